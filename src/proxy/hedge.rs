//! Hedging a late first token (`hedge:`): when a streamed request's first attempt has
//! produced no body byte (its first token) `hedge.after_ms` after it was sent, the same
//! request goes to the next-best worker too; the first of the two to produce a byte
//! wins, and the other's connection is closed at once (its engine aborts the request).
//!
//! At most one hedge per request (its first attempt), and at most `hedge.max_share` of
//! the streamed requests: each one adds that share to a budget a hedge spends whole
//! ([`Hedging`]). Only streamed chat and completions requests are hedged (a
//! non-streamed answer's first byte is its end), and not LoRA adapter requests (the
//! second worker may need the adapter loaded first). With flow control on, only the
//! classes of `hedge.classes` are hedged, and never a request `priority.preempt` may
//! cancel (it gives way to urgent work; a hedge would take a second slot). The answer's
//! headers wait for its first byte while a hedge may still start: engines send their
//! headers at once and their first event with the first token.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use http::Response;

use super::Router;
use super::forward::{Attempt, Leg, Route};
use crate::config::{HedgeConfig, PriorityConfig};
use crate::error::ProxyError;
use crate::policy::Pick;
use crate::pools::pool::{InFlightGuard, WorkerId};
use crate::upstream::UpstreamBody;

/// One attempt's answer, and whether it was a push-back (as `Router::send` returns it).
pub(super) type Sent = (Result<Response<UpstreamBody>, ProxyError>, bool);

/// Most hedges saved up by quiet time, in whole hedges.
const BURST: u64 = 10;
/// Budget units per hedge.
const UNIT: u64 = 1_000_000;

/// The process's hedging: its delay and the budget `hedge.max_share` fills.
#[derive(Debug)]
pub struct Hedging {
    after: Duration,
    /// Hedges that may start now, in millionths.
    budget: AtomicU64,
    /// What each streamed request adds to it (`max_share`, in millionths).
    per_request: u64,
    /// Per priority class, whether it is hedged (`hedge.classes`); empty with flow
    /// control off: every request may be.
    classes: Vec<bool>,
}

impl Hedging {
    /// `hedge:` when on (`after_ms` set); `priority`: the classes, when flow control is
    /// on.
    pub fn new(cfg: &HedgeConfig, priority: Option<&PriorityConfig>) -> Option<Self> {
        let classes = priority.map_or_else(Vec::new, |p| {
            p.classes.iter().map(|c| cfg.classes.contains(c)).collect()
        });
        Some(Hedging {
            after: cfg.after?,
            budget: AtomicU64::new(0),
            per_request: (cfg.max_share * UNIT as f64).round() as u64,
            classes,
        })
    }

    /// Whether requests of `class` may be hedged.
    fn hedges(&self, class: u8) -> bool {
        self.classes.is_empty() || self.classes.get(class as usize) == Some(&true)
    }

    /// A request that may be hedged: its share goes to the budget. Relaxed: a counter,
    /// nothing is published through it.
    fn credit(&self) {
        let _ = self
            .budget
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                Some((b + self.per_request).min(BURST * UNIT))
            });
    }

    /// Takes one hedge from the budget; false when it holds less than one.
    fn spend(&self) -> bool {
        self.budget
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                b.checked_sub(UNIT)
            })
            .is_ok()
    }
}

/// How a hedged attempt went, besides its answer.
#[derive(Debug, Default)]
pub(super) struct Hedged {
    /// The second worker won: its pick (its slot replaced the first's).
    pub swapped: Option<Pick>,
    /// The second worker tried (not to be tried again by a retry).
    pub tried: Option<WorkerId>,
    /// `won`, `lost` or `failed`, when a hedge was sent.
    pub outcome: Option<&'static str>,
}

/// Which leg answered first.
enum First {
    Original(Sent),
    Hedge(Sent, InFlightGuard),
    /// Neither answered: the first's answer (the retry logic takes it).
    Neither(Sent),
}

impl Router {
    /// The delay after which attempt `attempt` of `route` is hedged, when it may be.
    pub(super) fn hedge_after(&self, attempt: u32, route: &Route<'_>) -> Option<Duration> {
        let h = self.hedging.as_ref()?;
        let streamed = route.resume.is_some() && route.pd.is_none();
        let class = route.ticket.class;
        if attempt > 0
            || !streamed
            || route.req.adapter.is_some()
            || !h.hedges(class)
            || self.flow.admission().is_preemptible(class)
        {
            return None;
        }
        h.credit();
        Some(h.after)
    }

    /// Attempt `watch` of `leg.route` on the worker `guard` holds a slot on, hedged
    /// after `after` (see the module docs). When the hedge wins, `guard` is its slot.
    pub(super) async fn send_hedged(
        &self,
        after: Duration,
        watch: Attempt<'_>,
        leg: Leg<'_, '_>,
        guard: &mut InFlightGuard,
    ) -> (Sent, Hedged) {
        let deadline = tokio::time::Instant::now() + after;
        let first = guard.worker().id();
        let (first_answer, hedge) = {
            let send = self.send(watch, leg.base, leg.body, &leg.route.id, guard, leg.wait);
            tokio::pin!(send);
            // Its headers, then its first byte, each before the deadline.
            let got = tokio::select! {
                sent = &mut send => Some(sent),
                _ = tokio::time::sleep_until(deadline) => None,
            };
            let got = match got {
                Some(mut sent) => {
                    let answered = match &mut sent.0 {
                        Ok(resp) if resp.status().is_success() => tokio::select! {
                            _ = resp.body_mut().first() => true,
                            _ = tokio::time::sleep_until(deadline) => false,
                        },
                        _ => true,
                    };
                    if answered {
                        return (sent, Hedged::default());
                    }
                    Some(sent)
                }
                None => None,
            };
            let Some((pick, hedge_guard)) = self.hedge_pick(&leg, first) else {
                let sent = match got {
                    Some(s) => s,
                    None => send.await,
                };
                return (sent, Hedged::default());
            };
            let original = async {
                let sent = match got {
                    Some(s) => s,
                    None => send.await,
                };
                first_byte(sent).await
            };
            let won = self.race(original, &pick, hedge_guard, &leg).await;
            (won, pick)
        };
        let mut hedged = Hedged {
            tried: hedge.worker,
            ..Hedged::default()
        };
        let (sent, outcome) = match first_answer {
            First::Original(s) => (s, "lost"),
            First::Neither(s) => (s, "failed"),
            First::Hedge(s, g) => {
                *guard = g;
                hedged.swapped = Some(hedge);
                (s, "won")
            }
        };
        self.metrics.streams().hedged(outcome);
        hedged.outcome = Some(outcome);
        tracing::info!(request_id = ?leg.route.id.request_id, outcome, "late first token hedged on a second worker");
        (sent, hedged)
    }

    /// The hedge's worker and slot: the next-best usable worker, the first excluded,
    /// when the budget allows one (counted `capped` or `no_worker` when not).
    fn hedge_pick(&self, leg: &Leg<'_, '_>, first: WorkerId) -> Option<(Pick, InFlightGuard)> {
        let Some(h) = self.hedging.as_ref().filter(|h| h.spend()) else {
            self.metrics.streams().hedged("capped");
            return None;
        };
        let mut tried = leg.tried.clone();
        tried.insert(first);
        let picked = self.pick(leg.set, leg.route, &tried);
        if picked.is_none() {
            // Unspent: give it back.
            h.budget.fetch_add(UNIT, Ordering::Relaxed);
            self.metrics.streams().hedged("no_worker");
        }
        picked
    }

    /// The first attempt (`original`, its first byte) against the hedge on `guard`'s
    /// worker: the first to answer wins; the other is dropped, closing its connection.
    async fn race(
        &self,
        original: impl std::future::Future<Output = Sent>,
        pick: &Pick,
        guard: InFlightGuard,
        leg: &Leg<'_, '_>,
    ) -> First {
        let hedge = async {
            let mut guard = guard;
            let worker = Arc::clone(guard.worker());
            let watch = Attempt {
                policy: &**leg.route.policy,
                req: &leg.route.req,
                pick,
                worker: &worker,
                done: false,
            };
            let sent = self
                .send(
                    watch,
                    leg.base,
                    leg.body,
                    &leg.route.id,
                    &mut guard,
                    leg.wait,
                )
                .await;
            (first_byte(sent).await, guard)
        };
        tokio::pin!(original, hedge);
        let (mut original_failed, mut hedge_failed) = (None, false);
        loop {
            tokio::select! {
                sent = &mut original, if original_failed.is_none() => {
                    if answered(&sent) {
                        return First::Original(sent);
                    }
                    original_failed = Some(sent);
                }
                (sent, guard) = &mut hedge, if !hedge_failed => {
                    if answered(&sent) {
                        return First::Hedge(sent, guard);
                    }
                    hedge_failed = true;
                }
            }
            if hedge_failed && let Some(sent) = original_failed.take() {
                return First::Neither(sent);
            }
        }
    }
}

/// `sent` once its body's first byte (or end) came, when it is a 2xx answer.
async fn first_byte(mut sent: Sent) -> Sent {
    if let Ok(resp) = &mut sent.0
        && resp.status().is_success()
    {
        resp.body_mut().first().await;
    }
    sent
}

/// Whether a leg answered: a 2xx (its first byte read). A push-back or an error lets
/// the other leg answer.
fn answered(sent: &Sent) -> bool {
    matches!(&sent.0, Ok(r) if r.status().is_success()) && !sent.1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_allows_max_share_of_the_requests_with_a_small_burst() {
        let cfg = |after_ms: Option<u64>, max_share| HedgeConfig {
            after: after_ms.map(Duration::from_millis),
            max_share,
            ..HedgeConfig::default()
        };
        assert!(
            Hedging::new(&cfg(None, 0.5), None).is_none(),
            "off without after_ms"
        );
        let h = Hedging::new(&cfg(Some(100), 0.05), None).unwrap();
        let mut hedged = 0;
        for _ in 0..1000 {
            h.credit();
            hedged += usize::from(h.spend());
        }
        assert_eq!(hedged, 50, "5 % of 1000");
        // Quiet time saves at most BURST hedges.
        for _ in 0..10_000 {
            h.credit();
        }
        let burst = (0..100).filter(|_| h.spend()).count();
        assert_eq!(burst as u64, BURST);
        let none = Hedging::new(&cfg(Some(100), 0.0), None).unwrap();
        none.credit();
        assert!(!none.spend());
    }
}

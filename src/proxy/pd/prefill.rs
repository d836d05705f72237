//! The prefill leg: attempts on the prefill side until one answers, each picked by the
//! prefill leg's policy (which records the prompt for the worker that served it), its
//! breaker and in-flight slot its own; the slot ends when the answer has been read.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::Response;
use http_body_util::BodyExt;

use super::nixl;
use super::trail::PrefillDone;
use crate::error::ProxyError;
use crate::pools::pool::WorkerSet;
use crate::proxy::access_log::AccessLog;
use crate::proxy::forward::{Attempt, Route};
use crate::proxy::metrics::pd::{PdMetrics, failure_cause};
use crate::proxy::retry::Retries;
use crate::proxy::usage::{MAX_JSON_BYTES, UsageScanner};
use crate::proxy::{ProxyBody, Router};
use crate::tree::WorkerMask;
use crate::upstream::{RequestTemplate, UpstreamBody};

/// How the prefill leg ended.
pub(super) enum Prefilled<'m> {
    /// A worker answered with a hand-off (`params`, as written); the client leaving
    /// before the decode leg starts is counted (`between`).
    Handoff {
        params: Bytes,
        done: PrefillDone,
        between: BetweenLegs<'m>,
    },
    /// A worker answered 2xx without one.
    Nothing { done: PrefillDone },
    /// A worker answered a 4xx: the client's answer (no decode leg).
    Answer(Response<ProxyBody>),
    /// No prefill worker was usable.
    NoWorker,
    /// Every attempt failed; the last failure.
    Failed(String),
}

/// Counts a client gone between the legs: armed when a prefill worker answered 2xx (its
/// KV is held for the decode worker from then), disarmed when the decode leg starts.
pub(super) struct BetweenLegs<'m> {
    metrics: &'m PdMetrics,
    armed: bool,
}

impl BetweenLegs<'_> {
    pub(super) fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for BetweenLegs<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.metrics.abort_between_legs();
            tracing::info!(
                "client gone between the legs: the prefill worker holds the prompt's KV until its lease expires"
            );
        }
    }
}

impl Router {
    /// The prefill leg of `route` (its policy is the prefill leg's) on `set`: `body` to
    /// one prefill worker after another, within `proxy.max_retries` and the request's
    /// time, until one answers a 2xx (read whole) or a 4xx. Connection errors, time-outs
    /// and 5xx try another worker.
    pub(super) async fn prefill_leg<'m>(
        &'m self,
        set: &WorkerSet,
        base: &RequestTemplate,
        body: Bytes,
        route: &Route<'_>,
        waiting_on: &mut Option<Arc<str>>,
    ) -> Prefilled<'m> {
        let pd = self.metrics.pd();
        let mut retries = Retries::new(&self.config.proxy, route.id.arrived);
        let mut tried = WorkerMask::default();
        let mut last = String::new();
        for attempt in 0..=retries.max() {
            if attempt > 0 {
                let unsaturated = || self.any_unsaturated(set, &tried);
                let Some(backoff) = retries.backoff_before(attempt, unsaturated) else {
                    break;
                };
                tokio::time::sleep(backoff).await;
            }
            let started = Instant::now();
            let Some((pick, mut guard)) = self.pick(set, route, &tried) else {
                break;
            };
            let worker = Arc::clone(guard.worker());
            tried.insert(worker.id());
            *waiting_on = Some(Arc::clone(worker.label()));
            let decision = self.decided(&pick, &worker, started, attempt, true);
            let watch = Attempt {
                policy: &**route.policy,
                req: &route.req,
                pick: &pick,
                worker: &worker,
                done: false,
            };
            let wait = retries.attempt_wait();
            let sent = Instant::now();
            let (result, pushed_back) = self
                .send(watch, base, &body, &route.id, &mut guard, wait)
                .await;
            let cause = failure_cause(&result);
            if let Some(cause) = cause {
                pd.leg_failure("prefill", cause);
            }
            let resp = match result {
                Err(e) => {
                    last = format!("{}: {}", worker.url(), crate::error::Chain(&e));
                    if !retries.failed(attempt, e, &worker, route.id.request_id) {
                        break;
                    }
                    continue;
                }
                Ok(resp) => resp,
            };
            let status = resp.status();
            if status.is_client_error() && !pushed_back {
                // The request itself is at fault: another worker would say the same.
                let log = AccessLog::new(&route.id, &worker, decision, status.as_u16());
                return Prefilled::Answer(self.respond(resp, guard, log, route));
            }
            if !status.is_success() {
                last = format!("{} answered {status}", worker.url());
                tracing::warn!(request_id = ?route.id.request_id, worker = %worker.url(), status = status.as_u16(), "prefill leg failed; trying another prefill worker");
                continue;
            }
            guard.first_byte();
            let between = BetweenLegs {
                metrics: pd,
                armed: true,
            };
            let answer = match read_whole(resp, retries.attempt_wait()).await {
                Ok(a) => a,
                Err(why) => {
                    pd.leg_failure("prefill", "upstream");
                    let mut between = between;
                    between.armed = false;
                    last = format!("{}: {why}", worker.url());
                    tracing::warn!(request_id = ?route.id.request_id, worker = %worker.url(), error = %why, "prefill answer unreadable; trying another prefill worker");
                    continue;
                }
            };
            pd.prefill_took(sent.elapsed().as_secs_f64());
            let cached_tokens = self.prefill_usage(&guard, &pick, route, &answer);
            let done = PrefillDone {
                worker: Arc::clone(worker.label()),
                took: sent.elapsed(),
                cached_tokens,
            };
            return match nixl::handed_on(&answer.1) {
                Some(params) => Prefilled::Handoff {
                    params,
                    done,
                    between,
                },
                None => {
                    let mut between = between;
                    between.armed = false;
                    Prefilled::Nothing { done }
                }
            };
        }
        if tried.is_empty() {
            Prefilled::NoWorker
        } else {
            Prefilled::Failed(last)
        }
    }

    /// What the prefill answer's usage tells: the worker's engine usage counted, its
    /// tokens per byte learned, what it delivered of the pick's prediction told to the
    /// prefill policy. Returns its cached tokens, when it names them.
    fn prefill_usage(
        &self,
        guard: &crate::pools::pool::InFlightGuard,
        pick: &crate::policy::Pick,
        route: &Route<'_>,
        (headers, body): &(http::HeaderMap, Bytes),
    ) -> Option<u64> {
        let mut scanner = UsageScanner::for_response(headers, false)?;
        scanner.feed_bytes(body);
        let usage = scanner.finish()?;
        let worker = guard.worker();
        self.metrics.engine_usage(
            worker.label(),
            usage.prompt_tokens,
            usage.cached_tokens.unwrap_or(0),
        );
        let (delivered, delivery) = crate::policy::decide::settle_usage(
            guard,
            usage.prompt_tokens,
            usage.cached_tokens,
            false,
            (pick.saved_tokens(), pick.mark),
            self.config.cache.engine_block_tokens as u64,
        );
        // Every marked answer, short or not (the tree's doubts clear on a delivering
        // one), and precise mode's keyed blocks: the prefill worker's cache is where
        // the prediction was.
        let keyed = matches!(
            route.req.prepared,
            crate::policy::Prepared::Blocks(crate::precise::Lookup::Blocks { .. })
        );
        if delivery.is_some() || keyed {
            let answer = crate::policy::Answer {
                delivery,
                prepared: keyed.then_some(&route.req.prepared),
                delivered_tokens: delivered,
                ..Default::default()
            };
            route.policy.answered(worker, &answer);
        }
        usage.cached_tokens
    }
}

/// The answer's headers and whole body (at most [`MAX_JSON_BYTES`]), within `wait`.
async fn read_whole(
    resp: Response<UpstreamBody>,
    wait: std::time::Duration,
) -> Result<(http::HeaderMap, Bytes), String> {
    let (parts, body) = resp.into_parts();
    let read = http_body_util::Limited::new(body, MAX_JSON_BYTES).collect();
    match tokio::time::timeout(wait, read).await {
        Err(_) => Err(ProxyError::Timeout(wait.as_secs_f64()).to_string()),
        Ok(Err(e)) => Err(crate::error::describe(&*e)),
        Ok(Ok(c)) => Ok((parts.headers, c.to_bytes())),
    }
}

//! The queueing model: admission (`max_waiting`), the prefill queue under each
//! [`Physics`] (the chunked one's batch is `steps`), a hand-off's KV read, the
//! prefix-cache lookup that sets a prefill's cost, the clock a request's tokens follow,
//! and simulated time scaled to wall time. Never spins the CPU: every wait is a tokio
//! timer.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use super::{Engine, GaugeGuard, Physics, Waiting};

/// Seed of the body hash that picks the stalled requests.
const STALL_SEED: u64 = 0x0073_7461_6c6c; // "stall"

/// A prompt reduced to what the simulation needs.
#[derive(Debug)]
pub(super) struct PromptWork {
    pub(super) n_tokens: usize,
    pub(super) hashes: Vec<u64>,
    /// Leading tokens whose KV a prefill engine hands over (0: none; see `nixl`).
    pub(super) received: u64,
}

/// A request whose prompts are computed (or being computed, under the chunked
/// physics): what its usage reports as cached, and the clock its tokens follow.
pub(super) struct Started<'a> {
    /// Cached tokens per prompt.
    pub(super) cached: Vec<u64>,
    clock: Clock,
    engine: &'a Engine,
    /// Nominal time of its last token (for the engine's inter-token latency).
    last: Option<Instant>,
    /// Counts the request as running (the chunked physics' batch counts its own).
    _running: Option<GaugeGuard<'a>>,
}

enum Clock {
    /// The serial, parallel and shared physics: the first token at the end of the
    /// prefill, then one every `itl` (wall time).
    Timer { due: Instant, itl: Duration },
    /// The chunked physics: each token at the end of a step of the batch.
    Steps(mpsc::UnboundedReceiver<Instant>),
}

impl Started<'_> {
    /// Waits for the next token; false when none will come.
    pub(super) async fn next_token(&mut self) -> bool {
        let at = match &mut self.clock {
            Clock::Timer { due, itl } => {
                let at = *due;
                wait_until(at).await;
                *due += *itl;
                at
            }
            Clock::Steps(rx) => match rx.recv().await {
                Some(at) => at,
                None => return false,
            },
        };
        let factor = self.engine.inner.cfg.time_factor;
        if let Some(last) = self.last.replace(at)
            && factor > 0.0
        {
            let gap = at.saturating_duration_since(last).as_secs_f64() / factor;
            self.engine.inner.counters.itl.record(gap);
        }
        true
    }

    /// Holds its first token back `d` more (none taken yet), with what is sent before
    /// it (a chat's role chunk): under the timer every token after it moves too; under
    /// the chunked physics the batch goes on, and the tokens it made meanwhile follow
    /// at once.
    async fn hold_first_token(&mut self, d: Duration) {
        let until = match &mut self.clock {
            Clock::Timer { due, .. } => {
                *due += d;
                *due
            }
            Clock::Steps(_) => Instant::now() + d,
        };
        wait_until(until).await;
    }

    /// Waits for the last of `n` tokens (none taken yet); false when it will not come.
    pub(super) async fn last_token(&mut self, n: u64) -> bool {
        if let Clock::Timer { due, itl } = &mut self.clock {
            let rest = u32::try_from(n.saturating_sub(1)).unwrap_or(u32::MAX);
            *due += itl.saturating_mul(rest);
            return self.next_token().await;
        }
        for _ in 0..n {
            if !self.next_token().await {
                return false;
            }
        }
        true
    }
}

/// Outcome of prefill: when it ends (nominal), cached tokens per prompt.
struct Prefilled {
    end: Instant,
    pub(super) cached: Vec<u64>,
}

impl Engine {
    /// `secs` of simulated time as wall time: × `time_factor`, capped at one day
    /// so no timer or `Instant` arithmetic can overflow.
    pub(super) fn scaled_secs(&self, secs: f64) -> Duration {
        let wall = (secs * self.inner.cfg.time_factor).clamp(0.0, 86_400.0);
        Duration::try_from_secs_f64(wall).unwrap_or(Duration::ZERO)
    }

    /// Admits one request to the prefill queue (`waiting` + 1, peak updated), or
    /// `None` when `max_waiting` requests already wait (counted as rejected).
    pub(super) fn admit(&self) -> Option<Waiting> {
        let c = &self.inner.counters;
        let max = self.inner.cfg.max_waiting as u64;
        let before = c
            .waiting
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |w| {
                (max == 0 || w < max).then_some(w + 1)
            });
        match before {
            Ok(w) => {
                c.waiting_peak.fetch_max(w + 1, Ordering::Relaxed);
                Some(Waiting(self.inner.clone()))
            }
            Err(_) => {
                c.rejected.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    /// Runs a request up to its first token's clock: a hand-off's KV read
    /// ([`Self::receive_kv`]), then the prefill under the engine's physics (the chunked
    /// one puts it into the batch, after `ttft_base` off the accelerator: the API
    /// server's part). `n` tokens follow.
    pub(super) async fn start(
        &self,
        work: &[PromptWork],
        arrival: Instant,
        waiting: Waiting,
        n: u64,
    ) -> Started<'_> {
        let cfg = &self.inner.cfg;
        if cfg.prefill_physics == Physics::Chunked {
            wait_until(arrival + self.scaled_secs(cfg.ttft_base.as_secs_f64())).await;
            self.receive_kv(work).await;
            let (uncached, cached) = self.look_up_tokens(work);
            let rx = self.join_batch(uncached, work.len() as u64, n, waiting);
            return Started {
                cached,
                clock: Clock::Steps(rx),
                engine: self,
                last: None,
                _running: None,
            };
        }
        // A prefill queued behind a KV read starts no earlier than its end.
        let arrival = if self.receive_kv(work).await {
            Instant::now()
        } else {
            arrival
        };
        let (pre, running) = self.prefill(work, arrival, waiting).await;
        Started {
            cached: pre.cached,
            clock: Clock::Timer {
                due: pre.end,
                itl: self.scaled_secs(cfg.itl.as_secs_f64()),
            },
            engine: self,
            last: None,
            _running: Some(running),
        }
    }

    /// Reads the KV a prefill engine hands over for `work`'s prompts, the blocks not
    /// held here: waits `kv_transfer_base + kv_transfer_per_token × tokens` (still
    /// counted as waiting, as vLLM's `WAITING_FOR_REMOTE_KVS`). False when nothing is
    /// handed over.
    async fn receive_kv(&self, work: &[PromptWork]) -> bool {
        if work.iter().all(|p| p.received == 0) {
            return false;
        }
        let pulled: u64 = {
            let cache = self.lock_cache();
            work.iter()
                .map(|p| {
                    let held = cache.cached_tokens(&p.hashes, p.n_tokens) as u64;
                    p.received.saturating_sub(held)
                })
                .sum()
        };
        let c = &self.inner.counters;
        c.kv_handoffs_received.fetch_add(1, Ordering::Relaxed);
        c.kv_transferred_tokens.fetch_add(pulled, Ordering::Relaxed);
        let cfg = &self.inner.cfg;
        let secs = cfg.kv_transfer_base.as_secs_f64()
            + cfg.kv_transfer_per_token.as_secs_f64() * pulled as f64;
        wait_until(Instant::now() + self.scaled_secs(secs)).await;
        true
    }

    /// Queues for the prefill slot (counted in `waiting` by the admitted
    /// `waiting` until the slot is held), looks the prompts up in the cache and
    /// waits out the prefill. The returned guard keeps the request counted as
    /// running.
    async fn prefill(
        &self,
        work: &[PromptWork],
        arrival: Instant,
        waiting: Waiting,
    ) -> (Prefilled, GaugeGuard<'_>) {
        let c = &self.inner.counters;
        let physics = self.inner.cfg.prefill_physics;
        if physics != Physics::Serial {
            return self.prefill_in_slot(work, waiting).await;
        }
        let mut last_end = self.inner.prefill.lock().await;
        drop(waiting);
        let running = GaugeGuard::new(&c.running);
        let cost = self.look_up(work);
        // A single-server FIFO queue: start when both the request and the server
        // are there. Using nominal times keeps timer overshoot from accumulating.
        let start = arrival.max(*last_end);
        let end = start + cost.0;
        *last_end = end;
        wait_until(end).await;
        drop(last_end);
        (
            Prefilled {
                end,
                cached: cost.1,
            },
            running,
        )
    }

    /// The parallel and shared physics: waits for one of the prefill slots (FIFO),
    /// then prefills at full speed or at its share of it.
    async fn prefill_in_slot(
        &self,
        work: &[PromptWork],
        waiting: Waiting,
    ) -> (Prefilled, GaugeGuard<'_>) {
        let c = &self.inner.counters;
        // Never closed: the engine owns it.
        let slot = self.inner.slots.acquire().await.ok();
        drop(waiting);
        let running = GaugeGuard::new(&c.running);
        let (cost, cached) = self.look_up(work);
        let end = if self.inner.cfg.prefill_physics == Physics::Shared {
            self.inner.shared.run(cost).await
        } else {
            let end = Instant::now() + cost;
            wait_until(end).await;
            end
        };
        drop(slot);
        (Prefilled { end, cached }, running)
    }

    /// Looks the prompts up in the cache (inserting them), counts them, and returns the
    /// prefill's duration at full speed and the cached tokens per prompt.
    fn look_up(&self, work: &[PromptWork]) -> (Duration, Vec<u64>) {
        let (uncached, cached) = self.look_up_tokens(work);
        let cfg = &self.inner.cfg;
        let cost = self.scaled_secs(
            cfg.ttft_base.as_secs_f64() + cfg.prefill_per_token.as_secs_f64() * uncached as f64,
        );
        (cost, cached)
    }

    /// Looks the prompts up in the cache (inserting them) and counts them: the prompt
    /// tokens to compute, and the cached tokens per prompt (the prefix cache's, or the
    /// KV handed over when that is more).
    fn look_up_tokens(&self, work: &[PromptWork]) -> (u64, Vec<u64>) {
        let c = &self.inner.counters;
        let (hits, cached): (u64, Vec<u64>) = {
            let mut cache = self.lock_cache();
            let local: Vec<u64> = work
                .iter()
                .map(|p| cache.lookup_and_insert(&p.hashes, p.n_tokens) as u64)
                .collect();
            let cached = local
                .iter()
                .zip(work)
                .map(|(l, p)| (*l).max(p.received))
                .collect();
            (local.iter().sum(), cached)
        };
        let total: u64 = work.iter().map(|p| p.n_tokens as u64).sum();
        let uncached = total.saturating_sub(cached.iter().sum());
        c.prompt_tokens.fetch_add(total, Ordering::Relaxed);
        c.cache_queries.fetch_add(total, Ordering::Relaxed);
        c.cache_hits.fetch_add(hits, Ordering::Relaxed);
        c.prefill_tokens_computed
            .fetch_add(uncached, Ordering::Relaxed);
        (uncached, cached)
    }

    /// Whether the request with this body stalls: a hash of the body, read as a
    /// fraction of 1, below `stall_share` (so the same body always does or never does).
    pub(super) fn stalls(&self, body: &[u8]) -> bool {
        let cfg = &self.inner.cfg;
        if cfg.stall_share <= 0.0 || cfg.stall_first_token.is_zero() {
            return false;
        }
        let h = xxhash_rust::xxh3::xxh3_64_with_seed(body, STALL_SEED);
        ((h >> 11) as f64 / (1u64 << 53) as f64) < cfg.stall_share
    }

    /// Holds a stalled request's first token back `stall_first_token` past its clock
    /// (see [`Started::hold_first_token`]), outside the prefill queue.
    pub(super) async fn stall_first_token(&self, started: &mut Started<'_>, stalled: bool) {
        if !stalled {
            return;
        }
        self.inner.counters.stalled.fetch_add(1, Ordering::Relaxed);
        let d = self.scaled_secs(self.inner.cfg.stall_first_token.as_secs_f64());
        started.hold_first_token(d).await;
    }

    pub(super) fn finish(&self, work: &[PromptWork], n: u64) {
        let c = &self.inner.counters;
        c.generation_tokens
            .fetch_add(n * work.len() as u64, Ordering::Relaxed);
        c.requests_finished.fetch_add(1, Ordering::Relaxed);
    }
}

/// Sleeps until `deadline`, or not at all when it has passed. tokio's timer
/// rounds deadlines up to the next millisecond tick, so sleeping until "now" would
/// cost up to a millisecond per call: at `time_factor` 0 that would turn an instant
/// answer into a ~1 ms one, and make the prefill lock (held across the sleep) a
/// one-request-per-tick queue.
pub(super) async fn wait_until(deadline: Instant) {
    if deadline > Instant::now() {
        tokio::time::sleep_until(deadline).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::EngineConfig;

    #[test]
    fn stall_share_picks_that_share_of_bodies_the_same_way_each_time() {
        let e = Engine::new(EngineConfig {
            stall_first_token: Duration::from_secs(2),
            stall_share: 0.05,
            ..EngineConfig::default()
        })
        .unwrap();
        let bodies: Vec<String> = (0..4000).map(|i| format!("{{\"i\":{i}}}")).collect();
        let stalled: Vec<bool> = bodies.iter().map(|b| e.stalls(b.as_bytes())).collect();
        let n = stalled.iter().filter(|&&s| s).count();
        assert!((140..260).contains(&n), "{n} of 4000 at 5 %");
        let again: Vec<bool> = bodies.iter().map(|b| e.stalls(b.as_bytes())).collect();
        assert_eq!(stalled, again);
        // No stall without a duration.
        let off = Engine::new(EngineConfig {
            stall_share: 1.0,
            ..EngineConfig::default()
        })
        .unwrap();
        assert!(!off.stalls(b"{}"));
    }

    #[test]
    fn admission_stops_at_max_waiting_and_tracks_the_peak() {
        let e = Engine::new(EngineConfig {
            max_waiting: 2,
            ..EngineConfig::default()
        })
        .unwrap();
        let a = e.admit().expect("first admitted");
        let b = e.admit().expect("second admitted");
        assert!(e.admit().is_none(), "third finds 2 waiting");
        let s = e.stats();
        assert_eq!((s.waiting, s.waiting_peak, s.rejected), (2, 2, 1));
        drop(a);
        let c = e.admit().expect("room again");
        drop((b, c));
        let s = e.stats();
        assert_eq!((s.waiting, s.waiting_peak, s.rejected), (0, 2, 1));
        // 0 = unbounded.
        let u = Engine::new(EngineConfig::default()).unwrap();
        let held: Vec<_> = (0..100).map(|_| u.admit().unwrap()).collect();
        assert_eq!(u.stats().waiting_peak, 100);
        drop(held);
        assert!(
            u.metrics_text()
                .contains("sim:num_requests_waiting_peak{engine=\"0\",model_name=\"m\"} 100\n")
        );
    }
}

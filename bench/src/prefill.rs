//! How a simulated engine's prefills share its accelerator: the engine *physics* a
//! routing policy must not assume. Real engines differ here (vLLM's chunked prefill
//! splits a per-step token budget among running prefills; other engines, GPUs and
//! batch limits run several at full speed, or one at a time), and a router tuned on one
//! of them can lose on the next.
//!
//! - [`Physics::Serial`]: one prefill at a time, FIFO (a compute-bound GPU; the
//!   engine's own code path, `engine::Engine`).
//! - [`Physics::Parallel`]: up to `slots` prefills at once, each at full speed; FIFO
//!   beyond.
//! - [`Physics::Shared`]: up to `slots` prefills at once, sharing one prefill
//!   throughput equally (processor sharing: each of `k` running prefills advances at
//!   1/`k` of full speed, as a per-step token budget split among them does); FIFO
//!   beyond.
//! - [`Physics::Chunked`]: vLLM's chunked prefill. One batch per step: a token of every
//!   decoding request, and prompt chunks in the rest of a token budget, oldest first; a
//!   step lasts the inter-token latency plus its prompt tokens' cost. So a prefill
//!   delays the next token of every request decoding on that engine, which the other
//!   physics do not model (their decodes run on their own clocks). The engine's own code
//!   path, `engine::steps`.
//!
//! [`SharedPrefill`] runs the shared physics on tokio timers with no task of its own:
//! each prefill waits for its own finish and recomputes it whenever another starts or
//! ends. Under processor sharing a job's *finish tag* (the service per job the system
//! has given when it ends, [`SharedPrefill::run`]) is fixed at its start; only how fast
//! that service is given depends on later arrivals.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

/// How an engine's prefills share it (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Physics {
    /// One at a time, FIFO.
    #[default]
    Serial,
    /// Up to `slots` at once, each at full speed.
    Parallel,
    /// Up to `slots` at once, sharing one full speed equally.
    Shared,
    /// Chunked into steps shared with the decoding requests (vLLM's chunked prefill).
    Chunked,
}

impl Physics {
    /// `serial`, `parallel` or `shared` (what [`std::str::FromStr`] reads).
    pub fn as_str(self) -> &'static str {
        match self {
            Physics::Serial => "serial",
            Physics::Parallel => "parallel",
            Physics::Shared => "shared",
            Physics::Chunked => "chunked",
        }
    }
}

impl std::fmt::Display for Physics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Physics {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "serial" => Ok(Physics::Serial),
            "parallel" => Ok(Physics::Parallel),
            "shared" => Ok(Physics::Shared),
            "chunked" => Ok(Physics::Chunked),
            _ => Err(format!(
                "unknown prefill physics {s:?}: use serial, parallel, shared or chunked"
            )),
        }
    }
}

/// Prefills sharing one throughput equally (processor sharing), on tokio timers.
#[derive(Debug, Default)]
pub struct SharedPrefill {
    state: Mutex<State>,
    /// Told when a prefill starts or ends: every running one's finish moves.
    changed: Notify,
}

#[derive(Debug, Default)]
struct State {
    /// Service given to each running prefill since the first, in seconds of full
    /// speed (the "virtual time").
    given: f64,
    /// When `given` was last brought up to date.
    at: Option<Instant>,
    /// Running prefills: (id, finish tag in `given` seconds).
    jobs: Vec<(u64, f64)>,
    next_id: u64,
}

impl State {
    /// Brings `given` up to `now` at the current share (1 / running prefills).
    fn advance(&mut self, now: Instant) {
        if let Some(at) = self.at
            && !self.jobs.is_empty()
        {
            self.given += (now - at).as_secs_f64() / self.jobs.len() as f64;
        }
        self.at = Some(now);
    }
}

/// Removes its prefill from the running ones when done or dropped (the client left).
struct Running<'a> {
    owner: &'a SharedPrefill,
    id: u64,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        let mut s = self.owner.lock();
        s.advance(Instant::now());
        s.jobs.retain(|(id, _)| *id != self.id);
        drop(s);
        self.owner.changed.notify_waiters();
    }
}

impl SharedPrefill {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs one prefill of `work` (its duration at full speed) alongside the others
    /// running, and returns when it ends.
    pub async fn run(&self, work: Duration) -> Instant {
        if work.is_zero() {
            return Instant::now();
        }
        let id = {
            let mut s = self.lock();
            s.advance(Instant::now());
            let (id, tag) = (s.next_id, s.given + work.as_secs_f64());
            s.next_id += 1;
            s.jobs.push((id, tag));
            id
        };
        self.changed.notify_waiters();
        let _running = Running { owner: self, id };
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            // Registered before the state is read: a change after it still wakes us.
            changed.as_mut().enable();
            let eta = {
                let mut s = self.lock();
                let now = Instant::now();
                s.advance(now);
                let tag = s.jobs.iter().find(|(j, _)| *j == id).map_or(0.0, |j| j.1);
                // Half a microsecond of service: timer and float slop.
                let left = tag - s.given;
                if left <= 5e-7 {
                    return now;
                }
                now + Duration::from_secs_f64(left * s.jobs.len() as f64)
            };
            tokio::select! {
                () = tokio::time::sleep_until(eta) => {}
                () = &mut changed => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    async fn finish_after(p: &Arc<SharedPrefill>, start_ms: u64, work_ms: u64) -> u64 {
        let t0 = Instant::now();
        tokio::time::sleep(Duration::from_millis(start_ms)).await;
        let end = p.run(Duration::from_millis(work_ms)).await;
        (end - t0).as_millis() as u64
    }

    #[tokio::test(start_paused = true)]
    async fn one_prefill_alone_runs_at_full_speed() {
        let p = Arc::new(SharedPrefill::default());
        assert_eq!(finish_after(&p, 0, 100).await, 100);
    }

    #[tokio::test(start_paused = true)]
    async fn prefills_share_the_speed_equally() {
        let p = Arc::new(SharedPrefill::default());
        // Two of 100 ms from 0: each at half speed, both end at 200 ms.
        // A third of 30 ms at 50 ms: from then three share; it gets 1/3 speed and
        // ends at 50 + 90 = 140 ms; the first two have had 25 + 30 = 55 ms of their
        // 100 by then, and finish the other 45 at half speed: 140 + 90 = 230 ms.
        let (a, b, c) = tokio::join!(
            finish_after(&p, 0, 100),
            finish_after(&p, 0, 100),
            finish_after(&p, 50, 30)
        );
        assert_eq!((a, b, c), (230, 230, 140));
    }

    #[tokio::test(start_paused = true)]
    async fn a_prefill_whose_client_left_stops_taking_a_share() {
        let p = Arc::new(SharedPrefill::default());
        let q = Arc::clone(&p);
        let gone = tokio::spawn(async move { q.run(Duration::from_millis(1000)).await });
        tokio::time::sleep(Duration::from_millis(10)).await;
        // 10 ms in: abandoned. The next one runs alone from then.
        gone.abort();
        let _ = gone.await;
        assert_eq!(finish_after(&p, 0, 100).await, 100);
    }
}

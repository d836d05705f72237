//! [`Store`]: where answers and semantic candidates live. In-process
//! ([`super::memory::MemoryStore`], the default) or Redis ([`super::redis::RedisStore`],
//! shared by every router replica that names the same URL and namespace).

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicU64};

use futures_util::future::BoxFuture;

use super::entry::Entry;
use super::key::Key;

/// One stored answer the semantic lookup may replay: its exact key and the unit-length
/// embedding of its conversation text.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    pub key: Key,
    pub vector: Arc<[f32]>,
}

/// A store that could not answer. Never reaches the client: the request goes to a
/// worker as if the cache were off.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// Down, refusing or slow: later requests skip the store for a while.
    #[error("{0}")]
    Unavailable(String),
    /// It answered with something that is not ours (a foreign or corrupt value).
    #[error("{0}")]
    Garbage(String),
}

/// What the in-process store holds now, for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    pub entries: u64,
    /// Weight held: stored bodies, content types and per-entry overhead.
    pub bytes: u64,
    /// Entries dropped to stay within `max_bytes`, since start (expiry is not counted).
    pub evictions: u64,
}

/// A response store. Every method is bounded in time by the store itself; entries
/// expire after the configured TTL.
pub trait Store: Send + Sync + 'static {
    /// The answer stored under `key`, if any.
    fn get<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<Entry>, StoreError>>;
    /// Stores `entry` under `key` (replacing any).
    fn put(&self, key: Key, entry: Entry) -> BoxFuture<'_, Result<(), StoreError>>;
    /// Up to `n` of the partition's most recent candidates, newest first.
    fn recent<'a>(
        &'a self,
        partition: &'a Key,
        n: usize,
    ) -> BoxFuture<'a, Result<Vec<Candidate>, StoreError>>;
    /// Adds a candidate to the partition, keeping its `keep` newest.
    fn remember(
        &self,
        partition: Key,
        candidate: Candidate,
        keep: usize,
    ) -> BoxFuture<'_, Result<(), StoreError>>;
    /// Entries and bytes held, where the store knows (in-process); `None` for Redis.
    fn stats(&self) -> Option<StoreStats>;
    /// In-process: every call completes at once (no I/O).
    fn is_local(&self) -> bool {
        false
    }
}

/// How long calls may wait on a store that answers nothing before later callers stop
/// joining them, in milliseconds: a healthy Redis answers in about a millisecond, so
/// a tenth of a second without a single answer while calls are out means it hangs.
pub const STALL_MS: u64 = 100;

/// Who may call a store that may be down, so that a dead or frozen store costs the
/// bound of one call about once per down window, not once per request.
///
/// - **Up**: every caller goes, unless calls are out and none has been answered for
///   [`STALL_MS`] (a store that stopped answering, not yet timed out): then later
///   callers skip it instead of queueing behind the stuck ones.
/// - **Down** (a call failed less than `down_ms` ago): every caller skips the store.
/// - **Probing** (after that, until a call is answered): one call at a time, the
///   probe; the others skip at once. An answer makes it up again, a failure down again.
///
/// Times are milliseconds on any clock the caller keeps (a parameter, so the rules
/// test without waiting). Lock-free; every field is a standalone atomic read or
/// updated on its own (`Relaxed`: a decision that sees a neighbour's update a moment
/// late lets one more call through or skips one more, nothing else depends on it).
#[derive(Debug)]
pub struct Gate {
    down_ms: u64,
    /// Until when every caller skips the store.
    down_until: AtomicU64,
    /// A call failed and none has been answered since: calls go one at a time.
    suspect: AtomicBool,
    /// The one call allowed while suspect is out.
    probing: AtomicBool,
    /// Calls out while up.
    out: AtomicU64,
    /// When the last answer came, or when a call went out with none out before it.
    progress: AtomicU64,
}

/// What a call's outcome says about the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// It answered (a value, an error reply, garbage): up.
    Answered,
    /// It failed or did not answer within the bound: down for a while.
    Failed,
    /// Nothing to conclude (a call whose slowness is not an outage).
    Unknown,
}

/// A call let through by [`Gate::enter`]; counts as out until dropped. Settle it with
/// [`Pass::settle`]; one dropped unsettled (its caller went away) concludes nothing.
#[derive(Debug)]
pub struct Pass<'a> {
    gate: &'a Gate,
    probe: bool,
}

impl Gate {
    /// A gate that keeps callers off for `down` after a failure.
    pub fn new(down: std::time::Duration) -> Self {
        Gate {
            down_ms: down.as_millis() as u64,
            down_until: AtomicU64::new(0),
            suspect: AtomicBool::new(false),
            probing: AtomicBool::new(false),
            out: AtomicU64::new(0),
            progress: AtomicU64::new(0),
        }
    }

    /// Whether a caller at `now` may call the store (see the type's docs); `None` =
    /// skip it.
    pub fn enter(&self, now: u64) -> Option<Pass<'_>> {
        if now < self.down_until.load(Relaxed) {
            return None;
        }
        if self.suspect.load(Relaxed) {
            return self
                .probing
                .compare_exchange(false, true, Relaxed, Relaxed)
                .is_ok()
                // Lazily: a pass built and dropped would free the probe's slot.
                .then(|| Pass {
                    gate: self,
                    probe: true,
                });
        }
        if self.out.load(Relaxed) > 0 && now.saturating_sub(self.progress.load(Relaxed)) >= STALL_MS
        {
            return None;
        }
        if self.out.fetch_add(1, Relaxed) == 0 {
            self.progress.fetch_max(now, Relaxed);
        }
        Some(Pass {
            gate: self,
            probe: false,
        })
    }

    /// Whether a caller at `now` would be kept off the store for a failure (down, or
    /// probing): for views; [`Gate::enter`] decides.
    pub fn is_down(&self, now: u64) -> bool {
        now < self.down_until.load(Relaxed) || self.suspect.load(Relaxed)
    }
}

impl Pass<'_> {
    /// Records what the call found at `now`.
    pub fn settle(self, now: u64, verdict: Verdict) {
        let g = self.gate;
        match verdict {
            Verdict::Answered => {
                g.progress.fetch_max(now, Relaxed);
                g.suspect.store(false, Relaxed);
            }
            Verdict::Failed => {
                g.down_until.fetch_max(now + g.down_ms, Relaxed);
                g.suspect.store(true, Relaxed);
            }
            Verdict::Unknown => {}
        }
    }
}

impl Drop for Pass<'_> {
    fn drop(&mut self) {
        if self.probe {
            self.gate.probing.store(false, Relaxed);
        } else {
            self.gate.out.fetch_sub(1, Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOWN: u64 = 1000;

    fn gate() -> Gate {
        Gate::new(std::time::Duration::from_millis(DOWN))
    }

    #[test]
    fn an_answering_store_lets_every_caller_through() {
        let g = gate();
        let a = g.enter(0).unwrap();
        let b = g.enter(5).unwrap();
        a.settle(50, Verdict::Answered);
        // Calls out, but answers keep coming: nobody is turned away.
        let c = g.enter(120).unwrap();
        b.settle(130, Verdict::Answered);
        let d = g.enter(200).unwrap();
        drop((c, d));
        // Idle for long, then a call: it goes.
        assert!(g.enter(10_000).is_some());
    }

    #[test]
    fn a_store_that_stops_answering_turns_later_callers_away_before_its_timeout() {
        let g = gate();
        let stuck = g.enter(1_000).unwrap();
        let joined = g.enter(1_000 + STALL_MS - 1).unwrap();
        assert!(g.enter(1_000 + STALL_MS).is_none(), "stalled: skip");
        assert!(g.enter(1_200).is_none());
        stuck.settle(1_250, Verdict::Failed);
        joined.settle(1_260, Verdict::Failed);
        assert!(g.is_down(1_300));
        assert!(g.enter(2_000).is_none(), "down for a second");
    }

    #[test]
    fn after_a_failure_one_probe_at_a_time_until_an_answer() {
        let g = gate();
        g.enter(0).unwrap().settle(250, Verdict::Failed);
        assert!(g.enter(1_249).is_none());
        let probe = g.enter(1_250).expect("the probe");
        assert!(g.enter(1_251).is_none(), "one probe at a time");
        assert!(g.enter(1_400).is_none());
        probe.settle(1_500, Verdict::Failed);
        assert!(g.enter(2_499).is_none(), "down again");
        let probe = g.enter(2_500).expect("the next probe");
        assert!(g.enter(2_501).is_none());
        probe.settle(2_502, Verdict::Answered);
        assert!(!g.is_down(2_503));
        let (a, b) = (g.enter(2_503).unwrap(), g.enter(2_504).unwrap());
        drop((a, b));
    }

    #[test]
    fn a_probe_dropped_or_inconclusive_frees_the_slot() {
        let g = gate();
        g.enter(0).unwrap().settle(0, Verdict::Failed);
        drop(g.enter(DOWN).expect("probe"));
        let probe = g
            .enter(DOWN + 1)
            .expect("a new probe once the first went away");
        probe.settle(DOWN + 2, Verdict::Unknown);
        assert!(g.is_down(DOWN + 3), "still unproven");
        assert!(g.enter(DOWN + 3).is_some());
        // And calls dropped while up are no longer out.
        let g = gate();
        drop(g.enter(0).unwrap());
        assert!(g.enter(STALL_MS * 10).is_some());
    }
}

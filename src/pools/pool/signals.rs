//! What a worker's engine last said about itself, as the background sources in
//! `crate::signals` wrote it, and the back-pressure it asked for. Read lock-free on the
//! request path; nothing here is ever awaited there.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;

/// An engine's load as its Prometheus endpoint reported it (sums over its DP ranks).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineLoad {
    /// Whose metric names were found.
    pub engine: EngineKind,
    /// Requests queued inside the engine, not yet scheduled (vLLM
    /// `vllm:num_requests_waiting`, SGLang `sglang:num_queue_reqs`).
    pub waiting: f64,
    /// Requests being prefilled or decoded (`vllm:num_requests_running`,
    /// `sglang:num_running_reqs`).
    pub running: f64,
    /// KV-cache usage, 0–1 (`vllm:kv_cache_usage_perc`, older `vllm:gpu_cache_usage_perc`,
    /// `sglang:token_usage`); the largest rank's when there are several.
    pub kv_usage: Option<f64>,
    /// Prefix-cache hit rate, 0–1: vLLM's `vllm:prefix_cache_hits_total` over
    /// `vllm:prefix_cache_queries_total` (tokens, since the engine started), SGLang's
    /// `sglang:cache_hit_rate`.
    pub prefix_hit_rate: Option<f64>,
    /// When the scrape was read.
    pub at: Instant,
}

/// Which engine's metric names a scrape carried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineKind {
    Vllm,
    Sglang,
}

impl EngineKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EngineKind::Vllm => "vllm",
            EngineKind::Sglang => "sglang",
        }
    }
}

/// An LMCache occupancy signal (`workers[].lmcache`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LmcacheSignal {
    /// Occupancy, clamped to 0–1.
    pub occupancy: f64,
    pub cache_available: bool,
    pub at: Instant,
}

/// How one kind of poll has gone, for `/workers` and `/metrics`.
#[derive(Debug, Default)]
pub struct PollCounts {
    /// Answers read.
    pub ok: AtomicU64,
    /// No answer, or a non-2xx one.
    pub failed: AtomicU64,
    /// An answer that carried nothing usable.
    pub unparsable: AtomicU64,
}

impl PollCounts {
    pub fn get(&self) -> (u64, u64, u64) {
        (
            self.ok.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
            self.unparsable.load(Ordering::Relaxed),
        )
    }
}

/// One worker's signal slots. `repr(C)`, its saturation deadline first: every decision
/// reads that of every worker, from the worker's first cache line (`Worker`'s layout).
#[derive(Debug, Default)]
#[repr(C)]
pub struct Signals {
    /// Saturated until this many ns past `clock::epoch` (0 = not saturated).
    saturated_until_ns: AtomicU64,
    engine: ArcSwapOption<EngineLoad>,
    lmcache: ArcSwapOption<LmcacheSignal>,
    /// Engine scrapes.
    pub scrapes: PollCounts,
    /// LMCache polls.
    pub lmcache_polls: PollCounts,
    /// Signals read while missing or stale (counted by the policy that read them).
    pub neutral_reads: AtomicU64,
    /// 429/503 answers that marked it saturated.
    pub back_pressure: AtomicU64,
}

impl Signals {
    /// Bytes at its start that a decision reads (the saturation deadline).
    #[cfg(test)]
    pub(super) const HOT_BYTES: usize = 8;

    /// The last good engine scrape, whatever its age.
    pub fn engine(&self) -> Option<Arc<EngineLoad>> {
        self.engine.load_full()
    }

    /// The last engine scrape if younger than `stale` at `now`.
    pub fn engine_fresh(&self, now: Instant, stale: Duration) -> Option<EngineLoad> {
        let g = self.engine.load();
        g.as_deref()
            .filter(|l| now.saturating_duration_since(l.at) <= stale)
            .copied()
    }

    pub fn set_engine(&self, load: EngineLoad) {
        self.engine.store(Some(Arc::new(load)));
    }

    pub fn lmcache(&self) -> Option<Arc<LmcacheSignal>> {
        self.lmcache.load_full()
    }

    /// The last LMCache signal if younger than `stale` at `now`.
    pub fn lmcache_fresh(&self, now: Instant, stale: Duration) -> Option<LmcacheSignal> {
        let g = self.lmcache.load();
        g.as_deref()
            .filter(|l| now.saturating_duration_since(l.at) <= stale)
            .copied()
    }

    pub fn set_lmcache(&self, s: LmcacheSignal) {
        self.lmcache.store(Some(Arc::new(s)));
    }

    /// Marks the worker saturated until `until` (a later deadline wins).
    pub fn saturate(&self, until: Instant) {
        let ns = crate::clock::nanos(until);
        self.saturated_until_ns.fetch_max(ns, Ordering::Relaxed);
        self.back_pressure.fetch_add(1, Ordering::Relaxed);
    }

    /// Whether the engine asked for no new requests until after `now`.
    #[inline]
    pub fn is_saturated(&self, now: Instant) -> bool {
        self.is_saturated_at(crate::clock::nanos(now))
    }

    /// [`Signals::is_saturated`] at `now_ns` ([`crate::clock::nanos`] of now), for a
    /// caller that asks many workers at one instant.
    #[inline]
    pub fn is_saturated_at(&self, now_ns: u64) -> bool {
        let until = self.saturated_until_ns.load(Ordering::Relaxed);
        until != 0 && now_ns < until
    }

    /// Seconds of saturation left at `now` (0 when none), for `/workers`.
    pub fn saturated_for(&self, now: Instant) -> f64 {
        let until = self.saturated_until_ns.load(Ordering::Relaxed);
        let now_ns = crate::clock::nanos(now);
        until.saturating_sub(now_ns) as f64 / 1e9
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_saturation_deadline_is_the_first_field() {
        assert_eq!(std::mem::offset_of!(Signals, saturated_until_ns), 0);
        assert_eq!(Signals::HOT_BYTES, std::mem::size_of::<AtomicU64>());
    }

    #[tokio::test(start_paused = true)]
    async fn saturation_expires_and_the_later_deadline_wins() {
        let s = Signals::default();
        let now = crate::clock::now();
        assert!(!s.is_saturated(now));
        s.saturate(now + Duration::from_secs(2));
        s.saturate(now + Duration::from_secs(1));
        assert!(s.is_saturated(now + Duration::from_millis(1500)));
        assert!(!s.is_saturated(now + Duration::from_millis(2001)));
        assert_eq!(s.back_pressure.load(Ordering::Relaxed), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn stale_signals_are_not_fresh() {
        let s = Signals::default();
        let now = crate::clock::now();
        assert!(s.engine_fresh(now, Duration::from_secs(5)).is_none());
        s.set_engine(EngineLoad {
            engine: EngineKind::Vllm,
            waiting: 3.0,
            running: 1.0,
            kv_usage: Some(0.5),
            prefix_hit_rate: None,
            at: now,
        });
        let stale = Duration::from_secs(5);
        assert_eq!(s.engine_fresh(now + stale, stale).unwrap().waiting, 3.0);
        assert!(s.engine_fresh(now + stale * 2, stale).is_none());
        assert!(s.engine().is_some());
    }
}

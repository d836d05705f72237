//! What a worker's answers say of the router's prefix memory: per answer that reported
//! usage, the *available* prefix (the longest any worker held), the *predicted* one (what
//! the router believed this worker held) and the *delivered* one (the engine's
//! `cached_tokens`), all in tokens; and the *drift*, delivered ÷ predicted over the last
//! [`DRIFT_WINDOW`] answers that predicted a hit.
//!
//! A drift that stays under the floor (`cache.drift_floor`) for `cache.drift_secs`
//! ([`DRIFT_FOR`] by default) means the
//! router's memory of this worker is wrong: the engine evicted what the tree still
//! believes (a KV cache smaller than assumed), a block-size mismatch, or tokenizer drift
//! in precise mode. [`HitStats::record`] says when to warn (once per that time).
//!
//! Engines name their cached tokens only when asked to and only when non-zero (see
//! `proxy::usage::Usage::cached_tokens`): an answer without the count is *delivered 0*
//! once the worker has named a count before, and not counted at all until then, so an
//! engine that never reports is not taken for one that evicted everything
//! ([`HitStats::delivered`]).

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

/// Answers with a predicted hit that the drift is computed over.
pub const DRIFT_WINDOW: usize = 100;
/// How long the drift must stay under the floor before a warning, and the least time
/// between two warnings, by default (`cache.drift_secs`).
pub const DRIFT_FOR: Duration = Duration::from_secs(60);
/// Answers with a predicted hit needed before the drift counts (fewer say nothing).
const DRIFT_MIN_ANSWERS: usize = 10;

/// Token totals of the answers that reported usage, and the drift window.
#[derive(Debug, Default)]
pub struct HitStats {
    pub answers: AtomicU64,
    pub available: AtomicU64,
    pub predicted: AtomicU64,
    pub delivered: AtomicU64,
    /// The worker's engine has named its cached tokens in an answer.
    reports_cached: AtomicBool,
    /// Answers that delivered far fewer tokens than predicted
    /// (`policy::Shortfall::of`): each told the tree how far back its engine evicts.
    pub shortfalls: AtomicU64,
    drift: Mutex<Drift>,
}

#[derive(Debug, Default)]
struct Drift {
    /// (predicted, delivered capped at predicted, delivered) of the last answers that
    /// predicted a hit.
    window: VecDeque<(u64, u64, u64)>,
    predicted: u64,
    delivered: u64,
    /// The window's delivered tokens, uncapped.
    delivered_all: u64,
    /// Since when the drift has been under the floor.
    low_since: Option<Instant>,
    warned: Option<Instant>,
}

/// The drift after an answer, and whether to warn now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DriftNow {
    /// delivered ÷ predicted over the window; `None` until it holds enough answers.
    pub ratio: Option<f64>,
    /// Under the floor for the time asked or longer.
    pub low: bool,
    /// Warn now (low, and not warned within that time).
    pub warn: bool,
}

impl HitStats {
    /// The *delivered* tokens of an answer that named `cached` (`None`: no count in it):
    /// the count, else 0 from a worker that has named one before, else unknown (`None`,
    /// the answer is left out of the numbers).
    pub fn delivered(&self, cached: Option<u64>) -> Option<u64> {
        match cached {
            Some(n) => {
                self.reports_cached.store(true, Ordering::Relaxed);
                Some(n)
            }
            None => self.reports_cached.load(Ordering::Relaxed).then_some(0),
        }
    }

    /// Counts one answer's three numbers, `[available, predicted, delivered]` in tokens
    /// (`delivered` capped at `predicted` in the drift: an engine may hold more than the
    /// router knew), against `floor` held for `low_for`.
    pub fn record(
        &self,
        [available, predicted, delivered]: [u64; 3],
        floor: f64,
        low_for: Duration,
    ) -> DriftNow {
        self.answers.fetch_add(1, Ordering::Relaxed);
        self.available.fetch_add(available, Ordering::Relaxed);
        self.predicted.fetch_add(predicted, Ordering::Relaxed);
        self.delivered.fetch_add(delivered, Ordering::Relaxed);
        let mut d = self.drift.lock().unwrap_or_else(|p| p.into_inner());
        if predicted > 0 {
            let kept = delivered.min(predicted);
            d.window.push_back((predicted, kept, delivered));
            d.predicted += predicted;
            d.delivered += kept;
            d.delivered_all += delivered;
            if d.window.len() > DRIFT_WINDOW
                && let Some((p, k, all)) = d.window.pop_front()
            {
                d.predicted -= p;
                d.delivered -= k;
                d.delivered_all -= all;
            }
        }
        let ratio = d.ratio();
        let now = Instant::now();
        match ratio {
            Some(r) if r < floor => {
                d.low_since.get_or_insert(now);
            }
            _ => d.low_since = None,
        }
        let low = d.low_since.is_some_and(|t| now - t >= low_for);
        let warn = low && d.warned.is_none_or(|t| now - t >= low_for);
        if warn {
            d.warned = Some(now);
        }
        DriftNow { ratio, low, warn }
    }

    /// Counts an answer that fell far short of its prediction.
    pub fn shortfall(&self) {
        self.shortfalls.fetch_add(1, Ordering::Relaxed);
    }

    /// The drift now (see [`DriftNow::ratio`]).
    pub fn drift(&self) -> Option<f64> {
        self.drift.lock().unwrap_or_else(|p| p.into_inner()).ratio()
    }

    /// delivered ÷ predicted over the answers of the window so far, however few, and
    /// with what an answer delivered beyond its prediction counted (`None` before the
    /// first answer that predicted a hit): what the tree's learning weighs a short
    /// answer against (`policy::cache_aware::CacheAware::learn`). Uncapped, because an
    /// engine that reuses more than the router predicts elsewhere (prompts past
    /// `cache.max_prompt_bytes`) is not one whose cache the router overrates.
    pub fn drift_so_far(&self) -> Option<f64> {
        let d = self.drift.lock().unwrap_or_else(|p| p.into_inner());
        (d.predicted > 0).then(|| d.delivered_all as f64 / d.predicted as f64)
    }
}

impl Drift {
    fn ratio(&self) -> Option<f64> {
        (self.window.len() >= DRIFT_MIN_ANSWERS && self.predicted > 0)
            .then(|| self.delivered as f64 / self.predicted as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_count_is_zero_only_from_an_engine_that_reports() {
        let h = HitStats::default();
        assert_eq!(h.delivered(None), None);
        assert_eq!(h.delivered(Some(48)), Some(48));
        assert_eq!(h.delivered(None), Some(0));
    }

    #[test]
    fn the_learnings_ratio_counts_what_answers_delivered_beyond_their_prediction() {
        let h = HitStats::default();
        assert_eq!(h.drift_so_far(), None);
        // One answer far short, one far over (an engine reusing past the router's cut).
        h.record([400, 100, 0], 0.5, DRIFT_FOR);
        h.record([400, 100, 300], 0.5, DRIFT_FOR);
        assert_eq!(h.drift_so_far(), Some(1.5));
        // The warning's drift caps each answer at its prediction (and needs 10).
        assert_eq!(h.drift(), None);
        for _ in 0..8 {
            h.record([400, 100, 300], 0.5, DRIFT_FOR);
        }
        assert_eq!(h.drift(), Some(0.9));
    }

    #[tokio::test(start_paused = true)]
    async fn drift_under_the_floor_for_long_enough_warns_once_per_interval() {
        let h = HitStats::default();
        // Delivered as predicted: drift 1, never low.
        for _ in 0..DRIFT_MIN_ANSWERS {
            let now = h.record([500, 400, 400], 0.5, DRIFT_FOR);
            assert!(!now.low && !now.warn);
        }
        assert_eq!(h.drift(), Some(1.0));
        // The engine evicted: nothing delivered from here on.
        let mut warned = 0;
        for _ in 0..DRIFT_WINDOW {
            tokio::time::advance(Duration::from_secs(2)).await;
            let now = h.record([500, 400, 0], 0.5, DRIFT_FOR);
            warned += usize::from(now.warn);
        }
        assert_eq!(h.drift(), Some(0.0));
        // Low from the 6th of those answers (ratio < 0.5), warned when it had been low
        // for 60 s and again 60 s later, not on every answer.
        assert!((2..=4).contains(&warned), "warned {warned} times");
        // Recovery clears it.
        for _ in 0..DRIFT_WINDOW {
            h.record([500, 400, 400], 0.5, DRIFT_FOR);
        }
        let now = h.record([500, 400, 400], 0.5, DRIFT_FOR);
        assert_eq!((now.ratio, now.low, now.warn), (Some(1.0), false, false));
        // Misses (nothing predicted) count in the totals, not in the drift; more
        // delivered than predicted counts as predicted there.
        h.record([100, 0, 50], 0.5, DRIFT_FOR);
        h.record([600, 600, 900], 0.5, DRIFT_FOR);
        assert_eq!(h.drift(), Some(1.0));
        assert_eq!(
            h.answers.load(Ordering::Relaxed),
            2 * DRIFT_WINDOW as u64 + 13
        );
    }
}

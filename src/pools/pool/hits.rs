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
//! The tree's learning weighs its records apart ([`Borne`]): what the answers delivered
//! against what the worker's records alone predicted (a policy may predict more), over
//! the last answers and over the worker's longer run, and the last short answer waiting
//! for a second to confirm it.
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
/// Answers the *long* ratio of [`Borne`] remembers: each answer's weight decays by
/// `1 - 1/LONG_MEMORY` per later one (one this many answers old counts about a third),
/// so it follows a worker over about ten drift windows — a stretch of answers on
/// prompts its records predict badly does not swing it.
pub const LONG_MEMORY: f64 = 1000.0;

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
    /// (`policy::Delivery::is_short`).
    pub shortfalls: AtomicU64,
    drift: Mutex<Drift>,
    borne: Mutex<Borne>,
}

/// What the worker's answers said of the router's records of it, as the tree's
/// learning weighs them (`policy::cache_aware::CacheAware::learn`): per answer to a
/// marked prediction, the tokens the worker's records predicted and the tokens
/// delivered (uncapped: an engine that reuses past what the router records — prompts
/// past `cache.max_prompt_bytes` — is not one whose cache the router overrates).
#[derive(Debug, Default)]
struct Borne {
    /// (recorded, delivered) of the last [`DRIFT_WINDOW`] such answers, and their sums.
    window: VecDeque<(u64, u64)>,
    recorded: u64,
    delivered: u64,
    /// The long ratio's decayed sums (recorded, delivered) and the answers it has seen.
    long: (f64, f64, u64),
    /// The last short answer not yet confirmed: its tree stamp and `long.2` then.
    last_short: Option<(u64, u64)>,
}

#[derive(Debug, Default)]
struct Drift {
    /// (predicted, delivered capped at predicted, delivered) of the last answers that
    /// predicted a hit.
    window: VecDeque<(u64, u64, u64)>,
    predicted: u64,
    delivered: u64,
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
            if d.window.len() > DRIFT_WINDOW
                && let Some((p, k, _)) = d.window.pop_front()
            {
                d.predicted -= p;
                d.delivered -= k;
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

    /// One answer to a prediction of the worker's records: `recorded` tokens (what the
    /// records predicted), `delivered` tokens. See [`Borne`].
    pub fn borne(&self, recorded: u64, delivered: u64) {
        if recorded == 0 {
            return;
        }
        let mut b = self.borne.lock().unwrap_or_else(|p| p.into_inner());
        b.window.push_back((recorded, delivered));
        b.recorded += recorded;
        b.delivered += delivered;
        if b.window.len() > DRIFT_WINDOW
            && let Some((r, d)) = b.window.pop_front()
        {
            b.recorded -= r;
            b.delivered -= d;
        }
        let decay = 1.0 - 1.0 / LONG_MEMORY;
        let (r, d, n) = b.long;
        b.long = (
            r * decay + recorded as f64,
            d * decay + delivered as f64,
            n + 1,
        );
    }

    /// delivered ÷ recorded over the last answers [`HitStats::borne`] was told of
    /// (however few; `None` before the first) and over the worker's longer run
    /// ([`LONG_MEMORY`]; `None` until 10): what the tree's learning weighs a short
    /// answer against.
    pub fn borne_out(&self) -> (Option<f64>, Option<f64>) {
        let b = self.borne.lock().unwrap_or_else(|p| p.into_inner());
        let (r, d, n) = b.long;
        (
            (b.recorded > 0).then(|| b.delivered as f64 / b.recorded as f64),
            (n >= DRIFT_MIN_ANSWERS as u64 && r > 0.0).then(|| d / r),
        )
    }

    /// A short answer whose predicted prefix was last used at tree stamp `stamp`, which
    /// would bound the worker's records to those used since: `Some(horizon)` when an
    /// earlier one, within the last [`DRIFT_WINDOW`] answers [`HitStats::borne`] was
    /// told of, confirms it (the older of the two stamps: what both answers show), else
    /// `None` (this one waits for its confirmation). One short answer is one record; two
    /// are an engine that evicts what the router remembers.
    pub fn confirm_short(&self, stamp: u64) -> Option<u64> {
        let mut b = self.borne.lock().unwrap_or_else(|p| p.into_inner());
        let seen = b.long.2;
        match b.last_short.replace((stamp, seen)) {
            Some((earlier, at)) if seen.saturating_sub(at) <= DRIFT_WINDOW as u64 => {
                b.last_short = None;
                Some(earlier.min(stamp))
            }
            _ => None,
        }
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
    fn the_learnings_ratios_count_what_answers_delivered_beyond_the_records() {
        let h = HitStats::default();
        assert_eq!(h.borne_out(), (None, None));
        // One answer far short, one far over (an engine reusing past the router's cut).
        h.borne(100, 0);
        h.borne(100, 300);
        assert_eq!(h.borne_out(), (Some(1.5), None), "the long one needs 10");
        for _ in 0..8 {
            h.borne(100, 300);
        }
        // 2.7 but for the decay (the short one is the oldest).
        let long = h.borne_out().1.unwrap();
        assert!((long - 2.7).abs() < 0.01, "{long}");
        // A stretch of short answers drags the window under, not the long run.
        for _ in 0..DRIFT_WINDOW {
            h.borne(100, 50);
        }
        let (window, long) = h.borne_out();
        assert_eq!(window, Some(0.5));
        assert!(long.unwrap() > 0.65 && long.unwrap() < 0.75, "{long:?}");
        // The warning's drift is the picks' own, capped, and apart.
        assert_eq!(h.drift(), None);
    }

    #[test]
    fn a_short_answer_bounds_the_records_when_a_second_confirms_it() {
        let h = HitStats::default();
        assert_eq!(h.confirm_short(50), None);
        h.borne(100, 100);
        // Confirmed: the older of the two stamps.
        assert_eq!(h.confirm_short(40), Some(40));
        assert_eq!(h.confirm_short(60), None, "a new pair starts");
        for _ in 0..=DRIFT_WINDOW {
            h.borne(100, 100);
        }
        assert_eq!(h.confirm_short(70), None, "too far apart");
        assert_eq!(h.confirm_short(80), Some(70));
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

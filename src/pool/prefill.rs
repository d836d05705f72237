//! Prefill accounting per worker: the work the router has queued there, and the
//! worker's prefill speed learned from its own answers.
//!
//! **Pending prefill.** Every forwarded request reserves its estimated uncached prompt
//! tokens on its worker (see [`super::InFlightGuard::reserve_prefill`]) until its first
//! response byte: for a streamed answer that is the first token, so the reservation
//! covers the queue wait and the prefill; a non-streamed answer's first byte comes after
//! decode too, so its reservation over-covers (the engine's own `waiting` count, scraped
//! by `signals::engine_metrics`, is the other view of the same queue).
//!
//! **Drain time.** Each reservation also extends the worker's predicted *drain* instant,
//! when the prefill of everything the router has pending there ends: `drain =
//! max(now, drain) + base + tokens · per_token`. When a first byte arrives, the drain
//! moves by how far that request was late or early against its prediction, so the
//! estimate re-anchors on every answer instead of drifting; a request dropped before its
//! first byte takes its own cost back out. The queue a new request would wait behind is
//! `drain − now` ([`Prefill::queue_s`]): work already done on the request in service is
//! not counted again, as a sum of pending tokens would. It is floored at the cost of the
//! pending requests but one, so a worker that stops answering (no first byte re-anchors
//! its drain) is not taken for drained.
//!
//! **Learned speed.** Each streamed answer that reports `usage` and found nothing of the
//! router's pending ahead of it gives one sample: its TTFT `y` (s, from the request
//! leaving the router to its first byte) and its own prefill tokens `x` (`prompt_tokens −
//! cached_tokens`). The model is `y = base + per_token · x`, fitted by least squares
//! with exponential forgetting ([`FORGET`]), so a worker that slows down (a noisy
//! neighbour, a long context) is relearned within a few dozen answers. Answers that
//! queued behind others are left out: their wait is the drain's business. Until
//! [`MIN_SAMPLES`] have arrived the priors hold ([`PRIOR_BASE_S`],
//! [`PRIOR_SECS_PER_TOKEN`]). The same answers teach the prompt's tokens per byte of
//! routing text ([`PRIOR_TOKENS_PER_BYTE`] before any).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// Per-request overhead before any sample, in s: 20 ms, about the fixed part of a
/// vLLM step plus scheduling and HTTP for a short prompt on one GPU (and `sim-engine`'s
/// default `--ttft-base-ms`).
pub const PRIOR_BASE_S: f64 = 0.020;

/// Prefill time per uncached prompt token before any sample, in s: 100 µs (10,000
/// tokens/s, the order of an 8B model's prefill on one H100; `sim-engine` defaults to
/// 80 µs). Only the ratio to [`PRIOR_BASE_S`] matters while every worker has the prior.
pub const PRIOR_SECS_PER_TOKEN: f64 = 100e-6;

/// Tokens per byte of prompt text before any answer: 0.25 (about 4 bytes of English
/// per token, the usual rule of thumb for BPE tokenizers).
pub const PRIOR_TOKENS_PER_BYTE: f64 = 0.25;

/// Weight kept by the past at each new sample: 0.95, a memory of about 20 answers.
pub const FORGET: f64 = 0.95;

/// Samples before the fit replaces the priors.
pub const MIN_SAMPLES: u64 = 8;

/// The published estimates, read lock-free on the request path.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefillRate {
    /// Fixed cost per request, s.
    pub base_s: f64,
    /// Cost per uncached prompt token, s.
    pub secs_per_token: f64,
    /// Prompt tokens per byte of routing text.
    pub tokens_per_byte: f64,
    /// Samples learned from (0 = priors).
    pub samples: u64,
}

impl PrefillRate {
    /// Expected prefill time of `requests` requests holding `tokens` uncached tokens, s.
    pub fn cost_s(&self, requests: f64, tokens: f64) -> f64 {
        requests * self.base_s + tokens * self.secs_per_token
    }
}

/// One learning sample: an answer that waited for nothing (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// Its own prefill tokens (`prompt_tokens − cached_tokens`).
    pub tokens: f64,
    /// Observed TTFT, s.
    pub ttft_s: f64,
}

/// Decayed sums of the least-squares fit `y = base + per_token·x` (`w` the decayed
/// sample weight).
#[derive(Debug, Default, Clone, Copy)]
struct Fit {
    w: f64,
    x: f64,
    xx: f64,
    y: f64,
    xy: f64,
    samples: u64,
    tpb: f64,
    tpb_samples: u64,
}

impl Fit {
    fn add(&mut self, s: Sample) {
        let (x, y) = (s.tokens, s.ttft_s);
        self.w = self.w * FORGET + 1.0;
        self.x = self.x * FORGET + x;
        self.xx = self.xx * FORGET + x * x;
        self.y = self.y * FORGET + y;
        self.xy = self.xy * FORGET + x * y;
        self.samples += 1;
    }

    /// (base, per_token) from the sums; `None` while too few samples.
    fn solve(&self) -> Option<(f64, f64)> {
        if self.samples < MIN_SAMPLES {
            return None;
        }
        let det = self.w * self.xx - self.x * self.x;
        // Every prompt about as long: the two costs cannot be told apart; keep the
        // prior base and fit the per-token cost alone.
        let (base, per_token) = if det > 1e-6 * self.w * self.xx {
            (
                (self.y * self.xx - self.xy * self.x) / det,
                (self.w * self.xy - self.x * self.y) / det,
            )
        } else if self.xx > 0.0 {
            let per_token = (self.xy - PRIOR_BASE_S * self.x) / self.xx;
            (PRIOR_BASE_S, per_token)
        } else {
            (self.y / self.w.max(f64::MIN_POSITIVE), PRIOR_SECS_PER_TOKEN)
        };
        // A fit outside these bounds is noise (a negative cost, a prefill slower than a
        // second per token); clamp rather than route on it.
        Some((base.clamp(0.0, 10.0), per_token.clamp(1e-8, 1.0)))
    }
}

/// One worker's pending prefill and learned speed.
#[derive(Debug)]
pub struct Prefill {
    /// Router-forwarded requests before their first response byte.
    pending_requests: AtomicU64,
    /// Their reserved uncached prompt tokens.
    pending_tokens: AtomicU64,
    /// `f64` bits: moving average of the tokens a request reserves here.
    mean_tokens: AtomicU64,
    /// Predicted end of the pending prefill, ns past `clock::epoch` (0 = none pending).
    drain_ns: AtomicU64,
    fit: Mutex<Fit>,
    /// `f64` bits of the published [`PrefillRate`] fields.
    base_s: AtomicU64,
    secs_per_token: AtomicU64,
    tokens_per_byte: AtomicU64,
    samples: AtomicU64,
}

impl Default for Prefill {
    fn default() -> Self {
        Prefill {
            pending_requests: AtomicU64::new(0),
            pending_tokens: AtomicU64::new(0),
            mean_tokens: AtomicU64::new(0f64.to_bits()),
            drain_ns: AtomicU64::new(0),
            fit: Mutex::new(Fit::default()),
            base_s: AtomicU64::new(PRIOR_BASE_S.to_bits()),
            secs_per_token: AtomicU64::new(PRIOR_SECS_PER_TOKEN.to_bits()),
            tokens_per_byte: AtomicU64::new(PRIOR_TOKENS_PER_BYTE.to_bits()),
            samples: AtomicU64::new(0),
        }
    }
}

impl Prefill {
    /// (requests, tokens) reserved now.
    pub fn pending(&self) -> (u64, u64) {
        (
            self.pending_requests.load(Ordering::Relaxed),
            self.pending_tokens.load(Ordering::Relaxed),
        )
    }

    /// Moving average of the uncached tokens one request reserves here (weight
    /// 1 − [`FORGET`] per request): what one request queued inside the engine stands for.
    pub fn mean_request_tokens(&self) -> f64 {
        f64::from_bits(self.mean_tokens.load(Ordering::Relaxed))
    }

    /// Seconds of pending prefill a request sent at `now` would wait behind, at `rate`
    /// (0 when nothing is pending): the drain (see the module docs), but never less than
    /// the cost of the pending requests but one (the one in service may be nearly done),
    /// so a worker that stops answering does not look drained on schedule.
    pub fn queue_s(&self, now: std::time::Instant, rate: &PrefillRate) -> f64 {
        let (n, tokens) = self.pending();
        let d = self.drain_ns.load(Ordering::Relaxed);
        if n == 0 {
            return 0.0;
        }
        let drain = d.saturating_sub(crate::clock::nanos(now)) as f64 / 1e9;
        let floor = rate.cost_s(n as f64, tokens as f64) * (n - 1) as f64 / n as f64;
        drain.max(floor)
    }

    /// Extends the drain by `cost_ns` from `now`; returns the reservation's predicted
    /// end (ns past `clock::epoch`).
    pub(super) fn extend_drain(&self, cost_ns: u64, now: std::time::Instant) -> u64 {
        let now_ns = crate::clock::nanos(now);
        let mut end = 0;
        let _ = self
            .drain_ns
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |d| {
                end = d.max(now_ns).saturating_add(cost_ns);
                Some(end)
            });
        end
    }

    /// Moves the drain after a reservation ended at `now`: by `now − predicted_end` when
    /// it started answering (`answered`), else back by its own `cost_ns`; never before
    /// `now`, and cleared when nothing is pending any more.
    pub(super) fn settle_drain(
        &self,
        predicted_end: u64,
        cost_ns: u64,
        answered: bool,
        now: std::time::Instant,
    ) {
        let now_ns = crate::clock::nanos(now);
        let empty = self.pending_requests.load(Ordering::Relaxed) == 0;
        let _ = self
            .drain_ns
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |d| {
                if empty {
                    return Some(0);
                }
                let moved = if answered {
                    (d as i128 + now_ns as i128 - predicted_end as i128).max(0) as u64
                } else {
                    d.saturating_sub(cost_ns)
                };
                Some(moved.max(now_ns))
            });
    }

    /// Reserves `tokens`; returns the requests that were pending before.
    pub(super) fn reserve(&self, tokens: u64) -> u64 {
        // Racing updates may lose one sample: an estimate, not a count.
        let old = self.mean_request_tokens();
        let new = if old == 0.0 {
            tokens as f64
        } else {
            old * FORGET + tokens as f64 * (1.0 - FORGET)
        };
        self.mean_tokens.store(new.to_bits(), Ordering::Relaxed);
        self.pending_tokens.fetch_add(tokens, Ordering::Relaxed);
        self.pending_requests.fetch_add(1, Ordering::Relaxed)
    }

    /// Gives back one reservation of `tokens`.
    pub(super) fn release(&self, tokens: u64) {
        // Relaxed and saturating: these are load estimates; a racing reader may see the
        // request count before the tokens, never a wrapped value.
        let _ = self
            .pending_requests
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                Some(n.saturating_sub(1))
            });
        let _ = self
            .pending_tokens
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                Some(n.saturating_sub(tokens))
            });
    }

    /// The current estimates (priors until [`MIN_SAMPLES`] samples).
    pub fn rate(&self) -> PrefillRate {
        let f = |a: &AtomicU64| f64::from_bits(a.load(Ordering::Relaxed));
        PrefillRate {
            base_s: f(&self.base_s),
            secs_per_token: f(&self.secs_per_token),
            tokens_per_byte: f(&self.tokens_per_byte),
            samples: self.samples.load(Ordering::Relaxed),
        }
    }

    /// Learns from one streamed answer (see the module docs). Ignores a sample that
    /// cannot be a TTFT (negative, not finite, or longer than an hour).
    pub fn learn(&self, s: Sample) {
        let sane = s.ttft_s.is_finite()
            && (0.0..3600.0).contains(&s.ttft_s)
            && s.tokens.is_finite()
            && s.tokens >= 0.0;
        if !sane {
            return;
        }
        let mut fit = self.fit.lock().unwrap_or_else(|e| e.into_inner());
        fit.add(s);
        if let Some((base, per_token)) = fit.solve() {
            self.base_s.store(base.to_bits(), Ordering::Relaxed);
            self.secs_per_token
                .store(per_token.to_bits(), Ordering::Relaxed);
        }
        self.samples.store(fit.samples, Ordering::Relaxed);
    }

    /// Learns the tokens per byte of routing text from one answer's `prompt_tokens`
    /// for a prompt of `prompt_bytes` bytes (an EWMA with weight 1 − [`FORGET`]).
    pub fn learn_tokens_per_byte(&self, prompt_tokens: u64, prompt_bytes: u64) {
        if prompt_bytes < 64 || prompt_tokens == 0 {
            return; // too short to say anything about the ratio
        }
        let ratio = (prompt_tokens as f64 / prompt_bytes as f64).clamp(0.01, 4.0);
        let mut fit = self.fit.lock().unwrap_or_else(|e| e.into_inner());
        fit.tpb = if fit.tpb_samples == 0 {
            ratio
        } else {
            fit.tpb * FORGET + ratio * (1.0 - FORGET)
        };
        fit.tpb_samples += 1;
        self.tokens_per_byte
            .store(fit.tpb.to_bits(), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(base: f64, per_token: f64, x: f64) -> Sample {
        Sample {
            tokens: x,
            ttft_s: base + per_token * x,
        }
    }

    #[test]
    fn priors_until_enough_samples() {
        let p = Prefill::default();
        for _ in 0..MIN_SAMPLES - 1 {
            p.learn(engine(0.05, 1e-3, 1000.0));
        }
        let r = p.rate();
        assert_eq!(
            (r.base_s, r.secs_per_token),
            (PRIOR_BASE_S, PRIOR_SECS_PER_TOKEN)
        );
        p.learn(engine(0.05, 1e-3, 1000.0));
        assert!(p.rate().samples == MIN_SAMPLES);
    }

    #[test]
    fn fits_both_costs_and_follows_a_slowdown() {
        let p = Prefill::default();
        let shapes = [200.0, 3000.0, 1500.0, 600.0];
        for i in 0..40 {
            p.learn(engine(0.02, 80e-6, shapes[i % 4]));
        }
        let r = p.rate();
        assert!((r.base_s - 0.02).abs() < 1e-3, "{r:?}");
        assert!((r.secs_per_token - 80e-6).abs() < 2e-6, "{r:?}");
        // Three times slower: relearned within a few dozen answers.
        for i in 0..60 {
            p.learn(engine(0.02, 240e-6, shapes[i % 4]));
        }
        let r = p.rate();
        assert!((r.secs_per_token / 240e-6 - 1.0).abs() < 0.05, "{r:?}");
    }

    #[test]
    fn samples_of_one_length_keep_the_prior_base() {
        let p = Prefill::default();
        for _ in 0..20 {
            p.learn(engine(PRIOR_BASE_S, 50e-6, 2000.0));
        }
        let r = p.rate();
        assert!((r.secs_per_token - 50e-6).abs() < 1e-7, "{r:?}");
        assert_eq!(r.base_s, PRIOR_BASE_S);
    }

    #[test]
    fn nonsense_is_ignored_and_reservations_saturate() {
        let p = Prefill::default();
        for bad in [f64::NAN, -1.0, 1e9] {
            p.learn(Sample {
                tokens: 10.0,
                ttft_s: bad,
            });
        }
        assert_eq!(p.rate().samples, 0);
        assert_eq!(p.reserve(100), 0);
        assert_eq!(p.pending(), (1, 100));
        p.release(100);
        p.release(100);
        assert_eq!(p.pending(), (0, 0));
    }

    #[test]
    fn tokens_per_byte_moves_towards_the_answers() {
        let p = Prefill::default();
        p.learn_tokens_per_byte(10, 20); // too short: ignored
        assert_eq!(p.rate().tokens_per_byte, PRIOR_TOKENS_PER_BYTE);
        for _ in 0..100 {
            p.learn_tokens_per_byte(1000, 6000);
        }
        assert!((p.rate().tokens_per_byte - 1.0 / 6.0).abs() < 1e-3);
    }
}

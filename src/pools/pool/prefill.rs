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
//!
//! **Learned queueing.** The drain assumes the engine prefills one request after
//! another; engines differ (several prefills at once at full speed, a per-step token
//! budget shared among them, other batch limits). Each streamed answer that did queue
//! behind the router's pending work gives one more sample: the part of its TTFT its own
//! prefill does not explain (`y − base − per_token · x`) against the wait the drain
//! predicted for it when it was sent (`q`). The *queue factor* `κ` fits `y − base −
//! per_token · x = κ · q` by least squares with forgetting ([`FORGET`]): about 1 on an
//! engine that prefills one at a time, about 0 on one that runs what the router sends
//! at once, in between on one that shares its speed. Until [`MIN_SAMPLES`] such
//! answers (and the speed itself) are learned it is 1, the drain's own assumption.

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

/// The queue factor's bounds: a fit outside them is noise.
const QUEUE_FACTOR_MAX: f64 = 2.0;

/// Predicted waits shorter than this (s) teach the queue factor nothing: the residual
/// is then the speed fit's own error.
const MIN_WAIT_S: f64 = 1e-3;

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
    /// How much of the drain's predicted wait a request really waits there (the queue
    /// factor `κ`, see the module docs; 1 until learned).
    pub queue_factor: f64,
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
    /// Decayed sums of the queue factor's fit `r = κ·q`: Σq², Σr·q.
    qq: f64,
    rq: f64,
    q_samples: u64,
}

impl Fit {
    /// Adds one queued answer: `residual` s of its TTFT unexplained by its own prefill,
    /// after a predicted wait of `wait_s`.
    fn add_queued(&mut self, residual: f64, wait_s: f64) {
        self.qq = self.qq * FORGET + wait_s * wait_s;
        self.rq = self.rq * FORGET + residual * wait_s;
        self.q_samples += 1;
    }

    /// The queue factor; `None` while too few queued answers.
    fn queue_factor(&self) -> Option<f64> {
        (self.q_samples >= MIN_SAMPLES && self.qq > 0.0)
            .then(|| (self.rq / self.qq).clamp(0.0, QUEUE_FACTOR_MAX))
    }

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
    queue_factor: AtomicU64,
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
            queue_factor: AtomicU64::new(1f64.to_bits()),
        }
    }
}

impl Prefill {
    /// Requests reserved now: sent and not yet answered their first byte (one load,
    /// read for every worker at every decision).
    pub fn pending_requests(&self) -> u64 {
        self.pending_requests.load(Ordering::Relaxed)
    }

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
            queue_factor: f(&self.queue_factor),
        }
    }

    /// Learns the queue factor from one streamed answer that queued behind the
    /// router's pending work, the drain having predicted a wait of `wait_s` for it (see
    /// the module docs). Ignored until the speed is learned, for a wait too short to
    /// tell, and for a sample that cannot be a TTFT.
    pub fn learn_queued(&self, s: Sample, wait_s: f64) {
        let sane = s.ttft_s.is_finite()
            && (0.0..3600.0).contains(&s.ttft_s)
            && s.tokens.is_finite()
            && s.tokens >= 0.0
            && wait_s.is_finite()
            && (MIN_WAIT_S..3600.0).contains(&wait_s);
        let rate = self.rate();
        if !sane || rate.samples < MIN_SAMPLES {
            return;
        }
        let residual = s.ttft_s - rate.cost_s(1.0, s.tokens);
        let mut fit = self.fit.lock().unwrap_or_else(|e| e.into_inner());
        fit.add_queued(residual, wait_s);
        if let Some(k) = fit.queue_factor() {
            self.queue_factor.store(k.to_bits(), Ordering::Relaxed);
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

    /// How one engine's prefills share it, for the queue factor's tests.
    #[derive(Clone, Copy, Debug)]
    enum Physics {
        /// One at a time, FIFO.
        Serial,
        /// Up to this many at once at full speed, FIFO beyond.
        Parallel(usize),
        /// Up to this many at once sharing one full speed, FIFO beyond.
        Shared(usize),
        /// vLLM's chunked prefill: steps of this many prompt tokens, oldest prompt
        /// first, each step lasting an ITL of 15 ms plus its tokens at full speed; a
        /// prompt joins the batch after the fixed part of its work (the API server's).
        Chunked(usize),
    }

    /// The engine of [`serve`]: a prefill's fixed part (s) and its time per token (s).
    const BASE_S: f64 = 0.020;
    const PER_TOKEN_S: f64 = 80e-6;

    /// Prefill end of each job `(arrival s, work s)` (sorted by arrival) under `physics`.
    fn prefill_ends(physics: Physics, jobs: &[(f64, f64)]) -> Vec<f64> {
        match physics {
            Physics::Serial => {
                let mut free = 0.0f64;
                jobs.iter()
                    .map(|&(a, w)| {
                        free = free.max(a) + w;
                        free
                    })
                    .collect()
            }
            Physics::Parallel(n) => {
                let mut slots = vec![0.0f64; n];
                jobs.iter()
                    .map(|&(a, w)| {
                        let (i, _) = slots
                            .iter()
                            .enumerate()
                            .min_by(|x, y| x.1.total_cmp(y.1))
                            .unwrap();
                        slots[i] = slots[i].max(a) + w;
                        slots[i]
                    })
                    .collect()
            }
            Physics::Shared(n) => {
                // Processor sharing among at most `n`, event by event.
                let mut end = vec![0.0; jobs.len()];
                let (mut t, mut next) = (0.0f64, 0usize);
                let mut running: Vec<(usize, f64)> = Vec::new(); // (job, work left)
                let mut queued: std::collections::VecDeque<usize> = Default::default();
                while next < jobs.len() || !running.is_empty() || !queued.is_empty() {
                    while running.len() < n {
                        let Some(j) = queued.pop_front() else { break };
                        running.push((j, jobs[j].1));
                    }
                    let k = running.len() as f64;
                    let done_at = running
                        .iter()
                        .map(|r| t + r.1 * k)
                        .fold(f64::INFINITY, f64::min);
                    let arrive_at = jobs.get(next).map_or(f64::INFINITY, |j| j.0);
                    let to = done_at.min(arrive_at);
                    for r in &mut running {
                        r.1 -= (to - t) / k.max(1.0);
                    }
                    t = to;
                    running.retain(|&(j, left)| {
                        let done = left <= 1e-12;
                        if done {
                            end[j] = t;
                        }
                        !done
                    });
                    if arrive_at <= t {
                        queued.push_back(next);
                        next += 1;
                    }
                }
                end
            }
            Physics::Chunked(budget) => {
                const ITL_S: f64 = 0.015;
                let mut end = vec![0.0; jobs.len()];
                let mut t = 0.0f64;
                let mut next = 0usize;
                // (job, prompt tokens left), oldest first.
                let mut queued: std::collections::VecDeque<(usize, f64)> = Default::default();
                loop {
                    while next < jobs.len() && jobs[next].0 + BASE_S <= t {
                        let tokens = ((jobs[next].1 - BASE_S) / PER_TOKEN_S).round();
                        queued.push_back((next, tokens));
                        next += 1;
                    }
                    if queued.is_empty() {
                        let Some(j) = jobs.get(next) else { break };
                        t = t.max(j.0 + BASE_S);
                        continue;
                    }
                    let mut room = budget as f64;
                    let mut done = 0;
                    for q in queued.iter_mut() {
                        let take = q.1.min(room);
                        q.1 -= take;
                        room -= take;
                        if q.1 > 0.0 {
                            break;
                        }
                        done += 1;
                    }
                    t += ITL_S + (budget as f64 - room) * PER_TOKEN_S;
                    for (j, _) in queued.drain(..done) {
                        end[j] = t;
                    }
                }
                end
            }
        }
    }

    /// A worker of `physics` (20 ms + 80 µs a token, prompts of 200–3,000 uncached
    /// tokens, arrivals at 75 % of one serial engine's capacity, jittered) answering
    /// `answers` streamed requests, the router's accounting driven on a made-up clock
    /// as the proxy drives it (reserve when sent, first byte, learn). Returns the
    /// learned rate and, for each answer in order, (TTFT, own tokens, predicted wait).
    fn serve(physics: Physics, answers: usize) -> (PrefillRate, Vec<(f64, f64, f64)>) {
        let (base, per_token) = (BASE_S, PER_TOKEN_S);
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut draw = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % 10_000) as f64 / 10_000.0
        };
        let mut jobs = Vec::with_capacity(answers);
        let mut t = 0.0;
        for _ in 0..answers {
            let tokens = (200.0 + 2800.0 * draw()).round();
            jobs.push((t, tokens));
            // Mean work 0.148 s: arrivals every 0.197 s on average.
            t += 0.197 * 2.0 * draw();
        }
        let work: Vec<(f64, f64)> = jobs
            .iter()
            .map(|&(a, x)| (a, base + per_token * x))
            .collect();
        let ends = prefill_ends(physics, &work);
        // Events in time order: (time, 0 = sent / 1 = first byte, job).
        let mut events: Vec<(f64, u8, usize)> = (0..answers)
            .flat_map(|j| [(jobs[j].0, 0u8, j), (ends[j], 1u8, j)])
            .collect();
        events.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let t0 = crate::clock::epoch() + std::time::Duration::from_secs(1);
        let at = |s: f64| t0 + std::time::Duration::from_secs_f64(s);
        let p = Prefill::default();
        let mut tickets = vec![(0u64, 0u64, 0u64, 0.0f64); answers];
        let mut seen = Vec::with_capacity(answers);
        for (time, kind, j) in events {
            let tokens = jobs[j].1;
            if kind == 0 {
                let cost_ns = (p.rate().cost_s(1.0, tokens) * 1e9) as u64;
                let end = p.extend_drain(cost_ns, at(time));
                let ahead = p.reserve(tokens as u64);
                let start = end.saturating_sub(cost_ns);
                let wait = start.saturating_sub(crate::clock::nanos(at(time))) as f64 / 1e9;
                tickets[j] = (end, cost_ns, ahead, wait);
            } else {
                let (end, cost_ns, ahead, wait) = tickets[j];
                p.release(tokens as u64);
                p.settle_drain(end, cost_ns, true, at(time));
                let sample = Sample {
                    tokens,
                    ttft_s: time - jobs[j].0,
                };
                if ahead == 0 {
                    p.learn(sample);
                } else {
                    p.learn_queued(sample, wait);
                }
                seen.push((sample.ttft_s, tokens, wait));
            }
        }
        (p.rate(), seen)
    }

    /// Mean absolute TTFT error of `rate` with queue factor `k` over `answers`.
    fn error(rate: &PrefillRate, k: f64, answers: &[(f64, f64, f64)]) -> f64 {
        answers
            .iter()
            .map(|&(y, x, q)| (rate.cost_s(1.0, x) + k * q - y).abs())
            .sum::<f64>()
            / answers.len() as f64
    }

    #[test]
    fn the_queue_factor_learns_each_engine_physics_within_200_answers() {
        for (physics, band) in [
            (Physics::Serial, Some(0.8..1.2)),
            (Physics::Parallel(6), Some(0.0..0.25)),
            (Physics::Shared(6), Some(0.05..0.9)),
            // No settled κ: see the error check below.
            (Physics::Chunked(2048), None),
        ] {
            let (learned, _) = serve(physics, 200);
            let k = learned.queue_factor;
            assert!(
                band.is_none_or(|b| b.contains(&k)),
                "{physics:?}: queue factor {k}, {learned:?}"
            );
            // The speed is the engine's own where a prefill running alone keeps its
            // speed; a shared one's is slowed by prefills arriving during it, and so
            // is its TTFT.
            if !matches!(physics, Physics::Shared(_) | Physics::Chunked(_)) {
                assert!(
                    (learned.secs_per_token / 80e-6 - 1.0).abs() < 0.1,
                    "{learned:?}"
                );
            }
            // The next answers (the same stream, longer) are predicted at least as well
            // as by the serial assumption, and far better where it is wrong.
            let (_, all) = serve(physics, 400);
            let later = &all[200..];
            let (ours, serial) = (error(&learned, k, later), error(&learned, 1.0, later));
            match physics {
                // Within a millisecond of the exact model.
                Physics::Serial => assert!(ours <= serial + 1e-3, "{ours} vs {serial}"),
                Physics::Parallel(_) => assert!(ours < serial * 0.5, "{ours} vs {serial}"),
                // A shared engine's wait is not linear in the drain; still better.
                Physics::Shared(_) => assert!(ours < serial * 0.85, "{ours} vs {serial}"),
                // A chunked step carries whatever prompts came after too, so a
                // prefill's end depends on arrivals the router cannot know when it
                // sends: no model of what is in flight beats the serial one by much
                // (both miss by ~30 % of the mean TTFT here), nor may it do worse.
                Physics::Chunked(_) => assert!(ours < serial * 1.05, "{ours} vs {serial}"),
            }
        }
    }

    #[test]
    fn the_queue_factor_waits_for_the_speed_and_ignores_nonsense() {
        let p = Prefill::default();
        // No speed learned yet: a queued answer teaches nothing.
        for _ in 0..2 * MIN_SAMPLES {
            p.learn_queued(engine(0.02, 80e-6, 1000.0), 0.5);
        }
        assert_eq!(p.rate().queue_factor, 1.0);
        for i in 0..MIN_SAMPLES {
            p.learn(engine(0.02, 80e-6, 500.0 + 100.0 * i as f64));
        }
        for bad in [f64::NAN, -1.0, 0.0, 1e-4] {
            p.learn_queued(engine(0.02, 80e-6, 1000.0), bad);
        }
        assert_eq!(p.rate().queue_factor, 1.0);
        // Queued answers that waited half what the drain predicted.
        for _ in 0..MIN_SAMPLES {
            let mut s = engine(0.02, 80e-6, 1000.0);
            s.ttft_s += 0.25;
            p.learn_queued(s, 0.5);
        }
        assert!((p.rate().queue_factor - 0.5).abs() < 0.01, "{:?}", p.rate());
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

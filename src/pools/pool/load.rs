//! In-flight accounting: an RAII guard per forwarded request.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use super::Worker;
use super::breaker::{Admission, Outcome};

/// Counts one request in flight on a worker for as long as it lives, and carries its
/// circuit-breaker admission until an outcome is recorded.
///
/// The proxy moves the guard into the response body, so it is dropped when the body
/// ends, fails, or the client goes away mid-stream, not when headers arrive. Every path
/// out of a request drops it exactly once; there is no manual decrement anywhere. An
/// admission still pending at drop (the client cancelled before headers) is recorded as
/// neutral, so a half-open probe slot is always given back.
#[derive(Debug)]
pub struct InFlightGuard {
    worker: Arc<Worker>,
    admission: Option<Admission>,
    prefill: Option<PrefillTicket>,
    /// Another count this request is in while the guard lives (its priority class's
    /// in-flight, for `priority.reserve`): see [`InFlightGuard::count_also`].
    also: Option<Arc<AtomicUsize>>,
}

/// One request's prefill reservation on its worker (see [`super::prefill`]): held from
/// just before the request is sent until its first response byte, or the guard's drop.
#[derive(Debug, Clone, Copy)]
pub struct PrefillTicket {
    /// Its own estimated uncached prompt tokens.
    pub tokens: u64,
    /// Requests the router had pending there before it (0: its TTFT is its own).
    pub ahead_requests: u64,
    /// Bytes of its prompt (for the tokens-per-byte estimate).
    pub prompt_bytes: u64,
    /// When it was sent.
    pub sent: Instant,
    /// Time to its first response byte, once that arrived.
    pub first_byte: Option<std::time::Duration>,
    /// Its predicted prefill end (ns past `clock::epoch`) and cost (ns) in the drain.
    pub predicted_end: u64,
    pub cost_ns: u64,
}

impl PrefillTicket {
    /// The wait behind the router's pending work the drain predicted for it when it was
    /// sent, s (its predicted end less its own cost).
    pub fn predicted_wait_s(&self) -> f64 {
        let start = self
            .predicted_end
            .saturating_sub(self.cost_ns)
            .saturating_sub(crate::clock::nanos(self.sent));
        start as f64 / 1e9
    }
}

impl InFlightGuard {
    /// Takes a slot on `worker` if it is under its `max_load` (atomically, so two
    /// racing requests cannot both take the last slot); `None` when full.
    pub fn try_acquire(worker: &Arc<Worker>) -> Option<Self> {
        // The other router replicas' requests count against max_load too.
        let max = worker.config().max_load.map_or(usize::MAX, |m| {
            m.get().saturating_sub(worker.remote_in_flight())
        });
        // Relaxed: the counter publishes no other memory; only its own value matters.
        worker
            .in_flight
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()?;
        Some(InFlightGuard {
            worker: Arc::clone(worker),
            admission: None,
            prefill: None,
            also: None,
        })
    }

    /// Counts the request in `counter` too, for as long as the guard lives (replacing
    /// an earlier one).
    pub fn count_also(&mut self, counter: &Arc<AtomicUsize>) {
        // Relaxed: a count, as `in_flight`.
        counter.fetch_add(1, Ordering::Relaxed);
        if let Some(old) = self.also.replace(Arc::clone(counter)) {
            old.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Reserves `tokens` of prefill on the worker (estimated uncached prompt tokens; 0
    /// when the policy does not estimate them) for a prompt of `prompt_bytes` bytes,
    /// just before the request is sent. Replaces an earlier reservation.
    pub fn reserve_prefill(&mut self, tokens: u64, prompt_bytes: u64) {
        self.release_prefill();
        let p = self.worker.prefill();
        let sent = now();
        let cost_ns = (p.rate().cost_s(1.0, tokens as f64) * 1e9) as u64;
        let predicted_end = p.extend_drain(cost_ns, sent);
        let ahead_requests = p.reserve(tokens);
        self.prefill = Some(PrefillTicket {
            tokens,
            ahead_requests,
            prompt_bytes,
            sent,
            first_byte: None,
            predicted_end,
            cost_ns,
        });
    }

    /// The first response byte arrived: the prefill is done; its reservation ends.
    pub fn first_byte(&mut self) {
        if let Some(t) = &mut self.prefill
            && t.first_byte.is_none()
        {
            let at = now();
            t.first_byte = Some(at.saturating_duration_since(t.sent));
            let p = self.worker.prefill();
            p.release(t.tokens);
            p.settle_drain(t.predicted_end, t.cost_ns, true, at);
        }
    }

    /// Learns from the answer's usage: tokens per byte always, the prefill speed when
    /// `streamed` (only then was the first byte the first token).
    pub fn learn(&self, prompt_tokens: u64, cached_tokens: u64, streamed: bool) {
        let Some(t) = &self.prefill else { return };
        let p = self.worker.prefill();
        p.learn_tokens_per_byte(prompt_tokens, t.prompt_bytes);
        let (true, Some(ttft)) = (streamed, t.first_byte) else {
            return;
        };
        let sample = super::prefill::Sample {
            tokens: prompt_tokens.saturating_sub(cached_tokens) as f64,
            ttft_s: ttft.as_secs_f64(),
        };
        if t.ahead_requests == 0 {
            // It waited for nothing of the router's: its TTFT is its own prefill.
            p.learn(sample);
        } else {
            // It queued: how long, against the wait the drain predicted for it.
            p.learn_queued(sample, t.predicted_wait_s());
        }
    }

    /// The reservation, if any.
    pub fn prefill_ticket(&self) -> Option<&PrefillTicket> {
        self.prefill.as_ref()
    }

    fn release_prefill(&mut self) {
        if let Some(t) = self.prefill.take()
            && t.first_byte.is_none()
        {
            let p = self.worker.prefill();
            p.release(t.tokens);
            p.settle_drain(t.predicted_end, t.cost_ns, false, now());
        }
    }

    pub fn worker(&self) -> &Arc<Worker> {
        &self.worker
    }

    /// Asks the worker's breaker to admit this request; false when it refuses.
    pub fn admit(&mut self) -> bool {
        self.admission = self.worker.admit(now());
        self.admission.is_some()
    }

    /// Records the request's outcome with the breaker. The first call reports the
    /// admission's verdict; a later failure (a body that broke off after a successful
    /// start) counts as one more failure of a normal request.
    pub fn record(&mut self, outcome: Outcome) {
        match self.admission.take() {
            Some(a) => self.worker.record(a, outcome, now()),
            None if outcome == Outcome::Failure => {
                self.worker.record(Admission::Normal, outcome, now())
            }
            None => {}
        }
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.release_prefill();
        if let Some(a) = self.admission.take() {
            self.worker.record(a, Outcome::Neutral, now());
        }
        self.worker.in_flight.fetch_sub(1, Ordering::Relaxed);
        if let Some(c) = self.also.take() {
            c.fetch_sub(1, Ordering::Relaxed);
        }
        // No waiter: a stored permit, one spurious re-check later at most.
        self.worker.freed.notify_one();
    }
}

pub(crate) use crate::clock::now;

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(max_load: Option<usize>) -> Arc<Worker> {
        Arc::new(crate::pools::pool::worker::for_test(
            max_load,
            &crate::config::BreakerConfig {
                failure_threshold: 1,
                timeout: std::time::Duration::from_secs(60),
                success_threshold: 1,
            },
        ))
    }

    #[test]
    fn guard_counts_while_alive_and_respects_max_load() {
        let w = worker(Some(2));
        let a = InFlightGuard::try_acquire(&w).unwrap();
        let b = InFlightGuard::try_acquire(&w).unwrap();
        assert_eq!(w.in_flight(), 2);
        assert!(!w.is_routable(now()));
        assert!(InFlightGuard::try_acquire(&w).is_none());
        drop(a);
        assert_eq!(w.in_flight(), 1);
        assert!(w.is_routable(now()));
        drop(b);
        assert_eq!(w.in_flight(), 0);
    }

    #[test]
    fn dropped_probe_gives_its_slot_back() {
        let w = worker(None);
        let mut g = InFlightGuard::try_acquire(&w).unwrap();
        assert!(g.admit());
        g.record(Outcome::Failure); // failure_threshold 1: open
        drop(g);
        assert!(!w.is_routable(now()));
        let later = now() + std::time::Duration::from_secs(61);
        assert_eq!(
            w.breaker_state(later),
            crate::pools::pool::breaker::State::HalfOpen
        );
        assert_eq!(w.admit(later), Some(Admission::Probe));
        // The probe's client cancels: the guard records neutral on drop.
        let g = InFlightGuard {
            worker: Arc::clone(&w),
            admission: Some(Admission::Probe),
            prefill: None,
            also: None,
        };
        w.in_flight.fetch_add(1, Ordering::Relaxed);
        drop(g);
        assert_eq!(w.in_flight(), 0);
        assert!(w.is_routable(later));
    }

    #[tokio::test(start_paused = true)]
    async fn prefill_reservations_end_at_the_first_byte_or_the_drop_once() {
        let w = worker(None);
        let mut g1 = InFlightGuard::try_acquire(&w).unwrap();
        g1.reserve_prefill(1000, 4000);
        let mut g2 = InFlightGuard::try_acquire(&w).unwrap();
        g2.reserve_prefill(300, 1200);
        assert_eq!(w.prefill().pending(), (2, 1300));
        // g2 saw g1 ahead of it.
        let t = g2.prefill_ticket().unwrap();
        assert_eq!(t.ahead_requests, 1);
        tokio::time::advance(std::time::Duration::from_millis(50)).await;
        g1.first_byte();
        g1.first_byte();
        assert_eq!(w.prefill().pending(), (1, 300));
        assert_eq!(
            g1.prefill_ticket().unwrap().first_byte,
            Some(std::time::Duration::from_millis(50))
        );
        drop(g1);
        assert_eq!(w.prefill().pending(), (1, 300));
        drop(g2); // never answered: released on drop
        assert_eq!(w.prefill().pending(), (0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn the_drain_re_anchors_on_each_first_byte() {
        let w = worker(None);
        let p = w.prefill();
        // Priors: 20 ms + 100 µs per token; 1000 tokens = 120 ms each.
        let mut g1 = InFlightGuard::try_acquire(&w).unwrap();
        g1.reserve_prefill(1000, 4000);
        let mut g2 = InFlightGuard::try_acquire(&w).unwrap();
        g2.reserve_prefill(1000, 4000);
        let now = crate::clock::now();
        assert!(
            (p.queue_s(now, &p.rate()) - 0.240).abs() < 1e-6,
            "{}",
            p.queue_s(now, &p.rate())
        );
        // The first answers after 50 ms, 70 ms early: the second is expected 70 ms
        // earlier too, so 120 ms of queue remain.
        tokio::time::advance(std::time::Duration::from_millis(50)).await;
        g1.first_byte();
        let now = crate::clock::now();
        assert!(
            (p.queue_s(now, &p.rate()) - 0.120).abs() < 1e-6,
            "{}",
            p.queue_s(now, &p.rate())
        );
        // The second is dropped before answering: nothing pending, no queue.
        drop(g2);
        assert_eq!(p.queue_s(crate::clock::now(), &p.rate()), 0.0);
        drop(g1);
        // A request dropped from the middle takes its own cost back out.
        let mut a = InFlightGuard::try_acquire(&w).unwrap();
        a.reserve_prefill(1000, 4000);
        let mut b = InFlightGuard::try_acquire(&w).unwrap();
        b.reserve_prefill(1000, 4000);
        drop(b);
        assert!((p.queue_s(crate::clock::now(), &p.rate()) - 0.120).abs() < 1e-6);
        drop(a);
    }
}

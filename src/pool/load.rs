//! In-flight accounting: an RAII guard per forwarded request.

use std::sync::Arc;
use std::sync::atomic::Ordering;

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
}

impl InFlightGuard {
    /// Takes a slot on `worker` if it is under its `max_load` (atomically, so two
    /// racing requests cannot both take the last slot); `None` when full.
    pub fn try_acquire(worker: &Arc<Worker>) -> Option<Self> {
        let max = worker.config().max_load.map_or(usize::MAX, |m| m.get());
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
        })
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
        if let Some(a) = self.admission.take() {
            self.worker.record(a, Outcome::Neutral, now());
        }
        self.worker.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

pub(crate) use crate::clock::now;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{WorkerConfig, WorkerUrl};
    use std::num::NonZeroUsize;

    fn worker(max_load: Option<usize>) -> Arc<Worker> {
        Arc::new(Worker::new(
            crate::pool::WorkerId(0),
            WorkerConfig {
                url: WorkerUrl::parse("http://127.0.0.1:1").unwrap(),
                max_load: max_load.and_then(NonZeroUsize::new),
                load_penalty: 0,
                cache_aware: true,
                api_key: None,
                kv_events: None,
                name: None,
                role: Default::default(),
            },
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
            crate::pool::breaker::State::HalfOpen
        );
        assert_eq!(w.admit(later), Some(Admission::Probe));
        // The probe's client cancels: the guard records neutral on drop.
        let g = InFlightGuard {
            worker: Arc::clone(&w),
            admission: Some(Admission::Probe),
        };
        w.in_flight.fetch_add(1, Ordering::Relaxed);
        drop(g);
        assert_eq!(w.in_flight(), 0);
        assert!(w.is_routable(later));
    }
}

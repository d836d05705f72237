//! In-flight accounting: an RAII guard per forwarded request.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::Worker;

/// Counts one request in flight on a worker for as long as it lives.
///
/// The proxy moves the guard into the response body, so it is dropped when the body
/// ends, fails, or the client goes away mid-stream, not when headers arrive. Every path
/// out of a request drops it exactly once; there is no manual decrement anywhere.
#[derive(Debug)]
pub struct InFlightGuard {
    worker: Arc<Worker>,
}

impl InFlightGuard {
    /// Takes a slot on `worker` if it is under its `max_load` (atomically, so two
    /// racing requests cannot both take the last slot); `None` when full.
    pub fn try_acquire(worker: &Arc<Worker>) -> Option<Self> {
        let max = worker.config.max_load.map_or(usize::MAX, |m| m.get());
        // Relaxed: the counter publishes no other memory; only its own value matters.
        worker
            .in_flight
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()?;
        Some(InFlightGuard {
            worker: Arc::clone(worker),
        })
    }

    pub fn worker(&self) -> &Arc<Worker> {
        &self.worker
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.worker.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{WorkerConfig, WorkerUrl};
    use std::num::NonZeroUsize;

    fn worker(max_load: Option<usize>) -> Arc<Worker> {
        Arc::new(Worker::new(WorkerConfig {
            url: WorkerUrl::parse("http://127.0.0.1:1").unwrap(),
            max_load: max_load.and_then(NonZeroUsize::new),
            load_penalty: 0,
            cache_aware: true,
            api_key: None,
        }))
    }

    #[test]
    fn guard_counts_while_alive_and_respects_max_load() {
        let w = worker(Some(2));
        let a = InFlightGuard::try_acquire(&w).unwrap();
        let b = InFlightGuard::try_acquire(&w).unwrap();
        assert_eq!(w.in_flight(), 2);
        assert!(!w.is_routable());
        assert!(InFlightGuard::try_acquire(&w).is_none());
        drop(a);
        assert_eq!(w.in_flight(), 1);
        assert!(w.is_routable());
        drop(b);
        assert_eq!(w.in_flight(), 0);
    }
}

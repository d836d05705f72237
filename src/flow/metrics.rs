//! The admission queue's families in `/metrics`: requests waiting now, their waits,
//! refusals by cause. Every series exists from start-up.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Unit;

use crate::metrics::Metrics;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CauseLabels {
    cause: &'static str,
}

/// Why the queue refused a request: `full` (no room for its class:
/// `proxy.queue.max_waiting`, or its place taken by a more urgent class), `class_full`
/// (its class's `proxy.queue.per_class` bound), `timeout` (its wait ran out).
pub const CAUSES: [&str; 3] = ["full", "class_full", "timeout"];

/// See the module docs.
#[derive(Debug)]
pub struct QueueMetrics {
    waiting: Gauge,
    wait: Histogram,
    rejected: [Counter; CAUSES.len()],
}

impl QueueMetrics {
    pub fn register(registry: &mut Metrics) -> Self {
        let rejected: Family<CauseLabels, Counter> = Family::default();
        let m = QueueMetrics {
            waiting: Gauge::default(),
            // 100 µs … ~100 s.
            wait: Histogram::new(exponential_buckets(0.0001, 2.0, 21)),
            rejected: CAUSES.map(|cause| rejected.get_or_create(&CauseLabels { cause }).clone()),
        };
        registry.register_family(
            "queue_waiting",
            "Requests waiting for an in-flight slot now (proxy.queue: every usable worker at max_load, or its class's share held by priority.reserve)",
            m.waiting.clone(),
        );
        registry.register_family_with_unit(
            "queue_wait",
            "How long queued requests waited before a slot freed",
            Unit::Seconds,
            m.wait.clone(),
        );
        registry.register_family(
            "queue_rejected",
            "Requests the admission queue refused (503; 429 with flow control on): full (no room for its class: max_waiting reached, or its place taken by a more urgent class), class_full (proxy.queue.per_class), timeout (its wait ran out)",
            rejected,
        );
        m
    }

    /// Requests waiting now.
    pub fn set_waiting(&self, n: usize) {
        self.waiting.set(n as i64);
    }

    /// A queued request got a slot after waiting `took`.
    pub fn waited(&self, took: Duration) {
        self.wait.observe(took.as_secs_f64());
    }

    /// A request the queue refused, by one of [`CAUSES`].
    pub fn rejected(&self, cause: &'static str) {
        if let Some(i) = CAUSES.iter().position(|c| *c == cause) {
            self.rejected[i].inc();
        }
    }
}

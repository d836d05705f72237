//! Every metric name and label, in one place, on `prometheus-client`.
//!
//! Names follow Prometheus conventions (`cache_aware_router_…_total` for counters,
//! `…_seconds` for durations; the library adds both suffixes). Per-request metrics are
//! recorded on the request path; gauges (in-flight, health, breaker, tree size) are read
//! from the current worker set when `/metrics` is scraped, so they never drift.
//!
//! Hit rate and degradations are read from `…_routing_decisions_total{reason}`:
//! hits / all, and `hit_overloaded` / (`cache_hit` + `hit_overloaded`). The engines' own
//! view sits beside the router's estimate:
//! `…_engine_cached_tokens_total / …_engine_prompt_tokens_total` per worker is the real
//! prefix-cache hit rate, `…_estimated_prefix_tokens_saved_total` (matched bytes / 4)
//! what the router expected.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

use crate::policy::Reason;
use crate::workers::WorkerSet;

/// Content type of [`Metrics::encode`]'s output (Prometheus text format 0.0.4).
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    endpoint: &'static str,
    worker: Arc<str>,
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerLabels {
    worker: Arc<str>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BreakerLabels {
    worker: Arc<str>,
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

fn latency_histogram() -> Histogram {
    // 100 µs … ~100 s.
    Histogram::new(exponential_buckets(0.0001, 2.0, 21))
}

fn decision_histogram() -> Histogram {
    // 1 µs … ~16 ms.
    Histogram::new(exponential_buckets(0.000_001, 2.0, 15))
}

/// The router's metrics. One instance per process, handed to the proxy and `/metrics`.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    decisions: Family<ReasonLabels, Counter>,
    estimated_saved: Family<WorkerLabels, Counter>,
    engine_cached: Family<WorkerLabels, Counter>,
    engine_prompt: Family<WorkerLabels, Counter>,
    decision_time: Histogram,
    ttfb: Family<WorkerLabels, Histogram, fn() -> Histogram>,
    duration: Family<WorkerLabels, Histogram, fn() -> Histogram>,
    in_flight: Family<WorkerLabels, Gauge>,
    healthy: Family<WorkerLabels, Gauge>,
    breaker: Family<BreakerLabels, Gauge>,
    tree_nodes: Gauge,
    tree_bytes: Gauge,
    evicted: Counter,
    skipped_inserts: Counter,
    retries: Counter,
    reloads: Family<ResultLabels, Counter>,
    /// Set-level totals already added to `evicted`/`skipped_inserts` (they live in
    /// each `WorkerSet` and restart at 0 with a new set).
    seen_evicted: AtomicU64,
    seen_skipped: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates and registers every family.
    pub fn new() -> Self {
        let mut r = Registry::with_prefix("cache_aware_router");
        let m = Metrics {
            requests: Family::default(),
            decisions: Family::default(),
            estimated_saved: Family::default(),
            engine_cached: Family::default(),
            engine_prompt: Family::default(),
            decision_time: decision_histogram(),
            ttfb: Family::new_with_constructor(latency_histogram),
            duration: Family::new_with_constructor(latency_histogram),
            in_flight: Family::default(),
            healthy: Family::default(),
            breaker: Family::default(),
            tree_nodes: Gauge::default(),
            tree_bytes: Gauge::default(),
            evicted: Counter::default(),
            skipped_inserts: Counter::default(),
            retries: Counter::default(),
            reloads: Family::default(),
            seen_evicted: AtomicU64::new(0),
            seen_skipped: AtomicU64::new(0),
            registry: Registry::default(),
        };
        r.register(
            "requests",
            "Requests answered, by endpoint, worker (\"none\" when the router answered) and status",
            m.requests.clone(),
        );
        r.register(
            "routing_decisions",
            "Routing decisions by reason: cache_hit, hit_overloaded (a degradation), miss, empty_text, no_worker",
            m.decisions.clone(),
        );
        r.register(
            "estimated_prefix_tokens_saved",
            "Prefix tokens the router expects the worker to reuse (matched bytes / 4)",
            m.estimated_saved.clone(),
        );
        r.register(
            "engine_cached_tokens",
            "Cached prompt tokens the engines reported (usage.prompt_tokens_details.cached_tokens)",
            m.engine_cached.clone(),
        );
        r.register(
            "engine_prompt_tokens",
            "Prompt tokens the engines reported (usage.prompt_tokens) in responses that carried usage",
            m.engine_prompt.clone(),
        );
        r.register_with_unit(
            "decision_duration",
            "Time to extract the prompt and pick a worker",
            Unit::Seconds,
            m.decision_time.clone(),
        );
        r.register_with_unit(
            "time_to_first_byte",
            "From the request's arrival to the worker's response headers",
            Unit::Seconds,
            m.ttfb.clone(),
        );
        r.register_with_unit(
            "request_duration",
            "From the request's arrival to the end of the response body",
            Unit::Seconds,
            m.duration.clone(),
        );
        r.register(
            "worker_in_flight",
            "Requests in flight per worker",
            m.in_flight.clone(),
        );
        r.register(
            "worker_healthy",
            "1 when the worker passes health checks",
            m.healthy.clone(),
        );
        r.register(
            "worker_breaker_state",
            "1 for the worker's current circuit-breaker state",
            m.breaker.clone(),
        );
        r.register(
            "tree_nodes",
            "Nodes in the prefix tree",
            m.tree_nodes.clone(),
        );
        r.register(
            "tree_bytes",
            "Bytes of routing text in the prefix tree",
            m.tree_bytes.clone(),
        );
        r.register(
            "tree_evicted_nodes",
            "Tree nodes removed by eviction passes",
            m.evicted.clone(),
        );
        r.register(
            "tree_skipped_inserts",
            "Tree inserts skipped because an eviction pass was running",
            m.skipped_inserts.clone(),
        );
        r.register(
            "retries",
            "Requests re-sent to another worker",
            m.retries.clone(),
        );
        r.register(
            "reloads",
            "SIGHUP reloads by result (applied, rejected, invalid)",
            m.reloads.clone(),
        );
        Metrics { registry: r, ..m }
    }

    /// One routing decision and how long it took.
    pub fn decision(&self, reason: Reason, took: Duration) {
        self.decisions
            .get_or_create(&ReasonLabels {
                reason: reason.as_str(),
            })
            .inc();
        if reason != Reason::NoWorker {
            self.decision_time.observe(took.as_secs_f64());
        }
    }

    /// Prefix bytes matched on the chosen worker for a hit, recorded as tokens (÷ 4).
    pub fn estimated_saved(&self, worker: &Arc<str>, matched_bytes: usize) {
        if matched_bytes >= 4 {
            self.estimated_saved
                .get_or_create(&WorkerLabels {
                    worker: Arc::clone(worker),
                })
                .inc_by(matched_bytes as u64 / 4);
        }
    }

    /// A response (or an error the router answered itself, with worker `none`).
    pub fn request(&self, endpoint: &'static str, worker: &Arc<str>, status: u16) {
        self.requests
            .get_or_create(&RequestLabels {
                endpoint,
                worker: Arc::clone(worker),
                status,
            })
            .inc();
    }

    /// Response headers arrived from `worker` after `elapsed`.
    pub fn first_byte(&self, worker: &Arc<str>, elapsed: Duration) {
        self.ttfb
            .get_or_create(&WorkerLabels {
                worker: Arc::clone(worker),
            })
            .observe(elapsed.as_secs_f64());
    }

    /// The response body from `worker` ended (or was dropped) after `elapsed`.
    pub fn finished(&self, worker: &Arc<str>, elapsed: Duration) {
        self.duration
            .get_or_create(&WorkerLabels {
                worker: Arc::clone(worker),
            })
            .observe(elapsed.as_secs_f64());
    }

    /// Token usage an engine reported in a response.
    pub fn engine_usage(&self, worker: &Arc<str>, prompt_tokens: u64, cached_tokens: u64) {
        let labels = WorkerLabels {
            worker: Arc::clone(worker),
        };
        self.engine_prompt
            .get_or_create(&labels)
            .inc_by(prompt_tokens);
        self.engine_cached
            .get_or_create(&labels)
            .inc_by(cached_tokens);
    }

    pub fn retry(&self) {
        self.retries.inc();
    }

    /// A reload attempt: `applied`, `rejected` or `invalid`.
    pub fn reload(&self, result: &'static str) {
        self.reloads.get_or_create(&ResultLabels { result }).inc();
    }

    /// Prometheus text exposition, with gauges read from `set` now.
    pub fn encode(&self, set: &WorkerSet) -> String {
        let now = crate::workers::now();
        self.in_flight.clear();
        self.healthy.clear();
        self.breaker.clear();
        for w in set.workers() {
            let labels = WorkerLabels {
                worker: Arc::clone(w.label()),
            };
            self.in_flight
                .get_or_create(&labels)
                .set(w.in_flight() as i64);
            self.healthy
                .get_or_create(&labels)
                .set(i64::from(w.is_healthy()));
            let state = w.breaker_state(now);
            for s in [
                crate::breaker::State::Closed,
                crate::breaker::State::Open,
                crate::breaker::State::HalfOpen,
            ] {
                self.breaker
                    .get_or_create(&BreakerLabels {
                        worker: Arc::clone(w.label()),
                        state: s.as_str(),
                    })
                    .set(i64::from(s == state));
            }
        }
        {
            let tree = set.tree();
            self.tree_nodes.set(tree.node_count() as i64);
            self.tree_bytes.set(tree.total_bytes() as i64);
        }
        catch_up(&self.evicted, &self.seen_evicted, &set.evicted_nodes);
        catch_up(
            &self.skipped_inserts,
            &self.seen_skipped,
            &set.skipped_inserts,
        );
        let mut out = String::with_capacity(16 * 1024);
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry);
        out
    }
}

/// Adds to `counter` what `source` (a per-set total, which restarts at 0 in a new set)
/// gained since the last scrape.
fn catch_up(counter: &Counter, seen: &AtomicU64, source: &AtomicU64) {
    let now = source.load(Ordering::Relaxed);
    let before = seen.swap(now, Ordering::Relaxed);
    counter.inc_by(if now >= before { now - before } else { now });
}

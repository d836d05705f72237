//! The request path's families in `/metrics`: requests, routing decisions and their
//! time, latencies, the engines' token usage and the prefix numbers per worker, retries,
//! fallback picks, back-pressure and how each request ended (the admission queue's are
//! `crate::flow`'s). They
//! are updated as requests go (gauges of the pool itself are read at scrape time by
//! `pools::pool::metrics`); before each scrape every current worker gets its series at
//! 0, and a worker that leaves takes its series with it.
//!
//! Hit rate and degradations are read from `…_routing_decisions_total{reason}`:
//! hits / all, and `hit_overloaded` / (`cache_hit` + `hit_overloaded`). The engines' own
//! view sits beside the router's estimate:
//! `…_engine_cached_tokens_total / …_engine_prompt_tokens_total` per worker is the real
//! prefix-cache hit rate, `…_estimated_prefix_tokens_saved_total` (the hits' predicted tokens)
//! what the router expected.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Unit;

mod handles;
pub mod pd;
pub mod streams;

use crate::metrics::{BeforeScrape, Metrics};
use crate::policy::Reason;
use crate::pools::pool::{Pool, PoolListener, Worker, WorkerSet};

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

/// One of a worker's prefix numbers under one policy (see `pool::hits`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PrefixLabels {
    worker: Arc<str>,
    policy: &'static str,
    /// `available`, `predicted` or `delivered`.
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

/// How a request's exchange with its client ended, one per request (the access log's
/// `outcome`): `complete` (the whole answer, the router's own errors included),
/// `client_gone` (the client left first, before or after the headers),
/// `upstream_error` (the worker broke the body), `upstream_idle_timeout`.
pub const OUTCOMES: [&str; 4] = [
    "complete",
    "client_gone",
    "upstream_error",
    "upstream_idle_timeout",
];

fn latency_histogram() -> Histogram {
    // 100 µs … ~100 s.
    Histogram::new(exponential_buckets(0.0001, 2.0, 21))
}

fn decision_histogram() -> Histogram {
    // 1 µs … ~16 ms.
    Histogram::new(exponential_buckets(0.000_001, 2.0, 15))
}

/// The request path's families (see the module docs). One per process, built by
/// [`RequestMetrics::register`] and held by the proxy.
#[derive(Debug)]
pub struct RequestMetrics {
    requests: Family<RequestLabels, Counter>,
    decisions: Family<ReasonLabels, Counter>,
    estimated_saved: Family<WorkerLabels, Counter>,
    engine_cached: Family<WorkerLabels, Counter>,
    engine_prompt: Family<WorkerLabels, Counter>,
    prefix_tokens: Family<PrefixLabels, Counter>,
    drift: Family<WorkerLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    drift_low: Family<WorkerLabels, Gauge>,
    decision_time: Histogram,
    ttfb: Family<WorkerLabels, Histogram, fn() -> Histogram>,
    duration: Family<WorkerLabels, Histogram, fn() -> Histogram>,
    retries: Counter,
    fallback_picks: Counter,
    back_pressure: Family<WorkerLabels, Counter>,
    /// Every worker label with series of its own that outlive a scrape, and the label
    /// sets its label alone does not name (see [`Noted`]); a worker's entry and
    /// series go when it leaves ([`RequestMetrics::forget_worker`]).
    noted: std::sync::Mutex<std::collections::HashMap<Arc<str>, Noted>>,
    /// The per-worker series a routed request updates, resolved once per worker.
    handles: handles::Handles,
    outcomes: Family<OutcomeLabels, Counter>,
    /// `routing_decisions_total` per [`REASONS`] entry, resolved once (each request counts
    /// one).
    decision_counts: [Counter; REASONS.len()],
    /// `request_outcomes_total` per [`OUTCOMES`] entry, resolved once.
    outcome_counts: [Counter; OUTCOMES.len()],
    /// The `pd_` families (disaggregated pools).
    pd: pd::PdMetrics,
    /// Stream continuation and hedging.
    streams: streams::StreamMetrics,
}

/// The per-worker families a routed request updates (see [`RequestMetrics::register`]).
fn register_worker_families(r: &mut Metrics, m: &RequestMetrics) {
    r.register_family(
        "requests",
        "Requests answered, by endpoint, worker (\"none\" when the router answered) and status",
        m.requests.clone(),
    );
    r.register_family(
        "routing_decisions",
        "Routing decisions by reason: cache_hit, hit_overloaded (a degradation), miss, empty_text, no_worker",
        m.decisions.clone(),
    );
    r.register_family(
        "estimated_prefix_tokens_saved",
        "Prefix tokens the router expects the worker to reuse on its hits (whole KV blocks; estimated from bytes at the worker's learned tokens per byte in approximate mode)",
        m.estimated_saved.clone(),
    );
    r.register_family(
        "engine_cached_tokens",
        "Cached prompt tokens the engines reported (usage.prompt_tokens_details.cached_tokens)",
        m.engine_cached.clone(),
    );
    r.register_family(
        "engine_prompt_tokens",
        "Prompt tokens the engines reported (usage.prompt_tokens) in responses that carried usage",
        m.engine_prompt.clone(),
    );
    r.register_family(
        "prefix_tokens",
        "Prefix tokens of the answers that reported cached tokens, by worker, policy and kind: available (the longest any worker held), predicted (what the router believed the chosen worker held), delivered (the engine's cached_tokens); in whole KV blocks, estimated from bytes at the worker's learned tokens per byte in approximate mode",
        m.prefix_tokens.clone(),
    );
    r.register_family(
        "worker_hit_drift",
        "Delivered / predicted prefix tokens over a worker's last 100 answers that predicted a hit (absent until 10)",
        m.drift.clone(),
    );
    r.register_family(
        "worker_hit_drift_low",
        "1 while a worker's drift has stayed under cache.drift_floor for a minute: the router's memory of its KV cache is stale",
        m.drift_low.clone(),
    );
    r.register_family_with_unit(
        "decision_duration",
        "Time to extract the prompt and pick a worker",
        Unit::Seconds,
        m.decision_time.clone(),
    );
}

/// The request path's pool-wide families (see [`RequestMetrics::register`]).
fn register_request_families(r: &mut Metrics, m: &RequestMetrics) {
    r.register_family_with_unit(
        "time_to_first_byte",
        "From the request's arrival to the worker's response headers",
        Unit::Seconds,
        m.ttfb.clone(),
    );
    r.register_family_with_unit(
        "request_duration",
        "From the request's arrival to the end of the response body",
        Unit::Seconds,
        m.duration.clone(),
    );
    r.register_family(
        "retries",
        "Requests re-sent to another worker",
        m.retries.clone(),
    );
    r.register_family(
        "fallback_picks",
        "Attempts sent to a `role: fallback` worker (no primary worker was usable)",
        m.fallback_picks.clone(),
    );
    r.register_family(
        "request_outcomes",
        "Requests by how their client's exchange ended: complete, client_gone (before or after the headers), upstream_error, upstream_idle_timeout",
        m.outcomes.clone(),
    );
    r.register_family(
        "back_pressure",
        "429 (or 503 with Retry-After) answers per worker; not counted by the circuit breaker",
        m.back_pressure.clone(),
    );
}

/// A worker that leaves the pool takes its series with it.
impl PoolListener for RequestMetrics {
    fn worker_left(&self, worker: &Worker) {
        self.forget_worker(worker.label());
    }
}

/// Before each scrape: every worker of the pool gets its series at 0 (see
/// [`RequestMetrics::worker_series`]).
struct WorkerSeries {
    metrics: Arc<RequestMetrics>,
    pool: Arc<Pool>,
    /// The policy that labels `prefix_tokens_total`.
    policy: &'static str,
}

impl BeforeScrape for WorkerSeries {
    fn before_scrape(&self) {
        self.metrics.worker_series(&self.pool.set(), self.policy);
    }
}

/// Worker labels of answers the router gave itself ([`NO_WORKER`]) or replayed from the
/// response cache ([`CACHE_WORKER`]): never a pool's worker, so never forgotten.
pub const NO_WORKER: &str = "none";
pub const CACHE_WORKER: &str = "cache";

/// A worker's label sets that its label alone does not name, noted as they are first
/// created so that they can be removed: `requests_total` has one per endpoint and
/// status, `prefix_tokens_total` one per policy (a reload may change it).
#[derive(Debug, Default)]
struct Noted {
    requests: Vec<(&'static str, u16)>,
    policies: Vec<&'static str>,
}

/// Every decision reason, for series at 0 from start-up.
const REASONS: [Reason; 9] = [
    Reason::CacheHit,
    Reason::HitOverloaded,
    Reason::Miss,
    Reason::EmptyText,
    Reason::NoWorker,
    Reason::Session,
    Reason::Conversation,
    Reason::CacheSignal,
    Reason::FanOut,
];

/// `prefix_tokens_total`'s kinds.
const PREFIX_KINDS: [&str; 3] = ["available", "predicted", "delivered"];

impl Default for RequestMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl RequestMetrics {
    /// The families, with the series every process shows at 0 from start-up (each
    /// decision reason and outcome), in no registry yet: see
    /// [`RequestMetrics::register`].
    pub fn new() -> Self {
        let mut m = RequestMetrics {
            requests: Family::default(),
            decisions: Family::default(),
            estimated_saved: Family::default(),
            engine_cached: Family::default(),
            engine_prompt: Family::default(),
            prefix_tokens: Family::default(),
            drift: Family::default(),
            drift_low: Family::default(),
            decision_time: decision_histogram(),
            ttfb: Family::new_with_constructor(latency_histogram),
            duration: Family::new_with_constructor(latency_histogram),
            retries: Counter::default(),
            fallback_picks: Counter::default(),
            back_pressure: Family::default(),
            noted: Default::default(),
            handles: Default::default(),
            outcomes: Family::default(),
            decision_counts: Default::default(),
            outcome_counts: Default::default(),
            pd: pd::PdMetrics::new(),
            streams: streams::StreamMetrics::new(),
        };
        for (reason, count) in REASONS.iter().zip(&mut m.decision_counts) {
            *count = m
                .decisions
                .get_or_create(&ReasonLabels {
                    reason: reason.as_str(),
                })
                .clone();
        }
        for (outcome, count) in OUTCOMES.iter().zip(&mut m.outcome_counts) {
            *count = m.outcomes.get_or_create(&OutcomeLabels { outcome }).clone();
        }
        m
    }

    /// The request path's families, registered in `registry`. Before each scrape every
    /// worker of `pool` gets its series at 0 (`prefix_tokens_total` under `policy`, the
    /// policy that routes over it); a worker that leaves `pool` takes its series.
    pub fn register(registry: &mut Metrics, pool: &Arc<Pool>, policy: &'static str) -> Arc<Self> {
        let m = Arc::new(Self::new());
        register_worker_families(registry, &m);
        register_request_families(registry, &m);
        m.pd.register(registry);
        m.streams.register(registry);
        registry.before_scrape(Arc::new(WorkerSeries {
            metrics: Arc::clone(&m),
            pool: Arc::clone(pool),
            policy,
        }));
        pool.listen(Arc::clone(&m) as Arc<dyn PoolListener>);
        m
    }

    /// Gives every worker of `set` its per-worker series at 0 (those its events would
    /// create: saved and engine tokens, `prefix_tokens_total` under `policy`, drift,
    /// latency histograms), so a worker's first increments are seen; forgets every
    /// worker not in `set` that still has series (an answer that finished after its
    /// worker left made them again).
    fn worker_series(&self, set: &WorkerSet, policy: &'static str) {
        let now: Vec<Arc<str>> = set
            .workers()
            .iter()
            .map(|w| Arc::clone(w.label()))
            .collect();
        let gone: Vec<Arc<str>> = self
            .noted()
            .keys()
            .filter(|l| !now.contains(l) && !matches!(&***l, NO_WORKER | CACHE_WORKER))
            .cloned()
            .collect();
        for label in &gone {
            self.forget_worker(label);
        }
        for w in &now {
            let labels = WorkerLabels {
                worker: Arc::clone(w),
            };
            for f in [
                &self.estimated_saved,
                &self.engine_cached,
                &self.engine_prompt,
            ] {
                let _ = f.get_or_create(&labels);
            }
            let _ = self.drift_low.get_or_create(&labels);
            let _ = self.ttfb.get_or_create(&labels);
            let _ = self.duration.get_or_create(&labels);
            let _ = self.back_pressure.get_or_create(&labels);
            for kind in PREFIX_KINDS {
                let _ = self.prefix_tokens.get_or_create(&PrefixLabels {
                    worker: Arc::clone(w),
                    policy,
                    kind,
                });
            }
            self.note_policy(w, policy);
        }
        self.handles.retain(self, &now);
    }

    fn noted(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<Arc<str>, Noted>> {
        self.noted.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Notes that `worker` has series of its own (created on its first update).
    fn note_worker(&self, worker: &Arc<str>) {
        self.noted().entry(Arc::clone(worker)).or_default();
    }

    /// Notes `worker`'s `prefix_tokens_total` series under `policy`.
    fn note_policy(&self, worker: &Arc<str>, policy: &'static str) {
        let mut noted = self.noted();
        let n = noted.entry(Arc::clone(worker)).or_default();
        if !n.policies.contains(&policy) {
            n.policies.push(policy);
        }
    }

    /// Removes every series of the worker labelled `worker`: it left the pool (the
    /// admin API, a reload, discovery), so under churn the exposition stays as large as
    /// the pool. Series read from the pool at scrape time (in-flight, health, breaker,
    /// engine signals, KV-event feeds) are rebuilt by each scrape and need nothing here.
    pub fn forget_worker(&self, worker: &Arc<str>) {
        let noted = self.noted().remove(worker).unwrap_or_default();
        let labels = WorkerLabels {
            worker: Arc::clone(worker),
        };
        for f in [
            &self.estimated_saved,
            &self.engine_cached,
            &self.engine_prompt,
            &self.back_pressure,
        ] {
            f.remove(&labels);
        }
        self.drift.remove(&labels);
        self.drift_low.remove(&labels);
        self.ttfb.remove(&labels);
        self.duration.remove(&labels);
        for (endpoint, status) in noted.requests {
            self.requests.remove(&RequestLabels {
                endpoint,
                worker: Arc::clone(worker),
                status,
            });
        }
        for policy in noted.policies {
            for kind in PREFIX_KINDS {
                self.prefix_tokens.remove(&PrefixLabels {
                    worker: Arc::clone(worker),
                    policy,
                    kind,
                });
            }
        }
        self.handles.forget(worker);
    }

    /// One routing decision and how long it took.
    pub fn decision(&self, reason: Reason, took: Duration) {
        match REASONS.iter().position(|r| *r == reason) {
            Some(i) => self.decision_counts[i].inc(),
            None => self
                .decisions
                .get_or_create(&ReasonLabels {
                    reason: reason.as_str(),
                })
                .inc(),
        };
        if reason != Reason::NoWorker {
            self.decision_time.observe(took.as_secs_f64());
        }
    }

    /// Prefix tokens the chosen worker is expected to reuse on a hit
    /// ([`crate::policy::Pick::saved_tokens`]).
    pub fn estimated_saved(&self, worker: &Arc<str>, tokens: u64) {
        if tokens > 0 {
            self.handles
                .get(self, worker)
                .estimated_saved
                .inc_by(tokens);
        }
    }

    /// A response (or an error the router answered itself, with worker `none`).
    pub fn request(&self, endpoint: &'static str, worker: &Arc<str>, status: u16) {
        let labels = RequestLabels {
            endpoint,
            worker: Arc::clone(worker),
            status,
        };
        if let Some(c) = self.requests.get(&labels) {
            c.inc();
            return;
        }
        self.requests.get_or_create(&labels).inc();
        let mut noted = self.noted();
        let n = noted.entry(Arc::clone(worker)).or_default();
        if !n.requests.contains(&(endpoint, status)) {
            n.requests.push((endpoint, status));
        }
    }

    /// Response headers arrived from `worker` after `elapsed`.
    pub fn first_byte(&self, worker: &Arc<str>, elapsed: Duration) {
        self.handles
            .get(self, worker)
            .ttfb
            .observe(elapsed.as_secs_f64());
    }

    /// The response body from `worker` ended (or was dropped) after `elapsed`.
    pub fn finished(&self, worker: &Arc<str>, elapsed: Duration) {
        self.handles
            .get(self, worker)
            .duration
            .observe(elapsed.as_secs_f64());
    }

    /// Token usage an engine reported in a response.
    pub fn engine_usage(&self, worker: &Arc<str>, prompt_tokens: u64, cached_tokens: u64) {
        let h = self.handles.get(self, worker);
        h.engine_prompt.inc_by(prompt_tokens);
        h.engine_cached.inc_by(cached_tokens);
    }

    /// One answer's three prefix numbers (tokens), and its worker's drift after it.
    pub fn prefix_tokens(
        &self,
        worker: &Arc<str>,
        policy: &'static str,
        [available, predicted, delivered]: [u64; 3],
        drift: crate::pools::pool::hits::DriftNow,
    ) {
        let h = self.handles.get(self, worker);
        let numbers = [available, predicted, delivered];
        match h.prefix(self, policy) {
            Some(c) => {
                for (c, n) in c.iter().zip(numbers) {
                    c.inc_by(n);
                }
            }
            // Another policy than the handles were made under (a reload).
            None => {
                self.note_policy(worker, policy);
                for (kind, n) in PREFIX_KINDS.into_iter().zip(numbers) {
                    self.prefix_tokens
                        .get_or_create(&PrefixLabels {
                            worker: Arc::clone(worker),
                            policy,
                            kind,
                        })
                        .inc_by(n);
                }
            }
        }
        if let Some(r) = drift.ratio {
            h.drift(self).set(r);
        }
        h.drift_low.set(i64::from(drift.low));
    }

    /// The `pd_` families.
    pub fn pd(&self) -> &pd::PdMetrics {
        &self.pd
    }

    /// The stream continuation and hedging families.
    pub fn streams(&self) -> &streams::StreamMetrics {
        &self.streams
    }

    pub fn retry(&self) {
        self.retries.inc();
    }

    /// An attempt sent to a fallback worker.
    pub fn fallback_pick(&self) {
        self.fallback_picks.inc();
    }

    /// A 429 or 503 + Retry-After from `worker`.
    pub fn back_pressure(&self, worker: &Arc<str>) {
        self.note_worker(worker);
        self.back_pressure
            .get_or_create(&WorkerLabels {
                worker: Arc::clone(worker),
            })
            .inc();
    }

    /// How one request ended, one of [`OUTCOMES`].
    pub fn outcome(&self, outcome: &'static str) {
        match OUTCOMES.iter().position(|o| *o == outcome) {
            Some(i) => self.outcome_counts[i].inc(),
            None => self
                .outcomes
                .get_or_create(&OutcomeLabels { outcome })
                .inc(),
        };
    }
}

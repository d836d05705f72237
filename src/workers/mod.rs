//! Workers (upstream replicas) and the immutable snapshot of the pool.
//!
//! A [`Worker`] owns the state that must survive a reload: in-flight count and health.
//! A [`WorkerSet`] is one version of the pool: its workers in order (a worker's index is
//! its [`WorkerId`] in this set), the radix tree of what was routed to them, and the
//! `/v1/models` cache. Requests load the current set once (arc-swap) and keep it, so a
//! reload never changes the pool under a request in flight. A reload builds a new set,
//! reusing the `Arc<Worker>` of workers that stay, with a fresh tree.

mod load;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

pub use load::InFlightGuard;
pub(crate) use load::now;

use crate::breaker::{self, Admission, CircuitBreaker, Outcome};
use crate::config::{BreakerConfig, WorkerConfig};
use crate::precise::feed::Feed;
use crate::tree::RadixTree;
pub use crate::tree::WorkerId;

/// One upstream inference server.
#[derive(Debug)]
pub struct Worker {
    config: WorkerConfig,
    /// The normalised URL as a shared string: metric label and log field.
    label: Arc<str>,
    /// Requests forwarded and not yet finished (body ended or dropped).
    in_flight: AtomicUsize,
    healthy: AtomicBool,
    /// One lock for the whole state machine: a transition is one step.
    breaker: Mutex<CircuitBreaker>,
    /// Consecutive probe results, owned by the health-check task.
    probes: Mutex<ProbeRun>,
    /// Its KV-event feeds (precise mode), one per DP rank in rank order; empty
    /// without `kv_events`.
    feeds: Vec<Arc<Feed>>,
}

/// Consecutive health-probe results of one worker.
#[derive(Debug, Default)]
pub struct ProbeRun {
    pub successes: u32,
    pub failures: u32,
}

impl Worker {
    /// A worker that starts healthy, breaker closed, nothing in flight.
    pub fn new(config: WorkerConfig, breaker: &BreakerConfig) -> Self {
        let feeds = config
            .kv_events
            .as_ref()
            .map(|k| Feed::ranks(&config.url, k, now()))
            .unwrap_or_default();
        Worker {
            label: Arc::from(config.url.to_string()),
            feeds,
            config,
            in_flight: AtomicUsize::new(0),
            healthy: AtomicBool::new(true),
            breaker: Mutex::new(CircuitBreaker::new(breaker)),
            probes: Mutex::new(ProbeRun::default()),
        }
    }

    fn breaker(&self) -> MutexGuard<'_, CircuitBreaker> {
        self.breaker.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The breaker's state at `now`.
    pub fn breaker_state(&self, now: Instant) -> breaker::State {
        self.breaker().state(now)
    }

    /// Asks the breaker to admit one request; logs a transition.
    pub fn admit(&self, now: Instant) -> Option<Admission> {
        let (admission, transition) = self.breaker().admit(now);
        if let Some(t) = transition {
            tracing::info!(worker = %self.config.url, from = t.from.as_str(), to = t.to.as_str(), "circuit breaker");
        }
        admission
    }

    /// Records how an admitted request ended; logs a transition.
    pub fn record(&self, admission: Admission, outcome: Outcome, now: Instant) {
        let transition = self.breaker().record(admission, outcome, now);
        if let Some(t) = transition {
            let level_warn = t.to == breaker::State::Open;
            if level_warn {
                tracing::warn!(worker = %self.config.url, from = t.from.as_str(), to = t.to.as_str(), "circuit breaker");
            } else {
                tracing::info!(worker = %self.config.url, from = t.from.as_str(), to = t.to.as_str(), "circuit breaker");
            }
        }
    }

    /// The health-probe counters (health-check task only).
    pub fn probe_run(&self) -> MutexGuard<'_, ProbeRun> {
        self.probes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The worker's KV-event feeds, one per DP rank (`kv_events.dp_size`) in rank
    /// order; empty when it has no `kv_events`.
    pub fn feeds(&self) -> &[Arc<Feed>] {
        &self.feeds
    }

    pub fn config(&self) -> &WorkerConfig {
        &self.config
    }

    /// The URL as a shared string (metric label).
    pub fn label(&self) -> &Arc<str> {
        &self.label
    }

    pub fn url(&self) -> &crate::config::WorkerUrl {
        &self.config.url
    }

    /// Requests in flight now. Relaxed: a load estimate, nothing else is published
    /// through this counter.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// In-flight count plus the configured penalty: what load comparisons use.
    pub fn load(&self) -> usize {
        self.in_flight() + self.config.load_penalty as usize
    }

    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Sets health; returns whether it changed (the caller logs the transition).
    pub fn set_healthy(&self, healthy: bool) -> bool {
        self.healthy.swap(healthy, Ordering::Relaxed) != healthy
    }

    /// Whether another request may be sent at `now`: healthy, breaker admitting, and
    /// under `max_load`.
    pub fn is_routable(&self, now: Instant) -> bool {
        self.is_healthy() && self.has_capacity() && self.breaker().is_available(now)
    }

    fn has_capacity(&self) -> bool {
        self.config
            .max_load
            .is_none_or(|max| self.in_flight() < max.get())
    }
}

/// One version of the worker pool, with its tree. See the module docs.
#[derive(Debug)]
pub struct WorkerSet {
    workers: Vec<Arc<Worker>>,
    tree: Mutex<RadixTree>,
    round_robin: AtomicUsize,
    /// Set while an eviction pass runs: inserts are then skipped (and counted).
    evicting: AtomicBool,
    /// Inserts skipped because an eviction pass was running.
    pub skipped_inserts: AtomicU64,
    /// Nodes removed by eviction passes.
    pub evicted_nodes: AtomicU64,
    /// The cached `/v1/models` answer of this set (dropped with the set on reload).
    pub models: crate::proxy::models::ModelsCache,
}

impl WorkerSet {
    /// A set over `workers` (in order) with an empty tree.
    pub fn new(workers: Vec<Arc<Worker>>) -> Self {
        Self::with_tree(workers, RadixTree::new())
    }

    /// A set over `workers` with a tree whose ids already match their order.
    pub fn with_tree(workers: Vec<Arc<Worker>>, tree: RadixTree) -> Self {
        WorkerSet {
            workers,
            tree: Mutex::new(tree),
            round_robin: AtomicUsize::new(0),
            evicting: AtomicBool::new(false),
            skipped_inserts: AtomicU64::new(0),
            evicted_nodes: AtomicU64::new(0),
            models: Default::default(),
        }
    }

    pub fn workers(&self) -> &[Arc<Worker>] {
        &self.workers
    }

    pub fn get(&self, id: WorkerId) -> Option<&Arc<Worker>> {
        self.workers.get(id.0 as usize)
    }

    pub fn ids(&self) -> impl Iterator<Item = WorkerId> + '_ {
        (0..self.workers.len() as u32).map(WorkerId)
    }

    /// Locks the tree. Hold it for one decision only, never across an `.await`.
    /// A poisoned lock (a panic while holding it) is recovered: the tree is a cache and
    /// stays structurally valid between operations.
    pub fn tree(&self) -> MutexGuard<'_, RadixTree> {
        self.tree.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether an eviction pass is running (Relaxed: a hint, the lock orders the data).
    pub fn is_evicting(&self) -> bool {
        self.evicting.load(Ordering::Relaxed)
    }

    /// Marks an eviction pass as running or done.
    pub fn set_evicting(&self, on: bool) {
        self.evicting.store(on, Ordering::Relaxed);
    }

    /// The next round-robin ticket.
    pub fn next_ticket(&self) -> usize {
        self.round_robin.fetch_add(1, Ordering::Relaxed)
    }

    /// Workers that are healthy now.
    pub fn healthy_count(&self) -> usize {
        self.workers.iter().filter(|w| w.is_healthy()).count()
    }
}

//! Workers (upstream replicas) and the immutable snapshot of the pool.
//!
//! A [`Worker`] owns the state that must survive a reload: in-flight count and health.
//! A [`WorkerSet`] is one version of the pool: its workers in order (a worker's index is
//! its [`WorkerId`] in this set), the radix tree of what was routed to them, and the
//! `/v1/models` cache. Requests load the current set once (arc-swap) and keep it, so a
//! reload never changes the pool under a request in flight. A reload builds a new set,
//! reusing the `Arc<Worker>` of workers that stay, with a fresh tree.

mod load;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

pub use load::InFlightGuard;

use crate::config::WorkerConfig;
pub use crate::tree::WorkerId;
use crate::tree::{RadixTree, WorkerMask};

/// One upstream inference server.
#[derive(Debug)]
pub struct Worker {
    config: WorkerConfig,
    /// Requests forwarded and not yet finished (body ended or dropped).
    in_flight: AtomicUsize,
    healthy: AtomicBool,
}

impl Worker {
    /// A worker that starts healthy with nothing in flight.
    pub fn new(config: WorkerConfig) -> Self {
        Worker {
            config,
            in_flight: AtomicUsize::new(0),
            healthy: AtomicBool::new(true),
        }
    }

    pub fn config(&self) -> &WorkerConfig {
        &self.config
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

    /// Whether another request may be sent now: healthy and under `max_load`.
    pub fn is_routable(&self) -> bool {
        self.is_healthy() && self.has_capacity()
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
    /// The cached `/v1/models` answer of this set (dropped with the set on reload).
    pub models: crate::proxy::models::ModelsCache,
}

impl WorkerSet {
    /// A set over `workers` (in order) with an empty tree.
    pub fn new(workers: Vec<Arc<Worker>>) -> Self {
        WorkerSet {
            workers,
            tree: Mutex::new(RadixTree::new()),
            round_robin: AtomicUsize::new(0),
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

    /// The next round-robin ticket.
    pub fn next_ticket(&self) -> usize {
        self.round_robin.fetch_add(1, Ordering::Relaxed)
    }

    /// Workers that are healthy now.
    pub fn healthy_count(&self) -> usize {
        self.workers.iter().filter(|w| w.is_healthy()).count()
    }

    /// Ids of the workers that take prefix affinity.
    pub fn cache_aware_mask(&self) -> WorkerMask {
        self.ids()
            .filter(|id| self.workers[id.0 as usize].config.cache_aware)
            .collect()
    }
}

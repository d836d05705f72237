//! The worker pool: who the workers are (membership, identity), whether they can take a
//! request (health, breaker, in-flight load), and one path for every membership change.
//!
//! Terms: a **worker** is one upstream replica. Its **key** is its `name`, or its
//! normalised URL when it has none; its [`WorkerId`] is a small dense handle the pool
//! gives that key while it is in the pool, so policies can keep per-worker state in bit
//! sets and arrays. A worker keeps its id across reloads, reorders and the removal of
//! other workers; only its own removal frees the id, and only after every
//! [`PoolListener`] has forgotten it, so a later worker given the same id inherits no
//! stale routing memory.
//!
//! Depends on config only; the proxy, policies, health checks, reload, the admin API and
//! the KV-event supervisor depend on it, never the other way round.

pub mod adapters;
pub mod breaker;
mod fetch;
pub mod health;
pub mod hits;
pub mod keep_alive;
mod load;
pub mod metrics;
pub mod models;
pub mod prefill;
mod set;
pub mod signals;
mod worker;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use arc_swap::ArcSwap;

pub use fetch::{Fetch, Target};
pub(crate) use load::now;
pub use load::{InFlightGuard, PrefillTicket};
pub use set::WorkerSet;
pub use worker::{ProbeRun, Worker};

use crate::config::{BreakerConfig, WorkerConfig};

/// A worker's handle while its key is in the pool (dense, from 0; see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerId(pub u32);

/// Told about membership events, synchronously, while the change is being made (under
/// the membership lock): keep it short and never block.
pub trait PoolListener: Send + Sync {
    /// `worker` left the pool; its id may be given to another worker afterwards.
    fn worker_left(&self, _worker: &Worker) {}
    /// `worker` was marked unhealthy: its engine's KV cache is presumed lost (it may
    /// restart before it returns).
    fn worker_down(&self, _worker: &Worker) {}
    /// The membership changed: `set` is the new one, stored before this call.
    fn set_changed(&self, _set: &Arc<WorkerSet>) {}
}

/// The pool: the current [`WorkerSet`] and the one path that changes it.
pub struct Pool {
    set: ArcSwap<WorkerSet>,
    /// Notified once per in-flight slot freed on any worker (FIFO among waiters).
    freed: Arc<tokio::sync::Notify>,
    /// Notified when a worker joins, so the health task probes it at once.
    joined: tokio::sync::Notify,
    ids: Mutex<Ids>,
    breaker: BreakerConfig,
    listeners: RwLock<Vec<Arc<dyn PoolListener>>>,
    /// `proxy.drain_secs`: how long a worker that leaves keeps its streams.
    drain_after: std::time::Duration,
}

/// Membership, under one lock: key -> id, with freed ids reused lowest first (so bit
/// sets stay small), and the two sources of the worker list.
#[derive(Default)]
struct Ids {
    by_key: HashMap<String, WorkerId>,
    free: Vec<u32>,
    next: u32,
    /// `workers:` (SIGHUP replaces it; the admin API adds to and removes from it).
    configured: Vec<WorkerConfig>,
    /// What `discovery:` found last (its task replaces it).
    discovered: Vec<WorkerConfig>,
}

impl Ids {
    fn get_or_assign(&mut self, key: &str) -> WorkerId {
        if let Some(id) = self.by_key.get(key) {
            return *id;
        }
        let id = match self.free.pop() {
            Some(i) => WorkerId(i),
            None => {
                self.next += 1;
                WorkerId(self.next - 1)
            }
        };
        self.by_key.insert(key.to_string(), id);
        id
    }

    fn release(&mut self, key: &str) {
        if let Some(id) = self.by_key.remove(key) {
            self.free.push(id.0);
            // Lowest first: `pop` takes from the end.
            self.free.sort_unstable_by(|a, b| b.cmp(a));
        }
    }
}

impl Pool {
    /// Notified once per in-flight slot freed on any worker: a request waiting for one
    /// (`proxy.queue`) registers with `notified()` before it re-checks the workers.
    pub fn slot_freed(&self) -> &tokio::sync::Notify {
        &self.freed
    }

    /// Notified (one permit kept) when a worker joined the set: the health task probes
    /// the workers no probe has answered yet.
    pub fn worker_joined(&self) -> &tokio::sync::Notify {
        &self.joined
    }

    /// A pool of `workers` (validated config: keys distinct), all healthy, nothing in
    /// flight.
    pub fn new(workers: &[WorkerConfig], breaker: &BreakerConfig) -> Self {
        let mut ids = Ids::default();
        let freed = Arc::new(tokio::sync::Notify::new());
        let set = workers
            .iter()
            .map(|cfg| {
                let id = ids.get_or_assign(cfg.key());
                Arc::new(Worker::new(id, cfg.clone(), breaker).sharing(&freed))
            })
            .collect();
        ids.configured = workers.to_vec();
        Pool {
            freed,
            joined: tokio::sync::Notify::new(),
            set: ArcSwap::from_pointee(WorkerSet::new(set)),
            ids: Mutex::new(ids),
            breaker: breaker.clone(),
            listeners: RwLock::new(Vec::new()),
            drain_after: std::time::Duration::from_secs(30),
        }
    }

    /// The same pool, its leaving workers draining for `after` (`proxy.drain_secs`).
    pub fn draining_for(mut self, after: std::time::Duration) -> Self {
        self.drain_after = after;
        self
    }

    /// `proxy.drain_secs`: how long a worker that leaves, or that the admin API marks
    /// draining, keeps its streams before they continue elsewhere.
    pub fn drain_after(&self) -> std::time::Duration {
        self.drain_after
    }

    /// The current set (one atomic load).
    pub fn set(&self) -> Arc<WorkerSet> {
        self.set.load_full()
    }

    /// Registers `listener` for membership events (at start-up).
    pub fn listen(&self, listener: Arc<dyn PoolListener>) {
        self.listeners
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .push(listener);
    }

    /// Replaces the configured worker list (SIGHUP reload); discovered workers stay.
    /// A worker whose key stays keeps its id; if its config is unchanged it keeps its
    /// whole state (health, breaker, in-flight), otherwise it starts afresh under the
    /// same id. Workers whose key is gone leave. Requests in flight keep the set they
    /// loaded.
    pub fn replace(&self, workers: &[WorkerConfig]) {
        let mut ids = self.lock_ids();
        ids.configured = workers.to_vec();
        self.rebuild(&mut ids);
    }

    /// Replaces the discovered workers (`discovery:`), through the same path as
    /// [`Pool::replace`]: a new worker joins (health-checked like any other), a vanished
    /// one leaves (its in-flight requests finish, it gets no new ones, listeners forget
    /// it). A discovered worker whose key is also configured counts once, as configured.
    pub fn set_discovered(&self, workers: Vec<WorkerConfig>) {
        let mut ids = self.lock_ids();
        ids.discovered = workers;
        self.rebuild(&mut ids);
    }

    /// The set for configured + discovered workers (see [`Pool::replace`]).
    fn rebuild(&self, ids: &mut Ids) {
        let mut seen = std::collections::HashSet::new();
        let workers: Vec<WorkerConfig> = ids
            .configured
            .iter()
            .chain(ids.discovered.iter())
            .filter(|c| seen.insert(c.key().to_string()))
            .cloned()
            .collect();
        let old = self.set.load_full();
        let by_key: HashMap<&str, &Arc<Worker>> =
            old.workers().iter().map(|w| (w.key(), w)).collect();
        let mut joined = false;
        let next: Vec<Arc<Worker>> = workers
            .iter()
            .map(|cfg| match by_key.get(cfg.key()) {
                Some(w) if w.config() == cfg => Arc::clone(w),
                _ => {
                    joined = true;
                    let id = ids.get_or_assign(cfg.key());
                    Arc::new(Worker::new(id, cfg.clone(), &self.breaker).sharing(&self.freed))
                }
            })
            .collect();
        let kept: std::collections::HashSet<&str> = workers.iter().map(|c| c.key()).collect();
        let gone: Vec<Arc<Worker>> = old
            .workers()
            .iter()
            .filter(|w| !kept.contains(w.key()))
            .cloned()
            .collect();
        let set = Arc::new(WorkerSet::new(next));
        self.set.store(Arc::clone(&set));
        if joined {
            self.joined.notify_one();
        }
        self.leave(ids, &gone);
        for l in self.listeners().iter() {
            l.set_changed(&set);
        }
    }

    /// Adds one worker (admin API). Errors when a worker with that key is in the pool.
    pub fn add(&self, cfg: WorkerConfig) -> Result<(), String> {
        let mut ids = self.lock_ids();
        let old = self.set.load_full();
        if let Some(w) = old.workers().iter().find(|w| w.url() == &cfg.url) {
            return Err(format!(
                "a worker with URL {} is already in the pool (key {})",
                cfg.url,
                w.key()
            ));
        }
        if old.by_key(cfg.key()).is_some() {
            return Err(format!(
                "a worker with key {} is already in the pool",
                cfg.key()
            ));
        }
        ids.configured.push(cfg);
        self.rebuild(&mut ids);
        Ok(())
    }

    /// Removes the worker whose key or URL is `key` (admin API): it takes no new
    /// requests, its in-flight requests finish. Returns false when there is none.
    pub fn remove(&self, key: &str) -> bool {
        let mut ids = self.lock_ids();
        let old = self.set.load_full();
        let Some(gone) = old
            .workers()
            .iter()
            .find(|w| w.key() == key || w.url().to_string() == key)
            .cloned()
        else {
            return false;
        };
        // From whichever list holds it (a discovered one returns if discovery finds it
        // again).
        ids.configured.retain(|c| c.key() != gone.key());
        ids.discovered.retain(|c| c.key() != gone.key());
        self.rebuild(&mut ids);
        true
    }

    /// Tells the listeners that `worker` turned unhealthy (health checks call this after
    /// flipping its health).
    pub fn mark_down(&self, worker: &Worker) {
        worker.adapters().clear();
        for l in self.listeners().iter() {
            l.worker_down(worker);
        }
    }

    fn leave(&self, ids: &mut Ids, gone: &[Arc<Worker>]) {
        let listeners = self.listeners();
        let deadline = now() + self.drain_after;
        for w in gone {
            // Its requests in flight keep it (their guards hold it) until they end or,
            // for the streams that can continue elsewhere, until the deadline.
            w.drain(deadline);
            for l in listeners.iter() {
                l.worker_left(w);
            }
            ids.release(w.key());
        }
    }

    fn listeners(&self) -> std::sync::RwLockReadGuard<'_, Vec<Arc<dyn PoolListener>>> {
        self.listeners.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Serialises membership changes so none is lost; held only while a new set is
    /// built, never across an `.await`.
    fn lock_ids(&self) -> MutexGuard<'_, Ids> {
        self.ids.lock().unwrap_or_else(|e| e.into_inner())
    }
}

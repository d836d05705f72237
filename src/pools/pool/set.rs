//! [`WorkerSet`]: one immutable version of the pool.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::{Worker, WorkerId};

/// One version of the pool: its workers in config order, found by [`WorkerId`] in O(1).
/// Requests load the current set once (arc-swap) and keep it for all their attempts, so
/// a membership change never alters the pool under a request in flight.
#[derive(Debug)]
pub struct WorkerSet {
    workers: Vec<Arc<Worker>>,
    /// `WorkerId.0` -> index into `workers` (`NONE` when the id is not in this set).
    slots: Vec<u32>,
    round_robin: AtomicUsize,
    /// Distinct per set built in this process (policies cache what they derive from a set).
    generation: u64,
}

const NONE: u32 = u32::MAX;

static NEXT_GENERATION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl WorkerSet {
    /// A set over `workers`, in order; their ids must be distinct.
    pub fn new(workers: Vec<Arc<Worker>>) -> Self {
        let top = workers
            .iter()
            .map(|w| w.id().0 as usize + 1)
            .max()
            .unwrap_or(0);
        let mut slots = vec![NONE; top];
        for (i, w) in workers.iter().enumerate() {
            slots[w.id().0 as usize] = i as u32;
        }
        WorkerSet {
            workers,
            slots,
            round_robin: AtomicUsize::new(0),
            generation: NEXT_GENERATION.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// This set's generation: distinct for every set built in this process.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The workers, in config order.
    pub fn workers(&self) -> &[Arc<Worker>] {
        &self.workers
    }

    /// The worker with handle `id`, if it is in this set.
    pub fn get(&self, id: WorkerId) -> Option<&Arc<Worker>> {
        match self.slots.get(id.0 as usize) {
            Some(&i) if i != NONE => self.workers.get(i as usize),
            _ => None,
        }
    }

    /// The worker whose key (`name`, else normalised URL) is `key`.
    pub fn by_key(&self, key: &str) -> Option<&Arc<Worker>> {
        self.workers.iter().find(|w| w.key() == key)
    }

    /// The handles of the workers, in config order.
    pub fn ids(&self) -> impl Iterator<Item = WorkerId> + '_ {
        self.workers.iter().map(|w| w.id())
    }

    /// The next round-robin ticket (Relaxed: a counter, nothing published through it).
    pub fn next_ticket(&self) -> usize {
        self.round_robin.fetch_add(1, Ordering::Relaxed)
    }

    /// Workers a health probe found healthy (a worker that joined counts only after its
    /// first good probe, so readiness tells the truth).
    pub fn healthy_count(&self) -> usize {
        self.workers.iter().filter(|w| w.is_known_healthy()).count()
    }
}

//! `consistent_hash`: the request's key (its session, else its prompt digest) on a hash
//! ring of the workers, with bounded loads ("Consistent Hashing with Bounded Loads",
//! Mirrokni, Thorup and Zadimoghaddam, SODA 2018): a worker already holding more than
//! `load_factor` × the mean load (+1 for this request) passes the key on to the next
//! worker clockwise. The same key keeps landing on the same worker while it is usable
//! and not overloaded, and a worker joining or leaving moves only the keys next to it.
//!
//! Ring points come from each worker's key (name or URL), [`VNODES`] per worker, so the
//! ring is the same in every router replica and across restarts.

use std::sync::{Arc, Mutex};

use rand::RngCore;

use super::{Candidate, Pick, Policy, RouteRequest};
use crate::config::{ConsistentHashConfig, HashKey};
use crate::pools::pool::{PoolListener, WorkerId, WorkerSet};

/// Ring points per worker: enough that four workers split the ring within a few percent.
pub const VNODES: usize = 160;

/// See the module docs.
pub struct ConsistentHash {
    key: HashKey,
    load_factor: f64,
    ring: RingCache,
}

/// The ring of the last worker set seen, rebuilt when the set's generation changes.
#[derive(Default)]
pub struct RingCache(Mutex<Option<(u64, Arc<Ring>)>>);

impl RingCache {
    /// The ring of `set`'s workers (their keys and ids).
    pub fn ring_for(&self, set: &WorkerSet) -> Arc<Ring> {
        let mut cached = self.0.lock().unwrap_or_else(|e| e.into_inner());
        match &*cached {
            Some((generation, ring)) if *generation == set.generation() => Arc::clone(ring),
            _ => {
                let ring = Arc::new(Ring::new(set.workers().iter().map(|w| (w.key(), w.id()))));
                *cached = Some((set.generation(), Arc::clone(&ring)));
                ring
            }
        }
    }
}

/// Sorted (point, worker) pairs.
#[derive(Debug)]
pub struct Ring {
    points: Vec<(u64, WorkerId)>,
}

impl Ring {
    /// The ring of `workers` (their keys and ids).
    pub fn new<'a>(workers: impl Iterator<Item = (&'a str, WorkerId)>) -> Ring {
        let mut points = Vec::new();
        for (key, id) in workers {
            for v in 0..VNODES as u64 {
                points.push((xxhash_rust::xxh3::xxh3_64_with_seed(key.as_bytes(), v), id));
            }
        }
        points.sort_unstable();
        Ring { points }
    }

    /// Walks the ring clockwise from `hash`: the first usable candidate whose load is
    /// under `cap` (all of them once, then the least loaded usable one if every one is
    /// at its bound, which cannot happen with `load_factor` > 1 but is cheap to allow).
    pub fn lookup<'c>(
        &self,
        hash: u64,
        candidates: &'c [Candidate],
        cap: usize,
    ) -> Option<&'c Candidate> {
        if self.points.is_empty() {
            return None;
        }
        let start = self.points.partition_point(|(p, _)| *p < hash);
        let mut seen: Vec<WorkerId> = Vec::new();
        for i in 0..self.points.len() {
            let (_, id) = self.points[(start + i) % self.points.len()];
            if seen.contains(&id) {
                continue;
            }
            seen.push(id);
            if let Some(c) = candidates.iter().find(|c| c.id == id && c.usable)
                && c.load < cap
            {
                return Some(c);
            }
        }
        candidates
            .iter()
            .filter(|c| c.usable)
            .min_by_key(|c| c.load)
    }
}

/// The per-worker bound: ⌈`factor` × (total load + 1) / usable workers⌉.
pub fn load_cap(candidates: &[Candidate], factor: f64) -> usize {
    let usable: Vec<&Candidate> = candidates.iter().filter(|c| c.usable).collect();
    if usable.is_empty() {
        return 0;
    }
    let total: usize = usable.iter().map(|c| c.load).sum();
    (factor * (total + 1) as f64 / usable.len() as f64).ceil() as usize
}

impl ConsistentHash {
    pub fn new(cfg: &ConsistentHashConfig) -> Self {
        ConsistentHash {
            key: cfg.key,
            load_factor: cfg.load_factor,
            ring: RingCache::default(),
        }
    }
}

/// Keeps no per-worker state.
impl PoolListener for ConsistentHash {}

impl Policy for ConsistentHash {
    fn name(&self) -> &'static str {
        "consistent_hash"
    }

    fn pick(
        &self,
        req: &RouteRequest<'_>,
        set: &WorkerSet,
        candidates: &[Candidate],
        rng: &mut dyn RngCore,
    ) -> Pick {
        let digest = req.ctx.map(|c| c.digest);
        let hash = match self.key {
            HashKey::Auto => req.session.or(digest),
            HashKey::Session => req.session,
            HashKey::Digest => digest,
        };
        let Some(hash) = hash else {
            // Nothing to hash: least loaded, as any load-only policy.
            let w = super::select::least_loaded(super::select::usable(candidates), None, rng);
            return Pick::load_only(w.map(|c| c.id), req.text().len());
        };
        let cap = load_cap(candidates, self.load_factor);
        let w = self.ring.ring_for(set).lookup(hash, candidates, cap);
        Pick::load_only(w.map(|c| c.id), req.text().len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::fixtures::cands;

    fn ring(n: u32) -> Ring {
        let keys: Vec<String> = (0..n).map(|i| format!("http://10.0.0.{i}:8000")).collect();
        Ring::new(
            keys.iter()
                .enumerate()
                .map(|(i, k)| (k.as_str(), WorkerId(i as u32))),
        )
    }

    #[test]
    fn keys_spread_evenly_and_stick() {
        let r = ring(4);
        let c = cands(&[0, 0, 0, 0]);
        let mut seen = [0usize; 4];
        for k in 0..8000u64 {
            let h = xxhash_rust::xxh3::xxh3_64(&k.to_le_bytes());
            let w = r.lookup(h, &c, usize::MAX).unwrap().id;
            assert_eq!(r.lookup(h, &c, usize::MAX).unwrap().id, w);
            seen[w.0 as usize] += 1;
        }
        assert!(seen.iter().all(|n| (1600..2400).contains(n)), "{seen:?}");
    }

    #[test]
    fn a_worker_leaving_moves_only_its_keys() {
        let four = ring(4);
        let keys: Vec<String> = (0..3).map(|i| format!("http://10.0.0.{i}:8000")).collect();
        let three = Ring::new(
            keys.iter()
                .enumerate()
                .map(|(i, k)| (k.as_str(), WorkerId(i as u32))),
        );
        let c4 = cands(&[0, 0, 0, 0]);
        let c3 = cands(&[0, 0, 0]);
        for k in 0..2000u64 {
            let h = xxhash_rust::xxh3::xxh3_64(&k.to_le_bytes());
            let before = four.lookup(h, &c4, usize::MAX).unwrap().id;
            let after = three.lookup(h, &c3, usize::MAX).unwrap().id;
            if before.0 != 3 {
                assert_eq!(before, after, "key {k} moved though its worker stayed");
            }
        }
    }

    #[test]
    fn the_load_bound_passes_a_key_to_the_next_worker() {
        let r = ring(4);
        let h = 12345u64;
        let idle = cands(&[0, 0, 0, 0]);
        let home = r.lookup(h, &idle, load_cap(&idle, 1.25)).unwrap().id;
        let mut loads = [0usize; 4];
        loads[home.0 as usize] = 6;
        let busy = cands(&loads);
        // cap = ceil(1.25 × 7 / 4) = 3: the home worker (6) is over it.
        assert_eq!(load_cap(&busy, 1.25), 3);
        let moved = r.lookup(h, &busy, 3).unwrap().id;
        assert_ne!(moved, home);
        // Unusable home: the next one, without any load.
        let mut down = idle.clone();
        down[home.0 as usize].usable = false;
        assert_ne!(r.lookup(h, &down, usize::MAX).unwrap().id, home);
        // No usable worker at all.
        for c in &mut down {
            c.usable = false;
        }
        assert!(r.lookup(h, &down, usize::MAX).is_none());
    }

    #[test]
    fn under_a_hot_key_no_worker_passes_the_bound() {
        // Every request has the same key; loads accumulate as picks are made.
        let r = ring(4);
        let mut loads = vec![0usize; 4];
        for _ in 0..100 {
            let c = cands(&loads);
            let cap = load_cap(&c, 1.25);
            let w = r.lookup(7, &c, cap).unwrap().id;
            loads[w.0 as usize] += 1;
            let total: usize = loads.iter().sum();
            let max = *loads.iter().max().unwrap();
            assert!(
                max as f64 <= (1.25 * total as f64 / 4.0).ceil() + 1.0,
                "{loads:?}"
            );
        }
    }
}

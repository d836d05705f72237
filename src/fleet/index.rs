//! The other replicas' prefix records, in one flat table: a record is one (chunk hash,
//! worker) pair in a 16-byte slot, found by two-choice set-associative hashing.
//!
//! Why not a map with an LRU list: a probe of a 1 M-entry `LruCache` is three dependent
//! cache misses (control bytes, bucket, list node), ~0.6 µs on the bench machine, and a
//! 256-chunk match probes about ten times. Here a probe reads two sets of [`WAYS`] slots
//! (two cache lines each, at addresses known from the hash alone, so both misses
//! overlap). A chunk hash selects two sets (its low and its high bits: the hashes are
//! xxh3-derived, so the two are independent); a record goes into the emptier of the
//! two, and when both are full it replaces the least recently stored of their
//! 2 × [`WAYS`] slots. Stamps come from one counter bumped per stored record and chains
//! are stored tail first (see `Fleet::apply_records`), so within a chain the head is
//! the newest and is replaced last: what eviction leaves of a chain is, as in an LRU,
//! mostly still a prefix. Two choices keep sets from overflowing before the table is
//! nearly full (one choice and 8 ways overflow ~9 % of sets at 60 % load; the holes
//! that left in chains lowered the shared hit rate on the trace).
//!
//! Memory: 16 bytes per slot, allocated up front (16 MiB for [`crate::fleet::MAX_RECORDS`]),
//! against ~100 bytes per chunk hash in the map it replaces.

use crate::pools::pool::WorkerId;
use crate::tree::WorkerMask;

/// Slots per set: 8 × 16 bytes = two cache lines.
pub const WAYS: usize = 8;

/// One record; `key` 0 marks a free slot (a chunk hash of 0 is stored as 1).
#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    key: u64,
    worker: u32,
    /// The table's store counter when this record was last stored (wrapping).
    stamp: u32,
}

/// One set, aligned to its two cache lines.
#[derive(Debug, Clone, Copy, Default)]
#[repr(align(128))]
struct Set([Slot; WAYS]);

/// The table (see the module docs). Not synchronised: its owner locks it.
#[derive(Debug)]
pub struct ChunkIndex {
    sets: Box<[Set]>,
    /// `sets.len() - 1` (a power of two minus one).
    mask: usize,
    clock: u32,
    len: usize,
}

/// A chunk hash as stored (0 means free).
fn stored(h: u64) -> u64 {
    h.max(1)
}

impl ChunkIndex {
    /// A table of at least `records` slots (rounded up to a power-of-two number of sets).
    pub fn new(records: usize) -> Self {
        let n = records.div_ceil(WAYS).next_power_of_two().max(1);
        ChunkIndex {
            sets: vec![Set::default(); n].into_boxed_slice(),
            mask: n - 1,
            clock: 0,
            len: 0,
        }
    }

    /// Records held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no record is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Sets in the table (the unit of [`ChunkIndex::forget_in`]).
    pub fn sets(&self) -> usize {
        self.sets.len()
    }

    /// The two sets `key` may live in (the same one twice when they coincide).
    fn choices(&self, key: u64) -> (usize, usize) {
        (key as usize & self.mask, (key >> 40) as usize & self.mask)
    }

    /// The slots of both of `key`'s sets.
    fn candidates(&self, key: u64) -> impl Iterator<Item = &Slot> {
        let (a, b) = self.choices(key);
        let second: &[Slot] = if a == b { &[] } else { &self.sets[b].0 };
        self.sets[a].0.iter().chain(second)
    }

    /// Stores (or refreshes) the record that `worker` holds the chunk chain ending in
    /// hash `h`, replacing the least recently stored candidate when both sets are full.
    pub fn insert(&mut self, h: u64, worker: WorkerId) {
        let key = stored(h);
        self.clock = self.clock.wrapping_add(1);
        let now = self.clock;
        let (a, b) = self.choices(key);
        for s in [a, b] {
            if let Some(slot) = self.sets[s]
                .0
                .iter_mut()
                .find(|x| x.key == key && x.worker == worker.0)
            {
                slot.stamp = now;
                return;
            }
        }
        let free = |s: usize, sets: &[Set]| sets[s].0.iter().filter(|x| x.key == 0).count();
        let (fa, fb) = (free(a, &self.sets), free(b, &self.sets));
        let (set, way) = if fa.max(fb) > 0 {
            let s = if fa >= fb { a } else { b };
            let w = self.sets[s].0.iter().position(|x| x.key == 0).unwrap_or(0);
            self.len += 1;
            (s, w)
        } else {
            // Both full: the oldest of the candidates (largest wrapping age).
            let age = |x: &Slot| now.wrapping_sub(x.stamp);
            let oldest = |s: usize| {
                let (w, x) = self.sets[s]
                    .0
                    .iter()
                    .enumerate()
                    .max_by_key(|(_, x)| age(x))
                    .unwrap_or((0, &self.sets[s].0[0]));
                (w, age(x))
            };
            let ((wa, aa), (wb, ab)) = (oldest(a), oldest(b));
            if aa >= ab { (a, wa) } else { (b, wb) }
        };
        self.sets[set].0[way] = Slot {
            key,
            worker: worker.0,
            stamp: now,
        };
    }

    /// The workers of `eligible` that hold the chain ending in hash `h` (empty when
    /// none does).
    pub fn holders(&self, h: u64, eligible: &WorkerMask) -> WorkerMask {
        let key = stored(h);
        let mut m = WorkerMask::default();
        for x in self.candidates(key) {
            if x.key == key && eligible.contains(WorkerId(x.worker)) {
                m.insert(WorkerId(x.worker));
            }
        }
        m
    }

    /// Whether any worker of `eligible` holds the chain ending in hash `h`.
    pub fn held(&self, h: u64, eligible: &WorkerMask) -> bool {
        let key = stored(h);
        self.candidates(key)
            .any(|x| x.key == key && eligible.contains(WorkerId(x.worker)))
    }

    /// Reads one word of each cache line of `h`'s two sets and returns them folded, for
    /// the caller to pass to `std::hint::black_box`: loads that depend on nothing, so
    /// the misses of several hashes overlap and the probes that follow find their lines
    /// in cache (a prefetch without `unsafe`).
    pub fn touch(&self, h: u64) -> u64 {
        let (a, b) = self.choices(stored(h));
        let half = WAYS / 2;
        let (x, y) = (&self.sets[a].0, &self.sets[b].0);
        x[0].key ^ x[half].key ^ y[0].key ^ y[half].key
    }

    /// Whether `worker` holds the chain ending in hash `h`.
    pub fn held_by(&self, h: u64, worker: WorkerId) -> bool {
        let key = stored(h);
        self.candidates(key)
            .any(|x| x.key == key && x.worker == worker.0)
    }

    /// Removes `worker`'s records from sets `range` (clamped to the table), so a whole
    /// pass can run in steps between lock holds. Returns the records removed.
    pub fn forget_in(&mut self, worker: WorkerId, range: std::ops::Range<usize>) -> usize {
        let end = range.end.min(self.sets.len());
        let mut removed = 0;
        for set in &mut self.sets[range.start.min(end)..end] {
            for x in set
                .0
                .iter_mut()
                .filter(|x| x.key != 0 && x.worker == worker.0)
            {
                *x = Slot::default();
                removed += 1;
            }
        }
        self.len -= removed;
        removed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(n: u32) -> WorkerMask {
        (0..n).map(WorkerId).collect()
    }

    #[test]
    fn records_are_per_chunk_and_worker() {
        let mut ix = ChunkIndex::new(64);
        ix.insert(42, WorkerId(1));
        ix.insert(42, WorkerId(3));
        ix.insert(42, WorkerId(1)); // a refresh, not a second record
        ix.insert(0, WorkerId(2)); // hash 0 is a real hash, not a free slot
        assert_eq!(ix.len(), 3);
        let m = ix.holders(42, &all(4));
        assert!(m.contains(WorkerId(1)) && m.contains(WorkerId(3)) && !m.contains(WorkerId(2)));
        assert!(ix.held(42, &[WorkerId(3)].into_iter().collect()));
        assert!(!ix.held(42, &[WorkerId(2)].into_iter().collect()));
        assert!(ix.held_by(0, WorkerId(2)) && !ix.held_by(7, WorkerId(2)));
        let sets = ix.sets();
        assert_eq!(ix.forget_in(WorkerId(1), 0..sets), 1);
        assert_eq!(ix.len(), 2);
        assert!(!ix.held_by(42, WorkerId(1)) && ix.held_by(42, WorkerId(3)));
    }

    #[test]
    fn a_full_table_replaces_the_least_recently_stored() {
        // Uniform hashes, as chunk hashes are.
        let h = |i: u64| xxhash_rust::xxh3::xxh3_64(&i.to_le_bytes());
        let mut ix = ChunkIndex::new(1024);
        let cap = ix.sets() * WAYS;
        for i in 0..cap as u64 {
            ix.insert(h(i), WorkerId(0));
        }
        // Two choices fill the table almost to the last slot before replacing.
        assert!(ix.len() > cap * 95 / 100, "{} of {cap}", ix.len());
        // A refreshed record counts as new: a quarter of a table of new records replaces old
        // ones, not the refreshed ones nor the newest.
        for i in 0..64 {
            ix.insert(h(i), WorkerId(0));
        }
        let fresh = |ix: &ChunkIndex, from: u64, to: u64| {
            (from..to)
                .filter(|&i| ix.held_by(h(i), WorkerId(0)))
                .count()
        };
        let new = 1_000_000u64;
        for i in 0..cap as u64 / 4 {
            ix.insert(h(new + i), WorkerId(0));
        }
        assert!(ix.len() <= cap);
        assert_eq!(fresh(&ix, 0, 64), 64, "refreshed records are kept");
        let half = cap as u64 / 4;
        assert_eq!(
            fresh(&ix, new + half - 256, new + half),
            256,
            "the newest are kept"
        );
        assert!(fresh(&ix, 64, cap as u64) < cap * 4 / 5);
        // Two tables' worth more: nothing of the first fill is left.
        for i in 0..2 * cap as u64 {
            ix.insert(h(2 * new + i), WorkerId(0));
        }
        assert_eq!(
            fresh(&ix, 0, cap as u64),
            0,
            "the oldest records went first"
        );
    }
}

//! Tree upkeep task: LRU eviction above `cache.max_tree_size` nodes or
//! `cache.max_tree_bytes` bytes (every `cache.eviction_interval_secs`, and within a
//! second once the tree is [`OVER_BY`] past either ceiling), the optional daily reset
//! at `cache.daily_cleanup_hour_utc`, and age-out sweeps: a worker whose engine turned
//! out to have evicted a prefix loses its records last used before that prefix
//! ([`SharedTree::engine_evicted`], at most one sweep per [`AGE_OUT_EVERY`]).
//!
//! A pass never holds the tree lock for long: it takes the least recently used leaves
//! from the back of the tree's recency list (`super::lru`: O(1) a leaf, no scan, no
//! sort) in batches of [`EVICT_BATCH`], releasing the lock between batches and freeing
//! what a batch took after releasing it, so a request waits at most one batch. While a
//! pass runs, requests still match against the tree but skip their insert (counted in
//! `SharedTree::skipped_inserts`), so the pass is not chasing a growing tree; a pass
//! lasts about a microsecond per node it removes. Age-out sweeps scan the arena in
//! steps of [`SCAN_STEP`] slots.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::MissedTickBehavior;

use super::{Freed, RadixTree, SharedTree};
use crate::config::CacheConfig;
use crate::shutdown::Shutdown;

/// Arena slots scanned per lock hold: ~0.1 ms for 8 Ki slots of a full tree on the bench
/// machine (32 Ki took 0.5–0.9 ms), within the time a request spins for the lock before
/// it sleeps (`super::SharedTree::lock`).
pub const SCAN_STEP: usize = 8 * 1024;
/// Leaves evicted per lock hold: well under a microsecond each in a full tree (cache
/// misses on the leaf, its parent and its list neighbours), so tens of µs a hold at
/// most (2,048 held it for 0.9 ms). What they held is freed after the lock is released.
pub const EVICT_BATCH: usize = 64;
/// Past a ceiling by more than 1/`OVER_BY` of it (nodes or bytes), the tree is
/// evicted at the next [`AGE_OUT_EVERY`] look instead of waiting for the periodic pass:
/// a burst of long prompts must not hold gigabytes until then.
pub const OVER_BY: u64 = 8;
/// How often the upkeep task looks for age-out work (horizons reported meanwhile, and
/// workers grown past their learned capacity, wait for the next look).
pub const AGE_OUT_EVERY: Duration = Duration::from_secs(1);

/// The age-out sweep. For each worker whose engine was found to have evicted a prefix
/// last used at stamp `t` ([`SharedTree::engine_evicted`]): its records last used
/// before `t` go, and the bytes of those it keeps (the ones used since `t`, which the
/// engine could not all hold alongside that prefix) become its learned capacity
/// ([`SharedTree::capacity`]). For each worker with a learned capacity whose records
/// have since grown past it by an eighth: its least recently used records go until they
/// fit — the tree keeps each worker's share near what its KV cache holds, before the
/// next answer has to show it. Scans the arena in steps of [`SCAN_STEP`] slots between
/// lock holds. Returns the bytes removed (also added to `SharedTree::aged_out_bytes`).
pub async fn age_out(set: &SharedTree) -> u64 {
    let mut horizons = set.take_horizons();
    for (w, cap) in set.capacities() {
        let over = set.lock().worker_bytes(w) > cap + cap / 8;
        if over && !horizons.iter().any(|(h, _)| *h == w) {
            horizons.push((w, 0));
        }
    }
    if horizons.is_empty() {
        return 0;
    }
    // Per worker: its nodes' (stamp, bytes), then the stamp below which they go.
    let mut cut = Vec::with_capacity(horizons.len());
    for &(w, evicted_at) in &horizons {
        let mut nodes = Vec::new();
        let mut start = 0;
        while start < set.lock().arena_len() {
            set.lock_for_pass()
                .worker_nodes(start..start + SCAN_STEP, w, &mut nodes);
            start += SCAN_STEP;
            tokio::task::yield_now().await;
        }
        let cap = if evicted_at > 0 {
            let kept: u64 = nodes
                .iter()
                .filter(|(t, _)| *t >= evicted_at)
                .map(|(_, b)| b)
                .sum();
            set.set_capacity(w, Some(kept));
            kept
        } else {
            set.capacity(w).unwrap_or(u64::MAX)
        };
        cut.push((w, horizon_within(&mut nodes, cap).max(evicted_at)));
    }
    let mut removed = 0;
    let mut start = 0;
    let mut freed = Freed::with_room(SCAN_STEP);
    while start < set.lock().arena_len() {
        removed += set
            .lock_for_pass()
            .age_out(start..start + SCAN_STEP, &cut, &mut freed);
        freed.clear();
        start += SCAN_STEP;
        tokio::task::yield_now().await;
    }
    set.aged_out_bytes.fetch_add(removed, Ordering::Relaxed);
    removed
}

/// The lowest stamp such that the nodes used at or after it hold at most `cap` bytes
/// (`nodes`: `(stamp, bytes)`, reordered); 0 when all of them fit.
fn horizon_within(nodes: &mut [(u64, u64)], cap: u64) -> u64 {
    nodes.sort_unstable_by_key(|n| std::cmp::Reverse(n.0));
    let mut held = 0u64;
    for &(stamp, bytes) in nodes.iter() {
        held += bytes;
        if held > cap {
            return stamp + 1;
        }
    }
    0
}

/// The ceilings an eviction pass brings the tree under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ceiling {
    /// Nodes (`cache.max_tree_size`).
    pub nodes: usize,
    /// Bytes of routing text in edges (`cache.max_tree_bytes`).
    pub bytes: u64,
}

impl Ceiling {
    /// The ceilings a config sets.
    pub fn of(cache: &CacheConfig) -> Self {
        Ceiling {
            nodes: cache.max_tree_size,
            bytes: cache.max_tree_bytes,
        }
    }

    /// Whether `tree` is past either ceiling.
    pub fn exceeded_by(&self, tree: &RadixTree) -> bool {
        tree.node_count() > self.nodes || tree.total_bytes() > self.bytes
    }

    /// Whether `tree` is past either ceiling by more than 1/[`OVER_BY`] of it.
    fn far_exceeded_by(&self, tree: &RadixTree) -> bool {
        let nodes = self.nodes as u64;
        tree.node_count() as u64 > nodes + nodes / OVER_BY
            || tree.total_bytes() > self.bytes + self.bytes / OVER_BY
    }
}

/// Evicts least-recently-used leaves until the tree is within both ceilings (its nodes
/// and its bytes): O(1) a leaf, in lock holds of at most [`EVICT_BATCH`] leaves. Returns
/// the number of nodes removed.
pub async fn evict_to(set: &SharedTree, ceiling: Ceiling) -> usize {
    // Nothing to do: inserts must not be skipped for a pass that removes nothing.
    if !ceiling.exceeded_by(&set.lock()) {
        return 0;
    }
    let mut removed = 0;
    let mut freed = Freed::with_room(EVICT_BATCH);
    set.set_evicting(true);
    loop {
        let n =
            set.lock_for_pass()
                .evict_oldest(ceiling.nodes, ceiling.bytes, EVICT_BATCH, &mut freed);
        freed.clear();
        removed += n;
        if n < EVICT_BATCH {
            break;
        }
        tokio::task::yield_now().await;
    }
    set.set_evicting(false);
    set.evicted_nodes
        .fetch_add(removed as u64, Ordering::Relaxed);
    removed
}

/// The UTC hour (0–23) and day number of `t`.
fn utc_hour_and_day(t: SystemTime) -> (u8, u64) {
    let secs = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    (((secs / 3600) % 24) as u8, secs / 86_400)
}

/// Runs eviction every `eviction_interval`, the daily reset, and age-out sweeps when
/// due, until shutdown.
pub async fn run(set: Arc<SharedTree>, cache: CacheConfig, mut shutdown: Shutdown) {
    let period = cache
        .eviction_interval
        .unwrap_or(Duration::from_secs(60))
        .min(Duration::from_secs(60));
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut age_tick = tokio::time::interval(AGE_OUT_EVERY);
    age_tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut since_eviction = Duration::ZERO;
    let mut last_reset_day = None;
    let ceiling = Ceiling::of(&cache);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = age_tick.tick() => {
                let removed = age_out(&set).await;
                if removed > 0 {
                    tracing::debug!(removed_bytes = removed, "tree age-out sweep");
                }
                if cache.eviction_interval.is_some()
                    && ceiling.far_exceeded_by(&set.lock())
                {
                    evict_pass(&set, ceiling).await;
                }
                continue;
            }
            _ = shutdown.wait() => return,
        }
        since_eviction += period;
        if let Some(hour) = cache.daily_cleanup_hour_utc {
            let (now_hour, day) = utc_hour_and_day(SystemTime::now());
            if now_hour == hour && last_reset_day != Some(day) {
                last_reset_day = Some(day);
                // Swap under the lock; free the old nodes (~0.1 s for a full tree) after
                // releasing it, off the runtime's threads.
                let old = std::mem::take(&mut *set.lock());
                drop(tokio::task::spawn_blocking(move || drop(old)));
                tracing::info!(hour, "daily tree reset");
            }
        }
        if let Some(every) = cache.eviction_interval
            && since_eviction >= every
        {
            since_eviction = Duration::ZERO;
            evict_pass(&set, ceiling).await;
        }
    }
}

/// One eviction pass of the upkeep task, logged when it removed anything.
async fn evict_pass(set: &SharedTree, ceiling: Ceiling) {
    let removed = evict_to(set, ceiling).await;
    if removed > 0 {
        let t = set.lock();
        let (nodes, bytes) = (t.node_count(), t.total_bytes());
        drop(t);
        tracing::info!(removed, nodes, bytes, "tree eviction pass");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_horizon_keeps_the_most_recent_bytes_within_the_capacity() {
        let mut nodes = vec![(5, 100), (1, 100), (9, 100), (7, 100)];
        assert_eq!(horizon_within(&mut nodes, 1000), 0);
        // 9 and 7 fit in 250 bytes; 5 does not: what was used before 6 goes.
        assert_eq!(horizon_within(&mut nodes, 250), 6);
        assert_eq!(horizon_within(&mut nodes, 0), 10);
    }

    fn tree_of(prompts: &[&[u8]]) -> SharedTree {
        let set = SharedTree::default();
        for (i, p) in prompts.iter().enumerate() {
            set.lock().insert(p, super::super::WorkerId(i as u32 % 2));
        }
        set
    }

    fn matched(set: &SharedTree, text: &[u8]) -> usize {
        let all = [super::super::WorkerId(0), super::super::WorkerId(1)]
            .into_iter()
            .collect();
        set.lock().longest_prefix(text, &all).matched
    }

    #[tokio::test]
    async fn a_pass_brings_the_tree_under_its_byte_ceiling_oldest_first() {
        let long = |c: u8| vec![c; 1000];
        let (a, b, c) = (long(b'a'), long(b'b'), long(b'c'));
        let set = tree_of(&[&a, &b, &c, b"short"]);
        assert_eq!(set.lock().total_bytes(), 3005);
        // Its four nodes fit the node ceiling; their 3,005 bytes do not fit 2,100.
        let ceiling = Ceiling {
            nodes: 10,
            bytes: 2100,
        };
        assert!(ceiling.exceeded_by(&set.lock()));
        assert_eq!(evict_to(&set, ceiling).await, 1);
        assert_eq!(set.lock().total_bytes(), 2005);
        assert_eq!(matched(&set, &a), 0, "the least recently used goes first");
        assert_eq!(matched(&set, &c), 1000);
        assert_eq!(matched(&set, b"short"), 5);
        // Within both ceilings: nothing to do.
        assert_eq!(evict_to(&set, ceiling).await, 0);
        // The node ceiling still holds on its own.
        let ceiling = Ceiling {
            nodes: 1,
            bytes: u64::MAX,
        };
        assert_eq!(evict_to(&set, ceiling).await, 2);
        assert_eq!(matched(&set, b"short"), 5, "the most recent stays");
    }

    #[test]
    fn a_tree_an_eighth_past_a_ceiling_is_far_past_it() {
        let set = tree_of(&[&[b'x'; 900], &[b'y'; 226]]);
        let by_bytes = |bytes| Ceiling { nodes: 10, bytes };
        assert!(!by_bytes(1126).exceeded_by(&set.lock()));
        assert!(by_bytes(1125).exceeded_by(&set.lock()));
        // 1,126 ≤ 1,001 + 1,001/8 = 1,126: past, not far past.
        assert!(!by_bytes(1001).far_exceeded_by(&set.lock()));
        assert!(by_bytes(1000).far_exceeded_by(&set.lock()));
        let by_nodes = |nodes| Ceiling {
            nodes,
            bytes: u64::MAX,
        };
        assert!(by_nodes(1).exceeded_by(&set.lock()));
        assert!(
            by_nodes(1).far_exceeded_by(&set.lock()),
            "an eighth of one node is none"
        );
        assert!(!by_nodes(2).exceeded_by(&set.lock()));
    }

    #[test]
    fn utc_hour_of_known_instants() {
        // 2026-11-30T13:00:00Z = 1_796_043_600 s.
        let t = UNIX_EPOCH + Duration::from_secs(1_796_043_600);
        assert_eq!(utc_hour_and_day(t).0, 13);
        assert_eq!(utc_hour_and_day(UNIX_EPOCH).0, 0);
    }
}

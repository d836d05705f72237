//! The in-process store: `moka` caches bounded by weight (bytes) with a TTL.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_util::future::{BoxFuture, FutureExt, ready};
use moka::notification::RemovalCause;
use moka::sync::Cache;

use super::entry::Entry;
use super::key::Key;
use super::store::{Candidate, Store, StoreError, StoreStats};

/// A partition's candidates, newest first; replaced whole on each change, so the store
/// weighs it again.
type Candidates = Arc<[Candidate]>;

/// Bytes a list of candidates costs: per candidate its key, vector and bookkeeping.
fn list_weight(c: &Candidates) -> u32 {
    let bytes: usize = c.iter().map(|c| 32 + 4 * c.vector.len() + 48).sum();
    u32::try_from(bytes + 64).unwrap_or(u32::MAX)
}

/// Answers weighted by [`Entry::weight`], and per partition the newest semantic
/// candidates weighted by their vectors, within `max_bytes` together (a quarter of it
/// for the candidates when semantic lookups are on), each for `ttl`.
pub struct MemoryStore {
    entries: Cache<Key, Entry>,
    partitions: Cache<Key, Candidates>,
    evictions: Arc<AtomicU64>,
}

impl MemoryStore {
    pub fn new(max_bytes: u64, ttl: Duration, semantic: bool) -> Self {
        let vectors = if semantic { max_bytes / 4 } else { 0 };
        let evictions = Arc::new(AtomicU64::new(0));
        let counted = Arc::clone(&evictions);
        let entries = Cache::builder()
            .max_capacity(max_bytes - vectors)
            .weigher(|_: &Key, e: &Entry| u32::try_from(e.weight()).unwrap_or(u32::MAX))
            .time_to_live(ttl)
            .eviction_listener(move |_, _, cause| {
                if cause == RemovalCause::Size {
                    counted.fetch_add(1, Ordering::Relaxed);
                }
            })
            .build();
        let partitions = Cache::builder()
            .max_capacity(vectors)
            .weigher(|_: &Key, c: &Candidates| list_weight(c))
            .time_to_live(ttl)
            .build();
        MemoryStore {
            entries,
            partitions,
            evictions,
        }
    }
}

impl Store for MemoryStore {
    fn get<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<Entry>, StoreError>> {
        ready(Ok(self.entries.get(key))).boxed()
    }

    fn put(&self, key: Key, entry: Entry) -> BoxFuture<'_, Result<(), StoreError>> {
        self.entries.insert(key, entry);
        ready(Ok(())).boxed()
    }

    fn recent<'a>(
        &'a self,
        partition: &'a Key,
        n: usize,
    ) -> BoxFuture<'a, Result<Vec<Candidate>, StoreError>> {
        let found = self
            .partitions
            .get(partition)
            .map_or_else(Vec::new, |list| list.iter().take(n).cloned().collect());
        ready(Ok(found)).boxed()
    }

    fn remember(
        &self,
        partition: Key,
        candidate: Candidate,
        keep: usize,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        let old = self.partitions.get(&partition);
        let list: Candidates = std::iter::once(candidate.clone())
            .chain(
                old.iter()
                    .flat_map(|l| l.iter())
                    .filter(|c| c.key != candidate.key)
                    .cloned(),
            )
            .take(keep)
            .collect();
        self.partitions.insert(partition, list);
        ready(Ok(())).boxed()
    }

    fn is_local(&self) -> bool {
        true
    }

    fn stats(&self) -> Option<StoreStats> {
        self.entries.run_pending_tasks();
        self.partitions.run_pending_tasks();
        Some(StoreStats {
            entries: self.entries.entry_count(),
            bytes: self.entries.weighted_size() + self.partitions.weighted_size(),
            evictions: self.evictions.load(Ordering::Relaxed),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http::HeaderValue;

    fn entry(n: usize) -> Entry {
        Entry {
            content_type: HeaderValue::from_static("application/json"),
            body: Bytes::from(vec![b'x'; n]),
        }
    }

    #[tokio::test]
    async fn holds_within_max_bytes_and_counts_evictions() {
        let s = MemoryStore::new(10_000, Duration::from_secs(60), false);
        for i in 0..40u8 {
            s.put([i; 32], entry(900)).await.unwrap();
        }
        let st = s.stats().unwrap();
        assert!(st.bytes <= 10_000, "{st:?}");
        assert!(st.entries >= 5 && st.entries <= 10, "{st:?}");
        assert!(st.evictions >= 30, "{st:?}");
    }

    #[tokio::test]
    async fn candidates_newest_first_bounded_and_deduplicated() {
        let s = MemoryStore::new(1 << 20, Duration::from_secs(60), true);
        let p = [7; 32];
        let c = |k: u8| Candidate {
            key: [k; 32],
            vector: Arc::from(vec![k as f32]),
        };
        for k in 0..5 {
            s.remember(p, c(k), 3).await.unwrap();
        }
        s.remember(p, c(3), 3).await.unwrap();
        let got: Vec<u8> = s
            .recent(&p, 10)
            .await
            .unwrap()
            .iter()
            .map(|c| c.key[0])
            .collect();
        assert_eq!(got, vec![3, 4, 2]);
        assert!(s.recent(&[8; 32], 10).await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn candidate_vectors_count_against_max_bytes() {
        // A 4 MiB store with semantic lookups: 1 MiB for vectors; 16 KiB vectors.
        let s = MemoryStore::new(4 << 20, Duration::from_secs(60), true);
        for i in 0..2000u32 {
            let mut p = [0u8; 32];
            p[..4].copy_from_slice(&i.to_le_bytes());
            let c = Candidate {
                key: p,
                vector: Arc::from(vec![0.5f32; 4096]),
            };
            s.remember(p, c, 8).await.unwrap();
        }
        let st = s.stats().unwrap();
        assert!(st.bytes <= 4 << 20, "{st:?}");
        assert!(s.partitions.weighted_size() <= 1 << 20);
        assert!(s.partitions.entry_count() < 2000);
    }
}

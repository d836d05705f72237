//! The in-process store: a `moka` cache bounded by weight (bytes) with a TTL.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::{BoxFuture, FutureExt, ready};
use moka::notification::RemovalCause;
use moka::sync::Cache;

use super::entry::Entry;
use super::key::Key;
use super::store::{Candidate, Store, StoreError, StoreStats};

/// Most partitions whose candidate lists are kept (least recently used go first).
const MAX_PARTITIONS: u64 = 65_536;

type Candidates = Arc<Mutex<VecDeque<Candidate>>>;

/// Answers weighted by [`Entry::weight`] up to `max_bytes`, each for `ttl`; per
/// partition, the newest semantic candidates.
pub struct MemoryStore {
    entries: Cache<Key, Entry>,
    partitions: Cache<Key, Candidates>,
    evictions: Arc<AtomicU64>,
}

impl MemoryStore {
    pub fn new(max_bytes: u64, ttl: Duration) -> Self {
        let evictions = Arc::new(AtomicU64::new(0));
        let counted = Arc::clone(&evictions);
        let entries = Cache::builder()
            .max_capacity(max_bytes)
            .weigher(|_: &Key, e: &Entry| u32::try_from(e.weight()).unwrap_or(u32::MAX))
            .time_to_live(ttl)
            .eviction_listener(move |_, _, cause| {
                if cause == RemovalCause::Size {
                    counted.fetch_add(1, Ordering::Relaxed);
                }
            })
            .build();
        let partitions = Cache::builder()
            .max_capacity(MAX_PARTITIONS)
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
            .map_or_else(Vec::new, |list| {
                let list = list.lock().unwrap_or_else(|p| p.into_inner());
                list.iter().take(n).cloned().collect()
            });
        ready(Ok(found)).boxed()
    }

    fn remember(
        &self,
        partition: Key,
        candidate: Candidate,
        keep: usize,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        let list = self.partitions.get_with(partition, Candidates::default);
        let mut list = list.lock().unwrap_or_else(|p| p.into_inner());
        list.retain(|c| c.key != candidate.key);
        list.push_front(candidate);
        list.truncate(keep);
        ready(Ok(())).boxed()
    }

    fn stats(&self) -> Option<StoreStats> {
        self.entries.run_pending_tasks();
        Some(StoreStats {
            entries: self.entries.entry_count(),
            bytes: self.entries.weighted_size(),
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
        let s = MemoryStore::new(10_000, Duration::from_secs(60));
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
        let s = MemoryStore::new(1 << 20, Duration::from_secs(60));
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
}

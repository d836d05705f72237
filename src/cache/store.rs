//! [`Store`]: where answers and semantic candidates live. In-process
//! ([`super::memory::MemoryStore`], the default) or Redis ([`super::redis::RedisStore`],
//! shared by every router replica that names the same URL and namespace).

use std::sync::Arc;

use futures_util::future::BoxFuture;

use super::entry::Entry;
use super::key::Key;

/// One stored answer the semantic lookup may replay: its exact key and the unit-length
/// embedding of its conversation text.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    pub key: Key,
    pub vector: Arc<[f32]>,
}

/// A store that could not answer. Never reaches the client: the request goes to a
/// worker as if the cache were off.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// Down, refusing or slow: later requests skip the store for a while.
    #[error("{0}")]
    Unavailable(String),
    /// It answered with something that is not ours (a foreign or corrupt value).
    #[error("{0}")]
    Garbage(String),
}

/// What the in-process store holds now, for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    pub entries: u64,
    /// Weight held: stored bodies, content types and per-entry overhead.
    pub bytes: u64,
    /// Entries dropped to stay within `max_bytes`, since start (expiry is not counted).
    pub evictions: u64,
}

/// A response store. Every method is bounded in time by the store itself; entries
/// expire after the configured TTL.
pub trait Store: Send + Sync + 'static {
    /// The answer stored under `key`, if any.
    fn get<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<Entry>, StoreError>>;
    /// Stores `entry` under `key` (replacing any).
    fn put(&self, key: Key, entry: Entry) -> BoxFuture<'_, Result<(), StoreError>>;
    /// Up to `n` of the partition's most recent candidates, newest first.
    fn recent<'a>(
        &'a self,
        partition: &'a Key,
        n: usize,
    ) -> BoxFuture<'a, Result<Vec<Candidate>, StoreError>>;
    /// Adds a candidate to the partition, keeping its `keep` newest.
    fn remember(
        &self,
        partition: Key,
        candidate: Candidate,
        keep: usize,
    ) -> BoxFuture<'_, Result<(), StoreError>>;
    /// Entries and bytes held, where the store knows (in-process); `None` for Redis.
    fn stats(&self) -> Option<StoreStats>;
    /// In-process: every call completes at once (no I/O).
    fn is_local(&self) -> bool {
        false
    }
}

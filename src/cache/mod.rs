//! The response cache: whole answers stored and replayed, exact and semantic.
//!
//! [`ResponseCache::lookup`] runs after the body is read and before the routing
//! decision: a hit is answered from the store (no worker, no pick); a miss goes to a
//! worker with a [`Pending`] that becomes a [`Recorder`] on a 200 JSON / SSE answer and
//! stores it once the body completed and [`entry::verdict`] accepts it (in a task: the
//! client's stream never waits for the store). The client's `x-cache` header is
//! [`Status`].
//!
//! Fail open: a store that errs or times out turns the request into a bypass (counted,
//! logged at most once per [`LOG_EVERY`]) and keeps later requests off the store for
//! [`DOWN_FOR`], then lets one request at a time try it until one is answered; requests
//! that arrive while calls wait on a store that stopped answering skip it too
//! ([`store::Gate`]). So a dead or frozen store costs one request the store's bound
//! about once a second, not every request that arrives meanwhile. An embeddings
//! endpoint that fails turns a semantic lookup into an exact miss. The cache never
//! causes an error response.

pub mod entry;
pub mod key;
pub mod memory;
pub mod metrics;
pub mod redis;
pub mod semantic;
pub mod store;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use http::StatusCode;
use http::header::{self, HeaderMap, HeaderValue};

use crate::config::{ResponseCacheConfig, Secret};
use crate::prompt::Endpoint;
use crate::upstream::Upstream;
use entry::{Entry, NotStored};
use key::{Key, Unkeyable};
use semantic::Embedder;
use store::{Candidate, Gate, Store, StoreError, StoreStats, Verdict};

/// Largest answer stored, in bytes (further capped by `max_bytes`).
pub const MAX_ENTRY_BYTES: usize = 8 << 20;
/// How long requests skip a store that just failed.
pub const DOWN_FOR: Duration = Duration::from_secs(1);
/// How long semantic lookups are skipped after the embeddings endpoint was down or
/// slow (each such lookup costs up to `semantic::EMBED_TIMEOUT`).
pub const EMBED_DOWN_FOR: Duration = Duration::from_secs(5);
/// Most candidate bytes one semantic lookup reads (keys and vectors): a large model's
/// vectors make fewer candidates, so one Redis read stays well inside its time-out.
pub const MAX_CANDIDATE_BYTES: usize = 2 << 20;

/// How many candidates of `dims` dimensions a lookup compares: `max_candidates`, fewer
/// for large vectors (see [`MAX_CANDIDATE_BYTES`]), at least 1.
fn candidates_within(max_candidates: usize, dims: usize) -> usize {
    max_candidates
        .min(MAX_CANDIDATE_BYTES / (32 + 4 * dims))
        .max(1)
}

/// Largest answer checked and stored in-process without a task of its own, in bytes.
const INLINE_STORE_BYTES: usize = 64 << 10;

/// Longest content type stored, in bytes (a longer one is not an engine's).
const MAX_CONTENT_TYPE: usize = 256;
/// Least time between two log lines about store or embeddings failures.
pub const LOG_EVERY: Duration = Duration::from_secs(10);

/// The `x-cache` value of a response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Hit,
    Miss,
    Bypass,
}

impl Status {
    pub fn header(self) -> HeaderValue {
        HeaderValue::from_static(match self {
            Status::Hit => "hit",
            Status::Miss => "miss",
            Status::Bypass => "bypass",
        })
    }
}

/// Why a request did not use the cache (metric label `cause`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bypass {
    /// `response_cache.endpoints` does not list the endpoint.
    Endpoint,
    /// `Cache-Control: no-store`.
    NoStore,
    /// `Cache-Control: no-cache`: not looked up, stored.
    NoCache,
    /// The caller's key is in `uncacheable_api_keys`.
    ApiKey,
    /// `n` > 1.
    Choices,
    /// Not a JSON object, or one holding a number too large to key exactly.
    Unreadable,
    /// A Responses request that appends to engine-side state (`conversation`,
    /// `background`).
    Stateful,
    /// The store failed on this request.
    StoreError,
    /// The store failed less than [`DOWN_FOR`] ago, another request is finding out
    /// whether it is back, or calls are waiting on it without answers
    /// ([`store::Gate`]).
    StoreDown,
}

impl Bypass {
    pub const ALL: [Bypass; 9] = [
        Bypass::Endpoint,
        Bypass::NoStore,
        Bypass::NoCache,
        Bypass::ApiKey,
        Bypass::Choices,
        Bypass::Unreadable,
        Bypass::Stateful,
        Bypass::StoreError,
        Bypass::StoreDown,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Bypass::Endpoint => "endpoint",
            Bypass::NoStore => "no_store",
            Bypass::NoCache => "no_cache",
            Bypass::ApiKey => "api_key",
            Bypass::Choices => "choices",
            Bypass::Unreadable => "unreadable",
            Bypass::Stateful => "stateful",
            Bypass::StoreError => "store_error",
            Bypass::StoreDown => "store_down",
        }
    }
}

/// What became of a finished answer (metric label `result`).
pub const STORE_RESULTS: [&str; 6] = [
    "stored",
    "failed",
    "incomplete",
    "too_large",
    "not_cacheable",
    "error",
];

/// Which lookup found a hit (metric label `kind`).
pub const HIT_KINDS: [&str; 2] = ["exact", "semantic"];

/// Store operations whose errors are counted (metric label `op`).
pub const STORE_OPS: [&str; 5] = ["get", "put", "recent", "remember", "embed"];

/// The outcome of [`ResponseCache::lookup`].
#[derive(Debug)]
pub enum Lookup {
    /// Replay this answer; `kind` is `exact` or `semantic`.
    Hit { entry: Entry, kind: &'static str },
    /// Route the request; store its answer when `pending` is given.
    Route {
        status: Status,
        pending: Option<Pending>,
    },
}

/// What the answer of a routed request is stored under.
#[derive(Debug, Clone)]
pub struct Pending {
    cache: Arc<ResponseCache>,
    key: Key,
    stream: bool,
    /// The semantic candidate to add once stored.
    semantic: Option<(Key, Arc<[f32]>)>,
}

/// The response cache of one router (see the module docs).
pub struct ResponseCache {
    cfg: ResponseCacheConfig,
    store: Box<dyn Store>,
    embedder: Option<Embedder>,
    metrics: metrics::CacheMetrics,
    entry_cap: usize,
    born: Instant,
    /// Who may call the store (milliseconds since `born`).
    gate: Gate,
    /// Milliseconds since `born` until which semantic lookups are skipped.
    embed_down_until_ms: AtomicU64,
    /// Failure log lines, at most one per [`LOG_EVERY`].
    log: crate::clock::LogEvery,
}

impl std::fmt::Debug for ResponseCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseCache")
            .field("redis", &self.cfg.redis_url)
            .field("semantic", &self.embedder.is_some())
            .finish_non_exhaustive()
    }
}

impl ResponseCache {
    /// The cache for `cfg` (enabled): Redis when `redis_url` is set (connected on first
    /// use), else in-process. `bearer` is the backend key sent to an embeddings endpoint
    /// that is one of the workers.
    pub fn new(
        cfg: &ResponseCacheConfig,
        upstream: &Upstream,
        bearer: Option<HeaderValue>,
    ) -> Result<Arc<Self>, String> {
        let store: Box<dyn Store> = match &cfg.redis_url {
            Some(url) => Box::new(
                redis::RedisStore::new(url.expose(), &cfg.namespace, cfg.ttl)
                    .map_err(|e| e.to_string())?,
            ),
            None => Box::new(memory::MemoryStore::new(
                cfg.max_bytes,
                cfg.ttl,
                cfg.semantic.is_some(),
            )),
        };
        let embedder = cfg
            .semantic
            .clone()
            .map(|s| Embedder::new(s, upstream.clone(), bearer));
        Ok(Arc::new(ResponseCache {
            entry_cap: MAX_ENTRY_BYTES.min(cfg.max_bytes as usize),
            cfg: cfg.clone(),
            store,
            embedder,
            metrics: metrics::CacheMetrics::new(),
            born: Instant::now(),
            gate: Gate::new(DOWN_FOR),
            embed_down_until_ms: AtomicU64::new(0),
            log: crate::clock::LogEvery::new(LOG_EVERY),
        }))
    }

    /// What the store holds (in-process only).
    pub fn stats(&self) -> Option<StoreStats> {
        self.store.stats()
    }

    /// Looks the request up (see the module docs). Counts the hit, miss or bypass.
    pub async fn lookup(
        self: &Arc<Self>,
        endpoint: Endpoint,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Lookup {
        let found = self.find(endpoint, headers, body).await;
        match &found {
            Lookup::Hit { kind, .. } => self.metrics.hit(kind),
            Lookup::Route {
                status: Status::Miss,
                ..
            } => self.metrics.miss(),
            Lookup::Route { .. } => {}
        }
        found
    }

    async fn find(
        self: &Arc<Self>,
        endpoint: Endpoint,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Lookup {
        let bypass = |cause: Bypass, pending: Option<Pending>| {
            self.metrics.bypass(cause.as_str());
            Lookup::Route {
                status: Status::Bypass,
                pending,
            }
        };
        if !self.cfg.endpoints.contains(&endpoint) {
            return bypass(Bypass::Endpoint, None);
        }
        let control = CacheControl::read(headers);
        if control.no_store {
            return bypass(Bypass::NoStore, None);
        }
        if self.uncacheable(headers) {
            return bypass(Bypass::ApiKey, None);
        }
        let lookup_semantic = self.embedder.is_some() && !control.no_cache;
        let req = match key::analyse(endpoint, body, &key::tenant(headers), lookup_semantic) {
            Ok(r) => r,
            Err(Unkeyable::Unreadable) => return bypass(Bypass::Unreadable, None),
            Err(Unkeyable::Choices) => return bypass(Bypass::Choices, None),
            Err(Unkeyable::Stateful) => return bypass(Bypass::Stateful, None),
        };
        let mut pending = Pending {
            cache: Arc::clone(self),
            key: req.key,
            stream: req.stream,
            semantic: None,
        };
        if control.no_cache {
            if self.gate.is_down(self.now_ms()) {
                return bypass(Bypass::StoreDown, None);
            }
            return bypass(Bypass::NoCache, Some(pending));
        }
        let Some(found) = self.call(true, self.store.get(&req.key)).await else {
            return bypass(Bypass::StoreDown, None);
        };
        match found {
            Ok(Some(entry)) if entry.is_sse() == req.stream => {
                return Lookup::Hit {
                    entry,
                    kind: "exact",
                };
            }
            Ok(_) => {}
            // Something not ours under the key: a miss, and the answer overwrites it.
            Err(e @ StoreError::Garbage(_)) => self.failed("get", &e),
            Err(e) => {
                self.failed("get", &e);
                return bypass(Bypass::StoreError, None);
            }
        }
        let embed_up = self.now_ms() >= self.embed_down_until_ms.load(Ordering::Relaxed);
        if let (Some(embedder), Some(sem), true) = (&self.embedder, req.semantic, embed_up) {
            match embedder.embed(&sem.text).await {
                Err(e) => self.failed_embedding(&e),
                Ok(v) => {
                    match self
                        .semantic_hit(embedder, &sem.partition, &v, req.stream)
                        .await
                    {
                        Ok(Some(entry)) => {
                            return Lookup::Hit {
                                entry,
                                kind: "semantic",
                            };
                        }
                        Ok(None) => pending.semantic = Some((sem.partition, v)),
                        Err(cause) => return bypass(cause, None),
                    }
                }
            }
        }
        Lookup::Route {
            status: Status::Miss,
            pending: Some(pending),
        }
    }

    /// The stored answer of the partition's closest candidate at or above the threshold;
    /// `Err` with the bypass cause when the store failed (already counted) or was
    /// skipped.
    async fn semantic_hit(
        &self,
        embedder: &Embedder,
        partition: &Key,
        v: &[f32],
        stream: bool,
    ) -> Result<Option<Entry>, Bypass> {
        let n = candidates_within(embedder.max_candidates(), v.len());
        // A slow list is not an outage: exact lookups keep going.
        let candidates = self
            .call(false, self.store.recent(partition, n))
            .await
            .ok_or(Bypass::StoreDown)?
            .map_err(|e| {
                self.failed("recent", &e);
                Bypass::StoreError
            })?;
        let Some((best, _)) = semantic::best(&candidates, v, embedder.threshold()) else {
            return Ok(None);
        };
        match self.call(true, self.store.get(&best.key)).await {
            None => Err(Bypass::StoreDown),
            // A stored content type that disagrees with the caller's stream flag: a miss.
            Some(Ok(found)) => Ok(found.filter(|e| e.is_sse() == stream)),
            Some(Err(e)) => {
                self.failed("get", &e);
                Err(Bypass::StoreError)
            }
        }
    }

    /// Runs one store call if the gate lets it through (`None`: skipped, the store is
    /// down or not answering) and tells the gate what it found: an answer, or a failure
    /// that speaks for the store when `outage` (a slow semantic list does not).
    async fn call<T>(
        &self,
        outage: bool,
        call: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Option<Result<T, StoreError>> {
        let pass = self.gate.enter(self.now_ms())?;
        let r = call.await;
        let verdict = match &r {
            Ok(_) | Err(StoreError::Garbage(_)) => Verdict::Answered,
            Err(StoreError::Unavailable(_)) if outage => Verdict::Failed,
            Err(StoreError::Unavailable(_)) => Verdict::Unknown,
        };
        pass.settle(self.now_ms(), verdict);
        Some(r)
    }

    /// Whether the caller's key is listed in `uncacheable_api_keys`.
    fn uncacheable(&self, headers: &HeaderMap) -> bool {
        if self.cfg.uncacheable_api_keys.is_empty() {
            return false;
        }
        // Every credential the caller sent: `Authorization: <scheme> <key>` (any scheme,
        // any case) and `x-api-key`.
        let authorization = headers
            .get_all(header::AUTHORIZATION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .map(|v| v.trim().split_once(' ').map_or(v, |(_, k)| k).trim());
        let api_keys = headers
            .get_all("x-api-key")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .map(str::trim);
        let listed = &self.cfg.uncacheable_api_keys;
        authorization
            .chain(api_keys)
            .any(|p| listed.iter().map(Secret::expose).any(|k| k == p))
    }

    fn now_ms(&self) -> u64 {
        self.born.elapsed().as_millis() as u64
    }

    /// Counts a store failure of `op` and logs at most once per [`LOG_EVERY`] (the
    /// gate was told by [`ResponseCache::call`]).
    fn failed(&self, op: &'static str, e: &StoreError) {
        self.count_failure(op, &e.to_string(), true);
    }

    /// Counts and logs a failed embeddings call; one that found the endpoint down or
    /// slow keeps semantic lookups off for [`EMBED_DOWN_FOR`].
    fn failed_embedding(&self, e: &semantic::EmbedError) {
        if e.unavailable {
            self.embed_down_until_ms.store(
                self.now_ms() + EMBED_DOWN_FOR.as_millis() as u64,
                Ordering::Relaxed,
            );
        }
        self.count_failure("embed", &e.message, false);
    }

    fn count_failure(&self, op: &'static str, error: &str, store: bool) {
        self.metrics.store_error(op);
        if let Some(failures) = self.log.due() {
            let error = crate::redact::line(error);
            if store {
                tracing::warn!(op, %error, failures, "response cache store failed; requests go to workers without the cache until it answers");
            } else {
                tracing::warn!(op, %error, failures, "embeddings endpoint failed; semantic lookups are exact misses until it answers");
            }
        }
    }

    /// Validates and stores a finished answer (in a task of its own).
    fn store(self: Arc<Self>, pending: Pending, content_type: HeaderValue, body: Bytes) {
        // In-process and small: done here, at once (waking a task costs more than the
        // work). Otherwise (Redis, a large answer to check) in a task of its own.
        if self.store.is_local() && body.len() <= INLINE_STORE_BYTES {
            let _ = self.persist(pending, content_type, body).now_or_never();
        } else {
            tokio::spawn(self.persist(pending, content_type, body));
        }
    }

    /// Checks a finished answer with [`entry::verdict`] and stores it (and its semantic
    /// candidate).
    async fn persist(self: Arc<Self>, pending: Pending, content_type: HeaderValue, body: Bytes) {
        let sse = entry::is_sse(&content_type);
        let verdict = entry::verdict(&body, sse);
        if let Err(why) = verdict {
            self.metrics.store(match why {
                NotStored::Failed => "failed",
                NotStored::Incomplete => "incomplete",
            });
            return;
        }
        let entry = Entry { content_type, body };
        match self.call(true, self.store.put(pending.key, entry)).await {
            Some(Ok(())) => {}
            // Skipped: the store went down since the lookup.
            None => {
                self.metrics.store("error");
                return;
            }
            Some(Err(e)) => {
                self.failed("put", &e);
                self.metrics.store("error");
                return;
            }
        }
        self.metrics.store("stored");
        if let (Some((partition, vector)), Some(embedder)) = (pending.semantic, &self.embedder) {
            let c = Candidate {
                key: pending.key,
                vector,
            };
            let remember = self.store.remember(partition, c, embedder.max_candidates());
            if let Some(Err(e)) = self.call(false, remember).await {
                self.failed("remember", &e);
            }
        }
    }
}

/// The request's `Cache-Control` directives the cache obeys (RFC 9111 §5.2.1).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct CacheControl {
    no_cache: bool,
    no_store: bool,
}

impl CacheControl {
    fn read(headers: &HeaderMap) -> Self {
        let mut c = CacheControl::default();
        // HTTP/1.0 `Pragma: no-cache` counts when there is no Cache-Control (§5.4).
        if !headers.contains_key(header::CACHE_CONTROL) {
            c.no_cache = headers
                .get_all(header::PRAGMA)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .any(|v| {
                    v.split(',')
                        .any(|d| d.trim().eq_ignore_ascii_case("no-cache"))
                });
        }
        for v in headers.get_all(header::CACHE_CONTROL) {
            let Ok(v) = v.to_str() else { continue };
            for d in v.split(',') {
                let d = d.trim();
                let name = d.split('=').next().unwrap_or(d).trim();
                if name.eq_ignore_ascii_case("no-store") {
                    c.no_store = true;
                } else if name.eq_ignore_ascii_case("no-cache") {
                    c.no_cache = true;
                }
            }
        }
        c
    }
}

/// Copies a routed answer's body as it passes (reference-counted chunks, no copy until
/// the end) and stores it when the body completed.
#[derive(Debug)]
pub struct Recorder {
    pending: Pending,
    content_type: HeaderValue,
    chunks: Vec<Bytes>,
    size: usize,
    too_large: bool,
}

impl Recorder {
    /// A recorder for an answer with this status and headers: a 200, uncompressed, JSON
    /// for a non-streaming request or SSE for a streaming one. `None` (counted
    /// `not_cacheable`) for anything else.
    pub fn start(pending: Pending, status: StatusCode, headers: &HeaderMap) -> Option<Recorder> {
        let encoded = headers
            .get(header::CONTENT_ENCODING)
            .is_some_and(|v| !v.as_bytes().eq_ignore_ascii_case(b"identity"));
        let ct = headers.get(header::CONTENT_TYPE);
        let fits = ct.is_some_and(|ct| {
            ct.len() <= MAX_CONTENT_TYPE
                && if pending.stream {
                    entry::is_sse(ct)
                } else {
                    entry::is_json(ct)
                }
        });
        // Copied for the same reason as the body (see `finish`).
        let content_type = ct
            .filter(|_| fits)
            .and_then(|ct| HeaderValue::from_bytes(ct.as_bytes()).ok());
        let (true, false, Some(content_type)) = (status == StatusCode::OK, encoded, content_type)
        else {
            pending.cache.metrics.store("not_cacheable");
            return None;
        };
        Some(Recorder {
            content_type,
            pending,
            chunks: Vec::new(),
            size: 0,
            too_large: false,
        })
    }

    /// One body chunk, as it goes to the client.
    pub fn feed(&mut self, data: &Bytes) {
        if self.too_large {
            return;
        }
        self.size += data.len();
        if self.size > self.pending.cache.entry_cap {
            self.too_large = true;
            self.chunks = Vec::new();
        } else {
            self.chunks.push(data.clone());
        }
    }

    /// The body ended: stored when `complete` (the worker finished it), else dropped.
    pub fn finish(self, complete: bool) {
        let cache = Arc::clone(&self.pending.cache);
        if !complete {
            cache.metrics.store("incomplete");
            return;
        }
        if self.too_large {
            cache.metrics.store("too_large");
            return;
        }
        // Always a copy of exactly the body: a chunk is a slice of hyper's read buffer
        // (8 KiB and more), which a stored slice would keep alive for the TTL (measured:
        // 5.4 KB of RSS per 470-byte answer before, 1.0 KB after).
        let mut b = BytesMut::with_capacity(self.size);
        self.chunks.iter().for_each(|c| b.extend_from_slice(c));
        cache.store(self.pending, self.content_type, b.freeze());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_vectors_mean_fewer_candidates() {
        assert_eq!(candidates_within(256, 384), 256);
        assert_eq!(candidates_within(256, 4096), 127);
        assert_eq!(candidates_within(256, 16_384), 31);
        assert_eq!(candidates_within(256, 10_000_000), 1);
    }

    #[test]
    fn cache_control_directives() {
        let mut h = HeaderMap::new();
        assert_eq!(CacheControl::read(&h), CacheControl::default());
        h.append(
            header::CACHE_CONTROL,
            "max-age=0, No-Cache".parse().unwrap(),
        );
        assert_eq!(
            CacheControl::read(&h),
            CacheControl {
                no_cache: true,
                no_store: false
            }
        );
        h.append(header::CACHE_CONTROL, "no-store".parse().unwrap());
        assert!(CacheControl::read(&h).no_store);
        let mut p = HeaderMap::new();
        p.insert(header::PRAGMA, "No-Cache".parse().unwrap());
        assert!(CacheControl::read(&p).no_cache);
        p.insert(header::CACHE_CONTROL, "max-age=5".parse().unwrap());
        assert!(!CacheControl::read(&p).no_cache, "Cache-Control wins");
    }
}

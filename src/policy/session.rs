//! Session and conversation affinity, around whatever policy is configured, decided
//! before the inner policy's own pick (the prefix match, the ring, …):
//!
//! - **Conversation state** (`/v1/responses`): a request with `previous_response_id` (or
//!   a `conversation` id) goes to the worker that produced that response (or served that
//!   conversation): the state lives there. Response ids are learned from the answers as
//!   they pass (the JSON `id`, the SSE `response.created` event; [`Policy::answered`]).
//!   When that worker is unusable or gone the request still goes to a worker, whose own
//!   answer (typically "response not found") reaches the client.
//! - **Sessions** (`session:`): a request that carries a session key (a header such as
//!   `x-session-id`, or a body field such as `user` or `metadata.user_id`) goes to the
//!   worker that served that session last.
//!
//! - A binding is written only when a worker **served** the session (2xx first byte),
//!   like every routing memory ([`Policy::observe`]).
//! - `mode: soft` (default): the binding is followed unless its worker is unusable (down,
//!   breaker open, at `max_load`, gone) or overloaded by the same guard as prefix
//!   affinity (`cache.balance_*_threshold` against the least-loaded worker); then the
//!   inner policy picks and the session re-binds to whoever serves it. `mode: hard`:
//!   followed whatever the load, re-bound only when the worker is unusable.
//! - Bounded: at most `max_sessions` bindings (least recently used go first) and each
//!   expires `ttl_secs` after it was last used.
//! - A binding names the worker by id **and** by its key's hash, so a binding to a worker
//!   that left is never followed to another worker that later got the same id.

use std::num::NonZeroUsize;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lru::LruCache;
use rand::RngCore;

use super::select::{is_overloaded, least_loaded, usable};
use super::{CacheParams, Candidate, Outcome, Pick, Policy, Reason, RouteRequest};
use crate::config::{SessionConfig, SessionMode};
use crate::fleet::{BindingKind, BindingSink, Fleet};
use crate::pools::pool::{Pool, PoolListener, Worker, WorkerId, WorkerSet};
use crate::shutdown::Shutdown;

/// Why a session left its worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rebind {
    /// The worker is down, open, full, or was already tried for this request.
    Unusable,
    /// It left the pool.
    Gone,
    /// Soft mode: it was overloaded compared with the least-loaded worker.
    Overloaded,
}

impl Rebind {
    pub fn as_str(self) -> &'static str {
        match self {
            Rebind::Unusable => "unusable",
            Rebind::Gone => "gone",
            Rebind::Overloaded => "overloaded",
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Binding {
    worker: WorkerId,
    /// xxh3-64 of the worker's key, to tell a reused id from the bound worker.
    key_hash: u64,
    last_used: Instant,
}

/// The affinity layer around an inner policy. See the module docs.
pub struct Affinity {
    inner: std::sync::Arc<dyn Policy>,
    sessions_on: bool,
    mode: SessionMode,
    params: CacheParams,
    memory: std::sync::Arc<Memory>,
    /// The other router replicas, told every binding (`state:`; see `crate::fleet`).
    fleet: Option<std::sync::Arc<Fleet>>,
    counters: std::sync::Arc<Counters>,
}

/// What the layer counts; read through [`SessionsView`].
#[derive(Debug, Default)]
struct Counters {
    hits: AtomicU64,
    rebinds: [AtomicU64; 3],
    conversation_hits: AtomicU64,
    conversation_misses: AtomicU64,
}

/// The bindings: session key and response / conversation id (hashed, xxh3-64) -> worker.
/// Shared with the fleet, which applies the other replicas' bindings here.
#[derive(Debug)]
pub struct Memory {
    /// Most bindings in each map (the maps grow with use: `LruCache::new` would
    /// allocate for all of them up front).
    cap: usize,
    ttl: Duration,
    bindings: Mutex<LruCache<u64, Binding>>,
    /// Response or conversation id (hashed) -> the worker holding its state.
    conversations: Mutex<LruCache<u64, Binding>>,
}

impl Memory {
    /// Empty bindings with `cfg`'s bounds (`ttl_secs`, `max_sessions`).
    pub fn new(cfg: &SessionConfig) -> std::sync::Arc<Memory> {
        std::sync::Arc::new(Memory {
            cap: cfg.max_sessions.get(),
            ttl: cfg.ttl,
            bindings: Mutex::new(LruCache::unbounded()),
            conversations: Mutex::new(LruCache::unbounded()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LruCache<u64, Binding>> {
        self.bindings.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn conversations(&self) -> std::sync::MutexGuard<'_, LruCache<u64, Binding>> {
        self.conversations.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn map(&self, kind: BindingKind) -> std::sync::MutexGuard<'_, LruCache<u64, Binding>> {
        match kind {
            BindingKind::Session => self.lock(),
            BindingKind::Conversation => self.conversations(),
        }
    }

    /// The live binding of `key` in `map` (an expired one is dropped).
    fn bound(&self, map: &mut LruCache<u64, Binding>, key: u64) -> Option<Binding> {
        let b = *map.get(&key)?;
        if crate::clock::now().saturating_duration_since(b.last_used) > self.ttl {
            map.pop(&key);
            return None;
        }
        Some(b)
    }

    fn bind(&self, kind: BindingKind, key: u64, worker: &Worker) {
        let mut map = self.map(kind);
        if map.len() >= self.cap && !map.contains(&key) {
            map.pop_lru();
        }
        map.put(
            key,
            Binding {
                worker: worker.id(),
                key_hash: worker.key_hash(),
                last_used: crate::clock::now(),
            },
        );
    }
}

impl BindingSink for Memory {
    fn apply_binding(&self, kind: BindingKind, key: u64, worker: &Worker) {
        self.bind(kind, key, worker);
    }
}

/// The layer as operators see it: [`SessionStats`] as `sessions` in `/workers`, and
/// the session families in `/metrics`.
#[derive(Debug, Clone)]
pub struct SessionsView {
    memory: std::sync::Arc<Memory>,
    counters: std::sync::Arc<Counters>,
}

impl SessionsView {
    /// The counters now.
    pub fn stats(&self) -> SessionStats {
        let c = &self.counters;
        let r = |why: Rebind| c.rebinds[why as usize].load(Ordering::Relaxed);
        SessionStats {
            held: self.memory.lock().len(),
            hits: c.hits.load(Ordering::Relaxed),
            rebinds_unusable: r(Rebind::Unusable),
            rebinds_gone: r(Rebind::Gone),
            rebinds_overloaded: r(Rebind::Overloaded),
            conversations_held: self.memory.conversations().len(),
            conversation_hits: c.conversation_hits.load(Ordering::Relaxed),
            conversation_misses: c.conversation_misses.load(Ordering::Relaxed),
        }
    }
}

impl super::View for SessionsView {
    fn workers(&self, _: &WorkerSet, top: &mut super::view::Fields, _: &mut [super::view::Fields]) {
        super::view::put(top, "sessions", self.stats());
    }

    fn collector(
        &self,
        _: &std::sync::Arc<crate::pools::pool::Pool>,
    ) -> Option<Box<dyn prometheus_client::collector::Collector>> {
        Some(Box::new(self.clone()))
    }
}

impl prometheus_client::collector::Collector for SessionsView {
    fn encode(&self, mut enc: prometheus_client::encoding::DescriptorEncoder) -> std::fmt::Result {
        use super::view::{counter, gauge};
        use prometheus_client::encoding::EncodeMetric;
        let st = self.stats();
        gauge(
            &mut enc,
            "sessions",
            "Session bindings held (session -> worker)",
            st.held as i64,
        )?;
        counter(
            &mut enc,
            "session_hits",
            "Requests sent to the worker their session is bound to",
            st.hits,
        )?;
        let mut rebinds = enc.encode_descriptor(
            "session_rebinds",
            "Sessions that left their worker, by cause (unusable, gone, overloaded).",
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        for (cause, n) in [
            ("unusable", st.rebinds_unusable),
            ("gone", st.rebinds_gone),
            ("overloaded", st.rebinds_overloaded),
        ] {
            prometheus_client::metrics::counter::ConstCounter::new(n)
                .encode(rebinds.encode_family(&[("cause", cause)])?)?;
        }
        Ok(())
    }
}

/// Counters of the affinity layer (`/workers`, `/metrics`).
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct SessionStats {
    /// Session bindings held now.
    pub held: usize,
    /// Requests sent to their session's worker.
    pub hits: u64,
    pub rebinds_unusable: u64,
    pub rebinds_gone: u64,
    pub rebinds_overloaded: u64,
    /// Response / conversation ids known (`/v1/responses` state).
    pub conversations_held: usize,
    /// Follow-ups sent to the worker holding their state.
    pub conversation_hits: u64,
    /// Follow-ups whose worker was unusable or gone (sent elsewhere).
    pub conversation_misses: u64,
}

impl Affinity {
    /// The layer around `inner`: sessions as `cfg` says, conversation state always
    /// (with the same bounds: `ttl_secs`, `max_sessions`).
    /// `memory` is [`Memory::new`]'s for the same `cfg`; `fleet`, when given, hears
    /// every binding made here (and applies the others' into `memory`).
    pub fn new(
        inner: std::sync::Arc<dyn Policy>,
        cfg: &SessionConfig,
        params: CacheParams,
        memory: std::sync::Arc<Memory>,
        fleet: Option<std::sync::Arc<Fleet>>,
    ) -> Self {
        Affinity {
            inner,
            sessions_on: cfg.enabled,
            mode: cfg.mode,
            params,
            memory,
            fleet,
            counters: Default::default(),
        }
    }

    /// Binds `key` to `worker` here and tells the other replicas.
    fn bind(&self, kind: BindingKind, key: u64, worker: &Worker) {
        self.memory.bind(kind, key, worker);
        if let Some(f) = &self.fleet {
            f.bound(kind, key, worker);
        }
    }

    /// The counters now.
    pub fn stats(&self) -> SessionStats {
        self.view().stats()
    }

    fn view(&self) -> SessionsView {
        SessionsView {
            memory: std::sync::Arc::clone(&self.memory),
            counters: std::sync::Arc::clone(&self.counters),
        }
    }

    /// The bound worker of `session` if it may take this request, else why not.
    fn follow(
        &self,
        session: u64,
        set: &WorkerSet,
        candidates: &[Candidate],
        rng: &mut dyn RngCore,
    ) -> Option<Result<WorkerId, Rebind>> {
        let binding = self.memory.bound(&mut self.memory.lock(), session)?;
        let same_worker = set
            .get(binding.worker)
            .is_some_and(|w| w.key_hash() == binding.key_hash);
        if !same_worker {
            return Some(Err(Rebind::Gone));
        }
        let Some(c) = candidates
            .iter()
            .find(|c| c.id == binding.worker && c.usable)
        else {
            return Some(Err(Rebind::Unusable));
        };
        if self.mode == SessionMode::Soft
            && let Some(least) = least_loaded(usable(candidates), None, rng)
            && is_overloaded(&self.params, c.load, least.load)
        {
            return Some(Err(Rebind::Overloaded));
        }
        Some(Ok(c.id))
    }

    /// The worker holding the `/v1/responses` state `key`, when it is usable.
    fn holder(&self, key: u64, set: &WorkerSet, candidates: &[Candidate]) -> Option<WorkerId> {
        let b = self.memory.bound(&mut self.memory.conversations(), key)?;
        let here = set
            .get(b.worker)
            .is_some_and(|w| w.key_hash() == b.key_hash)
            && candidates.iter().any(|c| c.id == b.worker && c.usable);
        if !here {
            self.counters
                .conversation_misses
                .fetch_add(1, Ordering::Relaxed);
            return None;
        }
        self.counters
            .conversation_hits
            .fetch_add(1, Ordering::Relaxed);
        Some(b.worker)
    }
}

/// A decision that followed a binding to `id`.
fn bound_pick(
    id: WorkerId,
    reason: Reason,
    req: &RouteRequest<'_>,
    candidates: &[Candidate],
) -> Pick {
    let mut pick = Pick::load_only(Some(id), req.text().len());
    pick.reason = reason;
    pick.cache_aware = candidates.iter().any(|c| c.id == id && c.cache_aware);
    pick
}

impl PoolListener for Affinity {
    fn worker_left(&self, worker: &Worker) {
        self.inner.worker_left(worker);
    }

    fn worker_down(&self, worker: &Worker) {
        self.inner.worker_down(worker);
    }
}

impl Policy for Affinity {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn prepare<'a>(
        &'a self,
        req: super::RequestParts<'a>,
    ) -> Option<super::BoxFuture<'a, super::Prepared>> {
        self.inner.prepare(req)
    }

    fn pick(
        &self,
        req: &RouteRequest<'_>,
        set: &WorkerSet,
        candidates: &[Candidate],
        rng: &mut dyn RngCore,
    ) -> Pick {
        if let Some(key) = req.ctx.and_then(|c| c.continues)
            && let Some(id) = self.holder(key, set, candidates)
        {
            return bound_pick(id, Reason::Conversation, req, candidates);
        }
        if let Some(session) = req.session.filter(|_| self.sessions_on) {
            match self.follow(session, set, candidates, rng) {
                Some(Ok(id)) => {
                    self.counters.hits.fetch_add(1, Ordering::Relaxed);
                    return bound_pick(id, Reason::Session, req, candidates);
                }
                Some(Err(why)) => {
                    self.counters.rebinds[why as usize].fetch_add(1, Ordering::Relaxed);
                }
                None => {}
            }
        }
        self.inner.pick(req, set, candidates, rng)
    }

    fn observe(&self, req: &RouteRequest<'_>, pick: &Pick, worker: &Worker, outcome: Outcome) {
        if outcome == Outcome::Served {
            if let Some(session) = req.session.filter(|_| self.sessions_on) {
                self.bind(BindingKind::Session, session, worker);
            }
            // A conversation id names state the serving worker now holds.
            if let Some(key) = req.ctx.and_then(|c| c.continues) {
                self.bind(BindingKind::Conversation, key, worker);
            }
        }
        self.inner.observe(req, pick, worker, outcome);
    }

    fn answered(&self, worker: &Worker, answer: &super::Answer<'_>) {
        if let Some(id) = answer.response_id {
            let key = xxhash_rust::xxh3::xxh3_64(id.as_bytes());
            self.bind(BindingKind::Conversation, key, worker);
        }
        self.inner.answered(worker, answer);
    }

    /// The inner policy's views and this layer's own.
    fn views(&self) -> Vec<std::sync::Arc<dyn super::View>> {
        let mut views = self.inner.views();
        views.push(std::sync::Arc::new(self.view()));
        views
    }

    fn response_holder(&self, key: u64, set: &WorkerSet) -> Option<WorkerId> {
        let b = self.memory.bound(&mut self.memory.conversations(), key)?;
        set.get(b.worker)
            .filter(|w| w.key_hash() == b.key_hash)
            .map(|w| w.id())
    }

    fn background(
        &self,
        pool: std::sync::Arc<Pool>,
        shutdown: Shutdown,
    ) -> Option<super::BoxFuture<'static, ()>> {
        self.inner.background(pool, shutdown)
    }
}

/// The session key of a request: the first configured header present with a non-empty
/// value, else the first configured body field (a dotted JSON path) holding a non-empty
/// string or a number. Any length (hyper bounds headers; the body is bounded by
/// `server.max_body_bytes`): the key is hashed (xxh3-64), never stored or logged.
pub fn session_key(cfg: &SessionConfig, headers: &http::HeaderMap, body: &[u8]) -> Option<u64> {
    for name in &cfg.headers {
        if let Some(v) = headers.get(name) {
            let b = v.as_bytes();
            if !b.is_empty() {
                return Some(xxhash_rust::xxh3::xxh3_64(b));
            }
        }
    }
    if cfg.body_fields.is_empty() {
        return None;
    }
    let doc: serde_json::Value = serde_json::from_slice(body).ok()?;
    for path in &cfg.body_fields {
        let Some(v) = path.split('.').try_fold(&doc, |v, part| v.get(part)) else {
            continue;
        };
        let key = match v {
            serde_json::Value::String(s) if !s.is_empty() => s.clone(),
            serde_json::Value::Number(n) => n.to_string(),
            _ => continue,
        };
        return Some(xxhash_rust::xxh3::xxh3_64(key.as_bytes()));
    }
    None
}

/// Default bound on sessions held.
pub const DEFAULT_MAX_SESSIONS: NonZeroUsize = match NonZeroUsize::new(1_000_000) {
    Some(n) => n,
    None => unreachable!(),
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::policy::fixtures::cands;
    use std::sync::Arc;

    /// `sessions` as `/workers` shows it (through the policy's views).
    fn sessions(p: &Arc<dyn Policy>, pool: &Pool) -> serde_json::Value {
        let set = pool.set();
        let mut top = crate::policy::view::Fields::new();
        let mut workers = vec![crate::policy::view::Fields::new(); set.workers().len()];
        for v in p.views() {
            v.workers(&set, &mut top, &mut workers);
        }
        top.remove("sessions").expect("the session layer's view")
    }

    fn setup(extra: &str) -> (Config, Arc<Pool>, Arc<dyn Policy>) {
        let yaml = format!(
            "policy: round_robin\nworkers:\n  - url: http://a:1\n  - url: http://b:1\n  - url: http://c:1\n{extra}"
        );
        let cfg = Config::from_sources([(std::path::Path::new("s.yaml"), yaml.as_str())]).unwrap();
        let pool = Arc::new(Pool::new(&cfg.workers, &cfg.circuit_breaker));
        let policy = super::super::build(&cfg, &pool).policy;
        (cfg, pool, policy)
    }

    /// Picks and, when a worker was chosen, reports it served.
    fn serve(
        policy: &dyn Policy,
        set: &WorkerSet,
        session: u64,
        loads: &[usize],
        down: &[usize],
    ) -> WorkerId {
        let req = RouteRequest {
            session: Some(session),
            ..Default::default()
        };
        let mut c = cands(loads);
        for d in down {
            c[*d].usable = false;
        }
        let mut rng = rand::rng();
        let pick = policy.pick(&req, set, &c, &mut rng);
        let id = pick.worker.unwrap();
        policy.observe(&req, &pick, set.get(id).unwrap(), Outcome::Served);
        id
    }

    #[test]
    fn a_session_sticks_then_rebinds_when_its_worker_is_unusable_or_overloaded() {
        let (_, pool, p) = setup("");
        let set = pool.set();
        // Round robin alone would move it every request.
        let first = serve(&*p, &set, 7, &[0, 0, 0], &[]);
        for _ in 0..10 {
            assert_eq!(serve(&*p, &set, 7, &[0, 0, 0], &[]), first);
        }
        let mut busy = [0, 0, 0];
        busy[first.0 as usize] = 10;
        let moved = serve(&*p, &set, 7, &busy, &[]);
        assert_ne!(moved, first, "soft: overloaded worker left");
        assert_eq!(serve(&*p, &set, 7, &[0, 0, 0], &[]), moved, "re-bound");
        let again = serve(&*p, &set, 7, &[0, 0, 0], &[moved.0 as usize]);
        assert_ne!(again, moved, "unusable worker left");
        let s = sessions(&p, &pool);
        assert_eq!(
            (&s["held"], &s["rebinds_overloaded"], &s["rebinds_unusable"]),
            (&1.into(), &1.into(), &1.into())
        );
        assert!(s["hits"].as_u64().unwrap() >= 11);
    }

    #[test]
    fn hard_mode_ignores_load_but_not_health() {
        let (_, pool, p) = setup("session:\n  mode: hard\n");
        let set = pool.set();
        let first = serve(&*p, &set, 9, &[0, 0, 0], &[]);
        let mut busy = [0, 0, 0];
        busy[first.0 as usize] = 50;
        assert_eq!(serve(&*p, &set, 9, &busy, &[]), first);
        assert_ne!(serve(&*p, &set, 9, &[0, 0, 0], &[first.0 as usize]), first);
    }

    #[test]
    fn a_session_survives_another_workers_removal_and_rebinds_when_its_own_leaves() {
        let (cfg, pool, p) = setup("");
        let set = pool.set();
        let bound = serve(&*p, &set, 3, &[0, 0, 0], &[]);
        let other = set
            .workers()
            .iter()
            .find(|w| w.id() != bound)
            .unwrap()
            .key()
            .to_string();
        assert!(pool.remove(&other));
        let set = pool.set();
        let loads = vec![0; set.workers().len()];
        let c: Vec<Candidate> = set
            .workers()
            .iter()
            .zip(&loads)
            .map(|(w, l)| Candidate {
                id: w.id(),
                load: *l,
                usable: true,
                cache_aware: true,
                pending: 0,
            })
            .collect();
        let req = RouteRequest {
            session: Some(3),
            ..Default::default()
        };
        let pick = p.pick(&req, &set, &c, &mut rand::rng());
        assert_eq!(pick.worker, Some(bound));
        assert_eq!(pick.reason, Reason::Session);
        // Its own worker leaves, and a new worker is added: it may get the freed id,
        // but the session does not follow the id to it.
        let own = set.get(bound).unwrap().key().to_string();
        assert!(pool.remove(&own));
        let mut new = cfg.workers[0].clone();
        new.url = crate::config::WorkerUrl::parse("http://d:1").unwrap();
        pool.add(new).unwrap();
        let set = pool.set();
        let c: Vec<Candidate> = set
            .workers()
            .iter()
            .map(|w| Candidate {
                id: w.id(),
                load: 0,
                usable: true,
                cache_aware: true,
                pending: 0,
            })
            .collect();
        let pick = p.pick(&req, &set, &c, &mut rand::rng());
        assert_ne!(pick.reason, Reason::Session);
        assert_eq!(sessions(&p, &pool)["rebinds_gone"], 1);
    }

    #[test]
    fn sessions_are_bounded_in_number_and_time() {
        let (_, pool, p) = setup("session:\n  max_sessions: 2\n  ttl_secs: 60\n");
        let set = pool.set();
        for s in 0..5u64 {
            serve(&*p, &set, s, &[0, 0, 0], &[]);
        }
        assert_eq!(sessions(&p, &pool)["held"], 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_binding_expires_after_its_ttl() {
        let (_, pool, p) = setup("session:\n  ttl_secs: 10\n");
        let set = pool.set();
        serve(&*p, &set, 1, &[0, 0, 0], &[]);
        tokio::time::advance(Duration::from_secs(5)).await;
        let req = RouteRequest {
            session: Some(1),
            ..Default::default()
        };
        let c = cands(&[0, 0, 0]);
        assert_eq!(
            p.pick(&req, &set, &c, &mut rand::rng()).reason,
            Reason::Session
        );
        tokio::time::advance(Duration::from_secs(11)).await;
        assert_ne!(
            p.pick(&req, &set, &c, &mut rand::rng()).reason,
            Reason::Session
        );
        assert_eq!(sessions(&p, &pool)["held"], 0);
    }

    #[test]
    fn keys_come_from_headers_then_body_fields_and_bad_ones_are_ignored() {
        let cfg = |fields: &[&str]| SessionConfig {
            enabled: true,
            headers: vec![http::HeaderName::from_static("x-session-id")],
            body_fields: fields.iter().map(|s| s.to_string()).collect(),
            mode: SessionMode::Soft,
            ttl: Duration::from_secs(60),
            max_sessions: DEFAULT_MAX_SESSIONS,
        };
        let mut h = http::HeaderMap::new();
        let body = br#"{"user":"u-1","metadata":{"user_id":42}}"#;
        assert_eq!(session_key(&cfg(&[]), &h, body), None);
        assert_eq!(
            session_key(&cfg(&["metadata.user_id"]), &h, body),
            Some(xxhash_rust::xxh3::xxh3_64(b"42"))
        );
        assert_eq!(
            session_key(&cfg(&["nope", "user"]), &h, body),
            Some(xxhash_rust::xxh3::xxh3_64(b"u-1"))
        );
        h.insert("x-session-id", "abc".parse().unwrap());
        assert_eq!(
            session_key(&cfg(&["user"]), &h, body),
            Some(xxhash_rust::xxh3::xxh3_64(b"abc"))
        );
        h.insert("x-session-id", "x".repeat(10_000).parse().unwrap());
        assert_eq!(
            session_key(&cfg(&[]), &h, body),
            Some(xxhash_rust::xxh3::xxh3_64("x".repeat(10_000).as_bytes()))
        );
        h.remove("x-session-id");
        assert_eq!(session_key(&cfg(&["user"]), &h, b"not json"), None);
    }
}

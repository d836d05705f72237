//! Router-owned endpoints: `GET /health` and `GET /workers`.

use http::StatusCode;
use serde::Serialize;

use crate::error::{ProxyBody, ProxyError, json_response};
use crate::policy::view::Fields;
use crate::pools::pool::WorkerSet;

/// What the router's own endpoints read and change: the workers and each pool's policy's
/// views (the routing table), the metrics registry, the fleet and the response cache,
/// with the config keys they use.
pub struct Admin {
    pools: std::sync::Arc<crate::policy::Routes>,
    metrics: std::sync::Arc<crate::metrics::Metrics>,
    fleet: Option<std::sync::Arc<crate::fleet::Fleet>>,
    cache: Option<std::sync::Arc<crate::cache::ResponseCache>>,
    /// Flow control: the admission queue's depths.
    flow: std::sync::Arc<crate::flow::Flow>,
    /// `server.admin_token`.
    token: Option<crate::config::Secret>,
    /// `server.body_timeout_secs`: how long an admin request's body may take.
    body_timeout: std::time::Duration,
    /// `engine_metrics:` (whether and when a signal is stale).
    engine_metrics: crate::config::EngineMetricsConfig,
    /// Whether `response_cache.semantic` is set.
    semantic: bool,
}

impl Admin {
    /// The endpoints over the parts `app` built from `config`.
    pub fn new(
        config: &crate::config::Config,
        pools: std::sync::Arc<crate::policy::Routes>,
        metrics: std::sync::Arc<crate::metrics::Metrics>,
        fleet: Option<std::sync::Arc<crate::fleet::Fleet>>,
        cache: Option<std::sync::Arc<crate::cache::ResponseCache>>,
        flow: std::sync::Arc<crate::flow::Flow>,
    ) -> Self {
        Admin {
            pools,
            metrics,
            fleet,
            cache,
            flow,
            token: config.server.admin_token.clone(),
            body_timeout: config.server.body_timeout,
            engine_metrics: config.engine_metrics.clone(),
            semantic: config.response_cache.semantic.is_some(),
        }
    }

    /// The current worker set.
    pub fn worker_set(&self) -> std::sync::Arc<WorkerSet> {
        self.pools.workers().set()
    }

    /// Every pool's policies' views (a disaggregated pool's legs' included).
    fn views(&self) -> Vec<std::sync::Arc<dyn crate::policy::View>> {
        let table = self.pools.table();
        table
            .pools()
            .flat_map(|p| {
                let legs = p.legs().into_iter().flat_map(|l| [&l.prefill, &l.decode]);
                std::iter::once(p.policy()).chain(legs)
            })
            .flat_map(|policy| policy.views())
            .collect()
    }
}

#[derive(Serialize)]
struct Health {
    status: &'static str,
    healthy_workers: usize,
    total_workers: usize,
}

/// `GET /health`: 200 with the healthy worker count, 503 when none is healthy (so a
/// load balancer or Kubernetes readiness probe takes this router out of rotation).
pub fn health(set: &WorkerSet) -> http::Response<ProxyBody> {
    let healthy = set.healthy_count();
    let (status, word) = if healthy > 0 {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "no_healthy_workers")
    };
    let body = Health {
        status: word,
        healthy_workers: healthy,
        total_workers: set.workers().len(),
    };
    json_response(status, serde_json::to_string(&body).unwrap_or_default())
}

#[derive(Serialize)]
struct WorkerView {
    url: String,
    /// Its identity: `name`, else the normalised URL.
    key: String,
    /// `primary` or `fallback` (takes requests only while no primary is usable).
    role: &'static str,
    /// `prefill`, `decode` or `both`: its part of a request in a disaggregated pool.
    phase: &'static str,
    in_flight: usize,
    /// Requests the other router replicas have in flight here (`state:`; 0 alone).
    remote_in_flight: usize,
    healthy: bool,
    /// A health probe has answered since it joined; until then `/health` does not
    /// count it (it is routed to all the same).
    probed: bool,
    /// Why its last health probe failed; `null` after a good one.
    probe_error: Option<String>,
    breaker: &'static str,
    /// Removed, or marked draining (`POST /workers/drain`): it takes no new request;
    /// its streams move to another worker when `proxy.drain_secs` has passed.
    draining: bool,
    max_load: Option<usize>,
    load_penalty: u32,
    cache_aware: bool,
    /// What the policy's views show of this worker (`tree_share`, the fraction of the
    /// tree's bytes it holds; `tree_capacity_bytes`; `kv_events`, its KV-event feed in
    /// precise mode; see `policy::view`).
    #[serde(flatten)]
    views: Fields,
    /// What its engine's Prometheus endpoint said (`engine_metrics:` on).
    #[serde(skip_serializing_if = "Option::is_none")]
    engine: Option<EngineView>,
    /// Its LMCache signal (`lmcache:` configured).
    #[serde(skip_serializing_if = "Option::is_none")]
    lmcache: Option<LmcacheView>,
    /// Seconds it is still avoided after a 429 / 503 with Retry-After (0 = not).
    saturated_secs: f64,
    /// Such answers so far.
    back_pressure: u64,
    prefill: PrefillView,
    hits: HitsView,
    /// What it serves (`pools::pool::models`).
    models: ModelsView,
    /// The LoRA adapters its engine is estimated to hold (`pools::pool::adapters`).
    lora: LoraView,
}

/// A worker's LoRA adapters in `/workers`.
#[derive(Serialize)]
struct LoraView {
    /// Adapters held at once: `workers[].max_lora`, else the engine's report, else 1.
    slots: usize,
    /// The adapters the router estimates it holds, most recently sent first.
    resident: Vec<String>,
    /// Adapter requests sent to it, by where they landed: `resident`, `free_slot`,
    /// `evicting`.
    placed: std::collections::BTreeMap<&'static str, u64>,
    /// Adapters loaded onto it on demand (`adapters.load_on_demand`), and failed loads.
    loads: u64,
    load_failures: u64,
}

fn lora_view(w: &crate::pools::pool::Worker) -> LoraView {
    use crate::pools::pool::adapters::Placement;
    use std::sync::atomic::Ordering::Relaxed;
    let r = w.adapters();
    LoraView {
        slots: r.slots(),
        resident: r.resident().iter().map(|a| a.to_string()).collect(),
        placed: Placement::ALL
            .iter()
            .zip(r.placed())
            .map(|(p, n)| (p.as_str(), n))
            .collect(),
        loads: r.loads_ok.load(Relaxed),
        load_failures: r.loads_failed.load(Relaxed),
    }
}

/// A worker's model list in `/workers`.
#[derive(Serialize)]
struct ModelsView {
    /// `listed` (read from its `GET /v1/models`), `pinned` (`workers[].models`),
    /// `unread` (not yet) or `unreadable` (its answer was no model list).
    source: &'static str,
    /// Whether it takes a request for any model (its list is unread or unreadable).
    serves_any: bool,
    /// Base models' served names, as listed.
    models: Vec<String>,
    /// LoRA adapters, as listed, each with its base.
    adapters: Vec<AdapterView>,
    /// When the list was last read, seconds since the Unix epoch; `null` before (and
    /// for a pinned list).
    read_at: Option<f64>,
    /// Why the last read gave no list; `null` after a good one.
    error: Option<String>,
}

#[derive(Serialize)]
struct AdapterView {
    id: String,
    parent: String,
}

fn models_view(w: &crate::pools::pool::Worker) -> ModelsView {
    let s = w.served();
    ModelsView {
        source: s.source.as_str(),
        serves_any: s.serves_any(),
        models: s
            .models
            .iter()
            .filter(|m| !m.is_adapter())
            .map(|m| m.id.to_string())
            .collect(),
        adapters: s
            .models
            .iter()
            .filter_map(|m| {
                let parent = m.parent.as_ref()?;
                Some(AdapterView {
                    id: m.id.to_string(),
                    parent: parent.to_string(),
                })
            })
            .collect(),
        read_at: s.read_at.and_then(|t| {
            t.duration_since(std::time::UNIX_EPOCH)
                .ok()
                .map(|d| d.as_secs_f64())
        }),
        error: s.error.clone(),
    }
}

/// One pool in `/workers`: its model's names, its workers and what its policy's views
/// show of them.
#[derive(Serialize)]
struct PoolView {
    name: String,
    policy: &'static str,
    /// Its legs' policies, once its workers have disaggregated it (`pd:`).
    #[serde(skip_serializing_if = "Option::is_none")]
    prefill_policy: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    decode_policy: Option<&'static str>,
    /// The served names that route here (none for the default pool).
    models: Vec<String>,
    /// Its workers, each with its views' fields (`tree_share`, …).
    workers: Vec<Fields>,
    #[serde(flatten)]
    views: Fields,
}

fn pool_view(
    table: &crate::policy::RoutesTable,
    pool: &crate::pools::ModelPool<std::sync::Arc<dyn crate::policy::Policy>>,
) -> PoolView {
    let all = table.set();
    let mut models = Vec::new();
    let mut member = vec![false; all.workers().len()];
    let mut mark = |set: &WorkerSet| {
        for (i, w) in all.workers().iter().enumerate() {
            member[i] |= set.get(w.id()).is_some();
        }
    };
    if std::sync::Arc::ptr_eq(pool.name(), table.everyone().pool.name())
        && let Some(any) = table.any()
    {
        mark(any);
    }
    for (name, p, set) in table.models() {
        if std::sync::Arc::ptr_eq(p.name(), pool.name()) {
            models.push(name.to_string());
            mark(set);
        }
    }
    let set = WorkerSet::new(
        all.workers()
            .iter()
            .zip(&member)
            .filter(|(_, m)| **m)
            .map(|(w, _)| std::sync::Arc::clone(w))
            .collect(),
    );
    let mut views = Fields::new();
    let mut workers = vec![Fields::new(); set.workers().len()];
    for view in pool.policy().views() {
        view.workers(&set, &mut views, &mut workers);
    }
    for (w, fields) in set.workers().iter().zip(&mut workers) {
        fields.insert("key".into(), w.key().into());
    }
    PoolView {
        name: pool.name().to_string(),
        policy: pool.policy().name(),
        prefill_policy: pool.legs().map(|l| l.prefill.name()),
        decode_policy: pool.legs().map(|l| l.decode.name()),
        models,
        workers,
        views,
    }
}

/// What a worker's answers said of the router's prefix memory (see `pool::hits`).
#[derive(Serialize)]
struct HitsView {
    /// Answers that named their cached tokens (or came from an engine that has).
    answers: u64,
    /// Prefix tokens of those answers: the longest any worker held (available), what
    /// the router believed this worker held (predicted), the engine's `cached_tokens`
    /// (delivered). Whole KV blocks, estimated from bytes at the worker's learned
    /// tokens per byte in approximate mode.
    available_tokens: u64,
    predicted_tokens: u64,
    delivered_tokens: u64,
    /// delivered / predicted over the last 100 answers that predicted a hit; `null`
    /// until 10 such answers.
    drift: Option<f64>,
    /// Answers that delivered far fewer tokens than predicted (each ages out this
    /// worker's older records, see `tree::SharedTree::engine_evicted`).
    shortfalls: u64,
}

/// A worker's engine signals in `/workers`; values `null` before the first good scrape.
#[derive(Serialize)]
struct EngineView {
    /// `vllm` or `sglang`: whose metric names were found.
    kind: Option<&'static str>,
    waiting: Option<f64>,
    running: Option<f64>,
    /// 0–1.
    kv_cache_usage: Option<f64>,
    /// 0–1.
    prefix_hit_rate: Option<f64>,
    /// Seconds since the last good scrape.
    age_secs: Option<f64>,
    /// Younger than `engine_metrics.stale_secs` (otherwise neutral).
    fresh: bool,
    scrapes_ok: u64,
    scrapes_failed: u64,
    scrapes_unparsable: u64,
    /// Decisions that found this worker's signal missing or stale (neutral).
    neutral_reads: u64,
}

/// A worker's LMCache signal in `/workers`.
#[derive(Serialize)]
struct LmcacheView {
    endpoint: String,
    occupancy: Option<f64>,
    cache_available: Option<bool>,
    age_secs: Option<f64>,
    fresh: bool,
    polls_ok: u64,
    polls_failed: u64,
    polls_unparsable: u64,
}

/// A worker's prefill accounting in `/workers` (see `pool::prefill`).
#[derive(Serialize)]
struct PrefillView {
    /// Requests sent and not yet answered with a first byte, and their estimated
    /// uncached prompt tokens.
    pending_requests: u64,
    pending_tokens: u64,
    /// Learned prefill rate, tokens/s, and fixed cost per request, ms (priors until
    /// `samples` reaches 8).
    tokens_per_second: f64,
    base_ms: f64,
    /// Learned prompt tokens per byte of routing text.
    tokens_per_byte: f64,
    samples: u64,
    /// Learned share of the serial queue estimate a request really waits there (1 until
    /// learned; `pool::prefill`).
    queue_factor: f64,
    /// Whether the rates above are this worker's own (`samples` ≥ 8); below that they are
    /// the priors, and `cost_aware` costs the worker at the mean of the learned ones.
    learned: bool,
}

fn engine_view(
    w: &crate::pools::pool::Worker,
    now: std::time::Instant,
    stale: std::time::Duration,
) -> EngineView {
    let sig = w.signals();
    let load = sig.engine();
    let (ok, failed, unparsable) = sig.scrapes.get();
    EngineView {
        kind: load.as_ref().map(|l| l.engine.as_str()),
        waiting: load.as_ref().map(|l| l.waiting),
        running: load.as_ref().map(|l| l.running),
        kv_cache_usage: load.as_ref().and_then(|l| l.kv_usage),
        prefix_hit_rate: load.as_ref().and_then(|l| l.prefix_hit_rate),
        age_secs: load
            .as_ref()
            .map(|l| now.saturating_duration_since(l.at).as_secs_f64()),
        fresh: sig.engine_fresh(now, stale).is_some(),
        scrapes_ok: ok,
        scrapes_failed: failed,
        scrapes_unparsable: unparsable,
        neutral_reads: sig.neutral_reads.load(std::sync::atomic::Ordering::Relaxed),
    }
}

fn lmcache_view(w: &crate::pools::pool::Worker, now: std::time::Instant) -> Option<LmcacheView> {
    let cfg = w.config().lmcache.as_ref()?;
    let sig = w.signals();
    let s = sig.lmcache();
    let (ok, failed, unparsable) = sig.lmcache_polls.get();
    Some(LmcacheView {
        endpoint: crate::redact::url(&cfg.endpoint).into_owned(),
        occupancy: s.as_ref().map(|l| l.occupancy),
        cache_available: s.as_ref().map(|l| l.cache_available),
        age_secs: s
            .as_ref()
            .map(|l| now.saturating_duration_since(l.at).as_secs_f64()),
        fresh: sig.lmcache_fresh(now, cfg.stale).is_some(),
        polls_ok: ok,
        polls_failed: failed,
        polls_unparsable: unparsable,
    })
}

fn hits_view(h: &crate::pools::pool::hits::HitStats) -> HitsView {
    use std::sync::atomic::Ordering::Relaxed;
    HitsView {
        answers: h.answers.load(Relaxed),
        available_tokens: h.available.load(Relaxed),
        predicted_tokens: h.predicted.load(Relaxed),
        delivered_tokens: h.delivered.load(Relaxed),
        drift: h.drift(),
        shortfalls: h.shortfalls.load(Relaxed),
    }
}

fn prefill_view(w: &crate::pools::pool::Worker) -> PrefillView {
    let (pending_requests, pending_tokens) = w.prefill().pending();
    let rate = w.prefill().rate();
    PrefillView {
        pending_requests,
        pending_tokens,
        tokens_per_second: (1.0 / rate.secs_per_token).round(),
        base_ms: rate.base_s * 1e3,
        tokens_per_byte: rate.tokens_per_byte,
        samples: rate.samples,
        queue_factor: rate.queue_factor,
        learned: rate.samples >= crate::pools::pool::prefill::MIN_SAMPLES,
    }
}

#[derive(Serialize)]
struct Workers {
    /// The default pool's policy (its views' fields follow, as a router with one pool
    /// shows them).
    policy: &'static str,
    /// Every pool (`pools`): the default one, then one per model.
    pools: Vec<PoolView>,
    /// What the policy's views show (`tree_nodes`, `tree_bytes`, `sessions`,
    /// `precise`; see `policy::view`).
    #[serde(flatten)]
    views: Fields,
    /// The response cache (`response_cache:`), when on.
    #[serde(skip_serializing_if = "Option::is_none")]
    response_cache: Option<ResponseCacheView>,
    /// Routing state shared with other router replicas (`state:`), when on.
    #[serde(skip_serializing_if = "Option::is_none")]
    fleet: Option<FleetView>,
    /// The workers' `hits` summed: how much of the reuse the pool held the policy
    /// routed to, and how much of that the engines delivered.
    hits: HitsSummary,
    /// The admission queue now (`proxy.queue`; per class and tenant with flow control).
    queue: crate::flow::view::QueueView,
    workers: Vec<WorkerView>,
}

/// The pool's available / predicted / delivered prefix tokens (see [`HitsView`]) and
/// what they say: `routed_share` = predicted ÷ available (under 1: reuse lost to load
/// or thresholds), `delivered_share` = delivered ÷ predicted (under 1: the router's
/// memory is stale, see `pool::hits`); `null` while the divisor is 0.
#[derive(Serialize, Default)]
struct HitsSummary {
    answers: u64,
    available_tokens: u64,
    predicted_tokens: u64,
    delivered_tokens: u64,
    routed_share: Option<f64>,
    delivered_share: Option<f64>,
    shortfalls: u64,
}

impl HitsSummary {
    fn of<'a>(views: impl Iterator<Item = &'a HitsView>) -> Self {
        let mut s = HitsSummary::default();
        for h in views {
            s.answers += h.answers;
            s.available_tokens += h.available_tokens;
            s.predicted_tokens += h.predicted_tokens;
            s.delivered_tokens += h.delivered_tokens;
            s.shortfalls += h.shortfalls;
        }
        let share = |a: u64, b: u64| (b > 0).then(|| a as f64 / b as f64);
        s.routed_share = share(s.predicted_tokens, s.available_tokens);
        s.delivered_share = share(s.delivered_tokens, s.predicted_tokens);
        s
    }
}

#[derive(Serialize)]
struct FleetView {
    /// Subscribed to the fleet channel now.
    connected: bool,
    /// Chunk hashes held from the other replicas.
    remote_records: usize,
    messages_out: u64,
    bytes_out: u64,
    messages_in: u64,
    bytes_in: u64,
    /// Records dropped because the publisher fell behind.
    dropped: u64,
    /// Snapshot messages applied on (re)connecting (a replica that started late).
    snapshot_messages: u64,
}

#[derive(Serialize)]
struct ResponseCacheView {
    /// `memory` or `redis`.
    store: &'static str,
    semantic: bool,
    /// In-process store only: answers held and their weight in bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    entries: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    bytes: Option<u64>,
}

/// `GET /metrics`: Prometheus text exposition of the registry every part registered in.
pub fn metrics(admin: &Admin) -> http::Response<ProxyBody> {
    use http_body_util::BodyExt;
    let text = admin.metrics.encode();
    let mut resp = http::Response::new(
        http_body_util::Full::new(bytes::Bytes::from(text))
            .map_err(|never| match never {})
            .boxed(),
    );
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static(crate::metrics::CONTENT_TYPE),
    );
    resp
}

/// `GET /workers`: per-worker URL, in-flight count, health, breaker state and tree share;
/// in precise mode also the index and, per worker with `kv_events`, its feed (per DP
/// rank too, see [`FeedView`]); the admission queue's depths. API keys are never shown.
pub fn workers(admin: &Admin) -> http::Response<ProxyBody> {
    let table = admin.pools.table();
    let set = std::sync::Arc::clone(table.set());
    let policy = table.everyone().pool.policy();
    let now = crate::pools::pool::now();
    let mut top = Fields::new();
    let mut per_worker = vec![Fields::new(); set.workers().len()];
    for view in policy.views() {
        view.workers(&set, &mut top, &mut per_worker);
    }
    let em = &admin.engine_metrics;
    let workers: Vec<WorkerView> = set
        .workers()
        .iter()
        .zip(per_worker)
        .map(|(w, views)| WorkerView {
            views,
            url: w.url().to_string(),
            key: w.key().to_string(),
            role: w.config().role.as_str(),
            phase: w.config().phase.as_str(),
            in_flight: w.in_flight(),
            remote_in_flight: w.remote_in_flight(),
            healthy: w.is_healthy(),
            probed: w.is_probed(),
            probe_error: w.probe_run().last_error.clone(),
            breaker: w.breaker_state(now).as_str(),
            draining: w.is_draining(),
            max_load: w.config().max_load.map(|m| m.get()),
            load_penalty: w.config().load_penalty,
            cache_aware: w.config().cache_aware,
            engine: em.enabled.then(|| engine_view(w, now, em.stale)),
            lmcache: lmcache_view(w, now),
            saturated_secs: w.signals().saturated_for(now),
            back_pressure: w
                .signals()
                .back_pressure
                .load(std::sync::atomic::Ordering::Relaxed),
            prefill: prefill_view(w),
            hits: hits_view(w.hits()),
            models: models_view(w),
            lora: lora_view(w),
        })
        .collect();
    let body = Workers {
        pools: table.pools().map(|p| pool_view(&table, p)).collect(),
        hits: HitsSummary::of(workers.iter().map(|w| &w.hits)),
        policy: policy.name(),
        views: top,
        fleet: admin.fleet.as_ref().map(|f| {
            let c = &f.counts;
            let n = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
            FleetView {
                connected: c.connected.load(std::sync::atomic::Ordering::Relaxed),
                remote_records: f.remote_records(),
                messages_out: n(&c.messages_out),
                bytes_out: n(&c.bytes_out),
                messages_in: n(&c.messages_in),
                bytes_in: n(&c.bytes_in),
                dropped: n(&c.dropped),
                snapshot_messages: n(&c.snapshot_messages),
            }
        }),
        response_cache: admin.cache.as_ref().map(|c| {
            let st = c.stats();
            ResponseCacheView {
                store: if st.is_some() { "memory" } else { "redis" },
                semantic: admin.semantic,
                entries: st.map(|s| s.entries),
                bytes: st.map(|s| s.bytes),
            }
        }),
        queue: admin.flow.view(),
        workers,
    };
    json_response(
        StatusCode::OK,
        serde_json::to_string(&body).unwrap_or_default(),
    )
}

/// A mutating admin request, answered now or once its body is read.
pub enum Mutation {
    Done(http::Response<ProxyBody>),
    /// `POST /workers`: the body holds the worker; see [`mutate_with_body`].
    NeedsBody,
    /// `POST /cache/clear[?worker=…]` (the worker, if named): freeing route records is
    /// blocking work (a whole tree, or one worker's share of it in steps: up to ~0.25 s
    /// for 1 M nodes), done by [`clear_cache_blocking`] off the async workers.
    ClearCache(Option<String>),
}

/// Largest `POST /workers` body, in bytes.
const MAX_ADMIN_BODY: usize = 64 * 1024;

/// Answers the admin API when `method` + path is one of its endpoints:
/// `POST /workers`, `DELETE /workers?url=…`, `POST|DELETE /workers/drain?url=…`,
/// `POST /cache/clear[?worker=…]`. They need
/// `Authorization: Bearer <server.admin_token>`; without a configured token they answer
/// 403 saying how to enable them. None of them blocks requests being served.
pub fn mutation<B>(admin: &Admin, req: &http::Request<B>) -> Option<Mutation> {
    let (method, path) = (req.method(), req.uri().path());
    let is_admin = matches!(
        (method, path),
        (&http::Method::POST, "/workers")
            | (&http::Method::DELETE, "/workers")
            | (&http::Method::POST, "/workers/drain")
            | (&http::Method::DELETE, "/workers/drain")
            | (&http::Method::POST, "/cache/clear")
    );
    if !is_admin {
        return None;
    }
    if let Err(e) = authorize(admin, req.headers()) {
        return Some(Mutation::Done(e.into_response()));
    }
    let resp = match (method, path) {
        (&http::Method::POST, "/workers") => return Some(Mutation::NeedsBody),
        (&http::Method::DELETE, "/workers") => {
            named(req.uri()).and_then(|which| remove_worker(admin, which.as_which()))
        }
        (&http::Method::POST | &http::Method::DELETE, "/workers/drain") => {
            let on = method == http::Method::POST;
            named(req.uri()).and_then(|which| drain_worker(admin, which.as_which(), on))
        }
        _ => return Some(Mutation::ClearCache(query_param(req.uri(), "worker"))),
    };
    Some(Mutation::Done(
        resp.unwrap_or_else(ProxyError::into_response),
    ))
}

/// `POST /workers` with a JSON worker entry (the keys of one `workers:` item).
pub async fn mutate_with_body(
    admin: &Admin,
    req: http::Request<hyper::body::Incoming>,
) -> http::Response<ProxyBody> {
    let declared = crate::request::body::content_length(req.headers());
    let timeout = admin.body_timeout;
    let body = match crate::request::body::read(req.into_body(), declared, MAX_ADMIN_BODY, timeout)
        .await
    {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let cfg = match crate::config::WorkerConfig::from_json(&body) {
        Ok(c) => c,
        Err(e) => return ProxyError::BadRequest(format!("invalid worker: {e}")).into_response(),
    };
    let url = cfg.url.to_string();
    match admin.pools.workers().add(cfg) {
        Ok(()) => {
            tracing::info!(worker = %url, "worker added (admin API)");
            let n = admin.worker_set().workers().len();
            json_response(
                StatusCode::CREATED,
                serde_json::json!({"added": url, "workers": n}).to_string(),
            )
        }
        Err(m) => ProxyError::Conflict(m).into_response(),
    }
}

fn authorize(admin: &Admin, headers: &http::HeaderMap) -> Result<(), ProxyError> {
    let Some(token) = &admin.token else {
        return Err(ProxyError::Forbidden(
            "the admin API is disabled: set server.admin_token in the config and send `Authorization: Bearer <token>`",
        ));
    };
    // The scheme name is case-insensitive (RFC 9110 §11.1).
    let given = headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map_or("", |(_, token)| token.trim());
    if constant_time_eq(given.as_bytes(), token.expose().as_bytes()) {
        Ok(())
    } else {
        Err(ProxyError::Unauthorized(
            "missing or wrong admin token (Authorization: Bearer <server.admin_token>)",
        ))
    }
}

/// Compares without an early exit, so the time taken does not reveal a prefix.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn query_param(uri: &http::Uri, key: &str) -> Option<String> {
    form_urlencoded::parse(uri.query()?.as_bytes())
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.into_owned())
}

fn parse_url(raw: Option<&str>, param: &str) -> Result<crate::config::WorkerUrl, ProxyError> {
    let raw =
        raw.ok_or_else(|| ProxyError::BadRequest(format!("missing query parameter `{param}`")))?;
    crate::config::WorkerUrl::parse(raw).map_err(|e| {
        ProxyError::BadRequest(format!("`{param}`: `{}`: {e}", crate::redact::url(raw)))
    })
}

/// How an admin request names a worker.
enum Which<'a> {
    /// By URL (normalised before comparing).
    Url(&'a str),
    /// By `name`.
    Name(&'a str),
    /// `worker=` of `/cache/clear`: a name, else a URL.
    Either(&'a str),
}

/// The worker `which` names, `None` when no worker has it.
fn find_worker(
    set: &WorkerSet,
    which: &Which<'_>,
) -> Result<Option<std::sync::Arc<crate::pools::pool::Worker>>, ProxyError> {
    let by_url = |raw: &str, param: &str| -> Result<_, ProxyError> {
        let url = parse_url(Some(raw), param)?;
        Ok(set.workers().iter().find(|w| w.url() == &url).cloned())
    };
    match which {
        Which::Url(raw) => by_url(raw, "url"),
        Which::Name(name) => Ok(set
            .workers()
            .iter()
            .find(|w| w.config().name.as_deref() == Some(*name))
            .cloned()),
        Which::Either(raw) => match set.by_key(raw) {
            Some(w) => Ok(Some(std::sync::Arc::clone(w))),
            None => by_url(raw, "worker"),
        },
    }
}

fn shown(which: &Which<'_>) -> String {
    match which {
        Which::Url(raw) | Which::Either(raw) => crate::redact::url(raw).into_owned(),
        Which::Name(name) => format!("named `{}`", crate::redact::line(name)),
    }
}

/// The worker an admin request names by `url=` or `name=` (one of them).
enum Named {
    Url(String),
    Name(String),
}

impl Named {
    fn as_which(&self) -> Which<'_> {
        match self {
            Named::Url(u) => Which::Url(u),
            Named::Name(n) => Which::Name(n),
        }
    }
}

fn named(uri: &http::Uri) -> Result<Named, ProxyError> {
    match (query_param(uri, "url"), query_param(uri, "name")) {
        (Some(url), None) => Ok(Named::Url(url)),
        (None, Some(name)) => Ok(Named::Name(name)),
        (Some(_), Some(_)) => Err(ProxyError::BadRequest(
            "give `url` or `name`, not both".into(),
        )),
        (None, None) => Err(ProxyError::BadRequest(
            "missing query parameter `url` (the worker's URL) or `name` (its name)".into(),
        )),
    }
}

/// `POST /workers/drain` (`on`): the worker takes no new request and its streams move
/// to another worker after `proxy.drain_secs`; `DELETE /workers/drain`: it takes
/// requests again.
fn drain_worker(
    admin: &Admin,
    which: Which<'_>,
    on: bool,
) -> Result<http::Response<ProxyBody>, ProxyError> {
    let Some(w) = find_worker(&admin.worker_set(), &which)? else {
        return Err(ProxyError::UnknownWorker {
            which: shown(&which),
        });
    };
    let pool = admin.pools.workers();
    let after = pool.drain_after();
    let changed = if on {
        w.drain(crate::pools::pool::now() + after)
    } else {
        w.undrain()
    };
    if changed && on {
        tracing::info!(worker = %w.url(), drain_secs = after.as_secs_f64(), "worker draining (admin API): no new requests; its streams move elsewhere when the drain ends");
    } else if changed {
        tracing::info!(worker = %w.url(), "worker takes requests again (admin API)");
    }
    Ok(json_response(
        StatusCode::OK,
        serde_json::json!({"worker": w.url().to_string(), "key": w.key(), "draining": on, "drain_secs": after.as_secs_f64()})
            .to_string(),
    ))
}

fn remove_worker(admin: &Admin, which: Which<'_>) -> Result<http::Response<ProxyBody>, ProxyError> {
    let Some(w) = find_worker(&admin.worker_set(), &which)? else {
        return Err(ProxyError::UnknownWorker {
            which: shown(&which),
        });
    };
    admin.pools.workers().remove(w.key());
    tracing::info!(worker = %w.url(), key = w.key(), "worker removed (admin API); its in-flight requests finish, its streams move elsewhere after proxy.drain_secs");
    Ok(json_response(
        StatusCode::OK,
        serde_json::json!({"removed": w.url().to_string(), "key": w.key(), "workers": admin.worker_set().workers().len()})
            .to_string(),
    ))
}

/// The answer to `POST /cache/clear` under a policy that keeps no prefix records.
fn keeps_no_tree() -> http::Response<ProxyBody> {
    json_response(
        StatusCode::OK,
        serde_json::json!({"cleared": "nothing", "nodes_removed": 0, "note": "this policy keeps no prefix tree"})
            .to_string(),
    )
}

/// `POST /cache/clear` on a blocking thread (see [`Mutation::ClearCache`]).
pub async fn clear_cache_blocking(
    admin: std::sync::Arc<Admin>,
    worker: Option<String>,
) -> http::Response<ProxyBody> {
    let cleared = tokio::task::spawn_blocking(move || {
        clear_cache(&admin, worker.as_deref()).unwrap_or_else(ProxyError::into_response)
    })
    .await;
    cleared.unwrap_or_else(|e| {
        ProxyError::Internal {
            what: "clearing the route records failed",
            cause: Box::new(e),
        }
        .into_response()
    })
}

fn clear_cache(
    admin: &Admin,
    worker: Option<&str>,
) -> Result<http::Response<ProxyBody>, ProxyError> {
    let views = admin.views();
    let clear = |worker| {
        views
            .iter()
            .filter_map(|v| v.clear(worker))
            .reduce(|a, b| a + b)
    };
    let body = match worker {
        None => {
            let Some(removed) = clear(None) else {
                return Ok(keeps_no_tree());
            };
            tracing::info!(nodes = removed, "route records cleared (admin API)");
            serde_json::json!({"cleared": "all", "nodes_removed": removed})
        }
        Some(raw) => {
            let which = Which::Either(raw);
            let Some(w) = find_worker(&admin.worker_set(), &which)? else {
                return Err(ProxyError::UnknownWorker {
                    which: shown(&which),
                });
            };
            let Some(removed) = clear(Some(w.id())) else {
                return Ok(keeps_no_tree());
            };
            tracing::info!(worker = %w.url(), nodes = removed, "route records of one worker cleared (admin API)");
            serde_json::json!({"cleared": w.url().to_string(), "nodes_removed": removed})
        }
    };
    Ok(json_response(StatusCode::OK, body.to_string()))
}

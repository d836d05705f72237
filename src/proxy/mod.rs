//! The request path: read the body, extract the prompt, pick a worker, forward, stream
//! the answer back.
//!
//! [`Router`] is the hyper service state shared by every connection. One request loads
//! the current [`WorkerSet`] once and keeps it for all its attempts. The upstream body
//! goes back to the client frame by frame inside a [`GuardedBody`], which owns the
//! in-flight guard. Retries (other workers only, with backoff) happen only before any
//! response byte reached the client: once headers are returned, a failure ends the
//! client's stream with an error, never a replay.

pub mod body;
pub mod headers;
pub mod models;
pub mod request_body;
pub mod upstream;
pub mod usage;

use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use http_body_util::combinators::BoxBody;
use hyper::body::Incoming;

pub use body::GuardedBody;

use crate::admin;
use crate::breaker::Outcome;
use crate::config::{Config, PolicyKind, RemoteMediaPolicy, WorkerConfig};
use crate::error::ProxyError;
use crate::metrics::Metrics;
use crate::policy::{self, CacheParams, Candidate, Pick, Reason};
use crate::precise::{self, Precise};
use crate::prompt::{self, Endpoint, RouteContext};
use crate::tree::WorkerMask;
use crate::workers::{InFlightGuard, Worker, WorkerId, WorkerSet};

/// Error type of response bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// The body of every response the router sends.
pub type ProxyBody = BoxBody<Bytes, BoxError>;

/// Shared state of the request path. See the module docs.
pub struct Router {
    config: Config,
    workers: ArcSwap<WorkerSet>,
    client: upstream::Upstream,
    params: CacheParams,
    metrics: Arc<Metrics>,
    /// Worker label of answers the router gave itself.
    no_worker: Arc<str>,
    membership: std::sync::Mutex<()>,
    /// Precise mode's block index (empty unless `policy: precise_cache_aware`).
    precise: Arc<Precise>,
}

impl Router {
    /// Builds the router for a validated config: workers start healthy with nothing in
    /// flight, and the tree starts empty.
    pub fn new(config: Config) -> Self {
        let set = WorkerSet::new(
            config
                .workers
                .iter()
                .map(|w| Arc::new(Worker::new(w.clone(), &config.circuit_breaker)))
                .collect(),
        );
        Router {
            client: upstream::Upstream::new(&config.proxy),
            params: CacheParams::from(&config.cache),
            workers: ArcSwap::from_pointee(set),
            metrics: Arc::new(Metrics::new()),
            no_worker: Arc::from("none"),
            membership: std::sync::Mutex::new(()),
            precise: Arc::new(Precise::new(&config.precise)),
            config,
        }
    }

    /// The metrics registry (also fed by reload and `/metrics`).
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Precise mode's shared state (index, decision counters).
    pub fn precise(&self) -> &Arc<Precise> {
        &self.precise
    }

    /// The pooled upstream client (shared with health probes).
    pub fn upstream(&self) -> &upstream::Upstream {
        &self.client
    }

    /// The current worker set (one atomic load).
    pub fn worker_set(&self) -> Arc<WorkerSet> {
        self.workers.load_full()
    }

    /// Swaps in a new worker list (SIGHUP reload): workers whose config is unchanged
    /// keep their `Arc<Worker>` (health, breaker, in-flight); the tree and the models
    /// cache start fresh. Requests in flight keep the set they loaded.
    pub fn replace_workers(&self, workers: &[WorkerConfig]) {
        let _serial = self.lock_membership();
        let old = self.workers.load_full();
        let by_url: std::collections::HashMap<&crate::config::WorkerUrl, &Arc<Worker>> =
            old.workers().iter().map(|w| (w.url(), w)).collect();
        let next = workers
            .iter()
            .map(|cfg| {
                by_url
                    .get(&cfg.url)
                    .filter(|w| w.config() == cfg)
                    .map(|w| Arc::clone(w))
                    .unwrap_or_else(|| {
                        Arc::new(Worker::new(cfg.clone(), &self.config.circuit_breaker))
                    })
            })
            .collect();
        self.workers.store(Arc::new(WorkerSet::new(next)));
    }

    /// Adds one worker (admin API), keeping the tree: existing workers keep their ids.
    /// Errors when a worker with that URL is already in the pool.
    pub fn add_worker(&self, cfg: WorkerConfig) -> Result<(), String> {
        let _serial = self.lock_membership();
        let old = self.workers.load_full();
        if old.workers().iter().any(|w| w.url() == &cfg.url) {
            return Err(format!("worker {} is already in the pool", cfg.url));
        }
        let mut next: Vec<Arc<Worker>> = old.workers().to_vec();
        next.push(Arc::new(Worker::new(cfg, &self.config.circuit_breaker)));
        let tree = std::mem::take(&mut *old.tree());
        self.workers
            .store(Arc::new(WorkerSet::with_tree(next, tree)));
        Ok(())
    }

    /// Removes one worker by URL (admin API): it takes no new requests, its in-flight
    /// requests finish, its tree records go and the others keep theirs. Returns false
    /// when no worker has that URL.
    pub fn remove_worker(&self, url: &crate::config::WorkerUrl) -> bool {
        let _serial = self.lock_membership();
        let old = self.workers.load_full();
        let Some(gone) = old.workers().iter().position(|w| w.url() == url) else {
            return false;
        };
        let next: Vec<Arc<Worker>> = old
            .workers()
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != gone)
            .map(|(_, w)| Arc::clone(w))
            .collect();
        let map: Vec<Option<WorkerId>> = (0..old.workers().len())
            .map(|i| match i.cmp(&gone) {
                std::cmp::Ordering::Less => Some(WorkerId(i as u32)),
                std::cmp::Ordering::Equal => None,
                std::cmp::Ordering::Greater => Some(WorkerId(i as u32 - 1)),
            })
            .collect();
        let mut tree = std::mem::take(&mut *old.tree());
        tree.renumber(&map);
        self.workers
            .store(Arc::new(WorkerSet::with_tree(next, tree)));
        true
    }

    /// Serialises changes of the worker list (reload, admin API) so none is lost; held
    /// only while a new set is built, never across an `.await`.
    fn lock_membership(&self) -> std::sync::MutexGuard<'_, ()> {
        self.membership.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Answers one client request. Never fails: errors become JSON responses.
    pub async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Response<ProxyBody> {
        let method = req.method().clone();
        let path = req.uri().path();
        if method == Method::GET {
            match path {
                "/health" => return admin::health(&self.worker_set()),
                "/workers" => return admin::workers(&self),
                "/metrics" => return admin::metrics(&self),
                _ => {}
            }
        }
        if let Some(resp) = admin::mutation(&self, &req) {
            return match resp {
                admin::Mutation::Done(r) => r,
                admin::Mutation::NeedsBody => admin::mutate_with_body(&self, req).await,
            };
        }
        let label = endpoint_label(&method, path);
        let request_id = headers::request_id(req.headers());
        let result = if label == "models" {
            models::get(&self, req, &request_id).await
        } else if label == "other" && !self.config.proxy.passthrough.allows(path) {
            Err(ProxyError::NotPassedThrough {
                path: shown_path(path),
                rule: self.config.proxy.passthrough.describe(),
            })
        } else {
            self.proxy(req, &request_id, label).await
        };
        let mut resp = result.unwrap_or_else(|e| {
            let status = e.status().as_u16();
            self.metrics.request(label, &self.no_worker, status);
            tracing::info!(
                target: "cache_aware_router::access",
                request_id = request_id.to_str().unwrap_or("-"),
                endpoint = label,
                worker = "-",
                reason = if matches!(e, ProxyError::NoWorker(_)) { "no_worker" } else { "-" },
                status,
                error = %e,
                "request"
            );
            e.into_response()
        });
        resp.headers_mut()
            .insert(headers::REQUEST_ID.clone(), request_id);
        resp
    }

    /// Reads the body (bounded), routes and forwards.
    async fn proxy(
        &self,
        req: Request<Incoming>,
        request_id: &HeaderValue,
        label: &'static str,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let arrived = Instant::now();
        let (parts, body) = req.into_parts();
        let body = request_body::read(
            body,
            content_length(&parts.headers),
            self.config.server.max_body_bytes,
            self.config.server.body_timeout,
        )
        .await?;
        let endpoint = (parts.method == Method::POST)
            .then(|| Endpoint::from_path(parts.uri.path()))
            .flatten();
        let started = Instant::now();
        let ctx = endpoint.map(|e| prompt::extract(e, &body, self.config.cache.max_prompt_bytes));
        if let (Some(c), RemoteMediaPolicy::Reject(status)) =
            (&ctx, self.config.proxy.remote_media_url_policy)
            && c.has_remote_media
        {
            return Err(ProxyError::RemoteMedia(
                StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST),
            ));
        }
        // Precise mode: the request's token ids, keyed once (before the worker set is
        // read: tokenizing may wait for the blocking pool).
        let lookup = if self.config.policy == PolicyKind::PreciseCacheAware {
            Some(self.precise.lookup(&parts.headers, endpoint, &body).await)
        } else {
            None
        };
        let set = self.worker_set();
        let route = Route {
            label,
            ctx: ctx.as_ref(),
            lookup,
            arrived,
            started,
        };
        self.forward(&set, &parts, body.clone(), &route, request_id)
            .await
    }

    /// Picks a worker and forwards, retrying on other workers while nothing has been
    /// returned to the client.
    async fn forward(
        &self,
        set: &WorkerSet,
        parts: &http::request::Parts,
        body: Bytes,
        route: &Route<'_>,
        request_id: &HeaderValue,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let base = upstream::RequestTemplate::new(parts, request_id);
        let mut tried = WorkerMask::default();
        let mut last_error =
            ProxyError::NoWorker("every worker is unhealthy, at max_load, or down");
        // A retryable answer kept until another worker takes the request: when none is
        // left, the client gets the worker's own answer (e.g. its 503), not ours.
        let mut held: Option<(Response<Incoming>, InFlightGuard, AccessLog)> = None;
        let retries = self.config.proxy.max_retries;
        let mut started = route.started;
        for attempt in 0..=retries {
            if attempt > 0 {
                tokio::time::sleep(self.backoff(attempt)).await;
                started = Instant::now();
            }
            let Some((pick, mut guard)) = self.pick(set, route, &tried) else {
                if let Some((resp, guard, log)) = held {
                    return Ok(self.respond(resp, guard, log));
                }
                self.metrics.decision(Reason::NoWorker, started.elapsed());
                return Err(last_error);
            };
            held = None;
            let worker = Arc::clone(guard.worker());
            let decision = Decision {
                reason: pick.reason,
                matched_ratio: pick.matched_ratio(),
                decision_us: started.elapsed().as_micros() as u64,
                attempt,
            };
            self.metrics.decision(pick.reason, started.elapsed());
            if pick.reason == Reason::CacheHit {
                self.metrics
                    .estimated_saved(worker.label(), pick.saved_tokens());
            }
            if attempt > 0 {
                self.metrics.retry();
            }
            if let Some(id) = pick.worker {
                tried.insert(id);
            }
            let result = self
                .client
                .send(&worker, &base, body.clone(), pick.dp_rank)
                .await;
            guard.record(match &result {
                Ok(r) if r.status().is_server_error() => Outcome::Failure,
                Ok(r) if r.status().is_client_error() => Outcome::Neutral,
                Ok(_) => Outcome::Success,
                Err(_) => Outcome::Failure,
            });
            match result {
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    let log = AccessLog {
                        request_id: request_id.clone(),
                        endpoint: route.label,
                        worker: Arc::clone(worker.label()),
                        decision,
                        status,
                        arrived: route.arrived,
                    };
                    if attempt == retries || !self.config.proxy.retryable_statuses.contains(&status)
                    {
                        return Ok(self.respond(resp, guard, log));
                    }
                    tracing::warn!(
                        request_id = ?request_id,
                        worker = %worker.url(),
                        status,
                        "retryable status; trying another worker"
                    );
                    held = Some((resp, guard, log));
                }
                Err(e) => {
                    tracing::warn!(request_id = ?request_id, worker = %worker.url(), error = %e, "upstream attempt failed");
                    last_error = e;
                }
            }
        }
        match held {
            Some((resp, guard, log)) => Ok(self.respond(resp, guard, log)),
            None => Err(last_error),
        }
    }

    /// One decision plus the in-flight slot on the chosen worker. A worker that filled
    /// up between the decision and the slot is skipped and the decision re-run.
    fn pick(
        &self,
        set: &WorkerSet,
        route: &Route<'_>,
        tried: &WorkerMask,
    ) -> Option<(Pick, InFlightGuard)> {
        let mut excluded = tried.clone();
        loop {
            let now = crate::workers::now();
            let candidates: Vec<Candidate> = set
                .workers()
                .iter()
                .enumerate()
                .map(|(i, w)| {
                    let id = WorkerId(i as u32);
                    Candidate {
                        id,
                        load: w.load(),
                        usable: !excluded.contains(id) && w.is_routable(now),
                        cache_aware: w.config().cache_aware,
                    }
                })
                .collect();
            let text_len = route.ctx.map_or(0, |c| c.text.len());
            let pick = match (self.config.policy, route.ctx) {
                (PolicyKind::CacheAware, Some(ctx)) => {
                    let record = !set.is_evicting();
                    if !record {
                        set.skipped_inserts
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    let mut tree = set.tree();
                    policy::pick_cache_aware(
                        &self.params,
                        &ctx.text,
                        &candidates,
                        &mut tree,
                        record,
                        &mut rand::rng(),
                    )
                }
                // Precise mode (src/precise): engine-reported blocks, tree as fallback.
                (PolicyKind::PreciseCacheAware, Some(ctx)) => self.precise.pick(
                    set,
                    &self.params,
                    route.lookup.as_ref(),
                    &ctx.text,
                    &candidates,
                ),
                (PolicyKind::RoundRobin, _) => {
                    policy::pick_round_robin(&candidates, text_len, set.next_ticket())
                }
                (PolicyKind::Random, _) => {
                    policy::pick_random(&candidates, text_len, &mut rand::rng())
                }
                (
                    PolicyKind::LeastLoad | PolicyKind::CacheAware | PolicyKind::PreciseCacheAware,
                    _,
                ) => policy::pick_least_load(&candidates, text_len, &mut rand::rng()),
            };
            let id = pick.worker?;
            let worker = set.get(id)?;
            // Lost a race for the last slot, or the breaker's last probe slot: re-pick.
            if let Some(mut guard) = InFlightGuard::try_acquire(worker)
                && guard.admit()
            {
                return Some((pick, guard));
            }
            excluded.insert(id);
        }
    }

    /// Backoff before retry number `attempt` (1-based): initial × multiplier^(attempt-1),
    /// spread by ± `jitter_factor`.
    fn backoff(&self, attempt: u32) -> Duration {
        let p = &self.config.proxy;
        let base = p.initial_backoff.as_secs_f64() * p.backoff_multiplier.powi(attempt as i32 - 1);
        let jitter = 1.0 + p.jitter_factor * (rand::random::<f64>() * 2.0 - 1.0);
        Duration::from_secs_f64((base * jitter).clamp(0.0, 60.0))
    }

    /// The client's response: upstream status and end-to-end headers, body streamed with
    /// the in-flight guard.
    fn respond(
        &self,
        resp: Response<Incoming>,
        guard: InFlightGuard,
        log: AccessLog,
    ) -> Response<ProxyBody> {
        self.metrics.request(log.endpoint, &log.worker, log.status);
        self.metrics.first_byte(&log.worker, log.arrived.elapsed());
        let (mut parts, incoming) = resp.into_parts();
        if headers::strip_hop_by_hop(&mut parts.headers) {
            // Framing is hyper's job now; a length beside chunked framing is stale.
            parts.headers.remove(header::CONTENT_LENGTH);
        }
        if self.config.proxy.add_routed_peer_header
            && let Ok(v) = HeaderValue::from_str(&guard.worker().url().to_string())
        {
            parts.headers.insert(headers::ROUTED_PEER.clone(), v);
        }
        let is_sse = parts
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        if is_sse {
            // Keep any buffering proxy in front (nginx) from holding tokens back.
            parts
                .headers
                .entry(header::CACHE_CONTROL)
                .or_insert(HeaderValue::from_static("no-cache"));
            parts
                .headers
                .entry("x-accel-buffering")
                .or_insert(HeaderValue::from_static("no"));
        }
        let tap = body::BodyTap {
            metrics: Arc::clone(&self.metrics),
            scanner: usage::UsageScanner::for_response(&parts.headers),
            log,
        };
        let body =
            GuardedBody::new(incoming, guard, self.config.proxy.request_timeout, tap).boxed();
        Response::from_parts(parts, body)
    }
}

/// What one request routes on.
struct Route<'a> {
    /// Endpoint label for logs and metrics.
    label: &'static str,
    ctx: Option<&'a RouteContext<'a>>,
    /// Precise mode: the prompt's blocks, or why precise scoring is neutral.
    lookup: Option<precise::Lookup>,
    /// When the request arrived (for TTFB and duration).
    arrived: Instant,
    /// When the decision started (for its latency).
    started: Instant,
}

/// How a worker was chosen for one attempt.
#[derive(Debug, Clone, Copy)]
pub struct Decision {
    pub reason: Reason,
    pub matched_ratio: f64,
    /// Extract + match + insert, in µs.
    pub decision_us: u64,
    /// 0 for the first try.
    pub attempt: u32,
}

/// One request's access-log line, written when its response body ends.
#[derive(Debug)]
pub struct AccessLog {
    pub request_id: HeaderValue,
    pub endpoint: &'static str,
    pub worker: Arc<str>,
    pub decision: Decision,
    pub status: u16,
    pub arrived: Instant,
}

impl AccessLog {
    /// Writes the line; `outcome` says how the body ended (`complete`, `client_gone`,
    /// `upstream_error`).
    pub fn write(&self, outcome: &'static str) {
        tracing::info!(
            target: "cache_aware_router::access",
            request_id = self.request_id.to_str().unwrap_or("-"),
            endpoint = self.endpoint,
            worker = &*self.worker,
            reason = self.decision.reason.as_str(),
            matched_ratio = format_args!("{:.3}", self.decision.matched_ratio),
            decision_us = self.decision.decision_us,
            attempt = self.decision.attempt,
            status = self.status,
            duration_ms = format_args!("{:.1}", self.arrived.elapsed().as_secs_f64() * 1e3),
            outcome,
            "request"
        );
    }
}

/// Endpoint label of a request, for logs and metrics.
fn endpoint_label(method: &Method, path: &str) -> &'static str {
    match (method, path) {
        (&Method::GET, "/v1/models") => "models",
        (&Method::POST, p) => Endpoint::from_path(p).map_or("other", Endpoint::as_str),
        _ => "other",
    }
}

/// The request's declared `Content-Length`, when it has a valid one.
pub fn content_length(headers: &http::HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
}

/// A client's path as quoted back in an error: at most 100 characters.
fn shown_path(path: &str) -> String {
    match path.char_indices().nth(100) {
        Some((i, _)) => format!("{}…", &path[..i]),
        None => path.to_string(),
    }
}

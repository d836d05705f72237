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
mod json_members;
pub mod media;
pub mod models;
pub mod responses;
pub mod tunnel;
pub mod usage;

/// The client to workers, below `proxy` (`crate::upstream`).
pub use crate::upstream;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;

use crate::upstream::UpstreamBody;
pub use body::GuardedBody;

use crate::cache::{self, Lookup, Pending, ResponseCache};
use crate::config::{Config, PassthroughVerdict, RemoteMediaPolicy, Role};
use crate::error::ProxyError;
use crate::fleet::Fleet;
use crate::log_format::Decimal;
use crate::metrics::Metrics;
use crate::policy::{self, Outcome, Pick, Policy, Prepared, Reason, RequestParts, RouteRequest};
use crate::pool::breaker::Outcome as BreakerOutcome;
use crate::pool::{InFlightGuard, Pool, Worker, WorkerSet};
use crate::prompt::{self, Endpoint};
use crate::trace::TraceContext;
use crate::trace::export::{Exporter, Finished};
use crate::tree::WorkerMask;

pub use crate::error::{BoxError, ProxyBody};

/// Shared state of the request path. See the module docs.
pub struct Router {
    config: Config,
    pool: Arc<Pool>,
    policy: Arc<dyn Policy>,
    client: upstream::Upstream,
    metrics: Arc<Metrics>,
    /// `response_cache:` when enabled.
    cache: Option<Arc<ResponseCache>>,
    /// Routing state shared with other router replicas (`state.redis_url`).
    fleet: Option<Arc<Fleet>>,
    /// Worker label of answers the router gave itself.
    no_worker: Arc<str>,
    /// Worker label of answers replayed from the response cache.
    cache_worker: Arc<str>,
    /// One span per request to an OTLP collector (`tracing.otlp_endpoint`); `None` =
    /// no export, and no span is built.
    export: Option<Arc<Exporter>>,
}

impl Router {
    /// Builds the router for a validated config: workers start healthy with nothing in
    /// flight, and the policy's state starts empty.
    pub fn new(config: Config) -> Self {
        let pool = Arc::new(Pool::new(&config.workers, &config.circuit_breaker));
        let policy::Routing { policy, fleet, .. } = policy::build(&config, &pool);
        let mut metrics = Metrics::new();
        for view in policy.views() {
            if let Some(c) = view.collector(&pool) {
                metrics.register(c);
            }
        }
        let client = upstream::Upstream::new(&config.proxy);
        metrics.register(Box::new(crate::pool::metrics::PoolMetrics::new(
            Arc::clone(&pool),
        )));
        if let Some(f) = &fleet {
            metrics.register(Box::new(crate::fleet::metrics::FleetMetrics(Arc::clone(f))));
        }
        let rc = &config.response_cache;
        let cache = rc.enabled.then(|| {
            let bearer = rc
                .semantic
                .as_ref()
                .and_then(|s| embeddings_key(&config, &s.embeddings_url));
            ResponseCache::new(rc, &client, bearer)
                .inspect_err(|e| tracing::error!(error = %e, "response cache off: it cannot start"))
                .ok()
        });
        let cache = cache.flatten();
        if let Some(c) = &cache {
            metrics.register(Box::new(crate::cache::metrics::CacheCollector(Arc::clone(
                c,
            ))));
        }
        let metrics = Arc::new(metrics);
        pool.listen(Arc::clone(&metrics) as Arc<dyn crate::pool::PoolListener>);
        let export = config.tracing.otlp_endpoint.as_ref().and_then(|url| {
            Exporter::new(&config.tracing)
                .inspect(|_| tracing::info!(collector = %crate::redact::url(&url.to_string()), "tracing: exporting one span per request"))
                .inspect_err(|e| tracing::error!(error = %e, "tracing export off: it cannot start"))
                .ok()
                .map(Arc::new)
        });
        Router {
            export,
            client,
            pool,
            policy,
            metrics,
            cache,
            fleet,
            no_worker: Arc::from("none"),
            cache_worker: Arc::from("cache"),
            config,
        }
    }

    /// The fleet (shared routing state), when `state.redis_url` is set.
    pub fn fleet(&self) -> Option<&Arc<Fleet>> {
        self.fleet.as_ref()
    }

    /// The response cache, when `response_cache.enabled`.
    pub fn response_cache(&self) -> Option<&Arc<ResponseCache>> {
        self.cache.as_ref()
    }

    /// The span exporter, when `tracing.otlp_endpoint` is set (flushed at shutdown).
    pub fn exporter(&self) -> Option<&Arc<Exporter>> {
        self.export.as_ref()
    }

    /// The metrics registry (also fed by reload and `/metrics`).
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The worker pool (membership, health, load).
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// The routing policy.
    pub fn policy(&self) -> &Arc<dyn Policy> {
        &self.policy
    }

    /// The pooled upstream client (shared with health probes).
    pub fn upstream(&self) -> &upstream::Upstream {
        &self.client
    }

    /// The current worker set (one atomic load).
    pub fn worker_set(&self) -> Arc<WorkerSet> {
        self.pool.set()
    }

    /// Answers a request for a worker (a routed endpoint, `/v1/models`, or a path
    /// `proxy.passthrough` allows). Never fails: errors become JSON responses.
    pub async fn serve(&self, req: Request<Incoming>) -> Response<ProxyBody> {
        let arrived = Instant::now();
        let method = req.method().clone();
        let path = req.uri().path();
        let label = endpoint_label(&method, path);
        let request_id = headers::request_id(req.headers());
        let trace = TraceContext::from_headers(req.headers());
        // `x-cache` on every answer while the cache is on: bypass unless the lookup
        // says otherwise.
        let mut x_cache = self.cache.as_ref().map(|_| cache::Status::Bypass);
        let mut unanswered = Unanswered {
            metrics: &self.metrics,
            export: self.export.as_deref(),
            trace,
            endpoint: label,
            request_id: &request_id,
            arrived,
            waiting_on: None,
            answered: false,
        };
        let result = if label == "models" {
            models::get(self, req, &request_id, trace, &mut unanswered.waiting_on).await
        } else if label == "other"
            && let verdict @ (PassthroughVerdict::NotListed | PassthroughVerdict::Operator) =
                self.config.proxy.passthrough.verdict(path)
        {
            Err(match verdict {
                PassthroughVerdict::Operator => ProxyError::OperatorEndpoint {
                    path: shown_path(path),
                },
                _ => ProxyError::NotPassedThrough {
                    path: shown_path(path),
                    rule: self.config.proxy.passthrough.describe(),
                },
            })
        } else if tunnel::is_websocket_upgrade(&method, req.headers()) {
            self.tunnel(req, &request_id, trace, label, &mut unanswered.waiting_on)
                .await
        } else {
            self.proxy(
                req,
                &request_id,
                trace,
                label,
                &mut x_cache,
                &mut unanswered.waiting_on,
            )
            .await
        };
        unanswered.answered = true;
        drop(unanswered);
        let mut resp = result.unwrap_or_else(|e| {
            let status = e.status().as_u16();
            self.metrics.request(label, &self.no_worker, status);
            self.metrics.outcome("complete");
            let reason = if matches!(e, ProxyError::NoWorker(_)) {
                "no_worker"
            } else {
                "-"
            };
            tracing::info!(
                target: "cache_aware_router::access",
                request_id = request_id.to_str().unwrap_or("-"),
                trace_id = %trace.trace_id,
                endpoint = label,
                worker = "-",
                reason,
                status,
                error = %e,
                outcome = "complete",
                "request"
            );
            if let Some(x) = &self.export {
                x.record(&unrouted(
                    label,
                    trace,
                    arrived,
                    &request_id,
                    Arc::clone(&self.no_worker),
                    (reason, status, "complete"),
                    Some(&e.to_string()),
                ));
            }
            e.into_response()
        });
        resp.headers_mut()
            .insert(headers::REQUEST_ID.clone(), request_id);
        if let Some(status) = x_cache {
            resp.headers_mut()
                .insert(headers::X_CACHE.clone(), status.header());
        }
        resp
    }

    /// Reads the body (bounded), routes and forwards.
    async fn proxy(
        &self,
        req: Request<Incoming>,
        request_id: &HeaderValue,
        trace: TraceContext,
        label: &'static str,
        x_cache: &mut Option<cache::Status>,
        waiting_on: &mut Option<Arc<str>>,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let arrived = Instant::now();
        let (parts, body) = req.into_parts();
        let body = crate::request::body::read(
            body,
            crate::request::body::content_length(&parts.headers),
            self.config.server.max_body_bytes,
            self.config.server.body_timeout,
        )
        .await?;
        // Before anything reads the body for routing or the response cache: every
        // body the router forwards, routed endpoint or pass-through, is checked the same.
        if let RemoteMediaPolicy::Reject(status) = self.config.proxy.remote_media_url_policy
            && media::references_remote_media(&body)
        {
            return Err(ProxyError::RemoteMedia(
                StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST),
            ));
        }
        let endpoint = (parts.method == Method::POST)
            .then(|| Endpoint::from_path(parts.uri.path()))
            .flatten();
        // A call on a stored response goes where the response is.
        if endpoint.is_none() && responses::response_id_in_path(parts.uri.path()).is_some() {
            let route = Route {
                label,
                req: RouteRequest::default(),
                arrived,
                started: Instant::now(),
                cache: None,
                trace,
            };
            return self
                .to_response_holder(parts, body, &route, request_id, waiting_on)
                .await;
        }
        // The response cache first: a hit skips extraction and the pick.
        let mut pending = None;
        if let (Some(c), Some(e)) = (&self.cache, endpoint) {
            match c.lookup(e, &parts.headers, &body).await {
                Lookup::Hit { entry, kind } => {
                    *x_cache = Some(cache::Status::Hit);
                    return Ok(self.replay(&entry, kind, label, request_id, trace, arrived));
                }
                Lookup::Route { status, pending: p } => {
                    *x_cache = Some(status);
                    pending = p;
                }
            }
        }
        let started = Instant::now();
        let mut ctx =
            endpoint.map(|e| prompt::extract(e, &body, self.config.cache.max_prompt_bytes));
        // The policy's own preparation (precise mode: token ids), once, before the
        // worker set is read: it may wait for the blocking pool.
        let prepared = match self.policy.prepare(RequestParts {
            headers: &parts.headers,
            endpoint,
            body: &body,
        }) {
            Some(work) => work.await,
            None => Prepared::Nothing,
        };
        // Read whether or not session affinity is on: `consistent_hash` hashes it too.
        let session = policy::session::session_key(&self.config.session, &parts.headers, &body);
        let set = self.worker_set();
        // The chunk hashes extraction computed with the digest, moved to the request:
        // a shared-state pick matches by them and the publish of what was served
        // takes them.
        let chain = ctx
            .as_mut()
            .map(|c| std::mem::take(&mut c.chain))
            .unwrap_or_default();
        let route = Route {
            label,
            req: RouteRequest {
                ctx: ctx.as_ref(),
                prepared,
                session,
                tie: session.or(ctx.as_ref().map(|c| c.digest)),
                chain: chain.into(),
            },
            arrived,
            started,
            cache: pending,
            trace,
        };
        self.forward(&set, parts, body.clone(), &route, request_id, waiting_on)
            .await
    }

    /// Picks a worker and forwards, retrying on other workers while nothing has been
    /// returned to the client.
    async fn forward(
        &self,
        set: &WorkerSet,
        parts: http::request::Parts,
        body: Bytes,
        route: &Route<'_>,
        request_id: &HeaderValue,
        waiting_on: &mut Option<Arc<str>>,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let base = upstream::RequestTemplate::new(parts, request_id, &route.trace);
        let mut tried = WorkerMask::default();
        let mut last_error =
            ProxyError::NoWorker("every worker is unhealthy, at max_load, or down");
        // A retryable answer kept until another worker takes the request: when none is
        // left, the client gets the worker's own answer (e.g. its 503), not ours.
        let mut held: Option<(Response<UpstreamBody>, InFlightGuard, AccessLog)> = None;
        // Whether `held` is a push-back (429, 503 + Retry-After).
        let mut held_pushed_back = false;
        let retries = self.config.proxy.max_retries;
        // One bound on the client's wait for headers, over every attempt and backoff.
        let deadline = route.arrived + self.config.proxy.request_timeout;
        let mut started = route.started;
        for attempt in 0..=retries {
            if attempt > 0 {
                // Every worker left asked to be left alone: the client gets the first
                // engine's own answer now instead of a round of refusals.
                if held_pushed_back && !self.any_unsaturated(set, &tried) {
                    break;
                }
                let left = deadline.saturating_duration_since(Instant::now());
                let backoff = self.backoff(attempt);
                if backoff >= left {
                    break;
                }
                tokio::time::sleep(backoff).await;
                started = Instant::now();
            }
            let picked = match self.pick(set, route, &tried) {
                None if attempt == 0 => match self.wait_for_slot(set, route, &tried).await {
                    Ok(picked) => picked,
                    Err(e) => {
                        self.metrics.decision(Reason::NoWorker, started.elapsed());
                        return Err(e);
                    }
                },
                picked => picked,
            };
            let Some((pick, mut guard)) = picked else {
                if let Some((resp, guard, log)) = held {
                    return Ok(self.respond(resp, guard, log, route));
                }
                // A retry that finds no worker left is not a decision: the client gets
                // the last attempt's error (a 504 stays a time-out).
                if attempt == 0 {
                    self.metrics.decision(Reason::NoWorker, started.elapsed());
                }
                return Err(last_error);
            };
            *waiting_on = Some(Arc::clone(guard.worker().label()));
            let worker = Arc::clone(guard.worker());
            let decided_in = started.elapsed();
            let decision = Decision {
                reason: pick.reason,
                matched_ratio: pick.matched_ratio(),
                available_tokens: pick.available_tokens(),
                predicted_tokens: pick.saved_tokens(),
                stamp: pick.stamp,
                decision_us: decided_in.as_micros() as u64,
                attempt,
            };
            self.metrics.decision(pick.reason, decided_in);
            if pick.reason == Reason::CacheHit {
                self.metrics
                    .estimated_saved(worker.label(), pick.saved_tokens());
            }
            if attempt > 0 {
                self.metrics.retry();
            }
            if worker.config().role == Role::Fallback {
                self.metrics.fallback_pick();
            }
            if let Some(id) = pick.worker {
                tried.insert(id);
            }
            let attempt_watch = Attempt {
                policy: &*self.policy,
                req: &route.req,
                pick: &pick,
                worker: &worker,
                done: false,
            };
            guard.reserve_prefill(
                pick.prefill_tokens,
                route.req.ctx.map_or(0, |c| c.total_len) as u64,
            );
            let left = deadline.saturating_duration_since(Instant::now());
            let wait = self
                .config
                .proxy
                .attempt_timeout
                .map_or(left, |a| a.min(left));
            let result = self
                .client
                .send(&worker, &base, body.clone(), pick.dp_rank, wait)
                .await;
            let pushed_back = result.as_ref().ok().and_then(back_pressure);
            if let Some(wait) = pushed_back {
                worker.signals().saturate(crate::pool::now() + wait);
                self.metrics.back_pressure(worker.label());
                tracing::info!(
                    request_id = ?request_id,
                    worker = %worker.url(),
                    secs = wait.as_secs_f64(),
                    "worker pushed back; no new requests to it for that long while others can take them"
                );
            }
            guard.record(match &result {
                // Back-pressure is the engine working as designed, not a fault.
                Ok(_) if pushed_back.is_some() => BreakerOutcome::Neutral,
                Ok(r) if r.status().is_server_error() => BreakerOutcome::Failure,
                Ok(r) if r.status().is_client_error() => BreakerOutcome::Neutral,
                Ok(_) => BreakerOutcome::Success,
                Err(_) => BreakerOutcome::Failure,
            });
            attempt_watch.finish(match &result {
                Ok(r) if r.status().is_success() => Outcome::Served,
                _ => Outcome::Failed,
            });
            match result {
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    let log = AccessLog {
                        request_id: request_id.clone(),
                        endpoint: route.label,
                        worker: Arc::clone(worker.label()),
                        role: worker.config().role.as_str(),
                        decision,
                        status,
                        arrived: route.arrived,
                        delivered_tokens: None,
                        trace: route.trace,
                    };
                    // A push-back was refused before any work: another worker may take it.
                    let retryable = pushed_back.is_some()
                        || self.config.proxy.retryable_statuses.contains(&status);
                    if attempt == retries || !retryable {
                        return Ok(self.respond(resp, guard, log, route));
                    }
                    tracing::warn!(
                        request_id = ?request_id,
                        worker = %worker.url(),
                        status,
                        "retryable status; trying another worker"
                    );
                    held = Some((resp, guard, log));
                    held_pushed_back = pushed_back.is_some();
                }
                Err(e) => {
                    // The engine may still be computing a timed-out request: another
                    // try would pay its prefill twice, unless the operator bounded each
                    // attempt (`attempt_timeout_secs`) to fail over.
                    let timed_out = matches!(e, ProxyError::Timeout(_));
                    let again = attempt < retries
                        && (!timed_out || self.config.proxy.attempt_timeout.is_some())
                        && deadline > Instant::now();
                    if again {
                        tracing::warn!(request_id = ?request_id, worker = %worker.url(), error = %e, "upstream attempt failed; trying another worker");
                    } else {
                        tracing::warn!(request_id = ?request_id, worker = %worker.url(), error = %e, "upstream attempt failed");
                    }
                    last_error = e;
                    if !again {
                        break;
                    }
                }
            }
        }
        match held {
            Some((resp, guard, log)) => Ok(self.respond(resp, guard, log, route)),
            None => Err(last_error),
        }
    }

    /// `proxy.queue`: when no worker could be picked only because every usable one is at
    /// `max_load`, waits (FIFO among the waiting, bounded by `max_waiting`) for a slot to
    /// free and picks again, for at most `timeout_ms`. `Ok(None)` when waiting cannot
    /// help (the queue is off, or no worker is merely full); `Err` when the queue is full
    /// or the time ran out (503 + Retry-After, saying which). A client that leaves drops
    /// this future and so its place.
    async fn wait_for_slot(
        &self,
        set: &WorkerSet,
        route: &Route<'_>,
        tried: &WorkerMask,
    ) -> Result<Option<(Pick, InFlightGuard)>, ProxyError> {
        let q = self.config.proxy.queue;
        let only_full = |now| {
            set.workers()
                .iter()
                .any(|w| !tried.contains(w.id()) && w.is_full(now))
        };
        if q.max_waiting == 0 || !only_full(crate::pool::now()) {
            return Ok(None);
        }
        let Some(_place) = self.metrics.queue_enter(q.max_waiting) else {
            self.metrics.queue_rejected("full");
            return Err(ProxyError::QueueFull { max: q.max_waiting });
        };
        let since = Instant::now();
        let deadline = since + q.timeout;
        loop {
            // Registered before the re-check, so a slot freed in between is not missed.
            let freed = self.pool.slot_freed().notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            if let Some(picked) = self.pick(set, route, tried) {
                self.metrics.queue_waited(since.elapsed());
                return Ok(Some(picked));
            }
            if !only_full(crate::pool::now()) {
                return Ok(None);
            }
            if tokio::time::timeout_at(deadline.into(), freed)
                .await
                .is_err()
            {
                self.metrics.queue_rejected("timeout");
                return Err(ProxyError::QueueTimeout {
                    ms: q.timeout.as_millis() as u64,
                });
            }
        }
    }

    /// Whether a worker not yet tried is usable and has not pushed back.
    fn any_unsaturated(&self, set: &WorkerSet, tried: &WorkerMask) -> bool {
        let now = crate::pool::now();
        set.workers().iter().any(|w| {
            !tried.contains(w.id()) && w.is_routable(now) && !w.signals().is_saturated(now)
        })
    }

    /// One decision plus the in-flight slot on the chosen worker
    /// ([`policy::decide::pick_slot`]).
    fn pick(
        &self,
        set: &WorkerSet,
        route: &Route<'_>,
        tried: &WorkerMask,
    ) -> Option<(Pick, InFlightGuard)> {
        policy::decide::pick_slot(&*self.policy, set, &route.req, tried, &mut rand::rng())
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
        resp: Response<UpstreamBody>,
        guard: InFlightGuard,
        log: AccessLog,
        route: &Route<'_>,
    ) -> Response<ProxyBody> {
        let pending = route.cache.clone();
        // Handed back with the answer (precise mode's parity check); cloning shares it.
        let prepared = route.req.prepared.clone();
        self.metrics.request(log.endpoint, &log.worker, log.status);
        let record = pending.and_then(|p| cache::Recorder::start(p, resp.status(), resp.headers()));
        self.metrics.first_byte(&log.worker, log.arrived.elapsed());
        let (mut parts, incoming) = resp.into_parts();
        if headers::strip_hop_by_hop(&mut parts.headers) {
            // Framing is hyper's job now; a length beside chunked framing is stale.
            parts.headers.remove(header::CONTENT_LENGTH);
        }
        headers::rewrite_worker_urls(&mut parts.headers, guard.worker().url());
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
            policy: Arc::clone(&self.policy),
            scanner: usage::UsageScanner::for_response(
                &parts.headers,
                may_answer_with_response_id(log.endpoint),
            ),
            streamed: is_sse,
            record,
            log,
            drift_floor: self.config.cache.drift_floor,
            drift_for: self.config.cache.drift_for,
            block_tokens: self.config.cache.engine_block_tokens as u64,
            prepared,
            export: self.export.clone(),
        };
        let body =
            GuardedBody::new(incoming, guard, self.config.proxy.request_timeout, tap).boxed();
        Response::from_parts(parts, body)
    }
}

impl Router {
    /// A response-cache hit: the stored answer, counted and logged like a routed one
    /// (worker `cache`, reason `response_cache`).
    fn replay(
        &self,
        entry: &cache::entry::Entry,
        kind: &'static str,
        label: &'static str,
        request_id: &HeaderValue,
        trace: TraceContext,
        arrived: Instant,
    ) -> Response<ProxyBody> {
        self.metrics.request(label, &self.cache_worker, 200);
        self.metrics.outcome("complete");
        tracing::info!(
            target: "cache_aware_router::access",
            request_id = request_id.to_str().unwrap_or("-"),
            trace_id = %trace.trace_id,
            endpoint = label,
            worker = "cache",
            reason = "response_cache",
            cache = kind,
            status = 200,
            bytes = entry.body.len(),
            duration_ms = format_args!("{:.1}", arrived.elapsed().as_secs_f64() * 1e3),
            outcome = "complete",
            "request"
        );
        if let Some(x) = &self.export {
            x.record(&unrouted(
                label,
                trace,
                arrived,
                request_id,
                Arc::clone(&self.cache_worker),
                ("response_cache", 200, "complete"),
                None,
            ));
        }
        entry.replay()
    }
}

/// The backend key to send an embeddings endpoint that is one of the workers (same
/// scheme and authority): that worker's `api_key`, else `proxy.api_key`.
fn embeddings_key(config: &Config, url: &str) -> Option<HeaderValue> {
    let url = crate::config::WorkerUrl::parse(url).ok()?;
    let worker = config
        .workers
        .iter()
        .find(|w| w.url.authority() == url.authority())?;
    worker
        .api_key
        .as_ref()
        .or(config.proxy.api_key.as_ref())
        .map(|k| k.bearer().clone())
}

/// One attempt's pick, told to the policy exactly once: how it ended, or
/// [`Outcome::Cancelled`] when the request is dropped first (the client went away).
struct Attempt<'a> {
    policy: &'a dyn Policy,
    req: &'a RouteRequest<'a>,
    pick: &'a Pick,
    worker: &'a Worker,
    done: bool,
}

impl Attempt<'_> {
    fn finish(mut self, outcome: Outcome) {
        self.done = true;
        self.policy
            .observe(self.req, self.pick, self.worker, outcome);
    }
}

impl Drop for Attempt<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.policy
                .observe(self.req, self.pick, self.worker, Outcome::Cancelled);
        }
    }
}

/// Status logged and counted for a request whose client left before its response
/// headers (nginx's "client closed request").
const CLIENT_CLOSED: u16 = 499;

/// Writes the access line and counts the outcome of a request whose client left before
/// any response was returned (hyper drops the request's future): status 499, outcome
/// `client_gone`, with the worker it was waiting on, if any. Answered requests are
/// logged where their response ends instead, so each request has exactly one line.
struct Unanswered<'a> {
    metrics: &'a Metrics,
    export: Option<&'a Exporter>,
    trace: TraceContext,
    endpoint: &'static str,
    request_id: &'a HeaderValue,
    arrived: Instant,
    /// The worker of the attempt in progress.
    waiting_on: Option<Arc<str>>,
    answered: bool,
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        let worker = self.waiting_on.take().unwrap_or_else(|| Arc::from("none"));
        self.metrics.request(self.endpoint, &worker, CLIENT_CLOSED);
        self.metrics.outcome("client_gone");
        let request_id = self.request_id.to_str().unwrap_or("-");
        tracing::info!(
            target: "cache_aware_router::access",
            request_id,
            trace_id = %self.trace.trace_id,
            endpoint = self.endpoint,
            worker = &*worker,
            status = CLIENT_CLOSED,
            duration_ms = %Decimal::millis(self.arrived.elapsed(), 1),
            outcome = "client_gone",
            "request"
        );
        if let Some(x) = self.export {
            x.record(&unrouted(
                self.endpoint,
                self.trace,
                self.arrived,
                self.request_id,
                worker,
                ("-", CLIENT_CLOSED, "client_gone"),
                None,
            ));
        }
    }
}

/// The span of a request no worker's body answered (the router's own error, a
/// response-cache replay, a client gone before the headers): `(reason, status,
/// outcome)` as its access line says.
fn unrouted<'a>(
    endpoint: &'static str,
    trace: TraceContext,
    arrived: Instant,
    request_id: &'a HeaderValue,
    worker: Arc<str>,
    (reason, status, outcome): (&'static str, u16, &'static str),
    error: Option<&'a str>,
) -> Finished<'a> {
    Finished {
        name: span_name(endpoint),
        trace,
        arrived,
        endpoint,
        request_id: request_id.to_str().unwrap_or("-"),
        worker,
        reason,
        matched_ratio: None,
        attempt: None,
        status,
        outcome,
        error,
    }
}

/// What one request routes on.
struct Route<'a> {
    /// Endpoint label for logs and metrics.
    label: &'static str,
    /// What the policy decides on.
    req: RouteRequest<'a>,
    /// When the request arrived (for TTFB and duration).
    arrived: Instant,
    /// When the decision started (for its latency).
    started: Instant,
    /// Where the answer goes in the response cache, on a miss.
    cache: Option<Pending>,
    /// The router's span (W3C Trace Context), sent upstream as `traceparent`.
    trace: TraceContext,
}

/// How a worker was chosen for one attempt.
#[derive(Debug, Clone, Copy)]
pub struct Decision {
    pub reason: Reason,
    pub matched_ratio: f64,
    /// The longest prefix any worker held, in tokens (estimated from bytes in
    /// approximate mode: whole engine blocks at the worker's learned tokens per byte; exact in precise mode).
    pub available_tokens: u64,
    /// The prefix the chosen worker was believed to hold, in the same tokens.
    pub predicted_tokens: u64,
    /// The pick's [`crate::policy::Pick::stamp`].
    pub stamp: u64,
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
    /// The worker's role (`primary`, `fallback`).
    pub role: &'static str,
    pub decision: Decision,
    pub status: u16,
    pub arrived: Instant,
    /// Cached prompt tokens the engine reported in the answer, once read.
    pub delivered_tokens: Option<u64>,
    /// The request's trace (its id is logged as `trace_id`).
    pub trace: TraceContext,
}

impl AccessLog {
    /// Writes the line; `outcome` says how the body ended (`complete`, `client_gone`,
    /// `upstream_error`).
    pub fn write(&self, outcome: &'static str) {
        tracing::info!(
            target: "cache_aware_router::access",
            request_id = self.request_id.to_str().unwrap_or("-"),
            trace_id = %self.trace.trace_id,
            endpoint = self.endpoint,
            worker = &*self.worker,
            role = self.role,
            reason = self.decision.reason.as_str(),
            matched_ratio = %Decimal::new(self.decision.matched_ratio, 3),
            available_tokens = self.decision.available_tokens,
            predicted_tokens = self.decision.predicted_tokens,
            delivered_tokens = self.delivered_tokens.map_or(-1, |t| t as i64),
            decision_us = self.decision.decision_us,
            attempt = self.decision.attempt,
            status = self.status,
            duration_ms = %Decimal::millis(self.arrived.elapsed(), 1),
            outcome,
            "request"
        );
    }

    /// The request's span as the exporter takes it; `outcome` as for [`AccessLog::write`].
    pub fn finished(&self, outcome: &'static str) -> Finished<'_> {
        Finished {
            name: span_name(self.endpoint),
            trace: self.trace,
            arrived: self.arrived,
            endpoint: self.endpoint,
            request_id: self.request_id.to_str().unwrap_or("-"),
            worker: Arc::clone(&self.worker),
            reason: self.decision.reason.as_str(),
            matched_ratio: Some(self.decision.matched_ratio),
            attempt: Some(self.decision.attempt),
            status: self.status,
            outcome,
            error: None,
        }
    }
}

/// The span name of an endpoint label: method and route, or `proxy` for a path
/// `proxy.passthrough` let through (low cardinality: never the raw path).
fn span_name(label: &'static str) -> &'static str {
    match label {
        "chat_completions" => "POST /v1/chat/completions",
        "completions" => "POST /v1/completions",
        "messages" => "POST /v1/messages",
        "responses" => "POST /v1/responses",
        "models" => "GET /v1/models",
        _ => "proxy",
    }
}

/// Longest saturation a `Retry-After` may ask for: a bogus hour-long value must not
/// take a worker out of rotation for that long.
const MAX_BACK_PRESSURE: Duration = Duration::from_secs(60);

/// How long `resp` asks the router to stay away: a 429 (its `Retry-After`, else 1 s) or a
/// 503 that carries a readable `Retry-After`; `None` for any other answer. `Retry-After`
/// is read in both forms of RFC 9110 §10.2.3, delay-seconds (a value too large for any
/// integer counts as the cap) and HTTP-date; the first header counts. Clamped to
/// 100 ms ..= [`MAX_BACK_PRESSURE`].
fn back_pressure(resp: &Response<UpstreamBody>) -> Option<Duration> {
    let after = resp
        .headers()
        .get(header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(retry_after);
    match resp.status() {
        StatusCode::TOO_MANY_REQUESTS => Some(after.unwrap_or(Duration::from_secs(1))),
        StatusCode::SERVICE_UNAVAILABLE => after,
        _ => None,
    }
    .map(|d| d.clamp(Duration::from_millis(100), MAX_BACK_PRESSURE))
}

/// A `Retry-After` value as a duration from now; `None` when it is neither form.
fn retry_after(v: &str) -> Option<Duration> {
    let v = v.trim();
    if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) {
        return Some(
            v.parse::<u64>()
                .map_or(MAX_BACK_PRESSURE, Duration::from_secs),
        );
    }
    let at = httpdate::parse_http_date(v).ok()?;
    Some(
        at.duration_since(std::time::SystemTime::now())
            .unwrap_or(Duration::ZERO),
    )
}

/// Endpoint label of a request, for logs and metrics.
fn endpoint_label(method: &Method, path: &str) -> &'static str {
    match (method, path) {
        (&Method::GET, "/v1/models") => "models",
        (&Method::POST, p) => Endpoint::from_path(p).map_or("other", Endpoint::as_str),
        _ => "other",
    }
}

/// Whether an answer to the endpoint labelled `label` ([`endpoint_label`]) may carry a
/// `/v1/responses` id: every label but those of the three endpoints that never answer
/// with one (a pass-through path may).
fn may_answer_with_response_id(label: &str) -> bool {
    ![
        Endpoint::ChatCompletions,
        Endpoint::Completions,
        Endpoint::Messages,
    ]
    .iter()
    .any(|e| e.as_str() == label)
}

/// A client's path as quoted back in an error: at most 100 characters.
fn shown_path(path: &str) -> String {
    match path.char_indices().nth(100) {
        Some((i, _)) => format!("{}…", &path[..i]),
        None => path.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_responses_and_unknown_paths_are_searched_for_a_response_id() {
        let label = |m: &Method, p: &str| may_answer_with_response_id(endpoint_label(m, p));
        assert!(label(&Method::POST, "/v1/responses"));
        assert!(label(&Method::POST, "/v1/some/passthrough"));
        for p in ["/v1/chat/completions", "/v1/completions", "/v1/messages"] {
            assert!(!label(&Method::POST, p), "{p}");
        }
    }

    #[test]
    fn retry_after_reads_both_forms() {
        assert_eq!(retry_after("5"), Some(Duration::from_secs(5)));
        assert_eq!(retry_after(" 0 "), Some(Duration::ZERO));
        assert_eq!(retry_after("99999999999999999999"), Some(MAX_BACK_PRESSURE));
        for bad in ["", "abc", "-5", "1.5"] {
            assert_eq!(retry_after(bad), None, "{bad:?}");
        }
        let soon = std::time::SystemTime::now() + Duration::from_secs(30);
        let d = retry_after(&httpdate::fmt_http_date(soon)).unwrap();
        assert!((28..=30).contains(&d.as_secs()), "{d:?}");
        assert_eq!(
            retry_after("Wed, 21 Oct 2015 07:28:00 GMT"),
            Some(Duration::ZERO)
        );
    }
}

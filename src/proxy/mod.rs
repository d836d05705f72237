//! The request path, read in one direction: serve -> forward -> respond.
//!
//! ```text
//! serve       one request the route table sent here: read the body (bounded), check
//!             it, the response cache, the policy's preparation, then forward
//! forward     the attempt loop: pick (policy::decide), send (crate::upstream), tell
//!             the breaker and the policy; retry decides whether another worker tries
//! retry       which answer or failure another worker may take, backoff, push-back
//! respond     the worker's answer as the client's response, its body in a GuardedBody
//! body        GuardedBody: streams the answer, owns the in-flight guard, ends the request
//! access_log  the end of a request, in one place: outcome, access line, span
//! models, responses, tunnel   GET /v1/models; calls on a stored response; WebSockets
//! headers, media, usage       header rules; remote media; engine usage in the answer
//! ```
//!
//! [`Router`] is the hyper service state shared by every connection. One request loads
//! the current [`WorkerSet`] once and keeps it for all its attempts. The upstream body
//! goes back to the client frame by frame inside a [`GuardedBody`], which owns the
//! in-flight guard. Retries (other workers only, with backoff) happen only before any
//! response byte reached the client: once headers are returned, a failure ends the
//! client's stream with an error, never a replay.

mod access_log;
pub mod body;
mod forward;
pub mod headers;
mod json_members;
pub mod media;
pub mod models;
mod respond;
pub mod responses;
mod retry;
mod serve;
pub mod tunnel;
pub mod usage;

/// The client to workers, below `proxy` (`crate::upstream`).
pub use crate::upstream;

use std::sync::Arc;

use http::header::HeaderValue;

pub use access_log::{AccessLog, Decision};
pub use body::GuardedBody;
pub use serve::Call;

use crate::cache::ResponseCache;
use crate::config::Config;
use crate::fleet::Fleet;
use crate::metrics::Metrics;
use crate::policy::{self, Policy};
use crate::pool::{Pool, WorkerSet};
use crate::trace::export::Exporter;

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

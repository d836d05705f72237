//! Every running part, built once from the config. `app` hands each consumer the parts
//! it uses (the proxy, the admin endpoints, the background tasks); no part reaches
//! another through a third one, and nothing is wired in after construction.

use std::sync::Arc;

use http::HeaderValue;

use crate::cache::ResponseCache;
use crate::config::Config;
use crate::fleet::Fleet;
use crate::flow::Flow;
use crate::metrics::Metrics;
use crate::policy::{self, Policy, Routes};
use crate::pools::Pools;
use crate::pools::pool::Pool;
use crate::proxy::metrics::RequestMetrics;
use crate::reload::ReloadMetrics;
use crate::shutdown::Shutdown;
use crate::trace::export::Exporter;
use crate::upstream::Upstream;

/// See the module docs.
pub struct Parts {
    /// The routing table: every worker once (membership, health, load) and the pools
    /// that route over them, each with its policy (whose views' families are
    /// registered in `metrics`).
    pub pools: Arc<Routes>,
    /// Routing state shared with other router replicas (`state.redis_url`).
    pub fleet: Option<Arc<Fleet>>,
    /// The pooled client to workers (requests, health probes, scrapes).
    pub upstream: Upstream,
    /// The registry every part registered its families in (`/metrics` encodes it).
    pub metrics: Arc<Metrics>,
    /// The request path's families (the proxy's); they hear the pool's membership (a
    /// worker that leaves takes its series with them).
    pub requests: Arc<RequestMetrics>,
    /// `reloads_total` (SIGHUP's).
    pub reloads: ReloadMetrics,
    /// `response_cache:` when enabled.
    pub cache: Option<Arc<ResponseCache>>,
    /// One span per request to an OTLP collector (`tracing.otlp_endpoint`).
    pub export: Option<Arc<Exporter>>,
    /// Flow control (`tenants:`, `priority:`).
    pub flow: Arc<Flow>,
}

impl Parts {
    /// The parts for a validated config: workers start healthy with nothing in flight,
    /// the policies' state empty. A part that cannot start (the fleet, the response
    /// cache, the exporter) is logged and left off. Each pool's policy's own upkeep
    /// (tree eviction, KV-event consumers) starts when the pool is made, now or when
    /// its model appears, and stops on `shutdown`.
    pub fn build(config: &Config, shutdown: &Shutdown) -> Parts {
        let pool = Arc::new(
            Pool::new(&config.workers, &config.circuit_breaker).draining_for(config.proxy.drain),
        );
        let shared = policy::Shared::new(config, &pool);
        let fleet = shared.fleet.clone();
        let pools = Pools::with_adapters(Arc::clone(&pool), &config.models, &config.adapters, {
            let (config, pool, shutdown) = (config.clone(), Arc::clone(&pool), shutdown.clone());
            move |model: &str, leg| -> Arc<dyn Policy> {
                let (policy, _) = policy::build_pool(&config, model, leg, &pool, &shared);
                if let Some(task) = policy.background(Arc::clone(&pool), shutdown.clone()) {
                    tokio::spawn(task);
                }
                policy
            }
        });
        let upstream = Upstream::new(&config.proxy);
        let cache = response_cache(config, &upstream);
        let export = config.tracing.otlp_endpoint.as_ref().and_then(|url| {
            Exporter::new(&config.tracing)
                .inspect(|_| tracing::info!(collector = %crate::redact::url(&url.to_string()), "tracing: exporting one span per request"))
                .inspect_err(|e| tracing::error!(error = %e, "tracing export off: it cannot start"))
                .ok()
                .map(Arc::new)
        });
        let mut metrics = Metrics::new();
        let default_policy = pools.table().everyone().pool.policy().name();
        let requests = RequestMetrics::register(&mut metrics, &pool, default_policy);
        let reloads = ReloadMetrics::register(&mut metrics);
        let flow = Arc::new(Flow::new(config, &pool, &mut metrics));
        if flow.is_on() {
            metrics.register(Box::new(crate::flow::view::QueueDepths(Arc::clone(&flow))));
        }
        // Every pool's policy's views' families, read from the table at each scrape
        // (pools made later included), and the table's own.
        metrics.register_text(Arc::new(policy::view::PoolViews(Arc::clone(&pools))));
        metrics.register(Box::new(crate::pools::metrics::TableMetrics(Arc::clone(
            &pools,
        ))));
        metrics.register(Box::new(crate::pools::pool::metrics::PoolMetrics::new(
            Arc::clone(&pool),
        )));
        if let Some(f) = &fleet {
            metrics.register(Box::new(crate::fleet::metrics::FleetMetrics(Arc::clone(f))));
        }
        if let Some(c) = &cache {
            metrics.register(Box::new(crate::cache::metrics::CacheCollector(Arc::clone(
                c,
            ))));
        }
        Parts {
            pools,
            fleet,
            upstream,
            metrics: Arc::new(metrics),
            requests,
            reloads,
            cache,
            export,
            flow,
        }
    }
}

/// The response cache `response_cache:` asks for, when enabled and able to start.
fn response_cache(config: &Config, upstream: &Upstream) -> Option<Arc<ResponseCache>> {
    let rc = &config.response_cache;
    if !rc.enabled {
        return None;
    }
    let bearer = rc
        .semantic
        .as_ref()
        .and_then(|s| embeddings_key(config, &s.embeddings_url));
    ResponseCache::new(rc, upstream, bearer)
        .inspect_err(|e| tracing::error!(error = %e, "response cache off: it cannot start"))
        .ok()
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

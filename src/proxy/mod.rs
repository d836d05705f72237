//! The request path, read in one direction: serve -> forward -> respond.
//!
//! ```text
//! serve       one request the route table sent here: read the body (bounded), check
//!             it, the response cache, the policy's preparation, then forward
//! forward     the attempt loop: pick (policy::decide), send (crate::upstream), tell
//!             the breaker and the policy; retry decides whether another worker tries
//! hedge       a late first token: the first attempt raced against a second worker
//! retry       which answer or failure another worker may take, backoff, push-back
//! respond     the worker's answer as the client's response, its body in a GuardedBody
//! body        GuardedBody: streams the answer, owns the in-flight guard, ends the request
//! access_log  the end of a request, in one place: outcome, access line, span
//! models, responses, tunnel   GET /v1/models; calls on a stored response; WebSockets
//! adapters    a LoRA adapter request on its chosen worker: the adapter loaded on
//!             demand (once per worker and adapter at a time), SGLang's form
//! headers, media, usage       header rules; remote media; engine usage in the answer
//! migrate     stream continuation: a stream whose worker breaks after its first byte
//!             continues on another worker (the relay of its events, the continuation's
//!             body, pick and send); a worker's drain ending moves its streams too
//! flow        flow control's reading of a request (its ticket) and the body rewrite
//! pd          a disaggregated pool's request: decode pick, bypass, prefill leg, the
//!             hand-off relayed to the decode leg (which goes through forward)
//! metrics     the request path's families in `/metrics` (RequestMetrics)
//! ```
//!
//! [`Router`] is the hyper service state shared by every connection. One request loads
//! the current [`WorkerSet`] once and keeps it for all its attempts. The upstream body
//! goes back to the client frame by frame inside a [`GuardedBody`], which owns the
//! in-flight guard. Retries (other workers only, with backoff) happen only before any
//! response byte reached the client: once headers are returned, a failure never
//! replays the request; a streamed answer may instead be continued elsewhere
//! ([`migrate`]), else it ends with an error.

mod access_log;
mod adapters;
pub mod body;
mod flow;
mod forward;
pub mod headers;
mod hedge;
mod json_members;
pub mod media;
pub mod metrics;
pub mod migrate;
pub mod models;
mod pd;
mod respond;
pub mod responses;
mod retry;
mod serve;
pub mod tunnel;
pub mod usage;

use std::sync::Arc;

pub use access_log::{AccessLog, Decision};
pub use body::GuardedBody;
pub use serve::Call;

use crate::cache::ResponseCache;
use crate::config::Config;
use crate::flow::Flow;
use crate::policy::{Routes, RoutesTable};
use crate::pools::pool::WorkerSet;
use crate::trace::export::Exporter;
use crate::upstream::Upstream;
use metrics::RequestMetrics;

pub use crate::error::{BoxError, ProxyBody};

/// Shared state of the request path. See the module docs.
pub struct Router {
    config: Config,
    /// The routing table: the pools, each with its policy, over one membership.
    pools: Arc<Routes>,
    client: Upstream,
    metrics: Arc<RequestMetrics>,
    /// `response_cache:` when enabled.
    cache: Option<Arc<ResponseCache>>,
    /// Flow control: tenants, classes (`tenants:`, `priority:`).
    flow: Arc<Flow>,
    /// LoRA adapter loads onto workers (`adapters.load_on_demand`).
    loads: adapters::Loads,
    /// Worker label of answers the router gave itself.
    no_worker: Arc<str>,
    /// Worker label of answers replayed from the response cache.
    cache_worker: Arc<str>,
    /// One span per request to an OTLP collector (`tracing.otlp_endpoint`); `None` =
    /// no export, and no span is built.
    export: Option<Arc<Exporter>>,
    /// `hedge:` when on: late first tokens asked of a second worker.
    hedging: Option<hedge::Hedging>,
}

impl Router {
    /// The request path over the parts `app` built from the same `config`.
    pub fn new(
        config: Config,
        pools: Arc<Routes>,
        client: Upstream,
        metrics: Arc<RequestMetrics>,
        cache: Option<Arc<ResponseCache>>,
        flow: Arc<Flow>,
        export: Option<Arc<Exporter>>,
    ) -> Self {
        Router {
            hedging: hedge::Hedging::new(&config.hedge, flow.is_on().then_some(&config.priority)),
            flow,
            export,
            client,
            pools,
            metrics,
            cache,
            loads: adapters::Loads::default(),
            no_worker: Arc::from(metrics::NO_WORKER),
            cache_worker: Arc::from(metrics::CACHE_WORKER),
            config,
        }
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The current worker set (one atomic load).
    pub fn worker_set(&self) -> Arc<WorkerSet> {
        self.pools.workers().set()
    }

    /// The routing table now (one atomic load): a request keeps it for all its
    /// attempts, and routes in the pool [`crate::pools::Table::route`] gives.
    fn table(&self) -> Arc<RoutesTable> {
        self.pools.table()
    }
}

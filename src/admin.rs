//! Router-owned endpoints: `GET /health` and `GET /workers`.

use http::StatusCode;
use serde::Serialize;

use crate::error::json_response;
use crate::proxy::{ProxyBody, Router};
use crate::workers::WorkerSet;

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
    in_flight: usize,
    healthy: bool,
    breaker: &'static str,
    max_load: Option<usize>,
    load_penalty: u32,
    cache_aware: bool,
    /// Fraction of the tree's bytes this worker holds (0–1).
    tree_share: f64,
}

#[derive(Serialize)]
struct Workers {
    policy: &'static str,
    tree_nodes: usize,
    /// Bytes of routing text stored in the tree.
    tree_bytes: u64,
    workers: Vec<WorkerView>,
}

/// `GET /metrics`: Prometheus text exposition (see `metrics.rs`).
pub fn metrics(router: &Router) -> http::Response<ProxyBody> {
    use http_body_util::BodyExt;
    let text = router.metrics().encode(&router.worker_set());
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

/// `GET /workers`: per-worker URL, in-flight count, health, breaker state and tree share.
/// API keys are never shown.
pub fn workers(router: &Router) -> http::Response<ProxyBody> {
    let set = router.worker_set();
    // Copy what is needed under the lock, format after releasing it.
    let (nodes, bytes, shares): (usize, u64, Vec<f64>) = {
        let tree = set.tree();
        (
            tree.node_count(),
            tree.total_bytes(),
            set.ids().map(|id| tree.share(id)).collect(),
        )
    };
    let now = crate::workers::now();
    let workers = set
        .workers()
        .iter()
        .zip(shares)
        .map(|(w, tree_share)| WorkerView {
            url: w.url().to_string(),
            in_flight: w.in_flight(),
            healthy: w.is_healthy(),
            breaker: w.breaker_state(now).as_str(),
            max_load: w.config().max_load.map(|m| m.get()),
            load_penalty: w.config().load_penalty,
            cache_aware: w.config().cache_aware,
            tree_share,
        })
        .collect();
    let body = Workers {
        policy: router.config().policy.as_str(),
        tree_nodes: nodes,
        tree_bytes: bytes,
        workers,
    };
    json_response(
        StatusCode::OK,
        serde_json::to_string(&body).unwrap_or_default(),
    )
}

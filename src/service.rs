//! The hyper service: one function that sends each request to the router's own
//! endpoints (`admin`) or to a worker (`proxy`). The only module that knows both.

use std::sync::Arc;

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;

use crate::admin;
use crate::error::json_response;
use crate::proxy::{ProxyBody, Router};

/// Which listener a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listener {
    /// The main port. Without `server.admin` it serves everything; with it, the
    /// router's own endpoints but `/health` answer 404 here.
    Main,
    /// `server.admin`: `/health`, `/workers`, `/metrics` and the admin API only.
    Admin,
}

/// Answers one client request that came in on `on`. Never fails: errors become JSON
/// responses.
pub async fn handle(
    router: Arc<Router>,
    req: Request<Incoming>,
    on: Listener,
) -> Response<ProxyBody> {
    let admin_here = on == Listener::Admin || router.config().server.admin.is_none();
    if req.method() == Method::GET {
        match req.uri().path() {
            "/health" => return admin::health(&router.worker_set()),
            "/workers" if admin_here => return admin::workers(&router),
            "/metrics" if admin_here => return admin::metrics(&router),
            _ => {}
        }
    }
    if admin_here && let Some(resp) = admin::mutation(&router, &req) {
        return match resp {
            admin::Mutation::Done(r) => r,
            admin::Mutation::NeedsBody => admin::mutate_with_body(&router, req).await,
            admin::Mutation::ClearCache(worker) => {
                admin::clear_cache_blocking(Arc::clone(&router), worker).await
            }
        };
    }
    if on == Listener::Admin {
        return not_here(
            req.uri().path(),
            "the admin listener serves /health, /workers, /metrics and the admin API only; requests go to the main port",
        );
    }
    if matches!(req.uri().path(), "/workers" | "/metrics" | "/cache/clear") {
        return not_here(
            req.uri().path(),
            "served on the admin listener (server.admin) only",
        );
    }
    router.serve(req).await
}

/// A JSON 404 saying where `path` is served.
fn not_here(path: &str, why: &str) -> Response<ProxyBody> {
    let body = serde_json::json!({
        "error": {
            "message": format!("{}: {why}", crate::redact::line(path)),
            "type": "not_found",
            "code": 404,
        }
    });
    json_response(StatusCode::NOT_FOUND, body.to_string())
}

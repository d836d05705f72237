//! The hyper service: one route table (`route`) that sends each request to the
//! router's own endpoints (`admin`) or to a worker (`proxy`). The only module that
//! knows both.

use std::sync::Arc;

use http::{HeaderMap, Method, Request, Response};
use hyper::body::Incoming;

use crate::admin;
use crate::config::{Passthrough, PassthroughVerdict};
use crate::error::{ProxyBody, ProxyError};
use crate::prompt::Endpoint;
use crate::proxy::{Call, Router, tunnel};

/// Which listener a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listener {
    /// The main port. Without `server.admin` it serves everything; with it, the
    /// router's own endpoints but `/health` answer 404 here.
    Main,
    /// `server.admin`: `/health`, `/workers`, `/metrics` and the admin API only.
    Admin,
}

/// Where a request goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    /// `GET /health`.
    Health,
    /// `GET /workers`.
    Workers,
    /// `GET /metrics`.
    Metrics,
    /// The admin API: `POST /workers`, `DELETE /workers`, `POST /cache/clear` (their
    /// token is checked there).
    Admin,
    /// An endpoint of the other listener: 404 saying where it is served.
    NotHere(&'static str),
    /// To the workers, through the proxy.
    Proxy(Call),
}

/// Why an admin endpoint answers 404 on the main port, and anything but the admin
/// endpoints on the admin listener.
const ADMIN_LISTENER_ONLY: &str = "served on the admin listener (server.admin) only";
const NOT_ON_ADMIN: &str = "the admin listener serves /health, /workers, /metrics and the admin API only; requests go to the main port";

/// The route table, read top to bottom: the first row that matches decides.
/// `admin_here`: the router's own endpoints are served on this listener (the admin
/// listener, or the main port when there is none).
fn route(
    on: Listener,
    admin_here: bool,
    method: &Method,
    path: &str,
    headers: &HeaderMap,
    passthrough: &Passthrough,
) -> Route {
    match (method, path) {
        (&Method::GET, "/health") => Route::Health,
        (&Method::GET, "/workers") if admin_here => Route::Workers,
        (&Method::GET, "/metrics") if admin_here => Route::Metrics,
        (&Method::POST, "/workers")
        | (&Method::DELETE, "/workers")
        | (&Method::POST, "/workers/drain")
        | (&Method::DELETE, "/workers/drain")
        | (&Method::POST, "/cache/clear")
            if admin_here =>
        {
            Route::Admin
        }
        _ if on == Listener::Admin => Route::NotHere(NOT_ON_ADMIN),
        (_, "/workers" | "/workers/drain" | "/metrics" | "/cache/clear") => {
            Route::NotHere(ADMIN_LISTENER_ONLY)
        }
        (&Method::GET, "/v1/models") => Route::Proxy(Call::Models),
        _ => Route::Proxy(match Endpoint::from_path(path) {
            Some(e) if method == Method::POST => Call::Forward(Some(e)),
            // Any other path: `proxy.passthrough` decides whether it reaches a worker.
            _ => match passthrough.verdict(path) {
                v @ (PassthroughVerdict::NotListed | PassthroughVerdict::Operator) => {
                    Call::Closed(v)
                }
                PassthroughVerdict::Open if tunnel::is_websocket_upgrade(method, headers) => {
                    Call::Tunnel
                }
                PassthroughVerdict::Open => Call::Forward(None),
            },
        }),
    }
}

/// What a connection serves: the proxy and the router's own endpoints.
pub struct Service {
    pub router: Arc<Router>,
    pub admin: Arc<admin::Admin>,
}

/// Answers one client request that came in on `on`. Never fails: errors become JSON
/// responses.
pub async fn handle(
    service: &Service,
    req: Request<Incoming>,
    on: Listener,
) -> Response<ProxyBody> {
    let (router, admin) = (&service.router, &service.admin);
    let admin_here = on == Listener::Admin || router.config().server.admin.is_none();
    let to = route(
        on,
        admin_here,
        req.method(),
        req.uri().path(),
        req.headers(),
        &router.config().proxy.passthrough,
    );
    match to {
        Route::Health => admin::health(&admin.worker_set()),
        Route::Workers => admin::workers(admin),
        Route::Metrics => admin::metrics(admin),
        Route::Admin => match admin::mutation(admin, &req) {
            Some(admin::Mutation::Done(r)) => r,
            Some(admin::Mutation::NeedsBody) => admin::mutate_with_body(admin, req).await,
            Some(admin::Mutation::ClearCache(worker)) => {
                admin::clear_cache_blocking(Arc::clone(admin), worker).await
            }
            // The table and `admin::mutation` name the same endpoints.
            None => not_here(req.uri().path(), ADMIN_LISTENER_ONLY),
        },
        Route::NotHere(why) => not_here(req.uri().path(), why),
        Route::Proxy(call) => router.serve(req, call).await,
    }
}

/// A JSON 404 saying where `path` is served.
fn not_here(path: &str, why: &'static str) -> Response<ProxyBody> {
    ProxyError::NotHere {
        path: crate::redact::line(path),
        why,
    }
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(on: Listener, admin_here: bool, method: Method, path: &str) -> Route {
        let ws = HeaderMap::from_iter([
            (http::header::CONNECTION, "upgrade".parse().unwrap()),
            (http::header::UPGRADE, "websocket".parse().unwrap()),
        ]);
        let headers = if path == "/ws" { ws } else { HeaderMap::new() };
        route(on, admin_here, &method, path, &headers, &Passthrough::Allow)
    }

    #[test]
    fn the_table_sends_each_path_to_its_part() {
        use Listener::{Admin, Main};
        let chat = Call::Forward(Some(Endpoint::ChatCompletions));
        for (on, admin_here, method, path, want) in [
            (Main, true, Method::GET, "/health", Route::Health),
            (Admin, true, Method::GET, "/health", Route::Health),
            (Main, false, Method::GET, "/health", Route::Health),
            (Main, true, Method::GET, "/workers", Route::Workers),
            (Main, true, Method::GET, "/metrics", Route::Metrics),
            (Main, true, Method::DELETE, "/workers", Route::Admin),
            (Main, true, Method::POST, "/workers/drain", Route::Admin),
            (Main, true, Method::DELETE, "/workers/drain", Route::Admin),
            (Main, true, Method::POST, "/cache/clear", Route::Admin),
            (
                Main,
                false,
                Method::POST,
                "/workers/drain",
                Route::NotHere(ADMIN_LISTENER_ONLY),
            ),
            // With an admin listener, its endpoints are not on the main port.
            (
                Main,
                false,
                Method::GET,
                "/workers",
                Route::NotHere(ADMIN_LISTENER_ONLY),
            ),
            (
                Main,
                false,
                Method::POST,
                "/cache/clear",
                Route::NotHere(ADMIN_LISTENER_ONLY),
            ),
            (
                Main,
                true,
                Method::PUT,
                "/workers",
                Route::NotHere(ADMIN_LISTENER_ONLY),
            ),
            (
                Admin,
                true,
                Method::POST,
                "/v1/chat/completions",
                Route::NotHere(NOT_ON_ADMIN),
            ),
            (
                Main,
                true,
                Method::POST,
                "/v1/chat/completions",
                Route::Proxy(chat),
            ),
            (
                Main,
                true,
                Method::GET,
                "/v1/models",
                Route::Proxy(Call::Models),
            ),
            (
                Main,
                true,
                Method::GET,
                "/v1/chat/completions",
                Route::Proxy(Call::Forward(None)),
            ),
            (
                Main,
                true,
                Method::POST,
                "/tokenize",
                Route::Proxy(Call::Forward(None)),
            ),
            (Main, true, Method::GET, "/ws", Route::Proxy(Call::Tunnel)),
        ] {
            assert_eq!(
                table(on, admin_here, method.clone(), path),
                want,
                "{method} {path} on {on:?}"
            );
        }
    }
}

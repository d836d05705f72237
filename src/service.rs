//! The hyper service: one function that sends each request to the router's own
//! endpoints (`admin`) or to a worker (`proxy`). The only module that knows both.

use std::sync::Arc;

use http::{Method, Request, Response};
use hyper::body::Incoming;

use crate::admin;
use crate::proxy::{ProxyBody, Router};

/// Answers one client request. Never fails: errors become JSON responses.
pub async fn handle(router: Arc<Router>, req: Request<Incoming>) -> Response<ProxyBody> {
    if req.method() == Method::GET {
        match req.uri().path() {
            "/health" => return admin::health(&router.worker_set()),
            "/workers" => return admin::workers(&router),
            "/metrics" => return admin::metrics(&router),
            _ => {}
        }
    }
    if let Some(resp) = admin::mutation(&router, &req) {
        return match resp {
            admin::Mutation::Done(r) => r,
            admin::Mutation::NeedsBody => admin::mutate_with_body(&router, req).await,
        };
    }
    router.serve(req).await
}

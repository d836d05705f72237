//! `GET /v1/models`: proxied to a usable worker, the answer cached per worker set.

use std::time::Instant;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;

use super::access_log::RequestEnd;
use super::forward::Route;
use super::{ProxyBody, Router};
use crate::error::ProxyError;
use crate::pools::pool::CachedAnswer as Cached;

/// Largest `/v1/models` answer that is cached, in bytes.
const MAX_CACHED_BYTES: usize = 4 << 20;

/// Why a worker's `/v1/models` answer could not be cached and passed on.
#[derive(Debug, thiserror::Error)]
enum ListError {
    #[error("reading /v1/models")]
    Read(#[source] crate::error::BoxError),
    #[error("/v1/models answer is over {MAX_CACHED_BYTES} bytes")]
    TooLarge,
}

/// Serves `/v1/models` from the cache, or forwards it like any request (least-loaded
/// usable worker, retries) and caches a 200 answer for `proxy.models_cache_secs`.
pub(super) async fn get(
    router: &Router,
    req: Request<Incoming>,
    end: &mut RequestEnd<'_>,
) -> Result<Response<ProxyBody>, ProxyError> {
    let set = router.worker_set();
    let ttl = router.config.proxy.models_cache;
    if let Some(c) = set.models.fresh(ttl) {
        if !set.workers().iter().any(|w| w.is_healthy()) {
            return Err(ProxyError::NoWorker("no worker is healthy"));
        }
        return Ok(build(StatusCode::OK, c.content_type, c.body));
    }
    let (parts, _) = req.into_parts();
    let route = Route::without_prompt(end.id, router.pool_for(None));
    let resp = router
        .forward(&set, parts, Bytes::new(), &route, &mut end.waiting_on)
        .await?;
    if resp.status() != StatusCode::OK || ttl.is_zero() {
        return Ok(resp);
    }
    let (parts, mut body) = resp.into_parts();
    // Collected by hand: `Limited` over a boxed-error body trips rustc's higher-ranked
    // Send check (rust-lang/rust#102211).
    let mut buf = bytes::BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| ProxyError::Upstream(Box::new(ListError::Read(e))))?;
        if let Some(data) = frame.data_ref() {
            if buf.len() + data.len() > MAX_CACHED_BYTES {
                return Err(ProxyError::Upstream(Box::new(ListError::TooLarge)));
            }
            buf.extend_from_slice(data);
        }
    }
    let body = buf.freeze();
    let content_type = parts.headers.get(header::CONTENT_TYPE).cloned();
    set.models.store(Cached {
        at: Instant::now(),
        content_type: content_type.clone(),
        body: body.clone(),
    });
    Ok(build(parts.status, content_type, body))
}

fn build(
    status: StatusCode,
    content_type: Option<HeaderValue>,
    body: Bytes,
) -> Response<ProxyBody> {
    let mut resp = Response::new(Full::new(body).map_err(|never| match never {}).boxed());
    *resp.status_mut() = status;
    if let Some(ct) = content_type {
        resp.headers_mut().insert(header::CONTENT_TYPE, ct);
    }
    resp
}

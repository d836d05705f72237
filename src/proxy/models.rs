//! `GET /v1/models`: the fleet's list, the union of what the usable workers list (one
//! entry per id, the first worker's, adapters with their `parent`) and the aliases
//! whose targets are in it, built from the lists as last read (`pools::refresh`), so a
//! model that leaves a worker's list leaves this one with the next read. 503 when no
//! worker is usable. Where no usable worker's list could be read (backends without
//! `/v1/models`, a fleet just started), the request is forwarded to one, as a router
//! without lists would.

use std::collections::HashSet;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;

use super::access_log::RequestEnd;
use super::forward::Route;
use super::{ProxyBody, Router};
use crate::error::ProxyError;
use crate::pools::pool::breaker::State;

/// Answers `GET /v1/models`; see the module docs.
pub(super) async fn get(
    router: &Router,
    req: Request<Incoming>,
    end: &mut RequestEnd<'_>,
) -> Result<Response<ProxyBody>, ProxyError> {
    let table = router.table();
    let now = crate::pools::pool::now();
    let usable: Vec<_> = table
        .set()
        .workers()
        .iter()
        .filter(|w| w.is_healthy() && w.breaker_state(now) != State::Open)
        .collect();
    if usable.is_empty() {
        return Err(ProxyError::NoWorker("no worker is healthy"));
    }
    let mut seen: HashSet<&str> = HashSet::new();
    let mut cards: Vec<String> = Vec::new();
    let lists: Vec<_> = usable.iter().map(|w| w.served()).collect();
    for served in lists.iter().filter(|s| !s.serves_any()) {
        for m in served.models.iter() {
            if seen.insert(&m.id) {
                cards.push(m.card.get().to_string());
            }
        }
    }
    if cards.is_empty() {
        // No usable worker's list is known: one of them answers.
        let (parts, _) = req.into_parts();
        let route =
            Route::without_prompt(end.id, table.everyone().pool, router.flow.default_ticket());
        return router
            .forward(
                table.set(),
                parts,
                Bytes::new(),
                &route,
                &mut end.waiting_on,
            )
            .await;
    }
    for (public, targets) in &router.config.models.aliases {
        if !seen.contains(public.as_str())
            && targets.iter().any(|t| seen.contains(t.model.as_str()))
        {
            let card = serde_json::json!({
                "id": public,
                "object": "model",
                "owned_by": "cache-aware-router",
                "root": targets[0].model,
            });
            cards.push(card.to_string());
        }
    }
    let mut body = String::with_capacity(cards.iter().map(|c| c.len() + 1).sum::<usize>() + 32);
    body.push_str(r#"{"object":"list","data":["#);
    for (i, c) in cards.iter().enumerate() {
        if i > 0 {
            body.push(',');
        }
        body.push_str(c);
    }
    body.push_str("]}");
    let mut resp = Response::new(
        Full::new(Bytes::from(body))
            .map_err(|never| match never {})
            .boxed(),
    );
    *resp.status_mut() = StatusCode::OK;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Ok(resp)
}

//! WebSocket tunnels: a client's WebSocket handshake (`GET` with `Connection: upgrade`,
//! `Upgrade: websocket`; vLLM's `/v1/realtime`, Responses over WebSocket) is sent, with
//! its upgrade, to one usable worker picked as any request without a prompt is (the
//! policy's least-loaded choice; a bound session's worker). When the engine answers
//! `101 Switching Protocols`, the client gets that answer (its `Sec-WebSocket-Accept`
//! and extensions untouched) and the two connections are joined byte for byte until
//! either side closes: the frames are the engine's and the client's, never read here.
//! The session counts as one request in flight on its worker for as long as it lasts.
//! Any other answer (the engine's 404, 403, 426) goes back as it is, and the client's
//! connection stays plain HTTP/1.1.
//!
//! Only WebSocket is tunnelled, and only on `GET`: an `Upgrade` to another protocol
//! (`h2c`, as Java's HttpClient offers on every request) is ignored, as RFC 9110 §7.8
//! allows, and the request is served over HTTP/1.1 with the upgrade headers stripped.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty, Full, Limited};
use hyper::body::Incoming;
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;

use super::access_log::{AccessLog, Decision, RequestEnd};
use super::forward::Route;
use super::{Router, headers};
use crate::error::{Chain, ProxyBody, ProxyError};
use crate::pools::pool::breaker::Outcome as BreakerOutcome;
use crate::tree::WorkerMask;
use crate::upstream::RequestTemplate;

/// Longest refusal body (a worker's non-101 answer to a handshake) passed back.
const MAX_REFUSAL_BYTES: usize = 1 << 20;

/// Whether a request is a WebSocket handshake: `GET` with `upgrade` among its
/// `Connection` options and `websocket` among its `Upgrade` protocols (ASCII case
/// ignored, every header line read).
pub fn is_websocket_upgrade(method: &Method, headers: &HeaderMap) -> bool {
    let has = |name: header::HeaderName, token: &str| {
        headers
            .get_all(name)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|t| {
                let t = t.trim();
                // `websocket` may carry a version (`websocket/13`) in theory.
                t.split('/')
                    .next()
                    .is_some_and(|p| p.trim().eq_ignore_ascii_case(token))
            })
    };
    method == Method::GET && has(header::CONNECTION, "upgrade") && has(header::UPGRADE, "websocket")
}

impl Router {
    /// Tunnels the WebSocket handshake `req` to a worker (see the module docs).
    pub(super) async fn tunnel(
        &self,
        mut req: Request<Incoming>,
        end: &mut RequestEnd<'_>,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let upgrade = req
            .headers()
            .get(header::UPGRADE)
            .cloned()
            .unwrap_or(HeaderValue::from_static("websocket"));
        let client_side = hyper::upgrade::on(&mut req);
        let (parts, _) = req.into_parts();
        let table = self.table();
        let route =
            Route::without_prompt(end.id, table.everyone().pool, self.flow.default_ticket());
        let base = RequestTemplate::new(parts, route.id.request_id, &route.id.trace);
        let set = self.worker_set();
        let deadline = route.id.arrived + self.config.proxy.request_timeout;
        let mut tried = WorkerMask::default();
        let mut last_error =
            ProxyError::NoWorker("every worker is unhealthy, at max_load, or down");
        for attempt in 0..=self.config.proxy.max_retries {
            let Some((pick, mut guard)) = self.pick(&set, &route, &tried) else {
                if attempt == 0 {
                    self.metrics
                        .decision(crate::policy::Reason::NoWorker, route.started.elapsed());
                }
                return Err(last_error);
            };
            let worker = Arc::clone(guard.worker());
            tried.insert(worker.id());
            end.waiting_on = Some(Arc::clone(worker.label()));
            self.metrics.decision(pick.reason, route.started.elapsed());
            let left = deadline.saturating_duration_since(Instant::now());
            let resp = match self
                .client
                .send_upgrade(&worker, &base, upgrade.clone(), left)
                .await
            {
                Ok(resp) => resp,
                Err(e) => {
                    guard.record(BreakerOutcome::Failure);
                    tracing::warn!(request_id = ?route.id.request_id, worker = %worker.url(), error = %Chain(&e), "websocket handshake to the worker failed");
                    // Only a worker that could not be reached leaves the handshake
                    // unsent: another may take it.
                    let again = matches!(e, ProxyError::Unreachable(_));
                    last_error = e;
                    if again {
                        continue;
                    }
                    return Err(last_error);
                }
            };
            let status = resp.status();
            guard.record(if status.is_server_error() {
                BreakerOutcome::Failure
            } else if status.is_client_error() {
                BreakerOutcome::Neutral
            } else {
                BreakerOutcome::Success
            });
            let decision = Decision::unmatched(pick.reason, route.started, attempt);
            let log = AccessLog::new(&route.id, &worker, decision, status.as_u16());
            self.metrics.request(log.endpoint, &log.worker, log.status);
            self.metrics.first_byte(&log.worker, log.arrived.elapsed());
            if status != StatusCode::SWITCHING_PROTOCOLS {
                return refusal(resp, log, &self.metrics, self.export.as_deref()).await;
            }
            let mut resp = resp;
            let worker_side = hyper::upgrade::on(&mut resp);
            let (mut head, _) = resp.into_parts();
            let protocol = head.headers.get(header::UPGRADE).cloned();
            headers::strip_hop_by_hop(&mut head.headers);
            head.headers.remove(header::CONTENT_LENGTH);
            head.headers
                .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
            head.headers
                .insert(header::UPGRADE, protocol.unwrap_or(upgrade));
            if self.config.proxy.add_routed_peer_header
                && let Ok(v) = HeaderValue::from_str(&worker.url().to_string())
            {
                head.headers.insert(headers::ROUTED_PEER.clone(), v);
            }
            // The session's slot on its worker is held until the tunnel closes.
            let (metrics, export) = (Arc::clone(&self.metrics), self.export.clone());
            tokio::spawn(async move {
                let outcome = join(client_side, worker_side).await;
                log.end(&metrics, export.as_deref(), outcome);
                drop(guard);
            });
            let body = Empty::<Bytes>::new()
                .map_err(|never| match never {})
                .boxed();
            return Ok(Response::from_parts(head, body));
        }
        Err(last_error)
    }
}

/// Joins the client's and the worker's upgraded connections byte for byte until either
/// side closes; returns the session's outcome.
async fn join(client_side: OnUpgrade, worker_side: OnUpgrade) -> &'static str {
    match tokio::join!(client_side, worker_side) {
        (Ok(client), Ok(worker)) => {
            let mut client = TokioIo::new(client);
            let mut worker = TokioIo::new(worker);
            match tokio::io::copy_bidirectional(&mut client, &mut worker).await {
                Ok(_) => "complete",
                Err(e) => {
                    tracing::debug!(error = %e, "websocket tunnel ended with an error");
                    "upstream_error"
                }
            }
        }
        (Err(e), _) => {
            tracing::debug!(error = %e, "the client left before its websocket upgrade");
            "client_gone"
        }
        (_, Err(e)) => {
            tracing::warn!(error = %e, "the worker's websocket upgrade failed");
            "upstream_error"
        }
    }
}

/// A worker's answer other than 101 to a handshake, passed back as a plain response
/// (its body read first, bounded: such answers are short errors).
async fn refusal(
    resp: Response<Incoming>,
    log: AccessLog,
    metrics: &super::metrics::RequestMetrics,
    export: Option<&crate::trace::export::Exporter>,
) -> Result<Response<ProxyBody>, ProxyError> {
    let (mut head, body) = resp.into_parts();
    let body = Limited::new(body, MAX_REFUSAL_BYTES)
        .collect()
        .await
        .map_err(ProxyError::Upstream)?
        .to_bytes();
    headers::strip_hop_by_hop(&mut head.headers);
    head.headers.remove(header::CONTENT_LENGTH);
    log.end(metrics, export, "complete");
    let body = Full::new(body).map_err(|never| match never {}).boxed();
    Ok(Response::from_parts(head, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                header::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    #[test]
    fn only_a_get_with_a_websocket_upgrade_is_tunnelled() {
        let ws = [
            ("connection", "keep-alive, Upgrade"),
            ("upgrade", "WebSocket"),
        ];
        assert!(is_websocket_upgrade(&Method::GET, &headers(&ws)));
        let split = [
            ("connection", "keep-alive"),
            ("connection", "upgrade"),
            ("upgrade", "foo, websocket"),
        ];
        assert!(is_websocket_upgrade(&Method::GET, &headers(&split)));
        // A POST (Java's h2c offer), another protocol, no `Connection: upgrade`.
        assert!(!is_websocket_upgrade(&Method::POST, &headers(&ws)));
        let h2c = [
            ("connection", "Upgrade, HTTP2-Settings"),
            ("upgrade", "h2c"),
        ];
        assert!(!is_websocket_upgrade(&Method::GET, &headers(&h2c)));
        assert!(!is_websocket_upgrade(
            &Method::GET,
            &headers(&[("upgrade", "websocket")])
        ));
        assert!(!is_websocket_upgrade(
            &Method::GET,
            &headers(&[("connection", "upgrade"), ("upgrade", "websockets")])
        ));
    }
}

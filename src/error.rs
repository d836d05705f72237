//! Errors the router answers itself, and their single mapping to an HTTP response.
//!
//! Every error response has a JSON body in the OpenAI error shape, so SDKs show the
//! message: `{"error":{"message":…,"type":…,"code":<status>}}` (and `"param":"model"`
//! when the request's model is at fault); [`ProxyError::into_response`] is the only
//! place that body is built. An error keeps its cause as its `source()`
//! (a hyper or connector error, not its text); the message shown, logged or exported is
//! the error with its causes, `outer: cause: root cause` ([`Chain`]).

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};

/// Error type of response bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// An error and its causes on one line, `outer: cause: root cause` (hyper's and the
/// connector's top-level messages alone say little).
pub fn describe(e: &(dyn std::error::Error + 'static)) -> String {
    Chain(e).to_string()
}

/// Displays an error and its causes on one line, `outer: cause: root cause`, without
/// building a string first ([`describe`] builds one).
#[derive(Debug, Clone, Copy)]
pub struct Chain<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut src = self.0.source();
        while let Some(cause) = src {
            write!(f, ": {cause}")?;
            src = cause.source();
        }
        Ok(())
    }
}

/// The body of every response the router sends.
pub type ProxyBody = http_body_util::combinators::BoxBody<Bytes, BoxError>;

/// Something the router answers instead of a worker.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The request body is over `server.max_body_bytes` (413).
    #[error("request body is larger than the limit of {limit} bytes (server.max_body_bytes)")]
    BodyTooLarge { limit: usize },
    /// The request body did not arrive within `server.body_timeout_secs` (408; the
    /// connection is closed).
    #[error(
        "the request body did not arrive within {secs} s (server.body_timeout_secs); send the whole body promptly"
    )]
    BodyTimeout { secs: f64 },
    /// A path that is not a routed endpoint, closed by `proxy.passthrough` (404).
    #[error(
        "`{path}` is not forwarded to the workers: proxy.passthrough is {rule}; list a prefix of this path there (or set it to `allow`) to open it"
    )]
    NotPassedThrough { path: String, rule: String },
    /// An engine operator endpoint (`/v1/load_lora_adapter`, `/sleep`, …) that no entry
    /// of `proxy.passthrough` names, whatever prefix it lies under (404).
    #[error(
        "`{path}` is an engine operator endpoint (adapters, weights, caches, sleep, profiling): it is not forwarded to the workers, even under an open proxy.passthrough prefix; list this path in proxy.passthrough to open it"
    )]
    OperatorEndpoint { path: String },
    /// The request body could not be read (client went away, bad framing) (400).
    #[error("could not read the request body")]
    BadBody(#[source] BoxError),
    /// No worker is usable: all unhealthy, open, full, or already tried (503).
    #[error("no usable worker: {0}")]
    NoWorker(&'static str),
    /// The body references media by URL or path (see `proxy::media`) and
    /// `proxy.remote_media_url_policy` refuses it.
    #[error(
        "requests that make the engine fetch media by URL or path are not accepted here (proxy.remote_media_url_policy): send images, audio and video inline as data: URLs"
    )]
    RemoteMedia(StatusCode),
    /// Every usable worker stayed at `max_load` for the whole `proxy.queue.timeout_ms`
    /// (503).
    #[error(
        "every usable worker stayed at max_load for {ms} ms (proxy.queue.timeout_ms); retry later"
    )]
    QueueTimeout { ms: u64 },
    /// Every usable worker is at `max_load` and `proxy.queue.max_waiting` requests
    /// already wait (503).
    #[error(
        "every usable worker is at max_load and the queue is full ({max} waiting, proxy.queue.max_waiting); retry later"
    )]
    QueueFull { max: usize },
    /// Flow control turned the request away (429 + `Retry-After`): the queue had no room
    /// for its class, its wait ran out, or a more urgent request took its place. `kind`
    /// is the body's `type`; `limit` names the setting and its value.
    #[error("{why} (class `{class}`; {limit}); retry later")]
    Shed {
        class: std::sync::Arc<str>,
        why: String,
        limit: String,
        kind: &'static str,
        /// Seconds, for `Retry-After`.
        retry_after: u64,
    },
    /// A more urgent request pre-empted this one before its worker answered, with
    /// `priority.on_preempt: error` (503 + `x-preempted: true`).
    #[error(
        "a more urgent request pre-empted this one before its worker answered (priority.preempt, priority.on_preempt: error); retry later"
    )]
    Preempted,
    /// The chosen worker could not be connected to (503; another worker is tried while
    /// one is left, so the client sees this only when none could be).
    #[error("could not connect to the worker")]
    Unreachable(#[source] BoxError),
    /// A worker failed after the connection was made (502).
    #[error("upstream worker failed")]
    Upstream(#[source] BoxError),
    /// The worker's URL and the request's path make no valid URI (400).
    #[error("cannot build the upstream URI")]
    UpstreamUri(#[source] http::Error),
    /// No response headers within the attempt's time, in seconds: what was left of
    /// `proxy.request_timeout_secs` (counted from the request's arrival), or
    /// `proxy.attempt_timeout_secs` (504). Retried only when the latter is set.
    #[error(
        "the worker sent no response headers within {0:.1} s (proxy.request_timeout_secs bounds the whole wait, proxy.attempt_timeout_secs one attempt)"
    )]
    Timeout(f64),
    /// An endpoint served on the other listener (404): `why` says where.
    #[error("{path}: {why}")]
    NotHere { path: String, why: &'static str },
    /// A mutating admin endpoint without a configured token (403) or with a wrong one (401).
    #[error("{0}")]
    Forbidden(&'static str),
    #[error("{0}")]
    Unauthorized(&'static str),
    /// A malformed admin request (400).
    #[error("{0}")]
    BadRequest(String),
    /// The admin API names a worker that is not in the pool (404); `which` as shown.
    #[error("no worker {which} in the pool")]
    UnknownWorker { which: String },
    /// The admin API cannot add a worker as asked (409): the pool says why.
    #[error("{0}")]
    Conflict(String),
    /// The request's `model` is one no worker serves (404, `model_not_found`): the
    /// router answers it itself, never another model's worker. `model` as shown (cut).
    #[error(
        "the model `{model}` does not exist here: no worker serves it (GET /v1/models lists the models served)"
    )]
    ModelNotFound { model: String },
    /// The request names no `model`, there is no `models.default`, and the workers serve
    /// several (400); `choices` as shown.
    #[error(
        "the request names no model and several are served: set `model` to one of {choices} (or set models.default)"
    )]
    ModelRequired { choices: String },
    /// `adapters.load_on_demand`: the worker chosen for a LoRA adapter request did not
    /// load it (502, once no other worker is left to try); each as shown.
    #[error(
        "could not load the LoRA adapter `{adapter}` onto {worker} (adapters.load_on_demand, from adapters.sources): {why}"
    )]
    AdapterLoad {
        adapter: String,
        worker: String,
        why: String,
    },
    /// A disaggregated request's prefill leg failed: on every prefill worker tried
    /// (connection errors, time-outs, 5xx) with `pd.on_prefill_failure: error`, or
    /// SGLang's parallel prefill leg (its decode leg is then cancelled). `status`: 502,
    /// or the prefill worker's own 4xx; `last`: the (last) failure.
    #[error("the prefill leg failed ({last})")]
    PrefillFailed { status: StatusCode, last: String },
    /// The router's own work failed (500): `what` failed, and why.
    #[error("{what}")]
    Internal {
        what: &'static str,
        #[source]
        cause: BoxError,
    },
}

impl ProxyError {
    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            ProxyError::NotPassedThrough { .. }
            | ProxyError::OperatorEndpoint { .. }
            | ProxyError::NotHere { .. }
            | ProxyError::ModelNotFound { .. }
            | ProxyError::UnknownWorker { .. } => StatusCode::NOT_FOUND,
            ProxyError::BadBody(_)
            | ProxyError::BadRequest(_)
            | ProxyError::UpstreamUri(_)
            | ProxyError::ModelRequired { .. } => StatusCode::BAD_REQUEST,
            ProxyError::NoWorker(_)
            | ProxyError::Unreachable(_)
            | ProxyError::QueueTimeout { .. }
            | ProxyError::QueueFull { .. }
            | ProxyError::Preempted => StatusCode::SERVICE_UNAVAILABLE,
            ProxyError::Shed { .. } => StatusCode::TOO_MANY_REQUESTS,
            ProxyError::RemoteMedia(s) => *s,
            ProxyError::Upstream(_) | ProxyError::AdapterLoad { .. } => StatusCode::BAD_GATEWAY,
            ProxyError::PrefillFailed { status, .. } => *status,
            ProxyError::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::Forbidden(_) => StatusCode::FORBIDDEN,
            ProxyError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ProxyError::Conflict(_) => StatusCode::CONFLICT,
            ProxyError::Internal { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            ProxyError::BodyTooLarge { .. } => "request_too_large",
            ProxyError::BodyTimeout { .. } => "request_timeout",
            ProxyError::NotPassedThrough { .. }
            | ProxyError::NotHere { .. }
            | ProxyError::UnknownWorker { .. } => "not_found",
            ProxyError::OperatorEndpoint { .. } => "operator_endpoint_closed",
            ProxyError::ModelNotFound { .. } => "model_not_found",
            ProxyError::BadBody(_)
            | ProxyError::BadRequest(_)
            | ProxyError::UpstreamUri(_)
            | ProxyError::ModelRequired { .. } => "invalid_request_error",
            ProxyError::NoWorker(_) | ProxyError::Unreachable(_) => "no_worker_available",
            ProxyError::QueueTimeout { .. } => "queue_timeout",
            ProxyError::QueueFull { .. } => "queue_full",
            ProxyError::Shed { kind, .. } => kind,
            ProxyError::Preempted => "preempted",
            ProxyError::RemoteMedia(_) => "remote_media_rejected",
            ProxyError::Upstream(_) => "upstream_error",
            ProxyError::AdapterLoad { .. } => "adapter_load_failed",
            ProxyError::PrefillFailed { .. } => "prefill_failed",
            ProxyError::Timeout(_) => "upstream_timeout",
            ProxyError::Forbidden(_) => "admin_disabled",
            ProxyError::Unauthorized(_) => "unauthorized",
            ProxyError::Conflict(_) => "conflict",
            ProxyError::Internal { .. } => "internal_error",
        }
    }

    /// The JSON error response, the one shape of every error the router answers: the
    /// message is the error and its causes ([`Chain`]), credentials redacted. A 503
    /// carries `Retry-After: 1`, a shed request's 429 its own `Retry-After`, a
    /// pre-empted request's 503 `x-preempted: true`; a 408 closes the connection (the
    /// rest of the body is never read).
    pub fn into_response(self) -> Response<ProxyBody> {
        let status = self.status();
        let mut body = serde_json::json!({
            "error": {
                "message": crate::redact::text(&Chain(&self).to_string()),
                "type": self.kind(),
                "code": status.as_u16(),
            }
        });
        // The request field at fault, as OpenAI names it.
        if matches!(
            self,
            ProxyError::ModelNotFound { .. }
                | ProxyError::ModelRequired { .. }
                | ProxyError::AdapterLoad { .. }
        ) {
            body["error"]["param"] = "model".into();
        }
        let mut resp = json_response(status, body.to_string());
        if status == StatusCode::SERVICE_UNAVAILABLE {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if let ProxyError::Shed { retry_after, .. } = &self {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(*retry_after));
        }
        if matches!(self, ProxyError::Preempted) {
            resp.headers_mut().insert(
                http::HeaderName::from_static("x-preempted"),
                HeaderValue::from_static("true"),
            );
        }
        if status == StatusCode::REQUEST_TIMEOUT {
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        resp
    }
}

/// A response with a JSON body the router wrote itself.
pub fn json_response(status: StatusCode, body: String) -> Response<ProxyBody> {
    let mut resp = Response::new(
        Full::new(Bytes::from(body))
            .map_err(|never| match never {})
            .boxed(),
    );
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn body(resp: Response<ProxyBody>) -> serde_json::Value {
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        serde_json::from_slice(&bytes).unwrap()
    }

    #[tokio::test]
    async fn an_error_keeps_its_cause_and_the_json_body_shows_the_chain() {
        let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let e = ProxyError::Unreachable(Box::new(refused));
        let cause = std::error::Error::source(&e).expect("the cause is kept");
        assert!(cause.downcast_ref::<std::io::Error>().is_some());
        let resp = e.into_response();
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(resp.headers()[header::RETRY_AFTER], "1");
        let v = body(resp).await;
        assert_eq!(
            v["error"]["message"],
            "could not connect to the worker: refused"
        );
        assert_eq!(v["error"]["type"], "no_worker_available");
        assert_eq!(v["error"]["code"], 503);
    }

    #[tokio::test]
    async fn admin_and_listener_errors_share_the_one_body_shape() {
        for (e, status, kind, message) in [
            (
                ProxyError::UnknownWorker {
                    which: "named `w9`".into(),
                },
                404,
                "not_found",
                "no worker named `w9` in the pool",
            ),
            (
                ProxyError::Conflict("worker already in the pool".into()),
                409,
                "conflict",
                "worker already in the pool",
            ),
            (
                ProxyError::NotHere {
                    path: "/metrics".into(),
                    why: "served on the admin listener (server.admin) only",
                },
                404,
                "not_found",
                "/metrics: served on the admin listener (server.admin) only",
            ),
        ] {
            let resp = e.into_response();
            assert_eq!(resp.status().as_u16(), status);
            assert_eq!(resp.headers()[header::CONTENT_TYPE], "application/json");
            let v = body(resp).await;
            assert_eq!(v["error"]["message"], message);
            assert_eq!(v["error"]["type"], kind);
            assert_eq!(v["error"]["code"], status);
        }
    }
}

//! The pooled upstream client and the per-attempt request.

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Request, Response, Version};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use super::headers;
use crate::config::{ProxyConfig, Secret};
use crate::error::ProxyError;
use crate::pool::Worker;

/// The connector of every upstream call: plain TCP for `http://`, rustls over it for
/// `https://` (`proxy.tls`).
type Connector = HttpsConnector<HttpConnector>;

/// hyper-util's pooled HTTP/1.1 client, configured from `proxy:`. Cheap to clone.
#[derive(Clone)]
pub struct Upstream {
    client: Client<Connector, Full<Bytes>>,
    /// Same settings, no pooling: the resend after a stale pooled connection must not
    /// pick up another socket the worker already closed.
    fresh: Client<Connector, Full<Bytes>>,
    api_key: Option<Secret>,
}

impl Upstream {
    /// TCP_NODELAY on (small SSE writes must not wait for delayed ACKs), connect bound
    /// by `connect_timeout` (the TCP connect; the TLS handshake then runs within the
    /// request's `request_timeout`), idle pooled connections closed after
    /// `pool_idle_timeout`; `https://` verified as `proxy.tls` says.
    pub fn new(cfg: &ProxyConfig) -> Self {
        if cfg.tls.insecure_skip_verify {
            tracing::warn!(
                "proxy.tls.insecure_skip_verify is on: https:// workers are NOT verified; anyone on the path can read and change requests and answers"
            );
        }
        let connector = cfg.tls.https_connector(cfg.connect_timeout);
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(cfg.pool_idle_timeout)
            .build(connector.clone());
        let fresh = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(0)
            .build(connector);
        Upstream {
            client,
            fresh,
            api_key: cfg.api_key.clone(),
        }
    }

    /// Sends one attempt to `worker`, to its data-parallel rank `dp_rank` when set;
    /// resolves when the response headers arrive, or fails with
    /// [`ProxyError::Timeout`] after `timeout` (what is left of the request's
    /// `request_timeout`). A time-out drops the attempt: hyper closes its connection
    /// (it cannot be reused mid-request), which tells the engine the client is gone.
    pub async fn send(
        &self,
        worker: &Worker,
        template: &RequestTemplate,
        body: Bytes,
        dp_rank: Option<u32>,
        timeout: std::time::Duration,
    ) -> Result<Response<Incoming>, ProxyError> {
        let uri = worker
            .url()
            .uri_for(&template.path_and_query)
            .map_err(|e| ProxyError::BadRequest(format!("cannot build the upstream URI: {e}")))?;
        // The headers are built again for a resend (rare) rather than cloned for it on
        // every request.
        let headers = || {
            let mut headers = template.headers.clone();
            headers.insert(header::HOST, worker.url().host_header());
            if !body.is_empty() || template.method == Method::POST || template.method == Method::PUT
            {
                headers.insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
            }
            // A configured backend key always replaces the client's credential (built and
            // checked at config time, so this cannot fall back to the client's).
            if let Some(key) = self.key_for(worker) {
                headers.insert(header::AUTHORIZATION, key.bearer().clone());
            }
            if let Some(rank) = dp_rank {
                headers.insert(super::headers::DP_RANK.clone(), HeaderValue::from(rank));
            }
            headers
        };
        let build = || {
            let mut req = Request::new(Full::new(body.clone()));
            *req.method_mut() = template.method.clone();
            *req.uri_mut() = uri.clone();
            *req.version_mut() = Version::HTTP_11;
            *req.headers_mut() = headers();
            req
        };
        let call = async {
            match self.client.request(build()).await {
                // A pooled connection the worker closed as we reused it (uvicorn drops
                // idle keep-alive sockets after 5 s): nothing was answered, so send
                // once more, on a new connection, to the same worker.
                Err(e) if is_stale_connection(&e) => {
                    tracing::debug!(worker = %worker.url(), error = %describe(&e), "stale pooled connection; resending once");
                    self.fresh.request(build()).await
                }
                other => other,
            }
        };
        match tokio::time::timeout(timeout, call).await {
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(e)) if e.is_connect() => Err(ProxyError::Unreachable(describe(&e))),
            Ok(Err(e)) => Err(ProxyError::Upstream(describe(&e))),
            Err(_) => Err(ProxyError::Timeout(timeout.as_secs_f64())),
        }
    }
}

/// Whether a request failed because its connection was closed or reset under it before
/// any response byte arrived (hyper: "connection closed before message completed", or
/// a reset / broken pipe). A worker that crashed mid-request looks the same; the one
/// resend then meets a refused connection and the request moves to another worker.
fn is_stale_connection(e: &hyper_util::client::legacy::Error) -> bool {
    if e.is_connect() {
        return false;
    }
    let mut src = std::error::Error::source(e);
    while let Some(cause) = src {
        if let Some(h) = cause.downcast_ref::<hyper::Error>()
            && (h.is_incomplete_message() || h.is_canceled())
        {
            return true;
        }
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            return matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::ConnectionAborted
            );
        }
        src = cause.source();
    }
    false
}

impl crate::pool::Fetch for Upstream {
    fn get(
        &self,
        worker: &Worker,
        target: crate::pool::Target<'_>,
        timeout: std::time::Duration,
        max_bytes: usize,
    ) -> impl std::future::Future<Output = Result<(http::StatusCode, Bytes), String>> + Send {
        Upstream::get(self, worker, target, timeout, max_bytes)
    }
}

impl Upstream {
    /// `GET` of `target` (a path below the worker's prefix, with its backend key; or an
    /// absolute URL, without any key), bounded by `timeout` and `max_bytes` of body.
    pub async fn get(
        &self,
        worker: &Worker,
        target: crate::pool::Target<'_>,
        timeout: std::time::Duration,
        max_bytes: usize,
    ) -> Result<(http::StatusCode, Bytes), String> {
        let mut req = Request::new(Full::new(Bytes::new()));
        match target {
            crate::pool::Target::Path(path) => {
                *req.uri_mut() = worker.url().uri_for(path).map_err(|e| e.to_string())?;
                req.headers_mut()
                    .insert(header::HOST, worker.url().host_header());
                if let Some(key) = self.key_for(worker) {
                    req.headers_mut()
                        .insert(header::AUTHORIZATION, key.bearer().clone());
                }
            }
            crate::pool::Target::Url(url) => {
                let uri: http::Uri = url
                    .parse()
                    .map_err(|e: http::uri::InvalidUri| e.to_string())?;
                if let Some(host) = uri
                    .authority()
                    .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
                {
                    req.headers_mut().insert(header::HOST, host);
                }
                *req.uri_mut() = uri;
            }
        }
        self.bounded(req, timeout, max_bytes).await
    }

    /// `POST` of a JSON `body` to an absolute `http(s)://` URL (not a worker path), with
    /// `bearer` as its `Authorization` when given; bounded like [`Upstream::get`].
    pub async fn post_json(
        &self,
        url: &str,
        body: Bytes,
        bearer: Option<&HeaderValue>,
        timeout: std::time::Duration,
        max_bytes: usize,
    ) -> Result<(http::StatusCode, Bytes), String> {
        let uri: http::Uri = url
            .parse()
            .map_err(|e: http::uri::InvalidUri| e.to_string())?;
        let mut req = Request::new(Full::new(body));
        *req.method_mut() = Method::POST;
        let h = req.headers_mut();
        if let Some(host) = uri
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        {
            h.insert(header::HOST, host);
        }
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(b) = bearer {
            h.insert(header::AUTHORIZATION, b.clone());
        }
        *req.uri_mut() = uri;
        self.bounded(req, timeout, max_bytes).await
    }

    /// Sends `req` and reads its status and at most `max_bytes` of body within `timeout`.
    async fn bounded(
        &self,
        req: Request<Full<Bytes>>,
        timeout: std::time::Duration,
        max_bytes: usize,
    ) -> Result<(http::StatusCode, Bytes), String> {
        let call = async {
            let resp = self.client.request(req).await.map_err(|e| describe(&e))?;
            let status = resp.status();
            // Read (bounded) so the connection goes back to the pool.
            let body = http_body_util::Limited::new(resp.into_body(), max_bytes)
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            Ok((status, body))
        };
        tokio::time::timeout(timeout, call)
            .await
            .map_err(|_| format!("no answer within {timeout:?}"))?
    }

    /// The backend key for `worker`: its own `api_key`, else `proxy.api_key`.
    fn key_for<'a>(&'a self, worker: &'a Worker) -> Option<&'a Secret> {
        worker.config().api_key.as_ref().or(self.api_key.as_ref())
    }
}

/// What every attempt of one request shares: method, path and query, and the client's
/// end-to-end headers (hop-by-hop, Host, Content-Length and Expect removed; the request
/// id and the router's `traceparent` set).
pub struct RequestTemplate {
    method: Method,
    path_and_query: String,
    headers: HeaderMap,
}

impl RequestTemplate {
    pub fn new(
        parts: &http::request::Parts,
        request_id: &HeaderValue,
        trace: &crate::trace::TraceContext,
    ) -> Self {
        let mut headers = parts.headers.clone();
        headers::strip_hop_by_hop(&mut headers);
        headers.remove(header::HOST);
        headers.remove(header::CONTENT_LENGTH);
        headers.remove(header::EXPECT);
        // Read by the router (precise mode), not the engine: a long prompt's ids can pass
        // the engine's header size limit (uvicorn/h11: 16 KiB).
        headers.remove(crate::precise::TOKEN_IDS_HEADER);
        headers.insert(headers::REQUEST_ID.clone(), request_id.clone());
        trace.propagate(&mut headers);
        RequestTemplate {
            method: parts.method.clone(),
            path_and_query: parts
                .uri
                .path_and_query()
                .map_or("/", |pq| pq.as_str())
                .to_string(),
            headers,
        }
    }
}

/// The error and its causes on one line ([`crate::error::describe`]).
fn describe(e: &hyper_util::client::legacy::Error) -> String {
    crate::error::describe(e)
}

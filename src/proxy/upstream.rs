//! The pooled upstream client and the per-attempt request.

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Request, Response, Version};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use super::headers;
use crate::config::ProxyConfig;
use crate::error::ProxyError;
use crate::workers::Worker;

/// hyper-util's pooled HTTP/1.1 client, configured from `proxy:`.
pub struct Upstream {
    client: Client<HttpConnector, Full<Bytes>>,
    request_timeout: std::time::Duration,
    api_key: Option<HeaderValue>,
}

impl Upstream {
    /// TCP_NODELAY on (small SSE writes must not wait for delayed ACKs), connect bound
    /// by `connect_timeout`, idle pooled connections closed after `pool_idle_timeout`.
    pub fn new(cfg: &ProxyConfig) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(cfg.connect_timeout));
        connector.enforce_http(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(cfg.pool_idle_timeout)
            .build(connector);
        Upstream {
            client,
            request_timeout: cfg.request_timeout,
            api_key: cfg.api_key.as_deref().and_then(bearer),
        }
    }

    /// Sends one attempt to `worker`; resolves when the response headers arrive.
    pub async fn send(
        &self,
        worker: &Worker,
        template: &RequestTemplate,
        body: Bytes,
    ) -> Result<Response<Incoming>, ProxyError> {
        let uri = worker
            .url()
            .uri_for(&template.path_and_query)
            .map_err(|e| ProxyError::BadRequest(format!("cannot build the upstream URI: {e}")))?;
        let mut req = Request::new(Full::new(body.clone()));
        *req.method_mut() = template.method.clone();
        *req.uri_mut() = uri;
        *req.version_mut() = Version::HTTP_11;
        let h = req.headers_mut();
        *h = template.headers.clone();
        if let Ok(host) = HeaderValue::from_str(worker.url().authority()) {
            h.insert(header::HOST, host);
        }
        if !body.is_empty() || template.method == Method::POST || template.method == Method::PUT {
            h.insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
        }
        let key = worker
            .config()
            .api_key
            .as_deref()
            .and_then(bearer)
            .or_else(|| self.api_key.clone());
        if let Some(key) = key {
            h.insert(header::AUTHORIZATION, key);
        }
        match tokio::time::timeout(self.request_timeout, self.client.request(req)).await {
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(e)) if e.is_connect() => Err(ProxyError::Unreachable(describe(&e))),
            Ok(Err(e)) => Err(ProxyError::Upstream(describe(&e))),
            Err(_) => Err(ProxyError::Timeout(self.request_timeout.as_secs())),
        }
    }
}

/// What every attempt of one request shares: method, path and query, and the client's
/// end-to-end headers (hop-by-hop, Host, Content-Length and Expect removed; the request
/// id set).
pub struct RequestTemplate {
    method: Method,
    path_and_query: String,
    headers: HeaderMap,
}

impl RequestTemplate {
    pub fn new(parts: &http::request::Parts, request_id: &HeaderValue) -> Self {
        let mut headers = parts.headers.clone();
        headers::strip_hop_by_hop(&mut headers);
        headers.remove(header::HOST);
        headers.remove(header::CONTENT_LENGTH);
        headers.remove(header::EXPECT);
        headers.insert(headers::REQUEST_ID.clone(), request_id.clone());
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

fn bearer(key: &str) -> Option<HeaderValue> {
    let mut v = HeaderValue::from_str(&format!("Bearer {key}")).ok()?;
    v.set_sensitive(true);
    Some(v)
}

/// The error and its causes on one line (hyper's top-level message alone says little).
fn describe(e: &hyper_util::client::legacy::Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(cause) = src {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        src = cause.source();
    }
    s
}

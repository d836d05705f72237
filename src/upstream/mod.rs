//! The client to workers: requests on per-worker keep-alive connections
//! (`crate::pools::pool::keep_alive`), the per-attempt request, and calls to other hosts (the
//! response cache's embeddings endpoint). Below both `proxy` and `cache`, so neither
//! depends on the other.

pub mod headers;

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Request, Response, Version};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use crate::config::{ProxyConfig, Secret};
use crate::error::ProxyError;
use crate::pools::pool::Worker;
use crate::pools::pool::keep_alive::Conn;

/// The connector of every upstream call: plain TCP for `http://`, rustls over it for
/// `https://` (`proxy.tls`).
type Connector = HttpsConnector<HttpConnector>;

/// The upstream client, configured from `proxy:`. Cheap to clone.
///
/// Requests to a worker (proxied ones, and its health probes and scrapes) go over
/// HTTP/1.1 connections of hyper's own, kept per worker ([`Worker::keep_alive`]): a
/// request takes the worker's most recently idled one (or opens one), and its answer's
/// body returns it when read to the end. Calls to other hosts (absolute URLs) use
/// hyper-util's pooled client.
#[derive(Clone)]
pub struct Upstream {
    /// Calls to absolute URLs ([`crate::pools::pool::Target::Url`], [`Upstream::post_json`]).
    client: Client<Connector, Full<Bytes>>,
    connector: Connector,
    /// `proxy.pool_idle_timeout_secs`: an idle connection older than this is not used.
    idle_timeout: Duration,
    api_key: Option<Secret>,
}

impl Upstream {
    /// TCP_NODELAY on (small SSE writes must not wait for delayed ACKs), connect bound
    /// by `connect_timeout` (the TCP connect; the TLS handshake then runs within the
    /// request's `request_timeout`), idle connections not reused after
    /// `pool_idle_timeout` (and closed by [`close_idle`]); `https://` verified as
    /// `proxy.tls` says.
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
        Upstream {
            client,
            connector,
            idle_timeout: cfg.pool_idle_timeout,
            api_key: cfg.api_key.clone(),
        }
    }

    /// Sends one attempt to `worker`, to its data-parallel rank `dp_rank` when set;
    /// resolves when the response headers arrive, or fails with
    /// [`ProxyError::Timeout`] after `timeout` (what is left of the request's
    /// `request_timeout`). A time-out drops the attempt and its connection (it cannot
    /// be reused mid-request), which tells the engine the client is gone.
    ///
    /// A kept connection that the worker closed as it was reused (uvicorn drops idle
    /// keep-alive sockets after 5 s) answers nothing: the request is sent once more, on
    /// a new connection, to the same worker.
    pub async fn send(
        &self,
        worker: &Arc<Worker>,
        template: &RequestTemplate,
        body: Bytes,
        dp_rank: Option<u32>,
        timeout: Duration,
    ) -> Result<Response<UpstreamBody>, ProxyError> {
        let uri = worker
            .url()
            .origin_form(template.path_and_query.as_str())
            .map_err(ProxyError::UpstreamUri)?;
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
                headers.insert(headers::DP_RANK.clone(), HeaderValue::from(rank));
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
        tokio::time::timeout(timeout, self.exchange(worker, build))
            .await
            .unwrap_or(Err(ProxyError::Timeout(timeout.as_secs_f64())))
    }

    /// Sends `build()` to `worker` on a kept connection (or a new one); a kept one the
    /// worker closed as it was reused gets one resend of `build()` on a new connection.
    async fn exchange(
        &self,
        worker: &Arc<Worker>,
        build: impl Fn() -> Request<Full<Bytes>>,
    ) -> Result<Response<UpstreamBody>, ProxyError> {
        let mut conn = self.checkout(worker).await?;
        let resp = match conn.send_request(build()).await {
            Err(e) if is_stale_connection(&e) => {
                tracing::debug!(worker = %worker.url(), error = %crate::error::Chain(&e), "stale connection; resending once on a new one");
                drop(conn);
                conn = self.connect(worker).await?;
                conn.send_request(build()).await
            }
            other => other,
        };
        // `pool_idle_timeout_secs: 0`: no connection is kept (it closes after its answer).
        let keep = (!self.idle_timeout.is_zero()).then(|| Arc::clone(worker));
        resp.map(|r| UpstreamBody::wrap(r, conn, keep))
            .map_err(|e| ProxyError::Upstream(Box::new(e)))
    }

    /// A ready connection to `worker`: its most recently idled one, else a new one.
    async fn checkout(&self, worker: &Worker) -> Result<Conn, ProxyError> {
        while let Some(mut conn) = worker.keep_alive().take(self.idle_timeout) {
            // Returned when its answer's last byte was read: hyper marks it ready for
            // the next request at once, or within that instant. A closed one errs.
            if conn.ready().await.is_ok() {
                return Ok(conn);
            }
        }
        self.connect(worker).await
    }

    /// Opens a connection to `worker` (TCP, and TLS for `https://`); it is read and
    /// written as it is used ([`Conn`]).
    async fn connect(&self, worker: &Worker) -> Result<Conn, ProxyError> {
        let io = self.dial(worker).await?;
        let (conn, io_task) = hyper::client::conn::http1::handshake(io)
            .await
            .map_err(|e| ProxyError::Unreachable(Box::new(e)))?;
        Ok(Conn::new(conn, io_task, Arc::clone(worker.label())))
    }

    /// The transport to `worker`: TCP, and TLS over it for `https://`.
    async fn dial(
        &self,
        worker: &Worker,
    ) -> Result<<Connector as tower_service::Service<http::Uri>>::Response, ProxyError> {
        let origin = (worker.url().origin()).map_err(|e| ProxyError::Unreachable(Box::new(e)))?;
        let mut connector = self.connector.clone();
        std::future::poll_fn(|cx| tower_service::Service::poll_ready(&mut connector, cx))
            .await
            .map_err(ProxyError::Unreachable)?;
        tower_service::Service::call(&mut connector, origin)
            .await
            .map_err(ProxyError::Unreachable)
    }

    /// Sends an upgrade handshake (a WebSocket `GET`) to `worker` on a connection of its
    /// own, which the upgrade takes over: the template's headers plus `Connection:
    /// upgrade` and the client's `upgrade` protocols. Resolves with the worker's answer
    /// head (a `101` carries the upgraded connection: `hyper::upgrade::on`), or fails
    /// after `timeout`.
    pub async fn send_upgrade(
        &self,
        worker: &Arc<Worker>,
        template: &RequestTemplate,
        upgrade: HeaderValue,
        timeout: Duration,
    ) -> Result<Response<Incoming>, ProxyError> {
        let call = async {
            let uri = worker
                .url()
                .origin_form(template.path_and_query.as_str())
                .map_err(ProxyError::UpstreamUri)?;
            let mut req = Request::new(Full::new(Bytes::new()));
            *req.method_mut() = template.method.clone();
            *req.uri_mut() = uri;
            *req.version_mut() = Version::HTTP_11;
            let mut headers = template.headers.clone();
            headers.insert(header::HOST, worker.url().host_header());
            headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
            headers.insert(header::UPGRADE, upgrade);
            if let Some(key) = self.key_for(worker) {
                headers.insert(header::AUTHORIZATION, key.bearer().clone());
            }
            *req.headers_mut() = headers;
            let io = self.dial(worker).await?;
            let (mut send, conn) = hyper::client::conn::http1::handshake(io)
                .await
                .map_err(|e| ProxyError::Unreachable(Box::new(e)))?;
            // Driven by a task of its own: after a 101 it hands the socket to the
            // tunnel, and it must keep running while the request's task waits for that.
            let label = Arc::clone(worker.label());
            tokio::spawn(async move {
                if let Err(e) = conn.with_upgrades().await {
                    tracing::debug!(worker = &*label, error = %crate::error::Chain(&e), "upgrade connection ended with an error");
                }
            });
            send.send_request(req)
                .await
                .map_err(|e| ProxyError::Upstream(Box::new(e)))
        };
        tokio::time::timeout(timeout, call)
            .await
            .unwrap_or(Err(ProxyError::Timeout(timeout.as_secs_f64())))
    }
}

/// Closes, every `idle_timeout` / 2 (at least every second), the connections idle for
/// `proxy.pool_idle_timeout_secs` in every worker of `pool`, until shutdown: a burst's
/// connections do not stay open on the workers once the burst is over. Returns at once
/// for a zero `idle_timeout` (no connection is kept).
pub async fn close_idle(
    pool: Arc<crate::pools::pool::Pool>,
    idle_timeout: Duration,
    mut shutdown: crate::shutdown::Shutdown,
) {
    if idle_timeout.is_zero() {
        return;
    }
    let every = (idle_timeout / 2).clamp(Duration::from_millis(10), Duration::from_secs(1));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.wait() => return,
        }
        for w in pool.set().workers() {
            w.keep_alive().close_idle(idle_timeout);
        }
    }
}

/// A worker's answer body. Reading it drives its connection ([`Conn`]: the socket is
/// read as the body is). Returns the connection to the worker's keep-alive list once
/// read to the end; dropped before (a client that left, an answer not relayed), it
/// closes the connection, which cannot carry another request mid-answer.
#[derive(Debug)]
pub struct UpstreamBody {
    inner: Incoming,
    /// The connection, and the worker to give it back to (`None`: closed at the end),
    /// until the body ends.
    conn: Option<(Conn, Option<Arc<Worker>>)>,
    /// What [`UpstreamBody::first`] read, handed on by the next poll.
    early: Option<Option<Result<Frame<Bytes>, hyper::Error>>>,
}

impl UpstreamBody {
    fn wrap(resp: Response<Incoming>, conn: Conn, keep: Option<Arc<Worker>>) -> Response<Self> {
        let (parts, inner) = resp.into_parts();
        let mut body = UpstreamBody {
            inner,
            conn: Some((conn, keep)),
            early: None,
        };
        // An answer with no body (204, `Content-Length: 0`) may never be polled.
        if body.inner.is_end_stream() {
            body.release();
        }
        Response::from_parts(parts, body)
    }

    fn release(&mut self) {
        if let Some((conn, Some(worker))) = self.conn.take() {
            worker.keep_alive().put(conn);
        }
    }

    /// Waits for the body's first frame (or its end, or its error) and keeps it for the
    /// next poll: a hedged request's first byte, read before its answer is chosen.
    pub async fn first(&mut self) {
        if self.early.is_none() {
            let got = std::future::poll_fn(|cx| Pin::new(&mut *self).poll_frame(cx)).await;
            self.early = Some(got);
        }
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        if let Some(early) = this.early.take() {
            return Poll::Ready(early);
        }
        let mut frame = Pin::new(&mut this.inner).poll_frame(cx);
        // Nothing buffered: let hyper read the socket (the body's poll above told it the
        // next chunk is wanted), then look again. The socket and the body both wake this
        // task, so nothing is missed when both are still pending.
        if frame.is_pending()
            && let Some((conn, _)) = &mut this.conn
        {
            conn.poll_drive(cx);
            frame = Pin::new(&mut this.inner).poll_frame(cx);
        }
        let frame = ready!(frame);
        match &frame {
            // The last frame of a sized body: the server may not poll again.
            None => self.release(),
            Some(Ok(_)) if self.inner.is_end_stream() => self.release(),
            Some(Ok(_)) => {}
            Some(Err(_)) => self.conn = None,
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.early.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        match &self.early {
            None => self.inner.size_hint(),
            // The kept frame's bytes and what follows it.
            Some(Some(Ok(f))) => {
                let mut hint = self.inner.size_hint();
                let n = f.data_ref().map_or(0, |d| d.len() as u64);
                if let Some(u) = hint.upper() {
                    hint.set_upper(u + n);
                }
                hint.set_lower(hint.lower() + n);
                hint
            }
            Some(_) => SizeHint::with_exact(0),
        }
    }
}

/// Whether a request failed because its connection was closed or reset under it before
/// any response byte arrived (hyper: "connection closed before message completed", a
/// request canceled before it was written, or a reset / broken pipe). A worker that
/// crashed mid-request looks the same; the one resend then meets a refused connection
/// and the request moves to another worker.
fn is_stale_connection(e: &hyper::Error) -> bool {
    if e.is_incomplete_message() || e.is_canceled() {
        return true;
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

impl crate::pools::pool::Fetch for Upstream {
    /// [`Upstream::get`], its error shown with its causes.
    async fn get(
        &self,
        worker: &Arc<Worker>,
        target: crate::pools::pool::Target<'_>,
        timeout: Duration,
        max_bytes: usize,
    ) -> Result<(http::StatusCode, Bytes), String> {
        Upstream::get(self, worker, target, timeout, max_bytes)
            .await
            .map_err(|e| crate::error::describe(&e))
    }
}

impl Upstream {
    /// `GET` of `target` (a path below the worker's prefix, with its backend key, on the
    /// worker's keep-alive connections; or an absolute URL, without any key), bounded
    /// by `timeout` and `max_bytes` of body.
    pub async fn get(
        &self,
        worker: &Arc<Worker>,
        target: crate::pools::pool::Target<'_>,
        timeout: Duration,
        max_bytes: usize,
    ) -> Result<(http::StatusCode, Bytes), CallError> {
        let url = match target {
            crate::pools::pool::Target::Path(path) => {
                return self
                    .call_worker(worker, Method::GET, path, None, timeout, max_bytes)
                    .await;
            }
            crate::pools::pool::Target::Url(url) => url,
        };
        let mut req = Request::new(Full::new(Bytes::new()));
        let uri: http::Uri = url.parse().map_err(http::Error::from)?;
        if let Some(host) = uri
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        {
            req.headers_mut().insert(header::HOST, host);
        }
        *req.uri_mut() = uri;
        self.bounded(req, timeout, max_bytes).await
    }

    /// `POST` of a JSON `body` to `path` below the worker's URL, with its backend key,
    /// on its keep-alive connections; bounded like [`Upstream::get`].
    pub async fn post_worker_json(
        &self,
        worker: &Arc<Worker>,
        path: &str,
        body: Bytes,
        timeout: Duration,
        max_bytes: usize,
    ) -> Result<(http::StatusCode, Bytes), CallError> {
        self.call_worker(worker, Method::POST, path, Some(body), timeout, max_bytes)
            .await
    }

    /// One call of `method` on `path` below the worker's URL (a JSON `body` when
    /// given), with its backend key, on its connections, within `timeout` and
    /// `max_bytes` of answer.
    async fn call_worker(
        &self,
        worker: &Arc<Worker>,
        method: Method,
        path: &str,
        body: Option<Bytes>,
        timeout: Duration,
        max_bytes: usize,
    ) -> Result<(http::StatusCode, Bytes), CallError> {
        let uri = worker.url().origin_form(path)?;
        let build = || {
            let mut req = Request::new(Full::new(body.clone().unwrap_or_default()));
            *req.method_mut() = method.clone();
            *req.uri_mut() = uri.clone();
            let h = req.headers_mut();
            h.insert(header::HOST, worker.url().host_header());
            if body.is_some() {
                h.insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                );
            }
            if let Some(key) = self.key_for(worker) {
                h.insert(header::AUTHORIZATION, key.bearer().clone());
            }
            req
        };
        let call = async {
            let resp = self.exchange(worker, build).await?;
            read_bounded(resp, max_bytes).await
        };
        tokio::time::timeout(timeout, call)
            .await
            .map_err(|_| CallError::Timeout(timeout))?
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
    ) -> Result<(http::StatusCode, Bytes), CallError> {
        let uri: http::Uri = url.parse().map_err(http::Error::from)?;
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
    ) -> Result<(http::StatusCode, Bytes), CallError> {
        let call = async {
            let resp = self.client.request(req).await?;
            read_bounded(resp, max_bytes).await
        };
        tokio::time::timeout(timeout, call)
            .await
            .map_err(|_| CallError::Timeout(timeout))?
    }

    /// The backend key for `worker`: its own `api_key`, else `proxy.api_key`.
    fn key_for<'a>(&'a self, worker: &'a Worker) -> Option<&'a Secret> {
        worker.config().api_key.as_ref().or(self.api_key.as_ref())
    }
}

/// What every attempt of one request shares: method, path and query, and the client's
/// end-to-end headers (hop-by-hop, Host, Content-Length and Expect removed; the request
/// id and the router's `traceparent` set).
#[derive(Clone)]
pub struct RequestTemplate {
    method: Method,
    path_and_query: http::uri::PathAndQuery,
    headers: HeaderMap,
}

impl RequestTemplate {
    /// Takes the client's request head (moved, not copied: the request is routed by now).
    pub fn new(
        parts: http::request::Parts,
        request_id: &HeaderValue,
        trace: &crate::trace::TraceContext,
    ) -> Self {
        let mut headers = parts.headers;
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
            method: parts.method,
            path_and_query: (parts.uri.into_parts().path_and_query)
                .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/")),
            headers,
        }
    }
}

/// The status and at most `max_bytes` of `resp`'s body (read to its end, so that its
/// connection can carry the next request).
async fn read_bounded<B>(
    resp: Response<B>,
    max_bytes: usize,
) -> Result<(http::StatusCode, Bytes), CallError>
where
    B: Body<Data = Bytes>,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    let status = resp.status();
    let body = http_body_util::Limited::new(resp.into_body(), max_bytes)
        .collect()
        .await
        .map_err(CallError::Body)?
        .to_bytes();
    Ok((status, body))
}

/// Why a call that is not a proxied request (a health probe, a scrape, an embeddings
/// lookup) got no answer. Each shows as its cause does, `describe` adding the causes'
/// causes.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The URL, or the worker's prefix with the path, is not a valid URI.
    #[error(transparent)]
    Uri(#[from] http::Error),
    /// A call on the worker's own connections failed.
    #[error(transparent)]
    Worker(#[from] ProxyError),
    /// A call to another host failed.
    #[error(transparent)]
    Client(#[from] hyper_util::client::legacy::Error),
    /// The answer's body could not be read whole within its bound.
    #[error(transparent)]
    Body(crate::error::BoxError),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

//! Test support for the socket-level tests in `tests/`.
//!
//! - [`FakeWorker`]: a scripted, deterministic mock replica on a raw TCP listener with a
//!   small HTTP/1.1 parser. It records every request (request line, headers, body, the
//!   connection it came on) and answers as scripted: status, headers and body; chunked
//!   bodies written piece by piece with delays or gates (SSE); a `Content-Length` body
//!   trickled over time; exact raw bytes (malformed framing); a delay or gate before
//!   the head; closing idle keep-alive connections; requiring a bearer token. It can be
//!   killed mid-run ([`FakeWorker::kill`]) and still be asked what it received.
//! - [`Conn`] and friends: a raw HTTP/1.1 client that keeps the response headers exactly
//!   as received (duplicates, both framings) and records when each piece of the body
//!   arrived.
//! - [`start_router`], [`get_workers`], [`scrape`], [`wait_until`]: run and observe a
//!   router the way a user does (`GET /workers`, `GET /metrics` parsed into samples).
//!
//! Every wait is bounded (see [`within`]) so that a bug shows as a failure, not a hang.

#![allow(dead_code)]

pub mod binary;
pub mod dns;
pub mod kube_api;
pub mod otlp;
pub mod redis;
pub mod tls;
pub mod ws;

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use cache_aware_router::app::{self, RunningRouter};
use cache_aware_router::config::Config;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;

/// Upper bound of any single wait in a test: long enough never to trip on a slow CI
/// machine when the router behaves, short enough to fail fast when it does not.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(5);

/// Awaits `f`, panicking with `what` if it takes longer than [`STEP_TIMEOUT`].
pub async fn within<F: Future>(what: &str, f: F) -> F::Output {
    match tokio::time::timeout(STEP_TIMEOUT, f).await {
        Ok(v) => v,
        Err(_) => panic!("timed out after {STEP_TIMEOUT:?}: {what}"),
    }
}

/// Polls `cond` every 10 ms until it returns true; panics with `what` after `limit`.
pub async fn wait_until<F, Fut>(what: &str, limit: Duration, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if cond().await {
            return;
        }
        if start.elapsed() > limit {
            panic!("condition not reached within {limit:?}: {what}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

// ---------------------------------------------------------------------------------
// Mock worker

/// A request as the mock worker received it.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// Order of arrival at this worker (0-based).
    pub index: usize,
    /// The TCP connection it came on (1-based, in accept order).
    pub conn: u64,
    pub method: String,
    /// The request-line target: path and query, exactly as sent.
    pub target: String,
    pub version: String,
    /// Header lines in order, names as sent.
    pub headers: Vec<(String, String)>,
    /// The body, de-chunked when it came chunked.
    pub body: Vec<u8>,
    /// Whether the body came with `Transfer-Encoding: chunked`.
    pub chunked: bool,
    /// Whether the bearer token matched (always true when none is required).
    pub authorized: bool,
    pub at: Instant,
}

impl Recorded {
    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        header_in(&self.headers, name)
    }

    /// Every value of header `name`.
    pub fn header_all(&self, name: &str) -> Vec<&str> {
        header_all_in(&self.headers, name)
    }

    pub fn has_header(&self, name: &str) -> bool {
        self.header(name).is_some()
    }

    pub fn body_str(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

fn header_in<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

fn header_all_in<'a>(headers: &'a [(String, String)], name: &str) -> Vec<&'a str> {
    headers
        .iter()
        .filter(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
        .collect()
}

/// A latch the test opens to let a scripted reply continue (deterministic "mid-stream").
#[derive(Clone, Debug)]
pub struct Gate(Arc<watch::Sender<bool>>);

impl Default for Gate {
    fn default() -> Self {
        Gate::new()
    }
}

impl Gate {
    pub fn new() -> Self {
        Gate(Arc::new(watch::channel(false).0))
    }

    pub fn open(&self) {
        self.0.send_replace(true);
    }

    async fn wait(&self) {
        let mut rx = self.0.subscribe();
        let _ = rx.wait_for(|open| *open).await;
    }
}

/// One step of a body written over time.
#[derive(Clone, Debug)]
pub enum Step {
    /// Write these bytes (one chunk in chunked framing) and note when.
    Write(Vec<u8>),
    Sleep(Duration),
    /// Wait until the gate is opened.
    Wait(Gate),
    /// In a raw reply after a `101`: echo the client's WebSocket frames until its close
    /// ([`ws::echo_frames`]).
    EchoWebSocket,
}

#[derive(Clone, Debug)]
enum ReplyBody {
    /// Written at once with `Content-Length`.
    Full(Vec<u8>),
    /// `Transfer-Encoding: chunked`, one chunk per `Step::Write`, then the last chunk.
    Chunked(Vec<Step>),
    /// `Content-Length` of all writes, sent with the head; then written step by step.
    Trickle(Vec<Step>),
    /// Exactly these bytes, head included; the connection is closed after.
    Raw(Vec<Step>),
}

/// A scripted answer.
#[derive(Clone, Debug)]
pub struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: ReplyBody,
    close: bool,
    /// Wait before writing anything (a worker still prefilling).
    delay: Option<Step>,
}

/// A body for a plain successful chat answer.
pub const OK_BODY: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}"#;

impl Reply {
    /// `status` with an empty body.
    pub fn status(status: u16) -> Self {
        Reply {
            status,
            headers: Vec::new(),
            body: ReplyBody::Full(Vec::new()),
            close: false,
            delay: None,
        }
    }

    /// `status` with a JSON body.
    pub fn json(status: u16, body: &str) -> Self {
        Reply::status(status)
            .header("Content-Type", "application/json")
            .body(body.as_bytes().to_vec())
    }

    /// 200 with [`OK_BODY`].
    pub fn ok() -> Self {
        Reply::json(200, OK_BODY)
    }

    /// 200 `text/event-stream`, chunked, one chunk per event (`data: <e>\n\n`), `gap`
    /// between events.
    pub fn sse(events: &[String], gap: Duration) -> Self {
        let mut steps = Vec::new();
        for (i, e) in events.iter().enumerate() {
            if i > 0 && !gap.is_zero() {
                steps.push(Step::Sleep(gap));
            }
            steps.push(Step::Write(format!("data: {e}\n\n").into_bytes()));
        }
        Reply::status(200)
            .header("Content-Type", "text/event-stream")
            .chunked(steps)
    }

    /// Exactly these bytes (status line and head included); the connection closes after.
    pub fn raw(steps: Vec<Step>) -> Self {
        Reply {
            status: 0,
            headers: Vec::new(),
            body: ReplyBody::Raw(steps),
            close: true,
            delay: None,
        }
    }

    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.to_string(), value.to_string()));
        self
    }

    pub fn body(mut self, body: Vec<u8>) -> Self {
        self.body = ReplyBody::Full(body);
        self
    }

    /// A chunked body written step by step.
    pub fn chunked(mut self, steps: Vec<Step>) -> Self {
        self.body = ReplyBody::Chunked(steps);
        self
    }

    /// A `Content-Length` body whose bytes are written step by step.
    pub fn trickle(mut self, steps: Vec<Step>) -> Self {
        self.body = ReplyBody::Trickle(steps);
        self
    }

    /// Close the connection after this reply.
    pub fn close(mut self) -> Self {
        self.close = true;
        self
    }

    /// Writes nothing, not even the head, for `d` (a worker busy before it answers).
    pub fn after(mut self, d: Duration) -> Self {
        self.delay = Some(Step::Sleep(d));
        self
    }

    /// Writes nothing, not even the head, until `gate` opens (a worker that has the
    /// request and has not answered yet).
    pub fn after_gate(mut self, gate: &Gate) -> Self {
        self.delay = Some(Step::Wait(gate.clone()));
        self
    }
}

/// The `usage` object vLLM and SGLang report: `prompt` tokens, `cached` of them.
pub fn usage_json(prompt: u64, cached: u64) -> String {
    format!(
        r#"{{"prompt_tokens":{prompt},"completion_tokens":1,"prompt_tokens_details":{{"cached_tokens":{cached}}}}}"#
    )
}

/// Answers as an engine does, with the usage the test asks for in `x-usage: P,C` (and
/// no `prompt_tokens_details`, as vLLM without `--enable-prompt-tokens-details`, when
/// `x-no-details` is set):
/// `FAIL` prompts get a 500; streamed requests an SSE stream whose final chunk carries
/// the usage (held before it while `x-hold` is set, until `hold` opens); others a JSON
/// body with the usage.
pub fn usage_engine(hold: Gate) -> impl Fn(&Recorded) -> Reply + Send + Sync + 'static {
    move |req| {
        let body = req.body_str();
        if body.contains("FAIL") {
            return Reply::json(500, r#"{"error":{"message":"engine crashed","code":500}}"#);
        }
        let (p, c) = req
            .header("x-usage")
            .and_then(|v| v.split_once(','))
            .map(|(p, c)| (p.parse().unwrap(), c.parse().unwrap()))
            .unwrap_or((0, 0));
        let usage = if req.has_header("x-no-details") {
            format!(r#"{{"prompt_tokens":{p},"completion_tokens":1}}"#)
        } else {
            usage_json(p, c)
        };
        if body.contains(r#""stream":true"#) {
            let mut steps = vec![
                Step::Write(format!("data: {}\n\n", sse_event(0)).into_bytes()),
                Step::Write(format!("data: {}\n\n", sse_event(1)).into_bytes()),
            ];
            if req.has_header("x-hold") {
                steps.push(Step::Wait(hold.clone()));
            }
            steps.push(Step::Write(
                format!("data: {}\n\n", sse_usage_chunk(&usage)).into_bytes(),
            ));
            steps.push(Step::Write(b"data: [DONE]\n\n".to_vec()));
            Reply::status(200)
                .header("Content-Type", "text/event-stream")
                .chunked(steps)
        } else {
            Reply::json(
                200,
                &format!(
                    r#"{{"id":"chatcmpl-1","object":"chat.completion","choices":[{{"index":0,"message":{{"role":"assistant","content":"ok"}},"finish_reason":"stop"}}],"usage":{usage}}}"#
                ),
            )
        }
    }
}

/// Sends a long chat prompt through `addr` and asserts that `workers[0]` answered it
/// with 200; returns the prompt (its follow-ups are cache hits there).
pub async fn long_prompt_served_by_first(addr: SocketAddr, workers: &[&FakeWorker]) -> String {
    let long = "tell me everything about the history of the city and its rivers ".repeat(8);
    let (resp, by) = send_tagged(
        addr,
        workers,
        Req::post("/v1/chat/completions", chat_body(&long, false)),
    )
    .await;
    assert_eq!((resp.status, by), (200, 0), "{}", resp.text());
    long
}

/// Two [`usage_engine`]s (sharing `hold`) behind a router that diverts a hit on any load
/// difference (`hit_overloaded`) and never retries; `extra` is more of its YAML.
pub async fn usage_engines_and_router(extra: &str) -> (Gate, [FakeWorker; 2], RunningRouter) {
    usage_engines_and_router_with("", extra).await
}

/// [`usage_engines_and_router`] with `cache` keys added to its `cache:` section (each
/// line indented by two spaces).
pub async fn usage_engines_and_router_with(
    cache: &str,
    extra: &str,
) -> (Gate, [FakeWorker; 2], RunningRouter) {
    let hold = Gate::new();
    let a = FakeWorker::start_with(usage_engine(hold.clone())).await;
    let b = FakeWorker::start_with(usage_engine(hold.clone())).await;
    let router = start_router(&yaml_for(
        &[&a, &b],
        &format!(
            "cache:\n  balance_abs_threshold: 0\n  balance_rel_threshold: 1.0\n{cache}proxy:\n  max_retries: 0\n{extra}"
        ),
    ))
    .await;
    (hold, [a, b], router)
}

/// Sends `req` (a streamed chat request to [`usage_engine`]s) with `x-hold`, so its
/// stream stays open before its usage chunk until the engines' `hold` gate opens; returns
/// once its first event has arrived, with the open connection and which of `workers`
/// serves it.
pub async fn hold_stream(addr: SocketAddr, workers: &[&FakeWorker], req: Req) -> (Conn, usize) {
    let tag = new_tag();
    let mut held = Conn::connect(addr).await;
    held.send(&req.header("x-hold", "1").header("x-test-tag", &tag))
        .await
        .unwrap();
    assert_eq!(held.read_head().await.status, 200);
    held.next_piece().await.expect("first event");
    (held, served_by(workers, &tag))
}

/// A chat request whose engine answer reports `usage` = (prompt, cached) tokens (see
/// [`usage_engine`]).
pub fn chat_with_usage(body: String, usage: (u64, u64)) -> Req {
    Req::post("/v1/chat/completions", body).header("x-usage", &format!("{},{}", usage.0, usage.1))
}

/// The final SSE chunk of a stream with `stream_options.include_usage`.
pub fn sse_usage_event(prompt: u64, cached: u64) -> String {
    sse_usage_chunk(&usage_json(prompt, cached))
}

/// The final SSE chunk carrying the `usage` object `usage` (JSON).
pub fn sse_usage_chunk(usage: &str) -> String {
    format!(r#"{{"id":"c","object":"chat.completion.chunk","choices":[],"usage":{usage}}}"#)
}

/// An SSE event payload in the OpenAI chunk shape.
pub fn sse_event(i: usize) -> String {
    format!(
        r#"{{"id":"c","object":"chat.completion.chunk","choices":[{{"index":0,"delta":{{"content":"tok{i}"}}}}]}}"#
    )
}

type Handler = Arc<dyn Fn(&Recorded) -> Reply + Send + Sync>;

/// When a body piece was written, and its bytes.
pub type Written = (Instant, Vec<u8>);

struct State {
    handler: Handler,
    health: Handler,
    idle_close: Option<Duration>,
    stale_after: Option<Duration>,
    stale_reset: bool,
    stale_hits: AtomicU64,
    bearer: Option<String>,
    requests: Mutex<Vec<Recorded>>,
    /// Health probes (`GET …/health`), kept apart from `requests`.
    probes: Mutex<Vec<Recorded>>,
    /// Per request index: when each body piece was written, and its payload.
    writes: Mutex<HashMap<usize, Vec<Written>>>,
    conns: AtomicU64,
    open_conns: Mutex<std::collections::HashSet<u64>>,
    changed: Notify,
}

/// Builder for a [`FakeWorker`].
pub struct FakeWorkerBuilder {
    handler: Handler,
    health: Handler,
    idle_close: Option<Duration>,
    stale_after: Option<Duration>,
    stale_reset: bool,
    bearer: Option<String>,
    ipv6: bool,
    bind: Option<String>,
}

impl FakeWorkerBuilder {
    /// Answers each request with `f(request)`.
    pub fn reply(mut self, f: impl Fn(&Recorded) -> Reply + Send + Sync + 'static) -> Self {
        self.handler = Arc::new(f);
        self
    }

    /// Answers health probes (`GET` of a path ending in `/health`) with `f(probe)`
    /// instead of 200.
    pub fn health(mut self, f: impl Fn(&Recorded) -> Reply + Send + Sync + 'static) -> Self {
        self.health = Arc::new(f);
        self
    }

    /// Closes a keep-alive connection that stays idle this long between requests.
    pub fn idle_close(mut self, after: Duration) -> Self {
        self.idle_close = Some(after);
        self
    }

    /// A request that arrives on a connection idle for at least `after` is dropped with
    /// the connection, unread and unanswered, as when the worker closed an idle
    /// keep-alive connection at the very moment the request was sent. Such requests are
    /// not recorded: the worker never processed them.
    pub fn stale_after(mut self, after: Duration) -> Self {
        self.stale_after = Some(after);
        self
    }

    /// With [`FakeWorkerBuilder::stale_after`]: drop such connections with a TCP reset
    /// (as the kernel does when a socket is closed with unread data) instead of a FIN.
    pub fn reset_stale(mut self) -> Self {
        self.stale_reset = true;
        self
    }

    /// Answers 401 unless `Authorization: Bearer <token>`.
    pub fn require_bearer(mut self, token: &str) -> Self {
        self.bearer = Some(token.to_string());
        self
    }

    /// Listens on `[::1]:0` instead of `127.0.0.1:0`.
    pub fn ipv6(mut self) -> Self {
        self.ipv6 = true;
        self
    }

    /// Listens on `addr` (e.g. `127.0.0.2:40000`: several workers on one port, as
    /// DNS discovery finds them) instead of an ephemeral loopback port.
    pub fn bind(mut self, addr: &str) -> Self {
        self.bind = Some(addr.to_string());
        self
    }

    pub async fn start(self) -> FakeWorker {
        let bind = match &self.bind {
            Some(b) => b.as_str(),
            None if self.ipv6 => "[::1]:0",
            None => "127.0.0.1:0",
        };
        let listener = TcpListener::bind(bind).await.expect("bind mock worker");
        let addr = listener.local_addr().expect("mock worker address");
        let state = Arc::new(State {
            handler: self.handler,
            health: self.health,
            idle_close: self.idle_close,
            stale_after: self.stale_after,
            stale_reset: self.stale_reset,
            stale_hits: AtomicU64::new(0),
            bearer: self.bearer,
            requests: Mutex::new(Vec::new()),
            probes: Mutex::new(Vec::new()),
            writes: Mutex::new(HashMap::new()),
            conns: AtomicU64::new(0),
            open_conns: Mutex::new(Default::default()),
            changed: Notify::new(),
        });
        let task = tokio::spawn(accept_loop(listener, Arc::clone(&state)));
        FakeWorker { addr, state, task }
    }
}

/// A scripted mock replica. Dropping it (or [`FakeWorker::stop`]) closes its port and
/// every connection it holds.
pub struct FakeWorker {
    addr: SocketAddr,
    state: Arc<State>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeWorker {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FakeWorker {
    pub fn builder() -> FakeWorkerBuilder {
        FakeWorkerBuilder {
            handler: Arc::new(|_| Reply::ok()),
            health: Arc::new(|_| Reply::json(200, r#"{"status":"ok"}"#)),
            idle_close: None,
            stale_after: None,
            stale_reset: false,
            bearer: None,
            ipv6: false,
            bind: None,
        }
    }

    /// A worker answering every request with [`Reply::ok`].
    pub async fn start() -> FakeWorker {
        FakeWorker::builder().start().await
    }

    /// A worker answering with `f(request)`.
    pub async fn start_with(f: impl Fn(&Recorded) -> Reply + Send + Sync + 'static) -> Self {
        FakeWorker::builder().reply(f).start().await
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// `http://127.0.0.1:P` or `http://[::1]:P`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every request received so far, in order, health probes excepted.
    pub fn requests(&self) -> Vec<Recorded> {
        self.state.requests.lock().unwrap().clone()
    }

    /// Health probes received so far.
    pub fn probes(&self) -> Vec<Recorded> {
        self.state.probes.lock().unwrap().clone()
    }

    pub fn count(&self) -> usize {
        self.state.requests.lock().unwrap().len()
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.state.conns.load(Ordering::SeqCst)
    }

    /// Connections open now.
    pub fn open_connections(&self) -> usize {
        self.state.open_conns.lock().unwrap().len()
    }

    /// Requests dropped unanswered by [`FakeWorkerBuilder::stale_after`].
    pub fn stale_hits(&self) -> u64 {
        self.state.stale_hits.load(Ordering::SeqCst)
    }

    /// Whether connection `conn` (see [`Recorded::conn`]) is still open.
    pub fn is_open(&self, conn: u64) -> bool {
        self.state.open_conns.lock().unwrap().contains(&conn)
    }

    /// When each body piece of request `index` was written, with its payload.
    pub fn writes(&self, index: usize) -> Vec<(Instant, Vec<u8>)> {
        self.state
            .writes
            .lock()
            .unwrap()
            .get(&index)
            .cloned()
            .unwrap_or_default()
    }

    /// Waits until at least `n` requests were received.
    pub async fn wait_for_requests(&self, n: usize) {
        within(
            &format!("mock worker {} to receive {n} requests", self.addr),
            async {
                loop {
                    let notified = self.state.changed.notified();
                    if self.count() >= n {
                        return;
                    }
                    notified.await;
                }
            },
        )
        .await
    }

    /// Waits until at least `n` health probes were received.
    pub async fn wait_for_probes(&self, n: usize) {
        within(
            &format!("mock worker {} to receive {n} health probes", self.addr),
            async {
                loop {
                    let notified = self.state.changed.notified();
                    if self.probes().len() >= n {
                        return;
                    }
                    notified.await;
                }
            },
        )
        .await
    }

    /// The request carrying header `x-test-tag: tag`, if this worker received it.
    pub fn tagged(&self, tag: &str) -> Option<Recorded> {
        self.requests()
            .into_iter()
            .find(|r| r.header("x-test-tag") == Some(tag))
    }

    /// Closes the port and every connection.
    pub fn stop(self) {}

    /// Dies as a crashed replica does: the port refuses connections and every open
    /// connection is closed, answered or not. What it recorded stays readable. Returns
    /// once a connect to its port is refused.
    pub async fn kill(&self) {
        self.task.abort();
        let addr = self.addr;
        wait_until(
            "the killed worker's port refuses connections",
            STEP_TIMEOUT,
            || async move { TcpStream::connect(addr).await.is_err() },
        )
        .await;
    }
}

async fn accept_loop(listener: TcpListener, state: Arc<State>) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let _ = stream.set_nodelay(true);
                let id = state.conns.fetch_add(1, Ordering::SeqCst) + 1;
                conns.spawn(serve_conn(Arc::clone(&state), stream, id));
            }
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

struct OpenConn<'a>(&'a State, u64);

impl Drop for OpenConn<'_> {
    fn drop(&mut self) {
        self.0.open_conns.lock().unwrap().remove(&self.1);
    }
}

async fn serve_conn(state: Arc<State>, stream: TcpStream, conn: u64) {
    state.open_conns.lock().unwrap().insert(conn);
    let _open = OpenConn(&state, conn);
    let mut wire = Wire::new(stream);
    let mut idle_since: Option<Instant> = None;
    loop {
        let head = match state.idle_close {
            Some(idle) if wire.buf.is_empty() => {
                match tokio::time::timeout(idle, wire.read_head()).await {
                    Ok(h) => h,
                    Err(_) => return, // idle too long: close, as uvicorn does
                }
            }
            _ => wire.read_head().await,
        };
        let Ok(Some(head)) = head else { return };
        if let (Some(after), Some(since)) = (state.stale_after, idle_since)
            && since.elapsed() >= after
        {
            state.stale_hits.fetch_add(1, Ordering::SeqCst);
            if state.stale_reset {
                let _ = wire.stream.set_zero_linger();
            }
            return;
        }
        let Some((method, target, version, headers)) = parse_request_head(&head) else {
            let _ = wire
                .stream
                .write_all(
                    b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                )
                .await;
            return;
        };
        let chunked = header_in(&headers, "transfer-encoding")
            .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
        let body = if chunked {
            wire.read_chunked().await
        } else {
            let n = header_in(&headers, "content-length")
                .and_then(|v| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            wire.read_exact(n).await
        };
        let Ok(body) = body else { return };
        let authorized = match &state.bearer {
            None => true,
            Some(t) => header_in(&headers, "authorization") == Some(format!("Bearer {t}").as_str()),
        };
        let client_close = header_in(&headers, "connection")
            .is_some_and(|v| v.to_ascii_lowercase().contains("close"));
        let is_probe =
            method == "GET" && target.split('?').next().unwrap_or("").ends_with("/health");
        let index;
        let reply = {
            let mut reqs = if is_probe {
                state.probes.lock().unwrap()
            } else {
                state.requests.lock().unwrap()
            };
            index = (!is_probe).then_some(reqs.len());
            let rec = Recorded {
                index: index.unwrap_or(reqs.len()),
                conn,
                method,
                target,
                version,
                headers,
                body,
                chunked,
                authorized,
                at: Instant::now(),
            };
            let reply = if authorized && is_probe {
                (state.health)(&rec)
            } else if authorized {
                (state.handler)(&rec)
            } else {
                Reply::json(
                    401,
                    r#"{"error":{"message":"missing or wrong bearer token","code":401}}"#,
                )
            };
            reqs.push(rec);
            reply
        };
        state.changed.notify_waiters();
        let close = reply.close || client_close;
        if write_reply(&state, &mut wire.stream, index, reply)
            .await
            .is_err()
            || close
        {
            return;
        }
        idle_since = Some(Instant::now());
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        204 => "No Content",
        400 => "Bad Request",
        401 => "Unauthorized",
        404 => "Not Found",
        413 => "Payload Too Large",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Status",
    }
}

async fn write_reply(
    state: &State,
    stream: &mut TcpStream,
    index: Option<usize>,
    reply: Reply,
) -> std::io::Result<()> {
    let note = |data: &[u8]| {
        let Some(index) = index else { return };
        state
            .writes
            .lock()
            .unwrap()
            .entry(index)
            .or_default()
            .push((Instant::now(), data.to_vec()));
    };
    match reply.delay {
        Some(Step::Sleep(d)) => tokio::time::sleep(d).await,
        Some(Step::Wait(g)) => g.wait().await,
        _ => {}
    }
    let mut head = format!("HTTP/1.1 {} {}\r\n", reply.status, reason(reply.status));
    for (k, v) in &reply.headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    match reply.body {
        ReplyBody::Full(body) => {
            head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
            let mut out = head.into_bytes();
            out.extend_from_slice(&body);
            stream.write_all(&out).await?;
            note(&body);
        }
        ReplyBody::Chunked(steps) => {
            head.push_str("Transfer-Encoding: chunked\r\n\r\n");
            stream.write_all(head.as_bytes()).await?;
            for step in steps {
                match step {
                    Step::Write(data) => {
                        if data.is_empty() {
                            continue; // an empty chunk would end the body
                        }
                        let mut out = format!("{:x}\r\n", data.len()).into_bytes();
                        out.extend_from_slice(&data);
                        out.extend_from_slice(b"\r\n");
                        stream.write_all(&out).await?;
                        note(&data);
                    }
                    Step::Sleep(d) => tokio::time::sleep(d).await,
                    Step::Wait(g) => g.wait().await,
                    Step::EchoWebSocket => {}
                }
            }
            stream.write_all(b"0\r\n\r\n").await?;
        }
        ReplyBody::Trickle(steps) => {
            let total: usize = steps
                .iter()
                .map(|s| match s {
                    Step::Write(d) => d.len(),
                    _ => 0,
                })
                .sum();
            head.push_str(&format!("Content-Length: {total}\r\n\r\n"));
            stream.write_all(head.as_bytes()).await?;
            write_steps(stream, steps, &note).await?;
        }
        ReplyBody::Raw(steps) => {
            write_steps(stream, steps, &note).await?;
        }
    }
    stream.flush().await
}

async fn write_steps(
    stream: &mut TcpStream,
    steps: Vec<Step>,
    note: &impl Fn(&[u8]),
) -> std::io::Result<()> {
    for step in steps {
        match step {
            Step::Write(data) => {
                stream.write_all(&data).await?;
                note(&data);
            }
            Step::Sleep(d) => tokio::time::sleep(d).await,
            Step::Wait(g) => g.wait().await,
            Step::EchoWebSocket => ws::echo_frames(stream).await?,
        }
    }
    Ok(())
}

type RequestHead = (String, String, String, Vec<(String, String)>);

fn parse_request_head(head: &[u8]) -> Option<RequestHead> {
    let text = std::str::from_utf8(head).ok()?;
    let mut lines = text.split("\r\n");
    let mut first = lines.next()?.splitn(3, ' ');
    let method = first.next()?.to_string();
    let target = first.next()?.to_string();
    let version = first.next()?.to_string();
    let headers = parse_header_lines(lines)?;
    Some((method, target, version, headers))
}

fn parse_header_lines<'a>(lines: impl Iterator<Item = &'a str>) -> Option<Vec<(String, String)>> {
    let mut headers = Vec::new();
    for line in lines {
        if line.is_empty() {
            continue;
        }
        let (k, v) = line.split_once(':')?;
        headers.push((k.to_string(), v.trim_matches([' ', '\t']).to_string()));
    }
    Some(headers)
}

// ---------------------------------------------------------------------------------
// Wire: buffered reads over a TCP stream, shared by the mock worker and the client.

struct Wire<S = TcpStream> {
    stream: S,
    buf: BytesMut,
}

impl<S: AsyncRead + Unpin> Wire<S> {
    fn new(stream: S) -> Self {
        Wire {
            stream,
            buf: BytesMut::with_capacity(64 * 1024),
        }
    }

    /// Reads more bytes into the buffer; `Ok(0)` at end of stream.
    async fn fill(&mut self) -> std::io::Result<usize> {
        if self.buf.capacity() - self.buf.len() < 16 * 1024 {
            self.buf.reserve(64 * 1024);
        }
        self.stream.read_buf(&mut self.buf).await
    }

    /// The bytes up to and including the blank line ending a head; `None` on a clean EOF
    /// before any byte.
    async fn read_head(&mut self) -> std::io::Result<Option<Vec<u8>>> {
        loop {
            if let Some(i) = find(&self.buf, b"\r\n\r\n") {
                return Ok(Some(self.buf.split_to(i + 4).to_vec()));
            }
            if self.fill().await? == 0 {
                if self.buf.is_empty() {
                    return Ok(None);
                }
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
        }
    }

    async fn read_line(&mut self) -> std::io::Result<Vec<u8>> {
        loop {
            if let Some(i) = find(&self.buf, b"\r\n") {
                let line = self.buf.split_to(i + 2);
                return Ok(line[..i].to_vec());
            }
            if self.fill().await? == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
        }
    }

    async fn read_exact(&mut self, n: usize) -> std::io::Result<Vec<u8>> {
        while self.buf.len() < n {
            if self.fill().await? == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
        }
        Ok(self.buf.split_to(n).to_vec())
    }

    async fn read_chunked(&mut self) -> std::io::Result<Vec<u8>> {
        let mut out = Vec::new();
        loop {
            let line = self.read_line().await?;
            let size = chunk_size(&line)?;
            if size == 0 {
                // Trailers, then the blank line.
                while !self.read_line().await?.is_empty() {}
                return Ok(out);
            }
            out.extend_from_slice(&self.read_exact(size).await?);
            if !self.read_line().await?.is_empty() {
                return Err(std::io::Error::other("chunk not followed by CRLF"));
            }
        }
    }
}

fn chunk_size(line: &[u8]) -> std::io::Result<usize> {
    let text = std::str::from_utf8(line).map_err(std::io::Error::other)?;
    let hex = text.split(';').next().unwrap_or("").trim();
    usize::from_str_radix(hex, 16)
        .map_err(|e| std::io::Error::other(format!("bad chunk size {text:?}: {e}")))
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

// ---------------------------------------------------------------------------------
// Client

/// A request to send with [`Conn`].
#[derive(Clone, Debug)]
pub struct Req {
    pub method: String,
    pub target: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// Send the body chunked (pieces of this size) instead of with `Content-Length`.
    pub chunked: Option<usize>,
}

impl Req {
    pub fn new(method: &str, target: &str) -> Self {
        Req {
            method: method.to_string(),
            target: target.to_string(),
            headers: Vec::new(),
            body: Vec::new(),
            chunked: None,
        }
    }

    pub fn get(target: &str) -> Self {
        Req::new("GET", target)
    }

    /// A POST with a JSON body.
    pub fn post(target: &str, body: impl Into<Vec<u8>>) -> Self {
        Req::new("POST", target)
            .header("Content-Type", "application/json")
            .body(body)
    }

    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.to_string(), value.to_string()));
        self
    }

    pub fn body(mut self, body: impl Into<Vec<u8>>) -> Self {
        self.body = body.into();
        self
    }

    pub fn chunked(mut self, piece: usize) -> Self {
        self.chunked = Some(piece);
        self
    }

    /// The bytes on the wire. Adds `Host` and the framing header unless already given.
    pub fn to_bytes(&self, host: SocketAddr) -> Vec<u8> {
        let mut out = format!("{} {} HTTP/1.1\r\n", self.method, self.target).into_bytes();
        let has = |n: &str| self.headers.iter().any(|(k, _)| k.eq_ignore_ascii_case(n));
        if !has("host") {
            out.extend_from_slice(format!("Host: {host}\r\n").as_bytes());
        }
        for (k, v) in &self.headers {
            out.extend_from_slice(format!("{k}: {v}\r\n").as_bytes());
        }
        match self.chunked {
            Some(piece) => {
                out.extend_from_slice(b"Transfer-Encoding: chunked\r\n\r\n");
                for part in self.body.chunks(piece.max(1)) {
                    out.extend_from_slice(format!("{:x}\r\n", part.len()).as_bytes());
                    out.extend_from_slice(part);
                    out.extend_from_slice(b"\r\n");
                }
                out.extend_from_slice(b"0\r\n\r\n");
            }
            None => {
                let needs_length = !self.body.is_empty()
                    || matches!(self.method.as_str(), "POST" | "PUT" | "PATCH");
                if needs_length && !has("content-length") {
                    out.extend_from_slice(
                        format!("Content-Length: {}\r\n", self.body.len()).as_bytes(),
                    );
                }
                out.extend_from_slice(b"\r\n");
                out.extend_from_slice(&self.body);
            }
        }
        out
    }
}

/// A response head exactly as received.
#[derive(Debug, Clone)]
pub struct Head {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub at: Instant,
}

impl Head {
    pub fn header(&self, name: &str) -> Option<&str> {
        header_in(&self.headers, name)
    }

    pub fn header_all(&self, name: &str) -> Vec<&str> {
        header_all_in(&self.headers, name)
    }

    pub fn has_header(&self, name: &str) -> bool {
        self.header(name).is_some()
    }
}

/// A whole response, with when each body piece arrived.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// When the request was written.
    pub sent_at: Instant,
    /// When the head was complete.
    pub head_at: Instant,
    /// Each decoded body piece: arrival time and length.
    pub pieces: Vec<(Instant, usize)>,
    /// When the body was complete.
    pub done_at: Instant,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        header_in(&self.headers, name)
    }

    pub fn header_all(&self, name: &str) -> Vec<&str> {
        header_all_in(&self.headers, name)
    }

    pub fn has_header(&self, name: &str) -> bool {
        self.header(name).is_some()
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body as JSON; panics with the body when it is not.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "status {} body is not JSON ({e}): {:?}",
                self.status,
                self.text()
            )
        })
    }
}

#[derive(Debug, Clone, Copy)]
enum Framing {
    Length(usize),
    /// Remaining bytes of the current chunk (0: a size line comes next).
    Chunked(usize),
    Eof,
    Done,
}

/// One client connection (keep-alive across requests). `S` is the stream, or only its
/// read half when another task writes (see [`send_while_reading`]).
pub struct Conn<S = TcpStream> {
    wire: Wire<S>,
    peer: SocketAddr,
    framing: Framing,
    sent_at: Instant,
}

impl Conn {
    pub async fn connect(addr: SocketAddr) -> Conn {
        let stream = within(&format!("connect to {addr}"), TcpStream::connect(addr))
            .await
            .unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
        let _ = stream.set_nodelay(true);
        Conn {
            wire: Wire::new(stream),
            peer: addr,
            framing: Framing::Done,
            sent_at: Instant::now(),
        }
    }

    /// Writes `req` (does not read).
    pub async fn send(&mut self, req: &Req) -> std::io::Result<()> {
        let bytes = req.to_bytes(self.peer);
        self.sent_at = Instant::now();
        self.wire.stream.write_all(&bytes).await
    }

    /// Writes raw bytes.
    pub async fn write_raw(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.sent_at = Instant::now();
        self.wire.stream.write_all(bytes).await
    }

    /// Sends `req` and reads the whole response.
    pub async fn request(&mut self, req: &Req) -> Response {
        self.send(req).await.expect("write request");
        self.read_response().await
    }
}

impl<S: AsyncRead + Unpin> Conn<S> {
    /// Reads a response head and sets up body framing (panics on EOF or timeout).
    pub async fn read_head(&mut self) -> Head {
        let raw = within("response head", self.wire.read_head())
            .await
            .expect("read response head")
            .expect("connection closed before a response head");
        let at = Instant::now();
        let text = String::from_utf8_lossy(&raw).into_owned();
        let mut lines = text.split("\r\n");
        let status_line = lines.next().unwrap_or("");
        let status: u16 = status_line
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
        let headers = parse_header_lines(lines).expect("response header lines");
        let te = header_in(&headers, "transfer-encoding")
            .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
        let cl = header_in(&headers, "content-length").and_then(|v| v.trim().parse().ok());
        self.framing = if matches!(status, 204 | 304) || (100..200).contains(&status) {
            Framing::Done
        } else if te {
            Framing::Chunked(0)
        } else if let Some(n) = cl {
            if n == 0 {
                Framing::Done
            } else {
                Framing::Length(n)
            }
        } else {
            Framing::Eof
        };
        Head {
            status,
            headers,
            at,
        }
    }

    /// The next decoded body bytes as soon as some arrive; `None` at the end of the
    /// body. Panics on a framing error or when nothing arrives within [`STEP_TIMEOUT`].
    pub async fn next_piece(&mut self) -> Option<Vec<u8>> {
        within("next response body piece", self.try_next_piece())
            .await
            .unwrap_or_else(|e| panic!("reading the response body: {e}"))
    }

    /// As [`Conn::next_piece`], returning I/O and framing errors instead of panicking.
    pub async fn try_next_piece(&mut self) -> std::io::Result<Option<Vec<u8>>> {
        loop {
            match self.framing {
                Framing::Done => return Ok(None),
                Framing::Length(remaining) => {
                    if self.wire.buf.is_empty() && self.wire.fill().await? == 0 {
                        return Err(std::io::ErrorKind::UnexpectedEof.into());
                    }
                    let n = remaining.min(self.wire.buf.len());
                    let out = self.wire.buf.split_to(n).to_vec();
                    self.framing = if n == remaining {
                        Framing::Done
                    } else {
                        Framing::Length(remaining - n)
                    };
                    return Ok(Some(out));
                }
                Framing::Chunked(0) => {
                    let line = self.wire.read_line().await?;
                    let size = chunk_size(&line)?;
                    if size == 0 {
                        while !self.wire.read_line().await?.is_empty() {}
                        self.framing = Framing::Done;
                        return Ok(None);
                    }
                    self.framing = Framing::Chunked(size);
                }
                Framing::Chunked(remaining) => {
                    if self.wire.buf.is_empty() && self.wire.fill().await? == 0 {
                        return Err(std::io::ErrorKind::UnexpectedEof.into());
                    }
                    let n = remaining.min(self.wire.buf.len());
                    let out = self.wire.buf.split_to(n).to_vec();
                    if n == remaining {
                        let crlf = self.wire.read_line().await?;
                        if !crlf.is_empty() {
                            return Err(std::io::Error::other("chunk not followed by CRLF"));
                        }
                        self.framing = Framing::Chunked(0);
                    } else {
                        self.framing = Framing::Chunked(remaining - n);
                    }
                    return Ok(Some(out));
                }
                Framing::Eof => {
                    if !self.wire.buf.is_empty() {
                        let n = self.wire.buf.len();
                        return Ok(Some(self.wire.buf.split_to(n).to_vec()));
                    }
                    if self.wire.fill().await? == 0 {
                        self.framing = Framing::Done;
                        return Ok(None);
                    }
                }
            }
        }
    }

    /// Reads the rest of the body (after [`Conn::read_head`]) to its end.
    pub async fn read_rest(&mut self) -> Vec<u8> {
        let mut body = Vec::new();
        while let Some(p) = self.next_piece().await {
            body.extend_from_slice(&p);
        }
        body
    }

    /// Reads a whole response (head and body).
    pub async fn read_response(&mut self) -> Response {
        let head = self.read_head().await;
        let mut body = Vec::new();
        let mut pieces = Vec::new();
        while let Some(p) = self.next_piece().await {
            pieces.push((Instant::now(), p.len()));
            body.extend_from_slice(&p);
        }
        Response {
            status: head.status,
            headers: head.headers,
            body,
            sent_at: self.sent_at,
            head_at: head.at,
            pieces,
            done_at: Instant::now(),
        }
    }

    /// Whether the peer closed the connection (EOF within `wait`).
    pub async fn is_closed_by_peer(&mut self, wait: Duration) -> bool {
        matches!(
            tokio::time::timeout(wait, self.wire.fill()).await,
            Ok(Ok(0)) | Ok(Err(_))
        )
    }
}

/// Sends `req` on a fresh connection, writing from another task while the response is
/// read (a router may answer before reading a large body). Returns the response and
/// how the write ended (a router that refuses a body may stop reading it).
pub async fn send_while_reading(addr: SocketAddr, req: &Req) -> (Response, std::io::Result<()>) {
    let conn = Conn::connect(addr).await;
    let bytes = req.to_bytes(addr);
    let (read, mut write) = conn.wire.stream.into_split();
    let writer = tokio::spawn(async move {
        write.write_all(&bytes).await?;
        // Keep the write half open until the response is read.
        Ok::<_, std::io::Error>(write)
    });
    let mut reader = Conn {
        wire: Wire::new(read),
        peer: addr,
        framing: Framing::Done,
        sent_at: Instant::now(),
    };
    let resp = reader.read_response().await;
    let abort = writer.abort_handle();
    let written = match tokio::time::timeout(Duration::from_secs(1), writer).await {
        Ok(joined) => joined.expect("writer task").map(drop),
        Err(_) => {
            abort.abort();
            Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the peer stopped reading the request",
            ))
        }
    };
    (resp, written)
}

/// Sends `req` on a fresh connection and reads the whole response.
pub async fn send(addr: SocketAddr, req: &Req) -> Response {
    Conn::connect(addr).await.request(req).await
}

/// `POST path` with a JSON body on a fresh connection.
pub async fn post(addr: SocketAddr, path: &str, body: impl Into<Vec<u8>>) -> Response {
    send(addr, &Req::post(path, body)).await
}

/// A non-streamed chat request with `text` as its one user message, on a fresh
/// connection.
pub async fn chat(addr: SocketAddr, text: &str) -> Response {
    post(addr, "/v1/chat/completions", chat_body(text, false)).await
}

/// `n` non-streamed chat requests at once, each on its own connection (`"{text} {i}"`);
/// asserts each is answered 200 within [`STEP_TIMEOUT`].
pub async fn concurrent_chats(addr: SocketAddr, text: &str, n: usize) {
    let all: Vec<_> = (0..n)
        .map(|i| {
            let text = format!("{text} {i}");
            tokio::spawn(async move { chat(addr, &text).await })
        })
        .collect();
    for one in all {
        assert_eq!(within(text, one).await.unwrap().status, 200);
    }
}

/// `GET path` on a fresh connection.
pub async fn get(addr: SocketAddr, path: &str) -> Response {
    send(addr, &Req::get(path)).await
}

// ---------------------------------------------------------------------------------
// Router

/// Starts a router in-process from YAML text (file name `test.yaml`) on 127.0.0.1:0.
pub async fn start_router(yaml: &str) -> RunningRouter {
    start_router_on(yaml, None).await
}

/// As [`start_router`], its client connections on `cores` (thread per core, as the
/// binary serves them) when given.
pub async fn start_router_on(
    yaml: &str,
    cores: Option<std::sync::Arc<cache_aware_router::cores::Cores>>,
) -> RunningRouter {
    let config = Config::from_sources([(Path::new("test.yaml"), yaml)])
        .unwrap_or_else(|e| panic!("test config refused: {e}\n{yaml}"));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind router");
    app::spawn_on(config, listener, cores).expect("spawn router")
}

/// YAML: `extra` (top-level keys) followed by a `workers:` list of `urls`.
pub fn yaml_for_urls(urls: &[String], extra: &str) -> String {
    let mut y = String::from(extra);
    if !y.is_empty() && !y.ends_with('\n') {
        y.push('\n');
    }
    y.push_str("workers:\n");
    for u in urls {
        y.push_str(&format!("  - url: \"{u}\"\n"));
    }
    y
}

/// YAML: `extra` followed by the workers' URLs.
pub fn yaml_for(workers: &[&FakeWorker], extra: &str) -> String {
    let urls: Vec<String> = workers.iter().map(|w| w.url()).collect();
    yaml_for_urls(&urls, extra)
}

/// `GET /workers`, asserting 200 and JSON.
pub async fn get_workers(addr: SocketAddr) -> serde_json::Value {
    let r = get(addr, "/workers").await;
    assert_eq!(r.status, 200, "GET /workers: {}", r.text());
    r.json()
}

/// The workers' URLs, in `/workers` order.
pub async fn worker_urls(addr: SocketAddr) -> Vec<String> {
    get_workers(addr).await["workers"]
        .as_array()
        .expect("workers array")
        .iter()
        .map(|w| w["url"].as_str().expect("url").to_string())
        .collect()
}

/// Sends a non-streamed chat request with `prompt` in a task of its own (one the test
/// holds at the worker, say) and hands back its response when it ends.
pub fn spawn_chat(addr: SocketAddr, prompt: String) -> tokio::task::JoinHandle<Response> {
    tokio::spawn(async move {
        send(
            addr,
            &Req::post("/v1/chat/completions", chat_body(&prompt, false)),
        )
        .await
    })
}

/// Two workers on one port, as discovery finds a Deployment's pods: `a` on 127.0.0.2
/// (holds any request whose body says `hold` until `gate` opens), `b` on 127.0.0.3.
pub async fn workers_on_one_port(gate: &Gate) -> (FakeWorker, FakeWorker) {
    let held = gate.clone();
    let a = FakeWorker::builder()
        .bind("127.0.0.2:0")
        .reply(move |r| {
            if r.body_str().contains("hold") {
                Reply::ok().after_gate(&held)
            } else {
                Reply::ok()
            }
        })
        .start()
        .await;
    let b = FakeWorker::builder()
        .bind(&format!("127.0.0.3:{}", a.port()))
        .start()
        .await;
    (a, b)
}

/// In-flight count per worker, in `/workers` order.
pub async fn in_flight(addr: SocketAddr) -> Vec<u64> {
    get_workers(addr).await["workers"]
        .as_array()
        .expect("workers array")
        .iter()
        .map(|w| w["in_flight"].as_u64().expect("in_flight number"))
        .collect()
}

/// Waits until every worker's in-flight count is 0.
pub async fn wait_all_idle(addr: SocketAddr, limit: Duration) {
    wait_until("every in_flight back to 0", limit, || async {
        in_flight(addr).await.iter().all(|n| *n == 0)
    })
    .await
}

/// A URL whose port refuses connections (bound, then closed).
pub fn closed_port_url() -> String {
    let [url] = closed_port_urls::<1>();
    url
}

/// `N` distinct such URLs: every port is held until all are bound (ports bound and
/// closed one after the other can come back equal, and two workers with one URL are
/// one worker).
pub fn closed_port_urls<const N: usize>() -> [String; N] {
    let held: Vec<std::net::TcpListener> = (0..N)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("bind"))
        .collect();
    std::array::from_fn(|i| {
        format!(
            "http://127.0.0.1:{}",
            held[i].local_addr().expect("addr").port()
        )
    })
}

/// A chat completions body with one user message.
pub fn chat_body(prompt: &str, stream: bool) -> String {
    serde_json::json!({
        "model": "m",
        "stream": stream,
        "messages": [{"role": "user", "content": prompt}],
    })
    .to_string()
}

static TAGS: AtomicU64 = AtomicU64::new(0);

/// A unique value for the `x-test-tag` header.
pub fn new_tag() -> String {
    format!("t{}", TAGS.fetch_add(1, Ordering::SeqCst))
}

/// Sends `req` tagged with a unique `x-test-tag`; returns the response and the index of
/// the one worker that received it (panics unless exactly one did).
pub async fn send_tagged(addr: SocketAddr, workers: &[&FakeWorker], req: Req) -> (Response, usize) {
    let tag = new_tag();
    let resp = send(addr, &req.header("x-test-tag", &tag)).await;
    (resp, served_by(workers, &tag))
}

/// Index of the one worker that received the request tagged `tag`.
pub fn served_by(workers: &[&FakeWorker], tag: &str) -> usize {
    let hits: Vec<usize> = workers
        .iter()
        .enumerate()
        .filter(|(_, w)| w.tagged(tag).is_some())
        .map(|(i, _)| i)
        .collect();
    assert_eq!(
        hits.len(),
        1,
        "request {tag} should be received by exactly one worker, got {hits:?}"
    );
    hits[0]
}

/// A temporary file removed on drop.
pub struct TempFile {
    pub path: PathBuf,
}

impl TempFile {
    pub fn new(name: &str, contents: &str) -> TempFile {
        static N: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "car-tests-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join(name);
        std::fs::write(&path, contents).expect("write temp file");
        TempFile { path }
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        if let Some(dir) = self.path.parent() {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// Checks that every byte the mock wrote reached the client within `tolerance`: for
/// each write, the first client-side arrival that completes the bytes written so far.
pub fn assert_relayed_promptly(
    writes: &[(Instant, Vec<u8>)],
    arrivals: &[(Instant, usize)],
    tolerance: Duration,
) {
    assert!(!writes.is_empty(), "the mock wrote nothing");
    let mut written = 0usize;
    for (i, (at, data)) in writes.iter().enumerate() {
        written += data.len();
        let mut got = 0usize;
        let arrived = arrivals
            .iter()
            .find(|(_, n)| {
                got += n;
                got >= written
            })
            .map(|(t, _)| *t)
            .unwrap_or_else(|| {
                panic!("write {i} ({written} bytes so far) never reached the client")
            });
        let delay = arrived.saturating_duration_since(*at);
        assert!(
            delay <= tolerance,
            "write {i} reached the client {delay:?} after the worker wrote it (limit {tolerance:?})"
        );
    }
}

// ---------------------------------------------------------------------------------
// Metrics

/// One sample of a `GET /metrics` scrape.
#[derive(Debug, Clone)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

/// A parsed `GET /metrics` answer (Prometheus text format).
#[derive(Debug, Clone)]
pub struct Scrape {
    pub samples: Vec<Sample>,
    pub text: String,
}

impl Scrape {
    /// Parses Prometheus text exposition; panics on a line it cannot read.
    pub fn parse(text: &str) -> Scrape {
        let samples = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(|l| parse_sample(l).unwrap_or_else(|| panic!("bad metrics line {l:?}")))
            .collect();
        Scrape {
            samples,
            text: text.to_string(),
        }
    }

    /// The sample `name` with exactly the labels `labels` (any order), if exposed.
    pub fn get(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.samples
            .iter()
            .find(|s| {
                s.name == name
                    && s.labels.len() == labels.len()
                    && labels
                        .iter()
                        .all(|(k, v)| s.labels.iter().any(|(k2, v2)| k2 == k && v2 == v))
            })
            .map(|s| s.value)
    }

    /// As [`Scrape::get`], reading an unexposed series as 0 (a labelled counter appears
    /// only once it was first incremented).
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.get(name, labels).unwrap_or(0.0)
    }

    /// Every sample named `name`.
    pub fn all(&self, name: &str) -> Vec<&Sample> {
        self.samples.iter().filter(|s| s.name == name).collect()
    }
}

/// `name{k="v",…} value [timestamp]` or `name value [timestamp]`.
fn parse_sample(line: &str) -> Option<Sample> {
    let name_end = line.find(['{', ' '])?;
    let name = line[..name_end].to_string();
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(mut inner) = rest.strip_prefix('{') {
        loop {
            inner = inner.trim_start_matches(',');
            if let Some(after) = inner.strip_prefix('}') {
                rest = after;
                break;
            }
            let (key, quoted) = inner.split_once("=\"")?;
            let mut value = String::new();
            let mut chars = quoted.char_indices();
            let end = loop {
                match chars.next()? {
                    (i, '"') => break i,
                    (_, '\\') => match chars.next()?.1 {
                        'n' => value.push('\n'),
                        escaped => value.push(escaped),
                    },
                    (_, c) => value.push(c),
                }
            };
            labels.push((key.to_string(), value));
            inner = &quoted[end + 1..];
        }
    }
    let value = rest.split_whitespace().next()?.parse().ok()?;
    Some(Sample {
        name,
        labels,
        value,
    })
}

/// `GET /metrics`, asserting 200, parsed.
pub async fn scrape(addr: SocketAddr) -> Scrape {
    let r = get(addr, "/metrics").await;
    assert_eq!(r.status, 200, "GET /metrics: {}", r.text());
    Scrape::parse(&r.text())
}

/// The URL of worker `i` as `/workers` lists it (the `worker` label of metrics).
pub async fn worker_label(addr: SocketAddr, i: usize) -> String {
    get_workers(addr).await["workers"][i]["url"]
        .as_str()
        .expect("worker url")
        .to_string()
}

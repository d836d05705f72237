//! The mock worker: a scripted, deterministic replica on a raw TCP listener with a small
//! HTTP/1.1 parser. It records every request (request line, headers, body, the
//! connection it came on) and answers as scripted: status, headers and body; chunked
//! bodies written piece by piece with delays or gates (SSE); a `Content-Length` body
//! trickled over time; exact raw bytes (malformed framing); a delay or gate before the
//! head; closing idle keep-alive connections; requiring a bearer token. It can be killed
//! mid-run ([`FakeWorker::kill`]) and still be asked what it received.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;

use crate::wait::{STEP_TIMEOUT, wait_until, within};
use crate::wire::{Wire, header_all_in, header_in, parse_request_head};
use crate::ws;

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
    /// Close the connection at once, mid-body (no last chunk): an engine that crashed.
    Die,
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
type Handler = Arc<dyn Fn(&Recorded) -> Reply + Send + Sync>;

/// When a body piece was written, and its bytes.
pub type Written = (Instant, Vec<u8>);

struct State {
    handler: Handler,
    health: Handler,
    /// Answers `GET …/v1/models` (the router's list reads, and clients' requests it
    /// forwards); `listing`, when set, first.
    models: Handler,
    /// The model list it answers now (see [`FakeWorker::serve_models`]).
    listing: Mutex<Option<String>>,
    /// `GET …/v1/models` requests, kept apart from `requests`.
    model_reads: Mutex<Vec<Recorded>>,
    /// Loads LoRA adapters at `POST …/load_lora_adapter` (see
    /// [`FakeWorkerBuilder::lora_loads`]), each held until the gate opens.
    lora_loads: Option<Gate>,
    /// Those loads, kept apart from `requests`.
    loads: Mutex<Vec<Recorded>>,
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
    open_conns: Mutex<HashSet<u64>>,
    changed: Notify,
}

/// Builder for a [`FakeWorker`].
pub struct FakeWorkerBuilder {
    handler: Handler,
    health: Handler,
    models: Handler,
    listing: Option<String>,
    lora_loads: Option<Gate>,
    idle_close: Option<Duration>,
    stale_after: Option<Duration>,
    stale_reset: bool,
    bearer: Option<String>,
    ipv6: bool,
    bind: Option<String>,
}

impl FakeWorkerBuilder {
    /// Loads LoRA adapters as vLLM (`POST /v1/load_lora_adapter`) and SGLang
    /// (`POST /load_lora_adapter`) do, answering once `gate` opens (open it at once for
    /// no wait): `{"lora_name": N, "lora_path": P}` adds `N@<first listed model>` to
    /// its model list and answers 200 (400 "already been loaded" for a name it lists;
    /// 404 for a path containing `missing`). Loads are kept apart ([`FakeWorker::loads`]).
    pub fn lora_loads(mut self, gate: &Gate) -> Self {
        self.lora_loads = Some(gate.clone());
        self
    }

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

    /// Answers `GET …/v1/models` with `f(request)` instead of [`Reply::ok`] (an answer
    /// that is no model list: the router then treats the worker as serving any model).
    pub fn models(mut self, f: impl Fn(&Recorded) -> Reply + Send + Sync + 'static) -> Self {
        self.models = Arc::new(f);
        self
    }

    /// Lists these served names (and adapters) at `GET /v1/models`, as vLLM does: see
    /// [`model_list`].
    pub fn serving(mut self, models: &[&str]) -> Self {
        self.listing = Some(model_list(models));
        self
    }

    /// Answers `GET /v1/models` with this list body (any shape: an SGLang one, say).
    pub fn listing(mut self, body: &str) -> Self {
        self.listing = Some(body.to_string());
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
            models: self.models,
            listing: Mutex::new(self.listing),
            model_reads: Mutex::new(Vec::new()),
            lora_loads: self.lora_loads,
            loads: Mutex::new(Vec::new()),
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

/// A scripted mock replica. Dropping it closes its port and
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
            models: Arc::new(|_| Reply::ok()),
            listing: None,
            lora_loads: None,
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

    /// `GET …/v1/models` requests received so far (the router's list reads).
    pub fn model_reads(&self) -> Vec<Recorded> {
        self.state.model_reads.lock().unwrap().clone()
    }

    /// The adapter loads received so far (with [`FakeWorkerBuilder::lora_loads`]).
    pub fn loads(&self) -> Vec<Recorded> {
        self.state.loads.lock().unwrap().clone()
    }

    /// From now on lists these names at `GET /v1/models` (see [`model_list`]); `None`:
    /// answers as the builder said.
    pub fn serve_models(&self, models: Option<&[&str]>) {
        *self.state.listing.lock().unwrap() = models.map(model_list);
    }

    /// Waits until at least `n` model-list reads were received.
    pub async fn wait_for_model_reads(&self, n: usize) {
        within(
            &format!("mock worker {} to receive {n} model-list reads", self.addr),
            async {
                loop {
                    let notified = self.state.changed.notified();
                    if self.model_reads().len() >= n {
                        return;
                    }
                    notified.await;
                }
            },
        )
        .await
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
        let Some((method, target, headers)) = parse_request_head(&head) else {
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
        let path = target.split('?').next().unwrap_or("");
        let is_probe = method == "GET" && path.ends_with("/health");
        let is_list = method == "GET" && path.ends_with("/v1/models");
        let is_load =
            state.lora_loads.is_some() && method == "POST" && path.ends_with("/load_lora_adapter");
        let index;
        let reply = {
            let mut reqs = if is_probe {
                state.probes.lock().unwrap()
            } else if is_list {
                state.model_reads.lock().unwrap()
            } else if is_load {
                state.loads.lock().unwrap()
            } else {
                state.requests.lock().unwrap()
            };
            index = (!is_probe && !is_list && !is_load).then_some(reqs.len());
            let rec = Recorded {
                index: index.unwrap_or(reqs.len()),
                conn,
                method,
                target,
                headers,
                body,
                chunked,
                authorized,
                at: Instant::now(),
            };
            let listing = state.listing.lock().unwrap().clone();
            let reply = if authorized && is_probe {
                (state.health)(&rec)
            } else if authorized && is_list {
                match listing {
                    Some(body) => Reply::json(200, &body),
                    None => (state.models)(&rec),
                }
            } else if authorized && is_load {
                load_adapter(&state, &rec)
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
        Some(Step::Sleep(d)) => unless_closed(stream, tokio::time::sleep(d)).await?,
        Some(Step::Wait(g)) => unless_closed(stream, g.wait()).await?,
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
                    Step::Sleep(d) => unless_closed(stream, tokio::time::sleep(d)).await?,
                    Step::Wait(g) => unless_closed(stream, g.wait()).await?,
                    Step::EchoWebSocket => {}
                    Step::Die => return Err(std::io::Error::other("the engine died")),
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
            Step::Die => return Err(std::io::Error::other("the engine died")),
        }
    }
    Ok(())
}

/// Waits for `wait`, unless the client closes the connection first (an error then, and
/// the connection is dropped): an engine notices a client that left and stops, as
/// vLLM aborts the request.
async fn unless_closed(
    stream: &mut TcpStream,
    wait: impl std::future::Future<Output = ()>,
) -> std::io::Result<()> {
    tokio::pin!(wait);
    let mut byte = [0u8; 1];
    tokio::select! {
        _ = &mut wait => Ok(()),
        read = stream.read(&mut byte) => match read {
            Ok(0) | Err(_) => Err(std::io::Error::other("the client closed the connection")),
            Ok(_) => {
                wait.await;
                Ok(())
            }
        },
    }
}

/// A load of a LoRA adapter (see [`FakeWorkerBuilder::lora_loads`]).
fn load_adapter(state: &State, rec: &Recorded) -> Reply {
    let gate = state.lora_loads.clone().unwrap_or_default();
    let asked: serde_json::Value = serde_json::from_slice(&rec.body).unwrap_or_default();
    let (Some(name), Some(path)) = (asked["lora_name"].as_str(), asked["lora_path"].as_str())
    else {
        return Reply::json(
            400,
            r#"{"error":{"message":"lora_name and lora_path","code":400}}"#,
        );
    };
    if path.contains("missing") {
        return Reply::json(
            404,
            &format!(
                r#"{{"error":{{"message":"Loading lora {name} failed: No adapter found for {path}","type":"NotFoundError","code":404}}}}"#
            ),
        )
        .after_gate(&gate);
    }
    let mut listing = state.listing.lock().unwrap();
    let mut list: serde_json::Value = listing
        .as_deref()
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| serde_json::json!({"object": "list", "data": []}));
    let data = list["data"].as_array_mut().expect("a model list");
    if data.iter().any(|m| m["id"] == name) {
        return Reply::json(
            400,
            &format!(
                r#"{{"error":{{"message":"The lora adapter '{name}' has already been loaded.","type":"InvalidUserInput","code":400}}}}"#
            ),
        );
    }
    let base = data
        .first()
        .and_then(|m| m["id"].as_str())
        .unwrap_or("base")
        .to_string();
    let owner = data
        .first()
        .map_or("vllm".into(), |m| m["owned_by"].clone());
    data.push(
        serde_json::json!({"id": name, "object": "model", "owned_by": owner,
        "root": path, "parent": base}),
    );
    *listing = Some(list.to_string());
    Reply::status(200)
        .header("Content-Type", "text/plain")
        .body(format!("Success: LoRA adapter '{name}' added successfully.").into_bytes())
        .after_gate(&gate)
}

/// A `GET /v1/models` answer as vLLM gives it: one entry per name, each its own model
/// (`root` = its name) unless written `alias=base` (a second served name of `base`:
/// the same `root`), or `adapter@base` (a LoRA adapter of `base`: `parent`).
pub fn model_list(models: &[&str]) -> String {
    let data: Vec<serde_json::Value> = models
        .iter()
        .map(|m| {
            let (id, root, parent) = if let Some((a, base)) = m.split_once('@') {
                (a, format!("/adapters/{a}"), Some(base))
            } else if let Some((a, base)) = m.split_once('=') {
                (a, format!("/models/{base}"), None)
            } else {
                (*m, format!("/models/{m}"), None)
            };
            serde_json::json!({"id": id, "object": "model", "created": 1, "owned_by": "vllm",
                "root": root, "parent": parent, "max_model_len": 4096})
        })
        .collect();
    serde_json::json!({"object": "list", "data": data}).to_string()
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

/// A worker that reads a request and never answers, telling when the router closed
/// the connection (its `GET`s, health probes, are answered 200); returns its URL.
pub async fn silent_worker() -> (String, tokio::sync::mpsc::UnboundedReceiver<Instant>) {
    use tokio::io::AsyncReadExt;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 1 << 16];
                let mut seen = Vec::new();
                loop {
                    let n = s.read(&mut buf).await.unwrap_or(0);
                    if n == 0 {
                        if !seen.starts_with(b"GET") && !seen.is_empty() {
                            let _ = tx.send(Instant::now());
                        }
                        return;
                    }
                    seen.extend_from_slice(&buf[..n]);
                    if seen.starts_with(b"GET") && seen.windows(4).any(|w| w == b"\r\n\r\n") {
                        let ok =
                            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}";
                        let _ = s.write_all(ok).await;
                        return;
                    }
                }
            });
        }
    });
    (url, rx)
}

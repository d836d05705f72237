//! A raw HTTP/1.1 client that keeps the response headers exactly as received
//! (duplicates, both framings) and records when each piece of the body arrived, with
//! one-shot helpers (`send`, `post`, `chat`, `get`) and request tagging: which mock
//! worker received a request ([`send_tagged`]).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::wait::within;
use crate::wire::{Wire, chunk_size, header_all_in, header_in, parse_header_lines};
use crate::worker::FakeWorker;

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
    /// body. Panics on a framing error or when nothing arrives within [`crate::wait::STEP_TIMEOUT`].
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

/// A chat completions body with one user message.
pub fn chat_body(prompt: &str, stream: bool) -> String {
    serde_json::json!({
        "model": "m",
        "stream": stream,
        "messages": [{"role": "user", "content": prompt}],
    })
    .to_string()
}

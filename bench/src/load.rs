//! Closed-loop HTTP/1.1 load and one-shot bursts, for overhead measurements.
//!
//! Closed loop ([`run`]): `concurrency` workers, each owning one keep-alive
//! connection (hyper's HTTP/1 client connection over a tokio `TcpStream`, Nagle
//! off) to `targets[worker % targets.len()]`, each sending its next request as soon
//! as the previous response body has been read to the end. A shared ticket counter
//! bounds the total count and a deadline bounds the time, so a run ends after at
//! most `max_requests` requests or `max_duration` plus one `request_timeout`. A
//! failed request counts as an error and its worker reconnects.
//!
//! Burst ([`burst`]): `n` connections opened first (at most `connect_parallelism`
//! connects in progress), then one request on each, all released at once, so `n`
//! requests are in flight together.
//!
//! Per request it records the latency from just before the request is written to
//! the end of the response body, and the time to the first non-empty body frame
//! (TTFB), both in µs. A response counts as successful when its status is 2xx and,
//! for a streamed request, its body ends with `data: [DONE]`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper::client::conn::http1::SendRequest;
use hyper::header::{CONTENT_TYPE, HOST, HeaderValue};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::stats::Percentiles;

/// Builds the body of request number `i` (numbered from 0 within a run).
pub type BodyFn = Arc<dyn Fn(u64) -> Bytes + Send + Sync>;

/// System prompt shared by every small request (~100 bytes).
pub const SMALL_SYSTEM: &str = "You are a concise assistant answering questions for the router \
                                overhead benchmark. Reply in one short sentence.";

/// One small chat request body per index (256 distinct user messages, so a
/// router's prefix tree stays small): the shared system prompt, model `m`,
/// `max_tokens`, `ignore_eos`; streamed ones ask for the usage chunk.
pub fn small_chat_bodies(max_tokens: u64, stream: bool) -> BodyFn {
    chat_bodies(max_tokens, stream, 0)
}

/// [`small_chat_bodies`] with the shared system prompt padded with plain words
/// (the same in every body) until the longest body is `bytes` long, the others up
/// to 4 bytes shorter (their question numbers have fewer digits): e.g. 2048 for
/// the ~2 KB bodies of a chat with a longer system prompt. No padding when
/// `bytes` is at most the unpadded length.
pub fn chat_bodies(max_tokens: u64, stream: bool, bytes: usize) -> BodyFn {
    let body = |k: usize, system: &str| {
        let mut v = serde_json::json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": format!("Question {k}: which river flows through city number {k}?")},
            ],
            "max_tokens": max_tokens,
            "ignore_eos": true,
        });
        if stream {
            v["stream"] = serde_json::json!(true);
            v["stream_options"] = serde_json::json!({"include_usage": true});
        }
        v.to_string()
    };
    // The longest body without padding (k = 255 has the longest number); padding
    // is plain ASCII, one byte of JSON per character.
    let short = body(255, SMALL_SYSTEM).len();
    let mut system = SMALL_SYSTEM.to_string();
    const FILLER: &str = " Keep to the facts, name the river and the city, and say nothing else.";
    while system.len() - SMALL_SYSTEM.len() + short < bytes {
        system.push_str(FILLER);
    }
    system.truncate(SMALL_SYSTEM.len() + bytes.saturating_sub(short));
    let bodies: Vec<Bytes> = (0..256).map(|k| Bytes::from(body(k, &system))).collect();
    Arc::new(move |i| bodies[(i % bodies.len() as u64) as usize].clone())
}

/// System prompts of the new-turn workload ([`new_turn_bodies`]): as many as a few
/// applications sharing a pool would send.
pub const NEW_TURN_SYSTEMS: u64 = 8;

/// Bytes of each new user turn of [`new_turn_bodies`] (pseudo-random words), about.
pub const NEW_TURN_USER_BYTES: usize = 160;

/// Chat bodies as real traffic sends them: one of [`NEW_TURN_SYSTEMS`] fixed system
/// prompts (request `i` takes prompt `i % 8`; each is pseudo-random words of its own,
/// padded so that a body is about `bytes` long), then a user turn never sent before:
/// "Turn N:" and ~[`NEW_TURN_USER_BYTES`] bytes of words seeded by N, where N counts
/// every body this function's result has built (not `i`, which restarts with each
/// run), so a warm-up or a previous cell never repeats a turn. A prefix-caching router
/// matches the system prompt and inserts the new turn on every request, the way its
/// tree grows in production; [`chat_bodies`] (the repeated-body workload) only hits.
pub fn new_turn_bodies(max_tokens: u64, stream: bool, bytes: usize) -> BodyFn {
    use crate::prompts::{SplitMix64, WORDS};
    let words = |seed: u64, len: usize| {
        let mut rng = SplitMix64::new(seed);
        let mut text = String::with_capacity(len + 16);
        while text.len() < len {
            if !text.is_empty() {
                text.push(' ');
            }
            text.push_str(WORDS[(rng.next_u64() % WORDS.len() as u64) as usize]);
        }
        text
    };
    // Each body is built from its system prompt's JSON up to the user turn, the turn
    // (plain ASCII words: nothing to escape) and the JSON after it, so the load
    // generator spends little on it.
    let frame = |system: &str| {
        let mut v = serde_json::json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": "\u{1}"},
            ],
            "max_tokens": max_tokens,
            "ignore_eos": true,
        });
        if stream {
            v["stream"] = serde_json::json!(true);
            v["stream_options"] = serde_json::json!({"include_usage": true});
        }
        let text = v.to_string();
        let (head, tail) = text.split_once("\\u0001").unwrap_or((&text, ""));
        (head.to_string(), tail.to_string())
    };
    // The bytes around a system prompt: the frame and a turn with a long number.
    let turn = move |n: u64| {
        format!(
            "Turn {n}: {}",
            words(n ^ 0x6e65_775f_7475_726e, NEW_TURN_USER_BYTES)
        )
    };
    let (h, t) = frame("");
    let around = h.len() + t.len() + turn(u64::from(u32::MAX)).len();
    let room = bytes.saturating_sub(around).max(64);
    let frames: Vec<(String, String)> = (0..NEW_TURN_SYSTEMS)
        .map(|s| {
            let mut p = format!("You are assistant {s} of the new-turn benchmark. ");
            p.push_str(&words(0x7379_7374_656d ^ s, room));
            p.truncate(room);
            frame(&p)
        })
        .collect();
    let next = Arc::new(AtomicU64::new(0));
    Arc::new(move |i| {
        let n = next.fetch_add(1, Ordering::Relaxed);
        let (head, tail) = &frames[(i % NEW_TURN_SYSTEMS) as usize];
        let turn = turn(n);
        let mut b = String::with_capacity(head.len() + turn.len() + tail.len());
        b.push_str(head);
        b.push_str(&turn);
        b.push_str(tail);
        Bytes::from(b)
    })
}

/// One closed-loop run.
#[derive(Clone)]
pub struct LoadSpec {
    /// Servers; worker `w` talks to `targets[w % targets.len()]`.
    pub targets: Vec<SocketAddr>,
    /// Request path, e.g. `/v1/chat/completions` (always POSTed as JSON).
    pub path: String,
    /// Workers (= connections).
    pub concurrency: usize,
    /// Most requests sent, over all workers.
    pub max_requests: u64,
    /// No request is started after this much time.
    pub max_duration: Duration,
    /// Limit per request, from send to the end of the body.
    pub request_timeout: Duration,
    /// Expect an SSE body ending with `data: [DONE]`.
    pub stream: bool,
    /// Request bodies.
    pub body: BodyFn,
    /// Set to stop the run early (checked before each request).
    pub stop: Option<Arc<AtomicBool>>,
    /// Bumped after every finished request (successful or not), for progress.
    pub progress: Option<Arc<AtomicU64>>,
}

/// Timings of one successful request, in µs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// From writing the request to the end of the response body.
    pub latency_us: u64,
    /// From writing the request to the first non-empty body frame.
    pub ttfb_us: u64,
}

/// What a run (or a burst's request phase) produced.
#[derive(Debug, Clone, Default)]
pub struct LoadResult {
    /// Successful requests, in no particular order.
    pub samples: Vec<Sample>,
    /// Failed requests (and failed connects).
    pub errors: u64,
    /// The first failure, for the report.
    pub first_error: Option<String>,
    /// Wall time of the run.
    pub elapsed: Duration,
    /// Connections opened.
    pub connections: u64,
}

impl LoadResult {
    /// Adds `other`'s samples and counts (elapsed times add up).
    pub fn merge(&mut self, other: LoadResult) {
        self.samples.extend(other.samples);
        self.errors += other.errors;
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
        self.elapsed += other.elapsed;
        self.connections += other.connections;
    }

    /// Successful requests per second of wall time.
    pub fn req_per_s(&self) -> f64 {
        let s = self.elapsed.as_secs_f64();
        if s > 0.0 {
            self.samples.len() as f64 / s
        } else {
            0.0
        }
    }

    /// Percentiles of the end-of-body latency, in µs.
    pub fn latency_us(&self) -> Percentiles {
        let v: Vec<f64> = self.samples.iter().map(|s| s.latency_us as f64).collect();
        Percentiles::of(&v)
    }

    /// Percentiles of the time to first byte, in µs.
    pub fn ttfb_us(&self) -> Percentiles {
        let v: Vec<f64> = self.samples.iter().map(|s| s.ttfb_us as f64).collect();
        Percentiles::of(&v)
    }

    fn fail(&mut self, e: String) {
        self.errors += 1;
        if self.first_error.is_none() {
            self.first_error = Some(e);
        }
    }
}

/// A client HTTP/1.1 connection: request sender plus the `Host` value.
struct Conn {
    sender: SendRequest<Full<Bytes>>,
    host: HeaderValue,
}

async fn connect(addr: SocketAddr) -> Result<Conn, String> {
    let stream = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect {addr}: {e}"))?;
    let _ = stream.set_nodelay(true);
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("handshake {addr}: {e}"))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let host = HeaderValue::from_str(&addr.to_string()).map_err(|e| e.to_string())?;
    Ok(Conn { sender, host })
}

/// Sends one POST and reads the whole body.
async fn send_one(
    conn: &mut Conn,
    path: &str,
    body: Bytes,
    stream: bool,
) -> Result<Sample, String> {
    conn.sender
        .ready()
        .await
        .map_err(|e| format!("connection closed: {e}"))?;
    let req = Request::post(path)
        .header(HOST, conn.host.clone())
        .header(CONTENT_TYPE, "application/json")
        .body(Full::new(body))
        .map_err(|e| format!("cannot build request: {e}"))?;
    let t0 = Instant::now();
    let resp = conn
        .sender
        .send_request(req)
        .await
        .map_err(|e| format!("request failed: {e}"))?;
    let status = resp.status();
    let mut body = resp.into_body();
    let mut ttfb = None;
    // The first bytes (for an error message) and the last ones (for `[DONE]`).
    let mut head: Vec<u8> = Vec::new();
    let mut tail: Vec<u8> = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| format!("response body failed ({status}): {e}"))?;
        if let Ok(data) = frame.into_data()
            && !data.is_empty()
        {
            ttfb.get_or_insert_with(|| t0.elapsed());
            if head.len() < 200 {
                head.extend_from_slice(&data[..data.len().min(200 - head.len())]);
            }
            tail.extend_from_slice(&data[data.len().saturating_sub(32)..]);
            let cut = tail.len().saturating_sub(32);
            tail.drain(..cut);
        }
    }
    let latency = t0.elapsed();
    if !status.is_success() {
        return Err(format!(
            "status {status}: {}",
            String::from_utf8_lossy(&head).trim()
        ));
    }
    if stream && !tail.ends_with(b"data: [DONE]\n\n") {
        return Err("stream ended without `data: [DONE]`".into());
    }
    Ok(Sample {
        latency_us: latency.as_micros() as u64,
        ttfb_us: ttfb.unwrap_or(latency).as_micros() as u64,
    })
}

/// Runs the closed loop described by `spec` (see the module docs).
pub async fn run(spec: &LoadSpec) -> LoadResult {
    if spec.targets.is_empty() || spec.concurrency == 0 {
        return LoadResult::default();
    }
    let tickets = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let deadline = start + spec.max_duration;
    let mut set = JoinSet::new();
    for w in 0..spec.concurrency {
        let spec = spec.clone();
        let tickets = Arc::clone(&tickets);
        set.spawn(async move { worker(w, &spec, &tickets, deadline).await });
    }
    let mut total = LoadResult::default();
    while let Some(r) = set.join_next().await {
        match r {
            Ok(r) => total.merge(r),
            Err(e) => total.fail(format!("worker task failed: {e}")),
        }
    }
    total.elapsed = start.elapsed();
    total
}

async fn worker(w: usize, spec: &LoadSpec, tickets: &AtomicU64, deadline: Instant) -> LoadResult {
    let addr = spec.targets[w % spec.targets.len()];
    let share = spec.max_requests / spec.concurrency as u64 + 1;
    let mut out = LoadResult {
        samples: Vec::with_capacity(share.min(1 << 20) as usize),
        ..LoadResult::default()
    };
    let mut conn: Option<Conn> = None;
    loop {
        if Instant::now() >= deadline
            || spec
                .stop
                .as_ref()
                .is_some_and(|s| s.load(Ordering::Relaxed))
        {
            break;
        }
        let i = tickets.fetch_add(1, Ordering::Relaxed);
        if i >= spec.max_requests {
            break;
        }
        let c = match conn.as_mut() {
            Some(c) => c,
            None => match tokio::time::timeout(spec.request_timeout, connect(addr)).await {
                Ok(Ok(c)) => {
                    out.connections += 1;
                    conn.insert(c)
                }
                Ok(Err(e)) => {
                    out.fail(e);
                    bump(&spec.progress);
                    // Do not spin on a refused port.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
                Err(_) => {
                    out.fail(format!("connect {addr}: timed out"));
                    bump(&spec.progress);
                    continue;
                }
            },
        };
        let body = (spec.body)(i);
        match tokio::time::timeout(
            spec.request_timeout,
            send_one(c, &spec.path, body, spec.stream),
        )
        .await
        {
            Ok(Ok(s)) => out.samples.push(s),
            Ok(Err(e)) => {
                out.fail(e);
                conn = None;
            }
            Err(_) => {
                out.fail(format!(
                    "no complete response within {:?}",
                    spec.request_timeout
                ));
                conn = None;
            }
        }
        bump(&spec.progress);
    }
    out
}

fn bump(progress: &Option<Arc<AtomicU64>>) {
    if let Some(p) = progress {
        p.fetch_add(1, Ordering::Relaxed);
    }
}

/// One burst: `n` connections, then one request on each, all at once.
#[derive(Clone)]
pub struct BurstSpec {
    /// Servers; connection `k` goes to `targets[k % targets.len()]`.
    pub targets: Vec<SocketAddr>,
    /// Request path.
    pub path: String,
    /// Connections, and requests.
    pub n: usize,
    /// Most connects in progress at once.
    pub connect_parallelism: usize,
    /// Longest wait for all connections to be open (the burst starts then anyway,
    /// with those that are).
    pub connect_phase_timeout: Duration,
    /// Limit per request, from send to the end of the body.
    pub request_timeout: Duration,
    /// Expect an SSE body ending with `data: [DONE]`.
    pub stream: bool,
    /// Request bodies.
    pub body: BodyFn,
}

/// What a burst produced.
#[derive(Debug, Clone, Default)]
pub struct BurstResult {
    /// Connections opened.
    pub connected: u64,
    /// Connects that failed or timed out.
    pub connect_errors: u64,
    /// From the first connect to the release of the requests.
    pub connect_phase: Duration,
    /// Time each successful connect took (TCP connect + HTTP/1 handshake), in µs,
    /// from the moment it was allowed to start.
    pub connect_us: Vec<u64>,
    /// The requests: samples, errors (connect errors not included), and the time
    /// from their release to the end of the last one.
    pub requests: LoadResult,
}

/// Runs a burst (see the module docs). `on_release` is called just before the
/// requests are released, e.g. to start sampling the server.
pub async fn burst(spec: &BurstSpec, on_release: impl FnOnce()) -> BurstResult {
    let mut out = BurstResult::default();
    if spec.targets.is_empty() || spec.n == 0 {
        return out;
    }
    let t0 = Instant::now();
    let connecting = Arc::new(Semaphore::new(spec.connect_parallelism.max(1)));
    let settled = Arc::new(AtomicU64::new(0));
    let (go_tx, go_rx) = watch::channel(false);
    let mut set = JoinSet::new();
    for k in 0..spec.n {
        let addr = spec.targets[k % spec.targets.len()];
        let connecting = Arc::clone(&connecting);
        let settled = Arc::clone(&settled);
        let mut go = go_rx.clone();
        let spec = spec.clone();
        set.spawn(async move {
            let (conn, took) = {
                let _permit = connecting.acquire().await;
                let t = Instant::now();
                let c = tokio::time::timeout(spec.connect_phase_timeout, connect(addr)).await;
                (c, t.elapsed().as_micros() as u64)
            };
            settled.fetch_add(1, Ordering::Relaxed);
            let mut conn = match conn {
                Ok(Ok(c)) => c,
                Ok(Err(e)) => return (None, Err(e)),
                Err(_) => return (None, Err(format!("connect {addr}: timed out"))),
            };
            if go.wait_for(|&v| v).await.is_err() {
                return (Some(took), Err("burst abandoned".to_string()));
            }
            let body = (spec.body)(k as u64);
            let r = tokio::time::timeout(
                spec.request_timeout,
                send_one(&mut conn, &spec.path, body, spec.stream),
            )
            .await
            .unwrap_or_else(|_| {
                Err(format!(
                    "no complete response within {:?}",
                    spec.request_timeout
                ))
            });
            (Some(took), r)
        });
    }
    let connect_deadline = t0 + spec.connect_phase_timeout;
    while settled.load(Ordering::Relaxed) < spec.n as u64 && Instant::now() < connect_deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    out.connect_phase = t0.elapsed();
    on_release();
    let released = Instant::now();
    let _ = go_tx.send(true);
    let mut req = LoadResult {
        samples: Vec::with_capacity(spec.n),
        ..LoadResult::default()
    };
    while let Some(r) = set.join_next().await {
        match r {
            Ok((Some(took), r)) => {
                out.connected += 1;
                out.connect_us.push(took);
                match r {
                    Ok(s) => req.samples.push(s),
                    Err(e) => req.fail(e),
                }
            }
            Ok((None, r)) => {
                out.connect_errors += 1;
                if let Err(e) = r
                    && req.first_error.is_none()
                {
                    req.first_error = Some(e);
                }
            }
            Err(e) => req.fail(format!("task failed: {e}")),
        }
    }
    req.elapsed = released.elapsed();
    req.connections = out.connected;
    out.requests = req;
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_bodies_are_padded_to_the_size_asked() {
        let plain = small_chat_bodies(8, false);
        let short = plain(255).len();
        assert_eq!(chat_bodies(8, false, 0)(255), plain(255));
        let padded = chat_bodies(20, true, 2048);
        assert_eq!(padded(255).len(), 2048);
        assert!(padded(3).len() >= 2044);
        assert!(short < 2048);
        let v: serde_json::Value = serde_json::from_slice(&padded(7)).unwrap();
        assert_eq!(v["max_tokens"], 20);
        assert_eq!(v["stream"], true);
        assert!(
            v["messages"][0]["content"]
                .as_str()
                .unwrap()
                .starts_with(SMALL_SYSTEM)
        );
    }

    #[test]
    fn new_turn_bodies_share_eight_system_prompts_and_never_repeat_a_turn() {
        let bodies = new_turn_bodies(20, true, 2048);
        let mut systems = std::collections::HashSet::new();
        let mut turns = std::collections::HashSet::new();
        // Two runs number their requests from 0: the turns stay new.
        for i in (0..40).chain(0..40) {
            let b = bodies(i);
            assert!((1900..=2100).contains(&b.len()), "{}", b.len());
            let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
            assert_eq!(v["max_tokens"], 20);
            assert_eq!(v["stream"], true);
            let system = v["messages"][0]["content"].as_str().unwrap().to_string();
            assert!(system.starts_with(&format!("You are assistant {} ", i % 8)));
            systems.insert(system);
            let turn = v["messages"][1]["content"].as_str().unwrap();
            assert!(turn.len() >= NEW_TURN_USER_BYTES, "{turn}");
            assert!(turns.insert(turn.to_string()), "turn repeated: {turn}");
        }
        assert_eq!(systems.len(), 8);
    }
}

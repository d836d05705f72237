//! Open-loop replay of a Mooncake trace against an OpenAI-compatible endpoint.
//!
//! Each trace line becomes one streamed chat request (one user message holding the
//! line's deterministic prompt, see [`crate::prompts`]), sent at
//! `(timestamp - first timestamp) × time_scale` after the start whether or not
//! earlier requests have finished (open loop). At most `concurrency` requests are
//! in flight; past that the dispatcher waits, and the delay shows up as lateness
//! (`sent_ms - scheduled_ms`). Every request has a timeout, so a replay is bounded
//! by the trace span × `time_scale` plus one timeout.
//!
//! Per request it records TTFT (first SSE chunk with non-empty content), end-to-end
//! latency, the `usage` of the final chunk (prompt, cached and completion tokens)
//! and the `x-sim-engine` response header. Targets are base URLs such as
//! `http://127.0.0.1:6700`; with several, request `i` goes to URL `i mod n`
//! (client-side round robin). With [`ReplayConfig::failover`], a request whose first
//! attempt broke in transit (no response head, or the stream cut before `[DONE]`: the
//! server went away) is sent once more, to the next URL, as a client that knows
//! several router replicas would.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::CONTENT_TYPE;
use hyper::{Request, Uri};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::sync::Semaphore;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

use crate::engine::{ENGINE_HEADER, Usage};
use crate::prompts::TraceRecord;

/// How a replay runs.
#[derive(Debug, Clone)]
pub struct ReplayConfig {
    /// Base URLs (`http://host:port`); request `i` goes to `urls[i % urls.len()]`.
    pub urls: Vec<String>,
    /// Multiplier on trace timestamps (0.1 = ten times faster than recorded).
    pub time_scale: f64,
    /// Most requests in flight at once.
    pub concurrency: usize,
    /// Per-request limit from send to the end of the stream.
    pub request_timeout: Duration,
    /// Print a progress line to stderr this often (`None`: silent).
    pub progress_every: Option<Duration>,
    /// Send a request that broke in transit once more, to `urls[(i + 1) % n]` (see
    /// the module docs); with one URL, nothing is retried.
    pub failover: bool,
}

/// One trace line turned into a ready-to-send request body.
#[derive(Debug, Clone)]
pub struct PreparedRequest {
    /// Position in the (sorted) trace slice, from 0.
    pub index: usize,
    /// Trace timestamp, in ms.
    pub timestamp_ms: u64,
    /// Trace prompt length, in tokens (words).
    pub input_length: u64,
    /// `max_tokens` sent: `min(output_length, cap)`, at least 1.
    pub max_tokens: u64,
    /// The `model` the body names.
    pub model: String,
    /// JSON body of the chat request.
    pub body: Bytes,
}

/// Builds the request bodies of `records`: one user message with the line's
/// prompt, `stream: true`, `stream_options.include_usage`, `ignore_eos: true`,
/// `max_tokens = min(output_length, max_tokens_cap)`.
pub fn prepare(
    records: &[TraceRecord],
    model: &str,
    max_tokens_cap: u64,
    salt: u64,
) -> Vec<PreparedRequest> {
    prepare_split(records, &[model.to_string()], max_tokens_cap, salt)
}

/// As [`prepare`], each request naming one of `models` ([`model_of`]: a conversation
/// keeps its model). `models` must not be empty.
pub fn prepare_split(
    records: &[TraceRecord],
    models: &[String],
    max_tokens_cap: u64,
    salt: u64,
) -> Vec<PreparedRequest> {
    records
        .iter()
        .enumerate()
        .map(|(index, r)| {
            let max_tokens = r.output_length.min(max_tokens_cap).max(1);
            let model = &models[model_of(r, models.len())];
            let body = json!({
                "model": model,
                "messages": [{"role": "user", "content": r.prompt(salt)}],
                "max_tokens": max_tokens,
                "stream": true,
                "stream_options": {"include_usage": true},
                "ignore_eos": true,
            });
            PreparedRequest {
                index,
                timestamp_ms: r.timestamp,
                input_length: r.input_tokens(),
                max_tokens,
                model: model.clone(),
                body: Bytes::from(body.to_string()),
            }
        })
        .collect()
}

/// Which of `n` models trace line `r` asks for: a hash of its conversation, taken as
/// its second block id (its first when it has one block; every line of the Mooncake
/// conversation slice starts with the same block, a shared system prompt), so every
/// turn of a conversation, which repeats the earlier turns, names the same model.
pub fn model_of(r: &TraceRecord, n: usize) -> usize {
    let key = r
        .hash_ids
        .get(1)
        .or(r.hash_ids.first())
        .copied()
        .unwrap_or(0);
    let h = crate::prompts::SplitMix64::new(key).next_u64();
    (h % n.max(1) as u64) as usize
}

/// What happened to one request. Times are ms; `scheduled_ms` and `sent_ms` are
/// offsets from the start of the replay.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestResult {
    /// Position in the trace slice.
    pub index: usize,
    /// Trace timestamp, in ms.
    pub timestamp_ms: u64,
    /// Base URL the request went to.
    pub url: String,
    /// When the schedule said to send it, in ms from the replay start.
    pub scheduled_ms: f64,
    /// When it was actually sent, in ms from the replay start.
    pub sent_ms: f64,
    /// HTTP status, if a response head arrived.
    pub status: Option<u16>,
    /// Why the request failed (`None` = success).
    pub error: Option<String>,
    /// `x-sim-engine` response header: which replica served it.
    pub engine: Option<String>,
    /// The `model` the request named.
    #[serde(default)]
    pub model: String,
    /// The `model` the answer's first chunk named (`None`: no chunk named one).
    #[serde(default)]
    pub answered_model: Option<String>,
    /// Time to first content chunk, in ms from send.
    pub ttft_ms: Option<f64>,
    /// Time to the end of the stream (or the failure), in ms from send.
    pub latency_ms: f64,
    /// Prompt length from the trace, in tokens.
    pub input_length: u64,
    /// `max_tokens` sent.
    pub max_tokens: u64,
    /// `usage.prompt_tokens` reported by the server.
    pub prompt_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens` reported by the server.
    pub cached_tokens: Option<u64>,
    /// `usage.completion_tokens` reported by the server.
    pub completion_tokens: Option<u64>,
    /// SSE chunks that carried non-empty content.
    pub content_chunks: u64,
    /// Inter-token latency: the time between consecutive content chunks, in ms
    /// (one fewer than `content_chunks`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub itl_ms: Vec<f64>,
    /// The first attempt broke in transit and the request was sent again to the next
    /// URL (`url` is then that one; TTFT and latency count from the first send).
    #[serde(default)]
    pub retried: bool,
}

impl RequestResult {
    /// True when the request completed with a 2xx status, `[DONE]` and usage.
    pub fn is_ok(&self) -> bool {
        self.error.is_none()
    }

    /// True when an engine answered it for another model than it named: a 2xx answer
    /// naming another model, or an engine's 404 (the model is not served there; a
    /// router's own 404 carries no `x-sim-engine`).
    pub fn wrong_model(&self) -> bool {
        let engine_404 = self.status == Some(404) && self.engine.is_some();
        let other = self
            .answered_model
            .as_ref()
            .is_some_and(|m| *m != self.model);
        engine_404 || other
    }
}

/// Why a replay could not run at all (per-request failures are results instead).
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// No target URL was given.
    #[error("no target URL given")]
    NoUrl,
    /// A target URL does not parse.
    #[error("bad target URL {url:?}: {reason}")]
    BadUrl {
        /// The URL as given.
        url: String,
        /// The parse error.
        reason: String,
    },
    /// `time_scale` is negative or not finite.
    #[error("time scale must be a finite number >= 0, got {0}")]
    TimeScale(f64),
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// Replays `requests` on their schedule and returns one result per request, in
/// trace order.
pub async fn run(
    requests: &[PreparedRequest],
    cfg: &ReplayConfig,
) -> Result<Vec<RequestResult>, ReplayError> {
    if cfg.urls.is_empty() {
        return Err(ReplayError::NoUrl);
    }
    if !cfg.time_scale.is_finite() || cfg.time_scale < 0.0 {
        return Err(ReplayError::TimeScale(cfg.time_scale));
    }
    let targets = chat_targets(&cfg.urls)?;
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let shared = Shared {
        client: Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector),
        start: Instant::now(),
        timeout: cfg.request_timeout,
        done: Arc::new(AtomicUsize::new(0)),
        failed: Arc::new(AtomicUsize::new(0)),
    };
    let sem = Arc::new(Semaphore::new(cfg.concurrency.max(1)));
    let first_ts = requests.iter().map(|r| r.timestamp_ms).min().unwrap_or(0);
    let progress = cfg
        .progress_every
        .map(|every| spawn_progress(&shared, every, requests.len()));
    let mut tasks = JoinSet::new();
    for (i, req) in requests.iter().enumerate() {
        let offset_s = req.timestamp_ms.saturating_sub(first_ts) as f64 / 1000.0 * cfg.time_scale;
        let scheduled = Duration::try_from_secs_f64(offset_s).unwrap_or(Duration::ZERO);
        tokio::time::sleep_until(shared.start + scheduled).await;
        // Closed only when dropped, which happens after this loop.
        let Ok(permit) = sem.clone().acquire_owned().await else {
            break;
        };
        let job = Job {
            req: req.clone(),
            target: targets[i % targets.len()].clone(),
            fallback: (cfg.failover && targets.len() > 1)
                .then(|| targets[(i + 1) % targets.len()].clone()),
            scheduled,
        };
        let shared = shared.clone();
        tasks.spawn(async move {
            let r = replay_one(&shared, job).await;
            drop(permit);
            shared.done.fetch_add(1, Ordering::Relaxed);
            if r.error.is_some() {
                shared.failed.fetch_add(1, Ordering::Relaxed);
            }
            r
        });
    }
    let mut results = Vec::with_capacity(requests.len());
    while let Some(joined) = tasks.join_next().await {
        if let Ok(r) = joined {
            results.push(r);
        }
    }
    if let Some(p) = progress {
        p.abort();
    }
    results.sort_by_key(|r| r.index);
    Ok(results)
}

/// Each base URL (no trailing slash) with its chat completions URI.
fn chat_targets(urls: &[String]) -> Result<Vec<(String, Uri)>, ReplayError> {
    urls.iter()
        .map(|u| {
            let base = u.trim_end_matches('/').to_string();
            format!("{base}/v1/chat/completions")
                .parse::<Uri>()
                .map(|uri| (base, uri))
                .map_err(|e| ReplayError::BadUrl {
                    url: u.clone(),
                    reason: e.to_string(),
                })
        })
        .collect()
}

/// What every request of a replay shares: the client, the start, the per-request
/// limit and the progress counters.
#[derive(Clone)]
struct Shared {
    client: HttpClient,
    start: Instant,
    timeout: Duration,
    done: Arc<AtomicUsize>,
    failed: Arc<AtomicUsize>,
}

/// One request to send: its base URL and URI, the next one's when it may fail over,
/// and when the schedule said to send it (from the start).
struct Job {
    req: PreparedRequest,
    target: (String, Uri),
    fallback: Option<(String, Uri)>,
    scheduled: Duration,
}

/// Prints a progress line to stderr every `every` until aborted.
fn spawn_progress(shared: &Shared, every: Duration, total: usize) -> JoinHandle<()> {
    let (done, failed, start) = (shared.done.clone(), shared.failed.clone(), shared.start);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval_at(start + every, every);
        loop {
            tick.tick().await;
            eprintln!(
                "  {:>5.0} s: {} of {total} done, {} failed",
                start.elapsed().as_secs_f64(),
                done.load(Ordering::Relaxed),
                failed.load(Ordering::Relaxed)
            );
        }
    })
}

/// Sends `job` (once more to its fallback when the first attempt broke in transit)
/// within the per-request limit, and records what happened.
async fn replay_one(shared: &Shared, job: Job) -> RequestResult {
    let Job {
        req,
        target: (base, uri),
        fallback,
        scheduled,
    } = job;
    let client = &shared.client;
    let timeout = shared.timeout;
    let sent = shared.start.elapsed();
    let mut r = RequestResult {
        index: req.index,
        timestamp_ms: req.timestamp_ms,
        url: base,
        scheduled_ms: ms(scheduled),
        sent_ms: ms(sent),
        status: None,
        error: None,
        engine: None,
        model: req.model.clone(),
        answered_model: None,
        ttft_ms: None,
        latency_ms: 0.0,
        input_length: req.input_length,
        max_tokens: req.max_tokens,
        prompt_tokens: None,
        cached_tokens: None,
        completion_tokens: None,
        content_chunks: 0,
        itl_ms: Vec::new(),
        retried: false,
    };
    let t0 = Instant::now();
    let attempts = async {
        let first = send_one(client, uri, req.body.clone(), t0, &mut r).await;
        match (first, fallback) {
            (Err(e), Some((base, uri))) if broke_in_transit(&r, &e) => {
                r.url = base;
                r.retried = true;
                r.status = None;
                r.engine = None;
                r.ttft_ms = None;
                r.content_chunks = 0;
                r.itl_ms.clear();
                r.answered_model = None;
                send_one(client, uri, req.body, t0, &mut r).await
            }
            (first, _) => first,
        }
    };
    let outcome = tokio::time::timeout(timeout, attempts).await;
    r.error = match outcome {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e),
        Err(_) => Some(format!("timed out after {} s", timeout.as_secs_f64())),
    };
    r.latency_ms = ms(t0.elapsed());
    r
}

/// Whether a failed attempt never got an answer from a live server: no response head,
/// or a stream cut before its end (the process behind the URL went away).
fn broke_in_transit(r: &RequestResult, error: &str) -> bool {
    r.status.is_none()
        || error.starts_with("stream broke")
        || error.starts_with("stream ended before")
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Sends one request and reads its SSE stream into `r`; `Err` is the failure text.
async fn send_one(
    client: &HttpClient,
    uri: Uri,
    body: Bytes,
    t0: Instant,
    r: &mut RequestResult,
) -> Result<(), String> {
    let req = Request::post(uri)
        .header(CONTENT_TYPE, "application/json")
        .body(Full::new(body))
        .map_err(|e| format!("cannot build request: {e}"))?;
    let resp = client
        .request(req)
        .await
        .map_err(|e| format!("request failed: {}", error_chain(&e)))?;
    r.status = Some(resp.status().as_u16());
    r.engine = resp
        .headers()
        .get(ENGINE_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let status = resp.status();
    let mut body = resp.into_body();
    if !status.is_success() {
        let text = match body.collect().await {
            Ok(c) => String::from_utf8_lossy(&c.to_bytes())
                .chars()
                .take(300)
                .collect(),
            Err(e) => format!("(body unreadable: {e})"),
        };
        return Err(format!("HTTP {}: {text}", status.as_u16()));
    }
    let mut sse = SseParser::default();
    let mut done = false;
    let mut usage: Option<Usage> = None;
    let mut last_token: Option<Instant> = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| format!("stream broke: {}", error_chain(&e)))?;
        let Some(data) = frame.data_ref() else {
            continue;
        };
        for payload in sse.push(data) {
            if payload == "[DONE]" {
                done = true;
                continue;
            }
            let chunk: StreamChunk = serde_json::from_str(&payload)
                .map_err(|e| format!("bad SSE chunk ({e}): {}", truncate(&payload, 200)))?;
            if let Some(err) = chunk.error {
                return Err(format!("error event: {}", truncate(&err.to_string(), 300)));
            }
            let has_content = chunk.choices.iter().any(|c| {
                let delta = c.delta.as_ref().and_then(|d| d.content.as_deref());
                !delta.or(c.text.as_deref()).unwrap_or("").is_empty()
            });
            if r.answered_model.is_none() {
                r.answered_model = chunk.model;
            }
            if has_content {
                let now = Instant::now();
                r.content_chunks += 1;
                r.ttft_ms.get_or_insert_with(|| ms(now - t0));
                if let Some(prev) = last_token.replace(now) {
                    r.itl_ms.push(ms(now - prev));
                }
            }
            if chunk.usage.is_some() {
                usage = chunk.usage;
            }
        }
    }
    if let Some(u) = usage {
        r.prompt_tokens = Some(u.prompt_tokens);
        r.completion_tokens = Some(u.completion_tokens);
        r.cached_tokens = Some(u.prompt_tokens_details.map_or(0, |d| d.cached_tokens));
    }
    match (done, usage) {
        (false, _) => Err("stream ended before data: [DONE]".into()),
        (true, None) => Err("stream carried no usage chunk".into()),
        (true, Some(_)) => Ok(()),
    }
}

fn truncate(s: &str, n: usize) -> String {
    s.chars().take(n).collect()
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        out.push_str(": ");
        out.push_str(&s.to_string());
        src = s.source();
    }
    out
}

#[derive(Debug, Deserialize)]
struct StreamChunk {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    choices: Vec<ChunkChoice>,
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(default)]
    error: Option<serde_json::Value>,
}

#[derive(Debug, Deserialize)]
struct ChunkChoice {
    #[serde(default)]
    delta: Option<ChunkDelta>,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Debug, Deserialize)]
struct ChunkDelta {
    #[serde(default)]
    content: Option<String>,
}

/// Incremental SSE splitter: feed bytes as they arrive, get each complete
/// event's `data:` payload (multi-line data joined with `\n`).
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
}

impl SseParser {
    /// Appends `bytes` and returns the data payloads of every event now complete.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(end) = find_event_end(&self.buf) {
            let (event_len, sep_len) = end;
            let event: Vec<u8> = self
                .buf
                .drain(..event_len + sep_len)
                .take(event_len)
                .collect();
            let text = String::from_utf8_lossy(&event);
            let data: Vec<&str> = text
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if !data.is_empty() {
                out.push(data.join("\n"));
            }
        }
        out
    }
}

/// Position of the first blank line (`\n\n` or `\r\n\r\n`): (event length, separator length).
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| (i, 2));
    let crlf = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| (i, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_parser_joins_split_chunks() {
        let mut p = SseParser::default();
        assert!(p.push(b"data: {\"a\"").is_empty());
        assert_eq!(p.push(b":1}\n\ndata: [DONE]\n\n"), ["{\"a\":1}", "[DONE]"]);
        assert_eq!(p.push(b": comment\n\ndata:x\r\n\r\n"), ["x"]);
    }

    #[tokio::test]
    async fn failover_sends_what_finds_a_url_dead_to_the_next() {
        use crate::engine::{self, EngineConfig};
        let live = engine::start(EngineConfig {
            time_factor: 0.0,
            ..EngineConfig::default()
        })
        .await
        .unwrap();
        let dead = format!("http://127.0.0.1:{}", crate::procs::free_port().unwrap());
        let rec: TraceRecord = serde_json::from_str(
            r#"{"timestamp": 0, "input_length": 20, "output_length": 2, "hash_ids": [0]}"#,
        )
        .unwrap();
        let reqs = prepare(&vec![rec; 4], "m", 2, 0);
        let mut cfg = ReplayConfig {
            urls: vec![dead, live.url()],
            time_scale: 0.0,
            concurrency: 4,
            request_timeout: Duration::from_secs(10),
            progress_every: None,
            failover: true,
        };
        let r = run(&reqs, &cfg).await.unwrap();
        assert!(r.iter().all(RequestResult::is_ok), "{r:?}");
        assert_eq!(r.iter().filter(|x| x.retried).count(), 2);
        assert!(r.iter().all(|x| x.url == live.url()));
        cfg.failover = false;
        let r = run(&reqs, &cfg).await.unwrap();
        assert_eq!(r.iter().filter(|x| !x.is_ok()).count(), 2);
        assert!(r.iter().all(|x| !x.retried));
    }

    #[test]
    fn prepared_body_is_a_streamed_chat_request() {
        let rec: TraceRecord = serde_json::from_str(
            r#"{"timestamp": 3000, "input_length": 1100, "output_length": 500, "hash_ids": [0,1,2]}"#,
        )
        .unwrap();
        let p = prepare(&[rec], "m", 64, 0);
        let v: serde_json::Value = serde_json::from_slice(&p[0].body).unwrap();
        assert_eq!(v["max_tokens"], 64);
        assert_eq!(v["stream"], true);
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert_eq!(v["ignore_eos"], true);
        let content = v["messages"][0]["content"].as_str().unwrap();
        assert_eq!(content.len(), 5498);
    }
}

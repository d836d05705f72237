//! A simulated vLLM engine: OpenAI HTTP API, a prefix cache of token blocks and a
//! queueing model of prefill and decode, with no model behind it.
//!
//! What it owns: one replica's prefix cache ([`PrefixCache`]), its prefill queue
//! and its counters. What it must not do: spin the CPU to "simulate" work. All
//! simulated time is tokio timers, so one process serves hundreds of requests per
//! second on a small machine.
//!
//! Terms and units:
//! - **token**: a whitespace-separated word of the prompt after the chat template
//!   (an approximation of a tokenizer; the trace prompts are built so one word is
//!   about one token).
//! - **block**: `block_size` consecutive tokens (default 16, as vLLM). Only full
//!   blocks are cached. Block hashes are chained: a block's hash covers its parent's
//!   hash and its own words, so equal hashes imply equal prefixes (as in vLLM).
//! - **cached tokens**: leading blocks of the prompt already present × `block_size`,
//!   never counting the prompt's last token (vLLM always recomputes it).
//! - **prefill**: one request at a time per engine, FIFO; costs
//!   `ttft_base + uncached_tokens × prefill_per_token`. **decode**: concurrent,
//!   first token at the end of prefill, then one token per `itl`. Every simulated
//!   duration is multiplied by `time_factor`; at 0 the engine answers at once (no
//!   timer is armed for a deadline already reached).
//!
//! Endpoints: `POST /v1/chat/completions`, `POST /v1/completions` (streamed SSE or
//! not, vLLM response shapes), `GET /health`, `GET /v1/models`, `GET /metrics`
//! (Prometheus text with vLLM's metric names). Every response carries
//! `x-sim-engine: NAME`. Bad requests get a 400 JSON error, never a panic.
//!
//! Library use (e.g. from a router's integration tests):
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use bench::engine::{self, EngineConfig};
//! let cfg = EngineConfig { name: "a".into(), time_factor: 0.001, ..EngineConfig::default() };
//! let running = engine::start(cfg).await?; // binds 127.0.0.1:0
//! println!("{} serves as {}", running.url(), running.engine().name());
//! # Ok(()) }
//! ```

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Body, Frame, Incoming};
use hyper::header::{CONTENT_TYPE, HeaderName, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use lru::LruCache;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;
use xxhash_rust::xxh3::Xxh3;

use crate::prompts::WORDS;

/// Response header naming the replica that served a request.
pub const ENGINE_HEADER: &str = "x-sim-engine";

/// Seed of the first block's hash chain (any constant; equal across engines).
const ROOT_HASH: u64 = 0x6361_6368_6521_0001;

/// Settings of one simulated engine. Durations are simulated time, scaled by
/// `time_factor` before any timer is armed.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Replica name, sent back in the `x-sim-engine` header.
    pub name: String,
    /// Served model id (reported by `/v1/models` and in responses; requests may
    /// name any model).
    pub model: String,
    /// Prefix cache capacity, in blocks of `block_size` tokens.
    pub kv_blocks: usize,
    /// Tokens per cache block.
    pub block_size: usize,
    /// Fixed part of every prefill (simulated time).
    pub ttft_base: Duration,
    /// Prefill cost per uncached prompt token (simulated time).
    pub prefill_per_token: Duration,
    /// Inter-token latency while decoding (simulated time).
    pub itl: Duration,
    /// Multiplier applied to every simulated duration (0.1 = ten times faster).
    pub time_factor: f64,
    /// Upper bound on generated tokens per request, whatever `max_tokens` says.
    pub max_output_tokens: u64,
    /// Largest accepted request body, in bytes (413 past it).
    pub max_body_bytes: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            name: "sim".into(),
            model: "m".into(),
            kv_blocks: 65_536,
            block_size: 16,
            ttft_base: Duration::from_millis(20),
            prefill_per_token: Duration::from_micros(80),
            itl: Duration::from_millis(15),
            time_factor: 1.0,
            max_output_tokens: 4096,
            max_body_bytes: 64 << 20,
        }
    }
}

/// A setting of [`EngineConfig`] that cannot work.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// `kv_blocks` or `block_size` is zero.
    #[error("{0} must be at least 1")]
    Zero(&'static str),
    /// `time_factor` is negative, NaN or infinite.
    #[error("time_factor must be a finite number >= 0, got {0}")]
    TimeFactor(f64),
    /// The name cannot be sent as an HTTP header value.
    #[error("engine name {0:?} is not a valid header value")]
    Name(String),
}

/// Chained hashes of the full `block_size`-token blocks of `tokens`, plus the
/// token count. Block `i`'s hash covers block `i - 1`'s hash and block `i`'s words.
pub fn block_hashes<'a>(
    tokens: impl IntoIterator<Item = &'a str>,
    block_size: usize,
) -> (usize, Vec<u64>) {
    let block_size = block_size.max(1);
    let mut hashes = Vec::new();
    let mut hasher = Xxh3::with_seed(ROOT_HASH);
    let mut in_block = 0;
    let mut n = 0;
    for word in tokens {
        hasher.update(word.as_bytes());
        hasher.update(&[0]);
        in_block += 1;
        n += 1;
        if in_block == block_size {
            let h = hasher.digest();
            hashes.push(h);
            hasher = Xxh3::with_seed(h);
            in_block = 0;
        }
    }
    (n, hashes)
}

/// One replica's prefix cache: a set of block hashes with LRU eviction.
///
/// Insertion touches a request's blocks from last to first, so the first blocks
/// are the most recently used and a chain is evicted from its tail (vLLM frees a
/// request's blocks in reverse order for the same reason).
#[derive(Debug)]
pub struct PrefixCache {
    blocks: LruCache<u64, ()>,
    block_size: usize,
}

impl PrefixCache {
    /// An empty cache holding at most `capacity` blocks of `block_size` tokens.
    pub fn new(capacity: NonZeroUsize, block_size: NonZeroUsize) -> Self {
        Self {
            blocks: LruCache::new(capacity),
            block_size: block_size.get(),
        }
    }

    /// Tokens of a prompt (`n_tokens` long, with full-block `hashes`) that are
    /// already cached: leading cached blocks × block size, at most `n_tokens - 1`.
    /// Does not change the cache.
    pub fn cached_tokens(&self, hashes: &[u64], n_tokens: usize) -> usize {
        let max_blocks = n_tokens.saturating_sub(1) / self.block_size;
        let hit = hashes
            .iter()
            .take(max_blocks)
            .take_while(|h| self.blocks.contains(h))
            .count();
        hit * self.block_size
    }

    /// [`Self::cached_tokens`], then inserts or touches every full block of the
    /// prompt (evicting least recently used blocks past capacity).
    pub fn lookup_and_insert(&mut self, hashes: &[u64], n_tokens: usize) -> usize {
        let cached = self.cached_tokens(hashes, n_tokens);
        for &h in hashes.iter().rev() {
            self.blocks.put(h, ());
        }
        cached
    }

    /// Blocks currently held.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// True when no block is held.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Capacity, in blocks.
    pub fn capacity(&self) -> usize {
        self.blocks.cap().get()
    }
}

/// Token counts of one response, in OpenAI/vLLM `usage` shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt tokens (after the chat template).
    pub prompt_tokens: u64,
    /// `prompt_tokens + completion_tokens`.
    pub total_tokens: u64,
    /// Generated tokens.
    pub completion_tokens: u64,
    /// Breakdown of the prompt tokens.
    #[serde(default)]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens served from the prefix cache.
    #[serde(default)]
    pub cached_tokens: u64,
}

impl Usage {
    fn new(prompt_tokens: u64, completion_tokens: u64, cached_tokens: u64) -> Self {
        Self {
            prompt_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            completion_tokens,
            prompt_tokens_details: Some(PromptTokensDetails { cached_tokens }),
        }
    }
}

/// Point-in-time counters of one engine (what `/metrics` reports).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EngineStats {
    /// Requests that finished generating.
    pub requests_finished: u64,
    /// Prompt tokens of every admitted request.
    pub prompt_tokens: u64,
    /// Prompt tokens looked up in the prefix cache (= prompt tokens).
    pub cache_queries: u64,
    /// Prompt tokens found in the prefix cache.
    pub cache_hits: u64,
    /// Tokens generated.
    pub generation_tokens: u64,
    /// Requests in prefill or decode.
    pub running: u64,
    /// Requests queued for prefill.
    pub waiting: u64,
    /// Blocks held in the prefix cache.
    pub kv_blocks_used: u64,
}

#[derive(Debug, Default)]
struct Counters {
    requests_finished: AtomicU64,
    prompt_tokens: AtomicU64,
    cache_queries: AtomicU64,
    cache_hits: AtomicU64,
    generation_tokens: AtomicU64,
    running: AtomicU64,
    waiting: AtomicU64,
    next_id: AtomicU64,
}

/// Adds one to a gauge now and subtracts it on drop (every exit path, including a
/// client that leaves). Relaxed ordering: the gauges are only read for reporting.
struct GaugeGuard<'a>(&'a AtomicU64);

impl<'a> GaugeGuard<'a> {
    fn new(g: &'a AtomicU64) -> Self {
        g.fetch_add(1, Ordering::Relaxed);
        Self(g)
    }
}

impl Drop for GaugeGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A simulated engine: cheap to clone (shared state behind an `Arc`).
#[derive(Clone, Debug)]
pub struct Engine {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    cfg: EngineConfig,
    name_header: HeaderValue,
    cache: Mutex<PrefixCache>,
    /// Nominal end of the last scheduled prefill; the lock is the FIFO prefill
    /// queue (tokio's mutex is fair) and is held for the whole prefill.
    prefill: tokio::sync::Mutex<Instant>,
    counters: Counters,
    created: u64,
}

/// Response body of every handler.
pub type RespBody = BoxBody<Bytes, Infallible>;

/// Which OpenAI endpoint a generation request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Completions,
}

/// A generation request after validation.
#[derive(Debug, Clone, PartialEq)]
struct SimRequest {
    endpoint: Endpoint,
    /// Prompt texts (one for chat; completions may batch several).
    prompts: Vec<String>,
    /// Tokens to generate per prompt (already capped).
    max_tokens: u64,
    stream: bool,
    include_usage: bool,
}

/// A prompt reduced to what the simulation needs.
#[derive(Debug)]
struct PromptWork {
    n_tokens: usize,
    hashes: Vec<u64>,
}

/// Outcome of prefill: when it ends (nominal), cached tokens per prompt.
struct Prefilled {
    end: Instant,
    cached: Vec<u64>,
}

impl Engine {
    /// An engine with an empty cache; fails on settings that cannot work.
    pub fn new(cfg: EngineConfig) -> Result<Self, ConfigError> {
        let kv = NonZeroUsize::new(cfg.kv_blocks).ok_or(ConfigError::Zero("kv_blocks"))?;
        let bs = NonZeroUsize::new(cfg.block_size).ok_or(ConfigError::Zero("block_size"))?;
        if !cfg.time_factor.is_finite() || cfg.time_factor < 0.0 {
            return Err(ConfigError::TimeFactor(cfg.time_factor));
        }
        let name_header =
            HeaderValue::from_str(&cfg.name).map_err(|_| ConfigError::Name(cfg.name.clone()))?;
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Ok(Self {
            inner: Arc::new(Inner {
                cfg,
                name_header,
                cache: Mutex::new(PrefixCache::new(kv, bs)),
                prefill: tokio::sync::Mutex::new(Instant::now()),
                counters: Counters::default(),
                created,
            }),
        })
    }

    /// The replica name (`x-sim-engine` header value).
    pub fn name(&self) -> &str {
        &self.inner.cfg.name
    }

    /// The settings this engine runs with.
    pub fn config(&self) -> &EngineConfig {
        &self.inner.cfg
    }

    /// Current counters.
    pub fn stats(&self) -> EngineStats {
        let c = &self.inner.counters;
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        EngineStats {
            requests_finished: r(&c.requests_finished),
            prompt_tokens: r(&c.prompt_tokens),
            cache_queries: r(&c.cache_queries),
            cache_hits: r(&c.cache_hits),
            generation_tokens: r(&c.generation_tokens),
            running: r(&c.running),
            waiting: r(&c.waiting),
            kv_blocks_used: self.lock_cache().len() as u64,
        }
    }

    /// Serves HTTP/1 connections from `listener` until `shutdown` completes, then
    /// stops accepting and drops every open connection.
    pub async fn serve_with_shutdown(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()>,
    ) {
        let mut conns = JoinSet::new();
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                Some(_) = conns.join_next(), if !conns.is_empty() => {}
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => {
                        let _ = stream.set_nodelay(true);
                        let engine = self.clone();
                        conns.spawn(async move {
                            let svc = service_fn(move |req| {
                                let engine = engine.clone();
                                async move { Ok::<_, Infallible>(engine.handle(req).await) }
                            });
                            // A connection error only ends that connection.
                            let _ = http1::Builder::new()
                                .serve_connection(TokioIo::new(stream), svc)
                                .await;
                        });
                    }
                    Err(e) => {
                        // E.g. out of file descriptors: back off, keep serving.
                        eprintln!("sim-engine {}: accept failed: {e}", self.name());
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
            }
        }
    }

    /// Routes one request to its handler and stamps `x-sim-engine`.
    pub async fn handle(&self, req: Request<Incoming>) -> Response<RespBody> {
        let method = req.method().clone();
        let path = req.uri().path().to_owned();
        let mut resp = match (method, path.as_str()) {
            (Method::GET, "/health") => full(StatusCode::OK, None, Bytes::new()),
            (Method::GET, "/v1/models") => self.models(),
            (Method::GET, "/metrics") => full(
                StatusCode::OK,
                Some("text/plain; version=0.0.4; charset=utf-8"),
                Bytes::from(self.metrics_text()),
            ),
            (Method::POST, "/v1/chat/completions") => self.generate(Endpoint::Chat, req).await,
            (Method::POST, "/v1/completions") => self.generate(Endpoint::Completions, req).await,
            (_, "/health" | "/v1/models" | "/metrics")
            | (_, "/v1/chat/completions" | "/v1/completions") => error_response(
                StatusCode::METHOD_NOT_ALLOWED,
                "method not allowed",
                "invalid_request_error",
            ),
            _ => error_response(
                StatusCode::NOT_FOUND,
                &format!("no route for {path}"),
                "not_found_error",
            ),
        };
        resp.headers_mut().insert(
            HeaderName::from_static(ENGINE_HEADER),
            self.inner.name_header.clone(),
        );
        resp
    }

    fn lock_cache(&self) -> std::sync::MutexGuard<'_, PrefixCache> {
        // A panic while holding the lock cannot leave the LRU half-updated in a
        // way that matters for a simulation; keep serving.
        self.inner
            .cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// `secs` of simulated time as wall time: × `time_factor`, capped at one day
    /// so no timer or `Instant` arithmetic can overflow.
    fn scaled_secs(&self, secs: f64) -> Duration {
        let wall = (secs * self.inner.cfg.time_factor).clamp(0.0, 86_400.0);
        Duration::try_from_secs_f64(wall).unwrap_or(Duration::ZERO)
    }

    fn models(&self) -> Response<RespBody> {
        let cfg = &self.inner.cfg;
        let body = json!({
            "object": "list",
            "data": [{
                "id": cfg.model,
                "object": "model",
                "created": self.inner.created,
                "owned_by": "vllm",
                "root": cfg.model,
                "parent": null,
                "max_model_len": 131_072,
            }],
        });
        json_response(StatusCode::OK, &body)
    }

    /// Prometheus text exposition with vLLM's metric names.
    pub fn metrics_text(&self) -> String {
        let s = self.stats();
        let labels = format!(
            "{{engine=\"0\",model_name=\"{}\"}}",
            escape_label(&self.inner.cfg.model)
        );
        let usage = s.kv_blocks_used as f64 / self.lock_cache().capacity().max(1) as f64;
        let rows: [(&str, &str, &str, String); 8] = [
            (
                "vllm:num_requests_running",
                "gauge",
                "Requests in prefill or decode.",
                s.running.to_string(),
            ),
            (
                "vllm:num_requests_waiting",
                "gauge",
                "Requests queued for prefill.",
                s.waiting.to_string(),
            ),
            (
                "vllm:kv_cache_usage_perc",
                "gauge",
                "Fraction of prefix cache blocks in use (1 = 100 percent).",
                usage.to_string(),
            ),
            (
                "vllm:prefix_cache_queries_total",
                "counter",
                "Prefix cache queries, in tokens.",
                s.cache_queries.to_string(),
            ),
            (
                "vllm:prefix_cache_hits_total",
                "counter",
                "Prefix cache hits, in tokens.",
                s.cache_hits.to_string(),
            ),
            (
                "vllm:prompt_tokens_total",
                "counter",
                "Prompt tokens processed.",
                s.prompt_tokens.to_string(),
            ),
            (
                "vllm:generation_tokens_total",
                "counter",
                "Generation tokens produced.",
                s.generation_tokens.to_string(),
            ),
            (
                "vllm:request_success_total",
                "counter",
                "Requests that finished generating.",
                s.requests_finished.to_string(),
            ),
        ];
        let mut out = String::new();
        for (name, kind, help, value) in rows {
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{labels} {value}\n"
            ));
        }
        out
    }

    async fn generate(&self, endpoint: Endpoint, req: Request<Incoming>) -> Response<RespBody> {
        let arrival = Instant::now();
        let limit = self.inner.cfg.max_body_bytes;
        let body = match Limited::new(req.into_body(), limit).collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(e) if e.is::<http_body_util::LengthLimitError>() => {
                return error_response(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    &format!("request body exceeds {limit} bytes"),
                    "invalid_request_error",
                );
            }
            Err(e) => {
                return error_response(
                    StatusCode::BAD_REQUEST,
                    &format!("cannot read request body: {e}"),
                    "invalid_request_error",
                );
            }
        };
        let sim = match parse_request(endpoint, &body, self.inner.cfg.max_output_tokens) {
            Ok(sim) => sim,
            Err(msg) => {
                return error_response(StatusCode::BAD_REQUEST, &msg, "invalid_request_error");
            }
        };
        let work: Vec<PromptWork> = sim
            .prompts
            .iter()
            .map(|p| {
                let (n_tokens, hashes) =
                    block_hashes(p.split_whitespace(), self.inner.cfg.block_size);
                PromptWork { n_tokens, hashes }
            })
            .collect();
        let id_num = self.inner.counters.next_id.fetch_add(1, Ordering::Relaxed);
        let prefix = match endpoint {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Completions => "cmpl",
        };
        let shape = Shape {
            endpoint,
            id: format!("{prefix}-{}-{id_num}", self.inner.cfg.name),
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            model: self.inner.cfg.model.clone(),
        };
        if sim.stream {
            let (tx, rx) = mpsc::channel(64);
            let engine = self.clone();
            tokio::spawn(async move {
                tokio::select! {
                    () = engine.stream(&shape, &sim, &work, arrival, &tx) => {}
                    () = tx.closed() => {}
                }
            });
            let mut resp = Response::new(ChannelBody { rx }.boxed());
            resp.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static("text/event-stream; charset=utf-8"),
            );
            resp
        } else {
            let (pre, _running) = self.prefill(&work, arrival).await;
            let n = sim.max_tokens;
            let decode = self.inner.cfg.itl.as_secs_f64() * n.saturating_sub(1) as f64;
            let last = pre.end + self.scaled_secs(decode);
            wait_until(last).await;
            self.finish(&work, n);
            json_response(StatusCode::OK, &shape.full_response(&work, &pre.cached, n))
        }
    }

    /// Queues for the prefill slot, looks the prompts up in the cache and waits
    /// out the prefill. The returned guard keeps the request counted as running.
    async fn prefill(&self, work: &[PromptWork], arrival: Instant) -> (Prefilled, GaugeGuard<'_>) {
        let c = &self.inner.counters;
        let waiting = GaugeGuard::new(&c.waiting);
        let mut last_end = self.inner.prefill.lock().await;
        drop(waiting);
        let running = GaugeGuard::new(&c.running);
        let cached: Vec<u64> = {
            let mut cache = self.lock_cache();
            work.iter()
                .map(|p| cache.lookup_and_insert(&p.hashes, p.n_tokens) as u64)
                .collect()
        };
        let total: u64 = work.iter().map(|p| p.n_tokens as u64).sum();
        let hits: u64 = cached.iter().sum();
        c.prompt_tokens.fetch_add(total, Ordering::Relaxed);
        c.cache_queries.fetch_add(total, Ordering::Relaxed);
        c.cache_hits.fetch_add(hits, Ordering::Relaxed);
        let cfg = &self.inner.cfg;
        let uncached = total.saturating_sub(hits) as f64;
        let cost = self.scaled_secs(
            cfg.ttft_base.as_secs_f64() + cfg.prefill_per_token.as_secs_f64() * uncached,
        );
        // A single-server FIFO queue: start when both the request and the server
        // are there. Using nominal times keeps timer overshoot from accumulating.
        let start = arrival.max(*last_end);
        let end = start + cost;
        *last_end = end;
        wait_until(end).await;
        drop(last_end);
        (Prefilled { end, cached }, running)
    }

    fn finish(&self, work: &[PromptWork], n: u64) {
        let c = &self.inner.counters;
        c.generation_tokens
            .fetch_add(n * work.len() as u64, Ordering::Relaxed);
        c.requests_finished.fetch_add(1, Ordering::Relaxed);
    }

    /// Streams one request's SSE chunks into `tx`; returns early when the client
    /// has gone (send fails).
    async fn stream(
        &self,
        shape: &Shape,
        sim: &SimRequest,
        work: &[PromptWork],
        arrival: Instant,
        tx: &mpsc::Sender<Bytes>,
    ) {
        let (pre, _running) = self.prefill(work, arrival).await;
        let itl = self.scaled_secs(self.inner.cfg.itl.as_secs_f64());
        let n = sim.max_tokens;
        if shape.endpoint == Endpoint::Chat {
            for i in 0..work.len() {
                if tx.send(shape.role_chunk(i)).await.is_err() {
                    return;
                }
            }
        }
        let mut due = pre.end;
        for k in 0..n {
            wait_until(due).await;
            let last = k + 1 == n;
            for i in 0..work.len() {
                if tx.send(shape.token_chunk(i, k, last)).await.is_err() {
                    return;
                }
            }
            due += itl;
        }
        self.finish(work, n);
        if sim.include_usage {
            let _ = tx
                .send(shape.usage_chunk(&work_usage(work, &pre.cached, n)))
                .await;
        }
        let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
    }
}

/// Sleeps until `deadline`, or not at all when it has passed. tokio's timer
/// rounds deadlines up to the next millisecond tick, so sleeping until "now" would
/// cost up to a millisecond per call: at `time_factor` 0 that would turn an instant
/// answer into a ~1 ms one, and make the prefill lock (held across the sleep) a
/// one-request-per-tick queue.
async fn wait_until(deadline: Instant) {
    if deadline > Instant::now() {
        tokio::time::sleep_until(deadline).await;
    }
}

fn work_usage(work: &[PromptWork], cached: &[u64], n: u64) -> Usage {
    let prompt: u64 = work.iter().map(|p| p.n_tokens as u64).sum();
    Usage::new(prompt, n * work.len() as u64, cached.iter().sum())
}

/// Output token `k` (deterministic filler text, one word with a leading space).
fn output_word(k: u64) -> &'static str {
    WORDS[(k % WORDS.len() as u64) as usize]
}

/// Response identity and the JSON shapes built from it.
#[derive(Debug, Clone)]
struct Shape {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
}

impl Shape {
    fn object_chunk(&self) -> &'static str {
        match self.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completions => "text_completion",
        }
    }

    fn sse(value: &Value) -> Bytes {
        Bytes::from(format!("data: {value}\n\n"))
    }

    fn role_chunk(&self, index: usize) -> Bytes {
        Self::sse(&json!({
            "id": self.id, "object": self.object_chunk(), "created": self.created, "model": self.model,
            "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                         "logprobs": null, "finish_reason": null}],
        }))
    }

    fn token_chunk(&self, index: usize, k: u64, last: bool) -> Bytes {
        let text = format!(" {}", output_word(k));
        let finish = if last { json!("length") } else { Value::Null };
        let choice = match self.endpoint {
            Endpoint::Chat => json!({"index": index, "delta": {"content": text},
                                     "logprobs": null, "finish_reason": finish}),
            Endpoint::Completions => json!({"index": index, "text": text, "logprobs": null,
                                            "finish_reason": finish, "stop_reason": null}),
        };
        Self::sse(&json!({
            "id": self.id, "object": self.object_chunk(), "created": self.created,
            "model": self.model, "choices": [choice],
        }))
    }

    /// The final usage chunk vLLM sends when `stream_options.include_usage` is true.
    fn usage_chunk(&self, usage: &Usage) -> Bytes {
        Self::sse(&json!({
            "id": self.id, "object": self.object_chunk(), "created": self.created,
            "model": self.model, "choices": [], "usage": usage,
        }))
    }

    fn full_response(&self, work: &[PromptWork], cached: &[u64], n: u64) -> Value {
        let text: String = (0..n).map(|k| format!(" {}", output_word(k))).collect();
        let choices: Vec<Value> = (0..work.len())
            .map(|i| match self.endpoint {
                Endpoint::Chat => json!({
                    "index": i,
                    "message": {"role": "assistant", "content": text, "tool_calls": []},
                    "logprobs": null, "finish_reason": "length", "stop_reason": null,
                }),
                Endpoint::Completions => json!({
                    "index": i, "text": text, "logprobs": null,
                    "finish_reason": "length", "stop_reason": null,
                }),
            })
            .collect();
        let object = match self.endpoint {
            Endpoint::Chat => "chat.completion",
            Endpoint::Completions => "text_completion",
        };
        json!({
            "id": self.id, "object": object, "created": self.created, "model": self.model,
            "choices": choices, "usage": work_usage(work, cached, n),
        })
    }
}

/// Validates a generation body and extracts what the simulation needs. The error
/// is the message of a 400 response.
fn parse_request(endpoint: Endpoint, body: &[u8], max_output: u64) -> Result<SimRequest, String> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| format!("body is not valid JSON: {e}"))?;
    let obj = v.as_object().ok_or("request body must be a JSON object")?;
    let prompts = match endpoint {
        Endpoint::Chat => vec![chat_template(obj.get("messages"))?],
        Endpoint::Completions => completion_prompts(obj.get("prompt"))?,
    };
    let present = |k: &str| obj.get(k).filter(|v| !v.is_null());
    let max_tokens = match present("max_completion_tokens").or_else(|| present("max_tokens")) {
        None => 16,
        Some(v) => v
            .as_u64()
            .filter(|&n| n >= 1)
            .ok_or("max_tokens must be an integer >= 1")?,
    };
    let stream = match present("stream") {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err("stream must be a boolean".into()),
    };
    let include_usage = present("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    Ok(SimRequest {
        endpoint,
        prompts,
        max_tokens: max_tokens.min(max_output.max(1)),
        stream,
        include_usage,
    })
}

/// The chat template: `<|im_start|>ROLE\nCONTENT\n<|im_end|>\n` per message, then
/// the generation prompt `<|im_start|>assistant\n`. Content may be a string, null,
/// or an array of parts (text parts in order; other parts become `<TYPE>`); tool
/// calls add their function name and arguments.
pub fn chat_template(messages: Option<&Value>) -> Result<String, String> {
    let list = messages
        .and_then(Value::as_array)
        .ok_or("messages must be an array of messages")?;
    if list.is_empty() {
        return Err("messages must not be empty".into());
    }
    let mut out = String::new();
    for (i, m) in list.iter().enumerate() {
        let m = m
            .as_object()
            .ok_or_else(|| format!("messages[{i}] must be an object"))?;
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("messages[{i}].role must be a string"))?;
        out.push_str("<|im_start|>");
        out.push_str(role);
        out.push('\n');
        push_content(&mut out, m, i)?;
        out.push_str("\n<|im_end|>\n");
    }
    out.push_str("<|im_start|>assistant\n");
    Ok(out)
}

fn push_content(out: &mut String, m: &Map<String, Value>, i: usize) -> Result<(), String> {
    match m.get("content") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => out.push_str(s),
        Some(Value::Array(parts)) => {
            for (j, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str);
                match (kind, part.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(text)) => out.push_str(text),
                    (Some(other), _) if other != "text" => {
                        out.push_str(&format!(" <{other}> "));
                    }
                    _ => {
                        return Err(format!(
                            "messages[{i}].content[{j}] must be a content part with a type"
                        ));
                    }
                }
            }
        }
        Some(_) => {
            return Err(format!(
                "messages[{i}].content must be a string or an array of content parts"
            ));
        }
    }
    if let Some(calls) = m.get("tool_calls").and_then(Value::as_array) {
        for call in calls {
            let f = call.get("function");
            for key in ["name", "arguments"] {
                if let Some(s) = f.and_then(|f| f.get(key)).and_then(Value::as_str) {
                    out.push(' ');
                    out.push_str(s);
                }
            }
        }
    }
    Ok(())
}

/// `prompt` of `/v1/completions`: a string, an array of strings, an array of
/// token ids, or an array of token-id arrays. Token ids become words ("1 2 3").
fn completion_prompts(prompt: Option<&Value>) -> Result<Vec<String>, String> {
    const SHAPE: &str = "prompt must be a string, an array of strings, an array of token ids \
                         or an array of token-id arrays";
    let ids = |a: &[Value]| -> Result<String, String> {
        let ids: Option<Vec<String>> = a
            .iter()
            .map(|x| x.as_u64().map(|n| n.to_string()))
            .collect();
        ids.map(|v| v.join(" ")).ok_or_else(|| SHAPE.to_string())
    };
    let prompts = match prompt {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) if items.is_empty() => {
            return Err("prompt must not be empty".into());
        }
        Some(Value::Array(items)) => match &items[0] {
            Value::String(_) => items
                .iter()
                .map(|x| {
                    x.as_str()
                        .map(str::to_owned)
                        .ok_or_else(|| SHAPE.to_string())
                })
                .collect::<Result<_, _>>()?,
            Value::Number(_) => vec![ids(items)?],
            Value::Array(_) => items
                .iter()
                .map(|x| {
                    x.as_array()
                        .ok_or_else(|| SHAPE.to_string())
                        .and_then(|a| ids(a))
                })
                .collect::<Result<_, _>>()?,
            _ => return Err(SHAPE.into()),
        },
        _ => return Err(SHAPE.into()),
    };
    if prompts
        .iter()
        .any(|p| p.split_whitespace().next().is_none())
    {
        return Err("prompt must not be empty".into());
    }
    Ok(prompts)
}

fn escape_label(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn full(status: StatusCode, content_type: Option<&'static str>, body: Bytes) -> Response<RespBody> {
    let mut resp = Response::new(Full::new(body).boxed());
    *resp.status_mut() = status;
    if let Some(ct) = content_type {
        resp.headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static(ct));
    }
    resp
}

fn json_response(status: StatusCode, value: &Value) -> Response<RespBody> {
    full(
        status,
        Some("application/json"),
        Bytes::from(value.to_string()),
    )
}

/// `{"error":{"message","type","param":null,"code"}}` with the given status.
fn error_response(status: StatusCode, message: &str, kind: &str) -> Response<RespBody> {
    json_response(
        status,
        &json!({"error": {"message": message, "type": kind, "param": null, "code": status.as_u16()}}),
    )
}

/// A response body fed by a channel: one data frame per message, ends when the
/// sender is dropped. Dropping the body (client gone) makes the sender fail.
struct ChannelBody {
    rx: mpsc::Receiver<Bytes>,
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.rx.poll_recv(cx).map(|m| m.map(|b| Ok(Frame::data(b))))
    }
}

/// Serves `cfg` on `listener` forever (until the future is dropped).
pub async fn serve(listener: TcpListener, cfg: EngineConfig) -> Result<(), ConfigError> {
    let engine = Engine::new(cfg)?;
    engine
        .serve_with_shutdown(listener, std::future::pending())
        .await;
    Ok(())
}

/// An engine serving on a background task; dropping it stops the engine.
#[derive(Debug)]
pub struct RunningEngine {
    addr: SocketAddr,
    engine: Engine,
    task: JoinHandle<()>,
}

impl RunningEngine {
    /// The bound address (127.0.0.1 and an ephemeral port).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Base URL, e.g. `http://127.0.0.1:40123` (no trailing slash).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The engine, for [`Engine::stats`].
    pub fn engine(&self) -> &Engine {
        &self.engine
    }
}

impl Drop for RunningEngine {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Why [`start`] failed.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Binding 127.0.0.1:0 failed.
    #[error("cannot bind 127.0.0.1:0: {0}")]
    Bind(#[from] std::io::Error),
}

/// Listen backlog of [`bind`]: uvicorn's default (vLLM's HTTP server). tokio's
/// `TcpListener::bind` uses 128, which a burst of a few hundred connects overflows:
/// the kernel then drops SYNs and the client retries after 1 s.
pub const LISTEN_BACKLOG: u32 = 2048;

/// Binds `addr` with SO_REUSEADDR and a [`LISTEN_BACKLOG`] backlog (the kernel caps
/// it at `net.core.somaxconn`); the first address that works wins.
pub async fn bind(addr: impl tokio::net::ToSocketAddrs) -> std::io::Result<TcpListener> {
    let mut last = None;
    for a in tokio::net::lookup_host(addr).await? {
        let socket = if a.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        socket.set_reuseaddr(true)?;
        match socket.bind(a).and_then(|()| socket.listen(LISTEN_BACKLOG)) {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::AddrNotAvailable, "no address to bind")
    }))
}

/// Binds 127.0.0.1:0 and serves `cfg` on a spawned task (needs a tokio runtime).
pub async fn start(cfg: EngineConfig) -> Result<RunningEngine, StartError> {
    let engine = Engine::new(cfg)?;
    let listener = bind(("127.0.0.1", 0)).await?;
    let addr = listener.local_addr()?;
    let task = tokio::spawn(
        engine
            .clone()
            .serve_with_shutdown(listener, std::future::pending()),
    );
    Ok(RunningEngine { addr, engine, task })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nz(n: usize) -> NonZeroUsize {
        NonZeroUsize::new(n).unwrap()
    }

    fn words(n: usize, salt: usize) -> Vec<String> {
        (0..n).map(|i| format!("w{}", i * 7 + salt)).collect()
    }

    #[test]
    fn block_hashes_cover_full_blocks_and_chain_on_prefix() {
        let a = words(40, 0);
        let (n, ha) = block_hashes(a.iter().map(String::as_str), 16);
        assert_eq!((n, ha.len()), (40, 2));
        // Same second block after a different first block: a different hash.
        let mut b = a.clone();
        b[0] = "other".into();
        let (_, hb) = block_hashes(b.iter().map(String::as_str), 16);
        assert_ne!(ha[0], hb[0]);
        assert_ne!(ha[1], hb[1]);
        // Same first block, different second: first hash equal.
        let mut c = a.clone();
        c[20] = "other".into();
        let (_, hc) = block_hashes(c.iter().map(String::as_str), 16);
        assert_eq!(ha[0], hc[0]);
        assert_ne!(ha[1], hc[1]);
    }

    #[test]
    fn cached_tokens_count_leading_blocks_and_spare_the_last_token() {
        let mut cache = PrefixCache::new(nz(100), nz(4));
        let a = words(10, 0);
        let (n, h) = block_hashes(a.iter().map(String::as_str), 4);
        assert_eq!(cache.lookup_and_insert(&h, n), 0);
        assert_eq!(cache.len(), 2);
        assert_eq!(cache.lookup_and_insert(&h, n), 8);
        // A prompt of exactly two full blocks: the last token is recomputed, so
        // only the first block counts.
        let b = words(8, 0);
        let (nb, hb) = block_hashes(b.iter().map(String::as_str), 4);
        assert_eq!(cache.lookup_and_insert(&hb, nb), 4);
        // Divergence in block 0 means no hit at all, even if later blocks exist.
        let mut c = a.clone();
        c[1] = "x".into();
        let (nc, hc) = block_hashes(c.iter().map(String::as_str), 4);
        assert_eq!(cache.cached_tokens(&hc, nc), 0);
    }

    #[test]
    fn lru_evicts_least_recent_chains_from_their_tail() {
        let mut cache = PrefixCache::new(nz(4), nz(2));
        let a = words(6, 0); // 3 blocks
        let b = words(6, 1); // 3 blocks, unrelated
        let (na, ha) = block_hashes(a.iter().map(String::as_str), 2);
        let (nb, hb) = block_hashes(b.iter().map(String::as_str), 2);
        cache.lookup_and_insert(&ha, na);
        cache.lookup_and_insert(&hb, nb);
        assert_eq!(cache.len(), 4);
        // a's tail blocks went first: its first block is still there.
        assert_eq!(cache.cached_tokens(&ha, na), 2);
        assert_eq!(cache.cached_tokens(&hb, nb), 4);
        // Touching a again makes b the victim, tail first: b keeps its first block.
        cache.lookup_and_insert(&ha, na);
        assert_eq!(cache.cached_tokens(&ha, na), 4);
        assert_eq!(cache.cached_tokens(&hb, nb), 2);
        assert_eq!(cache.len(), 4);
    }

    fn shape(endpoint: Endpoint) -> Shape {
        Shape {
            endpoint,
            id: "chatcmpl-x-1".into(),
            created: 1,
            model: "m".into(),
        }
    }

    fn parse_sse(b: &Bytes) -> Value {
        let s = std::str::from_utf8(b).unwrap();
        let payload = s
            .strip_prefix("data: ")
            .unwrap()
            .strip_suffix("\n\n")
            .unwrap();
        serde_json::from_str(payload).unwrap()
    }

    #[test]
    fn usage_chunk_has_empty_choices_and_cached_tokens() {
        let v = parse_sse(&shape(Endpoint::Chat).usage_chunk(&Usage::new(100, 7, 64)));
        assert_eq!(v["object"], "chat.completion.chunk");
        assert_eq!(v["choices"], json!([]));
        assert_eq!(v["usage"]["prompt_tokens"], 100);
        assert_eq!(v["usage"]["completion_tokens"], 7);
        assert_eq!(v["usage"]["total_tokens"], 107);
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 64);
    }

    #[test]
    fn token_chunks_follow_vllm_shapes() {
        let chat = parse_sse(&shape(Endpoint::Chat).token_chunk(0, 0, true));
        assert_eq!(chat["choices"][0]["delta"]["content"], " the");
        assert_eq!(chat["choices"][0]["finish_reason"], "length");
        let cmpl = parse_sse(&shape(Endpoint::Completions).token_chunk(0, 1, false));
        assert_eq!(cmpl["object"], "text_completion");
        assert_eq!(cmpl["choices"][0]["text"], " of");
        assert!(cmpl["choices"][0]["finish_reason"].is_null());
    }

    #[test]
    fn chat_template_reads_strings_parts_and_tool_calls() {
        let msgs = json!([
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello"},
                                         {"type": "image_url", "image_url": {"url": "x"}},
                                         {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": null,
             "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
        ]);
        let text = chat_template(Some(&msgs)).unwrap();
        let w: Vec<&str> = text.split_whitespace().collect();
        assert_eq!(
            w,
            [
                "<|im_start|>system",
                "be",
                "brief",
                "<|im_end|>",
                "<|im_start|>user",
                "hello",
                "<image_url>",
                "there",
                "<|im_end|>",
                "<|im_start|>assistant",
                "f",
                "{}",
                "<|im_end|>",
                "<|im_start|>assistant"
            ]
        );
    }

    #[test]
    fn bad_requests_are_rejected_with_messages() {
        let bad: [(Endpoint, &str); 8] = [
            (Endpoint::Chat, "not json"),
            (Endpoint::Chat, "[]"),
            (Endpoint::Chat, r#"{"messages": []}"#),
            (Endpoint::Chat, r#"{"messages": [{"content": "x"}]}"#),
            (
                Endpoint::Chat,
                r#"{"messages": [{"role": "user", "content": 5}]}"#,
            ),
            (
                Endpoint::Chat,
                r#"{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}"#,
            ),
            (Endpoint::Completions, r#"{"prompt": 42}"#),
            (Endpoint::Completions, r#"{"prompt": ""}"#),
        ];
        for (ep, body) in bad {
            assert!(parse_request(ep, body.as_bytes(), 100).is_err(), "{body}");
        }
        let ok = parse_request(
            Endpoint::Completions,
            br#"{"prompt": [[1,2],[3]], "max_tokens": 500, "stream": true}"#,
            100,
        )
        .unwrap();
        assert_eq!(ok.prompts, ["1 2", "3"]);
        assert_eq!(
            (ok.max_tokens, ok.stream, ok.include_usage),
            (100, true, false)
        );
    }
}

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
//!   `ttft_base + uncached_tokens × prefill_per_token`. Other physics
//!   ([`Physics`], `prefill_physics`): up to `prefill_slots` at once, each at full
//!   speed or sharing it (see [`crate::prefill`]). **decode**: concurrent,
//!   first token at the end of prefill, then one token per `itl`. Every simulated
//!   duration is multiplied by `time_factor`; at 0 the engine answers at once (no
//!   timer is armed for a deadline already reached).
//!
//! Endpoints: `POST /v1/chat/completions`, `POST /v1/completions` (streamed SSE or
//! not, vLLM response shapes), `POST /v1/messages` (Anthropic Messages API as vLLM
//! serves it: converted to a chat conversation, so it shares the prefix cache and the
//! timing model with chat; JSON or Anthropic SSE events) and
//! `POST /v1/messages/count_tokens`; `POST /tokenize`, `POST /detokenize`,
//! `POST /v1/chat/completions/render`, `POST /v1/completions/render` (vLLM's
//! tokenizer endpoints, answered at once: see [`token_id`]); `POST /v1/embeddings`
//! (OpenAI shape, deterministic vectors of [`crate::embeddings`], answered at once:
//! no prefill queue, no prefix cache, counted in `sim:embedding_requests_total`);
//! `GET /health`, `GET /v1/models`, `GET /metrics` (Prometheus text with vLLM's
//! metric names, or SGLang's with [`MetricsFlavor::Sglang`], plus the simulator's
//! own `sim:` rows).
//! Every response carries `x-sim-engine: NAME`. Bad requests get a 400 JSON error,
//! never a panic.
//!
//! Admission: with `max_waiting` N > 0, a generation request that finds N requests
//! already waiting for the prefill slot is answered at once with 429, a
//! `Retry-After: <retry_after_secs>` header and an OpenAI-shaped error body
//! (Anthropic's shape on `/v1/messages`); it is counted in `sim:rejected_total` and
//! never touches the cache or the queue.
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
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

use crate::embeddings;
pub use crate::prefill::Physics;
use crate::prefill::SharedPrefill;
use crate::prompts::WORDS;
pub use cache_aware_router::simulate::engine::{PrefixCache, block_hashes};

/// Response header naming the replica that served a request.
pub const ENGINE_HEADER: &str = "x-sim-engine";

/// Size of the simulated vocabulary (Qwen2.5's): every token id is below it.
pub const VOCAB_SIZE: u32 = 151_936;

/// Context length reported by `/v1/models` and `/tokenize`, in tokens.
pub const MAX_MODEL_LEN: u64 = 131_072;

/// The chat template's role markers, which get fixed ids right after [`WORDS`].
const TEMPLATE_WORDS: [&str; 5] = [
    "<|im_start|>system",
    "<|im_start|>user",
    "<|im_start|>assistant",
    "<|im_start|>tool",
    "<|im_end|>",
];

/// First id of the hashed part of the vocabulary; ids below it are fixed words.
const HASHED_IDS_START: u32 = 1024;

/// The token id of one whitespace-separated word (the engine's tokenizer, see the
/// module docs): the prompt words of the traces (`prompts::WORDS`) are ids 0–255 in
/// that order, the chat template's role markers 256–260, a word written `<|tok_N|>`
/// is id `N` (what [`token_word`] makes of an id it cannot spell), and any other word
/// is xxh3 of its bytes mapped into `1024..VOCAB_SIZE`. Stable across engines, runs
/// and machines.
pub fn token_id(word: &str) -> u32 {
    static FIXED: std::sync::OnceLock<std::collections::HashMap<&'static str, u32>> =
        std::sync::OnceLock::new();
    let fixed = FIXED.get_or_init(|| {
        WORDS
            .iter()
            .chain(TEMPLATE_WORDS.iter())
            .enumerate()
            .map(|(i, w)| (*w, i as u32))
            .collect()
    });
    if let Some(&id) = fixed.get(word) {
        return id;
    }
    if let Some(n) = word
        .strip_prefix("<|tok_")
        .and_then(|r| r.strip_suffix("|>"))
        .and_then(|n| n.parse::<u32>().ok())
        .filter(|&n| n < VOCAB_SIZE)
    {
        return n;
    }
    let span = u64::from(VOCAB_SIZE - HASHED_IDS_START);
    HASHED_IDS_START + (xxhash_rust::xxh3::xxh3_64(word.as_bytes()) % span) as u32
}

/// The word of a token id: a fixed word for ids below 261, `<|tok_N|>` for any
/// other id of the vocabulary (hashed ids cannot be inverted; [`token_id`] maps that
/// spelling back to `N`), `None` past [`VOCAB_SIZE`].
pub fn token_word(id: u64) -> Option<String> {
    if id >= u64::from(VOCAB_SIZE) {
        return None;
    }
    let i = id as usize;
    Some(if i < WORDS.len() {
        WORDS[i].to_owned()
    } else if i < WORDS.len() + TEMPLATE_WORDS.len() {
        TEMPLATE_WORDS[i - WORDS.len()].to_owned()
    } else {
        format!("<|tok_{id}|>")
    })
}

/// Token ids of a prompt text (one per whitespace-separated word).
pub fn tokenize_text(text: &str) -> Vec<u32> {
    text.split_whitespace().map(token_id).collect()
}

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
    /// Metric names of `GET /metrics`: vLLM's (default) or SGLang's.
    pub metrics_flavor: MetricsFlavor,
    /// Most requests waiting for the prefill slot, in requests; a generation
    /// request arriving when this many already wait gets 429. 0 = unbounded.
    pub max_waiting: usize,
    /// `Retry-After` of a 429, in whole seconds.
    pub retry_after_secs: u64,
    /// How prefills share the engine ([`Physics`]; default one at a time).
    pub prefill_physics: Physics,
    /// Prefills running at once under [`Physics::Parallel`] and [`Physics::Shared`]
    /// (at least 1; the serial physics runs one).
    pub prefill_slots: usize,
}

/// Which serving engine's metric names `GET /metrics` uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MetricsFlavor {
    /// vLLM: `vllm:num_requests_waiting`, `vllm:num_requests_running`,
    /// `vllm:kv_cache_usage_perc`, ... with labels `{engine="0",model_name="M"}`.
    #[default]
    Vllm,
    /// SGLang: `sglang:num_queue_reqs`, `sglang:num_running_reqs`,
    /// `sglang:token_usage`, ... with labels `{model_name="M"}`.
    Sglang,
}

impl MetricsFlavor {
    /// `vllm` or `sglang` (what [`std::str::FromStr`] reads).
    pub fn as_str(self) -> &'static str {
        match self {
            MetricsFlavor::Vllm => "vllm",
            MetricsFlavor::Sglang => "sglang",
        }
    }
}

impl std::fmt::Display for MetricsFlavor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for MetricsFlavor {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "vllm" => Ok(MetricsFlavor::Vllm),
            "sglang" => Ok(MetricsFlavor::Sglang),
            other => Err(format!(
                "unknown metrics flavor {other:?}: use vllm or sglang"
            )),
        }
    }
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
            metrics_flavor: MetricsFlavor::Vllm,
            max_waiting: 0,
            retry_after_secs: 1,
            prefill_physics: Physics::Serial,
            prefill_slots: 6,
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
    /// Most requests ever queued for prefill at once (high-water mark of
    /// `waiting` since start).
    pub waiting_peak: u64,
    /// Generation requests answered 429 because `max_waiting` requests waited.
    pub rejected: u64,
    /// `POST /v1/embeddings` requests answered 200 (not in any other counter).
    pub embedding_requests: u64,
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
    waiting_peak: AtomicU64,
    rejected: AtomicU64,
    embedding_requests: AtomicU64,
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

/// A request admitted to the prefill queue: counted in `waiting` until dropped
/// (once it holds the prefill slot, or when its client leaves first). Owns an
/// `Arc` so it can move into a streaming task.
struct Waiting(Arc<Inner>);

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.counters.waiting.fetch_sub(1, Ordering::Relaxed);
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
    /// The prefill slots of the parallel and shared physics (FIFO: tokio's semaphore is
    /// fair).
    slots: tokio::sync::Semaphore,
    /// The shared physics' processor sharing.
    shared: SharedPrefill,
    counters: Counters,
    created: u64,
}

/// Response body of every handler.
pub type RespBody = BoxBody<Bytes, Infallible>;

/// Which endpoint a generation request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Completions,
    /// Anthropic Messages (`/v1/messages`).
    Messages,
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
        let slots = cfg.prefill_slots.max(1);
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Ok(Self {
            inner: Arc::new(Inner {
                cfg,
                name_header,
                cache: Mutex::new(PrefixCache::new(kv, bs)),
                prefill: tokio::sync::Mutex::new(Instant::now()),
                slots: tokio::sync::Semaphore::new(slots),
                shared: SharedPrefill::default(),
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
            waiting_peak: r(&c.waiting_peak),
            rejected: r(&c.rejected),
            embedding_requests: r(&c.embedding_requests),
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
            (Method::POST, "/v1/messages") => self.generate(Endpoint::Messages, req).await,
            (Method::POST, "/v1/messages/count_tokens") => self.count_tokens(req).await,
            (Method::POST, "/v1/embeddings") => self.embeddings(req).await,
            (Method::POST, "/tokenize") => self.tokenize(req).await,
            (Method::POST, "/detokenize") => self.detokenize(req).await,
            (Method::POST, "/v1/chat/completions/render") => self.render(Endpoint::Chat, req).await,
            (Method::POST, "/v1/completions/render") => {
                self.render(Endpoint::Completions, req).await
            }
            (_, "/health" | "/v1/models" | "/metrics")
            | (_, "/v1/chat/completions" | "/v1/completions" | "/v1/messages")
            | (_, "/v1/messages/count_tokens" | "/tokenize" | "/detokenize")
            | (_, "/v1/embeddings")
            | (_, "/v1/chat/completions/render" | "/v1/completions/render") => error_response(
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
                "max_model_len": MAX_MODEL_LEN,
            }],
        });
        json_response(StatusCode::OK, &body)
    }

    /// Prometheus text exposition: vLLM's or SGLang's metric names (see
    /// [`MetricsFlavor`]), then the simulator's own rows, in both flavors:
    /// `sim:num_requests_waiting_peak` (gauge, requests), `sim:rejected_total`
    /// (counter, requests answered 429) and `sim:embedding_requests_total`
    /// (counter, `/v1/embeddings` requests answered 200).
    pub fn metrics_text(&self) -> String {
        let s = self.stats();
        let model = escape_label(&self.inner.cfg.model);
        let usage = s.kv_blocks_used as f64 / self.lock_cache().capacity().max(1) as f64;
        let (labels, mut rows): (String, Vec<(&str, &str, &str, String)>) =
            match self.inner.cfg.metrics_flavor {
                MetricsFlavor::Vllm => (
                    format!("{{engine=\"0\",model_name=\"{model}\"}}"),
                    vec![
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
                    ],
                ),
                MetricsFlavor::Sglang => {
                    let hit_rate = if s.cache_queries > 0 {
                        s.cache_hits as f64 / s.cache_queries as f64
                    } else {
                        0.0
                    };
                    let used_tokens = s.kv_blocks_used * self.inner.cfg.block_size as u64;
                    (
                        format!("{{model_name=\"{model}\"}}"),
                        vec![
                            (
                                "sglang:num_running_reqs",
                                "gauge",
                                "The number of running requests",
                                s.running.to_string(),
                            ),
                            (
                                "sglang:num_queue_reqs",
                                "gauge",
                                "The number of requests in the waiting queue",
                                s.waiting.to_string(),
                            ),
                            (
                                "sglang:token_usage",
                                "gauge",
                                "The token usage (fraction of KV cache in use, 0-1)",
                                usage.to_string(),
                            ),
                            (
                                "sglang:num_used_tokens",
                                "gauge",
                                "The number of used tokens",
                                used_tokens.to_string(),
                            ),
                            (
                                "sglang:cache_hit_rate",
                                "gauge",
                                "The cache hit rate (cached over prompt tokens since start)",
                                hit_rate.to_string(),
                            ),
                            (
                                "sglang:prompt_tokens_total",
                                "counter",
                                "Number of prefill tokens processed.",
                                s.prompt_tokens.to_string(),
                            ),
                            (
                                "sglang:generation_tokens_total",
                                "counter",
                                "Number of generation tokens processed.",
                                s.generation_tokens.to_string(),
                            ),
                        ],
                    )
                }
            };
        rows.push((
            "sim:num_requests_waiting_peak",
            "gauge",
            "Most requests queued for prefill at once since start.",
            s.waiting_peak.to_string(),
        ));
        rows.push((
            "sim:rejected_total",
            "counter",
            "Generation requests answered 429 because max_waiting requests were queued.",
            s.rejected.to_string(),
        ));
        rows.push((
            "sim:embedding_requests_total",
            "counter",
            "Embedding requests answered (outside the prefill queue and the prefix cache).",
            s.embedding_requests.to_string(),
        ));
        let mut out = String::new();
        for (name, kind, help, value) in rows {
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{labels} {value}\n"
            ));
        }
        out
    }

    /// Admits one request to the prefill queue (`waiting` + 1, peak updated), or
    /// `None` when `max_waiting` requests already wait (counted as rejected).
    fn admit(&self) -> Option<Waiting> {
        let c = &self.inner.counters;
        let max = self.inner.cfg.max_waiting as u64;
        let before = c
            .waiting
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |w| {
                (max == 0 || w < max).then_some(w + 1)
            });
        match before {
            Ok(w) => {
                c.waiting_peak.fetch_max(w + 1, Ordering::Relaxed);
                Some(Waiting(self.inner.clone()))
            }
            Err(_) => {
                c.rejected.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    /// The 429 of a request [`Self::admit`] turned away: `Retry-After` and the
    /// endpoint's error shape.
    fn too_busy(&self, endpoint: Endpoint) -> Response<RespBody> {
        let cfg = &self.inner.cfg;
        let msg = format!(
            "{} requests are already waiting (max_waiting {}); retry after {} s",
            self.inner.counters.waiting.load(Ordering::Relaxed),
            cfg.max_waiting,
            cfg.retry_after_secs
        );
        let mut resp = match endpoint {
            Endpoint::Messages => anthropic_error(StatusCode::TOO_MANY_REQUESTS, &msg),
            _ => error_response(StatusCode::TOO_MANY_REQUESTS, &msg, "rate_limit_error"),
        };
        resp.headers_mut().insert(
            hyper::header::RETRY_AFTER,
            HeaderValue::from(cfg.retry_after_secs),
        );
        resp
    }

    /// The whole request body, or the error answer (413 past `max_body_bytes`).
    async fn read_body(&self, req: Request<Incoming>) -> Result<Bytes, (StatusCode, String)> {
        let limit = self.inner.cfg.max_body_bytes;
        match Limited::new(req.into_body(), limit).collect().await {
            Ok(collected) => Ok(collected.to_bytes()),
            Err(e) if e.is::<http_body_util::LengthLimitError>() => Err((
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("request body exceeds {limit} bytes"),
            )),
            Err(e) => Err((
                StatusCode::BAD_REQUEST,
                format!("cannot read request body: {e}"),
            )),
        }
    }

    async fn generate(&self, endpoint: Endpoint, req: Request<Incoming>) -> Response<RespBody> {
        let arrival = Instant::now();
        // Anthropic clients get Anthropic's error shape.
        let fail = |status: StatusCode, msg: &str| match endpoint {
            Endpoint::Messages => anthropic_error(status, msg),
            _ => error_response(status, msg, "invalid_request_error"),
        };
        let body = match self.read_body(req).await {
            Ok(body) => body,
            Err((status, msg)) => return fail(status, &msg),
        };
        let sim = match parse_request(endpoint, &body, self.inner.cfg.max_output_tokens) {
            Ok(sim) => sim,
            Err(msg) => return fail(StatusCode::BAD_REQUEST, &msg),
        };
        let Some(waiting) = self.admit() else {
            return self.too_busy(endpoint);
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
            Endpoint::Chat => "chatcmpl-",
            Endpoint::Completions => "cmpl-",
            Endpoint::Messages => "msg_",
        };
        let shape = Shape {
            endpoint,
            id: format!("{prefix}{}-{id_num}", self.inner.cfg.name),
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
                    () = engine.stream(&shape, &sim, &work, arrival, waiting, &tx) => {}
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
            let (pre, _running) = self.prefill(&work, arrival, waiting).await;
            let n = sim.max_tokens;
            let decode = self.inner.cfg.itl.as_secs_f64() * n.saturating_sub(1) as f64;
            let last = pre.end + self.scaled_secs(decode);
            wait_until(last).await;
            self.finish(&work, n);
            json_response(StatusCode::OK, &shape.full_response(&work, &pre.cached, n))
        }
    }

    /// Queues for the prefill slot (counted in `waiting` by the admitted
    /// `waiting` until the slot is held), looks the prompts up in the cache and
    /// waits out the prefill. The returned guard keeps the request counted as
    /// running.
    async fn prefill(
        &self,
        work: &[PromptWork],
        arrival: Instant,
        waiting: Waiting,
    ) -> (Prefilled, GaugeGuard<'_>) {
        let c = &self.inner.counters;
        let physics = self.inner.cfg.prefill_physics;
        if physics != Physics::Serial {
            return self.prefill_in_slot(work, waiting).await;
        }
        let mut last_end = self.inner.prefill.lock().await;
        drop(waiting);
        let running = GaugeGuard::new(&c.running);
        let cost = self.look_up(work);
        // A single-server FIFO queue: start when both the request and the server
        // are there. Using nominal times keeps timer overshoot from accumulating.
        let start = arrival.max(*last_end);
        let end = start + cost.0;
        *last_end = end;
        wait_until(end).await;
        drop(last_end);
        (
            Prefilled {
                end,
                cached: cost.1,
            },
            running,
        )
    }

    /// The parallel and shared physics: waits for one of the prefill slots (FIFO),
    /// then prefills at full speed or at its share of it.
    async fn prefill_in_slot(
        &self,
        work: &[PromptWork],
        waiting: Waiting,
    ) -> (Prefilled, GaugeGuard<'_>) {
        let c = &self.inner.counters;
        // Never closed: the engine owns it.
        let slot = self.inner.slots.acquire().await.ok();
        drop(waiting);
        let running = GaugeGuard::new(&c.running);
        let (cost, cached) = self.look_up(work);
        let end = if self.inner.cfg.prefill_physics == Physics::Shared {
            self.inner.shared.run(cost).await
        } else {
            let end = Instant::now() + cost;
            wait_until(end).await;
            end
        };
        drop(slot);
        (Prefilled { end, cached }, running)
    }

    /// Looks the prompts up in the cache (inserting them), counts them, and returns the
    /// prefill's duration at full speed and the cached tokens per prompt.
    fn look_up(&self, work: &[PromptWork]) -> (Duration, Vec<u64>) {
        let c = &self.inner.counters;
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
        (cost, cached)
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
        waiting: Waiting,
        tx: &mpsc::Sender<Bytes>,
    ) {
        let (pre, _running) = self.prefill(work, arrival, waiting).await;
        let itl = self.scaled_secs(self.inner.cfg.itl.as_secs_f64());
        let n = sim.max_tokens;
        if shape.endpoint == Endpoint::Messages {
            return self.stream_messages(shape, work, &pre, n, itl, tx).await;
        }
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

impl Engine {
    /// The Anthropic event stream after prefill: `message_start`,
    /// `content_block_start`, one `content_block_delta` (`text_delta`) per token on
    /// the decode clock, `content_block_stop`, `message_delta` (stop reason and
    /// usage), `message_stop`. Returns early when the client has gone.
    async fn stream_messages(
        &self,
        shape: &Shape,
        work: &[PromptWork],
        pre: &Prefilled,
        n: u64,
        itl: Duration,
        tx: &mpsc::Sender<Bytes>,
    ) {
        let usage = work_usage(work, &pre.cached, n);
        let head = [
            shape.message_start(&Usage {
                completion_tokens: 0,
                ..usage
            }),
            Shape::event(
                "content_block_start",
                &json!({"type": "content_block_start", "index": 0,
                        "content_block": {"type": "text", "text": ""}}),
            ),
        ];
        for ev in head {
            if tx.send(ev).await.is_err() {
                return;
            }
        }
        let mut due = pre.end;
        for k in 0..n {
            wait_until(due).await;
            let delta = Shape::event(
                "content_block_delta",
                &json!({"type": "content_block_delta", "index": 0,
                        "delta": {"type": "text_delta", "text": format!(" {}", output_word(k))}}),
            );
            if tx.send(delta).await.is_err() {
                return;
            }
            due += itl;
        }
        self.finish(work, n);
        let tail = [
            Shape::event(
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": 0}),
            ),
            Shape::event(
                "message_delta",
                &json!({"type": "message_delta",
                        "delta": {"stop_reason": "max_tokens", "stop_sequence": null},
                        "usage": anthropic_usage(&usage)}),
            ),
            Shape::event("message_stop", &json!({"type": "message_stop"})),
        ];
        for ev in tail {
            if tx.send(ev).await.is_err() {
                return;
            }
        }
    }
}

/// The JSON object of a request body, or the 4xx status and message.
fn json_object(
    body: Result<Bytes, (StatusCode, String)>,
) -> Result<Map<String, Value>, (StatusCode, String)> {
    match serde_json::from_slice::<Value>(&body?) {
        Ok(Value::Object(obj)) => Ok(obj),
        Ok(_) => Err((
            StatusCode::BAD_REQUEST,
            "request body must be a JSON object".into(),
        )),
        Err(e) => Err((
            StatusCode::BAD_REQUEST,
            format!("body is not valid JSON: {e}"),
        )),
    }
}

/// vLLM's `GenerateRequest` (what its render endpoints answer) for one prompt.
fn generate_request(
    id: String,
    token_ids: Vec<u32>,
    req: &Map<String, Value>,
    model: &str,
) -> Value {
    let present = |k: &str| req.get(k).filter(|v| !v.is_null()).cloned();
    json!({
        "request_id": id,
        "token_ids": token_ids,
        "features": null,
        "sampling_params": {
            "max_tokens": present("max_completion_tokens").or_else(|| present("max_tokens")),
            "temperature": present("temperature"),
        },
        "model": present("model").unwrap_or_else(|| json!(model)),
        "stream": present("stream").unwrap_or(json!(false)),
        "stream_options": present("stream_options"),
        "cache_salt": present("cache_salt"),
        "priority": present("priority").unwrap_or(json!(0)),
        "kv_transfer_params": null,
    })
}

/// The tokenizer endpoints: no simulated time, no cache lookup.
impl Engine {
    /// `POST /tokenize`: `{"prompt": "…"}` or `{"messages": […]}` (chat template,
    /// `add_generation_prompt` default true) → `{"count","max_model_len","tokens",
    /// "token_strs"}` (`token_strs` only with `return_token_strs`). `count` equals the
    /// `prompt_tokens` a generation request with the same prompt reports.
    async fn tokenize(&self, req: Request<Incoming>) -> Response<RespBody> {
        let obj = match json_object(self.read_body(req).await) {
            Ok(obj) => obj,
            Err((status, msg)) => {
                return error_response(status, &msg, "invalid_request_error");
            }
        };
        let text = if obj.contains_key("messages") {
            let add = obj
                .get("add_generation_prompt")
                .and_then(Value::as_bool)
                .unwrap_or(true);
            chat_template_with(obj.get("messages"), add)
        } else {
            match obj.get("prompt") {
                Some(Value::String(s)) => Ok(s.clone()),
                _ => Err("prompt must be a string (or send messages)".to_string()),
            }
        };
        let text = match text {
            Ok(t) => t,
            Err(msg) => {
                return error_response(StatusCode::BAD_REQUEST, &msg, "invalid_request_error");
            }
        };
        let words: Vec<&str> = text.split_whitespace().collect();
        let tokens: Vec<u32> = words.iter().map(|w| token_id(w)).collect();
        let strs = obj
            .get("return_token_strs")
            .and_then(Value::as_bool)
            .unwrap_or(false)
            .then(|| json!(words));
        json_response(
            StatusCode::OK,
            &json!({"count": tokens.len(), "max_model_len": MAX_MODEL_LEN,
                    "tokens": tokens, "token_strs": strs}),
        )
    }

    /// `POST /detokenize`: `{"tokens": [ids…]}` → `{"prompt": " w1 w2 …"}` (each word
    /// with a leading space, as the trace prompts are written; see [`token_word`]).
    async fn detokenize(&self, req: Request<Incoming>) -> Response<RespBody> {
        let obj = match json_object(self.read_body(req).await) {
            Ok(obj) => obj,
            Err((status, msg)) => {
                return error_response(status, &msg, "invalid_request_error");
            }
        };
        let words: Option<Vec<String>> =
            obj.get("tokens").and_then(Value::as_array).and_then(|ids| {
                ids.iter()
                    .map(|x| x.as_u64().and_then(token_word))
                    .collect()
            });
        match words {
            Some(words) => {
                let prompt: String = words.iter().map(|w| format!(" {w}")).collect();
                json_response(StatusCode::OK, &json!({ "prompt": prompt }))
            }
            None => error_response(
                StatusCode::BAD_REQUEST,
                &format!("tokens must be an array of token ids below {VOCAB_SIZE}"),
                "invalid_request_error",
            ),
        }
    }

    /// `POST /v1/embeddings`: `{"input": "…" | ["…", …], "model"?, "encoding_format"?:
    /// "float"}` → the OpenAI list of [`crate::embeddings::embed`] vectors. Answered at
    /// once, outside the prefill queue, the prefix cache and the 429 admission; only
    /// `embedding_requests` counts it.
    async fn embeddings(&self, req: Request<Incoming>) -> Response<RespBody> {
        let body = match self.read_body(req).await {
            Ok(body) => body,
            Err((status, msg)) => return error_response(status, &msg, "invalid_request_error"),
        };
        let emb = match embeddings::parse_request(&body) {
            Ok(emb) => emb,
            Err(msg) => {
                return error_response(StatusCode::BAD_REQUEST, &msg, "invalid_request_error");
            }
        };
        let resp = embeddings::response_body(&emb, &self.inner.cfg.model);
        let c = &self.inner.counters;
        c.embedding_requests.fetch_add(1, Ordering::Relaxed);
        json_response(StatusCode::OK, &resp)
    }

    /// `POST /v1/messages/count_tokens` → `{"input_tokens": n}`: the prompt tokens
    /// the same `/v1/messages` request would have.
    async fn count_tokens(&self, req: Request<Incoming>) -> Response<RespBody> {
        let body = match self.read_body(req).await {
            Ok(body) => body,
            Err((status, msg)) => return anthropic_error(status, &msg),
        };
        let text = serde_json::from_slice::<Value>(&body)
            .map_err(|e| format!("body is not valid JSON: {e}"))
            .and_then(|v| {
                let obj = v.as_object().ok_or("request body must be a JSON object")?;
                chat_template(Some(&anthropic_to_chat(obj)?))
            });
        match text {
            Ok(t) => json_response(
                StatusCode::OK,
                &json!({"input_tokens": t.split_whitespace().count()}),
            ),
            Err(msg) => anthropic_error(StatusCode::BAD_REQUEST, &msg),
        }
    }

    /// `POST /v1/chat/completions/render` (one `GenerateRequest`) and
    /// `POST /v1/completions/render` (a list, one per prompt; token-id prompts are
    /// passed through): vLLM's render endpoints, which llm-d's precise prefix-cache
    /// scorer calls to get the token ids it hashes into KV blocks.
    async fn render(&self, endpoint: Endpoint, req: Request<Incoming>) -> Response<RespBody> {
        let obj = match json_object(self.read_body(req).await) {
            Ok(obj) => obj,
            Err((status, msg)) => {
                return error_response(status, &msg, "invalid_request_error");
            }
        };
        let model = &self.inner.cfg.model;
        let next_id = || {
            let n = self.inner.counters.next_id.fetch_add(1, Ordering::Relaxed);
            format!("render-{}-{n}", self.inner.cfg.name)
        };
        if endpoint == Endpoint::Chat {
            return match chat_template(obj.get("messages")) {
                Ok(text) => json_response(
                    StatusCode::OK,
                    &generate_request(next_id(), tokenize_text(&text), &obj, model),
                ),
                Err(msg) => error_response(StatusCode::BAD_REQUEST, &msg, "invalid_request_error"),
            };
        }
        let prompt = obj.get("prompt");
        let ids = |a: &[Value]| -> Option<Vec<u32>> {
            a.iter()
                .map(|x| {
                    x.as_u64()
                        .filter(|&n| n < u64::from(VOCAB_SIZE))
                        .map(|n| n as u32)
                })
                .collect()
        };
        // Token ids (one list or a list of lists) pass through; text is tokenized.
        let token_lists: Option<Vec<Vec<u32>>> = match prompt {
            Some(Value::Array(items)) if items.first().is_some_and(Value::is_number) => {
                ids(items).map(|v| vec![v])
            }
            Some(Value::Array(items)) if items.first().is_some_and(Value::is_array) => items
                .iter()
                .map(|x| x.as_array().and_then(|a| ids(a)))
                .collect(),
            _ => completion_prompts(prompt)
                .ok()
                .map(|ps| ps.iter().map(|p| tokenize_text(p)).collect()),
        };
        match token_lists {
            Some(lists) => {
                let items: Vec<Value> = lists
                    .into_iter()
                    .map(|t| generate_request(next_id(), t, &obj, model))
                    .collect();
                json_response(StatusCode::OK, &Value::Array(items))
            }
            None => error_response(
                StatusCode::BAD_REQUEST,
                "prompt must be a string, an array of strings, an array of token ids \
                 or an array of token-id arrays (ids below the vocabulary size)",
                "invalid_request_error",
            ),
        }
    }
}

/// Anthropic `usage`: `input_tokens` excludes the cached part, which is
/// `cache_read_input_tokens` (Anthropic's meaning, and what the router's usage reader
/// adds back up); nothing is reported as written to the cache.
fn anthropic_usage(u: &Usage) -> Value {
    let cached = u.prompt_tokens_details.map_or(0, |d| d.cached_tokens);
    json!({
        "input_tokens": u.prompt_tokens - cached,
        "output_tokens": u.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    })
}

/// `{"type":"error","error":{"type","message"}}`, Anthropic's error body.
fn anthropic_error(status: StatusCode, message: &str) -> Response<RespBody> {
    let kind = match status {
        StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
        StatusCode::NOT_FOUND => "not_found_error",
        StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
        _ => "invalid_request_error",
    };
    json_response(
        status,
        &json!({"type": "error", "error": {"type": kind, "message": message}}),
    )
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
            Endpoint::Completions | Endpoint::Messages => "text_completion",
        }
    }

    fn sse(value: &Value) -> Bytes {
        Bytes::from(format!("data: {value}\n\n"))
    }

    /// One Anthropic SSE event: `event: NAME` then its `data:` line.
    fn event(name: &str, value: &Value) -> Bytes {
        Bytes::from(format!("event: {name}\ndata: {value}\n\n"))
    }

    /// An Anthropic message with `content` and `stop_reason` (null while streaming).
    fn message(&self, content: Value, stop_reason: Value, usage: &Usage) -> Value {
        json!({
            "id": self.id, "type": "message", "role": "assistant", "content": content,
            "model": self.model, "stop_reason": stop_reason, "stop_sequence": null,
            "usage": anthropic_usage(usage),
        })
    }

    fn message_start(&self, usage: &Usage) -> Bytes {
        Self::event(
            "message_start",
            &json!({"type": "message_start",
                    "message": self.message(json!([]), Value::Null, usage)}),
        )
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
            Endpoint::Chat | Endpoint::Messages => {
                json!({"index": index, "delta": {"content": text},
                                     "logprobs": null, "finish_reason": finish})
            }
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
        if self.endpoint == Endpoint::Messages {
            return self.message(
                json!([{"type": "text", "text": text}]),
                json!("max_tokens"),
                &work_usage(work, cached, n),
            );
        }
        let choices: Vec<Value> = (0..work.len())
            .map(|i| match self.endpoint {
                Endpoint::Chat | Endpoint::Messages => json!({
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
            Endpoint::Chat | Endpoint::Messages => "chat.completion",
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
        Endpoint::Messages => vec![chat_template(Some(&anthropic_to_chat(obj)?))?],
    };
    let present = |k: &str| obj.get(k).filter(|v| !v.is_null());
    let max_tokens = match present("max_completion_tokens").or_else(|| present("max_tokens")) {
        // Anthropic requires max_tokens.
        None if endpoint == Endpoint::Messages => return Err("max_tokens is required".into()),
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
    chat_template_with(messages, true)
}

/// [`chat_template`], with the trailing generation prompt only when
/// `add_generation_prompt` (vLLM's `/tokenize` option of that name).
pub fn chat_template_with(
    messages: Option<&Value>,
    add_generation_prompt: bool,
) -> Result<String, String> {
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
    if add_generation_prompt {
        out.push_str("<|im_start|>assistant\n");
    }
    Ok(out)
}

/// Text of an Anthropic `system` field or `system`-role content: a string, or the
/// text blocks of an array, concatenated.
fn anthropic_text(value: &Value, what: &str) -> Result<String, String> {
    match value {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => Ok(blocks
            .iter()
            .filter(|b| b.get("type").and_then(Value::as_str) == Some("text"))
            .filter_map(|b| b.get("text").and_then(Value::as_str))
            .collect()),
        _ => Err(format!(
            "{what} must be a string or an array of content blocks"
        )),
    }
}

/// An Anthropic Messages request as the OpenAI chat `messages` vLLM turns it into
/// (`vllm/entrypoints/anthropic`): `system` (a string or text blocks) and any
/// `system`-role messages become one leading system message; text blocks become text
/// parts (a lone one plain content), images `image_url` parts, `tool_use` blocks tool
/// calls (name + JSON arguments), a user's `tool_result` blocks `tool` messages (an
/// assistant's become "Tool result: …" text); thinking blocks are dropped.
pub fn anthropic_to_chat(req: &Map<String, Value>) -> Result<Value, String> {
    let list = req
        .get("messages")
        .and_then(Value::as_array)
        .ok_or("messages must be an array of messages")?;
    if list.is_empty() {
        return Err("messages must contain at least one item".into());
    }
    let mut system = anthropic_text(req.get("system").unwrap_or(&Value::Null), "system")?;
    let mut out: Vec<Value> = Vec::new();
    for (i, m) in list.iter().enumerate() {
        let m = m
            .as_object()
            .ok_or_else(|| format!("messages[{i}] must be an object"))?;
        let role = match m.get("role").and_then(Value::as_str) {
            Some(r @ ("user" | "assistant" | "system")) => r,
            // Claude Code's non-standard roles, mapped as vLLM does.
            Some("ctx" | "msg") => "user",
            _ => {
                return Err(format!(
                    "messages[{i}].role must be \"user\", \"assistant\" or \"system\""
                ));
            }
        };
        let content = m.get("content").unwrap_or(&Value::Null);
        if role == "system" {
            system.push_str(&anthropic_text(content, &format!("messages[{i}].content"))?);
            continue;
        }
        let blocks = match content {
            Value::String(s) => {
                out.push(json!({"role": role, "content": s}));
                continue;
            }
            Value::Array(blocks) if !blocks.is_empty() => blocks,
            Value::Array(_) => return Err(format!("messages[{i}].content must not be empty")),
            _ => {
                return Err(format!(
                    "messages[{i}].content must be a string or an array of content blocks"
                ));
            }
        };
        let mut parts: Vec<Value> = Vec::new();
        let mut calls: Vec<Value> = Vec::new();
        for (j, b) in blocks.iter().enumerate() {
            let kind = b.get("type").and_then(Value::as_str).ok_or_else(|| {
                format!("messages[{i}].content[{j}] must be a content block with a type")
            })?;
            match kind {
                "text" => {
                    if let Some(t) = b.get("text").and_then(Value::as_str).filter(|t| !t.is_empty())
                    {
                        parts.push(json!({"type": "text", "text": t}));
                    }
                }
                "image" => parts.push(json!({"type": "image_url", "image_url": {"url": ""}})),
                "tool_use" => calls.push(json!({
                    "id": b.get("id").cloned().unwrap_or(Value::Null),
                    "type": "function",
                    "function": {
                        "name": b.get("name").and_then(Value::as_str).unwrap_or(""),
                        "arguments": b.get("input").cloned().unwrap_or_else(|| json!({})).to_string(),
                    },
                })),
                "tool_result" => {
                    let text = match b.get("content") {
                        Some(Value::Array(items)) => items
                            .iter()
                            .filter_map(|x| x.get("text").and_then(Value::as_str))
                            .collect::<Vec<_>>()
                            .join("\n"),
                        Some(c) => anthropic_text(c, "tool_result.content")?,
                        None => String::new(),
                    };
                    if role == "user" {
                        out.push(json!({"role": "tool", "content": text,
                                        "tool_call_id": b.get("tool_use_id").cloned().unwrap_or(Value::Null)}));
                    } else {
                        parts.push(json!({"type": "text", "text": format!("Tool result: {text}")}));
                    }
                }
                _ => {} // thinking, redacted_thinking, document, …: not part of the prompt here
            }
        }
        let mut msg = json!({"role": role});
        if !calls.is_empty() {
            msg["tool_calls"] = Value::Array(calls);
        }
        match parts.len() {
            0 => {}
            1 if parts[0]["type"] == "text" => msg["content"] = parts[0]["text"].clone(),
            _ => msg["content"] = Value::Array(parts),
        }
        // A user turn holding only tool results is replaced by its tool messages.
        if !(role == "user" && msg.get("content").is_none() && msg.get("tool_calls").is_none()) {
            out.push(msg);
        }
    }
    if !system.is_empty() {
        out.insert(0, json!({"role": "system", "content": system}));
    }
    Ok(Value::Array(out))
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

    #[test]
    fn metrics_flavor_parses_and_prints() {
        assert_eq!("vllm".parse(), Ok(MetricsFlavor::Vllm));
        assert_eq!(" SGLang ".parse(), Ok(MetricsFlavor::Sglang));
        assert!("tgi".parse::<MetricsFlavor>().is_err());
        assert_eq!(MetricsFlavor::Sglang.to_string(), "sglang");
        assert_eq!(MetricsFlavor::default(), MetricsFlavor::Vllm);
    }

    #[test]
    fn admission_stops_at_max_waiting_and_tracks_the_peak() {
        let e = Engine::new(EngineConfig {
            max_waiting: 2,
            ..EngineConfig::default()
        })
        .unwrap();
        let a = e.admit().expect("first admitted");
        let b = e.admit().expect("second admitted");
        assert!(e.admit().is_none(), "third finds 2 waiting");
        let s = e.stats();
        assert_eq!((s.waiting, s.waiting_peak, s.rejected), (2, 2, 1));
        drop(a);
        let c = e.admit().expect("room again");
        drop((b, c));
        let s = e.stats();
        assert_eq!((s.waiting, s.waiting_peak, s.rejected), (0, 2, 1));
        // 0 = unbounded.
        let u = Engine::new(EngineConfig::default()).unwrap();
        let held: Vec<_> = (0..100).map(|_| u.admit().unwrap()).collect();
        assert_eq!(u.stats().waiting_peak, 100);
        drop(held);
        assert!(
            u.metrics_text()
                .contains("sim:num_requests_waiting_peak{engine=\"0\",model_name=\"m\"} 100\n")
        );
    }

    #[test]
    fn sglang_flavor_uses_sglang_names_only() {
        let e = Engine::new(EngineConfig {
            metrics_flavor: MetricsFlavor::Sglang,
            ..EngineConfig::default()
        })
        .unwrap();
        let text = e.metrics_text();
        for name in [
            "sglang:num_queue_reqs",
            "sglang:num_running_reqs",
            "sglang:token_usage",
            "sglang:cache_hit_rate",
            "sglang:prompt_tokens_total",
            "sglang:generation_tokens_total",
            "sim:num_requests_waiting_peak",
            "sim:rejected_total",
        ] {
            assert!(
                text.contains(&format!("\n{name}{{model_name=\"m\"}} ")),
                "{name} missing from\n{text}"
            );
        }
        assert!(!text.contains("vllm:"));
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

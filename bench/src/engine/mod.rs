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
//!   first token at the end of prefill, then one token per `itl`. Under the chunked
//!   physics prefill and decode share steps instead (`steps`: a prefill delays the
//!   tokens of the requests decoding beside it). Every simulated duration is
//!   multiplied by `time_factor`; at 0 the engine answers at once (no timer is armed
//!   for a deadline already reached).
//! - **hand-off**: with `kv_connector: nixl`, vLLM's NixlConnector contract (`nixl`):
//!   a prefill for a remote decoder answers with `kv_transfer_params`, a decode given
//!   them reads the prompt's KV instead of computing it.
//! - **answer**: greedy decoding: each output word is a function of every word before
//!   it, prompt then answer ([`greedy_text`]), so an answer continued from its first
//!   words (`continue_final_message` for chat) goes on as the uninterrupted one.
//! - **stall**: with `stall_share` > 0, that share of the generation requests (chosen
//!   by a hash of the request body, so the same body always stalls or never) has its
//!   first token held back `stall_first_token` more after its prefill, outside the
//!   prefill queue (counted in `sim:stalled_total`): a replica with an intermittent
//!   hiccup, for hedging benchmarks.
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
//! Models: `model` and `extra_models` are served, each its own entry (and `root`) of
//! `GET /v1/models`; a generation request naming another gets vLLM's 404 (`The model
//! `X` does not exist.`), one naming none gets `model`. A model other than `model`
//! starts its prompts' block hash chain from a root of its own, so one cache holds
//! every model's blocks and a prompt never hits across models.
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
//!
//! Parts: `physics` (admission, the prefill queue, cache lookups, stalls, simulated
//! time, the clock a request's tokens follow), `steps` (the chunked physics' batch),
//! `nixl` (the hand-off's wire contract), `itl` (inter-token latency on the engine's
//! clock), `generate` (the generation endpoints: non-streamed, SSE, Anthropic events),
//! `decode` (the answer's words),
//! `shapes` (vLLM's and Anthropic's response bodies), `template` (request bodies to
//! prompt text), `tokenizer` (token ids and the endpoints answered at once from
//! them), `metrics` (`GET /metrics`), `http` (the server, routing, body plumbing,
//! [`start`]).

mod decode;
mod generate;
mod http;
mod itl;
mod metrics;
mod nixl;
mod physics;
mod shapes;
mod steps;
mod template;
mod tokenizer;

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use hyper::header::HeaderValue;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

pub use crate::prefill::Physics;
use crate::prefill::SharedPrefill;
pub use cache_aware_router::simulate::engine::{PrefixCache, block_hashes, block_hashes_under};
pub use decode::greedy_text;
pub use http::{LISTEN_BACKLOG, RunningEngine, StartError, bind, serve, start};
pub use metrics::MetricsFlavor;
pub use nixl::KvConnector;
pub use template::{anthropic_to_chat, chat_prompt, chat_template, chat_template_with};
pub use tokenizer::{VOCAB_SIZE, token_id, token_word, tokenize_text};

/// Response header naming the replica that served a request.
pub const ENGINE_HEADER: &str = "x-sim-engine";

/// Context length reported by `/v1/models` and `/tokenize`, in tokens.
pub const MAX_MODEL_LEN: u64 = 131_072;

/// Settings of one simulated engine. Durations are simulated time, scaled by
/// `time_factor` before any timer is armed.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Replica name, sent back in the `x-sim-engine` header.
    pub name: String,
    /// Served model id: the first of `/v1/models`, the one a request that names no
    /// model gets, and the `model_name` label of `/metrics`.
    pub model: String,
    /// Further served model ids, each a model of its own in `/v1/models` (its own
    /// `root`). A request naming a model not served gets vLLM's 404. One cache holds
    /// them all, and a model's name is folded into its prompts' block hashes (as
    /// vLLM folds a LoRA adapter's), so prompts never hit across models; so is a
    /// request's `cache_salt` (never a hit across salts).
    pub extra_models: Vec<String>,
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
    /// Token budget of one step under [`Physics::Chunked`] (vLLM's
    /// `max_num_batched_tokens`), in tokens: one per decoding sequence, the rest for
    /// prompt chunks.
    pub max_batched_tokens: usize,
    /// How `kv_transfer_params` are read ([`KvConnector`]; default: ignored).
    pub kv_connector: KvConnector,
    /// Fixed cost of reading a prompt's KV from a prefill engine (simulated time).
    pub kv_transfer_base: Duration,
    /// Cost per token of KV read from a prefill engine (simulated time).
    pub kv_transfer_per_token: Duration,
    /// How long a stalled request's first token is held back after its prefill
    /// (simulated time; see `stall_share`).
    pub stall_first_token: Duration,
    /// Share of the generation requests that stall (0 to 1; 0 = none), chosen by a hash
    /// of the request body.
    pub stall_share: f64,
    /// A streamed answer that continues nothing (not a chat request with
    /// `continue_final_message`) is cut after this many tokens: its connection closes
    /// without the stream's end, as a killed engine's does (`None`: never).
    pub die_after_tokens: Option<u64>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            name: "sim".into(),
            model: "m".into(),
            extra_models: Vec::new(),
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
            max_batched_tokens: 2048,
            kv_connector: KvConnector::None,
            kv_transfer_base: Duration::from_millis(2),
            kv_transfer_per_token: Duration::from_micros(5),
            stall_first_token: Duration::ZERO,
            stall_share: 0.0,
            die_after_tokens: None,
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
    /// `stall_share` is outside 0 to 1.
    #[error("stall_share must be a number from 0 to 1, got {0}")]
    StallShare(f64),
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
    /// Generation requests whose first token was held back (`stall_share`).
    pub stalled: u64,
    /// Blocks held in the prefix cache.
    pub kv_blocks_used: u64,
    /// Prefill answers that carried `kv_transfer_params` for a remote decoder.
    pub kv_handoffs_sent: u64,
    /// Requests that read their prompt's KV from a prefill engine.
    pub kv_handoffs_received: u64,
    /// Requests with `kv_transfer_params` a decode cannot act on (prompt computed here).
    pub kv_handoffs_invalid: u64,
    /// Tokens of KV read from prefill engines (those not already held here).
    pub kv_transferred_tokens: u64,
    /// Prompt tokens computed (not cached, not transferred).
    pub prefill_tokens_computed: u64,
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
    kv_handoffs_sent: AtomicU64,
    kv_handoffs_received: AtomicU64,
    kv_handoffs_invalid: AtomicU64,
    kv_transferred_tokens: AtomicU64,
    prefill_tokens_computed: AtomicU64,
    itl: itl::ItlHistogram,
    stalled: AtomicU64,
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
#[derive(Debug)]
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
    /// The chunked physics' batch.
    batch: steps::Batch,
    counters: Counters,
    created: u64,
}

/// Response body of every handler.
pub type RespBody = BoxBody<Bytes, std::io::Error>;

/// Which endpoint a generation request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Completions,
    /// Anthropic Messages (`/v1/messages`).
    Messages,
}

impl Engine {
    /// An engine with an empty cache; fails on settings that cannot work.
    pub fn new(cfg: EngineConfig) -> Result<Self, ConfigError> {
        let kv = NonZeroUsize::new(cfg.kv_blocks).ok_or(ConfigError::Zero("kv_blocks"))?;
        let bs = NonZeroUsize::new(cfg.block_size).ok_or(ConfigError::Zero("block_size"))?;
        if !cfg.time_factor.is_finite() || cfg.time_factor < 0.0 {
            return Err(ConfigError::TimeFactor(cfg.time_factor));
        }
        if !(0.0..=1.0).contains(&cfg.stall_share) {
            return Err(ConfigError::StallShare(cfg.stall_share));
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
                batch: steps::Batch::default(),
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

    /// Every served model id, the default (`model`) first.
    pub fn models(&self) -> impl Iterator<Item = &str> {
        let cfg = &self.inner.cfg;
        std::iter::once(cfg.model.as_str()).chain(cfg.extra_models.iter().map(String::as_str))
    }

    /// The served model a request naming `asked` runs under (`None` asked: the
    /// default), or `None` when this engine does not serve it.
    fn resolve_model(&self, asked: Option<&str>) -> Option<String> {
        match asked {
            None => Some(self.inner.cfg.model.clone()),
            Some(m) => self.models().any(|s| s == m).then(|| m.to_string()),
        }
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
            stalled: r(&c.stalled),
            kv_blocks_used: self.lock_cache().len() as u64,
            kv_handoffs_sent: r(&c.kv_handoffs_sent),
            kv_handoffs_received: r(&c.kv_handoffs_received),
            kv_handoffs_invalid: r(&c.kv_handoffs_invalid),
            kv_transferred_tokens: r(&c.kv_transferred_tokens),
            prefill_tokens_computed: r(&c.prefill_tokens_computed),
        }
    }

    fn lock_cache(&self) -> std::sync::MutexGuard<'_, PrefixCache> {
        // A panic while holding the lock cannot leave the LRU half-updated in a
        // way that matters for a simulation; keep serving.
        self.inner
            .cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
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
}

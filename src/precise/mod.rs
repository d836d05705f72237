//! Precise mode (`policy: precise_cache_aware`): route on the KV blocks the engines
//! report holding, from vLLM's KV-cache events (spec `shared/docs/vllm-kv-events.md`),
//! instead of on what this router sent where.
//!
//! ```text
//! events     ZeroMQ frames + msgpack -> Batch / Event            (pure)
//! sequence   Sequencer: order, gaps, restarts, replay steps     (pure)
//! index      BlockIndex: router key -> workers and tiers, LRU-bounded (pure)
//! tiers      KV tiers (the events' medium) and their weights      (pure)
//! feed       Feed: one publisher's state and counters (a worker has one per DP rank)
//! consumer   one task per feed: SUB (+ DEALER for replay) -> index
//! parity     token parity: answers' blocks looked up in the engine's own events
//! mod        Precise (index + decision counters), the request's lookup, and the
//!            supervisor task that starts and stops consumers with the worker set
//!
//! The decision itself is the `precise_cache_aware` policy (`policy::precise`).
//! ```
//!
//! A request is scored precisely when its prompt's token ids are known (the
//! `x-token-ids` header, a completions prompt of token ids, or `precise.tokenizer`; see
//! [`tokens`]) and at least one usable cache-aware worker has a scorable feed;
//! otherwise the approximate tree decides, exactly as in `cache_aware` mode
//! ("fallback"). Precise decisions also record the prompt in the tree, so a fallback
//! later finds it warm.
//!
//! Data parallelism (`kv_events.dp_size` n > 1): one HTTP endpoint fronts n engine
//! ranks, each with its own feed and index source. A worker's matched run is the
//! **maximum** over its live ranks, and the request is sent to that rank: vLLM takes
//! the rank from the `X-data-parallel-rank` header ("router can inject it",
//! `_get_data_parallel_rank` in vLLM 0.32), where its own balancer would pick by queue
//! length, blind to prefixes (measured on a 2-rank CPU vLLM: without the header half
//! the repeats landed on the other rank and found nothing cached). For a prompt none of
//! its ranks holds, the router names a random rank, live if any (the engine's balancer
//! evens load by queue; a random pick evens it in expectation), and puts its
//! speculative entries there alone, so the prompt's repeats follow it before the
//! engine's events arrive. With one rank, nothing changes. A worker scores neutral
//! only when none of its ranks is live.
//!
//! Locking: the index is one `std::sync::Mutex`, held for one lookup + speculative
//! insert on the request path or one event in a consumer, never across an `.await`; it
//! is never held together with the tree's lock.

pub mod consumer;
pub mod events;
pub mod feed;
pub mod index;
pub mod parity;
pub mod sequence;
pub mod tiers;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;

use crate::config::PreciseConfig;
use crate::prompt::Endpoint;
use crate::tokenize::{self as tokens, PromptTokenizer, Tokens};
use index::BlockIndex;

/// Request header carrying the prompt's token ids: `x-token-ids: 151644,8948,198,…`.
pub const TOKEN_IDS_HEADER: &str = "x-token-ids";

/// What a request brings to the precise pick, worked out once per request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// Router keys of the prompt's full blocks, its length in tokens, and where the
    /// tokens came from; `ids` are the keyed token ids (at most [`MAX_LOOKUP_TOKENS`]),
    /// kept for the answer's parity check ([`parity`]). Cloning shares them.
    Blocks {
        keys: Arc<[u64]>,
        tokens: usize,
        source: TokenSource,
        ids: Arc<[u32]>,
        /// What the last precise pick for it found, by tier, for its answer's counts.
        tiers: TierNote,
    },
    /// Precise scoring is neutral for this request.
    Fallback(Fallback),
}

/// What a precise pick found for a request, tier by tier, kept with its [`Lookup`]
/// (clones share it) until the answer: the answer's engine usage then splits the
/// decision's available / predicted / delivered tokens by tier
/// ([`Precise::count_tiers`]). Empty when the request was not scored precisely.
#[derive(Debug, Clone, Default)]
pub struct TierNote(Arc<Mutex<Option<Noted>>>);

/// One precise pick's runs (see [`TierNote`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Noted {
    /// The longest run any scored worker holds, and its tokens as the pick counted them
    /// (*available*).
    pub available: tiers::Run,
    pub available_tokens: u64,
    /// The chosen worker's run and its tokens (*predicted*).
    pub predicted: tiers::Run,
    pub predicted_tokens: u64,
}

impl TierNote {
    /// Keeps `noted` (the latest pick's), or forgets the last one (`None`: the pick
    /// was not precise).
    pub fn set(&self, noted: Option<Noted>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = noted;
    }

    /// What the latest pick noted.
    pub fn get(&self) -> Option<Noted> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl PartialEq for TierNote {
    /// The same note (one request's), not equal contents.
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for TierNote {}

/// Per tier (configured order, see [`tiers::Tiers::names`]): available, predicted and
/// delivered prompt tokens of a worker's precisely scored answers.
pub type TierTokens = [[u64; tiers::MAX_TIERS]; 3];

/// Where a precisely scored request's token ids came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenSource {
    /// The `x-token-ids` header.
    Header,
    /// A `/v1/completions` prompt given as token ids.
    PromptIds,
    /// In-router tokenization (`precise.tokenizer`).
    Tokenizer,
}

impl TokenSource {
    const ALL: [TokenSource; 3] = [
        TokenSource::Header,
        TokenSource::PromptIds,
        TokenSource::Tokenizer,
    ];

    /// Label used in metrics and `/workers`.
    pub fn as_str(self) -> &'static str {
        match self {
            TokenSource::Header => "x_token_ids",
            TokenSource::PromptIds => "prompt_token_ids",
            TokenSource::Tokenizer => "tokenizer",
        }
    }
}

/// Why a request was routed by the approximate tree in precise mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// No token ids: no `x-token-ids` header, and no tokenizer configured or an
    /// endpoint it does not read (`/v1/messages`, `/v1/responses`).
    NoTokens,
    /// The header is not a comma-separated list of unsigned 32-bit integers.
    BadTokens,
    /// Fewer tokens than one block: nothing an engine could reuse.
    ShortPrompt,
    /// No usable cache-aware worker has a scorable feed (replaying, stale, or none).
    NoFreshWorker,
    /// The tokenizer cannot reproduce the engine's tokens for this request (media,
    /// a per-request chat template, a template error, a body over
    /// [`Precise::max_tokenize_body`], …; see [`crate::tokenize::chat_template::Untokenizable`]).
    Untokenizable,
    /// Every tokenizer slot stayed busy for [`TOKENIZE_WAIT`], or too many requests
    /// were already waiting: the request is not queued behind other prompts.
    TokenizerBusy,
    /// No scorable worker holds any of the prompt's blocks, but some usable worker
    /// cannot be scored (replaying, stale, disconnected, no `kv_events`): it may hold
    /// them, and the tree, which saw what was sent where, may know.
    UnscoredMiss,
    /// No usable cache-aware worker has a scorable feed, and some of them lost token
    /// parity: their engines' blocks stopped matching the router's tokens
    /// ([`parity`]).
    ParityLost,
}

impl Fallback {
    const ALL: [Fallback; 8] = [
        Fallback::NoTokens,
        Fallback::BadTokens,
        Fallback::ShortPrompt,
        Fallback::NoFreshWorker,
        Fallback::Untokenizable,
        Fallback::TokenizerBusy,
        Fallback::UnscoredMiss,
        Fallback::ParityLost,
    ];

    /// Label used in metrics and `/workers`.
    pub fn as_str(self) -> &'static str {
        match self {
            Fallback::NoTokens => "no_tokens",
            Fallback::BadTokens => "bad_tokens",
            Fallback::ShortPrompt => "short_prompt",
            Fallback::NoFreshWorker => "no_fresh_worker",
            Fallback::Untokenizable => "untokenizable",
            Fallback::TokenizerBusy => "tokenizer_busy",
            Fallback::UnscoredMiss => "unscored_miss",
            Fallback::ParityLost => "parity_lost",
        }
    }
}

/// Parses the `x-token-ids` value: unsigned 32-bit integers separated by commas, with
/// optional spaces around them. `None` for anything else (including an empty list).
pub fn parse_token_ids(value: &[u8]) -> Option<Vec<u32>> {
    let text = std::str::from_utf8(value).ok()?;
    let ids = text
        .split(',')
        .map(|t| t.trim().parse::<u32>().ok())
        .collect::<Option<Vec<u32>>>()?;
    (!ids.is_empty()).then_some(ids)
}

/// The precise mode's shared state: the block index and the decision counters. One per
/// router; consumers and the request path share it.
#[derive(Debug)]
pub struct Precise {
    config: PreciseConfig,
    index: Mutex<BlockIndex>,
    /// `precise.tokenizer`, loaded.
    tokenizer: Option<Arc<PromptTokenizer>>,
    /// Answers waiting for their token-parity check.
    pub(crate) parity: parity::Checks,
    /// Decisions scored precisely, by [`TokenSource::ALL`] position.
    precise_decisions: [AtomicU64; 3],
    /// Fallback decisions, by [`Fallback::ALL`] position.
    fallback_decisions: [AtomicU64; 8],
    /// Per worker label: its precisely scored answers' tokens by tier
    /// ([`Precise::count_tiers`]).
    tier_tokens: Mutex<std::collections::HashMap<Arc<str>, TierTokens>>,
    /// Tokenizer jobs that may run at once: one per core. A job holds its permit until
    /// it ends, even when its client has gone, so CPU and memory stay bounded.
    tokenize_slots: Arc<tokio::sync::Semaphore>,
    /// Places in the queue for a slot: [`TOKENIZE_QUEUE_PER_SLOT`] per slot. A waiting
    /// request holds one as a guard, so a request dropped while it waits (its client
    /// went away) gives its place back.
    tokenize_queue: tokio::sync::Semaphore,
}

/// Longest a request waits for a tokenizer slot before the tree decides for it. A
/// burst of ordinary prompts (0.1–1 ms each) clears well within it; a queue of long
/// ones does not, and those requests should not wait behind each other.
pub const TOKENIZE_WAIT: Duration = Duration::from_millis(50);
/// Waiting requests per tokenizer slot beyond which a request does not queue at all.
pub const TOKENIZE_QUEUE_PER_SLOT: usize = 64;

/// Most workers whose tokens by tier are kept (a pool has far fewer; the scrape drops
/// those that left).
const MAX_TIER_WORKERS: usize = 4096;

/// Most prompt tokens keyed per request (256k: the longest contexts served today);
/// a longer prompt is matched on this prefix. Bounds the keying work, the index lock
/// hold and the speculative inserts one request can make.
pub const MAX_LOOKUP_TOKENS: usize = 1 << 18;

impl Precise {
    /// An empty index sized by `config` (nothing allocated up front), and the tokenizer
    /// `precise.tokenizer` names, loaded here. Startup and `--config-check` refuse one
    /// that cannot be loaded before this builds; should it fail here all the same (a
    /// file changed since), the failure is logged and the tree decides for requests
    /// without token ids.
    pub fn new(config: &PreciseConfig) -> Self {
        let tokenizer = match PromptTokenizer::from_config(config) {
            Ok(t) => t.map(Arc::new),
            Err(e) => {
                tracing::error!(error = %e, "precise.tokenizer cannot be loaded: requests without token ids are routed by the tree");
                None
            }
        };
        if let (Some(t), Some(s)) = (&tokenizer, &config.tokenizer)
            && !t.has_chat_template()
        {
            tracing::warn!(
                tokenizer = %s.path.display(),
                "precise.tokenizer has no chat template: chat requests are routed by the tree (set precise.chat_template)"
            );
        }
        let slots = std::thread::available_parallelism().map_or(1, |n| n.get());
        Precise {
            index: Mutex::new(BlockIndex::with_tiers(
                config.block_size,
                config.max_blocks.get(),
                tiers::Tiers::new(&config.tier_weights),
            )),
            tokenizer,
            config: config.clone(),
            parity: parity::Checks::default(),
            precise_decisions: Default::default(),
            fallback_decisions: Default::default(),
            tier_tokens: Mutex::default(),
            tokenize_slots: Arc::new(tokio::sync::Semaphore::new(slots)),
            tokenize_queue: tokio::sync::Semaphore::new(slots * TOKENIZE_QUEUE_PER_SLOT),
        }
    }

    /// Largest request body whose tokens are worked out (the token-id prompt read or the
    /// tokenizer run): 4 × `precise.max_tokenize_bytes`. Parsing and rendering a body
    /// costs memory many times its size before the encode cap applies; a larger body
    /// is routed by the tree.
    pub fn max_tokenize_body(&self) -> usize {
        let text = self
            .config
            .tokenizer
            .as_ref()
            .map_or(tokens::DEFAULT_MAX_BYTES, |t| t.max_bytes);
        text.saturating_mul(4)
    }

    pub fn config(&self) -> &PreciseConfig {
        &self.config
    }

    /// Locks the index: one lookup or one event, never across an `.await`. A poisoned
    /// lock is recovered: the index is a cache, valid between operations.
    pub fn index(&self) -> MutexGuard<'_, BlockIndex> {
        self.index.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The request's prompt as router keys of its full blocks, or why precise scoring
    /// is neutral for it. Token ids come from, in order: the `x-token-ids` header, a
    /// completions prompt of token ids, the configured tokenizer (on the blocking pool).
    pub async fn lookup(
        &self,
        headers: &http::HeaderMap,
        endpoint: Option<Endpoint>,
        body: &Bytes,
    ) -> Lookup {
        match self.tokens(headers, endpoint, body).await {
            Ok((tokens, source)) => {
                let (lora, salt) = match endpoint {
                    Some(_) => self.key_fields(body),
                    None => (None, None),
                };
                self.keyed(&tokens, source, lora.as_deref(), salt.as_deref())
            }
            Err(why) => Lookup::Fallback(why),
        }
    }

    /// The request fields vLLM folds into its block hashes besides the tokens: the
    /// LoRA adapter (`model`, when an engine reported blocks under that adapter name)
    /// and `cache_salt`.
    fn key_fields(&self, body: &[u8]) -> (Option<String>, Option<String>) {
        #[derive(serde::Deserialize)]
        struct KeyFields<'a> {
            #[serde(borrow, default)]
            model: Option<std::borrow::Cow<'a, str>>,
            #[serde(borrow, default)]
            cache_salt: Option<std::borrow::Cow<'a, str>>,
        }
        // Parsing the body again costs about as much as extracting the prompt did
        // (25 µs for 48 KB): skip it unless one of the fields can matter.
        let salted = memchr::memmem::find(body, b"\"cache_salt\"").is_some();
        if !salted && !self.index().has_adapters() {
            return (None, None);
        }
        let Ok(f) = serde_json::from_slice::<KeyFields>(body) else {
            return (None, None);
        };
        let lora = f
            .model
            .filter(|m| self.index().is_adapter(m))
            .map(|m| m.into_owned());
        (lora, f.cache_salt.map(|s| s.into_owned()))
    }

    async fn tokens(
        &self,
        headers: &http::HeaderMap,
        endpoint: Option<Endpoint>,
        body: &Bytes,
    ) -> Result<(Tokens, TokenSource), Fallback> {
        if let Some(value) = headers.get(TOKEN_IDS_HEADER) {
            return parse_token_ids(value.as_bytes())
                .map(|t| (t, TokenSource::Header))
                .ok_or(Fallback::BadTokens);
        }
        let small = body.len() <= self.max_tokenize_body();
        if small
            && endpoint == Some(Endpoint::Completions)
            && let Some(ids) = tokens::completion_prompt_ids(body)
        {
            return Ok((ids, TokenSource::PromptIds));
        }
        let (Some(tokenizer), Some(endpoint @ (Endpoint::ChatCompletions | Endpoint::Completions))) =
            (&self.tokenizer, endpoint)
        else {
            return Err(Fallback::NoTokens);
        };
        if !small {
            tracing::debug!(
                bytes = body.len(),
                "precise: body too large to tokenize; the approximate tree decides"
            );
            return Err(Fallback::Untokenizable);
        }
        let slot = match Arc::clone(&self.tokenize_slots).try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => {
                let Ok(_place) = self.tokenize_queue.try_acquire() else {
                    return Err(Fallback::TokenizerBusy);
                };
                let waited = tokio::time::timeout(
                    TOKENIZE_WAIT,
                    Arc::clone(&self.tokenize_slots).acquire_owned(),
                )
                .await;
                match waited {
                    Ok(Ok(slot)) => slot,
                    _ => return Err(Fallback::TokenizerBusy),
                }
            }
        };
        let tokenizer = Arc::clone(tokenizer);
        let body = body.clone();
        let encoded = tokio::task::spawn_blocking(move || {
            let _slot = slot;
            match endpoint {
                Endpoint::ChatCompletions => tokenizer.chat(&body),
                _ => tokenizer.completion(&body),
            }
        })
        .await;
        match encoded {
            Ok(Ok(tokens)) => Ok((tokens, TokenSource::Tokenizer)),
            Ok(Err(why)) => {
                tracing::debug!(reason = %why, "precise: prompt not tokenized; the approximate tree decides");
                Err(Fallback::Untokenizable)
            }
            Err(e) => {
                tracing::warn!(error = %e, "precise: tokenizer task failed; the approximate tree decides");
                Err(Fallback::Untokenizable)
            }
        }
    }

    /// `tokens` as router keys of their full blocks, chained under LoRA adapter `lora`
    /// and cache salt `salt` as the engine chains its block hashes.
    pub(crate) fn keyed(
        &self,
        tokens: &[u32],
        source: TokenSource,
        lora: Option<&str>,
        salt: Option<&str>,
    ) -> Lookup {
        let bs = self.config.block_size;
        let keyed = &tokens[..tokens.len().min(MAX_LOOKUP_TOKENS)];
        let extra = index::request_extra_keys(lora, salt, keyed.len() / bs);
        let keys = index::chain_keys(index::root_key(lora), keyed, bs, &extra);
        if keys.is_empty() {
            return Lookup::Fallback(Fallback::ShortPrompt);
        }
        Lookup::Blocks {
            keys: keys.into(),
            tokens: tokens.len(),
            source,
            ids: keyed.into(),
            tiers: TierNote::default(),
        }
    }

    /// Queues the token-parity check of an answer the worker labelled `worker`, with
    /// these KV-event `feeds`, gave to a request keyed as `keys` from token ids `ids`
    /// (see [`parity`]); nothing for a worker without `kv_events`.
    pub fn check_parity(
        &self,
        worker: &Arc<str>,
        feeds: &[Arc<feed::Feed>],
        keys: &Arc<[u64]>,
        ids: &Arc<[u32]>,
    ) {
        if feeds.is_empty() || keys.is_empty() {
            return;
        }
        self.parity.push(parity::Check {
            due: crate::clock::now() + parity::CHECK_DELAY,
            worker: Arc::clone(worker),
            feeds: feeds.to_vec(),
            clears: feeds.iter().map(|f| f.clears()).collect(),
            keys: Arc::clone(keys),
            ids: Arc::clone(ids),
        });
    }

    /// Counts a decision scored precisely, by where its tokens came from.
    pub fn count_precise(&self, source: TokenSource) {
        let i = TokenSource::ALL
            .iter()
            .position(|s| *s == source)
            .unwrap_or(0);
        // Relaxed: independent counters, read at scrape time.
        self.precise_decisions[i].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a decision the approximate tree made, by cause.
    pub fn count_fallback(&self, why: Fallback) {
        let i = Fallback::ALL.iter().position(|f| *f == why).unwrap_or(0);
        self.fallback_decisions[i].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a precisely scored answer from `worker` whose engine reported
    /// `delivered` prompt tokens cached: the pick's `noted` runs split its available
    /// and predicted tokens by tier, and `delivered` is split along the predicted run
    /// (the engine reuses a prefix: its GPU blocks, then what it loads from a host
    /// tier); delivered tokens past that run count as the GPU's (the engine's own
    /// cache, which the router had not heard of yet).
    pub fn count_tiers(&self, worker: &Arc<str>, noted: &Noted, delivered: u64) {
        let (bs, gpu) = {
            let index = self.index();
            (index.block_size(), index.tiers().gpu_tier())
        };
        let split = [
            noted.available.split(noted.available_tokens, bs, gpu),
            noted.predicted.split(noted.predicted_tokens, bs, gpu),
            noted.predicted.split(delivered, bs, gpu),
        ];
        let mut all = self.tier_tokens.lock().unwrap_or_else(|e| e.into_inner());
        if !all.contains_key(worker) && all.len() >= MAX_TIER_WORKERS {
            return;
        }
        let counts = all.entry(Arc::clone(worker)).or_default();
        for (kind, by_tier) in counts.iter_mut().zip(split) {
            for (c, n) in kind.iter_mut().zip(by_tier) {
                *c += n;
            }
        }
    }

    /// `worker`'s tokens by tier so far ([`Precise::count_tiers`]).
    pub fn tier_tokens(&self, worker: &str) -> TierTokens {
        self.tier_tokens
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(worker)
            .copied()
            .unwrap_or_default()
    }

    /// Forgets the tier counts of workers no longer in `keep` (labels).
    pub fn retain_tier_tokens(&self, keep: &[&Arc<str>]) {
        self.tier_tokens
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|w, _| keep.iter().any(|k| **k == *w));
    }

    /// Decisions so far: `("precise", token source, n)` and `("fallback", cause, n)`.
    pub fn decisions(&self) -> Vec<(&'static str, &'static str, u64)> {
        let mut out: Vec<_> = TokenSource::ALL
            .iter()
            .zip(&self.precise_decisions)
            .map(|(s, n)| ("precise", s.as_str(), n.load(Ordering::Relaxed)))
            .collect();
        for (f, n) in Fallback::ALL.iter().zip(&self.fallback_decisions) {
            out.push(("fallback", f.as_str(), n.load(Ordering::Relaxed)));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_header_parses_strictly() {
        assert_eq!(
            parse_token_ids(b"1,2, 3 ,4294967295"),
            Some(vec![1, 2, 3, u32::MAX])
        );
        for bad in [
            &b""[..],
            b"1,,2",
            b"1,-2",
            b"1;2",
            b"4294967296",
            b"a",
            b"1,2,",
            b"\xff",
        ] {
            assert_eq!(parse_token_ids(bad), None, "{bad:?}");
        }
    }

    fn config() -> PreciseConfig {
        PreciseConfig {
            block_size: 4,
            max_blocks: std::num::NonZeroUsize::new(100).unwrap(),
            stale: Duration::from_secs(30),
            speculative_ttl: Duration::from_secs(2),
            tokenizer: None,
            parity_floor: 0.5,
            ..PreciseConfig::default()
        }
    }

    #[tokio::test]
    async fn lookup_keys_full_blocks_only() {
        let p = Precise::new(&config());
        let chat = Some(Endpoint::ChatCompletions);
        let body = Bytes::from_static(br#"{"messages": [{"role": "user", "content": "hi"}]}"#);
        let mut h = http::HeaderMap::new();
        assert_eq!(
            p.lookup(&h, chat, &body).await,
            Lookup::Fallback(Fallback::NoTokens)
        );
        h.insert(TOKEN_IDS_HEADER, "1,2,3".parse().unwrap());
        assert_eq!(
            p.lookup(&h, chat, &body).await,
            Lookup::Fallback(Fallback::ShortPrompt)
        );
        h.insert(TOKEN_IDS_HEADER, "1,2,x".parse().unwrap());
        assert_eq!(
            p.lookup(&h, chat, &body).await,
            Lookup::Fallback(Fallback::BadTokens)
        );
        h.insert(TOKEN_IDS_HEADER, "1,2,3,4,5,6,7,8,9".parse().unwrap());
        let Lookup::Blocks {
            keys,
            tokens,
            source,
            ..
        } = p.lookup(&h, chat, &body).await
        else {
            panic!()
        };
        assert_eq!((keys.len(), tokens, source), (2, 9, TokenSource::Header));
        // A completions prompt of token ids needs neither header nor tokenizer.
        let ids = Bytes::from_static(br#"{"model": "m", "prompt": [5, 6, 7, 8, 9]}"#);
        let none = http::HeaderMap::new();
        let Lookup::Blocks { keys, source, .. } =
            p.lookup(&none, Some(Endpoint::Completions), &ids).await
        else {
            panic!()
        };
        assert_eq!((keys.len(), source), (1, TokenSource::PromptIds));
    }

    #[tokio::test]
    async fn busy_tokenizer_slots_fall_back_and_dropped_waiters_leave_the_queue() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer");
        let p = Precise::new(&PreciseConfig {
            tokenizer: Some(crate::config::TokenizerSetting {
                path: dir,
                chat_template: None,
                content_format: crate::tokenize::chat_template::ContentFormat::Auto,
                max_bytes: tokens::DEFAULT_MAX_BYTES,
                tokenizer_at: Default::default(),
                chat_template_at: Default::default(),
            }),
            ..config()
        });
        let chat = Some(Endpoint::ChatCompletions);
        let body = Bytes::from_static(br#"{"messages": [{"role": "user", "content": "a prompt long enough to fill a block"}]}"#);
        let none = http::HeaderMap::new();
        assert!(matches!(
            p.lookup(&none, chat, &body).await,
            Lookup::Blocks {
                source: TokenSource::Tokenizer,
                ..
            }
        ));
        // Every slot taken: the request waits TOKENIZE_WAIT, then the tree decides.
        let slots = p.tokenize_slots.available_permits() as u32;
        let held = p.tokenize_slots.acquire_many(slots).await.unwrap();
        let queue = p.tokenize_queue.available_permits();
        assert_eq!(
            p.lookup(&none, chat, &body).await,
            Lookup::Fallback(Fallback::TokenizerBusy)
        );
        // Waiters whose clients go away mid-wait give their places back.
        for _ in 0..3 {
            let cut =
                tokio::time::timeout(Duration::from_millis(5), p.lookup(&none, chat, &body)).await;
            assert!(cut.is_err());
        }
        assert_eq!(p.tokenize_queue.available_permits(), queue);
        drop(held);
        assert!(matches!(
            p.lookup(&none, chat, &body).await,
            Lookup::Blocks { .. }
        ));
    }

    #[tokio::test]
    async fn adapter_and_salt_requests_key_like_their_engine_blocks() {
        use events::{BlockStored, Event, strings_digest};
        let p = Precise::new(&config());
        let tokens: Vec<u32> = (1..=9).collect();
        let header: http::HeaderMap = [(
            http::HeaderName::from_static(TOKEN_IDS_HEADER),
            "1,2,3,4,5,6,7,8,9".parse().unwrap(),
        )]
        .into_iter()
        .collect();
        // Engine A stored the prompt's 2 blocks for adapter "sql-lora" with salt "s1"
        // (vLLM's extra_keys: [lora, salt] on block 0, [lora] after).
        let a = index::SourceId(1);
        p.index().apply(
            a,
            &Event::Stored(BlockStored {
                block_hashes: vec![10, 11],
                parent_block_hash: None,
                token_ids: tokens[..8].to_vec(),
                block_size: 4,
                lora: Some("sql-lora".into()),
                medium: Some("GPU".into()),
                extra_keys: vec![
                    Some(strings_digest(&["sql-lora", "s1"])),
                    Some(strings_digest(&["sql-lora"])),
                ],
                group_idx: None,
                kind: None,
            }),
        );
        let now = crate::clock::now();
        let matched = |body: &'static str| {
            let p = &p;
            let header = header.clone();
            async move {
                let body = Bytes::from_static(body.as_bytes());
                let Lookup::Blocks { keys, .. } = p
                    .lookup(&header, Some(Endpoint::ChatCompletions), &body)
                    .await
                else {
                    panic!()
                };
                p.index().match_prefix(&keys, &[a], now)[0]
            }
        };
        assert_eq!(
            matched(r#"{"model": "sql-lora", "cache_salt": "s1"}"#).await,
            2
        );
        // The base model, another salt, or no salt: other blocks for the engine too.
        assert_eq!(matched(r#"{"model": "base", "cache_salt": "s1"}"#).await, 0);
        assert_eq!(
            matched(r#"{"model": "sql-lora", "cache_salt": "s2"}"#).await,
            0
        );
        assert_eq!(matched(r#"{"model": "sql-lora"}"#).await, 0);
    }
}

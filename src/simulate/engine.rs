//! The engine model `simulate` and `sim-engine` (bench) share: one replica's prefix
//! cache of KV blocks with LRU eviction, the chained block hashes it keys on, and the
//! serialized prefill queue that times a request.
//!
//! Units: **tokens** are the simulated engine's tokens, one per whitespace-separated
//! word of the prompt text ([`tokenize_words`]; sim-engine's tokenizer); a **block** is
//! `block_size` tokens; times are **milliseconds** of simulated time. Prefill is one
//! FIFO server per engine: a request starts when it and the engine are both free and
//! takes `ttft_base_ms + uncached_tokens / prefill_tokens_per_ms`; its cache lookup
//! (and insert) happens in that order, so a lookup done at arrival in arrival order sees
//! the same cache as sim-engine's at the start of prefill. Decode is concurrent: one
//! token per `decode_ms_per_token` after the first. No I/O, no clock.

use std::num::NonZeroUsize;

use lru::LruCache;
use xxhash_rust::xxh3::Xxh3;

/// Seed of the first block's hash chain (any constant; equal across engines).
const ROOT_HASH: u64 = 0x6361_6368_6521_0001;

/// The simulated engine's tokens of `text`: its whitespace-separated words.
pub fn tokenize_words(text: &str) -> impl Iterator<Item = &str> {
    text.split_whitespace()
}

/// Chained hashes of the full `block_size`-token blocks of `tokens`, plus the
/// token count. Block `i`'s hash covers block `i - 1`'s hash and block `i`'s words.
pub fn block_hashes<'a>(
    tokens: impl IntoIterator<Item = &'a str>,
    block_size: usize,
) -> (usize, Vec<u64>) {
    block_hashes_under(tokens, block_size, None)
}

/// As [`block_hashes`], for a prompt run under the LoRA adapter `adapter` (`None`: the
/// base model): the chain starts from a root of its own, so the blocks of one prompt
/// under two adapters never match (vLLM folds the adapter's name into every hash).
pub fn block_hashes_under<'a>(
    tokens: impl IntoIterator<Item = &'a str>,
    block_size: usize,
    adapter: Option<&str>,
) -> (usize, Vec<u64>) {
    let block_size = block_size.max(1);
    let mut hashes = Vec::new();
    let root = adapter.map_or(ROOT_HASH, |a| {
        xxhash_rust::xxh3::xxh3_64_with_seed(a.as_bytes(), ROOT_HASH)
    });
    let mut hasher = Xxh3::with_seed(root);
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

/// Timing of one simulated engine (milliseconds of simulated time).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    /// Fixed part of every prefill, in ms.
    pub ttft_base_ms: f64,
    /// Uncached prompt tokens prefilled per second.
    pub prefill_tokens_per_sec: f64,
    /// Time per generated token after the first, in ms.
    pub decode_ms_per_token: f64,
}

impl Default for Timing {
    /// sim-engine's and trace-matrix's defaults: 20 ms + 80 µs per uncached token
    /// (12,500 tokens/s), 15 ms per output token.
    fn default() -> Self {
        Timing {
            ttft_base_ms: 20.0,
            prefill_tokens_per_sec: 12_500.0,
            decode_ms_per_token: 15.0,
        }
    }
}

/// What one request got from an engine.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Served {
    /// Prompt tokens served from the prefix cache (the engine's `cached_tokens`).
    pub cached_tokens: u64,
    /// When its prefill started (queue wait = `prefill_start_ms - arrival`), in ms.
    pub prefill_start_ms: f64,
    /// When its first token was out (end of prefill), in ms.
    pub first_token_ms: f64,
}

/// One simulated engine: a [`PrefixCache`] behind a serialized prefill queue, and the
/// LoRA adapters it holds.
#[derive(Debug)]
pub struct EngineModel {
    cache: PrefixCache,
    timing: Timing,
    /// When the prefill server is next free, in ms.
    free_at_ms: f64,
    /// The adapters held, least recently used evicted first; `None`: adapters are not
    /// modelled.
    adapters: Option<LruCache<std::sync::Arc<str>, ()>>,
    /// Adapters loaded so far (one per request for an adapter it did not hold).
    loads: u64,
}

impl EngineModel {
    /// An engine with an empty cache of `kv_blocks` blocks of `block_size` tokens.
    pub fn new(kv_blocks: NonZeroUsize, block_size: NonZeroUsize, timing: Timing) -> Self {
        EngineModel {
            cache: PrefixCache::new(kv_blocks, block_size),
            timing,
            free_at_ms: 0.0,
            adapters: None,
            loads: 0,
        }
    }

    /// The same engine holding at most `slots` LoRA adapters at once (vLLM's
    /// `--max-loras`), least recently used evicted first.
    pub fn with_adapter_slots(mut self, slots: NonZeroUsize) -> Self {
        self.adapters = Some(LruCache::new(slots));
        self
    }

    /// A request for `adapter` runs here: loads it unless held (evicting the least
    /// recently used one past the slots). Returns whether it loaded.
    pub fn use_adapter(&mut self, adapter: &std::sync::Arc<str>) -> bool {
        let Some(held) = self.adapters.as_mut() else {
            return false;
        };
        let loaded = held.put(std::sync::Arc::clone(adapter), ()).is_none();
        self.loads += u64::from(loaded);
        loaded
    }

    /// Adapters loaded so far.
    pub fn adapter_loads(&self) -> u64 {
        self.loads
    }

    /// Prompt tokens this engine would serve from its cache now, without changing it.
    pub fn cached_tokens(&self, hashes: &[u64], n_tokens: usize) -> u64 {
        self.cache.cached_tokens(hashes, n_tokens) as u64
    }

    /// Queues a prompt of `n_tokens` tokens (full-block `hashes`) arriving at
    /// `arrival_ms`: looks it up and inserts it in the cache, and times its prefill.
    pub fn serve(&mut self, arrival_ms: f64, hashes: &[u64], n_tokens: usize) -> Served {
        self.serve_after(arrival_ms, hashes, n_tokens, 0.0)
    }

    /// As [`EngineModel::serve`], its prefill delayed by `extra_ms` more (an adapter
    /// load before it, say).
    pub fn serve_after(
        &mut self,
        arrival_ms: f64,
        hashes: &[u64],
        n_tokens: usize,
        extra_ms: f64,
    ) -> Served {
        let cached = self.cache.lookup_and_insert(hashes, n_tokens) as u64;
        let uncached = (n_tokens as u64).saturating_sub(cached) as f64;
        let rate_per_ms = (self.timing.prefill_tokens_per_sec / 1e3).max(f64::MIN_POSITIVE);
        let start = arrival_ms.max(self.free_at_ms);
        let end = start + extra_ms.max(0.0) + self.timing.ttft_base_ms + uncached / rate_per_ms;
        self.free_at_ms = end;
        Served {
            cached_tokens: cached,
            prefill_start_ms: start,
            first_token_ms: end,
        }
    }

    /// The engine's timing.
    pub fn timing(&self) -> Timing {
        self.timing
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nz(n: usize) -> NonZeroUsize {
        NonZeroUsize::new(n).unwrap()
    }

    fn words(n: usize, tag: &str) -> String {
        (0..n).map(|i| format!("{tag}{i} ")).collect()
    }

    #[test]
    fn a_repeated_prompt_is_cached_in_whole_blocks_but_its_last_token() {
        let text = words(40, "w");
        let (n, h) = block_hashes(tokenize_words(&text), 16);
        let mut e = EngineModel::new(nz(100), nz(16), Timing::default());
        assert_eq!(e.serve(0.0, &h, n).cached_tokens, 0);
        assert_eq!(e.serve(1000.0, &h, n).cached_tokens, 32);
        // 32 full blocks of 16 = 32 tokens of 40; 33 tokens would cap at 32 too.
    }

    #[test]
    fn prefill_is_serialized_and_costs_uncached_tokens() {
        let timing = Timing {
            ttft_base_ms: 10.0,
            prefill_tokens_per_sec: 1000.0,
            decode_ms_per_token: 1.0,
        };
        let mut e = EngineModel::new(nz(100), nz(4), timing);
        let a = words(100, "a");
        let (n, h) = block_hashes(tokenize_words(&a), 4);
        let first = e.serve(0.0, &h, n);
        assert_eq!(first.first_token_ms, 110.0);
        // Arrives while the first prefills: waits, then prefills only the uncached
        // last block (96 of 100 tokens cached).
        let second = e.serve(50.0, &h, n);
        assert_eq!(second.prefill_start_ms, 110.0);
        assert_eq!(second.cached_tokens, 96);
        assert_eq!(second.first_token_ms, 110.0 + 10.0 + 4.0);
    }

    #[test]
    fn adapters_key_their_blocks_and_load_into_lru_slots() {
        let text = words(40, "w");
        let (_, base) = block_hashes(tokenize_words(&text), 16);
        let (_, a) = block_hashes_under(tokenize_words(&text), 16, Some("a"));
        let (_, b) = block_hashes_under(tokenize_words(&text), 16, Some("b"));
        assert!(base.iter().chain(&a).all(|h| !b.contains(h)));
        assert!(base.iter().all(|h| !a.contains(h)));
        let mut e = EngineModel::new(nz(100), nz(16), Timing::default()).with_adapter_slots(nz(2));
        let [x, y, z] = ["x", "y", "z"].map(std::sync::Arc::<str>::from);
        assert!(e.use_adapter(&x) && e.use_adapter(&y));
        assert!(!e.use_adapter(&x), "held");
        assert!(e.use_adapter(&z), "evicts y, the least recently used");
        assert!(e.use_adapter(&y));
        assert_eq!(e.adapter_loads(), 4);
    }

    #[test]
    fn a_full_cache_evicts_the_least_recently_used_chain() {
        let mut e = EngineModel::new(nz(4), nz(2), Timing::default());
        let (na, ha) = block_hashes(tokenize_words("a b c d e f g h i"), 2);
        let (nb, hb) = block_hashes(tokenize_words("z y x w v u t s r"), 2);
        e.serve(0.0, &ha, na);
        e.serve(0.0, &hb, nb);
        assert_eq!(e.cached_tokens(&ha, na), 0);
        assert_eq!(e.cached_tokens(&hb, nb), 8);
    }
}

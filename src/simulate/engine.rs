//! The engine model `simulate` and `sim-engine` (bench) share: one replica's prefix
//! cache of KV blocks with LRU eviction and the chained block hashes it keys on; and
//! `simulate`'s model of how an engine times its prefills ([`Physics`]).
//!
//! Units: **tokens** are the simulated engine's tokens, one per whitespace-separated
//! word of the prompt text ([`tokenize_words`]; sim-engine's tokenizer); a **block** is
//! `block_size` tokens; times are **milliseconds** of simulated time. A prefill is
//! `ttft_base_ms + uncached_tokens / prefill_tokens_per_ms` of work at full speed, run
//! under the engine's [`Physics`] (as sim-engine's): one at a time, up to N at full
//! speed, or up to N sharing one speed; FIFO beyond. Its cache lookup (and insert)
//! happens at arrival, in arrival order: the order a FIFO engine starts prefills in, so
//! it sees the same cache as sim-engine's lookup at the start of prefill. Decode is
//! concurrent: one token per `decode_ms_per_token` after the first — except under the
//! chunked physics, where prefill and decode share the engine's steps
//! ([`Physics::Chunked`]). No I/O, no clock.

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

/// How an engine's prefills share it: the engine *physics* (as sim-engine's
/// `--prefill-physics`). Real engines differ here, and a policy must not assume one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Physics {
    /// One prefill at a time, FIFO (a compute-bound GPU).
    #[default]
    Serial,
    /// Up to `slots` prefills at once, each at full speed; FIFO beyond.
    Parallel,
    /// Up to `slots` prefills at once sharing one full speed equally (processor
    /// sharing, as a per-step token budget split among running prefills); FIFO beyond.
    Shared,
    /// vLLM's chunked prefill, as sim-engine's `chunked`: a request joins the engine's
    /// batch `ttft_base_ms` after it arrives; the engine runs one batch a step; a step
    /// holds one token of every decoding request and, in the rest of a budget of
    /// [`CHUNKED_BUDGET_TOKENS`], chunks of the prompts still to compute, oldest first,
    /// and lasts `decode_ms_per_token + prefill tokens in it ÷ prefill speed`. A prefill
    /// so slows the tokens of every request decoding beside it, and a request ends at
    /// its last token's step, not after a fixed decode time.
    Chunked,
}

/// Tokens a step of the [`Physics::Chunked`] engine schedules at most (vLLM's
/// `max_num_batched_tokens` with chunked prefill; sim-engine's default).
pub const CHUNKED_BUDGET_TOKENS: u64 = 2048;

impl Physics {
    /// `serial`, `parallel`, `shared` or `chunked`.
    pub fn as_str(self) -> &'static str {
        match self {
            Physics::Serial => "serial",
            Physics::Parallel => "parallel",
            Physics::Shared => "shared",
            Physics::Chunked => "chunked",
        }
    }
}

/// A request's prefill in an engine: whose it is and the work left, in ms at full speed.
#[derive(Debug, Clone, Copy)]
struct Job {
    index: usize,
    left_ms: f64,
    start_ms: f64,
}

/// A chunked engine's request (see [`Physics::Chunked`]): prompt tokens still to
/// compute, tokens still to emit (the first included), and the step under way's share.
#[derive(Debug, Clone, Copy)]
struct Seq {
    index: usize,
    /// When it joins the batch (arrival + `ttft_base_ms`).
    ready_ms: f64,
    prefill_left: u64,
    tokens_left: u64,
    start_ms: Option<f64>,
    /// Prompt tokens computed in the step under way.
    chunk: u64,
    /// Whether the step under way emits one of its tokens.
    decoding: bool,
}

/// A prefill that ended: the request (as given to [`EngineModel::arrive`]), when it
/// started (queue wait = start − arrival) and when its first token was out, in ms; or,
/// under [`Physics::Chunked`] only, its last token (`last`; its time in
/// `first_token_ms`), which that engine's steps time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Finished {
    pub index: usize,
    pub prefill_start_ms: f64,
    pub first_token_ms: f64,
    pub last: bool,
}

/// One simulated engine: a [`PrefixCache`], its prefills under a [`Physics`], and the
/// LoRA adapters it holds.
///
/// Event-driven: [`EngineModel::arrive`] at a request's arrival (its cache lookup and
/// insert happen then, in arrival order: the order a FIFO engine starts them in), and
/// [`EngineModel::finish_next`] at [`EngineModel::next_finish_ms`], which moves
/// whenever a prefill starts or ends (under the shared physics every running one slows
/// down when another starts). [`EngineModel::version`] changes with it, so a caller
/// can tell a stale wake-up from a due one.
#[derive(Debug)]
pub struct EngineModel {
    cache: PrefixCache,
    timing: Timing,
    physics: Physics,
    slots: usize,
    running: Vec<Job>,
    waiting: std::collections::VecDeque<Job>,
    /// When `running`'s work was last brought up to date, in ms.
    at_ms: f64,
    version: u64,
    /// The adapters held, least recently used evicted first; `None`: adapters are not
    /// modelled.
    adapters: Option<LruCache<std::sync::Arc<str>, ()>>,
    /// Adapters loaded so far (one per request for an adapter it did not hold).
    loads: u64,
    /// The chunked physics' batch, in arrival order, and the end of its step under way.
    batch: Vec<Seq>,
    step_end_ms: Option<f64>,
    /// What the last step ended, not yet handed out by [`EngineModel::finish_next`].
    ended: std::collections::VecDeque<Finished>,
}

impl EngineModel {
    /// An engine with an empty cache of `kv_blocks` blocks of `block_size` tokens, its
    /// prefills under `physics` with `slots` at once (1 for the serial physics).
    pub fn new(
        kv_blocks: NonZeroUsize,
        block_size: NonZeroUsize,
        timing: Timing,
        physics: Physics,
        slots: NonZeroUsize,
    ) -> Self {
        EngineModel {
            cache: PrefixCache::new(kv_blocks, block_size),
            timing,
            physics,
            slots: if physics == Physics::Serial {
                1
            } else {
                slots.get()
            },
            running: Vec::new(),
            waiting: std::collections::VecDeque::new(),
            at_ms: 0.0,
            version: 0,
            adapters: None,
            loads: 0,
            batch: Vec::new(),
            step_end_ms: None,
            ended: std::collections::VecDeque::new(),
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

    /// Request `index`, a prompt of `n_tokens` tokens (full-block `hashes`), arrives at
    /// `now_ms`: it is looked up and inserted in the cache, and its prefill
    /// (`extra_ms` — an adapter load, say — + `ttft_base_ms` + uncached tokens at the
    /// prefill rate) starts, or queues FIFO. Returns its cached tokens. Call
    /// [`EngineModel::finish_next`] for every prefill due at or before `now_ms` first.
    pub fn arrive(
        &mut self,
        now_ms: f64,
        index: usize,
        (hashes, n_tokens): (&[u64], usize),
        extra_ms: f64,
        output_tokens: u64,
    ) -> u64 {
        let cached = self.cache.lookup_and_insert(hashes, n_tokens) as u64;
        let uncached = (n_tokens as u64).saturating_sub(cached) as f64;
        let rate_per_ms = (self.timing.prefill_tokens_per_sec / 1e3).max(f64::MIN_POSITIVE);
        if self.physics == Physics::Chunked {
            // An adapter load counts as that much more prompt to compute.
            let extra = (extra_ms.max(0.0) * rate_per_ms).round() as u64;
            self.batch.push(Seq {
                index,
                ready_ms: now_ms + self.timing.ttft_base_ms.max(0.0),
                prefill_left: (uncached as u64 + extra).max(1),
                tokens_left: output_tokens.max(1),
                start_ms: None,
                chunk: 0,
                decoding: false,
            });
            if self.step_end_ms.is_none() {
                self.start_step(now_ms);
                self.version += 1;
            }
            return cached;
        }
        self.advance(now_ms);
        let job = Job {
            index,
            left_ms: extra_ms.max(0.0) + self.timing.ttft_base_ms + uncached / rate_per_ms,
            start_ms: now_ms,
        };
        if self.running.len() < self.slots {
            self.running.push(job);
        } else {
            self.waiting.push_back(job);
        }
        self.version += 1;
        cached
    }

    /// When the next running prefill ends if nothing else arrives, in ms; `None` when
    /// none runs.
    pub fn next_finish_ms(&self) -> Option<f64> {
        if self.physics == Physics::Chunked {
            return if self.ended.is_empty() {
                self.step_end_ms
            } else {
                Some(self.at_ms)
            };
        }
        let least = self.running.iter().map(|j| j.left_ms).reduce(f64::min)?;
        Some(self.at_ms + least.max(0.0) / self.share())
    }

    /// Whether this engine's steps time its requests' last tokens ([`Physics::Chunked`]:
    /// [`EngineModel::finish_next`] hands them out too); otherwise decode takes
    /// `decode_ms_per_token` a token after the first, beside any prefill.
    pub fn times_last_tokens(&self) -> bool {
        self.physics == Physics::Chunked
    }

    /// Changes whenever [`EngineModel::next_finish_ms`] may have.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Ends the prefill due at [`EngineModel::next_finish_ms`] (the clock moves there)
    /// and starts the first waiting one in its slot.
    pub fn finish_next(&mut self) -> Option<Finished> {
        if self.physics == Physics::Chunked {
            if self.ended.is_empty() {
                self.end_step();
            }
            return self.ended.pop_front();
        }
        let at = self.next_finish_ms()?;
        self.advance(at);
        let (i, _) = self
            .running
            .iter()
            .enumerate()
            .min_by(|a, b| a.1.left_ms.total_cmp(&b.1.left_ms))?;
        let job = self.running.swap_remove(i);
        if let Some(mut next) = self.waiting.pop_front() {
            next.start_ms = at;
            self.running.push(next);
        }
        self.version += 1;
        Some(Finished {
            index: job.index,
            prefill_start_ms: job.start_ms,
            first_token_ms: at,
            last: false,
        })
    }

    /// Plans the chunked engine's step from `at_ms` (see [`Physics::Chunked`]): one
    /// token of each decoding request, then prompt chunks oldest first in the budget
    /// left; none when the batch is empty.
    fn start_step(&mut self, at_ms: f64) {
        self.at_ms = self.at_ms.max(at_ms);
        // With nothing decoding and nothing ready, the engine idles until a request is.
        if self
            .batch
            .iter()
            .all(|s| s.prefill_left > 0 && s.ready_ms > self.at_ms)
            && let Some(ready) = self.batch.iter().map(|s| s.ready_ms).reduce(f64::min)
        {
            self.at_ms = ready;
        }
        let at = self.at_ms;
        let mut budget = CHUNKED_BUDGET_TOKENS;
        for s in &mut self.batch {
            s.decoding = s.prefill_left == 0;
            s.chunk = 0;
            budget = budget.saturating_sub(u64::from(s.decoding));
        }
        let mut prefill = 0;
        for s in self
            .batch
            .iter_mut()
            .filter(|s| s.prefill_left > 0 && s.ready_ms <= at)
        {
            if budget == 0 {
                break;
            }
            s.chunk = s.prefill_left.min(budget);
            s.start_ms.get_or_insert(self.at_ms);
            budget -= s.chunk;
            prefill += s.chunk;
        }
        let per_token_ms = 1e3 / self.timing.prefill_tokens_per_sec.max(f64::MIN_POSITIVE);
        self.step_end_ms = (!self.batch.is_empty()).then_some(
            self.at_ms + self.timing.decode_ms_per_token + prefill as f64 * per_token_ms,
        );
    }

    /// Ends the chunked engine's step under way: its first and last tokens go to
    /// `ended`, finished requests leave the batch, and the next step starts.
    fn end_step(&mut self) {
        let Some(at) = self.step_end_ms else { return };
        self.at_ms = at;
        for s in &mut self.batch {
            let first = s.chunk > 0 && s.chunk == s.prefill_left;
            s.prefill_left -= s.chunk;
            if first || s.decoding {
                s.tokens_left -= 1;
            }
            if first {
                self.ended.push_back(Finished {
                    index: s.index,
                    prefill_start_ms: s.start_ms.unwrap_or(at),
                    first_token_ms: at,
                    last: false,
                });
            }
            if (first || s.decoding) && s.tokens_left == 0 {
                self.ended.push_back(Finished {
                    index: s.index,
                    prefill_start_ms: s.start_ms.unwrap_or(at),
                    first_token_ms: at,
                    last: true,
                });
            }
        }
        self.batch
            .retain(|s| s.prefill_left > 0 || s.tokens_left > 0);
        self.start_step(at);
        self.version += 1;
    }

    /// The speed each running prefill advances at (1 = full speed).
    fn share(&self) -> f64 {
        match self.physics {
            Physics::Shared => 1.0 / self.running.len().max(1) as f64,
            Physics::Serial | Physics::Parallel | Physics::Chunked => 1.0,
        }
    }

    /// Brings the running prefills' work up to `now_ms`.
    fn advance(&mut self, now_ms: f64) {
        let done = (now_ms - self.at_ms).max(0.0) * self.share();
        for j in &mut self.running {
            j.left_ms -= done;
        }
        self.at_ms = self.at_ms.max(now_ms);
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

    fn engine(physics: Physics, slots: usize, block: usize, timing: Timing) -> EngineModel {
        EngineModel::new(nz(100), nz(block), timing, physics, nz(slots))
    }

    /// Every prefill to its end, in order: (index, start, first token).
    fn drain(e: &mut EngineModel) -> Vec<(usize, f64, f64)> {
        std::iter::from_fn(|| e.finish_next())
            .map(|f| (f.index, f.prefill_start_ms, f.first_token_ms))
            .collect()
    }

    #[test]
    fn a_repeated_prompt_is_cached_in_whole_blocks_but_its_last_token() {
        let text = words(40, "w");
        let (n, h) = block_hashes(tokenize_words(&text), 16);
        let mut e = engine(Physics::Serial, 1, 16, Timing::default());
        assert_eq!(e.arrive(0.0, 0, (&h, n), 0.0, 1), 0);
        assert_eq!(e.arrive(1000.0, 1, (&h, n), 0.0, 1), 32);
        // 32 full blocks of 16 = 32 tokens of 40; 33 tokens would cap at 32 too.
    }

    const SLOW: Timing = Timing {
        ttft_base_ms: 10.0,
        prefill_tokens_per_sec: 1000.0,
        decode_ms_per_token: 1.0,
    };

    /// Every token a chunked engine times until it is idle: (request, ms, last).
    fn steps(e: &mut EngineModel) -> Vec<(usize, f64, bool)> {
        let mut out = Vec::new();
        while e.next_finish_ms().is_some() {
            if let Some(f) = e.finish_next() {
                out.push((f.index, f.first_token_ms, f.last));
            }
        }
        out
    }

    #[test]
    fn chunked_steps_time_first_and_last_tokens_and_a_prefill_slows_decoding() {
        // 1 ms a prompt token, steps of 1 ms + their prompt tokens; no wait to join.
        let timing = Timing {
            ttft_base_ms: 0.0,
            ..SLOW
        };
        let prompt = |n, tag| block_hashes(tokenize_words(&words(n, tag)), 4);
        // Alone: 100 tokens in one step (1 + 100 ms), then one token a 1 ms step.
        let mut e = engine(Physics::Chunked, 6, 4, timing);
        let (n, h) = prompt(100, "a");
        e.arrive(0.0, 0, (&h, n), 0.0, 3);
        assert_eq!(steps(&mut e), [(0, 101.0, false), (0, 103.0, true)]);
        // 3,000 tokens take two steps: 2,048 of the budget, then the other 952.
        let (n, h) = prompt(3000, "b");
        e.arrive(200.0, 1, (&h, n), 0.0, 1);
        assert_eq!(
            steps(&mut e),
            [(1, 200.0 + 2049.0 + 953.0, false), (1, 3202.0, true)]
        );
        // A request decoding while a 2,000-token prompt arrives: its next token waits
        // for the step that computes that prompt.
        let mut e = engine(Physics::Chunked, 6, 4, timing);
        let (n, h) = prompt(10, "c");
        e.arrive(0.0, 0, (&h, n), 0.0, 5);
        assert_eq!(
            e.finish_next().map(|f| (f.first_token_ms, f.last)),
            Some((11.0, false))
        );
        let (n, h) = prompt(2000, "d");
        e.arrive(11.0, 1, (&h, n), 0.0, 1);
        assert_eq!(
            steps(&mut e),
            [(1, 2013.0, false), (1, 2013.0, true), (0, 2015.0, true)],
            "its 2nd token at 12 (a decode-only step), its 3rd at 12 + 1 + 2,000 (the \
             prefill's step), its 4th and 5th 1 ms apart"
        );
        // A request joins the batch `ttft_base_ms` (10) after it arrives.
        let mut e = engine(Physics::Chunked, 6, 4, SLOW);
        let (n, h) = prompt(100, "e");
        e.arrive(5.0, 0, (&h, n), 0.0, 1);
        assert_eq!(steps(&mut e), [(0, 116.0, false), (0, 116.0, true)]);
    }

    #[test]
    fn prefill_is_serialized_and_costs_uncached_tokens() {
        let mut e = engine(Physics::Serial, 6, 4, SLOW);
        let a = words(100, "a");
        let (n, h) = block_hashes(tokenize_words(&a), 4);
        e.arrive(0.0, 0, (&h, n), 0.0, 1);
        assert_eq!(e.next_finish_ms(), Some(110.0));
        // Arrives while the first prefills: waits, then prefills only the uncached
        // last block (96 of 100 tokens cached).
        assert_eq!(e.arrive(50.0, 1, (&h, n), 0.0, 1), 96);
        assert_eq!(drain(&mut e), vec![(0, 0.0, 110.0), (1, 110.0, 124.0)]);
    }

    #[test]
    fn parallel_prefills_run_at_full_speed_up_to_the_slots_then_queue() {
        let mut e = engine(Physics::Parallel, 2, 4, SLOW);
        for (i, tag) in ["a", "b", "c"].into_iter().enumerate() {
            let (n, h) = block_hashes(tokenize_words(&words(100, tag)), 4);
            e.arrive(0.0, i, (&h, n), 0.0, 1);
        }
        assert_eq!(
            drain(&mut e),
            vec![(0, 0.0, 110.0), (1, 0.0, 110.0), (2, 110.0, 220.0)]
        );
    }

    #[test]
    fn shared_prefills_split_one_speed_and_slow_down_when_another_starts() {
        let mut e = engine(Physics::Shared, 2, 4, SLOW);
        let (n, h) = block_hashes(tokenize_words(&words(100, "a")), 4);
        e.arrive(0.0, 0, (&h, n), 0.0, 1);
        assert_eq!(e.next_finish_ms(), Some(110.0));
        let v = e.version();
        // At 55 ms half of the first is done; from then on both run at half speed.
        let (n, h) = block_hashes(tokenize_words(&words(100, "b")), 4);
        e.arrive(55.0, 1, (&h, n), 0.0, 1);
        assert_ne!(e.version(), v, "the first one's end moved");
        assert_eq!(e.next_finish_ms(), Some(165.0));
        // The second has 55 ms of work left when the first ends: alone again.
        assert_eq!(drain(&mut e), vec![(0, 0.0, 165.0), (1, 55.0, 220.0)]);
    }

    #[test]
    fn adapters_key_their_blocks_and_load_into_lru_slots() {
        let text = words(40, "w");
        let (_, base) = block_hashes(tokenize_words(&text), 16);
        let (_, a) = block_hashes_under(tokenize_words(&text), 16, Some("a"));
        let (_, b) = block_hashes_under(tokenize_words(&text), 16, Some("b"));
        assert!(base.iter().chain(&a).all(|h| !b.contains(h)));
        assert!(base.iter().all(|h| !a.contains(h)));
        let mut e = engine(Physics::Serial, 1, 16, Timing::default()).with_adapter_slots(nz(2));
        let [x, y, z] = ["x", "y", "z"].map(std::sync::Arc::<str>::from);
        assert!(e.use_adapter(&x) && e.use_adapter(&y));
        assert!(!e.use_adapter(&x), "held");
        assert!(e.use_adapter(&z), "evicts y, the least recently used");
        assert!(e.use_adapter(&y));
        assert_eq!(e.adapter_loads(), 4);
    }

    #[test]
    fn a_full_cache_evicts_the_least_recently_used_chain() {
        let mut e = EngineModel::new(nz(4), nz(2), Timing::default(), Physics::Serial, nz(1));
        let (na, ha) = block_hashes(tokenize_words("a b c d e f g h i"), 2);
        let (nb, hb) = block_hashes(tokenize_words("z y x w v u t s r"), 2);
        e.arrive(0.0, 0, (&ha, na), 0.0, 1);
        e.arrive(0.0, 1, (&hb, nb), 0.0, 1);
        assert_eq!(e.cached_tokens(&ha, na), 0);
        assert_eq!(e.cached_tokens(&hb, nb), 8);
    }
}

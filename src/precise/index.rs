//! [`BlockIndex`]: which worker holds which KV block, in which tier, as the engines
//! report it. Pure: no sockets, no clocks (time is a parameter), no locking (the owner
//! wraps it in one `std::sync::Mutex`, never held across an `.await`).
//!
//! Keys are the router's own (spec `shared/docs/vllm-kv-events.md` §9, the "dual key"
//! design): block k of a token sequence is keyed by [`chain_keys`], an xxh3 chain over
//! the previous block's key and the block's token ids (plus the digest of the block's
//! `extra_keys`, and a root seeded by the LoRA adapter). The engine's block hash is
//! seeded per process, so it is never compared across workers or with a request; it
//! only finds, per worker, the router key of a parent block and of a removed block.
//!
//! Per key the index keeps the holders ("residents": one per source, i.e. per worker
//! and DP rank, per tier, per engine block) with a reference count (vLLM may store the
//! same block twice, §5.4; the offloading connector re-announces shared hashes), and
//! short-lived speculative holders (a request just routed there, §5.9). The number of
//! keys (distinct blocks, whatever tiers hold them) is bounded by `max_blocks`; the
//! least recently stored or matched key goes first, with every tier's holding of it.
//!
//! Tiers (§5.7, [`super::tiers`]): every `medium` is indexed. A removal applies to its
//! own tier only; `AllBlocksCleared` clears the GPU tier only (§5.5); a block held in
//! any tier of a source counts towards its match, in the heaviest tier holding it. A
//! host-tier copy usually comes without tokens: vLLM's CPU-offloading connector sends
//! empty `token_ids`, no parent, a block size of 0 (or its own block size) and the GPU
//! blocks' hashes (as raw bytes in some versions, normalised by the decoder). Such an
//! event is placed through the engine-hash → key map kept from the GPU event that had
//! the tokens (the map lives while any tier holds the block); a hash never seen with
//! tokens cannot be placed and is counted ([`Applied::Stored`]'s `unknown`). An event
//! that does carry tokens (vLLM's self-describing offload events, a GPU event) is
//! chained from its parent as usual.
//!
//! Only the full-attention group is indexed (§5.6): other groups are skipped and
//! counted by the caller. A GPU `BlockStored` whose parent block is unknown (evicted
//! here, or stored before this router was listening, §5.2) cannot be placed in a prefix
//! chain and is skipped.
//!
//! Memory: `cargo bench --bench precise_index` measured 263 bytes of RSS per block
//! with one holder, 308 with two (1 M blocks of 16 tokens, 2026-11-30): an LRU node
//! and its hash slot, the resident list, and the engine-hash map entry. A host-tier copy
//! of a block adds nothing measurable: one more resident in a list that had room.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use lru::LruCache;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::events::{BlockRemoved, BlockStored, Event};
use super::tiers::{MAX_MEDIUMS, MAX_TIERS, Medium, Run, Tiers};

/// Identity of one event feed (a worker's publisher) in the index. Stable for as long as
/// the worker keeps the same URL and `kv_events` config.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SourceId(pub u64);

/// Seed of the first block of a sequence without a LoRA adapter.
const ROOT_SEED: u64 = 0x6361_722d_7072_6563; // "car-prec"

/// The chain's starting key: the base model's, or one per adapter name.
pub fn root_key(lora: Option<&str>) -> u64 {
    match lora {
        None => ROOT_SEED,
        Some(name) => xxh3_64_with_seed(name.as_bytes(), ROOT_SEED),
    }
}

/// Per-block `extra_keys` digests of a request for LoRA adapter `lora` with
/// `cache_salt` `salt`, over `blocks` blocks, as its engine will report them (see
/// [`super::events::strings_digest`]); empty when neither is set.
pub fn request_extra_keys(
    lora: Option<&str>,
    salt: Option<&str>,
    blocks: usize,
) -> Vec<Option<u64>> {
    if lora.is_none() && salt.is_none() {
        return Vec::new();
    }
    let first: Vec<&str> = lora.into_iter().chain(salt).collect();
    let rest = lora.map(|l| super::events::strings_digest(&[l]));
    (0..blocks)
        .map(|i| {
            if i == 0 {
                Some(super::events::strings_digest(&first))
            } else {
                rest
            }
        })
        .collect()
}

/// Router keys of the full blocks of `tokens` (a trailing partial block gets none),
/// chained from `parent` (a block's key, or [`root_key`]). `extra[i]`, when present, is
/// the digest of block i's `extra_keys`. The same function keys a request's blocks and
/// an engine's stored blocks, so equal token runs get equal keys.
pub fn chain_keys(
    parent: u64,
    tokens: &[u32],
    block_size: usize,
    extra: &[Option<u64>],
) -> Vec<u64> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut keys = Vec::with_capacity(tokens.len() / block_size);
    let mut bytes = Vec::with_capacity(block_size * 4);
    let mut prev = parent;
    for (i, block) in tokens.chunks_exact(block_size).enumerate() {
        bytes.clear();
        for t in block {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        let mut key = xxh3_64_with_seed(&bytes, prev);
        if let Some(Some(digest)) = extra.get(i) {
            key = xxh3_64_with_seed(&digest.to_le_bytes(), key);
        }
        keys.push(key);
        prev = key;
    }
    keys
}

/// What applying one event did (the caller counts it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// Blocks added (or re-counted); `unknown`: hashes of an event without tokens that
    /// were never seen stored with tokens, so not placed.
    Stored { blocks: usize, unknown: usize },
    /// Known blocks released from the event's tier; removals of blocks that tier does
    /// not hold are ignored (§5.3).
    Removed(usize),
    /// The source's GPU tier dropped (`AllBlocksCleared`, §5.5).
    Cleared,
    /// Nothing indexed, and why.
    Skipped(Skip),
}

/// Why an event was not indexed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skip {
    /// The parent block of a GPU run is not in the index (§5.2).
    UnknownParent,
    /// A KV-cache group other than full attention (§5.6).
    OtherGroup,
    /// The event's tokens come in blocks of another size than `precise.block_size`.
    BlockSize(usize),
}

#[derive(Debug)]
struct Resident {
    source: SourceId,
    engine_hash: u64,
    /// Times the engine stored this block in this tier without removing it.
    count: u32,
    medium: Medium,
}

impl Resident {
    fn is(&self, source: SourceId, engine_hash: u64) -> bool {
        self.source == source && self.engine_hash == engine_hash
    }
}

#[derive(Debug)]
struct Speculation {
    source: SourceId,
    until: Instant,
    /// The source's epoch when speculated; a clear of the source bumps it.
    epoch: u32,
}

#[derive(Debug, Default)]
struct KeyEntry {
    residents: Vec<Resident>,
    speculative: Vec<Speculation>,
}

impl KeyEntry {
    fn is_empty(&self) -> bool {
        self.residents.is_empty() && self.speculative.is_empty()
    }

    /// Drops `source`'s holdings of engine block `engine_hash` that `drop` selects,
    /// taking them off `held`; true when the source still holds the block in a tier.
    fn release(
        &mut self,
        source: SourceId,
        engine_hash: u64,
        held: &mut [u64; MAX_MEDIUMS],
        drop: impl Fn(&Resident) -> bool,
    ) -> bool {
        self.residents.retain(|r| {
            let gone = r.is(source, engine_hash) && drop(r);
            if gone {
                held[r.medium.index()] = held[r.medium.index()].saturating_sub(1);
            }
            !gone
        });
        self.residents.iter().any(|r| r.is(source, engine_hash))
    }
}

#[derive(Debug, Default)]
struct SourceBlocks {
    /// Engine block hash -> router key, for parents, removals and host-tier copies;
    /// kept while any tier holds the block.
    engine: HashMap<u64, u64>,
    epoch: u32,
    /// The last [`RECENT_STORES`] runs the engine stored, newest last (token parity's
    /// diagnosis, [`super::parity`]).
    recent: std::collections::VecDeque<RecentStore>,
    /// Engine blocks held, per medium.
    held: [u64; MAX_MEDIUMS],
}

/// Runs of stored blocks remembered per source for token parity's diagnosis.
pub const RECENT_STORES: usize = 16;
/// Tokens of a stored run remembered (its first blocks).
const RECENT_TOKENS: usize = 4096;

/// One `BlockStored` run as indexed: where it hangs and what the engine said it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecentStore {
    /// Router key of the block before the run; `None` when the run starts at token 0.
    pub parent: Option<u64>,
    /// The run's first tokens (at most 4096), as the engine reported them.
    pub tokens: Vec<u32>,
}

/// Router key -> holders, bounded, LRU. See the module docs.
#[derive(Debug)]
pub struct BlockIndex {
    block_size: usize,
    max_blocks: usize,
    keys: LruCache<u64, KeyEntry>,
    sources: HashMap<SourceId, SourceBlocks>,
    tiers: Tiers,
    evicted: u64,
    /// LoRA adapter names seen in events, so a request naming one as its `model` is
    /// keyed under that adapter (at most [`MAX_ADAPTERS`]).
    adapters: HashSet<String>,
}

/// Most adapter names remembered; more are not expected in one pool.
const MAX_ADAPTERS: usize = 4096;

impl BlockIndex {
    /// An empty index for blocks of `block_size` tokens, holding at most `max_blocks`
    /// keys (nothing is allocated up front), with the default tiers.
    pub fn new(block_size: usize, max_blocks: usize) -> Self {
        BlockIndex::with_tiers(block_size, max_blocks, Tiers::default())
    }

    /// [`BlockIndex::new`] with these tiers (`precise.tier_weights`).
    pub fn with_tiers(block_size: usize, max_blocks: usize, tiers: Tiers) -> Self {
        BlockIndex {
            block_size,
            max_blocks: max_blocks.max(1),
            keys: LruCache::unbounded(),
            sources: HashMap::new(),
            tiers,
            evicted: 0,
            adapters: HashSet::new(),
        }
    }

    /// Whether any engine reported blocks of a LoRA adapter.
    pub fn has_adapters(&self) -> bool {
        !self.adapters.is_empty()
    }

    /// Whether an engine reported blocks of LoRA adapter `name`.
    pub fn is_adapter(&self, name: &str) -> bool {
        self.adapters.contains(name)
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The tiers blocks are held in.
    pub fn tiers(&self) -> &Tiers {
        &self.tiers
    }

    /// Distinct blocks (keys) indexed, in any tier, speculative ones included.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Engine blocks `source` holds according to its events, in any tier.
    pub fn source_blocks(&self, source: SourceId) -> usize {
        self.sources.get(&source).map_or(0, |s| s.engine.len())
    }

    /// Engine blocks `source` holds per configured tier (a block in two tiers counts
    /// in both).
    pub fn source_tier_blocks(&self, source: SourceId) -> [u64; MAX_TIERS] {
        let mut out = [0; MAX_TIERS];
        if let Some(s) = self.sources.get(&source) {
            for (m, n) in s.held.iter().enumerate() {
                if *n > 0
                    && let Some(slot) = out.get_mut(self.tiers.tier(Medium::from_index(m)))
                {
                    *slot += n;
                }
            }
        }
        out
    }

    /// Keys dropped to stay within `max_blocks`, since creation.
    pub fn evicted(&self) -> u64 {
        self.evicted
    }

    /// Applies one event from `source`.
    pub fn apply(&mut self, source: SourceId, event: &Event) -> Applied {
        match event {
            Event::Stored(e) => self.store(source, e),
            Event::Removed(e) => self.remove(source, e),
            Event::AllCleared => {
                let gpu = self.tiers.gpu();
                self.clear_medium(source, gpu);
                Applied::Cleared
            }
        }
    }

    fn store(&mut self, source: SourceId, e: &BlockStored) -> Applied {
        if !is_full_attention(e.group_idx, e.kind.as_deref()) {
            return Applied::Skipped(Skip::OtherGroup);
        }
        let medium = self.tiers.medium(e.medium.as_deref());
        if e.token_ids.is_empty() {
            return self.place_by_hash(source, medium, &e.block_hashes);
        }
        if e.block_size != self.block_size {
            return Applied::Skipped(Skip::BlockSize(e.block_size));
        }
        if let Some(lora) = &e.lora
            && self.adapters.len() < MAX_ADAPTERS
            && !self.adapters.contains(lora)
        {
            self.adapters.insert(lora.clone());
        }
        let gpu = medium == self.tiers.gpu();
        let parent = match e.parent_block_hash {
            None => root_key(e.lora.as_deref()),
            Some(p) => match self.sources.get(&source).and_then(|s| s.engine.get(&p)) {
                Some(k) => *k,
                None if gpu => return Applied::Skipped(Skip::UnknownParent),
                // A host-tier copy of blocks whose GPU run this router knows.
                None => return self.place_by_hash(source, medium, &e.block_hashes),
            },
        };
        let keys = chain_keys(parent, &e.token_ids, self.block_size, &e.extra_keys);
        for (&engine_hash, &key) in e.block_hashes.iter().zip(&keys) {
            self.hold(source, medium, engine_hash, key);
        }
        if gpu {
            let recent = &mut self.sources.entry(source).or_default().recent;
            if recent.len() == RECENT_STORES {
                recent.pop_front();
            }
            recent.push_back(RecentStore {
                parent: e.parent_block_hash.map(|_| parent),
                tokens: e.token_ids[..e.token_ids.len().min(RECENT_TOKENS)].to_vec(),
            });
        }
        Applied::Stored {
            blocks: keys.len(),
            unknown: 0,
        }
    }

    /// Places blocks named by engine hash only (a host-tier copy without tokens) where
    /// the source's GPU events put them.
    fn place_by_hash(&mut self, source: SourceId, medium: Medium, hashes: &[u64]) -> Applied {
        let (mut blocks, mut unknown) = (0, 0);
        for &h in hashes {
            match self.sources.get(&source).and_then(|s| s.engine.get(&h)) {
                Some(&key) => {
                    self.hold(source, medium, h, key);
                    blocks += 1;
                }
                None => unknown += 1,
            }
        }
        Applied::Stored { blocks, unknown }
    }

    /// Counts one more copy of engine block `engine_hash` (router key `key`) in
    /// `medium` on `source`.
    fn hold(&mut self, source: SourceId, medium: Medium, engine_hash: u64, key: u64) {
        let src = self.sources.entry(source).or_default();
        if let Some(old) = src.engine.insert(engine_hash, key)
            && old != key
            && let Some(entry) = self.keys.peek_mut(&old)
        {
            // The engine reused a hash for other tokens (a new process, or a
            // collision): the old block is gone from every tier.
            entry.release(source, engine_hash, &mut src.held, |_| true);
            if entry.is_empty() {
                self.keys.pop(&old);
            }
        }
        if self.keys.get_mut(&key).is_none() {
            self.insert_key(key);
        }
        let Some(entry) = self.keys.get_mut(&key) else {
            return;
        };
        let new = match entry
            .residents
            .iter_mut()
            .find(|r| r.is(source, engine_hash) && r.medium == medium)
        {
            Some(r) => {
                r.count = r.count.saturating_add(1);
                false
            }
            None => {
                entry.residents.push(Resident {
                    source,
                    engine_hash,
                    count: 1,
                    medium,
                });
                true
            }
        };
        // Confirmed by the engine: the speculation has served its purpose.
        entry.speculative.retain(|s| s.source != source);
        if new && let Some(src) = self.sources.get_mut(&source) {
            src.held[medium.index()] += 1;
        }
    }

    /// Adds an empty entry for `key`, evicting least recently used keys past the bound
    /// (with every tier's holding of them).
    fn insert_key(&mut self, key: u64) {
        self.keys.push(key, KeyEntry::default());
        while self.keys.len() > self.max_blocks {
            let Some((gone, entry)) = self.keys.pop_lru() else {
                break;
            };
            self.evicted += 1;
            for r in entry.residents {
                if let Some(src) = self.sources.get_mut(&r.source) {
                    let held = &mut src.held[r.medium.index()];
                    *held = held.saturating_sub(1);
                    if src.engine.get(&r.engine_hash) == Some(&gone) {
                        src.engine.remove(&r.engine_hash);
                    }
                }
            }
        }
    }

    fn remove(&mut self, source: SourceId, e: &BlockRemoved) -> Applied {
        if !is_full_attention(e.group_idx, None) {
            return Applied::Skipped(Skip::OtherGroup);
        }
        let medium = self.tiers.medium(e.medium.as_deref());
        let gpu = medium == self.tiers.gpu();
        let Some(src) = self.sources.get_mut(&source) else {
            return Applied::Removed(0);
        };
        let mut removed = 0;
        for engine_hash in &e.block_hashes {
            let Some(&key) = src.engine.get(engine_hash) else {
                continue;
            };
            let Some(entry) = self.keys.peek_mut(&key) else {
                src.engine.remove(engine_hash);
                continue;
            };
            let Some(r) = entry
                .residents
                .iter_mut()
                .find(|r| r.is(source, *engine_hash) && r.medium == medium)
            else {
                // Not held in this tier (another tier's copy stays).
                continue;
            };
            removed += 1;
            r.count = r.count.saturating_sub(1);
            if r.count == 0
                && !entry.release(source, *engine_hash, &mut src.held, |r| {
                    r.medium == medium && r.count == 0
                })
            {
                src.engine.remove(engine_hash);
            }
            if gpu {
                // The engine's word beats a guess made when routing.
                entry.speculative.retain(|s| s.source != source);
            }
            if entry.is_empty() {
                self.keys.pop(&key);
            }
        }
        Applied::Removed(removed)
    }

    /// Drops every block `source` holds in `medium` (`AllBlocksCleared`: the GPU tier,
    /// §5.5) and voids its speculative entries; blocks other tiers hold stay.
    fn clear_medium(&mut self, source: SourceId, medium: Medium) {
        let BlockIndex { keys, sources, .. } = self;
        let Some(src) = sources.get_mut(&source) else {
            return;
        };
        src.epoch = src.epoch.wrapping_add(1);
        src.recent.clear();
        let SourceBlocks { engine, held, .. } = src;
        engine.retain(|hash, key| {
            let Some(entry) = keys.peek_mut(key) else {
                return false;
            };
            let kept = entry.release(source, *hash, held, |r| r.medium == medium);
            if entry.is_empty() {
                keys.pop(key);
            }
            kept
        });
    }

    /// Drops every block `source` holds, in every tier (engine restart, sequence gap,
    /// worker unhealthy or removed) and voids its speculative entries.
    pub fn clear_source(&mut self, source: SourceId) {
        let Some(src) = self.sources.get_mut(&source) else {
            return;
        };
        src.epoch = src.epoch.wrapping_add(1);
        src.recent.clear();
        src.held = [0; MAX_MEDIUMS];
        for (_, key) in src.engine.drain() {
            if let Some(entry) = self.keys.peek_mut(&key) {
                entry.residents.retain(|r| r.source != source);
                if entry.is_empty() {
                    self.keys.pop(&key);
                }
            }
        }
    }

    /// Counts, per source of `sources`, how many of `keys` (a request's blocks, in
    /// order) it holds as a run from the first, in any tier: real holders and
    /// speculative ones still valid at `now`. Matched keys become most recently used.
    pub fn match_prefix(&mut self, keys: &[u64], sources: &[SourceId], now: Instant) -> Vec<usize> {
        self.match_runs(keys, sources, now)
            .into_iter()
            .map(|r| r.blocks)
            .collect()
    }

    /// [`BlockIndex::match_prefix`] with each run's blocks by tier: a block counts in
    /// the heaviest configured tier the source holds it in (a valid speculative entry
    /// counts as the GPU's; configured tiers are numbered heaviest first).
    pub fn match_runs(&mut self, keys: &[u64], sources: &[SourceId], now: Instant) -> Vec<Run> {
        let mut runs = vec![Run::default(); sources.len()];
        let mut alive: Vec<bool> = vec![true; sources.len()];
        let epochs: Vec<u32> = sources
            .iter()
            .map(|s| self.sources.get(s).map_or(0, |b| b.epoch))
            .collect();
        let gpu = self.tiers.gpu_tier();
        for key in keys {
            let Some(entry) = self.keys.get_mut(key) else {
                break;
            };
            entry.speculative.retain(|s| {
                s.until > now
                    && self
                        .sources
                        .get(&s.source)
                        .is_none_or(|b| b.epoch == s.epoch)
            });
            if entry.is_empty() {
                self.keys.pop(key);
                break;
            }
            let mut any = false;
            for (j, source) in sources.iter().enumerate() {
                if !alive[j] {
                    continue;
                }
                let mut best = usize::MAX;
                for r in &entry.residents {
                    if r.source == *source {
                        best = best.min(self.tiers.tier(r.medium));
                    }
                }
                if best > gpu
                    && entry
                        .speculative
                        .iter()
                        .any(|s| s.source == *source && s.epoch == epochs[j])
                {
                    best = gpu;
                }
                if best == usize::MAX {
                    alive[j] = false;
                } else {
                    runs[j].push(best);
                    any = true;
                }
            }
            if !any {
                break;
            }
        }
        runs
    }

    /// How many of `keys` (a request's blocks, in order) `source` holds as a run from
    /// the first, in any tier, by its engine's own events (speculative entries do not
    /// count). Does not touch recency.
    pub fn confirmed_run(&self, keys: &[u64], source: SourceId) -> usize {
        keys.iter()
            .take_while(|k| self.confirms(**k, source))
            .count()
    }

    /// Whether `source`'s engine reported holding block `key`, in any tier.
    pub fn confirms(&self, key: u64, source: SourceId) -> bool {
        self.keys
            .peek(&key)
            .is_some_and(|e| e.residents.iter().any(|r| r.source == source))
    }

    /// The runs `source` stored most recently, oldest first.
    pub fn recent_stores(&self, source: SourceId) -> impl Iterator<Item = &RecentStore> {
        self.sources
            .get(&source)
            .into_iter()
            .flat_map(|s| s.recent.iter())
    }

    /// Marks `keys` as held by `source` until `until` (a request was just routed there;
    /// the engine's events confirm or cancel it).
    pub fn speculate(&mut self, keys: &[u64], source: SourceId, until: Instant) {
        let epoch = self.sources.entry(source).or_default().epoch;
        for &key in keys {
            if self.keys.get_mut(&key).is_none() {
                self.insert_key(key);
            }
            let Some(entry) = self.keys.get_mut(&key) else {
                continue;
            };
            match entry.speculative.iter_mut().find(|s| s.source == source) {
                Some(s) => {
                    s.until = s.until.max(until);
                    s.epoch = epoch;
                }
                None => entry.speculative.push(Speculation {
                    source,
                    until,
                    epoch,
                }),
            }
        }
    }
}

/// The group a prefix lookup uses (§5.6): the kind says full attention, or, without a
/// kind, group 0 (or no group: an ordinary model).
fn is_full_attention(group: Option<i64>, kind: Option<&str>) -> bool {
    match kind {
        Some(k) => k == "full_attention",
        None => group.is_none_or(|g| g == 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const A: SourceId = SourceId(1);
    const B: SourceId = SourceId(2);
    const BS: usize = 4;

    fn tokens(n: u32, salt: u32) -> Vec<u32> {
        (0..n).map(|i| i * 7 + salt).collect()
    }

    /// BlockStored for `toks` (whole blocks), engine hashes `first..`, after `parent`.
    fn stored(toks: &[u32], first_hash: u64, parent: Option<u64>) -> Event {
        let n = toks.len() / BS;
        Event::Stored(BlockStored {
            block_hashes: (first_hash..first_hash + n as u64).collect(),
            parent_block_hash: parent,
            token_ids: toks.to_vec(),
            block_size: BS,
            lora: None,
            medium: Some("GPU".into()),
            extra_keys: Vec::new(),
            group_idx: None,
            kind: None,
        })
    }

    fn removed(hashes: &[u64]) -> Event {
        Event::Removed(BlockRemoved {
            block_hashes: hashes.to_vec(),
            medium: None,
            group_idx: None,
        })
    }

    fn keys(toks: &[u32]) -> Vec<u64> {
        chain_keys(root_key(None), toks, BS, &[])
    }

    fn t0() -> Instant {
        Instant::now()
    }

    #[test]
    fn request_keys_equal_engine_keys_across_runs_and_workers() {
        let toks = tokens(16, 0);
        let mut idx = BlockIndex::new(BS, 100);
        // A stores the prompt in two events (the second's parent is the first's last
        // block); B stores it in one, with unrelated engine hashes.
        assert_eq!(
            idx.apply(A, &stored(&toks[..8], 100, None)),
            Applied::Stored {
                blocks: 2,
                unknown: 0
            }
        );
        assert_eq!(
            idx.apply(A, &stored(&toks[8..], 102, Some(101))),
            Applied::Stored {
                blocks: 2,
                unknown: 0
            }
        );
        assert_eq!(
            idx.apply(B, &stored(&toks, 900, None)),
            Applied::Stored {
                blocks: 4,
                unknown: 0
            }
        );
        assert_eq!(idx.len(), 4);
        // A request with one partial block more: its 4 full blocks match on both.
        let mut req = toks.clone();
        req.extend([1, 2]);
        let k = keys(&req);
        assert_eq!(k.len(), 4);
        assert_eq!(idx.match_prefix(&k, &[A, B], t0()), [4, 4]);
        // A different block 2 keeps the first two blocks only.
        let mut other = toks.clone();
        other[9] = 12345;
        assert_eq!(idx.match_prefix(&keys(&other), &[A, B], t0()), [2, 2]);
        // Same tokens in another position (different parent) do not match.
        let shifted = [&[9, 9, 9, 9][..], &toks[..]].concat();
        assert_eq!(idx.match_prefix(&keys(&shifted), &[A, B], t0()), [0, 0]);
    }

    #[test]
    fn unknown_parent_is_skipped() {
        let toks = tokens(8, 0);
        let mut idx = BlockIndex::new(BS, 100);
        assert_eq!(
            idx.apply(A, &stored(&toks[4..], 5, Some(4))),
            Applied::Skipped(Skip::UnknownParent)
        );
        assert!(idx.is_empty());
    }

    #[test]
    fn removals_release_blocks_with_reference_counts() {
        let toks = tokens(8, 0);
        let mut idx = BlockIndex::new(BS, 100);
        idx.apply(A, &stored(&toks, 10, None));
        idx.apply(A, &stored(&toks[..4], 10, None)); // block 0 stored twice
        idx.apply(B, &stored(&toks, 20, None));
        assert_eq!(idx.source_blocks(A), 2);
        // First removal of block 0 on A: one copy left.
        assert_eq!(idx.apply(A, &removed(&[10])), Applied::Removed(1));
        assert_eq!(idx.match_prefix(&keys(&toks), &[A, B], t0()), [2, 2]);
        assert_eq!(idx.apply(A, &removed(&[10, 999])), Applied::Removed(1));
        assert_eq!(idx.match_prefix(&keys(&toks), &[A, B], t0()), [0, 2]);
        assert_eq!(idx.source_blocks(A), 1);
        // Removing B's blocks empties the keys.
        idx.apply(B, &removed(&[20, 21]));
        idx.apply(A, &removed(&[11]));
        assert!(idx.is_empty());
        assert_eq!(idx.source_blocks(A), 0);
    }

    #[test]
    fn clearing_a_source_keeps_the_others() {
        let toks = tokens(8, 0);
        let mut idx = BlockIndex::new(BS, 100);
        idx.apply(A, &stored(&toks, 10, None));
        idx.apply(B, &stored(&toks, 20, None));
        assert_eq!(idx.apply(A, &Event::AllCleared), Applied::Cleared);
        assert_eq!(idx.match_prefix(&keys(&toks), &[A, B], t0()), [0, 2]);
        assert_eq!(idx.source_blocks(A), 0);
        // A's chain is gone: a continuation on A has an unknown parent.
        assert_eq!(
            idx.apply(A, &stored(&tokens(4, 3), 12, Some(11))),
            Applied::Skipped(Skip::UnknownParent)
        );
    }

    #[test]
    fn other_groups_and_block_sizes_are_not_indexed() {
        let toks = tokens(8, 0);
        let mut idx = BlockIndex::new(BS, 100);
        let with = |f: &dyn Fn(&mut BlockStored)| {
            let Event::Stored(mut e) = stored(&toks, 1, None) else {
                unreachable!()
            };
            f(&mut e);
            Event::Stored(e)
        };
        let swa = with(&|e| e.kind = Some("sliding_window".into()));
        assert_eq!(idx.apply(A, &swa), Applied::Skipped(Skip::OtherGroup));
        let g1 = with(&|e| e.group_idx = Some(1));
        assert_eq!(idx.apply(A, &g1), Applied::Skipped(Skip::OtherGroup));
        let bs = with(&|e| {
            e.block_size = 2;
            e.block_hashes = (1..5).collect();
        });
        assert_eq!(idx.apply(A, &bs), Applied::Skipped(Skip::BlockSize(2)));
        let nil_medium = with(&|e| {
            e.medium = None;
            e.group_idx = Some(0);
        });
        assert_eq!(idx.apply(A, &nil_medium), stored_n(2));
        let g1_removed = Event::Removed(BlockRemoved {
            block_hashes: vec![1],
            medium: None,
            group_idx: Some(1),
        });
        assert_eq!(
            idx.apply(A, &g1_removed),
            Applied::Skipped(Skip::OtherGroup)
        );
    }

    fn stored_n(blocks: usize) -> Applied {
        Applied::Stored { blocks, unknown: 0 }
    }

    /// vLLM's CPU-offloading connector's form: the GPU blocks' hashes, no tokens, no
    /// parent, block size 0, medium `medium`.
    fn offloaded(medium: &str, hashes: &[u64]) -> Event {
        Event::Stored(BlockStored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: None,
            token_ids: Vec::new(),
            block_size: 0,
            lora: None,
            medium: Some(medium.into()),
            extra_keys: Vec::new(),
            group_idx: None,
            kind: None,
        })
    }

    fn removed_from(medium: &str, hashes: &[u64]) -> Event {
        Event::Removed(BlockRemoved {
            block_hashes: hashes.to_vec(),
            medium: Some(medium.into()),
            group_idx: None,
        })
    }

    /// Blocks of `run` per tier: GPU, CPU, STORAGE (the default tiers).
    fn tiers_of(run: &Run) -> [u64; 3] {
        let t = run.by_tier();
        [t[0], t[1], t[2]]
    }

    #[test]
    fn a_host_copy_outlives_the_gpu_eviction_until_its_own_removal() {
        let toks = tokens(12, 0);
        let k = keys(&toks);
        let mut idx = BlockIndex::new(BS, 100);
        idx.apply(A, &stored(&toks, 10, None));
        // The offloading connector copies blocks 0 and 1 (not 2) to the CPU.
        assert_eq!(idx.apply(A, &offloaded("CPU", &[10, 11])), stored_n(2));
        assert_eq!(&idx.source_tier_blocks(A)[..2], [3, 2]);
        // The GPU evicts all three: blocks 0 and 1 stay held, on the CPU.
        assert_eq!(idx.apply(A, &removed(&[10, 11, 12])), Applied::Removed(3));
        let run = idx.match_runs(&k, &[A], t0()).remove(0);
        assert_eq!((run.blocks, tiers_of(&run)), (2, [0, 2, 0]));
        assert_eq!(idx.source_blocks(A), 2);
        // The GPU's removal of a block it no longer holds changes nothing.
        assert_eq!(idx.apply(A, &removed(&[10])), Applied::Removed(0));
        // The CPU's removal of block 1 ends the run after block 0; of block 0, the
        // holding, and the hash mapping with it.
        assert_eq!(
            idx.apply(A, &removed_from("CPU", &[11])),
            Applied::Removed(1)
        );
        assert_eq!(idx.match_prefix(&k, &[A], t0()), [1]);
        idx.apply(A, &removed_from("CPU", &[10]));
        assert_eq!(idx.match_prefix(&k, &[A], t0()), [0]);
        assert_eq!((idx.source_blocks(A), idx.len()), (0, 0));
        assert_eq!(
            idx.apply(A, &offloaded("CPU", &[10])),
            Applied::Stored {
                blocks: 0,
                unknown: 1
            },
            "a hash no GPU event placed cannot be placed"
        );
    }

    #[test]
    fn a_removal_applies_to_its_own_tier_and_the_heaviest_tier_counts() {
        let toks = tokens(8, 0);
        let k = keys(&toks);
        let mut idx = BlockIndex::new(BS, 100);
        idx.apply(A, &stored(&toks, 10, None));
        idx.apply(A, &offloaded("CPU", &[10, 11]));
        idx.apply(A, &offloaded("STORAGE", &[10]));
        let run = idx.match_runs(&k, &[A], t0()).remove(0);
        assert_eq!(tiers_of(&run), [2, 0, 0], "on the GPU first");
        // The CPU drops both: the GPU still holds them.
        idx.apply(A, &removed_from("CPU", &[10, 11]));
        assert_eq!(idx.match_prefix(&k, &[A], t0()), [2]);
        assert_eq!(&idx.source_tier_blocks(A)[..3], [2, 0, 1]);
        // The GPU drops them: block 0 is still on storage, block 1 nowhere.
        idx.apply(A, &removed(&[10, 11]));
        let run = idx.match_runs(&k, &[A], t0()).remove(0);
        assert_eq!((run.blocks, tiers_of(&run)), (1, [0, 0, 1]));
        assert_eq!(idx.source_blocks(A), 1);
    }

    #[test]
    fn reference_counts_are_per_source_tier_and_block() {
        let toks = tokens(4, 0);
        let k = keys(&toks);
        let mut idx = BlockIndex::new(BS, 100);
        // Rank A0 stores the block twice on the GPU and its connector announces the
        // CPU copy twice (chunks re-announce shared hashes); rank A1 stores it once
        // under its own hash.
        const A1: SourceId = SourceId(3);
        for _ in 0..2 {
            idx.apply(A, &stored(&toks, 10, None));
            idx.apply(A, &offloaded("CPU", &[10]));
        }
        idx.apply(A1, &stored(&toks, 77, None));
        assert_eq!(idx.match_prefix(&k, &[A, A1], t0()), [1, 1]);
        // One GPU removal on A leaves a GPU copy; the second leaves the CPU's.
        idx.apply(A, &removed(&[10]));
        assert_eq!(tiers_of(&idx.match_runs(&k, &[A], t0())[0]), [1, 0, 0]);
        idx.apply(A, &removed(&[10]));
        assert_eq!(tiers_of(&idx.match_runs(&k, &[A], t0())[0]), [0, 1, 0]);
        idx.apply(A, &removed_from("CPU", &[10]));
        assert_eq!(idx.match_prefix(&k, &[A, A1], t0()), [1, 1]);
        idx.apply(A, &removed_from("CPU", &[10]));
        assert_eq!(idx.match_prefix(&k, &[A, A1], t0()), [0, 1]);
        // A's hash means nothing on A1: the removal there is ignored.
        assert_eq!(idx.apply(A1, &removed(&[10])), Applied::Removed(0));
        assert_eq!(
            idx.apply(A1, &removed_from("CPU", &[77])),
            Applied::Removed(0)
        );
        assert_eq!(idx.match_prefix(&k, &[A1], t0()), [1]);
    }

    #[test]
    fn all_blocks_cleared_clears_the_gpu_tier_only() {
        let toks = tokens(8, 0);
        let k = keys(&toks);
        let mut idx = BlockIndex::new(BS, 100);
        idx.apply(A, &stored(&toks, 10, None));
        idx.apply(A, &offloaded("CPU", &[10]));
        assert_eq!(idx.apply(A, &Event::AllCleared), Applied::Cleared);
        let run = idx.match_runs(&k, &[A], t0()).remove(0);
        assert_eq!((run.blocks, tiers_of(&run)), (1, [0, 1, 0]));
        // Block 0's mapping stays (the CPU holds it): its continuation can be placed.
        assert_eq!(idx.apply(A, &stored(&toks[4..], 11, Some(10))), stored_n(1));
        assert_eq!(idx.match_prefix(&k, &[A], t0()), [2]);
        // A restart, a gap: every tier goes.
        idx.clear_source(A);
        assert_eq!((idx.len(), idx.source_blocks(A)), (0, 0));
        assert_eq!(idx.source_tier_blocks(A), [0; MAX_TIERS]);
    }

    #[test]
    fn a_host_event_with_tokens_is_chained_or_else_placed_by_hash() {
        let toks = tokens(12, 0);
        let k = keys(&toks);
        let mut idx = BlockIndex::new(BS, 100);
        idx.apply(A, &stored(&toks[..4], 10, None));
        // Self-describing offload events: tokens, parent, the GPU block size.
        let Event::Stored(mut e) = stored(&toks[4..8], 11, Some(10)) else {
            unreachable!()
        };
        e.medium = Some("CPU".into());
        assert_eq!(idx.apply(A, &Event::Stored(e.clone())), stored_n(1));
        assert_eq!(tiers_of(&idx.match_runs(&k, &[A], t0())[0]), [1, 1, 0]);
        // Its parent unknown: placed by hash where known (block 1), counted otherwise.
        e.parent_block_hash = Some(999);
        e.block_hashes = vec![11];
        assert_eq!(idx.apply(A, &Event::Stored(e.clone())), stored_n(1));
        e.block_hashes = vec![12];
        assert_eq!(
            idx.apply(A, &Event::Stored(e)),
            Applied::Stored {
                blocks: 0,
                unknown: 1
            }
        );
    }

    #[test]
    fn the_bound_counts_blocks_in_every_tier() {
        let mut idx = BlockIndex::new(BS, 4);
        let (p, q, r) = (tokens(8, 0), tokens(8, 1), tokens(8, 2));
        idx.apply(A, &stored(&p, 10, None));
        idx.apply(A, &offloaded("CPU", &[10, 11]));
        // P leaves the GPU; its CPU copies keep its two keys.
        idx.apply(A, &removed(&[10, 11]));
        assert_eq!(idx.len(), 2);
        idx.apply(A, &stored(&q, 20, None));
        assert_eq!((idx.len(), idx.evicted()), (4, 0));
        // R needs two keys: P's, least recently used, go, CPU copies and all.
        idx.apply(A, &stored(&r, 30, None));
        assert_eq!((idx.len(), idx.evicted()), (4, 2));
        assert_eq!(idx.match_prefix(&keys(&p), &[A], t0()), [0]);
        assert_eq!(&idx.source_tier_blocks(A)[..2], [4, 0]);
        assert_eq!(idx.source_blocks(A), 4);
        assert_eq!(
            idx.apply(A, &removed_from("CPU", &[10])),
            Applied::Removed(0)
        );
    }

    #[test]
    fn a_speculative_entry_counts_as_the_gpu_tier() {
        let toks = tokens(8, 0);
        let k = keys(&toks);
        let now = t0();
        let mut idx = BlockIndex::new(BS, 100);
        idx.apply(A, &stored(&toks, 10, None));
        idx.apply(A, &offloaded("CPU", &[10, 11]));
        idx.apply(A, &removed(&[10, 11]));
        idx.speculate(&k[..1], A, now + std::time::Duration::from_secs(2));
        let run = idx.match_runs(&k, &[A], now).remove(0);
        assert_eq!(run.segments, [(0, 1), (1, 1)]);
        // The CPU's removal of block 0 leaves the speculation; block 1 is still there.
        idx.apply(A, &removed_from("CPU", &[10]));
        assert_eq!(idx.match_prefix(&k, &[A], now), [2]);
    }

    #[test]
    fn lora_and_extra_keys_change_the_chain() {
        let toks = tokens(8, 0);
        let mut idx = BlockIndex::new(BS, 100);
        let Event::Stored(mut e) = stored(&toks, 1, None) else {
            unreachable!()
        };
        e.lora = Some("adapter".into());
        idx.apply(A, &Event::Stored(e.clone()));
        e.lora = None;
        e.extra_keys = vec![Some(77), None];
        e.block_hashes = vec![5, 6];
        idx.apply(B, &Event::Stored(e));
        // A plain request matches neither.
        assert_eq!(idx.match_prefix(&keys(&toks), &[A, B], t0()), [0, 0]);
        let lora_keys = chain_keys(root_key(Some("adapter")), &toks, BS, &[]);
        assert_eq!(idx.match_prefix(&lora_keys, &[A, B], t0()), [2, 0]);
    }

    #[test]
    fn bound_evicts_least_recently_used_keys_and_their_engine_hashes() {
        let mut idx = BlockIndex::new(BS, 4);
        let p = tokens(8, 0);
        let q = tokens(8, 1);
        let r = tokens(8, 2);
        idx.apply(A, &stored(&p, 10, None));
        idx.apply(A, &stored(&q, 20, None));
        // Touch p: q becomes the oldest.
        assert_eq!(idx.match_prefix(&keys(&p), &[A], t0()), [2]);
        idx.apply(A, &stored(&r, 30, None));
        assert_eq!(idx.len(), 4);
        assert_eq!(idx.evicted(), 2);
        assert_eq!(idx.match_prefix(&keys(&q), &[A], t0()), [0]);
        assert_eq!(idx.match_prefix(&keys(&p), &[A], t0()), [2]);
        assert_eq!(
            idx.source_blocks(A),
            4,
            "evicted blocks leave the engine map"
        );
        // A removal of an evicted block is ignored.
        assert_eq!(idx.apply(A, &removed(&[20])), Applied::Removed(0));
    }

    #[test]
    fn speculation_expires_and_is_cancelled_by_the_engine() {
        let toks = tokens(8, 0);
        let k = keys(&toks);
        let now = t0();
        let mut idx = BlockIndex::new(BS, 100);
        idx.speculate(&k, A, now + Duration::from_secs(2));
        assert_eq!(idx.match_prefix(&k, &[A, B], now), [2, 0]);
        assert_eq!(
            idx.match_prefix(&k, &[A], now + Duration::from_secs(3)),
            [0]
        );
        // Pruned as walked (the walk stops at the first empty key); the rest go when
        // walked or evicted.
        assert_eq!(idx.len(), 1);
        // Confirmed by a store, then removed: no match (the removal cancels it).
        idx.speculate(&k, A, now + Duration::from_secs(2));
        idx.apply(A, &stored(&toks, 10, None));
        idx.apply(A, &removed(&[10, 11]));
        assert_eq!(idx.match_prefix(&k, &[A], now), [0]);
        // A clear voids the source's speculations.
        idx.speculate(&k, A, now + Duration::from_secs(2));
        idx.apply(A, &stored(&toks[..4], 10, None));
        idx.clear_source(A);
        assert_eq!(idx.match_prefix(&k, &[A], now), [0]);
    }
}

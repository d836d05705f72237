//! Precise mode's block index: memory per block and lookup latency.
//!
//! `cargo bench --bench precise_index [-- BLOCKS]` fills a `BlockIndex` with BLOCKS
//! blocks (default 1,000,000) from `BlockStored` events (64-block prompts of 16-token
//! blocks, each run stored by one of 4 workers, as after distinct prompts), reports the
//! resident memory it added per block, then the same with every block also stored on a
//! second worker (a shared prefix), and the time of a 512-block prefix lookup; then the
//! KV tiers: every block's CPU copy announced as vLLM's offloading connector does (the
//! GPU hashes, no tokens), placed through the engine-hash map, the memory it adds, and
//! the lookup once the GPU has evicted half the prompts. Memory is RSS from
//! `/proc/self/statm` (Linux), so allocator overhead is included.

use std::time::Instant;

use cache_aware_router::precise::events::{BlockRemoved, BlockStored, Event};
use cache_aware_router::precise::index::{BlockIndex, SourceId, chain_keys, root_key};

const BLOCK: usize = 16;
const PROMPT_BLOCKS: usize = 64;

fn rss_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

/// Prompt `p`'s tokens (distinct per prompt).
fn tokens(p: u64) -> Vec<u32> {
    (0..(PROMPT_BLOCKS * BLOCK) as u64)
        .map(|i| ((p * 7919 + i * 31) % 150_000) as u32)
        .collect()
}

fn stored(p: u64, engine: u64, toks: &[u32]) -> Event {
    Event::Stored(BlockStored {
        block_hashes: (0..PROMPT_BLOCKS as u64)
            .map(|i| (engine << 48) ^ (p * PROMPT_BLOCKS as u64 + i))
            .collect(),
        parent_block_hash: None,
        token_ids: toks.to_vec(),
        block_size: BLOCK,
        lora: None,
        medium: Some("GPU".into()),
        extra_keys: Vec::new(),
        group_idx: Some(0),
        kind: Some("full_attention".into()),
    })
}

fn main() {
    let blocks: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    let prompts = (blocks / PROMPT_BLOCKS) as u64;
    let mut index = BlockIndex::new(BLOCK, blocks);
    let before = rss_bytes();
    let start = Instant::now();
    for p in 0..prompts {
        index.apply(SourceId(p % 4), &stored(p, p % 4, &tokens(p)));
    }
    let fill = start.elapsed();
    let after_one = rss_bytes();
    println!(
        "{} blocks from {} events in {:.2} s ({:.2} µs per 64-block event)",
        index.len(),
        prompts,
        fill.as_secs_f64(),
        fill.as_secs_f64() * 1e6 / prompts as f64
    );
    if let (Some(b), Some(a)) = (before, after_one) {
        println!(
            "one holder per block: {:.0} bytes of RSS per block ({:.1} MiB)",
            (a - b) as f64 / index.len() as f64,
            (a - b) as f64 / (1 << 20) as f64
        );
    }
    for p in 0..prompts {
        index.apply(SourceId(p % 4 + 1), &stored(p, p % 4 + 8, &tokens(p)));
    }
    if let (Some(b), Some(a)) = (before, rss_bytes()) {
        println!(
            "two holders per block: {:.0} bytes of RSS per block",
            (a - b) as f64 / index.len() as f64
        );
    }
    let sources: Vec<SourceId> = (0..8).map(SourceId).collect();
    let mut times = Vec::new();
    let now = Instant::now();
    for p in 0..2_000u64 {
        // 8 prompts of 64 blocks back to back: a 512-block request (8,192 tokens).
        let toks: Vec<u32> = (0..8).flat_map(|k| tokens((p * 8 + k) % prompts)).collect();
        let t = Instant::now();
        let keys = chain_keys(root_key(None), &toks, BLOCK, &[]);
        let m = index.match_prefix(&keys, &sources, now);
        times.push(t.elapsed());
        std::hint::black_box(m);
    }
    times.sort();
    let pct = |q: f64| times[((times.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e6;
    println!(
        "8,192-token request, keys + lookup over 8 workers: p50 {:.1} µs, p99 {:.1} µs",
        pct(0.5),
        pct(0.99)
    );
    tiers(&mut index, prompts, &sources);
}

/// The connector's copies of prompt `p`'s blocks on `engine`: its GPU hashes, no tokens.
fn offloaded(p: u64, engine: u64, medium: &str) -> Event {
    let Event::Stored(mut e) = stored(p, engine, &[]) else {
        unreachable!()
    };
    e.token_ids = Vec::new();
    e.block_size = 0;
    e.medium = Some(medium.into());
    Event::Stored(e)
}

/// Every block copied to the CPU of its first holder; then half the prompts leave the
/// GPU (their CPU copies stay) and a lookup walks both tiers.
fn tiers(index: &mut BlockIndex, prompts: u64, sources: &[SourceId]) {
    let before = rss_bytes();
    let start = Instant::now();
    for p in 0..prompts {
        index.apply(SourceId(p % 4), &offloaded(p, p % 4, "CPU"));
    }
    let fill = start.elapsed();
    println!(
        "CPU copies (no tokens, placed by hash): {:.2} µs per 64-block event",
        fill.as_secs_f64() * 1e6 / prompts as f64
    );
    if let (Some(b), Some(a)) = (before, rss_bytes()) {
        println!(
            "a CPU copy of every block: {:.0} more bytes of RSS per block",
            (a - b) as f64 / index.len() as f64
        );
    }
    for p in (0..prompts).step_by(2) {
        let Event::Stored(e) = stored(p, p % 4, &[]) else {
            unreachable!()
        };
        let gone = Event::Removed(BlockRemoved {
            block_hashes: e.block_hashes,
            medium: Some("GPU".into()),
            group_idx: None,
        });
        index.apply(SourceId(p % 4), &gone);
    }
    let mut times = Vec::new();
    let now = Instant::now();
    for p in 0..2_000u64 {
        let toks: Vec<u32> = (0..8).flat_map(|k| tokens((p * 8 + k) % prompts)).collect();
        let t = Instant::now();
        let keys = chain_keys(root_key(None), &toks, BLOCK, &[]);
        let m = index.match_runs(&keys, sources, now);
        times.push(t.elapsed());
        std::hint::black_box(m);
    }
    times.sort();
    let pct = |q: f64| times[((times.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e6;
    println!(
        "the same, half the prompts on the CPU only, runs by tier: p50 {:.1} µs, p99 {:.1} µs",
        pct(0.5),
        pct(0.99)
    );
}

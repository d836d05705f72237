//! Decision latency: extract + prefix match + insert for 32 KiB chat prompts against a
//! tree of ~1M nodes. Reports p50/p99/max per decision in µs (a bench binary rather than
//! criterion because the target is a tail percentile, which criterion does not report).
//!
//! Run: `cargo bench --bench decision` (add `-- --nodes 200000` for a quicker run).

use std::time::{Duration, Instant};

use cache_aware_router::config::CacheConfig;
use cache_aware_router::policy::{CacheParams, Candidate, pick_cache_aware};
use cache_aware_router::prompt::{Endpoint, extract};
use cache_aware_router::tree::{RadixTree, WorkerId};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const WORDS: &[&str] = &[
    "the",
    "model",
    "cache",
    "prefix",
    "token",
    "block",
    "worker",
    "request",
    "stream",
    "decode",
    "prefill",
    "replica",
    "router",
    "latency",
    "memory",
    "context",
    "user",
    "assistant",
    "system",
    "answer",
    "question",
    "document",
    "summary",
    "code",
    "data",
    "table",
    "value",
    "field",
    "error",
    "result",
    "first",
    "second",
];

fn words(rng: &mut StdRng, bytes: usize) -> String {
    let mut s = String::with_capacity(bytes + 16);
    while s.len() < bytes {
        s.push(' ');
        s.push_str(WORDS[rng.random_range(0..WORDS.len())]);
    }
    s
}

fn chat_body(system: &str, user: &str) -> Vec<u8> {
    serde_json::json!({
        "model": "m",
        "stream": true,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
        ]
    })
    .to_string()
    .into_bytes()
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

fn report(name: &str, mut samples: Vec<Duration>) {
    samples.sort();
    println!(
        "{name:<34} n={:<6} p50={:>7.1} µs  p99={:>7.1} µs  max={:>8.1} µs",
        samples.len(),
        percentile(&samples, 0.50),
        percentile(&samples, 0.99),
        percentile(&samples, 1.0),
    );
}

fn main() {
    let mut nodes_target = 1_000_000usize;
    let mut decisions = 4000usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--nodes" => {
                nodes_target = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(nodes_target)
            }
            "--decisions" => {
                decisions = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(decisions)
            }
            _ => {} // cargo bench passes --bench
        }
    }
    let mut rng = StdRng::seed_from_u64(42);
    let workers = 4u32;
    let cache = CacheConfig {
        threshold: 0.3,
        match_abs_threshold: 8192,
        balance_abs_threshold: 2,
        balance_rel_threshold: 1.5,
        max_prompt_bytes: 32 * 1024,
        max_tree_size: usize::MAX,
        eviction_interval: None,
        daily_cleanup_hour_utc: None,
    };
    let params = CacheParams::from(&cache);

    // 1. Fill the tree: 200 shared system prompts (2 KiB), conversations branching off
    //    them, each insert adding a split and a leaf.
    let systems: Vec<String> = (0..200).map(|_| words(&mut rng, 2048)).collect();
    let mut tree = RadixTree::new();
    let fill = Instant::now();
    let mut i = 0u64;
    while tree.node_count() < nodes_target {
        let sys = &systems[rng.random_range(0..systems.len())];
        let text = format!(
            "system: {sys}\nuser: conversation {i}{}",
            words(&mut rng, 120)
        );
        tree.insert(text.as_bytes(), WorkerId((i % workers as u64) as u32));
        i += 1;
    }
    println!(
        "tree: {} nodes, {:.1} MiB of edges, from {} prompts in {:.1} s",
        tree.node_count(),
        tree.total_bytes() as f64 / (1 << 20) as f64,
        i,
        fill.elapsed().as_secs_f64()
    );

    // 2. Requests: 32 KiB prompts; half repeat an earlier request (hits), half are new.
    let mut bodies: Vec<Vec<u8>> = Vec::with_capacity(decisions);
    for n in 0..decisions {
        if n > 0 && rng.random_bool(0.5) {
            let j = rng.random_range(0..n);
            bodies.push(bodies[j].clone());
        } else {
            let sys = &systems[rng.random_range(0..systems.len())];
            bodies.push(chat_body(sys, &words(&mut rng, 30 * 1024)));
        }
    }
    let candidates: Vec<Candidate> = (0..workers)
        .map(|w| Candidate {
            id: WorkerId(w),
            load: 0,
            usable: true,
            cache_aware: true,
        })
        .collect();

    let mut extract_t = Vec::with_capacity(decisions);
    let mut pick_t = Vec::with_capacity(decisions);
    let mut total_t = Vec::with_capacity(decisions);
    let mut hits = 0;
    let mut pick_rng = StdRng::seed_from_u64(7);
    for body in &bodies {
        let t0 = Instant::now();
        let ctx = extract(Endpoint::ChatCompletions, body, cache.max_prompt_bytes);
        let t1 = Instant::now();
        let pick = pick_cache_aware(
            &params,
            &ctx.text,
            &candidates,
            &mut tree,
            true,
            &mut pick_rng,
        );
        let t2 = Instant::now();
        std::hint::black_box(&pick);
        if pick.reason == cache_aware_router::policy::Reason::CacheHit {
            hits += 1;
        }
        extract_t.push(t1 - t0);
        pick_t.push(t2 - t1);
        total_t.push(t2 - t0);
    }
    println!(
        "{} decisions on {} KiB chat bodies ({} cache hits), tree now {} nodes",
        decisions,
        bodies[0].len() / 1024,
        hits,
        tree.node_count()
    );
    report("extract (JSON -> routing text)", extract_t);
    report("match + insert (tree)", pick_t);
    report("decision (extract + match + insert)", total_t);
}

//! Decision latency through the policy seam: extract + `Policy::pick` +
//! `Policy::observe(Served)` (for `cache_aware`: prefix match + insert) for 32 KiB chat
//! prompts, `cache_aware` against a tree of ~1M nodes, then every other policy. Reports
//! p50/p99/max per decision in µs (a bench binary rather than criterion because the
//! target is a tail percentile, which criterion does not report).
//!
//! Run: `cargo bench --bench decision` (add `-- --nodes 200000` for a quicker run).

use std::time::{Duration, Instant};

use cache_aware_router::config::Config;
use cache_aware_router::policy::{self, Candidate, Outcome, RouteRequest};
use cache_aware_router::pool::{Pool, WorkerId};
use cache_aware_router::prompt::{Endpoint, extract};
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
    let config = |policy: &str| {
        let yaml = format!(
            "policy: {policy}\ncache:\n  max_tree_size: 4000000000\n  eviction_interval_secs: 0\nworkers:\n{}",
            (0..workers)
                .map(|w| format!("  - url: http://10.0.0.{w}:8000\n"))
                .collect::<String>()
        );
        Config::from_sources([(std::path::Path::new("bench.yaml"), yaml.as_str())]).expect("config")
    };

    // 1. Fill cache_aware's tree: 200 shared system prompts (2 KiB), conversations
    //    branching off them, each insert adding a split and a leaf.
    let cfg = config("cache_aware");
    let pool = Pool::new(&cfg.workers, &cfg.circuit_breaker);
    let cache_aware = policy::build(&cfg, &pool);
    let systems: Vec<String> = (0..200).map(|_| words(&mut rng, 2048)).collect();
    let fill = Instant::now();
    let mut i = 0u64;
    {
        let mut tree = cache_aware.tree().expect("cache_aware keeps a tree").lock();
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
    }

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

    // cost_aware walks the same tree (a copy: its own).
    let cost_cfg = config("cost_aware");
    let cost_pool = Pool::new(&cost_cfg.workers, &cost_cfg.circuit_breaker);
    let cost_aware = policy::build(&cost_cfg, &cost_pool);
    *cost_aware.tree().expect("cost_aware keeps a tree").lock() =
        cache_aware.tree().expect("tree").lock().clone();

    // 3. Every policy through the seam, as the proxy calls it.
    for name in [
        "cache_aware",
        "cost_aware",
        "round_robin",
        "random",
        "least_load",
        "power_of_two",
        "consistent_hash",
    ] {
        let (pool, policy) = if name == "cache_aware" {
            (pool.set(), std::sync::Arc::clone(&cache_aware))
        } else if name == "cost_aware" {
            (cost_pool.set(), std::sync::Arc::clone(&cost_aware))
        } else {
            let cfg = config(name);
            let p = Pool::new(&cfg.workers, &cfg.circuit_breaker);
            let policy = policy::build(&cfg, &p);
            (p.set(), policy)
        };
        let set = pool;
        let mut extract_t = Vec::with_capacity(decisions);
        let mut pick_t = Vec::with_capacity(decisions);
        let mut total_t = Vec::with_capacity(decisions);
        let mut hits = 0;
        let mut pick_rng = StdRng::seed_from_u64(7);
        for body in &bodies {
            let t0 = Instant::now();
            let ctx = extract(Endpoint::ChatCompletions, body, cfg.cache.max_prompt_bytes);
            let t1 = Instant::now();
            let req = RouteRequest {
                ctx: Some(&ctx),
                tie: Some(ctx.digest),
                ..Default::default()
            };
            let candidates: Vec<Candidate> = set
                .workers()
                .iter()
                .map(|w| Candidate {
                    id: w.id(),
                    load: w.load(),
                    usable: true,
                    cache_aware: true,
                })
                .collect();
            let pick = policy.pick(&req, &set, &candidates, &mut pick_rng);
            if let Some(w) = pick.worker.and_then(|id| set.get(id)) {
                policy.observe(&req, &pick, w, Outcome::Served);
            }
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
            "\n{name}: {} decisions on {} KiB chat bodies ({} cache hits)",
            decisions,
            bodies[0].len() / 1024,
            hits,
        );
        if name == "cache_aware" {
            report("extract (JSON -> routing text)", extract_t);
        }
        report("pick + observe", pick_t);
        report("decision (extract + pick + observe)", total_t);
    }
}

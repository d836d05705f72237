//! Per-stage benches of a request's decision (criterion: medians with confidence
//! intervals, to compare two builds on a noisy machine; the `decision` and `pool_scale`
//! benches report the tail instead):
//!
//! - `extract/chat_{2,32}KiB`: a chat body to routing text, chunk hashes and digest
//!   (`prompt::extract`).
//! - `tree/longest_prefix_32KiB`: a held 32 KiB prompt's match in a tree of 1 M nodes
//!   (read only), and `tree/insert_held_32KiB`: recording it again (the observe of a
//!   cache hit: the path is re-stamped, nothing is allocated).
//! - `pick_slot/{4,1000}_workers`: the proxy's pick for a held 2 KiB prompt
//!   (`policy::decide::pick_slot`: the candidate list, the `cache_aware` pick, the in-flight slot)
//!   and its observe, extraction excluded: what a request pays per worker in the pool;
//!   `…_miss`: the pick alone for a prompt no worker holds (it goes to the least loaded).
//!
//! - `usage/chat_answer_{100,8000}B`: reading `usage` from a non-streamed chat answer
//!   whose generated text is ~100 bytes or ~8 KB (about 2,000 tokens), as the proxy
//!   does once the answer has passed (`proxy::usage::UsageScanner`, one chunk).
//!
//! Run: `cargo bench --bench stages` (a filter narrows it: `-- pick_slot`).

use std::time::Duration;

use cache_aware_router::config::Config;
use cache_aware_router::policy::decide::pick_slot;
use cache_aware_router::policy::{self, Outcome, RouteRequest};
use cache_aware_router::pools::pool::{Pool, WorkerId};
use cache_aware_router::prompt::{Endpoint, RouteContext, extract};
use cache_aware_router::tree::{RadixTree, WorkerMask};
use criterion::{Criterion, criterion_group, criterion_main};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

mod common;
use common::{chat_body, words};

const MAX_PROMPT_BYTES: usize = 32 * 1024;

fn extraction(c: &mut Criterion) {
    let mut rng = StdRng::seed_from_u64(1);
    let mut g = c.benchmark_group("extract");
    for kib in [2, 32] {
        let body = chat_body(&words(&mut rng, 2048), &words(&mut rng, (kib - 2) << 10));
        g.bench_function(format!("chat_{kib}KiB"), |b| {
            b.iter(|| extract(Endpoint::ChatCompletions, &body, MAX_PROMPT_BYTES))
        });
    }
    g.finish();
}

fn tree(c: &mut Criterion) {
    let mut rng = StdRng::seed_from_u64(2);
    // 200 shared system prompts, conversations branching off them (as `pool_scale`).
    let systems: Vec<String> = (0..200).map(|_| words(&mut rng, 2048)).collect();
    let mut t = RadixTree::new();
    let mut i = 0u64;
    while t.node_count() < 1_000_000 {
        let sys = &systems[rng.random_range(0..systems.len())];
        let text = format!(
            "system: {sys}\nuser: conversation {i}{}",
            words(&mut rng, 120)
        );
        t.insert(text.as_bytes(), WorkerId((i % 4) as u32));
        i += 1;
    }
    let held = format!(
        "system: {}\nuser: {}",
        systems[7],
        words(&mut rng, 30 << 10)
    );
    t.insert(held.as_bytes(), WorkerId(1));
    let all: WorkerMask = (0..4).map(WorkerId).collect();
    let mut g = c.benchmark_group("tree");
    g.bench_function("longest_prefix_32KiB", |b| {
        b.iter(|| t.longest_prefix(held.as_bytes(), &all))
    });
    g.bench_function("insert_held_32KiB", |b| {
        b.iter(|| t.insert(held.as_bytes(), WorkerId(1)))
    });
    g.finish();
}

fn picks(c: &mut Criterion) {
    let mut g = c.benchmark_group("pick_slot");
    for workers in [4usize, 1000] {
        let yaml = format!(
            "policy: cache_aware\nhealth:\n  interval_secs: 3600\nworkers:\n{}",
            (0..workers)
                .map(|w| format!("  - http://127.0.{}.{}:9\n", 1 + w / 250, 1 + w % 250))
                .collect::<String>()
        );
        let cfg = Config::from_sources([(std::path::Path::new("bench.yaml"), yaml.as_str())])
            .expect("config");
        let pool = std::sync::Arc::new(Pool::new(&cfg.workers, &cfg.circuit_breaker));
        let policy = policy::build(&cfg, &pool).policy;
        let set = pool.set();
        let mut rng = StdRng::seed_from_u64(3);
        let (held, fresh) = (prompts(&mut rng), prompts(&mut rng));
        let (held, fresh) = (contexts(&held), contexts(&fresh));
        // One pick through the proxy's path; observed (served) or not.
        let decide = |ctx: &RouteContext<'_>, rng: &mut StdRng, observe: bool| {
            let req = RouteRequest {
                ctx: Some(ctx),
                tie: Some(ctx.digest),
                chain: ctx.chain.clone().into(),
                ..Default::default()
            };
            let (pick, guard) = pick_slot(&*policy, &set, &req, &WorkerMask::default(), rng)
                .expect("a usable worker");
            if observe {
                policy.observe(&req, &pick, guard.worker(), Outcome::Served);
            }
            pick
        };
        // Each prompt served once: the timed picks are cache hits.
        for ctx in &held {
            decide(ctx, &mut rng, true);
        }
        let mut n = 0;
        g.bench_function(format!("{workers}_workers"), |b| {
            b.iter(|| {
                n += 1;
                decide(&held[n % held.len()], &mut rng, true)
            })
        });
        // Prompts the tree does not hold, picked but never observed: every pick a miss,
        // which goes to the least loaded (here a tie among all the idle workers).
        g.bench_function(format!("{workers}_workers_miss"), |b| {
            b.iter(|| {
                n += 1;
                decide(&fresh[n % fresh.len()], &mut rng, false)
            })
        });
    }
    g.finish();
}

/// 64 chat bodies of ~2 KiB, each its own prompt.
fn prompts(rng: &mut StdRng) -> Vec<Vec<u8>> {
    (0..64)
        .map(|_| chat_body(&words(rng, 1024), &words(rng, 1024)))
        .collect()
}

fn contexts(bodies: &[Vec<u8>]) -> Vec<RouteContext<'_>> {
    bodies
        .iter()
        .map(|b| extract(Endpoint::ChatCompletions, b, MAX_PROMPT_BYTES))
        .collect()
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(30)
}

/// A vLLM-shaped chat answer with `content_bytes` of generated text.
fn chat_answer(rng: &mut StdRng, content_bytes: usize) -> bytes::Bytes {
    let content = serde_json::to_string(&words(rng, content_bytes)).expect("a string");
    format!(
        r#"{{"id":"chatcmpl-8f3a","object":"chat.completion","created":1733500000,"model":"m","choices":[{{"index":0,"message":{{"role":"assistant","content":{content},"tool_calls":[]}},"logprobs":null,"finish_reason":"stop","stop_reason":null}}],"usage":{{"prompt_tokens":512,"total_tokens":530,"completion_tokens":18,"prompt_tokens_details":{{"cached_tokens":496}}}},"prompt_logprobs":null,"kv_transfer_params":null}}"#
    )
    .into()
}

fn usage(c: &mut Criterion) {
    use cache_aware_router::proxy::usage::UsageScanner;
    let mut headers = http::HeaderMap::new();
    headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    let mut rng = StdRng::seed_from_u64(4);
    let mut g = c.benchmark_group("usage");
    for content in [100usize, 8000] {
        let answer = chat_answer(&mut rng, content);
        g.bench_function(format!("chat_answer_{content}B"), |b| {
            b.iter(|| {
                let mut s = UsageScanner::for_response(&headers, false).expect("JSON");
                s.feed_bytes(&answer);
                s.finish().expect("usage")
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = stages;
    config = config();
    targets = extraction, tree, picks, usage
}
criterion_main!(stages);

//! The router in front of sim-engines whose KV caches are too small for the traffic it
//! sends them: the engine reports fewer cached tokens than the router predicted, the
//! router counts the shortfalls and, the worker's records not borne out and a second
//! short answer confirming the first, ages out its records older than the prefix the
//! engine lost.

use std::time::Duration;

use crate::support::{client, send_to, start_router};
use bench::engine::{self, EngineConfig, RunningEngine};
use hyper::Method;
use serde_json::{Value, json};

async fn tiny_engine(name: &str) -> RunningEngine {
    let cfg = EngineConfig {
        name: name.into(),
        // 60 blocks of 16 tokens: the system prompt and about two questions.
        kv_blocks: 60,
        block_size: 16,
        max_output_tokens: 2,
        time_factor: 0.001,
        ..EngineConfig::default()
    };
    engine::start(cfg).await.expect("engine starts")
}

fn words(seed: usize, n: usize) -> String {
    (0..n)
        .map(|i| {
            engine::token_word(((seed * 7919 + i * 31) % 200) as u64)
                .unwrap_or_else(|| "word".into())
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_evicted_delivers_less_than_predicted_and_is_learned_from() {
    let engines = [tiny_engine("e0").await, tiny_engine("e1").await];
    let yaml = format!(
        "log: {{level: warn}}\ncache:\n  balance_abs_threshold: 0\n  balance_rel_threshold: 1.0\n  learn_evictions: true\nworkers:\n  - url: {}\n  - url: {}\n",
        engines[0].url(),
        engines[1].url()
    );
    let (_router, base) = start_router(&yaml).await;
    let c = client();
    let system = words(1, 400);
    let ask = |q: usize| {
        json!({
            "model": "m",
            "max_tokens": 2,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": words(100 + q, 200)},
            ],
        })
        .to_string()
    };
    let mut on = Vec::new();
    // 60 blocks hold the system prompt (25) and two questions' own parts (13 each):
    // eight questions, then four of the early ones again, each gone by then.
    for q in [1, 2, 3, 4, 5, 6, 7, 8, 3, 4, 5, 6] {
        let r = send_to(&c, &base, Method::POST, "/v1/chat/completions", &ask(q)).await;
        assert_eq!(r.status, 200, "{}", r.text());
        on.push(r.engine.clone());
    }
    // Every question shares the system prompt: all on the first one's engine.
    assert!(on.iter().all(|e| *e == on[0]), "{on:?}");
    let workers: Value = send_to(&c, &base, Method::GET, "/workers", "").await.json();
    let w = workers["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["hits"]["answers"].as_u64().unwrap_or(0) > 0)
        .expect("the worker that answered")
        .clone();
    let h = &w["hits"];
    let (predicted, delivered) = (
        h["predicted_tokens"].as_u64().unwrap(),
        h["delivered_tokens"].as_u64().unwrap(),
    );
    // The repeats were predicted whole (the tree still held them) and the engine had
    // kept only the system prompt of them.
    assert!(predicted > delivered, "{h}");
    assert!(h["shortfalls"].as_u64().unwrap() >= 2, "{h}");
    // From the worker's tenth answer with a prediction (question 5's repeat) its records
    // are measurably not borne out, and question 6's short answer confirms question 5's:
    // what was last used before question 5 was first asked (questions 1 and 2) goes, in
    // a sweep off the request path, within a second.
    let mut aged = 0.0;
    for _ in 0..200 {
        let m = send_to(&c, &base, Method::GET, "/metrics", "").await.text();
        aged = m
            .lines()
            .find_map(|l| l.strip_prefix("cache_aware_router_tree_aged_out_bytes_total "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0);
        if aged > 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(aged > 0.0, "nothing aged out: {h}");
    // What the worker kept is its learned capacity; new questions grow its records
    // past it, and the next sweeps cut its least recently used ones back.
    let holder = |v: &Value| {
        v["workers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["hits"]["answers"].as_u64().unwrap_or(0) > 0)
            .unwrap()
            .clone()
    };
    let held = |v: &Value| {
        (holder(v)["tree_share"].as_f64().unwrap() * v["tree_bytes"].as_f64().unwrap()) as u64
    };
    let v: Value = send_to(&c, &base, Method::GET, "/workers", "").await.json();
    let cap = holder(&v)["tree_capacity_bytes"]
        .as_u64()
        .expect("a learned capacity");
    for q in 20..26 {
        let r = send_to(&c, &base, Method::POST, "/v1/chat/completions", &ask(q)).await;
        assert_eq!(r.status, 200);
    }
    let grown = held(&send_to(&c, &base, Method::GET, "/workers", "").await.json());
    assert!(grown > cap + cap / 8, "{grown} of {cap}");
    let mut now = grown;
    for _ in 0..300 {
        now = held(&send_to(&c, &base, Method::GET, "/workers", "").await.json());
        if now <= cap + cap / 8 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(now <= cap + cap / 8, "still {now} of {cap}");
}

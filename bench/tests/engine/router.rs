//! The router in front of sim-engines, as the router's own tests cannot run them (the
//! router does not depend on this crate): the prefill rate it learns per worker from
//! their answers, their engine metrics read in both flavors, and the semantic response
//! cache on their embeddings.

use std::time::Duration;

use bench::engine::{self, EngineConfig, MetricsFlavor};
use hyper::Method;
use serde_json::{Value, json};

use crate::support::{HttpClient, client, send_to, start_router, wait_until};

/// YAML: `extra` followed by a `workers:` list of `urls`.
fn yaml_for(urls: &[String], extra: &str) -> String {
    let mut y = format!("{extra}\nworkers:\n");
    for u in urls {
        y.push_str(&format!("  - url: \"{u}\"\n"));
    }
    y
}

async fn workers(c: &HttpClient, base: &str) -> Value {
    let r = send_to(c, base, Method::GET, "/workers", "").await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_rate_is_learned_per_worker_from_real_engines() {
    // Two simulated vLLM engines, the second three times slower at prefill.
    let fast = engine::start(EngineConfig {
        name: "fast".into(),
        time_factor: 0.4,
        ..EngineConfig::default()
    })
    .await
    .unwrap();
    let slow = engine::start(EngineConfig {
        name: "slow".into(),
        time_factor: 0.4,
        prefill_per_token: Duration::from_micros(240),
        ..EngineConfig::default()
    })
    .await
    .unwrap();
    let (router, base) = start_router(&yaml_for(
        &[fast.url(), slow.url()],
        "policy: round_robin\nhealth: {interval_secs: 60}",
    ))
    .await;
    let c = client();
    for i in 0..40 {
        // Distinct prompts of 500 to 3,000 words (one word = one token there).
        let words = 500 + (i * 617) % 2500;
        let prompt: String = (0..words).map(|w| format!("w{i}x{w} ")).collect();
        let body = json!({
            "model": "m", "stream": true, "max_tokens": 1,
            "stream_options": {"include_usage": true},
            "messages": [{"role": "user", "content": prompt}],
        })
        .to_string();
        let r = send_to(&c, &base, Method::POST, "/v1/chat/completions", &body).await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let w = workers(&c, &base).await;
    let rate = |i: usize| {
        w["workers"][i]["prefill"]["tokens_per_second"]
            .as_f64()
            .unwrap()
    };
    for i in 0..2 {
        assert!(
            w["workers"][i]["prefill"]["samples"].as_u64().unwrap() >= 8,
            "{w}"
        );
    }
    let ratio = rate(0) / rate(1);
    assert!(
        (2.2..=3.8).contains(&ratio),
        "fast {} / slow {} = {ratio}",
        rate(0),
        rate(1)
    );
    // 1 / (80 µs × 0.4) = 31,250 tokens/s on the fast one, within noise.
    assert!((20_000.0..=45_000.0).contains(&rate(0)), "{}", rate(0));
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_simulated_engines_metrics_are_read_in_both_flavors() {
    let vllm = engine::start(EngineConfig {
        name: "v".into(),
        time_factor: 0.0,
        ..EngineConfig::default()
    })
    .await
    .unwrap();
    let sglang = engine::start(EngineConfig {
        name: "s".into(),
        time_factor: 0.0,
        metrics_flavor: MetricsFlavor::Sglang,
        ..EngineConfig::default()
    })
    .await
    .unwrap();
    let (router, base) = start_router(&yaml_for(
        &[vllm.url(), sglang.url()],
        "policy: cost_aware\nengine_metrics: {interval_ms: 50}\nhealth: {interval_secs: 60}",
    ))
    .await;
    let c = client();
    let (c, base) = (&c, base.as_str());
    wait_until("both engines read", || async move {
        let w = workers(c, base).await;
        w["workers"][0]["engine"]["kind"] == "vllm" && w["workers"][1]["engine"]["kind"] == "sglang"
    })
    .await;
    let w = workers(c, base).await;
    for i in 0..2 {
        let e = &w["workers"][i]["engine"];
        assert_eq!(e["waiting"], 0.0, "{e}");
        assert_eq!(e["fresh"], true, "{e}");
        assert!(e["kv_cache_usage"].as_f64().is_some(), "{e}");
    }
    router.shutdown().await;
}

/// The semantic response cache with a sim-engine as its embeddings endpoint and its
/// worker: the same question with a question mark more is a hit, another question a
/// miss. (The cache's rules are tested in the router's tests/state/response_cache.rs.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paraphrase_is_a_semantic_hit_on_a_sim_engines_embeddings() {
    let e = engine::start(EngineConfig {
        name: "e".into(),
        time_factor: 0.0,
        ..EngineConfig::default()
    })
    .await
    .unwrap();
    let extra = format!(
        "response_cache:\n  enabled: true\n  semantic:\n    embeddings_url: {}/v1/embeddings\n    model: embed\n    threshold: 0.92",
        e.url()
    );
    let (router, base) = start_router(&yaml_for(&[e.url()], &extra)).await;
    let c = client();
    let (c, base) = (&c, base.as_str());
    let chat = |q: &str| {
        let body =
            json!({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": q}]});
        async move {
            send_to(
                c,
                base,
                Method::POST,
                "/v1/chat/completions",
                &body.to_string(),
            )
            .await
        }
    };
    let q = "please tell me what the capital city of france is and why it became the capital";
    let first = chat(q).await;
    assert_eq!(
        (first.status.as_u16(), first.cache.as_str()),
        (200, "miss"),
        "{}",
        first.text()
    );
    // The answer is stored by a task of its own once its body ended.
    wait_until("the first answer stored", || async move {
        let m = send_to(c, base, Method::GET, "/metrics", "").await.text();
        sample(
            &m,
            "cache_aware_router_response_cache_stores_total{result=\"stored\"}",
        ) >= 1.0
    })
    .await;
    let near = chat(&format!("{q}?")).await;
    assert_eq!(near.cache, "hit", "{}", near.text());
    assert_eq!(near.body, first.body, "replayed");
    let far =
        chat("write a python function that returns the fibonacci numbers below one thousand").await;
    assert_eq!(far.cache, "miss", "{}", far.text());
    assert!(e.engine().stats().embedding_requests >= 3);
    router.shutdown().await;
}

/// The value of the series `series` (name and labels as exposed) in a `/metrics` page;
/// 0 when absent.
fn sample(page: &str, series: &str) -> f64 {
    page.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

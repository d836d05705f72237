//! `cache_salt`: the engine never shares a block across salts (vLLM folds the salt into
//! the first block's hash), and the router's `tenants.isolate_cache` gives each tenant
//! its own salt, so tenants never hit each other's prefix cache.

use bench::engine::{self, EngineConfig, RunningEngine};
use hyper::{Method, StatusCode};
use serde_json::json;

use crate::support::{client, send, send_with, start_router};

async fn engine() -> RunningEngine {
    engine::start(EngineConfig {
        name: "salted".into(),
        time_factor: 0.0,
        ..EngineConfig::default()
    })
    .await
    .expect("engine starts")
}

fn chat(salt: Option<&str>) -> String {
    let prompt: String = (0..300).map(|i| format!(" w{i}")).collect();
    let mut body = json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 2});
    if let Some(s) = salt {
        body["cache_salt"] = json!(s);
    }
    body.to_string()
}

fn cached(r: &crate::support::Reply) -> u64 {
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

#[tokio::test]
async fn a_prompt_never_hits_the_cache_across_salts() {
    let e = engine().await;
    let c = client();
    let ask = |salt| {
        let (c, e, body) = (&c, &e, chat(salt));
        async move { send(c, e, Method::POST, "/v1/chat/completions", &body).await }
    };
    assert_eq!(cached(&ask(Some("a")).await), 0);
    assert_eq!(cached(&ask(Some("b")).await), 0, "salt a's blocks");
    assert_eq!(cached(&ask(None).await), 0, "unsalted: none of them");
    assert!(cached(&ask(Some("a")).await) >= 288);
    assert!(cached(&ask(None).await) >= 288);
    let r = send(
        &c,
        &e,
        Method::POST,
        "/v1/chat/completions",
        r#"{"messages": [{"role": "user", "content": "x"}], "cache_salt": 5}"#,
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn isolated_tenants_never_share_the_engines_prefix_cache_and_one_tenant_does() {
    let e = engine().await;
    let yaml = format!(
        "workers: [\"{}\"]\ntenants:\n  isolate_cache: true\n  secret: test-secret\n  list: {{red: {{}}, blue: {{}}}}\n",
        e.url()
    );
    let (_router, base) = start_router(&yaml).await;
    let c = client();
    let body = chat(None);
    let mut seen = Vec::new();
    for tenant in ["red", "red", "blue", "blue"] {
        let r = send_with(
            &c,
            &base,
            Method::POST,
            "/v1/chat/completions",
            &body,
            &[("x-tenant-id", tenant)],
        )
        .await;
        seen.push(cached(&r));
    }
    assert_eq!(seen[0], 0);
    assert!(seen[1] >= 288, "red's own prompt: {seen:?}");
    assert_eq!(seen[2], 0, "blue never reads red's blocks: {seen:?}");
    assert!(seen[3] >= 288, "blue's own prompt: {seen:?}");
}

//! Engines serving several models: what `/v1/models` lists, vLLM's 404 for a model not
//! served, prompts that never hit the cache across models, and the router in front of
//! engines serving different models sending each request only where its model is.

use bench::engine::{self, EngineConfig, RunningEngine};
use hyper::{Method, StatusCode};
use serde_json::{Value, json};

use crate::support::{client, send, send_to, start_router, wait_until};

async fn serving(name: &str, models: &[&str]) -> RunningEngine {
    engine::start(EngineConfig {
        name: name.into(),
        model: models[0].into(),
        extra_models: models[1..].iter().map(|m| m.to_string()).collect(),
        time_factor: 0.0,
        ..EngineConfig::default()
    })
    .await
    .expect("engine starts")
}

fn chat(model: Option<&str>, prompt: &str) -> String {
    let mut body = json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 2});
    if let Some(m) = model {
        body["model"] = json!(m);
    }
    body.to_string()
}

fn long_prompt() -> String {
    (0..300).map(|i| format!(" w{i}")).collect()
}

#[tokio::test]
async fn an_engine_lists_its_models_and_refuses_others_like_vllm() {
    let e = serving("two", &["model-a", "model-b"]).await;
    let c = client();
    let list = send(&c, &e, Method::GET, "/v1/models", "").await.json();
    let ids: Vec<(&str, &str)> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["id"].as_str().unwrap(), m["root"].as_str().unwrap()))
        .collect();
    assert_eq!(ids, [("model-a", "model-a"), ("model-b", "model-b")]);
    for (model, want) in [
        (Some("model-b"), "model-b"),
        (Some("model-a"), "model-a"),
        (None, "model-a"),
    ] {
        let r = send(
            &c,
            &e,
            Method::POST,
            "/v1/chat/completions",
            &chat(model, "hi"),
        )
        .await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text());
        assert_eq!(r.json()["model"], want);
    }
    let r = send(
        &c,
        &e,
        Method::POST,
        "/v1/chat/completions",
        &chat(Some("other"), "hi"),
    )
    .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let err = &r.json()["error"];
    assert_eq!(err["type"], "NotFoundError");
    assert_eq!(err["message"], "The model `other` does not exist.");
    let r = send(
        &c,
        &e,
        Method::POST,
        "/v1/completions",
        r#"{"model": 5, "prompt": "x"}"#,
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn a_prompt_never_hits_the_cache_across_models() {
    let e = serving("two", &["model-a", "model-b"]).await;
    let c = client();
    let p = long_prompt();
    let cached = |v: Value| v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    let ask = |model: &'static str| {
        let (c, e, body) = (&c, &e, chat(Some(model), &p));
        async move {
            send(c, e, Method::POST, "/v1/chat/completions", &body)
                .await
                .json()
        }
    };
    assert_eq!(cached(ask("model-a").await), Some(0));
    assert_eq!(cached(ask("model-b").await), Some(0), "model-a's blocks");
    assert!(cached(ask("model-a").await).unwrap() >= 288);
    assert!(cached(ask("model-b").await).unwrap() >= 288);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_sends_each_model_only_to_the_engines_that_serve_it() {
    let a = serving("a", &["model-a"]).await;
    let b = serving("b", &["model-b"]).await;
    let both = serving("both", &["model-a", "model-b"]).await;
    let yaml = format!(
        "policy: round_robin\nworkers:\n  - url: \"{}\"\n  - url: \"{}\"\n  - url: \"{}\"\n",
        a.url(),
        b.url(),
        both.url()
    );
    let (_router, base) = start_router(&yaml).await;
    let c = client();
    wait_until("the router read every engine's list", || {
        let (c, base) = (&c, &base);
        async move {
            let w = send_to(c, base, Method::GET, "/workers", "").await.json();
            w["workers"].as_array().is_some_and(|ws| {
                ws.iter()
                    .all(|w| w["models"]["source"].as_str() == Some("listed"))
            })
        }
    })
    .await;
    for i in 0..12 {
        let model = if i % 2 == 0 { "model-a" } else { "model-b" };
        let r = send_to(
            &c,
            &base,
            Method::POST,
            "/v1/chat/completions",
            &chat(Some(model), &format!("q{i}")),
        )
        .await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text());
        assert_eq!(r.json()["model"], model);
        let allowed = if model == "model-a" {
            ["a", "both"]
        } else {
            ["b", "both"]
        };
        assert!(
            allowed.contains(&r.engine.as_str()),
            "{model} on {}",
            r.engine
        );
    }
    let list = send_to(&c, &base, Method::GET, "/v1/models", "")
        .await
        .json();
    let mut ids: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, ["model-a", "model-b"]);
}

//! The simulated engine continues an answer as a real one decodes greedily: a chat
//! request with its partial answer as the last assistant message
//! (`continue_final_message`) goes on exactly where the uninterrupted answer would;
//! and a stalling engine holds back the first token of the requests it stalls.

use std::time::{Duration, Instant};

use bench::engine::{self, EngineConfig, RunningEngine};
use hyper::{Method, StatusCode};
use serde_json::{Value, json};

use crate::support::{client, send};

async fn start(cfg: EngineConfig) -> RunningEngine {
    engine::start(cfg).await.expect("engine starts")
}

/// The content of a streamed chat answer, its tokens concatenated.
fn streamed_text(body: &str) -> String {
    body.split_terminator("\n\n")
        .filter_map(|ev| ev.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect()
}

#[tokio::test]
async fn a_continued_final_message_goes_on_as_the_uninterrupted_answer() {
    let e = start(EngineConfig {
        time_factor: 0.001,
        ..EngineConfig::default()
    })
    .await;
    let c = client();
    let user = json!({"role": "user", "content": "tell me a long story"});
    let ask = |messages: Value, max_tokens: u64, extra: Value| {
        let mut b = json!({"model": "m", "messages": messages, "max_tokens": max_tokens,
                           "stream": true});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b.to_string()
    };
    let whole = send(
        &c,
        &e,
        Method::POST,
        "/v1/chat/completions",
        &ask(json!([user]), 12, json!({})),
    )
    .await;
    assert_eq!(whole.status, StatusCode::OK);
    let whole = streamed_text(&whole.text());
    assert_eq!(whole.split_whitespace().count(), 12);
    // The first 5 tokens, as a client read them (each " word").
    let head: String = whole
        .split(' ')
        .skip(1)
        .take(5)
        .map(|w| format!(" {w}"))
        .collect();
    let cont = json!({"continue_final_message": true, "add_generation_prompt": false});
    let partial = json!([user, {"role": "assistant", "content": head}]);
    let rest = send(
        &c,
        &e,
        Method::POST,
        "/v1/chat/completions",
        &ask(partial.clone(), 7, cont.clone()),
    )
    .await;
    assert_eq!(rest.status, StatusCode::OK);
    assert_eq!(format!("{head}{}", streamed_text(&rest.text())), whole);

    // Not streamed: the same text.
    let mut once: Value = serde_json::from_str(&ask(partial.clone(), 7, cont.clone())).unwrap();
    once["stream"] = json!(false);
    let r = send(
        &c,
        &e,
        Method::POST,
        "/v1/chat/completions",
        &once.to_string(),
    )
    .await;
    let text = r.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(format!("{head}{text}"), whole);

    // Its prompt is the first one plus the 5 tokens, as /tokenize counts it.
    let count = |body: Value| {
        let c = c.clone();
        let e = &e;
        async move {
            let r = send(&c, e, Method::POST, "/tokenize", &body.to_string()).await;
            r.json()["count"].as_u64().unwrap()
        }
    };
    let first = count(json!({"messages": [user]})).await;
    let mut tok = cont.clone();
    tok["messages"] = partial.clone();
    assert_eq!(count(tok).await, first + 5);

    // vLLM refuses both options at once (add_generation_prompt defaults to true).
    let both = ask(partial, 7, json!({"continue_final_message": true}));
    let r = send(&c, &e, Method::POST, "/v1/chat/completions", &both).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert!(r.text().contains("continue_final_message"), "{}", r.text());
}

#[tokio::test]
async fn a_stalled_request_waits_for_its_first_token_and_is_counted() {
    let stall = Duration::from_millis(300);
    // Every request stalls; nothing else takes time.
    let stalling = |prefill_physics| EngineConfig {
        prefill_physics,
        ttft_base: Duration::ZERO,
        prefill_per_token: Duration::ZERO,
        itl: Duration::ZERO,
        stall_first_token: stall,
        stall_share: 1.0,
        ..EngineConfig::default()
    };
    let e = start(stalling(engine::Physics::Serial)).await;
    let c = client();
    let body = json!({"model": "m", "max_tokens": 2,
                      "messages": [{"role": "user", "content": "hello"}]});
    let t0 = Instant::now();
    let r = send(
        &c,
        &e,
        Method::POST,
        "/v1/chat/completions",
        &body.to_string(),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(t0.elapsed() >= stall, "answered after {:?}", t0.elapsed());
    assert_eq!(e.engine().stats().stalled, 1);
    assert!(
        e.engine()
            .metrics_text()
            .contains("sim:stalled_total{engine=\"0\",model_name=\"m\"} 1\n")
    );

    // Streamed, under the timer and the chunked physics: not even the role chunk
    // comes before the stall (a router waiting for a first byte sees none).
    for physics in [engine::Physics::Serial, engine::Physics::Chunked] {
        let e = start(stalling(physics)).await;
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let req = hyper::Request::post(format!("{}/v1/chat/completions", e.url()))
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::from(
                streamed.to_string(),
            )))
            .unwrap();
        let t0 = Instant::now();
        let resp = c.request(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        let mut body = resp.into_body();
        let first = http_body_util::BodyExt::frame(&mut body).await;
        assert!(first.is_some());
        assert!(
            t0.elapsed() >= stall,
            "{physics}: first byte after {:?}",
            t0.elapsed()
        );
        assert_eq!(e.engine().stats().stalled, 1);
    }

    // A share above 1 is refused.
    let bad = EngineConfig {
        stall_share: 1.5,
        ..EngineConfig::default()
    };
    assert!(engine::Engine::new(bad).is_err());
}

//! The simulated engine's `POST /v1/embeddings` over real HTTP on 127.0.0.1:0: the
//! OpenAI response shape, vectors equal to `bench::embeddings::embed`, OpenAI-shaped
//! 400s, the `sim:embedding_requests_total` counter, and answers that never wait
//! behind the prefill queue (nor count in it).

use std::time::{Duration, Instant};

use bench::embeddings::{EMBEDDING_DIM, embed};
use bench::engine::{self, EngineConfig, EngineStats, RunningEngine};
use bytes::Bytes;
use http_body_util::Full;
use hyper::{Method, Request, StatusCode};
use serde_json::{Value, json};

use crate::support::{HttpClient, client};

/// Sends `body` to `path`; status, content type and the body as JSON.
async fn send(
    c: &HttpClient,
    e: &RunningEngine,
    method: Method,
    path: &str,
    body: &str,
) -> (StatusCode, String, Value) {
    let r = crate::support::send(c, e, method, path, body).await;
    assert_eq!(r.engine, e.engine().name());
    (r.status, r.content_type.clone(), r.json())
}

/// An engine whose prefill takes `prefill_ms` of wall time per request.
async fn start(prefill_ms: u64, max_waiting: usize) -> RunningEngine {
    let cfg = EngineConfig {
        name: "e-emb".into(),
        ttft_base: Duration::from_millis(prefill_ms),
        prefill_per_token: Duration::ZERO,
        itl: Duration::ZERO,
        time_factor: 1.0,
        max_waiting,
        ..EngineConfig::default()
    };
    engine::start(cfg).await.expect("engine starts")
}

/// Polls `cond` on the engine's stats every ms for up to 5 s.
async fn until(e: &RunningEngine, what: &str, cond: impl Fn(&EngineStats) -> bool) {
    for _ in 0..5000 {
        if cond(&e.engine().stats()) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("timed out waiting for {what}: {:?}", e.engine().stats());
}

#[tokio::test]
async fn embeddings_answer_the_openai_shape_and_count_only_themselves() {
    let e = start(0, 0).await;
    let c = client();
    let texts = ["What is the capital of France?", "how do caches work"];
    let body = json!({"model": "text-embedding-3-small", "input": texts,
                      "encoding_format": "float"});
    let (status, ct, v) = send(&c, &e, Method::POST, "/v1/embeddings", &body.to_string()).await;
    assert_eq!((status, ct.as_str()), (StatusCode::OK, "application/json"));
    assert_eq!(v["object"], "list");
    assert_eq!(v["model"], "text-embedding-3-small");
    assert_eq!(v["usage"], json!({"prompt_tokens": 10, "total_tokens": 10}));
    let data = v["data"].as_array().unwrap();
    assert_eq!(data.len(), 2);
    for (i, d) in data.iter().enumerate() {
        assert_eq!(
            (d["object"].as_str(), d["index"].as_u64()),
            (Some("embedding"), Some(i as u64))
        );
        let got: Vec<f32> = serde_json::from_value(d["embedding"].clone()).unwrap();
        assert_eq!(got.len(), EMBEDDING_DIM);
        assert_eq!(got, embed(texts[i]), "f32 survives the JSON round trip");
    }

    // A plain string, no model: the served model's name.
    let (status, _, v) = send(&c, &e, Method::POST, "/v1/embeddings", r#"{"input": "hi"}"#).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        (v["model"].as_str(), v["data"].as_array().map(Vec::len)),
        (Some("m"), Some(1))
    );

    let s = e.engine().stats();
    assert_eq!(s.embedding_requests, 2);
    assert_eq!(
        (s.prompt_tokens, s.cache_queries, s.requests_finished),
        (0, 0, 0)
    );
    assert_eq!((s.kv_blocks_used, s.waiting_peak), (0, 0));
    let text = e.engine().metrics_text();
    assert!(
        text.contains("sim:embedding_requests_total{engine=\"0\",model_name=\"m\"} 2\n"),
        "{text}"
    );
}

#[tokio::test]
async fn bad_embedding_requests_get_openai_400s() {
    let e = start(0, 0).await;
    let c = client();
    let bad = [
        ("{}", "input is required"),
        (r#"{"input": 7}"#, "string or an array"),
        (r#"{"input": ["ok", 1]}"#, "string or an array"),
        (r#"{"input": []}"#, "must not be empty"),
        (
            r#"{"input": "x", "encoding_format": "base64"}"#,
            "encoding_format",
        ),
        ("not json", "valid JSON"),
    ];
    for (body, want) in bad {
        let (status, ct, v) = send(&c, &e, Method::POST, "/v1/embeddings", body).await;
        assert_eq!(
            (status, ct.as_str()),
            (StatusCode::BAD_REQUEST, "application/json"),
            "{body}"
        );
        assert_eq!(v["error"]["type"], "invalid_request_error", "{body}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(want), "{body}: {msg}");
    }
    let (status, _, v) = send(&c, &e, Method::GET, "/v1/embeddings", "").await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert_eq!(e.engine().stats().embedding_requests, 0);
}

#[tokio::test]
async fn embeddings_skip_a_full_prefill_queue() {
    // A holds the 400 ms prefill slot and B waits behind it: the queue (1) is full.
    let e = start(400, 1).await;
    let c = client();
    let chat = |salt: &str| {
        json!({"model": "m", "max_tokens": 1,
               "messages": [{"role": "user", "content": format!("hello {salt}")}]})
        .to_string()
    };
    let post_chat = |body: String| {
        let (c, url) = (c.clone(), e.url());
        async move {
            let req = Request::builder()
                .method(Method::POST)
                .uri(format!("{url}/v1/chat/completions"))
                .body(Full::new(Bytes::from(body)))
                .unwrap();
            c.request(req).await.unwrap().status()
        }
    };
    let a = tokio::spawn(post_chat(chat("a")));
    until(&e, "A running", |s| s.running == 1).await;
    let b = tokio::spawn(post_chat(chat("b")));
    until(&e, "B waiting", |s| s.waiting == 1).await;

    let t0 = Instant::now();
    let (status, _, v) = send(&c, &e, Method::POST, "/v1/embeddings", r#"{"input": "x"}"#).await;
    assert!(
        t0.elapsed() < Duration::from_millis(200),
        "answered at once"
    );
    assert_eq!(status, StatusCode::OK, "{v}");
    let s = e.engine().stats();
    assert_eq!((s.running, s.waiting, s.rejected), (1, 1, 0));
    assert_eq!((s.waiting_peak, s.embedding_requests), (1, 1));
    assert_eq!(
        (a.await.unwrap(), b.await.unwrap()),
        (StatusCode::OK, StatusCode::OK)
    );
}

//! The simulated engine over real HTTP on 127.0.0.1:0: vLLM response shapes,
//! prefix-cache hits on a repeated prompt, SSE framing and error bodies.

use bench::engine::{self, EngineConfig, RunningEngine};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

type HttpClient = Client<HttpConnector, Full<Bytes>>;

async fn start() -> RunningEngine {
    let cfg = EngineConfig {
        name: "e-test".into(),
        // 1 ms of simulated time = 1 µs: the whole test takes milliseconds.
        time_factor: 0.001,
        ..EngineConfig::default()
    };
    engine::start(cfg).await.expect("engine starts")
}

/// Sends a request and returns status, `x-sim-engine` and the whole body.
async fn send(
    client: &HttpClient,
    e: &RunningEngine,
    method: Method,
    path: &str,
    body: &str,
) -> (StatusCode, String, String) {
    let req = Request::builder()
        .method(method)
        .uri(format!("{}{path}", e.url()))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_owned())))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    let status = resp.status();
    let name = resp.headers()["x-sim-engine"].to_str().unwrap().to_owned();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, name, String::from_utf8(bytes.to_vec()).unwrap())
}

fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

#[tokio::test]
async fn repeated_prompt_reports_cached_tokens_streamed_and_not() {
    let e = start().await;
    let c = client();
    let prompt: String = (0..200).map(|i| format!(" w{i}")).collect();
    let body = json!({"model": "m", "messages": [{"role": "user", "content": prompt}],
                      "max_tokens": 5});

    let (status, name, text) = send(
        &c,
        &e,
        Method::POST,
        "/v1/chat/completions",
        &body.to_string(),
    )
    .await;
    assert_eq!((status, name.as_str()), (StatusCode::OK, "e-test"));
    let first: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(first["object"], "chat.completion");
    assert_eq!(first["choices"][0]["finish_reason"], "length");
    assert_eq!(first["usage"]["completion_tokens"], 5);
    // 200 words + template tokens, nothing cached yet.
    let prompt_tokens = first["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 200);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

    let (_, _, text) = send(
        &c,
        &e,
        Method::POST,
        "/v1/chat/completions",
        &body.to_string(),
    )
    .await;
    let second: Value = serde_json::from_str(&text).unwrap();
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached > 0 && cached < prompt_tokens && cached.is_multiple_of(16),
        "cached {cached}"
    );

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (status, _, text) = send(
        &c,
        &e,
        Method::POST,
        "/v1/chat/completions",
        &streamed.to_string(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let events: Vec<&str> = text.split_terminator("\n\n").collect();
    assert!(events.iter().all(|ev| ev.starts_with("data: ")), "{text}");
    assert_eq!(events.last(), Some(&"data: [DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|ev| serde_json::from_str(&ev["data: ".len()..]).unwrap())
        .collect();
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content.split_whitespace().count(), 5);
    let usage_chunk = chunks.last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(
        usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"],
        cached
    );

    let stats = e.engine().stats();
    assert_eq!(stats.requests_finished, 3);
    assert_eq!(stats.cache_hits, 2 * cached);
    assert_eq!((stats.running, stats.waiting), (0, 0));
}

#[tokio::test]
async fn side_endpoints_and_bad_requests() {
    let e = start().await;
    let c = client();
    let (status, _, text) = send(&c, &e, Method::POST, "/v1/chat/completions", "{not json").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error");

    let (status, _, text) = send(
        &c,
        &e,
        Method::POST,
        "/v1/completions",
        r#"{"prompt": [1, 2, 3], "max_tokens": 2}"#,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        (v["object"].as_str(), v["usage"]["prompt_tokens"].as_u64()),
        (Some("text_completion"), Some(3))
    );

    let (status, name, _) = send(&c, &e, Method::GET, "/health", "").await;
    assert_eq!((status, name.as_str()), (StatusCode::OK, "e-test"));
    let (_, _, text) = send(&c, &e, Method::GET, "/v1/models", "").await;
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        (v["object"].as_str(), v["data"][0]["id"].as_str()),
        (Some("list"), Some("m"))
    );
    let (_, _, text) = send(&c, &e, Method::GET, "/metrics", "").await;
    for name in [
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:prompt_tokens_total{engine=\"0\",model_name=\"m\"} 3",
    ] {
        assert!(text.contains(name), "{name} missing from\n{text}");
    }
    let (status, _, _) = send(&c, &e, Method::GET, "/nope", "").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

//! The simulated engine over real HTTP on 127.0.0.1:0: vLLM response shapes,
//! prefix-cache hits on a repeated prompt, SSE framing and error bodies; 429 with
//! Retry-After past `max_waiting`, the waiting high-water mark, SGLang metric names.

use bench::engine::{self, EngineConfig, MetricsFlavor, RunningEngine};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use serde_json::{Value, json};

use crate::support::{HttpClient, client};

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
    let r = crate::support::send(client, e, method, path, body).await;
    (r.status, r.engine.clone(), r.text())
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

/// An engine whose prefill takes `prefill_ms` of wall time per request (no decode
/// time), so requests can be held in the queue on purpose.
async fn start_slow(prefill_ms: u64, max_waiting: usize, flavor: MetricsFlavor) -> RunningEngine {
    let cfg = EngineConfig {
        name: "e-slow".into(),
        ttft_base: std::time::Duration::from_millis(prefill_ms),
        prefill_per_token: std::time::Duration::ZERO,
        itl: std::time::Duration::ZERO,
        time_factor: 1.0,
        max_waiting,
        retry_after_secs: 3,
        metrics_flavor: flavor,
        ..EngineConfig::default()
    };
    engine::start(cfg).await.expect("engine starts")
}

/// Polls `cond` on the engine's stats every ms for up to 5 s.
async fn until(e: &RunningEngine, what: &str, cond: impl Fn(&engine::EngineStats) -> bool) {
    for _ in 0..5000 {
        if cond(&e.engine().stats()) {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    panic!("timed out waiting for {what}: {:?}", e.engine().stats());
}

fn chat_body(salt: &str) -> String {
    json!({"model": "m", "messages": [{"role": "user", "content": format!("hello {salt}")}],
           "max_tokens": 1})
    .to_string()
}

#[tokio::test]
async fn full_queue_answers_429_with_retry_after_and_counts_peak() {
    let e = start_slow(400, 1, MetricsFlavor::Vllm).await;
    let c = client();
    let url = e.url();
    let post = |path: &'static str, body: String| {
        let c = c.clone();
        let url = url.clone();
        async move {
            let req = Request::builder()
                .method(Method::POST)
                .uri(format!("{url}{path}"))
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(body)))
                .unwrap();
            let resp = c.request(req).await.unwrap();
            let status = resp.status();
            let retry = resp
                .headers()
                .get("retry-after")
                .map(|v| v.to_str().unwrap().to_owned());
            let bytes = resp.into_body().collect().await.unwrap().to_bytes();
            (status, retry, String::from_utf8(bytes.to_vec()).unwrap())
        }
    };
    // A takes the prefill slot, B waits behind it: the queue (1) is full.
    let a = tokio::spawn(post("/v1/chat/completions", chat_body("a")));
    until(&e, "A running", |s| s.running == 1).await;
    let b = tokio::spawn(post("/v1/chat/completions", chat_body("b")));
    until(&e, "B waiting", |s| s.waiting == 1).await;

    let t0 = std::time::Instant::now();
    let (status, retry, text) = post("/v1/chat/completions", chat_body("c")).await;
    assert!(
        t0.elapsed() < std::time::Duration::from_millis(200),
        "answered at once"
    );
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(retry.as_deref(), Some("3"));
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["error"]["type"], "rate_limit_error");
    assert_eq!(v["error"]["code"], 429);
    assert!(v["error"]["message"].as_str().unwrap().contains("waiting"));

    let msg = json!({"model": "m", "max_tokens": 1,
                     "messages": [{"role": "user", "content": "hi"}]});
    let (status, retry, text) = post("/v1/messages", msg.to_string()).await;
    assert_eq!(
        (status, retry.as_deref()),
        (StatusCode::TOO_MANY_REQUESTS, Some("3"))
    );
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        (v["type"].as_str(), v["error"]["type"].as_str()),
        (Some("error"), Some("rate_limit_error"))
    );

    let (status, _, metrics) = send(&c, &e, Method::GET, "/metrics", "").await;
    assert_eq!(status, StatusCode::OK);
    for row in [
        "sim:rejected_total{engine=\"0\",model_name=\"m\"} 2",
        "sim:num_requests_waiting_peak{engine=\"0\",model_name=\"m\"} 1",
        "vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 1",
    ] {
        assert!(metrics.contains(row), "{row} missing from\n{metrics}");
    }

    // The admitted ones finish normally; the rejected ones left no trace.
    assert_eq!(a.await.unwrap().0, StatusCode::OK);
    assert_eq!(b.await.unwrap().0, StatusCode::OK);
    let s = e.engine().stats();
    assert_eq!((s.requests_finished, s.rejected, s.waiting_peak), (2, 2, 1));
    assert_eq!((s.running, s.waiting), (0, 0));
    // With the queue drained, a new request is admitted again.
    let (status, _, _) = post("/v1/chat/completions", chat_body("d")).await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn unbounded_queue_tracks_its_peak_and_sglang_names() {
    let e = start_slow(150, 0, MetricsFlavor::Sglang).await;
    let c = client();
    let mut tasks = Vec::new();
    for i in 0..4 {
        let c = c.clone();
        let url = e.url();
        tasks.push(tokio::spawn(async move {
            let req = Request::builder()
                .method(Method::POST)
                .uri(format!("{url}/v1/chat/completions"))
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(chat_body(&i.to_string()))))
                .unwrap();
            c.request(req).await.unwrap().status()
        }));
    }
    // One in prefill, three behind it.
    until(&e, "3 waiting", |s| s.waiting == 3).await;
    let (_, _, metrics) = send(&c, &e, Method::GET, "/metrics", "").await;
    for row in [
        "sglang:num_queue_reqs{model_name=\"m\"} 3",
        "sglang:num_running_reqs{model_name=\"m\"} 1",
        "sglang:token_usage{model_name=\"m\"} ",
        "sglang:cache_hit_rate{model_name=\"m\"} ",
        "sglang:prompt_tokens_total{model_name=\"m\"} ",
        "sglang:generation_tokens_total{model_name=\"m\"} ",
        "# TYPE sglang:num_queue_reqs gauge",
        "# TYPE sglang:prompt_tokens_total counter",
        "sim:num_requests_waiting_peak{model_name=\"m\"} 3",
        "sim:rejected_total{model_name=\"m\"} 0",
    ] {
        assert!(metrics.contains(row), "{row} missing from\n{metrics}");
    }
    assert!(
        !metrics.contains("vllm:"),
        "no vLLM names with sglang:\n{metrics}"
    );
    for t in tasks {
        assert_eq!(t.await.unwrap(), StatusCode::OK);
    }
    let s = e.engine().stats();
    assert_eq!((s.waiting, s.waiting_peak, s.rejected), (0, 3, 0));
}

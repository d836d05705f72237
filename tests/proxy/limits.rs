//! Request size limits and the answers the router gives itself: 413 past the body
//! limit, 503 with no usable worker, and pass-through of paths it does not know
//! (`proxy.passthrough`).

use std::time::{Duration, Instant};

use support::{client::*, config::*, observe::*, worker::*};

use crate::common::start_router;

const LIMIT: usize = 8 * 1024 * 1024;

/// A chat body of exactly `len` bytes of plain ASCII.
fn chat_body_of_len(len: usize) -> String {
    let head = r#"{"model":"m","messages":[{"role":"user","content":""#;
    let tail = r#""}]}"#;
    let mut body = String::with_capacity(len);
    body.push_str(head);
    let words = "long context line of plain text. ";
    while body.len() + tail.len() < len {
        let room = len - tail.len() - body.len();
        body.push_str(&words[..room.min(words.len())]);
    }
    body.push_str(tail);
    assert_eq!(body.len(), len);
    body
}

fn assert_413_naming_the_limit(resp: &Response) {
    assert_eq!(resp.status, 413, "{}", resp.text());
    let msg = resp.json()["error"]["message"]
        .as_str()
        .expect("error.message")
        .to_string();
    assert!(
        msg.contains(&LIMIT.to_string()),
        "the message names the limit: {msg}"
    );
}

// C26 (1)–(3)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn body_limit_forwards_bodies_up_to_it_and_refuses_larger_ones_before_any_worker() {
    let w = FakeWorker::start().await;
    let router = start_router(&yaml_for(&[&w], "server:\n  max_body_bytes: 8388608\n")).await;

    for len in [LIMIT - 1024, LIMIT] {
        let body = chat_body_of_len(len);
        let resp = post(router.addr, "/v1/chat/completions", body.clone()).await;
        assert_eq!(resp.status, 200, "{len} bytes: {}", resp.text());
        assert!(
            w.requests().pop().unwrap().body == body.as_bytes(),
            "{len} bytes forwarded unchanged"
        );
    }
    let forwarded = w.count();

    let big = chat_body_of_len(9 * 1024 * 1024);
    let (resp, _) =
        send_while_reading(router.addr, &Req::post("/v1/chat/completions", big.clone())).await;
    assert_413_naming_the_limit(&resp);
    assert_eq!(in_flight(router.addr).await, [0]);

    let (resp, _) = send_while_reading(
        router.addr,
        &Req::post("/v1/chat/completions", big).chunked(64 * 1024),
    )
    .await;
    assert_413_naming_the_limit(&resp);

    let (resp, _) = send_while_reading(
        router.addr,
        &Req::post("/v1/chat/completions", chat_body_of_len(LIMIT + 1)).chunked(64 * 1024),
    )
    .await;
    assert_413_naming_the_limit(&resp);

    assert_eq!(w.count(), forwarded, "refused bodies never reach a worker");
    assert_eq!(in_flight(router.addr).await, [0]);
    router.shutdown().await;
}

// C26 (4)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_body_limit_forwards_a_long_context_request_with_an_image() {
    let w = FakeWorker::start().await;
    let router = start_router(&yaml_for(&[&w], "")).await;
    let text = "a long context line of plain text. ".repeat(10 * 1024 * 1024 / 35);
    let image = "QUJD".repeat(2 * 1024 * 1024 / 4);
    let body = serde_json::json!({
        "model": "m",
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": text},
            {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{image}")}},
        ]}],
    })
    .to_string();
    assert!(body.len() >= 12 * 1024 * 1024);
    let resp = post(router.addr, "/v1/chat/completions", body.clone()).await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert!(w.requests()[0].body == body.as_bytes());
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_reachable_worker_answers_503_json_and_admin_still_answers() {
    let urls = closed_port_urls::<2>();
    let router = start_router(&yaml_for_urls(&urls, "")).await;
    for body in [
        chat_body("anyone there?", false),
        chat_body("anyone there?", true),
    ] {
        let started = Instant::now();
        let resp = post(router.addr, "/v1/chat/completions", body).await;
        assert_eq!(resp.status, 503, "{}", resp.text());
        assert!(
            resp.header("content-type")
                .is_some_and(|v| v.contains("json"))
        );
        let msg = &resp.json()["error"]["message"];
        assert!(
            msg.as_str().is_some_and(|m| !m.is_empty()),
            "{}",
            resp.text()
        );
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "answered in {:?}",
            started.elapsed()
        );
    }
    let workers = get_workers(router.addr).await;
    assert_eq!(workers["workers"].as_array().unwrap().len(), 2);
    assert_eq!(in_flight(router.addr).await, [0, 0]);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_paths_pass_through_to_a_worker_unchanged_when_passthrough_allows() {
    let w = FakeWorker::start_with(|_| {
        Reply::status(202)
            .header("X-Custom", "yes")
            .body(b"accepted-custom".to_vec())
    })
    .await;
    let router = start_router(&yaml_for(&[&w], "proxy:\n  passthrough: allow\n")).await;
    let cases = [
        Req::new("PUT", "/internal/custom/path?x=1&y=two%20words")
            .header("Content-Type", "application/octet-stream")
            .body(b"raw \x00\x01\xff bytes".to_vec()),
        Req::new("DELETE", "/v1/files/abc?force=1"),
        Req::get("/v1/custom/state?verbose=true&n=3"),
        Req::post("/tokenize?model=m", r#"{"prompt":"count my tokens"}"#),
    ];
    for (i, req) in cases.iter().enumerate() {
        let resp = send(router.addr, req).await;
        assert_eq!(resp.status, 202, "case {i}: {}", resp.text());
        assert_eq!(resp.text(), "accepted-custom");
        assert_eq!(resp.header("x-custom"), Some("yes"));
        let rec = w.requests().pop().unwrap();
        assert_eq!(rec.method, req.method, "case {i}");
        assert_eq!(rec.target, req.target, "case {i}");
        assert_eq!(rec.body, req.body, "case {i}");
        for (k, v) in &req.headers {
            assert_eq!(rec.header(k), Some(v.as_str()), "case {i}: header {k}");
        }
    }
    assert_eq!(w.count(), cases.len());
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_silent_past_the_request_timeout_answers_504_json() {
    let w = FakeWorker::start_with(|_| {
        Reply::raw(vec![
            Step::Sleep(Duration::from_millis(1500)),
            Step::Write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}".to_vec()),
        ])
    })
    .await;
    let router = start_router(&yaml_for(&[&w], "proxy:\n  request_timeout_secs: 0.2\n")).await;
    let started = Instant::now();
    let resp = post(
        router.addr,
        "/v1/chat/completions",
        chat_body("slow", false),
    )
    .await;
    assert_eq!(resp.status, 504, "{}", resp.text());
    assert!(resp.json()["error"]["message"].is_string());
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "answered after {:?}",
        started.elapsed()
    );
    assert_eq!(in_flight(router.addr).await, [0]);
    router.shutdown().await;
}

/// `request_timeout_secs` also bounds a silence inside a body: a stream that keeps
/// producing runs past it, however long; one that goes quiet mid-body is cut after it and
/// counted `upstream_idle_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_is_cut_by_a_silent_gap_never_by_its_length() {
    let w = FakeWorker::start_with(|req| {
        if req.body_str().contains("steady") {
            let events: Vec<String> = (0..8).map(|i| format!("{{\"n\":{i}}}")).collect();
            Reply::sse(&events, Duration::from_millis(100))
        } else {
            Reply::status(200)
                .header("Content-Type", "text/event-stream")
                .chunked(vec![
                    Step::Write(b"data: {\"n\":0}\n\n".to_vec()),
                    Step::Sleep(Duration::from_secs(3)),
                    Step::Write(b"data: {\"n\":1}\n\n".to_vec()),
                ])
        }
    })
    .await;
    let router = start_router(&yaml_for(&[&w], "proxy:\n  request_timeout_secs: 0.3\n")).await;

    let steady = post(
        router.addr,
        "/v1/chat/completions",
        chat_body("steady", true),
    )
    .await;
    assert_eq!(steady.status, 200);
    assert_eq!(
        steady.text().matches("data: ").count(),
        8,
        "{}",
        steady.text()
    );
    let ran = steady.done_at - steady.head_at;
    assert!(ran >= Duration::from_millis(600), "the stream ran {ran:?}");

    // The cut stream ends without its last chunk: read it piece by piece to the error.
    let mut conn = Conn::connect(router.addr).await;
    let req = Req::post("/v1/chat/completions", chat_body("silent", true));
    conn.send(&req).await.unwrap();
    let head = conn.read_head().await;
    assert_eq!(head.status, 200);
    let mut body = Vec::new();
    let ended = loop {
        match conn.try_next_piece().await {
            Ok(Some(p)) => body.extend_from_slice(&p),
            Ok(None) => panic!("a complete body: {}", String::from_utf8_lossy(&body)),
            Err(e) => break e,
        }
    };
    let waited = head.at.elapsed();
    let body = String::from_utf8_lossy(&body);
    assert!(body.contains(r#"{"n":0}"#), "{body}");
    assert!(!body.contains(r#"{"n":1}"#), "{body}");
    assert_eq!(ended.kind(), std::io::ErrorKind::UnexpectedEof, "{ended}");
    assert!(
        waited >= Duration::from_millis(250) && waited < Duration::from_secs(2),
        "cut after {waited:?}"
    );

    let m = scrape(router.addr).await;
    let outcome = |o: &str| {
        m.value(
            "cache_aware_router_request_outcomes_total",
            &[("outcome", o)],
        )
    };
    assert_eq!(outcome("upstream_idle_timeout"), 1.0);
    assert_eq!(outcome("complete"), 1.0);
    assert_eq!(in_flight(router.addr).await, [0]);
    router.shutdown().await;
}

/// An engine's operator endpoints, which a client must not reach with the router's key.
const OPERATOR_PATHS: [&str; 7] = [
    "/collective_rpc",
    "/sleep",
    "/wake_up",
    "/reset_prefix_cache",
    "/start_profile",
    "/flush_cache",
    "/update_weights_from_disk",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_operator_endpoints_are_closed_by_default_and_opened_by_passthrough() {
    let w = FakeWorker::start_with(|_| Reply::json(200, r#"{"ok":true}"#)).await;
    let keyed = "proxy:\n  api_key: backend-key-1\n";
    let router = start_router(&yaml_for(&[&w], keyed)).await;
    let sneaky = ["/v1/../sleep", "/v1/%2e%2e/sleep", "/v1%2fsleep", "/scores"];
    for path in OPERATOR_PATHS.iter().chain(&sneaky) {
        let resp = send(router.addr, &Req::post(path, "{}")).await;
        assert_eq!(resp.status, 404, "{path}: {}", resp.text());
        let msg = resp.json()["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(
            msg.contains("proxy.passthrough"),
            "{path}: says which key opens it: {msg}"
        );
    }
    assert_eq!(w.count(), 0, "no operator endpoint reached the worker");
    // The defaults: the OpenAI API and vLLM's client endpoints.
    for path in [
        "/v1/embeddings",
        "/tokenize",
        "/detokenize",
        "/pooling",
        "/classify",
        "/score",
        "/rerank",
        "/v1/chat/completions",
    ] {
        let resp = send(router.addr, &Req::post(path, chat_body("hi", false))).await;
        assert_eq!(resp.status, 200, "{path}: {}", resp.text());
    }
    assert_eq!(send(router.addr, &Req::get("/v1/models")).await.status, 200);
    router.shutdown().await;

    // `allow`: reaches the worker, with the backend key.
    let router = start_router(&yaml_for(&[&w], &format!("{keyed}  passthrough: allow\n"))).await;
    let before = w.count();
    let resp = send(
        router.addr,
        &Req::post("/collective_rpc", r#"{"method":"x"}"#)
            .header("Authorization", "Bearer client-key"),
    )
    .await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    let rec = w.requests().pop().unwrap();
    assert_eq!(
        (rec.target.as_str(), w.count()),
        ("/collective_rpc", before + 1)
    );
    assert_eq!(rec.header_all("authorization"), ["Bearer backend-key-1"]);
    router.shutdown().await;

    // A list opens exactly what it names; `deny` leaves only the routed endpoints.
    let router = start_router(&yaml_for(
        &[&w],
        "proxy:\n  passthrough: [/sleep, /v1/embeddings]\n",
    ))
    .await;
    assert_eq!(
        send(router.addr, &Req::post("/sleep", "{}")).await.status,
        200
    );
    assert_eq!(
        send(router.addr, &Req::post("/wake_up", "{}")).await.status,
        404
    );
    assert_eq!(
        send(router.addr, &Req::post("/tokenize", "{}"))
            .await
            .status,
        404
    );
    router.shutdown().await;
    let router = start_router(&yaml_for(&[&w], "proxy:\n  passthrough: deny\n")).await;
    assert_eq!(
        send(router.addr, &Req::post("/v1/embeddings", "{}"))
            .await
            .status,
        404
    );
    assert_eq!(send(router.addr, &Req::get("/v1/files")).await.status, 404);
    let resp = send(
        router.addr,
        &Req::post("/v1/chat/completions", chat_body("hi", false)),
    )
    .await;
    assert_eq!(resp.status, 200);
    assert_eq!(send(router.addr, &Req::get("/v1/models")).await.status, 200);
    router.shutdown().await;
}

// Issue 38: vLLM serves adapter loading and its admin API below `/v1/`, which the
// default rule opens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_endpoints_under_an_open_prefix_stay_closed_until_listed() {
    let w = FakeWorker::start_with(|_| Reply::json(200, r#"{"ok":true}"#)).await;
    let keyed = "proxy:\n  api_key: backend-key-1\n";
    let router = start_router(&yaml_for(&[&w], keyed)).await;
    let lora = r#"{"lora_name":"evil","lora_path":"/tmp/evil"}"#;
    for path in [
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/v1/admin/drain",
        "/v1/runtime_config",
        "/v1/load%5flora_adapter",
        "/v1//load_lora_adapter",
        "/v1/load_lora_adapter/",
    ] {
        let resp = send(router.addr, &Req::post(path, lora)).await;
        assert_eq!(resp.status, 404, "{path}: {}", resp.text());
        let err = &resp.json()["error"];
        assert_eq!(err["type"], "operator_endpoint_closed", "{path}: {err}");
        let msg = err["message"].as_str().unwrap_or_default();
        assert!(
            msg.contains("operator endpoint") && msg.contains("proxy.passthrough"),
            "{path}: says why and which key opens it: {msg}"
        );
    }
    assert_eq!(w.count(), 0, "no operator endpoint reached the worker");
    // The rest of `/v1/` is still open.
    let resp = send(
        router.addr,
        &Req::post("/v1/embeddings", r#"{"input":"x"}"#),
    )
    .await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    router.shutdown().await;

    // Listing the exact path opens that endpoint (with the backend key), and only it.
    let router = start_router(&yaml_for(
        &[&w],
        &format!("{keyed}  passthrough: [/v1/, /v1/load_lora_adapter]\n"),
    ))
    .await;
    let before = w.count();
    let resp = send(router.addr, &Req::post("/v1/load_lora_adapter", lora)).await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    let rec = w.requests().pop().unwrap();
    assert_eq!(
        (rec.target.as_str(), w.count()),
        ("/v1/load_lora_adapter", before + 1)
    );
    assert_eq!(rec.header_all("authorization"), ["Bearer backend-key-1"]);
    let resp = send(router.addr, &Req::post("/v1/unload_lora_adapter", lora)).await;
    assert_eq!(resp.status, 404, "{}", resp.text());
    assert_eq!(w.count(), before + 1);
    router.shutdown().await;
}

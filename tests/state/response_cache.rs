//! The response cache as a client sees it, against the in-process store and a real
//! `redis-server` (tests/support/redis.rs starts one per test): miss then hit for JSON
//! and SSE (replayed byte for byte, event by event), `Cache-Control`, TTL, tenants,
//! answers that must never be stored, semantic partitions and threshold (embeddings
//! from a stand-in whose similarities are plain to see), Redis killed and back, and two router processes sharing
//! one Redis.

use std::time::Duration;

use support::redis::RedisServer;
use support::{client::*, config::*, engine::*, observe::*, wait::*, worker::*};

use crate::common::start_router;

/// A chat answer with a distinct id, so a replay is told from a fresh answer.
fn answer(id: &str) -> String {
    format!(
        r#"{{"id":"{id}","object":"chat.completion","choices":[{{"index":0,"message":{{"role":"assistant","content":"hello"}},"finish_reason":"stop"}}],"usage":{}}}"#,
        usage_json(10, 0)
    )
}

/// The SSE events of a streamed answer, `[DONE]` last.
fn stream_events(id: &str) -> Vec<String> {
    let mut ev: Vec<String> = (0..4).map(sse_event).collect();
    ev.insert(0, format!(r#"{{"id":"{id}","object":"chat.completion.chunk","choices":[{{"index":0,"delta":{{"role":"assistant"}}}}]}}"#));
    ev.push(r#"{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#.into());
    ev.push("[DONE]".into());
    ev
}

/// A worker that answers every request freshly: JSON or SSE as asked, the id naming
/// the request's arrival index.
async fn fresh_worker() -> FakeWorker {
    FakeWorker::start_with(|r| {
        let id = format!("fresh-{}", r.index);
        if r.body_str().contains(r#""stream":true"#) {
            Reply::sse(&stream_events(&id), Duration::ZERO)
        } else {
            Reply::json(200, &answer(&id))
        }
    })
    .await
}

/// Router YAML with the cache on (Redis when given), `extra` under `response_cache:`.
fn config(w: &FakeWorker, redis: Option<&RedisServer>, extra: &str) -> String {
    let mut rc = String::from("response_cache:\n  enabled: true\n");
    if let Some(r) = redis {
        rc.push_str(&format!("  redis_url: \"{}\"\n", r.url()));
    }
    for line in extra.lines() {
        rc.push_str("  ");
        rc.push_str(line);
        rc.push('\n');
    }
    yaml_for(&[w], &format!("health:\n  interval_secs: 3600\n{rc}"))
}

fn chat(prompt: &str, stream: bool) -> Req {
    Req::post("/v1/chat/completions", chat_body(prompt, stream))
        .header("content-type", "application/json")
}

async fn metric(addr: std::net::SocketAddr, name: &str, labels: &[(&str, &str)]) -> f64 {
    scrape(addr).await.get(name, labels).unwrap_or(0.0)
}

/// Waits until `n` answers were stored (the store runs in a task after the body ends).
async fn wait_stored(addr: std::net::SocketAddr, n: f64) {
    wait_until("answers stored", Duration::from_secs(5), || async {
        metric(
            addr,
            "cache_aware_router_response_cache_stores_total",
            &[("result", "stored")],
        )
        .await
            >= n
    })
    .await;
}

async fn miss_then_hit(redis: Option<&RedisServer>) {
    let w = fresh_worker().await;
    let router = start_router(&config(&w, redis, "")).await;
    let a = router.addr;

    // JSON: miss, then a hit with the worker's first answer, byte for byte.
    let first = send(a, &chat("what is a cat", false)).await;
    assert_eq!(first.status, 200, "{}", first.text());
    assert_eq!(first.header("x-cache"), Some("miss"));
    wait_stored(a, 1.0).await;
    let again = send(a, &chat("what is a cat", false)).await;
    assert_eq!(again.status, 200);
    assert_eq!(again.header("x-cache"), Some("hit"));
    assert_eq!(again.body, first.body, "the stored bytes, not a new answer");
    assert_eq!(again.header("content-type"), Some("application/json"));
    assert_eq!(w.count(), 1, "a hit never reaches a worker");
    assert!(again.has_header("x-request-id"));

    // The same question streamed is another entry: a miss, then a replayed stream.
    let s1 = send(a, &chat("what is a cat", true)).await;
    assert_eq!(s1.header("x-cache"), Some("miss"));
    assert!(s1.text().contains("fresh-1"), "{}", s1.text());
    wait_stored(a, 2.0).await;
    let s2 = send(a, &chat("what is a cat", true)).await;
    assert_eq!(s2.header("x-cache"), Some("hit"));
    assert_eq!(s2.header("content-type"), Some("text/event-stream"));
    assert_eq!(s2.text(), s1.text(), "replayed SSE is byte-identical");
    assert_eq!(
        s2.pieces.len(),
        stream_events("x").len(),
        "one piece per event: {:?}",
        s2.pieces
    );
    assert_eq!(w.count(), 2);

    let m = scrape(a).await;
    let hits = m.get(
        "cache_aware_router_response_cache_hits_total",
        &[("kind", "exact")],
    );
    assert_eq!(hits, Some(2.0));
    assert_eq!(
        m.get("cache_aware_router_response_cache_misses_total", &[]),
        Some(2.0)
    );
    assert_eq!(
        m.get(
            "cache_aware_router_requests_total",
            &[
                ("endpoint", "chat_completions"),
                ("worker", "cache"),
                ("status", "200")
            ]
        ),
        Some(2.0)
    );
    // A hit skips the routing decision.
    let decisions: f64 = m
        .all("cache_aware_router_routing_decisions_total")
        .iter()
        .map(|s| s.value)
        .sum();
    assert_eq!(decisions, 2.0, "only the two misses were routed");
    let view = &get_workers(a).await["response_cache"];
    assert_eq!(
        view["store"],
        if redis.is_some() { "redis" } else { "memory" }
    );
    if redis.is_none() {
        assert_eq!(view["entries"], 2);
        let held = m
            .get("cache_aware_router_response_cache_bytes", &[])
            .unwrap_or(0.0);
        assert!(held > first.body.len() as f64, "bytes held: {held}");
        assert_eq!(
            m.get("cache_aware_router_response_cache_entries", &[]),
            Some(2.0)
        );
    }
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn miss_then_hit_in_process() {
    miss_then_hit(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn miss_then_hit_on_redis() {
    let redis = RedisServer::start();
    miss_then_hit(Some(&redis)).await;
    assert_eq!(
        redis.keys("cache-aware-router:rc:v1:e:*").len(),
        2,
        "entries live in Redis under the namespace"
    );
}

async fn control_ttl_and_tenants(redis: Option<&RedisServer>) {
    let w = fresh_worker().await;
    let router = start_router(&config(&w, redis, "ttl_secs: 1")).await;
    let a = router.addr;

    // no-store: neither looked up nor stored.
    let r = send(a, &chat("q1", false).header("cache-control", "no-store")).await;
    assert_eq!(r.header("x-cache"), Some("bypass"));
    let r = send(a, &chat("q1", false)).await;
    assert_eq!(
        r.header("x-cache"),
        Some("miss"),
        "no-store left nothing behind"
    );
    wait_stored(a, 1.0).await;
    // no-cache: not looked up (a fresh answer), but stored for the next caller.
    let r = send(a, &chat("q1", false).header("cache-control", "no-cache")).await;
    assert_eq!(r.header("x-cache"), Some("bypass"));
    assert!(r.text().contains("fresh-2"), "{}", r.text());
    wait_stored(a, 2.0).await;
    let r = send(a, &chat("q1", false)).await;
    assert_eq!(r.header("x-cache"), Some("hit"));
    assert!(
        r.text().contains("fresh-2"),
        "the no-cache answer replaced the old one"
    );

    // Tenants: the same body under two credentials never shares an entry.
    let alice = |p: &str| chat(p, false).header("authorization", "Bearer alice");
    let bob = |p: &str| chat(p, false).header("authorization", "Bearer bob");
    assert_eq!(send(a, &alice("t")).await.header("x-cache"), Some("miss"));
    wait_stored(a, 3.0).await;
    assert_eq!(send(a, &bob("t")).await.header("x-cache"), Some("miss"));
    assert_eq!(send(a, &alice("t")).await.header("x-cache"), Some("hit"));
    let anthropic_key = chat("t", false).header("x-api-key", "alice");
    assert_eq!(
        send(a, &anthropic_key).await.header("x-cache"),
        Some("miss")
    );

    // TTL: after ttl_secs (1 s, the store's own clock) the entry is gone; a hit
    // meanwhile does not extend it.
    wait_until("alice's entry expired", STEP_TIMEOUT, || async {
        send(a, &alice("t")).await.header("x-cache") == Some("miss")
    })
    .await;
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_ttl_and_tenants_in_process() {
    control_ttl_and_tenants(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_ttl_and_tenants_on_redis() {
    let redis = RedisServer::start();
    control_ttl_and_tenants(Some(&redis)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_cut_and_odd_answers_are_never_stored_in_process() {
    never_stored(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_cut_and_odd_answers_are_never_stored_on_redis() {
    let redis = RedisServer::start();
    never_stored(Some(&redis)).await;
    assert_eq!(
        redis.keys("cache-aware-router:rc:v1:e:*").len(),
        1,
        "only the control answer reached Redis"
    );
}

async fn never_stored(redis: Option<&RedisServer>) {
    // Each prompt names what the worker does with it.
    let w = FakeWorker::start_with(|r| {
        let body = r.body_str();
        if body.contains("server-error") {
            Reply::json(500, r#"{"error":{"message":"boom"}}"#)
        } else if body.contains("finish-error") {
            Reply::json(200, r#"{"id":"e","choices":[{"index":0,"finish_reason":"error","message":{"content":""}}]}"#)
        } else if body.contains("cut-stream") {
            // Two events, then the connection drops without [DONE] or the last chunk.
            Reply::raw(vec![Step::Write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n10\r\ndata: {\"a\":1}\n\n\r\n"
                    .to_vec(),
            )])
        } else if body.contains("no-done") {
            // A stream that ends cleanly but never said it was finished.
            Reply::sse(&[sse_event(0)], Duration::ZERO)
        } else if body.contains("aborted") {
            Reply::json(
                200,
                r#"{"id":"a","choices":[{"index":0,"finish_reason":"abort","message":{"content":""}}]}"#,
            )
        } else if body.contains("compressed") {
            Reply::json(200, &answer("z")).header("content-encoding", "gzip")
        } else if body.contains("plain-text") {
            Reply::status(200).header("content-type", "text/plain").body(b"hi".to_vec())
        } else {
            Reply::json(200, &answer(&format!("ok-{}", r.index)))
        }
    })
    .await;
    let router = start_router(&config(&w, redis, "")).await;
    let a = router.addr;
    // The cut stream's client gets the event sent before the cut, then the cut.
    let cut = async {
        let mut c = Conn::connect(a).await;
        c.send(&chat("cut-stream", true)).await.expect("send");
        let head = c.read_head().await;
        assert_eq!(head.header("x-cache"), Some("miss"));
        let mut got = Vec::new();
        let end = loop {
            match c.try_next_piece().await {
                Ok(Some(piece)) => got.extend_from_slice(&piece),
                Ok(None) => break "clean end",
                Err(_) => break "cut",
            }
        };
        assert_eq!(end, "cut", "a cut stream must not look complete");
        assert!(
            String::from_utf8_lossy(&got).contains(r#"data: {"a":1}"#),
            "the event sent before the cut reaches the client: {:?}",
            String::from_utf8_lossy(&got)
        );
    };
    cut.await;
    cut_again(a, &w).await;
    for (prompt, stream) in [
        ("server-error", false),
        ("finish-error", false),
        ("no-done", true),
        ("aborted", false),
        ("compressed", false),
        ("plain-text", false),
    ] {
        let _ = send(a, &chat(prompt, stream)).await;
        let before = w.count();
        let r = send(a, &chat(prompt, stream)).await;
        assert_eq!(
            r.header("x-cache"),
            Some("miss"),
            "{prompt} must not be stored"
        );
        assert_eq!(w.count(), before + 1, "{prompt}: the worker answered again");
    }
    let m = scrape(a).await;
    let stored = m.get(
        "cache_aware_router_response_cache_stores_total",
        &[("result", "stored")],
    );
    assert_eq!(stored, Some(0.0));
    for result in ["failed", "incomplete", "not_cacheable"] {
        let n = m
            .get(
                "cache_aware_router_response_cache_stores_total",
                &[("result", result)],
            )
            .unwrap_or(0.0);
        assert!(n >= 2.0, "{result}: {n}");
    }
    // The control: a plain answer through the same router is stored.
    assert_eq!(
        send(a, &chat("fine", false)).await.header("x-cache"),
        Some("miss")
    );
    wait_stored(a, 1.0).await;
    assert_eq!(
        send(a, &chat("fine", false)).await.header("x-cache"),
        Some("hit")
    );
    router.shutdown().await;
}

/// The cut stream again: still a miss (nothing was stored), and the worker asked again.
async fn cut_again(a: std::net::SocketAddr, w: &FakeWorker) {
    let before = w.count();
    let mut c = Conn::connect(a).await;
    c.send(&chat("cut-stream", true)).await.expect("send");
    let head = c.read_head().await;
    assert_eq!(
        head.header("x-cache"),
        Some("miss"),
        "a cut stream is never stored"
    );
    while let Ok(Some(_)) = c.try_next_piece().await {}
    assert_eq!(w.count(), before + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bypasses_say_why() {
    let w = fresh_worker().await;
    let yaml = config(
        &w,
        None,
        "endpoints: [chat_completions]\nuncacheable_api_keys: [sk-eval-1]",
    );
    let router = start_router(&yaml).await;
    let a = router.addr;
    let n2 = Req::post(
        "/v1/chat/completions",
        r#"{"model":"m","n":2,"messages":[{"role":"user","content":"x"}]}"#,
    );
    let key = chat("x", false).header("authorization", "Bearer sk-eval-1");
    let completions = Req::post("/v1/completions", r#"{"model":"m","prompt":"x"}"#);
    let broken = Req::post("/v1/chat/completions", "{not json");
    let shouted = chat("x", false)
        .header("authorization", "Bearer someone-else")
        .header("authorization", "BEARER  sk-eval-1");
    let mut expected = std::collections::HashMap::new();
    let seed = Req::post(
        "/v1/chat/completions",
        r#"{"model":"m","seed":123456789012345678901234,"messages":[{"role":"user","content":"x"}]}"#,
    );
    for (req, cause) in [
        (&n2, "choices"),
        (&key, "api_key"),
        (&completions, "endpoint"),
        (&broken, "unreadable"),
        (&seed, "unreadable"),
        (&shouted, "api_key"),
    ] {
        *expected.entry(cause).or_insert(0.0) += 2.0;
        for _ in 0..2 {
            let r = send(a, req).await;
            assert_eq!(r.header("x-cache"), Some("bypass"), "{cause}");
        }
        let n = metric(
            a,
            "cache_aware_router_response_cache_bypasses_total",
            &[("cause", cause)],
        )
        .await;
        assert_eq!(n, expected[cause], "{cause}");
    }
    assert_eq!(w.count(), 12, "every bypass reached the worker");
    // Models and other paths carry the header too.
    let models = get(a, "/v1/models").await;
    assert_eq!(models.header("x-cache"), Some("bypass"));
    router.shutdown().await;
}

/// An embeddings endpoint (`POST /v1/embeddings`, OpenAI's shape) whose vector of a
/// text counts its words, lowercased, in 64 buckets: texts with the same words (up to
/// case and punctuation) embed equal, cosine 1; the unrelated questions below share
/// one word, cosine about 0.3.
async fn embedder() -> FakeWorker {
    FakeWorker::start_with(|r| {
        let input: serde_json::Value = serde_json::from_slice(&r.body).unwrap_or_default();
        let text = input["input"].as_str().unwrap_or_default().to_lowercase();
        let mut v = vec![0.0f32; 64];
        for word in text
            .split(|c: char| !c.is_alphanumeric())
            .filter(|w| !w.is_empty())
        {
            let h = word
                .bytes()
                .fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(b.into()));
            v[h as usize % 64] += 1.0;
        }
        let answer = serde_json::json!({
            "object": "list",
            "model": "embed",
            "data": [{"object": "embedding", "index": 0, "embedding": v}],
        });
        Reply::json(200, &answer.to_string())
    })
    .await
}

fn chat_with(system: &str, prompt: &str, extra: serde_json::Value) -> Req {
    let mut body = serde_json::json!({
        "model": "m",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": prompt},
        ],
    });
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    Req::post("/v1/chat/completions", body.to_string())
}

async fn semantic(redis: Option<&RedisServer>) {
    let emb = embedder().await;
    let w = fresh_worker().await;
    let extra = format!(
        "semantic:\n  embeddings_url: {}/v1/embeddings\n  model: embed\n  threshold: 0.92",
        emb.url()
    );
    let router = start_router(&config(&w, redis, &extra)).await;
    let a = router.addr;
    let q = "please tell me what the capital city of france is and why it became the capital";
    let near = "please tell me what the capital city of france is and why it became the capital?";
    let far = "write a python function that returns the fibonacci numbers below one thousand";
    let none = serde_json::json!({});

    let first = send(a, &chat_with("answer in German", q, none.clone())).await;
    assert_eq!(first.header("x-cache"), Some("miss"));
    wait_stored(a, 1.0).await;
    // The same question in other words (well above the threshold): replayed.
    let r = send(a, &chat_with("answer in German", near, none.clone())).await;
    assert_eq!(r.header("x-cache"), Some("hit"));
    assert_eq!(r.body, first.body);
    assert_eq!(
        metric(
            a,
            "cache_aware_router_response_cache_hits_total",
            &[("kind", "semantic")]
        )
        .await,
        1.0
    );
    // Below the threshold: a miss.
    let r = send(a, &chat_with("answer in German", far, none.clone())).await;
    assert_eq!(r.header("x-cache"), Some("miss"));
    // Same text, another partition: system prompt, temperature, tools, streaming.
    for (system, extra) in [
        ("answer in Japanese", none.clone()),
        ("answer in German", serde_json::json!({"temperature": 1.5})),
        (
            "answer in German",
            serde_json::json!({"tools": [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]}),
        ),
        ("answer in German", serde_json::json!({"stream": true})),
    ] {
        let r = send(a, &chat_with(system, near, extra.clone())).await;
        assert_eq!(r.header("x-cache"), Some("miss"), "{system} {extra}");
    }
    // Images bypass the semantic lookup before any embedding call.
    let embeds_before = emb.count();
    let image = Req::post(
        "/v1/chat/completions",
        serde_json::json!({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "text", "text": q},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]})
        .to_string(),
    );
    assert_eq!(send(a, &image).await.header("x-cache"), Some("miss"));
    assert_eq!(emb.count(), embeds_before);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn semantic_in_process() {
    semantic(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn semantic_on_redis() {
    let redis = RedisServer::start();
    semantic(Some(&redis)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_embeddings_endpoint_is_an_exact_miss() {
    let w = fresh_worker().await;
    let extra = format!(
        "semantic:\n  embeddings_url: {}/v1/embeddings\n  model: embed",
        closed_port_url()
    );
    let router = start_router(&config(&w, None, &extra)).await;
    let a = router.addr;
    let r = send(a, &chat("q", false)).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-cache"), Some("miss"));
    wait_stored(a, 1.0).await;
    assert_eq!(
        send(a, &chat("q", false)).await.header("x-cache"),
        Some("hit"),
        "exact still works"
    );
    let errors = metric(
        a,
        "cache_aware_router_response_cache_store_errors_total",
        &[("op", "embed")],
    )
    .await;
    assert!(errors >= 1.0, "{errors}");
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_then_back() {
    let mut redis = RedisServer::start();
    let w = fresh_worker().await;
    let router = start_router(&config(&w, Some(&redis), "")).await;
    let a = router.addr;
    assert_eq!(
        send(a, &chat("q", false)).await.header("x-cache"),
        Some("miss")
    );
    wait_stored(a, 1.0).await;
    assert_eq!(
        send(a, &chat("q", false)).await.header("x-cache"),
        Some("hit")
    );

    // Garbage under the key: a store error, never a 5xx; a miss whose answer heals it.
    let keys = redis.keys("cache-aware-router:rc:v1:e:*");
    assert_eq!(keys.len(), 1);
    redis.command(&["SET", &keys[0], "garbage"]).expect("SET");
    let r = send(a, &chat("q", false)).await;
    assert_eq!((r.status, r.header("x-cache")), (200, Some("miss")));
    wait_stored(a, 2.0).await;
    assert_eq!(
        send(a, &chat("q", false)).await.header("x-cache"),
        Some("hit")
    );
    // A key of another type (WRONGTYPE) is not an outage either.
    redis.command(&["DEL", &keys[0]]).expect("DEL");
    redis.command(&["LPUSH", &keys[0], "x"]).expect("LPUSH");
    let r = send(a, &chat("q", false)).await;
    assert_eq!((r.status, r.header("x-cache")), (200, Some("miss")));
    wait_stored(a, 3.0).await;

    redis.kill();
    for i in 0..10 {
        let r = send(a, &chat(&format!("down {i}"), false)).await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-cache"), Some("bypass"));
    }
    let m = scrape(a).await;
    let get_errors = m
        .get(
            "cache_aware_router_response_cache_store_errors_total",
            &[("op", "get")],
        )
        .unwrap_or(0.0);
    assert!(
        get_errors >= 2.0,
        "garbage and the outage counted: {get_errors}"
    );
    assert_eq!(
        m.get(
            "cache_aware_router_response_cache_bypasses_total",
            &[("cause", "store_error")]
        ),
        Some(1.0),
        "the first request of the outage"
    );
    let down = m
        .get(
            "cache_aware_router_response_cache_bypasses_total",
            &[("cause", "store_down")],
        )
        .unwrap_or(0.0);
    assert!(
        down >= 5.0,
        "requests skip a store that just failed: {down}"
    );

    redis.restart();
    // Hits resume: within the down window requests bypass, then miss, store, hit.
    wait_until(
        "a miss once Redis answers",
        Duration::from_secs(5),
        || async { send(a, &chat("back", false)).await.header("x-cache") == Some("miss") },
    )
    .await;
    wait_until(
        "a hit after Redis is back",
        Duration::from_secs(5),
        || async { send(a, &chat("back", false)).await.header("x-cache") == Some("hit") },
    )
    .await;
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_router_processes_share_one_redis() {
    let redis = RedisServer::start();
    let w = fresh_worker().await;
    let yaml = format!(
        "server: {{host: 127.0.0.1, port: 0}}\nlog: {{format: json}}\n{}",
        config(&w, Some(&redis), "")
    );
    let file = TempFile::new("shared.yaml", &yaml);
    let one = crate::BINARY.serve(&[&file.path]);
    let two = crate::BINARY.serve(&[&file.path]);
    let first = send(one.addr, &chat("shared question", false)).await;
    assert_eq!(first.header("x-cache"), Some("miss"), "{}", one.output());
    wait_until("stored in Redis", Duration::from_secs(5), || async {
        redis.keys("cache-aware-router:rc:v1:e:*").len() == 1
    })
    .await;
    let second = send(two.addr, &chat("shared question", false)).await;
    assert_eq!(second.header("x-cache"), Some("hit"), "{}", two.output());
    assert_eq!(second.body, first.body);
    assert_eq!(w.count(), 1);
}

/// The resident set of this test process (both routers run in it), in bytes.
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// One request of the frozen-Redis load: its latency and what came back.
struct Sent {
    /// When it was sent, from the freeze.
    at: Duration,
    took: Duration,
    status: u16,
    cache: Option<String>,
}

// C51
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_redis_costs_about_one_request_a_second_and_hits_resume_with_their_own_bodies() {
    const FREEZE: Duration = Duration::from_secs(3);
    const SLOW: Duration = Duration::from_millis(200);
    let redis = RedisServer::start();
    // Every answer carries a fresh serial and echoes the request's prompt (its tag).
    let answer = |r: &Recorded| {
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap_or_default();
        let tag = v["messages"][0]["content"]
            .as_str()
            .unwrap_or("")
            .to_string();
        let body = serde_json::json!({"id": format!("serial-{}", r.index),
            "object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop",
            "message": {"role": "assistant", "content": tag}}]});
        Reply::json(200, &body.to_string())
    };
    let w0 = FakeWorker::start_with(answer).await;
    let w1 = FakeWorker::start_with(answer).await;
    let shared = format!(
        "health:\n  interval_secs: 3600\nresponse_cache:\n  enabled: true\n  redis_url: \"{0}\"\nstate:\n  redis_url: \"{0}\"\n",
        redis.url()
    );
    // R2 knows only w1, so every prefix it learns is w1's; R1 knows both.
    let r1 = start_router(&yaml_for(&[&w0, &w1], &shared)).await;
    let r2 = start_router(&yaml_for(&[&w1], &shared)).await;
    for r in [r1.addr, r2.addr] {
        wait_until("subscribed", Duration::from_secs(5), || async {
            get_workers(r).await["fleet"]["connected"] == true
        })
        .await;
    }

    // 1. Warm: ten answers stored through R1.
    let warm: Vec<String> = (0..10).map(|k| format!("warm question {k}")).collect();
    let mut stored = Vec::new();
    for q in &warm {
        let r = send(r1.addr, &chat(q, false)).await;
        assert_eq!((r.status, r.header("x-cache")), (200, Some("miss")));
        stored.push(r.body);
    }
    wait_stored(r1.addr, warm.len() as f64).await;
    let before = scrape(r1.addr).await;
    let rss_before = rss_bytes();

    // 2. Freeze. Four clients send 20 requests a second to R1, half repeats, half new;
    //    an observer reads /health, /workers and /metrics every 250 ms.
    let frozen = redis.freeze();
    let frozen_at = std::time::Instant::now();
    let clients = (0..4).map(|c| {
        let (addr, warm) = (r1.addr, warm.clone());
        tokio::spawn(async move {
            let mut sent = Vec::new();
            tokio::time::sleep(Duration::from_millis(50 * c as u64)).await;
            let mut tick = tokio::time::interval(Duration::from_millis(200));
            let mut i = 0usize;
            while frozen_at.elapsed() < FREEZE {
                tick.tick().await;
                i += 1;
                let q = if i.is_multiple_of(2) {
                    warm[(c * 7 + i) % warm.len()].clone()
                } else {
                    format!("new question {c}.{i}")
                };
                let t = std::time::Instant::now();
                let r = send(addr, &chat(&q, false)).await;
                sent.push(Sent {
                    at: t - frozen_at,
                    took: t.elapsed(),
                    status: r.status,
                    cache: r.header("x-cache").map(str::to_string),
                });
            }
            sent
        })
    });
    let clients: Vec<_> = clients.collect();
    let mut admin_slowest = Duration::ZERO;
    while frozen_at.elapsed() < FREEZE {
        for path in ["/health", "/workers", "/metrics"] {
            let t = std::time::Instant::now();
            let r = get(r1.addr, path).await;
            admin_slowest = admin_slowest.max(t.elapsed());
            assert_eq!(r.status, 200, "{path}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let mut sent = Vec::new();
    for c in clients {
        sent.extend(c.await.expect("client"));
    }
    let during = scrape(r1.addr).await;
    let rss_growth = rss_bytes().saturating_sub(rss_before);
    frozen.thaw();

    eprintln!(
        "{} requests, {} over {SLOW:?}; admin endpoints up to {admin_slowest:?}; RSS +{} KiB",
        sent.len(),
        sent.iter().filter(|s| s.took > SLOW).count(),
        rss_growth >> 10
    );
    assert!(sent.len() >= 40, "{} requests", sent.len());
    assert!(sent.iter().all(|s| s.status == 200), "no request fails");
    // At the onset, the calls out when Redis froze and those that joined them before
    // it was seen to hang (100 ms without an answer, two requests at this rate) wait.
    // After that, one probe per second of the down window: not every request that
    // arrives meanwhile (five in each probe's 250 ms at this rate).
    let onset = Duration::from_millis(500);
    let slow = |from: Duration, to: Duration| -> Vec<(Duration, Duration)> {
        sent.iter()
            .filter(|s| s.took > SLOW && s.at >= from && s.at < to)
            .map(|s| (s.at, s.took))
            .collect()
    };
    let first = slow(Duration::ZERO, onset);
    assert!(first.len() <= 4, "at the onset: {first:?}");
    let later = slow(onset, FREEZE);
    assert!(
        later.len() <= FREEZE.as_secs() as usize,
        "{} requests after the onset waited on Redis: {later:?}",
        later.len()
    );
    let bypassed = sent.iter().filter(|s| s.cache.as_deref() == Some("bypass"));
    assert!(bypassed.count() >= sent.len() / 2, "the rest skip Redis");
    let grew = |name: &str, labels: &[(&str, &str)]| {
        during.value(name, labels) - before.value(name, labels)
    };
    assert!(
        grew(
            "cache_aware_router_response_cache_bypasses_total",
            &[("cause", "store_down")]
        ) >= 10.0,
        "{}",
        during.text
    );
    let fleet_errors: f64 = during
        .all("cache_aware_router_fleet_errors_total")
        .iter()
        .map(|s| s.value)
        .sum();
    assert!(fleet_errors >= 1.0, "fleet errors counted: {fleet_errors}");
    // They read no Redis: one that waited on it would take the freeze (3 s) or a Redis
    // call's bound (250 ms at least); 200 ms leaves room for a busy machine's scheduling
    // (134 ms seen with the suite beside four compiles).
    assert!(
        admin_slowest < Duration::from_millis(200),
        "/health, /workers, /metrics took up to {admin_slowest:?}"
    );
    assert!(rss_growth < 20 << 20, "RSS grew by {rss_growth} bytes");

    // 3. Thawed: within about 2 s repeats are hits again, each with its own stored body.
    let thawed = std::time::Instant::now();
    let mut k = 0;
    loop {
        let r = send(r1.addr, &chat(&warm[k % warm.len()], false)).await;
        assert_eq!(r.status, 200);
        if r.header("x-cache") == Some("hit") {
            assert_eq!(
                r.body,
                stored[k % warm.len()],
                "a hit replays its own answer"
            );
            break;
        }
        assert!(
            thawed.elapsed() < Duration::from_secs(3),
            "no hit within 3 s of the thaw"
        );
        k += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("first hit {:?} after the thaw", thawed.elapsed());
    for (q, body) in warm.iter().zip(&stored) {
        let r = send(r1.addr, &chat(q, false)).await;
        assert_eq!(r.header("x-cache"), Some("hit"), "{q}");
        assert_eq!(&r.body, body, "{q}: its own tag and stored serial");
    }
    // A prefix learned through R2 after the thaw is followed by R1 within about 1 s.
    let system = "rule: be precise and cite the manual. ".repeat(60);
    let ask = |q: &str| {
        Req::post(
            "/v1/chat/completions",
            serde_json::json!({"model": "m", "messages": [
                {"role": "system", "content": system}, {"role": "user", "content": q}]})
            .to_string(),
        )
        .header("cache-control", "no-store")
    };
    let records = |m: serde_json::Value| m["fleet"]["remote_records"].as_u64().unwrap_or(0);
    let held = records(get_workers(r1.addr).await);
    assert_eq!(send(r2.addr, &ask("first")).await.status, 200);
    let learned = std::time::Instant::now();
    wait_until("R1 applied R2's record", Duration::from_secs(2), || async {
        records(get_workers(r1.addr).await) > held
    })
    .await;
    assert!(learned.elapsed() < Duration::from_millis(1500));
    let (r, by) = send_tagged(r1.addr, &[&w0, &w1], ask("second")).await;
    assert_eq!(
        (r.status, by),
        (200, 1),
        "R1 follows the prefix R2 served on w1"
    );
    r1.shutdown().await;
    r2.shutdown().await;
}

// C51: a connection whose call timed out is never used again, so a reply still queued
// on it when Redis thaws cannot answer a later call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_call_that_timed_out_takes_its_connection_with_it() {
    use cache_aware_router::redis_link::{LinkError, Query, RedisLink};
    let redis = RedisServer::start();
    redis.command(&["SET", "k1", "one"]).expect("SET");
    redis.command(&["SET", "k2", "two"]).expect("SET");
    let client = ::redis::Client::open(redis.url()).expect("client");
    let link = RedisLink::new(client, Duration::from_millis(200));
    let get = |k: &str| {
        let mut c = ::redis::cmd("GET");
        c.arg(k);
        Query::Cmd(c)
    };
    let id = || Query::Cmd(::redis::cmd("CLIENT").arg("ID").clone());
    let first: i64 = link.query(&id()).await.expect("CLIENT ID");
    assert_eq!(link.query::<i64>(&id()).await.unwrap(), first, "kept");

    let frozen = redis.freeze();
    let t = std::time::Instant::now();
    let r = link.query::<String>(&get("k1")).await;
    assert!(matches!(r, Err(LinkError::Timeout(_))), "{r:?}");
    assert!(
        t.elapsed() < Duration::from_millis(400),
        "{:?}",
        t.elapsed()
    );
    frozen.thaw();

    // GET k1 is still queued on the old connection: k2's call must get k2's value.
    assert_eq!(link.query::<String>(&get("k2")).await.unwrap(), "two");
    let now: i64 = link.query(&id()).await.expect("CLIENT ID");
    assert_ne!(now, first, "a fresh connection after the timeout");
}

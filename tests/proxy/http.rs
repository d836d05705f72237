//! HTTP mechanics of the proxy path: hop-by-hop headers, connection reuse, framing,
//! worker URLs (IPv6, path prefixes), request ids.

use std::time::Duration;

use tokio::io::AsyncWriteExt;

use support::ws;
use support::{client::*, config::*, engine::*, observe::*, wait::*, worker::*};

use crate::common::start_router;

const HOP_BY_HOP: [&str; 7] = [
    "connection",
    "keep-alive",
    "te",
    "upgrade",
    "proxy-authorization",
    "proxy-authenticate",
    "transfer-encoding",
];

// C24
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hop_by_hop_headers_are_stripped_both_ways() {
    let w = FakeWorker::start_with(|_| {
        Reply::ok()
            .header("Connection", "close, X-Hop-Reply")
            .header("X-Hop-Reply", "1")
            .header("Keep-Alive", "timeout=1")
            .header("Proxy-Authenticate", "Basic")
            .header("X-End-To-End", "kept")
            .close()
    })
    .await;
    let router = start_router(&yaml_for(&[&w], "")).await;
    let req = Req::post("/v1/chat/completions", chat_body("hop", false))
        .header("Connection", "keep-alive, X-Trace-Hop")
        .header("X-Trace-Hop", "1")
        .header("Keep-Alive", "timeout=2")
        .header("TE", "trailers")
        .header("Upgrade", "websocket")
        .header("Proxy-Authorization", "Basic dGVzdDp0ZXN0")
        .header("X-Request-Id", "qa-hop-1")
        // The router's own header (precise mode): long prompts' ids would pass the
        // engine's header size limit.
        .header("X-Token-Ids", "1,2,3");
    let resp = send(router.addr, &req).await;
    assert_eq!(resp.status, 200, "{}", resp.text());

    let rec = &w.requests()[0];
    for name in HOP_BY_HOP.iter().chain(&["x-trace-hop", "x-token-ids"]) {
        assert!(
            !rec.has_header(name),
            "`{name}` must not reach the worker: {:?}",
            rec.headers
        );
    }
    assert_eq!(rec.header("x-request-id"), Some("qa-hop-1"));
    assert_eq!(rec.header("content-type"), Some("application/json"));
    assert_eq!(rec.header_all("host"), [w.addr().to_string()]);

    assert_eq!(resp.header("x-end-to-end"), Some("kept"));
    for name in ["keep-alive", "proxy-authenticate", "x-hop-reply"] {
        assert!(
            !resp.has_header(name),
            "the worker's `{name}` must not reach the client: {:?}",
            resp.headers
        );
    }
    // The client asked for keep-alive: whatever the worker's connection did, the
    // client's connection has no reason to be closed.
    assert!(
        resp.header_all("connection")
            .iter()
            .all(|v| !v.eq_ignore_ascii_case("close")),
        "the worker's `Connection: close` leaked to the client: {:?}",
        resp.headers
    );
    router.shutdown().await;
}

// C24, second half
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_connection_close_does_not_close_the_upstream_connection() {
    let w = FakeWorker::start().await;
    // Its models pinned: the router reads no model list, so every upstream connection
    // the worker counts is a request's.
    let yaml = format!("workers:\n  - url: {}\n    models: [m]\n", w.url());
    let router = start_router(&yaml).await;
    // The startup health probe shares the pool: let it be done first, or a probe still
    // holding a connection when a request comes makes that request open another.
    wait_until("the startup health probe", STEP_TIMEOUT, || async {
        !w.probes().is_empty()
    })
    .await;
    // Each request after the first shows that the one before left its upstream
    // connection open: it is served on a pooled one.
    let mut conns_before_second = 0;
    for i in 0..4 {
        if i == 1 {
            conns_before_second = w.connections();
        }
        let mut conn = Conn::connect(router.addr).await;
        let resp = conn
            .request(
                &Req::post("/v1/chat/completions", chat_body("reuse me", false))
                    .header("Connection", "close"),
            )
            .await;
        assert_eq!(resp.status, 200);
        assert!(
            conn.is_closed_by_peer(Duration::from_secs(1)).await,
            "request {i}: the router closes the client's connection as asked"
        );
        let upstream = w.requests().pop().unwrap();
        assert!(!upstream.has_header("connection"), "{:?}", upstream.headers);
        assert!(
            w.is_open(upstream.conn),
            "request {i}: the upstream connection must stay open for reuse"
        );
    }
    assert_eq!(
        w.connections(),
        conns_before_second,
        "the requests after the first reuse a pooled upstream connection"
    );
    router.shutdown().await;
}

// C25 (a)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_error_json_with_content_length_reaches_the_client_complete() {
    const ERR: &str = r#"{"error":{"message":"unsupported field: effort","code":400}}"#;
    assert_eq!(ERR.len(), 60);
    let w = FakeWorker::start_with(|_| Reply::json(400, ERR)).await;
    let router = start_router(&yaml_for(&[&w], "")).await;
    let resp = post(router.addr, "/v1/chat/completions", chat_body("x", true)).await;
    assert_eq!(resp.status, 400);
    assert_eq!(resp.text(), ERR);
    if let Some(cl) = resp.header("content-length") {
        assert_eq!(cl, "60");
    }
    assert!(
        !(resp.has_header("content-length") && resp.has_header("transfer-encoding")),
        "{:?}",
        resp.headers
    );
    router.shutdown().await;
}

// C25 (b)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_reply_with_both_content_length_and_chunked_never_reaches_the_client_with_both() {
    let events = format!("data: {}\n\ndata: [DONE]\n\n", sse_event(0));
    let mut raw = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: 10\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
    raw.extend_from_slice(format!("{:x}\r\n{events}\r\n0\r\n\r\n", events.len()).as_bytes());
    let w = FakeWorker::start_with(move |_| Reply::raw(vec![Step::Write(raw.clone())])).await;
    let router = start_router(&yaml_for(&[&w], "")).await;
    let mut conn = Conn::connect(router.addr).await;
    conn.send(&Req::post("/v1/chat/completions", chat_body("x", true)))
        .await
        .unwrap();
    let head = conn.read_head().await;
    assert!(
        !(head.has_header("content-length") && head.has_header("transfer-encoding")),
        "the client got both framings: {:?}",
        head.headers
    );
    match head.status {
        200 => {
            let mut body = Vec::new();
            while let Some(p) = conn.next_piece().await {
                body.extend_from_slice(&p);
            }
            assert_eq!(
                String::from_utf8_lossy(&body),
                events,
                "the whole chunked body"
            );
        }
        502 => {}
        s => panic!("expected the body or a 502, got {s}"),
    }
    router.shutdown().await;
}

// C25 (c)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_content_length_equals_the_bytes_sent() {
    let w = FakeWorker::start().await;
    let router = start_router(&yaml_for(&[&w], "")).await;
    let long = chat_body(&"é long prompt ".repeat(5000), false);
    let cases = [
        Req::post("/v1/chat/completions", chat_body("short", false)),
        Req::post("/v1/chat/completions", long.clone()),
        // Chunked from the client: the router knows the length once it has the body.
        Req::post("/v1/chat/completions", long.clone()).chunked(1000),
        Req::post("/v1/completions", r#"{"model":"m","prompt":"x"}"#).chunked(3),
        Req::new("PUT", "/v1/custom").body("abc"),
        Req::new("POST", "/v1/custom"),
    ];
    for (i, req) in cases.iter().enumerate() {
        let resp = send(router.addr, req).await;
        assert_eq!(resp.status, 200, "case {i}");
        let rec = w.requests().pop().unwrap();
        assert_eq!(rec.body, req.body, "case {i}: body forwarded unchanged");
        let lengths = rec.header_all("content-length");
        if rec.chunked {
            assert!(
                lengths.is_empty(),
                "case {i}: chunked with a length: {:?}",
                rec.headers
            );
        } else if !req.body.is_empty() {
            assert_eq!(
                lengths,
                [req.body.len().to_string()],
                "case {i}: one Content-Length equal to the bytes sent"
            );
        } else {
            assert!(
                lengths.is_empty() || lengths == ["0"],
                "case {i}: {:?}",
                rec.headers
            );
        }
    }
    router.shutdown().await;
}

// C27
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_urls_keep_ipv6_brackets_and_path_prefixes() {
    let a = FakeWorker::start().await;
    let c = FakeWorker::builder().ipv6().start().await;
    let d = FakeWorker::builder().ipv6().start().await;
    let e = FakeWorker::start().await;
    let (pa, pc, pd, pe) = (a.port(), c.port(), d.port(), e.port());
    let urls = [
        format!("http://127.0.0.1:{pa}/"),
        format!("http://127.0.0.1:{pa}"),
        format!("http://[::1]:{pc}"),
        format!("http://[::1]:{pd}/"),
        format!("http://127.0.0.1:{pe}/gpu5"),
    ];
    let router = start_router(&yaml_for_urls(&urls, "policy: round_robin")).await;

    let listed: Vec<String> = get_workers(router.addr).await["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["url"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        listed,
        [
            format!("http://127.0.0.1:{pa}"),
            format!("http://[::1]:{pc}"),
            format!("http://[::1]:{pd}"),
            format!("http://127.0.0.1:{pe}/gpu5"),
        ],
        "normalised, the duplicate counted once"
    );

    for i in 0..8 {
        let resp = post(
            router.addr,
            "/v1/chat/completions?trace=1",
            chat_body(&format!("question {i}"), false),
        )
        .await;
        assert_eq!(resp.status, 200, "{}", resp.text());
    }
    for (w, target, host) in [
        (
            &a,
            "/v1/chat/completions?trace=1",
            format!("127.0.0.1:{pa}"),
        ),
        (&c, "/v1/chat/completions?trace=1", format!("[::1]:{pc}")),
        (&d, "/v1/chat/completions?trace=1", format!("[::1]:{pd}")),
        (
            &e,
            "/gpu5/v1/chat/completions?trace=1",
            format!("127.0.0.1:{pe}"),
        ),
    ] {
        let reqs = w.requests();
        assert_eq!(reqs.len(), 2, "round robin over four workers: {}", w.url());
        for r in reqs {
            assert_eq!(r.target, target);
            assert_eq!(r.header_all("host"), [host.as_str()]);
        }
    }
    // Health probes go below each worker's path prefix.
    for (w, path) in [
        (&a, "/health"),
        (&c, "/health"),
        (&d, "/health"),
        (&e, "/gpu5/health"),
    ] {
        wait_until("a health probe", STEP_TIMEOUT, || async {
            !w.probes().is_empty()
        })
        .await;
        assert!(w.probes().iter().all(|p| p.target == path), "{}", w.url());
    }
    router.shutdown().await;
}

// C28 (a), (b)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_id_is_kept_or_generated_and_sent_both_ways() {
    let w = FakeWorker::start().await;
    let router = start_router(&yaml_for(&[&w], "")).await;

    let resp = send(
        router.addr,
        &Req::post("/v1/chat/completions", chat_body("a", false))
            .header("X-Request-Id", "qa-req-0001"),
    )
    .await;
    assert_eq!(resp.header_all("x-request-id"), ["qa-req-0001"]);
    assert_eq!(w.requests()[0].header_all("x-request-id"), ["qa-req-0001"]);

    let mut ids = Vec::new();
    for _ in 0..2 {
        let resp = chat(router.addr, "b").await;
        let upstream = w.requests().pop().unwrap();
        let sent = upstream.header_all("x-request-id");
        assert_eq!(
            sent.len(),
            1,
            "one generated id upstream: {:?}",
            upstream.headers
        );
        assert!(!sent[0].is_empty());
        assert_eq!(
            resp.header_all("x-request-id"),
            sent,
            "the client gets the same id"
        );
        ids.push(sent[0].to_string());
    }
    assert_ne!(ids[0], ids[1], "each request gets its own id");
    router.shutdown().await;
}

// C28 (c)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_on_another_worker_carries_the_same_request_id() {
    // round_robin starts with the first worker: the refused port.
    let b = FakeWorker::start().await;
    let urls = [closed_port_url(), b.url()];
    let router = start_router(&yaml_for_urls(&urls, "policy: round_robin")).await;
    let resp = chat(router.addr, "c").await;
    assert_eq!(
        resp.status,
        200,
        "retried on the live worker: {}",
        resp.text()
    );
    let id = b.requests()[0].header("x-request-id").unwrap().to_string();
    assert_eq!(resp.header("x-request-id"), Some(id.as_str()));
    router.shutdown().await;

    // A worker answering a retryable status: both attempts are visible.
    let a = FakeWorker::start_with(|_| Reply::json(503, r#"{"error":"busy"}"#)).await;
    let b = FakeWorker::start().await;
    let router = start_router(&yaml_for(&[&a, &b], "policy: round_robin")).await;
    for req in [
        Req::post("/v1/chat/completions", chat_body("c", false)),
        Req::post("/v1/chat/completions", chat_body("c", false))
            .header("X-Request-Id", "qa-retry-7"),
    ] {
        let resp = send(router.addr, &req).await;
        assert_eq!(resp.status, 200, "{}", resp.text());
        let id = resp.header("x-request-id").unwrap().to_string();
        let attempts: Vec<String> = a
            .requests()
            .into_iter()
            .chain(b.requests())
            .filter_map(|r| r.header("x-request-id").map(str::to_string))
            .filter(|r| *r == id)
            .collect();
        assert_eq!(
            attempts.len(),
            2,
            "both attempts carry the client's id {id}"
        );
        if req.headers.iter().any(|(k, _)| k == "X-Request-Id") {
            assert_eq!(id, "qa-retry-7");
        }
    }
    router.shutdown().await;
}

// C28 (d)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_or_malformed_request_ids_are_replaced() {
    let w = FakeWorker::start().await;
    let router = start_router(&yaml_for(&[&w], "")).await;
    let huge = "a".repeat(10 * 1024);
    for bad in [huge.as_str(), "qa\tid", "qa id"] {
        let resp = send(
            router.addr,
            &Req::post("/v1/chat/completions", chat_body("d", false)).header("X-Request-Id", bad),
        )
        .await;
        assert_eq!(resp.status, 200);
        let upstream = w.requests().pop().unwrap();
        let sent = upstream.header_all("x-request-id");
        assert_eq!(sent.len(), 1);
        let sent = sent[0];
        assert_ne!(sent, bad, "never forwarded as-is");
        assert!(
            !sent.is_empty() && sent.len() <= 128 && sent.bytes().all(|b| b.is_ascii_graphic()),
            "replacement {sent:?} is a short visible id"
        );
        assert_eq!(resp.header("x-request-id"), Some(sent));
    }
    router.shutdown().await;
}

// C23
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_api_key_replaces_the_clients_key_on_requests_and_health_probes() {
    let a = FakeWorker::builder()
        .require_bearer("backend-key-1")
        .serving(&["m"])
        .start()
        .await;
    let b = FakeWorker::builder()
        .require_bearer("worker-key-2")
        .serving(&["m"])
        .start()
        .await;
    let yaml = format!(
        "policy: round_robin\nproxy:\n  api_key: backend-key-1\nhealth:\n  interval_secs: 0.05\nworkers:\n  - url: {}\n  - url: {}\n    api_key: worker-key-2\n",
        a.url(),
        b.url()
    );
    let router = start_router(&yaml).await;
    for _ in 0..2 {
        let resp = send(
            router.addr,
            &Req::post("/v1/chat/completions", chat_body("auth", false))
                .header("Authorization", "Bearer client-key-9"),
        )
        .await;
        assert_eq!(resp.status, 200, "{}", resp.text());
    }
    let resp = send(
        router.addr,
        &Req::get("/v1/models").header("Authorization", "Bearer client-key-9"),
    )
    .await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    for (w, key) in [(&a, "Bearer backend-key-1"), (&b, "Bearer worker-key-2")] {
        let reqs = w.requests();
        assert!(!reqs.is_empty());
        for r in reqs {
            assert_eq!(
                r.header_all("authorization"),
                [key],
                "{} {}",
                r.method,
                r.target
            );
        }
    }
    // Probes and model-list reads carry the key too: the workers stay healthy through
    // several intervals, and their lists are read.
    wait_until("health probes", Duration::from_secs(2), || async {
        a.probes().len() >= 4 && b.probes().len() >= 4
    })
    .await;
    for w in [&a, &b] {
        assert!(
            w.probes().iter().all(|p| p.authorized),
            "{:?}",
            w.probes()[0].headers
        );
        assert!(
            !w.model_reads().is_empty() && w.model_reads().iter().all(|p| p.authorized),
            "{:?}",
            w.model_reads()
        );
    }
    let workers = get(router.addr, "/workers").await;
    assert!(
        workers.json()["workers"]
            .as_array()
            .unwrap()
            .iter()
            .all(|w| w["healthy"] == true),
        "{}",
        workers.text()
    );
    for secret in ["backend-key-1", "worker-key-2"] {
        assert!(
            !workers.text().contains(secret),
            "/workers shows a key: {}",
            workers.text()
        );
    }
    router.shutdown().await;
}

// C15
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_closing_idle_connections_never_fails_a_request() {
    // The worker drops idle keep-alive connections after 40 ms (uvicorn: 5 s), well
    // before the router's pool would; requests come just before, at and after that.
    let w = FakeWorker::builder()
        .idle_close(Duration::from_millis(40))
        .start()
        .await;
    let router = start_router(&yaml_for(&[&w], "")).await;
    let pauses = [36u64, 38, 40, 42, 44, 39, 41, 43, 37, 45, 40, 40];
    for (i, pause) in pauses.iter().enumerate() {
        let resp = chat(router.addr, &format!("turn {i}")).await;
        assert_eq!(resp.status, 200, "turn {i}: {}", resp.text());
        tokio::time::sleep(Duration::from_millis(*pause)).await;
    }
    let reqs = w.requests();
    assert_eq!(reqs.len(), pauses.len(), "each turn processed exactly once");
    for (i, r) in reqs.iter().enumerate() {
        assert!(
            r.body_str().contains(&format!("turn {i}\"")),
            "turn {i} out of order"
        );
    }
    assert!(w.connections() > 1, "the worker did close idle connections");
    router.shutdown().await;
}

// C15, the race itself
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_on_a_connection_the_worker_just_closed_is_resent_once() {
    // Every request that reuses a connection idle for 30 ms or more finds it closed by
    // the worker before any answer: the router cannot see it coming.
    let w = FakeWorker::builder()
        .stale_after(Duration::from_millis(30))
        .start()
        .await;
    // The resend's connection is not pooled, so the stale race comes back every other
    // turn: at least half the turns exercise it.
    turns_after_idle_each_processed_once(&w, 6, 3).await;
}

/// C15: `turns` requests, each after 50 ms idle (past the worker's 30 ms), must each
/// reach the worker exactly once and answer 200; at least `min_stale` of them met a
/// connection the worker had already closed or reset.
async fn turns_after_idle_each_processed_once(w: &FakeWorker, turns: usize, min_stale: u64) {
    let router = start_router(&yaml_for(&[w], "")).await;
    // Let the start-up health probe finish, so that one idle connection is pooled.
    wait_until("the first health probe", STEP_TIMEOUT, || async {
        !w.probes().is_empty()
    })
    .await;
    for i in 0..turns {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let resp = chat(router.addr, &format!("turn {i}")).await;
        assert_eq!(resp.status, 200, "turn {i}: {}", resp.text());
    }
    assert_eq!(
        w.requests().len(),
        turns,
        "each turn processed exactly once"
    );
    assert!(
        w.stale_hits() >= min_stale,
        "turns that met a stale connection: {}",
        w.stale_hits()
    );
    router.shutdown().await;
}

// C15, the same race when the worker's close turns into a TCP reset
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_on_a_connection_the_worker_just_reset_is_resent_once() {
    let w = FakeWorker::builder()
        .stale_after(Duration::from_millis(30))
        .reset_stale()
        .start()
        .await;
    // Every other turn (the resend's connection is not pooled).
    turns_after_idle_each_processed_once(&w, 3, 2).await;
}

// C15, several idle connections closed at once (uvicorn closes each after 5 s idle)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resend_after_a_stale_connection_does_not_pick_another_stale_one() {
    let w = FakeWorker::builder()
        .stale_after(Duration::from_millis(30))
        .reply(|req| {
            if req.body_str().contains("parallel") {
                // Busy for 40 ms, so that the three requests need three connections.
                Reply::ok().trickle(vec![
                    Step::Sleep(Duration::from_millis(40)),
                    Step::Write(OK_BODY.as_bytes().to_vec()),
                ])
            } else {
                Reply::ok()
            }
        })
        .start()
        .await;
    // A pool idle timeout longer than the worker's keep-alive: only the resend helps.
    let router = start_router(&yaml_for(&[&w], "proxy:\n  pool_idle_timeout_secs: 10\n")).await;
    let addr = router.addr;
    concurrent_chats(addr, "parallel", 3).await;
    // Now several idle connections are pooled, and the worker has closed them all.
    tokio::time::sleep(Duration::from_millis(60)).await;
    let resp = chat(addr, "next turn").await;
    assert_eq!(
        resp.status,
        200,
        "a request must not fail because every pooled connection went stale: {}",
        resp.text()
    );
    assert_eq!(
        w.requests()
            .iter()
            .filter(|r| r.body_str().contains("next turn"))
            .count(),
        1
    );
    router.shutdown().await;
}

// C15, the first defence
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_idle_timeout_below_the_workers_keep_alive_avoids_stale_connections() {
    // Scaled down from the defaults: the worker keeps idle connections 60 ms
    // (uvicorn: 5 s), the router's pool 30 ms (default 4 s).
    let w = FakeWorker::builder()
        .stale_after(Duration::from_millis(60))
        .start()
        .await;
    let router = start_router(&yaml_for(&[&w], "proxy:\n  pool_idle_timeout_secs: 0.03\n")).await;
    for i in 0..5 {
        tokio::time::sleep(Duration::from_millis(80)).await;
        let resp = chat(router.addr, &format!("turn {i}")).await;
        assert_eq!(resp.status, 200, "turn {i}: {}", resp.text());
    }
    assert_eq!(w.requests().len(), 5);
    assert_eq!(
        w.stale_hits(),
        0,
        "idle connections are dropped by the router before the worker closes them"
    );
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_and_requests_share_one_kept_connection_and_an_empty_answer_returns_it() {
    // 204s with no body, a JSON answer, then the health probe's connection (and the
    // model-list read's, made at the same moment): no new socket, each used one request
    // after another.
    let w = FakeWorker::builder()
        .reply(|req| {
            if req.body_str().contains("empty") {
                Reply::status(204)
            } else {
                Reply::ok()
            }
        })
        .start()
        .await;
    let router = start_router(&yaml_for(&[&w], "")).await;
    wait_until(
        "the first health probe and list read",
        STEP_TIMEOUT,
        || async { !w.probes().is_empty() && !w.model_reads().is_empty() },
    )
    .await;
    let background = w.connections();
    assert!(background <= 2, "{background}");
    for (i, text) in ["empty", "full", "empty", "empty", "full"]
        .iter()
        .enumerate()
    {
        let resp = chat(router.addr, &format!("{text} {i}")).await;
        assert_eq!(resp.status, if *text == "empty" { 204 } else { 200 });
    }
    assert_eq!(w.requests().len(), 5);
    assert_eq!(
        w.connections(),
        background,
        "the probe's connection carried every request after it"
    );
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_closes_after_every_answer_never_fails_a_request() {
    // Each answer ends its connection (an HTTP/1.0-style server, or one shedding
    // connections): a kept connection is never good for a second request, however soon.
    let w = FakeWorker::builder()
        .reply(|_| Reply::ok().close())
        .health(|_| Reply::json(200, r#"{"status":"ok"}"#).close())
        .start()
        .await;
    let router = start_router(&yaml_for(&[&w], "")).await;
    for i in 0..6 {
        let resp = chat(router.addr, &format!("turn {i}")).await;
        assert_eq!(resp.status, 200, "turn {i}: {}", resp.text());
    }
    concurrent_chats(router.addr, "together", 3).await;
    let reqs = w.requests();
    assert_eq!(reqs.len(), 9, "each request processed exactly once");
    for i in 0..6 {
        assert_eq!(
            reqs.iter()
                .filter(|r| r.body_str().contains(&format!("turn {i}\"")))
                .count(),
            1
        );
    }
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_are_closed_by_the_router_after_the_pool_idle_timeout() {
    // A burst opens several connections; once it is over they are closed within
    // about the pool's idle timeout, not left open on the worker.
    let w = FakeWorker::builder()
        .reply(|_| {
            Reply::ok().trickle(vec![
                Step::Sleep(Duration::from_millis(30)),
                Step::Write(OK_BODY.as_bytes().to_vec()),
            ])
        })
        .start()
        .await;
    let router = start_router(&yaml_for(&[&w], "proxy:\n  pool_idle_timeout_secs: 0.1\n")).await;
    let addr = router.addr;
    concurrent_chats(addr, "burst", 4).await;
    assert!(w.connections() >= 4, "the burst needed a connection each");
    wait_until(
        "every idle upstream connection closed",
        Duration::from_secs(2),
        || async { w.open_connections() == 0 },
    )
    .await;
    // And the next request opens a new one, without an error.
    let resp = chat(addr, "after").await;
    assert_eq!(resp.status, 200);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_pool_idle_timeout_keeps_no_connection() {
    let w = FakeWorker::start().await;
    let router = start_router(&yaml_for(&[&w], "proxy:\n  pool_idle_timeout_secs: 0\n")).await;
    wait_until("the first health probe", STEP_TIMEOUT, || async {
        !w.probes().is_empty()
    })
    .await;
    for i in 0..3 {
        let resp = chat(router.addr, &format!("turn {i}")).await;
        assert_eq!(resp.status, 200);
        wait_until(
            "the request's upstream connection closed after its answer",
            STEP_TIMEOUT,
            || async { w.open_connections() == 0 },
        )
        .await;
    }
    assert_eq!(w.requests().len(), 3);
    assert!(
        w.connections() >= 4,
        "a connection each for the probe and the three requests: {}",
        w.connections()
    );
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routed_peer_header_names_the_worker_when_enabled() {
    let w = FakeWorker::start().await;
    let router = start_router(&yaml_for(&[&w], "proxy:\n  add_routed_peer_header: true\n")).await;
    let resp = chat(router.addr, "who").await;
    assert_eq!(resp.header_all("x-routed-peer"), [w.url().as_str()]);
    router.shutdown().await;

    let router = start_router(&yaml_for(&[&w], "")).await;
    let resp = chat(router.addr, "who").await;
    assert!(!resp.has_header("x-routed-peer"), "off by default");
    router.shutdown().await;
}

/// A worker as vLLM serves `/v1/realtime` (FastAPI): a WebSocket echo for handshakes on
/// it (and on `GET /v1/responses`, Responses over WebSocket), 404 to a plain `GET`
/// there, as a FastAPI websocket route answers; a chat answer otherwise.
fn websocket_engine(r: &Recorded) -> Reply {
    let path = r.target.split('?').next().unwrap_or("");
    let handshake = r
        .header("upgrade")
        .is_some_and(|u| u.eq_ignore_ascii_case("websocket"));
    match (r.method.as_str(), path) {
        ("GET", "/v1/realtime" | "/v1/responses") if handshake => {
            let accept = ws::accept_key(r.header("sec-websocket-key").unwrap_or(""));
            Reply::raw(vec![
                Step::Write(
                    format!(
                        "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: {accept}\r\n\r\n"
                    )
                    .into_bytes(),
                ),
                Step::EchoWebSocket,
            ])
        }
        ("GET", "/v1/realtime" | "/v1/responses") => Reply::json(404, r#"{"detail":"Not Found"}"#),
        _ => Reply::ok(),
    }
}

// C53 (1), (2)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_handshakes_are_tunnelled_to_a_worker_and_counted_in_flight() {
    assert_eq!(
        ws::accept_key(ws::SAMPLE_KEY),
        "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
    );
    let w = FakeWorker::start_with(websocket_engine).await;
    let router = start_router(&yaml_for(&[&w], "")).await;
    for (i, path) in ["/v1/realtime?model=m", "/v1/responses"]
        .into_iter()
        .enumerate()
    {
        let (status, head, mut s) = tokio::time::timeout(
            Duration::from_secs(2),
            ws::handshake(router.addr, path, ws::SAMPLE_KEY),
        )
        .await
        .unwrap_or_else(|_| panic!("{path}: no handshake answer within 2 s"));
        assert_eq!(status, 101, "{path}: {head:?}");
        let header = |name: &str| {
            head.iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.as_str())
        };
        assert_eq!(
            header("sec-websocket-accept"),
            Some("s3pPLMBiTxaQ9kYGzzhZRbK+xOo="),
            "{path}: {head:?}"
        );
        assert!(header("upgrade").is_some_and(|u| u.eq_ignore_ascii_case("websocket")));
        // The worker got the handshake itself, not a plain GET.
        let rec = &w.requests()[i];
        assert_eq!((rec.method.as_str(), rec.target.as_str()), ("GET", path));
        assert!(
            rec.header("upgrade")
                .is_some_and(|u| u.eq_ignore_ascii_case("websocket"))
                && rec
                    .header("connection")
                    .is_some_and(|c| c.to_ascii_lowercase().contains("upgrade")),
            "{:?}",
            rec.headers
        );
        assert_eq!(rec.header("sec-websocket-key"), Some(ws::SAMPLE_KEY));
        assert_eq!(rec.header("sec-websocket-version"), Some("13"));
        assert_eq!(
            in_flight(router.addr).await,
            [1],
            "{path}: the open session"
        );

        for n in 0..3 {
            let text = format!("frame {n} on {path}");
            s.write_all(&ws::frame(
                ws::TEXT,
                text.as_bytes(),
                Some([1, 2, 3, 4 + n]),
            ))
            .await
            .unwrap();
            let (opcode, masked, payload) = within("echo", ws::read_frame(&mut s))
                .await
                .unwrap()
                .expect("an echoed frame");
            assert_eq!((opcode, masked), (ws::TEXT, false));
            assert_eq!(payload, text.as_bytes());
        }
        s.write_all(&ws::frame(ws::CLOSE, &[0x03, 0xe8], Some([9, 9, 9, 9])))
            .await
            .unwrap();
        let (opcode, _, _) = within("close echo", ws::read_frame(&mut s))
            .await
            .unwrap()
            .expect("the close echoed");
        assert_eq!(opcode, ws::CLOSE);
        assert!(
            within("end of the tunnel", ws::read_frame(&mut s))
                .await
                .unwrap_or(None)
                .is_none(),
            "the worker closed: so does the tunnel"
        );
        drop(s);
        wait_all_idle(router.addr, STEP_TIMEOUT).await;
    }
    router.shutdown().await;
}

// C53 (3)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2c_upgrade_offer_on_a_post_is_served_over_http1_without_it() {
    let w = FakeWorker::start_with(websocket_engine).await;
    let router = start_router(&yaml_for(&[&w], "")).await;
    let mut conn = Conn::connect(router.addr).await;
    for _ in 0..2 {
        let req = Req::post("/v1/chat/completions", chat_body("java", false))
            .header("Connection", "Upgrade, HTTP2-Settings")
            .header("Upgrade", "h2c")
            .header("HTTP2-Settings", "AAMAAABkAAQAAP__");
        let resp = within("answer", conn.request(&req)).await;
        assert_eq!(resp.status, 200, "{}", resp.text());
        assert!(!resp.has_header("upgrade"), "{:?}", resp.headers);
    }
    for rec in w.requests() {
        for name in ["upgrade", "http2-settings", "connection"] {
            assert!(
                !rec.has_header(name),
                "`{name}` reached the worker: {:?}",
                rec.headers
            );
        }
    }
    router.shutdown().await;
}

/// A worker that redirects as Starlette does: a path with a trailing slash gets a 307
/// to the path without it, built from the `Host` it received (with its root path, the
/// worker's prefix), with `Content-Location` and `Link` on the same origin; `/v1/help`
/// redirects to an external page.
fn starlette_redirects(r: &Recorded) -> Reply {
    let path = r.target.split('?').next().unwrap_or("");
    let host = r.header("host").unwrap_or("");
    if path.ends_with("/v1/help") {
        return Reply::status(302).header("Location", "https://docs.example.org/help");
    }
    match path.strip_suffix('/') {
        Some(bare) => Reply::status(307)
            .header("Location", &format!("http://{host}{bare}"))
            .header("Content-Location", &format!("http://{host}{path}"))
            .header("Link", &format!("<http://{host}{bare}>; rel=\"canonical\"")),
        None => Reply::ok(),
    }
}

// C54
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_redirects_point_at_the_router_not_the_worker() {
    let a = FakeWorker::start_with(starlette_redirects).await;
    let e = FakeWorker::start_with(starlette_redirects).await;
    let (pa, pe) = (a.port(), e.port());
    for (url, port) in [
        (format!("http://127.0.0.1:{pa}"), pa),
        (format!("http://127.0.0.1:{pe}/gpu5"), pe),
    ] {
        let router = start_router(&yaml_for_urls(std::slice::from_ref(&url), "")).await;
        let leaks = |resp: &Response| {
            resp.headers
                .iter()
                .filter(|(k, _)| {
                    k.eq_ignore_ascii_case("location")
                        || k.eq_ignore_ascii_case("content-location")
                        || k.eq_ignore_ascii_case("link")
                })
                .any(|(_, v)| {
                    v.contains(&format!(":{port}"))
                        || v.contains("/gpu5")
                        || v.contains("127.0.0.1")
                })
        };
        let req = Req::post("/v1/chat/completions/", chat_body("slash", false))
            .header("Host", "router.test:6700");
        let resp = send(router.addr, &req).await;
        assert_eq!(resp.status, 307, "{url}: {}", resp.text());
        assert_eq!(
            resp.header("location"),
            Some("/v1/chat/completions"),
            "{url}"
        );
        assert_eq!(
            resp.header("content-location"),
            Some("/v1/chat/completions/"),
            "{url}"
        );
        assert_eq!(
            resp.header("link"),
            Some("</v1/chat/completions>; rel=\"canonical\""),
            "{url}"
        );
        assert!(!leaks(&resp), "{url}: {:?}", resp.headers);
        // A passed-through path the same way.
        let resp = get(router.addr, "/v1/models/").await;
        assert_eq!(resp.status, 307, "{url}: {}", resp.text());
        assert_eq!(resp.header("location"), Some("/v1/models"), "{url}");
        assert!(!leaks(&resp), "{url}: {:?}", resp.headers);
        // An external redirect passes unchanged.
        let resp = get(router.addr, "/v1/help").await;
        assert_eq!(resp.status, 302);
        assert_eq!(
            resp.header("location"),
            Some("https://docs.example.org/help")
        );
        router.shutdown().await;
    }
}

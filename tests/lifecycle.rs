//! Reload (the SIGHUP logic, called directly) and shutdown of a running router.

mod support;

use std::time::{Duration, Instant};

use cache_aware_router::reload::{self, Outcome};
use support::*;

async fn listed_urls(addr: std::net::SocketAddr) -> Vec<String> {
    get_workers(addr).await["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["url"].as_str().unwrap().to_string())
        .collect()
}

fn gated_stream(gate: &Gate) -> Reply {
    Reply::status(200)
        .header("Content-Type", "text/event-stream")
        .chunked(vec![
            Step::Write(format!("data: {}\n\n", sse_event(0)).into_bytes()),
            Step::Wait(gate.clone()),
            Step::Write(b"data: [DONE]\n\n".to_vec()),
        ])
}

/// Opens a streamed request and reads its first event.
async fn open_stream(addr: std::net::SocketAddr) -> Conn {
    let mut conn = Conn::connect(addr).await;
    conn.send(&Req::post(
        "/v1/chat/completions",
        chat_body("stream", true),
    ))
    .await
    .unwrap();
    assert_eq!(conn.read_head().await.status, 200);
    conn.next_piece().await.expect("first event");
    conn
}

async fn read_to_end(conn: &mut Conn) -> Vec<u8> {
    let mut body = Vec::new();
    while let Some(p) = conn.next_piece().await {
        body.extend_from_slice(&p);
    }
    body
}

// C27, reload half
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_with_an_unbracketed_ipv6_url_is_refused_and_the_old_list_stays() {
    let a = FakeWorker::start().await;
    let b = FakeWorker::start().await;
    let extra = "policy: round_robin\n";
    let router = start_router(&yaml_for(&[&a, &b], extra)).await;
    let before = listed_urls(router.addr).await;

    let bad = TempFile::new(
        "workers.yaml",
        &yaml_for_urls(&[a.url(), b.url(), "http://::1:18006".into()], extra),
    );
    match reload::apply(&router.router, std::slice::from_ref(&bad.path)) {
        Outcome::Invalid(msg) => {
            assert!(
                msg.contains(&bad.path.display().to_string())
                    && msg.contains("workers[2].url")
                    && msg.contains("http://::1:18006"),
                "the message names file, key and value: {msg}"
            );
        }
        other => panic!("an unbracketed IPv6 URL must be refused, got {other:?}"),
    }
    assert_eq!(listed_urls(router.addr).await, before);
    for _ in 0..4 {
        let r = post(
            router.addr,
            "/v1/chat/completions",
            chat_body("still here", false),
        )
        .await;
        assert_eq!(r.status, 200);
    }
    assert_eq!((a.count(), b.count()), (2, 2), "the old list keeps serving");

    // The same reload without the bad entry goes through.
    let good = TempFile::new("workers.yaml", &yaml_for(&[&b], extra));
    assert_eq!(
        reload::apply(&router.router, std::slice::from_ref(&good.path)),
        Outcome::Applied { workers: 1 }
    );
    assert_eq!(listed_urls(router.addr).await, [b.url()]);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_changing_anything_but_workers_is_rejected() {
    let a = FakeWorker::start().await;
    let router = start_router(&yaml_for(&[&a], "")).await;
    let f = TempFile::new("c.yaml", &yaml_for(&[&a], "policy: round_robin\n"));
    assert_eq!(
        reload::apply(&router.router, std::slice::from_ref(&f.path)),
        Outcome::Rejected { key: "policy" }
    );
    assert_eq!(get_workers(router.addr).await["policy"], "cache_aware");
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_keeps_the_in_flight_count_of_a_surviving_worker() {
    let gate = Gate::new();
    let g = gate.clone();
    let a = FakeWorker::start_with(move |_| gated_stream(&g)).await;
    let b = FakeWorker::start().await;
    let router = start_router(&yaml_for(&[&a], "")).await;
    let mut stream = open_stream(router.addr).await;
    assert_eq!(in_flight(router.addr).await, [1]);

    let f = TempFile::new("w.yaml", &yaml_for(&[&b, &a], ""));
    assert_eq!(
        reload::apply(&router.router, std::slice::from_ref(&f.path)),
        Outcome::Applied { workers: 2 }
    );
    assert_eq!(listed_urls(router.addr).await, [b.url(), a.url()]);
    assert_eq!(
        in_flight(router.addr).await,
        [0, 1],
        "the stream still counts on the surviving worker"
    );
    gate.open();
    let body = read_to_end(&mut stream).await;
    assert!(String::from_utf8_lossy(&body).ends_with("data: [DONE]\n\n"));
    wait_all_idle(router.addr, Duration::from_millis(500)).await;
    router.shutdown().await;
}

// C22
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_after_a_reload_come_from_the_new_worker_list() {
    fn serving(model: &'static str) -> impl Fn(&Recorded) -> Reply + Send + Sync + 'static {
        move |req| {
            if req.target == "/v1/models" {
                Reply::json(
                    200,
                    &format!(r#"{{"object":"list","data":[{{"id":"{model}","object":"model"}}]}}"#),
                )
            } else if req.body_str().contains(&format!(r#""model":"{model}""#)) {
                Reply::ok()
            } else {
                Reply::json(404, r#"{"error":{"message":"model not found","code":404}}"#)
            }
        }
    }
    let a = FakeWorker::start_with(serving("m-old")).await;
    let b = FakeWorker::start_with(serving("m-new")).await;
    let router = start_router(&yaml_for(&[&a], "")).await;
    let old = get(router.addr, "/v1/models").await;
    assert!(old.text().contains("m-old"), "{}", old.text());

    let f = TempFile::new("w.yaml", &yaml_for(&[&b], ""));
    assert_eq!(
        reload::apply(&router.router, std::slice::from_ref(&f.path)),
        Outcome::Applied { workers: 1 }
    );
    let new = get(router.addr, "/v1/models").await;
    assert_eq!(new.status, 200);
    assert!(
        new.text().contains("m-new") && !new.text().contains("m-old"),
        "{}",
        new.text()
    );
    let a_before = a.count();
    let body = r#"{"model":"m-old","messages":[{"role":"user","content":"hi"}]}"#;
    let resp = post(router.addr, "/v1/chat/completions", body).await;
    assert_eq!(a.count(), a_before, "nothing goes to the removed worker");
    assert!(
        matches!(resp.status, 400 | 404 | 503),
        "the old model is not served: {} {}",
        resp.status,
        resp.text()
    );
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_a_request_in_flight_finish() {
    let gate = Gate::new();
    let g = gate.clone();
    let a = FakeWorker::start_with(move |_| gated_stream(&g)).await;
    let router = start_router(&yaml_for(&[&a], "server:\n  shutdown_grace_secs: 3\n")).await;
    let addr = router.addr;
    let mut stream = open_stream(addr).await;
    let shutdown = tokio::spawn(router.shutdown());
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!shutdown.is_finished(), "shutdown waits for the stream");
    gate.open();
    let body = read_to_end(&mut stream).await;
    assert!(String::from_utf8_lossy(&body).ends_with("data: [DONE]\n\n"));
    within("shutdown after the last stream ended", shutdown)
        .await
        .unwrap();
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "no longer accepting"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_finishes_within_its_grace_period() {
    let gate = Gate::new();
    let g = gate.clone();
    let a = FakeWorker::start_with(move |_| gated_stream(&g)).await;
    let router = start_router(&yaml_for(&[&a], "server:\n  shutdown_grace_secs: 0.3\n")).await;
    let _stream = open_stream(router.addr).await;
    let started = Instant::now();
    within("shutdown", router.shutdown()).await;
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(250) && took < Duration::from_millis(1500),
        "a stuck stream holds shutdown for the grace period only: {took:?}"
    );
    gate.open();
}

// C20, step 4
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_to_an_empty_worker_list_answers_503_until_workers_return() {
    for policy in ["cache_aware", "round_robin", "random", "least_load"] {
        let a = FakeWorker::start().await;
        let extra = format!("policy: {policy}\n");
        let router = start_router(&yaml_for(&[&a], &extra)).await;
        let empty = TempFile::new("w.yaml", &format!("{extra}workers: []\n"));
        assert_eq!(
            reload::apply(&router.router, std::slice::from_ref(&empty.path)),
            Outcome::Applied { workers: 0 },
            "{policy}"
        );
        for _ in 0..5 {
            let r = post(
                router.addr,
                "/v1/chat/completions",
                chat_body("hello", false),
            )
            .await;
            assert_eq!(r.status, 503, "{policy}: {}", r.text());
            assert!(r.json()["error"]["message"].is_string());
        }
        assert_eq!(get(router.addr, "/v1/models").await.status, 503, "{policy}");
        assert_eq!(get(router.addr, "/health").await.status, 503, "{policy}");
        assert_eq!(listed_urls(router.addr).await, Vec::<String>::new());

        let back = TempFile::new("w.yaml", &yaml_for(&[&a], &extra));
        assert_eq!(
            reload::apply(&router.router, std::slice::from_ref(&back.path)),
            Outcome::Applied { workers: 1 }
        );
        let r = post(
            router.addr,
            "/v1/chat/completions",
            chat_body("hello", false),
        )
        .await;
        assert_eq!(r.status, 200, "{policy}: {}", r.text());
        router.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_keeps_the_breaker_state_of_a_surviving_worker() {
    let a = FakeWorker::start_with(|_| Reply::json(500, r#"{"error":"boom"}"#)).await;
    let b = FakeWorker::start().await;
    let extra =
        "proxy:\n  max_retries: 0\ncircuit_breaker:\n  failure_threshold: 2\n  timeout_secs: 60\n";
    let router = start_router(&yaml_for(&[&a], extra)).await;
    for _ in 0..2 {
        let r = post(router.addr, "/v1/chat/completions", chat_body("x", false)).await;
        assert_eq!(r.status, 500);
    }
    let breaker = |v: serde_json::Value, i: usize| v["workers"][i]["breaker"].clone();
    assert_eq!(breaker(get_workers(router.addr).await, 0), "open");

    let f = TempFile::new("w.yaml", &yaml_for(&[&b, &a], extra));
    assert_eq!(
        reload::apply(&router.router, std::slice::from_ref(&f.path)),
        Outcome::Applied { workers: 2 }
    );
    let after = get_workers(router.addr).await;
    assert_eq!(
        breaker(after.clone(), 0),
        "closed",
        "the new worker starts closed"
    );
    assert_eq!(
        breaker(after, 1),
        "open",
        "the surviving worker's breaker is kept"
    );
    for _ in 0..3 {
        let r = post(router.addr, "/v1/chat/completions", chat_body("x", false)).await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert_eq!(
        a.count(),
        2,
        "the open breaker still keeps traffic off the old worker"
    );
    router.shutdown().await;
}

//! Worker failures: active health checks (consecutive thresholds), the pool with no
//! healthy worker, and the circuit breaker's open / half-open / closed cycle.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use support::*;

/// A switch the test flips to change how a mock answers.
#[derive(Clone, Default)]
struct Mode(Arc<AtomicU8>);

impl Mode {
    fn set(&self, m: u8) {
        self.0.store(m, Ordering::SeqCst);
    }

    fn get(&self) -> u8 {
        self.0.load(Ordering::SeqCst)
    }
}

async fn worker_view(addr: std::net::SocketAddr, i: usize) -> serde_json::Value {
    get_workers(addr).await["workers"][i].clone()
}

const FLAKY: u8 = 0;
const DOWN: u8 = 1;
const UP: u8 = 2;

// C19
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_checks_flip_a_worker_only_after_consecutive_results() {
    let mode = Mode::default();
    let probes = Arc::new(AtomicUsize::new(0));
    let (m, n) = (mode.clone(), Arc::clone(&probes));
    let a = FakeWorker::builder()
        .health(move |_| {
            let i = n.fetch_add(1, Ordering::SeqCst);
            match m.get() {
                // Every 4th probe fails; one probe (the 6th) outlives the timeout.
                FLAKY if i % 4 == 3 => Reply::json(503, r#"{"status":"busy"}"#),
                FLAKY if i == 5 => Reply::raw(vec![
                    Step::Sleep(Duration::from_millis(200)),
                    Step::Write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n".to_vec()),
                ]),
                DOWN => Reply::json(503, r#"{"status":"down"}"#),
                _ => Reply::json(200, r#"{"status":"ok"}"#),
            }
        })
        .start()
        .await;
    let b = FakeWorker::start().await;
    let yaml = yaml_for(
        &[&a, &b],
        "policy: round_robin\nhealth:\n  interval_secs: 0.04\n  timeout_secs: 0.1\n  failure_threshold: 3\n  success_threshold: 2\n",
    );
    let router = start_router(&yaml).await;

    // Watch A's health the whole time, as a user polling /workers would.
    let addr = router.addr;
    let watcher = tokio::spawn(async move {
        let mut seen = vec![true];
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(4) {
            let h = worker_view(addr, 0).await["healthy"].as_bool().unwrap();
            if *seen.last().unwrap() != h {
                seen.push(h);
                if seen.len() == 3 {
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        seen
    });

    // Flaky phase: isolated failures and a slow probe, under steady traffic.
    wait_until("a dozen flaky probes", Duration::from_secs(3), || async {
        probes.load(Ordering::SeqCst) >= 12
    })
    .await;
    for _ in 0..10 {
        let r = post(
            router.addr,
            "/v1/chat/completions",
            chat_body("steady", false),
        )
        .await;
        assert_eq!(r.status, 200);
    }
    assert!(
        a.count() >= 4,
        "A keeps its share while flaky: {}",
        a.count()
    );
    assert_eq!(worker_view(router.addr, 0).await["healthy"], true);

    // Three failures in a row: A goes down and gets no traffic.
    mode.set(DOWN);
    wait_until("A marked unhealthy", Duration::from_secs(2), || async {
        worker_view(router.addr, 0).await["healthy"] == false
    })
    .await;
    let health = get(router.addr, "/health").await;
    assert_eq!(health.status, 200, "B is still healthy: {}", health.text());
    assert_eq!(health.json()["healthy_workers"], 1);
    let before = a.count();
    for _ in 0..6 {
        let r = post(
            router.addr,
            "/v1/chat/completions",
            chat_body("steady", false),
        )
        .await;
        assert_eq!(r.status, 200);
    }
    assert_eq!(a.count(), before, "an unhealthy worker gets no requests");

    // Successes again: A comes back.
    mode.set(UP);
    wait_until("A healthy again", Duration::from_secs(2), || async {
        worker_view(router.addr, 0).await["healthy"] == true
    })
    .await;
    let transitions = within("watcher", watcher).await.unwrap();
    assert_eq!(
        transitions,
        [true, false, true],
        "one down and one up transition for the whole run"
    );
    router.shutdown().await;
}

// C20
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_with_no_healthy_worker_answers_503_and_recovers_without_a_restart() {
    let mode = Mode::default();
    mode.set(DOWN);
    let m = mode.clone();
    let a = FakeWorker::builder()
        .health(move |_| match m.get() {
            DOWN => Reply::json(503, r#"{"status":"down"}"#),
            _ => Reply::json(200, r#"{"status":"ok"}"#),
        })
        .start()
        .await;
    let yaml = yaml_for(
        &[&a],
        "health:\n  interval_secs: 0.04\n  failure_threshold: 2\n  success_threshold: 2\n",
    );
    let router = start_router(&yaml).await;
    wait_until(
        "/health reports not ready",
        Duration::from_secs(2),
        || async { get(router.addr, "/health").await.status == 503 },
    )
    .await;
    assert_eq!(get(router.addr, "/workers").await.status, 200);
    let started = Instant::now();
    let r = post(
        router.addr,
        "/v1/chat/completions",
        chat_body("anyone?", false),
    )
    .await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(r.json()["error"]["message"].is_string());
    assert!(started.elapsed() < Duration::from_secs(1));
    assert_eq!(a.count(), 0, "nothing is sent to an unhealthy worker");

    mode.set(UP);
    wait_until("/health ready again", Duration::from_secs(2), || async {
        get(router.addr, "/health").await.status == 200
    })
    .await;
    let r = post(
        router.addr,
        "/v1/chat/completions",
        chat_body("anyone?", false),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    router.shutdown().await;
}

const FAIL: u8 = 0;
const SLOW: u8 = 1;
const BAD_REQUEST: u8 = 2;
const OK: u8 = 3;

// C18
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn breaker_opens_on_failures_and_closes_after_a_cancelled_or_neutral_probe() {
    let mode = Mode::default();
    let m = mode.clone();
    let a = FakeWorker::start_with(move |_| match m.get() {
        FAIL => Reply::json(500, r#"{"error":"boom"}"#),
        SLOW => Reply::raw(vec![
            Step::Sleep(Duration::from_millis(300)),
            Step::Write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}".to_vec()),
        ]),
        BAD_REQUEST => Reply::json(400, r#"{"error":"bad input"}"#),
        _ => Reply::ok(),
    })
    .await;
    let yaml = yaml_for(
        &[&a],
        "proxy:\n  max_retries: 0\ncircuit_breaker:\n  failure_threshold: 3\n  timeout_secs: 0.2\n  success_threshold: 1\n",
    );
    let router = start_router(&yaml).await;
    let chat = || {
        post(
            router.addr,
            "/v1/chat/completions",
            chat_body("probe", false),
        )
    };

    for _ in 0..3 {
        assert_eq!(chat().await.status, 500);
    }
    assert_eq!(worker_view(router.addr, 0).await["breaker"], "open");
    let r = chat().await;
    assert_eq!(r.status, 503, "an open breaker rejects: {}", r.text());
    assert_eq!(a.count(), 3);

    // Probe 1: a client error, which says nothing about the worker: the breaker stays
    // half-open and the slot is free for the next request.
    mode.set(BAD_REQUEST);
    wait_until(
        "half-open after the cooldown",
        Duration::from_secs(1),
        || async { worker_view(router.addr, 0).await["breaker"] == "half_open" },
    )
    .await;
    assert_eq!(chat().await.status, 400);
    assert_eq!(worker_view(router.addr, 0).await["breaker"], "half_open");

    // Probe 2: the client gives up before the worker answers.
    mode.set(SLOW);
    let mut conn = Conn::connect(router.addr).await;
    conn.send(&Req::post(
        "/v1/chat/completions",
        chat_body("probe", false),
    ))
    .await
    .unwrap();
    a.wait_for_requests(5).await;
    drop(conn);

    // The cancelled probe never leaves the breaker stuck: the next probe goes through
    // within the cooldown plus the slow answer, succeeds, and closes it.
    mode.set(OK);
    wait_until("a successful probe", Duration::from_secs(1), || async {
        chat().await.status == 200
    })
    .await;
    assert_eq!(worker_view(router.addr, 0).await["breaker"], "closed");
    for _ in 0..5 {
        assert_eq!(chat().await.status, 200);
    }
    router.shutdown().await;
}

//! In-flight accounting: a request counts on its worker until its response body ends or
//! the client goes away, not until the response headers arrive.

use std::time::Duration;

use support::{client::*, config::*, engine::*, observe::*, wait::*, worker::*};

use crate::common::start_router;

/// `cache.balance_abs_threshold: 100` keeps all requests with one prefix on one worker
/// however loaded it gets ("pinned").
const PINNED: &str = "cache:\n  balance_abs_threshold: 100\n";

fn pinned_prompt() -> String {
    "Pinned agent session. ".repeat(200)
}

/// Starts `n` requests with `body` at once on their own connections; each task reads
/// its response to the end and returns it.
fn start_clients(
    addr: std::net::SocketAddr,
    body: &str,
    n: usize,
) -> Vec<tokio::task::JoinHandle<Response>> {
    (0..n)
        .map(|_| {
            let body = body.to_string();
            tokio::spawn(async move {
                let mut c = Conn::connect(addr).await;
                c.request(&Req::post("/v1/chat/completions", body)).await
            })
        })
        .collect()
}

async fn check_counts_until_body_ends(a: &FakeWorker, b: &FakeWorker, stream: bool) {
    let router = start_router(&yaml_for(&[a, b], PINNED)).await;
    // Warm-up: pins the prompt to the worker that takes it.
    let warm = send(
        router.addr,
        &Req::post("/v1/chat/completions", chat_body(&pinned_prompt(), false))
            .header("x-warm-up", "1"),
    )
    .await;
    assert_eq!(warm.status, 200);
    let (pinned, other) = if a.count() == 1 { (0, 1) } else { (1, 0) };
    let ws = [a, b];

    let clients = start_clients(router.addr, &chat_body(&pinned_prompt(), stream), 6);
    wait_until("six requests reach the workers", STEP_TIMEOUT, || async {
        a.count() + b.count() == 7
    })
    .await;
    // All six are being answered now (each answer takes ~1 s).
    let loads = in_flight(router.addr).await;
    assert_eq!(
        loads[pinned], 6,
        "six answers in progress on the pinned worker: {loads:?}"
    );
    assert_eq!(loads[other], 0, "{loads:?}");
    for c in clients {
        let resp = within("client", c).await.expect("client task");
        assert_eq!(resp.status, 200);
        assert!(!resp.body.is_empty());
    }
    wait_all_idle(router.addr, Duration::from_millis(500)).await;
    assert_eq!(ws[other].count(), 0);
    router.shutdown().await;
}

/// 10 events, 100 ms apart (SSE when `stream`, otherwise one JSON body trickled out
/// after `Content-Length` headers sent at once).
fn slow_answer(req: &Recorded) -> Reply {
    if req.has_header("x-warm-up") {
        return Reply::ok();
    }
    let mut steps = Vec::new();
    for i in 0..10 {
        if i > 0 {
            steps.push(Step::Sleep(Duration::from_millis(100)));
        }
        steps.push(Step::Write(
            format!("data: {}\n\n", sse_event(i)).into_bytes(),
        ));
    }
    if req.body_str().contains(r#""stream":true"#) {
        Reply::status(200)
            .header("Content-Type", "text/event-stream")
            .chunked(steps)
    } else {
        let mut json = vec![Step::Write(b"{\"choices\":[{\"text\":\"".to_vec())];
        json.extend(steps.into_iter().map(|s| match s {
            Step::Write(_) => Step::Write(b"token ".repeat(1000)),
            other => other,
        }));
        json.push(Step::Write(b"\"}]}".to_vec()));
        Reply::status(200)
            .header("Content-Type", "application/json")
            .trickle(json)
    }
}

// C12, streamed
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_requests_count_in_flight_until_the_stream_ends() {
    let a = FakeWorker::start_with(slow_answer).await;
    let b = FakeWorker::start_with(slow_answer).await;
    check_counts_until_body_ends(&a, &b, true).await;
}

// C12, non-streamed body trickled after the headers
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trickled_body_counts_in_flight_until_the_body_ends() {
    let a = FakeWorker::start_with(slow_answer).await;
    let b = FakeWorker::start_with(slow_answer).await;
    check_counts_until_body_ends(&a, &b, false).await;
}

/// An endless stream: an event every 50 ms for 5 s.
fn endless_stream(_: &Recorded) -> Reply {
    let events: Vec<String> = (0..100).map(sse_event).collect();
    Reply::sse(&events, Duration::from_millis(50))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_leaving_mid_stream_releases_in_flight() {
    let w = FakeWorker::start_with(endless_stream).await;
    let router = start_router(&yaml_for(&[&w], "")).await;
    let mut conn = Conn::connect(router.addr).await;
    conn.send(&Req::post("/v1/chat/completions", chat_body("go", true)))
        .await
        .unwrap();
    assert_eq!(conn.read_head().await.status, 200);
    conn.next_piece().await.expect("first event");
    assert_eq!(in_flight(router.addr).await, [1]);
    drop(conn);
    // Well before the worker's stream would end on its own (5 s).
    wait_all_idle(router.addr, Duration::from_secs(1)).await;
    // The router also lets go of the upstream stream.
    let upstream = w.requests()[0].conn;
    wait_until(
        "the stream's upstream connection closed",
        Duration::from_secs(1),
        || async { !w.is_open(upstream) },
    )
    .await;
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_leaving_while_the_worker_is_silent_releases_in_flight() {
    // First event, then nothing until the test ends (a long prefill or tool wait).
    let gate = Gate::new();
    let g = gate.clone();
    let w = FakeWorker::start_with(move |_| gated_stream(&g)).await;
    let router = start_router(&yaml_for(&[&w], "")).await;
    let mut conn = Conn::connect(router.addr).await;
    conn.send(&Req::post("/v1/chat/completions", chat_body("go", true)))
        .await
        .unwrap();
    assert_eq!(conn.read_head().await.status, 200);
    conn.next_piece().await.expect("first event");
    assert_eq!(in_flight(router.addr).await, [1]);
    drop(conn);
    wait_all_idle(router.addr, Duration::from_secs(1)).await;
    gate.open();
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_clients_leaving_mid_stream_leave_nothing_in_flight() {
    let a = FakeWorker::start_with(endless_stream).await;
    let b = FakeWorker::start_with(endless_stream).await;
    let router = start_router(&yaml_for(&[&a, &b], "")).await;
    let addr = router.addr;
    let clients: Vec<_> = (0..50)
        .map(|i| {
            tokio::spawn(async move {
                let mut conn = Conn::connect(addr).await;
                conn.send(&Req::post(
                    "/v1/chat/completions",
                    chat_body(&format!("client {i} asks something different"), true),
                ))
                .await
                .unwrap();
                let head = conn.read_head().await;
                assert_eq!(head.status, 200);
                let mut events = 0;
                let mut seen = Vec::new();
                while events < 2 {
                    let piece = conn.next_piece().await.expect("stream ended early");
                    seen.extend_from_slice(&piece);
                    events = seen.windows(2).filter(|w| w == b"\n\n").count();
                }
                conn // dropped by the caller: the client goes away mid-stream
            })
        })
        .collect();
    let mut conns = Vec::new();
    for c in clients {
        conns.push(within("client reads two events", c).await.unwrap());
    }
    let loads = in_flight(addr).await;
    assert_eq!(
        loads.iter().sum::<u64>(),
        50,
        "all fifty streaming: {loads:?}"
    );
    drop(conns);
    wait_all_idle(addr, Duration::from_secs(1)).await;
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_clients_leaving_mid_stream_leave_nothing_in_flight() {
    const CLIENTS: usize = 1000;
    const BATCH: usize = 100;
    let a = FakeWorker::start_with(endless_stream).await;
    let b = FakeWorker::start_with(endless_stream).await;
    let router = start_router(&yaml_for(&[&a, &b], "")).await;
    let addr = router.addr;
    let mut left = 0;
    for batch in 0..CLIENTS / BATCH {
        let clients: Vec<_> = (0..BATCH)
            .map(|i| {
                let n = batch * BATCH + i;
                tokio::spawn(async move {
                    let mut conn = Conn::connect(addr).await;
                    conn.send(&Req::post(
                        "/v1/chat/completions",
                        chat_body(&format!("client {n} streams something"), true),
                    ))
                    .await
                    .unwrap();
                    assert_eq!(conn.read_head().await.status, 200);
                    // Leave right after the head, after one event, or after two.
                    let mut seen = Vec::new();
                    while seen.windows(2).filter(|w| *w == b"\n\n").count() < n % 3 {
                        let piece = conn.next_piece().await.expect("stream ended early");
                        seen.extend_from_slice(&piece);
                    }
                    drop(conn);
                })
            })
            .collect();
        for c in clients {
            within("client leaves mid-stream", c).await.unwrap();
            left += 1;
        }
    }
    assert_eq!(left, CLIENTS);
    assert_eq!(a.count() + b.count(), CLIENTS, "every stream was started");
    wait_all_idle(addr, Duration::from_secs(2)).await;
    let m = scrape(addr).await;
    let gauges = m.all("cache_aware_router_worker_in_flight");
    assert_eq!(gauges.len(), 2);
    assert!(gauges.iter().all(|s| s.value == 0.0), "{gauges:?}");
    // The router let go of every upstream stream too (each would run for 5 s).
    wait_until(
        "every upstream stream closed",
        Duration::from_secs(2),
        || async { a.open_connections() + b.open_connections() == 0 },
    )
    .await;
    router.shutdown().await;
}

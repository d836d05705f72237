//! Drain (`proxy.drain_secs`): a worker removed (the admin API, SIGHUP, discovery) or
//! marked draining takes no new request and keeps its streams until they end or the
//! drain does; then the streams still going continue on another worker.

use std::path::Path;
use std::time::{Duration, Instant};

use cache_aware_router::config::Config;
use support::story::{Script, read, story, story_engine};
use support::{client::*, config::*, observe::*, wait::*, worker::*};

use crate::common::start_router;

const TOKEN: &str = "drain-admin-token";

fn admin(method: &str, target: &str) -> Req {
    Req::new(method, target)
        .header("Authorization", &format!("Bearer {TOKEN}"))
        .header("Content-Length", "0")
}

/// A slow story engine `a` (one token each `gap`) and a quick one `b`, behind a router
/// that sends the first request to `a` (round robin) and drains for `drain_secs`.
async fn slow_and_quick(gap_ms: u64, drain_secs: f64) -> (FakeWorker, FakeWorker, String) {
    let a = FakeWorker::start_with(story_engine(Script {
        name: "a",
        gap: Duration::from_millis(gap_ms),
        ..Script::default()
    }))
    .await;
    let b = FakeWorker::start_with(story_engine(Script {
        name: "b",
        ..Script::default()
    }))
    .await;
    let yaml = yaml_for(
        &[&a, &b],
        &format!(
            "policy: round_robin\nserver:\n  admin_token: {TOKEN}\nproxy:\n  drain_secs: {drain_secs}\n"
        ),
    );
    (a, b, yaml)
}

fn stream_of(tokens: usize) -> Req {
    let body = serde_json::json!({
        "model": "m", "stream": true, "max_tokens": tokens,
        "messages": [{"role": "user", "content": "count slowly"}],
    });
    Req::post("/v1/chat/completions", body.to_string())
}

/// Starts a stream of `tokens` on the router and reads its first piece.
async fn started(addr: std::net::SocketAddr, tokens: usize) -> (Conn, Vec<u8>) {
    let mut conn = Conn::connect(addr).await;
    conn.send(&stream_of(tokens)).await.unwrap();
    assert_eq!(conn.read_head().await.status, 200);
    let first = conn.next_piece().await.expect("the first event");
    (conn, first)
}

async fn rest(mut conn: Conn, mut body: Vec<u8>) -> Vec<u8> {
    body.extend(within("the stream's end", conn.read_rest()).await);
    body
}

/// A continuation `b` received: when, and what it was asked.
fn continuation(b: &FakeWorker) -> Option<(Instant, serde_json::Value)> {
    b.requests().into_iter().find_map(|r| {
        let v: serde_json::Value = serde_json::from_slice(&r.body).ok()?;
        (v["continue_final_message"] == true).then_some((r.at, v))
    })
}

async fn drained_and_continued(addr: std::net::SocketAddr) -> f64 {
    scrape(addr).await.value(
        "cache_aware_router_stream_migrations_total",
        &[("cause", "drained"), ("outcome", "continued")],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_worker_keeps_its_stream_until_the_drain_ends_then_it_moves() {
    let (a, b, yaml) = slow_and_quick(40, 0.3).await;
    let router = start_router(&yaml).await;
    let addr = router.addr;
    let (conn, first) = started(addr, 30).await;
    let removed = send(addr, &admin("DELETE", &format!("/workers?url={}", a.url()))).await;
    assert_eq!(removed.status, 200, "{}", removed.text());
    let removed_at = Instant::now();
    // New requests go elsewhere at once.
    for _ in 0..3 {
        assert_eq!(chat(addr, "meanwhile").await.status, 200);
    }
    assert_eq!(a.count(), 1, "the removed worker took no new request");
    let body = rest(conn, first).await;
    let r = read(&body);
    assert_eq!(r.text, story(30), "{}", String::from_utf8_lossy(&body));
    assert_eq!((r.ids.len(), r.roles, r.dones), (1, 1, 1));
    let (at, asked) = continuation(&b).expect("the stream continued on b");
    assert!(
        at.duration_since(removed_at) >= Duration::from_millis(250),
        "the stream stayed on its worker through the drain ({:?})",
        at.duration_since(removed_at)
    );
    let said = asked["messages"][1]["content"].as_str().unwrap();
    assert!(!said.is_empty() && story(30).starts_with(said), "{said}");
    // The drained worker's connection was closed (its engine stops generating).
    let conn_a = a.requests()[0].conn;
    wait_until("a's stream connection closed", STEP_TIMEOUT, || async {
        !a.is_open(conn_a)
    })
    .await;
    assert_eq!(drained_and_continued(addr).await, 1.0);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_ends_within_the_drain_stays_on_its_worker() {
    let (a, b, yaml) = slow_and_quick(10, 10.0).await;
    let router = start_router(&yaml).await;
    let addr = router.addr;
    let (conn, first) = started(addr, 10).await;
    let removed = send(addr, &admin("DELETE", &format!("/workers?url={}", a.url()))).await;
    assert_eq!(removed.status, 200);
    let r = read(&rest(conn, first).await);
    assert_eq!((r.text, r.dones), (story(10), 1));
    assert!(continuation(&b).is_none(), "nothing moved");
    assert_eq!(drained_and_continued(addr).await, 0.0);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_drops_a_worker_drains_it_the_same_way() {
    let (a, b, yaml) = slow_and_quick(40, 0.2).await;
    let router = start_router(&yaml).await;
    let addr = router.addr;
    let (conn, first) = started(addr, 25).await;
    // What SIGHUP applies once the files load: the worker list without `a`.
    let next =
        Config::from_sources([(Path::new("reload.yaml"), yaml_for(&[&b], "").as_str())]).unwrap();
    router.pool().replace(&next.workers);
    let r = read(&rest(conn, first).await);
    assert_eq!((r.text, r.dones), (story(25), 1));
    assert!(continuation(&b).is_some());
    assert_eq!(a.count(), 1);
    assert_eq!(drained_and_continued(addr).await, 1.0);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_marked_draining_takes_no_new_request_until_it_is_undrained() {
    let (a, b, yaml) = slow_and_quick(40, 0.3).await;
    let router = start_router(&yaml).await;
    let addr = router.addr;
    let (conn, first) = started(addr, 25).await;
    let marked = send(
        addr,
        &admin("POST", &format!("/workers/drain?url={}", a.url())),
    )
    .await;
    assert_eq!(marked.status, 200, "{}", marked.text());
    assert_eq!(marked.json()["draining"], true);
    assert_eq!(get_workers(addr).await["workers"][0]["draining"], true);
    for _ in 0..3 {
        assert_eq!(chat(addr, "meanwhile").await.status, 200);
    }
    assert_eq!(a.count(), 1, "a draining worker takes no new request");
    let r = read(&rest(conn, first).await);
    assert_eq!((r.text, r.dones), (story(25), 1));
    assert!(
        continuation(&b).is_some(),
        "its stream moved when the drain ended"
    );
    // Undrained, it is a worker like any other again.
    let back = send(
        addr,
        &admin("DELETE", &format!("/workers/drain?url={}", a.url())),
    )
    .await;
    assert_eq!(
        (back.status, back.json()["draining"].clone()),
        (200, false.into())
    );
    assert_eq!(get_workers(addr).await["workers"][0]["draining"], false);
    for _ in 0..4 {
        assert_eq!(chat(addr, "again").await.status, 200);
    }
    assert!(a.count() > 1, "round robin reaches it again");
    let unknown = send(
        addr,
        &admin("POST", "/workers/drain?url=http://127.0.0.1:1"),
    )
    .await;
    assert_eq!(unknown.status, 404);
    router.shutdown().await;
}

//! Hedging a late first token (`hedge:`): the first worker's first byte is late, the
//! same request goes to a second worker, the first byte wins, and the other worker sees
//! its connection closed.

use std::time::{Duration, Instant};

use support::story::{Script, read, story, story_engine};
use support::{client::*, config::*, observe::*, wait::*, worker::*};

use crate::common::start_router;

const HEDGES: &str = "cache_aware_router_hedges_total";

/// Story engines `a` (first, by round robin) and `b`, as the scripts say, behind a
/// router that hedges after 100 ms (`extra`: more of `hedge:`).
async fn hedged_pair(a: Script, b: Script, extra: &str) -> (FakeWorker, FakeWorker, String) {
    let a = FakeWorker::start_with(story_engine(Script { name: "a", ..a })).await;
    let b = FakeWorker::start_with(story_engine(Script { name: "b", ..b })).await;
    let yaml = yaml_for(
        &[&a, &b],
        &format!("policy: round_robin\nhedge:\n  after_ms: 100\n{extra}"),
    );
    (a, b, yaml)
}

fn stream_of(tokens: usize) -> Req {
    let body = serde_json::json!({
        "model": "m", "stream": true, "max_tokens": tokens,
        "messages": [{"role": "user", "content": "quick please"}],
    });
    Req::post("/v1/chat/completions", body.to_string())
}

async fn hedges(addr: std::net::SocketAddr, outcome: &str) -> f64 {
    scrape(addr).await.value(HEDGES, &[("outcome", outcome)])
}

fn slow(stall_ms: u64) -> Script {
    Script {
        stall: Some(Duration::from_millis(stall_ms)),
        ..Script::default()
    }
}

async fn closed(w: &FakeWorker, what: &str) {
    let conn = w.requests()[0].conn;
    wait_until(what, STEP_TIMEOUT, || async { !w.is_open(conn) }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_first_token_is_hedged_and_the_fast_worker_wins() {
    for (late, how) in [
        (slow(5_000), "first token late"),
        (
            Script {
                delay: Some(Duration::from_secs(5)),
                ..Script::default()
            },
            "headers late",
        ),
    ] {
        let (a, b, yaml) = hedged_pair(late, Script::default(), "  max_share: 1.0\n").await;
        let router = start_router(&yaml).await;
        let sent = Instant::now();
        let resp = within("the hedged answer", send(router.addr, &stream_of(8))).await;
        assert!(
            sent.elapsed() < Duration::from_secs(4),
            "{how}: not waited out"
        );
        let r = read(&resp.body);
        assert_eq!((r.text.as_str(), r.dones), (story(8).as_str(), 1), "{how}");
        assert_eq!(r.ids, ["chatcmpl-b-0"], "{how}: the second worker's answer");
        assert_eq!(b.count(), 1, "{how}");
        closed(&a, "the late worker's connection closed").await;
        assert_eq!(hedges(router.addr, "won").await, 1.0, "{how}");
        wait_all_idle(router.addr, Duration::from_secs(2)).await;
        router.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_worker_wins_when_the_hedge_is_slower_and_an_early_token_is_never_hedged() {
    let (_a, b, yaml) = hedged_pair(slow(300), slow(5_000), "  max_share: 1.0\n").await;
    let router = start_router(&yaml).await;
    let resp = send(router.addr, &stream_of(4)).await;
    let r = read(&resp.body);
    assert_eq!(r.ids, ["chatcmpl-a-0"]);
    assert_eq!(r.text, story(4));
    closed(&b, "the hedge's connection closed").await;
    assert_eq!(hedges(router.addr, "lost").await, 1.0);
    router.shutdown().await;

    // First tokens on time: nothing is hedged.
    let (a, b, yaml) =
        hedged_pair(Script::default(), Script::default(), "  max_share: 1.0\n").await;
    let router = start_router(&yaml).await;
    for _ in 0..4 {
        assert_eq!(read(&send(router.addr, &stream_of(3)).await.body).dones, 1);
    }
    assert_eq!((a.count(), b.count()), (2, 2), "no request sent twice");
    let m = scrape(router.addr).await;
    for outcome in ["won", "lost", "failed", "capped", "no_worker"] {
        assert_eq!(m.value(HEDGES, &[("outcome", outcome)]), 0.0, "{outcome}");
    }
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hedges_stop_at_their_share() {
    // A share of 0: a late first token waits it out, counted as capped.
    let (_a, b, yaml) = hedged_pair(slow(400), Script::default(), "  max_share: 0.0\n").await;
    let router = start_router(&yaml).await;
    let r = read(&send(router.addr, &stream_of(3)).await.body);
    assert_eq!(r.ids, ["chatcmpl-a-0"]);
    assert_eq!(b.count(), 0);
    assert_eq!(hedges(router.addr, "capped").await, 1.0);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_mid_race_closes_both_legs() {
    let (a, b, yaml) = hedged_pair(slow(10_000), slow(10_000), "  max_share: 1.0\n").await;
    let router = start_router(&yaml).await;
    let mut conn = Conn::connect(router.addr).await;
    conn.send(&stream_of(4)).await.unwrap();
    b.wait_for_requests(1).await;
    assert_eq!(a.count(), 1, "both legs in flight");
    drop(conn);
    let left = Instant::now();
    closed(&a, "the first leg's connection closed").await;
    closed(&b, "the hedge's connection closed").await;
    assert!(
        left.elapsed() < Duration::from_secs(2),
        "promptly: {:?}",
        left.elapsed()
    );
    wait_all_idle(router.addr, Duration::from_secs(2)).await;
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_flow_control_only_hedge_classes_are_hedged_and_never_a_preemptible_request() {
    // Both first tokens late; batch is listed but may be pre-empted, standard is not
    // listed: only the interactive request is hedged.
    let extra = "  max_share: 1.0\n  classes: [interactive, batch]\npriority:\n  preempt: true\nproxy:\n  queue:\n    max_waiting: 8\n";
    let (a, b, yaml) = hedged_pair(slow(300), slow(300), extra).await;
    let router = start_router(&yaml).await;
    let hedged = || async {
        let m = scrape(router.addr).await;
        ["won", "lost", "failed", "capped", "no_worker"]
            .iter()
            .map(|o| m.value(HEDGES, &[("outcome", o)]))
            .sum::<f64>()
    };
    for class in ["batch", "standard"] {
        let resp = send(router.addr, &stream_of(3).header("x-priority", class)).await;
        assert_eq!(read(&resp.body).dones, 1, "{class}");
        assert_eq!(hedged().await, 0.0, "{class} not hedged");
    }
    assert_eq!((a.count(), b.count()), (1, 1), "no request sent twice");
    let resp = send(
        router.addr,
        &stream_of(3).header("x-priority", "interactive"),
    )
    .await;
    assert_eq!(read(&resp.body).dones, 1);
    assert_eq!(hedged().await, 1.0, "interactive hedged");
    assert_eq!(a.count() + b.count(), 4, "sent to both workers");
    router.shutdown().await;
}

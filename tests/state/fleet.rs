//! Router replicas that route as one through a real Redis (`state.redis_url`;
//! tests/support/redis.rs starts one per test): a prefix learned through one replica is
//! a cache hit through the other, in-flight requests through one count in the other's
//! load and `max_load`, and a Redis outage leaves both serving, then sharing resumes.

use std::time::Duration;

use cache_aware_router::app;
use support::redis::RedisServer;
use support::{client::*, config::*, observe::*, wait::*, worker::*};

use crate::common::start_router;

/// A long shared prefix (a system prompt of ~2 KiB), distinct per `k`.
fn system(k: usize) -> String {
    (0..120)
        .map(|i| format!("rule {k}.{i}: be precise. "))
        .collect::<String>()
}

fn chat_with(system: &str, question: &str) -> Req {
    Req::post(
        "/v1/chat/completions",
        serde_json::json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ],
        })
        .to_string(),
    )
}

fn state(redis: &RedisServer) -> String {
    format!(
        "health:\n  interval_secs: 3600\nstate:\n  redis_url: \"{}\"\n",
        redis.url()
    )
}

async fn wait_connected(addr: std::net::SocketAddr) {
    wait_until(
        "subscribed to the fleet channel",
        Duration::from_secs(5),
        || async { get_workers(addr).await["fleet"]["connected"] == true },
    )
    .await;
}

async fn remote_records(addr: std::net::SocketAddr) -> u64 {
    get_workers(addr).await["fleet"]["remote_records"]
        .as_u64()
        .unwrap_or(0)
}

async fn hits(addr: std::net::SocketAddr) -> f64 {
    scrape(addr).await.value(
        "cache_aware_router_routing_decisions_total",
        &[("reason", "cache_hit")],
    )
}

/// A Redis, two workers and two replicas, both subscribed: replica 1 knows only w1 (so
/// everything it serves lands there), replica 2 knows both.
async fn pair() -> (
    RedisServer,
    FakeWorker,
    FakeWorker,
    app::RunningRouter,
    app::RunningRouter,
) {
    let redis = RedisServer::start();
    let w0 = FakeWorker::start().await;
    let w1 = FakeWorker::start().await;
    let one = start_router(&yaml_for(&[&w1], &state(&redis))).await;
    let two = start_router(&yaml_for(&[&w0, &w1], &state(&redis))).await;
    wait_connected(one.addr).await;
    wait_connected(two.addr).await;
    (redis, w0, w1, one, two)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_learned_through_one_replica_routes_the_same_through_the_other() {
    let (_redis, w0, w1, one, two) = pair().await;
    // From the answer through replica 1 to the record applied by replica 2 (polled).
    let mut slowest = Duration::ZERO;
    for k in 0..6 {
        let before = remote_records(two.addr).await;
        let r = send(one.addr, &chat_with(&system(k), "first question")).await;
        assert_eq!(r.status, 200);
        let served = std::time::Instant::now();
        wait_until(
            "replica 2 applied the record",
            Duration::from_secs(5),
            || async { remote_records(two.addr).await > before },
        )
        .await;
        slowest = slowest.max(served.elapsed());
        let (r, by) = send_tagged(
            two.addr,
            &[&w0, &w1],
            chat_with(&system(k), "another question"),
        )
        .await;
        assert_eq!(r.status, 200);
        assert_eq!(
            by, 1,
            "prefix {k} is held by w1 (learned through replica 1)"
        );
    }
    assert_eq!(
        hits(two.addr).await,
        6.0,
        "each was a cache hit on shared records"
    );
    eprintln!("slowest propagation: {slowest:?}");
    let view = get_workers(two.addr).await;
    assert!(
        view["fleet"]["messages_in"].as_u64().unwrap() >= 6,
        "{view}"
    );
    // Sharing is both ways: replica 2 served the follow-ups on w1.
    let own = get_workers(one.addr).await;
    assert!(
        own["fleet"]["remote_records"].as_u64().unwrap() > 0,
        "{own}"
    );
    one.shutdown().await;
    two.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_through_one_replica_counts_in_the_others_guard() {
    let redis = RedisServer::start();
    let gate = Gate::new();
    let held = gate.clone();
    let w0 = FakeWorker::start().await;
    let w1 = FakeWorker::start_with(move |r| {
        if r.body_str().contains("hold") {
            Reply::ok().after_gate(&held)
        } else {
            Reply::ok()
        }
    })
    .await;
    let one = start_router(&yaml_for(&[&w1], &state(&redis))).await;
    let two_yaml = format!(
        "{}workers:\n  - url: \"{}\"\n  - url: \"{}\"\n    max_load: 1\n",
        state(&redis),
        w0.url(),
        w1.url()
    );
    let two = start_router(&two_yaml).await;
    wait_connected(one.addr).await;
    wait_connected(two.addr).await;

    let a = one.addr;
    let pending = tokio::spawn(async move { send(a, &chat_with("s", "hold")).await });
    w1.wait_for_requests(1).await;
    wait_until(
        "replica 2 sees w1's request",
        Duration::from_secs(5),
        || async { get_workers(two.addr).await["workers"][1]["remote_in_flight"] == 1 },
    )
    .await;
    // w1 is at max_load for replica 2 through replica 1's request: everything goes to w0.
    for i in 0..4 {
        let (r, by) = send_tagged(two.addr, &[&w0, &w1], chat_with("s", &format!("q{i}"))).await;
        assert_eq!(r.status, 200);
        assert_eq!(by, 0, "w1 is full");
    }
    gate.open();
    assert_eq!(within("held request", pending).await.unwrap().status, 200);
    wait_until(
        "the share goes back to 0",
        Duration::from_secs(5),
        || async { get_workers(two.addr).await["workers"][1]["remote_in_flight"] == 0 },
    )
    .await;
    one.shutdown().await;
    two.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_outage_leaves_both_serving_then_sharing_resumes() {
    let (mut redis, w0, w1, one, two) = pair().await;

    redis.kill();
    for i in 0..5 {
        for r in [one.addr, two.addr] {
            let resp = send(r, &chat_with("s", &format!("down {i}"))).await;
            assert_eq!(resp.status, 200, "serves per-process while Redis is down");
        }
    }
    wait_until("the outage is seen", Duration::from_secs(5), || async {
        get_workers(two.addr).await["fleet"]["connected"] == false
    })
    .await;
    let errors = scrape(two.addr).await.value(
        "cache_aware_router_fleet_errors_total",
        &[("op", "subscribe")],
    );
    assert!(errors >= 1.0, "{errors}");

    redis.restart();
    wait_connected(one.addr).await;
    wait_connected(two.addr).await;
    let before = hits(two.addr).await;
    let r = send(one.addr, &chat_with(&system(9), "first")).await;
    assert_eq!(r.status, 200);
    wait_until("records flow again", Duration::from_secs(5), || async {
        remote_records(two.addr).await > 0
    })
    .await;
    let (_, by) = send_tagged(two.addr, &[&w0, &w1], chat_with(&system(9), "second")).await;
    assert_eq!(by, 1);
    assert_eq!(hits(two.addr).await, before + 1.0);
    one.shutdown().await;
    two.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_bound_through_one_replica_is_honoured_by_the_other() {
    let (_redis, w0, w1, one, two) = pair().await;
    let sessions = |addr| async move {
        scrape(addr).await.value(
            "cache_aware_router_routing_decisions_total",
            &[("reason", "session")],
        )
    };
    for k in 0..6 {
        let id = format!("user-{k}");
        // Short prompts: nothing for the prefix records, only the binding travels.
        let r = send(one.addr, &chat_with("s", "hi").header("x-session-id", &id)).await;
        assert_eq!(r.status, 200);
        let tagged = chat_with("s", &format!("again {k}")).header("x-session-id", &id);
        wait_until(
            "replica 2 holds the binding",
            Duration::from_secs(5),
            || async { get_workers(two.addr).await["sessions"]["held"] == k + 1 },
        )
        .await;
        let (_, by) = send_tagged(two.addr, &[&w0, &w1], tagged.clone()).await;
        assert_eq!(by, 1, "session {id} is bound to w1 through replica 1");
    }
    assert_eq!(sessions(two.addr).await, 6.0, "each followed its binding");
    one.shutdown().await;
    two.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_starts_late_bootstraps_from_the_snapshot() {
    let redis = RedisServer::start();
    let w0 = FakeWorker::start().await;
    let w1 = FakeWorker::start().await;
    let one = start_router(&yaml_for(&[&w1], &state(&redis))).await;
    wait_connected(one.addr).await;
    for k in 0..4 {
        let r = send(one.addr, &chat_with(&system(k), "first question")).await;
        assert_eq!(r.status, 200);
    }
    // Replica 1 publishes what it queued every 20 ms (and its load every 100 ms): a
    // message that starts after the last answer carries that answer's records, and the
    // second message counted from here started after the first had ended.
    let sent = |v: serde_json::Value| v["fleet"]["messages_out"].as_u64().unwrap_or(0);
    let after_answers = sent(get_workers(one.addr).await);
    wait_until(
        "two messages published after the last answer",
        Duration::from_secs(5),
        || async { sent(get_workers(one.addr).await) >= after_answers + 2 },
    )
    .await;
    let logged = redis
        .command(&["LLEN", "cache-aware-router:fleet:v2:log"])
        .unwrap_or_default();
    assert_ne!(logged.trim(), ":0", "messages kept for late replicas");
    // Replica 2 starts after all of that was said.
    let two = start_router(&yaml_for(&[&w0, &w1], &state(&redis))).await;
    wait_connected(two.addr).await;
    // Connected comes first; the snapshot is read right after (under load, later).
    wait_until(
        "replica 2 read the snapshot",
        Duration::from_secs(5),
        || async {
            get_workers(two.addr).await["fleet"]["snapshot_messages"]
                .as_u64()
                .unwrap_or(0)
                >= 1
        },
    )
    .await;
    for k in 0..4 {
        let (_, by) = send_tagged(two.addr, &[&w0, &w1], chat_with(&system(k), "later")).await;
        assert_eq!(by, 1, "prefix {k} known from the snapshot");
    }
    assert_eq!(hits(two.addr).await, 4.0);
    one.shutdown().await;
    two.shutdown().await;
}

// C46, across replicas
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_created_through_one_replica_is_polled_on_its_worker_through_the_other() {
    let redis = RedisServer::start();
    // w1 holds every response (replica 1 knows only it); w0 holds none.
    let w0 =
        FakeWorker::start_with(|_| Reply::json(404, r#"{"error":{"message":"not found"}}"#)).await;
    let w1 = FakeWorker::start_with(|r| {
        let id = "resp_w1_0";
        if r.method == "POST" && r.target == "/v1/responses" {
            Reply::json(
                200,
                &format!(r#"{{"id":"{id}","object":"response","status":"queued"}}"#),
            )
        } else {
            Reply::json(
                200,
                &format!(r#"{{"id":"{id}","object":"response","status":"completed"}}"#),
            )
        }
    })
    .await;
    let one = start_router(&yaml_for(&[&w1], &state(&redis))).await;
    let two = start_router(&yaml_for(&[&w0, &w1], &state(&redis))).await;
    wait_connected(one.addr).await;
    wait_connected(two.addr).await;
    let body = serde_json::json!({"model": "m", "input": "job", "background": true});
    let r = post(one.addr, "/v1/responses", body.to_string()).await;
    assert_eq!(r.status, 200);
    wait_until(
        "replica 2 holds the response id",
        Duration::from_secs(5),
        || async { get_workers(two.addr).await["sessions"]["conversations_held"] == 1 },
    )
    .await;
    for path in ["/v1/responses/resp_w1_0", "/v1/responses/resp_w1_0/cancel"] {
        let req = if path.ends_with("cancel") {
            Req::post(path, "")
        } else {
            Req::get(path)
        };
        let (r, by) = send_tagged(two.addr, &[&w0, &w1], req).await;
        assert_eq!(r.status, 200, "{path}: {}", r.text());
        assert_eq!(by, 1, "{path}: the binding came from replica 1; no fan-out");
    }
    let m = scrape(two.addr).await;
    let decisions = |reason| {
        m.value(
            "cache_aware_router_routing_decisions_total",
            &[("reason", reason)],
        )
    };
    assert_eq!(
        (decisions("conversation"), decisions("fan_out")),
        (2.0, 0.0)
    );
    one.shutdown().await;
    two.shutdown().await;
}

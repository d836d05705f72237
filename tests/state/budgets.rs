//! Token budgets shared by router replicas through a real Redis (`state.redis_url`): a
//! tenant's spending through one replica limits it through the other; with Redis gone,
//! limits fail open (no request fails because of it) and come back with it.

use support::redis::RedisServer;
use support::{client::*, config::*, observe::*, wait::*, worker::*};

use crate::common::start_router;

const KEY: &str = "cache-aware-router:budget:acme:output:minute";

fn answer(completion: u64) -> String {
    format!(
        r#"{{"id":"c","object":"chat.completion","choices":[{{"index":0,"message":{{"role":"assistant","content":"ok"}},"finish_reason":"stop"}}],"usage":{{"prompt_tokens":5,"completion_tokens":{completion}}}}}"#
    )
}

fn acme(prompt: &str) -> Req {
    Req::post("/v1/chat/completions", chat_body(prompt, false)).header("x-tenant-id", "acme")
}

fn yaml(w: &FakeWorker, redis: &RedisServer) -> String {
    yaml_for(
        &[w],
        &format!(
            "health:\n  interval_secs: 3600\nstate:\n  redis_url: \"{}\"\ntenants:\n  list:\n    acme: {{tokens_per_minute: {{output: 60}}}}\n",
            redis.url()
        ),
    )
}

/// The fleet bucket's level, once Redis holds it.
fn level(redis: &RedisServer) -> Option<f64> {
    let reply = redis.command(&["HGET", KEY, "l"])?;
    reply.split("\r\n").nth(1)?.parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_spent_through_one_replica_holds_through_the_other() {
    let mut redis = RedisServer::start();
    let body = answer(70);
    let w = FakeWorker::start_with(move |_| Reply::json(200, &body)).await;
    let one = start_router(&yaml(&w, &redis)).await;
    let two = start_router(&yaml(&w, &redis)).await;
    assert_eq!(send(one.addr, &acme("first")).await.status, 200);
    // The settlement goes to Redis off the request path.
    wait_until("the output settled in Redis", STEP_TIMEOUT, || async {
        level(&redis).is_some_and(|l| l < 0.0)
    })
    .await;
    let over = send(two.addr, &acme("second")).await;
    assert_eq!(over.status, 429, "{}", over.text());
    let retry: u64 = over.header("retry-after").unwrap().parse().unwrap();
    assert!((10..=11).contains(&retry), "Retry-After {retry}");
    assert_eq!(over.json()["error"]["type"], "budget_exceeded");

    // Redis gone: limits fail open, no request fails, the failure is counted.
    redis.kill();
    for i in 0..3 {
        let r = send(two.addr, &acme(&format!("open {i}"))).await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let m = scrape(two.addr).await;
    assert!(m.value("cache_aware_router_flow_budget_errors_total", &[]) >= 1.0);

    // Back (empty: a full bucket): the budget holds again once the router tries it.
    redis.restart();
    wait_until("limits back", STEP_TIMEOUT, || async {
        send(two.addr, &acme("again")).await.status == 429
    })
    .await;
    one.shutdown().await;
    two.shutdown().await;
}

//! `tenants.isolate_cache`: each request's `cache_salt` becomes a keyed hash of its
//! tenant (the client's replaced), so engines never share KV blocks across tenants, and
//! neither do the router's routing memory and response cache.

use std::time::Duration;

use support::{client::*, observe::*, wait::*, worker::*};

use crate::common::start_router;

const DECISIONS: &str = "cache_aware_router_routing_decisions_total";

fn chat_as(tenant: &str, prompt: &str, tag: &str) -> Req {
    Req::post("/v1/chat/completions", chat_body(prompt, false))
        .header("x-tenant-id", tenant)
        .header("x-test-tag", tag)
}

/// The `cache_salt` the worker received with the request tagged `tag`.
fn salt_of(workers: &[&FakeWorker], tag: &str) -> Option<String> {
    let r = workers
        .iter()
        .find_map(|w| w.tagged(tag))
        .expect("received");
    let body: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    body["cache_salt"].as_str().map(str::to_string)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tenants_sending_one_prompt_reach_the_engine_with_different_salts() {
    let a = FakeWorker::start().await;
    let b = FakeWorker::start().await;
    let router = start_router(&format!(
        "workers: [\"{}\", \"{}\"]\nhealth: {{interval_secs: 60}}\ntenants:\n  isolate_cache: true\n  secret: test-secret\n  list: {{red: {{}}, blue: {{}}}}\n",
        a.url(),
        b.url()
    ))
    .await;
    let addr = router.addr;
    let prompt = "summarise the quarterly report on river levels in detail ".repeat(8);
    let mut salts = Vec::new();
    for (i, tenant) in ["red", "red", "blue", "blue"].iter().enumerate() {
        let tag = format!("iso-{i}");
        let r = send(addr, &chat_as(tenant, &prompt, &tag)).await;
        assert_eq!(r.status, 200, "{}", r.text());
        salts.push(salt_of(&[&a, &b], &tag).expect("a salt"));
    }
    assert_eq!(salts[0], salts[1], "one tenant, one salt");
    assert_eq!(salts[2], salts[3]);
    assert_ne!(salts[0], salts[2], "two tenants, two salts");
    // The routing memory is per salt: the second red request was a hit, the first
    // blue one, whose prompt red's worker holds, was not.
    let hits = scrape(addr)
        .await
        .value(DECISIONS, &[("reason", "cache_hit")]);
    assert_eq!(hits, 2.0, "red's second and blue's second");
    // A salt the client sends is replaced by its tenant's.
    let mut forged: serde_json::Value = serde_json::from_str(&chat_body(&prompt, false)).unwrap();
    forged["cache_salt"] = salts[0].clone().into();
    let req = Req::post("/v1/chat/completions", forged.to_string())
        .header("x-tenant-id", "blue")
        .header("x-test-tag", "forged");
    assert_eq!(send(addr, &req).await.status, 200);
    assert_eq!(salt_of(&[&a, &b], "forged").as_deref(), Some(&*salts[2]));
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_response_cache_answers_a_tenant_only_with_its_own_answers() {
    let w = FakeWorker::start().await;
    let router = start_router(&format!(
        "workers: [\"{}\"]\nhealth: {{interval_secs: 60}}\nresponse_cache: {{enabled: true}}\ntenants:\n  isolate_cache: true\n  secret: test-secret\n  list: {{red: {{}}, blue: {{}}}}\n",
        w.url()
    ))
    .await;
    let addr = router.addr;
    let first = send(addr, &chat_as("red", "what is a cat", "c1")).await;
    assert_eq!(first.header("x-cache"), Some("miss"));
    wait_until("the answer stored", Duration::from_secs(5), || async {
        scrape(addr).await.value(
            "cache_aware_router_response_cache_stores_total",
            &[("result", "stored")],
        ) >= 1.0
    })
    .await;
    let blue = send(addr, &chat_as("blue", "what is a cat", "c2")).await;
    assert_eq!(
        blue.header("x-cache"),
        Some("miss"),
        "another tenant's answer"
    );
    let red = send(addr, &chat_as("red", "what is a cat", "c3")).await;
    assert_eq!(red.header("x-cache"), Some("hit"));
    assert_eq!(w.count(), 2);
    router.shutdown().await;
}

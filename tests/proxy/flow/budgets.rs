//! Token budgets (`tenants.list.NAME.tokens_per_minute`): charged at admission by an
//! estimate, settled from the engine's usage; over budget, 429 with `Retry-After` from
//! the refill and a body naming the limit; other tenants unaffected.

use support::{client::*, observe::*, worker::*};

use crate::common::start_router;

/// An answer whose usage says `prompt` and `completion` tokens.
fn answer(prompt: u64, completion: u64) -> String {
    format!(
        r#"{{"id":"c","object":"chat.completion","choices":[{{"index":0,"message":{{"role":"assistant","content":"ok"}},"finish_reason":"stop"}}],"usage":{{"prompt_tokens":{prompt},"completion_tokens":{completion}}}}}"#
    )
}

fn as_(tenant: &str, prompt: &str) -> Req {
    Req::post("/v1/chat/completions", chat_body(prompt, false)).header("x-tenant-id", tenant)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_over_its_output_budget_gets_429_with_the_refill_time() {
    let body = answer(10, 70);
    let w = FakeWorker::start_with(move |_| Reply::json(200, &body)).await;
    let router = start_router(&format!(
        "workers: [\"{}\"]\nhealth: {{interval_secs: 60}}\ntenants:\n  list:\n    acme: {{tokens_per_minute: {{output: 60}}}}\n    beta: {{}}\n",
        w.url()
    ))
    .await;
    let addr = router.addr;
    assert_eq!(send(addr, &as_("acme", "one")).await.status, 200);
    // 70 generated against 60 a minute: 10 in debt, one token a second.
    let over = send(addr, &as_("acme", "two")).await;
    assert_eq!(over.status, 429, "{}", over.text());
    let retry: u64 = over.header("retry-after").unwrap().parse().unwrap();
    assert!((10..=11).contains(&retry), "Retry-After {retry}");
    let e = &over.json()["error"];
    assert_eq!(e["type"], "budget_exceeded");
    let message = e["message"].as_str().unwrap();
    assert!(
        message.contains("tenants.list.acme.tokens_per_minute.output: 60"),
        "{message}"
    );
    // Another tenant is not limited by it.
    assert_eq!(send(addr, &as_("beta", "three")).await.status, 200);
    assert_eq!(w.count(), 2);
    let m = scrape(addr).await;
    assert_eq!(
        m.value(
            "cache_aware_router_flow_shed_total",
            &[
                ("class", "standard"),
                ("tenant", "acme"),
                ("reason", "budget")
            ]
        ),
        1.0
    );
    assert_eq!(
        m.value(
            "cache_aware_router_flow_tokens_total",
            &[
                ("class", "standard"),
                ("tenant", "acme"),
                ("direction", "output")
            ]
        ),
        70.0
    );
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_input_estimate_is_settled_from_the_engines_count() {
    // The engine counts 900 prompt tokens for a short prompt: the second request finds
    // 100 of 1000 left, less than its own estimate needs only if the settlement landed.
    let body = answer(900, 1);
    let w = FakeWorker::start_with(move |_| Reply::json(200, &body)).await;
    let router = start_router(&format!(
        "workers: [\"{}\"]\nhealth: {{interval_secs: 60}}\ntenants:\n  list:\n    acme: {{tokens_per_minute: {{input: 1000}}}}\n",
        w.url()
    ))
    .await;
    let addr = router.addr;
    let prompt = "x".repeat(800);
    assert_eq!(send(addr, &as_("acme", &prompt)).await.status, 200);
    let over = send(addr, &as_("acme", &prompt)).await;
    assert_eq!(over.status, 429, "{}", over.text());
    assert!(
        over.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("tokens_per_minute.input: 1000")
    );
    router.shutdown().await;
}

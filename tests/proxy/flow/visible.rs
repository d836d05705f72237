//! What an operator sees of flow control: per class and tenant families in `/metrics`
//! (admitted, shed by reason, queued, waits, tokens) with bounded labels, the queue's
//! depths in `GET /workers`, and tenant and class on the access line.

use std::time::Duration;

use serde_json::Value;
use support::binary::Stream;
use support::{client::*, config::*, observe::*, wait::*, worker::*};

use crate::common::start_router;

const USAGE: &str = r#"{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":42,"completion_tokens":7}}"#;

fn as_(tenant: &str, class: &str, tag: &str) -> Req {
    Req::post("/v1/chat/completions", chat_body(tag, false))
        .header("x-tenant-id", tenant)
        .header("x-priority", class)
        .header("x-test-tag", tag)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn families_by_class_and_tenant_and_the_queue_in_workers() {
    let gate = Gate::new();
    let g = gate.clone();
    let w = FakeWorker::start_with(move |r| {
        if r.has_header("x-hold") {
            Reply::json(200, USAGE).after_gate(&g)
        } else {
            Reply::json(200, USAGE)
        }
    })
    .await;
    let router = start_router(&format!(
        "proxy:\n  max_retries: 0\n  queue: {{max_waiting: 1, timeout_ms: 10000}}\nhealth: {{interval_secs: 60}}\nworkers:\n  - url: \"{}\"\n    max_load: 1\ntenants:\n  list: {{acme: {{}}}}\n",
        w.url()
    ))
    .await;
    let addr = router.addr;
    // An unlisted name is `other`: it never becomes a label.
    assert_eq!(
        send(addr, &as_("zz-invented", "batch", "t0")).await.status,
        200
    );
    let holder = {
        let req = as_("acme", "interactive", "t1").header("x-hold", "1");
        tokio::spawn(async move { send(addr, &req).await })
    };
    wait_until("the slot taken", STEP_TIMEOUT, || async {
        get_workers(addr).await["workers"][0]["in_flight"] == 1
    })
    .await;
    let queued = tokio::spawn(async move { send(addr, &as_("acme", "interactive", "t2")).await });
    wait_until("one queued", STEP_TIMEOUT, || async {
        get_workers(addr).await["queue"]["waiting"] == 1
    })
    .await;
    let queue = &get_workers(addr).await["queue"];
    assert_eq!(queue["max_waiting"], 1);
    let interactive = &queue["classes"][1];
    assert_eq!(interactive["class"], "interactive");
    assert_eq!(interactive["waiting"], 1);
    assert_eq!(interactive["tenants"]["acme"], 1, "{queue}");
    let m = scrape(addr).await;
    let acme = |class| [("class", class), ("tenant", "acme")];
    assert_eq!(
        m.value("cache_aware_router_flow_queued", &acme("interactive")),
        1.0
    );
    // Full: a standard request finds nothing less urgent to shed.
    let shed = send(addr, &as_("acme", "standard", "t3")).await;
    assert_eq!(shed.status, 429);
    gate.open();
    assert_eq!(holder.await.unwrap().status, 200);
    assert_eq!(queued.await.unwrap().status, 200);
    wait_all_idle(addr, STEP_TIMEOUT).await;
    let m = scrape(addr).await;
    let v = |name: &str, labels: &[(&str, &str)]| {
        m.value(&format!("cache_aware_router_{name}"), labels)
    };
    assert_eq!(v("flow_admitted_total", &acme("interactive")), 2.0);
    assert_eq!(
        v(
            "flow_admitted_total",
            &[("class", "batch"), ("tenant", "other")]
        ),
        1.0
    );
    assert_eq!(
        v(
            "flow_shed_total",
            &[
                ("class", "standard"),
                ("tenant", "acme"),
                ("reason", "queue_full")
            ]
        ),
        1.0
    );
    assert_eq!(
        v("flow_queue_wait_seconds_count", &acme("interactive")),
        1.0
    );
    let tokens = |dir| {
        v(
            "flow_tokens_total",
            &[
                ("class", "interactive"),
                ("tenant", "acme"),
                ("direction", dir),
            ],
        )
    };
    assert_eq!((tokens("input"), tokens("output")), (84.0, 14.0));
    assert_eq!(v("flow_queued", &acme("interactive")), 0.0);
    // Every class and known tenant has its series from the start; no invented name.
    assert_eq!(
        v(
            "flow_admitted_total",
            &[("class", "critical"), ("tenant", "default")]
        ),
        0.0
    );
    let text = get(addr, "/metrics").await.text();
    assert!(!text.contains("zz-invented"));
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_line_carries_tenant_and_class() {
    let w = FakeWorker::start().await;
    let yaml = yaml_for(
        &[&w],
        "server: {host: 127.0.0.1, port: 0}\nlog: {format: json, level: info}\ntenants:\n  list: {acme: {max_class: standard}}\n",
    );
    let config = TempFile::new("router.yaml", &yaml);
    let router = crate::BINARY.serve(&[&config.path]);
    assert_eq!(
        send(router.addr, &as_("acme", "critical", "a1"))
            .await
            .status,
        200
    );
    let line = wait_for_access_line(&router).await;
    assert_eq!(
        (&line["tenant"], &line["class"]),
        (&Value::from("acme"), &Value::from("standard")),
        "{line}"
    );
}

async fn wait_for_access_line(r: &support::binary::Running) -> Value {
    let lines = || {
        r.lines()
            .into_iter()
            .filter(|(s, _)| *s == Stream::Stderr)
            .filter_map(|(_, l)| serde_json::from_str::<Value>(&l).ok())
            .filter(|v| v["target"] == "cache_aware_router::access")
            .map(|v| v["fields"].clone())
            .collect::<Vec<_>>()
    };
    wait_until("an access line", Duration::from_secs(3), || async {
        !lines().is_empty()
    })
    .await;
    lines().remove(0)
}

//! LoRA adapters: a prompt is keyed by the adapter (and `cache_salt`) it runs under, as
//! the engines key their caches; an adapter stays on few workers (the router's
//! residency estimate within `max_lora` slots); `adapters.load_on_demand` loads an
//! adapter once per worker, never twice at once, and a failed load goes to the next
//! worker or ends in a JSON error; SGLang workers get `model: "base:adapter"`.

use std::collections::{BTreeMap, BTreeSet};

use support::{client::*, engine::*, observe::*, wait::*, worker::*};

use crate::common::start_router;
use crate::models::{chat_for, lists_read};

const PREFIX: &str = "cache_aware_router_prefix_tokens_total";
const DECISIONS: &str = "cache_aware_router_routing_decisions_total";
const LOADS: &str = "cache_aware_router_lora_loads_total";

/// YAML: `extra`, then `workers` with `max_lora: slots` each.
fn yaml(workers: &[&FakeWorker], slots: usize, extra: &str) -> String {
    let mut y = format!("{extra}\nworkers:\n");
    for w in workers {
        y.push_str(&format!(
            "  - {{url: \"{}\", max_lora: {slots}}}\n",
            w.url()
        ));
    }
    y
}

fn long_prompt(topic: &str) -> String {
    let mut p = format!("{topic}. ");
    while p.len() < 4096 {
        p.push_str("Answer in plain words and cite the manual section you used. ");
    }
    p
}

/// Σ over workers of `prefix_tokens_total{kind}` (cache_aware).
fn prefix_sum(m: &Scrape, kind: &str) -> f64 {
    m.all(PREFIX)
        .iter()
        .filter(|s| s.labels.iter().any(|(k, v)| k == "kind" && v == kind))
        .map(|s| s.value)
        .sum()
}

fn hits(m: &Scrape) -> f64 {
    m.value(DECISIONS, &[("reason", "cache_hit")])
}

/// A chat request for `model` with `text`, with `cache_salt` when given.
fn salted(model: &str, text: &str, salt: Option<&str>) -> Req {
    let mut body = serde_json::json!({"model": model,
        "messages": [{"role": "user", "content": text}]});
    if let Some(s) = salt {
        body["cache_salt"] = s.into();
    }
    Req::post("/v1/chat/completions", body.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_is_a_hit_only_under_the_adapter_and_salt_it_was_served_under() {
    let list = ["tiny", "sql@tiny", "chat@tiny"];
    let a = FakeWorker::builder()
        .serving(&list)
        .reply(caching_engine())
        .start()
        .await;
    let b = FakeWorker::builder()
        .serving(&list)
        .reply(caching_engine())
        .start()
        .await;
    let router = start_router(&yaml(&[&a, &b], 2, "policy: cache_aware")).await;
    lists_read(router.addr).await;
    let (addr, ws) = (router.addr, [&a, &b]);
    let p = long_prompt("The shared question");
    let step = |req: Req| async move {
        let (r, by) = send_tagged(addr, &ws, req).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let m = scrape(addr).await;
        (
            by,
            hits(&m),
            prefix_sum(&m, "predicted"),
            prefix_sum(&m, "delivered"),
        )
    };
    // Cold, then warm under one adapter: predicted and delivered.
    let (first, h, pred, got) = step(salted("sql", &p, None)).await;
    assert_eq!((h, pred, got), (0.0, 0.0, 0.0));
    let (again, h, pred, got) = step(salted("sql", &p, None)).await;
    assert_eq!((again, h), (first, 1.0), "a hit under the same adapter");
    assert!(pred > 0.0 && got > 0.0, "predicted {pred}, delivered {got}");
    assert!(
        (got - pred).abs() <= 0.25 * got,
        "the engine agrees: predicted {pred}, delivered {got}"
    );
    // The same prompt under another adapter, the base model, another salt: the
    // engine reuses nothing, and the router predicts nothing.
    for req in [
        salted("chat", &p, None),
        salted("tiny", &p, None),
        salted("sql", &p, Some("tenant-7")),
    ] {
        let (_, h2, pred2, got2) = step(req).await;
        assert_eq!(h2, 1.0, "never a predicted hit across scopes");
        assert_eq!(
            (pred2, got2),
            (pred, got),
            "nothing predicted, nothing delivered"
        );
    }
    // Each of those is a hit under its own scope the second time.
    let (_, h, pred3, got3) = step(salted("chat", &p, None)).await;
    assert_eq!(h, 2.0);
    assert!(pred3 > pred && got3 > got);
    let (_, h, _, _) = step(salted("sql", &p, Some("tenant-7"))).await;
    assert_eq!(h, 3.0);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn residency_keeps_each_adapter_on_one_worker_while_they_keep_up() {
    let adapters: Vec<String> = (0..8).map(|i| format!("lora-{i}")).collect();
    let mut list = vec!["tiny".to_string()];
    list.extend(adapters.iter().map(|a| format!("{a}@tiny")));
    let list: Vec<&str> = list.iter().map(String::as_str).collect();
    let mut workers = Vec::new();
    for _ in 0..4 {
        workers.push(FakeWorker::builder().serving(&list).start().await);
    }
    let ws: Vec<&FakeWorker> = workers.iter().collect();
    let router = start_router(&yaml(&ws, 2, "policy: cache_aware")).await;
    lists_read(router.addr).await;
    // 8 adapters over 4 workers of 2 slots, in a mixed order, every prompt new (no
    // prefix affinity to follow).
    let mut on: BTreeMap<&str, BTreeSet<usize>> = BTreeMap::new();
    for i in 0..96usize {
        let adapter = &adapters[(i * 5 + i / 8) % 8];
        let (r, by) = send_tagged(
            router.addr,
            &ws,
            chat_for(Some(adapter), &format!("request {i} about its own topic")),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
        on.entry(adapter).or_default().insert(by);
    }
    for (adapter, workers) in &on {
        assert_eq!(workers.len(), 1, "{adapter} went to workers {workers:?}");
    }
    let m = scrape(router.addr).await;
    let placed = |p: &str| -> f64 {
        m.all("cache_aware_router_worker_lora_requests_total")
            .iter()
            .filter(|s| s.labels.iter().any(|(k, v)| k == "placement" && v == p))
            .map(|s| s.value)
            .sum()
    };
    assert_eq!(placed("evicting"), 0.0, "no adapter evicted another");
    assert_eq!(placed("free_slot"), 8.0, "each adapter placed once");
    assert_eq!(placed("resident"), 88.0);
    let w = get_workers(router.addr).await;
    for worker in w["workers"].as_array().unwrap() {
        let lora = &worker["lora"];
        assert_eq!(lora["slots"], 2, "{lora}");
        assert_eq!(lora["resident"].as_array().unwrap().len(), 2, "{lora}");
    }
    router.shutdown().await;
}

/// Two workers of `tiny` that load adapters (held until `gate` opens), and a router
/// that loads `x` on demand from `source`.
async fn loading(gate: &Gate, source: &str) -> ([FakeWorker; 2], String) {
    let a = FakeWorker::builder()
        .serving(&["tiny"])
        .lora_loads(gate)
        .start()
        .await;
    let b = FakeWorker::builder()
        .serving(&["tiny"])
        .lora_loads(gate)
        .start()
        .await;
    let extra = format!(
        "adapters:\n  load_on_demand: true\n  sources:\n    x: {source}\nmodels:\n  refresh_secs: 3600\nproxy:\n  max_retries: 1\n"
    );
    let y = yaml(&[&a, &b], 2, &extra);
    ([a, b], y)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_on_demand_loads_an_adapter_once_per_worker_and_never_twice_at_once() {
    let gate = Gate::new();
    let ([a, b], y) = loading(&gate, "/adapters/x").await;
    let router = start_router(&y).await;
    lists_read(router.addr).await;
    let addr = router.addr;
    let n = 6;
    let mut clients = Vec::new();
    for i in 0..n {
        clients.push(tokio::spawn(async move {
            send(addr, &chat_for(Some("x"), &format!("question {i}"))).await
        }));
    }
    // Every request has its worker and waits for the load there.
    wait_until(
        "all requests waiting on their loads",
        STEP_TIMEOUT,
        || async { in_flight(addr).await.iter().sum::<u64>() == n as u64 },
    )
    .await;
    let (la, lb) = (a.loads().len(), b.loads().len());
    assert!(la <= 1 && lb <= 1, "loads at once: {la} and {lb}");
    assert!(la + lb >= 1);
    gate.open();
    for c in clients {
        let r = c.await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    }
    // More requests find it loaded.
    for i in 0..6 {
        let r = send(addr, &chat_for(Some("x"), &format!("later {i}"))).await;
        assert_eq!(r.status, 200);
    }
    let (la, lb) = (a.loads().len(), b.loads().len());
    assert!(la <= 1 && lb <= 1, "loads in all: {la} and {lb}");
    for l in a.loads().iter().chain(b.loads().iter()) {
        assert_eq!(l.target, "/v1/load_lora_adapter");
        let body: serde_json::Value = serde_json::from_slice(&l.body).unwrap();
        assert_eq!(body["lora_name"], "x");
        assert_eq!(body["lora_path"], "/adapters/x");
    }
    assert_eq!(a.count() + b.count(), 12, "every request answered once");
    let m = scrape(addr).await;
    let ok: f64 = m
        .all(LOADS)
        .iter()
        .filter(|s| s.labels.iter().any(|(k, v)| k == "result" && v == "ok"))
        .map(|s| s.value)
        .sum();
    assert_eq!(ok as usize, la + lb, "counted in /metrics");
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_load_goes_to_the_next_worker_then_ends_in_a_json_error() {
    let gate = Gate::new();
    gate.open();
    // Every worker refuses: the client is told why, naming the adapter.
    let ([a, b], y) = loading(&gate, "/adapters/missing-x").await;
    let router = start_router(&y).await;
    lists_read(router.addr).await;
    let r = send(router.addr, &chat_for(Some("x"), "hello")).await;
    assert_eq!(r.status, 502, "{}", r.text());
    let e = &r.json()["error"];
    assert_eq!(e["type"], "adapter_load_failed", "{e}");
    assert_eq!(e["param"], "model");
    let msg = e["message"].as_str().unwrap();
    assert!(msg.contains("`x`") && msg.contains("404"), "{msg}");
    assert_eq!((a.loads().len(), b.loads().len()), (1, 1), "both tried");
    assert_eq!(a.count() + b.count(), 0, "no request without its adapter");
    router.shutdown().await;

    // One worker cannot load at all (vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING):
    // its requests go to the other.
    let refuses = FakeWorker::builder()
        .serving(&["tiny"])
        .reply(|r| {
            if r.target.ends_with("load_lora_adapter") {
                Reply::json(404, r#"{"detail":"Not Found"}"#)
            } else {
                Reply::ok()
            }
        })
        .start()
        .await;
    let loads = FakeWorker::builder()
        .serving(&["tiny"])
        .lora_loads(&gate)
        .start()
        .await;
    let extra = "adapters:\n  load_on_demand: true\n  sources: {x: /adapters/x}\nproxy:\n  max_retries: 1\n";
    let router = start_router(&yaml(&[&refuses, &loads], 1, extra)).await;
    lists_read(router.addr).await;
    for i in 0..6 {
        let r = send(router.addr, &chat_for(Some("x"), &format!("q{i}"))).await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let tried = refuses.requests();
    assert!(
        tried
            .iter()
            .all(|r| r.target.ends_with("load_lora_adapter")),
        "only load attempts reached the worker that cannot load"
    );
    assert!(
        tried.len() <= 1,
        "passed over once it failed: {}",
        tried.len()
    );
    assert_eq!(loads.count(), 6);
    assert_eq!(loads.loads().len(), 1);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_workers_get_base_colon_adapter_and_load_at_their_own_path() {
    let gate = Gate::new();
    gate.open();
    let sglang = r#"{"object":"list","data":[
        {"id":"tiny","object":"model","owned_by":"sglang","root":"tiny","max_model_len":4096},
        {"id":"sql","object":"model","owned_by":"sglang","root":"/a/sql","parent":"tiny"}]}"#;
    let w = FakeWorker::builder()
        .listing(sglang)
        .lora_loads(&gate)
        .start()
        .await;
    let extra = "adapters:\n  load_on_demand: true\n  sources: {chat: /a/chat}\n";
    let router = start_router(&yaml(&[&w], 4, extra)).await;
    lists_read(router.addr).await;
    for (asked, sent) in [("sql", "tiny:sql"), ("chat", "tiny:chat"), ("tiny", "tiny")] {
        let r = send(router.addr, &chat_for(Some(asked), "hi")).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let last = w.requests().pop().unwrap();
        let body: serde_json::Value = serde_json::from_slice(&last.body).unwrap();
        assert_eq!(body["model"], sent, "{asked}");
    }
    let loads = w.loads();
    assert_eq!(loads.len(), 1);
    assert_eq!(loads[0].target, "/load_lora_adapter", "SGLang's path");
    router.shutdown().await;
}

//! Several models behind one router: a request goes only to workers that serve its
//! `model` (learned from their `GET /v1/models`, or pinned), on every routed endpoint;
//! unknown and missing models; aliases with weights; lists that change; one pool per
//! model (its own memory and settings, one in-flight count per worker); per-model
//! metrics labelled only by known names.

use std::time::Duration;

use support::{client::*, config::*, wait::*, worker::*};

use crate::common::start_router;

/// Waits until the router has read every worker's list (none is `unread`) and routes
/// by them (each listed name is in a pool).
pub(crate) async fn lists_read(addr: std::net::SocketAddr) {
    wait_until(
        "every worker's model list read",
        STEP_TIMEOUT,
        || async move {
            let w = get(addr, "/workers").await.json();
            let Some(workers) = w["workers"].as_array() else {
                return false;
            };
            let routed: Vec<&serde_json::Value> = w["pools"]
                .as_array()
                .into_iter()
                .flatten()
                .flat_map(|p| p["models"].as_array().into_iter().flatten())
                .collect();
            workers.iter().all(|w| {
                let m = &w["models"];
                m["source"] != "unread"
                    && m["models"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .all(|id| routed.contains(&id))
            })
        },
    )
    .await;
}

/// A chat request for `model` (`None`: no `model` member) with `text`.
pub(crate) fn chat_for(model: Option<&str>, text: &str) -> Req {
    let mut body = serde_json::json!({"messages": [{"role": "user", "content": text}]});
    if let Some(m) = model {
        body["model"] = m.into();
    }
    Req::post("/v1/chat/completions", body.to_string())
}

/// Which of `workers` got each of `n` requests for `model` on `path` (body `body(i)`).
async fn spread(
    addr: std::net::SocketAddr,
    workers: &[&FakeWorker],
    n: usize,
    req: impl Fn(usize) -> Req,
) -> Vec<usize> {
    let mut got = vec![0; workers.len()];
    for i in 0..n {
        let (resp, by) = send_tagged(addr, workers, req(i)).await;
        assert_eq!(resp.status, 200, "{}", resp.text());
        got[by] += 1;
    }
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_go_only_to_workers_that_serve_their_model_on_every_endpoint() {
    let a = FakeWorker::builder().serving(&["llama"]).start().await;
    let b = FakeWorker::builder()
        .serving(&["llama", "qwen"])
        .start()
        .await;
    let c = FakeWorker::builder().serving(&["qwen"]).start().await;
    let router = start_router(&yaml_for(&[&a, &b, &c], "policy: round_robin\n")).await;
    lists_read(router.addr).await;
    let ws = [&a, &b, &c];
    for (path, body) in [
        (
            "/v1/chat/completions",
            r#"{"model":"M","messages":[{"role":"user","content":"hi"}]}"#,
        ),
        ("/v1/completions", r#"{"model":"M","prompt":"hi"}"#),
        (
            "/v1/messages",
            r#"{"model":"M","max_tokens":4,"messages":[{"role":"user","content":"hi"}]}"#,
        ),
        ("/v1/responses", r#"{"model":"M","input":"hi"}"#),
    ] {
        let llama = spread(router.addr, &ws, 8, |_| {
            Req::post(path, body.replace('M', "llama"))
        })
        .await;
        assert_eq!(
            llama[2], 0,
            "{path}: qwen's worker got a llama request: {llama:?}"
        );
        assert!(llama[0] > 0 && llama[1] > 0, "{path}: {llama:?}");
        let qwen = spread(router.addr, &ws, 8, |_| {
            Req::post(path, body.replace('M', "qwen"))
        })
        .await;
        assert_eq!(
            qwen[0], 0,
            "{path}: llama's worker got a qwen request: {qwen:?}"
        );
        assert!(qwen[1] > 0 && qwen[2] > 0, "{path}: {qwen:?}");
    }
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_model_is_a_404_naming_it_that_reaches_no_worker_and_labels_no_metric() {
    let a = FakeWorker::builder().serving(&["llama"]).start().await;
    let router = start_router(&yaml_for(&[&a], "proxy:\n  max_retries: 3\n")).await;
    lists_read(router.addr).await;
    let resp = send(router.addr, &chat_for(Some("gpt-zz-secret-name"), "hi")).await;
    assert_eq!(resp.status, 404, "{}", resp.text());
    let e = &resp.json()["error"];
    assert_eq!(e["type"], "model_not_found", "{}", resp.text());
    assert_eq!(e["param"], "model");
    assert_eq!(e["code"], 404);
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("gpt-zz-secret-name"),
        "{e}"
    );
    assert!(!resp.has_header("retry-after"), "no invitation to retry");
    assert_eq!(a.count(), 0, "never another model's worker");
    let metrics = get(router.addr, "/metrics").await.text();
    assert!(
        !metrics.contains("gpt-zz-secret-name"),
        "a client's string became a label"
    );
    assert!(
        metrics.contains("cache_aware_router_model_not_found_total 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"cache_aware_router_model_workers{model="llama"} 1"#),
        "{metrics}"
    );
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_model_goes_to_the_default_or_the_only_model_else_is_a_400() {
    // One model: it takes the request, and the forwarded body names it.
    let a = FakeWorker::builder().serving(&["llama"]).start().await;
    let router = start_router(&yaml_for(&[&a], "")).await;
    lists_read(router.addr).await;
    let resp = send(router.addr, &chat_for(None, "hi")).await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    let sent: serde_json::Value = serde_json::from_slice(&a.requests()[0].body).unwrap();
    assert_eq!(sent["model"], "llama");
    router.shutdown().await;

    // Two models, no default: 400 naming both.
    let b = FakeWorker::builder().serving(&["qwen"]).start().await;
    let router = start_router(&yaml_for(&[&a, &b], "")).await;
    lists_read(router.addr).await;
    let resp = send(router.addr, &chat_for(None, "hi")).await;
    assert_eq!(resp.status, 400, "{}", resp.text());
    let message = resp.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        message.contains("`llama`") && message.contains("`qwen`"),
        "{message}"
    );
    assert_eq!(resp.json()["error"]["param"], "model");
    router.shutdown().await;

    // Two models and `models.default`.
    let router = start_router(&yaml_for(&[&a, &b], "models:\n  default: qwen\n")).await;
    lists_read(router.addr).await;
    let resp = send(router.addr, &chat_for(None, "hi")).await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    let sent: serde_json::Value = serde_json::from_slice(&b.requests()[0].body).unwrap();
    assert_eq!(sent["model"], "qwen");
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_alias_splits_90_10_and_the_forwarded_body_carries_the_served_name() {
    let stable = FakeWorker::builder().serving(&["llama-v1"]).start().await;
    let canary = FakeWorker::builder().serving(&["llama-v2"]).start().await;
    let yaml = yaml_for(
        &[&stable, &canary],
        "models:\n  aliases:\n    chat: [{model: llama-v1, weight: 90}, {model: llama-v2, weight: 10}]\n",
    );
    let router = start_router(&yaml).await;
    lists_read(router.addr).await;
    let addr = router.addr;
    let tasks: Vec<_> = (0..8)
        .map(|t| {
            tokio::spawn(async move {
                for i in 0..125 {
                    let body = format!(r#"{{"model" : "chat","messages":[{{"role":"user","content":"q {t} {i}"}}]}}"#);
                    let resp = post(addr, "/v1/chat/completions", body).await;
                    assert_eq!(resp.status, 200, "{}", resp.text());
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let (v1, v2) = (stable.count(), canary.count());
    assert_eq!(v1 + v2, 1000);
    assert!(
        (870..=930).contains(&v1),
        "90 % ± 3 %: {v1} to the stable, {v2} to the canary"
    );
    for (w, name) in [(&stable, "llama-v1"), (&canary, "llama-v2")] {
        for r in w.requests() {
            let body = r.body_str();
            assert!(
                body.starts_with(&format!(r#"{{"model" : "{name}","messages""#)),
                "{body}"
            );
        }
    }
    // The alias is in the fleet's list too.
    let list = get(router.addr, "/v1/models").await.json();
    let ids: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["llama-v1", "llama-v2", "chat"]);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_stops_listing_a_model_stops_getting_it_within_one_refresh() {
    let a = FakeWorker::builder().serving(&["llama"]).start().await;
    let b = FakeWorker::builder().serving(&["llama"]).start().await;
    let router = start_router(&yaml_for(
        &[&a, &b],
        "policy: round_robin\nmodels:\n  refresh_secs: 0.1\n",
    ))
    .await;
    lists_read(router.addr).await;
    let before = spread(router.addr, &[&a, &b], 6, |i| {
        chat_for(Some("llama"), &format!("x{i}"))
    })
    .await;
    assert!(before[0] > 0, "{before:?}");
    a.serve_models(Some(&["other"]));
    // One read after the change is one refresh.
    let reads = a.model_reads().len();
    a.wait_for_model_reads(reads + 2).await;
    let after = spread(router.addr, &[&a, &b], 10, |i| {
        chat_for(Some("llama"), &format!("y{i}"))
    })
    .await;
    assert_eq!(after, [0, 10], "a no longer lists llama");
    let resp = send(router.addr, &chat_for(Some("other"), "z")).await;
    assert_eq!(
        resp.status,
        200,
        "its new model is routed to it: {}",
        resp.text()
    );
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_list_cannot_be_read_serves_any_model_and_workers_says_so() {
    let listing = FakeWorker::builder()
        .serving(&["llama", "sql@llama"])
        .start()
        .await;
    let unlisted = FakeWorker::builder()
        .models(|_| Reply::json(404, r#"{"detail":"Not Found"}"#))
        .start()
        .await;
    let router = start_router(&yaml_for(&[&listing, &unlisted], "policy: round_robin\n")).await;
    lists_read(router.addr).await;
    let w = get(router.addr, "/workers").await.json();
    let m0 = &w["workers"][0]["models"];
    assert_eq!(m0["source"], "listed", "{w}");
    assert_eq!(m0["serves_any"], false);
    assert_eq!(m0["models"], serde_json::json!(["llama"]));
    assert_eq!(
        m0["adapters"],
        serde_json::json!([{"id": "sql", "parent": "llama"}])
    );
    assert!(m0["read_at"].as_f64().unwrap() > 1.0e9, "{m0}");
    let m1 = &w["workers"][1]["models"];
    assert_eq!(m1["source"], "unreadable", "{w}");
    assert_eq!(m1["serves_any"], true);
    assert!(m1["error"].as_str().unwrap().contains("404"), "{m1}");
    // It takes llama's requests too, and alone those for models nobody lists.
    let llama = spread(router.addr, &[&listing, &unlisted], 6, |i| {
        chat_for(Some("llama"), &format!("a{i}"))
    })
    .await;
    assert!(llama[0] > 0 && llama[1] > 0, "{llama:?}");
    let other = spread(router.addr, &[&listing, &unlisted], 4, |i| {
        chat_for(Some("mistral"), &format!("b{i}"))
    })
    .await;
    assert_eq!(other, [0, 4]);
    // The adapter goes to the worker that lists it (or one that serves any).
    let sql = spread(router.addr, &[&listing, &unlisted], 6, |i| {
        chat_for(Some("sql"), &format!("c{i}"))
    })
    .await;
    assert!(sql[0] > 0, "{sql:?}");
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pinned_models_are_never_read_and_route_as_listed_ones() {
    let a = FakeWorker::start().await;
    let b = FakeWorker::start().await;
    let yaml = format!(
        "policy: round_robin\nhealth:\n  interval_secs: 0.05\nworkers:\n  - url: {}\n    models: [llama]\n  - url: {}\n    models: [qwen]\n",
        a.url(),
        b.url()
    );
    let router = start_router(&yaml).await;
    a.wait_for_probes(3).await;
    let got = spread(router.addr, &[&a, &b], 4, |i| {
        chat_for(Some("qwen"), &format!("q{i}"))
    })
    .await;
    assert_eq!(got, [0, 4]);
    assert!(
        a.model_reads().is_empty() && b.model_reads().is_empty(),
        "pinned: never asked"
    );
    let w = get(router.addr, "/workers").await.json();
    assert_eq!(w["workers"][0]["models"]["source"], "pinned");
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_model_has_a_pool_with_its_own_memory_and_settings() {
    let a = FakeWorker::builder().serving(&["llama"]).start().await;
    let b = FakeWorker::builder()
        .serving(&["llama", "qwen"])
        .start()
        .await;
    let yaml = yaml_for(
        &[&a, &b],
        "models:\n  overrides:\n    qwen: {policy: least_load}\n    llama: {cache: {threshold: 0.9}}\n",
    );
    let router = start_router(&yaml).await;
    lists_read(router.addr).await;
    let long = "the same long prompt about rivers and their cities ".repeat(20);
    for _ in 0..3 {
        assert_eq!(
            send(router.addr, &chat_for(Some("llama"), &long))
                .await
                .status,
            200
        );
    }
    let w = get(router.addr, "/workers").await.json();
    let pools = w["pools"].as_array().unwrap();
    let pool = |name: &str| {
        pools
            .iter()
            .find(|p| p["name"] == name)
            .unwrap_or_else(|| panic!("{w}"))
    };
    assert_eq!(pool("llama")["policy"], "cache_aware");
    assert!(pool("llama")["tree_nodes"].as_u64().unwrap() > 0, "{w}");
    assert_eq!(pool("qwen")["policy"], "least_load", "its override");
    assert_eq!(pool("qwen")["models"], serde_json::json!(["qwen"]));
    assert_eq!(pool("default")["tree_nodes"], 0, "{w}");
    let metrics = get(router.addr, "/metrics").await.text();
    assert!(
        metrics.contains(r#"cache_aware_router_model_requests_total{model="llama"} 3"#),
        "{metrics}"
    );
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with(r#"cache_aware_router_tree_nodes{model="llama"}"#)),
        "the pool's tree, labelled by its model: {metrics}"
    );
    assert_eq!(
        metrics
            .matches("# TYPE cache_aware_router_tree_nodes ")
            .count(),
        1,
        "one family, every pool's series in it"
    );
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_serving_two_models_has_one_in_flight_count_and_max_load() {
    let gate = Gate::new();
    let held = gate.clone();
    let shared = FakeWorker::builder()
        .serving(&["llama", "qwen"])
        .reply(move |r| {
            if r.body_str().contains("hold") {
                Reply::ok().after_gate(&held)
            } else {
                Reply::ok()
            }
        })
        .start()
        .await;
    let other = FakeWorker::builder().serving(&["qwen"]).start().await;
    let yaml = format!(
        "policy: round_robin\nworkers:\n  - url: {}\n    max_load: 1\n  - url: {}\n",
        shared.url(),
        other.url()
    );
    let router = start_router(&yaml).await;
    lists_read(router.addr).await;
    let addr = router.addr;
    let holding = tokio::spawn(async move { send(addr, &chat_for(Some("llama"), "hold")).await });
    shared.wait_for_requests(1).await;
    // Full for llama, so full for qwen: every qwen request goes to the other worker.
    let got = spread(router.addr, &[&shared, &other], 6, |i| {
        chat_for(Some("qwen"), &format!("q{i}"))
    })
    .await;
    assert_eq!(got, [0, 6]);
    gate.open();
    assert_eq!(
        within("the held request", holding).await.unwrap().status,
        200
    );
    let got = spread(router.addr, &[&shared, &other], 6, |i| {
        chat_for(Some("qwen"), &format!("r{i}"))
    })
    .await;
    assert!(got[0] > 0, "free again: {got:?}");
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_joins_is_read_at_once_and_brings_its_model() {
    let a = FakeWorker::builder().serving(&["llama"]).start().await;
    let b = FakeWorker::builder().serving(&["qwen"]).start().await;
    let token = "t0k3n";
    let router = start_router(&yaml_for(
        &[&a],
        &format!("server:\n  admin_token: {token}\nmodels:\n  refresh_secs: 3600\n"),
    ))
    .await;
    lists_read(router.addr).await;
    assert_eq!(
        send(router.addr, &chat_for(Some("qwen"), "x")).await.status,
        404
    );
    let added = send(
        router.addr,
        &Req::post("/workers", format!(r#"{{"url":"{}"}}"#, b.url()))
            .header("Authorization", &format!("Bearer {token}")),
    )
    .await;
    assert!(added.status < 300, "{}", added.text());
    wait_until(
        "the new worker's model routed",
        Duration::from_secs(5),
        || async { send(router.addr, &chat_for(Some("qwen"), "y")).await.status == 200 },
    )
    .await;
    assert!(b.count() >= 1 && a.requests().iter().all(|r| !r.body_str().contains("qwen")));
    router.shutdown().await;
}

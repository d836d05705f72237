//! `GET /v1/models`: the fleet's list (the union of the usable workers' lists, one entry
//! per id, following their changes), forwarded to a worker that is up when no list can
//! be read, 503 when no worker is.

use support::{client::*, config::*, wait::*, worker::*};

use crate::common::start_router;

/// The ids `GET /v1/models` lists, in order.
async fn ids(addr: std::net::SocketAddr) -> Vec<String> {
    let resp = get(addr, "/v1/models").await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(resp.header("content-type"), Some("application/json"));
    resp.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_are_the_union_of_the_usable_workers_lists_one_entry_per_id() {
    let a = FakeWorker::builder()
        .serving(&["llama", "l3=llama", "sql@llama"])
        .start()
        .await;
    let b = FakeWorker::builder()
        .serving(&["llama", "qwen"])
        .start()
        .await;
    let router = start_router(&yaml_for(&[&a, &b], "")).await;
    let addr = router.addr;
    wait_until("both lists read", STEP_TIMEOUT, || async move {
        ids(addr).await.len() == 4
    })
    .await;
    assert_eq!(ids(addr).await, ["llama", "l3", "sql", "qwen"]);
    let list = get(addr, "/v1/models").await.json();
    assert_eq!(list["object"], "list");
    let sql = &list["data"][2];
    assert_eq!(sql["parent"], "llama", "an adapter with its parent: {sql}");
    assert_eq!(
        list["data"][0]["max_model_len"], 4096,
        "entries as the worker listed them"
    );
    // The router answers it: no worker saw a client's GET /v1/models beyond its reads.
    assert_eq!(a.count() + b.count(), 0);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_follow_the_workers_lists_and_leave_with_an_unhealthy_worker() {
    let a = FakeWorker::builder().serving(&["llama"]).start().await;
    let b = FakeWorker::builder()
        .serving(&["qwen"])
        .health(|_| Reply::status(503))
        .start()
        .await;
    let router = start_router(&yaml_for(
        &[&a, &b],
        "models:\n  refresh_secs: 0.05\nhealth:\n  interval_secs: 0.05\n  failure_threshold: 1\n",
    ))
    .await;
    let addr = router.addr;
    wait_until("a's list read, b unhealthy", STEP_TIMEOUT, || async move {
        ids(addr).await == ["llama"]
    })
    .await;
    a.serve_models(Some(&["llama", "mistral"]));
    wait_until("a new model listed", STEP_TIMEOUT, || async move {
        ids(addr).await == ["llama", "mistral"]
    })
    .await;
    a.serve_models(Some(&["mistral"]));
    wait_until("a model that left is gone", STEP_TIMEOUT, || async move {
        ids(addr).await == ["mistral"]
    })
    .await;
    router.shutdown().await;
}

// C21: the first listed worker is down; its peer answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_are_forwarded_to_a_worker_that_is_up_when_no_list_can_be_read() {
    const LIST: &str = r#"{"weird":"shape"}"#;
    let b = FakeWorker::builder()
        .models(|_| Reply::json(200, LIST))
        .start()
        .await;
    // The down worker is listed first and tried first about half the time.
    let urls = [closed_port_url(), b.url()];
    let router = start_router(&yaml_for_urls(&urls, "")).await;
    for i in 0..6 {
        let resp = get(router.addr, "/v1/models").await;
        assert_eq!(resp.status, 200, "call {i}: {}", resp.text());
        assert_eq!(resp.text(), LIST);
    }
    router.shutdown().await;
}

// C21: with every worker down, 503 with a JSON error, never 500.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_with_every_worker_down_answer_503_json() {
    let urls = closed_port_urls::<2>();
    let router = start_router(&yaml_for_urls(&urls, "")).await;
    let resp = get(router.addr, "/v1/models").await;
    assert_eq!(resp.status, 503, "{}", resp.text());
    assert!(
        resp.json()["error"]["message"].is_string(),
        "{}",
        resp.text()
    );
    router.shutdown().await;
}

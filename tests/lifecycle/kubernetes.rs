//! Kubernetes discovery as an operator sees it: the built router, configured through a
//! kubeconfig (`KUBECONFIG`), follows the EndpointSlices of a fake API server
//! (tests/support/kube_api.rs: list, then watch): a ready endpoint joins, a not-ready one
//! does not, one that turns not-ready leaves while a request is in flight on it (the
//! request completes), a flapping one ends where it settled, a deleted slice takes its
//! workers away.

use std::time::Duration;

use support::kube_api::{FakeKubeApi, slice};
use support::{client::*, config::*, observe::*, wait::*, worker::*};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_follow_ready_endpoints_of_the_slices() {
    let gate = Gate::new();
    let (a, b) = workers_on_one_port(&gate).await;
    let port = a.port();
    let (ua, ub) = (
        format!("http://127.0.0.2:{port}"),
        format!("http://127.0.0.3:{port}"),
    );
    // A ready, B not ready yet.
    let api = FakeKubeApi::start(&[slice(
        "vllm-1",
        port,
        &[("127.0.0.2", true), ("127.0.0.3", false)],
    )])
    .await;
    let kubeconfig = api.kubeconfig();
    let config = TempFile::new(
        "k8s.yaml",
        "server: {host: 127.0.0.1, port: 0}\nlog: {format: json}\nhealth: {interval_secs: 3600}\ndiscovery:\n  kubernetes: {label_selector: app=vllm, port_name: http}\n",
    );
    let kc = kubeconfig.path.display().to_string();
    let router = crate::BINARY.serve_with_env(&[&config.path], &[("KUBECONFIG", kc.as_str())]);
    let r = router.addr;
    wait_until(
        "A discovered from the list",
        Duration::from_secs(10),
        || async { worker_urls(r).await == vec![ua.clone()] },
    )
    .await;
    let long = long_prompt_served_by_first(r, &[&a, &b]).await;

    // B turns ready: joins through the watch.
    api.apply(slice(
        "vllm-1",
        port,
        &[("127.0.0.2", true), ("127.0.0.3", true)],
    ));
    wait_until("B joins", Duration::from_secs(10), || async {
        worker_urls(r).await.len() == 2
    })
    .await;

    // A turns not ready with a request in flight on it: it leaves, the request completes.
    let pending = spawn_chat(r, format!("{long} hold"));
    a.wait_for_requests(2).await;
    api.apply(slice(
        "vllm-1",
        port,
        &[("127.0.0.2", false), ("127.0.0.3", true)],
    ));
    wait_until("A leaves", Duration::from_secs(10), || async {
        worker_urls(r).await == vec![ub.clone()]
    })
    .await;
    let (resp, by) = send_tagged(
        r,
        &[&a, &b],
        Req::post("/v1/chat/completions", chat_body("q", false)),
    )
    .await;
    assert_eq!((resp.status, by), (200, 1), "only B takes new requests");
    gate.open();
    assert_eq!(
        within("the request on the leaving worker", pending)
            .await
            .unwrap()
            .status,
        200
    );

    // A flaps: ready, not ready, ready again; it ends in the pool.
    for ready in [true, false, true] {
        api.apply(slice(
            "vllm-1",
            port,
            &[("127.0.0.2", ready), ("127.0.0.3", true)],
        ));
    }
    wait_until("A back after flapping", Duration::from_secs(10), || async {
        worker_urls(r).await.len() == 2
    })
    .await;

    // The slice is deleted: its workers go, and the router says there is none.
    api.delete("vllm-1");
    wait_until("no workers", Duration::from_secs(10), || async {
        worker_urls(r).await.is_empty()
    })
    .await;
    let resp = post(r, "/v1/chat/completions", chat_body("x", false)).await;
    assert_eq!(resp.status, 503, "{}", resp.text());
    let (lists, watches) = api.calls();
    assert!(
        lists >= 1 && watches >= 1,
        "list then watch: {lists} / {watches}"
    );
}

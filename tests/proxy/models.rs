//! `GET /v1/models`: answered by a worker that is up, cached, 503 when none is.

use support::{client::*, config::*, worker::*};

use crate::common::start_router;

const MODELS_B: &str = r#"{"object":"list","data":[{"id":"model-b","object":"model"}]}"#;

fn models_server(list: &'static str) -> impl Fn(&Recorded) -> Reply + Send + Sync + 'static {
    move |req| {
        if req.target == "/v1/models" {
            Reply::json(200, list)
        } else {
            Reply::ok()
        }
    }
}

// C21
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_are_served_by_a_worker_that_is_up_when_the_first_is_down() {
    let b = FakeWorker::start_with(models_server(MODELS_B)).await;
    // Caching off, so that each call picks a worker again; the down worker is listed
    // first and tried first about half the time.
    let urls = [closed_port_url(), b.url()];
    let router = start_router(&yaml_for_urls(&urls, "proxy:\n  models_cache_secs: 0\n")).await;
    for i in 0..6 {
        let resp = get(router.addr, "/v1/models").await;
        assert_eq!(resp.status, 200, "call {i}: {}", resp.text());
        assert_eq!(resp.text(), MODELS_B);
    }
    assert_eq!(b.count(), 6);
    router.shutdown().await;
}

// C21, every worker down
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_answer_is_cached_and_reused() {
    let b = FakeWorker::start_with(models_server(MODELS_B)).await;
    let router = start_router(&yaml_for(&[&b], "")).await;
    let first = get(router.addr, "/v1/models").await;
    let second = get(router.addr, "/v1/models").await;
    for r in [&first, &second] {
        assert_eq!(r.status, 200);
        assert_eq!(r.text(), MODELS_B);
        assert_eq!(r.header("content-type"), Some("application/json"));
    }
    assert_eq!(b.count(), 1, "the second call is answered from the cache");
    router.shutdown().await;
}

//! `https://` workers: served and health-probed through rustls, verified against
//! `proxy.tls.ca_file` or the platform's store, refused with a clear error when the
//! certificate cannot be trusted.

use std::sync::atomic::Ordering;

use support::tls::TlsWorker;
use support::{client::*, observe::*, wait::*};

use crate::common::start_router;

fn yaml(worker: &TlsWorker, tls: &str) -> String {
    format!(
        "health:\n  interval_secs: 0.1\n  timeout_secs: 1\nproxy:\n  max_retries: 0\n{tls}workers:\n  - url: \"{}\"\n",
        worker.url()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_worker_is_served_and_probed_when_its_certificate_is_trusted() {
    let w = TlsWorker::start().await;
    let tls = format!("  tls:\n    ca_file: \"{}\"\n", w.cert_pem.path.display());
    let router = start_router(&yaml(&w, &tls)).await;
    wait_until("a TLS health probe", STEP_TIMEOUT, || async {
        w.probes.load(Ordering::SeqCst) > 0
    })
    .await;
    // Counted healthy once that probe's answer is in.
    wait_until("GET /health says 200", STEP_TIMEOUT, || async {
        send(router.addr, &Req::get("/health")).await.status == 200
    })
    .await;
    let resp = send(
        router.addr,
        &Req::post("/v1/chat/completions", chat_body("hello over TLS", false)),
    )
    .await;
    assert_eq!(resp.status, 200, "{}", String::from_utf8_lossy(&resp.body));
    assert!(String::from_utf8_lossy(&resp.body).contains("over TLS"));
    assert_eq!(w.requests.load(Ordering::SeqCst), 1);
    assert_eq!(w.failed_handshakes.load(Ordering::SeqCst), 0);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_certificate_is_refused_with_a_clear_error() {
    let w = TlsWorker::start().await;
    // The platform's store does not hold this run's certificate.
    let router = start_router(&yaml(&w, "")).await;
    wait_until("a refused TLS handshake", STEP_TIMEOUT, || async {
        w.failed_handshakes.load(Ordering::SeqCst) > 0
    })
    .await;
    // Its first probe fails the handshake: unhealthy at once, and `/workers` says why.
    wait_until("the worker marked unhealthy", STEP_TIMEOUT, || async {
        get_workers(router.addr).await["workers"][0]["healthy"] == false
    })
    .await;
    let view = get_workers(router.addr).await["workers"][0].clone();
    let why = view["probe_error"].as_str().unwrap_or_default().to_string();
    assert!(why.contains("certificate"), "{view}");
    eprintln!("refused: {why}");
    let resp = send(
        router.addr,
        &Req::post("/v1/chat/completions", chat_body("hello", false)),
    )
    .await;
    assert_eq!(resp.status, 503, "{}", String::from_utf8_lossy(&resp.body));
    assert_eq!(w.requests.load(Ordering::SeqCst), 0);
    router.shutdown().await;

    // insecure_skip_verify takes it anyway (and says so loudly in the log).
    let router = start_router(&yaml(&w, "  tls:\n    insecure_skip_verify: true\n")).await;
    let resp = send(
        router.addr,
        &Req::post("/v1/chat/completions", chat_body("hello", false)),
    )
    .await;
    assert_eq!(resp.status, 200, "{}", String::from_utf8_lossy(&resp.body));
    router.shutdown().await;
}

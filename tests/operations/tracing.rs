//! Trace context: a client's W3C `traceparent` is continued by the router's span and
//! sent to the worker; none or an invalid one starts a new trace; with
//! `tracing.otlp_endpoint` one span per request reaches the collector with the
//! decision's attributes.

use support::otlp::Collector;
use support::{client::*, config::*, observe::*, wait::*, worker::*};

use crate::common::start_router;

const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

fn client_traceparent() -> String {
    format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")
}

/// `(trace id, parent id, flags)` of a well-formed version-00 `traceparent` (lowercase
/// hex, non-zero ids); panics otherwise.
fn fields(tp: &str) -> (String, String, String) {
    let parts: Vec<&str> = tp.split('-').collect();
    assert_eq!(parts.len(), 4, "{tp}");
    assert_eq!(parts[0], "00", "{tp}");
    for (p, len) in parts[1..].iter().zip([32, 16, 2]) {
        assert_eq!(p.len(), len, "{tp}");
        assert!(
            p.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
            "{tp}"
        );
    }
    assert!(parts[1].bytes().any(|b| b != b'0'), "zero trace id: {tp}");
    assert!(parts[2].bytes().any(|b| b != b'0'), "zero parent id: {tp}");
    (
        parts[1].to_string(),
        parts[2].to_string(),
        parts[3].to_string(),
    )
}

fn chat() -> Req {
    Req::post("/v1/chat/completions", chat_body("trace me", false))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_traceparent_is_continued_with_the_routers_span() {
    let w = FakeWorker::start().await;
    let router = start_router(&yaml_for(&[&w], "")).await;
    let resp = send(
        router.addr,
        &chat()
            .header("traceparent", &client_traceparent())
            .header("tracestate", "vendor=abc,other=1"),
    )
    .await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    let got = &w.requests()[0];
    let (trace, parent, flags) = fields(got.header("traceparent").expect("a traceparent"));
    assert_eq!(trace, CLIENT_TRACE, "same trace");
    assert_ne!(
        parent, CLIENT_SPAN,
        "the router's own span is the worker's parent"
    );
    assert_eq!(flags, "01");
    assert_eq!(got.header_all("traceparent").len(), 1);
    assert_eq!(got.header("tracestate"), Some("vendor=abc,other=1"));
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_traceparent_the_worker_gets_a_new_trace() {
    let w = FakeWorker::start().await;
    let router = start_router(&yaml_for(&[&w], "")).await;
    for _ in 0..2 {
        assert_eq!(send(router.addr, &chat()).await.status, 200);
    }
    let reqs = w.requests();
    let a = fields(reqs[0].header("traceparent").expect("a traceparent"));
    let b = fields(reqs[1].header("traceparent").expect("a traceparent"));
    assert_ne!(a.0, b.0, "each request starts its own trace");
    assert_eq!(a.2, "01", "a new trace is sampled");
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_traceparent_is_replaced_by_a_new_trace() {
    let w = FakeWorker::start().await;
    let router = start_router(&yaml_for(&[&w], "")).await;
    let upper = format!("00-{}-{CLIENT_SPAN}-01", CLIENT_TRACE.to_uppercase());
    let zero = format!("00-{}-{CLIENT_SPAN}-01", "0".repeat(32));
    for bad in [upper.as_str(), zero.as_str(), "00-abc-def-01", "hello"] {
        let resp = send(
            router.addr,
            &chat()
                .header("traceparent", bad)
                .header("tracestate", "vendor=abc"),
        )
        .await;
        assert_eq!(resp.status, 200, "{bad}: {}", resp.text());
        let reqs = w.requests();
        let got = reqs.last().unwrap();
        let (trace, parent, _) = fields(got.header("traceparent").expect("a traceparent"));
        assert_ne!(trace.to_uppercase(), CLIENT_TRACE.to_uppercase(), "{bad}");
        assert_ne!(parent, CLIENT_SPAN, "{bad}");
        assert!(
            !got.has_header("tracestate"),
            "{bad}: the state of another trace is not passed on"
        );
    }
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exported_span_continues_the_client_trace_with_the_decision() {
    let collector = Collector::start().await;
    let w = FakeWorker::start().await;
    let extra = format!(
        "tracing:\n  otlp_endpoint: {}\n  service_name: edge-router\n",
        collector.url()
    );
    let router = start_router(&yaml_for(&[&w], &extra)).await;
    let resp = send(
        router.addr,
        &chat()
            .header("traceparent", &client_traceparent())
            .header("x-request-id", "trace-req-1"),
    )
    .await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    // Sent by the batch processor within its delay (1 s), not at shutdown.
    let spans = collector.wait_for_spans(1).await;
    assert_eq!(spans.len(), 1, "one span per request: {spans:?}");
    let s = &spans[0];
    let (_, sent_parent, _) = fields(w.requests()[0].header("traceparent").unwrap());
    assert_eq!(s.trace_id(), CLIENT_TRACE);
    assert_eq!(s.parent_span_id(), CLIENT_SPAN);
    assert_eq!(s.span_id(), sent_parent, "the span the worker was told of");
    assert_eq!(s.service_name, "edge-router");
    assert_eq!(s.span.name, "POST /v1/chat/completions");
    assert_eq!(s.span.kind, 2, "SPAN_KIND_SERVER");
    assert!(s.span.end_time_unix_nano >= s.span.start_time_unix_nano);
    assert!(s.attr_str("router.reason").is_some_and(|r| !r.is_empty()));
    assert_eq!(
        s.attr_str("router.worker"),
        Some(worker_label(router.addr, 0).await.as_str())
    );
    assert!(
        s.attr_f64("router.matched_ratio")
            .is_some_and(|r| (0.0..=1.0).contains(&r))
    );
    assert_eq!(s.attr_int("router.attempt"), Some(0));
    assert_eq!(s.attr_int("http.response.status_code"), Some(200));
    assert_eq!(s.attr_str("router.endpoint"), Some("chat_completions"));
    assert_eq!(s.attr_str("router.request_id"), Some("trace-req-1"));
    assert_ne!(
        s.span.status.as_ref().map_or(0, |st| st.code),
        2,
        "not an error"
    );
    assert_eq!(
        collector.posts()[0],
        (
            "/v1/traces".to_string(),
            "application/x-protobuf".to_string()
        )
    );
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_the_router_gives_itself_exports_an_error_span() {
    let collector = Collector::start().await;
    let extra = format!("tracing:\n  otlp_endpoint: {}\n", collector.url());
    let router = start_router(&yaml_for_urls(&[closed_port_url()], &extra)).await;
    let resp = send(
        router.addr,
        &chat().header("traceparent", &client_traceparent()),
    )
    .await;
    assert_eq!(resp.status, 503, "{}", resp.text());
    // Flushed by the graceful shutdown.
    router.shutdown().await;
    let spans = collector.wait_for_spans(1).await;
    let s = &spans[0];
    assert_eq!(s.trace_id(), CLIENT_TRACE);
    assert_eq!(s.parent_span_id(), CLIENT_SPAN);
    assert_eq!(s.service_name, "cache-aware-router");
    assert_eq!(s.attr_int("http.response.status_code"), Some(503));
    assert_eq!(s.attr_str("router.worker"), Some("none"));
    assert_eq!(s.span.status.as_ref().map(|st| st.code), Some(2), "error");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_collector_never_fails_requests() {
    let w = FakeWorker::start().await;
    let extra = format!("tracing:\n  otlp_endpoint: {}\n", closed_port_url());
    let router = start_router(&yaml_for(&[&w], &extra)).await;
    for _ in 0..3 {
        let resp = send(router.addr, &chat()).await;
        assert_eq!(resp.status, 200, "{}", resp.text());
    }
    assert_eq!(w.count(), 3);
    within("shutdown with a collector that is down", router.shutdown()).await;
}

/// The access log line names the trace, so logs and traces correlate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_log_line_carries_the_trace_id() {
    let w = FakeWorker::start().await;
    let config = TempFile::new(
        "trace-log.yaml",
        &yaml_for(
            &[&w],
            "server: {host: 127.0.0.1, port: 0}\nlog: {format: json, level: \"warn,cache_aware_router=info\"}\n",
        ),
    );
    let router = crate::BINARY.serve(&[&config.path]);
    let resp = send(
        router.addr,
        &chat().header("traceparent", &client_traceparent()),
    )
    .await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    let resp = send(router.addr, &chat()).await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    let (new_trace, _, _) = fields(w.requests()[1].header("traceparent").unwrap());
    wait_until(
        "both access lines",
        std::time::Duration::from_secs(5),
        || {
            let out = router.output();
            let ok = [CLIENT_TRACE, new_trace.as_str()].iter().all(|t| {
                out.lines().any(|l| {
                    serde_json::from_str::<serde_json::Value>(l).is_ok_and(|v| {
                        v["target"] == "cache_aware_router::access" && v["fields"]["trace_id"] == *t
                    })
                })
            });
            async move { ok }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_cache_replay_exports_its_own_span() {
    let collector = Collector::start().await;
    let w = FakeWorker::start().await;
    let extra = format!(
        "response_cache:\n  enabled: true\ntracing:\n  otlp_endpoint: {}\n",
        collector.url()
    );
    let router = start_router(&yaml_for(&[&w], &extra)).await;
    assert_eq!(send(router.addr, &chat()).await.status, 200);
    // The first answer is stored once its body ended; the same request then replays it.
    wait_until("a cache hit", STEP_TIMEOUT, || async {
        send(
            router.addr,
            &chat().header("traceparent", &client_traceparent()),
        )
        .await
        .header("x-cache")
            == Some("hit")
    })
    .await;
    router.shutdown().await;
    let spans = collector.spans();
    let hit = spans
        .iter()
        .find(|s| s.attr_str("router.worker") == Some("cache"))
        .expect("a span for the replay");
    assert_eq!(hit.trace_id(), CLIENT_TRACE);
    assert_eq!(hit.parent_span_id(), CLIENT_SPAN);
    assert_eq!(hit.attr_str("router.reason"), Some("response_cache"));
}

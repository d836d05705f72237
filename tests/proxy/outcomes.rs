//! How a request ends, as the operator sees it: exactly one access-log line and one
//! counted outcome per request (a client that leaves before the headers included, a
//! stream read to its last event and then closed counted complete), header time-outs
//! that are final by default (not re-sent, their connection closed, the client's wait
//! bounded by one `request_timeout_secs`), and log lines that say what happened once.

use std::time::{Duration, Instant};

use serde_json::Value;
use support::binary::{self, Stream};
use support::{client::*, config::*, observe::*, wait::*, worker::*};

use crate::common::start_router;

/// The router binary's JSON log and address, in front of `workers`.
fn serve(workers: &[&FakeWorker], extra: &str) -> (TempFile, binary::Running) {
    let yaml = yaml_for(
        workers,
        &format!(
            "server: {{host: 127.0.0.1, port: 0}}\nlog: {{format: json, level: info}}\n{extra}"
        ),
    );
    let config = TempFile::new("router.yaml", &yaml);
    let running = crate::BINARY.serve(&[&config.path]);
    (config, running)
}

/// The access-log lines (`cache_aware_router::access`) printed so far, as JSON fields.
fn access_lines(r: &binary::Running) -> Vec<Value> {
    r.lines()
        .into_iter()
        .filter(|(s, _)| *s == Stream::Stderr)
        .filter_map(|(_, l)| serde_json::from_str::<Value>(&l).ok())
        .filter(|v| v["target"] == "cache_aware_router::access")
        .map(|v| v["fields"].clone())
        .collect()
}

async fn wait_for_lines(r: &binary::Running, n: usize) -> Vec<Value> {
    wait_until("access-log lines", Duration::from_secs(3), || async {
        access_lines(r).len() >= n
    })
    .await;
    access_lines(r)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_before_the_headers_gets_one_line_and_a_counted_outcome() {
    let gate = Gate::new();
    let g = gate.clone();
    let w = FakeWorker::start_with(move |_| Reply::ok().after_gate(&g)).await;
    let (_config, router) = serve(&[&w], "");
    let mut conn = Conn::connect(router.addr).await;
    conn.send(&Req::post(
        "/v1/chat/completions",
        chat_body("who leaves early", false),
    ))
    .await
    .unwrap();
    wait_until(
        "the worker has the request",
        Duration::from_secs(3),
        || async { w.count() == 1 },
    )
    .await;
    drop(conn);

    let lines = wait_for_lines(&router, 1).await;
    assert_eq!(lines.len(), 1, "{lines:?}");
    let line = &lines[0];
    assert_eq!(line["outcome"], "client_gone", "{line}");
    assert_eq!(line["status"], 499, "{line}");
    assert_eq!(line["worker"], w.url().trim_end_matches('/'), "{line}");
    let m = scrape(router.addr).await;
    assert_eq!(
        m.value(
            "cache_aware_router_request_outcomes_total",
            &[("outcome", "client_gone")]
        ),
        1.0
    );
    assert_eq!(
        m.value(
            "cache_aware_router_request_outcomes_total",
            &[("outcome", "complete")]
        ),
        0.0
    );
    assert_eq!(in_flight(router.addr).await, [0], "its slot is given back");
    gate.open();

    // An answered request: one line, counted complete (the scrape's own request is not
    // an access-logged one).
    let r = post(
        router.addr,
        "/v1/chat/completions",
        chat_body("stays", false),
    )
    .await;
    assert_eq!(r.status, 200);
    let lines = wait_for_lines(&router, 2).await;
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(lines[1]["outcome"], "complete");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_read_to_its_last_event_and_then_closed_counts_complete() {
    // The worker sends every event, `[DONE]` included, and holds the chunked
    // terminator: a client that closes right after `[DONE]` (Python's urllib) has the
    // whole answer.
    let hold = Gate::new();
    let h = hold.clone();
    let w = FakeWorker::start_with(move |_| {
        let events = [
            r#"{"choices":[{"index":0,"delta":{"content":"hi"}}]}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":1}}"#,
            "[DONE]",
        ];
        let mut steps: Vec<Step> = events
            .iter()
            .map(|e| Step::Write(format!("data: {e}\n\n").into_bytes()))
            .collect();
        steps.push(Step::Wait(h.clone()));
        Reply::status(200)
            .header("Content-Type", "text/event-stream")
            .chunked(steps)
    })
    .await;
    let (_config, router) = serve(&[&w], "");
    let mut conn = Conn::connect(router.addr).await;
    conn.send(&Req::post("/v1/chat/completions", chat_body("whole", true)))
        .await
        .unwrap();
    assert_eq!(conn.read_head().await.status, 200);
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("[DONE]") {
        let piece = conn.next_piece().await.expect("a piece before [DONE]");
        seen.extend_from_slice(&piece);
    }
    drop(conn);
    let lines = wait_for_lines(&router, 1).await;
    assert_eq!(lines[0]["outcome"], "complete", "{:?}", lines[0]);
    let m = scrape(router.addr).await;
    let outcome = |o| {
        m.value(
            "cache_aware_router_request_outcomes_total",
            &[("outcome", o)],
        )
    };
    assert_eq!((outcome("complete"), outcome("client_gone")), (1.0, 0.0));
    hold.open();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_left_before_its_last_event_is_a_client_gone() {
    let hold = Gate::new();
    let h = hold.clone();
    let w = FakeWorker::start_with(move |_| {
        Reply::status(200)
            .header("Content-Type", "text/event-stream")
            .chunked(vec![
                Step::Write(
                    b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n"
                        .to_vec(),
                ),
                Step::Wait(h.clone()),
                Step::Write(b"data: [DONE]\n\n".to_vec()),
            ])
    })
    .await;
    let (_config, router) = serve(&[&w], "");
    let mut conn = Conn::connect(router.addr).await;
    conn.send(&Req::post("/v1/chat/completions", chat_body("cut", true)))
        .await
        .unwrap();
    assert_eq!(conn.read_head().await.status, 200);
    conn.next_piece().await.expect("the first event");
    drop(conn);
    let lines = wait_for_lines(&router, 1).await;
    assert_eq!(lines[0]["outcome"], "client_gone", "{:?}", lines[0]);
    hold.open();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_time_out_is_final_closes_its_connection_and_bounds_the_wait() {
    let (silent, mut closed) = silent_worker().await;
    let spare = FakeWorker::start().await;
    let urls = [silent, spare.url()];
    let router = start_router(&yaml_for_urls(
        &urls,
        "policy: round_robin\nproxy:\n  request_timeout_secs: 0.4\n  max_retries: 2\n",
    ))
    .await;
    // Round robin starts at the silent worker; send until it gets one.
    let mut timed_out = None;
    for i in 0..4 {
        let started = Instant::now();
        let r = post(
            router.addr,
            "/v1/chat/completions",
            chat_body(&format!("long prefill {i}"), false),
        )
        .await;
        if r.status == 504 {
            timed_out = Some((started, started.elapsed(), r));
            break;
        }
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let (started, waited, r) = timed_out.expect("a request reached the silent worker");
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("request_timeout_secs"),
        "{}",
        r.text()
    );
    assert!(
        waited < Duration::from_millis(1000),
        "one request_timeout, not one per attempt: {waited:?}"
    );
    let served_before = spare.count();
    let at = within(
        "the silent worker sees its connection closed",
        closed.recv(),
    )
    .await
    .expect("a close");
    assert!(
        at.duration_since(started) < Duration::from_millis(1000),
        "closed {:?} after the request",
        at.duration_since(started)
    );
    assert_eq!(
        spare.count(),
        served_before,
        "the timed-out request was not re-sent to the other worker"
    );
    let m = scrape(router.addr).await;
    assert_eq!(
        m.value(
            "cache_aware_router_routing_decisions_total",
            &[("reason", "no_worker")]
        ),
        0.0,
        "a 504 is not a no_worker decision"
    );
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_time_out_fails_over_within_the_request_bound() {
    let (silent, mut closed) = silent_worker().await;
    let spare = FakeWorker::start().await;
    let urls = [silent, spare.url()];
    let router = start_router(&yaml_for_urls(
        &urls,
        "policy: round_robin\nproxy:\n  request_timeout_secs: 2\n  attempt_timeout_secs: 0.2\n",
    ))
    .await;
    for i in 0..4 {
        let started = Instant::now();
        let r = post(
            router.addr,
            "/v1/chat/completions",
            chat_body(&format!("fail over {i}"), false),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(started.elapsed() < Duration::from_millis(1500));
    }
    within("the abandoned attempt's connection closed", closed.recv())
        .await
        .expect("a close");
    assert_eq!(spare.count(), 4, "every request ended on the spare worker");
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_the_retry_recovers_is_not_logged_as_no_worker() {
    // The first worker passes its first probe, then dies; the next probe is a minute
    // away, so requests still go to it and meet a refused connection.
    let dying = FakeWorker::start().await;
    let live = FakeWorker::start().await;
    let yaml = yaml_for(
        &[&dying, &live],
        "server: {host: 127.0.0.1, port: 0}\nlog: {format: json, level: info}\npolicy: round_robin\nhealth: {interval_secs: 60}\n",
    );
    let config = TempFile::new("router.yaml", &yaml);
    let router = crate::BINARY.serve(&[&config.path]);
    dying.wait_for_probes(1).await;
    dying.kill().await;
    for i in 0..4 {
        let r = post(
            router.addr,
            "/v1/chat/completions",
            chat_body(&format!("retry {i}"), false),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let out = router.output();
    assert!(
        out.contains("trying another worker"),
        "the refused attempt was retried:\n{out}"
    );
    assert!(
        !out.contains("no worker could be reached"),
        "a recovered attempt is not a pool outage:\n{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_port_in_use_is_reported_once() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let w = FakeWorker::start().await;
    let config = TempFile::new(
        "router.yaml",
        &yaml_for(
            &[&w],
            &format!("server: {{host: 127.0.0.1, port: {port}}}\n"),
        ),
    );
    let out = crate::BINARY.run(&["-c", config.path.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = binary::stderr(&out);
    assert_eq!(
        err.matches("in use").count(),
        1,
        "the bind failure, once:\n{err}"
    );
    drop(taken);
}

/// Connection threads gather their log lines and write them out when they go idle
/// (`log_sink`): every request's line still arrives while the router runs, whole (many
/// connections on two threads never cut into each other's lines), once each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_connections_lines_arrive_whole_and_once_each_while_the_router_runs() {
    const CONNS: usize = 8;
    const EACH: usize = 25;
    let w = FakeWorker::start().await;
    let (_config, router) = serve(&[&w], "");
    let addr = router.addr;
    let clients: Vec<_> = (0..CONNS)
        .map(|c| {
            tokio::spawn(async move {
                let mut conn = Conn::connect(addr).await;
                for i in 0..EACH {
                    let body =
                        chat_body(&format!("conn {c} request {i} {}", "x".repeat(300)), false);
                    let r = conn
                        .request(
                            &Req::post("/v1/chat/completions", body)
                                .header("x-request-id", &format!("c{c}-r{i}")),
                        )
                        .await;
                    assert_eq!(r.status, 200);
                }
            })
        })
        .collect();
    for c in clients {
        c.await.unwrap();
    }
    let lines = wait_for_lines(&router, CONNS * EACH).await;
    let mut ids: Vec<String> = lines
        .iter()
        .map(|l| l["request_id"].as_str().unwrap_or_default().to_string())
        .collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), CONNS * EACH, "one line per request: {ids:?}");
    let stderr: Vec<String> = router
        .lines()
        .into_iter()
        .filter(|(s, _)| *s == Stream::Stderr)
        .map(|(_, l)| l)
        .collect();
    for l in &stderr {
        assert!(
            serde_json::from_str::<Value>(l).is_ok(),
            "every line whole JSON: {l:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_continued_elsewhere_says_so_on_its_one_access_line() {
    use support::story::{Script, read, story, story_engine};
    let a = FakeWorker::start_with(story_engine(Script {
        name: "a",
        die_after: Some(2),
        ..Script::default()
    }))
    .await;
    let b = FakeWorker::start_with(story_engine(Script {
        name: "b",
        ..Script::default()
    }))
    .await;
    let (_config, router) = serve(&[&a, &b], "policy: round_robin\n");
    let body = serde_json::json!({"model": "m", "stream": true, "max_tokens": 6,
        "messages": [{"role": "user", "content": "go"}]});
    let resp = post(router.addr, "/v1/chat/completions", body.to_string()).await;
    assert_eq!(read(&resp.body).text, story(6));
    let lines = wait_for_lines(&router, 1).await;
    assert_eq!(lines.len(), 1, "{lines:?}");
    let line = &lines[0];
    assert_eq!(line["worker"], a.url().trim_end_matches('/'), "{line}");
    assert_eq!(
        line["continued_on"],
        b.url().trim_end_matches('/'),
        "{line}"
    );
    assert_eq!(line["migrations"], 1, "{line}");
    assert_eq!(line["outcome"], "complete", "{line}");
}

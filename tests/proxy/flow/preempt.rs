//! `priority.preempt`: a critical request that finds no slot cancels a batch request
//! that has not had its worker's answer yet (its connection closed, so the engine
//! aborts it), never one whose answer has begun; the cancelled one is sent again, or
//! answered 503 with `x-preempted: true`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use support::{client::*, observe::*, wait::*, worker::*};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

use crate::common::start_router;

fn yaml(w: &FakeWorker, on_preempt: &str) -> String {
    format!(
        "proxy:\n  max_retries: 0\n  queue:\n    max_waiting: 8\n    timeout_ms: 10000\nhealth:\n  interval_secs: 60\nworkers:\n  - url: \"{}\"\n    max_load: 1\npriority:\n  preempt: true\n  on_preempt: {on_preempt}\n",
        w.url()
    )
}

fn request(tag: &str, class: &str) -> Req {
    Req::post("/v1/chat/completions", chat_body(tag, false))
        .header("x-test-tag", tag)
        .header("x-priority", class)
}

fn spawn_send(addr: SocketAddr, req: Req) -> tokio::task::JoinHandle<Response> {
    tokio::spawn(async move { send(addr, &req).await })
}

/// A worker that holds the first request tagged `victim` without an answer (until
/// `gate`), and answers everything else after 20 ms.
async fn worker_holding_the_victim(gate: &Gate) -> FakeWorker {
    let gate = gate.clone();
    let seen = Arc::new(AtomicUsize::new(0));
    FakeWorker::start_with(move |r| {
        if r.header("x-test-tag") == Some("victim") && seen.fetch_add(1, Ordering::SeqCst) == 0 {
            Reply::ok().after_gate(&gate)
        } else {
            Reply::ok().after(Duration::from_millis(20))
        }
    })
    .await
}

/// A batch request sent to `w` (through the router at `addr`, `on_preempt: error`)
/// that a critical one then pre-empts while the worker holds it without an answer:
/// the critical one's 200, and the batch one's answer, a 503 saying so.
async fn preempted_by_a_critical_request(w: &FakeWorker, addr: SocketAddr) -> Response {
    let victim = spawn_send(addr, request("victim", "batch"));
    // The worker has it (and no answer for it yet).
    w.wait_for_requests(1).await;
    let critical = within(
        "the critical request",
        send(addr, &request("critical", "critical")),
    )
    .await;
    assert_eq!(critical.status, 200);
    let victim = within("the batch request", victim).await.unwrap();
    assert_eq!(victim.status, 503);
    assert_eq!(victim.header("x-preempted"), Some("true"));
    victim
}

fn tags(w: &FakeWorker) -> Vec<String> {
    w.requests()
        .iter()
        .filter_map(|r| r.header("x-test-tag").map(str::to_string))
        .collect()
}

/// A raw worker: the first request whose body holds `victim` gets no answer, and its
/// connection's close is reported on the channel (the engine would abort it then); any
/// other request gets a JSON 200 (its tag reported too, in arrival order).
async fn aborting_worker() -> (String, mpsc::UnboundedReceiver<String>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = mpsc::unbounded_channel();
    let held = Arc::new(AtomicUsize::new(0));
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let (tx, held) = (tx.clone(), Arc::clone(&held));
            tokio::spawn(async move {
                let mut seen = Vec::new();
                let mut buf = vec![0u8; 1 << 16];
                loop {
                    let n = s.read(&mut buf).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    seen.extend_from_slice(&buf[..n]);
                    let Some(end) = seen.windows(4).position(|w| w == b"\r\n\r\n") else {
                        continue;
                    };
                    let head = String::from_utf8_lossy(&seen[..end]).to_ascii_lowercase();
                    let len: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(0);
                    if seen.len() < end + 4 + len {
                        continue;
                    }
                    let body = String::from_utf8_lossy(&seen[end + 4..end + 4 + len]).to_string();
                    seen.drain(..end + 4 + len);
                    let tag = ["victim", "critical"]
                        .into_iter()
                        .find(|t| body.contains(t));
                    if tag == Some("victim") && held.fetch_add(1, Ordering::SeqCst) == 0 {
                        let _ = tx.send("victim".to_string());
                        // No answer: wait for the router to close the connection.
                        while s.read(&mut buf).await.unwrap_or(0) > 0 {}
                        let _ = tx.send("closed".to_string());
                        return;
                    }
                    if let Some(t) = tag {
                        let _ = tx.send(t.to_string());
                    }
                    let reply = format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{OK_BODY}",
                        OK_BODY.len()
                    );
                    if s.write_all(reply.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (url, rx)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_critical_request_preempts_a_batch_one_waiting_for_its_answer_which_is_sent_again() {
    let (url, mut events) = aborting_worker().await;
    let router = start_router(&format!(
        "proxy:\n  max_retries: 0\n  queue:\n    max_waiting: 8\n    timeout_ms: 10000\nhealth:\n  interval_secs: 60\nworkers:\n  - url: \"{url}\"\n    max_load: 1\npriority:\n  preempt: true\n"
    ))
    .await;
    let addr = router.addr;
    let victim = spawn_send(addr, request("victim", "batch"));
    assert_eq!(
        within("the batch request", events.recv()).await.unwrap(),
        "victim"
    );
    let critical = within(
        "the critical request",
        send(addr, &request("critical", "critical")),
    )
    .await;
    assert_eq!(critical.status, 200, "{}", critical.text());
    let victim = within("the batch request, sent again", victim)
        .await
        .unwrap();
    assert_eq!(victim.status, 200, "{}", victim.text());
    // The critical one went, then it was sent again; its first attempt's connection
    // was closed (the engine aborts the request): the worker notices that close on a
    // task of its own, so it may report it at any point.
    let mut events_seen = Vec::new();
    wait_until("the pre-empted connection closed", STEP_TIMEOUT, || {
        while let Ok(e) = events.try_recv() {
            events_seen.push(e);
        }
        let closed = events_seen.iter().any(|e| e == "closed");
        async move { closed }
    })
    .await;
    let sent: Vec<&String> = events_seen.iter().filter(|e| *e != "closed").collect();
    assert_eq!(sent, ["critical", "victim"], "{events_seen:?}");
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_on_preempt_error_the_batch_request_gets_503_saying_so() {
    let gate = Gate::new();
    let w = worker_holding_the_victim(&gate).await;
    let router = start_router(&yaml(&w, "error")).await;
    let addr = router.addr;
    let victim = preempted_by_a_critical_request(&w, addr).await;
    assert_eq!(victim.header("retry-after"), Some("1"));
    assert_eq!(victim.json()["error"]["type"], "preempted");
    let m = scrape(addr).await;
    assert_eq!(
        m.value(
            "cache_aware_router_flow_preempted_total",
            &[("class", "batch"), ("tenant", "default")]
        ),
        1.0
    );
    assert_eq!(tags(&w), ["victim", "critical"]);
    gate.open();
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_request_whose_answer_has_begun_is_never_preempted() {
    let gate = Gate::new();
    let held = gate.clone();
    let w = FakeWorker::start_with(move |r| {
        if r.header("x-test-tag") == Some("victim") {
            // Headers and a first event, then the rest once the gate opens.
            Reply::status(200)
                .header("Content-Type", "text/event-stream")
                .chunked(vec![
                    Step::Write(b"data: {\"choices\":[]}\n\n".to_vec()),
                    Step::Wait(held.clone()),
                    Step::Write(b"data: [DONE]\n\n".to_vec()),
                ])
        } else {
            Reply::ok()
        }
    })
    .await;
    let router = start_router(&yaml(&w, "requeue")).await;
    let addr = router.addr;
    let mut conn = Conn::connect(addr).await;
    conn.send(&request("victim", "batch")).await.unwrap();
    let head = conn.read_head().await;
    assert_eq!(head.status, 200);
    let critical = spawn_send(addr, request("critical", "critical"));
    wait_until("the critical request queued", STEP_TIMEOUT, || async {
        scrape(addr)
            .await
            .value("cache_aware_router_queue_waiting", &[])
            == 1.0
    })
    .await;
    gate.open();
    let rest = String::from_utf8(conn.read_rest().await).unwrap();
    assert!(rest.contains("[DONE]"), "{rest}");
    assert_eq!(
        within("the critical request", critical)
            .await
            .unwrap()
            .status,
        200
    );
    assert_eq!(tags(&w), ["victim", "critical"]);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_stream_with_headers_but_no_first_event_is_still_preempted() {
    // Engines send a stream's headers at once: its answer begins with its first event.
    let gate = Gate::new();
    let held = gate.clone();
    let w = FakeWorker::start_with(move |r| {
        if r.header("x-test-tag") == Some("victim") {
            Reply::status(200)
                .header("Content-Type", "text/event-stream")
                .chunked(vec![
                    Step::Wait(held.clone()),
                    Step::Write(b"data: [DONE]\n\n".to_vec()),
                ])
        } else {
            Reply::ok()
        }
    })
    .await;
    let router = start_router(&yaml(&w, "error")).await;
    let addr = router.addr;
    preempted_by_a_critical_request(&w, addr).await;
    assert_eq!(tags(&w), ["victim", "critical"]);
    gate.open();
    router.shutdown().await;
}

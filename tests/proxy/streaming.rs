//! Streamed answers reach the client as the worker writes them: no buffering, no
//! re-encoding, no added latency per response.

use std::time::{Duration, Instant};

use support::{client::*, config::*, engine::*, observe::*, wait::*, worker::*};

use crate::common::start_router;

// C08
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_events_reach_the_client_as_the_worker_writes_them() {
    let events: Vec<String> = (0..6).map(sse_event).collect();
    let script = events.clone();
    let w = FakeWorker::start_with(move |_| Reply::sse(&script, Duration::from_millis(150))).await;
    let router = start_router(&yaml_for(&[&w], "")).await;

    let req = Req::post("/v1/chat/completions", chat_body("count", true))
        .header("Accept-Encoding", "gzip, br");
    let resp = within("streamed response", send(router.addr, &req)).await;

    assert_eq!(resp.status, 200);
    assert!(
        resp.header("content-type")
            .is_some_and(|v| v.starts_with("text/event-stream")),
        "{:?}",
        resp.headers
    );
    assert!(!resp.has_header("content-length"), "{:?}", resp.headers);
    assert_eq!(resp.header("transfer-encoding"), Some("chunked"));
    assert!(
        !resp.has_header("content-encoding"),
        "the router must not compress SSE itself: {:?}",
        resp.headers
    );
    assert_eq!(resp.header("cache-control"), Some("no-cache"));
    assert_eq!(resp.header("x-accel-buffering"), Some("no"));
    let expected: String = events.iter().map(|e| format!("data: {e}\n\n")).collect();
    assert_eq!(resp.text(), expected);

    let writes = w.writes(0);
    assert_eq!(writes.len(), events.len());
    let first_arrival = resp.pieces[0].0;
    let last_write = writes.last().unwrap().0;
    assert!(
        first_arrival < last_write,
        "the first event must arrive before the worker finished writing"
    );
    assert!(
        first_arrival.duration_since(resp.sent_at) < Duration::from_millis(250),
        "first event after {:?}",
        first_arrival.duration_since(resp.sent_at)
    );
    assert_relayed_promptly(&writes, &resp.pieces, Duration::from_millis(50));
    router.shutdown().await;
}

fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for b in data {
        crc ^= *b as u32;
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// A valid gzip stream of `events`, one stored (uncompressed) deflate block per event, so
/// each piece is flushed on a byte boundary as a sync flush would be. Returns the pieces:
/// header + first block, one block per further event, then the final block + trailer.
fn gzip_pieces(events: &[Vec<u8>]) -> Vec<Vec<u8>> {
    let block = |data: &[u8], last: bool| {
        let len = data.len() as u16;
        let mut out = vec![u8::from(last)];
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&(!len).to_le_bytes());
        out.extend_from_slice(data);
        out
    };
    let mut pieces = Vec::new();
    let mut all = Vec::new();
    for (i, e) in events.iter().enumerate() {
        let mut p = if i == 0 {
            vec![0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff]
        } else {
            Vec::new()
        };
        p.extend_from_slice(&block(e, false));
        pieces.push(p);
        all.extend_from_slice(e);
    }
    let mut end = block(&[], true);
    end.extend_from_slice(&crc32(&all).to_le_bytes());
    end.extend_from_slice(&(all.len() as u32).to_le_bytes());
    pieces.push(end);
    pieces
}

// C09
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gzip_sse_passes_through_byte_identical_with_its_content_encoding() {
    let events: Vec<Vec<u8>> = (0..5)
        .map(|i| format!("data: {}\n\n", sse_event(i)).into_bytes())
        .collect();
    let pieces = gzip_pieces(&events);
    let compressed: Vec<u8> = pieces.concat();
    let script = pieces.clone();
    let w = FakeWorker::start_with(move |_| {
        let mut steps = Vec::new();
        for (i, p) in script.iter().enumerate() {
            if i > 0 && i < script.len() - 1 {
                steps.push(Step::Sleep(Duration::from_millis(150)));
            }
            steps.push(Step::Write(p.clone()));
        }
        Reply::status(200)
            .header("Content-Type", "text/event-stream")
            .header("Content-Encoding", "gzip")
            .chunked(steps)
    })
    .await;
    let router = start_router(&yaml_for(&[&w], "")).await;

    let req = Req::post("/v1/chat/completions", chat_body("count", true))
        .header("Accept-Encoding", "gzip");
    let resp = within("gzip stream", send(router.addr, &req)).await;
    assert_eq!(resp.status, 200);
    assert_eq!(w.requests()[0].header("accept-encoding"), Some("gzip"));
    assert_eq!(
        resp.header("content-encoding"),
        Some("gzip"),
        "pass-through keeps the encoding label: {:?}",
        resp.headers
    );
    assert!(
        resp.body == compressed,
        "the compressed bytes must pass through unchanged ({} vs {} bytes)",
        resp.body.len(),
        compressed.len()
    );
    assert_relayed_promptly(&w.writes(0), &resp.pieces, Duration::from_millis(50));
    router.shutdown().await;
}

/// The median time of `n` streamed requests (20 events each) sent one after the other
/// on `conn`.
async fn median_of(conn: &mut Conn, n: usize) -> Duration {
    let req = Req::post("/v1/chat/completions", chat_body("hi", true));
    let mut took = Vec::with_capacity(n);
    for _ in 0..n {
        let start = Instant::now();
        let resp = conn.request(&req).await;
        took.push(start.elapsed());
        assert_eq!(resp.status, 200);
        assert_eq!(resp.body.len(), 20 * "data: tok00\n\n".len());
    }
    took.sort();
    took[n / 2]
}

// C29
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_through_the_router_adds_no_per_response_stall() {
    // 20 small SSE events written back to back, one write each.
    let w = FakeWorker::start_with(|_| {
        let steps = (0..20)
            .map(|i| Step::Write(format!("data: tok{i:02}\n\n").into_bytes()))
            .collect();
        Reply::status(200)
            .header("Content-Type", "text/event-stream")
            .chunked(steps)
    })
    .await;
    let router = start_router(&yaml_for(&[&w], "")).await;
    // Rounds of 31 requests back to back on one keep-alive connection, direct then
    // routed: a stall shows on every response of a routed round, so it moves the
    // median; a busy machine delays some responses (the median ignores them) or a whole
    // round (the best of three rounds ignores it).
    let mut best = Duration::MAX;
    for _ in 0..3 {
        let direct = median_of(&mut Conn::connect(w.addr()).await, 31).await;
        let routed = median_of(&mut Conn::connect(router.addr).await, 31).await;
        best = best.min(routed.saturating_sub(direct));
    }
    // A stall on every response (a flush waiting on a timer; a delayed ACK without
    // TCP_NODELAY, ~40 ms across hosts) fails this; on loopback a missing TCP_NODELAY
    // costs only 0.3–3 ms, too little to tell reliably from a busy machine.
    assert!(
        best < Duration::from_millis(5),
        "the router adds {best:?} to the median streamed response"
    );
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_broken_mid_body_is_cut_for_the_client_and_never_replayed() {
    // Headers and one event, then the worker's connection drops without the last chunk.
    let event = format!("data: {}\n\n", sse_event(0));
    let raw = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{event}\r\n",
        event.len()
    );
    let a = FakeWorker::start_with(move |_| {
        Reply::raw(vec![
            Step::Write(raw.clone().into_bytes()),
            Step::Sleep(Duration::from_millis(50)),
        ])
    })
    .await;
    let b = FakeWorker::start().await;
    // round_robin: the first request goes to the first worker. With `migration` off
    // (on, the stream would continue on `b`: see `migration.rs`).
    let router = start_router(&yaml_for(
        &[&a, &b],
        "policy: round_robin\nmigration:\n  enabled: false\n",
    ))
    .await;
    let mut conn = Conn::connect(router.addr).await;
    conn.send(&Req::post("/v1/chat/completions", chat_body("break", true)))
        .await
        .unwrap();
    let head = conn.read_head().await;
    assert_eq!(head.status, 200);
    let mut body = Vec::new();
    let ended = loop {
        match within("the cut stream", conn.try_next_piece()).await {
            Ok(Some(p)) => body.extend_from_slice(&p),
            Ok(None) => break "complete",
            Err(_) => break "cut",
        }
    };
    assert_eq!(
        String::from_utf8_lossy(&body),
        event,
        "what the worker sent, once"
    );
    assert_eq!(
        ended, "cut",
        "the client must see that the stream broke, not a clean end"
    );
    assert_eq!(b.count(), 0, "a started answer is never replayed elsewhere");
    wait_all_idle(router.addr, Duration::from_millis(500)).await;
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_scan_holds_back_no_sse_event_not_even_a_split_usage_chunk() {
    // The usage line arrives in two writes: the first half must not wait for the rest.
    let usage = format!("data: {}\n\n", sse_usage_event(321, 256));
    let (head, tail) = usage.split_at(usage.find("\"prompt_tokens_details\"").unwrap());
    let writes: Vec<Vec<u8>> = vec![
        format!("data: {}\n\n", sse_event(0)).into_bytes(),
        format!("data: {}\n\n", sse_event(1)).into_bytes(),
        head.as_bytes().to_vec(),
        tail.as_bytes().to_vec(),
        b"data: [DONE]\n\n".to_vec(),
    ];
    let script = writes.clone();
    let w = FakeWorker::start_with(move |_| {
        let mut steps = Vec::new();
        for (i, data) in script.iter().enumerate() {
            if i > 0 {
                steps.push(Step::Sleep(Duration::from_millis(120)));
            }
            steps.push(Step::Write(data.clone()));
        }
        Reply::status(200)
            .header("Content-Type", "text/event-stream")
            .chunked(steps)
    })
    .await;
    // `migration` off: a stream that may continue elsewhere passes whole events only,
    // and this one's usage event comes in two writes.
    let router = start_router(&yaml_for(&[&w], "migration:\n  enabled: false\n")).await;
    let resp = within(
        "streamed response",
        send(
            router.addr,
            &Req::post("/v1/chat/completions", chat_body("usage please", true)),
        ),
    )
    .await;
    assert_eq!(resp.status, 200);
    assert_eq!(resp.body, writes.concat(), "relayed byte for byte");
    let written = w.writes(0);
    assert_eq!(written.len(), writes.len());
    assert_relayed_promptly(&written, &resp.pieces, Duration::from_millis(50));

    // …and the usage was still read from the bytes as they passed.
    let label = worker_label(router.addr, 0).await;
    let m = scrape(router.addr).await;
    assert_eq!(
        m.get(
            "cache_aware_router_engine_prompt_tokens_total",
            &[("worker", &label)]
        ),
        Some(321.0),
        "{}",
        m.text
    );
    assert_eq!(
        m.get(
            "cache_aware_router_engine_cached_tokens_total",
            &[("worker", &label)]
        ),
        Some(256.0)
    );
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_events_reaches_the_client_while_the_worker_holds_the_stream_open() {
    // 20 events in one write (an engine's burst), then silence until the gate opens: the
    // events the router has already read must not wait for the next one.
    let events: String = (0..20)
        .map(|i| format!("data: {}\n\n", sse_event(i)))
        .collect();
    let mut burst =
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            .to_string();
    for i in 0..20 {
        let e = format!("data: {}\n\n", sse_event(i));
        burst.push_str(&format!("{:x}\r\n{e}\r\n", e.len()));
    }
    let done = "data: [DONE]\n\n";
    let tail = format!("{:x}\r\n{done}\r\n0\r\n\r\n", done.len());
    let gate = Gate::new();
    let g = gate.clone();
    let w = FakeWorker::start_with(move |_| {
        Reply::raw(vec![
            Step::Write(burst.clone().into_bytes()),
            Step::Wait(g.clone()),
            Step::Write(tail.clone().into_bytes()),
        ])
    })
    .await;
    let router = start_router(&yaml_for(&[&w], "")).await;
    let mut conn = Conn::connect(router.addr).await;
    conn.send(&Req::post("/v1/chat/completions", chat_body("burst", true)))
        .await
        .unwrap();
    assert_eq!(conn.read_head().await.status, 200);
    let mut body = Vec::new();
    while body.len() < events.len() {
        match within(
            "the burst, before the worker goes on",
            conn.try_next_piece(),
        )
        .await
        {
            Ok(Some(p)) => body.extend_from_slice(&p),
            other => panic!("stream ended early: {other:?}"),
        }
    }
    assert_eq!(
        String::from_utf8_lossy(&body),
        events,
        "every event, in order, once"
    );
    gate.open();
    let mut rest = Vec::new();
    while let Ok(Some(p)) = within("the end", conn.try_next_piece()).await {
        rest.extend_from_slice(&p);
    }
    assert_eq!(String::from_utf8_lossy(&rest), done);
    wait_all_idle(router.addr, Duration::from_millis(500)).await;
    router.shutdown().await;
}

//! Slow request bodies (a slowloris on the body): each body holds about its own bytes,
//! and a body that does not arrive within `server.body_timeout_secs` gets a JSON 408
//! and its connection closed, without any worker being contacted.

use std::time::{Duration, Instant};

use support::{client::*, config::*, observe::*, wait::*, worker::*};

use crate::common::start_router;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const HEAD: &str =
    "POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n";

/// A chat body of exactly `len` bytes.
fn body_of_len(len: usize) -> Vec<u8> {
    let head = br#"{"model":"m","messages":[{"role":"user","content":""#;
    let tail = br#""}]}"#;
    let mut b = head.to_vec();
    b.resize(len - tail.len(), b'a');
    b.extend_from_slice(tail);
    b
}

/// Reads what the router answers on `conn` until it closes the connection (bounded).
async fn answer_then_close(conn: &mut TcpStream) -> String {
    let mut raw = Vec::new();
    within("the router answers and closes", conn.read_to_end(&mut raw))
        .await
        .expect("read");
    String::from_utf8_lossy(&raw).into_owned()
}

fn assert_408_json(answer: &str) {
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    let body = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    let v: serde_json::Value =
        serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {answer}"));
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("server.body_timeout_secs"), "{msg}");
    assert_eq!(v["error"]["code"], 408);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_stalls_or_trickles_ends_at_the_deadline_with_408() {
    let w = FakeWorker::start().await;
    let router = start_router(&yaml_for(&[&w], "server:\n  body_timeout_secs: 0.5\n")).await;
    let body = body_of_len(300);

    // Idle: part of the body, then nothing.
    let mut idle = TcpStream::connect(router.addr).await.unwrap();
    idle.write_all(format!("{HEAD}Content-Length: 300\r\n\r\n").as_bytes())
        .await
        .unwrap();
    idle.write_all(&body[..40]).await.unwrap();
    // Trickle: a byte every 20 ms, never idle for long, 6 s for the whole body.
    let mut trickle = TcpStream::connect(router.addr).await.unwrap();
    trickle
        .write_all(format!("{HEAD}Content-Length: 300\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let started = Instant::now();
    let (mut reader, mut writer) = trickle.into_split();
    let sender = tokio::spawn(async move {
        for b in body.iter() {
            if writer.write_all(&[*b]).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    let answer = answer_then_close(&mut idle).await;
    assert_408_json(&answer);
    let mut raw = Vec::new();
    within("the trickling body is cut", reader.read_to_end(&mut raw))
        .await
        .unwrap();
    let took = started.elapsed();
    assert_408_json(&String::from_utf8_lossy(&raw));
    assert!(
        took >= Duration::from_millis(450) && took < Duration::from_secs(3),
        "the trickle ended after {took:?}, not at the 0.5 s deadline"
    );
    sender.abort();

    assert_eq!(w.count(), 0, "no worker sees a body that never arrived");
    assert_eq!(in_flight(router.addr).await, [0]);
    // A prompt body still goes through.
    let resp = post(
        router.addr,
        "/v1/chat/completions",
        chat_body("prompt", false),
    )
    .await;
    assert_eq!(resp.status, 200);
    router.shutdown().await;
}

/// The attack from the issue: 300 connections, each sending an honest 390-byte body one
/// byte at a time (117 kB in all). Before, every 1-byte read kept a read buffer alive and
/// the router grew by ~480 MB; each body must now hold about its bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trickled_bodies_hold_about_their_own_bytes() {
    const CONNS: usize = 300;
    const LEN: usize = 390;
    let config = TempFile::new(
        "slow-body.yaml",
        "server:\n  host: 127.0.0.1\n  port: 0\n  body_timeout_secs: 120\nlog:\n  format: json\n  level: warn,cache_aware_router=info\nworkers:\n  - url: http://127.0.0.1:9\n",
    );
    let r = crate::BINARY.serve(&[&config.path]);
    let body = body_of_len(LEN);

    let mut conns = Vec::with_capacity(CONNS);
    for _ in 0..CONNS {
        let mut c = TcpStream::connect(r.addr).await.unwrap();
        c.set_nodelay(true).unwrap();
        c.write_all(format!("{HEAD}Content-Length: {LEN}\r\n\r\n").as_bytes())
            .await
            .unwrap();
        conns.push(c);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let heads_only = r.rss_kib();
    // Every byte but the last, one per write; a short pause between rounds so the router
    // reads each byte on its own, as it does from a slow client.
    for i in 0..LEN - 1 {
        for c in conns.iter_mut() {
            c.write_all(&body[i..=i]).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let held = r.rss_kib();
    let grown_kib = held.saturating_sub(heads_only);
    let received_kib = (CONNS * (LEN - 1) / 1024) as u64;
    eprintln!(
        "RSS with {CONNS} request heads: {heads_only} KiB; with {received_kib} KiB of bodies: {held} KiB (+{grown_kib} KiB)"
    );
    assert!(
        grown_kib < received_kib + 4 * 1024,
        "{received_kib} KiB of bodies grew the router by {grown_kib} KiB"
    );
    // The last byte: every request completes and is answered (no worker: 503).
    for c in conns.iter_mut() {
        c.write_all(&body[LEN - 1..]).await.unwrap();
    }
    for c in conns.iter_mut() {
        let mut head = [0u8; 12];
        within("an answer", c.read_exact(&mut head)).await.unwrap();
        assert_eq!(&head, b"HTTP/1.1 503", "{}", String::from_utf8_lossy(&head));
    }
}

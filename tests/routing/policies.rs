//! The policy seam as a user sees it: routing memory records only the worker that
//! served, worker identity survives membership changes, sessions, the policy family,
//! and fallback workers.

use cache_aware_router::reload::{self, Outcome};
use support::{client::*, config::*, observe::*, worker::*};

use crate::common::start_router;

async fn three_workers() -> [FakeWorker; 3] {
    [
        FakeWorker::start().await,
        FakeWorker::start().await,
        FakeWorker::start().await,
    ]
}

/// `DELETE /workers?url=…` with the admin token `tok`.
async fn remove_worker(addr: std::net::SocketAddr, w: &FakeWorker) -> Response {
    let target = format!("/workers?url={}", w.url());
    send(
        addr,
        &Req::new("DELETE", &target).header("Authorization", "Bearer tok"),
    )
    .await
}

fn long_prompt(topic: &str) -> String {
    let mut p = format!("{topic}. ");
    while p.len() < 4 * 1024 {
        p.push_str("You are a careful assistant; answer with sources and keep it short. ");
    }
    p
}

/// A chat body whose prompt is `prefix` plus `turns` more exchanges (a conversation that
/// grows turn by turn, so each turn's prompt starts with the previous one's).
fn turn_body(prefix: &str, turns: usize) -> String {
    let mut messages = vec![serde_json::json!({"role": "system", "content": prefix})];
    for t in 0..turns {
        messages.push(serde_json::json!({"role": "user", "content": format!("question {t} about {prefix:.20}")}));
        messages.push(serde_json::json!({"role": "assistant", "content": format!("answer {t}")}));
    }
    messages.push(serde_json::json!({"role": "user", "content": "and next?"}));
    serde_json::json!({"model": "m", "messages": messages}).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_503_then_success_elsewhere_binds_later_turns_to_the_worker_that_served() {
    // A refuses every conversation's first turn (503); B serves everything. Wherever the
    // first turn was picked, it was served by B, and the tree must know only that.
    let a = FakeWorker::start_with(|r| {
        if r.body_str().contains("question 0") {
            Reply::json(200, OK_BODY)
        } else {
            Reply::json(503, r#"{"error":{"message":"busy"}}"#)
        }
    })
    .await;
    let b = FakeWorker::start().await;
    let ws = [&a, &b];
    // A high breaker threshold: A stays a candidate for every first turn.
    let router = start_router(&yaml_for(
        &ws,
        "circuit_breaker:\n  failure_threshold: 1000\nproxy:\n  initial_backoff_ms: 1\n",
    ))
    .await;
    let mut first_on_a = 0;
    for c in 0..20 {
        let prefix = long_prompt(&format!("conversation {c}"));
        let tag = new_tag();
        let resp = send(
            router.addr,
            &Req::post("/v1/chat/completions", turn_body(&prefix, 0)).header("x-test-tag", &tag),
        )
        .await;
        assert_eq!(resp.status, 200);
        assert!(b.tagged(&tag).is_some(), "the first turn is served by B");
        if a.tagged(&tag).is_some() {
            first_on_a += 1; // picked A first, refused, retried on B
        }
        for t in 1..4 {
            let (resp, w) = send_tagged(
                router.addr,
                &ws,
                Req::post("/v1/chat/completions", turn_body(&prefix, t)),
            )
            .await;
            assert_eq!(resp.status, 200);
            assert_eq!(
                w, 1,
                "conversation {c} turn {t} goes to B, which computed the prefix"
            );
        }
    }
    // Picks between two idle workers are at random: some first turns went to A.
    assert!(
        first_on_a > 0,
        "no first turn was ever picked on A; the test proves nothing"
    );
    router.shutdown().await;
}

/// The worker index (in `ws`) that serves `body` now.
async fn served(addr: std::net::SocketAddr, ws: &[&FakeWorker], body: &str) -> usize {
    let (resp, w) = send_tagged(
        addr,
        ws,
        Req::post("/v1/chat/completions", body.to_string()),
    )
    .await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    w
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_re_adding_and_reordering_workers_keeps_the_others_affinity() {
    let pool = three_workers().await;
    let ws: Vec<&FakeWorker> = pool.iter().collect();
    let extra = "server:\n  admin_token: tok\n";
    let router = start_router(&yaml_for(&ws, extra)).await;
    // Twelve conversations, each pinned to whichever worker served it first.
    let bodies: Vec<String> = (0..12)
        .map(|i| chat_body(&long_prompt(&format!("topic {i}")), false))
        .collect();
    let mut home = Vec::new();
    for b in &bodies {
        home.push(served(router.addr, &ws, b).await);
    }
    assert!(
        (0..3).all(|w| home.contains(&w)),
        "spread over all three: {home:?}"
    );
    let check = |home: Vec<usize>, skip: Option<usize>| {
        let bodies = bodies.clone();
        let ws = ws.clone();
        async move {
            for (b, h) in bodies.iter().zip(&home) {
                if Some(*h) == skip {
                    continue;
                }
                assert_eq!(
                    served(router.addr, &ws, b).await,
                    *h,
                    "a prompt left its worker"
                );
            }
        }
    };
    // Remove worker 0 (admin API): the others keep their prompts.
    let r = remove_worker(router.addr, &pool[0]).await;
    assert_eq!(r.status, 200, "{}", r.text());
    check(home.clone(), Some(0)).await;
    // Re-add it: still nobody else moves.
    let r = send(
        router.addr,
        &Req::post("/workers", format!(r#"{{"url":"{}"}}"#, pool[0].url()))
            .header("Authorization", "Bearer tok"),
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.text());
    check(home.clone(), Some(0)).await;
    // Reorder the list on SIGHUP: every worker keeps its prompts (worker 0's were
    // re-learned above wherever they went; take the current homes).
    let mut now = Vec::new();
    for b in &bodies {
        now.push(served(router.addr, &ws, b).await);
    }
    let reversed: Vec<&FakeWorker> = ws.iter().rev().copied().collect();
    let f = TempFile::new("workers.yaml", &yaml_for(&reversed, extra));
    assert_eq!(
        reload::apply(
            router.config(),
            router.pool(),
            std::slice::from_ref(&f.path)
        ),
        Outcome::Applied { workers: 3 }
    );
    check(now, None).await;
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_header_keeps_a_client_on_one_worker_until_that_worker_dies() {
    let pool = three_workers().await;
    let ws: Vec<&FakeWorker> = pool.iter().collect();
    // Round robin would move every request; the session keeps it.
    let router = start_router(&yaml_for(
        &ws,
        "policy: round_robin\nserver:\n  admin_token: tok\nhealth:\n  interval_secs: 0.05\n  failure_threshold: 1\n",
    ))
    .await;
    let req = |i: usize| {
        Req::post(
            "/v1/chat/completions",
            chat_body(&format!("turn {i}"), false),
        )
        .header("x-session-id", "agent-7")
    };
    let (_, home) = send_tagged(router.addr, &ws, req(0)).await;
    for i in 1..10 {
        assert_eq!(send_tagged(router.addr, &ws, req(i)).await.1, home);
    }
    // Another worker leaves: the session stays.
    let other = (home + 1) % 3;
    let r = remove_worker(router.addr, &pool[other]).await;
    assert_eq!(r.status, 200);
    for i in 10..15 {
        assert_eq!(send_tagged(router.addr, &ws, req(i)).await.1, home);
    }
    // Its own worker dies: it re-binds to the one left and stays there.
    pool[home].kill().await;
    let (resp, moved) = send_tagged(router.addr, &ws, req(15)).await;
    assert_eq!(resp.status, 200);
    assert_ne!(moved, home);
    for i in 16..20 {
        assert_eq!(send_tagged(router.addr, &ws, req(i)).await.1, moved);
    }
    let w = get_workers(router.addr).await;
    assert!(w["sessions"]["hits"].as_u64().unwrap() >= 17, "{w}");
    assert!(
        w["sessions"]["rebinds_unusable"].as_u64().unwrap()
            + w["sessions"]["rebinds_gone"].as_u64().unwrap()
            >= 1,
        "{w}"
    );
    let m = scrape(router.addr).await;
    assert!(m.value("cache_aware_router_session_hits_total", &[]) >= 17.0);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consistent_hash_keeps_a_key_on_one_worker_and_spreads_keys() {
    let pool = three_workers().await;
    let ws: Vec<&FakeWorker> = pool.iter().collect();
    let router = start_router(&yaml_for(
        &ws,
        "policy: consistent_hash\nsession:\n  enabled: false\n",
    ))
    .await;
    // 60 keys over 3 workers whose ring positions hash their (random-port) URLs: at
    // least 8 each (binomial mean 20, sd 3.7). 30 keys with at least 4 each (mean 10,
    // sd 2.6) failed once under a loaded full-suite run.
    let mut per_worker = [0usize; 3];
    for k in 0..60 {
        let body = chat_body(&format!("key {k}"), false);
        let first = served(router.addr, &ws, &body).await;
        for _ in 0..3 {
            assert_eq!(
                served(router.addr, &ws, &body).await,
                first,
                "key {k} moved"
            );
        }
        per_worker[first] += 1;
    }
    assert!(
        per_worker.iter().all(|n| *n >= 8),
        "keys spread: {per_worker:?}"
    );
    assert_eq!(get_workers(router.addr).await["policy"], "consistent_hash");
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_hash_sends_a_shared_head_to_one_worker_and_spreads_heads() {
    let pool = three_workers().await;
    let ws: Vec<&FakeWorker> = pool.iter().collect();
    let router = start_router(&yaml_for(
        &ws,
        "policy: prefix_hash
prefix_hash:
  prefix_bytes: 256
session:
  enabled: false
",
    ))
    .await;
    // 30 system prompts longer than the head, each with 4 different questions: every
    // question of one system prompt lands where its first did; the heads spread.
    let mut per_worker = [0usize; 3];
    for s in 0..30 {
        let system = long_prompt(&format!("System prompt {s}"));
        let ask = |q: usize| {
            serde_json::json!({"model": "m", "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": format!("question {q} of {s}")},
            ]})
            .to_string()
        };
        let first = served(router.addr, &ws, &ask(0)).await;
        for q in 1..4 {
            assert_eq!(
                served(router.addr, &ws, &ask(q)).await,
                first,
                "head {s} moved"
            );
        }
        per_worker[first] += 1;
    }
    assert!(
        per_worker.iter().all(|n| *n >= 3),
        "heads spread: {per_worker:?}"
    );
    assert_eq!(get_workers(router.addr).await["policy"], "prefix_hash");
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn power_of_two_serves_every_request_and_uses_every_worker() {
    let pool = three_workers().await;
    let ws: Vec<&FakeWorker> = pool.iter().collect();
    let router = start_router(&yaml_for(&ws, "policy: power_of_two\n")).await;
    for i in 0..60 {
        let resp = post(
            router.addr,
            "/v1/chat/completions",
            chat_body(&format!("p {i}"), false),
        )
        .await;
        assert_eq!(resp.status, 200);
    }
    assert!(
        pool.iter().all(|w| w.count() >= 5),
        "{:?}",
        pool.iter().map(|w| w.count()).collect::<Vec<_>>()
    );
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fallback_workers_take_traffic_only_while_no_primary_is_usable() {
    let primary = FakeWorker::start().await;
    let spare = FakeWorker::start().await;
    let yaml = format!(
        "policy: least_load\nhealth:\n  interval_secs: 0.05\n  failure_threshold: 1\nworkers:\n  - url: {}\n  - url: {}\n    role: fallback\n",
        primary.url(),
        spare.url()
    );
    let router = start_router(&yaml).await;
    for i in 0..10 {
        let resp = post(
            router.addr,
            "/v1/chat/completions",
            chat_body(&format!("p {i}"), false),
        )
        .await;
        assert_eq!(resp.status, 200);
    }
    assert_eq!((primary.count(), spare.count()), (10, 0));
    let w = get_workers(router.addr).await;
    assert_eq!(w["workers"][1]["role"], "fallback");
    primary.kill().await;
    for i in 0..5 {
        let resp = post(
            router.addr,
            "/v1/chat/completions",
            chat_body(&format!("q {i}"), false),
        )
        .await;
        assert_eq!(resp.status, 200);
    }
    assert_eq!(spare.count(), 5);
    assert!(
        scrape(router.addr)
            .await
            .value("cache_aware_router_fallback_picks_total", &[])
            >= 5.0
    );
    router.shutdown().await;
}

/// A worker that answers `/v1/responses` as an OpenAI-style engine does, with ids of its
/// own (`resp_<name>_<n>`): JSON, or SSE (`response.created` first) when asked to stream.
async fn responses_worker(name: &'static str) -> FakeWorker {
    FakeWorker::start_with(move |r| {
        let id = format!("resp_{name}_{}", r.index);
        if r.body_str().contains("\"stream\":true") {
            let created = format!(
                r#"{{"type":"response.created","response":{{"id":"{id}","object":"response","status":"in_progress"}}}}"#
            );
            let delta = r#"{"type":"response.output_text.delta","delta":"ok"}"#.to_string();
            let done = format!(
                r#"{{"type":"response.completed","response":{{"id":"{id}","object":"response","status":"completed"}}}}"#
            );
            Reply::sse(&[created, delta, done], std::time::Duration::ZERO)
        } else {
            Reply::json(
                200,
                &format!(r#"{{"id":"{id}","object":"response","status":"completed","output":[]}}"#),
            )
        }
    })
    .await
}

/// The response id in an answer (JSON or SSE).
fn response_id(text: &str) -> String {
    let start = text.find("\"id\":\"resp_").expect("a response id") + 6;
    let end = start + text[start..].find('"').unwrap();
    text[start..end].to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_previous_response_id_follow_up_reaches_the_worker_that_created_it() {
    let a = responses_worker("a").await;
    let b = responses_worker("b").await;
    let ws = [&a, &b];
    // Round robin alternates: only the learned response ids keep follow-ups in place.
    let router = start_router(&yaml_for(&ws, "policy: round_robin\n")).await;
    for stream in [false, true] {
        for i in 0..20 {
            let first =
                serde_json::json!({"model": "m", "input": format!("start {i}"), "stream": stream});
            let (resp, origin) = send_tagged(
                router.addr,
                &ws,
                Req::post("/v1/responses", first.to_string()),
            )
            .await;
            assert_eq!(resp.status, 200);
            let id = response_id(&resp.text());
            assert!(
                id.starts_with(if origin == 0 { "resp_a" } else { "resp_b" }),
                "{id}"
            );
            let follow = serde_json::json!({
                "model": "m",
                "input": "and then?",
                "previous_response_id": id,
                "stream": stream,
            });
            let (resp, w) = send_tagged(
                router.addr,
                &ws,
                Req::post("/v1/responses", follow.to_string()),
            )
            .await;
            assert_eq!(resp.status, 200);
            assert_eq!(
                w, origin,
                "stream={stream} follow-up {i} left the worker holding {id}"
            );
        }
    }
    let w = get_workers(router.addr).await;
    assert_eq!(w["sessions"]["conversation_hits"], 40, "{w}");
    // The worker holding the state is gone: the follow-up still gets a worker's answer.
    let first = serde_json::json!({"model": "m", "input": "last"});
    let (resp, origin) = send_tagged(
        router.addr,
        &ws,
        Req::post("/v1/responses", first.to_string()),
    )
    .await;
    let id = response_id(&resp.text());
    ws[origin].kill().await;
    let follow = serde_json::json!({"model": "m", "input": "more", "previous_response_id": id});
    let resp = post(router.addr, "/v1/responses", follow.to_string()).await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    router.shutdown().await;
}

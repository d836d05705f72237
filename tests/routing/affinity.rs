//! Which worker gets a request: prefix affinity, spreading, round robin, and the load
//! guard that overrides affinity.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::{client::*, config::*, engine::*, observe::*, wait::*, worker::*};

use crate::common::start_router;

async fn workers(n: usize) -> Vec<FakeWorker> {
    let mut v = Vec::new();
    for _ in 0..n {
        v.push(FakeWorker::start().await);
    }
    v
}

fn long_prompt(topic: &str) -> String {
    let mut p = format!("{topic}. ");
    while p.len() < 10 * 1024 {
        p.push_str("You are a careful assistant; answer with sources and keep it short. ");
    }
    p.push_str("Question: what changed?");
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_long_prompt_lands_on_the_same_worker() {
    let pool = workers(3).await;
    let ws: Vec<&FakeWorker> = pool.iter().collect();
    let router = start_router(&yaml_for(&ws, "")).await;
    let body = chat_body(&long_prompt("Quarterly report"), false);
    assert!(body.len() > 8 * 1024);
    let mut served = Vec::new();
    for _ in 0..5 {
        let (resp, w) = send_tagged(
            router.addr,
            &ws,
            Req::post("/v1/chat/completions", body.clone()),
        )
        .await;
        assert_eq!(resp.status, 200);
        served.push(w);
    }
    assert!(
        served.iter().all(|w| *w == served[0]),
        "the same prompt should stick to one worker: {served:?}"
    );
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distinct_prompts_spread_over_every_worker() {
    let pool = workers(3).await;
    let ws: Vec<&FakeWorker> = pool.iter().collect();
    let router = start_router(&yaml_for(&ws, "")).await;
    let topics = [
        "apples",
        "bridges",
        "comets",
        "dunes",
        "engines",
        "ferns",
        "glaciers",
        "harbors",
        "islands",
        "jungles",
        "kites",
        "lanterns",
        "meadows",
        "nebulae",
        "orchards",
        "prisms",
        "quarries",
        "rivers",
        "sonnets",
        "tundras",
        "volcanoes",
        "wharves",
        "yachts",
        "zithers",
        "anvils",
        "beacons",
        "canyons",
        "deltas",
        "estuaries",
        "fjords",
    ];
    let mut per_worker = [0usize; 3];
    for t in topics {
        let prompt = format!("{t}: write three sentences about {t} for a school report on {t}.");
        let (resp, w) = send_tagged(
            router.addr,
            &ws,
            Req::post("/v1/chat/completions", chat_body(&prompt, false)),
        )
        .await;
        assert_eq!(resp.status, 200);
        per_worker[w] += 1;
    }
    // Unrelated prompts are cache misses that go to a least-loaded worker chosen at
    // random among ties; a worker left out of 30 picks has probability ~1e-5.
    assert!(
        per_worker.iter().all(|n| *n > 0),
        "30 unrelated prompts should reach every worker: {per_worker:?}"
    );
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_policy_takes_workers_in_turn() {
    let pool = workers(3).await;
    let ws: Vec<&FakeWorker> = pool.iter().collect();
    let router = start_router(&yaml_for(&ws, "policy: round_robin")).await;
    let body = chat_body(&long_prompt("Same prompt every time"), false);
    let mut served = Vec::new();
    for _ in 0..9 {
        let (resp, w) = send_tagged(
            router.addr,
            &ws,
            Req::post("/v1/chat/completions", body.clone()),
        )
        .await;
        assert_eq!(resp.status, 200);
        served.push(w);
    }
    let first: Vec<usize> = served[..3].to_vec();
    let mut sorted = first.clone();
    sorted.sort();
    assert_eq!(
        sorted,
        [0, 1, 2],
        "one turn visits each worker once: {served:?}"
    );
    for (i, w) in served.iter().enumerate() {
        assert_eq!(
            *w,
            first[i % 3],
            "round robin repeats the same order: {served:?}"
        );
    }
    assert_eq!(
        get_workers(router.addr).await["policy"],
        "round_robin",
        "/workers names the policy"
    );
    router.shutdown().await;
}

/// Opens a streamed request and waits for its first event, so that it is in flight.
async fn open_stream(addr: std::net::SocketAddr, body: &str, tag: &str) -> Conn {
    let mut conn = Conn::connect(addr).await;
    conn.send(&Req::post("/v1/chat/completions", body.to_string()).header("x-test-tag", tag))
        .await
        .expect("send");
    let head = conn.read_head().await;
    assert_eq!(head.status, 200);
    assert!(conn.next_piece().await.is_some(), "first event");
    conn
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn imbalanced_load_picks_least_in_flight() {
    let gate = Gate::new();
    let pool = gated_workers(&gate).await;
    let ws: Vec<&FakeWorker> = pool.iter().collect();
    // Defaults: balance_abs_threshold 2, balance_rel_threshold 1.5.
    let router = start_router(&yaml_for(&ws, "")).await;
    let prompt = long_prompt("Pinned conversation");
    let plain = chat_body(&prompt, false);
    let streamed = chat_body(&prompt, true);

    let (_, x) = send_tagged(
        router.addr,
        &ws,
        Req::post("/v1/chat/completions", plain.clone()),
    )
    .await;
    let y = 1 - x;

    let mut streams = Vec::new();
    for n in 1..=3 {
        let tag = new_tag();
        streams.push(open_stream(router.addr, &streamed, &tag).await);
        assert_eq!(
            served_by(&ws, &tag),
            x,
            "stream {n} follows the prefix to worker {x}"
        );
        let loads = in_flight(router.addr).await;
        assert_eq!(
            loads[x], n as u64,
            "in_flight of the pinned worker: {loads:?}"
        );
        assert_eq!(loads[y], 0, "{loads:?}");
        let (resp, w) = send_tagged(
            router.addr,
            &ws,
            Req::post("/v1/chat/completions", plain.clone()),
        )
        .await;
        assert_eq!(resp.status, 200);
        if n <= 2 {
            // 2 in flight vs 0 is within balance_abs_threshold: affinity wins.
            assert_eq!(w, x, "with {n} in flight the prefix still wins");
        } else {
            // 3 vs 0 exceeds both margins: the least-loaded worker gets it.
            assert_eq!(
                w, y,
                "with {n} in flight on the cached worker, the idle one is picked"
            );
        }
    }
    gate.open();
    for mut s in streams {
        while s.next_piece().await.is_some() {}
    }
    wait_all_idle(router.addr, Duration::from_secs(1)).await;
    router.shutdown().await;
}

/// Two [`gated_streams`] workers.
async fn gated_workers(gate: &Gate) -> Vec<FakeWorker> {
    let mut pool = Vec::new();
    for _ in 0..2 {
        pool.push(FakeWorker::start_with(gated_streams(gate)).await);
    }
    pool
}

/// A document read once, then the worker holding it made 3 requests busier than the
/// other with streams of another prompt; returns who serves the document's next
/// reader, and who held it.
async fn next_reader_of_a_document(cache: &str) -> (usize, usize) {
    let gate = Gate::new();
    let pool = gated_workers(&gate).await;
    let ws: Vec<&FakeWorker> = pool.iter().collect();
    let router = start_router(&yaml_for(&ws, cache)).await;
    let addr = router.addr;
    let doc = chat_body(&long_prompt("Operations manual, chapter 7"), false);
    let (_, x) = send_tagged(addr, &ws, Req::post("/v1/chat/completions", doc.clone())).await;
    // Another prompt recorded on x (a miss goes where its digest breaks the tie).
    let mut other = None;
    for i in 0..32 {
        let body = chat_body(&long_prompt(&format!("Release notes {i}")), false);
        let (_, w) = send_tagged(addr, &ws, Req::post("/v1/chat/completions", body)).await;
        if w == x {
            other = Some(long_prompt(&format!("Release notes {i}")));
            break;
        }
    }
    let other = other.expect("a new prompt lands on either worker");
    let streamed = chat_body(&other, true);
    let mut streams = Vec::new();
    for _ in 0..3 {
        let tag = new_tag();
        streams.push(open_stream(addr, &streamed, &tag).await);
        assert_eq!(
            served_by(&ws, &tag),
            x,
            "within the margins: the prefix wins"
        );
    }
    assert_eq!(in_flight(addr).await[x], 3);
    let (resp, w) = send_tagged(addr, &ws, Req::post("/v1/chat/completions", doc)).await;
    assert_eq!(resp.status, 200);
    gate.open();
    for mut s in streams {
        while s.next_piece().await.is_some() {}
    }
    wait_all_idle(addr, Duration::from_secs(1)).await;
    router.shutdown().await;
    (w, x)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_document_few_requests_share_stays_on_its_worker_past_the_plain_margin() {
    // 3 in flight against 0 is past balance_abs_threshold (2) and the ratio, but the
    // other worker would recompute the whole document: the margin is 2 + 64.
    let (w, x) = next_reader_of_a_document("").await;
    assert_eq!(w, x, "the document stays where it is cached");
    // With the key at 0, the plain margins alone move it.
    let (w, x) = next_reader_of_a_document("cache:\n  balance_match_threshold: 0\n").await;
    assert_ne!(w, x, "without the match margin the idle worker gets it");
}

/// A mock worker for the queue tests: a streamed prompt containing `WAITING` sends its
/// headers and then nothing until `gate` opens (a request queued for prefill: no first
/// token yet); one containing `DECODING` sends its first event and then waits (a request
/// decoding); anything else is answered at once.
fn queue_engine(gate: &Gate) -> impl Fn(&Recorded) -> Reply + Send + Sync + 'static {
    let gate = gate.clone();
    move |req| {
        let body = req.body_str();
        let event = |i| format!("data: {}\n\n", sse_event(i)).into_bytes();
        let stream = |steps| {
            Reply::status(200)
                .header("Content-Type", "text/event-stream")
                .chunked(steps)
        };
        if body.contains("WAITING") {
            stream(vec![
                Step::Wait(gate.clone()),
                Step::Write(event(0)),
                Step::Write(b"data: [DONE]\n\n".to_vec()),
            ])
        } else if body.contains("DECODING") {
            stream(vec![
                Step::Write(event(0)),
                Step::Wait(gate.clone()),
                Step::Write(b"data: [DONE]\n\n".to_vec()),
            ])
        } else {
            Reply::ok()
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_request_goes_where_no_request_waits_for_its_first_token() {
    let gate = Gate::new();
    let a = FakeWorker::start_with(queue_engine(&gate)).await;
    let b = FakeWorker::start_with(queue_engine(&gate)).await;
    let ws = [&a, &b];
    let router = start_router(&yaml_for(&ws, "")).await;
    let addr = router.addr;
    // x: one request decoding.
    let tag = new_tag();
    let d1 = open_stream(addr, &chat_body(&long_prompt("DECODING one"), true), &tag).await;
    let x = served_by(&ws, &tag);
    let y = 1 - x;
    // y: one request still waiting for its first token (the least-loaded worker).
    let tag = new_tag();
    let mut waiting = Conn::connect(addr).await;
    waiting
        .send(
            &Req::post(
                "/v1/chat/completions",
                chat_body(&long_prompt("WAITING for prefill"), true),
            )
            .header("x-test-tag", &tag),
        )
        .await
        .unwrap();
    assert_eq!(waiting.read_head().await.status, 200);
    assert_eq!(
        served_by(&ws, &tag),
        y,
        "the idle worker gets the second request"
    );
    // One in flight on each: the new request goes where nothing waits for prefill.
    let tag = new_tag();
    let d2 = open_stream(addr, &chat_body(&long_prompt("DECODING two"), true), &tag).await;
    assert_eq!(
        served_by(&ws, &tag),
        x,
        "equal loads: the empty prefill queue wins"
    );
    // 2 in flight on x against 1 on y, within the load guard: still x, whose requests
    // are all past their first token.
    let loads = in_flight(addr).await;
    assert_eq!((loads[x], loads[y]), (2, 1), "{loads:?}");
    let (resp, w) = send_tagged(
        addr,
        &ws,
        Req::post(
            "/v1/chat/completions",
            chat_body(&long_prompt("A new question"), false),
        ),
    )
    .await;
    assert_eq!(resp.status, 200);
    assert_eq!(w, x, "the worker with no request queued for prefill");
    gate.open();
    for mut s in [d1, d2, waiting] {
        while s.next_piece().await.is_some() {}
    }
    wait_all_idle(addr, Duration::from_secs(1)).await;
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_at_max_load_is_skipped_even_when_it_holds_the_prefix() {
    let gate = Gate::new();
    let g = gate.clone();
    let answer = move |req: &Recorded| {
        if req.body_str().contains(r#""stream":true"#) {
            Reply::status(200)
                .header("Content-Type", "text/event-stream")
                .chunked(vec![
                    Step::Write(format!("data: {}\n\n", sse_event(0)).into_bytes()),
                    Step::Wait(g.clone()),
                ])
        } else {
            Reply::ok()
        }
    };
    let a = FakeWorker::start_with(answer.clone()).await;
    let b = FakeWorker::start_with(answer).await;
    let yaml = format!(
        "workers:\n  - url: {}\n    max_load: 1\n  - url: {}\n    max_load: 1\n",
        a.url(),
        b.url()
    );
    let router = start_router(&yaml).await;
    let ws = [&a, &b];
    let prompt = long_prompt("Capped worker");
    let (_, x) = send_tagged(
        router.addr,
        &ws,
        Req::post("/v1/chat/completions", chat_body(&prompt, false)),
    )
    .await;
    let tag = new_tag();
    let _s1 = open_stream(router.addr, &chat_body(&prompt, true), &tag).await;
    assert_eq!(served_by(&ws, &tag), x, "follows the prefix");
    // The cached worker is full: the same prefix goes to the other one.
    let tag = new_tag();
    let _s2 = open_stream(router.addr, &chat_body(&prompt, true), &tag).await;
    assert_eq!(served_by(&ws, &tag), 1 - x, "a full worker is not usable");
    // Both full: 503 with a JSON error, nothing forwarded.
    let before = a.count() + b.count();
    let resp = post(
        router.addr,
        "/v1/chat/completions",
        chat_body(&prompt, false),
    )
    .await;
    assert_eq!(resp.status, 503, "{}", resp.text());
    assert!(resp.json()["error"]["message"].is_string());
    assert_eq!(a.count() + b.count(), before);
    gate.open();
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tree_is_evicted_down_to_its_node_ceiling() {
    let pool = workers(2).await;
    let ws: Vec<&FakeWorker> = pool.iter().collect();
    let router = start_router(&yaml_for(
        &ws,
        "cache:\n  max_tree_size: 20\n  eviction_interval_secs: 0.05\n",
    ))
    .await;
    for i in 0..60 {
        let prompt = format!("{i:03} unrelated question number {i} about a topic of its own");
        let r = post(
            router.addr,
            "/v1/chat/completions",
            chat_body(&prompt, false),
        )
        .await;
        assert_eq!(r.status, 200);
    }
    wait_until(
        "tree back under 20 nodes",
        Duration::from_secs(2),
        || async {
            get_workers(router.addr).await["tree_nodes"]
                .as_u64()
                .unwrap()
                <= 20
        },
    )
    .await;
    // Recent prompts still route by prefix.
    let prompt = long_prompt("After eviction");
    let body = chat_body(&prompt, false);
    let (_, first) = send_tagged(
        router.addr,
        &ws,
        Req::post("/v1/chat/completions", body.clone()),
    )
    .await;
    for _ in 0..3 {
        let (_, w) = send_tagged(
            router.addr,
            &ws,
            Req::post("/v1/chat/completions", body.clone()),
        )
        .await;
        assert_eq!(w, first);
    }
    router.shutdown().await;
}

/// Routing decisions by reason (Prometheus counter).
const DECISIONS: &str = "cache_aware_router_routing_decisions_total";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_prompts_are_evicted_to_the_byte_ceiling_without_waiting_for_the_pass() {
    let pool = workers(2).await;
    let ws: Vec<&FakeWorker> = pool.iter().collect();
    // The periodic pass is an hour away: the tree an eighth past its byte ceiling is
    // evicted within a second instead.
    let router = start_router(&yaml_for(
        &ws,
        "cache:\n  max_prompt_bytes: 1024\n  max_tree_bytes: 4096\n  eviction_interval_secs: 3600\n",
    ))
    .await;
    let prompt = |i: usize| format!("{i:03} {}", "a long question of its own ".repeat(40));
    for i in 0..12 {
        let r = chat(router.addr, &prompt(i)).await;
        assert_eq!(r.status, 200);
    }
    let bytes = || async {
        get_workers(router.addr).await["tree_bytes"]
            .as_u64()
            .unwrap()
    };
    assert!(bytes().await > 4096 + 4096 / 8, "12 prompts of ~1 KiB held");
    wait_until(
        "tree under its byte ceiling",
        Duration::from_secs(3),
        || async { bytes().await <= 4096 },
    )
    .await;
    // Least recently used first: the last prompt is still held (a cache hit), the
    // first is gone (a miss).
    let hits = || async {
        scrape(router.addr)
            .await
            .value(DECISIONS, &[("reason", "cache_hit")])
    };
    let before = hits().await;
    assert_eq!(chat(router.addr, &prompt(11)).await.status, 200);
    assert_eq!(hits().await, before + 1.0, "the most recent prompt is held");
    assert_eq!(chat(router.addr, &prompt(0)).await.status, 200);
    assert_eq!(hits().await, before + 1.0, "the oldest prompt was evicted");
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_holds_the_tree_at_its_cap_and_keeps_a_prefix_in_use() {
    const CAP: u64 = 24;
    let pool = workers(2).await;
    let ws: Vec<&FakeWorker> = pool.iter().collect();
    let router = start_router(&yaml_for(
        &ws,
        &format!("cache:\n  max_tree_size: {CAP}\n  eviction_interval_secs: 0.05\n"),
    ))
    .await;
    let addr = router.addr;
    let unrelated = |tag: &str, i: usize| {
        chat_body(
            &format!("{tag}-{i:02} unrelated question about a topic of its own"),
            false,
        )
    };
    // Older traffic first, so that the shared prefix is never among the oldest entries:
    // only a least-recently-used order keeps it.
    for i in 0..40 {
        let r = post(addr, "/v1/chat/completions", unrelated("old", i)).await;
        assert_eq!(r.status, 200);
    }
    wait_until("tree at its cap", Duration::from_secs(2), || async {
        get_workers(addr).await["tree_nodes"].as_u64().unwrap() <= CAP
    })
    .await;
    let system = long_prompt("Shared agent instructions");
    let shared = |q: &str| chat_body(&format!("{system}\n{q}"), false);
    let (_, holder) = send_tagged(
        addr,
        &ws,
        Req::post("/v1/chat/completions", shared("first task")),
    )
    .await;

    for round in 0..3 {
        // Far more unrelated prompts than the cap, with the shared prefix in use
        // among them, as an agent fleet would.
        for i in 0..40 {
            let r = post(
                addr,
                "/v1/chat/completions",
                unrelated(&round.to_string(), i),
            )
            .await;
            assert_eq!(r.status, 200);
            if i % 8 == 7 {
                let (r, w) = send_tagged(
                    addr,
                    &ws,
                    Req::post("/v1/chat/completions", shared(&format!("task {round}-{i}"))),
                )
                .await;
                assert_eq!((r.status, w), (200, holder), "round {round}, step {i}");
            }
        }
        // An eviction pass brings the tree back to the cap (not far below it).
        wait_until("tree back at its cap", Duration::from_secs(2), || async {
            get_workers(addr).await["tree_nodes"].as_u64().unwrap() <= CAP
        })
        .await;
        let nodes = get_workers(addr).await["tree_nodes"].as_u64().unwrap();
        assert!(
            nodes >= CAP * 3 / 4,
            "round {round}: eviction removes only the excess, {nodes} nodes left"
        );

        // The shared prefix survived: a new task with it is a cache hit on its holder.
        let hits = scrape(addr)
            .await
            .value(DECISIONS, &[("reason", "cache_hit")]);
        let (r, w) = send_tagged(
            addr,
            &ws,
            Req::post(
                "/v1/chat/completions",
                shared(&format!("new task after round {round}")),
            ),
        )
        .await;
        assert_eq!(r.status, 200);
        assert_eq!(w, holder, "round {round}: the shared prefix still routes");
        assert_eq!(
            scrape(addr)
                .await
                .value(DECISIONS, &[("reason", "cache_hit")]),
            hits + 1.0,
            "round {round}: routed as a cache hit"
        );
    }
    // What went is what was used longest ago: the first prompt of all is a miss now.
    let misses = scrape(addr).await.value(DECISIONS, &[("reason", "miss")]);
    let r = post(addr, "/v1/chat/completions", unrelated("old", 0)).await;
    assert_eq!(r.status, 200);
    let m = scrape(addr).await;
    assert_eq!(
        m.value(DECISIONS, &[("reason", "miss")]),
        misses + 1.0,
        "the least recently used prompt was evicted"
    );
    assert!(
        m.value("cache_aware_router_tree_evicted_nodes_total", &[]) >= (4 * 40) as f64 - CAP as f64,
        "{}",
        m.text
    );
    router.shutdown().await;
}

/// A worker that stores the `/v1/responses` it creates, as vLLM does (in its own
/// memory): `background: true` creates answer `queued` at once; the calls on an id it
/// holds answer 200 (a poll, a resumed stream, the input items, a cancel, a delete);
/// any other id gets vLLM's 404.
async fn response_store(name: &'static str) -> FakeWorker {
    let held: Arc<Mutex<HashSet<String>>> = Arc::default();
    FakeWorker::start_with(move |r| {
        let path = r.target.split('?').next().unwrap_or("");
        if r.method == "POST" && path == "/v1/responses" {
            let id = format!("resp_{name}_{}", r.index);
            held.lock().unwrap().insert(id.clone());
            return Reply::json(
                200,
                &format!(r#"{{"id":"{id}","object":"response","status":"queued"}}"#),
            );
        }
        let Some(rest) = path.strip_prefix("/v1/responses/") else {
            return Reply::ok();
        };
        let (id, tail) = rest.split_once('/').unwrap_or((rest, ""));
        let mut held = held.lock().unwrap();
        if !held.contains(id) {
            return Reply::json(
                404,
                &format!(
                    r#"{{"error":{{"message":"Response with id '{id}' not found.","type":"invalid_request_error","code":404}}}}"#
                ),
            );
        }
        match (r.method.as_str(), tail) {
            ("GET", "") if r.target.contains("stream=true") => Reply::sse(
                &[format!(
                    r#"{{"type":"response.completed","sequence_number":1,"response":{{"id":"{id}","object":"response","status":"completed"}}}}"#
                )],
                Duration::ZERO,
            ),
            ("GET", "") => Reply::json(
                200,
                &format!(r#"{{"id":"{id}","object":"response","status":"in_progress"}}"#),
            ),
            ("GET", "input_items") => Reply::json(200, r#"{"object":"list","data":[]}"#),
            ("POST", "cancel") => Reply::json(
                200,
                &format!(r#"{{"id":"{id}","object":"response","status":"cancelled"}}"#),
            ),
            ("DELETE", "") => {
                held.remove(id);
                Reply::json(
                    200,
                    &format!(r#"{{"id":"{id}","object":"response","deleted":true}}"#),
                )
            }
            _ => Reply::status(405),
        }
    })
    .await
}

/// Creates a background response through the router: its id and the index of the
/// worker holding it.
async fn create_background(addr: std::net::SocketAddr, n: usize) -> (String, usize) {
    let body = serde_json::json!({"model": "m", "input": format!("job {n}"), "background": true});
    let r = post(addr, "/v1/responses", body.to_string()).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let id = r.json()["id"].as_str().unwrap().to_string();
    let owner = if id.starts_with("resp_a_") { 0 } else { 1 };
    (id, owner)
}

/// The calls on stored responses each worker received.
fn per_id_calls(w: &FakeWorker) -> Vec<String> {
    w.requests()
        .into_iter()
        .filter(|r| r.target.starts_with("/v1/responses/"))
        .map(|r| format!("{} {}", r.method, r.target))
        .collect()
}

// C46
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_on_a_stored_response_reach_the_worker_that_created_it() {
    let a = response_store("a").await;
    let b = response_store("b").await;
    let ws = [&a, &b];
    // Round robin alternates: only the ids learned from the create answers keep the
    // per-id calls on their worker.
    let router = start_router(&yaml_for(&ws, "policy: round_robin\n")).await;
    let addr = router.addr;
    let mut owners = [0; 2];
    for n in 0..8 {
        let (id, owner) = create_background(addr, 2 * n).await;
        let before = [per_id_calls(&a).len(), per_id_calls(&b).len()];
        for _ in 0..3 {
            let r = get(addr, &format!("/v1/responses/{id}")).await;
            assert_eq!(r.status, 200, "poll of {id}: {}", r.text());
            assert_eq!(r.json()["id"], id.as_str());
        }
        let r = get(
            addr,
            &format!("/v1/responses/{id}?stream=true&starting_after=0"),
        )
        .await;
        assert_eq!(r.status, 200, "stream resume of {id}: {}", r.text());
        assert!(r.text().contains(&id), "{}", r.text());
        let r = get(addr, &format!("/v1/responses/{id}/input_items")).await;
        assert_eq!(r.status, 200, "input items of {id}: {}", r.text());
        // A cancel on a second background response stops it on its own worker.
        let (second, second_owner) = create_background(addr, 2 * n + 1).await;
        owners[owner] += 1;
        owners[second_owner] += 1;
        let r = post(addr, &format!("/v1/responses/{second}/cancel"), "").await;
        assert_eq!(r.status, 200, "cancel of {second}: {}", r.text());
        assert_eq!(r.json()["status"], "cancelled");
        assert!(
            per_id_calls(ws[second_owner]).contains(&format!("POST /v1/responses/{second}/cancel")),
            "the owner of {second} never saw its cancel"
        );
        let r = send(addr, &Req::new("DELETE", &format!("/v1/responses/{id}"))).await;
        assert_eq!(r.status, 200, "delete of {id}: {}", r.text());
        // Every call reached the owner; the other worker saw none of them.
        let after = [per_id_calls(&a).len(), per_id_calls(&b).len()];
        let calls_on_id = 6 + usize::from(second_owner == owner);
        assert_eq!(
            after[owner] - before[owner],
            calls_on_id,
            "chain {n} ({id})"
        );
        let other = 1 - owner;
        assert_eq!(
            after[other] - before[other],
            usize::from(second_owner == other),
            "chain {n}: a call on {id} reached the worker that does not hold it: {:?}",
            per_id_calls(ws[other])
        );
    }
    assert_eq!(owners, [8, 8], "round robin spread the creates");

    // An id no worker holds: every worker is asked, and the engines' 404 comes back.
    let r = get(addr, "/v1/responses/resp_nobody_1").await;
    assert_eq!(r.status, 404, "{}", r.text());
    for w in ws {
        assert!(per_id_calls(w).contains(&"GET /v1/responses/resp_nobody_1".to_string()));
    }

    // A router that never saw the create (another replica, or this one restarted)
    // finds the owner by asking every worker, then goes to it alone.
    let (id, owner) = create_background(addr, 100).await;
    let fresh = start_router(&yaml_for(&ws, "policy: round_robin\n")).await;
    let r = get(fresh.addr, &format!("/v1/responses/{id}")).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let before = [per_id_calls(&a).len(), per_id_calls(&b).len()];
    let r = post(fresh.addr, &format!("/v1/responses/{id}/cancel"), "").await;
    assert_eq!(r.status, 200, "{}", r.text());
    let after = [per_id_calls(&a).len(), per_id_calls(&b).len()];
    assert_eq!(after[owner] - before[owner], 1);
    assert_eq!(
        after[1 - owner],
        before[1 - owner],
        "learned from the fan-out"
    );
    fresh.shutdown().await;
    router.shutdown().await;
}

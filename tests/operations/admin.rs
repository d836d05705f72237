//! The admin API: `POST /workers`, `DELETE /workers?url=…`, `POST /cache/clear[?worker=…]`,
//! guarded by `server.admin_token`, observed through `/workers`, `/metrics` and where
//! requests land.

use std::net::SocketAddr;
use std::time::Duration;

use support::{client::*, config::*, engine::*, observe::*, wait::*, worker::*};

use crate::common::start_router;

const TOKEN: &str = "qa-admin-token-1";
const WITH_TOKEN: &str = "server:\n  admin_token: qa-admin-token-1\n";
const DECISIONS: &str = "cache_aware_router_routing_decisions_total";

fn admin(method: &str, target: &str) -> Req {
    Req::new(method, target)
        .header("Authorization", &format!("Bearer {TOKEN}"))
        .header("Content-Length", "0")
}

fn add_worker(body: &str) -> Req {
    Req::new("POST", "/workers")
        .header("Authorization", &format!("Bearer {TOKEN}"))
        .header("Content-Type", "application/json")
        .body(body.as_bytes().to_vec())
}

/// Asserts a JSON error body in the router's shape with this status.
fn assert_error(resp: &Response, status: u16, what: &str) {
    assert_eq!(resp.status, status, "{what}: {}", resp.text());
    let v = resp.json();
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{what}: {v}"
    );
    assert_eq!(v["error"]["code"], status, "{what}: {v}");
}

async fn urls(addr: SocketAddr) -> Vec<String> {
    get_workers(addr).await["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["url"].as_str().unwrap().to_string())
        .collect()
}

async fn tree_nodes(addr: SocketAddr) -> u64 {
    get_workers(addr).await["tree_nodes"].as_u64().unwrap()
}

fn long_prompt(topic: &str) -> String {
    let mut p = format!("{topic}. ");
    while p.len() < 4096 {
        p.push_str("Keep the whole repository layout in mind and answer briefly. ");
    }
    p
}

/// Opens a tagged streamed request and reads its first event (it is then in flight).
async fn open_stream(addr: SocketAddr, prompt: &str, tag: &str) -> Conn {
    let mut conn = Conn::connect(addr).await;
    conn.send(
        &Req::post("/v1/chat/completions", chat_body(prompt, true)).header("x-test-tag", tag),
    )
    .await
    .unwrap();
    assert_eq!(conn.read_head().await.status, 200);
    conn.next_piece().await.expect("first event");
    conn
}

async fn decisions(addr: SocketAddr, reason: &str) -> f64 {
    scrape(addr).await.value(DECISIONS, &[("reason", reason)])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_api_without_a_configured_token_answers_403_saying_how_to_enable_it() {
    let a = FakeWorker::start().await;
    let b = FakeWorker::start().await;
    let router = start_router(&yaml_for(&[&a], "")).await;
    let addr = router.addr;
    post(
        addr,
        "/v1/chat/completions",
        chat_body(&long_prompt("x"), false),
    )
    .await;
    let nodes = tree_nodes(addr).await;
    let calls = [
        add_worker(&format!(r#"{{"url":"{}"}}"#, b.url())),
        admin("DELETE", &format!("/workers?url={}", a.url())),
        admin("POST", "/cache/clear"),
        admin("POST", &format!("/cache/clear?worker={}", a.url())),
    ];
    for req in calls {
        for req in [
            req.clone(),
            Req {
                headers: vec![],
                ..req
            },
        ] {
            let r = send(addr, &req).await;
            assert_error(&r, 403, &format!("{} {}", req.method, req.target));
            let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
            assert!(
                msg.contains("server.admin_token"),
                "the message says how to enable the admin API: {msg}"
            );
        }
    }
    assert_eq!(urls(addr).await, [a.url()], "nothing was changed");
    assert_eq!(tree_nodes(addr).await, nodes);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_api_refuses_a_missing_or_wrong_token_with_401() {
    let a = FakeWorker::start().await;
    let b = FakeWorker::start().await;
    let router = start_router(&yaml_for(&[&a], WITH_TOKEN)).await;
    let addr = router.addr;
    post(
        addr,
        "/v1/chat/completions",
        chat_body(&long_prompt("x"), false),
    )
    .await;
    let nodes = tree_nodes(addr).await;
    assert!(nodes > 0);
    let targets = [
        ("POST", "/workers".to_string()),
        ("DELETE", format!("/workers?url={}", a.url())),
        ("POST", "/cache/clear".to_string()),
        ("POST", format!("/cache/clear?worker={}", a.url())),
    ];
    let body = format!(r#"{{"url":"{}"}}"#, b.url());
    let wrong = [
        None,
        Some("Bearer wrong-token".to_string()),
        Some(format!("Bearer {TOKEN}x")),
        Some(format!("Bearer {}", &TOKEN[..TOKEN.len() - 1])),
        Some(TOKEN.to_string()),
        Some(format!("Basic {TOKEN}")),
        Some("Bearer ".to_string()),
    ];
    for (method, target) in &targets {
        for auth in &wrong {
            let mut req = Req::new(method, target)
                .header("Content-Type", "application/json")
                .body(body.as_bytes().to_vec());
            if let Some(v) = auth {
                req = req.header("Authorization", v);
            }
            let r = send(addr, &req).await;
            assert_error(&r, 401, &format!("{method} {target} with {auth:?}"));
        }
    }
    assert_eq!(urls(addr).await, [a.url()], "nothing was changed");
    assert_eq!(tree_nodes(addr).await, nodes);
    assert_eq!(b.count(), 0);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn added_worker_shows_in_workers_takes_traffic_and_the_tree_is_kept() {
    let gate = Gate::new();
    let a = FakeWorker::start_with(gated_streams(&gate)).await;
    let b = FakeWorker::start().await;
    let router = start_router(&yaml_for(&[&a], WITH_TOKEN)).await;
    let addr = router.addr;
    let pinned = long_prompt("Pinned before the add");
    let r = post(addr, "/v1/chat/completions", chat_body(&pinned, false)).await;
    assert_eq!(r.status, 200);
    // Two streams in flight on A: its load is 2.
    let _held = [
        open_stream(addr, &long_prompt("Held one"), &new_tag()).await,
        open_stream(addr, &long_prompt("Held two"), &new_tag()).await,
    ];

    let r = send(
        addr,
        &add_worker(&format!(
            r#"{{"url":"{}/","max_load":3,"load_penalty":1,"cache_aware":true}}"#,
            b.url()
        )),
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.json()["workers"], 2);
    let view = get_workers(addr).await;
    assert_eq!(urls(addr).await, [a.url(), b.url()], "URL normalised");
    let added = &view["workers"][1];
    assert_eq!(added["max_load"], 3, "{view}");
    assert_eq!(added["load_penalty"], 1);
    assert_eq!(added["cache_aware"], true);
    assert_eq!(added["in_flight"], 0);
    assert_eq!(added["healthy"], true);
    assert_eq!(added["breaker"], "closed");
    assert_eq!(view["workers"][0]["in_flight"], 2);

    // The tree survived the add: the pinned prompt is still a hit on A (load 2 vs
    // B's 1 is within the balance thresholds).
    let hits = decisions(addr, "cache_hit").await;
    let (r, w) = send_tagged(
        addr,
        &[&a, &b],
        Req::post("/v1/chat/completions", chat_body(&pinned, false)),
    )
    .await;
    assert_eq!((r.status, w), (200, 0));
    assert_eq!(decisions(addr, "cache_hit").await, hits + 1.0);

    // New prompts go to the least-loaded worker: B (0 in flight + penalty 1 < 2).
    for i in 0..6 {
        let (r, w) = send_tagged(
            addr,
            &[&a, &b],
            Req::post(
                "/v1/chat/completions",
                chat_body(&format!("new question {i} for the bigger pool"), false),
            ),
        )
        .await;
        assert_eq!((r.status, w), (200, 1), "question {i}");
    }
    assert_eq!(b.count(), 6, "the added worker takes traffic");
    gate.open();
    wait_all_idle(addr, Duration::from_secs(1)).await;
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adding_a_worker_refuses_bad_bodies_with_400_and_a_duplicate_with_409() {
    let a = FakeWorker::start().await;
    let router = start_router(&yaml_for(&[&a], WITH_TOKEN)).await;
    let addr = router.addr;
    let bad = [
        ("not JSON", "url=http://127.0.0.1:1".to_string()),
        ("empty body", String::new()),
        ("no url", r#"{"max_load":2}"#.to_string()),
        ("url not a string", r#"{"url":8000}"#.to_string()),
        ("not a URL", r#"{"url":"not a url"}"#.to_string()),
        (
            "unbracketed IPv6",
            r#"{"url":"http://::1:8000"}"#.to_string(),
        ),
        (
            "max_load 0",
            r#"{"url":"http://127.0.0.1:1","max_load":0}"#.to_string(),
        ),
        (
            "unknown key",
            r#"{"url":"http://127.0.0.1:1","weight":3}"#.to_string(),
        ),
    ];
    for (what, body) in &bad {
        let r = send(addr, &add_worker(body)).await;
        assert_error(&r, 400, what);
    }
    for dup in [a.url(), format!("{}/", a.url())] {
        let r = send(addr, &add_worker(&format!(r#"{{"url":"{dup}"}}"#))).await;
        assert_error(&r, 409, &format!("duplicate {dup}"));
    }
    // A plain JSON string is the same entry as {"url": …}, like `- URL` in the config.
    let r = send(addr, &add_worker(&format!(r#""{}""#, a.url()))).await;
    assert_error(&r, 409, "duplicate as a plain string");
    let r = send(addr, &add_worker("8000")).await;
    assert_error(&r, 400, "a number");
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("a URL string or a mapping with `url:`")),
        "{}",
        r.text()
    );
    assert_eq!(urls(addr).await, [a.url()]);
    let b = FakeWorker::start().await;
    let r = send(addr, &add_worker(&format!(r#""{}""#, b.url()))).await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(urls(addr).await, [a.url(), b.url()]);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removed_worker_gets_no_new_requests_and_its_in_flight_stream_finishes() {
    let gate = Gate::new();
    let a = FakeWorker::start_with(gated_streams(&gate)).await;
    let b = FakeWorker::start_with(gated_streams(&gate)).await;
    let ws = [&a, &b];
    let router = start_router(&yaml_for(&ws, WITH_TOKEN)).await;
    let addr = router.addr;
    let tag = new_tag();
    let mut stream = open_stream(addr, &long_prompt("Long answer"), &tag).await;
    let x = served_by(&ws, &tag);
    let (gone, kept) = (ws[x], ws[1 - x]);

    for (target, status) in [
        ("/workers".to_string(), 400),
        ("/workers?url=".to_string(), 400),
        ("/workers?url=not%20a%20url".to_string(), 400),
        (format!("/workers?url={}", closed_port_url()), 404),
    ] {
        let r = send(addr, &admin("DELETE", &target)).await;
        assert_error(&r, status, &target);
    }
    assert_eq!(urls(addr).await.len(), 2);

    // Percent-encoded, as a client library would send it.
    let encoded: String = gone.url().replace(':', "%3A").replace('/', "%2F");
    let r = send(addr, &admin("DELETE", &format!("/workers?url={encoded}"))).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["workers"], 1);
    assert_eq!(urls(addr).await, [kept.url()]);
    let r = send(
        addr,
        &admin("DELETE", &format!("/workers?url={}", gone.url())),
    )
    .await;
    assert_error(&r, 404, "already removed");

    let before = gone.count();
    for i in 0..6 {
        let r = post(
            addr,
            "/v1/chat/completions",
            chat_body(&format!("after the removal {i}"), false),
        )
        .await;
        assert_eq!(r.status, 200);
    }
    // Even the prompt the removed worker held goes to the other one now.
    let (r, w) = send_tagged(
        addr,
        &ws,
        Req::post(
            "/v1/chat/completions",
            chat_body(&long_prompt("Long answer"), false),
        ),
    )
    .await;
    assert_eq!((r.status, w), (200, 1 - x));
    assert_eq!(
        gone.count(),
        before,
        "no new request reaches a removed worker"
    );

    // The stream it was serving goes on to its end.
    gate.open();
    let rest = stream.read_rest().await;
    assert_eq!(rest, b"data: [DONE]\n\n");
    wait_all_idle(addr, Duration::from_secs(1)).await;
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clearing_one_workers_cache_forgets_only_its_prefixes() {
    let gate = Gate::new();
    let a = FakeWorker::start_with(gated_streams(&gate)).await;
    let b = FakeWorker::start_with(gated_streams(&gate)).await;
    let ws = [&a, &b];
    let router = start_router(&yaml_for(&ws, WITH_TOKEN)).await;
    let addr = router.addr;
    let (px, py) = (long_prompt("Project X"), long_prompt("Project Y"));

    // Pin px to x, then, with x busy, py to the other worker y.
    let (_, x) = send_tagged(
        addr,
        &ws,
        Req::post("/v1/chat/completions", chat_body(&px, false)),
    )
    .await;
    let y = 1 - x;
    let tag = new_tag();
    let held = open_stream(addr, &px, &tag).await;
    assert_eq!(served_by(&ws, &tag), x);
    let (_, w) = send_tagged(
        addr,
        &ws,
        Req::post("/v1/chat/completions", chat_body(&py, false)),
    )
    .await;
    assert_eq!(w, y, "a miss goes to the idle worker");
    drop(held);
    wait_all_idle(addr, Duration::from_secs(1)).await;

    for (target, status) in [
        ("/cache/clear?worker=not%20a%20url".to_string(), 400),
        (format!("/cache/clear?worker={}", closed_port_url()), 404),
    ] {
        let r = send(addr, &admin("POST", &target)).await;
        assert_error(&r, status, &target);
    }

    let before = get_workers(addr).await;
    let nodes = before["tree_nodes"].as_u64().unwrap();
    assert!(before["workers"][x]["tree_share"].as_f64().unwrap() > 0.0);
    let url_x = ws[x].url();
    let r = send(
        addr,
        &admin("POST", &format!("/cache/clear?worker={url_x}")),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        r.json()["nodes_removed"].as_u64().unwrap() > 0,
        "{}",
        r.text()
    );
    let after = get_workers(addr).await;
    assert!(
        after["tree_nodes"].as_u64().unwrap() < nodes,
        "tree_nodes drops: {nodes} -> {}",
        after["tree_nodes"]
    );
    assert_eq!(after["workers"][x]["tree_share"], 0.0);
    assert_eq!(urls(addr).await, [a.url(), b.url()], "the workers stay");

    // y's prefix still attracts; x's no longer does.
    let hits = decisions(addr, "cache_hit").await;
    let (r, w) = send_tagged(
        addr,
        &ws,
        Req::post("/v1/chat/completions", chat_body(&py, false)),
    )
    .await;
    assert_eq!((r.status, w), (200, y));
    assert_eq!(decisions(addr, "cache_hit").await, hits + 1.0);
    let misses = decisions(addr, "miss").await;
    let r = post(addr, "/v1/chat/completions", chat_body(&px, false)).await;
    assert_eq!(r.status, 200);
    assert_eq!(
        decisions(addr, "miss").await,
        misses + 1.0,
        "the cleared worker's prefix is a miss now"
    );
    assert_eq!(decisions(addr, "cache_hit").await, hits + 1.0);

    // Clearing everything: an empty tree, and py is a miss too.
    let r = send(addr, &admin("POST", "/cache/clear")).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(tree_nodes(addr).await, 0);
    let misses = decisions(addr, "miss").await;
    post(addr, "/v1/chat/completions", chat_body(&py, false)).await;
    assert_eq!(decisions(addr, "miss").await, misses + 1.0);
    gate.open();
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_token_is_accepted_whatever_the_case_of_the_bearer_scheme() {
    // RFC 9110 §11.1: the authentication scheme is a case-insensitive token, and curl
    // users write `-H "Authorization: bearer …"` as often as not.
    let a = FakeWorker::start().await;
    let router = start_router(&yaml_for(&[&a], WITH_TOKEN)).await;
    for scheme in ["Bearer", "bearer", "BEARER"] {
        let r = send(
            router.addr,
            &Req::new("POST", "/cache/clear")
                .header("Authorization", &format!("{scheme} {TOKEN}"))
                .header("Content-Length", "0"),
        )
        .await;
        assert_eq!(r.status, 200, "scheme `{scheme}`: {}", r.text());
    }
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_listener_takes_the_admin_endpoints_off_the_public_port() {
    let w = FakeWorker::start().await;
    let router = start_router(&yaml_for(
        &[&w],
        "server:\n  admin_token: qa-admin-token-1\n  admin:\n    host: 127.0.0.1\n    port: 0\n",
    ))
    .await;
    let public = router.addr;
    let private = router.admin_addr.expect("an admin listener");
    assert_ne!(public, private);
    // /health answers on both (200 once the worker's first probe is in).
    for addr in [public, private] {
        wait_until("GET /health says 200", STEP_TIMEOUT, || async {
            send(addr, &Req::get("/health")).await.status == 200
        })
        .await;
    }
    // /workers, /metrics and the mutations: the admin listener only.
    for req in [
        Req::get("/workers"),
        Req::get("/metrics"),
        admin("POST", "/cache/clear"),
        admin("DELETE", &format!("/workers?url={}", w.url())),
    ] {
        let resp = send(public, &req).await;
        assert_error(&resp, 404, "admin listener");
    }
    assert_eq!(send(private, &Req::get("/workers")).await.status, 200);
    assert_eq!(send(private, &Req::get("/metrics")).await.status, 200);
    // Mutations there still need the token.
    let no_token = Req::new("POST", "/cache/clear").header("Content-Length", "0");
    assert_eq!(send(private, &no_token).await.status, 401);
    assert_eq!(
        send(private, &admin("POST", "/cache/clear")).await.status,
        200
    );
    // Requests are served on the public port only.
    let chat = Req::post("/v1/chat/completions", chat_body("hi", false));
    assert_eq!(send(public, &chat).await.status, 200);
    assert_error(&send(private, &chat).await, 404, "main port");
    assert_eq!(w.count(), 1);
    router.shutdown().await;
}

/// The exposition's samples (series) now.
async fn series(addr: SocketAddr) -> usize {
    scrape(addr).await.samples.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_worker_series_go_with_their_worker_under_churn() {
    let a = FakeWorker::start().await;
    let b = FakeWorker::start().await;
    let router = start_router(&yaml_for(
        &[&a],
        &format!("policy: round_robin\n{WITH_TOKEN}"),
    ))
    .await;
    let addr = router.addr;
    // One cycle: a worker with a label of its own joins, answers, leaves.
    let cycle = |i: usize| {
        let url = format!("{}/churn-{i}", b.url());
        async move {
            let r = send(addr, &add_worker(&format!(r#"{{"url":"{url}"}}"#))).await;
            assert_eq!(r.status, 201, "add {url}: {}", r.text());
            // Round robin over two workers: both answer one of the two.
            for _ in 0..2 {
                let r = post(addr, "/v1/chat/completions", chat_body("hello", false)).await;
                assert_eq!(r.status, 200, "{}", r.text());
            }
            if i.is_multiple_of(100) {
                let with_it = scrape(addr).await;
                assert!(
                    with_it.text.contains(&format!("worker=\"{url}\"")),
                    "the joined worker has series of its own"
                );
            }
            let r = send(addr, &admin("DELETE", &format!("/workers?url={url}"))).await;
            assert_eq!(r.status, 200, "remove {url}: {}", r.text());
            url
        }
    };
    cycle(0).await;
    let start = series(addr).await;
    for i in 1..=1000 {
        let url = cycle(i).await;
        if i.is_multiple_of(100) {
            let now = scrape(addr).await;
            assert!(
                !now.text.contains(&format!("worker=\"{url}\"")),
                "a removed worker's series are gone"
            );
            assert_eq!(
                now.samples.len(),
                start,
                "series after {i} joins and leaves"
            );
        }
    }
    assert_eq!(series(addr).await, start);
}

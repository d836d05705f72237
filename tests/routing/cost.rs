//! Engine-aware routing as a user sees it: engine load scraped from `/metrics` (vLLM and
//! SGLang names, stale and garbage pages), `cost_aware` trading a warm worker's queue
//! against a cold worker's recompute, back-pressure that shifts traffic without opening
//! the breaker, and LMCache signals. (Against real sim-engines: the prefill rates
//! learned per worker and both metrics flavors, in bench/tests/engine/router.rs.)

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use support::{client::*, config::*, observe::*, wait::*, worker::*};

use crate::common::start_router;

const VLLM_PAGE: &str = "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 3\nvllm:num_requests_running{engine=\"0\",model_name=\"m\"} 2\nvllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.5\n";
const SGLANG_PAGE: &str = "sglang:num_queue_reqs{model_name=\"m\"} 7\nsglang:num_running_reqs{model_name=\"m\"} 1\nsglang:token_usage{model_name=\"m\"} 0.25\n";

/// A fake worker that serves `page` (by `mode`: 0 = page, 1 = 500) on `/metrics` and
/// `reply` elsewhere.
async fn engine_worker(
    page: &'static str,
    mode: Arc<AtomicU8>,
    reply: impl Fn(&Recorded) -> Reply + Send + Sync + 'static,
) -> FakeWorker {
    FakeWorker::builder()
        .reply(move |r| {
            if r.target == "/metrics" {
                match mode.load(Ordering::SeqCst) {
                    0 => Reply::status(200).body(page.as_bytes().to_vec()),
                    _ => Reply::status(500),
                }
            } else {
                reply(r)
            }
        })
        .start()
        .await
}

fn generations(w: &FakeWorker) -> usize {
    w.requests()
        .iter()
        .filter(|r| r.target.starts_with("/v1/"))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scrapes_read_both_engines_and_mark_stale_and_garbage_pages_neutral() {
    let ok = Arc::new(AtomicU8::new(0));
    let vllm = engine_worker(VLLM_PAGE, Arc::clone(&ok), |_| Reply::ok()).await;
    let sglang = engine_worker(SGLANG_PAGE, Arc::new(AtomicU8::new(0)), |_| Reply::ok()).await;
    let garbage = engine_worker(
        "<html>502 Bad Gateway</html>",
        Arc::new(AtomicU8::new(0)),
        |_| Reply::ok(),
    )
    .await;
    let router = start_router(&yaml_for(
        &[&vllm, &sglang, &garbage],
        "policy: cost_aware\nengine_metrics: {interval_ms: 50, stale_secs: 0.3}\nhealth: {interval_secs: 60}",
    ))
    .await;
    let addr = router.addr;
    wait_until("three scrapes of each", Duration::from_secs(5), || async {
        let w = get_workers(addr).await;
        w["workers"].as_array().unwrap().iter().all(|w| {
            let e = &w["engine"];
            e["scrapes_ok"].as_u64().unwrap() + e["scrapes_unparsable"].as_u64().unwrap() >= 3
        })
    })
    .await;
    let w = get_workers(addr).await;
    let ws = w["workers"].as_array().unwrap();
    assert_eq!(ws[0]["engine"]["kind"], "vllm");
    assert_eq!(ws[0]["engine"]["waiting"], 3.0);
    assert_eq!(ws[0]["engine"]["running"], 2.0);
    assert_eq!(ws[0]["engine"]["kv_cache_usage"], 0.5);
    assert_eq!(ws[0]["engine"]["fresh"], true);
    assert_eq!(ws[1]["engine"]["kind"], "sglang");
    assert_eq!(ws[1]["engine"]["waiting"], 7.0);
    assert_eq!(ws[1]["engine"]["kv_cache_usage"], 0.25);
    assert_eq!(ws[2]["engine"]["kind"], serde_json::Value::Null);
    assert_eq!(ws[2]["engine"]["fresh"], false);
    assert_eq!(ws[2]["engine"]["scrapes_ok"], 0);
    let m = scrape(addr).await;
    let label = worker_label(addr, 0).await;
    assert_eq!(
        m.value(
            "cache_aware_router_worker_engine_waiting",
            &[("worker", &label)]
        ),
        3.0
    );
    let g = worker_label(addr, 2).await;
    assert!(
        m.value(
            "cache_aware_router_engine_scrapes_total",
            &[("worker", &g), ("result", "unparsable")]
        ) >= 3.0
    );
    // The vLLM worker's endpoint starts failing: its last reading goes stale.
    ok.store(1, Ordering::SeqCst);
    wait_until(
        "the vllm reading goes stale",
        Duration::from_secs(5),
        || async { get_workers(addr).await["workers"][0]["engine"]["fresh"] == false },
    )
    .await;
    let w = get_workers(addr).await;
    assert!(
        w["workers"][0]["engine"]["scrapes_failed"]
            .as_u64()
            .unwrap()
            >= 1
    );
    // Routing never waited for any of it: requests are answered throughout.
    let r = post(addr, "/v1/chat/completions", chat_body("hello", false)).await;
    assert_eq!(r.status, 200);
    router.shutdown().await;
}

/// A long shared prefix (about 4,000 tokens at 4 bytes a token).
fn prefix() -> String {
    let mut p = String::from("System prompt. ");
    while p.len() < 16 * 1024 {
        p.push_str("Answer carefully, cite the documents, and keep every reply short. ");
    }
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cost_follows_the_warm_worker_until_its_queue_costs_more_than_the_recompute() {
    // Whichever worker serves the first turn is warm; it then holds its answers until
    // the gate opens (its queue grows), while the cold one answers at once.
    let gate = Gate::new();
    let warm = Arc::new(AtomicU8::new(u8::MAX));
    let worker = |k: u8| {
        let (g, warm) = (gate.clone(), Arc::clone(&warm));
        move |r: &Recorded| {
            if r.body_str().contains("first turn") {
                warm.store(k, Ordering::SeqCst);
                Reply::ok()
            } else if warm.load(Ordering::SeqCst) == k {
                Reply::ok().after_gate(&g)
            } else {
                Reply::ok()
            }
        }
    };
    let w0 = FakeWorker::start_with(worker(0)).await;
    let w1 = FakeWorker::start_with(worker(1)).await;
    let router = start_router(&yaml_for(
        &[&w0, &w1],
        "policy: cost_aware\nengine_metrics: {enabled: false}\nhealth: {interval_secs: 60}",
    ))
    .await;
    let addr = router.addr;
    let p = prefix();
    let r = post(
        addr,
        "/v1/chat/completions",
        chat_body(&format!("{p} first turn"), false),
    )
    .await;
    assert_eq!(r.status, 200);
    let hot = warm.load(Ordering::SeqCst) as usize;
    let (a, b) = if hot == 0 { (&w0, &w1) } else { (&w1, &w0) };
    // Follow-ups sharing the prefix queue on the warm worker while its queue is short...
    let mut held = Vec::new();
    for i in 0..40 {
        let body = chat_body(&format!("{p} follow-up {i}"), false);
        held.push(tokio::spawn(async move {
            post(addr, "/v1/chat/completions", body).await
        }));
        // Each is routed (and its prefill reserved) before the next is sent.
        wait_until("routed", Duration::from_secs(5), || async {
            generations(a) + generations(b) >= 2 + i
        })
        .await;
    }
    let (on_a, on_b) = (generations(a) - 1, generations(b));
    // ...about 4,000 tokens of recompute = 0.42 s at the priors; each queued request on
    // the warm worker adds its base (20 ms) and its few own tokens: some 18 fit first.
    assert!((10..=30).contains(&on_a), "warm took {on_a}, cold {on_b}");
    assert!(on_b >= 10, "warm took {on_a}, cold {on_b}");
    let w = get_workers(addr).await;
    assert_eq!(
        w["workers"][hot]["prefill"]["pending_requests"],
        on_a as u64
    );
    gate.open();
    for h in held {
        assert_eq!(h.await.unwrap().status, 200);
    }
    wait_all_idle(addr, Duration::from_secs(5)).await;
    let w = get_workers(addr).await;
    assert_eq!(w["workers"][hot]["prefill"]["pending_tokens"], 0);
    assert_eq!(w["workers"][hot]["prefill"]["pending_requests"], 0);
    // The first diverted request was a diverted hit; the cold worker that served it
    // holds the prefix from then on, so later ones were hits there.
    let m = scrape(addr).await;
    let diverted = m.value(
        "cache_aware_router_routing_decisions_total",
        &[("reason", "hit_overloaded")],
    );
    assert!(
        diverted >= 1.0 && diverted < on_b as f64,
        "diverted {diverted}, cold took {on_b}"
    );
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_reporting_a_long_queue_is_avoided() {
    // Both workers hold the prefix; A's engine says 50 requests are waiting there.
    let a = engine_worker(
        "vllm:num_requests_waiting 50\nvllm:num_requests_running 8\n",
        Arc::new(AtomicU8::new(0)),
        |_| Reply::ok(),
    )
    .await;
    let b = engine_worker(
        "vllm:num_requests_waiting 0\nvllm:num_requests_running 1\n",
        Arc::new(AtomicU8::new(0)),
        |_| Reply::ok(),
    )
    .await;
    let router = start_router(&yaml_for(
        &[&a, &b],
        "policy: cost_aware\nengine_metrics: {interval_ms: 50}\nhealth: {interval_secs: 60}",
    ))
    .await;
    let addr = router.addr;
    wait_until("both scraped", Duration::from_secs(5), || async {
        let w = get_workers(addr).await;
        w["workers"]
            .as_array()
            .unwrap()
            .iter()
            .all(|w| w["engine"]["fresh"] == true)
    })
    .await;
    let p = prefix();
    for i in 0..10 {
        let r = post(
            addr,
            "/v1/chat/completions",
            chat_body(&format!("{p} q{i}"), false),
        )
        .await;
        assert_eq!(r.status, 200);
    }
    assert_eq!(generations(&a), 0, "B took {}", generations(&b));
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn back_pressure_shifts_traffic_without_opening_the_breaker() {
    let a = FakeWorker::start_with(|_| {
        Reply::json(429, r#"{"error":{"message":"queue full"}}"#).header("Retry-After", "30")
    })
    .await;
    let b = FakeWorker::start().await;
    let router = start_router(&yaml_for(
        &[&a, &b],
        "policy: cost_aware\ncircuit_breaker: {failure_threshold: 1}\nhealth: {interval_secs: 60}\nengine_metrics: {enabled: false}",
    ))
    .await;
    let addr = router.addr;
    for i in 0..20 {
        let r = post(
            addr,
            "/v1/chat/completions",
            chat_body(&format!("q{i}"), false),
        )
        .await;
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
    }
    // A pushed back at most once: then it was left alone for its 30 s.
    assert!(
        generations(&a) <= 1,
        "A was tried {} times",
        generations(&a)
    );
    assert_eq!(generations(&b), 20);
    let w = get_workers(addr).await;
    let wa = &w["workers"][0];
    assert_eq!(wa["breaker"], "closed");
    if generations(&a) == 1 {
        assert!(wa["saturated_secs"].as_f64().unwrap() > 25.0, "{wa}");
        assert_eq!(wa["back_pressure"], 1);
    }
    // With B gone, A's own 429 reaches the client (nothing is lost or invented).
    b.kill().await;
    let r = post(addr, "/v1/chat/completions", chat_body("last", false)).await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert!(r.text().contains("queue full"), "{}", r.text());
    assert_eq!(r.header("retry-after"), Some("30"));
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_503_with_retry_after_is_back_pressure_and_without_it_a_failure() {
    let with = FakeWorker::start_with(|r| {
        if r.target.starts_with("/v1/") {
            Reply::json(503, r#"{"error":{"message":"overloaded"}}"#).header("Retry-After", "5")
        } else {
            Reply::ok()
        }
    })
    .await;
    let router = start_router(&yaml_for(
        &[&with],
        "policy: least_load\ncircuit_breaker: {failure_threshold: 1}\nproxy: {max_retries: 0}\nhealth: {interval_secs: 60}",
    ))
    .await;
    let r = post(router.addr, "/v1/chat/completions", chat_body("q", false)).await;
    assert_eq!(r.status, 503);
    let w = get_workers(router.addr).await;
    assert_eq!(w["workers"][0]["breaker"], "closed");
    assert_eq!(w["workers"][0]["back_pressure"], 1);
    router.shutdown().await;

    let without =
        FakeWorker::start_with(|_| Reply::json(503, r#"{"error":{"message":"down"}}"#)).await;
    let router = start_router(&yaml_for(
        &[&without],
        "policy: least_load\ncircuit_breaker: {failure_threshold: 1}\nproxy: {max_retries: 0}\nhealth: {interval_secs: 60}",
    ))
    .await;
    let r = post(router.addr, "/v1/chat/completions", chat_body("q", false)).await;
    assert_eq!(r.status, 503);
    let w = get_workers(router.addr).await;
    assert_eq!(w["workers"][0]["breaker"], "open");
    router.shutdown().await;
}

/// A worker whose `/lmcache` answers by `mode`: 0 = `body`, 1 = garbage, 2 = 500.
async fn lmcache_worker(body: &'static str, mode: Arc<AtomicU8>) -> FakeWorker {
    FakeWorker::start_with(move |r| {
        if r.target == "/lmcache" {
            match mode.load(Ordering::SeqCst) {
                0 => Reply::json(200, body),
                1 => Reply::json(200, "{\"occupancy\": \"high\"}"),
                _ => Reply::status(500),
            }
        } else {
            Reply::ok()
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lmcache_signals_fresh_stale_and_malformed() {
    let mode_a = Arc::new(AtomicU8::new(0));
    let mode_b = Arc::new(AtomicU8::new(0));
    let a = lmcache_worker(
        r#"{"occupancy": 0.9, "cache_available": true}"#,
        Arc::clone(&mode_a),
    )
    .await;
    let b = lmcache_worker(
        r#"{"occupancy": 0.2, "cache_available": true}"#,
        Arc::clone(&mode_b),
    )
    .await;
    let yaml = format!(
        "policy: lmcache_aware\nhealth: {{interval_secs: 60}}\nworkers:\n  - url: \"{}\"\n    lmcache: {{endpoint: /lmcache, refresh_secs: 0.05, stale_secs: 0.3}}\n  - url: \"{}\"\n    lmcache: {{endpoint: /lmcache, refresh_secs: 0.05, stale_secs: 0.3}}\n",
        a.url(),
        b.url()
    );
    let router = start_router(&yaml).await;
    let addr = router.addr;
    let fresh =
        |i: usize| async move { get_workers(addr).await["workers"][i]["lmcache"]["fresh"] == true };
    wait_until("both signals fresh", Duration::from_secs(5), || async {
        fresh(0).await && fresh(1).await
    })
    .await;
    // Fresh: the emptier cache (B, 1 − 0.2) takes sequential requests.
    for i in 0..10 {
        assert_eq!(
            post(
                addr,
                "/v1/chat/completions",
                chat_body(&format!("a{i}"), false)
            )
            .await
            .status,
            200
        );
    }
    assert_eq!((generations(&a), generations(&b)), (0, 10));
    // B's signal turns malformed and goes stale: neutral, so A's (0.1) wins now.
    mode_b.store(1, Ordering::SeqCst);
    wait_until("B neutral", Duration::from_secs(5), || async {
        !fresh(1).await
    })
    .await;
    let w = get_workers(addr).await;
    assert!(
        w["workers"][1]["lmcache"]["polls_unparsable"]
            .as_u64()
            .unwrap()
            >= 1
    );
    for i in 0..10 {
        assert_eq!(
            post(
                addr,
                "/v1/chat/completions",
                chat_body(&format!("b{i}"), false)
            )
            .await
            .status,
            200
        );
    }
    assert_eq!(generations(&a), 10);
    // Both fail: every signal neutral, least-load spreads the load (ties at random).
    mode_a.store(2, Ordering::SeqCst);
    mode_b.store(2, Ordering::SeqCst);
    wait_until("A neutral", Duration::from_secs(5), || async {
        !fresh(0).await
    })
    .await;
    for i in 0..40 {
        assert_eq!(
            post(
                addr,
                "/v1/chat/completions",
                chat_body(&format!("c{i}"), false)
            )
            .await
            .status,
            200
        );
    }
    let (na, nb) = (generations(&a) - 10, generations(&b) - 10);
    assert!(na >= 5 && nb >= 5, "A {na}, B {nb}");
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_every_worker_pushes_back_the_first_answer_is_returned_without_a_round_of_retries() {
    let ws = [
        FakeWorker::start_with(|_| Reply::json(429, r#"{"error":{"message":"full"}}"#)).await,
        FakeWorker::start_with(|_| Reply::json(429, r#"{"error":{"message":"full"}}"#)).await,
        FakeWorker::start_with(|_| Reply::json(429, r#"{"error":{"message":"full"}}"#)).await,
    ];
    let router = start_router(&yaml_for(
        &[&ws[0], &ws[1], &ws[2]],
        "policy: cost_aware\nengine_metrics: {enabled: false}\nhealth: {interval_secs: 60}\nproxy: {initial_backoff_ms: 1}",
    ))
    .await;
    for i in 0..6 {
        let r = post(
            router.addr,
            "/v1/chat/completions",
            chat_body(&format!("q{i}"), false),
        )
        .await;
        assert_eq!(r.status, 429, "{}", r.text());
        assert!(
            r.text().contains("full"),
            "the engine's own answer: {}",
            r.text()
        );
    }
    // The first request tried all three; once all pushed back, one attempt each.
    let attempts: usize = ws.iter().map(generations).sum();
    assert_eq!(attempts, 3 + 5, "attempts {attempts}");
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_back_is_what_the_client_gets_when_the_retry_cannot_connect() {
    let a = FakeWorker::start_with(|_| {
        Reply::json(429, r#"{"error":{"message":"slow down"}}"#).header("Retry-After", "2")
    })
    .await;
    let dead = closed_port_url();
    let router = start_router(&yaml_for_urls(
        &[a.url(), dead],
        "policy: round_robin\nhealth: {interval_secs: 60}\nproxy: {initial_backoff_ms: 1}",
    ))
    .await;
    // Whichever is tried first, the client ends with A's own 429, not a router error.
    for _ in 0..2 {
        let r = post(router.addr, "/v1/chat/completions", chat_body("q", false)).await;
        assert_eq!(r.status, 429, "{}", r.text());
        assert!(r.text().contains("slow down"), "{}", r.text());
        assert_eq!(r.header("retry-after"), Some("2"));
    }
    router.shutdown().await;
}

//! `GET /metrics` after a scripted workload: exact routing decisions per reason,
//! responses per endpoint / worker / status, the engines' own token usage (from JSON
//! bodies and from the final SSE chunk) and in-flight gauges back at 0.

use std::collections::BTreeMap;
use std::time::Duration;

use support::{client::*, config::*, engine::*, observe::*, worker::*};

use crate::common::start_router;

const DECISIONS: &str = "cache_aware_router_routing_decisions_total";
const REQUESTS: &str = "cache_aware_router_requests_total";
const PROMPT_TOKENS: &str = "cache_aware_router_engine_prompt_tokens_total";
const CACHED_TOKENS: &str = "cache_aware_router_engine_cached_tokens_total";
const IN_FLIGHT: &str = "cache_aware_router_worker_in_flight";

fn shared_prompt() -> String {
    let mut p = String::from("Shared system prompt. ");
    while p.len() < 2048 {
        p.push_str("Answer in plain words and cite the manual section you used. ");
    }
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_after_a_scripted_workload_match_it_exactly() {
    // Any load difference overrides affinity (hit_overloaded); one failure opens a
    // breaker for the rest of the test; no retries, so each request is one decision.
    let (hold, [a, b], yaml) = usage_engines(
        "",
        "circuit_breaker:\n  failure_threshold: 1\n  timeout_secs: 60\n",
    )
    .await;
    let router = start_router(&yaml).await;
    let ws = [&a, &b];
    let addr = router.addr;
    let labels = [worker_label(addr, 0).await, worker_label(addr, 1).await];
    let prompt = shared_prompt();

    // 1. First sight of the prompt: a miss. 2. Again: a hit on the same worker.
    let (r, x) = send_tagged(
        addr,
        &ws,
        chat_with_usage(chat_body(&prompt, false), (100, 0)),
    )
    .await;
    assert_eq!(r.status, 200);
    let y = 1 - x;
    let (r, w) = send_tagged(
        addr,
        &ws,
        chat_with_usage(chat_body(&prompt, false), (100, 96)),
    )
    .await;
    assert_eq!((r.status, w), (200, x), "the repeat follows the prefix");
    // 3. No text to match on.
    let (r, e) = send_tagged(
        addr,
        &ws,
        chat_with_usage(r#"{"model":"m","messages":[]}"#.to_string(), (7, 0)),
    )
    .await;
    assert_eq!(r.status, 200);
    // 4. A streamed hit; the usage comes in the final SSE chunk.
    let (r, w) = send_tagged(
        addr,
        &ws,
        chat_with_usage(chat_body(&prompt, true), (100, 64)),
    )
    .await;
    assert_eq!((r.status, w), (200, x));
    assert!(r.text().ends_with("data: [DONE]\n\n"), "{}", r.text());

    // 5. A streamed hit held open before its usage chunk: one in flight on x.
    let (mut held, on) = hold_stream(
        addr,
        &ws,
        chat_with_usage(chat_body(&prompt, true), (100, 80)),
    )
    .await;
    assert_eq!(on, x);
    let m = scrape(addr).await;
    assert_eq!(m.get(IN_FLIGHT, &[("worker", &labels[x])]), Some(1.0));
    assert_eq!(m.get(IN_FLIGHT, &[("worker", &labels[y])]), Some(0.0));

    // 6. The same prefix while x is busier than y: a degradation, sent to y.
    let (r, w) = send_tagged(
        addr,
        &ws,
        chat_with_usage(chat_body(&prompt, false), (100, 0)),
    )
    .await;
    assert_eq!((r.status, w), (200, y), "hit_overloaded goes least-loaded");
    hold.open();
    let rest = held.read_rest().await;
    assert!(String::from_utf8_lossy(&rest).ends_with("data: [DONE]\n\n"));
    wait_all_idle(addr, Duration::from_secs(1)).await;
    let m = scrape(addr).await;
    for l in &labels {
        assert_eq!(m.get(IN_FLIGHT, &[("worker", l)]), Some(0.0), "{l}");
    }

    // 7, 8. A failing prompt opens one breaker, then the other (it avoids the open one).
    let fail = chat_body(
        &format!("FAIL {}", "this prompt crashes the engine. ".repeat(4)),
        false,
    );
    let (r, f1) = send_tagged(addr, &ws, chat_with_usage(fail.clone(), (0, 0))).await;
    assert_eq!(r.status, 500);
    let (r, f2) = send_tagged(addr, &ws, chat_with_usage(fail, (0, 0))).await;
    assert_eq!(r.status, 500);
    assert_ne!(f1, f2, "an open breaker takes no request");
    // 9. Nothing usable: the router answers itself.
    let r = post(addr, "/v1/chat/completions", chat_body("anyone?", false)).await;
    assert_eq!(r.status, 503, "{}", r.text());

    let m = scrape(addr).await;
    let decisions: BTreeMap<String, f64> = m
        .all(DECISIONS)
        .into_iter()
        .map(|s| (s.labels[0].1.clone(), s.value))
        .collect();
    let expected: BTreeMap<String, f64> = [
        ("cache_hit", 3.0),
        ("miss", 3.0),
        ("hit_overloaded", 1.0),
        ("empty_text", 1.0),
        ("no_worker", 1.0),
        // Every reason is listed, at 0 until it happens.
        ("session", 0.0),
        ("conversation", 0.0),
        ("cache_signal", 0.0),
        ("fan_out", 0.0),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    assert_eq!(decisions, expected, "{}", m.text);

    let mut expected: BTreeMap<(String, String), f64> = BTreeMap::new();
    let mut add = |worker: &str, status: &str| {
        *expected
            .entry((worker.to_string(), status.to_string()))
            .or_default() += 1.0;
    };
    for _ in 0..4 {
        add(&labels[x], "200"); // 1, 2, 4, 5
    }
    add(&labels[e], "200"); // 3
    add(&labels[y], "200"); // 6
    add(&labels[f1], "500");
    add(&labels[f2], "500");
    add("none", "503");
    let requests: BTreeMap<(String, String), f64> = m
        .all(REQUESTS)
        .into_iter()
        .map(|s| {
            let label = |k: &str| {
                s.labels
                    .iter()
                    .find(|(n, _)| n == k)
                    .map(|(_, v)| v.clone())
                    .unwrap_or_else(|| panic!("{k} label missing: {s:?}"))
            };
            assert_eq!(label("endpoint"), "chat_completions", "{s:?}");
            ((label("worker"), label("status")), s.value)
        })
        .collect();
    assert_eq!(requests, expected, "{}", m.text);

    // Engine usage: x served 1, 2, 4 (SSE) and 5 (SSE); y served 6; the empty-text one
    // went to e. Error answers carried none.
    let (mut prompt_x, mut prompt_y) = (400.0, 100.0);
    if e == x {
        prompt_x += 7.0;
    } else {
        prompt_y += 7.0;
    }
    assert_eq!(
        m.get(PROMPT_TOKENS, &[("worker", &labels[x])]),
        Some(prompt_x),
        "{}",
        m.text
    );
    assert_eq!(
        m.get(CACHED_TOKENS, &[("worker", &labels[x])]),
        Some(96.0 + 64.0 + 80.0)
    );
    assert_eq!(
        m.get(PROMPT_TOKENS, &[("worker", &labels[y])]),
        Some(prompt_y)
    );
    assert_eq!(m.get(CACHED_TOKENS, &[("worker", &labels[y])]), Some(0.0));
    assert_eq!(m.get("cache_aware_router_retries_total", &[]), Some(0.0));
    for l in &labels {
        assert_eq!(m.get(IN_FLIGHT, &[("worker", l)]), Some(0.0), "{l}");
        assert_eq!(
            m.get(
                "cache_aware_router_worker_breaker_state",
                &[("worker", l), ("state", "open")]
            ),
            Some(1.0)
        );
    }
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_scrape_lists_every_known_series_at_zero_and_a_leaver_loses_its_own() {
    let (a, b) = (FakeWorker::start().await, FakeWorker::start().await);
    let router = start_router(&yaml_for(&[&a, &b], "server:\n  admin_token: t0k\n")).await;
    let m = scrape(router.addr).await;
    for reason in [
        "cache_hit",
        "hit_overloaded",
        "miss",
        "empty_text",
        "no_worker",
        "session",
        "conversation",
        "cache_signal",
        "fan_out",
    ] {
        assert_eq!(
            m.get(DECISIONS, &[("reason", reason)]),
            Some(0.0),
            "{reason}"
        );
    }
    for result in ["applied", "rejected", "invalid"] {
        assert_eq!(
            m.get("cache_aware_router_reloads_total", &[("result", result)]),
            Some(0.0),
            "{result}"
        );
    }
    let (la, lb) = (
        worker_label(router.addr, 0).await,
        worker_label(router.addr, 1).await,
    );
    for label in [&la, &lb] {
        for family in [PROMPT_TOKENS, CACHED_TOKENS] {
            assert_eq!(m.get(family, &[("worker", label)]), Some(0.0), "{family}");
        }
        assert_eq!(
            m.get(
                "cache_aware_router_prefix_tokens_total",
                &[
                    ("worker", label),
                    ("policy", "cache_aware"),
                    ("kind", "delivered")
                ]
            ),
            Some(0.0)
        );
        assert_eq!(
            m.get(
                "cache_aware_router_request_duration_seconds_count",
                &[("worker", label)]
            ),
            Some(0.0)
        );
    }
    // A worker removed: its series go with it at the next scrape.
    let del = Req::new("DELETE", &format!("/workers?url={}", b.url()))
        .header("Authorization", "Bearer t0k")
        .header("Content-Length", "0");
    assert_eq!(send(router.addr, &del).await.status, 200);
    let m = scrape(router.addr).await;
    assert_eq!(m.get(PROMPT_TOKENS, &[("worker", &la)]), Some(0.0));
    assert_eq!(m.get(PROMPT_TOKENS, &[("worker", &lb)]), None);
    assert_eq!(
        m.get(
            "cache_aware_router_request_duration_seconds_count",
            &[("worker", &lb)]
        ),
        None
    );
    router.shutdown().await;
}

//! `proxy.queue`: a burst past every worker's `max_load` waits for slots (FIFO,
//! bounded) instead of failing at once; past the time-out or the bound, 503 with
//! `Retry-After` and a JSON body saying which.

use std::time::Duration;

use support::{client::*, observe::*, wait::*, worker::*};

use crate::common::start_router;

/// One worker taking 2 at a time, each answer after `hold`, behind a router with the
/// queue set to `queue` (the YAML mapping's lines).
async fn setup(
    hold: Duration,
    queue: &str,
) -> (FakeWorker, cache_aware_router::app::RunningRouter) {
    let w = FakeWorker::start_with(move |_| Reply::ok().after(hold)).await;
    let yaml = format!(
        "proxy:\n  max_retries: 0\n  queue:\n{queue}health:\n  interval_secs: 60\nworkers:\n  - url: \"{}\"\n    max_load: 2\n",
        w.url()
    );
    (w, start_router(&yaml).await)
}

/// Sends `n` chat requests at once; their statuses, Retry-After values and error types.
async fn burst(
    router: &cache_aware_router::app::RunningRouter,
    n: usize,
) -> Vec<(u16, Option<String>, String)> {
    let sends = (0..n).map(|i| {
        let addr = router.addr;
        async move {
            let r = post(
                addr,
                "/v1/chat/completions",
                chat_body(&format!("q{i}"), false),
            )
            .await;
            let kind = if r.status == 200 {
                String::new()
            } else {
                r.json()["error"]["type"].as_str().unwrap_or("").to_string()
            };
            (r.status, r.header("retry-after").map(str::to_string), kind)
        }
    });
    futures_util::future::join_all(sends).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_three_times_max_load_waits_for_slots_and_all_succeed() {
    let (w, router) = setup(
        Duration::from_millis(150),
        "    max_waiting: 16\n    timeout_ms: 5000\n",
    )
    .await;
    let out = burst(&router, 6).await;
    assert!(out.iter().all(|(s, _, _)| *s == 200), "{out:?}");
    assert_eq!(w.count(), 6);
    let m = scrape(router.addr).await;
    assert_eq!(m.value("cache_aware_router_queue_waiting", &[]), 0.0);
    assert!(m.value("cache_aware_router_queue_wait_seconds_count", &[]) >= 4.0);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_time_out_or_the_bound_the_client_gets_503_saying_which() {
    // Slots free long after the 100 ms the queue waits.
    let (w, router) = setup(
        Duration::from_millis(800),
        "    max_waiting: 2\n    timeout_ms: 100\n",
    )
    .await;
    let out = burst(&router, 6).await;
    let served = out.iter().filter(|(s, _, _)| *s == 200).count();
    let timed_out = out.iter().filter(|(_, _, k)| k == "queue_timeout").count();
    let full = out.iter().filter(|(_, _, k)| k == "queue_full").count();
    assert_eq!((served, timed_out, full), (2, 2, 2), "{out:?}");
    for (status, retry_after, _) in out.iter().filter(|(s, _, _)| *s != 200) {
        assert_eq!((*status, retry_after.as_deref()), (503, Some("1")));
    }
    assert_eq!(w.count(), 2);
    let m = scrape(router.addr).await;
    assert_eq!(
        m.value(
            "cache_aware_router_routing_decisions_total",
            &[("reason", "no_worker")]
        ),
        4.0
    );
    for (cause, n) in [("timeout", 2.0), ("full", 2.0)] {
        assert_eq!(
            m.value(
                "cache_aware_router_queue_rejected_total",
                &[("cause", cause)]
            ),
            n
        );
    }
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_queue_a_full_pool_answers_at_once() {
    let (_w, router) = setup(Duration::from_millis(500), "    max_waiting: 0\n").await;
    let started = std::time::Instant::now();
    let out = burst(&router, 4).await;
    assert_eq!(
        out.iter().filter(|(s, _, _)| *s == 503).count(),
        2,
        "{out:?}"
    );
    assert!(started.elapsed() < Duration::from_millis(1500));
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_while_queued_frees_its_place() {
    let (_w, router) = setup(
        Duration::from_millis(1500),
        "    max_waiting: 1\n    timeout_ms: 10000\n",
    )
    .await;
    let addr = router.addr;
    // Two take the slots; a third waits, then its client gives up.
    let holders: Vec<_> = (0..2)
        .map(|i| {
            tokio::spawn(post(
                addr,
                "/v1/chat/completions",
                chat_body(&format!("h{i}"), false),
            ))
        })
        .collect();
    wait_until("both slots taken", STEP_TIMEOUT, || async {
        get_workers(addr).await["workers"][0]["in_flight"] == 2
    })
    .await;
    let gone = tokio::time::timeout(
        Duration::from_millis(300),
        post(addr, "/v1/chat/completions", chat_body("leaves", false)),
    )
    .await;
    assert!(gone.is_err(), "it was still waiting");
    wait_until("its place given back", STEP_TIMEOUT, || async {
        scrape(addr)
            .await
            .value("cache_aware_router_queue_waiting", &[])
            == 0.0
    })
    .await;
    // The place is free for the next one: it waits (and is served) rather than 503.
    let next = post(addr, "/v1/chat/completions", chat_body("next", false)).await;
    assert_eq!(next.status, 200, "{}", next.text());
    for h in holders {
        assert_eq!(h.await.unwrap().status, 200);
    }
    router.shutdown().await;
}

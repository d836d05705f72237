//! Worker failures: active health checks (consecutive thresholds), the pool with no
//! healthy worker, and the circuit breaker's open / half-open / closed cycle.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use support::{client::*, config::*, engine::*, observe::*, wait::*, worker::*};

use crate::common::start_router;

/// A switch the test flips to change how a mock answers.
#[derive(Clone, Default)]
struct Mode(Arc<AtomicU8>);

impl Mode {
    fn set(&self, m: u8) {
        self.0.store(m, Ordering::SeqCst);
    }

    fn get(&self) -> u8 {
        self.0.load(Ordering::SeqCst)
    }
}

async fn worker_view(addr: std::net::SocketAddr, i: usize) -> serde_json::Value {
    get_workers(addr).await["workers"][i].clone()
}

/// Waits until worker `i`'s first probe has marked it unhealthy (not merely unprobed:
/// `/health` does not count an unprobed worker either, yet requests still go to it).
async fn wait_probed_unhealthy(addr: std::net::SocketAddr, i: usize) {
    wait_until(
        "the worker marked unhealthy",
        Duration::from_secs(2),
        || async {
            let w = worker_view(addr, i).await;
            w["probed"] == true && w["healthy"] == false
        },
    )
    .await;
}

const FLAKY: u8 = 0;
const DOWN: u8 = 1;
const UP: u8 = 2;

// C19
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_checks_flip_a_worker_only_after_consecutive_results() {
    let mode = Mode::default();
    let probes = Arc::new(AtomicUsize::new(0));
    let (m, n) = (mode.clone(), Arc::clone(&probes));
    let a = FakeWorker::builder()
        .health(move |_| {
            let i = n.fetch_add(1, Ordering::SeqCst);
            match m.get() {
                // Every 4th probe fails; one probe (the 6th) outlives the timeout.
                FLAKY if i % 4 == 3 => Reply::json(503, r#"{"status":"busy"}"#),
                FLAKY if i == 5 => Reply::raw(vec![
                    Step::Sleep(Duration::from_millis(200)),
                    Step::Write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n".to_vec()),
                ]),
                DOWN => Reply::json(503, r#"{"status":"down"}"#),
                _ => Reply::json(200, r#"{"status":"ok"}"#),
            }
        })
        .start()
        .await;
    let b = FakeWorker::start().await;
    let yaml = yaml_for(
        &[&a, &b],
        "policy: round_robin\nhealth:\n  interval_secs: 0.04\n  timeout_secs: 0.1\n  failure_threshold: 3\n  success_threshold: 2\n",
    );
    let router = start_router(&yaml).await;

    // Watch A's health the whole time, as a user polling /workers would.
    let addr = router.addr;
    let watcher = tokio::spawn(async move {
        let mut seen = vec![true];
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(4) {
            let h = worker_view(addr, 0).await["healthy"].as_bool().unwrap();
            if *seen.last().unwrap() != h {
                seen.push(h);
                if seen.len() == 3 {
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        seen
    });

    // Flaky phase: isolated failures and a slow probe, under steady traffic.
    wait_until("a dozen flaky probes", Duration::from_secs(3), || async {
        probes.load(Ordering::SeqCst) >= 12
    })
    .await;
    for _ in 0..10 {
        let r = post(
            router.addr,
            "/v1/chat/completions",
            chat_body("steady", false),
        )
        .await;
        assert_eq!(r.status, 200);
    }
    assert!(
        a.count() >= 4,
        "A keeps its share while flaky: {}",
        a.count()
    );
    assert_eq!(worker_view(router.addr, 0).await["healthy"], true);

    // Three failures in a row: A goes down and gets no traffic.
    mode.set(DOWN);
    wait_until("A marked unhealthy", Duration::from_secs(2), || async {
        worker_view(router.addr, 0).await["healthy"] == false
    })
    .await;
    let health = get(router.addr, "/health").await;
    assert_eq!(health.status, 200, "B is still healthy: {}", health.text());
    assert_eq!(health.json()["healthy_workers"], 1);
    let before = a.count();
    for _ in 0..6 {
        let r = post(
            router.addr,
            "/v1/chat/completions",
            chat_body("steady", false),
        )
        .await;
        assert_eq!(r.status, 200);
    }
    assert_eq!(a.count(), before, "an unhealthy worker gets no requests");

    // Successes again: A comes back.
    mode.set(UP);
    wait_until("A healthy again", Duration::from_secs(2), || async {
        worker_view(router.addr, 0).await["healthy"] == true
    })
    .await;
    let transitions = within("watcher", watcher).await.unwrap();
    assert_eq!(
        transitions,
        [true, false, true],
        "one down and one up transition for the whole run"
    );
    router.shutdown().await;
}

// C20
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_with_no_healthy_worker_answers_503_and_recovers_without_a_restart() {
    let mode = Mode::default();
    mode.set(DOWN);
    let m = mode.clone();
    let a = FakeWorker::builder()
        .health(move |_| match m.get() {
            DOWN => Reply::json(503, r#"{"status":"down"}"#),
            _ => Reply::json(200, r#"{"status":"ok"}"#),
        })
        .start()
        .await;
    let yaml = yaml_for(
        &[&a],
        "health:\n  interval_secs: 0.04\n  failure_threshold: 2\n  success_threshold: 2\n",
    );
    let router = start_router(&yaml).await;
    // Its first probe has answered 503.
    wait_probed_unhealthy(router.addr, 0).await;
    assert_eq!(get(router.addr, "/health").await.status, 503);
    assert_eq!(get(router.addr, "/workers").await.status, 200);
    let started = Instant::now();
    let r = post(
        router.addr,
        "/v1/chat/completions",
        chat_body("anyone?", false),
    )
    .await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(r.json()["error"]["message"].is_string());
    assert!(started.elapsed() < Duration::from_secs(1));
    assert_eq!(a.count(), 0, "nothing is sent to an unhealthy worker");

    mode.set(UP);
    wait_until("/health ready again", Duration::from_secs(2), || async {
        get(router.addr, "/health").await.status == 200
    })
    .await;
    let r = post(
        router.addr,
        "/v1/chat/completions",
        chat_body("anyone?", false),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    router.shutdown().await;
}

const FAIL: u8 = 0;
const SLOW: u8 = 1;
const BAD_REQUEST: u8 = 2;
const OK: u8 = 3;

// C18
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn breaker_opens_on_failures_and_closes_after_a_cancelled_or_neutral_probe() {
    let mode = Mode::default();
    let m = mode.clone();
    let a = FakeWorker::start_with(move |_| match m.get() {
        FAIL => Reply::json(500, r#"{"error":"boom"}"#),
        SLOW => Reply::raw(vec![
            Step::Sleep(Duration::from_millis(300)),
            Step::Write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}".to_vec()),
        ]),
        BAD_REQUEST => Reply::json(400, r#"{"error":"bad input"}"#),
        _ => Reply::ok(),
    })
    .await;
    let yaml = yaml_for(
        &[&a],
        "proxy:\n  max_retries: 0\ncircuit_breaker:\n  failure_threshold: 3\n  timeout_secs: 0.2\n  success_threshold: 1\n",
    );
    let router = start_router(&yaml).await;
    let chat = || {
        post(
            router.addr,
            "/v1/chat/completions",
            chat_body("probe", false),
        )
    };

    for _ in 0..3 {
        assert_eq!(chat().await.status, 500);
    }
    assert_eq!(worker_view(router.addr, 0).await["breaker"], "open");
    let r = chat().await;
    assert_eq!(r.status, 503, "an open breaker rejects: {}", r.text());
    assert_eq!(a.count(), 3);

    // Probe 1: a client error, which says nothing about the worker: the breaker stays
    // half-open and the slot is free for the next request.
    mode.set(BAD_REQUEST);
    wait_until(
        "half-open after the cooldown",
        Duration::from_secs(1),
        || async { worker_view(router.addr, 0).await["breaker"] == "half_open" },
    )
    .await;
    assert_eq!(chat().await.status, 400);
    assert_eq!(worker_view(router.addr, 0).await["breaker"], "half_open");

    // Probe 2: the client gives up before the worker answers.
    mode.set(SLOW);
    let mut conn = Conn::connect(router.addr).await;
    conn.send(&Req::post(
        "/v1/chat/completions",
        chat_body("probe", false),
    ))
    .await
    .unwrap();
    a.wait_for_requests(5).await;
    drop(conn);

    // The cancelled probe never leaves the breaker stuck: the next probe goes through
    // within the cooldown plus the slow answer, succeeds, and closes it.
    mode.set(OK);
    wait_until("a successful probe", Duration::from_secs(1), || async {
        chat().await.status == 200
    })
    .await;
    assert_eq!(worker_view(router.addr, 0).await["breaker"], "closed");
    for _ in 0..5 {
        assert_eq!(chat().await.status, 200);
    }
    router.shutdown().await;
}

/// Three workers that each answer 503 with a body naming themselves.
async fn busy_workers() -> Vec<FakeWorker> {
    let mut v = Vec::new();
    for i in 0..3 {
        v.push(
            FakeWorker::start_with(move |_| {
                Reply::json(
                    503,
                    &format!(r#"{{"error":{{"message":"worker {i} is busy","code":503}}}}"#),
                )
            })
            .await,
        );
    }
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_never_send_a_request_to_a_worker_it_already_tried() {
    let pool = busy_workers().await;
    let ws: Vec<&FakeWorker> = pool.iter().collect();
    // As many retries as other workers, or more: one attempt per worker, and the client
    // gets the last worker's own 503.
    for (retries, n) in [(2, 3), (5, 2)] {
        let router = start_router(&yaml_for(
            &ws,
            &format!("proxy:\n  max_retries: {retries}\n  initial_backoff_ms: 5\n"),
        ))
        .await;
        for _ in 0..n {
            let tag = new_tag();
            let resp = send(
                router.addr,
                &Req::post("/v1/chat/completions", chat_body(&tag, false))
                    .header("x-test-tag", &tag),
            )
            .await;
            let attempts: Vec<Recorded> = ws.iter().filter_map(|w| w.tagged(&tag)).collect();
            let per_worker: Vec<usize> = ws
                .iter()
                .map(|w| {
                    w.requests()
                        .iter()
                        .filter(|r| r.header("x-test-tag") == Some(tag.as_str()))
                        .count()
                })
                .collect();
            assert_eq!(
                per_worker,
                [1, 1, 1],
                "max_retries {retries}: one attempt per worker"
            );
            // Whether retries ran out or workers did, the client gets the answer of
            // the last attempt: that worker's own 503.
            let last = ws
                .iter()
                .enumerate()
                .max_by_key(|(_, w)| w.tagged(&tag).unwrap().at)
                .map(|(i, _)| i)
                .unwrap();
            assert_eq!(resp.status, 503, "{}", resp.text());
            assert_eq!(
                resp.json()["error"]["message"],
                format!("worker {last} is busy"),
                "the client gets the answer of the last attempt"
            );
            assert_eq!(attempts.len(), 3);
        }
        let m = scrape(router.addr).await;
        assert_eq!(
            m.get("cache_aware_router_retries_total", &[]),
            Some(2.0 * n as f64),
            "two re-sends per request: {}",
            m.text
        );
        router.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_killed_mid_run_fails_no_request_that_had_not_reached_it() {
    // Plain answers take 5 ms, so some are in progress at the kill; streams never end
    // on their own.
    let forever = Gate::new();
    let mut pool = Vec::new();
    for _ in 0..3 {
        let forever = forever.clone();
        pool.push(
            FakeWorker::start_with(move |req| {
                if req.body_str().contains(r#""stream":true"#) {
                    Reply::status(200)
                        .header("Content-Type", "text/event-stream")
                        .chunked(vec![
                            Step::Write(format!("data: {}\n\n", sse_event(0)).into_bytes()),
                            Step::Wait(forever.clone()),
                        ])
                } else {
                    Reply::ok().after(Duration::from_millis(5))
                }
            })
            .await,
        );
    }
    let ws: Vec<&FakeWorker> = pool.iter().collect();
    // `migration` off: the stream below is cut, not continued (see `migration.rs`).
    let router = start_router(&yaml_for(&ws, "migration:\n  enabled: false\n")).await;
    let addr = router.addr;

    // A stream in progress on the worker about to die.
    let tag = new_tag();
    let mut stream = Conn::connect(addr).await;
    stream
        .send(
            &Req::post("/v1/chat/completions", chat_body("a long story", true))
                .header("x-test-tag", &tag),
        )
        .await
        .unwrap();
    assert_eq!(stream.read_head().await.status, 200);
    stream.next_piece().await.expect("first event");
    let victim = served_by(&ws, &tag);

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let completed = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..4)
        .map(|c| {
            let (stop, completed) = (Arc::clone(&stop), Arc::clone(&completed));
            tokio::spawn(async move {
                let mut done = Vec::new();
                let mut n = 0;
                while !stop.load(Ordering::SeqCst) {
                    let tag = new_tag();
                    let prompt = format!("client {c} request {n}: a question of its own");
                    let resp = send(
                        addr,
                        &Req::post("/v1/chat/completions", chat_body(&prompt, false))
                            .header("x-test-tag", &tag),
                    )
                    .await;
                    done.push((tag, resp.status, Instant::now()));
                    completed.fetch_add(1, Ordering::SeqCst);
                    n += 1;
                }
                done
            })
        })
        .collect();
    wait_until("the victim serves traffic", STEP_TIMEOUT, || async {
        ws[victim].count() >= 5
    })
    .await;
    let before_kill = ws[victim].count();
    assert!(in_flight(addr).await[victim] >= 1);
    ws[victim].kill().await;
    let killed_at = Instant::now();
    // Twenty requests end after the kill (a request of each client may have ended
    // just before it, and counts here).
    let at_kill = completed.load(Ordering::SeqCst);
    wait_until("traffic after the kill", STEP_TIMEOUT, || async {
        completed.load(Ordering::SeqCst) >= at_kill + 24
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    let mut results = Vec::new();
    for c in clients {
        results.extend(within("client loop", c).await.unwrap());
    }

    assert!(before_kill > 1, "the victim served traffic before the kill");
    let after: Vec<_> = results.iter().filter(|r| r.2 > killed_at).collect();
    assert!(
        after.len() >= 20,
        "traffic went on: {} requests",
        after.len()
    );
    let failed: Vec<_> = results.iter().filter(|r| r.1 != 200).collect();
    for (tag, status, _) in &failed {
        assert!(
            ws[victim].tagged(tag).is_some(),
            "request {tag} failed with {status} though it had not reached the killed worker"
        );
    }
    assert!(
        failed.len() <= 4,
        "at most the requests in progress at the kill: {failed:?}"
    );
    // The stream it was serving is cut for its client, not ended cleanly.
    let ended = within("the cut stream", async {
        loop {
            match stream.try_next_piece().await {
                Ok(Some(_)) => {}
                Ok(None) => break "complete",
                Err(_) => break "cut",
            }
        }
    })
    .await;
    assert_eq!(ended, "cut");
    let listed = get_workers(addr).await["workers"].as_array().unwrap().len();
    assert_eq!(listed, 3, "the dead worker stays listed");
    wait_all_idle(addr, Duration::from_secs(1)).await;
    forever.open();
    router.shutdown().await;
}

// Paused time: the breaker reads tokio's clock, so its 30 s timeout is stepped over with
// `advance` instead of being waited for. Everything runs on one thread over loopback
// sockets, so the clock only moves when the test moves it or every task is idle.
#[tokio::test(start_paused = true)]
async fn breaker_cycle_shows_in_workers_and_cancelled_probes_give_their_slots_back() {
    use tokio::time::{Instant, advance};
    const TIMEOUT: Duration = Duration::from_secs(30);
    // `fail` prompts get a 500; `hang` prompts are held unanswered until `hang` opens.
    let hang = Gate::new();
    let h = hang.clone();
    let a = FakeWorker::start_with(move |req| {
        let body = req.body_str();
        if body.contains("fail") {
            Reply::json(500, r#"{"error":"boom"}"#)
        } else if body.contains("hang") {
            Reply::ok().after_gate(&h)
        } else {
            Reply::ok()
        }
    })
    .await;
    let yaml = yaml_for(
        &[&a],
        "proxy:\n  max_retries: 0\ncircuit_breaker:\n  failure_threshold: 2\n  timeout_secs: 30\n  success_threshold: 2\n",
    );
    let router = start_router(&yaml).await;
    let addr = router.addr;
    let chat = |prompt: &'static str| post(addr, "/v1/chat/completions", chat_body(prompt, false));
    let breaker = || async move { worker_view(addr, 0).await["breaker"].clone() };

    // closed -> open after two consecutive failures; open for the whole timeout.
    assert_eq!(chat("fail").await.status, 500);
    assert_eq!(
        breaker().await,
        "closed",
        "one failure is below the threshold"
    );
    let before = Instant::now();
    assert_eq!(chat("fail").await.status, 500);
    let after = Instant::now();
    assert_eq!(breaker().await, "open");
    let r = chat("ok").await;
    assert_eq!(r.status, 503, "an open breaker takes nothing: {}", r.text());
    advance(
        (before + TIMEOUT - Duration::from_millis(100)).saturating_duration_since(Instant::now()),
    )
    .await;
    assert_eq!(
        breaker().await,
        "open",
        "still open just before the timeout"
    );
    assert_eq!(chat("ok").await.status, 503);
    assert_eq!(a.count(), 2);

    // open -> half_open once the timeout has passed.
    advance((after + TIMEOUT).saturating_duration_since(Instant::now())).await;
    assert_eq!(breaker().await, "half_open");

    // Two probes in flight fill both probe slots: a third request is refused.
    let mut probes = Vec::new();
    for n in 1..=2 {
        let mut c = Conn::connect(addr).await;
        c.send(&Req::post("/v1/chat/completions", chat_body("hang", false)))
            .await
            .unwrap();
        a.wait_for_requests(2 + n).await;
        probes.push(c);
    }
    assert_eq!(in_flight(addr).await, [2]);
    assert_eq!(breaker().await, "half_open");
    let r = chat("ok").await;
    assert_eq!(r.status, 503, "probes are bounded: {}", r.text());
    assert_eq!(a.count(), 4);

    // Both clients give up while their probes are in flight: the slots come back at
    // once (the worker never answers them), and the breaker stays half-open.
    drop(probes);
    wait_all_idle(addr, Duration::from_secs(1)).await;
    assert_eq!(
        breaker().await,
        "half_open",
        "a cancelled probe is no verdict"
    );

    // One success of two: still half-open. A failure: open again.
    assert_eq!(chat("ok").await.status, 200);
    assert_eq!(breaker().await, "half_open");
    let before = Instant::now();
    assert_eq!(chat("fail").await.status, 500);
    let after = Instant::now();
    assert_eq!(
        breaker().await,
        "open",
        "a failed probe reopens the breaker"
    );
    assert_eq!(chat("ok").await.status, 503);
    advance(
        (before + TIMEOUT - Duration::from_millis(100)).saturating_duration_since(Instant::now()),
    )
    .await;
    assert_eq!(breaker().await, "open", "for a whole new timeout");

    // half_open again after it; two successes close it.
    advance((after + TIMEOUT).saturating_duration_since(Instant::now())).await;
    assert_eq!(breaker().await, "half_open");
    assert_eq!(chat("ok").await.status, 200);
    assert_eq!(breaker().await, "half_open");
    assert_eq!(chat("ok").await.status, 200);
    assert_eq!(breaker().await, "closed");
    for _ in 0..3 {
        assert_eq!(chat("ok").await.status, 200);
    }
    hang.open();
    router.shutdown().await;
}

// Paused time: probes come every (virtual) second, and the test reads `/workers` after
// each one.
#[tokio::test(start_paused = true)]
async fn health_flapping_below_either_threshold_changes_nothing() {
    // Probe results by probe number, then `+` forever. Thresholds: 3 failures in a row
    // take A down, 2 successes in a row bring it back.
    //   0-6   +--+--+   two failures in a row, twice: A stays up
    //   7-9   ---       the third in a row: down after probe 9
    //   10-16 +-+-+-+   single successes: A stays down
    //   17    +         the second in a row: up after probe 17
    const SCRIPT: &[u8] = b"+--+--+---+-+-+-++";
    const HEALTHY_AFTER: &[u8] = b"uuuuuuuuuddddddddu";
    let probes = Arc::new(AtomicUsize::new(0));
    let n = Arc::clone(&probes);
    let a = FakeWorker::builder()
        .health(move |_| {
            let i = n.fetch_add(1, Ordering::SeqCst);
            match SCRIPT.get(i) {
                Some(b'-') => Reply::json(503, r#"{"status":"loading"}"#),
                _ => Reply::json(200, r#"{"status":"ok"}"#),
            }
        })
        .start()
        .await;
    let b = FakeWorker::start().await;
    let yaml = yaml_for(
        &[&a, &b],
        "policy: round_robin\nhealth:\n  interval_secs: 1\n  failure_threshold: 3\n  success_threshold: 2\n",
    );
    let router = start_router(&yaml).await;
    let addr = router.addr;

    for (i, expected) in HEALTHY_AFTER.iter().enumerate() {
        a.wait_for_probes(i + 1).await;
        // The router reads the answer and updates the worker well before the next probe.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let healthy = worker_view(addr, 0).await["healthy"].as_bool().unwrap();
        assert_eq!(
            healthy,
            *expected == b'u',
            "after probe {i} ({}): probes so far {}",
            SCRIPT[i] as char,
            String::from_utf8_lossy(&SCRIPT[..=i])
        );
        // Traffic follows: a worker marked down gets no requests, one up gets its turn.
        let before = a.count();
        for _ in 0..2 {
            let r = post(addr, "/v1/chat/completions", chat_body("flap", false)).await;
            assert_eq!(r.status, 200);
        }
        let expected_requests = if healthy { 1 } else { 0 };
        assert_eq!(a.count() - before, expected_requests, "after probe {i}");
    }
    router.shutdown().await;
}

/// A port nothing listens on.
fn dead_url() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    format!("http://{}", l.local_addr().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_is_503_at_once_when_the_only_worker_is_dead() {
    // Default probes: every 10 s, 3 failures to go down. The first probe decides.
    let router = start_router(&yaml_for_urls(&[dead_url()], "")).await;
    // Not counted before its probe answers; marked unhealthy by that first probe.
    wait_probed_unhealthy(router.addr, 0).await;
    let h = get(router.addr, "/health").await;
    assert_eq!(h.status, 503, "{}", h.text());
    assert_eq!(h.json()["healthy_workers"], 0, "{}", h.text());
    let r = post(
        router.addr,
        "/v1/chat/completions",
        chat_body("anyone?", false),
    )
    .await;
    assert_eq!(r.status, 503, "{}", r.text());
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_joins_is_probed_at_once_and_counted_only_once_it_answers() {
    let live = FakeWorker::start().await;
    let router = start_router(&yaml_for(
        &[&live],
        "server:\n  admin_token: qa-admin-token-1\n",
    ))
    .await;
    wait_until(
        "the live worker counted",
        Duration::from_secs(2),
        || async { get(router.addr, "/health").await.json()["healthy_workers"] == 1 },
    )
    .await;
    let dead = dead_url();
    let added = send(
        router.addr,
        &Req::new("POST", "/workers")
            .header("Authorization", "Bearer qa-admin-token-1")
            .header("Content-Type", "application/json")
            .body(format!(r#"{{"url":"{dead}"}}"#).into_bytes()),
    )
    .await;
    assert!(added.status < 300, "{}", added.text());
    let started = Instant::now();
    wait_until(
        "the dead worker marked unhealthy",
        Duration::from_secs(2),
        || async { worker_view(router.addr, 1).await["healthy"] == false },
    )
    .await;
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "not a probe interval later"
    );
    let h = get(router.addr, "/health").await;
    assert_eq!(h.json()["healthy_workers"], 1, "{}", h.text());
    // And a live one that joins counts once its first probe answers.
    let second = FakeWorker::start().await;
    let added = send(
        router.addr,
        &Req::new("POST", "/workers")
            .header("Authorization", "Bearer qa-admin-token-1")
            .header("Content-Type", "application/json")
            .body(format!(r#"{{"url":"{}"}}"#, second.url()).into_bytes()),
    )
    .await;
    assert!(added.status < 300, "{}", added.text());
    wait_until(
        "the new live worker counted",
        Duration::from_secs(2),
        || async { get(router.addr, "/health").await.json()["healthy_workers"] == 2 },
    )
    .await;
    assert!(!second.probes().is_empty());
    router.shutdown().await;
}

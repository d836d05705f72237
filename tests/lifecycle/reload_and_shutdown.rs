//! Reload (the SIGHUP logic, called directly) and shutdown of a running router.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use cache_aware_router::app;
use cache_aware_router::config::Config;
use cache_aware_router::reload::{self, Outcome};
use support::{client::*, config::*, engine::*, observe::*, wait::*, worker::*};

use crate::common::start_router;

async fn listed_urls(addr: std::net::SocketAddr) -> Vec<String> {
    get_workers(addr).await["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["url"].as_str().unwrap().to_string())
        .collect()
}

/// Opens a streamed request and reads its first event.
async fn open_stream(addr: std::net::SocketAddr) -> Conn {
    let mut conn = Conn::connect(addr).await;
    conn.send(&Req::post(
        "/v1/chat/completions",
        chat_body("stream", true),
    ))
    .await
    .unwrap();
    assert_eq!(conn.read_head().await.status, 200);
    conn.next_piece().await.expect("first event");
    conn
}

async fn read_to_end(conn: &mut Conn) -> Vec<u8> {
    let mut body = Vec::new();
    while let Some(p) = conn.next_piece().await {
        body.extend_from_slice(&p);
    }
    body
}

// C27, reload half
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_with_an_unbracketed_ipv6_url_is_refused_and_the_old_list_stays() {
    let a = FakeWorker::start().await;
    let b = FakeWorker::start().await;
    let extra = "policy: round_robin\n";
    let router = start_router(&yaml_for(&[&a, &b], extra)).await;
    let before = listed_urls(router.addr).await;

    let bad = TempFile::new(
        "workers.yaml",
        &yaml_for_urls(&[a.url(), b.url(), "http://::1:18006".into()], extra),
    );
    match reload::apply(
        router.config(),
        router.pool(),
        std::slice::from_ref(&bad.path),
    ) {
        Outcome::Invalid(msg) => {
            assert!(
                msg.contains(&bad.path.display().to_string())
                    && msg.contains("workers[2].url")
                    && msg.contains("http://::1:18006"),
                "the message names file, key and value: {msg}"
            );
        }
        other => panic!("an unbracketed IPv6 URL must be refused, got {other:?}"),
    }
    assert_eq!(listed_urls(router.addr).await, before);
    for _ in 0..4 {
        let r = post(
            router.addr,
            "/v1/chat/completions",
            chat_body("still here", false),
        )
        .await;
        assert_eq!(r.status, 200);
    }
    assert_eq!((a.count(), b.count()), (2, 2), "the old list keeps serving");

    // The same reload without the bad entry goes through.
    let good = TempFile::new("workers.yaml", &yaml_for(&[&b], extra));
    assert_eq!(
        reload::apply(
            router.config(),
            router.pool(),
            std::slice::from_ref(&good.path)
        ),
        Outcome::Applied { workers: 1 }
    );
    assert_eq!(listed_urls(router.addr).await, [b.url()]);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_changing_anything_but_workers_is_rejected() {
    let a = FakeWorker::start().await;
    let router = start_router(&yaml_for(&[&a], "")).await;
    let f = TempFile::new("c.yaml", &yaml_for(&[&a], "policy: round_robin\n"));
    assert_eq!(
        reload::apply(
            router.config(),
            router.pool(),
            std::slice::from_ref(&f.path)
        ),
        Outcome::Rejected {
            key: "policy",
            changes: vec!["policy: (unset) → round_robin".to_string()]
        }
    );
    assert_eq!(get_workers(router.addr).await["policy"], "cache_aware");
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_keeps_the_in_flight_count_of_a_surviving_worker() {
    let gate = Gate::new();
    let g = gate.clone();
    let a = FakeWorker::start_with(move |_| gated_stream(&g)).await;
    let b = FakeWorker::start().await;
    let router = start_router(&yaml_for(&[&a], "")).await;
    let mut stream = open_stream(router.addr).await;
    assert_eq!(in_flight(router.addr).await, [1]);

    let f = TempFile::new("w.yaml", &yaml_for(&[&b, &a], ""));
    assert_eq!(
        reload::apply(
            router.config(),
            router.pool(),
            std::slice::from_ref(&f.path)
        ),
        Outcome::Applied { workers: 2 }
    );
    assert_eq!(listed_urls(router.addr).await, [b.url(), a.url()]);
    assert_eq!(
        in_flight(router.addr).await,
        [0, 1],
        "the stream still counts on the surviving worker"
    );
    gate.open();
    let body = read_to_end(&mut stream).await;
    assert!(String::from_utf8_lossy(&body).ends_with("data: [DONE]\n\n"));
    wait_all_idle(router.addr, Duration::from_millis(500)).await;
    router.shutdown().await;
}

// C22
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_after_a_reload_come_from_the_new_worker_list() {
    async fn serving(model: &'static str) -> FakeWorker {
        FakeWorker::builder()
            .serving(&[model])
            .reply(move |req| {
                if req.body_str().contains(&format!(r#""model":"{model}""#)) {
                    Reply::ok()
                } else {
                    Reply::json(404, r#"{"error":{"message":"model not found","code":404}}"#)
                }
            })
            .start()
            .await
    }
    let a = serving("m-old").await;
    let b = serving("m-new").await;
    let router = start_router(&yaml_for(&[&a], "")).await;
    let old = get(router.addr, "/v1/models").await;
    assert!(old.text().contains("m-old"), "{}", old.text());

    let f = TempFile::new("w.yaml", &yaml_for(&[&b], ""));
    assert_eq!(
        reload::apply(
            router.config(),
            router.pool(),
            std::slice::from_ref(&f.path)
        ),
        Outcome::Applied { workers: 1 }
    );
    let new = get(router.addr, "/v1/models").await;
    assert_eq!(new.status, 200);
    assert!(
        new.text().contains("m-new") && !new.text().contains("m-old"),
        "{}",
        new.text()
    );
    let a_before = a.count();
    let body = r#"{"model":"m-old","messages":[{"role":"user","content":"hi"}]}"#;
    let resp = post(router.addr, "/v1/chat/completions", body).await;
    assert_eq!(a.count(), a_before, "nothing goes to the removed worker");
    assert!(
        matches!(resp.status, 400 | 404 | 503),
        "the old model is not served: {} {}",
        resp.status,
        resp.text()
    );
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_a_request_in_flight_finish() {
    let gate = Gate::new();
    let g = gate.clone();
    let a = FakeWorker::start_with(move |_| gated_stream(&g)).await;
    let router = start_router(&yaml_for(&[&a], "server:\n  shutdown_grace_secs: 3\n")).await;
    let addr = router.addr;
    let mut stream = open_stream(addr).await;
    let shutdown = tokio::spawn(router.shutdown());
    // Draining: new connections are refused while the stream goes on.
    wait_until("new connections refused", STEP_TIMEOUT, || async {
        tokio::net::TcpStream::connect(addr).await.is_err()
    })
    .await;
    assert!(!shutdown.is_finished(), "shutdown waits for the stream");
    gate.open();
    let body = read_to_end(&mut stream).await;
    assert!(String::from_utf8_lossy(&body).ends_with("data: [DONE]\n\n"));
    within("shutdown after the last stream ended", shutdown)
        .await
        .unwrap();
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "no longer accepting"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_finishes_within_its_grace_period() {
    let gate = Gate::new();
    let g = gate.clone();
    let a = FakeWorker::start_with(move |_| gated_stream(&g)).await;
    let router = start_router(&yaml_for(&[&a], "server:\n  shutdown_grace_secs: 0.3\n")).await;
    let _stream = open_stream(router.addr).await;
    let started = Instant::now();
    within("shutdown", router.shutdown()).await;
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(250) && took < Duration::from_millis(1500),
        "a stuck stream holds shutdown for the grace period only: {took:?}"
    );
    gate.open();
}

// C20, step 4
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_to_an_empty_worker_list_answers_503_until_workers_return() {
    for policy in ["cache_aware", "round_robin", "random", "least_load"] {
        let a = FakeWorker::start().await;
        let extra = format!("policy: {policy}\n");
        let router = start_router(&yaml_for(&[&a], &extra)).await;
        let empty = TempFile::new("w.yaml", &format!("{extra}workers: []\n"));
        assert_eq!(
            reload::apply(
                router.config(),
                router.pool(),
                std::slice::from_ref(&empty.path)
            ),
            Outcome::Applied { workers: 0 },
            "{policy}"
        );
        for _ in 0..5 {
            let r = post(
                router.addr,
                "/v1/chat/completions",
                chat_body("hello", false),
            )
            .await;
            assert_eq!(r.status, 503, "{policy}: {}", r.text());
            assert!(r.json()["error"]["message"].is_string());
        }
        assert_eq!(get(router.addr, "/v1/models").await.status, 503, "{policy}");
        assert_eq!(get(router.addr, "/health").await.status, 503, "{policy}");
        assert_eq!(listed_urls(router.addr).await, Vec::<String>::new());

        let back = TempFile::new("w.yaml", &yaml_for(&[&a], &extra));
        assert_eq!(
            reload::apply(
                router.config(),
                router.pool(),
                std::slice::from_ref(&back.path)
            ),
            Outcome::Applied { workers: 1 }
        );
        let r = post(
            router.addr,
            "/v1/chat/completions",
            chat_body("hello", false),
        )
        .await;
        assert_eq!(r.status, 200, "{policy}: {}", r.text());
        router.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_keeps_the_breaker_state_of_a_surviving_worker() {
    let a = FakeWorker::start_with(|_| Reply::json(500, r#"{"error":"boom"}"#)).await;
    let b = FakeWorker::start().await;
    let extra =
        "proxy:\n  max_retries: 0\ncircuit_breaker:\n  failure_threshold: 2\n  timeout_secs: 60\n";
    let router = start_router(&yaml_for(&[&a], extra)).await;
    for _ in 0..2 {
        let r = post(router.addr, "/v1/chat/completions", chat_body("x", false)).await;
        assert_eq!(r.status, 500);
    }
    let breaker = |v: serde_json::Value, i: usize| v["workers"][i]["breaker"].clone();
    assert_eq!(breaker(get_workers(router.addr).await, 0), "open");

    let f = TempFile::new("w.yaml", &yaml_for(&[&b, &a], extra));
    assert_eq!(
        reload::apply(
            router.config(),
            router.pool(),
            std::slice::from_ref(&f.path)
        ),
        Outcome::Applied { workers: 2 }
    );
    let after = get_workers(router.addr).await;
    assert_eq!(
        breaker(after.clone(), 0),
        "closed",
        "the new worker starts closed"
    );
    assert_eq!(
        breaker(after, 1),
        "open",
        "the surviving worker's breaker is kept"
    );
    for _ in 0..3 {
        let r = post(router.addr, "/v1/chat/completions", chat_body("x", false)).await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert_eq!(
        a.count(),
        2,
        "the open breaker still keeps traffic off the old worker"
    );
    router.shutdown().await;
}

/// Short streams for `"stream":true` (three events, 10 ms apart), JSON otherwise.
fn quick_answer(req: &Recorded) -> Reply {
    if req.body_str().contains(r#""stream":true"#) {
        let events: Vec<String> = (0..3).map(sse_event).chain(["[DONE]".into()]).collect();
        Reply::sse(&events, Duration::from_millis(10))
    } else {
        Reply::ok()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_under_steady_load_fails_no_request() {
    let a = FakeWorker::start_with(quick_answer).await;
    let b = FakeWorker::start_with(quick_answer).await;
    let c = FakeWorker::start_with(quick_answer).await;
    let router = start_router(&yaml_for(&[&a, &b], "")).await;
    let addr = router.addr;
    let stop = Arc::new(AtomicBool::new(false));
    // Requests each client has completed.
    let done: Arc<Vec<AtomicUsize>> = Arc::new((0..4).map(|_| AtomicUsize::new(0)).collect());
    let clients: Vec<_> = (0..4)
        .map(|i| {
            let (stop, done) = (Arc::clone(&stop), Arc::clone(&done));
            tokio::spawn(async move {
                let mut conn = Conn::connect(addr).await;
                let mut results = Vec::new();
                let mut n = 0;
                while !stop.load(Ordering::SeqCst) {
                    let stream = (i + n) % 2 == 0;
                    let prompt = format!("client {i} turn {n}: tell me more about topic {n}");
                    let resp = conn
                        .request(&Req::post(
                            "/v1/chat/completions",
                            chat_body(&prompt, stream),
                        ))
                        .await;
                    let complete = !stream || resp.text().ends_with("data: [DONE]\n\n");
                    results.push((resp.status, complete));
                    done[i].fetch_add(1, Ordering::SeqCst);
                    n += 1;
                }
                results
            })
        })
        .collect();
    let completed = || {
        done.iter()
            .map(|d| d.load(Ordering::SeqCst))
            .collect::<Vec<_>>()
    };

    wait_until("steady load", STEP_TIMEOUT, || async {
        completed().iter().sum::<usize>() >= 20
    })
    .await;
    let f = TempFile::new("w.yaml", &yaml_for(&[&b, &c], ""));
    assert_eq!(
        reload::apply(
            router.config(),
            router.pool(),
            std::slice::from_ref(&f.path)
        ),
        Outcome::Applied { workers: 2 }
    );
    assert_eq!(listed_urls(addr).await, [b.url(), c.url()]);
    wait_until("the added worker takes traffic", STEP_TIMEOUT, || async {
        c.count() >= 10
    })
    .await;
    let c_after_first = c.count();
    let f = TempFile::new("w.yaml", &yaml_for(&[&c, &a], ""));
    assert_eq!(
        reload::apply(
            router.config(),
            router.pool(),
            std::slice::from_ref(&f.path)
        ),
        Outcome::Applied { workers: 2 }
    );
    assert_eq!(listed_urls(addr).await, [c.url(), a.url()]);
    // A request that loaded the old list just before the swap may still reach B; each
    // client's second request from now on started after the swap.
    let at_swap = completed();
    wait_until(
        "two requests per client after the swap",
        STEP_TIMEOUT,
        || async {
            completed()
                .iter()
                .zip(&at_swap)
                .all(|(now, then)| *now >= then + 2)
        },
    )
    .await;
    let (a_settled, b_settled) = (a.count(), b.count());
    wait_until(
        "the re-added worker takes traffic",
        STEP_TIMEOUT,
        || async { a.count() >= a_settled + 10 },
    )
    .await;
    stop.store(true, Ordering::SeqCst);

    let mut results = Vec::new();
    for c in clients {
        results.extend(within("client loop", c).await.unwrap());
    }
    assert!(
        results.len() >= 40,
        "steady load: {} requests",
        results.len()
    );
    let failed: Vec<_> = results
        .iter()
        .filter(|(status, complete)| *status != 200 || !complete)
        .collect();
    assert!(
        failed.is_empty(),
        "{} of {} requests failed across two reloads: {failed:?}",
        failed.len(),
        results.len()
    );
    assert!(c_after_first > 0, "the added worker took traffic");
    assert!(a.count() > a_settled, "the re-added worker took traffic");
    assert_eq!(
        b.count(),
        b_settled,
        "the removed worker takes no new request"
    );
    wait_all_idle(addr, Duration::from_secs(1)).await;
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_reloads_keep_the_running_workers_and_config() {
    let a = FakeWorker::start().await;
    let b = FakeWorker::start().await;
    let c = FakeWorker::start().await;
    let router = start_router(&yaml_for(&[&a, &b], "")).await;
    let addr = router.addr;
    let with_c = |extra: &str| yaml_for(&[&a, &c], extra);
    let rejected = [
        (
            "policy",
            with_c("policy: round_robin\n"),
            "policy: (unset) → round_robin",
        ),
        (
            "cache",
            with_c("cache:\n  threshold: 0.5\n"),
            "cache.threshold: (unset) → 0.5",
        ),
        (
            "server",
            with_c("server:\n  admin_token: new-token\n"),
            "server.admin_token: (unset) → ***",
        ),
        (
            "proxy",
            with_c("proxy:\n  max_retries: 7\n  connect_timeout_secs: 3\n"),
            "proxy.max_retries: (unset) → 7; proxy.connect_timeout_secs: (unset) → 3",
        ),
    ];
    for (key, yaml, changes) in &rejected {
        let f = TempFile::new("w.yaml", yaml);
        let outcome = reload::apply(
            router.config(),
            router.pool(),
            std::slice::from_ref(&f.path),
        );
        let Outcome::Rejected { key: k, changes: c } = outcome else {
            panic!("{yaml}: {outcome:?}")
        };
        assert_eq!((k, c.join("; ").as_str()), (*key, *changes), "{yaml}");
    }
    let invalid = [
        (
            "unparsable YAML",
            format!("workers:\n  - url: {}\n   bad", c.url()),
        ),
        ("unknown key", with_c("cache:\n  treshold: 0.5\n")),
        ("no workers key", "policy: cache_aware\n".to_string()),
        (
            "max_load 0",
            format!("workers:\n  - url: {}\n    max_load: 0\n", c.url()),
        ),
    ];
    for (what, yaml) in &invalid {
        let f = TempFile::new("w.yaml", yaml);
        match reload::apply(
            router.config(),
            router.pool(),
            std::slice::from_ref(&f.path),
        ) {
            Outcome::Invalid(msg) => assert!(
                msg.contains(&f.path.display().to_string()),
                "{what}: the message names the file: {msg}"
            ),
            other => panic!("{what}: expected Invalid, got {other:?}"),
        }
    }
    let missing = std::env::temp_dir().join("car-tests-no-such-dir/w.yaml");
    assert!(matches!(
        reload::apply(
            router.config(),
            router.pool(),
            std::slice::from_ref(&missing)
        ),
        Outcome::Invalid(_)
    ));

    // Still the running list and config, serving as before; C never got anything.
    assert_eq!(listed_urls(addr).await, [a.url(), b.url()]);
    assert_eq!(get_workers(addr).await["policy"], "cache_aware");
    for i in 0..6 {
        let r = post(
            addr,
            "/v1/chat/completions",
            chat_body(&format!("question {i} after refused reloads"), false),
        )
        .await;
        assert_eq!(r.status, 200);
    }
    assert_eq!(c.count(), 0);
    let r = send(addr, &Req::new("POST", "/cache/clear")).await;
    assert_eq!(r.status, 403, "the admin token was not taken: {}", r.text());
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_refuses_new_connections_while_a_stream_drains_to_its_end() {
    drains_to_the_end(None).await;
}

/// The same with the client connections on runtimes of their own, as the binary runs
/// them (`CACHE_AWARE_ROUTER_THREADS`): the drain waits for them too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_on_a_connection_thread_drains_to_its_end() {
    let cores = std::sync::Arc::new(cache_aware_router::cores::Cores::start(2).unwrap());
    drains_to_the_end(Some(std::sync::Arc::clone(&cores))).await;
    tokio::task::spawn_blocking(move || cores.stop())
        .await
        .unwrap();
}

async fn drains_to_the_end(cores: Option<std::sync::Arc<cache_aware_router::cores::Cores>>) {
    let gate = Gate::new();
    let g = gate.clone();
    let a = FakeWorker::start_with(move |_| {
        Reply::status(200)
            .header("Content-Type", "text/event-stream")
            .chunked(vec![
                Step::Write(format!("data: {}\n\n", sse_event(0)).into_bytes()),
                Step::Wait(g.clone()),
                Step::Write(format!("data: {}\n\n", sse_event(1)).into_bytes()),
                Step::Sleep(Duration::from_millis(50)),
                Step::Write(format!("data: {}\n\n", sse_event(2)).into_bytes()),
                Step::Write(b"data: [DONE]\n\n".to_vec()),
            ])
    })
    .await;
    let yaml = yaml_for(&[&a], "server:\n  shutdown_grace_secs: 3\n");
    let config = Config::from_sources([(Path::new("test.yaml"), yaml.as_str())]).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    // Its client connections on `cores` (thread per core, as the binary serves them).
    let router = app::spawn_on(config, listener, cores).unwrap();
    let addr = router.addr;
    let mut stream = open_stream(addr).await;
    let shutdown = tokio::spawn(router.shutdown());

    // Draining: the port refuses new connections while the stream is still open.
    wait_until(
        "new connections refused",
        Duration::from_secs(1),
        || async { tokio::net::TcpStream::connect(addr).await.is_err() },
    )
    .await;
    assert!(!shutdown.is_finished(), "shutdown waits for the stream");
    assert_eq!(a.count(), 1);

    // The stream goes on to its end, event by event.
    gate.open();
    let rest = String::from_utf8(stream.read_rest().await).unwrap();
    let expected: String = [sse_event(1), sse_event(2), "[DONE]".into()]
        .iter()
        .map(|e| format!("data: {e}\n\n"))
        .collect();
    assert_eq!(rest, expected);
    within("shutdown after the stream ended", shutdown)
        .await
        .unwrap();
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
}

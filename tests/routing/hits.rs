//! Available / predicted / delivered prefix tokens per answer, and the drift, as a user
//! reads them from `/metrics` and `/workers`: a cold miss, a warm hit, a hit diverted by
//! load (predicted 0 on the worker that took it, available > 0), and an engine that
//! evicted (it reports no cached tokens where the router predicts a hit: drift → 0).

use support::{client::*, config::*, engine::*, observe::*, wait::*, worker::*};

use crate::common::start_router;

const PREFIX: &str = "cache_aware_router_prefix_tokens_total";
const DRIFT: &str = "cache_aware_router_worker_hit_drift";
const DRIFT_LOW: &str = "cache_aware_router_worker_hit_drift_low";

fn prompt() -> String {
    let mut p = String::from("Shared system prompt. ");
    while p.len() < 4096 {
        p.push_str("Answer in plain words and cite the manual section you used. ");
    }
    p
}

/// (available, predicted, delivered) counted for `worker` under `cache_aware`.
fn numbers(m: &Scrape, worker: &str) -> [f64; 3] {
    ["available", "predicted", "delivered"].map(|kind| {
        m.get(
            PREFIX,
            &[
                ("worker", worker),
                ("policy", "cache_aware"),
                ("kind", kind),
            ],
        )
        .unwrap_or(0.0)
    })
}

fn hits(workers: &serde_json::Value, label: &str) -> serde_json::Value {
    workers["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["url"] == label)
        .unwrap_or_else(|| panic!("{label} not in {workers}"))["hits"]
        .clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_numbers_per_answer_and_the_drift_of_an_engine_that_evicted() {
    let (hold, [a, b], yaml) = usage_engines("", "").await;
    let router = start_router(&yaml).await;
    let ws = [&a, &b];
    let addr = router.addr;
    let labels = [worker_label(addr, 0).await, worker_label(addr, 1).await];
    let p = prompt();

    // 1. Cold: nothing held anywhere.
    let (r, x) = send_tagged(addr, &ws, chat_with_usage(chat_body(&p, false), (1100, 0))).await;
    assert_eq!(r.status, 200);
    let y = 1 - x;
    let m = scrape(addr).await;
    assert_eq!(numbers(&m, &labels[x]), [0.0, 0.0, 0.0], "{}", m.text);

    // 2. Warm: the repeat goes back to x, which was predicted to hold the whole prompt
    //    — in whole 16-token blocks at the tokens per byte x's first answer taught
    //    (1100 tokens for this prompt: 68 blocks) — and delivered what its engine
    //    reported.
    let (r, w) = send_tagged(
        addr,
        &ws,
        chat_with_usage(chat_body(&p, false), (1100, 1024)),
    )
    .await;
    assert_eq!((r.status, w), (200, x));
    let m = scrape(addr).await;
    let [available, predicted, delivered] = numbers(&m, &labels[x]);
    assert_eq!(predicted, 1088.0);
    assert_eq!((available, delivered), (predicted, 1024.0));

    // 3. Diverted: x is busy, so the hit goes to y, which holds nothing of it:
    //    available as before, predicted 0 there.
    let (mut held, on) = hold_stream(
        addr,
        &ws,
        chat_with_usage(chat_body(&p, true), (1100, 1024)),
    )
    .await;
    assert_eq!(on, x);
    let (r, w) = send_tagged(addr, &ws, chat_with_usage(chat_body(&p, false), (1100, 0))).await;
    assert_eq!((r.status, w), (200, y), "a diverted hit");
    hold.open();
    held.read_rest().await;
    let m = scrape(addr).await;
    // y has taught nothing yet: its numbers are at the prior 4 bytes per token.
    let prior = (p.len() / 4 / 16 * 16) as f64;
    assert_eq!(numbers(&m, &labels[y]), [prior, 0.0, 0.0], "{}", m.text);

    // 4. An engine that evicted: both workers now hold the prompt by the router's
    //    memory, their engines report nothing cached. Twelve answers with a predicted
    //    hit that delivered nothing: the drift of the worker that served them falls.
    let mut served = [0usize; 2];
    for _ in 0..12 {
        let (r, w) = send_tagged(addr, &ws, chat_with_usage(chat_body(&p, false), (1100, 0))).await;
        assert_eq!(r.status, 200);
        served[w] += 1;
    }
    let z = if served[0] >= served[1] { 0 } else { 1 };
    assert!(served[z] >= 10, "{served:?}");
    let m = scrape(addr).await;
    let [_, predicted_z, delivered_z] = numbers(&m, &labels[z]);
    assert!(
        predicted_z > 4.0 * delivered_z,
        "{predicted_z} vs {delivered_z}"
    );
    let drift = m
        .get(DRIFT, &[("worker", &labels[z])])
        .expect("drift gauge");
    assert!(drift < 0.2, "drift {drift}");
    // Low for less than a minute: not yet flagged.
    assert_eq!(m.get(DRIFT_LOW, &[("worker", &labels[z])]), Some(0.0));
    let workers = get(addr, "/workers").await.json();
    let h = hits(&workers, &labels[z]);
    assert!(h["drift"].as_f64().unwrap() < 0.2, "{h}");
    assert_eq!(h["predicted_tokens"].as_f64().unwrap(), predicted_z, "{h}");
    assert_eq!(h["delivered_tokens"].as_f64().unwrap(), delivered_z, "{h}");
    assert!(h["answers"].as_u64().unwrap() >= served[z] as u64);
    // The pool's summary: the workers' numbers summed, and the shares they make.
    let sum = &workers["hits"];
    let total = |k: &str| -> f64 {
        labels
            .iter()
            .map(|l| hits(&workers, l)[k].as_f64().unwrap())
            .sum()
    };
    for k in [
        "answers",
        "available_tokens",
        "predicted_tokens",
        "delivered_tokens",
    ] {
        assert_eq!(sum[k].as_f64().unwrap(), total(k), "{k}: {sum}");
    }
    let routed = sum["routed_share"].as_f64().unwrap();
    assert_eq!(
        routed,
        total("predicted_tokens") / total("available_tokens")
    );
    assert!(sum["delivered_share"].as_f64().unwrap() < 0.5, "{sum}");
}

/// vLLM started without `--enable-prompt-tokens-details` names no cached tokens: its
/// answers are left out of the numbers (delivered unknown, not 0), so warm hits on it
/// show no drift; once it has named a count, an answer without one is delivered 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_never_names_cached_tokens_shows_no_drift() {
    let (_hold, [a, b], yaml) = usage_engines("", "").await;
    let router = start_router(&yaml).await;
    let ws = [&a, &b];
    let addr = router.addr;
    let labels = [worker_label(addr, 0).await, worker_label(addr, 1).await];
    let p = prompt();
    let quiet = |body: String| chat_with_usage(body, (1100, 0)).header("x-no-details", "1");
    let (_, x) = send_tagged(addr, &ws, quiet(chat_body(&p, false))).await;
    for stream in [
        false, true, false, true, false, false, false, false, false, false, false, false,
    ] {
        let (r, w) = send_tagged(addr, &ws, quiet(chat_body(&p, stream))).await;
        assert_eq!((r.status, w), (200, x), "warm hits stay on the holder");
    }
    let m = scrape(addr).await;
    assert_eq!(numbers(&m, &labels[x]), [0.0, 0.0, 0.0], "{}", m.text);
    assert_eq!(m.get(DRIFT, &[("worker", &labels[x])]), None);
    let h = hits(&get(addr, "/workers").await.json(), &labels[x]);
    assert_eq!(h["answers"].as_u64(), Some(0), "{h}");

    // It names a count once (a hit with the flag on); from then a missing one is 0.
    let (_, w) = send_tagged(
        addr,
        &ws,
        chat_with_usage(chat_body(&p, false), (1100, 1024)),
    )
    .await;
    assert_eq!(w, x);
    let (_, w) = send_tagged(addr, &ws, quiet(chat_body(&p, false))).await;
    assert_eq!(w, x);
    let m = scrape(addr).await;
    let [_, predicted, delivered] = numbers(&m, &labels[x]);
    assert!(predicted > 0.0, "{}", m.text);
    assert_eq!(delivered, 1024.0, "the second answer delivered 0");
    let h = hits(&get(addr, "/workers").await.json(), &labels[x]);
    assert_eq!(h["answers"].as_u64(), Some(2), "{h}");
}
/// The drift warning, as an operator sees it: the built binary, engines that keep
/// reporting nothing cached where the router predicts hits, and `cache.drift_secs`
/// short enough for a test. The warning names the worker; the metric flags it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drift_warning_fires_when_an_engine_keeps_delivering_nothing() {
    let hold = Gate::new();
    let a = FakeWorker::start_with(usage_engine(hold.clone())).await;
    let b = FakeWorker::start_with(usage_engine(hold)).await;
    let config = TempFile::new(
        "drift.yaml",
        &yaml_for(
            &[&a, &b],
            "server: {host: 127.0.0.1, port: 0}\nlog: {format: json, level: \"warn,cache_aware_router=info\"}\nproxy: {max_retries: 0}\ncache:\n  balance_abs_threshold: 0\n  balance_rel_threshold: 1.0\n  drift_secs: 0.3\n",
        ),
    );
    let router = crate::BINARY.serve(&[&config.path]);
    let ws = [&a, &b];
    let p = prompt();
    let mut round = 0;
    let mut served = |n: usize| {
        let qs: Vec<String> = (round..round + n)
            .map(|i| format!("conversation {i}: {p}"))
            .collect();
        round += n;
        qs
    };
    // New prompts, each served and then repeated: every repeat was predicted as a hit
    // and delivered nothing.
    for q in served(24) {
        for _ in 0..2 {
            let (r, _) = send_tagged(
                router.addr,
                &ws,
                chat_with_usage(chat_body(&q, false), (1100, 0)),
            )
            .await;
            assert_eq!(r.status, 200);
        }
    }
    // The drift stays under the floor while new repeats deliver nothing: an answer
    // after `cache.drift_secs` (0.3 s) of that logs the warning.
    let warned = || -> Vec<serde_json::Value> {
        router
            .lines()
            .iter()
            .filter_map(|(_, l)| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| {
                v["fields"]["message"].as_str().is_some_and(|m| {
                    m.contains("fewer cached prefix tokens than the router predicts")
                })
            })
            .collect()
    };
    let started = std::time::Instant::now();
    while warned().is_empty() {
        assert!(
            started.elapsed() < STEP_TIMEOUT,
            "no drift warning; output: {}",
            router.output()
        );
        for q in served(1) {
            for _ in 0..2 {
                send_tagged(
                    router.addr,
                    &ws,
                    chat_with_usage(chat_body(&q, false), (1100, 0)),
                )
                .await;
            }
        }
    }
    let warned = warned();
    let named = warned[0]["fields"]["worker"].as_str().unwrap().to_owned();
    assert!(
        [a.url(), b.url()]
            .iter()
            .any(|u| u.trim_end_matches('/') == named),
        "{named}"
    );
    let m = scrape(router.addr).await;
    assert_eq!(
        m.get(DRIFT_LOW, &[("worker", &named)]),
        Some(1.0),
        "{}",
        m.text
    );
}

/// With `cache.learn_evictions` on, an answer that delivers far less than predicted
/// tells the router how far back the worker's engine evicts: its records last used
/// before that prefix go (an age-out sweep off the request path), and the prefix
/// itself — recomputed by that very request — stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_delivery_ages_out_the_workers_older_records() {
    const AGED: &str = "cache_aware_router_tree_aged_out_bytes_total";
    let (_hold, [a, b], yaml) = usage_engines("  learn_evictions: true\n", "").await;
    let router = start_router(&yaml).await;
    let ws = [&a, &b];
    let addr = router.addr;
    let labels = [worker_label(addr, 0).await, worker_label(addr, 1).await];
    let system = prompt();
    let ask = |q: &str, cached: u64| {
        chat_with_usage(chat_body(&format!("{system}{q}"), false), (1100, cached))
    };
    let long_q = |n: usize| {
        format!(
            " question {n}: {}",
            "explain the next step in detail. ".repeat(40)
        )
    };
    // Three conversations on one worker (each a hit on the shared system prompt).
    let (_, x) = send_tagged(addr, &ws, ask(&long_q(1), 0)).await;
    for n in [2, 3] {
        let (_, w) = send_tagged(addr, &ws, ask(&long_q(n), 1024)).await;
        assert_eq!(w, x);
    }
    let m = scrape(addr).await;
    assert_eq!(m.get(AGED, &[]), Some(0.0), "{}", m.text);
    // Conversation 3 again: its engine had evicted it (delivered 0 of ~1,300).
    let (_, w) = send_tagged(addr, &ws, ask(&long_q(3), 0)).await;
    assert_eq!(w, x);
    let h = hits(&get(addr, "/workers").await.json(), &labels[x]);
    assert_eq!(h["shortfalls"].as_u64(), Some(1), "{h}");
    // The sweep removes conversations 1 and 2's own parts (last used before 3's); it
    // runs off the request path, about once a second.
    wait_until("the age-out sweep", STEP_TIMEOUT, || async {
        scrape(addr).await.get(AGED, &[]).unwrap_or(0.0) > 0.0
    })
    .await;
    let aged = scrape(addr).await.get(AGED, &[]).unwrap_or(0.0);
    let tail = long_q(1).len() - " question ".len();
    assert!(
        aged >= (2 * tail) as f64,
        "aged out {aged} bytes, tails {tail}"
    );
    let predicted = |m: &Scrape| numbers(m, &labels[x])[1];
    // Conversation 3, recomputed by the short answer, is still a full hit.
    let before = predicted(&scrape(addr).await);
    send_tagged(addr, &ws, ask(&long_q(3), 1024)).await;
    let got3 = predicted(&scrape(addr).await) - before;
    // Conversation 1 on x now matches only the system prompt: predicted accordingly.
    let before = predicted(&scrape(addr).await);
    let (_, w) = send_tagged(addr, &ws, ask(&long_q(1), 1024)).await;
    assert_eq!(w, x);
    let got1 = predicted(&scrape(addr).await) - before;
    assert!(got1 < got3 * 0.9, "predicted {got1} for 1, {got3} for 3");
    // What x kept is its learned capacity.
    let w = &get(addr, "/workers").await.json()["workers"];
    let cap = w
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["url"] == labels[x])
        .unwrap()["tree_capacity_bytes"]
        .as_u64();
    assert!(cap.is_some_and(|c| c as usize >= system.len()), "{w}");
}

/// By default (`cache.learn_evictions` off) a short answer is counted and shown, and
/// the tree keeps every record: the same sequence as above ages out nothing. On paused
/// time: the upkeep task's looks for age-out work (one a virtual second) come at once.
#[tokio::test(start_paused = true)]
async fn by_default_a_short_delivery_is_counted_and_ages_out_nothing() {
    const AGED: &str = "cache_aware_router_tree_aged_out_bytes_total";
    let (_hold, [a, b], yaml) = usage_engines("", "").await;
    let router = start_router(&yaml).await;
    let ws = [&a, &b];
    let addr = router.addr;
    let labels = [worker_label(addr, 0).await, worker_label(addr, 1).await];
    let system = prompt();
    let ask = |q: usize, cached: u64| {
        let q = format!(" question {q}: {}", "explain the next step. ".repeat(40));
        chat_with_usage(chat_body(&format!("{system}{q}"), false), (1100, cached))
    };
    let (_, x) = send_tagged(addr, &ws, ask(1, 0)).await;
    for (q, cached) in [(2, 1024), (3, 1024), (3, 0)] {
        let (_, w) = send_tagged(addr, &ws, ask(q, cached)).await;
        assert_eq!(w, x);
    }
    let h = hits(&get(addr, "/workers").await.json(), &labels[x]);
    assert_eq!(h["shortfalls"].as_u64(), Some(1), "{h}");
    // After the upkeep task's next looks for age-out work (one a second), nothing has
    // gone.
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let m = scrape(addr).await;
    assert_eq!(m.get(AGED, &[]), Some(0.0), "{}", m.text);
    let (_, w) = send_tagged(addr, &ws, ask(1, 1024)).await;
    assert_eq!(w, x);
}

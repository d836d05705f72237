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

    // 4. An engine that evicted: new prompts, each served and then repeated, the
    //    repeat predicted as a hit where the first went and delivering nothing (one
    //    such answer per prompt: a prompt's second makes the router stop predicting it
    //    there, see `undelivered.rs`). The drift of the worker that served the most of
    //    them falls.
    let mut served = [0usize; 2];
    for i in 0..24 {
        let q = format!("conversation {i}: {p}");
        let (r, first) =
            send_tagged(addr, &ws, chat_with_usage(chat_body(&q, false), (1100, 0))).await;
        assert_eq!(r.status, 200);
        let (r, w) = send_tagged(addr, &ws, chat_with_usage(chat_body(&q, false), (1100, 0))).await;
        assert_eq!((r.status, w), (200, first), "the repeat follows its record");
        served[w] += 1;
    }
    let z = if served[0] >= served[1] { 0 } else { 1 };
    assert!(served[z] >= 12, "{served:?}");
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

/// With `cache.learn_evictions` on (the default), a worker whose records its engine
/// keeps failing (delivered ÷ predicted under 0.95) tells the router how far back the
/// engine evicts: two short answers confirm it, and its records last used before the
/// older of the two lost prefixes go (an age-out sweep off the request path); what was
/// used since — the prefixes those requests recomputed included — stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_answers_from_an_engine_that_evicts_age_out_the_workers_older_records() {
    const AGED: &str = "cache_aware_router_tree_aged_out_bytes_total";
    let hold = Gate::new();
    let a = FakeWorker::start_with(usage_engine(hold)).await;
    let yaml = yaml_for(
        &[&a],
        "cache:\n  learn_evictions: true\nproxy:\n  max_retries: 0\n",
    );
    let router = start_router(&yaml).await;
    let ws = [&a];
    let addr = router.addr;
    let label = worker_label(addr, 0).await;
    let conversation = |n: usize| {
        chat_body(
            &format!(
                "conversation {n}: {}",
                "explain the next step in detail. ".repeat(40)
            ),
            false,
        )
    };
    // Twelve conversations, each sent and then repeated; the engine had evicted each
    // by its repeat (delivered 0 of ~300 predicted tokens).
    for n in 1..=12 {
        for _ in 0..2 {
            send_tagged(addr, &ws, chat_with_usage(conversation(n), (330, 0))).await;
        }
    }
    let h = hits(&get(addr, "/workers").await.json(), &label);
    assert_eq!(h["shortfalls"].as_u64(), Some(12), "{h}");
    // From the tenth repeat the worker's records are measurably not borne out; the
    // eleventh confirms the tenth: records last used before conversation 10 was first
    // sent (conversations 1–9) go, in a sweep about once a second.
    wait_until("the age-out sweep", STEP_TIMEOUT, || async {
        scrape(addr).await.get(AGED, &[]).unwrap_or(0.0) > 0.0
    })
    .await;
    let aged = scrape(addr).await.get(AGED, &[]).unwrap_or(0.0);
    let one = conversation(1).len() as f64 / 2.0;
    assert!(aged >= 9.0 * one, "aged out {aged} bytes");
    let predicted = |m: &Scrape| numbers(m, &label)[1];
    // Conversation 12 is still a hit; conversation 1 is gone.
    let before = predicted(&scrape(addr).await);
    send_tagged(addr, &ws, chat_with_usage(conversation(12), (330, 320))).await;
    assert!(predicted(&scrape(addr).await) > before);
    let before = predicted(&scrape(addr).await);
    send_tagged(addr, &ws, chat_with_usage(conversation(1), (330, 0))).await;
    assert_eq!(
        predicted(&scrape(addr).await),
        before,
        "no prediction left for 1"
    );
    // What the worker kept is its learned capacity.
    let w = &get(addr, "/workers").await.json()["workers"];
    assert!(w[0]["tree_capacity_bytes"].as_u64().is_some(), "{w}");
}

/// One short answer is one record, not an engine that evicts (that takes two, from a
/// worker whose records are not borne out overall): it is counted and shown, and the
/// tree keeps every record. On paused time: the upkeep task's looks for age-out work
/// (one a virtual second) come at once.
#[tokio::test(start_paused = true)]
async fn one_short_answer_ages_out_nothing() {
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

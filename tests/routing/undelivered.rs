//! A worker whose cache never delivers (issue 40, item 7): its engine answers every
//! repeat of a prompt with no cached tokens (prefix caching off, another model behind
//! its URL, a chat template that differs), so after a few such answers the router stops
//! believing its record of that prompt and sends the prompt where it is served from
//! cache; the worker still gets new prompts when it is the least loaded.

use std::time::Duration;

use support::{client::*, config::*, engine::*, observe::*, wait::*, worker::*};

use crate::common::start_router;

fn prompt(tag: &str) -> String {
    let mut p = format!("{tag}: ");
    while p.len() < 4096 {
        p.push_str("Summarise the attached report and list its three main findings. ");
    }
    p
}

/// An engine that caches nothing: every answer names its prompt tokens (from
/// `x-usage`, as [`usage_engine`] reads it) and `cached_tokens: 0`.
fn uncached_engine(req: &Recorded) -> Reply {
    let prompt: u64 = req
        .header("x-usage")
        .and_then(|v| v.split_once(','))
        .map_or(0, |(p, _)| p.parse().unwrap());
    Reply::json(
        200,
        &format!(
            r#"{{"id":"chatcmpl-1","object":"chat.completion","choices":[{{"index":0,"message":{{"role":"assistant","content":"ok"}},"finish_reason":"stop"}}],"usage":{}}}"#,
            usage_json(prompt, 0)
        ),
    )
}

/// Answers the router has counted for its workers (`/workers`), to wait until the
/// last answer's usage was settled before the next request is routed.
async fn answers(addr: std::net::SocketAddr) -> u64 {
    get_workers(addr).await["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["hits"]["answers"].as_u64().unwrap_or(0))
        .sum()
}

/// Sends `body` (asking the engines to report 1,088 of its 1,100 tokens cached, which
/// the uncached engine ignores) and waits until the router has settled its answer;
/// returns which worker served it.
async fn send_settled(addr: std::net::SocketAddr, ws: &[&FakeWorker], body: String) -> usize {
    let before = answers(addr).await;
    let (r, w) = send_tagged(addr, ws, chat_with_usage(body, (1100, 1088))).await;
    assert_eq!(r.status, 200);
    wait_until("the answer is settled", Duration::from_secs(5), || async {
        answers(addr).await > before
    })
    .await;
    w
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_is_not_pinned_to_a_worker_whose_cache_never_delivers_it() {
    let hold = Gate::new();
    let off = FakeWorker::start_with(uncached_engine).await;
    let on = FakeWorker::start_with(usage_engine(hold.clone())).await;
    let yaml = yaml_for(
        &[&off, &on],
        "cache:\n  balance_abs_threshold: 0\n  balance_rel_threshold: 1.0\nproxy:\n  max_retries: 0\n",
    );
    let router = start_router(&yaml).await;
    let addr = router.addr;
    let ws = [&off, &on];
    let label = worker_label(addr, 0).await;

    // New prompts go to the least-loaded worker, ties split by the prompt: the first
    // that lands on the uncached worker is the one it will be asked to repeat.
    let mut first = None;
    for i in 0..16 {
        let p = prompt(&format!("report {i}"));
        if send_settled(addr, &ws, chat_body(&p, false)).await == 0 {
            first = Some(p);
            break;
        }
    }
    let p = first.expect("some new prompt went to the uncached worker");

    // Twelve repeats: predicted there, delivered nothing, twice in a row; from then on
    // the prompt goes to the other worker (and stays there: it delivers).
    let mut by = Vec::new();
    for _ in 0..12 {
        by.push(send_settled(addr, &ws, chat_body(&p, false)).await);
    }
    let last_ten = &by[by.len() - 10..];
    let on_off = last_ten.iter().filter(|w| **w == 0).count();
    assert!(
        on_off <= 3,
        "the uncached worker got {on_off} of the last 10: {by:?}"
    );
    assert_eq!(
        &by[..2],
        &[0, 0],
        "two short answers before it is disbelieved: {by:?}"
    );
    assert!(
        by[2..].iter().all(|w| *w == 1),
        "then the other worker: {by:?}"
    );
    let m = scrape(addr).await;
    assert_eq!(
        m.get("cache_aware_router_tree_disbelieved_records_total", &[]),
        Some(1.0),
        "{}",
        m.text
    );

    // A new prompt still goes there when it is the least loaded: the other worker is
    // busy with a held stream (of the repeated prompt, which goes there).
    let (mut held, w) = hold_stream(
        addr,
        &ws,
        chat_with_usage(chat_body(&p, true), (1100, 1088)),
    )
    .await;
    assert_eq!(w, 1);
    let fresh = prompt("a new report");
    assert_eq!(send_settled(addr, &ws, chat_body(&fresh, false)).await, 0);
    hold.open();
    held.read_rest().await;
    // And the router's numbers for it show the two short answers, nothing after.
    let workers = get_workers(addr).await;
    let hits = workers["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["url"] == label.as_str())
        .unwrap()["hits"]
        .clone();
    assert_eq!(hits["shortfalls"].as_u64(), Some(2), "{hits}");
}

//! Disaggregated pools (vLLM NIXL): two scripted prefill and two scripted decode engines
//! sharing a hand-off registry (`support::pd`). Each request makes one prefill call
//! shaped for the hand-off and one decode call carrying it byte for byte; prefix-sharing
//! requests stay on one prefill worker while decode load stays even; in-flight comes
//! back to 0 after streams cut by their clients; each failure has its outcome and its
//! counter; bypasses are counted by reason; the decode stream is not buffered.

use std::time::Duration;

use serde_json::Value;
use support::pd::*;
use support::{client::*, observe::*, wait::*, worker::*};

use crate::common::start_router;
use support::binary::Stream;

const SHOW_PEERS: &str = "proxy:\n  add_routed_peer_header: true\n";

/// The JSON of `r`'s body.
fn body_json(r: &Recorded) -> Value {
    serde_json::from_slice(&r.body).unwrap()
}

/// `client`'s body with `,"kv_transfer_params":params` before its closing brace.
fn plus_params(client: &str, params: &str) -> String {
    let close = client.rfind('}').unwrap();
    format!(
        "{},\"kv_transfer_params\":{}{}",
        &client[..close],
        params,
        &client[close..]
    )
}

/// The `kv_transfer_params` bytes `prefill` wrote in its answer to request `index`.
fn written_params(prefill: &FakeWorker, index: usize) -> String {
    let written: Vec<u8> = prefill
        .writes(index)
        .into_iter()
        .flat_map(|(_, d)| d)
        .collect();
    let text = String::from_utf8(written).unwrap();
    let (_, rest) = text.split_once("\"kv_transfer_params\": ").unwrap();
    rest[..rest.len() - 1].to_string()
}

/// `pd_leg_failures_total{leg, cause}` in a scrape.
fn leg_failures(m: &Scrape, leg: &str, cause: &str) -> f64 {
    m.value(
        "cache_aware_router_pd_leg_failures_total",
        &[("leg", leg), ("cause", cause)],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_request_makes_one_prefill_call_for_the_hand_off_and_one_decode_call_carrying_it() {
    let f = PdFleet::serving(SHOW_PEERS).await;
    let router = start_router(&f.yaml).await;
    let workers = get_workers(router.addr).await;
    let phases: Vec<&str> = workers["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["phase"].as_str().unwrap())
        .collect();
    assert_eq!(phases, ["prefill", "prefill", "decode", "decode"]);
    assert_eq!(workers["pools"][0]["prefill_policy"], "cache_aware");
    assert_eq!(workers["pools"][0]["decode_policy"], "least_load");

    let chat = |stream: bool| {
        serde_json::json!({"model": "m", "stream": stream, "max_tokens": 64, "min_tokens": 2,
            "stream_options": if stream { serde_json::json!({"include_usage": true}) } else { Value::Null },
            "messages": [{"role": "user", "content": format!("tell me a story (stream {stream})")}]})
        .to_string()
    };
    let completion = |stream: bool| {
        serde_json::json!({"model": "m", "stream": stream, "max_tokens": 16, "n": 1,
            "prompt": format!("once upon a time (stream {stream})")})
        .to_string()
    };
    let mut cases = Vec::new();
    for stream in [false, true] {
        cases.push(("/v1/chat/completions", chat(stream), stream));
        cases.push(("/v1/completions", completion(stream), stream));
    }
    cases.push((
        "/v1/responses",
        r#"{"model":"m","input":"a response","max_output_tokens":20}"#.to_string(),
        false,
    ));
    for (i, (path, client, stream)) in cases.iter().enumerate() {
        let req = Req::post(path, client.as_str()).header("x-prefill-cached", "7");
        let resp = send(router.addr, &req).await;
        assert_eq!(resp.status, 200, "{path}: {}", resp.text());
        let (p, d) = (f.prefill_calls(), f.decode_calls());
        assert_eq!(
            (p.len(), d.len()),
            (i + 1, i + 1),
            "{path}: one call per leg"
        );
        let (p, d) = (
            &p.iter().max_by_key(|r| r.at).unwrap(),
            d.iter().max_by_key(|r| r.at).unwrap(),
        );
        assert_eq!(p.target, *path);
        // The prefill leg: capped at one token, not streamed, asking for a hand-off.
        let pb = body_json(p);
        let cap = if *path == "/v1/responses" {
            "max_output_tokens"
        } else {
            "max_tokens"
        };
        assert_eq!(pb[cap], 1, "{path}: {pb}");
        assert_eq!(pb["stream"], false);
        assert!(
            pb.get("stream_options").is_none() && pb.get("min_tokens").is_none(),
            "{pb}"
        );
        assert_eq!(
            pb["kv_transfer_params"],
            serde_json::json!({"do_remote_decode": true, "do_remote_prefill": false})
        );
        if *path != "/v1/responses" {
            assert_eq!(pb["n"], 1);
        }
        // The decode leg: the client's body plus the prefill's params, byte for byte.
        let prefill = f
            .prefill
            .iter()
            .find(|w| w.requests().iter().any(|r| r.at == p.at))
            .unwrap();
        let params = written_params(prefill, p.index);
        assert_eq!(
            String::from_utf8_lossy(&d.body),
            plus_params(client, &params),
            "{path}"
        );
        assert!(f.handoffs.by_params(&params).unwrap().read_by.is_some());
        // One request id on both legs and in the answer.
        let id = resp.header("x-request-id").unwrap();
        assert_eq!(
            (p.header("x-request-id"), d.header("x-request-id")),
            (Some(id), Some(id))
        );
        // What the client sees names both legs.
        assert_eq!(
            resp.header("x-routed-prefill"),
            Some(prefill.url().as_str())
        );
        let decoder = f
            .decode
            .iter()
            .find(|w| w.requests().iter().any(|r| r.at == d.at))
            .unwrap();
        assert_eq!(resp.header("x-routed-peer"), Some(decoder.url().as_str()));
        // The usage reports the prefill's cached tokens, not the decode's transfer.
        let usage = if *stream {
            let text = resp.text();
            let line = text
                .lines()
                .find(|l| l.contains("\"usage\""))
                .unwrap()
                .to_string();
            serde_json::from_str::<Value>(line.trim_start_matches("data: ")).unwrap()["usage"]
                .clone()
        } else {
            resp.json()["usage"].clone()
        };
        assert_eq!(
            usage["prompt_tokens_details"]["cached_tokens"], 7,
            "{path}: {usage}"
        );
        assert!(
            !resp.has_header("content-length") || *stream,
            "rewritten: its length unknown"
        );
    }
    let m = scrape(router.addr).await;
    assert_eq!(
        m.value(
            "cache_aware_router_pd_requests_total",
            &[("path", "disaggregated")]
        ),
        cases.len() as f64
    );
    assert_eq!(f.handoffs.unread(), 0, "every hand-off read");
    wait_all_idle(router.addr, Duration::from_secs(3)).await;
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_sharing_requests_stay_on_one_prefill_worker_while_decode_load_stays_even() {
    let f = PdFleet::serving("").await;
    let router = start_router(&f.yaml).await;
    let prefix = "You are a careful assistant. ".repeat(60);
    let n = 40;
    let mut held = Vec::new();
    for i in 0..n {
        let body = serde_json::json!({"model": "m", "stream": true,
            "messages": [{"role": "user", "content": format!("{prefix} question {i}")}]})
        .to_string();
        // Each stream stays open (the decode engine waits on the gate before its end):
        // the decode load builds up while the prefill slots come back.
        let mut c = Conn::connect(router.addr).await;
        c.send(&Req::post("/v1/chat/completions", body).header("x-decode-hold", "1"))
            .await
            .unwrap();
        assert_eq!(c.read_head().await.status, 200);
        c.next_piece().await.expect("first event");
        held.push(c);
    }
    let counts: Vec<usize> = f.prefill.iter().map(|w| w.count()).collect();
    assert!(
        counts.iter().max().copied().unwrap() * 100 >= n * 95,
        "prefill calls per worker: {counts:?}"
    );
    let loads = in_flight(router.addr).await;
    assert_eq!(
        &loads[..2],
        [0, 0],
        "prefill slots end with the prefill answer: {loads:?}"
    );
    let (hi, lo) = (loads[2].max(loads[3]), loads[2].min(loads[3]));
    assert!(
        lo > 0 && hi as f64 / lo as f64 <= 1.5,
        "decode in flight: {loads:?}"
    );
    f.hold.open();
    for mut c in held {
        let _ = c.read_rest().await;
    }
    wait_all_idle(router.addr, Duration::from_secs(5)).await;
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_returns_to_zero_on_both_sides_after_many_streams_a_third_cut_by_their_clients() {
    let f = PdFleet::serving("").await;
    let router = start_router(&f.yaml).await;
    let addr = router.addr;
    let total: usize = 1000;
    let mut tasks = tokio::task::JoinSet::new();
    let limit = std::sync::Arc::new(tokio::sync::Semaphore::new(32));
    for i in 0..total {
        let permit = std::sync::Arc::clone(&limit).acquire_owned().await.unwrap();
        tasks.spawn(async move {
            let _permit = permit;
            let body = serde_json::json!({"model": "m", "stream": true,
                "messages": [{"role": "user", "content": format!("shared head; stream {}", i % 50)}]})
            .to_string();
            let req = Req::post("/v1/chat/completions", body).header("x-decode-gap-ms", "2");
            let mut c = Conn::connect(addr).await;
            c.send(&req).await.unwrap();
            // A third leave: before any answer, after the head, after the first event.
            match (i % 3 == 0, (i / 3) % 3) {
                (true, 0) => tokio::task::yield_now().await,
                (true, 1) => {
                    c.read_head().await;
                }
                (true, _) => {
                    c.read_head().await;
                    c.next_piece().await;
                }
                (false, _) => {
                    assert_eq!(c.read_head().await.status, 200);
                    let rest = String::from_utf8(c.read_rest().await).unwrap();
                    assert!(rest.ends_with("data: [DONE]\n\n"), "{rest}");
                }
            }
        });
    }
    while let Some(t) = tasks.join_next().await {
        t.unwrap();
    }
    wait_all_idle(addr, Duration::from_secs(10)).await;
    let completed = total - total.div_ceil(3);
    assert!(f.decode_calls().len() >= completed && f.prefill_calls().len() >= completed);
    router.shutdown().await;
}

/// The fleet with `prefill` and `decode` scripts behind a router with `extra`.
async fn fleet(
    prefill: [PrefillScript; 2],
    decode: [DecodeScript; 2],
    extra: &str,
) -> (PdFleet, cache_aware_router::app::RunningRouter) {
    let f = PdFleet::start(prefill, decode, extra).await;
    let router = start_router(&f.yaml).await;
    (f, router)
}

fn chat_req(text: &str) -> Req {
    Req::post("/v1/chat/completions", chat_body(text, false))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_4xx_is_the_clients_answer_and_no_decode_call_is_made() {
    use PrefillScript::Status;
    let (f, router) = fleet(
        [Status(400), Status(400)],
        [DecodeScript::Serve, DecodeScript::Serve],
        "",
    )
    .await;
    let resp = send(router.addr, &chat_req("too long a prompt")).await;
    assert_eq!(resp.status, 400);
    assert_eq!(resp.json()["error"]["message"], "prefill says 400");
    assert_eq!((f.prefill_calls().len(), f.decode_calls().len()), (1, 0));
    let m = scrape(router.addr).await;
    assert_eq!(leg_failures(&m, "prefill", "status_4xx"), 1.0);
    wait_all_idle(router.addr, Duration::from_secs(3)).await;
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_5xx_is_retried_on_the_other_prefill_worker() {
    let (f, router) = fleet(
        [PrefillScript::Status(503), PrefillScript::Status(503)],
        [DecodeScript::Serve, DecodeScript::Serve],
        "",
    )
    .await;
    // Both fail: two prefill calls, then the decode worker computes (decode_only).
    let resp = send(router.addr, &chat_req("both prefill workers fail")).await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(
        f.prefill.iter().map(|w| w.count()).collect::<Vec<_>>(),
        [1, 1]
    );
    let d = f.decode_calls();
    assert_eq!(d.len(), 1);
    assert_eq!(
        String::from_utf8_lossy(&d[0].body),
        chat_body("both prefill workers fail", false),
        "no hand-off: the client's body"
    );
    let m = scrape(router.addr).await;
    assert_eq!(leg_failures(&m, "prefill", "status_5xx"), 2.0);
    assert_eq!(
        m.value("cache_aware_router_pd_prefill_fallbacks_total", &[]),
        1.0
    );
    assert_eq!(
        m.value(
            "cache_aware_router_pd_requests_total",
            &[("path", "decode_only")]
        ),
        1.0
    );
    router.shutdown().await;

    // One fails, the other serves: the hand-off is its.
    let f = PdFleet::start(
        [PrefillScript::Status(500), PrefillScript::Handoff],
        [DecodeScript::Serve, DecodeScript::Serve],
        "",
    )
    .await;
    let router = start_router(&f.yaml).await;
    for i in 0..4 {
        let resp = send(
            router.addr,
            &chat_req(&format!("one prefill worker fails {i}")),
        )
        .await;
        assert_eq!(resp.status, 200, "{}", resp.text());
    }
    let ok = f.prefill[1].count();
    assert_eq!(ok, 4, "every request ends on the serving prefill worker");
    assert_eq!(f.decode_calls().len(), 4);
    assert_eq!(f.handoffs.unread(), 0);
    let m = scrape(router.addr).await;
    let failed = leg_failures(&m, "prefill", "status_5xx");
    assert_eq!(failed, f.prefill[0].count() as f64);
    assert_eq!(
        m.value(
            "cache_aware_router_pd_requests_total",
            &[("path", "disaggregated")]
        ),
        4.0
    );
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_prefill_workers_go_decode_only_or_fail_as_configured() {
    use PrefillScript::Reset;
    let serve = [DecodeScript::Serve, DecodeScript::Serve];
    let (f, router) = fleet([Reset, Reset], serve.clone(), "").await;
    let resp = send(router.addr, &chat_req("nobody prefills")).await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    // Each tried (a connection that closes unanswered is sent once more on a new one).
    assert!(f.prefill.iter().all(|w| w.count() >= 1));
    let d = f.decode_calls();
    assert_eq!(d.len(), 1);
    assert_eq!(
        String::from_utf8_lossy(&d[0].body),
        chat_body("nobody prefills", false)
    );
    let m = scrape(router.addr).await;
    let failures = leg_failures(&m, "prefill", "upstream");
    assert_eq!(failures, 2.0, "{}", m.text);
    assert_eq!(
        m.value("cache_aware_router_pd_prefill_fallbacks_total", &[]),
        1.0
    );
    router.shutdown().await;

    let (f, router) = fleet([Reset, Reset], serve, "pd: {on_prefill_failure: error}\n").await;
    let resp = send(router.addr, &chat_req("nobody prefills, strictly")).await;
    assert_eq!(resp.status, 502, "{}", resp.text());
    assert_eq!(resp.json()["error"]["type"], "prefill_failed");
    assert_eq!(f.decode_calls().len(), 0, "no decode call");
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_answer_without_a_hand_off_goes_decode_only_and_is_counted() {
    let (f, router) = fleet(
        [PrefillScript::Eos, PrefillScript::Eos],
        [DecodeScript::Serve, DecodeScript::Serve],
        SHOW_PEERS,
    )
    .await;
    let resp = send(router.addr, &chat_req("stop at once")).await;
    assert_eq!(resp.status, 200);
    let d = f.decode_calls();
    assert_eq!((f.prefill_calls().len(), d.len()), (1, 1));
    assert_eq!(
        String::from_utf8_lossy(&d[0].body),
        chat_body("stop at once", false)
    );
    assert!(resp.has_header("x-routed-prefill"), "the prefill leg ran");
    let m = scrape(router.addr).await;
    assert_eq!(
        m.value("cache_aware_router_pd_missing_handoffs_total", &[]),
        1.0
    );
    assert_eq!(
        m.value(
            "cache_aware_router_pd_requests_total",
            &[("path", "decode_only")]
        ),
        1.0
    );
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_between_the_legs_makes_no_decode_call_and_is_counted() {
    let gate = Gate::new();
    let (f, router) = fleet(
        [
            PrefillScript::Trickle(gate.clone()),
            PrefillScript::Trickle(gate.clone()),
        ],
        [DecodeScript::Serve, DecodeScript::Serve],
        "",
    )
    .await;
    let mut c = Conn::connect(router.addr).await;
    c.send(&chat_req("leaving early")).await.unwrap();
    wait_until(
        "the prefill answer has begun",
        Duration::from_secs(3),
        || async { f.prefill.iter().any(|w| !w.writes(0).is_empty()) },
    )
    .await;
    drop(c);
    wait_until("the abort is counted", Duration::from_secs(3), || async {
        scrape(router.addr)
            .await
            .value("cache_aware_router_pd_aborts_between_legs_total", &[])
            == 1.0
    })
    .await;
    gate.open();
    assert_eq!(f.decode_calls().len(), 0, "no decode call");
    assert_eq!(
        f.handoffs.unread(),
        1,
        "the prefill worker holds it until its lease expires"
    );
    wait_all_idle(router.addr, Duration::from_secs(3)).await;
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_error_is_retried_on_the_other_decode_worker_with_the_same_hand_off() {
    let (f, router) = fleet(
        [PrefillScript::Handoff, PrefillScript::Handoff],
        [DecodeScript::Status(503), DecodeScript::Serve],
        "",
    )
    .await;
    for i in 0..3 {
        let resp = send(router.addr, &chat_req(&format!("decode retried {i}"))).await;
        assert_eq!(resp.status, 200, "{}", resp.text());
    }
    let bad = f.decode[0].requests();
    assert!(!bad.is_empty(), "least_load tried it");
    assert_eq!(f.decode[1].count(), 3);
    for r in &bad {
        let again = f.decode[1]
            .requests()
            .into_iter()
            .find(|g| g.header("x-request-id") == r.header("x-request-id"))
            .unwrap();
        assert_eq!(again.body, r.body, "the same hand-off, sent again");
    }
    assert_eq!(f.prefill_calls().len(), 3, "one prefill leg per request");
    let m = scrape(router.addr).await;
    assert_eq!(leg_failures(&m, "decode", "status_5xx"), bad.len() as f64);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_above_one_and_a_prompt_the_decode_worker_holds_skip_the_prefill_leg() {
    let f = PdFleet::serving("pd: {decode_policy: cache_aware}\n").await;
    let router = start_router(&f.yaml).await;
    let long = "The history of the long prompt, told again. ".repeat(80);
    let body = |suffix: &str, n: u32| {
        serde_json::json!({"model": "m", "n": n, "messages": [{"role": "user", "content": format!("{long}{suffix}")}]})
            .to_string()
    };
    // n > 1: the decode worker computes (and remembers) the prompt.
    let first = body("", 2);
    let resp = send(
        router.addr,
        &Req::post("/v1/chat/completions", first.as_str()),
    )
    .await;
    assert_eq!(resp.status, 200);
    assert_eq!(f.prefill_calls().len(), 0);
    assert_eq!(String::from_utf8_lossy(&f.decode_calls()[0].body), first);
    // The same prompt and a little more: its decode worker holds most of it.
    let resp = send(
        router.addr,
        &Req::post("/v1/chat/completions", body(" And one more line.", 1)),
    )
    .await;
    assert_eq!(resp.status, 200);
    assert_eq!(f.prefill_calls().len(), 0, "no prefill leg");
    let d = f.decode_calls();
    assert_eq!(d.len(), 2);
    assert!(
        f.decode.iter().any(|w| w.count() == 2),
        "the worker holding it"
    );
    // Something new: the prefill leg.
    let resp = send(
        router.addr,
        &Req::post("/v1/chat/completions", chat_body("a fresh question", false)),
    )
    .await;
    assert_eq!(resp.status, 200);
    assert_eq!(f.prefill_calls().len(), 1);
    let m = scrape(router.addr).await;
    let bypass = |reason| {
        m.value(
            "cache_aware_router_pd_bypasses_total",
            &[("reason", reason)],
        )
    };
    assert_eq!((bypass("n"), bypass("uncached")), (1.0, 1.0));
    assert_eq!(
        m.value(
            "cache_aware_router_pd_requests_total",
            &[("path", "bypass")]
        ),
        2.0
    );
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_next_turn_skips_the_prefill_leg_on_the_decode_worker_that_received_its_history() {
    let f = PdFleet::serving("pd: {decode_policy: cache_aware}\n").await;
    let router = start_router(&f.yaml).await;
    let history = "The first turn of a long conversation, told at length. ".repeat(80);
    let turn = |more: &str| {
        serde_json::json!({"model": "m", "messages": [{"role": "user", "content": format!("{history}{more}")}]})
            .to_string()
    };
    // The first turn is handed off: the decode worker reads its KV and keeps it.
    let resp = send(router.addr, &Req::post("/v1/chat/completions", turn(""))).await;
    assert_eq!(resp.status, 200);
    assert_eq!(f.prefill_calls().len(), 1);
    // The next turn: that decode worker holds all but its last words.
    let resp = send(
        router.addr,
        &Req::post("/v1/chat/completions", turn(" And a short follow-up.")),
    )
    .await;
    assert_eq!(resp.status, 200);
    assert_eq!(f.prefill_calls().len(), 1, "no second prefill leg");
    assert!(
        f.decode.iter().any(|w| w.count() == 2),
        "both turns on the decode worker that received the first"
    );
    let usage: Value = serde_json::from_slice(&resp.body).unwrap();
    assert!(
        usage["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() > Some(0),
        "the decode engine served the history from its cache: {usage}"
    );
    let m = scrape(router.addr).await;
    assert_eq!(
        m.value(
            "cache_aware_router_pd_bypasses_total",
            &[("reason", "uncached")]
        ),
        1.0
    );
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_decode_stream_reaches_the_client_as_the_decode_engine_writes_it() {
    let f = PdFleet::serving("").await;
    let router = start_router(&f.yaml).await;
    let req = Req::post("/v1/chat/completions", chat_body("stream it", true))
        .header("x-decode-gap-ms", "150");
    let resp = within("streamed response", send(router.addr, &req)).await;
    assert_eq!(resp.status, 200);
    let decoder = f.decode.iter().find(|w| w.count() == 1).unwrap();
    let writes = decoder.writes(0);
    assert!(
        resp.pieces[0].0 < writes.last().unwrap().0,
        "the first event arrives before the last is written"
    );
    // The token events (the usage chunk after them is rewritten: its length changes).
    assert_relayed_promptly(&writes[..3], &resp.pieces, Duration::from_millis(50));
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_line_span_and_metrics_carry_both_legs() {
    let f =
        PdFleet::serving("server: {host: 127.0.0.1, port: 0}\nlog: {format: json, level: info}\n")
            .await;
    let config = support::config::TempFile::new("router.yaml", &f.yaml);
    let router = crate::BINARY.serve(&[&config.path]);
    let resp = send(router.addr, &chat_req("a logged request")).await;
    assert_eq!(resp.status, 200);
    let line = |r: &support::binary::Running| {
        r.lines()
            .into_iter()
            .filter(|(s, _)| *s == Stream::Stderr)
            .filter_map(|(_, l)| serde_json::from_str::<Value>(&l).ok())
            .find(|v| v["target"] == "cache_aware_router::access")
            .map(|v| v["fields"].clone())
    };
    wait_until("the access line", Duration::from_secs(3), || async {
        line(&router).is_some()
    })
    .await;
    let l = line(&router).unwrap();
    let (p, d) = (&f.prefill_calls()[0], &f.decode_calls()[0]);
    let url = |calls: &[FakeWorker], r: &Recorded| {
        calls
            .iter()
            .find(|w| w.requests().iter().any(|x| x.at == r.at))
            .unwrap()
            .url()
    };
    assert_eq!(l["worker"], url(&f.decode, d), "{l}");
    assert_eq!(l["prefill_worker"], url(&f.prefill, p), "{l}");
    assert_eq!(l["pd"], "disaggregated", "{l}");
    assert!(
        l["prefill_ms"].as_f64().is_some() || l["prefill_ms"].as_str().is_some(),
        "{l}"
    );
    let m = scrape(router.addr).await;
    assert_eq!(
        m.value("cache_aware_router_pd_prefill_duration_seconds_count", &[]),
        1.0
    );
    assert_eq!(
        m.value(
            "cache_aware_router_pd_time_to_first_token_seconds_count",
            &[]
        ),
        1.0
    );
    // One decision per request: the prefill leg's.
    let decisions: f64 = m
        .all("cache_aware_router_routing_decisions_total")
        .iter()
        .map(|s| s.value)
        .sum();
    assert_eq!(decisions, 1.0);
}

/// YAML of an SGLang disaggregated router over `prefill` and `decode` URLs (the first
/// prefill worker with bootstrap port 8998).
fn sglang_yaml(prefill: &[String], decode: &[String]) -> String {
    let mut y = String::from("pd: {connector: sglang}\nproxy: {max_retries: 0}\nworkers:\n");
    for (i, u) in prefill.iter().enumerate() {
        let port = if i == 0 { ", bootstrap_port: 8998" } else { "" };
        y.push_str(&format!("  - {{url: \"{u}\", phase: prefill{port}}}\n"));
    }
    for u in decode {
        y.push_str(&format!("  - {{url: \"{u}\", phase: decode}}\n"));
    }
    y
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_sends_both_legs_at_once_to_meet_in_one_bootstrap_room() {
    let rooms = Rooms::default();
    let p = [
        FakeWorker::start_with(sglang_prefill(rooms.clone())).await,
        FakeWorker::start_with(sglang_prefill(rooms.clone())).await,
    ];
    let d = [
        FakeWorker::start_with(sglang_decode(rooms.clone())).await,
        FakeWorker::start_with(sglang_decode(rooms.clone())).await,
    ];
    let urls = |ws: &[FakeWorker]| ws.iter().map(|w| w.url()).collect::<Vec<_>>();
    let router = start_router(&sglang_yaml(&urls(&p), &urls(&d))).await;
    for (i, stream) in [false, true, false, true].into_iter().enumerate() {
        let client = chat_body(&format!("meet me {i}"), stream);
        let resp = send(
            router.addr,
            &Req::post("/v1/chat/completions", client.as_str()),
        )
        .await;
        assert_eq!(resp.status, 200, "{}", resp.text());
        let last = |ws: &[FakeWorker]| {
            let all: Vec<Recorded> = ws.iter().flat_map(|w| w.requests()).collect();
            assert_eq!(all.len(), i + 1, "one call per leg");
            let r = all.into_iter().max_by_key(|r| r.at).unwrap();
            let prefill_port = ws
                .iter()
                .position(|w| w.requests().iter().any(|x| x.at == r.at));
            (body_json(&r), prefill_port)
        };
        let ((pb, pi), (db, _)) = (last(&p), last(&d));
        assert_eq!(pb, db, "the same body to both legs");
        assert_eq!(pb["bootstrap_host"], "127.0.0.1");
        let port = if pi == Some(0) {
            Value::from(8998)
        } else {
            Value::Null
        };
        assert_eq!(pb["bootstrap_port"], port);
        assert!(pb["bootstrap_room"].as_u64().is_some_and(|r| r < 1 << 63));
        let mut c: Value = serde_json::from_str(&client).unwrap();
        for k in ["bootstrap_host", "bootstrap_port", "bootstrap_room"] {
            c[k] = pb[k].clone();
        }
        assert_eq!(db, c, "the client's body plus the bootstrap fields");
        if stream {
            assert!(resp.text().starts_with("data: "), "the decode answer");
        }
    }
    wait_all_idle(router.addr, Duration::from_secs(3)).await;
    router.shutdown().await;
}

/// Waits for the connection a silent engine reports closed; it must close within 1 s
/// of `sent`.
async fn closes_within_a_second(
    what: &str,
    sent: std::time::Instant,
    closed: &mut tokio::sync::mpsc::UnboundedReceiver<std::time::Instant>,
) {
    let at = within(what, closed.recv()).await.unwrap();
    let after = at.duration_since(sent);
    assert!(
        after < Duration::from_secs(1),
        "{what} closed after {after:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_a_legs_connection_error_ends_the_other_leg_within_a_second() {
    // The prefill leg breaks (its connection closes unanswered after 200 ms, once the
    // other leg is surely sent): the decode leg, waiting for its rendezvous, is cancelled.
    let broken =
        FakeWorker::start_with(|_| Reply::raw(vec![Step::Sleep(Duration::from_millis(200))])).await;
    let (decode, mut closed) = silent_worker().await;
    let router = start_router(&sglang_yaml(&[broken.url()], &[decode])).await;
    let sent = std::time::Instant::now();
    let resp = send(router.addr, &chat_req("a broken prefill")).await;
    assert_eq!(resp.status, 502, "{}", resp.text());
    assert_eq!(resp.json()["error"]["type"], "prefill_failed");
    closes_within_a_second("the decode connection", sent, &mut closed).await;
    let m = scrape(router.addr).await;
    assert_eq!(leg_failures(&m, "prefill", "upstream"), 1.0);
    router.shutdown().await;

    // The decode leg breaks: the prefill leg is cancelled.
    let (prefill, mut closed) = silent_worker().await;
    let router = start_router(&sglang_yaml(&[prefill], &[broken.url()])).await;
    let sent = std::time::Instant::now();
    let resp = send(router.addr, &chat_req("a broken decode")).await;
    assert_eq!(resp.status, 502, "{}", resp.text());
    closes_within_a_second("the prefill connection", sent, &mut closed).await;
    let m = scrape(router.addr).await;
    assert_eq!(leg_failures(&m, "decode", "upstream"), 1.0);
    wait_all_idle(router.addr, Duration::from_secs(3)).await;
    router.shutdown().await;
}

//! Stream continuation (`migration:`): a worker that breaks a streamed answer after
//! bytes reached the client, and what the client reads — one well-formed stream, its
//! text as if nothing broke; or, when the answer cannot continue, an error event.

use std::time::Duration;

use support::story::{Script, read, story, story_engine};
use support::{client::*, config::*, observe::*, wait::*, worker::*};

use crate::common::start_router;

const MIGRATIONS: &str = "cache_aware_router_stream_migrations_total";
const REFUSALS: &str = "cache_aware_router_stream_migration_refusals_total";

/// Two story engines, the first (`a`) misbehaving as `first` says, and a router in front
/// that sends the first request to `a` (round robin) and never retries before headers;
/// `extra`: more YAML.
async fn pair(first: Script, extra: &str) -> (FakeWorker, FakeWorker, String) {
    let a = FakeWorker::start_with(story_engine(Script { name: "a", ..first })).await;
    let b = FakeWorker::start_with(story_engine(Script {
        name: "b",
        cached: 5,
        ..Script::default()
    }))
    .await;
    let yaml = yaml_for(&[&a, &b], &format!("policy: round_robin\n{extra}"));
    (a, b, yaml)
}

fn chat(tokens: usize, more: serde_json::Value) -> Req {
    let mut body = serde_json::json!({
        "model": "m",
        "stream": true,
        "stream_options": {"include_usage": true},
        "max_tokens": tokens,
        "messages": [{"role": "user", "content": "count for me please"}],
    });
    if let (Some(b), Some(m)) = (body.as_object_mut(), more.as_object()) {
        b.extend(m.clone());
    }
    Req::post("/v1/chat/completions", body.to_string())
}

/// Sends `req` and reads its streamed answer to its end: the body, and whether it was
/// cut (ended by an error, not by its last chunk).
async fn streamed(addr: std::net::SocketAddr, req: &Req) -> (Vec<u8>, bool) {
    let mut conn = Conn::connect(addr).await;
    conn.send(req).await.unwrap();
    assert_eq!(conn.read_head().await.status, 200);
    let mut body = Vec::new();
    loop {
        match within("the stream", conn.try_next_piece()).await {
            Ok(Some(p)) => body.extend_from_slice(&p),
            Ok(None) => return (body, false),
            Err(_) => return (body, true),
        }
    }
}

async fn migrations(addr: std::net::SocketAddr, cause: &str, outcome: &str) -> f64 {
    scrape(addr)
        .await
        .value(MIGRATIONS, &[("cause", cause), ("outcome", outcome)])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_dies_mid_stream_is_continued_and_the_client_reads_one_stream() {
    let (resp, a, b, router) = cut_after_three(&chat(10, serde_json::json!({}))).await;
    let r = read(&resp.body);
    assert_eq!(
        r.text,
        story(10),
        "every token once, in order: {}",
        resp.text()
    );
    assert_eq!(r.ids, ["chatcmpl-a-0"], "one id, the first worker's");
    assert_eq!((r.roles, r.finishes, r.dones), (1, 1, 1), "{}", resp.text());
    assert!(r.errors.is_empty());
    let usage = r.usage.expect("the usage chunk");
    assert_eq!(usage["completion_tokens"], 10, "{usage}");
    assert_eq!(
        usage["prompt_tokens"], 4,
        "the client's prompt, not the continued one"
    );
    assert_eq!(usage["total_tokens"], 14);
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"], 5,
        "as the worker that continued reported it"
    );
    // What the second worker was asked: the conversation plus the partial answer.
    let asked: serde_json::Value = serde_json::from_slice(&b.requests()[0].body).unwrap();
    assert_eq!(asked["messages"][1]["role"], "assistant");
    assert_eq!(asked["messages"][1]["content"], story(3));
    assert_eq!(
        (
            &asked["continue_final_message"],
            &asked["add_generation_prompt"]
        ),
        (&serde_json::json!(true), &serde_json::json!(false))
    );
    assert_eq!(asked["max_tokens"], 7);
    assert_eq!(a.count(), 1);
    assert_eq!(migrations(router.addr, "closed", "continued").await, 1.0);
    wait_all_idle(router.addr, Duration::from_secs(2)).await;
    router.shutdown().await;
}

/// `req` streamed through a router in front of a worker (`a`) that dies after three
/// tokens and one (`b`) that continues: the client's answer, both workers, the router.
async fn cut_after_three(
    req: &Req,
) -> (
    Response,
    FakeWorker,
    FakeWorker,
    cache_aware_router::app::RunningRouter,
) {
    let (a, b, yaml) = pair(
        Script {
            die_after: Some(3),
            ..Script::default()
        },
        "",
    )
    .await;
    let router = start_router(&yaml).await;
    let resp = within("the continued stream", send(router.addr, req)).await;
    assert_eq!(resp.status, 200);
    (resp, a, b, router)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_responses_stream_is_continued_and_the_client_reads_one_response() {
    let body = serde_json::json!({"model": "m", "input": "count for me please",
        "instructions": "Be brief.", "stream": true, "max_output_tokens": 8});
    let req = Req::post("/v1/responses", body.to_string());
    let (resp, _a, b, router) = cut_after_three(&req).await;
    // Read as a client of the Responses API does: every event named and numbered.
    let text = resp.text();
    let mut kinds = Vec::new();
    let (mut said, mut last) = (String::new(), None);
    for (i, e) in text
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .enumerate()
    {
        let kind = e.lines().find_map(|l| l.strip_prefix("event: ")).unwrap();
        let data = e.lines().find_map(|l| l.strip_prefix("data: ")).unwrap();
        let v: serde_json::Value = serde_json::from_str(data).unwrap();
        assert_eq!(v["type"], kind, "{e}");
        assert_eq!(v["sequence_number"], i, "numbered without a gap: {text}");
        if kind == "response.output_text.delta" {
            assert_eq!(v["item_id"], "msg_a_0", "one message item: {e}");
            said.push_str(v["delta"].as_str().unwrap());
        }
        kinds.push(kind.to_string());
        last = Some(v);
    }
    assert_eq!(said, story(8), "every token once, in order: {text}");
    let count = |k: &str| kinds.iter().filter(|x| *x == k).count();
    assert_eq!(
        (
            count("response.created"),
            count("response.output_item.added")
        ),
        (1, 1),
        "{text}"
    );
    assert_eq!(count("response.output_text.done"), 1);
    // The continuation stopped at its budget (finish_reason "length"): the answer ran
    // to max_output_tokens, which vLLM reports as an incomplete response.
    assert_eq!(kinds.last().map(String::as_str), Some("response.completed"));
    let r = &last.unwrap()["response"];
    assert_eq!(
        (r["id"].as_str(), r["status"].as_str()),
        (Some("resp_a_0"), Some("incomplete"))
    );
    assert_eq!(r["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(r["output"][0]["id"], "msg_a_0");
    assert_eq!(r["output"][0]["content"][0]["text"], story(8));
    assert_eq!(r["usage"]["output_tokens"], 8, "{r}");
    assert_eq!(
        r["usage"]["input_tokens_details"]["cached_tokens"], 5,
        "as the worker that continued reported it"
    );
    // What the second worker was asked: the conversation as chat, the answer continued.
    let asked = &b.requests()[0];
    assert_eq!(asked.target, "/v1/chat/completions");
    let asked: serde_json::Value = serde_json::from_slice(&asked.body).unwrap();
    assert_eq!(
        asked["messages"],
        serde_json::json!([{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "count for me please"},
            {"role": "assistant", "content": story(3)}])
    );
    assert_eq!(asked["continue_final_message"], true);
    assert_eq!(asked["max_tokens"], 5);
    assert_eq!(migrations(router.addr, "closed", "continued").await, 1.0);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_anthropic_messages_stream_is_continued_and_the_client_reads_one_message() {
    let body = serde_json::json!({"model": "m", "max_tokens": 8, "stream": true,
        "system": "Be brief.", "messages": [{"role": "user", "content": "count for me please"}]});
    let req = Req::post("/v1/messages", body.to_string());
    let (resp, _a, b, router) = cut_after_three(&req).await;
    let text = resp.text();
    let (mut kinds, mut said, mut stop) = (Vec::new(), String::new(), None);
    for e in text.split("\n\n").filter(|e| !e.trim().is_empty()) {
        let kind = e.lines().find_map(|l| l.strip_prefix("event: ")).unwrap();
        let data = e.lines().find_map(|l| l.strip_prefix("data: ")).unwrap();
        let v: serde_json::Value = serde_json::from_str(data).unwrap();
        assert_eq!(v["type"], kind, "{e}");
        if kind == "content_block_delta" {
            assert_eq!(v["index"], 0, "one text block: {e}");
            said.push_str(v["delta"]["text"].as_str().unwrap());
        }
        if kind == "message_delta" {
            stop = Some(v.clone());
        }
        kinds.push(kind.to_string());
    }
    assert_eq!(said, story(8), "every token once, in order: {text}");
    let count = |k: &str| kinds.iter().filter(|x| *x == k).count();
    assert_eq!(
        [
            count("message_start"),
            count("content_block_start"),
            count("content_block_stop"),
            count("message_delta"),
            count("message_stop")
        ],
        [1; 5],
        "{text}"
    );
    assert_eq!(kinds.last().map(String::as_str), Some("message_stop"));
    let stop = stop.unwrap();
    assert_eq!(stop["delta"]["stop_reason"], "max_tokens");
    assert_eq!(stop["usage"]["output_tokens"], 8);
    let asked = &b.requests()[0];
    assert_eq!(asked.target, "/v1/chat/completions");
    let asked: serde_json::Value = serde_json::from_slice(&asked.body).unwrap();
    assert_eq!(asked["messages"][2]["content"], story(3));
    assert_eq!(asked["max_tokens"], 5);
    assert_eq!(migrations(router.addr, "closed", "continued").await, 1.0);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_and_engine_error_events_continue_too() {
    let (_a, b, yaml) = pair(
        Script {
            error_after: Some(2),
            ..Script::default()
        },
        "",
    )
    .await;
    let router = start_router(&yaml).await;
    let body =
        serde_json::json!({"model": "m", "prompt": "Count: ", "stream": true, "max_tokens": 6});
    let resp = send(router.addr, &Req::post("/v1/completions", body.to_string())).await;
    let r = read(&resp.body);
    assert_eq!(r.text, story(6), "{}", resp.text());
    assert!(
        r.errors.is_empty(),
        "the engine's error event is not passed on"
    );
    assert_eq!((r.ids.len(), r.dones), (1, 1));
    let asked: serde_json::Value = serde_json::from_slice(&b.requests()[0].body).unwrap();
    assert_eq!(asked["prompt"], format!("Count: {}", story(2)));
    assert_eq!(asked["max_tokens"], 4);
    assert_eq!(
        migrations(router.addr, "engine_error", "continued").await,
        1.0
    );
    router.shutdown().await;
}

/// Two story engines that both die two tokens into a fresh request, round robin.
async fn dying_pair(extra: &str) -> (FakeWorker, FakeWorker, String) {
    let dying = |name| Script {
        name,
        die_after: Some(2),
        ..Script::default()
    };
    let a = FakeWorker::start_with(story_engine(dying("a"))).await;
    let b = FakeWorker::start_with(story_engine(dying("b"))).await;
    let yaml = yaml_for(&[&a, &b], &format!("policy: round_robin\n{extra}"));
    (a, b, yaml)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_cannot_continue_ends_with_an_error_event_and_is_counted() {
    let (a, b, yaml) = dying_pair("").await;
    let router = start_router(&yaml).await;
    let addr = router.addr;
    for (more, reason) in [
        (serde_json::json!({"n": 2}), "n"),
        (
            serde_json::json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}),
            "guided",
        ),
        (serde_json::json!({"logprobs": true}), "logprobs"),
    ] {
        let (body, cut) = streamed(addr, &chat(8, more)).await;
        let r = read(&body);
        let text = String::from_utf8_lossy(&body);
        assert!(cut, "never a clean end: {text}");
        assert_eq!(r.text, story(2), "what the worker sent, once");
        assert_eq!(r.dones, 0, "{text}");
        assert_eq!(r.errors.len(), 1, "{text}");
        let message = r.errors[0]["message"].as_str().unwrap();
        assert!(message.contains("cannot be continued"), "{message}");
        assert_eq!(r.errors[0]["type"], "stream_interrupted");
        let m = scrape(addr).await;
        assert_eq!(m.value(REFUSALS, &[("reason", reason)]), 1.0, "{reason}");
    }
    assert_eq!(migrations(addr, "closed", "refused").await, 3.0);
    assert_eq!(a.count() + b.count(), 3, "nothing was continued");
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn continuations_stop_at_max_attempts() {
    // Both workers die two tokens into whatever they are sent.
    let dying = |name| Script {
        name,
        die_after: Some(2),
        die_always: true,
        ..Script::default()
    };
    let a = FakeWorker::start_with(story_engine(dying("a"))).await;
    let b = FakeWorker::start_with(story_engine(dying("b"))).await;
    let router = start_router(&yaml_for(
        &[&a, &b],
        "policy: round_robin\nmigration:\n  max_attempts: 1\n",
    ))
    .await;
    let (body, cut) = streamed(router.addr, &chat(10, serde_json::json!({}))).await;
    let r = read(&body);
    assert!(cut);
    assert_eq!(
        r.text,
        story(4),
        "two tokens from each: {}",
        String::from_utf8_lossy(&body)
    );
    assert_eq!(r.errors.len(), 1);
    assert_eq!(r.dones, 0);
    let m = scrape(router.addr).await;
    assert_eq!(m.value(REFUSALS, &[("reason", "attempts")]), 1.0);
    assert_eq!(
        m.value(MIGRATIONS, &[("cause", "closed"), ("outcome", "continued")]),
        1.0
    );
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_closes_the_continuation_too() {
    // b answers a continuation's head at once and then a token each 100 ms (left
    // mid-continuation), or holds its head for 10 s (left while it is being placed).
    for (b_script, when) in [
        (
            Script {
                gap: Duration::from_millis(100),
                ..Script::default()
            },
            "mid-continuation",
        ),
        (
            Script {
                delay: Some(Duration::from_secs(10)),
                ..Script::default()
            },
            "while it is placed",
        ),
    ] {
        let a = FakeWorker::start_with(story_engine(Script {
            name: "a",
            die_after: Some(2),
            ..Script::default()
        }))
        .await;
        let b = FakeWorker::start_with(story_engine(Script {
            name: "b",
            ..b_script
        }))
        .await;
        let router = start_router(&yaml_for(&[&a, &b], "policy: round_robin\n")).await;
        let mut conn = Conn::connect(router.addr).await;
        conn.send(&chat(50, serde_json::json!({}))).await.unwrap();
        assert_eq!(conn.read_head().await.status, 200);
        b.wait_for_requests(1).await;
        drop(conn);
        let conn_b = b.requests()[0].conn;
        wait_until(
            &format!("{when}: the continuation's connection closed"),
            STEP_TIMEOUT,
            || async { !b.is_open(conn_b) },
        )
        .await;
        wait_all_idle(router.addr, Duration::from_secs(2)).await;
        router.shutdown().await;
    }
}

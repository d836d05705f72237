//! Bodies in the shapes an OpenAI-compatible engine speaks (chat requests, SSE chunks,
//! `usage` objects), and [`usage_engine`]: a mock worker that answers with the prefix
//! usage the test asks for, as vLLM and SGLang report it.

use std::net::SocketAddr;

use crate::client::{Conn, Req, new_tag, served_by};
use crate::config::yaml_for;
use crate::worker::{FakeWorker, Gate, Recorded, Reply, Step};

/// A stream of one event that then waits for `gate` before `[DONE]` (a long decode, a
/// tool wait): it holds its worker's in-flight slot until the test opens the gate.
pub fn gated_stream(gate: &Gate) -> Reply {
    Reply::status(200)
        .header("Content-Type", "text/event-stream")
        .chunked(vec![
            Step::Write(format!("data: {}\n\n", sse_event(0)).into_bytes()),
            Step::Wait(gate.clone()),
            Step::Write(b"data: [DONE]\n\n".to_vec()),
        ])
}

/// A mock worker: streamed requests get a [`gated_stream`], plain ones answer at once.
pub fn gated_streams(gate: &Gate) -> impl Fn(&Recorded) -> Reply + Send + Sync + 'static {
    let gate = gate.clone();
    move |req| {
        if req.body_str().contains(r#""stream":true"#) {
            gated_stream(&gate)
        } else {
            Reply::ok()
        }
    }
}

/// The `usage` object vLLM and SGLang report: `prompt` tokens, `cached` of them.
pub fn usage_json(prompt: u64, cached: u64) -> String {
    format!(
        r#"{{"prompt_tokens":{prompt},"completion_tokens":1,"prompt_tokens_details":{{"cached_tokens":{cached}}}}}"#
    )
}

/// Answers as an engine does, with the usage the test asks for in `x-usage: P,C` (and
/// no `prompt_tokens_details`, as vLLM without `--enable-prompt-tokens-details`, when
/// `x-no-details` is set):
/// `FAIL` prompts get a 500; streamed requests an SSE stream whose final chunk carries
/// the usage (held before it while `x-hold` is set, until `hold` opens); others a JSON
/// body with the usage.
pub fn usage_engine(hold: Gate) -> impl Fn(&Recorded) -> Reply + Send + Sync + 'static {
    move |req| {
        let body = req.body_str();
        if body.contains("FAIL") {
            return Reply::json(500, r#"{"error":{"message":"engine crashed","code":500}}"#);
        }
        let (p, c) = req
            .header("x-usage")
            .and_then(|v| v.split_once(','))
            .map(|(p, c)| (p.parse().unwrap(), c.parse().unwrap()))
            .unwrap_or((0, 0));
        let usage = if req.has_header("x-no-details") {
            format!(r#"{{"prompt_tokens":{p},"completion_tokens":1}}"#)
        } else {
            usage_json(p, c)
        };
        if body.contains(r#""stream":true"#) {
            let mut steps = vec![
                Step::Write(format!("data: {}\n\n", sse_event(0)).into_bytes()),
                Step::Write(format!("data: {}\n\n", sse_event(1)).into_bytes()),
            ];
            if req.has_header("x-hold") {
                steps.push(Step::Wait(hold.clone()));
            }
            steps.push(Step::Write(
                format!("data: {}\n\n", sse_usage_chunk(&usage)).into_bytes(),
            ));
            steps.push(Step::Write(b"data: [DONE]\n\n".to_vec()));
            Reply::status(200)
                .header("Content-Type", "text/event-stream")
                .chunked(steps)
        } else {
            Reply::json(
                200,
                &format!(
                    r#"{{"id":"chatcmpl-1","object":"chat.completion","choices":[{{"index":0,"message":{{"role":"assistant","content":"ok"}},"finish_reason":"stop"}}],"usage":{usage}}}"#
                ),
            )
        }
    }
}

/// Two [`usage_engine`]s (sharing `hold`) and the YAML of a router in front of them
/// that diverts a hit on any load difference (`hit_overloaded`) and never retries;
/// `cache` is more of its `cache:` section (each line indented by two spaces), `extra`
/// more top-level keys.
pub async fn usage_engines(cache: &str, extra: &str) -> (Gate, [FakeWorker; 2], String) {
    let hold = Gate::new();
    let a = FakeWorker::start_with(usage_engine(hold.clone())).await;
    let b = FakeWorker::start_with(usage_engine(hold.clone())).await;
    let yaml = yaml_for(
        &[&a, &b],
        &format!(
            "cache:\n  balance_abs_threshold: 0\n  balance_rel_threshold: 1.0\n{cache}proxy:\n  max_retries: 0\n{extra}"
        ),
    );
    (hold, [a, b], yaml)
}

/// Sends `req` (a streamed chat request to [`usage_engine`]s) with `x-hold`, so its
/// stream stays open before its usage chunk until the engines' `hold` gate opens; returns
/// once its first event has arrived, with the open connection and which of `workers`
/// serves it.
pub async fn hold_stream(addr: SocketAddr, workers: &[&FakeWorker], req: Req) -> (Conn, usize) {
    let tag = new_tag();
    let mut held = Conn::connect(addr).await;
    held.send(&req.header("x-hold", "1").header("x-test-tag", &tag))
        .await
        .unwrap();
    assert_eq!(held.read_head().await.status, 200);
    held.next_piece().await.expect("first event");
    (held, served_by(workers, &tag))
}

/// A chat request whose engine answer reports `usage` = (prompt, cached) tokens (see
/// [`usage_engine`]).
pub fn chat_with_usage(body: String, usage: (u64, u64)) -> Req {
    Req::post("/v1/chat/completions", body).header("x-usage", &format!("{},{}", usage.0, usage.1))
}

/// The final SSE chunk of a stream with `stream_options.include_usage`.
pub fn sse_usage_event(prompt: u64, cached: u64) -> String {
    sse_usage_chunk(&usage_json(prompt, cached))
}

/// The final SSE chunk carrying the `usage` object `usage` (JSON).
pub fn sse_usage_chunk(usage: &str) -> String {
    format!(r#"{{"id":"c","object":"chat.completion.chunk","choices":[],"usage":{usage}}}"#)
}

/// An SSE event payload in the OpenAI chunk shape.
pub fn sse_event(i: usize) -> String {
    format!(
        r#"{{"id":"c","object":"chat.completion.chunk","choices":[{{"index":0,"delta":{{"content":"tok{i}"}}}}]}}"#
    )
}

/// Tokens per block of [`caching_engine`]'s prefix cache.
pub const CACHE_BLOCK_TOKENS: usize = 16;

/// An engine with a prefix cache keyed as vLLM keys it: blocks computed under one
/// `model` (a LoRA adapter's name, or the base's) and one `cache_salt` are reused only
/// by requests with the same pair. A prompt is its chat messages' contents joined, one
/// token per 4 bytes; the cached tokens reported are the whole blocks of the longest
/// prefix it shares with a prompt this engine served under the same pair (JSON body,
/// `usage.prompt_tokens_details.cached_tokens`).
pub fn caching_engine() -> impl Fn(&Recorded) -> Reply + Send + Sync + 'static {
    let served: std::sync::Mutex<Vec<(String, String)>> = Default::default();
    move |req| {
        let body: serde_json::Value = serde_json::from_slice(&req.body).unwrap_or_default();
        let scope = format!("{}\u{0}{}", body["model"], body["cache_salt"]);
        let prompt: String = body["messages"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|m| m["content"].as_str())
            .collect::<Vec<_>>()
            .join("\n");
        let mut served = served.lock().unwrap();
        let shared = served
            .iter()
            .filter(|(s, _)| *s == scope)
            .map(|(_, p)| {
                p.bytes()
                    .zip(prompt.bytes())
                    .take_while(|(a, b)| a == b)
                    .count()
            })
            .max()
            .unwrap_or(0);
        served.push((scope, prompt.clone()));
        let tokens = prompt.len() / 4;
        let cached =
            (shared / 4).min(tokens.saturating_sub(1)) / CACHE_BLOCK_TOKENS * CACHE_BLOCK_TOKENS;
        Reply::json(
            200,
            &format!(
                r#"{{"id":"chatcmpl-1","object":"chat.completion","model":{},"choices":[{{"index":0,"message":{{"role":"assistant","content":"ok"}},"finish_reason":"stop"}}],"usage":{}}}"#,
                body["model"],
                usage_json(tokens as u64, cached as u64)
            ),
        )
    }
}

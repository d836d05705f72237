//! [`story_engine`]: a mock engine whose answers can be checked token by token, and that
//! can die in the middle of one. Its answer to any prompt is the words `w0 w1 w2 …`
//! (one token each, `"wN "`), as many as the request's `max_tokens`
//! (`max_completion_tokens`) says. It honours vLLM's continuation of a partial
//! assistant message (`continue_final_message: true` with `add_generation_prompt:
//! false`) and a completions prompt that already holds some words: it counts the words
//! already there and goes on from the next, so a stream cut and continued elsewhere
//! reads exactly as one that never broke.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::worker::{Gate, Recorded, Reply, Step};

/// How a [`story_engine`] misbehaves.
#[derive(Clone, Debug, Default)]
pub struct Script {
    /// Dies (closes the connection mid-body, no final chunk) after this many token
    /// events of a request that continues nothing.
    pub die_after: Option<usize>,
    /// With `die_after`: dies in a continuation too (not only in a fresh request).
    pub die_always: bool,
    /// Sends an engine error event (then `[DONE]`) after this many token events instead.
    pub error_after: Option<usize>,
    /// Waits for this gate after this many token events (a stream held open).
    pub hold_after: Option<(usize, Gate)>,
    /// Between two token events.
    pub gap: Duration,
    /// Before the answer's head (a worker slow to answer at all).
    pub delay: Option<Duration>,
    /// After the head, before the first event (a slow first token: engines send their
    /// head at once and their first event with the first token).
    pub stall: Option<Duration>,
    /// The `cached_tokens` its usage reports.
    pub cached: u64,
    /// Its name, in the ids it gives (`chatcmpl-<name>-<n>`).
    pub name: &'static str,
}

/// The word of token `i`.
pub fn word(i: usize) -> String {
    format!("w{i} ")
}

/// The whole answer of `n` tokens from the start.
pub fn story(n: usize) -> String {
    (0..n).map(word).collect()
}

/// See the module docs. Non-streamed requests get the whole answer as JSON.
pub fn story_engine(script: Script) -> impl Fn(&Recorded) -> Reply + Send + Sync + 'static {
    let served = Arc::new(AtomicUsize::new(0));
    move |req| {
        let body: serde_json::Value = serde_json::from_slice(&req.body).unwrap_or_default();
        let n = served.fetch_add(1, Ordering::SeqCst);
        let chat = req.target.contains("chat/completions");
        let (said, prompt_words) = said_so_far(&body, chat);
        let max = body["max_completion_tokens"]
            .as_u64()
            .or(body["max_tokens"].as_u64())
            .unwrap_or(16) as usize;
        let id = format!(
            "{}-{}-{n}",
            if chat { "chatcmpl" } else { "cmpl" },
            script.name
        );
        if req.target.contains("/v1/responses") && body["stream"] == true {
            let max = body["max_output_tokens"].as_u64().unwrap_or(16) as usize;
            let input = body["input"].as_str().unwrap_or("");
            let name = format!("{}_{n}", script.name);
            return responses_stream(&script, &name, max, input.split_whitespace().count());
        }
        if req.target.contains("/v1/messages") && body["stream"] == true {
            let words = body["messages"][0]["content"].as_str().unwrap_or("");
            let name = format!("{}_{n}", script.name);
            return messages_stream(&script, &name, max, words.split_whitespace().count());
        }
        if body["stream"] != true {
            let text: String = (said..said + max).map(word).collect();
            return Reply::json(200, &whole(&id, chat, &text));
        }
        let continues = said > 0;
        let mut steps = Vec::new();
        if let Some(d) = script.stall {
            steps.push(Step::Sleep(d));
        }
        if chat {
            steps.push(event(&chunk(
                &id,
                chat,
                Some(r#"{"role":"assistant","content":""}"#),
                None,
            )));
        }
        let mut ended = false;
        for (k, i) in (said..said + max).enumerate() {
            if (!continues || script.die_always) && script.die_after == Some(k) {
                steps.push(Step::Die);
                ended = true;
                break;
            }
            if !continues {
                if script.error_after == Some(k) {
                    steps.push(event(
                        r#"{"error":{"message":"engine died","type":"InternalServerError","code":500}}"#,
                    ));
                    steps.push(Step::Write(b"data: [DONE]\n\n".to_vec()));
                    ended = true;
                    break;
                }
                if let Some((at, gate)) = &script.hold_after
                    && *at == k
                {
                    steps.push(Step::Wait(gate.clone()));
                }
            }
            if k > 0 && !script.gap.is_zero() {
                steps.push(Step::Sleep(script.gap));
            }
            let piece = if chat {
                serde_json::json!({"content": word(i)}).to_string()
            } else {
                serde_json::Value::String(word(i)).to_string()
            };
            steps.push(event(&chunk(&id, chat, Some(&piece), None)));
        }
        if !ended {
            let empty = if chat { "{}" } else { "\"\"" };
            steps.push(event(&chunk(&id, chat, Some(empty), Some("length"))));
            if body["stream_options"]["include_usage"] == true {
                let usage = serde_json::json!({
                    "prompt_tokens": prompt_words,
                    "completion_tokens": max,
                    "total_tokens": prompt_words + max,
                    "prompt_tokens_details": {"cached_tokens": script.cached},
                });
                steps.push(event(&format!(
                    r#"{{"id":"{id}","object":"{}","created":1,"model":"m","choices":[],"usage":{usage}}}"#,
                    object(chat)
                )));
            }
            steps.push(Step::Write(b"data: [DONE]\n\n".to_vec()));
        }
        let reply = event_stream(steps);
        match script.delay {
            Some(d) => reply.after(d),
            None => reply,
        }
    }
}

/// A streamed `/v1/responses` answer as vLLM writes one (`event:` + `data:` lines,
/// numbered events): the response, its message item and text part, one
/// `response.output_text.delta` per token, then the closing events. Dies as `script`
/// says (a Responses request is never a continuation: those come as chat).
fn responses_stream(script: &Script, name: &str, max: usize, prompt_words: usize) -> Reply {
    let mut seq = 0;
    let mut steps = Vec::new();
    let mut ev = |kind: &str, mut data: serde_json::Value| {
        data["type"] = kind.into();
        data["sequence_number"] = seq.into();
        seq += 1;
        Step::Write(format!("event: {kind}\ndata: {data}\n\n").into_bytes())
    };
    let (resp_id, item_id) = (format!("resp_{name}"), format!("msg_{name}"));
    let response = |status: &str, text: Option<&str>| {
        let mut r = serde_json::json!({"id": resp_id, "object": "response", "created_at": 1,
            "model": "m", "status": status, "output": [], "error": null});
        if let Some(t) = text {
            r["output"] = serde_json::json!([{"id": item_id, "type": "message",
                "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": t, "annotations": []}]}]);
            r["usage"] = serde_json::json!({"input_tokens": prompt_words,
                "input_tokens_details": {"cached_tokens": script.cached},
                "output_tokens": max, "total_tokens": prompt_words + max});
        }
        r
    };
    steps.push(ev(
        "response.created",
        serde_json::json!({"response": response("in_progress", None)}),
    ));
    let item = serde_json::json!({"id": item_id, "type": "message", "status": "in_progress",
        "role": "assistant", "content": []});
    steps.push(ev(
        "response.output_item.added",
        serde_json::json!({"output_index": 0, "item": item}),
    ));
    let at = serde_json::json!({"item_id": item_id, "output_index": 0, "content_index": 0});
    let mut part = at.clone();
    part["part"] = serde_json::json!({"type": "output_text", "text": "", "annotations": []});
    steps.push(ev("response.content_part.added", part));
    for i in 0..max {
        if script.die_after == Some(i) {
            steps.push(Step::Die);
            return event_stream(steps);
        }
        if i > 0 && !script.gap.is_zero() {
            steps.push(Step::Sleep(script.gap));
        }
        let mut d = at.clone();
        d["delta"] = word(i).into();
        steps.push(ev("response.output_text.delta", d));
    }
    let text = story(max);
    let mut done = at.clone();
    done["text"] = text.clone().into();
    steps.push(ev("response.output_text.done", done));
    steps.push(ev("response.content_part.done", at));
    steps.push(ev(
        "response.output_item.done",
        serde_json::json!({"output_index": 0}),
    ));
    steps.push(ev(
        "response.completed",
        serde_json::json!({"response": response("completed", Some(&text))}),
    ));
    event_stream(steps)
}

/// A streamed `/v1/messages` answer as an Anthropic-compatible engine writes one: the
/// message, a text block with one `content_block_delta` per token, its stop, the
/// message's delta and stop. Dies as `script` says (continuations come as chat).
fn messages_stream(script: &Script, name: &str, max: usize, prompt_words: usize) -> Reply {
    let ev = |kind: &str, data: serde_json::Value| {
        Step::Write(format!("event: {kind}\ndata: {data}\n\n").into_bytes())
    };
    let message = serde_json::json!({"id": format!("msg_{name}"), "type": "message",
        "role": "assistant", "model": "m", "content": [], "stop_reason": null,
        "usage": {"input_tokens": prompt_words, "output_tokens": 0}});
    let mut steps = vec![
        ev(
            "message_start",
            serde_json::json!({"type": "message_start", "message": message}),
        ),
        ev(
            "content_block_start",
            serde_json::json!({"type": "content_block_start",
            "index": 0, "content_block": {"type": "text", "text": ""}}),
        ),
        ev("ping", serde_json::json!({"type": "ping"})),
    ];
    for i in 0..max {
        if script.die_after == Some(i) {
            steps.push(Step::Die);
            return event_stream(steps);
        }
        steps.push(ev(
            "content_block_delta",
            serde_json::json!({"type": "content_block_delta",
            "index": 0, "delta": {"type": "text_delta", "text": word(i)}}),
        ));
    }
    steps.push(ev(
        "content_block_stop",
        serde_json::json!({"type": "content_block_stop", "index": 0}),
    ));
    steps.push(ev(
        "message_delta",
        serde_json::json!({"type": "message_delta",
        "delta": {"stop_reason": "max_tokens", "stop_sequence": null},
        "usage": {"output_tokens": max}}),
    ));
    steps.push(ev(
        "message_stop",
        serde_json::json!({"type": "message_stop"}),
    ));
    event_stream(steps)
}

/// A 200 event stream of `steps`.
fn event_stream(steps: Vec<Step>) -> Reply {
    Reply::status(200)
        .header("Content-Type", "text/event-stream")
        .chunked(steps)
}

/// How many answer words the request already holds (the partial assistant message it
/// continues, or the words of a completions prompt), and its prompt's length in words.
fn said_so_far(body: &serde_json::Value, chat: bool) -> (usize, usize) {
    let count = |s: &str| {
        s.split_whitespace()
            .filter(|w| {
                w.len() > 1 && w.starts_with('w') && w[1..].bytes().all(|b| b.is_ascii_digit())
            })
            .count()
    };
    let words = |s: &str| s.split_whitespace().count();
    if !chat {
        let p = body["prompt"].as_str().unwrap_or("");
        return (count(p), words(p));
    }
    let messages = body["messages"].as_array().cloned().unwrap_or_default();
    let all: usize = messages
        .iter()
        .filter_map(|m| m["content"].as_str())
        .map(words)
        .sum();
    let continuing = body["continue_final_message"] == true
        && body["add_generation_prompt"] == false
        && messages.last().is_some_and(|m| m["role"] == "assistant");
    let said = match messages.last() {
        Some(m) if continuing => count(m["content"].as_str().unwrap_or("")),
        _ => 0,
    };
    (said, all)
}

fn object(chat: bool) -> &'static str {
    if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    }
}

/// One streamed chunk: `piece` is the chat delta (JSON) or the completion's text (a JSON
/// string).
fn chunk(id: &str, chat: bool, piece: Option<&str>, finish: Option<&str>) -> String {
    let finish = finish.map_or("null".to_string(), |f| format!("\"{f}\""));
    let piece = piece.unwrap_or("null");
    let choice = if chat {
        format!(r#"{{"index":0,"delta":{piece},"logprobs":null,"finish_reason":{finish}}}"#)
    } else {
        format!(r#"{{"index":0,"text":{piece},"logprobs":null,"finish_reason":{finish}}}"#)
    };
    format!(
        r#"{{"id":"{id}","object":"{}","created":1,"model":"m","choices":[{choice}]}}"#,
        object(chat)
    )
}

fn event(data: &str) -> Step {
    Step::Write(format!("data: {data}\n\n").into_bytes())
}

fn whole(id: &str, chat: bool, text: &str) -> String {
    let text = serde_json::Value::String(text.to_string());
    if chat {
        format!(
            r#"{{"id":"{id}","object":"chat.completion","choices":[{{"index":0,"message":{{"role":"assistant","content":{text}}},"finish_reason":"length"}}]}}"#
        )
    } else {
        format!(
            r#"{{"id":"{id}","object":"text_completion","choices":[{{"index":0,"text":{text},"finish_reason":"length"}}]}}"#
        )
    }
}

/// A streamed answer as the client read it: its events' data, in order.
pub fn events(body: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(body)
        .split("\n\n")
        .filter_map(|e| {
            e.lines()
                .find_map(|l| l.strip_prefix("data: ").map(str::to_string))
        })
        .collect()
}

/// What a client assembles from a streamed answer: the ids its chunks carry, its text
/// (chat deltas or completion texts), how many role chunks, finish reasons and
/// `[DONE]`s it had, its usage, and its error events.
#[derive(Debug, Default)]
pub struct Read {
    pub ids: Vec<String>,
    pub text: String,
    pub roles: usize,
    pub finishes: usize,
    pub dones: usize,
    pub usage: Option<serde_json::Value>,
    pub errors: Vec<serde_json::Value>,
}

/// Reads a streamed answer as a client does (see [`Read`]).
pub fn read(body: &[u8]) -> Read {
    let mut r = Read::default();
    for data in events(body) {
        if data == "[DONE]" {
            r.dones += 1;
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(&data).unwrap_or_else(|e| panic!("event {data:?}: {e}"));
        if v.get("error").is_some() {
            r.errors.push(v["error"].clone());
            continue;
        }
        if let Some(id) = v["id"].as_str()
            && !r.ids.iter().any(|i| i == id)
        {
            r.ids.push(id.to_string());
        }
        let c = &v["choices"][0];
        if c["delta"].get("role").is_some() {
            r.roles += 1;
        }
        if let Some(t) = c["delta"]["content"].as_str().or(c["text"].as_str()) {
            r.text.push_str(t);
        }
        if c["finish_reason"].is_string() {
            r.finishes += 1;
        }
        if !v["usage"].is_null() {
            r.usage = Some(v["usage"].clone());
        }
    }
    r
}

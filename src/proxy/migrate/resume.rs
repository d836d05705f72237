//! The continuation's request body, from the client's and what was sent of the answer.
//!
//! Chat: the conversation plus the partial assistant message, continued
//! (`continue_final_message: true`, `add_generation_prompt: false`: vLLM renders the
//! chat template up to the end of that message and generates from there, as SGLang
//! does). Completions: the prompt plus the text so far. Either way the token budget
//! (`max_tokens`, `max_completion_tokens`, `min_tokens`) is reduced by the tokens sent.

use bytes::Bytes;
use serde_json::{Map, Value};

use super::Kind;
use super::relay::Said;

/// What follows a broken part.
#[derive(Debug, PartialEq, Eq)]
pub enum Next {
    /// This body goes to another worker.
    Send(Bytes),
    /// The answer is whole (its final chunk passed, or its budget is spent): the router
    /// writes its end.
    End,
}

/// The continuation of `original` (the body the first worker got) after `said` and
/// `sent` tokens; `None` when the body cannot be read as its kind's request.
pub fn next(kind: Kind, original: &Bytes, said: &Said, sent: u64) -> Option<Next> {
    if said.finished {
        return Some(Next::End);
    }
    if said.text.is_empty() && !kind.continues_as_chat() {
        // Nothing generated reached the client: the request as it was.
        return Some(Next::Send(original.clone()));
    }
    let Ok(Value::Object(mut body)) = serde_json::from_slice::<Value>(original) else {
        return None;
    };
    match kind {
        Kind::Responses => return response_as_chat(&body, &said.text, sent),
        Kind::Messages => return message_as_chat(&body, &said.text, sent),
        _ => {}
    }
    for key in ["max_tokens", "max_completion_tokens"] {
        if let Some(max) = body.get(key).and_then(Value::as_u64) {
            let left = max.saturating_sub(sent);
            if left == 0 {
                return Some(Next::End);
            }
            body.insert(key.into(), left.into());
        }
    }
    if let Some(min) = body.get("min_tokens").and_then(Value::as_u64) {
        body.insert("min_tokens".into(), min.saturating_sub(sent).into());
    }
    match kind {
        Kind::Chat | Kind::Responses | Kind::Messages => continue_chat(&mut body, &said.text)?,
        Kind::Completions => {
            let Some(Value::String(prompt)) = body.get_mut("prompt") else {
                return None;
            };
            prompt.push_str(&said.text);
        }
    }
    serde_json::to_vec(&Value::Object(body))
        .ok()
        .map(|b| Next::Send(Bytes::from(b)))
}

/// A Responses request continued as a streamed chat request (vLLM's Responses API
/// has no way to continue a partial message): `instructions` as the system message,
/// `input` (a string, or message items of text) as the conversation, `text` as the
/// assistant's message to continue (none yet: a new turn), `max_output_tokens` less
/// `sent` as `max_tokens`. `None` for input chat cannot carry (images, files, tool
/// items).
fn response_as_chat(body: &Map<String, Value>, text: &str, sent: u64) -> Option<Next> {
    let mut messages = Vec::new();
    if let Some(Value::String(s)) = body.get("instructions") {
        messages.push(serde_json::json!({"role": "system", "content": s}));
    }
    match body.get("input")? {
        Value::String(s) => messages.push(serde_json::json!({"role": "user", "content": s})),
        Value::Array(items) => {
            for item in items {
                messages.push(message_of(item)?);
            }
        }
        _ => return None,
    }
    let carried = ["model", "temperature", "top_p", "seed", "user"];
    as_chat(
        body,
        &carried,
        ("max_output_tokens", false),
        messages,
        text,
        sent,
    )
}

/// An Anthropic Messages request continued as a streamed chat request: `system` as the
/// system message, the messages of text as the conversation, `text` continuing the last
/// assistant message (the client's prefill, or a new one), `max_tokens` less `sent`.
/// `None` for content chat cannot carry (images, documents, tool use and results).
fn message_as_chat(body: &Map<String, Value>, text: &str, sent: u64) -> Option<Next> {
    let mut messages = Vec::new();
    match body.get("system") {
        None | Some(Value::Null) => {}
        Some(system) => {
            let content = text_of(system)?;
            messages.push(serde_json::json!({"role": "system", "content": content}));
        }
    }
    for m in body.get("messages")?.as_array()? {
        let role = m.get("role")?.as_str()?;
        let content = text_of(m.get("content")?)?;
        messages.push(serde_json::json!({"role": role, "content": content}));
    }
    let carried = ["model", "temperature", "top_p", "top_k"];
    let mut chat = as_chat(body, &carried, ("max_tokens", true), messages, text, sent)?;
    if let (Next::Send(b), Some(stop)) = (&mut chat, body.get("stop_sequences")) {
        let mut v: Map<String, Value> = serde_json::from_slice(b).ok()?;
        v.insert("stop".into(), stop.clone());
        *b = Bytes::from(serde_json::to_vec(&v).ok()?);
    }
    Some(chat)
}

/// A string, or text blocks (`{"type": "text", "text": …}`) joined; `None` otherwise.
fn text_of(content: &Value) -> Option<String> {
    match content {
        Value::String(s) => Some(s.clone()),
        Value::Array(blocks) => {
            let mut all = String::new();
            for b in blocks {
                if b.get("type")?.as_str()? != "text" {
                    return None;
                }
                all.push_str(b.get("text")?.as_str()?);
            }
            Some(all)
        }
        _ => None,
    }
}

/// The streamed chat request that continues `text` after `messages`: the `carried`
/// members of `body`, its budget (`budget.0`) less `sent` as `max_tokens`, usage on;
/// with `budget.1`, a last assistant message is a prefill the answer continues
/// (Anthropic's Messages API; the Responses API opens a new turn after it).
fn as_chat(
    body: &Map<String, Value>,
    carried: &[&str],
    budget: (&str, bool),
    messages: Vec<Value>,
    text: &str,
    sent: u64,
) -> Option<Next> {
    let (budget_key, prefills) = budget;
    let mut chat = Map::new();
    for key in carried {
        if let Some(v) = body.get(*key) {
            chat.insert((*key).into(), v.clone());
        }
    }
    if let Some(max) = body.get(budget_key).and_then(Value::as_u64) {
        let left = max.saturating_sub(sent);
        if left == 0 {
            return Some(Next::End);
        }
        chat.insert("max_tokens".into(), left.into());
    }
    // A last assistant message (an Anthropic prefill) is continued, not closed.
    let prefill = prefills
        && messages
            .last()
            .is_some_and(|m| m.get("role").and_then(Value::as_str) == Some("assistant"));
    chat.insert("messages".into(), Value::Array(messages));
    if prefill {
        chat.insert("continue_final_message".into(), Value::Bool(true));
    }
    if prefill || !text.is_empty() {
        continue_chat(&mut chat, text)?;
    }
    chat.insert("stream".into(), Value::Bool(true));
    chat.insert(
        "stream_options".into(),
        serde_json::json!({"include_usage": true}),
    );
    serde_json::to_vec(&Value::Object(chat))
        .ok()
        .map(|b| Next::Send(Bytes::from(b)))
}

/// A Responses input item as a chat message, when it is a message of text.
fn message_of(item: &Value) -> Option<Value> {
    let o = item.as_object()?;
    if o.get("type").is_some_and(|t| t != "message") {
        return None;
    }
    let role = match o.get("role")?.as_str()? {
        "developer" => "system",
        r => r,
    };
    let content = match o.get("content")? {
        Value::String(s) => s.clone(),
        Value::Array(parts) => {
            let mut all = String::new();
            for p in parts {
                let kind = p.get("type")?.as_str()?;
                if !matches!(kind, "input_text" | "output_text" | "text") {
                    return None;
                }
                all.push_str(p.get("text")?.as_str()?);
            }
            all
        }
        _ => return None,
    };
    Some(serde_json::json!({"role": role, "content": content}))
}

/// Adds `text` to the conversation as the assistant's message to continue (to the
/// client's own, when it already asked for its last assistant message continued).
fn continue_chat(body: &mut Map<String, Value>, text: &str) -> Option<()> {
    let continuing = body.get("continue_final_message") == Some(&Value::Bool(true));
    let messages = body.get_mut("messages")?.as_array_mut()?;
    let last = messages
        .last_mut()
        .filter(|m| continuing && m.get("role").and_then(Value::as_str) == Some("assistant"));
    match last.and_then(|m| m.get_mut("content")) {
        Some(Value::String(s)) => s.push_str(text),
        Some(Value::Array(parts)) => parts.push(serde_json::json!({"type": "text", "text": text})),
        _ => messages.push(serde_json::json!({"role": "assistant", "content": text})),
    }
    body.insert("continue_final_message".into(), Value::Bool(true));
    body.insert("add_generation_prompt".into(), Value::Bool(false));
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn said(text: &str) -> Said {
        Said {
            text: text.into(),
            ..Said::default()
        }
    }

    fn sent(next: Option<Next>) -> Value {
        match next {
            Some(Next::Send(b)) => serde_json::from_slice(&b).unwrap(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn chat_continues_the_partial_assistant_message_with_the_budget_left() {
        let body = Bytes::from_static(
            br#"{"model":"m","messages":[{"role":"user","content":"count"}],"stream":true,"max_tokens":10,"min_tokens":4}"#,
        );
        let v = sent(next(Kind::Chat, &body, &said("one two"), 3));
        assert_eq!(
            v["messages"][1],
            serde_json::json!({"role":"assistant","content":"one two"})
        );
        assert_eq!(v["continue_final_message"], true);
        assert_eq!(v["add_generation_prompt"], false);
        assert_eq!(
            (v["max_tokens"].as_u64(), v["min_tokens"].as_u64()),
            (Some(7), Some(1))
        );
        assert_eq!(v["stream"], true);
        // The client's own continued message grows.
        let own = Bytes::from_static(
            br#"{"messages":[{"role":"user","content":"x"},{"role":"assistant","content":"Sure: "}],"continue_final_message":true,"add_generation_prompt":false,"max_completion_tokens":5}"#,
        );
        let v = sent(next(Kind::Chat, &own, &said("a b"), 2));
        assert_eq!(v["messages"].as_array().unwrap().len(), 2);
        assert_eq!(v["messages"][1]["content"], "Sure: a b");
        assert_eq!(v["max_completion_tokens"], 3);
    }

    #[test]
    fn a_responses_request_continues_as_chat() {
        let body = Bytes::from_static(
            br#"{"model":"m","instructions":"Be brief.","input":[{"role":"user","content":"count"},{"type":"message","role":"assistant","content":[{"type":"output_text","text":"ok"}]},{"role":"user","content":[{"type":"input_text","text":"again"}]}],"stream":true,"max_output_tokens":10,"temperature":0.5}"#,
        );
        let v = sent(next(Kind::Responses, &body, &said("one two"), 3));
        assert_eq!(
            v["messages"],
            serde_json::json!([
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "count"},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "again"},
                {"role": "assistant", "content": "one two"},
            ])
        );
        assert_eq!(v["continue_final_message"], true);
        assert_eq!(v["add_generation_prompt"], false);
        assert_eq!(
            (v["max_tokens"].as_u64(), v["temperature"].as_f64()),
            (Some(7), Some(0.5))
        );
        assert_eq!(
            (v["stream"].as_bool(), v["model"].as_str()),
            (Some(true), Some("m"))
        );
        assert_eq!(v["stream_options"]["include_usage"], true);
        // Nothing said yet: a new assistant turn, as chat.
        let plain = Bytes::from_static(br#"{"input":"hi","stream":true}"#);
        let v = sent(next(Kind::Responses, &plain, &said(""), 0));
        assert_eq!(
            v["messages"],
            serde_json::json!([{"role": "user", "content": "hi"}])
        );
        assert!(v.get("continue_final_message").is_none());
        // Input chat cannot carry.
        let image = Bytes::from_static(
            br#"{"input":[{"role":"user","content":[{"type":"input_image","image_url":"x"}]}],"stream":true}"#,
        );
        assert_eq!(next(Kind::Responses, &image, &said("a"), 1), None);
        let tool = Bytes::from_static(
            br#"{"input":[{"type":"function_call_output","call_id":"c","output":"1"}],"stream":true}"#,
        );
        assert_eq!(next(Kind::Responses, &tool, &said("a"), 1), None);
    }

    #[test]
    fn a_messages_request_continues_as_chat_and_a_prefill_grows() {
        let body = Bytes::from_static(
            br#"{"model":"m","system":[{"type":"text","text":"Be brief."}],"messages":[{"role":"user","content":[{"type":"text","text":"count"}]}],"stream":true,"max_tokens":10,"stop_sequences":["END"],"top_k":5}"#,
        );
        let v = sent(next(Kind::Messages, &body, &said("one two"), 3));
        assert_eq!(
            v["messages"],
            serde_json::json!([
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "count"},
                {"role": "assistant", "content": "one two"},
            ])
        );
        assert_eq!(
            (
                v["continue_final_message"].as_bool(),
                v["add_generation_prompt"].as_bool()
            ),
            (Some(true), Some(false))
        );
        assert_eq!(
            (v["max_tokens"].as_u64(), v["top_k"].as_u64()),
            (Some(7), Some(5))
        );
        assert_eq!(v["stop"], serde_json::json!(["END"]));
        // The client's prefill is continued, with what was said added to it.
        let prefill = Bytes::from_static(
            br#"{"messages":[{"role":"user","content":"count"},{"role":"assistant","content":"Sure: "}],"stream":true,"max_tokens":4}"#,
        );
        let v = sent(next(Kind::Messages, &prefill, &said("a"), 1));
        assert_eq!(v["messages"].as_array().unwrap().len(), 2);
        assert_eq!(v["messages"][1]["content"], "Sure: a");
        let v = sent(next(Kind::Messages, &prefill, &said(""), 0));
        assert_eq!(
            (
                v["messages"][1]["content"].as_str(),
                v["continue_final_message"].as_bool()
            ),
            (Some("Sure: "), Some(true))
        );
        // A Responses input's assistant message is history: the answer is a new turn.
        let history = Bytes::from_static(
            br#"{"input":[{"role":"user","content":"x"},{"role":"assistant","content":"y"}],"stream":true}"#,
        );
        let v = sent(next(Kind::Responses, &history, &said(""), 0));
        assert!(v.get("continue_final_message").is_none(), "{v}");
        let image = Bytes::from_static(
            br#"{"messages":[{"role":"user","content":[{"type":"image","source":{}}]}],"stream":true,"max_tokens":4}"#,
        );
        assert_eq!(next(Kind::Messages, &image, &said("a"), 1), None);
    }

    #[test]
    fn completions_continue_the_prompt() {
        let body = Bytes::from_static(br#"{"prompt":"Once","stream":true,"max_tokens":8}"#);
        let v = sent(next(Kind::Completions, &body, &said(" upon a"), 2));
        assert_eq!(v["prompt"], "Once upon a");
        assert_eq!(v["max_tokens"], 6);
    }

    #[test]
    fn a_whole_or_empty_answer_needs_no_rewrite() {
        let body = Bytes::from_static(br#"{"prompt":"x","stream":true,"max_tokens":2}"#);
        assert_eq!(
            next(Kind::Completions, &body, &said("a b"), 2),
            Some(Next::End)
        );
        let mut done = said("a");
        done.finished = true;
        assert_eq!(next(Kind::Completions, &body, &done, 1), Some(Next::End));
        assert_eq!(
            next(Kind::Completions, &body, &said(""), 0),
            Some(Next::Send(body.clone()))
        );
        assert_eq!(
            next(Kind::Chat, &Bytes::from_static(b"[]"), &said("a"), 1),
            None
        );
    }
}

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
    if said.text.is_empty() {
        // Nothing generated reached the client: the request as it was.
        return Some(Next::Send(original.clone()));
    }
    let Ok(Value::Object(mut body)) = serde_json::from_slice::<Value>(original) else {
        return None;
    };
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
        Kind::Chat => continue_chat(&mut body, &said.text)?,
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

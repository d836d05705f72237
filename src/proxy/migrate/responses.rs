//! A streamed `/v1/responses` answer that continues elsewhere. The first worker's
//! events are read for what they said (the response, the message item, its text, the
//! last `sequence_number`); the continuation is a streamed chat request (vLLM's
//! Responses API cannot continue a partial message; its chat API can, see `resume`),
//! and its chunks are written as the first part's sequel: `response.output_text.delta`
//! events of the same item, then the closing events (`output_text.done`,
//! `content_part.done`, `output_item.done`, `response.completed` with usage covering
//! both parts) in place of its `[DONE]`.

use serde::Deserialize;
use serde_json::{Value, json};

use super::relay::Said;
use crate::prompt::Text;

/// What a Responses stream said besides its text.
#[derive(Debug, Default)]
pub struct Shape {
    /// The response object of `response.created` (written back, completed, at the end).
    pub response: Option<Value>,
    /// The assistant message item whose text is streamed, and where it sits.
    pub item_id: Option<String>,
    pub output_index: u64,
    pub content_index: u64,
    /// The last `sequence_number` passed.
    pub sequence: u64,
    /// The message item and its text part were announced (`output_item.added`,
    /// `content_part.added`).
    pub item_added: bool,
    pub part_added: bool,
    /// Closing events passed: `output_text.done`, `content_part.done`, `output_item.done`.
    pub closed: [bool; 3],
    /// The continuation stopped at its token budget (`finish_reason: length`).
    pub cut: bool,
    /// The continuation's usage: prompt tokens (the partial answer included), cached.
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
}

/// The fields of a Responses stream event the relay reads.
#[derive(Deserialize)]
struct Event<'a> {
    #[serde(rename = "type", borrow, default)]
    kind: Option<Text<'a>>,
    #[serde(default)]
    sequence_number: Option<u64>,
    #[serde(default)]
    output_index: Option<u64>,
    #[serde(default)]
    content_index: Option<u64>,
    #[serde(borrow, default)]
    delta: Option<Text<'a>>,
    #[serde(borrow, default)]
    item: Option<Item<'a>>,
    #[serde(default)]
    response: Option<Value>,
}

#[derive(Deserialize)]
struct Item<'a> {
    #[serde(borrow, default)]
    id: Option<Text<'a>>,
    #[serde(rename = "type", borrow, default)]
    kind: Option<Text<'a>>,
}

/// What one event of the first worker said, noted in `said`; `Err(())` when it is the
/// engine's error (the part broke). `Ok(true)`: it carried text.
pub fn note(said: &mut Said, data: &[u8]) -> Result<bool, ()> {
    let Ok(ev) = serde_json::from_slice::<Event<'_>>(data) else {
        return Ok(false);
    };
    let shape = &mut said.shape;
    if let Some(n) = ev.sequence_number {
        shape.sequence = shape.sequence.max(n);
    }
    let kind = ev.kind.as_deref().unwrap_or("");
    match kind {
        "error" | "response.failed" => return Err(()),
        "response.created" => shape.response = ev.response,
        "response.output_item.added" => match ev.item.as_ref().and_then(|i| i.kind.as_deref()) {
            Some("message") if !shape.item_added => {
                shape.item_added = true;
                shape.item_id = ev.item.and_then(|i| i.id).map(|t| t.to_string());
                shape.output_index = ev.output_index.unwrap_or(0);
            }
            Some("message") => {}
            Some("reasoning") => said.reasoning = true,
            // A function call, a tool's own item: not continued.
            _ => said.tool_call = true,
        },
        "response.output_text.delta" => {
            shape.content_index = ev.content_index.unwrap_or(0);
            if let Some(d) = ev.delta.filter(|d| !d.is_empty()) {
                said.text.push_str(&d);
                return Ok(true);
            }
        }
        "response.content_part.added" => {
            shape.part_added = true;
            shape.content_index = ev.content_index.unwrap_or(0);
        }
        "response.output_text.done" => {
            shape.closed[0] = true;
            said.finished = true;
        }
        "response.content_part.done" => shape.closed[1] = true,
        "response.output_item.done" => shape.closed[2] = true,
        "response.completed" | "response.incomplete" => said.done = true,
        k if k.starts_with("response.reasoning") => said.reasoning = true,
        _ => {}
    }
    Ok(false)
}

/// One event as the client reads it.
fn event(kind: &str, mut data: Value, shape: &mut Shape) -> Vec<u8> {
    shape.sequence = shape.sequence.saturating_add(1);
    if let Some(o) = data.as_object_mut() {
        o.insert("type".into(), kind.into());
        o.insert("sequence_number".into(), shape.sequence.into());
    }
    super::relay::named_event(kind, &data)
}

/// A continuation's text written as the first part's `response.output_text.delta`
/// (after the message item and its text part, when the first part had not announced
/// them yet).
pub fn delta(shape: &mut Shape, text: &str) -> Vec<u8> {
    let mut out = Vec::new();
    if !shape.item_added {
        shape.item_added = true;
        let id = shape
            .response
            .as_ref()
            .and_then(|r| r.get("id"))
            .and_then(Value::as_str)
            .map_or_else(|| "msg_continued".to_owned(), |id| format!("msg_{id}"));
        shape.item_id = Some(id);
        let item = json!({"id": shape.item_id, "type": "message", "status": "in_progress",
            "role": "assistant", "content": []});
        let d = json!({"output_index": shape.output_index, "item": item});
        out.extend(event("response.output_item.added", d, shape));
    }
    if !shape.part_added {
        shape.part_added = true;
        let d = json!({"item_id": shape.item_id, "output_index": shape.output_index,
            "content_index": shape.content_index,
            "part": {"type": "output_text", "text": "", "annotations": []}});
        out.extend(event("response.content_part.added", d, shape));
    }
    let data = json!({
        "item_id": shape.item_id,
        "output_index": shape.output_index,
        "content_index": shape.content_index,
        "delta": text,
        "logprobs": [],
    });
    out.extend(event("response.output_text.delta", data, shape));
    out
}

/// The events that close the answer (those not passed yet), the last one
/// `response.completed` with the response as created (status `incomplete` when its
/// budget ran out), its whole text, and `usage` when `tokens` (the output tokens of
/// every part) and the last part's usage are known.
pub fn closing(said: &mut Said, tokens: u64, before: u64) -> Vec<u8> {
    let text = said.text.clone();
    let shape = &mut said.shape;
    let (item_id, oi, ci) = (
        shape.item_id.clone(),
        shape.output_index,
        shape.content_index,
    );
    let part = json!({"type": "output_text", "text": text, "annotations": []});
    let item = json!({
        "id": item_id,
        "type": "message",
        "status": if shape.cut { "incomplete" } else { "completed" },
        "role": "assistant",
        "content": [part],
    });
    let mut out = Vec::new();
    if !shape.closed[0] {
        let d = json!({"item_id": item_id, "output_index": oi, "content_index": ci, "text": text, "logprobs": []});
        out.extend(event("response.output_text.done", d, shape));
    }
    if !shape.closed[1] {
        let d = json!({"item_id": item_id, "output_index": oi, "content_index": ci, "part": part});
        out.extend(event("response.content_part.done", d, shape));
    }
    if !shape.closed[2] {
        let d = json!({"output_index": oi, "item": item});
        out.extend(event("response.output_item.done", d, shape));
    }
    shape.closed = [true; 3];
    let mut response = shape.response.take().unwrap_or_else(|| json!({}));
    if let Some(r) = response.as_object_mut() {
        let status = if shape.cut { "incomplete" } else { "completed" };
        r.insert("status".into(), status.into());
        if shape.cut {
            r.insert(
                "incomplete_details".into(),
                json!({"reason": "max_output_tokens"}),
            );
        }
        r.insert("output".into(), json!([item]));
        if let Some(prompt) = shape.prompt_tokens {
            let input = prompt.saturating_sub(before);
            r.insert(
                "usage".into(),
                json!({
                    "input_tokens": input,
                    "input_tokens_details": {"cached_tokens": shape.cached_tokens.unwrap_or(0)},
                    "output_tokens": tokens,
                    "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": input.saturating_add(tokens),
                }),
            );
        }
    }
    // vLLM ends every Responses stream with `response.completed`, the response's
    // status saying whether it ran to max_output_tokens.
    out.extend(event(
        "response.completed",
        json!({"response": response}),
        shape,
    ));
    said.done = true;
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn said_after(events: &[&str]) -> Said {
        let mut said = Said::default();
        for e in events {
            note(&mut said, e.as_bytes()).unwrap();
        }
        said
    }

    #[test]
    fn the_first_part_is_read_for_its_item_text_and_sequence() {
        let mut said = said_after(&[
            r#"{"type":"response.created","sequence_number":0,"response":{"id":"resp_1","status":"in_progress","model":"m","error":null}}"#,
            r#"{"type":"response.output_item.added","sequence_number":1,"output_index":0,"item":{"id":"msg_1","type":"message","role":"assistant","content":[]}}"#,
            r#"{"type":"response.content_part.added","sequence_number":2,"item_id":"msg_1","output_index":0,"content_index":0,"part":{"type":"output_text","text":""}}"#,
            r#"{"type":"response.output_text.delta","sequence_number":3,"item_id":"msg_1","output_index":0,"content_index":0,"delta":"one "}"#,
            r#"{"type":"response.output_text.delta","sequence_number":4,"item_id":"msg_1","output_index":0,"content_index":0,"delta":"two"}"#,
        ]);
        assert_eq!(said.text, "one two");
        assert_eq!(said.shape.item_id.as_deref(), Some("msg_1"));
        assert_eq!(said.shape.sequence, 4);
        assert!(!said.finished && !said.tool_call && !said.reasoning);
        let d = String::from_utf8(delta(&mut said.shape, " three")).unwrap();
        assert!(d.starts_with("event: response.output_text.delta\ndata: "));
        let v: Value = serde_json::from_str(d.lines().nth(1).unwrap()[6..].trim()).unwrap();
        assert_eq!(
            (v["sequence_number"].as_u64(), v["item_id"].as_str()),
            (Some(5), Some("msg_1"))
        );
        said.text.push_str(" three");
        said.shape.prompt_tokens = Some(14);
        said.shape.cached_tokens = Some(8);
        let end = String::from_utf8(closing(&mut said, 3, 2)).unwrap();
        let kinds: Vec<&str> = end
            .lines()
            .filter_map(|l| l.strip_prefix("event: "))
            .collect();
        assert_eq!(
            kinds,
            [
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed"
            ]
        );
        let last = end.lines().rfind(|l| l.starts_with("data: ")).unwrap();
        let v: Value = serde_json::from_str(&last[6..]).unwrap();
        let r = &v["response"];
        assert_eq!(
            (r["id"].as_str(), r["status"].as_str()),
            (Some("resp_1"), Some("completed"))
        );
        assert_eq!(r["output"][0]["content"][0]["text"], "one two three");
        assert_eq!(r["usage"]["input_tokens"], 12);
        assert_eq!(r["usage"]["output_tokens"], 3);
        assert_eq!(r["usage"]["input_tokens_details"]["cached_tokens"], 8);
        assert_eq!(v["sequence_number"], 9);
    }

    #[test]
    fn an_engines_huge_numbers_never_overflow() {
        let mut said = Said::default();
        let seq = format!(
            r#"{{"type":"response.output_text.delta","sequence_number":{},"delta":"a"}}"#,
            u64::MAX
        );
        note(&mut said, seq.as_bytes()).unwrap();
        delta(&mut said.shape, "b");
        said.shape.prompt_tokens = Some(u64::MAX);
        assert!(!closing(&mut said, u64::MAX, 0).is_empty());
    }

    #[test]
    fn errors_tools_and_reasoning_are_told_apart() {
        let mut said = Said::default();
        assert!(
            note(
                &mut said,
                br#"{"type":"error","code":"x","message":"boom"}"#
            )
            .is_err()
        );
        let said = said_after(&[
            r#"{"type":"response.output_item.added","output_index":0,"item":{"id":"fc_1","type":"function_call"}}"#,
        ]);
        assert!(said.tool_call);
        let said = said_after(&[r#"{"type":"response.reasoning_text.delta","delta":"hm"}"#]);
        assert!(said.reasoning);
    }
}

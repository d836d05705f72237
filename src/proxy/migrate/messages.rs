//! A streamed `/v1/messages` (Anthropic) answer that continues elsewhere, as
//! [`super::responses`] does for Responses: the first worker's events are read for the
//! message and its text block; the continuation is a streamed chat request, and its
//! chunks are written as the first part's sequel: `content_block_delta` events of the
//! same block, then `content_block_stop`, `message_delta` (stop reason, output tokens of
//! every part) and `message_stop` in place of its `[DONE]`.

use serde::Deserialize;
use serde_json::json;

use super::relay::Said;
use crate::prompt::Text;

/// What a Messages stream said besides its text.
#[derive(Debug, Default)]
pub struct Blocks {
    /// `message_start` passed.
    pub started: bool,
    /// The text block being streamed: its index, started and stopped.
    pub index: u64,
    pub block_started: bool,
    pub block_stopped: bool,
    /// The next block's index (one more than the last started).
    pub next: u64,
    /// `message_delta` passed (the answer's end is known).
    pub ended: bool,
    /// The continuation stopped at its token budget.
    pub cut: bool,
    /// The input tokens `message_start` reported (the client's prompt).
    pub input_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct Event<'a> {
    #[serde(rename = "type", borrow, default)]
    kind: Option<Text<'a>>,
    #[serde(default)]
    index: Option<u64>,
    #[serde(borrow, default)]
    content_block: Option<Block<'a>>,
    #[serde(borrow, default)]
    delta: Option<Delta<'a>>,
    #[serde(default)]
    message: Option<Message>,
}

#[derive(Deserialize)]
struct Block<'a> {
    #[serde(rename = "type", borrow, default)]
    kind: Option<Text<'a>>,
}

#[derive(Deserialize)]
struct Delta<'a> {
    #[serde(rename = "type", borrow, default)]
    kind: Option<Text<'a>>,
    #[serde(borrow, default)]
    text: Option<Text<'a>>,
}

#[derive(Deserialize)]
struct Message {
    #[serde(default)]
    usage: Option<Usage>,
}

#[derive(Deserialize)]
struct Usage {
    #[serde(default)]
    input_tokens: Option<u64>,
}

/// What one event of the first worker said, noted in `said`; `Err(())` when it is the
/// engine's error (the part broke). `Ok(true)`: it carried text.
pub fn note(said: &mut Said, data: &[u8]) -> Result<bool, ()> {
    let Ok(ev) = serde_json::from_slice::<Event<'_>>(data) else {
        return Ok(false);
    };
    let blocks = &mut said.blocks;
    match ev.kind.as_deref().unwrap_or("") {
        "error" => return Err(()),
        "message_start" => {
            blocks.started = true;
            blocks.input_tokens = ev
                .message
                .and_then(|m| m.usage)
                .and_then(|u| u.input_tokens);
        }
        "content_block_start" => {
            let index = ev.index.unwrap_or(blocks.next);
            blocks.next = index.saturating_add(1);
            match ev.content_block.as_ref().and_then(|b| b.kind.as_deref()) {
                Some("text") => {
                    blocks.index = index;
                    blocks.block_started = true;
                    blocks.block_stopped = false;
                }
                Some("thinking" | "redacted_thinking") => said.reasoning = true,
                _ => said.tool_call = true,
            }
        }
        "content_block_delta" => match ev.delta.as_ref().and_then(|d| d.kind.as_deref()) {
            Some("text_delta") => {
                if let Some(t) = ev.delta.and_then(|d| d.text).filter(|t| !t.is_empty()) {
                    said.text.push_str(&t);
                    return Ok(true);
                }
            }
            Some("thinking_delta" | "signature_delta") => said.reasoning = true,
            _ => said.tool_call = true,
        },
        "content_block_stop" if ev.index == Some(blocks.index) => blocks.block_stopped = true,
        "message_delta" => {
            blocks.ended = true;
            said.finished = true;
        }
        "message_stop" => said.done = true,
        _ => {}
    }
    Ok(false)
}

fn event(kind: &str, data: serde_json::Value) -> Vec<u8> {
    super::relay::named_event(kind, &data)
}

/// A continuation's text written as the first part's `content_block_delta` (after a
/// text block's start when none is open).
pub fn delta(blocks: &mut Blocks, text: &str) -> Vec<u8> {
    let mut out = Vec::new();
    if !blocks.block_started || blocks.block_stopped {
        blocks.index = blocks.next;
        blocks.next = blocks.next.saturating_add(1);
        blocks.block_started = true;
        blocks.block_stopped = false;
        out.extend(event(
            "content_block_start",
            json!({"type": "content_block_start", "index": blocks.index,
                "content_block": {"type": "text", "text": ""}}),
        ));
    }
    out.extend(event(
        "content_block_delta",
        json!({"type": "content_block_delta", "index": blocks.index,
            "delta": {"type": "text_delta", "text": text}}),
    ));
    out
}

/// The events that end the message (those not passed yet): the text block's stop,
/// `message_delta` with the stop reason (`max_tokens` when the budget ran out) and
/// `output_tokens` (`tokens`: every part's), `message_stop`.
pub fn closing(said: &mut Said, tokens: u64) -> Vec<u8> {
    let blocks = &mut said.blocks;
    let mut out = Vec::new();
    if blocks.block_started && !blocks.block_stopped {
        blocks.block_stopped = true;
        out.extend(event(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": blocks.index}),
        ));
    }
    if !blocks.ended {
        blocks.ended = true;
        let reason = if blocks.cut { "max_tokens" } else { "end_turn" };
        out.extend(event(
            "message_delta",
            json!({"type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": null},
                "usage": {"output_tokens": tokens}}),
        ));
    }
    out.extend(event("message_stop", json!({"type": "message_stop"})));
    said.done = true;
    said.finished = true;
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_part_is_read_and_the_continuation_closes_it() {
        let mut said = Said::default();
        for e in [
            r#"{"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","content":[],"usage":{"input_tokens":12,"output_tokens":1}}}"#,
            r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
            r#"{"type":"ping"}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"one "}}"#,
        ] {
            note(&mut said, e.as_bytes()).unwrap();
        }
        assert_eq!(said.text, "one ");
        assert_eq!(said.blocks.input_tokens, Some(12));
        let d = String::from_utf8(delta(&mut said.blocks, "two")).unwrap();
        assert!(
            d.starts_with("event: content_block_delta\n"),
            "the open block: {d}"
        );
        said.blocks.cut = true;
        let end = String::from_utf8(closing(&mut said, 2)).unwrap();
        let kinds: Vec<&str> = end
            .lines()
            .filter_map(|l| l.strip_prefix("event: "))
            .collect();
        assert_eq!(
            kinds,
            ["content_block_stop", "message_delta", "message_stop"]
        );
        assert!(
            end.contains(r#""stop_reason":"max_tokens""#) && end.contains(r#""output_tokens":2"#)
        );
    }

    #[test]
    fn errors_tools_and_thinking_are_told_apart() {
        let mut said = Said::default();
        let err = br#"{"type":"error","error":{"type":"overloaded_error","message":"x"}}"#;
        assert!(note(&mut said, err).is_err());
        let tool = br#"{"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"t","name":"f","input":{}}}"#;
        note(&mut said, tool).unwrap();
        assert!(said.tool_call);
        let mut said = Said::default();
        let think = br#"{"type":"content_block_start","index":0,"content_block":{"type":"thinking","thinking":""}}"#;
        note(&mut said, think).unwrap();
        assert!(said.reasoning);
        // A stopped text block: the continuation's text opens the next one.
        let mut said = Said::default();
        let start = br#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#;
        note(&mut said, start).unwrap();
        note(&mut said, br#"{"type":"content_block_stop","index":0}"#).unwrap();
        let d = String::from_utf8(delta(&mut said.blocks, "x")).unwrap();
        assert!(d.starts_with("event: content_block_start\n") && d.contains(r#""index":1"#));
        // An engine's huge index never overflows.
        let mut said = Said::default();
        let huge = format!(
            r#"{{"type":"content_block_start","index":{},"content_block":{{"type":"text"}}}}"#,
            u64::MAX
        );
        note(&mut said, huge.as_bytes()).unwrap();
        note(
            &mut said,
            br#"{"type":"content_block_stop","index":18446744073709551615}"#,
        )
        .unwrap();
        assert!(!delta(&mut said.blocks, "x").is_empty());
    }
}

//! One stored answer: the engine's own bytes and content type; whether a finished body
//! may be stored; how a hit is replayed.

use bytes::{Buf, BufMut, Bytes};
use http::header::{self, HeaderValue};
use http::{Response, StatusCode};
use http_body_util::BodyExt;
use serde::Deserialize;

use crate::error::ProxyBody;

/// Marks the stored layout (a Redis value that does not start with it is garbage).
const MAGIC: &[u8; 4] = b"CAR1";
/// Bytes a stored entry costs beyond its body and content type (key, bookkeeping); the
/// in-process store's weight per entry.
pub const OVERHEAD_BYTES: usize = 128;

/// An answer as the engine sent it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub content_type: HeaderValue,
    /// The whole body, byte for byte (an SSE answer: every event, in order).
    pub body: Bytes,
}

/// Why a finished answer is not stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotStored {
    /// Not JSON / SSE as expected, or the stream has no end marker (`data: [DONE]`,
    /// `message_stop`, `response.completed`): cut or unknown.
    Incomplete,
    /// The answer reports an error (`finish_reason: "error"`, an `error` member or
    /// event, a Responses status other than `completed`).
    Failed,
}

impl Entry {
    /// Whether the answer is an SSE stream.
    pub fn is_sse(&self) -> bool {
        is_sse(&self.content_type)
    }

    /// Bytes it costs to keep.
    pub fn weight(&self) -> usize {
        self.body.len() + self.content_type.len() + OVERHEAD_BYTES
    }

    /// `CAR1`, u16 content-type length (big-endian), content type, body.
    pub fn encode(&self) -> Vec<u8> {
        let ct = self.content_type.as_bytes();
        let mut out = Vec::with_capacity(6 + ct.len() + self.body.len());
        out.put_slice(MAGIC);
        out.put_u16(ct.len() as u16);
        out.put_slice(ct);
        out.put_slice(&self.body);
        out
    }

    /// The inverse of [`Entry::encode`]; `Err` says what is wrong with the bytes.
    pub fn decode(mut b: Bytes) -> Result<Entry, &'static str> {
        if b.len() < 6 || &b[..4] != MAGIC {
            return Err("not a cache entry (wrong magic)");
        }
        b.advance(4);
        let n = b.get_u16() as usize;
        if b.len() < n {
            return Err("truncated content type");
        }
        let ct = b.split_to(n);
        let content_type =
            HeaderValue::from_maybe_shared(ct).map_err(|_| "content type is not a header value")?;
        if !is_sse(&content_type) && !is_json(&content_type) {
            return Err("content type is neither JSON nor SSE");
        }
        Ok(Entry {
            content_type,
            body: b,
        })
    }

    /// The client's response: status 200, the stored content type, and the body — an
    /// SSE answer frame by frame, one event per frame, byte-identical to the engine's.
    pub fn replay(&self) -> Response<ProxyBody> {
        let body: ProxyBody = if self.is_sse() {
            let frames: Vec<Result<_, crate::error::BoxError>> = events(&self.body)
                .map(|e| Ok(http_body::Frame::data(e)))
                .collect();
            http_body_util::StreamBody::new(futures_util::stream::iter(frames)).boxed()
        } else {
            http_body_util::Full::new(self.body.clone())
                .map_err(|never| match never {})
                .boxed()
        };
        let mut resp = Response::new(body);
        *resp.status_mut() = StatusCode::OK;
        let h = resp.headers_mut();
        h.insert(header::CONTENT_TYPE, self.content_type.clone());
        if self.is_sse() {
            h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
            h.insert("x-accel-buffering", HeaderValue::from_static("no"));
        }
        resp
    }
}

/// `text/event-stream`, with or without parameters.
pub fn is_sse(ct: &HeaderValue) -> bool {
    ct.as_bytes()
        .get(..17)
        .is_some_and(|p| p.eq_ignore_ascii_case(b"text/event-stream"))
}

/// `application/json`, with or without parameters.
pub fn is_json(ct: &HeaderValue) -> bool {
    ct.as_bytes()
        .get(..16)
        .is_some_and(|p| p.eq_ignore_ascii_case(b"application/json"))
}

/// The SSE events of `body`, each with its terminating blank line (`\n\n` or
/// `\r\n\r\n`); a trailing partial event is the last item. Zero-copy slices.
pub fn events(body: &Bytes) -> impl Iterator<Item = Bytes> + '_ {
    let mut start = 0;
    std::iter::from_fn(move || {
        if start >= body.len() {
            return None;
        }
        let rest = &body[start..];
        let mut i = 0;
        let end = loop {
            match memchr::memchr(b'\n', &rest[i..]) {
                None => break rest.len(),
                Some(j) => {
                    let after = i + j + 1;
                    match rest.get(after) {
                        Some(b'\n') => break after + 1,
                        Some(b'\r') if rest.get(after + 1) == Some(&b'\n') => break after + 2,
                        _ => i = after,
                    }
                }
            }
        };
        let ev = body.slice(start..start + end);
        start += end;
        Some(ev)
    })
}

/// Whether a finished 200 body may be stored: a JSON answer that parses and reports no
/// error, or an SSE stream that reached its end marker with no error event.
pub fn verdict(body: &[u8], sse: bool) -> Result<(), NotStored> {
    if sse {
        sse_verdict(body)
    } else {
        // A struct reads only from an object; a cut body does not parse.
        let s: Signals<'_> = serde_json::from_slice(body).map_err(|_| NotStored::Incomplete)?;
        if signals_error(&s) {
            return Err(NotStored::Failed);
        }
        // A whole answer says how each choice ended, and a Responses object that it
        // completed (not `queued` / `in_progress`: a background run).
        let unfinished = s.choices.iter().any(|c| c.finish_reason.is_none())
            || s.status.as_deref().is_some_and(|st| st != "completed");
        if unfinished {
            return Err(NotStored::Incomplete);
        }
        Ok(())
    }
}

/// The members of an answer or event that say it failed.
#[derive(Deserialize)]
struct Signals<'a> {
    #[serde(default, borrow, rename = "type")]
    kind: Option<std::borrow::Cow<'a, str>>,
    #[serde(default)]
    error: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    choices: Vec<Choice<'a>>,
    /// Responses: the response object itself, or `response` inside an event.
    #[serde(default, borrow)]
    status: Option<std::borrow::Cow<'a, str>>,
    #[serde(default, borrow)]
    response: Option<Box<Signals<'a>>>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(default, borrow)]
    finish_reason: Option<std::borrow::Cow<'a, str>>,
}

fn signals_error(s: &Signals<'_>) -> bool {
    s.error.is_some()
        || matches!(
            s.kind.as_deref(),
            Some("error" | "response.failed" | "response.incomplete")
        )
        || s.choices
            .iter()
            // vLLM and SGLang end an aborted request with `abort`.
            .any(|c| matches!(c.finish_reason.as_deref(), Some("error" | "abort")))
        || s.status
            .as_deref()
            .is_some_and(|st| matches!(st, "failed" | "incomplete" | "cancelled"))
        || s.response.as_deref().is_some_and(signals_error)
}

fn sse_verdict(body: &[u8]) -> Result<(), NotStored> {
    let mut ended = false;
    for line in body.split(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if ended && !line.is_empty() {
            // Only blank lines may follow the end marker.
            if !line.starts_with(b":") {
                return Err(NotStored::Incomplete);
            }
        }
        if let Some(ev) = line.strip_prefix(b"event:") {
            let ev = ev.trim_ascii();
            if matches!(ev, b"error" | b"response.failed" | b"response.incomplete") {
                return Err(NotStored::Failed);
            }
            continue;
        }
        let Some(data) = line.strip_prefix(b"data:") else {
            continue;
        };
        let data = data.trim_ascii();
        if data == b"[DONE]" {
            ended = true;
            continue;
        }
        let Ok(s) = serde_json::from_slice::<Signals<'_>>(data) else {
            // Not JSON we can read (an engine's comment-like data): not ours to judge.
            continue;
        };
        if signals_error(&s) {
            return Err(NotStored::Failed);
        }
        if matches!(
            s.kind.as_deref(),
            Some("message_stop" | "response.completed")
        ) {
            ended = true;
        }
    }
    if ended {
        Ok(())
    } else {
        Err(NotStored::Incomplete)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(ct: &'static str, body: &'static str) -> Entry {
        Entry {
            content_type: HeaderValue::from_static(ct),
            body: Bytes::from_static(body.as_bytes()),
        }
    }

    #[test]
    fn encode_decode_round_trip_and_garbage() {
        let e = entry("application/json", "{\"a\":1}");
        assert_eq!(Entry::decode(Bytes::from(e.encode())).unwrap(), e);
        let s = entry("text/event-stream; charset=utf-8", "data: x\n\n");
        assert_eq!(Entry::decode(Bytes::from(s.encode())).unwrap(), s);
        for bad in [
            &b""[..],
            b"CAR1",
            b"XXXX\0\0",
            b"CAR1\0\xffab",
            b"CAR1\0\x04text",
        ] {
            assert!(
                Entry::decode(Bytes::copy_from_slice(bad)).is_err(),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn events_split_at_blank_lines_and_rejoin_exactly() {
        let body =
            Bytes::from_static(b"data: a\n\nevent: x\r\ndata: b\r\n\r\ndata: c\n\ndata: tail");
        let evs: Vec<Bytes> = events(&body).collect();
        assert_eq!(evs.len(), 4, "{evs:?}");
        assert_eq!(&evs[0][..], b"data: a\n\n");
        assert_eq!(&evs[1][..], b"event: x\r\ndata: b\r\n\r\n");
        assert_eq!(evs.concat(), body.to_vec());
    }

    #[test]
    fn only_complete_successful_answers_are_stored() {
        let ok_json = r#"{"id":"x","choices":[{"index":0,"finish_reason":"stop","message":{"content":"hi"}}]}"#;
        assert_eq!(verdict(ok_json.as_bytes(), false), Ok(()));
        assert_eq!(
            verdict(
                br#"{"id":"msg","type":"message","stop_reason":"end_turn"}"#,
                false
            ),
            Ok(())
        );
        assert_eq!(
            verdict(
                br#"{"id":"r","object":"response","status":"completed"}"#,
                false
            ),
            Ok(())
        );
        assert_eq!(
            verdict(br#"{"id":"x","choices":[{"finish_reason":"stop"}]"#, false),
            Err(NotStored::Incomplete)
        );
        assert_eq!(verdict(b"[1]", false), Err(NotStored::Incomplete));
        assert_eq!(
            verdict(br#"{"choices":[{"finish_reason":"error"}]}"#, false),
            Err(NotStored::Failed)
        );
        assert_eq!(
            verdict(br#"{"error":{"message":"x"}}"#, false),
            Err(NotStored::Failed)
        );
        assert_eq!(
            verdict(br#"{"type":"error","error":{}}"#, false),
            Err(NotStored::Failed)
        );
        assert_eq!(
            verdict(br#"{"object":"response","status":"failed"}"#, false),
            Err(NotStored::Failed)
        );
        for unfinished in [
            &br#"{"object":"response","status":"queued"}"#[..],
            br#"{"object":"response","status":"in_progress"}"#,
            br#"{"choices":[{"finish_reason":null,"message":{}}]}"#,
            br#"{"choices":[{"message":{}}]}"#,
        ] {
            assert_eq!(verdict(unfinished, false), Err(NotStored::Incomplete));
        }
        assert_eq!(
            verdict(br#"{"choices":[{"finish_reason":"abort"}]}"#, false),
            Err(NotStored::Failed)
        );
        let aborted =
            b"data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"abort\"}]}\n\ndata: [DONE]\n\n";
        assert_eq!(verdict(aborted, true), Err(NotStored::Failed));

        let chat = b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n";
        assert_eq!(verdict(chat, true), Ok(()));
        let cut = &chat[..chat.len() - 16];
        assert_eq!(verdict(cut, true), Err(NotStored::Incomplete));
        let failed =
            b"data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"error\"}]}\n\ndata: [DONE]\n\n";
        assert_eq!(verdict(failed, true), Err(NotStored::Failed));
        let anthropic = b"event: message_start\ndata: {\"type\":\"message_start\"}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
        assert_eq!(verdict(anthropic, true), Ok(()));
        let anthropic_err = b"event: error\ndata: {\"type\":\"error\",\"error\":{}}\n\n";
        assert_eq!(verdict(anthropic_err, true), Err(NotStored::Failed));
        let responses = b"event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"status\":\"completed\"}}\n\n";
        assert_eq!(verdict(responses, true), Ok(()));
        let after_end = b"data: [DONE]\n\ndata: {\"x\":1}\n\n";
        assert_eq!(verdict(after_end, true), Err(NotStored::Incomplete));
    }
}

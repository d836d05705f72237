//! Reading a request log: one JSON object per line, in one of two formats.
//!
//! - **requests**: `{"timestamp_ms": 1200, "path": "/v1/chat/completions", "body": {…},
//!   "duration_ms": 850, "output_tokens": 120}` — only `body` is required. `path` is one
//!   of the four routed endpoints (default: from the body's shape: `messages` with a
//!   top-level `system` → `/v1/messages`, `messages` → `/v1/chat/completions`, `prompt`
//!   → `/v1/completions`, `input` → `/v1/responses`). A line that is a bare request body
//!   (no `body` key) is read the same way. `timestamp_ms` is the arrival in ms from any
//!   origin; `duration_ms` the request's time to its last byte; `output_tokens` the
//!   tokens generated (default: the body's `max_tokens` / `max_completion_tokens` /
//!   `max_output_tokens`, else `--max-output-tokens`).
//! - **mooncake**: `{"timestamp": 0, "input_length": 6758, "output_length": 500,
//!   "hash_ids": [0, 1, …]}` — expanded into prompt text by [`super::mooncake`] and sent
//!   as the chat body `trace-matrix` sends.
//!
//! A line that cannot be read is an error naming its line number and what is wrong
//! (never a panic); with `skip_bad` it is skipped and counted instead. Blank lines are
//! ignored. No I/O but reading the given text.

use bytes::Bytes;
use serde_json::{Map, Value, json};

use super::mooncake::TraceRecord;
use crate::prompt::Endpoint;

/// Which format a log is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Decided by the first non-blank line: `hash_ids` means mooncake.
    Auto,
    /// Request bodies (see the module docs).
    Requests,
    /// Mooncake trace lines.
    Mooncake,
}

/// One logged request, ready to route.
#[derive(Debug, Clone)]
pub struct LoggedRequest {
    /// 1-based line number in the log.
    pub line: usize,
    /// Arrival, in ms from the log's origin; `None` = not logged (paced by `--rate`).
    pub arrival_ms: Option<f64>,
    pub endpoint: Endpoint,
    /// The request body as the router would receive it.
    pub body: Bytes,
    /// Tokens generated (capped by the reader's `max_output_tokens`).
    pub output_tokens: u64,
    /// Time from arrival to the last byte, in ms, when the log gives it.
    pub duration_ms: Option<f64>,
}

/// What a log held.
#[derive(Debug, Default)]
pub struct Log {
    pub requests: Vec<LoggedRequest>,
    /// Lines skipped as unreadable (only with `skip_bad`).
    pub skipped: usize,
    /// The first skipped line's error, to show the user.
    pub first_skip: Option<String>,
}

/// A line of the log that cannot be read: `line` (1-based) and why.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("line {line}: {message}")]
pub struct LineError {
    pub line: usize,
    pub message: String,
}

/// Reads `text` (the whole log) in `format`; at most `limit` requests. `max_output_tokens`
/// caps each request's generated tokens (as trace-matrix does). Stops at the first bad
/// line unless `skip_bad`.
pub fn read(
    text: &str,
    format: Format,
    limit: Option<usize>,
    max_output_tokens: u64,
    skip_bad: bool,
) -> Result<Log, LineError> {
    let mut log = Log::default();
    let mut format = format;
    for (i, raw) in text.lines().enumerate() {
        if limit.is_some_and(|l| log.requests.len() >= l) {
            break;
        }
        let line = i + 1;
        let raw = raw.trim();
        if raw.is_empty() {
            continue;
        }
        let parsed = serde_json::from_str::<Value>(raw)
            .map_err(|e| format!("not JSON: {e}"))
            .and_then(|v| {
                if format == Format::Auto {
                    format = if v.get("hash_ids").is_some() {
                        Format::Mooncake
                    } else {
                        Format::Requests
                    };
                }
                match format {
                    Format::Mooncake => mooncake_line(v, line, max_output_tokens),
                    _ => request_line(v, line, max_output_tokens),
                }
            });
        match parsed {
            Ok(r) => log.requests.push(r),
            Err(message) if skip_bad => {
                log.skipped += 1;
                log.first_skip
                    .get_or_insert_with(|| format!("line {line}: {message}"));
            }
            Err(message) => return Err(LineError { line, message }),
        }
    }
    Ok(log)
}

fn mooncake_line(v: Value, line: usize, cap: u64) -> Result<LoggedRequest, String> {
    let r: TraceRecord =
        serde_json::from_value(v).map_err(|e| format!("not a Mooncake trace line: {e}"))?;
    let max_tokens = r.output_length.min(cap).max(1);
    // The body trace-matrix's replay sends (bench/src/replay.rs), so the router routes
    // on the same text.
    let body = json!({
        "model": "m",
        "messages": [{"role": "user", "content": r.prompt(0)}],
        "max_tokens": max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
        "ignore_eos": true,
    });
    Ok(LoggedRequest {
        line,
        arrival_ms: Some(r.timestamp as f64),
        endpoint: Endpoint::ChatCompletions,
        body: Bytes::from(body.to_string()),
        output_tokens: max_tokens,
        duration_ms: None,
    })
}

fn request_line(v: Value, line: usize, cap: u64) -> Result<LoggedRequest, String> {
    let Value::Object(mut obj) = v else {
        return Err("expected a JSON object".into());
    };
    let (body, wrapped) = match obj.remove("body") {
        Some(Value::Object(b)) => (b, true),
        Some(_) => return Err("`body` must be a JSON object (the request body)".into()),
        None => (std::mem::take(&mut obj), false),
    };
    let meta = if wrapped { &obj } else { &Map::new() };
    let number = |key: &str| -> Result<Option<f64>, String> {
        match meta.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) => match n.as_f64() {
                Some(x) if x.is_finite() && x >= 0.0 => Ok(Some(x)),
                _ => Err(format!("`{key}` must be a number >= 0, got {n}")),
            },
            Some(other) => Err(format!("`{key}` must be a number >= 0, got {other}")),
        }
    };
    let arrival_ms = number("timestamp_ms")?;
    let duration_ms = number("duration_ms")?;
    let endpoint = match meta.get("path") {
        Some(Value::String(p)) => Endpoint::from_path(p).ok_or_else(|| {
            format!(
                "path {p:?} is not a routed endpoint (/v1/chat/completions, /v1/completions, \
                 /v1/messages, /v1/responses)"
            )
        })?,
        Some(other) => return Err(format!("`path` must be a string, got {other}")),
        None => endpoint_of(&body).ok_or(
            "cannot tell the endpoint: give `path`, or a body with `messages`, `prompt` or `input`",
        )?,
    };
    let logged_output = number("output_tokens")?.map(|x| x as u64);
    let asked = ["max_tokens", "max_completion_tokens", "max_output_tokens"]
        .iter()
        .find_map(|k| body.get(*k).and_then(Value::as_u64));
    let output_tokens = logged_output.or(asked).unwrap_or(cap).min(cap).max(1);
    Ok(LoggedRequest {
        line,
        arrival_ms,
        endpoint,
        body: Bytes::from(Value::Object(body).to_string()),
        output_tokens,
        duration_ms,
    })
}

/// The endpoint a bare body is for, by its shape.
fn endpoint_of(body: &Map<String, Value>) -> Option<Endpoint> {
    if body.contains_key("messages") {
        Some(if body.contains_key("system") {
            Endpoint::Messages
        } else {
            Endpoint::ChatCompletions
        })
    } else if body.contains_key("prompt") {
        Some(Endpoint::Completions)
    } else if body.contains_key("input") {
        Some(Endpoint::Responses)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_wrapped_and_bare_bodies_with_their_metadata() {
        let text = r#"
{"timestamp_ms": 1200, "path": "/v1/messages", "body": {"system": "s", "messages": [], "max_tokens": 9}, "duration_ms": 850}

{"messages": [{"role": "user", "content": "hi"}]}
"#;
        let log = read(text, Format::Auto, None, 64, false).unwrap();
        assert_eq!(log.requests.len(), 2);
        let a = &log.requests[0];
        assert_eq!((a.line, a.endpoint), (2, Endpoint::Messages));
        assert_eq!((a.arrival_ms, a.duration_ms), (Some(1200.0), Some(850.0)));
        assert_eq!(a.output_tokens, 9);
        let b = &log.requests[1];
        assert_eq!(
            (b.endpoint, b.arrival_ms, b.output_tokens),
            (Endpoint::ChatCompletions, None, 64)
        );
    }

    #[test]
    fn mooncake_lines_become_the_chat_body_trace_matrix_sends() {
        let text =
            r#"{"timestamp": 5, "input_length": 600, "output_length": 500, "hash_ids": [1, 2]}"#;
        let log = read(text, Format::Auto, None, 64, false).unwrap();
        let r = &log.requests[0];
        assert_eq!((r.arrival_ms, r.output_tokens), (Some(5.0), 64));
        let v: Value = serde_json::from_slice(&r.body).unwrap();
        let content = v["messages"][0]["content"].as_str().unwrap();
        assert_eq!(content.split_whitespace().count(), 600);
    }

    #[test]
    fn a_bad_line_names_its_number_and_the_problem() {
        let text = "{\"messages\": []}\n{\"body\": 3}\nnot json\n";
        let e = read(text, Format::Requests, None, 64, false).unwrap_err();
        assert_eq!(e.line, 2);
        assert!(e.message.contains("`body` must be a JSON object"), "{e}");
        let log = read(text, Format::Requests, None, 64, true).unwrap();
        assert_eq!((log.requests.len(), log.skipped), (1, 2));
        let e = read(
            "{\"path\": \"/x\", \"body\": {}}",
            Format::Requests,
            None,
            64,
            false,
        )
        .unwrap_err();
        assert!(e.message.contains("not a routed endpoint"), "{e}");
        let e = read("{\"hash_ids\": \"x\"}", Format::Auto, None, 64, false).unwrap_err();
        assert!(e.message.contains("not a Mooncake trace line"), "{e}");
    }

    #[test]
    fn limit_counts_requests_not_lines() {
        let text = "\n{\"prompt\": \"a\"}\n\n{\"prompt\": \"b\"}\n{\"prompt\": \"c\"}\n";
        let log = read(text, Format::Requests, Some(2), 64, false).unwrap();
        assert_eq!(log.requests.len(), 2);
        assert_eq!(log.requests[1].endpoint, Endpoint::Completions);
    }
}

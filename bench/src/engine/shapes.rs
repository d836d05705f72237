//! Response bodies in vLLM's shapes (chat and text completions, whole or as SSE
//! chunks) and Anthropic's (messages, events, errors), built from a request's
//! identity ([`Shape`]) and its token counts.

use bytes::Bytes;
use hyper::{Response, StatusCode};
use serde_json::{Value, json};

use super::http::json_response;
use super::physics::PromptWork;
use super::{Endpoint, RespBody, Usage};

/// Anthropic `usage`: `input_tokens` excludes the cached part, which is
/// `cache_read_input_tokens` (Anthropic's meaning, and what the router's usage reader
/// adds back up); nothing is reported as written to the cache.
pub(super) fn anthropic_usage(u: &Usage) -> Value {
    let cached = u.prompt_tokens_details.map_or(0, |d| d.cached_tokens);
    json!({
        "input_tokens": u.prompt_tokens - cached,
        "output_tokens": u.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    })
}

/// `{"type":"error","error":{"type","message"}}`, Anthropic's error body.
pub(super) fn anthropic_error(status: StatusCode, message: &str) -> Response<RespBody> {
    let kind = match status {
        StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
        StatusCode::NOT_FOUND => "not_found_error",
        StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
        _ => "invalid_request_error",
    };
    json_response(
        status,
        &json!({"type": "error", "error": {"type": kind, "message": message}}),
    )
}

pub(super) fn work_usage(work: &[PromptWork], cached: &[u64], n: u64) -> Usage {
    let prompt: u64 = work.iter().map(|p| p.n_tokens as u64).sum();
    Usage::new(prompt, n * work.len() as u64, cached.iter().sum())
}

/// Response identity and the JSON shapes built from it.
#[derive(Debug, Clone)]
pub(super) struct Shape {
    pub(super) endpoint: Endpoint,
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) model: String,
}

impl Shape {
    fn object_chunk(&self) -> &'static str {
        match self.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completions | Endpoint::Messages => "text_completion",
        }
    }

    fn sse(value: &Value) -> Bytes {
        Bytes::from(format!("data: {value}\n\n"))
    }

    /// One Anthropic SSE event: `event: NAME` then its `data:` line.
    pub(super) fn event(name: &str, value: &Value) -> Bytes {
        Bytes::from(format!("event: {name}\ndata: {value}\n\n"))
    }

    /// An Anthropic message with `content` and `stop_reason` (null while streaming).
    fn message(&self, content: Value, stop_reason: Value, usage: &Usage) -> Value {
        json!({
            "id": self.id, "type": "message", "role": "assistant", "content": content,
            "model": self.model, "stop_reason": stop_reason, "stop_sequence": null,
            "usage": anthropic_usage(usage),
        })
    }

    pub(super) fn message_start(&self, usage: &Usage) -> Bytes {
        Self::event(
            "message_start",
            &json!({"type": "message_start",
                    "message": self.message(json!([]), Value::Null, usage)}),
        )
    }

    pub(super) fn role_chunk(&self, index: usize) -> Bytes {
        Self::sse(&json!({
            "id": self.id, "object": self.object_chunk(), "created": self.created, "model": self.model,
            "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                         "logprobs": null, "finish_reason": null}],
        }))
    }

    /// Choice `index`'s next token (`text`), with the finish reason when `last`.
    pub(super) fn token_chunk(&self, index: usize, text: &str, last: bool) -> Bytes {
        let finish = if last { json!("length") } else { Value::Null };
        let choice = match self.endpoint {
            Endpoint::Chat | Endpoint::Messages => {
                json!({"index": index, "delta": {"content": text},
                                     "logprobs": null, "finish_reason": finish})
            }
            Endpoint::Completions => json!({"index": index, "text": text, "logprobs": null,
                                            "finish_reason": finish, "stop_reason": null}),
        };
        Self::sse(&json!({
            "id": self.id, "object": self.object_chunk(), "created": self.created,
            "model": self.model, "choices": [choice],
        }))
    }

    /// The final usage chunk vLLM sends when `stream_options.include_usage` is true.
    pub(super) fn usage_chunk(&self, usage: &Usage) -> Bytes {
        Self::sse(&json!({
            "id": self.id, "object": self.object_chunk(), "created": self.created,
            "model": self.model, "choices": [], "usage": usage,
        }))
    }

    /// The whole answer: `texts[i]` is prompt `i`'s, `n` tokens.
    pub(super) fn full_response(
        &self,
        work: &[PromptWork],
        cached: &[u64],
        n: u64,
        texts: &[String],
    ) -> Value {
        if self.endpoint == Endpoint::Messages {
            return self.message(
                json!([{"type": "text", "text": texts.first()}]),
                json!("max_tokens"),
                &work_usage(work, cached, n),
            );
        }
        let choices: Vec<Value> = texts
            .iter()
            .enumerate()
            .map(|(i, text)| match self.endpoint {
                Endpoint::Chat | Endpoint::Messages => json!({
                    "index": i,
                    "message": {"role": "assistant", "content": text, "tool_calls": []},
                    "logprobs": null, "finish_reason": "length", "stop_reason": null,
                }),
                Endpoint::Completions => json!({
                    "index": i, "text": text, "logprobs": null,
                    "finish_reason": "length", "stop_reason": null,
                }),
            })
            .collect();
        let object = match self.endpoint {
            Endpoint::Chat | Endpoint::Messages => "chat.completion",
            Endpoint::Completions => "text_completion",
        };
        json!({
            "id": self.id, "object": object, "created": self.created, "model": self.model,
            "choices": choices, "usage": work_usage(work, cached, n),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(endpoint: Endpoint) -> Shape {
        Shape {
            endpoint,
            id: "chatcmpl-x-1".into(),
            created: 1,
            model: "m".into(),
        }
    }

    fn parse_sse(b: &Bytes) -> Value {
        let s = std::str::from_utf8(b).unwrap();
        let payload = s
            .strip_prefix("data: ")
            .unwrap()
            .strip_suffix("\n\n")
            .unwrap();
        serde_json::from_str(payload).unwrap()
    }

    #[test]
    fn usage_chunk_has_empty_choices_and_cached_tokens() {
        let v = parse_sse(&shape(Endpoint::Chat).usage_chunk(&Usage::new(100, 7, 64)));
        assert_eq!(v["object"], "chat.completion.chunk");
        assert_eq!(v["choices"], json!([]));
        assert_eq!(v["usage"]["prompt_tokens"], 100);
        assert_eq!(v["usage"]["completion_tokens"], 7);
        assert_eq!(v["usage"]["total_tokens"], 107);
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 64);
    }

    #[test]
    fn token_chunks_follow_vllm_shapes() {
        let chat = parse_sse(&shape(Endpoint::Chat).token_chunk(0, " the", true));
        assert_eq!(chat["choices"][0]["delta"]["content"], " the");
        assert_eq!(chat["choices"][0]["finish_reason"], "length");
        let cmpl = parse_sse(&shape(Endpoint::Completions).token_chunk(0, " of", false));
        assert_eq!(cmpl["object"], "text_completion");
        assert_eq!(cmpl["choices"][0]["text"], " of");
        assert!(cmpl["choices"][0]["finish_reason"].is_null());
    }
}

//! The simulated tokenizer: one token per whitespace-separated word ([`token_id`],
//! [`token_word`]), and the endpoints answered from it at once: vLLM's `/tokenize`,
//! `/detokenize` and render endpoints, Anthropic's `count_tokens`.

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use serde_json::{Map, Value, json};
use std::sync::atomic::Ordering;

use super::http::{error_response, json_response};
use super::shapes::anthropic_error;
use super::template::{anthropic_to_chat, chat_prompt, chat_template, completion_prompts};
use super::{Endpoint, Engine, MAX_MODEL_LEN, RespBody};
use crate::prompts::WORDS;

/// Size of the simulated vocabulary (Qwen2.5's): every token id is below it.
pub const VOCAB_SIZE: u32 = 151_936;

/// The chat template's role markers, which get fixed ids right after [`WORDS`].
const TEMPLATE_WORDS: [&str; 5] = [
    "<|im_start|>system",
    "<|im_start|>user",
    "<|im_start|>assistant",
    "<|im_start|>tool",
    "<|im_end|>",
];

/// First id of the hashed part of the vocabulary; ids below it are fixed words.
const HASHED_IDS_START: u32 = 1024;

/// The token id of one whitespace-separated word (the engine's tokenizer, see the
/// module docs): the prompt words of the traces (`prompts::WORDS`) are ids 0–255 in
/// that order, the chat template's role markers 256–260, a word written `<|tok_N|>`
/// is id `N` (what [`token_word`] makes of an id it cannot spell), and any other word
/// is xxh3 of its bytes mapped into `1024..VOCAB_SIZE`. Stable across engines, runs
/// and machines.
pub fn token_id(word: &str) -> u32 {
    static FIXED: std::sync::OnceLock<std::collections::HashMap<&'static str, u32>> =
        std::sync::OnceLock::new();
    let fixed = FIXED.get_or_init(|| {
        WORDS
            .iter()
            .chain(TEMPLATE_WORDS.iter())
            .enumerate()
            .map(|(i, w)| (*w, i as u32))
            .collect()
    });
    if let Some(&id) = fixed.get(word) {
        return id;
    }
    if let Some(n) = word
        .strip_prefix("<|tok_")
        .and_then(|r| r.strip_suffix("|>"))
        .and_then(|n| n.parse::<u32>().ok())
        .filter(|&n| n < VOCAB_SIZE)
    {
        return n;
    }
    let span = u64::from(VOCAB_SIZE - HASHED_IDS_START);
    HASHED_IDS_START + (xxhash_rust::xxh3::xxh3_64(word.as_bytes()) % span) as u32
}

/// The word of a token id: a fixed word for ids below 261, `<|tok_N|>` for any
/// other id of the vocabulary (hashed ids cannot be inverted; [`token_id`] maps that
/// spelling back to `N`), `None` past [`VOCAB_SIZE`].
pub fn token_word(id: u64) -> Option<String> {
    if id >= u64::from(VOCAB_SIZE) {
        return None;
    }
    let i = id as usize;
    Some(if i < WORDS.len() {
        WORDS[i].to_owned()
    } else if i < WORDS.len() + TEMPLATE_WORDS.len() {
        TEMPLATE_WORDS[i - WORDS.len()].to_owned()
    } else {
        format!("<|tok_{id}|>")
    })
}

/// Token ids of a prompt text (one per whitespace-separated word).
pub fn tokenize_text(text: &str) -> Vec<u32> {
    text.split_whitespace().map(token_id).collect()
}

/// The JSON object of a request body, or the 4xx status and message.
fn json_object(
    body: Result<Bytes, (StatusCode, String)>,
) -> Result<Map<String, Value>, (StatusCode, String)> {
    match serde_json::from_slice::<Value>(&body?) {
        Ok(Value::Object(obj)) => Ok(obj),
        Ok(_) => Err((
            StatusCode::BAD_REQUEST,
            "request body must be a JSON object".into(),
        )),
        Err(e) => Err((
            StatusCode::BAD_REQUEST,
            format!("body is not valid JSON: {e}"),
        )),
    }
}

/// vLLM's `GenerateRequest` (what its render endpoints answer) for one prompt.
fn generate_request(
    id: String,
    token_ids: Vec<u32>,
    req: &Map<String, Value>,
    model: &str,
) -> Value {
    let present = |k: &str| req.get(k).filter(|v| !v.is_null()).cloned();
    json!({
        "request_id": id,
        "token_ids": token_ids,
        "features": null,
        "sampling_params": {
            "max_tokens": present("max_completion_tokens").or_else(|| present("max_tokens")),
            "temperature": present("temperature"),
        },
        "model": present("model").unwrap_or_else(|| json!(model)),
        "stream": present("stream").unwrap_or(json!(false)),
        "stream_options": present("stream_options"),
        "cache_salt": present("cache_salt"),
        "priority": present("priority").unwrap_or(json!(0)),
        "kv_transfer_params": null,
    })
}

/// The tokenizer endpoints: no simulated time, no cache lookup.
impl Engine {
    /// `POST /tokenize`: `{"prompt": "…"}` or `{"messages": […]}` (chat template,
    /// `add_generation_prompt` default true, `continue_final_message`: [`chat_prompt`]) → `{"count","max_model_len","tokens",
    /// "token_strs"}` (`token_strs` only with `return_token_strs`). `count` equals the
    /// `prompt_tokens` a generation request with the same prompt reports.
    pub(super) async fn tokenize(&self, req: Request<Incoming>) -> Response<RespBody> {
        let obj = match json_object(self.read_body(req).await) {
            Ok(obj) => obj,
            Err((status, msg)) => {
                return error_response(status, &msg, "invalid_request_error");
            }
        };
        let text = if obj.contains_key("messages") {
            chat_prompt(&obj)
        } else {
            match obj.get("prompt") {
                Some(Value::String(s)) => Ok(s.clone()),
                _ => Err("prompt must be a string (or send messages)".to_string()),
            }
        };
        let text = match text {
            Ok(t) => t,
            Err(msg) => {
                return error_response(StatusCode::BAD_REQUEST, &msg, "invalid_request_error");
            }
        };
        let words: Vec<&str> = text.split_whitespace().collect();
        let tokens: Vec<u32> = words.iter().map(|w| token_id(w)).collect();
        let strs = obj
            .get("return_token_strs")
            .and_then(Value::as_bool)
            .unwrap_or(false)
            .then(|| json!(words));
        json_response(
            StatusCode::OK,
            &json!({"count": tokens.len(), "max_model_len": MAX_MODEL_LEN,
                    "tokens": tokens, "token_strs": strs}),
        )
    }

    /// `POST /detokenize`: `{"tokens": [ids…]}` → `{"prompt": " w1 w2 …"}` (each word
    /// with a leading space, as the trace prompts are written; see [`token_word`]).
    pub(super) async fn detokenize(&self, req: Request<Incoming>) -> Response<RespBody> {
        let obj = match json_object(self.read_body(req).await) {
            Ok(obj) => obj,
            Err((status, msg)) => {
                return error_response(status, &msg, "invalid_request_error");
            }
        };
        let words: Option<Vec<String>> =
            obj.get("tokens").and_then(Value::as_array).and_then(|ids| {
                ids.iter()
                    .map(|x| x.as_u64().and_then(token_word))
                    .collect()
            });
        match words {
            Some(words) => {
                let prompt: String = words.iter().map(|w| format!(" {w}")).collect();
                json_response(StatusCode::OK, &json!({ "prompt": prompt }))
            }
            None => error_response(
                StatusCode::BAD_REQUEST,
                &format!("tokens must be an array of token ids below {VOCAB_SIZE}"),
                "invalid_request_error",
            ),
        }
    }

    /// `POST /v1/messages/count_tokens` → `{"input_tokens": n}`: the prompt tokens
    /// the same `/v1/messages` request would have.
    pub(super) async fn count_tokens(&self, req: Request<Incoming>) -> Response<RespBody> {
        let body = match self.read_body(req).await {
            Ok(body) => body,
            Err((status, msg)) => return anthropic_error(status, &msg),
        };
        let text = serde_json::from_slice::<Value>(&body)
            .map_err(|e| format!("body is not valid JSON: {e}"))
            .and_then(|v| {
                let obj = v.as_object().ok_or("request body must be a JSON object")?;
                chat_template(Some(&anthropic_to_chat(obj)?))
            });
        match text {
            Ok(t) => json_response(
                StatusCode::OK,
                &json!({"input_tokens": t.split_whitespace().count()}),
            ),
            Err(msg) => anthropic_error(StatusCode::BAD_REQUEST, &msg),
        }
    }

    /// `POST /v1/chat/completions/render` (one `GenerateRequest`) and
    /// `POST /v1/completions/render` (a list, one per prompt; token-id prompts are
    /// passed through): vLLM's render endpoints, which llm-d's precise prefix-cache
    /// scorer calls to get the token ids it hashes into KV blocks.
    pub(super) async fn render(
        &self,
        endpoint: Endpoint,
        req: Request<Incoming>,
    ) -> Response<RespBody> {
        let obj = match json_object(self.read_body(req).await) {
            Ok(obj) => obj,
            Err((status, msg)) => {
                return error_response(status, &msg, "invalid_request_error");
            }
        };
        let model = &self.inner.cfg.model;
        let next_id = || {
            let n = self.inner.counters.next_id.fetch_add(1, Ordering::Relaxed);
            format!("render-{}-{n}", self.inner.cfg.name)
        };
        if endpoint == Endpoint::Chat {
            return match chat_prompt(&obj) {
                Ok(text) => json_response(
                    StatusCode::OK,
                    &generate_request(next_id(), tokenize_text(&text), &obj, model),
                ),
                Err(msg) => error_response(StatusCode::BAD_REQUEST, &msg, "invalid_request_error"),
            };
        }
        let prompt = obj.get("prompt");
        let ids = |a: &[Value]| -> Option<Vec<u32>> {
            a.iter()
                .map(|x| {
                    x.as_u64()
                        .filter(|&n| n < u64::from(VOCAB_SIZE))
                        .map(|n| n as u32)
                })
                .collect()
        };
        // Token ids (one list or a list of lists) pass through; text is tokenized.
        let token_lists: Option<Vec<Vec<u32>>> = match prompt {
            Some(Value::Array(items)) if items.first().is_some_and(Value::is_number) => {
                ids(items).map(|v| vec![v])
            }
            Some(Value::Array(items)) if items.first().is_some_and(Value::is_array) => items
                .iter()
                .map(|x| x.as_array().and_then(|a| ids(a)))
                .collect(),
            _ => completion_prompts(prompt)
                .ok()
                .map(|ps| ps.iter().map(|p| tokenize_text(p)).collect()),
        };
        match token_lists {
            Some(lists) => {
                let items: Vec<Value> = lists
                    .into_iter()
                    .map(|t| generate_request(next_id(), t, &obj, model))
                    .collect();
                json_response(StatusCode::OK, &Value::Array(items))
            }
            None => error_response(
                StatusCode::BAD_REQUEST,
                "prompt must be a string, an array of strings, an array of token ids \
                 or an array of token-id arrays (ids below the vocabulary size)",
                "invalid_request_error",
            ),
        }
    }
}

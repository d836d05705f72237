//! The generation endpoints (`/v1/chat/completions`, `/v1/completions`,
//! `/v1/messages`): validate, admit, prefill, then decode into one JSON answer or a
//! stream of SSE chunks (Anthropic events on `/v1/messages`).

use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::{Request, Response, StatusCode};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::decode::Decoder;
use super::http::{ChannelBody, error_response, json_response};
use super::nixl::{self, KvRole};
use super::physics::{PromptWork, Started};
use super::shapes::{Shape, anthropic_error, anthropic_usage, work_usage};
use super::template::{anthropic_to_chat, chat_prompt, chat_template, completion_prompts};
use super::{Endpoint, Engine, KvConnector, RespBody, Usage, Waiting, block_hashes_under};

/// A generation request after validation.
#[derive(Debug, Clone, PartialEq)]
struct SimRequest {
    endpoint: Endpoint,
    /// Prompt texts (one for chat; completions may batch several).
    prompts: Vec<String>,
    /// Tokens to generate per prompt (already capped).
    max_tokens: u64,
    stream: bool,
    include_usage: bool,
    /// The `model` asked for (`None`: the engine's default).
    model: Option<String>,
    /// Its `kv_transfer_params` (see `nixl`).
    kv_transfer_params: Option<Value>,
    /// Its `cache_salt`: vLLM folds it into the first block's hash, so prompts under
    /// different salts never share a block.
    cache_salt: Option<String>,
    /// Its first token is held back `stall_first_token` (see [`Engine::stalls`]).
    stalled: bool,
    /// A chat request that continues its last assistant message
    /// (`continue_final_message`): never cut by `die_after_tokens`.
    continues: bool,
}

impl Engine {
    /// The 429 of a request [`Self::admit`] turned away: `Retry-After` and the
    /// endpoint's error shape.
    fn too_busy(&self, endpoint: Endpoint) -> Response<RespBody> {
        let cfg = &self.inner.cfg;
        let msg = format!(
            "{} requests are already waiting (max_waiting {}); retry after {} s",
            self.inner.counters.waiting.load(Ordering::Relaxed),
            cfg.max_waiting,
            cfg.retry_after_secs
        );
        let mut resp = match endpoint {
            Endpoint::Messages => anthropic_error(StatusCode::TOO_MANY_REQUESTS, &msg),
            _ => error_response(StatusCode::TOO_MANY_REQUESTS, &msg, "rate_limit_error"),
        };
        resp.headers_mut().insert(
            hyper::header::RETRY_AFTER,
            HeaderValue::from(cfg.retry_after_secs),
        );
        resp
    }

    pub(super) async fn generate(
        &self,
        endpoint: Endpoint,
        req: Request<Incoming>,
    ) -> Response<RespBody> {
        let arrival = Instant::now();
        // Anthropic clients get Anthropic's error shape.
        let fail = |status: StatusCode, msg: &str| match endpoint {
            Endpoint::Messages => anthropic_error(status, msg),
            _ => error_response(status, msg, "invalid_request_error"),
        };
        let body = match self.read_body(req).await {
            Ok(body) => body,
            Err((status, msg)) => return fail(status, &msg),
        };
        let mut sim = match parse_request(endpoint, &body, self.inner.cfg.max_output_tokens) {
            Ok(sim) => sim,
            Err(msg) => return fail(StatusCode::BAD_REQUEST, &msg),
        };
        let Some(model) = self.resolve_model(sim.model.as_deref()) else {
            return model_not_found(endpoint, sim.model.as_deref().unwrap_or_default());
        };
        sim.stalled = self.stalls(&body);
        let Some(waiting) = self.admit() else {
            return self.too_busy(endpoint);
        };
        let role = self.kv_role(&sim);
        let work = self.work(&sim, &model, role);
        let id_num = self.inner.counters.next_id.fetch_add(1, Ordering::Relaxed);
        let prefix = match endpoint {
            Endpoint::Chat => "chatcmpl-",
            Endpoint::Completions => "cmpl-",
            Endpoint::Messages => "msg_",
        };
        let shape = Shape {
            endpoint,
            id: format!("{prefix}{}-{id_num}", self.inner.cfg.name),
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            model,
        };
        if sim.stream {
            let (tx, rx) = mpsc::channel(64);
            let engine = self.clone();
            tokio::spawn(async move {
                tokio::select! {
                    () = engine.stream(&shape, &sim, &work, arrival, waiting, &tx) => {}
                    () = tx.closed() => {}
                }
            });
            let mut resp = Response::new(ChannelBody { rx }.boxed());
            resp.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static("text/event-stream; charset=utf-8"),
            );
            resp
        } else {
            let n = sim.max_tokens;
            let mut started = self.start(&work, arrival, waiting, n).await;
            self.stall_first_token(&mut started, sim.stalled).await;
            started.last_token(n).await;
            self.finish(&work, n);
            let texts: Vec<String> = sim
                .prompts
                .iter()
                .map(|p| {
                    let mut d = Decoder::after(p);
                    (0..n).map(|_| d.next_token()).collect()
                })
                .collect();
            let mut answer = shape.full_response(&work, &started.cached, n, &texts);
            if role == Some(KvRole::Prefill) {
                // It finished on its length cap: the hand-off for a remote decoder.
                let blocks = work
                    .iter()
                    .map(|p| p.n_tokens as u64)
                    .sum::<u64>()
                    .div_ceil(self.inner.cfg.block_size.max(1) as u64);
                answer["kv_transfer_params"] =
                    nixl::handoff(&self.inner.cfg.name, &shape.id, blocks);
                self.inner
                    .counters
                    .kv_handoffs_sent
                    .fetch_add(1, Ordering::Relaxed);
            }
            json_response(StatusCode::OK, &answer)
        }
    }

    /// The role a request's `kv_transfer_params` give this engine (`None` without a KV
    /// connector); params a decode cannot act on are counted.
    fn kv_role(&self, sim: &SimRequest) -> Option<KvRole> {
        if self.inner.cfg.kv_connector != KvConnector::Nixl {
            return None;
        }
        let role = nixl::role(sim.kv_transfer_params.as_ref()?)?;
        if role == KvRole::Invalid {
            self.inner
                .counters
                .kv_handoffs_invalid
                .fetch_add(1, Ordering::Relaxed);
        }
        Some(role)
    }

    /// The request's prompts as block hashes under `model`, with the KV a prefill
    /// engine hands over (one prompt only: a hand-off is single-consumer).
    fn work(&self, sim: &SimRequest, model: &str, role: Option<KvRole>) -> Vec<PromptWork> {
        let bs = self.inner.cfg.block_size;
        // The default model's hashes are those of an engine serving one model; any
        // other's chain, or any salted prompt's, starts from a root of its own (never a
        // hit across models or salts).
        let scoped = match &sim.cache_salt {
            Some(salt) => Some(format!("{model}\0salt\0{salt}")),
            None => (model != self.inner.cfg.model).then(|| model.to_string()),
        };
        let under = scoped.as_deref();
        let handed = match role {
            Some(KvRole::Decode { blocks }) if sim.prompts.len() == 1 => blocks,
            _ => 0,
        };
        sim.prompts
            .iter()
            .map(|p| {
                let (n_tokens, hashes) = block_hashes_under(p.split_whitespace(), bs, under);
                // All but the last token, which the decode computes to sample from.
                let received = (handed * bs as u64).min(n_tokens.saturating_sub(1) as u64);
                PromptWork {
                    n_tokens,
                    hashes,
                    received,
                }
            })
            .collect()
    }

    /// Streams one request's SSE chunks into `tx`; returns early when the client
    /// has gone (send fails).
    async fn stream(
        &self,
        shape: &Shape,
        sim: &SimRequest,
        work: &[PromptWork],
        arrival: Instant,
        waiting: Waiting,
        tx: &mpsc::Sender<Bytes>,
    ) {
        let n = sim.max_tokens;
        let mut started = self.start(work, arrival, waiting, n).await;
        self.stall_first_token(&mut started, sim.stalled).await;
        let mut decoders: Vec<Decoder> = sim.prompts.iter().map(|p| Decoder::after(p)).collect();
        let dies = self.inner.cfg.die_after_tokens.filter(|_| !sim.continues);
        if shape.endpoint == Endpoint::Messages {
            return self
                .stream_messages(shape, work, &mut started, (n, dies), &mut decoders[0], tx)
                .await;
        }
        for k in 0..n {
            if !started.next_token().await {
                return;
            }
            // The role chunk comes with the first token, as vLLM sends it (its first
            // output is the first token): under the chunked physics `start` returns
            // before the prefill, and a role chunk sent then would be a first byte
            // long before the first token.
            if k == 0 && shape.endpoint == Endpoint::Chat {
                for i in 0..work.len() {
                    if tx.send(shape.role_chunk(i)).await.is_err() {
                        return;
                    }
                }
            }
            if dies == Some(k) {
                return die(tx).await;
            }
            let last = k + 1 == n;
            for (i, d) in decoders.iter_mut().enumerate() {
                if tx
                    .send(shape.token_chunk(i, &d.next_token(), last))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        }
        self.finish(work, n);
        if sim.include_usage {
            let _ = tx
                .send(shape.usage_chunk(&work_usage(work, &started.cached, n)))
                .await;
        }
        let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
    }
}

impl Engine {
    /// The Anthropic event stream after prefill: `message_start`,
    /// `content_block_start`, one `content_block_delta` (`text_delta`) per token on
    /// the decode clock, `content_block_stop`, `message_delta` (stop reason and
    /// usage), `message_stop`. Returns early when the client has gone.
    async fn stream_messages(
        &self,
        shape: &Shape,
        work: &[PromptWork],
        started: &mut Started<'_>,
        (n, dies): (u64, Option<u64>),
        decoder: &mut Decoder,
        tx: &mpsc::Sender<Bytes>,
    ) {
        let usage = work_usage(work, &started.cached, n);
        let head = [
            shape.message_start(&Usage {
                completion_tokens: 0,
                ..usage
            }),
            Shape::event(
                "content_block_start",
                &json!({"type": "content_block_start", "index": 0,
                        "content_block": {"type": "text", "text": ""}}),
            ),
        ];
        for ev in head {
            if tx.send(ev).await.is_err() {
                return;
            }
        }
        for k in 0..n {
            if !started.next_token().await {
                return;
            }
            if dies == Some(k) {
                return die(tx).await;
            }
            let delta = Shape::event(
                "content_block_delta",
                &json!({"type": "content_block_delta", "index": 0,
                        "delta": {"type": "text_delta", "text": decoder.next_token()}}),
            );
            if tx.send(delta).await.is_err() {
                return;
            }
        }
        self.finish(work, n);
        let tail = [
            Shape::event(
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": 0}),
            ),
            Shape::event(
                "message_delta",
                &json!({"type": "message_delta",
                        "delta": {"stop_reason": "max_tokens", "stop_sequence": null},
                        "usage": anthropic_usage(&usage)}),
            ),
            Shape::event("message_stop", &json!({"type": "message_stop"})),
        ];
        for ev in tail {
            if tx.send(ev).await.is_err() {
                return;
            }
        }
    }
}

/// Ends a stream as a killed engine does (`die_after_tokens`): once what it sent has
/// been written out (a process's writes reach the socket before it dies), the body
/// fails and the connection closes without the stream's end.
async fn die(tx: &mpsc::Sender<Bytes>) {
    while tx.capacity() < tx.max_capacity() && !tx.is_closed() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // The connection's task writes what it took from the channel when it finds it empty.
    tokio::time::sleep(Duration::from_millis(5)).await;
    let _ = tx.send(Bytes::new()).await;
}

/// Validates a generation body and extracts what the simulation needs. The error
/// is the message of a 400 response.
fn parse_request(endpoint: Endpoint, body: &[u8], max_output: u64) -> Result<SimRequest, String> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| format!("body is not valid JSON: {e}"))?;
    let obj = v.as_object().ok_or("request body must be a JSON object")?;
    let prompts = match endpoint {
        Endpoint::Chat => vec![chat_prompt(obj)?],
        Endpoint::Completions => completion_prompts(obj.get("prompt"))?,
        Endpoint::Messages => vec![chat_template(Some(&anthropic_to_chat(obj)?))?],
    };
    let present = |k: &str| obj.get(k).filter(|v| !v.is_null());
    let max_tokens = match present("max_completion_tokens").or_else(|| present("max_tokens")) {
        // Anthropic requires max_tokens.
        None if endpoint == Endpoint::Messages => return Err("max_tokens is required".into()),
        None => 16,
        Some(v) => v
            .as_u64()
            .filter(|&n| n >= 1)
            .ok_or("max_tokens must be an integer >= 1")?,
    };
    let stream = match present("stream") {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err("stream must be a boolean".into()),
    };
    let model = match present("model") {
        None => None,
        Some(Value::String(m)) => Some(m.clone()),
        Some(_) => return Err("model must be a string".into()),
    };
    let cache_salt = match present("cache_salt") {
        None => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err("cache_salt must be a string".into()),
    };
    let include_usage = present("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    Ok(SimRequest {
        endpoint,
        prompts,
        max_tokens: max_tokens.min(max_output.max(1)),
        stream,
        include_usage,
        model,
        kv_transfer_params: present("kv_transfer_params").cloned(),
        cache_salt,
        stalled: false,
        continues: present("continue_final_message") == Some(&Value::Bool(true)),
    })
}

/// vLLM's 404 for a model it does not serve (Anthropic's error shape on
/// `/v1/messages`).
fn model_not_found(endpoint: Endpoint, model: &str) -> Response<RespBody> {
    let msg = format!("The model `{model}` does not exist.");
    match endpoint {
        Endpoint::Messages => anthropic_error(StatusCode::NOT_FOUND, &msg),
        _ => json_response(
            StatusCode::NOT_FOUND,
            &json!({"error": {"message": msg, "type": "NotFoundError", "param": "model", "code": 404}}),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_requests_are_rejected_with_messages() {
        let bad: [(Endpoint, &str); 8] = [
            (Endpoint::Chat, "not json"),
            (Endpoint::Chat, "[]"),
            (Endpoint::Chat, r#"{"messages": []}"#),
            (Endpoint::Chat, r#"{"messages": [{"content": "x"}]}"#),
            (
                Endpoint::Chat,
                r#"{"messages": [{"role": "user", "content": 5}]}"#,
            ),
            (
                Endpoint::Chat,
                r#"{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}"#,
            ),
            (Endpoint::Completions, r#"{"prompt": 42}"#),
            (Endpoint::Completions, r#"{"prompt": ""}"#),
        ];
        for (ep, body) in bad {
            assert!(parse_request(ep, body.as_bytes(), 100).is_err(), "{body}");
        }
        let ok = parse_request(
            Endpoint::Completions,
            br#"{"prompt": [[1,2],[3]], "max_tokens": 500, "stream": true}"#,
            100,
        )
        .unwrap();
        assert_eq!(ok.prompts, ["1 2", "3"]);
        assert_eq!(
            (ok.max_tokens, ok.stream, ok.include_usage),
            (100, true, false)
        );
    }
}

//! vLLM's NIXL hand-off on the wire (as vLLM's own proxy, vllm-router and SMG send it):
//! the prefill leg's body, what the prefill answer hands on, the decode leg's body.
//! Pure functions of bytes.

use bytes::Bytes;
use serde_json::{Map, Value};

use crate::prompt::Endpoint;
use crate::proxy::json_members;

/// The top-level member the hand-off travels in, both ways.
const PARAMS: &str = "kv_transfer_params";

/// What a request's body says that decides its path, read before its legs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Shape {
    /// It is one JSON object (else it is not split: the engine answers it).
    pub object: bool,
    /// Its `n` (choices asked for; 1 when absent).
    pub n: u64,
    /// It continues a stored response (`previous_response_id`, `/v1/responses`).
    pub continues: bool,
}

impl Shape {
    /// Reads `body`'s top-level members, without decoding the rest.
    pub fn of(body: &[u8]) -> Shape {
        let mut shape = Shape {
            object: false,
            n: 1,
            continues: false,
        };
        let object = json_members::for_each(body, |key, value| match key {
            b"n" => shape.n = serde_json::from_slice(value).unwrap_or(1),
            b"previous_response_id" => shape.continues = value != b"null",
            _ => {}
        });
        shape.object = object.is_some();
        shape
    }
}

/// The prefill leg's body for `endpoint`: the client's, with the length cap 1 in the
/// spelling the endpoint uses (chat: `max_completion_tokens` when the client wrote it,
/// the other spelling dropped, since vLLM refuses both; Responses: `max_output_tokens`),
/// not streamed (the hand-off comes back only in a JSON answer), no `stream_options`
/// (refused without `stream`), no `min_tokens` / `min_completion_tokens` (min ≤ max),
/// `n: 1` (the hand-off is single-consumer), a Responses call not stored, and
/// `kv_transfer_params: {do_remote_decode: true, do_remote_prefill: false}`. `None`
/// when the body is not a JSON object.
pub fn prefill_body(endpoint: Endpoint, body: &[u8]) -> Option<Bytes> {
    let mut m: Map<String, Value> = serde_json::from_slice(body).ok()?;
    let one = Value::from(1);
    match endpoint {
        Endpoint::ChatCompletions if m.contains_key("max_completion_tokens") => {
            m.insert("max_completion_tokens".into(), one);
            m.remove("max_tokens");
        }
        Endpoint::ChatCompletions | Endpoint::Completions | Endpoint::Messages => {
            m.insert("max_tokens".into(), one);
            m.remove("max_completion_tokens");
        }
        Endpoint::Responses => {
            m.insert("max_output_tokens".into(), one);
            m.insert("store".into(), Value::Bool(false));
        }
    }
    if matches!(endpoint, Endpoint::ChatCompletions | Endpoint::Completions) {
        m.insert("n".into(), Value::from(1));
    }
    m.insert("stream".into(), Value::Bool(false));
    for gone in ["stream_options", "min_tokens", "min_completion_tokens"] {
        m.remove(gone);
    }
    m.insert(
        PARAMS.into(),
        serde_json::json!({"do_remote_decode": true, "do_remote_prefill": false}),
    );
    serde_json::to_vec(&m).ok().map(Bytes::from)
}

/// The prefill answer's `kv_transfer_params`, byte for byte as the engine wrote it;
/// `None` when the answer has none (vLLM writes `null` when the prefill stopped for
/// another reason than the length cap: an end of sequence on the first token) or is
/// not a JSON object.
pub fn handed_on(answer: &[u8]) -> Option<Bytes> {
    let mut found = None;
    json_members::for_each(answer, |key, value| {
        if key == PARAMS.as_bytes() && value.first() == Some(&b'{') && value != b"{}" {
            found = Some(value);
        }
    })?;
    found.map(Bytes::copy_from_slice)
}

/// The decode leg's body: the client's `body` as it was forwarded, plus
/// `"kv_transfer_params": params` (`params` as the prefill answer wrote them): added
/// before its closing brace, or in place of a value the client wrote. `None` when
/// `body` is not a JSON object.
pub fn decode_body(body: &Bytes, params: &[u8]) -> Option<Bytes> {
    let base = body.as_ptr() as usize;
    let mut existing = None;
    let mut members = 0usize;
    json_members::for_each(body, |key, value| {
        members += 1;
        if key == PARAMS.as_bytes() {
            let at = value.as_ptr() as usize - base;
            existing = Some(at..at + value.len());
        }
    })?;
    let mut out = Vec::with_capacity(body.len() + params.len() + PARAMS.len() + 4);
    match existing {
        Some(range) => {
            out.extend_from_slice(&body[..range.start]);
            out.extend_from_slice(params);
            out.extend_from_slice(&body[range.end..]);
        }
        None => {
            let close = body.iter().rposition(|&b| b == b'}')?;
            out.extend_from_slice(&body[..close]);
            if members > 0 {
                out.push(b',');
            }
            out.extend_from_slice(b"\"kv_transfer_params\":");
            out.extend_from_slice(params);
            out.extend_from_slice(&body[close..]);
        }
    }
    Some(Bytes::from(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(b: &[u8]) -> Value {
        serde_json::from_slice(b).unwrap()
    }

    #[test]
    fn the_prefill_leg_caps_at_one_token_unstreamed_and_asks_for_a_hand_off() {
        let client = br#"{"model":"m","stream":true,"stream_options":{"include_usage":true},"max_tokens":300,"min_tokens":5,"n":1,"messages":[{"role":"user","content":"hi"}]}"#;
        let p = json(&prefill_body(Endpoint::ChatCompletions, client).unwrap());
        assert_eq!(p["max_tokens"], 1);
        assert_eq!(p["stream"], false);
        assert_eq!(p["n"], 1);
        assert!(p.get("stream_options").is_none() && p.get("min_tokens").is_none());
        assert_eq!(
            p["kv_transfer_params"],
            serde_json::json!({"do_remote_decode": true, "do_remote_prefill": false})
        );
        assert_eq!(
            p["messages"],
            json(client)["messages"],
            "the prompt as sent"
        );
        // The other spelling of the cap, kept alone.
        let c = br#"{"max_completion_tokens":9,"max_tokens":9,"min_completion_tokens":2}"#;
        let p = json(&prefill_body(Endpoint::ChatCompletions, c).unwrap());
        assert_eq!(p["max_completion_tokens"], 1);
        assert!(p.get("max_tokens").is_none() && p.get("min_completion_tokens").is_none());
        let p = json(&prefill_body(Endpoint::Completions, br#"{"prompt":"x"}"#).unwrap());
        assert_eq!(
            (p["max_tokens"].clone(), p["n"].clone()),
            (1.into(), 1.into())
        );
        let p = json(
            &prefill_body(
                Endpoint::Responses,
                br#"{"input":"x","max_output_tokens":50}"#,
            )
            .unwrap(),
        );
        assert_eq!(p["max_output_tokens"], 1);
        assert_eq!(p["store"], false);
        assert!(p.get("n").is_none() && p.get("max_tokens").is_none());
        assert!(prefill_body(Endpoint::ChatCompletions, b"[1]").is_none());
    }

    #[test]
    fn the_hand_off_is_taken_byte_for_byte_and_none_is_none() {
        let answer = br#"{"id":"x","choices":[{"finish_reason":"length"}],"kv_transfer_params": {"do_remote_prefill": true, "remote_block_ids": [[1, 2]], "remote_host": "10.0.0.1"}, "usage":{}}"#;
        assert_eq!(
            &handed_on(answer).unwrap()[..],
            br#"{"do_remote_prefill": true, "remote_block_ids": [[1, 2]], "remote_host": "10.0.0.1"}"#
        );
        for none in [
            &br#"{"choices":[],"kv_transfer_params":null}"#[..],
            br#"{"choices":[]}"#,
            br#"{"kv_transfer_params":{}}"#,
            b"not json",
        ] {
            assert_eq!(handed_on(none), None, "{}", String::from_utf8_lossy(none));
        }
    }

    #[test]
    fn the_decode_leg_is_the_clients_body_plus_the_hand_off() {
        let params = br#"{"do_remote_prefill": true, "remote_port": 5600}"#;
        let client = Bytes::from_static(br#"{"model":"m","stream":true} "#);
        assert_eq!(
            &decode_body(&client, params).unwrap()[..],
            &br#"{"model":"m","stream":true,"kv_transfer_params":{"do_remote_prefill": true, "remote_port": 5600}} "#[..]
        );
        let empty = Bytes::from_static(b"{ }");
        assert_eq!(
            &decode_body(&empty, b"{\"a\":1}").unwrap()[..],
            b"{ \"kv_transfer_params\":{\"a\":1}}"
        );
        // A client's own value is replaced, not repeated.
        let own = Bytes::from_static(br#"{"kv_transfer_params":{"x":1},"n":2}"#);
        assert_eq!(
            &decode_body(&own, b"{\"a\":1}").unwrap()[..],
            br#"{"kv_transfer_params":{"a":1},"n":2}"#
        );
        assert!(decode_body(&Bytes::from_static(b"[]"), b"{}").is_none());
    }

    #[test]
    fn the_shape_reads_n_and_a_continued_response() {
        assert_eq!(
            Shape::of(br#"{"n":3,"messages":[]}"#),
            Shape {
                object: true,
                n: 3,
                continues: false
            }
        );
        assert!(Shape::of(br#"{"previous_response_id":"resp_1"}"#).continues);
        assert!(!Shape::of(br#"{"previous_response_id":null}"#).continues);
        assert!(!Shape::of(b"[]").object);
    }
}

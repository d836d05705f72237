//! What names a request in the response cache: the exact key, and for the semantic
//! lookup the partition and the conversation text.
//!
//! **Exact key** = SHA-256 over a layout version, the endpoint, the caller's credential
//! digest and the body in canonical form: object keys sorted, no insignificant
//! whitespace, a top-level `"stream": false` left out (it means the same as no `stream`).
//! Two tenants sending the same body never share a key.
//!
//! **Partition** = SHA-256 over the same, minus the conversation text: the content of
//! user and assistant turns (a completion's `prompt`, a Responses string `input`) and the
//! attribution fields `user` and `metadata`. Everything else — model, sampling and length
//! parameters, tools, `response_format`, stream options, system and developer messages
//! with their positions, Anthropic `system`, Responses `instructions`, and the roles of
//! every turn in order — must match for two requests to be compared by meaning, so
//! "answer in German" never matches "answer in Japanese".
//!
//! A request whose meaning the text does not carry (images, audio, files, tool calls and
//! results, token-id prompts, a `previous_response_id`) gets no semantic input: only the
//! exact key serves it.

use std::io::Write;

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use crate::prompt::Endpoint;

/// Version of the key layout; part of every key, so a change never reads old entries.
pub const LAYOUT: &str = "v1";
/// Longest conversation text sent to the embeddings endpoint, in bytes (cut on a UTF-8
/// boundary, keeping the end: the latest turns say most about the question). What is
/// cut off goes into the partition instead: two requests that differ only there never
/// match by meaning.
pub const MAX_SEMANTIC_TEXT: usize = 32 * 1024;
/// Numbers at or beyond this magnitude lose digits when read (serde_json keeps them
/// as `f64`): a body holding one is not keyed, or two different seeds would share an
/// entry.
const EXACT_NUMBERS: f64 = 9_007_199_254_740_992.0; // 2^53

/// A 32-byte SHA-256 digest.
pub type Key = [u8; 32];

/// Why a request is neither looked up nor stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unkeyable {
    /// The body is not a JSON object: the engine answers its own error.
    Unreadable,
    /// `n` > 1: several sampled answers, never one to replay.
    Choices,
    /// The request appends to state kept by the engine (a Responses `conversation`, a
    /// `background` run): replaying would skip that.
    Stateful,
}

/// A request as the cache sees it.
#[derive(Debug)]
pub struct CacheRequest {
    pub key: Key,
    /// The client asked for SSE (`"stream": true`).
    pub stream: bool,
    /// Partition and conversation text, when the request can be matched by meaning.
    pub semantic: Option<SemanticInput>,
}

/// What the semantic lookup compares.
#[derive(Debug)]
pub struct SemanticInput {
    pub partition: Key,
    /// `role: text` lines of the conversation, at most [`MAX_SEMANTIC_TEXT`] bytes.
    pub text: String,
}

/// Digest of the caller's credentials (`Authorization` and `x-api-key`; all zeros-in
/// for none): the tenant part of every key.
pub fn tenant(headers: &http::HeaderMap) -> Key {
    let mut h = Sha256::new();
    for name in [http::header::AUTHORIZATION.as_str(), "x-api-key"] {
        for v in headers.get_all(name) {
            h.update(name.as_bytes());
            h.update(b"\0");
            h.update(v.as_bytes());
            h.update(b"\0");
        }
    }
    h.finalize().into()
}

/// Reads `body` for `endpoint`: the exact key, the stream flag and (with `semantic`)
/// the semantic input.
pub fn analyse(
    endpoint: Endpoint,
    body: &[u8],
    tenant: &Key,
    semantic: bool,
) -> Result<CacheRequest, Unkeyable> {
    let Ok(Value::Object(obj)) = serde_json::from_slice::<Value>(body) else {
        return Err(Unkeyable::Unreadable);
    };
    let n = match obj.get("n") {
        Some(Value::String(s)) => s.trim().parse::<f64>().ok(),
        Some(v) => v.as_f64(),
        None => None,
    };
    if n.is_some_and(|n| n > 1.0) {
        return Err(Unkeyable::Choices);
    }
    if endpoint == Endpoint::Responses
        && (obj.get("conversation").is_some_and(|c| !c.is_null())
            || obj.get("background") == Some(&Value::Bool(true)))
    {
        return Err(Unkeyable::Stateful);
    }
    if obj.values().any(imprecise) {
        return Err(Unkeyable::Unreadable);
    }
    let stream = obj.get("stream").and_then(Value::as_bool) == Some(true);
    let key = {
        let mut h = hasher("exact", endpoint, tenant);
        write_object(&mut HashWriter(&mut h), &obj, &|k, v| {
            !(k == "stream" && v == &Value::Bool(false))
        });
        h.finalize().into()
    };
    let semantic = semantic
        .then(|| semantic_input(endpoint, &obj, tenant))
        .flatten();
    Ok(CacheRequest {
        key,
        stream,
        semantic,
    })
}

/// Whether `v` holds a number the parser could not keep exactly.
fn imprecise(v: &Value) -> bool {
    match v {
        Value::Number(n) => n.is_f64() && n.as_f64().is_some_and(|x| x.abs() >= EXACT_NUMBERS),
        Value::Array(a) => a.iter().any(imprecise),
        Value::Object(m) => m.values().any(imprecise),
        _ => false,
    }
}

fn hasher(kind: &str, endpoint: Endpoint, tenant: &Key) -> Sha256 {
    let mut h = Sha256::new();
    for part in [LAYOUT, kind, endpoint.as_str()] {
        h.update(part.as_bytes());
        h.update(b"\0");
    }
    h.update(tenant);
    h
}

/// The partition and text of a request that the text describes; `None` otherwise.
fn semantic_input(
    endpoint: Endpoint,
    obj: &Map<String, Value>,
    tenant: &Key,
) -> Option<SemanticInput> {
    let mut text = String::new();
    let conversation = match endpoint {
        Endpoint::ChatCompletions | Endpoint::Messages => "messages",
        Endpoint::Completions => "prompt",
        Endpoint::Responses => "input",
    };
    if obj.contains_key("previous_response_id") {
        return None;
    }
    match (endpoint, obj.get(conversation)?) {
        (Endpoint::Completions, Value::String(s)) => push_turn(&mut text, "prompt", s),
        (Endpoint::Completions, Value::Array(parts)) => {
            for p in parts {
                push_turn(&mut text, "prompt", p.as_str()?);
            }
        }
        (Endpoint::Responses, Value::String(s)) => push_turn(&mut text, "user", s),
        (_, Value::Array(turns)) => {
            for turn in turns {
                let turn = turn.as_object()?;
                if endpoint == Endpoint::Responses
                    && turn.get("type").is_some_and(|t| t != "message")
                {
                    return None;
                }
                let role = turn.get("role")?.as_str()?;
                match role {
                    "system" | "developer" => continue,
                    "user" | "assistant" => {}
                    _ => return None,
                }
                if ["tool_calls", "function_call", "audio"]
                    .iter()
                    .any(|f| turn.get(*f).is_some_and(|v| !v.is_null()))
                {
                    return None;
                }
                push_content(&mut text, role, turn.get("content")?)?;
            }
        }
        _ => return None,
    }
    if text.is_empty() {
        return None;
    }
    let (head, text) = split_tail(text, MAX_SEMANTIC_TEXT);
    let partition = {
        let mut h = hasher("partition", endpoint, tenant);
        // The text the embedding does not see must match exactly.
        h.update(head.len().to_le_bytes());
        h.update(head.as_bytes());
        let skeleton = |k: &str, _: &Value| !matches!(k, "user" | "metadata");
        let mut w = HashWriter(&mut h);
        write_object_with(&mut w, obj, &skeleton, &|w, k, v| {
            if k != conversation {
                return false;
            }
            // Keep each turn's place and role, drop what it says.
            if let Value::Array(turns) = v {
                w.raw(b"[");
                for (i, t) in turns.iter().enumerate() {
                    if i > 0 {
                        w.raw(b",");
                    }
                    match t {
                        Value::Object(m)
                            if !matches!(
                                m.get("role").and_then(Value::as_str),
                                Some("system" | "developer")
                            ) =>
                        {
                            write_object(w, m, &|k, _| k != "content")
                        }
                        other => write_value(w, other),
                    }
                }
                w.raw(b"]");
            } else {
                w.raw(b"null");
            }
            true
        });
        h.finalize().into()
    };
    Some(SemanticInput { partition, text })
}

/// Appends one turn's text (a string, or text parts only); `None` for any other part.
fn push_content(text: &mut String, role: &str, content: &Value) -> Option<()> {
    match content {
        Value::String(s) => push_turn(text, role, s),
        Value::Array(parts) => {
            for p in parts {
                let kind = p.get("type")?.as_str()?;
                if !matches!(kind, "text" | "input_text" | "output_text") {
                    return None;
                }
                push_turn(text, role, p.get("text")?.as_str()?);
            }
        }
        _ => return None,
    }
    Some(())
}

fn push_turn(text: &mut String, role: &str, s: &str) {
    text.push_str(role);
    text.push_str(": ");
    text.push_str(s);
    text.push('\n');
}

/// `s` split before its last `max` bytes (on a char boundary): (head, tail); the head
/// is empty when `s` fits.
fn split_tail(s: String, max: usize) -> (String, String) {
    if s.len() <= max {
        return (String::new(), s);
    }
    let mut start = s.len() - max;
    while !s.is_char_boundary(start) {
        start += 1;
    }
    (s[..start].to_string(), s[start..].to_string())
}

/// Feeds canonical JSON into a SHA-256.
struct HashWriter<'a>(&'a mut Sha256);

impl HashWriter<'_> {
    fn raw(&mut self, b: &[u8]) {
        self.0.update(b);
    }
}

impl Write for HashWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Canonical JSON of `v`: keys sorted, no whitespace; strings and numbers as serde_json
/// writes them.
fn write_value(w: &mut HashWriter<'_>, v: &Value) {
    match v {
        Value::Object(m) => write_object(w, m, &|_, _| true),
        Value::Array(a) => {
            w.raw(b"[");
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    w.raw(b",");
                }
                write_value(w, x);
            }
            w.raw(b"]");
        }
        // Writing into a hasher cannot fail.
        leaf => {
            let _ = serde_json::to_writer(&mut *w, leaf);
        }
    }
}

/// An object's members that `keep` accepts, keys sorted.
fn write_object(
    w: &mut HashWriter<'_>,
    m: &Map<String, Value>,
    keep: &dyn Fn(&str, &Value) -> bool,
) {
    write_object_with(w, m, keep, &|_, _, _| false);
}

/// Like [`write_object`]; `special` writes a member's value itself when it returns true.
fn write_object_with(
    w: &mut HashWriter<'_>,
    m: &Map<String, Value>,
    keep: &dyn Fn(&str, &Value) -> bool,
    special: &dyn Fn(&mut HashWriter<'_>, &str, &Value) -> bool,
) {
    let mut members: Vec<(&String, &Value)> = m.iter().filter(|(k, v)| keep(k, v)).collect();
    members.sort_unstable_by(|a, b| a.0.cmp(b.0));
    w.raw(b"{");
    for (i, (k, v)) in members.into_iter().enumerate() {
        if i > 0 {
            w.raw(b",");
        }
        let _ = serde_json::to_writer(&mut *w, k);
        w.raw(b":");
        if !special(w, k, v) {
            write_value(w, v);
        }
    }
    w.raw(b"}");
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Key = [0; 32];

    fn req(e: Endpoint, body: &str) -> CacheRequest {
        analyse(e, body.as_bytes(), &T, true).expect("keyable")
    }

    fn chat(body: &str) -> CacheRequest {
        req(Endpoint::ChatCompletions, body)
    }

    #[test]
    fn key_ignores_order_whitespace_and_stream_false() {
        let a = chat(r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#);
        let b = chat(
            r#"{ "messages" : [ {"content":"hi", "role":"user"} ],
                "stream": false, "model":"m" }"#,
        );
        assert_eq!(a.key, b.key);
        assert!(!a.stream && !b.stream);
        let s = chat(r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#);
        assert!(s.stream);
        assert_ne!(a.key, s.key, "a streamed answer is another entry");
        let other = chat(r#"{"model":"m","messages":[{"role":"user","content":"hi!"}]}"#);
        assert_ne!(a.key, other.key);
    }

    #[test]
    fn key_depends_on_endpoint_and_tenant() {
        let body = br#"{"model":"m","prompt":"hi"}"#;
        let a = analyse(Endpoint::Completions, body, &T, false).unwrap();
        let b = analyse(Endpoint::ChatCompletions, body, &T, false).unwrap();
        assert_ne!(a.key, b.key);
        let mut h1 = http::HeaderMap::new();
        h1.insert("authorization", "Bearer one".parse().unwrap());
        let mut h2 = http::HeaderMap::new();
        h2.insert("authorization", "Bearer two".parse().unwrap());
        let mut h3 = http::HeaderMap::new();
        h3.insert("x-api-key", "one".parse().unwrap());
        let keys: Vec<Key> = [&h1, &h2, &h3, &http::HeaderMap::new()]
            .iter()
            .map(|h| {
                analyse(Endpoint::Completions, body, &tenant(h), false)
                    .unwrap()
                    .key
            })
            .collect();
        for i in 0..keys.len() {
            for j in i + 1..keys.len() {
                assert_ne!(keys[i], keys[j], "{i} vs {j}");
            }
        }
    }

    #[test]
    fn bypasses() {
        for bad in ["", "[1]", "{", "\"x\"", "{\"model\":\"m\",}"] {
            assert_eq!(
                analyse(Endpoint::ChatCompletions, bad.as_bytes(), &T, true).unwrap_err(),
                Unkeyable::Unreadable,
                "{bad:?}"
            );
        }
        let n2 = br#"{"model":"m","n":2,"messages":[]}"#;
        assert_eq!(
            analyse(Endpoint::ChatCompletions, n2, &T, true).unwrap_err(),
            Unkeyable::Choices
        );
        let n1 = br#"{"model":"m","n":1,"messages":[]}"#;
        assert!(analyse(Endpoint::ChatCompletions, n1, &T, true).is_ok());
    }

    fn part(body: &str) -> Key {
        chat(body).semantic.expect("semantic").partition
    }

    #[test]
    fn partition_keeps_everything_but_the_conversation_text() {
        let base = r#"{"model":"m","temperature":0,"messages":[{"role":"system","content":"answer in German"},{"role":"user","content":"what is a cat"}]}"#;
        let same_meaning = r#"{"model":"m","temperature":0,"user":"u1","metadata":{"a":1},"messages":[{"role":"system","content":"answer in German"},{"role":"user","content":"what is a cat?"}]}"#;
        assert_eq!(part(base), part(same_meaning));
        for differs in [
            base.replace("German", "Japanese"),
            base.replace("\"temperature\":0", "\"temperature\":1"),
            base.replace("\"model\":\"m\"", "\"model\":\"n\""),
            base.replace("\"temperature\":0", "\"temperature\":0,\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}]"),
            base.replace("\"temperature\":0", "\"temperature\":0,\"stream\":true"),
            // The system message moved after the question.
            r#"{"model":"m","temperature":0,"messages":[{"role":"user","content":"what is a cat"},{"role":"system","content":"answer in German"}]}"#.to_string(),
        ] {
            assert_ne!(part(base), part(&differs), "{differs}");
        }
        let text = chat(base).semantic.unwrap().text;
        assert_eq!(text, "user: what is a cat\n");
    }

    #[test]
    fn text_the_words_cannot_carry_gets_no_semantic_input() {
        for body in [
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"http://x/a.png"}}]}]}"#,
            r#"{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":null,"tool_calls":[{"id":"1"}]},{"role":"tool","content":"42","tool_call_id":"1"}]}"#,
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"input_audio","input_audio":{}}]}]}"#,
            r#"{"model":"m","messages":[]}"#,
        ] {
            assert!(chat(body).semantic.is_none(), "{body}");
        }
        let anthropic = req(
            Endpoint::Messages,
            r#"{"model":"m","system":"be brief","max_tokens":9,"messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"1","content":"x"}]}]}"#,
        );
        assert!(anthropic.semantic.is_none());
        let tokens = req(Endpoint::Completions, r#"{"model":"m","prompt":[1,2,3]}"#);
        assert!(tokens.semantic.is_none());
        let prev = req(
            Endpoint::Responses,
            r#"{"model":"m","input":"and then?","previous_response_id":"resp_1"}"#,
        );
        assert!(prev.semantic.is_none());
    }

    #[test]
    fn every_endpoint_yields_its_text() {
        let c = req(
            Endpoint::Completions,
            r#"{"model":"m","prompt":"once upon"}"#,
        );
        assert_eq!(c.semantic.unwrap().text, "prompt: once upon\n");
        let a = req(
            Endpoint::Messages,
            r#"{"model":"m","system":"s","max_tokens":9,"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]},{"role":"assistant","content":"yo"}]}"#,
        );
        assert_eq!(a.semantic.unwrap().text, "user: hi\nassistant: yo\n");
        let r = req(
            Endpoint::Responses,
            r#"{"model":"m","instructions":"x","input":[{"role":"user","content":[{"type":"input_text","text":"q"}]}]}"#,
        );
        assert_eq!(r.semantic.unwrap().text, "user: q\n");
        let sys_a = req(
            Endpoint::Messages,
            r#"{"model":"m","system":"German","max_tokens":9,"messages":[{"role":"user","content":"q"}]}"#,
        );
        let sys_b = req(
            Endpoint::Messages,
            r#"{"model":"m","system":"Japanese","max_tokens":9,"messages":[{"role":"user","content":"q"}]}"#,
        );
        assert_ne!(
            sys_a.semantic.unwrap().partition,
            sys_b.semantic.unwrap().partition
        );
    }

    #[test]
    fn long_text_keeps_its_end_on_a_char_boundary() {
        let s = format!("{}é", "a".repeat(10));
        assert_eq!(split_tail(s, 2), ("a".repeat(10), "é".to_string()));
        assert_eq!(split_tail("abc".into(), 2), ("a".into(), "bc".into()));
        assert_eq!(split_tail("abc".into(), 9), (String::new(), "abc".into()));
    }

    #[test]
    fn texts_that_differ_only_past_the_embedded_tail_are_other_partitions() {
        let appendix = "appendix text. ".repeat(3000);
        let body = |price: &str| {
            serde_json::json!({"model": "m", "messages": [{"role": "user",
                "content": format!("Contract: the price is {price} dollars. {appendix} What is the price?")}]})
            .to_string()
        };
        let a = chat(&body("ONE")).semantic.unwrap();
        let b = chat(&body("NINE THOUSAND")).semantic.unwrap();
        assert_eq!(a.text, b.text, "the embedded tails are the same");
        assert!(a.text.len() <= MAX_SEMANTIC_TEXT);
        assert_ne!(a.partition, b.partition, "the cut heads differ");
    }

    #[test]
    fn stateful_and_imprecise_requests_are_not_keyed() {
        for body in [
            r#"{"model":"m","conversation":"conv_1","input":"and then?"}"#,
            r#"{"model":"m","background":true,"input":"x"}"#,
        ] {
            let e = analyse(Endpoint::Responses, body.as_bytes(), &T, true).unwrap_err();
            assert_eq!(e, Unkeyable::Stateful, "{body}");
        }
        let big = br#"{"model":"m","seed":12345678901234567890123,"prompt":"x"}"#;
        assert_eq!(
            analyse(Endpoint::Completions, big, &T, false).unwrap_err(),
            Unkeyable::Unreadable
        );
        let fine = br#"{"model":"m","seed":18446744073709551615,"temperature":0.7,"prompt":"x"}"#;
        assert!(analyse(Endpoint::Completions, fine, &T, false).is_ok());
        let n = br#"{"model":"m","n":"2","prompt":"x"}"#;
        assert_eq!(
            analyse(Endpoint::Completions, n, &T, false).unwrap_err(),
            Unkeyable::Choices
        );
    }
}

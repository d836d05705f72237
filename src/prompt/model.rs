//! A request's `model`: where its string sits in the body (read by the endpoint's own
//! parse, no second one), the name it gives, and the body carrying another served name
//! (an alias's target, or the model chosen for a request that named none): the one
//! JSON string replaced in place, nothing else re-serialised.

use std::borrow::Cow;
use std::ops::Range;

use bytes::{Bytes, BytesMut};
use serde_json::value::RawValue;

/// The body's top-level `model` string. See the module docs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelField {
    /// The JSON string's bytes in the body, quotes included.
    pub span: Range<usize>,
}

impl ModelField {
    /// The field `raw` (a value borrowed from `body` by the endpoint's parse), when it
    /// is a string.
    pub(crate) fn of(raw: Option<&RawValue>, body: &[u8]) -> Option<ModelField> {
        let v = raw?.get();
        if !v.starts_with('"') {
            return None;
        }
        let start = (v.as_ptr() as usize).checked_sub(body.as_ptr() as usize)?;
        let end = start + v.len();
        (end <= body.len()).then_some(ModelField { span: start..end })
    }

    /// The name it gives (escapes decoded; borrowed from `body` when it has none);
    /// `None` when the span holds no JSON string.
    pub fn name<'b>(&self, body: &'b [u8]) -> Option<Cow<'b, str>> {
        let raw = body.get(self.span.clone())?;
        let inner = raw.strip_prefix(b"\"")?.strip_suffix(b"\"")?;
        if !inner.contains(&b'\\') {
            return std::str::from_utf8(inner).ok().map(Cow::Borrowed);
        }
        serde_json::from_slice::<String>(raw).ok().map(Cow::Owned)
    }
}

/// The top-level `model` of a JSON object body that is not of its endpoint's shape (the
/// routing text then is the raw body; the model still chooses the pool).
pub(crate) fn of_any_object(body: &[u8]) -> Option<ModelField> {
    #[derive(serde::Deserialize)]
    struct Only<'a> {
        #[serde(borrow, default)]
        model: Option<&'a RawValue>,
    }
    let only: Only<'_> = serde_json::from_slice(body).ok()?;
    ModelField::of(only.model, body)
}

/// `body` with `model` set to `name`: the string at `field` replaced, or, when the
/// request named none (`field` is `None`), a `"model"` member put first in its object.
/// A body that is not an object is returned as it is.
pub fn with_model(body: &Bytes, field: Option<&ModelField>, name: &str) -> Bytes {
    let quoted = serde_json::to_string(name).unwrap_or_else(|_| "\"\"".into());
    let (head, tail, member) = match field {
        Some(f) if f.span.end <= body.len() => (&body[..f.span.start], &body[f.span.end..], false),
        Some(_) => return body.clone(),
        None => {
            let open = body.iter().position(|b| !b.is_ascii_whitespace());
            match open {
                Some(i) if body[i] == b'{' => (&body[..=i], &body[i + 1..], true),
                _ => return body.clone(),
            }
        }
    };
    let mut out = BytesMut::with_capacity(body.len() + quoted.len() + 10);
    out.extend_from_slice(head);
    if member {
        out.extend_from_slice(b"\"model\":");
    }
    out.extend_from_slice(quoted.as_bytes());
    if member && tail.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'}') {
        out.extend_from_slice(b",");
    }
    out.extend_from_slice(tail);
    out.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prompt::{Endpoint, extract};

    fn field(body: &str, e: Endpoint) -> Option<ModelField> {
        extract(e, body.as_bytes(), 1 << 20).model
    }

    #[test]
    fn every_endpoint_reads_the_model_in_its_own_parse() {
        for (e, body) in [
            (
                Endpoint::ChatCompletions,
                r#"{"messages":[{"role":"user","content":"hi"}], "model" : "m\u00e9"}"#,
            ),
            (Endpoint::Completions, r#"{"model":"mé","prompt":"hi"}"#),
            (Endpoint::Responses, r#"{"model":"mé","input":"hi"}"#),
            (
                Endpoint::Messages,
                r#"{"model":"mé","max_tokens":1,"messages":[]}"#,
            ),
            (
                Endpoint::Completions,
                r#"{"model":"mé","prompt":{"odd":1}}"#,
            ),
        ] {
            let f = field(body, e).unwrap_or_else(|| panic!("{body}"));
            assert_eq!(f.name(body.as_bytes()).as_deref(), Some("mé"), "{body}");
        }
        for body in [
            r#"{"messages":[]}"#,
            r#"{"model":null,"messages":[]}"#,
            r#"{"model":7,"messages":[]}"#,
            "not json",
        ] {
            assert_eq!(field(body, Endpoint::ChatCompletions), None, "{body}");
        }
    }

    #[test]
    fn the_one_string_is_replaced_and_the_rest_kept_byte_for_byte() {
        let body = r#"{"model" : "chat",  "messages":[{"content":"model \"chat\""}]}"#;
        let f = field(body, Endpoint::ChatCompletions).unwrap();
        let out = with_model(&Bytes::from(body), Some(&f), "llama-\"b\"");
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            r#"{"model" : "llama-\"b\"",  "messages":[{"content":"model \"chat\""}]}"#
        );
    }

    #[test]
    fn a_body_without_model_gets_one_first() {
        let put = |b: &str| {
            String::from_utf8(with_model(&Bytes::from(b.to_string()), None, "m").to_vec()).unwrap()
        };
        assert_eq!(put(r#" {"prompt":"x"}"#), r#" {"model":"m","prompt":"x"}"#);
        assert_eq!(put("{ }"), r#"{"model":"m" }"#);
        assert_eq!(put("[1]"), "[1]");
    }
}

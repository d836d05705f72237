//! The top-level members of a JSON object, found by stepping over the values between
//! them without decoding them.
//!
//! An engine's answer puts `usage` after `choices`, which holds the generated text
//! (KiB for a long answer). A full parse decodes and checks every byte of that text to
//! reach `usage`; here a string is skipped with one SIMD search for its closing quote
//! (`memchr2` for `"` and `\`), and a nested object or array by counting brackets
//! outside strings. Only the members the caller wants are then parsed, by serde, from
//! their own bytes.

/// Calls `member(key, value)` for each top-level member of the JSON object `body`, in
/// order: `key` is the bytes between the key's quotes, `value` the value's bytes from
/// its first to its last (`{…}`, `"…"`, `12`, `null`).
///
/// Returns `None`, having called `member` for some members or none, when `body` is not
/// one object (with only whitespace around it) or a key holds an escape (its bytes would
/// not be its name). Values are delimited, not validated: `[1 2]` passes as one value;
/// the caller's parse of a value it wants is what checks it.
pub fn for_each<'a>(body: &'a [u8], mut member: impl FnMut(&'a [u8], &'a [u8])) -> Option<()> {
    let mut i = skip_ws(body, 0);
    expect(body, i, b'{')?;
    i = skip_ws(body, i + 1);
    if body.get(i) == Some(&b'}') {
        return only_ws_after(body, i + 1);
    }
    loop {
        expect(body, i, b'"')?;
        let close = string_end(body, i)?;
        let key = &body[i + 1..close];
        if key.contains(&b'\\') {
            return None;
        }
        i = skip_ws(body, close + 1);
        expect(body, i, b':')?;
        let start = skip_ws(body, i + 1);
        let end = value_end(body, start)?;
        member(key, &body[start..end]);
        i = skip_ws(body, end);
        match body.get(i)? {
            b',' => i = skip_ws(body, i + 1),
            b'}' => return only_ws_after(body, i + 1),
            _ => return None,
        }
    }
}

fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

fn skip_ws(body: &[u8], mut i: usize) -> usize {
    while body.get(i).is_some_and(|&b| is_ws(b)) {
        i += 1;
    }
    i
}

fn expect(body: &[u8], i: usize, want: u8) -> Option<()> {
    (body.get(i) == Some(&want)).then_some(())
}

fn only_ws_after(body: &[u8], i: usize) -> Option<()> {
    body[i..].iter().all(|&b| is_ws(b)).then_some(())
}

/// The index of the quote that closes the string opened at `open`; `None` when the
/// string never closes.
pub(super) fn string_end(body: &[u8], open: usize) -> Option<usize> {
    let mut i = open + 1;
    loop {
        i += memchr::memchr2(b'"', b'\\', body.get(i..)?)?;
        if body[i] == b'"' {
            return Some(i);
        }
        // An escape: its next byte (a quote, say) is part of the string.
        i += 2;
    }
}

/// The index just past the value that starts at `start`.
fn value_end(body: &[u8], start: usize) -> Option<usize> {
    match *body.get(start)? {
        b'"' => string_end(body, start).map(|c| c + 1),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut i = start;
            while let Some(&b) = body.get(i) {
                match b {
                    b'"' => i = string_end(body, i)?,
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(i + 1);
                        }
                    }
                    _ => {}
                }
                i += 1;
            }
            None
        }
        b',' | b'}' | b']' | b':' => None,
        _ => {
            // A number, `true`, `false` or `null`: up to the next delimiter.
            let len = body[start..]
                .iter()
                .position(|&b| matches!(b, b',' | b'}' | b']') || is_ws(b))
                .unwrap_or(body.len() - start);
            Some(start + len)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members(body: &str) -> Option<Vec<(String, String)>> {
        let mut out = Vec::new();
        for_each(body.as_bytes(), |k, v| {
            out.push((
                String::from_utf8(k.to_vec()).unwrap(),
                String::from_utf8(v.to_vec()).unwrap(),
            ))
        })?;
        Some(out)
    }

    fn pairs(list: &[(&str, &str)]) -> Option<Vec<(String, String)>> {
        Some(
            list.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    #[test]
    fn members_are_found_past_nested_values_and_tricky_strings() {
        let body = r#" {"id":"chatcmpl-1", "choices":[{"message":{"content":"a \"usage\": {\"x\":1} ] } \\"}}],
            "n": -1.5e3 ,"ok":true,"none":null,"usage":{"prompt_tokens":12,"prompt_tokens_details":{"cached_tokens":8}}}
        "#;
        assert_eq!(
            members(body),
            pairs(&[
                ("id", r#""chatcmpl-1""#),
                (
                    "choices",
                    r#"[{"message":{"content":"a \"usage\": {\"x\":1} ] } \\"}}]"#
                ),
                ("n", "-1.5e3"),
                ("ok", "true"),
                ("none", "null"),
                (
                    "usage",
                    r#"{"prompt_tokens":12,"prompt_tokens_details":{"cached_tokens":8}}"#
                ),
            ])
        );
        assert_eq!(members("{}"), pairs(&[]));
        assert_eq!(members(" { } \n"), pairs(&[]));
    }

    /// A random JSON value: nested objects and arrays, strings with escapes, quotes,
    /// brackets and non-ASCII text, numbers, literals.
    fn random_value(rng: &mut rand::rngs::StdRng, depth: u32) -> serde_json::Value {
        use rand::Rng;
        use serde_json::Value;
        const PIECES: [&str; 8] = ["a", "\"", "\\", "{", "]", "usage", "é漢", "\n\t"];
        let text = |rng: &mut rand::rngs::StdRng| {
            (0..rng.random_range(0..6))
                .map(|_| PIECES[rng.random_range(0..PIECES.len())])
                .collect::<String>()
        };
        match rng.random_range(0..if depth == 0 { 4 } else { 6 }) {
            0 => Value::String(text(rng)),
            // Quarters: exact in binary, so serde's float parse gives them back equal.
            1 => Value::from(rng.random_range(-4_000_000i64..4_000_000) as f64 / 4.0),
            2 => Value::from(rng.random_range(-1000i64..1000)),
            3 => {
                [Value::Null, Value::Bool(true), Value::Bool(false)][rng.random_range(0..3)].clone()
            }
            4 => Value::Array(
                (0..rng.random_range(0..4))
                    .map(|_| random_value(rng, depth - 1))
                    .collect(),
            ),
            _ => Value::Object(
                (0..rng.random_range(0..4))
                    .map(|_| (text(rng), random_value(rng, depth - 1)))
                    .collect(),
            ),
        }
    }

    #[test]
    fn random_objects_split_into_the_members_serde_reads() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(17);
        for _ in 0..2000 {
            let want: serde_json::Map<String, serde_json::Value> = (0..rng.random_range(0..6))
                .map(|_| match random_value(&mut rng, 0) {
                    serde_json::Value::String(key) => (key, random_value(&mut rng, 4)),
                    other => (other.to_string(), random_value(&mut rng, 4)),
                })
                .collect();
            let body = if want.len().is_multiple_of(2) {
                serde_json::to_string(&want).unwrap()
            } else {
                serde_json::to_string_pretty(&want).unwrap()
            };
            let mut got = serde_json::Map::new();
            let scanned = for_each(body.as_bytes(), |k, v| {
                let key = String::from_utf8(k.to_vec()).unwrap();
                got.insert(key, serde_json::from_slice(v).expect("a whole value"));
            });
            // Keys with escapes are refused (the full parse reads those bodies).
            if want
                .keys()
                .any(|k| serde_json::to_string(k).unwrap().contains('\\'))
            {
                assert_eq!(scanned, None, "{body}");
            } else {
                assert_eq!(scanned, Some(()), "{body}");
                assert_eq!(got, want, "{body}");
            }
            // Cut anywhere, a body is refused or read without a panic.
            for cut in [1, body.len() / 3, body.len() / 2, body.len() - 1] {
                let _ = for_each(&body.as_bytes()[..cut], |_, _| {});
            }
        }
    }

    #[test]
    fn what_is_not_one_object_is_refused() {
        for bad in [
            "",
            "[]",
            "\"usage\"",
            "{",
            "{\"a\":1",
            "{\"a\":1,}",
            "{\"a\" 1}",
            "{\"a\":}",
            "{\"a\":[1,2}",
            "{\"a\":\"open}",
            "{\"a\":1}{\"b\":2}",
            "{\"a\":1} x",
            "{a:1}",
            "{\"us\\u0061ge\":{}}",
            "{\"a\":\"\\",
        ] {
            assert_eq!(members(bad), None, "{bad:?}");
        }
    }
}

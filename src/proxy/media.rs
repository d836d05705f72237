//! `proxy.remote_media_url_policy`: whether a request body makes an engine fetch media
//! by reference.
//!
//! vLLM and SGLang fetch any `http(s)://` media URL they are given (SGLang also opens
//! local paths), so a client can turn them into a server-side request forgery tool. The
//! check runs on the raw bytes of every body the router forwards, routed endpoint or
//! pass-through alike, and does not depend on the endpoint's shape: it walks the whole
//! JSON text once and looks at the value of **every** occurrence of a media-carrying
//! member, at any depth. A body that names `"messages"` twice (Python's `json` keeps
//! the last, serde the first, or refuses it), a part without `type`, a URL past
//! `cache.max_prompt_bytes`, a pooling or score body: all are seen alike.
//!
//! Media-carrying members ([`MEDIA_KEYS`]): `image_url`, `video_url`, `audio_url` (a
//! string, or an object whose `url` members are read: OpenAI and vLLM chat parts with
//! or without `type`, Responses `input_image`), `file_url` (Responses `input_file`),
//! SGLang's `image_data`, `video_data`, `audio_data` (a string or a list), and an
//! Anthropic `source` object's `url`. Lists under them are read element by element.
//!
//! A value is **inline** (allowed) when it is a `data:` URL or bare base64 (SGLang
//! decodes it); anything else, a URL of any scheme in any case (`HTTP://`, `file:`,
//! `ftp:`) or a path, is a reference and refused. Like Python's `urlsplit`, leading
//! spaces and control characters, and tabs and newlines anywhere, are ignored when the
//! scheme is read. Text that merely mentions a URL is not a media member and passes.
//!
//! The body is read as the engines' Python `json.loads(bytes)` reads it: a UTF-8 BOM
//! is skipped, and UTF-16 and UTF-32 bodies (with or without a BOM, told apart by
//! their zero bytes) are decoded first. Cost: one pass over the body, strings skipped
//! with `memchr2`; only when the policy refuses remote media, and without a copy of the
//! body unless it is UTF-16 or UTF-32.

use std::borrow::Cow;

use super::json_members::string_end;

/// The members whose value an engine may fetch or open (see the module docs).
pub const MEDIA_KEYS: [&str; 7] = [
    "image_url",
    "video_url",
    "audio_url",
    "file_url",
    "image_data",
    "video_data",
    "audio_data",
];

/// Whether `body` carries media by reference (a URL or path an engine would fetch or
/// open) in any media-carrying member. Never fails: bytes that are not JSON carry no
/// member and pass, as the engine refuses them itself.
pub fn references_remote_media(body: &[u8]) -> bool {
    scan(&as_utf8(body))
}

/// What the value at the current position is to the check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// Not media: strings are text, never checked.
    Plain,
    /// A media reference: a string is checked, an array's elements are media, an
    /// object's `url` (and media keys) are.
    Media,
    /// An Anthropic `source`: an object is media (its `url`), a string is not.
    Source,
}

/// One open object or array.
struct Frame {
    object: bool,
    role: Role,
    /// In an object: the role of the value after the last key read.
    next: Role,
}

fn scan(b: &[u8]) -> bool {
    let mut stack: Vec<Frame> = Vec::new();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'"' => {
                // An unterminated string: not JSON, the engine refuses it.
                let Some(close) = string_end(b, i) else {
                    return false;
                };
                let after = skip_ws(b, close + 1);
                match stack.last_mut() {
                    Some(f) if f.object && b.get(after) == Some(&b':') => {
                        f.next = child_role(f.role, &b[i..=close]);
                        i = after + 1;
                        continue;
                    }
                    _ => {
                        if value_role(&stack) == Role::Media && !is_inline(&b[i..=close]) {
                            return true;
                        }
                    }
                }
                i = close + 1;
                continue;
            }
            open @ (b'{' | b'[') => {
                let role = match value_role(&stack) {
                    Role::Source if open == b'{' => Role::Media,
                    Role::Source => Role::Plain,
                    r => r,
                };
                stack.push(Frame {
                    object: open == b'{',
                    role,
                    next: Role::Plain,
                });
            }
            b'}' | b']' => {
                stack.pop();
            }
            b',' => {
                if let Some(f) = stack.last_mut().filter(|f| f.object) {
                    f.next = Role::Plain;
                }
            }
            _ => {}
        }
        i += 1;
    }
    false
}

/// The role of a value starting now: after a key, the key's; in an array, the array's.
fn value_role(stack: &[Frame]) -> Role {
    match stack.last() {
        Some(f) if f.object => f.next,
        Some(f) => f.role,
        None => Role::Plain,
    }
}

/// The role of the value of member `key` (its quoted bytes) in an object of `parent`
/// role.
fn child_role(parent: Role, quoted: &[u8]) -> Role {
    let key = decoded(quoted);
    let Some(key) = key.as_deref() else {
        return Role::Plain;
    };
    if MEDIA_KEYS.contains(&key) || (parent == Role::Media && key == "url") {
        Role::Media
    } else if key == "source" {
        Role::Source
    } else {
        Role::Plain
    }
}

/// The text of a JSON string (its quoted bytes): borrowed when it holds no escape;
/// `None` when it does not decode (an invalid escape, a lone surrogate, bad UTF-8).
fn decoded(quoted: &[u8]) -> Option<Cow<'_, str>> {
    let inner = &quoted[1..quoted.len() - 1];
    if inner.contains(&b'\\') {
        serde_json::from_slice::<String>(quoted)
            .ok()
            .map(Cow::Owned)
    } else {
        std::str::from_utf8(inner).ok().map(Cow::Borrowed)
    }
}

/// Whether a media value (its quoted bytes) is inline data: a `data:` URL or bare
/// base64. A value that does not decode is not.
fn is_inline(quoted: &[u8]) -> bool {
    let Some(v) = decoded(quoted) else {
        return false;
    };
    // `urlsplit` strips leading C0 controls and spaces, and drops tabs and newlines.
    let v = v.trim_start_matches(|c: char| c <= ' ');
    let scheme: String = v
        .chars()
        .filter(|c| !matches!(c, '\t' | '\n' | '\r'))
        .take(5)
        .collect();
    scheme.eq_ignore_ascii_case("data:")
        || v.bytes().all(|c| {
            c.is_ascii_alphanumeric()
                || matches!(c, b'+' | b'/' | b'=' | b'-' | b'_')
                || c.is_ascii_whitespace()
        })
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while b
        .get(i)
        .is_some_and(|c| matches!(c, b' ' | b'\t' | b'\n' | b'\r'))
    {
        i += 1;
    }
    i
}

/// The body as UTF-8 bytes, decoded as Python's `json.detect_encoding` would read it.
fn as_utf8(b: &[u8]) -> Cow<'_, [u8]> {
    enum Enc {
        Utf16 { be: bool },
        Utf32 { be: bool },
    }
    let (enc, skip) = match b {
        [0, 0, 0xfe, 0xff, ..] => (Enc::Utf32 { be: true }, 4),
        [0xff, 0xfe, 0, 0, ..] => (Enc::Utf32 { be: false }, 4),
        [0xfe, 0xff, ..] => (Enc::Utf16 { be: true }, 2),
        [0xff, 0xfe, ..] => (Enc::Utf16 { be: false }, 2),
        [0xef, 0xbb, 0xbf, ..] => return Cow::Borrowed(&b[3..]),
        [0, b1, _, _, ..] => (
            if *b1 != 0 {
                Enc::Utf16 { be: true }
            } else {
                Enc::Utf32 { be: true }
            },
            0,
        ),
        [_, 0, b2, b3, ..] => (
            if *b2 != 0 || *b3 != 0 {
                Enc::Utf16 { be: false }
            } else {
                Enc::Utf32 { be: false }
            },
            0,
        ),
        _ => return Cow::Borrowed(b),
    };
    let b = &b[skip..];
    let text: String = match enc {
        Enc::Utf16 { be } => char::decode_utf16(b.chunks_exact(2).map(|c| {
            let pair = [c[0], c[1]];
            if be {
                u16::from_be_bytes(pair)
            } else {
                u16::from_le_bytes(pair)
            }
        }))
        .map(|c| c.unwrap_or(char::REPLACEMENT_CHARACTER))
        .collect(),
        Enc::Utf32 { be } => b
            .chunks_exact(4)
            .map(|c| {
                let quad = [c[0], c[1], c[2], c[3]];
                let n = if be {
                    u32::from_be_bytes(quad)
                } else {
                    u32::from_le_bytes(quad)
                };
                char::from_u32(n).unwrap_or(char::REPLACEMENT_CHARACTER)
            })
            .collect(),
    };
    Cow::Owned(text.into_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    const URL: &str = "http://169.254.169.254/latest/meta-data/";

    fn chat(part: &str) -> String {
        format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"text","text":"look"}},{part}]}}]}}"#
        )
    }

    #[test]
    fn every_part_shape_the_engines_accept_is_seen() {
        for part in [
            format!(r#"{{"type":"image_url","image_url":{{"url":"{URL}"}}}}"#),
            format!(r#"{{"type":"video_url","video_url":{{"url":"{URL}"}}}}"#),
            format!(r#"{{"type":"audio_url","audio_url":{{"url":"{URL}"}}}}"#),
            format!(r#"{{"image_url":{{"url":"{URL}"}}}}"#),
            format!(r#"{{"image_url":"{URL}"}}"#),
            format!(r#"{{"audio_url":{{"url":"{URL}"}}}}"#),
            format!(r#"{{"video_url":"{URL}"}}"#),
            format!(r#"{{"type":"input_image","image_url":"{URL}"}}"#),
            format!(r#"{{"type":"input_file","file_url":"{URL}"}}"#),
            format!(r#"{{"type":"image","source":{{"type":"url","url":"{URL}"}}}}"#),
            // Case, leading blanks, tabs inside the scheme, escapes.
            r#"{"image_url":{"url":"HTTP://169.254.169.254/"}}"#.into(),
            r#"{"image_url":{"url":" \u0001https://x/"}}"#.into(),
            r#"{"image_url":{"url":"ht\ttp://x/"}}"#.into(),
            r#"{"image_url":{"url":"\u0068ttp://x/"}}"#.into(),
            r#"{"image\u005furl":{"url":"http://x/"}}"#.into(),
            // Other schemes and paths are references too.
            r#"{"image_url":{"url":"file:///etc/passwd.png"}}"#.into(),
            r#"{"image_url":"cat.png"}"#.into(),
            // Two members of the same name: each is seen.
            format!(r#"{{"image_url":{{"url":"data:,x","url":"{URL}"}}}}"#),
            format!(
                r#"{{"type":"image_url","image_url":{{"url":"data:,x"}},"image_url":"{URL}"}}"#
            ),
            // A lone surrogate serde cannot decode: not inline.
            r#"{"image_url":"\ud800http://x/"}"#.into(),
        ] {
            assert!(references_remote_media(chat(&part).as_bytes()), "{part}");
        }
    }

    #[test]
    fn media_anywhere_in_any_body_is_seen() {
        let part = format!(r#"{{"type":"image_url","image_url":{{"url":"{URL}"}}}}"#);
        for body in [
            // The last `messages` is the one the engine keeps.
            format!(
                r#"{{"messages":[{{"role":"user","content":"hi"}}],"messages":[{{"role":"user","content":[{part}]}}]}}"#
            ),
            // Past any prompt cut.
            format!(
                r#"{{"messages":[{{"role":"user","content":[{{"type":"text","text":"{}"}},{part}]}}]}}"#,
                "x".repeat(40_000)
            ),
            // Pooling, score, SGLang's native /generate.
            format!(r#"{{"model":"m","text_1":"q","text_2":{{"content":[{part}]}}}}"#),
            format!(r#"{{"text":"x","image_data":["data:,a","{URL}"]}}"#),
            format!(r#"{{"text":"x","video_data":[["{URL}"]]}}"#),
            format!(
                r#"{{"input":[{{"role":"user","content":[{{"type":"input_image","image_url":"{URL}"}}]}}]}}"#
            ),
        ] {
            assert!(references_remote_media(body.as_bytes()), "{body}");
        }
    }

    #[test]
    fn inline_media_and_mentions_pass() {
        for body in [
            chat(
                r#"{"type":"image_url","image_url":{"url":"data:image/png;base64,iVBORw0KGgo="}}"#,
            ),
            chat(
                r#"{"type":"image_url","image_url":{"url":" DATA:image/png;base64,QUJD","detail":"high"}}"#,
            ),
            chat(r#"{"image_url":"/9j/4AAQSkZJRg=="}"#),
            chat(&format!(r#"{{"type":"text","text":"what is at {URL}?"}}"#)),
            chat(&format!(
                r#"{{"type":"text","text":"{{\"image_url\":\"{URL}\"}}"}}"#
            )),
            chat(&format!(r#"{{"type":"image","source":"{URL}"}}"#)),
            format!(
                r#"{{"metadata":{{"url":"{URL}"}},"tools":[{{"type":"mcp","server_url":"{URL}"}}]}}"#
            ),
            format!(
                r#"{{"input":[{{"type":"message","content":[{{"type":"output_text","annotations":[{{"type":"url_citation","url":"{URL}"}}]}}]}}]}}"#
            ),
            r#"{"image_url":null,"video_url":{"uuid":"x"}}"#.into(),
        ] {
            assert!(!references_remote_media(body.as_bytes()), "{body}");
        }
    }

    #[test]
    fn other_encodings_are_read_as_python_reads_them() {
        let body = chat(&format!(r#"{{"image_url":"{URL}"}}"#));
        let utf16le: Vec<u8> = body.encode_utf16().flat_map(u16::to_le_bytes).collect();
        let utf16be: Vec<u8> = body.encode_utf16().flat_map(u16::to_be_bytes).collect();
        let utf32le: Vec<u8> = body
            .chars()
            .flat_map(|c| (c as u32).to_le_bytes())
            .collect();
        let utf32be: Vec<u8> = body
            .chars()
            .flat_map(|c| (c as u32).to_be_bytes())
            .collect();
        let bom8 = [&[0xef, 0xbb, 0xbf][..], body.as_bytes()].concat();
        let bom16 = [&[0xff, 0xfe][..], &utf16le].concat();
        let bom32 = [&[0, 0, 0xfe, 0xff][..], &utf32be].concat();
        for b in [utf16le, utf16be, utf32le, utf32be, bom8, bom16, bom32] {
            assert!(references_remote_media(&b), "{b:?}");
        }
    }

    #[test]
    fn cut_or_garbage_bodies_never_panic() {
        let body = chat(&format!(r#"{{"image_url":{{"url":"{URL}"}}}}"#));
        for end in 0..body.len() {
            let _ = references_remote_media(&body.as_bytes()[..end]);
        }
        for b in [
            &b""[..],
            b"\"",
            b"\"\\",
            b"{\"image_url\":\"\\",
            b"]]]}}}",
            b"{\"image_url\"",
            b"{\"image_url\":",
            b"\x00",
            b"\xff\xfe\x00",
            b"\x00\x00\xfe",
            b"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[",
        ] {
            assert!(!references_remote_media(b), "{b:?}");
        }
        // A value cut inside its string is not JSON: nothing is fetched.
        assert!(!references_remote_media(br#"{"image_url":"http://x"#));
    }
}

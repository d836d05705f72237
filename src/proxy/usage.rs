//! Reads the token usage an engine reports, from response bytes as they pass.
//!
//! vLLM and SGLang put `usage.prompt_tokens` and `usage.prompt_tokens_details.cached_tokens`
//! in a JSON response, and in the final SSE chunk when `stream_options.include_usage` is
//! set; Anthropic-style servers report `input_tokens` and `cache_read_input_tokens`
//! (in `message_start` when streaming). For `/v1/responses` it also reads the
//! response's `id` (the JSON body's, or the SSE `response.created` /
//! `response.completed` event's), which a follow-up's `previous_response_id` names.
//! The scanner only looks at bytes the proxy is
//! already forwarding: it never holds a chunk back. JSON bodies are copied up to
//! [`MAX_JSON_BYTES`]; SSE keeps only the current partial line. Compressed bodies are
//! not scanned.

use bytes::Bytes;
use http::HeaderMap;
use http::header;
use serde::Deserialize;

/// Largest JSON body copied for the usage scan, in bytes; past it, usage is not read.
pub const MAX_JSON_BYTES: usize = 1 << 20;
/// Longest SSE line kept while waiting for its end, in bytes.
const MAX_LINE_BYTES: usize = 1 << 20;

/// Tokens an engine reported for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: u64,
    /// Prompt tokens served from the engine's prefix cache; `None` when the answer names
    /// no count. vLLM writes `prompt_tokens_details` only when started with
    /// `--enable-prompt-tokens-details` *and* the count is non-zero (its
    /// `serving_chat.py`), SGLang only with `--enable-cache-report`: an absent count is
    /// 0 from an engine that reports, unknown from one that never does (see
    /// `pool::hits::HitStats::delivered`).
    pub cached_tokens: Option<u64>,
    /// Generated tokens (`completion_tokens`; Anthropic's `output_tokens`, in a stream
    /// the last `message_delta`'s), when the answer names them.
    pub completion_tokens: Option<u64>,
}

/// Incremental usage reader for one response body.
#[derive(Debug)]
pub enum UsageScanner {
    Json {
        /// A body that came in one chunk, held by reference (no copy); moved into
        /// `buf` when a second chunk comes.
        first: Option<Bytes>,
        buf: Vec<u8>,
        overflow: bool,
        /// Whether the answer's `id` and `object` are read (as for `Sse`).
        wants_id: bool,
        /// The body's first [`HEAD_BYTES`], kept past an overflow: a large answer's
        /// leading `id` is still read from it.
        head: Vec<u8>,
    },
    Sse {
        line: Vec<u8>,
        skipping: bool,
        usage: Option<Usage>,
        response_id: Option<String>,
        /// Whether data lines are searched for a response id (not for an endpoint that
        /// never answers with one).
        wants_id: bool,
        /// The stream's last event has passed ([`sse_line_ends`]).
        ended: bool,
    },
}

/// What a complete answer told: its usage and, for `/v1/responses`, its id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Found {
    pub usage: Option<Usage>,
    pub response_id: Option<String>,
}

impl UsageScanner {
    /// A scanner for a response with these headers, when it is uncompressed JSON or SSE.
    /// `wants_id`: the request's endpoint may answer with a `/v1/responses` id (false
    /// for chat completions, completions and messages: their streams' lines are then
    /// not searched for one, nor their JSON answers' `id` and `object` read).
    pub fn for_response(headers: &HeaderMap, wants_id: bool) -> Option<Self> {
        let encoded = headers
            .get(header::CONTENT_ENCODING)
            .is_some_and(|v| !v.as_bytes().eq_ignore_ascii_case(b"identity"));
        if encoded {
            return None;
        }
        let ct = headers.get(header::CONTENT_TYPE)?.to_str().ok()?;
        if ct.starts_with("text/event-stream") {
            Some(UsageScanner::Sse {
                line: Vec::new(),
                skipping: false,
                usage: None,
                response_id: None,
                wants_id,
                ended: false,
            })
        } else if ct.starts_with("application/json") {
            Some(UsageScanner::Json {
                first: None,
                buf: Vec::new(),
                wants_id,
                overflow: false,
                head: Vec::new(),
            })
        } else {
            None
        }
    }

    /// Looks at one chunk of the body (already on its way to the client). A JSON
    /// answer's first chunk is kept by reference: most answers are one chunk, read
    /// without a copy.
    pub fn feed_bytes(&mut self, chunk: &Bytes) {
        if let UsageScanner::Json {
            first: first @ None,
            buf,
            overflow: false,
            ..
        } = self
            && buf.is_empty()
            && chunk.len() <= MAX_JSON_BYTES
        {
            *first = Some(chunk.clone());
            return;
        }
        self.feed(chunk);
    }

    /// Looks at one chunk of the body (already on its way to the client), copying what
    /// it keeps.
    pub fn feed(&mut self, chunk: &[u8]) {
        match self {
            UsageScanner::Json {
                first,
                buf,
                overflow,
                head,
                ..
            } => {
                if *overflow {
                    return;
                }
                if let Some(f) = first.take() {
                    buf.extend_from_slice(&f);
                }
                if buf.len() + chunk.len() > MAX_JSON_BYTES {
                    *overflow = true;
                    buf.truncate(HEAD_BYTES);
                    let room = HEAD_BYTES - buf.len();
                    buf.extend_from_slice(&chunk[..chunk.len().min(room)]);
                    buf.shrink_to_fit();
                    *head = std::mem::take(buf);
                } else {
                    buf.extend_from_slice(chunk);
                }
            }
            UsageScanner::Sse {
                line,
                skipping,
                usage,
                response_id,
                wants_id,
                ended,
            } => {
                let mut rest = chunk;
                while let Some(nl) = memchr::memchr(b'\n', rest) {
                    if !*skipping {
                        // A line whole in this chunk is read where it lies; only one
                        // split across chunks is put together in `line`.
                        let whole: &[u8] = if line.is_empty() {
                            &rest[..nl]
                        } else {
                            line.extend_from_slice(&rest[..nl]);
                            line
                        };
                        match sse_line_usage(whole) {
                            Some(LineUsage::Whole(u)) => *usage = Some(u),
                            Some(LineUsage::Output(n)) => {
                                if let Some(u) = usage {
                                    u.completion_tokens = Some(n);
                                }
                            }
                            None => {}
                        }
                        if *wants_id && response_id.is_none() {
                            *response_id = sse_line_response_id(whole);
                        }
                        *ended |= sse_line_ends(whole);
                    }
                    line.clear();
                    *skipping = false;
                    rest = &rest[nl + 1..];
                }
                if !*skipping {
                    if line.len() + rest.len() > MAX_LINE_BYTES {
                        *skipping = true;
                        line.clear();
                    } else {
                        line.extend_from_slice(rest);
                    }
                }
            }
        }
    }

    /// Whether an SSE answer's last event has passed: a client that stops reading
    /// after it (Python's urllib closes right after `data: [DONE]`) got the whole answer.
    pub fn saw_end(&self) -> bool {
        matches!(self, UsageScanner::Sse { ended: true, .. })
    }

    /// The usage found, once the body has ended.
    pub fn finish(self) -> Option<Usage> {
        self.found().usage
    }

    /// Everything found, once the body has ended.
    pub fn found(self) -> Found {
        match self {
            UsageScanner::Json {
                first,
                buf,
                overflow,
                head,
                wants_id,
            } => {
                if overflow {
                    return Found {
                        usage: None,
                        response_id: wants_id.then(|| head_response_id(&head)).flatten(),
                    };
                }
                let body = first.as_deref().unwrap_or(&buf);
                let Some(env) = Envelope::read(body, wants_id) else {
                    return Found::default();
                };
                let response_id = env
                    .id
                    .as_deref()
                    .filter(|_| env.object.as_deref() == Some("response"))
                    .map(str::to_owned);
                Found {
                    usage: env.usage(),
                    response_id,
                }
            }
            UsageScanner::Sse {
                line,
                usage,
                response_id,
                wants_id,
                ..
            } => Found {
                usage: match (usage, sse_line_usage(&line)) {
                    (_, Some(LineUsage::Whole(u))) => Some(u),
                    (Some(u), Some(LineUsage::Output(n))) => Some(Usage {
                        completion_tokens: Some(n),
                        ..u
                    }),
                    (u, _) => u,
                },
                response_id: response_id
                    .or_else(|| wants_id.then(|| sse_line_response_id(&line)).flatten()),
            },
        }
    }
}

/// Bytes of a JSON answer kept past [`MAX_JSON_BYTES`], for its leading fields.
const HEAD_BYTES: usize = 64 * 1024;

/// The top-level `id` of a `/v1/responses` answer from the start of its JSON (the rest
/// cut off): read key by key until the bytes run out. Taken when the head also says
/// `"object": "response"`, or the id has the `resp` prefix engines give response ids.
fn head_response_id(head: &[u8]) -> Option<String> {
    use serde::de::{DeserializeSeed, IgnoredAny, MapAccess, Visitor};
    struct Head<'a> {
        id: &'a mut Option<String>,
        is_response: &'a mut bool,
    }
    impl<'de> DeserializeSeed<'de> for Head<'_> {
        type Value = ();
        fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_map(self)
        }
    }
    impl<'de> Visitor<'de> for Head<'_> {
        type Value = ();
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
            while let Some(key) = map.next_key::<String>()? {
                match key.as_str() {
                    "id" => *self.id = map.next_value::<Option<String>>()?,
                    "object" => {
                        *self.is_response =
                            map.next_value::<Option<String>>()?.as_deref() == Some("response")
                    }
                    _ => {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
            }
            Ok(())
        }
    }
    let (mut id, mut is_response) = (None, false);
    let mut de = serde_json::Deserializer::from_slice(head);
    // The head is cut mid-value: the error at its end is expected.
    let _ = Head {
        id: &mut id,
        is_response: &mut is_response,
    }
    .deserialize(&mut de);
    id.filter(|i| is_response || i.starts_with("resp"))
}

/// Whether an SSE line is a stream's last event: OpenAI's `data: [DONE]` (vLLM and
/// SGLang send it too), Anthropic's `event: message_stop`, or a `/v1/responses`
/// terminal event (`response.completed`, `response.failed`, `response.incomplete`).
fn sse_line_ends(line: &[u8]) -> bool {
    if let Some(v) = line.strip_prefix(b"data:") {
        return v.trim_ascii() == b"[DONE]";
    }
    line.strip_prefix(b"event:").is_some_and(|v| {
        matches!(
            v.trim_ascii(),
            b"message_stop" | b"response.completed" | b"response.failed" | b"response.incomplete"
        )
    })
}

/// The response id of an SSE `response.created` / `response.completed` data line.
fn sse_line_response_id(line: &[u8]) -> Option<String> {
    let data = line.strip_prefix(b"data:")?;
    // One search for both event types; most lines (every chat chunk) have neither.
    if RESPONSE_EVENT.find(data).is_none()
        || (!contains(data, b"\"response.created\"") && !contains(data, b"\"response.completed\""))
    {
        return None;
    }
    #[derive(Deserialize)]
    struct Event {
        response: Option<Inner>,
    }
    #[derive(Deserialize)]
    struct Inner {
        id: Option<String>,
    }
    serde_json::from_slice::<Event>(data).ok()?.response?.id
}

/// What one SSE line's `usage` says.
enum LineUsage {
    Whole(Usage),
    /// Anthropic's `message_delta`: only the generated tokens so far.
    Output(u64),
}

fn sse_line_usage(line: &[u8]) -> Option<LineUsage> {
    let data = line.strip_prefix(b"data:")?;
    // Parsed only when some `"usage"` key holds more than `null`: with
    // `stream_options.include_usage` every chunk says `"usage":null` and only the last
    // one counts.
    let mut at = 0;
    loop {
        let p = at + USAGE_KEY.find(&data[at..])?;
        at = p + b"\"usage\"".len();
        let value = data[at..]
            .iter()
            .position(|b| !matches!(b, b' ' | b'\t' | b':'))
            .map(|i| &data[at + i..]);
        if value.is_some_and(|v| !v.starts_with(b"null")) {
            break;
        }
    }
    let env = Envelope::read(data, false)?;
    let output = env.usage.as_ref().and_then(RawUsage::output_only);
    match output {
        Some(n) => Some(LineUsage::Output(n)),
        None => env.usage().map(LineUsage::Whole),
    }
}

/// Whether `needle` occurs in `hay` (SIMD substring search; the needles every line is
/// searched for have prebuilt finders below).
fn contains(hay: &[u8], needle: &[u8]) -> bool {
    memchr::memmem::find(hay, needle).is_some()
}

/// Prebuilt searchers for the needles every SSE line is searched for.
static USAGE_KEY: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\"usage\""));
static RESPONSE_EVENT: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\"response.c"));

/// The fields of an answer (or an SSE data line) the scanner reads; `id` and `object`
/// borrowed, so a line's parse allocates nothing for them.
#[derive(Deserialize, Default)]
struct Envelope<'a> {
    #[serde(default, borrow)]
    id: Option<crate::prompt::Text<'a>>,
    #[serde(default, borrow)]
    object: Option<crate::prompt::Text<'a>>,
    #[serde(default)]
    usage: Option<RawUsage>,
    /// Anthropic `message_start` carries usage inside `message`.
    #[serde(default)]
    message: Option<Message>,
}

#[derive(Deserialize)]
struct Message {
    #[serde(default)]
    usage: Option<RawUsage>,
}

#[derive(Deserialize)]
struct RawUsage {
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    output_tokens: Option<u64>,
    prompt_tokens_details: Option<Details>,
    input_tokens: Option<u64>,
    cache_read_input_tokens: Option<u64>,
    cache_creation_input_tokens: Option<u64>,
}

impl RawUsage {
    /// An Anthropic `message_delta`'s usage: the output count alone.
    fn output_only(&self) -> Option<u64> {
        match (self.prompt_tokens, self.input_tokens) {
            (None, None) => self.output_tokens,
            _ => None,
        }
    }
}

#[derive(Deserialize)]
struct Details {
    cached_tokens: Option<u64>,
}

impl<'a> Envelope<'a> {
    /// The fields of the JSON object `body`: its top-level members found without
    /// decoding the others ([`super::json_members`]; `choices` is most of an answer),
    /// then each wanted one parsed by serde (`id` and `object` only when `wants_id`).
    /// `None` when `body` is not a JSON object or a wanted member does not parse; a body
    /// the member scan refuses gets serde's full parse, which decides.
    fn read(body: &'a [u8], wants_id: bool) -> Option<Self> {
        let mut env = Envelope::default();
        let mut parsed = true;
        let scanned = super::json_members::for_each(body, |key, value| {
            fn set<'a, T: Deserialize<'a>>(slot: &mut Option<T>, value: &'a [u8], ok: &mut bool) {
                match serde_json::from_slice::<Option<T>>(value) {
                    Ok(v) => *slot = v,
                    Err(_) => *ok = false,
                }
            }
            match key {
                b"id" if wants_id => set(&mut env.id, value, &mut parsed),
                b"object" if wants_id => set(&mut env.object, value, &mut parsed),
                b"usage" => set(&mut env.usage, value, &mut parsed),
                b"message" => set(&mut env.message, value, &mut parsed),
                _ => {}
            }
        });
        match scanned {
            Some(()) => parsed.then_some(env),
            None => serde_json::from_slice(body).ok(),
        }
    }

    fn usage(self) -> Option<Usage> {
        let u = self.usage.or_else(|| self.message.and_then(|m| m.usage))?;
        if let Some(prompt) = u.prompt_tokens {
            return Some(Usage {
                prompt_tokens: prompt,
                cached_tokens: u.prompt_tokens_details.and_then(|d| d.cached_tokens),
                completion_tokens: u.completion_tokens,
            });
        }
        // Anthropic: input_tokens excludes the cached part.
        let input = u.input_tokens?;
        let read = u.cache_read_input_tokens;
        Some(Usage {
            prompt_tokens: input + read.unwrap_or(0) + u.cache_creation_input_tokens.unwrap_or(0),
            cached_tokens: read,
            completion_tokens: u.output_tokens,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn scanner(ct: &'static str) -> UsageScanner {
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static(ct));
        UsageScanner::for_response(&h, true).unwrap()
    }

    #[test]
    fn json_usage_across_chunks() {
        let body = br#"{"id":"x","choices":[],"usage":{"prompt_tokens":120,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":96}}}"#;
        let mut s = scanner("application/json");
        for c in body.chunks(7) {
            s.feed(c);
        }
        assert_eq!(
            s.finish(),
            Some(Usage {
                prompt_tokens: 120,
                cached_tokens: Some(96),
                completion_tokens: Some(5),
            })
        );
    }

    #[test]
    fn json_usage_from_a_kept_first_chunk_alone_or_with_more() {
        let body = Bytes::from_static(
            br#"{"id":"x","choices":[],"usage":{"prompt_tokens":120,"prompt_tokens_details":{"cached_tokens":96}}}"#,
        );
        let want = Some(Usage {
            prompt_tokens: 120,
            cached_tokens: Some(96),
            completion_tokens: None,
        });
        let mut s = scanner("application/json");
        s.feed_bytes(&body);
        assert_eq!(s.finish(), want, "one chunk");
        for split in 1..body.len() {
            let mut s = scanner("application/json");
            s.feed_bytes(&body.slice(..split));
            s.feed_bytes(&body.slice(split..));
            assert_eq!(s.finish(), want, "split at {split}");
        }
        // A kept first chunk still counts toward the copy limit.
        let mut s = scanner("application/json");
        s.feed_bytes(&Bytes::from(vec![b' '; MAX_JSON_BYTES]));
        s.feed_bytes(&Bytes::from_static(br#"{"usage":{"prompt_tokens":1}}"#));
        assert_eq!(s.finish(), None);
    }

    #[test]
    fn the_member_scan_reads_what_a_full_parse_reads() {
        let long = "word \\\"quoted\\\" {[".repeat(2000);
        let bodies = [
            r#"{"id":"chatcmpl-1","object":"chat.completion","choices":[{"message":{"role":"assistant","content":"hi"}}],"usage":{"prompt_tokens":120,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":96}}}"#.to_string(),
            format!(r#"{{"choices":[{{"message":{{"content":"{long}"}}}}],"usage":{{"prompt_tokens":7}}}}"#),
            r#"{"id":"resp_1","object":"response","output":[],"usage":{"input_tokens":5,"cache_read_input_tokens":3}}"#.to_string(),
            r#"{"type":"message_start","message":{"id":"m","content":[],"usage":{"input_tokens":4,"cache_read_input_tokens":60}}}"#.to_string(),
            r#"{"usage":null,"choices":[]}"#.to_string(),
            r#"{"usage":{"prompt_tokens":12,"prompt_tokens_details":null}}"#.to_string(),
            // Not parsed by either: a wanted member of the wrong shape, not an object.
            r#"{"object":"error","message":"no such model","usage":{"prompt_tokens":1}}"#.to_string(),
            r#"{"usage":{"prompt_tokens":"12"}}"#.to_string(),
            r#"[{"usage":{"prompt_tokens":1}}]"#.to_string(),
            // Refused by the scan (an escaped key), read by the full parse.
            r#"{"us\u0061ge":{"prompt_tokens":9}}"#.to_string(),
        ];
        for body in &bodies {
            let full = serde_json::from_slice::<Envelope>(body.as_bytes()).ok();
            let read = Envelope::read(body.as_bytes(), true);
            assert_eq!(
                read.as_ref().map(|e| (
                    e.id.as_ref().map(|t| t.to_string()),
                    e.object.as_ref().map(|t| t.to_string())
                )),
                full.as_ref().map(|e| (
                    e.id.as_ref().map(|t| t.to_string()),
                    e.object.as_ref().map(|t| t.to_string())
                )),
                "{body}"
            );
            assert_eq!(
                read.and_then(Envelope::usage),
                full.and_then(Envelope::usage),
                "{body}"
            );
        }
        let with_usage = |b: &str| Envelope::read(b.as_bytes(), false).and_then(Envelope::usage);
        assert_eq!(with_usage(&bodies[1]).map(|u| u.prompt_tokens), Some(7));
        assert_eq!(with_usage(&bodies[9]).map(|u| u.prompt_tokens), Some(9));
        // That body does go the fallback's way: the member scan alone refuses it.
        assert_eq!(
            super::super::json_members::for_each(bodies[9].as_bytes(), |_, _| {}),
            None
        );
    }

    #[test]
    fn sse_final_usage_chunk_split_anywhere() {
        let stream = b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":50,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\ndata: [DONE]\n\n";
        for split in 1..stream.len() {
            let mut s = scanner("text/event-stream");
            s.feed(&stream[..split]);
            s.feed(&stream[split..]);
            assert_eq!(
                s.finish(),
                Some(Usage {
                    prompt_tokens: 50,
                    cached_tokens: Some(32),
                    completion_tokens: None,
                }),
                "split at {split}"
            );
        }
    }

    #[test]
    fn null_usage_keys_are_skipped_and_spaced_ones_read() {
        let stream = b"data: {\"usage\": null, \"choices\":[{\"delta\":{\"content\":\"say \\\"usage\\\" twice\"}}]}\n\ndata: {\"usage\" : {\"prompt_tokens\":7}}\n\n";
        for split in 1..stream.len() {
            let mut s = scanner("text/event-stream");
            s.feed(&stream[..split]);
            s.feed(&stream[split..]);
            assert!(!s.saw_end(), "no [DONE] yet");
            s.feed(b"data: [DONE]\n\n");
            assert!(s.saw_end());
            assert_eq!(
                s.finish(),
                Some(Usage {
                    prompt_tokens: 7,
                    cached_tokens: None,
                    completion_tokens: None,
                }),
                "split at {split}"
            );
        }
    }

    #[test]
    fn anthropic_shapes() {
        let mut s = scanner("application/json");
        s.feed(br#"{"type":"message","usage":{"input_tokens":10,"cache_read_input_tokens":90,"output_tokens":3}}"#);
        assert_eq!(
            s.finish(),
            Some(Usage {
                prompt_tokens: 100,
                cached_tokens: Some(90),
                completion_tokens: Some(3),
            })
        );
        let mut s = scanner("text/event-stream");
        s.feed(b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":4,\"cache_read_input_tokens\":60}}}\n\n");
        s.feed(b"event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":9}}\n\n");
        assert_eq!(
            s.finish(),
            Some(Usage {
                prompt_tokens: 64,
                cached_tokens: Some(60),
                completion_tokens: Some(9),
            })
        );
    }

    #[test]
    fn response_ids_are_read_from_json_and_sse() {
        let mut s = scanner("application/json");
        s.feed(br#"{"id":"resp_123","object":"response","output":[],"usage":{"input_tokens":5}}"#);
        assert_eq!(s.found().response_id.as_deref(), Some("resp_123"));
        // Escaped strings are decoded (read in place only when they have no escapes).
        let mut s = scanner("application/json");
        s.feed(br#"{"id":"resp_1","object":"response","usage":{"input_tokens":5}}"#);
        let found = s.found();
        assert_eq!(found.response_id.as_deref(), Some("resp_1"));
        assert_eq!(found.usage.map(|u| u.prompt_tokens), Some(5));
        let mut s = scanner("application/json");
        s.feed(br#"{"id":"chatcmpl-1","object":"chat.completion"}"#);
        assert_eq!(s.found().response_id, None);
        // An answer past the copy limit: the id is still read from its head.
        let big = format!(
            r#"{{"id":"resp_big","created_at":1,"output":[{{"type":"message","content":"{}"}}]}}"#,
            "x".repeat(MAX_JSON_BYTES + 10)
        );
        let mut s = scanner("application/json");
        for c in big.as_bytes().chunks(64 * 1024) {
            s.feed(c);
        }
        assert_eq!(s.found().response_id.as_deref(), Some("resp_big"));
        let stream = b"event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_9\",\"status\":\"in_progress\"}}\n\nevent: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"hi\"}\n\n";
        for split in 1..stream.len() {
            let mut s = scanner("text/event-stream");
            s.feed(&stream[..split]);
            s.feed(&stream[split..]);
            assert_eq!(
                s.found().response_id.as_deref(),
                Some("resp_9"),
                "split at {split}"
            );
        }
        // A chat stream is not searched for one (its endpoint never answers with one).
        let mut h = HeaderMap::new();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        let mut s = UsageScanner::for_response(&h, false).unwrap();
        s.feed(stream);
        assert_eq!(s.found().response_id, None);
        // Nor a chat answer's JSON, whose usage is still read.
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        let mut s = UsageScanner::for_response(&h, false).unwrap();
        s.feed(br#"{"id":"resp_1","object":"response","usage":{"input_tokens":5}}"#);
        let found = s.found();
        assert_eq!(found.response_id, None);
        assert_eq!(found.usage.map(|u| u.prompt_tokens), Some(5));
    }

    #[test]
    fn an_absent_cached_count_is_not_read_as_zero() {
        // vLLM without `--enable-prompt-tokens-details` (or a miss with it): no details.
        let mut s = scanner("application/json");
        s.feed(br#"{"usage":{"prompt_tokens":120,"completion_tokens":5,"total_tokens":125}}"#);
        let u = s.finish().unwrap();
        assert_eq!((u.prompt_tokens, u.cached_tokens), (120, None));
        let mut s = scanner("application/json");
        s.feed(br#"{"usage":{"prompt_tokens":12,"prompt_tokens_details":null}}"#);
        assert_eq!(s.finish().unwrap().cached_tokens, None);
        let mut s = scanner("application/json");
        s.feed(br#"{"usage":{"input_tokens":12,"output_tokens":3}}"#);
        assert_eq!(s.finish().unwrap().cached_tokens, None);
        let mut s = scanner("application/json");
        s.feed(br#"{"usage":{"input_tokens":12,"cache_read_input_tokens":0}}"#);
        assert_eq!(s.finish().unwrap().cached_tokens, Some(0));
    }

    #[test]
    fn no_usage_compressed_or_oversized() {
        let mut s = scanner("text/event-stream");
        s.feed(b"data: {\"choices\":[]}\n\n");
        assert_eq!(s.finish(), None);
        let mut h = HeaderMap::new();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        h.insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        assert!(UsageScanner::for_response(&h, true).is_none());
        let mut s = scanner("application/json");
        s.feed(&vec![b' '; MAX_JSON_BYTES + 1]);
        s.feed(br#"{"usage":{"prompt_tokens":1}}"#);
        assert_eq!(s.finish(), None);
    }
}

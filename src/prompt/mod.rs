//! Prompt extraction: request body -> [`RouteContext`], the text the tree routes on.
//!
//! The routing text is the conversation in the order the model sees it (role, then
//! content, per message), never the raw JSON: every chat body starts with the same
//! envelope (`{"model":…,"messages":[{"role":…`), and routing on it would make unrelated
//! requests look like cache hits. Rules per API family live in [`openai`] and
//! [`anthropic`]. Media (images, audio, files) enter the text only as a short
//! placeholder carrying the media's hash, so two requests that differ only in an image
//! do not look like a full match, and no base64 ever enters the tree.
//!
//! Extraction never fails: a body that is not JSON or not of the endpoint's shape falls
//! back to its raw bytes. It only reads the body; the upstream always receives the
//! client's bytes unchanged.

pub mod anthropic;
pub mod chunks;
pub mod model;
pub mod openai;

use std::borrow::Cow;

use serde_json::value::RawValue;

use chunks::Chunker;

/// An API route whose body the router knows how to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/chat/completions` (OpenAI).
    ChatCompletions,
    /// `POST /v1/completions` (OpenAI legacy completions).
    Completions,
    /// `POST /v1/messages` (Anthropic).
    Messages,
    /// `POST /v1/responses` (OpenAI Responses).
    Responses,
}

impl Endpoint {
    /// The endpoint for a request path (exact match, no trailing slash), if routed by
    /// prompt.
    pub fn from_path(path: &str) -> Option<Endpoint> {
        match path {
            "/v1/chat/completions" => Some(Endpoint::ChatCompletions),
            "/v1/completions" => Some(Endpoint::Completions),
            "/v1/messages" => Some(Endpoint::Messages),
            "/v1/responses" => Some(Endpoint::Responses),
            _ => None,
        }
    }

    /// Short name for logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "chat_completions",
            Endpoint::Completions => "completions",
            Endpoint::Messages => "messages",
            Endpoint::Responses => "responses",
        }
    }
}

/// Where the routing text came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// Read from the endpoint's JSON shape.
    Extracted,
    /// The body was unreadable for this endpoint; its raw bytes are the key.
    RawBody,
}

/// What the policy needs to know about one request's prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteContext<'a> {
    /// Routing text, at most `max_prompt_bytes` bytes. UTF-8 when `source` is
    /// `Extracted` (cut on a character boundary); arbitrary bytes for `RawBody`.
    pub text: Cow<'a, [u8]>,
    /// Length in bytes of the whole prompt (text plus media), before the cut.
    pub total_len: usize,
    /// Digest of the whole prompt before the cut ([`chunks::Chunker::digest`] of the text
    /// with its media placeholders, which carry the media's xxh3-64; of the raw body
    /// for [`Source::RawBody`]).
    pub digest: u64,
    /// The chained hashes of `text`'s whole [`chunks::CHUNK_BYTES`] chunks
    /// ([`chunks::chain`]), computed in the digest's pass: router replicas sharing
    /// state match and publish prefixes by them. The proxy moves them into the
    /// request's `ChainMemo`.
    pub chain: Vec<u64>,
    pub source: Source,
    /// `/v1/responses` state the request continues, hashed (xxh3-64): its
    /// `previous_response_id`, else its `conversation` id. The worker that holds that
    /// state must answer it (see `policy::session`).
    pub continues: Option<u64>,
    /// Digest of the prompt up to the cut (the routing text, media placeholders
    /// included), when the prompt was longer than `max_prompt_bytes`; `None` when
    /// nothing was cut. Equal for prompts whose kept text is equal, at no extra hashing
    /// (the digest's chunker is read at the cut).
    pub cut_digest: Option<u64>,
    /// Where the body's `model` string is (read in the same parse), when it has one.
    pub model: Option<model::ModelField>,
    /// The request's `cache_salt` (vLLM: blocks computed under another salt are never
    /// reused), when it names one.
    pub cache_salt: Option<Box<str>>,
}

/// Bytes [`RouteContext::scope`] puts before the routing text: a NUL and 16 hex digits.
pub const SCOPE_BYTES: usize = 17;

impl RouteContext<'_> {
    /// Keys the routing text by what the engine keys its cache by besides the tokens:
    /// the LoRA `adapter` the request runs under and its `cache_salt`. Engines never
    /// reuse blocks across either (vLLM folds both into its block hashes, SGLang into
    /// its radix keys), so neither may a prediction. The text is prefixed with
    /// [`SCOPE_BYTES`] bytes naming the pair (shorter than any KV block, so two prompts
    /// of one scope share no whole block through it), and the digests are mixed with
    /// it; the chunk hashes are dropped (the shared-state lookup computes them again
    /// from the new text). Nothing changes for a request with neither.
    pub fn scope(&mut self, adapter: Option<&str>) {
        let salt = self.cache_salt.as_deref();
        if adapter.is_none() && salt.is_none() {
            return;
        }
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        for part in [adapter, salt] {
            // Length-prefixed: ("ab", None) and ("a", "b") differ.
            let bytes = part.map_or(&[][..], str::as_bytes);
            h.update(&(part.map_or(u64::MAX, |p| p.len() as u64)).to_le_bytes());
            h.update(bytes);
        }
        let key = h.digest();
        let mut text = Vec::with_capacity(SCOPE_BYTES + self.text.len());
        text.push(0);
        text.extend_from_slice(format!("{key:016x}").as_bytes());
        text.extend_from_slice(&self.text);
        self.text = Cow::Owned(text);
        self.digest = chunks::link(key, &self.digest.to_le_bytes());
        self.cut_digest = self.cut_digest.map(|d| chunks::link(key, &d.to_le_bytes()));
        self.chain.clear();
    }
}

/// Reads the routing context of `body` for `endpoint`. `max_prompt_bytes` bounds the
/// routing text (bytes). Never fails; see the module docs for the fallback.
pub fn extract(endpoint: Endpoint, body: &[u8], max_prompt_bytes: usize) -> RouteContext<'_> {
    let mut b = PromptBuilder::sized(max_prompt_bytes, body.len());
    let ok = match endpoint {
        Endpoint::ChatCompletions => openai::chat(body, &mut b),
        Endpoint::Completions => openai::completions(body, &mut b),
        Endpoint::Responses => openai::responses(body, &mut b),
        Endpoint::Messages => anthropic::messages(body, &mut b),
    };
    if ok {
        b.finish()
    } else {
        raw_body(body, max_prompt_bytes)
    }
}

/// The fallback context: the body's own bytes (cut to `max_prompt_bytes`).
pub fn raw_body(body: &[u8], max_prompt_bytes: usize) -> RouteContext<'_> {
    let text = &body[..body.len().min(max_prompt_bytes)];
    let mut h = Chunker::new(max_prompt_bytes, body.len());
    h.update(text);
    let cut_digest = (body.len() > text.len()).then(|| h.digest());
    h.update(&body[text.len()..]);
    RouteContext {
        text: Cow::Borrowed(text),
        total_len: body.len(),
        digest: h.digest(),
        chain: h.into_chain(text.len()),
        source: Source::RawBody,
        continues: None,
        cut_digest,
        model: model::of_any_object(body),
        cache_salt: None,
    }
}

/// Accumulates routing text up to a byte cap while hashing (in chunks, see [`chunks`])
/// and counting everything.
pub struct PromptBuilder {
    text: String,
    cap: usize,
    total_len: usize,
    hasher: Chunker,
    continues: Option<u64>,
    cut_digest: Option<u64>,
    model: Option<model::ModelField>,
    cache_salt: Option<Box<str>>,
}

impl PromptBuilder {
    /// A builder keeping at most `cap` bytes of text.
    pub fn new(cap: usize) -> Self {
        Self::sized(cap, 4096)
    }

    /// As [`PromptBuilder::new`], sized for a prompt of about `expect` bytes (the
    /// body's length).
    pub fn sized(cap: usize, expect: usize) -> Self {
        PromptBuilder {
            // Sized once from the body (the text is rarely longer than its JSON), not
            // doubled from 4 KiB with a copy at each step.
            text: String::with_capacity(cap.min(expect)),
            cap,
            total_len: 0,
            hasher: Chunker::new(cap, expect),
            continues: None,
            cut_digest: None,
            model: None,
            cache_salt: None,
        }
    }

    /// Notes the body's `model` (`raw`, borrowed from `body` by the endpoint's parse).
    pub fn model(&mut self, raw: Option<&RawValue>, body: &[u8]) {
        self.model = model::ModelField::of(raw, body);
    }

    /// Notes the body's `cache_salt` (a value borrowed by the endpoint's parse), when it
    /// is a non-empty string.
    pub fn cache_salt(&mut self, raw: Option<&RawValue>) {
        self.cache_salt = raw
            .and_then(json_str)
            .filter(|s| !s.is_empty())
            .map(|s| s.into_owned().into_boxed_str());
    }

    /// Reads the digest at the cut, once: called when the text is full and more comes.
    fn note_cut(&mut self) {
        if self.cut_digest.is_none() {
            self.cut_digest = Some(self.hasher.digest());
        }
    }

    /// Marks the request as continuing `/v1/responses` state `id` (a previous response
    /// or a conversation).
    pub fn continues(&mut self, id: &str) {
        self.continues = Some(xxhash_rust::xxh3::xxh3_64(id.as_bytes()));
    }

    /// Appends text: to the routing text (while under the cap and not yet cut), the
    /// length and the digest.
    pub fn text(&mut self, s: &str) {
        if s.is_empty() {
            return;
        }
        self.total_len += s.len();
        // Once cut (on a character boundary, maybe short of the cap), the text is
        // sealed: it stays a prefix of the prompt, and so do its chunk hashes.
        let room = if self.cut_digest.is_some() {
            0
        } else {
            self.cap - self.text.len()
        };
        if room == 0 {
            self.note_cut();
            self.hasher.update(s.as_bytes());
            return;
        }
        if s.len() <= room {
            self.text.push_str(s);
            self.hasher.update(s.as_bytes());
        } else {
            let mut end = room;
            while !s.is_char_boundary(end) {
                end -= 1;
            }
            self.text.push_str(&s[..end]);
            self.hasher.update(&s.as_bytes()[..end]);
            self.note_cut();
            self.hasher.update(&s.as_bytes()[end..]);
        }
    }

    /// Appends a role header and separates it from the content that follows.
    pub fn role(&mut self, role: &str) {
        self.text(role);
        self.text(": ");
    }

    /// Ends one message (or part) of the conversation.
    pub fn end_message(&mut self) {
        self.text("\n");
    }

    /// Counts media bytes (an image's data URL or JSON) towards the length, and puts a
    /// placeholder with their xxh3-64 in the text, `<image:0123456789abcdef>`, which
    /// carries them into the digest.
    pub fn media(&mut self, kind: &str, raw: &[u8]) {
        self.total_len += raw.len();
        let h = xxhash_rust::xxh3::xxh3_64(raw);
        let mut tag = String::with_capacity(kind.len() + 20);
        tag.push('<');
        tag.push_str(kind);
        tag.push(':');
        for shift in (0..16).rev() {
            let nibble = ((h >> (shift * 4)) & 0xf) as u32;
            tag.push(char::from_digit(nibble, 16).unwrap_or('0'));
        }
        tag.push('>');
        self.text(&tag);
    }

    /// The finished context.
    pub fn finish(self) -> RouteContext<'static> {
        RouteContext {
            digest: self.hasher.digest(),
            chain: self.hasher.into_chain(self.text.len()),
            text: Cow::Owned(self.text.into_bytes()),
            total_len: self.total_len,
            source: Source::Extracted,
            continues: self.continues,
            cut_digest: self.cut_digest,
            model: self.model,
            cache_salt: self.cache_salt,
        }
    }
}

/// One content part or block, of any family: OpenAI chat parts (`text`, `image_url`,
/// `input_audio`, `file`, `refusal`), Responses parts (`input_text`, `output_text`,
/// `input_image`, `input_file`), Anthropic blocks (`text`, `image`, `document`,
/// `tool_use`, `tool_result`, `thinking`). Heavy fields stay unparsed (`RawValue`).
#[derive(serde::Deserialize)]
struct Part<'a> {
    #[serde(rename = "type", borrow, default)]
    kind: Option<Text<'a>>,
    #[serde(borrow, default)]
    text: Option<Text<'a>>,
    #[serde(borrow, default)]
    refusal: Option<Text<'a>>,
    #[serde(borrow, default)]
    thinking: Option<Text<'a>>,
    #[serde(borrow, default)]
    name: Option<Text<'a>>,
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
}

/// A message's `content` (also an Anthropic `system` and a Responses `input`): a
/// string, or an array of parts/blocks (each kept unparsed, [`part`] reads it).
///
/// A string is read as bytes between its quotes (serde_json's `deserialize_bytes`: one
/// `memchr2` pass for `"` and `\`, escapes decoded) and then checked as UTF-8. serde_json's
/// `str` path scans a word at a time for control characters as well, and on a 32 KiB
/// message that cost 4x as much (10.8 vs 2.4 µs, 2026-12-02). The one difference: a raw
/// control character inside a string (which JSON forbids) is kept as text instead of
/// failing the parse. Only the routing text is read; the engine still gets the client's
/// bytes unchanged and answers such a body with its own 400.
pub(crate) enum Content<'a> {
    Text(Cow<'a, str>),
    Parts(Vec<&'a RawValue>),
}

/// A JSON string read as [`Content`] reads one (bytes, then UTF-8); anything else is a
/// type error. Borrowed from the body when it has no escapes: serde's own `Cow<str>`
/// inside an `Option` always allocates, a `String` per field per request.
pub(crate) struct Text<'a>(pub Cow<'a, str>);

impl std::ops::Deref for Text<'_> {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

/// `v` as UTF-8: simdutf8's check (the common, valid case), std's error (which says
/// where the invalid byte is) otherwise.
fn utf8<E: serde::de::Error>(v: &[u8]) -> Result<&str, E> {
    simdutf8::basic::from_utf8(v).or_else(|_| std::str::from_utf8(v).map_err(E::custom))
}

struct ContentVisitor<'a>(std::marker::PhantomData<&'a ()>);

impl<'de: 'a, 'a> serde::de::Visitor<'de> for ContentVisitor<'a> {
    type Value = Content<'a>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a string or an array of content parts")
    }

    fn visit_borrowed_bytes<E: serde::de::Error>(self, v: &'de [u8]) -> Result<Self::Value, E> {
        utf8(v).map(|s| Content::Text(Cow::Borrowed(s)))
    }

    fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Self::Value, E> {
        utf8(v).map(|s| Content::Text(Cow::Owned(s.to_owned())))
    }

    fn visit_borrowed_str<E: serde::de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Content::Text(Cow::Borrowed(v)))
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Content::Text(Cow::Owned(v.to_owned())))
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut parts = Vec::with_capacity(seq.size_hint().unwrap_or(4));
        while let Some(p) = seq.next_element::<&'de RawValue>()? {
            parts.push(p);
        }
        Ok(Content::Parts(parts))
    }
}

impl<'de: 'a, 'a> serde::Deserialize<'de> for Content<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_bytes(ContentVisitor(std::marker::PhantomData))
    }
}

impl<'de: 'a, 'a> serde::Deserialize<'de> for Text<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Content::deserialize(d)? {
            Content::Text(t) => Ok(Text(t)),
            Content::Parts(_) => Err(serde::de::Error::invalid_type(
                serde::de::Unexpected::Seq,
                &"a string",
            )),
        }
    }
}

/// The text of a JSON string value; `None` when `raw` is not a string.
pub(crate) fn json_str(raw: &RawValue) -> Option<Cow<'_, str>> {
    serde_json::from_str::<Text<'_>>(raw.get())
        .ok()
        .map(|t| t.0)
}

/// Appends a read `content`: the string, or each part (newline-separated). Returns false
/// when a part is unreadable (the caller falls back to the raw body).
pub(crate) fn append_content(c: &Content<'_>, b: &mut PromptBuilder) -> bool {
    match c {
        Content::Text(t) => {
            b.text(t);
            true
        }
        Content::Parts(parts) => {
            for (i, p) in parts.iter().enumerate() {
                if i > 0 {
                    b.text("\n");
                }
                if !part(p, b) {
                    return false;
                }
            }
            true
        }
    }
}

/// Appends a request's tool definitions (`tools`, as sent) ahead of the conversation,
/// where chat templates render them: `tools: <the JSON as written>` and a newline. The
/// raw bytes of the value are the text (no parse, no re-serialisation); `null` and `[]`
/// are no tools, so they route as a request without the field.
///
/// Tools are often most of an agent's prompt (5–20 KB of schemas): two requests with the
/// same messages and different tools share next to nothing in the engine's cache, and
/// must not look like a full match here. Like any text they count towards the length and
/// the digest past the cut.
pub(crate) fn tools(raw: Option<&RawValue>, b: &mut PromptBuilder) {
    // `null` reads as `None`; RawValue holds the value without the whitespace around it.
    let Some(raw) = raw.map(RawValue::get) else {
        return;
    };
    let empty = raw
        .strip_prefix('[')
        .and_then(|r| r.strip_suffix(']'))
        .is_some_and(|r| r.trim().is_empty());
    if empty {
        return;
    }
    b.role("tools");
    b.text(raw);
    b.end_message();
}

/// Appends an unparsed `content`: a string, an array of parts/blocks, or null (empty).
/// Returns false when it is none of these (the caller falls back to the raw body).
pub(crate) fn content(raw: &RawValue, b: &mut PromptBuilder) -> bool {
    match serde_json::from_str::<Option<Content<'_>>>(raw.get()) {
        Ok(Some(c)) => append_content(&c, b),
        Ok(None) => true,
        Err(_) => false,
    }
}

fn part(raw: &RawValue, b: &mut PromptBuilder) -> bool {
    let Ok(p) = serde_json::from_str::<Part<'_>>(raw.get()) else {
        // A bare string inside an array (seen in some clients) is text.
        return match json_str(raw) {
            Some(t) => {
                b.text(&t);
                true
            }
            None => false,
        };
    };
    let kind = p.kind.as_deref().unwrap_or("text");
    match kind {
        "text" | "input_text" | "output_text" => match &p.text {
            Some(t) => b.text(&t.0),
            None => b.media("part", raw.get().as_bytes()),
        },
        "refusal" => b.text(p.refusal.as_deref().unwrap_or_default()),
        "thinking" => b.text(p.thinking.as_ref().map_or("", |t| &t.0)),
        "tool_use" | "server_tool_use" => {
            b.text(p.name.as_deref().unwrap_or_default());
            b.text(" ");
            b.text(p.input.map(RawValue::get).unwrap_or_default());
        }
        "tool_result" | "web_search_tool_result" => {
            if let Some(c) = p.content
                && !content(c, b)
            {
                b.media("part", c.get().as_bytes());
            }
        }
        "image_url" | "input_image" | "image" | "document" | "video_url" => {
            let label = if kind == "document" {
                "document"
            } else {
                "image"
            };
            b.media(label, raw.get().as_bytes());
        }
        "input_audio" => b.media("audio", raw.get().as_bytes()),
        "file" | "input_file" => b.media("file", raw.get().as_bytes()),
        _ => b.media("part", raw.get().as_bytes()),
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// JSON strings that the routing text must read exactly as serde_json does.
    const STRINGS: [&str; 4] = [
        r#""plain text, ünïcødé, 🦀""#,
        r#""with \"escapes\", a \n newline, \u00e9 and a pair \ud83e\udd80""#,
        r#""""#,
        r#""a\\b""#,
    ];

    #[test]
    fn json_str_reads_a_string_as_serde_json_does_and_nothing_else() {
        for v in STRINGS {
            let raw: &RawValue = serde_json::from_str(v).unwrap();
            let want: String = serde_json::from_str(v).unwrap();
            assert_eq!(json_str(raw).as_deref(), Some(want.as_str()), "{v}");
        }
        for v in ["1", "null", "[\"a\"]", r#"{"a":"b"}"#] {
            let raw: &RawValue = serde_json::from_str(v).unwrap();
            assert_eq!(json_str(raw), None, "{v}");
        }
    }

    #[test]
    fn content_reads_a_string_as_serde_json_does_and_refuses_what_is_not_text() {
        for v in STRINGS {
            let want: String = serde_json::from_str(v).unwrap();
            match serde_json::from_str::<Content<'_>>(v) {
                Ok(Content::Text(t)) => assert_eq!(t, want, "{v}"),
                _ => panic!("{v} is not read as text"),
            }
        }
        for v in ["1", "true", r#"{"a":"b"}"#, r#""\ud800""#, r#""\udc00 x""#] {
            assert!(serde_json::from_str::<Content<'_>>(v).is_err(), "{v}");
        }
        assert!(serde_json::from_slice::<Content<'_>>(b"\"\xff\xfe\"").is_err());
        let parts = serde_json::from_str::<Content<'_>>(r#"[{"type":"text","text":"a"}, "b"]"#);
        assert!(matches!(parts, Ok(Content::Parts(p)) if p.len() == 2));
        assert!(serde_json::from_str::<Text<'_>>(r#"["a"]"#).is_err());
    }

    #[test]
    fn a_message_with_a_raw_control_character_or_bad_utf8_inside() {
        // A raw tab inside a string is invalid JSON but still the message's text.
        let tab = b"{\"messages\":[{\"role\":\"user\",\"content\":\"a\tb\"}]}";
        let ctx = extract(Endpoint::ChatCompletions, tab, 1000);
        assert_eq!(ctx.source, Source::Extracted);
        assert_eq!(ctx.text.as_ref(), b"user: a\tb\n");
        // Bytes that are not UTF-8 are not text: the raw body routes.
        let bad = b"{\"messages\":[{\"role\":\"user\",\"content\":\"a\xffb\"}]}";
        let ctx = extract(Endpoint::ChatCompletions, bad, 1000);
        assert_eq!(ctx.source, Source::RawBody);
        for body in [
            &br#"{"system":"s\ud800","messages":[]}"#[..],
            br#"{"system":"s","messages":[{"role":"user","content":[{"type":"text","text":"\udc00"}]}]}"#,
        ] {
            let ctx = extract(Endpoint::Messages, body, 1000);
            assert_eq!(ctx.source, Source::RawBody, "{}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn cut_lands_on_a_char_boundary() {
        let mut b = PromptBuilder::new(5);
        b.text("ab");
        b.text("ééé"); // 2 bytes each: only one fits in the 3 remaining bytes
        let ctx = b.finish();
        assert_eq!(ctx.text.as_ref(), "abé".as_bytes());
        assert_eq!(ctx.total_len, 8);
        assert!(std::str::from_utf8(&ctx.text).is_ok());
    }

    #[test]
    fn digest_covers_the_whole_prompt_past_the_cut() {
        let long_a = format!("{}A", "x".repeat(100));
        let long_b = format!("{}B", "x".repeat(100));
        let a = extract(
            Endpoint::Completions,
            format!(r#"{{"prompt":"{long_a}"}}"#).as_bytes(),
            10,
        )
        .into_owned_for_test();
        let b = extract(
            Endpoint::Completions,
            format!(r#"{{"prompt":"{long_b}"}}"#).as_bytes(),
            10,
        )
        .into_owned_for_test();
        assert_eq!(a.text, b.text);
        assert_eq!(a.total_len, 101);
        assert_ne!(a.digest, b.digest);
    }

    #[test]
    fn unreadable_bodies_fall_back_to_raw_bytes() {
        for body in [
            &b"not json"[..],
            b"\xff\xfe\x00garbage",
            b"[1,2,3]",
            b"{\"messages\": 5}",
            b"",
        ] {
            let ctx = extract(Endpoint::ChatCompletions, body, 4);
            assert_eq!(ctx.source, Source::RawBody, "{body:?}");
            assert_eq!(ctx.text.as_ref(), &body[..body.len().min(4)]);
            assert_eq!(ctx.total_len, body.len());
        }
    }

    impl RouteContext<'_> {
        fn into_owned_for_test(self) -> RouteContext<'static> {
            RouteContext {
                text: Cow::Owned(self.text.into_owned()),
                total_len: self.total_len,
                digest: self.digest,
                chain: self.chain,
                source: self.source,
                continues: self.continues,
                cut_digest: self.cut_digest,
                model: self.model,
                cache_salt: self.cache_salt,
            }
        }
    }

    #[test]
    fn the_adapter_and_the_cache_salt_scope_the_routing_text() {
        let body = |extra: &str| {
            format!(
                r#"{{"model":"m",{extra}"messages":[{{"role":"user","content":"the same question"}}]}}"#
            )
        };
        let plain_body = body("");
        let plain = extract(Endpoint::ChatCompletions, plain_body.as_bytes(), 1 << 20);
        let scoped = |adapter: Option<&str>, extra: &str| {
            let b = body(extra);
            let mut c =
                extract(Endpoint::ChatCompletions, b.as_bytes(), 1 << 20).into_owned_for_test();
            c.scope(adapter);
            c
        };
        let same = scoped(None, "");
        assert_eq!(same, plain, "neither adapter nor salt: unchanged");
        let a = scoped(Some("sql"), "");
        let b = scoped(Some("chat"), "");
        let salted = scoped(None, r#""cache_salt":"tenant-1","#);
        let both = scoped(Some("sql"), r#""cache_salt":"tenant-1","#);
        for c in [&a, &b, &salted, &both] {
            assert_eq!(c.text.len(), plain.text.len() + SCOPE_BYTES);
            assert!(
                c.text.ends_with(&plain.text),
                "the prompt follows the scope"
            );
            assert!(std::str::from_utf8(&c.text).is_ok(), "still text");
            assert!(c.chain.is_empty());
        }
        let texts = [&a.text, &b.text, &salted.text, &both.text];
        for (i, x) in texts.iter().enumerate() {
            for y in &texts[i + 1..] {
                // Past the NUL they differ within the first hex digits.
                let common = x.iter().zip(y.iter()).take_while(|(p, q)| p == q).count();
                assert!(common < SCOPE_BYTES, "two scopes share the prompt's text");
            }
        }
        assert_ne!(a.digest, b.digest);
        assert_eq!(scoped(Some("sql"), "").text, a.text, "one scope, one key");
        assert_eq!(salted.cache_salt.as_deref(), Some("tenant-1"));
        let empty = scoped(None, r#""cache_salt":"","#);
        assert_eq!(empty.text, plain.text, "an empty salt is none");
    }

    #[test]
    fn the_cut_digest_names_the_kept_text_and_the_digest_the_whole() {
        let mut a = PromptBuilder::new(8);
        a.text("hello ");
        a.text("world, and more");
        let a = a.finish();
        let mut b = PromptBuilder::new(8);
        b.text("hello wo");
        b.text("rld! other tail");
        let b = b.finish();
        assert_eq!(a.text, b.text);
        assert_eq!(a.cut_digest, b.cut_digest);
        assert_eq!(a.cut_digest, Some(chunks::digest(b"hello wo")));
        assert_ne!(a.digest, b.digest);
        // The whole-prompt digest is of everything, however it was fed.
        assert_eq!(a.digest, chunks::digest(b"hello world, and more"));
        let mut c = PromptBuilder::new(64);
        c.text("short");
        assert_eq!(c.finish().cut_digest, None);
        assert_eq!(
            raw_body(b"0123456789", 4).cut_digest,
            Some(chunks::digest(b"0123"))
        );
        assert_eq!(raw_body(b"0123", 4).cut_digest, None);
    }

    // C48
    #[test]
    fn tool_definitions_lead_the_routing_text_on_every_chat_endpoint() {
        let tools = |f: &str| {
            format!(
                r#"[{{"type":"function","function":{{"name":"{f}","parameters":{{"type":"object"}}}}}}]"#
            )
        };
        let (t1, t2) = (tools("get_weather"), tools("book_flight"));
        let bodies = |t: Option<&str>| {
            let field = t.map(|t| format!(r#""tools":{t},"#)).unwrap_or_default();
            [
                (
                    Endpoint::ChatCompletions,
                    format!(
                        r#"{{"model":"m",{field}"messages":[{{"role":"system","content":"S"}},{{"role":"user","content":"U"}}]}}"#
                    ),
                ),
                (
                    Endpoint::Messages,
                    format!(
                        r#"{{"system":"S",{field}"messages":[{{"role":"user","content":"U"}}]}}"#
                    ),
                ),
                (
                    Endpoint::Responses,
                    format!(r#"{{"instructions":"S",{field}"input":"U"}}"#),
                ),
            ]
        };
        for ((e, none), ((_, one), (_, two))) in bodies(None)
            .into_iter()
            .zip(bodies(Some(&t1)).into_iter().zip(bodies(Some(&t2))))
        {
            let none = extract(e, none.as_bytes(), 1 << 20).into_owned_for_test();
            let one = extract(e, one.as_bytes(), 1 << 20).into_owned_for_test();
            let two = extract(e, two.as_bytes(), 1 << 20).into_owned_for_test();
            assert_eq!(none.text.as_ref(), b"system: S\nuser: U\n", "{e:?}");
            // The tools as sent, then the conversation unchanged.
            assert_eq!(
                one.text.as_ref(),
                format!("tools: {t1}\nsystem: S\nuser: U\n").as_bytes(),
                "{e:?}"
            );
            assert_ne!(one.digest, two.digest, "{e:?}");
            assert_eq!(one.total_len, none.total_len + "tools: \n".len() + t1.len());
            // Other tools part where their definitions part, not at the end.
            let common = one
                .text
                .iter()
                .zip(two.text.iter())
                .take_while(|(a, b)| a == b);
            assert!(common.count() < "tools: ".len() + t1.len(), "{e:?}");
        }
        // No tools, `null` and `[]` route alike.
        let chat = |field: &str| {
            let body = format!(r#"{{{field}"messages":[{{"role":"user","content":"U"}}]}}"#);
            extract(Endpoint::ChatCompletions, body.as_bytes(), 1 << 20).into_owned_for_test()
        };
        assert_eq!(chat(""), chat(r#""tools":null,"#));
        assert_eq!(chat(""), chat(r#""tools":[ ],"#));
    }

    // C48: tools count towards length and digest even when the cut falls inside them.
    #[test]
    fn tools_past_the_cut_still_count_in_length_and_digest() {
        let body = |f: &str, q: &str| {
            format!(
                r#"{{"tools":[{{"type":"function","function":{{"name":"{f}","description":"{}"}}}}],"messages":[{{"role":"user","content":"{q}"}}]}}"#,
                "x".repeat(200)
            )
        };
        let a = extract(Endpoint::ChatCompletions, body("a", "hi").as_bytes(), 64)
            .into_owned_for_test();
        let b = extract(Endpoint::ChatCompletions, body("a", "ho").as_bytes(), 64)
            .into_owned_for_test();
        let c = extract(Endpoint::ChatCompletions, body("b", "hi").as_bytes(), 64)
            .into_owned_for_test();
        assert_eq!(a.text.len(), 64);
        assert!(a.text.starts_with(b"tools: [{"));
        assert_eq!(a.text, b.text);
        assert_ne!(a.text, c.text, "the tools differ before the cut");
        assert_ne!(a.digest, b.digest, "the messages past the cut count");
        assert!(a.total_len > 200 + "user: hi".len());
        assert_eq!(a.cut_digest, b.cut_digest);
    }

    #[test]
    fn the_chain_is_the_routing_texts_whole_chunks_and_text_stops_at_the_cut() {
        let cap = chunks::CHUNK_BYTES * 3;
        // "é" is two bytes: the cut falls one byte short of the cap, and what comes
        // after it (a message end, more text) never enters the text.
        let long = format!("{}é{}", "a".repeat(cap - 7), "b".repeat(500));
        let body = serde_json::json!({"messages": [
            {"role": "user", "content": long},
            {"role": "user", "content": "more"},
        ]})
        .to_string();
        let ctx = extract(Endpoint::ChatCompletions, body.as_bytes(), cap);
        assert_eq!(ctx.source, Source::Extracted);
        let expected = format!("user: {long}");
        let kept = &expected.as_bytes()[..ctx.text.len()];
        assert_eq!(ctx.text.len(), cap - 1);
        assert_eq!(ctx.text.as_ref(), kept);
        assert_eq!(ctx.chain, chunks::chain(&ctx.text).collect::<Vec<_>>());
        assert_eq!(ctx.chain.len(), ctx.text.len() / chunks::CHUNK_BYTES);
        assert_eq!(ctx.cut_digest, Some(chunks::digest(&ctx.text)));
        // A raw body too.
        let raw = vec![b'x'; cap + 7];
        let r = raw_body(&raw, cap);
        assert_eq!(r.chain, chunks::chain(&raw[..cap]).collect::<Vec<_>>());
        assert_eq!(r.digest, chunks::digest(&raw));
    }
}

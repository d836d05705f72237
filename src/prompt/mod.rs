//! Prompt extraction: request body -> [`RouteContext`], the text the tree routes on.
//!
//! The routing text is the conversation in the order the model sees it (role, then
//! content, per message), never the raw JSON: every chat body starts with the same
//! envelope (`{"model":…,"messages":[{"role":…`), and routing on it would make unrelated
//! requests look like cache hits. Rules per API family live in [`openai`] and
//! [`anthropic`]. Media (images, audio, files) count towards the digest only; the text
//! gets a short placeholder carrying the media's hash, so two requests that differ only
//! in an image do not look like a full match, and no base64 ever enters the tree.
//!
//! Extraction never fails: a body that is not JSON or not of the endpoint's shape falls
//! back to its raw bytes. It only reads the body; the upstream always receives the
//! client's bytes unchanged.

pub mod anthropic;
pub mod openai;

use std::borrow::Cow;

use serde_json::value::RawValue;
use xxhash_rust::xxh3::Xxh3;

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
    /// xxh3-64 of the whole prompt (text plus media bytes), before the cut.
    pub digest: u64,
    pub source: Source,
    /// Whether the prompt references media by a remote `http(s)://` URL.
    pub has_remote_media: bool,
    /// `/v1/responses` state the request continues, hashed (xxh3-64): its
    /// `previous_response_id`, else its `conversation` id. The worker that holds that
    /// state must answer it (see `policy::session`).
    pub continues: Option<u64>,
    /// xxh3-64 of the prompt up to the cut (the routing text and any media before it),
    /// when the prompt was longer than `max_prompt_bytes`; `None` when nothing was cut.
    /// Equal for prompts whose kept text is equal, at no extra hashing (the digest's
    /// hasher is read at the cut).
    pub cut_digest: Option<u64>,
}

/// Reads the routing context of `body` for `endpoint`. `max_prompt_bytes` bounds the
/// routing text (bytes). Never fails; see the module docs for the fallback.
pub fn extract(endpoint: Endpoint, body: &[u8], max_prompt_bytes: usize) -> RouteContext<'_> {
    let mut b = PromptBuilder::new(max_prompt_bytes);
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
    RouteContext {
        text: Cow::Borrowed(&body[..body.len().min(max_prompt_bytes)]),
        total_len: body.len(),
        digest: xxhash_rust::xxh3::xxh3_64(body),
        source: Source::RawBody,
        has_remote_media: false,
        continues: None,
        cut_digest: (body.len() > max_prompt_bytes)
            .then(|| xxhash_rust::xxh3::xxh3_64(&body[..max_prompt_bytes])),
    }
}

/// Accumulates routing text up to a byte cap while hashing and counting everything.
pub struct PromptBuilder {
    text: String,
    cap: usize,
    total_len: usize,
    hasher: Xxh3,
    has_remote_media: bool,
    continues: Option<u64>,
    cut_digest: Option<u64>,
}

impl PromptBuilder {
    /// A builder keeping at most `cap` bytes of text.
    pub fn new(cap: usize) -> Self {
        PromptBuilder {
            text: String::with_capacity(cap.min(4096)),
            cap,
            total_len: 0,
            hasher: Xxh3::new(),
            has_remote_media: false,
            continues: None,
            cut_digest: None,
        }
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

    /// Appends text: to the routing text (while under the cap), the length and the digest.
    pub fn text(&mut self, s: &str) {
        if s.is_empty() {
            return;
        }
        self.total_len += s.len();
        let room = self.cap - self.text.len();
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

    /// Counts media bytes (an image's data URL or JSON) towards length and digest, and
    /// puts a placeholder with their hash in the text: `<image:0123456789abcdef>`.
    pub fn media(&mut self, kind: &str, raw: &[u8]) {
        if self.text.len() == self.cap {
            self.note_cut();
        }
        self.total_len += raw.len();
        self.hasher.update(raw);
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

    /// Notes that the prompt fetches media from a remote URL.
    pub fn remote_media(&mut self) {
        self.has_remote_media = true;
    }

    /// The finished context.
    pub fn finish(self) -> RouteContext<'static> {
        RouteContext {
            text: Cow::Owned(self.text.into_bytes()),
            total_len: self.total_len,
            digest: self.hasher.digest(),
            source: Source::Extracted,
            has_remote_media: self.has_remote_media,
            continues: self.continues,
            cut_digest: self.cut_digest,
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
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    refusal: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    thinking: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
    #[serde(borrow, default)]
    image_url: Option<&'a RawValue>,
    #[serde(borrow, default)]
    source: Option<&'a RawValue>,
}

/// A URL given either as a string or as `{"url": "..."}`.
#[derive(serde::Deserialize)]
#[serde(untagged)]
enum UrlRef<'a> {
    Plain(#[serde(borrow)] Cow<'a, str>),
    Object {
        #[serde(borrow)]
        url: Cow<'a, str>,
    },
}

/// An Anthropic media `source` (`{"type":"url","url":...}` or base64 data).
#[derive(serde::Deserialize)]
struct MediaSource<'a> {
    #[serde(borrow, default)]
    url: Option<Cow<'a, str>>,
}

/// Appends a message's `content`: a string, an array of parts/blocks, or null.
/// Returns false when it is neither (the caller falls back to the raw body).
/// The text of a JSON string value (`raw` already validated by serde_json as one JSON
/// value); `None` when `raw` is not a string. Without a backslash the text is the bytes
/// between the quotes (a valid JSON string holds no raw control character or quote),
/// so a long message is not scanned a second time; escapes are decoded by serde_json.
pub(crate) fn json_str(raw: &RawValue) -> Option<Cow<'_, str>> {
    let s = raw.get();
    if s.len() >= 2 && s.starts_with('"') && memchr::memchr(b'\\', s.as_bytes()).is_none() {
        return Some(Cow::Borrowed(&s[1..s.len() - 1]));
    }
    serde_json::from_str::<Cow<'_, str>>(s).ok()
}

pub(crate) fn content(raw: &RawValue, b: &mut PromptBuilder) -> bool {
    let s = raw.get().as_bytes();
    match s.first() {
        Some(b'"') => match json_str(raw) {
            Some(t) => {
                b.text(&t);
                true
            }
            None => false,
        },
        Some(b'[') => match serde_json::from_str::<Vec<&RawValue>>(raw.get()) {
            Ok(parts) => {
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
            Err(_) => false,
        },
        Some(b'n') => true, // null: empty content
        _ => false,
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
            Some(t) => b.text(t),
            None => b.media("part", raw.get().as_bytes()),
        },
        "refusal" => b.text(p.refusal.as_deref().unwrap_or_default()),
        "thinking" => b.text(p.thinking.as_deref().unwrap_or_default()),
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
            let url = p
                .image_url
                .and_then(|u| serde_json::from_str::<UrlRef<'_>>(u.get()).ok())
                .map(|u| match u {
                    UrlRef::Plain(s) | UrlRef::Object { url: s } => s,
                })
                .or_else(|| {
                    p.source
                        .and_then(|s| serde_json::from_str::<MediaSource<'_>>(s.get()).ok())
                        .and_then(|s| s.url)
                });
            if url.as_deref().is_some_and(is_remote_url) {
                b.remote_media();
            }
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

/// Whether a media reference is a remote URL rather than inline data.
pub(crate) fn is_remote_url(url: &str) -> bool {
    let l = url.get(..8).unwrap_or(url).to_ascii_lowercase();
    l.starts_with("http://") || l.starts_with("https://")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_json_string_reads_the_same_with_or_without_the_fast_path() {
        for v in [
            r#""plain text, ünïcødé, 🦀""#,
            r#""with \"escapes\" and \n a newline \u00e9""#,
            r#""""#,
            r#""a\\b""#,
        ] {
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
                source: self.source,
                has_remote_media: self.has_remote_media,
                continues: self.continues,
                cut_digest: self.cut_digest,
            }
        }
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
        assert_eq!(a.cut_digest, Some(xxhash_rust::xxh3::xxh3_64(b"hello wo")));
        assert_ne!(a.digest, b.digest);
        // The whole-prompt digest is as before: of everything, in one piece.
        assert_eq!(
            a.digest,
            xxhash_rust::xxh3::xxh3_64(b"hello world, and more")
        );
        let mut c = PromptBuilder::new(64);
        c.text("short");
        assert_eq!(c.finish().cut_digest, None);
        assert_eq!(
            raw_body(b"0123456789", 4).cut_digest,
            Some(xxhash_rust::xxh3::xxh3_64(b"0123"))
        );
        assert_eq!(raw_body(b"0123", 4).cut_digest, None);
    }
}

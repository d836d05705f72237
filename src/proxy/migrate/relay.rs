//! The answer's SSE events as they pass to the client, for a stream that may continue
//! elsewhere: what was generated so far ([`Said`]), and each continuation's events made
//! the first part's sequel.
//!
//! Only whole events go out: an event's first bytes wait for its end (its worker may
//! break in the middle, and half an event cannot be finished by another worker). An
//! engine writes one event per write, so in practice nothing waits, and a read of whole
//! events goes out as the same buffer, uncopied. A continuation's events get the first
//! part's `id`; its role chunk is dropped (the client has had one); its usage covers both
//! parts (`completion_tokens` plus what was sent before, `prompt_tokens` less it, as the
//! continued prompt carried it; `cached_tokens` as the new worker reported).
//!
//! The first part's events are read (JSON-parsed) only when something needs what was
//! said: a break, or more unread event bytes than [`UNREAD_MAX`]. Until then they are
//! copied aside as they pass; an event naming `"error"` is read at once (it may break
//! the part).

use std::borrow::Cow;

use bytes::Bytes;
use serde::Deserialize;
use serde::de::IgnoredAny;

use super::{Kind, messages, responses};
use crate::prompt::Text;

/// The most bytes of the first part's events kept unread: past it they are read and
/// dropped. Covers a short answer (an engine's chat chunk is about 200 bytes: some 80
/// events) while bounding what 5,000 open streams keep (80 MiB at most).
pub const UNREAD_MAX: usize = 16 * 1024;

/// The unread buffer's first allocation (it grows as events come).
const UNREAD_FIRST: usize = 1024;

/// The search for `"error"` every event of the first part gets, built once.
static ERROR_KEY: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\"error\""));

/// What the client has been sent of the answer.
#[derive(Debug, Default)]
pub struct Said {
    /// The first part's `id`, `object`, `created` and `model` (every later event says
    /// the same id).
    pub id: Option<String>,
    pub object: Option<String>,
    pub created: Option<u64>,
    pub model: Option<String>,
    /// The generated text so far (choice 0).
    pub text: String,
    /// A chunk with the assistant's `role` passed.
    pub role_sent: bool,
    /// A `finish_reason` passed: the answer is whole.
    pub finished: bool,
    /// `data: [DONE]` passed.
    pub done: bool,
    /// A tool call was being streamed.
    pub tool_call: bool,
    /// Reasoning text was being streamed.
    pub reasoning: bool,
    /// A Responses stream's item, sequence and closing events.
    pub shape: super::responses::Shape,
    /// A Messages stream's blocks and end.
    pub blocks: super::messages::Blocks,
}

/// See the module docs.
#[derive(Debug)]
pub struct Relay {
    kind: Kind,
    /// The start of an event not whole yet.
    partial: Vec<u8>,
    said: Said,
    /// The first part's events passed but not read yet (see the module docs), copied
    /// one after another: a slice of the worker's read buffer would keep the whole
    /// buffer (8 KiB or more a read) alive.
    unread: Vec<u8>,
    /// 0 for the first worker's events, then one more per continuation.
    part: u32,
    /// This continuation's own id, written as the first part's.
    their_id: Option<String>,
    /// Tokens sent before this part.
    before: u64,
    /// This part's content events, and its usage's `completion_tokens` (continuous
    /// usage) when it reports them: its tokens are the larger.
    events: u64,
    reported: u64,
    /// The engine sent an error event: nothing more of this part is passed.
    broken: bool,
}

/// What one read of the worker's body gives the client.
#[derive(Debug, Default)]
pub struct Passed {
    /// The whole events to send now (`None`: nothing yet).
    pub out: Option<Bytes>,
    /// The engine sent an error event (not passed, nor anything after it).
    pub broke: bool,
}

/// What becomes of one event.
enum Verdict {
    Keep,
    Drop,
    Replace(Vec<u8>),
    Broke,
}

impl Relay {
    pub fn new(kind: Kind) -> Self {
        Relay {
            kind,
            partial: Vec::new(),
            said: Said::default(),
            unread: Vec::new(),
            part: 0,
            their_id: None,
            before: 0,
            events: 0,
            reported: 0,
            broken: false,
        }
    }

    /// Tokens sent so far (every part's).
    pub fn tokens(&mut self) -> u64 {
        self.settle();
        self.before.saturating_add(self.events.max(self.reported))
    }

    /// What the client has been sent so far.
    pub fn said(&mut self) -> &Said {
        self.settle();
        &self.said
    }

    /// Reads the events kept unread.
    fn settle(&mut self) {
        let mut unread = std::mem::take(&mut self.unread);
        let mut at = 0;
        while let Some(end) = event_end(&unread, at) {
            let event = &unread[at..end];
            if let Some(data) = data_of(event) {
                // Never a break: an event naming "error" was read when it passed.
                self.read(event, &data);
            }
            at = end;
        }
        unread.clear();
        self.unread = unread;
    }

    /// Continuations so far.
    pub fn part(&self) -> u32 {
        self.part
    }

    /// A continuation's events follow: an event its predecessor left unfinished is
    /// dropped (the client never saw it).
    pub fn begin_part(&mut self) {
        self.before = self.tokens();
        self.part += 1;
        self.their_id = None;
        self.events = 0;
        self.reported = 0;
        self.partial.clear();
        self.broken = false;
    }

    /// Passes one read of the worker's body: its whole events (as they are, or as a
    /// continuation's are rewritten); an unfinished one is kept for the next read.
    pub fn pass(&mut self, data: &Bytes) -> Passed {
        if self.broken {
            return Passed::default();
        }
        let src = if self.partial.is_empty() {
            data.clone()
        } else {
            let mut held = std::mem::take(&mut self.partial);
            held.extend_from_slice(data);
            Bytes::from(held)
        };
        let buf = &src[..];
        let mut edited: Option<Vec<u8>> = None;
        let (mut at, mut copied) = (0, 0);
        let mut broke = false;
        while let Some(end) = event_end(buf, at) {
            let verdict = match self.part {
                0 => self.first_part(&buf[at..end]),
                _ => self.event(&buf[at..end]),
            };
            if !matches!(verdict, Verdict::Keep) {
                let out = edited.get_or_insert_with(|| Vec::with_capacity(buf.len()));
                out.extend_from_slice(&buf[copied..at]);
                copied = end;
                match verdict {
                    Verdict::Replace(v) => out.extend_from_slice(&v),
                    Verdict::Broke => {
                        copied = at;
                        broke = true;
                        self.broken = true;
                        break;
                    }
                    _ => {}
                }
            }
            at = end;
        }
        let whole = if broke { copied } else { at };
        if !broke {
            self.partial.extend_from_slice(&buf[at..]);
        }
        let out = match edited {
            Some(mut v) => {
                v.extend_from_slice(&buf[copied.min(whole)..whole]);
                Bytes::from(v)
            }
            None => src.slice(..whole),
        };
        Passed {
            out: (!out.is_empty()).then_some(out),
            broke,
        }
    }

    /// One whole event of the first part (blank line included): kept unread unless it
    /// may break the part.
    fn first_part(&mut self, event: &[u8]) -> Verdict {
        if self.said.done {
            return Verdict::Keep;
        }
        let Some(data) = data_of(event) else {
            return Verdict::Keep;
        };
        if data.trim_ascii() == b"[DONE]" {
            self.said.done = true;
            return Verdict::Keep;
        }
        // Inside a JSON string a quote is escaped: `"error"` is a key or a value.
        if ERROR_KEY.find(&data).is_some() {
            self.settle();
            return self.read(event, &data);
        }
        if self.unread.len() + event.len() > UNREAD_MAX {
            // Read what is kept first: the buffer never grows past its bound.
            self.settle();
        }
        if self.unread.capacity() == 0 {
            self.unread.reserve(UNREAD_FIRST);
        }
        self.unread.extend_from_slice(event);
        Verdict::Keep
    }

    /// One whole event of a continuation (its bytes, blank line included).
    fn event(&mut self, event: &[u8]) -> Verdict {
        let Some(data) = data_of(event) else {
            return Verdict::Keep;
        };
        if data.trim_ascii() == b"[DONE]" {
            if self.kind.continues_as_chat() && !self.said.done {
                // The chat continuation's end: the answer's closing events.
                return Verdict::Replace(self.closing());
            }
            self.said.done = true;
            return Verdict::Keep;
        }
        if self.said.done {
            return Verdict::Keep;
        }
        self.read(event, &data)
    }

    /// What one event's data says (parsed): noted, and what becomes of the event.
    fn read(&mut self, event: &[u8], data: &[u8]) -> Verdict {
        if self.kind.continues_as_chat() {
            return if self.part == 0 {
                self.first_response(data)
            } else {
                self.sequel(data)
            };
        }
        let Ok(chunk) = serde_json::from_slice::<Chunk<'_>>(data) else {
            return Verdict::Keep;
        };
        if chunk.error.is_some() || chunk.object.as_deref() == Some("error") {
            return Verdict::Broke;
        }
        let first = self.part == 0;
        if first && self.said.id.is_none() {
            self.said.id = chunk.id.as_ref().map(|t| t.to_string());
            self.said.object = chunk.object.as_ref().map(|t| t.to_string());
            self.said.created = chunk.created;
            self.said.model = chunk.model.as_ref().map(|t| t.to_string());
        } else if !first && self.their_id.is_none() {
            self.their_id = chunk
                .id
                .as_deref()
                .filter(|id| Some(*id) != self.said.id.as_deref())
                .map(str::to_owned);
        }
        let mut role_again = false;
        let mut content = false;
        if let Some(c) = chunk.choices.as_ref().and_then(|c| c.first()) {
            let text = match self.kind {
                Kind::Chat => c.delta.as_ref().and_then(|d| d.content.as_deref()),
                // (Responses and Messages never reach here: see `read`.)
                _ => c.text.as_deref(),
            };
            if let Some(d) = &c.delta {
                role_again = d.role.is_some() && self.said.role_sent && !first;
                self.said.role_sent |= d.role.is_some();
                self.said.tool_call |= d.tool_calls.as_ref().is_some_and(|t| !t.is_empty())
                    || d.function_call.is_some();
                self.said.reasoning |= [&d.reasoning_content, &d.reasoning]
                    .iter()
                    .any(|r| r.as_deref().is_some_and(|r| !r.is_empty()));
            }
            if let Some(t) = text.filter(|t| !t.is_empty()) {
                self.said.text.push_str(t);
                self.events += 1;
                content = true;
            }
            self.said.finished |= c.finish_reason.is_some();
            if role_again && !content && c.finish_reason.is_none() {
                return Verdict::Drop;
            }
        }
        let usage = chunk.usage.as_ref().and_then(|u| u.completion_tokens);
        if let Some(n) = usage {
            self.reported = self.reported.max(n);
        }
        if first {
            return Verdict::Keep;
        }
        if role_again || usage.is_some() {
            return self.rewritten(data);
        }
        match (&self.their_id, &self.said.id) {
            (Some(theirs), Some(ours)) => Verdict::Replace(replace_id(event, theirs, ours)),
            _ => Verdict::Keep,
        }
    }

    /// The closing events of a Responses or Messages answer continued as chat.
    fn closing(&mut self) -> Vec<u8> {
        let tokens = self.before.saturating_add(self.events.max(self.reported));
        match self.kind {
            Kind::Messages => messages::closing(&mut self.said, tokens),
            _ => responses::closing(&mut self.said, tokens, self.before),
        }
    }

    /// One event of a Responses or Messages answer's first part, noted.
    fn first_response(&mut self, data: &[u8]) -> Verdict {
        let noted = match self.kind {
            Kind::Messages => messages::note(&mut self.said, data),
            _ => responses::note(&mut self.said, data),
        };
        match noted {
            Err(()) => Verdict::Broke,
            Ok(text) => {
                self.events += u64::from(text);
                Verdict::Keep
            }
        }
    }

    /// One chunk of a Responses or Messages answer's (chat) continuation, written as
    /// the first part's events: its text as a delta; role, finish and usage chunks noted, not
    /// passed.
    fn sequel(&mut self, data: &[u8]) -> Verdict {
        let Ok(chunk) = serde_json::from_slice::<Chunk<'_>>(data) else {
            return Verdict::Drop;
        };
        if chunk.error.is_some() || chunk.object.as_deref() == Some("error") {
            return Verdict::Broke;
        }
        let mut out = Vec::new();
        if let Some(c) = chunk.choices.as_ref().and_then(|c| c.first()) {
            let text = c.delta.as_ref().and_then(|d| d.content.as_deref());
            if let Some(t) = text.filter(|t| !t.is_empty()) {
                self.said.text.push_str(t);
                self.events += 1;
                out = match self.kind {
                    Kind::Messages => messages::delta(&mut self.said.blocks, t),
                    _ => responses::delta(&mut self.said.shape, t),
                };
            }
            self.said.finished |= c.finish_reason.is_some();
            let cut = c.finish_reason.as_deref() == Some("length");
            self.said.shape.cut |= cut;
            self.said.blocks.cut |= cut;
        }
        if let Some(u) = &chunk.usage {
            self.reported = self.reported.max(u.completion_tokens.unwrap_or(0));
            let shape = &mut self.said.shape;
            shape.prompt_tokens = u.prompt_tokens.or(shape.prompt_tokens);
            let cached = u
                .prompt_tokens_details
                .as_ref()
                .and_then(|d| d.cached_tokens);
            shape.cached_tokens = cached.or(shape.cached_tokens);
        }
        if out.is_empty() {
            Verdict::Drop
        } else {
            Verdict::Replace(out)
        }
    }

    /// A continuation's event parsed and written again: the first part's id, no role,
    /// usage covering every part.
    fn rewritten(&self, data: &[u8]) -> Verdict {
        let Ok(mut v) = serde_json::from_slice::<serde_json::Value>(data) else {
            return Verdict::Keep;
        };
        if let (Some(id), Some(slot)) = (&self.said.id, v.get_mut("id")) {
            *slot = serde_json::Value::String(id.clone());
        }
        if let Some(delta) = v
            .pointer_mut("/choices/0/delta")
            .and_then(|d| d.as_object_mut())
        {
            delta.remove("role");
        }
        if let Some(u) = v.get_mut("usage").and_then(|u| u.as_object_mut()) {
            let get = |u: &serde_json::Map<String, serde_json::Value>, k: &str| {
                u.get(k).and_then(|n| n.as_u64())
            };
            let (prompt, completion) = (get(u, "prompt_tokens"), get(u, "completion_tokens"));
            if let (Some(p), Some(c)) = (prompt, completion) {
                let (p, c) = (p.saturating_sub(self.before), c.saturating_add(self.before));
                u.insert("prompt_tokens".into(), p.into());
                u.insert("completion_tokens".into(), c.into());
                u.insert("total_tokens".into(), p.saturating_add(c).into());
            }
        }
        let mut out = b"data: ".to_vec();
        // A Value always serialises.
        out.extend_from_slice(&serde_json::to_vec(&v).unwrap_or_default());
        out.extend_from_slice(b"\n\n");
        Verdict::Replace(out)
    }

    /// The end the router writes for an answer that was whole when its worker broke
    /// (its final chunk passed, or its token budget is spent): a final chunk when none
    /// passed (`finish_reason: length`), then `data: [DONE]`.
    pub fn ending(&mut self) -> Bytes {
        self.settle();
        if self.kind.continues_as_chat() {
            if self.said.done {
                return Bytes::new();
            }
            return Bytes::from(self.closing());
        }
        let mut out = Vec::new();
        if !self.said.finished {
            let choice = match self.kind {
                Kind::Chat => {
                    serde_json::json!({"index": 0, "delta": {}, "finish_reason": "length"})
                }
                _ => {
                    serde_json::json!({"index": 0, "text": "", "finish_reason": "length"})
                }
            };
            let chunk = serde_json::json!({
                "id": self.said.id,
                "object": self.said.object,
                "created": self.said.created,
                "model": self.said.model,
                "choices": [choice],
            });
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(chunk.to_string().as_bytes());
            out.extend_from_slice(b"\n\n");
        }
        out.extend_from_slice(b"data: [DONE]\n\n");
        Bytes::from(out)
    }
}

/// The SSE error event a stream of `kind` that could not continue ends with (OpenAI's
/// error shape, as vLLM sends one mid-stream; Anthropic's `event: error` on
/// `/v1/messages`, which its SDK raises), after a blank line when the bytes before it
/// ended mid-event (`clean`: they did not).
pub fn error_event(kind: Kind, message: &str, clean: bool) -> Bytes {
    let lead: &str = if clean { "" } else { "\n\n" };
    if kind == Kind::Messages {
        let body = serde_json::json!({"type": "error", "error": {
            "type": "api_error",
            "message": message,
        }});
        return Bytes::from(format!("{lead}event: error\ndata: {body}\n\n"));
    }
    let body = serde_json::json!({"error": {
        "message": message,
        "type": "stream_interrupted",
        "param": null,
        "code": 502,
    }});
    Bytes::from(format!("{lead}data: {body}\n\n"))
}

/// A named SSE event (`event:` then `data:`), as Responses and Messages streams write
/// each one.
pub(super) fn named_event(kind: &str, data: &serde_json::Value) -> Vec<u8> {
    let mut out = format!("event: {kind}\ndata: ").into_bytes();
    // A Value always serialises.
    out.extend_from_slice(&serde_json::to_vec(data).unwrap_or_default());
    out.extend_from_slice(b"\n\n");
    out
}

/// `event` with the JSON string `theirs` written as `ours`.
fn replace_id(event: &[u8], theirs: &str, ours: &str) -> Vec<u8> {
    let (from, to) = (format!("\"{theirs}\""), format!("\"{ours}\""));
    let mut out = Vec::with_capacity(event.len() + to.len());
    let mut rest = event;
    while let Some(i) = memchr::memmem::find(rest, from.as_bytes()) {
        out.extend_from_slice(&rest[..i]);
        out.extend_from_slice(to.as_bytes());
        rest = &rest[i + from.len()..];
    }
    out.extend_from_slice(rest);
    out
}

/// Where the event that starts at `from` ends (just past its blank line), if it is
/// whole in `buf`. Lines end with `\n` (`\r\n` too).
fn event_end(buf: &[u8], from: usize) -> Option<usize> {
    let mut line = from;
    loop {
        let nl = line + memchr::memchr(b'\n', &buf[line..])?;
        let text = &buf[line..nl];
        if text.is_empty() || text == b"\r" {
            return Some(nl + 1);
        }
        line = nl + 1;
    }
}

/// The data of an event: its `data:` lines' values joined by newlines (borrowed when
/// it has one); `None` when it has none.
fn data_of(event: &[u8]) -> Option<Cow<'_, [u8]>> {
    let mut found: Option<Cow<'_, [u8]>> = None;
    let mut rest = event;
    while !rest.is_empty() {
        let (line, next) = match memchr::memchr(b'\n', rest) {
            Some(nl) => (&rest[..nl], &rest[nl + 1..]),
            None => (rest, &rest[rest.len()..]),
        };
        rest = next;
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(v) = line.strip_prefix(b"data:") else {
            continue;
        };
        let v = v.strip_prefix(b" ").unwrap_or(v);
        found = Some(match found {
            None => Cow::Borrowed(v),
            Some(prev) => {
                let mut joined = prev.into_owned();
                joined.push(b'\n');
                joined.extend_from_slice(v);
                Cow::Owned(joined)
            }
        });
    }
    found
}

/// The fields of a streamed chunk the relay reads (strings borrowed when unescaped).
#[derive(Deserialize)]
struct Chunk<'a> {
    #[serde(borrow, default)]
    id: Option<Text<'a>>,
    #[serde(borrow, default)]
    object: Option<Text<'a>>,
    #[serde(default)]
    created: Option<u64>,
    #[serde(borrow, default)]
    model: Option<Text<'a>>,
    #[serde(borrow, default)]
    choices: Option<Vec<Choice<'a>>>,
    #[serde(default)]
    usage: Option<Tokens>,
    #[serde(default)]
    error: Option<IgnoredAny>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(borrow, default)]
    delta: Option<Delta<'a>>,
    #[serde(borrow, default)]
    text: Option<Text<'a>>,
    #[serde(borrow, default)]
    finish_reason: Option<Text<'a>>,
}

#[derive(Deserialize)]
struct Delta<'a> {
    #[serde(default)]
    role: Option<IgnoredAny>,
    #[serde(borrow, default)]
    content: Option<Text<'a>>,
    #[serde(default)]
    tool_calls: Option<Vec<IgnoredAny>>,
    #[serde(default)]
    function_call: Option<IgnoredAny>,
    #[serde(borrow, default)]
    reasoning_content: Option<Text<'a>>,
    #[serde(borrow, default)]
    reasoning: Option<Text<'a>>,
}

#[derive(Deserialize)]
struct Tokens {
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens_details: Option<Details>,
}

#[derive(Deserialize)]
struct Details {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(id: &str, delta: &str) -> String {
        format!(
            "data: {{\"id\":\"{id}\",\"object\":\"chat.completion.chunk\",\"created\":7,\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{delta},\"finish_reason\":null}}]}}\n\n"
        )
    }

    fn passed(r: &mut Relay, data: &str) -> String {
        let p = r.pass(&Bytes::from(data.to_string()));
        String::from_utf8(p.out.map(|b| b.to_vec()).unwrap_or_default()).unwrap()
    }

    #[test]
    fn the_first_part_passes_whole_events_unchanged_and_is_remembered() {
        let stream = [
            chunk("a", r#"{"role":"assistant","content":""}"#),
            chunk("a", r#"{"content":"Hel"}"#),
            chunk("a", r#"{"content":"lo \"you\""}"#),
        ]
        .concat();
        for split in 1..stream.len() {
            let mut r = Relay::new(Kind::Chat);
            let mut out = passed(&mut r, &stream[..split]);
            out += &passed(&mut r, &stream[split..]);
            assert_eq!(out, stream, "split at {split}");
            assert_eq!(r.said().text, "Hello \"you\"");
            assert_eq!(r.tokens(), 2);
            assert!(r.said().role_sent && !r.said().finished && !r.said().done);
            assert_eq!(r.said().id.as_deref(), Some("a"));
        }
        // A read of whole events goes out as the same buffer.
        let mut r = Relay::new(Kind::Chat);
        let data = Bytes::from(stream.clone());
        let out = r.pass(&data).out.unwrap();
        assert_eq!(out.as_ptr(), data.as_ptr());
        // An unfinished event waits for its end.
        let mut r = Relay::new(Kind::Chat);
        let half = &stream[..stream.len() - 1];
        assert_eq!(
            passed(&mut r, half).len(),
            stream.len() - chunk("a", r#"{"content":"lo \"you\""}"#).len()
        );
    }

    #[test]
    fn unread_events_are_bounded_and_read_when_asked() {
        let mut r = Relay::new(Kind::Chat);
        let one = chunk("a", r#"{"content":"x"}"#);
        let n = 2 * UNREAD_MAX / one.len();
        for _ in 0..n {
            assert_eq!(passed(&mut r, &one), one);
            assert!(r.unread.len() <= UNREAD_MAX);
        }
        assert!(!r.unread.is_empty(), "the latest events wait unread");
        assert_eq!(r.tokens(), n as u64);
        assert_eq!(r.said().text, "x".repeat(n));
        // An error event after unread ones: what came before it counts.
        let mut r = Relay::new(Kind::Chat);
        passed(&mut r, &chunk("a", r#"{"content":"one "}"#));
        passed(&mut r, &chunk("a", r#"{"content":"two"}"#));
        let p = r.pass(&Bytes::from_static(b"data: {\"error\":{\"code\":500}}\n\n"));
        assert!(p.broke && p.out.is_none());
        assert_eq!(r.said().text, "one two");
        assert_eq!(r.tokens(), 2);
        // A content token that says "error" in quotes is text, not a break.
        let mut r = Relay::new(Kind::Chat);
        let quoted = chunk("a", r#"{"content":"an \"error\""}"#);
        assert_eq!(passed(&mut r, &quoted), quoted);
        assert_eq!(r.said().text, "an \"error\"");
    }

    #[test]
    fn an_engine_error_event_breaks_the_part_and_is_not_passed() {
        let mut r = Relay::new(Kind::Chat);
        let ok = chunk("a", r#"{"content":"x"}"#);
        let err = "data: {\"error\":{\"message\":\"boom\",\"code\":500}}\n\n";
        let p = r.pass(&Bytes::from(format!("{ok}{err}data: [DONE]\n\n")));
        assert!(p.broke);
        assert_eq!(p.out.unwrap(), ok.as_bytes());
        assert!(!r.said().done, "the [DONE] after the error is not passed");
        // vLLM's older error shape.
        let mut r = Relay::new(Kind::Completions);
        let p = r.pass(&Bytes::from_static(
            b"data: {\"object\":\"error\",\"message\":\"x\",\"code\":500}\n\n",
        ));
        assert!(p.broke && p.out.is_none());
    }

    #[test]
    fn a_continuation_reads_as_the_sequel_of_the_first_part() {
        let mut r = Relay::new(Kind::Chat);
        passed(&mut r, &chunk("a", r#"{"role":"assistant","content":""}"#));
        passed(&mut r, &chunk("a", r#"{"content":"one "}"#));
        passed(&mut r, &chunk("a", r#"{"content":"two "}"#));
        // Half an event of the broken part: never sent, forgotten.
        passed(&mut r, "data: {\"id\":\"a\",\"cho");
        r.begin_part();
        let role = passed(&mut r, &chunk("b", r#"{"role":"assistant","content":""}"#));
        assert_eq!(role, "", "no second role chunk");
        let three = passed(&mut r, &chunk("b", r#"{"content":"three"}"#));
        assert_eq!(
            three,
            chunk("a", r#"{"content":"three"}"#),
            "the first part's id"
        );
        let usage = "data: {\"id\":\"b\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":1,\"total_tokens\":13,\"prompt_tokens_details\":{\"cached_tokens\":8}}}\n\n";
        let out = passed(&mut r, usage);
        let v: serde_json::Value =
            serde_json::from_str(out.strip_prefix("data: ").unwrap().trim()).unwrap();
        assert_eq!(v["id"], "a");
        assert_eq!(v["usage"]["prompt_tokens"], 10);
        assert_eq!(v["usage"]["completion_tokens"], 3);
        assert_eq!(v["usage"]["total_tokens"], 13);
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 8);
        assert_eq!(passed(&mut r, "data: [DONE]\n\n"), "data: [DONE]\n\n");
        assert!(r.said().done);
        assert_eq!(r.said().text, "one two three");
        assert_eq!(r.tokens(), 3);
    }

    #[test]
    fn tool_calls_and_reasoning_are_noted() {
        let mut r = Relay::new(Kind::Chat);
        passed(&mut r, &chunk("a", r#"{"reasoning_content":"hmm"}"#));
        assert!(r.said().reasoning && !r.said().tool_call);
        passed(
            &mut r,
            &chunk(
                "a",
                r#"{"tool_calls":[{"index":0,"function":{"name":"f"}}]}"#,
            ),
        );
        assert!(r.said().tool_call);
        let mut r = Relay::new(Kind::Chat);
        passed(&mut r, &chunk("a", r#"{"content":"x","tool_calls":[]}"#));
        assert!(!r.said().tool_call);
    }

    #[test]
    fn the_routers_ending_closes_a_whole_answer() {
        let mut r = Relay::new(Kind::Completions);
        passed(
            &mut r,
            "data: {\"id\":\"c\",\"object\":\"text_completion\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\"hi\",\"finish_reason\":null}]}\n\n",
        );
        let end = String::from_utf8(r.ending().to_vec()).unwrap();
        assert!(end.contains("\"finish_reason\":\"length\"") && end.contains("\"id\":\"c\""));
        assert!(end.ends_with("data: [DONE]\n\n"));
        assert_eq!(
            error_event(Kind::Chat, "x", false).slice(..2),
            Bytes::from_static(b"\n\n")
        );
        // Anthropic's error event on /v1/messages (its SDK raises it).
        let e = error_event(Kind::Messages, "gone", true);
        let e = String::from_utf8(e.to_vec()).unwrap();
        assert!(e.starts_with("event: error\ndata: "), "{e}");
        let v: serde_json::Value =
            serde_json::from_str(e.lines().nth(1).unwrap()[6..].trim()).unwrap();
        assert_eq!(
            (v["type"].as_str(), v["error"]["message"].as_str()),
            (Some("error"), Some("gone"))
        );
    }
}

//! Stream continuation (`migration:`): a streamed answer whose worker fails after bytes
//! reached the client is continued on another worker, and the client reads one
//! well-formed stream.
//!
//! ```text
//! plan       which requests can continue: decided once from the request body (streamed
//!            chat, completions or Responses; refused for n > 1, guided output,
//!            logprobs, echo, stored Responses context)
//! relay      the answer's SSE events as they pass: what was generated so far, and the
//!            continuation's events stitched to the first part (same id, no second role
//!            chunk, one [DONE], usage covering both parts)
//! resume     the continuation's body: the conversation plus the partial assistant
//!            message continued (vLLM's continue_final_message), or prompt + text so far
//!            (Responses: as chat); the token budget reduced by what was sent
//! responses  a Responses answer's events: read in the first part, written for the
//!            chat continuation's chunks, and the closing events
//! continuer  the continuation's pick and send, on the pool's current workers, the
//!            failed ones excluded
//! stream     the state a GuardedBody keeps for it: when to continue, refusals, counts
//! ```
//!
//! A stream breaks when its worker's connection fails or closes before the body's end,
//! when the engine sends an error event, when it stays silent past
//! `proxy.request_timeout_secs`, or when its worker's drain (`proxy.drain_secs`) ends.
//! Only a request that can continue pays for the relay (its events framed as they
//! pass, read only when it breaks); for the others the bytes pass as before, and a cut stream ends with an error
//! event saying why it could not continue.

mod continuer;
mod messages;
mod relay;
mod responses;
mod resume;
mod stream;

use serde::Deserialize;
use serde::de::IgnoredAny;

pub use continuer::{Continuer, Resumed, Sending};
pub use stream::{Migration, Step, Stream, Watch};

use crate::config::MigrationConfig;
use crate::prompt::{Endpoint, Text};
use crate::proxy::metrics::streams::{CAUSES, REFUSALS};

/// Which answer shape a continued stream has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `/v1/chat/completions`: `choices[].delta.content`.
    Chat,
    /// `/v1/completions`: `choices[].text`.
    Completions,
    /// `/v1/responses`: `response.output_text.delta` events (continued as chat).
    Responses,
    /// `/v1/messages`: `content_block_delta` events (continued as chat).
    Messages,
}

impl Kind {
    /// Its continuation is a chat request whose chunks are written in its own events.
    pub fn continues_as_chat(self) -> bool {
        matches!(self, Kind::Responses | Kind::Messages)
    }
}

/// Why a stream broke.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// The worker's connection failed mid-body (a reset, a read error).
    Reset,
    /// The worker's connection closed before the body's end (a process killed).
    Closed,
    /// The engine sent an error event mid-stream.
    EngineError,
    /// The worker's drain ended (`proxy.drain_secs`) with the stream still going.
    Drained,
    /// The worker sent nothing for `proxy.request_timeout_secs`.
    IdleTimeout,
}

impl Cause {
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::Reset => CAUSES[0],
            Cause::Closed => CAUSES[1],
            Cause::EngineError => CAUSES[2],
            Cause::Drained => CAUSES[3],
            Cause::IdleTimeout => CAUSES[4],
        }
    }
}

/// Why a broken stream is not continued (it ends with an error event).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// `n` (or `best_of`) above 1, or beam search.
    N,
    /// Guided or structured output (`response_format` json, `guided_*`,
    /// `structured_outputs`): a continuation cannot resume the grammar's state.
    Guided,
    /// Log probabilities asked for.
    Logprobs,
    /// A tool call was being streamed.
    ToolCall,
    /// Reasoning text was being streamed (its form in a continued message is the
    /// model's own).
    Reasoning,
    /// A shape the continuation cannot rebuild: `echo`, a list prompt (token ids, or
    /// several prompts at once).
    Unsupported,
    /// `migration.max_attempts` continuations already.
    Attempts,
}

impl Refusal {
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::N => REFUSALS[0],
            Refusal::Guided => REFUSALS[1],
            Refusal::Logprobs => REFUSALS[2],
            Refusal::ToolCall => REFUSALS[3],
            Refusal::Reasoning => REFUSALS[4],
            Refusal::Unsupported => REFUSALS[5],
            Refusal::Attempts => REFUSALS[6],
        }
    }
}

/// What a streamed request allows, decided once from its body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    pub kind: Kind,
    /// Why it can never continue; `None`: it can, while what it streams allows.
    pub refused: Option<Refusal>,
}

/// What a request's answer needs to continue elsewhere: its plan, and (unless refused
/// up front) how continuations are sent.
#[derive(Debug, Clone)]
pub struct Resume {
    pub plan: Plan,
    pub continuer: Option<Continuer>,
}

/// The fields of a request body that decide its [`Plan`].
#[derive(Deserialize, Default)]
struct Ask<'a> {
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    n: Option<u64>,
    #[serde(default)]
    best_of: Option<u64>,
    #[serde(default)]
    use_beam_search: Option<bool>,
    #[serde(borrow, default)]
    response_format: Option<Format<'a>>,
    #[serde(default)]
    guided_json: Option<IgnoredAny>,
    #[serde(default)]
    guided_regex: Option<IgnoredAny>,
    #[serde(default)]
    guided_choice: Option<IgnoredAny>,
    #[serde(default)]
    guided_grammar: Option<IgnoredAny>,
    #[serde(default)]
    structured_outputs: Option<IgnoredAny>,
    #[serde(default)]
    logprobs: Option<serde_json::Value>,
    #[serde(default)]
    top_logprobs: Option<u64>,
    #[serde(default)]
    prompt_logprobs: Option<u64>,
    #[serde(default)]
    echo: Option<bool>,
    /// Responses: an answer that builds on a stored one, or a stored conversation (a
    /// continuation as chat would not carry them).
    #[serde(default)]
    previous_response_id: Option<IgnoredAny>,
    #[serde(default)]
    conversation: Option<IgnoredAny>,
    /// Responses: `text.format` (`json_schema`, `json_object`: structured output).
    #[serde(borrow, default)]
    text: Option<TextParam<'a>>,
    /// A completions `prompt` that is a list (of strings, of token ids), not a string.
    #[serde(skip)]
    listed: bool,
}

/// The top-level members [`Ask`] reads (`prompt` is only looked at).
const ASKED: [&[u8]; 17] = [
    b"stream",
    b"n",
    b"best_of",
    b"use_beam_search",
    b"response_format",
    b"guided_json",
    b"guided_regex",
    b"guided_choice",
    b"guided_grammar",
    b"structured_outputs",
    b"logprobs",
    b"top_logprobs",
    b"prompt_logprobs",
    b"echo",
    b"previous_response_id",
    b"conversation",
    b"text",
];

impl Ask<'_> {
    /// The members of `body` a plan reads, parsed from their own bytes: the messages or
    /// prompt (most of a body) are stepped over, not decoded. `None` when `body` is not
    /// one JSON object or a member it reads is malformed.
    fn of<'p>(body: &[u8], picked: &'p mut Vec<u8>) -> Option<Ask<'p>> {
        let mut listed = false;
        picked.push(b'{');
        super::json_members::for_each(body, |key, value| {
            if key == b"prompt" {
                listed = value.first() == Some(&b'[');
            } else if ASKED.contains(&key) {
                if picked.len() > 1 {
                    picked.push(b',');
                }
                picked.push(b'"');
                picked.extend_from_slice(key);
                picked.extend_from_slice(b"\":");
                picked.extend_from_slice(value);
            }
        })?;
        picked.push(b'}');
        let picked: &'p Vec<u8> = picked;
        let ask: Ask<'p> = serde_json::from_slice(picked).ok()?;
        Some(Ask { listed, ..ask })
    }
}

#[derive(Deserialize)]
struct TextParam<'a> {
    #[serde(borrow, default)]
    format: Option<Format<'a>>,
}

#[derive(Deserialize)]
struct Format<'a> {
    #[serde(borrow, rename = "type", default)]
    kind: Option<Text<'a>>,
}

/// The [`Plan`] of a request to `endpoint` with `body`, when it streams an answer that
/// continuation knows (chat, completions) and `migration.enabled`; `None` otherwise
/// (its bytes pass untouched and a cut stream is cut, as before).
pub fn plan(cfg: &MigrationConfig, endpoint: Option<Endpoint>, body: &[u8]) -> Option<Plan> {
    let kind = match endpoint? {
        Endpoint::ChatCompletions => Kind::Chat,
        Endpoint::Completions => Kind::Completions,
        Endpoint::Responses => Kind::Responses,
        Endpoint::Messages => Kind::Messages,
    };
    // Most non-streamed bodies are told apart without a parse.
    if !cfg.enabled || memchr::memmem::find(body, b"\"stream\"").is_none() {
        return None;
    }
    let mut picked = Vec::with_capacity(64);
    let ask = Ask::of(body, &mut picked)?;
    if ask.stream != Some(true) {
        return None;
    }
    Some(Plan {
        kind,
        refused: refusal(&ask),
    })
}

/// Why a request's stream can never continue, if it cannot.
fn refusal(ask: &Ask<'_>) -> Option<Refusal> {
    let several = |n: Option<u64>| n.is_some_and(|n| n > 1);
    if several(ask.n) || several(ask.best_of) || ask.use_beam_search == Some(true) {
        return Some(Refusal::N);
    }
    let text_format = ask.text.as_ref().and_then(|t| t.format.as_ref());
    let json_format = [ask.response_format.as_ref(), text_format]
        .into_iter()
        .flatten()
        .filter_map(|f| f.kind.as_deref())
        .any(|k| k != "text");
    if json_format
        || ask.guided_json.is_some()
        || ask.guided_regex.is_some()
        || ask.guided_choice.is_some()
        || ask.guided_grammar.is_some()
        || ask.structured_outputs.is_some()
    {
        return Some(Refusal::Guided);
    }
    let logprobs = match &ask.logprobs {
        None | Some(serde_json::Value::Null) | Some(serde_json::Value::Bool(false)) => false,
        Some(_) => true,
    };
    if logprobs || ask.top_logprobs.is_some_and(|n| n > 0) || ask.prompt_logprobs.is_some() {
        return Some(Refusal::Logprobs);
    }
    if ask.echo == Some(true)
        || ask.listed
        || ask.previous_response_id.is_some()
        || ask.conversation.is_some()
    {
        return Some(Refusal::Unsupported);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn planned(endpoint: Endpoint, body: &str) -> Option<Plan> {
        plan(&MigrationConfig::default(), Some(endpoint), body.as_bytes())
    }

    #[test]
    fn only_streamed_answers_of_the_four_endpoints_get_a_plan() {
        let chat = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}"#;
        assert_eq!(
            planned(Endpoint::ChatCompletions, chat),
            Some(Plan {
                kind: Kind::Chat,
                refused: None
            })
        );
        let done = r#"{"prompt":"once","stream":true,"max_tokens":5}"#;
        assert_eq!(
            planned(Endpoint::Completions, done).map(|p| p.kind),
            Some(Kind::Completions)
        );
        for (e, body) in [
            (
                Endpoint::ChatCompletions,
                r#"{"messages":[],"stream":false}"#,
            ),
            (Endpoint::ChatCompletions, r#"{"messages":[]}"#),
            (Endpoint::ChatCompletions, "not json \"stream\""),
        ] {
            assert_eq!(planned(e, body), None, "{body}");
        }
        assert_eq!(
            planned(Endpoint::Messages, r#"{"messages":[],"stream":true}"#).map(|p| p.kind),
            Some(Kind::Messages)
        );
        assert_eq!(
            planned(Endpoint::Responses, r#"{"input":"x","stream":true}"#),
            Some(Plan {
                kind: Kind::Responses,
                refused: None
            })
        );
        let off = MigrationConfig {
            enabled: false,
            max_attempts: 1,
        };
        assert_eq!(
            plan(&off, Some(Endpoint::ChatCompletions), chat.as_bytes()),
            None
        );
    }

    #[test]
    fn what_a_continuation_cannot_resume_is_refused_up_front() {
        for (body, want) in [
            (r#"{"stream":true,"n":2}"#, Some(Refusal::N)),
            (r#"{"stream":true,"n":1}"#, None),
            (r#"{"stream":true,"best_of":3}"#, Some(Refusal::N)),
            (
                r#"{"stream":true,"response_format":{"type":"json_schema","json_schema":{}}}"#,
                Some(Refusal::Guided),
            ),
            (
                r#"{"stream":true,"response_format":{"type":"json_object"}}"#,
                Some(Refusal::Guided),
            ),
            (r#"{"stream":true,"response_format":{"type":"text"}}"#, None),
            (
                r#"{"stream":true,"guided_regex":"a+"}"#,
                Some(Refusal::Guided),
            ),
            (r#"{"stream":true,"guided_json":null}"#, None),
            (
                r#"{"stream":true,"structured_outputs":{"choice":["a"]}}"#,
                Some(Refusal::Guided),
            ),
            (
                r#"{"stream":true,"logprobs":true}"#,
                Some(Refusal::Logprobs),
            ),
            (r#"{"stream":true,"logprobs":false}"#, None),
            (r#"{"stream":true,"logprobs":2}"#, Some(Refusal::Logprobs)),
            (r#"{"stream":true,"top_logprobs":0}"#, None),
            (r#"{"stream":true,"echo":true}"#, Some(Refusal::Unsupported)),
            (
                r#"{"stream":true,"input":"x","previous_response_id":"resp_1"}"#,
                Some(Refusal::Unsupported),
            ),
            (
                r#"{"stream":true,"input":"x","previous_response_id":null}"#,
                None,
            ),
            (
                r#"{"stream":true,"input":"x","text":{"format":{"type":"json_schema","name":"a","schema":{}}}}"#,
                Some(Refusal::Guided),
            ),
            (
                r#"{"stream":true,"input":"x","text":{"format":{"type":"text"}}}"#,
                None,
            ),
            (
                r#"{"stream":true,"prompt":["a","b"]}"#,
                Some(Refusal::Unsupported),
            ),
            (
                r#"{"stream":true,"prompt":[1,2,3]}"#,
                Some(Refusal::Unsupported),
            ),
            (
                r#"{"stream":true,"prompt":["one"]}"#,
                Some(Refusal::Unsupported),
            ),
            (r#"{"stream":true,"prompt":"one"}"#, None),
        ] {
            assert_eq!(
                planned(Endpoint::Completions, body).and_then(|p| p.refused),
                want,
                "{body}"
            );
        }
    }
}

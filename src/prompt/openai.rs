//! OpenAI request shapes: chat completions, legacy completions and Responses.
//!
//! Shapes follow the OpenAI API reference as served by vLLM and SGLang. Each function
//! appends to a [`PromptBuilder`] and returns false when the body is not of its shape,
//! so the caller falls back to the raw body.

use std::borrow::Cow;
use std::fmt::Write as _;

use serde::Deserialize;
use serde_json::value::RawValue;

use super::{Content, PromptBuilder, Text, append_content};

#[derive(Deserialize)]
struct ChatBody<'a> {
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
    #[serde(borrow, default)]
    cache_salt: Option<&'a RawValue>,
    #[serde(borrow)]
    messages: Vec<ChatMessage<'a>>,
    /// Kept unparsed: its bytes are the routing text (`prompt::tools`).
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct ChatMessage<'a> {
    #[serde(borrow, default)]
    role: Option<Text<'a>>,
    #[serde(borrow, default)]
    content: Option<Content<'a>>,
    #[serde(borrow, default)]
    tool_calls: Option<Vec<ToolCall<'a>>>,
}

#[derive(Deserialize)]
struct ToolCall<'a> {
    #[serde(borrow, default)]
    function: Option<FunctionCall<'a>>,
}

#[derive(Deserialize)]
struct FunctionCall<'a> {
    #[serde(borrow, default)]
    name: Option<Text<'a>>,
    /// A JSON-encoded string per the API; some clients send an object.
    #[serde(borrow, default)]
    arguments: Option<&'a RawValue>,
}

/// `/v1/chat/completions`: the tool definitions first (`tools: …`, see
/// `prompt::tools`), then for each message, `role: ` then its content (string, parts
/// or null), then each tool call's name and arguments, then a newline. Tool results are
/// `role: tool` messages and count like any content.
pub fn chat(body: &[u8], b: &mut PromptBuilder) -> bool {
    let Ok(req) = serde_json::from_slice::<ChatBody<'_>>(body) else {
        return false;
    };
    b.model(req.model, body);
    b.cache_salt(req.cache_salt);
    super::tools(req.tools, b);
    for m in &req.messages {
        b.role(m.role.as_deref().unwrap_or("user"));
        if let Some(c) = &m.content
            && !append_content(c, b)
        {
            return false;
        }
        for call in m.tool_calls.iter().flatten() {
            if let Some(f) = &call.function {
                b.text("\n<tool_call> ");
                b.text(f.name.as_deref().unwrap_or_default());
                b.text(" ");
                if let Some(args) = f.arguments {
                    json_text(args, b);
                }
            }
        }
        b.end_message();
    }
    true
}

/// Appends a JSON value's text: a string's contents, anything else as written.
fn json_text(raw: &RawValue, b: &mut PromptBuilder) {
    match super::json_str(raw) {
        Some(s) => b.text(&s),
        None => b.text(raw.get()),
    }
}

#[derive(Deserialize)]
struct CompletionBody<'a> {
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
    #[serde(borrow, default)]
    cache_salt: Option<&'a RawValue>,
    #[serde(borrow)]
    prompt: &'a RawValue,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Prompt<'a> {
    Text(#[serde(borrow)] Cow<'a, str>),
    Texts(#[serde(borrow)] Vec<Cow<'a, str>>),
    Tokens(Vec<u64>),
    TokenBatches(Vec<Vec<u64>>),
}

/// `/v1/completions`: `prompt` as a string, an array of strings (joined by newlines),
/// token ids (written as decimal numbers each followed by a space, so a token prefix is
/// a text prefix) or arrays of token ids. Any other `prompt` is not this shape.
pub fn completions(body: &[u8], b: &mut PromptBuilder) -> bool {
    let Ok(req) = serde_json::from_slice::<CompletionBody<'_>>(body) else {
        return false;
    };
    b.model(req.model, body);
    b.cache_salt(req.cache_salt);
    let Ok(prompt) = serde_json::from_str::<Prompt<'_>>(req.prompt.get()) else {
        return false;
    };
    match prompt {
        Prompt::Text(t) => b.text(&t),
        Prompt::Texts(ts) => {
            for (i, t) in ts.iter().enumerate() {
                if i > 0 {
                    b.text("\n");
                }
                b.text(t);
            }
        }
        Prompt::Tokens(ids) => token_ids(&ids, b),
        Prompt::TokenBatches(batches) => {
            for (i, ids) in batches.iter().enumerate() {
                if i > 0 {
                    b.text("\n");
                }
                token_ids(ids, b);
            }
        }
    }
    true
}

fn token_ids(ids: &[u64], b: &mut PromptBuilder) {
    let mut buf = String::with_capacity(24);
    for id in ids {
        buf.clear();
        let _ = write!(buf, "{id} ");
        b.text(&buf);
    }
}

#[derive(Deserialize)]
struct ResponsesBody<'a> {
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
    #[serde(borrow, default)]
    cache_salt: Option<&'a RawValue>,
    #[serde(borrow, default)]
    instructions: Option<Text<'a>>,
    /// A string (one user message) or an array of items.
    #[serde(borrow, default)]
    input: Option<Content<'a>>,
    #[serde(borrow, default)]
    previous_response_id: Option<Cow<'a, str>>,
    /// A conversation id, or `{"id": …}`.
    #[serde(borrow, default)]
    conversation: Option<&'a RawValue>,
    /// Kept unparsed: its bytes are the routing text (`prompt::tools`).
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
}

/// The id of a `conversation` field: a string, or an object with a string `id`.
fn conversation_id(raw: &RawValue) -> Option<String> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Conv {
        Id(String),
        Object { id: String },
    }
    match serde_json::from_str::<Conv>(raw.get()).ok()? {
        Conv::Id(s) | Conv::Object { id: s } => Some(s),
    }
}

#[derive(Deserialize)]
struct ResponsesItem<'a> {
    #[serde(rename = "type", borrow, default)]
    kind: Option<Text<'a>>,
    #[serde(borrow, default)]
    role: Option<Text<'a>>,
    #[serde(borrow, default)]
    content: Option<Content<'a>>,
    #[serde(borrow, default)]
    name: Option<Text<'a>>,
    #[serde(borrow, default)]
    arguments: Option<&'a RawValue>,
    #[serde(borrow, default)]
    output: Option<&'a RawValue>,
}

/// `/v1/responses`: the tool definitions first (`tools: …`, see `prompt::tools`),
/// `instructions` as a system message, then `input`: a string (one user message) or items (messages, `function_call` name + arguments,
/// `function_call_output`; other items such as reasoning count towards the digest).
pub fn responses(body: &[u8], b: &mut PromptBuilder) -> bool {
    let Ok(req) = serde_json::from_slice::<ResponsesBody<'_>>(body) else {
        return false;
    };
    b.model(req.model, body);
    b.cache_salt(req.cache_salt);
    if let Some(prev) = req
        .previous_response_id
        .as_deref()
        .filter(|p| !p.is_empty())
    {
        b.continues(prev);
    } else if let Some(conv) = req.conversation.and_then(conversation_id) {
        b.continues(&conv);
    }
    super::tools(req.tools, b);
    if let Some(i) = &req.instructions {
        b.role("system");
        b.text(&i.0);
        b.end_message();
    }
    let items = match &req.input {
        None => return req.instructions.is_some(),
        Some(Content::Text(t)) => {
            b.role("user");
            b.text(t);
            b.end_message();
            return true;
        }
        Some(Content::Parts(items)) => items,
    };
    for &raw in items {
        let Ok(item) = serde_json::from_str::<ResponsesItem<'_>>(raw.get()) else {
            return false;
        };
        match item.kind.as_deref().unwrap_or("message") {
            "message" => {
                b.role(item.role.as_deref().unwrap_or("user"));
                if let Some(c) = &item.content
                    && !append_content(c, b)
                {
                    return false;
                }
            }
            "function_call" => {
                b.role("assistant");
                b.text("<tool_call> ");
                b.text(item.name.as_deref().unwrap_or_default());
                b.text(" ");
                if let Some(a) = item.arguments {
                    json_text(a, b);
                }
            }
            "function_call_output" => {
                b.role("tool");
                if let Some(o) = item.output {
                    json_text(o, b);
                }
            }
            other => b.media(other, raw.get().as_bytes()),
        }
        b.end_message();
    }
    true
}

#[cfg(test)]
mod tests {
    use crate::prompt::{Endpoint, Source, extract};

    fn text(endpoint: Endpoint, body: &str) -> String {
        let ctx = extract(endpoint, body.as_bytes(), 1 << 20);
        assert_eq!(ctx.source, Source::Extracted, "{body}");
        String::from_utf8(ctx.text.into_owned()).unwrap()
    }

    #[test]
    fn chat_string_content_in_order_with_roles() {
        let t = text(
            Endpoint::ChatCompletions,
            r#"{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}]}"#,
        );
        assert_eq!(t, "system: Be brief.\nuser: Hi\n");
        // A role (read where it lies when it can be) with escapes is decoded; a role that
        // is not a string makes the body unreadable (the raw body is the key).
        let t = text(
            Endpoint::ChatCompletions,
            r#"{"model":"m","messages":[{"role":"us\u0065r","content":"Hi"}]}"#,
        );
        assert_eq!(t, "user: Hi\n");
        let body = r#"{"model":"m","messages":[{"role":5,"content":"Hi"}]}"#;
        let ctx = extract(Endpoint::ChatCompletions, body.as_bytes(), 1 << 20);
        assert_eq!(ctx.source, Source::RawBody);
    }

    #[test]
    fn chat_parts_keep_text_order_and_hash_images() {
        let img = |d: &str| {
            format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"text","text":"Describe the chart."}},{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{d}"}}}},{{"type":"text","text":"Answer in one line."}}]}}]}}"#
            )
        };
        let a_body = img(&"QUJD".repeat(1000));
        let b_body = img(&"WFla".repeat(1000));
        let a = extract(Endpoint::ChatCompletions, a_body.as_bytes(), 1 << 20);
        let b = extract(Endpoint::ChatCompletions, b_body.as_bytes(), 1 << 20);
        let at = std::str::from_utf8(&a.text).unwrap();
        let bt = std::str::from_utf8(&b.text).unwrap();
        let d = at.find("Describe the chart.").unwrap();
        let o = at.find("Answer in one line.").unwrap();
        assert!(d < o);
        assert!(!at.contains("QUJD"), "no base64 in the routing text");
        assert!(at.len() < 100);
        assert_ne!(at, bt, "different images give different routing text");
        assert_ne!(a.digest, b.digest);
        assert!(a.total_len > 4000, "media counts towards the length");
    }

    #[test]
    fn chat_null_empty_and_missing_content_with_tool_calls() {
        let body = |content: &str| {
            format!(
                r#"{{"model":"m","messages":[{{"role":"system","content":"You plan trips."}},{{"role":"user","content":"Weather in Testville?"}},{{"role":"assistant",{content}"tool_calls":[{{"id":"call_1","type":"function","function":{{"name":"get_weather","arguments":"{{\"city\":\"Testville\"}}"}}}}]}},{{"role":"tool","tool_call_id":"call_1","content":"12C cloudy"}},{{"role":"user","content":"And tomorrow?"}}]}}"#
            )
        };
        let variants = [
            body(r#""content":null,"#),
            body(r#""content":"","#),
            body(""),
        ];
        let texts: Vec<String> = variants
            .iter()
            .map(|v| text(Endpoint::ChatCompletions, v))
            .collect();
        assert_eq!(texts[0], texts[1]);
        assert_eq!(texts[0], texts[2]);
        let t = &texts[0];
        let name = t.find("get_weather").unwrap();
        let args = t.find(r#"{"city":"Testville"}"#).unwrap();
        let result = t.find("12C cloudy").unwrap();
        assert!(name < args && args < result && result < t.find("And tomorrow?").unwrap());
        let first_two = text(
            Endpoint::ChatCompletions,
            r#"{"messages":[{"role":"system","content":"You plan trips."},{"role":"user","content":"Weather in Testville?"}]}"#,
        );
        assert!(
            t.starts_with(&first_two),
            "a conversation's start is a prefix of the whole"
        );
    }

    #[test]
    fn chat_with_unreadable_content_falls_back() {
        let ctx = extract(
            Endpoint::ChatCompletions,
            br#"{"messages":[{"role":"user","content":42}]}"#,
            100,
        );
        assert_eq!(ctx.source, Source::RawBody);
    }

    #[test]
    fn completions_prompt_shapes() {
        assert_eq!(
            text(Endpoint::Completions, r#"{"prompt":"Once upon"}"#),
            "Once upon"
        );
        assert_eq!(
            text(
                Endpoint::Completions,
                r#"{"model":"m","prompt":[1212,318,257,1332],"max_tokens":4}"#
            ),
            "1212 318 257 1332 "
        );
        assert_eq!(
            text(
                Endpoint::Completions,
                r#"{"model":"m","prompt":[[1,2,3],[4,5,6]],"max_tokens":4}"#
            ),
            "1 2 3 \n4 5 6 "
        );
        assert_eq!(
            text(
                Endpoint::Completions,
                r#"{"model":"m","prompt":["alpha text","beta text"]}"#
            ),
            "alpha text\nbeta text"
        );
        assert_eq!(
            text(Endpoint::Completions, r#"{"model":"m","prompt":""}"#),
            ""
        );
        for odd in [
            r#"{"model":"m","prompt":42}"#,
            r#"{"model":"m"}"#,
            r#"{"prompt":[1,"a"]}"#,
        ] {
            assert_eq!(
                extract(Endpoint::Completions, odd.as_bytes(), 100).source,
                Source::RawBody
            );
        }
    }

    #[test]
    fn token_prefix_is_text_prefix() {
        let a = text(Endpoint::Completions, r#"{"prompt":[12,5]}"#);
        let b = text(Endpoint::Completions, r#"{"prompt":[12,5,7]}"#);
        let c = text(Endpoint::Completions, r#"{"prompt":[125,7]}"#);
        assert!(b.starts_with(&a));
        assert!(!c.starts_with(&a));
    }

    #[test]
    fn responses_instructions_then_input() {
        assert_eq!(
            text(
                Endpoint::Responses,
                r#"{"model":"m","instructions":"Be kind.","input":"Hello"}"#
            ),
            "system: Be kind.\nuser: Hello\n"
        );
        let t = text(
            Endpoint::Responses,
            r#"{"input":[{"role":"user","content":[{"type":"input_text","text":"Find x"}]},{"type":"function_call","call_id":"c1","name":"find","arguments":"{\"q\":\"x\"}"},{"type":"function_call_output","call_id":"c1","output":"x=1"},{"type":"message","role":"assistant","content":[{"type":"output_text","text":"x is 1"}]}]}"#,
        );
        assert_eq!(
            t,
            "user: Find x\nassistant: <tool_call> find {\"q\":\"x\"}\ntool: x=1\nassistant: x is 1\n"
        );
    }
}

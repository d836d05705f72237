//! A chat request's messages rendered through the model's chat template, the way vLLM
//! renders them before tokenizing (vLLM 0.32 `vllm/renderers/{chat_utils,hf}.py`, which
//! calls Hugging Face `transformers`' `apply_chat_template`).
//!
//! What is mirrored, because each one changes the prompt's tokens:
//! - the Jinja environment of `transformers` (`chat_template_utils.py`): `trim_blocks`,
//!   `lstrip_blocks`, loop controls, `raise_exception`, `strftime_now` (the engine's
//!   clock is assumed to be UTC, as in its usual container), and a `tojson` that writes like
//!   Python's `json.dumps(ensure_ascii=False)` (`", "` and `": "` separators, no HTML
//!   escaping); Python string/dict methods come from `minijinja-contrib`'s pycompat;
//! - vLLM's message parsing: content parts of the text kinds (`text`, `input_text`,
//!   `output_text`, `refusal`, `thinking`) joined with `"\n"` in the "string" content
//!   format or kept as `{"type": "text", "text": …}` parts in the "openai" one (picked,
//!   like vLLM, by whether the template loops over a message's `content`); `null`
//!   content as empty; tool results' text parts joined; `name`, `tool_call_id`,
//!   `reasoning` carried; tool-call `arguments` decoded from their JSON string (invalid
//!   or non-object JSON becomes `{}`); `developer` messages turned into one leading
//!   `system` message when the template does not know that role;
//! - the variables `transformers` passes: `messages`, `tools`, `documents`,
//!   `add_generation_prompt` (default true), the tokenizer's special tokens
//!   (`bos_token`, …), the request's `chat_template_kwargs`, and vLLM's
//!   `continue_final_message` cut after the last message.
//!
//! Requests this cannot mirror are refused with [`Untokenizable`] and routed by the
//! approximate tree: media parts, a per-request `chat_template`, prompt truncation.

use std::collections::BTreeMap;
use std::sync::Arc;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};
use serde::Deserialize;

/// Why a request's tokens cannot be worked out as the engine will see them.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Untokenizable {
    /// The body is not the endpoint's JSON shape.
    #[error("body is not a {0} request")]
    Shape(&'static str),
    /// Images, audio or other media change the prompt in engine-specific ways.
    #[error("media content parts")]
    Media,
    /// The request asks for something the router does not mirror (named field).
    #[error("`{0}` is not mirrored by the router")]
    Unsupported(&'static str),
    /// The chat template failed on this request (the engine will most likely answer 400).
    #[error("chat template: {0}")]
    Template(String),
    /// Text the tokenizer rejected.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
}

/// How the template reads a message's `content`: a config value
/// (`precise.chat_template_content_format`).
pub use crate::config::ContentFormat;

/// The chat-completions fields that change the rendered prompt.
#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Value>,
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    #[serde(default)]
    pub documents: Option<Value>,
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
    #[serde(default)]
    pub continue_final_message: Option<bool>,
    /// `None` = the endpoint's default (false for chat).
    #[serde(default)]
    pub add_special_tokens: Option<bool>,
    #[serde(default)]
    pub chat_template_kwargs: Option<Value>,
    #[serde(default)]
    pub reasoning_effort: Option<String>,
    #[serde(default)]
    pub chat_template: Option<Value>,
    #[serde(default)]
    pub truncate_prompt_tokens: Option<Value>,
}

/// A compiled chat template and what rendering needs besides the request.
pub struct ChatTemplate {
    env: Environment<'static>,
    format: ContentFormat,
    /// Whether the template mentions the `developer` role (vLLM's test: the quoted word).
    developer_role: bool,
    /// The tokenizer's named special tokens (`bos_token` → `<s>`), passed to the template.
    special: Arc<[(String, String)]>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("format", &self.format)
            .field("developer_role", &self.developer_role)
            .finish_non_exhaustive()
    }
}

const TEMPLATE_NAME: &str = "chat";

/// Marker `transformers` appends to the final message for `continue_final_message`.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

impl ChatTemplate {
    /// Compiles `source`. `special` are the tokenizer's named special tokens.
    /// Errors: the template's syntax error, with its line.
    pub fn new(
        source: String,
        format: ContentFormat,
        special: Vec<(String, String)>,
    ) -> Result<Self, String> {
        let format = match format {
            ContentFormat::Auto => detect_content_format(&source),
            f => f,
        };
        let developer_role = source.contains("\"developer\"") || source.contains("'developer'");
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| e.to_string())?,
        );
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        // Jinja2 prints values the way Python's str() does (`None`, `True`, `1e-07`,
        // `['a', 1]`), and its `iterable`/`sequence` tests follow Python's protocols.
        env.set_formatter(|out, _state, value| {
            out.write_str(&python_str(value))
                .map_err(|_| Error::new(ErrorKind::WriteFailure, "write failed"))
        });
        env.add_filter("string", |v: &Value| python_str(v));
        env.add_test("iterable", |v: &Value| {
            matches!(
                v.kind(),
                ValueKind::Undefined
                    | ValueKind::String
                    | ValueKind::Bytes
                    | ValueKind::Seq
                    | ValueKind::Map
                    | ValueKind::Iterable
            )
        });
        env.add_test("sequence", |v: &Value| {
            matches!(
                v.kind(),
                ValueKind::String | ValueKind::Bytes | ValueKind::Seq | ValueKind::Map
            )
        });
        env.add_template_owned(TEMPLATE_NAME, jinja2_source(&source))
            .map_err(|e| format!("{e:#}"))?;
        Ok(ChatTemplate {
            env,
            format,
            developer_role,
            special: special.into(),
        })
    }

    /// Renders a one-message chat (`[{"role": "user", "content": "Hello"}]`, with an
    /// empty `tools` list when `with_tools`), the least any usable template renders;
    /// its error otherwise.
    pub fn probe(&self, with_tools: bool) -> Result<(), Untokenizable> {
        let body = if with_tools {
            r#"{"messages": [{"role": "user", "content": "Hello"}], "tools": []}"#
        } else {
            r#"{"messages": [{"role": "user", "content": "Hello"}]}"#
        };
        let req: ChatRequest =
            serde_json::from_str(body).map_err(|_| Untokenizable::Shape("chat completions"))?;
        self.render(&req).map(drop)
    }

    /// The content format in use (after detection).
    pub fn content_format(&self) -> ContentFormat {
        self.format
    }

    /// The prompt text the engine will tokenize for `req`.
    pub fn render(&self, req: &ChatRequest) -> Result<String, Untokenizable> {
        if req.chat_template.as_ref().is_some_and(|v| !v.is_none()) {
            return Err(Untokenizable::Unsupported("chat_template"));
        }
        if req
            .truncate_prompt_tokens
            .as_ref()
            .is_some_and(|v| !v.is_none())
        {
            return Err(Untokenizable::Unsupported("truncate_prompt_tokens"));
        }
        let mut messages = req
            .messages
            .iter()
            .map(|m| self.message(m))
            .collect::<Result<Vec<_>, _>>()?;
        if !self.developer_role && messages.iter().any(|m| m.role == "developer") {
            messages = developer_to_system(messages);
        }
        // Template variables, lowest precedence first: `transformers` puts the request's
        // kwargs over the special tokens; vLLM (`build_chat_params`, `merge_kwargs`) puts
        // its own request fields over `chat_template_kwargs`.
        let mut vars: BTreeMap<String, Value> = self
            .special
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        if let Some(kw) = req.chat_template_kwargs.as_ref().filter(|v| !v.is_none()) {
            if kw.kind() != ValueKind::Map {
                return Err(Untokenizable::Shape("chat completions"));
            }
            for k in kw
                .try_iter()
                .map_err(|_| Untokenizable::Shape("chat completions"))?
            {
                let Some(name) = k.as_str() else { continue };
                if matches!(name, "chat_template" | "tokenize") {
                    return Err(Untokenizable::Unsupported("chat_template_kwargs"));
                }
                vars.insert(name.to_owned(), kw.get_item(&k).unwrap_or_default());
            }
        }
        let continue_final = req.continue_final_message.unwrap_or(false);
        vars.insert(
            "add_generation_prompt".into(),
            Value::from(req.add_generation_prompt.unwrap_or(true)),
        );
        vars.insert("continue_final_message".into(), Value::from(continue_final));
        if let Some(effort) = req.reasoning_effort.as_deref().filter(|e| *e != "auto") {
            vars.insert("reasoning_effort".into(), Value::from(effort));
            let user_set = req.chat_template_kwargs.as_ref().is_some_and(|kw| {
                kw.get_attr("enable_thinking")
                    .is_ok_and(|v| !v.is_undefined())
            });
            if !user_set {
                vars.insert("enable_thinking".into(), Value::from(effort != "none"));
            }
        }
        let tools = req
            .tools
            .as_ref()
            .map(|t| Value::from(t.iter().map(tool_schema).collect::<Vec<_>>()));
        vars.insert("tools".into(), tools.unwrap_or(Value::from(())));
        vars.insert(
            "documents".into(),
            req.documents.clone().unwrap_or(Value::from(())),
        );
        let final_text = if continue_final {
            let Some(last) = messages.last_mut() else {
                return Err(Untokenizable::Template(
                    "continue_final_message with no messages".into(),
                ));
            };
            Some(last.tag_final()?)
        } else {
            None
        };
        let messages: Vec<Value> = messages.into_iter().map(Message::into_value).collect();
        vars.insert("messages".into(), Value::from(messages));
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| Untokenizable::Template(e.to_string()))?;
        let mut out = tmpl
            .render(Value::from(vars))
            .map_err(|e| Untokenizable::Template(format!("{e:#}")))?;
        if let Some(final_text) = final_text {
            // transformers `render_jinja_template`: cut at the tag, after the message.
            let tag = CONTINUE_TAG.trim();
            let (Some(at), true) = (out.rfind(tag), out.contains(final_text.trim())) else {
                return Err(Untokenizable::Template(
                    "continue_final_message: the final message is not in the rendered chat".into(),
                ));
            };
            if out[at..].starts_with(CONTINUE_TAG) {
                out.truncate(at);
            } else {
                out.truncate(at);
                out.truncate(out.trim_end().len());
            }
        }
        Ok(out)
    }

    /// One request message as vLLM hands it to the template.
    fn message(&self, m: &Value) -> Result<Message, Untokenizable> {
        if m.kind() != ValueKind::Map {
            return Err(Untokenizable::Shape("chat completions"));
        }
        let role = get(m, "role")
            .as_str()
            .map(str::to_owned)
            .ok_or(Untokenizable::Shape("chat completions"))?;
        let content = get(m, "content");
        let mut texts: Vec<String> = Vec::new();
        match content.kind() {
            ValueKind::Undefined | ValueKind::None => {}
            ValueKind::String => texts.push(content.as_str().unwrap_or_default().to_owned()),
            ValueKind::Seq => {
                for part in content
                    .try_iter()
                    .map_err(|_| Untokenizable::Shape("chat completions"))?
                {
                    if let Some(t) = text_part(&part)? {
                        texts.push(t);
                    }
                }
            }
            _ => return Err(Untokenizable::Shape("chat completions")),
        }
        if role == "system" {
            texts = strip_billing_header(texts);
        }
        let mut extra: Vec<(&'static str, Value)> = Vec::new();
        let mut content = match self.format {
            ContentFormat::OpenAi => Content::Parts(texts),
            _ => Content::Text(texts.join("\n")),
        };
        match role.as_str() {
            "assistant" => {
                let calls = get(m, "tool_calls");
                if !calls.is_none()
                    && !calls.is_undefined()
                    && let Some(calls) = tool_calls(&calls)?
                {
                    extra.push(("tool_calls", calls));
                }
                let reasoning = get(m, "reasoning");
                if !reasoning.is_none() && !reasoning.is_undefined() {
                    extra.push(("reasoning", reasoning.clone()));
                    extra.push(("reasoning_content", reasoning));
                }
            }
            "tool" => {
                let id = get(m, "tool_call_id");
                if !id.is_undefined() {
                    extra.push(("tool_call_id", id));
                }
                // vLLM: a tool result's text parts become one string in every format.
                if let Content::Parts(parts) = content {
                    content = Content::Text(parts.join("\n"));
                }
            }
            _ => {}
        }
        for key in ["name", "task"] {
            let v = get(m, key);
            if v.kind() == ValueKind::String {
                extra.push((key, v));
            }
        }
        if role == "developer" {
            let tools = get(m, "tools");
            extra.push((
                "tools",
                if tools.is_undefined() {
                    Value::from(())
                } else {
                    tools
                },
            ));
        }
        Ok(Message {
            role,
            content,
            extra,
        })
    }
}

/// A message's content as the template sees it.
#[derive(Debug, Clone)]
enum Content {
    Text(String),
    Parts(Vec<String>),
}

#[derive(Debug, Clone)]
struct Message {
    role: String,
    content: Content,
    extra: Vec<(&'static str, Value)>,
}

impl Message {
    /// Appends `transformers`' continue tag to the last text of this (final) message;
    /// returns that text before the tag.
    fn tag_final(&mut self) -> Result<String, Untokenizable> {
        let text = match &mut self.content {
            Content::Text(t) => t,
            Content::Parts(parts) => parts.last_mut().ok_or_else(|| {
                Untokenizable::Template("continue_final_message: no text to continue".into())
            })?,
        };
        let before = text.clone();
        text.push_str(CONTINUE_TAG);
        Ok(before)
    }

    fn into_value(self) -> Value {
        let content = match self.content {
            Content::Text(t) => Value::from(t),
            Content::Parts(parts) => Value::from(
                parts
                    .into_iter()
                    .map(|t| {
                        Value::from_pairs([("type", Value::from("text")), ("text", Value::from(t))])
                    })
                    .collect::<Vec<_>>(),
            ),
        };
        let mut pairs: Vec<(&str, Value)> =
            vec![("role", Value::from(self.role)), ("content", content)];
        pairs.extend(self.extra);
        Value::from_pairs(pairs)
    }
}

fn empty_map() -> Value {
    Value::from_pairs(std::iter::empty::<(&str, Value)>())
}

/// `m[key]`, undefined when absent.
fn get(m: &Value, key: &str) -> Value {
    m.get_attr(key).unwrap_or_default()
}

/// The text of one content part; `None` for a text part with null text (vLLM skips
/// it); [`Untokenizable::Media`] for anything else.
fn text_part(part: &Value) -> Result<Option<String>, Untokenizable> {
    if let Some(s) = part.as_str() {
        return Ok(Some(s.to_owned()));
    }
    if part.kind() != ValueKind::Map {
        return Err(Untokenizable::Shape("chat completions"));
    }
    let kind = get(part, "type");
    let field = match kind.as_str().unwrap_or("text") {
        "text" | "input_text" | "output_text" => "text",
        "refusal" => "refusal",
        "thinking" => "thinking",
        _ => return Err(Untokenizable::Media),
    };
    let text = get(part, field);
    match text.kind() {
        ValueKind::String => Ok(Some(text.as_str().unwrap_or_default().to_owned())),
        ValueKind::None | ValueKind::Undefined => Ok(None),
        _ => Err(Untokenizable::Shape("chat completions")),
    }
}

/// vLLM drops Claude Code's per-request attribution line from system text, so the
/// prompt stays cacheable (`_strip_claude_code_billing_header`).
fn strip_billing_header(texts: Vec<String>) -> Vec<String> {
    const HEADER: &str = "x-anthropic-billing-header";
    texts
        .into_iter()
        .filter_map(|t| {
            if !t.starts_with(HEADER) {
                return Some(t);
            }
            let rest = t.split_once('\n').map(|(_, r)| r).unwrap_or("");
            (!rest.is_empty()).then(|| rest.to_owned())
        })
        .collect()
}

/// Tool calls with their `arguments` decoded (vLLM `_postprocess_messages`) and keys in
/// the order vLLM's request model declares them (`id`, `function`, `type`;
/// `arguments`, `name`), which is the order `tojson` writes. `None` for an empty list.
fn tool_calls(calls: &Value) -> Result<Option<Value>, Untokenizable> {
    if calls.kind() != ValueKind::Seq {
        return Ok(Some(calls.clone()));
    }
    let mut out = Vec::new();
    for call in calls
        .try_iter()
        .map_err(|_| Untokenizable::Shape("chat completions"))?
    {
        let function = get(&call, "function");
        let kind = get(&call, "type");
        if call.kind() != ValueKind::Map
            || function.kind() != ValueKind::Map
            || !(kind.is_undefined() || kind.as_str() == Some("function"))
        {
            return Err(Untokenizable::Template(
                "tool_calls must be function calls".into(),
            ));
        }
        let args = get(&function, "arguments");
        let args = if !args.is_true() {
            empty_map()
        } else if args.kind() == ValueKind::Map {
            args
        } else if let Some(s) = args.as_str() {
            serde_json::from_str::<Value>(s)
                .ok()
                .filter(|v| v.kind() == ValueKind::Map)
                .unwrap_or_else(empty_map)
        } else {
            empty_map()
        };
        let function = reorder(&function, &["arguments", "name"], Some(("arguments", args)));
        let call = reorder(
            &call,
            &["id", "function", "type"],
            Some(("function", function)),
        );
        out.push(call);
    }
    Ok((!out.is_empty()).then(|| Value::from(out)))
}

/// A tool definition as vLLM hands it to the template: `tool.model_dump()` of its
/// request model (vLLM 0.32 `ChatCompletionToolsParam` and `FunctionDefinition`, with
/// their serializers): only the model's fields, in their order (`type`, `function`,
/// `defer_loading`; `name`, `description`, `parameters`, `strict`, `defer_loading`);
/// `description` and `parameters` kept as `null` when absent, `strict` and
/// `defer_loading` dropped when absent; a tool-level `defer_loading` copied into the
/// function when it has none.
fn tool_schema(tool: &Value) -> Value {
    let function = get(tool, "function");
    if tool.kind() != ValueKind::Map || function.kind() != ValueKind::Map {
        return tool.clone();
    }
    let given = |v: Value| (!v.is_undefined() && !v.is_none()).then_some(v);
    let or_none = |v: Value| if v.is_undefined() { Value::from(()) } else { v };
    let tool_defer = given(get(tool, "defer_loading"));
    let mut f: Vec<(&str, Value)> = vec![
        ("name", or_none(get(&function, "name"))),
        ("description", or_none(get(&function, "description"))),
        ("parameters", or_none(get(&function, "parameters"))),
    ];
    if let Some(strict) = given(get(&function, "strict")) {
        f.push(("strict", strict));
    }
    if let Some(defer) = given(get(&function, "defer_loading")).or_else(|| tool_defer.clone()) {
        f.push(("defer_loading", defer));
    }
    let kind = given(get(tool, "type")).unwrap_or_else(|| Value::from("function"));
    let mut t: Vec<(&str, Value)> = vec![("type", kind), ("function", Value::from_pairs(f))];
    if let Some(defer) = tool_defer {
        t.push(("defer_loading", defer));
    }
    Value::from_pairs(t)
}

/// `map` with `first` keys leading in that order, then the others; `replace` swaps one
/// key's value. Keys whose value is `null` are dropped (pydantic's `exclude_none`).
fn reorder(map: &Value, first: &[&str], replace: Option<(&str, Value)>) -> Value {
    let mut pairs: Vec<(Value, Value)> = Vec::new();
    let value_of = |k: &str| match &replace {
        Some((rk, rv)) if *rk == k => rv.clone(),
        _ => get(map, k),
    };
    for k in first {
        let v = value_of(k);
        if !v.is_undefined() && !v.is_none() {
            pairs.push((Value::from(*k), v));
        }
    }
    if let Ok(keys) = map.try_iter() {
        for k in keys {
            if k.as_str().is_some_and(|s| first.contains(&s)) {
                continue;
            }
            let v = map.get_item(&k).unwrap_or_default();
            if !v.is_none() {
                pairs.push((k, v));
            }
        }
    }
    Value::from_pairs(pairs)
}

/// vLLM `_convert_developer_to_system` + `_consolidate_system_messages`: developer
/// messages become system ones, and all system texts merge into one leading message
/// (joined with a blank line) when there is more than one or one not first.
fn developer_to_system(messages: Vec<Message>) -> Vec<Message> {
    let mut messages: Vec<Message> = messages
        .into_iter()
        .map(|mut m| {
            if m.role == "developer" {
                m.role = "system".into();
                m.extra.retain(|(k, _)| *k != "tools");
            }
            m
        })
        .collect();
    let systems: Vec<usize> = (0..messages.len())
        .filter(|&i| messages[i].role == "system")
        .collect();
    if systems.is_empty() || systems == [0] {
        return messages;
    }
    let mut texts = Vec::new();
    let mut rest = Vec::new();
    for m in messages.drain(..) {
        if m.role == "system" {
            let text = match m.content {
                Content::Text(t) => t,
                Content::Parts(p) => p.join("\n"),
            };
            if !text.is_empty() {
                texts.push(text);
            }
        } else {
            rest.push(m);
        }
    }
    let merged = Message {
        role: "system".into(),
        content: Content::Text(texts.join("\n\n")),
        extra: Vec::new(),
    };
    std::iter::once(merged).chain(rest).collect()
}

/// vLLM `_detect_content_format`, on the template's text instead of its syntax tree:
/// "openai" when a `{% for … in X %}` loops over a message's content (`X` is
/// `<name>['content']`, `<name>["content"]`, `<name>.content`, or a variable named
/// `content`), "string" otherwise.
pub fn detect_content_format(source: &str) -> ContentFormat {
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let after = &rest[start + 2..];
        let end = after.find("%}").unwrap_or(after.len());
        let tag = after[..end].trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        rest = &after[end..];
        let Some(head) = tag.strip_prefix("for ") else {
            continue;
        };
        let Some((_, iter)) = head.split_once(" in ") else {
            continue;
        };
        let iter = iter
            .split(" if ")
            .next()
            .unwrap_or(iter)
            .split('|')
            .next()
            .unwrap_or(iter)
            .trim_end_matches(" recursive")
            .trim();
        let compact: String = iter.chars().filter(|c| !c.is_whitespace()).collect();
        if compact == "content"
            || compact.ends_with("['content']")
            || compact.ends_with("[\"content\"]")
            || compact.ends_with(".content")
        {
            return ContentFormat::OpenAi;
        }
    }
    ContentFormat::String
}

/// `raise_exception(message)`: a template's own refusal.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// The template text as Jinja2 reads it: newlines normalised to `\n` (Jinja2's
/// `newline_sequence`; vLLM also reads template files with universal newlines), and
/// `transformers`' `{% generation %}…{% endgeneration %}` marker blocks (which only
/// record assistant spans) turned into plain blocks that render their body.
fn jinja2_source(source: &str) -> String {
    let text = source.replace("\r\n", "\n").replace('\r', "\n");
    let mut out = String::with_capacity(text.len());
    let mut rest = text.as_str();
    while let Some(start) = rest.find("{%") {
        let Some(len) = rest[start..].find("%}") else {
            break;
        };
        let tag = &rest[start..start + len + 2];
        let inner =
            tag[2..tag.len() - 2].trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        out.push_str(&rest[..start]);
        match inner {
            "generation" => out.push_str(&tag.replacen("generation", "if true", 1)),
            "endgeneration" => out.push_str(&tag.replacen("endgeneration", "endif", 1)),
            _ => out.push_str(tag),
        }
        rest = &rest[start + len + 2..];
    }
    out.push_str(rest);
    out
}

/// Python's `str(value)`, which is what Jinja2 prints for `{{ value }}` and `|string`:
/// `None`, `True`/`False`, floats as Python writes them, containers as their `repr`.
/// Undefined prints nothing.
fn python_str(v: &Value) -> String {
    match v.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::String => v.as_str().unwrap_or_default().to_owned(),
        _ => python_repr(v),
    }
}

/// Python's `repr(value)`.
fn python_repr(v: &Value) -> String {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => "None".into(),
        ValueKind::Bool => if v.is_true() { "True" } else { "False" }.into(),
        ValueKind::Number if !v.is_integer() => {
            python_float(f64::try_from(v.clone()).unwrap_or(f64::NAN))
                .replace("Infinity", "inf")
                .replace("NaN", "nan")
        }
        ValueKind::String => python_string_repr(v.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<String> = v
                .try_iter()
                .map(|i| i.map(|x| python_repr(&x)).collect())
                .unwrap_or_default();
            format!("[{}]", items.join(", "))
        }
        ValueKind::Map => {
            let items: Vec<String> = v
                .try_iter()
                .map(|keys| {
                    keys.map(|k| {
                        let item = v.get_item(&k).unwrap_or_default();
                        format!("{}: {}", python_repr(&k), python_repr(&item))
                    })
                    .collect()
                })
                .unwrap_or_default();
            format!("{{{}}}", items.join(", "))
        }
        _ => v.to_string(),
    }
}

/// Python's `repr(str)`: single quotes unless the text has `'` and no `"`; escapes
/// for backslashes, the quote, `\n \r \t`, and characters Python does not print
/// (controls, format characters, separators other than the space, private use; the
/// unassigned code points Python also escapes are not known here).
fn python_string_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if !python_printable(c) => {
                let n = c as u32;
                if n < 0x100 {
                    out.push_str(&format!("\\x{n:02x}"));
                } else if n < 0x10000 {
                    out.push_str(&format!("\\u{n:04x}"));
                } else {
                    out.push_str(&format!("\\U{n:08x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// `str.isprintable()` for one character, from the Unicode categories Python treats as
/// non-printable (Cc, Cf, Zl, Zp, Zs but the space, Co), without unassigned ones.
fn python_printable(c: char) -> bool {
    let n = c as u32;
    !(c.is_control()
        || matches!(
            n,
            0xa0 | 0xad
                | 0x600..=0x605
                | 0x61c
                | 0x6dd
                | 0x70f
                | 0x8e2
                | 0x1680
                | 0x180e
                | 0x2000..=0x200f
                | 0x2028..=0x202f
                | 0x205f..=0x2064
                | 0x2066..=0x206f
                | 0x3000
                | 0xe000..=0xf8ff
                | 0xfeff
                | 0xfff9..=0xfffb
                | 0x110bd
                | 0x110cd
                | 0x13430..=0x1343f
                | 0x1bca0..=0x1bca3
                | 0x1d173..=0x1d17a
                | 0xe0001
                | 0xe0020..=0xe007f
                | 0xf0000..=0x10ffff
        ))
}

/// `strftime_now(format)`: the current date and time, like Python's
/// `datetime.now().strftime(format)` (Llama 3.x templates put today's date in the
/// system header). UTC.
fn strftime_now(format: String) -> Result<Value, Error> {
    use std::fmt::Write;
    let mut out = String::new();
    write!(out, "{}", chrono::Utc::now().format(&format)).map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: bad format {format:?}"),
        )
    })?;
    Ok(Value::from(out))
}

/// `tojson` as `transformers` defines it: `json.dumps(x, ensure_ascii=False,
/// indent=None, separators=None, sort_keys=False)`.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let (item_sep, key_sep) = match &separators {
        Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "separators must be a pair",
            ));
        }
        None if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    let mut out = String::new();
    let style = JsonStyle {
        indent,
        item_sep: &item_sep,
        key_sep: &key_sep,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    style.write(value, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

/// Python `json.dumps` layout.
struct JsonStyle<'a> {
    indent: Option<usize>,
    item_sep: &'a str,
    key_sep: &'a str,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl JsonStyle<'_> {
    /// Writes `v` in this style; values are walked in their own key order (what a
    /// Python dict keeps), so requests' JSON objects come out as the client wrote them.
    fn write(&self, v: &Value, depth: usize, out: &mut String) -> Result<(), Error> {
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => {
                if v.is_integer() {
                    out.push_str(&v.to_string());
                } else {
                    let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
                    out.push_str(&python_float(f));
                }
            }
            ValueKind::String | ValueKind::Bytes => {
                self.string(v.as_str().unwrap_or_default(), out)
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = v.try_iter()?.collect();
                if keys.is_empty() {
                    out.push_str("{}");
                    return Ok(());
                }
                if self.sort_keys {
                    keys.sort();
                }
                out.push('{');
                for (i, k) in keys.iter().enumerate() {
                    self.separator(i == 0, depth + 1, out);
                    match k.as_str() {
                        Some(s) => self.string(s, out),
                        None => self.string(&k.to_string(), out),
                    }
                    out.push_str(self.key_sep);
                    self.write(&v.get_item(k)?, depth + 1, out)?;
                }
                self.close(depth, out);
                out.push('}');
            }
            _ => {
                let items: Vec<Value> = v.try_iter()?.collect();
                if items.is_empty() {
                    out.push_str("[]");
                    return Ok(());
                }
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    self.separator(i == 0, depth + 1, out);
                    self.write(item, depth + 1, out)?;
                }
                self.close(depth, out);
                out.push(']');
            }
        }
        Ok(())
    }

    fn separator(&self, first: bool, depth: usize, out: &mut String) {
        if !first {
            out.push_str(self.item_sep);
        }
        if let Some(n) = self.indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    }

    fn close(&self, depth: usize, out: &mut String) {
        if let Some(n) = self.indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    }

    fn string(&self, s: &str, out: &mut String) {
        if !self.ensure_ascii {
            out.push_str(&serde_json::to_string(s).unwrap_or_default());
            return;
        }
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (c as u32) > 0x7e => {
                    let mut buf = [0u16; 2];
                    for unit in c.encode_utf16(&mut buf) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// Python's `repr(float)`: shortest round-trip digits, always a `.0` or an exponent.
fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    let abs = f.abs();
    if abs != 0.0 && !(1e-4..1e16).contains(&abs) {
        // 1e-05, 1e+16: Python's exponent has a sign and at least two digits.
        let s = format!("{f:e}");
        let (mantissa, exp) = s.split_once('e').unwrap_or((&s, "0"));
        let exp: i32 = exp.parse().unwrap_or(0);
        let sign = if exp < 0 { '-' } else { '+' };
        return format!("{mantissa}e{sign}{:02}", exp.abs());
    }
    let s = f.to_string();
    if s.contains('.') { s } else { format!("{s}.0") }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(src: &str) -> ChatTemplate {
        ChatTemplate::new(
            src.to_owned(),
            ContentFormat::Auto,
            vec![("bos_token".into(), "<s>".into())],
        )
        .unwrap()
    }

    fn req(json: &str) -> ChatRequest {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn content_format_follows_loops_over_content() {
        assert_eq!(
            detect_content_format("{{ m['content'] }}"),
            ContentFormat::String
        );
        for src in [
            "{% for p in message['content'] %}{% endfor %}",
            "{%- for p in msg.content -%}{% endfor %}",
            "{% for p in content if p.type == 'text' %}{% endfor %}",
            "{% for p in m[\"content\"] | list %}{% endfor %}",
        ] {
            assert_eq!(detect_content_format(src), ContentFormat::OpenAi, "{src}");
        }
    }

    #[test]
    fn tojson_writes_like_python_json_dumps() {
        let t = template(
            "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(sort_keys=true, separators=[',', ':']) }}|{{ 'é<' | tojson(ensure_ascii=true) }}",
        );
        let x: Value =
            serde_json::from_str(r#"{"b": [1, 2.5, 1e-7, true, null], "a": "ü<&>", "e": {}}"#)
                .unwrap();
        let out = t
            .env
            .get_template(TEMPLATE_NAME)
            .unwrap()
            .render(minijinja::context! { x => x })
            .unwrap();
        assert_eq!(
            out,
            "{\"b\": [1, 2.5, 1e-07, true, null], \"a\": \"ü<&>\", \"e\": {}}|{\n  \"b\": [\n    1,\n    2.5,\n    1e-07,\n    true,\n    null\n  ],\n  \"a\": \"ü<&>\",\n  \"e\": {}\n}|{\"a\":\"ü<&>\",\"b\":[1,2.5,1e-07,true,null],\"e\":{}}|\"\\u00e9<\""
        );
    }

    #[test]
    fn python_float_repr() {
        for (f, s) in [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (1e-5, "1e-05"),
            (1e16, "1e+16"),
            (123456.789, "123456.789"),
            (-0.0001, "-0.0001"),
        ] {
            assert_eq!(python_float(f), s);
        }
    }

    #[test]
    fn string_format_joins_text_parts_and_nulls_are_empty() {
        let t = template(
            "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}{% if add_generation_prompt %}>{% endif %}",
        );
        assert_eq!(t.content_format(), ContentFormat::String);
        let out = t
            .render(&req(r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": null}, "b"]}, {"role": "assistant", "content": null}]}"#))
            .unwrap();
        assert_eq!(out, "[user:a\nb][assistant:]>");
    }

    #[test]
    fn media_and_per_request_templates_are_refused() {
        let t = template("{{ messages }}");
        assert_eq!(
            t.render(&req(r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}"#)),
            Err(Untokenizable::Media)
        );
        assert_eq!(
            t.render(&req(r#"{"messages": [], "chat_template": "{{ 1 }}"}"#)),
            Err(Untokenizable::Unsupported("chat_template"))
        );
    }

    #[test]
    fn strftime_now_formats_today() {
        let t = template(
            "{{ strftime_now('%d %b %Y') }}|{% if strftime_now is defined %}yes{% endif %}",
        );
        let out = t.render(&req(r#"{"messages": []}"#)).unwrap();
        let today = chrono::Utc::now().format("%d %b %Y").to_string();
        assert_eq!(out, format!("{today}|yes"));
        let bad = template("{{ strftime_now('%Q') }}");
        assert!(matches!(
            bad.render(&req(r#"{"messages": []}"#)),
            Err(Untokenizable::Template(_))
        ));
    }

    #[test]
    fn values_print_as_python_does() {
        let t = template(
            "{{ none }}|{{ true }}|{{ 1e-7 }}|{{ 1e21 }}|{{ 2.5 }}|{{ 3 }}|{{ [1e-7, 'a', none, false] }}|{{ {'k': \"it's\"} }}|{{ ['\u{2028}', '\u{a0}'] }}|{{ 1e-7|string }}|{{ undefined_name }}",
        );
        let out = t.render(&req(r#"{"messages": []}"#)).unwrap();
        assert_eq!(
            out,
            "None|True|1e-07|1e+21|2.5|3|[1e-07, 'a', None, False]|{'k': \"it's\"}|['\\u2028', '\\xa0']|1e-07|"
        );
    }

    #[test]
    fn iterable_and_sequence_follow_python() {
        let t = template(
            "{{ none is iterable }} {{ 'a' is iterable }} {{ [] is iterable }} {{ 1 is iterable }} {{ 'a' is sequence }} {{ {} is sequence }} {{ none is sequence }}",
        );
        let out = t.render(&req(r#"{"messages": []}"#)).unwrap();
        assert_eq!(out, "False True True False True True False");
        // The pattern real templates use on `tools`, which is None without tools.
        let t =
            template("{% if tools is iterable and tools | length > 0 %}T{% else %}N{% endif %}");
        assert_eq!(t.render(&req(r#"{"messages": []}"#)).unwrap(), "N");
    }

    #[test]
    fn crlf_and_generation_blocks_read_as_jinja2_does() {
        let t = template(
            "A\r\n{{ 'x' }}\r\n{%- generation -%} g {%- endgeneration %}\n{% generation %}h{% endgeneration %}",
        );
        assert_eq!(t.render(&req(r#"{"messages": []}"#)).unwrap(), "A\nxgh");
    }

    #[test]
    fn tools_are_shaped_like_vllm_model_dump() {
        let t = template("{{ tools | tojson }}");
        let out = t
            .render(&req(r#"{"messages": [], "tools": [{"type": "function", "x_extra": 1, "defer_loading": true, "function": {"name": "n", "return": "str", "strict": null}}]}"#))
            .unwrap();
        assert_eq!(
            out,
            r#"[{"type": "function", "function": {"name": "n", "description": null, "parameters": null, "defer_loading": true}, "defer_loading": true}]"#
        );
    }

    #[test]
    fn raise_exception_is_a_template_error() {
        let t = template("{{ raise_exception('no system role') }}");
        let err = t.render(&req(r#"{"messages": []}"#)).unwrap_err();
        assert!(
            matches!(&err, Untokenizable::Template(m) if m.contains("no system role")),
            "{err:?}"
        );
    }
}

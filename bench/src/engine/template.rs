//! Request bodies to prompt text: the chat template, Anthropic Messages to chat
//! messages (as vLLM converts them), and the `prompt` shapes of `/v1/completions`.

use serde_json::{Map, Value, json};

/// The chat template: `<|im_start|>ROLE\nCONTENT\n<|im_end|>\n` per message, then
/// the generation prompt `<|im_start|>assistant\n`. Content may be a string, null,
/// or an array of parts (text parts in order; other parts become `<TYPE>`); tool
/// calls add their function name and arguments.
pub fn chat_template(messages: Option<&Value>) -> Result<String, String> {
    chat_template_with(messages, true)
}

/// The prompt of a chat request body (`messages`) as vLLM renders it, honouring its
/// chat-template options: `add_generation_prompt` (default true) ends the prompt with
/// the assistant's turn opened; `continue_final_message` (default false) leaves the
/// last message open instead (no end of turn, no generation prompt), so the answer
/// continues it. Both true is refused, as vLLM does.
pub fn chat_prompt(req: &Map<String, Value>) -> Result<String, String> {
    let flag = |k: &str, default: bool| match req.get(k) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(format!("{k} must be a boolean")),
    };
    let add = flag("add_generation_prompt", true)?;
    if !flag("continue_final_message", false)? {
        return chat_template_with(req.get("messages"), add);
    }
    if add {
        return Err(
            "Cannot set both `continue_final_message` and `add_generation_prompt` \
                    to True (send add_generation_prompt: false)"
                .into(),
        );
    }
    let closed = chat_template_with(req.get("messages"), false)?;
    Ok(closed
        .strip_suffix(END_OF_TURN)
        .unwrap_or(&closed)
        .to_owned())
}

/// What closes each message of the template.
const END_OF_TURN: &str = "\n<|im_end|>\n";

/// [`chat_template`], with the trailing generation prompt only when
/// `add_generation_prompt` (vLLM's `/tokenize` option of that name).
pub fn chat_template_with(
    messages: Option<&Value>,
    add_generation_prompt: bool,
) -> Result<String, String> {
    let list = messages
        .and_then(Value::as_array)
        .ok_or("messages must be an array of messages")?;
    if list.is_empty() {
        return Err("messages must not be empty".into());
    }
    let mut out = String::new();
    for (i, m) in list.iter().enumerate() {
        let m = m
            .as_object()
            .ok_or_else(|| format!("messages[{i}] must be an object"))?;
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("messages[{i}].role must be a string"))?;
        out.push_str("<|im_start|>");
        out.push_str(role);
        out.push('\n');
        push_content(&mut out, m, i)?;
        out.push_str(END_OF_TURN);
    }
    if add_generation_prompt {
        out.push_str("<|im_start|>assistant\n");
    }
    Ok(out)
}

/// Text of an Anthropic `system` field or `system`-role content: a string, or the
/// text blocks of an array, concatenated.
fn anthropic_text(value: &Value, what: &str) -> Result<String, String> {
    match value {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => Ok(blocks
            .iter()
            .filter(|b| b.get("type").and_then(Value::as_str) == Some("text"))
            .filter_map(|b| b.get("text").and_then(Value::as_str))
            .collect()),
        _ => Err(format!(
            "{what} must be a string or an array of content blocks"
        )),
    }
}

/// An Anthropic Messages request as the OpenAI chat `messages` vLLM turns it into
/// (`vllm/entrypoints/anthropic`): `system` (a string or text blocks) and any
/// `system`-role messages become one leading system message; text blocks become text
/// parts (a lone one plain content), images `image_url` parts, `tool_use` blocks tool
/// calls (name + JSON arguments), a user's `tool_result` blocks `tool` messages (an
/// assistant's become "Tool result: …" text); thinking blocks are dropped.
pub fn anthropic_to_chat(req: &Map<String, Value>) -> Result<Value, String> {
    let list = req
        .get("messages")
        .and_then(Value::as_array)
        .ok_or("messages must be an array of messages")?;
    if list.is_empty() {
        return Err("messages must contain at least one item".into());
    }
    let mut system = anthropic_text(req.get("system").unwrap_or(&Value::Null), "system")?;
    let mut out: Vec<Value> = Vec::new();
    for (i, m) in list.iter().enumerate() {
        let m = m
            .as_object()
            .ok_or_else(|| format!("messages[{i}] must be an object"))?;
        let role = match m.get("role").and_then(Value::as_str) {
            Some(r @ ("user" | "assistant" | "system")) => r,
            // Claude Code's non-standard roles, mapped as vLLM does.
            Some("ctx" | "msg") => "user",
            _ => {
                return Err(format!(
                    "messages[{i}].role must be \"user\", \"assistant\" or \"system\""
                ));
            }
        };
        let content = m.get("content").unwrap_or(&Value::Null);
        if role == "system" {
            system.push_str(&anthropic_text(content, &format!("messages[{i}].content"))?);
            continue;
        }
        let blocks = match content {
            Value::String(s) => {
                out.push(json!({"role": role, "content": s}));
                continue;
            }
            Value::Array(blocks) if !blocks.is_empty() => blocks,
            Value::Array(_) => return Err(format!("messages[{i}].content must not be empty")),
            _ => {
                return Err(format!(
                    "messages[{i}].content must be a string or an array of content blocks"
                ));
            }
        };
        let mut parts: Vec<Value> = Vec::new();
        let mut calls: Vec<Value> = Vec::new();
        for (j, b) in blocks.iter().enumerate() {
            let kind = b.get("type").and_then(Value::as_str).ok_or_else(|| {
                format!("messages[{i}].content[{j}] must be a content block with a type")
            })?;
            match kind {
                "text" => {
                    if let Some(t) = b.get("text").and_then(Value::as_str).filter(|t| !t.is_empty())
                    {
                        parts.push(json!({"type": "text", "text": t}));
                    }
                }
                "image" => parts.push(json!({"type": "image_url", "image_url": {"url": ""}})),
                "tool_use" => calls.push(json!({
                    "id": b.get("id").cloned().unwrap_or(Value::Null),
                    "type": "function",
                    "function": {
                        "name": b.get("name").and_then(Value::as_str).unwrap_or(""),
                        "arguments": b.get("input").cloned().unwrap_or_else(|| json!({})).to_string(),
                    },
                })),
                "tool_result" => {
                    let text = match b.get("content") {
                        Some(Value::Array(items)) => items
                            .iter()
                            .filter_map(|x| x.get("text").and_then(Value::as_str))
                            .collect::<Vec<_>>()
                            .join("\n"),
                        Some(c) => anthropic_text(c, "tool_result.content")?,
                        None => String::new(),
                    };
                    if role == "user" {
                        out.push(json!({"role": "tool", "content": text,
                                        "tool_call_id": b.get("tool_use_id").cloned().unwrap_or(Value::Null)}));
                    } else {
                        parts.push(json!({"type": "text", "text": format!("Tool result: {text}")}));
                    }
                }
                _ => {} // thinking, redacted_thinking, document, …: not part of the prompt here
            }
        }
        let mut msg = json!({"role": role});
        if !calls.is_empty() {
            msg["tool_calls"] = Value::Array(calls);
        }
        match parts.len() {
            0 => {}
            1 if parts[0]["type"] == "text" => msg["content"] = parts[0]["text"].clone(),
            _ => msg["content"] = Value::Array(parts),
        }
        // A user turn holding only tool results is replaced by its tool messages.
        if !(role == "user" && msg.get("content").is_none() && msg.get("tool_calls").is_none()) {
            out.push(msg);
        }
    }
    if !system.is_empty() {
        out.insert(0, json!({"role": "system", "content": system}));
    }
    Ok(Value::Array(out))
}

fn push_content(out: &mut String, m: &Map<String, Value>, i: usize) -> Result<(), String> {
    match m.get("content") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => out.push_str(s),
        Some(Value::Array(parts)) => {
            for (j, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str);
                match (kind, part.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(text)) => out.push_str(text),
                    (Some(other), _) if other != "text" => {
                        out.push_str(&format!(" <{other}> "));
                    }
                    _ => {
                        return Err(format!(
                            "messages[{i}].content[{j}] must be a content part with a type"
                        ));
                    }
                }
            }
        }
        Some(_) => {
            return Err(format!(
                "messages[{i}].content must be a string or an array of content parts"
            ));
        }
    }
    if let Some(calls) = m.get("tool_calls").and_then(Value::as_array) {
        for call in calls {
            let f = call.get("function");
            for key in ["name", "arguments"] {
                if let Some(s) = f.and_then(|f| f.get(key)).and_then(Value::as_str) {
                    out.push(' ');
                    out.push_str(s);
                }
            }
        }
    }
    Ok(())
}

/// `prompt` of `/v1/completions`: a string, an array of strings, an array of
/// token ids, or an array of token-id arrays. Token ids become words ("1 2 3").
pub(super) fn completion_prompts(prompt: Option<&Value>) -> Result<Vec<String>, String> {
    const SHAPE: &str = "prompt must be a string, an array of strings, an array of token ids \
                         or an array of token-id arrays";
    let ids = |a: &[Value]| -> Result<String, String> {
        let ids: Option<Vec<String>> = a
            .iter()
            .map(|x| x.as_u64().map(|n| n.to_string()))
            .collect();
        ids.map(|v| v.join(" ")).ok_or_else(|| SHAPE.to_string())
    };
    let prompts = match prompt {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) if items.is_empty() => {
            return Err("prompt must not be empty".into());
        }
        Some(Value::Array(items)) => match &items[0] {
            Value::String(_) => items
                .iter()
                .map(|x| {
                    x.as_str()
                        .map(str::to_owned)
                        .ok_or_else(|| SHAPE.to_string())
                })
                .collect::<Result<_, _>>()?,
            Value::Number(_) => vec![ids(items)?],
            Value::Array(_) => items
                .iter()
                .map(|x| {
                    x.as_array()
                        .ok_or_else(|| SHAPE.to_string())
                        .and_then(|a| ids(a))
                })
                .collect::<Result<_, _>>()?,
            _ => return Err(SHAPE.into()),
        },
        _ => return Err(SHAPE.into()),
    };
    if prompts
        .iter()
        .any(|p| p.split_whitespace().next().is_none())
    {
        return Err("prompt must not be empty".into());
    }
    Ok(prompts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_continued_final_message_is_left_open() {
        let req = |extra: Value| {
            let mut r = json!({"messages": [{"role": "user", "content": "hi"},
                                            {"role": "assistant", "content": "Sure: one"}]});
            for (k, v) in extra.as_object().unwrap() {
                r[k] = v.clone();
            }
            r.as_object().unwrap().clone()
        };
        let open = chat_prompt(&req(
            json!({"continue_final_message": true, "add_generation_prompt": false}),
        ))
        .unwrap();
        assert!(
            open.ends_with("<|im_start|>assistant\nSure: one"),
            "{open:?}"
        );
        // The prompt the answer started from, plus the answer so far.
        let asked = chat_prompt(
            &json!({"messages": [{"role": "user", "content": "hi"}]})
                .as_object()
                .unwrap()
                .clone(),
        )
        .unwrap();
        assert_eq!(open, format!("{asked}Sure: one"));
        let closed = chat_prompt(&req(json!({"add_generation_prompt": false}))).unwrap();
        assert!(closed.ends_with("Sure: one\n<|im_end|>\n"));
        for bad in [
            json!({"continue_final_message": true}),
            json!({"continue_final_message": "yes", "add_generation_prompt": false}),
        ] {
            assert!(chat_prompt(&req(bad.clone())).is_err(), "{bad}");
        }
    }

    #[test]
    fn chat_template_reads_strings_parts_and_tool_calls() {
        let msgs = json!([
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello"},
                                         {"type": "image_url", "image_url": {"url": "x"}},
                                         {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": null,
             "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
        ]);
        let text = chat_template(Some(&msgs)).unwrap();
        let w: Vec<&str> = text.split_whitespace().collect();
        assert_eq!(
            w,
            [
                "<|im_start|>system",
                "be",
                "brief",
                "<|im_end|>",
                "<|im_start|>user",
                "hello",
                "<image_url>",
                "there",
                "<|im_end|>",
                "<|im_start|>assistant",
                "f",
                "{}",
                "<|im_end|>",
                "<|im_start|>assistant"
            ]
        );
    }
}

//! Anthropic Messages shape (`POST /v1/messages`): `tools`, `system`, then `messages`
//! (the order of Anthropic's own prompt cache, and of chat templates that render tool
//! definitions ahead of the conversation).
//!
//! `system` may be a string or a list of text blocks; blocks are joined with newlines,
//! so both spellings of the same system prompt give the same routing text. Message
//! content blocks (`text`, `tool_use`, `tool_result`, images, documents, thinking) are
//! read by the shared part reader in [`super`].

use serde::Deserialize;

use super::{Content, PromptBuilder, Text, append_content};

#[derive(Deserialize)]
struct MessagesBody<'a> {
    #[serde(borrow, default)]
    model: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow, default)]
    system: Option<Content<'a>>,
    #[serde(borrow)]
    messages: Vec<Message<'a>>,
    /// Kept unparsed: its bytes are the routing text (`prompt::tools`).
    #[serde(borrow, default)]
    tools: Option<&'a serde_json::value::RawValue>,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow, default)]
    role: Option<Text<'a>>,
    #[serde(borrow, default)]
    content: Option<Content<'a>>,
}

/// Appends `tools: <tools as sent>` (`prompt::tools`), `system: <system>`, then
/// `role: content` per message.
pub fn messages(body: &[u8], b: &mut PromptBuilder) -> bool {
    let Ok(req) = serde_json::from_slice::<MessagesBody<'_>>(body) else {
        return false;
    };
    b.model(req.model, body);
    super::tools(req.tools, b);
    if let Some(system) = &req.system {
        b.role("system");
        if !append_content(system, b) {
            return false;
        }
        b.end_message();
    }
    for m in &req.messages {
        b.role(m.role.as_deref().unwrap_or("user"));
        if let Some(c) = &m.content
            && !append_content(c, b)
        {
            return false;
        }
        b.end_message();
    }
    true
}

#[cfg(test)]
mod tests {
    use crate::prompt::{Endpoint, Source, extract};

    fn text(body: &str) -> String {
        let ctx = extract(Endpoint::Messages, body.as_bytes(), 1 << 20);
        assert_eq!(ctx.source, Source::Extracted, "{body}");
        String::from_utf8(ctx.text.into_owned()).unwrap()
    }

    const MESSAGES: &str = r#""messages":[{"role":"user","content":[{"type":"text","text":"hi"}]},{"role":"assistant","content":[{"type":"tool_use","id":"tu_1","name":"lookup","input":{"q":"x"}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"tu_1","content":[{"type":"text","text":"found"}]}]}]"#;

    #[test]
    fn system_blocks_and_string_route_alike() {
        let blocks = text(&format!(
            r#"{{"model":"m","max_tokens":16,"system":[{{"type":"text","text":"You are terse."}},{{"type":"text","text":"Reply in English.","cache_control":{{"type":"ephemeral"}}}}],{MESSAGES}}}"#
        ));
        let string = text(&format!(
            r#"{{"model":"m","max_tokens":16,"system":"You are terse.\nReply in English.",{MESSAGES}}}"#
        ));
        assert_eq!(blocks, string);
        assert_eq!(
            blocks,
            "system: You are terse.\nReply in English.\nuser: hi\nassistant: lookup {\"q\":\"x\"}\nuser: found\n"
        );
    }

    #[test]
    fn images_are_hashed_not_copied() {
        let body = r#"{"messages":[{"role":"user","content":[{"type":"image","source":{"type":"base64","media_type":"image/png","data":"AAAABBBBCCCC"}},{"type":"text","text":"What is this?"}]}]}"#;
        let t = text(body);
        assert!(
            t.starts_with("user: <image:") && t.ends_with("What is this?\n"),
            "{t}"
        );
        assert!(!t.contains("AAAABBBB"));
    }

    #[test]
    fn no_system_and_string_content() {
        assert_eq!(
            text(r#"{"messages":[{"role":"user","content":"Hello"}]}"#),
            "user: Hello\n"
        );
        assert_eq!(
            extract(Endpoint::Messages, br#"{"system":"x"}"#, 100).source,
            Source::RawBody
        );
    }
}

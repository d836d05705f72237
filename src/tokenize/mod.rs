//! A request's prompt tokens, as the engine will prefill them, for precise scoring.
//!
//! Three sources, tried in this order by [`crate::precise::Precise::lookup`]:
//! 1. the `x-token-ids` header (a client or gateway that tokenized already);
//! 2. a `/v1/completions` prompt given as token ids (nothing to tokenize);
//! 3. in-router tokenization with the model's Hugging Face tokenizer
//!    (`precise.tokenizer`): chat requests through the chat template
//!    ([`chat_template`]), completions prompts as they are, with vLLM's defaults
//!    for special tokens (added for completions, not for chat: the template writes them).
//!
//! Tokenizing costs about as much CPU as the rest of the decision put together (the BPE
//! pass runs at some tens of MB/s), so the request path runs it on tokio's blocking pool.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::value::RawValue;

pub mod chat_template;

use chat_template::{ChatRequest, ChatTemplate, ContentFormat, Untokenizable};

use crate::config::{ConfigError, DEFAULT_MAX_TOKENIZE_BYTES, PreciseConfig, TokenizerSetting};

/// The model's tokenizer and chat template, loaded once from `precise.tokenizer`.
pub struct PromptTokenizer {
    tokenizer: tokenizers::Tokenizer,
    /// `None` when no chat template was found: chat requests then fall back.
    template: Option<ChatTemplate>,
    /// The template named `tool_use`, for requests with `tools` (as `transformers`
    /// picks it), when `tokenizer_config.json` has named templates.
    tool_template: Option<ChatTemplate>,
    /// The tokenizer.json it was loaded from, for logs.
    path: PathBuf,
    /// Most bytes of prompt text encoded per request (see [`PromptTokenizer::encode`]).
    max_bytes: usize,
}

impl std::fmt::Debug for PromptTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptTokenizer")
            .field("path", &self.path)
            .field("template", &self.template)
            .field("tool_template", &self.tool_template)
            .finish_non_exhaustive()
    }
}

/// Token ids of one request's prompt.
pub type Tokens = Vec<u32>;

impl PromptTokenizer {
    /// The tokenizer `precise.tokenizer` names, loaded; `None` when none is set. A file
    /// that cannot be used is refused like a config value, at the key that named it
    /// (`precise.chat_template` for the template file given there, else
    /// `precise.tokenizer`). Precise mode loads it when it builds; startup and
    /// `--config-check` load it first, so a bad file is refused before serving.
    pub fn from_config(config: &PreciseConfig) -> Result<Option<Self>, ConfigError> {
        config
            .tokenizer
            .as_ref()
            .map(Self::from_setting)
            .transpose()
    }

    fn from_setting(s: &TokenizerSetting) -> Result<Self, ConfigError> {
        Self::load_with_limit(
            &s.path,
            s.chat_template.as_deref(),
            s.content_format,
            s.max_bytes,
        )
        .map_err(|e| match e {
            LoadError::Template(m) if s.chat_template.is_some() => s.chat_template_at.refuse(m),
            e => s.tokenizer_at.refuse(e.to_string()),
        })
    }

    /// Loads `path`: a directory holding `tokenizer.json` (a Hugging Face model folder),
    /// or a `tokenizer.json` file. The chat template is, first found: `chat_template`
    /// (a Jinja file, like vLLM's `--chat-template`), `chat_template.jinja` beside the
    /// tokenizer, or `chat_template` in `tokenizer_config.json` (a string, or a list of
    /// named ones: `default`, and `tool_use` for requests with `tools`). Special tokens (`bos_token`, …) come from
    /// `tokenizer_config.json`, else `special_tokens_map.json`.
    ///
    /// Errors: [`LoadError`], naming the file and what is wrong with it. A template is
    /// also rendered once on a one-message chat, so one that cannot render anything is
    /// refused here rather than on every request.
    pub fn load(
        path: &Path,
        chat_template: Option<&Path>,
        format: ContentFormat,
    ) -> Result<Self, LoadError> {
        Self::load_with_limit(path, chat_template, format, DEFAULT_MAX_BYTES)
    }

    /// [`PromptTokenizer::load`], encoding at most `max_bytes` bytes of each prompt.
    pub fn load_with_limit(
        path: &Path,
        chat_template: Option<&Path>,
        format: ContentFormat,
        max_bytes: usize,
    ) -> Result<Self, LoadError> {
        let (dir, file) = if path.is_dir() {
            (path.to_path_buf(), path.join("tokenizer.json"))
        } else {
            let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
            (dir, path.to_path_buf())
        };
        let tokenizer_text = read_text(&file, MAX_TOKENIZER_FILE).map_err(LoadError::Tokenizer)?;
        let tokenizer = tokenizer_text
            .parse::<tokenizers::Tokenizer>()
            .map_err(|e| {
                LoadError::Tokenizer(format!("`{}`: not a tokenizer: {e}", file.display()))
            })?;
        drop(tokenizer_text);
        let config_path = dir.join("tokenizer_config.json");
        let config = read_json(&config_path).map_err(LoadError::Tokenizer)?;
        let special_map =
            read_json(&dir.join("special_tokens_map.json")).map_err(LoadError::Tokenizer)?;
        let mut special = Vec::new();
        for name in SPECIAL_TOKENS {
            let token = [&config, &special_map]
                .into_iter()
                .flatten()
                .find_map(|c| token_text(c.get(name)?));
            if let Some(token) = token {
                special.push((name.to_string(), token));
            }
        }
        let jinja = dir.join("chat_template.jinja");
        let config_template = config.as_ref().and_then(|c| c.get("chat_template"));
        // (text, where it came from) of the default and the `tool_use` template.
        type Source = Option<(String, PathBuf)>;
        let (source, tool_source): (Source, Source) = match chat_template {
            Some(p) => (
                Some((
                    read_text(p, MAX_TEMPLATE_FILE).map_err(LoadError::Template)?,
                    p.to_path_buf(),
                )),
                None,
            ),
            None if jinja.is_file() => (
                Some((
                    read_text(&jinja, MAX_TEMPLATE_FILE).map_err(LoadError::Template)?,
                    jinja,
                )),
                None,
            ),
            None => match config_template {
                None => (None, None),
                Some(t) => {
                    let default = template_text(t, "default");
                    if default.is_none() && !t.is_array() {
                        return Err(LoadError::Template(format!(
                            "`{}`: `chat_template` is neither a string nor a list of {{name, template}}",
                            config_path.display()
                        )));
                    }
                    (
                        default.map(|s| (s, config_path.clone())),
                        template_text(t, "tool_use").map(|s| (s, config_path.clone())),
                    )
                }
            },
        };
        let compile = |s: Source, with_tools: bool| {
            s.map(|(text, from)| {
                let t = ChatTemplate::new(text, format, special.clone()).map_err(|e| {
                    LoadError::Template(format!(
                        "`{}`: the chat template does not compile: {e}",
                        from.display()
                    ))
                })?;
                t.probe(with_tools).map_err(|e| {
                    LoadError::Template(format!(
                        "`{}`: the chat template fails on a one-message chat: {e}",
                        from.display()
                    ))
                })?;
                Ok(t)
            })
            .transpose()
        };
        let template = compile(source, false)?;
        let tool_template = compile(tool_source, true)?;
        Ok(PromptTokenizer {
            tokenizer,
            template,
            tool_template,
            path: file,
            max_bytes,
        })
    }

    /// The tokenizer.json this was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether chat requests can be tokenized (a chat template was found).
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// Tokens of a `/v1/chat/completions` body: rendered, then encoded without added
    /// special tokens unless the request sets `add_special_tokens`.
    pub fn chat(&self, body: &[u8]) -> Result<Tokens, Untokenizable> {
        let req: ChatRequest =
            serde_json::from_slice(body).map_err(|_| Untokenizable::Shape("chat completions"))?;
        let template = match &self.tool_template {
            Some(t) if req.tools.is_some() => Some(t),
            _ => self.template.as_ref(),
        };
        let template = template.ok_or(Untokenizable::Unsupported(
            "chat template (none configured)",
        ))?;
        let text = template.render(&req)?;
        self.encode(&text, req.add_special_tokens.unwrap_or(false))
    }

    /// Tokens of a `/v1/completions` body with one text prompt (token-id prompts are
    /// read by [`completion_prompt_ids`]); special tokens added unless the request says
    /// `add_special_tokens: false`.
    pub fn completion(&self, body: &[u8]) -> Result<Tokens, Untokenizable> {
        let req: CompletionRequest =
            serde_json::from_slice(body).map_err(|_| Untokenizable::Shape("completions"))?;
        req.check()?;
        let text = match serde_json::from_str::<OneOrMany<String>>(req.prompt.get()) {
            Ok(OneOrMany::One(s)) => s,
            Ok(OneOrMany::Many(mut v)) if v.len() == 1 => v.remove(0),
            Ok(OneOrMany::Many(_)) => return Err(Untokenizable::Unsupported("prompt batch")),
            Err(_) => return Err(Untokenizable::Shape("completions")),
        };
        self.encode(&text, req.add_special_tokens.unwrap_or(true))
    }

    /// `text` encoded as the engine's tokenizer does (`tokenizer(text,
    /// add_special_tokens=…)`). Only the first `max_bytes` bytes are encoded (cut on a
    /// character boundary): encoding runs at roughly 10 MB/s, and a prefix is all that
    /// prefix scoring needs. The tokens before the cut are the engine's; only the last
    /// pre-token or two before it may differ, which costs at most the final block or
    /// two of the match, never a wrong earlier one.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Tokens, Untokenizable> {
        let mut end = text.len().min(self.max_bytes);
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        self.tokenizer
            .encode_fast(&text[..end], add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| Untokenizable::Tokenizer(e.to_string()))
    }
}

/// Default of `precise.max_tokenize_bytes` (see [`DEFAULT_MAX_TOKENIZE_BYTES`]).
pub const DEFAULT_MAX_BYTES: usize = DEFAULT_MAX_TOKENIZE_BYTES;

/// `transformers`' named special tokens, passed to chat templates.
const SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// The fields of a completions body that decide its tokens.
#[derive(Deserialize)]
struct CompletionRequest<'a> {
    #[serde(borrow)]
    prompt: &'a RawValue,
    #[serde(default)]
    add_special_tokens: Option<bool>,
    #[serde(default)]
    truncate_prompt_tokens: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    prompt_embeds: Option<serde::de::IgnoredAny>,
}

impl CompletionRequest<'_> {
    fn check(&self) -> Result<(), Untokenizable> {
        if self.truncate_prompt_tokens.is_some() {
            return Err(Untokenizable::Unsupported("truncate_prompt_tokens"));
        }
        if self.prompt_embeds.is_some() {
            return Err(Untokenizable::Unsupported("prompt_embeds"));
        }
        Ok(())
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

/// The prompt of a `/v1/completions` body given as token ids (`[1, 2, 3]` or one
/// `[[1, 2, 3]]`): the engine prefills exactly these. `None` for any other body.
pub fn completion_prompt_ids(body: &[u8]) -> Option<Tokens> {
    let req: CompletionRequest = serde_json::from_slice(body).ok()?;
    req.check().ok()?;
    match serde_json::from_str::<OneOrMany<Tokens>>(req.prompt.get()).ok()? {
        OneOrMany::One(ids) => Some(ids),
        OneOrMany::Many(mut batch) if batch.len() == 1 => Some(batch.remove(0)),
        OneOrMany::Many(_) => None,
    }
    .filter(|ids| !ids.is_empty())
}

/// Why [`PromptTokenizer::load`] failed: the tokenizer (its `tokenizer.json`,
/// `tokenizer_config.json`, `special_tokens_map.json`) or the chat template.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    #[error("{0}")]
    Tokenizer(String),
    #[error("{0}")]
    Template(String),
}

/// Largest `tokenizer.json` read (bytes); real ones are 2–20 MB.
const MAX_TOKENIZER_FILE: u64 = 256 << 20;
/// Largest chat template file or `tokenizer_config.json` read (bytes).
const MAX_TEMPLATE_FILE: u64 = 16 << 20;

/// A regular file's text, refusing anything else (a directory, a FIFO, `/dev/zero`)
/// and files over `limit` bytes.
fn read_text(path: &Path, limit: u64) -> Result<String, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("`{}`: {e}", path.display()))?;
    if !meta.is_file() {
        return Err(format!("`{}`: not a regular file", path.display()));
    }
    if meta.len() > limit {
        return Err(format!(
            "`{}`: {} bytes, over the {limit}-byte limit",
            path.display(),
            meta.len()
        ));
    }
    std::fs::read_to_string(path).map_err(|e| format!("`{}`: cannot read: {e}", path.display()))
}

/// A JSON file of the model folder; `None` when it does not exist.
fn read_json(path: &Path) -> Result<Option<serde_json::Value>, String> {
    if !path.exists() {
        return Ok(None);
    }
    let text = read_text(path, MAX_TEMPLATE_FILE)?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| format!("`{}`: not valid JSON: {e}", path.display()))
}

/// A special token as `tokenizer_config.json` writes it: a string or an `AddedToken`
/// object with `content`.
fn token_text(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// The template called `name` in `tokenizer_config.json`'s `chat_template`: a list of
/// `{name, template}`, or one string (which is the `default`).
fn template_text(v: &serde_json::Value, name: &str) -> Option<String> {
    match v {
        serde_json::Value::String(s) => (name == "default").then(|| s.clone()),
        serde_json::Value::Array(list) => list.iter().find_map(|t| {
            (t.get("name")?.as_str()? == name)
                .then(|| t.get("template")?.as_str().map(str::to_owned))
                .flatten()
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completion_token_prompts_are_read_as_is() {
        assert_eq!(
            completion_prompt_ids(br#"{"prompt": [1, 2, 3]}"#),
            Some(vec![1, 2, 3])
        );
        assert_eq!(
            completion_prompt_ids(br#"{"prompt": [[7, 8]]}"#),
            Some(vec![7, 8])
        );
        for body in [
            &br#"{"prompt": "text"}"#[..],
            br#"{"prompt": [[1], [2]]}"#,
            br#"{"prompt": []}"#,
            br#"{"prompt": [-1]}"#,
            br#"{"prompt": [1], "truncate_prompt_tokens": 5}"#,
            b"not json",
        ] {
            assert_eq!(
                completion_prompt_ids(body),
                None,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn special_tokens_and_templates_read_both_layouts() {
        assert_eq!(token_text(&serde_json::json!("<s>")), Some("<s>".into()));
        assert_eq!(
            token_text(&serde_json::json!({"content": "<s>", "lstrip": false})),
            Some("<s>".into())
        );
        let named = serde_json::json!([{"name": "tool_use", "template": "t"}, {"name": "default", "template": "d"}]);
        assert_eq!(template_text(&named, "default"), Some("d".into()));
        assert_eq!(template_text(&named, "tool_use"), Some("t".into()));
        assert_eq!(template_text(&serde_json::json!("s"), "tool_use"), None);
    }

    #[test]
    fn long_prompts_are_tokenized_up_to_the_cap_as_a_prefix() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer");
        let full = PromptTokenizer::load(&dir, None, ContentFormat::Auto).unwrap();
        let capped =
            PromptTokenizer::load_with_limit(&dir, None, ContentFormat::Auto, 4096).unwrap();
        let text = "déjà vu: the router keeps a prefix tree per worker.\n".repeat(400);
        let all = full.encode(&text, false).unwrap();
        let cut = capped.encode(&text, false).unwrap();
        assert!(
            cut.len() > 500 && cut.len() < all.len() / 4,
            "{} of {}",
            cut.len(),
            all.len()
        );
        // Only the pre-token cut in two can differ.
        let same = cut.iter().zip(&all).take_while(|(a, b)| a == b).count();
        assert!(same + 4 >= cut.len(), "{same} of {}", cut.len());
    }

    #[test]
    fn requests_with_tools_use_the_tool_use_template() {
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer");
        let dir = std::env::temp_dir().join(format!("car-tool-use-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(fixture.join("tokenizer.json"), dir.join("tokenizer.json")).unwrap();
        let config = serde_json::json!({"chat_template": [
            {"name": "default", "template": "plain:{{ messages[0].content }}"},
            {"name": "tool_use", "template": "tools:{{ tools | length }}:{{ messages[0].content }}"},
        ]});
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
        let tok = PromptTokenizer::load(&dir, None, ContentFormat::Auto).unwrap();
        let plain = br#"{"messages": [{"role": "user", "content": "hi"}]}"#;
        let tools = br#"{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]}"#;
        assert_eq!(
            tok.chat(plain).unwrap(),
            tok.encode("plain:hi", false).unwrap()
        );
        assert_eq!(
            tok.chat(tools).unwrap(),
            tok.encode("tools:1:hi", false).unwrap()
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn missing_tokenizer_names_the_file() {
        let e = PromptTokenizer::load(Path::new("/nonexistent/model"), None, ContentFormat::Auto)
            .unwrap_err();
        assert!(
            matches!(&e, LoadError::Tokenizer(m) if m.contains("/nonexistent/model")),
            "{e}"
        );
        let zero =
            PromptTokenizer::load(Path::new("/dev/zero"), None, ContentFormat::Auto).unwrap_err();
        assert!(zero.to_string().contains("not a regular file"), "{zero}");
    }

    /// The tokenizer a config names is refused like a config value: the file and line
    /// that set the key, the key, and the path as written.
    #[test]
    fn a_configured_tokenizer_that_cannot_load_names_the_file_key_and_value() {
        use crate::config::Config;
        let load = |over: &str| {
            Config::from_sources([
                (Path::new("base.yaml"), "workers:\n  - url: http://a:1\n"),
                (Path::new("over.yaml"), over),
            ])
            .and_then(|c| PromptTokenizer::from_config(&c.precise))
        };
        let e = load("precise:\n  tokenizer: Qwen/Qwen3-8B\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("over.yaml")
                && e.contains("precise.tokenizer")
                && e.contains("Qwen/Qwen3-8B"),
            "{e}"
        );
        assert!(load("precise:\n  block_size: 32\n").unwrap().is_none());
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer");
        let t = load(&format!(
            "precise:\n  tokenizer: \"{}\"\n",
            fixture.display()
        ))
        .unwrap()
        .expect("loaded");
        assert!(t.has_chat_template());
    }
}

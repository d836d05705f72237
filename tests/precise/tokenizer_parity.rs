//! In-router tokenization against vLLM itself: for every request in
//! `tests/fixtures/tokenizer/vllm_tokens.json` (recorded from vLLM 0.32's `/tokenize` on
//! the tiny model that `shared/tools/vllm-cpu/make_model.py` builds; see `record.py`
//! there), the router's tokens must equal vLLM's, id for id.

use std::path::{Path, PathBuf};

use cache_aware_router::tokenize::PromptTokenizer;
use cache_aware_router::tokenize::chat_template::ContentFormat;

/// One recorded request; `request` stays raw so its keys keep the client's order
/// (a JSON object's order reaches the prompt through `tojson`).
#[derive(serde::Deserialize)]
struct Case {
    name: String,
    template: Option<String>,
    endpoint: String,
    request: Box<serde_json::value::RawValue>,
    tokens: Vec<u32>,
}

#[derive(serde::Deserialize)]
struct Recorded {
    cases: Vec<Case>,
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer")
}

#[test]
fn router_tokens_equal_vllm_tokenize() {
    let dir = fixtures();
    let recorded: Recorded =
        serde_json::from_slice(&std::fs::read(dir.join("vllm_tokens.json")).unwrap()).unwrap();
    let default = PromptTokenizer::load(&dir, None, ContentFormat::Auto).unwrap();
    let tools = PromptTokenizer::load(
        &dir.join("tokenizer.json"),
        Some(&dir.join("tools_template.jinja")),
        ContentFormat::Auto,
    )
    .unwrap();
    let cases = recorded.cases;
    assert!(cases.len() >= 30, "fixture has {} cases", cases.len());
    let mut failures = Vec::new();
    for case in &cases {
        let name = &case.name;
        let body = case.request.get().as_bytes();
        let tokenizer = match case.template.as_deref() {
            Some("tools_template.jinja") => &tools,
            _ => &default,
        };
        let ours = match case.endpoint.as_str() {
            "/v1/chat/completions" => tokenizer.chat(body),
            _ => tokenizer.completion(body),
        };
        let want = &case.tokens;
        match ours {
            Ok(ours) if &ours == want => {}
            Ok(ours) => failures.push(format!(
                "{name}: {} tokens, vLLM {}; first difference at {}",
                ours.len(),
                want.len(),
                ours.iter().zip(want).take_while(|(a, b)| a == b).count()
            )),
            Err(e) => failures.push(format!("{name}: not tokenized: {e}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

//! Hostile and malformed input on precise mode's in-router tokenization path
//! (`precise.tokenizer`): whatever the body or the `x-token-ids` header holds, the
//! router forwards the client's bytes unchanged to one worker, falls back with the
//! cause the README names (`untokenizable`, `bad_tokens`, `short_prompt`) and keeps
//! serving. Config errors in `precise.*` name the key and the file.
//!
//! No KV-event publisher runs: tokenizing happens before scoring, so a request that
//! was tokenized shows as `precise.*` or `fallback.no_fresh_worker` ("keyed" here),
//! never as one of the causes above.

use std::path::{Path, PathBuf};

use cache_aware_router::app::RunningRouter;
use cache_aware_router::config::Config;
use cache_aware_router::tokenize::PromptTokenizer;
use serde_json::{Value, json};
use support::{client::*, config::*, observe::*, worker::*};

use crate::common::start_router;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer")
}

/// A `tcp://` endpoint on a port nothing listens on.
fn dead_endpoint() -> String {
    closed_port_url().replace("http://", "tcp://")
}

/// A precise-mode router with the fixture tokenizer in front of `ws`; `extra` are
/// more `precise:` lines (indented).
async fn router(ws: &[&FakeWorker], extra: &str) -> RunningRouter {
    let mut y = format!(
        "policy: precise_cache_aware\nprecise:\n  block_size: 16\n  tokenizer: \"{}\"\n{extra}health:\n  interval_secs: 60\nworkers:\n",
        fixture().display()
    );
    for w in ws {
        y.push_str(&format!(
            "  - url: \"{}\"\n    kv_events:\n      endpoint: \"{}\"\n",
            w.url(),
            dead_endpoint()
        ));
    }
    start_router(&y).await
}

/// `precise.decisions` flattened to `"path.cause" -> n`.
async fn decisions(r: &RunningRouter) -> Value {
    let d = get_workers(r.addr).await["precise"]["decisions"].clone();
    let mut out = serde_json::Map::new();
    for (path, causes) in d.as_object().expect("decisions") {
        for (cause, n) in causes.as_object().expect("causes") {
            out.insert(format!("{path}.{cause}"), n.clone());
        }
    }
    Value::Object(out)
}

/// The decision counter that moved for one request; "keyed" when the prompt's tokens
/// were found (scored precisely, or no fresh feed to score on).
fn moved(before: &Value, after: &Value) -> String {
    let changed: Vec<&String> = after
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, v)| before[k.as_str()] != **v)
        .map(|(k, _)| k)
        .collect();
    assert_eq!(changed.len(), 1, "one decision per request: {changed:?}");
    match changed[0].as_str() {
        "fallback.no_fresh_worker" => "keyed".into(),
        p if p.starts_with("precise.") => "keyed".into(),
        other => other.to_string(),
    }
}

/// Sends `body` to `path` (with `header`, if any); asserts the worker's 200 came back,
/// exactly one worker got the client's exact bytes, and returns the decision made.
async fn forwarded(
    r: &RunningRouter,
    ws: &[&FakeWorker],
    path: &str,
    body: &[u8],
    header: Option<&str>,
) -> String {
    let before = decisions(r).await;
    let mut req = Req::post(path, body.to_vec());
    if let Some(h) = header {
        req = req.header("x-token-ids", h);
    }
    let tag = new_tag();
    let resp = send(r.addr, &req.header("x-test-tag", &tag)).await;
    let shown = String::from_utf8_lossy(&body[..body.len().min(120)]).into_owned();
    assert_eq!(resp.status, 200, "{shown}: {}", resp.text());
    let got = ws[served_by(ws, &tag)].tagged(&tag).expect("recorded");
    assert!(got.body == body, "{shown}: body changed on the way");
    moved(&before, &decisions(r).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_chat_bodies_are_forwarded_and_fall_back() {
    let (a, b) = (FakeWorker::start().await, FakeWorker::start().await);
    let ws = [&a, &b];
    let r = router(&ws, "").await;
    let text = "the quick brown fox jumps over the lazy dog. ".repeat(8);
    let user = json!({"role": "user", "content": text});
    let chat = |messages: Value, more: Value| {
        let mut v = json!({"model": "m", "messages": messages});
        for (k, x) in more.as_object().unwrap() {
            v[k] = x.clone();
        }
        v.to_string().into_bytes()
    };
    let deep = format!(
        "{{\"model\":\"m\",\"messages\":[{{\"role\":\"user\",\"content\":\"{text}\",\"x\":{}{}}}]}}",
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    let mut invalid_utf8 = br#"{"model":"m","messages":[{"role":"user","content":"ab"#.to_vec();
    invalid_utf8.extend_from_slice(b"\xff\xfe\"}]}");
    let untokenizable: Vec<(&str, Vec<u8>)> = vec![
        ("not JSON", b"{\"model\": \"m\", \"messages\": [".to_vec()),
        ("empty body", Vec::new()),
        ("invalid UTF-8", invalid_utf8),
        ("100k nested arrays", deep.into_bytes()),
        ("messages as an object", chat(user.clone(), json!({}))),
        ("messages null", chat(Value::Null, json!({}))),
        ("a message that is a string", chat(json!([text]), json!({}))),
        (
            "content a number",
            chat(json!([{"role": "user", "content": 5}]), json!({})),
        ),
        ("role missing", chat(json!([{"content": text}]), json!({}))),
        (
            "role a number",
            chat(json!([{"role": 1, "content": text}]), json!({})),
        ),
        (
            "tool_calls of numbers",
            chat(
                json!([user, {"role": "assistant", "content": null, "tool_calls": [1]}]),
                json!({}),
            ),
        ),
        (
            "chat_template_kwargs a list",
            chat(json!([user]), json!({"chat_template_kwargs": [1, 2]})),
        ),
        (
            "chat_template_kwargs sets chat_template",
            chat(
                json!([user]),
                json!({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}),
            ),
        ),
        (
            "per-request chat_template",
            chat(json!([user]), json!({"chat_template": "{{ messages }}"})),
        ),
        (
            "image part",
            chat(
                json!([{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]),
                json!({}),
            ),
        ),
        (
            "continue_final_message without messages",
            chat(json!([]), json!({"continue_final_message": true})),
        ),
        (
            "add_generation_prompt a string",
            chat(json!([user]), json!({"add_generation_prompt": "yes"})),
        ),
    ];
    for (what, body) in &untokenizable {
        let d = forwarded(&r, &ws, "/v1/chat/completions", body, None).await;
        assert_eq!(d, "fallback.untokenizable", "{what}");
    }
    // Odd but renderable: tokenized (vLLM would take or refuse these itself).
    let call = |args: Value| {
        json!([user, {"role": "assistant", "content": null, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}]}])
    };
    let tokenized: Vec<(&str, Vec<u8>)> = vec![
        ("arguments a number", chat(call(json!(5)), json!({}))),
        ("arguments an array", chat(call(json!([1, 2])), json!({}))),
        (
            "arguments invalid JSON",
            chat(call(json!("{not json")), json!({})),
        ),
        (
            "arguments nested 100k deep",
            chat(
                call(json!(format!(
                    "{}{}",
                    "[".repeat(100_000),
                    "]".repeat(100_000)
                ))),
                json!({}),
            ),
        ),
        (
            "null everywhere",
            chat(
                json!([{"role": "user", "content": text, "name": null, "tool_calls": null}]),
                json!({"tools": null, "documents": null, "add_generation_prompt": null,
                       "continue_final_message": null, "add_special_tokens": null,
                       "chat_template_kwargs": null, "reasoning_effort": null,
                       "chat_template": null, "truncate_prompt_tokens": null}),
            ),
        ),
        (
            "kwargs named messages, tools, add_generation_prompt",
            chat(
                json!([user]),
                json!({"chat_template_kwargs": {"messages": "x", "tools": 5, "add_generation_prompt": [1]}}),
            ),
        ),
        (
            "continue_final_message on an empty last message",
            chat(
                json!([user, {"role": "assistant", "content": ""}]),
                json!({"continue_final_message": true, "add_generation_prompt": false}),
            ),
        ),
        (
            "continue_final_message on content parts",
            chat(
                json!([user, {"role": "assistant", "content": [{"type": "text", "text": "Sure, "}]}]),
                json!({"continue_final_message": true, "add_generation_prompt": false}),
            ),
        ),
    ];
    for (what, body) in &tokenized {
        let d = forwarded(&r, &ws, "/v1/chat/completions", body, None).await;
        assert_eq!(d, "keyed", "{what}");
    }
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_token_prompts_and_token_headers_are_checked() {
    let (a, b) = (FakeWorker::start().await, FakeWorker::start().await);
    let ws = [&a, &b];
    let r = router(&ws, "").await;
    let ids: Vec<u32> = (100..164).collect();
    let prompt = |p: Value| json!({"model": "m", "prompt": p}).to_string().into_bytes();
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("token ids", prompt(json!(ids)), "keyed"),
        ("one nested list", prompt(json!([ids])), "keyed"),
        (
            "a batch",
            prompt(json!([ids, ids])),
            "fallback.untokenizable",
        ),
        (
            "three levels",
            prompt(json!([[ids]])),
            "fallback.untokenizable",
        ),
        (
            "a negative id",
            prompt(json!([-1, 5, 6])),
            "fallback.untokenizable",
        ),
        (
            "an id above u32",
            prompt(json!([4_294_967_296u64, 5])),
            "fallback.untokenizable",
        ),
        ("an empty list", prompt(json!([])), "fallback.untokenizable"),
        ("a number", prompt(json!(42)), "fallback.untokenizable"),
        ("null", prompt(Value::Null), "fallback.untokenizable"),
        (
            "an empty string",
            prompt(json!("")),
            "fallback.short_prompt",
        ),
        (
            "truncate_prompt_tokens",
            json!({"prompt": "some text ".repeat(20), "truncate_prompt_tokens": 4})
                .to_string()
                .into_bytes(),
            "fallback.untokenizable",
        ),
    ];
    for (what, body, want) in &cases {
        let d = forwarded(&r, &ws, "/v1/completions", body, None).await;
        assert_eq!(&d, want, "{what}");
    }
    let chat = chat_body("hello", false).into_bytes();
    let good: Vec<String> = ids.iter().map(u32::to_string).collect();
    for (what, header) in [
        ("empty", String::new()),
        ("trailing comma", format!("{},", good.join(","))),
        ("negative", "-1,2,3".to_string()),
        ("above u32", "4294967296".to_string()),
        ("a JSON list", format!("[{}]", good.join(","))),
    ] {
        let d = forwarded(&r, &ws, "/v1/chat/completions", &chat, Some(&header)).await;
        assert_eq!(d, "fallback.bad_tokens", "x-token-ids {what}");
    }
    let d = forwarded(
        &r,
        &ws,
        "/v1/chat/completions",
        &chat,
        Some(&good.join(", ")),
    )
    .await;
    assert_eq!(d, "keyed");
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_past_the_tokenize_cap_are_still_forwarded_whole() {
    let (a, b) = (FakeWorker::start().await, FakeWorker::start().await);
    let ws = [&a, &b];
    let r = router(&ws, "  max_tokenize_bytes: 4096\n").await;
    // 12 KiB of text, 3 times the cap: tokenized (its first 4 KiB), forwarded whole.
    let body = chat_body(&"lorem ipsum dolor sit amet ".repeat(450), false).into_bytes();
    let started = std::time::Instant::now();
    let d = forwarded(&r, &ws, "/v1/chat/completions", &body, None).await;
    assert_eq!(d, "keyed");
    // 2 MiB bodies, past 4 times the cap: not parsed for tokens at all (the tree
    // decides), still forwarded whole.
    let body = chat_body(&"lorem ipsum dolor sit amet ".repeat(80_000), false).into_bytes();
    let d = forwarded(&r, &ws, "/v1/chat/completions", &body, None).await;
    assert_eq!(d, "fallback.untokenizable");
    let body = json!({"model": "m", "prompt": "a".repeat(2 << 20)})
        .to_string()
        .into_bytes();
    let d = forwarded(&r, &ws, "/v1/completions", &body, None).await;
    assert_eq!(d, "fallback.untokenizable");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    r.shutdown().await;
}

/// `--config-check`'s text for these `precise:` lines: the config, then the tokenizer
/// it names (loaded by the part that uses it, and by startup before serving).
fn config_error(precise: &str) -> String {
    let yaml = format!(
        "policy: precise_cache_aware\nprecise:\n{precise}workers:\n  - url: http://127.0.0.1:9\n    kv_events:\n      endpoint: tcp://127.0.0.1:9\n"
    );
    let checked = Config::from_sources([(Path::new("test.yaml"), yaml.as_str())])
        .and_then(|c| PromptTokenizer::from_config(&c.precise));
    match checked {
        Ok(_) => panic!("accepted:\n{yaml}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn tokenizer_config_errors_name_the_key_and_the_file() {
    let missing = config_error("  tokenizer: /nonexistent/model\n");
    assert!(
        missing.contains("precise.tokenizer") && missing.contains("/nonexistent/model"),
        "{missing}"
    );
    let dir = TempFile::new("README", "a folder without tokenizer.json");
    let folder = dir.path.parent().unwrap();
    let e = config_error(&format!("  tokenizer: \"{}\"\n", folder.display()));
    assert!(
        e.contains("precise.tokenizer") && e.contains("tokenizer.json"),
        "{e}"
    );
    let corrupt = TempFile::new("tokenizer.json", "{\"model\": {\"type\": \"BPE\", ");
    let e = config_error(&format!("  tokenizer: \"{}\"\n", corrupt.path.display()));
    assert!(
        e.contains("precise.tokenizer") && e.contains(&corrupt.path.display().to_string()),
        "{e}"
    );
    // A chat template file: a syntax error, and one that raises on every chat, are
    // refused under `precise.chat_template` with the file's name.
    for (what, text) in [
        ("syntax", "{% for m in messages %}{{ m.content }}"),
        (
            "raises",
            "{{ raise_exception('this template refuses everything') }}",
        ),
    ] {
        let t = TempFile::new("t.jinja", text);
        let e = config_error(&format!(
            "  tokenizer: \"{}\"\n  chat_template: \"{}\"\n",
            fixture().display(),
            t.path.display()
        ));
        assert!(
            e.contains("precise.chat_template") && e.contains(&t.path.display().to_string()),
            "{what}: {e}"
        );
    }
    // `chat_template` in tokenizer_config.json that is neither a string nor a list.
    let cfg = TempFile::new("tokenizer_config.json", "{\"chat_template\": 5}");
    let folder = cfg.path.parent().unwrap();
    std::fs::copy(
        fixture().join("tokenizer.json"),
        folder.join("tokenizer.json"),
    )
    .unwrap();
    let e = config_error(&format!("  tokenizer: \"{}\"\n", folder.display()));
    let _ = std::fs::remove_file(folder.join("tokenizer.json"));
    assert!(
        e.contains("precise.tokenizer") && e.contains("tokenizer_config.json"),
        "{e}"
    );
    let e = config_error(&format!(
        "  tokenizer: \"{}\"\n  chat_template_content_format: list\n",
        fixture().display()
    ));
    assert!(
        e.contains("precise.chat_template_content_format") && e.contains("openai"),
        "{e}"
    );
}

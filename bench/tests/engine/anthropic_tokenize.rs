//! The simulated engine's Anthropic Messages endpoint and vLLM's tokenizer endpoints
//! (`/tokenize`, `/detokenize`, the two render endpoints) over real HTTP on
//! 127.0.0.1:0: shapes, SSE event order, the prefix cache shared with chat, and
//! token counts that agree across endpoints.

use bench::engine::{self, EngineConfig, RunningEngine, VOCAB_SIZE};
use hyper::{Method, StatusCode};
use serde_json::{Value, json};

use crate::support::HttpClient;

struct Fixture {
    engine: RunningEngine,
    client: HttpClient,
}

impl Fixture {
    async fn new() -> Self {
        let cfg = EngineConfig {
            name: "e-test".into(),
            // 1 ms of simulated time = 1 µs.
            time_factor: 0.001,
            ..EngineConfig::default()
        };
        Self {
            engine: engine::start(cfg).await.expect("engine starts"),
            client: crate::support::client(),
        }
    }

    /// POSTs `body` to `path`; status, content type and the whole body.
    async fn post(&self, path: &str, body: &Value) -> (StatusCode, String, String) {
        let r = crate::support::send(
            &self.client,
            &self.engine,
            Method::POST,
            path,
            &body.to_string(),
        )
        .await;
        assert_eq!(r.engine, "e-test");
        (r.status, r.content_type.clone(), r.text())
    }

    async fn post_json(&self, path: &str, body: &Value) -> (StatusCode, Value) {
        let (status, _, text) = self.post(path, body).await;
        let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        (status, v)
    }
}

/// A long prompt (more than a few 16-token blocks).
fn long_text(n: usize, salt: &str) -> String {
    (0..n).map(|i| format!(" {salt}{i}")).collect()
}

/// Anthropic SSE body → (event name, data) pairs; checks the framing on the way.
fn anthropic_events(text: &str) -> Vec<(String, Value)> {
    text.split_terminator("\n\n")
        .map(|ev| {
            let (head, data) = ev.split_once('\n').expect("event line then data line");
            let name = head.strip_prefix("event: ").expect("event: line");
            let data: Value =
                serde_json::from_str(data.strip_prefix("data: ").expect("data: line")).unwrap();
            assert_eq!(data["type"], name, "event name matches data.type");
            (name.to_owned(), data)
        })
        .collect()
}

#[tokio::test]
async fn messages_json_reports_cache_reads_and_shares_the_cache_with_chat() {
    let f = Fixture::new().await;
    let system = long_text(100, "s");
    let user = long_text(100, "u");
    let body = json!({
        "model": "m", "max_tokens": 4,
        "system": [{"type": "text", "text": system}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": user}]}],
    });
    let (status, ct, text) = f.post("/v1/messages", &body).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert!(ct.starts_with("application/json"));
    let first: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(first["type"], "message");
    assert_eq!(first["role"], "assistant");
    assert_eq!(first["stop_reason"], "max_tokens");
    assert!(first["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(first["content"][0]["type"], "text");
    assert_eq!(
        first["content"][0]["text"]
            .as_str()
            .unwrap()
            .split_whitespace()
            .count(),
        4
    );
    let u = &first["usage"];
    assert_eq!(u["output_tokens"], 4);
    assert_eq!(u["cache_read_input_tokens"], 0);
    let prompt = u["input_tokens"].as_u64().unwrap();
    // 200 words + the chat template's 5 markers (system, user, generation prompt).
    assert_eq!(prompt, 205);

    // Same request again: most of it is read from the cache, and Anthropic's
    // input_tokens counts only the rest.
    let (_, second) = f.post_json("/v1/messages", &body).await;
    let read = second["usage"]["cache_read_input_tokens"].as_u64().unwrap();
    let input = second["usage"]["input_tokens"].as_u64().unwrap();
    assert!(read > 0 && read.is_multiple_of(16), "read {read}");
    assert_eq!(input + read, prompt);

    // The same conversation through chat hits the same cache: vLLM serves
    // /v1/messages by converting it to a chat request.
    let chat = json!({"model": "m", "max_tokens": 2, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": user}]});
    let (_, c) = f.post_json("/v1/chat/completions", &chat).await;
    assert_eq!(c["usage"]["prompt_tokens"], prompt);
    assert_eq!(c["usage"]["prompt_tokens_details"]["cached_tokens"], read);

    // count_tokens and /tokenize agree with what generation reports.
    let mut count = body.clone();
    count.as_object_mut().unwrap().remove("max_tokens");
    let (status, n) = f.post_json("/v1/messages/count_tokens", &count).await;
    assert_eq!(
        (status, n["input_tokens"].as_u64()),
        (StatusCode::OK, Some(prompt))
    );
    let (_, t) = f
        .post_json(
            "/tokenize",
            &json!({"model": "m", "messages": chat["messages"]}),
        )
        .await;
    assert_eq!(t["count"], prompt);

    let stats = f.engine.engine().stats();
    assert_eq!(stats.requests_finished, 3);
    assert_eq!(stats.cache_hits, 2 * read);
}

#[tokio::test]
async fn messages_stream_sends_anthropic_events_in_order() {
    let f = Fixture::new().await;
    let body = json!({
        "model": "m", "max_tokens": 5, "stream": true, "system": "be brief",
        "messages": [{"role": "user", "content": long_text(64, "w")}],
    });
    f.post("/v1/messages", &body).await; // warm the cache
    let (status, ct, text) = f.post("/v1/messages", &body).await;
    assert_eq!(status, StatusCode::OK);
    assert!(ct.starts_with("text/event-stream"), "{ct}");
    let events = anthropic_events(&text);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    let mut expected = vec!["message_start", "content_block_start"];
    expected.extend(["content_block_delta"; 5]);
    expected.extend(["content_block_stop", "message_delta", "message_stop"]);
    assert_eq!(names, expected);

    let start = &events[0].1["message"];
    assert_eq!(
        (start["role"].as_str(), start["content"].clone()),
        (Some("assistant"), json!([]))
    );
    assert!(start["stop_reason"].is_null());
    let read = start["usage"]["cache_read_input_tokens"].as_u64().unwrap();
    assert!(read > 0, "the second request reads the cache: {start}");
    assert_eq!(
        events[1].1["content_block"],
        json!({"type": "text", "text": ""})
    );
    let text: String = events[2..7]
        .iter()
        .map(|(_, d)| {
            assert_eq!(
                (d["index"].as_u64(), d["delta"]["type"].as_str()),
                (Some(0), Some("text_delta"))
            );
            d["delta"]["text"].as_str().unwrap().to_owned()
        })
        .collect();
    // The answer chat would give the same conversation (greedy: a function of the prompt).
    let chat = engine::anthropic_to_chat(body.as_object().unwrap()).unwrap();
    let prompt = engine::chat_template(Some(&chat)).unwrap();
    assert_eq!(text, engine::greedy_text(&prompt, 5));
    let delta = &events[8].1;
    assert_eq!(delta["delta"]["stop_reason"], "max_tokens");
    assert_eq!(delta["usage"]["output_tokens"], 5);
    assert_eq!(delta["usage"]["cache_read_input_tokens"], read);
    assert_eq!(
        delta["usage"]["input_tokens"],
        start["usage"]["input_tokens"]
    );
    let stats = f.engine.engine().stats();
    assert_eq!((stats.requests_finished, stats.running), (2, 0));
}

#[tokio::test]
async fn messages_convert_tools_and_reject_bad_requests_in_anthropic_shape() {
    let f = Fixture::new().await;
    // A tool round trip: assistant tool_use, user tool_result; a system-role message.
    let body = json!({"model": "m", "max_tokens": 1, "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "checking"},
            {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "sunny"}]}]},
        {"role": "system", "content": "be brief"},
    ]});
    let (status, v) = f.post_json("/v1/messages", &body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let chat = engine::anthropic_to_chat(body.as_object().unwrap()).unwrap();
    assert_eq!(
        chat,
        json!([
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "checking", "tool_calls": [{"id": "t1", "type": "function",
              "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
            {"role": "tool", "content": "sunny", "tool_call_id": "t1"},
        ])
    );
    let words = engine::chat_template(Some(&chat)).unwrap();
    assert_eq!(
        v["usage"]["input_tokens"].as_u64(),
        Some(words.split_whitespace().count() as u64)
    );

    for bad in [
        json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}),
        json!({"model": "m", "max_tokens": 1, "messages": []}),
        json!({"model": "m", "max_tokens": 1, "messages": [{"role": "robot", "content": "x"}]}),
        json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": []}]}),
        json!({"model": "m", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}),
        json!({"model": "m", "max_tokens": 1, "system": 5, "messages": [{"role": "user", "content": "x"}]}),
    ] {
        let (status, v) = f.post_json("/v1/messages", &bad).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}");
        assert_eq!(v["type"], "error", "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
        );
    }
    assert_eq!(f.engine.engine().stats().requests_finished, 1);
}

#[tokio::test]
async fn tokenize_counts_match_generation_and_ids_are_stable() {
    let f = Fixture::new().await;
    let prompt = " farm only it together zebra";
    let (status, t) = f
        .post_json(
            "/tokenize",
            &json!({"model": "m", "prompt": prompt, "return_token_strs": true}),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(t["count"], 5);
    assert_eq!(t["max_model_len"], 131_072);
    assert_eq!(
        t["token_strs"],
        json!(["farm", "only", "it", "together", "zebra"])
    );
    // Trace words have their fixed ids (index in the 256-word list); others hash.
    let ids: Vec<u64> = t["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    assert_eq!(ids[..4], [226, 110, 6, 248]);
    assert!(ids[4] >= 1024 && ids[4] < u64::from(VOCAB_SIZE));
    assert_eq!(u64::from(engine::token_id("zebra")), ids[4]);

    let (_, c) = f
        .post_json(
            "/v1/completions",
            &json!({"model": "m", "prompt": prompt, "max_tokens": 1}),
        )
        .await;
    assert_eq!(c["usage"]["prompt_tokens"], t["count"]);

    let msgs = json!([{"role": "user", "content": "hello there"}]);
    let (_, t) = f.post_json("/tokenize", &json!({"messages": msgs})).await;
    assert_eq!(
        t["tokens"],
        json!([257, engine::token_id("hello"), 37, 260, 258])
    );
    assert!(t["token_strs"].is_null());
    let (_, t2) = f
        .post_json(
            "/tokenize",
            &json!({"messages": msgs, "add_generation_prompt": false}),
        )
        .await;
    assert_eq!(t2["count"], 4);
    let (_, c) = f
        .post_json(
            "/v1/chat/completions",
            &json!({"messages": msgs, "max_tokens": 1}),
        )
        .await;
    assert_eq!(c["usage"]["prompt_tokens"], t["count"]);

    // detokenize spells fixed ids and <|tok_N|> for the rest; tokenize maps the
    // spelling back, so ids survive the round trip.
    let ids = json!([0, 1, 258, 5000, VOCAB_SIZE - 1]);
    let (status, d) = f.post_json("/detokenize", &json!({"tokens": ids})).await;
    assert_eq!(status, StatusCode::OK);
    let text = d["prompt"].as_str().unwrap();
    assert_eq!(
        text,
        format!(
            " the of <|im_start|>assistant <|tok_5000|> <|tok_{}|>",
            VOCAB_SIZE - 1
        )
    );
    let (_, back) = f.post_json("/tokenize", &json!({"prompt": text})).await;
    assert_eq!(back["tokens"], ids);

    for (path, bad) in [
        ("/detokenize", json!({"tokens": [VOCAB_SIZE]})),
        ("/detokenize", json!({"tokens": "x"})),
        ("/tokenize", json!({"prompt": 5})),
        ("/tokenize", json!({})),
        ("/tokenize", json!({"messages": []})),
    ] {
        let (status, v) = f.post_json(path, &bad).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path} {bad}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
    let (status, _, _) = f.post("/tokenize", &json!("not an object")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    // Tokenizing is free: no generation was counted for it.
    assert_eq!(f.engine.engine().stats().requests_finished, 2);
}

#[tokio::test]
async fn render_endpoints_answer_vllm_generate_requests() {
    let f = Fixture::new().await;
    let msgs = json!([{"role": "system", "content": "be brief"},
                      {"role": "user", "content": long_text(40, "r")}]);
    let (status, r) = f
        .post_json(
            "/v1/chat/completions/render",
            &json!({"model": "m", "messages": msgs, "max_tokens": 7, "cache_salt": "s1"}),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let (_, t) = f.post_json("/tokenize", &json!({"messages": msgs})).await;
    assert_eq!(r["token_ids"], t["tokens"]);
    assert_eq!(r["sampling_params"]["max_tokens"], 7);
    assert_eq!(
        (
            r["model"].as_str(),
            r["cache_salt"].as_str(),
            r["stream"].as_bool()
        ),
        (Some("m"), Some("s1"), Some(false))
    );
    assert!(r["request_id"].is_string());

    let (status, r) = f
        .post_json(
            "/v1/completions/render",
            &json!({"model": "m", "prompt": ["the of", "and"]}),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let lists: Vec<&Value> = r
        .as_array()
        .unwrap()
        .iter()
        .map(|x| &x["token_ids"])
        .collect();
    assert_eq!(lists, [&json!([0, 1]), &json!([2])]);
    // Token-id prompts pass through unchanged.
    let (_, r) = f
        .post_json("/v1/completions/render", &json!({"prompt": [[5, 6], [7]]}))
        .await;
    assert_eq!(r[0]["token_ids"], json!([5, 6]));
    assert_eq!(r[1]["token_ids"], json!([7]));

    for (path, bad) in [
        ("/v1/chat/completions/render", json!({"messages": []})),
        ("/v1/completions/render", json!({"prompt": 3})),
        ("/v1/completions/render", json!({"prompt": [VOCAB_SIZE]})),
    ] {
        let (status, _) = f.post_json(path, &bad).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path} {bad}");
    }
    assert_eq!(f.engine.engine().stats().requests_finished, 0);
}

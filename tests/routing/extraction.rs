//! Prompt extraction seen end to end: whatever the body's shape, the worker receives the
//! client's bytes unchanged, and the routing key follows the conversation.

use cache_aware_router::app::RunningRouter;
use support::{client::*, config::*, engine::*, observe::*, worker::*};

use crate::common::start_router;

/// `n` bytes of base64-looking text, different for each `seed`.
fn fake_base64(n: usize, seed: u8) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut x = 0x9e37_79b9_u32.wrapping_mul(seed as u32 + 1);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            ALPHABET[(x % 64) as usize] as char
        })
        .collect()
}

fn tree_bytes(v: &serde_json::Value) -> u64 {
    v["tree_bytes"].as_u64().expect("tree_bytes")
}

async fn three_workers() -> [FakeWorker; 3] {
    [
        FakeWorker::start().await,
        FakeWorker::start().await,
        FakeWorker::start().await,
    ]
}

// C02
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn image_parts_are_forwarded_byte_identical_and_keep_base64_out_of_the_tree() {
    let [a, b, c] = three_workers().await;
    let router = start_router(&yaml_for(&[&a, &b, &c], "")).await;
    let ws = [&a, &b, &c];
    let mut last_tree = tree_bytes(&get_workers(router.addr).await);
    for seed in [1u8, 2] {
        let body = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"text","text":"Describe the chart."}},{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{}"}}}},{{"type":"text","text":"Answer in one line."}}]}}]}}"#,
            fake_base64(1 << 20, seed)
        );
        let (resp, w) = send_tagged(
            router.addr,
            &ws,
            Req::post("/v1/chat/completions", body.clone()),
        )
        .await;
        assert_eq!(resp.status, 200, "{}", resp.text());
        let rec = ws[w].requests().pop().unwrap();
        assert!(
            rec.body == body.as_bytes(),
            "the worker must receive the client's bytes unchanged ({} vs {} bytes)",
            rec.body.len(),
            body.len()
        );
        let now = tree_bytes(&get_workers(router.addr).await);
        assert!(now > last_tree, "the prompt's text should enter the tree");
        assert!(
            now.saturating_sub(last_tree) < 10_000,
            "the tree grew by {} bytes for one request with a 1 MiB image",
            now - last_tree
        );
        last_tree = now;
    }
    router.shutdown().await;
}

// C03
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_call_history_with_null_empty_or_missing_content_is_forwarded_byte_identical() {
    let w = FakeWorker::start().await;
    let router = start_router(&yaml_for(&[&w], "")).await;
    let head = r#"{"model":"m","tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}],"messages":[{"role":"system","content":"You plan trips."},{"role":"user","content":"Weather in Testville?"},{"role":"assistant","#;
    let tail = r#""tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Testville\"}"}}]},{"role":"tool","tool_call_id":"call_1","content":"12C cloudy"},{"role":"user","content":"And tomorrow?"}]}"#;
    let variants = [
        format!(r#"{head}"content":null,{tail}"#),
        format!(r#"{head}"content":"",{tail}"#),
        format!("{head}{tail}"),
    ];
    for (i, body) in variants.iter().enumerate() {
        serde_json::from_str::<serde_json::Value>(body).expect("variant is valid JSON");
        let resp = post(router.addr, "/v1/chat/completions", body.clone()).await;
        assert_eq!(resp.status, 200, "variant {i}: {}", resp.text());
        assert_eq!(
            resp.body,
            OK_BODY.as_bytes(),
            "variant {i}: the mock's answer"
        );
        let rec = w.requests().pop().unwrap();
        assert_eq!(
            rec.body_str(),
            *body,
            "variant {i} must be forwarded unchanged"
        );
    }
    assert!(w.requests()[0].body_str().contains(r#""content":null"#));
    router.shutdown().await;
}

// C04 (a)–(d)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_prompts_of_every_valid_shape_are_forwarded_byte_identical() {
    let [a, b, c] = three_workers().await;
    let ws = [&a, &b, &c];
    let router = start_router(&yaml_for(&ws, "")).await;
    let bodies = [
        r#"{"model":"m","prompt":[1212,318,257,1332],"max_tokens":4}"#,
        r#"{"model":"m","prompt":[[1,2,3],[4,5,6]],"max_tokens":4}"#,
        r#"{"model":"m","prompt":["alpha text","beta text"],"max_tokens":4}"#,
        r#"{"model":"m","prompt":"","max_tokens":4}"#,
    ];
    for body in bodies {
        let (resp, w) = send_tagged(router.addr, &ws, Req::post("/v1/completions", body)).await;
        assert_eq!(resp.status, 200, "{body}: {}", resp.text());
        assert_eq!(resp.body, OK_BODY.as_bytes(), "{body}: the mock's answer");
        assert_eq!(ws[w].requests().pop().unwrap().body_str(), body);
    }
    router.shutdown().await;
}

// C04 (a) twice
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_id_prompt_sent_again_goes_to_the_same_worker() {
    let [a, b, c] = three_workers().await;
    let ws = [&a, &b, &c];
    let router = start_router(&yaml_for(&ws, "")).await;
    let body = r#"{"model":"m","prompt":[1212,318,257,1332],"max_tokens":4}"#;
    let mut served = Vec::new();
    // With three idle workers a key-less pick is a random one: six agreeing picks in a
    // row happen by chance with probability 1/243.
    for _ in 0..6 {
        let (resp, w) = send_tagged(router.addr, &ws, Req::post("/v1/completions", body)).await;
        assert_eq!(resp.status, 200);
        served.push(w);
    }
    assert!(
        served.iter().all(|w| *w == served[0]),
        "the same token-id prompt was spread over workers: {served:?}"
    );
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_token_id_prompt_sent_again_goes_to_the_same_worker() {
    let [a, b, c] = three_workers().await;
    let ws = [&a, &b, &c];
    let router = start_router(&yaml_for(&ws, "")).await;
    let ids: Vec<String> = (0..200).map(|i| (1000 + i * 37).to_string()).collect();
    let body = format!(
        r#"{{"model":"m","prompt":[{}],"max_tokens":4}}"#,
        ids.join(",")
    );
    let mut served = Vec::new();
    for _ in 0..4 {
        let (resp, w) =
            send_tagged(router.addr, &ws, Req::post("/v1/completions", body.clone())).await;
        assert_eq!(resp.status, 200);
        assert_eq!(ws[w].requests().pop().unwrap().body, body.as_bytes());
        served.push(w);
    }
    assert!(
        served.iter().all(|w| *w == served[0]),
        "the same 200-token prompt was spread over workers: {served:?}"
    );
    router.shutdown().await;
}

// C04 (e)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_prompt_of_a_wrong_type_is_forwarded_or_refused_but_never_a_500() {
    const WORKER_400: &str =
        r#"{"error":{"message":"prompt must be a string or token ids","code":400}}"#;
    let w = FakeWorker::start_with(|_| Reply::json(400, WORKER_400)).await;
    let router = start_router(&yaml_for(&[&w], "")).await;
    let body = r#"{"model":"m","prompt":42}"#;
    let resp = post(router.addr, "/v1/completions", body).await;
    match w.requests().as_slice() {
        [rec] => {
            assert_eq!(rec.body_str(), body, "forwarded unchanged");
            assert_eq!(resp.status, 400, "the worker's answer: {}", resp.text());
            assert_eq!(resp.text(), WORKER_400);
        }
        [] => {
            assert_eq!(resp.status, 400, "refused by the router: {}", resp.text());
            assert!(
                resp.json()["error"]["message"].is_string(),
                "{}",
                resp.text()
            );
        }
        more => panic!("forwarded {} times", more.len()),
    }
    router.shutdown().await;
}

// C05
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_system_as_blocks_or_as_a_string_is_forwarded_unchanged_to_the_same_worker() {
    let [a, b, c] = three_workers().await;
    let ws = [&a, &b, &c];
    let router = start_router(&yaml_for(&ws, "")).await;
    let messages = r#""messages":[{"role":"user","content":[{"type":"text","text":"hi"}]},{"role":"assistant","content":[{"type":"tool_use","id":"tu_1","name":"lookup","input":{"q":"x"}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"tu_1","content":[{"type":"text","text":"found"}]}]}]"#;
    // Four independent trials, each with a system prompt that differs from the first
    // byte on (so trials do not share a prefix): if the two spellings of `system` were
    // keyed differently, all four pairs would agree by chance with probability 1/81.
    for first in ["Alpha", "Bravo", "Charlie", "Delta"] {
        let blocks = format!(
            r#"{{"model":"m","max_tokens":16,"system":[{{"type":"text","text":"{first}: you are terse."}},{{"type":"text","text":"Reply in English.","cache_control":{{"type":"ephemeral"}}}}],{messages}}}"#
        );
        let string = format!(
            r#"{{"model":"m","max_tokens":16,"system":"{first}: you are terse.\nReply in English.",{messages}}}"#
        );
        let mut served = Vec::new();
        for body in [&blocks, &string] {
            serde_json::from_str::<serde_json::Value>(body).expect("valid JSON");
            let (resp, w) =
                send_tagged(router.addr, &ws, Req::post("/v1/messages", body.clone())).await;
            assert_eq!(resp.status, 200, "{}", resp.text());
            assert_eq!(ws[w].requests().pop().unwrap().body_str(), **body);
            served.push(w);
        }
        assert_eq!(
            served[0], served[1],
            "{first}: `system` as blocks and as a string should land on the same worker"
        );
    }
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_body_is_forwarded_unchanged() {
    let w = FakeWorker::start().await;
    let router = start_router(&yaml_for(&[&w], "")).await;
    for body in [
        &b"not json at all"[..],
        br#"{"model":"m","messages":"should be a list"}"#,
        b"\xff\xfe\x00binary",
    ] {
        let resp = post(router.addr, "/v1/chat/completions", body.to_vec()).await;
        assert_eq!(resp.status, 200, "{}", resp.text());
        assert_eq!(w.requests().pop().unwrap().body, body);
    }
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_media_urls_are_refused_when_the_policy_says_so() {
    let w = FakeWorker::start().await;
    let router = start_router(&yaml_for(&[&w], "proxy:\n  remote_media_url_policy: 403\n")).await;
    let remote = r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"What is this?"},{"type":"image_url","image_url":{"url":"https://example.com/cat.png"}}]}]}"#;
    let resp = post(router.addr, "/v1/chat/completions", remote).await;
    assert_eq!(resp.status, 403, "{}", resp.text());
    assert!(resp.json()["error"]["message"].is_string());
    assert_eq!(w.count(), 0);
    // Inline (data:) images are not remote.
    let inline = remote.replace("https://example.com/cat.png", "data:image/png;base64,QUJD");
    let resp = post(router.addr, "/v1/chat/completions", inline).await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    router.shutdown().await;
}

/// C44: the address engines must never be made to fetch.
const METADATA_URL: &str = "http://169.254.169.254/latest/meta-data/";

/// C44: a chat body whose one user message holds `parts` (JSON, comma-separated).
fn chat_with_parts(parts: &str) -> String {
    format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"text","text":"What is this?"}},{parts}]}}]}}"#
    )
}

/// C44 (a): the part every check knows.
fn image_part(url: &str) -> String {
    format!(r#"{{"type":"image_url","image_url":{{"url":"{url}"}}}}"#)
}

/// C44: a router refusing remote media with 403 in front of one recording worker.
async fn media_policy_router() -> (FakeWorker, RunningRouter) {
    let w = FakeWorker::start().await;
    let router = start_router(&yaml_for(&[&w], "proxy:\n  remote_media_url_policy: 403\n")).await;
    (w, router)
}

/// C44: whether `body` on `path` was refused with the configured status and a JSON
/// error naming the key, without reaching the worker; `Err` says how it was not.
async fn refused(
    router: &RunningRouter,
    w: &FakeWorker,
    path: &str,
    body: &str,
) -> Result<(), String> {
    let before = w.count();
    let resp = post(router.addr, path, body.to_string()).await;
    if resp.status != 403 || w.count() != before {
        return Err(format!(
            "answered {} and reached the worker {} time(s)",
            resp.status,
            w.count() - before
        ));
    }
    let err = &resp.json()["error"];
    let names_key = err["message"]
        .as_str()
        .is_some_and(|m| m.contains("remote_media_url_policy"));
    if err["type"] != "remote_media_rejected" || !names_key {
        return Err(format!("not the policy's JSON error: {err}"));
    }
    Ok(())
}

/// C44: asserts [`refused`] for one case.
async fn assert_refused(
    router: &RunningRouter,
    w: &FakeWorker,
    path: &str,
    body: &str,
    case: &str,
) {
    if let Err(e) = refused(router, w, path, body).await {
        panic!("{case}: {e}");
    }
}

// C44 (a)–(e)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_media_part_shape_with_a_remote_url_is_refused() {
    let (w, router) = media_policy_router().await;
    let u = METADATA_URL;
    let mut leaked = Vec::new();
    for (case, part) in [
        ("(a) image_url part", image_part(u)),
        (
            "(b) video_url part",
            format!(r#"{{"type":"video_url","video_url":{{"url":"{u}"}}}}"#),
        ),
        (
            "(c) audio_url part",
            format!(r#"{{"type":"audio_url","audio_url":{{"url":"{u}"}}}}"#),
        ),
        (
            "(d) image_url object without type",
            format!(r#"{{"image_url":{{"url":"{u}"}}}}"#),
        ),
        (
            "(d) image_url string without type",
            format!(r#"{{"image_url":"{u}"}}"#),
        ),
        (
            "(d) audio_url object without type",
            format!(r#"{{"audio_url":{{"url":"{u}"}}}}"#),
        ),
        (
            "(e) HTTP:// in capitals",
            image_part("HTTP://169.254.169.254/latest/meta-data/"),
        ),
        // Python's urlsplit strips leading blanks: the engine still fetches it.
        (
            "(e) a leading space before HTTPS://",
            image_part(" HTTPS://169.254.169.254/latest/meta-data/"),
        ),
    ] {
        let body = chat_with_parts(&part);
        if let Err(e) = refused(&router, &w, "/v1/chat/completions", &body).await {
            leaked.push(format!("{case}: {e}"));
        }
    }
    assert!(leaked.is_empty(), "{leaked:#?}");
    router.shutdown().await;
}

// C44 (f)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_messages_key_cannot_hide_a_media_url() {
    let (w, router) = media_policy_router().await;
    // Python's json keeps the last `messages`: the engine sees the URL.
    let body = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"hello"}}],"messages":[{{"role":"user","content":[{}]}}]}}"#,
        image_part(METADATA_URL)
    );
    assert_refused(&router, &w, "/v1/chat/completions", &body, "(f)").await;
    router.shutdown().await;
}

// C44 (g)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_input_image_with_a_url_string_is_refused() {
    let (w, router) = media_policy_router().await;
    let body = format!(
        r#"{{"model":"m","input":[{{"role":"user","content":[{{"type":"input_text","text":"describe"}},{{"type":"input_image","image_url":"{METADATA_URL}"}}]}}]}}"#
    );
    assert_refused(&router, &w, "/v1/responses", &body, "(g)").await;
    router.shutdown().await;
}

// C44 (h)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pass_through_bodies_with_media_urls_are_refused() {
    let (w, router) = media_policy_router().await;
    let messages = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":[{}]}}]}}"#,
        image_part(METADATA_URL)
    );
    assert_refused(
        &router,
        &w,
        "/v1/embeddings",
        &messages,
        "(h) /v1/embeddings",
    )
    .await;
    assert_refused(&router, &w, "/pooling", &messages, "(h) /pooling").await;
    let score = format!(
        r#"{{"model":"m","text_1":"a cat","text_2":{{"content":[{}]}}}}"#,
        image_part(METADATA_URL)
    );
    assert_refused(&router, &w, "/v1/score", &score, "(h) /v1/score").await;
    router.shutdown().await;
}

// C44 (i)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_media_url_past_the_prompt_cut_is_refused() {
    let (w, router) = media_policy_router().await;
    let text = format!(r#"{{"type":"text","text":"{}"}}"#, "x".repeat(40 * 1024));
    let body = chat_with_parts(&format!("{text},{}", image_part(METADATA_URL)));
    assert_refused(&router, &w, "/v1/chat/completions", &body, "(i)").await;
    router.shutdown().await;
}

// C44 (j)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inline_media_and_a_mentioned_url_still_pass_the_policy() {
    let (w, router) = media_policy_router().await;
    let inline = chat_with_parts(&image_part(
        "data:image/png;base64,iVBORw0KGgoAAAANSUhEUg==",
    ));
    let mention = chat_with_parts(&format!(
        r#"{{"type":"text","text":"Why does {METADATA_URL} matter?"}}"#
    ));
    for body in [inline, mention] {
        let resp = post(router.addr, "/v1/chat/completions", body.clone()).await;
        assert_eq!(resp.status, 200, "{}", resp.text());
        assert_eq!(w.requests().pop().unwrap().body_str(), body);
    }
    router.shutdown().await;
}

/// An engine's prefix cache, per worker: the rendered prompt is the canonical JSON of
/// `tools`, a newline, then the conversation (`system`/`instructions`, then
/// `messages`/`input`), as a tools-first chat template (Llama 3.x JSON) renders it. It
/// answers with the usage an engine reports: prompt tokens at 4 bytes a token, cached
/// tokens the longest prefix it rendered before, in whole 16-token blocks.
fn tools_first_engine() -> impl Fn(&Recorded) -> Reply + Send + Sync + 'static {
    let seen = std::sync::Mutex::new(Vec::<String>::new());
    move |r| {
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap_or_default();
        let mut rendered = v.get("tools").map(|t| t.to_string()).unwrap_or_default();
        rendered.push('\n');
        for k in ["system", "instructions", "messages", "input"] {
            if let Some(x) = v.get(k) {
                rendered.push_str(&x.to_string());
            }
        }
        let mut seen = seen.lock().unwrap();
        let common = seen
            .iter()
            .map(|s| {
                s.bytes()
                    .zip(rendered.bytes())
                    .take_while(|(a, b)| a == b)
                    .count()
            })
            .max()
            .unwrap_or(0);
        seen.push(rendered.clone());
        let cached = (common / 4) / 16 * 16;
        Reply::json(
            200,
            &format!(
                r#"{{"id":"x","object":"chat.completion","choices":[{{"index":0,"message":{{"role":"assistant","content":"ok"}},"finish_reason":"stop"}}],"usage":{}}}"#,
                usage_json((rendered.len() / 4) as u64, cached as u64)
            ),
        )
    }
}

/// Twelve tool definitions of about 8 KB in all, named `{set}_…`, in the endpoint's
/// shape (chat: `function`; Anthropic: `input_schema`; Responses: flat `parameters`).
fn tool_set(endpoint: &str, set: &str) -> serde_json::Value {
    let tools = (0..12).map(|i| {
        let name = format!("{set}_tool_{i}");
        let description = format!("{set}: does step {i} of the job. ").repeat(14);
        let schema = serde_json::json!({
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": format!("what {name} looks for")},
                "limit": {"type": "integer", "description": "at most this many results"},
            },
            "required": ["query"],
        });
        match endpoint {
            "/v1/messages" => {
                serde_json::json!({"name": name, "description": description, "input_schema": schema})
            }
            "/v1/responses" => serde_json::json!({"type": "function", "name": name,
                "description": description, "parameters": schema}),
            _ => serde_json::json!({"type": "function", "function": {"name": name,
                "description": description, "parameters": schema}}),
        }
    });
    serde_json::Value::Array(tools.collect())
}

/// A request of `endpoint`'s shape: `system` (or none), one user turn, `tools` (or none).
fn shaped(
    endpoint: &str,
    system: Option<&str>,
    user: &str,
    tools: Option<&serde_json::Value>,
) -> Req {
    let mut body = match endpoint {
        "/v1/responses" => serde_json::json!({"model": "m", "input": user}),
        _ => serde_json::json!({"model": "m", "max_tokens": 16,
            "messages": [{"role": "user", "content": user}]}),
    };
    if let Some(s) = system {
        match endpoint {
            "/v1/chat/completions" => body["messages"]
                .as_array_mut()
                .unwrap()
                .insert(0, serde_json::json!({"role": "system", "content": s})),
            "/v1/messages" => body["system"] = s.into(),
            _ => body["instructions"] = s.into(),
        }
    }
    if let Some(t) = tools {
        body["tools"] = t.clone();
    }
    Req::post(endpoint, body.to_string())
}

// C48
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_that_differ_only_in_their_tools_are_not_predicted_as_whole_prompt_hits() {
    const DECISIONS: &str = "cache_aware_router_routing_decisions_total";
    const AGED: &str = "cache_aware_router_tree_aged_out_bytes_total";
    let a = FakeWorker::start_with(tools_first_engine()).await;
    let b = FakeWorker::start_with(tools_first_engine()).await;
    let ws = [&a, &b];
    let router = start_router(&yaml_for(&ws, "health:\n  interval_secs: 3600\n")).await;
    let addr = router.addr;
    let hits = |m: &Scrape| m.value(DECISIONS, &[("reason", "cache_hit")]);
    let predicted = |m: &Scrape| -> f64 {
        m.all("cache_aware_router_prefix_tokens_total")
            .iter()
            .filter(|s| {
                s.labels
                    .iter()
                    .any(|(k, v)| k == "kind" && v == "predicted")
            })
            .map(|s| s.value)
            .sum()
    };
    for endpoint in ["/v1/chat/completions", "/v1/messages", "/v1/responses"] {
        // 1. Four warm-up prompts without tools, then M with tools T1, served by R.
        let qs: Vec<String> = (1..=4)
            .map(|k| {
                format!(
                    "{endpoint} warm-up {k}: {}",
                    "summarise the log. ".repeat(60)
                )
            })
            .collect();
        let mut q_on = Vec::new();
        for q in &qs {
            let (r, w) = send_tagged(addr, &ws, shaped(endpoint, None, q, None)).await;
            assert_eq!(r.status, 200, "{endpoint}: {}", r.text());
            q_on.push(w);
        }
        let system = format!(
            "{endpoint}: you are an agent. {}",
            "Plan, then act. ".repeat(64)
        );
        let user = "Find the cheapest flight to Testville.";
        let (t1, t2) = (tool_set(endpoint, "alpha"), tool_set(endpoint, "beta"));
        assert!(t1.to_string().len() > 7000, "{}", t1.to_string().len());
        let m = |t: &serde_json::Value| shaped(endpoint, Some(&system), user, Some(t));
        let (r, on_r) = send_tagged(addr, &ws, m(&t1)).await;
        assert_eq!(r.status, 200, "{endpoint}: {}", r.text());
        let before = scrape(addr).await;

        // 2. M with other tools: the engine shares next to nothing of it.
        let (r, _) = send_tagged(addr, &ws, m(&t2)).await;
        assert_eq!(r.status, 200);
        let after = scrape(addr).await;
        assert_eq!(
            hits(&after) - hits(&before),
            0.0,
            "{endpoint}: M with other tools was predicted as a cache hit"
        );
        let full = (m(&t2).body.len() / 4) as f64;
        let guess = predicted(&after) - predicted(&before);
        assert!(
            guess < full / 10.0,
            "{endpoint}: predicted {guess} tokens of a ~{full}-token prompt"
        );

        // 3. M with T1 again: a hit on R.
        let (r, w) = send_tagged(addr, &ws, m(&t1)).await;
        assert_eq!((r.status, w), (200, on_r), "{endpoint}: M with T1 again");
        let again = scrape(addr).await;
        assert_eq!(hits(&again) - hits(&after), 1.0, "{endpoint}: a cache hit");

        // 4. The warm-up prompts are still hits where they were served; nothing aged out.
        for (q, &was) in qs.iter().zip(&q_on) {
            let (r, w) = send_tagged(addr, &ws, shaped(endpoint, None, q, None)).await;
            assert_eq!((r.status, w), (200, was), "{endpoint}: {q:.40}");
        }
        let end = scrape(addr).await;
        assert_eq!(hits(&end) - hits(&again), 4.0, "{endpoint}: warm-ups hit");
        assert_eq!(
            end.value(AGED, &[]),
            before.value(AGED, &[]),
            "{endpoint}: records aged out"
        );
    }
    router.shutdown().await;
}

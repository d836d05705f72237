//! Prompt extraction seen end to end: whatever the body's shape, the worker receives the
//! client's bytes unchanged, and the routing key follows the conversation.

mod support;

use support::*;

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

//! Prefill/decode disaggregation on sim-engines: vLLM's NixlConnector contract (a
//! prefill answers a 1-token request asking for a remote decode with
//! `kv_transfer_params`; a decode given them reads the prompt's KV instead of computing
//! it), params it cannot act on, an engine without a connector, and the router in front
//! of a prefill and a decode engine.

use bench::engine::{self, EngineConfig, KvConnector, Physics, RunningEngine};
use hyper::{Method, StatusCode};
use serde_json::{Value, json};

use crate::support::{client, send, send_to, start_router, wait_until};

async fn nixl_engine(name: &str, connector: KvConnector) -> RunningEngine {
    engine::start(EngineConfig {
        name: name.into(),
        prefill_physics: Physics::Chunked,
        kv_connector: connector,
        time_factor: 0.001,
        ..EngineConfig::default()
    })
    .await
    .expect("engine starts")
}

fn prompt() -> String {
    (0..400).map(|i| format!(" w{i}")).collect()
}

fn client_body(stream: bool) -> Value {
    json!({"model": "m", "messages": [{"role": "user", "content": prompt()}],
           "max_tokens": 5, "stream": stream, "stream_options": {"include_usage": true}})
}

/// The prefill leg of `body`, as the router (and vLLM's proxy) shapes it.
fn prefill_leg(body: &Value) -> Value {
    let mut p = body.clone();
    p["max_tokens"] = json!(1);
    p["stream"] = json!(false);
    p.as_object_mut().unwrap().remove("stream_options");
    p["kv_transfer_params"] = json!({"do_remote_decode": true, "do_remote_prefill": false});
    p
}

/// The usage of a streamed answer (its last chunk with one).
fn streamed_usage(text: &str) -> Value {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| v.get("usage").cloned())
        .next_back()
        .unwrap_or(Value::Null)
}

#[tokio::test]
async fn a_prefill_hands_off_and_a_decode_reads_instead_of_computing() {
    let (p, d) = (
        nixl_engine("p0", KvConnector::Nixl).await,
        nixl_engine("d0", KvConnector::Nixl).await,
    );
    let c = client();
    let body = client_body(true);
    let r = send(
        &c,
        &p,
        Method::POST,
        "/v1/chat/completions",
        &prefill_leg(&body).to_string(),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let answer = r.json();
    assert_eq!(answer["choices"][0]["finish_reason"], "length");
    assert_eq!(answer["usage"]["completion_tokens"], 1);
    let params = answer["kv_transfer_params"].clone();
    assert_eq!(params["do_remote_prefill"], true);
    assert_eq!(params["do_remote_decode"], false);
    assert_eq!(params["remote_engine_id"], "p0");
    let prompt_tokens = answer["usage"]["prompt_tokens"].as_u64().unwrap();
    let blocks = params["remote_block_ids"].as_array().unwrap().len() as u64;
    assert_eq!(blocks, prompt_tokens.div_ceil(16));
    for k in ["remote_request_id", "remote_host", "remote_port", "tp_size"] {
        assert!(!params[k].is_null(), "{k} in {params}");
    }
    assert_eq!(p.engine().stats().kv_handoffs_sent, 1);

    let mut decode_leg = body.clone();
    decode_leg["kv_transfer_params"] = params;
    let r = send(
        &c,
        &d,
        Method::POST,
        "/v1/chat/completions",
        &decode_leg.to_string(),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let usage = streamed_usage(&r.text());
    assert_eq!(usage["completion_tokens"], 5);
    // The transferred KV counts as cached: all but the last token, computed here.
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"],
        prompt_tokens - 1
    );
    let s = d.engine().stats();
    assert_eq!(
        (
            s.kv_handoffs_received,
            s.kv_transferred_tokens,
            s.prefill_tokens_computed
        ),
        (1, prompt_tokens - 1, 1)
    );
    assert!(
        d.engine()
            .metrics_text()
            .contains("sim:kv_handoffs_received_total")
    );
}

#[tokio::test]
async fn params_a_decode_cannot_act_on_or_an_engine_without_connector_compute_the_prompt() {
    let d = nixl_engine("d0", KvConnector::Nixl).await;
    let c = client();
    let mut body = client_body(false);
    body["kv_transfer_params"] = json!({"do_remote_prefill": true, "remote_engine_id": "p0"});
    let r = send(
        &c,
        &d,
        Method::POST,
        "/v1/chat/completions",
        &body.to_string(),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(
        r.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
        0
    );
    let s = d.engine().stats();
    assert_eq!((s.kv_handoffs_invalid, s.kv_handoffs_received), (1, 0));

    let plain = nixl_engine("plain", KvConnector::None).await;
    let leg = prefill_leg(&client_body(false));
    let r = send(
        &c,
        &plain,
        Method::POST,
        "/v1/chat/completions",
        &leg.to_string(),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(r.json().get("kv_transfer_params").is_none(), "{}", r.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_relays_a_sim_prefills_hand_off_to_a_sim_decode() {
    let (p, d) = (
        nixl_engine("p0", KvConnector::Nixl).await,
        nixl_engine("d0", KvConnector::Nixl).await,
    );
    let yaml = format!(
        "workers:\n  - {{url: \"{}\", phase: prefill}}\n  - {{url: \"{}\", phase: decode}}\n",
        p.url(),
        d.url()
    );
    let (_router, base) = start_router(&yaml).await;
    let c = client();
    let mut cached = Vec::new();
    for _ in 0..2 {
        let r = send_to(
            &c,
            &base,
            Method::POST,
            "/v1/chat/completions",
            &client_body(true).to_string(),
        )
        .await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text());
        assert_eq!(r.engine, "d0");
        let usage = streamed_usage(&r.text());
        cached.push(
            usage["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap(),
        );
    }
    // The client sees the prefill's prefix cache: nothing, then the whole prompt's
    // full blocks.
    assert_eq!(cached[0], 0);
    assert!(cached[1] >= 384, "{cached:?}");
    wait_until("both hand-offs read", || async {
        d.engine().stats().kv_handoffs_received == 2
    })
    .await;
    assert_eq!(p.engine().stats().kv_handoffs_sent, 2);
    assert_eq!(d.engine().stats().kv_handoffs_invalid, 0);
}

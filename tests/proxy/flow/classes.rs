//! Tenants (header, API key, `default`, `other`) and classes (header, the body's vLLM
//! `priority`, clamped to the tenant's `max_class`), seen in the `priority` the worker
//! receives with `priority.engine_priority`.

use sha2::{Digest, Sha256};
use support::{client::*, worker::*};

use crate::common::start_router;

fn sha256_hex(key: &str) -> String {
    Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The `priority` the worker received in the body of the request tagged `tag`.
fn forwarded_priority(w: &FakeWorker, tag: &str) -> Option<i64> {
    let r = w.tagged(tag).expect("the worker got the request");
    let body: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    body["priority"].as_i64()
}

#[tokio::test]
async fn the_class_reaches_the_engine_as_vllm_priority_clamped_to_the_tenant() {
    let w = FakeWorker::start().await;
    let yaml = format!(
        "workers: [\"{}\"]\npriority: {{engine_priority: true}}\ntenants:\n  list:\n    acme: {{max_class: interactive}}\n    keyed: {{api_key_sha256: [\"{}\"], max_class: batch}}\n",
        w.url(),
        sha256_hex("sk-keyed")
    );
    let router = start_router(&yaml).await;
    let body_with = |priority: Option<i64>| {
        let mut v: serde_json::Value = serde_json::from_str(&chat_body("hi", false)).unwrap();
        if let Some(p) = priority {
            v["priority"] = p.into();
        }
        v.to_string()
    };
    // (headers, the body's priority) -> the priority the engine gets (critical -2,
    // interactive -1, standard 0, batch 1).
    type Case<'a> = (&'a [(&'a str, &'a str)], Option<i64>, i64);
    let cases: [Case; 9] = [
        (&[], None, 0),
        (&[("x-priority", "batch")], None, 1),
        (&[], Some(-2), -2),
        (&[("x-priority", "critical")], Some(1), -2),
        (&[], Some(40), 1),
        // A tenant named by the header is clamped to its max_class…
        (
            &[("x-tenant-id", "acme"), ("x-priority", "critical")],
            None,
            -1,
        ),
        // …a keyed tenant by its key only: by the header it is `other` (unclamped).
        (
            &[("x-tenant-id", "keyed"), ("x-priority", "critical")],
            None,
            -2,
        ),
        (
            &[
                ("authorization", "Bearer sk-keyed"),
                ("x-priority", "critical"),
            ],
            None,
            1,
        ),
        (&[("x-api-key", "sk-keyed")], Some(-2), 1),
    ];
    for (headers, priority, want) in cases {
        let tag = new_tag();
        let mut req =
            Req::post("/v1/chat/completions", body_with(priority)).header("x-test-tag", &tag);
        for (k, v) in headers {
            req = req.header(k, v);
        }
        let resp = send(router.addr, &req).await;
        assert_eq!(resp.status, 200, "{headers:?}: {}", resp.text());
        assert_eq!(
            forwarded_priority(&w, &tag),
            Some(want),
            "{headers:?} with body priority {priority:?}"
        );
    }
    router.shutdown().await;
}

#[tokio::test]
async fn without_engine_priority_the_body_goes_as_the_client_sent_it() {
    let w = FakeWorker::start().await;
    let yaml = format!("workers: [\"{}\"]\npriority: {{}}\n", w.url());
    let router = start_router(&yaml).await;
    let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"priority": 3}"#;
    let tag = new_tag();
    let req = Req::post("/v1/chat/completions", body)
        .header("x-test-tag", &tag)
        .header("x-priority", "critical");
    assert_eq!(send(router.addr, &req).await.status, 200);
    assert_eq!(w.tagged(&tag).unwrap().body_str(), body);
    router.shutdown().await;
}

//! Precise mode across KV tiers: fake vLLM engines publish GPU events with tokens and
//! their CPU-offloading connector's copies in the shapes vLLM sends them (the GPU
//! blocks' hashes, as raw digests or integers, no tokens, no parent, a block size of 0
//! or the engine's), and the router routes on both tiers, the GPU above the CPU.

use rmpv::Value;
use support::{client::*, engine::usage_engine, observe::*, worker::*};

use crate::kv_events::{
    BS, FakeEngine, Form, NO_HEALTH, hashes, prompt, removed, s, setup_with, stored, wait_feed,
};

/// How the offloading connector writes a copy's hashes and block size, by version.
#[derive(Clone, Copy, Debug)]
enum Offload {
    /// Current map form: raw 32-byte digests (whose last 8 bytes are the GPU event's
    /// integer hash), block size 0.
    Digests,
    /// Legacy array form, the first versions: raw digests, the connector's block size
    /// (the GPU's by default).
    LegacyArray,
    /// Newest placeholder: integer hashes, block size 0, a group and a locality.
    Ints,
}

/// A 32-byte digest whose last 8 bytes read `h` big-endian (vLLM's int hash is those).
fn digest(h: u64) -> Value {
    let mut d = vec![0xa5; 24];
    d.extend_from_slice(&h.to_be_bytes());
    Value::Binary(d)
}

/// The connector's `BlockStored` for copies of GPU blocks `gpu_hashes` in `medium`.
fn offloaded(shape: Offload, gpu_hashes: &[u64], medium: &str) -> Value {
    let digests = Value::Array(gpu_hashes.iter().map(|h| digest(*h)).collect());
    let ints = Value::Array(gpu_hashes.iter().map(|h| Value::from(*h)).collect());
    match shape {
        Offload::Digests => Value::Map(vec![
            (s("type"), s("BlockStored")),
            (s("block_hashes"), digests),
            (s("parent_block_hash"), Value::Nil),
            (s("token_ids"), Value::Array(vec![])),
            (s("block_size"), Value::from(0)),
            (s("lora_id"), Value::Nil),
            (s("medium"), s(medium)),
            (s("lora_name"), Value::Nil),
        ]),
        Offload::LegacyArray => Value::Array(vec![
            s("BlockStored"),
            digests,
            Value::Nil,
            Value::Array(vec![]),
            Value::from(BS as u64),
            Value::Nil,
            s(medium),
        ]),
        Offload::Ints => Value::Map(vec![
            (s("type"), s("BlockStored")),
            (s("block_hashes"), ints),
            (s("parent_block_hash"), Value::Nil),
            (s("token_ids"), Value::Array(vec![])),
            (s("block_size"), Value::from(0)),
            (s("medium"), s(medium)),
            (s("group_idx"), Value::from(0)),
            (s("locality"), s("LOCAL")),
        ]),
    }
}

/// The connector's `BlockRemoved` for its copies of `gpu_hashes` in `medium` (raw
/// digests, as the versions that send them so).
fn evicted_from(medium: &str, gpu_hashes: &[u64]) -> Value {
    Value::Map(vec![
        (s("type"), s("BlockRemoved")),
        (
            s("block_hashes"),
            Value::Array(gpu_hashes.iter().map(|h| digest(*h)).collect()),
        ),
        (s("medium"), s(medium)),
    ])
}

/// Sends a chat request whose token ids are `tokens` to engines that report
/// `prompt,cached` usage; returns the worker index.
async fn route_usage(
    router: &cache_aware_router::app::RunningRouter,
    ws: &[&FakeWorker],
    tokens: &[u32],
    cached: usize,
) -> usize {
    let ids: Vec<String> = tokens.iter().map(u32::to_string).collect();
    let req = Req::post("/v1/chat/completions", chat_body("the same text", false))
        .header("x-token-ids", &ids.join(","))
        .header("x-usage", &format!("{},{cached}", tokens.len()));
    let (resp, w) = send_tagged(router.addr, ws, req).await;
    assert_eq!(resp.status, 200);
    w
}

/// Two engines that answer with the usage asked for, the router in precise mode
/// (`extra`: more `precise:` lines) and both feeds live; no speculative entries, so
/// that only the engines' events say who holds what.
async fn tier_setup(
    extra: &str,
) -> (
    Vec<FakeWorker>,
    Vec<FakeEngine>,
    cache_aware_router::app::RunningRouter,
) {
    let ws = vec![
        FakeWorker::start_with(usage_engine(Gate::new())).await,
        FakeWorker::start_with(usage_engine(Gate::new())).await,
    ];
    setup_with(
        ws,
        false,
        &format!("  speculative_ttl_secs: 0\n{extra}"),
        NO_HEALTH,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_evicted_from_the_gpu_but_kept_on_the_cpu_still_routes_to_its_worker() {
    let (ws, es, router) = tier_setup("").await;
    let w: Vec<&FakeWorker> = ws.iter().collect();
    let p = prompt(3, 31);
    let h = hashes(1, 3);
    // Engine A prefills P, its connector copies each block to the CPU (one per shape
    // vLLM has sent), then its GPU evicts them all.
    es[0]
        .publish(vec![stored(Form::Map, &h, None, &p[..3 * BS])])
        .await;
    es[0]
        .publish(vec![
            offloaded(Offload::Digests, &h[..1], "CPU"),
            offloaded(Offload::LegacyArray, &h[1..2], "CPU"),
            offloaded(Offload::Ints, &h[2..], "CPU"),
        ])
        .await;
    es[0].publish(vec![removed(Form::Map, &h)]).await;
    wait_feed(&router, 0, "A's blocks on the CPU only", |f| {
        f["blocks"] == 3 && f["tier_blocks"]["CPU"] == 3 && f["tier_blocks"]["GPU"] == 0
    })
    .await;
    // Before tiers, the GPU's eviction made P unroutable; now A still takes it.
    for _ in 0..3 {
        assert_eq!(
            route_usage(&router, &w, &p, 3 * BS).await,
            0,
            "P is on A's CPU"
        );
    }
    let view = get_workers(router.addr).await;
    let a = &view["workers"][0]["tier_tokens"];
    assert_eq!(
        (
            &a["CPU"]["available"],
            &a["CPU"]["predicted"],
            &a["CPU"]["delivered"]
        ),
        (
            &(3 * 3 * BS).into(),
            &(3 * 3 * BS).into(),
            &(3 * 3 * BS).into()
        ),
        "{view}"
    );
    assert_eq!(a["GPU"]["predicted"], 0, "{view}");
    assert_eq!(view["precise"]["tiers"]["CPU"]["weight"], 0.8, "{view}");
    assert_eq!(
        view["precise"]["tiers"]["CPU"]["delivered"],
        3 * 3 * BS,
        "{view}"
    );

    // Engine B prefills P on its GPU: an equal match there beats A's CPU copy.
    es[1]
        .publish(vec![stored(Form::Array, &hashes(2, 3), None, &p[..3 * BS])])
        .await;
    wait_feed(&router, 1, "B indexed", |f| f["tier_blocks"]["GPU"] == 3).await;
    for _ in 0..3 {
        assert_eq!(
            route_usage(&router, &w, &p, 3 * BS).await,
            1,
            "B's GPU wins"
        );
    }

    // A's CPU evicts block 1: A's run is block 0 only; then block 0: A holds nothing.
    es[0].publish(vec![evicted_from("CPU", &h[1..2])]).await;
    wait_feed(&router, 0, "A's block 1 gone", |f| f["blocks"] == 2).await;
    es[0]
        .publish(vec![evicted_from("CPU", &[h[0], h[2]])])
        .await;
    wait_feed(&router, 0, "A's CPU copies gone", |f| {
        f["blocks"] == 0 && f["tier_blocks"]["CPU"] == 0
    })
    .await;
    // A copy of a block this router never saw prefilled cannot be placed: counted.
    es[0]
        .publish(vec![offloaded(Offload::Digests, &[77, 78], "CPU")])
        .await;
    wait_feed(&router, 0, "unknown hashes counted", |f| {
        f["unknown_hashes"] == 2 && f["blocks"] == 0
    })
    .await;

    let label = worker_label(router.addr, 0).await;
    let m = scrape(router.addr).await;
    let tier = |name: &str, tier: &str, kind: Option<&str>| {
        let mut labels = vec![("worker", label.as_str()), ("tier", tier)];
        if let Some(k) = kind {
            labels.push(("kind", k));
        }
        m.value(name, &labels)
    };
    let tokens = "cache_aware_router_precise_prefix_tokens_total";
    assert_eq!(tier(tokens, "CPU", Some("predicted")), (3 * 3 * BS) as f64);
    assert_eq!(tier(tokens, "CPU", Some("delivered")), (3 * 3 * BS) as f64);
    assert_eq!(tier(tokens, "STORAGE", Some("delivered")), 0.0);
    assert_eq!(
        tier("cache_aware_router_precise_index_tier_blocks", "CPU", None),
        0.0
    );
    assert_eq!(
        m.value(
            "cache_aware_router_kv_event_unknown_hashes_total",
            &[("worker", &label)]
        ),
        2.0
    );
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reference_counts_hold_per_rank_and_tier() {
    let ws = [
        FakeWorker::start_with(usage_engine(Gate::new())).await,
        FakeWorker::start_with(usage_engine(Gate::new())).await,
    ];
    let w: Vec<&FakeWorker> = ws.iter().collect();
    // A: two DP ranks. B: one rank, holding nothing.
    let a = FakeEngine::ranks(2).await;
    let b = FakeEngine::start(false).await;
    let mut yaml = format!(
        "policy: precise_cache_aware\nprecise:\n  block_size: {BS}\n  speculative_ttl_secs: 0\nhealth:\n{NO_HEALTH}workers:\n"
    );
    for (url, engine, ranks) in [
        (ws[0].url(), &a[0], "      dp_size: 2\n"),
        (ws[1].url(), &b, ""),
    ] {
        yaml.push_str(&format!(
            "  - url: \"{url}\"\n    kv_events:\n      endpoint: \"{}\"\n      topic: kv\n{ranks}",
            engine.endpoint
        ));
    }
    let router = crate::common::start_router(&yaml).await;
    a[0].sync_rank(&router, 0, Some(0)).await;
    a[1].sync_rank(&router, 0, Some(1)).await;
    b.sync(&router, 1).await;

    // Rank 0 prefills P twice (vLLM does not deduplicate) and its connector announces
    // the CPU copies twice (a chunk re-announces shared hashes); rank 1 prefills P
    // once, under its own hashes.
    let p = prompt(2, 41);
    let (h0, h1) = (hashes(1, 2), hashes(5, 2));
    for _ in 0..2 {
        a[0].publish(vec![
            stored(Form::Map, &h0, None, &p[..2 * BS]),
            offloaded(Offload::Digests, &h0, "CPU"),
        ])
        .await;
    }
    a[1].publish(vec![stored(Form::Array, &h1, None, &p[..2 * BS])])
        .await;
    wait_feed(&router, 0, "both ranks indexed", |f| {
        f["ranks"][0]["tier_blocks"]["GPU"] == 2
            && f["ranks"][0]["tier_blocks"]["CPU"] == 2
            && f["ranks"][1]["tier_blocks"]["GPU"] == 2
    })
    .await;
    let f = crate::kv_events::feed(&router, 0).await;
    assert_eq!(
        (&f["tier_blocks"]["GPU"], &f["tier_blocks"]["CPU"]),
        (&4.into(), &2.into()),
        "the worker sums its ranks: {f}"
    );

    // Rank 1's GPU evicts P; rank 0's GPU evicts it once (one copy left), then again:
    // its CPU copies stay, counted twice.
    a[1].publish(vec![removed(Form::Map, &h1)]).await;
    a[0].publish(vec![removed(Form::Map, &h0)]).await;
    wait_feed(&router, 0, "rank 1 empty, rank 0's GPU copy left", |f| {
        f["ranks"][1]["blocks"] == 0 && f["ranks"][0]["tier_blocks"]["GPU"] == 2
    })
    .await;
    a[0].publish(vec![removed(Form::Array, &h0)]).await;
    wait_feed(&router, 0, "rank 0 on the CPU only", |f| {
        f["ranks"][0]["tier_blocks"]["GPU"] == 0 && f["ranks"][0]["tier_blocks"]["CPU"] == 2
    })
    .await;
    assert_eq!(route_usage(&router, &w, &p, 2 * BS).await, 0);
    assert!(
        ws[0]
            .requests()
            .iter()
            .all(|r| r.header("x-data-parallel-rank") == Some("0")),
        "sent to the rank holding the CPU copies"
    );
    // One CPU removal leaves the second announcement's count; the second ends it.
    a[0].publish(vec![evicted_from("CPU", &h0)]).await;
    a[0].publish(Vec::new()).await;
    wait_feed(&router, 0, "rank 0 applied the first removal", |f| {
        f["ranks"][0]["removed"] == 3
    })
    .await;
    assert_eq!(feed_blocks(&router, 0).await, 2, "one announcement left");
    a[0].publish(vec![evicted_from("CPU", &h0)]).await;
    wait_feed(&router, 0, "rank 0 empty", |f| f["ranks"][0]["blocks"] == 0).await;
    router.shutdown().await;
}

async fn feed_blocks(router: &cache_aware_router::app::RunningRouter, worker: usize) -> u64 {
    crate::kv_events::feed(router, worker).await["blocks"]
        .as_u64()
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_blocks_bounds_the_blocks_of_every_tier_together() {
    let (_ws, es, router) = tier_setup("  max_blocks: 4\n").await;
    let p = prompt(3, 51);
    let q = prompt(2, 52);
    let (hp, hq) = (hashes(1, 3), hashes(3, 2));
    // P's three blocks move to the CPU: they still take three of the four places.
    es[0]
        .publish(vec![
            stored(Form::Map, &hp, None, &p[..3 * BS]),
            offloaded(Offload::Digests, &hp, "CPU"),
            removed(Form::Map, &hp),
        ])
        .await;
    wait_feed(&router, 0, "P on the CPU", |f| f["tier_blocks"]["CPU"] == 3).await;
    assert_eq!(get_workers(router.addr).await["precise"]["blocks"], 3);
    // Q's two GPU blocks need a fifth: P's least recently stored block goes.
    es[0]
        .publish(vec![stored(Form::Map, &hq, None, &q[..2 * BS])])
        .await;
    wait_feed(&router, 0, "Q stored, one of P's gone", |f| {
        f["tier_blocks"]["GPU"] == 2 && f["tier_blocks"]["CPU"] == 2
    })
    .await;
    let view = get_workers(router.addr).await;
    assert_eq!(
        (&view["precise"]["blocks"], &view["precise"]["evicted"]),
        (&4.into(), &1.into()),
        "{view}"
    );
    router.shutdown().await;
}

/// `cost_aware` with `kv_events` prices a prompt whose token ids are known on the
/// engines' blocks: a CPU copy is worth its transfer at `tier_load_tokens_per_sec`.
/// 12 cached tokens take 1.2 ms to recompute at the prior prefill rate; loaded at
/// 1,000 tokens/s they take 12 ms, at 1,000,000 tokens/s 12 µs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cost_aware_prices_a_cpu_hit_as_a_transfer() {
    for (rate, want) in [(1_000_000, 0), (1_000, 1)] {
        let ws = [
            FakeWorker::start_with(usage_engine(Gate::new())).await,
            FakeWorker::start_with(usage_engine(Gate::new())).await,
        ];
        let w: Vec<&FakeWorker> = ws.iter().collect();
        let es = [
            FakeEngine::start(false).await,
            FakeEngine::start(false).await,
        ];
        let mut yaml = format!(
            "policy: cost_aware\nengine_metrics: {{enabled: false}}\nprecise:\n  block_size: {BS}\n  tier_load_tokens_per_sec: {rate}\nhealth:\n{NO_HEALTH}workers:\n"
        );
        for (wk, e) in ws.iter().zip(&es) {
            yaml.push_str(&format!(
                "  - url: \"{}\"\n    kv_events:\n      endpoint: \"{}\"\n      topic: kv\n",
                wk.url(),
                e.endpoint
            ));
        }
        let router = crate::common::start_router(&yaml).await;
        for (i, e) in es.iter().enumerate() {
            e.sync(&router, i).await;
        }
        let p = prompt(3, 61);
        let h = hashes(1, 3);
        es[0]
            .publish(vec![
                stored(Form::Map, &h, None, &p[..3 * BS]),
                offloaded(Offload::Ints, &h, "CPU"),
                removed(Form::Map, &h),
            ])
            .await;
        wait_feed(&router, 0, "A's copies on the CPU", |f| {
            f["tier_blocks"]["CPU"] == 3 && f["tier_blocks"]["GPU"] == 0
        })
        .await;
        assert_eq!(
            route_usage(&router, &w, &p, 3 * BS).await,
            want,
            "{rate} tokens/s"
        );
        let view = get_workers(router.addr).await;
        assert_eq!(
            view["precise"]["decisions"]["precise"]["x_token_ids"], 1,
            "{view}"
        );
        router.shutdown().await;
    }
}

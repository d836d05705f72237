//! `simulate` on the committed 500-line Mooncake sample: `cache_aware`'s delivered hit
//! rate matches what `trace-matrix` measured over real router and sim-engine processes
//! on the same lines (README, "simulate"), and two runs recommend the same row.

use std::path::PathBuf;

use cache_aware_router::simulate::{self, SimulateArgs, input::Format};

/// `trace-matrix --trace bench/data/mooncake_sample_500.jsonl --policies cache_aware,…`
/// (defaults: 4 engines × 64,000 blocks of 16 tokens, time scale 0.07), 2026-12-01:
/// cache_aware's hit rate (Σ engines' cached_tokens ÷ Σ prompt tokens).
const TRACE_MATRIX_CACHE_AWARE: f64 = 0.152;

fn args() -> SimulateArgs {
    SimulateArgs {
        input: PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("bench/data/mooncake_sample_500.jsonl"),
        format: Format::Auto,
        limit: 0,
        skip_bad_lines: false,
        workers: 4,
        kv_blocks: 64_000,
        block_tokens: 16,
        prefill_tokens_per_sec: 12_500.0,
        ttft_base_ms: 20.0,
        decode_ms_per_token: 15.0,
        max_output_tokens: 64,
        rate: 10.0,
        load: 1.0,
        prefill_physics: simulate::engine::Physics::Serial,
        prefill_slots: 6,
        concurrency: 512,
        grid: simulate::grid::Grid::Tuning,
        config: Vec::new(),
        seed: 0,
        max_lora: 0,
        adapter_load_ms: 0.0,
    }
}

#[test]
fn cache_aware_matches_trace_matrix_and_the_recommendation_is_stable() {
    let a = args();
    // The two runs at once, each on a runtime of its own: the slowest test of the suite
    // takes one run's time on two cores.
    let (first, second) = std::thread::scope(|s| {
        let second = s.spawn(|| simulate::run(&a, false).expect("second run"));
        let first = simulate::run(&a, false).expect("simulate runs on the sample");
        (first, second.join().expect("second run"))
    });
    assert_eq!(first.requests, 500);
    let row = first
        .settings
        .iter()
        .position(|s| s.label == "cache_aware (defaults)")
        .expect("the grid has cache_aware at its defaults");
    let m = &first.rows[row];
    let hit = m.ratio(m.delivered_tokens);
    assert!(
        (hit - TRACE_MATRIX_CACHE_AWARE).abs() <= 0.02,
        "simulate's cache_aware hit rate {hit:.3} vs trace-matrix {TRACE_MATRIX_CACHE_AWARE}"
    );
    // Cache-aware routing beats round robin by far on this conversation trace.
    let rr = first
        .settings
        .iter()
        .position(|s| s.label == "round_robin")
        .expect("round_robin row");
    assert!(first.rows[rr].ratio(first.rows[rr].delivered_tokens) < hit - 0.04);
    assert!(first.recommended.is_some());
    assert_eq!(first.recommended, second.recommended);
    assert_eq!(
        first.render(&a),
        second.render(&a),
        "two runs print the same table"
    );
}

#[test]
fn with_adapters_residency_loads_each_adapter_once_where_the_policy_alone_reloads() {
    // 4 adapters over 4 engines of 1 slot; every prompt new (nothing to follow but
    // the adapter), 2 requests a second.
    let dir = std::env::temp_dir().join(format!("simulate-adapters-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("log.jsonl");
    let mut log = String::new();
    for i in 0..200 {
        let body = serde_json::json!({"model": format!("lora-{}", (i * 3 + i / 4) % 4),
            "messages": [{"role": "user", "content": format!("question {i} on a topic of its own")}]});
        log.push_str(&serde_json::json!({"timestamp_ms": i * 500, "body": body}).to_string());
        log.push('\n');
    }
    std::fs::write(&path, log).unwrap();
    let a = SimulateArgs {
        input: path,
        max_lora: 1,
        adapter_load_ms: 100.0,
        ..args()
    };
    let report = simulate::run(&a, false).expect("simulate runs with adapters");
    let row = |label: &str| {
        let i = report
            .settings
            .iter()
            .position(|s| s.label == label)
            .unwrap_or_else(|| panic!("no row {label}"));
        &report.rows[i]
    };
    let with = row("cache_aware (defaults)");
    let without = row("cache_aware (defaults), no adapter residency");
    assert_eq!(with.adapter_loads, Some(4), "each adapter loaded once");
    assert!(
        without.adapter_loads.unwrap() > 20,
        "{:?}",
        without.adapter_loads
    );
    assert!(with.loads_per_minute().unwrap() < without.loads_per_minute().unwrap());
    assert!(report.render(&a).contains("adapter loads/min"));
    std::fs::remove_dir_all(&dir).ok();
}

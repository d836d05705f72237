//! In-router tokenization cost (precise mode with `precise.tokenizer`).
//!
//! `cargo bench --bench tokenize` renders and tokenizes chat bodies of 2, 8 and 32 KiB
//! of prose (a system prompt plus a short question, as in agent and RAG traffic) with
//! the tiny model's tokenizer from `tests/fixtures/tokenizer` (byte-level BPE, 4,096
//! ids) and prints p50/p99 per request for the chat template render, the encode, and
//! both. Larger vocabularies (Llama 3: 128k, Qwen: 151k) change the encode cost; rerun
//! this with their tokenizer.json in place of the fixture to size a deployment.

use std::path::Path;
use std::time::Instant;

use cache_aware_router::tokenize::PromptTokenizer;
use cache_aware_router::tokenize::chat_template::ContentFormat;

const WORDS: &[&str] = &[
    "the",
    "router",
    "sends",
    "each",
    "request",
    "to",
    "a",
    "replica",
    "whose",
    "KV",
    "cache",
    "already",
    "holds",
    "its",
    "longest",
    "prefix,",
    "unless",
    "that",
    "one",
    "is",
    "overloaded;",
    "prefill",
    "tokens",
    "saved",
    "there",
    "lower",
    "TTFT",
    "for",
    "everyone.",
];

fn body(bytes: usize) -> String {
    let mut text = String::new();
    let mut i = 0usize;
    while text.len() < bytes {
        text.push_str(WORDS[(i * 7 + i / 3) % WORDS.len()]);
        text.push(if i % 17 == 16 { '\n' } else { ' ' });
        i += 1;
    }
    serde_json::json!({
        "model": "m",
        "messages": [
            {"role": "system", "content": text},
            {"role": "user", "content": "What does the router do with an overloaded replica?"},
        ],
    })
    .to_string()
}

fn percentiles(mut us: Vec<f64>) -> (f64, f64) {
    us.sort_by(f64::total_cmp);
    let at = |q: f64| us[((us.len() - 1) as f64 * q) as usize];
    (at(0.5), at(0.99))
}

fn main() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer");
    let tok = PromptTokenizer::load(&dir, None, ContentFormat::Auto).expect("fixture tokenizer");
    println!(
        "{:>8} {:>8} {:>22} {:>22}",
        "body", "tokens", "chat() p50/p99 µs", "encode only p50/p99 µs"
    );
    for kib in [2usize, 8, 32] {
        let b = body(kib * 1024);
        let tokens = tok.chat(b.as_bytes()).expect("tokenizes").len();
        let text: serde_json::Value = serde_json::from_str(&b).unwrap();
        let system = text["messages"][0]["content"].as_str().unwrap().to_owned();
        let iters = 2000 / kib;
        for _ in 0..20 {
            let _ = tok.chat(b.as_bytes());
        }
        let mut full = Vec::with_capacity(iters);
        let mut encode = Vec::with_capacity(iters);
        for _ in 0..iters {
            let t = Instant::now();
            let _ = tok.chat(b.as_bytes());
            full.push(t.elapsed().as_secs_f64() * 1e6);
            let t = Instant::now();
            let _ = tok.encode(&system, false);
            encode.push(t.elapsed().as_secs_f64() * 1e6);
        }
        let (f50, f99) = percentiles(full);
        let (e50, e99) = percentiles(encode);
        println!(
            "{:>6}KiB {:>8} {:>10.0} / {:<9.0} {:>10.0} / {:<9.0}",
            kib, tokens, f50, f99, e50, e99
        );
    }
}

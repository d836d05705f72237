//! What every bench shares: prompt text. The tail-latency benches also share `seam`
//! (a decision through the policy seam as the proxy makes it, trees held at their size,
//! percentile reports), declared by the benches that use all of it, so no bench
//! compiles code it does not use.

use rand::Rng;
use rand::rngs::StdRng;

pub const WORDS: &[&str] = &[
    "the",
    "model",
    "cache",
    "prefix",
    "token",
    "block",
    "worker",
    "request",
    "stream",
    "decode",
    "prefill",
    "replica",
    "router",
    "latency",
    "memory",
    "context",
    "user",
    "assistant",
    "system",
    "answer",
    "question",
    "document",
    "summary",
    "code",
    "data",
    "table",
    "value",
    "field",
    "error",
    "result",
    "first",
    "second",
];

pub fn words(rng: &mut StdRng, bytes: usize) -> String {
    let mut s = String::with_capacity(bytes + 16);
    while s.len() < bytes {
        s.push(' ');
        s.push_str(WORDS[rng.random_range(0..WORDS.len())]);
    }
    s
}

pub fn chat_body(system: &str, user: &str) -> Vec<u8> {
    serde_json::json!({
        "model": "m",
        "stream": true,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
        ]
    })
    .to_string()
    .into_bytes()
}

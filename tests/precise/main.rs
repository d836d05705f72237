//! Precise mode: KV-event feeds from (fake) vLLM engines over ZeroMQ, and the in-router
//! tokenization it routes on, against vLLM's own tokens and hostile input.

#[path = "../common/mod.rs"]
mod common;
mod kv_events;
mod tiers;
mod tokenizer_input;
mod tokenizer_parity;

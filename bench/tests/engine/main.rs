//! The simulated engine over real HTTP on 127.0.0.1:0 (its OpenAI, Anthropic, tokenizer
//! and embeddings endpoints; continued answers, stalls), and the router in front of sim-engines: what it reads of
//! them and learns from their answers.

mod anthropic_tokenize;
mod continuation;
mod embeddings;
mod evicts;
mod http;
mod models;
mod pd;
mod router;
mod salt;
mod support;

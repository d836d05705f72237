//! cache-aware-router: a cache-aware load balancer for pools of vLLM / SGLang replicas.
//!
//! # Architecture
//!
//! ```text
//! main.rs      CLI -> Config::load -> app::run
//! app          builds the Router, accepts connections, SIGHUP reload, SIGTERM drain
//! config       CLI + YAML layers -> validated Config
//! proxy        hyper service: body -> prompt -> policy -> upstream -> GuardedBody
//!   headers    hop-by-hop stripping, request ids
//!   upstream   pooled hyper-util client, one attempt
//!   body       GuardedBody: streams the answer, owns the in-flight guard
//!   models     GET /v1/models with a per-set cache
//! prompt       request body -> RouteContext (routing text, length, digest)
//! policy       pure decision: candidates + tree -> Pick (worker, reason)
//! tree         RadixTree: prefix -> workers, per-node LRU stamp
//! precise      precise mode: vLLM KV events -> BlockIndex -> precise pick
//!   tokens     request token ids: header, token prompt, or HF tokenizer
//!   chat_template  messages -> prompt text as vLLM renders it (minijinja)
//!   events     ZeroMQ frames + msgpack -> typed batches (pure)
//!   sequence   gaps, restarts, replay (pure)
//!   index      BlockIndex: router block key -> workers, LRU (pure)
//!   score      matched blocks -> uncached tokens -> Pick (pure)
//!   feed       per-worker feed state and counters
//!   consumer   per-worker ZMQ task (SUB + DEALER for replay)
//! workers      Worker (in-flight, health), WorkerSet snapshot, InFlightGuard
//!   usage      engine token usage read from response bytes as they pass
//! metrics      every metric name and label (prometheus-client)
//! health       active health checks
//! breaker      per-worker circuit breaker state machine
//! tree::evict  LRU eviction and daily reset task
//! admin        GET /health, GET /workers
//! reload       SIGHUP: re-read files, swap workers
//! error        ProxyError -> JSON response
//! shutdown     one watch-channel shutdown signal
//! ```
//!
//! # A request
//!
//! 1. Read the body up to `server.max_body_bytes` (413 past it).
//! 2. `prompt::extract` the routing text for the endpoint.
//! 3. Load the current `WorkerSet` once; `policy` picks a worker and records the prompt
//!    in the tree (one short mutex hold, never across an `.await`).
//! 4. Take an `InFlightGuard`, forward, return the upstream body in a `GuardedBody` so
//!    the guard lives exactly as long as the stream.
//! 5. Retry on another worker on connection errors, timeouts before headers and
//!    retryable statuses, only while nothing has reached the client.

#![forbid(unsafe_code)]

pub mod admin;
pub mod app;
pub mod clock;
pub mod config;
pub mod error;
pub mod metrics;
pub mod policy;
pub mod pool;
pub mod precise;
pub mod prompt;
pub mod proxy;
pub mod redact;
pub mod reload;
pub mod service;
pub mod shutdown;
pub mod tokenize;
pub mod tree;

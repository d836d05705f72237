//! The proxy path, request by request: HTTP mechanics (headers, connection reuse,
//! framing, WebSocket tunnels), streamed answers, `https://` workers, worker failures
//! (health checks, circuit breaker, retries), size and time limits, in-flight
//! accounting, how each request ends (access line, outcome), the queue, `/v1/models`,
//! streams continued on another worker when theirs breaks (`migration:`) or is drained,
//! late first tokens hedged on a second worker (`hedge:`),
//! disaggregated (prefill/decode) pools.

#[path = "../common/mod.rs"]
mod common;
mod drain;
mod flow;
mod hedge;
mod http;
mod in_flight;
mod limits;
mod migration;
mod models;
mod outcomes;
mod pd;
mod queue;
mod resilience;
mod slow_body;
mod streaming;
mod tls;

/// The router binary cargo built for these tests.
const BINARY: support::binary::Binary =
    support::binary::Binary::at(env!("CARGO_BIN_EXE_cache-aware-router"));

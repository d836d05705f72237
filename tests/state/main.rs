//! State shared beyond one request: router replicas routing as one through a real
//! Redis, the response cache (in-process and on Redis), token budgets on Redis.

mod budgets;
#[path = "../common/mod.rs"]
mod common;
mod fleet;
mod response_cache;

/// The router binary cargo built for these tests.
const BINARY: support::binary::Binary =
    support::binary::Binary::at(env!("CARGO_BIN_EXE_cache-aware-router"));

//! A running router whose workers and configuration change: DNS and Kubernetes
//! discovery, reload (SIGHUP), and shutdown that drains what is in flight.

#[path = "../common/mod.rs"]
mod common;
mod discovery;
mod kubernetes;
mod reload_and_shutdown;

/// The router binary cargo built for these tests.
const BINARY: support::binary::Binary =
    support::binary::Binary::at(env!("CARGO_BIN_EXE_cache-aware-router"));

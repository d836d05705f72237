//! The router as its operator runs and watches it: the command line and configuration
//! errors, the admin API, `/metrics`, and trace context with OTLP export.

mod admin;
mod cli;
#[path = "../common/mod.rs"]
mod common;
mod metrics;
mod tracing;

/// The router binary cargo built for these tests.
const BINARY: support::binary::Binary =
    support::binary::Binary::at(env!("CARGO_BIN_EXE_cache-aware-router"));

//! Which worker gets a request, and what the router learns from the answer: prefix
//! affinity, spreading and the load guard, the policy family and sessions, prompt
//! extraction, engine-aware cost, predicted / delivered prefix tokens, a worker whose
//! cache never delivers, several models and LoRA adapters (their keys, residency,
//! loads), and `simulate` against what `trace-matrix` measured.

mod adapters;
mod affinity;
#[path = "../common/mod.rs"]
mod common;
mod cost;
mod extraction;
mod hits;
mod models;
mod policies;
mod simulate;
mod undelivered;

/// The router binary cargo built for these tests.
const BINARY: support::binary::Binary =
    support::binary::Binary::at(env!("CARGO_BIN_EXE_cache-aware-router"));

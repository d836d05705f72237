//! Where the router learns what the engines know about themselves, in the background:
//! their Prometheus endpoints ([`engine_metrics`]) and LMCache occupancy signals
//! ([`lmcache`]). Each source writes into the worker's slots ([`crate::pools::pool::signals`]);
//! the request path only reads those, never waits for a source, and treats a missing,
//! stale or unreadable signal as neutral.
//!
//! Depends on the pool and config; the app spawns the tasks, the proxy's upstream client
//! does the fetching ([`crate::pools::pool::Fetch`]).

pub mod engine_metrics;
pub mod lmcache;

//! Where the router learns what the engines know about themselves, in the background:
//! their Prometheus endpoints ([`engine_metrics`]) and LMCache occupancy signals
//! ([`lmcache`]). Each source writes into the worker's slots ([`crate::pool::signals`]);
//! the request path only reads those, never waits for a source, and treats a missing,
//! stale or unreadable signal as neutral.
//!
//! Depends on the pool and config; the app spawns the tasks, the proxy's upstream client
//! does the fetching ([`Fetch`]).

pub mod engine_metrics;
pub mod lmcache;

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;

use crate::pool::Worker;

/// What a source asks for.
#[derive(Debug, Clone, Copy)]
pub enum Target<'a> {
    /// A path below the worker's URL, sent with the worker's backend key.
    Path(&'a str),
    /// An absolute `http://` URL, sent without any key (it is not the worker).
    Url(&'a str),
}

/// One bounded `GET`: the status and at most `max_bytes` of body, or why there was none.
pub trait Fetch: Clone + Send + Sync + 'static {
    fn get(
        &self,
        worker: &Worker,
        target: Target<'_>,
        timeout: Duration,
        max_bytes: usize,
    ) -> impl Future<Output = Result<(http::StatusCode, Bytes), String>> + Send;
}

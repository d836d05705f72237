//! [`Fetch`]: the one way background tasks reach a worker outside the request path
//! (health probes, engine-metrics scrapes, LMCache polls). The proxy's upstream client
//! implements it, so every such request carries the backend key like proxied ones do.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use super::Worker;

/// What a task asks for.
#[derive(Debug, Clone, Copy)]
pub enum Target<'a> {
    /// A path below the worker's URL, sent with the worker's backend key.
    Path(&'a str),
    /// An absolute `http://` or `https://` URL, sent without any key (it is not the worker).
    Url(&'a str),
}

/// One bounded `GET`: the status and at most `max_bytes` of body (bytes), within
/// `timeout`; `Err` says why there was no answer (connect error, time-out, a body over
/// `max_bytes`).
pub trait Fetch: Clone + Send + Sync + 'static {
    fn get(
        &self,
        worker: &Arc<Worker>,
        target: Target<'_>,
        timeout: Duration,
        max_bytes: usize,
    ) -> impl Future<Output = Result<(http::StatusCode, Bytes), String>> + Send;
}

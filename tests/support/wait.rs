//! Bounded waits: every wait in a test ends, so that a bug shows as a failure, not a
//! hang.

use std::future::Future;
use std::time::{Duration, Instant};

/// Upper bound of any single wait in a test: long enough never to trip on a slow CI
/// machine when the router behaves, short enough to fail fast when it does not.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(5);

/// Awaits `f`, panicking with `what` if it takes longer than [`STEP_TIMEOUT`].
pub async fn within<F: Future>(what: &str, f: F) -> F::Output {
    match tokio::time::timeout(STEP_TIMEOUT, f).await {
        Ok(v) => v,
        Err(_) => panic!("timed out after {STEP_TIMEOUT:?}: {what}"),
    }
}

/// Polls `cond` every 10 ms until it returns true; panics with `what` after `limit`.
pub async fn wait_until<F, Fut>(what: &str, limit: Duration, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if cond().await {
            return;
        }
        if start.elapsed() > limit {
            panic!("condition not reached within {limit:?}: {what}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

//! The time the router's state machines see (breakers, feed staleness, speculative
//! entries): tokio's clock, so tests with paused time drive them.

/// Now, on tokio's clock.
pub fn now() -> std::time::Instant {
    tokio::time::Instant::now().into_std()
}

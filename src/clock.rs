//! The time the router's state machines see (breakers, feed staleness, speculative
//! entries): tokio's clock, so tests with paused time drive them.

/// Now, on tokio's clock.
pub fn now() -> std::time::Instant {
    tokio::time::Instant::now().into_std()
}

/// A process-wide reference instant (one second before the first call), for deadlines
/// kept in atomics as nanoseconds.
pub fn epoch() -> std::time::Instant {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(|| now() - std::time::Duration::from_secs(1))
}

/// Nanoseconds from [`epoch`] to `t` (0 for an instant before it).
pub fn nanos(t: std::time::Instant) -> u64 {
    t.saturating_duration_since(epoch()).as_nanos() as u64
}

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

/// A gate for repeated log lines (a store, a watch, a resolver that keeps failing): at
/// most one line per `period`, saying how many events it stands for. Lock-free; safe to
/// share across tasks.
#[derive(Debug)]
pub struct LogEvery {
    period_ns: u64,
    /// [`nanos`] of the last line (0: none yet).
    last: std::sync::atomic::AtomicU64,
    /// Events since that line.
    events: std::sync::atomic::AtomicU64,
}

impl LogEvery {
    pub const fn new(period: std::time::Duration) -> Self {
        LogEvery {
            period_ns: period.as_nanos() as u64,
            last: std::sync::atomic::AtomicU64::new(0),
            events: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Counts one event; `Some(n)` when a line is due now (`n` events since the last
    /// one, this one included), `None` when it is not.
    pub fn due(&self) -> Option<u64> {
        use std::sync::atomic::Ordering::Relaxed;
        let n = self.events.fetch_add(1, Relaxed) + 1;
        let now = nanos(now()).max(1);
        let last = self.last.load(Relaxed);
        let due = last == 0 || now.saturating_sub(last) >= self.period_ns;
        if due
            && self
                .last
                .compare_exchange(last, now, Relaxed, Relaxed)
                .is_ok()
        {
            self.events.fetch_sub(n, Relaxed);
            return Some(n);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn log_every_lets_one_line_through_per_period() {
        let gate = LogEvery::new(std::time::Duration::from_secs(10));
        assert_eq!(gate.due(), Some(1));
        assert_eq!(gate.due(), None);
        assert_eq!(gate.due(), None);
        tokio::time::advance(std::time::Duration::from_secs(11)).await;
        assert_eq!(gate.due(), Some(3), "the two held back and this one");
        assert_eq!(gate.due(), None);
    }
}

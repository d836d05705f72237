//! Gives freed memory back to the system after a burst. glibc's malloc keeps what a
//! thread frees in that thread's arena and returns only the free top of each arena, so
//! after 5,000 concurrent streams (~40 KiB each) the router's RSS stayed at the burst's
//! peak. `malloc_trim(0)` hands every whole free page of every arena back (`madvise`).
//!
//! [`run`] looks every [`CHECK_EVERY`] and trims, on the blocking pool, when at most
//! [`QUIET_IN_FLIGHT`] requests are in flight and the RSS has grown by
//! [`TRIM_GROWTH_KIB`] since the last trim (or that trim gave back as much: a burst's
//! connections close after their idle time-out, `proxy.pool_idle_timeout_secs`, and free
//! more). glibc locks each arena while it walks it, so a trim in the middle of a burst
//! would hold up the threads allocating there, and under a steady load there is little to
//! give back. A burst's memory goes back within a check or two of its end; a page reused
//! later costs one page fault. This is the one `unsafe` call of the crate (glibc's
//! allocator interface has no safe wrapper); other C libraries (musl, macOS) return
//! memory themselves, and there the task does nothing.

use std::sync::Arc;
use std::time::Duration;

use crate::pools::pool::Pool;
use crate::shutdown::Shutdown;

/// Between two looks at the RSS and the load.
pub const CHECK_EVERY: Duration = Duration::from_secs(10);

/// Trim only when at most this many requests are in flight (all workers together).
pub const QUIET_IN_FLIGHT: usize = 32;

/// Trim only when the RSS is at least this much above its level after the last trim
/// (or at start), in KiB.
pub const TRIM_GROWTH_KIB: u64 = 16 * 1024;

/// Trims after bursts, checking every [`CHECK_EVERY`], until `shutdown`.
pub async fn run(pool: Arc<Pool>, mut shutdown: Shutdown) {
    if !cfg!(all(target_os = "linux", target_env = "gnu")) {
        return;
    }
    let mut tick = tokio::time::interval(CHECK_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    let mut trimmed_at = rss_kib().unwrap_or(0);
    // The last trim gave back a lot: what the burst held is still being freed (its
    // connections close after their idle time-out), so trim again at the next check.
    let mut again = false;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.wait() => return,
        }
        let rss = rss_kib().unwrap_or(0);
        let in_flight: usize = pool.set().workers().iter().map(|w| w.in_flight()).sum();
        if !due(rss, trimmed_at, again, in_flight) {
            continue;
        }
        // Off the runtime's threads: it locks each arena in turn while it walks it
        // (0.1–12 ms measured, up to 40 ms after a burst of 5,000 streams).
        let (released, took) = tokio::task::spawn_blocking(|| {
            let started = std::time::Instant::now();
            (trim(), started.elapsed())
        })
        .await
        .unwrap_or_default();
        trimmed_at = rss_kib().unwrap_or(0);
        again = rss.saturating_sub(trimmed_at) >= TRIM_GROWTH_KIB;
        tracing::debug!(
            in_flight,
            released,
            took_us = took.as_micros() as u64,
            rss_before_kib = rss,
            rss_after_kib = trimmed_at,
            "gave the allocator's free pages back"
        );
    }
}

/// Whether a check trims: the router is quiet, and either the RSS grew by
/// [`TRIM_GROWTH_KIB`] since the last trim or that trim gave back as much (`again`).
fn due(rss_kib: u64, trimmed_at_kib: u64, again: bool, in_flight: usize) -> bool {
    in_flight <= QUIET_IN_FLIGHT && (again || rss_kib >= trimmed_at_kib + TRIM_GROWTH_KIB)
}

/// The process's resident set (`VmRSS` of `/proc/self/status`), in KiB.
fn rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// `malloc_trim(0)`: whether glibc gave any memory back.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[expect(
    unsafe_code,
    reason = "glibc's malloc_trim, through libc's declaration"
)]
pub fn trim() -> bool {
    // SAFETY: malloc_trim takes no pointer and is MT-safe (glibc locks each arena in
    // turn); it frees nothing the program holds.
    unsafe { libc::malloc_trim(0) == 1 }
}

/// Elsewhere: nothing to call (musl's and the other systems' allocators return freed
/// memory themselves).
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn trim() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trims_after_growth_or_a_large_release_and_only_when_quiet() {
        let base = 20 * 1024;
        // Grown by the threshold, quiet: trim; busy: wait.
        assert!(due(base + TRIM_GROWTH_KIB, base, false, 0));
        assert!(!due(
            base + TRIM_GROWTH_KIB,
            base,
            false,
            QUIET_IN_FLIGHT + 1
        ));
        // Steady: nothing to give back.
        assert!(!due(base + TRIM_GROWTH_KIB - 1, base, false, 0));
        // The last trim released a lot: once more.
        assert!(due(base, base, true, QUIET_IN_FLIGHT));
    }

    #[test]
    fn reads_its_own_rss() {
        if cfg!(target_os = "linux") {
            assert!(rss_kib().is_some_and(|kib| kib > 0));
        }
    }
}

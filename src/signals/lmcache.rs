//! LMCache occupancy signals (`workers[].lmcache`, `policy: lmcache_aware`).
//!
//! Each configured worker's `endpoint` is polled every `refresh_secs`, bounded by the
//! same time-out, for a JSON object `{"occupancy": 0.42, "cache_available": true}`.
//! Occupancy is clamped to [0, 1]. A failed poll, a non-2xx answer or a body without both
//! fields (or of the wrong types) keeps the last good signal until it goes stale after
//! `stale_secs`, and is counted.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::task::JoinSet;

use crate::pools::pool::signals::LmcacheSignal;
use crate::pools::pool::{Fetch, Target};
use crate::pools::pool::{Pool, WorkerId};
use crate::shutdown::Shutdown;

/// Largest signal body read, in bytes.
pub const MAX_SIGNAL_BYTES: usize = 64 << 10;

/// One finished poll: whose, and what came back.
type Polled = (
    WorkerId,
    Arc<crate::pools::pool::Worker>,
    Result<(http::StatusCode, bytes::Bytes), String>,
);

/// How often the task looks for polls that are due.
const TICK: Duration = Duration::from_millis(100);

/// Reads one signal body: `(occupancy clamped to [0, 1], cache_available)`, or `None`
/// when it is not a JSON object with a number `occupancy` and a boolean
/// `cache_available`.
pub fn parse(body: &[u8]) -> Option<(f64, bool)> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let o = v.as_object()?;
    let occupancy = o.get("occupancy")?.as_f64()?;
    let available = o.get("cache_available")?.as_bool()?;
    occupancy
        .is_finite()
        .then(|| (occupancy.clamp(0.0, 1.0), available))
}

/// Polls every worker that has `lmcache:` until shutdown (see the module docs).
pub async fn run<F: Fetch>(pool: Arc<Pool>, fetch: F, mut shutdown: Shutdown) {
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut due: HashMap<WorkerId, Instant> = HashMap::new();
    let mut polls: JoinSet<Polled> = JoinSet::new();
    let mut in_flight: HashSet<WorkerId> = HashSet::new();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            Some(joined) = polls.join_next(), if !polls.is_empty() => {
                if let Ok((id, worker, got)) = joined {
                    in_flight.remove(&id);
                    record(&worker, got);
                }
                continue;
            }
            _ = shutdown.wait() => return,
        }
        let now = crate::clock::now();
        let set = pool.set();
        for worker in set.workers() {
            let Some(cfg) = worker.config().lmcache.clone() else {
                continue;
            };
            let id = worker.id();
            if in_flight.contains(&id) || due.get(&id).is_some_and(|t| now < *t) {
                continue;
            }
            due.insert(id, now + cfg.refresh);
            in_flight.insert(id);
            let worker = Arc::clone(worker);
            let fetch = fetch.clone();
            polls.spawn(async move {
                let target = if cfg.endpoint.starts_with('/') {
                    Target::Path(&cfg.endpoint)
                } else {
                    Target::Url(&cfg.endpoint)
                };
                let got = fetch
                    .get(&worker, target, cfg.refresh, MAX_SIGNAL_BYTES)
                    .await;
                (id, worker, got)
            });
        }
        due.retain(|id, _| set.get(*id).is_some());
    }
}

fn record(
    worker: &crate::pools::pool::Worker,
    got: Result<(http::StatusCode, bytes::Bytes), String>,
) {
    let counts = &worker.signals().lmcache_polls;
    match got {
        Ok((status, body)) if status.is_success() => match parse(&body) {
            Some((occupancy, cache_available)) => {
                worker.signals().set_lmcache(LmcacheSignal {
                    occupancy,
                    cache_available,
                    at: crate::clock::now(),
                });
                counts.ok.fetch_add(1, Ordering::Relaxed);
            }
            None => {
                counts.unparsable.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(worker = %worker.url(), "LMCache signal malformed");
            }
        },
        Ok((status, _)) => {
            counts.failed.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(worker = %worker.url(), %status, "LMCache signal refused");
        }
        Err(e) => {
            counts.failed.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(worker = %worker.url(), error = %crate::redact::text(&e), "LMCache signal unreachable");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_are_clamped_and_malformed_ones_refused() {
        assert_eq!(
            parse(br#"{"occupancy": 0.42, "cache_available": true}"#),
            Some((0.42, true))
        );
        assert_eq!(
            parse(br#"{"occupancy": 7, "cache_available": false, "extra": 1}"#),
            Some((1.0, false))
        );
        assert_eq!(
            parse(br#"{"occupancy": -3, "cache_available": true}"#),
            Some((0.0, true))
        );
        for bad in [
            &br#"{"occupancy": "0.4", "cache_available": true}"#[..],
            br#"{"occupancy": 0.4}"#,
            br#"{"cache_available": true}"#,
            br#"[0.4, true]"#,
            b"not json",
            b"",
            br#"{"occupancy": 1e999, "cache_available": true}"#,
        ] {
            assert_eq!(parse(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }
}

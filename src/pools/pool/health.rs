//! Active health checks: probe every worker's `health.endpoint` each `interval`.
//!
//! `failure_threshold` consecutive failed probes (non-2xx, connect error, timeout) mark
//! a worker unhealthy; `success_threshold` consecutive good ones bring it back. An
//! isolated failure changes nothing. A worker that turns unhealthy is reported to the
//! pool's listeners ([`Pool::mark_down`]): its KV cache is presumed cold when it returns,
//! so the policy drops its routing memory (tree entries; in precise mode its blocks, and
//! its KV-event feeds start over). Probes carry the backend API key like proxied
//! requests do (the [`Fetch`] is the proxy's upstream client).

use std::sync::Arc;

use tokio::task::JoinSet;
use tokio::time::MissedTickBehavior;

use super::{Fetch, Pool, ProbeRun, Target};
use crate::config::HealthConfig;
use crate::shutdown::Shutdown;

/// Largest probe answer read, in bytes (a health body is small; the rest is refused).
const MAX_PROBE_BYTES: usize = 64 * 1024;

/// Folds one probe result into a worker's run of results. Returns the new health when
/// it changes. A worker's first probe (`probed` false: it just joined) decides at once,
/// either way: a new worker is not trusted, nor kept out, on a threshold's worth of
/// probes.
pub fn observe(
    run: &mut ProbeRun,
    healthy: bool,
    probed: bool,
    ok: bool,
    cfg: &HealthConfig,
) -> Option<bool> {
    if !probed {
        run.successes = ok as u32;
        run.failures = !ok as u32;
        return (ok != healthy).then_some(ok);
    }
    if ok {
        run.failures = 0;
        run.successes = run.successes.saturating_add(1);
        (!healthy && run.successes >= cfg.success_threshold).then_some(true)
    } else {
        run.successes = 0;
        run.failures = run.failures.saturating_add(1);
        (healthy && run.failures >= cfg.failure_threshold).then_some(false)
    }
}

/// Probes every worker of the current set each interval until shutdown, and a worker
/// that joins (start-up, SIGHUP, admin API, discovery) at once.
pub async fn run<F: Fetch>(pool: Arc<Pool>, cfg: HealthConfig, fetch: F, mut shutdown: Shutdown) {
    let mut tick = tokio::time::interval(cfg.interval);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        let only_new = tokio::select! {
            _ = tick.tick() => false,
            _ = pool.worker_joined().notified() => true,
            _ = shutdown.wait() => return,
        };
        probe_round(&pool, &cfg, &fetch, only_new).await;
    }
}

/// Probes the set's workers (only those no probe has answered yet when `only_new`)
/// and applies the results.
async fn probe_round<F: Fetch>(pool: &Pool, cfg: &HealthConfig, fetch: &F, only_new: bool) {
    let set = pool.set();
    let mut probes = JoinSet::new();
    for worker in set.workers().iter().filter(|w| !only_new || !w.is_probed()) {
        let worker = Arc::clone(worker);
        let fetch = fetch.clone();
        let (path, timeout) = (cfg.endpoint.clone(), cfg.timeout);
        probes.spawn(async move {
            let result = fetch
                .get(&worker, Target::Path(&path), timeout, MAX_PROBE_BYTES)
                .await
                .map(|(status, _)| status);
            (worker.id(), result)
        });
    }
    while let Some(joined) = probes.join_next().await {
        let Ok((id, result)) = joined else { continue };
        let Some(worker) = set.get(id) else { continue };
        let ok = matches!(result, Ok(s) if s.is_success());
        let first = !worker.is_probed();
        let change = {
            let mut run = worker.probe_run();
            run.last_error = match &result {
                Ok(s) if s.is_success() => None,
                Ok(s) => Some(format!("status {s}")),
                Err(e) => Some(e.clone()),
            };
            observe(&mut run, worker.is_healthy(), !first, ok, cfg)
        };
        worker.set_probed();
        match (change, &result) {
            (Some(true), _) => {
                worker.set_healthy(true);
                tracing::info!(worker = %worker.url(), "worker healthy again");
            }
            (Some(false), r) => {
                worker.set_healthy(false);
                pool.mark_down(worker);
                let why = match r {
                    Ok(s) => format!("status {s}"),
                    Err(e) => e.clone(),
                };
                if first {
                    tracing::warn!(worker = %worker.url(), reason = %why, "new worker unhealthy: its first health probe failed");
                } else {
                    tracing::warn!(worker = %worker.url(), reason = %why, "worker unhealthy; its tree entries (and precise blocks) dropped");
                }
            }
            (None, Err(e)) => {
                tracing::debug!(worker = %worker.url(), error = %e, "health probe failed")
            }
            (None, Ok(s)) if !s.is_success() => {
                tracing::debug!(worker = %worker.url(), status = %s, "health probe failed")
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn cfg() -> HealthConfig {
        HealthConfig {
            endpoint: "/health".into(),
            interval: Duration::from_secs(1),
            timeout: Duration::from_secs(1),
            failure_threshold: 3,
            success_threshold: 2,
        }
    }

    /// Runs a sequence of probe results; returns the health after each.
    fn replay(seq: &str) -> Vec<bool> {
        let mut run = ProbeRun::default();
        let mut healthy = true;
        seq.chars()
            .enumerate()
            .map(|(i, c)| {
                if let Some(h) = observe(&mut run, healthy, i > 0, c == '+', &cfg()) {
                    healthy = h;
                }
                healthy
            })
            .collect()
    }

    #[test]
    fn a_new_workers_first_probe_decides_at_once() {
        assert_eq!(replay("-"), [false]);
        assert_eq!(replay("-+++"), [false, false, true, true]);
        assert_eq!(replay("+--"), [true, true, true]);
    }

    #[test]
    fn isolated_failures_change_nothing() {
        assert!(replay("+++-+++-++-++--+++").iter().all(|h| *h));
    }

    #[test]
    fn consecutive_thresholds_flip_health_once_each_way() {
        let h = replay("++---+-++");
        assert_eq!(
            h,
            [true, true, true, true, false, false, false, false, true]
        );
    }
}

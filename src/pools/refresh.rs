//! The model-list reads: every worker's `GET /v1/models` when it joins and every
//! `models.refresh_secs` (default: the health interval), each within `health.timeout_secs`;
//! when a worker's list changed, the table is rebuilt (and a pool made for a model seen
//! for the first time). Never on the request path: a request reads the table that the
//! last read left.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio::time::MissedTickBehavior;

use super::Pools;
use super::pool::Fetch;
use super::pool::models::{self, ListSource};
use crate::shutdown::Shutdown;

/// Reads the lists every `every` (each read within `timeout`) and those of workers that
/// join at once, until shutdown.
pub async fn run<P: Clone + Send + Sync + 'static, F: Fetch>(
    pools: Arc<Pools<P>>,
    every: Duration,
    timeout: Duration,
    fetch: F,
    mut shutdown: Shutdown,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        let joined = tokio::select! {
            _ = tick.tick() => false,
            _ = pools.membership_changed().notified() => true,
            _ = shutdown.wait() => return,
        };
        read_round(&pools, &fetch, timeout, joined).await;
    }
}

/// Reads every worker's list (only those never read when `joined`), then rebuilds the
/// table if one changed (always after a membership change: a pinned worker may bring a
/// model without a pool).
async fn read_round<P: Clone + Send + Sync + 'static, F: Fetch>(
    pools: &Pools<P>,
    fetch: &F,
    timeout: Duration,
    joined: bool,
) {
    let set = pools.workers().set();
    let mut reads = JoinSet::new();
    for worker in set.workers() {
        if joined && worker.served().source != ListSource::Unread {
            continue;
        }
        let (worker, fetch) = (Arc::clone(worker), fetch.clone());
        reads.spawn(async move { models::refresh(&fetch, &worker, timeout).await });
    }
    let mut changed = joined;
    while let Some(read) = reads.join_next().await {
        changed |= read.unwrap_or(false);
    }
    if changed {
        pools.update();
    }
}

//! The KV-event supervisor: one consumer task per feed, kept in step with the pool.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;

use crate::pools::pool::Pool;
use crate::precise::feed::Feed;
use crate::precise::index::SourceId;
use crate::precise::{Precise, consumer};
use crate::shutdown::Shutdown;

/// How often the supervisor compares the running consumers with the worker set.
const SUPERVISE_EVERY: Duration = Duration::from_millis(500);

/// Starts a consumer task per feed (each DP rank of each worker with `kv_events`) and
/// keeps that set in step with the worker set (SIGHUP reload, admin API): a worker that
/// leaves has every rank's consumer stopped and its blocks dropped. Runs until
/// `shutdown`. Like the health checker with its probes, it owns the tasks it starts.
pub async fn run(precise: Arc<Precise>, pool: Arc<Pool>, mut shutdown: Shutdown) {
    let mut running: HashMap<SourceId, (Arc<Feed>, JoinHandle<()>)> = HashMap::new();
    let mut tick = tokio::time::interval(SUPERVISE_EVERY);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.wait() => break,
        }
        let set = pool.set();
        let current: Vec<Arc<Feed>> = set
            .workers()
            .iter()
            .flat_map(|w| w.feeds().iter().cloned())
            .collect();
        let gone: Vec<SourceId> = running
            .iter()
            .filter(|(_, (feed, _))| !current.iter().any(|f| Arc::ptr_eq(f, feed)))
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            if let Some((feed, task)) = running.remove(&id) {
                task.abort();
                let _ = task.await;
                precise.index().clear_source(id);
                tracing::info!(endpoint = %feed.endpoint(), rank = feed.rank(), "kv-events: worker left the pool; consumer stopped");
            }
        }
        for feed in current {
            running.entry(feed.source()).or_insert_with(|| {
                let task = tokio::spawn(consumer::run(
                    Arc::clone(&feed),
                    Arc::clone(&precise),
                    shutdown.clone(),
                ));
                (feed, task)
            });
        }
    }
    for (_, (_, task)) in running {
        let _ = task.await;
    }
}

//! Engine queues during a replay: every engine's `GET /metrics` polled at a fixed
//! interval into [`QueueStats`].

use std::time::Duration;

use bytes::Bytes;

use crate::stats::{EngineLoad, QueueStats, parse_engine_load};

/// How often [`QueueSampler`] polls every engine's `/metrics` (wall clock).
pub const QUEUE_SAMPLE_EVERY: Duration = Duration::from_millis(100);

/// Polls every engine's `GET /metrics` at a fixed wall-clock interval on a
/// background task and accumulates [`QueueStats`]: per-engine peak waiting and
/// how often a queue stood while another engine was idle. Stopped by
/// [`QueueSampler::finish`]; dropping it aborts the task.
#[derive(Debug)]
pub struct QueueSampler {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<QueueStats>,
}

impl QueueSampler {
    /// Starts polling `urls` (engine base URLs, named `names`) every `every`;
    /// needs a tokio runtime.
    pub fn start(names: &[String], urls: &[String], every: Duration) -> Self {
        use hyper_util::client::legacy::Client;
        use hyper_util::client::legacy::connect::HttpConnector;
        use hyper_util::rt::TokioExecutor;
        let targets: Vec<Option<hyper::Uri>> = urls
            .iter()
            .map(|u| format!("{}/metrics", u.trim_end_matches('/')).parse().ok())
            .collect();
        let client: Client<HttpConnector, http_body_util::Empty<Bytes>> =
            Client::builder(TokioExecutor::new()).build(HttpConnector::new());
        let (stop, mut stopped) = tokio::sync::oneshot::channel();
        let mut stats = QueueStats::new(names);
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = &mut stopped => break,
                    _ = tick.tick() => stats.record(&poll_loads(&client, &targets).await),
                }
            }
            // One last read for the engines' own high-water marks.
            stats.record_peaks(&poll_loads(&client, &targets).await);
            stats
        });
        Self {
            stop: Some(stop),
            task,
        }
    }

    /// Stops polling and returns what was seen.
    pub async fn finish(mut self) -> QueueStats {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        (&mut self.task).await.unwrap_or_default()
    }
}

impl Drop for QueueSampler {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One `GET /metrics` per target, all at once (1 s limit each); `None` where a
/// target did not answer 2xx with readable queue gauges.
async fn poll_loads(
    client: &hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        http_body_util::Empty<Bytes>,
    >,
    targets: &[Option<hyper::Uri>],
) -> Vec<Option<EngineLoad>> {
    use http_body_util::BodyExt;
    let mut set = tokio::task::JoinSet::new();
    for (i, uri) in targets.iter().enumerate() {
        let (client, uri) = (client.clone(), uri.clone());
        set.spawn(async move {
            let read = async {
                let resp = client.get(uri?).await.ok()?;
                if !resp.status().is_success() {
                    return None;
                }
                let body = resp.into_body().collect().await.ok()?.to_bytes();
                parse_engine_load(&String::from_utf8_lossy(&body))
            };
            let load = tokio::time::timeout(Duration::from_secs(1), read)
                .await
                .ok()
                .flatten();
            (i, load)
        });
    }
    let mut out = vec![None; targets.len()];
    while let Some(joined) = set.join_next().await {
        if let Ok((i, load)) = joined {
            out[i] = load;
        }
    }
    out
}

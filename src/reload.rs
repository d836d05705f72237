//! SIGHUP reload: re-read every `-c` file and swap the worker list.
//!
//! Only `workers` may change. A file that fails to load, or a change to any other key,
//! is logged and the running config kept. Surviving workers keep their state and their
//! routing memory (see [`Pool::replace`]); the `/v1/models` cache starts fresh. Each
//! attempt is counted in `/metrics` (`reloads_total{result}`, [`ReloadMetrics`]).

use std::path::PathBuf;
use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use crate::config::Config;
use crate::metrics::Metrics;
use crate::pools::pool::Pool;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

/// `reloads_total{result}`: every result at 0 from start-up.
#[derive(Clone, Debug)]
pub struct ReloadMetrics {
    reloads: Family<ResultLabels, Counter>,
}

impl ReloadMetrics {
    /// The family, registered in `registry`.
    pub fn register(registry: &mut Metrics) -> Self {
        let reloads = Family::default();
        for result in ["applied", "rejected", "invalid"] {
            let _ = reloads.get_or_create(&ResultLabels { result });
        }
        registry.register_family(
            "reloads",
            "SIGHUP reloads by result (applied, rejected, invalid)",
            reloads.clone(),
        );
        ReloadMetrics { reloads }
    }

    /// A reload attempt that ended as `outcome`.
    fn count(&self, outcome: &Outcome) {
        let result = match outcome {
            Outcome::Applied { .. } => "applied",
            Outcome::Rejected { .. } => "rejected",
            Outcome::Invalid(_) => "invalid",
        };
        self.reloads.get_or_create(&ResultLabels { result }).inc();
    }
}

/// What a reload did.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    Applied {
        workers: usize,
    },
    /// The files did not load; the message names file, key and value.
    Invalid(String),
    /// A key other than `workers` differs: the first differing section, and every key
    /// the files changed (see [`Config::changed_settings`]).
    Rejected {
        key: &'static str,
        changes: Vec<String>,
    },
}

/// Loads `files` and applies them to `pool` if only `workers` differs from `running`.
pub fn apply(running: &Config, pool: &Pool, files: &[PathBuf]) -> Outcome {
    let next = match Config::load_with(files, false) {
        Ok(c) => c,
        Err(e) => return Outcome::Invalid(e.to_string()),
    };
    if let Some(key) = running.non_worker_difference(&next) {
        return Outcome::Rejected {
            key,
            changes: running.changed_settings(&next),
        };
    }
    if next.workers.is_empty() {
        tracing::warn!(
            "reload leaves no workers: every request gets 503 until workers are listed again"
        );
    }
    pool.replace(&next.workers);
    Outcome::Applied {
        workers: next.workers.len(),
    }
}

/// Applies the files on each SIGHUP received by `hup` (registered by the caller before
/// the router listens, so an early SIGHUP never hits the default action, which would
/// end the process). Each outcome is logged and counted in `/metrics`.
pub async fn run(
    running: Config,
    pool: Arc<Pool>,
    metrics: ReloadMetrics,
    files: Vec<PathBuf>,
    mut hup: tokio::signal::unix::Signal,
) {
    let running = Arc::new(running);
    while hup.recv().await.is_some() {
        // Reading and parsing the files is blocking I/O: off the async workers.
        let (c, p, f) = (Arc::clone(&running), Arc::clone(&pool), files.clone());
        let outcome = match tokio::task::spawn_blocking(move || apply(&c, &p, &f)).await {
            Ok(o) => o,
            Err(e) => Outcome::Invalid(format!("reload task failed: {e}")),
        };
        metrics.count(&outcome);
        match outcome {
            Outcome::Applied { workers } => tracing::info!(workers, "reload applied"),
            Outcome::Invalid(e) => {
                tracing::error!(error = %e, "reload failed; keeping the running config")
            }
            Outcome::Rejected { key, changes } => tracing::error!(
                section = key,
                changes = %if changes.is_empty() {
                    format!("`{key}` (no key in the files differs: a value read from the environment or from a file changed)")
                } else {
                    changes.join("; ")
                },
                "reload rejected: only `workers` may change without a restart; keeping the running config"
            ),
        }
    }
}

//! SIGHUP reload: re-read every `-c` file and swap the worker list.
//!
//! Only `workers` may change. A file that fails to load, or a change to any other key,
//! is logged and the running config kept. Surviving workers keep their state (see
//! [`Router::replace_workers`]); the tree and the `/v1/models` cache start fresh.

use std::path::PathBuf;
use std::sync::Arc;

use crate::config::Config;
use crate::proxy::Router;

/// What a reload did.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    Applied {
        workers: usize,
    },
    /// The files did not load; the message names file, key and value.
    Invalid(String),
    /// A key other than `workers` differs.
    Rejected {
        key: &'static str,
    },
}

/// Loads `files` and applies them to `router` if only `workers` changed.
pub fn apply(router: &Router, files: &[PathBuf]) -> Outcome {
    let next = match Config::load_with(files, false) {
        Ok(c) => c,
        Err(e) => return Outcome::Invalid(e.to_string()),
    };
    if let Some(key) = router.config().non_worker_difference(&next) {
        return Outcome::Rejected { key };
    }
    if next.workers.is_empty() {
        tracing::warn!(
            "reload leaves no workers: every request gets 503 until workers are listed again"
        );
    }
    router.replace_workers(&next.workers);
    Outcome::Applied {
        workers: next.workers.len(),
    }
}

/// Applies the files on each SIGHUP received by `hup` (registered by the caller before
/// the router listens, so an early SIGHUP never hits the default action, which would
/// end the process). Each outcome is logged and counted in `/metrics`.
pub async fn run(router: Arc<Router>, files: Vec<PathBuf>, mut hup: tokio::signal::unix::Signal) {
    while hup.recv().await.is_some() {
        // Reading and parsing the files is blocking I/O: off the async workers.
        let (r, f) = (Arc::clone(&router), files.clone());
        let outcome = match tokio::task::spawn_blocking(move || apply(&r, &f)).await {
            Ok(o) => o,
            Err(e) => Outcome::Invalid(format!("reload task failed: {e}")),
        };
        router.metrics().reload(match outcome {
            Outcome::Applied { .. } => "applied",
            Outcome::Rejected { .. } => "rejected",
            Outcome::Invalid(_) => "invalid",
        });
        match outcome {
            Outcome::Applied { workers } => tracing::info!(workers, "reload applied"),
            Outcome::Invalid(e) => {
                tracing::error!(error = %e, "reload failed; keeping the running config")
            }
            Outcome::Rejected { key } => tracing::error!(
                key,
                "reload rejected: only `workers` may change without a restart; keeping the running config"
            ),
        }
    }
}

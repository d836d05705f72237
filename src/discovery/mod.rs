//! Workers found at run time (`discovery:`), fed into the pool's one membership path
//! ([`crate::pools::pool::Pool::set_discovered`]): the same one SIGHUP and the admin API use.
//!
//! - `dns`: the A/AAAA records of a name (a Kubernetes headless Service lists its ready
//!   pods), re-resolved every `interval_secs` ([`dns`]).
//!
//! For DNS, a lookup that fails or finds nothing leaves the list as it was (a resolver hiccup
//! must not empty the pool); a worker leaves only after it is missing from
//! [`ABSENT_ROUNDS`] lookups in a row, so a flapping record does not churn the pool (each
//! leave forgets the worker's routing memory).

pub mod dns;
pub mod kubernetes;

use std::collections::{BTreeMap, BTreeSet};

use crate::config::WorkerConfig;
use crate::pools::pool::Pool;

/// Consecutive lookups a worker must be missing from before it leaves.
pub const ABSENT_ROUNDS: u32 = 2;

/// What one source found, with the hysteresis of the module docs.
#[derive(Debug, Default)]
pub struct Found {
    /// URL -> lookups in a row it was missing from (0 = seen in the last one).
    members: BTreeMap<String, u32>,
}

impl Found {
    /// Folds in one lookup's URLs; `Some(list)` when the membership changed.
    pub fn update(&mut self, seen: &BTreeSet<String>) -> Option<Vec<String>> {
        if seen.is_empty() {
            return None;
        }
        let before: Vec<String> = self.members.keys().cloned().collect();
        for (url, missing) in self.members.iter_mut() {
            *missing = if seen.contains(url) { 0 } else { *missing + 1 };
        }
        self.members.retain(|_, missing| *missing < ABSENT_ROUNDS);
        for url in seen {
            self.members.entry(url.clone()).or_insert(0);
        }
        let after: Vec<String> = self.members.keys().cloned().collect();
        (after != before).then_some(after)
    }
}

/// A discovered worker: `url` with every other setting at its default (the backend key
/// is `proxy.api_key`).
pub fn worker(url: &str) -> Result<WorkerConfig, String> {
    WorkerConfig::from_json(serde_json::json!({ "url": url }).to_string().as_bytes())
}

/// Hands `pool` the workers at `urls` (`source` names the discovery in the log).
pub fn publish<'a>(pool: &Pool, urls: impl IntoIterator<Item = &'a String>, source: &str) {
    let workers: Vec<WorkerConfig> = urls
        .into_iter()
        .filter_map(|u| {
            worker(u)
                .inspect_err(|e| tracing::warn!(url = %u, error = %e, "discovered address is not a worker URL"))
                .ok()
        })
        .collect();
    tracing::info!(
        source,
        workers = workers.len(),
        "discovery: worker list changed"
    );
    pool.set_discovered(workers);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(urls: &[&str]) -> BTreeSet<String> {
        urls.iter().map(|u| u.to_string()).collect()
    }

    #[test]
    fn joins_at_once_leaves_after_two_misses_and_ignores_empty_answers() {
        let mut f = Found::default();
        assert_eq!(
            f.update(&set(&["a", "b"])),
            Some(vec!["a".into(), "b".into()])
        );
        assert_eq!(f.update(&set(&["a", "b"])), None);
        // b flaps out for one lookup: stays.
        assert_eq!(f.update(&set(&["a"])), None);
        assert_eq!(f.update(&set(&["a", "b"])), None);
        // Gone for two lookups: leaves.
        assert_eq!(f.update(&set(&["a"])), None);
        assert_eq!(f.update(&set(&["a"])), Some(vec!["a".into()]));
        // Nothing found: nothing changes.
        assert_eq!(f.update(&set(&[])), None);
        assert_eq!(f.update(&set(&["c"])), Some(vec!["a".into(), "c".into()]));
    }

    #[test]
    fn a_discovered_worker_has_the_defaults() {
        let w = worker("http://10.0.0.7:8000").unwrap();
        assert_eq!(w.key(), "http://10.0.0.7:8000");
        assert!(w.cache_aware);
        assert!(worker("ftp://x").is_err());
    }
}

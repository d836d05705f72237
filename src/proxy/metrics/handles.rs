//! Per-worker handles to the series a routed request updates, resolved once per worker
//! instead of once per update: a `Family` lookup hashes the worker's name (SipHash) and
//! takes the family's read lock, and an answer makes about ten of them (~6k of the
//! ~133k instructions a routed request costs, measured with callgrind).
//!
//! The table is keyed by the address of the worker's label (`Arc<str>`, the one
//! `Worker::label` hands out): it holds a clone of that `Arc`, so the address cannot be
//! reused for another name while the entry lives. Filled on a worker's first update,
//! rebuilt at each scrape from the pool (departed workers' handles go with their
//! series), and read lock-free (`ArcSwap`).

use std::sync::{Arc, Mutex, OnceLock};

use arc_swap::ArcSwap;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

use super::{PREFIX_KINDS, PrefixLabels, RequestMetrics, WorkerLabels};

/// A table this large without a scrape to prune it (a churning pool, never scraped)
/// starts again empty.
const MAX_ENTRIES: usize = 8192;

/// One worker's series (clones share the family's values).
#[derive(Debug)]
pub(super) struct WorkerHandles {
    /// Held so that its address names this worker while the table keeps it.
    label: Arc<str>,
    pub estimated_saved: Counter,
    pub engine_cached: Counter,
    pub engine_prompt: Counter,
    /// Created on the first reading (a drift of 0 would mean something).
    drift: OnceLock<Gauge<f64, std::sync::atomic::AtomicU64>>,
    pub drift_low: Gauge,
    pub ttfb: Histogram,
    pub duration: Histogram,
    /// `prefix_tokens_total` (available, predicted, delivered) under the policy of the
    /// first answer; another policy (after a reload) goes through the family until the
    /// next scrape rebuilds the table.
    prefix: OnceLock<(&'static str, [Counter; 3])>,
}

impl WorkerHandles {
    /// The drift gauge, created on its first reading.
    pub fn drift(&self, m: &RequestMetrics) -> &Gauge<f64, std::sync::atomic::AtomicU64> {
        self.drift.get_or_init(|| {
            m.drift
                .get_or_create(&WorkerLabels {
                    worker: Arc::clone(&self.label),
                })
                .clone()
        })
    }

    /// The prefix counters under `policy`.
    pub fn prefix(&self, m: &RequestMetrics, policy: &'static str) -> Option<&[Counter; 3]> {
        let (p, c) = self.prefix.get_or_init(|| {
            m.note_policy(&self.label, policy);
            let c = PREFIX_KINDS.map(|kind| {
                m.prefix_tokens
                    .get_or_create(&PrefixLabels {
                        worker: Arc::clone(&self.label),
                        policy,
                        kind,
                    })
                    .clone()
            });
            (policy, c)
        });
        (*p == policy).then_some(c)
    }
}

/// Handles sorted by label address.
type Table = Vec<(usize, Arc<WorkerHandles>)>;

/// See the module docs.
#[derive(Debug, Default)]
pub(super) struct Handles {
    table: ArcSwap<Table>,
    /// Serialises writers (a copy of the table each; readers never wait).
    write: Mutex<()>,
}

fn key(label: &Arc<str>) -> usize {
    Arc::as_ptr(label).cast::<u8>() as usize
}

impl Handles {
    /// `label`'s handles, resolved (and kept) on its first use.
    pub fn get(&self, m: &RequestMetrics, label: &Arc<str>) -> Arc<WorkerHandles> {
        let k = key(label);
        let table = self.table.load();
        if let Ok(i) = table.binary_search_by_key(&k, |(a, _)| *a) {
            return Arc::clone(&table[i].1);
        }
        drop(table);
        let h = Arc::new(resolve(m, label));
        let _w = self.write.lock().unwrap_or_else(|e| e.into_inner());
        let mut t: Table = if self.table.load().len() >= MAX_ENTRIES {
            Vec::new()
        } else {
            (**self.table.load()).clone()
        };
        if let Err(i) = t.binary_search_by_key(&k, |(a, _)| *a) {
            t.insert(i, (k, Arc::clone(&h)));
        }
        self.table.store(Arc::new(t));
        h
    }

    /// Keeps the handles of `labels` (the pool now) and drops the rest, after a scrape
    /// removed the departed workers' series.
    pub fn retain(&self, m: &RequestMetrics, labels: &[Arc<str>]) {
        let _w = self.write.lock().unwrap_or_else(|e| e.into_inner());
        let old = self.table.load();
        let mut t: Table = labels
            .iter()
            .map(|l| {
                let k = key(l);
                let h = match old.binary_search_by_key(&k, |(a, _)| *a) {
                    Ok(i) => Arc::clone(&old[i].1),
                    Err(_) => Arc::new(resolve(m, l)),
                };
                (k, h)
            })
            .collect();
        t.sort_unstable_by_key(|(a, _)| *a);
        t.dedup_by_key(|(a, _)| *a);
        self.table.store(Arc::new(t));
    }

    /// Drops the handles of the worker named `name` (it left; its series went).
    pub fn forget(&self, name: &str) {
        let _w = self.write.lock().unwrap_or_else(|e| e.into_inner());
        let mut t: Table = (**self.table.load()).clone();
        t.retain(|(_, h)| *h.label != *name);
        self.table.store(Arc::new(t));
    }

    /// Entries held (tests).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.table.load().len()
    }
}

/// Clones of `label`'s series from the families (created at 0 when absent).
fn resolve(m: &RequestMetrics, label: &Arc<str>) -> WorkerHandles {
    m.note_worker(label);
    let l = WorkerLabels {
        worker: Arc::clone(label),
    };
    WorkerHandles {
        label: Arc::clone(label),
        estimated_saved: m.estimated_saved.get_or_create(&l).clone(),
        engine_cached: m.engine_cached.get_or_create(&l).clone(),
        engine_prompt: m.engine_prompt.get_or_create(&l).clone(),
        drift: OnceLock::new(),
        drift_low: m.drift_low.get_or_create(&l).clone(),
        ttfb: m.ttfb.get_or_create(&l).clone(),
        duration: m.duration.get_or_create(&l).clone(),
        prefix: OnceLock::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pools::pool::hits::DriftNow;
    use std::time::Duration;

    #[test]
    fn handles_update_the_families_series_and_follow_the_pool() {
        let m = RequestMetrics::new();
        let (a, b): (Arc<str>, Arc<str>) = (Arc::from("a"), Arc::from("b"));
        let family = |l: &Arc<str>| {
            m.engine_cached
                .get_or_create(&WorkerLabels {
                    worker: Arc::clone(l),
                })
                .get()
        };
        let prefix = |policy, kind| {
            m.prefix_tokens
                .get_or_create(&PrefixLabels {
                    worker: Arc::clone(&a),
                    policy,
                    kind,
                })
                .get()
        };
        let drift = DriftNow {
            ratio: None,
            low: false,
            warn: false,
        };
        m.first_byte(&a, Duration::from_millis(5));
        m.engine_usage(&a, 100, 40);
        m.prefix_tokens(&a, "cache_aware", [10, 8, 6], drift);
        m.engine_usage(&b, 1, 1);
        assert_eq!(m.handles.len(), 2);
        assert_eq!(family(&a), 40);
        assert_eq!(prefix("cache_aware", "delivered"), 6);
        // No drift reading yet: no drift series (a 0 would be a reading).
        let labels = |l: &Arc<str>| WorkerLabels {
            worker: Arc::clone(l),
        };
        assert!(m.drift.get(&labels(&a)).is_none());
        let read = DriftNow {
            ratio: Some(0.5),
            ..drift
        };
        m.prefix_tokens(&a, "cache_aware", [0, 0, 0], read);
        assert_eq!(m.drift.get(&labels(&a)).map(|g| g.get()), Some(0.5));
        // Another Arc with the same name (a re-added worker) adds to the same series.
        let again: Arc<str> = Arc::from("a");
        m.engine_usage(&again, 0, 2);
        assert_eq!(family(&a), 42);
        // After a reload to another policy, its numbers go to its own series.
        m.prefix_tokens(&a, "round_robin", [1, 1, 1], drift);
        assert_eq!(prefix("round_robin", "available"), 1);
        assert_eq!(prefix("cache_aware", "available"), 10);
        // A scrape keeps the pool's workers only.
        m.handles.retain(&m, std::slice::from_ref(&b));
        assert_eq!(m.handles.len(), 1);
        m.engine_usage(&b, 0, 1);
        assert_eq!(family(&b), 2);
    }
}

//! What a policy's state shows to operators, through one interface.
//!
//! A policy hands out a [`View`] of each part of routing memory it owns
//! ([`super::Policy::views`]): the prefix tree, precise mode's KV-event index, the session
//! layer's bindings. A view adds its fields to `GET /workers`, gives the metric families
//! read from it at each scrape, and forgets its prefix records on `POST /cache/clear`. A
//! wrapper adds its own views to its inner policy's, so nothing forwards a view by hand,
//! and `admin` and `metrics` never name a policy's parts.

use std::sync::Arc;

use prometheus_client::collector::Collector;
use serde::Serialize;

use crate::pools::pool::{WorkerId, WorkerSet};

/// JSON fields of one `/workers` object.
pub type Fields = serde_json::Map<String, serde_json::Value>;

/// One part of a policy's routing memory, as operators see it. See the module docs.
pub trait View: Send + Sync {
    /// Adds this part's `/workers` fields: to the top level (`top`) and to each worker's
    /// entry (`workers`, in `set`'s order).
    fn workers(&self, set: &WorkerSet, top: &mut Fields, workers: &mut [Fields]);

    /// The metric families read from this part at each scrape, registered once when
    /// the metrics registry is built (`pool` gives the current workers); `None` when
    /// it has none.
    fn collector(&self, _pool: &Arc<crate::pools::pool::Pool>) -> Option<Box<dyn Collector>> {
        None
    }

    /// Forgets this part's prefix records (`POST /cache/clear`): every worker's, or
    /// `worker`'s only. Returns the records removed, `None` when it keeps none. Blocking
    /// (a large tree is freed in steps): call it off the async runtime's threads.
    fn clear(&self, _worker: Option<WorkerId>) -> Option<usize> {
        None
    }
}

pub use crate::exposition::{counter, family, gauge};

/// Sets `key` to `value` in `fields` (a value that cannot be shown as JSON is left out).
pub fn put(fields: &mut Fields, key: &str, value: impl Serialize) {
    if let Ok(v) = serde_json::to_value(value) {
        fields.insert(key.to_string(), v);
    }
}

/// Every pool's policy's views' metric families, read from the routing table at each
/// scrape (pools made since start included): the default pool's unlabelled (as a
/// router with one pool writes them; the first model's pool shares its policy), each
/// other model's pool's labelled `model="<its name>"`. The registry merges a family
/// several pools write into one.
pub struct PoolViews(pub Arc<super::Routes>);

impl crate::metrics::ScrapeText for PoolViews {
    fn write(&self, out: &mut String) {
        let table = self.0.table();
        let mut registry =
            prometheus_client::registry::Registry::with_prefix(crate::metrics::PREFIX);
        let mut written: Vec<&Arc<dyn super::Policy>> = Vec::new();
        for (i, p) in table.pools().enumerate() {
            // A policy two pools share (the default's and the first model's) once.
            if written.iter().any(|w| Arc::ptr_eq(w, p.policy())) {
                continue;
            }
            written.push(p.policy());
            let r = if i == 0 {
                &mut registry
            } else {
                registry.sub_registry_with_label(("model".into(), p.name().to_string().into()))
            };
            for view in p.policy().views() {
                if let Some(c) = view.collector(self.0.workers()) {
                    r.register_collector(c);
                }
            }
            // A disaggregated pool's legs' policies, labelled by leg.
            for (leg, policy) in p.legs().into_iter().flat_map(|l| {
                [
                    (crate::pools::Leg::Prefill, &l.prefill),
                    (crate::pools::Leg::Decode, &l.decode),
                ]
            }) {
                if written.iter().any(|w| Arc::ptr_eq(w, policy)) {
                    continue;
                }
                written.push(policy);
                let r = r.sub_registry_with_label(("leg".into(), leg.as_str().into()));
                for view in policy.views() {
                    if let Some(c) = view.collector(self.0.workers()) {
                        r.register_collector(c);
                    }
                }
            }
        }
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::prometheus_text::encode(out, &registry);
    }
}

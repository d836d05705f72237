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
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Unit;
use serde::Serialize;

use crate::pool::{WorkerId, WorkerSet};

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
    fn collector(&self, _pool: &Arc<crate::pool::Pool>) -> Option<Box<dyn Collector>> {
        None
    }

    /// Forgets this part's prefix records (`POST /cache/clear`): every worker's, or
    /// `worker`'s only. Returns the records removed, `None` when it keeps none. Blocking
    /// (a large tree is freed in steps): call it off the async runtime's threads.
    fn clear(&self, _worker: Option<WorkerId>) -> Option<usize> {
        None
    }
}

/// Sets `key` to `value` in `fields` (a value that cannot be shown as JSON is left out).
pub fn put(fields: &mut Fields, key: &str, value: impl Serialize) {
    if let Ok(v) = serde_json::to_value(value) {
        fields.insert(key.to_string(), v);
    }
}

/// Writes the gauge `name` (the registry adds its prefix) with `help` and value `v`.
pub fn gauge(enc: &mut DescriptorEncoder, name: &str, help: &str, v: i64) -> std::fmt::Result {
    let g = ConstGauge::new(v);
    g.encode(enc.encode_descriptor(name, &described(help), None, g.metric_type())?)
}

/// Writes the counter `name` (`_total` added, as for a registered counter).
pub fn counter(enc: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> std::fmt::Result {
    let c = ConstCounter::new(v);
    c.encode(enc.encode_descriptor(name, &described(help), None, c.metric_type())?)
}

/// Writes `family` under `name` (with `unit`'s suffix), unless it holds no series (as
/// the registry does).
pub fn family(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    family: &impl EncodeMetric,
) -> std::fmt::Result {
    if family.is_empty() {
        return Ok(());
    }
    family.encode(enc.encode_descriptor(name, &described(help), unit, family.metric_type())?)
}

/// Help text as `Registry::register` writes it (with a closing period).
fn described(help: &str) -> String {
    format!("{help}.")
}

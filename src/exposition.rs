//! How a part writes its metric families at scrape time (a `prometheus_client`
//! `Collector`, registered once in the metrics registry): the registry adds the
//! `cache_aware_router_` prefix, these writers add what `Registry::register` would (a
//! closing period on the help text, `_total` on counters, nothing for an empty family).
//! Imports no part, so every part can use it.

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Unit;

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

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

/// `text` (Prometheus text exposition) with each family written once: the series of a
/// family that appears in several places (one per pool, each labelled with its model)
/// gathered under its first `# HELP` and `# TYPE`, families in order of first
/// appearance. A family is the lines from its `# HELP` up to the next one.
pub fn merge_families(text: &str) -> String {
    let mut order: Vec<&str> = Vec::new();
    let mut families: std::collections::HashMap<&str, (Vec<&str>, Vec<&str>)> =
        std::collections::HashMap::new();
    let mut current: Option<&str> = None;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let name = rest.split(' ').next().unwrap_or(rest);
            current = Some(name);
            let entry = families.entry(name).or_insert_with(|| {
                order.push(name);
                (Vec::new(), Vec::new())
            });
            if entry.0.is_empty() {
                entry.0.push(line);
            }
            continue;
        }
        let Some(name) = current else { continue };
        let Some(entry) = families.get_mut(name) else {
            continue;
        };
        if line.starts_with('#') {
            // `# TYPE` / `# UNIT`: the first family's stand.
            if entry.0.len() < 3 && !entry.0.contains(&line) && entry.1.is_empty() {
                entry.0.push(line);
            }
        } else if !line.is_empty() {
            entry.1.push(line);
        }
    }
    let mut out = String::with_capacity(text.len());
    for name in order {
        let (head, series) = &families[name];
        for line in head.iter().chain(series) {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_family_written_twice_is_written_once_with_every_series() {
        let text = "# HELP a_x Nodes.\n# TYPE a_x gauge\na_x 1\n# HELP a_y Bytes.\n# TYPE a_y gauge\na_y 2\n\
                    # HELP a_x Nodes.\n# TYPE a_x gauge\na_x{model=\"m\"} 3\n";
        assert_eq!(
            super::merge_families(text),
            "# HELP a_x Nodes.\n# TYPE a_x gauge\na_x 1\na_x{model=\"m\"} 3\n# HELP a_y Bytes.\n# TYPE a_y gauge\na_y 2\n"
        );
    }
}

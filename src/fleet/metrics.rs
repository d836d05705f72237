//! The fleet channel's families in `/metrics`, read from its counters at each scrape.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Unit;

use super::Fleet;
use crate::exposition::{counter, gauge};

/// See the module docs.
#[derive(Debug)]
pub struct FleetMetrics(pub Arc<Fleet>);

/// Writes a counter family labelled by `label`, one series per `(value, source)`.
fn by_label(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    label: &'static str,
    series: &[(&'static str, &AtomicU64)],
) -> std::fmt::Result {
    let help = format!("{help}.");
    let mut family = enc.encode_descriptor(name, &help, unit, MetricType::Counter)?;
    for (value, source) in series {
        ConstCounter::new(source.load(Ordering::Relaxed))
            .encode(family.encode_family(&[(label, *value)])?)?;
    }
    Ok(())
}

impl Collector for FleetMetrics {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let fleet = &*self.0;
        let c = &fleet.counts;
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        by_label(
            &mut enc,
            "fleet_messages",
            "Fleet channel messages (state.redis_url) published (out) and applied (in, others' only)",
            None,
            "direction",
            &[("out", &c.messages_out), ("in", &c.messages_in)],
        )?;
        by_label(
            &mut enc,
            "fleet",
            "Fleet channel payload bytes published (out) and applied (in)",
            Some(&Unit::Bytes),
            "direction",
            &[("out", &c.bytes_out), ("in", &c.bytes_in)],
        )?;
        by_label(
            &mut enc,
            "fleet_records",
            "Fleet records (prefix, load) published (out) and applied (in)",
            None,
            "direction",
            &[("out", &c.records_out), ("in", &c.records_in)],
        )?;
        counter(
            &mut enc,
            "fleet_dropped_records",
            "Prefix records dropped because the fleet publisher fell behind",
            n(&c.dropped),
        )?;
        counter(
            &mut enc,
            "fleet_malformed_messages",
            "Messages on the fleet channel that were not fleet messages",
            n(&c.malformed),
        )?;
        by_label(
            &mut enc,
            "fleet_errors",
            "Fleet Redis failures, by operation (publish, subscribe)",
            None,
            "op",
            &[
                ("publish", &c.publish_errors),
                ("subscribe", &c.subscribe_errors),
            ],
        )?;
        gauge(
            &mut enc,
            "fleet_connected",
            "1 while subscribed to the fleet channel",
            i64::from(c.connected.load(Ordering::Relaxed)),
        )?;
        gauge(
            &mut enc,
            "fleet_remote_prefix_records",
            "Prefix records (chunk hash, worker) held from the other router replicas",
            fleet.remote_records() as i64,
        )?;
        let help =
            "Requests the other router replicas have in flight on the worker, as last published.";
        let mut family =
            enc.encode_descriptor("worker_remote_in_flight", help, None, MetricType::Gauge)?;
        for w in fleet.pool.set().workers() {
            ConstGauge::new(w.remote_in_flight() as i64)
                .encode(family.encode_family(&[("worker", &**w.label())])?)?;
        }
        Ok(())
    }
}

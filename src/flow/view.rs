//! What flow control shows: the queue's depths in `GET /workers` (`queue`), and the
//! `flow_queued` gauge, both read from the queue when asked (nothing is counted on the
//! request path for them).

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::gauge::ConstGauge;
use serde::Serialize;

use super::Flow;

/// `GET /workers`' `queue`: requests waiting now, in all and (flow control on) per class
/// and tenant, with each class's bounds.
#[derive(Debug, Serialize)]
pub struct QueueView {
    pub waiting: usize,
    /// `proxy.queue.max_waiting` (0: no queue).
    pub max_waiting: usize,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub classes: Vec<ClassView>,
}

/// One class of [`QueueView`].
#[derive(Debug, Serialize)]
pub struct ClassView {
    pub class: String,
    pub waiting: usize,
    pub max_waiting: usize,
    pub timeout_ms: u64,
    /// Its requests holding a slot now (counted only with `priority.reserve`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub in_flight: Option<usize>,
    /// Waiting requests per tenant (tenants with none left out).
    pub tenants: std::collections::BTreeMap<String, usize>,
}

impl Flow {
    /// The queue now (see [`QueueView`]).
    pub fn view(&self) -> QueueView {
        let adm = &self.admission;
        let depths = adm.depths();
        let waiting = depths.iter().flatten().sum();
        let classes = match &self.classifier {
            None => Vec::new(),
            Some(c) => depths
                .iter()
                .enumerate()
                .map(|(class, per_tenant)| {
                    let rule = adm.rule(class as u8);
                    ClassView {
                        class: c.class_name(class as u8).to_string(),
                        waiting: per_tenant.iter().sum(),
                        max_waiting: rule.max_waiting,
                        timeout_ms: rule.timeout.as_millis() as u64,
                        in_flight: adm
                            .class_count(class as u8)
                            .map(|n| n.load(std::sync::atomic::Ordering::Relaxed)),
                        tenants: per_tenant
                            .iter()
                            .enumerate()
                            .filter(|(_, n)| **n > 0)
                            .map(|(t, n)| (c.tenant_name(t as u16).to_string(), *n))
                            .collect(),
                    }
                })
                .collect(),
        };
        QueueView {
            waiting,
            max_waiting: adm.max_waiting(),
            classes,
        }
    }
}

/// `flow_queued{class, tenant}`: requests waiting now, read from the queue at each
/// scrape (flow control on).
#[derive(Debug)]
pub struct QueueDepths(pub Arc<Flow>);

impl Collector for QueueDepths {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let Some(c) = self.0.classifier() else {
            return Ok(());
        };
        let mut family = enc.encode_descriptor(
            "flow_queued",
            "Requests waiting in the admission queue now, by class and tenant.",
            None,
            MetricType::Gauge,
        )?;
        for (class, per_tenant) in self.0.admission.depths().iter().enumerate() {
            for (tenant, n) in per_tenant.iter().enumerate() {
                let labels = [
                    ("class", &**c.class_name(class as u8)),
                    ("tenant", &**c.tenant_name(tenant as u16)),
                ];
                ConstGauge::new(*n as i64).encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

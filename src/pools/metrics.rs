//! The table's scrape-time families: per model, labelled only by the names the workers
//! list and the config writes (a client's `model` never becomes a label).

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

use super::Pools;

/// See the module docs.
pub struct TableMetrics<P>(pub Arc<Pools<P>>);

impl<P> std::fmt::Debug for TableMetrics<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TableMetrics")
    }
}

impl<P: Send + Sync + 'static> Collector for TableMetrics<P> {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let table = self.0.table();
        let models = table.models();
        if !models.is_empty() {
            let mut f = enc.encode_descriptor(
                "model_workers",
                "Workers a request for each served model may go to: those that list it and those whose list is unknown.",
                None,
                MetricType::Gauge,
            )?;
            for (name, _, set) in &models {
                ConstGauge::new(set.workers().len() as i64)
                    .encode(f.encode_family(&[("model", &***name)])?)?;
            }
        }
        let (requests, not_found) = self.0.request_counts();
        if !requests.is_empty() {
            let mut f = enc.encode_descriptor(
                "model_requests",
                "Requests routed by model, for the models the workers list and the config names (an alias's requests count under the served model chosen).",
                None,
                MetricType::Counter,
            )?;
            for (name, n) in &requests {
                ConstCounter::new(*n).encode(f.encode_family(&[("model", &**name)])?)?;
            }
        }
        crate::exposition::counter(
            &mut enc,
            "model_not_found",
            "Requests for a model no worker serves (answered 404 model_not_found)",
            not_found,
        )?;
        crate::exposition::gauge(
            &mut enc,
            "model_pools",
            "Pools made: one per model the workers listed, and the default",
            table.pools().count() as i64,
        )
    }
}

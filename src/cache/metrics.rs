//! The response cache's families in `/metrics`: what it did with each request, counted
//! as it happens (every label value at 0 from start-up, so dashboards see them before
//! the first event), and what the in-process store holds, read at each scrape.

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Unit;

use super::{Bypass, HIT_KINDS, ResponseCache, STORE_OPS, STORE_RESULTS};
use crate::exposition::{counter, family, gauge};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CauseLabels {
    cause: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabels {
    op: &'static str,
}

/// The cache's counters (see the module docs).
#[derive(Debug)]
pub struct CacheMetrics {
    hits: Family<KindLabels, Counter>,
    misses: Counter,
    bypasses: Family<CauseLabels, Counter>,
    stores: Family<ResultLabels, Counter>,
    store_errors: Family<OpLabels, Counter>,
}

impl CacheMetrics {
    /// Every series the cache names, at 0.
    pub fn new() -> Self {
        let m = CacheMetrics {
            hits: Family::default(),
            misses: Counter::default(),
            bypasses: Family::default(),
            stores: Family::default(),
            store_errors: Family::default(),
        };
        for kind in HIT_KINDS {
            let _ = m.hits.get_or_create(&KindLabels { kind });
        }
        for cause in Bypass::ALL.map(Bypass::as_str) {
            let _ = m.bypasses.get_or_create(&CauseLabels { cause });
        }
        for result in STORE_RESULTS {
            let _ = m.stores.get_or_create(&ResultLabels { result });
        }
        for op in STORE_OPS {
            let _ = m.store_errors.get_or_create(&OpLabels { op });
        }
        m
    }

    /// A hit of `kind` (`exact`, `semantic`).
    pub fn hit(&self, kind: &'static str) {
        self.hits.get_or_create(&KindLabels { kind }).inc();
    }

    pub fn miss(&self) {
        self.misses.inc();
    }

    /// A request that skipped the cache, for `cause`.
    pub fn bypass(&self, cause: &'static str) {
        self.bypasses.get_or_create(&CauseLabels { cause }).inc();
    }

    /// What became of a routed answer offered to the cache.
    pub fn store(&self, result: &'static str) {
        self.stores.get_or_create(&ResultLabels { result }).inc();
    }

    /// A failed store call or embeddings call.
    pub fn store_error(&self, op: &'static str) {
        self.store_errors.get_or_create(&OpLabels { op }).inc();
    }
}

impl Default for CacheMetrics {
    fn default() -> Self {
        Self::new()
    }
}

/// The cache's families, registered once in the metrics registry.
#[derive(Debug)]
pub struct CacheCollector(pub Arc<ResponseCache>);

impl Collector for CacheCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let m = &self.0.metrics;
        family(
            &mut enc,
            "response_cache_hits",
            "Requests answered from the response cache, by lookup kind (exact, semantic)",
            None,
            &m.hits,
        )?;
        family(
            &mut enc,
            "response_cache_misses",
            "Requests looked up in the response cache and not found (sent to a worker)",
            None,
            &m.misses,
        )?;
        family(
            &mut enc,
            "response_cache_bypasses",
            "Requests that skipped the response cache, by cause (endpoint, no_store, no_cache, api_key, choices, unreadable, stateful, store_error, store_down)",
            None,
            &m.bypasses,
        )?;
        family(
            &mut enc,
            "response_cache_stores",
            "Routed answers offered to the response cache, by result (stored; failed, incomplete, too_large, not_cacheable: not stored; error: the store failed)",
            None,
            &m.stores,
        )?;
        family(
            &mut enc,
            "response_cache_store_errors",
            "Response-cache store and embeddings failures, by operation (get, put, recent, remember, embed)",
            None,
            &m.store_errors,
        )?;
        // The in-process store's holdings; 0 with Redis (not counted here).
        let st = self.0.stats().unwrap_or_default();
        gauge(
            &mut enc,
            "response_cache_entries",
            "Answers held by the in-process response cache (0 with Redis)",
            st.entries as i64,
        )?;
        let bytes = prometheus_client::metrics::gauge::ConstGauge::new(st.bytes as i64);
        prometheus_client::encoding::EncodeMetric::encode(
            &bytes,
            enc.encode_descriptor(
                "response_cache",
                "Weight held by the in-process response cache: bodies, content types and per-entry overhead (0 with Redis).",
                Some(&Unit::Bytes),
                prometheus_client::metrics::MetricType::Gauge,
            )?,
        )?;
        counter(
            &mut enc,
            "response_cache_evictions",
            "Answers dropped from the in-process response cache to stay within max_bytes",
            st.evictions,
        )
    }
}

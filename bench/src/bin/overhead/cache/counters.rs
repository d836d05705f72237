//! The response-cache families of a router's `GET /metrics`, read before and after
//! each run to check what every request was.

use std::time::Duration;

use tokio::time::Instant;

use crate::env::Admin;

/// The response-cache families of a router's `GET /metrics`.
#[derive(Debug, Clone, Copy, Default)]
pub struct CacheCounters {
    pub hits: u64,
    pub misses: u64,
    pub bypasses: u64,
    /// `stores_total{result="stored"}`.
    pub stored: u64,
    /// Every other `stores_total` result.
    pub not_stored: u64,
    pub store_errors: u64,
    /// Gauges (in-process store only).
    pub entries: u64,
    pub bytes: u64,
    pub evictions: u64,
}

impl CacheCounters {
    /// Counters since `before`; gauges as now.
    pub fn since(&self, before: &CacheCounters) -> CacheCounters {
        CacheCounters {
            hits: self.hits.saturating_sub(before.hits),
            misses: self.misses.saturating_sub(before.misses),
            bypasses: self.bypasses.saturating_sub(before.bypasses),
            stored: self.stored.saturating_sub(before.stored),
            not_stored: self.not_stored.saturating_sub(before.not_stored),
            store_errors: self.store_errors.saturating_sub(before.store_errors),
            evictions: self.evictions.saturating_sub(before.evictions),
            ..*self
        }
    }

    pub fn add(&mut self, d: &CacheCounters) {
        self.hits += d.hits;
        self.misses += d.misses;
        self.bypasses += d.bypasses;
        self.stored += d.stored;
        self.not_stored += d.not_stored;
        self.store_errors += d.store_errors;
        self.evictions += d.evictions;
        self.entries = d.entries;
        self.bytes = d.bytes;
    }
}

/// Sum of the samples of metric `name` in a Prometheus text exposition, only the
/// series with exactly `labels` (`kind="exact"`) when given; `None` if absent.
pub fn metric_sum(text: &str, name: &str, labels: Option<&str>) -> Option<f64> {
    let mut found = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let (n, l) = match series.split_once('{') {
            Some((n, rest)) => (n, Some(rest.trim_end_matches('}'))),
            None => (series, None),
        };
        if n != name || labels.is_some_and(|want| l != Some(want)) {
            continue;
        }
        if let Ok(v) = value.parse::<f64>() {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

pub const RC: &str = "cache_aware_router_response_cache_";

pub async fn cache_counters(admin: &Admin) -> Result<CacheCounters, String> {
    let body = admin.get("/metrics").await?;
    let text = String::from_utf8_lossy(&body);
    let m = |name: &str, labels: Option<&str>| {
        metric_sum(&text, &format!("{RC}{name}"), labels)
            .map(|v| v as u64)
            .ok_or_else(|| format!("GET /metrics has no {RC}{name}"))
    };
    let stores = m("stores_total", None)?;
    let stored = m("stores_total", Some("result=\"stored\""))?;
    Ok(CacheCounters {
        hits: m("hits_total", None)?,
        misses: m("misses_total", None)?,
        bypasses: m("bypasses_total", None)?,
        stored,
        not_stored: stores.saturating_sub(stored),
        store_errors: m("store_errors_total", None)?,
        entries: m("entries", None)?,
        bytes: m("bytes", None)?,
        evictions: m("evictions_total", None)?,
    })
}

/// Polls `/metrics` until `stores_total` (every result) reaches `at_least` or
/// `max` has passed; the last reading. Answers are stored in a task after the body
/// ended, a moment after the client saw the end.
pub async fn wait_stores(
    admin: &Admin,
    at_least: u64,
    max: Duration,
) -> Result<CacheCounters, String> {
    let t0 = Instant::now();
    loop {
        let c = cache_counters(admin).await?;
        if c.stored + c.not_stored >= at_least || t0.elapsed() >= max {
            return Ok(c);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

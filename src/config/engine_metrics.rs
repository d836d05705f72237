//! `engine_metrics:` — scraping each engine's Prometheus endpoint for its own load
//! (see `signals::engine_metrics`).

use std::time::Duration;

use serde::Deserialize;

use super::check::{Checker, ConfigError, Secs};
use super::difference::Section;
use super::policy::PolicyKind;

/// `engine_metrics:` — scraping each engine's Prometheus endpoint for its own load
/// (see `signals::engine_metrics`).
#[derive(Debug, Clone, PartialEq)]
pub struct EngineMetricsConfig {
    /// Default: on for `cost_aware`, off otherwise.
    pub enabled: bool,
    /// Path scraped below each worker's URL (default `/metrics`).
    pub path: String,
    /// Scrape period (default 1000 ms); one scrape's time-out is the same, so scrapes of
    /// one worker never overlap.
    pub interval: Duration,
    /// A scrape older than this is stale: its values are neutral (default 5 s).
    pub stale: Duration,
}

impl EngineMetricsConfig {
    /// The defaults under `policy` (scraping is on by default for `cost_aware` only).
    fn defaults(policy: PolicyKind) -> Self {
        EngineMetricsConfig {
            enabled: policy == PolicyKind::CostAware,
            path: "/metrics".into(),
            interval: Duration::from_millis(1000),
            stale: Duration::from_secs(5),
        }
    }
}

impl Section for EngineMetricsConfig {
    const KEY: &'static str = "engine_metrics";
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
pub(super) struct RawEngineMetrics {
    enabled: Option<bool>,
    path: Option<String>,
    interval_ms: Option<u64>,
    stale_secs: Option<Secs>,
}

impl RawEngineMetrics {
    pub(super) fn validate(
        self,
        policy: PolicyKind,
        ck: &Checker<'_>,
    ) -> Result<EngineMetricsConfig, ConfigError> {
        let d = EngineMetricsConfig::defaults(policy);
        let path = self.path.unwrap_or(d.path);
        if !path.starts_with('/') || path.parse::<http::uri::PathAndQuery>().is_err() {
            return Err(ck.bad(
                "engine_metrics.path",
                path,
                "is not a URL path starting with `/` (no spaces or control characters)",
            ));
        }
        let interval_ms = self.interval_ms.unwrap_or(d.interval.as_millis() as u64);
        if !(50..=600_000).contains(&interval_ms) {
            return Err(ck.bad(
                "engine_metrics.interval_ms",
                interval_ms,
                "is out of range (ms, 50 to 600000)",
            ));
        }
        let stale = ck.secs(
            "engine_metrics.stale_secs",
            self.stale_secs,
            d.stale.as_secs_f64(),
            None,
        )?;
        let interval = Duration::from_millis(interval_ms);
        if stale < interval {
            return Err(ck.err(
                "engine_metrics.stale_secs",
                format!(
                    "{} s is shorter than engine_metrics.interval_ms ({interval_ms} ms): every reading would go stale before the next one arrives (give at least the interval, e.g. 5 × it)",
                    stale.as_secs_f64()
                ),
            ));
        }
        Ok(EngineMetricsConfig {
            enabled: self.enabled.unwrap_or(d.enabled),
            path,
            interval,
            stale,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::config::testing::{ONE, err, load};

    #[test]
    fn engine_metrics_keys_and_their_defaults() {
        let c = load(&[("a.yaml", ONE)]).unwrap();
        assert!(!c.engine_metrics.enabled);
        assert_eq!(c.engine_metrics.path, "/metrics");
        assert_eq!(c.engine_metrics.interval, Duration::from_secs(1));
        assert_eq!(c.engine_metrics.stale, Duration::from_secs(5));
        let c = load(&[("a.yaml", &format!("policy: cost_aware\n{ONE}"))]).unwrap();
        assert!(c.engine_metrics.enabled, "on by default for cost_aware");
        for (doc, key) in [
            (
                format!("engine_metrics: {{interval_ms: 10}}\n{ONE}"),
                "engine_metrics.interval_ms",
            ),
            (
                format!("engine_metrics: {{path: metrics}}\n{ONE}"),
                "engine_metrics.path",
            ),
            (format!("engine_metrics: {{every: 1}}\n{ONE}"), "every"),
            (
                format!("engine_metrics: {{interval_ms: 5000, stale_secs: 1}}\n{ONE}"),
                "engine_metrics.stale_secs",
            ),
        ] {
            let e = err(&[("a.yaml", &doc)]);
            assert!(e.contains(key), "{doc}: {e}");
        }
    }
}

//! `health:` — active health checks of every worker (see `pool::health`).

use std::time::Duration;

use serde::Deserialize;

use super::check::{Checker, ConfigError, Secs};
use super::difference::Section;

/// `health:` — active health checks (see `health.rs`).
#[derive(Debug, Clone, PartialEq)]
pub struct HealthConfig {
    /// Path probed on each worker, below its path prefix (default `/health`).
    pub endpoint: String,
    /// Probe period (default 10 s).
    pub interval: Duration,
    /// Timeout of one probe (default 5 s).
    pub timeout: Duration,
    /// Consecutive failures that mark a worker unhealthy (default 3).
    pub failure_threshold: u32,
    /// Consecutive successes that bring it back (default 2).
    pub success_threshold: u32,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            endpoint: "/health".into(),
            interval: Duration::from_secs(10),
            timeout: Duration::from_secs(5),
            failure_threshold: 3,
            success_threshold: 2,
        }
    }
}

impl Section for HealthConfig {
    const KEY: &'static str = "health";
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
pub(super) struct RawHealth {
    endpoint: Option<String>,
    interval_secs: Option<Secs>,
    timeout_secs: Option<Secs>,
    failure_threshold: Option<u32>,
    success_threshold: Option<u32>,
}

impl RawHealth {
    pub(super) fn validate(self, ck: &Checker<'_>) -> Result<HealthConfig, ConfigError> {
        let d = HealthConfig::default();
        let endpoint = self.endpoint.unwrap_or(d.endpoint);
        if !endpoint.starts_with('/') || endpoint.parse::<http::uri::PathAndQuery>().is_err() {
            return Err(ck.bad(
                "health.endpoint",
                endpoint,
                "is not a path starting with `/`",
            ));
        }
        Ok(HealthConfig {
            endpoint,
            interval: ck.secs(
                "health.interval_secs",
                self.interval_secs,
                d.interval.as_secs_f64(),
                None,
            )?,
            timeout: ck.secs(
                "health.timeout_secs",
                self.timeout_secs,
                d.timeout.as_secs_f64(),
                None,
            )?,
            failure_threshold: ck.at_least_one(
                "health.failure_threshold",
                self.failure_threshold,
                d.failure_threshold,
            )?,
            success_threshold: ck.at_least_one(
                "health.success_threshold",
                self.success_threshold,
                d.success_threshold,
            )?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::testing::{ONE, err, load};

    #[test]
    fn defaults_and_refusals() {
        assert_eq!(load(&[("a", ONE)]).unwrap().health, HealthConfig::default());
        for (over, key) in [
            ("health:\n  endpoint: health\n", "health.endpoint"),
            (
                "health:\n  success_threshold: 0\n",
                "health.success_threshold",
            ),
            ("health:\n  timeout_secs: 0\n", "health.timeout_secs"),
        ] {
            let e = err(&[("a.yaml", ONE), ("b.yaml", over)]);
            assert!(e.contains("b.yaml") && e.contains(key), "{over}: {e}");
        }
    }
}

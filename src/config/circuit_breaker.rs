//! `circuit_breaker:` — passive failure tracking per worker (see `pool::breaker`).

use std::time::Duration;

use serde::Deserialize;

use super::check::{Checker, ConfigError, Secs};
use super::difference::Section;

/// `circuit_breaker:` — passive failure tracking per worker.
#[derive(Debug, Clone, PartialEq)]
pub struct BreakerConfig {
    /// Consecutive request failures that open the breaker (default 5).
    pub failure_threshold: u32,
    /// How long an open breaker rejects traffic before probing (default 30 s).
    pub timeout: Duration,
    /// Successful probes that close it again (default 2).
    pub success_threshold: u32,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            failure_threshold: 5,
            timeout: Duration::from_secs(30),
            success_threshold: 2,
        }
    }
}

impl Section for BreakerConfig {
    const KEY: &'static str = "circuit_breaker";
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
pub(super) struct RawBreaker {
    failure_threshold: Option<u32>,
    timeout_secs: Option<Secs>,
    success_threshold: Option<u32>,
}

impl RawBreaker {
    pub(super) fn validate(self, ck: &Checker<'_>) -> Result<BreakerConfig, ConfigError> {
        let d = BreakerConfig::default();
        Ok(BreakerConfig {
            failure_threshold: ck.at_least_one(
                "circuit_breaker.failure_threshold",
                self.failure_threshold,
                d.failure_threshold,
            )?,
            timeout: ck.secs(
                "circuit_breaker.timeout_secs",
                self.timeout_secs,
                d.timeout.as_secs_f64(),
                None,
            )?,
            success_threshold: ck.at_least_one(
                "circuit_breaker.success_threshold",
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
        let c = load(&[("a", ONE)]).unwrap();
        assert_eq!(c.circuit_breaker, BreakerConfig::default());
        for key in ["failure_threshold", "success_threshold"] {
            let e = err(&[
                ("a.yaml", ONE),
                ("b.yaml", &format!("circuit_breaker: {{{key}: 0}}\n")),
            ]);
            assert!(e.contains(&format!("circuit_breaker.{key}")), "{key}: {e}");
        }
    }
}

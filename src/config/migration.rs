//! `migration:` — a streamed answer whose worker fails mid-stream is continued on
//! another worker (see `crate::proxy::migrate`).

use serde::Deserialize;

use super::check::{Checker, ConfigError};
use super::difference::Section;

/// `migration: {enabled, max_attempts}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigrationConfig {
    /// Continue a cut stream on another worker (default true). Off: a stream whose
    /// worker fails after its first byte is cut, as any proxy cuts it.
    pub enabled: bool,
    /// How many times one answer may be continued elsewhere (default 1, 1 to 10); past
    /// it the stream ends with an error event.
    pub max_attempts: u32,
}

impl Default for MigrationConfig {
    fn default() -> Self {
        MigrationConfig {
            enabled: true,
            max_attempts: 1,
        }
    }
}

impl Section for MigrationConfig {
    const KEY: &'static str = "migration";
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
pub(super) struct RawMigration {
    enabled: Option<bool>,
    max_attempts: Option<u32>,
}

impl RawMigration {
    pub(super) fn validate(self, ck: &Checker<'_>) -> Result<MigrationConfig, ConfigError> {
        let d = MigrationConfig::default();
        let max_attempts = self.max_attempts.unwrap_or(d.max_attempts);
        if !(1..=10).contains(&max_attempts) {
            return Err(ck.bad(
                "migration.max_attempts",
                max_attempts,
                "is out of range (1 to 10 continuations of one answer)",
            ));
        }
        Ok(MigrationConfig {
            enabled: self.enabled.unwrap_or(d.enabled),
            max_attempts,
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::config::load_text as load;
    use crate::config::testing::ONE;

    #[test]
    fn on_by_default_with_one_attempt_and_bad_values_name_their_key() {
        let c = load(ONE).unwrap();
        assert!(c.migration.enabled);
        assert_eq!(c.migration.max_attempts, 1);
        let c = load(&format!(
            "migration: {{enabled: false, max_attempts: 3}}\n{ONE}"
        ))
        .unwrap();
        assert!(!c.migration.enabled);
        assert_eq!(c.migration.max_attempts, 3);
        for bad in ["{max_attempts: 0}", "{max_attempts: 11}", "{tries: 2}"] {
            let e = load(&format!("migration: {bad}\n{ONE}")).unwrap_err();
            assert!(e.contains("migration") || e.contains("tries"), "{bad}: {e}");
        }
    }
}

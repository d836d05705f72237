//! `consistent_hash:` — the ring policy's key and load bound (see
//! `policy::consistent_hash`).

use serde::Deserialize;

use super::check::{Checker, ConfigError, named};
use super::difference::Section;

/// `consistent_hash:` — the ring policy's key and load bound.
#[derive(Debug, Clone, PartialEq)]
pub struct ConsistentHashConfig {
    /// What is hashed (default `auto`: the session when the request has one, else the
    /// prompt digest).
    pub key: HashKey,
    /// A worker takes a key while its load is under `load_factor` × the mean load
    /// (+1); past it the key goes to the next worker on the ring (default 1.25, > 1).
    pub load_factor: f64,
}

/// `consistent_hash.key`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HashKey {
    Auto,
    Session,
    Digest,
}

named!(HashKey {
    "auto" => HashKey::Auto,
    "session" => HashKey::Session,
    "digest" => HashKey::Digest,
});

impl Default for ConsistentHashConfig {
    fn default() -> Self {
        ConsistentHashConfig {
            key: HashKey::Auto,
            load_factor: 1.25,
        }
    }
}

impl Section for ConsistentHashConfig {
    const KEY: &'static str = "consistent_hash";
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
pub(super) struct RawConsistentHash {
    key: Option<HashKey>,
    load_factor: Option<f64>,
}

impl RawConsistentHash {
    pub(super) fn validate(self, ck: &Checker<'_>) -> Result<ConsistentHashConfig, ConfigError> {
        let d = ConsistentHashConfig::default();
        Ok(ConsistentHashConfig {
            key: self.key.unwrap_or(d.key),
            load_factor: load_factor(self.load_factor, d.load_factor, "consistent_hash", ck)?,
        })
    }
}

/// A hash ring's bounded-load factor (`SECTION.load_factor`, `given` or `default`): > 1
/// and ≤ 100. Shared by the ring policies' sections.
pub(super) fn load_factor(
    given: Option<f64>,
    default: f64,
    section: &str,
    ck: &Checker<'_>,
) -> Result<f64, ConfigError> {
    let f = given.unwrap_or(default);
    if !f.is_finite() || !(1.0..=100.0).contains(&f) || f == 1.0 {
        return Err(ck.bad(
            &format!("{section}.load_factor"),
            f,
            "is out of range (> 1 and ≤ 100: a worker may hold this many times the mean load)",
        ));
    }
    Ok(f)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::testing::{ONE, err, load};

    #[test]
    fn defaults_and_refusals() {
        let c = load(&[("a", ONE)]).unwrap();
        assert_eq!(c.consistent_hash, ConsistentHashConfig::default());
        let c = load(&[
            ("a", ONE),
            ("b", "consistent_hash: {key: session, load_factor: 2}\n"),
        ])
        .unwrap();
        assert_eq!(
            (c.consistent_hash.key, c.consistent_hash.load_factor),
            (HashKey::Session, 2.0)
        );
        for bad in ["1", "0.5", "101", ".nan"] {
            let e = err(&[
                ("a.yaml", ONE),
                (
                    "b.yaml",
                    &format!("consistent_hash: {{load_factor: {bad}}}\n"),
                ),
            ]);
            assert!(e.contains("consistent_hash.load_factor"), "{bad}: {e}");
        }
    }
}

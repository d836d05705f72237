//! `prefix_hash:` — how much of the prompt the `prefix_hash` policy hashes, and its load
//! bound (see `policy::prefix_hash`).

use serde::Deserialize;

use super::check::{Checker, ConfigError};
use super::difference::Section;

/// `prefix_hash:` — the `prefix_hash` policy's head length and load bound.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefixHashConfig {
    /// Bytes of the routing text hashed (default 4096, about 1,000 tokens of English; at
    /// least 1): requests that share these bytes go to the same worker.
    pub prefix_bytes: usize,
    /// A worker takes a head while its load is under `load_factor` × the mean load (+1);
    /// past it the head goes to the next worker on the ring (default 1.25, > 1).
    pub load_factor: f64,
}

impl Default for PrefixHashConfig {
    fn default() -> Self {
        PrefixHashConfig {
            prefix_bytes: 4096,
            load_factor: 1.25,
        }
    }
}

impl Section for PrefixHashConfig {
    const KEY: &'static str = "prefix_hash";
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
pub(super) struct RawPrefixHash {
    prefix_bytes: Option<usize>,
    load_factor: Option<f64>,
}

impl RawPrefixHash {
    pub(super) fn validate(self, ck: &Checker<'_>) -> Result<PrefixHashConfig, ConfigError> {
        let d = PrefixHashConfig::default();
        let prefix_bytes = self.prefix_bytes.unwrap_or(d.prefix_bytes);
        if prefix_bytes == 0 {
            return Err(ck.bad(
                "prefix_hash.prefix_bytes",
                prefix_bytes,
                "must be at least 1 (the bytes of the prompt that choose its worker)",
            ));
        }
        Ok(PrefixHashConfig {
            prefix_bytes,
            load_factor: super::consistent_hash::load_factor(
                self.load_factor,
                d.load_factor,
                "prefix_hash",
                ck,
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
        assert_eq!(c.prefix_hash, PrefixHashConfig::default());
        let c = load(&[
            ("a", ONE),
            ("b", "prefix_hash: {prefix_bytes: 256, load_factor: 2}\n"),
        ])
        .unwrap();
        assert_eq!(
            (c.prefix_hash.prefix_bytes, c.prefix_hash.load_factor),
            (256, 2.0)
        );
        for (key, bad) in [
            ("prefix_bytes", "0"),
            ("prefix_bytes", "-1"),
            ("load_factor", "1"),
            ("load_factor", ".nan"),
        ] {
            let e = err(&[
                ("a.yaml", ONE),
                ("b.yaml", &format!("prefix_hash: {{{key}: {bad}}}\n")),
            ]);
            assert!(
                e.contains(&format!("prefix_hash.{key}")),
                "{key}={bad}: {e}"
            );
        }
    }
}

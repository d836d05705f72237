//! `cache:` — the approximate prefix tree (see `crate::tree`) and the cache/load
//! trade-off of `cache_aware` and the policies built on it.

use std::time::Duration;

use serde::Deserialize;

use super::check::{Checker, ConfigError, Secs};
use super::difference::Section;

/// `cache:` — the approximate prefix tree and the cache/load trade-off.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheConfig {
    /// A match is a cache hit when matched/prompt length (bytes of the routing text)
    /// reaches this ratio, in [0, 1] (default 0.3).
    pub threshold: f64,
    /// …or when at least this many bytes matched (default 8192; 0 disables).
    pub match_abs_threshold: usize,
    /// A hit is overridden for load only when the cached worker's load exceeds the
    /// least-loaded one's by more than this many requests (default 2)…
    pub balance_abs_threshold: usize,
    /// …and by more than this factor (default 1.5, ≥ 1).
    pub balance_rel_threshold: f64,
    /// A hit that moving would make the least-loaded worker recompute part of, on a
    /// prefix whose recent traffic its holders can carry, is overridden only past
    /// `balance_abs_threshold` + this many requests × the share of the prompt that
    /// would be recomputed (default 64; 0 = off: the two thresholds above alone). See
    /// `policy::select::hold_margin`.
    pub balance_match_threshold: usize,
    /// Routing text kept per request, in bytes, cut on a UTF-8 boundary (default 32 KiB).
    pub max_prompt_bytes: usize,
    /// Node ceiling for the whole tree (default 1,000,000).
    pub max_tree_size: usize,
    /// Byte ceiling for the whole tree: routing text held in its edges, in bytes
    /// (`cache.max_tree_bytes`, default 1 GiB). Long prompts make few nodes of many
    /// bytes, so the node ceiling alone does not bound the tree's memory.
    pub max_tree_bytes: u64,
    /// Eviction pass period (default 60 s); `None` = eviction off (`0` in YAML).
    pub eviction_interval: Option<Duration>,
    /// UTC hour (0–23) at which the whole tree is dropped; `None` = off (`-1`, default).
    pub daily_cleanup_hour_utc: Option<u8>,
    /// Tokens per KV block of the engines (default 16, vLLM's): an engine reuses only
    /// whole blocks, so a matched prefix counts in whole blocks (`policy::BlockScale`).
    pub engine_block_tokens: usize,
    /// Below this drift (delivered ÷ predicted prefix tokens of a worker's last answers
    /// that predicted a hit, see `pool::hits`) for [`CacheConfig::drift_for`], the
    /// router warns that its memory of that worker is stale (default 0.5; 0 = never).
    pub drift_floor: f64,
    /// How long the drift must stay under the floor before the warning, and the least
    /// time between two warnings (`cache.drift_secs`, default 60 s).
    pub drift_for: Duration,
    /// Whether answers that deliver far fewer cached tokens than predicted age out the
    /// worker's older records (`cache.learn_evictions`, default true; see
    /// `policy::cache_aware::CacheAware::learn`).
    pub learn_evictions: bool,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            threshold: 0.3,
            match_abs_threshold: 8192,
            balance_abs_threshold: 2,
            balance_rel_threshold: 1.5,
            balance_match_threshold: 64,
            max_prompt_bytes: 32 << 10,
            max_tree_size: 1_000_000,
            max_tree_bytes: 1 << 30,
            eviction_interval: Some(Duration::from_secs(60)),
            daily_cleanup_hour_utc: None,
            engine_block_tokens: 16,
            drift_floor: 0.5,
            drift_for: Duration::from_secs(60),
            learn_evictions: true,
        }
    }
}

impl Section for CacheConfig {
    const KEY: &'static str = "cache";
}

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
pub(super) struct RawCache {
    threshold: Option<f64>,
    match_abs_threshold: Option<u64>,
    balance_abs_threshold: Option<u64>,
    balance_rel_threshold: Option<f64>,
    balance_match_threshold: Option<u64>,
    max_prompt_bytes: Option<u64>,
    max_tree_size: Option<u64>,
    max_tree_bytes: Option<u64>,
    eviction_interval_secs: Option<Secs>,
    daily_cleanup_hour_utc: Option<i64>,
    engine_block_tokens: Option<u64>,
    drift_floor: Option<f64>,
    drift_secs: Option<Secs>,
    learn_evictions: Option<bool>,
}

impl RawCache {
    pub(super) fn validate(self, ck: &Checker<'_>) -> Result<CacheConfig, ConfigError> {
        self.validate_at(ck, "cache")
    }

    /// These keys, and `base`'s where these leave one out (a model's `cache:` over the
    /// top-level one, `models.overrides.<name>.cache`).
    pub(super) fn over(self, base: &RawCache) -> RawCache {
        let b = base.clone();
        RawCache {
            threshold: self.threshold.or(b.threshold),
            match_abs_threshold: self.match_abs_threshold.or(b.match_abs_threshold),
            balance_abs_threshold: self.balance_abs_threshold.or(b.balance_abs_threshold),
            balance_rel_threshold: self.balance_rel_threshold.or(b.balance_rel_threshold),
            balance_match_threshold: self.balance_match_threshold.or(b.balance_match_threshold),
            max_prompt_bytes: self.max_prompt_bytes.or(b.max_prompt_bytes),
            max_tree_size: self.max_tree_size.or(b.max_tree_size),
            max_tree_bytes: self.max_tree_bytes.or(b.max_tree_bytes),
            eviction_interval_secs: self.eviction_interval_secs.or(b.eviction_interval_secs),
            daily_cleanup_hour_utc: self.daily_cleanup_hour_utc.or(b.daily_cleanup_hour_utc),
            engine_block_tokens: self.engine_block_tokens.or(b.engine_block_tokens),
            drift_floor: self.drift_floor.or(b.drift_floor),
            drift_secs: self.drift_secs.or(b.drift_secs),
            learn_evictions: self.learn_evictions.or(b.learn_evictions),
        }
    }

    /// As [`RawCache::validate`], the section being at `at` (refusals name its keys
    /// below it).
    pub(super) fn validate_at(
        self,
        ck: &Checker<'_>,
        at: &str,
    ) -> Result<CacheConfig, ConfigError> {
        let d = CacheConfig::default();
        let threshold = self.threshold.unwrap_or(d.threshold);
        if !(0.0..=1.0).contains(&threshold) {
            return Err(ck.bad(
                &format!("{at}.threshold"),
                threshold,
                "is out of range [0, 1]",
            ));
        }
        let balance_rel_threshold = self
            .balance_rel_threshold
            .unwrap_or(d.balance_rel_threshold);
        if !balance_rel_threshold.is_finite() || balance_rel_threshold < 1.0 {
            return Err(ck.bad(
                &format!("{at}.balance_rel_threshold"),
                balance_rel_threshold,
                "is out of range (≥ 1)",
            ));
        }
        let max_prompt_bytes = self.max_prompt_bytes.unwrap_or(d.max_prompt_bytes as u64);
        if !(1..=(16 << 20)).contains(&max_prompt_bytes) {
            return Err(ck.bad(
                &format!("{at}.max_prompt_bytes"),
                max_prompt_bytes,
                "is out of range (bytes, 1 to 16 MiB)",
            ));
        }
        let max_tree_size = self.max_tree_size.unwrap_or(d.max_tree_size as u64);
        if max_tree_size == 0 {
            return Err(ck.bad(
                &format!("{at}.max_tree_size"),
                0,
                "is out of range (nodes, ≥ 1)",
            ));
        }
        let max_tree_bytes = self.max_tree_bytes.unwrap_or(d.max_tree_bytes);
        if max_tree_bytes < max_prompt_bytes {
            return Err(ck.bad(
                &format!("{at}.max_tree_bytes"),
                max_tree_bytes,
                format!(
                    "is out of range (bytes of routing text, at least one prompt: \
                     cache.max_prompt_bytes, {max_prompt_bytes})"
                ),
            ));
        }
        let eviction = ck.secs(
            &format!("{at}.eviction_interval_secs"),
            self.eviction_interval_secs,
            d.eviction_interval.map_or(0.0, |t| t.as_secs_f64()),
            Some("off"),
        )?;
        let daily_cleanup_hour_utc = match self.daily_cleanup_hour_utc {
            None => d.daily_cleanup_hour_utc,
            Some(-1) => None,
            Some(h @ 0..=23) => Some(h as u8),
            Some(h) => {
                return Err(ck.bad(
                    &format!("{at}.daily_cleanup_hour_utc"),
                    h,
                    "is out of range (0–23, or -1 for off)",
                ));
            }
        };
        let engine_block_tokens = self
            .engine_block_tokens
            .unwrap_or(d.engine_block_tokens as u64);
        if !(1..=4096).contains(&engine_block_tokens) {
            return Err(ck.bad(
                &format!("{at}.engine_block_tokens"),
                engine_block_tokens,
                "is out of range (tokens, 1 to 4096; the engines' --block-size)",
            ));
        }
        let drift_floor = self.drift_floor.unwrap_or(d.drift_floor);
        if !(0.0..=1.0).contains(&drift_floor) {
            return Err(ck.bad(
                &format!("{at}.drift_floor"),
                drift_floor,
                "is out of range (a ratio of delivered to predicted tokens, 0 to 1; 0 = never warn)",
            ));
        }
        Ok(CacheConfig {
            threshold,
            match_abs_threshold: self
                .match_abs_threshold
                .map_or(d.match_abs_threshold, |n| n as usize),
            balance_abs_threshold: self
                .balance_abs_threshold
                .map_or(d.balance_abs_threshold, |n| n as usize),
            balance_rel_threshold,
            balance_match_threshold: self
                .balance_match_threshold
                .map_or(d.balance_match_threshold, |n| n as usize),
            max_prompt_bytes: max_prompt_bytes as usize,
            max_tree_size: max_tree_size as usize,
            max_tree_bytes,
            eviction_interval: (!eviction.is_zero()).then_some(eviction),
            daily_cleanup_hour_utc,
            engine_block_tokens: engine_block_tokens as usize,
            drift_floor,
            drift_for: ck.secs(
                &format!("{at}.drift_secs"),
                self.drift_secs,
                d.drift_for.as_secs_f64(),
                None,
            )?,
            learn_evictions: self.learn_evictions.unwrap_or(d.learn_evictions),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::testing::{ONE, err, load};

    #[test]
    fn engine_block_tokens_default_to_vllms_and_are_checked() {
        let c = load(&[("a.yaml", ONE)]).unwrap();
        assert_eq!(c.cache.engine_block_tokens, 16);
        let doc = format!("cache: {{engine_block_tokens: 0}}\n{ONE}");
        let e = err(&[("a.yaml", &doc)]);
        assert!(e.contains("cache.engine_block_tokens"), "{doc}: {e}");
    }

    #[test]
    fn the_match_margin_defaults_to_64_and_takes_whole_requests() {
        let c = load(&[("a.yaml", ONE)]).unwrap();
        assert_eq!(c.cache.balance_match_threshold, 64);
        let doc = |v: &str| format!("cache:\n  balance_match_threshold: {v}\n");
        let off = load(&[("a.yaml", ONE), ("b.yaml", &doc("0"))]).unwrap();
        assert_eq!(off.cache.balance_match_threshold, 0);
        for bad in ["-1", "2.5", "lots"] {
            let e = err(&[("a.yaml", ONE), ("b.yaml", &doc(bad))]);
            assert!(e.contains("balance_match_threshold"), "{bad}: {e}");
        }
    }

    #[test]
    fn the_drift_floor_is_a_ratio_from_0_to_1() {
        let key = "cache.drift_floor";
        let doc = |v: &str| format!("cache:\n  drift_floor: {v}\n");
        for bad in ["-0.1", "1.5", ".nan"] {
            let e = err(&[("a.yaml", ONE), ("b.yaml", &doc(bad))]);
            assert!(e.contains(key) && e.contains("0 to 1"), "{key} {bad}: {e}");
        }
        for good in ["0", "0.5", "1"] {
            assert!(
                load(&[("a.yaml", ONE), ("b.yaml", &doc(good))]).is_ok(),
                "{key} {good}"
            );
        }
        assert_eq!(load(&[("a", ONE)]).unwrap().cache, CacheConfig::default());
    }
}

//! `tenants:` — who a request is (see `crate::flow`): named by a header, or by the
//! caller's API key (kept here only as SHA-256 hashes), else `default`.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::check::{Checker, ConfigError};
use super::difference::Section;
use super::priority::{PriorityConfig, is_label};
use super::secret::Secret;

/// The tenant of a request that names none.
pub const DEFAULT_TENANT: &str = "default";
/// The one label (and queue) of every tenant name the list does not hold.
pub const OTHER_TENANT: &str = "other";

/// `tenants:` — see the module docs.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantsConfig {
    /// Whether the section is written at all (see [`PriorityConfig::enabled`]).
    pub enabled: bool,
    /// The header a request names its tenant in (default `x-tenant-id`).
    pub header: http::HeaderName,
    /// `tenants.isolate_cache`: every request's `cache_salt` becomes a keyed hash of its
    /// tenant (default false).
    pub isolate_cache: bool,
    /// `tenants.secret`: the key of that hash (required with `isolate_cache`).
    pub secret: Option<Secret>,
    /// The listed tenants, by name (sorted).
    pub list: Vec<TenantConfig>,
}

/// One entry of `tenants.list`.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantConfig {
    pub name: String,
    /// SHA-256 digests of the API keys that name this tenant (`Authorization: Bearer
    /// KEY` or `x-api-key: KEY`). A tenant with keys is named by a key only, never by
    /// the header.
    pub api_key_sha256: Vec<[u8; 32]>,
    /// Index of the most urgent class its requests may have (default the first).
    pub max_class: usize,
    /// Its share of a class's slots against the other tenants waiting in it, in prompt
    /// tokens (1 to 1000, default 1).
    pub weight: u32,
    /// `tokens_per_minute`: its token budget per minute (default none).
    pub tokens_per_minute: TokenLimits,
    /// `tokens_per_day`: its token budget per day (default none).
    pub tokens_per_day: TokenLimits,
}

/// A token budget: input (prompt) and output (generated) tokens, each unset = none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
pub struct TokenLimits {
    pub input: Option<u64>,
    pub output: Option<u64>,
}

impl TokenLimits {
    pub fn is_set(&self) -> bool {
        self.input.is_some() || self.output.is_some()
    }
}

impl Default for TenantsConfig {
    fn default() -> Self {
        TenantsConfig {
            enabled: false,
            header: http::HeaderName::from_static("x-tenant-id"),
            isolate_cache: false,
            secret: None,
            list: Vec::new(),
        }
    }
}

impl Section for TenantsConfig {
    const KEY: &'static str = "tenants";
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
pub(super) struct RawTenants {
    header: Option<String>,
    isolate_cache: Option<bool>,
    secret: Option<String>,
    list: Option<BTreeMap<String, RawTenant>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
struct RawTenant {
    api_key_sha256: Option<Vec<String>>,
    max_class: Option<String>,
    weight: Option<u32>,
    tokens_per_minute: Option<TokenLimits>,
    tokens_per_day: Option<TokenLimits>,
}

/// A SHA-256 digest written as 64 hex digits.
fn digest(hex: &str) -> Option<[u8; 32]> {
    let hex = hex.as_bytes();
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (o, pair) in out.iter_mut().zip(hex.chunks(2)) {
        let s = std::str::from_utf8(pair).ok()?;
        *o = u8::from_str_radix(s, 16).ok()?;
    }
    Some(out)
}

impl RawTenants {
    /// `written`: whether the files have a `tenants:` key; `priority`: the classes a
    /// `max_class` names.
    pub(super) fn validate(
        self,
        ck: &Checker<'_>,
        written: bool,
        priority: &PriorityConfig,
    ) -> Result<TenantsConfig, ConfigError> {
        let d = TenantsConfig::default();
        let header = match self.header {
            None => d.header,
            Some(h) => http::HeaderName::from_bytes(h.as_bytes())
                .map_err(|_| ck.bad("tenants.header", &h, "is not an HTTP header name"))?,
        };
        let isolate_cache = self.isolate_cache.unwrap_or(d.isolate_cache);
        let secret = ck.secret("tenants.secret", self.secret)?;
        if isolate_cache && secret.is_none() {
            return Err(ck.err(
                "tenants.secret",
                "is needed with tenants.isolate_cache: the key of the hash that makes each tenant's cache_salt (a long random string, e.g. `openssl rand -hex 32`)",
            ));
        }
        let mut list = Vec::new();
        let mut keys: BTreeMap<[u8; 32], String> = BTreeMap::new();
        for (name, raw) in self.list.unwrap_or_default() {
            let at = format!("tenants.list.{name}");
            if !is_label(&name) {
                return Err(ck.err(
                    &at,
                    format!("`{name}` is not a tenant name (1 to 64 of A-Z a-z 0-9 _ - .)"),
                ));
            }
            let mut api_key_sha256 = Vec::new();
            for (i, hex) in raw.api_key_sha256.unwrap_or_default().iter().enumerate() {
                let key = format!("{at}.api_key_sha256[{i}]");
                let Some(d) = digest(&hex.to_ascii_lowercase()) else {
                    return Err(ck.err(
                        &key,
                        "is not a SHA-256 digest (64 hex digits: `printf %s KEY | sha256sum`)",
                    ));
                };
                if let Some(other) = keys.insert(d, name.clone()) {
                    return Err(ck.err(&key, format!("is also a key of tenant `{other}`")));
                }
                api_key_sha256.push(d);
            }
            let max_class = match raw.max_class {
                None => 0,
                Some(c) => priority.class(&c).ok_or_else(|| {
                    ck.bad(
                        &format!("{at}.max_class"),
                        &c,
                        format!(
                            "is not one of priority.classes ({})",
                            priority.classes.join(", ")
                        ),
                    )
                })?,
            };
            let weight = raw.weight.unwrap_or(1);
            if !(1..=1000).contains(&weight) {
                return Err(ck.bad(
                    &format!("{at}.weight"),
                    weight,
                    "is out of range (1 to 1000)",
                ));
            }
            let tokens_per_minute = raw.tokens_per_minute.unwrap_or_default();
            let tokens_per_day = raw.tokens_per_day.unwrap_or_default();
            for (key, limits) in [
                ("tokens_per_minute", &tokens_per_minute),
                ("tokens_per_day", &tokens_per_day),
            ] {
                for (dir, v) in [("input", limits.input), ("output", limits.output)] {
                    if let Some(v) = v.filter(|v| !(1..=1_000_000_000_000).contains(v)) {
                        return Err(ck.bad(
                            &format!("{at}.{key}.{dir}"),
                            v,
                            "is out of range (tokens, 1 to 1e12)",
                        ));
                    }
                }
            }
            list.push(TenantConfig {
                name,
                api_key_sha256,
                max_class,
                weight,
                tokens_per_minute,
                tokens_per_day,
            });
        }
        Ok(TenantsConfig {
            enabled: written,
            header,
            isolate_cache,
            secret,
            list,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::testing::{ONE, err, load};

    const KEY_A: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";

    #[test]
    fn defaults_and_refusals() {
        let c = load(&[("a", ONE)]).unwrap();
        assert_eq!(c.tenants, TenantsConfig::default());
        let c = load(&[
            ("a", ONE),
            (
                "b",
                &format!(
                    "tenants: {{header: X-Team, list: {{acme: {{api_key_sha256: [\"{}\"], max_class: standard}}, beta: {{}}}}}}\n",
                    KEY_A.to_uppercase()
                ),
            ),
        ])
        .unwrap();
        let t = &c.tenants;
        assert!(t.enabled);
        assert_eq!(t.header, "x-team");
        assert_eq!(t.list.len(), 2);
        assert_eq!((t.list[0].name.as_str(), t.list[0].max_class), ("acme", 2));
        assert_eq!(t.list[0].api_key_sha256[0][0], 0x9f);
        assert_eq!(t.list[1].max_class, 0);
        for (over, key) in [
            ("tenants: {header: \"a b\"}\n", "tenants.header"),
            ("tenants: {list: {\"a b\": {}}}\n", "tenants.list.a b"),
            (
                "tenants: {list: {a: {api_key_sha256: [abc]}}}\n",
                "tenants.list.a.api_key_sha256[0]",
            ),
            (
                &format!(
                    "tenants: {{list: {{a: {{api_key_sha256: [\"{KEY_A}\"]}}, b: {{api_key_sha256: [\"{KEY_A}\"]}}}}}}\n"
                ),
                "tenants.list.b.api_key_sha256[0]",
            ),
            (
                "tenants: {list: {a: {max_class: gold}}}\n",
                "tenants.list.a.max_class",
            ),
            ("tenants: {lists: {}}\n", "lists"),
            (
                "tenants: {list: {a: {weight: 0}}}\n",
                "tenants.list.a.weight",
            ),
            ("tenants: {isolate_cache: true}\n", "tenants.secret"),
            (
                "tenants: {list: {a: {tokens_per_minute: {input: 0}}}}\n",
                "tenants.list.a.tokens_per_minute.input",
            ),
            (
                "tenants: {list: {a: {tokens_per_day: {outputs: 5}}}}\n",
                "outputs",
            ),
            ("tenants: {secret: \"a b\"}\n", "tenants.secret"),
        ] {
            let e = err(&[("a.yaml", ONE), ("b.yaml", over)]);
            assert!(e.contains("b.yaml") && e.contains(key), "{over}: {e}");
        }
    }
}

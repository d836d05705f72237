//! `adapters:` — LoRA adapters the router loads onto a worker before sending it a
//! request for one (`load_on_demand`), and where each is loaded from (`sources`). How
//! many adapters a worker holds at once is `workers[].max_lora`.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::check::{Checker, ConfigError};
use super::difference::Section;
use super::models::MAX_MODEL_NAME_BYTES;

/// Longest adapter source accepted, in bytes (a path or a URI).
const MAX_SOURCE_BYTES: usize = 4096;

/// `adapters:` — see the module docs.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct AdaptersConfig {
    /// Load an adapter onto the chosen worker, through the engine's load endpoint,
    /// when the worker does not list it (`load_on_demand`, default false).
    pub load_on_demand: bool,
    /// Adapter name -> where the engine loads it from (`sources`).
    pub sources: BTreeMap<String, AdapterSource>,
}

/// `adapters.sources.<name>`: a path or URI the engine can load (its `lora_path`), and
/// optionally the base model it adapts.
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterSource {
    /// What the engine's load endpoint is given as `lora_path`.
    pub path: String,
    /// The base model's served name (`base`); `None`: the base a worker lists it
    /// under, else `models.default`, else the fleet's only base model.
    pub base: Option<String>,
}

impl AdaptersConfig {
    /// The source of `adapter`, when loading on demand is on and config names one.
    pub fn loadable(&self, adapter: &str) -> Option<&AdapterSource> {
        self.load_on_demand
            .then(|| self.sources.get(adapter))
            .flatten()
    }
}

impl Section for AdaptersConfig {
    const KEY: &'static str = "adapters";
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
pub(super) struct RawAdapters {
    load_on_demand: Option<bool>,
    sources: Option<BTreeMap<String, RawSource>>,
}

/// A source: `NAME: /path` or `NAME: {path: /path, base: MODEL}`.
#[derive(Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "a path or URI, or a mapping with `path:` and `base:`"
)]
enum RawSource {
    Path(String),
    Full { path: String, base: Option<String> },
}

impl RawAdapters {
    pub(super) fn validate(self, ck: &Checker<'_>) -> Result<AdaptersConfig, ConfigError> {
        let mut sources = BTreeMap::new();
        for (name, raw) in self.sources.unwrap_or_default() {
            let key = format!("adapters.sources.{name}");
            if name.is_empty()
                || name.len() > MAX_MODEL_NAME_BYTES
                || name.chars().any(char::is_control)
            {
                return Err(ck.bad(
                    &key,
                    name.escape_debug(),
                    format!(
                        "is not an adapter name (1 to {MAX_MODEL_NAME_BYTES} bytes, no control characters)"
                    ),
                ));
            }
            let (path, base) = match raw {
                RawSource::Path(p) => (p, None),
                RawSource::Full { path, base } => (path, base),
            };
            if path.is_empty()
                || path.len() > MAX_SOURCE_BYTES
                || path.chars().any(char::is_control)
            {
                return Err(ck.bad(
                    &key,
                    path.escape_debug(),
                    format!(
                        "is not a path or URI (1 to {MAX_SOURCE_BYTES} bytes, no control characters)"
                    ),
                ));
            }
            if let Some(b) = &base
                && (b.is_empty()
                    || b.len() > MAX_MODEL_NAME_BYTES
                    || b.chars().any(char::is_control))
            {
                return Err(ck.bad(
                    &format!("{key}.base"),
                    b.escape_debug(),
                    "is not a model name",
                ));
            }
            sources.insert(name, AdapterSource { path, base });
        }
        Ok(AdaptersConfig {
            load_on_demand: self.load_on_demand.unwrap_or(false),
            sources,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::testing::{ONE, err, load};

    #[test]
    fn off_by_default_and_sources_in_both_forms() {
        let c = load(&[("a.yaml", ONE)]).unwrap();
        assert_eq!(c.adapters, AdaptersConfig::default());
        let doc = "adapters:
  load_on_demand: true
  sources:
    sql: /adapters/sql
    chat: {path: 's3://b/chat', base: llama}
";
        let c = load(&[("a.yaml", ONE), ("b.yaml", doc)]).unwrap();
        let a = &c.adapters;
        assert!(a.load_on_demand);
        assert_eq!(a.sources["sql"].path, "/adapters/sql");
        assert_eq!(a.sources["sql"].base, None);
        assert_eq!(a.sources["chat"].base.as_deref(), Some("llama"));
        assert_eq!(a.loadable("chat").map(|s| &*s.path), Some("s3://b/chat"));
        assert!(a.loadable("other").is_none());
        let off = load(&[
            ("a.yaml", ONE),
            ("b.yaml", "adapters: {sources: {sql: /a}}"),
        ])
        .unwrap();
        assert!(off.adapters.loadable("sql").is_none(), "off: nothing loads");
    }

    #[test]
    fn refusals_name_the_key() {
        for (doc, key) in [
            ("adapters: {sources: {sql: ''}}", "adapters.sources.sql"),
            ("adapters: {sources: {sql: [1]}}", "adapters.sources.sql"),
            (
                "adapters: {sources: {sql: {path: /a, base: ''}}}",
                "adapters.sources.sql.base",
            ),
            ("adapters: {load_on_demand: 3}", "adapters.load_on_demand"),
            ("adapters: {zz: 1}", "zz"),
        ] {
            let e = err(&[("a.yaml", ONE), ("b.yaml", doc)]);
            assert!(e.contains("b.yaml") && e.contains(key), "{doc}: {e}");
        }
    }
}

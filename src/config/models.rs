//! `models:` — several models behind one router (see `crate::pools`): the model a
//! request that names none gets, public names that stand for served ones (weighted,
//! for canaries), per-model policy and cache settings, and how often the workers'
//! model lists are read. What each worker serves is `workers[].models` (pinned) or its
//! own `GET /v1/models`.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

use super::PolicyKind;
use super::cache::{CacheConfig, RawCache};
use super::check::{Checker, ConfigError, Secs};
use super::difference::Section;

/// Longest model name accepted in config, in bytes (served names are short: a
/// Hugging Face id or a path).
pub const MAX_MODEL_NAME_BYTES: usize = 512;

/// `models:` — see the module docs.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ModelsConfig {
    /// The model a request that names none is sent to (`models.default`); unset: the
    /// fleet's only model, or a 400 naming the choices when it serves several.
    pub default: Option<String>,
    /// Public name -> the served names it stands for, with weights (`models.aliases`).
    pub aliases: BTreeMap<String, Vec<AliasTarget>>,
    /// Per-model policy and cache settings (`models.overrides`), by served name (a
    /// pool's name: the first name its workers list for it).
    pub overrides: BTreeMap<String, ModelOverride>,
    /// How often every worker's `GET /v1/models` is read (`models.refresh_secs`);
    /// `None` = each `health.interval_secs`.
    pub refresh: Option<Duration>,
}

/// One served name an alias stands for.
#[derive(Debug, Clone, PartialEq)]
pub struct AliasTarget {
    /// A served name (as the workers list it).
    pub model: String,
    /// Its share of the alias's requests, relative to the other targets' (> 0;
    /// default 1).
    pub weight: f64,
}

/// `models.overrides.<name>`: what differs for that model's pool.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelOverride {
    /// Its policy (default: the top-level `policy`).
    pub policy: Option<PolicyKind>,
    /// Its `cache:` settings: the keys given here over the top-level `cache:`.
    pub cache: Option<CacheConfig>,
}

impl ModelsConfig {
    /// How often the workers' model lists are read: `refresh_secs`, else `health`.
    pub fn refresh_every(&self, health: Duration) -> Duration {
        self.refresh.unwrap_or(health)
    }

    /// Every model name the config writes (the default, aliases, their targets,
    /// overrides): known names, which may label metrics before a worker lists them.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        let aliases = self.aliases.iter().flat_map(|(public, targets)| {
            std::iter::once(public.as_str()).chain(targets.iter().map(|t| t.model.as_str()))
        });
        self.default
            .as_deref()
            .into_iter()
            .chain(aliases)
            .chain(self.overrides.keys().map(String::as_str))
    }
}

impl Section for ModelsConfig {
    const KEY: &'static str = "models";
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
pub(super) struct RawModels {
    default: Option<String>,
    aliases: Option<BTreeMap<String, Vec<RawTarget>>>,
    overrides: Option<BTreeMap<String, RawOverride>>,
    refresh_secs: Option<Secs>,
}

#[derive(Debug, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a mapping with `model:` and `weight:`"
)]
struct RawTarget {
    model: String,
    weight: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
struct RawOverride {
    policy: Option<PolicyKind>,
    cache: Option<RawCache>,
}

/// A model name as config may write it: 1 to [`MAX_MODEL_NAME_BYTES`] bytes, no
/// control characters.
fn check_name(ck: &Checker<'_>, key: &str, name: &str) -> Result<(), ConfigError> {
    if name.is_empty() || name.len() > MAX_MODEL_NAME_BYTES || name.chars().any(char::is_control) {
        return Err(ck.bad(
            key,
            name.escape_debug(),
            format!(
                "is not a model name (1 to {MAX_MODEL_NAME_BYTES} bytes, no control characters)"
            ),
        ));
    }
    Ok(())
}

impl RawModels {
    /// Checks the section; `cache` is the top-level `cache:` as written (an
    /// override's keys go over it) and `policy` the top-level policy.
    pub(super) fn validate(
        self,
        ck: &Checker<'_>,
        cache: &RawCache,
        policy: PolicyKind,
    ) -> Result<ModelsConfig, ConfigError> {
        if let Some(d) = &self.default {
            check_name(ck, "models.default", d)?;
        }
        let aliases = self.aliases.unwrap_or_default();
        for (public, targets) in &aliases {
            let key = format!("models.aliases.{public}");
            check_name(ck, &key, public)?;
            if targets.is_empty() {
                return Err(ck.err(&key, "lists no model: give at least one `{model, weight}`"));
            }
            for (i, t) in targets.iter().enumerate() {
                check_name(ck, &format!("{key}[{i}].model"), &t.model)?;
                if t.model != *public && aliases.contains_key(&t.model) {
                    return Err(ck.bad(
                        &format!("{key}[{i}].model"),
                        &t.model,
                        "is itself an alias: an alias names served models only",
                    ));
                }
                if let Some(w) = t.weight
                    && !(w.is_finite() && w > 0.0)
                {
                    return Err(ck.bad(
                        &format!("{key}[{i}].weight"),
                        w,
                        "is out of range (a share, > 0)",
                    ));
                }
            }
        }
        let mut overrides = BTreeMap::new();
        for (name, o) in self.overrides.unwrap_or_default() {
            let key = format!("models.overrides.{name}");
            check_name(ck, &key, &name)?;
            if o.policy == Some(PolicyKind::PreciseCacheAware)
                && policy != PolicyKind::PreciseCacheAware
            {
                return Err(ck.bad(
                    &format!("{key}.policy"),
                    "precise_cache_aware",
                    "cannot be one model's: precise mode is the whole router's (`policy: precise_cache_aware`)",
                ));
            }
            let cache = o
                .cache
                .map(|c| c.over(cache).validate_at(ck, &format!("{key}.cache")))
                .transpose()?;
            overrides.insert(
                name,
                ModelOverride {
                    policy: o.policy,
                    cache,
                },
            );
        }
        let refresh = self
            .refresh_secs
            .map(|s| ck.secs("models.refresh_secs", Some(s), 0.0, None))
            .transpose()?;
        Ok(ModelsConfig {
            default: self.default,
            aliases: aliases
                .into_iter()
                .map(|(public, targets)| {
                    let targets = targets
                        .into_iter()
                        .map(|t| AliasTarget {
                            model: t.model,
                            weight: t.weight.unwrap_or(1.0),
                        })
                        .collect();
                    (public, targets)
                })
                .collect(),
            overrides,
            refresh,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::testing::{ONE, err, load};

    #[test]
    fn unset_means_one_router_for_whatever_the_workers_serve() {
        let c = load(&[("a.yaml", ONE)]).unwrap();
        assert_eq!(c.models, ModelsConfig::default());
        assert_eq!(
            c.models.refresh_every(c.health.interval),
            c.health.interval,
            "the lists are read with the health probes"
        );
    }

    #[test]
    fn aliases_overrides_and_the_default_are_read() {
        let doc = "models:
  default: chat
  refresh_secs: 2
  aliases:
    chat: [{model: llama-a, weight: 90}, {model: llama-b, weight: 10}]
    small: [{model: qwen}]
  overrides:
    llama-a: {policy: least_load, cache: {threshold: 0.6}}
cache: {max_prompt_bytes: 1000, max_tree_bytes: 5000}
";
        let c = load(&[("a.yaml", ONE), ("b.yaml", doc)]).unwrap();
        let m = &c.models;
        assert_eq!(m.default.as_deref(), Some("chat"));
        assert_eq!(m.refresh, Some(Duration::from_secs(2)));
        assert_eq!(m.aliases["chat"][1].model, "llama-b");
        assert_eq!(m.aliases["chat"][1].weight, 10.0);
        assert_eq!(m.aliases["small"][0].weight, 1.0, "weight defaults to 1");
        let o = &m.overrides["llama-a"];
        assert_eq!(o.policy, Some(PolicyKind::LeastLoad));
        let cache = o.cache.as_ref().unwrap();
        assert_eq!(cache.threshold, 0.6, "the override's key");
        assert_eq!(cache.max_prompt_bytes, 1000, "the top-level cache's key");
        assert_eq!(c.cache.threshold, 0.3, "the top level keeps its own");
        let names: Vec<&str> = m.names().collect();
        assert!(
            names.contains(&"qwen") && names.contains(&"chat"),
            "{names:?}"
        );
    }

    #[test]
    fn refusals_name_the_key() {
        for (doc, key) in [
            ("models: {aliases: {chat: []}}", "models.aliases.chat"),
            (
                "models: {aliases: {chat: [{model: a, weight: 0}]}}",
                "models.aliases.chat[0].weight",
            ),
            (
                "models: {aliases: {chat: [{model: b}], b: [{model: c}]}}",
                "models.aliases.chat[0].model",
            ),
            ("models: {default: ''}", "models.default"),
            ("models: {refresh_secs: 0}", "models.refresh_secs"),
            (
                "models: {overrides: {m: {cache: {threshold: 2}}}}",
                "models.overrides.m.cache.threshold",
            ),
            (
                "models: {overrides: {m: {policy: precise_cache_aware}}}",
                "models.overrides.m.policy",
            ),
            ("models: {overrides: {m: {zz: 1}}}", "zz"),
        ] {
            let e = err(&[("a.yaml", ONE), ("b.yaml", doc)]);
            assert!(e.contains("b.yaml") && e.contains(key), "{doc}: {e}");
        }
    }

    #[test]
    fn a_reload_may_not_change_the_section() {
        let a = load(&[("a.yaml", ONE)]).unwrap();
        let b = load(&[("a.yaml", ONE), ("b.yaml", "models: {default: m}")]).unwrap();
        assert_eq!(a.non_worker_difference(&b), Some("models"));
    }
}

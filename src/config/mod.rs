//! Command line and configuration: YAML files -> one validated [`Config`].
//!
//! Parsing happens once, at the edge. Several `-c` files are layered in order: mappings
//! merge key by key, lists and scalars replace, and an empty or comment-only file changes
//! nothing. Each file is first checked on its own (unknown keys and wrong types are
//! reported with that file's name and the key's path), then the merged document is
//! deserialised and range-checked; a range error names the last file that set the key.
//! SIGHUP reload goes through the same [`Config::load`].
//!
//! Every top-level section has a file of its own holding its raw (serde) schema, its
//! defaults, its validation, its tests and its key for the SIGHUP difference
//! (`difference.rs`); `workers[i].kv_events` and `workers[i].lmcache` are sections of
//! a worker entry. `check.rs` builds the refusals (file, line, key path, value as
//! written). This file holds the [`Config`] of sections, the layering and the loading.
//! Files a setting names (the tokenizer, its chat template) are read by the part that
//! uses them, not here.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;
use serde_yaml_ng::{Mapping, Value};

mod adapters;
mod cache;
mod check;
mod circuit_breaker;
mod consistent_hash;
mod difference;
mod discovery;
#[cfg(test)]
mod doc_reference;
mod engine_metrics;
mod health;
mod hedge;
mod kv_events;
mod lmcache;
mod log;
mod migration;
mod models;
mod passthrough;
mod pd;
mod policy;
mod precise;
mod prefix_hash;
mod priority;
mod proxy;
mod response_cache;
mod secret;
mod server;
mod session;
pub mod source;
mod state;
mod tenants;
mod tls;
mod trace;
mod worker_url;
mod workers;

pub use adapters::{AdapterSource, AdaptersConfig};
pub use cache::CacheConfig;
pub use check::{ConfigError, KeySite, MIN_SECS};
pub use circuit_breaker::BreakerConfig;
pub use consistent_hash::{ConsistentHashConfig, HashKey};
pub use difference::Settings;
pub use discovery::{DiscoveryConfig, DnsDiscovery, KubernetesDiscovery};
pub use engine_metrics::EngineMetricsConfig;
pub use health::HealthConfig;
pub use hedge::HedgeConfig;
pub use kv_events::{KvEventsConfig, MAX_DP_SIZE};
pub use lmcache::LmcacheConfig;
pub use log::{LogColor, LogConfig, LogFormat};
pub use migration::MigrationConfig;
pub use models::{AliasTarget, MAX_MODEL_NAME_BYTES, ModelOverride, ModelsConfig};
pub use passthrough::{Passthrough, Verdict as PassthroughVerdict};
pub use pd::{Bypass, Connector, OnPrefillFailure, PdConfig, Phase};
pub use policy::PolicyKind;
pub use precise::{
    ContentFormat, DEFAULT_MAX_TOKENIZE_BYTES, DEFAULT_TIER_LOAD_TOKENS_PER_SEC, MAX_TIERS,
    PreciseConfig, TierWeights, TokenizerSetting,
};
pub use prefix_hash::PrefixHashConfig;
pub use priority::{DEFAULT_CLASSES, MAX_CLASSES, OnPreempt, PriorityConfig};
pub use proxy::{ClassQueueConfig, ProxyConfig, QueueConfig, RemoteMediaPolicy};
pub use response_cache::{ALL_ENDPOINTS, RedisUrl, ResponseCacheConfig, SemanticConfig};
pub use secret::Secret;
pub use server::{AdminListen, ServerConfig};
pub use session::{SessionConfig, SessionMode};
pub use state::StateConfig;
pub use tenants::{DEFAULT_TENANT, OTHER_TENANT, TenantConfig, TenantsConfig, TokenLimits};
pub use tls::TlsSetting;
pub use trace::TracingConfig;
pub use worker_url::WorkerUrl;
pub use workers::{Role, WorkerConfig};

use check::{Checker, Layer};
use difference::changed;

/// The whole validated configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub policy: PolicyKind,
    pub server: ServerConfig,
    /// At least one, URLs normalised, duplicates merged (first occurrence wins).
    pub workers: Vec<WorkerConfig>,
    pub cache: CacheConfig,
    /// The files' keys as written, for naming a rejected reload's changes.
    pub settings: Settings,
    pub health: HealthConfig,
    pub circuit_breaker: BreakerConfig,
    pub proxy: ProxyConfig,
    pub log: LogConfig,
    pub precise: PreciseConfig,
    pub consistent_hash: ConsistentHashConfig,
    pub prefix_hash: PrefixHashConfig,
    pub session: SessionConfig,
    pub engine_metrics: EngineMetricsConfig,
    pub response_cache: ResponseCacheConfig,
    pub state: StateConfig,
    pub discovery: DiscoveryConfig,
    pub tracing: TracingConfig,
    /// Several models behind one router (`models:`).
    pub models: ModelsConfig,
    /// LoRA adapters loaded on demand (`adapters:`).
    pub adapters: AdaptersConfig,
    /// Prefill/decode disaggregation (`pd:`).
    pub pd: PdConfig,
    /// Streams continued on another worker when theirs fails (`migration:`).
    pub migration: MigrationConfig,
    /// A late first token asked of a second worker too (`hedge:`).
    pub hedge: HedgeConfig,
    /// Who a request is (`tenants:`; flow control).
    pub tenants: TenantsConfig,
    /// Priority classes (`priority:`; flow control).
    pub priority: PriorityConfig,
}

// Raw (serde) schema of the whole file: every section's raw form, each key optional so
// one file of a layered set can be checked alone. Each section applies its defaults and
// checks its values in its own file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
struct RawConfig {
    policy: Option<PolicyKind>,
    #[serde(default)]
    server: server::RawServer,
    workers: Option<Vec<workers::WorkerEntry>>,
    #[serde(default)]
    cache: cache::RawCache,
    #[serde(default)]
    health: health::RawHealth,
    #[serde(default)]
    circuit_breaker: circuit_breaker::RawBreaker,
    #[serde(default)]
    proxy: proxy::RawProxy,
    #[serde(default)]
    log: log::RawLog,
    #[serde(default)]
    precise: precise::RawPrecise,
    #[serde(default)]
    consistent_hash: consistent_hash::RawConsistentHash,
    #[serde(default)]
    prefix_hash: prefix_hash::RawPrefixHash,
    #[serde(default)]
    session: session::RawSession,
    #[serde(default)]
    engine_metrics: engine_metrics::RawEngineMetrics,
    #[serde(default)]
    response_cache: response_cache::RawResponseCache,
    #[serde(default)]
    state: state::RawState,
    discovery: Option<Value>,
    #[serde(default)]
    tracing: trace::RawTracing,
    #[serde(default)]
    models: models::RawModels,
    #[serde(default)]
    adapters: adapters::RawAdapters,
    #[serde(default)]
    pd: pd::RawPd,
    #[serde(default)]
    migration: migration::RawMigration,
    #[serde(default)]
    hedge: hedge::RawHedge,
    tenants: Option<tenants::RawTenants>,
    priority: Option<priority::RawPriority>,
}

impl RawConfig {
    /// Every section validated, in the order of the file's keys (so the first refusal
    /// of a file with several is the same every time), then the checks across them.
    fn validate(self, ck: &Checker<'_>, require_workers: bool) -> Result<Config, ConfigError> {
        let policy = self.policy.unwrap_or_default();
        let server = self.server.validate(ck)?;
        // Discovered workers may be the only ones.
        let discovery = DiscoveryConfig::validate(self.discovery, ck)?;
        let discovers = discovery != DiscoveryConfig::Static;
        let workers = workers::validate(self.workers, require_workers, discovers, ck)?;
        let raw_cache = self.cache.clone();
        let cache = self.cache.validate(ck)?;
        let health = self.health.validate(ck)?;
        let circuit_breaker = self.circuit_breaker.validate(ck)?;
        let proxy = self.proxy.validate(ck)?;
        let log = self.log.validate(ck)?;
        let precise = self.precise.validate(ck)?;
        kv_events::check_workers(policy, workers.iter().map(|w| w.kv_events.as_ref()), ck)?;
        let consistent_hash = self.consistent_hash.validate(ck)?;
        let prefix_hash = self.prefix_hash.validate(ck)?;
        let session = self.session.validate(ck)?;
        let engine_metrics = self.engine_metrics.validate(policy, ck)?;
        lmcache::check_workers(policy, workers.iter().map(|w| w.lmcache.as_ref()), ck)?;
        pd::check_workers(workers.iter(), ck)?;
        let priority = self.priority.map(|p| (p, true)).unwrap_or_default();
        let priority = priority.0.validate(ck, priority.1)?;
        let tenants = self.tenants.map(|t| (t, true)).unwrap_or_default();
        let tenants = tenants.0.validate(ck, tenants.1, &priority)?;
        let hedge = self.hedge.validate(ck)?;
        check_flow(&proxy, &priority, &tenants, ck)?;
        check_hedge_classes(&hedge, &priority, &tenants, ck)?;
        Ok(Config {
            policy,
            server,
            workers,
            cache,
            settings: Settings::default(),
            health,
            circuit_breaker,
            proxy,
            log,
            precise,
            consistent_hash,
            prefix_hash,
            session,
            engine_metrics,
            response_cache: self.response_cache.validate(ck)?,
            state: self.state.validate(ck)?,
            discovery,
            tracing: self.tracing.validate(ck)?,
            models: self.models.validate(ck, &raw_cache, policy)?,
            adapters: self.adapters.validate(ck)?,
            pd: self.pd.validate(ck, policy)?,
            migration: self.migration.validate(ck)?,
            hedge,
            tenants,
            priority,
        })
    }
}

/// The checks across `proxy.queue` and flow control's sections.
fn check_flow(
    proxy: &ProxyConfig,
    priority: &PriorityConfig,
    tenants: &TenantsConfig,
    ck: &Checker<'_>,
) -> Result<(), ConfigError> {
    let on = priority.enabled || tenants.enabled;
    for (class, _) in &proxy.queue.per_class {
        if !on {
            return Err(ck.err(
                "proxy.queue.per_class",
                "needs flow control: write a priority: section (priority: {} for the default classes)",
            ));
        }
        if priority.class(class).is_none() {
            return Err(ck.err(
                &format!("proxy.queue.per_class.{class}"),
                format!(
                    "names no class of priority.classes ({})",
                    priority.classes.join(", ")
                ),
            ));
        }
    }
    if priority.preempt && proxy.queue.max_waiting == 0 {
        return Err(ck.err(
            "priority.preempt",
            "needs the admission queue (proxy.queue.max_waiting > 0): a pre-empting request waits there for the slot it freed",
        ));
    }
    Ok(())
}

/// With hedging and flow control on, `hedge.classes` names classes of
/// `priority.classes`.
fn check_hedge_classes(
    hedge: &HedgeConfig,
    priority: &PriorityConfig,
    tenants: &TenantsConfig,
    ck: &Checker<'_>,
) -> Result<(), ConfigError> {
    if hedge.after.is_none() || !(priority.enabled || tenants.enabled) {
        return Ok(());
    }
    match hedge
        .classes
        .iter()
        .enumerate()
        .find(|(_, c)| priority.class(c).is_none())
    {
        Some((i, c)) => Err(ck.bad(
            &format!("hedge.classes[{i}]"),
            c,
            format!(
                "names no class of priority.classes ({})",
                priority.classes.join(", ")
            ),
        )),
        None => Ok(()),
    }
}

/// Merges `over` into `base`: mappings key by key (recursively), anything else replaces.
fn merge(base: &mut Value, over: Value) {
    match (base, over) {
        (Value::Mapping(b), Value::Mapping(o)) => {
            for (k, v) in o {
                match b.get_mut(&k) {
                    Some(slot) => merge(slot, v),
                    None => {
                        b.insert(k, v);
                    }
                }
            }
        }
        (_, Value::Null) => {}
        (slot, o) => *slot = o,
    }
}

/// The layers merged into one document, in order.
fn merged(layers: &[Layer<'_>]) -> Value {
    let mut merged = Value::Mapping(Mapping::new());
    for l in layers {
        merge(&mut merged, l.doc.clone());
    }
    merged
}

impl Config {
    /// Reads, layers and validates the given files (in order).
    ///
    /// Errors: unreadable file, YAML syntax, unknown key, wrong type (each naming the
    /// file, line and key path), out-of-range value (naming the last file that set it,
    /// the line, the key and the value as written), or an empty worker list. No error
    /// holds a credential.
    pub fn load(files: &[PathBuf]) -> Result<Config, ConfigError> {
        Self::load_with(files, true)
    }

    /// As [`Config::load`]; with `require_workers` false an empty worker list is
    /// accepted (SIGHUP reload: a controller may scale the pool to zero, and requests then
    /// get 503 until workers come back).
    pub fn load_with(files: &[PathBuf], require_workers: bool) -> Result<Config, ConfigError> {
        let mut docs = Vec::with_capacity(files.len());
        for f in files {
            let text = std::fs::read_to_string(f).map_err(|source| ConfigError::Read {
                file: f.clone(),
                source,
            })?;
            docs.push((f.clone(), text));
        }
        Self::from_sources_with(
            docs.iter().map(|(f, t)| (f.as_path(), t.as_str())),
            require_workers,
        )
    }

    /// As [`Config::load`], from `(file name, YAML text)` pairs (a seam for tests).
    pub fn from_sources<'a>(
        sources: impl IntoIterator<Item = (&'a Path, &'a str)>,
    ) -> Result<Config, ConfigError> {
        Self::from_sources_with(sources, true)
    }

    fn from_sources_with<'a>(
        sources: impl IntoIterator<Item = (&'a Path, &'a str)>,
        require_workers: bool,
    ) -> Result<Config, ConfigError> {
        let mut layers: Vec<Layer<'a>> = Vec::new();
        let mut last_raw = None;
        for (file, text) in sources {
            // Keys and types first: that error knows the key path.
            let raw = check::parse::<RawConfig>(file, text)?;
            let doc: Value = serde_yaml_ng::from_str(text).map_err(|e| ConfigError::Parse {
                file: file.to_path_buf(),
                line: e.location().map(|l| l.line()),
                key: None,
                message: source::untyped_message(&e.to_string()),
            })?;
            match &doc {
                Value::Null => continue, // empty or comment-only: changes nothing
                Value::Mapping(_) => {}
                _ => {
                    return Err(ConfigError::Parse {
                        file: file.to_path_buf(),
                        line: None,
                        key: None,
                        message: "the top level must be a mapping of keys".into(),
                    });
                }
            }
            last_raw = Some(raw);
            layers.push(Layer { file, text, doc });
        }
        let raw = match (layers.len(), last_raw) {
            (0, _) | (_, None) => {
                return Err(ConfigError::Other(
                    "no configuration: every -c file is empty; `workers` is required".into(),
                ));
            }
            (1, Some(raw)) => raw,
            _ => {
                // Merged as YAML text, read by the same parser as each file, so a
                // value reads the same alone and layered (`url: 70000` is a string).
                let text = serde_yaml_ng::to_string(&merged(&layers)).map_err(|e| {
                    ConfigError::Other(format!("cannot merge the config files: {e}"))
                })?;
                let last = layers.last().map_or(Path::new(""), |l| l.file);
                check::parse::<RawConfig>(last, &text)?
            }
        };
        let mut config = raw.validate(&Checker { layers: &layers }, require_workers)?;
        let mut settings = merged(&layers);
        if let Value::Mapping(m) = &mut settings {
            m.remove("workers");
        }
        config.settings = Settings(Arc::new(settings));
        Ok(config)
    }

    /// Every key other than `workers` whose value differs between the files of two
    /// configs, by its full path with both values: `cache.threshold: 0.3 → 0.55`,
    /// `(unset)` for a key one of them leaves out (its default then applies). A
    /// credential's value is shown as `***`, a URL's user-info masked; a long value is
    /// cut at 60 characters. Compares what the files say, so a key written differently
    /// but meaning the same (`0.30` and `0.3`) is not listed.
    pub fn changed_settings(&self, other: &Config) -> Vec<String> {
        let mut out = Vec::new();
        difference::diff_values(
            "",
            Some(&self.settings.0),
            Some(&other.settings.0),
            &mut out,
        );
        out
    }

    /// Names the first top-level key other than `workers` that differs between two
    /// configs (SIGHUP may change only `workers`), or `None`.
    pub fn non_worker_difference(&self, other: &Config) -> Option<&'static str> {
        let (a, b) = (self, other);
        [
            changed(&a.policy, &b.policy),
            changed(&a.server, &b.server),
            changed(&a.cache, &b.cache),
            changed(&a.health, &b.health),
            changed(&a.circuit_breaker, &b.circuit_breaker),
            changed(&a.proxy, &b.proxy),
            changed(&a.log, &b.log),
            changed(&a.precise, &b.precise),
            changed(&a.consistent_hash, &b.consistent_hash),
            changed(&a.prefix_hash, &b.prefix_hash),
            changed(&a.session, &b.session),
            changed(&a.engine_metrics, &b.engine_metrics),
            changed(&a.response_cache, &b.response_cache),
            changed(&a.state, &b.state),
            changed(&a.discovery, &b.discovery),
            changed(&a.tracing, &b.tracing),
            changed(&a.models, &b.models),
            changed(&a.adapters, &b.adapters),
            changed(&a.pd, &b.pd),
            changed(&a.migration, &b.migration),
            changed(&a.hedge, &b.hedge),
            changed(&a.tenants, &b.tenants),
            changed(&a.priority, &b.priority),
        ]
        .into_iter()
        .flatten()
        .next()
    }
}

/// One YAML text (`a.yaml`) as a config, the error as its message: for the section
/// modules' tests.
#[cfg(test)]
pub(crate) fn load_text(doc: &str) -> Result<Config, String> {
    Config::from_sources([(Path::new("a.yaml"), doc)]).map_err(|e| e.to_string())
}

/// Loading named files, for the section modules' tests.
#[cfg(test)]
pub(crate) mod testing {
    use std::path::Path;

    use super::{Config, ConfigError};

    /// One file holding one worker.
    pub(crate) const ONE: &str = "workers:\n  - url: http://127.0.0.1:8001\n";

    /// `(file name, YAML text)` layered in order.
    pub(crate) fn load(files: &[(&str, &str)]) -> Result<Config, ConfigError> {
        Config::from_sources(files.iter().map(|(f, t)| (Path::new(*f), *t)))
    }

    /// The refusal of `files`, as printed.
    pub(crate) fn err(files: &[(&str, &str)]) -> String {
        load(files)
            .expect_err("config should be refused")
            .to_string()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::testing::{ONE, err, load};

    #[test]
    fn minimal_config_gets_documented_defaults() {
        let c = load(&[("a.yaml", ONE)]).unwrap();
        assert_eq!(c.policy, PolicyKind::CacheAware);
        assert_eq!(c.server.port, 6700);
        assert_eq!(c.server.host, "0.0.0.0");
        assert_eq!(c.server.max_body_bytes, 32 << 20);
        assert_eq!(c.cache.threshold, 0.3);
        assert_eq!(c.cache.match_abs_threshold, 8192);
        assert_eq!(c.cache.balance_abs_threshold, 2);
        assert_eq!(c.cache.balance_rel_threshold, 1.5);
        assert_eq!(c.cache.max_prompt_bytes, 32768);
        assert_eq!(c.cache.max_tree_size, 1_000_000);
        assert_eq!(c.cache.max_tree_bytes, 1 << 30);
        assert_eq!(c.cache.eviction_interval, Some(Duration::from_secs(60)));
        assert_eq!(c.cache.daily_cleanup_hour_utc, None);
        assert_eq!(c.health.failure_threshold, 3);
        assert_eq!(c.health.success_threshold, 2);
        assert_eq!(c.proxy.max_retries, 2);
        assert_eq!(c.proxy.connect_timeout, Duration::from_secs(2));
        assert_eq!(c.proxy.models_cache, Duration::from_secs(600));
        assert!(!c.proxy.add_routed_peer_header);
        assert_eq!(c.workers.len(), 1);
        assert_eq!(c.workers[0].max_load, None);
        assert!(c.workers[0].cache_aware);
    }

    #[test]
    fn layers_merge_mappings_and_replace_lists_and_scalars() {
        let base = "policy: round_robin\nserver:\n  port: 7000\n  host: 127.0.0.1\nworkers:\n  - url: http://a:1\n  - url: http://b:2\ncache:\n  threshold: 0.5\n";
        let over = "server:\n  port: 7100\nworkers:\n  - url: http://c:3\ncache:\n  match_abs_threshold: 10\n";
        let c = load(&[("base.yaml", base), ("over.yaml", over)]).unwrap();
        assert_eq!(c.policy, PolicyKind::RoundRobin);
        assert_eq!(c.server.port, 7100);
        assert_eq!(c.server.host, "127.0.0.1", "sibling key kept by the merge");
        assert_eq!(c.workers.len(), 1, "lists replace");
        assert_eq!(c.workers[0].url.to_string(), "http://c:3");
        assert_eq!(c.cache.threshold, 0.5);
        assert_eq!(c.cache.match_abs_threshold, 10);
    }

    #[test]
    fn empty_and_comment_only_layers_change_nothing() {
        let a = load(&[("a.yaml", ONE)]).unwrap();
        let b = load(&[
            ("a.yaml", ONE),
            ("empty.yaml", ""),
            ("c.yaml", "# just a comment\n"),
        ])
        .unwrap();
        assert_eq!(a, b);
        let c = load(&[("empty.yaml", ""), ("a.yaml", ONE)]).unwrap();
        assert_eq!(a, c);
    }

    #[test]
    fn unknown_key_names_file_and_key() {
        let e = err(&[("a.yaml", ONE), ("b.yaml", "cache:\n  treshold: 0.4\n")]);
        assert!(e.contains("b.yaml") && e.contains("treshold"), "{e}");
        let e = err(&[("a.yaml", "workerz: []\n")]);
        assert!(e.contains("a.yaml") && e.contains("workerz"), "{e}");
    }

    #[test]
    fn wrong_type_names_file_key_and_value() {
        let e = err(&[("a.yaml", ONE), ("b.yaml", "cache:\n  threshold: high\n")]);
        assert!(
            e.contains("b.yaml") && e.contains("cache.threshold") && e.contains("high"),
            "{e}"
        );
        let e = err(&[("a.yaml", "server:\n  port: 70000\n")]);
        assert!(e.contains("server.port") && e.contains("70000"), "{e}");
        let e = err(&[("a.yaml", "policy: fastest\n")]);
        assert!(e.contains("fastest"), "{e}");
    }

    #[test]
    fn only_worker_changes_are_not_differences() {
        let a = load(&[("a", ONE)]).unwrap();
        let b = load(&[("b", "workers:\n  - url: http://other:1\n")]).unwrap();
        assert_eq!(a.non_worker_difference(&b), None);
        let c = load(&[("c", ONE), ("d", "cache:\n  threshold: 0.9\n")]).unwrap();
        assert_eq!(a.non_worker_difference(&c), Some("cache"));
    }
}

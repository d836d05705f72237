//! `state:` — routing state shared by router replicas through Redis (see `crate::fleet`).

use serde::Deserialize;

use super::check::{Checker, ConfigError};
use super::difference::Section;
use super::response_cache::RedisUrl;

/// `state:` — absent = each router keeps its own routing state.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StateConfig {
    /// The Redis every replica of this fleet names (`redis://…`); `None` = per-process.
    pub redis_url: Option<RedisUrl>,
    /// Prefix of the fleet's channel and keys (default `cache-aware-router`): replicas
    /// with the same URL and namespace route as one.
    pub namespace: String,
}

impl Section for StateConfig {
    const KEY: &'static str = "state";
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
pub(super) struct RawState {
    redis_url: Option<String>,
    namespace: Option<String>,
}

impl RawState {
    pub(super) fn validate(self, ck: &Checker<'_>) -> Result<StateConfig, ConfigError> {
        Ok(StateConfig {
            redis_url: self
                .redis_url
                .map(|u| RedisUrl::parse(ck, "state.redis_url", u))
                .transpose()?,
            namespace: super::response_cache::namespace(ck, "state.namespace", self.namespace)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::config::Config;

    const ONE: &str = "workers:\n  - url: http://127.0.0.1:8001\n";

    use crate::config::load_text as load;

    #[test]
    fn absent_is_per_process_and_bad_values_name_their_key() {
        let c = load(ONE).unwrap();
        assert!(c.state.redis_url.is_none());
        assert_eq!(c.state.namespace, "cache-aware-router");
        let c = load(&format!(
            "state: {{redis_url: \"redis://r:6379/2\", namespace: eu}}\n{ONE}"
        ))
        .unwrap();
        assert_eq!(c.state.redis_url.unwrap().expose(), "redis://r:6379/2");
        assert_eq!(c.state.namespace, "eu");
        for (section, key) in [
            ("{redis_url: \"http://r\"}", "state.redis_url"),
            ("{namespace: \"\"}", "state.namespace"),
            ("{url: x}", "url"),
        ] {
            let e = load(&format!("state: {section}\n{ONE}")).unwrap_err();
            assert!(e.contains(key), "{section}: {e}");
        }
    }

    /// The router configs shipped in deploy/kubernetes/ (ConfigMaps, and the Secret's
    /// admin layer) are valid, layered as the Deployments pass them.
    #[test]
    fn the_kubernetes_examples_are_valid_configs() {
        use serde::Deserialize;
        for (file, text) in [
            (
                "cache-aware-router.yaml",
                include_str!("../../deploy/kubernetes/cache-aware-router.yaml"),
            ),
            (
                "fleet.yaml",
                include_str!("../../deploy/kubernetes/fleet.yaml"),
            ),
        ] {
            let mut layers: Vec<(String, String)> = Vec::new();
            for doc in serde_yaml_ng::Deserializer::from_str(text) {
                let v = serde_yaml_ng::Value::deserialize(doc).expect("a YAML document");
                for key in ["data", "stringData"] {
                    if let Some(m) = v.get(key).and_then(|d| d.as_mapping()) {
                        for (name, body) in m {
                            let name = name.as_str().unwrap().to_string();
                            layers.push((name, body.as_str().unwrap().to_string()));
                        }
                    }
                }
            }
            assert!(!layers.is_empty(), "{file}: no config found");
            let c = Config::from_sources(
                layers
                    .iter()
                    .map(|(n, t)| (Path::new(n.as_str()), t.as_str())),
            )
            .unwrap_or_else(|e| panic!("{file}: {e}"));
            if file == "fleet.yaml" {
                assert!(c.state.redis_url.is_some() && c.response_cache.redis_url.is_some());
                assert!(c.server.admin_token.is_some());
            }
        }
    }
}

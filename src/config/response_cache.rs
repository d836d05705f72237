//! `response_cache:` — the response cache's settings (see `crate::cache`).

use std::time::Duration;

use serde::Deserialize;

use super::check::{Checker, ConfigError, Secs};
use super::difference::Section;
use super::secret::Secret;
use super::worker_url::WorkerUrl;
use crate::prompt::Endpoint;

/// Every endpoint the cache can serve, in config order.
pub const ALL_ENDPOINTS: [Endpoint; 4] = [
    Endpoint::ChatCompletions,
    Endpoint::Completions,
    Endpoint::Messages,
    Endpoint::Responses,
];

/// `response_cache:` — answers stored and replayed whole (exact, and semantic when
/// `semantic` is set).
#[derive(Debug, Clone, PartialEq)]
pub struct ResponseCacheConfig {
    /// Default false.
    pub enabled: bool,
    /// How long an answer is replayed (default 300 s).
    pub ttl: Duration,
    /// Weight bound of the in-process store, in bytes of stored body and key (default
    /// 256 MiB). One answer larger than `min(max_bytes, 8 MiB)` is never stored.
    pub max_bytes: u64,
    /// When set, answers live in this Redis (shared by every router replica) instead of
    /// in the process. Holds any password: never printed (see `redact`).
    pub redis_url: Option<RedisUrl>,
    /// Prefix of every Redis key (default `cache-aware-router`).
    pub namespace: String,
    /// Which endpoints may be cached (default all four).
    pub endpoints: Vec<Endpoint>,
    /// Callers (`Authorization: Bearer <key>` or `x-api-key`) whose requests are never
    /// looked up or stored.
    pub uncacheable_api_keys: Vec<Secret>,
    pub semantic: Option<SemanticConfig>,
}

/// `response_cache.semantic:` — replay an answer to a request whose conversation text
/// embeds close enough to a stored one's, within the same partition (see
/// `crate::cache::key`).
#[derive(Debug, Clone, PartialEq)]
pub struct SemanticConfig {
    /// Full URL of an OpenAI-compatible embeddings endpoint
    /// (`http://host:8000/v1/embeddings`).
    pub embeddings_url: String,
    /// The `model` sent in every embeddings request.
    pub model: String,
    /// Least cosine similarity that counts as the same question (default 0.92).
    pub threshold: f32,
    /// How many of a partition's most recent entries a lookup compares (default 256).
    pub max_candidates: usize,
}

/// A validated `redis://` / `rediss://` URL; `Debug` hides it (it may hold a password).
#[derive(Clone, PartialEq)]
pub struct RedisUrl(String);

impl RedisUrl {
    /// Checks a `redis://` URL at `key` (the error never shows a password).
    pub(super) fn parse(ck: &Checker<'_>, key: &str, u: String) -> Result<RedisUrl, ConfigError> {
        if u.starts_with("rediss") {
            return Err(ck.err(
                key,
                "rediss:// (TLS) is not supported yet; use redis:// on a private network",
            ));
        }
        if let Err(e) = redis::Client::open(u.as_str()) {
            return Err(ck.err(
                key,
                format!(
                    "`{}` is not a Redis URL ({e}); expected redis://host:port/db (a password goes before the host, as in any URL)",
                    crate::redact::url(&u)
                ),
            ));
        }
        Ok(RedisUrl(u))
    }

    /// The URL itself, for connecting.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for RedisUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&crate::redact::url(&self.0))
    }
}

impl Default for ResponseCacheConfig {
    fn default() -> Self {
        ResponseCacheConfig {
            enabled: false,
            ttl: Duration::from_secs(300),
            max_bytes: 256 << 20,
            redis_url: None,
            namespace: "cache-aware-router".into(),
            endpoints: ALL_ENDPOINTS.to_vec(),
            uncacheable_api_keys: Vec::new(),
            semantic: None,
        }
    }
}

impl Section for ResponseCacheConfig {
    const KEY: &'static str = "response_cache";
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
pub(super) struct RawResponseCache {
    enabled: Option<bool>,
    ttl_secs: Option<Secs>,
    max_bytes: Option<u64>,
    redis_url: Option<String>,
    namespace: Option<String>,
    endpoints: Option<Vec<String>>,
    uncacheable_api_keys: Option<Vec<String>>,
    semantic: Option<RawSemantic>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
struct RawSemantic {
    embeddings_url: String,
    model: String,
    threshold: Option<f64>,
    max_candidates: Option<usize>,
}

impl RawResponseCache {
    pub(super) fn validate(self, ck: &Checker<'_>) -> Result<ResponseCacheConfig, ConfigError> {
        let d = ResponseCacheConfig::default();
        let max_bytes = self.max_bytes.unwrap_or(d.max_bytes);
        if !(1 << 20..=1 << 40).contains(&max_bytes) {
            return Err(ck.bad(
                "response_cache.max_bytes",
                max_bytes,
                "is out of range (bytes, 1 MiB to 1 TiB)",
            ));
        }
        let redis_url = self
            .redis_url
            .map(|u| RedisUrl::parse(ck, "response_cache.redis_url", u))
            .transpose()?;
        let namespace = namespace(ck, "response_cache.namespace", self.namespace)?;
        let endpoints = match self.endpoints {
            None => d.endpoints,
            Some(names) => {
                let mut out = Vec::new();
                for (i, name) in names.iter().enumerate() {
                    let e = ALL_ENDPOINTS
                        .into_iter()
                        .find(|e| e.as_str() == name)
                        .ok_or_else(|| {
                            ck.bad(
                                &format!("response_cache.endpoints[{i}]"),
                                name,
                                "is not an endpoint (chat_completions, completions, messages, responses)",
                            )
                        })?;
                    if !out.contains(&e) {
                        out.push(e);
                    }
                }
                out
            }
        };
        let uncacheable_api_keys = self
            .uncacheable_api_keys
            .unwrap_or_default()
            .into_iter()
            .enumerate()
            .map(|(i, k)| {
                ck.secret(
                    &format!("response_cache.uncacheable_api_keys[{i}]"),
                    Some(k),
                )
                .map(|s| s.expect("a given key"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let semantic = self.semantic.map(|s| s.validate(ck)).transpose()?;
        Ok(ResponseCacheConfig {
            enabled: self.enabled.unwrap_or(d.enabled),
            ttl: ck.secs("response_cache.ttl_secs", self.ttl_secs, 300.0, None)?,
            max_bytes,
            redis_url,
            namespace,
            endpoints,
            uncacheable_api_keys,
            semantic,
        })
    }
}

/// A namespace at `key` (default `cache-aware-router`): 1 to 64 characters of letters,
/// digits, `-`, `_`, `.` or `:`.
pub(super) fn namespace(
    ck: &Checker<'_>,
    key: &str,
    v: Option<String>,
) -> Result<String, ConfigError> {
    let namespace = v.unwrap_or_else(|| "cache-aware-router".into());
    if namespace.is_empty()
        || namespace.len() > 64
        || !namespace
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b))
    {
        return Err(ck.bad(
            key,
            &namespace,
            "must be 1 to 64 characters of letters, digits, `-`, `_`, `.` or `:`",
        ));
    }
    Ok(namespace)
}

impl RawSemantic {
    fn validate(self, ck: &Checker<'_>) -> Result<SemanticConfig, ConfigError> {
        let url = self.embeddings_url.trim().to_string();
        let parsed = WorkerUrl::parse(&url).map_err(|m| {
            ck.err(
                "response_cache.semantic.embeddings_url",
                format!("`{}`: {m}", crate::redact::url(&url)),
            )
        })?;
        if parsed.path_prefix().is_empty() {
            return Err(ck.bad(
                "response_cache.semantic.embeddings_url",
                &url,
                "has no path: give the full URL, e.g. http://host:8000/v1/embeddings",
            ));
        }
        if self.model.trim().is_empty() {
            return Err(ck.err(
                "response_cache.semantic.model",
                "is empty: name the embedding model the endpoint serves",
            ));
        }
        let threshold = self.threshold.unwrap_or(0.92);
        if !(threshold > 0.0 && threshold <= 1.0) {
            return Err(ck.bad(
                "response_cache.semantic.threshold",
                threshold,
                "is out of range (cosine similarity, above 0 up to 1)",
            ));
        }
        let max_candidates = self.max_candidates.unwrap_or(256);
        if !(1..=4096).contains(&max_candidates) {
            return Err(ck.bad(
                "response_cache.semantic.max_candidates",
                max_candidates,
                "is out of range (1 to 4096)",
            ));
        }
        Ok(SemanticConfig {
            embeddings_url: parsed.to_string(),
            model: self.model,
            threshold: threshold as f32,
            max_candidates,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::config::Config;

    const ONE: &str = "workers:\n  - url: http://127.0.0.1:8001\n";

    use crate::config::load_text as load;

    #[test]
    fn defaults_and_a_full_section() {
        let c = load(ONE).unwrap().response_cache;
        assert_eq!(c, ResponseCacheConfig::default());
        assert!(!c.enabled);
        assert_eq!(c.ttl, Duration::from_secs(300));
        assert_eq!(c.max_bytes, 256 << 20);
        assert_eq!(c.endpoints.len(), 4);
        let doc = format!(
            "response_cache:\n  enabled: true\n  ttl_secs: 10\n  max_bytes: 2097152\n  redis_url: \"redis://:pw@r:6379/1\"\n  namespace: prod.eu\n  endpoints: [messages, messages, completions]\n  uncacheable_api_keys: [sk-1]\n  semantic: {{embeddings_url: \"http://e:8000/v1/embeddings/\", model: bge, threshold: 0.9, max_candidates: 8}}\n{ONE}"
        );
        let c = load(&doc).unwrap().response_cache;
        assert!(c.enabled);
        assert_eq!(c.endpoints, vec![Endpoint::Messages, Endpoint::Completions]);
        assert_eq!(
            c.redis_url.as_ref().unwrap().expose(),
            "redis://:pw@r:6379/1"
        );
        assert!(!format!("{c:?}").contains("pw@"), "{c:?}");
        let s = c.semantic.unwrap();
        assert_eq!(s.embeddings_url, "http://e:8000/v1/embeddings");
        assert_eq!((s.threshold, s.max_candidates), (0.9, 8));
    }

    #[test]
    fn the_example_config_is_valid() {
        let text = include_str!("../../config.example.yaml");
        Config::from_sources([(Path::new("config.example.yaml"), text)])
            .unwrap_or_else(|e| panic!("config.example.yaml: {e}"));
    }

    #[test]
    fn bad_values_name_their_key() {
        for (section, key) in [
            ("{max_bytes: 10}", "response_cache.max_bytes"),
            ("{ttl_secs: 0}", "response_cache.ttl_secs"),
            ("{redis_url: \"http://x\"}", "response_cache.redis_url"),
            ("{redis_url: \"rediss://x:1\"}", "response_cache.redis_url"),
            ("{namespace: \"a b\"}", "response_cache.namespace"),
            ("{endpoints: [chat]}", "response_cache.endpoints[0]"),
            (
                "{uncacheable_api_keys: [\"a b\"]}",
                "response_cache.uncacheable_api_keys[0]",
            ),
            (
                "{semantic: {embeddings_url: \"http://e:1\", model: m}}",
                "response_cache.semantic.embeddings_url",
            ),
            (
                "{semantic: {embeddings_url: \"ftp://e:1/v1/embeddings\", model: m}}",
                "response_cache.semantic.embeddings_url",
            ),
            (
                "{semantic: {embeddings_url: \"http://e:1/v1/embeddings\", model: \" \"}}",
                "response_cache.semantic.model",
            ),
            (
                "{semantic: {embeddings_url: \"http://e:1/v1/embeddings\", model: m, threshold: 1.5}}",
                "response_cache.semantic.threshold",
            ),
            (
                "{semantic: {embeddings_url: \"http://e:1/v1/embeddings\", model: m, max_candidates: 0}}",
                "response_cache.semantic.max_candidates",
            ),
            ("{semantic: {model: m}}", "embeddings_url"),
            ("{enable: true}", "enable"),
        ] {
            let doc = format!("response_cache: {section}\n{ONE}");
            let e = load(&doc).expect_err(&doc);
            assert!(e.contains(key), "{doc}: {e}");
        }
        let e = load(&format!(
            "response_cache: {{redis_url: \"redis://:hunter2@x:99999\"}}\n{ONE}"
        ));
        if let Err(e) = e {
            assert!(!e.contains("hunter2"), "{e}");
        }
    }
}

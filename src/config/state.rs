//! `state:` — routing state shared by router replicas through Redis (see `crate::fleet`).

use serde::Deserialize;

use super::{Checker, ConfigError, RedisUrl};

/// `state:` — absent = each router keeps its own routing state.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StateConfig {
    /// The Redis every replica of this fleet names (`redis://…`); `None` = per-process.
    pub redis_url: Option<RedisUrl>,
    /// Prefix of the fleet's channel and keys (default `cache-aware-router`): replicas
    /// with the same URL and namespace route as one.
    pub namespace: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
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

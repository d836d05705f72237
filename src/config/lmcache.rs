//! `workers[i].lmcache:` — a worker's LMCache occupancy signal (`policy: lmcache_aware`,
//! polled by `signals::lmcache`), and the check across workers: the policy needs one.

use std::time::Duration;

use serde::Deserialize;

use super::check::{Checker, ConfigError, MIN_SECS, Secs};
use super::policy::PolicyKind;
use crate::redact;

/// `workers[i].lmcache:` — an HTTP JSON signal of the worker's LMCache occupancy,
/// `{"occupancy": 0.42, "cache_available": true}` (`policy: lmcache_aware`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LmcacheConfig {
    /// A path below the worker's URL (`/lmcache/stats`) or an absolute `http://` URL.
    pub endpoint: String,
    /// Poll period (default 2 s).
    pub refresh: Duration,
    /// A signal older than this is neutral (default 10 s).
    pub stale: Duration,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
pub(super) struct RawLmcache {
    endpoint: String,
    refresh_secs: Option<Secs>,
    stale_secs: Option<Secs>,
}

impl RawLmcache {
    /// Checks one worker's `lmcache`; an error names the key below the worker entry.
    pub(super) fn validate(self) -> Result<LmcacheConfig, (&'static str, String)> {
        let endpoint = self.endpoint.trim().to_string();
        let ok = if endpoint.starts_with('/') {
            endpoint.parse::<http::uri::PathAndQuery>().is_ok()
        } else {
            endpoint.starts_with("http://")
                && endpoint
                    .parse::<http::Uri>()
                    .is_ok_and(|u| u.authority().is_some_and(|a| !a.as_str().contains('@')))
        };
        if !ok {
            return Err((
                "lmcache.endpoint",
                format!(
                    "`{}` is neither a path starting with `/` (below the worker's URL) nor an http:// URL without user info",
                    redact::url(&endpoint)
                ),
            ));
        }
        let secs = |key: &'static str, v: Option<Secs>, default: f64| match v {
            None => Ok(Duration::from_secs_f64(default)),
            Some(Secs(s)) if s.is_finite() && (MIN_SECS..=1e6).contains(&s) => {
                Ok(Duration::from_secs_f64(s))
            }
            Some(Secs(s)) => Err((
                key,
                format!("`{s}` is out of range (seconds: {MIN_SECS} to 1e6)"),
            )),
        };
        let refresh = secs("lmcache.refresh_secs", self.refresh_secs, 2.0)?;
        let stale = secs("lmcache.stale_secs", self.stale_secs, 10.0)?;
        if stale < refresh {
            return Err((
                "lmcache.stale_secs",
                format!(
                    "{} s is shorter than lmcache.refresh_secs ({} s): every signal would go stale before the next poll",
                    stale.as_secs_f64(),
                    refresh.as_secs_f64()
                ),
            ));
        }
        Ok(LmcacheConfig {
            endpoint,
            refresh,
            stale,
        })
    }
}

/// `policy: lmcache_aware` needs `lmcache` on at least one worker; `lmcache` holds
/// each worker's, in list order.
pub(super) fn check_workers<'a>(
    policy: PolicyKind,
    mut lmcache: impl Iterator<Item = Option<&'a LmcacheConfig>> + Clone,
    ck: &Checker<'_>,
) -> Result<(), ConfigError> {
    if policy == PolicyKind::LmcacheAware
        && lmcache.clone().next().is_some()
        && lmcache.all(|l| l.is_none())
    {
        return Err(ck.err(
            "workers",
            "policy lmcache_aware needs `lmcache: {endpoint: /path or http://host:port/path}` on at least one worker",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::config::testing::{ONE, err, load};

    #[test]
    fn lmcache_keys_and_their_defaults() {
        let c = load(&[(
            "a.yaml",
            "policy: lmcache_aware\nworkers:\n  - url: http://a:1\n    lmcache: {endpoint: /lmcache, refresh_secs: 0.5}\n  - url: http://b:1\n    lmcache: {endpoint: \"http://cache:9000/stats\"}\n",
        )])
        .unwrap();
        let l = c.workers[0].lmcache.as_ref().unwrap();
        assert_eq!(
            (l.endpoint.as_str(), l.refresh, l.stale),
            (
                "/lmcache",
                Duration::from_millis(500),
                Duration::from_secs(10)
            )
        );
        assert_eq!(
            c.workers[1].lmcache.as_ref().unwrap().refresh,
            Duration::from_secs(2)
        );
        for (doc, key) in [
            (format!("policy: lmcache_aware\n{ONE}"), "lmcache"),
            (
                "workers:\n  - url: http://a:1\n    lmcache: {endpoint: \"ftp://x\"}\n".into(),
                "lmcache.endpoint",
            ),
            (
                "workers:\n  - url: http://a:1\n    lmcache: {endpoint: \"http://u:p@x:1/s\"}\n"
                    .into(),
                "lmcache.endpoint",
            ),
            (
                "workers:\n  - url: http://a:1\n    lmcache: {endpoint: /s, stale_secs: 0}\n"
                    .into(),
                "lmcache.stale_secs",
            ),
            ("workers:\n  - url: http://a:1\n    lmcache: {endpoint: /s, refresh_secs: 5, stale_secs: 0.5}\n".into(), "lmcache.stale_secs"),
        ] {
            let e = err(&[("a.yaml", &doc)]);
            assert!(e.contains(key), "{doc}: {e}");
        }
        assert!(!err(&[("a.yaml", "workers:\n  - url: http://a:1\n    lmcache: {endpoint: \"http://u:hunter2@x:1/s\"}\n")]).contains("hunter2"));
    }
}

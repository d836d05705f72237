//! `proxy:` — forwarding, retries and timeouts; its `passthrough` and `tls` keys have
//! files of their own.

use std::time::Duration;

use serde::Deserialize;
use serde_yaml_ng::Value;

use super::check::{Checker, ConfigError, Secs};
use super::difference::Section;
use super::passthrough::Passthrough;
use super::secret::Secret;
use super::tls::{RawTls, TlsSetting};

/// `proxy:` — forwarding, retries and timeouts.
#[derive(Debug, Clone, PartialEq)]
pub struct ProxyConfig {
    /// Extra attempts on other workers after a connection error or retryable status
    /// (default 2).
    pub max_retries: u32,
    /// Backoff before the first retry (default 50 ms).
    pub initial_backoff: Duration,
    /// Backoff growth per retry (default 2.0, ≥ 1).
    pub backoff_multiplier: f64,
    /// Random spread of each backoff, ± this fraction, in [0, 1] (default 0.2).
    pub jitter_factor: f64,
    /// Upstream statuses that are retried on another worker while nothing has reached
    /// the client (default 502, 503, 504).
    pub retryable_statuses: Vec<u16>,
    /// TCP connect bound (default 2 s).
    pub connect_timeout: Duration,
    /// Bound on the client's wait for response headers, from the request's arrival over
    /// every attempt (default 600 s: a non-streamed vLLM response sends its headers only
    /// when generation ends); also the longest silence between two body frames.
    pub request_timeout: Duration,
    /// `proxy.attempt_timeout_secs`: how long one attempt waits for headers before it is
    /// abandoned (its connection closed, so the engine aborts it) and the request tried
    /// on another worker, within `request_timeout`. Unset (the default): an attempt may
    /// use the whole `request_timeout`, and a time-out is not retried — the engine may
    /// still be computing it (a non-streamed answer's headers come at its end), so a
    /// second try would pay its prefill twice.
    pub attempt_timeout: Option<Duration>,
    /// Idle pooled upstream connections are closed after this (default 4 s, below
    /// uvicorn's 5 s keep-alive, so a reused socket is never one the worker closed).
    pub pool_idle_timeout: Duration,
    /// Adds `x-routed-peer: <worker url>` to responses (default false).
    pub add_routed_peer_header: bool,
    /// `allow` (default), or an HTTP status with which requests carrying remote media
    /// URLs are refused.
    pub remote_media_url_policy: RemoteMediaPolicy,
    /// `proxy.models_cache_secs`: no effect (`GET /v1/models` is the fleet's list, built
    /// from the workers' lists); accepted so that older files still load.
    pub models_cache: Duration,
    /// Bearer token sent to every worker (requests and health probes) unless the worker
    /// sets its own; it replaces the client's `Authorization`.
    pub api_key: Option<Secret>,
    /// Which other paths may reach a worker (default: `/v1/…` and vLLM's client
    /// endpoints; see [`Passthrough`]).
    pub passthrough: Passthrough,
    /// How `https://` workers are verified (`proxy.tls`; default the platform's trust
    /// store).
    pub tls: TlsSetting,
    /// `proxy.queue`: requests that find every usable worker at `max_load` wait for a
    /// slot instead of failing at once.
    pub queue: QueueConfig,
    /// `proxy.drain_secs`: how long a worker removed (SIGHUP, the admin API, discovery)
    /// or marked draining keeps its in-flight streams before they continue on another
    /// worker (default 30 s).
    pub drain: Duration,
}

/// `proxy.queue: {max_waiting, timeout_ms, per_class}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueConfig {
    /// Requests that may wait at once, all classes together (default 0 = off: a full
    /// pool answers at once).
    pub max_waiting: usize,
    /// Longest a request waits for a slot (default 1000 ms), then 503 (429 with flow
    /// control on).
    pub timeout: Duration,
    /// `proxy.queue.per_class`: bounds of one priority class each (its name, as
    /// written; checked against `priority.classes`), over the two above.
    pub per_class: Vec<(String, ClassQueueConfig)>,
}

/// `proxy.queue.per_class.CLASS: {max_waiting, timeout_ms}`: each unset is the
/// queue's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClassQueueConfig {
    pub max_waiting: usize,
    pub timeout: Duration,
}

/// What to do with requests that reference remote media by URL (`http(s)://` images).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoteMediaPolicy {
    /// Forward them (the default).
    Allow,
    /// Refuse them with this status (4xx).
    Reject(u16),
}

impl Default for QueueConfig {
    fn default() -> Self {
        QueueConfig {
            max_waiting: 0,
            timeout: Duration::from_millis(1000),
            per_class: Vec::new(),
        }
    }
}

impl Section for ProxyConfig {
    const KEY: &'static str = "proxy";
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
pub(super) struct RawProxy {
    max_retries: Option<u32>,
    initial_backoff_ms: Option<u64>,
    backoff_multiplier: Option<f64>,
    jitter_factor: Option<f64>,
    retryable_statuses: Option<Vec<u16>>,
    connect_timeout_secs: Option<Secs>,
    request_timeout_secs: Option<Secs>,
    attempt_timeout_secs: Option<Secs>,
    pool_idle_timeout_secs: Option<Secs>,
    add_routed_peer_header: Option<bool>,
    remote_media_url_policy: Option<Value>,
    models_cache_secs: Option<Secs>,
    api_key: Option<String>,
    passthrough: Option<Value>,
    tls: Option<RawTls>,
    queue: Option<RawQueue>,
    drain_secs: Option<Secs>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
struct RawQueue {
    max_waiting: Option<u64>,
    timeout_ms: Option<u64>,
    per_class: Option<std::collections::BTreeMap<String, RawClassQueue>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
struct RawClassQueue {
    max_waiting: Option<u64>,
    timeout_ms: Option<u64>,
}

/// `proxy.queue.max_waiting` at `key`: 0 to 1,000,000.
fn max_waiting(ck: &Checker<'_>, key: &str, v: u64) -> Result<usize, ConfigError> {
    if v > 1_000_000 {
        return Err(ck.bad(key, v, "is out of range (requests, 0 = off, to 1,000,000)"));
    }
    Ok(v as usize)
}

/// `proxy.queue.timeout_ms` at `key`: 1 to 600,000.
fn timeout_ms(ck: &Checker<'_>, key: &str, v: u64) -> Result<Duration, ConfigError> {
    if !(1..=600_000).contains(&v) {
        return Err(ck.bad(key, v, "is out of range (milliseconds, 1 to 600000)"));
    }
    Ok(Duration::from_millis(v))
}

impl RawProxy {
    /// The defaults are written here rather than in a `Default` (the TLS setting of
    /// one is built by reading the trust store); each field's doc says its default.
    pub(super) fn validate(self, ck: &Checker<'_>) -> Result<ProxyConfig, ConfigError> {
        let backoff_multiplier = self.backoff_multiplier.unwrap_or(2.0);
        if !backoff_multiplier.is_finite() || !(1.0..=100.0).contains(&backoff_multiplier) {
            return Err(ck.bad(
                "proxy.backoff_multiplier",
                backoff_multiplier,
                "is out of range [1, 100]",
            ));
        }
        let jitter_factor = self.jitter_factor.unwrap_or(0.2);
        if !(0.0..=1.0).contains(&jitter_factor) {
            return Err(ck.bad(
                "proxy.jitter_factor",
                jitter_factor,
                "is out of range [0, 1]",
            ));
        }
        let retryable_statuses = self
            .retryable_statuses
            .unwrap_or_else(|| vec![502, 503, 504]);
        if let Some((i, bad)) = retryable_statuses
            .iter()
            .enumerate()
            .find(|(_, s)| !(100..=599).contains(*s))
        {
            return Err(ck.bad(
                &format!("proxy.retryable_statuses[{i}]"),
                bad,
                "is not an HTTP status (100–599)",
            ));
        }
        let remote_media_url_policy = remote_media(self.remote_media_url_policy, ck)?;
        let passthrough = match &self.passthrough {
            None => Passthrough::default(),
            Some(v) => Passthrough::from_yaml(v).map_err(|m| match v {
                Value::Sequence(_) => ck.err("proxy.passthrough", m),
                _ => ck.bad("proxy.passthrough", format!("{v:?}"), m),
            })?,
        };
        let tls = self.tls.unwrap_or_default().validate(ck)?;
        let queue = self.queue.unwrap_or_default().validate(ck)?;
        let request_timeout = ck.secs(
            "proxy.request_timeout_secs",
            self.request_timeout_secs,
            600.0,
            None,
        )?;
        let attempt_timeout = match self.attempt_timeout_secs {
            None => None,
            Some(v) => {
                let t = ck.secs("proxy.attempt_timeout_secs", Some(v), 0.0, None)?;
                if t > request_timeout {
                    return Err(ck.bad(
                        "proxy.attempt_timeout_secs",
                        v.0,
                        format!(
                            "is longer than proxy.request_timeout_secs ({} s), which bounds every attempt together",
                            request_timeout.as_secs_f64()
                        ),
                    ));
                }
                Some(t)
            }
        };
        Ok(ProxyConfig {
            queue,
            max_retries: self.max_retries.unwrap_or(2),
            initial_backoff: Duration::from_millis(self.initial_backoff_ms.unwrap_or(50)),
            backoff_multiplier,
            jitter_factor,
            retryable_statuses,
            connect_timeout: ck.secs(
                "proxy.connect_timeout_secs",
                self.connect_timeout_secs,
                2.0,
                None,
            )?,
            request_timeout,
            attempt_timeout,
            pool_idle_timeout: ck.secs(
                "proxy.pool_idle_timeout_secs",
                self.pool_idle_timeout_secs,
                4.0,
                Some("no idle connection kept"),
            )?,
            add_routed_peer_header: self.add_routed_peer_header.unwrap_or(false),
            remote_media_url_policy,
            models_cache: ck.secs(
                "proxy.models_cache_secs",
                self.models_cache_secs,
                600.0,
                Some("never cached"),
            )?,
            api_key: ck.secret("proxy.api_key", self.api_key)?,
            passthrough,
            tls,
            drain: ck.secs(
                "proxy.drain_secs",
                self.drain_secs,
                30.0,
                Some("streams continue elsewhere at once"),
            )?,
        })
    }
}

/// `proxy.remote_media_url_policy`: `allow` (default) or a 4xx status.
fn remote_media(v: Option<Value>, ck: &Checker<'_>) -> Result<RemoteMediaPolicy, ConfigError> {
    match v {
        None => Ok(RemoteMediaPolicy::Allow),
        Some(Value::String(s)) if s == "allow" => Ok(RemoteMediaPolicy::Allow),
        Some(Value::Number(n)) if n.as_u64().is_some_and(|n| (400..=499).contains(&n)) => {
            Ok(RemoteMediaPolicy::Reject(n.as_u64().unwrap_or(400) as u16))
        }
        Some(other) => Err(ck.bad(
            "proxy.remote_media_url_policy",
            format!("{other:?}"),
            "is not `allow` or a 4xx status",
        )),
    }
}

impl RawQueue {
    fn validate(self, ck: &Checker<'_>) -> Result<QueueConfig, ConfigError> {
        let d = QueueConfig::default();
        let max = self.max_waiting.unwrap_or(d.max_waiting as u64);
        let max = max_waiting(ck, "proxy.queue.max_waiting", max)?;
        let ms = self.timeout_ms.unwrap_or(d.timeout.as_millis() as u64);
        let timeout = timeout_ms(ck, "proxy.queue.timeout_ms", ms)?;
        let mut per_class = Vec::new();
        for (class, raw) in self.per_class.unwrap_or_default() {
            let at = format!("proxy.queue.per_class.{class}");
            let bound = ClassQueueConfig {
                max_waiting: match raw.max_waiting {
                    Some(v) => max_waiting(ck, &format!("{at}.max_waiting"), v)?,
                    None => max,
                },
                timeout: match raw.timeout_ms {
                    Some(v) => timeout_ms(ck, &format!("{at}.timeout_ms"), v)?,
                    None => timeout,
                },
            };
            per_class.push((class, bound));
        }
        Ok(QueueConfig {
            max_waiting: max,
            timeout,
            per_class,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::testing::{ONE, err, load};

    #[test]
    fn defaults_and_refusals() {
        let p = load(&[("a", ONE)]).unwrap().proxy;
        assert_eq!(
            (p.max_retries, p.initial_backoff, p.retryable_statuses),
            (2, Duration::from_millis(50), vec![502, 503, 504])
        );
        assert_eq!(
            (p.attempt_timeout, &p.queue),
            (None, &QueueConfig::default())
        );
        assert_eq!(p.remote_media_url_policy, RemoteMediaPolicy::Allow);
        let p = load(&[("a", ONE), ("b", "proxy: {remote_media_url_policy: 415}\n")])
            .unwrap()
            .proxy;
        assert_eq!(p.remote_media_url_policy, RemoteMediaPolicy::Reject(415));
        for (over, key) in [
            (
                "proxy: {remote_media_url_policy: 500}\n",
                "proxy.remote_media_url_policy",
            ),
            (
                "proxy: {backoff_multiplier: 0.5}\n",
                "proxy.backoff_multiplier",
            ),
            (
                "proxy: {queue: {max_waiting: 2000000}}\n",
                "proxy.queue.max_waiting",
            ),
            (
                "proxy: {queue: {timeout_ms: 0}}\n",
                "proxy.queue.timeout_ms",
            ),
            (
                "proxy: {queue: {per_class: {batch: {timeout_ms: 0}}}}\n",
                "proxy.queue.per_class.batch.timeout_ms",
            ),
            (
                "priority: {}\nproxy: {queue: {max_waiting: 4, per_class: {gold: {}}}}\n",
                "proxy.queue.per_class.gold",
            ),
            (
                "proxy: {queue: {max_waiting: 4, per_class: {batch: {}}}}\n",
                "proxy.queue.per_class",
            ),
            (
                "proxy: {request_timeout_secs: 5, attempt_timeout_secs: 6}\n",
                "proxy.attempt_timeout_secs",
            ),
        ] {
            let e = err(&[("a.yaml", ONE), ("b.yaml", over)]);
            assert!(e.contains("b.yaml") && e.contains(key), "{over}: {e}");
        }
    }
}

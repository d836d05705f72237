//! `session:` — session affinity around any policy (see `policy::session`).

use std::num::NonZeroUsize;
use std::time::Duration;

use serde::Deserialize;

use super::check::{Checker, ConfigError, Secs, named};
use super::difference::Section;

/// `session:` — session affinity around the policy (see `policy::session`).
#[derive(Debug, Clone, PartialEq)]
pub struct SessionConfig {
    /// On by default; applies only to requests that carry a key.
    pub enabled: bool,
    /// Headers read for the key, in order (default `[x-session-id]`).
    pub headers: Vec<http::HeaderName>,
    /// Body fields read for the key when no header has one: dotted JSON paths such as
    /// `user` or `metadata.user_id` (default none: the body is not parsed for it).
    pub body_fields: Vec<String>,
    pub mode: SessionMode,
    /// A binding expires this long after its last use (default 3600 s).
    pub ttl: Duration,
    /// Most bindings held; least recently used go first (default 1,000,000).
    pub max_sessions: NonZeroUsize,
}

/// `session.mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionMode {
    /// Follow the binding unless its worker is unusable or overloaded (the default).
    Soft,
    /// Follow it whatever the load; leave only an unusable worker.
    Hard,
}

named!(SessionMode { "soft" => SessionMode::Soft, "hard" => SessionMode::Hard });

impl Default for SessionConfig {
    fn default() -> Self {
        SessionConfig {
            enabled: true,
            headers: vec![http::HeaderName::from_static("x-session-id")],
            body_fields: Vec::new(),
            mode: SessionMode::Soft,
            ttl: Duration::from_secs(3600),
            max_sessions: const { NonZeroUsize::new(1_000_000).unwrap() },
        }
    }
}

impl Section for SessionConfig {
    const KEY: &'static str = "session";
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
pub(super) struct RawSession {
    enabled: Option<bool>,
    headers: Option<Vec<String>>,
    body_fields: Option<Vec<String>>,
    mode: Option<SessionMode>,
    ttl_secs: Option<Secs>,
    max_sessions: Option<u64>,
}

impl RawSession {
    pub(super) fn validate(self, ck: &Checker<'_>) -> Result<SessionConfig, ConfigError> {
        let d = SessionConfig::default();
        let headers = match self.headers {
            None => d.headers,
            Some(names) => {
                let mut headers = Vec::with_capacity(names.len());
                for (i, h) in names.iter().enumerate() {
                    let name = http::HeaderName::from_bytes(h.as_bytes()).map_err(|_| {
                        ck.bad(
                            &format!("session.headers[{i}]"),
                            h,
                            "is not an HTTP header name",
                        )
                    })?;
                    headers.push(name);
                }
                headers
            }
        };
        let body_fields = self.body_fields.unwrap_or(d.body_fields);
        for (i, f) in body_fields.iter().enumerate() {
            if f.is_empty() || f.split('.').any(str::is_empty) {
                return Err(ck.bad(
                    &format!("session.body_fields[{i}]"),
                    f,
                    "is not a dotted JSON path (e.g. `user` or `metadata.user_id`)",
                ));
            }
        }
        let max_sessions = self.max_sessions.unwrap_or(d.max_sessions.get() as u64);
        let max_sessions = NonZeroUsize::new(max_sessions as usize)
            .filter(|_| max_sessions <= 100_000_000)
            .ok_or_else(|| {
                ck.bad(
                    "session.max_sessions",
                    max_sessions,
                    "is out of range (sessions, 1 to 100,000,000)",
                )
            })?;
        Ok(SessionConfig {
            enabled: self.enabled.unwrap_or(d.enabled),
            headers,
            body_fields,
            mode: self.mode.unwrap_or(d.mode),
            ttl: ck.secs("session.ttl_secs", self.ttl_secs, d.ttl.as_secs_f64(), None)?,
            max_sessions,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::testing::{ONE, err, load};

    #[test]
    fn defaults_and_refusals() {
        let c = load(&[("a", ONE)]).unwrap();
        assert_eq!(c.session, SessionConfig::default());
        let c = load(&[
            ("a", ONE),
            (
                "b",
                "session: {headers: [X-User], body_fields: [metadata.user_id], mode: hard}\n",
            ),
        ])
        .unwrap();
        assert_eq!(c.session.headers, ["x-user"]);
        assert_eq!(c.session.body_fields, ["metadata.user_id"]);
        assert_eq!(c.session.mode, SessionMode::Hard);
        for (over, key) in [
            ("session: {headers: [\"a b\"]}\n", "session.headers[0]"),
            (
                "session: {body_fields: [user, \"a..b\"]}\n",
                "session.body_fields[1]",
            ),
            ("session: {max_sessions: 0}\n", "session.max_sessions"),
            ("session: {ttl_secs: 0}\n", "session.ttl_secs"),
        ] {
            let e = err(&[("a.yaml", ONE), ("b.yaml", over)]);
            assert!(e.contains("b.yaml") && e.contains(key), "{over}: {e}");
        }
    }
}

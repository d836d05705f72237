//! The checker: where a key sits in the files, and refusals in the config's words.
//!
//! Every refusal names the file that last set the key, the line, the key's full path
//! and the value as that file wrote it ([`Checker`]); a credential's value is never
//! shown. The value kinds read with those words live here too: seconds as YAML writes
//! numbers ([`Secs`]), and names from a fixed set ([`Named`]).

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use serde_yaml_ng::Value;

use super::secret::Secret;
use super::source;
use crate::redact;

/// A config error: which file, which key, what was wrong.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{file}: cannot read: {source}")]
    Read {
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// YAML syntax, or a key the file cannot hold (unknown, wrong type); `key` and
    /// `line` when the parser knows them.
    #[error("{file}{}: {}{message}", at_line(*.line), key.as_ref().map_or_else(String::new, |k| format!("`{k}`: ")))]
    Parse {
        file: PathBuf,
        line: Option<usize>,
        key: Option<String>,
        message: String,
    },
    /// A value out of range or unusable, in the last file that set it.
    #[error("{file}{}: `{key}`: {message}", at_line(*.line))]
    Invalid {
        file: PathBuf,
        line: Option<usize>,
        key: String,
        message: String,
    },
    #[error("{0}")]
    Other(String),
}

fn at_line(line: Option<usize>) -> String {
    line.map_or_else(String::new, |l| format!(":{l}"))
}

/// Shortest non-zero interval or time-out, in seconds: below it a timer loop spins
/// (a health interval of 1e-7 s burns most of a core) and no network answer fits.
pub const MIN_SECS: f64 = 0.01;

/// A number of seconds as YAML writes numbers (`5`, `0.5`, `1e-3`, `0x10`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Secs(pub(super) f64);

impl<'de> Deserialize<'de> for Secs {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Secs;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a number of seconds")
            }
            fn visit_u64<E>(self, v: u64) -> Result<Secs, E> {
                Ok(Secs(v as f64))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Secs, E> {
                Ok(Secs(v as f64))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Secs, E> {
                Ok(Secs(v))
            }
        }
        d.deserialize_any(V)
    }
}

/// A value that is one of a fixed set of names (`policy`, `log.format`, `workers[].role`,
/// …). Read as a plain string whatever the YAML form, so that every refusal — a wrong
/// name, a number, a list, a mapping, a `!tag` — lists the names the key takes, not
/// the YAML library's enum rules.
pub(crate) trait Named: Sized + 'static {
    /// Every accepted name, in the order a refusal lists them.
    const NAMES: &'static [&'static str];
    fn from_name(name: &str) -> Option<Self>;
}

/// [`Named`]'s names in words: "`a` or `b`", "one of: `a`, `b`, `c`".
fn one_of(names: &[&str]) -> String {
    let quoted: Vec<String> = names.iter().map(|n| format!("`{n}`")).collect();
    match quoted.as_slice() {
        [a, b] => format!("{a} or {b}"),
        all => format!("one of: {}", all.join(", ")),
    }
}

pub(super) fn deserialize_named<'de, D: serde::Deserializer<'de>, T: Named>(
    d: D,
) -> Result<T, D::Error> {
    struct V<T>(std::marker::PhantomData<T>);
    impl<T: Named> serde::de::Visitor<'_> for V<T> {
        type Value = T;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(&one_of(T::NAMES))
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<T, E> {
            T::from_name(v).ok_or_else(|| E::unknown_variant(v, T::NAMES))
        }
    }
    d.deserialize_any(V(std::marker::PhantomData))
}

/// `impl Named` and `Deserialize` for an enum of unit variants, one name each.
macro_rules! named {
    ($ty:ty { $($name:literal => $variant:expr),+ $(,)? }) => {
        impl $crate::config::check::Named for $ty {
            const NAMES: &'static [&'static str] = &[$($name),+];
            fn from_name(name: &str) -> Option<Self> {
                match name {
                    $($name => Some($variant),)+
                    _ => None,
                }
            }
        }
        impl<'de> serde::Deserialize<'de> for $ty {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                $crate::config::check::deserialize_named(d)
            }
        }
    };
}
pub(super) use named;

/// One file: its name, its text (to quote values as written) and its parsed YAML (to
/// tell which file set a key).
pub(super) struct Layer<'a> {
    pub(super) file: &'a Path,
    pub(super) text: &'a str,
    pub(super) doc: Value,
}

impl Layer<'_> {
    fn sets(&self, path: &[source::Seg<'_>]) -> bool {
        let mut v = &self.doc;
        for seg in path {
            // A `!tag` on a section is no part of its path.
            if let Value::Tagged(t) = v {
                v = &t.value;
            }
            let next = match (seg, v) {
                (source::Seg::Key(k), Value::Mapping(m)) => m.get(*k),
                (source::Seg::Index(i), Value::Sequence(s)) => s.get(*i),
                _ => None,
            };
            match next {
                Some(n) => v = n,
                None => return false,
            }
        }
        true
    }
}

/// Where a key was set (file and line), kept past loading: a part that reads a file
/// the config names (the tokenizer) refuses it as the checker would have.
#[derive(Debug, Clone, Default)]
pub struct KeySite {
    file: PathBuf,
    line: Option<usize>,
    key: String,
}

impl KeySite {
    /// A refusal of this key that says `message` (redacted), worded as the checker's.
    pub fn refuse(&self, message: impl Into<String>) -> ConfigError {
        ConfigError::Invalid {
            file: self.file.clone(),
            line: self.line,
            key: self.key.clone(),
            message: redact::line(&message.into()),
        }
    }
}

/// Builds range errors: the file that last set the key, the line, and the value as
/// that file wrote it.
pub(super) struct Checker<'a> {
    pub(super) layers: &'a [Layer<'a>],
}

impl Checker<'_> {
    /// The file that last set `key` (a dotted path such as `workers[2].url`; the nearest
    /// parent when no file sets the key itself) and where the value sits in it.
    fn find(&self, key: &str) -> (PathBuf, Option<source::Spot>) {
        let segs = source::segments(key);
        let mut path = segs.as_slice();
        loop {
            if let Some(l) = self.layers.iter().rev().find(|l| l.sets(path)) {
                return (l.file.to_path_buf(), source::locate(l.text, path));
            }
            if path.len() <= 1 {
                let file = self.layers.last().map(|l| l.file.to_path_buf());
                return (file.unwrap_or_default(), None);
            }
            path = &path[..path.len() - 1];
        }
    }

    /// Where `key` was set, for a refusal made after loading ([`KeySite::refuse`]).
    pub(super) fn site(&self, key: &str) -> KeySite {
        let (file, spot) = self.find(key);
        KeySite {
            file,
            line: spot.map(|s| s.line),
            key: key.to_string(),
        }
    }

    /// A refusal of `key` that says `message` (redacted).
    pub(super) fn err(&self, key: &str, message: impl Into<String>) -> ConfigError {
        self.site(key).refuse(message)
    }

    /// A refusal of the scalar at `key`: "`<value as written>` <why>". `parsed` is shown
    /// when the value is a default no file wrote; a secret key's value never is.
    pub(super) fn bad(
        &self,
        key: &str,
        parsed: impl std::fmt::Display,
        why: impl std::fmt::Display,
    ) -> ConfigError {
        let (file, spot) = self.find(key);
        let shown = if redact::is_secret_key(key) {
            redact::MASK.to_string()
        } else {
            let shown = spot
                .as_ref()
                .filter(|s| !s.text.is_empty())
                .map_or_else(|| parsed.to_string(), |s| s.text.clone());
            redact::url(&shown).into_owned()
        };
        ConfigError::Invalid {
            file,
            line: spot.map(|s| s.line),
            key: key.to_string(),
            message: redact::line(&format!("`{shown}` {why}")),
        }
    }

    /// Seconds at `key` (default `default`): finite, at most 1e9, and at least
    /// [`MIN_SECS`]; with `zero_means` set, 0 is also accepted (and means that).
    pub(super) fn secs(
        &self,
        key: &str,
        v: Option<Secs>,
        default: f64,
        zero_means: Option<&str>,
    ) -> Result<Duration, ConfigError> {
        let s = v.map_or(default, |s| s.0);
        let ok = s.is_finite() && s <= 1e9 && (s >= MIN_SECS || (s == 0.0 && zero_means.is_some()));
        if !ok {
            let range = match zero_means {
                Some(what) => format!("seconds: 0 ({what}), or {MIN_SECS} to 1e9"),
                None => format!("seconds: {MIN_SECS} to 1e9"),
            };
            return Err(self.bad(key, s, format!("is out of range ({range})")));
        }
        Ok(Duration::from_secs_f64(s))
    }

    /// A count at `key` (default `default`) of at least 1.
    pub(super) fn at_least_one(
        &self,
        key: &str,
        v: Option<u32>,
        default: u32,
    ) -> Result<u32, ConfigError> {
        match v.unwrap_or(default) {
            0 => Err(self.bad(key, 0, "is out of range (must be ≥ 1)")),
            n => Ok(n),
        }
    }

    /// The section at `key`, read from the merged document (`v`) into `T`; an error
    /// names the full key path and says what was wrong in the config's words, like a
    /// refusal of the file itself.
    pub(super) fn typed<T: serde::de::DeserializeOwned>(
        &self,
        key: &str,
        v: Value,
    ) -> Result<T, ConfigError> {
        serde_path_to_error::deserialize(v).map_err(|e| {
            let path = e.path().to_string();
            let full = match path.as_str() {
                "." => key.to_string(),
                p if p.starts_with('[') => format!("{key}{p}"),
                p => format!("{key}.{p}"),
            };
            let written = if redact::is_secret_key(&full) {
                Some(redact::MASK.to_string())
            } else {
                self.find(&full)
                    .1
                    .map(|s| redact::url(&s.text).into_owned())
                    .filter(|w| !w.is_empty())
            };
            let message = source::humanize(&e.into_inner().to_string(), &full, written.as_deref());
            self.err(&full, message)
        })
    }

    /// A credential at `key`, checked by [`Secret::parse`].
    pub(super) fn secret(
        &self,
        key: &str,
        v: Option<String>,
    ) -> Result<Option<Secret>, ConfigError> {
        v.map(Secret::parse)
            .transpose()
            .map_err(|m| self.err(key, m))
    }
}

/// Deserialises one YAML text into `T` with the full key path of any error
/// (serde_path_to_error), its line, and the value as the file wrote it.
pub(super) fn parse<T: serde::de::DeserializeOwned>(
    file: &Path,
    text: &str,
) -> Result<T, ConfigError> {
    let de = serde_yaml_ng::Deserializer::from_str(text);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let loc = inner.location();
        let key = (path != ".").then_some(path);
        let written = match &key {
            Some(k) if redact::is_secret_key(k) => Some(redact::MASK.to_string()),
            _ => loc
                .as_ref()
                .map(|l| redact::url(&source::written_at(text, l.index())).into_owned()),
        };
        let message = source::humanize(
            &inner.to_string(),
            key.as_deref().unwrap_or(""),
            written.as_deref().filter(|w| !w.is_empty()),
        );
        ConfigError::Parse {
            file: file.to_path_buf(),
            line: loc.map(|l| l.line()),
            key,
            message: redact::line(&message),
        }
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::testing::{ONE, err, load};
    use crate::config::{PolicyKind, Role};

    #[test]
    fn every_named_value_reads_back_its_own_name() {
        fn each<T: Named + PartialEq + std::fmt::Debug>(name: impl Fn(&T) -> &'static str) {
            for n in T::NAMES {
                let v = T::from_name(n).unwrap_or_else(|| panic!("{n}"));
                assert_eq!(name(&v), *n);
            }
        }
        each::<PolicyKind>(|p| p.as_str());
        each::<Role>(|r| r.as_str());
        assert_eq!(PolicyKind::NAMES.len(), 10);
        assert_eq!(one_of(&["a", "b"]), "`a` or `b`");
        assert_eq!(one_of(&["a", "b", "c"]), "one of: `a`, `b`, `c`");
    }

    #[test]
    fn out_of_range_values_name_file_key_and_value() {
        let cases = [
            ("cache:\n  threshold: 1.5\n", "cache.threshold", "1.5"),
            ("cache:\n  threshold: -0.1\n", "cache.threshold", "-0.1"),
            (
                "cache:\n  balance_rel_threshold: 0.5\n",
                "cache.balance_rel_threshold",
                "0.5",
            ),
            (
                "cache:\n  daily_cleanup_hour_utc: 24\n",
                "cache.daily_cleanup_hour_utc",
                "24",
            ),
            ("cache:\n  max_tree_size: 0\n", "cache.max_tree_size", "0"),
            (
                "cache:\n  max_tree_bytes: 1000\n",
                "cache.max_tree_bytes",
                "1000",
            ),
            ("proxy:\n  jitter_factor: 2\n", "proxy.jitter_factor", "2"),
            (
                "proxy:\n  retryable_statuses: [700]\n",
                "proxy.retryable_statuses",
                "700",
            ),
            (
                "health:\n  failure_threshold: 0\n",
                "health.failure_threshold",
                "0",
            ),
            ("health:\n  interval_secs: 0\n", "health.interval_secs", "0"),
            ("health:\n  endpoint: health\n", "health.endpoint", "health"),
            (
                "server:\n  max_body_bytes: 0\n",
                "server.max_body_bytes",
                "0",
            ),
            ("log:\n  level: \"[[\"\n", "log.level", "[["),
        ];
        for (over, key, value) in cases {
            let e = err(&[("base.yaml", ONE), ("over.yaml", over)]);
            assert!(
                e.contains("over.yaml") && e.contains(key) && e.contains(value),
                "{over:?} gave {e}"
            );
        }
    }

    #[test]
    fn refusals_name_file_line_key_and_the_value_as_written() {
        for (over, want) in [
            (
                "workers: [{url: 70000}]\n",
                "over.yaml:1: `workers[0].url`: `70000`",
            ),
            (
                "health:\n  interval_secs: 0.0000001 # fast\n",
                "over.yaml:2: `health.interval_secs`: `0.0000001` is out of range",
            ),
            (
                "server:\n  host: 123\n",
                "over.yaml:2: `server.host`: `123`",
            ),
            (
                "server:\n  host: [a]\n",
                "over.yaml:2: `server.host`: a list is not a string",
            ),
            (
                "health:\n  endpoint: [a]\n",
                "over.yaml:2: `health.endpoint`: a list is not a string",
            ),
            (
                "log:\n  level: {a: 1}\n",
                "over.yaml:2: `log.level`: a mapping is not a string",
            ),
            (
                "log:\n  level: \"[[\"\n",
                "over.yaml:2: `log.level`: `\"[[\"`",
            ),
            (
                "server:\n  port: 70000\n",
                "over.yaml:2: `server.port`: `70000` is not a whole number from 0 to 65535",
            ),
            (
                "cache:\n  threshold: high\n",
                "over.yaml:2: `cache.threshold`: `high` is not a number",
            ),
            (
                "workers:\n  - url: http://a:1\n  - {url: http://b:1, max_load: -1}\n",
                "over.yaml:3: `workers[1].max_load`: `-1` is not a whole number",
            ),
            (
                "proxy:\n  retryable_statuses: [502, 700]\n",
                "over.yaml:2: `proxy.retryable_statuses[1]`: `700` is not an HTTP status",
            ),
            (
                "server:\n  prot: 1\n",
                "over.yaml:2: `server.prot`: unknown key `prot`",
            ),
            (
                "policy: fastest\n",
                "over.yaml:1: `policy`: `fastest` is not one of",
            ),
            (
                "proxy:\n  passthrough: open\n",
                "over.yaml:2: `proxy.passthrough`: `open` is not",
            ),
        ] {
            let e = err(&[("base.yaml", ONE), ("over.yaml", over)]);
            assert!(e.contains(want), "{over:?} gave {e}\nwanted {want}");
            assert!(
                !e.contains(" f64") && !e.contains(" u64") && !e.contains("struct Raw"),
                "{e}"
            );
        }
        // Layered: the merged document reads like each file alone.
        let e = err(&[
            ("base.yaml", ONE),
            ("a.yaml", "cache:\n  threshold: 0.5\n"),
            ("over.yaml", "workers: [{url: 70000}]\n"),
        ]);
        assert!(e.contains("over.yaml:1: `workers[0].url`: `70000`"), "{e}");
    }

    #[test]
    fn seconds_take_any_yaml_number_and_every_interval_has_a_lower_bound() {
        let c = load(&[
            ("a.yaml", ONE),
            (
                "b.yaml",
                "health:\n  timeout_secs: 0x10\n  interval_secs: 1e1\n",
            ),
        ])
        .unwrap();
        assert_eq!(c.health.timeout, Duration::from_secs(16));
        assert_eq!(c.health.interval, Duration::from_secs(10));
        let zero_is_off = [
            "server.shutdown_grace_secs",
            "cache.eviction_interval_secs",
            "proxy.pool_idle_timeout_secs",
            "proxy.models_cache_secs",
            "precise.speculative_ttl_secs",
        ];
        for key in [
            "server.shutdown_grace_secs",
            "server.body_timeout_secs",
            "cache.eviction_interval_secs",
            "health.interval_secs",
            "health.timeout_secs",
            "circuit_breaker.timeout_secs",
            "proxy.connect_timeout_secs",
            "proxy.request_timeout_secs",
            "proxy.pool_idle_timeout_secs",
            "proxy.models_cache_secs",
            "precise.stale_secs",
            "precise.speculative_ttl_secs",
        ] {
            let (section, name) = key.split_once('.').unwrap();
            let doc = |v: &str| format!("{section}:\n  {name}: {v}\n");
            for bad in ["0.0000001", "0.009", "-1", "1e10", ".nan"] {
                let e = err(&[("a.yaml", ONE), ("b.yaml", &doc(bad))]);
                assert!(
                    e.contains(key) && e.contains(bad) && e.contains("0.01"),
                    "{key} {bad}: {e}"
                );
            }
            assert!(
                load(&[("a.yaml", ONE), ("b.yaml", &doc("0.01"))]).is_ok(),
                "{key} 0.01"
            );
            assert_eq!(
                load(&[("a.yaml", ONE), ("b.yaml", &doc("0"))]).is_ok(),
                zero_is_off.contains(&key),
                "{key}: 0"
            );
        }
        let c = load(&[("a.yaml", ONE)]).unwrap();
        assert_eq!(c.server.body_timeout, Duration::from_secs(30));
    }

    #[test]
    fn credentials_never_leak_through_big_numbers_collections_or_odd_urls() {
        const S: &str = "SECRET-xyz";
        for doc in [
            "server:\n  admin_token: 123456789012345678901234567890\nworkers: [{url: \"http://h:1\"}]\n",
            "workers:\n  api_key: SECRET-xyz\n  url: http://127.0.0.1:1\n",
            "workers: {url: \"http://h:1\", api_key: SECRET-xyz}\n",
            "server: [admin_token, SECRET-xyz]\nworkers: [{url: \"http://h:1\"}]\n",
            "workers:\n  - url: \"http://admin:pa'SECRET-xyz@10.0.0.7:8000\"\n",
            "workers:\n  - url: \"http://admin:pa ss<SECRET-xyz>@10.0.0.7:8000\"\n",
            "workers:\n  - url: admin:SECRET-xyz@10.0.0.7:8000\n",
            "workers:\n  - url: http://admin:1234/SECRET-xyz@10.0.0.7:8000\n",
            "policy: precise_cache_aware\nworkers:\n  - url: http://127.0.0.1:1\n    kv_events: {endpoint: \"tcp://u:SECRET-xyz@127.0.0.1:5557\"}\n",
        ] {
            let e = err(&[("s.yaml", doc)]);
            assert!(!e.contains(S) && !e.contains("u128"), "{doc:?}: {e}");
            assert!(e.contains("s.yaml:"), "{doc:?}: {e}");
        }
        let s = "123456789012345678901234567890";
        let e = err(&[(
            "s.yaml",
            &format!("server:\n  admin_token: {s}\nworkers: [{{url: \"http://h:1\"}}]\n"),
        )]);
        assert!(!e.contains(s), "{e}");
        // A newline in a value cannot forge a log line.
        let e = err(&[(
            "s.yaml",
            "workers:\n  - url: \"http://127.0.0.1:1\\n2026-12-01 INFO forged\"\n",
        )]);
        assert!(!e.contains('\n'), "{e}");
    }
}

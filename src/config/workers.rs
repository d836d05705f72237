//! `workers:` — the static worker list: each entry a URL string or a mapping, checked
//! one by one (the admin API's `POST /workers` body is one entry), then together (one
//! worker per URL, one identity per worker).

use std::collections::HashMap;
use std::num::NonZeroUsize;

use serde::Deserialize;

use super::check::{Checker, ConfigError, named};
use super::kv_events::{KvEventsConfig, RawKvEvents};
use super::lmcache::{LmcacheConfig, RawLmcache};
use super::models::MAX_MODEL_NAME_BYTES;
use super::pd::Phase;
use super::secret::Secret;
use super::source;
use super::worker_url::WorkerUrl;
use crate::redact;

/// One entry of `workers:`.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerConfig {
    pub url: WorkerUrl,
    /// Its stable identity (`name`); `None` = the normalised URL (see [`WorkerConfig::key`]).
    pub name: Option<String>,
    /// `primary` (default) or `fallback`: a fallback worker takes requests only while no
    /// primary worker is usable.
    pub role: Role,
    /// Most in-flight requests this worker takes; `None` = unbounded (the default).
    pub max_load: Option<NonZeroUsize>,
    /// Added to the in-flight count when comparing loads (default 0), to make a slower
    /// replica look busier than it is.
    pub load_penalty: u32,
    /// Whether prefix affinity applies to this worker (default true); when false it is
    /// only ever picked for load.
    pub cache_aware: bool,
    /// Bearer token sent to this worker, overriding `proxy.api_key`.
    pub api_key: Option<Secret>,
    /// Where this worker's engine publishes its KV-cache events (precise mode).
    pub kv_events: Option<KvEventsConfig>,
    /// Its LMCache occupancy signal (`lmcache_aware`).
    pub lmcache: Option<LmcacheConfig>,
    /// The served names it answers (`models`), pinned: its `GET /v1/models` is then
    /// never read. `None` = read from the worker.
    pub models: Option<Vec<String>>,
    /// LoRA adapters its engine holds in memory at once (`max_lora`: vLLM's
    /// `--max-loras`, SGLang's `--max-loras-per-batch`), for the router's estimate of
    /// which adapters it holds; `None` = what its engine's metrics report, else
    /// [`crate::pools::pool::adapters::DEFAULT_SLOTS`].
    pub max_lora: Option<NonZeroUsize>,
    /// Its part of a request in a disaggregated pool (`phase`, default `both`).
    pub phase: Phase,
    /// SGLang's `--disaggregation-bootstrap-port` of a prefill worker (`bootstrap_port`).
    pub bootstrap_port: Option<u16>,
}

/// `workers[i].role`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Role {
    #[default]
    Primary,
    Fallback,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Primary => "primary",
            Role::Fallback => "fallback",
        }
    }
}

named!(Role { "primary" => Role::Primary, "fallback" => Role::Fallback });

impl WorkerConfig {
    /// The worker's identity: `name` when set, else the normalised URL. Routing memory,
    /// sessions and counters follow the key, never the worker's position in the list.
    pub fn key(&self) -> &str {
        self.name.as_deref().unwrap_or(self.url.as_str())
    }

    /// A worker from a JSON object with the keys of one `workers:` entry (admin API):
    /// `{"url": …, "max_load"?: n, "load_penalty"?: n, "cache_aware"?: bool,
    /// "api_key"?: "…"}`. The error names the field and the bad value.
    pub fn from_json(body: &[u8]) -> Result<WorkerConfig, String> {
        let mut de = serde_json::Deserializer::from_slice(body);
        let WorkerEntry(raw) = serde_path_to_error::deserialize(&mut de).map_err(|e| {
            let path = e.path().to_string();
            let message = if redact::is_secret_key(&path) {
                // serde_json quotes the bad value; a credential's is never shown.
                "is not a string (the value is not shown)".to_string()
            } else {
                source::humanize(&e.into_inner().to_string(), &path, None)
            };
            let m = match path.as_str() {
                "." | "?" => message,
                _ => format!("`{path}`: {message}"),
            };
            redact::line(&m)
        })?;
        raw.validate()
            .map_err(|(field, m)| redact::line(&format!("`{field}`: {m}")))
    }
}

/// Most adapter slots `workers[].max_lora` may give a worker.
const MAX_LORA: u64 = 4096;

/// What a `workers:` entry may be, in the config's words (every error about one says it).
const WORKER_ENTRY: &str = "a URL string or a mapping with `url:`";

/// One `workers:` entry (and the admin API's `POST /workers` body): a plain URL string
/// (`- http://10.0.0.1:8000`, the form other routers take) or a mapping with `url:` and
/// the optional keys of [`RawWorker`]; `- URL` means the same as `- url: URL`, and one
/// list may mix both.
#[derive(Debug)]
pub(super) struct WorkerEntry(RawWorker);

impl<'de> Deserialize<'de> for WorkerEntry {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = WorkerEntry;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(WORKER_ENTRY)
            }
            fn visit_str<E: serde::de::Error>(self, url: &str) -> Result<WorkerEntry, E> {
                Ok(WorkerEntry(RawWorker::of_url(url.to_string())))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                map: A,
            ) -> Result<WorkerEntry, A::Error> {
                // The derived struct reads the keys through the same (path-tracking)
                // access, so an error inside still names `workers[i].key`.
                RawWorker::deserialize(serde::de::value::MapAccessDeserializer::new(map))
                    .map(WorkerEntry)
            }
        }
        d.deserialize_any(V)
    }
}

/// The mapping form of a `workers:` entry (see [`WorkerEntry`]).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping with `url:`")]
struct RawWorker {
    url: String,
    name: Option<String>,
    role: Option<Role>,
    max_load: Option<u64>,
    load_penalty: Option<u32>,
    cache_aware: Option<bool>,
    api_key: Option<String>,
    kv_events: Option<RawKvEvents>,
    lmcache: Option<RawLmcache>,
    models: Option<Vec<String>>,
    max_lora: Option<u64>,
    phase: Option<Phase>,
    bootstrap_port: Option<u16>,
}

impl RawWorker {
    /// `- URL`: the entry with only its URL.
    fn of_url(url: String) -> RawWorker {
        RawWorker {
            url,
            name: None,
            role: None,
            max_load: None,
            load_penalty: None,
            cache_aware: None,
            api_key: None,
            kv_events: None,
            lmcache: None,
            models: None,
            max_lora: None,
            phase: None,
            bootstrap_port: None,
        }
    }

    /// Checks one worker entry; an error names the field (below the entry) and says
    /// what is wrong.
    fn validate(self) -> Result<WorkerConfig, (&'static str, String)> {
        let url = WorkerUrl::parse(&self.url)
            .map_err(|m| ("url", format!("`{}`: {m}", redact::url(&self.url))))?;
        let max_load = match self.max_load {
            None => None,
            Some(0) => {
                return Err((
                    "max_load",
                    "0 is out of range (≥ 1; leave it out for unbounded)".into(),
                ));
            }
            Some(n) => NonZeroUsize::new(n as usize),
        };
        let max_lora = match self.max_lora {
            None => None,
            Some(n) if (1..=MAX_LORA).contains(&n) => NonZeroUsize::new(n as usize),
            Some(n) => {
                return Err((
                    "max_lora",
                    format!("{n} is out of range (1 to {MAX_LORA} adapters held at once)"),
                ));
            }
        };
        let kv_events = self.kv_events.map(RawKvEvents::validate).transpose()?;
        let lmcache = self.lmcache.map(RawLmcache::validate).transpose()?;
        let name = match self.name {
            None => None,
            Some(n)
                if !n.is_empty() && n.len() <= 128 && n.chars().all(|c| c.is_ascii_graphic()) =>
            {
                Some(n)
            }
            Some(n) => {
                return Err((
                    "name",
                    format!(
                        "`{}` is not a worker name (1 to 128 visible ASCII characters, no spaces)",
                        n.escape_debug()
                    ),
                ));
            }
        };
        Ok(WorkerConfig {
            url,
            name,
            role: self.role.unwrap_or_default(),
            max_load,
            load_penalty: self.load_penalty.unwrap_or(0),
            cache_aware: self.cache_aware.unwrap_or(true),
            api_key: self
                .api_key
                .map(Secret::parse)
                .transpose()
                .map_err(|m| ("api_key", m))?,
            kv_events,
            lmcache,
            models: self.models.map(pinned_models).transpose()?,
            max_lora,
            phase: self.phase.unwrap_or_default(),
            bootstrap_port: self.bootstrap_port,
        })
    }
}

/// `workers[i].models`: one name or more, each a model name ([`MAX_MODEL_NAME_BYTES`]),
/// repeats dropped.
fn pinned_models(names: Vec<String>) -> Result<Vec<String>, (&'static str, String)> {
    if names.is_empty() {
        return Err((
            "models",
            "is empty: list the served names, or leave it out to read the worker's GET /v1/models"
                .into(),
        ));
    }
    let mut out: Vec<String> = Vec::with_capacity(names.len());
    for n in names {
        if n.is_empty() || n.len() > MAX_MODEL_NAME_BYTES || n.chars().any(char::is_control) {
            return Err((
                "models",
                format!(
                    "`{}` is not a model name (1 to {MAX_MODEL_NAME_BYTES} bytes, no control characters)",
                    n.escape_debug()
                ),
            ));
        }
        if !out.contains(&n) {
            out.push(n);
        }
    }
    Ok(out)
}

/// Reads `workers:`: URLs normalised, an entry repeated with the same URL and name
/// merged into its first (first occurrence wins). An explicit `workers: []` is accepted
/// where `require_workers` is false (SIGHUP: a controller may scale the pool to zero);
/// a missing key never is (a half-written file must not take the pool away), unless
/// the workers are discovered at run time (`discovers`).
pub(super) fn validate(
    entries: Option<Vec<WorkerEntry>>,
    require_workers: bool,
    discovers: bool,
    ck: &Checker<'_>,
) -> Result<Vec<WorkerConfig>, ConfigError> {
    let missing = entries.is_none();
    let entries = entries.unwrap_or_default();
    if entries.is_empty() && (require_workers || missing) && !discovers {
        return Err(ck.err(
            "workers",
            "the worker list is empty: list at least one worker URL (e.g. `- url: http://127.0.0.1:8000`)",
        ));
    }
    let mut workers: Vec<WorkerConfig> = Vec::with_capacity(entries.len());
    // URL -> (entry, name) of its first entry; every key (name, else URL) once.
    let mut seen: HashMap<WorkerUrl, (usize, Option<String>)> =
        HashMap::with_capacity(entries.len());
    let mut keys: HashMap<String, usize> = HashMap::with_capacity(entries.len());
    for (i, WorkerEntry(w)) in entries.into_iter().enumerate() {
        let worker = w
            .validate()
            .map_err(|(field, m)| ck.err(&format!("workers[{i}].{field}"), m))?;
        if let Some((j, name)) = seen.get(&worker.url) {
            if *name != worker.name {
                return Err(ck.bad(
                    &format!("workers[{i}].url"),
                    &worker.url,
                    format!(
                        "is also workers[{j}]'s URL, under another name (one URL is one worker)"
                    ),
                ));
            }
            tracing::warn!(url = %worker.url, "duplicate worker URL merged into its first entry");
            continue;
        }
        seen.insert(worker.url.clone(), (i, worker.name.clone()));
        if let Some(j) = keys.insert(worker.key().to_string(), i) {
            let field = if worker.name.is_some() { "name" } else { "url" };
            return Err(ck.bad(
                &format!("workers[{i}].{field}"),
                worker.key(),
                format!("is workers[{j}]'s key (its name, or its URL when it has none): a worker's identity is one per worker"),
            ));
        }
        workers.push(worker);
    }
    Ok(workers)
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroUsize;

    use super::*;
    use crate::config::testing::{err, load};

    #[test]
    fn a_worker_entry_may_be_a_plain_url_string_mixed_with_mappings() {
        let plain = load(&[(
            "a.yaml",
            "workers:\n  - http://10.0.0.1:8000\n  - \"http://10.0.0.2:8000/\"\n  - {url: http://10.0.0.3:8000, max_load: 4}\n",
        )])
        .unwrap();
        let mapped = load(&[(
            "a.yaml",
            "workers:\n  - url: http://10.0.0.1:8000\n  - url: http://10.0.0.2:8000\n  - {url: http://10.0.0.3:8000, max_load: 4}\n",
        )])
        .unwrap();
        assert_eq!(plain.workers, mapped.workers);
        assert_eq!(plain.workers[1].url.as_str(), "http://10.0.0.2:8000");
        assert_eq!(plain.workers[2].max_load, NonZeroUsize::new(4));
        let flow = load(&[("a.yaml", "workers: [\"http://10.0.0.1:8000\"]\n")]).unwrap();
        assert_eq!(flow.workers, mapped.workers[..1]);
        // A bad plain URL is refused like a bad `url:`, and nothing else is an entry.
        let e = err(&[("a.yaml", "workers:\n  - http://a:1\n  - ftp://b:1\n")]);
        assert!(
            e.contains("a.yaml:3: `workers[1].url`") && e.contains("ftp"),
            "{e}"
        );
        for (doc, want) in [
            (
                "workers: [8000]\n",
                "`workers[0]`: `8000` is not a URL string or a mapping with `url:`",
            ),
            (
                "workers: [[http://a:1]]\n",
                "`workers[0]`: a list is not a URL string or a mapping with `url:`",
            ),
            (
                "workers: [~]\n",
                "`workers[0]`: `~` is not a URL string or a mapping with `url:`",
            ),
            ("workers: [{name: a}]\n", "`workers[0]`: missing key `url`"),
        ] {
            let e = err(&[("a.yaml", doc)]);
            assert!(e.contains(want), "{doc:?}: {e}");
        }
        // The admin API's `POST /workers` body takes the same two forms.
        let w = WorkerConfig::from_json(br#""http://10.0.0.1:8000/""#).unwrap();
        assert_eq!(w, mapped.workers[0]);
        let w = WorkerConfig::from_json(br#"{"url":"http://10.0.0.1:8000"}"#).unwrap();
        assert_eq!(w, mapped.workers[0]);
        let e = WorkerConfig::from_json(b"8000").unwrap_err();
        assert!(e.contains("a URL string or a mapping with `url:`"), "{e}");
        let e = WorkerConfig::from_json(br#"{"url":"http://a:1","role":"backup"}"#).unwrap_err();
        assert!(
            e.contains("`role`") && e.contains("`primary` or `fallback`"),
            "{e}"
        );
    }

    #[test]
    fn worker_errors_are_refused() {
        let e = err(&[("w.yaml", "workers:\n  - url: http://a:1\n    max_load: 0\n")]);
        assert!(
            e.contains("w.yaml") && e.contains("workers[0].max_load") && e.contains('0'),
            "{e}"
        );
        for bad in [
            "http://::1:18006",
            "ftp://a:1",
            "a:1",
            "http://:80",
            "http://h:99999",
            "http://h:0",
            "http://a b:1",
            "http://h/p?q=1",
            "https://h:0",
        ] {
            let e = err(&[(
                "w.yaml",
                &format!("workers:\n  - url: http://ok:1\n  - url: \"{bad}\"\n"),
            )]);
            assert!(
                e.contains("w.yaml") && e.contains("workers[1].url") && e.contains(bad),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn empty_worker_list_is_refused_with_a_message() {
        for doc in ["workers: []\n", "server:\n  port: 1\n"] {
            let e = err(&[("w.yaml", doc)]);
            assert!(e.contains("worker list is empty"), "{e}");
        }
        let e = err(&[("e.yaml", "")]);
        assert!(e.contains("workers"), "{e}");
    }

    #[test]
    fn url_passwords_never_appear_in_errors() {
        for doc in [
            "workers:\n  - url: http://u:hunter2@h:1\n",
            "workers:\n  - url: \"http://u:hunter2@h:1/p\"\n",
            "workers:\n  - {url: http://u:hunter2@h:1, max_load: 0}\n",
            "workers:\n  - url: http://h:1\n    kv_events: {endpoint: \"tcp://u:hunter2@h:99999\"}\n",
        ] {
            let e = err(&[("u.yaml", doc)]);
            assert!(
                e.contains("workers[0]") && !e.contains("hunter2"),
                "{doc:?}: {e}"
            );
        }
        let e = WorkerConfig::from_json(br#"{"url":"http://u:hunter2@h:1"}"#).unwrap_err();
        assert!(
            e.contains("url") && e.contains("***@h:1") && !e.contains("hunter2"),
            "{e}"
        );
    }

    #[test]
    fn worker_identities_are_one_per_worker() {
        for (doc, key) in [
            (
                "workers:\n  - {url: http://a:1}\n  - {url: http://b:1, name: \"http://a:1\"}\n",
                "workers[1].name",
            ),
            (
                "workers:\n  - {url: http://a:1, name: x}\n  - {url: http://b:1, name: x}\n",
                "workers[1].name",
            ),
            (
                "workers:\n  - {url: http://a:1, name: c}\n  - {url: http://a:1, name: d}\n",
                "workers[1].url",
            ),
            (
                "workers:\n  - {url: http://a:1, name: c}\n  - {url: http://a:1}\n",
                "workers[1].url",
            ),
        ] {
            let e = err(&[("k.yaml", doc)]);
            assert!(e.contains(key) && e.contains("workers[0]"), "{doc:?}: {e}");
        }
        let c = load(&[(
            "k.yaml",
            "workers:\n  - {url: http://a:1, name: c}\n  - {url: \"http://a:1/\", name: c}\n",
        )])
        .unwrap();
        assert_eq!(c.workers.len(), 1, "the same entry twice is merged");
    }

    #[test]
    fn eighty_thousand_workers_load_in_linear_time() {
        // A list of `n` distinct workers plus a duplicate (merged); its load time.
        let timed = |n: u32| {
            let mut doc = String::from("workers:\n");
            for i in 0..n {
                doc.push_str(&format!(
                    "  - url: http://10.{}.{}.{}:{}\n",
                    i / 65_000,
                    (i / 250) % 250,
                    i % 250,
                    8000 + i % 1000
                ));
            }
            doc.push_str("  - url: http://10.0.0.0:8000/\n");
            let started = std::time::Instant::now();
            let c = load(&[("big.yaml", &doc)]).unwrap();
            let took = started.elapsed();
            assert_eq!(c.workers.len(), n as usize);
            took
        };
        // 8x the workers: about 8x the time when linear, 64x when quadratic (which took
        // 28.9 s in release at 80,000). A ratio, not a wall-clock bound, so a slow or
        // busy machine cannot trip it.
        let (small, large) = (timed(10_000), timed(80_000));
        let ratio = large.as_secs_f64() / small.as_secs_f64().max(1e-6);
        assert!(
            ratio < 24.0,
            "10,000 in {small:?}, 80,000 in {large:?}: x{ratio:.1}"
        );
    }
}

//! Command line and configuration: YAML files -> one validated [`Config`].
//!
//! Parsing happens once, at the edge. Several `-c` files are layered in order: mappings
//! merge key by key, lists and scalars replace, and an empty or comment-only file changes
//! nothing. Each file is first checked on its own (unknown keys and wrong types are
//! reported with that file's name and the key's path), then the merged document is
//! deserialised and range-checked; a range error names the last file that set the key.
//! SIGHUP reload goes through the same [`Config::load`].

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use serde_yaml_ng::{Mapping, Value};

use crate::redact;
use crate::tokenize::chat_template::ContentFormat;
use crate::tokenize::{LoadError, PromptTokenizer};

mod discovery;
#[cfg(test)]
mod doc_reference;
mod passthrough;
mod response_cache;
mod secret;
pub mod source;
mod state;
mod tls;
mod trace;

pub use discovery::{DiscoveryConfig, DnsDiscovery, KubernetesDiscovery};
pub use passthrough::{Passthrough, Verdict as PassthroughVerdict};
pub use response_cache::{ALL_ENDPOINTS, RedisUrl, ResponseCacheConfig, SemanticConfig};
pub use secret::Secret;
pub use state::StateConfig;
pub use tls::TlsSetting;
pub use trace::TracingConfig;

/// Routing policy (top-level `policy` key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyKind {
    /// Longest prefix match in the radix tree, guarded by load balance (the default).
    CacheAware,
    /// Baseline: usable workers in turn.
    RoundRobin,
    /// Baseline: a uniformly random usable worker.
    Random,
    /// Baseline: the usable worker with the fewest in-flight requests (+ penalty).
    LeastLoad,
    /// Two random usable workers, the less loaded.
    PowerOfTwo,
    /// The session (or prompt digest) on a hash ring, with bounded loads.
    ConsistentHash,
    /// Prefix match on the blocks the engines report holding (vLLM KV-cache events,
    /// `precise:` and per-worker `kv_events:`), falling back to the approximate tree
    /// when a request carries no token ids or no worker's event feed is usable.
    PreciseCacheAware,
    /// The least expected time to first token: queued prefill work plus this request's
    /// uncached prefill, over each worker's learned prefill rate (`policy::cost_aware`).
    CostAware,
    /// LMCache occupancy signals (`workers[].lmcache`), least-load when they are missing.
    LmcacheAware,
}

impl PolicyKind {
    /// The name used in config, logs and `/workers`.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::CacheAware => "cache_aware",
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::Random => "random",
            PolicyKind::LeastLoad => "least_load",
            PolicyKind::PreciseCacheAware => "precise_cache_aware",
            PolicyKind::PowerOfTwo => "power_of_two",
            PolicyKind::ConsistentHash => "consistent_hash",
            PolicyKind::CostAware => "cost_aware",
            PolicyKind::LmcacheAware => "lmcache_aware",
        }
    }
}

/// The merged files' keys other than `workers`, as written (for naming what a rejected
/// reload changed). Not part of the configuration's meaning: always equal.
#[derive(Clone, Default)]
pub struct Settings(Arc<Value>);

impl PartialEq for Settings {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Settings(..)")
    }
}

/// Adds to `out` one line per leaf where `a` and `b` differ below `path`.
fn diff_values(path: &str, a: Option<&Value>, b: Option<&Value>, out: &mut Vec<String>) {
    let join = |k: &Value| {
        let k = match k {
            Value::String(s) => s.clone(),
            other => show_value(other),
        };
        if path.is_empty() {
            k
        } else {
            format!("{path}.{k}")
        }
    };
    let empty = Value::Mapping(Mapping::new());
    // A section one side leaves out: its keys are each unset there.
    let (a, b) = match (a, b) {
        (None | Some(Value::Null), Some(m @ Value::Mapping(_))) => (Some(&empty), Some(m)),
        (Some(m @ Value::Mapping(_)), None | Some(Value::Null)) => (Some(m), Some(&empty)),
        other => other,
    };
    match (a, b) {
        (Some(Value::Mapping(x)), Some(Value::Mapping(y))) => {
            for (k, v) in x {
                diff_values(&join(k), Some(v), y.get(k), out);
            }
            for (k, v) in y {
                if !x.contains_key(k) {
                    diff_values(&join(k), None, Some(v), out);
                }
            }
        }
        (a, b) if a == b => {}
        (a, b) => {
            let show = |v: Option<&Value>| match v {
                None | Some(Value::Null) => "(unset)".to_string(),
                Some(_) if crate::redact::is_secret_key(path) => crate::redact::MASK.to_string(),
                Some(v) => show_value(v),
            };
            out.push(format!("{path}: {} → {}", show(a), show(b)));
        }
    }
}

/// One value on one line, as YAML flow, user-info masked, at most 60 characters.
fn show_value(v: &Value) -> String {
    let text = match v {
        Value::String(s) => s.clone(),
        other => serde_yaml_ng::to_string(other)
            .unwrap_or_default()
            .trim_end()
            .replace('\n', " "),
    };
    let text = crate::redact::line(&crate::redact::url(&text));
    match text.char_indices().nth(60) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text,
    }
}

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
    pub session: SessionConfig,
    pub engine_metrics: EngineMetricsConfig,
    pub response_cache: ResponseCacheConfig,
    pub state: StateConfig,
    pub discovery: DiscoveryConfig,
    pub tracing: TracingConfig,
}

/// `engine_metrics:` — scraping each engine's Prometheus endpoint for its own load
/// (see `signals::engine_metrics`).
#[derive(Debug, Clone, PartialEq)]
pub struct EngineMetricsConfig {
    /// Default: on for `cost_aware`, off otherwise.
    pub enabled: bool,
    /// Path scraped below each worker's URL (default `/metrics`).
    pub path: String,
    /// Scrape period (default 1000 ms); one scrape's time-out is the same, so scrapes of
    /// one worker never overlap.
    pub interval: Duration,
    /// A scrape older than this is stale: its values are neutral (default 5 s).
    pub stale: Duration,
}

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

/// `consistent_hash:` — the ring policy's key and load bound.
#[derive(Debug, Clone, PartialEq)]
pub struct ConsistentHashConfig {
    /// What is hashed (default `auto`: the session when the request has one, else the
    /// prompt digest).
    pub key: HashKey,
    /// A worker takes a key while its load is under `load_factor` × the mean load
    /// (+1); past it the key goes to the next worker on the ring (default 1.25, > 1).
    pub load_factor: f64,
}

/// `consistent_hash.key`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HashKey {
    Auto,
    Session,
    Digest,
}

/// `server:` — the client-facing listener.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerConfig {
    /// Listen address (default `0.0.0.0`).
    pub host: String,
    /// Listen port (default 6700).
    pub port: u16,
    /// Largest request body accepted, in bytes (default 32 MiB); larger ones get 413.
    pub max_body_bytes: usize,
    /// Bearer token for the mutating admin endpoints; `None` disables them.
    pub admin_token: Option<Secret>,
    /// How long SIGTERM waits for in-flight requests before exiting (default 30 s).
    pub shutdown_grace: Duration,
    /// Longest time a request body may take to arrive, counted from its request head,
    /// idle gaps included (default 30 s); past it the client gets 408 and the
    /// connection is closed.
    pub body_timeout: Duration,
    /// `server.admin`: a listener of its own for `/workers`, `/metrics` and the admin
    /// API (`/health` answers on both); `None` = they share the main port.
    pub admin: Option<AdminListen>,
}

/// `server.admin: {host, port}` (host default: `server.host`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdminListen {
    pub host: String,
    /// 0 = any free port (tests).
    pub port: u16,
}

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
}

/// `workers[i].kv_events:` — one vLLM KV-event publisher (spec
/// `shared/docs/vllm-kv-events.md`, sections 1–3 and 7).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KvEventsConfig {
    /// The engine's PUB socket as the router dials it, `tcp://host:port` (the engine
    /// binds `tcp://*:5557`; give the address the router reaches it at).
    pub endpoint: String,
    /// Topic prefix subscribed to (the engine's `topic`; default `""` = every message).
    pub topic: String,
    /// The engine's replay ROUTER socket, `tcp://host:port`; `None` = no replay, so a
    /// sequence gap drops this worker's entries.
    pub replay_endpoint: Option<String>,
    /// Data-parallel ranks behind the worker's one HTTP endpoint (vLLM
    /// `--data-parallel-size` with its internal load balancing; default 1). Each rank
    /// publishes on its own port, `endpoint`'s plus the rank, and serves replay on
    /// `replay_endpoint`'s plus the rank (spec §1); the router follows each rank as a
    /// separate feed ([`KvEventsConfig::rank_endpoint`]).
    pub dp_size: u32,
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

/// Largest `kv_events.dp_size`.
pub const MAX_DP_SIZE: u32 = 64;

impl KvEventsConfig {
    /// Rank `rank`'s event endpoint: `endpoint` with its port plus `rank` (as vLLM
    /// offsets its per-rank publishers; rank 0 keeps the base).
    pub fn rank_endpoint(&self, rank: u32) -> String {
        offset_port(&self.endpoint, rank).unwrap_or_else(|| self.endpoint.clone())
    }

    /// Rank `rank`'s replay endpoint, offset like [`KvEventsConfig::rank_endpoint`].
    pub fn rank_replay_endpoint(&self, rank: u32) -> Option<String> {
        self.replay_endpoint
            .as_ref()
            .map(|r| offset_port(r, rank).unwrap_or_else(|| r.clone()))
    }
}

/// Host and port of a validated `tcp://host:port` endpoint.
fn host_port(endpoint: &str) -> Option<(&str, u16)> {
    let (host, port) = endpoint.strip_prefix("tcp://")?.rsplit_once(':')?;
    Some((host, port.parse().ok()?))
}

/// `endpoint` with its port plus `n`; `None` when it is not `tcp://host:port` or the
/// port would pass 65535 (validation rules both out).
fn offset_port(endpoint: &str, n: u32) -> Option<String> {
    if n == 0 {
        return Some(endpoint.to_string());
    }
    let (host, port) = host_port(endpoint)?;
    let port = u16::try_from(u32::from(port) + n).ok()?;
    Some(format!("tcp://{host}:{port}"))
}

/// Every (host, port) the router dials for `k`, all ranks: `(rank, is_replay, host, port)`.
fn kv_ports(k: &KvEventsConfig) -> Vec<(u32, bool, &str, u16)> {
    let mut out = Vec::new();
    for (replay, ep) in [
        (false, Some(&k.endpoint)),
        (true, k.replay_endpoint.as_ref()),
    ] {
        let Some((host, base)) = ep.and_then(|e| host_port(e)) else {
            continue;
        };
        for r in 0..k.dp_size {
            if let Ok(port) = u16::try_from(u32::from(base) + r) {
                out.push((r, replay, host, port));
            }
        }
    }
    out
}

/// Names one dialled port of [`kv_ports`] in an error message.
fn kv_port_name(dp_size: u32, rank: u32, replay: bool) -> String {
    let what = if replay { "replay" } else { "event" };
    if dp_size > 1 {
        format!("rank {rank} {what} endpoint")
    } else {
        format!("{what} endpoint")
    }
}

/// `precise:` — the block index of precise mode.
#[derive(Debug, Clone, PartialEq)]
pub struct PreciseConfig {
    /// Tokens per KV block; must equal the engines' `--block-size` (default 16, vLLM's
    /// CUDA default). Events with another block size are skipped and counted.
    pub block_size: usize,
    /// Most distinct blocks (prefix keys) the index keeps; least recently used ones go
    /// first (default 1,000,000).
    pub max_blocks: NonZeroUsize,
    /// A worker whose feed sent nothing for this long while requests were routed to it
    /// scores neutral (default 30 s).
    pub stale: Duration,
    /// How long a routed request's blocks count as held by the chosen worker before the
    /// engine's own events confirm them (default 2 s).
    pub speculative_ttl: Duration,
    /// In-router tokenization (`precise.tokenizer`), loaded; `None` = requests without
    /// token ids are scored by the approximate tree.
    pub tokenizer: Option<TokenizerSetting>,
    /// Token-parity floor (`precise.parity_floor`, default 0.5; 0 = never fall back): a
    /// worker whose engine confirmed under this share of the router's block keys over
    /// its last checked answers is scored by the tree until the share is back (see
    /// [`crate::precise::parity`]).
    pub parity_floor: f64,
}

/// `precise.tokenizer` (+ `chat_template`, `chat_template_content_format`), loaded at
/// config time so a bad file is a config error. Two settings are equal when they name
/// the same files and format (SIGHUP reload compares configs).
#[derive(Clone)]
pub struct TokenizerSetting {
    /// A Hugging Face model folder holding `tokenizer.json`, or that file.
    pub path: PathBuf,
    /// A Jinja chat template overriding the folder's (vLLM's `--chat-template`).
    pub chat_template: Option<PathBuf>,
    pub content_format: ContentFormat,
    /// Most bytes of each prompt's text tokenized (a longer prompt's prefix is).
    pub max_bytes: usize,
    pub loaded: Arc<PromptTokenizer>,
}

impl PartialEq for TokenizerSetting {
    fn eq(&self, other: &Self) -> bool {
        (
            &self.path,
            &self.chat_template,
            self.content_format,
            self.max_bytes,
        ) == (
            &other.path,
            &other.chat_template,
            other.content_format,
            other.max_bytes,
        )
    }
}

impl std::fmt::Debug for TokenizerSetting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenizerSetting")
            .field("path", &self.path)
            .field("chat_template", &self.chat_template)
            .field("content_format", &self.content_format)
            .field("max_bytes", &self.max_bytes)
            .finish_non_exhaustive()
    }
}

/// A worker's base URL, normalised: `scheme://authority` plus a path prefix with no
/// trailing slash (`""` when none). IPv6 hosts keep their brackets.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct WorkerUrl {
    scheme: String,
    authority: String,
    path_prefix: String,
    /// `scheme://authority/prefix`, as displayed.
    full: String,
    /// The scheme and authority parsed once, and the `Host` value: every request's URI
    /// and headers take shared copies instead of parsing them again.
    uri_scheme: http::uri::Scheme,
    uri_authority: http::uri::Authority,
    host: http::HeaderValue,
}

impl WorkerUrl {
    /// Parses and normalises a worker URL. Accepts `http://` or `https://` (verified as
    /// `proxy.tls` says) `host[:port][/prefix][/]`; refuses other schemes, a missing host, an unbracketed IPv6 literal, a bad port,
    /// a query or a fragment.
    pub fn parse(raw: &str) -> Result<Self, String> {
        let raw = raw.trim();
        let (scheme, rest) = raw
            .split_once("://")
            .ok_or_else(|| "expected http(s)://host[:port][/path]".to_string())?;
        let scheme = scheme.to_ascii_lowercase();
        if scheme != "http" && scheme != "https" {
            return Err(format!(
                "scheme `{scheme}` is not supported (http:// or https://)"
            ));
        }
        if rest.contains(['?', '#']) {
            return Err("a worker URL may not carry a query or fragment".into());
        }
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        if authority.is_empty() {
            return Err("missing host".into());
        }
        if raw.contains('@') {
            return Err(
                "user info (`user:password@`) in worker URLs is not supported; use api_key".into(),
            );
        }
        let (host, port) = if let Some(inner) = authority.strip_prefix('[') {
            let end = inner
                .find(']')
                .ok_or_else(|| "unclosed `[` in IPv6 host".to_string())?;
            let host = &inner[..end];
            if host.parse::<std::net::Ipv6Addr>().is_err() {
                return Err(format!("`{host}` is not an IPv6 address"));
            }
            let after = &inner[end + 1..];
            let port = match after {
                "" => None,
                p => Some(
                    p.strip_prefix(':')
                        .ok_or_else(|| format!("unexpected `{p}` after IPv6 host"))?,
                ),
            };
            (&authority[..end + 2], port)
        } else {
            if authority.matches(':').count() > 1 {
                return Err(
                    "an IPv6 host must be written in brackets, e.g. http://[::1]:8000".into(),
                );
            }
            match authority.split_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (authority, None),
            }
        };
        if host.is_empty() {
            return Err("missing host".into());
        }
        if !host.starts_with('[')
            && !host
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
        {
            return Err(format!("invalid host `{host}`"));
        }
        let authority = match port {
            Some(p) => {
                let n: u16 = p
                    .parse()
                    .ok()
                    .filter(|n| *n != 0)
                    .ok_or_else(|| format!("invalid port `{p}`"))?;
                format!("{}:{n}", host.to_ascii_lowercase())
            }
            None => host.to_ascii_lowercase(),
        };
        let path_prefix = path.trim_end_matches('/');
        if path_prefix.contains("//") || path_prefix.chars().any(|c| c.is_whitespace()) {
            return Err(format!("invalid path `{path}`"));
        }
        let url = WorkerUrl {
            full: format!("{scheme}://{authority}{path_prefix}"),
            uri_scheme: scheme
                .parse()
                .map_err(|e| format!("not a valid URI scheme: {e}"))?,
            uri_authority: authority
                .parse()
                .map_err(|e| format!("not a valid URI authority: {e}"))?,
            host: http::HeaderValue::from_str(&authority)
                .map_err(|e| format!("not a valid Host header: {e}"))?,
            scheme,
            authority,
            path_prefix: path_prefix.to_string(),
        };
        // Final check with the same parser the proxy uses to build request URIs.
        url.uri_for("/")
            .map_err(|e| format!("not a valid URI: {e}"))?;
        Ok(url)
    }

    /// The normalised URL, `scheme://authority[/prefix]`.
    pub fn as_str(&self) -> &str {
        &self.full
    }

    /// `host[:port]`, as sent in the `Host` header (IPv6 in brackets).
    pub fn authority(&self) -> &str {
        &self.authority
    }

    /// [`WorkerUrl::authority`] as a `Host` header value (a shared copy).
    pub fn host_header(&self) -> http::HeaderValue {
        self.host.clone()
    }

    /// The path prefix, `""` or `/something` without a trailing slash.
    pub fn path_prefix(&self) -> &str {
        &self.path_prefix
    }

    /// The upstream URI for a client `path_and_query` (which starts with `/`): the
    /// worker's prefix is put in front, the query is kept, no `//` appears.
    pub fn uri_for(&self, path_and_query: &str) -> Result<http::Uri, http::Error> {
        let mut parts = http::uri::Parts::default();
        parts.scheme = Some(self.uri_scheme.clone());
        parts.authority = Some(self.uri_authority.clone());
        parts.path_and_query = Some(self.path_for(path_and_query)?);
        Ok(http::Uri::from_parts(parts)?)
    }

    /// [`WorkerUrl::uri_for`] in origin form (path and query only), as an HTTP/1.1
    /// request line to the worker itself carries it (RFC 9112 §3.2.1).
    pub fn origin_form(&self, path_and_query: &str) -> Result<http::Uri, http::Error> {
        Ok(http::Uri::from(self.path_for(path_and_query)?))
    }

    /// The worker's URI (its prefix as the path): a connection to it is opened to the
    /// scheme, host and port.
    pub fn origin(&self) -> Result<http::Uri, http::Error> {
        self.uri_for("/")
    }

    /// The worker's prefix in front of `path_and_query`.
    fn path_for(&self, path_and_query: &str) -> Result<http::uri::PathAndQuery, http::Error> {
        Ok(if self.path_prefix.is_empty() {
            path_and_query.parse()?
        } else {
            let mut pq = String::with_capacity(self.path_prefix.len() + path_and_query.len());
            pq.push_str(&self.path_prefix);
            pq.push_str(path_and_query);
            pq.parse()?
        })
    }
}

impl std::fmt::Display for WorkerUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.full)
    }
}

/// `cache:` — the approximate prefix tree and the cache/load trade-off.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheConfig {
    /// A match is a cache hit when matched/prompt length (bytes of the routing text)
    /// reaches this ratio, in [0, 1] (default 0.3).
    pub threshold: f64,
    /// …or when at least this many bytes matched (default 8192; 0 disables).
    pub match_abs_threshold: usize,
    /// A hit is overridden for load only when the cached worker's load exceeds the
    /// least-loaded one's by more than this many requests (default 2)…
    pub balance_abs_threshold: usize,
    /// …and by more than this factor (default 1.5, ≥ 1).
    pub balance_rel_threshold: f64,
    /// Routing text kept per request, in bytes, cut on a UTF-8 boundary (default 32 KiB).
    pub max_prompt_bytes: usize,
    /// Node ceiling for the whole tree (default 1,000,000).
    pub max_tree_size: usize,
    /// Byte ceiling for the whole tree: routing text held in its edges, in bytes
    /// (`cache.max_tree_bytes`, default 1 GiB). Long prompts make few nodes of many
    /// bytes, so the node ceiling alone does not bound the tree's memory.
    pub max_tree_bytes: u64,
    /// Eviction pass period (default 60 s); `None` = eviction off (`0` in YAML).
    pub eviction_interval: Option<Duration>,
    /// UTC hour (0–23) at which the whole tree is dropped; `None` = off (`-1`, default).
    pub daily_cleanup_hour_utc: Option<u8>,
    /// Tokens per KV block of the engines (default 16, vLLM's): an engine reuses only
    /// whole blocks, so a matched prefix counts in whole blocks (`policy::BlockScale`).
    pub engine_block_tokens: usize,
    /// Below this drift (delivered ÷ predicted prefix tokens of a worker's last answers
    /// that predicted a hit, see `pool::hits`) for [`CacheConfig::drift_for`], the
    /// router warns that its memory of that worker is stale (default 0.5; 0 = never).
    pub drift_floor: f64,
    /// How long the drift must stay under the floor before the warning, and the least
    /// time between two warnings (`cache.drift_secs`, default 60 s).
    pub drift_for: Duration,
    /// Whether answers that deliver far fewer cached tokens than predicted age out the
    /// worker's older records (`cache.learn_evictions`, default false; see
    /// `policy::cache_aware::CacheAware::learn`).
    pub learn_evictions: bool,
}

/// `health:` — active health checks (see `health.rs`).
#[derive(Debug, Clone, PartialEq)]
pub struct HealthConfig {
    /// Path probed on each worker, below its path prefix (default `/health`).
    pub endpoint: String,
    /// Probe period (default 10 s).
    pub interval: Duration,
    /// Timeout of one probe (default 5 s).
    pub timeout: Duration,
    /// Consecutive failures that mark a worker unhealthy (default 3).
    pub failure_threshold: u32,
    /// Consecutive successes that bring it back (default 2).
    pub success_threshold: u32,
}

/// `circuit_breaker:` — passive failure tracking per worker.
#[derive(Debug, Clone, PartialEq)]
pub struct BreakerConfig {
    /// Consecutive request failures that open the breaker (default 5).
    pub failure_threshold: u32,
    /// How long an open breaker rejects traffic before probing (default 30 s).
    pub timeout: Duration,
    /// Successful probes that close it again (default 2).
    pub success_threshold: u32,
}

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
    /// How long a `/v1/models` answer is reused (default 600 s; 0 = never cached).
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
}

/// `proxy.queue: {max_waiting, timeout_ms}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueConfig {
    /// Requests that may wait at once (default 0 = off: a full pool answers 503 at once).
    pub max_waiting: usize,
    /// Longest a request waits for a slot (default 1000 ms), then 503.
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

/// `log:` — tracing output.
#[derive(Debug, Clone, PartialEq)]
pub struct LogConfig {
    pub format: LogFormat,
    /// An `EnvFilter` directive such as `info` or `cache_aware_router=debug`; `RUST_LOG`
    /// wins when set. Default `info`.
    pub level: String,
    /// ANSI colours in text logs (default `auto`: only when stderr is a terminal).
    pub color: LogColor,
}

/// `log.color`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogColor {
    /// Colours when stderr is a terminal, none in a file or a pipe.
    Auto,
    Always,
    Never,
}

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

/// A value that is one of a fixed set of names (`policy`, `log.format`, `workers[].role`,
/// …). Read as a plain string whatever the YAML form, so that every refusal — a wrong
/// name, a number, a list, a mapping, a `!tag` — lists the names the key takes, not
/// the YAML library's enum rules.
trait Named: Sized + 'static {
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

fn deserialize_named<'de, D: serde::Deserializer<'de>, T: Named>(d: D) -> Result<T, D::Error> {
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
        impl Named for $ty {
            const NAMES: &'static [&'static str] = &[$($name),+];
            fn from_name(name: &str) -> Option<Self> {
                match name {
                    $($name => Some($variant),)+
                    _ => None,
                }
            }
        }
        impl<'de> Deserialize<'de> for $ty {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                deserialize_named(d)
            }
        }
    };
}

named!(PolicyKind {
    "cache_aware" => PolicyKind::CacheAware,
    "round_robin" => PolicyKind::RoundRobin,
    "random" => PolicyKind::Random,
    "least_load" => PolicyKind::LeastLoad,
    "power_of_two" => PolicyKind::PowerOfTwo,
    "consistent_hash" => PolicyKind::ConsistentHash,
    "precise_cache_aware" => PolicyKind::PreciseCacheAware,
    "cost_aware" => PolicyKind::CostAware,
    "lmcache_aware" => PolicyKind::LmcacheAware,
});
named!(SessionMode { "soft" => SessionMode::Soft, "hard" => SessionMode::Hard });
named!(HashKey {
    "auto" => HashKey::Auto,
    "session" => HashKey::Session,
    "digest" => HashKey::Digest,
});
named!(Role { "primary" => Role::Primary, "fallback" => Role::Fallback });
named!(LogColor {
    "auto" => LogColor::Auto,
    "always" => LogColor::Always,
    "never" => LogColor::Never,
});
named!(LogFormat { "text" => LogFormat::Text, "json" => LogFormat::Json });
named!(ContentFormat {
    "auto" => ContentFormat::Auto,
    "string" => ContentFormat::String,
    "openai" => ContentFormat::OpenAi,
});

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
struct Secs(f64);

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

// ---------------------------------------------------------------------------------
// Raw (serde) schema. Every field optional so one file of a layered set can be
// checked alone; defaults are applied in `Config::from_raw`.

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
struct RawConfig {
    policy: Option<PolicyKind>,
    #[serde(default)]
    server: RawServer,
    workers: Option<Vec<WorkerEntry>>,
    #[serde(default)]
    cache: RawCache,
    #[serde(default)]
    health: RawHealth,
    #[serde(default)]
    circuit_breaker: RawBreaker,
    #[serde(default)]
    proxy: RawProxy,
    #[serde(default)]
    log: RawLog,
    #[serde(default)]
    precise: RawPrecise,
    #[serde(default)]
    consistent_hash: RawConsistentHash,
    #[serde(default)]
    session: RawSession,
    #[serde(default)]
    engine_metrics: RawEngineMetrics,
    #[serde(default)]
    response_cache: response_cache::RawResponseCache,
    #[serde(default)]
    state: state::RawState,
    discovery: Option<Value>,
    #[serde(default)]
    tracing: trace::RawTracing,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
struct RawEngineMetrics {
    enabled: Option<bool>,
    path: Option<String>,
    interval_ms: Option<u64>,
    stale_secs: Option<Secs>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
struct RawLmcache {
    endpoint: String,
    refresh_secs: Option<Secs>,
    stale_secs: Option<Secs>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
struct RawSession {
    enabled: Option<bool>,
    headers: Option<Vec<String>>,
    body_fields: Option<Vec<String>>,
    mode: Option<SessionMode>,
    ttl_secs: Option<Secs>,
    max_sessions: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
struct RawConsistentHash {
    key: Option<HashKey>,
    load_factor: Option<f64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
struct RawServer {
    host: Option<String>,
    port: Option<u16>,
    max_body_bytes: Option<u64>,
    admin_token: Option<String>,
    shutdown_grace_secs: Option<Secs>,
    body_timeout_secs: Option<Secs>,
    admin: Option<RawAdmin>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
struct RawAdmin {
    host: Option<String>,
    port: Option<u16>,
}

/// What a `workers:` entry may be, in the config's words (every error about one says it).
const WORKER_ENTRY: &str = "a URL string or a mapping with `url:`";

/// One `workers:` entry (and the admin API's `POST /workers` body): a plain URL string
/// (`- http://10.0.0.1:8000`, the form other routers take) or a mapping with `url:` and
/// the optional keys of [`RawWorker`]; `- URL` means the same as `- url: URL`, and one
/// list may mix both.
#[derive(Debug)]
struct WorkerEntry(RawWorker);

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
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
struct RawKvEvents {
    endpoint: String,
    topic: Option<String>,
    replay_endpoint: Option<String>,
    dp_size: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
struct RawPrecise {
    block_size: Option<u64>,
    max_blocks: Option<u64>,
    stale_secs: Option<Secs>,
    speculative_ttl_secs: Option<Secs>,
    tokenizer: Option<PathBuf>,
    chat_template: Option<PathBuf>,
    chat_template_content_format: Option<ContentFormat>,
    max_tokenize_bytes: Option<u64>,
    parity_floor: Option<f64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
struct RawCache {
    threshold: Option<f64>,
    match_abs_threshold: Option<u64>,
    balance_abs_threshold: Option<u64>,
    balance_rel_threshold: Option<f64>,
    max_prompt_bytes: Option<u64>,
    max_tree_size: Option<u64>,
    max_tree_bytes: Option<u64>,
    eviction_interval_secs: Option<Secs>,
    daily_cleanup_hour_utc: Option<i64>,
    engine_block_tokens: Option<u64>,
    drift_floor: Option<f64>,
    drift_secs: Option<Secs>,
    learn_evictions: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
struct RawHealth {
    endpoint: Option<String>,
    interval_secs: Option<Secs>,
    timeout_secs: Option<Secs>,
    failure_threshold: Option<u32>,
    success_threshold: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
struct RawBreaker {
    failure_threshold: Option<u32>,
    timeout_secs: Option<Secs>,
    success_threshold: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
struct RawProxy {
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
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
struct RawQueue {
    max_waiting: Option<u64>,
    timeout_ms: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
struct RawTls {
    ca_file: Option<PathBuf>,
    insecure_skip_verify: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
struct RawLog {
    format: Option<LogFormat>,
    level: Option<String>,
    color: Option<LogColor>,
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
        }
    }

    /// Checks one worker entry; an error names the field and says what is wrong.
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
        let kv_events = match self.kv_events {
            None => None,
            Some(k) => {
                let endpoint = zmq_endpoint(&k.endpoint).map_err(|m| {
                    (
                        "kv_events.endpoint",
                        format!("`{}`: {m}", redact::url(&k.endpoint)),
                    )
                })?;
                let replay_endpoint = match k.replay_endpoint {
                    None => None,
                    Some(r) => Some(zmq_endpoint(&r).map_err(|m| {
                        (
                            "kv_events.replay_endpoint",
                            format!("`{}`: {m}", redact::url(&r)),
                        )
                    })?),
                };
                if replay_endpoint.as_ref() == Some(&endpoint) {
                    return Err((
                        "kv_events.replay_endpoint",
                        format!(
                            "`{endpoint}` is also the event endpoint; the replay socket has its own port"
                        ),
                    ));
                }
                let dp_size = match k.dp_size {
                    None => 1,
                    Some(n) if (1..=i64::from(MAX_DP_SIZE)).contains(&n) => n as u32,
                    Some(n) => {
                        return Err((
                            "kv_events.dp_size",
                            format!(
                                "{n} is out of range (1 to {MAX_DP_SIZE}: the engine's --data-parallel-size behind this one URL; the router opens a SUB socket, a replay socket and a task per rank, so a larger value is taken for a mistake)"
                            ),
                        ));
                    }
                };
                let k = KvEventsConfig {
                    endpoint,
                    topic: k.topic.unwrap_or_default(),
                    replay_endpoint,
                    dp_size,
                };
                check_rank_ports(&k)?;
                Some(k)
            }
        };
        let lmcache = match self.lmcache {
            None => None,
            Some(l) => Some(l.validate()?),
        };
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
        })
    }
}

impl RawLmcache {
    fn validate(self) -> Result<LmcacheConfig, (&'static str, String)> {
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

/// Checks the ports of a worker's ranks (spec §1: rank r publishes on the event port
/// plus r, replays on the replay port plus r): none past 65535, and the event range
/// apart from the replay range when both are on one host.
fn check_rank_ports(k: &KvEventsConfig) -> Result<(), (&'static str, String)> {
    let n = k.dp_size;
    for (key, ep) in [
        ("kv_events.endpoint", Some(&k.endpoint)),
        ("kv_events.replay_endpoint", k.replay_endpoint.as_ref()),
    ] {
        let Some((_, port)) = ep.and_then(|e| host_port(e)) else {
            continue;
        };
        if u32::from(port) + n - 1 > 65535 {
            return Err((
                key,
                format!(
                    "`{}`: with dp_size {n} rank {} would use port {}, past 65535",
                    ep.map_or("", |e| e.as_str()),
                    n - 1,
                    u32::from(port) + n - 1
                ),
            ));
        }
    }
    let (Some((eh, ep)), Some((rh, rp))) = (
        host_port(&k.endpoint),
        k.replay_endpoint.as_deref().and_then(host_port),
    ) else {
        return Ok(());
    };
    let (e_end, r_end) = (u32::from(ep) + n - 1, u32::from(rp) + n - 1);
    if eh == rh && u32::from(ep) <= r_end && u32::from(rp) <= e_end {
        return Err((
            "kv_events.replay_endpoint",
            format!(
                "with dp_size {n} the event ports {ep}..={e_end} and the replay ports {rp}..={r_end} of {eh} overlap (each rank offsets both by its rank); pick bases at least {n} apart, e.g. event 5557 and replay 6557"
            ),
        ));
    }
    Ok(())
}

/// Checks a `log.level` filter: comma-separated directives, each a level (`trace`,
/// `debug`, `info`, `warn`, `error`, `off`) or `target=level`. A bare word is refused:
/// `EnvFilter` would read `warning` as a target name and log nothing else.
fn check_log_filter(filter: &str) -> Result<(), String> {
    const LEVELS: [&str; 6] = ["trace", "debug", "info", "warn", "error", "off"];
    let is_level = |l: &str| LEVELS.iter().any(|x| x.eq_ignore_ascii_case(l.trim()));
    for d in filter.split(',') {
        let ok = match d.rsplit_once('=') {
            Some((target, level)) => !target.trim().is_empty() && is_level(level),
            None => is_level(d),
        };
        if !ok {
            return Err(format!(
                "is not a log filter: `{}` is neither a level ({}) nor `target=level`",
                d.trim().escape_debug(),
                LEVELS.join(", ")
            ));
        }
    }
    if tracing_subscriber::EnvFilter::try_new(filter).is_err() {
        return Err("is not a log level or filter".into());
    }
    Ok(())
}

/// Checks a ZeroMQ endpoint the router dials: `tcp://host:port` with a concrete host
/// (an IP, a bracketed IPv6 address or a DNS name) and a port from 1 to 65535. Returns
/// it trimmed. vLLM's bind forms (`tcp://*:5557`, `tcp://0.0.0.0:5557`) are refused
/// with a hint: they name the engine's side, not an address to reach it at.
fn zmq_endpoint(raw: &str) -> Result<String, String> {
    let raw = raw.trim();
    let Some(rest) = raw.strip_prefix("tcp://") else {
        return Err("expected tcp://host:port (other ZeroMQ transports are not supported)".into());
    };
    if rest.contains('@') {
        return Err("a ZeroMQ tcp endpoint has no user info (`user:password@`)".into());
    }
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| "missing `:port`".to_string())?;
    let unspecified = host
        .trim_matches(['[', ']'])
        .parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_unspecified());
    if host == "*" || unspecified {
        return Err("that is the engine's bind address; give the address the router dials, e.g. tcp://10.0.0.7:5557".into());
    }
    if host.is_empty() {
        return Err("missing host".into());
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => {}
        _ => return Err(format!("invalid port `{port}`")),
    }
    // Final check with the parser the event consumer connects with.
    match raw.parse::<zeromq::Endpoint>() {
        Ok(zeromq::Endpoint::Tcp(..)) => Ok(raw.to_string()),
        Ok(_) => Err("not a tcp:// endpoint".into()),
        Err(e) => Err(format!("not a ZeroMQ endpoint: {e}")),
    }
}

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

/// One file: its name, its text (to quote values as written) and its parsed YAML (to
/// tell which file set a key).
struct Layer<'a> {
    file: &'a Path,
    text: &'a str,
    doc: Value,
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

/// Builds range errors: the file that last set the key, the line, and the value as
/// that file wrote it.
struct Checker<'a> {
    layers: &'a [Layer<'a>],
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

    /// A refusal of `key` that says `message` (redacted).
    fn err(&self, key: &str, message: impl Into<String>) -> ConfigError {
        let (file, spot) = self.find(key);
        ConfigError::Invalid {
            file,
            line: spot.map(|s| s.line),
            key: key.to_string(),
            message: redact::line(&message.into()),
        }
    }

    /// A refusal of the scalar at `key`: "`<value as written>` <why>". `parsed` is shown
    /// when the value is a default no file wrote; a secret key's value never is.
    fn bad(
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
    fn secs(
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

    fn at_least_one(&self, key: &str, v: Option<u32>, default: u32) -> Result<u32, ConfigError> {
        match v.unwrap_or(default) {
            0 => Err(self.bad(key, 0, "is out of range (must be ≥ 1)")),
            n => Ok(n),
        }
    }

    /// The section at `key`, read from the merged document (`v`) into `T`; an error
    /// names the full key path and says what was wrong in the config's words, like a
    /// refusal of the file itself.
    fn typed<T: serde::de::DeserializeOwned>(&self, key: &str, v: Value) -> Result<T, ConfigError> {
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
    fn secret(&self, key: &str, v: Option<String>) -> Result<Option<Secret>, ConfigError> {
        v.map(Secret::parse)
            .transpose()
            .map_err(|m| self.err(key, m))
    }
}

/// Deserialises one YAML text into `T` with the full key path of any error
/// (serde_path_to_error), its line, and the value as the file wrote it.
fn typed<T: serde::de::DeserializeOwned>(file: &Path, text: &str) -> Result<T, ConfigError> {
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
            let raw = typed::<RawConfig>(file, text)?;
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
                let mut merged = Value::Mapping(Mapping::new());
                for l in &layers {
                    merge(&mut merged, l.doc.clone());
                }
                let text = serde_yaml_ng::to_string(&merged).map_err(|e| {
                    ConfigError::Other(format!("cannot merge the config files: {e}"))
                })?;
                let last = layers.last().map_or(Path::new(""), |l| l.file);
                typed::<RawConfig>(last, &text)?
            }
        };
        let mut config = Self::from_raw(raw, &Checker { layers: &layers }, require_workers)?;
        let mut merged = Value::Mapping(Mapping::new());
        for l in &layers {
            merge(&mut merged, l.doc.clone());
        }
        if let Value::Mapping(m) = &mut merged {
            m.remove("workers");
        }
        config.settings = Settings(Arc::new(merged));
        Ok(config)
    }

    fn from_raw(
        raw: RawConfig,
        ck: &Checker<'_>,
        require_workers: bool,
    ) -> Result<Config, ConfigError> {
        let s = raw.server;
        let max_body_bytes = s.max_body_bytes.unwrap_or(32 * 1024 * 1024);
        if max_body_bytes == 0 || max_body_bytes > (1 << 32) {
            return Err(ck.bad(
                "server.max_body_bytes",
                max_body_bytes,
                "is out of range (bytes, 1 to 4 GiB)",
            ));
        }
        let host = s.host.unwrap_or_else(|| "0.0.0.0".into());
        if host.parse::<std::net::IpAddr>().is_err() && host != "localhost" {
            return Err(ck.bad("server.host", host, "is not an IP address to listen on"));
        }
        let port = s.port.unwrap_or(6700);
        let admin = match s.admin {
            None => None,
            Some(a) => {
                let Some(admin_port) = a.port else {
                    return Err(ck.err(
                        "server.admin.port",
                        "is missing: give the admin listener a port of its own (e.g. 6701)",
                    ));
                };
                let admin_host = a.host.unwrap_or_else(|| host.clone());
                if admin_host.trim().is_empty() {
                    return Err(ck.err("server.admin.host", "is empty"));
                }
                if admin_port != 0 && admin_port == port && admin_host == host {
                    return Err(ck.bad(
                        "server.admin.port",
                        admin_port,
                        "is the main port: the admin listener needs another one",
                    ));
                }
                Some(AdminListen {
                    host: admin_host,
                    port: admin_port,
                })
            }
        };
        let server = ServerConfig {
            admin,
            host,
            port,
            max_body_bytes: max_body_bytes as usize,
            admin_token: ck.secret("server.admin_token", s.admin_token)?,
            shutdown_grace: ck.secs(
                "server.shutdown_grace_secs",
                s.shutdown_grace_secs,
                30.0,
                Some("exit at once"),
            )?,
            body_timeout: ck.secs("server.body_timeout_secs", s.body_timeout_secs, 30.0, None)?,
        };

        // An explicit `workers: []` may scale to zero on reload; a missing key never
        // does (a half-written file must not take the pool away).
        let missing = raw.workers.is_none();
        let raw_workers = raw.workers.unwrap_or_default();
        // Discovered workers may be the only ones.
        let discovery = DiscoveryConfig::validate(raw.discovery, ck)?;
        let discovers = discovery != DiscoveryConfig::Static;
        if raw_workers.is_empty() && (require_workers || missing) && !discovers {
            return Err(ck.err(
                "workers",
                "the worker list is empty: list at least one worker URL (e.g. `- url: http://127.0.0.1:8000`)",
            ));
        }
        let mut workers: Vec<WorkerConfig> = Vec::with_capacity(raw_workers.len());
        // URL -> (entry, name) of its first entry; every key (name, else URL) once.
        let mut seen: HashMap<WorkerUrl, (usize, Option<String>)> =
            HashMap::with_capacity(raw_workers.len());
        let mut keys: HashMap<String, usize> = HashMap::with_capacity(raw_workers.len());
        for (i, WorkerEntry(w)) in raw_workers.into_iter().enumerate() {
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

        let c = raw.cache;
        let threshold = c.threshold.unwrap_or(0.3);
        if !(0.0..=1.0).contains(&threshold) {
            return Err(ck.bad("cache.threshold", threshold, "is out of range [0, 1]"));
        }
        let balance_rel_threshold = c.balance_rel_threshold.unwrap_or(1.5);
        if !balance_rel_threshold.is_finite() || balance_rel_threshold < 1.0 {
            return Err(ck.bad(
                "cache.balance_rel_threshold",
                balance_rel_threshold,
                "is out of range (≥ 1)",
            ));
        }
        let max_prompt_bytes = c.max_prompt_bytes.unwrap_or(32 * 1024);
        if !(1..=(16 << 20)).contains(&max_prompt_bytes) {
            return Err(ck.bad(
                "cache.max_prompt_bytes",
                max_prompt_bytes,
                "is out of range (bytes, 1 to 16 MiB)",
            ));
        }
        let max_tree_size = c.max_tree_size.unwrap_or(1_000_000);
        if max_tree_size == 0 {
            return Err(ck.bad("cache.max_tree_size", 0, "is out of range (nodes, ≥ 1)"));
        }
        let max_tree_bytes = c.max_tree_bytes.unwrap_or(1 << 30);
        if max_tree_bytes < max_prompt_bytes {
            return Err(ck.bad(
                "cache.max_tree_bytes",
                max_tree_bytes,
                format!(
                    "is out of range (bytes of routing text, at least one prompt: \
                     cache.max_prompt_bytes, {max_prompt_bytes})"
                ),
            ));
        }
        let eviction = ck.secs(
            "cache.eviction_interval_secs",
            c.eviction_interval_secs,
            60.0,
            Some("off"),
        )?;
        let daily_cleanup_hour_utc = match c.daily_cleanup_hour_utc.unwrap_or(-1) {
            -1 => None,
            h @ 0..=23 => Some(h as u8),
            h => {
                return Err(ck.bad(
                    "cache.daily_cleanup_hour_utc",
                    h,
                    "is out of range (0–23, or -1 for off)",
                ));
            }
        };
        let engine_block_tokens = c.engine_block_tokens.unwrap_or(16);
        if !(1..=4096).contains(&engine_block_tokens) {
            return Err(ck.bad(
                "cache.engine_block_tokens",
                engine_block_tokens,
                "is out of range (tokens, 1 to 4096; the engines' --block-size)",
            ));
        }
        let engine_block_tokens = engine_block_tokens as usize;
        let drift_floor = c.drift_floor.unwrap_or(0.5);
        if !(0.0..=1.0).contains(&drift_floor) {
            return Err(ck.bad(
                "cache.drift_floor",
                drift_floor,
                "is out of range (a ratio of delivered to predicted tokens, 0 to 1; 0 = never warn)",
            ));
        }
        let cache = CacheConfig {
            threshold,
            match_abs_threshold: c.match_abs_threshold.unwrap_or(8192) as usize,
            balance_abs_threshold: c.balance_abs_threshold.unwrap_or(2) as usize,
            balance_rel_threshold,
            max_prompt_bytes: max_prompt_bytes as usize,
            max_tree_size: max_tree_size as usize,
            max_tree_bytes,
            eviction_interval: (!eviction.is_zero()).then_some(eviction),
            daily_cleanup_hour_utc,
            engine_block_tokens,
            drift_floor,
            drift_for: ck.secs("cache.drift_secs", c.drift_secs, 60.0, None)?,
            learn_evictions: c.learn_evictions.unwrap_or(false),
        };

        let h = raw.health;
        let endpoint = h.endpoint.unwrap_or_else(|| "/health".into());
        if !endpoint.starts_with('/') || endpoint.parse::<http::uri::PathAndQuery>().is_err() {
            return Err(ck.bad(
                "health.endpoint",
                endpoint,
                "is not a path starting with `/`",
            ));
        }
        let health = HealthConfig {
            endpoint,
            interval: ck.secs("health.interval_secs", h.interval_secs, 10.0, None)?,
            timeout: ck.secs("health.timeout_secs", h.timeout_secs, 5.0, None)?,
            failure_threshold: ck.at_least_one(
                "health.failure_threshold",
                h.failure_threshold,
                3,
            )?,
            success_threshold: ck.at_least_one(
                "health.success_threshold",
                h.success_threshold,
                2,
            )?,
        };

        let b = raw.circuit_breaker;
        let circuit_breaker = BreakerConfig {
            failure_threshold: ck.at_least_one(
                "circuit_breaker.failure_threshold",
                b.failure_threshold,
                5,
            )?,
            timeout: ck.secs("circuit_breaker.timeout_secs", b.timeout_secs, 30.0, None)?,
            success_threshold: ck.at_least_one(
                "circuit_breaker.success_threshold",
                b.success_threshold,
                2,
            )?,
        };

        let p = raw.proxy;
        let backoff_multiplier = p.backoff_multiplier.unwrap_or(2.0);
        if !backoff_multiplier.is_finite() || !(1.0..=100.0).contains(&backoff_multiplier) {
            return Err(ck.bad(
                "proxy.backoff_multiplier",
                backoff_multiplier,
                "is out of range [1, 100]",
            ));
        }
        let jitter_factor = p.jitter_factor.unwrap_or(0.2);
        if !(0.0..=1.0).contains(&jitter_factor) {
            return Err(ck.bad(
                "proxy.jitter_factor",
                jitter_factor,
                "is out of range [0, 1]",
            ));
        }
        let retryable_statuses = p.retryable_statuses.unwrap_or_else(|| vec![502, 503, 504]);
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
        let remote_media_url_policy = match p.remote_media_url_policy {
            None => RemoteMediaPolicy::Allow,
            Some(Value::String(s)) if s == "allow" => RemoteMediaPolicy::Allow,
            Some(Value::Number(n)) if n.as_u64().is_some_and(|n| (400..=499).contains(&n)) => {
                RemoteMediaPolicy::Reject(n.as_u64().unwrap_or(400) as u16)
            }
            Some(other) => {
                return Err(ck.bad(
                    "proxy.remote_media_url_policy",
                    format!("{other:?}"),
                    "is not `allow` or a 4xx status",
                ));
            }
        };
        let passthrough = match &p.passthrough {
            None => Passthrough::default(),
            Some(v) => Passthrough::from_yaml(v).map_err(|m| match v {
                Value::Sequence(_) => ck.err("proxy.passthrough", m),
                _ => ck.bad("proxy.passthrough", format!("{v:?}"), m),
            })?,
        };
        let raw_tls = p.tls.unwrap_or_default();
        let tls = TlsSetting::load(
            raw_tls.ca_file,
            raw_tls.insecure_skip_verify.unwrap_or(false),
        )
        .map_err(|m| ck.err("proxy.tls.ca_file", m))?;
        let q = p.queue.unwrap_or_default();
        let max_waiting = q.max_waiting.unwrap_or(0);
        if max_waiting > 1_000_000 {
            return Err(ck.bad(
                "proxy.queue.max_waiting",
                max_waiting,
                "is out of range (requests, 0 = off, to 1,000,000)",
            ));
        }
        let timeout_ms = q.timeout_ms.unwrap_or(1000);
        if !(1..=600_000).contains(&timeout_ms) {
            return Err(ck.bad(
                "proxy.queue.timeout_ms",
                timeout_ms,
                "is out of range (milliseconds, 1 to 600000)",
            ));
        }
        let queue = QueueConfig {
            max_waiting: max_waiting as usize,
            timeout: Duration::from_millis(timeout_ms),
        };
        let request_timeout = ck.secs(
            "proxy.request_timeout_secs",
            p.request_timeout_secs,
            600.0,
            None,
        )?;
        let attempt_timeout = match p.attempt_timeout_secs {
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
        let proxy = ProxyConfig {
            queue,
            max_retries: p.max_retries.unwrap_or(2),
            initial_backoff: Duration::from_millis(p.initial_backoff_ms.unwrap_or(50)),
            backoff_multiplier,
            jitter_factor,
            retryable_statuses,
            connect_timeout: ck.secs(
                "proxy.connect_timeout_secs",
                p.connect_timeout_secs,
                2.0,
                None,
            )?,
            request_timeout,
            attempt_timeout,
            pool_idle_timeout: ck.secs(
                "proxy.pool_idle_timeout_secs",
                p.pool_idle_timeout_secs,
                4.0,
                Some("no idle connection kept"),
            )?,
            add_routed_peer_header: p.add_routed_peer_header.unwrap_or(false),
            remote_media_url_policy,
            models_cache: ck.secs(
                "proxy.models_cache_secs",
                p.models_cache_secs,
                600.0,
                Some("never cached"),
            )?,
            api_key: ck.secret("proxy.api_key", p.api_key)?,
            passthrough,
            tls,
        };

        let level = raw.log.level.unwrap_or_else(|| "info".into());
        if let Err(why) = check_log_filter(&level) {
            return Err(ck.bad("log.level", &level, why));
        }
        let log = LogConfig {
            format: raw.log.format.unwrap_or(LogFormat::Text),
            level,
            color: raw.log.color.unwrap_or(LogColor::Auto),
        };

        let policy = raw.policy.unwrap_or(PolicyKind::CacheAware);
        let pr = raw.precise;
        let content_format = pr
            .chat_template_content_format
            .unwrap_or(ContentFormat::Auto);
        let max_bytes = pr
            .max_tokenize_bytes
            .unwrap_or(crate::tokenize::DEFAULT_MAX_BYTES as u64);
        if !(1024..=1 << 30).contains(&max_bytes) {
            return Err(ck.bad(
                "precise.max_tokenize_bytes",
                max_bytes,
                "is out of range (bytes, 1024 to 2^30)",
            ));
        }
        let tokenizer = match (pr.tokenizer, pr.chat_template) {
            (Some(path), chat_template) => {
                let loaded = PromptTokenizer::load_with_limit(
                    &path,
                    chat_template.as_deref(),
                    content_format,
                    max_bytes as usize,
                )
                .map_err(|e| match e {
                    LoadError::Template(m) if chat_template.is_some() => {
                        ck.err("precise.chat_template", m)
                    }
                    e => ck.err("precise.tokenizer", e.to_string()),
                })?;
                Some(TokenizerSetting {
                    path,
                    chat_template,
                    content_format,
                    max_bytes: max_bytes as usize,
                    loaded: Arc::new(loaded),
                })
            }
            (None, Some(_)) => {
                return Err(ck.err(
                    "precise.chat_template",
                    "needs `precise.tokenizer` (the model folder or its tokenizer.json)",
                ));
            }
            (None, None) => None,
        };
        let block_size = pr.block_size.unwrap_or(16);
        if !(1..=4096).contains(&block_size) {
            return Err(ck.bad(
                "precise.block_size",
                block_size,
                "is out of range (tokens, 1 to 4096; must equal the engines' --block-size)",
            ));
        }
        let max_blocks = pr.max_blocks.unwrap_or(1_000_000);
        let max_blocks = NonZeroUsize::new(max_blocks as usize)
            .filter(|_| max_blocks <= 1 << 32)
            .ok_or_else(|| {
                ck.bad(
                    "precise.max_blocks",
                    max_blocks,
                    "is out of range (blocks, 1 to 2^32)",
                )
            })?;
        let parity_floor = pr.parity_floor.unwrap_or(0.5);
        if !(0.0..=1.0).contains(&parity_floor) {
            return Err(ck.bad(
                "precise.parity_floor",
                parity_floor,
                "is out of range (a share of checked answers whose blocks the engine confirmed, 0 to 1; 0 = never fall back)",
            ));
        }
        let precise = PreciseConfig {
            block_size: block_size as usize,
            max_blocks,
            stale: ck.secs("precise.stale_secs", pr.stale_secs, 30.0, None)?,
            speculative_ttl: ck.secs(
                "precise.speculative_ttl_secs",
                pr.speculative_ttl_secs,
                2.0,
                Some("off"),
            )?,
            tokenizer,
            parity_floor,
        };
        if policy == PolicyKind::PreciseCacheAware
            && !workers.is_empty()
            && workers.iter().all(|w| w.kv_events.is_none())
        {
            return Err(ck.err(
                "workers",
                "policy precise_cache_aware needs `kv_events: {endpoint: tcp://host:port}` on at least one worker",
            ));
        }
        // One publisher per worker and rank: no port any rank of a worker dials (event or
        // replay) may be one another worker's rank dials.
        let mut dialled: HashMap<(&str, u16), (usize, u32, u32, bool)> = HashMap::new();
        for (i, w) in workers.iter().enumerate() {
            let Some(k) = &w.kv_events else { continue };
            for (rank, replay, host, port) in kv_ports(k) {
                if let Some(&(j, dp, r, rep)) = dialled.get(&(host, port))
                    && j != i
                {
                    return Err(ck.err(
                        &format!("workers[{i}].kv_events"),
                        format!(
                            "`{}`: another worker already dials tcp://{host}:{port}, this worker's {}, as workers[{j}]'s {} (one publisher per worker and rank; with dp_size n a worker dials its event and replay ports plus 0 to n-1)",
                            k.endpoint,
                            kv_port_name(k.dp_size, rank, replay),
                            kv_port_name(dp, r, rep),
                        ),
                    ));
                }
                dialled.insert((host, port), (i, k.dp_size, rank, replay));
            }
        }

        let ch = raw.consistent_hash;
        let load_factor = ch.load_factor.unwrap_or(1.25);
        if !load_factor.is_finite() || !(1.0..=100.0).contains(&load_factor) || load_factor == 1.0 {
            return Err(ck.bad(
                "consistent_hash.load_factor",
                load_factor,
                "is out of range (> 1 and ≤ 100: a worker may hold this many times the mean load)",
            ));
        }
        let consistent_hash = ConsistentHashConfig {
            key: ch.key.unwrap_or(HashKey::Auto),
            load_factor,
        };

        let se = raw.session;
        let mut headers = Vec::new();
        for (i, h) in se
            .headers
            .unwrap_or_else(|| vec!["x-session-id".into()])
            .iter()
            .enumerate()
        {
            let name = http::HeaderName::from_bytes(h.as_bytes()).map_err(|_| {
                ck.bad(
                    &format!("session.headers[{i}]"),
                    h,
                    "is not an HTTP header name",
                )
            })?;
            headers.push(name);
        }
        let body_fields = se.body_fields.unwrap_or_default();
        for (i, f) in body_fields.iter().enumerate() {
            if f.is_empty() || f.split('.').any(str::is_empty) {
                return Err(ck.bad(
                    &format!("session.body_fields[{i}]"),
                    f,
                    "is not a dotted JSON path (e.g. `user` or `metadata.user_id`)",
                ));
            }
        }
        let max_sessions = se.max_sessions.unwrap_or(1_000_000);
        let max_sessions = NonZeroUsize::new(max_sessions as usize)
            .filter(|_| max_sessions <= 100_000_000)
            .ok_or_else(|| {
                ck.bad(
                    "session.max_sessions",
                    max_sessions,
                    "is out of range (sessions, 1 to 100,000,000)",
                )
            })?;
        let session = SessionConfig {
            enabled: se.enabled.unwrap_or(true),
            headers,
            body_fields,
            mode: se.mode.unwrap_or(SessionMode::Soft),
            ttl: ck.secs("session.ttl_secs", se.ttl_secs, 3600.0, None)?,
            max_sessions,
        };

        let em = raw.engine_metrics;
        let path = em.path.unwrap_or_else(|| "/metrics".into());
        if !path.starts_with('/') || path.parse::<http::uri::PathAndQuery>().is_err() {
            return Err(ck.bad(
                "engine_metrics.path",
                path,
                "is not a URL path starting with `/` (no spaces or control characters)",
            ));
        }
        let interval_ms = em.interval_ms.unwrap_or(1000);
        if !(50..=600_000).contains(&interval_ms) {
            return Err(ck.bad(
                "engine_metrics.interval_ms",
                interval_ms,
                "is out of range (ms, 50 to 600000)",
            ));
        }
        let engine_metrics = EngineMetricsConfig {
            enabled: em.enabled.unwrap_or(policy == PolicyKind::CostAware),
            path,
            interval: Duration::from_millis(interval_ms),
            stale: ck.secs("engine_metrics.stale_secs", em.stale_secs, 5.0, None)?,
        };
        if engine_metrics.stale < engine_metrics.interval {
            return Err(ck.err(
                "engine_metrics.stale_secs",
                format!(
                    "{} s is shorter than engine_metrics.interval_ms ({interval_ms} ms): every reading would go stale before the next one arrives (give at least the interval, e.g. 5 × it)",
                    engine_metrics.stale.as_secs_f64()
                ),
            ));
        }
        if policy == PolicyKind::LmcacheAware
            && !workers.is_empty()
            && workers.iter().all(|w| w.lmcache.is_none())
        {
            return Err(ck.err(
                "workers",
                "policy lmcache_aware needs `lmcache: {endpoint: /path or http://host:port/path}` on at least one worker",
            ));
        }

        let response_cache = raw.response_cache.validate(ck)?;
        let state = raw.state.validate(ck)?;
        let tracing = raw.tracing.validate(ck)?;

        Ok(Config {
            tracing,
            discovery,
            state,
            response_cache,
            engine_metrics,
            session,
            consistent_hash,
            policy,
            server,
            workers,
            cache,
            health,
            circuit_breaker,
            proxy,
            log,
            precise,
            settings: Settings::default(),
        })
    }

    /// Every key other than `workers` whose value differs between the files of two
    /// configs, by its full path with both values: `cache.threshold: 0.3 → 0.55`,
    /// `(unset)` for a key one of them leaves out (its default then applies). A
    /// credential's value is shown as `***`, a URL's user-info masked; a long value is
    /// cut at 60 characters. Compares what the files say, so a key written differently
    /// but meaning the same (`0.30` and `0.3`) is not listed.
    pub fn changed_settings(&self, other: &Config) -> Vec<String> {
        let mut out = Vec::new();
        diff_values(
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
        if self.policy != other.policy {
            return Some("policy");
        }
        if self.server != other.server {
            return Some("server");
        }
        if self.cache != other.cache {
            return Some("cache");
        }
        if self.health != other.health {
            return Some("health");
        }
        if self.circuit_breaker != other.circuit_breaker {
            return Some("circuit_breaker");
        }
        if self.proxy != other.proxy {
            return Some("proxy");
        }
        if self.log != other.log {
            return Some("log");
        }
        if self.precise != other.precise {
            return Some("precise");
        }
        if self.consistent_hash != other.consistent_hash {
            return Some("consistent_hash");
        }
        if self.session != other.session {
            return Some("session");
        }
        if self.engine_metrics != other.engine_metrics {
            return Some("engine_metrics");
        }
        if self.response_cache != other.response_cache {
            return Some("response_cache");
        }
        if self.state != other.state {
            return Some("state");
        }
        if self.discovery != other.discovery {
            return Some("discovery");
        }
        if self.tracing != other.tracing {
            return Some("tracing");
        }
        None
    }
}

/// One YAML text (`a.yaml`) as a config, the error as its message: for the section
/// modules' tests.
#[cfg(test)]
pub(crate) fn load_text(doc: &str) -> Result<Config, String> {
    Config::from_sources([(Path::new("a.yaml"), doc)]).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(files: &[(&str, &str)]) -> Result<Config, ConfigError> {
        Config::from_sources(files.iter().map(|(f, t)| (Path::new(*f), *t)))
    }

    fn err(files: &[(&str, &str)]) -> String {
        load(files)
            .expect_err("config should be refused")
            .to_string()
    }

    const ONE: &str = "workers:\n  - url: http://127.0.0.1:8001\n";

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
    fn every_named_value_reads_back_its_own_name() {
        fn each<T: Named + PartialEq + std::fmt::Debug>(name: impl Fn(&T) -> &'static str) {
            for n in T::NAMES {
                let v = T::from_name(n).unwrap_or_else(|| panic!("{n}"));
                assert_eq!(name(&v), *n);
            }
        }
        each::<PolicyKind>(|p| p.as_str());
        each::<Role>(|r| r.as_str());
        assert_eq!(PolicyKind::NAMES.len(), 9);
        assert_eq!(one_of(&["a", "b"]), "`a` or `b`");
        assert_eq!(one_of(&["a", "b", "c"]), "one of: `a`, `b`, `c`");
    }

    #[test]
    fn engine_signal_keys_and_their_defaults() {
        let c = load(&[("a.yaml", ONE)]).unwrap();
        assert!(!c.engine_metrics.enabled);
        assert_eq!(c.engine_metrics.path, "/metrics");
        assert_eq!(c.engine_metrics.interval, Duration::from_secs(1));
        assert_eq!(c.engine_metrics.stale, Duration::from_secs(5));
        assert_eq!(c.cache.engine_block_tokens, 16);
        let c = load(&[("a.yaml", &format!("policy: cost_aware\n{ONE}"))]).unwrap();
        assert!(c.engine_metrics.enabled, "on by default for cost_aware");
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
            (
                format!("engine_metrics: {{interval_ms: 10}}\n{ONE}"),
                "engine_metrics.interval_ms",
            ),
            (
                format!("engine_metrics: {{path: metrics}}\n{ONE}"),
                "engine_metrics.path",
            ),
            (format!("engine_metrics: {{every: 1}}\n{ONE}"), "every"),
            (
                format!("cache: {{engine_block_tokens: 0}}\n{ONE}"),
                "cache.engine_block_tokens",
            ),
            (format!("engine_metrics: {{interval_ms: 5000, stale_secs: 1}}\n{ONE}"), "engine_metrics.stale_secs"),
            ("workers:\n  - url: http://a:1\n    lmcache: {endpoint: /s, refresh_secs: 5, stale_secs: 0.5}\n".into(), "lmcache.stale_secs"),
        ] {
            let e = err(&[("a.yaml", &doc)]);
            assert!(e.contains(key), "{doc}: {e}");
        }
        assert!(!err(&[("a.yaml", "workers:\n  - url: http://a:1\n    lmcache: {endpoint: \"http://u:hunter2@x:1/s\"}\n")]).contains("hunter2"));
    }

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
    fn worker_urls_are_normalised_and_duplicates_merged() {
        let doc = "workers:\n  - url: http://127.0.0.1:18001/\n  - url: http://127.0.0.1:18001\n  - url: http://[::1]:18003\n  - url: http://[::1]:18004/\n  - url: http://127.0.0.1:18005/gpu5/\n  - url: HTTP://Example.com\n";
        let c = load(&[("w.yaml", doc)]).unwrap();
        let urls: Vec<String> = c.workers.iter().map(|w| w.url.to_string()).collect();
        assert_eq!(
            urls,
            [
                "http://127.0.0.1:18001",
                "http://[::1]:18003",
                "http://[::1]:18004",
                "http://127.0.0.1:18005/gpu5",
                "http://example.com"
            ]
        );
        assert_eq!(c.workers[1].url.authority(), "[::1]:18003");
        assert_eq!(c.workers[1].url.host_header(), "[::1]:18003");
        assert_eq!(
            c.workers[1]
                .url
                .uri_for("/v1/models?x=1")
                .unwrap()
                .to_string(),
            "http://[::1]:18003/v1/models?x=1"
        );
        assert!(
            c.workers[1].url.uri_for("/bad path").is_err(),
            "a path the URI parser refuses is an error, not a panic"
        );
        let u = &c.workers[3].url;
        assert_eq!(
            u.uri_for("/v1/chat/completions?trace=1")
                .unwrap()
                .to_string(),
            "http://127.0.0.1:18005/gpu5/v1/chat/completions?trace=1"
        );
        assert_eq!(
            c.workers[0].url.uri_for("/v1/models").unwrap().to_string(),
            "http://127.0.0.1:18001/v1/models"
        );
    }

    #[test]
    fn keys_never_show_in_debug_output() {
        let c = load(&[(
            "k.yaml",
            "workers:\n  - url: http://a:1\n    api_key: sk-worker-1\nproxy:\n  api_key: sk-global-2\nserver:\n  admin_token: tok-3\n",
        )])
        .unwrap();
        let shown = format!("{c:?}");
        for secret in ["sk-worker-1", "sk-global-2", "tok-3"] {
            assert!(!shown.contains(secret), "{shown}");
        }
        assert_eq!(
            c.workers[0].api_key.as_ref().map(Secret::expose),
            Some("sk-worker-1")
        );
    }

    #[test]
    fn precise_mode_keys_are_read_with_defaults() {
        let doc = "policy: precise_cache_aware\nworkers:\n  - url: http://a:1\n    kv_events:\n      endpoint: tcp://10.0.0.7:5557\n      topic: kv-events\n      replay_endpoint: tcp://10.0.0.7:5558\n  - url: http://b:1\n";
        let c = load(&[("p.yaml", doc)]).unwrap();
        assert_eq!(c.policy, PolicyKind::PreciseCacheAware);
        let k = c.workers[0].kv_events.as_ref().unwrap();
        assert_eq!(
            (
                k.endpoint.as_str(),
                k.topic.as_str(),
                k.replay_endpoint.as_deref()
            ),
            (
                "tcp://10.0.0.7:5557",
                "kv-events",
                Some("tcp://10.0.0.7:5558")
            )
        );
        assert_eq!(c.workers[1].kv_events, None);
        assert_eq!(c.precise.block_size, 16);
        assert_eq!(c.precise.max_blocks.get(), 1_000_000);
        assert_eq!(c.precise.stale, Duration::from_secs(30));
        assert_eq!(c.precise.speculative_ttl, Duration::from_secs(2));
        let c = load(&[
            ("p.yaml", doc),
            ("q.yaml", "precise:\n  block_size: 32\n  max_blocks: 10\n  stale_secs: 0.5\n  speculative_ttl_secs: 0\n"),
        ])
        .unwrap();
        assert_eq!((c.precise.block_size, c.precise.max_blocks.get()), (32, 10));
        assert_eq!(c.precise.stale, Duration::from_millis(500));
        assert!(c.precise.speculative_ttl.is_zero());
        // kv_events through the admin API's JSON form too.
        let w = WorkerConfig::from_json(
            br#"{"url":"http://c:1","kv_events":{"endpoint":"tcp://c:5557"}}"#,
        )
        .unwrap();
        assert_eq!(w.kv_events.unwrap().topic, "");
    }

    #[test]
    fn precise_mode_errors_name_the_key() {
        let base = "workers:\n  - url: http://a:1\n";
        let e = err(&[
            ("p.yaml", "policy: precise_cache_aware\n"),
            ("w.yaml", base),
        ]);
        assert!(
            e.contains("kv_events") && e.contains("precise_cache_aware"),
            "{e}"
        );
        for (endpoint, why) in [
            ("tcp://*:5557", "bind address"),
            ("tcp://0.0.0.0:5557", "bind address"),
            ("ipc:///tmp/kv", "tcp://host:port"),
            ("tcp://h:0", "invalid port"),
            ("tcp://h", "missing `:port`"),
            ("tcp://:5557", "missing host"),
        ] {
            let doc = format!(
                "workers:\n  - url: http://a:1\n    kv_events:\n      endpoint: \"{endpoint}\"\n"
            );
            let e = err(&[("k.yaml", &doc)]);
            assert!(
                e.contains("k.yaml")
                    && e.contains("workers[0].kv_events.endpoint")
                    && e.contains(endpoint)
                    && e.contains(why),
                "{endpoint}: {e}"
            );
        }
        let dup = "workers:\n  - url: http://a:1\n    kv_events: {endpoint: \"tcp://h:1\"}\n  - url: http://b:1\n    kv_events: {endpoint: \"tcp://h:1\"}\n";
        let e = err(&[("d.yaml", dup)]);
        assert!(
            e.contains("workers[1].kv_events") && e.contains("another worker"),
            "{e}"
        );
        let same = "workers:\n  - url: http://a:1\n    kv_events: {endpoint: \"tcp://h:1\", replay_endpoint: \"tcp://h:1\"}\n";
        assert!(err(&[("s.yaml", same)]).contains("replay_endpoint"));
        let unknown =
            "workers:\n  - url: http://a:1\n    kv_events: {endpoint: \"tcp://h:1\", topik: x}\n";
        assert!(err(&[("u.yaml", unknown)]).contains("topik"));
        for (over, key, value) in [
            ("precise:\n  block_size: 0\n", "precise.block_size", "0"),
            ("precise:\n  max_blocks: 0\n", "precise.max_blocks", "0"),
            ("precise:\n  stale_secs: 0\n", "precise.stale_secs", "0"),
            (
                "precise:\n  tokenizer: Qwen/Qwen3-8B\n",
                "precise.tokenizer",
                "Qwen/Qwen3-8B",
            ),
            (
                "precise:\n  chat_template: t.jinja\n",
                "precise.chat_template",
                "precise.tokenizer",
            ),
            (
                "precise:\n  chat_template_content_format: list\n",
                "precise.chat_template_content_format",
                "list",
            ),
            (
                "precise:\n  max_tokenize_bytes: 10\n",
                "precise.max_tokenize_bytes",
                "10",
            ),
        ] {
            let e = err(&[("base.yaml", base), ("over.yaml", over)]);
            assert!(
                e.contains("over.yaml") && e.contains(key) && e.contains(value),
                "{over:?} gave {e}"
            );
        }
    }

    #[test]
    fn dp_size_offsets_every_rank_and_is_checked() {
        let kv = |w: &str, fields: &str| {
            format!(
                "  - url: http://{w}:1\n    kv_events: {{endpoint: \"tcp://h:5557\", {fields}}}\n"
            )
        };
        // Default 1; a rank's ports are the bases plus the rank.
        let c = load(&[(
            "a.yaml",
            &format!(
                "workers:\n{}",
                kv("a", "replay_endpoint: \"tcp://h:6557\", dp_size: 4")
            ),
        )])
        .unwrap();
        let k = c.workers[0].kv_events.as_ref().unwrap();
        assert_eq!(k.dp_size, 4);
        assert_eq!(
            (
                k.rank_endpoint(0),
                k.rank_endpoint(3),
                k.rank_replay_endpoint(3)
            ),
            (
                "tcp://h:5557".to_string(),
                "tcp://h:5560".to_string(),
                Some("tcp://h:6560".to_string())
            )
        );
        let c = load(&[("b.yaml", &format!("workers:\n{}", kv("a", "topic: t")))]).unwrap();
        assert_eq!(c.workers[0].kv_events.as_ref().unwrap().dp_size, 1);
        let w = WorkerConfig::from_json(
            br#"{"url":"http://c:1","kv_events":{"endpoint":"tcp://c:5557","dp_size":2}}"#,
        )
        .unwrap();
        assert_eq!(w.kv_events.unwrap().rank_endpoint(1), "tcp://c:5558");

        let refused = |workers: &[String], key: &str, why: &[&str]| {
            let e = err(&[("d.yaml", &format!("workers:\n{}", workers.concat()))]);
            assert!(
                e.contains("d.yaml") && e.contains(key) && why.iter().all(|w| e.contains(w)),
                "{workers:?} gave {e}"
            );
        };
        // Range, with the reason.
        for n in ["0", "-1", "65"] {
            refused(
                &[kv("a", &format!("dp_size: {n}"))],
                "workers[0].kv_events.dp_size",
                &[n, "1 to 64", "--data-parallel-size"],
            );
        }
        // The last rank's port must exist.
        refused(
            &[
                "  - url: http://a:1\n    kv_events: {endpoint: \"tcp://h:65534\", dp_size: 3}\n"
                    .into(),
            ],
            "workers[0].kv_events.endpoint",
            &["rank 2", "65536", "65535"],
        );
        refused(
            &[kv("a", "replay_endpoint: \"tcp://h:65535\", dp_size: 2")],
            "workers[0].kv_events.replay_endpoint",
            &["65536"],
        );
        // A worker's event and replay ranges apart: vLLM's defaults 5557/5558 collide
        // from dp_size 2 on.
        refused(
            &[kv("a", "replay_endpoint: \"tcp://h:5558\", dp_size: 2")],
            "workers[0].kv_events.replay_endpoint",
            &["5557..=5558", "5558..=5559", "overlap"],
        );
        assert!(
            load(&[(
                "ok.yaml",
                &format!(
                    "workers:\n{}",
                    kv("a", "replay_endpoint: \"tcp://h:5559\", dp_size: 2")
                )
            )])
            .is_ok()
        );
        // Another worker on any rank's port: event on event, event on replay.
        let two_ranks = kv("a", "dp_size: 2");
        let on_rank_1 = "  - url: http://b:1\n    kv_events: {endpoint: \"tcp://h:5558\"}\n";
        refused(
            &[two_ranks.clone(), on_rank_1.into()],
            "workers[1].kv_events",
            &[
                "another worker",
                "tcp://h:5558",
                "workers[0]'s rank 1 event endpoint",
            ],
        );
        let replay_on_rank_1 = "  - url: http://b:1\n    kv_events: {endpoint: \"tcp://h:7000\", replay_endpoint: \"tcp://h:5558\"}\n";
        refused(
            &[two_ranks.clone(), replay_on_rank_1.into()],
            "workers[1].kv_events",
            &[
                "this worker's replay endpoint",
                "workers[0]'s rank 1 event endpoint",
            ],
        );
        let below =
            "  - url: http://b:1\n    kv_events: {endpoint: \"tcp://h:5556\", dp_size: 2}\n";
        refused(
            &[two_ranks.clone(), below.into()],
            "workers[1].kv_events",
            &[
                "this worker's rank 1 event endpoint",
                "workers[0]'s rank 0 event endpoint",
            ],
        );
        // Next to each other, or the same ports on another host, is fine.
        let after =
            "  - url: http://b:1\n    kv_events: {endpoint: \"tcp://h:5559\", dp_size: 2}\n";
        let elsewhere =
            "  - url: http://c:1\n    kv_events: {endpoint: \"tcp://g:5557\", dp_size: 2}\n";
        let c = load(&[(
            "ok.yaml",
            &format!("workers:\n{two_ranks}{after}{elsewhere}"),
        )])
        .unwrap();
        assert_eq!(c.workers.len(), 3);
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
    fn keys_that_cannot_be_a_header_are_refused_naming_the_key_never_the_value() {
        for (key, yaml) in [
            (
                "workers[0].api_key",
                "workers:\n  - url: http://a:1\n    api_key: {v}\n",
            ),
            ("proxy.api_key", "proxy:\n  api_key: {v}\n"),
            ("server.admin_token", "server:\n  admin_token: {v}\n"),
        ] {
            for v in [
                "\"sk-hidden-1\\n\"",
                "\"\"",
                "\"sk hidden-1\"",
                "\"sk-\\u0007hidden-1\"",
                "[sk-hidden-1]",
                "{a: sk-hidden-1}",
            ] {
                let e = err(&[("a.yaml", ONE), ("k.yaml", &yaml.replace("{v}", v))]);
                assert!(e.contains("k.yaml") && e.contains(key), "{key} {v}: {e}");
                assert!(
                    !e.contains("hidden"),
                    "{key} {v}: the value is printed: {e}"
                );
            }
        }
        let w = WorkerConfig::from_json(br#"{"url":"http://c:1","api_key":"sk-hidden-1\n"}"#)
            .unwrap_err();
        assert!(w.contains("api_key") && !w.contains("hidden"), "{w}");
        let w = WorkerConfig::from_json(br#"{"url":"http://c:1","api_key":12345678}"#).unwrap_err();
        assert!(w.contains("api_key") && !w.contains("12345678"), "{w}");
        let c = load(&[(
            "a.yaml",
            "workers:\n  - url: http://a:1\n    api_key: sk-ok_1.2\n",
        )])
        .unwrap();
        assert_eq!(
            c.workers[0].api_key.as_ref().unwrap().bearer(),
            "Bearer sk-ok_1.2"
        );
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

    #[test]
    fn a_log_level_typo_is_refused_not_read_as_a_target() {
        for bad in [
            "warning",
            "\"\"",
            "\"True\"",
            "info,warning",
            "=debug",
            "x=loud",
        ] {
            let e = err(&[
                ("a.yaml", ONE),
                ("l.yaml", &format!("log:\n  level: {bad}\n")),
            ]);
            assert!(e.contains("log.level"), "{bad}: {e}");
        }
        for good in [
            "info",
            "WARN",
            "warn,cache_aware_router=debug",
            "hyper=off,info",
        ] {
            assert!(
                load(&[
                    ("a.yaml", ONE),
                    ("l.yaml", &format!("log:\n  level: \"{good}\"\n"))
                ])
                .is_ok(),
                "{good}"
            );
        }
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
        let mut doc = String::from("workers:\n");
        for i in 0..80_000u32 {
            doc.push_str(&format!(
                "  - url: http://10.{}.{}.{}:{}\n",
                i / 65_000,
                (i / 250) % 250,
                i % 250,
                8000 + i % 1000
            ));
        }
        doc.push_str("  - url: http://10.0.0.0:8000/\n"); // a duplicate, merged
        let started = std::time::Instant::now();
        let c = load(&[("big.yaml", &doc)]).unwrap();
        let took = started.elapsed();
        assert_eq!(c.workers.len(), 80_000);
        // Quadratic, this took 28.9 s in release; linear it is well under 1 s in release
        // and a few seconds in a debug build on a slow CI core.
        assert!(took < Duration::from_secs(10), "{took:?}");
    }

    #[test]
    fn https_workers_and_proxy_tls_are_checked() {
        let c = load(&[("a", "workers:\n  - url: HTTPS://Example.com/v1/\n")]).unwrap();
        assert_eq!(c.workers[0].url.as_str(), "https://example.com/v1");
        assert!(!c.proxy.tls.insecure_skip_verify);
        let e = err(&[
            ("a.yaml", ONE),
            (
                "b.yaml",
                "proxy:\n  tls:\n    ca_file: /nonexistent/ca.pem\n",
            ),
        ]);
        assert!(
            e.contains("proxy.tls.ca_file") && e.contains("cannot be read"),
            "{e}"
        );
        let e = err(&[
            ("a.yaml", ONE),
            ("b.yaml", "proxy:\n  tls:\n    verify: no\n"),
        ]);
        assert!(e.contains("verify"), "{e}");
    }

    #[test]
    fn changed_settings_name_every_key_by_its_path() {
        let a = load(&[(
            "a",
            "cache:\n  threshold: 0.3\n  match_abs_threshold: 100\nproxy:\n  api_key: old\nstate:\n  redis_url: \"redis://:pw@r:6379\"\nworkers:\n  - url: http://a:1\n",
        )])
        .unwrap();
        let b = load(&[(
            "b",
            "cache:\n  threshold: 0.55\n  match_abs_threshold: 100\nproxy:\n  api_key: new\nstate:\n  redis_url: \"redis://:pw2@r:6379\"\nworkers:\n  - url: http://b:1\n",
        )])
        .unwrap();
        assert_eq!(
            a.changed_settings(&b),
            [
                "cache.threshold: 0.3 → 0.55",
                "proxy.api_key: *** → ***",
                "state.redis_url: redis://***@r:6379 → redis://***@r:6379",
            ]
        );
        assert!(a.changed_settings(&a).is_empty());
    }

    #[test]
    fn an_admin_listener_needs_a_port_of_its_own() {
        let c = load(&[
            ("a", ONE),
            ("b", "server:\n  host: 10.0.0.1\n  admin:\n    port: 6701\n"),
        ])
        .unwrap();
        assert_eq!(
            c.server.admin,
            Some(AdminListen {
                host: "10.0.0.1".into(),
                port: 6701
            })
        );
        assert_eq!(load(&[("a", ONE)]).unwrap().server.admin, None);
        for (doc, key, what) in [
            (
                "server:\n  admin: {host: 127.0.0.1}\n",
                "server.admin.port",
                "is missing",
            ),
            (
                "server:\n  port: 6700\n  admin: {port: 6700}\n",
                "server.admin.port",
                "main port",
            ),
            ("server:\n  admin: {port: 6701, tls: true}\n", "tls", ""),
        ] {
            let e = err(&[("a.yaml", ONE), ("b.yaml", doc)]);
            assert!(e.contains(key) && e.contains(what), "{doc}: {e}");
        }
    }

    #[test]
    fn floors_are_ratios_from_0_to_1() {
        for key in ["cache.drift_floor", "precise.parity_floor"] {
            let (section, name) = key.split_once('.').unwrap();
            let doc = |v: &str| format!("{section}:\n  {name}: {v}\n");
            for bad in ["-0.1", "1.5", ".nan"] {
                let e = err(&[("a.yaml", ONE), ("b.yaml", &doc(bad))]);
                assert!(e.contains(key) && e.contains("0 to 1"), "{key} {bad}: {e}");
            }
            for good in ["0", "0.5", "1"] {
                assert!(
                    load(&[("a.yaml", ONE), ("b.yaml", &doc(good))]).is_ok(),
                    "{key} {good}"
                );
            }
        }
        assert_eq!(load(&[("a", ONE)]).unwrap().precise.parity_floor, 0.5);
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

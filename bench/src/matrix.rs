//! The policy comparison: for each contender start fresh engines (and a router),
//! replay the same trace slice through it, stop everything, and tabulate.
//!
//! A contender is a router policy of ours (`cache_aware`, `round_robin`,
//! `least_load`, ...), a peer router with one of its policies (`sglang:cache_aware`:
//! sglang-router; `vllm:cache_aware`: vllm-router; both run from their PyPI
//! packages, see [`Peer`]), `direct` (client-side round robin straight to the
//! engines, no router) or `ideal` (everything straight to ONE engine whose KV cache
//! holds the whole slice: the hit rate no routing over bounded caches can beat).
//! `POLICY/N[/shared][/kill]` ([`Replicas`]) runs N replicas of our router over the
//! same engines, requests alternating between them: independent, or sharing routing
//! state through a `redis-server` started for the run (`state.redis_url`), and with
//! `kill` the last replica killed when the middle request is due (the client sends
//! what finds it gone to the next replica).
//! Every contender starts from cold caches: new `sim-engine` processes, a new
//! router process (and Redis), free ports on 127.0.0.1.
//!
//! Child processes are started and owned through [`crate::procs`]: stopped
//! explicitly on the normal and error paths, and killed on drop if the future is
//! cancelled (Ctrl-C) or panics.

use std::fmt::Write as _;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;

use crate::procs::{
    self, RouterCommand, ScratchDir, free_port, io_err, start_engine, start_router_command, tail,
};
pub use crate::procs::{ChildProc, EngineParams, ProcError, sibling_binary};
use crate::replay::{self, PreparedRequest, ReplayConfig, ReplayError, RequestResult};
use crate::stats::{EngineLoad, QueueStats, Summary, parse_engine_load, summarize};

/// How often [`QueueSampler`] polls every engine's `/metrics` (wall clock).
pub const QUEUE_SAMPLE_EVERY: Duration = Duration::from_millis(100);

/// Polls every engine's `GET /metrics` at a fixed wall-clock interval on a
/// background task and accumulates [`QueueStats`]: per-engine peak waiting and
/// how often a queue stood while another engine was idle. Stopped by
/// [`QueueSampler::finish`]; dropping it aborts the task.
#[derive(Debug)]
pub struct QueueSampler {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<QueueStats>,
}

impl QueueSampler {
    /// Starts polling `urls` (engine base URLs, named `names`) every `every`;
    /// needs a tokio runtime.
    pub fn start(names: &[String], urls: &[String], every: Duration) -> Self {
        use hyper_util::client::legacy::Client;
        use hyper_util::client::legacy::connect::HttpConnector;
        use hyper_util::rt::TokioExecutor;
        let targets: Vec<Option<hyper::Uri>> = urls
            .iter()
            .map(|u| format!("{}/metrics", u.trim_end_matches('/')).parse().ok())
            .collect();
        let client: Client<HttpConnector, http_body_util::Empty<Bytes>> =
            Client::builder(TokioExecutor::new()).build(HttpConnector::new());
        let (stop, mut stopped) = tokio::sync::oneshot::channel();
        let mut stats = QueueStats::new(names);
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = &mut stopped => break,
                    _ = tick.tick() => stats.record(&poll_loads(&client, &targets).await),
                }
            }
            // One last read for the engines' own high-water marks.
            stats.record_peaks(&poll_loads(&client, &targets).await);
            stats
        });
        Self {
            stop: Some(stop),
            task,
        }
    }

    /// Stops polling and returns what was seen.
    pub async fn finish(mut self) -> QueueStats {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        (&mut self.task).await.unwrap_or_default()
    }
}

impl Drop for QueueSampler {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One `GET /metrics` per target, all at once (1 s limit each); `None` where a
/// target did not answer 2xx with readable queue gauges.
async fn poll_loads(
    client: &hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        http_body_util::Empty<Bytes>,
    >,
    targets: &[Option<hyper::Uri>],
) -> Vec<Option<EngineLoad>> {
    use http_body_util::BodyExt;
    let mut set = tokio::task::JoinSet::new();
    for (i, uri) in targets.iter().enumerate() {
        let (client, uri) = (client.clone(), uri.clone());
        set.spawn(async move {
            let read = async {
                let resp = client.get(uri?).await.ok()?;
                if !resp.status().is_success() {
                    return None;
                }
                let body = resp.into_body().collect().await.ok()?.to_bytes();
                parse_engine_load(&String::from_utf8_lossy(&body))
            };
            let load = tokio::time::timeout(Duration::from_secs(1), read)
                .await
                .ok()
                .flatten();
            (i, load)
        });
    }
    let mut out = vec![None; targets.len()];
    while let Some(joined) = set.join_next().await {
        if let Ok((i, load)) = joined {
            out[i] = load;
        }
    }
    out
}

/// Router policies the demo compares by default, in table order.
pub const DEFAULT_POLICIES: [&str; 3] = ["cache_aware", "round_robin", "least_load"];

/// A peer router, run from its PyPI package (a Python entry point around a Rust
/// extension; the router runs inside that Python process).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Peer {
    /// `sglang-router` (PyPI 0.3.2): `smg launch --worker-urls ... --policy P`.
    Sglang,
    /// `vllm-router` (PyPI 0.1.17): `vllm-router --worker-urls ... --policy P`.
    Vllm,
}

impl Peer {
    /// Both peers, in table order.
    pub const ALL: [Peer; 2] = [Peer::Sglang, Peer::Vllm];

    /// Package name: `sglang-router`, `vllm-router`.
    pub fn name(self) -> &'static str {
        match self {
            Peer::Sglang => "sglang-router",
            Peer::Vllm => "vllm-router",
        }
    }

    /// Short key used in contender lists: `sglang`, `vllm`.
    pub fn key(self) -> &'static str {
        match self {
            Peer::Sglang => "sglang",
            Peer::Vllm => "vllm",
        }
    }

    /// The peer named `key` (`sglang`, `sglang-router`, `vllm`, `vllm-router`).
    pub fn from_key(key: &str) -> Option<Peer> {
        Peer::ALL
            .into_iter()
            .find(|p| key == p.key() || key == p.name())
    }

    /// Its executable inside a virtualenv: `VENV/bin/smg`, `VENV/bin/vllm-router`.
    pub fn bin_in(self, venv: &Path) -> PathBuf {
        venv.join("bin").join(match self {
            Peer::Sglang => "smg",
            Peer::Vllm => "vllm-router",
        })
    }

    /// Its `--log-level` value for `level` (`warn` is `warning` for vllm-router).
    fn log_level(self, level: &str) -> String {
        match (self, level) {
            (Peer::Vllm, "warn") => "warning".into(),
            (Peer::Sglang, "warning") => "warn".into(),
            _ => level.into(),
        }
    }

    /// Its balance thresholds when left at their defaults, as its `--help` and the
    /// startup log say: (cache_threshold, balance_abs_threshold, balance_rel_threshold).
    pub fn default_thresholds(self) -> (f64, u32, f64) {
        (0.3, 64, 1.5)
    }

    /// Its command line: only what it needs to run here (address, workers,
    /// policy) plus, when `log_level` is given, that log level; every other
    /// setting is the package's default. The environment points any Hugging Face
    /// hub access at a closed loopback port (sglang-router tries to fetch a
    /// tokenizer for the served model name; there is no network here anyway).
    pub fn command(
        self,
        program: &Path,
        policy: &str,
        port: u16,
        workers: &[String],
        log_level: Option<&str>,
    ) -> RouterCommand {
        let mut args: Vec<String> = Vec::new();
        if self == Peer::Sglang {
            args.push("launch".into());
        }
        args.extend([
            "--host".into(),
            "127.0.0.1".into(),
            "--port".into(),
            port.to_string(),
            "--policy".into(),
            policy.into(),
        ]);
        if let Some(level) = log_level {
            args.push("--log-level".into());
            args.push(self.log_level(level));
        }
        args.push("--worker-urls".into());
        args.extend(workers.iter().cloned());
        RouterCommand {
            name: self.name().into(),
            program: program.to_path_buf(),
            args,
            env: vec![
                ("HF_ENDPOINT".into(), "http://127.0.0.1:9".into()),
                ("HF_HUB_OFFLINE".into(), "1".into()),
            ],
            context: String::new(),
            term_tree: false,
        }
    }
}

/// Where the peer routers are and how they are run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerSetup {
    /// `smg` of sglang-router.
    pub sglang_bin: PathBuf,
    /// `vllm-router`.
    pub vllm_bin: PathBuf,
    /// `--log-level` given to the peers (`None`: their default, `info`).
    pub log_level: Option<String>,
    /// nginx, for [`RouterKind::Nginx`] (default `/usr/sbin/nginx`, Debian's).
    pub nginx_bin: PathBuf,
    /// nginx writes an access log line per request (default off: the plain
    /// proxy baseline).
    pub nginx_access_log: bool,
}

impl PeerSetup {
    /// Both peers from the virtualenv `venv` (see `bench/peers/run.sh`); nginx
    /// from `/usr/sbin/nginx`, without access log.
    pub fn from_venv(venv: &Path, log_level: Option<String>) -> Self {
        Self {
            sglang_bin: Peer::Sglang.bin_in(venv),
            vllm_bin: Peer::Vllm.bin_in(venv),
            log_level,
            nginx_bin: PathBuf::from("/usr/sbin/nginx"),
            nginx_access_log: false,
        }
    }

    /// The executable of `peer`.
    pub fn bin(&self, peer: Peer) -> &Path {
        match peer {
            Peer::Sglang => &self.sglang_bin,
            Peer::Vllm => &self.vllm_bin,
        }
    }
}

/// Which router serves a contender.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RouterKind {
    /// cache-aware-router (this project).
    Ours,
    /// A peer router.
    Peer(Peer),
    /// nginx as a plain round-robin reverse proxy (see [`nginx_config`]): the
    /// baseline of what proxying alone costs.
    Nginx,
}

impl RouterKind {
    /// `cache-aware-router`, `sglang-router`, `vllm-router`, `nginx`.
    pub fn name(self) -> &'static str {
        match self {
            RouterKind::Ours => "cache-aware-router",
            RouterKind::Peer(p) => p.name(),
            RouterKind::Nginx => "nginx",
        }
    }
}

/// The nginx.conf of [`RouterKind::Nginx`]: a plain round-robin reverse proxy on
/// 127.0.0.1:`port` in front of `workers` (`http://host:port` URLs), everything
/// it writes (pid, temp files, the access log when `access_log`) under `dir`, its
/// error log (level `warn`) to stderr. As nginx is usually run: `worker_processes
/// auto` (one per core), the default round robin of an `upstream` block, the
/// default `combined` access log format; for proxying LLM answers: an upstream keep-alive pool (`keepalive 64`,
/// HTTP/1.1, `Connection` cleared), `proxy_buffering off` (streams pass as they
/// come) and `proxy_request_buffering off`, bodies up to 64 MiB. Set above the
/// defaults so that the load decides, not a limit: `worker_connections 4096`
/// (default 512) and `keepalive_requests 1000000` on both sides (default 1000,
/// after which nginx closes a keep-alive connection and the closed-loop clients
/// would count that as an error).
pub fn nginx_config(port: u16, workers: &[String], dir: &Path, access_log: bool) -> String {
    let servers: String = workers
        .iter()
        .map(|w| {
            let hostport = w.trim_start_matches("http://").trim_end_matches('/');
            format!("        server {hostport};\n")
        })
        .collect();
    let access = if access_log {
        "access_log DIR/access.log;"
    } else {
        "access_log off;"
    };
    NGINX_CONF
        .replace("ACCESS_LOG", access)
        .replace("        SERVERS\n", &servers)
        .replace("PORT", &port.to_string())
        .replace("DIR", &dir.display().to_string())
}

/// [`nginx_config`]'s template.
const NGINX_CONF: &str = r#"worker_processes auto;
daemon off;
master_process on;
pid DIR/nginx.pid;
error_log stderr warn;
worker_rlimit_nofile 65536;
events {
    worker_connections 4096;
}
http {
    ACCESS_LOG
    client_body_temp_path DIR/client_body;
    proxy_temp_path DIR/proxy;
    fastcgi_temp_path DIR/fastcgi;
    uwsgi_temp_path DIR/uwsgi;
    scgi_temp_path DIR/scgi;
    keepalive_requests 1000000;
    upstream engines {
        SERVERS
        keepalive 64;
        keepalive_requests 1000000;
    }
    server {
        listen 127.0.0.1:PORT;
        client_max_body_size 64m;
        location / {
            proxy_pass http://engines;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
        }
    }
}
"#;

/// A router process started by [`start_any_router`].
#[derive(Debug)]
pub struct StartedRouter {
    /// Base URL on 127.0.0.1.
    pub url: String,
    /// OS process id.
    pub pid: u32,
    /// How it was run (command line; for ours also the config).
    pub how: String,
    /// Holds its log (and config); removed on drop.
    pub dir: ScratchDir,
}

impl StartedRouter {
    /// The last lines of its log.
    pub fn log_tail(&self, lines: usize) -> String {
        tail(&self.dir.path().join("router.log"), lines)
    }
}

/// The 1-token chat request used to tell that a router routes (see
/// [`procs::start_router_command`]): too short to fill one KV block.
pub fn probe_body(model: &str) -> Bytes {
    Bytes::from(
        serde_json::json!({
            "model": model,
            "messages": [{"role": "user", "content": "ping"}],
            "max_tokens": 1,
        })
        .to_string(),
    )
}

/// Starts `kind` with `policy` in front of `workers` on 127.0.0.1:`port` and waits
/// until it answers `GET /health` and a probe chat request ([`probe_body`]) with
/// 2xx. Ours gets [`router_config`] plus `extra_yaml` (a `log:` line there
/// replaces the default one); a peer gets [`Peer::command`]; nginx (which ignores
/// `policy`: round robin) gets [`nginx_config`] and is stopped with SIGTERM to its
/// master and workers. The child is pushed onto `procs`.
#[allow(clippy::too_many_arguments)]
pub async fn start_any_router(
    kind: RouterKind,
    policy: &str,
    router_bin: &Path,
    peers: &PeerSetup,
    workers: &[String],
    port: u16,
    extra_yaml: &str,
    model: &str,
    startup_timeout: Duration,
    procs: &mut Vec<ChildProc>,
) -> Result<StartedRouter, ProcError> {
    let dir = ScratchDir::new("router", &format!("{}-{policy}-{port}", kind.name()))?;
    let (spec, how) = match kind {
        RouterKind::Ours => {
            procs::require_binary(
                router_bin,
                "cache-aware-router",
                "build it with `cargo build --release --workspace` or pass --router-bin",
            )?;
            let (policy, variant) = policy_variant(policy).map_err(ProcError::NotReady)?;
            let mut yaml = router_config(policy, port, workers);
            // A `log:` entry of `extra_yaml` replaces the default one.
            if extra_yaml.lines().any(|l| l.starts_with("log:")) {
                yaml = yaml.replace(DEFAULT_LOG_YAML, "");
            }
            yaml.push_str(extra_yaml);
            let config_path = dir.path().join("config.yaml");
            std::fs::write(&config_path, &yaml)
                .map_err(io_err(format!("write {}", config_path.display())))?;
            let mut args = vec!["-c".into(), config_path.display().to_string()];
            // The variant's keys as a second, layered config file (merged key by key).
            if !variant.is_empty() {
                let path = dir.path().join("variant.yaml");
                std::fs::write(&path, &variant)
                    .map_err(io_err(format!("write {}", path.display())))?;
                args.extend(["-c".into(), path.display().to_string()]);
                yaml.push_str("--- layered on it ---\n");
                yaml.push_str(&variant);
            }
            let spec = RouterCommand {
                name: kind.name().into(),
                program: router_bin.to_path_buf(),
                args,
                env: Vec::new(),
                context: format!("--- its config ---\n{yaml}"),
                term_tree: false,
            };
            let how = format!(
                "`{} -c config.yaml` with config `{}`",
                router_bin.display(),
                yaml.trim_end()
                    .replace("\n  - url: ", " ")
                    .replace('\n', "; ")
            );
            (spec, how)
        }
        RouterKind::Peer(peer) => {
            let bin = peers.bin(peer);
            procs::require_binary(
                bin,
                peer.name(),
                "install the peers with `bench/peers/run.sh` (or pass --peer-venv / --sglang-bin / --vllm-bin)",
            )?;
            let spec = peer.command(bin, policy, port, workers, peers.log_level.as_deref());
            let how = format!("`{}`", spec.display_line());
            (spec, how)
        }
        RouterKind::Nginx => {
            procs::require_binary(
                &peers.nginx_bin,
                "nginx",
                "install the Debian package (`apt-get install nginx`) or pass --nginx-bin",
            )?;
            let conf = nginx_config(port, workers, dir.path(), peers.nginx_access_log);
            let conf_path = dir.path().join("nginx.conf");
            std::fs::write(&conf_path, &conf)
                .map_err(io_err(format!("write {}", conf_path.display())))?;
            let spec = RouterCommand {
                name: kind.name().into(),
                program: peers.nginx_bin.clone(),
                // `-e stderr`: the error log from the start, before the config is
                // read (else the compiled-in /var/log/nginx/error.log).
                args: vec![
                    "-p".into(),
                    dir.path().display().to_string(),
                    "-e".into(),
                    "stderr".into(),
                    "-c".into(),
                    conf_path.display().to_string(),
                ],
                env: Vec::new(),
                context: format!("--- its config ---\n{conf}"),
                term_tree: true,
            };
            let how = format!(
                "`{} -p DIR -e stderr -c DIR/nginx.conf` (master + workers), \
                 nginx.conf: `{}`",
                peers.nginx_bin.display(),
                conf.lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty() && !l.contains("_temp_path"))
                    .collect::<Vec<_>>()
                    .join(" ")
                    .replace(&dir.path().display().to_string(), "DIR")
            );
            (spec, how)
        }
    };
    let url = start_router_command(
        &spec,
        port,
        &dir,
        startup_timeout,
        Some(probe_body(model)),
        procs,
    )
    .await?;
    let pid = procs.last().and_then(ChildProc::pid).ok_or_else(|| {
        ProcError::NotReady(format!("{} exited right after starting", kind.name()))
    })?;
    Ok(StartedRouter { url, pid, how, dir })
}

/// Our router's `routing_decisions_total` by reason and the bytes its tree aged out,
/// from `GET /metrics` (`cache_hit 1200, hit_overloaded 40, miss 760, tree aged out
/// 0.0 MB`), then its `GET /workers` prefix
/// token summary when it has one (`available 9.1M, predicted 7.9M (0.87), delivered
/// 5.2M (0.66)`); `None` if unreadable.
pub async fn routing_decisions(router_url: &str) -> Option<String> {
    let decisions = decision_counts(router_url).await?;
    let Some(hits) = get_body(&format!("{router_url}/workers"))
        .await
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| v.get("hits").cloned())
    else {
        return Some(decisions);
    };
    let n = |k: &str| hits[k].as_f64().unwrap_or(0.0);
    let m = |x: f64| format!("{:.2}M", x / 1e6);
    let share = |k: &str| hits[k].as_f64().map_or("-".into(), |x| format!("{x:.2}"));
    Some(format!(
        "{decisions}; prefix tokens available {}, predicted {} ({}), delivered {} ({})",
        m(n("available_tokens")),
        m(n("predicted_tokens")),
        share("routed_share"),
        m(n("delivered_tokens")),
        share("delivered_share"),
    ))
}

async fn decision_counts(router_url: &str) -> Option<String> {
    let body = get_body(&format!("{router_url}/metrics")).await?;
    let text = String::from_utf8_lossy(&body);
    // What the tree's learning removed (`cache.learn_evictions`), beside the decisions.
    let aged = text.lines().find_map(|l| {
        l.strip_prefix("cache_aware_router_tree_aged_out_bytes_total ")
            .and_then(|v| v.trim().parse::<f64>().ok())
    });
    let mut parts: Vec<String> = text
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("cache_aware_router_routing_decisions_total{")?;
            let (labels, value) = rest.split_once("} ")?;
            let reason = labels
                .split(',')
                .find_map(|kv| kv.strip_prefix("reason=\""))?
                .trim_end_matches('"');
            Some(format!("{reason} {}", value.trim()))
        })
        .collect();
    if let (false, Some(bytes)) = (parts.is_empty(), aged) {
        parts.push(format!("tree aged out {:.1} MB", bytes / 1e6));
    }
    (!parts.is_empty()).then(|| parts.join(", "))
}

/// The body of `GET url` when it answers 2xx within 5 s.
async fn get_body(url: &str) -> Option<Bytes> {
    use http_body_util::{BodyExt, Empty};
    use hyper_util::client::legacy::Client;
    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::rt::TokioExecutor;
    let uri: hyper::Uri = url.parse().ok()?;
    let client: Client<HttpConnector, Empty<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let call = async {
        let resp = client.get(uri).await.ok()?;
        if !resp.status().is_success() {
            return None;
        }
        resp.into_body().collect().await.ok().map(|b| b.to_bytes())
    };
    tokio::time::timeout(Duration::from_secs(5), call)
        .await
        .ok()?
}

/// Whether the engine at `engine_url` answers vLLM's render endpoint
/// (`POST /v1/chat/completions/render` with `token_ids`), which vllm-router's
/// `cache_aware` policy calls on every worker for every request to get the token
/// ids it matches on; without it vllm-router routes without a prefix match.
/// A short phrase for reports.
pub async fn render_status(engine_url: &str) -> String {
    use http_body_util::{BodyExt, Full};
    use hyper_util::client::legacy::Client;
    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::rt::TokioExecutor;
    let Ok(uri) = format!("{engine_url}/v1/chat/completions/render").parse::<hyper::Uri>() else {
        return "render endpoint: bad engine URL".into();
    };
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let body =
        Bytes::from_static(br#"{"model":"m","messages":[{"role":"user","content":"a b c"}]}"#);
    let Ok(req) = hyper::Request::post(uri)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(body))
    else {
        return "render endpoint: cannot build the request".into();
    };
    let call = async {
        let resp = client.request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok::<_, String>((status, bytes))
    };
    match tokio::time::timeout(Duration::from_secs(5), call).await {
        Ok(Ok((status, bytes))) if status.is_success() => {
            let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
            if v["token_ids"].as_array().is_some_and(|a| !a.is_empty()) {
                "engines answer POST /v1/chat/completions/render with token_ids".into()
            } else {
                "engines answer POST /v1/chat/completions/render WITHOUT token_ids: \
                 vllm-router's cache_aware cannot match prefixes"
                    .into()
            }
        }
        Ok(Ok((status, _))) => format!(
            "engines answer POST /v1/chat/completions/render with {status}: \
             vllm-router's cache_aware cannot match prefixes"
        ),
        Ok(Err(e)) => format!("render probe failed: {e}"),
        Err(_) => "render probe took over 5 s".into(),
    }
}

/// One column of the comparison.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Contender {
    /// Our router with this `policy:` value.
    Router(String),
    /// A peer router with this `--policy` value.
    Peer(Peer, String),
    /// No router: the replayer round-robins over the engines itself.
    Direct,
    /// No router, ONE engine whose cache holds the whole slice.
    Ideal,
    /// Several replicas of our router over the same engines.
    Replicas(Replicas),
}

/// N replicas of our router in front of the same engines, request `i` sent to replica
/// `i mod N` (`POLICY/N`, `POLICY/N/shared`, `POLICY/N/shared/kill`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replicas {
    /// Our `policy:` value.
    pub policy: String,
    /// Router processes, at least 2.
    pub n: usize,
    /// Whether they share routing state through one Redis (`state.redis_url`).
    pub shared: bool,
    /// Whether the last replica is killed (SIGKILL) when the middle request of the
    /// replay is due; the client then sends a request that found it gone, or whose
    /// stream it cut, to the next replica ([`ReplayConfig::failover`]).
    pub kill_one: bool,
}

impl Replicas {
    /// Parses `POLICY/N[/shared][/kill]`.
    pub fn parse(s: &str) -> Result<Replicas, String> {
        let mut parts = s.split('/').map(str::trim);
        let policy = parts.next().unwrap_or("");
        let n = parts.next().and_then(|n| n.parse::<usize>().ok());
        let (Some(n), false) = (n.filter(|&n| n >= 2), policy.is_empty()) else {
            return Err(format!(
                "bad replicas contender {s:?}: use POLICY/N[/shared][/kill], N >= 2"
            ));
        };
        let mut r = Replicas {
            policy: policy.into(),
            n,
            shared: false,
            kill_one: false,
        };
        for flag in parts {
            match flag {
                "shared" => r.shared = true,
                "kill" => r.kill_one = true,
                _ => {
                    return Err(format!(
                        "bad replicas contender {s:?}: {flag:?} is neither `shared` nor `kill`"
                    ));
                }
            }
        }
        Ok(r)
    }
}

impl Contender {
    /// Parses one entry of a contender list: `direct`, `ideal`, `sglang:POLICY`,
    /// `vllm:POLICY`, or one of our policies.
    pub fn parse(s: &str) -> Result<Contender, String> {
        let s = s.trim();
        match s {
            "" => Err("empty contender".into()),
            "direct" => Ok(Contender::Direct),
            "ideal" => Ok(Contender::Ideal),
            _ => match s.split_once(':') {
                Some((peer, policy)) => match Peer::from_key(peer) {
                    Some(p) if !policy.is_empty() => Ok(Contender::Peer(p, policy.into())),
                    _ => Err(format!(
                        "unknown contender {s:?}: use sglang:POLICY or vllm:POLICY"
                    )),
                },
                None if s.contains('/') => {
                    let r = Replicas::parse(s)?;
                    policy_variant(&r.policy)?;
                    Ok(Contender::Replicas(r))
                }
                None => policy_variant(s).map(|_| Contender::Router(s.into())),
            },
        }
    }

    /// Table label: the policy name, `sglang-router POLICY`, `direct (no router)`,
    /// `ideal (1 engine, unbounded KV)`, `cache_aware ×2 shared, 1 killed halfway`.
    pub fn label(&self) -> String {
        match self {
            Contender::Router(p) => p.clone(),
            Contender::Peer(peer, p) => format!("{} {p}", peer.name()),
            Contender::Direct => "direct (no router)".into(),
            Contender::Ideal => "ideal (1 engine, unbounded KV)".into(),
            Contender::Replicas(r) => format!(
                "{} ×{} {}{}",
                r.policy,
                r.n,
                if r.shared { "shared" } else { "independent" },
                if r.kill_one { ", 1 killed halfway" } else { "" }
            ),
        }
    }

    /// The router serving it and its policy (`None`: no router).
    pub fn router(&self) -> Option<(RouterKind, &str)> {
        match self {
            Contender::Router(p) => Some((RouterKind::Ours, p)),
            Contender::Replicas(r) => Some((RouterKind::Ours, &r.policy)),
            Contender::Peer(peer, p) => Some((RouterKind::Peer(*peer), p)),
            Contender::Direct | Contender::Ideal => None,
        }
    }

    /// Router processes it runs (0: none).
    pub fn routers(&self) -> usize {
        match self {
            Contender::Replicas(r) => r.n,
            Contender::Router(_) | Contender::Peer(..) => 1,
            Contender::Direct | Contender::Ideal => 0,
        }
    }
}

/// Everything a matrix run needs besides the prepared requests.
#[derive(Debug, Clone)]
pub struct MatrixConfig {
    /// `sim-engine` executable.
    pub engine_bin: PathBuf,
    /// `cache-aware-router` executable.
    pub router_bin: PathBuf,
    /// Engines per contender.
    pub engines: usize,
    /// Engine settings.
    pub engine: EngineParams,
    /// Multiplier on trace timestamps.
    pub time_scale: f64,
    /// Most requests in flight during a replay.
    pub concurrency: usize,
    /// Per-request timeout.
    pub request_timeout: Duration,
    /// Longest wait for an engine to announce itself or the router to answer
    /// `GET /health` with 200.
    pub startup_timeout: Duration,
    /// Router on this port and engines on the next ones; `None`: free ports.
    pub base_port: Option<u16>,
    /// Where to write `<label>.jsonl` per-request results (`None`: nowhere).
    pub out_dir: Option<PathBuf>,
    /// Progress line interval during replays (`None`: silent).
    pub progress_every: Option<Duration>,
    /// Peer routers (for `Contender::Peer`).
    pub peers: PeerSetup,
    /// KV blocks of the `ideal` contender's one engine.
    pub ideal_kv_blocks: usize,
    /// Time factor of the `ideal` contender's engine (0 = it answers at once: one
    /// engine cannot keep up with the pool's load, and only its hit rate is used).
    pub ideal_time_factor: f64,
    /// YAML appended to our router's generated config (e.g. `cache: {...}`).
    pub router_extra_yaml: String,
    /// `redis-server` executable, for replicas that share state.
    pub redis_bin: PathBuf,
}

/// What the router process of a contender used, from `/proc` (its process tree).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RouterUsage {
    /// RSS once ready, before the replay, in KiB.
    pub idle_rss_kib: u64,
    /// Peak RSS (`VmHWM`) at the end of the replay, in KiB.
    pub peak_rss_kib: u64,
    /// CPU time (user + system) during the replay, in s.
    pub cpu_s: f64,
}

/// One contender's outcome.
#[derive(Debug, Clone, PartialEq)]
pub struct ContenderRun {
    /// The replay summary.
    pub summary: Summary,
    /// Router usage (`None` without a router).
    pub router: Option<RouterUsage>,
    /// How it was run: router command line or config, engine layout.
    pub how: String,
    /// CPU time other processes on the machine used during the replay.
    pub other_cpu: Option<procs::OtherCpu>,
    /// Router processes (0: none).
    pub routers: usize,
    /// What the replicas sent and received on the fleet channel during the replay
    /// (`None`: they share nothing).
    pub fleet: Option<FleetTraffic>,
    /// Time to first token of each successful request, in ms (for the picture).
    pub ttft_ms: Vec<f64>,
}

/// The fleet counters of one replica (`GET /workers` → `fleet`), or their sum over
/// replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FleetTraffic {
    /// Redis `PUBLISH`es made.
    pub messages_out: u64,
    /// Bytes in them.
    pub bytes_out: u64,
    /// Messages received from the other replicas.
    pub messages_in: u64,
    /// Bytes in them.
    pub bytes_in: u64,
    /// Prefix records dropped because the publisher fell behind.
    pub dropped: u64,
    /// Chunk hashes held from the other replicas (at the end; summed over replicas).
    pub remote_records: u64,
}

impl FleetTraffic {
    /// Reads `GET /workers` of our router at `router_url`; `None` if it has no fleet
    /// or does not answer.
    pub async fn read(router_url: &str) -> Option<FleetTraffic> {
        let body = get_body(&format!("{router_url}/workers")).await?;
        let v: serde_json::Value = serde_json::from_slice(&body).ok()?;
        let f = v.get("fleet")?;
        let n = |k: &str| f[k].as_u64().unwrap_or(0);
        Some(FleetTraffic {
            messages_out: n("messages_out"),
            bytes_out: n("bytes_out"),
            messages_in: n("messages_in"),
            bytes_in: n("bytes_in"),
            dropped: n("dropped"),
            remote_records: n("remote_records"),
        })
    }

    /// The counters' growth from `before` to `self` (`remote_records` is `self`'s).
    pub fn since(self, before: FleetTraffic) -> FleetTraffic {
        FleetTraffic {
            messages_out: self.messages_out.saturating_sub(before.messages_out),
            bytes_out: self.bytes_out.saturating_sub(before.bytes_out),
            messages_in: self.messages_in.saturating_sub(before.messages_in),
            bytes_in: self.bytes_in.saturating_sub(before.bytes_in),
            dropped: self.dropped.saturating_sub(before.dropped),
            remote_records: self.remote_records,
        }
    }

    /// Field by field sum.
    pub fn plus(self, o: FleetTraffic) -> FleetTraffic {
        FleetTraffic {
            messages_out: self.messages_out + o.messages_out,
            bytes_out: self.bytes_out + o.bytes_out,
            messages_in: self.messages_in + o.messages_in,
            bytes_in: self.bytes_in + o.bytes_in,
            dropped: self.dropped + o.dropped,
            remote_records: self.remote_records + o.remote_records,
        }
    }
}

/// Waits until every router in `urls` says in `GET /workers` that it is subscribed to
/// the fleet channel (a message published before a replica subscribes never reaches it).
async fn wait_fleet_connected(urls: &[String], timeout: Duration) -> Result<(), ProcError> {
    let deadline = tokio::time::Instant::now() + timeout;
    for url in urls {
        loop {
            let body = get_body(&format!("{url}/workers")).await;
            let connected = body
                .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
                .and_then(|v| v["fleet"]["connected"].as_bool())
                .unwrap_or(false);
            if connected {
                break;
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(ProcError::NotReady(format!(
                    "{url} not subscribed to the fleet channel within {timeout:?}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    Ok(())
}

/// Why a contender could not be run to the end.
#[derive(Debug, thiserror::Error)]
pub enum MatrixError {
    /// A child process could not be started, or files or ports set up.
    #[error(transparent)]
    Proc(#[from] ProcError),
    /// The replay could not start.
    #[error(transparent)]
    Replay(#[from] ReplayError),
    /// The run was interrupted (Ctrl-C).
    #[error("interrupted")]
    Interrupted,
}

/// Names of the engines of a contender: `e0`, `e1`, ...
pub fn engine_names(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("e{i}")).collect()
}

/// Splits one of our contenders' policy value, `POLICY[+SECTION.KEY=VALUE]...`
/// (`cache_aware+cache.learn_evictions=true`), into the policy and the YAML of its
/// variant keys (empty without any), which the router gets as a second `-c` file.
pub fn policy_variant(spec: &str) -> Result<(&str, String), String> {
    let mut parts = spec.split('+');
    let policy = parts.next().unwrap_or_default();
    let mut sections: Vec<(&str, Vec<(&str, &str)>)> = Vec::new();
    for part in parts {
        let bad = || format!("bad variant {part:?} in {spec:?}: use +SECTION.KEY=VALUE");
        let (path, value) = part.split_once('=').ok_or_else(bad)?;
        let (section, key) = path.split_once('.').ok_or_else(bad)?;
        if section.is_empty() || key.is_empty() || key.contains('.') || value.is_empty() {
            return Err(bad());
        }
        match sections.iter_mut().find(|(s, _)| *s == section) {
            Some((_, keys)) => keys.push((key, value)),
            None => sections.push((section, vec![(key, value)])),
        }
    }
    let mut yaml = String::new();
    for (section, keys) in sections {
        let _ = writeln!(yaml, "{section}:");
        for (key, value) in keys {
            let _ = writeln!(yaml, "  {key}: {value}");
        }
    }
    Ok((policy, yaml))
}

/// The router config the demo writes (keys per the design doc).
pub fn router_config(policy: &str, port: u16, workers: &[String]) -> String {
    let mut y =
        format!("policy: {policy}\nserver: {{ host: 127.0.0.1, port: {port} }}\nworkers:\n");
    for w in workers {
        let _ = writeln!(y, "  - url: {w}");
    }
    y.push_str(DEFAULT_LOG_YAML);
    y
}

/// The `log:` line of [`router_config`]: no line per request.
const DEFAULT_LOG_YAML: &str = "log: { level: warn }\n";

/// Runs one contender from cold start to teardown and returns its summary.
/// All children it started are killed and reaped before it returns, on every
/// path, including when `interrupt` completes first ([`MatrixError::Interrupted`]).
pub async fn run_contender(
    cfg: &MatrixConfig,
    contender: &Contender,
    requests: &[PreparedRequest],
    interrupt: impl Future<Output = ()>,
) -> Result<Summary, MatrixError> {
    run_contender_measured(cfg, contender, requests, interrupt)
        .await
        .map(|r| r.summary)
}

/// [`run_contender`], also returning the router's CPU and memory and how the
/// contender was run.
pub async fn run_contender_measured(
    cfg: &MatrixConfig,
    contender: &Contender,
    requests: &[PreparedRequest],
    interrupt: impl Future<Output = ()>,
) -> Result<ContenderRun, MatrixError> {
    let mut procs = Vec::new();
    let result = tokio::select! {
        r = run_contender_inner(cfg, contender, requests, &mut procs) => r,
        () = interrupt => Err(MatrixError::Interrupted),
    };
    procs::stop_all(procs).await;
    result
}

async fn run_contender_inner(
    cfg: &MatrixConfig,
    contender: &Contender,
    requests: &[PreparedRequest],
    procs: &mut Vec<ChildProc>,
) -> Result<ContenderRun, MatrixError> {
    procs::require_binary(
        &cfg.engine_bin,
        "sim-engine",
        "build it with `cargo build --release -p bench` or pass --engine-bin",
    )?;
    let label = contender.label();
    let (names, engine) = if *contender == Contender::Ideal {
        let engine = EngineParams {
            kv_blocks: cfg.ideal_kv_blocks,
            time_factor: cfg.ideal_time_factor,
            ..cfg.engine.clone()
        };
        (vec!["ideal".to_string()], engine)
    } else {
        (engine_names(cfg.engines), cfg.engine.clone())
    };
    let mut urls = Vec::with_capacity(names.len());
    for (i, name) in names.iter().enumerate() {
        let port = cfg.base_port.map_or(0, |b| b.saturating_add(1 + i as u16));
        urls.push(
            start_engine(
                &cfg.engine_bin,
                &engine,
                name,
                port,
                cfg.startup_timeout,
                procs,
            )
            .await?,
        );
    }
    let engines_how = format!(
        "{} engine{} × {} KV blocks, time factor {}",
        names.len(),
        if names.len() == 1 { "" } else { "s" },
        engine.kv_blocks,
        engine.time_factor
    );
    let replicas = match contender {
        Contender::Replicas(r) => Some(r),
        _ => None,
    };
    let mut routers: Vec<StartedRouter> = Vec::new();
    let mut redis = None;
    // Lives as long as the row's redis-server (its working directory and log).
    let mut _redis_dir = None;
    if let Some((kind, policy)) = contender.router() {
        let mut extra = cfg.router_extra_yaml.clone();
        if replicas.is_some_and(|r| r.shared) {
            let dir = ScratchDir::new("redis", "trace-matrix")?;
            let port = procs::start_redis(&cfg.redis_bin, &dir, cfg.startup_timeout, procs).await?;
            let url = format!("redis://127.0.0.1:{port}/");
            _redis_dir = Some(dir);
            let _ = writeln!(
                extra,
                "state: {{ redis_url: \"{url}\", namespace: trace-matrix }}"
            );
            redis = Some(url);
        }
        for k in 0..contender.routers() {
            let port = match cfg.base_port {
                Some(p) if k == 0 => p,
                _ => free_port()?,
            };
            let r = start_any_router(
                kind,
                policy,
                &cfg.router_bin,
                &cfg.peers,
                &urls,
                port,
                &extra,
                &cfg.engine.model,
                cfg.startup_timeout,
                procs,
            )
            .await?;
            routers.push(r);
        }
    }
    let router_urls: Vec<String> = routers.iter().map(|r| r.url.clone()).collect();
    if redis.is_some() {
        wait_fleet_connected(&router_urls, cfg.startup_timeout).await?;
    }
    let targets = if routers.is_empty() {
        urls.clone()
    } else {
        router_urls.clone()
    };
    let router = routers.first();
    // With `kill`: the last replica (the last child started) goes when the middle
    // request is due.
    let first_ts = requests.iter().map(|r| r.timestamp_ms).min().unwrap_or(0);
    let kill_at = replicas.filter(|r| r.kill_one).map(|_| {
        let mid = &requests[requests.len() / 2];
        let offset_s = mid.timestamp_ms.saturating_sub(first_ts) as f64 / 1000.0 * cfg.time_scale;
        (
            mid.index,
            Duration::try_from_secs_f64(offset_s).unwrap_or(Duration::ZERO),
        )
    });
    let mut how = match router {
        Some(r) if matches!(contender, Contender::Peer(Peer::Vllm, _)) => {
            format!(
                "{}; {engines_how}; {}",
                r.how,
                render_status(&urls[0]).await
            )
        }
        Some(r) => format!("{}; {engines_how}", r.how),
        None if *contender == Contender::Ideal => {
            format!("no router, every request to the one engine; {engines_how}")
        }
        None => format!("no router, client round robin; {engines_how}"),
    };
    if let Some(r) = replicas {
        how = format!(
            "{} replicas of our router on ports {}, request i sent to replica i mod {}{}{}; \
             each {how}; router CPU and RSS are replica 1's",
            r.n,
            router_urls
                .iter()
                .map(|u| u.rsplit(':').next().unwrap_or(""))
                .collect::<Vec<_>>()
                .join(", "),
            r.n,
            match &redis {
                Some(u) => format!(
                    ", sharing state through `redis-server --save \"\" --appendonly no` at {u}"
                ),
                None => ", each with its own state".into(),
            },
            match kill_at {
                Some((i, at)) => format!(
                    "; replica {} killed (SIGKILL) when request {i} of {} was due ({:.1} s in), \
                     and the client sends a request that finds it gone, or whose stream it cuts, \
                     once more to the next replica",
                    r.n,
                    requests.len(),
                    at.as_secs_f64()
                ),
                None => String::new(),
            }
        );
    }
    let replay_cfg = ReplayConfig {
        urls: targets,
        time_scale: cfg.time_scale,
        concurrency: cfg.concurrency,
        request_timeout: cfg.request_timeout,
        progress_every: cfg.progress_every,
        failover: kill_at.is_some(),
    };
    let mut fleet_before = Vec::new();
    if redis.is_some() {
        for u in &router_urls {
            fleet_before.push(FleetTraffic::read(u).await.unwrap_or_default());
        }
    }
    let before = router.map(|r| procs::tree_usage(r.pid).unwrap_or_default());
    let watch = procs::Disturbance::start(procs.iter().filter_map(ChildProc::pid).collect());
    let victim = match (kill_at, router_urls.last()) {
        (Some((_, at)), Some(url)) => procs.pop().map(|p| (p, at, url.clone())),
        _ => None,
    };
    // The victim's counters and decisions are read just before it goes.
    let kill = async move {
        let (p, at, url) = victim?;
        tokio::time::sleep(at).await;
        let last = (
            FleetTraffic::read(&url).await,
            routing_decisions(&url).await,
        );
        p.stop().await;
        Some(last)
    };
    let sampler = QueueSampler::start(&names, &urls, QUEUE_SAMPLE_EVERY);
    let (results, killed) = tokio::join!(replay::run(requests, &replay_cfg), kill);
    let results = results?;
    let queue = sampler.finish().await;
    let other_cpu = watch.finish();
    let ours = matches!(contender.router(), Some((RouterKind::Ours, _)));
    let mut decisions = Vec::new();
    let mut fleet = (!fleet_before.is_empty()).then(FleetTraffic::default);
    for (k, r) in routers.iter().enumerate() {
        let gone = killed.as_ref().filter(|_| k + 1 == routers.len());
        if ours {
            let d = match gone {
                Some((_, d)) => d
                    .clone()
                    .map(|d| format!("{d} (read before it was killed)")),
                None => routing_decisions(&r.url).await,
            };
            decisions.push(d.unwrap_or_else(|| "unreadable".into()));
        }
        if let (Some(total), Some(b)) = (fleet.as_mut(), fleet_before.get(k)) {
            let after = match gone {
                Some((f, _)) => *f,
                None => FleetTraffic::read(&r.url).await,
            };
            *total = total.plus(after.unwrap_or_default().since(*b));
        }
    }
    let usage = match (router, before) {
        (Some(r), Some(b)) => {
            let a = procs::tree_usage(r.pid).unwrap_or_default();
            let tick = procs::clock_ticks_per_sec() as f64;
            Some(RouterUsage {
                idle_rss_kib: b.rss_kib,
                peak_rss_kib: a.hwm_kib,
                cpu_s: a.cpu_ticks.saturating_sub(b.cpu_ticks) as f64 / tick,
            })
        }
        _ => None,
    };
    let how = match decisions.len() {
        0 => how,
        1 => format!("{how}; routing decisions (its /metrics): {}", decisions[0]),
        _ => format!(
            "{how}; routing decisions (their /metrics): {}",
            decisions
                .iter()
                .enumerate()
                .map(|(k, d)| format!("replica {}: {d}", k + 1))
                .collect::<Vec<_>>()
                .join("; ")
        ),
    };
    if let Some(out) = &cfg.out_dir {
        write_results(out, &label, &results)?;
    }
    let mut summary = summarize(&results, &names);
    summary.queue = Some(queue);
    if summary.errors > 0
        && let Some(r) = router
    {
        eprintln!("router log tail ({label}):\n{}", r.log_tail(20));
    }
    Ok(ContenderRun {
        summary,
        router: usage,
        how,
        other_cpu,
        routers: contender.routers(),
        fleet,
        ttft_ms: results
            .iter()
            .filter(|r| r.is_ok())
            .filter_map(|r| r.ttft_ms)
            .collect(),
    })
}

/// Writes one JSON line per request to `dir/<label>.jsonl`.
pub fn write_results(
    dir: &Path,
    label: &str,
    results: &[RequestResult],
) -> Result<(), MatrixError> {
    std::fs::create_dir_all(dir).map_err(io_err(format!("create {}", dir.display())))?;
    let name: String = label
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let path = dir.join(format!("{name}.jsonl"));
    let mut text = String::new();
    for r in results {
        text.push_str(&serde_json::to_string(r).unwrap_or_default());
        text.push('\n');
    }
    std::fs::write(&path, text).map_err(io_err(format!("write {}", path.display())))?;
    Ok(())
}

/// The comparison table (markdown), one row per contender. Hit rates are also
/// shown as a share of the `ideal` row's, when there is one. "longest queue" is
/// the most requests waiting for prefill on one engine ([`QueueStats::longest_queue`]),
/// "queued while idle" the share of queue samples in which an engine had ≥ 2
/// waiting while another had nothing waiting or running (– with one engine).
pub fn render_table(rows: &[(String, Result<ContenderRun, String>)]) -> String {
    let ideal_label = Contender::Ideal.label();
    let ideal = rows.iter().find_map(|(l, r)| match r {
        Ok(run) if *l == ideal_label && run.summary.hit_rate > 0.0 => Some(run.summary.hit_rate),
        _ => None,
    });
    let mut t = String::from(
        "| contender | requests | errors | hit rate | of ideal | TTFT p50 / p99 (ms) | end-to-end p50 / p99 (ms) | throughput (req/s, out tok/s) | max/mean req per worker | longest queue | queued while idle | router peak RSS | router CPU s |\n\
         | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    for (label, row) in rows {
        match row {
            Ok(run) => {
                let s = &run.summary;
                let of_ideal = ideal.map_or("–".to_string(), |i| {
                    format!("{:.0} %", 100.0 * s.hit_rate / i)
                });
                let timing = if *label == ideal_label {
                    "(reference) | (reference) | (reference)".to_string()
                } else {
                    format!(
                        "{:.0} / {:.0} | {:.0} / {:.0} | {:.1} req/s, {:.0} tok/s",
                        s.ttft_ms.p50,
                        s.ttft_ms.p99,
                        s.latency_ms.p50,
                        s.latency_ms.p99,
                        s.req_per_s,
                        s.out_tok_per_s,
                    )
                };
                let (rss, cpu) = match &run.router {
                    Some(u) => (
                        format!("{:.0} MiB", u.peak_rss_kib as f64 / 1024.0),
                        format!("{:.1}", u.cpu_s),
                    ),
                    None => ("–".into(), "–".into()),
                };
                let spread = if s.per_engine.len() > 1 {
                    format!("{:.2}", s.max_over_mean)
                } else {
                    "–".into()
                };
                let (longest, idle) = match &s.queue {
                    Some(q) => (
                        q.longest_queue().to_string(),
                        if q.engines.len() > 1 && q.samples > 0 {
                            format!("{:.1} %", 100.0 * q.queued_while_idle_share())
                        } else {
                            "–".into()
                        },
                    ),
                    None => ("–".into(), "–".into()),
                };
                let _ = writeln!(
                    t,
                    "| {label} | {} | {} | {:.3} | {of_ideal} | {timing} | {spread} | {longest} | {idle} | {rss} | {cpu} |",
                    s.requests, s.errors, s.hit_rate,
                );
            }
            Err(e) => {
                let first = e.lines().next().unwrap_or("");
                let _ = writeln!(
                    t,
                    "| {label} | – | – | – | – | – | – | – | – | – | – | – | failed: {first} |"
                );
            }
        }
    }
    t
}

/// The router-replicas table (markdown): one row per contender with a router, with
/// how many router processes it ran, the requests that got no answer (after the
/// client's one retry on the next replica), those retried, hit rate, TTFT, and the
/// fleet channel's traffic per request replayed: Redis `PUBLISH`es and their bytes
/// summed over the replicas (out), and what the replicas received (in).
pub fn render_fleet_table(rows: &[(String, Result<ContenderRun, String>)]) -> String {
    let mut t = String::from(
        "| contender | routers | requests | failed (no answer) | retried on the other replica | hit rate | TTFT p50 / p99 (ms) | Redis messages / request (out, in) | Redis bytes / request (out, in) |\n\
         | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    for (label, row) in rows {
        match row {
            Ok(run) if run.routers > 0 => {
                let s = &run.summary;
                let per = |x: u64, digits: usize| {
                    format!("{:.digits$}", x as f64 / s.requests.max(1) as f64)
                };
                let (msgs, bytes) = match &run.fleet {
                    Some(f) => (
                        format!("{}, {}", per(f.messages_out, 2), per(f.messages_in, 2)),
                        format!("{}, {}", per(f.bytes_out, 0), per(f.bytes_in, 0)),
                    ),
                    None => ("–".into(), "–".into()),
                };
                let _ = writeln!(
                    t,
                    "| {label} | {} | {} | {} | {} | {:.3} | {:.0} / {:.0} | {msgs} | {bytes} |",
                    run.routers,
                    s.requests,
                    s.errors,
                    s.retried,
                    s.hit_rate,
                    s.ttft_ms.p50,
                    s.ttft_ms.p99,
                );
            }
            Ok(_) => {}
            Err(e) => {
                let first = e.lines().next().unwrap_or("");
                let _ = writeln!(
                    t,
                    "| {label} | – | – | – | – | – | – | – | failed: {first} |"
                );
            }
        }
    }
    t
}

/// The fleet targets: each sharing row's hit rate within 0.01 of the one-router row of
/// the same policy, beside the independent replicas' figure, and the failures of a row
/// with a replica killed. One line per sharing row; empty without the rows needed.
pub fn check_fleet(
    rows: &[(String, Result<ContenderRun, String>)],
    contenders: &[Contender],
) -> String {
    let summary = |want: &dyn Fn(&Contender) -> bool| {
        contenders.iter().zip(rows).find_map(|(c, (_, r))| match r {
            Ok(run) if want(c) => Some(&run.summary),
            _ => None,
        })
    };
    let mut out = String::new();
    for (c, (label, row)) in contenders.iter().zip(rows) {
        let (Contender::Replicas(r), Ok(run)) = (c, row) else {
            continue;
        };
        if !r.shared {
            continue;
        }
        let Some(one) = summary(&|x| *x == Contender::Router(r.policy.clone())) else {
            continue;
        };
        let independent = summary(
            &|x| matches!(x, Contender::Replicas(o) if o.policy == r.policy && o.n == r.n && !o.shared && !o.kill_one),
        );
        let s = &run.summary;
        let close = (s.hit_rate - one.hit_rate).abs() <= 0.01;
        let _ = writeln!(
            out,
            "- {label}: hit rate {:.3} vs one router's {:.3} (within 0.01: {}){}{}",
            s.hit_rate,
            one.hit_rate,
            if close { "met" } else { "**MISSED**" },
            independent.map_or(String::new(), |i| format!(
                "; {} independent replicas: {:.3}",
                r.n, i.hit_rate
            )),
            if r.kill_one {
                format!(
                    "; {} of {} requests failed (no answer), {} retried on the other replica",
                    s.errors, s.requests, s.retried
                )
            } else {
                String::new()
            }
        );
    }
    out
}

/// The replay targets, checked for our `cache_aware` row against the peers'
/// rows and the `ideal` row: hit rate ≥ the best peer's, ≥ 90 % of the ideal's,
/// max/mean requests per worker ≤ 1.2. One line per target; empty when the rows
/// needed are missing.
pub fn check_targets(rows: &[(String, Result<ContenderRun, String>)], ours: &str) -> String {
    let ok = |label: &str| {
        rows.iter().find_map(|(l, r)| match r {
            Ok(run) if l == label => Some(&run.summary),
            _ => None,
        })
    };
    let Some(us) = ok(ours) else {
        return String::new();
    };
    let mut out = String::new();
    let mark = |met: bool| if met { "met" } else { "**MISSED**" };
    let best_peer = rows
        .iter()
        .filter(|(l, _)| Peer::ALL.iter().any(|p| l.starts_with(p.name())))
        .filter_map(|(l, r)| r.as_ref().ok().map(|run| (l, run.summary.hit_rate)))
        .max_by(|a, b| a.1.total_cmp(&b.1));
    if let Some((l, h)) = best_peer {
        let _ = writeln!(
            out,
            "- hit rate ≥ best peer's: {:.3} vs {:.3} ({l}): {}",
            us.hit_rate,
            h,
            mark(us.hit_rate >= h)
        );
    }
    if let Some(ideal) = ok(&Contender::Ideal.label()) {
        let share = if ideal.hit_rate > 0.0 {
            us.hit_rate / ideal.hit_rate
        } else {
            0.0
        };
        let _ = writeln!(
            out,
            "- hit rate ≥ 90 % of the ideal's: {:.3} = {:.0} % of {:.3}: {}",
            us.hit_rate,
            share * 100.0,
            ideal.hit_rate,
            mark(share >= 0.9)
        );
    }
    let _ = writeln!(
        out,
        "- max/mean requests per worker ≤ 1.2: {:.2}: {}",
        us.max_over_mean,
        mark(us.max_over_mean <= 1.2)
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contenders_parse() {
        assert_eq!(Contender::parse("direct"), Ok(Contender::Direct));
        assert_eq!(Contender::parse(" ideal "), Ok(Contender::Ideal));
        assert_eq!(
            Contender::parse("sglang:cache_aware"),
            Ok(Contender::Peer(Peer::Sglang, "cache_aware".into()))
        );
        assert_eq!(
            Contender::parse("vllm-router:round_robin"),
            Ok(Contender::Peer(Peer::Vllm, "round_robin".into()))
        );
        assert_eq!(
            Contender::parse("least_load"),
            Ok(Contender::Router("least_load".into()))
        );
        assert!(Contender::parse("nginx:x").is_err());
        assert!(Contender::parse("vllm:").is_err());
        let r = |n, shared, kill_one| {
            Ok(Contender::Replicas(Replicas {
                policy: "cache_aware".into(),
                n,
                shared,
                kill_one,
            }))
        };
        assert_eq!(Contender::parse("cache_aware/2"), r(2, false, false));
        assert_eq!(Contender::parse("cache_aware/3/shared"), r(3, true, false));
        assert_eq!(
            Contender::parse("cache_aware/2/shared/kill"),
            r(2, true, true)
        );
        assert_eq!(
            Contender::parse("cache_aware/2/shared/kill")
                .unwrap()
                .label(),
            "cache_aware ×2 shared, 1 killed halfway"
        );
        for bad in [
            "cache_aware/1",
            "cache_aware/x",
            "/2",
            "cache_aware/2/sharde",
        ] {
            assert!(Contender::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn peer_commands_carry_only_what_they_need() {
        let w = [
            "http://127.0.0.1:1".to_string(),
            "http://127.0.0.1:2".into(),
        ];
        let s = Peer::Sglang.command(Path::new("/v/bin/smg"), "cache_aware", 7, &w, Some("warn"));
        assert_eq!(
            s.args.join(" "),
            "launch --host 127.0.0.1 --port 7 --policy cache_aware --log-level warn \
             --worker-urls http://127.0.0.1:1 http://127.0.0.1:2"
        );
        let v = Peer::Vllm.command(Path::new("/v/bin/vllm-router"), "cache_aware", 7, &w, None);
        assert_eq!(
            v.args.join(" "),
            "--host 127.0.0.1 --port 7 --policy cache_aware \
             --worker-urls http://127.0.0.1:1 http://127.0.0.1:2"
        );
        let v = Peer::Vllm.command(Path::new("/v/bin/vllm-router"), "x", 7, &w, Some("warn"));
        assert!(v.args.join(" ").contains("--log-level warning"));
        assert!(v.display_line().starts_with(
            "HF_ENDPOINT=http://127.0.0.1:9 HF_HUB_OFFLINE=1 /v/bin/vllm-router --host"
        ));
    }

    #[test]
    fn table_has_the_queue_columns() {
        let mut q = QueueStats::new(&engine_names(2));
        let l = |waiting, running| {
            Some(EngineLoad {
                waiting,
                running,
                waiting_peak: None,
            })
        };
        q.record(&[l(3, 1), l(0, 0)]);
        q.record(&[l(0, 1), l(0, 1)]);
        let run = ContenderRun {
            summary: Summary {
                requests: 10,
                queue: Some(q),
                ..Summary::default()
            },
            router: None,
            how: String::new(),
            other_cpu: None,
            routers: 1,
            fleet: None,
            ttft_ms: Vec::new(),
        };
        let t = render_table(&[
            ("least_load".into(), Ok(run)),
            ("cache_aware".into(), Err("boom".into())),
        ]);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].contains("| longest queue | queued while idle |"));
        let cells = |l: &str| l.split(" | ").count();
        assert!(lines.iter().all(|l| cells(l) == cells(lines[0])), "{t}");
        assert!(lines[2].contains("| 3 | 50.0 % |"), "{t}");
    }

    #[tokio::test]
    async fn sampler_sees_a_queue_next_to_an_idle_engine() {
        use crate::engine::{self, EngineConfig};
        let slow = engine::start(EngineConfig {
            ttft_base: Duration::from_millis(300),
            itl: Duration::ZERO,
            ..EngineConfig::default()
        })
        .await
        .unwrap();
        let idle = engine::start(EngineConfig::default()).await.unwrap();
        let names = engine_names(2);
        let sampler =
            QueueSampler::start(&names, &[slow.url(), idle.url()], Duration::from_millis(10));
        let client: hyper_util::client::legacy::Client<_, http_body_util::Full<Bytes>> =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build(hyper_util::client::legacy::connect::HttpConnector::new());
        let mut sent = Vec::new();
        for i in 0..3 {
            let req = hyper::Request::post(format!("{}/v1/completions", slow.url()))
                .header("content-type", "application/json")
                .body(http_body_util::Full::new(Bytes::from(format!(
                    r#"{{"prompt": "p{i}", "max_tokens": 1}}"#
                ))))
                .unwrap();
            sent.push(tokio::spawn(client.request(req)));
        }
        for _ in 0..2000 {
            if slow.engine().stats().waiting == 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let q = sampler.finish().await;
        assert!(q.samples >= 3, "{q:?}");
        assert!(q.queued_while_idle >= 1, "{q:?}");
        assert_eq!(q.peak_waiting, [2, 0], "{q:?}");
        for t in sent {
            t.abort();
        }
    }

    #[test]
    fn a_policy_variant_becomes_a_layered_config() {
        assert_eq!(
            policy_variant("cache_aware").unwrap(),
            ("cache_aware", String::new())
        );
        assert_eq!(
            policy_variant(
                "cost_aware+cache.learn_evictions=true+cache.threshold=0.5+proxy.max_retries=0"
            )
            .unwrap(),
            (
                "cost_aware",
                "cache:\n  learn_evictions: true\n  threshold: 0.5\nproxy:\n  max_retries: 0\n"
                    .into()
            )
        );
        for bad in ["p+cache", "p+cache.x", "p+.x=1", "p+cache.=1", "p+a.b.c=1"] {
            assert!(policy_variant(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn router_config_lists_workers_in_order() {
        let y = router_config(
            "round_robin",
            6700,
            &["http://127.0.0.1:1".into(), "http://127.0.0.1:2".into()],
        );
        assert_eq!(
            y,
            "policy: round_robin\nserver: { host: 127.0.0.1, port: 6700 }\nworkers:\n  \
             - url: http://127.0.0.1:1\n  - url: http://127.0.0.1:2\nlog: { level: warn }\n"
        );
    }

    #[test]
    fn nginx_config_is_a_plain_round_robin_proxy_with_keepalive_and_no_buffering() {
        let workers = ["http://127.0.0.1:1".into(), "http://127.0.0.1:2/".into()];
        let c = nginx_config(6700, &workers, Path::new("/tmp/x"), false);
        for line in [
            "worker_processes auto;",
            "daemon off;",
            "master_process on;",
            "pid /tmp/x/nginx.pid;",
            "error_log stderr warn;",
            "    access_log off;",
            "    upstream engines {\n        server 127.0.0.1:1;\n        server 127.0.0.1:2;\n        keepalive 64;",
            "        listen 127.0.0.1:6700;",
            "            proxy_pass http://engines;",
            "            proxy_http_version 1.1;",
            "            proxy_set_header Connection \"\";",
            "            proxy_buffering off;",
            "            proxy_request_buffering off;",
        ] {
            assert!(c.contains(line), "{line:?} not in:\n{c}");
        }
        assert!(!c.contains("DIR") && !c.contains("PORT") && !c.contains("SERVERS"));
        let logged = nginx_config(6700, &workers, Path::new("/tmp/x"), true);
        assert!(
            logged.contains("    access_log /tmp/x/access.log;"),
            "{logged}"
        );
    }
}

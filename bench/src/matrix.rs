//! The policy comparison: for each contender start fresh engines (and a router),
//! replay the same trace slice through it, stop everything, and tabulate.
//!
//! A contender is a router policy (`cache_aware`, `round_robin`, `least_load`, ...)
//! or `direct` (client-side round robin straight to the engines, no router).
//! Every contender starts from cold caches: new `sim-engine` processes, a new
//! router process with a generated config, free ports on 127.0.0.1.
//!
//! Child processes are owned by [`ChildProc`] values: stopped explicitly on the
//! normal and error paths, and killed on drop (`kill_on_drop`) if the future is
//! cancelled (Ctrl-C) or panics.

use std::fmt::Write as _;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Empty;
use hyper::Uri;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::time::Instant;

use crate::replay::{self, PreparedRequest, ReplayConfig, ReplayError, RequestResult};
use crate::stats::{Summary, summarize};

/// Router policies the demo compares by default, in table order.
pub const DEFAULT_POLICIES: [&str; 3] = ["cache_aware", "round_robin", "least_load"];

/// One column of the comparison.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Contender {
    /// The router with this `policy:` value.
    Router(String),
    /// No router: the replayer round-robins over the engines itself.
    Direct,
}

impl Contender {
    /// Table label: the policy name, or `direct (no router)`.
    pub fn label(&self) -> String {
        match self {
            Contender::Router(p) => p.clone(),
            Contender::Direct => "direct (no router)".into(),
        }
    }
}

/// Engine settings shared by every replica of every contender.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineParams {
    /// Prefix cache capacity per engine, in blocks.
    pub kv_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Fixed prefill cost, in simulated ms.
    pub ttft_base_ms: f64,
    /// Prefill cost per uncached token, in simulated µs.
    pub prefill_us_per_token: f64,
    /// Inter-token latency, in simulated ms.
    pub itl_ms: f64,
    /// Multiplier on every simulated time.
    pub time_factor: f64,
    /// Cap on generated tokens per request.
    pub max_output_tokens: u64,
    /// Served model id.
    pub model: String,
}

impl EngineParams {
    fn args(&self, name: &str, port: u16) -> Vec<String> {
        let mut a: Vec<String> = vec![
            "--host".into(),
            "127.0.0.1".into(),
            "--port".into(),
            port.to_string(),
            "--name".into(),
            name.into(),
        ];
        for (k, v) in [
            ("--kv-blocks", self.kv_blocks.to_string()),
            ("--block-size", self.block_size.to_string()),
            ("--ttft-base-ms", self.ttft_base_ms.to_string()),
            (
                "--prefill-us-per-token",
                self.prefill_us_per_token.to_string(),
            ),
            ("--itl-ms", self.itl_ms.to_string()),
            ("--time-factor", self.time_factor.to_string()),
            ("--max-output-tokens", self.max_output_tokens.to_string()),
            ("--model", self.model.clone()),
        ] {
            a.push(k.into());
            a.push(v);
        }
        a
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
}

/// Why a contender could not be run to the end.
#[derive(Debug, thiserror::Error)]
pub enum MatrixError {
    /// An executable is missing.
    #[error("{what} not found at {path} ({hint})")]
    MissingBinary {
        /// `sim-engine` or `cache-aware-router`.
        what: &'static str,
        /// Where it was looked for.
        path: String,
        /// How to get it.
        hint: &'static str,
    },
    /// A process could not be started.
    #[error("cannot start {path}: {source}")]
    Spawn {
        /// The executable.
        path: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A child did not become ready.
    #[error("{0}")]
    NotReady(String),
    /// Files or ports could not be set up.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The replay could not start.
    #[error(transparent)]
    Replay(#[from] ReplayError),
    /// The run was interrupted (Ctrl-C).
    #[error("interrupted")]
    Interrupted,
}

fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> MatrixError {
    let what = what.into();
    move |source| MatrixError::Io { what, source }
}

/// A started child process; [`ChildProc::stop`] kills and reaps it, and dropping
/// it kills it too.
#[derive(Debug)]
pub struct ChildProc {
    name: String,
    child: Child,
}

impl ChildProc {
    /// Kills the process and waits for it to exit.
    pub async fn stop(mut self) {
        let _ = self.child.start_kill();
        if tokio::time::timeout(Duration::from_secs(5), self.child.wait())
            .await
            .is_err()
        {
            eprintln!("warning: {} did not exit within 5 s of SIGKILL", self.name);
        }
    }
}

/// A scratch directory removed on drop.
#[derive(Debug)]
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn new(label: &str) -> Result<Self, MatrixError> {
        let safe: String = label
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        let dir = std::env::temp_dir().join(format!("trace-matrix-{}-{safe}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(io_err(format!("create {}", dir.display())))?;
        Ok(Self(dir))
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `name` next to the running executable (`sim-engine`, `cache-aware-router`).
pub fn sibling_binary(name: &str) -> PathBuf {
    let file = format!("{name}{}", std::env::consts::EXE_SUFFIX);
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join(&file)))
        .unwrap_or_else(|| PathBuf::from(file))
}

/// Names of the engines of a contender: `e0`, `e1`, ...
pub fn engine_names(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("e{i}")).collect()
}

/// A port that was free a moment ago on 127.0.0.1 (bind :0, read, release).
fn free_port() -> Result<u16, MatrixError> {
    let l = std::net::TcpListener::bind(("127.0.0.1", 0)).map_err(io_err("bind 127.0.0.1:0"))?;
    let port = l.local_addr().map_err(io_err("read bound port"))?.port();
    Ok(port)
}

async fn start_engine(
    cfg: &MatrixConfig,
    name: &str,
    port: u16,
    procs: &mut Vec<ChildProc>,
) -> Result<String, MatrixError> {
    let mut cmd = Command::new(&cfg.engine_bin);
    cmd.args(cfg.engine.args(name, port))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    let mut child = cmd.spawn().map_err(|source| MatrixError::Spawn {
        path: cfg.engine_bin.display().to_string(),
        source,
    })?;
    let stdout = child.stdout.take();
    procs.push(ChildProc {
        name: format!("sim-engine {name}"),
        child,
    });
    let Some(stdout) = stdout else {
        return Err(MatrixError::NotReady(format!(
            "sim-engine {name}: no stdout"
        )));
    };
    let mut lines = BufReader::new(stdout).lines();
    let first = tokio::time::timeout(cfg.startup_timeout, lines.next_line()).await;
    let line = match first {
        Ok(Ok(Some(line))) => line,
        Ok(_) => {
            return Err(MatrixError::NotReady(format!(
                "sim-engine {name} exited before announcing its address"
            )));
        }
        Err(_) => {
            return Err(MatrixError::NotReady(format!(
                "sim-engine {name} did not announce its address within {:?}",
                cfg.startup_timeout
            )));
        }
    };
    let url = line
        .split_once("listening on ")
        .map(|(_, u)| u.trim().to_string())
        .ok_or_else(|| {
            MatrixError::NotReady(format!("sim-engine {name}: unexpected first line {line:?}"))
        })?;
    // Keep draining stdout so the child never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok(url)
}

/// The router config the demo writes (keys per the design doc).
pub fn router_config(policy: &str, port: u16, workers: &[String]) -> String {
    let mut y =
        format!("policy: {policy}\nserver: {{ host: 127.0.0.1, port: {port} }}\nworkers:\n");
    for w in workers {
        let _ = writeln!(y, "  - url: {w}");
    }
    y.push_str("log: { level: warn }\n");
    y
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    let from = all.len().saturating_sub(lines);
    all[from..].join("\n")
}

async fn start_router(
    cfg: &MatrixConfig,
    policy: &str,
    port: u16,
    workers: &[String],
    dir: &ScratchDir,
    procs: &mut Vec<ChildProc>,
) -> Result<String, MatrixError> {
    let config_path = dir.0.join("config.yaml");
    let yaml = router_config(policy, port, workers);
    std::fs::write(&config_path, &yaml)
        .map_err(io_err(format!("write {}", config_path.display())))?;
    let log_path = dir.0.join("router.log");
    let log = std::fs::File::create(&log_path)
        .map_err(io_err(format!("create {}", log_path.display())))?;
    let log2 = log.try_clone().map_err(io_err("dup router log"))?;
    let mut cmd = Command::new(&cfg.router_bin);
    cmd.arg("-c")
        .arg(&config_path)
        .stdin(Stdio::null())
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(log2))
        .kill_on_drop(true);
    let child = cmd.spawn().map_err(|source| MatrixError::Spawn {
        path: cfg.router_bin.display().to_string(),
        source,
    })?;
    procs.push(ChildProc {
        name: "cache-aware-router".into(),
        child,
    });
    let url = format!("http://127.0.0.1:{port}");
    let health: Uri = format!("{url}/health")
        .parse()
        .map_err(|e| MatrixError::NotReady(format!("bad health URL: {e}")))?;
    let client: Client<HttpConnector, Empty<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let deadline = Instant::now() + cfg.startup_timeout;
    loop {
        if let Some(router) = procs.last_mut()
            && let Ok(Some(status)) = router.child.try_wait()
        {
            return Err(MatrixError::NotReady(format!(
                "router exited ({status}) before answering GET /health\n\
                 --- its config ---\n{yaml}--- its log (last 20 lines) ---\n{}",
                tail(&log_path, 20)
            )));
        }
        let last =
            match tokio::time::timeout(Duration::from_secs(1), client.get(health.clone())).await {
                Ok(Ok(resp)) if resp.status().is_success() => return Ok(url),
                Ok(Ok(resp)) => format!("GET /health answered {}", resp.status()),
                Ok(Err(e)) => format!("GET /health failed: {e}"),
                Err(_) => "GET /health took over 1 s".to_string(),
            };
        if Instant::now() >= deadline {
            return Err(MatrixError::NotReady(format!(
                "router not healthy within {:?} ({last})\n\
                 --- its config ---\n{yaml}--- its log (last 20 lines) ---\n{}",
                cfg.startup_timeout,
                tail(&log_path, 20)
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Runs one contender from cold start to teardown and returns its summary.
/// All children it started are killed and reaped before it returns, on every
/// path, including when `interrupt` completes first ([`MatrixError::Interrupted`]).
pub async fn run_contender(
    cfg: &MatrixConfig,
    contender: &Contender,
    requests: &[PreparedRequest],
    interrupt: impl Future<Output = ()>,
) -> Result<Summary, MatrixError> {
    let mut procs = Vec::new();
    let result = tokio::select! {
        r = run_contender_inner(cfg, contender, requests, &mut procs) => r,
        () = interrupt => Err(MatrixError::Interrupted),
    };
    for p in procs.into_iter().rev() {
        p.stop().await;
    }
    result
}

async fn run_contender_inner(
    cfg: &MatrixConfig,
    contender: &Contender,
    requests: &[PreparedRequest],
    procs: &mut Vec<ChildProc>,
) -> Result<Summary, MatrixError> {
    if !cfg.engine_bin.is_file() {
        return Err(MatrixError::MissingBinary {
            what: "sim-engine",
            path: cfg.engine_bin.display().to_string(),
            hint: "build it with `cargo build --release -p bench` or pass --engine-bin",
        });
    }
    if matches!(contender, Contender::Router(_)) && !cfg.router_bin.is_file() {
        return Err(MatrixError::MissingBinary {
            what: "cache-aware-router",
            path: cfg.router_bin.display().to_string(),
            hint: "build it with `cargo build --release --workspace` or pass --router-bin",
        });
    }
    let label = contender.label();
    let dir = ScratchDir::new(&label)?;
    let names = engine_names(cfg.engines);
    let mut urls = Vec::with_capacity(names.len());
    for (i, name) in names.iter().enumerate() {
        let port = cfg.base_port.map_or(0, |b| b.saturating_add(1 + i as u16));
        urls.push(start_engine(cfg, name, port, procs).await?);
    }
    let targets = match contender {
        Contender::Direct => urls.clone(),
        Contender::Router(policy) => {
            let port = match cfg.base_port {
                Some(p) => p,
                None => free_port()?,
            };
            vec![start_router(cfg, policy, port, &urls, &dir, procs).await?]
        }
    };
    let replay_cfg = ReplayConfig {
        urls: targets,
        time_scale: cfg.time_scale,
        concurrency: cfg.concurrency,
        request_timeout: cfg.request_timeout,
        progress_every: cfg.progress_every,
    };
    let results = replay::run(requests, &replay_cfg).await?;
    if let Some(out) = &cfg.out_dir {
        write_results(out, &label, &results)?;
    }
    let summary = summarize(&results, &names);
    if summary.errors > 0 && matches!(contender, Contender::Router(_)) {
        eprintln!(
            "router log tail ({label}):\n{}",
            tail(&dir.0.join("router.log"), 20)
        );
    }
    Ok(summary)
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
    std::fs::write(&path, text).map_err(io_err(format!("write {}", path.display())))
}

/// The comparison table (markdown), one row per contender.
pub fn render_table(rows: &[(String, Result<Summary, String>)]) -> String {
    let mut t = String::from(
        "| policy | requests | errors | hit rate | TTFT p50 / p99 (ms) | throughput (req/s, out tok/s) | max/mean req per worker |\n\
         | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    for (label, row) in rows {
        match row {
            Ok(s) => {
                let _ = writeln!(
                    t,
                    "| {label} | {} | {} | {:.3} | {:.0} / {:.0} | {:.1} req/s, {:.0} tok/s | {:.2} |",
                    s.requests,
                    s.errors,
                    s.hit_rate,
                    s.ttft_ms.p50,
                    s.ttft_ms.p99,
                    s.req_per_s,
                    s.out_tok_per_s,
                    s.max_over_mean
                );
            }
            Err(e) => {
                let first = e.lines().next().unwrap_or("");
                let _ = writeln!(t, "| {label} | – | – | – | – | – | failed: {first} |");
            }
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

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
}

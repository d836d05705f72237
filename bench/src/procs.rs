//! Child processes of the benchmark binaries: `sim-engine` replicas, the router and
//! `redis-server`, started on 127.0.0.1, waited for until ready, and killed on every
//! exit path; plus what `/proc` says about them (CPU time, resident memory).
//!
//! Child processes are owned by [`ChildProc`] values: stopped explicitly on the
//! normal and error paths, and killed on drop (`kill_on_drop`) if the future is
//! cancelled (Ctrl-C) or panics.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Uri;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::time::Instant;

/// Why a child could not be started or inspected.
#[derive(Debug, thiserror::Error)]
pub enum ProcError {
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
}

/// Maps an I/O error to [`ProcError::Io`] saying what was being done.
pub fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ProcError {
    let what = what.into();
    move |source| ProcError::Io { what, source }
}

/// A started child process; [`ChildProc::stop`] kills and reaps it, and dropping
/// it kills it too.
#[derive(Debug)]
pub struct ChildProc {
    name: String,
    child: Child,
    /// Stop it with SIGTERM to it and all its descendants first (see
    /// [`RouterCommand::term_tree`]).
    term_tree: bool,
}

impl ChildProc {
    /// The OS process id (`None` once reaped).
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// The name given at start (`sim-engine e0`, `cache-aware-router`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Sends `signal` (`HUP`, `KILL`, ...) to the process alone (with `kill`; this
    /// crate has no unsafe code); false if it has exited or the signal failed.
    pub fn signal(&mut self, signal: &str) -> bool {
        let Some(pid) = self.child.id() else {
            return false;
        };
        if !matches!(self.child.try_wait(), Ok(None)) {
            return false;
        }
        std::process::Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Kills the process and waits for it to exit. One started with
    /// [`RouterCommand::term_tree`] gets SIGTERM (it and its descendants) first and
    /// up to 5 s to exit by itself.
    pub async fn stop(mut self) {
        if self.term_tree && self.term_tree_now() {
            let exited = tokio::time::timeout(Duration::from_secs(5), self.child.wait()).await;
            if exited.is_ok() {
                return;
            }
            eprintln!("warning: {} did not exit within 5 s of SIGTERM", self.name);
        }
        let _ = self.child.start_kill();
        if tokio::time::timeout(Duration::from_secs(5), self.child.wait())
            .await
            .is_err()
        {
            eprintln!("warning: {} did not exit within 5 s of SIGKILL", self.name);
        }
    }

    /// Sends SIGTERM to the process and all its descendants (with `kill`; this crate
    /// has no unsafe code); false if it has exited already.
    fn term_tree_now(&mut self) -> bool {
        let Some(pid) = self.child.id() else {
            return false;
        };
        if !matches!(self.child.try_wait(), Ok(None)) {
            return false;
        }
        let pids: Vec<String> = process_tree(pid).iter().map(u32::to_string).collect();
        let _ = std::process::Command::new("kill")
            .arg("-TERM")
            .args(&pids)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        true
    }
}

impl Drop for ChildProc {
    /// A [`RouterCommand::term_tree`] child's descendants (nginx's workers) would
    /// outlive a SIGKILL of the parent alone: SIGTERM them all first; the parent is
    /// then killed by `kill_on_drop` as any other child.
    fn drop(&mut self) {
        if self.term_tree {
            self.term_tree_now();
        }
    }
}

/// Stops every child, last started first.
pub async fn stop_all(procs: Vec<ChildProc>) {
    for p in procs.into_iter().rev() {
        p.stop().await;
    }
}

/// A scratch directory removed on drop.
#[derive(Debug)]
pub struct ScratchDir(PathBuf);

impl ScratchDir {
    /// Creates `$TMPDIR/<prefix>-<pid>-<label>` (label reduced to `[A-Za-z0-9_]`).
    pub fn new(prefix: &str, label: &str) -> Result<Self, ProcError> {
        let safe: String = label
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        let dir = std::env::temp_dir().join(format!("{prefix}-{}-{safe}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(io_err(format!("create {}", dir.display())))?;
        Ok(Self(dir))
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
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

/// Fails with [`ProcError::MissingBinary`] unless `path` is a file.
pub fn require_binary(
    path: &Path,
    what: &'static str,
    hint: &'static str,
) -> Result<(), ProcError> {
    if path.is_file() {
        Ok(())
    } else {
        Err(ProcError::MissingBinary {
            what,
            path: path.display().to_string(),
            hint,
        })
    }
}

/// The `sim-engine` and `cache-aware-router` binaries beside this one
/// ([`sibling_binary`]), or what to build when one is missing.
pub fn engine_and_router_binaries() -> Result<(PathBuf, PathBuf), ProcError> {
    let hint = "cargo build -p bench --bin sim-engine && cargo build --bin cache-aware-router, \
                with --release when this binary is a release build";
    let engine = sibling_binary("sim-engine");
    let router = sibling_binary("cache-aware-router");
    require_binary(&engine, "sim-engine", hint)?;
    require_binary(&router, "cache-aware-router", hint)?;
    Ok((engine, router))
}

/// A port that was free a moment ago on 127.0.0.1 (bind :0, read, release).
pub fn free_port() -> Result<u16, ProcError> {
    let l = std::net::TcpListener::bind(("127.0.0.1", 0)).map_err(io_err("bind 127.0.0.1:0"))?;
    let port = l.local_addr().map_err(io_err("read bound port"))?.port();
    Ok(port)
}

/// `sim-engine` settings (its command-line flags).
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
    /// Metric names of `/metrics`: `vllm` or `sglang` (`--metrics-flavor`).
    pub metrics_flavor: crate::engine::MetricsFlavor,
    /// Most requests waiting for prefill before 429 (0 = unbounded; `--max-waiting`).
    pub max_waiting: usize,
    /// `Retry-After` of a 429, in whole seconds (`--retry-after-secs`).
    pub retry_after_secs: u64,
    /// How prefills share an engine (`--prefill-physics`).
    pub prefill_physics: crate::prefill::Physics,
    /// Prefills at once under the parallel and shared physics (`--prefill-slots`).
    pub prefill_slots: usize,
    /// Tokens per step under the chunked physics (`--max-batched-tokens`).
    pub max_batched_tokens: usize,
    /// `--kv-connector`: `none` or `nixl`.
    pub kv_connector: crate::engine::KvConnector,
    /// Fixed cost of reading a handed-over prompt's KV, in simulated ms.
    pub kv_transfer_base_ms: f64,
    /// Cost per token of KV read, in simulated µs.
    pub kv_transfer_us_per_token: f64,
    /// A stalled request's first token held back this long, in simulated ms
    /// (`--stall-first-token-ms`).
    pub stall_first_token_ms: f64,
    /// Share of the requests that stall, 0 to 1 (`--stall-share`).
    pub stall_share: f64,
}

impl Default for EngineParams {
    /// `sim-engine`'s own defaults.
    fn default() -> Self {
        let e = crate::engine::EngineConfig::default();
        Self {
            kv_blocks: e.kv_blocks,
            block_size: e.block_size,
            ttft_base_ms: e.ttft_base.as_secs_f64() * 1e3,
            prefill_us_per_token: e.prefill_per_token.as_secs_f64() * 1e6,
            itl_ms: e.itl.as_secs_f64() * 1e3,
            time_factor: e.time_factor,
            max_output_tokens: e.max_output_tokens,
            model: e.model,
            metrics_flavor: e.metrics_flavor,
            max_waiting: e.max_waiting,
            retry_after_secs: e.retry_after_secs,
            prefill_physics: e.prefill_physics,
            prefill_slots: e.prefill_slots,
            max_batched_tokens: e.max_batched_tokens,
            kv_connector: e.kv_connector,
            kv_transfer_base_ms: e.kv_transfer_base.as_secs_f64() * 1e3,
            kv_transfer_us_per_token: e.kv_transfer_per_token.as_secs_f64() * 1e6,
            stall_first_token_ms: e.stall_first_token.as_secs_f64() * 1e3,
            stall_share: e.stall_share,
        }
    }
}

impl EngineParams {
    /// The `sim-engine` arguments for replica `name` on 127.0.0.1:`port` (0 = any).
    pub fn args(&self, name: &str, port: u16) -> Vec<String> {
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
            ("--metrics-flavor", self.metrics_flavor.to_string()),
            ("--max-waiting", self.max_waiting.to_string()),
            ("--retry-after-secs", self.retry_after_secs.to_string()),
            ("--prefill-physics", self.prefill_physics.to_string()),
            ("--prefill-slots", self.prefill_slots.to_string()),
            ("--max-batched-tokens", self.max_batched_tokens.to_string()),
            ("--kv-connector", self.kv_connector.to_string()),
            (
                "--kv-transfer-base-ms",
                self.kv_transfer_base_ms.to_string(),
            ),
            (
                "--kv-transfer-us-per-token",
                self.kv_transfer_us_per_token.to_string(),
            ),
            (
                "--stall-first-token-ms",
                self.stall_first_token_ms.to_string(),
            ),
            ("--stall-share", self.stall_share.to_string()),
        ] {
            a.push(k.into());
            a.push(v);
        }
        a
    }
}

/// Starts `sim-engine` replica `name` on `port` (0 = any free port), waits for the
/// line announcing its address, and returns its base URL. The child is pushed onto
/// `procs` before waiting, so it is stopped with the others on failure.
pub async fn start_engine(
    engine_bin: &Path,
    params: &EngineParams,
    name: &str,
    port: u16,
    startup_timeout: Duration,
    procs: &mut Vec<ChildProc>,
) -> Result<String, ProcError> {
    let mut cmd = Command::new(engine_bin);
    cmd.args(params.args(name, port))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    let mut child = cmd.spawn().map_err(|source| ProcError::Spawn {
        path: engine_bin.display().to_string(),
        source,
    })?;
    let stdout = child.stdout.take();
    procs.push(ChildProc {
        name: format!("sim-engine {name}"),
        child,
        term_tree: false,
    });
    let Some(stdout) = stdout else {
        return Err(ProcError::NotReady(format!("sim-engine {name}: no stdout")));
    };
    let mut lines = BufReader::new(stdout).lines();
    let first = tokio::time::timeout(startup_timeout, lines.next_line()).await;
    let line = match first {
        Ok(Ok(Some(line))) => line,
        Ok(_) => {
            return Err(ProcError::NotReady(format!(
                "sim-engine {name} exited before announcing its address"
            )));
        }
        Err(_) => {
            return Err(ProcError::NotReady(format!(
                "sim-engine {name} did not announce its address within {startup_timeout:?}"
            )));
        }
    };
    let url = line
        .split_once("listening on ")
        .map(|(_, u)| u.trim().to_string())
        .ok_or_else(|| {
            ProcError::NotReady(format!("sim-engine {name}: unexpected first line {line:?}"))
        })?;
    // Keep draining stdout so the child never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok(url)
}

/// Starts `redis-server` (`bin`) on a free port of 127.0.0.1 with no persistence
/// (`--save "" --appendonly no`, working directory `dir`, output to
/// `dir/redis.log`) and waits until it answers `PING`. Returns the port. The child
/// is pushed onto `procs` first, so it is stopped with the others on failure.
pub async fn start_redis(
    bin: &Path,
    dir: &ScratchDir,
    startup_timeout: Duration,
    procs: &mut Vec<ChildProc>,
) -> Result<u16, ProcError> {
    start_redis_on(bin, dir, free_port()?, startup_timeout, procs).await
}

/// [`start_redis`] on `port` (a Redis started again where it was).
pub async fn start_redis_on(
    bin: &Path,
    dir: &ScratchDir,
    port: u16,
    startup_timeout: Duration,
    procs: &mut Vec<ChildProc>,
) -> Result<u16, ProcError> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let log_path = dir.0.join("redis.log");
    let log = std::fs::File::create(&log_path)
        .map_err(io_err(format!("create {}", log_path.display())))?;
    let log2 = log.try_clone().map_err(io_err("dup redis log"))?;
    let mut cmd = Command::new(bin);
    cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(&dir.0)
        .stdin(Stdio::null())
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(log2))
        .kill_on_drop(true);
    let child = cmd.spawn().map_err(|source| ProcError::Spawn {
        path: bin.display().to_string(),
        source,
    })?;
    procs.push(ChildProc {
        name: "redis-server".into(),
        child,
        term_tree: false,
    });
    let deadline = Instant::now() + startup_timeout;
    loop {
        if let Some(p) = procs.last_mut()
            && let Ok(Some(status)) = p.child.try_wait()
        {
            return Err(ProcError::NotReady(format!(
                "redis-server exited ({status}) before it answered PING\n--- its log ---\n{}",
                tail(&log_path, 20)
            )));
        }
        let ping = async {
            let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
            s.write_all(b"PING\r\n").await?;
            let mut buf = [0u8; 16];
            let n = s.read(&mut buf).await?;
            Ok::<_, std::io::Error>(buf[..n].starts_with(b"+PONG"))
        };
        if let Ok(Ok(true)) = tokio::time::timeout(Duration::from_secs(1), ping).await {
            return Ok(port);
        }
        if Instant::now() >= deadline {
            return Err(ProcError::NotReady(format!(
                "redis-server on port {port} did not answer PING within {startup_timeout:?}\n--- its log ---\n{}",
                tail(&log_path, 20)
            )));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The last `lines` lines of a text file (empty if unreadable).
pub fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    let from = all.len().saturating_sub(lines);
    all[from..].join("\n")
}

/// Writes `yaml` to `dir/config.yaml`, starts the router on it (output to
/// `dir/router.log`) and waits until `GET http://127.0.0.1:port/health` answers a
/// 2xx. Returns the router's base URL. The child is pushed onto `procs` first.
pub async fn start_router(
    router_bin: &Path,
    yaml: &str,
    port: u16,
    dir: &ScratchDir,
    startup_timeout: Duration,
    procs: &mut Vec<ChildProc>,
) -> Result<String, ProcError> {
    let config_path = dir.0.join("config.yaml");
    std::fs::write(&config_path, yaml)
        .map_err(io_err(format!("write {}", config_path.display())))?;
    let spec = RouterCommand {
        name: "cache-aware-router".into(),
        program: router_bin.to_path_buf(),
        args: vec!["-c".into(), config_path.display().to_string()],
        env: Vec::new(),
        context: format!("--- its config ---\n{yaml}"),
        term_tree: false,
    };
    start_router_command(&spec, port, dir, startup_timeout, None, procs).await
}

/// A router process described by its command line (ours, or a peer router such
/// as sglang-router or vllm-router).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouterCommand {
    /// Process name for messages (`cache-aware-router`, `sglang-router`, ...).
    pub name: String,
    /// The executable.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// Extra environment variables.
    pub env: Vec<(String, String)>,
    /// Shown with a start failure (e.g. the config file), may be empty.
    pub context: String,
    /// Stop it with SIGTERM to it and its descendants, then SIGKILL after 5 s,
    /// instead of SIGKILL at once: for a master process whose workers would outlive
    /// it (nginx).
    pub term_tree: bool,
}

impl RouterCommand {
    /// The command as one shell-like line (environment first), for reports.
    pub fn display_line(&self) -> String {
        let mut parts: Vec<String> = self
            .env
            .iter()
            .map(|(k, v)| format!("{k}={}", shell_quote(v)))
            .collect();
        parts.push(shell_quote(&self.program.display().to_string()));
        parts.extend(self.args.iter().map(|a| shell_quote(a)));
        parts.join(" ")
    }
}

/// `s` quoted for a POSIX shell when it holds anything but plain characters.
pub fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=,:+@%".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// Starts `spec` (stdout and stderr to `dir/router.log`) and waits until it is
/// ready on 127.0.0.1:`port`: `GET /health` answers a 2xx and, when `probe` is
/// given, `POST /v1/chat/completions` with that body answers a 2xx too (a router
/// may report healthy before it has registered its workers). Returns the base
/// URL. The child is pushed onto `procs` first, so it is stopped with the others
/// on failure.
pub async fn start_router_command(
    spec: &RouterCommand,
    port: u16,
    dir: &ScratchDir,
    startup_timeout: Duration,
    probe: Option<Bytes>,
    procs: &mut Vec<ChildProc>,
) -> Result<String, ProcError> {
    let log_path = dir.0.join("router.log");
    let log = std::fs::File::create(&log_path)
        .map_err(io_err(format!("create {}", log_path.display())))?;
    let log2 = log.try_clone().map_err(io_err("dup router log"))?;
    let mut cmd = Command::new(&spec.program);
    cmd.args(&spec.args)
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(log2))
        .kill_on_drop(true);
    let child = cmd.spawn().map_err(|source| ProcError::Spawn {
        path: spec.program.display().to_string(),
        source,
    })?;
    procs.push(ChildProc {
        name: spec.name.clone(),
        child,
        term_tree: spec.term_tree,
    });
    let url = format!("http://127.0.0.1:{port}");
    let bad = |e: hyper::http::uri::InvalidUri| ProcError::NotReady(format!("bad URL: {e}"));
    let health: Uri = format!("{url}/health").parse().map_err(bad)?;
    let chat: Uri = format!("{url}/v1/chat/completions").parse().map_err(bad)?;
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let deadline = Instant::now() + startup_timeout;
    let name = &spec.name;
    let failure = |what: String| {
        ProcError::NotReady(format!(
            "{what}\n{}--- its log (last 20 lines) ---\n{}",
            if spec.context.is_empty() {
                String::new()
            } else {
                format!("{}\n", spec.context.trim_end())
            },
            tail(&log_path, 20)
        ))
    };
    let mut healthy = false;
    loop {
        if let Some(router) = procs.last_mut()
            && let Ok(Some(status)) = router.child.try_wait()
        {
            return Err(failure(format!(
                "{name} exited ({status}) before it was ready"
            )));
        }
        let last = if healthy {
            let req = hyper::Request::post(chat.clone())
                .header(hyper::header::CONTENT_TYPE, "application/json")
                .body(Full::new(probe.clone().unwrap_or_default()))
                .map_err(|e| ProcError::NotReady(format!("cannot build the probe: {e}")))?;
            match tokio::time::timeout(Duration::from_secs(5), async {
                let resp = client.request(req).await?;
                let status = resp.status();
                // Read the body to its end so the probe is over before the run starts.
                resp.into_body().collect().await?;
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>(status)
            })
            .await
            {
                Ok(Ok(s)) if s.is_success() => return Ok(url),
                Ok(Ok(s)) => format!("the probe request answered {s}"),
                Ok(Err(e)) => format!("the probe request failed: {e}"),
                Err(_) => "the probe request took over 5 s".to_string(),
            }
        } else {
            let req = hyper::Request::get(health.clone())
                .body(Full::new(Bytes::new()))
                .map_err(|e| ProcError::NotReady(format!("cannot build GET /health: {e}")))?;
            match tokio::time::timeout(Duration::from_secs(1), client.request(req)).await {
                Ok(Ok(resp)) if resp.status().is_success() => {
                    if probe.is_none() {
                        return Ok(url);
                    }
                    healthy = true;
                    continue;
                }
                Ok(Ok(resp)) => format!("GET /health answered {}", resp.status()),
                Ok(Err(e)) => format!("GET /health failed: {e}"),
                Err(_) => "GET /health took over 1 s".to_string(),
            }
        };
        if Instant::now() >= deadline {
            return Err(failure(format!(
                "{name} not ready within {startup_timeout:?} ({last})"
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// CPU time and memory of one process, from `/proc/<pid>/stat` and `/status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ProcUsage {
    /// `utime + stime`, in clock ticks (see [`clock_ticks_per_sec`]).
    pub cpu_ticks: u64,
    /// `VmRSS`: resident set now, in KiB.
    pub rss_kib: u64,
    /// `VmHWM`: peak resident set since start or the last [`reset_peak_rss`], in KiB.
    pub hwm_kib: u64,
}

/// `utime + stime` (fields 14 and 15) of a `/proc/<pid>/stat` line. The command
/// name (field 2) may hold spaces and parentheses, so fields are counted after the
/// last `)`.
pub fn parse_stat_cpu_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state): utime is field 14 → index 11.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// The value in KiB of a `Key:   1234 kB` line of `/proc/<pid>/status`.
pub fn parse_status_kib(status: &str, key: &str) -> Option<u64> {
    status.lines().find_map(|l| {
        let v = l.strip_prefix(key)?.strip_prefix(':')?;
        v.split_whitespace().next()?.parse().ok()
    })
}

/// Reads [`ProcUsage`] of `pid` (Linux only).
pub fn proc_usage(pid: u32) -> std::io::Result<ProcUsage> {
    let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string());
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    Ok(ProcUsage {
        cpu_ticks: parse_stat_cpu_ticks(&stat).ok_or_else(|| bad("unreadable /proc/PID/stat"))?,
        rss_kib: parse_status_kib(&status, "VmRSS").ok_or_else(|| bad("no VmRSS"))?,
        hwm_kib: parse_status_kib(&status, "VmHWM").ok_or_else(|| bad("no VmHWM"))?,
    })
}

/// `pid` and all its descendants (children, their children, ...), from the
/// parent pids in `/proc/*/stat`; just `[pid]` where `/proc` cannot be listed.
pub fn process_tree(pid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return vec![pid];
    };
    let parents: Vec<(u32, u32)> = entries
        .filter_map(|e| {
            let p: u32 = e.ok()?.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).ok()?;
            let rest = &stat[stat.rfind(')')? + 1..];
            // rest: " state ppid ..."
            let ppid: u32 = rest.split_whitespace().nth(1)?.parse().ok()?;
            Some((p, ppid))
        })
        .collect();
    let mut tree = vec![pid];
    let mut i = 0;
    while i < tree.len() {
        let parent = tree[i];
        tree.extend(
            parents
                .iter()
                .filter(|&&(p, pp)| pp == parent && !tree.contains(&p))
                .map(|&(p, _)| p)
                .collect::<Vec<_>>(),
        );
        i += 1;
    }
    tree
}

/// [`ProcUsage`] of `pid` plus its descendants (see [`process_tree`]): CPU ticks
/// and RSS add up; `hwm_kib` is the sum of each process's own peak (an upper
/// bound of the tree's peak). Fails only if `pid` itself cannot be read.
pub fn tree_usage(pid: u32) -> std::io::Result<ProcUsage> {
    let mut total = proc_usage(pid)?;
    for p in process_tree(pid).into_iter().skip(1) {
        if let Ok(u) = proc_usage(p) {
            total.cpu_ticks += u.cpu_ticks;
            total.rss_kib += u.rss_kib;
            total.hwm_kib += u.hwm_kib;
        }
    }
    Ok(total)
}

/// RSS of a process tree read every `every` by a background task ([`RssSeries::start`])
/// until [`RssSeries::finish`]: memory over a run, to tell growth from a plateau.
pub struct RssSeries {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<Vec<(f64, u64)>>,
}

impl RssSeries {
    /// Starts reading `pid`'s tree ([`tree_usage`]) now and then every `every`.
    pub fn start(pid: u32, every: std::time::Duration) -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = std::sync::Arc::clone(&stop);
        let task = tokio::spawn(async move {
            let t0 = std::time::Instant::now();
            let mut points = Vec::new();
            // Bounded in time: a day of readings at most, whoever forgets to stop it.
            while !flag.load(std::sync::atomic::Ordering::Relaxed)
                && t0.elapsed() < std::time::Duration::from_secs(86_400)
            {
                if let Ok(u) = tree_usage(pid) {
                    points.push((t0.elapsed().as_secs_f64(), u.rss_kib));
                }
                tokio::time::sleep(every).await;
            }
            points
        });
        RssSeries { stop, task }
    }

    /// Stops reading: `(seconds since the start, RSS KiB)` per reading, in order.
    pub async fn finish(self) -> Vec<(f64, u64)> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.task.await.unwrap_or_default()
    }
}

/// `n` readings of a series ([`RssSeries::finish`]) spread evenly over it, the first
/// and last included, as "t s: N MiB" items.
pub fn rss_over_time(points: &[(f64, u64)], n: usize) -> String {
    if points.is_empty() {
        return "–".into();
    }
    let n = n.clamp(2, points.len().max(2));
    let last = points.len() - 1;
    let mut picked: Vec<usize> = (0..n).map(|k| k * last / (n - 1)).collect();
    picked.dedup();
    picked
        .iter()
        .map(|&i| {
            format!(
                "{:.0} s: {:.0} MiB",
                points[i].0,
                points[i].1 as f64 / 1024.0
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Resets `VmHWM` of `pid` to its current RSS (writes `5` to `/proc/<pid>/clear_refs`,
/// Linux ≥ 4.0; needs to own the process).
pub fn reset_peak_rss(pid: u32) -> std::io::Result<()> {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5")
}

/// Read and write system calls made so far by `pid` (`syscr`, `syscw` of
/// `/proc/<pid>/io`); `None` if unreadable.
pub fn proc_syscalls(pid: u32) -> Option<(u64, u64)> {
    let io = std::fs::read_to_string(format!("/proc/{pid}/io")).ok()?;
    let field = |k: &str| {
        io.lines()
            .find_map(|l| l.strip_prefix(k)?.strip_prefix(':')?.trim().parse().ok())
    };
    Some((field("syscr")?, field("syscw")?))
}

/// Busy CPU time of the whole machine (all CPUs), in clock ticks, from the `cpu`
/// line of `/proc/stat`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MachineBusy {
    /// user + nice + system + steal: time charged to processes (guest time is
    /// already inside user and nice).
    pub tasks: u64,
    /// irq + softirq: interrupt work, e.g. loopback TCP delivery, charged to no
    /// process.
    pub interrupts: u64,
}

/// [`MachineBusy`] now; `None` if unreadable.
pub fn machine_busy_ticks() -> Option<MachineBusy> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    parse_proc_stat_busy(stat.lines().next()?)
}

/// [`MachineBusy`] of a `/proc/stat` `cpu` line.
pub fn parse_proc_stat_busy(line: &str) -> Option<MachineBusy> {
    let mut f = line.split_whitespace();
    if f.next()? != "cpu" {
        return None;
    }
    let v: Vec<u64> = f.take(8).map(|x| x.parse().ok()).collect::<Option<_>>()?;
    let [user, nice, system, _idle, _iowait, irq, softirq, steal] = v[..] else {
        return None;
    };
    Some(MachineBusy {
        tasks: user + nice + system + steal,
        interrupts: irq + softirq,
    })
}

/// CPU time used on the machine by processes outside a benchmark over an
/// interval, to tell a run disturbed by unrelated load: machine busy time
/// (`/proc/stat`) minus that of the given processes, their descendants and this
/// process.
#[derive(Debug, Clone)]
pub struct Disturbance {
    pids: Vec<u32>,
    busy0: Option<MachineBusy>,
    ours0: u64,
    t0: std::time::Instant,
}

/// What [`Disturbance::finish`] measured, in CPU seconds.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct OtherCpu {
    /// CPU time of every other process.
    pub other_s: f64,
    /// Wall time × CPUs: what the machine had.
    pub capacity_s: f64,
}

impl std::fmt::Display for OtherCpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.1} CPU s ({:.0} % of the machine)",
            self.other_s,
            100.0 * self.other_s / self.capacity_s.max(1e-9)
        )
    }
}

impl Disturbance {
    fn ours(pids: &[u32]) -> u64 {
        pids.iter()
            .chain([&std::process::id()])
            .filter_map(|&p| tree_usage(p).ok())
            .map(|u| u.cpu_ticks)
            .sum()
    }

    /// Starts watching; `pids` are the benchmark's own processes (this one is
    /// always counted as the benchmark's).
    pub fn start(pids: Vec<u32>) -> Self {
        Self {
            busy0: machine_busy_ticks(),
            ours0: Self::ours(&pids),
            pids,
            t0: std::time::Instant::now(),
        }
    }

    /// Other processes' CPU time since [`Disturbance::start`]; `None` if
    /// `/proc/stat` is unreadable.
    pub fn finish(&self) -> Option<OtherCpu> {
        let busy1 = machine_busy_ticks()?;
        let busy0 = self.busy0?;
        let ours = Self::ours(&self.pids).saturating_sub(self.ours0);
        let tick = clock_ticks_per_sec() as f64;
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        Some(OtherCpu {
            other_s: busy1.tasks.saturating_sub(busy0.tasks).saturating_sub(ours) as f64 / tick,
            capacity_s: self.t0.elapsed().as_secs_f64() * cpus,
        })
    }
}

/// Runs a benchmark binary's work on a multi-threaded tokio runtime
/// (`worker_threads` of them; 0: one per CPU) until it ends. Ctrl-C drops it instead
/// (the children it started are kill-on-drop) and exits 130. Messages start with
/// `name`.
pub fn run_interruptible(
    name: &str,
    worker_threads: usize,
    work: impl std::future::Future<Output = std::process::ExitCode>,
) -> std::process::ExitCode {
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    rt.enable_all();
    if worker_threads > 0 {
        rt.worker_threads(worker_threads);
    }
    let rt = match rt.build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("{name}: cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    rt.block_on(async {
        tokio::select! {
            code = work => code,
            _ = tokio::signal::ctrl_c() => {
                eprintln!("{name}: interrupted");
                std::process::ExitCode::from(130)
            }
        }
    })
}

/// This machine in the words a report starts with: `machine: nproc N, CPU MODEL,
/// X.X GiB RAM, Linux RELEASE` (from /proc; `unknown` or 0 where unreadable).
pub fn machine_summary() -> String {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let cpuinfo = read("/proc/cpuinfo");
    let model = cpuinfo
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .map(|v| v.trim_start_matches([' ', '\t', ':']))
        })
        .unwrap_or("unknown")
        .to_string();
    let mem = parse_status_kib(&read("/proc/meminfo"), "MemTotal").unwrap_or(0);
    let nproc = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!(
        "machine: nproc {nproc}, {model}, {:.1} GiB RAM, Linux {}",
        mem as f64 / (1024.0 * 1024.0),
        read("/proc/sys/kernel/osrelease").trim()
    )
}

/// `getconf CLK_TCK` (the unit of `/proc/<pid>/stat` times), 100 if unavailable.
pub fn clock_ticks_per_sec() -> u64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(100)
}

/// A CLI seconds value as a [`std::time::Duration`]; errors name the flag.
pub fn secs(v: f64, flag: &str) -> Result<std::time::Duration, String> {
    std::time::Duration::try_from_secs_f64(v)
        .map_err(|_| format!("{flag} must be a finite number >= 0"))
}

/// The body of `GET url` when it answers 2xx within 5 s.
pub async fn get_body(url: &str) -> Option<Bytes> {
    let uri: Uri = url.parse().ok()?;
    let client: Client<HttpConnector, http_body_util::Empty<Bytes>> =
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

/// The socket address of an `http://host:port[/]` URL.
pub fn addr_of(url: &str) -> Result<std::net::SocketAddr, String> {
    url.trim_start_matches("http://")
        .trim_end_matches('/')
        .parse()
        .map_err(|e| format!("cannot read an address from {url:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_after_the_command_name() {
        let stat = "4242 (tokio (rt) x) S 1 4242 4242 0 -1 4194304 100 0 0 0 \
                    250 37 0 0 20 0 3 0 12345 1000000 500 18446744073709551615";
        assert_eq!(parse_stat_cpu_ticks(stat), Some(287));
        assert_eq!(parse_stat_cpu_ticks("garbage"), None);
    }

    #[test]
    fn machine_busy_leaves_out_idle_and_iowait() {
        let line = "cpu  100 5 50 9000 40 3 2 1 0 0";
        assert_eq!(
            parse_proc_stat_busy(line),
            Some(MachineBusy {
                tasks: 156,
                interrupts: 5
            })
        );
        assert_eq!(parse_proc_stat_busy("cpu0 1 2 3 4 5 6 7 8"), None);
    }

    #[test]
    fn status_values_are_read_in_kib() {
        let status = "Name:\tx\nVmHWM:\t  20480 kB\nVmRSS:\t   10240 kB\n";
        assert_eq!(parse_status_kib(status, "VmRSS"), Some(10_240));
        assert_eq!(parse_status_kib(status, "VmHWM"), Some(20_480));
        assert_eq!(parse_status_kib(status, "VmSwap"), None);
    }

    #[test]
    fn engine_args_carry_every_setting() {
        let p = EngineParams {
            kv_blocks: 10,
            block_size: 16,
            ttft_base_ms: 0.0,
            prefill_us_per_token: 0.0,
            itl_ms: 100.0,
            time_factor: 0.0,
            max_output_tokens: 20,
            model: "m".into(),
            metrics_flavor: crate::engine::MetricsFlavor::Sglang,
            max_waiting: 3,
            retry_after_secs: 2,
            prefill_physics: crate::prefill::Physics::Shared,
            prefill_slots: 4,
            max_batched_tokens: 512,
            kv_connector: crate::engine::KvConnector::Nixl,
            kv_transfer_base_ms: 1.0,
            kv_transfer_us_per_token: 3.0,
            stall_first_token_ms: 2000.0,
            stall_share: 0.05,
        };
        let a = p.args("e0", 0);
        let flag = |f: &str| &a[a.iter().position(|x| x == f).unwrap() + 1];
        assert_eq!(
            (
                flag("--metrics-flavor").as_str(),
                flag("--max-waiting").as_str(),
                flag("--retry-after-secs").as_str(),
                flag("--prefill-physics").as_str(),
                flag("--prefill-slots").as_str(),
                flag("--stall-first-token-ms").as_str(),
                flag("--stall-share").as_str()
            ),
            ("sglang", "3", "2", "shared", "4", "2000", "0.05")
        );
        assert_eq!(
            (
                flag("--max-batched-tokens").as_str(),
                flag("--kv-connector").as_str(),
                flag("--kv-transfer-base-ms").as_str(),
                flag("--kv-transfer-us-per-token").as_str()
            ),
            ("512", "nixl", "1", "3")
        );
        assert_eq!(
            &a[..6],
            ["--host", "127.0.0.1", "--port", "0", "--name", "e0"]
        );
        let at = a.iter().position(|x| x == "--time-factor").unwrap();
        assert_eq!(a[at + 1], "0");
    }
}

//! The policy comparison: for each contender start fresh engines (and a router),
//! replay the same trace slice through it, stop everything, and tabulate.
//!
//! A contender is a router policy (`cache_aware`, `round_robin`, `least_load`, ...)
//! or `direct` (client-side round robin straight to the engines, no router).
//! Every contender starts from cold caches: new `sim-engine` processes, a new
//! router process with a generated config, free ports on 127.0.0.1.
//!
//! Child processes are started and owned through [`crate::procs`]: stopped
//! explicitly on the normal and error paths, and killed on drop if the future is
//! cancelled (Ctrl-C) or panics.

use std::fmt::Write as _;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::procs::{self, ScratchDir, free_port, io_err, start_engine, start_router, tail};
pub use crate::procs::{ChildProc, EngineParams, ProcError, sibling_binary};
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
    procs::stop_all(procs).await;
    result
}

async fn run_contender_inner(
    cfg: &MatrixConfig,
    contender: &Contender,
    requests: &[PreparedRequest],
    procs: &mut Vec<ChildProc>,
) -> Result<Summary, MatrixError> {
    procs::require_binary(
        &cfg.engine_bin,
        "sim-engine",
        "build it with `cargo build --release -p bench` or pass --engine-bin",
    )?;
    if matches!(contender, Contender::Router(_)) {
        procs::require_binary(
            &cfg.router_bin,
            "cache-aware-router",
            "build it with `cargo build --release --workspace` or pass --router-bin",
        )?;
    }
    let label = contender.label();
    let dir = ScratchDir::new("trace-matrix", &label)?;
    let names = engine_names(cfg.engines);
    let mut urls = Vec::with_capacity(names.len());
    for (i, name) in names.iter().enumerate() {
        let port = cfg.base_port.map_or(0, |b| b.saturating_add(1 + i as u16));
        urls.push(
            start_engine(
                &cfg.engine_bin,
                &cfg.engine,
                name,
                port,
                cfg.startup_timeout,
                procs,
            )
            .await?,
        );
    }
    let targets = match contender {
        Contender::Direct => urls.clone(),
        Contender::Router(policy) => {
            let port = match cfg.base_port {
                Some(p) => p,
                None => free_port()?,
            };
            let yaml = router_config(policy, port, &urls);
            vec![
                start_router(
                    &cfg.router_bin,
                    &yaml,
                    port,
                    &dir,
                    cfg.startup_timeout,
                    procs,
                )
                .await?,
            ]
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
            tail(&dir.path().join("router.log"), 20)
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
    std::fs::write(&path, text).map_err(io_err(format!("write {}", path.display())))?;
    Ok(())
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

//! What every section shares: the binaries and limits ([`Env`]), starting engines and
//! routers, admin calls to a router ([`Admin`]), request bodies and /proc readings.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bench::load::{self, BodyFn, LoadSpec};
use bench::matrix::router_config;
use bench::procs::{self, ChildProc, EngineParams, ProcUsage, ScratchDir, addr_of};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::HeaderMap;
use hyper::{StatusCode, Uri};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

/// The path of every chat request.
pub const CHAT: &str = "/v1/chat/completions";

/// Shared by every small request and every tree prompt (~100 bytes).
pub const SYSTEM: &str = load::SMALL_SYSTEM;

/// What every section needs.
pub struct Env {
    pub engine_bin: PathBuf,
    pub router_bin: PathBuf,
    pub startup: Duration,
    pub request_timeout: Duration,
    pub clk_tck: u64,
}

/// A started router.
pub struct RouterProc {
    pub url: String,
    pub addr: SocketAddr,
    pub pid: u32,
    pub dir: ScratchDir,
}

impl RouterProc {
    pub fn log_tail(&self) -> String {
        procs::tail(&self.dir.path().join("router.log"), 20)
    }
}

impl Env {
    pub fn engine(&self, time_factor: f64, max_output_tokens: u64) -> EngineParams {
        EngineParams {
            kv_blocks: 65_536,
            block_size: 16,
            ttft_base_ms: 20.0,
            prefill_us_per_token: 80.0,
            itl_ms: 15.0,
            time_factor,
            max_output_tokens,
            model: "m".into(),
            ..EngineParams::default()
        }
    }

    pub async fn engines(
        &self,
        n: usize,
        params: &EngineParams,
        procs: &mut Vec<ChildProc>,
    ) -> Result<Vec<String>, String> {
        let mut urls = Vec::with_capacity(n);
        for i in 0..n {
            let url = procs::start_engine(
                &self.engine_bin,
                params,
                &format!("e{i}"),
                0,
                self.startup,
                procs,
            )
            .await
            .map_err(|e| e.to_string())?;
            urls.push(url);
        }
        Ok(urls)
    }

    pub async fn router(
        &self,
        workers: &[String],
        extra_yaml: &str,
        label: &str,
        procs: &mut Vec<ChildProc>,
    ) -> Result<RouterProc, String> {
        let dir = ScratchDir::new("overhead", label).map_err(|e| e.to_string())?;
        let port = procs::free_port().map_err(|e| e.to_string())?;
        let mut yaml = router_config("cache_aware", port, workers);
        yaml.push_str(extra_yaml);
        let url = procs::start_router(&self.router_bin, &yaml, port, &dir, self.startup, procs)
            .await
            .map_err(|e| e.to_string())?;
        let pid = procs
            .last()
            .and_then(ChildProc::pid)
            .ok_or("router exited right after starting")?;
        Ok(RouterProc {
            addr: addr_of(&url)?,
            url,
            pid,
            dir,
        })
    }

    pub fn cpu_s(&self, before: &ProcUsage, after: &ProcUsage) -> f64 {
        after.cpu_ticks.saturating_sub(before.cpu_ticks) as f64 / self.clk_tck as f64
    }

    pub fn spec(
        &self,
        targets: Vec<SocketAddr>,
        c: usize,
        n: u64,
        d: Duration,
        body: &BodyFn,
        stream: bool,
    ) -> LoadSpec {
        LoadSpec {
            targets,
            path: CHAT.into(),
            concurrency: c,
            max_requests: n,
            max_duration: d,
            request_timeout: self.request_timeout,
            stream,
            body: Arc::clone(body),
            stop: None,
            progress: None,
        }
    }
}

/// Sets the CPU affinity of every thread of `pid` (`taskset -a -p -c CPUS PID`).
pub fn pin(pid: u32, cpus: &str) -> Result<(), String> {
    let out = std::process::Command::new("taskset")
        .args(["-a", "-p", "-c", cpus, &pid.to_string()])
        .output()
        .map_err(|e| format!("cannot run taskset: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "taskset -a -p -c {cpus} {pid}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Usage of a process, zeros if it cannot be read.
pub fn usage(pid: u32) -> ProcUsage {
    procs::proc_usage(pid).unwrap_or_default()
}

/// Summed usage of several processes.
pub fn usage_sum(pids: &[u32]) -> ProcUsage {
    pids.iter()
        .map(|&p| usage(p))
        .fold(ProcUsage::default(), |a, u| ProcUsage {
            cpu_ticks: a.cpu_ticks + u.cpu_ticks,
            rss_kib: a.rss_kib + u.rss_kib,
            hwm_kib: a.hwm_kib + u.hwm_kib,
        })
}

pub fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

/// Admin calls to a router (`GET /workers`, `GET /metrics`) and single requests.
pub struct Admin {
    client: Client<HttpConnector, Full<Bytes>>,
    base: String,
}

/// Status, headers and body of one answer.
pub type Answer = (StatusCode, HeaderMap, Bytes);

impl Admin {
    pub fn new(router_url: &str) -> Result<Self, String> {
        Ok(Admin {
            client: Client::builder(TokioExecutor::new()).build(HttpConnector::new()),
            base: router_url.trim_end_matches('/').to_string(),
        })
    }

    /// One request with `body` (POST when given, else GET), read to the end; at most 10 s.
    pub async fn call(&self, path: &str, body: Option<Bytes>) -> Result<Answer, String> {
        let uri: Uri = format!("{}{path}", self.base)
            .parse()
            .map_err(|e| format!("bad URL for {path}: {e}"))?;
        let what = if body.is_some() { "POST" } else { "GET" };
        let req = match body {
            Some(b) => hyper::Request::post(uri)
                .header(hyper::header::CONTENT_TYPE, "application/json")
                .body(Full::new(b)),
            None => hyper::Request::get(uri).body(Full::new(Bytes::new())),
        }
        .map_err(|e| format!("cannot build {what} {path}: {e}"))?;
        let call = async {
            let resp = self
                .client
                .request(req)
                .await
                .map_err(|e| format!("{what} {path}: {e}"))?;
            let (parts, body) = resp.into_parts();
            let body = body
                .collect()
                .await
                .map_err(|e| format!("{what} {path} body: {e}"))?
                .to_bytes();
            Ok((parts.status, parts.headers, body))
        };
        tokio::time::timeout(Duration::from_secs(10), call)
            .await
            .map_err(|_| format!("{what} {path} took over 10 s"))?
    }

    /// A GET that must answer 2xx.
    pub async fn get(&self, path: &str) -> Result<Bytes, String> {
        let (status, _, body) = self.call(path, None).await?;
        if !status.is_success() {
            return Err(format!("GET {path} answered {status}"));
        }
        Ok(body)
    }

    pub async fn workers(&self) -> Result<Value, String> {
        let body = self.get("/workers").await?;
        serde_json::from_slice::<Value>(&body).map_err(|e| format!("GET /workers JSON: {e}"))
    }
}

pub fn in_flight(workers: &Value) -> Vec<u64> {
    workers["workers"]
        .as_array()
        .map(|ws| {
            ws.iter()
                .map(|w| w["in_flight"].as_u64().unwrap_or(u64::MAX))
                .collect()
        })
        .unwrap_or_default()
}

/// One small chat request body per index: [`load::small_chat_bodies`].
pub fn small_bodies(max_tokens: u64, stream: bool) -> BodyFn {
    load::small_chat_bodies(max_tokens, stream)
}

/// Open file descriptors of `pid` (0 if unreadable).
pub fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

/// The report's machine line: [`procs::machine_summary`], the open-file limit, the
/// clock tick and the load generator's threads.
pub fn machine_facts(nofile: u64, clk_tck: u64, client_threads: usize) -> String {
    let nproc = std::thread::available_parallelism().map_or(0, |n| n.get());
    let threads = if client_threads > 0 {
        client_threads
    } else {
        nproc
    };
    format!(
        "{}; open-file limit {nofile}; CLK_TCK {clk_tck}; load generator: {threads} tokio \
         worker threads, same machine",
        procs::machine_summary()
    )
}

pub fn pct_cell(p: f64) -> String {
    format!("{p:.0}")
}

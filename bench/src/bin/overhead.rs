//! `overhead`: what the router costs, measured against `sim-engine` replicas on
//! 127.0.0.1, printed as markdown tables.
//!
//! Sections (`--only`, comma-separated, default all, in this order):
//! - `added`: p50/p99 latency of small chat requests sent straight to one engine vs
//!   through the router with that engine as its only worker, at each
//!   `--added-concurrency`, non-streamed and streamed (end of stream and first byte);
//!   added = router − direct per percentile. Direct and router runs alternate
//!   (direct, router, router, direct; half the requests each) so drift cancels.
//! - `saturation`: requests/s through the router (2 engines) and straight to the
//!   engines at each `--saturation-concurrency`, with the router's CPU seconds and
//!   peak RSS over each phase; then again with the router pinned alone on CPU 0 and
//!   everything else on the other CPUs (`taskset`), which gives its one-core capacity.
//! - `streams5k`: 5,000 connections to the router, then one streamed request on each
//!   (engines at real time: 20 tokens × 100 ms); errors, connect times, router CPU
//!   and RSS, and every worker's `in_flight` in `GET /workers` afterwards; repeated
//!   `--streams-rounds` times on the same router, then RSS and open fds after 10 s
//!   idle (pooled upstream connections expire).
//! - `tree`: fills the router's radix tree with distinct prompts until
//!   `tree_nodes` (from `GET /workers`) reaches `--tree-nodes`; RSS before, during
//!   and after, and bytes per node.
//! - `cache`: the response cache. Routers with `response_cache` off, in-process and
//!   on a `redis-server` it starts (`--redis-server`, loopback, no persistence). At
//!   concurrency 1, p50/p99 of small chat requests (non-streamed; streamed to end of
//!   stream) direct to the engine, through the router with the cache off, and through
//!   each store on a miss (a new body every request) and on a hit (bodies stored
//!   first); rows alternate as in `added`. Then hits/s at `--cache-concurrency` with
//!   router (and Redis) CPU per request. Then memory: two fresh routers (cache on,
//!   cache off) sent the same `--cache-entries` distinct requests; router RSS against
//!   `response_cache_bytes` / `_entries`, per entry. Every request's cache outcome is
//!   checked against the router's `response_cache_{hits,misses}_total`.
//!
//! Every section starts fresh processes (engines at `--time-factor`, default 0 =
//! answer at once; router with `log: {level: warn}`) and kills them at its end, on
//! every path. Load is closed-loop ([`bench::load`]): one keep-alive connection per
//! concurrent worker; every loop is bounded in count and time. Each section ends
//! with the machine's CPU time split into this benchmark's processes and others, so
//! a run disturbed by unrelated load shows it.
//!
//! Usage: `cargo build --release -p bench -p cache-aware-router`, then
//! `target/release/overhead` (about 3 minutes on 2 cores; `--only tree,cache` etc.).

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bench::load::{self, BodyFn, BurstSpec, LoadSpec};
use bench::matrix::router_config;
use bench::procs::{self, ChildProc, EngineParams, ProcUsage, ScratchDir, addr_of, secs};
use bench::prompts::{SplitMix64, WORDS};
use bench::stats::Percentiles;
use bytes::Bytes;
use clap::{Parser, ValueEnum};
use http_body_util::{BodyExt, Full};
use hyper::header::HeaderMap;
use hyper::{StatusCode, Uri};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use tokio::time::Instant;

const CHAT: &str = "/v1/chat/completions";

/// Shared by every small request and every tree prompt (~100 bytes).
const SYSTEM: &str = load::SMALL_SYSTEM;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Section {
    /// Added latency, direct vs through the router.
    Added,
    /// Requests/s at high concurrency, router CPU and RSS.
    Saturation,
    /// 5,000 concurrent streams through the router.
    #[value(name = "streams5k")]
    Streams5k,
    /// Router RSS with a large radix tree.
    Tree,
    /// Response cache: hit and miss latency, hit throughput, memory per entry.
    Cache,
}

/// Measure the router's overhead against simulated vLLM engines on 127.0.0.1.
#[derive(Debug, Parser)]
#[command(name = "overhead", version)]
struct Cli {
    /// Sections to run, comma-separated: added, saturation, streams5k, tree, cache.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "added,saturation,streams5k,tree,cache"
    )]
    only: Vec<Section>,
    /// sim-engine executable [default: next to this executable].
    #[arg(long)]
    engine_bin: Option<PathBuf>,
    /// cache-aware-router executable [default: next to this executable].
    #[arg(long)]
    router_bin: Option<PathBuf>,
    /// Engine time factor in added, saturation and tree (0 = answer at once).
    #[arg(long, default_value_t = 0.0)]
    time_factor: f64,
    /// max_tokens of the small chat requests (added, saturation).
    #[arg(long, default_value_t = 8)]
    max_tokens: u64,
    /// Concurrency levels of the added-latency section.
    #[arg(long, value_delimiter = ',', default_value = "1,64")]
    added_concurrency: Vec<usize>,
    /// Requests per target and mode at each added-latency concurrency (same order).
    #[arg(long, value_delimiter = ',', default_value = "2000,20000")]
    added_requests: Vec<u64>,
    /// Longest time per target, mode and concurrency in the added section, in s.
    #[arg(long, default_value_t = 20.0)]
    added_max_s: f64,
    /// Concurrency levels of the saturation section.
    #[arg(long, value_delimiter = ',', default_value = "64,256")]
    saturation_concurrency: Vec<usize>,
    /// Length of each saturation phase, in s.
    #[arg(long, default_value_t = 5.0)]
    saturation_s: f64,
    /// Skip the saturation rows with the router pinned alone on CPU 0.
    #[arg(long)]
    no_saturation_pin: bool,
    /// Engines behind the router in the saturation section.
    #[arg(long, default_value_t = 2)]
    saturation_engines: usize,
    /// Concurrent streams in the streams5k section.
    #[arg(long, default_value_t = 5000)]
    streams: usize,
    /// Engines behind the router in the streams5k section.
    #[arg(long, default_value_t = 4)]
    streams_engines: usize,
    /// Tokens per stream in the streams5k section.
    #[arg(long, default_value_t = 20)]
    streams_tokens: u64,
    /// Inter-token latency of the streams5k engines (real time), in ms.
    #[arg(long, default_value_t = 100.0)]
    streams_itl_ms: f64,
    /// Rounds of the streams section (same router; RSS after each).
    #[arg(long, default_value_t = 2)]
    streams_rounds: usize,
    /// Most client connects in progress at once while opening the streams.
    #[arg(long, default_value_t = 256)]
    streams_connect_parallelism: usize,
    /// Tree size to reach in the tree section, in nodes.
    #[arg(long, default_value_t = 1_000_000)]
    tree_nodes: u64,
    /// Concurrency while filling the tree.
    #[arg(long, default_value_t = 128)]
    tree_concurrency: usize,
    /// Longest fill time, in s (the section then reports what it reached).
    #[arg(long, default_value_t = 120.0)]
    tree_max_s: f64,
    /// Routing text per tree prompt (system + user message), in bytes.
    #[arg(long, default_value_t = 300)]
    tree_prompt_bytes: usize,
    /// Requests per row and mode at concurrency 1 in the cache section.
    #[arg(long, default_value_t = 2000)]
    cache_requests: u64,
    /// Concurrency of the cache section's hit throughput and memory fills.
    #[arg(long, default_value_t = 64)]
    cache_concurrency: usize,
    /// Length of each hit throughput row of the cache section, in s.
    #[arg(long, default_value_t = 3.0)]
    cache_phase_s: f64,
    /// Distinct answers stored in the cache section's memory rows.
    #[arg(long, default_value_t = 20_000)]
    cache_entries: u64,
    /// max_tokens of the memory rows' requests (sets the answers' size).
    #[arg(long, default_value_t = 32)]
    cache_entry_tokens: u64,
    /// redis-server executable for the cache section (looked up in PATH).
    #[arg(long, default_value = "redis-server")]
    redis_server: PathBuf,
    /// Worker threads of this process's tokio runtime (0 = one per CPU).
    #[arg(long, default_value_t = 0)]
    client_threads: usize,
    /// Longest wait for engines and router to start, in s.
    #[arg(long, default_value_t = 30.0)]
    startup_timeout_s: f64,
    /// Limit per request, in s.
    #[arg(long, default_value_t = 60.0)]
    request_timeout_s: f64,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Each client connection is a file descriptor: 5,000 streams need more than the
    // usual soft limit of 1,024. Raise it to the hard limit (the router raises its own).
    let nofile = rlimit::increase_nofile_limit(u64::MAX).unwrap_or(0);
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    rt.enable_all();
    if cli.client_threads > 0 {
        rt.worker_threads(cli.client_threads);
    }
    let rt = match rt.build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("overhead: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // Ctrl-C drops the running section, whose children are kill-on-drop.
    rt.block_on(async {
        tokio::select! {
            code = run(cli, nofile) => code,
            _ = tokio::signal::ctrl_c() => {
                eprintln!("overhead: interrupted");
                ExitCode::from(130)
            }
        }
    })
}

/// What every section needs.
struct Env {
    engine_bin: PathBuf,
    router_bin: PathBuf,
    startup: Duration,
    request_timeout: Duration,
    clk_tck: u64,
}

/// A started router.
struct RouterProc {
    url: String,
    addr: SocketAddr,
    pid: u32,
    dir: ScratchDir,
}

impl RouterProc {
    fn log_tail(&self) -> String {
        procs::tail(&self.dir.path().join("router.log"), 20)
    }
}

impl Env {
    fn engine(&self, time_factor: f64, max_output_tokens: u64) -> EngineParams {
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

    async fn engines(
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

    async fn router(
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

    fn cpu_s(&self, before: &ProcUsage, after: &ProcUsage) -> f64 {
        after.cpu_ticks.saturating_sub(before.cpu_ticks) as f64 / self.clk_tck as f64
    }
}

/// Sets the CPU affinity of every thread of `pid` (`taskset -a -p -c CPUS PID`).
fn pin(pid: u32, cpus: &str) -> Result<(), String> {
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
fn usage(pid: u32) -> ProcUsage {
    procs::proc_usage(pid).unwrap_or_default()
}

/// Summed usage of several processes.
fn usage_sum(pids: &[u32]) -> ProcUsage {
    pids.iter()
        .map(|&p| usage(p))
        .fold(ProcUsage::default(), |a, u| ProcUsage {
            cpu_ticks: a.cpu_ticks + u.cpu_ticks,
            rss_kib: a.rss_kib + u.rss_kib,
            hwm_kib: a.hwm_kib + u.hwm_kib,
        })
}

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

/// Admin calls to a router (`GET /workers`, `GET /metrics`) and single requests.
struct Admin {
    client: Client<HttpConnector, Full<Bytes>>,
    base: String,
}

/// Status, headers and body of one answer.
type Answer = (StatusCode, HeaderMap, Bytes);

impl Admin {
    fn new(router_url: &str) -> Result<Self, String> {
        Ok(Admin {
            client: Client::builder(TokioExecutor::new()).build(HttpConnector::new()),
            base: router_url.trim_end_matches('/').to_string(),
        })
    }

    /// One request with `body` (POST when given, else GET), read to the end; at most 10 s.
    async fn call(&self, path: &str, body: Option<Bytes>) -> Result<Answer, String> {
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
    async fn get(&self, path: &str) -> Result<Bytes, String> {
        let (status, _, body) = self.call(path, None).await?;
        if !status.is_success() {
            return Err(format!("GET {path} answered {status}"));
        }
        Ok(body)
    }

    async fn workers(&self) -> Result<Value, String> {
        let body = self.get("/workers").await?;
        serde_json::from_slice::<Value>(&body).map_err(|e| format!("GET /workers JSON: {e}"))
    }
}

fn in_flight(workers: &Value) -> Vec<u64> {
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
fn small_bodies(max_tokens: u64, stream: bool) -> BodyFn {
    load::small_chat_bodies(max_tokens, stream)
}

/// Distinct prompts for the tree fill: the shared system prompt, then a user
/// message of pseudo-random words (seeded by the index) up to about
/// `prompt_bytes` of routing text in all.
fn tree_bodies(prompt_bytes: usize) -> BodyFn {
    let user_bytes = prompt_bytes.saturating_sub(SYSTEM.len() + 16).max(16);
    Arc::new(move |i| {
        let mut rng = SplitMix64::new(i ^ 0x7472_6565_6669_6c6c);
        let mut text = String::with_capacity(user_bytes + 16);
        while text.len() < user_bytes {
            if !text.is_empty() {
                text.push(' ');
            }
            text.push_str(WORDS[(rng.next_u64() % WORDS.len() as u64) as usize]);
        }
        let v = json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": text},
            ],
            "max_tokens": 1,
        });
        Bytes::from(v.to_string())
    })
}

impl Env {
    fn spec(
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

fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=,:+@%".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

fn machine_facts(nofile: u64, clk_tck: u64, client_threads: usize) -> String {
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
    let mem = procs::parse_status_kib(&read("/proc/meminfo"), "MemTotal").unwrap_or(0);
    let nproc = std::thread::available_parallelism().map_or(0, |n| n.get());
    let threads = if client_threads > 0 {
        client_threads
    } else {
        nproc
    };
    format!(
        "machine: nproc {nproc}, {model}, {:.1} GiB RAM, Linux {}; open-file limit {nofile}; \
         CLK_TCK {clk_tck}; load generator: {threads} tokio worker threads, same machine",
        mem as f64 / (1024.0 * 1024.0),
        read("/proc/sys/kernel/osrelease").trim()
    )
}

async fn run(cli: Cli, nofile: u64) -> ExitCode {
    match try_run(cli, nofile).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("overhead: {e}");
            ExitCode::from(2)
        }
    }
}

/// Runs the sections; `Ok(false)` when one failed or saw errors.
async fn try_run(cli: Cli, nofile: u64) -> Result<bool, String> {
    if cli.added_concurrency.len() != cli.added_requests.len() {
        return Err(
            "--added-concurrency and --added-requests need the same number of values".into(),
        );
    }
    if !cli.time_factor.is_finite() || cli.time_factor < 0.0 {
        return Err("--time-factor must be a finite number >= 0".into());
    }
    let env = Env {
        engine_bin: cli
            .engine_bin
            .clone()
            .unwrap_or_else(|| procs::sibling_binary("sim-engine")),
        router_bin: cli
            .router_bin
            .clone()
            .unwrap_or_else(|| procs::sibling_binary("cache-aware-router")),
        startup: secs(cli.startup_timeout_s, "--startup-timeout-s")?,
        request_timeout: secs(cli.request_timeout_s, "--request-timeout-s")?,
        clk_tck: procs::clock_ticks_per_sec(),
    };
    procs::require_binary(
        &env.engine_bin,
        "sim-engine",
        "build it with `cargo build --release -p bench` or pass --engine-bin",
    )
    .map_err(|e| e.to_string())?;
    procs::require_binary(
        &env.router_bin,
        "cache-aware-router",
        "build it with `cargo build --release -p cache-aware-router` or pass --router-bin",
    )
    .map_err(|e| e.to_string())?;
    let command: Vec<String> = std::env::args().map(|a| shell_quote(&a)).collect();
    println!("# cache-aware-router overhead\n");
    println!("command: `{}`  ", command.join(" "));
    println!(
        "{}  ",
        machine_facts(nofile, env.clk_tck, cli.client_threads)
    );
    println!(
        "router: {}; engine: {}\n",
        env.router_bin.display(),
        env.engine_bin.display()
    );
    let mut all_ok = true;
    let mut sections = cli.only.clone();
    sections.dedup();
    for s in sections {
        let t0 = Instant::now();
        eprintln!("== {s:?}");
        let (busy0, me0) = (procs::machine_busy_ticks(), usage(std::process::id()));
        let mut procs = Vec::new();
        let r = match s {
            Section::Added => added(&env, &cli, &mut procs).await,
            Section::Saturation => saturation(&env, &cli, &mut procs).await,
            Section::Streams5k => streams(&env, &cli, nofile, &mut procs).await,
            Section::Tree => tree(&env, &cli, &mut procs).await,
            Section::Cache => cache(&env, &cli, &mut procs).await,
        };
        // Children started within the section: all their CPU time is the section's.
        let pids: Vec<u32> = procs.iter().filter_map(ChildProc::pid).collect();
        let ours = usage_sum(&pids).cpu_ticks
            + usage(std::process::id())
                .cpu_ticks
                .saturating_sub(me0.cpu_ticks);
        let busy = procs::machine_busy_ticks().zip(busy0).map(|(b1, b0)| {
            (
                b1.tasks.saturating_sub(b0.tasks),
                b1.interrupts.saturating_sub(b0.interrupts),
            )
        });
        procs::stop_all(procs).await;
        let wall = t0.elapsed().as_secs_f64();
        let cpu_line = match busy {
            Some((tasks, interrupts)) => {
                let tick = env.clk_tck as f64;
                let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
                format!(
                    "Machine CPU over this section ({wall:.0} s × {cores} cores): this benchmark's \
                     processes {:.1} s, irq+softirq time (mostly loopback TCP; \
                     partly inside the processes' own figures) {:.1} s, **other processes {:.1} s**.\n",
                    ours as f64 / tick,
                    interrupts as f64 / tick,
                    tasks.saturating_sub(ours) as f64 / tick
                )
            }
            None => String::new(),
        };
        match r {
            Ok((text, ok)) => {
                println!("{text}\n{cpu_line}");
                all_ok &= ok;
            }
            Err(e) => {
                println!("## {s:?}: FAILED\n\n{e}\n");
                all_ok = false;
            }
        }
        eprintln!("== {s:?}: {:.0} s", t0.elapsed().as_secs_f64());
    }
    Ok(all_ok)
}

fn pct_cell(p: f64) -> String {
    format!("{p:.0}")
}

/// Section 1: added latency.
async fn added(env: &Env, cli: &Cli, procs: &mut Vec<ChildProc>) -> Result<(String, bool), String> {
    let params = env.engine(cli.time_factor, 4096);
    let urls = env.engines(1, &params, procs).await?;
    let router = env.router(&urls, "", "added", procs).await?;
    let direct = vec![addr_of(&urls[0])?];
    let via = vec![router.addr];
    let max = secs(cli.added_max_s / 2.0, "--added-max-s")?;
    let mut t = String::new();
    let _ = writeln!(
        t,
        "## 1. Added latency (µs): one engine (time factor {}), direct vs through the router\n\n\
         Small chat requests (system + user message, {} bytes of JSON, max_tokens {}), closed loop, \
         one keep-alive connection per concurrent client. Each figure merges two halves run \
         direct, router, router, direct. added = router − direct. Router CPU (utime+stime) and \
         write/writev calls (`syscw` of /proc/PID/io; socket reads use recv, not counted there) \
         are per request over the router's two halves.\n",
        cli.time_factor,
        small_bodies(cli.max_tokens, false)(0).len(),
        cli.max_tokens
    );
    t.push_str(
        "| request | c | requests direct / router | direct p50 | router p50 | **added p50** | direct p99 | router p99 | **added p99** | req/s direct / router | router CPU µs/req | router write syscalls/req | errors |\n\
         | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    let mut ok = true;
    for stream in [false, true] {
        let body = small_bodies(cli.max_tokens, stream);
        for (&c, &n) in cli.added_concurrency.iter().zip(&cli.added_requests) {
            eprintln!("   stream={stream} c={c} n={n}");
            let warm = (n / 10).clamp(4 * c as u64, 2_000);
            for target in [&direct, &via] {
                load::run(&env.spec(
                    target.clone(),
                    c,
                    warm,
                    Duration::from_secs(5),
                    &body,
                    stream,
                ))
                .await;
            }
            let half = n / 2;
            let mut d = load::run(&env.spec(direct.clone(), c, half, max, &body, stream)).await;
            let (u0, io0) = (usage(router.pid), procs::proc_syscalls(router.pid));
            let mut r = load::run(&env.spec(via.clone(), c, half, max, &body, stream)).await;
            r.merge(load::run(&env.spec(via.clone(), c, n - half, max, &body, stream)).await);
            let (u1, io1) = (usage(router.pid), procs::proc_syscalls(router.pid));
            let per_req = r.samples.len().max(1) as f64;
            let router_cpu = env.cpu_s(&u0, &u1) * 1e6 / per_req;
            let router_sys = match (io0, io1) {
                (Some((_, w0)), Some((_, w1))) => {
                    format!("{:.1}", w1.saturating_sub(w0) as f64 / per_req)
                }
                _ => "–".into(),
            };
            d.merge(load::run(&env.spec(direct.clone(), c, n - half, max, &body, stream)).await);
            let errors = format!("{} / {}", d.errors, r.errors);
            ok &= d.errors == 0 && r.errors == 0;
            for (e, first) in [(&d, "direct"), (&r, "router")] {
                if let Some(err) = &e.first_error {
                    eprintln!("   {first}: {} errors, first: {err}", e.errors);
                }
            }
            let rows: Vec<(&str, Percentiles, Percentiles)> = if stream {
                vec![
                    ("streamed, end of stream", d.latency_us(), r.latency_us()),
                    ("streamed, first byte", d.ttfb_us(), r.ttfb_us()),
                ]
            } else {
                vec![("non-streamed", d.latency_us(), r.latency_us())]
            };
            for (label, pd, pr) in rows {
                let _ = writeln!(
                    t,
                    "| {label} | {c} | {} / {} | {} | {} | **{:+.0}** | {} | {} | **{:+.0}** | {:.0} / {:.0} | {router_cpu:.0} | {router_sys} | {errors} |",
                    d.samples.len(),
                    r.samples.len(),
                    pct_cell(pd.p50),
                    pct_cell(pr.p50),
                    pr.p50 - pd.p50,
                    pct_cell(pd.p99),
                    pct_cell(pr.p99),
                    pr.p99 - pd.p99,
                    d.req_per_s(),
                    r.req_per_s(),
                );
            }
        }
    }
    if !ok {
        let _ = writeln!(t, "\nrouter log tail:\n```\n{}\n```", router.log_tail());
    }
    Ok((t, ok))
}

/// Section 2: saturation.
async fn saturation(
    env: &Env,
    cli: &Cli,
    procs: &mut Vec<ChildProc>,
) -> Result<(String, bool), String> {
    let params = env.engine(cli.time_factor, 4096);
    let urls = env
        .engines(cli.saturation_engines.max(1), &params, procs)
        .await?;
    let engine_pids: Vec<u32> = procs.iter().filter_map(ChildProc::pid).collect();
    let router = env.router(&urls, "", "saturation", procs).await?;
    let direct: Vec<SocketAddr> = urls.iter().map(|u| addr_of(u)).collect::<Result<_, _>>()?;
    let via = vec![router.addr];
    let phase = secs(cli.saturation_s, "--saturation-s")?;
    let body = small_bodies(cli.max_tokens, false);
    let me = std::process::id();
    let idle = usage(router.pid);
    let mut t = String::new();
    let _ = writeln!(
        t,
        "## 2. Saturation: {} engines (time factor {}), non-streamed, {:.0} s per row\n\n\
         Router RSS idle before the first row: {}. Router peak RSS is VmHWM, reset at the start \
         of each row{}. CPU s are utime+stime over the row (1.00 s per s = one core busy).\n",
        urls.len(),
        cli.time_factor,
        phase.as_secs_f64(),
        mib(idle.rss_kib),
        if procs::reset_peak_rss(router.pid).is_ok() {
            ""
        } else {
            " (reset failed: peak since start)"
        },
    );
    t.push_str(
        "| placement | target | c | requests | errors | req/s | p50 µs | p99 µs | router CPU s (cores) | router CPU µs/req | router peak RSS | engines CPU s | client CPU s |\n\
         | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
    let all_cpus = format!("0-{}", ncpu - 1);
    let mut placements = vec![("shared", None)];
    if ncpu >= 2 && !cli.no_saturation_pin {
        placements.push(("router pinned", Some(format!("1-{}", ncpu - 1))));
    }
    let mut ok = true;
    let mut notes = Vec::new();
    for (place, others) in placements {
        if let Some(others) = &others {
            // The router alone on CPU 0; this process and the engines on the rest.
            let pinned = pin(router.pid, "0").and_then(|()| {
                engine_pids
                    .iter()
                    .chain([&me])
                    .try_for_each(|&p| pin(p, others))
            });
            if let Err(e) = pinned {
                notes.push(format!("pinning skipped: {e}"));
                let _ = pin(me, &all_cpus);
                break;
            }
        }
        let targets: &[(&str, &Vec<SocketAddr>)] = if others.is_some() {
            &[("router", &via)]
        } else {
            &[("router", &via), ("direct (client round robin)", &direct)]
        };
        for &c in &cli.saturation_concurrency {
            for &(label, target) in targets {
                eprintln!("   {place}: {label} c={c}");
                load::run(&env.spec(
                    target.clone(),
                    c,
                    50_000,
                    Duration::from_secs(1),
                    &body,
                    false,
                ))
                .await;
                let _ = procs::reset_peak_rss(router.pid);
                let (r0, e0, m0) = (usage(router.pid), usage_sum(&engine_pids), usage(me));
                let res =
                    load::run(&env.spec(target.clone(), c, 5_000_000, phase, &body, false)).await;
                let (r1, e1, m1) = (usage(router.pid), usage_sum(&engine_pids), usage(me));
                ok &= res.errors == 0;
                if let Some(err) = &res.first_error {
                    eprintln!("   {} errors, first: {err}", res.errors);
                }
                let p = res.latency_us();
                let wall = res.elapsed.as_secs_f64().max(1e-9);
                let router_cells = if label == "router" {
                    let cpu = env.cpu_s(&r0, &r1);
                    format!(
                        "{cpu:.2} ({:.2}) | {:.0} | {}",
                        cpu / wall,
                        cpu * 1e6 / res.samples.len().max(1) as f64,
                        mib(r1.hwm_kib)
                    )
                } else {
                    format!("{:.2} (idle) | – | –", env.cpu_s(&r0, &r1))
                };
                let _ = writeln!(
                    t,
                    "| {place} | {label} | {c} | {} | {} | {:.0} | {:.0} | {:.0} | {router_cells} | {:.2} | {:.2} |",
                    res.samples.len(),
                    res.errors,
                    res.req_per_s(),
                    p.p50,
                    p.p99,
                    env.cpu_s(&e0, &e1),
                    env.cpu_s(&m0, &m1),
                );
            }
        }
        if others.is_some() {
            // Later sections run in this process: give it every CPU back.
            if let Err(e) = pin(me, &all_cpus) {
                notes.push(format!("could not unpin this process: {e}"));
            }
        }
    }
    let _ = writeln!(
        t,
        "\nshared: every process may run on every CPU (client, router and engines compete). \
         router pinned: the router alone on CPU 0, client and engines on CPU {} (`taskset`), \
         so a router at 1.00 cores is the bottleneck and req/s is its capacity on one core. \
         Peak RSS includes what earlier rows left allocated.",
        if ncpu > 2 {
            format!("1–{}", ncpu - 1)
        } else {
            "1".into()
        }
    );
    for n in notes {
        let _ = writeln!(t, "\n{n}");
    }
    if !ok {
        let _ = writeln!(t, "\nrouter log tail:\n```\n{}\n```", router.log_tail());
    }
    Ok((t, ok))
}

/// What one round of the streams section measured.
struct StreamRound {
    res: load::BurstResult,
    /// Router usage at the start of the connect phase, at the release, at the end
    /// of the last stream, and once `in_flight` was read back.
    before: ProcUsage,
    released: ProcUsage,
    done: ProcUsage,
    after: ProcUsage,
    /// VmHWM was reset at the start of the round.
    reset_ok: bool,
    /// Highest RSS of the 200 ms samples.
    sampled_peak_rss_kib: u64,
    peak_in_flight: u64,
    /// First `/workers` reading after the last stream, and when.
    first_read: Option<(Vec<u64>, Duration)>,
    /// Last reading, and when every `in_flight` was 0 (None: not within 10 s).
    last_read: Vec<u64>,
    zero_after: Option<Duration>,
    /// Router's open file descriptors at the end of the round.
    fds_after: usize,
}

/// Open file descriptors of `pid` (0 if unreadable).
fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

async fn stream_round(spec: &BurstSpec, router: &RouterProc, admin: &Arc<Admin>) -> StreamRound {
    let reset_ok = procs::reset_peak_rss(router.pid).is_ok();
    // Sample /workers and the router's RSS while the streams run.
    let stop = Arc::new(AtomicBool::new(false));
    let peak_in_flight = Arc::new(AtomicU64::new(0));
    let peak_rss = Arc::new(AtomicU64::new(0));
    let monitor = {
        let (stop, peak_in_flight, peak_rss, admin) = (
            Arc::clone(&stop),
            Arc::clone(&peak_in_flight),
            Arc::clone(&peak_rss),
            Arc::clone(admin),
        );
        let pid = router.pid;
        tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(600);
            while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                if let Ok(w) = admin.workers().await {
                    let sum: u64 = in_flight(&w).iter().sum();
                    peak_in_flight.fetch_max(sum, Ordering::Relaxed);
                }
                peak_rss.fetch_max(usage(pid).rss_kib, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    let before = usage(router.pid);
    let released = std::cell::Cell::new(before);
    let res = load::burst(spec, || released.set(usage(router.pid))).await;
    let done = usage(router.pid);
    let done_at = Instant::now();
    stop.store(true, Ordering::Relaxed);
    let _ = monitor.await;
    // The guard is released when the router's body ends, a moment after the
    // client saw the end: poll for a while.
    let mut first_read = None;
    let mut zero_after = None;
    let mut last_read = Vec::new();
    while done_at.elapsed() < Duration::from_secs(10) {
        if let Ok(w) = admin.workers().await {
            last_read = in_flight(&w);
            first_read.get_or_insert_with(|| (last_read.clone(), done_at.elapsed()));
            if last_read.iter().all(|&x| x == 0) {
                zero_after = Some(done_at.elapsed());
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    StreamRound {
        res,
        before,
        released: released.get(),
        done,
        after: usage(router.pid),
        reset_ok,
        sampled_peak_rss_kib: peak_rss.load(Ordering::Relaxed),
        peak_in_flight: peak_in_flight.load(Ordering::Relaxed),
        first_read,
        last_read,
        zero_after,
        fds_after: open_fds(router.pid),
    }
}

/// Section 3: thousands of concurrent streams, `--streams-rounds` times on the
/// same router (a second round tells retained memory from growth).
async fn streams(
    env: &Env,
    cli: &Cli,
    nofile: u64,
    procs: &mut Vec<ChildProc>,
) -> Result<(String, bool), String> {
    let n = cli.streams;
    if nofile < n as u64 + 256 {
        return Err(format!(
            "{n} streams need about {} open files; this process may open {nofile} (raise `ulimit -n`)",
            n + 256
        ));
    }
    let params = EngineParams {
        ttft_base_ms: 0.0,
        prefill_us_per_token: 0.0,
        itl_ms: cli.streams_itl_ms,
        ..env.engine(1.0, cli.streams_tokens)
    };
    let urls = env
        .engines(cli.streams_engines.max(1), &params, procs)
        .await?;
    let router = env.router(&urls, "", "streams", procs).await?;
    let admin = Arc::new(Admin::new(&router.url)?);
    let idle = usage(router.pid);
    let spec = BurstSpec {
        targets: vec![router.addr],
        path: CHAT.into(),
        n,
        connect_parallelism: cli.streams_connect_parallelism,
        connect_phase_timeout: Duration::from_secs(60),
        request_timeout: env.request_timeout,
        stream: true,
        body: small_bodies(cli.streams_tokens, true),
    };
    let mut rounds = Vec::new();
    for r in 0..cli.streams_rounds.max(1) {
        eprintln!(
            "   round {}: opening {n} connections, then one stream on each",
            r + 1
        );
        rounds.push(stream_round(&spec, &router, &admin).await);
        // Let the client side's closed connections settle before the next round.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let ok = rounds
        .iter()
        .all(|x| x.res.connect_errors == 0 && x.res.requests.errors == 0 && x.zero_after.is_some());
    let nominal = (cli.streams_tokens.saturating_sub(1)) as f64 * cli.streams_itl_ms / 1000.0;
    let mut t = String::new();
    let _ = writeln!(
        t,
        "## 3. {n} concurrent streams through the router\n\n\
         {} engines, each stream {} tokens at {} ms ITL (nominal {nominal:.1} s), prefill 0. \
         Per round the client opens {n} connections to the router (≤ {} connects at a time), \
         then sends one streamed chat request on each, all released together; rounds reuse \
         the same router. Router RSS idle before round 1: {}.\n",
        urls.len(),
        cli.streams_tokens,
        cli.streams_itl_ms,
        cli.streams_connect_parallelism,
        mib(idle.rss_kib),
    );
    t.push_str("| metric |");
    for i in 0..rounds.len() {
        let _ = write!(t, " round {} |", i + 1);
    }
    t.push_str("\n| --- |");
    t.push_str(&" ---: |".repeat(rounds.len()));
    t.push('\n');
    let mut row = |k: &str, cell: &dyn Fn(&StreamRound) -> String| {
        let _ = write!(t, "| {k} |");
        for x in &rounds {
            let _ = write!(t, " {} |", cell(x).replace('|', "\\|"));
        }
        t.push('\n');
    };
    row("connections opened / connect errors", &|x| {
        format!(
            "{} / {} in {:.2} s",
            x.res.connected,
            x.res.connect_errors,
            x.res.connect_phase.as_secs_f64()
        )
    });
    row("connect time p50 / p99 / max", &|x| {
        let ms: Vec<f64> = x.res.connect_us.iter().map(|&u| u as f64 / 1e3).collect();
        let p = Percentiles::of(&ms);
        let max = ms.iter().copied().fold(0.0, f64::max);
        format!("{:.1} / {:.1} / {max:.1} ms", p.p50, p.p99)
    });
    row("streams completed / errors", &|x| {
        format!(
            "**{} / {}**",
            x.res.requests.samples.len(),
            x.res.requests.errors
        )
    });
    row("first error", &|x| {
        x.res
            .requests
            .first_error
            .clone()
            .unwrap_or_else(|| "–".into())
    });
    row("all streams done after release", &|x| {
        format!("{:.2} s", x.res.requests.elapsed.as_secs_f64())
    });
    row("stream duration p50 / p99", &|x| {
        let p = x.res.requests.latency_us();
        format!("{:.2} / {:.2} s", p.p50 / 1e6, p.p99 / 1e6)
    });
    row("time to first byte p50 / p99", &|x| {
        let p = x.res.requests.ttfb_us();
        format!("{:.0} / {:.0} ms", p.p50 / 1e3, p.p99 / 1e3)
    });
    row("peak Σ in_flight in GET /workers (200 ms samples)", &|x| {
        x.peak_in_flight.to_string()
    });
    row("router CPU: connect phase / streams", &|x| {
        let s = x.res.requests.elapsed.as_secs_f64().max(1e-9);
        let streams = env.cpu_s(&x.released, &x.done);
        format!(
            "{:.2} s / {streams:.2} s ({:.2} cores)",
            env.cpu_s(&x.before, &x.released),
            streams / s
        )
    });
    row("router RSS: start / peak / after", &|x| {
        let peak = if x.reset_ok {
            x.done.hwm_kib.max(x.after.hwm_kib)
        } else {
            x.sampled_peak_rss_kib
        };
        format!(
            "{} / {}{} / {}",
            mib(x.before.rss_kib),
            mib(peak),
            if x.reset_ok { "" } else { " (sampled)" },
            mib(x.after.rss_kib)
        )
    });
    row("router open fds after the round", &|x| {
        x.fds_after.to_string()
    });
    row(
        "in_flight per worker after the last stream",
        &|x| match x.zero_after {
            Some(z) => {
                let (v, at) = x.first_read.clone().unwrap_or_default();
                format!(
                    "**{:?}** (first read {v:?} at {:.0} ms, all 0 at {:.0} ms)",
                    x.last_read,
                    at.as_secs_f64() * 1e3,
                    z.as_secs_f64() * 1e3
                )
            }
            None => format!("**{:?}: not all 0 after 10 s**", x.last_read),
        },
    );
    // Idle upstream connections close after proxy.pool_idle_timeout_secs (4 s),
    // found by a sweep that runs every 4 s: wait for two sweeps.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let rested = usage(router.pid);
    let _ = writeln!(
        t,
        "\nAfter 10 s idle (pooled upstream connections expire after 4 s idle, swept every 4 s): \
         router RSS {}, {} open fds.",
        mib(rested.rss_kib),
        open_fds(router.pid)
    );
    if !ok {
        let _ = writeln!(t, "\nrouter log tail:\n```\n{}\n```", router.log_tail());
    }
    Ok((t, ok))
}

/// One reading during the tree fill.
#[derive(Debug, Clone, Copy, Default)]
struct TreePoint {
    elapsed_s: f64,
    requests: u64,
    nodes: u64,
    bytes: u64,
    rss_kib: u64,
}

async fn tree_point(
    admin: &Admin,
    pid: u32,
    t0: Instant,
    requests: u64,
) -> Result<TreePoint, String> {
    let w = admin.workers().await?;
    Ok(TreePoint {
        elapsed_s: t0.elapsed().as_secs_f64(),
        requests,
        nodes: w["tree_nodes"].as_u64().unwrap_or(0),
        bytes: w["tree_bytes"].as_u64().unwrap_or(0),
        rss_kib: usage(pid).rss_kib,
    })
}

/// Section 4: router RSS with a large tree.
async fn tree(env: &Env, cli: &Cli, procs: &mut Vec<ChildProc>) -> Result<(String, bool), String> {
    let target = cli.tree_nodes;
    let params = env.engine(cli.time_factor, 1);
    let urls = env.engines(1, &params, procs).await?;
    let max_tree = (target * 2).max(2_000_000);
    let router = env
        .router(
            &urls,
            &format!("cache: {{ max_tree_size: {max_tree}, eviction_interval_secs: 0 }}\n"),
            "tree",
            procs,
        )
        .await?;
    let admin = Arc::new(Admin::new(&router.url)?);
    let t0 = Instant::now();
    let before = tree_point(&admin, router.pid, t0, 0).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let progress = Arc::new(AtomicU64::new(0));
    let body = tree_bodies(cli.tree_prompt_bytes);
    let routing_bytes = {
        let b = body(0);
        let v: Value = serde_json::from_slice(&b).unwrap_or_default();
        // What the router keys on: "role: content\n" per message (approximately).
        v["messages"].as_array().map_or(0, |ms| {
            ms.iter()
                .map(|m| {
                    m["role"].as_str().unwrap_or("").len()
                        + 3
                        + m["content"].as_str().unwrap_or("").len()
                })
                .sum::<usize>()
        })
    };
    let monitor = {
        let (stop, progress, admin) =
            (Arc::clone(&stop), Arc::clone(&progress), Arc::clone(&admin));
        let pid = router.pid;
        let max = secs(cli.tree_max_s + 30.0, "--tree-max-s")?;
        tokio::spawn(async move {
            let mut points = Vec::new();
            let mut last_print = Instant::now();
            while !stop.load(Ordering::Relaxed) && t0.elapsed() < max {
                tokio::time::sleep(Duration::from_millis(500)).await;
                let Ok(p) = tree_point(&admin, pid, t0, progress.load(Ordering::Relaxed)).await
                else {
                    continue;
                };
                if last_print.elapsed() >= Duration::from_secs(10) {
                    eprintln!(
                        "   {:.0} s: {} requests, {} nodes, RSS {}",
                        p.elapsed_s,
                        p.requests,
                        p.nodes,
                        mib(p.rss_kib)
                    );
                    last_print = Instant::now();
                }
                points.push(p);
                if p.nodes >= target {
                    stop.store(true, Ordering::Relaxed);
                }
            }
            points
        })
    };
    let spec = LoadSpec {
        stop: Some(Arc::clone(&stop)),
        progress: Some(Arc::clone(&progress)),
        ..env.spec(
            vec![router.addr],
            cli.tree_concurrency,
            target.saturating_mul(2),
            secs(cli.tree_max_s, "--tree-max-s")?,
            &body,
            false,
        )
    };
    eprintln!(
        "   filling the tree to {target} nodes (at most {:.0} s)",
        cli.tree_max_s
    );
    let res = load::run(&spec).await;
    stop.store(true, Ordering::Relaxed);
    let points = monitor.await.unwrap_or_default();
    let end = tree_point(&admin, router.pid, t0, progress.load(Ordering::Relaxed)).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let idle_after = tree_point(&admin, router.pid, t0, end.requests).await?;
    let ok = res.errors == 0;
    if let Some(e) = &res.first_error {
        eprintln!("   {} errors, first: {e}", res.errors);
    }
    let mut t = String::new();
    let _ = writeln!(
        t,
        "## 4. Router RSS with a large tree\n\n\
         1 engine (time factor {}), `cache: {{max_tree_size: {max_tree}, eviction_interval_secs: 0}}`; \
         distinct chat prompts of ~{routing_bytes} bytes of routing text (shared ~{} byte system \
         prompt + pseudo-random words), non-streamed, max_tokens 1, concurrency {}. \
         Fill: {} requests in {:.1} s ({:.0} req/s), {} errors; target {target} nodes{}.\n",
        cli.time_factor,
        SYSTEM.len(),
        cli.tree_concurrency,
        res.samples.len() as u64 + res.errors,
        res.elapsed.as_secs_f64(),
        res.req_per_s(),
        res.errors,
        if end.nodes >= target {
            " (reached)"
        } else {
            " (NOT reached within --tree-max-s)"
        }
    );
    t.push_str(
        "| point | elapsed s | requests | tree_nodes | tree_bytes | router RSS |\n\
         | --- | ---: | ---: | ---: | ---: | ---: |\n",
    );
    let mut row = |label: String, p: &TreePoint| {
        let _ = writeln!(
            t,
            "| {label} | {:.1} | {} | {} | {} | {} |",
            p.elapsed_s,
            p.requests,
            p.nodes,
            mib(p.bytes / 1024),
            mib(p.rss_kib)
        );
    };
    row("idle, before".into(), &before);
    for frac in [0.1, 0.25, 0.5, 0.75] {
        let want = (end.nodes as f64 * frac) as u64;
        if let Some(p) = points.iter().find(|p| p.nodes >= want) {
            row(format!("~{:.0} %", frac * 100.0), p);
        }
    }
    row("end of fill".into(), &end);
    row("idle, 1 s later".into(), &idle_after);
    let grown = end.nodes.saturating_sub(before.nodes).max(1);
    let per_node = (end.rss_kib.saturating_sub(before.rss_kib) * 1024) as f64 / grown as f64;
    let tenth = points
        .iter()
        .find(|p| p.nodes >= end.nodes / 10)
        .copied()
        .unwrap_or(before);
    let marginal = (end.rss_kib.saturating_sub(tenth.rss_kib) * 1024) as f64
        / end.nodes.saturating_sub(tenth.nodes).max(1) as f64;
    let _ = writeln!(
        t,
        "\nRSS per node: {per_node:.0} bytes (end − before, over {grown} nodes); marginal from ~10 % \
         to end: {marginal:.0} bytes/node; edge text alone: {:.0} bytes/node (tree_bytes / nodes); \
         {:.2} nodes per request.",
        end.bytes as f64 / end.nodes.max(1) as f64,
        end.nodes as f64 / end.requests.max(1) as f64,
    );
    if !ok {
        let _ = writeln!(t, "\nrouter log tail:\n```\n{}\n```", router.log_tail());
    }
    Ok((t, ok))
}

/// Small chat requests shaped like [`small_bodies`] (same system prompt and
/// `max_tokens`), each with a question of its own: request `i` asks question number
/// `first + i`. Numbers from 1,000,000 up never meet the 256 of [`small_bodies`] and
/// keep every body the same length, so each one is a response-cache miss.
fn fresh_bodies(max_tokens: u64, stream: bool, first: u64) -> BodyFn {
    Arc::new(move |i| {
        let k = first + i;
        let mut v = json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": format!("Question {k}: which river flows through city number {k}?")},
            ],
            "max_tokens": max_tokens,
            "ignore_eos": true,
        });
        if stream {
            v["stream"] = json!(true);
            v["stream_options"] = json!({"include_usage": true});
        }
        Bytes::from(v.to_string())
    })
}

/// Numbers for [`fresh_bodies`]: each run takes a range no other run has used.
struct Fresh(u64);

impl Fresh {
    fn take(&mut self, n: u64) -> u64 {
        let first = self.0;
        self.0 += n;
        first
    }
}

/// The response-cache families of a router's `GET /metrics`.
#[derive(Debug, Clone, Copy, Default)]
struct CacheCounters {
    hits: u64,
    misses: u64,
    bypasses: u64,
    /// `stores_total{result="stored"}`.
    stored: u64,
    /// Every other `stores_total` result.
    not_stored: u64,
    store_errors: u64,
    /// Gauges (in-process store only).
    entries: u64,
    bytes: u64,
    evictions: u64,
}

impl CacheCounters {
    /// Counters since `before`; gauges as now.
    fn since(&self, before: &CacheCounters) -> CacheCounters {
        CacheCounters {
            hits: self.hits.saturating_sub(before.hits),
            misses: self.misses.saturating_sub(before.misses),
            bypasses: self.bypasses.saturating_sub(before.bypasses),
            stored: self.stored.saturating_sub(before.stored),
            not_stored: self.not_stored.saturating_sub(before.not_stored),
            store_errors: self.store_errors.saturating_sub(before.store_errors),
            evictions: self.evictions.saturating_sub(before.evictions),
            ..*self
        }
    }

    fn add(&mut self, d: &CacheCounters) {
        self.hits += d.hits;
        self.misses += d.misses;
        self.bypasses += d.bypasses;
        self.stored += d.stored;
        self.not_stored += d.not_stored;
        self.store_errors += d.store_errors;
        self.evictions += d.evictions;
        self.entries = d.entries;
        self.bytes = d.bytes;
    }
}

/// Sum of the samples of metric `name` in a Prometheus text exposition, only the
/// series with exactly `labels` (`kind="exact"`) when given; `None` if absent.
fn metric_sum(text: &str, name: &str, labels: Option<&str>) -> Option<f64> {
    let mut found = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let (n, l) = match series.split_once('{') {
            Some((n, rest)) => (n, Some(rest.trim_end_matches('}'))),
            None => (series, None),
        };
        if n != name || labels.is_some_and(|want| l != Some(want)) {
            continue;
        }
        if let Ok(v) = value.parse::<f64>() {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

const RC: &str = "cache_aware_router_response_cache_";

async fn cache_counters(admin: &Admin) -> Result<CacheCounters, String> {
    let body = admin.get("/metrics").await?;
    let text = String::from_utf8_lossy(&body);
    let m = |name: &str, labels: Option<&str>| {
        metric_sum(&text, &format!("{RC}{name}"), labels)
            .map(|v| v as u64)
            .ok_or_else(|| format!("GET /metrics has no {RC}{name}"))
    };
    let stores = m("stores_total", None)?;
    let stored = m("stores_total", Some("result=\"stored\""))?;
    Ok(CacheCounters {
        hits: m("hits_total", None)?,
        misses: m("misses_total", None)?,
        bypasses: m("bypasses_total", None)?,
        stored,
        not_stored: stores.saturating_sub(stored),
        store_errors: m("store_errors_total", None)?,
        entries: m("entries", None)?,
        bytes: m("bytes", None)?,
        evictions: m("evictions_total", None)?,
    })
}

/// Polls `/metrics` until `stores_total` (every result) reaches `at_least` or
/// `max` has passed; the last reading. Answers are stored in a task after the body
/// ended, a moment after the client saw the end.
async fn wait_stores(admin: &Admin, at_least: u64, max: Duration) -> Result<CacheCounters, String> {
    let t0 = Instant::now();
    loop {
        let c = cache_counters(admin).await?;
        if c.stored + c.not_stored >= at_least || t0.elapsed() >= max {
            return Ok(c);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A router of the cache section and its admin client.
struct CacheRouter {
    proc: RouterProc,
    admin: Admin,
}

/// One row's target in the cache section.
#[derive(Clone, Copy)]
struct CacheTarget<'a> {
    label: &'static str,
    addr: SocketAddr,
    router: Option<&'a CacheRouter>,
    /// What every request should be: `hit`, `miss`, or `None` (no cache).
    expect: Option<&'static str>,
}

impl CacheTarget<'_> {
    /// Requests that are cache misses get a question of their own.
    fn fresh(&self) -> bool {
        self.router.is_some() && self.expect != Some("hit")
    }
}

/// What the runs of one row measured.
#[derive(Default)]
struct CacheRow {
    res: load::LoadResult,
    router_cpu_s: f64,
    delta: CacheCounters,
}

impl CacheRow {
    fn merge(&mut self, other: CacheRow) {
        self.res.merge(other.res);
        self.router_cpu_s += other.router_cpu_s;
        self.delta.add(&other.delta);
    }

    /// `hit 2000`, `miss 2000`, `–`; bold with the shortfall when some request was
    /// not what the row is about.
    fn x_cache(&self, expect: Option<&str>) -> (String, bool) {
        let n = self.res.samples.len() as u64;
        let d = &self.delta;
        let got = match expect {
            None => return ("–".into(), true),
            Some("hit") => d.hits,
            Some(_) => d.misses,
        };
        let e = expect.unwrap_or_default();
        if got == n && d.bypasses == 0 {
            (format!("{e} {got}"), true)
        } else {
            (
                format!(
                    "**{e} {got} of {n}** (hits {}, misses {}, bypasses {})",
                    d.hits, d.misses, d.bypasses
                ),
                false,
            )
        }
    }
}

impl Env {
    /// One closed-loop run on `t`, with the router's CPU and cache counters around it.
    async fn cache_run(&self, t: &CacheTarget<'_>, spec: &LoadSpec) -> Result<CacheRow, String> {
        let Some(r) = t.router else {
            return Ok(CacheRow {
                res: load::run(spec).await,
                ..CacheRow::default()
            });
        };
        let (u0, c0) = (usage(r.proc.pid), cache_counters(&r.admin).await?);
        let res = load::run(spec).await;
        let u1 = usage(r.proc.pid);
        // Misses are stored after their body ended: wait for the last ones, so the next
        // run's counters do not see them.
        let c1 = if t.expect == Some("miss") {
            let offered = c0.stored + c0.not_stored + res.samples.len() as u64;
            wait_stores(&r.admin, offered, Duration::from_secs(5)).await?
        } else {
            cache_counters(&r.admin).await?
        };
        Ok(CacheRow {
            res,
            router_cpu_s: self.cpu_s(&u0, &u1),
            delta: c1.since(&c0),
        })
    }

    async fn cache_router(
        &self,
        workers: &[String],
        extra_yaml: &str,
        label: &str,
        procs: &mut Vec<ChildProc>,
    ) -> Result<CacheRouter, String> {
        let proc = self.router(workers, extra_yaml, label, procs).await?;
        let admin = Admin::new(&proc.url)?;
        Ok(CacheRouter { proc, admin })
    }
}

/// Stores the answers of `body`'s first `n` requests in `r` (one at a time) and
/// checks that the first is then a hit (`x-cache: hit`).
async fn warm_keys(
    env: &Env,
    r: &CacheRouter,
    body: &BodyFn,
    n: u64,
    stream: bool,
) -> Result<(), String> {
    let c0 = cache_counters(&r.admin).await?;
    let res = load::run(&env.spec(
        vec![r.proc.addr],
        1,
        n,
        Duration::from_secs(10),
        body,
        stream,
    ))
    .await;
    if let Some(e) = res.first_error {
        return Err(format!(
            "warming the cache keys: {} errors, first: {e}",
            res.errors
        ));
    }
    let c1 = wait_stores(
        &r.admin,
        c0.stored + c0.not_stored + n,
        Duration::from_secs(10),
    )
    .await?;
    let (_, headers, _) = r.admin.call(CHAT, Some(body(0))).await?;
    let x = headers
        .get("x-cache")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("(none)");
    if x != "hit" {
        return Err(format!(
            "after warming {n} keys ({} stored, {} not stored, {} store errors) the first \
             answers x-cache: {x}, not hit\nrouter log tail:\n{}",
            c1.stored.saturating_sub(c0.stored),
            c1.not_stored.saturating_sub(c0.not_stored),
            c1.store_errors.saturating_sub(c0.store_errors),
            r.proc.log_tail()
        ));
    }
    Ok(())
}

/// One reading of the memory rows.
#[derive(Debug, Clone, Copy, Default)]
struct MemPoint {
    requests: u64,
    rss_kib: u64,
    entries: u64,
    bytes: u64,
    evictions: u64,
    tree_nodes: u64,
}

async fn mem_point(r: &CacheRouter, requests: u64, cache_on: bool) -> Result<MemPoint, String> {
    let c = if cache_on {
        cache_counters(&r.admin).await?
    } else {
        CacheCounters::default()
    };
    let w = r.admin.workers().await?;
    Ok(MemPoint {
        requests,
        rss_kib: usage(r.proc.pid).rss_kib,
        entries: c.entries,
        bytes: c.bytes,
        evictions: c.evictions,
        tree_nodes: w["tree_nodes"].as_u64().unwrap_or(0),
    })
}

/// Section 5: the response cache. Hit and miss latency against the engine at
/// concurrency 1, hit throughput, memory per stored answer.
async fn cache(env: &Env, cli: &Cli, procs: &mut Vec<ChildProc>) -> Result<(String, bool), String> {
    let params = env.engine(cli.time_factor, 4096);
    let urls = env.engines(1, &params, procs).await?;
    let engine_pid = procs
        .last()
        .and_then(ChildProc::pid)
        .ok_or("engine exited right after starting")?;
    let redis_dir = ScratchDir::new("overhead", "redis").map_err(|e| e.to_string())?;
    let redis_port = procs::start_redis(&cli.redis_server, &redis_dir, env.startup, procs)
        .await
        .map_err(|e| {
            format!("{e} (the cache section needs redis-server: install it or pass --redis-server)")
        })?;
    let redis_pid = procs
        .last()
        .and_then(ChildProc::pid)
        .ok_or("redis-server exited right after starting")?;
    let mem_yaml = "response_cache: { enabled: true, ttl_secs: 600 }\n";
    let redis_yaml = format!(
        "response_cache: {{ enabled: true, ttl_secs: 600, redis_url: \"redis://127.0.0.1:{redis_port}/\" }}\n"
    );
    let off = env.cache_router(&urls, "", "cache_off", procs).await?;
    let mem = env
        .cache_router(&urls, mem_yaml, "cache_mem", procs)
        .await?;
    let redis = env
        .cache_router(&urls, &redis_yaml, "cache_redis", procs)
        .await?;
    let direct = addr_of(&urls[0])?;
    let mut ok = true;
    let mut fresh = Fresh(1_000_000);
    let mut t = String::new();
    let n = cli.cache_requests.max(2);
    let max = secs(cli.added_max_s / 2.0, "--added-max-s")?;
    let _ = writeln!(
        t,
        "## 5. Response cache\n\n\
         1 engine (time factor {}); routers with `response_cache` off, in-process \
         (`{{enabled: true, ttl_secs: 600}}`, moka) and on a local `redis-server` (no \
         persistence, 127.0.0.1). Small chat requests as in section 1 ({} bytes of JSON, \
         max_tokens {}). Hit rows replay the 256 bodies of section 1, whose answers were \
         stored first; miss rows and the cache-off row send a question of their own every \
         time (the same shape and length), so every one goes to the engine. x-cache is the \
         router's own count (`{RC}hits_total` / `misses_total` over the row, 0 bypasses) \
         and must equal the requests.\n",
        cli.time_factor,
        small_bodies(cli.max_tokens, false)(0).len(),
        cli.max_tokens
    );

    // 1. Latency at concurrency 1.
    let targets = [
        CacheTarget {
            label: "direct to the engine",
            addr: direct,
            router: None,
            expect: None,
        },
        CacheTarget {
            label: "router, cache off",
            addr: off.proc.addr,
            router: Some(&off),
            expect: None,
        },
        CacheTarget {
            label: "router, in-process, miss",
            addr: mem.proc.addr,
            router: Some(&mem),
            expect: Some("miss"),
        },
        CacheTarget {
            label: "router, in-process, **hit**",
            addr: mem.proc.addr,
            router: Some(&mem),
            expect: Some("hit"),
        },
        CacheTarget {
            label: "router, Redis, miss",
            addr: redis.proc.addr,
            router: Some(&redis),
            expect: Some("miss"),
        },
        CacheTarget {
            label: "router, Redis, **hit**",
            addr: redis.proc.addr,
            router: Some(&redis),
            expect: Some("hit"),
        },
    ];
    let _ = writeln!(
        t,
        "### Latency at concurrency 1 (µs)\n\n\
         {n} requests per row, in two halves run in the order of the rows and then back \
         (drift cancels). added = row − direct, per percentile. Router CPU is utime+stime \
         over the row's requests.\n"
    );
    t.push_str(
        "| request | path | requests | p50 | p99 | **added p50** | **added p99** | router CPU µs/req | x-cache | errors |\n\
         | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |\n",
    );
    for stream in [false, true] {
        let repeated = small_bodies(cli.max_tokens, stream);
        eprintln!("   stream={stream}: storing the 256 hit keys");
        for r in [&mem, &redis] {
            warm_keys(env, r, &repeated, 256, stream).await?;
        }
        let half = n / 2;
        let warm = (n / 10).clamp(50, 500);
        let body_for = |tg: &CacheTarget<'_>, fresh: &mut Fresh, count: u64| {
            if tg.fresh() {
                fresh_bodies(cli.max_tokens, stream, fresh.take(count))
            } else {
                Arc::clone(&repeated)
            }
        };
        eprintln!("   stream={stream}: c=1, {n} requests per row");
        for tg in &targets {
            let body = body_for(tg, &mut fresh, warm);
            env.cache_run(tg, &env.spec(vec![tg.addr], 1, warm, max, &body, stream))
                .await?;
        }
        let mut rows: Vec<CacheRow> = targets.iter().map(|_| CacheRow::default()).collect();
        let order: Vec<(usize, u64)> = (0..targets.len())
            .map(|i| (i, half))
            .chain((0..targets.len()).rev().map(|i| (i, n - half)))
            .collect();
        for (i, count) in order {
            let tg = &targets[i];
            let body = body_for(tg, &mut fresh, count);
            let row = env
                .cache_run(tg, &env.spec(vec![tg.addr], 1, count, max, &body, stream))
                .await?;
            rows[i].merge(row);
        }
        let request = if stream {
            "streamed, end of stream"
        } else {
            "non-streamed"
        };
        let pd = rows[0].res.latency_us();
        for (tg, row) in targets.iter().zip(&rows) {
            let p = row.res.latency_us();
            let (x, x_ok) = row.x_cache(tg.expect);
            ok &= x_ok && row.res.errors == 0;
            if let Some(e) = &row.res.first_error {
                eprintln!("   {}: {} errors, first: {e}", tg.label, row.res.errors);
            }
            let per = row.res.samples.len().max(1) as f64;
            let (added50, added99) = if tg.router.is_some() {
                (
                    format!("**{:+.0}**", p.p50 - pd.p50),
                    format!("**{:+.0}**", p.p99 - pd.p99),
                )
            } else {
                ("–".into(), "–".into())
            };
            let cpu = if tg.router.is_some() {
                format!("{:.0}", row.router_cpu_s * 1e6 / per)
            } else {
                "–".into()
            };
            let _ = writeln!(
                t,
                "| {request} | {} | {} | {:.0} | {:.0} | {added50} | {added99} | {cpu} | {x} | {} |",
                tg.label,
                row.res.samples.len(),
                p.p50,
                p.p99,
                row.res.errors,
            );
        }
    }

    // 2. Hit throughput.
    let c = cli.cache_concurrency.max(1);
    let phase = secs(cli.cache_phase_s, "--cache-phase-s")?;
    let thr_targets = [targets[0], targets[1], targets[3], targets[5]];
    let me = std::process::id();
    let _ = writeln!(
        t,
        "\n### Hits per second at concurrency {c}\n\n\
         {:.0} s per row after 1 s of warm-up, the 256 stored bodies (the cache-off row sends \
         the same ones to the engine). Everything shares the machine's CPUs: the load \
         generator, router, engine and Redis compete, as in section 2's shared rows. CPU s \
         are utime+stime over the row.\n",
        phase.as_secs_f64()
    );
    t.push_str(
        "| request | target | requests | errors | req/s | p50 µs | p99 µs | router CPU s (cores) | router CPU µs/req | engine CPU s | Redis CPU µs/req | client CPU s | x-cache |\n\
         | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n",
    );
    for stream in [false, true] {
        let body = small_bodies(cli.max_tokens, stream);
        let request = if stream { "streamed" } else { "non-streamed" };
        for tg in &thr_targets {
            eprintln!("   {request}: {} c={c}", tg.label.replace("**", ""));
            load::run(&env.spec(
                vec![tg.addr],
                c,
                50_000,
                Duration::from_secs(1),
                &body,
                stream,
            ))
            .await;
            let (e0, r0, m0) = (usage(engine_pid), usage(redis_pid), usage(me));
            let row = env
                .cache_run(
                    tg,
                    &env.spec(vec![tg.addr], c, 5_000_000, phase, &body, stream),
                )
                .await?;
            let (e1, r1, m1) = (usage(engine_pid), usage(redis_pid), usage(me));
            let (x, x_ok) = row.x_cache(tg.expect);
            ok &= x_ok && row.res.errors == 0;
            if let Some(e) = &row.res.first_error {
                eprintln!("   {} errors, first: {e}", row.res.errors);
            }
            let p = row.res.latency_us();
            let wall = row.res.elapsed.as_secs_f64().max(1e-9);
            let per = row.res.samples.len().max(1) as f64;
            let router_cells = if tg.router.is_some() {
                format!(
                    "{:.2} ({:.2}) | {:.0}",
                    row.router_cpu_s,
                    row.router_cpu_s / wall,
                    row.router_cpu_s * 1e6 / per
                )
            } else {
                "– | –".into()
            };
            let redis_cell = if tg.router.is_some_and(|r| std::ptr::eq(r, &redis)) {
                format!("{:.0}", env.cpu_s(&r0, &r1) * 1e6 / per)
            } else {
                "–".into()
            };
            let _ = writeln!(
                t,
                "| {request} | {} | {} | {} | {:.0} | {:.0} | {:.0} | {router_cells} | {:.2} | {redis_cell} | {:.2} | {x} |",
                tg.label,
                row.res.samples.len(),
                row.res.errors,
                row.res.req_per_s(),
                p.p50,
                p.p99,
                env.cpu_s(&e0, &e1),
                env.cpu_s(&m0, &m1),
            );
        }
    }

    // 3. Memory per stored answer.
    let entries = cli.cache_entries.max(10);
    let tenth = entries / 10;
    let first = fresh.take(entries);
    let fill_body = |from: u64| fresh_bodies(cli.cache_entry_tokens, false, from);
    let answer_bytes = {
        let engine = Admin::new(&urls[0])?;
        let (status, _, b) = engine.call(CHAT, Some(fill_body(first)(0))).await?;
        if !status.is_success() {
            return Err(format!(
                "the engine answered {status} to a memory-row request"
            ));
        }
        b.len()
    };
    let _ = writeln!(
        t,
        "\n### Memory per stored answer (in-process store)\n\n\
         Two fresh routers, one with the in-process cache and one with it off, each sent the \
         same {entries} distinct non-streamed chat requests (concurrency {c}, {} bytes of \
         JSON each, max_tokens {}: answers of {answer_bytes} bytes), in two steps: the first \
         {tenth}, then the rest; each reading after every answer was stored. The cache-off \
         router grows by its radix tree (the same prompts) and whatever the request path \
         keeps; the difference is the cache's. Store bytes and entries are \
         `{RC}bytes` / `{RC}entries`.\n",
        fill_body(first)(0).len(),
        cli.cache_entry_tokens,
    );
    t.push_str(
        "| router | point | requests | entries | store bytes | tree_nodes | router RSS |\n\
         | --- | --- | ---: | ---: | ---: | ---: | ---: |\n",
    );
    let mut marginal = Vec::new();
    for (label, yaml, cache_on) in [
        ("cache off", "", false),
        ("in-process cache", mem_yaml, true),
    ] {
        eprintln!("   memory: {label}, {entries} distinct requests");
        let r = env
            .cache_router(&urls, yaml, &format!("cache_mem_{cache_on}"), procs)
            .await?;
        let idle = mem_point(&r, 0, cache_on).await?;
        let mut points = vec![("idle", idle)];
        let mut errors = 0;
        for (step, from, count) in [
            ("after the first tenth", first, tenth),
            ("after all", first + tenth, entries - tenth),
        ] {
            let res = load::run(&env.spec(
                vec![r.proc.addr],
                c,
                count,
                Duration::from_secs(30),
                &fill_body(from),
                false,
            ))
            .await;
            errors += res.errors;
            if let Some(e) = &res.first_error {
                eprintln!("   {} errors, first: {e}", res.errors);
            }
            let done = points.last().map_or(0, |p| p.1.requests) + res.samples.len() as u64;
            if cache_on {
                wait_stores(&r.admin, done, Duration::from_secs(10)).await?;
            }
            points.push((step, mem_point(&r, done, cache_on).await?));
        }
        ok &= errors == 0;
        for (point, p) in &points {
            let _ = writeln!(
                t,
                "| {label} | {point} | {} | {} | {} | {} | {} |",
                p.requests,
                if cache_on {
                    p.entries.to_string()
                } else {
                    "–".into()
                },
                if cache_on {
                    mib(p.bytes / 1024)
                } else {
                    "–".into()
                },
                p.tree_nodes,
                mib(p.rss_kib)
            );
        }
        let (a, b) = (points[1].1, points[2].1);
        // Per stored answer with the cache on, per request with it off.
        let (da, db) = if cache_on {
            (a.entries, b.entries)
        } else {
            (a.requests, b.requests)
        };
        let rss = (b.rss_kib.saturating_sub(a.rss_kib) * 1024) as f64;
        let whole = (b.rss_kib.saturating_sub(idle.rss_kib) * 1024) as f64;
        marginal.push((
            rss / db.saturating_sub(da).max(1) as f64,
            whole / db.max(1) as f64,
            b,
        ));
        if cache_on && b.entries < b.requests {
            ok = false;
            let _ = writeln!(
                t,
                "\n**only {} of {} answers stored**",
                b.entries, b.requests
            );
        }
        if errors > 0 {
            let _ = writeln!(t, "\nrouter log tail:\n```\n{}\n```", r.proc.log_tail());
        }
    }
    if let [(off_m, off_w, _), (on_m, on_w, on_b)] = marginal[..] {
        let weight = on_b.bytes as f64 / on_b.entries.max(1) as f64;
        let _ = writeln!(
            t,
            "\nRSS growth from the first tenth to all: cache on {on_m:.0} bytes per stored \
             answer, cache off {off_m:.0} bytes per request; **the cache's share: {:.0} bytes \
             per entry** (whole fill from idle: {on_w:.0} − {off_w:.0} = {:.0}). The store's own \
             weight: **{weight:.0} bytes per entry** (`{RC}bytes` / `{RC}entries`: the \
             {answer_bytes}-byte body, the content type and a fixed 128 bytes of accounted \
             overhead); the RSS share is {:.1}× that. {} evictions.",
            on_m - off_m,
            on_w - off_w,
            (on_m - off_m) / weight.max(1.0),
            on_b.evictions,
        );
    }
    if !ok {
        for r in [&off, &mem, &redis] {
            let _ = writeln!(t, "\nrouter log tail:\n```\n{}\n```", r.proc.log_tail());
        }
    }
    Ok((t, ok))
}

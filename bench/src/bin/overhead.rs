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
//!
//! Every section starts fresh processes (engines at `--time-factor`, default 0 =
//! answer at once; router with `log: {level: warn}`) and kills them at its end, on
//! every path. Load is closed-loop ([`bench::load`]): one keep-alive connection per
//! concurrent worker; every loop is bounded in count and time. Each section ends
//! with the machine's CPU time split into this benchmark's processes and others, so
//! a run disturbed by unrelated load shows it.
//!
//! Usage: `cargo build --release -p bench -p cache-aware-router`, then
//! `target/release/overhead` (about 2 minutes on 2 cores; `--only tree` etc.).

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
use http_body_util::{BodyExt, Empty};
use hyper::Uri;
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
}

/// Measure the router's overhead against simulated vLLM engines on 127.0.0.1.
#[derive(Debug, Parser)]
#[command(name = "overhead", version)]
struct Cli {
    /// Sections to run, comma-separated: added, saturation, streams5k, tree.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "added,saturation,streams5k,tree"
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

/// `GET /workers` of a router.
struct Admin {
    client: Client<HttpConnector, Empty<Bytes>>,
    uri: Uri,
}

impl Admin {
    fn new(router_url: &str) -> Result<Self, String> {
        Ok(Admin {
            client: Client::builder(TokioExecutor::new()).build(HttpConnector::new()),
            uri: format!("{router_url}/workers")
                .parse()
                .map_err(|e| format!("bad /workers URL: {e}"))?,
        })
    }

    async fn workers(&self) -> Result<Value, String> {
        let call = async {
            let resp = self
                .client
                .get(self.uri.clone())
                .await
                .map_err(|e| format!("GET /workers: {e}"))?;
            let status = resp.status();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| format!("GET /workers body: {e}"))?
                .to_bytes();
            if !status.is_success() {
                return Err(format!("GET /workers answered {status}"));
            }
            serde_json::from_slice::<Value>(&body).map_err(|e| format!("GET /workers JSON: {e}"))
        };
        tokio::time::timeout(Duration::from_secs(10), call)
            .await
            .map_err(|_| "GET /workers took over 10 s".to_string())?
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

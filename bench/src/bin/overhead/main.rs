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
//!   `--streams-rounds` times on the same router, each followed by `--streams-rest-s`
//!   of rest with RSS read every second (whether the burst's memory comes back), then
//!   RSS and open fds after 10 s more idle (pooled upstream connections expire).
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
//! - `soak` (not in the default list: 10 minutes by default): the new-turn workload
//!   (~2 KB bodies, 8 system prompts, a new user turn every request, so every request
//!   inserts into the tree) at `--soak-concurrency` for `--soak-s` against 4 engines,
//!   the tree capped at `--soak-tree-size` nodes; RSS, tree nodes and bytes and router
//!   CPU per request over time, and RSS at 2 minutes against the end.
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
//!
//! Parts: `env` (what every section shares: processes, admin calls, /proc readings),
//! one module per section (`added`, `saturation`, `streams`, `tree`, `cache`).

mod added;
mod cache;
mod env;
mod saturation;
mod soak;
mod streams;
mod tree;

use std::path::PathBuf;
use std::process::ExitCode;

use bench::procs::{self, ChildProc, secs};
use clap::{Parser, ValueEnum};
use tokio::time::Instant;

use env::{Env, machine_facts, usage, usage_sum};

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
    /// RSS over a long run of new turns with the tree at its cap.
    Soak,
}

/// Measure the router's overhead against simulated vLLM engines on 127.0.0.1.
#[derive(Debug, Parser)]
#[command(name = "overhead", version)]
struct Cli {
    /// Sections to run, comma-separated: added, saturation, streams5k, tree, cache, soak.
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
    /// Rest after each round of the streams section, RSS read every second, in s.
    #[arg(long, default_value_t = 60.0)]
    streams_rest_s: f64,
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
    /// Length of the soak section, in s.
    #[arg(long, default_value_t = 600.0)]
    soak_s: f64,
    /// Between two readings of the soak section, in s.
    #[arg(long, default_value_t = 5.0)]
    soak_every_s: f64,
    /// Concurrency of the soak section.
    #[arg(long, default_value_t = 64)]
    soak_concurrency: usize,
    /// The soak router's `cache.max_tree_size`, in nodes (low enough to reach early).
    #[arg(long, default_value_t = 200_000)]
    soak_tree_size: usize,
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
    procs::run_interruptible("overhead", cli.client_threads, run(cli, nofile))
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

/// A section's markdown and whether it saw no errors, or why it could not run.
type Report = Result<(String, bool), String>;

/// Runs the sections; `Ok(false)` when one failed or saw errors.
async fn try_run(cli: Cli, nofile: u64) -> Result<bool, String> {
    let env = environment(&cli)?;
    let command: Vec<String> = std::env::args().map(|a| procs::shell_quote(&a)).collect();
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
        all_ok &= run_section(s, &env, &cli, nofile).await;
    }
    Ok(all_ok)
}

/// The checked flags and binaries every section runs with.
fn environment(cli: &Cli) -> Result<Env, String> {
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
    Ok(env)
}

/// Runs one section with processes of its own, prints its text (or its failure) and
/// the machine's CPU time over it; false when it failed or saw errors.
async fn run_section(s: Section, env: &Env, cli: &Cli, nofile: u64) -> bool {
    let t0 = Instant::now();
    eprintln!("== {s:?}");
    let (busy0, me0) = (procs::machine_busy_ticks(), usage(std::process::id()));
    let mut procs = Vec::new();
    let r = match s {
        Section::Added => added::run(env, cli, &mut procs).await,
        Section::Saturation => saturation::run(env, cli, &mut procs).await,
        Section::Streams5k => streams::run(env, cli, nofile, &mut procs).await,
        Section::Tree => tree::run(env, cli, &mut procs).await,
        Section::Cache => cache::run(env, cli, &mut procs).await,
        Section::Soak => soak::run(env, cli, &mut procs).await,
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
    let cpu_line = match busy {
        Some((tasks, interrupts)) => cpu_line(env, t0, ours, tasks, interrupts),
        None => String::new(),
    };
    let ok = match r {
        Ok((text, ok)) => {
            println!("{text}\n{cpu_line}");
            ok
        }
        Err(e) => {
            println!("## {s:?}: FAILED\n\n{e}\n");
            false
        }
    };
    eprintln!("== {s:?}: {:.0} s", t0.elapsed().as_secs_f64());
    ok
}

/// The machine's CPU time over a section: this benchmark's processes (`ours`),
/// interrupts and every other process, in clock ticks.
fn cpu_line(env: &Env, t0: Instant, ours: u64, tasks: u64, interrupts: u64) -> String {
    let wall = t0.elapsed().as_secs_f64();
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

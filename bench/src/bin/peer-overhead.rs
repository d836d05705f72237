//! `peer-overhead`: what each router costs per request, ours against the peer
//! routers (sglang-router, vllm-router) and against nginx as a plain round-robin
//! reverse proxy, measured against `sim-engine` replicas on 127.0.0.1 that answer
//! at once, printed as markdown tables.
//!
//! For each engine count (`--engines`, default 1 and 2) the engines are started
//! once; then each router in turn (`--routers`, each with `--policy`, default
//! `cache_aware`) is started in front of them, and for each mode (non-streamed,
//! streamed) and concurrency (`--concurrency`, default 1, 64, 512) a cell runs:
//! warm-up, then half the direct time straight to the engines (client round
//! robin), the router time through the router, the other half direct again, so
//! drift cancels. added = through the router − direct, per percentile. The router
//! is stopped before the next one starts. Load is closed-loop ([`bench::load`]):
//! one keep-alive connection per concurrent client, small chat requests
//! (`max_tokens` 8, `--max-tokens`; streamed ones `--stream-max-tokens`, one SSE
//! event per token plus the role, usage and `[DONE]` events; bodies padded to
//! `--prompt-bytes`); every cell is bounded in time and count. Router CPU is the
//! utime+stime of its process tree (nginx: master + workers) over the router run
//! of a cell, its RSS the tree's at the end of the cell.
//!
//! Ours runs with its access log at `--router-log-level` (default `info`, its own
//! default: one access line per request, written to a file in a scratch dir).
//! Peers run from their PyPI packages in a virtualenv (`bench/peers/run.sh` makes
//! it) with only what they need to run: address, worker URLs, policy, and a log
//! level (`--peer-log-level`, default `warn`). nginx (`--routers ...,nginx`; the
//! Debian package, `--nginx-bin`) runs [`matrix::nginx_config`]: `proxy_pass` round
//! robin, upstream keep-alive pool, buffering off, `worker_processes auto`, access
//! log off unless `--nginx-access-log`.
//!
//! Workloads (`--workloads`, each a whole run with its own report): `repeated`, 256
//! fixed bodies cycled (after the first 256 a prefix tree only answers hits), and
//! `new-turn`, 8 fixed system prompts and a user turn never sent before on every
//! request (every request also inserts into the tree, as real traffic does). Each
//! router's RSS is read every second over its run and reported over time.
//!
//! Usage: `cargo build --release --workspace`, then `target/release/peer-overhead`
//! (about 4 minutes on 2 cores); against nginx:
//! `target/release/peer-overhead --routers ours,nginx --engines 4 --prompt-bytes 2048
//! --stream-max-tokens 20 --concurrency 1,64 --workloads new-turn,repeated`.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use bench::load::{self, LoadResult, LoadSpec};
use bench::matrix::{self, Peer, PeerSetup, RouterKind, StartedRouter};
use bench::procs::{self, ChildProc, EngineParams, ProcUsage, addr_of, secs};
use bench::stats::Percentiles;
use clap::{Parser, ValueEnum};
use tokio::time::Instant;

const CHAT: &str = "/v1/chat/completions";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum)]
enum RouterArg {
    /// cache-aware-router (this project).
    Ours,
    /// sglang-router.
    Sglang,
    /// vllm-router.
    Vllm,
    /// nginx as a plain round-robin reverse proxy (the cost of proxying alone).
    Nginx,
}

impl RouterArg {
    fn kind(self) -> RouterKind {
        match self {
            RouterArg::Ours => RouterKind::Ours,
            RouterArg::Sglang => RouterKind::Peer(Peer::Sglang),
            RouterArg::Vllm => RouterKind::Peer(Peer::Vllm),
            RouterArg::Nginx => RouterKind::Nginx,
        }
    }
}

/// What the chat bodies are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum)]
enum Workload {
    /// 256 fixed bodies cycled ([`load::chat_bodies`]): after the first 256 every
    /// request repeats an earlier one byte for byte, so a prefix tree only answers hits.
    Repeated,
    /// 8 fixed system prompts and a new user turn every request
    /// ([`load::new_turn_bodies`]): every request also inserts into the tree, as real
    /// traffic does.
    NewTurn,
}

impl Workload {
    fn describe(self) -> &'static str {
        match self {
            Workload::Repeated => {
                "repeated bodies (256 fixed bodies cycled: after the first 256 every request \
                 repeats an earlier one, so a prefix tree only answers hits)"
            }
            Workload::NewTurn => {
                "new turn per request (8 fixed system prompts, then a user turn of ~160 bytes \
                 never sent before: every request also inserts into the prefix tree)"
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum)]
enum Mode {
    /// Non-streamed: one JSON answer.
    Plain,
    /// Streamed (SSE), timed to the end of the stream and to the first byte.
    Stream,
}

/// Added latency, requests/s, CPU and memory of cache-aware-router, sglang-router,
/// vllm-router and nginx over simulated engines on 127.0.0.1.
#[derive(Debug, Parser)]
#[command(name = "peer-overhead", version)]
struct Cli {
    /// Routers, comma-separated: ours, sglang, vllm, nginx (a plain round-robin
    /// reverse proxy; not in the default list).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "ours,sglang,vllm"
    )]
    routers: Vec<RouterArg>,
    /// Routing policy given to every router but nginx (round robin).
    #[arg(long, default_value = "cache_aware")]
    policy: String,
    /// Engine counts behind each router, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    engines: Vec<usize>,
    /// Concurrent clients (= connections), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,64,512")]
    concurrency: Vec<usize>,
    /// Modes, comma-separated: plain (non-streamed), stream.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "plain,stream"
    )]
    modes: Vec<Mode>,
    /// Time through the router per cell, in s (direct gets the same, in two halves).
    #[arg(long, default_value_t = 2.0)]
    cell_s: f64,
    /// Warm-up per cell and target, in s (not measured).
    #[arg(long, default_value_t = 0.5)]
    warm_s: f64,
    /// Most requests per measured run.
    #[arg(long, default_value_t = 500_000)]
    cell_max_requests: u64,
    /// max_tokens of the small chat requests.
    #[arg(long, default_value_t = 8)]
    max_tokens: u64,
    /// max_tokens of the streamed requests (one SSE event per token, plus the
    /// role, usage and `[DONE]` events) [default: --max-tokens].
    #[arg(long)]
    stream_max_tokens: Option<u64>,
    /// Pad the shared system prompt so that each request body is about this many
    /// bytes (e.g. 2048 for ~2 KB chat bodies; 0: unpadded, about 300 bytes; new-turn
    /// bodies are at least ~400 bytes).
    #[arg(long, default_value_t = 0)]
    prompt_bytes: usize,
    /// Workloads, comma-separated, each a whole run with its own report: repeated
    /// (256 bodies cycled: the tree only hits), new-turn (8 system prompts and a new
    /// user turn every request: every request inserts into the tree).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "repeated")]
    workloads: Vec<Workload>,
    /// `log.level` of ours (`info`, its default: one access line per request;
    /// `warn`: none). The last one given wins (`bench/peers/run.sh` passes `warn`).
    #[arg(long, default_value = "info", overrides_with = "router_log_level")]
    router_log_level: String,
    /// Virtualenv holding the peer routers (`bin/smg`, `bin/vllm-router`).
    #[arg(long, default_value = "/tmp/peers-venv")]
    peer_venv: PathBuf,
    /// sglang-router's `smg` [default: PEER_VENV/bin/smg].
    #[arg(long)]
    sglang_bin: Option<PathBuf>,
    /// vllm-router's executable [default: PEER_VENV/bin/vllm-router].
    #[arg(long)]
    vllm_bin: Option<PathBuf>,
    /// `--log-level` given to the peers (`warn`: no line per request; `default`:
    /// leave theirs, `info`, where sglang-router logs two lines per request).
    #[arg(long, default_value = "warn")]
    peer_log_level: String,
    /// nginx executable (the Debian package's).
    #[arg(long, default_value = "/usr/sbin/nginx")]
    nginx_bin: PathBuf,
    /// nginx writes an access log line per request (the default `combined`
    /// format, to a file), like ours at `info`; off by default (plain proxy).
    #[arg(long)]
    nginx_access_log: bool,
    /// sim-engine executable [default: next to this executable].
    #[arg(long)]
    engine_bin: Option<PathBuf>,
    /// cache-aware-router executable [default: next to this executable].
    #[arg(long)]
    router_bin: Option<PathBuf>,
    /// Longest wait for engines and a router to be ready, in s.
    #[arg(long, default_value_t = 60.0)]
    startup_timeout_s: f64,
    /// Limit per request, in s.
    #[arg(long, default_value_t = 30.0)]
    request_timeout_s: f64,
    /// Measure every router this many times, the routers taking turns (ours, nginx,
    /// ours, nginx, …), so that a slow stretch of a shared machine does not fall on one
    /// of them. Each cell then reports the router's median round (by router CPU), and
    /// "Ours against nginx" adds each round's CPU ratio.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // 512 client connections plus the routers' own: raise the soft fd limit.
    let _ = rlimit::increase_nofile_limit(u64::MAX);
    procs::run_interruptible("peer-overhead", 0, run(cli))
}

async fn run(cli: Cli) -> ExitCode {
    match try_run(cli).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("peer-overhead: {e}");
            ExitCode::from(2)
        }
    }
}

/// One measured cell.
struct Cell {
    router: RouterKind,
    engines: usize,
    mode: Mode,
    c: usize,
    direct: LoadResult,
    via: LoadResult,
    router_cpu_us_per_req: f64,
    /// RSS of the router's process tree at the end of the cell, KiB.
    router_rss_kib: u64,
    /// Which of the `--rounds` it was measured in (0-based).
    round: usize,
}

impl Cell {
    fn added(&self, p: fn(&Percentiles) -> f64, ttfb: bool) -> f64 {
        let (d, v) = if ttfb {
            (self.direct.ttfb_us(), self.via.ttfb_us())
        } else {
            (self.direct.latency_us(), self.via.latency_us())
        };
        p(&v) - p(&d)
    }

    fn errors(&self) -> u64 {
        self.direct.errors + self.via.errors
    }
}

/// What one router process used over all its cells.
struct RouterRun {
    router: RouterKind,
    engines: usize,
    how: String,
    idle: ProcUsage,
    end: ProcUsage,
    other: Option<procs::OtherCpu>,
    error: Option<String>,
    /// `(s since start, RSS KiB)` of its process tree, read every second.
    rss: Vec<(f64, u64)>,
}

fn machine_facts() -> String {
    format!(
        "{}; load generator, routers and engines on the same machine over 127.0.0.1",
        procs::machine_summary()
    )
}

struct Ctx {
    cli: Cli,
    /// The workload being run (one of `cli.workloads`).
    workload: Workload,
    engine_bin: PathBuf,
    router_bin: PathBuf,
    peers: PeerSetup,
    startup: Duration,
    request_timeout: Duration,
    cell: Duration,
    warm: Duration,
    clk_tck: f64,
}

impl Ctx {
    fn max_tokens(&self, stream: bool) -> u64 {
        match self.cli.stream_max_tokens {
            Some(n) if stream => n,
            _ => self.cli.max_tokens,
        }
    }

    fn bodies(&self, stream: bool) -> load::BodyFn {
        let (tokens, bytes) = (self.max_tokens(stream), self.cli.prompt_bytes);
        match self.workload {
            Workload::Repeated => load::chat_bodies(tokens, stream, bytes),
            Workload::NewTurn => load::new_turn_bodies(tokens, stream, bytes),
        }
    }

    fn spec(&self, targets: Vec<SocketAddr>, c: usize, d: Duration, stream: bool) -> LoadSpec {
        LoadSpec {
            targets,
            path: CHAT.into(),
            concurrency: c,
            max_requests: self.cli.cell_max_requests,
            max_duration: d,
            request_timeout: self.request_timeout,
            stream,
            body: self.bodies(stream),
            stop: None,
            progress: None,
        }
    }
}

async fn try_run(cli: Cli) -> Result<bool, String> {
    if cli.engines.contains(&0) {
        return Err("--engines values must be at least 1".into());
    }
    let mut peers = PeerSetup::from_venv(
        &cli.peer_venv,
        (cli.peer_log_level != "default").then(|| cli.peer_log_level.clone()),
    );
    if let Some(b) = &cli.sglang_bin {
        peers.sglang_bin = b.clone();
    }
    if let Some(b) = &cli.vllm_bin {
        peers.vllm_bin = b.clone();
    }
    peers.nginx_bin = cli.nginx_bin.clone();
    peers.nginx_access_log = cli.nginx_access_log;
    if cli.routers.contains(&RouterArg::Nginx) {
        procs::require_binary(
            &peers.nginx_bin,
            "nginx",
            "install the Debian package (`apt-get install nginx`) or pass --nginx-bin",
        )
        .map_err(|e| e.to_string())?;
    }
    let mut ctx = Ctx {
        workload: Workload::Repeated,
        engine_bin: cli
            .engine_bin
            .clone()
            .unwrap_or_else(|| procs::sibling_binary("sim-engine")),
        router_bin: cli
            .router_bin
            .clone()
            .unwrap_or_else(|| procs::sibling_binary("cache-aware-router")),
        peers,
        startup: secs(cli.startup_timeout_s, "--startup-timeout-s")?,
        request_timeout: secs(cli.request_timeout_s, "--request-timeout-s")?,
        cell: secs(cli.cell_s, "--cell-s")?,
        warm: secs(cli.warm_s, "--warm-s")?,
        clk_tck: procs::clock_ticks_per_sec() as f64,
        cli,
    };
    procs::require_binary(
        &ctx.engine_bin,
        "sim-engine",
        "build it with `cargo build --release --workspace` or pass --engine-bin",
    )
    .map_err(|e| e.to_string())?;
    let command: Vec<String> = std::env::args().map(|a| procs::shell_quote(&a)).collect();
    println!("# Router overhead: ours vs the peer routers and nginx\n");
    println!("command: `{}`  ", command.join(" "));
    println!("{}\n", machine_facts());
    let mut ok = true;
    let mut workloads = ctx.cli.workloads.clone();
    workloads.dedup();
    for w in workloads {
        ctx.workload = w;
        ok &= run_workload(&ctx).await?;
    }
    Ok(ok)
}

/// Every engine count, router and cell of one workload, then its report.
async fn run_workload(ctx: &Ctx) -> Result<bool, String> {
    eprintln!("== workload {:?}", ctx.workload);
    let t0 = Instant::now();
    let mut cells: Vec<Cell> = Vec::new();
    let mut runs: Vec<RouterRun> = Vec::new();
    for &n in &ctx.cli.engines {
        let mut procs_engines = Vec::new();
        let r = engines_round(ctx, n, &mut procs_engines, &mut cells, &mut runs).await;
        procs::stop_all(procs_engines).await;
        r?;
    }
    let ratios = round_ratios(&cells);
    let cells = median_cells(cells);
    let text = report(ctx, &cells, &ratios, &runs, t0.elapsed());
    println!("{text}");
    Ok(cells.iter().all(|c| c.errors() == 0) && runs.iter().all(|r| r.error.is_none()))
}

/// Starts `n` engines, then each router in front of them in turn.
async fn engines_round(
    ctx: &Ctx,
    n: usize,
    procs_engines: &mut Vec<ChildProc>,
    cells: &mut Vec<Cell>,
    runs: &mut Vec<RouterRun>,
) -> Result<(), String> {
    let params = EngineParams {
        kv_blocks: 65_536,
        block_size: 16,
        ttft_base_ms: 20.0,
        prefill_us_per_token: 80.0,
        itl_ms: 15.0,
        time_factor: 0.0,
        max_output_tokens: 4096,
        model: "m".into(),
        ..EngineParams::default()
    };
    let mut urls = Vec::with_capacity(n);
    for i in 0..n {
        urls.push(
            procs::start_engine(
                &ctx.engine_bin,
                &params,
                &format!("e{i}"),
                0,
                ctx.startup,
                procs_engines,
            )
            .await
            .map_err(|e| e.to_string())?,
        );
    }
    let direct: Vec<SocketAddr> = urls.iter().map(|u| addr_of(u)).collect::<Result<_, _>>()?;
    let render = if ctx.cli.routers.contains(&RouterArg::Vllm) {
        Some(matrix::render_status(&urls[0]).await)
    } else {
        None
    };
    let rounds = ctx.cli.rounds.max(1);
    for (round, &r) in (0..rounds).flat_map(|i| ctx.cli.routers.iter().map(move |r| (i, r))) {
        let kind = r.kind();
        eprintln!(
            "== {} in front of {n} engine(s){}",
            kind.name(),
            if rounds > 1 {
                format!(", round {} of {rounds}", round + 1)
            } else {
                String::new()
            }
        );
        let first_cell = cells.len();
        let mut procs_router = Vec::new();
        let started = start(ctx, kind, &urls, &mut procs_router).await;
        let run = match started {
            Ok(router) => {
                let mut how = router.how.clone();
                if let (RouterArg::Vllm, Some(note)) = (r, &render) {
                    let _ = write!(how, "; {note}");
                }
                let idle = procs::tree_usage(router.pid).unwrap_or_default();
                let watch = procs::Disturbance::start(
                    procs_engines
                        .iter()
                        .chain(procs_router.iter())
                        .filter_map(ChildProc::pid)
                        .collect(),
                );
                let series = procs::RssSeries::start(router.pid, Duration::from_secs(1));
                let res = measure_router(ctx, kind, n, &direct, &router, cells).await;
                for c in &mut cells[first_cell..] {
                    c.round = round;
                }
                let rss = series.finish().await;
                let other = watch.finish();
                let end = procs::tree_usage(router.pid).unwrap_or_default();
                if res.is_err() {
                    eprintln!("router log tail:\n{}", router.log_tail(20));
                }
                RouterRun {
                    router: kind,
                    engines: n,
                    how,
                    idle,
                    end,
                    other,
                    error: res.err(),
                    rss,
                }
            }
            Err(e) => RouterRun {
                router: kind,
                engines: n,
                how: String::new(),
                idle: ProcUsage::default(),
                end: ProcUsage::default(),
                other: None,
                error: Some(e),
                rss: Vec::new(),
            },
        };
        if let Some(e) = &run.error {
            eprintln!("   FAILED: {e}");
        }
        runs.push(run);
        procs::stop_all(procs_router).await;
    }
    Ok(())
}

async fn start(
    ctx: &Ctx,
    kind: RouterKind,
    urls: &[String],
    procs_router: &mut Vec<ChildProc>,
) -> Result<StartedRouter, String> {
    let port = procs::free_port().map_err(|e| e.to_string())?;
    let log = format!("log: {{ level: {} }}\n", ctx.cli.router_log_level);
    matrix::start_any_router(
        kind,
        &ctx.cli.policy,
        &ctx.router_bin,
        &ctx.peers,
        (urls, &[]),
        port,
        &log,
        "m",
        ctx.startup,
        procs_router,
    )
    .await
    .map_err(|e| e.to_string())
}

/// Every (mode, concurrency) cell for one router.
async fn measure_router(
    ctx: &Ctx,
    kind: RouterKind,
    n: usize,
    direct: &[SocketAddr],
    router: &StartedRouter,
    cells: &mut Vec<Cell>,
) -> Result<(), String> {
    let via = vec![addr_of(&router.url)?];
    let half = ctx.cell / 2;
    for &mode in &ctx.cli.modes {
        let stream = mode == Mode::Stream;
        for &c in &ctx.cli.concurrency {
            eprintln!("   {mode:?} c={c}");
            for t in [direct.to_vec(), via.clone()] {
                load::run(&ctx.spec(t, c, ctx.warm, stream)).await;
            }
            let mut d = load::run(&ctx.spec(direct.to_vec(), c, half, stream)).await;
            let u0 = procs::tree_usage(router.pid).map_err(|e| format!("router gone: {e}"))?;
            let v = load::run(&ctx.spec(via.clone(), c, ctx.cell, stream)).await;
            let u1 = procs::tree_usage(router.pid).map_err(|e| format!("router gone: {e}"))?;
            d.merge(load::run(&ctx.spec(direct.to_vec(), c, half, stream)).await);
            // Both direct halves ran for `half` each: their wall time adds up.
            for (r, what) in [(&d, "direct"), (&v, "router")] {
                if let Some(e) = &r.first_error {
                    eprintln!("   {what}: {} errors, first: {e}", r.errors);
                }
            }
            let cpu_s = u1.cpu_ticks.saturating_sub(u0.cpu_ticks) as f64 / ctx.clk_tck;
            cells.push(Cell {
                router: kind,
                engines: n,
                mode,
                c,
                router_cpu_us_per_req: cpu_s * 1e6 / v.samples.len().max(1) as f64,
                router_rss_kib: u1.rss_kib,
                direct: d,
                via: v,
                round: 0,
            });
        }
    }
    Ok(())
}

fn mib(kib: u64) -> String {
    format!("{:.0} MiB", kib as f64 / 1024.0)
}

fn report(
    ctx: &Ctx,
    cells: &[Cell],
    ratios: &RoundRatios,
    runs: &[RouterRun],
    took: Duration,
) -> String {
    let mut t = intro(ctx, took);
    for &mode in &ctx.cli.modes {
        t.push_str(&mode_table(cells, mode));
    }
    t.push_str(&compact(&ctx.cli, cells));
    t.push_str(&best_table(ctx, cells, runs));
    t.push_str(&how_ran(runs));
    t.push_str(&rss_lines(runs));
    t.push('\n');
    t.push_str(&targets(cells, runs));
    t.push_str(&against_nginx(cells, ratios));
    t
}

/// How the cells were measured: bodies, timings, policy, log levels, rounds.
fn intro(ctx: &Ctx, took: Duration) -> String {
    let mut t = String::new();
    let cli = &ctx.cli;
    let _ = writeln!(t, "## Workload: {}\n", ctx.workload.describe());
    let _ = writeln!(
        t,
        "Engines answer at once (time factor 0). Chat requests ({} bytes of JSON, \
         max_tokens {}; streamed {} bytes, max_tokens {}: {} SSE events with the role, usage \
         and `[DONE]` ones), closed loop, one keep-alive connection per client; per cell: \
         warm-up {:.1} s to each target, then direct {:.1} s (client round robin over the \
         engines), router {:.1} s, direct {:.1} s. µs; added = router − direct per percentile. \
         Router CPU µs/req = utime+stime (/proc) of its process tree (nginx: master + workers) \
         over the router run / requests; RSS = the tree's at the end of the cell. Policy `{}` \
         for every router but nginx (round robin); ours logs at `{}`{}. Took {:.0} s.\n",
        ctx.bodies(false)(255).len(),
        ctx.max_tokens(false),
        ctx.bodies(true)(255).len(),
        ctx.max_tokens(true),
        ctx.max_tokens(true) + 3,
        cli.warm_s,
        cli.cell_s / 2.0,
        cli.cell_s,
        cli.cell_s / 2.0,
        cli.policy,
        cli.router_log_level,
        if !cli.routers.contains(&RouterArg::Nginx) {
            ""
        } else if cli.nginx_access_log {
            ", nginx writes its access log"
        } else {
            ", nginx has no access log"
        },
        took.as_secs_f64()
    );
    if cli.rounds > 1 {
        let _ = writeln!(
            t,
            "Each router was measured in {} rounds, taking turns; every cell below is the \
             router's median round by router CPU.\n",
            cli.rounds
        );
    }
    t
}

/// Every cell of one mode: direct and through the router, added latency, requests/s,
/// router CPU and RSS.
fn mode_table(cells: &[Cell], mode: Mode) -> String {
    let mut t = String::new();
    let stream = mode == Mode::Stream;
    let _ = writeln!(
        t,
        "### {}\n",
        if stream {
            "Streamed (latency to the end of the stream; TTFB to the first body byte)"
        } else {
            "Non-streamed"
        }
    );
    t.push_str(
        "| router | engines | c | direct p50 / p99 | via router p50 / p99 | **added p50 / p99** |",
    );
    if stream {
        t.push_str(" added TTFB p50 / p99 |");
    }
    t.push_str(" req/s via router (direct) | router CPU µs/req | router RSS | errors |\n| --- | ---: | ---: | ---: | ---: | ---: |");
    if stream {
        t.push_str(" ---: |");
    }
    t.push_str(" ---: | ---: | ---: | ---: |\n");
    for cell in cells.iter().filter(|c| c.mode == mode) {
        let (d, v) = (cell.direct.latency_us(), cell.via.latency_us());
        let _ = write!(
            t,
            "| {} | {} | {} | {:.0} / {:.0} | {:.0} / {:.0} | **{:+.0} / {:+.0}** |",
            cell.router.name(),
            cell.engines,
            cell.c,
            d.p50,
            d.p99,
            v.p50,
            v.p99,
            cell.added(|p| p.p50, false),
            cell.added(|p| p.p99, false),
        );
        if stream {
            let _ = write!(
                t,
                " {:+.0} / {:+.0} |",
                cell.added(|p| p.p50, true),
                cell.added(|p| p.p99, true)
            );
        }
        let _ = writeln!(
            t,
            " {:.0} ({:.0}) | {:.0} | {} | {} / {} |",
            cell.via.req_per_s(),
            cell.direct.req_per_s(),
            cell.router_cpu_us_per_req,
            mib(cell.router_rss_kib),
            cell.direct.errors,
            cell.via.errors
        );
    }
    t.push('\n');
    t
}

/// Most requests/s through each router (best cell), its memory and CPU in all.
fn best_table(ctx: &Ctx, cells: &[Cell], runs: &[RouterRun]) -> String {
    let mut t = String::new();
    t.push_str(
        "### Most requests/s through each router (best cell), and its memory\n\n\
         | router | engines | max req/s non-streamed (at c) | max req/s streamed (at c) | router RSS idle / peak | router CPU s in all | other processes' CPU meanwhile |\n\
         | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    let best = |k: RouterKind, n: usize, m: Mode| {
        cells
            .iter()
            .filter(|c| c.router == k && c.engines == n && c.mode == m)
            .map(|c| (c.via.req_per_s(), c.c))
            .max_by(|a, b| a.0.total_cmp(&b.0))
    };
    let cell_str =
        |b: Option<(f64, usize)>| b.map_or("–".into(), |(r, c)| format!("{r:.0} ({c})"));
    for r in runs {
        if let Some(e) = &r.error {
            let _ = writeln!(
                t,
                "| {} | {} | failed: {} | | | | |",
                r.router.name(),
                r.engines,
                e.lines().next().unwrap_or("")
            );
            continue;
        }
        let _ = writeln!(
            t,
            "| {} | {} | {} | {} | {} / {} | {:.1} | {} |",
            r.router.name(),
            r.engines,
            cell_str(best(r.router, r.engines, Mode::Plain)),
            cell_str(best(r.router, r.engines, Mode::Stream)),
            mib(r.idle.rss_kib),
            mib(r.end.hwm_kib),
            r.end.cpu_ticks.saturating_sub(r.idle.cpu_ticks) as f64 / ctx.clk_tck,
            r.other.map_or("–".into(), |o| o.to_string()),
        );
    }
    t
}

/// One line per router run: its RSS over the run (read every second).
fn rss_lines(runs: &[RouterRun]) -> String {
    let mut t =
        String::from("\nRouter RSS over each run (its process tree, read every second):\n\n");
    for (i, r) in runs.iter().enumerate().filter(|(_, r)| !r.rss.is_empty()) {
        let _ = writeln!(
            t,
            "- {} ({} engines, run {}): {}",
            r.router.name(),
            r.engines,
            i + 1,
            procs::rss_over_time(&r.rss, 8)
        );
    }
    t
}

/// One line per router and engine count: how it was started.
fn how_ran(runs: &[RouterRun]) -> String {
    let mut t = String::new();
    t.push_str("\nHow each router ran:\n\n");
    let mut seen = Vec::new();
    for r in runs {
        if seen.contains(&(r.router, r.engines)) || r.how.is_empty() {
            continue;
        }
        seen.push((r.router, r.engines));
        let _ = writeln!(
            t,
            "- {} ({} engine{}): {}",
            r.router.name(),
            r.engines,
            if r.engines == 1 { "" } else { "s" },
            r.how
        );
    }
    t
}

/// One row per router, engine count and mode; one column per concurrency:
/// added p50 / p99 and requests/s through the router.
fn compact(cli: &Cli, cells: &[Cell]) -> String {
    let mut t = String::from(
        "### Summary: added latency p50 / p99 (µs) and requests/s through the router\n\n\
         | router | engines | mode |",
    );
    for c in &cli.concurrency {
        let _ = write!(t, " c={c} |");
    }
    t.push_str("\n| --- | ---: | --- |");
    t.push_str(&" ---: |".repeat(cli.concurrency.len()));
    t.push('\n');
    let mut keys: Vec<(RouterKind, usize, Mode)> = Vec::new();
    for cell in cells {
        let k = (cell.router, cell.engines, cell.mode);
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    // Ours first, then the peers, each by engines then mode (cells run engines-major).
    keys.sort_by_key(|&(r, n, m)| (n, m == Mode::Stream, r != RouterKind::Ours));
    for (r, n, m) in keys {
        let _ = write!(
            t,
            "| {} | {n} | {} |",
            r.name(),
            if m == Mode::Stream {
                "streamed"
            } else {
                "non-streamed"
            }
        );
        for &c in &cli.concurrency {
            match cells
                .iter()
                .find(|x| x.router == r && x.engines == n && x.mode == m && x.c == c)
            {
                Some(x) => {
                    let _ = write!(
                        t,
                        " {:+.0} / {:+.0}, {:.1}k/s |",
                        x.added(|p| p.p50, false),
                        x.added(|p| p.p99, false),
                        x.via.req_per_s() / 1000.0
                    );
                }
                None => t.push_str(" – |"),
            }
        }
        t.push('\n');
    }
    t.push('\n');
    t
}

/// Our router against the best peer: added p50 per cell, and best requests/s.
fn targets(cells: &[Cell], runs: &[RouterRun]) -> String {
    let mut t = String::new();
    let peers: Vec<RouterKind> = runs
        .iter()
        .map(|r| r.router)
        .filter(|&k| matches!(k, RouterKind::Peer(_)))
        .fold(Vec::new(), |mut v, k| {
            if !v.contains(&k) {
                v.push(k);
            }
            v
        });
    if peers.is_empty() || !runs.iter().any(|r| r.router == RouterKind::Ours) {
        return t;
    }
    t.push_str("Targets (ours against the best peer in the same cell):\n\n");
    let mut met = 0;
    let mut missed = Vec::new();
    for ours in cells.iter().filter(|c| c.router == RouterKind::Ours) {
        let best_peer = cells
            .iter()
            .filter(|c| {
                matches!(c.router, RouterKind::Peer(_))
                    && c.engines == ours.engines
                    && c.mode == ours.mode
                    && c.c == ours.c
            })
            .map(|c| (c.added(|p| p.p50, false), c.router))
            .min_by(|a, b| a.0.total_cmp(&b.0));
        let Some((peer_added, peer)) = best_peer else {
            continue;
        };
        let us = ours.added(|p| p.p50, false);
        if us <= peer_added {
            met += 1;
        } else {
            missed.push(format!(
                "{:?} c={} {} engine(s): ours {us:+.0} µs vs {} {peer_added:+.0} µs",
                ours.mode,
                ours.c,
                ours.engines,
                peer.name()
            ));
        }
    }
    let _ = writeln!(
        t,
        "- added latency p50 ≤ the best peer's: met in {met} of {} cells{}",
        met + missed.len(),
        if missed.is_empty() {
            String::new()
        } else {
            format!("; **MISSED** in: {}", missed.join("; "))
        }
    );
    let engines: Vec<usize> = runs.iter().map(|r| r.engines).fold(Vec::new(), |mut v, n| {
        if !v.contains(&n) {
            v.push(n);
        }
        v
    });
    for n in engines {
        let best = |k: RouterKind| {
            cells
                .iter()
                .filter(|c| c.router == k && c.engines == n && c.mode == Mode::Plain)
                .map(|c| c.via.req_per_s())
                .fold(0.0, f64::max)
        };
        let ours = best(RouterKind::Ours);
        let Some((peer, peer_rps)) = peers
            .iter()
            .map(|&k| (k, best(k)))
            .max_by(|a, b| a.1.total_cmp(&b.1))
        else {
            continue;
        };
        if peer_rps <= 0.0 {
            continue;
        }
        let ratio = ours / peer_rps;
        let _ = writeln!(
            t,
            "- requests/s ≥ 1.5 × the best peer's ({n} engine(s), non-streamed, best cell): \
             {ours:.0} vs {peer_rps:.0} ({}) = {ratio:.2}×: {}",
            peer.name(),
            if ratio >= 1.5 { "met" } else { "**MISSED**" }
        );
    }
    t
}

/// Ours' router CPU over nginx's, per (engines, mode, c), one ratio per round in which
/// both were measured.
type RoundRatios = Vec<((usize, Mode, usize), Vec<f64>)>;

fn round_ratios(cells: &[Cell]) -> RoundRatios {
    let mut out: RoundRatios = Vec::new();
    for o in cells.iter().filter(|c| c.router == RouterKind::Ours) {
        let Some(x) = cells.iter().find(|x| {
            x.router == RouterKind::Nginx
                && (x.engines, x.mode, x.c, x.round) == (o.engines, o.mode, o.c, o.round)
        }) else {
            continue;
        };
        let r = o.router_cpu_us_per_req / x.router_cpu_us_per_req.max(f64::MIN_POSITIVE);
        let key = (o.engines, o.mode, o.c);
        match out.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => v.push(r),
            None => out.push((key, vec![r])),
        }
    }
    out
}

/// Ours' router CPU over nginx's in cell `o` against `x`, and how it was had: with one
/// round, the two cells' ratio; with several, the median of the rounds' own ratios
/// (each round's pair ran back to back, so a slow stretch of the machine weighs on
/// both), and the text that lists them.
fn cpu_ratio(o: &Cell, x: &Cell, ratios: &RoundRatios) -> (f64, String) {
    let single = o.router_cpu_us_per_req / x.router_cpu_us_per_req.max(f64::MIN_POSITIVE);
    match ratios.iter().find(|(k, _)| *k == (o.engines, o.mode, o.c)) {
        Some((_, v)) if v.len() > 1 => {
            let each: Vec<String> = v.iter().map(|r| format!("{r:.2}×")).collect();
            let mut sorted = v.clone();
            sorted.sort_by(f64::total_cmp);
            (
                sorted[(sorted.len() - 1) / 2],
                format!(" (median rounds); per round {}, median", each.join(", ")),
            )
        }
        _ => (single, String::new()),
    }
}

/// One cell per router, engine count, mode and concurrency: with several rounds, the
/// round of median router CPU (the lower middle one of an even count), in the order the
/// cells were first measured.
fn median_cells(cells: Vec<Cell>) -> Vec<Cell> {
    let mut groups: Vec<Vec<Cell>> = Vec::new();
    for c in cells {
        match groups.iter_mut().find(|g| {
            let f = &g[0];
            (f.router, f.engines, f.mode, f.c) == (c.router, c.engines, c.mode, c.c)
        }) {
            Some(g) => g.push(c),
            None => groups.push(vec![c]),
        }
    }
    groups
        .into_iter()
        .filter_map(|mut g| {
            g.sort_by(|a, b| a.router_cpu_us_per_req.total_cmp(&b.router_cpu_us_per_req));
            let mid = (g.len() - 1) / 2;
            g.into_iter().nth(mid)
        })
        .collect()
}

/// Ours against nginx, per engine count where both ran (issue 17's targets):
/// non-streamed CPU/request at c=64 ≤ 2×, added p50 at c=1 ≤ 3×, requests/s at
/// c=64 ≥ 0.6× nginx's, RSS at the end of the c=64 cell ≤ 50 MB; streamed: added
/// TTFB p50 at c=1 ≤ 0.2 ms and CPU/request at c=64 ≤ 2× nginx's.
fn against_nginx(cells: &[Cell], ratios: &RoundRatios) -> String {
    let mut t = String::new();
    let find = |k: RouterKind, n: usize, m: Mode, c: usize| {
        cells
            .iter()
            .find(|x| x.router == k && x.engines == n && x.mode == m && x.c == c)
    };
    let mut engines: Vec<usize> = cells
        .iter()
        .filter(|c| c.router == RouterKind::Nginx)
        .map(|c| c.engines)
        .collect();
    engines.dedup();
    let verdict = |ok: bool| if ok { "met" } else { "**MISSED**" };
    for n in engines {
        let mut lines: Vec<String> = Vec::new();
        let pair = |m: Mode, c: usize| {
            Some((
                find(RouterKind::Ours, n, m, c)?,
                find(RouterKind::Nginx, n, m, c)?,
            ))
        };
        if let Some((o, x)) = pair(Mode::Plain, 64) {
            let (r, how) = cpu_ratio(o, x, ratios);
            lines.push(format!(
                "non-streamed c=64: router CPU {:.0} vs {:.0} µs/req{how} = {r:.2}× (≤ 2×): {}",
                o.router_cpu_us_per_req,
                x.router_cpu_us_per_req,
                verdict(r <= 2.0),
            ));
            let r = o.via.req_per_s() / x.via.req_per_s().max(f64::MIN_POSITIVE);
            lines.push(format!(
                "non-streamed c=64: requests/s {:.0} vs {:.0} = {r:.2}× (≥ 0.6×): {}",
                o.via.req_per_s(),
                x.via.req_per_s(),
                verdict(r >= 0.6)
            ));
            let mb = o.router_rss_kib as f64 * 1024.0 / 1e6;
            lines.push(format!(
                "non-streamed c=64: ours RSS {mb:.1} MB (nginx {:.1} MB) (≤ 50 MB): {}",
                x.router_rss_kib as f64 * 1024.0 / 1e6,
                verdict(mb <= 50.0)
            ));
        }
        if let Some((o, x)) = pair(Mode::Plain, 1) {
            let (a, b) = (o.added(|p| p.p50, false), x.added(|p| p.p50, false));
            lines.push(format!(
                "non-streamed c=1: added p50 {a:+.0} vs {b:+.0} µs = {:.2}× (≤ 3×): {}",
                a / b.max(1.0),
                verdict(a <= 3.0 * b.max(1.0))
            ));
        }
        if let Some((o, x)) = pair(Mode::Stream, 1) {
            let (a, b) = (o.added(|p| p.p50, true), x.added(|p| p.p50, true));
            lines.push(format!(
                "streamed c=1: added TTFB p50 {a:+.0} µs (nginx {b:+.0} µs) (≤ 200 µs): {}",
                verdict(a <= 200.0)
            ));
        }
        if let Some((o, x)) = pair(Mode::Stream, 64) {
            let (r, how) = cpu_ratio(o, x, ratios);
            lines.push(format!(
                "streamed c=64: router CPU {:.0} vs {:.0} µs/req{how} = {r:.2}× (≤ 2×): {}",
                o.router_cpu_us_per_req,
                x.router_cpu_us_per_req,
                verdict(r <= 2.0),
            ));
        }
        if lines.is_empty() {
            continue;
        }
        let _ = writeln!(
            t,
            "\nOurs against nginx ({n} engine{}):\n",
            if n == 1 { "" } else { "s" }
        );
        for l in lines {
            let _ = writeln!(t, "- {l}");
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cell(router: RouterKind, round: usize, cpu: f64) -> Cell {
        Cell {
            router,
            engines: 4,
            mode: Mode::Plain,
            c: 64,
            direct: LoadResult::default(),
            via: LoadResult::default(),
            router_cpu_us_per_req: cpu,
            router_rss_kib: 0,
            round,
        }
    }

    #[test]
    fn rounds_give_the_median_cell_and_the_median_paired_ratio() {
        let cells = vec![
            cell(RouterKind::Ours, 0, 90.0),
            cell(RouterKind::Nginx, 0, 30.0),
            cell(RouterKind::Ours, 1, 60.0),
            cell(RouterKind::Nginx, 1, 40.0),
            cell(RouterKind::Ours, 2, 70.0),
            cell(RouterKind::Nginx, 2, 20.0),
        ];
        let ratios = round_ratios(&cells);
        assert_eq!(ratios.len(), 1);
        assert_eq!(ratios[0].1, vec![3.0, 1.5, 3.5]);
        let median = median_cells(cells);
        assert_eq!(median.len(), 2, "one cell per router");
        let (o, x) = (&median[0], &median[1]);
        assert_eq!((o.round, o.router_cpu_us_per_req), (2, 70.0));
        assert_eq!((x.round, x.router_cpu_us_per_req), (0, 30.0));
        // The verdict takes the rounds' median ratio (3.0), not 70 / 30.
        let (r, how) = cpu_ratio(o, x, &ratios);
        assert_eq!(r, 3.0);
        assert!(how.contains("3.00×, 1.50×, 3.50×"), "{how}");
        // One round: the two cells' own ratio.
        let (r, how) = cpu_ratio(o, x, &round_ratios(&[cell(RouterKind::Ours, 0, 70.0)]));
        assert!((r - 70.0 / 30.0).abs() < 1e-9 && how.is_empty());
    }
}

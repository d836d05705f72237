//! One contender from cold start to teardown: engines, its router(s) (and Redis), the
//! replay, what the routers used, the per-request results.

use std::fmt::Write as _;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::probes::{engine_itl, wait_fleet_connected, wait_models_listed};
use super::{
    Contender, FleetTraffic, ModelLayout, PdCounts, Peer, PeerSetup, QUEUE_SAMPLE_EVERY,
    QueueSampler, RouterKind, StartedRouter, render_status, routing_decisions, start_any_router,
};
use crate::procs::{
    self, ChildProc, EngineParams, ProcError, ScratchDir, free_port, io_err, start_engine,
};
use crate::replay::{self, PreparedRequest, ReplayConfig, ReplayError, RequestResult};
use crate::stats::{Summary, summarize};

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
    /// Served models when the requests name several, and how the engines serve them
    /// (`None`: every engine serves `engine.model`).
    pub models: Option<(Vec<String>, ModelLayout)>,
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
    /// What the disaggregated pool's requests did during the replay (`pd:` contenders).
    pub pd: Option<PdCounts>,
    /// Inter-token latency on the engines' own clock, in simulated ms (`None`: no
    /// engine reported one; see [`engine_itl`]).
    pub engine_itl_ms: Option<crate::stats::Percentiles>,
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
    let label = match &cfg.models {
        Some((_, layout)) => format!("{layout} · {}", contender.label()),
        None => contender.label(),
    };
    let engines = start_engines(cfg, contender, procs).await?;
    let replicas = match contender {
        Contender::Replicas(r) => Some(r),
        _ => None,
    };
    let routers = start_routers(cfg, contender, &engines.urls, procs).await?;
    let targets = if routers.started.is_empty() {
        engines.urls.clone()
    } else {
        routers.urls.clone()
    };
    let router = routers.started.first();
    // With `kill`: the last replica (the last child started) goes when the middle
    // request is due.
    let kill_at = replicas
        .filter(|r| r.kill_one)
        .map(|_| kill_time(requests, cfg.time_scale));
    let how = describe(contender, &engines, &routers, kill_at, requests.len()).await;
    let replay_cfg = ReplayConfig {
        urls: targets,
        time_scale: cfg.time_scale,
        concurrency: cfg.concurrency,
        request_timeout: cfg.request_timeout,
        progress_every: cfg.progress_every,
        failover: kill_at.is_some(),
    };
    let mut fleet_before = Vec::new();
    if routers.redis.is_some() {
        for u in &routers.urls {
            fleet_before.push(FleetTraffic::read(u).await.unwrap_or_default());
        }
    }
    let pd_url = router
        .filter(|_| matches!(contender, Contender::Pd(_)))
        .map(|r| r.url.clone());
    let pd_before = match &pd_url {
        Some(u) => PdCounts::read(u).await,
        None => None,
    };
    let before = router.map(|r| procs::tree_usage(r.pid).unwrap_or_default());
    let watch = procs::Disturbance::start(procs.iter().filter_map(ChildProc::pid).collect());
    let victim = match (kill_at, routers.urls.last()) {
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
    let sampler = QueueSampler::start(&engines.names, &engines.urls, QUEUE_SAMPLE_EVERY);
    let (results, killed) = tokio::join!(replay::run(requests, &replay_cfg), kill);
    let results = results?;
    let queue = sampler.finish().await;
    let other_cpu = watch.finish();
    let (decisions, fleet) = read_routers(contender, &routers.started, killed, &fleet_before).await;
    let engine_itl_ms = engine_itl(&engines.urls).await;
    let pd = match (&pd_url, &pd_before) {
        (Some(u), Some(b)) => PdCounts::read(u).await.map(|a| a.since(b)),
        _ => None,
    };
    let usage = router_usage(router, before);
    let how = with_decisions(how, &decisions);
    if let Some(out) = &cfg.out_dir {
        write_results(out, &label, &results)?;
    }
    let mut summary = summarize(&results, &engines.names);
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
        pd,
        engine_itl_ms,
    })
}

/// What the router used during the replay, from its usage `before` and now.
fn router_usage(
    router: Option<&StartedRouter>,
    before: Option<procs::ProcUsage>,
) -> Option<RouterUsage> {
    let (r, b) = (router?, before?);
    let a = procs::tree_usage(r.pid).unwrap_or_default();
    let tick = procs::clock_ticks_per_sec() as f64;
    Some(RouterUsage {
        idle_rss_kib: b.rss_kib,
        peak_rss_kib: a.hwm_kib,
        cpu_s: a.cpu_ticks.saturating_sub(b.cpu_ticks) as f64 / tick,
    })
}

/// `how` with our routers' routing decisions after it.
fn with_decisions(how: String, decisions: &[String]) -> String {
    match decisions.len() {
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
    }
}

/// A contender's engines, started.
struct Engines {
    /// Their names (`e0`, `e1`, ... or `ideal`) and base URLs, in order.
    names: Vec<String>,
    urls: Vec<String>,
    /// How many, with what cache and time factor, for the report.
    how: String,
}

/// Starts the engines of `contender`: `cfg.engines` of them, or for `ideal` one whose
/// cache holds the whole slice.
async fn start_engines(
    cfg: &MatrixConfig,
    contender: &Contender,
    procs: &mut Vec<ChildProc>,
) -> Result<Engines, MatrixError> {
    let (names, engine) = if *contender == Contender::Ideal {
        let engine = EngineParams {
            kv_blocks: cfg.ideal_kv_blocks,
            time_factor: cfg.ideal_time_factor,
            ..cfg.engine.clone()
        };
        (vec!["ideal".to_string()], engine)
    } else {
        let mut engine = cfg.engine.clone();
        if matches!(contender, Contender::Pd(_)) {
            engine.kv_connector = crate::engine::KvConnector::Nixl;
        }
        (engine_names(cfg.engines), engine)
    };
    let mut urls = Vec::with_capacity(names.len());
    let mut served = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let port = cfg.base_port.map_or(0, |b| b.saturating_add(1 + i as u16));
        let mut engine = engine.clone();
        if let Some((models, layout)) = &cfg.models {
            engine.model = layout.engine_models(models, i);
            served.push(format!("{name}: {}", engine.model));
        }
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
    let how = format!(
        "{} engine{} × {} KV blocks, time factor {}{}",
        names.len(),
        if names.len() == 1 { "" } else { "s" },
        engine.kv_blocks,
        engine.time_factor,
        match &cfg.models {
            Some((_, layout)) => format!(", models {layout} ({})", served.join("; ")),
            None => String::new(),
        }
    );
    Ok(Engines { names, urls, how })
}

/// A contender's routers, started (none for `direct` and `ideal`).
struct Routers {
    started: Vec<StartedRouter>,
    /// Their base URLs, in order.
    urls: Vec<String>,
    /// The Redis the replicas share (`None`: they share nothing).
    redis: Option<String>,
    /// Lives as long as the row's redis-server (its working directory and log).
    _redis_dir: Option<ScratchDir>,
}

/// Starts the router(s) of `contender` in front of `workers` (and, for replicas that
/// share state, a Redis first), and waits until sharing replicas are subscribed.
async fn start_routers(
    cfg: &MatrixConfig,
    contender: &Contender,
    workers: &[String],
    procs: &mut Vec<ChildProc>,
) -> Result<Routers, MatrixError> {
    let mut routers: Vec<StartedRouter> = Vec::new();
    let mut redis = None;
    let mut _redis_dir = None;
    if let Some((kind, policy)) = contender.router() {
        let mut extra = cfg.router_extra_yaml.clone();
        if matches!(contender, Contender::Replicas(r) if r.shared) {
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
                (workers, &contender.phases(workers.len())),
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
    let urls: Vec<String> = routers.iter().map(|r| r.url.clone()).collect();
    if redis.is_some() {
        wait_fleet_connected(&urls, cfg.startup_timeout).await?;
    }
    if cfg.models.is_some() && matches!(contender.router(), Some((RouterKind::Ours, _))) {
        for url in &urls {
            wait_models_listed(url, cfg.startup_timeout).await?;
        }
    }
    Ok(Routers {
        started: routers,
        urls,
        redis,
        _redis_dir,
    })
}

/// The middle request of the replay: its index and when it is due from the start.
fn kill_time(requests: &[PreparedRequest], time_scale: f64) -> (usize, Duration) {
    let first_ts = requests.iter().map(|r| r.timestamp_ms).min().unwrap_or(0);
    let mid = &requests[requests.len() / 2];
    let offset_s = mid.timestamp_ms.saturating_sub(first_ts) as f64 / 1000.0 * time_scale;
    (
        mid.index,
        Duration::try_from_secs_f64(offset_s).unwrap_or(Duration::ZERO),
    )
}

/// How the contender runs, for the report: its router's command (and for vllm-router
/// whether the engines answer the render endpoint), the engines, and for replicas
/// their ports, what they share and which one is killed when (`kill_at`).
async fn describe(
    contender: &Contender,
    engines: &Engines,
    routers: &Routers,
    kill_at: Option<(usize, Duration)>,
    requests: usize,
) -> String {
    let engines_how = &engines.how;
    let mut how = match routers.started.first() {
        Some(r) if matches!(contender, Contender::Peer(Peer::Vllm, _)) => {
            format!(
                "{}; {engines_how}; {}",
                r.how,
                render_status(&engines.urls[0]).await
            )
        }
        Some(r) => format!("{}; {engines_how}", r.how),
        None if *contender == Contender::Ideal => {
            format!("no router, every request to the one engine; {engines_how}")
        }
        None => format!("no router, client round robin; {engines_how}"),
    };
    if let Contender::Replicas(r) = contender {
        how = format!(
            "{} replicas of our router on ports {}, request i sent to replica i mod {}{}{}; \
             each {how}; router CPU and RSS are replica 1's",
            r.n,
            routers
                .urls
                .iter()
                .map(|u| u.rsplit(':').next().unwrap_or(""))
                .collect::<Vec<_>>()
                .join(", "),
            r.n,
            match &routers.redis {
                Some(u) => format!(
                    ", sharing state through `redis-server --save \"\" --appendonly no` at {u}"
                ),
                None => ", each with its own state".into(),
            },
            match kill_at {
                Some((i, at)) => format!(
                    "; replica {} killed (SIGKILL) when request {i} of {requests} was due \
                     ({:.1} s in), and the client sends a request that finds it gone, or whose \
                     stream it cuts, once more to the next replica",
                    r.n,
                    at.as_secs_f64()
                ),
                None => String::new(),
            }
        );
    }
    how
}

/// After the replay: our routers' routing decisions, and the fleet traffic summed over
/// the replicas since `fleet_before` (`None` when they share nothing). What the killed
/// replica (the last) said just before it went is in `killed`.
async fn read_routers(
    contender: &Contender,
    routers: &[StartedRouter],
    killed: Option<(Option<FleetTraffic>, Option<String>)>,
    fleet_before: &[FleetTraffic],
) -> (Vec<String>, Option<FleetTraffic>) {
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
    (decisions, fleet)
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

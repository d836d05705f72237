//! `trace-matrix`: the project's demo. For each contender (one of our router's
//! policies, a peer router — `sglang:POLICY`, `vllm:POLICY` — `direct` without a
//! router, or `ideal`: one engine with an unbounded KV cache) it starts cold
//! `sim-engine` replicas and the router, replays the Mooncake slice through it,
//! stops everything and prints one markdown table, with a picture of it beside
//! (`--svg`: TTFT distribution and hit rate per contender). Exits non-zero if a contender
//! had errors or could not start. `POLICY/N[/shared][/kill]` runs N replicas of our
//! router over the same engines, requests alternating between them, independent or
//! sharing state through a `redis-server` it starts (and with `kill`, the last
//! replica killed halfway); a second table then shows failures, retries and the
//! Redis traffic per request. `bench/peers/run.sh` installs the peers and runs
//! the comparison against them.

use bench::procs::secs;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use bench::engine::{MetricsFlavor, Physics};
use bench::matrix::{
    self, Contender, EngineParams, MatrixConfig, MatrixError, ModelLayout, PeerSetup,
};
use bench::prompts::{TraceRecord, read_trace};
use bench::replay;
use clap::Parser;
use tokio::sync::watch;

const SLICE: &str = "bench/data/mooncake_conversation_slice.jsonl";

/// Compare routing policies on a Mooncake trace slice over simulated vLLM engines.
#[derive(Debug, Parser)]
#[command(name = "trace-matrix", version)]
struct Cli {
    /// Mooncake jsonl trace, e.g. bench/data/hot_prefix.jsonl (see hot-prefix-trace)
    /// [default: bench/data/mooncake_conversation_slice.jsonl,
    /// found from the working directory or the bench crate's source directory].
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Replay only the first N lines (0 = all lines of the trace).
    #[arg(long, default_value_t = 0)]
    limit: usize,
    /// Base multiplier on trace timestamps (0.07 = the slice's 11 min in 47 s);
    /// the replay uses --time-scale / --load.
    #[arg(long, default_value_t = 0.07)]
    time_scale: f64,
    /// Multiplier on simulated engine times [default: same as --time-scale, so
    /// engine load relative to arrivals is as at full scale]. Not changed by --load.
    #[arg(long)]
    time_factor: Option<f64>,
    /// Offered load: arrivals X times as fast at the same engine speed (the replay
    /// runs at time scale --time-scale / X, the engines keep --time-factor); 1 =
    /// the trace's own rate, 1.5 = 50 % more requests per second.
    #[arg(long, default_value_t = 1.0)]
    load: f64,
    /// Comma-separated contenders: our router's policies; `sglang:POLICY` and
    /// `vllm:POLICY` (peer routers, see --peer-venv); `pd:POLICY` (ours over a
    /// disaggregated fleet: the first half of the engines `phase: prefill`, the rest
    /// `phase: decode`, every engine with vLLM's NixlConnector; `pd:` keys as variants,
    /// e.g. `pd:cache_aware+pd.decode_policy=cache_aware`; a table of inter-token
    /// latency and the router's bypasses follows the main one); `direct` (client round
    /// robin, no router); `ideal` (one engine with an unbounded KV cache, no router);
    /// `POLICY/N`, `POLICY/N/shared`, `POLICY/N/shared/kill` (N replicas of our
    /// router, request i to replica i mod N; independent, or sharing state through a
    /// Redis started for the run; `kill`: the last replica is killed when the middle
    /// request is due, and the client retries what finds it gone on the next one).
    /// Any of our policies may carry config keys of its own as
    /// `POLICY+SECTION.KEY=VALUE` (repeatable: `cache_aware+cache.learn_evictions=true`),
    /// layered on the run's config.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "cache_aware,round_robin,least_load"
    )]
    policies: Vec<String>,
    /// Also run the `direct` contender (client-side round robin, no router).
    #[arg(long)]
    direct: bool,
    /// Engines per contender.
    #[arg(long, default_value_t = 4)]
    engines: usize,
    /// Prefix cache capacity per engine, in blocks (64,000 × 16 = 1.02 M tokens,
    /// 2,000 Mooncake blocks).
    #[arg(long, default_value_t = 64_000)]
    kv_blocks: usize,
    /// Tokens per cache block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Fixed prefill cost per request, in simulated ms.
    #[arg(long, default_value_t = 20.0)]
    ttft_base_ms: f64,
    /// Prefill cost per uncached prompt token, in simulated µs.
    #[arg(long, default_value_t = 80.0)]
    prefill_us_per_token: f64,
    /// Inter-token latency, in simulated ms.
    #[arg(long, default_value_t = 15.0)]
    itl_ms: f64,
    /// Generated tokens per request: min(trace output_length, this).
    #[arg(long, default_value_t = 64)]
    max_output_tokens: u64,
    /// Most requests in flight during a replay.
    #[arg(long, default_value_t = 512)]
    concurrency: usize,
    /// Model id.
    #[arg(long, default_value = "m")]
    model: String,
    /// Several models, comma-separated (e.g. `model-a,model-b`; replaces --model): each
    /// conversation of the trace names one of them (a hash of its second block id, so
    /// every turn names the same one), and every contender runs once per
    /// --model-layouts entry. A table of wrong-model answers, hit rate, TTFT and spread
    /// per layout and contender follows the main one.
    #[arg(long, value_delimiter = ',')]
    models: Vec<String>,
    /// With --models, how the engines serve them (comma-separated, each a run of every
    /// contender): `separate` (engine i serves model i mod M only: two models on four
    /// engines, two each) or `shared` (every engine serves every model from one KV
    /// cache; a model's prompts never hit another's blocks).
    #[arg(long, value_delimiter = ',', default_value = "separate,shared")]
    model_layouts: Vec<ModelLayout>,
    /// Metric names the engines serve on /metrics: `vllm` or `sglang`.
    #[arg(long, default_value_t = MetricsFlavor::Vllm)]
    metrics_flavor: MetricsFlavor,
    /// Engines answer 429 (with Retry-After) to a request that finds this many
    /// waiting for prefill, in requests (0 = unbounded, never 429).
    #[arg(long, default_value_t = 0)]
    max_waiting: usize,
    /// How the engines' prefills share each engine: `serial` (one at a time, FIFO),
    /// `parallel` (up to --prefill-slots at once, each at full speed), `shared` (up
    /// to --prefill-slots at once, sharing one full speed, as vLLM's chunked prefill
    /// splits a per-step token budget) or `chunked` (vLLM's chunked prefill itself:
    /// steps of --max-batched-tokens shared by the decodes' tokens and prompt chunks,
    /// each lasting --itl-ms plus its prompt tokens' cost, so a prefill delays the next
    /// token of every request decoding on that engine; the only physics where it does).
    #[arg(long, default_value_t = Physics::Serial)]
    prefill_physics: Physics,
    /// Prefills at once under the parallel and shared physics.
    #[arg(long, default_value_t = 6)]
    prefill_slots: usize,
    /// Tokens per step under the chunked physics (vLLM's max_num_batched_tokens): one
    /// per decoding sequence, the rest prompt chunks.
    #[arg(long, default_value_t = 2048)]
    max_batched_tokens: usize,
    /// `pd:` contenders: fixed cost of a decode engine reading a prompt's KV from a
    /// prefill engine, in simulated ms.
    #[arg(long, default_value_t = 2.0)]
    kv_transfer_base_ms: f64,
    /// `pd:` contenders: cost per token of KV read from a prefill engine, in simulated µs.
    #[arg(long, default_value_t = 5.0)]
    kv_transfer_us_per_token: f64,
    /// Retry-After of the engines' 429, in whole (wall-clock) seconds. Default 0: the
    /// header allows no fraction, and at a time factor of 0.07 one second is 14
    /// simulated seconds; 0 makes the router stay away for its 100 ms minimum (1.4
    /// simulated seconds).
    #[arg(long, default_value_t = 0)]
    retry_after_secs: u64,
    /// sim-engine executable [default: next to this executable].
    #[arg(long)]
    engine_bin: Option<PathBuf>,
    /// cache-aware-router executable [default: next to this executable].
    #[arg(long)]
    router_bin: Option<PathBuf>,
    /// redis-server executable, for `POLICY/N/shared` (started per contender on a
    /// free loopback port, persistence off, killed with the contender).
    #[arg(long, default_value = "redis-server")]
    redis_server: PathBuf,
    /// Virtualenv holding the peer routers (`bin/smg`, `bin/vllm-router`), as
    /// `bench/peers/run.sh` creates it.
    #[arg(long, default_value = "/tmp/peers-venv")]
    peer_venv: PathBuf,
    /// sglang-router's `smg` [default: PEER_VENV/bin/smg].
    #[arg(long)]
    sglang_bin: Option<PathBuf>,
    /// vllm-router's executable [default: PEER_VENV/bin/vllm-router].
    #[arg(long)]
    vllm_bin: Option<PathBuf>,
    /// `--log-level` given to the peer routers (`warn`: as ours runs here, no line
    /// per request; `default`: leave theirs, `info`).
    #[arg(long, default_value = "warn")]
    peer_log_level: String,
    /// KV blocks of the `ideal` engine (0 = enough for every prompt token of the
    /// slice, so it never evicts).
    #[arg(long, default_value_t = 0)]
    ideal_kv_blocks: usize,
    /// Time factor of the `ideal` engine (0 = it answers at once: one engine cannot
    /// keep up with four engines' load, and only its hit rate is a reference).
    #[arg(long, default_value_t = 0.0)]
    ideal_time_factor: f64,
    /// YAML appended to our router's generated config, e.g.
    /// `cache: {balance_abs_threshold: 64}` (experiments; default none).
    #[arg(long, default_value = "")]
    router_yaml: String,
    /// Router on this port, engines on the next ones [default: free ports].
    #[arg(long)]
    base_port: Option<u16>,
    /// Longest wait for engines to start and the router's /health to answer 200, in s.
    #[arg(long, default_value_t = 30.0)]
    startup_timeout_s: f64,
    /// Per-request timeout, in s.
    #[arg(long, default_value_t = 120.0)]
    request_timeout_s: f64,
    /// Write per-request results to DIR/CONTENDER.jsonl (e.g. cache_aware.jsonl).
    #[arg(long)]
    out_dir: Option<PathBuf>,
    /// Where the picture goes: TTFT distribution and hit rate per contender, SVG
    /// [default: trace-matrix.svg in --out-dir, else in the working directory].
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Progress line interval on stderr, in s (0 = none).
    #[arg(long, default_value_t = 10.0)]
    progress_s: f64,
}

fn default_trace() -> PathBuf {
    let here = PathBuf::from(SLICE);
    if here.is_file() {
        return here;
    }
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/data/mooncake_conversation_slice.jsonl"
    ))
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    // Ctrl-C flips the flag; the running contender then kills and reaps its
    // children and the loop stops. A second Ctrl-C exits at once (children are
    // still killed: ChildProc is kill-on-drop).
    let (tx, rx) = watch::channel(false);
    tokio::select! {
        code = run(cli, rx) => code,
        () = async {
            let _ = tokio::signal::ctrl_c().await;
            eprintln!("trace-matrix: interrupted, stopping children (Ctrl-C again to force)");
            let _ = tx.send(true);
            let _ = tokio::signal::ctrl_c().await;
        } => ExitCode::from(130),
    }
}

async fn run(cli: Cli, interrupted: watch::Receiver<bool>) -> ExitCode {
    match try_run(cli, interrupted).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("trace-matrix: {e}");
            ExitCode::from(2)
        }
    }
}

async fn try_run(cli: Cli, interrupted: watch::Receiver<bool>) -> Result<ExitCode, String> {
    let trace = cli.trace.clone().unwrap_or_else(default_trace);
    let limit = (cli.limit > 0).then_some(cli.limit);
    let records = read_trace(&trace, limit).map_err(|e| e.to_string())?;
    if records.is_empty() {
        return Err(format!("{} holds no requests", trace.display()));
    }
    let contenders = contenders(&cli)?;
    if cli.engines == 0 {
        return Err("--engines must be at least 1".into());
    }
    if !cli.load.is_finite() || cli.load <= 0.0 {
        return Err(format!(
            "--load must be a finite number > 0, got {}",
            cli.load
        ));
    }
    // The engines run at the base speed; only arrivals speed up with --load.
    let time_factor = cli.time_factor.unwrap_or(cli.time_scale);
    let time_scale = cli.time_scale / cli.load;
    let prompt_tokens: u64 = records.iter().map(|r| r.input_tokens()).sum();
    let mut cfg = matrix_config(&cli, &records, prompt_tokens, time_factor, time_scale)?;
    let models = served_models(&cli);
    let requests = replay::prepare_split(&records, &models, cli.max_output_tokens, 0);
    let params = params_line(
        &cli,
        &trace,
        &records,
        prompt_tokens,
        time_factor,
        time_scale,
    );
    eprintln!("{params}");
    // One run of every contender per model layout (one run without several models).
    let layouts: Vec<Option<ModelLayout>> = if models.len() > 1 {
        cfg.engine.model = models[0].clone();
        cli.model_layouts.iter().copied().map(Some).collect()
    } else {
        vec![None]
    };
    let (mut rows, mut failed, mut ran) = (Vec::new(), false, Vec::new());
    for layout in &layouts {
        cfg.models = layout.map(|l| (models.clone(), l));
        let prefix = layout.map_or(String::new(), |l| format!("{l} · "));
        let Some((r, f)) = run_all(&cfg, &contenders, &requests, &interrupted, &prefix).await
        else {
            return Ok(ExitCode::from(130));
        };
        rows.extend(r);
        failed |= f;
        ran.extend(contenders.iter().map(|c| (*layout, c.clone())));
    }
    failed |= report(
        &cli,
        &cfg,
        &ran,
        &rows,
        (&params, &trace, records.len(), time_factor),
    );
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// The models the requests name: `--models` (at least two), else `--model`.
fn served_models(cli: &Cli) -> Vec<String> {
    let models: Vec<String> = cli
        .models
        .iter()
        .map(|m| m.trim().to_string())
        .filter(|m| !m.is_empty())
        .collect();
    if models.len() > 1 {
        models
    } else {
        vec![
            models
                .into_iter()
                .next()
                .unwrap_or_else(|| cli.model.clone()),
        ]
    }
}

/// The contenders of `--policies` (each once, in order), then `direct` with
/// `--direct`.
fn contenders(cli: &Cli) -> Result<Vec<Contender>, String> {
    let mut contenders: Vec<Contender> = Vec::new();
    for p in cli
        .policies
        .iter()
        .map(|p| p.trim())
        .filter(|p| !p.is_empty())
    {
        let c = Contender::parse(p)?;
        if !contenders.contains(&c) {
            contenders.push(c);
        }
    }
    if cli.direct && !contenders.contains(&Contender::Direct) {
        contenders.push(Contender::Direct);
    }
    if contenders.is_empty() {
        return Err("no contender: give --policies and/or --direct".into());
    }
    Ok(contenders)
}

/// What every contender runs with: the binaries, the engines' settings (at
/// `time_factor`), the replay's (at `time_scale`), the peers, the `ideal` engine (its
/// cache sized from `prompt_tokens` unless `--ideal-kv-blocks`), our router's extra
/// YAML.
fn matrix_config(
    cli: &Cli,
    records: &[TraceRecord],
    prompt_tokens: u64,
    time_factor: f64,
    time_scale: f64,
) -> Result<MatrixConfig, String> {
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
    // Every full block of every prompt, plus the chat template's few tokens per
    // request: the ideal engine never evicts.
    let ideal_kv_blocks = if cli.ideal_kv_blocks > 0 {
        cli.ideal_kv_blocks
    } else {
        (prompt_tokens as usize + 64 * records.len()) / cli.block_size.max(1) + 1024
    };
    Ok(MatrixConfig {
        engine_bin: cli
            .engine_bin
            .clone()
            .unwrap_or_else(|| matrix::sibling_binary("sim-engine")),
        router_bin: cli
            .router_bin
            .clone()
            .unwrap_or_else(|| matrix::sibling_binary("cache-aware-router")),
        engines: cli.engines,
        engine: EngineParams {
            kv_blocks: cli.kv_blocks,
            block_size: cli.block_size,
            ttft_base_ms: cli.ttft_base_ms,
            prefill_us_per_token: cli.prefill_us_per_token,
            itl_ms: cli.itl_ms,
            time_factor,
            max_output_tokens: cli.max_output_tokens,
            model: cli.model.clone(),
            metrics_flavor: cli.metrics_flavor,
            max_waiting: cli.max_waiting,
            retry_after_secs: cli.retry_after_secs,
            prefill_physics: cli.prefill_physics,
            prefill_slots: cli.prefill_slots.max(1),
            max_batched_tokens: cli.max_batched_tokens.max(1),
            // `pd:` contenders' engines get NixlConnector.
            kv_connector: bench::engine::KvConnector::None,
            kv_transfer_base_ms: cli.kv_transfer_base_ms,
            kv_transfer_us_per_token: cli.kv_transfer_us_per_token,
            ..EngineParams::default()
        },
        time_scale,
        concurrency: cli.concurrency,
        request_timeout: secs(cli.request_timeout_s, "--request-timeout-s")?,
        startup_timeout: secs(cli.startup_timeout_s, "--startup-timeout-s")?,
        base_port: cli.base_port,
        out_dir: cli.out_dir.clone(),
        progress_every: (cli.progress_s > 0.0)
            .then(|| Duration::try_from_secs_f64(cli.progress_s).ok())
            .flatten(),
        peers,
        ideal_kv_blocks,
        ideal_time_factor: cli.ideal_time_factor,
        redis_bin: cli.redis_server.clone(),
        models: None,
        router_extra_yaml: {
            let mut y = if cli.router_yaml.is_empty() || cli.router_yaml.ends_with('\n') {
                cli.router_yaml.clone()
            } else {
                format!("{}\n", cli.router_yaml)
            };
            // The engines run `time_factor` times faster than full scale: so do the
            // router's engine scrapes (1 s and 5 s stale at full scale), or a reading
            // would be 1/time_factor times staler than in production.
            if !y.contains("engine_metrics") {
                y.push_str(&engine_metrics_yaml(time_factor));
            }
            y
        },
    })
}

/// The run's parameters in two lines (printed before the runs and above the table).
fn params_line(
    cli: &Cli,
    trace: &Path,
    records: &[TraceRecord],
    prompt_tokens: u64,
    time_factor: f64,
    time_scale: f64,
) -> String {
    let span_s = records
        .last()
        .map_or(0, |r| r.timestamp)
        .saturating_sub(records[0].timestamp) as f64
        / 1000.0;
    format!(
        "trace {} (first {} lines, {} prompt tokens, span {:.0} s) × time scale {} (load {}) = {:.0} s per contender\n\
         {} engines × {} KV blocks of {} tokens ({:.2} M tokens each); prefill {} ms + {} µs/token ({}), \
         ITL {} ms, all × time factor {}; output tokens min(trace, {}); concurrency cap {}{}",
        trace.display(),
        records.len(),
        prompt_tokens,
        span_s,
        time_scale,
        cli.load,
        span_s * time_scale,
        cli.engines,
        cli.kv_blocks,
        cli.block_size,
        (cli.kv_blocks * cli.block_size) as f64 / 1e6,
        cli.ttft_base_ms,
        cli.prefill_us_per_token,
        match cli.prefill_physics {
            Physics::Serial => "one at a time, FIFO".to_string(),
            Physics::Parallel => format!("up to {} at once at full speed", cli.prefill_slots),
            Physics::Shared => format!("up to {} at once sharing full speed", cli.prefill_slots),
            Physics::Chunked => format!(
                "chunked into steps of {} tokens shared with the decodes, each ITL + its \
                 prompt tokens; the fixed part before the batch",
                cli.max_batched_tokens
            ),
        },
        cli.itl_ms,
        time_factor,
        cli.max_output_tokens,
        cli.concurrency,
        if cli.max_waiting > 0 || cli.metrics_flavor != MetricsFlavor::Vllm {
            format!(
                "; engine metrics {}, max waiting {} (429, Retry-After {} s)",
                cli.metrics_flavor,
                if cli.max_waiting > 0 {
                    cli.max_waiting.to_string()
                } else {
                    "unbounded".into()
                },
                cli.retry_after_secs
            )
        } else {
            String::new()
        },
    ) + &models_note(cli)
}

/// The params line's note on several models (empty with one).
fn models_note(cli: &Cli) -> String {
    let models = served_models(cli);
    if models.len() < 2 {
        return String::new();
    }
    let layouts: Vec<&str> = cli.model_layouts.iter().map(|l| l.as_str()).collect();
    format!(
        "\nmodels {} (each conversation names one), engine layouts: {}",
        models.join(", "),
        layouts.join(", ")
    )
}

/// Runs every contender in turn: its row, and whether any failed or saw errors;
/// `None` when interrupted.
async fn run_all(
    cfg: &MatrixConfig,
    contenders: &[Contender],
    requests: &[replay::PreparedRequest],
    interrupted: &watch::Receiver<bool>,
    prefix: &str,
) -> Option<(Vec<Row>, bool)> {
    let mut rows = Vec::new();
    let mut failed = false;
    for c in contenders {
        let label = format!("{prefix}{}", c.label());
        eprintln!(
            "== {label}: starting {}{}",
            if *c == Contender::Ideal {
                "1 engine".to_string()
            } else {
                format!("{} engines", cfg.engines)
            },
            match (c.router(), c.routers()) {
                (Some((kind, _)), 1) => format!(" + {}", kind.name()),
                (Some((kind, _)), n) => format!(" + {n} × {}", kind.name()),
                (None, _) => String::new(),
            }
        );
        let t0 = Instant::now();
        let mut flag = interrupted.clone();
        let interrupt = async move {
            if flag.wait_for(|&v| v).await.is_err() {
                std::future::pending::<()>().await;
            }
        };
        let row = matrix::run_contender_measured(cfg, c, requests, interrupt).await;
        if matches!(row, Err(MatrixError::Interrupted)) {
            return None;
        }
        let row = row.map_err(|e| e.to_string());
        match &row {
            Ok(run) => {
                eprintln!(
                    "{}\n== {label}: done in {:.0} s",
                    run.summary,
                    t0.elapsed().as_secs_f64()
                );
                failed |= run.summary.errors > 0;
            }
            Err(e) => {
                eprintln!("== {label}: FAILED: {e}");
                failed = true;
            }
        }
        rows.push((label, row));
    }
    Some((rows, failed))
}

/// Prints the table, the picture's path, the notes under it, the replicas' table and
/// how each contender ran; true when the picture could not be written.
fn report(
    cli: &Cli,
    cfg: &MatrixConfig,
    ran: &[(Option<ModelLayout>, Contender)],
    rows: &[Row],
    (params, trace, requests, time_factor): (&str, &Path, usize, f64),
) -> bool {
    println!("{params}\n");
    let mut failed = false;
    println!("{}", matrix::render_table(rows));
    let contenders: Vec<Contender> = ran.iter().map(|(_, c)| c.clone()).collect();
    let contenders = contenders.as_slice();
    if contenders.iter().any(|c| matches!(c, Contender::Pd(_))) {
        print_pd_table(cli, cfg, contenders, rows);
    }
    if ran.iter().any(|(l, _)| l.is_some()) {
        print_models_table(cli, ran, rows);
    }
    let svg_path = cli.svg.clone().unwrap_or_else(|| {
        cli.out_dir
            .clone()
            .unwrap_or_default()
            .join("trace-matrix.svg")
    });
    match write_picture(&svg_path, rows, trace, requests, cli, time_factor) {
        Ok(()) => println!(
            "picture (TTFT distribution and hit rate): {}\n",
            svg_path.display()
        ),
        Err(e) => {
            eprintln!("trace-matrix: {e}");
            failed = true;
        }
    }
    println!(
        "hit rate = Σ cached / Σ prompt tokens from the engines' usage; TTFT and end-to-end are \
         wall-clock ms at time factor {time_factor} (÷ {time_factor} ≈ full-scale simulated ms); \
         open loop, so throughput follows the offered load unless a pool falls behind. Longest \
         queue is the most requests waiting for prefill on one engine (GET /metrics of every \
         engine polled every 100 ms, and the engines' own high-water mark); queued while idle \
         is the share of those samples in which one engine had ≥ 2 waiting while another had \
         nothing waiting or running. Router \
         peak RSS is VmHWM of the router process at the end of the replay, router CPU s its \
         utime+stime during the replay (/proc). Routers are ready when GET /health and a \
         1-token chat request answer 2xx."
    );
    if contenders
        .iter()
        .any(|c| matches!(c, Contender::Replicas(_)))
    {
        println!("\nRouter replicas:\n\n{}", matrix::render_fleet_table(rows));
        println!(
            "failed = requests that got no complete answer, after the client's one retry; \
             retried = requests whose first attempt found the replica gone (connection \
             refused) or had its stream cut, sent once more to the next replica. Redis \
             messages and bytes per request: the fleet counters of every replica's GET \
             /workers (messages_out/bytes_out: its PUBLISHes; messages_in/bytes_in: what \
             it received from the others), read just before and after the replay (a killed \
             replica's just before it was killed), growth summed over the replicas, ÷ the \
             requests replayed. They include the in-flight shares every replica publishes \
             each 100 ms whether or not it routes."
        );
        let checks = matrix::check_fleet(rows, contenders);
        if !checks.is_empty() {
            println!("\nTargets (shared state):\n\n{checks}");
        }
    }
    if contenders.contains(&Contender::Ideal) {
        println!(
            "ideal: ONE engine with {} KV blocks (the whole slice) at time factor {}, every \
             request sent to it: the best hit rate the slice allows; its timings are not \
             comparable (one engine, not four).",
            cfg.ideal_kv_blocks, cfg.ideal_time_factor
        );
    }
    println!("\nHow each contender ran:\n");
    for (c, (label, row)) in contenders.iter().zip(rows) {
        match row {
            Ok(run) => {
                println!("- {label}: {}", run.how);
                if let Some(o) = run.other_cpu {
                    println!("  (other processes on the machine during the replay: {o})");
                }
            }
            Err(_) => println!("- {label}: failed (see above)"),
        }
        if let Contender::Peer(p, _) = c {
            let (t, a, r) = p.default_thresholds();
            println!(
                "  ({} defaults: cache_threshold {t}, balance_abs_threshold {a}, \
                 balance_rel_threshold {r}; ours by default: 0.3, 2, 1.5)",
                p.name()
            );
        }
    }
    if contenders.iter().any(|c| matches!(c, Contender::Peer(..))) {
        let targets = matrix::check_targets(rows, "cache_aware");
        if !targets.is_empty() {
            println!("\nTargets (our cache_aware):\n\n{targets}");
        }
    }
    failed
}

/// The several-models table and what it means.
fn print_models_table(cli: &Cli, ran: &[(Option<ModelLayout>, Contender)], rows: &[Row]) {
    let models = served_models(cli);
    let table: Vec<matrix::ScenarioRow<'_>> = ran
        .iter()
        .zip(rows)
        .map(|((l, _), (label, row))| {
            let layout = l.map_or("", ModelLayout::as_str);
            let short = label.strip_prefix(&format!("{layout} · ")).unwrap_or(label);
            (layout, short, row)
        })
        .collect();
    println!(
        "Models {}: each conversation names one (a hash of its second block id). \
         separate: engine i serves model i mod {} only; shared: every engine serves \
         every model from one KV cache (a model's prompts never hit another's blocks). \
         Wrong-model answers: an engine's 404 for a model it does not serve, or a 2xx \
         answer naming another model than asked.\n\n{}",
        models.join(", "),
        models.len(),
        matrix::render_models_table(&table),
    );
}

/// The disaggregation table and what it means.
fn print_pd_table(cli: &Cli, cfg: &MatrixConfig, contenders: &[Contender], rows: &[Row]) {
    let tf = cfg.engine.time_factor;
    let workers: Vec<String> = contenders
        .iter()
        .map(|c| {
            let phases = c.phases(cfg.engines);
            match c {
                Contender::Ideal => "1 (unbounded KV)".to_string(),
                _ if phases.is_empty() => format!("{} aggregated", cfg.engines),
                _ => {
                    let p = phases.iter().filter(|p| **p == "prefill").count();
                    format!("{p} prefill + {} decode", phases.len() - p)
                }
            }
        })
        .collect();
    let table: Vec<matrix::ScenarioRow<'_>> = workers
        .iter()
        .zip(rows)
        .map(|(w, (label, row))| (w.as_str(), label.as_str(), row))
        .collect();
    println!(
        "Aggregated against disaggregated workers ({} physics{}). Times in simulated ms \
         (wall-clock ms ÷ time factor {tf}). TTFT and end-to-end as the client measured \
         them. ITL: every gap between two consecutive tokens of a request, pooled over \
         the requests: on the engines' clock (sim:inter_token_latency_seconds, the ends \
         of the steps that made them; read from bucket bounds 15 % apart), and as the \
         client measured it, which adds the 1 ms timer tick and the machine's scheduling \
         (one tick is {tick:.0} simulated ms here). Hit rate: the cached tokens the \
         client's usage reports (for a disaggregated request the prefill leg's, as the \
         router rewrites it). Bypass share: the requests the router sent to a decode \
         worker without a prefill leg (its pd_requests_total and pd_bypasses_total \
         during the replay). A decode engine reads a handed-over prompt's KV in {} ms + \
         {} µs a token (only the blocks it does not hold).\n\n{}",
        cli.prefill_physics,
        if cli.prefill_physics == Physics::Chunked {
            format!(", steps of {} tokens", cli.max_batched_tokens)
        } else {
            "; only the chunked physics makes a prefill delay the decodes".into()
        },
        cli.kv_transfer_base_ms,
        cli.kv_transfer_us_per_token,
        matrix::render_pd_table(&table, tf),
        tf = tf,
        tick = if tf > 0.0 { 1.0 / tf } else { 0.0 },
    );
}

/// One row of the table: the contender's label and its run, or why it failed.
type Row = (String, Result<matrix::ContenderRun, String>);

/// The picture beside the table, written to `path`.
fn write_picture(
    path: &std::path::Path,
    rows: &[(String, Result<matrix::ContenderRun, String>)],
    trace: &std::path::Path,
    requests: usize,
    cli: &Cli,
    time_factor: f64,
) -> Result<(), String> {
    let name = trace
        .file_name()
        .unwrap_or(trace.as_os_str())
        .to_string_lossy();
    let subtitle = format!(
        "{requests} requests of {name} at load {}; {} simulated vLLM engines × {} KV blocks of {} tokens; \
         TTFT wall-clock ms at time factor {time_factor}",
        cli.load, cli.engines, cli.kv_blocks, cli.block_size
    );
    let svg = bench::chart::render_svg(rows, &subtitle)?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    std::fs::write(path, svg).map_err(|e| format!("{}: {e}", path.display()))
}

/// `engine_metrics:` at the production defaults (1 s scrapes, stale after 5 s) scaled by
/// the engines' `time_factor`, within the router's bounds (≥ 50 ms, ≥ 0.01 s).
fn engine_metrics_yaml(time_factor: f64) -> String {
    let interval_ms = (1000.0 * time_factor).round().clamp(50.0, 600_000.0) as u64;
    let stale = (5.0 * time_factor)
        .clamp(0.01, 1e6)
        .max(2.0 * interval_ms as f64 / 1000.0);
    format!("engine_metrics: {{ interval_ms: {interval_ms}, stale_secs: {stale:.3} }}\n")
}

//! `hedge-bench`: what hedging a late first token does to the time to first token
//! (issue 43's acceptance).
//!
//! Two arms, one after the other, each on fresh processes: `--engines` sim-engines, the
//! first of which holds back the first token of `--stall-share` of its requests for
//! `--stall-ms` (`sim-engine --stall-first-token-ms --stall-share`), behind the router
//! without hedging, then with `hedge: {after_ms: --after-ms}` (and `max_share` when
//! `--max-share` is given; the router's default otherwise). Each arm sends the same
//! `--requests` streamed chat requests (new user turns under 8 system prompts,
//! `bench::load::new_turn_bodies`) at `--concurrency`, closed loop. Prints per arm the
//! time to first token as the client saw it (its first body byte) at p50, p99 and max,
//! the requests that failed, the stalls the engine counted, the router's
//! `hedges_total` by outcome and the share of the requests hedged against its cap;
//! exits 1 when a request failed or the share hedged is over the cap.
//!
//! Build first (same profile; found beside this binary):
//! `cargo build --release -p bench --bin hedge-bench --bin sim-engine` and
//! `cargo build --release --bin cache-aware-router`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use bench::load::{self, LoadSpec};
use bench::procs::{self, ChildProc, EngineParams, ScratchDir};
use bench::stats::{nearest_rank, series_by};
use clap::Parser;

/// The router's default `hedge.max_share`.
const DEFAULT_MAX_SHARE: f64 = 0.05;
/// Outcomes of `cache_aware_router_hedges_total`, in the table's order.
const OUTCOMES: [&str; 5] = ["won", "lost", "failed", "capped", "no_worker"];

/// TTFT with and without hedging, one engine stalling some first tokens.
#[derive(Debug, Parser)]
#[command(name = "hedge-bench", version)]
struct Cli {
    /// Simulated engines behind the router (at least 2); the first one stalls.
    #[arg(long, default_value_t = 4)]
    engines: usize,
    /// Streamed chat requests per arm.
    #[arg(long, default_value_t = 2000)]
    requests: u64,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Tokens of each answer (`max_tokens`).
    #[arg(long, default_value_t = 32)]
    tokens: u64,
    /// Bytes of each request body, about.
    #[arg(long, default_value_t = 1024)]
    body_bytes: usize,
    /// How long the stalling engine holds a first token back, in simulated ms.
    #[arg(long, default_value_t = 2000.0)]
    stall_ms: f64,
    /// Share of the stalling engine's requests that stall (0 to 1).
    #[arg(long, default_value_t = 0.05)]
    stall_share: f64,
    /// The engines' inter-token latency, in simulated ms.
    #[arg(long, default_value_t = 15.0)]
    itl_ms: f64,
    /// Multiplier on every simulated time (0.5 = twice as fast).
    #[arg(long, default_value_t = 1.0)]
    time_factor: f64,
    /// The hedged arm's `hedge.after_ms`.
    #[arg(long, default_value_t = 400)]
    after_ms: u64,
    /// The hedged arm's `hedge.max_share` (unset: the router's default, 0.05).
    #[arg(long)]
    max_share: Option<f64>,
}

/// What one arm measured.
struct Arm {
    name: String,
    /// Time to first byte of the answered requests, in ms, ascending.
    ttft_ms: Vec<f64>,
    failed: u64,
    first_error: Option<String>,
    /// Requests the stalling engine held back (its `sim:stalled_total`).
    stalled: f64,
    /// `hedges_total` by outcome.
    hedges: BTreeMap<String, f64>,
}

impl Arm {
    /// Hedges sent (won, lost or failed) per request.
    fn hedged_share(&self) -> f64 {
        let sent: f64 = ["won", "lost", "failed"]
            .iter()
            .filter_map(|o| self.hedges.get(*o))
            .sum();
        let requests = self.ttft_ms.len() as f64 + self.failed as f64;
        if requests > 0.0 { sent / requests } else { 0.0 }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(&cli).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("hedge-bench: {e}");
            ExitCode::from(2)
        }
    }
}

async fn run(cli: &Cli) -> Result<bool, String> {
    if cli.engines < 2 {
        return Err("--engines must be at least 2 (one stalls, one answers the hedge)".into());
    }
    let (engine_bin, router_bin) =
        procs::engine_and_router_binaries().map_err(|e| e.to_string())?;
    let cap = cli.max_share.unwrap_or(DEFAULT_MAX_SHARE);
    let mut arms = Vec::new();
    for hedged in [false, true] {
        let mut children = Vec::new();
        let arm = arm(cli, hedged, (&engine_bin, &router_bin), &mut children).await;
        procs::stop_all(children).await;
        arms.push(arm?);
    }
    println!(
        "{} engines, e0 stalling its first token {} ms on {} % of its requests; per arm {} streamed chat requests of {} tokens at concurrency {}",
        cli.engines,
        cli.stall_ms * cli.time_factor,
        cli.stall_share * 100.0,
        cli.requests,
        cli.tokens,
        cli.concurrency
    );
    println!(
        "\n| arm | answered | failed | TTFT p50 | TTFT p99 | TTFT max | stalled | hedges won / lost / failed / capped / no_worker | hedged share (cap) |\n|---|---|---|---|---|---|---|---|---|"
    );
    let mut ok = true;
    for a in &arms {
        let ms = |p: f64| format!("{:.0} ms", nearest_rank(&a.ttft_ms, p));
        let outcomes: Vec<String> = OUTCOMES
            .iter()
            .map(|o| format!("{}", a.hedges.get(*o).copied().unwrap_or(0.0)))
            .collect();
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {:.2} % ({:.0} %) |",
            a.name,
            a.ttft_ms.len(),
            a.failed,
            ms(0.50),
            ms(0.99),
            ms(1.0),
            a.stalled,
            outcomes.join(" / "),
            a.hedged_share() * 100.0,
            cap * 100.0
        );
        if let Some(e) = &a.first_error {
            println!("  {}: first failure: {e}", a.name);
        }
        ok &= a.failed == 0 && a.hedged_share() <= cap;
    }
    Ok(ok)
}

/// One arm on fresh engines and a fresh router (see the module docs).
async fn arm(
    cli: &Cli,
    hedged: bool,
    (engine_bin, router_bin): (&PathBuf, &PathBuf),
    children: &mut Vec<ChildProc>,
) -> Result<Arm, String> {
    let mut urls = Vec::new();
    for i in 0..cli.engines {
        let stalls = i == 0;
        let params = EngineParams {
            itl_ms: cli.itl_ms,
            time_factor: cli.time_factor,
            stall_first_token_ms: if stalls { cli.stall_ms } else { 0.0 },
            stall_share: if stalls { cli.stall_share } else { 0.0 },
            ..EngineParams::default()
        };
        let wait = Duration::from_secs(10);
        let url = procs::start_engine(engine_bin, &params, &format!("e{i}"), 0, wait, children)
            .await
            .map_err(|e| e.to_string())?;
        urls.push(url);
    }
    let port = procs::free_port().map_err(|e| e.to_string())?;
    let mut yaml = format!("server: {{host: 127.0.0.1, port: {port}}}\nlog: {{level: warn}}\n");
    let name = if hedged {
        let share = cli
            .max_share
            .map(|s| format!(", max_share: {s}"))
            .unwrap_or_default();
        yaml.push_str(&format!("hedge: {{after_ms: {}{share}}}\n", cli.after_ms));
        format!("hedge.after_ms {}", cli.after_ms)
    } else {
        "no hedging".to_string()
    };
    yaml.push_str("workers:\n");
    for u in &urls {
        yaml.push_str(&format!("  - url: {u}\n"));
    }
    let dir = ScratchDir::new("hedge-bench", "router").map_err(|e| e.to_string())?;
    let base = procs::start_router(
        router_bin,
        &yaml,
        port,
        &dir,
        Duration::from_secs(20),
        children,
    )
    .await
    .map_err(|e| e.to_string())?;
    eprintln!("hedge-bench: {name}: {} requests", cli.requests);
    let result = load::run(&LoadSpec {
        targets: vec![procs::addr_of(&base)?],
        path: "/v1/chat/completions".into(),
        concurrency: cli.concurrency,
        max_requests: cli.requests,
        max_duration: Duration::from_secs(3600),
        request_timeout: Duration::from_secs(60),
        stream: true,
        body: load::new_turn_bodies(cli.tokens, true, cli.body_bytes),
        stop: None,
        progress: None,
    })
    .await;
    let metrics = |url: String| async move {
        let body = procs::get_body(&format!("{url}/metrics"))
            .await
            .ok_or_else(|| format!("GET {url}/metrics failed"))?;
        Ok::<String, String>(String::from_utf8_lossy(&body).into_owned())
    };
    let stalled = series_by(&metrics(urls[0].clone()).await?, "sim:stalled_total", &[]);
    let hedges = series_by(
        &metrics(base).await?,
        "cache_aware_router_hedges_total",
        &["outcome"],
    );
    let mut ttft_ms: Vec<f64> = result
        .samples
        .iter()
        .map(|s| s.ttfb_us as f64 / 1e3)
        .collect();
    ttft_ms.sort_by(f64::total_cmp);
    Ok(Arm {
        name,
        ttft_ms,
        failed: result.errors,
        first_error: result.first_error,
        stalled: stalled.values().sum(),
        hedges: hedges
            .into_iter()
            .filter_map(|(k, v)| Some((k.into_iter().next()?, v)))
            .collect(),
    })
}

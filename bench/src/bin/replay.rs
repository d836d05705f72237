//! `replay`: replays a Mooncake trace against one or more OpenAI-compatible base
//! URLs on the trace's schedule (open loop) and prints a summary.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use bench::prompts::read_trace;
use bench::replay::{self, ReplayConfig};
use bench::stats::summarize;
use clap::Parser;

/// Open-loop Mooncake trace replay (streamed chat requests).
#[derive(Debug, Parser)]
#[command(name = "replay", version)]
struct Cli {
    /// Mooncake jsonl trace (timestamp ms, input_length, output_length, hash_ids).
    #[arg(long, default_value = "bench/data/mooncake_conversation_slice.jsonl")]
    trace: PathBuf,
    /// Base URL to send to (repeat for client-side round robin), e.g. http://127.0.0.1:6700.
    #[arg(long = "url", required = true)]
    urls: Vec<String>,
    /// Replay only the first N lines (0 = all).
    #[arg(long, default_value_t = 0)]
    limit: usize,
    /// Multiplier on trace timestamps (0.1 = ten times faster than recorded).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// max_tokens = min(output_length, this cap), in tokens.
    #[arg(long, default_value_t = 64)]
    max_tokens_cap: u64,
    /// Most requests in flight at once.
    #[arg(long, default_value_t = 512)]
    concurrency: usize,
    /// Per-request timeout, in s.
    #[arg(long, default_value_t = 120.0)]
    request_timeout_s: f64,
    /// Model id to put in requests.
    #[arg(long, default_value = "m")]
    model: String,
    /// Salt of the prompt expansion (0 = expand_prompts.py's default text).
    #[arg(long, default_value_t = 0)]
    salt: u64,
    /// Write one JSON line per request here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Progress line interval on stderr, in s (0 = none).
    #[arg(long, default_value_t = 10.0)]
    progress_s: f64,
    /// Send a request whose connection failed or whose stream broke once more, to the
    /// next URL (needs two URLs or more).
    #[arg(long)]
    failover: bool,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    tokio::select! {
        code = run(cli) => code,
        _ = tokio::signal::ctrl_c() => {
            eprintln!("replay: interrupted");
            ExitCode::from(130)
        }
    }
}

async fn run(cli: Cli) -> ExitCode {
    let limit = (cli.limit > 0).then_some(cli.limit);
    let records = match read_trace(&cli.trace, limit) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("replay: {e}");
            return ExitCode::from(2);
        }
    };
    let requests = replay::prepare(&records, &cli.model, cli.max_tokens_cap, cli.salt);
    let Ok(request_timeout) = Duration::try_from_secs_f64(cli.request_timeout_s) else {
        eprintln!("replay: --request-timeout-s must be a finite number >= 0");
        return ExitCode::from(2);
    };
    let cfg = ReplayConfig {
        urls: cli.urls.clone(),
        time_scale: cli.time_scale,
        concurrency: cli.concurrency,
        request_timeout,
        progress_every: (cli.progress_s > 0.0)
            .then(|| Duration::try_from_secs_f64(cli.progress_s).ok())
            .flatten(),
        failover: cli.failover,
    };
    let span_s = records
        .iter()
        .map(|r| r.timestamp)
        .max()
        .unwrap_or(0)
        .saturating_sub(records.first().map_or(0, |r| r.timestamp)) as f64
        / 1000.0;
    eprintln!(
        "replaying {} requests from {} to {} (trace span {:.0} s × {} = {:.1} s)",
        requests.len(),
        cli.trace.display(),
        cli.urls.join(", "),
        span_s,
        cli.time_scale,
        span_s * cli.time_scale
    );
    let results = match replay::run(&requests, &cfg).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("replay: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(path) = &cli.out {
        let text: String = results
            .iter()
            .map(|r| serde_json::to_string(r).unwrap_or_default() + "\n")
            .collect();
        if let Err(e) = std::fs::write(path, text) {
            eprintln!("replay: cannot write {}: {e}", path.display());
            return ExitCode::from(2);
        }
    }
    let summary = summarize(&results, &[]);
    println!("{summary}");
    if summary.errors > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

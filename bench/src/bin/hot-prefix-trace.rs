//! `hot-prefix-trace`: writes the hot-prefix workload (see `bench::workloads`) as
//! Mooncake-format jsonl, to stdout or `--out`. With the defaults it reproduces
//! `bench/data/hot_prefix.jsonl` byte for byte:
//!
//! ```text
//! cargo run --release -p bench --bin hot-prefix-trace -- --out bench/data/hot_prefix.jsonl
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use bench::workloads::{HotPrefixSpec, hot_prefix, shape, to_jsonl};
use clap::Parser;

/// Generate the hot-prefix trace: a shared ~3k-token system prompt on ~60 % of
/// requests, multi-turn sessions, one-off requests; Mooncake jsonl format.
#[derive(Debug, Parser)]
#[command(name = "hot-prefix-trace", version)]
struct Cli {
    /// Write the trace here instead of stdout.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Requests in the trace.
    #[arg(long, default_value_t = HotPrefixSpec::default().requests)]
    requests: usize,
    /// Timestamp of the last request, in ms (the first is at 0).
    #[arg(long, default_value_t = HotPrefixSpec::default().span_ms)]
    span_ms: u64,
    /// Seed of the random stream (the default gives the committed file).
    #[arg(long, default_value_t = HotPrefixSpec::default().seed)]
    seed: u64,
    /// Blocks of 512 tokens in the hot system prompt.
    #[arg(long, default_value_t = HotPrefixSpec::default().hot_blocks)]
    hot_blocks: usize,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let spec = HotPrefixSpec {
        requests: cli.requests,
        span_ms: cli.span_ms,
        seed: cli.seed,
        hot_blocks: cli.hot_blocks,
        ..HotPrefixSpec::default()
    };
    let reqs = hot_prefix(&spec);
    let text = to_jsonl(&reqs);
    let s = shape(&reqs, spec.hot_blocks);
    eprintln!(
        "hot-prefix-trace: {} requests over {:.0} s ({:.2} req/s), hot share {:.3}, \
         {} sessions holding {:.3} of the requests, mean input {:.0} tokens, mean output {:.0}",
        s.requests,
        spec.span_ms as f64 / 1000.0,
        s.rate_per_s,
        s.hot_share,
        s.sessions,
        s.session_share,
        s.mean_input,
        s.mean_output
    );
    let written = match &cli.out {
        Some(path) => std::fs::write(path, &text).map_err(|e| format!("{}: {e}", path.display())),
        None => {
            use std::io::Write;
            std::io::stdout()
                .write_all(text.as_bytes())
                .map_err(|e| format!("stdout: {e}"))
        }
    };
    match written {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("hot-prefix-trace: {e}");
            ExitCode::from(2)
        }
    }
}

//! `expand-prompts`: a Mooncake jsonl trace as literal prompts, one JSON line per
//! request, `{"timestamp": ms, "text_input": str, "output_length": n}` (aiperf's
//! `mooncake_trace` custom dataset). The text is exactly what `trace-matrix` and
//! `replay` send (`bench::prompts`), so an aiperf run sees the same prefix reuse.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use bench::prompts::read_trace;
use clap::Parser;

/// Expand a Mooncake trace into literal prompts on stdout.
#[derive(Debug, Parser)]
#[command(name = "expand-prompts", version)]
struct Cli {
    /// Mooncake jsonl trace (lines with `timestamp`, `input_length`, `output_length`,
    /// `hash_ids`).
    trace: PathBuf,
    /// Only the first N lines (0 = all).
    #[arg(long, default_value_t = 0)]
    limit: usize,
    /// Multiplier on timestamps (ms), truncated to whole ms.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Salt of the block text (different salts share no prefix).
    #[arg(long, default_value_t = 0)]
    salt: u64,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let trace = match read_trace(&cli.trace, (cli.limit > 0).then_some(cli.limit)) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("expand-prompts: {}: {e}", cli.trace.display());
            return ExitCode::from(2);
        }
    };
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    for r in &trace {
        let line = serde_json::json!({
            "timestamp": (r.timestamp as f64 * cli.time_scale) as u64,
            "text_input": r.prompt(cli.salt),
            "output_length": r.output_length,
        });
        if writeln!(out, "{line}").is_err() {
            return ExitCode::FAILURE;
        }
    }
    if out.flush().is_err() {
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

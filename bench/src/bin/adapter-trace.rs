//! `adapter-trace`: writes the LoRA adapter workload (`bench::workloads::adapter_mix`)
//! as a request log `cache-aware-router simulate` reads (one `{"timestamp_ms", "body"}`
//! per line, the body's `model` naming the adapter), to stdout or `--out`:
//!
//! ```text
//! cargo run --release -p bench --bin adapter-trace -- --out /tmp/adapters.jsonl
//! cache-aware-router simulate --input /tmp/adapters.jsonl --workers 4 --max-lora 2
//! ```

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use bench::workloads::{AdapterMixSpec, adapter_mix, request_line};
use clap::Parser;

/// Generate a mixed LoRA adapter workload: adapters of skewed popularity, each with
/// its own system prompt and multi-turn sessions.
#[derive(Debug, Parser)]
#[command(name = "adapter-trace", version)]
struct Cli {
    /// Write the log here instead of stdout.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Requests in the log.
    #[arg(long, default_value_t = AdapterMixSpec::default().requests)]
    requests: usize,
    /// LoRA adapters.
    #[arg(long, default_value_t = AdapterMixSpec::default().adapters)]
    adapters: usize,
    /// Timestamp of the last session's start, in ms.
    #[arg(long, default_value_t = AdapterMixSpec::default().span_ms)]
    span_ms: u64,
    /// Seed of the random stream.
    #[arg(long, default_value_t = AdapterMixSpec::default().seed)]
    seed: u64,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let spec = AdapterMixSpec {
        requests: cli.requests,
        adapters: cli.adapters,
        span_ms: cli.span_ms,
        seed: cli.seed,
        ..AdapterMixSpec::default()
    };
    let mut text = String::new();
    for (adapter, r) in adapter_mix(&spec) {
        text.push_str(&request_line(&adapter, &r.record));
        text.push('\n');
    }
    let written = match &cli.out {
        Some(path) => std::fs::write(path, &text).map_err(|e| format!("{}: {e}", path.display())),
        None => std::io::stdout()
            .write_all(text.as_bytes())
            .map_err(|e| format!("stdout: {e}")),
    };
    match written {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("adapter-trace: {e}");
            ExitCode::from(2)
        }
    }
}

//! `hot-prefix-trace`: writes a synthetic workload (see `bench::workloads`) as
//! Mooncake-format jsonl, to stdout or `--out`: the hot-prefix workload (default; with
//! the defaults it reproduces `bench/data/hot_prefix.jsonl` byte for byte), or with
//! `--kind system-prompts` / `--kind shared-docs` the workloads of those names:
//!
//! ```text
//! cargo run --release -p bench --bin hot-prefix-trace -- --out bench/data/hot_prefix.jsonl
//! ./target/release/hot-prefix-trace --kind shared-docs --out /tmp/shared_docs.jsonl
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use bench::workloads::{
    HotPrefixSpec, SharedDocsSpec, SystemPromptsSpec, hot_prefix, shape, shared_documents,
    system_prompts, to_jsonl,
};
use clap::Parser;

/// Generate the hot-prefix trace: a shared ~3k-token system prompt on ~60 % of
/// requests, multi-turn sessions, one-off requests; Mooncake jsonl format.
#[derive(Debug, Parser)]
#[command(name = "hot-prefix-trace", version)]
struct Cli {
    /// Which workload: `hot-prefix` (one hot system prompt, multi-turn sessions,
    /// one-offs), `system-prompts` (a few system prompts shared by most requests,
    /// each with a user turn of its own) or `shared-docs` (a few hundred long
    /// documents each read by several independent sessions). --hot-blocks is the
    /// hot-prefix workload's only.
    #[arg(long, default_value = "hot-prefix", value_parser = ["hot-prefix", "system-prompts", "shared-docs"])]
    kind: String,
    /// Write the trace here instead of stdout.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Requests in the trace.
    #[arg(long, default_value_t = HotPrefixSpec::default().requests)]
    requests: usize,
    /// Timestamp of the last request, in ms (the first is at 0).
    #[arg(long, default_value_t = HotPrefixSpec::default().span_ms)]
    span_ms: u64,
    /// Seed of the random stream [default: the workload's own; the hot-prefix one
    /// gives the committed file].
    #[arg(long)]
    seed: Option<u64>,
    /// Blocks of 512 tokens in the hot system prompt.
    #[arg(long, default_value_t = HotPrefixSpec::default().hot_blocks)]
    hot_blocks: usize,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let spec = HotPrefixSpec {
        requests: cli.requests,
        span_ms: cli.span_ms,
        seed: cli.seed.unwrap_or(HotPrefixSpec::default().seed),
        hot_blocks: cli.hot_blocks,
        ..HotPrefixSpec::default()
    };
    let reqs = match cli.kind.as_str() {
        "system-prompts" => system_prompts(&SystemPromptsSpec {
            requests: cli.requests,
            span_ms: cli.span_ms,
            seed: cli.seed.unwrap_or(SystemPromptsSpec::default().seed),
            ..SystemPromptsSpec::default()
        }),
        "shared-docs" => shared_documents(&SharedDocsSpec {
            requests: cli.requests,
            span_ms: cli.span_ms,
            seed: cli.seed.unwrap_or(SharedDocsSpec::default().seed),
            ..SharedDocsSpec::default()
        }),
        _ => hot_prefix(&spec),
    };
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

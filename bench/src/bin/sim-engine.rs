//! `sim-engine`: one simulated vLLM replica (see `bench::engine`).
//!
//! Prints `sim-engine NAME listening on http://HOST:PORT` on stdout once bound
//! (`--port 0` picks a free port), then serves until Ctrl-C or SIGTERM.

use std::time::Duration;

use bench::engine::{Engine, EngineConfig, KvConnector, MetricsFlavor, Physics};
use clap::Parser;

/// Simulated vLLM engine: OpenAI API, prefix cache with LRU, queueing model on timers.
#[derive(Debug, Parser)]
#[command(name = "sim-engine", version)]
struct Cli {
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to bind (0 = any free port; the bound one is printed).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Replica name, returned in the `x-sim-engine` header.
    #[arg(long, default_value = "sim")]
    name: String,
    /// Served model ids, comma-separated: the first is the default (a request naming
    /// no model gets it); each is a model of its own in GET /v1/models, a request
    /// naming another gets 404, and prompts never hit the cache across models.
    #[arg(long, default_value = "m", value_delimiter = ',')]
    model: Vec<String>,
    /// Prefix cache capacity, in blocks.
    #[arg(long, default_value_t = 65_536)]
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
    /// Inter-token latency while decoding, in simulated ms.
    #[arg(long, default_value_t = 15.0)]
    itl_ms: f64,
    /// Multiplier on every simulated time (0.1 = ten times faster).
    #[arg(long, default_value_t = 1.0)]
    time_factor: f64,
    /// Upper bound on generated tokens per request (tokens).
    #[arg(long, default_value_t = 4096)]
    max_output_tokens: u64,
    /// Largest accepted request body, in bytes.
    #[arg(long, default_value_t = 64 << 20)]
    max_body_bytes: usize,
    /// Metric names of GET /metrics: `vllm` (vllm:num_requests_waiting,
    /// vllm:num_requests_running, vllm:kv_cache_usage_perc, ...) or `sglang`
    /// (sglang:num_queue_reqs, sglang:num_running_reqs, sglang:token_usage, ...).
    /// Both add sim:num_requests_waiting_peak, sim:rejected_total and
    /// sim:embedding_requests_total.
    #[arg(long, default_value_t = MetricsFlavor::Vllm)]
    metrics_flavor: MetricsFlavor,
    /// Most requests waiting for the prefill slot (requests); a generation
    /// request arriving when this many wait is answered 429 with Retry-After
    /// (0 = unbounded, never 429).
    #[arg(long, default_value_t = 0)]
    max_waiting: usize,
    /// Retry-After of a 429, in whole seconds.
    #[arg(long, default_value_t = 1)]
    retry_after_secs: u64,
    /// How prefills share the engine: `serial` (one at a time, FIFO), `parallel` (up
    /// to --prefill-slots at once, each at full speed), `shared` (up to
    /// --prefill-slots at once, sharing one full speed equally, as a per-step token
    /// budget split among running prefills does) or `chunked` (vLLM's chunked prefill:
    /// steps of --max-batched-tokens shared by the decoding requests' tokens and prompt
    /// chunks, each lasting --itl-ms plus its prompt tokens' cost, so a prefill delays
    /// every running request's next token; --ttft-base-ms is then paid before the
    /// request reaches the batch, off the accelerator).
    #[arg(long, default_value_t = Physics::Serial)]
    prefill_physics: Physics,
    /// Prefills running at once under the parallel and shared physics.
    #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(u64).range(1..))]
    prefill_slots: u64,
    /// Tokens one step computes under the chunked physics (vLLM's
    /// max_num_batched_tokens): a token per decoding sequence, the rest prompt chunks.
    #[arg(long, default_value_t = 2048, value_parser = clap::value_parser!(u64).range(1..))]
    max_batched_tokens: u64,
    /// KV connector: `none` (kv_transfer_params ignored) or `nixl` (vLLM's
    /// NixlConnector, kv_both: `do_remote_decode` makes a prefill that answers with
    /// kv_transfer_params, a decode given them reads the prompt's KV instead of
    /// computing it).
    #[arg(long, default_value_t = KvConnector::None)]
    kv_connector: KvConnector,
    /// Fixed cost of reading a prompt's KV from a prefill engine, in simulated ms.
    #[arg(long, default_value_t = 2.0)]
    kv_transfer_base_ms: f64,
    /// Cost per token of KV read from a prefill engine, in simulated µs.
    #[arg(long, default_value_t = 5.0)]
    kv_transfer_us_per_token: f64,
    /// How long a stalled request's first token is held back after its prefill, in
    /// simulated ms (see --stall-share).
    #[arg(long, default_value_t = 0.0)]
    stall_first_token_ms: f64,
    /// Share of the generation requests whose first token stalls (0 to 1), chosen by a
    /// hash of the request body: the same body always stalls or never does.
    #[arg(long, default_value_t = 0.0)]
    stall_share: f64,
    /// Cuts every streamed answer that continues nothing (not a chat request with
    /// continue_final_message) after this many tokens: the connection closes without
    /// the stream's end, as a killed engine's does (to test stream continuation).
    #[arg(long)]
    die_after_tokens: Option<u64>,
}

fn duration(value: f64, unit_s: f64, flag: &str) -> Result<Duration, String> {
    Duration::try_from_secs_f64(value * unit_s)
        .map_err(|_| format!("{flag} must be a finite number >= 0"))
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sim-engine: {e}");
            std::process::ExitCode::from(2)
        }
    }
}

async fn run(cli: Cli) -> Result<(), String> {
    let mut models = cli
        .model
        .iter()
        .map(|m| m.trim().to_string())
        .filter(|m| !m.is_empty());
    let cfg = EngineConfig {
        name: cli.name.clone(),
        model: models.next().ok_or("--model names no model")?,
        extra_models: models.collect(),
        kv_blocks: cli.kv_blocks,
        block_size: cli.block_size,
        ttft_base: duration(cli.ttft_base_ms, 1e-3, "--ttft-base-ms")?,
        prefill_per_token: duration(cli.prefill_us_per_token, 1e-6, "--prefill-us-per-token")?,
        itl: duration(cli.itl_ms, 1e-3, "--itl-ms")?,
        time_factor: cli.time_factor,
        max_output_tokens: cli.max_output_tokens,
        max_body_bytes: cli.max_body_bytes,
        metrics_flavor: cli.metrics_flavor,
        max_waiting: cli.max_waiting,
        retry_after_secs: cli.retry_after_secs,
        prefill_physics: cli.prefill_physics,
        prefill_slots: cli.prefill_slots as usize,
        max_batched_tokens: cli.max_batched_tokens as usize,
        kv_connector: cli.kv_connector,
        kv_transfer_base: duration(cli.kv_transfer_base_ms, 1e-3, "--kv-transfer-base-ms")?,
        kv_transfer_per_token: duration(
            cli.kv_transfer_us_per_token,
            1e-6,
            "--kv-transfer-us-per-token",
        )?,
        stall_first_token: duration(cli.stall_first_token_ms, 1e-3, "--stall-first-token-ms")?,
        stall_share: cli.stall_share,
        die_after_tokens: cli.die_after_tokens,
    };
    let engine = Engine::new(cfg).map_err(|e| e.to_string())?;
    let listener = bench::engine::bind((cli.host.as_str(), cli.port))
        .await
        .map_err(|e| format!("cannot bind {}:{}: {e}", cli.host, cli.port))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    println!("sim-engine {} listening on http://{addr}", cli.name);
    engine
        .serve_with_shutdown(listener, shutdown_signal())
        .await;
    Ok(())
}

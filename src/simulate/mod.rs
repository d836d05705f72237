//! `cache-aware-router simulate`: replays a request log through the router's own policy
//! code, with no network, over a model of N engines, for a grid of settings.
//!
//! ```text
//! input     the log: request bodies (JSONL) or a Mooncake trace, per-line errors
//! mooncake  a trace line's deterministic prompt text (shared with bench's sim-engine)
//! engine    the engine model (prefix cache, block hashes, prefill queue; shared with
//!           sim-engine)
//! run       one replay: extract -> pick_slot -> observe -> first byte -> settle_usage,
//!           on tokio's paused clock
//! grid      the settings, the table, the recommendation rule
//! ```
//!
//! Workers are N URLs under `.invalid` that are never contacted. Token counts are the
//! engine model's tokens: one per whitespace-separated word of the whole prompt text as
//! the router extracts it (role, then content, per message; sim-engine's word-level
//! tokenizer — for real text about 0.75 of a BPE tokenizer's count). Times are
//! simulated milliseconds. Deterministic: fixed seeds, one thread, paused time; two runs
//! of the same input print the same table.

pub mod engine;
pub mod grid;
pub mod input;
pub mod mooncake;
pub mod run;

use std::io::{IsTerminal, Write as _};
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};

use crate::config::{Config, ConfigError};
use crate::prompt;
use engine::{Physics, Timing, block_hashes_under, tokenize_words};
use input::Format;
use run::{Measured, PoolModel, Prepared};

/// `cache-aware-router simulate`: replay a request log through the same policy code,
/// with no network, over a model of N engines, and compare a grid of settings.
#[derive(Debug, Clone, clap::Args)]
pub struct SimulateArgs {
    /// The request log: JSONL of request bodies (`{"timestamp_ms", "path", "body",
    /// "duration_ms"}`, see README "simulate") or a Mooncake trace.
    #[arg(long, value_name = "FILE")]
    pub input: PathBuf,
    /// Log format; `auto` decides by the first line (`hash_ids` = mooncake).
    #[arg(long, value_enum, default_value_t = Format::Auto)]
    pub format: Format,
    /// Replay only the first N requests (0 = all).
    #[arg(long, default_value_t = 0)]
    pub limit: usize,
    /// Skip (and count) unreadable lines instead of stopping at the first one.
    #[arg(long)]
    pub skip_bad_lines: bool,
    /// Engines in the modelled pool.
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// Prefix-cache capacity per engine, in KV blocks.
    #[arg(long, default_value_t = 64_000)]
    pub kv_blocks: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_tokens: usize,
    /// Uncached prompt tokens one engine prefills per second (serialized per engine).
    #[arg(long, default_value_t = 12_500.0)]
    pub prefill_tokens_per_sec: f64,
    /// Fixed cost of every prefill, in ms.
    #[arg(long, default_value_t = 20.0)]
    pub ttft_base_ms: f64,
    /// Decode time per output token after the first, in ms (used when the log gives no
    /// `duration_ms`).
    #[arg(long, default_value_t = 15.0)]
    pub decode_ms_per_token: f64,
    /// Most output tokens per request (the log's or the body's `max_tokens`, capped).
    #[arg(long, default_value_t = 64)]
    pub max_output_tokens: u64,
    /// Arrival rate for requests without `timestamp_ms`, in requests per second.
    #[arg(long, default_value_t = 10.0)]
    pub rate: f64,
    /// Offered load: arrivals this many times as fast at the same engine speed (the
    /// log's timestamps, or `--rate`'s spacing, divided by it; as trace-matrix's
    /// `--load`).
    #[arg(long, default_value_t = 1.0)]
    pub load: f64,
    /// How each engine's prefills share it: `serial` (one at a time), `parallel` (up
    /// to --prefill-slots at once, each at full speed) or `shared` (up to
    /// --prefill-slots sharing one speed), FIFO beyond; or `chunked` (vLLM's chunked
    /// prefill: steps of 2,048 tokens shared by every decoding request's next token and
    /// prompt chunks, oldest first, so a prefill slows the tokens decoding beside it).
    #[arg(long, value_enum, default_value_t = Physics::Serial)]
    pub prefill_physics: Physics,
    /// Prefills at once under the parallel and shared physics.
    #[arg(long, default_value_t = 6)]
    pub prefill_slots: usize,
    /// Most requests in flight at once, as trace-matrix's replay allows: a request due
    /// while that many run is sent when one ends (0 = no limit).
    #[arg(long, default_value_t = 512)]
    pub concurrency: usize,
    /// Which rows: `tuning` (cache_aware's knobs, then the other policies) or
    /// `learning` (cache_aware and cost_aware with `cache.learn_evictions` off and on,
    /// round_robin).
    #[arg(long, value_enum, default_value_t = grid::Grid::Tuning)]
    pub grid: grid::Grid,
    /// Router config to start from (repeatable, layered as for serving); each grid row
    /// layers its policy and cache keys on top, and the workers are always the
    /// simulated ones.
    #[arg(short = 'c', long = "config", value_name = "FILE")]
    pub config: Vec<PathBuf>,
    /// Seed of the policies' random choices.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Model LoRA adapters: a request's `model` names the adapter it runs under (none:
    /// the base model), each engine holds this many at once (loading one it does not
    /// hold, least recently used evicted) and each worker is configured with
    /// `max_lora` = this; the table gains adapter loads per minute and a
    /// `cache_aware` row without the router's adapter residency. 0 = off.
    #[arg(long, default_value_t = 0)]
    pub max_lora: usize,
    /// With `--max-lora`: what loading an adapter adds to the prefill of the request
    /// that needs it, in ms (serialized with the engine's prefills).
    #[arg(long, default_value_t = 0.0)]
    pub adapter_load_ms: f64,
}

/// Why a simulation could not run.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Line {
        path: PathBuf,
        #[source]
        source: input::LineError,
    },
    #[error("{0}: no request to replay")]
    Empty(PathBuf),
    #[error("invalid setting: {0}")]
    Setting(String),
    #[error("grid row {row:?}: {source}")]
    Config {
        row: String,
        #[source]
        source: ConfigError,
    },
    #[error("cannot start the simulation runtime: {0}")]
    Runtime(#[source] std::io::Error),
}

/// The result: the grid, each row's measurements, the recommendation.
#[derive(Debug, Clone)]
pub struct Report {
    pub settings: Vec<grid::Setting>,
    pub rows: Vec<Measured>,
    pub recommended: Option<usize>,
    /// Lines skipped as unreadable, and the first one's error.
    pub skipped: usize,
    pub first_skip: Option<String>,
    pub requests: usize,
}

impl Report {
    /// The markdown table plus a line on what was replayed.
    pub fn render(&self, args: &SimulateArgs) -> String {
        let physics = match args.prefill_physics {
            Physics::Serial => "one at a time per engine".to_owned(),
            Physics::Chunked => format!(
                "chunked, {} tokens a step",
                crate::simulate::engine::CHUNKED_BUDGET_TOKENS
            ),
            p => format!("{} × {} per engine", p.as_str(), args.prefill_slots),
        };
        let mut out = format!(
            "{} requests from {} at {}× over {} engines × {} KV blocks of {} tokens; prefill \
             {} ms + {} tokens/s ({physics}), decode {} ms/token, output ≤ {} tokens\n\n",
            self.requests,
            args.input.display(),
            args.load,
            args.workers,
            args.kv_blocks,
            args.block_tokens,
            args.ttft_base_ms,
            args.prefill_tokens_per_sec,
            args.decode_ms_per_token,
            args.max_output_tokens,
        );
        if args.max_lora > 0 {
            out.insert_str(
                out.len() - 1,
                &format!(
                    "LoRA adapters: each request's `model`; {} held per engine (LRU), a load adds {} ms to its prefill\n",
                    args.max_lora, args.adapter_load_ms
                ),
            );
        }
        out.push_str(&grid::table(&self.settings, &self.rows, self.recommended));
        out.push_str(
            "\navailable / predicted / delivered = Σ tokens ÷ Σ prompt tokens: the longest \
             prefix any engine held at arrival / the policy's prediction for its pick / what \
             the chosen engine served from cache. TTFT = prefill queue wait + the fixed \
             prefill base + uncached tokens ÷ prefill rate (simulated ms). Recommended: best \
             delivered among rows within 10 % of the best TTFT p99 that rejected nothing. \
             d÷p = delivered ÷ predicted over the requests whose pick predicted a hit; aged \
             out = MB of routing records the tree's learning removed (cache.learn_evictions).\n",
        );
        if self.skipped > 0 {
            out.push_str(&format!(
                "{} unreadable line(s) skipped; the first: {}\n",
                self.skipped,
                self.first_skip.as_deref().unwrap_or("-")
            ));
        }
        out
    }
}

/// Reads the log and runs every row of the grid. Progress goes to stderr (a bar when it
/// is a terminal, a line per row otherwise) when `show_progress`.
pub fn run(args: &SimulateArgs, show_progress: bool) -> Result<Report, SimError> {
    let model = pool_model(args)?;
    let text = std::fs::read_to_string(&args.input).map_err(|source| SimError::Read {
        path: args.input.clone(),
        source,
    })?;
    let log = input::read(
        &text,
        args.format,
        (args.limit > 0).then_some(args.limit),
        args.max_output_tokens,
        args.skip_bad_lines,
    )
    .map_err(|source| SimError::Line {
        path: args.input.clone(),
        source,
    })?;
    if log.requests.is_empty() {
        return Err(SimError::Empty(args.input.clone()));
    }
    let requests = prepare(
        &log.requests,
        (args.rate, args.load),
        model.block_tokens.get(),
        args.max_lora > 0,
    );
    let user: Vec<(PathBuf, String)> = args
        .config
        .iter()
        .map(|p| {
            std::fs::read_to_string(p)
                .map(|t| (p.clone(), t))
                .map_err(|source| SimError::Read {
                    path: p.clone(),
                    source,
                })
        })
        .collect::<Result<_, _>>()?;
    let mut settings = grid::settings(args.grid);
    if args.max_lora > 0 {
        settings.push(grid::without_residency());
    }
    let configs = settings
        .iter()
        .map(|s| row_config(&user, s, args.workers, args.max_lora))
        .collect::<Result<Vec<_>, _>>()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .map_err(SimError::Runtime)?;
    // Every row layers only policy and cache thresholds: one max_prompt_bytes for all.
    let max_prompt_bytes = configs
        .first()
        .map_or(32 * 1024, |c| c.cache.max_prompt_bytes);
    let contexts: Vec<_> = requests
        .iter()
        .map(|r| {
            let mut c = prompt::extract(r.endpoint, &r.body, max_prompt_bytes);
            c.scope(r.adapter.as_deref());
            c
        })
        .collect();
    let mut bar = Progress::new(show_progress, settings.len() * requests.len());
    let rows = runtime.block_on(async {
        let mut rows = Vec::with_capacity(configs.len());
        for (i, config) in configs.iter().enumerate() {
            let run = (args.seed, settings[i].residency);
            let m = run::replay(config, &model, &requests, &contexts, run, || bar.tick()).await;
            bar.row_done(i + 1, settings.len(), &settings[i].label);
            rows.push(m);
        }
        rows
    });
    bar.finish();
    let recommended = grid::recommend(&rows);
    Ok(Report {
        settings,
        rows,
        recommended,
        skipped: log.skipped,
        first_skip: log.first_skip,
        requests: requests.len(),
    })
}

fn pool_model(args: &SimulateArgs) -> Result<PoolModel, SimError> {
    let nz = |n: usize, what: &str| {
        NonZeroUsize::new(n).ok_or_else(|| SimError::Setting(format!("{what} must be at least 1")))
    };
    if args.workers > 4096 {
        return Err(SimError::Setting("--workers is at most 4096".into()));
    }
    for (v, what) in [
        (args.prefill_tokens_per_sec, "--prefill-tokens-per-sec"),
        (args.rate, "--rate"),
        (args.load, "--load"),
    ] {
        if !(v.is_finite() && v > 0.0) {
            return Err(SimError::Setting(format!(
                "{what} must be a number > 0, got {v}"
            )));
        }
    }
    for (v, what) in [
        (args.ttft_base_ms, "--ttft-base-ms"),
        (args.decode_ms_per_token, "--decode-ms-per-token"),
        (args.adapter_load_ms, "--adapter-load-ms"),
    ] {
        if !(v.is_finite() && v >= 0.0) {
            return Err(SimError::Setting(format!(
                "{what} must be a number >= 0, got {v}"
            )));
        }
    }
    Ok(PoolModel {
        workers: nz(args.workers, "--workers")?.get(),
        kv_blocks: nz(args.kv_blocks, "--kv-blocks")?,
        block_tokens: nz(args.block_tokens, "--block-tokens")?,
        timing: Timing {
            ttft_base_ms: args.ttft_base_ms,
            prefill_tokens_per_sec: args.prefill_tokens_per_sec,
            decode_ms_per_token: args.decode_ms_per_token,
        },
        physics: args.prefill_physics,
        prefill_slots: nz(args.prefill_slots, "--prefill-slots")?,
        concurrency: args.concurrency,
        adapter_slots: NonZeroUsize::new(args.max_lora),
        adapter_load_ms: args.adapter_load_ms,
    })
}

/// Arrivals from the log's timestamps (shifted so the first is 0; a request without
/// one comes `1000 / rate` ms after the one before), divided by `load`, sorted stably;
/// the engine's tokens and block hashes of each whole prompt.
fn prepare(
    logged: &[input::LoggedRequest],
    (rate, load): (f64, f64),
    block_tokens: usize,
    adapters: bool,
) -> Vec<Prepared> {
    let origin = logged
        .iter()
        .filter_map(|r| r.arrival_ms)
        .fold(f64::INFINITY, f64::min);
    let mut last = 0.0;
    let mut out: Vec<Prepared> = logged
        .iter()
        .map(|r| {
            let arrival_ms = match r.arrival_ms {
                Some(t) => t - origin,
                None => last + 1000.0 / rate,
            };
            last = arrival_ms;
            let whole = prompt::extract(r.endpoint, &r.body, usize::MAX);
            let adapter: Option<std::sync::Arc<str>> = whole
                .model
                .as_ref()
                .and_then(|f| f.name(&r.body))
                .filter(|m| adapters && !m.is_empty())
                .map(|m| std::sync::Arc::from(&*m));
            let text = String::from_utf8_lossy(&whole.text);
            let (n, hashes) =
                block_hashes_under(tokenize_words(&text), block_tokens, adapter.as_deref());
            Prepared {
                endpoint: r.endpoint,
                body: r.body.clone(),
                arrival_ms: arrival_ms / load,
                prompt_tokens: n,
                hashes,
                output_tokens: r.output_tokens,
                duration_ms: r.duration_ms,
                adapter,
            }
        })
        .collect();
    out.sort_by(|a, b| a.arrival_ms.total_cmp(&b.arrival_ms));
    out
}

/// A grid row's config: the user's files, then the row's keys, then the simulated
/// workers (never contacted), validated as `Config::load` validates.
fn row_config(
    user: &[(PathBuf, String)],
    setting: &grid::Setting,
    workers: usize,
    max_lora: usize,
) -> Result<Config, SimError> {
    let mut overlay = setting.yaml.clone();
    overlay.push_str("workers:\n");
    for i in 0..workers {
        overlay.push_str(&format!(
            "  - url: http://engine-{i}.simulate.invalid:8000\n"
        ));
        if max_lora > 0 {
            overlay.push_str(&format!("    max_lora: {max_lora}\n"));
        }
    }
    let row = Path::new("<simulate grid row>");
    let sources = user
        .iter()
        .map(|(p, t)| (p.as_path(), t.as_str()))
        .chain(std::iter::once((row, overlay.as_str())));
    Config::from_sources(sources).map_err(|source| SimError::Config {
        row: setting.label.clone(),
        source,
    })
}

/// Progress on stderr: a bar redrawn in place on a terminal, else one line per row.
struct Progress {
    enabled: bool,
    terminal: bool,
    total: usize,
    done: usize,
    drawn_pct: usize,
}

impl Progress {
    fn new(enabled: bool, total: usize) -> Self {
        Progress {
            enabled,
            terminal: std::io::stderr().is_terminal(),
            total: total.max(1),
            done: 0,
            drawn_pct: usize::MAX,
        }
    }

    fn tick(&mut self) {
        self.done += 1;
        if !(self.enabled && self.terminal) {
            return;
        }
        let pct = self.done * 100 / self.total;
        if pct != self.drawn_pct {
            self.drawn_pct = pct;
            let filled = pct * 40 / 100;
            eprint!(
                "\rsimulate [{}{}] {pct:3}%",
                "=".repeat(filled),
                " ".repeat(40 - filled)
            );
            let _ = std::io::stderr().flush();
        }
    }

    fn row_done(&mut self, row: usize, rows: usize, label: &str) {
        if self.enabled && !self.terminal {
            eprintln!("simulate: row {row}/{rows} done ({label})");
        }
    }

    fn finish(&mut self) {
        if self.enabled && self.terminal {
            eprintln!();
        }
    }
}

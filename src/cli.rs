//! The `cache-aware-router` command line: serve (the default), `--config-check`, and
//! the tools (`simulate`). Read by `main` only, so the config does not depend on the
//! tools.

use std::path::PathBuf;

use clap::Parser;

/// `cache-aware-router` command line.
#[derive(Debug, Parser)]
#[command(
    name = "cache-aware-router",
    version,
    about,
    subcommand_negates_reqs = true
)]
pub struct Cli {
    /// YAML config file; repeat to layer files in order (later files override earlier
    /// ones key by key; lists replace).
    #[arg(short = 'c', long = "config", value_name = "FILE", required = true)]
    pub config: Vec<PathBuf>,

    /// Validate the config files and exit: 0 when valid, 2 with a message otherwise.
    #[arg(long)]
    pub config_check: bool,

    /// A tool instead of serving.
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// `cache-aware-router <COMMAND>`.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Replay a request log (JSONL bodies or a Mooncake trace) through the same policy
    /// code with no network, over a model of N engines, and print a table over a grid
    /// of policies and settings with the recommended one marked.
    Simulate(crate::simulate::SimulateArgs),
}

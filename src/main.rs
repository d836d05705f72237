//! `cache-aware-router` binary: parse the CLI, load the config, run.

use std::process::ExitCode;

use cache_aware_router::{
    app,
    cli::{Cli, Command},
    config::{Config, LogColor, LogFormat},
    log_format, log_sink, simulate,
    tokenize::PromptTokenizer,
};
use clap::Parser;

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(Command::Simulate(args)) = &cli.command {
        return match simulate::run(args, true) {
            Ok(report) => {
                print!("{}", report.render(args));
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("cache-aware-router simulate: {e}");
                ExitCode::from(2)
            }
        };
    }
    // The tokenizer is the part's to load (precise mode loads it again when it builds);
    // loaded here first so that a file it cannot use is refused before serving, and by
    // --config-check, like any config value.
    let loaded =
        Config::load(&cli.config).and_then(|c| PromptTokenizer::from_config(&c.precise).map(|_| c));
    let config = match loaded {
        Ok(c) => c,
        Err(e) => {
            eprintln!("cache-aware-router: invalid configuration: {e}");
            return ExitCode::from(2);
        }
    };
    if cli.config_check {
        println!(
            "configuration OK: {} worker(s), policy {}",
            config.workers.len(),
            config.policy.as_str()
        );
        return ExitCode::SUCCESS;
    }
    init_tracing(&config);
    if let Err(e) = raise_fd_limit() {
        eprintln!("cache-aware-router: {e}");
        return ExitCode::FAILURE;
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("cache-aware-router: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(app::run(config, cli.config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Once, in the log's own format (logging is up by now).
            tracing::error!("cannot run: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Environment variable naming the least open-file limit the router may start with
/// (set by the container image; unset = only warn).
const MIN_NOFILE_ENV: &str = "CACHE_AWARE_ROUTER_MIN_NOFILE";

/// Each client and each upstream connection is a file descriptor: raise the soft limit to
/// the hard one, and warn when that stays below 65535. Refuses to start when it stays
/// below `CACHE_AWARE_ROUTER_MIN_NOFILE`.
fn raise_fd_limit() -> Result<(), String> {
    const WANTED: u64 = 65_535;
    let required =
        match std::env::var(MIN_NOFILE_ENV) {
            Ok(v) => Some(v.trim().parse::<u64>().map_err(|_| {
                format!("{MIN_NOFILE_ENV}={v:?} is not a number of file descriptors")
            })?),
            Err(_) => None,
        };
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(n) if required.is_some_and(|r| n < r) => Err(format!(
            "the open-file limit is {n}, below the {} this deployment requires ({MIN_NOFILE_ENV}): \
             every client and upstream connection takes one; raise it (docker run --ulimit nofile=65535:65535, \
             or the pod's/host's limits)",
            required.unwrap_or(WANTED)
        )),
        Ok(n) if n < WANTED => {
            tracing::warn!(
                limit = n,
                "open-file limit is below {WANTED}; raise it (ulimit -n) or connections will fail under load"
            );
            Ok(())
        }
        Ok(n) => {
            tracing::debug!(limit = n, "open-file limit");
            Ok(())
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot read or raise the open-file limit");
            Ok(())
        }
    }
}

/// Logs go to stderr (stdout stays free for `--config-check`'s answer), in colour as
/// `log.color` says (`auto`: only when stderr is a terminal, so a file or a pipe gets
/// no escape codes). `RUST_LOG` wins over `log.level`; `log.format` picks text or JSON
/// lines (never coloured). Connection threads gather their lines and write them out
/// when they go idle (`log_sink`).
fn init_tracing(config: &Config) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&config.log.level));
    let ansi = match config.log.color {
        LogColor::Auto => std::io::stderr().is_terminal(),
        LogColor::Always => config.log.format == LogFormat::Text,
        LogColor::Never => false,
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(log_sink::Stderr)
        .with_timer(log_format::CachedTime)
        .with_ansi(ansi);
    match config.log.format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text if ansi => builder.init(),
        // The same `key=value` text as the default field formatter, written for less
        // (see `log_format`).
        LogFormat::Text => builder.fmt_fields(log_format::PlainFields).init(),
    }
}

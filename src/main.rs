//! `cache-aware-router` binary: parse the CLI, load the config, run.

use std::process::ExitCode;

use cache_aware_router::{
    app,
    config::{Cli, Config, LogFormat},
};
use clap::Parser;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let config = match Config::load(&cli.config) {
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
    raise_fd_limit();
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
            tracing::error!(error = %e, "fatal");
            eprintln!("cache-aware-router: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Each client and each upstream connection is a file descriptor: raise the soft limit to
/// the hard one, and warn when that stays below 65535.
fn raise_fd_limit() {
    const WANTED: u64 = 65_535;
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(n) if n < WANTED => tracing::warn!(
            limit = n,
            "open-file limit is below {WANTED}; raise it (ulimit -n) or connections will fail under load"
        ),
        Ok(n) => tracing::debug!(limit = n, "open-file limit"),
        Err(e) => tracing::warn!(error = %e, "cannot read or raise the open-file limit"),
    }
}

/// `RUST_LOG` wins over `log.level`; `log.format` picks text or JSON lines.
fn init_tracing(config: &Config) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&config.log.level));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    match config.log.format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}

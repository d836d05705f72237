//! The `cache-aware-router` command line: serve (the default), `--config-check`, and
//! the tools (`simulate`). Read by `main` only, so the config does not depend on the
//! tools.

use std::path::PathBuf;

use clap::Parser;

/// What `--help` says after the options: signals, the environment, where the config
/// keys are documented, and the exit codes. Every variable listed is one the binary (or
/// a library it calls) really reads; the config itself reads none (no `${VAR}`).
pub const AFTER_HELP: &str = "\
Signals:
  SIGHUP           Re-read every -c file. Only `workers` may change live (add, remove,
                   edit; workers that stay keep their routing memory, an empty list is
                   allowed). A file that does not load, or a change to any other key, is
                   logged and the running config kept: restart for those.
  SIGTERM, SIGINT  Stop accepting, drain in-flight requests for up to
                   server.shutdown_grace_secs (default 30), exit 0; a second signal exits
                   at once.

Environment:
  RUST_LOG                       Overrides log.level when set (same syntax: info,
                                 cache_aware_router=debug, ...).
  CACHE_AWARE_ROUTER_MIN_NOFILE  Refuse to start when the open-file limit stays below it.
  CACHE_AWARE_ROUTER_THREADS     Threads serving client connections, a runtime each
                                 (default: one per core; 0: tasks of the main runtime).
  SSL_CERT_FILE, SSL_CERT_DIR    Trust store for https:// workers (else the system's;
                                 proxy.tls.ca_file adds to it).
  KUBECONFIG                     Cluster access for `discovery: kubernetes` (else
                                 ~/.kube/config, else the in-cluster service account).
  OTEL_EXPORTER_OTLP_TRACES_HEADERS, OTEL_EXPORTER_OTLP_HEADERS
                                 Extra headers (key1=value1,key2=value2) on span
                                 exports, e.g. a collector's auth token; the endpoint
                                 is tracing.otlp_endpoint.
  No config value comes from the environment: put secrets (api_key, admin_token) in a
  file of their own and layer it with a second -c.

Configuration reference:
  README.md, section \"Configuration\"; config.example.yaml lists every key with its
  default and unit. Workers: `workers: [http://10.0.0.1:8000, ...]`.

Exit status:
  --config-check: 0 when the files are valid, 2 with a one-line message naming the
  file, line, key and value otherwise. Serving: 2 on an invalid config or command line,
  1 when it cannot start (port taken, open-file limit), 0 after a drain.";

/// `cache-aware-router` command line.
#[derive(Debug, Parser)]
#[command(
    name = "cache-aware-router",
    version,
    about,
    after_help = AFTER_HELP,
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

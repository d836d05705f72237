//! Starting the router of a contender: ours (its generated config and a policy's
//! variant keys), a peer from its PyPI package, or nginx as a plain round-robin proxy.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;

use crate::procs::{
    self, ChildProc, ProcError, RouterCommand, ScratchDir, io_err, start_router_command, tail,
};

/// A peer router, run from its PyPI package (a Python entry point around a Rust
/// extension; the router runs inside that Python process).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Peer {
    /// `sglang-router` (PyPI 0.3.2): `smg launch --worker-urls ... --policy P`.
    Sglang,
    /// `vllm-router` (PyPI 0.1.17): `vllm-router --worker-urls ... --policy P`.
    Vllm,
}

impl Peer {
    /// Both peers, in table order.
    pub const ALL: [Peer; 2] = [Peer::Sglang, Peer::Vllm];

    /// Package name: `sglang-router`, `vllm-router`.
    pub fn name(self) -> &'static str {
        match self {
            Peer::Sglang => "sglang-router",
            Peer::Vllm => "vllm-router",
        }
    }

    /// Short key used in contender lists: `sglang`, `vllm`.
    pub fn key(self) -> &'static str {
        match self {
            Peer::Sglang => "sglang",
            Peer::Vllm => "vllm",
        }
    }

    /// The peer named `key` (`sglang`, `sglang-router`, `vllm`, `vllm-router`).
    pub fn from_key(key: &str) -> Option<Peer> {
        Peer::ALL
            .into_iter()
            .find(|p| key == p.key() || key == p.name())
    }

    /// Its executable inside a virtualenv: `VENV/bin/smg`, `VENV/bin/vllm-router`.
    pub fn bin_in(self, venv: &Path) -> PathBuf {
        venv.join("bin").join(match self {
            Peer::Sglang => "smg",
            Peer::Vllm => "vllm-router",
        })
    }

    /// Its `--log-level` value for `level` (`warn` is `warning` for vllm-router).
    fn log_level(self, level: &str) -> String {
        match (self, level) {
            (Peer::Vllm, "warn") => "warning".into(),
            (Peer::Sglang, "warning") => "warn".into(),
            _ => level.into(),
        }
    }

    /// Its balance thresholds when left at their defaults, as its `--help` and the
    /// startup log say: (cache_threshold, balance_abs_threshold, balance_rel_threshold).
    pub fn default_thresholds(self) -> (f64, u32, f64) {
        (0.3, 64, 1.5)
    }

    /// Its command line: only what it needs to run here (address, workers,
    /// policy) plus, when `log_level` is given, that log level; every other
    /// setting is the package's default. The environment points any Hugging Face
    /// hub access at a closed loopback port (sglang-router tries to fetch a
    /// tokenizer for the served model name; there is no network here anyway).
    pub fn command(
        self,
        program: &Path,
        policy: &str,
        port: u16,
        workers: &[String],
        log_level: Option<&str>,
    ) -> RouterCommand {
        let mut args: Vec<String> = Vec::new();
        if self == Peer::Sglang {
            args.push("launch".into());
        }
        args.extend([
            "--host".into(),
            "127.0.0.1".into(),
            "--port".into(),
            port.to_string(),
            "--policy".into(),
            policy.into(),
        ]);
        if let Some(level) = log_level {
            args.push("--log-level".into());
            args.push(self.log_level(level));
        }
        args.push("--worker-urls".into());
        args.extend(workers.iter().cloned());
        RouterCommand {
            name: self.name().into(),
            program: program.to_path_buf(),
            args,
            env: vec![
                ("HF_ENDPOINT".into(), "http://127.0.0.1:9".into()),
                ("HF_HUB_OFFLINE".into(), "1".into()),
            ],
            context: String::new(),
            term_tree: false,
        }
    }
}

/// Where the peer routers are and how they are run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerSetup {
    /// `smg` of sglang-router.
    pub sglang_bin: PathBuf,
    /// `vllm-router`.
    pub vllm_bin: PathBuf,
    /// `--log-level` given to the peers (`None`: their default, `info`).
    pub log_level: Option<String>,
    /// nginx, for [`RouterKind::Nginx`] (default `/usr/sbin/nginx`, Debian's).
    pub nginx_bin: PathBuf,
    /// nginx writes an access log line per request (default off: the plain
    /// proxy baseline).
    pub nginx_access_log: bool,
}

impl PeerSetup {
    /// Both peers from the virtualenv `venv` (see `bench/peers/run.sh`); nginx
    /// from `/usr/sbin/nginx`, without access log.
    pub fn from_venv(venv: &Path, log_level: Option<String>) -> Self {
        Self {
            sglang_bin: Peer::Sglang.bin_in(venv),
            vllm_bin: Peer::Vllm.bin_in(venv),
            log_level,
            nginx_bin: PathBuf::from("/usr/sbin/nginx"),
            nginx_access_log: false,
        }
    }

    /// The executable of `peer`.
    pub fn bin(&self, peer: Peer) -> &Path {
        match peer {
            Peer::Sglang => &self.sglang_bin,
            Peer::Vllm => &self.vllm_bin,
        }
    }
}

/// Which router serves a contender.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RouterKind {
    /// cache-aware-router (this project).
    Ours,
    /// A peer router.
    Peer(Peer),
    /// nginx as a plain round-robin reverse proxy (see [`nginx_config`]): the
    /// baseline of what proxying alone costs.
    Nginx,
}

impl RouterKind {
    /// `cache-aware-router`, `sglang-router`, `vllm-router`, `nginx`.
    pub fn name(self) -> &'static str {
        match self {
            RouterKind::Ours => "cache-aware-router",
            RouterKind::Peer(p) => p.name(),
            RouterKind::Nginx => "nginx",
        }
    }
}

/// The nginx.conf of [`RouterKind::Nginx`]: a plain round-robin reverse proxy on
/// 127.0.0.1:`port` in front of `workers` (`http://host:port` URLs), everything
/// it writes (pid, temp files, the access log when `access_log`) under `dir`, its
/// error log (level `warn`) to stderr. As nginx is usually run: `worker_processes
/// auto` (one per core), the default round robin of an `upstream` block, the
/// default `combined` access log format; for proxying LLM answers: an upstream keep-alive pool (`keepalive 64`,
/// HTTP/1.1, `Connection` cleared), `proxy_buffering off` (streams pass as they
/// come) and `proxy_request_buffering off`, bodies up to 64 MiB. Set above the
/// defaults so that the load decides, not a limit: `worker_connections 4096`
/// (default 512) and `keepalive_requests 1000000` on both sides (default 1000,
/// after which nginx closes a keep-alive connection and the closed-loop clients
/// would count that as an error).
pub fn nginx_config(port: u16, workers: &[String], dir: &Path, access_log: bool) -> String {
    let servers: String = workers
        .iter()
        .map(|w| {
            let hostport = w.trim_start_matches("http://").trim_end_matches('/');
            format!("        server {hostport};\n")
        })
        .collect();
    let access = if access_log {
        "access_log DIR/access.log;"
    } else {
        "access_log off;"
    };
    NGINX_CONF
        .replace("ACCESS_LOG", access)
        .replace("        SERVERS\n", &servers)
        .replace("PORT", &port.to_string())
        .replace("DIR", &dir.display().to_string())
}

/// [`nginx_config`]'s template.
const NGINX_CONF: &str = r#"worker_processes auto;
daemon off;
master_process on;
pid DIR/nginx.pid;
error_log stderr warn;
worker_rlimit_nofile 65536;
events {
    worker_connections 4096;
}
http {
    ACCESS_LOG
    client_body_temp_path DIR/client_body;
    proxy_temp_path DIR/proxy;
    fastcgi_temp_path DIR/fastcgi;
    uwsgi_temp_path DIR/uwsgi;
    scgi_temp_path DIR/scgi;
    keepalive_requests 1000000;
    upstream engines {
        SERVERS
        keepalive 64;
        keepalive_requests 1000000;
    }
    server {
        listen 127.0.0.1:PORT;
        client_max_body_size 64m;
        location / {
            proxy_pass http://engines;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
        }
    }
}
"#;

/// A router process started by [`start_any_router`].
#[derive(Debug)]
pub struct StartedRouter {
    /// Base URL on 127.0.0.1.
    pub url: String,
    /// OS process id.
    pub pid: u32,
    /// How it was run (command line; for ours also the config).
    pub how: String,
    /// Holds its log (and config); removed on drop.
    pub dir: ScratchDir,
}

impl StartedRouter {
    /// The last lines of its log.
    pub fn log_tail(&self, lines: usize) -> String {
        tail(&self.dir.path().join("router.log"), lines)
    }
}

/// The 1-token chat request used to tell that a router routes (see
/// [`procs::start_router_command`]): too short to fill one KV block.
pub fn probe_body(model: &str) -> Bytes {
    Bytes::from(
        serde_json::json!({
            "model": model,
            "messages": [{"role": "user", "content": "ping"}],
            "max_tokens": 1,
        })
        .to_string(),
    )
}

/// Starts `kind` with `policy` in front of `workers` on 127.0.0.1:`port` and waits
/// until it answers `GET /health` and a probe chat request ([`probe_body`]) with
/// 2xx. Ours gets [`router_config_phased`] (`phases`: each worker's `phase`, empty for
/// none) plus `extra_yaml` (a `log:` line there replaces the default one); a peer gets [`Peer::command`]; nginx (which ignores
/// `policy`: round robin) gets [`nginx_config`] and is stopped with SIGTERM to its
/// master and workers. The child is pushed onto `procs`.
#[allow(clippy::too_many_arguments)]
pub async fn start_any_router(
    kind: RouterKind,
    policy: &str,
    router_bin: &Path,
    peers: &PeerSetup,
    (workers, phases): (&[String], &[&str]),
    port: u16,
    extra_yaml: &str,
    model: &str,
    startup_timeout: Duration,
    procs: &mut Vec<ChildProc>,
) -> Result<StartedRouter, ProcError> {
    let dir = ScratchDir::new("router", &format!("{}-{policy}-{port}", kind.name()))?;
    let (spec, how) = match kind {
        RouterKind::Ours => {
            let yaml = router_config_phased(
                policy_variant(policy).map_err(ProcError::NotReady)?.0,
                port,
                workers,
                phases,
            );
            ours_command(policy, router_bin, yaml, extra_yaml, &dir)?
        }
        RouterKind::Peer(peer) => {
            let bin = peers.bin(peer);
            procs::require_binary(
                bin,
                peer.name(),
                "install the peers with `bench/peers/run.sh` (or pass --peer-venv / --sglang-bin / --vllm-bin)",
            )?;
            let spec = peer.command(bin, policy, port, workers, peers.log_level.as_deref());
            let how = format!("`{}`", spec.display_line());
            (spec, how)
        }
        RouterKind::Nginx => nginx_command(peers, workers, port, &dir)?,
    };
    let url = start_router_command(
        &spec,
        port,
        &dir,
        startup_timeout,
        Some(probe_body(model)),
        procs,
    )
    .await?;
    let pid = procs.last().and_then(ChildProc::pid).ok_or_else(|| {
        ProcError::NotReady(format!("{} exited right after starting", kind.name()))
    })?;
    Ok(StartedRouter { url, pid, how, dir })
}

/// Ours: its config `yaml` plus `extra_yaml` (a `log:` line there replaces the default
/// one) in `dir`, and a policy's variant keys as a second, layered config file; the
/// command and how it was run.
fn ours_command(
    policy: &str,
    router_bin: &Path,
    mut yaml: String,
    extra_yaml: &str,
    dir: &ScratchDir,
) -> Result<(RouterCommand, String), ProcError> {
    procs::require_binary(
        router_bin,
        "cache-aware-router",
        "build it with `cargo build --release --workspace` or pass --router-bin",
    )?;
    let (_, variant) = policy_variant(policy).map_err(ProcError::NotReady)?;
    // A `log:` entry of `extra_yaml` replaces the default one.
    if extra_yaml.lines().any(|l| l.starts_with("log:")) {
        yaml = yaml.replace(DEFAULT_LOG_YAML, "");
    }
    yaml.push_str(extra_yaml);
    let config_path = dir.path().join("config.yaml");
    std::fs::write(&config_path, &yaml)
        .map_err(io_err(format!("write {}", config_path.display())))?;
    let mut args = vec!["-c".into(), config_path.display().to_string()];
    // The variant's keys as a second, layered config file (merged key by key).
    if !variant.is_empty() {
        let path = dir.path().join("variant.yaml");
        std::fs::write(&path, &variant).map_err(io_err(format!("write {}", path.display())))?;
        args.extend(["-c".into(), path.display().to_string()]);
        yaml.push_str("--- layered on it ---\n");
        yaml.push_str(&variant);
    }
    let spec = RouterCommand {
        name: RouterKind::Ours.name().into(),
        program: router_bin.to_path_buf(),
        args,
        env: Vec::new(),
        context: format!("--- its config ---\n{yaml}"),
        term_tree: false,
    };
    let how = format!(
        "`{} -c config.yaml` with config `{}`",
        router_bin.display(),
        yaml.trim_end()
            .replace("\n  - url: ", " ")
            .replace("\n    phase: ", " as ")
            .replace('\n', "; ")
    );
    Ok((spec, how))
}

/// nginx: [`nginx_config`] in `dir`, stopped with SIGTERM to its master and workers;
/// the command and how it was run.
fn nginx_command(
    peers: &PeerSetup,
    workers: &[String],
    port: u16,
    dir: &ScratchDir,
) -> Result<(RouterCommand, String), ProcError> {
    procs::require_binary(
        &peers.nginx_bin,
        "nginx",
        "install the Debian package (`apt-get install nginx`) or pass --nginx-bin",
    )?;
    let conf = nginx_config(port, workers, dir.path(), peers.nginx_access_log);
    let conf_path = dir.path().join("nginx.conf");
    std::fs::write(&conf_path, &conf).map_err(io_err(format!("write {}", conf_path.display())))?;
    let spec = RouterCommand {
        name: RouterKind::Nginx.name().into(),
        program: peers.nginx_bin.clone(),
        // `-e stderr`: the error log from the start, before the config is
        // read (else the compiled-in /var/log/nginx/error.log).
        args: vec![
            "-p".into(),
            dir.path().display().to_string(),
            "-e".into(),
            "stderr".into(),
            "-c".into(),
            conf_path.display().to_string(),
        ],
        env: Vec::new(),
        context: format!("--- its config ---\n{conf}"),
        term_tree: true,
    };
    let how = format!(
        "`{} -p DIR -e stderr -c DIR/nginx.conf` (master + workers), \
         nginx.conf: `{}`",
        peers.nginx_bin.display(),
        conf.lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.contains("_temp_path"))
            .collect::<Vec<_>>()
            .join(" ")
            .replace(&dir.path().display().to_string(), "DIR")
    );
    Ok((spec, how))
}

/// Splits one of our contenders' policy value, `POLICY[+SECTION.KEY=VALUE]...`
/// (`cache_aware+cache.learn_evictions=true`), into the policy and the YAML of its
/// variant keys (empty without any), which the router gets as a second `-c` file.
pub fn policy_variant(spec: &str) -> Result<(&str, String), String> {
    let mut parts = spec.split('+');
    let policy = parts.next().unwrap_or_default();
    let mut sections: Vec<(&str, Vec<(&str, &str)>)> = Vec::new();
    for part in parts {
        let bad = || format!("bad variant {part:?} in {spec:?}: use +SECTION.KEY=VALUE");
        let (path, value) = part.split_once('=').ok_or_else(bad)?;
        let (section, key) = path.split_once('.').ok_or_else(bad)?;
        if section.is_empty() || key.is_empty() || key.contains('.') || value.is_empty() {
            return Err(bad());
        }
        match sections.iter_mut().find(|(s, _)| *s == section) {
            Some((_, keys)) => keys.push((key, value)),
            None => sections.push((section, vec![(key, value)])),
        }
    }
    let mut yaml = String::new();
    for (section, keys) in sections {
        let _ = writeln!(yaml, "{section}:");
        for (key, value) in keys {
            let _ = writeln!(yaml, "  {key}: {value}");
        }
    }
    Ok((policy, yaml))
}

/// The router config the demo writes (keys per the design doc).
pub fn router_config(policy: &str, port: u16, workers: &[String]) -> String {
    router_config_phased(policy, port, workers, &[])
}

/// [`router_config`] with each worker's `phase` (`phases[i]` for worker `i`; none past
/// the end of `phases`).
pub fn router_config_phased(
    policy: &str,
    port: u16,
    workers: &[String],
    phases: &[&str],
) -> String {
    let mut y =
        format!("policy: {policy}\nserver: {{ host: 127.0.0.1, port: {port} }}\nworkers:\n");
    for (i, w) in workers.iter().enumerate() {
        let _ = writeln!(y, "  - url: {w}");
        if let Some(phase) = phases.get(i) {
            let _ = writeln!(y, "    phase: {phase}");
        }
    }
    y.push_str(DEFAULT_LOG_YAML);
    y
}

/// The `log:` line of [`router_config`]: no line per request.
const DEFAULT_LOG_YAML: &str = "log: { level: warn }\n";

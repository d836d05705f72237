//! The binary's command line: `--version`, `--config-check`, error messages naming file,
//! key and value, and layered `-c` files.

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use support::TempFile;

const BIN: &str = env!("CARGO_BIN_EXE_cache-aware-router");

fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .expect("run the binary")
}

fn config_check(files: &[&Path]) -> Output {
    let mut args = Vec::new();
    for f in files {
        args.push("-c".to_string());
        args.push(f.display().to_string());
    }
    args.push("--config-check".into());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run(&args)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

const VALID: &str = "workers:\n  - url: http://127.0.0.1:8001\n  - url: http://[::1]:8002/\n";

#[test]
fn version_flag_prints_the_package_version() {
    let o = run(&["--version"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("cache-aware-router") && out.contains(env!("CARGO_PKG_VERSION")),
        "{out}"
    );
}

#[test]
fn config_check_accepts_a_valid_file() {
    let f = TempFile::new("valid.yaml", VALID);
    let o = config_check(&[&f.path]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(o.status.code(), Some(0));
}

/// `--config-check` on a base file plus `over`: fails, and the message names the file
/// that holds the error, the key and (when given) the bad value.
fn assert_refused(over: &str, key: &str, value: Option<&str>) {
    let base = TempFile::new("base.yaml", VALID);
    let f = TempFile::new("over.yaml", over);
    let o = config_check(&[&base.path, &f.path]);
    let err = stderr(&o);
    assert!(!o.status.success(), "{over:?} should be refused");
    assert!(
        err.contains(&f.path.display().to_string()),
        "{over:?}: names the file: {err}"
    );
    assert!(err.contains(key), "{over:?}: names `{key}`: {err}");
    if let Some(v) = value {
        assert!(err.contains(v), "{over:?}: names the value `{v}`: {err}");
    }
}

#[test]
fn config_check_refuses_an_unknown_key() {
    assert_refused("cache:\n  treshold: 0.4\n", "treshold", None);
}

#[test]
fn config_check_refuses_a_threshold_above_one() {
    assert_refused("cache:\n  threshold: 1.5\n", "cache.threshold", Some("1.5"));
}

#[test]
fn config_check_refuses_max_load_zero() {
    assert_refused(
        "workers:\n  - url: http://127.0.0.1:8001\n    max_load: 0\n",
        "workers[0].max_load",
        Some("0"),
    );
}

#[test]
fn config_check_refuses_an_unbracketed_ipv6_worker_url() {
    assert_refused(
        "workers:\n  - url: \"http://::1:1\"\n",
        "workers[0].url",
        Some("http://::1:1"),
    );
}

#[test]
fn empty_worker_list_is_refused_with_a_message_saying_so() {
    let f = TempFile::new("empty-workers.yaml", "workers: []\n");
    for extra in [&["--config-check"][..], &[][..]] {
        let path = f.path.display().to_string();
        let mut args = vec!["-c", path.as_str()];
        args.extend_from_slice(extra);
        let o = run(&args);
        let err = stderr(&o);
        assert!(!o.status.success(), "{args:?} should fail");
        assert!(
            err.contains("worker list is empty") && err.contains(&path),
            "{args:?}: {err}"
        );
    }
}

/// A running binary, killed on drop.
struct Running {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts the binary with `files` (which log JSON lines) and waits for the line
/// announcing the listening address.
fn serve(files: &[&Path]) -> Running {
    let mut cmd = Command::new(BIN);
    for f in files {
        cmd.arg("-c").arg(f);
    }
    let child = cmd
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the binary");
    // Killed and reaped on drop, also when this function panics.
    let mut running = Running {
        child,
        addr: SocketAddr::from(([0, 0, 0, 0], 0)),
    };
    let (tx, rx) = mpsc::channel::<String>();
    let out: Box<dyn Read + Send> = Box::new(running.child.stdout.take().unwrap());
    let err: Box<dyn Read + Send> = Box::new(running.child.stderr.take().unwrap());
    for pipe in [out, err] {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
    }
    let mut seen = Vec::new();
    loop {
        let Ok(line) = rx.recv_timeout(Duration::from_secs(5)) else {
            panic!("no `listening` line from the binary; output: {seen:#?}")
        };
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line)
            && let Some(addr) = v["fields"]["addr"].as_str()
        {
            running.addr = addr.parse().expect("listening address");
            return running;
        }
        seen.push(line);
    }
}

/// `GET path` over a plain blocking socket, asserting 200; the body.
fn get_of(addr: SocketAddr, path: &str) -> String {
    let mut s = TcpStream::connect(addr).expect("connect to the binary");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read the response");
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").expect("a response");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    body.to_string()
}

/// `GET /workers` over a plain blocking socket.
fn workers_of(addr: SocketAddr) -> serde_json::Value {
    let body = get_of(addr, "/workers");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"))
}

const BASE: &str = "policy: round_robin\nserver:\n  host: 127.0.0.1\n  port: 6999\nlog:\n  format: json\nworkers:\n  - url: http://127.0.0.1:9/\n";

#[test]
fn second_config_file_overrides_scalars_and_keeps_sibling_keys() {
    let base = TempFile::new("base.yaml", BASE);
    let over = TempFile::new("over.yaml", "policy: least_load\nserver:\n  port: 0\n");
    let r = serve(&[&base.path, &over.path]);
    assert_eq!(
        r.addr.ip().to_string(),
        "127.0.0.1",
        "server.host kept from the first file"
    );
    assert_ne!(
        r.addr.port(),
        6999,
        "server.port overridden by the second file"
    );
    let w = workers_of(r.addr);
    assert_eq!(w["policy"], "least_load");
    assert_eq!(w["workers"][0]["url"], "http://127.0.0.1:9");
    assert_eq!(w["workers"].as_array().unwrap().len(), 1);
}

#[test]
fn empty_second_config_file_changes_nothing() {
    let base = TempFile::new("base.yaml", &BASE.replace("port: 6999", "port: 0"));
    let empty = TempFile::new("empty.yaml", "");
    let alone = config_check(&[&base.path]);
    let layered = config_check(&[&base.path, &empty.path]);
    assert!(layered.status.success(), "{}", stderr(&layered));
    assert_eq!(alone.stdout, layered.stdout);

    let r = serve(&[&base.path, &empty.path]);
    assert_eq!(r.addr.ip().to_string(), "127.0.0.1");
    let w = workers_of(r.addr);
    assert_eq!(w["policy"], "round_robin");
    assert_eq!(w["workers"][0]["url"], "http://127.0.0.1:9");
}

/// Sends SIGHUP to the running binary.
fn hang_up(r: &Running) {
    let ok = Command::new("kill")
        .args(["-HUP", &r.child.id().to_string()])
        .status()
        .expect("run kill")
        .success();
    assert!(ok, "kill -HUP failed");
}

/// Polls `cond` every 20 ms for up to 3 s.
fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let start = std::time::Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "not within 3 s: {what}"
        );
        std::thread::park_timeout(Duration::from_millis(20));
    }
}

#[test]
fn sighup_reloads_the_workers_and_counts_each_reload_in_metrics_by_result() {
    let base = BASE.replace("port: 6999", "port: 0");
    let f = TempFile::new("base.yaml", &base);
    let r = serve(&[&f.path]);
    // The binary installs its SIGHUP handler in a task started after the `listening`
    // line, and nothing shows when that is done; until then SIGHUP's default action
    // kills it. Serve a request, then leave it a moment before the first SIGHUP.
    assert_eq!(workers_of(r.addr)["workers"].as_array().unwrap().len(), 1);
    let settle = std::time::Instant::now();
    while settle.elapsed() < Duration::from_millis(300) {
        std::thread::park_timeout(Duration::from_millis(20));
    }
    let reloads = |result: &str| {
        let text = get_of(r.addr, "/metrics");
        support::Scrape::parse(&text)
            .value("cache_aware_router_reloads_total", &[("result", result)])
    };

    std::fs::write(&f.path, format!("{base}  - url: http://127.0.0.1:10/\n")).unwrap();
    hang_up(&r);
    eventually("the reload applied", || {
        workers_of(r.addr)["workers"].as_array().unwrap().len() == 2
    });
    let reload_lines: Vec<String> = get_of(r.addr, "/metrics")
        .lines()
        .filter(|l| l.contains("reloads"))
        .map(str::to_string)
        .collect();
    assert_eq!(
        reloads("applied"),
        1.0,
        "a SIGHUP reload that was applied is counted; /metrics has: {reload_lines:?}"
    );

    std::fs::write(&f.path, base.replace("round_robin", "least_load")).unwrap();
    hang_up(&r);
    eventually("the rejected reload counted", || reloads("rejected") == 1.0);
    std::fs::write(&f.path, "workers: [\n").unwrap();
    hang_up(&r);
    eventually("the invalid reload counted", || reloads("invalid") == 1.0);
    let w = workers_of(r.addr);
    assert_eq!(w["policy"], "round_robin");
    assert_eq!(w["workers"].as_array().unwrap().len(), 2);
    assert_eq!(reloads("applied"), 1.0);
}

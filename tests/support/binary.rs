//! The router as a user runs it: the built binary in its own process, its stdout and
//! stderr captured line by line, and its memory read from `/proc`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The router's binary: `Binary::at(env!("CARGO_BIN_EXE_cache-aware-router"))` in a
/// test of the router's package (only there does cargo say where it built it).
#[derive(Debug, Clone, Copy)]
pub struct Binary(&'static str);

impl Binary {
    pub const fn at(path: &'static str) -> Binary {
        Binary(path)
    }

    /// A command running it, `RUST_LOG` unset.
    pub fn command(&self) -> Command {
        let mut cmd = Command::new(self.0);
        cmd.env_remove("RUST_LOG");
        cmd
    }

    /// Runs it with `args` to completion.
    pub fn run(&self, args: &[&str]) -> Output {
        self.command().args(args).output().expect("run the binary")
    }

    /// `--config-check` with each of `files` as a `-c`.
    pub fn config_check(&self, files: &[&Path]) -> Output {
        let mut args = Vec::new();
        for f in files {
            args.push("-c".to_string());
            args.push(f.display().to_string());
        }
        args.push("--config-check".into());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.run(&args)
    }

    /// Starts it with `files` (which must set `log.format: json`) and waits for the line
    /// announcing the listening address.
    pub fn serve(&self, files: &[&Path]) -> Running {
        self.serve_with_env(files, &[])
    }

    /// As [`Binary::serve`], with these environment variables set for the binary.
    pub fn serve_with_env(&self, files: &[&Path], env: &[(&str, &str)]) -> Running {
        let mut cmd = self.command();
        for f in files {
            cmd.arg("-c").arg(f);
        }
        cmd.envs(env.iter().copied());
        let child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn the binary");
        Running::watch(child)
    }
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Which stream a line came on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// A running binary, killed on drop.
pub struct Running {
    pub child: Child,
    pub addr: SocketAddr,
    lines: Arc<Mutex<Vec<(Stream, String)>>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Running {
    /// Every line printed so far, with its stream.
    pub fn lines(&self) -> Vec<(Stream, String)> {
        self.lines.lock().unwrap().clone()
    }

    /// Everything printed so far on both streams, one line each.
    pub fn output(&self) -> String {
        self.lines().into_iter().map(|(_, l)| l + "\n").collect()
    }

    /// Sends SIGHUP (reload).
    pub fn hang_up(&self) {
        let ok = Command::new("kill")
            .args(["-HUP", &self.child.id().to_string()])
            .status()
            .expect("run kill")
            .success();
        assert!(ok, "kill -HUP failed");
    }

    /// Resident memory of the process now, in KiB (`VmRSS` of `/proc/<pid>/status`).
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .expect("read /proc/<pid>/status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS in /proc/<pid>/status")
    }
}

impl Running {
    /// Captures `child`'s output line by line and waits for the line announcing its
    /// listening address.
    fn watch(child: Child) -> Running {
        // Killed and reaped on drop, also when this function panics.
        let mut running = Running {
            child,
            addr: SocketAddr::from(([0, 0, 0, 0], 0)),
            lines: Arc::default(),
        };
        let out: Box<dyn Read + Send> = Box::new(running.child.stdout.take().unwrap());
        let err: Box<dyn Read + Send> = Box::new(running.child.stderr.take().unwrap());
        for (stream, pipe) in [(Stream::Stdout, out), (Stream::Stderr, err)] {
            let lines = Arc::clone(&running.lines);
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    lines.lock().unwrap().push((stream, line));
                }
            });
        }
        let started = Instant::now();
        loop {
            let addr = running.lines().iter().find_map(|(_, line)| {
                let v = serde_json::from_str::<serde_json::Value>(line).ok()?;
                v["fields"]["addr"].as_str()?.parse().ok()
            });
            if let Some(addr) = addr {
                running.addr = addr;
                return running;
            }
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "no `listening` line from the binary; output: {}",
                running.output()
            );
            std::thread::park_timeout(Duration::from_millis(10));
        }
    }
}

/// `GET path` over a plain blocking socket: (status line, body).
pub fn get_raw(addr: SocketAddr, path: &str) -> (String, String) {
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
    let status = head.lines().next().unwrap_or("").to_string();
    (status, body.to_string())
}

/// `GET path`, asserting 200; the body.
pub fn get_of(addr: SocketAddr, path: &str) -> String {
    let (status, body) = get_raw(addr, path);
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    body
}

/// `GET /workers`.
pub fn workers_of(addr: SocketAddr) -> serde_json::Value {
    let body = get_of(addr, "/workers");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"))
}

/// Polls `cond` every 20 ms for up to 3 s.
pub fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "not within 3 s: {what}"
        );
        std::thread::park_timeout(Duration::from_millis(20));
    }
}

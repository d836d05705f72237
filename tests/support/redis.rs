//! A real `redis-server` owned by one test: started on a free loopback port with no
//! persistence, killed and restarted on the same port on demand, killed on drop.
//!
//! Needs the `redis-server` binary (Debian: `apt-get install redis-server`; `.ci/run`
//! installs it; `REDIS_SERVER` names another path). Without it the test fails and says
//! so: it never passes without having talked to Redis.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct RedisServer {
    child: Option<Child>,
    pub port: u16,
    dir: PathBuf,
}

impl RedisServer {
    /// Starts a server on a free port and waits until it answers `PING`.
    pub fn start() -> RedisServer {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr").port()
        };
        let dir = std::env::temp_dir().join(format!("car-redis-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("redis dir");
        let mut r = RedisServer {
            child: None,
            port,
            dir,
        };
        r.restart();
        r
    }

    /// `redis://127.0.0.1:<port>/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Kills the server (SIGKILL) and waits until its port refuses connections.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// (Re)starts the server on the same port, empty, and waits until it answers.
    pub fn restart(&mut self) {
        self.kill();
        let bin = std::env::var("REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
        let child = Command::new(&bin)
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start `{bin}` ({e}): this test needs a real Redis server. Install it (Debian: apt-get install redis-server; .ci/run does) or set REDIS_SERVER to its path"
                )
            });
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if self
                .command(&["PING"])
                .is_some_and(|r| r.starts_with("+PONG"))
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!(
            "redis-server on port {} did not answer PING within 10 s",
            self.port
        );
    }

    /// Stops the server with SIGSTOP (its port still accepts connections, nothing
    /// answers: a frozen server) until the returned guard is dropped, which sends
    /// SIGCONT, on a test's failure too.
    pub fn freeze(&self) -> Frozen {
        let pid = self.child.as_ref().expect("redis-server is running").id();
        signal(pid, "-STOP");
        Frozen { pid, thawed: false }
    }

    /// Sends one command (RESP) and returns the raw reply; `None` when unreachable.
    pub fn command(&self, args: &[&str]) -> Option<String> {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        let mut req = format!("*{}\r\n", args.len());
        for a in args {
            req.push_str(&format!("${}\r\n{a}\r\n", a.len()));
        }
        s.write_all(req.as_bytes()).ok()?;
        let mut buf = vec![0u8; 1 << 16];
        let n = s.read(&mut buf).ok()?;
        Some(String::from_utf8_lossy(&buf[..n]).into_owned())
    }

    /// The keys matching `pattern` (`KEYS`; fine for a test's few keys).
    pub fn keys(&self, pattern: &str) -> Vec<String> {
        let reply = self.command(&["KEYS", pattern]).unwrap_or_default();
        // *N, then $len / key pairs.
        reply
            .split("\r\n")
            .skip(1)
            .collect::<Vec<_>>()
            .chunks(2)
            .filter_map(|c| c.get(1).filter(|k| !k.is_empty()).map(|k| k.to_string()))
            .collect()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A frozen server (see [`RedisServer::freeze`]); thawed on drop.
pub struct Frozen {
    pid: u32,
    thawed: bool,
}

impl Frozen {
    /// Sends SIGCONT now.
    pub fn thaw(mut self) {
        signal(self.pid, "-CONT");
        self.thawed = true;
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        if !self.thawed {
            signal(self.pid, "-CONT");
        }
    }
}

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok || std::thread::panicking(), "kill {sig} {pid} failed");
}

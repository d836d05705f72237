//! Fleet scale: what a large pool costs the request path. For 4 and 1,000 workers, a
//! `cache_aware` tree filled to its default cap (`cache.max_tree_size`, 1 M nodes) with
//! prompts spread over the workers:
//!
//! 1. decision latency (extract + pick + observe, µs) for 2 KiB and 32 KiB chat bodies,
//!    the tree held at its cap by an untimed eviction pass every 256 decisions (as the
//!    router's upkeep task holds it), its least recently used leaves earlier 32 KiB
//!    requests (`seam::history`);
//! 2. membership changes while a second thread decides in a loop: a worker removed and
//!    added back (`Pool::remove` / `Pool::add`, the admin API's and discovery's path,
//!    which drops its tree records), the time each change took and the longest decision
//!    that overlapped one, against the longest that did not;
//! 3. with 1,000 workers, `GET /workers` and `GET /metrics` answered by an in-process
//!    router (workers on closed loopback ports) and the bytes they return.
//!
//! Run: `cargo bench --bench pool_scale` (add `-- --nodes 200000` for a quicker run, or
//! `-- --workers 4` for one pool size).

use std::io::{Read, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use cache_aware_router::config::Config;
use cache_aware_router::policy::{self, Policy};
use cache_aware_router::pools::pool::{Pool, WorkerId};
use cache_aware_router::tree::SharedTree;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

mod common;
#[path = "common/seam.rs"]
mod seam;
use common::words;
use seam::{Upkeep, decide, history, percentile, report, requests};

fn config(workers: usize, nodes: usize) -> Config {
    let yaml = format!(
        "policy: cache_aware\ncache:\n  max_tree_size: {nodes}\n  eviction_interval_secs: 0\n\
         health:\n  interval_secs: 3600\nworkers:\n{}",
        (0..workers)
            .map(|w| format!("  - http://127.0.{}.{}:9\n", 1 + w / 250, 1 + w % 250))
            .collect::<String>()
    );
    Config::from_sources([(std::path::Path::new("bench.yaml"), yaml.as_str())]).expect("config")
}

struct Fixture {
    cfg: Config,
    pool: Arc<Pool>,
    policy: Arc<dyn Policy>,
    tree: Arc<SharedTree>,
    systems: Vec<String>,
}

/// Decisions per run (one run per prompt size).
const DECISIONS: usize = 2000;
/// Earlier requests in the tree (`seam::history`): what the runs' passes evict.
const EARLIER: usize = 2 * DECISIONS + Upkeep::SLACK;

/// A pool of `workers` and a tree of `nodes` nodes: 200 shared 2 KiB system prompts,
/// [`EARLIER`] earlier 32 KiB requests (the least recently used leaves), then
/// conversations branching off them, each on some worker.
fn fixture(workers: usize, nodes: usize, rng: &mut StdRng) -> Fixture {
    let cfg = config(workers, nodes);
    let pool = Arc::new(Pool::new(&cfg.workers, &cfg.circuit_breaker));
    let policy::Routing { policy, tree, .. } = policy::build(&cfg, &pool);
    let shared = tree.expect("cache_aware keeps a tree");
    let systems: Vec<String> = (0..200).map(|_| words(rng, 2048)).collect();
    let t = Instant::now();
    let mut tree = shared.lock();
    // Held at its cap: first the earlier 32 KiB requests the runs' passes evict.
    history(
        &mut tree,
        &systems,
        EARLIER,
        32 * 1024,
        workers as u32,
        cfg.cache.max_prompt_bytes,
        rng,
    );
    let mut i = 0u64;
    while tree.node_count() < nodes {
        let sys = &systems[rng.random_range(0..systems.len())];
        let text = format!("system: {sys}\nuser: conversation {i}{}", words(rng, 120));
        tree.insert(text.as_bytes(), WorkerId((i % workers as u64) as u32));
        i += 1;
    }
    println!(
        "\n== {workers} workers: tree of {} nodes from {EARLIER} earlier 32 KiB requests and \
         {i} conversations in {:.1} s",
        tree.node_count(),
        t.elapsed().as_secs_f64()
    );
    drop(tree);
    Fixture {
        cfg,
        pool,
        policy,
        tree: shared,
        systems,
    }
}

/// Chat bodies of `bytes` (about): half repeat an earlier one.
fn bodies(f: &Fixture, n: usize, bytes: usize, rng: &mut StdRng) -> Vec<Vec<u8>> {
    requests(&f.systems, n, bytes.saturating_sub(2048), rng)
}

fn decisions(f: &Fixture, upkeep: &Upkeep, bodies: &[Vec<u8>], label: &str) {
    let mut rng = StdRng::seed_from_u64(7);
    let set = f.pool.set();
    let tree = &f.tree;
    let mut total = Vec::with_capacity(bodies.len());
    let mut hits = 0;
    for (n, b) in bodies.iter().enumerate() {
        if n % Upkeep::EVERY == 0 {
            upkeep.pass(tree);
        }
        let d = decide(&*f.policy, &set, b, f.cfg.cache.max_prompt_bytes, &mut rng);
        total.push(d.extract + d.pick);
        hits += usize::from(d.hit);
    }
    report(label, &mut total);
    // What the timed decisions exercised: prefix matches, on a tree of this size.
    println!(
        "{:<34} {hits} of {} were prefix hits; tree held near {} nodes",
        "",
        bodies.len(),
        upkeep.target()
    );
}

/// Removes and re-adds one worker `rounds` times while another thread decides.
fn membership(f: &Fixture, bodies: &[Vec<u8>], rounds: usize) {
    let stop = AtomicBool::new(false);
    let mut ops: Vec<(Instant, Instant, &'static str)> = Vec::new();
    let mut seen: Vec<(Instant, Duration)> = Vec::new();
    std::thread::scope(|s| {
        let decider = s.spawn(|| {
            let mut rng = StdRng::seed_from_u64(9);
            let mut seen = Vec::new();
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                let set = f.pool.set();
                let t = Instant::now();
                let d = decide(
                    &*f.policy,
                    &set,
                    &bodies[i % bodies.len()],
                    f.cfg.cache.max_prompt_bytes,
                    &mut rng,
                );
                seen.push((t, d.extract + d.pick));
                i += 1;
            }
            seen
        });
        for r in 0..rounds {
            std::thread::sleep(Duration::from_millis(30));
            let cfg = f.cfg.workers[(r * 7 + 1) % f.cfg.workers.len()].clone();
            let t = Instant::now();
            assert!(f.pool.remove(cfg.key()), "the worker is in the pool");
            ops.push((t, Instant::now(), "remove"));
            std::thread::sleep(Duration::from_millis(30));
            let t = Instant::now();
            f.pool.add(cfg).expect("added back");
            ops.push((t, Instant::now(), "add"));
        }
        std::thread::sleep(Duration::from_millis(30));
        stop.store(true, Ordering::Relaxed);
        seen = decider.join().expect("decider");
    });
    for kind in ["remove", "add"] {
        let mut took: Vec<Duration> = ops
            .iter()
            .filter(|o| o.2 == kind)
            .map(|o| o.1 - o.0)
            .collect();
        report(&format!("Pool::{kind} (one worker)"), &mut took);
    }
    let overlaps = |t: Instant, d: Duration| ops.iter().any(|o| t < o.1 && t + d > o.0);
    let (mut during, mut other): (Vec<Duration>, Vec<Duration>) = (Vec::new(), Vec::new());
    for &(t, d) in &seen {
        if overlaps(t, d) {
            during.push(d)
        } else {
            other.push(d)
        }
    }
    // The slowest decisions of each group: a membership change's steps should not show
    // in them beyond the machine's own noise (the decisions that overlap none).
    let tail = |v: &mut Vec<Duration>| {
        v.sort();
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        let over_1ms = v.iter().filter(|d| **d > Duration::from_millis(1)).count();
        match v.last() {
            Some(&max) => format!(
                "{} decisions: p99.9 {:.1} µs, longest {:.1} µs, {over_1ms} over 1 ms",
                v.len(),
                percentile(v, 0.999),
                us(max)
            ),
            None => "no decisions".to_string(),
        }
    };
    println!("overlapping a change: {}", tail(&mut during));
    println!("overlapping none:     {}", tail(&mut other));
}

/// `GET path` on `addr`, read to the end: (time, bytes).
fn get(addr: std::net::SocketAddr, path: &str) -> (Duration, usize) {
    let t = Instant::now();
    let mut c = std::net::TcpStream::connect(addr).expect("connect");
    write!(
        c,
        "GET {path} HTTP/1.1\r\nhost: bench\r\nconnection: close\r\n\r\n"
    )
    .expect("send");
    let mut out = Vec::new();
    c.read_to_end(&mut out).expect("read");
    assert!(
        out.starts_with(b"HTTP/1.1 200"),
        "{path}: {:?}",
        &out[..out.len().min(80)]
    );
    (t.elapsed(), out.len())
}

fn endpoints(cfg: Config) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let router = rt.block_on(async {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        cache_aware_router::app::spawn(cfg, l).expect("router")
    });
    let addr = router.addr;
    for path in ["/workers", "/metrics"] {
        let mut took = Vec::new();
        let mut bytes = 0;
        for _ in 0..20 {
            let (t, n) = get(addr, path);
            took.push(t);
            bytes = n;
        }
        took.sort();
        println!(
            "GET {path:<9} {bytes:>8} bytes  p50={:>6.1} ms  max={:>6.1} ms",
            percentile(&took, 0.5) / 1e3,
            percentile(&took, 1.0) / 1e3
        );
    }
    rt.block_on(router.shutdown());
}

fn main() {
    let mut nodes = 1_000_000usize;
    let mut pools = vec![4, 1000];
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--nodes" => nodes = args.next().and_then(|v| v.parse().ok()).unwrap_or(nodes),
            "--workers" => {
                if let Some(w) = args.next().and_then(|v| v.parse().ok()) {
                    pools = vec![w];
                }
            }
            _ => {}
        }
    }
    let mut rng = StdRng::seed_from_u64(42);
    let upkeep = Upkeep::new(nodes);
    for workers in pools {
        let f = fixture(workers, nodes, &mut rng);
        for kib in [2, 32] {
            let b = bodies(&f, DECISIONS, kib << 10, &mut rng);
            decisions(&f, &upkeep, &b, &format!("decision, {kib} KiB chat"));
        }
        let b = bodies(&f, 500, 2 << 10, &mut rng);
        membership(&f, &b, 10);
        if workers == 1000 {
            endpoints(f.cfg.clone());
        }
    }
}

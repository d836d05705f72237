//! Decision latency through the policy seam: extract + `Policy::pick` +
//! `Policy::observe(Served)` (for `cache_aware`: prefix match + insert) for 32 KiB chat
//! prompts, `cache_aware` against a tree of ~1M nodes, then every other policy. Reports
//! p50/p99/max per decision in µs (a bench binary rather than criterion because the
//! target is a tail percentile, which criterion does not report).
//!
//! `cache_aware` runs three times, interleaved request by request (the order rotating):
//! sharing off, and twice with sharing on (`state.redis_url`), each over a copy of the
//! same tree and a [`Fleet`] index holding what a second replica published: "every
//! prompt" (it served the tree fill's prompts and every distinct request of the run, so
//! each remote lookup walks the whole 32 KiB: 256 chunks) and "fill only" (it served
//! the tree fill's prompts, so lookups stop after the shared 2 KiB system prompt). The
//! Redis URL names a closed port and is never connected (the decision path reads only
//! the in-process index and queues a record for the publisher, not running here). A
//! last pass times the remote lookup alone (`Fleet::longest_prefix`, on the chunk
//! hashes extraction computed) and, beside it, what those hashes cost (inside extract).
//!
//! The trees are held at their size after the fill, as a router's upkeep task holds its
//! tree at `cache.max_tree_size` (an untimed eviction pass before the run and every 256
//! decisions). Their least recently used leaves are earlier 32 KiB requests (inserted
//! before the fill; `seam::history`), so a pass evicts leaves as large as the run's
//! new ones and each new 30 KiB leaf reuses memory an evicted one freed: the steady
//! state of a tree at its cap under this traffic. With `--growing` there are no
//! earlier requests and no passes: the trees grow in bytes, and each new leaf's pages
//! fault in (a tree still filling).
//!
//! Run: `cargo bench --bench decision` (add `-- --nodes 200000` for a quicker run).

use std::sync::Arc;
use std::time::{Duration, Instant};

use cache_aware_router::config::Config;
use cache_aware_router::fleet::wire::{Batch, Record};
use cache_aware_router::fleet::{Fleet, chain};
use cache_aware_router::policy::{self, Policy};
use cache_aware_router::pools::pool::{Pool, WorkerId, WorkerSet};
use cache_aware_router::prompt::{Endpoint, extract};
use cache_aware_router::tree::{ChainMemo, RemotePrefixes, SharedTree, WorkerMask};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

mod common;
#[path = "common/seam.rs"]
mod seam;
use common::{chat_body, words};
use seam::{Upkeep, decide, history, report};

/// One policy measured through the seam.
struct Lane {
    name: &'static str,
    set: Arc<WorkerSet>,
    policy: Arc<dyn Policy>,
    /// Its tree, when the policy keeps one (held at its cap by `Upkeep`).
    tree: Option<Arc<SharedTree>>,
    rng: StdRng,
    extract_t: Vec<Duration>,
    pick_t: Vec<Duration>,
    total_t: Vec<Duration>,
    hits: usize,
    /// Minor page faults taken inside timed decisions (first touches of new memory).
    faults: u64,
    /// Decisions that took no page fault (what the code costs apart from the kernel
    /// handing it fresh pages).
    clean_t: Vec<Duration>,
    /// Decisions by kind: a cache hit (the held prompt's whole leaf compared), or not (a
    /// new ~30 KiB leaf allocated and copied in).
    hit_t: Vec<Duration>,
    miss_t: Vec<Duration>,
}

impl Lane {
    fn new(name: &'static str, set: Arc<WorkerSet>, routing: policy::Routing) -> Self {
        Lane {
            name,
            set,
            policy: routing.policy,
            tree: routing.tree,
            rng: StdRng::seed_from_u64(7),
            extract_t: Vec::new(),
            pick_t: Vec::new(),
            total_t: Vec::new(),
            hits: 0,
            faults: 0,
            clean_t: Vec::new(),
            hit_t: Vec::new(),
            miss_t: Vec::new(),
        }
    }

    /// One decision, as the proxy makes it: extract, pick, observe(Served).
    fn decide(&mut self, body: &[u8], max_prompt_bytes: usize) {
        let f0 = minor_faults();
        let d = decide(
            &*self.policy,
            &self.set,
            body,
            max_prompt_bytes,
            &mut self.rng,
        );
        let faults = minor_faults() - f0;
        self.faults += faults;
        if faults == 0 {
            self.clean_t.push(d.extract + d.pick);
        }
        if d.hit {
            self.hits += 1;
            self.hit_t.push(d.extract + d.pick);
        } else {
            self.miss_t.push(d.extract + d.pick);
        }
        self.extract_t.push(d.extract);
        self.pick_t.push(d.pick);
        self.total_t.push(d.extract + d.pick);
    }
}

/// `cache_aware` with sharing on: its own pool and policy, its tree shared with a
/// fleet whose index is filled with another replica's prefix records, batched as the
/// publisher batches them.
struct Sharing {
    /// Its lane's name.
    name: &'static str,
    pool: Arc<Pool>,
    policy: Arc<dyn Policy>,
    tree: Arc<SharedTree>,
    fleet: Arc<Fleet>,
    keys: Vec<u64>,
    batch: Batch,
    took: Duration,
}

impl Sharing {
    /// Its policy and tree, for a lane.
    fn routing(&self) -> policy::Routing {
        policy::Routing {
            policy: Arc::clone(&self.policy),
            fleet: Some(Arc::clone(&self.fleet)),
            tree: Some(Arc::clone(&self.tree)),
        }
    }

    /// Another replica's id: never this process's own (random) one in practice.
    const FROM: u64 = 0x5eed_f1ee_7000_0001;

    fn new(cfg: &Config, name: &'static str) -> Self {
        let pool = Arc::new(Pool::new(&cfg.workers, &cfg.circuit_breaker));
        let policy::Routing {
            policy,
            fleet,
            tree,
        } = policy::build(cfg, &pool);
        let fleet = fleet.expect("fleet: state.redis_url is set");
        let tree = tree.expect("cache_aware keeps a tree");
        let keys = pool.set().workers().iter().map(|w| w.key_hash()).collect();
        Sharing {
            name,
            pool,
            policy,
            tree,
            fleet,
            keys,
            batch: Batch::new(Self::FROM),
            took: Duration::ZERO,
        }
    }

    fn add(&mut self, text: &[u8], worker: usize) {
        let t = Instant::now();
        self.batch.push(&Record::Prefix {
            worker: self.keys[worker % self.keys.len()],
            chain: chain(text).collect(),
        });
        if self.batch.records() >= 256 {
            self.flush();
        }
        self.took += t.elapsed();
    }

    fn flush(&mut self) {
        let full = std::mem::replace(&mut self.batch, Batch::new(Self::FROM));
        if !full.is_empty() {
            self.fleet.apply_message(&full.into_bytes());
        }
    }

    /// Flushes, copies `tree` in and says what the index holds.
    fn ready(&mut self, tree: &cache_aware_router::tree::RadixTree) {
        self.flush();
        *self.tree.lock() = tree.clone();
        println!(
            "fleet index ({}): {} chunk hashes from another replica (cap {}), applied in {:.1} s",
            self.name,
            self.fleet.remote_records(),
            cache_aware_router::fleet::MAX_RECORDS,
            self.took.as_secs_f64()
        );
    }
}

fn main() {
    let mut nodes_target = 1_000_000usize;
    let mut decisions = 4000usize;
    let mut publisher = true;
    let mut growing = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--nodes" => {
                nodes_target = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(nodes_target)
            }
            "--decisions" => {
                decisions = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(decisions)
            }
            // The fleets' publisher and subscriber not started (the request path alone).
            "--no-publisher" => publisher = false,
            // The tree grows without bound (no eviction): every new prompt's leaf lands
            // in memory never touched before, as while a router's tree first fills.
            "--growing" => growing = true,
            _ => {} // cargo bench passes --bench
        }
    }
    let mut rng = StdRng::seed_from_u64(42);
    let workers = 4u32;
    let config_with = |policy: &str, extra: &str| {
        let yaml = format!(
            "policy: {policy}\n{extra}cache:\n  max_tree_size: 4000000000\n  eviction_interval_secs: 0\nworkers:\n{}",
            (0..workers)
                .map(|w| format!("  - url: http://10.0.0.{w}:8000\n"))
                .collect::<String>()
        );
        Config::from_sources([(std::path::Path::new("bench.yaml"), yaml.as_str())]).expect("config")
    };
    let config = |policy: &str| config_with(policy, "");

    // 1. Fill cache_aware's tree: 200 shared system prompts (2 KiB), conversations
    //    branching off them, each insert adding a split and a leaf.
    let cfg = config("cache_aware");
    let pool = Arc::new(Pool::new(&cfg.workers, &cfg.circuit_breaker));
    let cache_aware = policy::build(&cfg, &pool);
    let ca_tree = Arc::clone(cache_aware.tree.as_ref().expect("cache_aware keeps a tree"));
    // Sharing on: the other replica served every prompt, or only the fill's.
    let fleet_cfg = config_with(
        "cache_aware",
        "state: { redis_url: \"redis://127.0.0.1:1/\", namespace: bench }\n",
    );
    let mut every = Sharing::new(&fleet_cfg, "cache_aware, sharing on, every prompt");
    let mut fill_only = Sharing::new(&fleet_cfg, "cache_aware, sharing on, fill only");
    let systems: Vec<String> = (0..200).map(|_| words(&mut rng, 2048)).collect();
    let fill = Instant::now();
    let mut i = 0u64;
    // Held at its cap: first the earlier 32 KiB requests the run's passes evict (see
    // `seam::history`; in this tree only, not in the fleets' indexes).
    let earlier = if growing {
        0
    } else {
        decisions + Upkeep::SLACK
    };
    {
        let mut tree = ca_tree.lock();
        history(
            &mut tree,
            &systems,
            earlier,
            32 * 1024,
            workers,
            cfg.cache.max_prompt_bytes,
            &mut rng,
        );
        while tree.node_count() < nodes_target {
            let sys = &systems[rng.random_range(0..systems.len())];
            let text = format!(
                "system: {sys}\nuser: conversation {i}{}",
                words(&mut rng, 120)
            );
            tree.insert(text.as_bytes(), WorkerId((i % workers as u64) as u32));
            for s in [&mut every, &mut fill_only] {
                s.add(text.as_bytes(), (i % workers as u64) as usize);
            }
            i += 1;
        }
        println!(
            "tree: {} nodes, {:.1} MiB of edges, from {} earlier 32 KiB requests and {} \
             conversations in {:.1} s",
            tree.node_count(),
            tree.total_bytes() as f64 / (1 << 20) as f64,
            earlier,
            i,
            (fill.elapsed() - every.took - fill_only.took).as_secs_f64()
        );
    }

    // 2. Requests: 32 KiB prompts; half repeat an earlier request (hits), half are new.
    let mut bodies: Vec<Vec<u8>> = Vec::with_capacity(decisions);
    for n in 0..decisions {
        if n > 0 && rng.random_bool(0.5) {
            let j = rng.random_range(0..n);
            bodies.push(bodies[j].clone());
        } else {
            let sys = &systems[rng.random_range(0..systems.len())];
            bodies.push(chat_body(sys, &words(&mut rng, 30 * 1024)));
        }
    }

    // "every prompt": the other replica also served every distinct request (each on
    // some worker).
    let mut seen = std::collections::HashSet::new();
    for (n, body) in bodies.iter().enumerate() {
        if seen.insert(body.as_slice()) {
            let ctx = extract(Endpoint::ChatCompletions, body, cfg.cache.max_prompt_bytes);
            every.add(&ctx.text, n);
        }
    }
    {
        let tree = ca_tree.lock();
        every.ready(&tree);
        fill_only.ready(&tree);
    }
    // The fleets' publisher and subscriber run as in the router, on a thread of their own
    // (the publisher hashes what the request path queued; its Redis is a closed port).
    let (stop, shutdown) = cache_aware_router::shutdown::channel();
    let fleets = [Arc::clone(&every.fleet), Arc::clone(&fill_only.fleet)];
    let background = std::thread::spawn(move || {
        if !publisher {
            return;
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let tasks: Vec<_> = fleets
                .into_iter()
                .map(|f| tokio::spawn(f.run(shutdown.clone())))
                .collect();
            for t in tasks {
                let _ = t.await;
            }
        });
    });

    // cost_aware walks the same tree (a copy: its own).
    let cost_cfg = config("cost_aware");
    let cost_pool = Arc::new(Pool::new(&cost_cfg.workers, &cost_cfg.circuit_breaker));
    let cost_aware = policy::build(&cost_cfg, &cost_pool);
    *cost_aware
        .tree
        .as_ref()
        .expect("cost_aware keeps a tree")
        .lock() = ca_tree.lock().clone();

    // 3. Every policy through the seam, as the proxy calls it; cache_aware with sharing
    //    off and on interleaved, request by request, the order alternating.
    let max_prompt_bytes = cfg.cache.max_prompt_bytes;
    let mut cases: Vec<Vec<Lane>> = vec![
        vec![
            Lane::new("cache_aware", pool.set(), cache_aware),
            Lane::new(every.name, every.pool.set(), every.routing()),
            Lane::new(fill_only.name, fill_only.pool.set(), fill_only.routing()),
        ],
        vec![Lane::new("cost_aware", cost_pool.set(), cost_aware)],
    ];
    for name in [
        "round_robin",
        "random",
        "least_load",
        "power_of_two",
        "consistent_hash",
    ] {
        let cfg = config(name);
        let p = Arc::new(Pool::new(&cfg.workers, &cfg.circuit_breaker));
        cases.push(vec![Lane::new(name, p.set(), policy::build(&cfg, &p))]);
    }
    // At the cap (the default): each tree is held near its size after the fill (see
    // `Upkeep`); `--growing` lets it grow.
    let upkeep = Upkeep::new(nodes_target);
    let evict = |lanes: &[Lane]| {
        if growing {
            return;
        }
        for lane in lanes {
            if let Some(tree) = &lane.tree {
                upkeep.pass(tree);
            }
        }
    };
    println!(
        "\ntree upkeep: {}",
        if growing {
            "none, the trees grow (--growing)".to_string()
        } else {
            format!(
                "an eviction pass to {} nodes before the run and every {} decisions \
                 (untimed)",
                upkeep.target(),
                Upkeep::EVERY
            )
        }
    );
    let mut totals = Vec::new();
    let mut paired = Vec::new();
    for lanes in &mut cases {
        for (n, body) in bodies.iter().enumerate() {
            if n % Upkeep::EVERY == 0 {
                evict(lanes);
            }
            let k = lanes.len();
            for j in 0..k {
                lanes[(n + j) % k].decide(body, max_prompt_bytes);
            }
        }
        // Same request, adjacent in time: the per-request difference against the first
        // lane (sharing off) is robust where a lane's p50 is not (half the requests
        // insert a new 30 KiB leaf and half do not, so the p50 sits between two modes).
        for lane in &lanes[1..] {
            let mut d: Vec<f64> = lane
                .total_t
                .iter()
                .zip(&lanes[0].total_t)
                .map(|(on, off)| (on.as_secs_f64() - off.as_secs_f64()) * 1e6)
                .collect();
            d.sort_by(f64::total_cmp);
            let mean = |t: &[Duration]| {
                t.iter().map(Duration::as_secs_f64).sum::<f64>() * 1e6 / t.len() as f64
            };
            paired.push(format!(
                "{} vs off, per request: median difference {:+.1} µs; mean decision {:.1} vs \
                 {:.1} µs ({:+.1} %)",
                lane.name,
                d[d.len() / 2],
                mean(&lane.total_t),
                mean(&lanes[0].total_t),
                100.0 * (mean(&lane.total_t) / mean(&lanes[0].total_t) - 1.0),
            ));
        }
        for lane in lanes.iter_mut() {
            println!(
                "\n{}: {} decisions on {} KiB chat bodies ({} cache hits, {:.2} minor page \
                 faults per decision)",
                lane.name,
                decisions,
                bodies[0].len() / 1024,
                lane.hits,
                lane.faults as f64 / decisions as f64,
            );
            if lane.name == "cache_aware" {
                report("extract (JSON -> routing text)", &mut lane.extract_t);
            }
            let pick = report("pick + observe", &mut lane.pick_t);
            let total = report("decision (extract + pick + observe)", &mut lane.total_t);
            if lane.faults > 0 && !lane.clean_t.is_empty() {
                report("  decisions that took no fault", &mut lane.clean_t);
            }
            if !lane.hit_t.is_empty() && !lane.miss_t.is_empty() {
                report("  cache hits", &mut lane.hit_t);
                report("  the others (a new leaf)", &mut lane.miss_t);
            }
            totals.push((lane.name, pick, total));
        }
    }
    let find = |name: &str| totals.iter().find(|t| t.0 == name).copied();
    // "p50 ON vs OFF µs (+x %), p99 ON vs OFF µs (+y %)"
    let vs = |on: (f64, f64), off: (f64, f64)| {
        let pct = |a: f64, b: f64| 100.0 * (b - a) / a;
        format!(
            "p50 {:.1} vs {:.1} µs ({:+.1} %), p99 {:.1} vs {:.1} µs ({:+.1} %)",
            on.0,
            off.0,
            pct(off.0, on.0),
            on.1,
            off.1,
            pct(off.1, on.1)
        )
    };
    if let Some(off) = find("cache_aware") {
        println!();
        for line in &paired {
            println!("{line}");
        }
        for s in [&every, &fill_only] {
            let Some(on) = find(s.name) else { continue };
            println!(
                "{} vs off (same run, interleaved): pick + observe {}; decision {}; records \
                 dropped (publisher queue full): {}",
                s.name,
                vs(on.1, off.1),
                vs(on.2, off.2),
                s.fleet
                    .counts
                    .dropped
                    .load(std::sync::atomic::Ordering::Relaxed),
            );
        }
    }

    stop.shutdown();
    let _ = background.join();

    // 4. The remote lookup alone, on the same bodies (a pass of its own).
    let all: WorkerMask = every.pool.set().workers().iter().map(|w| w.id()).collect();
    for s in [&every, &fill_only] {
        let mut hash_t = Vec::with_capacity(decisions);
        let mut walk_t = Vec::with_capacity(decisions);
        let mut matched = 0usize;
        for body in &bodies {
            let ctx = extract(Endpoint::ChatCompletions, body, max_prompt_bytes);
            // The hashes come with extraction (its digest pass); timed here alone.
            let memo = ChainMemo::from(ctx.chain.clone());
            let t0 = Instant::now();
            std::hint::black_box(chain(&ctx.text).last());
            let t1 = Instant::now();
            let m = s.fleet.longest_prefix(&ctx.text, &all, &memo, 0);
            let t2 = Instant::now();
            matched += m.matched;
            hash_t.push(t1 - t0);
            walk_t.push(t2 - t1);
        }
        println!(
            "\nremote lookup alone ({}; mean match {:.1} KiB):",
            s.name,
            matched as f64 / bodies.len() as f64 / 1024.0
        );
        report("chunk hashes (inside extract)", &mut hash_t);
        report("Fleet::longest_prefix", &mut walk_t);
    }
}

/// This thread's minor page faults so far (`/proc/thread-self/stat`, field 10); 0 where
/// there is no such file.
pub fn minor_faults() -> u64 {
    std::fs::read_to_string("/proc/thread-self/stat")
        .ok()
        .and_then(|s| {
            let rest = &s[s.rfind(')')? + 2..];
            rest.split(' ').nth(7)?.parse().ok()
        })
        .unwrap_or(0)
}

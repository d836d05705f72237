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
use common::words;
use seam::{Upkeep, decide, history, report, requests};

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

impl Lane {
    /// Prints the lane's decisions (`decisions` on bodies of `body_len` bytes) and
    /// percentiles; its name, pick + observe and decision (p50, p99).
    fn report(&mut self, decisions: usize, body_len: usize) -> Totals {
        println!(
            "\n{}: {} decisions on {} KiB chat bodies ({} cache hits, {:.2} minor page \
             faults per decision)",
            self.name,
            decisions,
            body_len / 1024,
            self.hits,
            self.faults as f64 / decisions as f64,
        );
        if self.name == "cache_aware" {
            report("extract (JSON -> routing text)", &mut self.extract_t);
        }
        let pick = report("pick + observe", &mut self.pick_t);
        let total = report("decision (extract + pick + observe)", &mut self.total_t);
        if self.faults > 0 && !self.clean_t.is_empty() {
            report("  decisions that took no fault", &mut self.clean_t);
        }
        if !self.hit_t.is_empty() && !self.miss_t.is_empty() {
            report("  cache hits", &mut self.hit_t);
            // The new-turn case: every real request adds its new turn to the tree.
            report(
                "  decisions with their insert (a new ~30 KiB leaf; target p99 < 20 µs)",
                &mut self.miss_t,
            );
        }
        (self.name, pick, total)
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

/// The command line (`cargo bench --bench decision -- ...`).
struct Args {
    /// `--nodes N`: the tree's size after the fill.
    nodes_target: usize,
    /// `--decisions N`: requests timed per lane.
    decisions: usize,
    /// The fleets' publisher and subscriber run (`--no-publisher`: the request path
    /// alone).
    publisher: bool,
    /// `--growing`: the tree grows without bound (no eviction): every new prompt's leaf
    /// lands in memory never touched before, as while a router's tree first fills.
    growing: bool,
}

impl Args {
    fn parse() -> Self {
        let mut a = Args {
            nodes_target: 1_000_000,
            decisions: 4000,
            publisher: true,
            growing: false,
        };
        let mut args = std::env::args().skip(1);
        while let Some(arg) = args.next() {
            match arg.as_str() {
                "--nodes" => {
                    a.nodes_target = args
                        .next()
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(a.nodes_target)
                }
                "--decisions" => {
                    a.decisions = args
                        .next()
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(a.decisions)
                }
                "--no-publisher" => a.publisher = false,
                "--growing" => a.growing = true,
                _ => {} // cargo bench passes --bench
            }
        }
        a
    }
}

/// Workers of every config.
const WORKERS: u32 = 4;

/// A config of [`WORKERS`] workers with `policy` and `extra` YAML; its tree never
/// evicts on its own (the bench holds it at its size, see `Upkeep`).
fn config_with(policy: &str, extra: &str) -> Config {
    let yaml = format!(
        "policy: {policy}\n{extra}cache:\n  max_tree_size: 4000000000\n  eviction_interval_secs: 0\nworkers:\n{}",
        (0..WORKERS)
            .map(|w| format!("  - url: http://10.0.0.{w}:8000\n"))
            .collect::<String>()
    );
    Config::from_sources([(std::path::Path::new("bench.yaml"), yaml.as_str())]).expect("config")
}

fn config(policy: &str) -> Config {
    config_with(policy, "")
}

fn main() {
    let args = Args::parse();
    let mut rng = StdRng::seed_from_u64(42);

    // 1. Fill cache_aware's tree: 200 shared system prompts (2 KiB), conversations
    //    branching off them, each insert adding a split and a leaf.
    let cfg = config("cache_aware");
    let max_prompt_bytes = cfg.cache.max_prompt_bytes;
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
    fill(
        &ca_tree,
        &systems,
        &args,
        max_prompt_bytes,
        [&mut every, &mut fill_only],
        &mut rng,
    );

    // 2. Requests: 32 KiB prompts; half repeat an earlier request (hits), half are new.
    let bodies = requests(&systems, args.decisions, 30 * 1024, &mut rng);
    // "every prompt": the other replica also served every distinct request (each on
    // some worker).
    let mut seen = std::collections::HashSet::new();
    for (n, body) in bodies.iter().enumerate() {
        if seen.insert(body.as_slice()) {
            let ctx = extract(Endpoint::ChatCompletions, body, max_prompt_bytes);
            every.add(&ctx.text, n);
        }
    }
    {
        let tree = ca_tree.lock();
        every.ready(&tree);
        fill_only.ready(&tree);
    }
    let (stop, background) = start_fleets(args.publisher, [&every, &fill_only]);

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
    let (totals, paired) = time_cases(&mut cases, &bodies, &args, max_prompt_bytes);
    sharing_against_off(&totals, &paired, [&every, &fill_only]);

    stop.shutdown();
    let _ = background.join();

    // 4. The remote lookup alone, on the same bodies (a pass of its own).
    remote_lookup([&every, &fill_only], &bodies, max_prompt_bytes);
}

/// Fills `tree` to `args.nodes_target` nodes: first the earlier 32 KiB requests the
/// run's passes evict (unless `--growing`; see `seam::history`; in this tree only, not
/// in the fleets' indexes), then conversations off the `systems` prompts, each also
/// added to the `fleets`' indexes as another replica's.
fn fill(
    tree: &SharedTree,
    systems: &[String],
    args: &Args,
    max_prompt_bytes: usize,
    fleets: [&mut Sharing; 2],
    rng: &mut StdRng,
) {
    let started = Instant::now();
    let mut i = 0u64;
    let earlier = if args.growing {
        0
    } else {
        args.decisions + Upkeep::SLACK
    };
    let mut tree = tree.lock();
    history(
        &mut tree,
        systems,
        earlier,
        32 * 1024,
        WORKERS,
        max_prompt_bytes,
        rng,
    );
    let [every, fill_only] = fleets;
    while tree.node_count() < args.nodes_target {
        let sys = &systems[rng.random_range(0..systems.len())];
        let text = format!("system: {sys}\nuser: conversation {i}{}", words(rng, 120));
        tree.insert(text.as_bytes(), WorkerId((i % WORKERS as u64) as u32));
        for s in [&mut *every, &mut *fill_only] {
            s.add(text.as_bytes(), (i % WORKERS as u64) as usize);
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
        (started.elapsed() - every.took - fill_only.took).as_secs_f64()
    );
}

/// The fleets' publisher and subscriber as in the router, on a thread of their own
/// (the publisher hashes what the request path queued; its Redis is a closed port);
/// nothing with `--no-publisher`. Stopped by the returned shutdown.
fn start_fleets(
    publisher: bool,
    fleets: [&Sharing; 2],
) -> (
    cache_aware_router::shutdown::Trigger,
    std::thread::JoinHandle<()>,
) {
    let (stop, shutdown) = cache_aware_router::shutdown::channel();
    let fleets = fleets.map(|s| Arc::clone(&s.fleet));
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
    (stop, background)
}

/// Pick + observe and decision (p50, p99) in µs of one lane.
type Totals = (&'static str, (f64, f64), (f64, f64));

/// Times every lane of every case on `bodies` (a case's lanes interleaved request by
/// request, the order rotating), holding each tree at its cap (unless `--growing`),
/// and prints each lane's percentiles. Each lane's totals, and per lane after a case's
/// first the per-request difference against it.
fn time_cases(
    cases: &mut [Vec<Lane>],
    bodies: &[Vec<u8>],
    args: &Args,
    max_prompt_bytes: usize,
) -> (Vec<Totals>, Vec<String>) {
    // At the cap (the default): each tree is held near its size after the fill (see
    // `Upkeep`); `--growing` lets it grow.
    let upkeep = Upkeep::new(args.nodes_target);
    let evict = |lanes: &[Lane]| {
        if args.growing {
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
        if args.growing {
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
    for lanes in cases.iter_mut() {
        for (n, body) in bodies.iter().enumerate() {
            if n % Upkeep::EVERY == 0 {
                evict(lanes);
            }
            let k = lanes.len();
            for j in 0..k {
                lanes[(n + j) % k].decide(body, max_prompt_bytes);
            }
        }
        paired.extend(lanes[1..].iter().map(|lane| paired_line(lane, &lanes[0])));
        for lane in lanes.iter_mut() {
            totals.push(lane.report(args.decisions, bodies[0].len()));
        }
    }
    (totals, paired)
}

/// Same request, adjacent in time: the per-request difference against the first lane
/// (sharing off) is robust where a lane's p50 is not (half the requests insert a new
/// 30 KiB leaf and half do not, so the p50 sits between two modes).
fn paired_line(lane: &Lane, off: &Lane) -> String {
    let mut d: Vec<f64> = lane
        .total_t
        .iter()
        .zip(&off.total_t)
        .map(|(on, off)| (on.as_secs_f64() - off.as_secs_f64()) * 1e6)
        .collect();
    d.sort_by(f64::total_cmp);
    let mean =
        |t: &[Duration]| t.iter().map(Duration::as_secs_f64).sum::<f64>() * 1e6 / t.len() as f64;
    format!(
        "{} vs off, per request: median difference {:+.1} µs; mean decision {:.1} vs \
         {:.1} µs ({:+.1} %)",
        lane.name,
        d[d.len() / 2],
        mean(&lane.total_t),
        mean(&off.total_t),
        100.0 * (mean(&lane.total_t) / mean(&off.total_t) - 1.0),
    )
}

/// cache_aware with sharing on against off: the paired lines, then each sharing lane's
/// percentiles against off's and the records its publisher dropped.
fn sharing_against_off(totals: &[Totals], paired: &[String], fleets: [&Sharing; 2]) {
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
    let Some(off) = find("cache_aware") else {
        return;
    };
    println!();
    for line in paired {
        println!("{line}");
    }
    for s in fleets {
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

/// Times the remote lookup alone (`Fleet::longest_prefix`) on each fleet's index, and
/// beside it the chunk hashes it walks (computed inside extract).
fn remote_lookup(fleets: [&Sharing; 2], bodies: &[Vec<u8>], max_prompt_bytes: usize) {
    let all: WorkerMask = fleets[0]
        .pool
        .set()
        .workers()
        .iter()
        .map(|w| w.id())
        .collect();
    for s in fleets {
        let mut hash_t = Vec::with_capacity(bodies.len());
        let mut walk_t = Vec::with_capacity(bodies.len());
        let mut matched = 0usize;
        for body in bodies {
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

//! A decision through the policy seam as the proxy makes it, the requests it decides
//! on, trees held at their size between timed decisions, and percentile reports (the
//! `decision` and `pool_scale` benches).

use std::time::{Duration, Instant};

use cache_aware_router::policy::decide::pick_slot;
use cache_aware_router::policy::{Outcome, Policy, Reason, RouteRequest};
use cache_aware_router::pools::pool::{WorkerId, WorkerSet};
use cache_aware_router::prompt::{Endpoint, extract};
use cache_aware_router::tree::{RadixTree, WorkerMask, evict};
use rand::Rng;
use rand::rngs::StdRng;

use crate::common::{chat_body, words};

pub fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

/// Prints p50/p99/max of `samples` and returns (p50, p99) in µs.
pub fn report(name: &str, samples: &mut [Duration]) -> (f64, f64) {
    samples.sort();
    let (p50, p99) = (percentile(samples, 0.50), percentile(samples, 0.99));
    println!(
        "{name:<34} n={:<6} p50={p50:>7.1} µs  p99={p99:>7.1} µs  max={:>8.1} µs",
        samples.len(),
        percentile(samples, 1.0),
    );
    (p50, p99)
}

/// Holds trees near their size after the fill, as a router's upkeep task holds its tree
/// at `cache.max_tree_size`: a pass (`tree::evict::evict_to`, run between timed
/// decisions, as it runs beside the request path) takes a tree [`Upkeep::SLACK`] nodes
/// under that size, evicting its least recently used leaves. New leaves reuse what
/// evicted ones freed, instead of faulting in fresh pages, when those are as large as
/// they are (see [`history`]).
pub struct Upkeep {
    rt: tokio::runtime::Runtime,
    /// Nodes a pass leaves.
    to: usize,
}

impl Upkeep {
    /// Decisions between two passes.
    pub const EVERY: usize = 256;
    /// Nodes a pass leaves under the size after the fill: room for the ≤ 2 nodes (a
    /// leaf and a split) each of [`Upkeep::EVERY`] decisions adds.
    pub const SLACK: usize = 4 * Self::EVERY;

    /// Upkeep for trees filled to `nodes` nodes.
    pub fn new(nodes: usize) -> Self {
        Upkeep {
            rt: tokio::runtime::Builder::new_current_thread()
                .build()
                .expect("runtime"),
            to: nodes.saturating_sub(Self::SLACK),
        }
    }

    /// The node count a pass leaves.
    pub fn target(&self) -> usize {
        self.to
    }

    /// One eviction pass over `tree`.
    pub fn pass(&self, tree: &cache_aware_router::tree::SharedTree) {
        self.rt.block_on(evict::evict_to(
            tree,
            evict::Ceiling {
                nodes: self.to,
                bytes: u64::MAX,
            },
        ));
    }
}

/// Inserts `n` earlier requests into `tree` before its fill: chat bodies of about
/// `bytes` over `systems` (as the runs send them), extracted as the proxy extracts them
/// (`max_prompt_bytes`), each on one of `workers`. They become the tree's least
/// recently used leaves, so a run's eviction passes offset each new leaf by evicting
/// one of the same size, and the tree's bytes stay level: the steady state of a tree
/// at its cap under this traffic. Without them the passes evict the fill's ~90-byte
/// leaves while each new 32 KiB prompt adds a ~30 KiB leaf, so the tree grows in bytes
/// and its new pages fault in (a tree still filling; `decision --growing`).
pub fn history(
    tree: &mut RadixTree,
    systems: &[String],
    n: usize,
    bytes: usize,
    workers: u32,
    max_prompt_bytes: usize,
    rng: &mut StdRng,
) {
    for i in 0..n {
        let sys = &systems[rng.random_range(0..systems.len())];
        let body = chat_body(sys, &words(rng, bytes.saturating_sub(2048)));
        let ctx = extract(Endpoint::ChatCompletions, &body, max_prompt_bytes);
        tree.insert(&ctx.text, WorkerId(i as u32 % workers));
    }
}

/// `n` chat bodies over the `systems` prompts, each with about `user_bytes` of user
/// text; past the first, half repeat an earlier body (hits), half are new.
pub fn requests(systems: &[String], n: usize, user_bytes: usize, rng: &mut StdRng) -> Vec<Vec<u8>> {
    let mut bodies: Vec<Vec<u8>> = Vec::with_capacity(n);
    for k in 0..n {
        if k > 0 && rng.random_bool(0.5) {
            let j = rng.random_range(0..k);
            bodies.push(bodies[j].clone());
        } else {
            let sys = &systems[rng.random_range(0..systems.len())];
            bodies.push(chat_body(sys, &words(rng, user_bytes)));
        }
    }
    bodies
}

/// What one decision took.
pub struct Decided {
    /// JSON body to routing text.
    pub extract: Duration,
    /// `Policy::pick` and `Policy::observe(Served)`.
    pub pick: Duration,
    /// The pick was a cache hit.
    pub hit: bool,
}

thread_local! {
    /// The body as the server read it (see [`decide`]).
    static READ: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// One decision, as the proxy makes it: extract, `policy::decide::pick_slot` (the candidates
/// from the set, pick, the in-flight slot), observe(Served).
///
/// The body is first copied (untimed) into one reused buffer, as the proxy copies the
/// frames it read into one buffer just before extraction
/// (`proxy::request_body::collect`): extraction reads bytes just written, not a body
/// among the run's megabytes that left the cache long ago.
pub fn decide(
    policy: &dyn Policy,
    set: &WorkerSet,
    body: &[u8],
    max_prompt_bytes: usize,
    rng: &mut StdRng,
) -> Decided {
    READ.with_borrow_mut(|read| {
        read.clear();
        read.extend_from_slice(body);
        decide_read(policy, set, read, max_prompt_bytes, rng)
    })
}

fn decide_read(
    policy: &dyn Policy,
    set: &WorkerSet,
    body: &[u8],
    max_prompt_bytes: usize,
    rng: &mut StdRng,
) -> Decided {
    let t0 = Instant::now();
    let mut ctx = extract(Endpoint::ChatCompletions, body, max_prompt_bytes);
    let t1 = Instant::now();
    // As the proxy does: the chunk hashes move from the context to the request.
    let chain = std::mem::take(&mut ctx.chain).into();
    let req = RouteRequest {
        ctx: Some(&ctx),
        tie: Some(ctx.digest),
        chain,
        ..Default::default()
    };
    // The proxy's own step: the candidates (health, breaker, load), the pick, and the
    // chosen worker's in-flight slot, released at once.
    let (pick, guard) =
        pick_slot(policy, set, &req, &WorkerMask::default(), rng).expect("a usable worker");
    policy.observe(&req, &pick, guard.worker(), Outcome::Served);
    drop(guard);
    let t2 = Instant::now();
    std::hint::black_box(&pick);
    Decided {
        extract: t1 - t0,
        pick: t2 - t1,
        hit: pick.reason == Reason::CacheHit,
    }
}

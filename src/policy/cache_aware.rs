//! `cache_aware` (the default): the longest prefix match in the radix tree of what this
//! router sent where, guarded by load. It owns the tree.
//!
//! The six steps of design.md ("Pick"):
//! 1. usable = healthy ∧ breaker admits ∧ in-flight < `max_load` ∧ not tried for this
//!    request (decided by the proxy); none usable ⇒ [`Reason::NoWorker`];
//! 2. the least-loaded usable worker by `in_flight + load_penalty`, ties broken stably
//!    by the request's session or prompt digest ([`super::select::least_loaded`]);
//! 3. the prompt is prefix-matched in the tree, restricted to usable cache-aware workers,
//!    and the match is rounded down to whole engine KV blocks (`cache.engine_block_tokens`
//!    at the worker's learned tokens per byte, [`BlockScale`]): under one block is a miss;
//! 4. it is a cache hit when matched/len ≥ `threshold` or matched ≥ `match_abs_threshold`
//!    (bytes of those whole blocks);
//! 5. …unless the cached worker's load exceeds the least-loaded one's by more than
//!    `balance_abs_threshold` AND more than `balance_rel_threshold` times
//!    ⇒ least-loaded ([`Reason::HitOverloaded`], a degradation); where the least-loaded
//!    worker lacks part of the match and that part is not busier than its holders'
//!    share of the pool, the gap must also exceed [`hold_margin`] for the share of the
//!    prompt a move would recompute ([`Held`]);
//! 6. otherwise least-loaded ([`Reason::Miss`], or [`Reason::EmptyText`] for an empty
//!    prompt).
//!
//! The prompt is recorded in the tree for the worker that **served** it (the first
//! response byte with a 2xx status, [`Policy::observe`]), never for one that was only
//! picked: a worker that failed did not compute the prefix. The balance guard compares
//! against the least-loaded worker (as SGLang's cache-aware policy does), which keeps a
//! trace whose every prompt shares one system prompt from collapsing onto one replica.

use std::sync::Arc;

use rand::RngCore;

use super::select::{
    BlockScale, CacheParams, eviction_evidence, hold_margin, is_overloaded, least_queued,
    least_queued_or_loaded, outgrows_holders, usable,
};
use super::{Answer, Candidate, Delivery, MatchUnit, Outcome, Pick, Policy, Reason, RouteRequest};
use crate::config::CacheConfig;
use crate::pools::pool::{Pool, PoolListener, Worker, WorkerId, WorkerSet};
use crate::shutdown::Shutdown;
use crate::tree::{
    ChainMemo, Lookup, Mark, MaskBuilder, PrefixMatch, RadixTree, RemotePrefixes, SharedTree,
    Verdict, WorkerMask,
};

/// The drift (delivered ÷ predicted prefix tokens, `pool::hits`) under which a worker's
/// short answers are taken as evictions ([`CacheAware::learn`]): at or above it the
/// router's memory of the worker is borne out, and a short answer is noise (a
/// tokens-per-byte estimate, a prefix still being computed).
pub const LEARN_BELOW: f64 = 0.95;

/// At most one warning line a minute about records the router stopped believing.
static DISBELIEF_LOG: crate::clock::LogEvery =
    crate::clock::LogEvery::new(std::time::Duration::from_secs(60));

/// Whether a worker's short answers may bound its records ([`CacheAware::learn`]):
/// its engine delivers under [`LEARN_BELOW`] of what its records predict, over its
/// last answers and over its longer run (`pool::hits::HitStats::borne_out`).
pub fn learning_allowed(hits: &crate::pools::pool::hits::HitStats) -> bool {
    let (window, long) = hits.borne_out();
    window.is_some_and(|d| d < LEARN_BELOW) && long.is_some_and(|d| d < LEARN_BELOW)
}

/// The `cache_aware` policy: its tree and thresholds.
pub struct CacheAware {
    params: CacheParams,
    cache: CacheConfig,
    tree: Arc<SharedTree>,
}

impl CacheAware {
    /// The policy for `cache:`, its tree shared with the other router replicas through
    /// `fleet` when given (`state:`).
    pub fn new(cache: &CacheConfig, fleet: Option<&Arc<crate::fleet::Fleet>>) -> Self {
        let remote = fleet.map(|f| Arc::clone(f) as Arc<dyn crate::tree::RemotePrefixes>);
        CacheAware {
            params: CacheParams::from(cache),
            cache: cache.clone(),
            tree: Arc::new(SharedTree::new(remote)),
        }
    }

    /// The thresholds (precise mode's scoring uses the same guard).
    pub fn params(&self) -> &CacheParams {
        &self.params
    }

    /// The shared tree.
    pub fn shared_tree(&self) -> &Arc<SharedTree> {
        &self.tree
    }

    /// The tree's decision for `req` (steps 1–6), under one short lock hold; tokens per
    /// byte are `set`'s workers' learned ones.
    pub fn decide(
        &self,
        req: &RouteRequest<'_>,
        set: &WorkerSet,
        candidates: &[Candidate],
        rng: &mut dyn RngCore,
    ) -> Pick {
        let tree = self.tree.lock();
        let memory = Memory {
            tree: &tree,
            remote: self.tree.remote().map(|r| (r, &req.chain)),
            tokens_per_byte: &|id| learned_tokens_per_byte(set, id),
        };
        pick_cache_aware(&self.params, req.text(), candidates, &memory, req.tie, rng)
    }

    /// Learns from the answer to a prediction of the tree's records ([`Delivery`]),
    /// judged against what the worker's records predicted (a policy may predict more:
    /// `cost_aware` a cut prompt as far as the worker served it before):
    /// - it counts in the worker's *borne-out* ratios (delivered ÷ recorded, recent and
    ///   long: `pool::hits::HitStats::borne_out`);
    /// - on evidence ([`Mark::evidence`]), always, what it shows of that one record
    ///   ([`RadixTree::answered`]): a short answer counts a doubt, for that worker, at
    ///   the node ending the first block its engine did not serve (a head shared above
    ///   it is not blamed); one that delivered clears the counts; after
    ///   [`crate::tree::DISBELIEVE_AFTER`] short ones in a row the router stops
    ///   believing the worker holds that prefix (logged, naming the worker);
    /// - with `cache.learn_evictions` on, short answers also bound the worker's records
    ///   by what its KV cache was found to hold ([`SharedTree::engine_evicted`]: its
    ///   records last used before the lost prefix, and a learned capacity) — only when
    ///   the match ended in a node that worker alone held (its last use *there*), the
    ///   worker's records are measurably not borne out ([`learning_allowed`]), and a
    ///   second short answer within the drift window confirms the first (the horizon
    ///   is the older of the two): a worker whose engine delivers what its records
    ///   predict loses no record, and one short answer is one record.
    pub fn learn(&self, worker: &Worker, answer: &Answer<'_>) {
        let Some(d) = answer.delivery else {
            return;
        };
        // The record's prediction at the worker's tokens per byte.
        let scale = BlockScale {
            tokens_per_byte: worker.prefill().rate().tokens_per_byte,
            block_tokens: self.params.block_tokens,
        };
        let recorded = (scale.tokens(d.mark.bytes as usize) as u64).min(d.predicted_tokens);
        worker.hits().borne(recorded, d.delivered_tokens);
        let block = self.params.block_tokens as u64;
        let short = Delivery::is_short(recorded, d.delivered_tokens, block);
        // The last byte of the first block the engine did not serve.
        let missed = if scale.tokens_per_byte > 0.0 {
            ((d.delivered_tokens + block) as f64 / scale.tokens_per_byte) as usize
        } else {
            0
        };
        if !d.mark.evidence {
            return;
        }
        let verdict = self
            .tree
            .answered(worker.id(), &d.mark, short, missed.saturating_sub(1));
        if verdict == Verdict::Disbelieved
            && let Some(n) = DISBELIEF_LOG.due()
        {
            tracing::warn!(
                worker = &**worker.label(),
                records = n,
                "worker's engine served far fewer cached tokens than the router predicted \
                 for one prefix {} answers in a row: the router no longer predicts that \
                 prefix there (prefix caching off on it, another model behind its URL, or \
                 a chat template that differs?)",
                crate::tree::DISBELIEVE_AFTER
            );
        }
        if self.cache.learn_evictions
            && short
            && d.mark.stamp > 0
            && learning_allowed(worker.hits())
        {
            // One short answer is one record (counted above); a second within the
            // window confirms an engine that evicts what the router remembers.
            if let Some(horizon) = worker.hits().confirm_short(d.mark.stamp) {
                self.tree.engine_evicted(worker.id(), horizon);
            }
        }
    }

    /// Records the served request's prompt for the worker that served it.
    pub fn record_served(&self, req: &RouteRequest<'_>, pick: &Pick) {
        if let Some(id) = pick.worker
            && pick.cache_aware
        {
            self.tree.record(req.text(), id, &req.chain);
        }
    }
}

impl PoolListener for CacheAware {
    /// Its records go: up to ~0.25 s of work for a worker holding a quarter of a full
    /// tree (done in short lock holds, see [`SharedTree::remove_worker`]), so inside a
    /// runtime it runs on a blocking thread, not on the async worker that brought the
    /// news (a health flip, an admin call, discovery).
    fn worker_left(&self, worker: &Worker) {
        let (tree, id) = (Arc::clone(&self.tree), worker.id());
        let forget = move || {
            tree.remove_worker(id);
            tree.set_capacity(id, None);
            if let Some(r) = tree.remote() {
                r.forget(id);
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn_blocking(forget)),
            Err(_) => forget(),
        }
    }

    /// Its cache is presumed cold when it returns.
    fn worker_down(&self, worker: &Worker) {
        self.worker_left(worker);
    }
}

impl Policy for CacheAware {
    fn name(&self) -> &'static str {
        "cache_aware"
    }

    fn pick(
        &self,
        req: &RouteRequest<'_>,
        set: &WorkerSet,
        candidates: &[Candidate],
        rng: &mut dyn RngCore,
    ) -> Pick {
        self.decide(req, set, candidates, rng)
    }

    fn observe(&self, req: &RouteRequest<'_>, pick: &Pick, _: &Worker, outcome: Outcome) {
        if outcome == Outcome::Served {
            self.record_served(req, pick);
        }
    }

    fn answered(&self, worker: &Worker, answer: &Answer<'_>) {
        self.learn(worker, answer);
    }

    fn views(&self) -> Vec<Arc<dyn super::View>> {
        vec![Arc::new(TreeView(Arc::clone(&self.tree)))]
    }

    fn background(
        &self,
        _: Arc<Pool>,
        shutdown: Shutdown,
    ) -> Option<super::BoxFuture<'static, ()>> {
        Some(Box::pin(crate::tree::evict::run(
            Arc::clone(&self.tree),
            self.cache.clone(),
            shutdown,
        )))
    }
}

/// The prefix tree as operators see it: its size and each worker's share in
/// `/workers`, its size and upkeep counters in `/metrics`, and `POST /cache/clear`.
pub struct TreeView(pub Arc<SharedTree>);

impl super::View for TreeView {
    fn workers(
        &self,
        set: &WorkerSet,
        top: &mut super::view::Fields,
        workers: &mut [super::view::Fields],
    ) {
        use super::view::put;
        // Copied under the lock, formatted after releasing it.
        let (nodes, bytes, shares) = {
            let tree = self.0.lock();
            let shares: Vec<f64> = set.ids().map(|id| tree.share(id)).collect();
            (tree.node_count(), tree.total_bytes(), shares)
        };
        put(top, "tree_nodes", nodes);
        put(top, "tree_bytes", bytes);
        for ((w, fields), share) in set.workers().iter().zip(workers).zip(shares) {
            put(fields, "tree_share", share);
            put(fields, "tree_capacity_bytes", self.0.capacity(w.id()));
        }
    }

    fn collector(&self, _: &Arc<Pool>) -> Option<Box<dyn prometheus_client::collector::Collector>> {
        Some(Box::new(TreeMetrics(Arc::clone(&self.0))))
    }

    fn clear(&self, worker: Option<crate::pools::pool::WorkerId>) -> Option<usize> {
        Some(match worker {
            // Swapped under the lock, the old nodes freed after releasing it.
            None => {
                let old = std::mem::take(&mut *self.0.lock());
                old.node_count()
            }
            Some(id) => self.0.remove_worker(id),
        })
    }
}

/// The tree's families, read at each scrape.
#[derive(Debug)]
struct TreeMetrics(Arc<SharedTree>);

impl prometheus_client::collector::Collector for TreeMetrics {
    fn encode(&self, mut enc: prometheus_client::encoding::DescriptorEncoder) -> std::fmt::Result {
        use super::view::{counter, gauge};
        use std::sync::atomic::Ordering::Relaxed;
        let (nodes, bytes) = {
            let tree = self.0.lock();
            (tree.node_count(), tree.total_bytes())
        };
        gauge(
            &mut enc,
            "tree_nodes",
            "Nodes in the prefix tree",
            nodes as i64,
        )?;
        gauge(
            &mut enc,
            "tree_bytes",
            "Bytes of routing text in the prefix tree",
            bytes as i64,
        )?;
        counter(
            &mut enc,
            "tree_evicted_nodes",
            "Tree nodes removed by eviction passes",
            self.0.evicted_nodes.load(Relaxed),
        )?;
        counter(
            &mut enc,
            "tree_aged_out_bytes",
            "Bytes of workers' tree records removed because their engine was found to have evicted older prefixes (an answer delivered far fewer cached tokens than predicted)",
            self.0.aged_out_bytes.load(Relaxed),
        )?;
        counter(
            &mut enc,
            "tree_disbelieved_records",
            "Records the router stopped believing a worker holds: its engine served far fewer cached tokens than predicted for that prefix two answers in a row (prefix caching off, another model behind the URL, a chat template that differs)",
            self.0.disbelieved.load(Relaxed),
        )?;
        counter(
            &mut enc,
            "tree_skipped_inserts",
            "Tree inserts skipped because an eviction pass was running",
            self.0.skipped_inserts.load(Relaxed),
        )
    }
}

/// What the cache-aware decision reads of what workers hold: the tree, the other
/// replicas' records when shared (`remote`), and each worker's tokens per byte of
/// routing text (to count matches in whole engine blocks).
pub struct Memory<'a> {
    pub tree: &'a RadixTree,
    pub remote: Option<(&'a dyn RemotePrefixes, &'a ChainMemo)>,
    pub tokens_per_byte: &'a dyn Fn(WorkerId) -> f64,
}

/// A worker's tokens per byte of routing text as its answers taught it
/// (`pool::prefill`), the prior for one not in `set`.
pub fn learned_tokens_per_byte(set: &WorkerSet, id: WorkerId) -> f64 {
    set.get(id)
        .map_or(crate::pools::pool::prefill::PRIOR_TOKENS_PER_BYTE, |w| {
            w.prefill().rate().tokens_per_byte
        })
}

/// One pass over the candidates: the least load among usable workers (which of them
/// carries it is worked out only when the pick goes there: a tie among many idle workers
/// ranks each of them), the usable cache-aware workers, every cache-aware one, and the
/// pool's in-flight total.
struct Survey {
    eligible: MaskBuilder,
    all: MaskBuilder,
    least_load: usize,
    in_flight: usize,
}

impl Survey {
    #[inline]
    fn of(candidates: &[Candidate]) -> Survey {
        let (mut eligible, mut all) = (
            MaskBuilder::for_ids(candidates.len()),
            MaskBuilder::for_ids(candidates.len()),
        );
        // Each mask word's bits are gathered in a register while consecutive candidates
        // share it (the proxy lists a pool in id order: one store per 64 workers), not
        // read and written in memory per worker (`stages pick_slot/1000_workers`: 9.5 →
        // 7.9 µs).
        let mut least_load = usize::MAX;
        let mut in_flight = 0usize;
        let (mut word, mut all_bits, mut eligible_bits) = (0usize, 0u64, 0u64);
        for c in candidates {
            in_flight = in_flight.saturating_add(c.load);
            let w = c.id.0 as usize / 64;
            if w != word {
                all.or_word(word, all_bits);
                eligible.or_word(word, eligible_bits);
                (word, all_bits, eligible_bits) = (w, 0, 0);
            }
            let bit = 1u64 << (c.id.0 % 64);
            all_bits |= bit & u64::from(c.cache_aware).wrapping_neg();
            eligible_bits |= bit & u64::from(c.cache_aware && c.usable).wrapping_neg();
            least_load = least_load.min(if c.usable { c.load } else { usize::MAX });
        }
        all.or_word(word, all_bits);
        eligible.or_word(word, eligible_bits);
        Survey {
            eligible,
            all,
            least_load,
            in_flight,
        }
    }
}

/// The cache-aware decision (steps 1–6 of the module docs) on `memory` (the longer of
/// the tree's and the other replicas' matches wins, equal ones merge); records nothing
/// (the policy records the served worker in [`Policy::observe`]). The pick's numbers
/// are prompt tokens in whole engine blocks, at the chosen worker's tokens per byte.
/// `tie` breaks load ties stably (see [`super::select::least_loaded`]).
pub fn pick_cache_aware(
    params: &CacheParams,
    text: &[u8],
    candidates: &[Candidate],
    memory: &Memory<'_>,
    tie: Option<u64>,
    rng: &mut dyn RngCore,
) -> Pick {
    let Survey {
        eligible,
        all,
        least_load,
        in_flight,
    } = Survey::of(candidates);
    // A usable candidate's load is below `usize::MAX`: `least_load` is its least.
    let Some(first) = usable(candidates).next() else {
        return Pick::load_only(None, text.len());
    };
    let least = |rng: &mut dyn RngCore| {
        least_queued(usable(candidates), params, least_load, tie, rng).unwrap_or(first)
    };
    let scale = |c: &Candidate| BlockScale {
        tokens_per_byte: (memory.tokens_per_byte)(c.id),
        block_tokens: params.block_tokens,
    };
    // `matched` and `available` in bytes of routing text, reported in whole blocks.
    // `mark`: where the predicted prefix ends, for a hit on the tree's own records.
    let pick = |c: &Candidate, reason, matched: usize, available: usize, mark: Mark| {
        let s = scale(c);
        let matched = s.tokens(matched);
        Pick {
            worker: Some(c.id),
            reason,
            matched,
            available: s.tokens(available).max(matched),
            text_len: s.text_tokens(text.len()),
            unit: MatchUnit::Tokens,
            dp_rank: None,
            cache_aware: c.cache_aware,
            prefill_tokens: 0,
            mark,
        }
    };
    if text.is_empty() {
        return pick(least(rng), Reason::EmptyText, 0, 0, Mark::default());
    }
    let tree = memory.tree;
    let (eligible, all) = (eligible.build(), all.build());
    let (held, own_match) = tree_matches(tree, text, &all, &eligible);
    let Lookup {
        found: mut m,
        mut mark,
        disbelieved,
    } = own_match;
    let least = |rng: &mut dyn RngCore| {
        least_believed(
            least(rng),
            candidates,
            &disbelieved,
            params,
            least_load,
            tie,
            rng,
        )
    };
    // A bound on the other replicas' longest match over every eligible worker: no one
    // worker's can be longer, which spares `own` a second remote lookup when the tree's
    // is as long. An empty answer bounds it by the guess only (the lookup reports no
    // match shorter than the tree's).
    let mut remote_best = 0;
    if let Some((r, memo)) = memory.remote {
        let other = r.longest_prefix(text, &eligible, memo, m.matched);
        remote_best = if other.matched > 0 {
            other.matched
        } else {
            m.matched
        };
        if other.matched > m.matched {
            m = other;
            mark = Mark::default();
        } else if other.matched == m.matched && other.matched > 0 {
            m.workers = m.workers.union(&other.workers);
        }
    }
    // The least-loaded holder, and whether what it holds is a hit in whole blocks.
    let cached = (m.matched > 0)
        .then(|| least_usable_holder(candidates, &m.workers, params, least_load, tie, rng))
        .flatten()
        .filter(|c| {
            let aligned = scale(c).aligned_bytes(m.matched);
            aligned > 0
                && (aligned as f64 >= params.threshold * text.len() as f64
                    || (params.match_abs_threshold > 0 && aligned >= params.match_abs_threshold))
        });
    let available = held.max(m.matched);
    // The least-loaded worker's own match, when the pick goes there instead.
    let own = |c: &Candidate| {
        if m.workers.contains(c.id) {
            return m.matched;
        }
        let only: WorkerMask = [c.id].into_iter().collect();
        let mut n = tree.longest_prefix(text, &only).matched;
        if let Some((r, memo)) = memory.remote
            && (remote_best > n || !eligible.contains(c.id))
        {
            n = n.max(r.longest_prefix(text, &only, memo, n).matched);
        }
        n
    };
    match cached {
        Some(c) if is_overloaded(params, c.load, least_load) => {
            let least = least(rng);
            let own_least = own(least);
            let hold = Held {
                text,
                lost: scale(c)
                    .tokens(m.matched)
                    .saturating_sub(scale(least).tokens(own_least)),
                text_tokens: scale(c).text_tokens(text.len()),
                lacking: own_least
                    .saturating_add(scale(least).block_bytes())
                    .min(m.matched)
                    .saturating_sub(1),
                workers: candidates.len(),
            };
            if hold.stays(params, tree, c.load.saturating_sub(least_load)) {
                let mark = eviction_evidence(mark, tree.clock(), in_flight);
                return pick(c, Reason::CacheHit, m.matched, available, mark);
            }
            pick(
                least,
                Reason::HitOverloaded,
                own_least,
                available,
                Mark::default(),
            )
        }
        Some(c) => {
            let mark = eviction_evidence(mark, tree.clock(), in_flight);
            pick(c, Reason::CacheHit, m.matched, available, mark)
        }
        None if m.matched == 0 => pick(least(rng), Reason::Miss, 0, available, Mark::default()),
        None => {
            let least = least(rng);
            pick(least, Reason::Miss, own(least), available, Mark::default())
        }
    }
}

/// A hit on an overloaded worker, weighed against moving it to the least-loaded one
/// (step 5 of the module docs, [`hold_margin`]).
struct Held<'a> {
    text: &'a [u8],
    /// Tokens of the cached worker's match the least-loaded worker would recompute.
    lost: usize,
    text_tokens: usize,
    /// A byte of `text` in the first whole block the least-loaded worker lacks: whose
    /// tree node says how busy that part is. (Not the first byte it lacks: that may
    /// lie in a few bytes every prompt shares, such as a chat template's `user: `,
    /// busy by construction.)
    lacking: usize,
    /// Workers in the pool.
    workers: usize,
}

impl Held<'_> {
    /// Whether the hit stays on its worker although that one's load is `gap` requests
    /// above the least-loaded one's: the gap is within [`hold_margin`] for the share of
    /// the prompt a move would recompute, and the part the least-loaded worker lacks is
    /// not a prefix outgrowing its holders ([`outgrows_holders`]; unknown to this
    /// replica's tree — another replica's record — it moves, as without the margin).
    fn stays(&self, params: &CacheParams, tree: &RadixTree, gap: usize) -> bool {
        if params.balance_match_threshold == 0 || self.lost == 0 {
            return false;
        }
        let share = self.lost as f64 / self.text_tokens.max(1) as f64;
        if gap > hold_margin(params, share) {
            return false;
        }
        tree.use_at(self.text, self.lacking).is_some_and(|u| {
            let age = tree.clock().saturating_sub(u.used);
            !outgrows_holders(age, u.holders, self.workers)
        })
    }
}

/// What any cache-aware worker (`all`) holds of `text` (bytes: what was available),
/// then the usable ones' (`eligible`) match: the same walk when a holder of the longest
/// is usable (the common case).
fn tree_matches(
    tree: &RadixTree,
    text: &[u8],
    all: &WorkerMask,
    eligible: &WorkerMask,
) -> (usize, Lookup) {
    let held = tree.lookup(text, all);
    let usable_holders = held.found.workers.intersection(eligible);
    let matched = held.found.matched;
    if usable_holders.is_empty() && matched > 0 {
        return (matched, tree.lookup(text, eligible));
    }
    let found = PrefixMatch {
        matched,
        workers: usable_holders,
        stamp: held.found.stamp,
    };
    (matched, Lookup { found, ..held })
}

/// `least` (the usable worker [`least_queued`] picks), unless it is disbelieved on this
/// text's path ([`RadixTree::answered`]) and another usable worker is as lightly
/// loaded: a prefix its engine does not serve from cache goes where it will be.
fn least_believed<'a>(
    least: &'a Candidate,
    candidates: &'a [Candidate],
    disbelieved: &WorkerMask,
    p: &CacheParams,
    least_load: usize,
    tie: Option<u64>,
    rng: &mut dyn RngCore,
) -> &'a Candidate {
    if disbelieved.is_empty() || !disbelieved.contains(least.id) {
        return least;
    }
    let others = usable(candidates).filter(|c| !disbelieved.contains(c.id));
    least_queued(others, p, least_load, tie, rng)
        .filter(|c| (c.pending, c.load) <= (least.pending, least.load))
        .unwrap_or(least)
}

/// The usable worker among `holders` that [`least_queued_or_loaded`] picks. Holders are
/// looked up by id when the list is in id order (the proxy's is the pool's, and a pool
/// numbers its workers in order until one leaves): a pass over the holders, not over a
/// pool of 1,000 workers. Otherwise one pass over the list.
fn least_usable_holder<'a>(
    candidates: &'a [Candidate],
    holders: &WorkerMask,
    p: &CacheParams,
    least_load: usize,
    tie: Option<u64>,
    rng: &mut dyn RngCore,
) -> Option<&'a Candidate> {
    let by_id = |id: WorkerId| {
        candidates
            .get(id.0 as usize)
            .filter(|c: &&Candidate| c.id == id)
    };
    if holders.iter().all(|id| by_id(id).is_some()) {
        least_queued_or_loaded(
            || holders.iter().filter_map(by_id).filter(|c| c.usable),
            p,
            least_load,
            tie,
            rng,
        )
    } else {
        least_queued_or_loaded(
            || {
                candidates
                    .iter()
                    .filter(|c| c.usable && holders.contains(c.id))
            },
            p,
            least_load,
            tie,
            rng,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use crate::policy::fixtures::{cands, params};
    use crate::pools::pool::WorkerId;

    fn rng() -> StdRng {
        StdRng::seed_from_u64(7)
    }

    /// The decision on `t` alone, every worker at the prior 0.25 tokens per byte.
    fn decide(
        p: &CacheParams,
        text: &[u8],
        c: &[Candidate],
        t: &RadixTree,
        rng: &mut StdRng,
    ) -> Pick {
        let memory = Memory {
            tree: t,
            remote: None,
            tokens_per_byte: &|_| 0.25,
        };
        pick_cache_aware(p, text, c, &memory, None, rng)
    }

    /// Picks, then records the prompt for the chosen worker as `observe(Served)` does.
    fn serve(
        p: &CacheParams,
        text: &[u8],
        c: &[Candidate],
        t: &mut RadixTree,
        rng: &mut StdRng,
    ) -> Pick {
        let pick = decide(p, text, c, t, rng);
        if let Some(id) = pick.worker
            && pick.cache_aware
            && !text.is_empty()
        {
            t.insert(text, id);
        }
        pick
    }

    const PROMPT: &[u8] = b"system: You are a helpful assistant.\nuser: summarise this document";

    #[test]
    fn available_is_any_holder_and_predicted_the_chosen_workers_own_match() {
        let mut t = RadixTree::new();
        let head = b"system: You are a helpful assistant who answers from the manual.\nuser: ";
        let full = [
            &head[..],
            b"summarise chapter three of the manual in plain words",
        ]
        .concat();
        t.insert(&full, WorkerId(0));
        t.insert(head, WorkerId(1));
        // A warm hit: all three numbers are the whole prompt.
        let c = cands(&[0, 0, 0]);
        let p = decide(&params(), &full, &c, &t, &mut rng());
        assert_eq!((p.worker, p.reason), (Some(WorkerId(0)), Reason::CacheHit));
        // In whole 16-token blocks at 4 bytes a token: 124 bytes are 31 tokens, 1 block.
        let blocks = |bytes: usize| bytes / 4 / 16 * 16;
        assert_eq!(
            (p.available, p.matched),
            (blocks(full.len()), blocks(full.len()))
        );
        assert_eq!(p.unit, MatchUnit::Tokens);
        // Worker 0 unusable: available still counts what it holds; the pick goes to
        // worker 1 (holding the head) or 2 (nothing), each with its own match.
        let mut c = cands(&[0, 0, 0]);
        c[0].usable = false;
        let p = decide(&params(), &full, &c, &t, &mut rng());
        assert_eq!(p.available, blocks(full.len()));
        let own = if p.worker == Some(WorkerId(1)) {
            blocks(head.len())
        } else {
            0
        };
        assert_eq!(p.matched, own, "{p:?}");
        // Diverted by load: the least-loaded worker 2 holds nothing.
        let c = cands(&[9, 9, 0]);
        let p = decide(&params(), &full, &c, &t, &mut rng());
        assert_eq!(
            (p.worker, p.reason),
            (Some(WorkerId(2)), Reason::HitOverloaded)
        );
        assert_eq!((p.available, p.matched), (blocks(full.len()), 0));
    }

    #[test]
    fn a_prompt_its_holder_never_delivers_goes_to_an_as_lightly_loaded_other() {
        let mut t = RadixTree::new();
        t.insert(PROMPT, WorkerId(0));
        // Its engine served nothing of it twice in a row (the first block's last byte,
        // 63, is in the record).
        let mark = t.lookup(PROMPT, &[WorkerId(0)].into_iter().collect()).mark;
        for _ in 0..crate::tree::DISBELIEVE_AFTER {
            t.answered(WorkerId(0), &mark, true, 63);
        }
        // Whatever the tie key, an idle other worker takes it, as a miss.
        for tie in 0..20 {
            let memory = Memory {
                tree: &t,
                remote: None,
                tokens_per_byte: &|_| 0.25,
            };
            let p = pick_cache_aware(
                &params(),
                PROMPT,
                &cands(&[0, 0]),
                &memory,
                Some(tie),
                &mut rng(),
            );
            assert_eq!((p.worker, p.reason), (Some(WorkerId(1)), Reason::Miss));
            // Busier: the disbelieved worker is the least loaded, and takes it.
            let p = pick_cache_aware(
                &params(),
                PROMPT,
                &cands(&[0, 1]),
                &memory,
                Some(tie),
                &mut rng(),
            );
            assert_eq!((p.worker, p.matched), (Some(WorkerId(0)), 0));
        }
        // A new prompt is not affected.
        let other = b"user: something else entirely, long enough to be a prompt of its own";
        let c = cands(&[0, 0]);
        let ws: Vec<_> = (0..20)
            .map(|tie| {
                let memory = Memory {
                    tree: &t,
                    remote: None,
                    tokens_per_byte: &|_| 0.25,
                };
                pick_cache_aware(&params(), other, &c, &memory, Some(tie), &mut rng()).worker
            })
            .collect();
        assert!(ws.contains(&Some(WorkerId(0))), "{ws:?}");
    }

    #[test]
    fn no_usable_worker() {
        let mut t = RadixTree::new();
        let mut c = cands(&[0, 0]);
        for x in &mut c {
            x.usable = false;
        }
        let p = serve(&params(), PROMPT, &c, &mut t, &mut rng());
        assert_eq!((p.worker, p.reason), (None, Reason::NoWorker));
        assert_eq!(
            serve(&params(), PROMPT, &[], &mut t, &mut rng()).reason,
            Reason::NoWorker
        );
        assert_eq!(t.node_count(), 0);
    }

    #[test]
    fn empty_text_goes_least_loaded_without_insert() {
        let mut t = RadixTree::new();
        let p = serve(&params(), b"", &cands(&[3, 1, 2]), &mut t, &mut rng());
        assert_eq!((p.worker, p.reason), (Some(WorkerId(1)), Reason::EmptyText));
        assert_eq!(t.node_count(), 0);
    }

    #[test]
    fn miss_then_hit_follows_the_prefix() {
        let mut t = RadixTree::new();
        let c = cands(&[1, 0, 1]);
        let first = serve(&params(), PROMPT, &c, &mut t, &mut rng());
        assert_eq!(
            (first.worker, first.reason),
            (Some(WorkerId(1)), Reason::Miss)
        );
        // Now worker 1 is busier than 0 but within the balance margins.
        let c = cands(&[0, 2, 0]);
        let second = serve(&params(), PROMPT, &c, &mut t, &mut rng());
        assert_eq!(
            (second.worker, second.reason),
            (Some(WorkerId(1)), Reason::CacheHit)
        );
        // 66 bytes ≈ 16.5 tokens: one whole block of 16 reused, of 17 (rounded).
        assert_eq!((second.matched, second.text_len), (16, 17));
    }

    #[test]
    fn thresholds_ratio_and_absolute() {
        let mut t = RadixTree::new();
        // 140 bytes: 35 tokens at 4 bytes each, two whole blocks (128 bytes).
        let shared = [b'x'; 140];
        t.insert(&shared, WorkerId(0));
        let c = cands(&[0, 0]);
        let mut p = params();
        // 140 of 560 bytes = 0.25 < 0.3: a miss.
        let text = [&shared[..], &[b'y'; 420][..]].concat();
        let miss = serve(&p, &text, &c, &mut t.clone(), &mut rng());
        assert_eq!(miss.reason, Reason::Miss);
        // The absolute threshold makes it a hit.
        p.match_abs_threshold = 128;
        let hit = serve(&p, &text, &c, &mut t.clone(), &mut rng());
        assert_eq!(
            (hit.worker, hit.reason, hit.matched),
            (Some(WorkerId(0)), Reason::CacheHit, 32)
        );
        // Thresholds count whole blocks: 140 bytes held, but the blocks cover 128.
        p.match_abs_threshold = 129;
        let miss = serve(&p, &text, &c, &mut t.clone(), &mut rng());
        assert_eq!(miss.reason, Reason::Miss);
        // 0 disables the absolute threshold.
        p.match_abs_threshold = 0;
        let miss = serve(&p, &text, &c, &mut t.clone(), &mut rng());
        assert_eq!(miss.reason, Reason::Miss);
        // The ratio too: 128 / 560 = 0.229.
        p.threshold = 0.25;
        let miss = serve(&p, &text, &c, &mut t.clone(), &mut rng());
        assert_eq!(miss.reason, Reason::Miss);
        p.threshold = 0.22;
        let hit = serve(&p, &text, &c, &mut t, &mut rng());
        assert_eq!(hit.reason, Reason::CacheHit);
    }

    #[test]
    fn a_short_prompt_never_hits_and_blocks_follow_the_learned_rate() {
        // A repeat of a prompt under one block: the engine reuses nothing of it.
        let mut t = RadixTree::new();
        let short = b"user: what is the capital of France?";
        t.insert(short, WorkerId(0));
        let r = serve(&params(), short, &cands(&[1, 0]), &mut t, &mut rng());
        assert_eq!(
            (r.worker, r.reason, r.matched),
            (Some(WorkerId(1)), Reason::Miss, 0)
        );
        // 100 bytes held by worker 0 of a 300-byte prompt, threshold 0.3 (90 bytes): at
        // 0.25 tokens per byte 25 tokens are 1 block = 64 bytes (a miss); a tokenizer at
        // 0.33 makes it 33 tokens, 2 blocks = 96 bytes (a hit, 32 tokens predicted).
        let mut t = RadixTree::new();
        t.insert(&[b'x'; 100], WorkerId(0));
        let text = [&[b'x'; 100][..], &[b'y'; 200][..]].concat();
        let c = cands(&[0, 0]);
        let mut p = params();
        p.match_abs_threshold = 0;
        assert_eq!(decide(&p, &text, &c, &t, &mut rng()).reason, Reason::Miss);
        let memory = Memory {
            tree: &t,
            remote: None,
            tokens_per_byte: &|_| 0.33,
        };
        let r = pick_cache_aware(&p, &text, &c, &memory, None, &mut rng());
        assert_eq!(
            (r.worker, r.reason, r.matched),
            (Some(WorkerId(0)), Reason::CacheHit, 32)
        );
    }

    #[test]
    fn matches_shorter_than_a_block_are_misses() {
        let mut t = RadixTree::new();
        t.insert(
            b"user: hello there, this is a long enough prompt to matter at all",
            WorkerId(0),
        );
        // "user: h" matches 7 of 9 bytes (0.78) but saves no KV block.
        let r = serve(
            &params(),
            b"user: hi\n",
            &cands(&[1, 0]),
            &mut t,
            &mut rng(),
        );
        assert_eq!((r.worker, r.reason), (Some(WorkerId(1)), Reason::Miss));
    }

    #[test]
    fn overloaded_hit_needs_both_margins() {
        let mut t = RadixTree::new();
        t.insert(PROMPT, WorkerId(0));
        let p = params(); // abs 2, rel 1.5
        // 3 vs 0: > 0 + 2 and > 0 × 1.5 ⇒ overloaded.
        let r = serve(&p, PROMPT, &cands(&[3, 0]), &mut t.clone(), &mut rng());
        assert_eq!(
            (r.worker, r.reason),
            (Some(WorkerId(1)), Reason::HitOverloaded)
        );
        // 2 vs 0: abs margin not exceeded ⇒ hit.
        let r = serve(&p, PROMPT, &cands(&[2, 0]), &mut t.clone(), &mut rng());
        assert_eq!(r.reason, Reason::CacheHit);
        // 14 vs 10: abs exceeded (4 > 2) but 14 < 15 = 10 × 1.5 ⇒ hit.
        let r = serve(&p, PROMPT, &cands(&[14, 10]), &mut t.clone(), &mut rng());
        assert_eq!(r.reason, Reason::CacheHit);
        // 16 vs 10: both exceeded ⇒ overloaded.
        let r = serve(&p, PROMPT, &cands(&[16, 10]), &mut t, &mut rng());
        assert_eq!(
            (r.worker, r.reason),
            (Some(WorkerId(1)), Reason::HitOverloaded)
        );
    }

    /// Records `n` prompts of their own for worker 1, so what was recorded before is
    /// `n` records old.
    fn age(t: &mut RadixTree, n: usize) {
        for i in 0..n {
            t.insert(format!("another prompt {i}").as_bytes(), WorkerId(1));
        }
    }

    #[test]
    fn a_match_few_requests_share_stays_until_the_gap_outweighs_its_recompute() {
        // 256 bytes: 64 tokens at the prior rate, four whole blocks.
        let text = [b'p'; 256];
        let mut t = RadixTree::new();
        t.insert(&text, WorkerId(0));
        age(&mut t, 10);
        // Worker 1 would recompute the whole prompt: the margin is 2 + 64 × 1.
        let r = serve(
            &params(),
            &text,
            &cands(&[40, 0]),
            &mut t.clone(),
            &mut rng(),
        );
        assert_eq!((r.worker, r.reason), (Some(WorkerId(0)), Reason::CacheHit));
        let r = serve(
            &params(),
            &text,
            &cands(&[66, 0]),
            &mut t.clone(),
            &mut rng(),
        );
        assert_eq!(r.reason, Reason::CacheHit);
        let r = serve(
            &params(),
            &text,
            &cands(&[67, 0]),
            &mut t.clone(),
            &mut rng(),
        );
        assert_eq!(
            (r.worker, r.reason),
            (Some(WorkerId(1)), Reason::HitOverloaded)
        );
        // Off: the two plain thresholds alone.
        let off = CacheParams {
            balance_match_threshold: 0,
            ..params()
        };
        let r = serve(&off, &text, &cands(&[5, 0]), &mut t, &mut rng());
        assert_eq!(
            (r.worker, r.reason),
            (Some(WorkerId(1)), Reason::HitOverloaded)
        );
    }

    #[test]
    fn the_margin_counts_only_what_the_least_loaded_worker_lacks() {
        // Worker 1 holds the first half of the prompt, worker 0 all of it: a move would
        // recompute half, so the margin is 2 + 64 × 0.5 = 34.
        let head = vec![b'd'; 256];
        let text = [&head[..], &[b'q'; 256][..]].concat();
        let mut t = RadixTree::new();
        t.insert(&head, WorkerId(1));
        t.insert(&text, WorkerId(0));
        age(&mut t, 10);
        let r = serve(
            &params(),
            &text,
            &cands(&[34, 0]),
            &mut t.clone(),
            &mut rng(),
        );
        assert_eq!((r.worker, r.reason), (Some(WorkerId(0)), Reason::CacheHit));
        let r = serve(&params(), &text, &cands(&[35, 0]), &mut t, &mut rng());
        assert_eq!(
            (r.worker, r.reason, r.matched),
            (Some(WorkerId(1)), Reason::HitOverloaded, 64)
        );
    }

    #[test]
    fn a_prefix_busier_than_its_holders_spreads_at_the_plain_margin() {
        // A system prompt behind every other request, all of them on worker 0 so far:
        // one request in two through it, against one holder of four workers.
        let system = "s".repeat(2500);
        let prompt = |i: usize| format!("{system} turn {i}");
        let mut t = RadixTree::new();
        for i in 0..20 {
            t.insert(prompt(i).as_bytes(), WorkerId(0));
            t.insert(format!("one-off {i}").as_bytes(), WorkerId(2));
        }
        let r = serve(
            &params(),
            prompt(99).as_bytes(),
            &cands(&[5, 0, 1, 1]),
            &mut t.clone(),
            &mut rng(),
        );
        assert_eq!(
            (r.worker, r.reason),
            (Some(WorkerId(1)), Reason::HitOverloaded)
        );
        // The same prompt seen once in the last ten records: within its holder's share.
        age(&mut t, 10);
        let r = serve(
            &params(),
            prompt(99).as_bytes(),
            &cands(&[5, 0, 1, 1]),
            &mut t,
            &mut rng(),
        );
        assert_eq!((r.worker, r.reason), (Some(WorkerId(0)), Reason::CacheHit));
    }

    #[test]
    fn overloaded_hit_records_the_prompt_for_the_new_worker() {
        let mut t = RadixTree::new();
        t.insert(PROMPT, WorkerId(0));
        serve(&params(), PROMPT, &cands(&[5, 0]), &mut t, &mut rng());
        let holders = t.longest_prefix(PROMPT, &[WorkerId(0), WorkerId(1)].into_iter().collect());
        assert!(holders.workers.contains(WorkerId(1)));
    }

    /// Other replicas' records as `crate::fleet::Fleet` answers them: whole 128-byte
    /// chunks, and nothing when no eligible record ties or beats the tree's match (the
    /// guess; so nothing when it is past the text's whole chunks).
    #[derive(Debug)]
    struct Remote(Vec<(WorkerId, usize)>);

    impl RemotePrefixes for Remote {
        fn longest_prefix(
            &self,
            text: &[u8],
            eligible: &WorkerMask,
            _: &ChainMemo,
            guess: usize,
        ) -> PrefixMatch {
            let whole = text.len() / 128 * 128;
            let held = self
                .0
                .iter()
                .filter(|(w, _)| eligible.contains(*w) && guess <= whole);
            let matched = held
                .clone()
                .map(|(_, n)| (*n).min(whole))
                .max()
                .filter(|&m| m >= guess)
                .unwrap_or(0);
            PrefixMatch {
                matched,
                workers: held
                    .filter(|(_, n)| *n >= matched)
                    .map(|(w, _)| *w)
                    .collect(),
                stamp: 0,
            }
        }
        fn prefix_per_worker(
            &self,
            _: &[u8],
            _: &WorkerMask,
            _: &ChainMemo,
            _: &mut dyn FnMut(WorkerId, usize),
        ) {
        }
        fn learned(&self, _: &[u8], _: WorkerId, _: &ChainMemo) {}
        fn forget(&self, _: WorkerId) {}
    }

    #[test]
    fn a_diverted_hit_counts_what_the_other_replicas_hold_for_its_worker() {
        // Worker 0 holds the whole prompt here; another replica served its first 256
        // bytes to worker 1. Worker 0 is overloaded, so the pick goes to worker 1, whose
        // match is the other replica's (the first lookup, over every worker, answered
        // nothing: the tree's match was past the text's whole chunks).
        let text = [&[b'x'; 256][..], &[b'y'; 44][..]].concat();
        let mut t = RadixTree::new();
        t.insert(&text, WorkerId(0));
        let remote = Remote(vec![(WorkerId(1), 256)]);
        let memory = Memory {
            tree: &t,
            remote: Some((&remote, &ChainMemo::default())),
            tokens_per_byte: &|_| 0.25,
        };
        let r = pick_cache_aware(&params(), &text, &cands(&[5, 0]), &memory, None, &mut rng());
        assert_eq!(
            (r.worker, r.reason, r.matched),
            (Some(WorkerId(1)), Reason::HitOverloaded, 64)
        );
        // The other replica holds less than the tree's match: the first lookup answers
        // nothing, and the diverted worker's own (shorter) match is still asked for.
        let remote = Remote(vec![(WorkerId(1), 128)]);
        let memory = Memory {
            tree: &t,
            remote: Some((&remote, &ChainMemo::default())),
            tokens_per_byte: &|_| 0.25,
        };
        let short = [&[b'x'; 256][..], &[b'y'; 128][..]].concat();
        let r = pick_cache_aware(
            &params(),
            &short,
            &cands(&[5, 0]),
            &memory,
            None,
            &mut rng(),
        );
        assert_eq!(
            (r.worker, r.reason, r.matched),
            (Some(WorkerId(1)), Reason::HitOverloaded, 32)
        );
    }

    #[test]
    fn load_penalty_and_unusable_workers_are_respected() {
        let mut t = RadixTree::new();
        t.insert(PROMPT, WorkerId(0));
        let mut c = cands(&[0, 1]);
        c[0].usable = false; // e.g. at max_load or already tried
        let r = serve(&params(), PROMPT, &c, &mut t, &mut rng());
        assert_eq!((r.worker, r.reason), (Some(WorkerId(1)), Reason::Miss));
    }

    #[test]
    fn non_cache_aware_worker_gets_no_affinity() {
        let mut t = RadixTree::new();
        let mut c = cands(&[0, 5]);
        c[0].cache_aware = false;
        let r = serve(&params(), PROMPT, &c, &mut t, &mut rng());
        assert_eq!(r.worker, Some(WorkerId(0)));
        assert_eq!(
            t.node_count(),
            0,
            "nothing recorded for a non-cache-aware worker"
        );
    }

    #[test]
    fn shared_system_prompt_does_not_collapse_onto_one_worker() {
        // Every prompt shares a 2.5 KB system prompt but is otherwise new (Mooncake's
        // block 0): with default thresholds these are misses and spread by load.
        let mut t = RadixTree::new();
        let system = "s".repeat(2500);
        let mut counts = [0usize; 4];
        let mut r = rng();
        for i in 0..400 {
            let text = format!("{system} conversation {i} {}", "x".repeat(20_000));
            let c = cands(&[0, 0, 0, 0]);
            let p = serve(&params(), text.as_bytes(), &c, &mut t, &mut r);
            counts[p.worker.unwrap().0 as usize] += 1;
        }
        assert!(counts.iter().all(|n| *n > 50), "{counts:?}");
    }

    #[test]
    fn the_least_loaded_holder_is_the_same_whether_looked_up_by_id_or_by_a_pass() {
        let cand = |id: u32, load: usize, usable: bool| Candidate {
            id: WorkerId(id),
            load,
            usable,
            cache_aware: true,
            pending: 0,
        };
        let in_order: Vec<Candidate> = (0..200)
            .map(|i| cand(i, (i as usize * 7) % 5, i % 3 != 0))
            .collect();
        // A pool that lost a worker: ids no longer match positions.
        let mut gapped = in_order.clone();
        gapped.remove(40);
        let mut reversed = in_order.clone();
        reversed.reverse();
        for holders in [
            vec![1, 2, 70, 199],
            vec![0, 3, 6],
            (0..200).collect(),
            vec![41, 150],
        ] {
            let mask: WorkerMask = holders.iter().map(|&i| WorkerId(i)).collect();
            for list in [&in_order, &gapped, &reversed] {
                let by_pass = crate::policy::select::least_loaded(
                    list.iter().filter(|c| c.usable && mask.contains(c.id)),
                    Some(42),
                    &mut rng(),
                )
                .map(|c| c.id);
                // Nothing waits for a first byte: the least loaded, as before.
                let least = list
                    .iter()
                    .filter(|c| c.usable)
                    .map(|c| c.load)
                    .min()
                    .unwrap();
                let got = least_usable_holder(list, &mask, &params(), least, Some(42), &mut rng())
                    .map(|c| c.id);
                assert_eq!(got, by_pass, "holders {holders:?}");
            }
        }
    }
}

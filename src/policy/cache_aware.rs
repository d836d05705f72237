//! `cache_aware` (the default): the longest prefix match in the radix tree of what this
//! router sent where, guarded by load. It owns the tree.
//!
//! The six steps of design.md ("Pick"):
//! 1. usable = healthy ∧ breaker admits ∧ in-flight < `max_load` ∧ not tried for this
//!    request (decided by the proxy); none usable ⇒ [`Reason::NoWorker`];
//! 2. the least-loaded usable worker by `in_flight + load_penalty`, ties broken stably
//!    by the request's session or prompt digest ([`least_loaded`]);
//! 3. the prompt is prefix-matched in the tree, restricted to usable cache-aware workers;
//! 4. it is a cache hit when matched/len ≥ `threshold` or matched ≥ `match_abs_threshold`;
//! 5. …unless the cached worker's load exceeds the least-loaded one's by more than
//!    `balance_abs_threshold` AND more than `balance_rel_threshold` times
//!    ⇒ least-loaded ([`Reason::HitOverloaded`], a degradation);
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

use super::select::{CacheParams, MIN_HIT_BYTES, is_overloaded, least_loaded, usable};
use super::{Candidate, MatchUnit, Outcome, Pick, Policy, Reason, RouteRequest};
use crate::config::CacheConfig;
use crate::pool::{Pool, PoolListener, Worker, WorkerSet};
use crate::shutdown::Shutdown;
use crate::tree::{ChainMemo, PrefixMatch, RadixTree, RemotePrefixes, SharedTree, WorkerMask};

/// The `cache_aware` policy: its tree and thresholds.
pub struct CacheAware {
    params: CacheParams,
    cache: CacheConfig,
    tree: Arc<SharedTree>,
}

impl CacheAware {
    pub fn new(cache: &CacheConfig) -> Self {
        CacheAware {
            params: CacheParams::from(cache),
            cache: cache.clone(),
            tree: Arc::new(SharedTree::default()),
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

    /// The tree's decision for `req` (steps 1–6), under one short lock hold.
    pub fn decide(
        &self,
        req: &RouteRequest<'_>,
        candidates: &[Candidate],
        rng: &mut dyn RngCore,
    ) -> Pick {
        let tree = self.tree.lock();
        let remote = self.tree.remote().map(|r| (r, &req.chain));
        pick_cache_aware(
            &self.params,
            req.text(),
            candidates,
            &tree,
            remote,
            req.tie,
            rng,
        )
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
    fn worker_left(&self, worker: &Worker) {
        self.tree.lock().remove_worker(worker.id());
        if let Some(r) = self.tree.remote() {
            r.forget(worker.id());
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
        _: &WorkerSet,
        candidates: &[Candidate],
        rng: &mut dyn RngCore,
    ) -> Pick {
        self.decide(req, candidates, rng)
    }

    fn observe(&self, req: &RouteRequest<'_>, pick: &Pick, _: &Worker, outcome: Outcome) {
        if outcome == Outcome::Served {
            self.record_served(req, pick);
        }
    }

    fn tree(&self) -> Option<&Arc<SharedTree>> {
        Some(&self.tree)
    }

    fn share(&self, fleet: &Arc<crate::fleet::Fleet>) {
        self.tree
            .share(Arc::clone(fleet) as Arc<dyn crate::tree::RemotePrefixes>);
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

/// The cache-aware decision (steps 1–6 of the module docs) on `tree` and, when shared,
/// the other replicas' records (`remote`; the longer match wins, equal ones merge);
/// records nothing (the policy records the served worker in [`Policy::observe`]). `tie`
/// breaks load ties stably (see [`least_loaded`]).
pub fn pick_cache_aware(
    params: &CacheParams,
    text: &[u8],
    candidates: &[Candidate],
    tree: &RadixTree,
    remote: Option<(&dyn RemotePrefixes, &ChainMemo)>,
    tie: Option<u64>,
    rng: &mut dyn RngCore,
) -> Pick {
    let Some(least) = least_loaded(usable(candidates), tie, rng) else {
        return Pick::load_only(None, text.len());
    };
    let pick = |c: &Candidate, reason, matched, available| Pick {
        worker: Some(c.id),
        reason,
        matched,
        available,
        text_len: text.len(),
        unit: MatchUnit::Bytes,
        dp_rank: None,
        cache_aware: c.cache_aware,
        prefill_tokens: 0,
    };
    if text.is_empty() {
        return pick(least, Reason::EmptyText, 0, 0);
    }
    let eligible: WorkerMask = candidates
        .iter()
        .filter(|c| c.usable && c.cache_aware)
        .map(|c| c.id)
        .collect();
    // What any cache-aware worker holds (available), then the usable ones' match: the
    // same walk when a holder of the longest is usable (the common case).
    let all: WorkerMask = candidates
        .iter()
        .filter(|c| c.cache_aware)
        .map(|c| c.id)
        .collect();
    let held = tree.longest_prefix(text, &all);
    let usable_holders = held.workers.intersection(&eligible);
    let mut m = if usable_holders.is_empty() && held.matched > 0 {
        tree.longest_prefix(text, &eligible)
    } else {
        PrefixMatch {
            matched: held.matched,
            workers: usable_holders,
        }
    };
    if let Some((r, memo)) = remote {
        let other = r.longest_prefix(text, &eligible, memo, m.matched);
        if other.matched > m.matched {
            m = other;
        } else if other.matched == m.matched && other.matched > 0 {
            m.workers = m.workers.union(&other.workers);
        }
    }
    // The floor never exceeds the prompt: an exact repeat of a short prompt still hits.
    let is_hit = m.matched >= MIN_HIT_BYTES.min(text.len())
        && (m.matched as f64 >= params.threshold * text.len() as f64
            || (params.match_abs_threshold > 0 && m.matched >= params.match_abs_threshold));
    let cached = is_hit
        .then(|| {
            least_loaded(
                candidates
                    .iter()
                    .filter(|c| c.usable && m.workers.contains(c.id)),
                tie,
                rng,
            )
        })
        .flatten();
    let available = held.matched.max(m.matched);
    // The least-loaded worker's own match, when the pick goes there instead.
    let own = |c: &Candidate| {
        if m.workers.contains(c.id) {
            return m.matched;
        }
        let only: WorkerMask = [c.id].into_iter().collect();
        let mut n = tree.longest_prefix(text, &only).matched;
        if let Some((r, memo)) = remote {
            n = n.max(r.longest_prefix(text, &only, memo, n).matched);
        }
        n
    };
    match cached {
        Some(c) if is_overloaded(params, c.load, least.load) => {
            pick(least, Reason::HitOverloaded, own(least), available)
        }
        Some(c) => pick(c, Reason::CacheHit, m.matched, available),
        None if m.matched == 0 => pick(least, Reason::Miss, 0, available),
        None => pick(least, Reason::Miss, own(least), available),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use crate::policy::fixtures::{cands, params};
    use crate::pool::WorkerId;

    fn rng() -> StdRng {
        StdRng::seed_from_u64(7)
    }

    /// Picks, then records the prompt for the chosen worker as `observe(Served)` does.
    fn serve(
        p: &CacheParams,
        text: &[u8],
        c: &[Candidate],
        t: &mut RadixTree,
        rng: &mut StdRng,
    ) -> Pick {
        let pick = pick_cache_aware(p, text, c, t, None, None, rng);
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
        let p = pick_cache_aware(&params(), &full, &c, &t, None, None, &mut rng());
        assert_eq!((p.worker, p.reason), (Some(WorkerId(0)), Reason::CacheHit));
        assert_eq!((p.available, p.matched), (full.len(), full.len()));
        // Worker 0 unusable: available still counts what it holds; the pick goes to
        // worker 1 (holding the head) or 2 (nothing), each with its own match.
        let mut c = cands(&[0, 0, 0]);
        c[0].usable = false;
        let p = pick_cache_aware(&params(), &full, &c, &t, None, None, &mut rng());
        assert_eq!(p.available, full.len());
        let own = if p.worker == Some(WorkerId(1)) {
            head.len()
        } else {
            0
        };
        assert_eq!(p.matched, own, "{p:?}");
        // Diverted by load: the least-loaded worker 2 holds nothing.
        let c = cands(&[9, 9, 0]);
        let p = pick_cache_aware(&params(), &full, &c, &t, None, None, &mut rng());
        assert_eq!(
            (p.worker, p.reason),
            (Some(WorkerId(2)), Reason::HitOverloaded)
        );
        assert_eq!((p.available, p.matched), (full.len(), 0));
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
        assert_eq!(second.matched, PROMPT.len());
        assert_eq!(second.matched_ratio(), 1.0);
    }

    #[test]
    fn thresholds_ratio_and_absolute() {
        let mut t = RadixTree::new();
        let shared = [b'x'; 100];
        t.insert(&shared, WorkerId(0));
        let c = cands(&[0, 0]);
        let mut p = params();
        // 100 of 400 bytes = 0.25 < 0.3: a miss.
        let text = [&shared[..], &[b'y'; 300][..]].concat();
        let miss = serve(&p, &text, &c, &mut t.clone(), &mut rng());
        assert_eq!(miss.reason, Reason::Miss);
        // The absolute threshold makes it a hit.
        p.match_abs_threshold = 100;
        let hit = serve(&p, &text, &c, &mut t.clone(), &mut rng());
        assert_eq!(
            (hit.worker, hit.reason),
            (Some(WorkerId(0)), Reason::CacheHit)
        );
        // 0 disables the absolute threshold.
        p.match_abs_threshold = 0;
        let miss = serve(&p, &text, &c, &mut t.clone(), &mut rng());
        assert_eq!(miss.reason, Reason::Miss);
        // Ratio reached.
        p.threshold = 0.25;
        let hit = serve(&p, &text, &c, &mut t, &mut rng());
        assert_eq!(hit.reason, Reason::CacheHit);
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

    #[test]
    fn overloaded_hit_records_the_prompt_for_the_new_worker() {
        let mut t = RadixTree::new();
        t.insert(PROMPT, WorkerId(0));
        serve(&params(), PROMPT, &cands(&[5, 0]), &mut t, &mut rng());
        let holders = t.longest_prefix(PROMPT, &[WorkerId(0), WorkerId(1)].into_iter().collect());
        assert!(holders.workers.contains(WorkerId(1)));
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
}

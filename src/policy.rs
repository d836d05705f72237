//! Routing decisions: which worker gets a request. Pure functions: no I/O, no clocks,
//! randomness passed in.
//!
//! Cache-aware pick, the six steps of design.md ("Pick"):
//! 1. usable = healthy ∧ breaker admits ∧ in-flight < `max_load` ∧ not tried for this
//!    request; none usable ⇒ [`Reason::NoWorker`];
//! 2. the least-loaded usable worker by `in_flight + load_penalty`, ties broken at random
//!    (never by list order, which would pile ties onto the first worker);
//! 3. the prompt is prefix-matched in the tree, restricted to usable cache-aware workers;
//! 4. it is a cache hit when matched/len ≥ `threshold` or matched ≥ `match_abs_threshold`;
//! 5. …unless the cached worker's load exceeds the least-loaded one's by more than
//!    `balance_abs_threshold` AND more than `balance_rel_threshold` times
//!    ⇒ least-loaded ([`Reason::HitOverloaded`], a degradation);
//! 6. otherwise least-loaded ([`Reason::Miss`], or [`Reason::EmptyText`] for an empty
//!    prompt); the prompt is inserted for the chosen worker so that the next request
//!    with the same prefix follows it.
//!
//! The balance guard compares against the least-loaded worker (as SGLang's cache-aware
//! policy does with its `balance_abs_threshold`/`balance_rel_threshold`), which keeps a
//! trace whose every prompt shares one system prompt from collapsing onto one replica.

use rand::Rng;

use crate::config::CacheConfig;
use crate::tree::{RadixTree, WorkerId, WorkerMask};

/// Shortest match that counts as a hit, in bytes (unless it is the whole prompt): about
/// one KV block (vLLM's default block is 16 tokens, ~4 bytes of English each). An engine
/// reuses only whole blocks, so a shorter partial match saves nothing; without this floor
/// every short prompt would "hit" on its role header (`user: `) alone.
pub const MIN_HIT_BYTES: usize = 64;

/// Why a worker was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// Followed prefix affinity.
    CacheHit,
    /// A hit sent to the least-loaded worker instead (a degradation).
    HitOverloaded,
    /// No sufficient prefix match (or a load-only policy): least-loaded.
    Miss,
    /// Nothing to match on: least-loaded.
    EmptyText,
    /// No usable worker.
    NoWorker,
}

impl Reason {
    /// Label used in logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::CacheHit => "cache_hit",
            Reason::HitOverloaded => "hit_overloaded",
            Reason::Miss => "miss",
            Reason::EmptyText => "empty_text",
            Reason::NoWorker => "no_worker",
        }
    }
}

/// A worker as the policy sees it at decision time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    pub id: WorkerId,
    /// `in_flight + load_penalty`.
    pub load: usize,
    /// Step 1's filter, evaluated by the caller (health, breaker, max_load, tried).
    pub usable: bool,
    /// Whether prefix affinity applies to this worker.
    pub cache_aware: bool,
}

/// A decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pick {
    /// The chosen worker; `None` only with [`Reason::NoWorker`].
    pub worker: Option<WorkerId>,
    pub reason: Reason,
    /// Prefix matched on the chosen side: bytes of routing text in the tree (0 for
    /// load-only policies), or prompt tokens in precise mode (see `unit`).
    pub matched: usize,
    /// Length of what was matched against, in the same unit.
    pub text_len: usize,
    /// What `matched` and `text_len` count.
    pub unit: MatchUnit,
    /// The engine's data-parallel rank to send the request to (vLLM's
    /// `X-data-parallel-rank` header), when precise mode knows the rank holding the
    /// prefix; `None` lets the engine balance its ranks.
    pub dp_rank: Option<u32>,
}

/// The unit of [`Pick::matched`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatchUnit {
    /// Bytes of routing text (the approximate tree).
    Bytes,
    /// Prompt tokens in whole KV blocks (precise mode).
    Tokens,
}

impl Pick {
    /// matched / text length, 0 when the text is empty.
    pub fn matched_ratio(&self) -> f64 {
        if self.text_len == 0 {
            0.0
        } else {
            self.matched as f64 / self.text_len as f64
        }
    }

    /// Prefix tokens the chosen worker is expected to reuse: exact in precise mode,
    /// matched bytes / 4 (about 4 bytes of English per token) for the tree.
    pub fn saved_tokens(&self) -> u64 {
        match self.unit {
            MatchUnit::Bytes => self.matched as u64 / 4,
            MatchUnit::Tokens => self.matched as u64,
        }
    }

    fn load_only(worker: Option<WorkerId>, text_len: usize) -> Pick {
        Pick {
            worker,
            reason: if worker.is_some() {
                Reason::Miss
            } else {
                Reason::NoWorker
            },
            matched: 0,
            text_len,
            unit: MatchUnit::Bytes,
            dp_rank: None,
        }
    }
}

/// The thresholds of steps 4 and 5 (from `cache:`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CacheParams {
    pub threshold: f64,
    pub match_abs_threshold: usize,
    pub balance_abs_threshold: usize,
    pub balance_rel_threshold: f64,
}

impl From<&CacheConfig> for CacheParams {
    fn from(c: &CacheConfig) -> Self {
        CacheParams {
            threshold: c.threshold,
            match_abs_threshold: c.match_abs_threshold,
            balance_abs_threshold: c.balance_abs_threshold,
            balance_rel_threshold: c.balance_rel_threshold,
        }
    }
}

/// The cache-aware pick (steps 1–6 of the module docs). When `record` is true, inserts
/// `text` into `tree` for the chosen worker (if that worker is cache-aware and the text
/// is not empty); an eviction pass in progress passes false.
pub fn pick_cache_aware(
    params: &CacheParams,
    text: &[u8],
    candidates: &[Candidate],
    tree: &mut RadixTree,
    record: bool,
    rng: &mut impl Rng,
) -> Pick {
    let Some(least) = least_loaded(candidates.iter().filter(|c| c.usable), rng) else {
        return Pick::load_only(None, text.len());
    };
    if text.is_empty() {
        return Pick {
            worker: Some(least.id),
            reason: Reason::EmptyText,
            matched: 0,
            text_len: 0,
            unit: MatchUnit::Bytes,
            dp_rank: None,
        };
    }
    let eligible: WorkerMask = candidates
        .iter()
        .filter(|c| c.usable && c.cache_aware)
        .map(|c| c.id)
        .collect();
    let m = tree.longest_prefix(text, &eligible);
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
                rng,
            )
        })
        .flatten();
    let (chosen, reason) = match cached {
        Some(c) if is_overloaded(params, c.load, least.load) => (least, Reason::HitOverloaded),
        Some(c) => (c, Reason::CacheHit),
        None => (least, Reason::Miss),
    };
    if record && chosen.cache_aware {
        tree.insert(text, chosen.id);
    }
    Pick {
        worker: Some(chosen.id),
        reason,
        matched: m.matched,
        text_len: text.len(),
        unit: MatchUnit::Bytes,
        dp_rank: None,
    }
}

/// Step 5: whether `cached` load is too far above the least `load` to follow affinity.
pub(crate) fn is_overloaded(p: &CacheParams, cached: usize, least: usize) -> bool {
    cached > least + p.balance_abs_threshold
        && cached as f64 > least as f64 * p.balance_rel_threshold
}

/// Least-loaded of `candidates`, uniformly random among ties.
pub(crate) fn least_loaded<'a>(
    candidates: impl Iterator<Item = &'a Candidate>,
    rng: &mut impl Rng,
) -> Option<&'a Candidate> {
    let mut best: Option<&Candidate> = None;
    let mut ties = 0u32;
    for c in candidates {
        match best {
            Some(b) if c.load > b.load => {}
            Some(b) if c.load == b.load => {
                // Reservoir sampling: each of the k ties ends up chosen with p = 1/k.
                ties += 1;
                if rng.random_range(0..ties) == 0 {
                    best = Some(c);
                }
            }
            _ => {
                best = Some(c);
                ties = 1;
            }
        }
    }
    best
}

/// `least_load` baseline: the least-loaded usable worker, random among ties.
pub fn pick_least_load(candidates: &[Candidate], text_len: usize, rng: &mut impl Rng) -> Pick {
    let w = least_loaded(candidates.iter().filter(|c| c.usable), rng).map(|c| c.id);
    Pick::load_only(w, text_len)
}

/// `round_robin` baseline: the usable workers in turn; `ticket` is a per-set counter
/// the caller increments once per request.
pub fn pick_round_robin(candidates: &[Candidate], text_len: usize, ticket: usize) -> Pick {
    let usable = candidates.iter().filter(|c| c.usable).count();
    let w = (usable > 0)
        .then(|| candidates.iter().filter(|c| c.usable).nth(ticket % usable))
        .flatten()
        .map(|c| c.id);
    Pick::load_only(w, text_len)
}

/// `random` baseline: a uniformly random usable worker.
pub fn pick_random(candidates: &[Candidate], text_len: usize, rng: &mut impl Rng) -> Pick {
    let usable = candidates.iter().filter(|c| c.usable).count();
    let w = (usable > 0)
        .then(|| {
            candidates
                .iter()
                .filter(|c| c.usable)
                .nth(rng.random_range(0..usable))
        })
        .flatten()
        .map(|c| c.id);
    Pick::load_only(w, text_len)
}

/// Shared test inputs for the pick functions (here and in `precise::score`).
#[cfg(test)]
pub(crate) mod fixtures {
    use super::{CacheParams, Candidate};
    use crate::tree::WorkerId;

    /// The design.md defaults.
    pub(crate) fn params() -> CacheParams {
        CacheParams {
            threshold: 0.3,
            match_abs_threshold: 8192,
            balance_abs_threshold: 2,
            balance_rel_threshold: 1.5,
        }
    }

    /// Usable cache-aware workers with these loads, ids in order.
    pub(crate) fn cands(loads: &[usize]) -> Vec<Candidate> {
        loads
            .iter()
            .enumerate()
            .map(|(i, &load)| Candidate {
                id: WorkerId(i as u32),
                load,
                usable: true,
                cache_aware: true,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::fixtures::{cands, params};

    fn rng() -> StdRng {
        StdRng::seed_from_u64(7)
    }

    const PROMPT: &[u8] = b"system: You are a helpful assistant.\nuser: summarise this document";

    #[test]
    fn no_usable_worker() {
        let mut t = RadixTree::new();
        let mut c = cands(&[0, 0]);
        for x in &mut c {
            x.usable = false;
        }
        let p = pick_cache_aware(&params(), PROMPT, &c, &mut t, true, &mut rng());
        assert_eq!((p.worker, p.reason), (None, Reason::NoWorker));
        assert_eq!(
            pick_cache_aware(&params(), PROMPT, &[], &mut t, true, &mut rng()).reason,
            Reason::NoWorker
        );
        assert_eq!(pick_round_robin(&c, 0, 3).reason, Reason::NoWorker);
        assert_eq!(pick_random(&c, 0, &mut rng()).reason, Reason::NoWorker);
        assert_eq!(pick_least_load(&[], 0, &mut rng()).reason, Reason::NoWorker);
        assert_eq!(t.node_count(), 0);
    }

    #[test]
    fn empty_text_goes_least_loaded_without_insert() {
        let mut t = RadixTree::new();
        let p = pick_cache_aware(&params(), b"", &cands(&[3, 1, 2]), &mut t, true, &mut rng());
        assert_eq!((p.worker, p.reason), (Some(WorkerId(1)), Reason::EmptyText));
        assert_eq!(t.node_count(), 0);
    }

    #[test]
    fn miss_then_hit_follows_the_prefix() {
        let mut t = RadixTree::new();
        let c = cands(&[1, 0, 1]);
        let first = pick_cache_aware(&params(), PROMPT, &c, &mut t, true, &mut rng());
        assert_eq!(
            (first.worker, first.reason),
            (Some(WorkerId(1)), Reason::Miss)
        );
        // Now worker 1 is busier than 0 but within the balance margins.
        let c = cands(&[0, 2, 0]);
        let second = pick_cache_aware(&params(), PROMPT, &c, &mut t, true, &mut rng());
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
        let miss = pick_cache_aware(&p, &text, &c, &mut t.clone(), true, &mut rng());
        assert_eq!(miss.reason, Reason::Miss);
        // The absolute threshold makes it a hit.
        p.match_abs_threshold = 100;
        let hit = pick_cache_aware(&p, &text, &c, &mut t.clone(), true, &mut rng());
        assert_eq!(
            (hit.worker, hit.reason),
            (Some(WorkerId(0)), Reason::CacheHit)
        );
        // 0 disables the absolute threshold.
        p.match_abs_threshold = 0;
        let miss = pick_cache_aware(&p, &text, &c, &mut t.clone(), true, &mut rng());
        assert_eq!(miss.reason, Reason::Miss);
        // Ratio reached.
        p.threshold = 0.25;
        let hit = pick_cache_aware(&p, &text, &c, &mut t, true, &mut rng());
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
        let r = pick_cache_aware(
            &params(),
            b"user: hi\n",
            &cands(&[1, 0]),
            &mut t,
            true,
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
        let r = pick_cache_aware(
            &p,
            PROMPT,
            &cands(&[3, 0]),
            &mut t.clone(),
            true,
            &mut rng(),
        );
        assert_eq!(
            (r.worker, r.reason),
            (Some(WorkerId(1)), Reason::HitOverloaded)
        );
        // 2 vs 0: abs margin not exceeded ⇒ hit.
        let r = pick_cache_aware(
            &p,
            PROMPT,
            &cands(&[2, 0]),
            &mut t.clone(),
            true,
            &mut rng(),
        );
        assert_eq!(r.reason, Reason::CacheHit);
        // 14 vs 10: abs exceeded (4 > 2) but 14 < 15 = 10 × 1.5 ⇒ hit.
        let r = pick_cache_aware(
            &p,
            PROMPT,
            &cands(&[14, 10]),
            &mut t.clone(),
            true,
            &mut rng(),
        );
        assert_eq!(r.reason, Reason::CacheHit);
        // 16 vs 10: both exceeded ⇒ overloaded.
        let r = pick_cache_aware(&p, PROMPT, &cands(&[16, 10]), &mut t, true, &mut rng());
        assert_eq!(
            (r.worker, r.reason),
            (Some(WorkerId(1)), Reason::HitOverloaded)
        );
    }

    #[test]
    fn overloaded_hit_records_the_prompt_for_the_new_worker() {
        let mut t = RadixTree::new();
        t.insert(PROMPT, WorkerId(0));
        pick_cache_aware(&params(), PROMPT, &cands(&[5, 0]), &mut t, true, &mut rng());
        let holders = t.longest_prefix(PROMPT, &[WorkerId(0), WorkerId(1)].into_iter().collect());
        assert!(holders.workers.contains(WorkerId(1)));
    }

    #[test]
    fn load_penalty_and_unusable_workers_are_respected() {
        let mut t = RadixTree::new();
        t.insert(PROMPT, WorkerId(0));
        let mut c = cands(&[0, 1]);
        c[0].usable = false; // e.g. at max_load or already tried
        let r = pick_cache_aware(&params(), PROMPT, &c, &mut t, true, &mut rng());
        assert_eq!((r.worker, r.reason), (Some(WorkerId(1)), Reason::Miss));
    }

    #[test]
    fn non_cache_aware_worker_gets_no_affinity() {
        let mut t = RadixTree::new();
        let mut c = cands(&[0, 5]);
        c[0].cache_aware = false;
        let r = pick_cache_aware(&params(), PROMPT, &c, &mut t, true, &mut rng());
        assert_eq!(r.worker, Some(WorkerId(0)));
        assert_eq!(
            t.node_count(),
            0,
            "nothing recorded for a non-cache-aware worker"
        );
    }

    #[test]
    fn ties_are_broken_at_random_not_by_list_order() {
        let c = cands(&[0, 0, 0, 0]);
        let mut r = rng();
        let mut seen = [0usize; 4];
        for _ in 0..4000 {
            let mut t = RadixTree::new();
            let p = pick_cache_aware(&params(), b"", &c, &mut t, true, &mut r);
            seen[p.worker.unwrap().0 as usize] += 1;
        }
        for n in seen {
            assert!((800..1200).contains(&n), "{seen:?}");
        }
        let mut seen = [0usize; 4];
        for _ in 0..4000 {
            seen[pick_least_load(&c, 0, &mut r).worker.unwrap().0 as usize] += 1;
        }
        assert!(seen.iter().all(|n| (800..1200).contains(n)), "{seen:?}");
    }

    #[test]
    fn baselines() {
        let mut c = cands(&[5, 0, 3]);
        let order: Vec<_> = (0..6)
            .map(|t| pick_round_robin(&c, 0, t).worker.unwrap().0)
            .collect();
        assert_eq!(order, [0, 1, 2, 0, 1, 2]);
        c[1].usable = false;
        let order: Vec<_> = (0..4)
            .map(|t| pick_round_robin(&c, 0, t).worker.unwrap().0)
            .collect();
        assert_eq!(order, [0, 2, 0, 2]);
        assert_eq!(pick_least_load(&c, 0, &mut rng()).worker, Some(WorkerId(2)));
        for _ in 0..50 {
            assert_ne!(pick_random(&c, 0, &mut rng()).worker, Some(WorkerId(1)));
        }
        assert_eq!(pick_least_load(&c, 9, &mut rng()).reason, Reason::Miss);
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
            let p = pick_cache_aware(&params(), text.as_bytes(), &c, &mut t, true, &mut r);
            counts[p.worker.unwrap().0 as usize] += 1;
        }
        assert!(counts.iter().all(|n| *n > 50), "{counts:?}");
    }
}

//! The precise pick: matched KV blocks per worker -> uncached prefill tokens -> a
//! worker. Pure: no I/O, no clock, randomness passed in.
//!
//! 1. usable workers as in the approximate pick (none ⇒ [`Reason::NoWorker`]); the
//!    least-loaded one as there: within the load guard of the pool's least
//!    `in_flight + load_penalty`, the fewest requests waiting for their first byte, then
//!    the least loaded ([`crate::policy::select::least_queued`]), ties broken stably (`tie`);
//! 2. each usable cache-aware worker with a scorable feed has a matched run of the
//!    request's full blocks (a worker with several DP ranks: the longest run of its
//!    live ranks, an optimistic figure; see [`super`]); a worker without one (no feed,
//!    every rank replaying or stale) scores neutral: nothing matched, no preference
//!    either way;
//! 3. its cost is the prompt's uncached prefill: `prompt_tokens - matched_blocks ×
//!    block_size`, where a block held only off the GPU counts at its tier's weight
//!    (`precise.tier_weights`: a CPU block 0.8 of a GPU block by default, since it must
//!    be loaded first); the lowest cost wins, ties to the least loaded as in step 1,
//!    then at random;
//! 4. the same balance guard as the approximate mode: the winner's load may exceed the
//!    pool's least load by at most `balance_abs_threshold` or `balance_rel_threshold`
//!    times, else the least-loaded worker of step 1 ([`Reason::HitOverloaded`]);
//! 5. no block matched anywhere ⇒ least-loaded ([`Reason::Miss`]).
//!
//! One whole block is the smallest saving an engine can make, so any match counts
//! (the approximate mode's `threshold` and `match_abs_threshold` guess at that from
//! bytes; here it is known).

use rand::RngCore;

use crate::policy::select::{is_overloaded, least_queued_or_loaded, usable};
use crate::policy::{CacheParams, Candidate, MatchUnit, Pick, Reason};

/// A candidate's matched run: its blocks in any tier, and their worth in GPU blocks
/// (each block at its tier's weight, see [`crate::precise::tiers::Run::credit`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Matched {
    pub blocks: usize,
    pub credit: f64,
}

impl Matched {
    /// A run of `blocks` GPU blocks.
    pub fn gpu(blocks: usize) -> Matched {
        Matched {
            blocks,
            credit: blocks as f64,
        }
    }
}

/// Credits closer than this are equal (sums of weights of up to 2^18 blocks).
const CREDIT_EPSILON: f64 = 1e-6;

/// Picks a worker; `matched[i]` is candidate i's matched run (`None` = neutral).
/// `prompt_tokens` counts every token of the request, `block_size` is tokens per block.
pub fn pick_precise(
    params: &CacheParams,
    candidates: &[Candidate],
    matched: &[Option<Matched>],
    prompt_tokens: usize,
    block_size: usize,
    tie: Option<u64>,
    rng: &mut dyn RngCore,
) -> Pick {
    let run = |i: usize| matched.get(i).copied().flatten().unwrap_or_default();
    let tokens = |i: usize| (run(i).blocks * block_size).min(prompt_tokens);
    // Held by any cache-aware worker, usable or not, in any tier.
    let available = candidates
        .iter()
        .enumerate()
        .filter(|(_, c)| c.cache_aware)
        .map(|(i, _)| tokens(i))
        .max()
        .unwrap_or(0);
    let own = |worker: Option<&Candidate>| {
        worker
            .and_then(|w| candidates.iter().position(|c| c.id == w.id))
            .map_or(0, tokens)
    };
    let pick = |worker: Option<&Candidate>, reason, matched_tokens: usize| Pick {
        worker: worker.map(|c| c.id),
        reason,
        matched: matched_tokens,
        available,
        text_len: prompt_tokens,
        unit: MatchUnit::Tokens,
        dp_rank: None,
        cache_aware: worker.is_some_and(|c| c.cache_aware),
        prefill_tokens: prompt_tokens.saturating_sub(matched_tokens) as u64,
        mark: crate::tree::Mark::default(),
    };
    let Some(least_load) = usable(candidates).map(|c| c.load).min() else {
        return pick(None, Reason::NoWorker, 0);
    };
    let Some(least) = least_queued_or_loaded(|| usable(candidates), params, least_load, tie, rng)
    else {
        return pick(None, Reason::NoWorker, 0);
    };
    let scored = || {
        candidates
            .iter()
            .enumerate()
            .filter(|(_, c)| c.usable && c.cache_aware)
    };
    let best = scored().map(|(i, _)| run(i).credit).fold(0.0, f64::max);
    if best < CREDIT_EPSILON {
        return pick(Some(least), Reason::Miss, own(Some(least)));
    }
    let cached = least_queued_or_loaded(
        || {
            scored()
                .filter(|(i, _)| run(*i).credit >= best - CREDIT_EPSILON)
                .map(|(_, c)| c)
        },
        params,
        least_load,
        tie,
        rng,
    );
    match cached {
        Some(c) if is_overloaded(params, c.load, least_load) => {
            pick(Some(least), Reason::HitOverloaded, own(Some(least)))
        }
        Some(c) => pick(Some(c), Reason::CacheHit, own(Some(c))),
        None => pick(Some(least), Reason::Miss, own(Some(least))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pools::pool::WorkerId;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use crate::policy::fixtures::{cands, params};

    fn gpu(blocks: &[Option<usize>]) -> Vec<Option<Matched>> {
        blocks.iter().map(|b| b.map(Matched::gpu)).collect()
    }

    fn pick(loads: &[usize], matched: &[Option<usize>]) -> Pick {
        pick_precise(
            &params(),
            &cands(loads),
            &gpu(matched),
            100,
            16,
            None,
            &mut StdRng::seed_from_u64(3),
        )
    }

    #[test]
    fn most_matched_blocks_win_and_report_tokens() {
        let p = pick(&[0, 1, 0], &[Some(1), Some(4), Some(2)]);
        assert_eq!((p.worker, p.reason), (Some(WorkerId(1)), Reason::CacheHit));
        assert_eq!((p.matched, p.text_len, p.saved_tokens()), (64, 100, 64));
    }

    #[test]
    fn nothing_matched_or_all_neutral_goes_least_loaded() {
        let p = pick(&[2, 1, 3], &[Some(0), None, Some(0)]);
        assert_eq!((p.worker, p.reason), (Some(WorkerId(1)), Reason::Miss));
        let p = pick(&[2, 1, 3], &[None, None, None]);
        assert_eq!(p.reason, Reason::Miss);
    }

    #[test]
    fn the_balance_guard_overrides_a_hit() {
        let p = pick(&[3, 0], &[Some(5), Some(0)]);
        assert_eq!(
            (p.worker, p.reason),
            (Some(WorkerId(1)), Reason::HitOverloaded)
        );
        let p = pick(&[2, 0], &[Some(5), Some(0)]);
        assert_eq!((p.worker, p.reason), (Some(WorkerId(0)), Reason::CacheHit));
    }

    #[test]
    fn equal_costs_go_to_the_less_loaded_then_at_random() {
        let p = pick(&[2, 1, 0], &[Some(3), Some(3), Some(1)]);
        assert_eq!(p.worker, Some(WorkerId(1)));
        let mut seen = [0; 2];
        let mut rng = StdRng::seed_from_u64(9);
        for _ in 0..200 {
            let p = pick_precise(
                &params(),
                &cands(&[1, 1]),
                &gpu(&[Some(2), Some(2)]),
                100,
                16,
                None,
                &mut rng,
            );
            seen[p.worker.unwrap().0 as usize] += 1;
        }
        assert!(seen[0] > 50 && seen[1] > 50, "{seen:?}");
    }

    #[test]
    fn the_least_loaded_is_the_fewest_waiting_for_a_first_token_within_the_guard() {
        let with = |loads: &[usize], pending: &[usize]| {
            let mut c = cands(loads);
            for (c, &p) in c.iter_mut().zip(pending) {
                c.pending = p;
            }
            c
        };
        let run = |c: &[Candidate], m: &[Option<usize>]| {
            let p = pick_precise(
                &params(),
                c,
                &gpu(m),
                100,
                16,
                None,
                &mut StdRng::seed_from_u64(5),
            );
            (p.worker, p.reason)
        };
        // A miss: worker 1 has more in flight, but none of it waits for a first token.
        let c = with(&[1, 2, 1], &[1, 0, 1]);
        assert_eq!(run(&c, &[None; 3]), (Some(WorkerId(1)), Reason::Miss));
        // Equal matches: the holder with nothing waiting, though it runs more.
        assert_eq!(
            run(&c, &[Some(3), Some(3), Some(0)]),
            (Some(WorkerId(1)), Reason::CacheHit)
        );
        // Past the guard (5 > 1 + 2 and 5 > 1.5 × 1) an idle queue does not count: the
        // fewest in flight again.
        let c = with(&[1, 5, 2], &[1, 0, 1]);
        assert_eq!(run(&c, &[None; 3]), (Some(WorkerId(0)), Reason::Miss));
        // The guard still measures a hit against the pool's least load.
        assert_eq!(
            run(&c, &[Some(0), Some(4), Some(0)]),
            (Some(WorkerId(0)), Reason::HitOverloaded)
        );
    }

    #[test]
    fn a_host_tier_run_scores_at_its_weight() {
        let cpu = |blocks: usize| {
            Some(Matched {
                blocks,
                credit: blocks as f64 * 0.8,
            })
        };
        let run = |loads: &[usize], m: &[Option<Matched>]| {
            pick_precise(
                &params(),
                &cands(loads),
                m,
                100,
                16,
                None,
                &mut StdRng::seed_from_u64(3),
            )
        };
        // The same 4 blocks on the CPU of worker 0 and the GPU of worker 1: the GPU's,
        // although its worker is busier.
        let p = run(&[0, 1], &[cpu(4), Some(Matched::gpu(4))]);
        assert_eq!(
            (p.worker, p.reason, p.matched),
            (Some(WorkerId(1)), Reason::CacheHit, 64)
        );
        // Alone, the CPU's copy is a hit, all its tokens predicted cached.
        let p = run(&[1, 0], &[cpu(4), Some(Matched::gpu(0))]);
        assert_eq!(
            (p.worker, p.reason, p.matched),
            (Some(WorkerId(0)), Reason::CacheHit, 64)
        );
        assert_eq!(p.available, 64);
        // 5 CPU blocks (worth 4) against 3 GPU blocks: the CPU's.
        let p = run(&[0, 0], &[cpu(5), Some(Matched::gpu(3))]);
        assert_eq!((p.worker, p.matched), (Some(WorkerId(0)), 80));
        // A tier weighted 0: held, not credited.
        let zero = Some(Matched {
            blocks: 4,
            credit: 0.0,
        });
        let p = run(&[1, 0], &[zero, Some(Matched::gpu(0))]);
        assert_eq!(
            (p.worker, p.reason, p.available),
            (Some(WorkerId(1)), Reason::Miss, 64)
        );
    }

    #[test]
    fn unusable_and_non_cache_aware_workers_are_not_followed() {
        let mut c = cands(&[0, 0, 0]);
        c[0].usable = false;
        c[1].cache_aware = false;
        let p = pick_precise(
            &params(),
            &c,
            &gpu(&[Some(9), Some(9), Some(1)]),
            100,
            16,
            None,
            &mut StdRng::seed_from_u64(1),
        );
        assert_eq!((p.worker, p.reason), (Some(WorkerId(2)), Reason::CacheHit));
        for x in &mut c {
            x.usable = false;
        }
        let p = pick_precise(
            &params(),
            &c,
            &[],
            100,
            16,
            None,
            &mut StdRng::seed_from_u64(1),
        );
        assert_eq!((p.worker, p.reason), (None, Reason::NoWorker));
    }
}

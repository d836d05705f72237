//! Selection rules every policy shares: the least-loaded worker with stable ties, and
//! the overload guard that keeps affinity from piling onto one worker.

use rand::{Rng, RngCore};

use super::Candidate;
use crate::config::CacheConfig;
use crate::tree::Mark;

/// The thresholds of the cache/load trade-off (from `cache:`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CacheParams {
    pub threshold: f64,
    pub match_abs_threshold: usize,
    pub balance_abs_threshold: usize,
    pub balance_rel_threshold: f64,
    pub balance_match_threshold: usize,
    /// Tokens per KV block of the engines (`cache.engine_block_tokens`).
    pub block_tokens: usize,
}

impl From<&CacheConfig> for CacheParams {
    fn from(c: &CacheConfig) -> Self {
        CacheParams {
            threshold: c.threshold,
            match_abs_threshold: c.match_abs_threshold,
            balance_abs_threshold: c.balance_abs_threshold,
            balance_rel_threshold: c.balance_rel_threshold,
            balance_match_threshold: c.balance_match_threshold,
            block_tokens: c.engine_block_tokens.max(1),
        }
    }
}

/// How a match in bytes of routing text becomes what the engine will serve from its KV
/// cache: tokens at the worker's learned tokens per byte (`pool::prefill`, 0.25 until
/// its answers teach it), rounded down to whole blocks of `block_tokens`. vLLM's and
/// SGLang's prefix caches reuse whole blocks only (a block's hash covers all its
/// tokens), so a match shorter than one block saves nothing: it is a miss.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockScale {
    pub tokens_per_byte: f64,
    pub block_tokens: usize,
}

impl BlockScale {
    /// Tokens of `bytes` of routing text in whole blocks (0 under one block).
    pub fn tokens(&self, bytes: usize) -> usize {
        let b = self.block_tokens.max(1);
        let t = (bytes as f64 * self.tokens_per_byte.max(0.0)) as usize;
        t / b * b
    }

    /// Bytes of routing text that those whole blocks cover (≤ `bytes`).
    pub fn aligned_bytes(&self, bytes: usize) -> usize {
        let t = self.tokens(bytes);
        if t == 0 || self.tokens_per_byte <= 0.0 {
            return 0;
        }
        ((t as f64 / self.tokens_per_byte) as usize).min(bytes)
    }

    /// Bytes of routing text in one whole block (at least 1).
    pub fn block_bytes(&self) -> usize {
        if self.tokens_per_byte <= 0.0 {
            return usize::MAX;
        }
        ((self.block_tokens.max(1) as f64 / self.tokens_per_byte).ceil() as usize).max(1)
    }

    /// Tokens of a `bytes`-long text, unrounded (at least 1 when not empty).
    pub fn text_tokens(&self, bytes: usize) -> usize {
        if bytes == 0 {
            return 0;
        }
        ((bytes as f64 * self.tokens_per_byte).round() as usize).max(1)
    }
}

/// Whether `cached` load is too far above the `least` load to follow affinity: more
/// than `balance_abs_threshold` above AND more than `balance_rel_threshold` times (the
/// rule of SGLang's cache-aware policy).
pub fn is_overloaded(p: &CacheParams, cached: usize, least: usize) -> bool {
    cached > least + p.balance_abs_threshold
        && cached as f64 > least as f64 * p.balance_rel_threshold
}

/// The load gap, in requests, a hit may carry over the least-loaded worker when moving
/// it would make that worker recompute `share` (0–1) of the prompt:
/// `balance_abs_threshold` + `balance_match_threshold` × `share`. A diversion costs the
/// recompute for this request, and (on a prefix few requests share) splits the later
/// readers' cache between two workers; under load the hits kept are prefill work the
/// pool never does. Measured (`simulate`, three engine physics, shared documents read
/// by several sessions): 0.70 → 0.77 of prompt tokens from cache, TTFT better too;
/// 64 is where the gain levels off (16: 0.74, 32: 0.77 on some traces only).
pub fn hold_margin(p: &CacheParams, share: f64) -> usize {
    let extra = p.balance_match_threshold as f64 * share.clamp(0.0, 1.0);
    p.balance_abs_threshold.saturating_add(extra as usize)
}

/// Whether a prefix last used `age` records ago and held by `holders` of `workers`
/// workers draws more of the pool's traffic than its holders' share: about one
/// request in `age + 1` goes through it, against `holders / workers`. Such a prefix
/// (a hot system prompt) must spread to more workers or its holders queue, so it gets
/// no [`hold_margin`]: the usual guard moves it, and the worker it moves to holds it
/// from then on.
pub fn outgrows_holders(age: u64, holders: usize, workers: usize) -> bool {
    (age.saturating_add(1)).saturating_mul(holders.max(1) as u64) < workers as u64
}

/// The [`super::Pick::mark`] of a hit whose match ended at `mark`
/// ([`crate::tree::Lookup::mark`]), with the tree's clock at `clock` and `in_flight`
/// requests running in the pool: `mark` taken as evidence ([`Mark::evidence`]) unless
/// fewer than 2 × `in_flight` records were made since its end was last used. The
/// request that made it may then still be running: an engine never evicts a running
/// request's blocks, and may not have cached them yet (the router records a prefix at
/// the response head, which vLLM sends before the prefill ends), so a short answer
/// would be the engine catching up, not an eviction nor a record it cannot serve. By
/// Little's law the pool's last `in_flight` records are about the requests still
/// running; twice that is the margin.
pub fn eviction_evidence(mark: Mark, clock: u64, in_flight: usize) -> Mark {
    Mark {
        evidence: mark.is_some() && clock.saturating_sub(mark.used) >= 2 * in_flight as u64,
        ..mark
    }
}

/// Least-loaded of `candidates`. Ties go by `tie` when given (the session key or the
/// prompt digest, hashed with each tied worker's id: the same key picks the same worker
/// among the same ties, so one client's paced requests do not bounce), uniformly at
/// random otherwise (never by list order, which would pile ties onto the first worker).
pub fn least_loaded<'a>(
    candidates: impl Iterator<Item = &'a Candidate>,
    tie: Option<u64>,
    rng: &mut dyn RngCore,
) -> Option<&'a Candidate> {
    least_by(candidates, |c| (c.load, 0), tie, rng)
}

/// Of `candidates` within the load guard of the pool's `least_load` (not
/// [`is_overloaded`] against it), the one with the fewest requests waiting for their
/// first byte, then the least loaded; ties as in [`least_loaded`]. `None` when none is
/// within the guard.
///
/// Why: what delays a new request's first token is the prefill queued ahead of it, not
/// the requests already decoding; the in-flight count mixes both. Measured (`simulate`
/// and sim-engine, serial, shared and chunked-prefill engines): hot system prompts'
/// TTFT p99 −23 to −32 %, shared documents' hit rate equal or higher; see the book's
/// performance page. The guard bounds how far in-flight counts may drift apart for it
/// (decoders slow a real engine's steps).
pub fn least_queued<'a>(
    candidates: impl Iterator<Item = &'a Candidate>,
    p: &CacheParams,
    least_load: usize,
    tie: Option<u64>,
    rng: &mut dyn RngCore,
) -> Option<&'a Candidate> {
    least_by(
        candidates.filter(|c| !is_overloaded(p, c.load, least_load)),
        |c| (c.pending, c.load),
        tie,
        rng,
    )
}

/// [`least_queued`] of the candidates `of` yields, else (none within the load guard)
/// [`least_loaded`] of them: the least-loaded worker as both cache-aware picks take it.
/// `of` is called again for the second pass, so the list need not be collected.
pub fn least_queued_or_loaded<'a, I: Iterator<Item = &'a Candidate>>(
    of: impl Fn() -> I,
    p: &CacheParams,
    least_load: usize,
    tie: Option<u64>,
    rng: &mut dyn RngCore,
) -> Option<&'a Candidate> {
    least_queued(of(), p, least_load, tie, rng).or_else(|| least_loaded(of(), tie, rng))
}

/// The candidate with the least `key`, ties broken as [`least_loaded`] says.
fn least_by<'a>(
    candidates: impl Iterator<Item = &'a Candidate>,
    key: impl Fn(&Candidate) -> (usize, usize),
    tie: Option<u64>,
    rng: &mut dyn RngCore,
) -> Option<&'a Candidate> {
    let mut best: Option<(&Candidate, (usize, usize))> = None;
    // The best's rendezvous rank, worked out at its first tie only.
    let mut best_rank: Option<u64> = None;
    let mut ties = 0u32;
    for c in candidates {
        let k = key(c);
        match best {
            Some((_, bk)) if k > bk => {}
            Some((b, bk)) if k == bk => match tie {
                Some(t) => {
                    let held = *best_rank.get_or_insert_with(|| tie_rank(t, b));
                    let rank = tie_rank(t, c);
                    if rank > held {
                        best = Some((c, k));
                        best_rank = Some(rank);
                    }
                }
                None => {
                    // Reservoir sampling: each of the k ties ends up chosen with p = 1/k.
                    ties += 1;
                    if rng.random_range(0..ties) == 0 {
                        best = Some((c, k));
                    }
                }
            },
            _ => {
                best = Some((c, k));
                best_rank = None;
                ties = 1;
            }
        }
    }
    best.map(|(c, _)| c)
}

/// Rendezvous weight of `c` for `key` (highest wins): SplitMix64's finalizer (Steele,
/// Lea, Flood 2014) of the key xor the worker id times the golden ratio. A bijection for
/// a given key, so two workers never tie, and a few multiplies where a seeded xxh3 of
/// the id cost several times more: a tie among 1,000 idle workers ranks each of them,
/// twice per cache-aware decision.
pub(crate) fn tie_rank(key: u64, c: &Candidate) -> u64 {
    let mut z = key ^ u64::from(c.id.0).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The usable candidates.
pub fn usable(candidates: &[Candidate]) -> impl Iterator<Item = &Candidate> {
    candidates.iter().filter(|c| c.usable)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_record_younger_than_the_requests_in_flight_is_no_eviction_evidence() {
        let e = |used, clock, in_flight| {
            let m = crate::tree::Mark {
                stamp: used,
                used,
                node: 3,
                end: 100,
                bytes: 90,
                evidence: false,
            };
            super::eviction_evidence(m, clock, in_flight).evidence
        };
        // Idle pool: whatever made the record has finished.
        assert!(e(10, 10, 0));
        // 4 in flight: the last 8 records may be theirs.
        assert!(!e(10, 17, 4));
        assert!(e(10, 18, 4));
        // No mark is no evidence.
        let none = crate::tree::Mark::default();
        assert!(!super::eviction_evidence(none, 100, 0).evidence);
    }

    #[test]
    fn matches_round_down_to_whole_engine_blocks() {
        let s = super::BlockScale {
            tokens_per_byte: 0.25,
            block_tokens: 16,
        };
        // 63 bytes = 15.75 tokens: under one block, a miss.
        assert_eq!((s.tokens(63), s.aligned_bytes(63)), (0, 0));
        assert_eq!((s.tokens(64), s.aligned_bytes(64)), (16, 64));
        assert_eq!((s.tokens(200), s.aligned_bytes(200)), (48, 192));
        assert_eq!(
            (s.text_tokens(0), s.text_tokens(1), s.text_tokens(200)),
            (0, 1, 50)
        );
        // A tokenizer at 3 bytes per token: blocks of 48 bytes.
        let s = super::BlockScale {
            tokens_per_byte: 1.0 / 3.0,
            block_tokens: 16,
        };
        assert_eq!((s.tokens(100), s.aligned_bytes(100)), (32, 96));
    }

    use super::*;
    use crate::policy::fixtures::cands;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    #[test]
    fn ties_without_a_key_are_spread_at_random() {
        let c = cands(&[0, 0, 0, 0]);
        let mut r = StdRng::seed_from_u64(7);
        let mut seen = [0usize; 4];
        for _ in 0..4000 {
            seen[least_loaded(c.iter(), None, &mut r).unwrap().id.0 as usize] += 1;
        }
        assert!(seen.iter().all(|n| (800..1200).contains(n)), "{seen:?}");
    }

    #[test]
    fn ties_with_a_key_are_stable_and_keys_spread() {
        let c = cands(&[0, 0, 0, 0]);
        let mut r = StdRng::seed_from_u64(7);
        for key in 0..50u64 {
            let first = least_loaded(c.iter(), Some(key), &mut r).unwrap().id;
            for _ in 0..5 {
                assert_eq!(least_loaded(c.iter(), Some(key), &mut r).unwrap().id, first);
            }
        }
        let mut seen = [0usize; 4];
        for key in 0..4000u64 {
            seen[least_loaded(c.iter(), Some(key), &mut r).unwrap().id.0 as usize] += 1;
        }
        assert!(seen.iter().all(|n| (800..1200).contains(n)), "{seen:?}");
        // Load still comes first.
        let c = cands(&[1, 0, 1, 1]);
        for key in 0..50u64 {
            assert_eq!(least_loaded(c.iter(), Some(key), &mut r).unwrap().id.0, 1);
        }
    }

    #[test]
    fn least_queued_takes_the_fewest_waiting_for_a_first_token_within_the_guard() {
        let p = crate::policy::fixtures::params(); // abs 2, rel 1.5
        let mut r = StdRng::seed_from_u64(7);
        let with = |loads: &[usize], pending: &[usize]| {
            let mut c = cands(loads);
            for (c, &n) in c.iter_mut().zip(pending) {
                c.pending = n;
            }
            c
        };
        let pick = |c: &[Candidate], r: &mut StdRng| {
            let least = c.iter().map(|c| c.load).min().unwrap();
            least_queued(c.iter(), &p, least, Some(9), r).map(|c| c.id.0)
        };
        // Worker 1 has more in flight, all past their first token: it gets the request.
        assert_eq!(pick(&with(&[1, 3], &[1, 0]), &mut r), Some(1));
        // Equal queues: the in-flight count decides.
        assert_eq!(pick(&with(&[2, 3], &[1, 1]), &mut r), Some(0));
        // Past the guard (4 > 1 + 2 and 4 > 1.5): in flight decides, queue or not.
        assert_eq!(pick(&with(&[1, 4], &[1, 0]), &mut r), Some(0));
        // Among holders none within the guard of the pool's least: none.
        let c = with(&[4, 5], &[0, 0]);
        assert_eq!(
            least_queued(c.iter(), &p, 1, None, &mut r).map(|c| c.id.0),
            None
        );
        // Full ties go by the key, stably.
        let c = with(&[1, 1, 1], &[0, 0, 0]);
        let first = pick(&c, &mut r);
        assert!((0..5).all(|_| pick(&c, &mut r) == first));
    }

    #[test]
    fn the_hold_margin_grows_with_the_share_a_move_would_recompute() {
        let mut p = crate::policy::fixtures::params(); // abs 2, match 64
        assert_eq!(hold_margin(&p, 0.0), 2);
        assert_eq!(hold_margin(&p, 0.5), 34);
        assert_eq!(hold_margin(&p, 1.0), 66);
        assert_eq!(
            hold_margin(&p, 7.0),
            66,
            "a share is at most the whole prompt"
        );
        p.balance_match_threshold = 0;
        assert_eq!(hold_margin(&p, 1.0), 2);
        p.balance_match_threshold = usize::MAX;
        p.balance_abs_threshold = usize::MAX;
        assert_eq!(hold_margin(&p, 1.0), usize::MAX);
    }

    #[test]
    fn a_prefix_outgrows_its_holders_when_its_traffic_passes_their_share() {
        // One request in 2 through it, one holder of 4: it needs more holders.
        assert!(outgrows_holders(1, 1, 4));
        // One in 4 and one holder of 4: its fair share, it stays.
        assert!(!outgrows_holders(3, 1, 4));
        // One in 2 and 2 holders of 4: their share.
        assert!(!outgrows_holders(1, 2, 4));
        // Every request through it: only the whole pool carries it.
        assert!(outgrows_holders(0, 3, 4));
        assert!(!outgrows_holders(0, 4, 4));
        assert!(!outgrows_holders(u64::MAX, usize::MAX, 4));
    }

    #[test]
    fn overload_needs_both_margins() {
        let p = crate::policy::fixtures::params(); // abs 2, rel 1.5
        assert!(is_overloaded(&p, 3, 0));
        assert!(!is_overloaded(&p, 2, 0));
        assert!(!is_overloaded(&p, 14, 10));
        assert!(is_overloaded(&p, 16, 10));
    }
}

//! `precise_cache_aware`: route on the KV blocks the engines report holding (vLLM's
//! KV-cache events, kept by [`crate::precise::Precise`]), with `cache_aware`'s tree as
//! the fallback when precise scoring is neutral for a request.
//!
//! A request is scored precisely when its prompt's token ids are known ([`Policy::prepare`]
//! works them out: the `x-token-ids` header, a completions prompt of token ids, or the
//! in-router tokenizer) and at least one usable cache-aware worker has a live feed;
//! otherwise the tree decides ("fallback", counted by cause). What was served is recorded
//! in the tree either way, so a later fallback finds it warm; a precise decision also
//! marks its blocks as speculatively held by the serving worker (rank) until the engine's
//! own events confirm them (`precise.speculative_ttl_secs`).
//!
//! KV tiers: a block a worker holds in any tier (GPU, CPU, storage) counts towards its
//! run, at its tier's weight (`precise.tier_weights`, see [`score`]).
//!
//! Data parallelism: a worker's matched run is the best of its live ranks', and the
//! request names that rank (vLLM's `X-data-parallel-rank`); for a prompt no rank holds,
//! a random live rank, so that its repeats follow it (see [`crate::precise`]).

pub mod event_index;
pub mod score;
mod supervise;
mod view;

use std::sync::Arc;

use rand::RngCore;

use super::{
    Answer, BoxFuture, CacheAware, Candidate, Outcome, Pick, Policy, Prepared, RequestParts,
    RouteRequest,
};
use crate::config::Config;
use crate::pools::pool::{Pool, PoolListener, Worker, WorkerSet};
use crate::precise::feed::Feed;
use crate::precise::{Fallback, TokenSource};
use crate::shutdown::Shutdown;
use crate::tree::SharedTree;
pub use event_index::EventIndex;

/// See the module docs.
pub struct PreciseCacheAware {
    events: EventIndex,
    fallback: CacheAware,
}

impl PreciseCacheAware {
    /// Its fallback's tree.
    pub fn shared_tree(&self) -> &Arc<SharedTree> {
        self.fallback.shared_tree()
    }

    pub fn new(config: &Config) -> Self {
        Self::sharing(config, EventIndex::new(&config.precise))
    }

    /// A policy over `events`, whose KV-event state one policy feeds for every model's
    /// pool ([`EventIndex::sharing`]).
    pub fn sharing(config: &Config, events: EventIndex) -> Self {
        PreciseCacheAware {
            events,
            fallback: CacheAware::new(&config.cache, None),
        }
    }

    /// Scores the candidates on the index; `Err` when no feed is scorable, or when no
    /// scored worker holds any of the prompt while some worker could not be scored. A
    /// candidate's matched run is the best of its live ranks' (by its worth across
    /// tiers). Notes the runs for the answer's counts by tier.
    fn score(
        &self,
        req: &RouteRequest<'_>,
        candidates: &[Candidate],
        feeds: &[&[Arc<Feed>]],
        rng: &mut dyn RngCore,
    ) -> Result<(Pick, TokenSource), Fallback> {
        let now = crate::pools::pool::now();
        let runs = self.events.runs(req, candidates, feeds, now)?;
        let per_candidate: Vec<Option<score::Matched>> = runs
            .best
            .iter()
            .map(|b| b.as_ref().map(|b| b.matched))
            .collect();
        let unscored = candidates
            .iter()
            .zip(&per_candidate)
            .any(|(c, m)| c.usable && c.cache_aware && m.is_none());
        if unscored
            && per_candidate
                .iter()
                .all(|m| m.is_none_or(|m| m.blocks == 0))
        {
            runs.note_none();
            return Err(Fallback::UnscoredMiss);
        }
        let config = self.events.precise().config();
        let mut pick = score::pick_precise(
            self.fallback.params(),
            candidates,
            &per_candidate,
            runs.tokens,
            config.block_size,
            req.tie,
            rng,
        );
        let chosen = pick
            .worker
            .and_then(|id| candidates.iter().position(|c| c.id == id && c.cache_aware));
        if let Some(i) = chosen {
            pick.dp_rank =
                event_index::rank_for(feeds[i], runs.best[i].as_ref(), now, config.stale, rng);
        }
        runs.note(chosen, &pick);
        Ok((pick, runs.source))
    }
}

impl PoolListener for PreciseCacheAware {
    fn worker_left(&self, worker: &Worker) {
        // Its consumers are stopped and its blocks dropped by the supervisor.
        self.fallback.worker_left(worker);
    }

    /// The engine may have restarted unseen: every DP rank's feed starts over (a replay
    /// from 0 when a replay endpoint exists) and its blocks go.
    fn worker_down(&self, worker: &Worker) {
        self.fallback.worker_down(worker);
        self.events.worker_down(worker);
    }
}

impl Policy for PreciseCacheAware {
    fn name(&self) -> &'static str {
        "precise_cache_aware"
    }

    fn prepare<'a>(&'a self, req: RequestParts<'a>) -> Option<BoxFuture<'a, Prepared>> {
        Some(self.events.prepare(req))
    }

    fn pick(
        &self,
        req: &RouteRequest<'_>,
        set: &WorkerSet,
        candidates: &[Candidate],
        rng: &mut dyn RngCore,
    ) -> Pick {
        let now = crate::pools::pool::now();
        let feeds = EventIndex::feeds(set, candidates);
        let precise = self.events.precise();
        let pick = match self.score(req, candidates, &feeds, rng) {
            Ok((pick, source)) => {
                precise.count_precise(source);
                pick
            }
            Err(why) => {
                precise.count_fallback(why);
                self.fallback.decide(req, set, candidates, rng)
            }
        };
        EventIndex::routed(&pick, candidates, &feeds, now);
        pick
    }

    fn observe(&self, req: &RouteRequest<'_>, pick: &Pick, worker: &Worker, outcome: Outcome) {
        if outcome != Outcome::Served {
            return;
        }
        self.fallback.record_served(req, pick);
        self.events.speculate(req, pick, worker);
    }

    /// The tree learns from the answer as in `cache_aware`; an answer to a request
    /// whose blocks were keyed is queued for its token-parity check and counted by tier.
    fn answered(&self, worker: &Worker, answer: &Answer<'_>) {
        self.fallback.learn(worker, answer);
        self.events.answered(worker, answer);
    }

    fn views(&self) -> Vec<Arc<dyn super::View>> {
        let mut views = self.fallback.views();
        if let Some(v) = self.events.view() {
            views.insert(0, v);
        }
        views
    }

    fn background(&self, pool: Arc<Pool>, shutdown: Shutdown) -> Option<BoxFuture<'static, ()>> {
        let evict = self
            .fallback
            .background(Arc::clone(&pool), shutdown.clone());
        let precise = self.events.background(pool, shutdown);
        both(evict, precise)
    }
}

/// Both background tasks, either, or none.
pub(crate) fn both(
    a: Option<BoxFuture<'static, ()>>,
    b: Option<BoxFuture<'static, ()>>,
) -> Option<BoxFuture<'static, ()>> {
    match (a, b) {
        (Some(a), Some(b)) => Some(Box::pin(async move {
            futures_util::future::join(a, b).await;
        })),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> crate::config::PreciseConfig {
        crate::config::PreciseConfig {
            block_size: 4,
            max_blocks: std::num::NonZeroUsize::new(100).unwrap(),
            stale: std::time::Duration::from_secs(30),
            speculative_ttl: std::time::Duration::from_secs(2),
            tokenizer: None,
            parity_floor: 0.5,
            ..crate::config::PreciseConfig::default()
        }
    }

    fn policy(precise: &crate::config::PreciseConfig) -> PreciseCacheAware {
        let cache = crate::config::Config::from_sources([(
            std::path::Path::new("t.yaml"),
            "workers:\n  - url: http://a:1\n",
        )])
        .unwrap()
        .cache;
        PreciseCacheAware {
            events: EventIndex::new(precise),
            fallback: CacheAware::new(&cache, None),
        }
    }

    #[test]
    fn a_worker_of_several_ranks_scores_its_best_live_rank() {
        use crate::config::{BreakerConfig, WorkerConfig};
        use crate::policy::fixtures::cands;
        use crate::pools::pool::{Worker, WorkerId, WorkerSet};
        use crate::precise::events::{BlockStored, Event};
        use crate::precise::{Fallback, Lookup, TokenSource};
        use std::time::Duration;
        let breaker = BreakerConfig {
            failure_threshold: 5,
            timeout: Duration::from_secs(30),
            success_threshold: 2,
        };
        let set = WorkerSet::new(
            [
                &br#"{"url":"http://a:1","kv_events":{"endpoint":"tcp://a:5557","dp_size":2}}"#[..],
                br#"{"url":"http://b:1","kv_events":{"endpoint":"tcp://b:5557"}}"#,
            ]
            .iter()
            .enumerate()
            .map(|(i, j)| {
                Arc::new(Worker::new(
                    WorkerId(i as u32),
                    WorkerConfig::from_json(j).unwrap(),
                    &breaker,
                ))
            })
            .collect(),
        );
        let (a, b) = (set.workers()[0].feeds(), set.workers()[1].feeds());
        assert_eq!((a.len(), b.len()), (2, 1));
        let tokens: Vec<u32> = (1..=14).collect();
        let stored = |hashes: Vec<u64>| {
            let n = hashes.len();
            Event::Stored(BlockStored {
                block_hashes: hashes,
                parent_block_hash: None,
                token_ids: tokens[..n * 4].to_vec(),
                block_size: 4,
                lora: None,
                medium: Some("GPU".into()),
                extra_keys: vec![],
                group_idx: None,
                kind: None,
            })
        };
        let no_spec = crate::config::PreciseConfig {
            speculative_ttl: Duration::ZERO,
            ..config()
        };
        for (pol, speculate) in [(policy(&no_spec), false), (policy(&config()), true)] {
            let p = pol.events.precise();
            // A served attempt, as the proxy reports it: pick, then observe.
            let serve = |lookup: &Lookup, loads: &[usize]| {
                let req = RouteRequest {
                    prepared: Prepared::Blocks(lookup.clone()),
                    ..Default::default()
                };
                let mut rng = rand::rng();
                let pick = pol.pick(&req, &set, &cands(loads), &mut rng);
                if let Some(w) = pick.worker.and_then(|id| set.get(id)) {
                    pol.observe(&req, &pick, w, Outcome::Served);
                }
                pick
            };
            for f in a.iter().chain(b) {
                f.set_replaying(false);
                f.set_connected(true);
            }
            // A's rank 1 holds the prompt's 3 blocks, its rank 0 none; B the first one.
            p.index().apply(a[1].source(), &stored(vec![10, 11, 12]));
            p.index().apply(b[0].source(), &stored(vec![20]));
            let lookup = p.keyed(&tokens, TokenSource::Header, None, None);
            let Lookup::Blocks { keys, .. } = &lookup else {
                panic!()
            };
            let pick = || serve(&lookup, &[0, 0]);
            let first = pick();
            // Sent to A's rank 1 (vLLM's X-data-parallel-rank), where the blocks are.
            assert_eq!(
                (first.worker, first.matched, first.dp_rank),
                (Some(WorkerId(0)), 12, Some(1))
            );
            let now = crate::pools::pool::now();
            let held = p
                .index()
                .match_prefix(keys, &[a[0].source(), a[1].source()], now);
            // Speculation follows the request: rank 1 only.
            assert_eq!(held, [0, 3]);
            if speculate {
                // A prompt nobody holds goes to the least loaded worker, A, on a rank
                // of the router's choosing, which alone holds it speculatively; the
                // repeat goes there too.
                let fresh: Vec<u32> = (200..214).collect();
                let lookup = p.keyed(&fresh, TokenSource::Header, None, None);
                let Lookup::Blocks { keys, .. } = &lookup else {
                    panic!()
                };
                let miss = serve(&lookup, &[0, 5]);
                let rank = miss.dp_rank.expect("a rank is named");
                assert_eq!(miss.worker, Some(WorkerId(0)));
                let held = p
                    .index()
                    .match_prefix(keys, &[a[0].source(), a[1].source()], now);
                let mut want = [0, 0];
                want[rank as usize] = 3;
                assert_eq!(held, want);
                let repeat = serve(&lookup, &[1, 0]);
                assert_eq!(
                    (repeat.worker, repeat.dp_rank),
                    (Some(WorkerId(0)), Some(rank))
                );
                continue;
            }
            // Rank 1 replaying: A is scored on rank 0 alone (nothing), B's block wins.
            a[1].set_replaying(true);
            assert_eq!((pick().worker, pick().matched), (Some(WorkerId(1)), 4));
            // Neither rank live: A is neutral; with B replaying too, the tree decides.
            a[0].set_replaying(true);
            assert_eq!(pick().worker, Some(WorkerId(1)));
            // A neutral and B holding nothing of another prompt: not a known miss, as A
            // may hold it; the tree decides.
            let other: Vec<u32> = (100..114).collect();
            let miss = p.keyed(&other, TokenSource::Header, None, None);
            serve(&miss, &[0, 0]);
            assert!(
                p.decisions()
                    .contains(&("fallback", Fallback::UnscoredMiss.as_str(), 1))
            );
            b[0].set_replaying(true);
            pick();
            assert!(
                p.decisions()
                    .contains(&("fallback", Fallback::NoFreshWorker.as_str(), 1))
            );
        }
    }
}

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
//! Data parallelism: a worker's matched run is the longest of its live ranks', and the
//! request names that rank (vLLM's `X-data-parallel-rank`); for a prompt no rank holds,
//! a random live rank, so that its repeats follow it (see [`crate::precise`]).

pub mod score;
mod supervise;
mod view;

use std::sync::Arc;

use rand::{Rng, RngCore};

use super::{
    Answer, BoxFuture, CacheAware, Candidate, Outcome, Pick, Policy, Prepared, RequestParts,
    RouteRequest,
};
use crate::config::Config;
use crate::pools::pool::{Pool, PoolListener, Worker, WorkerSet};
use crate::precise::feed::{self, Feed, FeedStats};
use crate::precise::index::SourceId;
use crate::precise::{Fallback, Lookup, Precise};
use crate::shutdown::Shutdown;
use crate::tree::SharedTree;

/// See the module docs.
pub struct PreciseCacheAware {
    precise: Arc<Precise>,
    fallback: CacheAware,
    /// Whether this instance runs the KV-event consumers and the parity check: one
    /// state serves every model's pool, and only one instance feeds it.
    feeds: bool,
}

impl PreciseCacheAware {
    /// Its fallback's tree.
    pub fn shared_tree(&self) -> &Arc<SharedTree> {
        self.fallback.shared_tree()
    }

    pub fn new(config: &Config) -> Self {
        Self::sharing(config, Arc::new(Precise::new(&config.precise)), true)
    }

    /// A policy over the KV-event state `precise`, which another instance may already
    /// feed (`feeds` false: this one runs only its tree's upkeep).
    pub fn sharing(config: &Config, precise: Arc<Precise>, feeds: bool) -> Self {
        PreciseCacheAware {
            precise,
            fallback: CacheAware::new(&config.cache, None),
            feeds,
        }
    }

    /// Scores the candidates on the index; `Err` when no feed is scorable. A
    /// candidate's matched run is the longest of its live ranks'.
    fn score(
        &self,
        req: &RouteRequest<'_>,
        candidates: &[Candidate],
        feeds: &[&[Arc<Feed>]],
        keys: &[u64],
        tokens: usize,
        rng: &mut dyn RngCore,
    ) -> Result<Pick, Fallback> {
        let now = crate::pools::pool::now();
        let stale = self.precise.config().stale;
        // (candidate, source) for every live rank of every usable cache-aware candidate.
        let scorable: Vec<(usize, SourceId)> = candidates
            .iter()
            .zip(feeds)
            .enumerate()
            .filter(|(_, (c, _))| c.usable && c.cache_aware)
            .flat_map(|(i, (_, ranks))| {
                ranks
                    .iter()
                    .filter(|f| f.state(now, stale) == feed::FeedState::Live)
                    .map(move |f| (i, f.source()))
            })
            .collect();
        if scorable.is_empty() {
            let parity_lost = candidates.iter().zip(feeds).any(|(c, ranks)| {
                c.usable
                    && c.cache_aware
                    && ranks
                        .iter()
                        .any(|f| f.state(now, stale) == feed::FeedState::ParityLost)
            });
            return Err(if parity_lost {
                Fallback::ParityLost
            } else {
                Fallback::NoFreshWorker
            });
        }
        let sources: Vec<SourceId> = scorable.iter().map(|(_, s)| *s).collect();
        let matched = self.precise.index().match_prefix(keys, &sources, now);
        let mut per_candidate: Vec<Option<usize>> = vec![None; candidates.len()];
        // The source holding each candidate's longest run (its best rank).
        let mut best_source: Vec<Option<SourceId>> = vec![None; candidates.len()];
        for ((i, source), m) in scorable.iter().zip(matched) {
            let best = per_candidate[*i].get_or_insert(0);
            if m > *best || best_source[*i].is_none() {
                best_source[*i] = Some(*source);
            }
            *best = (*best).max(m);
        }
        let unscored = candidates
            .iter()
            .zip(&per_candidate)
            .any(|(c, m)| c.usable && c.cache_aware && m.is_none());
        if unscored && per_candidate.iter().all(|m| m.unwrap_or(0) == 0) {
            return Err(Fallback::UnscoredMiss);
        }
        let mut pick = score::pick_precise(
            self.fallback.params(),
            candidates,
            &per_candidate,
            tokens,
            self.precise.config().block_size,
            req.tie,
            rng,
        );
        let chosen = pick
            .worker
            .and_then(|id| candidates.iter().position(|c| c.id == id && c.cache_aware));
        if let Some(i) = chosen {
            // A worker of several ranks: name the rank (vLLM's `X-data-parallel-rank`)
            // rather than leave it to the engine's balancer, which is not prefix-aware:
            // the rank holding the longest run, or for a prompt it does not hold, a
            // random live one (the engine balances by queue, a random pick evenly), so
            // that its repeats, steered by the speculative entries, find it there.
            let ranks = feeds[i];
            let rank = if ranks.len() < 2 {
                None
            } else if per_candidate[i].unwrap_or(0) > 0 {
                ranks.iter().find(|f| Some(f.source()) == best_source[i])
            } else {
                let live: Vec<&Arc<Feed>> = ranks
                    .iter()
                    .filter(|f| f.state(now, stale) == feed::FeedState::Live)
                    .collect();
                let from: Vec<&Arc<Feed>> = if live.is_empty() {
                    ranks.iter().collect()
                } else {
                    live
                };
                Some(from[rng.random_range(0..from.len())])
            };
            pick.dp_rank = rank.map(|f| f.rank());
        }
        Ok(pick)
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
        for feed in worker.feeds() {
            // Reset first: a batch applied after the clear below is then cleared again
            // by the consumer.
            feed.reset();
            self.precise.index().clear_source(feed.source());
            FeedStats::inc(&feed.stats.clears_unhealthy);
        }
    }
}

impl Policy for PreciseCacheAware {
    fn name(&self) -> &'static str {
        "precise_cache_aware"
    }

    fn prepare<'a>(&'a self, req: RequestParts<'a>) -> Option<BoxFuture<'a, Prepared>> {
        Some(Box::pin(async move {
            Prepared::Blocks(
                self.precise
                    .lookup(req.headers, req.endpoint, req.body)
                    .await,
            )
        }))
    }

    fn pick(
        &self,
        req: &RouteRequest<'_>,
        set: &WorkerSet,
        candidates: &[Candidate],
        rng: &mut dyn RngCore,
    ) -> Pick {
        let now = crate::pools::pool::now();
        let feeds: Vec<&[Arc<Feed>]> = candidates
            .iter()
            .map(|c| set.get(c.id).map_or(&[][..], |w| w.feeds()))
            .collect();
        let result = match &req.prepared {
            Prepared::Blocks(Lookup::Blocks {
                keys,
                tokens,
                source,
                ..
            }) => self
                .score(req, candidates, &feeds, keys, *tokens, rng)
                .map(|pick| (pick, *source)),
            Prepared::Blocks(Lookup::Fallback(why)) => Err(*why),
            Prepared::Nothing => Err(Fallback::NoTokens),
        };
        let pick = match result {
            Ok((pick, source)) => {
                self.precise.count_precise(source);
                pick
            }
            Err(why) => {
                self.precise.count_fallback(why);
                self.fallback.decide(req, set, candidates, rng)
            }
        };
        // The ranks share the staleness clock: starting it on one starts it for all.
        if let Some(feed) = pick
            .worker
            .and_then(|id| candidates.iter().position(|c| c.id == id))
            .and_then(|i| feeds[i].first())
        {
            feed.note_routed(now);
        }
        pick
    }

    fn observe(&self, req: &RouteRequest<'_>, pick: &Pick, worker: &Worker, outcome: Outcome) {
        if outcome != Outcome::Served {
            return;
        }
        self.fallback.record_served(req, pick);
        let ttl = self.precise.config().speculative_ttl;
        let Prepared::Blocks(Lookup::Blocks { keys, .. }) = &req.prepared else {
            return;
        };
        if pick.unit != super::MatchUnit::Tokens || !pick.cache_aware || ttl.is_zero() {
            return;
        }
        let until = crate::pools::pool::now() + ttl;
        let mut index = self.precise.index();
        for feed in worker.feeds() {
            if pick.dp_rank.is_none_or(|r| r == feed.rank()) {
                index.speculate(keys, feed.source(), until);
            }
        }
    }

    /// The tree learns from the answer as in `cache_aware`; an answer to a request
    /// whose blocks were keyed is queued for its token-parity check.
    fn answered(&self, worker: &Worker, answer: &Answer<'_>) {
        self.fallback.learn(worker, answer);
        if let Some(Prepared::Blocks(Lookup::Blocks { keys, ids, .. })) = answer.prepared {
            self.precise
                .check_parity(worker.label(), worker.feeds(), keys, ids);
        }
    }

    fn views(&self) -> Vec<Arc<dyn super::View>> {
        let mut views = self.fallback.views();
        // The one state's view, once (with the instance that feeds it).
        if self.feeds {
            views.insert(0, Arc::new(view::PreciseView(Arc::clone(&self.precise))));
        }
        views
    }

    fn background(&self, pool: Arc<Pool>, shutdown: Shutdown) -> Option<BoxFuture<'static, ()>> {
        let evict = self
            .fallback
            .background(Arc::clone(&pool), shutdown.clone());
        if !self.feeds {
            return evict;
        }
        let parity = crate::precise::parity::run(Arc::clone(&self.precise), shutdown.clone());
        let supervise = supervise::run(Arc::clone(&self.precise), pool, shutdown);
        let precise = futures_util::future::join(supervise, parity);
        Some(Box::pin(async move {
            match evict {
                Some(e) => {
                    futures_util::future::join(e, precise).await;
                }
                None => {
                    precise.await;
                }
            }
        }))
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
            precise: Arc::new(Precise::new(precise)),
            fallback: CacheAware::new(&cache, None),
            feeds: true,
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
            let p = &pol.precise;
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

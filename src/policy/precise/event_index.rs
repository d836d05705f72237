//! [`EventIndex`]: precise mode's KV-event index as a policy uses it. It keys each
//! request's prompt ([`EventIndex::prepare`]), runs the event consumers and the parity
//! checker ([`EventIndex::background`]), gives each candidate's matched run by tier
//! ([`EventIndex::runs`]), and learns from a served request (speculative entries) and
//! from its answer (token parity, tokens by tier). `precise_cache_aware` scores on it;
//! `cost_aware` prices with it when workers have `kv_events`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{Rng, RngCore};

use super::score::Matched;
use super::{supervise, view};
use crate::config::PreciseConfig;
use crate::policy::{
    Answer, BoxFuture, Candidate, MatchUnit, Pick, Prepared, RequestParts, RouteRequest, View,
};
use crate::pools::pool::{Pool, Worker, WorkerSet};
use crate::precise::feed::{self, Feed, FeedStats};
use crate::precise::index::SourceId;
use crate::precise::tiers::Run;
use crate::precise::{Fallback, Lookup, Noted, Precise, TierNote, TokenSource};
use crate::shutdown::Shutdown;

/// See the module docs.
pub struct EventIndex {
    precise: Arc<Precise>,
    /// Whether this one runs the KV-event consumers and the parity checker, and shows
    /// the views: one state serves every model's pool, and only one of its policies
    /// feeds it.
    feeds: bool,
}

/// One candidate's best live rank: its run by tier, the run's worth, the rank's source.
#[derive(Debug, Clone)]
pub struct Best {
    pub run: Run,
    pub matched: Matched,
    pub source: SourceId,
}

/// A request's runs on the index: per candidate its best live rank (`None`: not scored:
/// unusable, not cache-aware, or no live feed).
pub struct Runs<'r> {
    pub best: Vec<Option<Best>>,
    /// The prompt's tokens (all of them, not only the whole blocks).
    pub tokens: usize,
    /// Where they came from.
    pub source: TokenSource,
    /// The configured GPU tier (for [`Run::host_blocks`]).
    pub gpu_tier: usize,
    note: &'r TierNote,
}

impl Runs<'_> {
    /// Forgets the request's notes: the pick is not made on the index after all.
    pub fn note_none(&self) {
        self.note.set(None);
    }

    /// Notes the runs behind `pick` (of candidate `chosen`) for the answer's tokens by
    /// tier ([`Precise::count_tiers`]).
    pub fn note(&self, chosen: Option<usize>, pick: &Pick) {
        let longest = self
            .best
            .iter()
            .flatten()
            .max_by_key(|b| b.matched.blocks)
            .map(|b| b.run.clone())
            .unwrap_or_default();
        self.note.set(Some(Noted {
            available: longest,
            available_tokens: pick.available as u64,
            predicted: chosen
                .and_then(|i| self.best.get(i)?.as_ref())
                .map(|b| b.run.clone())
                .unwrap_or_default(),
            predicted_tokens: pick.matched as u64,
        }));
    }
}

impl EventIndex {
    /// An index of its own (which it feeds).
    pub fn new(config: &PreciseConfig) -> Self {
        EventIndex::sharing(Arc::new(Precise::new(config)), true)
    }

    /// An index over the KV-event state `precise`, which another policy may already
    /// feed (`feeds` false: this one only reads it).
    pub fn sharing(precise: Arc<Precise>, feeds: bool) -> Self {
        EventIndex { precise, feeds }
    }

    pub fn precise(&self) -> &Arc<Precise> {
        &self.precise
    }

    /// Keys the request's prompt (see [`Precise::lookup`]).
    pub fn prepare<'a>(&'a self, req: RequestParts<'a>) -> BoxFuture<'a, Prepared> {
        Box::pin(async move {
            Prepared::Blocks(
                self.precise
                    .lookup(req.headers, req.endpoint, req.body)
                    .await,
            )
        })
    }

    /// The KV-event feeds of each candidate's worker (none for a worker without
    /// `kv_events`).
    pub fn feeds<'s>(set: &'s WorkerSet, candidates: &[Candidate]) -> Vec<&'s [Arc<Feed>]> {
        candidates
            .iter()
            .map(|c| set.get(c.id).map_or(&[][..], |w| w.feeds()))
            .collect()
    }

    /// The request's runs on the index, or why it cannot be scored on it: no keys (its
    /// lookup's fallback), or no candidate with a live feed. A failure forgets the
    /// request's earlier notes.
    pub fn runs<'r>(
        &self,
        req: &'r RouteRequest<'_>,
        candidates: &[Candidate],
        feeds: &[&[Arc<Feed>]],
        now: Instant,
    ) -> Result<Runs<'r>, Fallback> {
        let Prepared::Blocks(lookup) = &req.prepared else {
            return Err(Fallback::NoTokens);
        };
        let (keys, tokens, source, note) = match lookup {
            Lookup::Blocks {
                keys,
                tokens,
                source,
                tiers,
                ..
            } => (keys, *tokens, *source, tiers),
            Lookup::Fallback(why) => return Err(*why),
        };
        let best = best_runs(&self.precise, candidates, feeds, keys, now).inspect_err(|_| {
            note.set(None);
        })?;
        Ok(Runs {
            best,
            tokens,
            source,
            gpu_tier: self.precise.index().tiers().gpu_tier(),
            note,
        })
    }

    /// Starts the staleness clock of the worker `pick` chose (its ranks share it).
    pub fn routed(pick: &Pick, candidates: &[Candidate], feeds: &[&[Arc<Feed>]], now: Instant) {
        if let Some(feed) = pick
            .worker
            .and_then(|id| candidates.iter().position(|c| c.id == id))
            .and_then(|i| feeds[i].first())
        {
            feed.note_routed(now);
        }
    }

    /// A served request's blocks count as held by its worker (the rank `pick` named, or
    /// all its ranks) for `precise.speculative_ttl_secs`, until its engine's events
    /// confirm or cancel them.
    pub fn speculate(&self, req: &RouteRequest<'_>, pick: &Pick, worker: &Worker) {
        let ttl = self.precise.config().speculative_ttl;
        let Prepared::Blocks(Lookup::Blocks { keys, .. }) = &req.prepared else {
            return;
        };
        if pick.unit != MatchUnit::Tokens || !pick.cache_aware || ttl.is_zero() {
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

    /// An answer to a request whose blocks were keyed: queued for its token-parity
    /// check, and its tokens counted by tier when it was scored on the index.
    pub fn answered(&self, worker: &Worker, answer: &Answer<'_>) {
        if let Some(Prepared::Blocks(Lookup::Blocks {
            keys, ids, tiers, ..
        })) = answer.prepared
        {
            self.precise
                .check_parity(worker.label(), worker.feeds(), keys, ids);
            if let (Some(noted), Some(delivered)) = (tiers.get(), answer.delivered_tokens) {
                self.precise.count_tiers(worker.label(), &noted, delivered);
            }
        }
    }

    /// The engine may have restarted unseen: every DP rank's feed starts over (a replay
    /// from 0 when a replay endpoint exists) and its blocks go. Done by the index that
    /// feeds the state (every pool's policy hears it), once.
    pub fn worker_down(&self, worker: &Worker) {
        if !self.feeds {
            return;
        }
        for feed in worker.feeds() {
            // Reset first: a batch applied after the clear below is then cleared again
            // by the consumer.
            feed.reset();
            self.precise.index().clear_source(feed.source());
            FeedStats::inc(&feed.stats.clears_unhealthy);
        }
    }

    /// The event consumers (kept in step with the pool) and the parity checker, when
    /// this one feeds the state.
    pub fn background(
        &self,
        pool: Arc<Pool>,
        shutdown: Shutdown,
    ) -> Option<BoxFuture<'static, ()>> {
        if !self.feeds {
            return None;
        }
        let parity = crate::precise::parity::run(Arc::clone(&self.precise), shutdown.clone());
        let supervise = supervise::run(Arc::clone(&self.precise), pool, shutdown);
        Some(Box::pin(async move {
            futures_util::future::join(supervise, parity).await;
        }))
    }

    /// `/workers` and `/metrics` for the index and the feeds: the one state's view,
    /// once (with the policy that feeds it).
    pub fn view(&self) -> Option<Arc<dyn View>> {
        self.feeds
            .then(|| Arc::new(view::PreciseView(Arc::clone(&self.precise))) as Arc<dyn View>)
    }
}

/// Each candidate's best live rank on the index (see [`Runs::best`]); `Err` when no
/// usable cache-aware candidate has a live feed. A rank's run is better for more worth
/// across tiers, then more blocks. Matched keys become most recently used.
fn best_runs(
    precise: &Precise,
    candidates: &[Candidate],
    feeds: &[&[Arc<Feed>]],
    keys: &[u64],
    now: Instant,
) -> Result<Vec<Option<Best>>, Fallback> {
    let stale = precise.config().stale;
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
    let runs = precise.index().match_runs(keys, &sources, now);
    let weights = &precise.config().tier_weights;
    let mut best: Vec<Option<Best>> = vec![None; candidates.len()];
    for ((i, source), run) in scorable.iter().zip(runs) {
        let matched = Matched {
            blocks: run.blocks,
            credit: run.credit(weights),
        };
        let better = best[*i].as_ref().is_none_or(|b| {
            (matched.credit, matched.blocks) > (b.matched.credit, b.matched.blocks)
        });
        if better {
            best[*i] = Some(Best {
                run,
                matched,
                source: *source,
            });
        }
    }
    Ok(best)
}

/// The DP rank to name for a worker of several ranks (vLLM's `X-data-parallel-rank`)
/// rather than leave it to the engine's balancer, which is not prefix-aware: the rank
/// holding its best run, or for a prompt it does not hold, a random live one (the
/// engine balances by queue, a random pick evenly), so that its repeats, steered by the
/// speculative entries, find it there. `None` for a worker of one rank.
pub fn rank_for(
    ranks: &[Arc<Feed>],
    best: Option<&Best>,
    now: Instant,
    stale: Duration,
    rng: &mut dyn RngCore,
) -> Option<u32> {
    if ranks.len() < 2 {
        return None;
    }
    if let Some(b) = best.filter(|b| b.matched.blocks > 0) {
        return ranks
            .iter()
            .find(|f| f.source() == b.source)
            .map(|f| f.rank());
    }
    let live: Vec<&Arc<Feed>> = ranks
        .iter()
        .filter(|f| f.state(now, stale) == feed::FeedState::Live)
        .collect();
    let from: Vec<&Arc<Feed>> = if live.is_empty() {
        ranks.iter().collect()
    } else {
        live
    };
    Some(from[rng.random_range(0..from.len())].rank())
}

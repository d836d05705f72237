//! Precise mode as operators see it: the index and its decisions (`precise`) and each
//! worker's KV-event feed (`kv_events`) in `/workers`; their families in `/metrics`.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Unit;
use serde::Serialize;

use crate::policy::view::{Fields, View, family, put};
use crate::pools::pool::{Pool, WorkerSet};
use crate::precise::feed::{Feed, FeedCounts, FeedState};
use crate::precise::tiers::MAX_TIERS;
use crate::precise::{Precise, TierTokens};

/// Precise mode's [`View`]: its index and the workers' feeds.
pub struct PreciseView(pub Arc<Precise>);

impl View for PreciseView {
    fn workers(&self, set: &WorkerSet, top: &mut Fields, workers: &mut [Fields]) {
        let precise = &*self.0;
        let now = crate::pools::pool::now();
        let (blocks, evicted, held, names) = {
            let index = precise.index();
            let held: Vec<Vec<Held>> = set
                .workers()
                .iter()
                .map(|w| {
                    w.feeds()
                        .iter()
                        .map(|f| Held {
                            blocks: index.source_blocks(f.source()),
                            tiers: index.source_tier_blocks(f.source()),
                        })
                        .collect()
                })
                .collect();
            let names: Vec<String> = index.tiers().names().map(str::to_string).collect();
            (index.len(), index.evicted(), held, names)
        };
        let tokens: Vec<TierTokens> = set
            .workers()
            .iter()
            .map(|w| precise.tier_tokens(w.label()))
            .collect();
        let weights = &precise.config().tier_weights;
        put(
            top,
            "precise",
            IndexView {
                block_size: precise.config().block_size,
                max_blocks: precise.config().max_blocks.get(),
                blocks,
                evicted,
                tiers: names
                    .iter()
                    .enumerate()
                    .map(|(t, name)| {
                        let sum = |kind: usize| tokens.iter().map(|w| w[kind][t]).sum();
                        let row = TierTotals {
                            weight: weights.tiers().get(t).map_or(0.0, |(_, w)| *w),
                            available: sum(0),
                            predicted: sum(1),
                            delivered: sum(2),
                        };
                        (name.clone(), row)
                    })
                    .collect(),
                decisions: precise.decisions().into_iter().fold(
                    Default::default(),
                    |mut by_path: std::collections::BTreeMap<
                        _,
                        std::collections::BTreeMap<_, _>,
                    >,
                     (path, cause, n)| {
                        by_path.entry(path).or_default().insert(cause, n);
                        by_path
                    },
                ),
            },
        );
        let stale = precise.config().stale;
        for (((w, fields), held), tokens) in set.workers().iter().zip(workers).zip(held).zip(tokens)
        {
            if !w.feeds().is_empty() {
                put(
                    fields,
                    "kv_events",
                    worker_feed_view(w, &held, &names, now, stale),
                );
            }
            let by_tier: std::collections::BTreeMap<&str, TierTokenView> = names
                .iter()
                .enumerate()
                .map(|(t, name)| {
                    let row = TierTokenView {
                        available: tokens[0][t],
                        predicted: tokens[1][t],
                        delivered: tokens[2][t],
                    };
                    (name.as_str(), row)
                })
                .collect();
            put(fields, "tier_tokens", by_tier);
        }
    }

    fn collector(
        &self,
        pool: &Arc<Pool>,
    ) -> Option<Box<dyn prometheus_client::collector::Collector>> {
        Some(Box::new(PreciseMetrics {
            precise: Arc::clone(&self.0),
            pool: Arc::clone(pool),
            families: PreciseFamilies::default(),
        }))
    }
}

/// One worker's KV-event feed in `/workers`. A worker with one DP rank shows its one
/// feed. A worker with `dp_size` n > 1 shows its worker-level summary here, and each
/// rank's feed in `ranks` (the same fields plus `rank` and `rank_mismatch`): the
/// summary's endpoints are the configured (rank 0) ones, its counters and `blocks` the
/// sums over the ranks (so one unhealthy transition adds n to `clears_unhealthy`),
/// `state` the worst rank's (`stale` > `replaying` > `live`; the worker is still scored
/// while `live_ranks` > 0), `connected` true when every rank is, `seconds_since_event`
/// the freshest rank's, and `last_seq` null (each rank numbers its own batches).
#[derive(Serialize)]
struct FeedView {
    /// The DP rank (only in `ranks`).
    #[serde(skip_serializing_if = "Option::is_none")]
    rank: Option<u32>,
    endpoint: String,
    topic: String,
    replay_endpoint: Option<String>,
    /// `live` (scored), `parity_lost`, `replaying`, `stale` or `disconnected` (neutral).
    state: &'static str,
    connected: bool,
    last_seq: Option<u64>,
    /// Seconds since the last message; `null` before the first.
    seconds_since_event: Option<f64>,
    /// Engine blocks the worker holds according to its events, in any tier.
    blocks: usize,
    /// Of those, per configured tier (`precise.tier_weights`; a block in two tiers
    /// counts in both).
    tier_blocks: std::collections::BTreeMap<String, u64>,
    /// messages, malformed, skipped_events, stored, removed, cleared, unknown_parent,
    /// ignored, gaps, restarts, the worker's blocks dropped by the router by cause
    /// (`clears_gap`: a gap no replay could fill, `clears_restart`,
    /// `clears_reconnect`: a forward jump after a reconnect taken as a restart,
    /// `clears_unhealthy`), replays, replays_complete, replays_failed, reconnects.
    #[serde(flatten)]
    counts: FeedCounts,
    /// Batches whose `dp_rank` was not the rank of the port they came on (dp_size > 1
    /// only; they are applied to the port's rank).
    #[serde(skip_serializing_if = "Option::is_none")]
    rank_mismatch: Option<u64>,
    /// `kv_events.dp_size` (dp_size > 1 only).
    #[serde(skip_serializing_if = "Option::is_none")]
    dp_size: Option<u32>,
    /// Ranks whose feed is live (scored) now (dp_size > 1 only).
    #[serde(skip_serializing_if = "Option::is_none")]
    live_ranks: Option<usize>,
    /// Each rank's feed (dp_size > 1 only).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    ranks: Vec<FeedView>,
    /// The worker's token parity (not per rank): answers whose blocks its engine
    /// confirmed or not, and whether the tree routes for it (`precise::parity`).
    #[serde(skip_serializing_if = "Option::is_none")]
    parity: Option<crate::precise::parity::ParityView>,
}

/// One source's holdings: engine blocks in any tier, and per configured tier.
struct Held {
    blocks: usize,
    tiers: [u64; MAX_TIERS],
}

/// A tier's weight and its tokens over all workers (`/workers` `precise.tiers`).
#[derive(Serialize)]
struct TierTotals {
    weight: f64,
    available: u64,
    predicted: u64,
    delivered: u64,
}

/// A worker's precisely scored answers' tokens in one tier (`/workers` `tier_tokens`):
/// see [`Precise::count_tiers`].
#[derive(Serialize)]
struct TierTokenView {
    available: u64,
    predicted: u64,
    delivered: u64,
}

/// Precise mode's index and decisions in `/workers` (`precise`).
#[derive(Serialize)]
struct IndexView {
    block_size: usize,
    max_blocks: usize,
    /// Distinct blocks indexed, in any tier (speculative ones included).
    blocks: usize,
    evicted: u64,
    /// Per configured tier: its weight, and the available / predicted / delivered
    /// tokens of precisely scored answers, all workers together.
    tiers: std::collections::BTreeMap<String, TierTotals>,
    /// Decisions so far by path (`precise`, `fallback`), then by token source
    /// (`x_token_ids`, `prompt_token_ids`, `tokenizer`) or fallback cause.
    decisions:
        std::collections::BTreeMap<&'static str, std::collections::BTreeMap<&'static str, u64>>,
}

/// Per tier name, `counts` (in configured order).
fn by_name(names: &[String], counts: &[u64; MAX_TIERS]) -> std::collections::BTreeMap<String, u64> {
    names.iter().cloned().zip(counts.iter().copied()).collect()
}

/// A worker's `kv_events` view (see [`FeedView`]); `held` holds each rank's blocks,
/// `names` the configured tiers.
fn worker_feed_view(
    w: &crate::pools::pool::Worker,
    held: &[Held],
    names: &[String],
    now: std::time::Instant,
    stale: std::time::Duration,
) -> FeedView {
    let feeds = w.feeds();
    let view = |f: &Feed, held: &Held, state: FeedState| FeedView {
        rank: None,
        endpoint: f.endpoint().to_string(),
        topic: f.topic().to_string(),
        replay_endpoint: f.replay_endpoint().map(str::to_string),
        state: state.as_str(),
        connected: f.is_connected(),
        last_seq: f.last_seq(),
        seconds_since_event: f.seconds_since_message(now),
        blocks: held.blocks,
        tier_blocks: by_name(names, &held.tiers),
        counts: f.stats.counts(),
        rank_mismatch: None,
        dp_size: None,
        live_ranks: None,
        ranks: Vec::new(),
        parity: None,
    };
    let states: Vec<FeedState> = feeds.iter().map(|f| f.state(now, stale)).collect();
    let mut ranks: Vec<FeedView> = feeds
        .iter()
        .zip(held)
        .zip(&states)
        .map(|((f, h), st)| view(f, h, *st))
        .collect();
    let parity = feeds.first().map(|f| f.parity().view());
    if ranks.len() == 1 {
        let mut one = ranks.remove(0);
        one.parity = parity;
        return one;
    }
    for (r, f) in ranks.iter_mut().zip(feeds) {
        r.rank = Some(f.rank());
        r.rank_mismatch = Some(r.counts.rank_mismatch);
    }
    let counts: FeedCounts = ranks.iter().map(|r| r.counts).sum();
    let kv = w.config().kv_events.as_ref();
    FeedView {
        rank: None,
        endpoint: kv.map_or_else(String::new, |k| k.endpoint.clone()),
        topic: kv.map_or_else(String::new, |k| k.topic.clone()),
        replay_endpoint: kv.and_then(|k| k.replay_endpoint.clone()),
        state: states
            .iter()
            .max()
            .copied()
            .unwrap_or(FeedState::Live)
            .as_str(),
        connected: ranks.iter().all(|r| r.connected),
        last_seq: None,
        seconds_since_event: ranks
            .iter()
            .filter_map(|r| r.seconds_since_event)
            .reduce(f64::min),
        blocks: ranks.iter().map(|r| r.blocks).sum(),
        tier_blocks: {
            let mut sum = [0; MAX_TIERS];
            for h in held {
                for (s, n) in sum.iter_mut().zip(h.tiers) {
                    *s += n;
                }
            }
            by_name(names, &sum)
        },
        counts,
        rank_mismatch: Some(counts.rank_mismatch),
        dp_size: Some(feeds.len() as u32),
        live_ranks: Some(states.iter().filter(|s| **s == FeedState::Live).count()),
        ranks,
        parity,
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerLabels {
    worker: Arc<str>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerKindLabels {
    worker: Arc<str>,
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerResultLabels {
    worker: Arc<str>,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerCauseLabels {
    worker: Arc<str>,
    cause: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerStateLabels {
    worker: Arc<str>,
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerTierLabels {
    worker: Arc<str>,
    tier: Arc<str>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerTierKindLabels {
    worker: Arc<str>,
    tier: Arc<str>,
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabels {
    path: &'static str,
    cause: &'static str,
}

/// Precise mode: KV-event feeds and the block index. Every value is read from the
/// feeds' and the index's own counters at scrape time (counters are monotonic per
/// feed; a worker whose config changes starts a new feed at 0).
///
/// Series are per worker, never per DP rank: a worker with `kv_events.dp_size` > 1
/// shows its ranks summed up as `/workers` does (counters and blocks summed,
/// `kv_event_connected` 1 only when every rank is, `kv_event_since_last_seconds` the
/// freshest rank's, `kv_event_feed_state` the worst rank's), plus
/// `kv_event_live_ranks` and `kv_event_rank_mismatch_total`; the per-rank detail is in
/// `/workers` (`kv_events.ranks`). A `rank` label would have been cheap to add but not
/// consistent: every existing series of a one-rank worker would gain it (or only some
/// workers' series would carry it), changing what queries and dashboards select.
#[derive(Debug, Default)]
struct PreciseFamilies {
    messages: Family<WorkerLabels, Counter>,
    malformed: Family<WorkerLabels, Counter>,
    events: Family<WorkerKindLabels, Counter>,
    gaps: Family<WorkerLabels, Counter>,
    restarts: Family<WorkerLabels, Counter>,
    clears: Family<WorkerCauseLabels, Counter>,
    replays: Family<WorkerResultLabels, Counter>,
    reconnects: Family<WorkerLabels, Counter>,
    since_message: Family<WorkerLabels, Gauge<f64, AtomicU64>>,
    connected: Family<WorkerLabels, Gauge>,
    state: Family<WorkerStateLabels, Gauge>,
    worker_blocks: Family<WorkerLabels, Gauge>,
    tier_blocks: Family<WorkerTierLabels, Gauge>,
    tier_tokens: Family<WorkerTierKindLabels, Counter>,
    unknown_hashes: Family<WorkerLabels, Counter>,
    live_ranks: Family<WorkerLabels, Gauge>,
    rank_mismatch: Family<WorkerLabels, Counter>,
    parity_checks: Family<WorkerResultLabels, Counter>,
    parity_lost: Family<WorkerLabels, Gauge>,
    blocks: Gauge,
    evicted: Counter,
    decisions: Family<DecisionLabels, Counter>,
}

/// Precise mode's families, refilled from the feeds and the index at each scrape.
struct PreciseMetrics {
    precise: Arc<Precise>,
    pool: Arc<Pool>,
    families: PreciseFamilies,
}

impl std::fmt::Debug for PreciseMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreciseMetrics").finish_non_exhaustive()
    }
}

impl PreciseMetrics {
    /// Reads every value anew from the feeds of `set`'s workers and the index.
    fn refill(&self, set: &WorkerSet) {
        let f = &self.families;
        let precise = &*self.precise;
        f.messages.clear();
        f.malformed.clear();
        f.events.clear();
        f.gaps.clear();
        f.restarts.clear();
        f.clears.clear();
        f.replays.clear();
        f.reconnects.clear();
        f.since_message.clear();
        f.connected.clear();
        f.state.clear();
        f.worker_blocks.clear();
        f.tier_blocks.clear();
        f.tier_tokens.clear();
        f.unknown_hashes.clear();
        f.live_ranks.clear();
        f.rank_mismatch.clear();
        f.parity_checks.clear();
        f.parity_lost.clear();
        f.decisions.clear();
        let now = crate::pools::pool::now();
        let stale = precise.config().stale;
        let feeds: Vec<(&Arc<str>, &[Arc<Feed>])> = set
            .workers()
            .iter()
            .filter(|w| !w.feeds().is_empty())
            .map(|w| (w.label(), w.feeds()))
            .collect();
        let (blocks, evicted, per_worker, names) = {
            let index = precise.index();
            let per_worker: Vec<(usize, [u64; MAX_TIERS])> = feeds
                .iter()
                .map(|(_, ranks)| {
                    let mut tiers = [0; MAX_TIERS];
                    for feed in ranks.iter() {
                        for (t, n) in tiers
                            .iter_mut()
                            .zip(index.source_tier_blocks(feed.source()))
                        {
                            *t += n;
                        }
                    }
                    let blocks = ranks
                        .iter()
                        .map(|feed| index.source_blocks(feed.source()))
                        .sum();
                    (blocks, tiers)
                })
                .collect();
            let names: Vec<Arc<str>> = index.tiers().names().map(Arc::from).collect();
            (index.len(), index.evicted(), per_worker, names)
        };
        for ((label, ranks), (held, tiers)) in feeds.iter().zip(per_worker) {
            worker_series(f, label, ranks, held, now, stale);
            for (name, n) in names.iter().zip(tiers) {
                f.tier_blocks
                    .get_or_create(&WorkerTierLabels {
                        worker: Arc::clone(label),
                        tier: Arc::clone(name),
                    })
                    .set(n as i64);
            }
        }
        let labels: Vec<&Arc<str>> = set.workers().iter().map(|w| w.label()).collect();
        precise.retain_tier_tokens(&labels);
        for label in labels {
            let tokens = precise.tier_tokens(label);
            for (kind, by_tier) in ["available", "predicted", "delivered"]
                .into_iter()
                .zip(tokens)
            {
                for (name, n) in names.iter().zip(by_tier) {
                    f.tier_tokens
                        .get_or_create(&WorkerTierKindLabels {
                            worker: Arc::clone(label),
                            tier: Arc::clone(name),
                            kind,
                        })
                        .inc_by(n);
                }
            }
        }
        f.blocks.set(blocks as i64);
        let before = f.evicted.get();
        f.evicted.inc_by(evicted.saturating_sub(before));
        for (path, cause, n) in precise.decisions() {
            f.decisions
                .get_or_create(&DecisionLabels { path, cause })
                .inc_by(n);
        }
    }
}

/// One worker's series: its feeds' (ranks summed) counters, state and blocks held.
fn worker_series(
    f: &PreciseFamilies,
    label: &Arc<str>,
    ranks: &[Arc<Feed>],
    held: usize,
    now: std::time::Instant,
    stale: std::time::Duration,
) {
    let w = || WorkerLabels {
        worker: Arc::clone(label),
    };
    let kind = |kind| WorkerKindLabels {
        worker: Arc::clone(label),
        kind,
    };
    let s: FeedCounts = ranks.iter().map(|feed| feed.stats.counts()).sum();
    f.messages.get_or_create(&w()).inc_by(s.messages);
    f.malformed.get_or_create(&w()).inc_by(s.malformed);
    for (k, c) in [
        ("block_stored", s.stored),
        ("block_removed", s.removed),
        ("all_blocks_cleared", s.cleared),
        ("unknown_parent", s.unknown_parent),
        ("ignored", s.ignored),
        ("skipped", s.skipped_events),
    ] {
        f.events.get_or_create(&kind(k)).inc_by(c);
    }
    f.gaps.get_or_create(&w()).inc_by(s.gaps);
    f.restarts.get_or_create(&w()).inc_by(s.restarts);
    for (cause, c) in [
        ("gap", s.clears_gap),
        ("restart", s.clears_restart),
        ("reconnect", s.clears_reconnect),
        ("unhealthy", s.clears_unhealthy),
    ] {
        f.clears
            .get_or_create(&WorkerCauseLabels {
                worker: Arc::clone(label),
                cause,
            })
            .inc_by(c);
    }
    f.reconnects.get_or_create(&w()).inc_by(s.reconnects);
    for (result, c) in [
        ("requested", s.replays),
        ("complete", s.replays_complete),
        ("failed", s.replays_failed),
    ] {
        f.replays
            .get_or_create(&WorkerResultLabels {
                worker: Arc::clone(label),
                result,
            })
            .inc_by(c);
    }
    f.rank_mismatch.get_or_create(&w()).inc_by(s.rank_mismatch);
    f.unknown_hashes
        .get_or_create(&w())
        .inc_by(s.unknown_hashes);
    if let Some(feed) = ranks.first() {
        let parity = feed.parity();
        let (matches, mismatches) = parity.counts();
        for (result, c) in [("match", matches), ("mismatch", mismatches)] {
            f.parity_checks
                .get_or_create(&WorkerResultLabels {
                    worker: Arc::clone(label),
                    result,
                })
                .inc_by(c);
        }
        f.parity_lost
            .get_or_create(&w())
            .set(i64::from(parity.is_lost()));
    }
    if let Some(secs) = ranks
        .iter()
        .filter_map(|feed| feed.seconds_since_message(now))
        .reduce(f64::min)
    {
        f.since_message.get_or_create(&w()).set(secs);
    }
    f.connected
        .get_or_create(&w())
        .set(i64::from(ranks.iter().all(|feed| feed.is_connected())));
    let states: Vec<FeedState> = ranks.iter().map(|feed| feed.state(now, stale)).collect();
    let state = states.iter().max().copied().unwrap_or(FeedState::Live);
    for st in [
        FeedState::Live,
        FeedState::ParityLost,
        FeedState::Replaying,
        FeedState::Stale,
        FeedState::Disconnected,
    ] {
        f.state
            .get_or_create(&WorkerStateLabels {
                worker: Arc::clone(label),
                state: st.as_str(),
            })
            .set(i64::from(st == state));
    }
    let live = states.iter().filter(|st| **st == FeedState::Live).count();
    f.live_ranks.get_or_create(&w()).set(live as i64);
    f.worker_blocks.get_or_create(&w()).set(held as i64);
}

impl prometheus_client::collector::Collector for PreciseMetrics {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        self.refill(&self.pool.set());
        let f = &self.families;
        feed_families(&mut enc, f)?;
        index_families(&mut enc, f)
    }
}

/// The KV-event feeds' families (per worker, ranks summed).
fn feed_families(enc: &mut DescriptorEncoder, f: &PreciseFamilies) -> std::fmt::Result {
    family(
        enc,
        "kv_event_messages",
        "KV-event messages (batches) received per worker, well-formed or not",
        None,
        &f.messages,
    )?;
    family(
        enc,
        "kv_event_malformed",
        "KV-event messages that did not decode (frames or msgpack), skipped",
        None,
        &f.malformed,
    )?;
    family(
        enc,
        "kv_events",
        "KV events per worker by kind: block_stored, block_removed, all_blocks_cleared, unknown_parent (not indexed), ignored (other KV-cache group or block size), skipped (unknown tag or bad field)",
        None,
        &f.events,
    )?;
    family(
        enc,
        "kv_event_gaps",
        "Sequence gaps in a worker's KV-event stream",
        None,
        &f.gaps,
    )?;
    family(
        enc,
        "kv_event_restarts",
        "Publisher restarts seen in a worker's KV-event stream",
        None,
        &f.restarts,
    )?;
    family(
        enc,
        "kv_event_clears",
        "Times the router dropped a worker's blocks, by cause: gap (no replay could fill it), restart (sequence went back or new publisher id), reconnect (forward jump after a reconnect, taken as a restart), unhealthy (health checks failed)",
        None,
        &f.clears,
    )?;
    family(
        enc,
        "kv_event_replays",
        "Replays per worker by result: requested, complete (gap closed), failed (blocks cleared)",
        None,
        &f.replays,
    )?;
    family(
        enc,
        "kv_event_reconnects",
        "Connections to a worker's KV-event publisher re-established",
        None,
        &f.reconnects,
    )?;
    family(
        enc,
        "kv_event_since_last",
        "Seconds since the last KV-event message from the worker (absent before the first)",
        Some(&Unit::Seconds),
        &f.since_message,
    )?;
    family(
        enc,
        "kv_event_connected",
        "1 while connected to the worker's KV-event publisher",
        None,
        &f.connected,
    )?;
    family(
        enc,
        "kv_event_feed_state",
        "1 for the feed's state: live (scored), parity_lost, replaying, stale or disconnected (neutral)",
        None,
        &f.state,
    )?;
    family(
        enc,
        "kv_event_live_ranks",
        "Data-parallel ranks of the worker whose KV-event feed is live (scored); the worker scores neutral at 0",
        None,
        &f.live_ranks,
    )?;
    family(
        enc,
        "kv_event_unknown_hashes",
        "Blocks of host-tier events without tokens (vLLM's CPU offloading) whose hash no event with tokens had placed: not indexed",
        None,
        &f.unknown_hashes,
    )?;
    family(
        enc,
        "kv_event_rank_mismatch",
        "KV-event batches whose dp_rank was not the rank of the port they came on (workers with dp_size > 1; applied to the port's rank)",
        None,
        &f.rank_mismatch,
    )?;
    Ok(())
}

/// Token parity, the index and the decisions.
fn index_families(enc: &mut DescriptorEncoder, f: &PreciseFamilies) -> std::fmt::Result {
    family(
        enc,
        "precise_parity_checks",
        "Answers whose KV blocks were looked up in the worker's own events after they ended: result match (the engine reported the router's last block key) or mismatch",
        None,
        &f.parity_checks,
    )?;
    family(
        enc,
        "precise_parity_lost",
        "1 while the worker's engine blocks do not match the router's tokens (match share under precise.parity_floor): the approximate tree routes for it",
        None,
        &f.parity_lost,
    )?;
    family(
        enc,
        "precise_index_worker_blocks",
        "Engine blocks a worker holds according to its events",
        None,
        &f.worker_blocks,
    )?;
    family(
        enc,
        "precise_index_tier_blocks",
        "Engine blocks a worker holds according to its events, per KV tier (precise.tier_weights; a medium not named there counts as the lightest tier named; a block in two tiers counts in both)",
        None,
        &f.tier_blocks,
    )?;
    family(
        enc,
        "precise_prefix_tokens",
        "Prompt tokens of a worker's precisely scored answers by KV tier: available (the longest run any worker held), predicted (the chosen worker's run), delivered (the engine's cached tokens, split along the predicted run; beyond it, GPU)",
        None,
        &f.tier_tokens,
    )?;
    family(
        enc,
        "precise_index_blocks",
        "Distinct blocks in the precise index (speculative ones included)",
        None,
        &f.blocks,
    )?;
    family(
        enc,
        "precise_index_evicted",
        "Blocks dropped from the precise index to stay within precise.max_blocks",
        None,
        &f.evicted,
    )?;
    family(
        enc,
        "precise_decisions",
        "Precise-mode decisions: path precise (cause: token source x_token_ids, prompt_token_ids, tokenizer) or fallback to the approximate tree (cause no_tokens, bad_tokens, short_prompt, no_fresh_worker, untokenizable, tokenizer_busy, unscored_miss)",
        None,
        &f.decisions,
    )?;
    Ok(())
}

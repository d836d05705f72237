//! [`Feed`]: one KV-event publisher of a worker as the rest of the router sees it —
//! its identity in the block index, whether its entries may be scored now, and its
//! counters. Written by its consumer task, read by the request path, `/workers` and
//! `/metrics`; plain atomics, no locks.
//!
//! A worker has one feed per data-parallel rank (`kv_events.dp_size`, default 1):
//! vLLM runs a publisher per rank, rank r on the configured ports plus r (spec §1), and
//! each rank has its own sequence numbers, replay buffer and engine block hashes, so
//! each feed has its own consumer, sequence state and [`SourceId`] in the index (spec
//! §10, "state per (worker, dp_rank)"). [`Feed::ranks`] builds them.
//!
//! A feed is *scorable* unless it is disconnected (events may be missed), replaying (a
//! gap is being filled: entries may miss removals) or stale: requests were routed to the worker and then `precise.stale_secs`
//! passed with no message from it (the feed is broken or the engine stuck). A silent
//! feed with no traffic is not stale: an idle engine publishes nothing (spec §3).
//! Staleness is judged per worker, not per rank: the ranks share the clock, a request
//! starts it and a message from any rank stops it. The engine's own balancer picks the
//! rank of each request (by queue length, not prefix), and under light load it may send
//! every request to one rank, leaving the others silent yet sound; only a worker whose
//! every rank stays silent under traffic is evidence of a broken feed.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::index::SourceId;
use crate::config::{KvEventsConfig, WorkerUrl};

/// Longest a consumer waiting for messages takes to act on a [`Feed::reset`].
pub const RESET_CHECK_EVERY: Duration = Duration::from_millis(250);

/// A feed's state, for scoring and `/workers`. Ordered from best to worst: a
/// worker's ranks are summed up by the worst of their states ([`Ord::max`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum FeedState {
    /// Following the stream: entries are scored.
    Live,
    /// Following the stream, but the engine's blocks have stopped matching the
    /// router's tokens (see [`super::parity`]): neutral until parity returns.
    ParityLost,
    /// Filling a sequence gap by replay: neutral until it ends.
    Replaying,
    /// Requests flowed, events did not: neutral until the next message.
    Stale,
    /// No connection to the publisher (not yet made, or lost): events may be missed,
    /// so neutral until it is back (the first message then shows any gap or restart).
    Disconnected,
}

impl FeedState {
    pub fn as_str(self) -> &'static str {
        match self {
            FeedState::Live => "live",
            FeedState::ParityLost => "parity_lost",
            FeedState::Replaying => "replaying",
            FeedState::Stale => "stale",
            FeedState::Disconnected => "disconnected",
        }
    }
}

/// Counters of one feed since it started (monotonic).
#[derive(Debug, Default)]
pub struct FeedStats {
    /// Messages (batches) received on the live socket, well-formed or not.
    pub messages: AtomicU64,
    /// Messages that could not be decoded (frames or payload), skipped.
    pub malformed: AtomicU64,
    /// Events inside good batches skipped: unknown tag or a malformed field.
    pub skipped_events: AtomicU64,
    /// Events applied, by tag.
    pub stored: AtomicU64,
    pub removed: AtomicU64,
    pub cleared: AtomicU64,
    /// `BlockStored` events whose parent block was unknown (not indexed).
    pub unknown_parent: AtomicU64,
    /// Events of another KV-cache group or block size (not indexed).
    pub ignored: AtomicU64,
    /// Blocks of host-tier events (no tokens) whose hash no event with tokens had
    /// placed: not indexed.
    pub unknown_hashes: AtomicU64,
    /// Sequence gaps seen.
    pub gaps: AtomicU64,
    /// Publisher restarts seen: sequence went back, a new publisher id, or a forward
    /// jump on the first batch after a reconnect (see [`super::sequence`]).
    pub restarts: AtomicU64,
    /// The worker's blocks dropped by the router itself, by cause: a gap no replay
    /// could fill, a restart, a forward jump after a reconnect (also counted in
    /// `restarts`), the health checker marking the worker unhealthy.
    pub clears_gap: AtomicU64,
    pub clears_restart: AtomicU64,
    pub clears_reconnect: AtomicU64,
    pub clears_unhealthy: AtomicU64,
    /// Replays asked for, completed (gap closed), failed (entries cleared).
    pub replays: AtomicU64,
    pub replays_complete: AtomicU64,
    pub replays_failed: AtomicU64,
    /// Connections to the publisher re-established after the first.
    pub reconnects: AtomicU64,
    /// Batches whose `data_parallel_rank` is not this feed's rank (only checked when
    /// `dp_size` > 1; see [`Feed::check_rank`]).
    pub rank_mismatch: AtomicU64,
}

impl FeedStats {
    /// Adds one (Relaxed: independent counters, read for display only).
    pub fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// The counters now, as plain numbers.
    pub fn counts(&self) -> FeedCounts {
        let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
        FeedCounts {
            messages: n(&self.messages),
            malformed: n(&self.malformed),
            skipped_events: n(&self.skipped_events),
            stored: n(&self.stored),
            removed: n(&self.removed),
            cleared: n(&self.cleared),
            unknown_parent: n(&self.unknown_parent),
            ignored: n(&self.ignored),
            unknown_hashes: n(&self.unknown_hashes),
            gaps: n(&self.gaps),
            restarts: n(&self.restarts),
            clears_gap: n(&self.clears_gap),
            clears_restart: n(&self.clears_restart),
            clears_reconnect: n(&self.clears_reconnect),
            clears_unhealthy: n(&self.clears_unhealthy),
            replays: n(&self.replays),
            replays_complete: n(&self.replays_complete),
            replays_failed: n(&self.replays_failed),
            reconnects: n(&self.reconnects),
            rank_mismatch: n(&self.rank_mismatch),
        }
    }
}

/// [`FeedStats`] read at one moment (field meanings there). A worker's ranks add up
/// field by field (`+`): `/workers` and `/metrics` show a worker's totals so.
/// Serialized as `/workers` shows one feed, without `rank_mismatch` (shown beside it
/// only for a worker with several ranks).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct FeedCounts {
    pub messages: u64,
    pub malformed: u64,
    pub skipped_events: u64,
    pub stored: u64,
    pub removed: u64,
    pub cleared: u64,
    pub unknown_parent: u64,
    pub ignored: u64,
    pub unknown_hashes: u64,
    pub gaps: u64,
    pub restarts: u64,
    pub clears_gap: u64,
    pub clears_restart: u64,
    pub clears_reconnect: u64,
    pub clears_unhealthy: u64,
    pub replays: u64,
    pub replays_complete: u64,
    pub replays_failed: u64,
    pub reconnects: u64,
    #[serde(skip)]
    pub rank_mismatch: u64,
}

impl std::ops::Add for FeedCounts {
    type Output = FeedCounts;

    fn add(self, o: FeedCounts) -> FeedCounts {
        FeedCounts {
            messages: self.messages + o.messages,
            malformed: self.malformed + o.malformed,
            skipped_events: self.skipped_events + o.skipped_events,
            stored: self.stored + o.stored,
            removed: self.removed + o.removed,
            cleared: self.cleared + o.cleared,
            unknown_parent: self.unknown_parent + o.unknown_parent,
            ignored: self.ignored + o.ignored,
            unknown_hashes: self.unknown_hashes + o.unknown_hashes,
            gaps: self.gaps + o.gaps,
            restarts: self.restarts + o.restarts,
            clears_gap: self.clears_gap + o.clears_gap,
            clears_restart: self.clears_restart + o.clears_restart,
            clears_reconnect: self.clears_reconnect + o.clears_reconnect,
            clears_unhealthy: self.clears_unhealthy + o.clears_unhealthy,
            replays: self.replays + o.replays,
            replays_complete: self.replays_complete + o.replays_complete,
            replays_failed: self.replays_failed + o.replays_failed,
            reconnects: self.reconnects + o.reconnects,
            rank_mismatch: self.rank_mismatch + o.rank_mismatch,
        }
    }
}

impl std::iter::Sum for FeedCounts {
    fn sum<I: Iterator<Item = FeedCounts>>(iter: I) -> FeedCounts {
        iter.fold(FeedCounts::default(), |a, b| a + b)
    }
}

/// One event feed: a worker's publisher of one DP rank. See the module docs.
#[derive(Debug)]
pub struct Feed {
    /// This rank's event endpoint (the configured one plus the rank).
    endpoint: String,
    /// This rank's replay endpoint, offset the same way.
    replay_endpoint: Option<String>,
    topic: String,
    rank: u32,
    dp_size: u32,
    source: SourceId,
    /// Base of the millisecond stamps below.
    origin: Instant,
    /// Last message, ms after `origin` plus 1; 0 = none yet.
    last_message: AtomicU64,
    /// First request routed to the worker since the last message from any of its ranks,
    /// same encoding; shared by the worker's ranks (see the module docs).
    routed_since: Arc<AtomicU64>,
    replaying: AtomicBool,
    connected: AtomicBool,
    /// Last live sequence number plus 1; 0 = none.
    last_seq: AtomicU64,
    /// Bumped by [`Feed::reset`]; the consumer compares it with the value it last saw.
    resets: AtomicU64,
    /// The block size of the last event skipped for having another one than
    /// `precise.block_size` (0 = none).
    foreign_block_size: AtomicU64,
    /// The worker's token parity, shared by its ranks.
    parity: Arc<super::parity::state::ParityState>,
    pub stats: FeedStats,
}

impl Feed {
    /// The feeds of the worker at `url`, one per rank of `config.dp_size`, in rank
    /// order. A feed's [`SourceId`] is derived from the URL, the `kv_events` config and
    /// the rank, so it is stable across reloads that keep them.
    pub fn ranks(url: &WorkerUrl, config: &KvEventsConfig, origin: Instant) -> Vec<Arc<Feed>> {
        let routed_since = Arc::new(AtomicU64::new(0));
        let parity = Arc::new(super::parity::state::ParityState::default());
        (0..config.dp_size.max(1))
            .map(|rank| {
                let endpoint = config.rank_endpoint(rank);
                let replay_endpoint = config.rank_replay_endpoint(rank);
                let identity = format!(
                    "{url}\n{endpoint}\n{}\n{}\n{rank}/{}",
                    config.topic,
                    replay_endpoint.as_deref().unwrap_or(""),
                    config.dp_size,
                );
                Arc::new(Feed {
                    source: SourceId(xxhash_rust::xxh3::xxh3_64(identity.as_bytes())),
                    endpoint,
                    replay_endpoint,
                    topic: config.topic.clone(),
                    rank,
                    dp_size: config.dp_size.max(1),
                    origin,
                    last_message: AtomicU64::new(0),
                    routed_since: Arc::clone(&routed_since),
                    replaying: AtomicBool::new(false),
                    connected: AtomicBool::new(false),
                    last_seq: AtomicU64::new(0),
                    resets: AtomicU64::new(0),
                    foreign_block_size: AtomicU64::new(0),
                    parity: Arc::clone(&parity),
                    stats: FeedStats::default(),
                })
            })
            .collect()
    }

    /// This rank's event endpoint, `tcp://host:port`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// This rank's replay endpoint, when replay is configured.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// The topic prefix subscribed to.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The DP rank this feed follows (0 to `dp_size - 1`).
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The worker's `kv_events.dp_size`.
    pub fn dp_size(&self) -> u32 {
        self.dp_size
    }

    pub fn source(&self) -> SourceId {
        self.source
    }

    /// Checks a batch's `data_parallel_rank` against this feed's rank; counts a
    /// mismatch in [`FeedStats::rank_mismatch`] and returns false for it.
    ///
    /// The batch is applied to this feed's rank either way: its sequence number belongs
    /// to the stream of the socket it came on, and so do the engine block hashes its
    /// events name (parents, removals), so filing it under another rank would break both
    /// ranks' sequence and hash state. The field is only a label; disagreement means the
    /// configuration and the engine number their ranks differently (a wrong `dp_size` or
    /// base port, or publishers that report global ranks, as in a multi-node
    /// deployment), which the counter makes visible. With `dp_size` 1 nothing is
    /// checked: the one publisher is the worker's whatever rank it reports (a server of
    /// an externally balanced deployment, `--data-parallel-rank k`, reports k on a port
    /// the configuration already names).
    pub fn check_rank(&self, dp_rank: Option<i64>) -> bool {
        match dp_rank {
            Some(r) if self.dp_size > 1 && r != i64::from(self.rank) => {
                FeedStats::inc(&self.stats.rank_mismatch);
                false
            }
            _ => true,
        }
    }

    fn stamp(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.origin).as_millis() as u64 + 1
    }

    fn at(&self, stamp: u64) -> Option<Instant> {
        (stamp > 0).then(|| self.origin + Duration::from_millis(stamp - 1))
    }

    /// A message arrived on the live socket (sequence `seq`, when it had one).
    pub fn note_message(&self, now: Instant, seq: Option<u64>) {
        // Relaxed throughout: each field is an independent hint; nothing else is
        // published through them.
        self.last_message.store(self.stamp(now), Ordering::Relaxed);
        self.routed_since.store(0, Ordering::Relaxed);
        if let Some(s) = seq {
            self.last_seq.store(s.saturating_add(1), Ordering::Relaxed);
        }
    }

    /// A request was routed to this worker (starts the staleness clock of all its
    /// ranks if it is not running).
    pub fn note_routed(&self, now: Instant) {
        let _ = self.routed_since.compare_exchange(
            0,
            self.stamp(now),
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
    }

    pub fn set_replaying(&self, on: bool) {
        self.replaying.store(on, Ordering::Relaxed);
    }

    pub fn set_connected(&self, on: bool) {
        self.connected.store(on, Ordering::Relaxed);
    }

    /// Whether the consumer is connected to the publisher now.
    pub fn is_connected(&self) -> bool {
        self.connected.load(Ordering::Relaxed)
    }

    /// The last sequence number received on the live socket.
    pub fn last_seq(&self) -> Option<u64> {
        self.last_seq.load(Ordering::Relaxed).checked_sub(1)
    }

    /// Seconds since the last message, `None` before the first.
    pub fn seconds_since_message(&self, now: Instant) -> Option<f64> {
        self.at(self.last_message.load(Ordering::Relaxed))
            .map(|t| now.saturating_duration_since(t).as_secs_f64())
    }

    /// Tells the consumer to forget the feed's sequence state: it clears the rank's
    /// blocks again and takes the next batch as a first contact (a replay from 0 when
    /// a replay endpoint exists, spec §7.4 point 5). The caller clears the blocks now
    /// too; the consumer acts on its next message or check (within
    /// [`RESET_CHECK_EVERY`]).
    pub fn reset(&self) {
        // Relaxed: the consumer only compares values; the index lock orders the clears.
        self.resets.fetch_add(1, Ordering::Relaxed);
    }

    /// How many resets were asked for so far (see [`Feed::reset`]).
    pub fn resets(&self) -> u64 {
        self.resets.load(Ordering::Relaxed)
    }

    /// The worker's token parity (shared by its ranks).
    pub fn parity(&self) -> &super::parity::state::ParityState {
        &self.parity
    }

    /// An event was skipped for its block size, `size` tokens.
    pub fn note_foreign_block_size(&self, size: usize) {
        self.foreign_block_size
            .store(size as u64, Ordering::Relaxed);
    }

    /// The block size of the last event skipped for it, when one was.
    pub fn foreign_block_size(&self) -> Option<usize> {
        match self.foreign_block_size.load(Ordering::Relaxed) {
            0 => None,
            n => Some(n as usize),
        }
    }

    /// Times the router dropped this rank's blocks (engine clears, gaps, restarts,
    /// resets): a parity check that spans one is not counted.
    pub fn clears(&self) -> u64 {
        let s = &self.stats;
        let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
        n(&s.cleared)
            + n(&s.clears_gap)
            + n(&s.clears_restart)
            + n(&s.clears_reconnect)
            + n(&s.clears_unhealthy)
            + self.resets()
    }

    /// The state at `now`, with `stale` = `precise.stale_secs`: [`Feed::events_state`],
    /// or [`FeedState::ParityLost`] for a live feed whose worker lost token parity.
    pub fn state(&self, now: Instant, stale: Duration) -> FeedState {
        match self.events_state(now, stale) {
            FeedState::Live if self.parity.is_lost() => FeedState::ParityLost,
            st => st,
        }
    }

    /// The state of the event stream alone (parity aside).
    pub fn events_state(&self, now: Instant, stale: Duration) -> FeedState {
        if !self.is_connected() {
            return FeedState::Disconnected;
        }
        if self.replaying.load(Ordering::Relaxed) {
            return FeedState::Replaying;
        }
        match self.at(self.routed_since.load(Ordering::Relaxed)) {
            Some(t) if now.saturating_duration_since(t) > stale => FeedState::Stale,
            _ => FeedState::Live,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(dp_size: u32) -> KvEventsConfig {
        KvEventsConfig {
            endpoint: "tcp://127.0.0.1:5557".into(),
            topic: String::new(),
            replay_endpoint: Some("tcp://127.0.0.1:6557".into()),
            dp_size,
        }
    }

    fn feed(origin: Instant) -> Arc<Feed> {
        let url = WorkerUrl::parse("http://127.0.0.1:8000").unwrap();
        let f = Feed::ranks(&url, &config(1), origin).remove(0);
        f.set_connected(true);
        f
    }

    #[test]
    fn a_feed_without_its_publisher_is_neutral() {
        let t = Instant::now();
        let f = feed(t);
        f.set_connected(false);
        assert_eq!(f.state(t, Duration::from_secs(5)), FeedState::Disconnected);
        f.set_connected(true);
        assert_eq!(f.state(t, Duration::from_secs(5)), FeedState::Live);
    }

    #[test]
    fn stale_only_when_requests_flow_without_messages() {
        let t = Instant::now();
        let stale = Duration::from_secs(5);
        let f = feed(t);
        let later = |s| t + Duration::from_secs(s);
        // Silence without traffic is fine.
        assert_eq!(f.state(later(100), stale), FeedState::Live);
        f.note_routed(later(100));
        f.note_routed(later(104)); // the clock keeps the first request
        assert_eq!(f.state(later(105), stale), FeedState::Live);
        assert_eq!(f.state(later(106), stale), FeedState::Stale);
        f.note_message(later(106), Some(9));
        assert_eq!(f.state(later(200), stale), FeedState::Live);
        assert_eq!(f.last_seq(), Some(9));
        assert_eq!(f.seconds_since_message(later(110)), Some(4.0));
        f.set_replaying(true);
        assert_eq!(f.state(later(200), stale), FeedState::Replaying);
    }

    #[test]
    fn source_id_follows_url_and_config() {
        let t = Instant::now();
        assert_eq!(feed(t).source(), feed(t).source());
        let other = Feed::ranks(
            &WorkerUrl::parse("http://127.0.0.1:8001").unwrap(),
            &config(1),
            t,
        );
        assert_ne!(other[0].source(), feed(t).source());
    }

    #[test]
    fn ranks_offset_their_ports_and_share_the_staleness_clock() {
        let t = Instant::now();
        let url = WorkerUrl::parse("http://127.0.0.1:8000").unwrap();
        let ranks = Feed::ranks(&url, &config(3), t);
        ranks.iter().for_each(|f| f.set_connected(true));
        let eps: Vec<(&str, Option<&str>, u32)> = ranks
            .iter()
            .map(|f| (f.endpoint(), f.replay_endpoint(), f.rank()))
            .collect();
        assert_eq!(
            eps,
            [
                ("tcp://127.0.0.1:5557", Some("tcp://127.0.0.1:6557"), 0),
                ("tcp://127.0.0.1:5558", Some("tcp://127.0.0.1:6558"), 1),
                ("tcp://127.0.0.1:5559", Some("tcp://127.0.0.1:6559"), 2),
            ]
        );
        let sources: std::collections::HashSet<_> = ranks.iter().map(|f| f.source()).collect();
        assert_eq!(sources.len(), 3);
        // A request starts every rank's clock; a message from any rank stops it.
        let stale = Duration::from_secs(5);
        let later = |s| t + Duration::from_secs(s);
        ranks[0].note_routed(later(10));
        assert!(
            ranks
                .iter()
                .all(|f| f.state(later(16), stale) == FeedState::Stale)
        );
        ranks[2].note_message(later(16), Some(0));
        assert!(
            ranks
                .iter()
                .all(|f| f.state(later(30), stale) == FeedState::Live)
        );
        assert_eq!((ranks[0].last_seq(), ranks[2].last_seq()), (None, Some(0)));
        // The worst state sums a worker up.
        ranks[1].set_replaying(true);
        let worst = ranks.iter().map(|f| f.state(later(30), stale)).max();
        assert_eq!(worst, Some(FeedState::Replaying));
    }

    #[test]
    fn a_batch_from_another_rank_is_counted() {
        let t = Instant::now();
        let url = WorkerUrl::parse("http://127.0.0.1:8000").unwrap();
        let ranks = Feed::ranks(&url, &config(2), t);
        assert!(ranks[1].check_rank(Some(1)));
        assert!(ranks[1].check_rank(None), "vLLM before mid-2025 sends none");
        assert!(!ranks[1].check_rank(Some(0)));
        assert_eq!(ranks[1].stats.counts().rank_mismatch, 1);
        // One rank: whatever rank its publisher reports.
        assert!(feed(t).check_rank(Some(3)));
        assert_eq!(feed(t).stats.counts().rank_mismatch, 0);
        let sum: FeedCounts = ranks.iter().map(|f| f.stats.counts()).sum();
        assert_eq!(sum.rank_mismatch, 1);
    }
}

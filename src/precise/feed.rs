//! [`Feed`]: one worker's KV-event feed as the rest of the router sees it — its
//! identity in the block index, whether its entries may be scored now, and its
//! counters. Written by that worker's consumer task, read by the request path,
//! `/workers` and `/metrics`; plain atomics, no locks.
//!
//! A feed is *scorable* unless it is replaying (a gap is being filled: entries may miss
//! removals) or stale: requests were routed to the worker and then `precise.stale_secs`
//! passed with no message from it (the feed is broken or the engine stuck). A silent
//! feed with no traffic is not stale: an idle engine publishes nothing (spec §3).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::index::SourceId;
use crate::config::{KvEventsConfig, WorkerUrl};

/// Longest a consumer waiting for messages takes to act on a [`Feed::reset`].
pub const RESET_CHECK_EVERY: Duration = Duration::from_millis(250);

/// A feed's state, for scoring and `/workers`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeedState {
    /// Following the stream: entries are scored.
    Live,
    /// Filling a sequence gap by replay: neutral until it ends.
    Replaying,
    /// Requests flowed, events did not: neutral until the next message.
    Stale,
}

impl FeedState {
    pub fn as_str(self) -> &'static str {
        match self {
            FeedState::Live => "live",
            FeedState::Replaying => "replaying",
            FeedState::Stale => "stale",
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
    /// Events of another tier, group or block size (not indexed).
    pub ignored: AtomicU64,
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
}

impl FeedStats {
    /// Adds one (Relaxed: independent counters, read for display only).
    pub fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// One worker's event feed. See the module docs.
#[derive(Debug)]
pub struct Feed {
    config: KvEventsConfig,
    source: SourceId,
    /// Base of the millisecond stamps below.
    origin: Instant,
    /// Last message, ms after `origin` plus 1; 0 = none yet.
    last_message: AtomicU64,
    /// First request routed to the worker since the last message, same encoding.
    routed_since: AtomicU64,
    replaying: AtomicBool,
    connected: AtomicBool,
    /// Last live sequence number plus 1; 0 = none.
    last_seq: AtomicU64,
    /// Bumped by [`Feed::reset`]; the consumer compares it with the value it last saw.
    resets: AtomicU64,
    pub stats: FeedStats,
}

impl Feed {
    /// The feed of the worker at `url`. Its [`SourceId`] is derived from the URL and
    /// the `kv_events` config, so it is stable across reloads that keep both.
    pub fn new(url: &WorkerUrl, config: KvEventsConfig, origin: Instant) -> Self {
        let identity = format!(
            "{url}\n{}\n{}\n{}",
            config.endpoint,
            config.topic,
            config.replay_endpoint.as_deref().unwrap_or("")
        );
        Feed {
            source: SourceId(xxhash_rust::xxh3::xxh3_64(identity.as_bytes())),
            config,
            origin,
            last_message: AtomicU64::new(0),
            routed_since: AtomicU64::new(0),
            replaying: AtomicBool::new(false),
            connected: AtomicBool::new(false),
            last_seq: AtomicU64::new(0),
            resets: AtomicU64::new(0),
            stats: FeedStats::default(),
        }
    }

    pub fn config(&self) -> &KvEventsConfig {
        &self.config
    }

    pub fn source(&self) -> SourceId {
        self.source
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

    /// A request was routed to this worker (starts the staleness clock if it is not
    /// running).
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

    /// Tells the consumer to forget the feed's sequence state: it clears the worker's
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

    /// The state at `now`, with `stale` = `precise.stale_secs`.
    pub fn state(&self, now: Instant, stale: Duration) -> FeedState {
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

    fn feed(origin: Instant) -> Feed {
        Feed::new(
            &WorkerUrl::parse("http://127.0.0.1:8000").unwrap(),
            KvEventsConfig {
                endpoint: "tcp://127.0.0.1:5557".into(),
                topic: String::new(),
                replay_endpoint: None,
            },
            origin,
        )
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
        let other = Feed::new(
            &WorkerUrl::parse("http://127.0.0.1:8001").unwrap(),
            feed(t).config().clone(),
            t,
        );
        assert_ne!(other.source(), feed(t).source());
    }
}

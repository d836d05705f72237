//! One feed's event consumer (a worker has one per DP rank, each with its own sockets,
//! sequence and index source): a ZeroMQ SUB socket on the rank's publisher, a DEALER on
//! its replay service when configured, and the [`Sequencer`] in between; decoded
//! batches go into the shared [`BlockIndex`](super::index::BlockIndex).
//!
//! Sockets come from the pure-Rust `zeromq` crate on tokio. The SUB socket reconnects
//! by itself when the publisher goes away (the crate backs off up to 30 s and re-sends
//! the subscription); when the socket itself fails or cannot connect, this task drops
//! it and dials again after a backoff of 100 ms doubling to 5 s. Sequence state
//! survives reconnects, so the first message after one shows any gap or restart; a
//! lost connection (the socket monitor's `Disconnected`, or a failed socket) is told to
//! the [`Sequencer`], which takes a forward jump on that first message as an engine
//! restart (rule and trade-off in [`super::sequence`]).
//!
//! The health checker asks for a reset through [`Feed::reset`] when the worker turns
//! unhealthy; the consumer acts on it before its next message and at least every
//! [`RESET_CHECK_EVERY`]: it clears the rank's blocks, drops a replay under way, and
//! forgets the sequence, so the next message is a first contact.
//!
//! A batch whose `data_parallel_rank` is not the feed's is counted and applied to the
//! feed's rank all the same ([`Feed::check_rank`] says why).
//!
//! Nothing here panics on input: a message that does not decode is counted and skipped
//! (its sequence number still counts, when it had a readable one). The index lock is
//! taken per event, never across an `.await`.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use tokio::time::Instant;
use zeromq::{
    DealerSocket, Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend, SubSocket, ZmqMessage,
};

use super::Precise;
use super::events::{self, Batch, ReplayFrame};
use super::feed::{Feed, FeedStats, RESET_CHECK_EVERY};
use super::index::{Applied, Skip};
use super::sequence::{ClearCause, Sequencer, Step};
use crate::shutdown::Shutdown;

/// Bound on one connection attempt (TCP connect + ZMTP handshake, retried inside).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Backoff between attempts to (re)create the SUB socket: 100 ms doubling to 5 s.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// A replay with no reply for this long is given up (the worker's entries are then
/// cleared); each reply restarts the clock.
const REPLAY_IDLE_TIMEOUT: Duration = Duration::from_secs(2);

type Seq = Sequencer<Option<Batch>>;

/// Consumes `feed`'s events into `precise`'s index until `shutdown` (or until the
/// supervisor aborts the task because the worker left the pool).
pub async fn run(feed: Arc<Feed>, precise: Arc<Precise>, mut shutdown: Shutdown) {
    let endpoint = feed.endpoint().to_string();
    let resets_seen = feed.resets();
    let mut consumer = Consumer {
        seq: Sequencer::new(feed.replay_endpoint().is_some()),
        feed,
        precise,
        dealer: None,
        replay_deadline: None,
        publisher: None,
        warned_block_size: false,
        warned_rank: false,
        resets_seen,
    };
    let mut backoff = BACKOFF_MIN;
    let mut connections = 0u64;
    loop {
        let attempt = tokio::select! {
            r = tokio::time::timeout(CONNECT_TIMEOUT, subscribe(&endpoint, consumer.feed.topic())) => r,
            _ = shutdown.wait() => return,
        };
        match attempt {
            Ok(Ok((sub, monitor))) => {
                connections += 1;
                if connections > 1 {
                    FeedStats::inc(&consumer.feed.stats.reconnects);
                }
                tracing::info!(endpoint = %endpoint, "kv-events: subscribed");
                backoff = BACKOFF_MIN;
                consumer.feed.set_connected(true);
                let stopped = consumer.session(sub, monitor, &mut shutdown).await;
                consumer.feed.set_connected(false);
                if stopped {
                    return;
                }
                consumer.seq.disconnected();
            }
            Ok(Err(e)) => {
                tracing::warn!(endpoint = %endpoint, error = %e, "kv-events: cannot subscribe")
            }
            Err(_) => tracing::warn!(endpoint = %endpoint, "kv-events: connect timed out"),
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = shutdown.wait() => return,
        }
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

async fn subscribe(
    endpoint: &str,
    topic: &str,
) -> zeromq::ZmqResult<(
    SubSocket,
    impl Stream<Item = SocketEvent> + Unpin + Send + use<>,
)> {
    let mut options = SocketOptions::default();
    options.connect_timeout(CONNECT_TIMEOUT);
    let mut sub = SubSocket::with_options(options);
    let monitor = sub.monitor();
    sub.connect(endpoint).await?;
    sub.subscribe(topic).await?;
    Ok((sub, monitor))
}

struct Consumer {
    feed: Arc<Feed>,
    precise: Arc<Precise>,
    seq: Seq,
    dealer: Option<DealerSocket>,
    /// When the replay under way is given up.
    replay_deadline: Option<Instant>,
    /// Digest of the last `publisher_id` seen.
    publisher: Option<u64>,
    warned_block_size: bool,
    warned_rank: bool,
    /// [`Feed::resets`] when last acted on.
    resets_seen: u64,
}

impl Consumer {
    /// Receives until the socket fails (returns false: reconnect) or shutdown (true).
    async fn session(
        &mut self,
        mut sub: SubSocket,
        mut monitor: impl Stream<Item = SocketEvent> + Unpin,
        shutdown: &mut Shutdown,
    ) -> bool {
        let mut monitor_open = true;
        let mut connects = 0u32;
        let mut reset_check = tokio::time::interval(RESET_CHECK_EVERY);
        reset_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let deadline = self.replay_deadline;
            tokio::select! {
                msg = sub.recv() => match msg {
                    Ok(m) => self.on_live(m).await,
                    Err(e) => {
                        tracing::warn!(endpoint = %self.feed.endpoint(), error = %e, "kv-events: receive failed; reconnecting");
                        return false;
                    }
                },
                reply = recv_replay(self.dealer.as_mut()) => match reply {
                    Ok(m) => self.on_replay(m).await,
                    Err(e) => {
                        tracing::warn!(error = %e, "kv-events: replay socket failed");
                        self.dealer = None;
                        self.give_up_replay().await;
                    }
                },
                event = monitor.next(), if monitor_open => match event {
                    Some(SocketEvent::Connected(..)) => {
                        connects += 1;
                        if connects > 1 {
                            FeedStats::inc(&self.feed.stats.reconnects);
                            tracing::info!(endpoint = %self.feed.endpoint(), "kv-events: reconnected");
                        }
                        self.feed.set_connected(true);
                    }
                    Some(SocketEvent::Disconnected(_)) => {
                        tracing::info!(endpoint = %self.feed.endpoint(), "kv-events: publisher disconnected");
                        self.feed.set_connected(false);
                        self.seq.disconnected();
                    }
                    Some(_) => {}
                    None => monitor_open = false,
                },
                _ = sleep_until(deadline) => {
                    tracing::warn!(endpoint = %self.feed.endpoint(), "kv-events: replay timed out");
                    self.dealer = None;
                    self.give_up_replay().await;
                }
                _ = reset_check.tick() => self.check_reset(),
                _ = shutdown.wait() => return true,
            }
        }
    }

    /// Acts on a [`Feed::reset`] asked for since the last check: clears the worker's
    /// blocks (again: the health checker cleared them, but a batch may have been
    /// applied since), abandons a replay, forgets the sequence and publisher.
    fn check_reset(&mut self) {
        let resets = self.feed.resets();
        if resets == self.resets_seen {
            return;
        }
        self.resets_seen = resets;
        self.seq.reset();
        self.dealer = None;
        self.replay_deadline = None;
        self.publisher = None;
        self.feed.set_replaying(false);
        self.precise.index().clear_source(self.feed.source());
        tracing::info!(endpoint = %self.feed.endpoint(), "kv-events: feed reset; the next message is a first contact");
    }

    async fn on_live(&mut self, msg: ZmqMessage) {
        self.check_reset();
        let now = crate::clock::now();
        let frames = msg.into_vec();
        let (seq, batch) = match events::live_frames(&frames) {
            Ok((seq, payload)) => (seq, self.decode(payload)),
            Err(e) => {
                FeedStats::inc(&self.feed.stats.messages);
                self.malformed(&e);
                self.feed.note_message(now, None);
                return;
            }
        };
        FeedStats::inc(&self.feed.stats.messages);
        self.feed.note_message(now, Some(seq));
        if let Some(id) = batch.as_ref().and_then(|b| b.publisher_id.as_ref())
            && self.publisher_changed(id)
        {
            let steps = self.seq.publisher_changed();
            self.carry_out(steps).await;
        }
        let steps = self.seq.live(seq, batch);
        self.carry_out(steps).await;
    }

    async fn on_replay(&mut self, msg: ZmqMessage) {
        self.check_reset();
        let frames = msg.into_vec();
        let steps = match events::replay_frames(&frames) {
            Ok(ReplayFrame::Batch { seq, payload }) => {
                let batch = self.decode(payload);
                self.replay_deadline = self
                    .replay_deadline
                    .map(|_| Instant::now() + REPLAY_IDLE_TIMEOUT);
                self.seq.replayed(seq, batch)
            }
            Ok(ReplayFrame::End) => {
                self.replay_deadline = None;
                self.seq.replay_done()
            }
            Err(e) => {
                self.malformed(&e);
                return;
            }
        };
        self.carry_out(steps).await;
    }

    /// Records the batch's publisher id (NEWEST batches carry one, §8); true when it
    /// differs from the last one seen: the publisher restarted.
    fn publisher_changed(&mut self, id: &[u8]) -> bool {
        let key = xxhash_rust::xxh3::xxh3_64(id);
        let changed = self.publisher.is_some_and(|last| last != key);
        self.publisher = Some(key);
        changed
    }

    fn decode(&mut self, payload: &[u8]) -> Option<Batch> {
        match events::decode_batch(payload) {
            Ok(b) => {
                if !self.feed.check_rank(b.dp_rank) && !self.warned_rank {
                    self.warned_rank = true;
                    tracing::warn!(
                        endpoint = %self.feed.endpoint(),
                        rank = self.feed.rank(),
                        batch_rank = b.dp_rank,
                        "kv-events: batch from another data-parallel rank than this port's (check kv_events.dp_size and the ports); applied to this port's rank"
                    );
                }
                Some(b)
            }
            Err(e) => {
                self.malformed(&e);
                None
            }
        }
    }

    fn malformed(&self, e: &events::DecodeError) {
        FeedStats::inc(&self.feed.stats.malformed);
        tracing::debug!(endpoint = %self.feed.endpoint(), error = %e, "kv-events: malformed message skipped");
    }

    async fn give_up_replay(&mut self) {
        self.check_reset();
        self.replay_deadline = None;
        let steps = self.seq.replay_failed();
        self.carry_out(steps).await;
    }

    /// Carries out the sequencer's steps; asks for a replay last (it awaits the
    /// socket), and gives it up at once when it cannot be asked.
    async fn carry_out(&mut self, mut steps: Vec<Step<Option<Batch>>>) {
        loop {
            let Some(from) = self.take_steps(steps) else {
                return;
            };
            FeedStats::inc(&self.feed.stats.replays);
            match self.request_replay(from).await {
                Ok(()) => {
                    self.replay_deadline = Some(Instant::now() + REPLAY_IDLE_TIMEOUT);
                    tracing::info!(endpoint = %self.feed.endpoint(), from, "kv-events: replay requested");
                    return;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "kv-events: cannot ask for replay");
                    self.dealer = None;
                    steps = self.seq.replay_failed();
                }
            }
        }
    }

    /// Carries out every step but a replay request, whose start it returns.
    fn take_steps(&mut self, steps: Vec<Step<Option<Batch>>>) -> Option<u64> {
        let mut replay_from = None;
        for step in steps {
            match step {
                Step::Apply(_, Some(batch)) => self.apply(&batch),
                Step::Apply(_, None) => {}
                Step::Clear(cause) => {
                    self.precise.index().clear_source(self.feed.source());
                    let stats = &self.feed.stats;
                    FeedStats::inc(match cause {
                        ClearCause::Gap => &stats.clears_gap,
                        ClearCause::Restart => &stats.clears_restart,
                        ClearCause::Reconnect => &stats.clears_reconnect,
                    });
                    tracing::warn!(
                        endpoint = %self.feed.endpoint(),
                        cause = cause.as_str(),
                        "kv-events: worker's blocks cleared"
                    );
                }
                Step::RequestReplay(from) => replay_from = Some(from),
                Step::Gap { expected, got } => {
                    FeedStats::inc(&self.feed.stats.gaps);
                    tracing::warn!(endpoint = %self.feed.endpoint(), expected, got, "kv-events: sequence gap");
                }
                Step::Restart => {
                    FeedStats::inc(&self.feed.stats.restarts);
                    // A replay under way belongs to the old life: drop its socket, so
                    // late answers cannot be taken for a new replay's.
                    self.dealer = None;
                    self.replay_deadline = None;
                    tracing::info!(endpoint = %self.feed.endpoint(), "kv-events: publisher restarted");
                }
                Step::ReplayComplete => FeedStats::inc(&self.feed.stats.replays_complete),
                Step::ReplayFailed => {
                    FeedStats::inc(&self.feed.stats.replays_failed);
                    tracing::warn!(endpoint = %self.feed.endpoint(), "kv-events: replay could not close the gap");
                }
            }
        }
        self.feed.set_replaying(self.seq.is_replaying());
        replay_from
    }

    /// Sends `[empty, start_seq]` on the DEALER (§7.1), connecting it first if needed.
    async fn request_replay(&mut self, from: u64) -> Result<(), String> {
        let Some(endpoint) = self.feed.replay_endpoint().map(str::to_string) else {
            return Err("no replay endpoint".into());
        };
        if self.dealer.is_none() {
            let mut options = SocketOptions::default();
            options.connect_timeout(REPLAY_IDLE_TIMEOUT);
            let mut dealer = DealerSocket::with_options(options);
            tokio::time::timeout(REPLAY_IDLE_TIMEOUT, dealer.connect(&endpoint))
                .await
                .map_err(|_| format!("connecting {endpoint} timed out"))?
                .map_err(|e| format!("connecting {endpoint}: {e}"))?;
            self.dealer = Some(dealer);
        }
        let request = ZmqMessage::try_from(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&events::replay_request(from)),
        ])
        .map_err(|e| e.to_string())?;
        let dealer = self.dealer.as_mut().ok_or("no replay socket")?;
        tokio::time::timeout(REPLAY_IDLE_TIMEOUT, dealer.send(request))
            .await
            .map_err(|_| "sending the replay request timed out".to_string())?
            .map_err(|e| e.to_string())
    }

    /// Applies one batch, one index lock per event.
    fn apply(&mut self, batch: &Batch) {
        let stats = &self.feed.stats;
        for _ in 0..batch.skipped {
            FeedStats::inc(&stats.skipped_events);
        }
        let source = self.feed.source();
        for event in &batch.events {
            let applied = self.precise.index().apply(source, event);
            match applied {
                Applied::Stored { unknown, .. } => {
                    FeedStats::inc(&stats.stored);
                    if unknown > 0 {
                        // Relaxed: an independent counter, read for display only.
                        stats
                            .unknown_hashes
                            .fetch_add(unknown as u64, std::sync::atomic::Ordering::Relaxed);
                    }
                }
                Applied::Removed(_) => FeedStats::inc(&stats.removed),
                Applied::Cleared => FeedStats::inc(&stats.cleared),
                Applied::Skipped(Skip::UnknownParent) => FeedStats::inc(&stats.unknown_parent),
                Applied::Skipped(Skip::BlockSize(got)) => {
                    FeedStats::inc(&stats.ignored);
                    self.feed.note_foreign_block_size(got);
                    if !self.warned_block_size {
                        self.warned_block_size = true;
                        tracing::warn!(
                            endpoint = %self.feed.endpoint(),
                            engine_block_size = got,
                            router_block_size = self.precise.config().block_size,
                            "kv-events: block size differs from precise.block_size; this worker's blocks are not indexed"
                        );
                    }
                }
                Applied::Skipped(Skip::OtherGroup) => FeedStats::inc(&stats.ignored),
            }
        }
    }
}

/// The next replay reply, or never when there is no replay socket.
async fn recv_replay(dealer: Option<&mut DealerSocket>) -> zeromq::ZmqResult<ZmqMessage> {
    match dealer {
        Some(d) => d.recv().await,
        None => std::future::pending().await,
    }
}

/// Sleeps until `deadline`, or forever without one.
async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

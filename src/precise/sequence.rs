//! [`Sequencer`]: keeps one feed's batches in sequence order, detects gaps and
//! publisher restarts, and drives replay. Pure: the consumer feeds it what arrived and
//! carries out the [`Step`]s it returns.
//!
//! Implements `shared/docs/vllm-kv-events.md` §3 (sequence semantics) and §7.4 (gap
//! handling), per feed (one publisher = one worker and DP rank):
//!
//! - first contact: sequence 0 is applied; a later one (the ZeroMQ slow joiner) starts
//!   a replay from 0 when a replay endpoint is configured — whatever the engine still
//!   buffers is applied, a shorter buffer is accepted — or is taken as a cold start;
//! - `seq == next`: applied;
//! - `seq > next`, a gap: with replay, live batches are buffered, replay is asked from
//!   `next`, replayed batches are applied in order, then the buffer; the feed is in
//!   [`Sequencer::is_replaying`] meanwhile (the worker scores neutral). When the replay
//!   cannot close the gap (it starts later, ends early, times out) or without replay:
//!   the worker's entries are cleared and the stream is followed from where it is;
//! - a live sequence number at or below the last live one: the publisher restarted
//!   (the live socket is ordered, so this is never a reordering); its state is void;
//! - a live number below `next` but above the last live one: the live copy of a batch
//!   the replay already delivered (§7.2), skipped;
//! - the first live number after a reconnect ([`Sequencer::disconnected`]) that jumps
//!   forward (`seq > last + 1`): taken as a restart too, see below;
//! - [`Sequencer::reset`] (the worker turned unhealthy): everything is forgotten, the
//!   next batch is a first contact again.
//!
//! # A forward jump after a reconnect
//!
//! The live socket drops what is published while it is disconnected, so after a
//! reconnect `seq > last + 1` is what a network blip on a busy engine shows: a plain
//! gap. It is also what an engine that restarted meanwhile shows once it has published
//! more batches than we had seen of its previous life. The number cannot tell them
//! apart (only a `publisher_id`, §8, could), and taking a restart for a gap is unsafe
//! exactly when a replay endpoint exists: §7.4 point 2 asks the *new* engine to replay
//! from `next`, its buffer answers with its own batches from `next` on, point 3's check
//! (first replayed sequence `> next`) passes, and the old life's blocks stay indexed,
//! drawing requests to a cold cache until they age out of the index. The spec's rules
//! are safe in the other cases: no replay endpoint (the gap clears, §7.4 point 3), a
//! new engine still at or below our last number (point 4), one whose buffer no longer
//! reaches `next` (point 3), a new `publisher_id` (§8).
//!
//! Rule: after a reconnect, a first live number above `last + 1` is a restart
//! ([`Step::Restart`], [`ClearCause::Reconnect`]): the worker's blocks are cleared and
//! the feed starts over as on first contact (§7.4 points 4–5), with a replay from 0
//! when a replay endpoint exists, else cold from the batch seen. `seq == last + 1`
//! (nothing missed) carries on, so a blip on an idle engine costs nothing.
//!
//! Trade-off: a blip on a busy engine costs a rebuild from the engine's replay buffer
//! (up to its last 10000 batches, §7.2, served between its live sends; the worker
//! scores neutral meanwhile) instead of a replay of the few batches missed. The
//! rebuild is exact while the buffer still holds the engine's whole life; past that
//! it misses blocks stored earlier, which under-reports the worker's cache (fewer hits
//! routed there) instead of over-reporting it (requests sent to a cold cache). Not
//! caught: a new engine whose first batch we see is exactly `last + 1`; the health
//! checker's reset (see [`Sequencer::reset`]) covers a restart long enough to fail
//! its probes, whatever the numbers.

/// Live batches buffered during a replay before it is given up.
pub const MAX_BUFFERED: usize = 10_000;

/// What the consumer does next.
#[derive(Debug, PartialEq)]
pub enum Step<T> {
    /// Apply this batch (sequence number, batch) to the index.
    Apply(u64, T),
    /// Drop the worker's entries.
    Clear(ClearCause),
    /// Ask the replay service for every batch from this sequence number on.
    RequestReplay(u64),
    /// A gap was seen (expected, received).
    Gap { expected: u64, got: u64 },
    /// The publisher restarted (or, after a reconnect, is taken to have).
    Restart,
    /// The replay closed the gap.
    ReplayComplete,
    /// The replay could not close the gap (its entries were cleared if they mattered).
    ReplayFailed,
}

/// Why the worker's entries were dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClearCause {
    /// A gap no replay could fill (§7.4 point 3).
    Gap,
    /// The publisher restarted: its sequence went back (§7.4 point 4), or a new
    /// `publisher_id` (§8).
    Restart,
    /// A forward jump on the first batch after a reconnect, taken as a restart (see
    /// the module docs).
    Reconnect,
}

impl ClearCause {
    /// Label used in logs, metrics and `/workers`.
    pub fn as_str(self) -> &'static str {
        match self {
            ClearCause::Gap => "gap",
            ClearCause::Restart => "restart",
            ClearCause::Reconnect => "reconnect",
        }
    }
}

#[derive(Debug)]
struct Replay<T> {
    /// Live batches that arrived meanwhile, in arrival (= sequence) order.
    buffered: Vec<(u64, T)>,
    /// Whether a shorter replay is acceptable (first contact: nothing to lose).
    lossy_ok: bool,
    /// Whether it already failed to close the gap (entries cleared).
    failed: bool,
}

/// One feed's sequence state. See the module docs.
#[derive(Debug)]
pub struct Sequencer<T> {
    can_replay: bool,
    /// The sequence number expected next; `None` before first contact.
    next: Option<u64>,
    /// The last sequence number seen on the live socket.
    last_live: Option<u64>,
    replay: Option<Replay<T>>,
    /// The live socket lost its connection since the last live batch.
    resumed: bool,
}

impl<T> Sequencer<T> {
    /// A feed with (`can_replay`) or without a replay endpoint.
    pub fn new(can_replay: bool) -> Self {
        Sequencer {
            can_replay,
            next: None,
            last_live: None,
            replay: None,
            resumed: false,
        }
    }

    /// Whether a replay is under way (the index is not whole until it ends).
    pub fn is_replaying(&self) -> bool {
        self.replay.is_some()
    }

    /// The last sequence number seen on the live socket.
    pub fn last_seq(&self) -> Option<u64> {
        self.last_live
    }

    /// The live socket lost its connection: the next live batch is judged as the
    /// first after a reconnect (see the module docs).
    pub fn disconnected(&mut self) {
        self.resumed = true;
    }

    /// Forgets everything, as if the feed had never been heard from: the next live
    /// batch is a first contact. A replay under way is abandoned (its late answers are
    /// ignored). The caller clears the worker's entries.
    pub fn reset(&mut self) {
        *self = Sequencer::new(self.can_replay);
    }

    /// A batch from the live socket.
    pub fn live(&mut self, seq: u64, batch: T) -> Vec<Step<T>> {
        let mut out = Vec::new();
        let resumed = std::mem::take(&mut self.resumed);
        match self.last_live {
            Some(last) if seq <= last => {
                out.push(Step::Restart);
                self.restart(ClearCause::Restart, &mut out);
            }
            Some(last) if resumed && seq > last.saturating_add(1) => {
                out.push(Step::Restart);
                self.restart(ClearCause::Reconnect, &mut out);
            }
            _ => {}
        }
        self.last_live = Some(seq);
        if let Some(r) = &mut self.replay {
            r.buffered.push((seq, batch));
            if r.buffered.len() > MAX_BUFFERED {
                self.fail(&mut out);
            }
            return out;
        }
        match self.next {
            None if seq == 0 => self.apply(seq, batch, &mut out),
            None if self.can_replay => self.start_replay(0, seq, batch, true, &mut out),
            None => self.apply(seq, batch, &mut out),
            Some(n) if seq == n => self.apply(seq, batch, &mut out),
            Some(n) if seq < n => {} // a live copy of a replayed batch
            Some(n) => {
                out.push(Step::Gap {
                    expected: n,
                    got: seq,
                });
                if self.can_replay {
                    self.start_replay(n, seq, batch, false, &mut out);
                } else {
                    out.push(Step::Clear(ClearCause::Gap));
                    self.apply(seq, batch, &mut out);
                }
            }
        }
        out
    }

    /// The publisher changed identity (a new `publisher_id`): same as a restart.
    pub fn publisher_changed(&mut self) -> Vec<Step<T>> {
        let mut out = vec![Step::Restart];
        self.restart(ClearCause::Restart, &mut out);
        out
    }

    /// A batch from the replay service. Ignored when no replay is under way (a late
    /// answer to one given up).
    pub fn replayed(&mut self, seq: u64, batch: T) -> Vec<Step<T>> {
        let mut out = Vec::new();
        if self.replay.is_some() {
            self.ordered(seq, batch, &mut out);
        }
        out
    }

    /// The replay service's terminator: apply what was buffered meanwhile and resume.
    pub fn replay_done(&mut self) -> Vec<Step<T>> {
        let mut out = Vec::new();
        let Some(buffered) = self
            .replay
            .as_mut()
            .map(|r| std::mem::take(&mut r.buffered))
        else {
            return out;
        };
        for (seq, batch) in buffered {
            self.ordered(seq, batch, &mut out);
        }
        if self.replay.take().is_some_and(|r| !r.failed) {
            out.push(Step::ReplayComplete);
        }
        out
    }

    /// The replay timed out or could not be asked for: give it up.
    pub fn replay_failed(&mut self) -> Vec<Step<T>> {
        let mut out = Vec::new();
        if self.replay.is_some() {
            self.fail(&mut out);
        }
        out
    }

    /// Voids the publisher's state: clears, then the next batch is a first contact.
    fn restart(&mut self, cause: ClearCause, out: &mut Vec<Step<T>>) {
        out.push(Step::Clear(cause));
        self.reset();
    }

    fn start_replay(
        &mut self,
        from: u64,
        seq: u64,
        batch: T,
        lossy_ok: bool,
        out: &mut Vec<Step<T>>,
    ) {
        self.next = Some(from);
        self.replay = Some(Replay {
            buffered: vec![(seq, batch)],
            lossy_ok,
            failed: false,
        });
        out.push(Step::RequestReplay(from));
    }

    /// Gives the replay up: clears when entries may be missing, then applies the
    /// buffered batches as a fresh start.
    fn fail(&mut self, out: &mut Vec<Step<T>>) {
        let Some(r) = self.replay.take() else { return };
        out.push(Step::ReplayFailed);
        if !r.lossy_ok {
            out.push(Step::Clear(ClearCause::Gap));
        }
        self.next = None;
        for (seq, batch) in r.buffered {
            match self.next {
                Some(n) if seq < n => {}
                _ => self.apply(seq, batch, out),
            }
        }
    }

    /// Applies `seq` during a replay: in order, skipping duplicates; a jump means the
    /// replay cannot close the gap (unless a shorter replay is fine).
    fn ordered(&mut self, seq: u64, batch: T, out: &mut Vec<Step<T>>) {
        let next = self.next.unwrap_or(0);
        if seq < next {
            return;
        }
        if seq > next
            && let Some(r) = &mut self.replay
            && !r.lossy_ok
        {
            // Entries were lost for good: clear once, then follow from here.
            r.lossy_ok = true;
            r.failed = true;
            out.push(Step::ReplayFailed);
            out.push(Step::Clear(ClearCause::Gap));
        }
        self.apply(seq, batch, out);
    }

    fn apply(&mut self, seq: u64, batch: T, out: &mut Vec<Step<T>>) {
        self.next = Some(seq.saturating_add(1));
        out.push(Step::Apply(seq, batch));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use Step::*;

    fn seqs(steps: &[Step<u64>]) -> Vec<u64> {
        steps
            .iter()
            .filter_map(|s| match s {
                Apply(n, _) => Some(*n),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn in_order_batches_apply_and_duplicates_are_dropped() {
        let mut s = Sequencer::new(false);
        assert_eq!(s.live(0, 0), [Apply(0, 0)]);
        assert_eq!(s.live(1, 1), [Apply(1, 1)]);
        assert_eq!(s.last_seq(), Some(1));
    }

    #[test]
    fn first_contact_without_replay_is_a_cold_start() {
        let mut s = Sequencer::new(false);
        assert_eq!(s.live(7, 7), [Apply(7, 7)]);
        assert_eq!(s.live(8, 8), [Apply(8, 8)]);
    }

    #[test]
    fn first_contact_with_replay_fetches_from_zero_and_accepts_a_short_buffer() {
        let mut s = Sequencer::new(true);
        assert_eq!(s.live(5, 5), [RequestReplay(0)]);
        assert!(s.is_replaying());
        assert_eq!(s.live(6, 6), []);
        // The engine's buffer starts at 2: fine on first contact.
        let mut out = s.replayed(2, 2);
        out.extend(s.replayed(3, 3));
        out.extend(s.replayed(4, 4));
        out.extend(s.replayed(5, 5));
        out.extend(s.replay_done());
        assert_eq!(seqs(&out), [2, 3, 4, 5, 6]);
        assert!(!out.contains(&Clear(ClearCause::Gap)));
        assert_eq!(out.last(), Some(&ReplayComplete));
        assert_eq!(s.live(7, 7), [Apply(7, 7)]);
    }

    #[test]
    fn gap_without_replay_clears_and_follows_on() {
        let mut s = Sequencer::new(false);
        s.live(0, 0);
        assert_eq!(
            s.live(3, 3),
            [
                Gap {
                    expected: 1,
                    got: 3
                },
                Clear(ClearCause::Gap),
                Apply(3, 3)
            ]
        );
        assert_eq!(s.live(4, 4), [Apply(4, 4)]);
    }

    #[test]
    fn gap_with_replay_fills_in_order_and_drops_live_copies() {
        let mut s = Sequencer::new(true);
        s.live(0, 0);
        assert_eq!(
            s.live(3, 3),
            [
                Gap {
                    expected: 1,
                    got: 3
                },
                RequestReplay(1)
            ]
        );
        assert!(s.is_replaying());
        assert_eq!(s.live(4, 4), []);
        let mut out = Vec::new();
        for n in 1..=4 {
            out.extend(s.replayed(n, n));
        }
        out.extend(s.replay_done());
        assert_eq!(seqs(&out), [1, 2, 3, 4]);
        assert_eq!(out.last(), Some(&ReplayComplete));
        assert!(!s.is_replaying());
        // A live copy of 4 arriving late is a duplicate, not a restart.
        assert_eq!(s.live(5, 5), [Apply(5, 5)]);
    }

    #[test]
    fn replay_that_starts_late_or_ends_early_clears() {
        let mut s = Sequencer::new(true);
        s.live(0, 0);
        s.live(5, 5);
        let out = s.replayed(3, 3);
        assert_eq!(out, [ReplayFailed, Clear(ClearCause::Gap), Apply(3, 3)]);
        let out = s.replay_done();
        assert_eq!(seqs(&out), [5]);

        let mut s = Sequencer::new(true);
        s.live(0, 0);
        s.live(5, 5);
        let out = s.replay_done(); // terminator only
        assert_eq!(
            out,
            [ReplayFailed, Clear(ClearCause::Gap), Apply(5, 5)],
            "the buffered batch is applied after the clear"
        );
        assert_eq!(s.live(6, 6), [Apply(6, 6)]);
    }

    #[test]
    fn replay_timeout_clears_and_applies_the_buffer() {
        let mut s = Sequencer::new(true);
        s.live(0, 0);
        s.live(2, 2);
        s.live(3, 3);
        let out = s.replay_failed();
        assert_eq!(
            out,
            [
                ReplayFailed,
                Clear(ClearCause::Gap),
                Apply(2, 2),
                Apply(3, 3)
            ]
        );
        // A late replay answer is ignored.
        assert_eq!(s.replayed(1, 1), []);
        assert_eq!(s.replay_done(), []);
    }

    #[test]
    fn lower_live_sequence_is_a_restart() {
        let mut s = Sequencer::new(false);
        s.live(10, 10);
        s.live(11, 11);
        assert_eq!(
            s.live(0, 0),
            [Restart, Clear(ClearCause::Restart), Apply(0, 0)]
        );
        let mut s = Sequencer::new(true);
        s.live(0, 0);
        s.live(1, 1);
        assert_eq!(
            s.live(1, 1),
            [Restart, Clear(ClearCause::Restart), RequestReplay(0)]
        );
        assert_eq!(
            s.publisher_changed()[..2],
            [Restart, Clear(ClearCause::Restart)]
        );
    }

    #[test]
    fn forward_jump_after_a_reconnect_is_a_restart() {
        // With replay: cleared, then rebuilt from 0 like a first contact, and a shorter
        // buffer (the new engine's) is accepted.
        let mut s = Sequencer::new(true);
        s.live(0, 0);
        s.live(1, 1);
        s.disconnected();
        assert_eq!(
            s.live(5, 5),
            [Restart, Clear(ClearCause::Reconnect), RequestReplay(0)]
        );
        let mut out = Vec::new();
        for n in 0..=5 {
            out.extend(s.replayed(n, n));
        }
        out.extend(s.replay_done());
        assert_eq!(seqs(&out), [0, 1, 2, 3, 4, 5]);
        assert_eq!(out.last(), Some(&ReplayComplete));
        // Without replay: cleared, then a cold start from the batch seen.
        let mut s = Sequencer::new(false);
        s.live(3, 3);
        s.disconnected();
        assert_eq!(
            s.live(9, 9),
            [Restart, Clear(ClearCause::Reconnect), Apply(9, 9)]
        );
        assert_eq!(s.live(10, 10), [Apply(10, 10)]);
    }

    #[test]
    fn reconnect_without_a_jump_carries_on_and_only_the_first_batch_is_judged() {
        let mut s = Sequencer::new(true);
        s.live(0, 0);
        s.disconnected();
        // Nothing was missed: the same stream.
        assert_eq!(s.live(1, 1), [Apply(1, 1)]);
        // A later jump on the same connection is a plain gap again.
        assert_eq!(
            s.live(4, 4),
            [
                Gap {
                    expected: 2,
                    got: 4
                },
                RequestReplay(2)
            ]
        );
        // A lower number after a reconnect stays a plain restart.
        let mut s = Sequencer::new(false);
        s.live(7, 7);
        s.disconnected();
        assert_eq!(
            s.live(0, 0),
            [Restart, Clear(ClearCause::Restart), Apply(0, 0)]
        );
    }

    #[test]
    fn jump_after_a_reconnect_during_a_replay_voids_it() {
        // A gap replay is under way when the engine restarts and comes back further on:
        // the buffered live batches and the replay belong to the old life.
        let mut s = Sequencer::new(true);
        s.live(0, 0);
        s.live(3, 3);
        assert!(s.is_replaying());
        s.disconnected();
        assert_eq!(
            s.live(8, 8),
            [Restart, Clear(ClearCause::Reconnect), RequestReplay(0)]
        );
        // (The consumer drops its replay socket on a restart, so answers to the old
        // request never reach the new replay.)
        assert!(s.is_replaying());
        let out = s.replay_done();
        assert_eq!(seqs(&out), [8], "only the new life's batch is kept");
    }

    #[test]
    fn reset_forgets_the_stream() {
        let mut s = Sequencer::new(true);
        s.live(0, 0);
        s.live(4, 4); // a gap: replay under way
        s.reset();
        assert!(!s.is_replaying());
        assert_eq!(s.last_seq(), None);
        // Late answers to the abandoned replay are ignored.
        assert_eq!(s.replayed(1, 1), []);
        assert_eq!(s.replay_done(), []);
        // The next batch is a first contact: replay from 0.
        assert_eq!(s.live(5, 5), [RequestReplay(0)]);
        let mut s = Sequencer::new(false);
        s.live(0, 0);
        s.reset();
        assert_eq!(s.live(3, 3), [Apply(3, 3)], "a cold start, not a gap");
    }
}

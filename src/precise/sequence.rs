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
//!   the replay already delivered (§7.2), skipped.

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
    /// The publisher restarted.
    Restart,
    /// The replay closed the gap.
    ReplayComplete,
    /// The replay could not close the gap (its entries were cleared if they mattered).
    ReplayFailed,
}

/// Why the worker's entries were dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClearCause {
    /// A gap no replay could fill.
    Gap,
    /// The publisher restarted.
    Restart,
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
}

impl<T> Sequencer<T> {
    /// A feed with (`can_replay`) or without a replay endpoint.
    pub fn new(can_replay: bool) -> Self {
        Sequencer {
            can_replay,
            next: None,
            last_live: None,
            replay: None,
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

    /// A batch from the live socket.
    pub fn live(&mut self, seq: u64, batch: T) -> Vec<Step<T>> {
        let mut out = Vec::new();
        if self.last_live.is_some_and(|last| seq <= last) {
            out.push(Step::Restart);
            self.restart(&mut out);
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
        self.restart(&mut out);
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

    fn restart(&mut self, out: &mut Vec<Step<T>>) {
        out.push(Step::Clear(ClearCause::Restart));
        self.next = None;
        self.last_live = None;
        self.replay = None;
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
}

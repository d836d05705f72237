//! Token parity: does the engine key its KV blocks from the same tokens as the router?
//!
//! Precise mode scores a request on the router's own keys of its tokens (the
//! `x-token-ids` header, a token-id prompt, or `precise.tokenizer` with its chat
//! template). When those tokens differ from the ones the engine prefilled (another chat
//! template, another tokenizer revision, a block size or `cache_salt` the router does
//! not apply), the index never matches and precise mode silently routes everything as
//! a miss. This module checks it answer by answer:
//!
//! - When an answer that precise mode keyed ends on a worker with a KV-event feed,
//!   a [`Check`] is queued for [`CHECK_DELAY`] later (the engine publishes its blocks
//!   at the end of each step; the delay covers the trip to the router).
//! - The checker ([`run`]) then asks the index whether the worker's engine itself
//!   reported the request's last full block (its own events, not the speculative
//!   entry). It did: a *match*. It did not: a *mismatch*, and [`diagnose`] names the
//!   likely cause from the blocks the engine reported recently.
//! - Per worker, over its last [`WINDOW`] checks (once there are [`MIN_CHECKS`]): a
//!   match share under `precise.parity_floor` marks its parity lost. Its feeds then
//!   score neutral ([`super::feed::FeedState::ParityLost`]) so the approximate tree
//!   routes for it, a warning names the cause (at most once per [`WARN_EVERY`]), and it
//!   is counted; the share back at the floor restores it. Checks go on while it is
//!   lost: the router still keys the requests.
//!
//! A check is skipped, not counted, when the feed was not following the stream at
//! check time, or the router dropped the worker's blocks meanwhile (a restart, a gap).
//! An engine that evicts a request's blocks within [`CHECK_DELAY`] of its answer counts
//! a mismatch; the floor is meant to absorb those.
//!
//! Nothing here runs on the request path but the queueing: a lock held for one push.

pub mod state;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use state::{Cause, MIN_CHECKS, ParityState, ParityView, Turn, WARN_EVERY, WINDOW, diagnose};

use super::Precise;
use super::feed::{Feed, FeedState};
use super::index::RecentStore;
use crate::shutdown::Shutdown;

/// How long after an answer its blocks are looked up.
pub const CHECK_DELAY: Duration = Duration::from_millis(500);
/// How often the checker wakes.
pub const CHECK_EVERY: Duration = Duration::from_millis(250);
/// Checks waiting at most; more are dropped (counted) rather than queued.
pub const MAX_PENDING: usize = 1024;

/// One answer to check: the worker's feeds (the rank it was sent to, or all of its
/// ranks), the request's keys and tokens, when it is due.
#[derive(Debug)]
pub struct Check {
    pub due: Instant,
    pub worker: Arc<str>,
    pub feeds: Vec<Arc<Feed>>,
    /// Each feed's [`Feed::clears`] when queued.
    pub clears: Vec<u64>,
    pub keys: Arc<[u64]>,
    pub ids: Arc<[u32]>,
}

/// The queue of checks waiting for their time.
#[derive(Debug, Default)]
pub struct Checks {
    pending: Mutex<VecDeque<Check>>,
    dropped: AtomicU64,
}

impl Checks {
    /// Queues `check`; dropped (counted) when [`MAX_PENDING`] are waiting.
    pub fn push(&self, check: Check) {
        let mut q = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if q.len() >= MAX_PENDING {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        q.push_back(check);
    }

    /// Checks dropped because the queue was full.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// The checks due at `now`, in order (the queue is in due order: one delay for all).
    fn take_due(&self, now: Instant) -> Vec<Check> {
        let mut q = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let n = q.iter().take_while(|c| c.due <= now).count();
        q.drain(..n).collect()
    }
}

/// The checker: every [`CHECK_EVERY`], runs the due checks. Runs until `shutdown`.
pub async fn run(precise: Arc<Precise>, mut shutdown: Shutdown) {
    let mut tick = tokio::time::interval(CHECK_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.wait() => return,
        }
        let now = crate::clock::now();
        for c in precise.parity.take_due(now) {
            check(&precise, &c, now);
        }
    }
}

/// Runs one check and acts on its result.
fn check(precise: &Precise, c: &Check, now: Instant) {
    let config = precise.config();
    let following: Vec<&Arc<Feed>> = c
        .feeds
        .iter()
        .zip(&c.clears)
        .filter(|(f, clears)| {
            f.events_state(now, config.stale) == FeedState::Live && f.clears() == **clears
        })
        .map(|(f, _)| f)
        .collect();
    let (Some(first), Some(&last)) = (following.first(), c.keys.last()) else {
        return;
    };
    let cause = {
        let index = precise.index();
        if following.iter().any(|f| index.confirms(last, f.source())) {
            None
        } else if let Some(engine) = first.foreign_block_size() {
            Some(Cause::BlockSize {
                engine,
                router: config.block_size,
            })
        } else {
            let (feed, confirmed) = following
                .iter()
                .map(|f| (f, index.confirmed_run(&c.keys, f.source())))
                .max_by_key(|(_, n)| *n)
                .unwrap_or((first, 0));
            let recent: Vec<&RecentStore> = index.recent_stores(feed.source()).collect();
            Some(diagnose(
                &c.keys,
                &c.ids,
                config.block_size,
                confirmed,
                &recent,
            ))
        }
    };
    let parity = first.parity();
    let detail = cause.as_ref().map(Cause::explain);
    let label = cause.as_ref().map(Cause::as_str);
    let mismatch = cause.is_some();
    match parity.record(cause, config.parity_floor) {
        Some(Turn::Lost) => {
            // Starts the once-per-interval gate: the next line comes a minute later.
            let _ = parity.warn_due();
            tracing::warn!(
            worker = %c.worker,
            match_share = parity.recent_share(),
            floor = config.parity_floor,
            cause = label.unwrap_or(""),
            detail = detail.as_deref().unwrap_or(""),
            "precise: token parity lost: the engine's KV blocks do not match the router's tokens; the approximate tree routes for this worker until they do"
            )
        }
        Some(Turn::Regained) => tracing::info!(
            worker = %c.worker,
            match_share = parity.recent_share(),
            "precise: token parity back; this worker is scored on its KV events again"
        ),
        None if mismatch && parity.is_lost() => {
            if let Some(n) = parity.warn_due() {
                tracing::warn!(
                    worker = %c.worker,
                    mismatches_since_last_line = n,
                    cause = label.unwrap_or(""),
                    detail = detail.as_deref().unwrap_or(""),
                    "precise: token parity still lost"
                );
            }
        }
        None => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_queue_is_bounded_and_hands_out_due_checks_in_order() {
        let q = Checks::default();
        let t = Instant::now();
        let check = |due| Check {
            due,
            worker: "w".into(),
            feeds: Vec::new(),
            clears: Vec::new(),
            keys: Arc::from(&[1u64][..]),
            ids: Arc::from(&[1u32][..]),
        };
        for i in 0..MAX_PENDING + 3 {
            q.push(check(t + Duration::from_millis(i as u64)));
        }
        assert_eq!(q.dropped(), 3);
        assert_eq!(q.take_due(t + Duration::from_millis(9)).len(), 10);
        assert_eq!(q.take_due(t + Duration::from_millis(9)).len(), 0);
    }
}

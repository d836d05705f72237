//! One worker's token parity: the sliding window of checks, whether parity is lost, and
//! the diagnosis of a mismatch (see [`super`]). Pure but for the atomics; knows
//! nothing of feeds, so a feed can hold it.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use crate::clock::LogEvery;
use crate::precise::index::RecentStore;

/// Checks per worker the match share is taken over.
pub const WINDOW: u32 = 20;
/// Checks a worker needs before its parity can be judged lost.
pub const MIN_CHECKS: u32 = 10;
/// Least time between two parity warnings for one worker.
pub const WARN_EVERY: Duration = Duration::from_secs(60);

/// Why a worker's engine did not confirm a request's blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cause {
    /// The engine reports blocks of another size than `precise.block_size`.
    BlockSize { engine: usize, router: usize },
    /// The engine stored the same tokens under other block keys: the `extra_keys` it
    /// folds in differ (`cache_salt`, a LoRA adapter, multimodal inputs).
    ExtraKeys { block: usize },
    /// The engine's tokens differ from the router's from token `at` on (`router`,
    /// `engine`: the two ids there): the chat template or the tokenizer differ.
    Tokens { at: usize, router: u32, engine: u32 },
    /// The engine reported nothing the router can place after the router's first
    /// `block` blocks: evicted already, events not reaching the router, or tokens that
    /// differ in a way the recent events do not show.
    NotReported { block: usize },
}

impl Cause {
    /// Label in `/workers` and logs.
    pub fn as_str(&self) -> &'static str {
        match self {
            Cause::BlockSize { .. } => "block_size",
            Cause::ExtraKeys { .. } => "extra_keys",
            Cause::Tokens { .. } => "tokens",
            Cause::NotReported { .. } => "not_reported",
        }
    }

    /// What an operator should look at.
    pub fn explain(&self) -> String {
        match self {
            Cause::BlockSize { engine, router } => format!(
                "the engine's blocks are {engine} tokens, precise.block_size is {router}: set it to the engine's --block-size"
            ),
            Cause::ExtraKeys { block } => format!(
                "block {block} has the same tokens on the engine but another key: its extra keys differ (cache_salt, a LoRA adapter the router does not know, multimodal input)"
            ),
            Cause::Tokens { at, router, engine } => format!(
                "the engine's tokens differ from token {at} on (router {router}, engine {engine}): the chat template or the tokenizer differ from the engine's (precise.chat_template, precise.tokenizer, vLLM --chat-template)"
            ),
            Cause::NotReported { block } => format!(
                "the engine reported no block after the router's first {block}: evicted at once, events lost, or tokens that differ"
            ),
        }
    }
}

/// Where `tokens` (a request's keyed token ids, blocks of `block_size`, keyed into
/// `keys`) and the engine part ways, given that the engine confirmed the first
/// `confirmed` blocks and reported `recent` runs. Pure.
///
/// The engine's run covering block `confirmed` is found by its parent: a run from
/// token 0 for block 0 (under any root: an adapter's too), else a run hanging under
/// one of the confirmed blocks. Its tokens there against the router's: equal means
/// other extra keys, else the first differing token.
pub fn diagnose(
    keys: &[u64],
    tokens: &[u32],
    block_size: usize,
    confirmed: usize,
    recent: &[&RecentStore],
) -> Cause {
    let n = confirmed;
    let ours =
        &tokens[(n * block_size).min(tokens.len())..((n + 1) * block_size).min(tokens.len())];
    // (run, offset in tokens where block n starts in it), newest first.
    let mut runs: Vec<(&RecentStore, usize)> = Vec::new();
    for r in recent.iter().rev() {
        match r.parent {
            None if n == 0 => runs.push((r, 0)),
            None => {}
            Some(p) => {
                if let Some(m) = keys[..n].iter().position(|k| *k == p).map(|i| i + 1) {
                    runs.push((r, (n - m) * block_size));
                }
            }
        }
    }
    let theirs = runs.iter().find_map(|(r, off)| {
        let end = off + block_size;
        (end <= r.tokens.len()).then(|| &r.tokens[*off..end])
    });
    match theirs {
        Some(t) if t == ours => Cause::ExtraKeys { block: n },
        Some(t) => {
            let i = t.iter().zip(ours).position(|(a, b)| a != b).unwrap_or(0);
            Cause::Tokens {
                at: n * block_size + i,
                router: ours.get(i).copied().unwrap_or(0),
                engine: t[i],
            }
        }
        None => Cause::NotReported { block: n },
    }
}

/// The last [`WINDOW`] checks of a worker, newest in bit 0.
#[derive(Debug, Default, Clone, Copy)]
struct Window {
    bits: u32,
    len: u32,
}

impl Window {
    fn push(&mut self, matched: bool) {
        self.bits = (self.bits << 1 | u32::from(matched)) & ((1 << WINDOW) - 1);
        self.len = (self.len + 1).min(WINDOW);
    }

    fn share(&self) -> f64 {
        if self.len == 0 {
            return 1.0;
        }
        f64::from(self.bits.count_ones()) / f64::from(self.len)
    }
}

/// One worker's parity (shared by its DP ranks' feeds). Written by the checker, read
/// by the request path (`is_lost`), `/workers` and `/metrics`.
#[derive(Debug)]
pub struct ParityState {
    matches: AtomicU64,
    mismatches: AtomicU64,
    lost: AtomicBool,
    inner: Mutex<(Window, Option<Cause>)>,
    warn: LogEvery,
}

impl Default for ParityState {
    fn default() -> Self {
        ParityState {
            matches: AtomicU64::new(0),
            mismatches: AtomicU64::new(0),
            lost: AtomicBool::new(false),
            inner: Mutex::new((Window::default(), None)),
            warn: LogEvery::new(WARN_EVERY),
        }
    }
}

/// A change of a worker's parity that [`ParityState::record`] made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Turn {
    Lost,
    Regained,
}

/// A worker's parity as `/workers` shows it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ParityView {
    /// Answers checked whose last block the engine confirmed, and those it did not.
    pub matches: u64,
    pub mismatches: u64,
    /// The match share over the last [`WINDOW`] checks (1 before the first).
    pub recent_share: f64,
    /// Parity lost: the tree routes for this worker.
    pub lost: bool,
    /// The cause of the last mismatch (`block_size`, `extra_keys`, `tokens`,
    /// `not_reported`) and what it means.
    pub last_cause: Option<&'static str>,
    pub last_cause_detail: Option<String>,
}

impl ParityState {
    /// Whether the worker's parity is lost now.
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Relaxed)
    }

    pub fn counts(&self) -> (u64, u64) {
        (
            self.matches.load(Ordering::Relaxed),
            self.mismatches.load(Ordering::Relaxed),
        )
    }

    /// Records one check (`cause` set for a mismatch) against `floor`
    /// (`precise.parity_floor`; 0 = never lost); returns the change it made, if any.
    pub fn record(&self, cause: Option<Cause>, floor: f64) -> Option<Turn> {
        let counter = if cause.is_none() {
            &self.matches
        } else {
            &self.mismatches
        };
        counter.fetch_add(1, Ordering::Relaxed);
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let (window, last) = &mut *inner;
        window.push(cause.is_none());
        if cause.is_some() {
            *last = cause;
        }
        let lost_now = floor > 0.0 && window.len >= MIN_CHECKS && window.share() < floor;
        let was = self.lost.swap(lost_now, Ordering::Relaxed);
        match (was, lost_now) {
            (false, true) => Some(Turn::Lost),
            (true, false) => Some(Turn::Regained),
            _ => None,
        }
    }

    /// Counts a line the checker would log while parity stays lost; `Some(n)` when one
    /// is due (at most once per [`WARN_EVERY`]), `n` the events it stands for.
    pub(super) fn warn_due(&self) -> Option<u64> {
        self.warn.due()
    }

    pub fn view(&self) -> ParityView {
        let (matches, mismatches) = self.counts();
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        ParityView {
            matches,
            mismatches,
            recent_share: inner.0.share(),
            lost: self.is_lost(),
            last_cause: inner.1.as_ref().map(Cause::as_str),
            last_cause_detail: inner.1.as_ref().map(Cause::explain),
        }
    }

    pub(super) fn recent_share(&self) -> f64 {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .0
            .share()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::precise::index::{chain_keys, root_key};

    const BS: usize = 4;

    fn keys(tokens: &[u32]) -> Vec<u64> {
        chain_keys(root_key(None), tokens, BS, &[])
    }

    #[test]
    fn a_worker_loses_parity_under_the_floor_and_regains_it() {
        let p = ParityState::default();
        let miss = || Some(Cause::NotReported { block: 0 });
        // Nine mismatches: too few checks to judge.
        for _ in 0..9 {
            assert_eq!(p.record(miss(), 0.5), None);
        }
        assert_eq!(p.record(miss(), 0.5), Some(Turn::Lost));
        assert!(p.is_lost());
        // Matches bring the share of the last 20 back to the floor: 10 of 20.
        for _ in 0..9 {
            assert_eq!(p.record(None, 0.5), None);
        }
        assert_eq!(p.record(None, 0.5), Some(Turn::Regained));
        assert_eq!(p.counts(), (10, 10));
        let v = p.view();
        assert_eq!(
            (v.lost, v.last_cause, v.recent_share),
            (false, Some("not_reported"), 0.5)
        );
        // Floor 0: never lost.
        let q = ParityState::default();
        for _ in 0..30 {
            assert_eq!(q.record(miss(), 0.0), None);
        }
    }

    #[test]
    fn diagnosis_finds_where_the_engine_tokens_part_ways() {
        let ours: Vec<u32> = (1..=12).collect();
        let k = keys(&ours);
        // Another template: the engine's first block starts with a BOS token.
        let mut theirs = vec![99];
        theirs.extend(1..=11);
        let engine = RecentStore {
            parent: None,
            tokens: theirs,
        };
        assert_eq!(
            diagnose(&k, &ours, BS, 0, &[&engine]),
            Cause::Tokens {
                at: 0,
                router: 1,
                engine: 99
            }
        );
        // Same first two blocks; the engine's third differs at its second token (a
        // generation prompt), in a run that hangs under block 1.
        let tail = RecentStore {
            parent: Some(k[1]),
            tokens: vec![9, 77, 11, 12],
        };
        assert_eq!(
            diagnose(&k, &ours, BS, 2, &[&engine, &tail]),
            Cause::Tokens {
                at: 9,
                router: 10,
                engine: 77
            }
        );
        // The same run hanging under block 0 covers block 2 at its second block.
        let run = RecentStore {
            parent: Some(k[0]),
            tokens: vec![5, 6, 7, 8, 9, 10, 0, 12],
        };
        assert_eq!(
            diagnose(&k, &ours, BS, 2, &[&run]),
            Cause::Tokens {
                at: 10,
                router: 11,
                engine: 0
            }
        );
        // Same tokens, other keys: a salt.
        let salted = RecentStore {
            parent: None,
            tokens: ours.clone(),
        };
        assert_eq!(
            diagnose(&k, &ours, BS, 0, &[&salted]),
            Cause::ExtraKeys { block: 0 }
        );
        // Nothing the engine reported hangs where the request's blocks stop.
        assert_eq!(
            diagnose(&k, &ours, BS, 1, &[&salted]),
            Cause::NotReported { block: 1 }
        );
    }
}

//! Synthetic workloads in the Mooncake trace format (see [`crate::prompts`]).
//!
//! [`hot_prefix`] builds the "hot prefix" trace (`bench/data/hot_prefix.jsonl`,
//! written by the `hot-prefix-trace` binary): the arrival span and mean rate of
//! the Mooncake conversation slice (2,000 requests over 669 s, 2.99 req/s), with
//!
//! - a hot ~3k-token system prompt: the same [`HotPrefixSpec::hot_blocks`] (6)
//!   hash ids `0..6` of 512 tokens at the head of ~60 % of the requests;
//! - multi-turn sessions (~60 % of the requests; 2–8 turns, 5–60 s apart): turn 1
//!   is the system prompt (for 80 % of sessions) plus 1–3 new blocks, every later
//!   turn repeats the previous turn's `hash_ids` and adds 1–3 new ones (the earlier
//!   turns plus the new exchange);
//! - one-off requests with fresh ids (30 % of them behind the hot prefix).
//!
//! `input_length` is `len(hash_ids) × 512` minus 0–399 tokens (a partial last
//! block; the hot blocks are always whole), `output_length` 50–600 tokens.
//!
//! Deterministic: the random stream is [`SplitMix64`] (the same generator the
//! prompt text uses) and every draw is integer arithmetic, so a seed gives the
//! same bytes on every machine and toolchain (no floating point, no dependency
//! whose stream may change between versions).

use std::collections::HashMap;
use std::fmt::Write as _;

use crate::prompts::{MOONCAKE_BLOCK_WORDS, SplitMix64, TraceRecord};

/// The shape of [`hot_prefix`]'s trace. Shares are in per mille (integers, so the
/// output does not depend on floating point).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HotPrefixSpec {
    /// Requests in the trace.
    pub requests: usize,
    /// Timestamp of the last request, in ms (the first is at 0).
    pub span_ms: u64,
    /// Seed of the random stream.
    pub seed: u64,
    /// Blocks of 512 tokens in the hot system prompt (ids `0..hot_blocks`).
    pub hot_blocks: usize,
    /// Share of the requests that are turns of multi-turn sessions, per mille.
    pub session_share_permille: u64,
    /// Share of sessions that start with the hot system prompt, per mille.
    pub hot_session_permille: u64,
    /// Share of one-off requests that start with the hot system prompt, per mille.
    pub hot_one_off_permille: u64,
}

impl Default for HotPrefixSpec {
    /// The committed `bench/data/hot_prefix.jsonl`: the Mooncake slice's 2,000
    /// requests over 669 s.
    fn default() -> Self {
        Self {
            requests: 2000,
            span_ms: 669_000,
            seed: 0x686f_745f_7072_6566, // "hot_pref"
            hot_blocks: 6,
            session_share_permille: 600,
            hot_session_permille: 800,
            hot_one_off_permille: 300,
        }
    }
}

/// One generated request: its trace line and where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GeneratedRequest {
    /// The trace line.
    pub record: TraceRecord,
    /// Session number (`None` for a one-off request).
    pub session: Option<u32>,
    /// Turn within the session, from 1 (1 for one-off requests).
    pub turn: u32,
    /// Whether `hash_ids` start with the hot system prompt.
    pub hot: bool,
}

/// Random draws of the generator: integer only.
struct Draw(SplitMix64);

impl Draw {
    /// Uniform in `lo..=hi` (`hi >= lo`).
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.0.next_u64() % (hi - lo + 1)
    }

    /// True with probability `permille / 1000`.
    fn chance(&mut self, permille: u64) -> bool {
        self.0.next_u64() % 1000 < permille
    }
}

/// Most turns of a session.
const MAX_TURNS: u64 = 8;
/// Think time between two turns of a session, in ms.
const TURN_GAP_MS: (u64, u64) = (5_000, 60_000);
/// Output length, in tokens.
const OUTPUT_TOKENS: (u64, u64) = (50, 600);
/// Tokens cut from the last block (it keeps at least 113 of 512).
const MAX_CUT: u64 = 399;

/// The hot-prefix trace of `spec`, sorted by timestamp (ties in generation
/// order). Fresh hash ids are numbered from `hot_blocks` upward in order of first
/// appearance, as in the Mooncake traces.
pub fn hot_prefix(spec: &HotPrefixSpec) -> Vec<GeneratedRequest> {
    let mut rng = Draw(SplitMix64::new(spec.seed));
    let hot: Vec<u64> = (0..spec.hot_blocks as u64).collect();
    let mut next_id = spec.hot_blocks as u64;
    let mut fresh = |n: u64| -> Vec<u64> {
        let ids = (next_id..next_id + n).collect();
        next_id += n;
        ids
    };
    let mut out: Vec<GeneratedRequest> = Vec::with_capacity(spec.requests);
    fn record(rng: &mut Draw, ts: u64, ids: Vec<u64>) -> TraceRecord {
        let full = ids.len() as u64 * MOONCAKE_BLOCK_WORDS as u64;
        TraceRecord {
            timestamp: ts,
            input_length: Some(full - rng.range(0, MAX_CUT)),
            output_length: rng.range(OUTPUT_TOKENS.0, OUTPUT_TOKENS.1),
            hash_ids: ids,
        }
    }

    // Sessions until their turns make up the session share (never a 1-turn one).
    let mut in_sessions =
        (spec.requests as u64 * spec.session_share_permille / 1000).min(spec.requests as u64);
    let mut session = 0u32;
    while in_sessions >= 2 {
        let mut turns = rng.range(2, MAX_TURNS).min(in_sessions);
        if in_sessions - turns == 1 {
            turns += 1;
        }
        in_sessions -= turns;
        let gaps: Vec<u64> = (1..turns)
            .map(|_| rng.range(TURN_GAP_MS.0, TURN_GAP_MS.1))
            .collect();
        let length: u64 = gaps.iter().sum();
        let mut ts = rng.range(0, spec.span_ms.saturating_sub(length));
        let is_hot = rng.chance(spec.hot_session_permille);
        let mut ids: Vec<u64> = if is_hot { hot.clone() } else { Vec::new() };
        for turn in 1..=turns as u32 {
            if turn > 1 {
                ts += gaps[turn as usize - 2];
            }
            let extra = rng.range(1, 3) + u64::from(turn == 1 && !is_hot);
            ids.extend(fresh(extra));
            out.push(GeneratedRequest {
                record: record(&mut rng, ts.min(spec.span_ms), ids.clone()),
                session: Some(session),
                turn,
                hot: is_hot,
            });
        }
        session += 1;
    }

    // One-off requests fill the rest; the first two pin the span.
    let one_offs = spec.requests - out.len();
    for k in 0..one_offs {
        let ts = match k {
            0 => 0,
            1 => spec.span_ms,
            _ => rng.range(0, spec.span_ms),
        };
        let is_hot = rng.chance(spec.hot_one_off_permille);
        let ids = if is_hot {
            let mut ids = hot.clone();
            ids.extend(fresh(rng.range(1, 6)));
            ids
        } else {
            fresh(rng.range(2, 12))
        };
        out.push(GeneratedRequest {
            record: record(&mut rng, ts, ids),
            session: None,
            turn: 1,
            hot: is_hot,
        });
    }

    out.sort_by_key(|r| r.record.timestamp);
    // Renumber fresh ids by first appearance (hot ids keep 0..hot_blocks).
    let mut renumber: HashMap<u64, u64> = HashMap::new();
    let mut next = spec.hot_blocks as u64;
    for r in &mut out {
        for id in &mut r.record.hash_ids {
            if *id >= spec.hot_blocks as u64 {
                *id = *renumber.entry(*id).or_insert_with(|| {
                    next += 1;
                    next - 1
                });
            }
        }
    }
    out
}

/// One trace line as the Mooncake files write it (Python `json.dumps` spacing):
/// `{"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1]}`.
pub fn trace_line(r: &TraceRecord) -> String {
    let mut s = format!(
        "{{\"timestamp\": {}, \"input_length\": {}, \"output_length\": {}, \"hash_ids\": [",
        r.timestamp,
        r.input_tokens(),
        r.output_length
    );
    for (i, id) in r.hash_ids.iter().enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        let _ = write!(s, "{id}");
    }
    s.push_str("]}");
    s
}

/// The whole trace as jsonl text (one [`trace_line`] per request, each ending in
/// a newline).
pub fn to_jsonl(requests: &[GeneratedRequest]) -> String {
    let mut s = String::new();
    for r in requests {
        s.push_str(&trace_line(&r.record));
        s.push('\n');
    }
    s
}

/// Shares of a generated trace, for reports and tests.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkloadShape {
    /// Requests.
    pub requests: usize,
    /// Share of requests whose ids start with the hot prefix (0–1).
    pub hot_share: f64,
    /// Sessions.
    pub sessions: usize,
    /// Share of requests that are session turns (0–1).
    pub session_share: f64,
    /// Mean prompt length, in tokens.
    pub mean_input: f64,
    /// Mean output length, in tokens.
    pub mean_output: f64,
    /// Requests per second over the span.
    pub rate_per_s: f64,
}

/// The [`WorkloadShape`] of `requests` (`hot` = ids start with `0..hot_blocks`).
pub fn shape(requests: &[GeneratedRequest], hot_blocks: usize) -> WorkloadShape {
    let n = requests.len().max(1) as f64;
    let hot_prefix: Vec<u64> = (0..hot_blocks as u64).collect();
    let hot = requests
        .iter()
        .filter(|r| r.record.hash_ids.starts_with(&hot_prefix))
        .count();
    let mut sessions: Vec<u32> = requests.iter().filter_map(|r| r.session).collect();
    let in_sessions = sessions.len();
    sessions.sort_unstable();
    sessions.dedup();
    let span_ms = requests
        .iter()
        .map(|r| r.record.timestamp)
        .max()
        .unwrap_or(0)
        .saturating_sub(
            requests
                .iter()
                .map(|r| r.record.timestamp)
                .min()
                .unwrap_or(0),
        );
    WorkloadShape {
        requests: requests.len(),
        hot_share: hot as f64 / n,
        sessions: sessions.len(),
        session_share: in_sessions as f64 / n,
        mean_input: requests
            .iter()
            .map(|r| r.record.input_tokens() as f64)
            .sum::<f64>()
            / n,
        mean_output: requests
            .iter()
            .map(|r| r.record.output_length as f64)
            .sum::<f64>()
            / n,
        rate_per_s: if span_ms > 0 {
            requests.len() as f64 * 1000.0 / span_ms as f64
        } else {
            0.0
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn hot_prefix_has_the_asked_shape() {
        let spec = HotPrefixSpec::default();
        let reqs = hot_prefix(&spec);
        let s = shape(&reqs, spec.hot_blocks);
        assert_eq!(s.requests, 2000);
        assert!((0.55..=0.65).contains(&s.hot_share), "hot share {s:?}");
        assert!(
            (0.55..=0.65).contains(&s.session_share),
            "session share {s:?}"
        );
        assert!((2.9..=3.1).contains(&s.rate_per_s), "rate {s:?}");
        assert_eq!(reqs[0].record.timestamp, 0);
        assert_eq!(reqs.last().unwrap().record.timestamp, spec.span_ms);
        // The hot flag agrees with the ids, and hot ids appear only as the prefix.
        for r in &reqs {
            let ids = &r.record.hash_ids;
            assert_eq!(r.hot, ids.starts_with(&[0, 1, 2, 3, 4, 5]), "{r:?}");
            let from = if r.hot { 6 } else { 0 };
            assert!(ids[from..].iter().all(|&id| id >= 6), "{r:?}");
            assert!(ids.len() > from, "at least one block of its own: {r:?}");
            let len = ids.len() as u64 * 512;
            let input = r.record.input_tokens();
            assert!(input <= len && input > len - 512, "{r:?}");
            assert!(input > 6 * 512 || !r.hot, "hot blocks are whole: {r:?}");
            assert!((50..=600).contains(&r.record.output_length), "{r:?}");
        }
        // Sessions: > 1 turn, turns in time order, each extending the previous.
        let mut by_session: BTreeMap<u32, Vec<&GeneratedRequest>> = BTreeMap::new();
        for r in &reqs {
            if let Some(id) = r.session {
                by_session.entry(id).or_default().push(r);
            }
        }
        assert_eq!(by_session.len(), s.sessions);
        let mut hot_sessions = 0;
        for turns in by_session.values() {
            assert!(turns.len() > 1, "{turns:?}");
            hot_sessions += usize::from(turns[0].hot);
            for (k, pair) in turns.windows(2).enumerate() {
                let (a, b) = (&pair[0].record, &pair[1].record);
                assert_eq!(pair[1].turn as usize, k + 2);
                assert!(b.timestamp > a.timestamp);
                assert!(b.hash_ids.len() > a.hash_ids.len());
                assert!(b.hash_ids.starts_with(&a.hash_ids), "{a:?} then {b:?}");
            }
        }
        assert!(
            hot_sessions * 2 > by_session.len(),
            "most sessions start hot"
        );
        // One-offs: ids no other request has (past the hot prefix).
        let mut seen: HashMap<u64, usize> = HashMap::new();
        for r in reqs.iter().filter(|r| r.session.is_none()) {
            for &id in r.record.hash_ids.iter().filter(|&&id| id >= 6) {
                *seen.entry(id).or_default() += 1;
            }
        }
        assert!(seen.values().all(|&n| n == 1));
        let one_off_hot = reqs.iter().filter(|r| r.session.is_none() && r.hot).count();
        let one_offs = reqs.iter().filter(|r| r.session.is_none()).count();
        assert!(one_off_hot > 0 && one_off_hot < one_offs);
    }

    #[test]
    fn generation_is_deterministic_and_matches_the_committed_file() {
        let spec = HotPrefixSpec::default();
        let text = to_jsonl(&hot_prefix(&spec));
        assert_eq!(text, to_jsonl(&hot_prefix(&spec)));
        let other = to_jsonl(&hot_prefix(&HotPrefixSpec {
            seed: 7,
            ..spec.clone()
        }));
        assert_ne!(text, other);
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/data/hot_prefix.jsonl");
        let committed = std::fs::read_to_string(path).expect("bench/data/hot_prefix.jsonl");
        assert!(
            committed == text,
            "bench/data/hot_prefix.jsonl differs from the generator: regenerate it with \
             `cargo run --release -p bench --bin hot-prefix-trace -- --out bench/data/hot_prefix.jsonl`"
        );
    }

    #[test]
    fn trace_lines_read_back_and_match_mooncake_spacing() {
        let r = TraceRecord {
            timestamp: 5,
            input_length: Some(900),
            output_length: 60,
            hash_ids: vec![0, 1],
        };
        let line = trace_line(&r);
        assert_eq!(
            line,
            r#"{"timestamp": 5, "input_length": 900, "output_length": 60, "hash_ids": [0, 1]}"#
        );
        let back: TraceRecord = serde_json::from_str(&line).unwrap();
        assert_eq!(back, r);
    }
}

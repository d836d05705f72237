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
    let record = synthetic_record;

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

/// The "system prompts" workload: a few system prompts shared by most requests, each
/// request adding a user turn of its own (nothing else is reused), arrivals Poisson
/// (uniform timestamps over the span, sorted: a Poisson process given its count).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SystemPromptsSpec {
    /// Requests in the trace.
    pub requests: usize,
    /// Timestamp of the last request, in ms (the first is at 0).
    pub span_ms: u64,
    /// Seed of the random stream.
    pub seed: u64,
    /// System prompts; the k-th (from 0) is chosen with weight 1 / (k + 1).
    pub prompts: usize,
    /// Blocks of 512 tokens per system prompt, drawn in this range.
    pub prompt_blocks: (u64, u64),
    /// Share of requests behind a system prompt, per mille (the rest are one-offs).
    pub shared_permille: u64,
}

impl Default for SystemPromptsSpec {
    /// 2,000 requests over the Mooncake slice's 669 s; 4 prompts of 2–6 blocks; 90 %.
    fn default() -> Self {
        Self {
            requests: 2000,
            span_ms: 669_000,
            seed: 0x7379_735f_7072_6f6d, // "sys_prom"
            prompts: 4,
            prompt_blocks: (2, 6),
            shared_permille: 900,
        }
    }
}

/// The "shared documents" workload: a few hundred long documents, each read by several
/// independent sessions (a question about it, then follow-ups that repeat the
/// conversation so far); sessions start at Poisson arrivals, turns follow after a think
/// time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedDocsSpec {
    /// Requests in the trace (about: the last session is cut to fit).
    pub requests: usize,
    /// Timestamp of the last session start, in ms (the first is at 0).
    pub span_ms: u64,
    /// Seed of the random stream.
    pub seed: u64,
    /// Documents.
    pub documents: usize,
    /// Blocks of 512 tokens per document, drawn in this range.
    pub doc_blocks: (u64, u64),
    /// Turns per session, drawn in this range.
    pub turns: (u64, u64),
}

impl Default for SharedDocsSpec {
    /// 2,000 requests over 669 s; 300 documents of 4–16 blocks; 1–3 turns a session.
    fn default() -> Self {
        Self {
            requests: 2000,
            span_ms: 669_000,
            seed: 0x646f_6373_5f73_6864, // "docs_shd"
            documents: 300,
            doc_blocks: (4, 16),
            turns: (1, 3),
        }
    }
}

/// The trace of `spec` (see [`SystemPromptsSpec`]), sorted by timestamp, ids
/// numbered by first appearance.
pub fn system_prompts(spec: &SystemPromptsSpec) -> Vec<GeneratedRequest> {
    let mut rng = Draw(SplitMix64::new(spec.seed));
    let mut next_id = 0u64;
    let mut fresh = |n: u64| -> Vec<u64> {
        let ids = (next_id..next_id + n).collect();
        next_id += n;
        ids
    };
    let prompts: Vec<Vec<u64>> = (0..spec.prompts)
        .map(|_| fresh(rng.range(spec.prompt_blocks.0, spec.prompt_blocks.1)))
        .collect();
    // Weights 1/(k+1) in integers: the least common multiple's share of each.
    let scale: u64 = 720_720; // divisible by 1..=16
    let weights: Vec<u64> = (0..prompts.len() as u64)
        .map(|k| scale / (k + 1).min(16))
        .collect();
    let total: u64 = weights.iter().sum();
    let mut out = Vec::with_capacity(spec.requests);
    for k in 0..spec.requests {
        let ts = match k {
            0 => 0,
            1 => spec.span_ms,
            _ => rng.range(0, spec.span_ms),
        };
        let shared = !prompts.is_empty() && rng.chance(spec.shared_permille);
        let ids = if shared {
            let mut pick = rng.range(0, total - 1);
            let mut which = 0;
            while pick >= weights[which] {
                pick -= weights[which];
                which += 1;
            }
            let mut ids = prompts[which].clone();
            ids.extend(fresh(rng.range(1, 3)));
            ids
        } else {
            fresh(rng.range(2, 8))
        };
        out.push(GeneratedRequest {
            record: synthetic_record(&mut rng, ts, ids),
            session: None,
            turn: 1,
            hot: shared,
        });
    }
    finish(out)
}

/// The trace of `spec` (see [`SharedDocsSpec`]), sorted by timestamp, ids numbered by
/// first appearance.
pub fn shared_documents(spec: &SharedDocsSpec) -> Vec<GeneratedRequest> {
    let mut rng = Draw(SplitMix64::new(spec.seed));
    let mut next_id = 0u64;
    let mut fresh = |n: u64| -> Vec<u64> {
        let ids = (next_id..next_id + n).collect();
        next_id += n;
        ids
    };
    let docs: Vec<Vec<u64>> = (0..spec.documents.max(1))
        .map(|_| fresh(rng.range(spec.doc_blocks.0, spec.doc_blocks.1)))
        .collect();
    let mut out = Vec::with_capacity(spec.requests);
    let mut session = 0u32;
    while out.len() < spec.requests {
        let turns = rng
            .range(spec.turns.0.max(1), spec.turns.1.max(spec.turns.0).max(1))
            .min((spec.requests - out.len()) as u64);
        let mut ts = match session {
            0 => 0,
            _ => rng.range(0, spec.span_ms),
        };
        let mut ids = docs[rng.range(0, docs.len() as u64 - 1) as usize].clone();
        for turn in 1..=turns as u32 {
            if turn > 1 {
                ts += rng.range(TURN_GAP_MS.0, TURN_GAP_MS.1 / 2);
            }
            ids.extend(fresh(rng.range(1, 2)));
            out.push(GeneratedRequest {
                record: synthetic_record(&mut rng, ts, ids.clone()),
                session: Some(session),
                turn,
                hot: true,
            });
        }
        session += 1;
    }
    finish(out)
}

/// A trace line of `ids` (512 tokens each, the last block cut by 0–[`MAX_CUT`]) at
/// `ts` with a drawn output length.
fn synthetic_record(rng: &mut Draw, ts: u64, ids: Vec<u64>) -> TraceRecord {
    let full = ids.len() as u64 * MOONCAKE_BLOCK_WORDS as u64;
    TraceRecord {
        timestamp: ts,
        input_length: Some(full - rng.range(0, MAX_CUT)),
        output_length: rng.range(OUTPUT_TOKENS.0, OUTPUT_TOKENS.1),
        hash_ids: ids,
    }
}

/// Sorts by timestamp (ties in generation order) and numbers ids by first appearance.
fn finish(mut out: Vec<GeneratedRequest>) -> Vec<GeneratedRequest> {
    out.sort_by_key(|r| r.record.timestamp);
    let mut renumber: HashMap<u64, u64> = HashMap::new();
    for r in &mut out {
        for id in &mut r.record.hash_ids {
            let next = renumber.len() as u64;
            *id = *renumber.entry(*id).or_insert(next);
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
    fn system_prompts_share_a_few_heads_and_nothing_else() {
        let spec = SystemPromptsSpec::default();
        let reqs = system_prompts(&spec);
        assert_eq!(reqs.len(), spec.requests);
        assert!(
            reqs.windows(2)
                .all(|w| w[0].record.timestamp <= w[1].record.timestamp)
        );
        assert_eq!(reqs.last().unwrap().record.timestamp, spec.span_ms);
        // Every block id appears in one request only, but for the system prompts'.
        let mut seen: BTreeMap<u64, usize> = BTreeMap::new();
        for r in &reqs {
            for id in &r.record.hash_ids {
                *seen.entry(*id).or_default() += 1;
            }
        }
        let reused: usize = seen.values().filter(|n| **n > 1).count();
        assert!(
            reused <= spec.prompts * spec.prompt_blocks.1 as usize,
            "{reused}"
        );
        let shared = reqs.iter().filter(|r| r.hot).count() as f64 / reqs.len() as f64;
        assert!((0.87..0.93).contains(&shared), "{shared}");
        assert_eq!(system_prompts(&spec), reqs, "deterministic");
    }

    #[test]
    fn shared_documents_are_read_by_several_independent_sessions() {
        let spec = SharedDocsSpec::default();
        let reqs = shared_documents(&spec);
        assert_eq!(reqs.len(), spec.requests);
        // Sessions per document (its first block id), and turns that extend their
        // previous turn.
        let mut sessions_of: BTreeMap<u64, std::collections::BTreeSet<u32>> = BTreeMap::new();
        let mut last: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
        for r in &reqs {
            let s = r.session.unwrap();
            sessions_of
                .entry(r.record.hash_ids[0])
                .or_default()
                .insert(s);
            if let Some(prev) = last.get(&s) {
                assert!(r.record.hash_ids.starts_with(prev));
            }
            last.insert(s, r.record.hash_ids.clone());
        }
        let docs = sessions_of.len();
        let mean = sessions_of.values().map(|s| s.len()).sum::<usize>() as f64 / docs as f64;
        assert!(docs > 200 && docs <= spec.documents, "{docs}");
        assert!(mean > 2.5, "{mean} sessions a document");
        assert_eq!(shared_documents(&spec), reqs, "deterministic");
    }

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

/// The shape of [`adapter_mix`]'s workload: many LoRA adapters of one base model,
/// each with its own system prompt and multi-turn sessions, adapter popularity
/// skewed (adapter `k` is drawn with weight `1 / (k + 1)`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterMixSpec {
    /// Requests in the workload.
    pub requests: usize,
    /// Timestamp of the last session's start, in ms (the first is at 0).
    pub span_ms: u64,
    /// Seed of the random stream.
    pub seed: u64,
    /// LoRA adapters (`lora-0` … `lora-{n-1}`).
    pub adapters: usize,
    /// Blocks of 512 tokens in each adapter's system prompt.
    pub system_blocks: u64,
    /// Turns per session, inclusive range.
    pub turns: (u64, u64),
}

impl Default for AdapterMixSpec {
    /// 2,400 requests over 10 minutes (4 req/s), 8 adapters with a 1,024-token system
    /// prompt each, sessions of 1–4 turns.
    fn default() -> Self {
        Self {
            requests: 2400,
            span_ms: 600_000,
            seed: 0x6c6f_7261_5f6d_6978, // "lora_mix"
            adapters: 8,
            system_blocks: 2,
            turns: (1, 4),
        }
    }
}

/// The workload of `spec` as `(adapter, request)` pairs sorted by timestamp: each
/// session draws its adapter, starts with that adapter's system prompt and adds 1–2
/// new blocks per turn (turns 5–30 s apart).
pub fn adapter_mix(spec: &AdapterMixSpec) -> Vec<(String, GeneratedRequest)> {
    let mut rng = Draw(SplitMix64::new(spec.seed));
    let adapters = spec.adapters.max(1);
    let mut next_id = 0u64;
    let mut fresh = |n: u64| -> Vec<u64> {
        let ids = (next_id..next_id + n).collect();
        next_id += n;
        ids
    };
    let systems: Vec<Vec<u64>> = (0..adapters).map(|_| fresh(spec.system_blocks)).collect();
    let scale: u64 = 720_720; // divisible by 1..=16
    let weights: Vec<u64> = (0..adapters as u64)
        .map(|k| scale / (k + 1).min(16))
        .collect();
    let total: u64 = weights.iter().sum();
    let mut out = Vec::with_capacity(spec.requests);
    let mut session = 0u32;
    while out.len() < spec.requests {
        let mut pick = rng.range(0, total - 1);
        let mut which = 0;
        while pick >= weights[which] {
            pick -= weights[which];
            which += 1;
        }
        let turns = rng
            .range(spec.turns.0.max(1), spec.turns.1.max(spec.turns.0).max(1))
            .min((spec.requests - out.len()) as u64);
        let mut ts = rng.range(0, spec.span_ms);
        let mut ids = systems[which].clone();
        for turn in 1..=turns as u32 {
            if turn > 1 {
                ts += rng.range(TURN_GAP_MS.0, TURN_GAP_MS.1 / 2);
            }
            ids.extend(fresh(rng.range(1, 2)));
            let request = GeneratedRequest {
                record: synthetic_record(&mut rng, ts, ids.clone()),
                session: Some(session),
                turn,
                hot: true,
            };
            out.push((format!("lora-{which}"), request));
        }
        session += 1;
    }
    out.sort_by_key(|(_, r)| r.record.timestamp);
    out
}

/// One line of a request log `simulate` reads: `{"timestamp_ms", "body"}` with a chat
/// body for `model` whose one user message is the record's prompt text, and its output
/// length as `max_tokens`.
pub fn request_line(model: &str, r: &TraceRecord) -> String {
    let body = serde_json::json!({
        "model": model,
        "max_tokens": r.output_length,
        "messages": [{"role": "user", "content": r.prompt(0)}],
    });
    serde_json::json!({"timestamp_ms": r.timestamp, "body": body}).to_string()
}

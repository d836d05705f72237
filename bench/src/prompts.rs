//! Mooncake trace lines and their deterministic prompt text.
//!
//! A byte-exact Rust port of `shared/data/traces/expand_prompts.py`: block id `b`
//! becomes [`MOONCAKE_BLOCK_WORDS`] words drawn from [`WORDS`] with a SplitMix64
//! stream seeded by `salt ^ b`; every word is written as `" " + word`; a prompt is
//! its blocks in order with the last block cut to `input_length - 512 * (n - 1)`
//! words (at least one). Equal ids give equal text, so two trace lines that share
//! their first `k` ids share their first `k * 512` words and a prefix cache sees
//! the same reuse as the trace describes.
//!
//! Words stand in for tokens: one word is roughly one token of a BPE vocabulary,
//! so `input_length` (tokens in the trace) equals the number of words produced.
//! This module does no I/O except [`read_trace`].

use std::fmt::Write as _;
use std::io::BufRead;
use std::path::Path;

pub use cache_aware_router::simulate::mooncake::{
    MOONCAKE_BLOCK_WORDS, SplitMix64, TraceRecord, WORDS, block_words, prompt_for,
};

/// Why a trace file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be opened or read.
    #[error("cannot read trace {path}: {source}")]
    Io {
        /// The trace path as given.
        path: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A line is not a valid Mooncake record.
    #[error("{path}:{line}: not a Mooncake trace line: {source}")]
    Parse {
        /// The trace path as given.
        path: String,
        /// 1-based line number.
        line: usize,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
}

/// Reads the first `limit` non-blank lines of a Mooncake jsonl trace (all lines
/// when `limit` is `None`) and returns them sorted by timestamp (stable sort, so
/// an already sorted trace keeps its line order).
pub fn read_trace(path: &Path, limit: Option<usize>) -> Result<Vec<TraceRecord>, TraceError> {
    let shown = path.display().to_string();
    let io_err = |source| TraceError::Io {
        path: shown.clone(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io_err)?;
    let mut out = Vec::new();
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        if limit.is_some_and(|l| out.len() >= l) {
            break;
        }
        let line = line.map_err(io_err)?;
        if line.trim().is_empty() {
            continue;
        }
        let rec = serde_json::from_str(&line).map_err(|source| TraceError::Parse {
            path: shown.clone(),
            line: i + 1,
            source,
        })?;
        out.push(rec);
    }
    out.sort_by_key(|r: &TraceRecord| r.timestamp);
    Ok(out)
}

/// Lowercase hex of `bytes` (used for short digests in reports and tests).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};

    fn sha_prefix(text: &str) -> String {
        hex(&Sha256::digest(text.as_bytes()))[..16].to_string()
    }

    #[test]
    fn readme_vector_three_blocks() {
        let text = prompt_for(&[0, 1, 2], 1100, 512, 0);
        assert_eq!(text.len(), 5498);
        assert!(text.starts_with(" farm only it together"));
        assert_eq!(sha_prefix(&text), "455b1834636d2dcb");
        assert_eq!(text.split_whitespace().count(), 1100);
    }

    #[test]
    fn readme_vector_four_blocks() {
        let text = prompt_for(&[46, 47, 48, 2353], 1700, 512, 0);
        assert_eq!(text.len(), 8483);
        assert_eq!(sha_prefix(&text), "821a68d8205f7f47");
    }

    #[test]
    fn shared_ids_share_exactly_their_blocks() {
        let a = prompt_for(&[46, 47, 48, 2353], 1700, 512, 0);
        let b = prompt_for(&[46, 47, 48, 2366], 1700, 512, 0);
        let wa: Vec<&str> = a.split_whitespace().collect();
        let wb: Vec<&str> = b.split_whitespace().collect();
        let common = wa.iter().zip(&wb).take_while(|(x, y)| x == y).count();
        // The README: they diverge at word 1,537 (1-based), i.e. 1,536 shared words.
        assert_eq!(common, 1536);
    }

    #[test]
    fn cut_block_is_prefix_of_full_block_and_short_lengths_keep_one_word() {
        let full = prompt_for(&[7], 512, 512, 0);
        let cut = prompt_for(&[7], 100, 512, 0);
        assert!(full.starts_with(&cut));
        assert_eq!(
            prompt_for(&[7, 8], 3, 512, 0).split_whitespace().count(),
            513
        );
        assert_eq!(prompt_for(&[], 10, 512, 0), "");
    }

    #[test]
    fn trace_line_parses_with_python_defaults() {
        let r: TraceRecord = serde_json::from_str(r#"{"hash_ids":[0,1]}"#).unwrap();
        assert_eq!(
            (r.timestamp, r.input_tokens(), r.output_length),
            (0, 1024, 16)
        );
    }
}

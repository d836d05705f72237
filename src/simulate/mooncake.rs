//! Mooncake trace lines and their deterministic prompt text (shared with `bench`).
//!
//! A byte-exact Rust port of `shared/data/traces/expand_prompts.py`: block id `b`
//! becomes [`MOONCAKE_BLOCK_WORDS`] words drawn from [`WORDS`] with a SplitMix64
//! stream seeded by `salt ^ b`; every word is written as `" " + word`; a prompt is
//! its blocks in order with the last block cut to `input_length - 512 * (n - 1)`
//! words (at least one). Equal ids give equal text, so two trace lines that share
//! their first `k` ids share their first `k * 512` words and a prefix cache sees
//! the same reuse as the trace describes.
//!
//! Words stand in for tokens: one word is one token of the simulated engine's
//! tokenizer ([`super::engine`]), so `input_length` (tokens in the trace) equals the
//! number of words produced. No I/O.

use serde::{Deserialize, Serialize};

/// Words per Mooncake block (the trace's `hash_ids` are one id per 512 tokens).
pub const MOONCAKE_BLOCK_WORDS: usize = 512;

/// The 256-word vocabulary; word index = top 8 bits of a SplitMix64 output.
pub const WORDS: [&str; 256] = [
    "the", "of", "and", "to", "in", "is", "it", "you", "that", "he", "was", "for", "on", "are",
    "with", "as", "his", "they", "be", "at", "one", "have", "this", "from", "or", "had", "by",
    "word", "but", "what", "some", "we", "can", "out", "other", "were", "all", "there", "when",
    "up", "use", "your", "how", "said", "an", "each", "she", "which", "do", "their", "time", "if",
    "will", "way", "about", "many", "then", "them", "write", "would", "like", "so", "these", "her",
    "long", "make", "thing", "see", "him", "two", "has", "look", "more", "day", "could", "go",
    "come", "did", "number", "sound", "no", "most", "people", "my", "over", "know", "water",
    "than", "call", "first", "who", "may", "down", "side", "been", "now", "find", "any", "new",
    "work", "part", "take", "get", "place", "made", "live", "where", "after", "back", "little",
    "only", "round", "man", "year", "came", "show", "every", "good", "me", "give", "our", "under",
    "name", "very", "through", "just", "form", "sentence", "great", "think", "say", "help", "low",
    "line", "differ", "turn", "cause", "much", "mean", "before", "move", "right", "boy", "old",
    "too", "same", "tell", "does", "set", "three", "want", "air", "well", "also", "play", "small",
    "end", "put", "home", "read", "hand", "port", "large", "spell", "add", "even", "land", "here",
    "must", "big", "high", "such", "follow", "act", "why", "ask", "men", "change", "went", "light",
    "kind", "off", "need", "house", "picture", "try", "us", "again", "animal", "point", "mother",
    "world", "near", "build", "self", "earth", "father", "head", "stand", "own", "page", "should",
    "country", "found", "answer", "school", "grow", "study", "still", "learn", "plant", "cover",
    "food", "sun", "four", "between", "state", "keep", "eye", "never", "last", "let", "thought",
    "city", "tree", "cross", "farm", "hard", "start", "might", "story", "saw", "far", "sea",
    "draw", "left", "late", "run", "while", "press", "close", "night", "real", "life", "few",
    "north", "open", "seem", "together", "next", "white", "children", "begin", "got", "walk",
    "example",
];

/// SplitMix64, the generator `expand_prompts.py` uses (64-bit wrapping arithmetic).
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator seeded with `seed`; the first output is the one after one step.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// Advances the state and returns the next 64-bit output.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// The first `count` words of block `block_id` (a block has `block` words in full;
/// `count <= block` gives a prefix of the full block).
pub fn block_words(block_id: u64, count: usize, salt: u64) -> impl Iterator<Item = &'static str> {
    let mut rng = SplitMix64::new(salt ^ block_id);
    (0..count).map(move |_| WORDS[(rng.next_u64() >> 56) as usize])
}

/// Prompt text for one trace line: `hash_ids` expanded block by block, each word
/// preceded by one space, the last block cut so the word count is `input_length`
/// (tokens) when `input_length` falls inside the last block.
///
/// `block` is the number of words per block (512 for Mooncake); `salt` is XORed
/// into every seed (0 reproduces the Python script's default output).
pub fn prompt_for(hash_ids: &[u64], input_length: u64, block: usize, salt: u64) -> String {
    let n = hash_ids.len();
    let mut out = String::with_capacity(n * block * 5);
    for (i, &id) in hash_ids.iter().enumerate() {
        let count = if i + 1 == n {
            let before = (block as i128) * (n as i128 - 1);
            (input_length as i128 - before).clamp(1, block as i128) as usize
        } else {
            block
        };
        for w in block_words(id, count, salt) {
            out.push(' ');
            out.push_str(w);
        }
    }
    out
}

/// One line of a Mooncake trace (`conversation_trace.jsonl` and friends).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceRecord {
    /// Arrival time, in milliseconds since the start of the trace.
    #[serde(default)]
    pub timestamp: u64,
    /// Prompt length, in tokens; `None` means `hash_ids.len() * 512` (as the Python rule).
    #[serde(default)]
    pub input_length: Option<u64>,
    /// Generated length, in tokens (16 when absent, as the Python rule).
    #[serde(default = "default_output_length")]
    pub output_length: u64,
    /// One prefix-hash id per 512-token block of the prompt.
    pub hash_ids: Vec<u64>,
}

fn default_output_length() -> u64 {
    16
}

impl TraceRecord {
    /// Prompt length in tokens (words), defaulting as `expand_prompts.py` does.
    pub fn input_tokens(&self) -> u64 {
        self.input_length
            .unwrap_or((self.hash_ids.len() * MOONCAKE_BLOCK_WORDS) as u64)
    }

    /// This line's prompt text with Mooncake's 512-word blocks and the given salt.
    pub fn prompt(&self, salt: u64) -> String {
        prompt_for(
            &self.hash_ids,
            self.input_tokens(),
            MOONCAKE_BLOCK_WORDS,
            salt,
        )
    }
}

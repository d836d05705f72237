//! `precise:` — precise mode's block index, and the tokenizer it names.
//!
//! The tokenizer's files are only named here: the part that tokenizes loads them
//! (`tokenize::PromptTokenizer::from_config`), and a file it cannot use is refused in
//! the config's words, at the key and line that named it ([`KeySite`]).

use std::collections::BTreeMap;
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::check::{Checker, ConfigError, KeySite, Secs, named};
use super::difference::Section;

/// `precise:` — the block index of precise mode.
#[derive(Debug, Clone, PartialEq)]
pub struct PreciseConfig {
    /// Tokens per KV block; must equal the engines' `--block-size` (default 16, vLLM's
    /// CUDA default). Events with another block size are skipped and counted.
    pub block_size: usize,
    /// Most distinct blocks (prefix keys) the index keeps; least recently used ones go
    /// first (default 1,000,000).
    pub max_blocks: NonZeroUsize,
    /// A worker whose feed sent nothing for this long while requests were routed to it
    /// scores neutral (default 30 s).
    pub stale: Duration,
    /// How long a routed request's blocks count as held by the chosen worker before the
    /// engine's own events confirm them (default 2 s).
    pub speculative_ttl: Duration,
    /// In-router tokenization (`precise.tokenizer`); `None` = requests without token ids
    /// are scored by the approximate tree.
    pub tokenizer: Option<TokenizerSetting>,
    /// Token-parity floor (`precise.parity_floor`, default 0.5; 0 = never fall back): a
    /// worker whose engine confirmed under this share of the router's block keys over
    /// its last checked answers is scored by the tree until the share is back (see
    /// [`crate::precise::parity`]).
    pub parity_floor: f64,
    /// `precise.tier_weights`: how much a block held in each KV tier (the events'
    /// `medium`) is worth against a GPU block.
    pub tier_weights: TierWeights,
    /// `precise.tier_load_tokens_per_sec`: tokens per second an engine loads from a
    /// host tier (CPU, storage) into GPU memory; `cost_aware` prices a host-tier hit at
    /// this rate instead of as free (default 100,000).
    pub tier_load_tokens_per_sec: f64,
}

/// `precise.tier_weights`, merged over the defaults (GPU 1.0, CPU 0.8, STORAGE 0.5): the
/// tiers' names (upper case, as vLLM's `medium`) and weights (0 to 1), heaviest first,
/// ties by name. At most [`MAX_TIERS`].
#[derive(Debug, Clone, PartialEq)]
pub struct TierWeights(Vec<(String, f64)>);

/// Most tiers `precise.tier_weights` may name, defaults included.
pub const MAX_TIERS: usize = 8;

/// Tiers and weights when `precise.tier_weights` names none: llm-d's GPU and CPU weights,
/// and storage half a GPU block (a read from local NVMe is some 5× slower than from
/// host memory).
pub const DEFAULT_TIER_WEIGHTS: [(&str, f64); 3] = [("GPU", 1.0), ("CPU", 0.8), ("STORAGE", 0.5)];

/// Default of `precise.tier_load_tokens_per_sec`: about what a PCIe 4.0 ×16 link (some
/// 25 GB/s) moves for a model with 256 KiB of KV per token (a 70B-class model at 16 bits;
/// a smaller model loads more tokens per second, a slower link fewer).
pub const DEFAULT_TIER_LOAD_TOKENS_PER_SEC: f64 = 100_000.0;

impl TierWeights {
    /// `overrides` (name, weight) merged over [`DEFAULT_TIER_WEIGHTS`]; names compare
    /// case-insensitively and are kept upper case.
    pub fn new<'a>(overrides: impl IntoIterator<Item = (&'a str, f64)>) -> Self {
        let mut tiers: Vec<(String, f64)> = DEFAULT_TIER_WEIGHTS
            .iter()
            .map(|(n, w)| (n.to_string(), *w))
            .collect();
        for (name, weight) in overrides {
            let name = name.to_ascii_uppercase();
            match tiers.iter_mut().find(|(n, _)| *n == name) {
                Some(t) => t.1 = weight,
                None => tiers.push((name, weight)),
            }
        }
        tiers.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        TierWeights(tiers)
    }

    /// The tiers, heaviest first: (name, weight).
    pub fn tiers(&self) -> &[(String, f64)] {
        &self.0
    }
}

impl Default for TierWeights {
    fn default() -> Self {
        TierWeights::new([])
    }
}

/// `precise.tokenizer` (+ `chat_template`, `chat_template_content_format`,
/// `max_tokenize_bytes`): the files precise mode tokenizes with, and where the keys
/// naming them were set. Two settings are equal when they name the same files and
/// format (SIGHUP reload compares configs; a changed file is read again only at a
/// restart).
#[derive(Debug, Clone)]
pub struct TokenizerSetting {
    /// A Hugging Face model folder holding `tokenizer.json`, or that file.
    pub path: PathBuf,
    /// A Jinja chat template overriding the folder's (vLLM's `--chat-template`).
    pub chat_template: Option<PathBuf>,
    pub content_format: ContentFormat,
    /// Most bytes of each prompt's text tokenized (a longer prompt's prefix is).
    pub max_bytes: usize,
    /// Where `precise.tokenizer` was set: a tokenizer file that cannot be used is
    /// refused there.
    pub tokenizer_at: KeySite,
    /// Where `precise.chat_template` was set: a template that cannot be used is
    /// refused there.
    pub chat_template_at: KeySite,
}

impl PartialEq for TokenizerSetting {
    fn eq(&self, other: &Self) -> bool {
        (
            &self.path,
            &self.chat_template,
            self.content_format,
            self.max_bytes,
        ) == (
            &other.path,
            &other.chat_template,
            other.content_format,
            other.max_bytes,
        )
    }
}

/// How the template reads a message's `content` (vLLM `--chat-template-content-format`,
/// `precise.chat_template_content_format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ContentFormat {
    /// Detect it from the template's source, as vLLM does (the default).
    #[default]
    Auto,
    /// `content` is one string (text parts joined with `"\n"`).
    String,
    /// `content` is a list of `{"type": "text", "text": …}` parts.
    OpenAi,
}

named!(ContentFormat {
    "auto" => ContentFormat::Auto,
    "string" => ContentFormat::String,
    "openai" => ContentFormat::OpenAi,
});

/// Default of `precise.max_tokenize_bytes`: 256 KiB of prompt text, about 60k tokens,
/// 30 ms of one core and 50 MB of transient memory (the tokenizer's per-token
/// bookkeeping).
pub const DEFAULT_MAX_TOKENIZE_BYTES: usize = 256 << 10;

impl Default for PreciseConfig {
    fn default() -> Self {
        PreciseConfig {
            block_size: 16,
            max_blocks: const { NonZeroUsize::new(1_000_000).unwrap() },
            stale: Duration::from_secs(30),
            speculative_ttl: Duration::from_secs(2),
            tokenizer: None,
            parity_floor: 0.5,
            tier_weights: TierWeights::default(),
            tier_load_tokens_per_sec: DEFAULT_TIER_LOAD_TOKENS_PER_SEC,
        }
    }
}

impl Section for PreciseConfig {
    const KEY: &'static str = "precise";
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
pub(super) struct RawPrecise {
    block_size: Option<u64>,
    max_blocks: Option<u64>,
    stale_secs: Option<Secs>,
    speculative_ttl_secs: Option<Secs>,
    tokenizer: Option<PathBuf>,
    chat_template: Option<PathBuf>,
    chat_template_content_format: Option<ContentFormat>,
    max_tokenize_bytes: Option<u64>,
    parity_floor: Option<f64>,
    tier_weights: Option<BTreeMap<String, f64>>,
    tier_load_tokens_per_sec: Option<f64>,
}

impl RawPrecise {
    pub(super) fn validate(self, ck: &Checker<'_>) -> Result<PreciseConfig, ConfigError> {
        let d = PreciseConfig::default();
        let tokenizer = self.tokenizer_setting(ck)?;
        let block_size = self.block_size.unwrap_or(d.block_size as u64);
        if !(1..=4096).contains(&block_size) {
            return Err(ck.bad(
                "precise.block_size",
                block_size,
                "is out of range (tokens, 1 to 4096; must equal the engines' --block-size)",
            ));
        }
        let max_blocks = self.max_blocks.unwrap_or(d.max_blocks.get() as u64);
        let max_blocks = NonZeroUsize::new(max_blocks as usize)
            .filter(|_| max_blocks <= 1 << 32)
            .ok_or_else(|| {
                ck.bad(
                    "precise.max_blocks",
                    max_blocks,
                    "is out of range (blocks, 1 to 2^32)",
                )
            })?;
        let parity_floor = self.parity_floor.unwrap_or(d.parity_floor);
        if !(0.0..=1.0).contains(&parity_floor) {
            return Err(ck.bad(
                "precise.parity_floor",
                parity_floor,
                "is out of range (a share of checked answers whose blocks the engine confirmed, 0 to 1; 0 = never fall back)",
            ));
        }
        let tier_weights = self.tier_weights(ck)?;
        let load = self
            .tier_load_tokens_per_sec
            .unwrap_or(d.tier_load_tokens_per_sec);
        if !(load.is_finite() && load > 0.0 && load <= 1e9) {
            return Err(ck.bad(
                "precise.tier_load_tokens_per_sec",
                load,
                "is out of range (tokens per second, above 0 and at most 1e9)",
            ));
        }
        Ok(PreciseConfig {
            block_size: block_size as usize,
            max_blocks,
            stale: ck.secs(
                "precise.stale_secs",
                self.stale_secs,
                d.stale.as_secs_f64(),
                None,
            )?,
            speculative_ttl: ck.secs(
                "precise.speculative_ttl_secs",
                self.speculative_ttl_secs,
                d.speculative_ttl.as_secs_f64(),
                Some("off"),
            )?,
            tokenizer,
            parity_floor,
            tier_weights,
            tier_load_tokens_per_sec: load,
        })
    }

    /// `precise.tier_weights`: each a weight from 0 to 1 under a name of letters, digits,
    /// `_` or `-`, named once (case aside), at most [`MAX_TIERS`] with the defaults.
    fn tier_weights(&self, ck: &Checker<'_>) -> Result<TierWeights, ConfigError> {
        let Some(given) = &self.tier_weights else {
            return Ok(TierWeights::default());
        };
        let mut seen: Vec<String> = Vec::new();
        for (name, weight) in given {
            let key = format!("precise.tier_weights.{name}");
            let upper = name.to_ascii_uppercase();
            if name.is_empty()
                || name.len() > 32
                || !name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
            {
                return Err(ck.err(
                    "precise.tier_weights",
                    format!("`{name}` is not a tier name (the engines' `medium`, e.g. GPU, CPU, STORAGE: letters, digits, `_` or `-`, at most 32)"),
                ));
            }
            if seen.contains(&upper) {
                return Err(ck.err(
                    &key,
                    format!("names tier {upper} twice (names compare without case)"),
                ));
            }
            seen.push(upper);
            if !(0.0..=1.0).contains(weight) {
                return Err(ck.bad(
                    &key,
                    weight,
                    "is out of range (a block's worth against a GPU block, 0 to 1; 0 = not credited)",
                ));
            }
        }
        let weights = TierWeights::new(given.iter().map(|(n, w)| (n.as_str(), *w)));
        if weights.tiers().len() > MAX_TIERS {
            return Err(ck.err(
                "precise.tier_weights",
                format!(
                    "names {} tiers with the defaults (GPU, CPU, STORAGE); at most {MAX_TIERS}",
                    weights.tiers().len()
                ),
            ));
        }
        Ok(weights)
    }

    /// `precise.tokenizer` and the keys that go with it (the files are not read here).
    fn tokenizer_setting(&self, ck: &Checker<'_>) -> Result<Option<TokenizerSetting>, ConfigError> {
        let max_bytes = self
            .max_tokenize_bytes
            .unwrap_or(DEFAULT_MAX_TOKENIZE_BYTES as u64);
        if !(1024..=1 << 30).contains(&max_bytes) {
            return Err(ck.bad(
                "precise.max_tokenize_bytes",
                max_bytes,
                "is out of range (bytes, 1024 to 2^30)",
            ));
        }
        match (&self.tokenizer, &self.chat_template) {
            (Some(path), chat_template) => Ok(Some(TokenizerSetting {
                path: path.clone(),
                chat_template: chat_template.clone(),
                content_format: self.chat_template_content_format.unwrap_or_default(),
                max_bytes: max_bytes as usize,
                tokenizer_at: ck.site("precise.tokenizer"),
                chat_template_at: ck.site("precise.chat_template"),
            })),
            (None, Some(_)) => Err(ck.err(
                "precise.chat_template",
                "needs `precise.tokenizer` (the model folder or its tokenizer.json)",
            )),
            (None, None) => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::testing::{ONE, err, load};

    #[test]
    fn precise_keys_are_read_with_defaults() {
        let doc = "policy: precise_cache_aware\nworkers:\n  - url: http://a:1\n    kv_events:\n      endpoint: tcp://10.0.0.7:5557\n      topic: kv-events\n      replay_endpoint: tcp://10.0.0.7:5558\n  - url: http://b:1\n";
        let c = load(&[("p.yaml", doc)]).unwrap();
        assert_eq!(c.precise.block_size, 16);
        assert_eq!(c.precise.max_blocks.get(), 1_000_000);
        assert_eq!(c.precise.stale, Duration::from_secs(30));
        assert_eq!(c.precise.speculative_ttl, Duration::from_secs(2));
        assert_eq!(c.precise, PreciseConfig::default());
        let c = load(&[
            ("p.yaml", doc),
            ("q.yaml", "precise:\n  block_size: 32\n  max_blocks: 10\n  stale_secs: 0.5\n  speculative_ttl_secs: 0\n"),
        ])
        .unwrap();
        assert_eq!((c.precise.block_size, c.precise.max_blocks.get()), (32, 10));
        assert_eq!(c.precise.stale, Duration::from_millis(500));
        assert!(c.precise.speculative_ttl.is_zero());
    }

    #[test]
    fn precise_errors_name_the_key() {
        let base = "workers:\n  - url: http://a:1\n";
        for (over, key, value) in [
            ("precise:\n  block_size: 0\n", "precise.block_size", "0"),
            ("precise:\n  max_blocks: 0\n", "precise.max_blocks", "0"),
            ("precise:\n  stale_secs: 0\n", "precise.stale_secs", "0"),
            (
                "precise:\n  chat_template: t.jinja\n",
                "precise.chat_template",
                "precise.tokenizer",
            ),
            (
                "precise:\n  chat_template_content_format: list\n",
                "precise.chat_template_content_format",
                "list",
            ),
            (
                "precise:\n  max_tokenize_bytes: 10\n",
                "precise.max_tokenize_bytes",
                "10",
            ),
        ] {
            let e = err(&[("base.yaml", base), ("over.yaml", over)]);
            assert!(
                e.contains("over.yaml") && e.contains(key) && e.contains(value),
                "{over:?} gave {e}"
            );
        }
    }

    /// The tokenizer's files are read by the part that tokenizes; the setting keeps
    /// where each key was written, for that part's refusal.
    #[test]
    fn a_tokenizer_setting_names_its_files_and_where_they_were_set() {
        let base = "workers:\n  - url: http://a:1\n";
        let over = "precise:\n  tokenizer: Qwen/Qwen3-8B\n  chat_template: t.jinja\n  chat_template_content_format: openai\n";
        let c = load(&[("base.yaml", base), ("over.yaml", over)]).unwrap();
        let t = c.precise.tokenizer.expect("a tokenizer setting");
        assert_eq!(
            (
                t.path.to_str(),
                t.chat_template.as_deref().and_then(|p| p.to_str())
            ),
            (Some("Qwen/Qwen3-8B"), Some("t.jinja"))
        );
        assert_eq!(
            (t.content_format, t.max_bytes),
            (ContentFormat::OpenAi, DEFAULT_MAX_TOKENIZE_BYTES)
        );
        assert_eq!(
            t.tokenizer_at.refuse("cannot be read").to_string(),
            "over.yaml:2: `precise.tokenizer`: cannot be read"
        );
        assert_eq!(
            t.chat_template_at.refuse("does not render").to_string(),
            "over.yaml:3: `precise.chat_template`: does not render"
        );
    }

    #[test]
    fn tier_weights_merge_over_the_defaults_and_are_checked_where_written() {
        let c = load(&[("a.yaml", ONE)]).unwrap();
        let names = |w: &TierWeights| {
            w.tiers()
                .iter()
                .map(|(n, w)| format!("{n}={w}"))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            names(&c.precise.tier_weights),
            ["GPU=1", "CPU=0.8", "STORAGE=0.5"]
        );
        assert_eq!(c.precise.tier_load_tokens_per_sec, 100_000.0);
        let doc =
            "precise:\n  tier_weights: {cpu: 0.9, DISK: 0.25}\n  tier_load_tokens_per_sec: 25000\n";
        let c = load(&[("a.yaml", ONE), ("b.yaml", doc)]).unwrap();
        assert_eq!(
            names(&c.precise.tier_weights),
            ["GPU=1", "CPU=0.9", "STORAGE=0.5", "DISK=0.25"]
        );
        assert_eq!(c.precise.tier_load_tokens_per_sec, 25_000.0);
        for (bad, key, says) in [
            (
                "  tier_weights:\n    CPU: 1.5\n",
                "precise.tier_weights.CPU",
                "`1.5` is out of range",
            ),
            (
                "  tier_weights: {CPU: -1}\n",
                "precise.tier_weights.CPU",
                "0 to 1",
            ),
            (
                "  tier_weights: {cpu: 0.5, CPU: 0.6}\n",
                "precise.tier_weights",
                "twice",
            ),
            (
                "  tier_weights: {\"C P U\": 0.5}\n",
                "precise.tier_weights",
                "not a tier name",
            ),
            (
                "  tier_weights: {A: 0, B: 0, C: 0, D: 0, E: 0, F: 0}\n",
                "precise.tier_weights",
                "at most 8",
            ),
            (
                "  tier_load_tokens_per_sec: 0\n",
                "precise.tier_load_tokens_per_sec",
                "tokens per second",
            ),
            (
                "  tier_load_tokens_per_sec: .inf\n",
                "precise.tier_load_tokens_per_sec",
                "tokens per second",
            ),
        ] {
            let e = err(&[("a.yaml", ONE), ("b.yaml", &format!("precise:\n{bad}"))]);
            assert!(
                e.contains("b.yaml") && e.contains(key) && e.contains(says),
                "{bad:?} gave {e}"
            );
        }
        // The line of the weight itself.
        let e = err(&[
            ("a.yaml", ONE),
            (
                "b.yaml",
                "precise:\n  tier_weights:\n    GPU: 1\n    CPU: 2\n",
            ),
        ]);
        assert!(e.contains("b.yaml:4"), "{e}");
    }

    #[test]
    fn the_parity_floor_is_a_ratio_from_0_to_1() {
        let key = "precise.parity_floor";
        let doc = |v: &str| format!("precise:\n  parity_floor: {v}\n");
        for bad in ["-0.1", "1.5", ".nan"] {
            let e = err(&[("a.yaml", ONE), ("b.yaml", &doc(bad))]);
            assert!(e.contains(key) && e.contains("0 to 1"), "{key} {bad}: {e}");
        }
        for good in ["0", "0.5", "1"] {
            assert!(
                load(&[("a.yaml", ONE), ("b.yaml", &doc(good))]).is_ok(),
                "{key} {good}"
            );
        }
        assert_eq!(load(&[("a", ONE)]).unwrap().precise.parity_floor, 0.5);
    }
}

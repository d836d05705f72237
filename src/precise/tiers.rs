//! KV tiers: where an engine holds a block (the events' `medium`: `"GPU"`, `"CPU"`,
//! `"STORAGE"`, …; spec §5.7) and what a block there is worth against one on the GPU
//! (`precise.tier_weights`). Pure, owned by the block index (behind its lock).
//!
//! The configured tiers are the only ones reported (`/workers`, the `tier` label of
//! `/metrics`), so label values stay bounded whatever the engines send: a medium the
//! config does not name is kept apart in the index (a removal applies to its own medium
//! only) but weighted and reported as the lightest configured tier.

use crate::config::TierWeights;

/// Most medium names the index tells apart (the configured tiers first); names beyond
/// share the last slot. Engines report two or three.
pub const MAX_MEDIUMS: usize = 16;

/// Most configured tiers (`precise.tier_weights`).
pub use crate::config::MAX_TIERS;

/// A medium as the index numbers it: configured tiers first (heaviest first), then
/// the names the engines sent that the config does not know, in order of appearance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Medium(u8);

impl Medium {
    /// Its position in per-medium arrays (below [`MAX_MEDIUMS`]).
    pub fn index(self) -> usize {
        usize::from(self.0)
    }

    /// The medium at position `i` of a per-medium array.
    pub(crate) fn from_index(i: usize) -> Medium {
        Medium(i.min(MAX_MEDIUMS - 1) as u8)
    }
}

/// The configured tiers and every medium seen. See the module docs.
#[derive(Debug, Clone)]
pub struct Tiers {
    /// Configured tiers: upper-case name and weight, heaviest first.
    configured: Vec<(String, f64)>,
    /// Every medium named so far: its upper-case name.
    mediums: Vec<String>,
    /// Per medium, the configured tier it is weighted and reported as (the lightest
    /// for a name the config does not know). Configured tiers are heaviest first, so
    /// the lower of two tiers is the heavier.
    tier_of: [u8; MAX_MEDIUMS],
    /// The GPU tier: a nil `medium` (engines before the field existed) is the GPU.
    gpu: Medium,
}

impl Tiers {
    /// The tiers of `weights` (GPU always among them: the weights merge over defaults).
    pub fn new(weights: &TierWeights) -> Self {
        let configured: Vec<(String, f64)> = weights
            .tiers()
            .iter()
            .take(MAX_TIERS)
            .map(|(n, w)| (n.to_ascii_uppercase(), *w))
            .collect();
        let mediums: Vec<String> = configured.iter().map(|(n, _)| n.clone()).collect();
        let lightest = configured.len().saturating_sub(1) as u8;
        let mut tier_of = [lightest; MAX_MEDIUMS];
        for (i, t) in tier_of.iter_mut().enumerate().take(configured.len()) {
            *t = i as u8;
        }
        let gpu = configured.iter().position(|(n, _)| n == "GPU").unwrap_or(0);
        Tiers {
            configured,
            mediums,
            tier_of,
            gpu: Medium(gpu as u8),
        }
    }

    /// The medium an event names (`None` = nil: the GPU), remembered when new.
    pub fn medium(&mut self, name: Option<&str>) -> Medium {
        let Some(name) = name else {
            return self.gpu;
        };
        if let Some(i) = self
            .mediums
            .iter()
            .position(|n| n.eq_ignore_ascii_case(name))
        {
            return Medium(i as u8);
        }
        if self.mediums.len() >= MAX_MEDIUMS {
            return Medium((MAX_MEDIUMS - 1) as u8);
        }
        // Its tier is already the lightest (`tier_of`'s fill).
        self.mediums.push(name.to_ascii_uppercase());
        Medium((self.mediums.len() - 1) as u8)
    }

    /// The GPU medium.
    pub fn gpu(&self) -> Medium {
        self.gpu
    }

    /// The configured tier `m` counts as (an index into [`Tiers::names`]; the lower of
    /// two is the heavier).
    pub fn tier(&self, m: Medium) -> usize {
        usize::from(self.tier_of[m.index()])
    }

    /// The configured GPU tier's index.
    pub fn gpu_tier(&self) -> usize {
        self.tier(self.gpu)
    }

    /// The weight of configured tier `tier` (0 for an index past them).
    pub fn weight(&self, tier: usize) -> f64 {
        self.configured.get(tier).map_or(0.0, |(_, w)| *w)
    }

    /// The configured tiers' names, heaviest first.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.configured.iter().map(|(n, _)| n.as_str())
    }

    /// How many tiers are configured.
    pub fn len(&self) -> usize {
        self.configured.len()
    }

    pub fn is_empty(&self) -> bool {
        self.configured.is_empty()
    }
}

impl Default for Tiers {
    fn default() -> Self {
        Tiers::new(&TierWeights::default())
    }
}

/// A matched run of a request's blocks on one source, tier by tier in prompt order:
/// `segments` are (configured tier, blocks) with neighbours of the same tier merged.
/// Each block counts in the heaviest tier that holds it (a speculative entry is the
/// GPU's).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Run {
    /// Blocks matched from the first, in any tier.
    pub blocks: usize,
    pub segments: Vec<(u8, u32)>,
}

impl Run {
    /// Adds one block held in configured tier `tier`.
    pub fn push(&mut self, tier: usize) {
        self.blocks += 1;
        match self.segments.last_mut() {
            Some((t, n)) if usize::from(*t) == tier => *n += 1,
            _ => self.segments.push((tier as u8, 1)),
        }
    }

    /// The run's worth in GPU blocks: each block weighted by its tier.
    pub fn credit(&self, weights: &TierWeights) -> f64 {
        self.segments
            .iter()
            .map(|(t, n)| {
                let w = weights
                    .tiers()
                    .get(usize::from(*t))
                    .map_or(0.0, |(_, w)| *w);
                w * f64::from(*n)
            })
            .sum()
    }

    /// Blocks per configured tier.
    pub fn by_tier(&self) -> [u64; MAX_TIERS] {
        let mut out = [0; MAX_TIERS];
        for (t, n) in &self.segments {
            if let Some(slot) = out.get_mut(usize::from(*t)) {
                *slot += u64::from(*n);
            }
        }
        out
    }

    /// Blocks held only off the GPU (configured tier `gpu` is the GPU's).
    pub fn host_blocks(&self, gpu: usize) -> usize {
        self.segments
            .iter()
            .filter(|(t, _)| usize::from(*t) != gpu)
            .map(|(_, n)| *n as usize)
            .sum()
    }

    /// `tokens` (a prefix of the run, counted from its first block, `block_size`
    /// tokens each) split by the tier of the blocks they fall in; tokens past the run
    /// count as `gpu`'s (the engine's own cache, which the router had not heard of).
    pub fn split(&self, tokens: u64, block_size: usize, gpu: usize) -> [u64; MAX_TIERS] {
        let mut out = [0; MAX_TIERS];
        let mut left = tokens;
        for (t, n) in &self.segments {
            let take = left.min(u64::from(*n) * block_size as u64);
            if let Some(slot) = out.get_mut(usize::from(*t)) {
                *slot += take;
            }
            left -= take;
        }
        if let Some(slot) = out.get_mut(gpu) {
            *slot += left;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mediums_are_configured_tiers_or_kept_apart_as_the_lightest() {
        let mut t = Tiers::default();
        assert_eq!(t.names().collect::<Vec<_>>(), ["GPU", "CPU", "STORAGE"]);
        let gpu = t.medium(Some("GPU"));
        assert_eq!((t.medium(None), t.medium(Some("gpu"))), (gpu, gpu));
        let cpu = t.medium(Some("CPU"));
        assert_eq!((t.tier(cpu), t.weight(t.tier(cpu))), (1, 0.8));
        // A name the config does not know: its own medium, weighted as STORAGE.
        let disk = t.medium(Some("disk"));
        assert_ne!(disk, t.medium(Some("STORAGE")));
        assert_eq!((t.tier(disk), t.weight(t.tier(disk))), (2, 0.5));
        assert_eq!(t.medium(Some("DISK")), disk);
        // Bounded: past MAX_MEDIUMS, names share the last slot.
        for i in 0..40 {
            assert!(t.medium(Some(&format!("m{i}"))).index() < MAX_MEDIUMS);
        }
    }

    #[test]
    fn a_run_splits_credit_and_tokens_by_tier() {
        let weights = TierWeights::default();
        let mut r = Run::default();
        for tier in [0, 0, 1, 1, 1, 0] {
            r.push(tier);
        }
        assert_eq!(r.segments, [(0, 2), (1, 3), (0, 1)]);
        assert!((r.credit(&weights) - (3.0 + 3.0 * 0.8)).abs() < 1e-9);
        assert_eq!(&r.by_tier()[..3], [3, 3, 0]);
        assert_eq!(r.host_blocks(0), 3);
        // 10 tokens of 4-token blocks: 8 on the GPU blocks, 2 in the CPU's.
        assert_eq!(&r.split(10, 4, 0)[..2], [8, 2]);
        // Past the run: the engine's own cache.
        assert_eq!(&r.split(30, 4, 0)[..2], [8 + 4 + 6, 12]);
    }
}

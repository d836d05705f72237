//! `prefix_hash`: the first `prefix_hash.prefix_bytes` bytes of the routing text,
//! hashed, on the same bounded-load hash ring as `consistent_hash`. Requests that share
//! that head (a system prompt, a long instruction, a document read by many sessions)
//! land on the same worker while it is under `load_factor` × the mean load, so its KV
//! cache holds the head once; past the bound the key walks the ring. SMG ships the same
//! idea under this name.
//!
//! It keeps no routing memory: the ring comes from the workers' keys, so every router
//! replica sends a head to the same worker without sharing state, and its memory and
//! decision cost do not grow with traffic. The price is precision: prompts that share
//! less than the head are spread by their differences, and a head shorter than
//! `prefix_bytes` is the whole (short) prompt. `cache_aware` learns longer and shorter
//! shared prefixes from what was served.

use rand::RngCore;

use super::consistent_hash::{RingCache, load_cap};
use super::{Candidate, Pick, Policy, RouteRequest};
use crate::config::PrefixHashConfig;
use crate::pools::pool::{PoolListener, WorkerSet};

/// See the module docs.
pub struct PrefixHash {
    prefix_bytes: usize,
    load_factor: f64,
    ring: RingCache,
}

impl PrefixHash {
    pub fn new(cfg: &PrefixHashConfig) -> Self {
        PrefixHash {
            prefix_bytes: cfg.prefix_bytes,
            load_factor: cfg.load_factor,
            ring: RingCache::default(),
        }
    }

    /// The ring position of `text`'s head (`None` for an empty text).
    fn key(&self, text: &[u8]) -> Option<u64> {
        let head = &text[..text.len().min(self.prefix_bytes)];
        (!head.is_empty()).then(|| xxhash_rust::xxh3::xxh3_64(head))
    }
}

/// Keeps no per-worker state.
impl PoolListener for PrefixHash {}

impl Policy for PrefixHash {
    fn name(&self) -> &'static str {
        "prefix_hash"
    }

    fn pick(
        &self,
        req: &RouteRequest<'_>,
        set: &WorkerSet,
        candidates: &[Candidate],
        rng: &mut dyn RngCore,
    ) -> Pick {
        let w = match self.key(req.text()) {
            Some(hash) => {
                let cap = load_cap(candidates, self.load_factor);
                self.ring.ring_for(set).lookup(hash, candidates, cap)
            }
            // Nothing to hash: least loaded, as any load-only policy.
            None => super::select::least_loaded(super::select::usable(candidates), None, rng),
        };
        Pick::load_only(w.map(|c| c.id), req.text().len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(prefix_bytes: usize) -> PrefixHash {
        PrefixHash::new(&PrefixHashConfig {
            prefix_bytes,
            load_factor: 1.25,
        })
    }

    #[test]
    fn prompts_that_share_the_head_share_a_key_and_others_spread() {
        let p = policy(16);
        let system = b"You are a helpful assistant. ";
        let a = [&system[..], b"What is a KV cache?"].concat();
        let b = [&system[..], b"Name three rivers."].concat();
        assert_eq!(p.key(&a), p.key(&b));
        assert_ne!(p.key(&a), p.key(b"Another system prompt, then a question"));
        // A text shorter than the head is its own key.
        assert_ne!(p.key(b"short"), p.key(b"shorter"));
        assert_eq!(p.key(b""), None);
    }
}

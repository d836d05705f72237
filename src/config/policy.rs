//! `policy:` — which routing policy decides (see `crate::policy`).

use super::check::named;
use super::difference::Section;

/// Routing policy (top-level `policy` key).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PolicyKind {
    /// Longest prefix match in the radix tree, guarded by load balance (the default).
    #[default]
    CacheAware,
    /// Baseline: usable workers in turn.
    RoundRobin,
    /// Baseline: a uniformly random usable worker.
    Random,
    /// Baseline: the usable worker with the fewest in-flight requests (+ penalty).
    LeastLoad,
    /// Two random usable workers, the less loaded.
    PowerOfTwo,
    /// The session (or prompt digest) on a hash ring, with bounded loads.
    ConsistentHash,
    /// The prompt's first `prefix_hash.prefix_bytes` on a hash ring, with bounded loads.
    PrefixHash,
    /// Prefix match on the blocks the engines report holding (vLLM KV-cache events,
    /// `precise:` and per-worker `kv_events:`), falling back to the approximate tree
    /// when a request carries no token ids or no worker's event feed is usable.
    PreciseCacheAware,
    /// The least expected time to first token: queued prefill work plus this request's
    /// uncached prefill, over each worker's learned prefill rate (`policy::cost_aware`).
    CostAware,
    /// LMCache occupancy signals (`workers[].lmcache`), least-load when they are missing.
    LmcacheAware,
}

impl PolicyKind {
    /// The name used in config, logs and `/workers`.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::CacheAware => "cache_aware",
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::Random => "random",
            PolicyKind::LeastLoad => "least_load",
            PolicyKind::PreciseCacheAware => "precise_cache_aware",
            PolicyKind::PowerOfTwo => "power_of_two",
            PolicyKind::ConsistentHash => "consistent_hash",
            PolicyKind::PrefixHash => "prefix_hash",
            PolicyKind::CostAware => "cost_aware",
            PolicyKind::LmcacheAware => "lmcache_aware",
        }
    }
}

impl Section for PolicyKind {
    const KEY: &'static str = "policy";
}

named!(PolicyKind {
    "cache_aware" => PolicyKind::CacheAware,
    "round_robin" => PolicyKind::RoundRobin,
    "random" => PolicyKind::Random,
    "least_load" => PolicyKind::LeastLoad,
    "power_of_two" => PolicyKind::PowerOfTwo,
    "consistent_hash" => PolicyKind::ConsistentHash,
    "prefix_hash" => PolicyKind::PrefixHash,
    "precise_cache_aware" => PolicyKind::PreciseCacheAware,
    "cost_aware" => PolicyKind::CostAware,
    "lmcache_aware" => PolicyKind::LmcacheAware,
});

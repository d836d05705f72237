//! Routing policies: which worker gets a request, behind one seam.
//!
//! Every policy implements [`Policy`]: `pick` chooses among the usable candidates from
//! the request's routing context (pure: no I/O, no await, no lock held past return), and
//! `observe` hears how the attempt it picked ended. `observe` is the only place routing
//! memory is written (a tree insert, a session binding), and only for
//! [`Outcome::Served`] (the first response byte with a 2xx status): a failed or
//! cancelled attempt leaves nothing behind, and a retry that succeeds elsewhere is
//! recorded there only. Each policy owns its state, keyed by [`WorkerId`] (stable for a
//! worker's key, see [`crate::pools::pool`]), and hears membership events as a
//! [`PoolListener`] so a worker that leaves or goes down is forgotten.
//!
//! Eligibility is decided once, by the proxy, for every policy alike
//! ([`Candidate::usable`]: healthy, breaker admitting, under `max_load`, not yet tried
//! for this request); selection is the policy's. [`build`] is the one place that names a
//! policy kind.
//!
//! ```text
//! select          shared rules: least loaded with stable ties, the overload guard
//! round_robin     usable workers in turn
//! random          a uniformly random usable worker
//! least_load      fewest in flight (+ load_penalty)
//! power_of_two    two random usable workers, the less loaded
//! consistent_hash the session (or prompt digest) on a hash ring, with bounded loads
//! prefix_hash     the prompt's head on that ring: shared heads share a worker, no memory
//! cache_aware     longest prefix in the radix tree (owns the tree), load-guarded
//! cost_aware      least expected TTFT: queued prefill + uncached prefill over the
//!                 worker's learned prefill rate (the tree of cache_aware, no knobs)
//! lmcache         LMCache occupancy signals, load-guarded; least-load without them
//! precise         vLLM KV events (owns nothing but its view of precise::Precise),
//!                 cache_aware as its fallback
//! ```

mod cache_aware;
mod consistent_hash;
mod cost_aware;
pub mod decide;
mod least_load;
mod lmcache;
mod matches;
mod power_of_two;
pub mod precise;
mod prefix_hash;
mod random;
mod round_robin;
pub mod select;
pub mod session;
pub mod view;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use rand::RngCore;

pub use cache_aware::{CacheAware, Memory, pick_cache_aware};
pub use select::{BlockScale, CacheParams};
pub use view::View;

use crate::config::{Config, PolicyKind};
use crate::fleet::Fleet;
use crate::pools::Leg;
use crate::pools::pool::{Pool, PoolListener, Worker, WorkerId, WorkerSet};
use crate::prompt::{Endpoint, RouteContext};
use crate::shutdown::Shutdown;
use crate::tree::SharedTree;

/// The routing table the proxy routes with: each pool's policy (see [`crate::pools`]).
pub type Routes = crate::pools::Pools<Arc<dyn Policy>>;

/// One version of [`Routes`]' table.
pub type RoutesTable = crate::pools::Table<Arc<dyn Policy>>;

/// A boxed future, for the few async hooks of the seam.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Why a worker was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// Followed prefix affinity.
    CacheHit,
    /// A hit sent to the least-loaded worker instead (a degradation).
    HitOverloaded,
    /// No sufficient prefix match (or a load-only policy): least-loaded.
    Miss,
    /// Nothing to match on: least-loaded.
    EmptyText,
    /// No usable worker.
    NoWorker,
    /// Followed the request's session binding (`session:`).
    Session,
    /// Sent to the worker holding the `/v1/responses` state it continues.
    Conversation,
    /// Followed a worker's cache signal (`lmcache_aware`: the most LMCache room).
    CacheSignal,
    /// A call on a stored `/v1/responses` id whose worker is unknown, sent to every
    /// usable worker (`crate::proxy::responses`).
    FanOut,
}

impl Reason {
    /// Label used in logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::CacheHit => "cache_hit",
            Reason::HitOverloaded => "hit_overloaded",
            Reason::Miss => "miss",
            Reason::EmptyText => "empty_text",
            Reason::NoWorker => "no_worker",
            Reason::Session => "session",
            Reason::Conversation => "conversation",
            Reason::CacheSignal => "cache_signal",
            Reason::FanOut => "fan_out",
        }
    }
}

/// A worker as the policy sees it at decision time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    pub id: WorkerId,
    /// `in_flight + load_penalty`.
    pub load: usize,
    /// Decided by the proxy for every policy alike: healthy, breaker admitting, under
    /// `max_load`, not already tried for this request.
    pub usable: bool,
    /// Whether prefix affinity applies to this worker.
    pub cache_aware: bool,
    /// Requests the router sent this worker that have not had their first byte yet.
    pub pending: usize,
}

/// A decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pick {
    /// The chosen worker; `None` only with [`Reason::NoWorker`].
    pub worker: Option<WorkerId>,
    pub reason: Reason,
    /// *Predicted*: the prefix the chosen worker holds, by the policy's memory — prompt
    /// tokens in whole KV blocks: exact in precise mode, estimated from the tree's bytes
    /// of routing text at the worker's learned tokens per byte otherwise
    /// ([`BlockScale`]); 0 for load-only policies (see `unit`).
    pub matched: usize,
    /// *Available*: the longest prefix any cache-aware worker of the pool holds, usable
    /// now or not, in the same unit (≥ `matched`); what perfect routing could reuse.
    pub available: usize,
    /// Length of what was matched against, in the same unit.
    pub text_len: usize,
    /// What `matched` and `text_len` count.
    pub unit: MatchUnit,
    /// The engine's data-parallel rank to send the request to (vLLM's
    /// `X-data-parallel-rank` header), when precise mode knows the rank holding the
    /// prefix; `None` lets the engine balance its ranks.
    pub dp_rank: Option<u32>,
    /// Whether the chosen worker takes prefix affinity (`cache_aware: true`): only then
    /// is its served prompt recorded.
    pub cache_aware: bool,
    /// Uncached prompt tokens the chosen worker is expected to prefill (reserved on it
    /// until the first response byte, see `pool::prefill`); 0 when the policy does not
    /// estimate them.
    pub prefill_tokens: u64,
    /// For a hit on the approximate tree's records: where the predicted prefix ends in
    /// the tree ([`crate::tree::Mark`]; evidence unless a request that may still run
    /// recorded it, [`select::eviction_evidence`]), which the answer confirms or
    /// refutes ([`Delivery`]); none otherwise.
    pub mark: crate::tree::Mark,
}

/// Bytes of routing text per token for a [`MatchUnit::Bytes`] pick (only load-only ones,
/// matching nothing, count in bytes; about 4 for English with the common BPE tokenizers).
pub const BYTES_PER_TOKEN: u64 = 4;

/// The unit of [`Pick::matched`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatchUnit {
    /// Bytes of routing text (a load-only decision).
    Bytes,
    /// Prompt tokens in whole KV blocks (the tree's estimated, precise mode's exact).
    Tokens,
}

impl Pick {
    /// matched / text length, 0 when the text is empty.
    pub fn matched_ratio(&self) -> f64 {
        if self.text_len == 0 {
            0.0
        } else {
            self.matched as f64 / self.text_len as f64
        }
    }

    /// Prefix tokens the chosen worker is expected to reuse (*predicted*, see
    /// [`Pick::matched`]).
    pub fn saved_tokens(&self) -> u64 {
        self.tokens(self.matched)
    }

    /// The whole text matched against, in tokens (as [`Pick::saved_tokens`]).
    pub fn text_tokens(&self) -> u64 {
        self.tokens(self.text_len)
    }

    /// *Available* tokens: as [`Pick::saved_tokens`], for [`Pick::available`].
    pub fn available_tokens(&self) -> u64 {
        self.tokens(self.available.max(self.matched))
    }

    fn tokens(&self, n: usize) -> u64 {
        match self.unit {
            MatchUnit::Bytes => n as u64 / BYTES_PER_TOKEN,
            MatchUnit::Tokens => n as u64,
        }
    }

    /// A load-only decision: `worker` (or none), nothing matched.
    pub fn load_only(worker: Option<WorkerId>, text_len: usize) -> Pick {
        Pick {
            worker,
            reason: if worker.is_some() {
                Reason::Miss
            } else {
                Reason::NoWorker
            },
            matched: 0,
            available: 0,
            text_len,
            unit: MatchUnit::Bytes,
            dp_rank: None,
            cache_aware: false,
            prefill_tokens: 0,
            mark: crate::tree::Mark::default(),
        }
    }
}

/// How an attempt a policy picked ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The worker answered with a 2xx status (its first response byte arrived).
    Served,
    /// It failed: connection error, time-out, or a non-2xx status.
    Failed,
    /// The client went away before the worker answered.
    Cancelled,
}

/// What a complete answer told, read from its bytes as they passed to the client.
#[derive(Debug, Default)]
pub struct Answer<'a> {
    /// A `/v1/responses` answer's id (a later `previous_response_id`).
    pub response_id: Option<&'a str>,
    /// What the engine served from its KV cache of a prediction the pick marked
    /// ([`Pick::mark`]).
    pub delivery: Option<Delivery>,
    /// What the policy's [`Policy::prepare`] worked out for the request, when it
    /// keyed its blocks (precise mode's token-parity check reads it).
    pub prepared: Option<&'a Prepared>,
    /// Prompt tokens the engine reported cached for it (the *delivered* prefix), when
    /// it reported them (precise mode splits them by KV tier).
    pub delivered_tokens: Option<u64>,
}

/// The answer to a marked prediction: the pick ([`Pick::mark`] `mark`) predicted
/// `predicted_tokens` cached on the worker; its answer reported `delivered_tokens`
/// (`cached_tokens`), `short` when far fewer ([`Delivery::is_short`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delivery {
    pub mark: crate::tree::Mark,
    pub predicted_tokens: u64,
    pub delivered_tokens: u64,
    pub short: bool,
}

impl Delivery {
    /// Whether `delivered` tokens fall short of `predicted` by enough to act on: under
    /// 3/4 of it and by more than two `block_tokens` blocks. The margin absorbs the
    /// error of a tokens-per-byte estimate and the chat template's tokens; an eviction
    /// loses whole runs of blocks.
    pub fn is_short(predicted: u64, delivered: u64, block_tokens: u64) -> bool {
        delivered * 4 < predicted * 3 && predicted - delivered > 2 * block_tokens
    }
}

/// What a request brings to a policy, worked out once before its first attempt.
#[derive(Debug, Default)]
pub struct RouteRequest<'a> {
    /// The routed endpoint's context (prompt text, digest); `None` for other paths.
    pub ctx: Option<&'a RouteContext<'a>>,
    /// What the policy's [`Policy::prepare`] worked out, if anything.
    pub prepared: Prepared,
    /// xxh3-64 of the request's session key, when it carries one (`session:`).
    pub session: Option<u64>,
    /// Breaks load ties stably: the session hash, else the prompt digest; `None` = at
    /// random (see [`select::least_loaded`]).
    pub tie: Option<u64>,
    /// The routing text's chunk hashes once computed (routing state shared by router
    /// replicas: the pick's match and the publish of what was served use the same).
    pub chain: crate::tree::ChainMemo,
    /// The LoRA adapter it runs under, when it names one: [`decide::pick_slot`] prefers
    /// the workers that hold it.
    pub adapter: Option<AdapterAsk>,
}

/// A request's LoRA adapter, as [`decide::pick_slot`] places it (see
/// [`crate::pools::pool::adapters`]).
#[derive(Debug, Clone)]
pub struct AdapterAsk {
    /// The adapter's served name.
    pub name: Arc<str>,
    /// The balance margins of the pool's `cache:` (`balance_abs_threshold`,
    /// `balance_rel_threshold`): the workers that hold the adapter are preferred
    /// unless the least loaded of them is overloaded against the pool's least loaded.
    pub balance: CacheParams,
}

impl RouteRequest<'_> {
    /// The routing text (bytes), empty when there is none.
    pub fn text(&self) -> &[u8] {
        self.ctx.map_or(&[][..], |c| &c.text)
    }
}

/// A policy's per-request preparation, done before the decision (it may wait).
/// Cloning shares its buffers.
#[derive(Debug, Default, Clone)]
pub enum Prepared {
    #[default]
    Nothing,
    /// Precise mode: the prompt's KV blocks, or why precise scoring is neutral.
    Blocks(crate::precise::Lookup),
}

/// What [`Policy::prepare`] reads: the request as it arrived.
pub struct RequestParts<'a> {
    pub headers: &'a http::HeaderMap,
    pub endpoint: Option<Endpoint>,
    pub body: &'a bytes::Bytes,
}

/// A routing policy. See the module docs.
pub trait Policy: PoolListener {
    /// The policy's name (config, logs, `/workers`).
    fn name(&self) -> &'static str;

    /// Per-request work that may wait (precise mode tokenizes on the blocking pool);
    /// `None` (the default) when the policy needs none, at no cost.
    fn prepare<'a>(&'a self, _req: RequestParts<'a>) -> Option<BoxFuture<'a, Prepared>> {
        None
    }

    /// Chooses among `candidates` (the set's workers, usability decided). Pure: no I/O,
    /// no await, no lock held past return.
    fn pick(
        &self,
        req: &RouteRequest<'_>,
        set: &WorkerSet,
        candidates: &[Candidate],
        rng: &mut dyn RngCore,
    ) -> Pick;

    /// How the attempt `pick` chose ended, on `worker` (the one `pick.worker` names):
    /// the only place routing memory is written.
    fn observe(&self, _req: &RouteRequest<'_>, _pick: &Pick, _worker: &Worker, _outcome: Outcome) {}

    /// What a complete answer from `worker` told (read from its bytes as they passed).
    fn answered(&self, _worker: &Worker, _answer: &Answer<'_>) {}

    /// A view of each part of routing memory the policy owns (`/workers`, `/metrics`,
    /// `POST /cache/clear`; see [`view`]). Default: none.
    fn views(&self) -> Vec<Arc<dyn View>> {
        Vec::new()
    }

    /// The worker that holds the `/v1/responses` state `key` (xxh3-64 of a response
    /// id), as learned from the answers and the other router replicas, when it is still
    /// in `set`; `None` when unknown. Default: unknown.
    fn response_holder(&self, _key: u64, _set: &WorkerSet) -> Option<WorkerId> {
        None
    }

    /// The policy's own background work (tree eviction, KV-event consumers), spawned by
    /// `app` once; `None` when it has none.
    fn background(&self, _pool: Arc<Pool>, _shutdown: Shutdown) -> Option<BoxFuture<'static, ()>> {
        None
    }
}

impl std::fmt::Debug for dyn Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Policy({})", self.name())
    }
}

/// The routing parts [`build`] makes from a config.
pub struct Routing {
    /// The policy `config.policy` names, inside the session layer.
    pub policy: Arc<dyn Policy>,
    /// Routing state shared with the other router replicas (`state.redis_url`), which
    /// the policy's tree and bindings already use; `app` runs its connection.
    pub fleet: Option<Arc<Fleet>>,
    /// The approximate prefix tree the policy routes on, when it keeps one (precise
    /// mode: its fallback's): for the benches and tools that fill or read it directly.
    pub tree: Option<Arc<SharedTree>>,
}

/// What every pool's policy shares, built once: the session layer's memory (sessions
/// and stored responses belong to the router, whatever the model), the fleet its
/// memory is shared through (`state.redis_url`), and precise mode's KV-event state
/// (the engines' events, one feed per worker).
pub struct Shared {
    memory: Arc<session::Memory>,
    /// Routing state shared with the other router replicas; `app` runs its connection.
    pub fleet: Option<Arc<Fleet>>,
    precise: Option<Arc<crate::precise::Precise>>,
    /// Whether a policy already feeds `precise` (the first one made with it does).
    fed: std::sync::atomic::AtomicBool,
}

impl Shared {
    /// The shared parts for `config`, the fleet registered with `pool` for membership.
    pub fn new(config: &Config, pool: &Arc<Pool>) -> Shared {
        let memory = session::Memory::new(&config.session);
        let fleet = config.state.redis_url.as_ref().and_then(|_| {
            let sink = Arc::clone(&memory) as Arc<dyn crate::fleet::BindingSink>;
            Fleet::new(&config.state, Arc::clone(pool), sink)
                .inspect_err(|e| tracing::error!(error = %e, "state sharing off: it cannot start"))
                .ok()
        });
        // `cost_aware` reads it too when workers have `kv_events`.
        let precise = (config.policy == PolicyKind::PreciseCacheAware
            || config.workers.iter().any(|w| w.kv_events.is_some()))
        .then(|| Arc::new(crate::precise::Precise::new(&config.precise)));
        Shared {
            memory,
            fleet,
            precise,
            fed: Default::default(),
        }
    }
}

impl Shared {
    /// The KV-event state as a policy's index: the first policy to ask feeds it (runs
    /// its consumers, shows its view); `None` when there is none.
    fn events(&self) -> Option<precise::EventIndex> {
        let state = self.precise.as_ref()?;
        let feeds = !self.fed.swap(true, std::sync::atomic::Ordering::Relaxed);
        Some(precise::EventIndex::sharing(Arc::clone(state), feeds))
    }
}

/// The policy `config.policy` names, with its state, registered with `pool` for
/// membership events, and the fleet its memory is shared through when `state.redis_url`
/// is set (built first, handed to the parts that use it: nothing is wired in later).
/// One pool's worth ([`build_pool`] for [`crate::pools::DEFAULT_POOL`]).
pub fn build(config: &Config, pool: &Arc<Pool>) -> Routing {
    let shared = Shared::new(config, pool);
    let (policy, tree) = build_pool(
        config,
        crate::pools::DEFAULT_POOL,
        Leg::Whole,
        pool,
        &shared,
    );
    Routing {
        policy,
        fleet: shared.fleet,
        tree,
    }
}

/// The policy of the pool `model` (a served name, or [`crate::pools::DEFAULT_POOL`])
/// for `leg`: `models.overrides.<model>`'s policy and cache settings over the
/// top-level ones for the whole request, `pd.prefill_policy` / `pd.decode_policy` for
/// a disaggregated pool's legs (with the override's cache settings); inside the
/// session layer over `shared`'s memory (the decode leg's over a memory of its own);
/// registered with `pool` for membership events. Also the tree it routes
/// on, when it keeps one. The one place that matches on [`PolicyKind`].
pub fn build_pool(
    config: &Config,
    model: &str,
    leg: Leg,
    pool: &Arc<Pool>,
    shared: &Shared,
) -> (Arc<dyn Policy>, Option<Arc<SharedTree>>) {
    let over = config.models.overrides.get(model);
    let kind = match leg {
        Leg::Whole => over.and_then(|o| o.policy).unwrap_or(config.policy),
        Leg::Prefill => config.pd.prefill_policy,
        Leg::Decode => config.pd.decode_policy,
    };
    let config: std::borrow::Cow<'_, Config> = match over {
        None if kind == config.policy => std::borrow::Cow::Borrowed(config),
        _ => {
            let mut c = config.clone();
            c.policy = kind;
            c.cache = over.and_then(|o| o.cache.clone()).unwrap_or(c.cache);
            std::borrow::Cow::Owned(c)
        }
    };
    let shared_fleet = shared.fleet.as_ref();
    let mut tree = None;
    let policy: Arc<dyn Policy> = match config.policy {
        PolicyKind::CacheAware => {
            let p = CacheAware::new(&config.cache, shared_fleet);
            tree = Some(Arc::clone(p.shared_tree()));
            Arc::new(p)
        }
        PolicyKind::PreciseCacheAware => {
            let p = match shared.events() {
                Some(events) => precise::PreciseCacheAware::sharing(&config, events),
                None => precise::PreciseCacheAware::new(&config),
            };
            tree = Some(Arc::clone(p.shared_tree()));
            Arc::new(p)
        }
        PolicyKind::RoundRobin => Arc::new(round_robin::RoundRobin),
        PolicyKind::Random => Arc::new(random::Random),
        PolicyKind::LeastLoad => Arc::new(least_load::LeastLoad),
        PolicyKind::PowerOfTwo => Arc::new(power_of_two::PowerOfTwo),
        PolicyKind::ConsistentHash => Arc::new(consistent_hash::ConsistentHash::new(
            &config.consistent_hash,
        )),
        PolicyKind::PrefixHash => Arc::new(prefix_hash::PrefixHash::new(&config.prefix_hash)),
        PolicyKind::CostAware => {
            let p = cost_aware::CostAware::with_events(&config, shared_fleet, shared.events());
            tree = Some(Arc::clone(p.shared_tree()));
            Arc::new(p)
        }
        PolicyKind::LmcacheAware => Arc::new(lmcache::LmcacheAware::new(&config.cache)),
    };
    // Conversation state and sessions wrap whichever policy: decided before its pick.
    // A decode leg's bindings are its own (a session's prefill and decode workers
    // differ), and not shared with other router replicas.
    let (memory, fleet) = match leg {
        Leg::Decode => (session::Memory::new(&config.session), None),
        Leg::Whole | Leg::Prefill => (Arc::clone(&shared.memory), shared.fleet.clone()),
    };
    let policy: Arc<dyn Policy> = Arc::new(session::Affinity::new(
        policy,
        &config.session,
        CacheParams::from(&config.cache),
        memory,
        fleet,
    ));
    pool.listen(Arc::clone(&policy) as Arc<dyn PoolListener>);
    (policy, tree)
}

/// Shared test inputs for the pick functions.
#[cfg(test)]
pub(crate) mod fixtures {
    use super::{CacheParams, Candidate};
    use crate::pools::pool::WorkerId;

    /// The design.md defaults.
    pub(crate) fn params() -> CacheParams {
        CacheParams {
            threshold: 0.3,
            match_abs_threshold: 8192,
            balance_abs_threshold: 2,
            balance_rel_threshold: 1.5,
            balance_match_threshold: 64,
            block_tokens: 16,
        }
    }

    /// Usable cache-aware workers with these loads, ids in order.
    pub(crate) fn cands(loads: &[usize]) -> Vec<Candidate> {
        loads
            .iter()
            .enumerate()
            .map(|(i, &load)| Candidate {
                id: WorkerId(i as u32),
                load,
                usable: true,
                cache_aware: true,
                pending: 0,
            })
            .collect()
    }
}

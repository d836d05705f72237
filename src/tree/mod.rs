//! The approximate KV-cache map: a radix tree of routing text shared by all workers.
//!
//! Each node holds one compressed edge (a run of bytes), the set of workers this router
//! sent that prefix to, and a last-access stamp. A worker that holds a node holds every
//! ancestor too (`child.workers ⊆ parent.workers`), so a match can stop as soon as no
//! eligible worker holds the next edge. Match and insert walk at most one edge per
//! branching point of the prompt, and compare each byte of the prompt at most once: their
//! cost grows with the prompt's length, not with the tree's size (children are found by
//! binary search on the edge's first byte).
//!
//! Text is bytes, not chars: thresholds and the tree share are in bytes of UTF-8 text.
//! Nodes live in an arena (`Vec<Node>` plus a free list) addressed by `u32`, so there are
//! no reference-counted links. An insert allocates once per node it creates: the new
//! leaf's edge, and a split's head (the split node keeps its own allocation for the tail,
//! shrunk in place; up to two children live inline in a node). Eviction takes the least
//! recently used leaf from the back of a recency list through the arena ([`lru`]): O(1)
//! a node, no scan and no sort.
//!
//! Memory: a node is 96 bytes in the arena plus its edge (one allocation: its length
//! rounded up to 16 bytes plus 8, at least 32) and, past two children, its child list;
//! a freed slot or edge is reused by the next insert, so a tree held at its ceilings
//! stays at their size. The router's RSS per node as measured is in the book's
//! performance page; `max_tree_size` (nodes) and `max_tree_bytes` (edge bytes) bound it.
//!
//! Locking (see `workers::WorkerSet`): the tree is plain data with no interior locking;
//! its owner wraps it in one `parking_lot::Mutex`, held only for one match + insert (a
//! few microseconds) and never across an `.await`. Whole-tree passes (removing a worker,
//! eviction) run under the same lock but in bounded batches, so a request never waits
//! behind a whole pass.
//!
//! The idea follows SGLang's `sgl-model-gateway` approximate tree (per-node tenant sets
//! and LRU stamps); the arena layout and the subset invariant are ours.

mod doubt;
pub mod evict;
mod lru;
mod mask;

pub use doubt::{DISBELIEVE_AFTER, Verdict};
pub use mask::{MaskBuilder, WorkerMask};

pub use crate::pools::pool::WorkerId;

/// How long a worker's learned KV cache capacity bounds its records after the last
/// answer that showed its engine evicting: a capacity learned from a passing squeeze
/// (other work on the engine, a restart) must not shrink its share for good.
pub const CAPACITY_TTL: std::time::Duration = std::time::Duration::from_secs(300);

/// Nodes visited, freed or detached per lock hold by [`SharedTree::remove_worker`], at
/// most: ~30 µs on the 2026-12-03 bench machine (120–290 µs on a slower one, hence
/// [`REMOVE_STEP_TIME`]), meant to stay within the time a decision that finds the lock
/// held spins for it before sleeping ([`SPIN_FOR`]), so it is not put to sleep (and
/// woken late) behind a step (`pool_scale`, 2026-12-03: 512-node steps let a decision
/// wait 2–6 ms more often).
pub const REMOVE_STEP: usize = 128;

/// The most a step of [`SharedTree::remove_worker`] holds the lock, whatever is left of
/// [`REMOVE_STEP`]: a node's cost depends on the machine (cold memory), and 128 nodes
/// took 120–290 µs on a slower VM (`pool_scale`, 2026-12-06), past [`SPIN_FOR`], so a
/// decision went to sleep and was woken 1–2 ms late. Checked every few nodes.
const REMOVE_STEP_TIME: std::time::Duration = std::time::Duration::from_micros(50);

/// How long [`SharedTree::remove_worker`] sleeps between its steps. A removal that ran
/// its steps back to back kept a core busy for its whole length (0.2–0.4 s for a worker
/// of a 4-worker pool), one runnable thread more than a 2-core machine has cores: the
/// scheduler then took a core from a deciding thread for a whole time slice, or
/// descheduled the removal while it held the lock, and a decision waited 1–3 ms
/// (`pool_scale`, 2026-12-06: 1–4 decisions over 1 ms a run of ten removals, each with
/// one context switch of the deciding thread). Sleeping between steps leaves the core
/// to the requests: over three runs, 0, 0 and 3 of ~2.8 M decisions overlapping a
/// removal took over 1 ms (before: 3–4 of ~190 k a run), for a removal about five
/// times longer (about 1 s for such a worker; until it ends its records name a worker
/// no longer in the pool, which picks skip).
const REMOVE_PAUSE: std::time::Duration = std::time::Duration::from_micros(50);

/// How long a thread that finds the tree locked spins for it before it sleeps. An upkeep
/// step holds the lock for tens of microseconds; waking a sleeping thread took up to
/// milliseconds on a VM (`pool_scale`), far longer than the wait itself.
const SPIN_FOR: std::time::Duration = std::time::Duration::from_micros(200);

/// How long a whole-tree pass waits, before each lock hold, for the requests that wait
/// for the lock to take it first ([`SharedTree::lock_for_pass`]): a request's wait is
/// normally well under [`SPIN_FOR`]; the bound keeps a pass moving if a waiter's thread
/// is not run for a while.
const YIELD_FOR: std::time::Duration = std::time::Duration::from_millis(2);

/// A tree shared by the request path and its upkeep task: one `parking_lot::Mutex`, held
/// for one match or one insert (a few microseconds), never across an `.await`, plus the
/// eviction pass's flag and counters (see [`evict`]).
#[derive(Debug, Default)]
pub struct SharedTree {
    tree: parking_lot::Mutex<RadixTree>,
    /// Threads in [`SharedTree::lock`] that found the lock held and wait for it.
    waiting: std::sync::atomic::AtomicUsize,
    /// Set while an eviction pass runs: inserts are then skipped (and counted).
    evicting: std::sync::atomic::AtomicBool,
    /// Inserts skipped because an eviction pass was running.
    pub skipped_inserts: std::sync::atomic::AtomicU64,
    /// Nodes removed by eviction passes.
    pub evicted_nodes: std::sync::atomic::AtomicU64,
    /// What other router replicas' workers hold (`state.redis_url`, see `crate::fleet`).
    remote: Option<std::sync::Arc<dyn RemotePrefixes>>,
    /// Per worker, the last-use stamp below which its engine has evicted (see
    /// [`SharedTree::engine_evicted`]), waiting for the upkeep task's age-out sweep.
    horizons: std::sync::Mutex<Vec<(WorkerId, u64)>>,
    /// Per worker, the bytes of routing text its engine's KV cache was found to hold at
    /// most (see [`evict::age_out`]), and when (tokio's clock); its records are kept
    /// within it for [`CAPACITY_TTL`] after the last answer that showed it.
    capacities: std::sync::Mutex<Vec<(WorkerId, u64, std::time::Instant)>>,
    /// Bytes of workers' records removed by age-out sweeps.
    pub aged_out_bytes: std::sync::atomic::AtomicU64,
    /// Records a worker's answers made the router stop believing ([`doubt`]).
    pub disbelieved: std::sync::atomic::AtomicU64,
    /// Whether any doubt is counted (an answer that delivered what was predicted
    /// takes the lock only then).
    doubting: std::sync::atomic::AtomicBool,
}

/// One request's chunk hashes (`crate::prompt::chunks`), kept between its pick and its
/// publish so the routing text is hashed once: the proxy fills it from extraction,
/// which computes them with the digest; the [`RemotePrefixes`] implementation reads it
/// (completing what is missing) and takes it to publish.
#[derive(Debug, Default)]
pub struct ChainMemo(std::sync::Mutex<Vec<u64>>);

impl From<Vec<u64>> for ChainMemo {
    /// A memo holding `chain` (the routing text's chunk hashes, or a prefix of them:
    /// `crate::prompt::RouteContext::chain`).
    fn from(chain: Vec<u64>) -> Self {
        ChainMemo(std::sync::Mutex::new(chain))
    }
}

impl ChainMemo {
    /// The hashes computed so far (a prefix of the chain).
    pub fn lock(&self) -> std::sync::MutexGuard<'_, Vec<u64>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Prefix records learned from other router replicas, consulted beside the tree and
/// told what this replica's workers served (implemented by `crate::fleet`). Its matches
/// are in whole chunks of the routing text; bytes, like the tree's.
pub trait RemotePrefixes: Send + Sync + std::fmt::Debug {
    /// As [`RadixTree::longest_prefix`], over the other replicas' records, for a match
    /// of at least `guess` bytes (the tree's own match, say): one shorter need not be
    /// reported (the answer may then be empty), and the search starts there, so a
    /// close guess probes less.
    fn longest_prefix(
        &self,
        text: &[u8],
        eligible: &WorkerMask,
        memo: &ChainMemo,
        guess: usize,
    ) -> PrefixMatch;
    /// As [`RadixTree::prefix_per_worker`], over the other replicas' records.
    fn prefix_per_worker(
        &self,
        text: &[u8],
        eligible: &WorkerMask,
        memo: &ChainMemo,
        f: &mut dyn FnMut(WorkerId, usize),
    );
    /// This replica's `worker` served `text`: tell the other replicas.
    fn learned(&self, text: &[u8], worker: WorkerId, memo: &ChainMemo);
    /// The worker left or went down: its records go.
    fn forget(&self, worker: WorkerId);
}

impl SharedTree {
    /// Locks the tree. A panic while holding it leaves it usable (no poisoning): the
    /// tree is a cache and stays structurally valid between operations. When the lock
    /// is held (an upkeep step, another request), the caller spins for up to
    /// [`SPIN_FOR`] before it sleeps.
    pub fn lock(&self) -> parking_lot::MutexGuard<'_, RadixTree> {
        if let Some(g) = self.tree.try_lock() {
            return g;
        }
        // A count for passes to defer to (a hint: the mutex orders the tree's data).
        use std::sync::atomic::Ordering::Relaxed;
        self.waiting.fetch_add(1, Relaxed);
        let start = std::time::Instant::now();
        let g = loop {
            for _ in 0..64 {
                std::hint::spin_loop();
            }
            if let Some(g) = self.tree.try_lock() {
                break g;
            }
            if start.elapsed() >= SPIN_FOR {
                break self.tree.lock();
            }
            std::thread::yield_now();
        };
        self.waiting.fetch_sub(1, Relaxed);
        g
    }

    /// Locks the tree for one step of a whole-tree pass (a worker's removal, eviction,
    /// an age-out sweep), once the requests that wait for it have had it. A pass that
    /// locked again as soon as it unlocked took the lock back before a request spinning
    /// for it saw it free, step after step, until the request went to sleep and waited
    /// for parking_lot's fairness hand-off (`pool_scale`: decisions overlapping a removal
    /// waited up to 1.9 ms). Waits at most [`YIELD_FOR`] (spinning, then yielding its
    /// thread), so a pass still advances under a steady stream of requests; an async
    /// pass blocks its runtime thread for that wait (microseconds when a request waits,
    /// none otherwise).
    pub fn lock_for_pass(&self) -> parking_lot::MutexGuard<'_, RadixTree> {
        self.lock_after_waiters(YIELD_FOR)
    }

    /// [`SharedTree::lock_for_pass`], waiting at most `limit` for the waiters.
    fn lock_after_waiters(
        &self,
        limit: std::time::Duration,
    ) -> parking_lot::MutexGuard<'_, RadixTree> {
        use std::sync::atomic::Ordering::Relaxed;
        if self.waiting.load(Relaxed) > 0 {
            let start = std::time::Instant::now();
            let mut spins = 0u32;
            while self.waiting.load(Relaxed) > 0 && start.elapsed() < limit {
                if spins < 64 {
                    spins += 1;
                    for _ in 0..64 {
                        std::hint::spin_loop();
                    }
                } else {
                    std::thread::yield_now();
                }
            }
        }
        self.lock()
    }

    /// Whether an eviction pass is running (Relaxed: a hint, the lock orders the data).
    pub fn is_evicting(&self) -> bool {
        self.evicting.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Marks an eviction pass as running or done.
    pub fn set_evicting(&self, on: bool) {
        self.evicting
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// `worker`'s engine no longer held a prefix whose last use there was at tree stamp
    /// `stamp` ([`PrefixMatch::stamp`]: the match's end, held by that worker alone; it
    /// served less of it from cache than predicted): its engine evicts least recently
    /// used blocks first, so every record of `worker` last used before `stamp` is as
    /// good as gone. They are removed by the upkeep task's next age-out sweep
    /// ([`evict::age_out`]) — which bounds the worker's share of the tree to about what
    /// its KV cache holds — never on the request path. Records used since, a shared
    /// head included, stay; so does the prefix itself, just recomputed there. The
    /// policy decides whether an answer is evidence at all
    /// (`policy::cache_aware::CacheAware::learn`).
    pub fn engine_evicted(&self, worker: WorkerId, stamp: u64) {
        if stamp == 0 {
            return;
        }
        let mut h = self.horizons.lock().unwrap_or_else(|e| e.into_inner());
        match h.iter_mut().find(|(w, _)| *w == worker) {
            Some((_, s)) => *s = (*s).max(stamp),
            None => h.push((worker, stamp)),
        }
    }

    /// The answer to a prediction marked `mark` from `worker`: see
    /// [`RadixTree::answered`] (`delivered`: bytes of routing text). Takes the lock only
    /// for a short answer, or while doubts are counted.
    pub fn answered(
        &self,
        worker: WorkerId,
        mark: &Mark,
        short: bool,
        delivered: usize,
    ) -> Verdict {
        use std::sync::atomic::Ordering::Relaxed;
        if !mark.is_some() || (!short && !self.doubting.load(Relaxed)) {
            return Verdict::Nothing;
        }
        let mut tree = self.lock();
        let verdict = tree.answered(worker, mark, short, delivered);
        self.doubting.store(!tree.doubts.is_empty(), Relaxed);
        drop(tree);
        if verdict == Verdict::Disbelieved {
            self.disbelieved.fetch_add(1, Relaxed);
        }
        verdict
    }

    /// The horizons waiting for a sweep, taken.
    pub(crate) fn take_horizons(&self) -> Vec<(WorkerId, u64)> {
        std::mem::take(&mut *self.horizons.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// The effective KV cache capacity learned for `worker`, in bytes of routing text
    /// (`None` until an answer showed its engine evicting).
    pub fn capacity(&self, worker: WorkerId) -> Option<u64> {
        self.capacities
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|(w, _, at)| *w == worker && crate::clock::now() - *at < CAPACITY_TTL)
            .map(|(_, c, _)| *c)
    }

    /// Sets (`Some`) or forgets `worker`'s learned capacity.
    pub fn set_capacity(&self, worker: WorkerId, bytes: Option<u64>) {
        let mut c = self.capacities.lock().unwrap_or_else(|e| e.into_inner());
        c.retain(|(w, _, _)| *w != worker);
        if let Some(b) = bytes {
            c.push((worker, b, crate::clock::now()));
        }
    }

    /// Every learned capacity still in force (expired ones are dropped).
    pub(crate) fn capacities(&self) -> Vec<(WorkerId, u64)> {
        let mut c = self.capacities.lock().unwrap_or_else(|e| e.into_inner());
        let now = crate::clock::now();
        c.retain(|(_, _, at)| now - *at < CAPACITY_TTL);
        c.iter().map(|(w, b, _)| (*w, *b)).collect()
    }

    /// Removes every record of `worker` (it left the pool or went down), holding the
    /// lock for at most [`REMOVE_STEP`] nodes at a time and freeing what each step took
    /// out after releasing it: a worker of a 4-worker pool holds ~250 k nodes of a full
    /// tree, which in one hold stalled every decision for ~235 ms (`cargo bench --bench
    /// pool_scale`), and sleeping [`REMOVE_PAUSE`] between steps. Blocking (about 1 s
    /// for such a worker, most of it asleep): call it off the async runtime's threads.
    /// Returns the nodes removed (other inserts and evictions between the steps count
    /// too).
    pub fn remove_worker(&self, worker: WorkerId) -> usize {
        let (before, roots) = {
            let tree = self.lock();
            (tree.node_count(), tree.children_of(ROOT))
        };
        let mut r = Removal::below(roots);
        r.reserve_for_worker();
        // A step takes at most its budget, plus the children (≤ 256, one per first
        // byte) of the node that ends it.
        let mut freed = Freed::with_room(REMOVE_STEP + 257);
        loop {
            let mut tree = self.lock_for_pass();
            r.until = Some(std::time::Instant::now() + REMOVE_STEP_TIME);
            tree.remove_step(&mut r, worker, REMOVE_STEP, &mut freed);
            let after = tree.node_count();
            drop(tree);
            freed.clear();
            if r.is_done() {
                return before.saturating_sub(after);
            }
            std::thread::sleep(REMOVE_PAUSE);
        }
    }

    /// A tree shared with the other router replicas through `remote` (`state:`), or
    /// kept to this process (`None`, as [`SharedTree::default`]).
    pub fn new(remote: Option<std::sync::Arc<dyn RemotePrefixes>>) -> Self {
        SharedTree {
            remote,
            ..SharedTree::default()
        }
    }

    /// The other replicas' records, when shared.
    pub fn remote(&self) -> Option<&dyn RemotePrefixes> {
        self.remote.as_deref()
    }

    /// Records `text` as held by `worker` (and tells the other replicas, when shared),
    /// unless an eviction pass runs (then the insert is skipped and counted).
    pub fn record(&self, text: &[u8], worker: WorkerId, memo: &ChainMemo) {
        if text.is_empty() {
            return;
        }
        if let Some(r) = self.remote() {
            r.learned(text, worker, memo);
        }
        if self.is_evicting() {
            self.skipped_inserts
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return;
        }
        self.lock().insert(text, worker);
    }
}

type NodeIdx = u32;
const ROOT: NodeIdx = 0;

/// A worker's removal in progress: what [`RadixTree::remove_step`] has left to do.
#[derive(Debug, Default)]
struct Removal {
    /// Nodes still to visit.
    stack: Vec<NodeIdx>,
    /// Detached nodes still to free.
    doomed: Vec<NodeIdx>,
    /// When the current step should end, whatever its budget left ([`REMOVE_STEP_TIME`]);
    /// `None`: by the budget alone.
    until: Option<std::time::Instant>,
}

impl Removal {
    fn below(stack: Vec<NodeIdx>) -> Self {
        Removal {
            stack,
            doomed: Vec::new(),
            until: None,
        }
    }

    /// Sizes its lists for a worker of a full tree (call it with the lock released), so
    /// steps under the lock rarely grow them (see [`RadixTree::free_head`] for what a
    /// regrowth can cost).
    fn reserve_for_worker(&mut self) {
        self.stack.reserve(16 * 1024);
        self.doomed.reserve(4 * 1024);
    }

    fn is_done(&self) -> bool {
        self.stack.is_empty() && self.doomed.is_empty()
    }
}

/// Nodes taken out of a [`RadixTree`] (edges, worker masks, child lists), for the caller
/// to drop after releasing the tree's lock: freeing them is most of the cost of an
/// eviction or removal step, and no request needs to wait for it.
#[derive(Debug, Default)]
pub struct Freed(Vec<Node>);

impl Freed {
    /// Room for `nodes` nodes, allocated now (before the lock is taken): a step that
    /// outgrew its buffer under the lock could wait on glibc's consolidation of every
    /// small chunk freed before it (see [`RadixTree::free_head`]).
    pub fn with_room(nodes: usize) -> Self {
        Freed(Vec::with_capacity(nodes))
    }

    /// Frees what it holds (call it with the tree's lock released), keeping its buffer
    /// for the next step.
    pub fn clear(&mut self) {
        self.0.clear();
    }
}

#[derive(Debug, Clone)]
struct Node {
    /// Bytes between the parent and this node (empty only for the root).
    edge: Box<[u8]>,
    /// Children sorted by the first byte of their edge; up to two inline (a split's
    /// node has two), so most nodes need no allocation for them.
    children: Children,
    parent: NodeIdx,
    workers: WorkerMask,
    /// Logical time of the last insert through this node (see [`RadixTree::insert`]).
    last_access: u64,
    /// Its slot of doubts (workers whose answers did not bear it out, see [`doubt`]);
    /// 0 for none.
    doubt: u32,
    /// Its neighbours in the recency list ([`lru`]): towards the most and the least
    /// recently used; [`lru::NONE`] while not in it (a free or detached slot).
    lru_newer: NodeIdx,
    lru_older: NodeIdx,
}

/// A node's children: `(first byte of the edge, node)`, sorted.
type Children = smallvec::SmallVec<[(u8, NodeIdx); 2]>;

impl Node {
    /// Its last-use stamp when one worker alone holds it, else 0 (see
    /// [`PrefixMatch::stamp`]).
    fn sole_stamp(&self) -> u64 {
        if self.workers.is_single() {
            self.last_access
        } else {
            0
        }
    }

    /// The root, or a free slot.
    fn empty() -> Node {
        Node {
            edge: Box::default(),
            children: Children::new(),
            parent: ROOT,
            workers: WorkerMask::default(),
            last_access: 0,
            doubt: 0,
            lru_newer: lru::NONE,
            lru_older: lru::NONE,
        }
    }
}

/// The result of a prefix match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Bytes of the query matched (0 when nothing matched).
    pub matched: usize,
    /// The eligible workers that hold the whole matched prefix (empty when `matched` is 0).
    pub workers: WorkerMask,
    /// The tree's last-use stamp of the matched prefix's end when one worker alone holds
    /// that node (so the stamp is its last use *there*); 0 when several hold it (the
    /// stamp may be another worker's use, a moment ago for a shared prefix), when
    /// nothing matched, and for another replica's records. What a short delivery is
    /// weighed against ([`SharedTree::engine_evicted`]).
    pub stamp: u64,
}

/// Where a match ended in the tree, for the answer to its prediction to confirm or
/// refute ([`RadixTree::answered`], [`SharedTree::engine_evicted`]). A handle, not a
/// reference: the node may be split, freed or reused before the answer comes, which
/// [`RadixTree::answered`] checks by its depth. `Default` (node 0, the root): no mark.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Mark {
    /// The match's [`PrefixMatch::stamp`] (its end's last use when one worker alone
    /// holds it), 0 otherwise.
    pub stamp: u64,
    /// The tree's clock when the end node was last used by any worker (whether the
    /// request that recorded it may still run: `policy::select::eviction_evidence`).
    pub used: u64,
    /// The node the match ended in, and the byte offset where that node's edge ends.
    pub node: u32,
    pub end: u32,
    /// Bytes of the routing text matched (≤ `end`).
    pub bytes: u32,
    /// Whether its answer may judge the record: not recorded by a request that may
    /// still run (`policy::select::eviction_evidence` decides; false until then).
    pub evidence: bool,
}

impl Mark {
    /// Whether it names a node.
    pub fn is_some(&self) -> bool {
        self.node != ROOT
    }
}

/// One node's use ([`RadixTree::use_at`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeUse {
    /// The tree's clock when a record last passed through it.
    pub used: u64,
    /// Workers holding it.
    pub holders: usize,
}

/// A match with what the decision hands on: its [`Mark`], and the workers disbelieved
/// along the text's path ([`doubt`]), whom a least-loaded choice for this text avoids
/// at equal load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lookup {
    pub found: PrefixMatch,
    pub mark: Mark,
    pub disbelieved: WorkerMask,
}

/// Radix tree over routing text with per-node worker membership. See the module docs.
#[derive(Debug, Clone)]
pub struct RadixTree {
    nodes: Vec<Node>,
    /// Free slots, linked through their `parent` field (`ROOT` ends the list): freeing a
    /// slot never allocates, so an eviction or removal step under the lock never grows a
    /// buffer. (A free list `Vec` grew to a quarter million entries during a worker's
    /// removal, and each regrowth's `realloc` made glibc consolidate every small chunk
    /// the steps before had freed: 3–10 ms with the lock held, `pool_scale`, 2026-12-03.)
    free_head: NodeIdx,
    /// Slots in the free list.
    free_len: usize,
    /// Edge bytes held per worker (index = `WorkerId.0`), for the tree share.
    worker_bytes: Vec<u64>,
    /// Sum of all edge lengths.
    total_bytes: u64,
    /// Logical clock for `last_access`, bumped per insert.
    clock: u64,
    /// The nodes' doubt slots (see [`doubt`]).
    doubts: doubt::Doubts,
}

impl Default for RadixTree {
    fn default() -> Self {
        Self::new()
    }
}

impl RadixTree {
    /// An empty tree (just the root).
    pub fn new() -> Self {
        RadixTree {
            nodes: vec![lru::root()],
            free_head: ROOT,
            free_len: 0,
            worker_bytes: Vec::new(),
            total_bytes: 0,
            clock: 0,
            doubts: doubt::Doubts::default(),
        }
    }

    /// Nodes in the tree, the root excluded.
    pub fn node_count(&self) -> usize {
        self.nodes.len() - self.free_len - 1
    }

    /// Bytes of routing text stored in the tree (sum of edge lengths).
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// Fraction (0–1) of the tree's bytes that `worker` holds.
    pub fn share(&self, worker: WorkerId) -> f64 {
        if self.total_bytes == 0 {
            return 0.0;
        }
        let held = self
            .worker_bytes
            .get(worker.0 as usize)
            .copied()
            .unwrap_or(0);
        held as f64 / self.total_bytes as f64
    }

    /// Bytes of routing text held for `worker` (shared prefixes count for each holder).
    pub fn worker_bytes(&self, worker: WorkerId) -> u64 {
        self.worker_bytes
            .get(worker.0 as usize)
            .copied()
            .unwrap_or(0)
    }

    fn children_of(&self, node: NodeIdx) -> Vec<NodeIdx> {
        self.nodes[node as usize]
            .children
            .iter()
            .map(|(_, c)| *c)
            .collect()
    }

    fn child(&self, node: NodeIdx, first: u8) -> Option<NodeIdx> {
        let children = &self.nodes[node as usize].children;
        children
            .binary_search_by_key(&first, |(b, _)| *b)
            .ok()
            .map(|i| children[i].1)
    }

    /// Longest prefix of `text` held by any worker in `eligible`; read-only. A worker
    /// disbelieved at a node ([`doubt`]) holds nothing from that node on.
    pub fn longest_prefix(&self, text: &[u8], eligible: &WorkerMask) -> PrefixMatch {
        self.lookup(text, eligible).found
    }

    /// [`RadixTree::longest_prefix`] with its [`Mark`] and the workers disbelieved
    /// along the way.
    ///
    /// The walk follows edges while at least one eligible worker holds them; a match may
    /// end inside an edge (its holders hold the partial edge too).
    pub fn lookup(&self, text: &[u8], eligible: &WorkerMask) -> Lookup {
        let mut node = ROOT;
        let mut pos = 0;
        // The deepest node reached (the root: none) and where its edge ends; its holders
        // are taken once, at the end (a mask of over 64 workers allocates).
        let (mut last, mut last_end) = (ROOT, 0);
        let doubts = self.doubts.any_disbelieved();
        let mut disbelieved = WorkerMask::default();
        while pos < text.len() {
            let Some(child) = self.child(node, text[pos]) else {
                break;
            };
            let c = &self.nodes[child as usize];
            if doubts {
                self.add_disbelieved(c, &mut disbelieved);
            }
            let held = if disbelieved.is_empty() {
                c.workers.intersects(eligible)
            } else {
                !c.workers
                    .intersection(eligible)
                    .difference(&disbelieved)
                    .is_empty()
            };
            if !held {
                break;
            }
            let n = common_prefix_len(&c.edge, &text[pos..]);
            last_end = pos + c.edge.len();
            pos += n;
            last = child;
            if n < c.edge.len() {
                break;
            }
            node = child;
        }
        if last == ROOT {
            return Lookup {
                found: PrefixMatch {
                    matched: 0,
                    workers: WorkerMask::default(),
                    stamp: 0,
                },
                mark: Mark::default(),
                disbelieved,
            };
        }
        let c = &self.nodes[last as usize];
        let mut workers = c.workers.intersection(eligible);
        if !disbelieved.is_empty() {
            workers = workers.difference(&disbelieved);
        }
        // Several holders, one of them disbelieved: the others' last use is not known
        // apart from its; one left: its alone only if it was the node's only holder.
        let stamp = c.sole_stamp();
        let mark = Mark {
            stamp,
            used: c.last_access,
            node: last,
            end: u32::try_from(last_end).unwrap_or(u32::MAX),
            bytes: u32::try_from(pos).unwrap_or(u32::MAX),
            evidence: false,
        };
        Lookup {
            found: PrefixMatch {
                matched: pos,
                workers,
                stamp,
            },
            mark,
            disbelieved,
        }
    }

    /// The node holding byte `at` of `text`: when it was last used (the tree's clock)
    /// and how many workers hold it; `None` when the tree does not hold `text` that
    /// far. Read-only; one walk down the path.
    pub fn use_at(&self, text: &[u8], at: usize) -> Option<NodeUse> {
        let (mut node, mut pos) = (ROOT, 0);
        while pos <= at && pos < text.len() {
            let child = self.child(node, text[pos])?;
            let c = &self.nodes[child as usize];
            let n = common_prefix_len(&c.edge, &text[pos..]);
            if pos + n > at {
                return Some(NodeUse {
                    used: c.last_access,
                    holders: c.workers.iter().count(),
                });
            }
            if n < c.edge.len() {
                return None;
            }
            pos += n;
            node = child;
        }
        None
    }

    /// The logical clock: inserts made so far (the stamp of the latest one).
    pub fn clock(&self) -> u64 {
        self.clock
    }

    /// For each worker of `eligible` that holds a prefix of `text`: `f(worker, bytes,
    /// mark)` with the longest one it holds and that match's [`Mark`] (its stamp:
    /// [`PrefixMatch::stamp`]), once per worker (workers holding nothing are not
    /// called); a worker disbelieved at a node holds nothing from there on ([`doubt`]).
    /// Returns the workers disbelieved along the way. Read-only. One walk down the path;
    /// each step costs the workers that leave it (a node's holders are a subset of its
    /// parent's).
    pub fn prefix_per_worker(
        &self,
        text: &[u8],
        eligible: &WorkerMask,
        mut f: impl FnMut(WorkerId, usize, Mark),
    ) -> WorkerMask {
        let mut disbelieved = WorkerMask::default();
        let mut node = ROOT;
        let mut pos = 0;
        let mut holding = eligible.clone();
        let doubts = self.doubts.any_disbelieved();
        // The mark of the match's end so far.
        let mut mark = Mark::default();
        while pos < text.len() {
            let Some(child) = self.child(node, text[pos]) else {
                break;
            };
            let c = &self.nodes[child as usize];
            let mut here = c.workers.intersection(&holding);
            if doubts && c.doubt != 0 {
                let mut out = WorkerMask::default();
                self.add_disbelieved(c, &mut out);
                here = here.difference(&out);
                disbelieved = disbelieved.union(&out);
            }
            if here.is_empty() {
                break;
            }
            if pos > 0 {
                for w in holding.iter().filter(|w| !here.contains(*w)) {
                    f(w, pos, mark);
                }
            }
            let n = common_prefix_len(&c.edge, &text[pos..]);
            let end = pos + c.edge.len();
            pos += n;
            holding = here;
            mark = Mark {
                stamp: c.sole_stamp(),
                used: c.last_access,
                node: child,
                end: u32::try_from(end).unwrap_or(u32::MAX),
                bytes: u32::try_from(pos).unwrap_or(u32::MAX),
                evidence: false,
            };
            if n < c.edge.len() {
                break;
            }
            node = child;
        }
        if pos > 0 {
            for w in holding.iter() {
                f(w, pos, mark);
            }
        }
        disbelieved
    }

    /// Records that `text` was sent to `worker`: adds the worker along the whole path,
    /// splitting an edge where the text diverges and adding one leaf for the rest.
    /// Returns the number of nodes created (0–2).
    pub fn insert(&mut self, text: &[u8], worker: WorkerId) -> usize {
        self.clock += 1;
        let now = self.clock;
        let mut created = 0;
        let mut node = ROOT;
        let mut pos = 0;
        while pos < text.len() {
            match self.child(node, text[pos]) {
                None => {
                    // The one allocation of an insert: the new leaf's edge.
                    let leaf = self.alloc(Node {
                        edge: text[pos..].into(),
                        parent: node,
                        last_access: now,
                        ..Node::empty()
                    });
                    self.link(node, text[pos], leaf);
                    self.total_bytes += (text.len() - pos) as u64;
                    self.hold(leaf, worker, now);
                    self.lru_after(node, leaf);
                    return created + 1;
                }
                Some(child) => {
                    let n = common_prefix_len(&self.nodes[child as usize].edge, &text[pos..]);
                    let next = if n < self.nodes[child as usize].edge.len() {
                        created += 1;
                        self.split(child, n)
                    } else {
                        child
                    };
                    self.hold(next, worker, now);
                    // The path in order right behind its parent: a node is always
                    // more recent in the list than its descendants.
                    self.lru_after(node, next);
                    pos += n;
                    node = next;
                }
            }
        }
        created
    }

    /// Removes every record of `worker`; nodes left with no worker are freed (their
    /// whole subtree is then empty too, by the subset invariant). Cost: one pass over
    /// the nodes that worker holds, in one go (the request path uses
    /// [`SharedTree::remove_worker`], which takes it in steps).
    pub fn remove_worker(&mut self, worker: WorkerId) {
        let mut r = Removal::below(self.children_of(ROOT));
        self.remove_step(&mut r, worker, usize::MAX, &mut Freed::default());
    }

    /// Appends `(last_access, edge bytes)` of every node among arena slots `range` that
    /// `worker` holds.
    pub fn worker_nodes(
        &self,
        range: std::ops::Range<usize>,
        worker: WorkerId,
        out: &mut Vec<(u64, u64)>,
    ) {
        let end = range.end.min(self.nodes.len());
        for i in range.start.max(1)..end {
            let n = &self.nodes[i];
            if n.workers.contains(worker) {
                out.push((n.last_access, n.edge.len() as u64));
            }
        }
    }

    /// Removes each `(worker, horizon)`'s worker from the nodes among arena slots
    /// `range` last used before its horizon, with their subtrees (a node's stamp is at
    /// least any descendant's: an insert stamps the whole path), so an upkeep sweep can
    /// run in short steps between lock holds; what is freed goes to `freed`. Returns the
    /// bytes removed.
    pub fn age_out(
        &mut self,
        range: std::ops::Range<usize>,
        horizons: &[(WorkerId, u64)],
        freed: &mut Freed,
    ) -> u64 {
        let end = range.end.min(self.nodes.len());
        let mut removed = 0;
        for i in range.start.max(1)..end {
            for &(w, horizon) in horizons {
                let n = &self.nodes[i];
                // Free slots have no edge (and no workers).
                if n.last_access < horizon && n.workers.contains(w) {
                    let before = self.worker_bytes(w);
                    let mut r = Removal::below(vec![i as NodeIdx]);
                    self.remove_step(&mut r, w, usize::MAX, freed);
                    removed += before - self.worker_bytes(w);
                }
            }
        }
        removed
    }

    /// Works on `r` (removing `worker` from the subtrees under `r`'s nodes, freeing the
    /// nodes it leaves empty) until it is done or `budget` nodes were visited, freed or
    /// detached; what is left in `r` is the rest of the work. A node left empty is
    /// unlinked at once and its subtree detached (each node's bytes accounted and its
    /// edge and workers cleared, so that arena scans see a free slot), then freed a node
    /// at a time.
    /// Slots kept in `r` across lock holds may have been freed or reused meanwhile: a
    /// free slot holds no worker and is skipped, and a reused one is handled like any
    /// node (removing a leaving worker from it is right). Returns the nodes worked on.
    fn remove_step(
        &mut self,
        r: &mut Removal,
        worker: WorkerId,
        budget: usize,
        freed: &mut Freed,
    ) -> usize {
        let mut work = 0;
        let mut turns = 0u32;
        while work < budget {
            turns += 1;
            if turns.is_multiple_of(16) && r.until.is_some_and(|t| std::time::Instant::now() >= t) {
                break;
            }
            if let Some(n) = r.doomed.pop() {
                let slot = std::mem::replace(&mut self.nodes[n as usize], Node::empty());
                // Each child detached counts (a shared prompt's node has thousands).
                work += 1 + slot.children.len();
                for &(_, c) in &slot.children {
                    freed.0.push(self.detach(c));
                    r.doomed.push(c);
                }
                freed.0.push(slot);
                self.free_slot(n);
                continue;
            }
            let Some(n) = r.stack.pop() else { break };
            work += 1;
            let node = &mut self.nodes[n as usize];
            if !node.workers.remove(worker) {
                continue; // nor do its descendants hold it
            }
            self.doubts.forget_worker(&mut node.doubt, worker);
            let len = node.edge.len() as u64;
            let empty = node.workers.is_empty();
            if !empty {
                r.stack.extend(node.children.iter().map(|(_, c)| *c));
            }
            if let Some(b) = self.worker_bytes.get_mut(worker.0 as usize) {
                *b -= len;
            }
            if empty {
                // Its descendants held only this worker too: free them all.
                self.unlink(n);
                freed.0.push(self.detach(n));
                r.doomed.push(n);
            }
        }
        work
    }

    /// Takes `node` (unlinked, or below an unlinked node) out of the tree's byte totals
    /// and clears its edge and workers, returned (for the caller to drop) as a node that
    /// holds just them; its slot is freed later by [`Self::remove_step`].
    fn detach(&mut self, node: NodeIdx) -> Node {
        self.lru_remove(node);
        let slot = &mut self.nodes[node as usize];
        self.doubts.release(&mut slot.doubt);
        let len = slot.edge.len() as u64;
        self.total_bytes -= len;
        for w in slot.workers.iter() {
            if let Some(b) = self.worker_bytes.get_mut(w.0 as usize) {
                *b -= len;
            }
        }
        Node {
            edge: std::mem::take(&mut slot.edge),
            workers: std::mem::take(&mut slot.workers),
            ..Node::empty()
        }
    }

    /// Slots in the node arena (live or free); bounds the ranges given to
    /// [`RadixTree::collect_leaves`].
    pub fn arena_len(&self) -> usize {
        self.nodes.len()
    }

    /// Appends `(last_access, node)` for every live leaf among arena slots `range`, so an
    /// eviction pass can scan the arena in short steps between lock holds.
    pub fn collect_leaves(&self, range: std::ops::Range<usize>, out: &mut Vec<(u64, u32)>) {
        let end = range.end.min(self.nodes.len());
        for i in range.start.max(1)..end {
            let n = &self.nodes[i];
            // Live non-root nodes always have a non-empty edge; free slots have none.
            if !n.edge.is_empty() && n.children.is_empty() {
                out.push((n.last_access, i as u32));
            }
        }
    }

    /// Evicts one leaf found by [`RadixTree::collect_leaves`], unless it changed since:
    /// it must still be a live leaf with the same stamp (a touched or reused slot gets a
    /// newer stamp). Its parent may become a leaf for a later round; shared prefixes with
    /// other children stay; what it held goes to `freed`. Returns whether it was removed.
    pub fn evict_leaf(&mut self, node: u32, stamp: u64, freed: &mut Freed) -> bool {
        let Some(n) = self.nodes.get(node as usize) else {
            return false;
        };
        if node == ROOT || n.edge.is_empty() || !n.children.is_empty() || n.last_access != stamp {
            return false;
        }
        self.unlink(node);
        self.release(node, freed);
        true
    }

    fn hold(&mut self, node: NodeIdx, worker: WorkerId, now: u64) {
        let n = &mut self.nodes[node as usize];
        n.last_access = now;
        if n.workers.insert(worker) {
            let i = worker.0 as usize;
            if self.worker_bytes.len() <= i {
                self.worker_bytes.resize(i + 1, 0);
            }
            self.worker_bytes[i] += n.edge.len() as u64;
        }
    }

    /// Splits `child`'s edge after `at` bytes; returns the new middle node, which takes
    /// the first `at` bytes and `child`'s workers and stamp.
    /// The child keeps its allocation for the tail (moved down and shrunk in place), so
    /// a split allocates the head only.
    fn split(&mut self, child: NodeIdx, at: usize) -> NodeIdx {
        let c = &mut self.nodes[child as usize];
        let parent = c.parent;
        let first = c.edge[0];
        let (workers, last_access) = (c.workers.clone(), c.last_access);
        let mut tail = std::mem::take(&mut c.edge).into_vec();
        let head: Box<[u8]> = tail[..at].into();
        tail.drain(..at);
        let tail = tail.into_boxed_slice();
        let middle = self.alloc(Node {
            edge: head,
            children: smallvec::smallvec![(tail[0], child)],
            parent,
            workers,
            last_access,
            ..Node::empty()
        });
        let c = &mut self.nodes[child as usize];
        c.edge = tail;
        c.parent = middle;
        let siblings = &mut self.nodes[parent as usize].children;
        if let Ok(i) = siblings.binary_search_by_key(&first, |(b, _)| *b) {
            siblings[i].1 = middle;
        }
        middle
    }

    fn alloc(&mut self, node: Node) -> NodeIdx {
        if self.free_head == ROOT {
            self.nodes.push(node);
            return (self.nodes.len() - 1) as NodeIdx;
        }
        let i = self.free_head;
        self.free_head = self.nodes[i as usize].parent;
        self.free_len -= 1;
        self.nodes[i as usize] = node;
        i
    }

    fn link(&mut self, parent: NodeIdx, first: u8, child: NodeIdx) {
        let children = &mut self.nodes[parent as usize].children;
        let i = children
            .binary_search_by_key(&first, |(b, _)| *b)
            .unwrap_or_else(|i| i);
        children.insert(i, (first, child));
    }

    fn unlink(&mut self, node: NodeIdx) {
        let n = &self.nodes[node as usize];
        let (parent, first) = (n.parent, n.edge[0]);
        let siblings = &mut self.nodes[parent as usize].children;
        if let Ok(i) = siblings.binary_search_by_key(&first, |(b, _)| *b) {
            siblings.remove(i);
        }
    }

    /// Frees `node` and its subtree (into `freed`), keeping the byte totals right.
    fn release(&mut self, node: NodeIdx, freed: &mut Freed) {
        let mut stack: smallvec::SmallVec<[NodeIdx; 8]> = smallvec::smallvec![node];
        while let Some(n) = stack.pop() {
            let slot = &self.nodes[n as usize];
            stack.extend(slot.children.iter().map(|(_, c)| *c));
            let len = slot.edge.len() as u64;
            self.total_bytes -= len;
            for w in slot.workers.iter() {
                if let Some(b) = self.worker_bytes.get_mut(w.0 as usize) {
                    *b -= len;
                }
            }
        }
        self.free_subtree(node, freed);
    }

    /// Returns `node` and its subtree to the free list, their contents to `freed` (no
    /// byte accounting).
    fn free_subtree(&mut self, node: NodeIdx, freed: &mut Freed) {
        let mut stack: smallvec::SmallVec<[NodeIdx; 8]> = smallvec::smallvec![node];
        while let Some(n) = stack.pop() {
            self.lru_remove(n);
            let mut slot = std::mem::replace(&mut self.nodes[n as usize], Node::empty());
            self.doubts.release(&mut slot.doubt);
            stack.extend(slot.children.iter().map(|(_, c)| *c));
            freed.0.push(slot);
            self.free_slot(n);
        }
    }

    /// Puts slot `n` (already emptied) on the free list.
    fn free_slot(&mut self, n: NodeIdx) {
        self.nodes[n as usize].parent = self.free_head;
        self.free_head = n;
        self.free_len += 1;
    }
}

/// Length of the common prefix of two byte strings.
fn common_prefix_len(a: &[u8], b: &[u8]) -> usize {
    // Whole blocks by slice equality (libc's vectorised `bcmp`: a held 32 KiB prompt is
    // 32 calls), then the first differing block word by word: the lowest differing
    // byte of two little-endian words is the xor's lowest set bit.
    const BLOCK: usize = 1024;
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut i = 0;
    for (x, y) in a.chunks_exact(BLOCK).zip(b.chunks_exact(BLOCK)) {
        if x != y {
            break;
        }
        i += BLOCK;
    }
    let (aw, _) = a[i..].as_chunks::<8>();
    let (bw, _) = b[i..].as_chunks::<8>();
    for (x, y) in aw.iter().zip(bw) {
        let d = u64::from_le_bytes(*x) ^ u64::from_le_bytes(*y);
        if d != 0 {
            return i + (d.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: WorkerId = WorkerId(0);
    const B: WorkerId = WorkerId(1);
    const C: WorkerId = WorkerId(70); // beyond the inline mask

    fn all() -> WorkerMask {
        [A, B, C].into_iter().collect()
    }

    fn only(w: WorkerId) -> WorkerMask {
        [w].into_iter().collect()
    }

    #[test]
    fn a_pass_step_waits_for_the_request_that_waits_for_the_lock() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::mpsc;
        let set = std::sync::Arc::new(SharedTree::default());
        let order = std::sync::Arc::new(AtomicUsize::new(0));
        let (held_tx, held_rx) = mpsc::channel();
        // A pass holds the lock for a step, then takes it again for the next one.
        let pass = {
            let (set, order) = (set.clone(), order.clone());
            std::thread::spawn(move || {
                let step = set.lock();
                held_tx.send(()).unwrap();
                while set.waiting.load(Ordering::SeqCst) == 0 {
                    std::thread::yield_now();
                }
                // The request spins for the lock: unlocked and locked again at once,
                // the pass would take it before the request sees it free.
                drop(step);
                let _next = set.lock_after_waiters(std::time::Duration::from_secs(30));
                order.fetch_add(1, Ordering::SeqCst)
            })
        };
        held_rx.recv().unwrap();
        let request = {
            let (set, order) = (set.clone(), order.clone());
            std::thread::spawn(move || {
                let _t = set.lock();
                order.fetch_add(1, Ordering::SeqCst)
            })
        };
        assert_eq!(request.join().unwrap(), 0, "the waiting request goes first");
        assert_eq!(pass.join().unwrap(), 1);
        assert_eq!(set.waiting.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_node_takes_96_bytes_of_arena() {
        // The memory per record the docs state (`cache.max_tree_size`).
        assert_eq!(std::mem::size_of::<Node>(), 96);
    }

    #[test]
    fn empty_tree_matches_nothing() {
        let t = RadixTree::new();
        let m = t.longest_prefix(b"hello", &all());
        assert_eq!(m.matched, 0);
        assert!(m.workers.is_empty());
        assert_eq!(t.node_count(), 0);
    }

    #[test]
    fn a_match_ending_in_a_node_others_hold_too_carries_no_stamp() {
        let mut t = RadixTree::new();
        let (w0, w1) = (WorkerId(0), WorkerId(1));
        let head = b"system: a long shared system prompt.\nuser: ".to_vec();
        let mut tail = head.clone();
        tail.extend_from_slice(b"my own question");
        t.insert(&tail, w0); // stamp 1: the whole path w0's alone
        t.insert(&head, w1); // stamp 2: the head shared, and used a moment ago
        let (only0, both) = (only(w0), [w0, w1].into_iter().collect::<WorkerMask>());
        // A match ending in w0's own tail: its last use there.
        assert_eq!(t.longest_prefix(&tail, &only0).stamp, 1);
        // One ending in the shared head: the head's stamp is w1's use, not w0's.
        assert_eq!(t.longest_prefix(&head, &only0).stamp, 0);
        let mut per = Vec::new();
        t.prefix_per_worker(&tail, &both, |w, n, m| per.push((w, n, m.stamp)));
        assert_eq!(per, vec![(w1, head.len(), 0), (w0, tail.len(), 1)]);
        assert_eq!(t.clock(), 2);
    }

    #[test]
    fn age_out_removes_a_workers_records_last_used_before_its_horizon() {
        let mut t = RadixTree::new();
        let (w0, w1) = (WorkerId(0), WorkerId(1));
        let shared = "system: answer from the manual, citing sections.\nuser: ";
        let [a, b, c] = ["chapter one", "chapter two", "chapter three"]
            .map(|q| format!("{shared}{q}").into_bytes());
        t.insert(&a, w0); // stamp 1
        t.insert(&b, w0); // stamp 2
        t.insert(&a, w1); // stamp 3: a's path is newer now, w1 on it
        t.insert(&c, w0); // stamp 4
        let only0: WorkerMask = [w0].into_iter().collect();
        let c_stamp = t.longest_prefix(&c, &only0).stamp;
        assert_eq!(c_stamp, 4);
        // w0's engine had evicted b (last used at 2): what w0 last used before 2.5 goes.
        let before = t.worker_bytes(w0);
        let removed = t.age_out(0..t.arena_len(), &[(w0, 3)], &mut Freed::default());
        assert_eq!(t.worker_bytes(w0), before - removed);
        // b's own leaf only: `wo` under the `t` that c (stamp 4) shares.
        assert_eq!(removed, 2);
        assert_eq!(
            t.longest_prefix(&b, &only0).matched,
            shared.len() + "chapter t".len()
        );
        // a (touched at 3) and c (4) stay for w0; w1 is untouched.
        assert_eq!(t.longest_prefix(&a, &only0).matched, a.len());
        assert_eq!(t.longest_prefix(&c, &only0).matched, c.len());
        let only1: WorkerMask = [w1].into_iter().collect();
        assert_eq!(t.longest_prefix(&a, &only1).matched, a.len());
        // A horizon past everything empties w0 but keeps w1's records.
        t.age_out(0..t.arena_len(), &[(w0, 99)], &mut Freed::default());
        assert_eq!(t.worker_bytes(w0), 0);
        assert_eq!(t.longest_prefix(&a, &only1).matched, a.len());
    }

    #[test]
    fn longest_prefix_and_holders() {
        let mut t = RadixTree::new();
        t.insert(b"system: you are helpful\nuser: hi", A);
        t.insert(b"system: you are helpful\nuser: bye", B);
        let m = t.longest_prefix(b"system: you are helpful\nuser: hi there", &all());
        assert_eq!(m.matched, 32);
        assert_eq!(m.workers.iter().collect::<Vec<_>>(), vec![A]);
        let m = t.longest_prefix(b"system: you are helpful\nuser: b", &all());
        assert_eq!(m.matched, 31);
        assert_eq!(m.workers.iter().collect::<Vec<_>>(), vec![B]);
        // The shared part is held by both.
        let m = t.longest_prefix(b"system: you are helpful\nassistant", &all());
        assert_eq!(m.matched, 24);
        assert_eq!(m.workers.iter().collect::<Vec<_>>(), vec![A, B]);
        // Match can end inside an edge.
        let m = t.longest_prefix(b"system: you", &all());
        assert_eq!(m.matched, 11);
    }

    #[test]
    fn prefix_per_worker_reports_each_holders_depth() {
        let mut t = RadixTree::new();
        t.insert(b"system: you are helpful\nuser: hi", A);
        t.insert(b"system: you are helpful\nuser: bye", B);
        t.insert(b"system: other", C);
        let mut got = Vec::new();
        t.prefix_per_worker(
            b"system: you are helpful\nuser: hi there",
            &all(),
            |w, n, _| got.push((w, n)),
        );
        got.sort();
        assert_eq!(got, vec![(A, 32), (B, 30), (C, 8)]);
        // Restricted to the eligible ones; each agrees with longest_prefix alone.
        for w in [A, B, C] {
            let mut one = Vec::new();
            t.prefix_per_worker(
                b"system: you are helpful\nuser: hi there",
                &only(w),
                |w, n, mark| one.push((w, n, mark)),
            );
            let m = t.lookup(b"system: you are helpful\nuser: hi there", &only(w));
            assert_eq!(one, vec![(w, m.found.matched, m.mark)]);
        }
        let mut none = Vec::new();
        t.prefix_per_worker(b"zzz", &all(), |w, n, _| none.push((w, n)));
        assert!(none.is_empty());
    }

    #[test]
    fn match_is_restricted_to_eligible_workers() {
        let mut t = RadixTree::new();
        t.insert(b"abcdef", A);
        t.insert(b"abcxyz", B);
        assert_eq!(t.longest_prefix(b"abcdef", &only(B)).matched, 3);
        assert_eq!(t.longest_prefix(b"abcdef", &only(B)).workers, only(B));
        assert_eq!(t.longest_prefix(b"abcdef", &only(A)).matched, 6);
        assert_eq!(t.longest_prefix(b"abcdef", &only(C)).matched, 0);
        assert_eq!(
            t.longest_prefix(b"abcdef", &WorkerMask::default()).matched,
            0
        );
    }

    #[test]
    fn insert_splits_edges_and_counts_nodes() {
        let mut t = RadixTree::new();
        assert_eq!(t.insert(b"abcdef", A), 1);
        assert_eq!(t.insert(b"abcdef", A), 0, "re-insert creates nothing");
        assert_eq!(t.insert(b"abcxyz", B), 2, "split + leaf");
        assert_eq!(t.insert(b"abc", C), 0, "ends on the split point");
        assert_eq!(t.insert(b"ab", C), 1, "ends inside an edge: split only");
        assert_eq!(t.node_count(), 4);
        assert_eq!(t.longest_prefix(b"abcdef", &only(C)).matched, 3);
        assert_eq!(t.insert(b"", A), 0);
        check_lru(&t);
    }

    #[test]
    fn tree_share_counts_bytes_per_worker() {
        let mut t = RadixTree::new();
        t.insert(b"aaaa", A);
        t.insert(b"aabb", B);
        // edges: "aa" (A,B), "aa" (A), "bb" (B): total 6
        assert_eq!(t.worker_bytes(A), 4);
        assert_eq!(t.worker_bytes(B), 4);
        assert!((t.share(A) - 4.0 / 6.0).abs() < 1e-9);
        assert_eq!(t.share(C), 0.0);
    }

    #[test]
    fn removing_a_worker_keeps_the_others() {
        let mut t = RadixTree::new();
        t.insert(b"shared prefix then A", A);
        t.insert(b"shared prefix then B", B);
        t.insert(b"only A here", A);
        t.insert(b"shared prefix then C", C);
        t.remove_worker(A);
        assert_eq!(t.longest_prefix(b"only A here", &all()).matched, 0);
        assert_eq!(
            t.longest_prefix(b"shared prefix then A", &only(A)).matched,
            0
        );
        let m = t.longest_prefix(b"shared prefix then B", &all());
        assert_eq!((m.matched, m.workers), (20, only(B)));
        assert_eq!(
            t.longest_prefix(b"shared prefix then C", &all()).matched,
            20
        );
        assert_eq!(t.worker_bytes(A), 0);
        assert_eq!(t.node_count(), 3, "A's private nodes freed");
        t.remove_worker(B);
        t.remove_worker(C);
        assert_eq!(t.node_count(), 0);
        assert_eq!(t.share(B), 0.0);
        // Freed nodes are reused.
        t.insert(b"again", A);
        assert_eq!(t.longest_prefix(b"again!", &all()).matched, 5);
        check_lru(&t);
    }

    /// The recency list holds every live node once, each behind its parent, stamps
    /// never increasing: its last node is the least recently used leaf.
    fn check_lru(t: &RadixTree) {
        let order = t.lru_order();
        assert_eq!(order.len(), t.node_count(), "every live node, once");
        let mut seen = std::collections::HashSet::new();
        let mut last = u64::MAX;
        for &(n, stamp, parent) in &order {
            assert!(
                parent == ROOT || seen.contains(&parent),
                "{n} before its parent"
            );
            assert!(stamp <= last, "stamps never increase along the list");
            assert!(seen.insert(n));
            last = stamp;
        }
        if let Some(&(n, _, _)) = order.last() {
            assert!(
                t.nodes[n as usize].children.is_empty(),
                "the last is a leaf"
            );
        }
    }

    #[test]
    fn the_oldest_leaves_go_first_one_at_a_time_whatever_the_tree_size() {
        let mut t = RadixTree::new();
        let system = "system: a shared prompt for every conversation. user: ";
        for i in 0..2000 {
            t.insert(
                format!("{system}turn {i} of {}", i % 7).as_bytes(),
                WorkerId(i % 3),
            );
            if i % 10 == 0 {
                // An old prompt used again is recent again.
                t.insert(
                    format!("{system}turn {} of {}", i / 2, (i / 2) % 7).as_bytes(),
                    A,
                );
            }
        }
        check_lru(&t);
        let (nodes, bytes) = (t.node_count(), t.total_bytes());
        // Ceilings already met: nothing goes.
        assert_eq!(t.evict_oldest(nodes, bytes, 100, &mut Freed::default()), 0);
        // What the old scan-and-sort pass would take first: the oldest leaf.
        let mut leaves = Vec::new();
        t.collect_leaves(0..t.arena_len(), &mut leaves);
        let oldest = *leaves.iter().min().unwrap();
        let mut freed = Freed::default();
        assert_eq!(t.evict_oldest(nodes - 1, u64::MAX, 100, &mut freed), 1);
        assert_eq!(freed.0.len(), 1);
        assert!(
            t.nodes[oldest.1 as usize].edge.is_empty(),
            "the oldest leaf went"
        );
        check_lru(&t);
        // A budget bounds a step; the ceilings bound the pass.
        assert_eq!(t.evict_oldest(0, 0, 64, &mut Freed::default()), 64);
        assert_eq!(t.node_count(), nodes - 65);
        let removed = t.evict_oldest(nodes / 2, u64::MAX, usize::MAX, &mut Freed::default());
        assert_eq!(t.node_count(), nodes / 2, "{removed}");
        check_lru(&t);
        let (n, b) = walk(&t);
        assert_eq!((n, b), (t.node_count(), t.total_bytes()));
        // The most recent prompts stay whole.
        let last = format!("{system}turn 1999 of {}", 1999 % 7);
        assert_eq!(
            t.longest_prefix(last.as_bytes(), &all()).matched,
            last.len()
        );
        // Down to nothing, and the list is empty.
        t.evict_oldest(0, 0, usize::MAX, &mut Freed::default());
        assert_eq!((t.node_count(), t.total_bytes()), (0, 0));
        assert!(t.lru_order().is_empty());
        t.insert(b"again", A);
        check_lru(&t);
    }

    /// Reachable nodes and the sum of their edges, walked from the root.
    fn walk(t: &RadixTree) -> (usize, u64) {
        let (mut nodes, mut bytes, mut stack) = (0, 0, t.children_of(ROOT));
        while let Some(n) = stack.pop() {
            nodes += 1;
            bytes += t.nodes[n as usize].edge.len() as u64;
            stack.extend(t.children_of(n));
        }
        (nodes, bytes)
    }

    #[test]
    fn a_removal_step_past_its_time_stops_whatever_its_budget() {
        let mut t = RadixTree::new();
        for i in 0..500 {
            t.insert(format!("prompt {i} of A alone").as_bytes(), A);
        }
        let mut r = Removal::below(t.children_of(ROOT));
        r.until = Some(std::time::Instant::now()); // already over
        let work = t.remove_step(&mut r, A, usize::MAX, &mut Freed::default());
        assert!(
            work < 16 + 256,
            "a step over its time ends within 16 nodes: {work}"
        );
        assert!(!r.is_done());
        // Untimed steps finish the job.
        r.until = None;
        t.remove_step(&mut r, A, usize::MAX, &mut Freed::default());
        assert!(r.is_done());
        assert_eq!(t.worker_bytes(A), 0);
    }

    #[test]
    fn a_removal_in_one_node_steps_survives_inserts_and_evictions_between_them() {
        let mut t = RadixTree::new();
        for i in 0..200 {
            let w = [A, B, C][i % 3];
            t.insert(
                format!("system {} / turn {i} of a conversation", i % 5).as_bytes(),
                w,
            );
        }
        t.insert(b"only A, a long private prompt", A);
        let mut r = Removal::below(t.children_of(ROOT));
        let mut steps = 0;
        while !r.is_done() {
            t.remove_step(&mut r, A, 1, &mut Freed::default());
            steps += 1;
            // Between two steps: new records (reusing freed slots) and an eviction.
            if steps % 7 == 0 {
                t.insert(format!("new prompt {steps} for B").as_bytes(), B);
                let mut leaves = Vec::new();
                t.collect_leaves(0..t.arena_len(), &mut leaves);
                if let Some(&(stamp, node)) = leaves.iter().min() {
                    t.evict_leaf(node, stamp, &mut Freed::default());
                }
            }
        }
        assert!(steps > 100, "{steps} steps");
        assert_eq!(t.worker_bytes(A), 0);
        assert_eq!(
            t.longest_prefix(b"only A, a long private prompt", &all())
                .matched,
            0
        );
        let (nodes, bytes) = walk(&t);
        assert_eq!(t.node_count(), nodes, "every live node is reachable");
        check_lru(&t);
        assert_eq!(t.total_bytes(), bytes);
        assert_eq!(
            t.total_bytes(),
            t.worker_bytes(B) + t.worker_bytes(C) - shared(&t)
        );
        let m = t.longest_prefix(b"system 4 / turn 199 of a conversation", &only(B));
        assert_eq!(m.matched, 37, "B's records stay");
    }

    #[test]
    fn a_removal_hands_what_it_frees_to_the_caller() {
        let mut t = RadixTree::new();
        t.insert(b"shared system prompt / question one", A);
        t.insert(b"shared system prompt / question two", A);
        t.insert(b"shared system prompt / question three", B);
        let before = t.total_bytes();
        let mut freed = Freed::default();
        t.remove_step(
            &mut Removal::below(t.children_of(ROOT)),
            A,
            usize::MAX,
            &mut freed,
        );
        // "one" and "wo" (under "t"): the nodes A alone held.
        let edges: Vec<&[u8]> = freed
            .0
            .iter()
            .map(|n| &*n.edge)
            .filter(|e| !e.is_empty())
            .collect();
        assert_eq!(edges.len(), 2, "{edges:?}");
        let edges: u64 = edges.iter().map(|e| e.len() as u64).sum();
        assert_eq!(edges, 5);
        assert_eq!(before - t.total_bytes(), edges);
        assert_eq!(t.worker_bytes(A), 0);
    }

    /// Bytes counted for both B and C (nodes both hold).
    fn shared(t: &RadixTree) -> u64 {
        t.nodes
            .iter()
            .filter(|n| n.workers.contains(B) && n.workers.contains(C))
            .map(|n| n.edge.len() as u64)
            .sum()
    }

    #[test]
    fn cost_follows_prompt_not_tree() {
        // 20k distinct prompts; a lookup still touches only its own path.
        let mut t = RadixTree::new();
        for i in 0..20_000u32 {
            t.insert(
                format!("conversation {i} says hello").as_bytes(),
                WorkerId(i % 4),
            );
        }
        let m = t.longest_prefix(
            b"conversation 12345 says hello and more",
            &(0..4).map(WorkerId).collect(),
        );
        assert_eq!(m.matched, "conversation 12345 says hello".len());
        assert_eq!(m.workers, only(WorkerId(12345 % 4)));
    }

    #[test]
    fn freed_slots_are_reused_before_the_arena_grows() {
        let mut t = RadixTree::new();
        for i in 0..50 {
            t.insert(format!("prompt {i:02} of worker A").as_bytes(), A);
        }
        t.insert(b"prompt of worker B", B);
        let (nodes, arena) = (t.node_count(), t.arena_len());
        t.remove_worker(A);
        assert_eq!(
            t.node_count(),
            2,
            "B's prompt and the shared \"prompt \" node"
        );
        assert_eq!(
            t.arena_len(),
            arena,
            "removal frees slots, it does not shrink"
        );
        // Refilled: every node lands in a freed slot, none in a new one.
        for i in 0..50 {
            t.insert(format!("prompt {i:02} of worker A").as_bytes(), A);
        }
        assert_eq!(t.node_count(), nodes);
        assert_eq!(t.arena_len(), arena);
        assert_eq!(
            t.longest_prefix(b"prompt 07 of worker A", &all()).matched,
            21
        );
        // And once the free list is used up, the arena grows again.
        t.insert(b"something else", B);
        assert_eq!(t.arena_len(), arena + 1);
        assert_eq!(t.node_count(), nodes + 1);
    }

    #[test]
    fn leaves_are_evicted_oldest_first_and_shared_prefixes_stay() {
        let mut t = RadixTree::new();
        t.insert(b"system prompt / conversation one", A);
        t.insert(b"system prompt / conversation two", B);
        t.insert(b"other prompt", A);
        assert_eq!(t.node_count(), 4);
        let mut leaves = Vec::new();
        t.collect_leaves(0..t.arena_len(), &mut leaves);
        leaves.sort();
        assert_eq!(leaves.len(), 3);
        // The oldest leaf is "...one"; its memory is handed over, to be freed unlocked.
        let (stamp, node) = leaves[0];
        let mut freed = Freed::default();
        assert!(t.evict_leaf(node, stamp, &mut freed));
        assert_eq!(freed.0.len(), 1);
        assert_eq!(&*freed.0[0].edge, b"one");
        assert!(
            !t.evict_leaf(node, stamp, &mut Freed::default()),
            "already gone"
        );
        assert_eq!(
            t.longest_prefix(b"system prompt / conversation one", &all())
                .matched,
            29
        );
        assert_eq!(
            t.longest_prefix(b"system prompt / conversation two", &all())
                .matched,
            32
        );
        assert_eq!(t.worker_bytes(A), 29 + 12);
        // A touched leaf is not evicted with its old stamp.
        let (stamp, node) = leaves[1];
        t.insert(b"system prompt / conversation two", B);
        assert!(!t.evict_leaf(node, stamp, &mut Freed::default()));
        check_lru(&t);
    }

    #[test]
    fn common_prefix_handles_chunks_and_tails() {
        let a = vec![7u8; 40];
        let mut b = a.clone();
        assert_eq!(common_prefix_len(&a, &b), 40);
        b[33] = 0;
        assert_eq!(common_prefix_len(&a, &b), 33);
        assert_eq!(common_prefix_len(&a[..5], &b), 5);
        assert_eq!(common_prefix_len(b"", &b), 0);
    }

    #[test]
    fn common_prefix_finds_every_first_difference_across_blocks_and_words() {
        let naive = |a: &[u8], b: &[u8]| a.iter().zip(b).take_while(|(x, y)| x == y).count();
        let a: Vec<u8> = (0..3000u32).map(|i| (i * 7 % 251) as u8).collect();
        for len in [0, 1, 7, 8, 9, 1023, 1024, 1025, 2048, 2999, 3000] {
            assert_eq!(common_prefix_len(&a[..len], &a), len);
            assert_eq!(common_prefix_len(&a, &a[..len]), len);
        }
        for at in (0..3000)
            .step_by(13)
            .chain([1023, 1024, 1025, 2047, 2048, 2999])
        {
            let mut b = a.clone();
            b[at] ^= 0x40;
            assert_eq!(common_prefix_len(&a, &b), at);
            assert_eq!(common_prefix_len(&a, &b), naive(&a, &b));
            // The other side shorter than the difference: the shorter length.
            assert_eq!(common_prefix_len(&a[..at / 2], &b), at / 2);
        }
    }
}

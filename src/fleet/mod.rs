//! Many router replicas that route as one: routing state shared through Redis
//! (`state: {redis_url, namespace}`).
//!
//! Each replica publishes, on the Redis pub/sub channel `<namespace>:fleet:v2`, batches
//! of [`wire::Record`]s: the prefixes its workers served (chained hashes of 128-byte
//! chunks of the routing text, never the text) and, every [`LOAD_EVERY`], its requests
//! in flight per worker. It applies what the others publish: their prefix records go to
//! an index beside the tree ([`Fleet`] implements [`RemotePrefixes`]; `cache_aware` and
//! `cost_aware` take the longer of the two matches), and their in-flight shares are
//! summed into each worker's `remote_in_flight` (load comparisons and `max_load`), each
//! replica's share expiring [`LOAD_TTL`] after its last publish.
//!
//! Routing never waits on Redis: the request path hashes nothing of its own (the chunk
//! hashes come with the prompt's digest, `crate::prompt::chunks`), it only hands the
//! served prompt's record to a bounded channel (dropped and counted when full);
//! publishing and applying run in two tasks. A Redis outage degrades to per-process
//! routing (the other replicas' loads expire; their prefix records stay, they were true)
//! and is counted and logged; both tasks reconnect and sharing resumes. Precise mode needs none of this:
//! every replica follows the engines' own KV events.
//!
//! Session and `/v1/responses` bindings travel the same way ([`Fleet::bound`] out,
//! [`BindingSink`] in): a session bound through one replica is followed by all.
//!
//! A replica that starts late, or comes back after an outage, bootstraps from a bounded
//! snapshot: every message is also kept in the list `<namespace>:fleet:v2:log` (the
//! newest [`LOG_MESSAGES`]), read and applied, oldest first, right after subscribing
//! (in-flight shares in it are stale and skipped).

mod index;
pub mod metrics;
pub mod wire;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use tokio::sync::mpsc;

use crate::config::StateConfig;
use crate::pools::pool::{Pool, Worker, WorkerId};
pub use crate::prompt::chunks::{CHUNK_BYTES, chain};
use crate::prompt::chunks::{extend, link};
use crate::redis_link::{Query, RedisLink};
use crate::shutdown::Shutdown;
use crate::tree::{ChainMemo, PrefixMatch, RemotePrefixes, WorkerMask};
use index::ChunkIndex;
use wire::{Batch, Record};

/// How often a replica publishes its in-flight counts.
pub const LOAD_EVERY: Duration = Duration::from_millis(100);
/// A replica's in-flight share counts this long after its last publish.
pub const LOAD_TTL: Duration = Duration::from_secs(1);
/// Longest a prefix record waits to be batched.
pub const FLUSH_EVERY: Duration = Duration::from_millis(20);
/// Prefix records (chunk hash, worker) kept from the other replicas, least recently
/// stored replaced first; 16 bytes each, allocated when the fleet is built (16 MiB).
pub const MAX_RECORDS: usize = 1 << 20;
/// Messages kept in Redis for replicas that start late.
pub const LOG_MESSAGES: usize = 1000;
/// The snapshot list expires this long after its last message (a fleet that stopped).
const LOG_TTL: Duration = Duration::from_secs(24 * 3600);
/// Records waiting for the publisher; past it new ones are dropped (and counted).
const QUEUE: usize = 4096;
/// Index sets cleared per lock hold when a worker's records go.
const FORGET_SETS: usize = 4096;
/// Longest one Redis call may take.
const OP_TIMEOUT: Duration = Duration::from_millis(500);
/// Least time between two log lines about Redis failures.
const LOG_EVERY: Duration = Duration::from_secs(10);

/// Which binding map a [`wire::Record::Binding`] names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BindingKind {
    /// A session key (`session:`).
    Session,
    /// A `/v1/responses` response or conversation id.
    Conversation,
}

/// Where the other replicas' bindings go (the session layer's memory).
pub trait BindingSink: Send + Sync + std::fmt::Debug {
    /// Another replica bound `key` (a hash) to `worker`.
    fn apply_binding(&self, kind: BindingKind, key: u64, worker: &Worker);
}

/// Counters of the fleet channel, for `/metrics` and `/workers`.
#[derive(Debug, Default)]
pub struct FleetCounts {
    pub messages_out: AtomicU64,
    pub bytes_out: AtomicU64,
    pub records_out: AtomicU64,
    pub messages_in: AtomicU64,
    pub bytes_in: AtomicU64,
    pub records_in: AtomicU64,
    /// Records dropped because the publisher fell behind.
    pub dropped: AtomicU64,
    /// Messages that were not fleet messages (another program on the channel).
    pub malformed: AtomicU64,
    pub publish_errors: AtomicU64,
    pub subscribe_errors: AtomicU64,
    /// Snapshot messages applied on (re)connecting.
    pub snapshot_messages: AtomicU64,
    /// Whether the subscriber is connected now.
    pub connected: AtomicBool,
}

/// One replica's published in-flight counts (worker key hash, requests) and when.
type Share = (Instant, Vec<(u64, u32)>);

/// This replica's view of the fleet (see the module docs).
pub struct Fleet {
    /// Random, per process: told apart from the others' messages.
    replica: u64,
    channel: String,
    /// The snapshot list's key.
    log: String,
    client: redis::Client,
    pool: Arc<Pool>,
    tx: mpsc::Sender<Record>,
    rx: Mutex<Option<mpsc::Receiver<Record>>>,
    index: Mutex<ChunkIndex>,
    /// Per other replica: when it last published, and its share.
    loads: Mutex<HashMap<u64, Share>>,
    /// Where the other replicas' bindings are applied (the session layer's memory).
    bindings: Arc<dyn BindingSink>,
    pub counts: FleetCounts,
    /// Failure log lines, at most one per [`LOG_EVERY`].
    failures: crate::clock::LogEvery,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("replica", &format_args!("{:016x}", self.replica))
            .field("channel", &self.channel)
            .finish_non_exhaustive()
    }
}

impl Fleet {
    /// The fleet for `cfg` (its `redis_url` set), over `pool`'s workers, applying the
    /// other replicas' bindings into `bindings`; connects when [`Fleet::run`] starts.
    /// `Err` when the URL cannot be used (config checked it).
    pub fn new(
        cfg: &StateConfig,
        pool: Arc<Pool>,
        bindings: Arc<dyn BindingSink>,
    ) -> Result<Arc<Self>, String> {
        let url = cfg.redis_url.as_ref().ok_or("state.redis_url is not set")?;
        let client = redis::Client::open(url.expose()).map_err(|e| e.to_string())?;
        let (tx, rx) = mpsc::channel(QUEUE);
        Ok(Arc::new(Fleet {
            replica: rand::random(),
            // v2: the chunk hashes of `link` (v1 seeded xxh3 with the chain; the two
            // never match, so they keep apart during a rolling upgrade).
            channel: format!("{}:fleet:v2", cfg.namespace),
            log: format!("{}:fleet:v2:log", cfg.namespace),
            client,
            pool,
            tx,
            rx: Mutex::new(Some(rx)),
            index: Mutex::new(ChunkIndex::new(MAX_RECORDS)),
            loads: Mutex::new(HashMap::new()),
            bindings,
            counts: FleetCounts::default(),
            failures: crate::clock::LogEvery::new(LOG_EVERY),
        }))
    }

    /// This replica bound `key` to `worker`: tell the others (dropped and counted when
    /// the publisher is behind).
    pub fn bound(&self, kind: BindingKind, key: u64, worker: &Worker) {
        let r = Record::Binding {
            kind,
            key,
            worker: worker.key_hash(),
        };
        self.queue(r);
    }

    /// Hands `record` to the publisher; dropped and counted when it is behind.
    fn queue(&self, record: Record) {
        if self.tx.try_send(record).is_err() {
            self.counts.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Prefix records (chunk hash, worker) held from the other replicas.
    pub fn remote_records(&self) -> usize {
        self.index.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// The publisher and the subscriber, until shutdown.
    pub async fn run(self: Arc<Self>, shutdown: Shutdown) {
        let Some(rx) = self.rx.lock().unwrap_or_else(|p| p.into_inner()).take() else {
            return;
        };
        tokio::join!(
            Arc::clone(&self).publish(rx, shutdown.clone()),
            Arc::clone(&self).subscribe(shutdown)
        );
    }

    async fn publish(self: Arc<Self>, mut rx: mpsc::Receiver<Record>, mut shutdown: Shutdown) {
        // A connection whose pipeline timed out (a frozen Redis) is replaced, not
        // queued behind: sharing resumes as soon as Redis answers again.
        let link = RedisLink::new(self.client.clone(), OP_TIMEOUT);
        let mut flush = tokio::time::interval(FLUSH_EVERY);
        flush.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_load = Instant::now() - LOAD_EVERY;
        let mut batch = Batch::new(self.replica);
        loop {
            // The queue is drained at each tick, never awaited: a request's `try_send`
            // then wakes no task (no cross-thread wake-up, no syscall, per request).
            tokio::select! {
                _ = shutdown.wait() => return,
                _ = flush.tick() => {
                    loop {
                        match rx.try_recv() {
                            Ok(r) => batch.push(&r),
                            Err(mpsc::error::TryRecvError::Empty) => break,
                            Err(mpsc::error::TryRecvError::Disconnected) => return,
                        }
                    }
                    if last_load.elapsed() >= LOAD_EVERY {
                        last_load = Instant::now();
                        batch.push(&Record::Load(self.local_loads()));
                    }
                    if !batch.is_empty() {
                        self.send(&link, &batch).await;
                        batch.clear();
                    }
                }
            }
        }
    }

    async fn send(&self, link: &RedisLink, batch: &Batch) {
        let (records, bytes) = (batch.records(), batch.len());
        let payload = batch.as_bytes();
        let mut p = redis::pipe();
        p.cmd("PUBLISH")
            .arg(&self.channel)
            .arg(payload)
            .ignore()
            .cmd("LPUSH")
            .arg(&self.log)
            .arg(payload)
            .ignore()
            .cmd("LTRIM")
            .arg(&self.log)
            .arg(0)
            .arg(LOG_MESSAGES as i64 - 1)
            .ignore()
            .cmd("EXPIRE")
            .arg(&self.log)
            .arg(LOG_TTL.as_secs())
            .ignore();
        match link.query::<()>(&Query::Pipe(p)).await {
            Ok(()) => {
                let c = &self.counts;
                c.messages_out.fetch_add(1, Ordering::Relaxed);
                c.bytes_out.fetch_add(bytes as u64, Ordering::Relaxed);
                c.records_out.fetch_add(records as u64, Ordering::Relaxed);
            }
            Err(e) => self.failed(&self.counts.publish_errors, &e.to_string()),
        }
    }

    async fn subscribe(self: Arc<Self>, mut shutdown: Shutdown) {
        let mut backoff = Duration::from_millis(200);
        let mut expire = tokio::time::interval(LOAD_TTL / 4);
        loop {
            let connected = async {
                let mut ps = self.client.get_async_pubsub().await?;
                ps.subscribe(&self.channel).await?;
                Ok::<_, redis::RedisError>(ps)
            };
            let ps = tokio::select! {
                _ = shutdown.wait() => return,
                r = tokio::time::timeout(OP_TIMEOUT * 4, connected) => r,
            };
            match ps {
                Ok(Ok(ps)) => {
                    backoff = Duration::from_millis(200);
                    self.counts.connected.store(true, Ordering::Relaxed);
                    // Subscribed first, so nothing falls between the snapshot and the
                    // channel (a record seen twice is applied twice: harmless).
                    let applied = self.bootstrap().await;
                    tracing::info!(channel = %self.channel, snapshot_messages = applied, "fleet: sharing routing state");
                    let mut messages = ps.into_on_message();
                    loop {
                        tokio::select! {
                            _ = shutdown.wait() => return,
                            _ = expire.tick() => self.apply_loads(),
                            m = messages.next() => match m {
                                Some(m) => self.apply(m.get_payload_bytes()),
                                None => break,
                            },
                        }
                    }
                    self.counts.connected.store(false, Ordering::Relaxed);
                    self.failed(&self.counts.subscribe_errors, "subscription closed");
                }
                Ok(Err(e)) => self.failed(&self.counts.subscribe_errors, &e.to_string()),
                Err(_) => self.failed(&self.counts.subscribe_errors, "no answer within 2 s"),
            }
            // Per-process until Redis answers again: the others' loads expire.
            self.apply_loads();
            tokio::select! {
                _ = shutdown.wait() => return,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }

    /// Reads the snapshot list and applies it oldest first (loads skipped); the number
    /// of messages applied. A failure is counted and leaves the channel to catch up.
    async fn bootstrap(&self) -> usize {
        let read = async {
            let mut conn = self.client.get_multiplexed_async_connection().await?;
            redis::cmd("LRANGE")
                .arg(&self.log)
                .arg(0)
                .arg(LOG_MESSAGES as i64 - 1)
                .query_async::<Vec<bytes::Bytes>>(&mut conn)
                .await
        };
        match tokio::time::timeout(OP_TIMEOUT * 4, read).await {
            Ok(Ok(messages)) => {
                for m in messages.iter().rev() {
                    self.apply_records(m, false);
                }
                self.counts
                    .snapshot_messages
                    .fetch_add(messages.len() as u64, Ordering::Relaxed);
                messages.len()
            }
            Ok(Err(e)) => {
                self.failed(&self.counts.subscribe_errors, &e.to_string());
                0
            }
            Err(_) => {
                self.failed(
                    &self.counts.subscribe_errors,
                    "snapshot: no answer within 2 s",
                );
                0
            }
        }
    }

    /// Applies `payload` as if it had arrived on the channel (a [`wire::Batch`]'s bytes;
    /// its own replica's and garbage are skipped): for benchmarks and tests that fill
    /// the index without a Redis.
    pub fn apply_message(&self, payload: &[u8]) {
        self.apply(payload);
    }

    /// Applies one message from the channel (own messages and garbage are skipped).
    fn apply(&self, payload: &[u8]) {
        self.apply_records(payload, true);
    }

    /// Applies one message; `live` = from the channel now (a snapshot's in-flight shares
    /// are stale and skipped, and its messages are not counted as received).
    fn apply_records(&self, payload: &[u8], live: bool) {
        let c = &self.counts;
        let Ok((replica, records)) = wire::decode(payload) else {
            c.malformed.fetch_add(1, Ordering::Relaxed);
            return;
        };
        if replica == self.replica {
            return;
        }
        if live {
            c.messages_in.fetch_add(1, Ordering::Relaxed);
            c.bytes_in
                .fetch_add(payload.len() as u64, Ordering::Relaxed);
            c.records_in
                .fetch_add(records.len() as u64, Ordering::Relaxed);
        }
        let set = self.pool.set();
        let by_key: HashMap<u64, WorkerId> = set
            .workers()
            .iter()
            .map(|w| (w.key_hash(), w.id()))
            .collect();
        let mut load = None;
        let mut bindings = Vec::new();
        for r in records {
            match r {
                Record::Prefix { worker, chain } => {
                    let Some(&id) = by_key.get(&worker) else {
                        continue;
                    };
                    // One chain per lock hold (at most `wire::MAX_CHAIN` stores, a few
                    // µs), so a request's lookup never waits behind a whole message.
                    // Tail first: the head, stored last, is replaced last, so what
                    // eviction leaves of a chain is still a prefix.
                    let mut index = self.index.lock().unwrap_or_else(|p| p.into_inner());
                    for h in chain.into_iter().rev() {
                        index.insert(h, id);
                    }
                }
                Record::Load(l) if live => load = Some(l),
                Record::Load(_) => {}
                Record::Binding { kind, key, worker } => bindings.push((kind, key, worker)),
            }
        }
        for (kind, key, worker) in bindings {
            if let Some(w) = by_key.get(&worker).and_then(|&id| set.get(id)) {
                self.bindings.apply_binding(kind, key, w);
            }
        }
        if let Some(l) = load {
            self.loads
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(replica, (Instant::now(), l));
            self.apply_loads();
        }
    }

    /// Sums the live replicas' in-flight shares into each worker; drops expired shares.
    fn apply_loads(&self) {
        let mut sums: HashMap<u64, usize> = HashMap::new();
        {
            let mut loads = self.loads.lock().unwrap_or_else(|p| p.into_inner());
            loads.retain(|_, (at, _)| at.elapsed() < LOAD_TTL);
            for (_, l) in loads.values() {
                for &(w, n) in l {
                    *sums.entry(w).or_default() += n as usize;
                }
            }
        }
        for w in self.pool.set().workers() {
            w.set_remote_in_flight(sums.get(&w.key_hash()).copied().unwrap_or(0));
        }
    }

    fn local_loads(&self) -> Vec<(u64, u32)> {
        self.pool
            .set()
            .workers()
            .iter()
            .map(|w| (w.key_hash(), w.in_flight() as u32))
            .collect()
    }

    fn failed(&self, counter: &AtomicU64, error: &str) {
        counter.fetch_add(1, Ordering::Relaxed);
        if let Some(failures) = self.failures.due() {
            tracing::warn!(error = %crate::redact::line(error), channel = %self.channel, failures, "fleet: Redis failed; routing per-process until it answers");
        }
    }
}

/// The chunk hashes of one text, from the request's [`ChainMemo`]: the proxy's comes
/// filled by extraction (`RouteContext::chain`); an empty one (tests, other callers) is
/// filled as far as the search asks, and the publish reuses what it holds.
struct LazyChain<'a> {
    text: &'a [u8],
    hashes: std::sync::MutexGuard<'a, Vec<u64>>,
    len: usize,
}

impl<'a> LazyChain<'a> {
    fn new(text: &'a [u8], memo: &'a ChainMemo) -> Self {
        let len = text.len() / CHUNK_BYTES;
        let mut hashes = memo.lock();
        let have = hashes.len();
        if hashes.capacity() < len {
            hashes.reserve_exact(len - have);
        }
        LazyChain { text, hashes, len }
    }

    /// Hash of chunk `i` (< `len`), chained from chunk 0.
    fn get(&mut self, i: usize) -> u64 {
        debug_assert!(i < self.len);
        while self.hashes.len() <= i {
            let k = self.hashes.len();
            let prev = self.hashes.last().copied().unwrap_or(0);
            let c = &self.text[k * CHUNK_BYTES..(k + 1) * CHUNK_BYTES];
            self.hashes.push(link(prev, c));
        }
        self.hashes[i]
    }
}

/// How much each step of [`last_held`]'s gallop grows.
const GALLOP: usize = 4;

/// The chunks [`last_held`] probes after a held `from` while every probe holds: `from`
/// plus 1, 5, 21, … below `n - 1`, then `n - 1` (its first probes whatever they find,
/// known before the search starts).
fn gallop_probes(from: usize, n: usize) -> impl Iterator<Item = usize> {
    let steps = std::iter::successors(Some((from + 1, 1usize)), |&(at, step)| {
        Some((at + step * GALLOP, step * GALLOP))
    });
    steps
        .map(|(at, _)| at)
        .take_while(move |&at| at + 1 < n)
        .chain((n > from + 1).then(|| n - 1))
}

/// The last `i` < `n` for which `holds(i)` is true, for a `holds` that is true up to some
/// point and false after it; `None` when none is. Starts at `guess` (clamped to the
/// chain), gallops from there (+1, +4, +16, …; the chain's end is tried before a gallop
/// passes it) or, when `guess` is not held, from 0 below it, and bisects: O(log m)
/// probes for a match of m, one when the guess is the whole chain. Each probe of `i`
/// needs the chain's hashes up to `i`, so a good guess also hashes less (trying the
/// end first would hash the whole text for every match that stops early).
fn last_held(n: usize, guess: usize, mut holds: impl FnMut(usize) -> bool) -> Option<usize> {
    if n == 0 {
        return None;
    }
    let g = guess.min(n - 1);
    // Invariant: `holds(lo)`, and `hi` is not held (or is `n`).
    let (mut lo, mut hi) = if holds(g) {
        (g, n)
    } else if g > 0 && holds(0) {
        (0, g)
    } else {
        return None;
    };
    // Steps grow GALLOP-fold: a 256-chunk match past a 16-chunk guess is 5 probes, not 9
    // (each a miss in a 16 MiB table), for about one more bisection probe otherwise.
    let mut step = 1;
    while lo + step < hi {
        let next = lo + step;
        if hi == n && next >= n - 1 {
            break;
        }
        if !holds(next) {
            hi = next;
            break;
        }
        lo = next;
        step *= GALLOP;
    }
    if hi == n {
        // The gallop reached the chain's end: the whole chain, or bisect below its end.
        if lo == n - 1 || holds(n - 1) {
            return Some(n - 1);
        }
        hi = n - 1;
    }
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if holds(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Some(lo)
}

impl RemotePrefixes for Fleet {
    /// Records are prefix-closed (a chain is stored tail first, so eviction takes tails
    /// before heads): the chunks some eligible worker holds are a prefix of the chain,
    /// and its end is found by [`last_held`] — O(log m) lookups for an m-chunk match.
    fn longest_prefix(
        &self,
        text: &[u8],
        eligible: &WorkerMask,
        memo: &ChainMemo,
        guess: usize,
    ) -> PrefixMatch {
        let mut best = PrefixMatch {
            matched: 0,
            workers: WorkerMask::default(),
            stamp: 0,
        };
        let index = self.index.lock().unwrap_or_else(|p| p.into_inner());
        if index.is_empty() {
            return best;
        }
        // A local match longer than the text's whole chunks is more than any record here
        // can match (or tie): nothing to hash or probe.
        let n = text.len() / CHUNK_BYTES;
        if guess > n * CHUNK_BYTES {
            return best;
        }
        let mut chain = LazyChain::new(text, memo);
        // The chunk whose record would tie the guess (or beat it, for a guess between
        // chunk ends): when no eligible worker holds it, nothing here is as long as the
        // guess, and the caller keeps its own match (one probe, the common case of a
        // prompt the other replicas saw no more of than this one did).
        let first = guess.div_ceil(CHUNK_BYTES).saturating_sub(1);
        if guess > 0 && !index.held(chain.get(first), eligible) {
            return best;
        }
        // The gallop's next probes (`gallop_probes`), when their hashes are known (the proxy's memo comes whole from
        // extraction): their sets are loaded together now, not one dependent miss after
        // another (a 256-chunk match past a 16-chunk guess: 6 probes).
        if chain.hashes.len() >= n {
            let fold = gallop_probes(first, n).fold(0, |f, i| f ^ index.touch(chain.hashes[i]));
            std::hint::black_box(fold);
        }
        // `first` is known held when probed (a guess of 0 probes chunk 0 here first).
        let mut known = guess > 0;
        let holds = |i: usize| {
            if known && i == first {
                known = false;
                return true;
            }
            index.held(chain.get(i), eligible)
        };
        let Some(last) = last_held(n, first, holds) else {
            return best;
        };
        best.matched = (last + 1) * CHUNK_BYTES;
        best.workers = index.holders(chain.get(last), eligible);
        best
    }

    /// As [`Fleet::longest_prefix`], one search per worker that holds the first chunk.
    fn prefix_per_worker(
        &self,
        text: &[u8],
        eligible: &WorkerMask,
        memo: &ChainMemo,
        f: &mut dyn FnMut(WorkerId, usize),
    ) {
        let index = self.index.lock().unwrap_or_else(|p| p.into_inner());
        if index.is_empty() || text.len() < CHUNK_BYTES {
            return;
        }
        let mut chain = LazyChain::new(text, memo);
        let n = chain.len;
        let holders = index.holders(chain.get(0), eligible);
        for w in holders.iter() {
            let holds = |i: usize| index.held_by(chain.get(i), w);
            if let Some(last) = last_held(n, 0, holds) {
                f(w, (last + 1) * CHUNK_BYTES);
            }
        }
    }

    fn learned(&self, text: &[u8], worker: WorkerId, memo: &ChainMemo) {
        if text.len() < CHUNK_BYTES {
            return;
        }
        let Some(w) = self.pool.set().get(worker).map(|w| w.key_hash()) else {
            return;
        };
        // The request's hashes, taken (it is done routing): the proxy's come whole from
        // extraction; a caller that brought none (a test, say) has the rest hashed here.
        let n = (text.len() / CHUNK_BYTES).min(wire::MAX_CHAIN);
        let mut chain = std::mem::take(&mut *memo.lock());
        chain.truncate(n);
        if chain.len() < n {
            let from = chain.len() * CHUNK_BYTES;
            extend(&mut chain, &text[from..n * CHUNK_BYTES]);
        }
        self.queue(Record::Prefix { worker: w, chain });
    }

    /// In steps of [`FORGET_SETS`] sets per lock hold (~0.5 MiB of the table), so the
    /// request path never waits behind the whole 16 MiB pass.
    fn forget(&self, worker: WorkerId) {
        let sets = self.index.lock().unwrap_or_else(|p| p.into_inner()).sets();
        for start in (0..sets).step_by(FORGET_SETS) {
            self.index
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .forget_in(worker, start..start + FORGET_SETS);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn fleet() -> Arc<Fleet> {
        let c = Config::from_sources([(
            std::path::Path::new("t.yaml"),
            "state: {redis_url: \"redis://127.0.0.1:1/\"}\nworkers:\n  - url: http://a:1\n  - url: http://b:1\n",
        )])
        .unwrap();
        let pool = Arc::new(Pool::new(&c.workers, &c.circuit_breaker));
        let memory = crate::policy::session::Memory::new(&c.session);
        Fleet::new(&c.state, pool, memory).unwrap()
    }

    fn message(from: u64, records: &[Record]) -> Vec<u8> {
        let mut b = Batch::new(from);
        for r in records {
            b.push(r);
        }
        b.into_bytes()
    }

    #[test]
    fn applied_records_match_by_whole_chunks_per_worker() {
        let f = fleet();
        let set = f.pool.set();
        let (a, b) = (&set.workers()[0], &set.workers()[1]);
        let text = vec![b'x'; CHUNK_BYTES * 4 + 10];
        let hashes: Vec<u64> = chain(&text).collect();
        f.apply(&message(
            7,
            &[
                Record::Prefix {
                    worker: a.key_hash(),
                    chain: hashes[..3].to_vec(),
                },
                Record::Prefix {
                    worker: b.key_hash(),
                    chain: hashes[..1].to_vec(),
                },
                // A worker this replica does not have: ignored.
                Record::Prefix {
                    worker: 99,
                    chain: hashes.clone(),
                },
            ],
        ));
        let all: WorkerMask = [a.id(), b.id()].into_iter().collect();
        let m = f.longest_prefix(&text, &all, &ChainMemo::default(), 0);
        assert_eq!(m.matched, 3 * CHUNK_BYTES);
        assert!(m.workers.contains(a.id()) && !m.workers.contains(b.id()));
        let only_b: WorkerMask = [b.id()].into_iter().collect();
        assert_eq!(
            f.longest_prefix(&text, &only_b, &ChainMemo::default(), 0)
                .matched,
            CHUNK_BYTES
        );
        let mut per = Vec::new();
        f.prefix_per_worker(&text, &all, &ChainMemo::default(), &mut |w, n| {
            per.push((w, n))
        });
        per.sort();
        assert_eq!(per, vec![(a.id(), 3 * CHUNK_BYTES), (b.id(), CHUNK_BYTES)]);
        // Its own messages are never applied.
        let before = f.remote_records();
        f.apply(&message(
            f.replica,
            &[Record::Prefix {
                worker: b.key_hash(),
                chain: hashes.clone(),
            }],
        ));
        assert_eq!(f.remote_records(), before);
        f.apply(b"garbage");
        assert_eq!(f.counts.malformed.load(Ordering::Relaxed), 1);
        // A guess (the tree's own match) is tied or beaten, or nothing is reported.
        for (guess, want) in [
            (2 * CHUNK_BYTES + 5, 3 * CHUNK_BYTES),
            (3 * CHUNK_BYTES, 3 * CHUNK_BYTES),
            (3 * CHUNK_BYTES + 1, 0),
            (4 * CHUNK_BYTES, 0),
        ] {
            let hashed = ChainMemo::from(hashes.clone());
            for memo in [&ChainMemo::default(), &hashed] {
                let m = f.longest_prefix(&text, &all, memo, guess);
                assert_eq!(m.matched, want, "guess {guess}");
                assert_eq!(m.workers.contains(a.id()), want > 0);
            }
        }
        // A tree match past the text's whole chunks: no record here can match or tie it.
        let past = 4 * CHUNK_BYTES + 1;
        assert_eq!(
            f.longest_prefix(&text, &all, &ChainMemo::default(), past)
                .matched,
            0
        );
        f.forget(a.id());
        assert_eq!(
            f.longest_prefix(&text, &all, &ChainMemo::default(), 0)
                .matched,
            CHUNK_BYTES
        );
        f.forget(b.id());
        assert_eq!(f.remote_records(), 0);
    }

    #[test]
    fn a_served_prompt_is_published_whole_whatever_its_pick_hashed() {
        let f = fleet();
        let mut rx = f.rx.lock().unwrap().take().unwrap();
        let a = f.pool.set().workers()[0].id();
        let text: Vec<u8> = (0..CHUNK_BYTES * 9 + 17).map(|i| (i % 251) as u8).collect();
        let whole: Vec<u64> = chain(&text).collect();
        for hashed in [0, 1, 5, 9] {
            let memo = ChainMemo::default();
            if hashed > 0 {
                LazyChain::new(&text, &memo).get(hashed - 1);
            }
            f.learned(&text, a, &memo);
            let Record::Prefix { chain, .. } = rx.try_recv().expect("queued") else {
                panic!("a prefix record");
            };
            assert_eq!(chain, whole, "pick hashed {hashed} chunks");
            assert!(memo.lock().is_empty(), "the hashes were taken, not copied");
        }
    }

    #[test]
    fn remote_loads_sum_over_replicas() {
        let f = fleet();
        let set = f.pool.set();
        let (a, b) = (&set.workers()[0], &set.workers()[1]);
        f.apply(&message(
            1,
            &[Record::Load(vec![(a.key_hash(), 2), (b.key_hash(), 1)])],
        ));
        f.apply(&message(2, &[Record::Load(vec![(a.key_hash(), 3)])]));
        assert_eq!((a.remote_in_flight(), b.remote_in_flight()), (5, 1));
        assert_eq!(a.load(), 5);
        // A newer share from replica 1 replaces its old one.
        f.apply(&message(1, &[Record::Load(vec![(a.key_hash(), 0)])]));
        assert_eq!((a.remote_in_flight(), b.remote_in_flight()), (3, 0));
    }

    #[test]
    fn last_held_finds_the_end_of_a_prefix() {
        for n in 0..40usize {
            for end in 0..=n {
                // Chunks 0..end are held.
                for guess in [0, end.saturating_sub(1), end, n / 2, n + 3] {
                    let mut probes = 0;
                    let got = last_held(n, guess, |i| {
                        probes += 1;
                        i < end
                    });
                    assert_eq!(got, end.checked_sub(1), "n {n} end {end} guess {guess}");
                    assert!(probes <= 2 * (usize::BITS - n.leading_zeros()) as usize + 3);
                }
            }
            // A right guess of the whole chain costs one probe.
            let mut probes = 0;
            last_held(n, n.saturating_sub(1), |_| {
                probes += 1;
                true
            });
            assert_eq!(probes, usize::from(n > 0));
        }
        // What is loaded ahead of a search is what the search probes while it holds.
        for n in 1..300usize {
            for from in [0, 1, n / 3, n - 1] {
                let mut probed = Vec::new();
                last_held(n, from, |i| {
                    probed.push(i);
                    true
                });
                let ahead: Vec<usize> = gallop_probes(from, n).collect();
                assert_eq!(probed[1..], ahead[..], "n {n} from {from}");
            }
        }
        let text = vec![7u8; CHUNK_BYTES * 5 + 3];
        let memo = ChainMemo::default();
        let mut lazy = LazyChain::new(&text, &memo);
        let all: Vec<u64> = chain(&text).collect();
        assert_eq!(lazy.len, 5);
        assert_eq!(lazy.get(3), all[3]);
        assert_eq!(lazy.get(1), all[1]);
        assert_eq!(lazy.get(4), all[4]);
    }
}

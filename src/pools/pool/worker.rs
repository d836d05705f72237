//! One upstream inference server and the state that must survive a reload: in-flight
//! count, health, breaker, probe run, KV-event feeds.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use super::WorkerId;
use super::breaker::{self, Admission, CircuitBreaker, Outcome};
use super::load::now;
use super::prefill::Prefill;
use super::signals::Signals;
use crate::config::{BreakerConfig, WorkerConfig};
use crate::precise::feed::Feed;

/// One upstream inference server.
///
/// Laid out (`repr(C)`, aligned to a 64-byte cache line) so that what every decision
/// reads of every worker (`routing_state`, its id, whether it is a fallback, cache-aware
/// or saturated) is in its first cache line: at 1,000 workers a decision reads 1,000 of
/// those lines instead of four lines of each worker (its counters, flags and config
/// were spread over ~1 KiB).
#[derive(Debug)]
#[repr(C, align(64))]
pub struct Worker {
    // The first cache line: read by every decision.
    /// Requests forwarded and not yet finished (body ended or dropped).
    pub(super) in_flight: AtomicUsize,
    /// Requests the other router replicas have in flight here (`crate::fleet`; 0 when
    /// not shared or when their shares expired).
    remote_in_flight: AtomicUsize,
    /// `config.max_load`, 0 for none (copied: the config is fixed for a worker's life).
    max_load: usize,
    /// Its stable handle in the pool (see [`WorkerId`]).
    id: WorkerId,
    /// `config.load_penalty`.
    load_penalty: u32,
    healthy: AtomicBool,
    /// Whether the breaker is closed, stored under its lock after each change: every
    /// request asks each worker whether it is routable, and the usual answer ("closed")
    /// then costs no lock (1,000 lock round trips per request at 1,000 workers).
    breaker_closed: AtomicBool,
    /// `config.role` is `fallback`.
    fallback: bool,
    /// `config.cache_aware`.
    cache_aware: bool,
    /// Removed from the pool or marked draining: it takes no new request (see
    /// [`Worker::drain`]).
    draining: AtomicBool,
    /// What its engine reports (scrapes, LMCache) and back-pressure it asked for (its
    /// saturation deadline first, in this line).
    signals: Signals,
    // The rest.
    config: WorkerConfig,
    /// The normalised URL as a shared string: metric label and log field.
    label: Arc<str>,
    /// xxh3-64 of its key (tells this worker from a later one given the same id).
    key_hash: u64,
    /// Told when one of its in-flight slots frees; shared by the pool's workers, so a
    /// request queued for any slot (`proxy.queue`) wakes (see [`super::Pool::slot_freed`]).
    pub(super) freed: Arc<tokio::sync::Notify>,
    /// A health probe has answered since it joined: until then it is routable (so a
    /// fresh router serves at once) but not counted healthy by `/health`.
    probed: AtomicBool,
    /// One lock for the whole state machine: a transition is one step.
    breaker: Mutex<CircuitBreaker>,
    /// Consecutive probe results, owned by the health-check task.
    probes: Mutex<ProbeRun>,
    /// Its KV-event feeds (precise mode), one per DP rank in rank order; empty
    /// without `kv_events`.
    feeds: Vec<Arc<Feed>>,
    /// Prefill queued by the router there, and the learned prefill speed.
    prefill: Prefill,
    /// Available / predicted / delivered prefix tokens of its answers, and the drift.
    hits: super::hits::HitStats,
    /// Its idle keep-alive connections (`proxy.pool_idle_timeout_secs`).
    keep_alive: super::keep_alive::KeepAlive,
    /// What it serves (`super::models`): pinned, or its list as last read.
    served: arc_swap::ArcSwap<super::models::Served>,
    /// The LoRA adapters its engine is estimated to hold (`super::adapters`).
    adapters: super::adapters::Residency,
    /// When its drain ends (`proxy.drain_secs` after it began): its streams still going
    /// then continue on another worker. `None` while it is not draining.
    drain_deadline: tokio::sync::watch::Sender<Option<Instant>>,
}

/// Consecutive health-probe results of one worker.
#[derive(Debug, Default)]
pub struct ProbeRun {
    pub successes: u32,
    pub failures: u32,
    /// Why the last probe failed (`status 503`, a connect or TLS error); `None` after a
    /// good one. Shown in `/workers`.
    pub last_error: Option<String>,
}

impl Worker {
    /// A worker with handle `id` that starts healthy, breaker closed, nothing in flight.
    pub fn new(id: WorkerId, config: WorkerConfig, breaker: &BreakerConfig) -> Self {
        let feeds = config
            .kv_events
            .as_ref()
            .map(|k| Feed::ranks(&config.url, k, now()))
            .unwrap_or_default();
        let served = super::models::Served::initial(config.models.as_deref());
        Worker {
            served: arc_swap::ArcSwap::from_pointee(served),
            adapters: super::adapters::Residency::new(config.max_lora.map(|n| n.get())),
            id,
            max_load: config.max_load.map_or(0, |m| m.get()),
            load_penalty: config.load_penalty,
            fallback: config.role == crate::config::Role::Fallback,
            cache_aware: config.cache_aware,
            draining: AtomicBool::new(false),
            drain_deadline: tokio::sync::watch::Sender::new(None),
            label: Arc::from(config.url.to_string()),
            key_hash: xxhash_rust::xxh3::xxh3_64(config.key().as_bytes()),
            feeds,
            config,
            in_flight: AtomicUsize::new(0),
            freed: Arc::default(),
            remote_in_flight: AtomicUsize::new(0),
            healthy: AtomicBool::new(true),
            probed: AtomicBool::new(false),
            breaker: Mutex::new(CircuitBreaker::new(breaker)),
            breaker_closed: AtomicBool::new(true),
            probes: Mutex::new(ProbeRun::default()),
            signals: Signals::default(),
            prefill: Prefill::default(),
            hits: Default::default(),
            keep_alive: Default::default(),
        }
    }

    /// The same worker, telling `freed` (the pool's) when a slot frees.
    pub(super) fn sharing(mut self, freed: &Arc<tokio::sync::Notify>) -> Self {
        self.freed = Arc::clone(freed);
        self
    }

    /// What its answers said of the router's prefix memory (see `pool::hits`).
    pub fn hits(&self) -> &super::hits::HitStats {
        &self.hits
    }

    /// What it serves, as last learned (one atomic load; see `pool::models`).
    pub fn served(&self) -> Arc<super::models::Served> {
        self.served.load_full()
    }

    /// The LoRA adapters its engine is estimated to hold, and its adapter counts.
    pub fn adapters(&self) -> &super::adapters::Residency {
        &self.adapters
    }

    /// Stores what it serves (the model-list reads).
    pub fn set_served(&self, served: super::models::Served) {
        self.served.store(Arc::new(served));
    }

    /// Its idle keep-alive connections, which the proxy takes and returns.
    pub fn keep_alive(&self) -> &super::keep_alive::KeepAlive {
        &self.keep_alive
    }

    /// Its engine's reported load, LMCache signal and back-pressure.
    #[inline]
    pub fn signals(&self) -> &Signals {
        &self.signals
    }

    /// Its pending prefill and learned prefill speed.
    pub fn prefill(&self) -> &Prefill {
        &self.prefill
    }

    fn breaker(&self) -> MutexGuard<'_, CircuitBreaker> {
        self.breaker.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Mirrors `b` (this worker's breaker, locked) into `breaker_closed`. A breaker
    /// enters or leaves the closed state only in `admit` or `record`, which call this;
    /// an open one turns half-open by time alone, which the locked path works out.
    fn note_breaker(&self, b: &CircuitBreaker, now: Instant) {
        self.breaker_closed
            .store(b.state(now) == breaker::State::Closed, Ordering::Relaxed);
    }

    /// Whether the breaker would admit a request at `now`: closed (one atomic load), or
    /// half-open with a probe slot free.
    #[inline]
    fn breaker_available(&self, now: Instant) -> bool {
        self.breaker_closed.load(Ordering::Relaxed) || self.breaker().is_available(now)
    }

    /// The breaker's state at `now`.
    pub fn breaker_state(&self, now: Instant) -> breaker::State {
        self.breaker().state(now)
    }

    /// Asks the breaker to admit one request; logs a transition.
    pub fn admit(&self, now: Instant) -> Option<Admission> {
        let (admission, transition) = {
            let mut b = self.breaker();
            let r = b.admit(now);
            self.note_breaker(&b, now);
            r
        };
        if let Some(t) = transition {
            tracing::info!(worker = %self.config.url, from = t.from.as_str(), to = t.to.as_str(), "circuit breaker");
        }
        admission
    }

    /// Records how an admitted request ended; logs a transition.
    pub fn record(&self, admission: Admission, outcome: Outcome, now: Instant) {
        let transition = {
            let mut b = self.breaker();
            let t = b.record(admission, outcome, now);
            self.note_breaker(&b, now);
            t
        };
        if let Some(t) = transition {
            let level_warn = t.to == breaker::State::Open;
            if level_warn {
                tracing::warn!(worker = %self.config.url, from = t.from.as_str(), to = t.to.as_str(), "circuit breaker");
            } else {
                tracing::info!(worker = %self.config.url, from = t.from.as_str(), to = t.to.as_str(), "circuit breaker");
            }
        }
    }

    /// The health-probe counters (health-check task only).
    pub fn probe_run(&self) -> MutexGuard<'_, ProbeRun> {
        self.probes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The worker's KV-event feeds, one per DP rank (`kv_events.dp_size`) in rank
    /// order; empty when it has no `kv_events`.
    pub fn feeds(&self) -> &[Arc<Feed>] {
        &self.feeds
    }

    #[inline]
    pub fn config(&self) -> &WorkerConfig {
        &self.config
    }

    /// Its stable handle in the pool.
    #[inline]
    pub fn id(&self) -> WorkerId {
        self.id
    }

    /// Its identity: `name` when configured, else the normalised URL.
    pub fn key(&self) -> &str {
        self.config.key()
    }

    /// xxh3-64 of [`Worker::key`].
    pub fn key_hash(&self) -> u64 {
        self.key_hash
    }

    /// The URL as a shared string (metric label).
    pub fn label(&self) -> &Arc<str> {
        &self.label
    }

    pub fn url(&self) -> &crate::config::WorkerUrl {
        &self.config.url
    }

    /// Requests in flight now. Relaxed: a load estimate, nothing else is published
    /// through this counter.
    #[inline]
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Requests the other router replicas have in flight here, as they last published.
    #[inline]
    pub fn remote_in_flight(&self) -> usize {
        self.remote_in_flight.load(Ordering::Relaxed)
    }

    /// Sets [`Worker::remote_in_flight`] (the fleet task, from the replicas' shares).
    pub fn set_remote_in_flight(&self, n: usize) {
        self.remote_in_flight.store(n, Ordering::Relaxed);
    }

    /// In-flight count (this replica's and the others') plus the configured penalty:
    /// what load comparisons use.
    #[inline]
    pub fn load(&self) -> usize {
        self.in_flight() + self.remote_in_flight() + self.config.load_penalty as usize
    }

    /// What a decision reads of it at `now`, each counter once: `(routable, load)`, i.e.
    /// [`Worker::is_routable`] and [`Worker::load`] (every request reads this for every
    /// worker in the pool).
    #[inline]
    pub fn routing_state(&self, now: Instant) -> (bool, usize) {
        let in_flight = self.in_flight() + self.remote_in_flight();
        let routable = self.is_healthy()
            && !self.draining.load(Ordering::Relaxed)
            && (self.max_load == 0 || in_flight < self.max_load)
            && self.breaker_available(now);
        (routable, in_flight + self.load_penalty as usize)
    }

    /// `role: fallback`: used only when no primary worker is usable.
    #[inline]
    pub fn is_fallback(&self) -> bool {
        self.fallback
    }

    /// `cache_aware` (its config's): whether prefix affinity applies to it.
    #[inline]
    pub fn is_cache_aware(&self) -> bool {
        self.cache_aware
    }

    #[inline]
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Sets health; returns whether it changed (the caller logs the transition).
    pub fn set_healthy(&self, healthy: bool) -> bool {
        self.healthy.swap(healthy, Ordering::Relaxed) != healthy
    }

    /// Whether a health probe has answered since it joined (see [`super::health`]).
    pub fn is_probed(&self) -> bool {
        self.probed.load(Ordering::Relaxed)
    }

    /// Records that a probe answered (the health task's).
    pub fn set_probed(&self) {
        self.probed.store(true, Ordering::Relaxed);
    }

    /// Healthy by a probe's answer: what `/health` counts.
    pub fn is_known_healthy(&self) -> bool {
        self.is_probed() && self.is_healthy()
    }

    /// Whether another request may be sent at `now`: healthy, breaker admitting, and
    /// under `max_load`.
    #[inline]
    pub fn is_routable(&self, now: Instant) -> bool {
        self.routing_state(now).0
    }

    /// Whether the only thing keeping a request off it at `now` is `max_load`: healthy,
    /// breaker admitting, every slot taken (a request may wait for one).
    pub fn is_full(&self, now: Instant) -> bool {
        self.is_healthy()
            && !self.is_draining()
            && !self.has_capacity()
            && self.breaker_available(now)
    }

    /// Whether it is draining: removed from the pool, or marked so by the admin API.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Starts its drain: no new request is sent to it, and its streams still going at
    /// `deadline` continue on another worker ([`Worker::drained`]). A drain already
    /// under way keeps the earlier deadline. Returns whether it was not draining.
    pub fn drain(&self, deadline: Instant) -> bool {
        let was = self.draining.swap(true, Ordering::Relaxed);
        self.drain_deadline.send_if_modified(|d| match d {
            Some(at) if *at <= deadline => false,
            _ => {
                *d = Some(deadline);
                true
            }
        });
        !was
    }

    /// Ends a drain the admin API began: it takes requests again. Returns whether it was
    /// draining.
    pub fn undrain(&self) -> bool {
        self.drain_deadline.send_replace(None);
        self.draining.swap(false, Ordering::Relaxed)
    }

    /// Resolves when its drain deadline passes (never while it is not draining; a drain
    /// ended by [`Worker::undrain`] before its deadline does not resolve it). A stream
    /// that can continue elsewhere waits on this beside its body.
    pub fn drained(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.drain_deadline.subscribe();
        async move {
            loop {
                let Ok(Some(at)) = rx.wait_for(Option::is_some).await.map(|d| *d) else {
                    // The worker is gone: its drain never ends.
                    return std::future::pending().await;
                };
                tokio::select! {
                    // Its deadline, unless it changed meanwhile (undrained, or sooner).
                    _ = tokio::time::sleep_until(at.into()) => {
                        if *rx.borrow() == Some(at) {
                            return;
                        }
                    }
                    changed = rx.changed() => {
                        if changed.is_err() {
                            return std::future::pending().await;
                        }
                    }
                }
            }
        }
    }

    #[inline]
    pub(super) fn has_capacity(&self) -> bool {
        self.config
            .max_load
            .is_none_or(|max| self.in_flight() + self.remote_in_flight() < max.get())
    }
}

/// A worker on a closed loopback port, for tests: `max_load` slots (none: unbounded),
/// `breaker` as given.
#[cfg(test)]
pub(crate) fn for_test(max_load: Option<usize>, breaker: &BreakerConfig) -> Worker {
    Worker::new(
        WorkerId(0),
        WorkerConfig {
            url: crate::config::WorkerUrl::parse("http://127.0.0.1:1").unwrap(),
            max_load: max_load.and_then(std::num::NonZeroUsize::new),
            load_penalty: 0,
            cache_aware: true,
            api_key: None,
            kv_events: None,
            lmcache: None,
            name: None,
            role: Default::default(),
            models: None,
            max_lora: None,
            phase: Default::default(),
            bootstrap_port: None,
        },
        breaker,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routable_follows_the_breaker_through_open_half_open_and_closed() {
        let w = for_test(
            None,
            &BreakerConfig {
                failure_threshold: 2,
                timeout: std::time::Duration::from_secs(10),
                success_threshold: 1,
            },
        );
        let t0 = now();
        assert!(w.is_routable(t0));
        for _ in 0..2 {
            let a = w.admit(t0).expect("closed admits");
            w.record(a, Outcome::Failure, t0);
        }
        assert!(!w.is_routable(t0), "open after two failures");
        let later = t0 + std::time::Duration::from_secs(11);
        assert!(
            w.is_routable(later),
            "half-open after the timeout: a probe may go"
        );
        let probe = w.admit(later).expect("a probe slot");
        assert!(!w.is_routable(later), "its one probe slot is taken");
        w.record(probe, Outcome::Success, later);
        assert!(w.is_routable(later), "closed again");
        assert_eq!(w.breaker_state(later), breaker::State::Closed);
    }

    #[tokio::test(start_paused = true)]
    async fn a_draining_worker_takes_nothing_and_its_drain_ends_at_its_deadline() {
        use std::time::Duration;
        let w = for_test(None, &BreakerConfig::default());
        let mut drained = Box::pin(w.drained());
        fn soon(f: &mut std::pin::Pin<Box<impl std::future::Future<Output = ()>>>) -> bool {
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            f.as_mut().poll(&mut cx).is_ready()
        }
        assert!(w.is_routable(now()) && !w.is_draining());
        assert!(w.drain(now() + Duration::from_secs(5)));
        assert!(!w.is_routable(now()) && w.is_draining());
        assert!(
            !w.drain(now() + Duration::from_secs(60)),
            "the earlier deadline stays"
        );
        tokio::time::sleep(Duration::from_secs(4)).await;
        assert!(!soon(&mut drained));
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(soon(&mut drained), "past its deadline");
        // Undrained before its deadline: it never resolves.
        let w = for_test(None, &BreakerConfig::default());
        let mut drained = Box::pin(w.drained());
        w.drain(now() + Duration::from_secs(1));
        assert!(!soon(&mut drained));
        assert!(w.undrain());
        assert!(w.is_routable(now()));
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(!soon(&mut drained));
    }

    #[test]
    fn the_routing_state_is_health_capacity_and_breaker_with_the_load() {
        let w = for_test(
            Some(2),
            &BreakerConfig {
                failure_threshold: 1,
                timeout: std::time::Duration::from_secs(10),
                success_threshold: 1,
            },
        );
        let t0 = now();
        assert_eq!(w.routing_state(t0), (true, 0));
        w.in_flight.store(1, Ordering::Relaxed);
        assert_eq!(w.routing_state(t0), (true, 1), "one of two slots taken");
        w.set_remote_in_flight(1);
        assert_eq!(
            w.routing_state(t0),
            (false, 2),
            "full: 1 here and 1 elsewhere of 2"
        );
        assert_eq!(w.load(), 2);
        w.set_remote_in_flight(0);
        w.set_healthy(false);
        assert_eq!(w.routing_state(t0), (false, 1), "unhealthy");
        w.set_healthy(true);
        let a = w.admit(t0).expect("closed admits");
        w.record(a, Outcome::Failure, t0);
        assert_eq!(w.routing_state(t0), (false, 1), "breaker open");
    }
}

#[cfg(test)]
mod layout {
    use super::Worker;
    use std::mem::offset_of;

    #[test]
    fn what_every_decision_reads_is_in_the_first_cache_line() {
        assert_eq!(std::mem::align_of::<Worker>(), 64);
        let ends = [
            offset_of!(Worker, in_flight) + 8,
            offset_of!(Worker, remote_in_flight) + 8,
            offset_of!(Worker, max_load) + 8,
            offset_of!(Worker, id) + 4,
            offset_of!(Worker, load_penalty) + 4,
            offset_of!(Worker, healthy) + 1,
            offset_of!(Worker, breaker_closed) + 1,
            offset_of!(Worker, fallback) + 1,
            offset_of!(Worker, cache_aware) + 1,
            offset_of!(Worker, signals) + super::Signals::HOT_BYTES,
        ];
        assert!(ends.iter().all(|&e| e <= 64), "{ends:?}");
    }
}

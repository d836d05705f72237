//! Admission: whether a request may try for a worker's slot now, or waits in the queue
//! ([`super::queue`]) for one; the classes' bounds, `priority.reserve` and
//! pre-emption.
//!
//! A request goes straight to the pick when nobody of its class or a more urgent one
//! waits (one atomic read when nobody waits at all) and its class may take capacity.
//! Otherwise, when every usable worker is merely full or its class's capacity is held
//! for others, it takes a [`Place`] and waits: for a grant (a freed slot the queue hands
//! it in order), for its class's `timeout_ms`, or until a more urgent request takes its
//! place. Every waiter also listens to the pool's slot-freed signal and relays each one
//! to the queue, which counts the workers' free slots afresh and grants that many
//! waiters (less those already granted), so no task of its own runs the queue.
//!
//! The lock is a `std::sync::Mutex` held for a few list operations and never across an
//! await; waiters are woken after it is released.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::Ticket;
use super::metrics::{FlowMetrics, QueueMetrics};
use super::queue::{Entry, Queue, State, Waiter};
use crate::config::{Config, OnPreempt};
use crate::pools::pool::Pool;

/// How many times one request is pre-empted and sent again before it is answered 503.
pub const MAX_REQUEUES: u8 = 3;

/// Why the queue refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No room: `proxy.queue.max_waiting` requests wait, none less urgent and none of
    /// a tenant with more tokens waiting in its class; or such a request took this
    /// one's place (`evicted`).
    Full { max: usize, evicted: bool },
    /// Its class's `proxy.queue.per_class.<class>.max_waiting` requests wait.
    ClassFull { max: usize },
    /// It waited its class's whole time-out.
    Timeout { waited: Duration },
}

impl Refusal {
    /// The `queue_rejected_total` cause.
    pub fn cause(&self) -> &'static str {
        match self {
            Refusal::Full { .. } => "full",
            Refusal::ClassFull { .. } => "class_full",
            Refusal::Timeout { .. } => "timeout",
        }
    }
}

/// One class's bounds.
#[derive(Debug, Clone, Copy)]
pub struct ClassRule {
    pub max_waiting: usize,
    pub timeout: Duration,
    /// Set by `proxy.queue.per_class` (else the queue's own).
    pub own: bool,
}

/// `priority.reserve`: shares of the slots held per class, and each class's requests in
/// flight (counted by their in-flight guards).
#[derive(Debug)]
struct Reserve {
    shares: Vec<f64>,
    in_flight: Vec<Arc<AtomicUsize>>,
}

/// `priority.preempt`: the requests of the last class that may be cancelled now (sent,
/// no answer yet), newest last.
#[derive(Debug)]
struct Preemption {
    last: u8,
    on_preempt: OnPreempt,
    running: Mutex<Vec<(u64, Ticket, Arc<tokio::sync::Notify>)>>,
}

/// See the module docs.
#[derive(Debug)]
pub struct Admission {
    queue: Mutex<Queue>,
    /// Requests waiting or granted, all classes: 0 = nobody ahead of anyone.
    busy: AtomicUsize,
    rules: Vec<ClassRule>,
    /// `proxy.queue.max_waiting`.
    max_waiting: usize,
    reserve: Option<Reserve>,
    preempt: Option<Preemption>,
    next_id: AtomicU64,
    metrics: QueueMetrics,
    /// Per class and tenant (flow control on).
    tickets: Option<FlowMetrics>,
    /// The workers whose slots the queue hands out (all of them).
    pool: Workers,
}

/// The membership, for counting free slots (not shown by `Debug`).
struct Workers(Arc<Pool>);

impl std::fmt::Debug for Workers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Workers(..)")
    }
}

impl Admission {
    /// The queue for `classes` classes and tenants of `weights` (one and `[1]` with
    /// flow control off), bounded as `proxy.queue` says, sharing `pool`'s slots.
    pub fn new(
        config: &Config,
        classes: usize,
        weights: &[u32],
        pool: &Arc<Pool>,
        metrics: QueueMetrics,
        tickets: Option<FlowMetrics>,
    ) -> Self {
        let q = &config.proxy.queue;
        let p = &config.priority;
        let rules = (0..classes)
            .map(|c| {
                let own = p
                    .classes
                    .get(c)
                    .and_then(|name| q.per_class.iter().find(|(n, _)| n == name));
                match own {
                    Some((_, b)) if classes > 1 => ClassRule {
                        max_waiting: b.max_waiting,
                        timeout: b.timeout,
                        own: true,
                    },
                    _ => ClassRule {
                        max_waiting: q.max_waiting,
                        timeout: q.timeout,
                        own: false,
                    },
                }
            })
            .collect();
        let reserve = (classes > 1 && p.reserve.iter().any(|s| *s > 0.0)).then(|| Reserve {
            shares: p.reserve.clone(),
            in_flight: (0..classes).map(|_| Arc::default()).collect(),
        });
        let preempt = (classes > 1 && p.preempt).then(|| Preemption {
            last: (classes - 1) as u8,
            on_preempt: p.on_preempt,
            running: Mutex::default(),
        });
        Admission {
            queue: Mutex::new(Queue::new(classes, weights)),
            busy: AtomicUsize::new(0),
            rules,
            max_waiting: q.max_waiting,
            reserve,
            preempt,
            next_id: AtomicU64::new(1),
            metrics,
            tickets,
            pool: Workers(Arc::clone(pool)),
        }
    }

    /// Slots free now on the usable workers (one without `max_load` counts as many as
    /// could want one).
    fn free_slots(&self) -> usize {
        let now = crate::pools::pool::now();
        let set = self.pool.0.set();
        set.workers()
            .iter()
            .filter(|w| w.is_routable(now))
            .map(|w| match w.config().max_load {
                Some(max) => max
                    .get()
                    .saturating_sub(w.in_flight() + w.remote_in_flight()),
                None => self.max_waiting.max(1),
            })
            .fold(0usize, usize::saturating_add)
    }

    /// The per class and tenant families, when flow control is on.
    pub fn tickets(&self) -> Option<&FlowMetrics> {
        self.tickets.as_ref()
    }

    /// A request of `ticket` took a slot (straight away, or after waiting).
    pub fn admitted(&self, ticket: Ticket) {
        if let Some(m) = &self.tickets {
            m.admitted(ticket.class, ticket.tenant);
        }
    }

    /// Requests waiting now, by class then tenant.
    pub fn depths(&self) -> Vec<Vec<usize>> {
        let q = self.lock();
        (0..self.rules.len())
            .map(|c| (0..q.tenants()).map(|t| q.waiting_of(c, t)).collect())
            .collect()
    }

    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Ends a change to the queue: the fast path's count and the gauge follow it, and
    /// those `granted` are told (after the lock is released).
    fn settle(&self, q: MutexGuard<'_, Queue>, granted: Vec<Arc<Waiter>>) {
        self.busy.store(q.busy(), Ordering::Relaxed);
        self.metrics.set_waiting(q.waiting());
        drop(q);
        for w in granted {
            w.notify.notify_one();
        }
    }

    /// Hands the queue's credits out (see [`Queue::dispatch`]).
    fn dispatch(&self, q: &mut Queue) -> Vec<Arc<Waiter>> {
        q.dispatch(|c| self.reserve_allows(c))
    }

    /// Whether a request of `class` must wait rather than try for a slot: others of its
    /// class or a more urgent one are ahead of it, or its class's capacity is held.
    pub fn must_wait(&self, class: u8) -> bool {
        // Relaxed: a hint; a request that reads a stale 0 tries for a slot, as one that
        // arrived a moment earlier would have.
        (self.busy.load(Ordering::Relaxed) > 0 && self.lock().ahead_of(class as usize))
            || !self.reserve_allows(class as usize)
    }

    /// `proxy.queue.max_waiting`.
    pub fn max_waiting(&self) -> usize {
        self.max_waiting
    }

    /// The bounds of `class`.
    pub fn rule(&self, class: u8) -> ClassRule {
        self.rules[class as usize]
    }

    /// Whether requests of `class` may wait at all (`max_waiting` > 0 for it).
    pub fn queues(&self, class: u8) -> bool {
        self.max_waiting > 0 && self.rules[class as usize].max_waiting > 0
    }

    /// The count a request of `class` is in while it holds a slot (`priority.reserve`
    /// only).
    pub fn class_count(&self, class: u8) -> Option<&Arc<AtomicUsize>> {
        self.reserve.as_ref().map(|r| &r.in_flight[class as usize])
    }

    /// `priority.reserve`: whether `class` may take a slot now: the free slots are more
    /// than the other classes' reserved shares they do not use. Always true without
    /// reserves, or while some healthy worker has no `max_load`.
    pub fn reserve_allows(&self, class: usize) -> bool {
        let Some(r) = &self.reserve else {
            return true;
        };
        let set = self.pool.0.set();
        let (mut cap, mut used) = (0usize, 0usize);
        for w in set.workers().iter().filter(|w| w.is_healthy()) {
            let Some(max) = w.config().max_load else {
                return true;
            };
            cap += max.get();
            used += w.in_flight() + w.remote_in_flight();
        }
        let held: usize = (0..r.shares.len())
            .filter(|&d| d != class)
            .map(|d| {
                let share = (r.shares[d] * cap as f64).ceil() as usize;
                share.saturating_sub(r.in_flight[d].load(Ordering::Relaxed))
            })
            .sum();
        cap.saturating_sub(used) > held
    }

    /// Takes a place in the queue for a request with `ticket` and `cost` prompt tokens
    /// that can use the workers of `pool` (an address naming its worker set); at the head
    /// of its queue when `front` (a pre-empted request sent again). When the queue is
    /// full, the newest request of the least urgent class below this one's is shed to
    /// make room (told, 429); with none, this one is refused.
    pub fn enter(
        &self,
        ticket: Ticket,
        cost: u64,
        pool: usize,
        front: bool,
    ) -> Result<Place<'_>, Refusal> {
        let class = ticket.class as usize;
        let rule = self.rules[class];
        let mut q = self.lock();
        let mut shed = Vec::new();
        if rule.own && q.waiting_in(class) >= rule.max_waiting {
            drop(q);
            return Err(self.refuse(
                ticket,
                Refusal::ClassFull {
                    max: rule.max_waiting,
                },
            ));
        }
        if q.waiting() >= self.max_waiting {
            let displaced = q
                .shed_below(class)
                .or_else(|| q.shed_within(class, ticket.tenant as usize, cost));
            match displaced {
                Some((c, t, e)) => {
                    self.metrics.rejected("full");
                    if let Some(m) = &self.tickets {
                        m.shed(c as u8, t as u16, "queue_full");
                    }
                    shed.push(e.waiter);
                }
                None => {
                    drop(q);
                    let full = Refusal::Full {
                        max: self.max_waiting,
                        evicted: false,
                    };
                    return Err(self.refuse(ticket, full));
                }
            }
        }
        let waiter: Arc<Waiter> = Arc::default();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let entry = Entry {
            id,
            cost,
            pool,
            waiter: Arc::clone(&waiter),
        };
        q.push(class, ticket.tenant as usize, entry, front);
        self.settle(q, shed);
        let since = Instant::now();
        Ok(Place {
            adm: self,
            ticket,
            id,
            cost,
            pool,
            waiter,
            since,
            deadline: since + rule.timeout,
            done: false,
        })
    }

    /// Counts a refusal of a request of `ticket`.
    fn refuse(&self, ticket: Ticket, r: Refusal) -> Refusal {
        self.metrics.rejected(r.cause());
        if let Some(m) = &self.tickets {
            let reason = match r {
                Refusal::Full { .. } => "queue_full",
                Refusal::ClassFull { .. } => "class_full",
                Refusal::Timeout { .. } => "timeout",
            };
            m.shed(ticket.class, ticket.tenant, reason);
        }
        r
    }

    /// `priority.preempt`: a request of `ticket`'s class registers as one that may be
    /// cancelled until the first byte of its worker's answer (the last class only).
    pub fn preemptible(&self, ticket: Ticket) -> Option<Preemptible<'_>> {
        let p = self.preempt.as_ref().filter(|p| ticket.class == p.last)?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let notify = Arc::new(tokio::sync::Notify::new());
        lock(&p.running).push((id, ticket, Arc::clone(&notify)));
        Some(Preemptible {
            running: &p.running,
            id,
            notify,
        })
    }

    /// Whether requests of `class` may be pre-empted (`priority.preempt`, the last
    /// class).
    pub fn is_preemptible(&self, class: u8) -> bool {
        self.preempt.as_ref().is_some_and(|p| class == p.last)
    }

    /// A request of the first class found no slot: cancels the newest pre-emptible
    /// request, if any (its slot frees when its attempt ends). Whether one was.
    pub fn preempt_for(&self, ticket: Ticket) -> bool {
        let Some(p) = self.preempt.as_ref().filter(|_| ticket.class == 0) else {
            return false;
        };
        let victim = lock(&p.running).pop();
        match victim {
            Some((_, t, n)) => {
                n.notify_one();
                if let Some(m) = &self.tickets {
                    m.preempted(t.class, t.tenant);
                }
                true
            }
            None => false,
        }
    }

    /// Whether a pre-empted request goes back to the queue (else 503).
    pub fn requeues(&self) -> bool {
        self.preempt
            .as_ref()
            .is_some_and(|p| p.on_preempt == OnPreempt::Requeue)
    }

    /// A worker may have room while others wait: the next waiters try for each free
    /// slot no granted waiter is already about to take.
    pub fn room_left(&self) {
        if self.busy.load(Ordering::Relaxed) == 0 {
            return;
        }
        let free = self.free_slots();
        let mut q = self.lock();
        q.refill(free);
        let granted = self.dispatch(&mut q);
        self.settle(q, granted);
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A request that may be pre-empted, registered until dropped.
#[derive(Debug)]
pub struct Preemptible<'a> {
    running: &'a Mutex<Vec<(u64, Ticket, Arc<tokio::sync::Notify>)>>,
    id: u64,
    notify: Arc<tokio::sync::Notify>,
}

impl Preemptible<'_> {
    /// Resolves when a more urgent request pre-empts this one.
    pub async fn preempted(&self) {
        self.notify.notified().await
    }
}

impl Drop for Preemptible<'_> {
    fn drop(&mut self) {
        let mut running = lock(self.running);
        if let Some(i) = running.iter().position(|(id, ..)| *id == self.id) {
            // In order: the newest is pre-empted first.
            running.remove(i);
        }
    }
}

/// What woke a waiting request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// Its own state changed (granted, shed).
    Told,
    /// The pool freed a slot: to be relayed ([`Place::relay_freed`]).
    Freed,
    /// Its class's time-out passed.
    TimedOut,
}

/// A request's place in the queue, from [`Admission::enter`] until it is admitted or
/// refused; dropped early (its client gone), it leaves, giving back a grant it held.
#[derive(Debug)]
pub struct Place<'a> {
    adm: &'a Admission,
    ticket: Ticket,
    id: u64,
    cost: u64,
    pool: usize,
    waiter: Arc<Waiter>,
    since: Instant,
    deadline: Instant,
    done: bool,
}

impl Place<'_> {
    pub fn state(&self) -> State {
        self.waiter.state()
    }

    /// Waits for its state to change, a freed slot (`freed`, the pool's signal,
    /// registered before the caller last looked), or its deadline.
    pub async fn wait(
        &self,
        freed: std::pin::Pin<&mut tokio::sync::futures::Notified<'_>>,
    ) -> Wake {
        tokio::select! {
            biased;
            _ = self.waiter.notify.notified() => Wake::Told,
            _ = freed => Wake::Freed,
            _ = tokio::time::sleep_until(self.deadline.into()) => Wake::TimedOut,
        }
    }

    /// Relays a freed slot to the queue: its free slots, handed to the next waiters in
    /// order.
    pub fn relay_freed(&self) {
        let free = self.adm.free_slots();
        let mut q = self.adm.lock();
        q.freed(free);
        let granted = self.adm.dispatch(&mut q);
        self.adm.settle(q, granted);
    }

    /// Granted, it found no slot: back to the head of its queue (see
    /// [`Queue::failed`]).
    pub fn no_slot(&self) {
        let free = self.adm.free_slots();
        let mut q = self.adm.lock();
        if self.waiter.state() != State::Granted {
            return;
        }
        let e = Entry {
            id: self.id,
            cost: self.cost,
            pool: self.pool,
            waiter: Arc::clone(&self.waiter),
        };
        q.failed(self.ticket.class as usize, self.ticket.tenant as usize, e);
        q.refill(free);
        let granted = self.adm.dispatch(&mut q);
        self.adm.settle(q, granted);
    }

    /// Granted, it took a slot: its wait ends.
    pub fn admitted(mut self) {
        self.done = true;
        let mut q = self.adm.lock();
        q.resolved(self.ticket.class as usize);
        self.adm.settle(q, Vec::new());
        let took = self.since.elapsed();
        self.adm.metrics.waited(took);
        if let Some(m) = &self.adm.tickets {
            m.waited(self.ticket.class, self.ticket.tenant, took);
        }
    }

    /// Why it was refused, now that it was shed ([`State::Shed`]) or its time ran out;
    /// counted.
    pub fn refused(&self, timed_out: bool) -> Refusal {
        if timed_out {
            let waited = self.since.elapsed();
            self.adm.refuse(self.ticket, Refusal::Timeout { waited })
        } else {
            // Counted when it was shed.
            Refusal::Full {
                max: self.adm.max_waiting,
                evicted: true,
            }
        }
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let (class, tenant) = (self.ticket.class as usize, self.ticket.tenant as usize);
        let free = match self.waiter.state() {
            State::Granted => self.adm.free_slots(),
            _ => 0,
        };
        let mut q = self.adm.lock();
        let granted = match self.waiter.state() {
            State::Waiting => {
                q.remove(class, tenant, self.id);
                Vec::new()
            }
            // Its right to try goes to the next waiter.
            State::Granted => {
                q.resolved(class);
                q.refill(free);
                self.adm.dispatch(&mut q)
            }
            State::Shed => Vec::new(),
        };
        self.adm.settle(q, granted);
    }
}

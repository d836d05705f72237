//! The admission queue's state: one queue per (class, tenant). Plain data under the
//! admission's lock ([`super::admission`]): no runtime, no time, tested as functions.
//!
//! Order: strict across classes (a waiting request of a more urgent class always goes
//! first, unless the class may not take the capacity left: `priority.reserve`); within a
//! class, tenants share by deficit round robin counted in prompt tokens (M. Shreedhar
//! and G. Varghese, "Efficient fair queuing using deficit round robin", SIGCOMM 1995):
//! each tenant with requests waiting is visited in turn and earns `weight` ×
//! [`QUANTUM`] tokens per visit; its oldest request goes once its earnings cover that
//! request's tokens. A heavy tenant thus gets the same tokens per round as a light one
//! of the same weight, however many requests it queues. One tenant, one class: FIFO.
//!
//! Each free slot no granted waiter is about to take is a **credit** (counted afresh from
//! the workers whenever a slot frees, never accumulated, so one slot is never offered
//! twice); each credit grants one waiter (taken out of its queue) the right to try for a
//! slot. A waiter that then finds none (another pool's worker freed it, or a request
//! from outside the queue took it) goes back to the head of its queue, and its pool is
//! passed over until the next slot frees.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

/// Tokens a tenant of weight 1 earns per visit of the round robin.
pub const QUANTUM: u64 = 512;

/// A waiter's state, written under the admission's lock, read by its task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Waiting,
    /// Taken out of the queue with the right to try for a slot.
    Granted,
    /// Taken out of the queue to make room for a more urgent class.
    Shed,
}

/// The part of a waiter its task and the queue share.
#[derive(Debug, Default)]
pub struct Waiter {
    state: AtomicU8,
    /// Told when the state changes.
    pub notify: tokio::sync::Notify,
}

impl Waiter {
    pub fn state(&self) -> State {
        // Relaxed: written and read under the admission's lock, or re-read after its
        // notify (which orders it).
        match self.state.load(Ordering::Relaxed) {
            1 => State::Granted,
            2 => State::Shed,
            _ => State::Waiting,
        }
    }

    fn set(&self, s: State) {
        let v = match s {
            State::Waiting => 0,
            State::Granted => 1,
            State::Shed => 2,
        };
        self.state.store(v, Ordering::Relaxed);
    }
}

/// One waiting request.
#[derive(Debug)]
pub struct Entry {
    pub id: u64,
    /// Its prompt tokens (estimated): what the round robin charges.
    pub cost: u64,
    /// Which workers it can use (its worker set's address): a pool whose waiter found no
    /// slot is passed over until the next slot frees.
    pub pool: usize,
    pub waiter: Arc<Waiter>,
}

#[derive(Debug, Default)]
struct TenantQueue {
    entries: VecDeque<Entry>,
    /// Tokens earned and not yet spent (deficit round robin's deficit counter).
    deficit: u64,
    /// Tokens of its waiting requests.
    queued: u64,
}

#[derive(Debug)]
struct ClassQueue {
    tenants: Vec<TenantQueue>,
    /// Tenants with requests waiting, in round-robin order; the front is being visited
    /// (it has earned this visit's quantum).
    active: VecDeque<u16>,
    waiting: usize,
    /// Granted and not yet resolved.
    granted: usize,
}

/// See the module docs.
#[derive(Debug)]
pub struct Queue {
    classes: Vec<ClassQueue>,
    /// Per tenant: `weight` × [`QUANTUM`].
    quantum: Vec<u64>,
    waiting: usize,
    credits: usize,
    /// Pools whose waiter found no slot since the last slot freed.
    failed: Vec<usize>,
}

impl Queue {
    /// An empty queue for `classes` classes and tenants of these `weights`.
    pub fn new(classes: usize, weights: &[u32]) -> Self {
        Queue {
            classes: (0..classes)
                .map(|_| ClassQueue {
                    tenants: weights.iter().map(|_| TenantQueue::default()).collect(),
                    active: VecDeque::new(),
                    waiting: 0,
                    granted: 0,
                })
                .collect(),
            quantum: weights.iter().map(|w| QUANTUM * u64::from(*w)).collect(),
            waiting: 0,
            credits: 0,
            failed: Vec::new(),
        }
    }

    /// How many tenants each class has a queue for.
    pub fn tenants(&self) -> usize {
        self.quantum.len()
    }

    /// Requests waiting in all classes.
    pub fn waiting(&self) -> usize {
        self.waiting
    }

    /// Requests waiting or granted (and not yet resolved), all classes.
    pub fn busy(&self) -> usize {
        self.waiting + self.granted()
    }

    /// Requests granted and not yet resolved, all classes.
    pub fn granted(&self) -> usize {
        self.classes.iter().map(|c| c.granted).sum()
    }

    /// Requests waiting in `class`.
    pub fn waiting_in(&self, class: usize) -> usize {
        self.classes[class].waiting
    }

    /// Requests waiting in `class` from `tenant`.
    pub fn waiting_of(&self, class: usize, tenant: usize) -> usize {
        self.classes[class].tenants[tenant].entries.len()
    }

    /// Whether a request of `class` has others ahead of it: waiting or granted in its
    /// class or a more urgent one.
    pub fn ahead_of(&self, class: usize) -> bool {
        self.classes[..=class]
            .iter()
            .any(|c| c.waiting + c.granted > 0)
    }

    /// Adds `e` to the queue of (`class`, `tenant`): at its back, or at its head when
    /// `front` (a request that was granted and found no slot, or was pre-empted).
    pub fn push(&mut self, class: usize, tenant: usize, e: Entry, front: bool) {
        e.waiter.set(State::Waiting);
        let q = self.quantum[tenant];
        let cq = &mut self.classes[class];
        let t = &mut cq.tenants[tenant];
        let was_idle = t.entries.is_empty();
        t.queued += e.cost;
        if front {
            t.entries.push_front(e);
        } else {
            t.entries.push_back(e);
        }
        cq.waiting += 1;
        self.waiting += 1;
        if was_idle {
            // A tenant that starts waiting starts with nothing earned; the one visited
            // first earns its quantum at once.
            t.deficit = if cq.active.is_empty() { q } else { 0 };
            cq.active.push_back(tenant as u16);
        }
    }

    /// Takes request `id` out of its queue (it left: timed out, its client gone).
    pub fn remove(&mut self, class: usize, tenant: usize, id: u64) -> Option<Entry> {
        let t = &mut self.classes[class].tenants[tenant];
        let at = t.entries.iter().position(|e| e.id == id)?;
        let e = t.entries.remove(at)?;
        self.took(class, tenant, &e);
        Some(e)
    }

    /// Bookkeeping of an entry taken out of (`class`, `tenant`).
    fn took(&mut self, class: usize, tenant: usize, e: &Entry) {
        let q = &self.quantum;
        let cq = &mut self.classes[class];
        cq.tenants[tenant].queued -= e.cost;
        cq.waiting -= 1;
        self.waiting -= 1;
        if cq.tenants[tenant].entries.is_empty() {
            cq.tenants[tenant].deficit = 0;
            if let Some(pos) = cq.active.iter().position(|t| *t as usize == tenant) {
                cq.active.remove(pos);
                if pos == 0
                    && let Some(&next) = cq.active.front()
                {
                    cq.tenants[next as usize].deficit += q[next as usize];
                }
            }
        }
    }

    /// Makes room for a request of `class`: sheds the newest request of the tenant
    /// with the most tokens waiting in the least urgent class less urgent than `class`
    /// (marked [`State::Shed`]). `None` when no class below `class` has a request
    /// waiting.
    pub fn shed_below(&mut self, class: usize) -> Option<(usize, usize, Entry)> {
        let c = (class + 1..self.classes.len())
            .rev()
            .find(|&c| self.classes[c].waiting > 0)?;
        let cq = &self.classes[c];
        let tenant = (0..cq.tenants.len())
            .filter(|&t| !cq.tenants[t].entries.is_empty())
            .max_by_key(|&t| cq.tenants[t].queued)?;
        let e = self.classes[c].tenants[tenant].entries.pop_back()?;
        self.took(c, tenant, &e);
        e.waiter.set(State::Shed);
        Some((c, tenant, e))
    }

    /// Makes room in a full queue for a request of `tenant` costing `cost` tokens in
    /// `class`, when nothing less urgent waits: sheds the newest request of the tenant
    /// of `class` with the most tokens waiting per unit of weight, if that is more than
    /// `tenant` would have with this request (so a tenant that fills the queue cannot
    /// keep a lighter one out of it). `None` when no other tenant holds more.
    pub fn shed_within(
        &mut self,
        class: usize,
        tenant: usize,
        cost: u64,
    ) -> Option<(usize, usize, Entry)> {
        let cq = &self.classes[class];
        // Tokens waiting per QUANTUM of the tenant's quantum (its weight).
        let load = |t: usize, more: u64| {
            u128::from(cq.tenants[t].queued + more) * u128::from(QUANTUM)
                / u128::from(self.quantum[t].max(1))
        };
        let mine = load(tenant, cost);
        let heaviest = (0..cq.tenants.len())
            .filter(|&t| t != tenant && !cq.tenants[t].entries.is_empty())
            .max_by_key(|&t| load(t, 0))
            .filter(|&t| load(t, 0) > mine)?;
        let e = self.classes[class].tenants[heaviest].entries.pop_back()?;
        self.took(class, heaviest, &e);
        e.waiter.set(State::Shed);
        Some((class, heaviest, e))
    }

    /// A slot freed, and the workers have `free` slots now: the pools passed over may
    /// try again ([`Queue::refill`]).
    pub fn freed(&mut self, free: usize) {
        self.failed.clear();
        self.refill(free);
    }

    /// The workers have `free` slots now: a credit for each one no granted waiter is
    /// about to take (never more than the waiters).
    pub fn refill(&mut self, free: usize) {
        self.credits = free.saturating_sub(self.granted()).min(self.waiting);
    }

    /// One more credit (tests: a slot freed while nothing is granted).
    #[cfg(test)]
    pub fn credit(&mut self) {
        self.credits = (self.credits + 1).min(self.waiting);
    }

    /// A granted waiter of `class` from `pool` found no slot: passed over with its pool
    /// until the next slot frees; it goes back to the head of its queue (`e`) (a
    /// [`Queue::refill`] then offers the slot to a waiter of another pool).
    pub fn failed(&mut self, class: usize, tenant: usize, e: Entry) {
        if !self.failed.contains(&e.pool) {
            self.failed.push(e.pool);
        }
        self.resolved(class);
        self.push(class, tenant, e, true);
    }

    /// A granted waiter of `class` is done with its grant (admitted, or gone).
    pub fn resolved(&mut self, class: usize) {
        let g = &mut self.classes[class].granted;
        *g = g.saturating_sub(1);
    }

    /// Hands each credit to the next waiter in order (see the module docs) whose class
    /// `allowed` says may take capacity now; returns those granted, to be told. Credits
    /// no waiter can take are dropped.
    pub fn dispatch(&mut self, allowed: impl Fn(usize) -> bool) -> Vec<Arc<Waiter>> {
        let mut granted = Vec::new();
        while self.credits > 0 {
            let mut next = None;
            for c in 0..self.classes.len() {
                if self.classes[c].waiting > 0
                    && allowed(c)
                    && let Some(e) = self.take(c)
                {
                    next = Some((c, e));
                    break;
                }
            }
            let Some((class, e)) = next else {
                self.credits = 0;
                break;
            };
            self.credits -= 1;
            self.classes[class].granted += 1;
            e.waiter.set(State::Granted);
            granted.push(e.waiter);
        }
        granted
    }

    /// The next request of `class` by deficit round robin, taken out of its queue and
    /// charged; a pool passed over is skipped (its tenant's head then goes by order
    /// alone, uncharged: the rare case of several pools).
    fn take(&mut self, class: usize) -> Option<Entry> {
        let cq = &self.classes[class];
        let n = cq.active.len();
        // The step of the round robin at which each active tenant's head would go:
        // the front (mid-visit) at once if it has earned enough, else after j more
        // rounds; position p > 0 at its next visit (step p) or j - 1 rounds after.
        let mut best: Option<(u64, usize)> = None;
        for (pos, &t) in cq.active.iter().enumerate() {
            let tq = &cq.tenants[t as usize];
            let head = tq.entries.front()?;
            let q = self.quantum[t as usize].max(1);
            let j = head.cost.saturating_sub(tq.deficit).div_ceil(q);
            let step = if pos == 0 {
                j * n as u64
            } else {
                pos as u64 + j.max(1).saturating_sub(1) * n as u64
            };
            if best.is_none_or(|(s, _)| step < s) {
                best = Some((step, pos));
            }
        }
        let (step, pos) = best?;
        let t = cq.active[pos] as usize;
        if self.failed.is_empty() || !self.is_passed(class, t) {
            return Some(self.charge(class, step));
        }
        let t = cq
            .active
            .iter()
            .map(|&t| t as usize)
            .find(|&t| !self.is_passed(class, t))?;
        let e = self.classes[class].tenants[t].entries.pop_front()?;
        self.took(class, t, &e);
        Some(e)
    }

    /// Whether the head of (`class`, `tenant`) is from a pool passed over.
    fn is_passed(&self, class: usize, tenant: usize) -> bool {
        self.classes[class].tenants[tenant]
            .entries
            .front()
            .is_some_and(|e| self.failed.contains(&e.pool))
    }

    /// Runs the round robin of `class` `step` steps on: every tenant earns the quanta
    /// of its visits, the one visited at the last step goes to the front, and its head
    /// is taken and charged.
    fn charge(&mut self, class: usize, step: u64) -> Entry {
        let quantum = &self.quantum;
        let cq = &mut self.classes[class];
        let n = cq.active.len() as u64;
        for (pos, &t) in cq.active.iter().enumerate() {
            let pos = pos as u64;
            let visits = if pos == 0 {
                step / n
            } else if step >= pos {
                (step - pos) / n + 1
            } else {
                0
            };
            cq.tenants[t as usize].deficit += visits * quantum[t as usize];
        }
        cq.active.rotate_left((step % n) as usize);
        let t = cq.active[0] as usize;
        let tq = &mut cq.tenants[t];
        let e = tq
            .entries
            .pop_front()
            .expect("an active tenant has a request waiting");
        tq.deficit = tq.deficit.saturating_sub(e.cost);
        self.took(class, t, &e);
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: u64, cost: u64) -> Entry {
        Entry {
            id,
            cost,
            pool: 0,
            waiter: Arc::default(),
        }
    }

    /// Grants one credit at a time until the queue is empty; the ids in grant order.
    fn drain(q: &mut Queue) -> Vec<u64> {
        let mut ids = Vec::new();
        loop {
            q.credit();
            let before = q.waiting();
            let granted = q.dispatch(|_| true);
            if granted.is_empty() {
                return ids;
            }
            // The grant order by id: the entry left the queue; find it by elimination.
            assert_eq!(q.waiting(), before - 1);
            ids.push(Arc::as_ptr(&granted[0]) as u64);
        }
    }

    #[test]
    fn one_class_and_one_tenant_is_fifo() {
        let mut q = Queue::new(1, &[1]);
        let waiters: Vec<Arc<Waiter>> = (0..5).map(|_| Arc::default()).collect();
        for (i, w) in waiters.iter().enumerate() {
            q.push(
                0,
                0,
                Entry {
                    id: i as u64,
                    cost: 100 * (5 - i as u64),
                    pool: 0,
                    waiter: Arc::clone(w),
                },
                false,
            );
        }
        let order: Vec<usize> = drain(&mut q)
            .into_iter()
            .map(|p| {
                waiters
                    .iter()
                    .position(|w| Arc::as_ptr(w) as u64 == p)
                    .unwrap()
            })
            .collect();
        assert_eq!(order, [0, 1, 2, 3, 4]);
        assert!(waiters.iter().all(|w| w.state() == State::Granted));
    }

    #[test]
    fn classes_go_in_strict_order_and_reserve_can_hold_one_back() {
        let mut q = Queue::new(3, &[1]);
        let w: Vec<Arc<Waiter>> = (0..3).map(|_| Arc::default()).collect();
        for (class, w) in [2, 0, 1].into_iter().zip(&w) {
            let e = Entry {
                id: class as u64,
                cost: 10,
                pool: 0,
                waiter: Arc::clone(w),
            };
            q.push(class, 0, e, false);
        }
        assert!(q.ahead_of(0) && q.ahead_of(2));
        q.credit();
        // Class 0 may not take capacity now: class 1 goes.
        let g = q.dispatch(|c| c != 0);
        assert!(Arc::ptr_eq(&g[0], &w[2]));
        q.credit();
        assert!(Arc::ptr_eq(&q.dispatch(|_| true)[0], &w[1]));
        q.credit();
        assert!(Arc::ptr_eq(&q.dispatch(|_| true)[0], &w[0]));
    }

    #[test]
    fn tenants_share_a_class_by_tokens_not_requests() {
        // Tenant 0 queues 100 requests of 1000 tokens, tenant 1 of 100 tokens: while
        // both wait, each is granted about the same tokens.
        let mut q = Queue::new(1, &[1, 1]);
        let mut owner = std::collections::HashMap::new();
        for i in 0..100 {
            for (tenant, cost) in [(0usize, 1000u64), (1, 100)] {
                let w: Arc<Waiter> = Arc::default();
                owner.insert(Arc::as_ptr(&w) as u64, (tenant, cost));
                q.push(
                    0,
                    tenant,
                    Entry {
                        id: i,
                        cost,
                        pool: 0,
                        waiter: w,
                    },
                    false,
                );
            }
        }
        let mut tokens = [0u64; 2];
        for p in drain(&mut q).into_iter().take(60) {
            let (t, c) = owner[&p];
            tokens[t] += c;
        }
        let (heavy, light) = (tokens[0] as f64, tokens[1] as f64);
        assert!((heavy / light - 1.0).abs() < 0.35, "{tokens:?}");
    }

    #[test]
    fn weights_scale_a_tenants_share() {
        let mut q = Queue::new(1, &[3, 1]);
        let mut owner = std::collections::HashMap::new();
        for i in 0..200 {
            for tenant in 0..2usize {
                let w: Arc<Waiter> = Arc::default();
                owner.insert(Arc::as_ptr(&w) as u64, tenant);
                q.push(
                    0,
                    tenant,
                    Entry {
                        id: i,
                        cost: 200,
                        pool: 0,
                        waiter: w,
                    },
                    false,
                );
            }
        }
        let mut n = [0u32; 2];
        for p in drain(&mut q).into_iter().take(100) {
            n[owner[&p]] += 1;
        }
        assert!((70..=80).contains(&n[0]), "{n:?}");
    }

    #[test]
    fn shedding_takes_the_heaviest_tenants_newest_in_the_least_urgent_class() {
        let mut q = Queue::new(3, &[1, 1]);
        q.push(1, 0, entry(1, 10), false);
        q.push(2, 0, entry(2, 10), false);
        q.push(2, 1, entry(3, 500), false);
        q.push(2, 1, entry(4, 5), false);
        assert!(q.shed_below(2).is_none());
        let (c, t, e) = q.shed_below(0).unwrap();
        assert_eq!((c, t, e.id), (2, 1, 4));
        assert_eq!(e.waiter.state(), State::Shed);
        assert_eq!(q.shed_below(0).unwrap().2.id, 3);
        assert_eq!(q.shed_below(0).unwrap().2.id, 2);
        assert_eq!(q.shed_below(0).unwrap().2.id, 1);
        assert_eq!(q.waiting(), 0);
    }

    #[test]
    fn a_full_class_sheds_the_tenant_with_the_most_tokens_waiting_for_a_lighter_one() {
        let mut q = Queue::new(2, &[1, 1, 2]);
        for id in 0..4 {
            q.push(1, 0, entry(id, 100), false);
        }
        q.push(1, 2, entry(10, 300), false);
        // Tenant 1 (nothing waiting) displaces tenant 0's newest; tenant 2's 300 tokens
        // count as 150 at weight 2.
        let (c, t, e) = q.shed_within(1, 1, 100).unwrap();
        assert_eq!((c, t, e.id), (1, 0, 3));
        assert_eq!(e.waiter.state(), State::Shed);
        q.push(1, 1, entry(20, 100), false);
        // Tenant 0 now holds 300 tokens: it cannot displace anyone lighter than itself.
        assert!(q.shed_within(1, 0, 100).is_none());
        // Tenant 1 with a second request (200) still has less than tenant 0's 300.
        assert_eq!(q.shed_within(1, 1, 100).unwrap().2.id, 2);
        // A class with nothing waiting sheds nothing.
        assert!(q.shed_within(0, 1, 1).is_none());
    }

    #[test]
    fn a_pool_that_found_no_slot_is_passed_over_until_the_next_free() {
        let mut q = Queue::new(1, &[1, 1]);
        let a = Entry {
            pool: 1,
            ..entry(1, 10)
        };
        let b = Entry {
            pool: 2,
            ..entry(2, 10)
        };
        let (wa, wb) = (Arc::clone(&a.waiter), Arc::clone(&b.waiter));
        q.push(0, 0, a, false);
        q.push(0, 1, b, false);
        q.credit();
        let g = q.dispatch(|_| true);
        assert!(Arc::ptr_eq(&g[0], &wa));
        // It found no slot: back at its head, and the slot goes to pool 2.
        q.failed(
            0,
            0,
            Entry {
                id: 1,
                cost: 10,
                pool: 1,
                waiter: wa.clone(),
            },
        );
        q.refill(1);
        let g = q.dispatch(|_| true);
        assert!(Arc::ptr_eq(&g[0], &wb));
        assert_eq!(wa.state(), State::Waiting);
        // While b is about to take the one free slot, nothing more is offered.
        q.refill(1);
        assert!(q.dispatch(|_| true).is_empty());
        q.resolved(0);
        q.refill(1);
        assert!(q.dispatch(|_| true).is_empty(), "pool 1 is passed over");
        q.freed(1);
        assert!(Arc::ptr_eq(&q.dispatch(|_| true)[0], &wa));
    }
}

//! Forward: the attempt loop of one routed request. Each attempt picks a worker not yet
//! tried (the policy's decision and an in-flight slot), sends the request, and tells the
//! breaker and the policy how it went; [`super::retry`] says whether another worker
//! takes it. The answer that ends the loop goes to [`Router::respond`]. The first
//! attempt goes through admission (`crate::flow`): it may wait in the queue, and with
//! `priority.preempt` a request of the last class may be cancelled until the first byte of
//! its worker's answer, then sent again.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Response;

use super::access_log::{AccessLog, Decision, Ident};
use super::retry::{self, Answer, Retries};
use super::{ProxyBody, Router};
use crate::cache::Pending;
use crate::config::Role;
use crate::error::ProxyError;
use crate::flow::{Ticket, Wake, queue::State};
use crate::policy::{self, Outcome, Pick, Policy, Reason, RouteRequest};
use crate::pools::ModelPool;
use crate::pools::pool::breaker::Outcome as BreakerOutcome;
use crate::pools::pool::{InFlightGuard, Worker, WorkerSet};
use crate::tree::WorkerMask;
use crate::upstream::{RequestTemplate, UpstreamBody};

/// What one request routes on.
pub(super) struct Route<'a> {
    pub id: Ident<'a>,
    /// The pool it routes in (its model's; [`crate::pools::Pools::route`]).
    pub pool: &'a ModelPool<Arc<dyn Policy>>,
    /// What picks its worker: the policy of the pool it routes in (its model's;
    /// [`crate::pools::Pools::route`]), or of one leg of a disaggregated pool.
    pub policy: &'a Arc<dyn Policy>,
    /// What the policy decides on.
    pub req: RouteRequest<'a>,
    /// When the decision started (for its latency).
    pub started: Instant,
    /// Where the answer goes in the response cache, on a miss.
    pub cache: Option<Pending>,
    /// The decode leg of a disaggregated request: how its prefill leg went.
    pub pd: Option<super::pd::trail::Trail>,
    /// A streamed answer's continuation plan (see [`super::migrate`]).
    pub resume: Option<super::migrate::Resume>,
    /// Its tenant and class (flow control; one ticket for every request when off).
    pub ticket: Ticket,
    /// How many times it was pre-empted (`priority.preempt`).
    pub preempted: AtomicU8,
    /// The input tokens its tenant's budgets were charged at admission (0: none).
    pub debited: AtomicU64,
}

impl<'a> Route<'a> {
    /// A request routed without a prompt (`/v1/models`, a tunnel, a stored response's
    /// calls): the policy's least-loaded choice, or a bound session's worker.
    pub fn without_prompt(
        id: Ident<'a>,
        pool: &'a ModelPool<Arc<dyn Policy>>,
        ticket: Ticket,
    ) -> Self {
        Route {
            id,
            pool,
            policy: pool.policy(),
            req: RouteRequest::default(),
            started: Instant::now(),
            cache: None,
            pd: None,
            resume: None,
            ticket,
            preempted: AtomicU8::new(0),
            debited: AtomicU64::new(0),
        }
    }

    /// What its tenant's budgets were charged, taken (to settle or refund once).
    pub fn take_debit(&self) -> Option<crate::flow::Debit> {
        let input = self.debited.swap(0, Ordering::Relaxed);
        (input > 0).then_some(crate::flow::Debit {
            tenant: self.ticket.tenant,
            input,
        })
    }

    /// Its prompt's tokens as the queue charges them: about 4 bytes a token.
    pub fn cost(&self) -> u64 {
        self.req.ctx.map_or(0, |c| c.total_len as u64) / 4 + 1
    }
}

impl Router {
    /// Picks a worker and forwards, retrying on other workers while nothing has been
    /// returned to the client; a pre-empted request goes back to the queue
    /// (`priority.on_preempt: requeue`, at most [`crate::flow::admission::MAX_REQUEUES`]
    /// times).
    pub(super) async fn forward(
        &self,
        set: &WorkerSet,
        parts: http::request::Parts,
        body: Bytes,
        route: &Route<'_>,
        waiting_on: &mut Option<Arc<str>>,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let base = RequestTemplate::new(parts, route.id.request_id, &route.id.trace);
        loop {
            let sent = self
                .forward_with(set, &base, body.clone(), route, None, waiting_on)
                .await;
            let adm = self.flow.admission();
            match sent {
                Err(ProxyError::Preempted)
                    if adm.requeues()
                        && route.preempted.load(Ordering::Relaxed)
                            <= crate::flow::admission::MAX_REQUEUES =>
                {
                    tracing::info!(request_id = ?route.id.request_id, "pre-empted before its worker answered; queued again");
                }
                other => return other,
            }
        }
    }

    /// [`Router::forward`] with the request's head made (`base`), and its first attempt
    /// on `first` when given (a pick already made, with its slot: a disaggregated
    /// request's decode worker, chosen before its prefill leg).
    pub(super) async fn forward_with(
        &self,
        set: &WorkerSet,
        base: &RequestTemplate,
        body: Bytes,
        route: &Route<'_>,
        mut first: Option<(Pick, InFlightGuard)>,
        waiting_on: &mut Option<Arc<str>>,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let mut retries = Retries::new(&self.config.proxy, route.id.arrived);
        let mut tried = WorkerMask::default();
        let mut started = route.started;
        for attempt in 0..=retries.max() {
            if attempt > 0 {
                let unsaturated = || self.any_unsaturated(set, &tried);
                let Some(backoff) = retries.backoff_before(attempt, unsaturated) else {
                    break;
                };
                tokio::time::sleep(backoff).await;
                started = Instant::now();
            }
            let picked = match first.take() {
                Some(made) => Some(made),
                None => self.pick_for(attempt, set, route, &tried, started).await?,
            };
            let Some((pick, mut guard)) = picked else {
                break;
            };
            let mut worker = Arc::clone(guard.worker());
            *waiting_on = Some(Arc::clone(worker.label()));
            if let Some(id) = pick.worker {
                tried.insert(id);
            }
            // A disaggregated request's decision is its prefill leg's, when it had one.
            let counted = route.pd.as_ref().is_none_or(|t| !t.prefill_tried);
            let mut decision = self.decided(&pick, &worker, started, attempt, counted);
            let watch = Attempt {
                policy: &**route.policy,
                req: &route.req,
                pick: &pick,
                worker: &worker,
                done: false,
            };
            // An adapter request: the adapter loaded there first when it must be, and
            // the body in the worker's form. A failed load fails this attempt only.
            let adapted = match self
                .for_adapter(&worker, route, &body, retries.attempt_wait())
                .await
            {
                Ok(adapted) => adapted,
                Err((e, unreachable)) => {
                    guard.record(if unreachable {
                        BreakerOutcome::Failure
                    } else {
                        BreakerOutcome::Neutral
                    });
                    watch.finish(Outcome::Failed);
                    if !retries.failed(attempt, e, &worker, route.id.request_id) {
                        break;
                    }
                    continue;
                }
            };
            let wait = retries.attempt_wait();
            let to = adapted.as_ref().unwrap_or(&body);
            let ((result, pushed_back), hedged) = match self.hedge_after(attempt, route) {
                Some(after) => {
                    let leg = Leg {
                        set,
                        base,
                        body: to,
                        route,
                        wait,
                        tried: &tried,
                    };
                    self.send_hedged(after, watch, leg, &mut guard).await
                }
                None => (
                    self.send_preemptible(watch, base, to, route, &mut guard, wait)
                        .await,
                    Default::default(),
                ),
            };
            if let Err(ProxyError::Preempted) = result {
                return Err(ProxyError::Preempted);
            }
            if let Some(id) = hedged.tried {
                tried.insert(id);
            }
            if let Some(p) = &hedged.swapped {
                // The hedge won: its worker answers.
                worker = Arc::clone(guard.worker());
                *waiting_on = Some(Arc::clone(worker.label()));
                decision = self.decided(p, &worker, started, attempt, false);
            }
            if route.pd.is_some() {
                self.metrics.pd().decode_attempt(&result);
            }
            match result {
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    let mut log = AccessLog::new(&route.id, &worker, decision, status);
                    log.hedge = hedged.outcome;
                    if !retries.holds(attempt, status, pushed_back) {
                        return Ok(self.respond(resp, guard, log, route));
                    }
                    retries.hold(Answer { resp, guard, log }, pushed_back, &worker);
                }
                Err(e) => {
                    if !retries.failed(attempt, e, &worker, route.id.request_id) {
                        break;
                    }
                }
            }
        }
        let a = retries.finish()?;
        Ok(self.respond(a.resp, a.guard, a.log, route))
    }

    /// The pick and slot of attempt `attempt`: on the first, waiting in `proxy.queue`
    /// when only full workers stand in the way. `Ok(None)` when no worker is usable;
    /// on the first attempt that (and a queue's refusal) counts as a `no_worker`
    /// decision, while a retry that finds no worker left is not a decision.
    pub(super) async fn pick_for(
        &self,
        attempt: u32,
        set: &WorkerSet,
        route: &Route<'_>,
        tried: &WorkerMask,
        started: Instant,
    ) -> Result<Option<(Pick, InFlightGuard)>, ProxyError> {
        if attempt == 0 {
            self.debit(route).await?;
        }
        // Admission: others ahead of it in the queue, or its class's capacity held, and
        // it waits instead of taking a slot.
        let must_wait = attempt == 0 && self.flow.admission().must_wait(route.ticket.class);
        let picked = if must_wait {
            None
        } else {
            self.pick(set, route, tried)
        };
        if picked.is_some() || attempt > 0 {
            if attempt == 0 && picked.is_some() {
                self.flow.admission().admitted(route.ticket);
            }
            return Ok(picked);
        }
        let waited = self.wait_for_slot(set, route, tried).await;
        match &waited {
            Ok(Some(_)) => self.flow.admission().admitted(route.ticket),
            _ => {
                self.metrics.decision(Reason::NoWorker, started.elapsed());
                // Turned away before any worker had it: its budget charge comes back.
                if let Some(d) = route.take_debit() {
                    self.flow.refund(d);
                }
            }
        }
        waited
    }

    /// Token budgets (`tenants.list.NAME.tokens_per_minute`, `tokens_per_day`): a routed
    /// request is charged its prompt's estimated tokens once, before it may queue;
    /// over its tenant's budget, 429 with `Retry-After` from the refill.
    async fn debit(&self, route: &Route<'_>) -> Result<(), ProxyError> {
        if !self.flow.has_budgets()
            || route.req.ctx.is_none()
            || route.debited.load(Ordering::Relaxed) > 0
        {
            return Ok(());
        }
        match self.flow.debit(route.ticket, route.cost()).await {
            Ok(Some(d)) => route.debited.store(d.input, Ordering::Relaxed),
            Ok(None) => {}
            Err(over) => return Err(self.over_budget(route.ticket, over)),
        }
        Ok(())
    }

    /// What an adapter request needs on `worker` before it is sent (see
    /// [`super::adapters`]): its adapter loaded (`adapters.load_on_demand`), within
    /// `wait`; the body to send instead of the client's (SGLang's form), if any. `Err`:
    /// the load failed, and whether the worker could not be reached at all.
    async fn for_adapter(
        &self,
        worker: &Arc<Worker>,
        route: &Route<'_>,
        body: &Bytes,
        wait: Duration,
    ) -> Result<Option<Bytes>, (ProxyError, bool)> {
        let Some(adapter) = &route.req.adapter else {
            return Ok(None);
        };
        if let Some(source) = self.config.adapters.loadable(&adapter.name) {
            self.loads
                .ensure(&self.client, worker, &adapter.name, source, wait)
                .await?;
        }
        Ok(super::adapters::sglang_form(
            worker,
            body,
            &adapter.name,
            route.pool.name(),
        ))
    }

    /// Counts the decision of attempt `attempt` (made since `started`) unless not
    /// `counted`, and returns it as the access line will tell it.
    pub(super) fn decided(
        &self,
        pick: &Pick,
        worker: &Worker,
        started: Instant,
        attempt: u32,
        counted: bool,
    ) -> Decision {
        let decided_in = started.elapsed();
        if counted {
            self.metrics.decision(pick.reason, decided_in);
            if pick.reason == Reason::CacheHit {
                self.metrics
                    .estimated_saved(worker.label(), pick.saved_tokens());
            }
            if worker.config().role == Role::Fallback {
                self.metrics.fallback_pick();
            }
        }
        if attempt > 0 {
            self.metrics.retry();
        }
        Decision {
            reason: pick.reason,
            matched_ratio: pick.matched_ratio(),
            available_tokens: pick.available_tokens(),
            predicted_tokens: pick.saved_tokens(),
            mark: pick.mark,
            decision_us: decided_in.as_micros() as u64,
            attempt,
        }
    }

    /// One attempt, `watch`'s pick, on the worker `guard` holds a slot on, waiting at
    /// most `wait` for its headers. The breaker and the policy hear how it went (the
    /// policy exactly once, [`Outcome::Cancelled`] if the client leaves first); a
    /// push-back saturates the worker for as long as it asks. Returns the answer and
    /// whether it was a push-back.
    pub(super) async fn send(
        &self,
        watch: Attempt<'_>,
        base: &RequestTemplate,
        body: &Bytes,
        id: &Ident<'_>,
        guard: &mut InFlightGuard,
        wait: Duration,
    ) -> (Result<Response<UpstreamBody>, ProxyError>, bool) {
        let (pick, worker) = (watch.pick, watch.worker);
        guard.reserve_prefill(
            pick.prefill_tokens,
            watch.req.ctx.map_or(0, |c| c.total_len) as u64,
        );
        let result = self
            .client
            .send(worker, base, body.clone(), pick.dp_rank, wait)
            .await;
        let pushed_back = result.as_ref().ok().and_then(retry::back_pressure);
        if let Some(wait) = pushed_back {
            worker.signals().saturate(crate::pools::pool::now() + wait);
            self.metrics.back_pressure(worker.label());
            tracing::info!(
                request_id = ?id.request_id,
                worker = %worker.url(),
                secs = wait.as_secs_f64(),
                "worker pushed back; no new requests to it for that long while others can take them"
            );
        }
        guard.record(match &result {
            // Back-pressure is the engine working as designed, not a fault.
            Ok(_) if pushed_back.is_some() => BreakerOutcome::Neutral,
            Ok(r) if r.status().is_server_error() => BreakerOutcome::Failure,
            Ok(r) if r.status().is_client_error() => BreakerOutcome::Neutral,
            Ok(_) => BreakerOutcome::Success,
            Err(_) => BreakerOutcome::Failure,
        });
        watch.finish(match &result {
            Ok(r) if r.status().is_success() => Outcome::Served,
            _ => Outcome::Failed,
        });
        (result, pushed_back.is_some())
    }

    /// `proxy.queue` (see `crate::flow::admission`): when no worker could be picked only
    /// because every usable one is at `max_load` (or its class's share is held, or
    /// others are ahead of it), waits in the queue for a slot and picks again, for at
    /// most its class's `timeout_ms`. `Ok(None)` when waiting cannot help (the queue is
    /// off, or no worker is merely full); `Err` when the queue refuses it or the time
    /// ran out (503 + Retry-After; 429 with flow control on), saying which. A client
    /// that leaves drops this future and so its place.
    async fn wait_for_slot(
        &self,
        set: &WorkerSet,
        route: &Route<'_>,
        tried: &WorkerMask,
    ) -> Result<Option<(Pick, InFlightGuard)>, ProxyError> {
        let adm = self.flow.admission();
        let class = route.ticket.class;
        let blocked = || {
            let now = crate::pools::pool::now();
            !adm.reserve_allows(class as usize)
                || set
                    .workers()
                    .iter()
                    .any(|w| !tried.contains(w.id()) && w.is_full(now))
        };
        if !adm.queues(class) || !(adm.must_wait(class) || blocked()) {
            return Ok(None);
        }
        let front = route.preempted.load(Ordering::Relaxed) > 0;
        let pool = set as *const WorkerSet as usize;
        let place = adm
            .enter(route.ticket, route.cost(), pool, front)
            .map_err(|r| self.refused(route.ticket, r))?;
        if !blocked() {
            // Others are ahead of it but a worker has room: the next in order tries.
            adm.room_left();
        } else {
            // In the queue first, so that the slot a pre-empted request frees is its.
            adm.preempt_for(route.ticket);
        }
        loop {
            // Registered before the state is read, so a slot freed in between is seen.
            let freed = self.pools.workers().slot_freed().notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            match place.state() {
                State::Shed => return Err(self.refused(route.ticket, place.refused(false))),
                State::Granted => {
                    if adm.reserve_allows(class as usize)
                        && let Some(picked) = self.pick(set, route, tried)
                    {
                        place.admitted();
                        adm.room_left();
                        return Ok(Some(picked));
                    }
                    if !blocked() {
                        // Not merely full: no worker it could wait for.
                        return Ok(None);
                    }
                    place.no_slot();
                }
                State::Waiting => {}
            }
            match place.wait(freed).await {
                Wake::Told => {}
                Wake::Freed => place.relay_freed(),
                Wake::TimedOut => {
                    return Err(self.refused(route.ticket, place.refused(true)));
                }
            }
        }
    }

    /// One attempt ([`Router::send`]); a request `priority.preempt` may cancel is
    /// cancelled (its connection closed: the engine aborts it) when a more urgent one
    /// pre-empts it before the first byte of its worker's answer: `Err(Preempted)`.
    /// Engines send a stream's headers at once and its first event with the first
    /// token, so a 2xx answer's headers wait here for its first body byte.
    async fn send_preemptible(
        &self,
        watch: Attempt<'_>,
        base: &RequestTemplate,
        body: &Bytes,
        route: &Route<'_>,
        guard: &mut InFlightGuard,
        wait: Duration,
    ) -> (Result<Response<UpstreamBody>, ProxyError>, bool) {
        let preemptible = match route.pd {
            None => self.flow.admission().preemptible(route.ticket),
            // A disaggregated request's legs are never pre-empted.
            Some(_) => None,
        };
        let Some(p) = preemptible else {
            return self.send(watch, base, body, &route.id, guard, wait).await;
        };
        let first_byte = async {
            let mut sent = self.send(watch, base, body, &route.id, guard, wait).await;
            if let Ok(resp) = &mut sent.0
                && resp.status().is_success()
            {
                resp.body_mut().first().await;
            }
            sent
        };
        tokio::select! {
            sent = first_byte => sent,
            () = p.preempted() => {
                route.preempted.fetch_add(1, Ordering::Relaxed);
                (Err(ProxyError::Preempted), false)
            }
        }
    }

    /// Whether a worker not yet tried is usable and has not pushed back.
    pub(super) fn any_unsaturated(&self, set: &WorkerSet, tried: &WorkerMask) -> bool {
        let now = crate::pools::pool::now();
        set.workers().iter().any(|w| {
            !tried.contains(w.id()) && w.is_routable(now) && !w.signals().is_saturated(now)
        })
    }

    /// One decision plus the in-flight slot on the chosen worker
    /// ([`policy::decide::pick_slot`]).
    pub(super) fn pick(
        &self,
        set: &WorkerSet,
        route: &Route<'_>,
        tried: &WorkerMask,
    ) -> Option<(Pick, InFlightGuard)> {
        let policy = &**route.policy;
        let mut picked =
            policy::decide::pick_slot(policy, set, &route.req, tried, &mut rand::rng());
        if let (Some((_, guard)), Some(count)) = (
            picked.as_mut(),
            self.flow.admission().class_count(route.ticket.class),
        ) {
            guard.count_also(count);
        }
        picked
    }
}

/// What a hedged attempt needs besides its first pick (see [`super::hedge`]).
pub(super) struct Leg<'a, 'r> {
    pub set: &'a WorkerSet,
    pub base: &'a RequestTemplate,
    pub body: &'a Bytes,
    pub route: &'a Route<'r>,
    pub wait: Duration,
    pub tried: &'a WorkerMask,
}

/// One attempt's pick, told to the policy exactly once: how it ended, or
/// [`Outcome::Cancelled`] when the request is dropped first (the client went away).
pub(super) struct Attempt<'a> {
    pub policy: &'a dyn Policy,
    pub req: &'a RouteRequest<'a>,
    pub pick: &'a Pick,
    pub worker: &'a Arc<Worker>,
    pub done: bool,
}

impl Attempt<'_> {
    pub(super) fn finish(mut self, outcome: Outcome) {
        self.done = true;
        self.policy
            .observe(self.req, self.pick, self.worker, outcome);
    }
}

impl Drop for Attempt<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.policy
                .observe(self.req, self.pick, self.worker, Outcome::Cancelled);
        }
    }
}

//! Flow control in front of the fleet: who a request is (its tenant), how urgent (its
//! priority class), when it may take a worker's slot (the admission queue) and what it
//! may spend (token budgets).
//!
//! ```text
//! classify   tenant (header, API key -> name, else `default`; unlisted -> `other`)
//!            and class (header, body `priority`, else the default), clamped to the
//!            tenant's max_class: a Ticket
//! queue      one queue per (class, tenant): strict order across classes, deficit round
//!            robin in prompt tokens across tenants; shedding; credits counted afresh
//!            from the workers' free slots
//! admission  the fast path, the bounds per class, priority.reserve, pre-emption; a
//!            waiter's Place
//! metrics    the queue's families; per class and tenant ones (admitted, shed, pre-empted,
//!            waits, tokens)
//! view       the queue's depths for GET /workers and the flow_queued gauge
//! budget     token budgets per tenant: buckets in process or on Redis (fail open)
//! ```
//!
//! With neither `tenants:` nor `priority:` in the config, flow control is off: every
//! request has one ticket, nothing here reads its headers or body, and the queue is one
//! FIFO (`proxy.queue`). Below the proxy, above the policies and pools: it never touches
//! sockets.

pub mod admission;
pub mod budget;
pub mod classify;
pub mod metrics;
pub mod queue;
pub mod view;

use std::sync::Arc;

pub use admission::{Admission, Place, Refusal, Wake};
pub use budget::{Budgets, Debit, Over};
pub use classify::{Classifier, Ticket};

use crate::config::Config;
use crate::pools::pool::Pool;

/// An answered request's tokens, counted (and charged to its tenant) when its answer
/// ends.
#[derive(Debug)]
pub struct Charge {
    flow: Arc<Flow>,
    ticket: Ticket,
    /// Its prompt's tokens as the router estimated them.
    estimate: u64,
    /// What its tenant's budgets were charged at admission, settled here.
    debit: Option<Debit>,
}

impl Charge {
    /// The answer ended; `usage`: the engine's `(prompt, completion)` tokens, when it
    /// reported them (else the estimate, and no output, are counted).
    pub fn settle(self, usage: Option<(u64, Option<u64>)>) {
        let (input, output) = match usage {
            Some((prompt, completion)) => (prompt, completion.unwrap_or(0)),
            None => (self.estimate, 0),
        };
        if let Some(m) = self.flow.admission.tickets() {
            m.tokens(self.ticket.class, self.ticket.tenant, input, output);
        }
        if let (Some(b), Some(d)) = (&self.flow.budgets, self.debit) {
            b.settle(d, input, output);
        }
    }
}

/// Flow control's parts, built once from the config (see the module docs).
#[derive(Debug)]
pub struct Flow {
    /// `None` when flow control is off.
    classifier: Option<Classifier>,
    /// `priority.engine_priority`.
    engine_priority: bool,
    admission: Admission,
    default_ticket: Ticket,
    /// Token budgets, when a tenant has one.
    budgets: Option<Arc<Budgets>>,
}

impl Flow {
    /// Flow control for `config`, over the workers of `pool` (their slots), its
    /// families registered in `registry`.
    pub fn new(config: &Config, pool: &Arc<Pool>, registry: &mut crate::metrics::Metrics) -> Self {
        let on = config.tenants.enabled || config.priority.enabled;
        let classifier = on.then(|| Classifier::new(config));
        let (classes, weights) = match &classifier {
            Some(c) => (c.classes(), c.weights()),
            None => (1, vec![1]),
        };
        let metrics = metrics::QueueMetrics::register(registry);
        let names = classifier.as_ref().map(|c| {
            let classes: Vec<_> = (0..c.classes() as u8)
                .map(|i| Arc::clone(c.class_name(i)))
                .collect();
            let tenants: Vec<_> = (0..c.tenants() as u16)
                .map(|i| Arc::clone(c.tenant_name(i)))
                .collect();
            (classes, tenants)
        });
        let tickets = names
            .as_ref()
            .map(|(classes, tenants)| metrics::FlowMetrics::register(registry, classes, tenants));
        let budgets = names.as_ref().and_then(|(_, tenants)| {
            let errors = prometheus_client::metrics::counter::Counter::default();
            let b = Budgets::new(config, tenants, errors.clone())?;
            registry.register_family(
                "flow_budget_errors",
                "Token budget calls to Redis (state.redis_url) that failed: limits failed open",
                errors,
            );
            Some(Arc::new(b))
        });
        Flow {
            default_ticket: classifier
                .as_ref()
                .map_or_else(Ticket::default, Classifier::default_ticket),
            admission: Admission::new(config, classes, &weights, pool, metrics, tickets),
            classifier,
            engine_priority: on && config.priority.engine_priority,
            budgets,
        }
    }

    /// Whether some tenant has a token budget.
    pub fn has_budgets(&self) -> bool {
        self.budgets.is_some()
    }

    /// Charges a request of `ticket` with about `input` prompt tokens against its
    /// tenant's budgets ([`Budgets::debit`]); over budget, counted as shed (`budget`).
    pub async fn debit(&self, ticket: Ticket, input: u64) -> Result<Option<Debit>, Over> {
        let Some(b) = &self.budgets else {
            return Ok(None);
        };
        let debited = b.debit(ticket.tenant, input).await;
        if debited.is_err()
            && let Some(m) = self.admission.tickets()
        {
            m.shed(ticket.class, ticket.tenant, "budget");
        }
        debited
    }

    /// Gives back what a request turned away before any worker had it was charged.
    pub fn refund(&self, debit: Debit) {
        if let Some(b) = &self.budgets {
            b.refund(debit);
        }
    }

    /// The classifier, when flow control is on.
    pub fn classifier(&self) -> Option<&Classifier> {
        self.classifier.as_ref()
    }

    /// Whether flow control is on (its refusals are 429s).
    pub fn is_on(&self) -> bool {
        self.classifier.is_some()
    }

    /// Whether the class is written into the forwarded body as vLLM's `priority`.
    pub fn engine_priority(&self) -> bool {
        self.engine_priority
    }

    pub fn admission(&self) -> &Admission {
        &self.admission
    }

    /// What an answered request of `ticket` with a prompt of about `estimate` tokens
    /// is charged when its answer ends ([`Charge::settle`]); `None` with flow control
    /// off.
    pub fn charge(
        self: &Arc<Self>,
        ticket: Ticket,
        estimate: u64,
        debit: Option<Debit>,
    ) -> Option<Charge> {
        self.is_on().then(|| Charge {
            flow: Arc::clone(self),
            ticket,
            estimate,
            debit,
        })
    }

    /// The tenant and class names of `ticket`, for the access line (flow control on).
    pub fn names(&self, ticket: Ticket) -> Option<(&Arc<str>, &Arc<str>)> {
        let c = self.classifier.as_ref()?;
        Some((c.tenant_name(ticket.tenant), c.class_name(ticket.class)))
    }

    /// The ticket of a request nothing names (the `default` tenant, the default
    /// class): a tunnel, a call on a stored response.
    pub fn default_ticket(&self) -> Ticket {
        self.default_ticket
    }
}

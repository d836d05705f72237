//! Flow control in front of the fleet: who a request is (its tenant), how urgent (its
//! priority class), when it may take a worker's slot (the admission queue) and what it
//! may spend (token budgets).
//!
//! ```text
//! classify   tenant (header, API key -> name, else `default`; unlisted -> `other`)
//!            and class (header, body `priority`, else the default), clamped to the
//!            tenant's max_class: a Ticket
//! queue      one queue per (class, tenant): strict order across classes, deficit round
//!            robin in prompt tokens across tenants; shedding; credits per freed slot
//! admission  the fast path, the bounds per class, priority.reserve, pre-emption; a
//!            waiter's Place
//! metrics    the queue's families
//! ```
//!
//! With neither `tenants:` nor `priority:` in the config, flow control is off: every
//! request has one ticket, nothing here reads its headers or body, and the queue is one
//! FIFO (`proxy.queue`). Below the proxy, above the policies and pools: it never touches
//! sockets.

pub mod admission;
pub mod classify;
pub mod metrics;
pub mod queue;

use std::sync::Arc;

pub use admission::{Admission, Place, Refusal, Wake};
pub use classify::{Classifier, Ticket};

use crate::config::Config;
use crate::pools::pool::Pool;

/// Flow control's parts, built once from the config (see the module docs).
#[derive(Debug)]
pub struct Flow {
    /// `None` when flow control is off.
    classifier: Option<Classifier>,
    /// `priority.engine_priority`.
    engine_priority: bool,
    admission: Admission,
    default_ticket: Ticket,
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
        Flow {
            default_ticket: classifier
                .as_ref()
                .map_or_else(Ticket::default, Classifier::default_ticket),
            admission: Admission::new(config, classes, &weights, pool, metrics),
            classifier,
            engine_priority: on && config.priority.engine_priority,
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

    /// The ticket of a request nothing names (the `default` tenant, the default
    /// class): a tunnel, a call on a stored response.
    pub fn default_ticket(&self) -> Ticket {
        self.default_ticket
    }
}

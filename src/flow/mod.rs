//! Flow control in front of the fleet: who a request is (its tenant), how urgent (its
//! priority class), when it may take a worker's slot (the admission queue) and what it
//! may spend (token budgets).
//!
//! ```text
//! classify   tenant (header, API key -> name, else `default`; unlisted -> `other`)
//!            and class (header, body `priority`, else the default), clamped to the
//!            tenant's max_class: a Ticket
//! ```
//!
//! With neither `tenants:` nor `priority:` in the config flow control is off: every
//! request has one ticket and nothing here reads its headers or body.
//! Below the proxy, above the policies and pools: it never touches sockets.

pub mod classify;

pub use classify::{Classifier, Ticket};

use crate::config::Config;

/// Flow control's parts, built once from the config (see the module docs).
#[derive(Debug)]
pub struct Flow {
    /// `None` when flow control is off.
    classifier: Option<Classifier>,
    /// `priority.engine_priority`.
    engine_priority: bool,
}

impl Flow {
    pub fn new(config: &Config) -> Self {
        let on = config.tenants.enabled || config.priority.enabled;
        Flow {
            classifier: on.then(|| Classifier::new(config)),
            engine_priority: on && config.priority.engine_priority,
        }
    }

    /// The classifier, when flow control is on.
    pub fn classifier(&self) -> Option<&Classifier> {
        self.classifier.as_ref()
    }

    /// Whether the class is written into the forwarded body as vLLM's `priority`.
    pub fn engine_priority(&self) -> bool {
        self.engine_priority
    }
}

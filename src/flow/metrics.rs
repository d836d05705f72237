//! The admission queue's families in `/metrics`: requests waiting now, their waits,
//! refusals by cause. Every series exists from start-up.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Unit;

use crate::metrics::Metrics;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CauseLabels {
    cause: &'static str,
}

/// Why the queue refused a request: `full` (no room for its class:
/// `proxy.queue.max_waiting`, or its place taken by a more urgent class), `class_full`
/// (its class's `proxy.queue.per_class` bound), `timeout` (its wait ran out).
pub const CAUSES: [&str; 3] = ["full", "class_full", "timeout"];

/// See the module docs.
#[derive(Debug)]
pub struct QueueMetrics {
    waiting: Gauge,
    wait: Histogram,
    rejected: [Counter; CAUSES.len()],
}

impl QueueMetrics {
    pub fn register(registry: &mut Metrics) -> Self {
        let rejected: Family<CauseLabels, Counter> = Family::default();
        let m = QueueMetrics {
            waiting: Gauge::default(),
            // 100 µs … ~100 s.
            wait: Histogram::new(exponential_buckets(0.0001, 2.0, 21)),
            rejected: CAUSES.map(|cause| rejected.get_or_create(&CauseLabels { cause }).clone()),
        };
        registry.register_family(
            "queue_waiting",
            "Requests waiting for an in-flight slot now (proxy.queue: every usable worker at max_load, or its class's share held by priority.reserve)",
            m.waiting.clone(),
        );
        registry.register_family_with_unit(
            "queue_wait",
            "How long queued requests waited before a slot freed",
            Unit::Seconds,
            m.wait.clone(),
        );
        registry.register_family(
            "queue_rejected",
            "Requests the admission queue refused (503; 429 with flow control on): full (no room for its class: max_waiting reached, or its place taken by a more urgent class), class_full (proxy.queue.per_class), timeout (its wait ran out)",
            rejected,
        );
        m
    }

    /// Requests waiting now.
    pub fn set_waiting(&self, n: usize) {
        self.waiting.set(n as i64);
    }

    /// A queued request got a slot after waiting `took`.
    pub fn waited(&self, took: Duration) {
        self.wait.observe(took.as_secs_f64());
    }

    /// A request the queue refused, by one of [`CAUSES`].
    pub fn rejected(&self, cause: &'static str) {
        if let Some(i) = CAUSES.iter().position(|c| *c == cause) {
            self.rejected[i].inc();
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TicketLabels {
    class: std::sync::Arc<str>,
    tenant: std::sync::Arc<str>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShedLabels {
    class: std::sync::Arc<str>,
    tenant: std::sync::Arc<str>,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TokenLabels {
    class: std::sync::Arc<str>,
    tenant: std::sync::Arc<str>,
    direction: &'static str,
}

/// Why flow control turned a request away: `queue_full` (no room in the queue for its
/// class, or its place taken by a more urgent class), `class_full` (its class's own
/// bound), `timeout` (its wait ran out), `budget` (its tenant's token budget).
pub const SHED_REASONS: [&str; 4] = ["queue_full", "class_full", "timeout", "budget"];

/// The per class and tenant families (flow control on): requests admitted, shed by
/// reason, pre-empted, their waits and their tokens. Every series (the classes times
/// the known tenants, `default` and `other` included) exists from start-up; each
/// request updates handles resolved here, by index.
#[derive(Debug)]
pub struct FlowMetrics {
    tenants: usize,
    admitted: Vec<Counter>,
    shed: Vec<[Counter; SHED_REASONS.len()]>,
    preempted: Vec<Counter>,
    wait: Vec<Histogram>,
    tokens: Vec<[Counter; 2]>,
}

impl FlowMetrics {
    /// The families for these `classes` and `tenants` (names, by index), registered in
    /// `registry`.
    pub fn register(
        registry: &mut Metrics,
        classes: &[std::sync::Arc<str>],
        tenants: &[std::sync::Arc<str>],
    ) -> Self {
        let admitted: Family<TicketLabels, Counter> = Family::default();
        let preempted: Family<TicketLabels, Counter> = Family::default();
        let shed: Family<ShedLabels, Counter> = Family::default();
        let tokens: Family<TokenLabels, Counter> = Family::default();
        let wait: Family<TicketLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.001, 2.0, 18)));
        let mut m = FlowMetrics {
            tenants: tenants.len(),
            admitted: Vec::new(),
            shed: Vec::new(),
            preempted: Vec::new(),
            wait: Vec::new(),
            tokens: Vec::new(),
        };
        for class in classes {
            for tenant in tenants {
                let labels = TicketLabels {
                    class: class.clone(),
                    tenant: tenant.clone(),
                };
                m.admitted.push(admitted.get_or_create(&labels).clone());
                m.preempted.push(preempted.get_or_create(&labels).clone());
                m.wait.push(wait.get_or_create(&labels).clone());
                m.shed.push(SHED_REASONS.map(|reason| {
                    let l = ShedLabels {
                        class: class.clone(),
                        tenant: tenant.clone(),
                        reason,
                    };
                    shed.get_or_create(&l).clone()
                }));
                m.tokens.push(["input", "output"].map(|direction| {
                    let l = TokenLabels {
                        class: class.clone(),
                        tenant: tenant.clone(),
                        direction,
                    };
                    tokens.get_or_create(&l).clone()
                }));
            }
        }
        registry.register_family(
            "flow_admitted",
            "Requests admitted to a worker's slot, by class and tenant (flow control; a pre-empted request sent again counts again)",
            admitted,
        );
        registry.register_family(
            "flow_shed",
            "Requests flow control turned away (429), by class, tenant and reason: queue_full, class_full, timeout, budget",
            shed,
        );
        registry.register_family(
            "flow_preempted",
            "Requests cancelled before their worker's answer by a more urgent one (priority.preempt), by class and tenant",
            preempted,
        );
        registry.register_family_with_unit(
            "flow_queue_wait",
            "How long queued requests waited before a slot, by class and tenant",
            Unit::Seconds,
            wait,
        );
        registry.register_family(
            "flow_tokens",
            "Tokens of answered requests by class, tenant and direction: input (the engine's prompt_tokens, else the router's estimate) and output (the engine's completion_tokens)",
            tokens,
        );
        m
    }

    fn at(&self, class: u8, tenant: u16) -> usize {
        class as usize * self.tenants + tenant as usize
    }

    pub fn admitted(&self, class: u8, tenant: u16) {
        self.admitted[self.at(class, tenant)].inc();
    }

    /// One request shed for `reason`, one of [`SHED_REASONS`].
    pub fn shed(&self, class: u8, tenant: u16, reason: &'static str) {
        if let Some(i) = SHED_REASONS.iter().position(|r| *r == reason) {
            self.shed[self.at(class, tenant)][i].inc();
        }
    }

    pub fn preempted(&self, class: u8, tenant: u16) {
        self.preempted[self.at(class, tenant)].inc();
    }

    pub fn waited(&self, class: u8, tenant: u16, took: Duration) {
        self.wait[self.at(class, tenant)].observe(took.as_secs_f64());
    }

    /// An answered request's `input` and `output` tokens.
    pub fn tokens(&self, class: u8, tenant: u16, input: u64, output: u64) {
        let [i, o] = &self.tokens[self.at(class, tenant)];
        i.inc_by(input);
        o.inc_by(output);
    }
}

//! Disaggregated pools: a pool whose workers include `phase: prefill` and `phase: decode`
//! ones routes each request in two legs (`crate::proxy::pd`), each leg with a policy of
//! its own over the workers of its phase. Whether a pool disaggregates is read from its
//! membership, like everything else of the table: a worker that joins or leaves may turn
//! a pool aggregated or disaggregated, and the legs' policies are made (once, with the
//! pool's other policies) when the pool first has both kinds of worker.
//!
//! Sides: the prefill leg goes to `prefill` workers only; the decode leg, and a request
//! that skips the prefill leg, to `decode` and `both` workers (a `both` worker computes
//! whole requests, which is what a decode worker does on a bypass). A pool with prefill
//! workers and no decode worker stays aggregated over all of them.

use std::sync::Arc;

use super::pool::{Worker, WorkerSet};
use crate::config::Phase;

/// Which part of a request a policy routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leg {
    /// The whole request (an aggregated pool; what a disaggregated one does for the
    /// requests it does not split: other paths, WebSockets).
    Whole,
    /// The prefill leg of a disaggregated pool.
    Prefill,
    /// The decode leg of a disaggregated pool (and requests sent to it alone).
    Decode,
}

impl Leg {
    /// Label used in logs, metrics and `/workers`.
    pub fn as_str(self) -> &'static str {
        match self {
            Leg::Whole => "whole",
            Leg::Prefill => "prefill",
            Leg::Decode => "decode",
        }
    }
}

/// A disaggregated pool's policies for its two legs.
#[derive(Clone)]
pub struct Legs<P> {
    pub prefill: P,
    pub decode: P,
}

/// One set's workers by side, when it has both (see the module docs).
pub struct Phases {
    /// `phase: prefill` workers.
    pub prefill: Arc<WorkerSet>,
    /// `phase: decode` and `phase: both` workers.
    pub decode: Arc<WorkerSet>,
}

impl Phases {
    /// `set` split by side; `None` unless it has a prefill and a decode worker (the set
    /// then routes aggregated).
    pub fn of(set: &WorkerSet) -> Option<Arc<Phases>> {
        let phase = |w: &Arc<Worker>| w.config().phase;
        let ws = set.workers();
        if !ws.iter().any(|w| phase(w) == Phase::Prefill)
            || !ws.iter().any(|w| phase(w) == Phase::Decode)
        {
            return None;
        }
        let side = |prefill: bool| {
            Arc::new(WorkerSet::new(
                ws.iter()
                    .filter(|w| (phase(w) == Phase::Prefill) == prefill)
                    .cloned()
                    .collect(),
            ))
        };
        Some(Arc::new(Phases {
            prefill: side(true),
            decode: side(false),
        }))
    }
}

/// Where a request of a disaggregated pool goes: its legs' policies and workers.
pub struct Disaggregated<'t, P> {
    pub policies: &'t Legs<P>,
    pub phases: &'t Phases,
}

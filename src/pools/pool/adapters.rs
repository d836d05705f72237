//! Which LoRA adapters a worker's engine holds in memory, as the router estimates it.
//!
//! No engine says so reliably: vLLM's `/v1/models` lists every adapter ever registered,
//! and its `vllm:lora_requests_info` names only the adapters with requests queued or
//! running. So the router keeps its own estimate per worker: the adapters it sent there
//! most recently, at most the worker's slots (`workers[].max_lora`, else the engine's
//! reported `max_lora`, else [`DEFAULT_SLOTS`]), least recently sent evicted first —
//! as the engines' own LRU caches evict. What the engine reports active is resident by
//! definition and counts as just sent; a worker that goes down holds nothing (its
//! engine may restart).
//!
//! An adapter request's candidates are ranked by [`Placement`] (the `policy::decide`
//! seam narrows them), and every request sent updates the estimate ([`Residency::sent`]).
//! The counts here are the worker's (`/metrics`, `/workers`).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Adapter slots assumed for a worker when neither config nor its engine says: vLLM's
/// `--max-loras` default. Underestimating only weakens the preference; overestimating
/// would send more adapters to a worker than it can hold.
pub const DEFAULT_SLOTS: usize = 1;

/// How long a worker that failed to load an adapter is passed over for it while
/// another worker can take it (LoRA off there, runtime loading not allowed, the
/// source unreadable from it): such a load fails the same way again.
pub const REFUSED_FOR: Duration = Duration::from_secs(30);

/// Most adapters remembered as refused per worker (the oldest go first).
const MAX_REFUSED: usize = 64;

/// Where an adapter request would land on a worker, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Placement {
    /// The worker is estimated to hold the adapter.
    Resident = 0,
    /// It does not, and has a free slot: loading it evicts nothing.
    FreeSlot = 1,
    /// It does not and is full: loading it evicts another adapter.
    Evicting = 2,
}

impl Placement {
    /// The label `/metrics` uses.
    pub fn as_str(self) -> &'static str {
        match self {
            Placement::Resident => "resident",
            Placement::FreeSlot => "free_slot",
            Placement::Evicting => "evicting",
        }
    }

    pub const ALL: [Placement; 3] = [
        Placement::Resident,
        Placement::FreeSlot,
        Placement::Evicting,
    ];
}

/// One worker's estimate and counts. See the module docs.
#[derive(Debug, Default)]
pub struct Residency {
    /// `workers[].max_lora`; 0 = unset.
    configured: usize,
    /// The engine's reported slots at its last scrape; 0 = none reported.
    reported: AtomicUsize,
    /// Held adapters, least recently sent first.
    held: Mutex<Vec<Arc<str>>>,
    /// Adapters whose load failed here, and when.
    refused: Mutex<Vec<(Arc<str>, Instant)>>,
    /// Adapter requests sent here, by [`Placement`] at the time.
    placed: [AtomicU64; 3],
    /// Loads through the engine's load endpoint (`adapters.load_on_demand`) that
    /// succeeded / failed.
    pub loads_ok: AtomicU64,
    pub loads_failed: AtomicU64,
}

impl Residency {
    /// The estimate for a worker with `configured` slots (`workers[].max_lora`).
    pub fn new(configured: Option<usize>) -> Self {
        Residency {
            configured: configured.unwrap_or(0),
            ..Residency::default()
        }
    }

    fn held(&self) -> MutexGuard<'_, Vec<Arc<str>>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How many adapters it holds at once: configured, else reported, else
    /// [`DEFAULT_SLOTS`].
    pub fn slots(&self) -> usize {
        if self.configured > 0 {
            return self.configured;
        }
        // Relaxed: a lone value, read as a hint.
        match self.reported.load(Ordering::Relaxed) {
            0 => DEFAULT_SLOTS,
            n => n,
        }
    }

    /// Where a request for `adapter` would land here now.
    pub fn placement(&self, adapter: &str) -> Placement {
        let held = self.held();
        if held.iter().any(|a| **a == *adapter) {
            Placement::Resident
        } else if held.len() < self.slots() {
            Placement::FreeSlot
        } else {
            Placement::Evicting
        }
    }

    /// A request for `adapter` was sent here: it is now the most recently used, the
    /// least recently used ones beyond the slots go. Returns where it landed.
    pub fn sent(&self, adapter: &Arc<str>) -> Placement {
        let slots = self.slots();
        let mut held = self.held();
        let placement = touch(&mut held, adapter, slots);
        drop(held);
        // Relaxed: counters.
        self.placed[placement as usize].fetch_add(1, Ordering::Relaxed);
        placement
    }

    /// What the engine reported at its last scrape: the adapters with requests queued
    /// or running (resident, by definition) and its slots, when it says.
    pub fn engine_reported(&self, active: &[&str], slots: Option<usize>) {
        if let Some(n) = slots {
            self.reported.store(n, Ordering::Relaxed);
        }
        let slots = self.slots();
        let mut held = self.held();
        for a in active {
            touch(&mut held, &Arc::from(*a), slots);
        }
    }

    /// A load of `adapter` failed here at `at`: it does not hold it, and is passed over
    /// for it for [`REFUSED_FOR`] while another worker can take it.
    pub fn refused(&self, adapter: &Arc<str>, at: Instant) {
        self.held().retain(|a| **a != **adapter);
        let mut refused = self.refused.lock().unwrap_or_else(|e| e.into_inner());
        refused.retain(|(a, _)| **a != **adapter);
        if refused.len() >= MAX_REFUSED {
            refused.remove(0);
        }
        refused.push((Arc::clone(adapter), at));
    }

    /// Whether a load of `adapter` failed here within [`REFUSED_FOR`] before `now`.
    pub fn refuses(&self, adapter: &str, now: Instant) -> bool {
        let refused = self.refused.lock().unwrap_or_else(|e| e.into_inner());
        refused
            .iter()
            .any(|(a, at)| **a == *adapter && now.saturating_duration_since(*at) < REFUSED_FOR)
    }

    /// Its engine holds nothing now (it went down, and may restart).
    pub fn clear(&self) {
        self.held().clear();
    }

    /// The adapters it is estimated to hold, most recently sent first.
    pub fn resident(&self) -> Vec<Arc<str>> {
        self.held().iter().rev().cloned().collect()
    }

    /// Adapter requests sent here by where they landed, in [`Placement::ALL`]'s order.
    pub fn placed(&self) -> [u64; 3] {
        [0, 1, 2].map(|i| self.placed[i].load(Ordering::Relaxed))
    }
}

/// Makes `adapter` the most recently used of `held` (least recent first), keeping at
/// most `slots`; returns where it was before.
fn touch(held: &mut Vec<Arc<str>>, adapter: &Arc<str>, slots: usize) -> Placement {
    let placement = match held.iter().position(|a| **a == **adapter) {
        Some(i) => {
            let a = held.remove(i);
            held.push(a);
            Placement::Resident
        }
        None => {
            let p = if held.len() < slots {
                Placement::FreeSlot
            } else {
                Placement::Evicting
            };
            held.push(Arc::clone(adapter));
            p
        }
    };
    let over = held.len().saturating_sub(slots.max(1));
    held.drain(..over);
    placement
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> Arc<str> {
        Arc::from(s)
    }

    #[test]
    fn the_most_recently_sent_adapters_stay_within_the_slots() {
        let r = Residency::new(Some(2));
        assert_eq!(r.placement("x"), Placement::FreeSlot);
        assert_eq!(r.sent(&a("x")), Placement::FreeSlot);
        assert_eq!(r.sent(&a("y")), Placement::FreeSlot);
        assert_eq!(r.placement("x"), Placement::Resident);
        assert_eq!(r.placement("z"), Placement::Evicting);
        assert_eq!(r.sent(&a("x")), Placement::Resident);
        // y is now the least recently sent: z evicts it.
        assert_eq!(r.sent(&a("z")), Placement::Evicting);
        assert_eq!(r.resident(), [a("z"), a("x")]);
        assert_eq!(r.placed(), [1, 2, 1]);
        r.clear();
        assert_eq!(r.placement("x"), Placement::FreeSlot);
    }

    #[test]
    fn a_refused_load_is_remembered_for_a_while() {
        let r = Residency::new(Some(2));
        let t0 = Instant::now();
        r.sent(&a("x"));
        r.refused(&a("x"), t0);
        assert_eq!(r.placement("x"), Placement::FreeSlot, "not held");
        assert!(r.refuses("x", t0 + REFUSED_FOR / 2));
        assert!(!r.refuses("x", t0 + REFUSED_FOR));
        assert!(!r.refuses("y", t0));
    }

    #[test]
    fn slots_come_from_config_else_the_engine_else_the_default() {
        let unset = Residency::new(None);
        assert_eq!(unset.slots(), DEFAULT_SLOTS);
        unset.engine_reported(&[], Some(4));
        assert_eq!(unset.slots(), 4);
        let set = Residency::new(Some(2));
        set.engine_reported(&[], Some(8));
        assert_eq!(set.slots(), 2, "config wins");
    }

    #[test]
    fn what_the_engine_reports_active_is_resident() {
        let r = Residency::new(Some(2));
        r.sent(&a("x"));
        r.sent(&a("y"));
        // Another client's requests brought w in: the engine says so.
        r.engine_reported(&["w"], None);
        assert_eq!(r.placement("w"), Placement::Resident);
        assert_eq!(r.placement("x"), Placement::Evicting, "x was the oldest");
        assert_eq!(r.placed(), [0, 2, 0], "reports are not requests");
    }
}

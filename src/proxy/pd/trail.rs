//! What a disaggregated pool's request carries from its legs to its answer (the access
//! line, the span, the response headers, the usage the client sees). Imports nothing of
//! the proxy: the parts that read it sit above it.

use std::sync::Arc;
use std::time::Duration;

/// How a disaggregated pool's request went, carried by its decode leg to its answer
/// (access line, span, response headers, the usage rewrite).
#[derive(Debug, Clone)]
pub struct Trail {
    pub path: Path,
    /// The prefill attempt whose answer was read, when one was.
    pub prefill: Option<PrefillDone>,
    /// Whether a prefill worker was tried (its decision counted: the decode leg's then
    /// is not, so that a request counts one decision).
    pub prefill_tried: bool,
    /// From the request's arrival to the decode answer's first body byte, once seen.
    pub first_token: Option<Duration>,
}

/// Which way the request went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// Prefill leg, its hand-off relayed to the decode leg.
    Disaggregated,
    /// No prefill leg, for this reason (one of `metrics::pd::BYPASS_REASONS`).
    Bypass(&'static str),
    /// The prefill leg handed nothing on: `missing_handoff` (it answered without one)
    /// or `prefill_failed` (it failed on every worker tried).
    DecodeOnly(&'static str),
}

impl Path {
    /// The `pd_requests_total` path and the reason (none for `disaggregated`).
    pub fn labels(self) -> (&'static str, Option<&'static str>) {
        match self {
            Path::Disaggregated => ("disaggregated", None),
            Path::Bypass(r) => ("bypass", Some(r)),
            Path::DecodeOnly(r) => ("decode_only", Some(r)),
        }
    }
}

impl Trail {
    /// The cached tokens the client's usage reports instead of the decode engine's: the
    /// prefill leg's, when its hand-off was relayed and its engine named them.
    pub fn reported_cached_tokens(&self) -> Option<u64> {
        match self.path {
            Path::Disaggregated => self.prefill.as_ref()?.cached_tokens,
            _ => None,
        }
    }
}

/// The prefill attempt whose answer was read.
#[derive(Debug, Clone)]
pub struct PrefillDone {
    /// Its worker's label (its URL).
    pub worker: Arc<str>,
    /// From its send to its answer read whole.
    pub took: Duration,
    /// The cached prompt tokens its engine reported, when it did: what the client's
    /// usage reports.
    pub cached_tokens: Option<u64>,
}

//! The `pd_` families: what disaggregated requests did (see `crate::proxy::pd`). Every
//! label value is from a fixed list, each series present at 0 from the first scrape.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Unit;

use crate::error::ProxyError;
use crate::metrics::Metrics;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PathLabels {
    path: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LegLabels {
    leg: &'static str,
    cause: &'static str,
}

/// How a disaggregated pool's request went: `disaggregated` (prefill leg, hand-off
/// relayed), `bypass` (no prefill leg), `decode_only` (the prefill leg ran and handed
/// nothing on: the decode worker computed the prompt).
pub const PATHS: [&str; 3] = ["disaggregated", "bypass", "decode_only"];

/// Why a request skipped the prefill leg.
pub const BYPASS_REASONS: [&str; 6] = [
    "uncached",
    "n",
    "no_prefill_worker",
    "endpoint",
    "conversation",
    "unreadable",
];

/// Which leg failed and how: a connection error, a time-out before headers, an error
/// status, or a broken answer.
pub const LEG_CAUSES: [&str; 5] = ["connect", "timeout", "status_4xx", "status_5xx", "upstream"];

fn latency_histogram() -> Histogram {
    // 1 ms … ~65 s.
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        0.001, 2.0, 17,
    ))
}

/// See the module docs.
#[derive(Debug)]
pub struct PdMetrics {
    requests: Family<PathLabels, Counter>,
    bypasses: Family<ReasonLabels, Counter>,
    missing_handoffs: Counter,
    prefill_fallbacks: Counter,
    aborts_between_legs: Counter,
    leg_failures: Family<LegLabels, Counter>,
    prefill_duration: Histogram,
    ttft: Histogram,
}

impl PdMetrics {
    /// The families with every series at 0, in no registry yet.
    pub(super) fn new() -> Self {
        let m = PdMetrics {
            requests: Family::default(),
            bypasses: Family::default(),
            missing_handoffs: Counter::default(),
            prefill_fallbacks: Counter::default(),
            aborts_between_legs: Counter::default(),
            leg_failures: Family::default(),
            prefill_duration: latency_histogram(),
            ttft: latency_histogram(),
        };
        for path in PATHS {
            let _ = m.requests.get_or_create(&PathLabels { path });
        }
        for reason in BYPASS_REASONS {
            let _ = m.bypasses.get_or_create(&ReasonLabels { reason });
        }
        for leg in ["prefill", "decode"] {
            for cause in LEG_CAUSES {
                let _ = m.leg_failures.get_or_create(&LegLabels { leg, cause });
            }
        }
        m
    }

    pub(super) fn register(&self, r: &mut Metrics) {
        r.register_family(
            "pd_requests",
            "Requests of disaggregated pools by path: disaggregated (prefill leg, hand-off relayed), bypass (no prefill leg), decode_only (the prefill leg handed nothing on)",
            self.requests.clone(),
        );
        r.register_family(
            "pd_bypasses",
            "Requests of disaggregated pools sent to a decode worker without a prefill leg, by reason: uncached (the decode worker holds most of the prompt), n (n > 1), no_prefill_worker, endpoint (one the engines do not hand off), conversation (continues a stored response), unreadable (not a JSON object)",
            self.bypasses.clone(),
        );
        r.register_family(
            "pd_missing_handoffs",
            "Prefill answers with a 2xx status and no kv_transfer_params (an end of sequence on the first token): the decode worker computed the prompt",
            self.missing_handoffs.clone(),
        );
        r.register_family(
            "pd_prefill_fallbacks",
            "Requests sent to their decode worker without a hand-off after the prefill leg failed on every worker tried (pd.on_prefill_failure: decode_only)",
            self.prefill_fallbacks.clone(),
        );
        r.register_family(
            "pd_aborts_between_legs",
            "Clients gone after the prefill worker answered and before the decode call: the prefill worker holds that KV until its lease expires",
            self.aborts_between_legs.clone(),
        );
        r.register_family(
            "pd_leg_failures",
            "Failed attempts of a disaggregated request's legs, by leg and cause (connect, timeout, status_4xx, status_5xx, upstream)",
            self.leg_failures.clone(),
        );
        r.register_family_with_unit(
            "pd_prefill_duration",
            "From the prefill leg's send to its answer read whole (the hand-off in hand)",
            Unit::Seconds,
            self.prefill_duration.clone(),
        );
        r.register_family_with_unit(
            "pd_time_to_first_token",
            "From a disaggregated request's arrival to the decode answer's first body byte",
            Unit::Seconds,
            self.ttft.clone(),
        );
    }

    /// A request of a disaggregated pool took `path` (one of [`PATHS`]).
    pub fn request(&self, path: &'static str) {
        self.requests.get_or_create(&PathLabels { path }).inc();
    }

    /// A request skipped the prefill leg for `reason` (one of [`BYPASS_REASONS`]).
    pub fn bypass(&self, reason: &'static str) {
        self.bypasses.get_or_create(&ReasonLabels { reason }).inc();
    }

    pub fn missing_handoff(&self) {
        self.missing_handoffs.inc();
    }

    pub fn prefill_fallback(&self) {
        self.prefill_fallbacks.inc();
    }

    pub fn abort_between_legs(&self) {
        self.aborts_between_legs.inc();
    }

    /// A failed attempt of `leg` (`prefill`, `decode`), for `cause` (one of
    /// [`LEG_CAUSES`]).
    pub fn leg_failure(&self, leg: &'static str, cause: &'static str) {
        self.leg_failures
            .get_or_create(&LegLabels { leg, cause })
            .inc();
    }

    /// How a decode attempt ended, counted when it failed.
    pub fn decode_attempt<B>(&self, result: &Result<http::Response<B>, ProxyError>) {
        if let Some(cause) = failure_cause(result) {
            self.leg_failure("decode", cause);
        }
    }

    /// A prefill leg answered whole after `secs`.
    pub fn prefill_took(&self, secs: f64) {
        self.prefill_duration.observe(secs);
    }

    /// A disaggregated request's first decode byte, `secs` after its arrival.
    pub fn first_token(&self, secs: f64) {
        self.ttft.observe(secs);
    }
}

/// Why an attempt failed (one of [`LEG_CAUSES`]); `None` for a 1xx–3xx answer.
pub fn failure_cause<B>(result: &Result<http::Response<B>, ProxyError>) -> Option<&'static str> {
    match result {
        Ok(r) if r.status().is_server_error() => Some("status_5xx"),
        Ok(r) if r.status().is_client_error() => Some("status_4xx"),
        Ok(_) => None,
        Err(ProxyError::Timeout(_)) => Some("timeout"),
        Err(ProxyError::Unreachable(_)) => Some("connect"),
        Err(_) => Some("upstream"),
    }
}

//! The families of stream continuation and hedging (see `crate::proxy::migrate` and
//! `crate::proxy::hedge`): what became of the streams that broke, by cause, why some
//! were not continued, and how hedges went. Every
//! label value is from a fixed list, each series present at 0 from the first scrape.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use crate::metrics::Metrics;

/// Why a stream broke: its worker's connection failed mid-body (`reset`) or closed before
/// the body's end (`closed`: a process killed), the engine sent an error event (`engine_error`),
/// its worker's drain ended (`drained`), its worker went silent (`idle_timeout`).
pub const CAUSES: [&str; 5] = ["reset", "closed", "engine_error", "drained", "idle_timeout"];

/// How a broken stream ended: `continued` on another worker; `ended` by the router (the
/// answer was already whole); `refused` (see [`REFUSALS`]); `failed` (no worker took the
/// continuation).
pub const OUTCOMES: [&str; 4] = ["continued", "ended", "refused", "failed"];

/// Why a broken stream was not continued.
pub const REFUSALS: [&str; 7] = [
    "n",
    "guided",
    "logprobs",
    "tool_call",
    "reasoning",
    "unsupported",
    "attempts",
];

/// How a hedge went: `won` (the second worker's first byte came first), `lost` (the
/// first worker's did), `failed` (neither answered; the request went on as a retry),
/// `capped` (due, but `hedge.max_share` was spent), `no_worker` (due, but no other
/// worker was usable).
pub const HEDGE_OUTCOMES: [&str; 5] = ["won", "lost", "failed", "capped", "no_worker"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MigrationLabels {
    cause: &'static str,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

/// See the module docs.
#[derive(Debug)]
pub struct StreamMetrics {
    migrations: Family<MigrationLabels, Counter>,
    refusals: Family<ReasonLabels, Counter>,
    hedges: Family<OutcomeLabels, Counter>,
}

impl StreamMetrics {
    /// The families with every series at 0, in no registry yet.
    pub(super) fn new() -> Self {
        let m = StreamMetrics {
            migrations: Family::default(),
            refusals: Family::default(),
            hedges: Family::default(),
        };
        for outcome in HEDGE_OUTCOMES {
            let _ = m.hedges.get_or_create(&OutcomeLabels { outcome });
        }
        for cause in CAUSES {
            for outcome in OUTCOMES {
                let _ = m
                    .migrations
                    .get_or_create(&MigrationLabels { cause, outcome });
            }
        }
        for reason in REFUSALS {
            let _ = m.refusals.get_or_create(&ReasonLabels { reason });
        }
        m
    }

    pub(super) fn register(&self, r: &mut Metrics) {
        r.register_family(
            "stream_migrations",
            "Streamed answers whose worker broke after bytes reached the client, by cause (reset, closed, engine_error, drained, idle_timeout: the worker's connection failed, closed mid-body, its engine sent an error event, its drain ended, it went silent) and outcome (continued on another worker; ended by the router, the answer being whole; refused; failed: no worker took it)",
            self.migrations.clone(),
        );
        r.register_family(
            "stream_migration_refusals",
            "Broken streams not continued, by reason (n, guided, logprobs, tool_call, reasoning, unsupported, attempts): each ended with an error event",
            self.refusals.clone(),
        );
        r.register_family(
            "hedges",
            "Streamed requests whose first token was late (hedge.after_ms), by outcome: won (the second worker answered first), lost (the first did), failed (neither), capped (hedge.max_share spent), no_worker (no other worker usable)",
            self.hedges.clone(),
        );
    }

    /// A hedge went as `outcome` (one of [`HEDGE_OUTCOMES`]).
    pub fn hedged(&self, outcome: &'static str) {
        self.hedges.get_or_create(&OutcomeLabels { outcome }).inc();
    }

    /// A stream broken by `cause` (one of [`CAUSES`]) ended as `outcome` (one of
    /// [`OUTCOMES`]).
    pub fn migrated(&self, cause: &'static str, outcome: &'static str) {
        self.migrations
            .get_or_create(&MigrationLabels { cause, outcome })
            .inc();
    }

    /// A stream broken by `cause` was not continued, for `reason` (one of
    /// [`REFUSALS`]).
    pub fn refused(&self, cause: &'static str, reason: &'static str) {
        self.migrated(cause, "refused");
        self.refusals.get_or_create(&ReasonLabels { reason }).inc();
    }
}

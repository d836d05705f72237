//! The registry behind `GET /metrics` and its naming rules, on `prometheus-client`.
//! Each part registers its own families here (the proxy its request path's, `reload`
//! its reloads, the pool, fleet, response cache and policy views their scrape-time
//! collectors) before the registry is shared; this module imports no part.
//!
//! Naming rules: every name gets the [`PREFIX`] (`cache_aware_router_`); counters end
//! in `_total` and durations in `_seconds` (the library adds both suffixes: register
//! `requests` as a counter, `decision_duration` with [`Unit::Seconds`]); help texts
//! are one sentence, the library (or `exposition` for a collector) adds its period. A
//! per-worker family labels the worker `worker` (its URL, as `/workers` lists it), and
//! its series go when the worker leaves the pool.

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::registry::{Metric, Registry, Unit};

/// Content type of [`Metrics::encode`]'s output (Prometheus text format 0.0.4).
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// The prefix of every family's name (with `_` after it).
pub const PREFIX: &str = "cache_aware_router";

/// A part called just before each scrape is encoded: e.g. to create a series at 0 for
/// every label value it knows now (each current worker), so a family is present from
/// the first scrape and a first increment is seen as one.
pub trait BeforeScrape: Send + Sync {
    /// Runs on the scraping request's task: keep it short and never block.
    fn before_scrape(&self);
}

/// A part that writes families as text at each scrape, after the registry's: what it
/// can only read as text (each pool's policy views, written per pool through a
/// registry of its own and labelled by the pool's model). A family it writes that
/// another writer wrote too is merged into one ([`crate::exposition::merge_families`]).
pub trait ScrapeText: Send + Sync {
    /// Appends Prometheus text families to `out`, names with the [`PREFIX`]. Runs on
    /// the scraping request's task: keep it short and never block.
    fn write(&self, out: &mut String);
}

/// The process's one registry: filled by the parts as `app` builds them, then shared
/// (read-only) with `/metrics`.
pub struct Metrics {
    registry: Registry,
    before: Vec<Arc<dyn BeforeScrape>>,
    texts: Vec<Arc<dyn ScrapeText>>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics")
            .field("registry", &self.registry)
            .finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// An empty registry with the [`PREFIX`].
    pub fn new() -> Self {
        Metrics {
            registry: Registry::with_prefix(PREFIX),
            before: Vec::new(),
            texts: Vec::new(),
        }
    }

    /// Adds a family (or a single metric) a part updates as things happen; `name`
    /// without the prefix or the `_total` suffix, `help` without its closing period.
    pub fn register_family(&mut self, name: &str, help: &str, metric: impl Metric) {
        self.registry.register(name, help, metric);
    }

    /// As [`Metrics::register_family`], with `unit`'s suffix (e.g. `_seconds`).
    pub fn register_family_with_unit(
        &mut self,
        name: &str,
        help: &str,
        unit: Unit,
        metric: impl Metric,
    ) {
        self.registry.register_with_unit(name, help, unit, metric);
    }

    /// Adds the families read from a part at each scrape (a policy's views: its tree,
    /// precise mode's index and feeds, sessions; the pool's gauges), written with
    /// `exposition`'s helpers. They follow the registered families in the exposition.
    pub fn register(&mut self, collector: Box<dyn Collector>) {
        self.registry.register_collector(collector);
    }

    /// Has `text` write its families at each scrape, after the registry's.
    pub fn register_text(&mut self, text: Arc<dyn ScrapeText>) {
        self.texts.push(text);
    }

    /// Has `hook` called before each scrape, in the order hooks were added.
    pub fn before_scrape(&mut self, hook: Arc<dyn BeforeScrape>) {
        self.before.push(hook);
    }

    /// Prometheus text exposition of every registered family, after the
    /// [`BeforeScrape`] hooks ran, then the [`ScrapeText`] writers' (each family once).
    pub fn encode(&self) -> String {
        for hook in &self.before {
            hook.before_scrape();
        }
        let mut out = String::with_capacity(16 * 1024);
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry);
        if self.texts.is_empty() {
            return out;
        }
        for t in &self.texts {
            t.write(&mut out);
        }
        crate::exposition::merge_families(&out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;

    /// Counts the scrapes it was told about in a counter of its own.
    struct Scrapes(Counter);

    impl BeforeScrape for Scrapes {
        fn before_scrape(&self) {
            self.0.inc();
        }
    }

    #[test]
    fn families_get_the_prefix_and_hooks_run_before_each_scrape() {
        let mut m = Metrics::new();
        let scrapes = Counter::default();
        m.register_family("scrapes", "Scrapes seen", scrapes.clone());
        m.before_scrape(Arc::new(Scrapes(scrapes)));
        assert!(
            m.encode()
                .contains("# HELP cache_aware_router_scrapes_total Scrapes seen.\n")
        );
        assert!(m.encode().contains("cache_aware_router_scrapes_total 2\n"));
    }
}

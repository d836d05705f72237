//! The engine's inter-token latency on its own clock: every gap between two consecutive
//! tokens of a request, at their nominal times (the ends of the steps that produced
//! them under the chunked physics; the decode timer's otherwise), in simulated seconds.
//! What a client measures adds its timers' tick and the machine's scheduling to it,
//! which at a small `time_factor` can exceed the gap itself.
//!
//! `GET /metrics` shows it as the histogram `sim:inter_token_latency_seconds`, with
//! bucket bounds 1 ms × 1.15^k (k = 0 … 79, up to about 62 s) so that percentiles
//! read from it are within 15 %.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

/// Finite bucket bounds.
const BUCKETS: usize = 80;

/// Upper bound of bucket `k`, in seconds.
fn bound(k: usize) -> f64 {
    1e-3 * 1.15f64.powi(k as i32)
}

/// Counts of inter-token gaps per bucket (the last one +Inf), their sum and count.
#[derive(Debug)]
pub(super) struct ItlHistogram {
    buckets: Vec<AtomicU64>,
    sum_us: AtomicU64,
    count: AtomicU64,
}

impl Default for ItlHistogram {
    fn default() -> Self {
        Self {
            buckets: (0..=BUCKETS).map(|_| AtomicU64::new(0)).collect(),
            sum_us: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }
}

impl ItlHistogram {
    /// Counts one gap of `secs` simulated seconds.
    pub(super) fn record(&self, secs: f64) {
        if !secs.is_finite() || secs < 0.0 {
            return;
        }
        let k = (0..BUCKETS).find(|&k| secs <= bound(k)).unwrap_or(BUCKETS);
        self.buckets[k].fetch_add(1, Ordering::Relaxed);
        self.sum_us
            .fetch_add((secs * 1e6).round() as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// The histogram in Prometheus text; `labels` are the series' other labels
    /// (`engine="0",model_name="m"`, without braces).
    pub(super) fn exposition(&self, labels: &str) -> String {
        let name = "sim:inter_token_latency_seconds";
        let mut out = format!(
            "# HELP {name} Gaps between consecutive tokens of a request on the engine's \
             clock, in simulated seconds.\n# TYPE {name} histogram\n"
        );
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cumulative = 0;
        for (k, b) in self.buckets.iter().enumerate() {
            cumulative += b.load(Ordering::Relaxed);
            let le = if k < BUCKETS {
                format!("{:.6}", bound(k))
            } else {
                "+Inf".into()
            };
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}{sep}le=\"{le}\"}} {cumulative}"
            );
        }
        let sum = self.sum_us.load(Ordering::Relaxed) as f64 / 1e6;
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
        let _ = writeln!(out, "{name}_count{{{labels}}} {count}");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gaps_land_in_their_buckets_cumulatively() {
        let h = ItlHistogram::default();
        for s in [0.0005, 0.015, 0.015, 0.2, 1e6] {
            h.record(s);
        }
        let text = h.exposition("engine=\"0\"");
        let count = |le: &str| -> u64 {
            let key =
                format!("sim:inter_token_latency_seconds_bucket{{engine=\"0\",le=\"{le}\"}} ");
            let line = text.lines().find(|l| l.starts_with(&key)).unwrap();
            line[key.len()..].parse().unwrap()
        };
        assert_eq!(count("0.001000"), 1);
        // 1.15^20 ms = 16.4 ms holds the two 15 ms gaps.
        assert_eq!(count(&format!("{:.6}", bound(20))), 3);
        assert_eq!(count("+Inf"), 5);
        assert!(text.contains("sim:inter_token_latency_seconds_count{engine=\"0\"} 5\n"));
    }
}

//! The settings grid `simulate` compares, its table, and the recommendation rule.
//!
//! Rows: `cache_aware` at the design defaults and with one knob moved at a time
//! (`cache.threshold`, `cache.match_abs_threshold`, the balance margins
//! `balance_abs_threshold` / `balance_rel_threshold` / `balance_match_threshold`), then
//! `cost_aware`,
//! `consistent_hash`, `prefix_hash`, `least_load` and `round_robin`. Each row is YAML layered on the
//! user's `-c` files, so a row reads exactly as a config would.
//!
//! **Recommendation**: among rows that rejected no request, those whose TTFT p99 is
//! within [`P99_SLACK`] of the best p99 of the grid; of those, the highest delivered hit
//! rate; ties (within 0.001) go to the lower p99, then to the earlier row. Pure: the
//! same measurements give the same pick.

use std::fmt::Write as _;

use super::run::Measured;

/// How far above the grid's best TTFT p99 a recommended row may be (0.10 = 10 %).
pub const P99_SLACK: f64 = 0.10;

/// One setting of the grid.
#[derive(Debug, Clone, PartialEq)]
pub struct Setting {
    /// What the table shows, e.g. `cache_aware threshold=0.5`.
    pub label: String,
    /// The YAML layered on the user's config (policy and cache keys).
    pub yaml: String,
    /// Whether adapter requests prefer the workers holding their adapter (the router's
    /// residency; only `--max-lora` runs have adapters).
    pub residency: bool,
}

/// Which rows `simulate` runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Grid {
    /// `cache_aware` at its defaults and with one knob moved at a time, then the other
    /// policies.
    #[default]
    Tuning,
    /// The tree's learning from short answers (`cache.learn_evictions`) off and on, for
    /// `cache_aware` and `cost_aware`, then `round_robin`.
    Learning,
}

/// The rows of `grid`, in table order.
pub fn settings(grid: Grid) -> Vec<Setting> {
    match grid {
        Grid::Tuning => tuning(),
        Grid::Learning => ["cache_aware", "cost_aware"]
            .into_iter()
            .flat_map(|p| {
                [false, true].map(|on| Setting {
                    label: format!("{p} learn_evictions={on}"),
                    yaml: format!("policy: {p}\ncache: {{ learn_evictions: {on} }}\n"),
                    residency: true,
                })
            })
            .chain(std::iter::once(Setting {
                label: "round_robin".into(),
                yaml: "policy: round_robin\n".into(),
                residency: true,
            }))
            .collect(),
    }
}

fn tuning() -> Vec<Setting> {
    let cache = |label: &str, keys: &str| Setting {
        label: format!("cache_aware {label}").trim_end().to_owned(),
        yaml: format!("policy: cache_aware\ncache: {{ {keys} }}\n"),
        residency: true,
    };
    let plain = |p: &str| Setting {
        label: p.to_owned(),
        yaml: format!("policy: {p}\n"),
        residency: true,
    };
    vec![
        cache("(defaults)", ""),
        cache("threshold=0.1", "threshold: 0.1"),
        cache("threshold=0.5", "threshold: 0.5"),
        cache("match_abs_threshold=2048", "match_abs_threshold: 2048"),
        cache("match_abs_threshold=32768", "match_abs_threshold: 32768"),
        cache(
            "balance=8/2.0",
            "balance_abs_threshold: 8, balance_rel_threshold: 2.0",
        ),
        cache(
            "balance=32/4.0",
            "balance_abs_threshold: 32, balance_rel_threshold: 4.0",
        ),
        cache("balance_match_threshold=0", "balance_match_threshold: 0"),
        cache(
            "balance_match_threshold=256",
            "balance_match_threshold: 256",
        ),
        plain("cost_aware"),
        plain("consistent_hash"),
        plain("prefix_hash"),
        plain("least_load"),
        plain("round_robin"),
    ]
}

/// `cache_aware` at its defaults without the router's adapter residency: adapter
/// requests placed by the policy alone (their prompts still keyed by adapter).
pub fn without_residency() -> Setting {
    Setting {
        label: "cache_aware (defaults), no adapter residency".to_owned(),
        yaml: "policy: cache_aware\n".to_owned(),
        residency: false,
    }
}

/// The recommended row's index (see the module docs); `None` for an empty grid.
pub fn recommend(rows: &[Measured]) -> Option<usize> {
    let eligible: Vec<usize> = (0..rows.len()).filter(|&i| rows[i].rejected == 0).collect();
    let pool = if eligible.is_empty() {
        (0..rows.len()).collect()
    } else {
        eligible
    };
    let p99 = |i: usize| rows[i].ttft_quantile(0.99);
    let best = pool.iter().map(|&i| p99(i)).fold(f64::INFINITY, f64::min);
    let hit = |i: usize| rows[i].ratio(rows[i].delivered_tokens);
    pool.into_iter()
        .filter(|&i| p99(i) <= best * (1.0 + P99_SLACK) + 1e-9)
        .reduce(|a, b| {
            let (ha, hb) = (hit(a), hit(b));
            if hb > ha + 1e-3 || ((hb - ha).abs() <= 1e-3 && p99(b) < p99(a)) {
                b
            } else {
                a
            }
        })
}

/// The markdown table: one row per setting, the recommended one marked.
pub fn table(settings: &[Setting], rows: &[Measured], recommended: Option<usize>) -> String {
    let adapters = rows.iter().any(|m| m.adapter_loads.is_some());
    let mut t = String::from(
        "| setting | available | predicted | delivered | d÷p | aged out (MB) | max/mean req | \
         peak in-flight | TTFT p50 / p99 (ms) | rejected |",
    );
    let columns = 10 + usize::from(adapters);
    t.push_str(if adapters {
        " adapter loads/min | |\n"
    } else {
        " |\n"
    });
    t.push_str(&format!("| --- |{} --- |\n", " ---: |".repeat(columns - 1)));
    for (i, (s, m)) in settings.iter().zip(rows).enumerate() {
        let loads = match m.loads_per_minute() {
            Some(l) if adapters => format!(" {l:.1} |"),
            _ if adapters => " - |".to_owned(),
            _ => String::new(),
        };
        let _ = writeln!(
            t,
            "| {} | {:.3} | {:.3} | {:.3} | {:.2} | {:.1} | {:.2} | {} | {:.0} / {:.0} | {} |{loads} {} |",
            s.label,
            m.ratio(m.available_tokens),
            m.ratio(m.predicted_tokens),
            m.ratio(m.delivered_tokens),
            m.predicted_hit_delivered as f64 / m.predicted_tokens.max(1) as f64,
            m.aged_out_bytes as f64 / 1e6,
            m.max_over_mean(),
            m.peak_in_flight,
            m.ttft_quantile(0.5),
            m.ttft_quantile(0.99),
            m.rejected,
            if recommended == Some(i) {
                "**recommended**"
            } else {
                ""
            },
        );
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(delivered: u64, p99: f64, rejected: u64) -> Measured {
        Measured {
            requests: 1,
            rejected,
            prompt_tokens: 1000,
            delivered_tokens: delivered,
            ttft_ms: vec![p99],
            per_worker: vec![1],
            ..Measured::default()
        }
    }

    #[test]
    fn recommends_the_best_hit_rate_within_the_p99_slack() {
        // Row 1 has the best hit rate but a p99 20 % above the best: out.
        let rows = [row(100, 100.0, 0), row(300, 120.0, 0), row(200, 105.0, 0)];
        assert_eq!(recommend(&rows), Some(2));
    }

    #[test]
    fn ties_go_to_the_lower_p99_then_the_earlier_row() {
        let rows = [row(200, 104.0, 0), row(200, 100.0, 0), row(200, 100.0, 0)];
        assert_eq!(recommend(&rows), Some(1));
    }

    #[test]
    fn a_row_that_rejected_requests_is_not_recommended() {
        let rows = [row(100, 100.0, 0), row(900, 50.0, 3)];
        assert_eq!(recommend(&rows), Some(0));
        assert_eq!(recommend(&[]), None);
    }

    #[test]
    fn the_table_marks_the_recommended_row() {
        let s = settings(Grid::Tuning);
        let rows: Vec<Measured> = s.iter().map(|_| row(100, 10.0, 0)).collect();
        let t = table(&s, &rows, Some(0));
        assert_eq!(t.matches("**recommended**").count(), 1);
        assert!(t.lines().nth(2).unwrap().contains("**recommended**"));
    }
}

//! The markdown tables of a comparison and the target checks under them.

use std::fmt::Write as _;

use super::{Contender, ContenderRun, Peer};

/// The comparison table (markdown), one row per contender. Hit rates are also
/// shown as a share of the `ideal` row's, when there is one. "longest queue" is
/// the most requests waiting for prefill on one engine ([`QueueStats::longest_queue`]),
/// "queued while idle" the share of queue samples in which an engine had ≥ 2
/// waiting while another had nothing waiting or running (– with one engine).
///
/// [`QueueStats::longest_queue`]: crate::stats::QueueStats::longest_queue
pub fn render_table(rows: &[(String, Result<ContenderRun, String>)]) -> String {
    let ideal_label = Contender::Ideal.label();
    let ideal = rows.iter().find_map(|(l, r)| match r {
        Ok(run) if *l == ideal_label && run.summary.hit_rate > 0.0 => Some(run.summary.hit_rate),
        _ => None,
    });
    let mut t = String::from(
        "| contender | requests | errors | hit rate | of ideal | TTFT p50 / p99 (ms) | end-to-end p50 / p99 (ms) | throughput (req/s, out tok/s) | max/mean req per worker | longest queue | queued while idle | router peak RSS | router CPU s |\n\
         | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    for (label, row) in rows {
        match row {
            Ok(run) => {
                let s = &run.summary;
                let of_ideal = ideal.map_or("–".to_string(), |i| {
                    format!("{:.0} %", 100.0 * s.hit_rate / i)
                });
                let timing = if *label == ideal_label {
                    "(reference) | (reference) | (reference)".to_string()
                } else {
                    format!(
                        "{:.0} / {:.0} | {:.0} / {:.0} | {:.1} req/s, {:.0} tok/s",
                        s.ttft_ms.p50,
                        s.ttft_ms.p99,
                        s.latency_ms.p50,
                        s.latency_ms.p99,
                        s.req_per_s,
                        s.out_tok_per_s,
                    )
                };
                let (rss, cpu) = match &run.router {
                    Some(u) => (
                        format!("{:.0} MiB", u.peak_rss_kib as f64 / 1024.0),
                        format!("{:.1}", u.cpu_s),
                    ),
                    None => ("–".into(), "–".into()),
                };
                let spread = if s.per_engine.len() > 1 {
                    format!("{:.2}", s.max_over_mean)
                } else {
                    "–".into()
                };
                let (longest, idle) = match &s.queue {
                    Some(q) => (
                        q.longest_queue().to_string(),
                        if q.engines.len() > 1 && q.samples > 0 {
                            format!("{:.1} %", 100.0 * q.queued_while_idle_share())
                        } else {
                            "–".into()
                        },
                    ),
                    None => ("–".into(), "–".into()),
                };
                let _ = writeln!(
                    t,
                    "| {label} | {} | {} | {:.3} | {of_ideal} | {timing} | {spread} | {longest} | {idle} | {rss} | {cpu} |",
                    s.requests, s.errors, s.hit_rate,
                );
            }
            Err(e) => {
                let first = e.lines().next().unwrap_or("");
                let _ = writeln!(
                    t,
                    "| {label} | – | – | – | – | – | – | – | – | – | – | – | failed: {first} |"
                );
            }
        }
    }
    t
}

/// The router-replicas table (markdown): one row per contender with a router, with
/// how many router processes it ran, the requests that got no answer (after the
/// client's one retry on the next replica), those retried, hit rate, TTFT, and the
/// fleet channel's traffic per request replayed: Redis `PUBLISH`es and their bytes
/// summed over the replicas (out), and what the replicas received (in).
pub fn render_fleet_table(rows: &[(String, Result<ContenderRun, String>)]) -> String {
    let mut t = String::from(
        "| contender | routers | requests | failed (no answer) | retried on the other replica | hit rate | TTFT p50 / p99 (ms) | Redis messages / request (out, in) | Redis bytes / request (out, in) |\n\
         | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    for (label, row) in rows {
        match row {
            Ok(run) if run.routers > 0 => {
                let s = &run.summary;
                let per = |x: u64, digits: usize| {
                    format!("{:.digits$}", x as f64 / s.requests.max(1) as f64)
                };
                let (msgs, bytes) = match &run.fleet {
                    Some(f) => (
                        format!("{}, {}", per(f.messages_out, 2), per(f.messages_in, 2)),
                        format!("{}, {}", per(f.bytes_out, 0), per(f.bytes_in, 0)),
                    ),
                    None => ("–".into(), "–".into()),
                };
                let _ = writeln!(
                    t,
                    "| {label} | {} | {} | {} | {} | {:.3} | {:.0} / {:.0} | {msgs} | {bytes} |",
                    run.routers,
                    s.requests,
                    s.errors,
                    s.retried,
                    s.hit_rate,
                    s.ttft_ms.p50,
                    s.ttft_ms.p99,
                );
            }
            Ok(_) => {}
            Err(e) => {
                let first = e.lines().next().unwrap_or("");
                let _ = writeln!(
                    t,
                    "| {label} | – | – | – | – | – | – | – | failed: {first} |"
                );
            }
        }
    }
    t
}

/// The fleet targets: each sharing row's hit rate within 0.01 of the one-router row of
/// the same policy, beside the independent replicas' figure, and the failures of a row
/// with a replica killed. One line per sharing row; empty without the rows needed.
pub fn check_fleet(
    rows: &[(String, Result<ContenderRun, String>)],
    contenders: &[Contender],
) -> String {
    let summary = |want: &dyn Fn(&Contender) -> bool| {
        contenders.iter().zip(rows).find_map(|(c, (_, r))| match r {
            Ok(run) if want(c) => Some(&run.summary),
            _ => None,
        })
    };
    let mut out = String::new();
    for (c, (label, row)) in contenders.iter().zip(rows) {
        let (Contender::Replicas(r), Ok(run)) = (c, row) else {
            continue;
        };
        if !r.shared {
            continue;
        }
        let Some(one) = summary(&|x| *x == Contender::Router(r.policy.clone())) else {
            continue;
        };
        let independent = summary(
            &|x| matches!(x, Contender::Replicas(o) if o.policy == r.policy && o.n == r.n && !o.shared && !o.kill_one),
        );
        let s = &run.summary;
        let close = (s.hit_rate - one.hit_rate).abs() <= 0.01;
        let _ = writeln!(
            out,
            "- {label}: hit rate {:.3} vs one router's {:.3} (within 0.01: {}){}{}",
            s.hit_rate,
            one.hit_rate,
            if close { "met" } else { "**MISSED**" },
            independent.map_or(String::new(), |i| format!(
                "; {} independent replicas: {:.3}",
                r.n, i.hit_rate
            )),
            if r.kill_one {
                format!(
                    "; {} of {} requests failed (no answer), {} retried on the other replica",
                    s.errors, s.requests, s.retried
                )
            } else {
                String::new()
            }
        );
    }
    out
}

/// The replay targets, checked for our `cache_aware` row against the peers'
/// rows and the `ideal` row: hit rate ≥ the best peer's, ≥ 90 % of the ideal's,
/// max/mean requests per worker ≤ 1.2. One line per target; empty when the rows
/// needed are missing.
pub fn check_targets(rows: &[(String, Result<ContenderRun, String>)], ours: &str) -> String {
    let ok = |label: &str| {
        rows.iter().find_map(|(l, r)| match r {
            Ok(run) if l == label => Some(&run.summary),
            _ => None,
        })
    };
    let Some(us) = ok(ours) else {
        return String::new();
    };
    let mut out = String::new();
    let mark = |met: bool| if met { "met" } else { "**MISSED**" };
    let best_peer = rows
        .iter()
        .filter(|(l, _)| Peer::ALL.iter().any(|p| l.starts_with(p.name())))
        .filter_map(|(l, r)| r.as_ref().ok().map(|run| (l, run.summary.hit_rate)))
        .max_by(|a, b| a.1.total_cmp(&b.1));
    if let Some((l, h)) = best_peer {
        let _ = writeln!(
            out,
            "- hit rate ≥ best peer's: {:.3} vs {:.3} ({l}): {}",
            us.hit_rate,
            h,
            mark(us.hit_rate >= h)
        );
    }
    if let Some(ideal) = ok(&Contender::Ideal.label()) {
        let share = if ideal.hit_rate > 0.0 {
            us.hit_rate / ideal.hit_rate
        } else {
            0.0
        };
        let _ = writeln!(
            out,
            "- hit rate ≥ 90 % of the ideal's: {:.3} = {:.0} % of {:.3}: {}",
            us.hit_rate,
            share * 100.0,
            ideal.hit_rate,
            mark(share >= 0.9)
        );
    }
    let _ = writeln!(
        out,
        "- max/mean requests per worker ≤ 1.2: {:.2}: {}",
        us.max_over_mean,
        mark(us.max_over_mean <= 1.2)
    );
    out
}

//! Section 1, `added`: latency of small chat requests straight to one engine against
//! through the router, per concurrency, non-streamed and streamed.

use std::fmt::Write as _;
use std::time::Duration;

use bench::load;
use bench::procs::{self, ChildProc, addr_of, secs};
use bench::stats::Percentiles;

use crate::env::{Env, pct_cell, small_bodies, usage};
use crate::{Cli, Report};

/// Section 1: added latency.
pub async fn run(env: &Env, cli: &Cli, procs: &mut Vec<ChildProc>) -> Report {
    let params = env.engine(cli.time_factor, 4096);
    let urls = env.engines(1, &params, procs).await?;
    let router = env.router(&urls, "", "added", procs).await?;
    let direct = vec![addr_of(&urls[0])?];
    let via = vec![router.addr];
    let max = secs(cli.added_max_s / 2.0, "--added-max-s")?;
    let mut t = String::new();
    let _ = writeln!(
        t,
        "## 1. Added latency (µs): one engine (time factor {}), direct vs through the router\n\n\
         Small chat requests (system + user message, {} bytes of JSON, max_tokens {}), closed loop, \
         one keep-alive connection per concurrent client. Each figure merges two halves run \
         direct, router, router, direct. added = router − direct. Router CPU (utime+stime) and \
         write/writev calls (`syscw` of /proc/PID/io; socket reads use recv, not counted there) \
         are per request over the router's two halves.\n",
        cli.time_factor,
        small_bodies(cli.max_tokens, false)(0).len(),
        cli.max_tokens
    );
    t.push_str(
        "| request | c | requests direct / router | direct p50 | router p50 | **added p50** | direct p99 | router p99 | **added p99** | req/s direct / router | router CPU µs/req | router write syscalls/req | errors |\n\
         | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    let mut ok = true;
    for stream in [false, true] {
        let body = small_bodies(cli.max_tokens, stream);
        for (&c, &n) in cli.added_concurrency.iter().zip(&cli.added_requests) {
            eprintln!("   stream={stream} c={c} n={n}");
            let warm = (n / 10).clamp(4 * c as u64, 2_000);
            for target in [&direct, &via] {
                load::run(&env.spec(
                    target.clone(),
                    c,
                    warm,
                    Duration::from_secs(5),
                    &body,
                    stream,
                ))
                .await;
            }
            let half = n / 2;
            let mut d = load::run(&env.spec(direct.clone(), c, half, max, &body, stream)).await;
            let (u0, io0) = (usage(router.pid), procs::proc_syscalls(router.pid));
            let mut r = load::run(&env.spec(via.clone(), c, half, max, &body, stream)).await;
            r.merge(load::run(&env.spec(via.clone(), c, n - half, max, &body, stream)).await);
            let (u1, io1) = (usage(router.pid), procs::proc_syscalls(router.pid));
            let per_req = r.samples.len().max(1) as f64;
            let router_cpu = env.cpu_s(&u0, &u1) * 1e6 / per_req;
            let router_sys = match (io0, io1) {
                (Some((_, w0)), Some((_, w1))) => {
                    format!("{:.1}", w1.saturating_sub(w0) as f64 / per_req)
                }
                _ => "–".into(),
            };
            d.merge(load::run(&env.spec(direct.clone(), c, n - half, max, &body, stream)).await);
            let errors = format!("{} / {}", d.errors, r.errors);
            ok &= d.errors == 0 && r.errors == 0;
            for (e, first) in [(&d, "direct"), (&r, "router")] {
                if let Some(err) = &e.first_error {
                    eprintln!("   {first}: {} errors, first: {err}", e.errors);
                }
            }
            let rows: Vec<(&str, Percentiles, Percentiles)> = if stream {
                vec![
                    ("streamed, end of stream", d.latency_us(), r.latency_us()),
                    ("streamed, first byte", d.ttfb_us(), r.ttfb_us()),
                ]
            } else {
                vec![("non-streamed", d.latency_us(), r.latency_us())]
            };
            for (label, pd, pr) in rows {
                let _ = writeln!(
                    t,
                    "| {label} | {c} | {} / {} | {} | {} | **{:+.0}** | {} | {} | **{:+.0}** | {:.0} / {:.0} | {router_cpu:.0} | {router_sys} | {errors} |",
                    d.samples.len(),
                    r.samples.len(),
                    pct_cell(pd.p50),
                    pct_cell(pr.p50),
                    pr.p50 - pd.p50,
                    pct_cell(pd.p99),
                    pct_cell(pr.p99),
                    pr.p99 - pd.p99,
                    d.req_per_s(),
                    r.req_per_s(),
                );
            }
        }
    }
    if !ok {
        let _ = writeln!(t, "\nrouter log tail:\n```\n{}\n```", router.log_tail());
    }
    Ok((t, ok))
}

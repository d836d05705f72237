//! Section 2, `saturation`: requests/s through the router and straight to the engines
//! at high concurrency, with the router's CPU and peak RSS; then with the router
//! pinned alone on CPU 0.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::time::Duration;

use bench::load::{self, BodyFn};
use bench::procs::{self, ChildProc, addr_of, secs};

use crate::env::{Env, mib, pin, small_bodies, usage, usage_sum};
use crate::{Cli, Report};

/// Section 2: saturation.
pub async fn run(env: &Env, cli: &Cli, procs: &mut Vec<ChildProc>) -> Report {
    let params = env.engine(cli.time_factor, 4096);
    let urls = env
        .engines(cli.saturation_engines.max(1), &params, procs)
        .await?;
    let engine_pids: Vec<u32> = procs.iter().filter_map(ChildProc::pid).collect();
    let router = env.router(&urls, "", "saturation", procs).await?;
    let direct: Vec<SocketAddr> = urls.iter().map(|u| addr_of(u)).collect::<Result<_, _>>()?;
    let via = vec![router.addr];
    let phase = secs(cli.saturation_s, "--saturation-s")?;
    let body = small_bodies(cli.max_tokens, false);
    let me = std::process::id();
    let idle = usage(router.pid);
    let mut t = String::new();
    let _ = writeln!(
        t,
        "## 2. Saturation: {} engines (time factor {}), non-streamed, {:.0} s per row\n\n\
         Router RSS idle before the first row: {}. Router peak RSS is VmHWM, reset at the start \
         of each row{}. CPU s are utime+stime over the row (1.00 s per s = one core busy).\n",
        urls.len(),
        cli.time_factor,
        phase.as_secs_f64(),
        mib(idle.rss_kib),
        if procs::reset_peak_rss(router.pid).is_ok() {
            ""
        } else {
            " (reset failed: peak since start)"
        },
    );
    t.push_str(
        "| placement | target | c | requests | errors | req/s | p50 µs | p99 µs | router CPU s (cores) | router CPU µs/req | router peak RSS | engines CPU s | client CPU s |\n\
         | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
    let all_cpus = format!("0-{}", ncpu - 1);
    let mut placements = vec![("shared", None)];
    if ncpu >= 2 && !cli.no_saturation_pin {
        placements.push(("router pinned", Some(format!("1-{}", ncpu - 1))));
    }
    let rows = Rows {
        env,
        router_pid: router.pid,
        engine_pids: &engine_pids,
        phase,
        body: &body,
    };
    let mut ok = true;
    let mut notes = Vec::new();
    for (place, others) in placements {
        if let Some(others) = &others {
            // The router alone on CPU 0; this process and the engines on the rest.
            let pinned = pin(router.pid, "0").and_then(|()| {
                engine_pids
                    .iter()
                    .chain([&me])
                    .try_for_each(|&p| pin(p, others))
            });
            if let Err(e) = pinned {
                notes.push(format!("pinning skipped: {e}"));
                let _ = pin(me, &all_cpus);
                break;
            }
        }
        let targets: &[(&str, &Vec<SocketAddr>)] = if others.is_some() {
            &[("router", &via)]
        } else {
            &[("router", &via), ("direct (client round robin)", &direct)]
        };
        for &c in &cli.saturation_concurrency {
            for &(label, target) in targets {
                ok &= rows.row(place, label, target, c, &mut t).await;
            }
        }
        if others.is_some() {
            // Later sections run in this process: give it every CPU back.
            if let Err(e) = pin(me, &all_cpus) {
                notes.push(format!("could not unpin this process: {e}"));
            }
        }
    }
    let _ = writeln!(
        t,
        "\nshared: every process may run on every CPU (client, router and engines compete). \
         router pinned: the router alone on CPU 0, client and engines on CPU {} (`taskset`), \
         so a router at 1.00 cores is the bottleneck and req/s is its capacity on one core. \
         Peak RSS includes what earlier rows left allocated.",
        if ncpu > 2 {
            format!("1–{}", ncpu - 1)
        } else {
            "1".into()
        }
    );
    for n in notes {
        let _ = writeln!(t, "\n{n}");
    }
    if !ok {
        let _ = writeln!(t, "\nrouter log tail:\n```\n{}\n```", router.log_tail());
    }
    Ok((t, ok))
}

/// What every row of the section shares.
struct Rows<'a> {
    env: &'a Env,
    router_pid: u32,
    engine_pids: &'a [u32],
    /// Length of a measured row.
    phase: Duration,
    body: &'a BodyFn,
}

impl Rows<'_> {
    /// One row: 1 s of warm-up, then `phase` at concurrency `c` on `target`, with
    /// the router's, the engines' and this process's CPU and the router's peak RSS;
    /// false when it saw errors.
    async fn row(
        &self,
        place: &str,
        label: &str,
        target: &[SocketAddr],
        c: usize,
        t: &mut String,
    ) -> bool {
        let me = std::process::id();
        eprintln!("   {place}: {label} c={c}");
        load::run(&self.env.spec(
            target.to_vec(),
            c,
            50_000,
            Duration::from_secs(1),
            self.body,
            false,
        ))
        .await;
        let _ = procs::reset_peak_rss(self.router_pid);
        let (r0, e0, m0) = (
            usage(self.router_pid),
            usage_sum(self.engine_pids),
            usage(me),
        );
        let res =
            load::run(
                &self
                    .env
                    .spec(target.to_vec(), c, 5_000_000, self.phase, self.body, false),
            )
            .await;
        let (r1, e1, m1) = (
            usage(self.router_pid),
            usage_sum(self.engine_pids),
            usage(me),
        );
        if let Some(err) = &res.first_error {
            eprintln!("   {} errors, first: {err}", res.errors);
        }
        let p = res.latency_us();
        let wall = res.elapsed.as_secs_f64().max(1e-9);
        let router_cells = if label == "router" {
            let cpu = self.env.cpu_s(&r0, &r1);
            format!(
                "{cpu:.2} ({:.2}) | {:.0} | {}",
                cpu / wall,
                cpu * 1e6 / res.samples.len().max(1) as f64,
                mib(r1.hwm_kib)
            )
        } else {
            format!("{:.2} (idle) | – | –", self.env.cpu_s(&r0, &r1))
        };
        let _ = writeln!(
            t,
            "| {place} | {label} | {c} | {} | {} | {:.0} | {:.0} | {:.0} | {router_cells} | {:.2} | {:.2} |",
            res.samples.len(),
            res.errors,
            res.req_per_s(),
            p.p50,
            p.p99,
            self.env.cpu_s(&e0, &e1),
            self.env.cpu_s(&m0, &m1),
        );
        res.errors == 0
    }
}

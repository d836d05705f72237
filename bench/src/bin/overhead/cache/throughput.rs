//! The cache section's throughput table: hits per second at `--cache-concurrency`,
//! with the router's, the engine's, Redis's and this process's CPU over each row.

use std::fmt::Write as _;
use std::time::Duration;

use bench::load::{self, BodyFn};
use bench::procs::secs;

use super::{CacheTarget, Setup};
use crate::Cli;
use crate::env::{Env, small_bodies, usage};

/// Writes the table into `t`; false when a row saw errors or a request that was not
/// a hit (or, cache off, went to the engine).
pub async fn table(env: &Env, cli: &Cli, setup: &Setup, t: &mut String) -> Result<bool, String> {
    let c = cli.cache_concurrency.max(1);
    let phase = secs(cli.cache_phase_s, "--cache-phase-s")?;
    let targets = setup.targets();
    let thr_targets = [targets[0], targets[1], targets[3], targets[5]];
    let _ = writeln!(
        t,
        "\n### Hits per second at concurrency {c}\n\n\
         {:.0} s per row after 1 s of warm-up, the 256 stored bodies (the cache-off row sends \
         the same ones to the engine). Everything shares the machine's CPUs: the load \
         generator, router, engine and Redis compete, as in section 2's shared rows. CPU s \
         are utime+stime over the row.\n",
        phase.as_secs_f64()
    );
    t.push_str(
        "| request | target | requests | errors | req/s | p50 µs | p99 µs | router CPU s (cores) | router CPU µs/req | engine CPU s | Redis CPU µs/req | client CPU s | x-cache |\n\
         | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n",
    );
    let mut ok = true;
    for stream in [false, true] {
        let body = small_bodies(cli.max_tokens, stream);
        for tg in &thr_targets {
            ok &= row(env, setup, tg, &body, stream, (c, phase), t).await?;
        }
    }
    Ok(ok)
}

/// One row: 1 s of warm-up, then `phase` at concurrency `c` (`load`).
async fn row(
    env: &Env,
    setup: &Setup,
    tg: &CacheTarget<'_>,
    body: &BodyFn,
    stream: bool,
    (c, phase): (usize, Duration),
    t: &mut String,
) -> Result<bool, String> {
    let request = if stream { "streamed" } else { "non-streamed" };
    let (engine_pid, redis_pid, me) = (setup.engine_pid, setup.redis_pid, std::process::id());
    eprintln!("   {request}: {} c={c}", tg.label.replace("**", ""));
    load::run(&env.spec(
        vec![tg.addr],
        c,
        50_000,
        Duration::from_secs(1),
        body,
        stream,
    ))
    .await;
    let (e0, r0, m0) = (usage(engine_pid), usage(redis_pid), usage(me));
    let row = env
        .cache_run(
            tg,
            &env.spec(vec![tg.addr], c, 5_000_000, phase, body, stream),
        )
        .await?;
    let (e1, r1, m1) = (usage(engine_pid), usage(redis_pid), usage(me));
    let (x, x_ok) = row.x_cache(tg.expect);
    if let Some(e) = &row.res.first_error {
        eprintln!("   {} errors, first: {e}", row.res.errors);
    }
    let p = row.res.latency_us();
    let wall = row.res.elapsed.as_secs_f64().max(1e-9);
    let per = row.res.samples.len().max(1) as f64;
    let router_cells = if tg.router.is_some() {
        format!(
            "{:.2} ({:.2}) | {:.0}",
            row.router_cpu_s,
            row.router_cpu_s / wall,
            row.router_cpu_s * 1e6 / per
        )
    } else {
        "– | –".into()
    };
    let redis_cell = if tg.router.is_some_and(|r| std::ptr::eq(r, &setup.redis)) {
        format!("{:.0}", env.cpu_s(&r0, &r1) * 1e6 / per)
    } else {
        "–".into()
    };
    let _ = writeln!(
        t,
        "| {request} | {} | {} | {} | {:.0} | {:.0} | {:.0} | {router_cells} | {:.2} | {redis_cell} | {:.2} | {x} |",
        tg.label,
        row.res.samples.len(),
        row.res.errors,
        row.res.req_per_s(),
        p.p50,
        p.p99,
        env.cpu_s(&e0, &e1),
        env.cpu_s(&m0, &m1),
    );
    Ok(x_ok && row.res.errors == 0)
}

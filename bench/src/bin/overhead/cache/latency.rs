//! The cache section's latency table: concurrency 1, every target in turn, the hit
//! keys stored first, each row in two halves run in the order of the rows and then
//! back (drift cancels).

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use bench::load::{self, BodyFn};
use bench::procs::secs;

use super::counters::{cache_counters, wait_stores};
use super::{CacheRouter, CacheRow, CacheTarget, Fresh, Setup, fresh_bodies};
use crate::Cli;
use crate::env::{CHAT, Env, small_bodies};

/// Writes the table into `t`; false when a row saw errors or a request that was not
/// what its row is about.
pub async fn table(
    env: &Env,
    cli: &Cli,
    setup: &Setup,
    fresh: &mut Fresh,
    t: &mut String,
) -> Result<bool, String> {
    let n = cli.cache_requests.max(2);
    let max = secs(cli.added_max_s / 2.0, "--added-max-s")?;
    let targets = setup.targets();
    let _ = writeln!(
        t,
        "### Latency at concurrency 1 (µs)\n\n\
         {n} requests per row, in two halves run in the order of the rows and then back \
         (drift cancels). added = row − direct, per percentile. Router CPU is utime+stime \
         over the row's requests.\n"
    );
    t.push_str(
        "| request | path | requests | p50 | p99 | **added p50** | **added p99** | router CPU µs/req | x-cache | errors |\n\
         | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |\n",
    );
    let mut ok = true;
    for stream in [false, true] {
        let rows = measure(env, cli, setup, fresh, stream, n, max).await?;
        ok &= write_rows(t, &targets, &rows, stream);
    }
    Ok(ok)
}

/// Stores the hit keys, warms every target up, then runs `n` requests per target in
/// two halves; one row per target, in the order of [`Setup::targets`].
async fn measure(
    env: &Env,
    cli: &Cli,
    setup: &Setup,
    fresh: &mut Fresh,
    stream: bool,
    n: u64,
    max: Duration,
) -> Result<Vec<CacheRow>, String> {
    let targets = setup.targets();
    let repeated = small_bodies(cli.max_tokens, stream);
    eprintln!("   stream={stream}: storing the 256 hit keys");
    for r in [&setup.mem, &setup.redis] {
        warm_keys(env, r, &repeated, 256, stream).await?;
    }
    let half = n / 2;
    let warm = (n / 10).clamp(50, 500);
    let body_for = |tg: &CacheTarget<'_>, fresh: &mut Fresh, count: u64| {
        if tg.fresh() {
            fresh_bodies(cli.max_tokens, stream, fresh.take(count))
        } else {
            Arc::clone(&repeated)
        }
    };
    eprintln!("   stream={stream}: c=1, {n} requests per row");
    for tg in &targets {
        let body = body_for(tg, fresh, warm);
        env.cache_run(tg, &env.spec(vec![tg.addr], 1, warm, max, &body, stream))
            .await?;
    }
    let mut rows: Vec<CacheRow> = targets.iter().map(|_| CacheRow::default()).collect();
    let order: Vec<(usize, u64)> = (0..targets.len())
        .map(|i| (i, half))
        .chain((0..targets.len()).rev().map(|i| (i, n - half)))
        .collect();
    for (i, count) in order {
        let tg = &targets[i];
        let body = body_for(tg, fresh, count);
        let row = env
            .cache_run(tg, &env.spec(vec![tg.addr], 1, count, max, &body, stream))
            .await?;
        rows[i].merge(row);
    }
    Ok(rows)
}

/// One line per target, added latency against the first (direct); false when a row
/// saw errors or a request that was not what its row is about.
fn write_rows(
    t: &mut String,
    targets: &[CacheTarget<'_>],
    rows: &[CacheRow],
    stream: bool,
) -> bool {
    let request = if stream {
        "streamed, end of stream"
    } else {
        "non-streamed"
    };
    let mut ok = true;
    let pd = rows[0].res.latency_us();
    for (tg, row) in targets.iter().zip(rows) {
        let p = row.res.latency_us();
        let (x, x_ok) = row.x_cache(tg.expect);
        ok &= x_ok && row.res.errors == 0;
        if let Some(e) = &row.res.first_error {
            eprintln!("   {}: {} errors, first: {e}", tg.label, row.res.errors);
        }
        let per = row.res.samples.len().max(1) as f64;
        let (added50, added99) = if tg.router.is_some() {
            (
                format!("**{:+.0}**", p.p50 - pd.p50),
                format!("**{:+.0}**", p.p99 - pd.p99),
            )
        } else {
            ("–".into(), "–".into())
        };
        let cpu = if tg.router.is_some() {
            format!("{:.0}", row.router_cpu_s * 1e6 / per)
        } else {
            "–".into()
        };
        let _ = writeln!(
            t,
            "| {request} | {} | {} | {:.0} | {:.0} | {added50} | {added99} | {cpu} | {x} | {} |",
            tg.label,
            row.res.samples.len(),
            p.p50,
            p.p99,
            row.res.errors,
        );
    }
    ok
}

/// Stores the answers of `body`'s first `n` requests in `r` (one at a time) and
/// checks that the first is then a hit (`x-cache: hit`).
async fn warm_keys(
    env: &Env,
    r: &CacheRouter,
    body: &BodyFn,
    n: u64,
    stream: bool,
) -> Result<(), String> {
    let c0 = cache_counters(&r.admin).await?;
    let res = load::run(&env.spec(
        vec![r.proc.addr],
        1,
        n,
        Duration::from_secs(10),
        body,
        stream,
    ))
    .await;
    if let Some(e) = res.first_error {
        return Err(format!(
            "warming the cache keys: {} errors, first: {e}",
            res.errors
        ));
    }
    let c1 = wait_stores(
        &r.admin,
        c0.stored + c0.not_stored + n,
        Duration::from_secs(10),
    )
    .await?;
    let (_, headers, _) = r.admin.call(CHAT, Some(body(0))).await?;
    let x = headers
        .get("x-cache")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("(none)");
    if x != "hit" {
        return Err(format!(
            "after warming {n} keys ({} stored, {} not stored, {} store errors) the first \
             answers x-cache: {x}, not hit\nrouter log tail:\n{}",
            c1.stored.saturating_sub(c0.stored),
            c1.not_stored.saturating_sub(c0.not_stored),
            c1.store_errors.saturating_sub(c0.store_errors),
            r.proc.log_tail()
        ));
    }
    Ok(())
}

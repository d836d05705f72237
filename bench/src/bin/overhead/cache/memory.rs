//! The cache section's memory table: two fresh routers (cache on, cache off) sent the
//! same distinct requests; router RSS against the store's entries and bytes, per entry.

use std::fmt::Write as _;
use std::time::Duration;

use bench::load::{self, BodyFn};
use bench::procs::ChildProc;

use super::counters::{CacheCounters, RC, cache_counters, wait_stores};
use super::{CacheRouter, Fresh, MEM_YAML, fresh_bodies};
use crate::Cli;
use crate::env::{Admin, CHAT, Env, mib, usage};

/// One reading of the memory rows.
#[derive(Debug, Clone, Copy, Default)]
struct MemPoint {
    requests: u64,
    rss_kib: u64,
    entries: u64,
    bytes: u64,
    evictions: u64,
    tree_nodes: u64,
}

async fn mem_point(r: &CacheRouter, requests: u64, cache_on: bool) -> Result<MemPoint, String> {
    let c = if cache_on {
        cache_counters(&r.admin).await?
    } else {
        CacheCounters::default()
    };
    let w = r.admin.workers().await?;
    Ok(MemPoint {
        requests,
        rss_kib: usage(r.proc.pid).rss_kib,
        entries: c.entries,
        bytes: c.bytes,
        evictions: c.evictions,
        tree_nodes: w["tree_nodes"].as_u64().unwrap_or(0),
    })
}

/// The requests every memory router is sent: `entries` distinct ones from question
/// `first`, in two steps (the first `tenth`, then the rest), at concurrency `c`.
struct Fill {
    first: u64,
    entries: u64,
    tenth: u64,
    c: usize,
    max_tokens: u64,
}

impl Fill {
    fn body(&self, from: u64) -> BodyFn {
        fresh_bodies(self.max_tokens, false, from)
    }
}

/// RSS growth of one router: bytes per stored answer (cache on) or per request (cache
/// off) from the first tenth to all, the same over the whole fill from idle, and the
/// last reading.
type Growth = (f64, f64, MemPoint);

/// Writes the table into `t`; false when a fill saw errors or not every answer was
/// stored.
pub async fn table(
    env: &Env,
    cli: &Cli,
    urls: &[String],
    fresh: &mut Fresh,
    procs: &mut Vec<ChildProc>,
    t: &mut String,
) -> Result<bool, String> {
    let entries = cli.cache_entries.max(10);
    let fill = Fill {
        first: fresh.take(entries),
        entries,
        tenth: entries / 10,
        c: cli.cache_concurrency.max(1),
        max_tokens: cli.cache_entry_tokens,
    };
    let answer_bytes = {
        let engine = Admin::new(&urls[0])?;
        let (status, _, b) = engine.call(CHAT, Some(fill.body(fill.first)(0))).await?;
        if !status.is_success() {
            return Err(format!(
                "the engine answered {status} to a memory-row request"
            ));
        }
        b.len()
    };
    let _ = writeln!(
        t,
        "\n### Memory per stored answer (in-process store)\n\n\
         Two fresh routers, one with the in-process cache and one with it off, each sent the \
         same {entries} distinct non-streamed chat requests (concurrency {}, {} bytes of \
         JSON each, max_tokens {}: answers of {answer_bytes} bytes), in two steps: the first \
         {}, then the rest; each reading after every answer was stored. The cache-off \
         router grows by its radix tree (the same prompts) and whatever the request path \
         keeps; the difference is the cache's. Store bytes and entries are \
         `{RC}bytes` / `{RC}entries`.\n",
        fill.c,
        fill.body(fill.first)(0).len(),
        cli.cache_entry_tokens,
        fill.tenth,
    );
    t.push_str(
        "| router | point | requests | entries | store bytes | tree_nodes | router RSS |\n\
         | --- | --- | ---: | ---: | ---: | ---: | ---: |\n",
    );
    let mut ok = true;
    let mut marginal = Vec::new();
    for (label, yaml, cache_on) in [
        ("cache off", "", false),
        ("in-process cache", MEM_YAML, true),
    ] {
        let (growth, fill_ok) =
            fill_router(env, &fill, urls, (label, yaml, cache_on), procs, t).await?;
        marginal.push(growth);
        ok &= fill_ok;
    }
    if let [(off_m, off_w, _), (on_m, on_w, on_b)] = marginal[..] {
        let weight = on_b.bytes as f64 / on_b.entries.max(1) as f64;
        let _ = writeln!(
            t,
            "\nRSS growth from the first tenth to all: cache on {on_m:.0} bytes per stored \
             answer, cache off {off_m:.0} bytes per request; **the cache's share: {:.0} bytes \
             per entry** (whole fill from idle: {on_w:.0} − {off_w:.0} = {:.0}). The store's own \
             weight: **{weight:.0} bytes per entry** (`{RC}bytes` / `{RC}entries`: the \
             {answer_bytes}-byte body, the content type and a fixed 128 bytes of accounted \
             overhead); the RSS share is {:.1}× that. {} evictions.",
            on_m - off_m,
            on_w - off_w,
            (on_m - off_m) / weight.max(1.0),
            on_b.evictions,
        );
    }
    Ok(ok)
}

/// Starts a fresh router with `yaml`, sends it the fill in two steps and writes its
/// rows; its growth, and false when it saw errors or did not store every answer.
async fn fill_router(
    env: &Env,
    fill: &Fill,
    urls: &[String],
    (label, yaml, cache_on): (&str, &str, bool),
    procs: &mut Vec<ChildProc>,
    t: &mut String,
) -> Result<(Growth, bool), String> {
    eprintln!("   memory: {label}, {} distinct requests", fill.entries);
    let r = env
        .cache_router(urls, yaml, &format!("cache_mem_{cache_on}"), procs)
        .await?;
    let idle = mem_point(&r, 0, cache_on).await?;
    let mut points = vec![("idle", idle)];
    let mut errors = 0;
    for (step, from, count) in [
        ("after the first tenth", fill.first, fill.tenth),
        (
            "after all",
            fill.first + fill.tenth,
            fill.entries - fill.tenth,
        ),
    ] {
        let res = load::run(&env.spec(
            vec![r.proc.addr],
            fill.c,
            count,
            Duration::from_secs(30),
            &fill.body(from),
            false,
        ))
        .await;
        errors += res.errors;
        if let Some(e) = &res.first_error {
            eprintln!("   {} errors, first: {e}", res.errors);
        }
        let done = points.last().map_or(0, |p| p.1.requests) + res.samples.len() as u64;
        if cache_on {
            wait_stores(&r.admin, done, Duration::from_secs(10)).await?;
        }
        points.push((step, mem_point(&r, done, cache_on).await?));
    }
    let mut ok = errors == 0;
    for (point, p) in &points {
        let _ = writeln!(
            t,
            "| {label} | {point} | {} | {} | {} | {} | {} |",
            p.requests,
            if cache_on {
                p.entries.to_string()
            } else {
                "–".into()
            },
            if cache_on {
                mib(p.bytes / 1024)
            } else {
                "–".into()
            },
            p.tree_nodes,
            mib(p.rss_kib)
        );
    }
    let (a, b) = (points[1].1, points[2].1);
    // Per stored answer with the cache on, per request with it off.
    let (da, db) = if cache_on {
        (a.entries, b.entries)
    } else {
        (a.requests, b.requests)
    };
    let rss = (b.rss_kib.saturating_sub(a.rss_kib) * 1024) as f64;
    let whole = (b.rss_kib.saturating_sub(idle.rss_kib) * 1024) as f64;
    let growth = (
        rss / db.saturating_sub(da).max(1) as f64,
        whole / db.max(1) as f64,
        b,
    );
    if cache_on && b.entries < b.requests {
        ok = false;
        let _ = writeln!(
            t,
            "\n**only {} of {} answers stored**",
            b.entries, b.requests
        );
    }
    if errors > 0 {
        let _ = writeln!(t, "\nrouter log tail:\n```\n{}\n```", r.proc.log_tail());
    }
    Ok((growth, ok))
}

//! Section 6, `soak`: the new-turn workload (every request inserts into the tree) for
//! `--soak-s` at `--soak-concurrency` against a router whose tree is capped low enough
//! (`--soak-tree-size` nodes) to reach its cap early; the router's RSS, the tree's
//! nodes and bytes read every `--soak-every-s`: whether memory stays flat once the
//! tree is at its cap.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use bench::load::{self, LoadSpec};
use bench::procs::{ChildProc, secs};
use tokio::time::Instant;

use crate::env::{Admin, Env, mib, usage};
use crate::{Cli, Report};

/// One reading.
#[derive(Debug, Clone, Copy, Default)]
struct Point {
    elapsed_s: f64,
    requests: u64,
    nodes: u64,
    bytes: u64,
    rss_kib: u64,
    cpu_ticks: u64,
}

/// Section 6: RSS over a long run of new turns with the tree at its cap.
pub async fn run(env: &Env, cli: &Cli, procs: &mut Vec<ChildProc>) -> Report {
    let params = env.engine(0.0, 4096);
    let urls = env.engines(4, &params, procs).await?;
    let cap = cli.soak_tree_size;
    let router = env
        .router(
            &urls,
            &format!("cache: {{ max_tree_size: {cap} }}\n"),
            "soak",
            procs,
        )
        .await?;
    let admin = Admin::new(&router.url)?;
    let length = secs(cli.soak_s, "--soak-s")?;
    let every = secs(cli.soak_every_s, "--soak-every-s")?;
    let stop = Arc::new(AtomicBool::new(false));
    let progress = Arc::new(AtomicU64::new(0));
    let body = load::new_turn_bodies(cli.max_tokens, false, 2048);
    let spec = LoadSpec {
        stop: Some(Arc::clone(&stop)),
        progress: Some(Arc::clone(&progress)),
        ..env.spec(
            vec![router.addr],
            cli.soak_concurrency,
            u64::MAX,
            length,
            &body,
            false,
        )
    };
    eprintln!(
        "   new turns at c={} for {:.0} s, tree capped at {cap} nodes",
        cli.soak_concurrency,
        length.as_secs_f64()
    );
    let t0 = Instant::now();
    let load = tokio::spawn(async move { load::run(&spec).await });
    let mut points = Vec::new();
    while !load.is_finished() {
        let w = admin.workers().await.unwrap_or_default();
        let u = usage(router.pid);
        points.push(Point {
            elapsed_s: t0.elapsed().as_secs_f64(),
            requests: progress.load(Ordering::Relaxed),
            nodes: w["tree_nodes"].as_u64().unwrap_or(0),
            bytes: w["tree_bytes"].as_u64().unwrap_or(0),
            rss_kib: u.rss_kib,
            cpu_ticks: u.cpu_ticks,
        });
        if points.len() % 12 == 0 {
            let p = points[points.len() - 1];
            eprintln!(
                "   {:.0} s: {} requests, {} nodes, RSS {}",
                p.elapsed_s,
                p.requests,
                p.nodes,
                mib(p.rss_kib)
            );
        }
        tokio::time::sleep(every).await;
    }
    stop.store(true, Ordering::Relaxed);
    let res = load.await.map_err(|e| format!("load task: {e}"))?;
    let ok = res.errors == 0;
    let mut t = String::new();
    let _ = writeln!(
        t,
        "## 6. Soak: new turns with the tree at its cap\n\n\
         4 engines (time factor 0), `cache: {{max_tree_size: {cap}}}` (eviction every 60 s, \
         and within a second once an eighth past the cap); ~2 KB chat bodies, each one of 8 \
         system prompts and a new user turn (every request inserts into the tree), \
         non-streamed, concurrency {}, {:.0} s: {} requests ({:.0} req/s), {} errors.\n",
        cli.soak_concurrency,
        length.as_secs_f64(),
        res.samples.len() as u64 + res.errors,
        res.req_per_s(),
        res.errors,
    );
    t.push_str(&table(env, &points));
    if let Some(e) = &res.first_error {
        let _ = writeln!(t, "\nfirst error: {e}");
    }
    Ok((t, ok))
}

/// A row a minute (and the last reading), then RSS at 2 minutes against the end.
fn table(env: &Env, points: &[Point]) -> String {
    let mut t = String::from(
        "| elapsed | requests | tree_nodes | tree_bytes | router RSS | router CPU µs/req since the last row |\n\
         | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    let mut last: Option<Point> = None;
    let mut next_minute = 0.0;
    for (i, p) in points.iter().enumerate() {
        if p.elapsed_s < next_minute && i + 1 < points.len() {
            continue;
        }
        next_minute = (p.elapsed_s / 60.0).floor() * 60.0 + 60.0;
        let cpu = last.map_or("–".into(), |l| {
            let ticks = p.cpu_ticks.saturating_sub(l.cpu_ticks) as f64;
            let reqs = p.requests.saturating_sub(l.requests).max(1) as f64;
            format!("{:.0}", ticks / env.clk_tck as f64 * 1e6 / reqs)
        });
        let _ = writeln!(
            t,
            "| {:.0} s | {} | {} | {} | {} | {cpu} |",
            p.elapsed_s,
            p.requests,
            p.nodes,
            mib(p.bytes / 1024),
            mib(p.rss_kib)
        );
        last = Some(*p);
    }
    let at = |s: f64| points.iter().find(|p| p.elapsed_s >= s).copied();
    if let (Some(two), Some(end)) = (at(120.0), points.last())
        && end.elapsed_s > two.elapsed_s
    {
        let _ = writeln!(
            t,
            "\nRSS after {:.0} s: {}; at the end ({:.0} s): {} = {:+.1} % (target: within 10 %). \
             Per tree node at the end: {:.0} bytes of RSS, {:.0} bytes of edge text.",
            two.elapsed_s,
            mib(two.rss_kib),
            end.elapsed_s,
            mib(end.rss_kib),
            (end.rss_kib as f64 / two.rss_kib.max(1) as f64 - 1.0) * 100.0,
            end.rss_kib as f64 * 1024.0 / end.nodes.max(1) as f64,
            end.bytes as f64 / end.nodes.max(1) as f64,
        );
    }
    t
}

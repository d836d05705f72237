//! Section 4, `tree`: router RSS while its radix tree fills with distinct prompts to
//! `--tree-nodes`, and bytes per node.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bench::load::{self, BodyFn, LoadSpec};
use bench::procs::{ChildProc, secs};
use bench::prompts::{SplitMix64, WORDS};
use bytes::Bytes;
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::env::{Admin, Env, SYSTEM, mib, usage};
use crate::{Cli, Report};

/// Distinct prompts for the tree fill: the shared system prompt, then a user
/// message of pseudo-random words (seeded by the index) up to about
/// `prompt_bytes` of routing text in all.
fn tree_bodies(prompt_bytes: usize) -> BodyFn {
    let user_bytes = prompt_bytes.saturating_sub(SYSTEM.len() + 16).max(16);
    Arc::new(move |i| {
        let mut rng = SplitMix64::new(i ^ 0x7472_6565_6669_6c6c);
        let mut text = String::with_capacity(user_bytes + 16);
        while text.len() < user_bytes {
            if !text.is_empty() {
                text.push(' ');
            }
            text.push_str(WORDS[(rng.next_u64() % WORDS.len() as u64) as usize]);
        }
        let v = json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": text},
            ],
            "max_tokens": 1,
        });
        Bytes::from(v.to_string())
    })
}

/// One reading during the tree fill.
#[derive(Debug, Clone, Copy, Default)]
struct TreePoint {
    elapsed_s: f64,
    requests: u64,
    nodes: u64,
    bytes: u64,
    rss_kib: u64,
}

async fn tree_point(
    admin: &Admin,
    pid: u32,
    t0: Instant,
    requests: u64,
) -> Result<TreePoint, String> {
    let w = admin.workers().await?;
    Ok(TreePoint {
        elapsed_s: t0.elapsed().as_secs_f64(),
        requests,
        nodes: w["tree_nodes"].as_u64().unwrap_or(0),
        bytes: w["tree_bytes"].as_u64().unwrap_or(0),
        rss_kib: usage(pid).rss_kib,
    })
}

/// Section 4: router RSS with a large tree.
pub async fn run(env: &Env, cli: &Cli, procs: &mut Vec<ChildProc>) -> Report {
    let target = cli.tree_nodes;
    let params = env.engine(cli.time_factor, 1);
    let urls = env.engines(1, &params, procs).await?;
    let max_tree = (target * 2).max(2_000_000);
    let router = env
        .router(
            &urls,
            &format!("cache: {{ max_tree_size: {max_tree}, eviction_interval_secs: 0 }}\n"),
            "tree",
            procs,
        )
        .await?;
    let admin = Arc::new(Admin::new(&router.url)?);
    let t0 = Instant::now();
    let before = tree_point(&admin, router.pid, t0, 0).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let progress = Arc::new(AtomicU64::new(0));
    let body = tree_bodies(cli.tree_prompt_bytes);
    let routing_bytes = routing_bytes(&body);
    let monitor = spawn_monitor(
        Arc::clone(&admin),
        router.pid,
        t0,
        secs(cli.tree_max_s + 30.0, "--tree-max-s")?,
        target,
        (Arc::clone(&stop), Arc::clone(&progress)),
    );
    let spec = LoadSpec {
        stop: Some(Arc::clone(&stop)),
        progress: Some(Arc::clone(&progress)),
        ..env.spec(
            vec![router.addr],
            cli.tree_concurrency,
            target.saturating_mul(2),
            secs(cli.tree_max_s, "--tree-max-s")?,
            &body,
            false,
        )
    };
    eprintln!(
        "   filling the tree to {target} nodes (at most {:.0} s)",
        cli.tree_max_s
    );
    let res = load::run(&spec).await;
    stop.store(true, Ordering::Relaxed);
    let points = monitor.await.unwrap_or_default();
    let end = tree_point(&admin, router.pid, t0, progress.load(Ordering::Relaxed)).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let idle_after = tree_point(&admin, router.pid, t0, end.requests).await?;
    let ok = res.errors == 0;
    if let Some(e) = &res.first_error {
        eprintln!("   {} errors, first: {e}", res.errors);
    }
    let mut t = String::new();
    let _ = writeln!(
        t,
        "## 4. Router RSS with a large tree\n\n\
         1 engine (time factor {}), `cache: {{max_tree_size: {max_tree}, eviction_interval_secs: 0}}`; \
         distinct chat prompts of ~{routing_bytes} bytes of routing text (shared ~{} byte system \
         prompt + pseudo-random words), non-streamed, max_tokens 1, concurrency {}. \
         Fill: {} requests in {:.1} s ({:.0} req/s), {} errors; target {target} nodes{}.\n",
        cli.time_factor,
        SYSTEM.len(),
        cli.tree_concurrency,
        res.samples.len() as u64 + res.errors,
        res.elapsed.as_secs_f64(),
        res.req_per_s(),
        res.errors,
        if end.nodes >= target {
            " (reached)"
        } else {
            " (NOT reached within --tree-max-s)"
        }
    );
    t.push_str(&points_table(&before, &points, &end, &idle_after));
    if !ok {
        let _ = writeln!(t, "\nrouter log tail:\n```\n{}\n```", router.log_tail());
    }
    Ok((t, ok))
}

/// Routing text of a tree request, in bytes: what the router keys on, "role: content\n"
/// per message (approximately).
fn routing_bytes(body: &BodyFn) -> usize {
    let b = body(0);
    let v: Value = serde_json::from_slice(&b).unwrap_or_default();
    v["messages"].as_array().map_or(0, |ms| {
        ms.iter()
            .map(|m| {
                m["role"].as_str().unwrap_or("").len()
                    + 3
                    + m["content"].as_str().unwrap_or("").len()
            })
            .sum::<usize>()
    })
}

/// Reads the tree every 500 ms while it fills (a line to stderr every 10 s) until
/// `stop` or `max` after `t0`; sets `stop` once `target` nodes are reached. The
/// readings, in order.
fn spawn_monitor(
    admin: Arc<Admin>,
    pid: u32,
    t0: Instant,
    max: Duration,
    target: u64,
    (stop, progress): (Arc<AtomicBool>, Arc<AtomicU64>),
) -> tokio::task::JoinHandle<Vec<TreePoint>> {
    tokio::spawn(async move {
        let mut points = Vec::new();
        let mut last_print = Instant::now();
        while !stop.load(Ordering::Relaxed) && t0.elapsed() < max {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let Ok(p) = tree_point(&admin, pid, t0, progress.load(Ordering::Relaxed)).await else {
                continue;
            };
            if last_print.elapsed() >= Duration::from_secs(10) {
                eprintln!(
                    "   {:.0} s: {} requests, {} nodes, RSS {}",
                    p.elapsed_s,
                    p.requests,
                    p.nodes,
                    mib(p.rss_kib)
                );
                last_print = Instant::now();
            }
            points.push(p);
            if p.nodes >= target {
                stop.store(true, Ordering::Relaxed);
            }
        }
        points
    })
}

/// The readings before, during (~10, 25, 50, 75 % of the end's nodes), at the end and
/// 1 s after the fill; then RSS per node.
fn points_table(
    before: &TreePoint,
    points: &[TreePoint],
    end: &TreePoint,
    idle_after: &TreePoint,
) -> String {
    let (before, end) = (*before, *end);
    let mut t = String::new();
    t.push_str(
        "| point | elapsed s | requests | tree_nodes | tree_bytes | router RSS |\n\
         | --- | ---: | ---: | ---: | ---: | ---: |\n",
    );
    let mut row = |label: String, p: &TreePoint| {
        let _ = writeln!(
            t,
            "| {label} | {:.1} | {} | {} | {} | {} |",
            p.elapsed_s,
            p.requests,
            p.nodes,
            mib(p.bytes / 1024),
            mib(p.rss_kib)
        );
    };
    row("idle, before".into(), &before);
    for frac in [0.1, 0.25, 0.5, 0.75] {
        let want = (end.nodes as f64 * frac) as u64;
        if let Some(p) = points.iter().find(|p| p.nodes >= want) {
            row(format!("~{:.0} %", frac * 100.0), p);
        }
    }
    row("end of fill".into(), &end);
    row("idle, 1 s later".into(), idle_after);
    let grown = end.nodes.saturating_sub(before.nodes).max(1);
    let per_node = (end.rss_kib.saturating_sub(before.rss_kib) * 1024) as f64 / grown as f64;
    let tenth = points
        .iter()
        .find(|p| p.nodes >= end.nodes / 10)
        .copied()
        .unwrap_or(before);
    let marginal = (end.rss_kib.saturating_sub(tenth.rss_kib) * 1024) as f64
        / end.nodes.saturating_sub(tenth.nodes).max(1) as f64;
    let _ = writeln!(
        t,
        "\nRSS per node: {per_node:.0} bytes (end − before, over {grown} nodes); marginal from ~10 % \
         to end: {marginal:.0} bytes/node; edge text alone: {:.0} bytes/node (tree_bytes / nodes); \
         {:.2} nodes per request.",
        end.bytes as f64 / end.nodes.max(1) as f64,
        end.nodes as f64 / end.requests.max(1) as f64,
    );
    t
}

//! Section 3, `streams5k`: thousands of connections to the router, one streamed
//! request on each; errors, connect times, router CPU, RSS and open fds, and every
//! worker's `in_flight` afterwards.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bench::load::{self, BurstSpec};
use bench::procs::{self, ChildProc, EngineParams, ProcUsage};
use bench::stats::Percentiles;
use tokio::time::Instant;

use crate::env::{Admin, CHAT, Env, RouterProc, in_flight, mib, open_fds, small_bodies, usage};
use crate::{Cli, Report};

/// What one round of the streams section measured.
struct StreamRound {
    res: load::BurstResult,
    /// Router usage at the start of the connect phase, at the release, at the end
    /// of the last stream, and once `in_flight` was read back.
    before: ProcUsage,
    released: ProcUsage,
    done: ProcUsage,
    after: ProcUsage,
    /// VmHWM was reset at the start of the round.
    reset_ok: bool,
    /// Highest RSS of the 200 ms samples.
    sampled_peak_rss_kib: u64,
    peak_in_flight: u64,
    /// First `/workers` reading after the last stream, and when.
    first_read: Option<(Vec<u64>, Duration)>,
    /// Last reading, and when every `in_flight` was 0 (None: not within 10 s).
    last_read: Vec<u64>,
    zero_after: Option<Duration>,
    /// Router's open file descriptors at the end of the round.
    fds_after: usize,
    /// `(s after the round, RSS KiB)` read every second over the rest that follows it.
    rest: Vec<(f64, u64)>,
}

async fn stream_round(spec: &BurstSpec, router: &RouterProc, admin: &Arc<Admin>) -> StreamRound {
    let reset_ok = procs::reset_peak_rss(router.pid).is_ok();
    // Sample /workers and the router's RSS while the streams run.
    let stop = Arc::new(AtomicBool::new(false));
    let peak_in_flight = Arc::new(AtomicU64::new(0));
    let peak_rss = Arc::new(AtomicU64::new(0));
    let monitor = {
        let (stop, peak_in_flight, peak_rss, admin) = (
            Arc::clone(&stop),
            Arc::clone(&peak_in_flight),
            Arc::clone(&peak_rss),
            Arc::clone(admin),
        );
        let pid = router.pid;
        tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(600);
            while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                if let Ok(w) = admin.workers().await {
                    let sum: u64 = in_flight(&w).iter().sum();
                    peak_in_flight.fetch_max(sum, Ordering::Relaxed);
                }
                peak_rss.fetch_max(usage(pid).rss_kib, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    let before = usage(router.pid);
    let released = std::cell::Cell::new(before);
    let res = load::burst(spec, || released.set(usage(router.pid))).await;
    let done = usage(router.pid);
    let done_at = Instant::now();
    stop.store(true, Ordering::Relaxed);
    let _ = monitor.await;
    // The guard is released when the router's body ends, a moment after the
    // client saw the end: poll for a while.
    let mut first_read = None;
    let mut zero_after = None;
    let mut last_read = Vec::new();
    while done_at.elapsed() < Duration::from_secs(10) {
        if let Ok(w) = admin.workers().await {
            last_read = in_flight(&w);
            first_read.get_or_insert_with(|| (last_read.clone(), done_at.elapsed()));
            if last_read.iter().all(|&x| x == 0) {
                zero_after = Some(done_at.elapsed());
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    StreamRound {
        res,
        before,
        released: released.get(),
        done,
        after: usage(router.pid),
        reset_ok,
        sampled_peak_rss_kib: peak_rss.load(Ordering::Relaxed),
        peak_in_flight: peak_in_flight.load(Ordering::Relaxed),
        first_read,
        last_read,
        zero_after,
        fds_after: open_fds(router.pid),
        rest: Vec::new(),
    }
}

/// Section 3: thousands of concurrent streams, `--streams-rounds` times on the
/// same router (a second round tells retained memory from growth).
pub async fn run(env: &Env, cli: &Cli, nofile: u64, procs: &mut Vec<ChildProc>) -> Report {
    let n = cli.streams;
    if nofile < n as u64 + 256 {
        return Err(format!(
            "{n} streams need about {} open files; this process may open {nofile} (raise `ulimit -n`)",
            n + 256
        ));
    }
    let params = EngineParams {
        ttft_base_ms: 0.0,
        prefill_us_per_token: 0.0,
        itl_ms: cli.streams_itl_ms,
        ..env.engine(1.0, cli.streams_tokens)
    };
    let urls = env
        .engines(cli.streams_engines.max(1), &params, procs)
        .await?;
    let router = env.router(&urls, "", "streams", procs).await?;
    let admin = Arc::new(Admin::new(&router.url)?);
    let idle = usage(router.pid);
    let spec = BurstSpec {
        targets: vec![router.addr],
        path: CHAT.into(),
        n,
        connect_parallelism: cli.streams_connect_parallelism,
        connect_phase_timeout: Duration::from_secs(60),
        request_timeout: env.request_timeout,
        stream: true,
        body: small_bodies(cli.streams_tokens, true),
    };
    let rest = bench::procs::secs(cli.streams_rest_s, "--streams-rest-s")?;
    let mut rounds = Vec::new();
    for r in 0..cli.streams_rounds.max(1) {
        eprintln!(
            "   round {}: opening {n} connections, then one stream on each",
            r + 1
        );
        let mut round = stream_round(&spec, &router, &admin).await;
        // Rest, reading RSS: does the memory the burst took come back?
        let series = procs::RssSeries::start(router.pid, Duration::from_secs(1));
        tokio::time::sleep(rest).await;
        round.rest = series.finish().await;
        rounds.push(round);
    }
    let ok = rounds
        .iter()
        .all(|x| x.res.connect_errors == 0 && x.res.requests.errors == 0 && x.zero_after.is_some());
    let nominal = (cli.streams_tokens.saturating_sub(1)) as f64 * cli.streams_itl_ms / 1000.0;
    let mut t = String::new();
    let _ = writeln!(
        t,
        "## 3. {n} concurrent streams through the router\n\n\
         {} engines, each stream {} tokens at {} ms ITL (nominal {nominal:.1} s), prefill 0. \
         Per round the client opens {n} connections to the router (≤ {} connects at a time), \
         then sends one streamed chat request on each, all released together; rounds reuse \
         the same router. Router RSS idle before round 1: {}.\n",
        urls.len(),
        cli.streams_tokens,
        cli.streams_itl_ms,
        cli.streams_connect_parallelism,
        mib(idle.rss_kib),
    );
    t.push_str(&round_table(env, &rounds));
    // Idle upstream connections close after proxy.pool_idle_timeout_secs (4 s),
    // found by a sweep that runs every 4 s: wait for two sweeps.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let rested = usage(router.pid);
    let _ = writeln!(
        t,
        "\nAfter 10 s idle (pooled upstream connections expire after 4 s idle, swept every 4 s): \
         router RSS {}, {} open fds.",
        mib(rested.rss_kib),
        open_fds(router.pid)
    );
    if !ok {
        let _ = writeln!(t, "\nrouter log tail:\n```\n{}\n```", router.log_tail());
    }
    Ok((t, ok))
}

/// One row per metric, one column per round.
fn round_table(env: &Env, rounds: &[StreamRound]) -> String {
    let mut t = String::new();
    t.push_str("| metric |");
    for i in 0..rounds.len() {
        let _ = write!(t, " round {} |", i + 1);
    }
    t.push_str("\n| --- |");
    t.push_str(&" ---: |".repeat(rounds.len()));
    t.push('\n');
    let mut row = |k: &str, cell: &dyn Fn(&StreamRound) -> String| {
        let _ = write!(t, "| {k} |");
        for x in rounds {
            let _ = write!(t, " {} |", cell(x).replace('|', "\\|"));
        }
        t.push('\n');
    };
    row("connections opened / connect errors", &|x| {
        format!(
            "{} / {} in {:.2} s",
            x.res.connected,
            x.res.connect_errors,
            x.res.connect_phase.as_secs_f64()
        )
    });
    row("connect time p50 / p99 / max", &|x| {
        let ms: Vec<f64> = x.res.connect_us.iter().map(|&u| u as f64 / 1e3).collect();
        let p = Percentiles::of(&ms);
        let max = ms.iter().copied().fold(0.0, f64::max);
        format!("{:.1} / {:.1} / {max:.1} ms", p.p50, p.p99)
    });
    row("streams completed / errors", &|x| {
        format!(
            "**{} / {}**",
            x.res.requests.samples.len(),
            x.res.requests.errors
        )
    });
    row("first error", &|x| {
        x.res
            .requests
            .first_error
            .clone()
            .unwrap_or_else(|| "–".into())
    });
    row("all streams done after release", &|x| {
        format!("{:.2} s", x.res.requests.elapsed.as_secs_f64())
    });
    row("stream duration p50 / p99", &|x| {
        let p = x.res.requests.latency_us();
        format!("{:.2} / {:.2} s", p.p50 / 1e6, p.p99 / 1e6)
    });
    row("time to first byte p50 / p99", &|x| {
        let p = x.res.requests.ttfb_us();
        format!("{:.0} / {:.0} ms", p.p50 / 1e3, p.p99 / 1e3)
    });
    row("peak Σ in_flight in GET /workers (200 ms samples)", &|x| {
        x.peak_in_flight.to_string()
    });
    row("router CPU: connect phase / streams", &|x| {
        let s = x.res.requests.elapsed.as_secs_f64().max(1e-9);
        let streams = env.cpu_s(&x.released, &x.done);
        format!(
            "{:.2} s / {streams:.2} s ({:.2} cores)",
            env.cpu_s(&x.before, &x.released),
            streams / s
        )
    });
    row("router RSS: start / peak / after", &|x| {
        let peak = if x.reset_ok {
            x.done.hwm_kib.max(x.after.hwm_kib)
        } else {
            x.sampled_peak_rss_kib
        };
        format!(
            "{} / {}{} / {}",
            mib(x.before.rss_kib),
            mib(peak),
            if x.reset_ok { "" } else { " (sampled)" },
            mib(x.after.rss_kib)
        )
    });
    row("router RSS during the rest after the round", &|x| {
        procs::rss_over_time(&x.rest, 5)
    });
    row("RSS back within 30 MB of the round's start", &|x| {
        let mb = |kib: u64| kib as f64 * 1024.0 / 1e6;
        match x
            .rest
            .iter()
            .find(|(_, kib)| mb(*kib) <= mb(x.before.rss_kib) + 30.0)
        {
            Some((s, _)) => format!("**after {s:.0} s**"),
            None => "**no**".into(),
        }
    });
    row("router open fds after the round", &|x| {
        x.fds_after.to_string()
    });
    row(
        "in_flight per worker after the last stream",
        &|x| match x.zero_after {
            Some(z) => {
                let (v, at) = x.first_read.clone().unwrap_or_default();
                format!(
                    "**{:?}** (first read {v:?} at {:.0} ms, all 0 at {:.0} ms)",
                    x.last_read,
                    at.as_secs_f64() * 1e3,
                    z.as_secs_f64() * 1e3
                )
            }
            None => format!("**{:?}: not all 0 after 10 s**", x.last_read),
        },
    );
    t
}

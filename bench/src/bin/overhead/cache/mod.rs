//! Section 5, `cache`: the response cache. Hit and miss latency at concurrency 1
//! (`latency`), hits per second (`throughput`), memory per stored answer (`memory`),
//! every request's outcome checked against the router's own counters (`counters`).

mod counters;
mod latency;
mod memory;
mod throughput;

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bench::load::{self, BodyFn, LoadSpec};
use bench::procs::{self, ChildProc, ScratchDir, addr_of};
use bytes::Bytes;
use serde_json::json;

use crate::env::{Admin, Env, RouterProc, SYSTEM, small_bodies, usage};
use crate::{Cli, Report};
use counters::{CacheCounters, RC, cache_counters, wait_stores};

/// Small chat requests shaped like [`small_bodies`] (same system prompt and
/// `max_tokens`), each with a question of its own: request `i` asks question number
/// `first + i`. Numbers from 1,000,000 up never meet the 256 of [`small_bodies`] and
/// keep every body the same length, so each one is a response-cache miss.
fn fresh_bodies(max_tokens: u64, stream: bool, first: u64) -> BodyFn {
    Arc::new(move |i| {
        let k = first + i;
        let mut v = json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": format!("Question {k}: which river flows through city number {k}?")},
            ],
            "max_tokens": max_tokens,
            "ignore_eos": true,
        });
        if stream {
            v["stream"] = json!(true);
            v["stream_options"] = json!({"include_usage": true});
        }
        Bytes::from(v.to_string())
    })
}

/// Numbers for [`fresh_bodies`]: each run takes a range no other run has used.
struct Fresh(u64);

impl Fresh {
    fn take(&mut self, n: u64) -> u64 {
        let first = self.0;
        self.0 += n;
        first
    }
}

/// A router of the cache section and its admin client.
struct CacheRouter {
    proc: RouterProc,
    admin: Admin,
}

/// One row's target in the cache section.
#[derive(Clone, Copy)]
struct CacheTarget<'a> {
    label: &'static str,
    addr: SocketAddr,
    router: Option<&'a CacheRouter>,
    /// What every request should be: `hit`, `miss`, or `None` (no cache).
    expect: Option<&'static str>,
}

impl CacheTarget<'_> {
    /// Requests that are cache misses get a question of their own.
    fn fresh(&self) -> bool {
        self.router.is_some() && self.expect != Some("hit")
    }
}

/// What the runs of one row measured.
#[derive(Default)]
struct CacheRow {
    res: load::LoadResult,
    router_cpu_s: f64,
    delta: CacheCounters,
}

impl CacheRow {
    fn merge(&mut self, other: CacheRow) {
        self.res.merge(other.res);
        self.router_cpu_s += other.router_cpu_s;
        self.delta.add(&other.delta);
    }

    /// `hit 2000`, `miss 2000`, `–`; bold with the shortfall when some request was
    /// not what the row is about.
    fn x_cache(&self, expect: Option<&str>) -> (String, bool) {
        let n = self.res.samples.len() as u64;
        let d = &self.delta;
        let got = match expect {
            None => return ("–".into(), true),
            Some("hit") => d.hits,
            Some(_) => d.misses,
        };
        let e = expect.unwrap_or_default();
        if got == n && d.bypasses == 0 {
            (format!("{e} {got}"), true)
        } else {
            (
                format!(
                    "**{e} {got} of {n}** (hits {}, misses {}, bypasses {})",
                    d.hits, d.misses, d.bypasses
                ),
                false,
            )
        }
    }
}

impl Env {
    /// One closed-loop run on `t`, with the router's CPU and cache counters around it.
    async fn cache_run(&self, t: &CacheTarget<'_>, spec: &LoadSpec) -> Result<CacheRow, String> {
        let Some(r) = t.router else {
            return Ok(CacheRow {
                res: load::run(spec).await,
                ..CacheRow::default()
            });
        };
        // A router with the cache off has no response-cache families to read.
        let counters = async || match t.expect {
            Some(_) => cache_counters(&r.admin).await,
            None => Ok(CacheCounters::default()),
        };
        let (u0, c0) = (usage(r.proc.pid), counters().await?);
        let res = load::run(spec).await;
        let u1 = usage(r.proc.pid);
        // Misses are stored after their body ended: wait for the last ones, so the next
        // run's counters do not see them.
        let c1 = if t.expect == Some("miss") {
            let offered = c0.stored + c0.not_stored + res.samples.len() as u64;
            wait_stores(&r.admin, offered, Duration::from_secs(5)).await?
        } else {
            counters().await?
        };
        Ok(CacheRow {
            res,
            router_cpu_s: self.cpu_s(&u0, &u1),
            delta: c1.since(&c0),
        })
    }

    async fn cache_router(
        &self,
        workers: &[String],
        extra_yaml: &str,
        label: &str,
        procs: &mut Vec<ChildProc>,
    ) -> Result<CacheRouter, String> {
        let proc = self.router(workers, extra_yaml, label, procs).await?;
        let admin = Admin::new(&proc.url)?;
        Ok(CacheRouter { proc, admin })
    }
}

/// `response_cache` in-process (the memory rows' routers use it too).
const MEM_YAML: &str = "response_cache: { enabled: true, ttl_secs: 600 }\n";

/// The section's processes: one engine, a Redis, and a router per store (cache off,
/// in-process, Redis), stopped with `procs` at the end of the section.
struct Setup {
    urls: Vec<String>,
    direct: SocketAddr,
    engine_pid: u32,
    redis_pid: u32,
    /// Redis's directory: removed when dropped, so held as long as Redis runs.
    _redis_dir: ScratchDir,
    off: CacheRouter,
    mem: CacheRouter,
    redis: CacheRouter,
}

impl Setup {
    async fn start(env: &Env, cli: &Cli, procs: &mut Vec<ChildProc>) -> Result<Self, String> {
        let params = env.engine(cli.time_factor, 4096);
        let urls = env.engines(1, &params, procs).await?;
        let engine_pid = procs
            .last()
            .and_then(ChildProc::pid)
            .ok_or("engine exited right after starting")?;
        let redis_dir = ScratchDir::new("overhead", "redis").map_err(|e| e.to_string())?;
        let redis_port = procs::start_redis(&cli.redis_server, &redis_dir, env.startup, procs)
            .await
            .map_err(|e| {
                format!(
                    "{e} (the cache section needs redis-server: install it or pass --redis-server)"
                )
            })?;
        let redis_pid = procs
            .last()
            .and_then(ChildProc::pid)
            .ok_or("redis-server exited right after starting")?;
        let redis_yaml = format!(
            "response_cache: {{ enabled: true, ttl_secs: 600, redis_url: \"redis://127.0.0.1:{redis_port}/\" }}\n"
        );
        let off = env.cache_router(&urls, "", "cache_off", procs).await?;
        let mem = env
            .cache_router(&urls, MEM_YAML, "cache_mem", procs)
            .await?;
        let redis = env
            .cache_router(&urls, &redis_yaml, "cache_redis", procs)
            .await?;
        Ok(Setup {
            direct: addr_of(&urls[0])?,
            urls,
            engine_pid,
            redis_pid,
            _redis_dir: redis_dir,
            off,
            mem,
            redis,
        })
    }

    /// The latency table's rows, in order; the throughput table takes 0, 1, 3 and 5.
    fn targets(&self) -> [CacheTarget<'_>; 6] {
        let (off, mem, redis) = (&self.off, &self.mem, &self.redis);
        [
            CacheTarget {
                label: "direct to the engine",
                addr: self.direct,
                router: None,
                expect: None,
            },
            CacheTarget {
                label: "router, cache off",
                addr: off.proc.addr,
                router: Some(off),
                expect: None,
            },
            CacheTarget {
                label: "router, in-process, miss",
                addr: mem.proc.addr,
                router: Some(mem),
                expect: Some("miss"),
            },
            CacheTarget {
                label: "router, in-process, **hit**",
                addr: mem.proc.addr,
                router: Some(mem),
                expect: Some("hit"),
            },
            CacheTarget {
                label: "router, Redis, miss",
                addr: redis.proc.addr,
                router: Some(redis),
                expect: Some("miss"),
            },
            CacheTarget {
                label: "router, Redis, **hit**",
                addr: redis.proc.addr,
                router: Some(redis),
                expect: Some("hit"),
            },
        ]
    }
}

/// Section 5: the response cache. Hit and miss latency against the engine at
/// concurrency 1, hit throughput, memory per stored answer.
pub async fn run(env: &Env, cli: &Cli, procs: &mut Vec<ChildProc>) -> Report {
    let setup = Setup::start(env, cli, procs).await?;
    let mut fresh = Fresh(1_000_000);
    let mut t = String::new();
    let _ = writeln!(
        t,
        "## 5. Response cache\n\n\
         1 engine (time factor {}); routers with `response_cache` off, in-process \
         (`{{enabled: true, ttl_secs: 600}}`, moka) and on a local `redis-server` (no \
         persistence, 127.0.0.1). Small chat requests as in section 1 ({} bytes of JSON, \
         max_tokens {}). Hit rows replay the 256 bodies of section 1, whose answers were \
         stored first; miss rows and the cache-off row send a question of their own every \
         time (the same shape and length), so every one goes to the engine. x-cache is the \
         router's own count (`{RC}hits_total` / `misses_total` over the row, 0 bypasses) \
         and must equal the requests.\n",
        cli.time_factor,
        small_bodies(cli.max_tokens, false)(0).len(),
        cli.max_tokens
    );
    let mut ok = latency::table(env, cli, &setup, &mut fresh, &mut t).await?;
    ok &= throughput::table(env, cli, &setup, &mut t).await?;
    ok &= memory::table(env, cli, &setup.urls, &mut fresh, procs, &mut t).await?;
    if !ok {
        for r in [&setup.off, &setup.mem, &setup.redis] {
            let _ = writeln!(t, "\nrouter log tail:\n```\n{}\n```", r.proc.log_tail());
        }
    }
    Ok((t, ok))
}

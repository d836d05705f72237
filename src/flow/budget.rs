//! Token budgets (`tenants.list.NAME.tokens_per_minute`, `tokens_per_day`): per tenant,
//! input and output tokens per minute and per day, each a token bucket that holds the
//! limit and refills at limit ÷ period.
//!
//! A request is charged at admission by an estimate of its prompt (input) and admitted
//! only while each input bucket holds that much (at most the whole bucket) and each
//! output bucket is above 0 (output is not known in advance); otherwise 429 with
//! `Retry-After` the time the refill takes. When the answer ends the charge is settled
//! from the usage the engine reports: the input's difference and the output. A request
//! the queue then turns away is refunded.
//!
//! With `state.redis_url` the buckets live in Redis, shared by every replica: one Lua
//! script, atomic, one round trip per admission (the settlement is sent off the request
//! path). While Redis does not answer, limits fail open (requests go unlimited), counted
//! in `flow_budget_errors_total` and logged at most once a minute; the next call after
//! [`DOWN_FOR`] tries it again.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;

use crate::config::Config;
use crate::redis_link::{Query, RedisLink};

/// How long a Redis that failed is left alone (limits open) before the next try.
pub const DOWN_FOR: Duration = Duration::from_secs(1);
/// The longest an admission waits for Redis before it fails open.
const CALL_BOUND: Duration = Duration::from_millis(250);
/// Least time between two "budgets fail open" log lines.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// The bucket script: `KEYS` the buckets, `ARGV` per bucket `cap, rate (tokens per ms),
/// need, take`. Refills each by Redis's clock; when one holds less than its `need`,
/// returns `{ms to wait, its 1-based index}` and changes nothing, else takes `take`
/// from each (a negative take refunds, never past `cap`) and returns `{0, 0}`.
const SCRIPT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local level = {}
local wait, which = 0, 0
for i = 1, #KEYS do
  local o = (i - 1) * 4
  local cap, rate, need = tonumber(ARGV[o + 1]), tonumber(ARGV[o + 2]), tonumber(ARGV[o + 3])
  local h = redis.call('HMGET', KEYS[i], 'l', 't')
  local l = tonumber(h[1]) or cap
  local at = tonumber(h[2]) or now
  l = math.min(cap, l + math.max(0, now - at) * rate)
  level[i] = l
  if l < need then
    local w = math.ceil((need - l) / rate)
    if w > wait then wait, which = w, i end
  end
end
if wait > 0 then return {wait, which} end
for i = 1, #KEYS do
  local o = (i - 1) * 4
  local cap, rate, take = tonumber(ARGV[o + 1]), tonumber(ARGV[o + 2]), tonumber(ARGV[o + 4])
  local l = math.min(cap, level[i] - take)
  redis.call('HSET', KEYS[i], 'l', tostring(l), 't', now)
  redis.call('PEXPIRE', KEYS[i], math.ceil(cap / rate) + 60000)
end
return {0, 0}
";

/// Input (prompt) or output (generated) tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dir {
    Input,
    Output,
}

/// One limit of a tenant: its config key, bucket size and refill.
#[derive(Debug)]
struct Limit {
    dir: Dir,
    /// `tenants.list.NAME.tokens_per_minute.input`, …: named in the 429.
    key: String,
    cap: f64,
    /// Tokens per second.
    rate: f64,
    /// Its Redis key (with `state.redis_url`).
    redis_key: String,
}

/// A bucket's level at an instant (in-process budgets).
#[derive(Debug, Clone, Copy)]
struct Level {
    tokens: f64,
    at: Instant,
}

#[derive(Debug)]
struct Tenant {
    limits: Vec<Limit>,
    levels: Mutex<Vec<Level>>,
}

/// A request over budget: the limit, and when to retry.
#[derive(Debug, Clone, PartialEq)]
pub struct Over {
    /// The limit's config key and value.
    pub limit: String,
    /// Seconds until the bucket holds enough (at least 1).
    pub retry_after: u64,
}

/// What a request was charged at admission, to settle or refund.
#[derive(Debug, Clone, Copy)]
pub struct Debit {
    pub tenant: u16,
    /// The input tokens charged (the estimate).
    pub input: u64,
}

/// The fleet's buckets on Redis (`state.redis_url`).
struct Shared {
    link: RedisLink,
    /// Until when ([`crate::clock::nanos`]) Redis is left alone after a failure.
    down_until: AtomicU64,
    /// At most one "fail open" line a minute.
    warn: crate::clock::LogEvery,
}

/// See the module docs.
pub struct Budgets {
    /// By tenant index; `None` for a tenant without a budget.
    tenants: Vec<Option<Tenant>>,
    shared: Option<Shared>,
    /// `flow_budget_errors_total`.
    errors: Counter,
}

impl std::fmt::Debug for Budgets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Budgets")
            .field("tenants", &self.tenants)
            .field("shared", &self.shared.is_some())
            .finish()
    }
}

impl Budgets {
    /// The budgets of `tenants` (names by index; `tenants.list` gives each its limits),
    /// on Redis when `state.redis_url` is set. `None` when no tenant has one.
    pub fn new(config: &Config, tenants: &[Arc<str>], errors: Counter) -> Option<Self> {
        let now = crate::clock::now();
        let ns = &config.state.namespace;
        let built: Vec<Option<Tenant>> = tenants
            .iter()
            .map(|name| {
                let t = config.tenants.list.iter().find(|t| *t.name == **name)?;
                let mut limits = Vec::new();
                for (per, secs, l) in [
                    ("minute", 60.0, t.tokens_per_minute),
                    ("day", 86_400.0, t.tokens_per_day),
                ] {
                    for (dir, word, cap) in [
                        (Dir::Input, "input", l.input),
                        (Dir::Output, "output", l.output),
                    ] {
                        let Some(cap) = cap else { continue };
                        let per_key = format!("tokens_per_{per}");
                        limits.push(Limit {
                            dir,
                            key: format!("tenants.list.{name}.{per_key}.{word}: {cap}"),
                            cap: cap as f64,
                            rate: cap as f64 / secs,
                            redis_key: format!("{ns}:budget:{name}:{word}:{per}"),
                        });
                    }
                }
                let levels = limits
                    .iter()
                    .map(|l| Level {
                        tokens: l.cap,
                        at: now,
                    })
                    .collect();
                (!limits.is_empty()).then(|| Tenant {
                    limits,
                    levels: Mutex::new(levels),
                })
            })
            .collect();
        if built.iter().all(Option::is_none) {
            return None;
        }
        let shared = config.state.redis_url.as_ref().and_then(|url| {
            redis::Client::open(url.expose())
                .inspect_err(|e| tracing::error!(error = %e, "token budgets: state.redis_url unusable; budgets are per router"))
                .ok()
                .map(|client| Shared {
                    link: RedisLink::new(client, CALL_BOUND),
                    down_until: AtomicU64::new(0),
                    warn: crate::clock::LogEvery::new(WARN_EVERY),
                })
        });
        Some(Budgets {
            tenants: built,
            shared,
            errors,
        })
    }

    /// Charges a request of `tenant` with about `input` prompt tokens, when every one of
    /// its budgets admits it; `Ok(None)` for a tenant without one (and while Redis is
    /// down: fail open).
    pub async fn debit(&self, tenant: u16, input: u64) -> Result<Option<Debit>, Over> {
        let Some(t) = self.tenants.get(tenant as usize).and_then(Option::as_ref) else {
            return Ok(None);
        };
        let moves: Vec<(f64, f64)> = t
            .limits
            .iter()
            .map(|l| match l.dir {
                Dir::Input => ((input as f64).min(l.cap), input as f64),
                Dir::Output => (1f64.min(l.cap), 0.0),
            })
            .collect();
        let debit = Debit { tenant, input };
        match &self.shared {
            None => t.take_local(&moves).map(|()| Some(debit)),
            Some(s) => match self.take_shared(s, t, &moves).await {
                Some(Err(over)) => Err(over),
                Some(Ok(())) => Ok(Some(debit)),
                None => Ok(None),
            },
        }
    }

    /// Settles `debit` from the engine's count: `input` prompt tokens (the estimate's
    /// difference) and `output` generated ones. Off the request path with Redis.
    pub fn settle(self: &Arc<Self>, debit: Debit, input: u64, output: u64) {
        self.adjust(debit, input as f64 - debit.input as f64, output as f64);
    }

    /// Gives `debit` back (the request was turned away before any worker had it).
    pub fn refund(self: &Arc<Self>, debit: Debit) {
        self.adjust(debit, -(debit.input as f64), 0.0);
    }

    fn adjust(self: &Arc<Self>, debit: Debit, input: f64, output: f64) {
        let Some(t) = self
            .tenants
            .get(debit.tenant as usize)
            .and_then(Option::as_ref)
        else {
            return;
        };
        let moves: Vec<(f64, f64)> = t
            .limits
            .iter()
            .map(|l| match l.dir {
                Dir::Input => (0.0, input),
                Dir::Output => (0.0, output),
            })
            .collect();
        if moves.iter().all(|m| m.1 == 0.0) {
            return;
        }
        if self.shared.is_none() {
            let _ = t.take_local(&moves);
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let me = Arc::clone(self);
        rt.spawn(async move {
            if let (Some(s), Some(t)) = (&me.shared, me.tenants[debit.tenant as usize].as_ref()) {
                let _ = me.take_shared(s, t, &moves).await;
            }
        });
    }

    /// Runs the script for `moves` (`(need, take)` per limit) on Redis: `None` when it
    /// did not answer (fail open, counted and logged).
    async fn take_shared(
        &self,
        s: &Shared,
        t: &Tenant,
        moves: &[(f64, f64)],
    ) -> Option<Result<(), Over>> {
        let now = crate::clock::nanos(crate::clock::now());
        // Relaxed: a hint; a call that reads it stale makes one more try.
        if now < s.down_until.load(Ordering::Relaxed) {
            return None;
        }
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(SCRIPT).arg(t.limits.len());
        for l in &t.limits {
            cmd.arg(&l.redis_key);
        }
        for (l, (need, take)) in t.limits.iter().zip(moves) {
            cmd.arg(l.cap).arg(l.rate / 1000.0).arg(*need).arg(*take);
        }
        match s.link.query::<(i64, i64)>(&Query::Cmd(cmd)).await {
            Ok((0, _)) => Some(Ok(())),
            Ok((wait_ms, which)) => {
                let l = &t.limits[(which.max(1) as usize - 1).min(t.limits.len() - 1)];
                Some(Err(Over {
                    limit: l.key.clone(),
                    retry_after: (wait_ms.max(1) as u64).div_ceil(1000),
                }))
            }
            Err(e) => {
                self.errors.inc();
                s.down_until
                    .store(now + DOWN_FOR.as_nanos() as u64, Ordering::Relaxed);
                if let Some(n) = s.warn.due() {
                    tracing::warn!(error = %e, failures = n, "token budgets: Redis (state.redis_url) does not answer; limits fail open (requests go unlimited) until it does");
                }
                None
            }
        }
    }
}

impl Tenant {
    /// The in-process buckets: refilled to now; when one holds less than its `need`,
    /// `Err` with the longest wait; else each takes its `take` (never over its cap).
    fn take_local(&self, moves: &[(f64, f64)]) -> Result<(), Over> {
        let now = crate::clock::now();
        let mut levels = self.levels.lock().unwrap_or_else(|e| e.into_inner());
        let mut worst: Option<(f64, usize)> = None;
        for (i, (l, lv)) in self.limits.iter().zip(levels.iter_mut()).enumerate() {
            let secs = now.saturating_duration_since(lv.at).as_secs_f64();
            lv.tokens = (lv.tokens + secs * l.rate).min(l.cap);
            lv.at = now;
            let need = moves[i].0;
            if lv.tokens < need {
                let wait = (need - lv.tokens) / l.rate;
                if worst.is_none_or(|(w, _)| wait > w) {
                    worst = Some((wait, i));
                }
            }
        }
        if let Some((wait, i)) = worst {
            return Err(Over {
                limit: self.limits[i].key.clone(),
                retry_after: (wait.ceil() as u64).max(1),
            });
        }
        for ((l, lv), (_, take)) in self.limits.iter().zip(levels.iter_mut()).zip(moves) {
            lv.tokens = (lv.tokens - take).min(l.cap);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budgets(limits: &str) -> Budgets {
        let yaml =
            format!("workers: [\"http://127.0.0.1:1\"]\ntenants: {{list: {{acme: {limits}}}}}\n");
        let config = crate::config::load_text(&yaml).unwrap();
        let names: Vec<Arc<str>> = vec![Arc::from("acme"), Arc::from("default")];
        Budgets::new(&config, &names, Counter::default()).unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn input_is_charged_by_the_estimate_and_refills_over_the_minute() {
        let b = Arc::new(budgets("{tokens_per_minute: {input: 600}}"));
        assert!(b.debit(1, 10_000).await.unwrap().is_none(), "no budget");
        let d = b.debit(0, 400).await.unwrap().unwrap();
        // 200 left: a request of 300 waits for 100 tokens at 10 a second.
        let over = b.debit(0, 300).await.unwrap_err();
        assert_eq!(over.retry_after, 10);
        assert!(
            over.limit
                .contains("tenants.list.acme.tokens_per_minute.input: 600")
        );
        // The engine counted 100: 300 come back.
        b.settle(d, 100, 0);
        b.debit(0, 300).await.unwrap().unwrap();
        // 200 left; 30 s later 500: a request larger than the whole budget waits for
        // a full bucket (10 s more), no longer.
        tokio::time::advance(Duration::from_secs(30)).await;
        let over = b.debit(0, 5_000).await.unwrap_err();
        assert_eq!(over.retry_after, 10);
    }

    #[tokio::test(start_paused = true)]
    async fn output_is_settled_after_the_answer_and_holds_the_next_request() {
        let b = Arc::new(budgets(
            "{tokens_per_minute: {output: 60}, tokens_per_day: {input: 100000}}",
        ));
        let d = b.debit(0, 10).await.unwrap().unwrap();
        b.settle(d, 10, 70);
        let over = b.debit(0, 10).await.unwrap_err();
        assert_eq!(over.retry_after, 11, "{over:?}");
        assert!(over.limit.contains("tokens_per_minute.output: 60"));
        let refunded = b.debit(0, 10).await;
        assert!(refunded.is_err());
        tokio::time::advance(Duration::from_secs(11)).await;
        let d = b.debit(0, 10).await.unwrap().unwrap();
        b.refund(d);
    }
}

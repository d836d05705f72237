//! Retries of one request: which attempt another worker may take, the backoff between
//! attempts, and how long a worker's push-back (429, 503 + `Retry-After`) keeps it
//! avoided. Retries happen only before any response byte reached the client.

use std::time::{Duration, Instant};

use http::header::{self, HeaderValue};
use http::{Response, StatusCode};

use super::access_log::AccessLog;
use crate::config::ProxyConfig;
use crate::error::ProxyError;
use crate::pools::pool::{InFlightGuard, Worker};
use crate::upstream::UpstreamBody;

/// A worker's answer, with the slot it holds there and its access line.
pub struct Answer {
    pub resp: Response<UpstreamBody>,
    pub guard: InFlightGuard,
    pub log: AccessLog,
}

/// The retry state of one request across its attempts.
pub struct Retries<'c> {
    cfg: &'c ProxyConfig,
    /// One bound on the client's wait for headers, over every attempt and backoff.
    deadline: Instant,
    last_error: ProxyError,
    /// A retryable answer kept until another worker takes the request: when none is
    /// left, the client gets the worker's own answer (e.g. its 503), not ours.
    held: Option<Answer>,
    /// Whether `held` is a push-back (429, 503 + Retry-After).
    held_pushed_back: bool,
}

impl<'c> Retries<'c> {
    /// The state of a request that arrived at `arrived`, under `proxy:`.
    pub fn new(cfg: &'c ProxyConfig, arrived: Instant) -> Self {
        Retries {
            cfg,
            deadline: arrived + cfg.request_timeout,
            last_error: ProxyError::NoWorker("every worker is unhealthy, at max_load, or down"),
            held: None,
            held_pushed_back: false,
        }
    }

    /// `proxy.max_retries`: attempts after the first.
    pub fn max(&self) -> u32 {
        self.cfg.max_retries
    }

    /// What one attempt may wait for headers: what is left of the request's bound,
    /// at most `proxy.attempt_timeout_secs`.
    pub fn attempt_wait(&self) -> Duration {
        let left = self.deadline.saturating_duration_since(Instant::now());
        self.cfg.attempt_timeout.map_or(left, |a| a.min(left))
    }

    /// The wait before retry number `attempt` (1-based), or `None` when the request
    /// retries no more: every worker left has pushed back (`any_unsaturated` says
    /// whether one has not; the client gets the first engine's own answer now instead of
    /// a round of refusals), or the backoff would outlast the request's bound.
    pub fn backoff_before(
        &self,
        attempt: u32,
        any_unsaturated: impl FnOnce() -> bool,
    ) -> Option<Duration> {
        if self.held_pushed_back && !any_unsaturated() {
            return None;
        }
        let left = self.deadline.saturating_duration_since(Instant::now());
        let backoff = backoff(self.cfg, attempt);
        (backoff < left).then_some(backoff)
    }

    /// Whether a worker's answer to attempt `attempt` with `status` (`pushed_back`: a
    /// push-back) is held while another worker is tried: its status is retryable (a
    /// push-back is: it was refused before any work) and an attempt is left. Else the
    /// client gets it now.
    pub fn holds(&self, attempt: u32, status: u16, pushed_back: bool) -> bool {
        let retryable = pushed_back || self.cfg.retryable_statuses.contains(&status);
        attempt < self.cfg.max_retries && retryable
    }

    /// Holds `answer` from `worker` (see [`Retries::holds`]), in place of any held
    /// before.
    pub fn hold(&mut self, answer: Answer, pushed_back: bool, worker: &Worker) {
        tracing::warn!(
            request_id = ?answer.log.request_id,
            worker = %worker.url(),
            status = answer.log.status,
            "retryable status; trying another worker"
        );
        self.held = Some(answer);
        self.held_pushed_back = pushed_back;
    }

    /// Attempt `attempt` on `worker` failed with `e`: whether another worker is tried.
    /// The engine may still be computing a timed-out request: another try would pay
    /// its prefill twice, unless the operator bounded each attempt
    /// (`attempt_timeout_secs`) to fail over.
    pub fn failed(
        &mut self,
        attempt: u32,
        e: ProxyError,
        worker: &Worker,
        request_id: &HeaderValue,
    ) -> bool {
        let timed_out = matches!(e, ProxyError::Timeout(_));
        let again = attempt < self.cfg.max_retries
            && (!timed_out || self.cfg.attempt_timeout.is_some())
            && self.deadline > Instant::now();
        let error = crate::error::Chain(&e);
        if again {
            tracing::warn!(request_id = ?request_id, worker = %worker.url(), error = %error, "upstream attempt failed; trying another worker");
        } else {
            tracing::warn!(request_id = ?request_id, worker = %worker.url(), error = %error, "upstream attempt failed");
        }
        self.last_error = e;
        again
    }

    /// No attempt is left: the held answer, else the last attempt's error (a 504 stays
    /// a time-out).
    pub fn finish(self) -> Result<Answer, ProxyError> {
        self.held.ok_or(self.last_error)
    }
}

/// Backoff before retry number `attempt` (1-based): initial × multiplier^(attempt-1),
/// spread by ± `jitter_factor`.
fn backoff(p: &ProxyConfig, attempt: u32) -> Duration {
    let base = p.initial_backoff.as_secs_f64() * p.backoff_multiplier.powi(attempt as i32 - 1);
    let jitter = 1.0 + p.jitter_factor * (rand::random::<f64>() * 2.0 - 1.0);
    Duration::from_secs_f64((base * jitter).clamp(0.0, 60.0))
}

/// Longest saturation a `Retry-After` may ask for: a bogus hour-long value must not
/// take a worker out of rotation for that long.
const MAX_BACK_PRESSURE: Duration = Duration::from_secs(60);

/// How long `resp` asks the router to stay away: a 429 (its `Retry-After`, else 1 s) or a
/// 503 that carries a readable `Retry-After`; `None` for any other answer. `Retry-After`
/// is read in both forms of RFC 9110 §10.2.3, delay-seconds (a value too large for any
/// integer counts as the cap) and HTTP-date; the first header counts. Clamped to
/// 100 ms ..= [`MAX_BACK_PRESSURE`].
pub fn back_pressure<B>(resp: &Response<B>) -> Option<Duration> {
    let after = resp
        .headers()
        .get(header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(retry_after);
    match resp.status() {
        StatusCode::TOO_MANY_REQUESTS => Some(after.unwrap_or(Duration::from_secs(1))),
        StatusCode::SERVICE_UNAVAILABLE => after,
        _ => None,
    }
    .map(|d| d.clamp(Duration::from_millis(100), MAX_BACK_PRESSURE))
}

/// A `Retry-After` value as a duration from now; `None` when it is neither form.
fn retry_after(v: &str) -> Option<Duration> {
    let v = v.trim();
    if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) {
        return Some(
            v.parse::<u64>()
                .map_or(MAX_BACK_PRESSURE, Duration::from_secs),
        );
    }
    let at = httpdate::parse_http_date(v).ok()?;
    Some(
        at.duration_since(std::time::SystemTime::now())
            .unwrap_or(Duration::ZERO),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_reads_both_forms() {
        assert_eq!(retry_after("5"), Some(Duration::from_secs(5)));
        assert_eq!(retry_after(" 0 "), Some(Duration::ZERO));
        assert_eq!(retry_after("99999999999999999999"), Some(MAX_BACK_PRESSURE));
        for bad in ["", "abc", "-5", "1.5"] {
            assert_eq!(retry_after(bad), None, "{bad:?}");
        }
        let soon = std::time::SystemTime::now() + Duration::from_secs(30);
        let d = retry_after(&httpdate::fmt_http_date(soon)).unwrap();
        assert!((28..=30).contains(&d.as_secs()), "{d:?}");
        assert_eq!(
            retry_after("Wed, 21 Oct 2015 07:28:00 GMT"),
            Some(Duration::ZERO)
        );
    }
}

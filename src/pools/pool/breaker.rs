//! Per-worker circuit breaker: a pure state machine; the caller passes the time in.
//!
//! Terms keep their electrical meaning:
//! - **Closed**: traffic flows. `failure_threshold` consecutive failures (connect
//!   errors, timeouts, 5xx; never 4xx) open it.
//! - **Open**: traffic is rejected for `timeout`.
//! - **HalfOpen**: after the timeout, up to `success_threshold` probe requests are
//!   admitted at a time. `success_threshold` successful probes close the breaker; a
//!   failed probe opens it again; a probe that ends any other way (a 4xx, the client
//!   cancelling) only frees its slot. So a half-open breaker never sticks: every probe
//!   gives its slot back, through [`CircuitBreaker::record`] or the caller's drop guard.
//!
//! Outcomes of requests admitted while Closed but finishing after the breaker opened are
//! ignored: they say nothing about the worker's state since.

use std::time::{Duration, Instant};

use crate::config::BreakerConfig;

/// The breaker's state, as shown in `/workers`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Closed,
    Open,
    HalfOpen,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Closed => "closed",
            State::Open => "open",
            State::HalfOpen => "half_open",
        }
    }
}

/// How one request to the worker ended, as far as the breaker cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Response headers with a status below 500.
    Success,
    /// Connect error, timeout, 5xx, or a body that broke off.
    Failure,
    /// Ended without a verdict (client cancelled, 4xx on a probe): frees a probe slot.
    Neutral,
}

/// A state change, for the caller to log and count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transition {
    pub from: State,
    pub to: State,
}

/// Permission to send one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// A normal request (breaker closed).
    Normal,
    /// A half-open probe: its outcome must be recorded with `probe = true`.
    Probe,
}

/// See the module docs.
#[derive(Debug, Clone)]
pub struct CircuitBreaker {
    failure_threshold: u32,
    success_threshold: u32,
    timeout: Duration,
    state: State,
    consecutive_failures: u32,
    opened_at: Option<Instant>,
    probes_in_flight: u32,
    probe_successes: u32,
}

impl CircuitBreaker {
    pub fn new(cfg: &BreakerConfig) -> Self {
        CircuitBreaker {
            failure_threshold: cfg.failure_threshold,
            success_threshold: cfg.success_threshold,
            timeout: cfg.timeout,
            state: State::Closed,
            consecutive_failures: 0,
            opened_at: None,
            probes_in_flight: 0,
            probe_successes: 0,
        }
    }

    /// The state at `now`: an Open breaker whose timeout has passed reads HalfOpen.
    pub fn state(&self, now: Instant) -> State {
        match self.state {
            State::Open if self.cooled_down(now) => State::HalfOpen,
            s => s,
        }
    }

    /// Whether a request could be admitted at `now` (does not take a probe slot).
    pub fn is_available(&self, now: Instant) -> bool {
        match self.state(now) {
            State::Closed => true,
            State::Open => false,
            State::HalfOpen => self.probes_in_flight < self.success_threshold,
        }
    }

    /// Admits one request at `now`, taking a probe slot when half-open; `None` when the
    /// breaker rejects it. May move Open -> HalfOpen.
    pub fn admit(&mut self, now: Instant) -> (Option<Admission>, Option<Transition>) {
        let mut transition = None;
        if self.state == State::Open && self.cooled_down(now) {
            transition = self.set(State::HalfOpen, now);
        }
        let admission = match self.state {
            State::Closed => Some(Admission::Normal),
            State::Open => None,
            State::HalfOpen if self.probes_in_flight < self.success_threshold => {
                self.probes_in_flight += 1;
                Some(Admission::Probe)
            }
            State::HalfOpen => None,
        };
        (admission, transition)
    }

    /// Records how an admitted request ended.
    pub fn record(
        &mut self,
        admission: Admission,
        outcome: Outcome,
        now: Instant,
    ) -> Option<Transition> {
        match (admission, self.state) {
            (Admission::Probe, State::HalfOpen) => {
                self.probes_in_flight = self.probes_in_flight.saturating_sub(1);
                match outcome {
                    Outcome::Success => {
                        self.probe_successes += 1;
                        (self.probe_successes >= self.success_threshold)
                            .then(|| self.set(State::Closed, now))
                            .flatten()
                    }
                    Outcome::Failure => self.set(State::Open, now),
                    Outcome::Neutral => None,
                }
            }
            (Admission::Normal, State::Closed) => match outcome {
                Outcome::Success => {
                    self.consecutive_failures = 0;
                    None
                }
                Outcome::Failure => {
                    self.consecutive_failures += 1;
                    (self.consecutive_failures >= self.failure_threshold)
                        .then(|| self.set(State::Open, now))
                        .flatten()
                }
                Outcome::Neutral => None,
            },
            // A probe from an earlier half-open period, or a request admitted while
            // closed finishing after the breaker opened: no information about now.
            _ => None,
        }
    }

    fn cooled_down(&self, now: Instant) -> bool {
        self.opened_at
            .is_some_and(|t| now.saturating_duration_since(t) >= self.timeout)
    }

    fn set(&mut self, to: State, now: Instant) -> Option<Transition> {
        let from = self.state;
        if from == to {
            return None;
        }
        self.state = to;
        self.consecutive_failures = 0;
        self.probes_in_flight = 0;
        self.probe_successes = 0;
        self.opened_at = (to == State::Open).then_some(now);
        Some(Transition { from, to })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breaker() -> CircuitBreaker {
        CircuitBreaker::new(&BreakerConfig {
            failure_threshold: 3,
            timeout: Duration::from_secs(10),
            success_threshold: 2,
        })
    }

    fn fail(b: &mut CircuitBreaker, now: Instant, n: u32) -> Option<Transition> {
        let mut last = None;
        for _ in 0..n {
            let (a, _) = b.admit(now);
            last = b.record(a.unwrap(), Outcome::Failure, now).or(last);
        }
        last
    }

    #[test]
    fn opens_after_consecutive_failures_only() {
        let t0 = Instant::now();
        let mut b = breaker();
        fail(&mut b, t0, 2);
        b.record(Admission::Normal, Outcome::Success, t0); // resets the run
        assert_eq!(fail(&mut b, t0, 2), None);
        b.record(Admission::Normal, Outcome::Neutral, t0); // a 4xx neither resets nor counts
        let t = fail(&mut b, t0, 1);
        assert_eq!(
            t,
            Some(Transition {
                from: State::Closed,
                to: State::Open
            })
        );
        assert_eq!(b.state(t0), State::Open);
        assert!(!b.is_available(t0));
        assert_eq!(b.admit(t0).0, None);
    }

    #[test]
    fn full_cycle_closed_open_half_open_closed() {
        let t0 = Instant::now();
        let mut b = breaker();
        fail(&mut b, t0, 3);
        let later = t0 + Duration::from_secs(10);
        assert_eq!(b.state(later), State::HalfOpen);
        assert!(b.is_available(later));
        let (p1, tr) = b.admit(later);
        assert_eq!(p1, Some(Admission::Probe));
        assert_eq!(
            tr,
            Some(Transition {
                from: State::Open,
                to: State::HalfOpen
            })
        );
        let (p2, _) = b.admit(later);
        assert_eq!(p2, Some(Admission::Probe));
        assert_eq!(b.admit(later).0, None, "probes are bounded");
        assert_eq!(b.record(Admission::Probe, Outcome::Success, later), None);
        let tr = b.record(Admission::Probe, Outcome::Success, later);
        assert_eq!(
            tr,
            Some(Transition {
                from: State::HalfOpen,
                to: State::Closed
            })
        );
        assert_eq!(b.admit(later).0, Some(Admission::Normal));
    }

    #[test]
    fn cancelled_or_neutral_probe_frees_its_slot() {
        let t0 = Instant::now();
        let mut b = breaker();
        fail(&mut b, t0, 3);
        let later = t0 + Duration::from_secs(11);
        for _ in 0..5 {
            let (a, _) = b.admit(later);
            assert_eq!(a, Some(Admission::Probe));
            // The client went away (or the worker said 400): no verdict.
            b.record(Admission::Probe, Outcome::Neutral, later);
            assert_eq!(b.state(later), State::HalfOpen);
            assert!(
                b.is_available(later),
                "slot released; never stuck half-open"
            );
        }
        let (a, _) = b.admit(later);
        b.record(a.unwrap(), Outcome::Success, later);
        let (a, _) = b.admit(later);
        assert_eq!(
            b.record(a.unwrap(), Outcome::Success, later).map(|t| t.to),
            Some(State::Closed)
        );
    }

    #[test]
    fn failed_probe_reopens_for_another_timeout() {
        let t0 = Instant::now();
        let mut b = breaker();
        fail(&mut b, t0, 3);
        let t1 = t0 + Duration::from_secs(10);
        let (a, _) = b.admit(t1);
        let tr = b.record(a.unwrap(), Outcome::Failure, t1);
        assert_eq!(
            tr,
            Some(Transition {
                from: State::HalfOpen,
                to: State::Open
            })
        );
        assert_eq!(b.state(t1 + Duration::from_secs(9)), State::Open);
        assert_eq!(b.state(t1 + Duration::from_secs(10)), State::HalfOpen);
    }

    #[test]
    fn late_outcomes_from_before_opening_are_ignored() {
        let t0 = Instant::now();
        let mut b = breaker();
        fail(&mut b, t0, 3);
        assert_eq!(b.record(Admission::Normal, Outcome::Success, t0), None);
        assert_eq!(b.state(t0), State::Open);
        let later = t0 + Duration::from_secs(10);
        let (a, _) = b.admit(later);
        assert_eq!(a, Some(Admission::Probe));
        // A normal request admitted long ago fails now: not the probe's verdict.
        assert_eq!(b.record(Admission::Normal, Outcome::Failure, later), None);
        assert_eq!(b.state(later), State::HalfOpen);
    }
}

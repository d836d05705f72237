//! The chunked physics ([`Physics::Chunked`]): vLLM's scheduler with chunked prefill.
//! The engine runs one batch per step; a step holds one token of every decoding
//! request and, in the rest of a token budget (`max_batched_tokens`), chunks of the
//! prompts still to compute, oldest first. It lasts `itl + prefill tokens in it ×
//! prefill_per_token`, so a prefill delays the next token of every request decoding
//! beside it, and a decode-only step lasts `itl`. A request's first token comes at the
//! end of the step that computes its prompt's last chunk, each later one at the end of
//! a later step: tokens stream at the step cadence.
//!
//! One task per engine runs the steps while there is work ([`Batch::join`] starts it,
//! it ends when the batch is empty), on tokio timers: each step ends at its nominal
//! time (the previous step's end plus its length, scaled by `time_factor`), so timer
//! overshoot never accumulates. A request hears of each of its tokens on a channel;
//! one whose client left (its receiver dropped) leaves the batch at the next step.
//!
//! [`Physics::Chunked`]: crate::prefill::Physics::Chunked

use std::sync::atomic::Ordering;
use std::sync::{Mutex, PoisonError};

use tokio::sync::mpsc;
use tokio::time::Instant;

use super::physics::wait_until;
use super::{Engine, Waiting};

/// The requests of one engine's batch (see the module docs).
#[derive(Debug, Default)]
pub(super) struct Batch {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// The step being run (1 for the first).
    step: u64,
    /// Whether the step task runs.
    looping: bool,
    /// In arrival order: prompts are chunked oldest first.
    jobs: Vec<Job>,
}

#[derive(Debug)]
struct Job {
    /// Prompt tokens still to compute.
    prefill_left: u64,
    /// Sequences decoding in lockstep (the prompts of a completions batch).
    seqs: u64,
    /// Tokens still to emit per sequence, the first included.
    tokens_left: u64,
    /// The step it was last scheduled in (0: never).
    scheduled_in: u64,
    /// Counted in `waiting` until first scheduled.
    waiting: Option<Waiting>,
    /// Counted in `running` from then on (until it leaves the batch).
    running: Option<Running>,
    /// Hears the nominal time of each of its tokens.
    tx: mpsc::UnboundedSender<Instant>,
}

/// A request counted in the engine's `running` gauge until dropped.
#[derive(Debug)]
struct Running(Engine);

impl Running {
    fn new(engine: &Engine) -> Self {
        engine
            .inner
            .counters
            .running
            .fetch_add(1, Ordering::Relaxed);
        Running(engine.clone())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.0
            .inner
            .counters
            .running
            .fetch_sub(1, Ordering::Relaxed);
    }
}

impl State {
    /// Schedules the next step: every decoding request's token, then prompt chunks in the
    /// budget left, oldest first. Returns the prompt tokens it computes, or `None` (and
    /// stops the loop) when the batch is empty.
    fn plan(&mut self, engine: &Engine, budget: u64) -> Option<u64> {
        // Clients gone leave the batch.
        self.jobs.retain(|j| !j.tx.is_closed());
        if self.jobs.is_empty() {
            self.looping = false;
            return None;
        }
        self.step += 1;
        let step = self.step;
        let mut left = budget;
        for j in self.jobs.iter_mut().filter(|j| j.prefill_left == 0) {
            j.scheduled_in = step;
            left = left.saturating_sub(j.seqs);
        }
        let mut prefill = 0;
        for j in self.jobs.iter_mut().filter(|j| j.prefill_left > 0) {
            if left == 0 {
                break;
            }
            let chunk = j.prefill_left.min(left);
            j.prefill_left -= chunk;
            left -= chunk;
            prefill += chunk;
            j.scheduled_in = step;
            if j.running.is_none() {
                j.waiting = None;
                j.running = Some(Running::new(engine));
            }
        }
        Some(prefill)
    }

    /// Ends the step at (nominal) `at`: a token for every request whose prompt is
    /// computed and that was in the step; those with none left leave.
    fn finish(&mut self, at: Instant) {
        let step = self.step;
        self.jobs.retain_mut(|j| {
            if j.scheduled_in != step || j.prefill_left > 0 {
                return true;
            }
            if j.tx.send(at).is_err() {
                return false;
            }
            j.tokens_left = j.tokens_left.saturating_sub(1);
            j.tokens_left > 0
        });
    }
}

impl Batch {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Engine {
    /// Puts a request into the batch: `prefill_tokens` to compute (at least 1), then
    /// `tokens` to generate per sequence (of `seqs`). Each token's nominal time arrives
    /// on the returned channel, which closes after the last.
    pub(super) fn join_batch(
        &self,
        prefill_tokens: u64,
        seqs: u64,
        tokens: u64,
        waiting: Waiting,
    ) -> mpsc::UnboundedReceiver<Instant> {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut s = self.inner.batch.lock();
        s.jobs.push(Job {
            prefill_left: prefill_tokens.max(1),
            seqs: seqs.max(1),
            tokens_left: tokens.max(1),
            scheduled_in: 0,
            waiting: Some(waiting),
            running: None,
            tx,
        });
        if !s.looping {
            s.looping = true;
            tokio::spawn(self.clone().run_steps());
        }
        rx
    }

    /// The step task: runs steps while the batch holds requests.
    async fn run_steps(self) {
        let cfg = &self.inner.cfg;
        let budget = cfg.max_batched_tokens.max(1) as u64;
        let (itl, per_token) = (cfg.itl.as_secs_f64(), cfg.prefill_per_token.as_secs_f64());
        // Nominal end of the last step; the first step of a run starts now.
        let mut end: Option<Instant> = None;
        loop {
            let Some(prefill) = self.inner.batch.lock().plan(&self, budget) else {
                return;
            };
            let length = self.scaled_secs(itl + per_token * prefill as f64);
            let step_end = end.unwrap_or_else(Instant::now) + length;
            if length.is_zero() {
                // Time factor 0: let the requests run between steps.
                tokio::task::yield_now().await;
            } else {
                wait_until(step_end).await;
            }
            self.inner.batch.lock().finish(step_end);
            end = Some(step_end);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::engine::{EngineConfig, Physics};

    fn engine(budget: usize) -> Engine {
        Engine::new(EngineConfig {
            prefill_physics: Physics::Chunked,
            max_batched_tokens: budget,
            itl: Duration::from_millis(10),
            prefill_per_token: Duration::from_millis(1),
            ..EngineConfig::default()
        })
        .unwrap()
    }

    /// Offsets of every token of `rx` from `t0`, in ms.
    async fn token_times(t0: Instant, mut rx: mpsc::UnboundedReceiver<Instant>) -> Vec<u64> {
        let mut out = Vec::new();
        while let Some(at) = rx.recv().await {
            out.push((at - t0).as_millis() as u64);
        }
        out
    }

    #[tokio::test(start_paused = true)]
    async fn a_prefill_delays_the_tokens_of_the_requests_decoding_beside_it() {
        let e = engine(100);
        let t0 = Instant::now();
        // 5 prompt tokens then 4 tokens: one step of 10 + 5 ms, then 3 of 10 ms.
        let a = e.join_batch(5, 1, 4, e.admit().unwrap());
        let alone = token_times(t0, a).await;
        assert_eq!(alone, [15, 25, 35, 45]);
        let t0 = Instant::now();
        let a = e.join_batch(5, 1, 6, e.admit().unwrap());
        let a = tokio::spawn(token_times(t0, a));
        // 20 ms in (step 2 running), a prompt of 250 tokens: chunks of 99 (a's token
        // takes one of the budget), 99 and 52 in the next three steps, each 10 ms + 1 ms
        // a token; a's tokens wait for them.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let b = e.join_batch(250, 1, 2, e.admit().unwrap());
        assert_eq!(e.stats().waiting, 1);
        let b = token_times(t0, b).await;
        assert_eq!(a.await.unwrap(), [15, 25, 134, 243, 305, 315]);
        assert_eq!(b, [305, 315]);
        let s = e.stats();
        assert_eq!((s.waiting, s.running), (0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_gone_leaves_the_batch() {
        let e = engine(100);
        let gone = e.join_batch(1000, 1, 4, e.admit().unwrap());
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(e.stats().running, 1);
        drop(gone);
        let t0 = Instant::now();
        let next = e.join_batch(5, 1, 1, e.admit().unwrap());
        // The step running when it left ends (at most 110 ms), then one of 15 ms.
        let at = token_times(t0, next).await;
        assert!(at[0] <= 125, "{at:?}");
        assert_eq!(e.stats().running, 0);
    }
}

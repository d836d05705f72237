//! One shutdown signal for the whole process: a `watch` channel every task can await.

use tokio::sync::watch;

/// Sending half: call [`Trigger::shutdown`] once to stop everything.
#[derive(Debug, Clone)]
pub struct Trigger(watch::Sender<bool>);

/// Receiving half, cheap to clone into each task.
#[derive(Debug, Clone)]
pub struct Shutdown(watch::Receiver<bool>);

/// A connected pair.
pub fn channel() -> (Trigger, Shutdown) {
    let (tx, rx) = watch::channel(false);
    (Trigger(tx), Shutdown(rx))
}

impl Trigger {
    pub fn shutdown(&self) {
        self.0.send_replace(true);
    }
}

impl Shutdown {
    /// Resolves once shutdown has been triggered (at once if it already was, or if the
    /// trigger was dropped).
    pub async fn wait(&mut self) {
        let _ = self.0.wait_for(|stop| *stop).await;
    }
}

/// SIGTERM and SIGINT, caught from creation on: until a handler is registered, their
/// default action ends the process at once, so the binary creates this before it
/// listens.
pub struct TerminateSignals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl TerminateSignals {
    pub fn new() -> std::io::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(TerminateSignals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }

    /// Resolves on the next SIGTERM or SIGINT.
    pub async fn recv(&mut self) {
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
        }
    }
}

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

    pub fn is_triggered(&self) -> bool {
        *self.0.borrow()
    }
}

/// Resolves on the first SIGTERM or SIGINT (Ctrl-C).
pub async fn terminate_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(mut term), Ok(mut int)) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
            }
            _ => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

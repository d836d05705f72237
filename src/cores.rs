//! Thread-per-core serving: each client connection runs, for its whole life, on one of
//! N single-threaded tokio runtimes (one OS thread each), handed out round robin as
//! connections are accepted.
//!
//! Why: on tokio's work-stealing runtime a request's task, woken by the I/O driver on
//! one thread, wakes an idle second worker thread to look for work, and the task moves
//! between threads; at one connection that cost 1.4 extra context switches a request
//! and about a quarter of the router's CPU (README "Performance", sessions 17 and 19). On a
//! runtime of its own, a connection's reads, its upstream calls (whose connections are
//! kept per runtime, see `crate::pools::pool::keep_alive`) and its writes all run on one
//! thread, as nginx's workers do. Background work (health probes, scrapes, the tree's
//! upkeep, reloads, the admin listener) stays on the main multi-threaded runtime.
//!
//! A connection is not moved once placed, so one very busy connection uses one core at
//! most (as with nginx); many connections spread over all of them.

use std::cell::Cell;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;

/// Environment variable: how many connection runtimes to run (`0`: none, connections run
/// on the main runtime as tasks; unset: one per available core).
pub const THREADS_ENV: &str = "CACHE_AWARE_ROUTER_THREADS";

thread_local! {
    /// This thread's runtime: `1..=N` on a connection runtime's thread, 0 elsewhere.
    static HOME: Cell<usize> = const { Cell::new(0) };
}

/// The runtime this code runs on, for keeping resources with the runtime that polls
/// them: `1..=N` on a connection runtime, 0 anywhere else (the main runtime, tests).
pub fn home() -> usize {
    HOME.with(Cell::get)
}

/// The connection runtimes. Dropping it (or [`Cores::stop`]) ends their threads; tasks
/// still on them are dropped, so stop them only after the connections have drained.
pub struct Cores {
    handles: Vec<tokio::runtime::Handle>,
    next: AtomicUsize,
    threads: std::sync::Mutex<Vec<(JoinHandle<()>, tokio::sync::oneshot::Sender<()>)>>,
}

impl Cores {
    /// How many connection runtimes [`THREADS_ENV`] asks for: its value, else the
    /// number of cores the process may use. `Err` names a value that is not a number.
    pub fn wanted() -> Result<usize, String> {
        threads(std::env::var(THREADS_ENV).ok().as_deref())
    }

    /// Starts `n` runtimes (at least one), each on a thread named `conn-I`.
    pub fn start(n: usize) -> std::io::Result<Self> {
        let n = n.max(1);
        let mut handles = Vec::with_capacity(n);
        let mut threads = Vec::with_capacity(n);
        for i in 1..=n {
            // Log lines gathered on the thread are written out when it runs out of work.
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .on_thread_park(crate::log_sink::flush)
                .build()?;
            handles.push(runtime.handle().clone());
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let thread = std::thread::Builder::new()
                .name(format!("conn-{i}"))
                .spawn(move || {
                    HOME.with(|h| h.set(i));
                    crate::log_sink::gather_on_this_thread();
                    // A current-thread runtime runs its tasks only inside `block_on`.
                    let _ = runtime.block_on(stopped);
                })?;
            threads.push((thread, stop));
        }
        Ok(Cores {
            handles,
            next: AtomicUsize::new(0),
            threads: std::sync::Mutex::new(threads),
        })
    }

    /// Runs `task` on the next runtime, round robin.
    pub fn spawn<F>(&self, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.handles.len();
        drop(self.handles[i].spawn(task));
    }

    /// Ends the runtimes and waits for their threads (blocking: call it off the async
    /// threads, or at exit).
    pub fn stop(&self) {
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|e| e.into_inner()));
        for (thread, stop) in threads {
            let _ = stop.send(());
            let _ = thread.join();
        }
    }
}

/// [`Cores::wanted`] for the variable's value (`None`: unset).
fn threads(value: Option<&str>) -> Result<usize, String> {
    match value {
        Some(v) => v
            .trim()
            .parse()
            .map_err(|_| format!("{THREADS_ENV}={v:?}: expected a number of threads (0 for none)")),
        None => Ok(std::thread::available_parallelism().map_or(1, |n| n.get())),
    }
}

impl Drop for Cores {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tasks_go_round_robin_to_runtimes_that_know_their_home() {
        let cores = Cores::start(2).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        for _ in 0..4 {
            let tx = tx.clone();
            cores.spawn(async move {
                tokio::task::yield_now().await;
                let _ = tx.send(home());
            });
        }
        let mut homes: Vec<usize> = (0..4).map(|_| rx.recv().unwrap()).collect();
        homes.sort();
        assert_eq!(homes, [1, 1, 2, 2]);
        assert_eq!(home(), 0, "the test's own thread is no runtime's");
        cores.stop();
    }

    #[test]
    fn the_thread_count_is_the_variables_or_one_per_core() {
        assert_eq!(threads(Some("3")), Ok(3));
        assert_eq!(threads(Some(" 0 ")), Ok(0));
        let cores = std::thread::available_parallelism().unwrap().get();
        assert_eq!(threads(None), Ok(cores));
        let e = threads(Some("two")).unwrap_err();
        assert!(e.contains("CACHE_AWARE_ROUTER_THREADS=\"two\""), "{e}");
    }
}

//! A worker's idle keep-alive connections: HTTP/1.1 connections the proxy opened to it
//! whose last answer has been read to its end, kept for the next request.
//!
//! Kept per worker, so a request finds its connections without a pool-wide lookup (a
//! shared pool keyed by scheme and authority hashes the key and takes a pool-wide lock
//! twice per request). The proxy opens, uses and returns the connections
//! (`crate::upstream`); this list only holds them. Connections close when
//! dropped: taken after `max_idle`, closed by the worker, reaped by
//! [`KeepAlive::close_idle`], or with the worker when it leaves the pool.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;

/// The read/write half of a connection: hyper's dispatcher, which ends when the
/// connection closes.
type Driver = Pin<Box<dyn Future<Output = hyper::Result<()>> + Send + Sync>>;

/// One HTTP/1.1 connection to a worker: hyper's sending half and its read/write half,
/// driven by whoever uses the connection (the request's own task, as it sends and as its
/// answer's body is read) instead of a task of its own.
///
/// Why: with a task per connection, every upstream read woke that task, which then woke
/// the request's task, often on the other core: two task wake-ups and a thread hop per
/// response chunk (20 per streamed answer). Driven in place, the socket wakes the
/// request's task directly.
///
/// An idle connection is not driven: a worker's close is seen when the connection is
/// next taken ([`KeepAlive::take`]) or reaped ([`KeepAlive::close_idle`]).
pub struct Conn {
    send: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    /// `None` once the connection has closed.
    driver: Option<Driver>,
    /// The worker's label, for the debug line when the connection ends in an error.
    label: std::sync::Arc<str>,
    /// The runtime whose I/O driver its socket is registered with ([`crate::cores::home`]):
    /// used from another one, every read would wake a task across threads.
    home: usize,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("worker", &self.label)
            .field("closed", &self.is_closed())
            .finish()
    }
}

impl Conn {
    /// A connection from hyper's handshake (`send`, `driver`) to the worker `label`,
    /// opened on this thread's runtime.
    pub fn new<D>(
        send: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
        driver: D,
        label: std::sync::Arc<str>,
    ) -> Self
    where
        D: Future<Output = hyper::Result<()>> + Send + Sync + 'static,
    {
        Conn {
            send,
            driver: Some(Box::pin(driver)),
            label,
            home: crate::cores::home(),
        }
    }

    /// Whether the connection has closed, as of the last time it was driven.
    pub fn is_closed(&self) -> bool {
        self.driver.is_none() || self.send.is_closed()
    }

    /// Lets hyper read and write what the socket allows now; `cx` is woken when there is
    /// more. Returns whether the connection is still open.
    pub fn poll_drive(&mut self, cx: &mut Context<'_>) -> bool {
        if let Some(driver) = &mut self.driver
            && let Poll::Ready(ended) = driver.as_mut().poll(cx)
        {
            if let Err(e) = ended {
                tracing::debug!(worker = %self.label, error = %crate::error::describe(&e), "upstream connection ended");
            }
            self.driver = None;
        }
        self.driver.is_some()
    }

    /// Drives it once without waiting (no task is woken later): whether it is still
    /// open. Sees a close the worker sent while it was idle.
    pub fn is_open_now(&mut self) -> bool {
        self.poll_drive(&mut Context::from_waker(Waker::noop())) && !self.send.is_closed()
    }

    /// Resolves when the connection can take a request; fails when it has closed.
    pub async fn ready(&mut self) -> hyper::Result<()> {
        std::future::poll_fn(|cx| {
            self.poll_drive(cx);
            self.send.poll_ready(cx)
        })
        .await
    }

    /// Sends `req`, driving the connection until the answer's head arrives.
    pub async fn send_request(
        &mut self,
        req: Request<Full<Bytes>>,
    ) -> hyper::Result<Response<Incoming>> {
        let mut answer = std::pin::pin!(self.send.send_request(req));
        std::future::poll_fn(|cx| {
            self.poll_drive(cx);
            answer.as_mut().poll(cx)
        })
        .await
    }
}

/// Idle connections to one worker, most recently used last.
#[derive(Default)]
pub struct KeepAlive {
    /// `(connection, when it went idle)`, in the order they went idle.
    idle: parking_lot::Mutex<Vec<(Conn, Instant)>>,
}

impl std::fmt::Debug for KeepAlive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeepAlive")
            .field("idle", &self.idle.lock().len())
            .finish()
    }
}

impl KeepAlive {
    /// The most recently idled connection opened on this thread's runtime
    /// ([`crate::cores::home`]), if it has been idle for less than `max_idle` and the
    /// worker has not closed it (the latest is the likeliest to be open still, and the
    /// least likely to meet the worker's own keep-alive limit). `None`: open a new one.
    /// Connections passed over are closed, outside the lock (as is the check for a
    /// close); those idle for `max_idle` go on the way.
    pub fn take(&self, max_idle: Duration) -> Option<Conn> {
        let now = Instant::now();
        let home = crate::cores::home();
        let expired = |since: &Instant| now.saturating_duration_since(*since) >= max_idle;
        loop {
            let mut idle = self.idle.lock();
            // In the order they went idle: the expired ones are at the front.
            let fresh_from = match idle.first() {
                Some((_, since)) if expired(since) => idle
                    .iter()
                    .position(|(_, s)| !expired(s))
                    .unwrap_or(idle.len()),
                _ => 0,
            };
            let gone: Vec<_> = idle.drain(..fresh_from).collect();
            let conn = idle
                .iter()
                .rposition(|(c, _)| c.home == home)
                .map(|i| idle.remove(i).0);
            drop(idle);
            drop(gone);
            let mut conn = conn?;
            if conn.is_open_now() {
                return Some(conn);
            }
        }
    }

    /// Keeps `conn` for the next request (dropped instead when it has closed).
    pub fn put(&self, conn: Conn) {
        if !conn.is_closed() {
            self.idle.lock().push((conn, Instant::now()));
        }
    }

    /// Closes the connections idle for `max_idle` or more, and those the worker closed.
    /// Returns how many stay.
    pub fn close_idle(&self, max_idle: Duration) -> usize {
        let now = Instant::now();
        let mut idle = self.idle.lock();
        let keep_from = idle
            .iter()
            .position(|(_, since)| now.saturating_duration_since(*since) < max_idle)
            .unwrap_or(idle.len());
        let mut closed: Vec<_> = idle.drain(..keep_from).collect();
        let mut i = 0;
        while i < idle.len() {
            // A reaper's pass (every second at most), not a request's: driving each
            // idle connection here is what notices a worker's close while it idles.
            if idle[i].0.is_open_now() {
                i += 1;
            } else {
                closed.push(idle.remove(i));
            }
        }
        let left = idle.len();
        drop(idle);
        drop(closed);
        left
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection over an in-memory pipe (no server: nothing is sent), open while the
    /// pipe's other end is kept, closed once that is dropped.
    async fn conn() -> (Conn, impl Drop) {
        let (ours, theirs) = tokio::io::duplex(1024);
        let (send, io) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(ours))
            .await
            .expect("handshake over a pipe");
        (Conn::new(send, io, "pipe".into()), theirs)
    }

    #[tokio::test]
    async fn the_latest_open_connection_is_taken_and_closed_or_expired_ones_are_dropped() {
        let keep = KeepAlive::default();
        let long = Duration::from_secs(3600);
        assert!(keep.take(long).is_none());
        let (a, a_io) = conn().await;
        let (b, b_io) = conn().await;
        let (c, c_io) = conn().await;
        keep.put(a);
        keep.put(b);
        keep.put(c);
        // The latest (c) goes first; once its other half is gone it is passed over.
        drop(c_io);
        let taken = keep.take(long).expect("b is open");
        assert!(!taken.is_closed());
        keep.put(taken);
        // b was put back last: closing it leaves a as the one taken.
        drop(b_io);
        assert!(keep.take(long).is_some(), "a is open");
        assert!(keep.take(long).is_none(), "b and c were dropped on the way");
        drop(a_io);

        // Reaping: expired ones go, and so do closed ones; open, fresh ones stay.
        let (d, _d_io) = conn().await;
        let (e, e_io) = conn().await;
        keep.put(d);
        keep.put(e);
        drop(e_io);
        assert_eq!(keep.close_idle(long), 1, "the closed one is reaped");
        assert_eq!(keep.close_idle(Duration::ZERO), 0, "every idle one expired");
        let (f, _f_io) = conn().await;
        keep.put(f);
        assert!(keep.take(Duration::ZERO).is_none(), "too old to reuse");
        assert!(keep.take(long).is_none(), "and gone");
    }

    #[tokio::test]
    async fn only_a_connection_of_this_threads_runtime_is_taken() {
        let keep = KeepAlive::default();
        let long = Duration::from_secs(3600);
        let (mut theirs, _t) = conn().await;
        theirs.home = 1; // opened on connection runtime 1; this test runs on none (0)
        let (ours, _o) = conn().await;
        keep.put(ours);
        keep.put(theirs);
        let taken = keep
            .take(long)
            .expect("ours, behind the later one of runtime 1");
        assert_eq!(taken.home, 0);
        assert!(keep.take(long).is_none(), "runtime 1's is left for it");
        assert_eq!(keep.close_idle(long), 1);
    }

    #[tokio::test]
    async fn a_closed_connection_is_not_kept() {
        let keep = KeepAlive::default();
        let (a, a_io) = conn().await;
        drop(a_io);
        keep.put(a);
        assert_eq!(keep.close_idle(Duration::from_secs(3600)), 0);
    }
}

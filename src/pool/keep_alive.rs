//! A worker's idle keep-alive connections: HTTP/1.1 connections the proxy opened to it
//! whose last answer has been read to its end, kept for the next request.
//!
//! Kept per worker, so a request finds its connections without a pool-wide lookup (a
//! shared pool keyed by scheme and authority hashes the key and takes a pool-wide lock
//! twice per request). The proxy opens, uses and returns the connections
//! (`crate::proxy::upstream`); this list only holds them. Connections close when
//! dropped: taken after `max_idle`, closed by the worker, reaped by
//! [`KeepAlive::close_idle`], or with the worker when it leaves the pool.

use std::time::{Duration, Instant};

/// The sending half of one HTTP/1.1 connection to a worker (its read/write half runs
/// as a task of its own until the connection closes).
pub type Conn = hyper::client::conn::http1::SendRequest<http_body_util::Full<bytes::Bytes>>;

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
    /// The most recently idled connection, if it has been idle for less than `max_idle`
    /// and the worker has not closed it (the latest is the likeliest to be open still,
    /// and the least likely to meet the worker's own keep-alive limit). Connections
    /// passed over are closed, outside the lock.
    pub fn take(&self, max_idle: Duration) -> Option<Conn> {
        let now = Instant::now();
        let mut idle = self.idle.lock();
        let mut closed = Vec::new();
        while let Some((conn, since)) = idle.pop() {
            if now.saturating_duration_since(since) >= max_idle {
                // Every older one is older still.
                closed.push(conn);
                closed.extend(idle.drain(..).map(|(c, _)| c));
                break;
            }
            if !conn.is_closed() {
                drop(idle);
                drop(closed);
                return Some(conn);
            }
            closed.push(conn);
        }
        drop(idle);
        drop(closed);
        None
    }

    /// Keeps `conn` for the next request (dropped instead when the worker closed it).
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
            if idle[i].0.is_closed() {
                closed.push(idle.remove(i));
            } else {
                i += 1;
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

    /// A connection over an in-memory pipe (no server: nothing is sent), open while its
    /// read/write half is kept, closed once that is dropped.
    async fn conn() -> (Conn, impl Drop) {
        let (ours, theirs) = tokio::io::duplex(1024);
        let (send, io) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(ours))
            .await
            .expect("handshake over a pipe");
        (send, Box::new((io, theirs)))
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
        tokio::task::yield_now().await;
        let taken = keep.take(long).expect("b is open");
        assert!(!taken.is_closed());
        keep.put(taken);
        // b was put back last: closing it leaves a as the one taken.
        drop(b_io);
        tokio::task::yield_now().await;
        assert!(keep.take(long).is_some(), "a is open");
        assert!(keep.take(long).is_none(), "b and c were dropped on the way");
        drop(a_io);

        // Reaping: expired ones go, and so do closed ones; open, fresh ones stay.
        let (d, _d_io) = conn().await;
        let (e, e_io) = conn().await;
        keep.put(d);
        keep.put(e);
        drop(e_io);
        tokio::task::yield_now().await;
        assert_eq!(keep.close_idle(long), 1, "the closed one is reaped");
        assert_eq!(keep.close_idle(Duration::ZERO), 0, "every idle one expired");
        let (f, _f_io) = conn().await;
        keep.put(f);
        assert!(keep.take(Duration::ZERO).is_none(), "too old to reuse");
        assert!(keep.take(long).is_none(), "and gone");
    }

    #[tokio::test]
    async fn a_closed_connection_is_not_kept() {
        let keep = KeepAlive::default();
        let (a, a_io) = conn().await;
        drop(a_io);
        tokio::task::yield_now().await;
        keep.put(a);
        assert_eq!(keep.close_idle(Duration::from_secs(3600)), 0);
    }
}

//! Where log lines go: stderr. On a connection thread ([`crate::cores`]) a line is
//! gathered in the thread's buffer and written out with the lines beside it when the
//! thread's runtime runs out of work (tokio's `on_thread_park`, see [`flush`]), when the
//! buffer holds [`FLUSH_BYTES`], or when the thread ends; on every other thread each line
//! is written as it comes.
//!
//! Why: one access line per request made one `write(2)` to stderr per request, 3.5% of
//! the router's CPU at 64 connections with stderr on `/dev/null` (perf, README
//! "Performance", session 20; on a pipe, whose reader each write wakes, likely more: not
//! measured). A line waits at most until its thread next goes idle, or until
//! [`FLUSH_BYTES`] have gathered on a thread that does not. Lines are written whole and
//! in the order each thread wrote them (the stderr lock is held for each write-out, so
//! threads never cut into each other's lines; lines of different threads keep their own
//! timestamps, not a global order).
//!
//! Lost on a crash that skips thread-exit (SIGKILL, abort): the lines of the stretch the
//! thread was busy with. The router's graceful stop ends the connection threads, which
//! writes out what they hold.

use std::cell::RefCell;
use std::io::{self, Write};

use tracing_subscriber::fmt::MakeWriter;

/// Gathered bytes on one thread at which they are written out without waiting for the
/// thread to go idle (16 KiB: about 60 access lines).
pub const FLUSH_BYTES: usize = 16 * 1024;

/// A thread's gathered lines; what is left is written out when the thread ends.
struct Gathered(Vec<u8>);

impl Gathered {
    /// Adds `line`; writes everything out through `out` once [`FLUSH_BYTES`] are held.
    fn push(&mut self, line: &[u8], out: impl FnOnce(&[u8])) {
        self.0.extend_from_slice(line);
        if self.0.len() >= FLUSH_BYTES {
            self.write_out(out);
        }
    }

    fn write_out(&mut self, out: impl FnOnce(&[u8])) {
        if !self.0.is_empty() {
            out(&self.0);
            self.0.clear();
        }
    }
}

impl Drop for Gathered {
    fn drop(&mut self) {
        self.write_out(to_stderr);
    }
}

thread_local! {
    /// `Some` on a thread that gathers its lines ([`gather_on_this_thread`]).
    static GATHERED: RefCell<Option<Gathered>> = const { RefCell::new(None) };
}

/// Writes `bytes` to stderr whole (a failed write is dropped: nowhere is left to report
/// it, as with tracing-subscriber's own stderr writer).
fn to_stderr(bytes: &[u8]) {
    let _ = io::stderr().lock().write_all(bytes);
}

/// From now on this thread's log lines are gathered until [`flush`] (to be called when
/// the thread goes idle), until [`FLUSH_BYTES`] are held, or until the thread ends.
pub fn gather_on_this_thread() {
    GATHERED.with(|g| *g.borrow_mut() = Some(Gathered(Vec::with_capacity(FLUSH_BYTES))));
}

/// Writes out the lines this thread has gathered (none gathered, or a thread that does
/// not gather: nothing to do). Meant for `tokio::runtime::Builder::on_thread_park`.
pub fn flush() {
    let _ = GATHERED.try_with(|g| {
        if let Ok(mut g) = g.try_borrow_mut()
            && let Some(g) = g.as_mut()
        {
            g.write_out(to_stderr);
        }
    });
}

/// The log writer for `tracing_subscriber::fmt().with_writer(…)`: stderr, gathered per
/// thread where [`gather_on_this_thread`] was called.
#[derive(Debug, Default, Clone, Copy)]
pub struct Stderr;

impl<'a> MakeWriter<'a> for Stderr {
    type Writer = LineWriter;

    fn make_writer(&'a self) -> LineWriter {
        LineWriter
    }
}

/// One line's writer (tracing-subscriber formats a line, then writes it in one call).
#[derive(Debug)]
pub struct LineWriter;

impl Write for LineWriter {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        let gathered = GATHERED
            .try_with(|g| match g.try_borrow_mut() {
                Ok(mut g) => match g.as_mut() {
                    Some(g) => {
                        g.push(bytes, to_stderr);
                        true
                    }
                    None => false,
                },
                // Written from inside a write-out (cannot happen today): straight through.
                Err(_) => false,
            })
            .unwrap_or(false);
        if !gathered {
            io::stderr().lock().write_all(bytes)?;
        }
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_held_until_the_buffer_fills_then_written_whole_and_in_order() {
        let mut g = Gathered(Vec::new());
        let mut written: Vec<Vec<u8>> = Vec::new();
        let line = [b'x'; 100];
        let lines_to_fill = FLUSH_BYTES.div_ceil(line.len());
        for i in 0..lines_to_fill - 1 {
            let mut l = line.to_vec();
            l[0] = (i % 256) as u8;
            g.push(&l, |b| written.push(b.to_vec()));
        }
        assert!(written.is_empty(), "held below {FLUSH_BYTES} bytes");
        g.push(&line, |b| written.push(b.to_vec()));
        assert_eq!(written.len(), 1, "one write for the whole buffer");
        assert_eq!(written[0].len(), lines_to_fill * line.len());
        assert_eq!(written[0][100], 1, "second line second");
        assert!(g.0.is_empty());
        g.write_out(|_| panic!("nothing left to write"));
    }

    #[test]
    fn a_thread_that_does_not_gather_holds_nothing_and_one_that_does_holds_until_flush() {
        std::thread::spawn(|| {
            assert!(GATHERED.with(|g| g.borrow().is_none()));
            gather_on_this_thread();
            LineWriter.write_all(b"held line\n").unwrap();
            let held = GATHERED.with(|g| g.borrow().as_ref().unwrap().0.clone());
            assert_eq!(held, b"held line\n");
            flush();
            assert!(GATHERED.with(|g| g.borrow().as_ref().unwrap().0.is_empty()));
        })
        .join()
        .unwrap();
    }
}

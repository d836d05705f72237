//! The text log line, written for less: the same `timestamp LEVEL target: message
//! key=value …` line tracing-subscriber's `fmt` layer writes without colour, byte for
//! byte, with its most expensive steps done another way. One access line per request
//! makes these steps part of the hot path: measured with callgrind, the line cost 15.8 k
//! of a proxied request's ~110 k instructions, of which `Debug` escaping of string
//! fields, integer padding, float formatting and the RFC 3339 timestamp were most.
//!
//! - [`PlainFields`]: `key=value` pairs; a string that needs no escaping is written
//!   between quotes as it is (what `Debug` would write), integers through `itoa`.
//! - [`CachedTime`]: the timestamp's date and time of day are formatted once per second
//!   per thread; each line adds only its microseconds.
//! - [`Decimal`]: a fixed-point number for a field (`{:.3}` of a ratio, `{:.1}` of ms),
//!   from integer digits instead of float formatting.
//!
//! `log.format: json` and coloured text keep tracing-subscriber's own field formatters;
//! every format takes its timestamp from [`CachedTime`] (the same text as before).

use std::cell::Cell;
use std::fmt::{self, Write};
use std::time::{SystemTime, UNIX_EPOCH};

use tracing::field::{Field, Visit};
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::fmt::FormatFields;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::FormatTime;

/// Fields as `message key=value key=value …`: the message as written, every other value
/// as `Debug` writes it (strings quoted and escaped), one space between fields —
/// tracing-subscriber's `DefaultFields` without colour (apart from an error's
/// `error.sources`, which this does not add).
#[derive(Debug, Default, Clone, Copy)]
pub struct PlainFields;

impl<'w> FormatFields<'w> for PlainFields {
    fn format_fields<R: RecordFields>(&self, writer: Writer<'w>, fields: R) -> fmt::Result {
        let mut v = PlainVisitor {
            writer,
            first: true,
            result: Ok(()),
        };
        fields.record(&mut v);
        v.result
    }
}

struct PlainVisitor<'w> {
    writer: Writer<'w>,
    first: bool,
    /// The first write error; later fields are skipped.
    result: fmt::Result,
}

impl PlainVisitor<'_> {
    /// Writes the separator and `name=` (nothing for the message), then `value`.
    fn field(&mut self, field: &Field, value: impl FnOnce(&mut Writer<'_>) -> fmt::Result) {
        if self.result.is_err() {
            return;
        }
        let w = &mut self.writer;
        self.result = (|| {
            if !std::mem::take(&mut self.first) {
                w.write_char(' ')?;
            }
            match field.name() {
                "message" => {}
                // A raw identifier (`r#type = …`) is logged by its name.
                name => {
                    w.write_str(name.strip_prefix("r#").unwrap_or(name))?;
                    w.write_char('=')?;
                }
            }
            value(w)
        })();
    }
}

/// Whether `Debug` writes `s` as itself between quotes: printable ASCII, no `"` or `\`.
fn needs_no_escape(s: &str) -> bool {
    // Every byte tested, no early exit: the loop vectorises (fields are short, and
    // nearly all pass).
    s.bytes().fold(true, |ok, b| {
        ok & (0x20..0x7f).contains(&b) & (b != b'"') & (b != b'\\')
    })
}

impl Visit for PlainVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        let message = field.name() == "message";
        self.field(field, |w| {
            if message {
                w.write_str(value)
            } else if needs_no_escape(value) {
                w.write_char('"')?;
                w.write_str(value)?;
                w.write_char('"')
            } else {
                write!(w, "{value:?}")
            }
        });
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.field(field, |w| w.write_str(itoa::Buffer::new().format(value)));
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.field(field, |w| w.write_str(itoa::Buffer::new().format(value)));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.field(field, |w| w.write_str(if value { "true" } else { "false" }));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.field(field, |w| write!(w, "{value:?}"));
    }
}

/// UTC timestamps as tracing-subscriber's `SystemTime` writes them (RFC 3339,
/// microseconds, `Z`: `2026-12-03T14:40:32.608677Z`), the part up to the second cached
/// per thread.
#[derive(Debug, Default, Clone, Copy)]
pub struct CachedTime;

/// `YYYY-MM-DDTHH:MM:SS.`: the cached part of a timestamp.
const SECOND_BYTES: usize = 20;

thread_local! {
    /// The second last formatted on this thread, and its text.
    static SECOND: Cell<(u64, [u8; SECOND_BYTES])> = const { Cell::new((u64::MAX, [0; SECOND_BYTES])) };
}

impl FormatTime for CachedTime {
    fn format_time(&self, w: &mut Writer<'_>) -> fmt::Result {
        let Ok(since) = SystemTime::now().duration_since(UNIX_EPOCH) else {
            // A clock before 1970: tracing-subscriber's own formatter handles it.
            return tracing_subscriber::fmt::time::SystemTime.format_time(w);
        };
        let secs = since.as_secs();
        let (cached, mut text) = SECOND.get();
        if cached != secs {
            match second_text(secs) {
                Some(t) => text = t,
                None => return tracing_subscriber::fmt::time::SystemTime.format_time(w),
            }
            SECOND.set((secs, text));
        }
        w.write_str(std::str::from_utf8(&text).map_err(|_| fmt::Error)?)?;
        let mut micros = [b'0'; 6];
        let mut n = since.subsec_micros();
        for d in micros.iter_mut().rev() {
            *d = b'0' + (n % 10) as u8;
            n /= 10;
        }
        w.write_str(std::str::from_utf8(&micros).map_err(|_| fmt::Error)?)?;
        w.write_char('Z')
    }
}

/// `YYYY-MM-DDTHH:MM:SS.` of `secs` since the Unix epoch (UTC); `None` past year 9999
/// (a width the cache does not hold).
fn second_text(secs: u64) -> Option<[u8; SECOND_BYTES]> {
    use chrono::{Datelike, Timelike};
    let t = chrono::DateTime::from_timestamp(i64::try_from(secs).ok()?, 0)?.naive_utc();
    if t.year() > 9999 {
        return None;
    }
    let mut out = [0u8; SECOND_BYTES];
    let mut s = String::with_capacity(SECOND_BYTES);
    write!(
        s,
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.",
        t.year(),
        t.month(),
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    )
    .ok()?;
    out.copy_from_slice(s.as_bytes().get(..SECOND_BYTES)?);
    Some(out)
}

/// A non-negative number written with a fixed number of decimals, as `{:.N}` writes an
/// `f64`, from integer digits. Rounds half away from zero (`{:.N}` rounds the exact
/// binary value half to even: the two differ only on exact ties). A value that is
/// negative, not finite or too large for the integer path is written by `{:.N}` itself.
#[derive(Debug, Clone, Copy)]
pub struct Decimal {
    value: f64,
    places: u8,
}

impl Decimal {
    /// `value` with `places` decimals (at most 9).
    pub fn new(value: f64, places: u8) -> Self {
        Decimal {
            value,
            places: places.min(9),
        }
    }

    /// A duration in milliseconds with `places` decimals, from its nanoseconds.
    pub fn millis(d: std::time::Duration, places: u8) -> Self {
        Decimal::new(d.as_secs_f64() * 1e3, places)
    }
}

impl fmt::Display for Decimal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scale = 10u64.pow(u32::from(self.places));
        let scaled = (self.value * scale as f64).round();
        // Below 2^53 every integer is exact in an f64.
        if !(self.value >= 0.0 && scaled < 9_007_199_254_740_992.0) {
            return write!(f, "{:.*}", usize::from(self.places), self.value);
        }
        let scaled = scaled as u64;
        f.write_str(itoa::Buffer::new().format(scaled / scale))?;
        if self.places == 0 {
            return Ok(());
        }
        let mut frac = [b'0'; 9];
        let digits = &mut frac[..usize::from(self.places)];
        let mut n = scaled % scale;
        for d in digits.iter_mut().rev() {
            *d = b'0' + (n % 10) as u8;
            n /= 10;
        }
        f.write_char('.')?;
        f.write_str(std::str::from_utf8(digits).map_err(|_| fmt::Error)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use tracing_subscriber::fmt::format::DefaultFields;
    use tracing_subscriber::fmt::time::SystemTime as SubscriberTime;

    /// The line a subscriber with `fields` and `timer` writes for one event.
    fn line<F, T>(fields: F, timer: T, event: impl FnOnce()) -> String
    where
        F: for<'w> FormatFields<'w> + Send + Sync + 'static,
        T: FormatTime + Send + Sync + 'static,
    {
        let buf = std::sync::Arc::new(std::sync::Mutex::new(Vec::<u8>::new()));
        let sink = std::sync::Arc::clone(&buf);
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || Sink(std::sync::Arc::clone(&sink)))
            .with_ansi(false)
            .with_timer(timer)
            .fmt_fields(fields)
            .finish();
        tracing::subscriber::with_default(subscriber, event);
        let out = buf.lock().map(|b| b.clone()).unwrap_or_default();
        String::from_utf8(out).unwrap_or_default()
    }

    struct Sink(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
    impl std::io::Write for Sink {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            if let Ok(mut v) = self.0.lock() {
                v.extend_from_slice(b);
            }
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// No timestamp: the fields alone compare.
    struct NoTime;
    impl FormatTime for NoTime {
        fn format_time(&self, _: &mut Writer<'_>) -> fmt::Result {
            Ok(())
        }
    }

    #[test]
    fn fields_read_as_the_default_formatter_writes_them_without_colour() {
        let event = || {
            tracing::info!(
                id = "0c9c7d",
                path = "a \"quoted\" \\ tab\there é\u{0}",
                empty = "",
                n = 304u64,
                neg = -1i64,
                ok = true,
                ratio = %Decimal::new(0.99, 3),
                d = ?std::time::Duration::from_millis(5),
                float = 0.25f64,
                r#type = "t",
                "request {}",
                7
            )
        };
        let ours = line(PlainFields, NoTime, event);
        let theirs = line(DefaultFields::new(), NoTime, event);
        assert_eq!(ours, theirs);
        assert!(
            ours.contains(
                r#"request 7 id="0c9c7d" path="a \"quoted\" \\ tab\there é\0" empty="" n=304 neg=-1 ok=true ratio=0.990 d=5ms float=0.25 type="t""#
            ),
            "{ours}"
        );
        // A message given as a string is written as it is, not quoted.
        let event = || tracing::info!(message = "plain \"text\"", n = 1u64);
        let ours = line(PlainFields, NoTime, event);
        assert_eq!(ours, line(DefaultFields::new(), NoTime, event));
        assert!(ours.contains(r#"plain "text" n=1"#), "{ours}");
    }

    #[test]
    fn timestamps_read_as_the_subscribers_own() {
        // Two lines a few µs apart, each against the subscriber's own timer around it:
        // the same second means the same text up to the micros, and the micros fall
        // between.
        for _ in 0..3 {
            let before = line(PlainFields, SubscriberTime, || tracing::info!("x"));
            let ours = line(PlainFields, CachedTime, || tracing::info!("x"));
            let after = line(PlainFields, SubscriberTime, || tracing::info!("x"));
            let stamp = |l: &str| l.split_whitespace().next().unwrap_or("").to_string();
            let (b, o, a) = (stamp(&before), stamp(&ours), stamp(&after));
            assert_eq!(o.len(), "2026-12-03T14:40:32.608677Z".len(), "{o}");
            assert!(o.ends_with('Z') && o.as_bytes()[19] == b'.', "{o}");
            if b[..20] == a[..20] {
                assert_eq!(o[..20], b[..20]);
                assert!(b <= o && o <= a, "{b} {o} {a}");
                return;
            }
        }
        panic!("three pairs straddled a second");
    }

    #[test]
    fn a_second_of_any_date_is_cached_as_rfc_3339() {
        let text = |s| second_text(s).map(|t| String::from_utf8_lossy(&t).into_owned());
        assert_eq!(text(0).as_deref(), Some("1970-01-01T00:00:00."));
        assert_eq!(text(1_796_308_832).as_deref(), Some("2026-12-03T14:40:32."));
        assert_eq!(text(951_782_400).as_deref(), Some("2000-02-29T00:00:00."));
        assert_eq!(text(253_402_300_800), None, "year 10000");
    }

    #[test]
    fn decimals_write_as_fixed_float_formatting_does() {
        for (v, places) in [
            (0.99, 3),
            (0.0, 3),
            (1.0, 3),
            (0.1234, 3),
            (6.54, 1),
            (1234.5678, 1),
            (0.04, 1),
            (12.0, 0),
            (1.23456, 4),
        ] {
            assert_eq!(
                Decimal::new(v, places).to_string(),
                format!("{v:.*}", usize::from(places)),
                "{v} to {places}"
            );
        }
        // Past the integer path, and values it does not take: `{:.N}` itself.
        for v in [1e300, -2.5, f64::NAN, f64::INFINITY] {
            assert_eq!(Decimal::new(v, 2).to_string(), format!("{v:.2}"));
        }
        assert_eq!(
            Decimal::millis(std::time::Duration::from_micros(6_460), 1).to_string(),
            "6.5"
        );
    }
}

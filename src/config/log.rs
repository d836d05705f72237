//! `log:` — the log lines' format, filter and colour (see `log_format`).

use serde::Deserialize;

use super::check::{Checker, ConfigError, named};
use super::difference::Section;

/// `log:` — tracing output.
#[derive(Debug, Clone, PartialEq)]
pub struct LogConfig {
    pub format: LogFormat,
    /// An `EnvFilter` directive such as `info` or `cache_aware_router=debug`; `RUST_LOG`
    /// wins when set. Default `info`.
    pub level: String,
    /// ANSI colours in text logs (default `auto`: only when stderr is a terminal).
    pub color: LogColor,
}

/// `log.color`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogColor {
    /// Colours when stderr is a terminal, none in a file or a pipe.
    Auto,
    Always,
    Never,
}

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

named!(LogColor {
    "auto" => LogColor::Auto,
    "always" => LogColor::Always,
    "never" => LogColor::Never,
});
named!(LogFormat { "text" => LogFormat::Text, "json" => LogFormat::Json });

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            format: LogFormat::Text,
            level: "info".into(),
            color: LogColor::Auto,
        }
    }
}

impl Section for LogConfig {
    const KEY: &'static str = "log";
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
pub(super) struct RawLog {
    format: Option<LogFormat>,
    level: Option<String>,
    color: Option<LogColor>,
}

impl RawLog {
    pub(super) fn validate(self, ck: &Checker<'_>) -> Result<LogConfig, ConfigError> {
        let d = LogConfig::default();
        let level = self.level.unwrap_or(d.level);
        if let Err(why) = check_log_filter(&level) {
            return Err(ck.bad("log.level", &level, why));
        }
        Ok(LogConfig {
            format: self.format.unwrap_or(d.format),
            level,
            color: self.color.unwrap_or(d.color),
        })
    }
}

/// Checks a `log.level` filter: comma-separated directives, each a level (`trace`,
/// `debug`, `info`, `warn`, `error`, `off`) or `target=level`. A bare word is refused:
/// `EnvFilter` would read `warning` as a target name and log nothing else.
fn check_log_filter(filter: &str) -> Result<(), String> {
    const LEVELS: [&str; 6] = ["trace", "debug", "info", "warn", "error", "off"];
    let is_level = |l: &str| LEVELS.iter().any(|x| x.eq_ignore_ascii_case(l.trim()));
    for d in filter.split(',') {
        let ok = match d.rsplit_once('=') {
            Some((target, level)) => !target.trim().is_empty() && is_level(level),
            None => is_level(d),
        };
        if !ok {
            return Err(format!(
                "is not a log filter: `{}` is neither a level ({}) nor `target=level`",
                d.trim().escape_debug(),
                LEVELS.join(", ")
            ));
        }
    }
    if tracing_subscriber::EnvFilter::try_new(filter).is_err() {
        return Err("is not a log level or filter".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::config::testing::{ONE, err, load};

    #[test]
    fn a_log_level_typo_is_refused_not_read_as_a_target() {
        for bad in [
            "warning",
            "\"\"",
            "\"True\"",
            "info,warning",
            "=debug",
            "x=loud",
        ] {
            let e = err(&[
                ("a.yaml", ONE),
                ("l.yaml", &format!("log:\n  level: {bad}\n")),
            ]);
            assert!(e.contains("log.level"), "{bad}: {e}");
        }
        for good in [
            "info",
            "WARN",
            "warn,cache_aware_router=debug",
            "hyper=off,info",
        ] {
            assert!(
                load(&[
                    ("a.yaml", ONE),
                    ("l.yaml", &format!("log:\n  level: \"{good}\"\n"))
                ])
                .is_ok(),
                "{good}"
            );
        }
    }
}

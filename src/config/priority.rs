//! `priority:` — priority classes (see `crate::flow`): an ordered list of class names,
//! the first the most urgent, one of which every request is given.

use serde::Deserialize;

use super::check::{Checker, ConfigError, named};
use super::difference::Section;

/// The classes when `priority.classes` is not written.
pub const DEFAULT_CLASSES: [&str; 4] = ["critical", "interactive", "standard", "batch"];

/// Most classes a config may list (they index small arrays on the request path).
pub const MAX_CLASSES: usize = 16;

/// `priority:` — see the module docs.
#[derive(Debug, Clone, PartialEq)]
pub struct PriorityConfig {
    /// Whether the section is written at all: with neither `priority:` nor `tenants:`
    /// the router does no flow control (one class, one tenant: today's FIFO queue).
    pub enabled: bool,
    /// The header a client names its class in (default `x-priority`): a class name,
    /// or an integer in vLLM's sense (see [`PriorityConfig::class_of_engine`]).
    pub header: http::HeaderName,
    /// Class names, most urgent first (default [`DEFAULT_CLASSES`]).
    pub classes: Vec<String>,
    /// Index in `classes` of the class a request that names none gets (default
    /// `standard`).
    pub default: usize,
    /// `priority.engine_priority`: write the request's class into the forwarded body as
    /// vLLM's `priority` (its engine's `--scheduling-policy priority` then orders its
    /// own queue the same way). Default false.
    pub engine_priority: bool,
    /// `priority.reserve`: per class (by index), the share of the workers' slots
    /// (`max_load`) held for it: no other class takes the part of its share it does
    /// not use. Each 0 to 1, together under 1; default none.
    pub reserve: Vec<f64>,
    /// `priority.preempt`: a request of the first class that finds no slot may cancel
    /// one of the last class that has not yet had its worker's answer (default false).
    pub preempt: bool,
    /// `priority.on_preempt`: what the cancelled request gets.
    pub on_preempt: OnPreempt,
}

/// `priority.on_preempt`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnPreempt {
    /// Back to the head of its queue, to be sent again (the default; at most three
    /// times, then as `error`).
    #[default]
    Requeue,
    /// 503 with `x-preempted: true` and `Retry-After`.
    Error,
}

named!(OnPreempt { "requeue" => OnPreempt::Requeue, "error" => OnPreempt::Error });

impl Default for PriorityConfig {
    fn default() -> Self {
        PriorityConfig {
            enabled: false,
            header: http::HeaderName::from_static("x-priority"),
            classes: DEFAULT_CLASSES.iter().map(|c| c.to_string()).collect(),
            default: 2,
            engine_priority: false,
            reserve: vec![0.0; 4],
            preempt: false,
            on_preempt: OnPreempt::Requeue,
        }
    }
}

impl PriorityConfig {
    /// The index of the class named `name`.
    pub fn class(&self, name: &str) -> Option<usize> {
        self.classes.iter().position(|c| c == name)
    }

    /// vLLM's `priority` for class `class` (lower runs earlier; a request that sends
    /// none has 0): the default class is 0, each class above it one less, each below
    /// one more. With the default classes: critical −2, interactive −1, standard 0,
    /// batch 1.
    pub fn engine_of_class(&self, class: usize) -> i64 {
        class as i64 - self.default as i64
    }

    /// The class a vLLM `priority` integer stands for: the inverse of
    /// [`PriorityConfig::engine_of_class`], clamped to the first and last class.
    pub fn class_of_engine(&self, priority: i64) -> usize {
        let last = self.classes.len().saturating_sub(1) as i64;
        (priority.saturating_add(self.default as i64)).clamp(0, last) as usize
    }
}

impl Section for PriorityConfig {
    const KEY: &'static str = "priority";
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
pub(super) struct RawPriority {
    header: Option<String>,
    classes: Option<Vec<String>>,
    default: Option<String>,
    engine_priority: Option<bool>,
    reserve: Option<std::collections::BTreeMap<String, f64>>,
    preempt: Option<bool>,
    on_preempt: Option<OnPreempt>,
}

/// Whether `name` may name a class or a tenant: 1 to 64 of `A-Z a-z 0-9 _ - .` (it
/// labels metrics and the access line).
pub(super) fn is_label(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

impl RawPriority {
    /// `written`: whether the files have a `priority:` key at all.
    pub(super) fn validate(
        self,
        ck: &Checker<'_>,
        written: bool,
    ) -> Result<PriorityConfig, ConfigError> {
        let d = PriorityConfig::default();
        let header = match self.header {
            None => d.header,
            Some(h) => http::HeaderName::from_bytes(h.as_bytes())
                .map_err(|_| ck.bad("priority.header", &h, "is not an HTTP header name"))?,
        };
        let classes = self.classes.unwrap_or(d.classes);
        if classes.is_empty() || classes.len() > MAX_CLASSES {
            return Err(ck.err(
                "priority.classes",
                format!("lists {} classes (1 to {MAX_CLASSES})", classes.len()),
            ));
        }
        for (i, c) in classes.iter().enumerate() {
            let key = format!("priority.classes[{i}]");
            if !is_label(c) {
                return Err(ck.bad(
                    &key,
                    c,
                    "is not a class name (1 to 64 of A-Z a-z 0-9 _ - .)",
                ));
            }
            if classes[..i].contains(c) {
                return Err(ck.bad(&key, c, "is listed twice"));
            }
        }
        let default = match &self.default {
            Some(name) => classes.iter().position(|c| c == name).ok_or_else(|| {
                ck.bad(
                    "priority.default",
                    name,
                    format!("is not one of priority.classes ({})", classes.join(", ")),
                )
            })?,
            None => classes
                .iter()
                .position(|c| c == "standard")
                .ok_or_else(|| {
                    ck.err(
                        "priority.default",
                        "is needed: priority.classes has no `standard` class to default to",
                    )
                })?,
        };
        let mut reserve = vec![0.0; classes.len()];
        for (name, share) in self.reserve.unwrap_or_default() {
            let key = format!("priority.reserve.{name}");
            let Some(c) = classes.iter().position(|c| *c == name) else {
                return Err(ck.err(
                    &key,
                    format!(
                        "names no class of priority.classes ({})",
                        classes.join(", ")
                    ),
                ));
            };
            if !(0.0..1.0).contains(&share) {
                return Err(ck.bad(
                    &key,
                    share,
                    "is out of range (a share of the slots, 0 to under 1)",
                ));
            }
            reserve[c] = share;
        }
        if reserve.iter().sum::<f64>() >= 1.0 {
            return Err(ck.err(
                "priority.reserve",
                "holds all the slots or more: the shares must add up to under 1",
            ));
        }
        Ok(PriorityConfig {
            enabled: written,
            header,
            classes,
            default,
            engine_priority: self.engine_priority.unwrap_or(d.engine_priority),
            reserve,
            preempt: self.preempt.unwrap_or(d.preempt),
            on_preempt: self.on_preempt.unwrap_or(d.on_preempt),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::testing::{ONE, err, load};

    #[test]
    fn defaults_and_refusals() {
        let c = load(&[("a", ONE)]).unwrap();
        assert_eq!(c.priority, PriorityConfig::default());
        assert!(!c.priority.enabled);
        let c = load(&[("a", ONE), ("b", "priority: {}\n")]).unwrap();
        assert!(c.priority.enabled);
        assert_eq!(c.priority.classes[c.priority.default], "standard");
        let c = load(&[
            ("a", ONE),
            (
                "b",
                "priority: {classes: [gold, silver], default: silver}\n",
            ),
        ])
        .unwrap();
        assert_eq!((c.priority.classes.len(), c.priority.default), (2, 1));
        for (over, key) in [
            ("priority: {header: \"a b\"}\n", "priority.header"),
            ("priority: {classes: []}\n", "priority.classes"),
            ("priority: {classes: [a, \"b c\"]}\n", "priority.classes[1]"),
            ("priority: {classes: [a, a]}\n", "priority.classes[1]"),
            ("priority: {default: urgent}\n", "priority.default"),
            ("priority: {classes: [gold, silver]}\n", "priority.default"),
            (
                "priority: {reserve: {gold: 0.1}}\n",
                "priority.reserve.gold",
            ),
            (
                "priority: {reserve: {batch: 1.5}}\n",
                "priority.reserve.batch",
            ),
            (
                "priority: {reserve: {batch: 0.5, critical: 0.5}}\n",
                "priority.reserve",
            ),
            ("priority: {on_preempt: drop}\n", "priority.on_preempt"),
            ("priority: {preempt: true}\n", "priority.preempt"),
        ] {
            let e = err(&[("a.yaml", ONE), ("b.yaml", over)]);
            assert!(e.contains("b.yaml") && e.contains(key), "{over}: {e}");
        }
    }

    #[test]
    fn classes_map_to_vllm_priorities_around_the_default() {
        let p = PriorityConfig::default();
        let ints: Vec<i64> = (0..4).map(|c| p.engine_of_class(c)).collect();
        assert_eq!(ints, [-2, -1, 0, 1]);
        for (c, i) in ints.iter().enumerate() {
            assert_eq!(p.class_of_engine(*i), c);
        }
        assert_eq!(p.class_of_engine(-100), 0);
        assert_eq!(p.class_of_engine(i64::MAX), 3);
        assert_eq!(p.class_of_engine(i64::MIN), 0);
    }
}

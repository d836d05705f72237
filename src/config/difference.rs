//! What two configs differ in: SIGHUP may change only `workers`. Each section names
//! its key ([`Section`]) and says what counts as a change (its `PartialEq`); the files'
//! keys as written ([`Settings`]) name every changed key to the operator.

use std::sync::Arc;

use serde_yaml_ng::{Mapping, Value};

/// A top-level section other than `workers`: its key in the files. A section that
/// differs refuses a SIGHUP reload, naming this key; what counts as a difference is the
/// section's `PartialEq` (a setting that names a file compares the file's path, not
/// its contents).
pub(super) trait Section: PartialEq {
    const KEY: &'static str;
}

/// `Some(S::KEY)` when the two differ.
pub(super) fn changed<S: Section>(a: &S, b: &S) -> Option<&'static str> {
    (a != b).then_some(S::KEY)
}

/// The merged files' keys other than `workers`, as written (for naming what a rejected
/// reload changed). Not part of the configuration's meaning: always equal.
#[derive(Clone, Default)]
pub struct Settings(pub(super) Arc<Value>);

impl PartialEq for Settings {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Settings(..)")
    }
}

/// Adds to `out` one line per leaf where `a` and `b` differ below `path`.
pub(super) fn diff_values(path: &str, a: Option<&Value>, b: Option<&Value>, out: &mut Vec<String>) {
    let join = |k: &Value| {
        let k = match k {
            Value::String(s) => s.clone(),
            other => show_value(other),
        };
        if path.is_empty() {
            k
        } else {
            format!("{path}.{k}")
        }
    };
    let empty = Value::Mapping(Mapping::new());
    // A section one side leaves out: its keys are each unset there.
    let (a, b) = match (a, b) {
        (None | Some(Value::Null), Some(m @ Value::Mapping(_))) => (Some(&empty), Some(m)),
        (Some(m @ Value::Mapping(_)), None | Some(Value::Null)) => (Some(m), Some(&empty)),
        other => other,
    };
    match (a, b) {
        (Some(Value::Mapping(x)), Some(Value::Mapping(y))) => {
            for (k, v) in x {
                diff_values(&join(k), Some(v), y.get(k), out);
            }
            for (k, v) in y {
                if !x.contains_key(k) {
                    diff_values(&join(k), None, Some(v), out);
                }
            }
        }
        (a, b) if a == b => {}
        (a, b) => {
            let show = |v: Option<&Value>| match v {
                None | Some(Value::Null) => "(unset)".to_string(),
                Some(_) if crate::redact::is_secret_key(path) => crate::redact::MASK.to_string(),
                Some(v) => show_value(v),
            };
            out.push(format!("{path}: {} → {}", show(a), show(b)));
        }
    }
}

/// One value on one line, as YAML flow, user-info masked, at most 60 characters.
fn show_value(v: &Value) -> String {
    let text = match v {
        Value::String(s) => s.clone(),
        other => serde_yaml_ng::to_string(other)
            .unwrap_or_default()
            .trim_end()
            .replace('\n', " "),
    };
    let text = crate::redact::line(&crate::redact::url(&text));
    match text.char_indices().nth(60) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use crate::config::testing::load;

    #[test]
    fn changed_settings_name_every_key_by_its_path() {
        let a = load(&[(
            "a",
            "cache:\n  threshold: 0.3\n  match_abs_threshold: 100\nproxy:\n  api_key: old\nstate:\n  redis_url: \"redis://:pw@r:6379\"\nworkers:\n  - url: http://a:1\n",
        )])
        .unwrap();
        let b = load(&[(
            "b",
            "cache:\n  threshold: 0.55\n  match_abs_threshold: 100\nproxy:\n  api_key: new\nstate:\n  redis_url: \"redis://:pw2@r:6379\"\nworkers:\n  - url: http://b:1\n",
        )])
        .unwrap();
        assert_eq!(
            a.changed_settings(&b),
            [
                "cache.threshold: 0.3 → 0.55",
                "proxy.api_key: *** → ***",
                "state.redis_url: redis://***@r:6379 → redis://***@r:6379",
            ]
        );
        assert!(a.changed_settings(&a).is_empty());
    }
}

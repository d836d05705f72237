//! The configuration reference (`docs/src/configuration.md`) names every key a user can
//! write: each key of `config.example.yaml`, and each key the loader accepts. The second
//! set is not a hand list that could drift: every section of the schema refuses an
//! unknown key and says which keys it knows, so the test asks the loader itself, section
//! by section, through the public [`Config::from_sources`].

use std::collections::BTreeSet;
use std::path::Path;

use serde_yaml_ng::{Mapping, Value};

use super::{Config, ConfigError};

/// The page every key must have a row on: a table row whose first cell is the key path,
/// `` | `section.key` | `` (list items as `[]`: `workers[].url`).
const REFERENCE: &str = "docs/src/configuration.md";

/// A key no section knows: the loader's refusal lists the keys the section does know.
const PROBE: &str = "zz_reference_probe";

/// One step of a key path: a mapping key, or an element of a list.
#[derive(Debug, Clone)]
enum Step {
    Key(String),
    Item,
}

/// The path as the reference writes it: `workers[].kv_events.endpoint`.
fn written(path: &[Step]) -> String {
    path_text(path, "[]")
}

/// The path as the loader's errors name it: `workers[0].kv_events`.
fn as_loader_names(path: &[Step]) -> String {
    path_text(path, "[0]")
}

fn path_text(path: &[Step], item: &str) -> String {
    let mut s = String::new();
    for step in path {
        match step {
            Step::Key(k) => {
                if !s.is_empty() {
                    s.push('.');
                }
                s.push_str(k);
            }
            Step::Item => s.push_str(item),
        }
    }
    s
}

/// `leaf` placed at `path` inside an otherwise empty document.
fn nest(path: &[Step], leaf: Value) -> Value {
    match path.split_first() {
        None => leaf,
        Some((Step::Key(k), rest)) => {
            let mut m = Mapping::new();
            m.insert(Value::String(k.clone()), nest(rest, leaf));
            Value::Mapping(m)
        }
        Some((Step::Item, rest)) => Value::Sequence(vec![nest(rest, leaf)]),
    }
}

/// The loader's refusal of a document with an unknown key in the mapping at `path`:
/// the key path it names and its message (`None` if the document loads).
fn refusal(path: &[Step]) -> Option<(String, String)> {
    let mut probe = Mapping::new();
    probe.insert(Value::String(PROBE.into()), Value::Number(1.into()));
    let mut doc = match nest(path, Value::Mapping(probe)) {
        Value::Mapping(m) => m,
        _ => return None,
    };
    // A valid worker list, so that the only thing wrong is the probe.
    let workers = Value::String("workers".into());
    if !doc.contains_key(&workers) {
        let url = Value::String("http://127.0.0.1:8000".into());
        doc.insert(workers, Value::Sequence(vec![url]));
    }
    let text = serde_yaml_ng::to_string(&Value::Mapping(doc)).ok()?;
    match Config::from_sources([(Path::new("probe.yaml"), text.as_str())]).err()? {
        ConfigError::Parse { key, message, .. } => Some((key.unwrap_or_default(), message)),
        ConfigError::Invalid { key, message, .. } => Some((key, message)),
        _ => None,
    }
}

/// The words a message quotes in backticks, in order.
fn quoted(message: &str) -> Vec<&str> {
    message.split('`').skip(1).step_by(2).collect()
}

/// The keys of the mapping at `path`, when the loader reads one there: from its refusal
/// of the probe (`unknown key … (known keys: `a`, `b`)`), or, for a mapping that takes
/// one of several named sources (`discovery`), from the `name: {…}` forms it offers.
fn keys_at(path: &[Step]) -> Option<Vec<String>> {
    let (key, message) = refusal(path)?;
    // The refusal names the mapping, or the probe inside it.
    let here = as_loader_names(path);
    let probe = if here.is_empty() {
        PROBE.to_string()
    } else {
        format!("{here}.{PROBE}")
    };
    if key != here && key != probe {
        return None; // refused for another reason: no mapping of keys here
    }
    let keys: Vec<String> = if quoted(&message).contains(&PROBE) {
        quoted(&message)
            .into_iter()
            .filter(|w| *w != PROBE)
            .map(str::to_string)
            .collect()
    } else {
        quoted(&message)
            .into_iter()
            .filter_map(|w| w.split_once(": {").map(|(name, _)| name.to_string()))
            .collect()
    };
    (!keys.is_empty()).then_some(keys)
}

/// Every key path below `path` that the loader accepts, into `out`.
fn schema_keys(path: &[Step], out: &mut BTreeSet<String>) {
    let Some(keys) = keys_at(path) else {
        return;
    };
    for k in keys {
        let mut child = path.to_vec();
        child.push(Step::Key(k));
        out.insert(written(&child));
        if keys_at(&child).is_some() {
            schema_keys(&child, out);
            continue;
        }
        child.push(Step::Item);
        if keys_at(&child).is_some() {
            schema_keys(&child, out);
        }
    }
}

/// Every key path written in a YAML document (mappings and lists of mappings).
fn example_keys(v: &Value, path: &mut Vec<Step>, out: &mut BTreeSet<String>) {
    match v {
        Value::Mapping(m) => {
            for (k, v) in m {
                let Some(k) = k.as_str() else { continue };
                path.push(Step::Key(k.to_string()));
                out.insert(written(path));
                example_keys(v, path, out);
                path.pop();
            }
        }
        Value::Sequence(items) => {
            path.push(Step::Item);
            for item in items {
                example_keys(item, path, out);
            }
            path.pop();
        }
        _ => {}
    }
}

fn read(relative: &str) -> String {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join(relative);
    std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()))
}

/// The keys the reference's tables define: the first cell of each row, when it is one
/// quoted key path.
fn reference_rows(page: &str) -> BTreeSet<String> {
    page.lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split_once("` |").map(|(k, _)| k.to_string()))
        .collect()
}

/// The keys that have no row of their own on the page.
fn missing_from(page: &str, keys: &BTreeSet<String>) -> Vec<String> {
    keys.difference(&reference_rows(page)).cloned().collect()
}

#[test]
fn the_reference_names_every_key_the_loader_accepts() {
    let mut keys = BTreeSet::new();
    schema_keys(&[], &mut keys);
    // The walk itself must work: if the loader's wording changed, it would find
    // nothing and pass for the wrong reason.
    for deep in [
        "server.admin.port",
        "workers[].kv_events.dp_size",
        "discovery.dns.interval_secs",
        "response_cache.semantic.threshold",
        "proxy.queue.timeout_ms",
    ] {
        assert!(
            keys.contains(deep),
            "the schema walk missed `{deep}`: {keys:?}"
        );
    }
    let missing = missing_from(&read(REFERENCE), &keys);
    assert!(
        missing.is_empty(),
        "{REFERENCE} does not name these keys the loader accepts (add a row for each): {missing:?}"
    );
}

#[test]
fn the_reference_names_every_key_of_the_example_config() {
    let example: Value = serde_yaml_ng::from_str(&read("config.example.yaml")).expect("YAML");
    let mut keys = BTreeSet::new();
    example_keys(&example, &mut Vec::new(), &mut keys);
    assert!(keys.contains("workers[].url"), "{keys:?}");
    let missing = missing_from(&read(REFERENCE), &keys);
    assert!(
        missing.is_empty(),
        "{REFERENCE} does not name these keys of config.example.yaml: {missing:?}"
    );
}

#[test]
fn every_key_the_reference_defines_exists() {
    let mut schema = BTreeSet::new();
    schema_keys(&[], &mut schema);
    let rows = reference_rows(&read(REFERENCE));
    let unknown: Vec<&String> = rows.difference(&schema).collect();
    assert!(
        unknown.is_empty(),
        "{REFERENCE} has rows for keys the loader refuses (renamed or removed?): {unknown:?}"
    );
}

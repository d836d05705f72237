//! The config file as its author wrote it: where a key's value sits (line) and its text,
//! and serde's messages put in the config's words.
//!
//! Positions come from the YAML parser itself (serde_yaml_ng attaches the position of
//! the event being read to every error): [`locate`] walks the document to the key and
//! fails there on purpose, so flow style (`{url: 70000}`), anchors and comments are
//! handled as the parser sees them.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// One step of a key path: a mapping key or a list index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seg<'a> {
    Key(&'a str),
    Index(usize),
}

/// Splits a dotted key path (`workers[2].kv_events.endpoint`) into steps.
pub fn segments(key: &str) -> Vec<Seg<'_>> {
    let mut out = Vec::new();
    for part in key.split('.') {
        let (name, mut rest) = part.split_once('[').map_or((part, ""), |(n, r)| (n, r));
        if !name.is_empty() {
            out.push(Seg::Key(name));
        }
        while let Some((idx, after)) = rest.split_once(']') {
            if let Ok(i) = idx.parse() {
                out.push(Seg::Index(i));
            }
            rest = after.strip_prefix('[').unwrap_or(after);
        }
    }
    out
}

/// Where a value sits in a file: 1-based line, and the value as written (one line at
/// most, cut to [`MAX_SHOWN`] characters).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spot {
    pub line: usize,
    pub text: String,
}

/// Most characters of a value quoted back in a message.
pub const MAX_SHOWN: usize = 80;

const HERE: &str = "\u{0}cache-aware-router: key found";

/// Finds the value at `path` in the YAML document `yaml`; `None` when the path is not
/// in it (or the text does not parse).
pub fn locate(yaml: &str, path: &[Seg<'_>]) -> Option<Spot> {
    let de = serde_yaml_ng::Deserializer::from_str(yaml);
    let err = Find { path }.deserialize(de).err()?;
    if !err.to_string().contains(HERE) {
        return None;
    }
    let loc = err.location()?;
    Some(Spot {
        line: loc.line(),
        text: written_at(yaml, loc.index()),
    })
}

/// The value starting at byte `index` of `yaml` as written: a quoted scalar up to its
/// closing quote, a plain one up to a comment, the line's end, or (inside `{…}`/`[…]`)
/// the next `,`, `}` or `]`.
pub fn written_at(yaml: &str, index: usize) -> String {
    let Some(rest) = yaml.get(index..) else {
        return String::new();
    };
    let line_start = yaml[..index].rfind('\n').map_or(0, |i| i + 1);
    let before = &yaml[line_start..index];
    let in_flow = before.matches(['{', '[']).count() > before.matches(['}', ']']).count();
    let line = rest.split('\n').next().unwrap_or("").trim_end_matches('\r');
    let end = match line.chars().next() {
        Some(q @ ('"' | '\'')) => line[1..].find(q).map_or(line.len(), |i| i + 2),
        _ => {
            let comment = line.find(" #").unwrap_or(line.len());
            let flow_end = if in_flow {
                line.find([',', '}', ']']).unwrap_or(line.len())
            } else {
                line.len()
            };
            comment.min(flow_end)
        }
    };
    let shown = line[..end].trim();
    if shown.chars().count() > MAX_SHOWN {
        let cut: String = shown.chars().take(MAX_SHOWN).collect();
        format!("{cut}…")
    } else {
        shown.to_string()
    }
}

struct Find<'p, 'a> {
    path: &'p [Seg<'a>],
}

impl<'de> DeserializeSeed<'de> for Find<'_, '_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        match self.path.split_first() {
            // Read the value's first event, so the error carries its position.
            None => d.deserialize_any(Here),
            Some((seg, rest)) => d.deserialize_any(Step { seg, rest }),
        }
    }
}

/// Fails on whatever value it is given: the mark [`locate`] reads.
struct Here;

impl<'de> Visitor<'de> for Here {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any YAML value")
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Err(E::custom(HERE))
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        Err(E::custom(HERE))
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        Err(E::custom(HERE))
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        Err(E::custom(HERE))
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        Err(E::custom(HERE))
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Err(E::custom(HERE))
    }
    fn visit_none<E: de::Error>(self) -> Result<(), E> {
        Err(E::custom(HERE))
    }
    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<(), A::Error> {
        Err(de::Error::custom(HERE))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<(), A::Error> {
        Err(de::Error::custom(HERE))
    }
    fn visit_enum<A: de::EnumAccess<'de>>(self, _: A) -> Result<(), A::Error> {
        Err(de::Error::custom(HERE))
    }
}

struct Step<'p, 'a> {
    seg: &'p Seg<'a>,
    rest: &'p [Seg<'a>],
}

impl<'de> Visitor<'de> for Step<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any YAML value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(key) = map.next_key::<serde_yaml_ng::Value>()? {
            if matches!((self.seg, &key), (Seg::Key(k), serde_yaml_ng::Value::String(s)) if s == k)
            {
                return map.next_value_seed(Find { path: self.rest });
            }
            map.next_value::<IgnoredAny>()?;
        }
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let Seg::Index(want) = self.seg else {
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            return Ok(());
        };
        let mut i = 0;
        while i < *want {
            if seq.next_element::<IgnoredAny>()?.is_none() {
                return Ok(());
            }
            i += 1;
        }
        seq.next_element_seed(Find { path: self.rest })?;
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(())
    }

    // A scalar where the path goes deeper: the path is not in the document.
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_none<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_enum<A: de::EnumAccess<'de>>(self, _: A) -> Result<(), A::Error> {
        Ok(())
    }
}

/// serde's message about the value at `path`, in the config's words: the position
/// suffix and serde_yaml_ng's own path prefix removed, Rust type names replaced by what
/// the key takes, and the value quoted as written (`written`) instead of as parsed
/// (so `0x10` stays `0x10`, not `integer 16`).
pub fn humanize(message: &str, path: &str, written: Option<&str>) -> String {
    let mut m = message;
    if let Some(i) = m.rfind(" at line ") {
        m = &m[..i];
    }
    if m.starts_with("invalid length") {
        return "a list is not a mapping of keys".into();
    }
    // serde_yaml_ng's own path prefix (`workers[0]: unknown field …`), shown apart.
    if let Some((before, rest)) = m.split_once(": ")
        && !before.is_empty()
        && !before.contains(' ')
        && path.starts_with(before)
    {
        m = rest;
    }
    let typed = m
        .strip_prefix("invalid type: ")
        .or_else(|| m.strip_prefix("invalid value: "));
    if let Some(rest) = typed
        && let Some((found, expected)) = rest.rsplit_once(", expected ")
    {
        // A collection is named, never quoted: it may hold a credential.
        let shown = match found {
            "map" => "a mapping".to_string(),
            "sequence" => "a list".to_string(),
            f if f.contains("as u128") || f.contains("as i128") => {
                "a number too large for 64 bits".to_string()
            }
            f => written.map_or_else(|| unexpected_in_words(f), |w| format!("`{w}`")),
        };
        return format!("{shown} is not {}", in_words(expected));
    }
    if let Some(rest) = m.strip_prefix("unknown field ") {
        return match rest.split_once(", expected ") {
            Some((field, known)) => format!(
                "unknown key {field} (known keys: {})",
                known.trim_start_matches("one of ")
            ),
            None => format!("unknown key {rest}"),
        };
    }
    if let Some(rest) = m.strip_prefix("unknown variant ") {
        return match rest.split_once(", expected ") {
            Some((v, known)) => format!("{v} is not {}", known.replace("one of ", "one of: ")),
            None => format!("{rest} is not a known value"),
        };
    }
    if let Some(rest) = m.strip_prefix("missing field ") {
        return format!("missing key {rest}");
    }
    m.to_string()
}

/// The message of a failed untyped parse (after the typed one passed: a number too
/// large for 64 bits, …), without the value: serde_yaml_ng quotes it, and it may be a
/// credential written as digits.
pub fn untyped_message(message: &str) -> String {
    if message.contains(" as u128") || message.contains(" as i128") {
        return "a number too large for 64 bits (quote it if it is text, such as a token); the value is not shown".into();
    }
    crate::redact::line(message)
}

/// What serde found (`Unexpected`'s wording, when the value as written is not known) →
/// what a config author calls it.
fn unexpected_in_words(found: &str) -> String {
    match found {
        "unit value" | "unit" | "null" => "an empty value".into(),
        "enum" | "unit variant" | "newtype variant" | "tuple variant" | "struct variant" => {
            "a `!tagged` value".into()
        }
        "newtype struct" => "a value".into(),
        f => f.to_string(),
    }
}

/// A Rust type as serde names it → what a config author writes.
fn in_words(expected: &str) -> String {
    match expected {
        "u8" => "a whole number from 0 to 255".into(),
        "u16" => "a whole number from 0 to 65535".into(),
        "u32" => "a whole number from 0 to 4294967295".into(),
        "u64" | "usize" => "a whole number ≥ 0".into(),
        "i8" | "i16" | "i32" | "i64" | "isize" => "a whole number".into(),
        "f32" | "f64" => "a number".into(),
        "a boolean" => "`true` or `false`".into(),
        "a sequence" => "a list".into(),
        "a YAML tag starting with '!'" => "one of the accepted names".into(),
        "path string" => "a file path".into(),
        e if e.starts_with("struct ") || e == "a map" => "a mapping of keys".into(),
        e => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(yaml: &str, key: &str) -> Option<(usize, String)> {
        locate(yaml, &segments(key)).map(|s| (s.line, s.text))
    }

    #[test]
    fn paths_split_into_keys_and_indexes() {
        assert_eq!(
            segments("workers[2].kv_events.endpoint"),
            [
                Seg::Key("workers"),
                Seg::Index(2),
                Seg::Key("kv_events"),
                Seg::Key("endpoint")
            ]
        );
        assert_eq!(
            segments("a[0][1]"),
            [Seg::Key("a"), Seg::Index(0), Seg::Index(1)]
        );
    }

    #[test]
    fn values_are_found_with_their_line_and_text_as_written() {
        let doc = "# comment\nhealth:\n  interval_secs: 0.0000001   # too fast\n  timeout_secs: 0x10\nworkers:\n  - url: http://a:1\n  - {url: 70000, max_load: 0}\n  - url: \"quoted, with comma\"\n";
        assert_eq!(
            at(doc, "health.interval_secs"),
            Some((3, "0.0000001".into()))
        );
        assert_eq!(at(doc, "health.timeout_secs"), Some((4, "0x10".into())));
        assert_eq!(at(doc, "workers[1].url"), Some((7, "70000".into())));
        assert_eq!(at(doc, "workers[1].max_load"), Some((7, "0".into())));
        assert_eq!(
            at(doc, "workers[2].url"),
            Some((8, "\"quoted, with comma\"".into()))
        );
        assert_eq!(at(doc, "workers[0].url"), Some((6, "http://a:1".into())));
        assert_eq!(at(doc, "workers[3].url"), None);
        assert_eq!(at(doc, "cache.threshold"), None);
        assert_eq!(at(doc, "health.interval_secs.deeper"), None);
        assert_eq!(at("a: [1, 2]\n", "a[5]"), None);
    }

    #[test]
    fn long_values_are_cut() {
        let doc = format!("a: {}\n", "x".repeat(200));
        let (_, text) = at(&doc, "a").unwrap();
        assert_eq!(text.chars().count(), MAX_SHOWN + 1);
        assert!(text.ends_with('…'));
    }

    #[test]
    fn serde_messages_are_put_in_the_configs_words() {
        assert_eq!(
            humanize(
                "health.timeout_secs: invalid type: integer `16`, expected f64 at line 2 column 17",
                "health.timeout_secs",
                Some("0x10")
            ),
            "`0x10` is not a number"
        );
        assert_eq!(
            humanize(
                "invalid value: integer `70000`, expected u16",
                "server.port",
                None
            ),
            "integer `70000` is not a whole number from 0 to 65535"
        );
        assert_eq!(
            humanize(
                "workers[0]: unknown field `bogus`, expected one of `url`, `max_load` at line 3 column 5",
                "workers[0].bogus",
                None
            ),
            "unknown key `bogus` (known keys: `url`, `max_load`)"
        );
        assert_eq!(
            humanize(
                "invalid type: map, expected a string",
                "log.level",
                Some("{a: 1}")
            ),
            "a mapping is not a string"
        );
        assert_eq!(
            humanize(
                "invalid type: integer `3`, expected struct RawHealth",
                "health",
                Some("3")
            ),
            "`3` is not a mapping of keys"
        );
    }
}

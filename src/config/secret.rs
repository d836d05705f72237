//! Credentials from the config: checked once, used as built headers, never printed.

use http::HeaderValue;

/// A credential (`api_key`, `admin_token`): compared and sent, never printed (`Debug`
/// shows `***`). Holds the prebuilt `Authorization: Bearer <key>` value, so using it on
/// the request path allocates nothing and cannot fail.
#[derive(Clone)]
pub struct Secret {
    text: Box<str>,
    bearer: HeaderValue,
}

impl Secret {
    /// Checks a credential as written in the config. A bearer credential is sent in a
    /// header, so it must be 1 or more visible ASCII characters (RFC 6750 `b64token` is
    /// narrower still): no whitespace, control character (a trailing newline from a
    /// secret file), DEL or non-ASCII byte. The error says what is wrong and where, and
    /// never holds the value.
    pub fn parse(raw: String) -> Result<Secret, String> {
        if raw.is_empty() {
            return Err("is empty; remove the key to send none".into());
        }
        if let Some((i, c)) = raw.char_indices().find(|(_, c)| !c.is_ascii_graphic()) {
            let what = match c {
                '\n' | '\r' => "a line break",
                ' ' | '\t' => "whitespace",
                c if c.is_control() => "a control character",
                c if !c.is_ascii() => "a non-ASCII character",
                _ => "a character not allowed in a header",
            };
            return Err(format!(
                "holds {what} at byte {i} of {} (a key is sent as `Authorization: Bearer <key>`: visible ASCII only; the value is not shown)",
                raw.len()
            ));
        }
        let mut bearer = HeaderValue::try_from(format!("Bearer {raw}"))
            .map_err(|_| "cannot be sent in a header (the value is not shown)".to_string())?;
        bearer.set_sensitive(true);
        Ok(Secret {
            text: raw.into_boxed_str(),
            bearer,
        })
    }

    /// The credential itself, for comparing.
    pub fn expose(&self) -> &str {
        &self.text
    }

    /// `Bearer <key>`, marked sensitive (hyper never logs or indexes it).
    pub fn bearer(&self) -> &HeaderValue {
        &self.bearer
    }
}

impl PartialEq for Secret {
    fn eq(&self, other: &Self) -> bool {
        self.text == other.text
    }
}

impl Eq for Secret {}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(crate::redact::MASK)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::WorkerConfig;
    use crate::config::testing::{ONE, err, load};

    #[test]
    fn header_safe_keys_are_kept_and_built_once() {
        let s = Secret::parse("sk-abc_123.XYZ".into()).unwrap();
        assert_eq!(s.expose(), "sk-abc_123.XYZ");
        assert_eq!(s.bearer(), "Bearer sk-abc_123.XYZ");
        assert!(s.bearer().is_sensitive());
        assert_eq!(format!("{s:?}"), "***");
    }

    #[test]
    fn keys_that_cannot_be_a_header_are_refused_without_the_value() {
        for (raw, why) in [
            ("", "empty"),
            ("sk-secret\n", "line break"),
            ("sk-secret\r\n", "line break"),
            ("sk-se cret", "whitespace"),
            (" sk-secret", "whitespace"),
            ("sk-secret\t", "whitespace"),
            ("sk-\u{7}secret", "control character"),
            ("sk-\u{7f}secret", "control character"),
            ("sk-sécret", "non-ASCII"),
        ] {
            let e = Secret::parse(raw.into()).unwrap_err();
            assert!(e.contains(why), "{raw:?}: {e}");
            assert!(!e.contains("secret") || raw.is_empty(), "{raw:?}: {e}");
        }
    }

    #[test]
    fn keys_never_show_in_debug_output() {
        let c = load(&[(
            "k.yaml",
            "workers:\n  - url: http://a:1\n    api_key: sk-worker-1\nproxy:\n  api_key: sk-global-2\nserver:\n  admin_token: tok-3\n",
        )])
        .unwrap();
        let shown = format!("{c:?}");
        for secret in ["sk-worker-1", "sk-global-2", "tok-3"] {
            assert!(!shown.contains(secret), "{shown}");
        }
        assert_eq!(
            c.workers[0].api_key.as_ref().map(Secret::expose),
            Some("sk-worker-1")
        );
    }

    #[test]
    fn keys_that_cannot_be_a_header_are_refused_naming_the_key_never_the_value() {
        for (key, yaml) in [
            (
                "workers[0].api_key",
                "workers:\n  - url: http://a:1\n    api_key: {v}\n",
            ),
            ("proxy.api_key", "proxy:\n  api_key: {v}\n"),
            ("server.admin_token", "server:\n  admin_token: {v}\n"),
        ] {
            for v in [
                "\"sk-hidden-1\\n\"",
                "\"\"",
                "\"sk hidden-1\"",
                "\"sk-\\u0007hidden-1\"",
                "[sk-hidden-1]",
                "{a: sk-hidden-1}",
            ] {
                let e = err(&[("a.yaml", ONE), ("k.yaml", &yaml.replace("{v}", v))]);
                assert!(e.contains("k.yaml") && e.contains(key), "{key} {v}: {e}");
                assert!(
                    !e.contains("hidden"),
                    "{key} {v}: the value is printed: {e}"
                );
            }
        }
        let w = WorkerConfig::from_json(br#"{"url":"http://c:1","api_key":"sk-hidden-1\n"}"#)
            .unwrap_err();
        assert!(w.contains("api_key") && !w.contains("hidden"), "{w}");
        let w = WorkerConfig::from_json(br#"{"url":"http://c:1","api_key":12345678}"#).unwrap_err();
        assert!(w.contains("api_key") && !w.contains("12345678"), "{w}");
        let c = load(&[(
            "a.yaml",
            "workers:\n  - url: http://a:1\n    api_key: sk-ok_1.2\n",
        )])
        .unwrap();
        assert_eq!(
            c.workers[0].api_key.as_ref().unwrap().bearer(),
            "Bearer sk-ok_1.2"
        );
    }
}

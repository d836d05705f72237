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
}

//! Redaction: the one rule for credentials in text that leaves the process (error
//! messages, log lines, API answers).
//!
//! A credential reaches text in three ways, and each has its function here:
//! - inside a URL as user-info (`http://user:password@host`): [`text`] replaces the
//!   user-info of every `scheme://` URL with `***`;
//! - as an `Authorization` value (`Bearer sk-…`, `Basic …`): [`text`] replaces the
//!   credential after the scheme with `***`;
//! - as the value of a key that holds one (`api_key`, `admin_token`, …): such a value is
//!   never shown at all ([`is_secret_key`] tells which keys).

use std::borrow::Cow;

/// What replaces a credential.
pub const MASK: &str = "***";

/// `s` with the user-info of every URL and the credential of every `Bearer`/`Basic`
/// authorization replaced by [`MASK`]. Borrowed when there was nothing to redact.
///
/// A URL's user-info is everything between `://` and the last `@` before the next
/// whitespace or quote (so a password holding a raw `/` is still covered; a `@` in a
/// path is over-redacted, never under-redacted).
pub fn text(s: &str) -> Cow<'_, str> {
    let s = userinfo(s);
    match auth_scheme_credential(&s) {
        None => s,
        Some(_) => Cow::Owned(authorization(&s)),
    }
}

/// A value that is (or may be) one URL, with its user-info masked: everything after
/// `scheme://` (or from the start, when there is no scheme) up to the **last** `@` of
/// the whole value. Unlike [`text`] this needs no end marker, so a password holding a
/// quote, a space or a `/` is covered too. A value without `@` is borrowed unchanged.
pub fn url(value: &str) -> Cow<'_, str> {
    let Some(at) = value.rfind('@') else {
        return Cow::Borrowed(value);
    };
    let start = value.find("://").map_or(0, |i| i + 3).min(at);
    Cow::Owned(format!("{}{MASK}{}", &value[..start], &value[at..]))
}

/// `s` made safe for one log line: credentials redacted ([`text`]) and control
/// characters (a newline that would forge a log line) escaped.
pub fn line(s: &str) -> String {
    let s = text(s);
    if !s.chars().any(char::is_control) {
        return s.into_owned();
    }
    s.chars()
        .flat_map(|c| -> Box<dyn Iterator<Item = char>> {
            if c.is_control() {
                Box::new(c.escape_default())
            } else {
                Box::new(std::iter::once(c))
            }
        })
        .collect()
}

/// Whether a config key (a dotted path such as `workers[2].api_key`) holds a credential
/// whose value must never be printed.
pub fn is_secret_key(key: &str) -> bool {
    let last = key.rsplit('.').next().unwrap_or(key);
    let last = last.split('[').next().unwrap_or(last);
    matches!(
        last,
        "api_key" | "admin_token" | "password" | "token" | "secret" | "api_key_sha256"
    ) || last.ends_with("_token")
        || last.ends_with("_password")
        || last.ends_with("_secret")
}

/// Ends a URL's authority scan: whitespace and the quotes text puts around a value.
fn ends_url(c: char) -> bool {
    c.is_whitespace() || matches!(c, '`' | '"' | '\'' | '<' | '>')
}

fn userinfo(s: &str) -> Cow<'_, str> {
    if !s.contains("://") || !s.contains('@') {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    let mut changed = false;
    while let Some(i) = rest.find("://") {
        let start = i + 3;
        out.push_str(&rest[..start]);
        let after = &rest[start..];
        let end = after.find(ends_url).unwrap_or(after.len());
        match after[..end].rfind('@') {
            Some(at) => {
                out.push_str(MASK);
                out.push_str(&after[at..end]);
                changed = true;
            }
            None => out.push_str(&after[..end]),
        }
        rest = &after[end..];
    }
    if !changed {
        return Cow::Borrowed(s);
    }
    out.push_str(rest);
    Cow::Owned(out)
}

/// The byte range of the first credential after `Bearer ` or `Basic ` (any case).
fn auth_scheme_credential(s: &str) -> Option<(usize, usize)> {
    let lower = s.to_ascii_lowercase();
    ["bearer ", "basic "]
        .iter()
        .filter_map(|scheme| {
            let mut from = 0;
            while let Some(i) = lower[from..].find(scheme) {
                let at = from + i;
                let begins_word = at == 0 || !lower.as_bytes()[at - 1].is_ascii_alphanumeric();
                let start = at + scheme.len();
                let end = s[start..]
                    .find(|c: char| ends_url(c) || c == ',')
                    .map_or(s.len(), |e| start + e);
                if begins_word && end > start && &s[start..end] != MASK {
                    return Some((start, end));
                }
                from = start;
            }
            None
        })
        .min()
}

fn authorization(s: &str) -> String {
    let mut out = s.to_string();
    while let Some((start, end)) = auth_scheme_credential(&out) {
        out.replace_range(start..end, MASK);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_user_info_is_masked_wherever_it_appears() {
        for (given, want) in [
            ("http://u:secret@host:1", "http://***@host:1"),
            (
                "`workers[0].url`: `http://u:secret@h:1/p`: not supported",
                "`workers[0].url`: `http://***@h:1/p`: not supported",
            ),
            ("http://u:pa/ss@h:1", "http://***@h:1"),
            (
                "redis://:pw@r:6379/0 and http://a:b@c",
                "redis://***@r:6379/0 and http://***@c",
            ),
            ("http://user@h", "http://***@h"),
        ] {
            assert_eq!(text(given), want, "{given}");
        }
    }

    #[test]
    fn text_without_credentials_is_borrowed_unchanged() {
        for s in [
            "http://h:1/v1/models",
            "a@b.c is an address",
            "plain text",
            "",
        ] {
            assert!(matches!(text(s), Cow::Borrowed(_)), "{s}");
            assert_eq!(text(s), s);
        }
    }

    #[test]
    fn authorization_credentials_are_masked() {
        assert_eq!(
            text("sent Authorization: Bearer sk-123 to w, Basic dXNlcg== too"),
            "sent Authorization: Bearer *** to w, Basic *** too"
        );
        assert_eq!(text("bearer abc"), "bearer ***");
        assert_eq!(text("Bearer ***"), "Bearer ***");
        assert_eq!(text("the Bearer scheme"), "the Bearer ***");
    }

    #[test]
    fn a_url_value_is_masked_up_to_its_last_at_whatever_the_password_holds() {
        for (given, want) in [
            (
                "http://admin:pa'SECRET@10.0.0.7:8000",
                "http://***@10.0.0.7:8000",
            ),
            ("http://admin:pa ss\"<>`x@h:1", "http://***@h:1"),
            ("admin:SECRET@10.0.0.7:8000", "***@10.0.0.7:8000"),
            ("http://a:1234/SECRET@h", "http://***@h"),
            ("tcp://u:SECRET@127.0.0.1:5557", "tcp://***@127.0.0.1:5557"),
        ] {
            assert_eq!(url(given), want, "{given}");
        }
        assert!(matches!(url("http://h:1/p"), Cow::Borrowed(_)));
    }

    #[test]
    fn log_lines_cannot_be_forged() {
        assert_eq!(line("bad\n2026 INFO forged"), "bad\\n2026 INFO forged");
        assert_eq!(line("http://u:p@h ok"), "http://***@h ok");
    }

    #[test]
    fn secret_keys_are_recognised_by_their_last_segment() {
        for k in [
            "workers[3].api_key",
            "proxy.api_key",
            "server.admin_token",
            "state.password",
            "api_key",
        ] {
            assert!(is_secret_key(k), "{k}");
        }
        for k in [
            "workers[0].url",
            "server.host",
            "api_key_file.x",
            "tokenizer",
        ] {
            assert!(!is_secret_key(k), "{k}");
        }
    }
}

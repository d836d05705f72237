//! `tracing:` — span export to an OpenTelemetry collector (see `crate::trace::export`).
//! W3C `traceparent` propagation needs no config: it is always on.

use serde::Deserialize;

use super::check::{Checker, ConfigError};
use super::difference::Section;

/// `tracing:` — absent = no export.
#[derive(Debug, Clone, PartialEq)]
pub struct TracingConfig {
    /// Where OTLP/HTTP (protobuf) spans are POSTed: the full traces URL. The file names
    /// the collector (`http://collector:4318`, `https://…`); `/v1/traces` is appended
    /// to its path unless the path already ends with it. `None` = no export (default).
    pub otlp_endpoint: Option<http::Uri>,
    /// The `service.name` resource attribute of every span (default
    /// `cache-aware-router`).
    pub service_name: String,
}

impl Default for TracingConfig {
    fn default() -> Self {
        TracingConfig {
            otlp_endpoint: None,
            service_name: DEFAULT_SERVICE_NAME.to_string(),
        }
    }
}

impl Section for TracingConfig {
    const KEY: &'static str = "tracing";
}

const DEFAULT_SERVICE_NAME: &str = "cache-aware-router";
/// The OTLP/HTTP path of traces (OTLP specification, "OTLP/HTTP Request").
const TRACES_PATH: &str = "/v1/traces";

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTracing {
    otlp_endpoint: Option<String>,
    service_name: Option<String>,
}

impl RawTracing {
    pub(super) fn validate(self, ck: &Checker<'_>) -> Result<TracingConfig, ConfigError> {
        let otlp_endpoint = self
            .otlp_endpoint
            .map(|u| traces_url(&u).map_err(|why| ck.bad("tracing.otlp_endpoint", &u, why)))
            .transpose()?;
        let service_name = self
            .service_name
            .unwrap_or_else(|| DEFAULT_SERVICE_NAME.into());
        if service_name.is_empty()
            || service_name.len() > 255
            || service_name.chars().any(char::is_control)
        {
            return Err(ck.bad(
                "tracing.service_name",
                &service_name,
                "must be 1 to 255 characters, none of them control characters",
            ));
        }
        Ok(TracingConfig {
            otlp_endpoint,
            service_name,
        })
    }
}

/// The traces URL of a collector URL as written: `http://` or `https://`, a host, no
/// query or fragment; `/v1/traces` appended unless the path ends with it.
fn traces_url(written: &str) -> Result<http::Uri, String> {
    const SHAPE: &str = "expected http://host[:port][/path] or https://… (an OTLP/HTTP collector, e.g. http://collector:4318)";
    let uri: http::Uri = written
        .parse()
        .map_err(|e: http::uri::InvalidUri| format!("is not a URL ({e}): {SHAPE}"))?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        _ => return Err(format!("has no http:// or https:// scheme: {SHAPE}")),
    }
    let Some(authority) = uri.authority().filter(|a| !a.host().is_empty()) else {
        return Err(format!("has no host: {SHAPE}"));
    };
    let host_port = authority.as_str().rsplit('@').next().unwrap_or_default();
    let after_host = &host_port[host_port.rfind(']').map_or(0, |i| i + 1)..];
    if let Some((_, port)) = after_host.rsplit_once(':')
        && !port.parse::<u16>().is_ok_and(|p| p > 0)
    {
        return Err(format!("has a bad port `{port}`: {SHAPE}"));
    }
    if written.contains('?') || written.contains('#') {
        return Err(format!("has a query or fragment: {SHAPE}"));
    }
    let path = uri.path().trim_end_matches('/');
    let path = if path.ends_with(TRACES_PATH) {
        path.to_string()
    } else {
        format!("{path}{TRACES_PATH}")
    };
    http::Uri::builder()
        .scheme(uri.scheme_str().unwrap_or("http"))
        .authority(authority.as_str())
        .path_and_query(path)
        .build()
        .map_err(|e| format!("is not a usable URL ({e}): {SHAPE}"))
}

#[cfg(test)]
mod tests {
    use crate::config::load_text as load;

    const ONE: &str = "workers:\n  - url: http://127.0.0.1:8001\n";

    #[test]
    fn absent_is_no_export_and_the_traces_path_is_appended() {
        let c = load(ONE).unwrap();
        assert!(c.tracing.otlp_endpoint.is_none());
        assert_eq!(c.tracing.service_name, "cache-aware-router");
        for (written, url) in [
            ("http://collector:4318", "http://collector:4318/v1/traces"),
            ("http://collector:4318/", "http://collector:4318/v1/traces"),
            (
                "https://otel.example/otlp",
                "https://otel.example/otlp/v1/traces",
            ),
            ("http://c:4318/v1/traces", "http://c:4318/v1/traces"),
        ] {
            let c = load(&format!(
                "tracing: {{otlp_endpoint: \"{written}\", service_name: edge}}\n{ONE}"
            ))
            .unwrap();
            assert_eq!(c.tracing.otlp_endpoint.unwrap().to_string(), url);
            assert_eq!(c.tracing.service_name, "edge");
        }
    }

    #[test]
    fn a_bad_endpoint_or_name_names_its_key() {
        for (section, key) in [
            (
                "{otlp_endpoint: \"collector:4318\"}",
                "tracing.otlp_endpoint",
            ),
            (
                "{otlp_endpoint: \"grpc://c:4317\"}",
                "tracing.otlp_endpoint",
            ),
            ("{otlp_endpoint: \"http://\"}", "tracing.otlp_endpoint"),
            (
                "{otlp_endpoint: \"http://c:99999\"}",
                "tracing.otlp_endpoint",
            ),
            (
                "{otlp_endpoint: \"http://c:4318/?x=1\"}",
                "tracing.otlp_endpoint",
            ),
            ("{otlp_endpoint: \"not a url\"}", "tracing.otlp_endpoint"),
            ("{service_name: \"\"}", "tracing.service_name"),
            ("{endpoint: \"http://c\"}", "endpoint"),
        ] {
            let e = load(&format!("tracing: {section}\n{ONE}")).unwrap_err();
            assert!(e.contains(key), "{section}: {e}");
        }
    }
}

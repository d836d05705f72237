//! `server:` — the client-facing listener, and the admin one when it has its own.

use std::time::Duration;

use serde::Deserialize;

use super::check::{Checker, ConfigError, Secs};
use super::difference::Section;
use super::secret::Secret;

/// `server:` — the client-facing listener.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerConfig {
    /// Listen address (default `0.0.0.0`).
    pub host: String,
    /// Listen port (default 6700).
    pub port: u16,
    /// Largest request body accepted, in bytes (default 32 MiB); larger ones get 413.
    pub max_body_bytes: usize,
    /// Bearer token for the mutating admin endpoints; `None` disables them.
    pub admin_token: Option<Secret>,
    /// How long SIGTERM waits for in-flight requests before exiting (default 30 s).
    pub shutdown_grace: Duration,
    /// Longest time a request body may take to arrive, counted from its request head,
    /// idle gaps included (default 30 s); past it the client gets 408 and the
    /// connection is closed.
    pub body_timeout: Duration,
    /// `server.admin`: a listener of its own for `/workers`, `/metrics` and the admin
    /// API (`/health` answers on both); `None` = they share the main port.
    pub admin: Option<AdminListen>,
}

/// `server.admin: {host, port}` (host default: `server.host`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdminListen {
    pub host: String,
    /// 0 = any free port (tests).
    pub port: u16,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            host: "0.0.0.0".into(),
            port: 6700,
            max_body_bytes: 32 << 20,
            admin_token: None,
            shutdown_grace: Duration::from_secs(30),
            body_timeout: Duration::from_secs(30),
            admin: None,
        }
    }
}

impl Section for ServerConfig {
    const KEY: &'static str = "server";
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
pub(super) struct RawServer {
    host: Option<String>,
    port: Option<u16>,
    max_body_bytes: Option<u64>,
    admin_token: Option<String>,
    shutdown_grace_secs: Option<Secs>,
    body_timeout_secs: Option<Secs>,
    admin: Option<RawAdmin>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
struct RawAdmin {
    host: Option<String>,
    port: Option<u16>,
}

impl RawServer {
    pub(super) fn validate(self, ck: &Checker<'_>) -> Result<ServerConfig, ConfigError> {
        let d = ServerConfig::default();
        let max_body_bytes = self.max_body_bytes.unwrap_or(d.max_body_bytes as u64);
        if max_body_bytes == 0 || max_body_bytes > (1 << 32) {
            return Err(ck.bad(
                "server.max_body_bytes",
                max_body_bytes,
                "is out of range (bytes, 1 to 4 GiB)",
            ));
        }
        let host = self.host.unwrap_or(d.host);
        if host.parse::<std::net::IpAddr>().is_err() && host != "localhost" {
            return Err(ck.bad("server.host", host, "is not an IP address to listen on"));
        }
        let port = self.port.unwrap_or(d.port);
        let admin = match self.admin {
            None => None,
            Some(a) => Some(a.validate(ck, &host, port)?),
        };
        Ok(ServerConfig {
            admin,
            host,
            port,
            max_body_bytes: max_body_bytes as usize,
            admin_token: ck.secret("server.admin_token", self.admin_token)?,
            shutdown_grace: ck.secs(
                "server.shutdown_grace_secs",
                self.shutdown_grace_secs,
                d.shutdown_grace.as_secs_f64(),
                Some("exit at once"),
            )?,
            body_timeout: ck.secs(
                "server.body_timeout_secs",
                self.body_timeout_secs,
                d.body_timeout.as_secs_f64(),
                None,
            )?,
        })
    }
}

impl RawAdmin {
    /// `server.admin`, beside the main listener on `host:port`.
    fn validate(self, ck: &Checker<'_>, host: &str, port: u16) -> Result<AdminListen, ConfigError> {
        let Some(admin_port) = self.port else {
            return Err(ck.err(
                "server.admin.port",
                "is missing: give the admin listener a port of its own (e.g. 6701)",
            ));
        };
        let admin_host = self.host.unwrap_or_else(|| host.to_string());
        if admin_host.trim().is_empty() {
            return Err(ck.err("server.admin.host", "is empty"));
        }
        if admin_port != 0 && admin_port == port && admin_host == host {
            return Err(ck.bad(
                "server.admin.port",
                admin_port,
                "is the main port: the admin listener needs another one",
            ));
        }
        Ok(AdminListen {
            host: admin_host,
            port: admin_port,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::testing::{ONE, err, load};

    #[test]
    fn an_admin_listener_needs_a_port_of_its_own() {
        let c = load(&[
            ("a", ONE),
            ("b", "server:\n  host: 10.0.0.1\n  admin:\n    port: 6701\n"),
        ])
        .unwrap();
        assert_eq!(
            c.server.admin,
            Some(AdminListen {
                host: "10.0.0.1".into(),
                port: 6701
            })
        );
        assert_eq!(load(&[("a", ONE)]).unwrap().server.admin, None);
        for (doc, key, what) in [
            (
                "server:\n  admin: {host: 127.0.0.1}\n",
                "server.admin.port",
                "is missing",
            ),
            (
                "server:\n  port: 6700\n  admin: {port: 6700}\n",
                "server.admin.port",
                "main port",
            ),
            ("server:\n  admin: {port: 6701, tls: true}\n", "tls", ""),
        ] {
            let e = err(&[("a.yaml", ONE), ("b.yaml", doc)]);
            assert!(e.contains(key) && e.contains(what), "{doc}: {e}");
        }
    }
}

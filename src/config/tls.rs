//! `proxy.tls`: how `https://` workers are verified (requests, health probes, engine
//! scrapes and every other call the upstream client makes). rustls with ring; no
//! OpenSSL.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use rustls::RootCertStore;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use serde::Deserialize;

use super::check::{Checker, ConfigError};

/// `proxy.tls`, loaded at config time so a bad CA file is a config error. Two settings
/// are equal when they name the same file and the same verification (SIGHUP reload
/// compares configs; a changed file's contents are read again only at a restart).
#[derive(Clone)]
pub struct TlsSetting {
    /// PEM certificates trusted besides the platform's store (`proxy.tls.ca_file`).
    pub ca_file: Option<PathBuf>,
    /// Accept any certificate (`proxy.tls.insecure_skip_verify`); logged loudly.
    pub insecure_skip_verify: bool,
    /// The client side of every TLS connection to a worker.
    pub client: Arc<rustls::ClientConfig>,
    /// Certificates trusted: the platform's, then the CA file's.
    pub roots: usize,
}

impl PartialEq for TlsSetting {
    fn eq(&self, other: &Self) -> bool {
        (&self.ca_file, self.insecure_skip_verify) == (&other.ca_file, other.insecure_skip_verify)
    }
}

impl std::fmt::Debug for TlsSetting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsSetting")
            .field("ca_file", &self.ca_file)
            .field("insecure_skip_verify", &self.insecure_skip_verify)
            .field("roots", &self.roots)
            .finish_non_exhaustive()
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The platform's trust store (`rustls-native-certs`: the system bundle, or
/// `SSL_CERT_FILE` / `SSL_CERT_DIR`), read once per process: every config load, reload
/// and test shares it. Certificates it cannot parse are left out.
fn platform_roots() -> &'static [CertificateDer<'static>] {
    static ROOTS: OnceLock<Vec<CertificateDer<'static>>> = OnceLock::new();
    ROOTS.get_or_init(|| rustls_native_certs::load_native_certs().certs)
}

impl TlsSetting {
    /// The connector of every outgoing call (workers, the OTLP collector): TCP with
    /// `TCP_NODELAY` (small SSE writes must not wait for delayed ACKs) and
    /// `connect_timeout` on the TCP connect; rustls over it for `https://`, verified as
    /// this setting says.
    pub fn https_connector(
        &self,
        connect_timeout: std::time::Duration,
    ) -> hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector> {
        let mut tcp = hyper_util::client::legacy::connect::HttpConnector::new();
        tcp.set_nodelay(true);
        tcp.set_connect_timeout(Some(connect_timeout));
        tcp.enforce_http(false);
        hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config((*self.client).clone())
            .https_or_http()
            .enable_http1()
            .wrap_connector(tcp)
    }

    /// Trust the platform's store plus the certificates of `ca_file` (PEM, one or more);
    /// `insecure_skip_verify` trusts any certificate instead. `Err` says what is wrong
    /// with the file (unreadable, not PEM, no certificate in it, a certificate rustls
    /// refuses).
    pub fn load(ca_file: Option<PathBuf>, insecure_skip_verify: bool) -> Result<Self, String> {
        let mut roots = RootCertStore::empty();
        let (_, _) = roots.add_parsable_certificates(platform_roots().iter().cloned());
        if let Some(path) = &ca_file {
            let shown = path.display();
            let pem = std::fs::read(path).map_err(|e| format!("`{shown}` cannot be read: {e}"))?;
            let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&pem)
                .collect::<Result<_, _>>()
                .map_err(|e| format!("`{shown}` is not a PEM certificate file: {e}"))?;
            if certs.is_empty() {
                return Err(format!(
                    "`{shown}` holds no certificate (expected PEM `-----BEGIN CERTIFICATE-----` blocks)"
                ));
            }
            for (i, c) in certs.into_iter().enumerate() {
                roots
                    .add(c)
                    .map_err(|e| format!("`{shown}`: certificate {} is refused: {e}", i + 1))?;
            }
        }
        let provider = provider();
        let builder = rustls::ClientConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("no TLS version available: {e}"))?;
        let count = roots.len();
        let client = if insecure_skip_verify {
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
                .with_no_client_auth()
        } else {
            builder.with_root_certificates(roots).with_no_client_auth()
        };
        Ok(TlsSetting {
            ca_file,
            insecure_skip_verify,
            client: Arc::new(client),
            roots: count,
        })
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
pub(super) struct RawTls {
    ca_file: Option<PathBuf>,
    insecure_skip_verify: Option<bool>,
}

impl RawTls {
    /// Loads the setting; a CA file that cannot be used is refused at `proxy.tls.ca_file`.
    pub(super) fn validate(self, ck: &Checker<'_>) -> Result<TlsSetting, ConfigError> {
        TlsSetting::load(self.ca_file, self.insecure_skip_verify.unwrap_or(false))
            .map_err(|m| ck.err("proxy.tls.ca_file", m))
    }
}

/// `insecure_skip_verify`: any certificate for any name, signatures still checked
/// against the certificate presented (so the handshake is well-formed, not trusted).
#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::testing::{ONE, err, load};

    #[test]
    fn a_ca_file_must_hold_pem_certificates() {
        let dir = std::env::temp_dir().join(format!("car-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = dir.join("missing.pem");
        let e = TlsSetting::load(Some(missing), false).unwrap_err();
        assert!(e.contains("cannot be read"), "{e}");
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let e = TlsSetting::load(Some(empty), false).unwrap_err();
        assert!(e.contains("holds no certificate"), "{e}");
        let bad = dir.join("bad.pem");
        std::fs::write(
            &bad,
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let e = TlsSetting::load(Some(bad), false).unwrap_err();
        assert!(e.contains("refused"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
        // The platform's store alone loads (it may be empty on a bare machine).
        assert!(TlsSetting::load(None, false).is_ok());
        assert!(TlsSetting::load(None, true).is_ok());
    }

    #[test]
    fn https_workers_and_proxy_tls_are_checked() {
        let c = load(&[("a", "workers:\n  - url: HTTPS://Example.com/v1/\n")]).unwrap();
        assert_eq!(c.workers[0].url.as_str(), "https://example.com/v1");
        assert!(!c.proxy.tls.insecure_skip_verify);
        let e = err(&[
            ("a.yaml", ONE),
            (
                "b.yaml",
                "proxy:\n  tls:\n    ca_file: /nonexistent/ca.pem\n",
            ),
        ]);
        assert!(
            e.contains("proxy.tls.ca_file") && e.contains("cannot be read"),
            "{e}"
        );
        let e = err(&[
            ("a.yaml", ONE),
            ("b.yaml", "proxy:\n  tls:\n    verify: no\n"),
        ]);
        assert!(e.contains("verify"), "{e}");
    }
}

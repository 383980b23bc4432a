//! Client-side TLS: the router calling `https://` workers, and workers (simulated
//! engines, bridges) streaming to an `https://` router.
//!
//! Both trust the same roots: the system's trust store, plus a CA file for
//! certificates from a private CA. A machine without a trust store (a slim
//! container) still works with the CA file alone.

use std::path::{Path, PathBuf};

use rustls::{ClientConfig, RootCertStore};
use tonic::transport::{ClientTlsConfig, Endpoint, Identity};

use crate::server::HANDSHAKE_TIMEOUT;
use crate::{TlsError, pem};

/// The system's trust roots plus every certificate in `ca_file`.
fn roots(ca_file: Option<&Path>) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    let system = rustls_native_certs::load_native_certs();
    for e in &system.errors {
        tracing::debug!("system trust store: {e}");
    }
    roots.add_parsable_certificates(system.certs);
    if let Some(ca_file) = ca_file {
        pem::add_ca_certificates(&mut roots, ca_file)?;
    }
    Ok(roots)
}

/// The config of the router's client for `https://` workers. With no roots at
/// all it still builds: the router serves plain workers, and an `https://` one
/// fails its handshake with a clear "unknown issuer".
pub fn https_client_config(ca_file: Option<&Path>) -> Result<ClientConfig, TlsError> {
    let config = ClientConfig::builder_with_provider(crate::provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_root_certificates(roots(ca_file)?)
        .with_no_client_auth();
    Ok(config)
}

/// How a worker reaches an `https://` router.
#[derive(Clone, Debug, Default)]
pub struct GrpcClientTls {
    /// Trusted beside the system's roots: the CA of the router's certificate.
    pub ca_file: Option<PathBuf>,
    /// The worker's client certificate and key, for a router that asks for them (mTLS).
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
}

impl GrpcClientTls {
    fn is_set(&self) -> bool {
        self.ca_file.is_some() || self.cert_file.is_some() || self.key_file.is_some()
    }
}

/// The gRPC endpoint of the router at `url`: plain for `http://`, TLS for
/// `https://`. Files are read here, so a certificate renewed on disk is picked
/// up at the next reconnect; call it once at start to fail early on bad files.
pub fn grpc_endpoint(url: &str, tls: &GrpcClientTls) -> Result<Endpoint, TlsError> {
    let endpoint = Endpoint::from_shared(url.to_string())
        .map_err(|e| TlsError::Config(format!("router URL {url:?}: {e}")))?;
    if endpoint.uri().scheme_str() != Some("https") {
        if tls.is_set() {
            return Err(TlsError::Config(format!(
                "TLS files are given but the router URL {url:?} is not https://"
            )));
        }
        return Ok(endpoint);
    }
    let roots = roots(tls.ca_file.as_deref())?;
    if roots.is_empty() {
        return Err(TlsError::Config(format!(
            "cannot verify {url}: the system has no trust roots and no CA file was given"
        )));
    }
    let mut config = ClientTlsConfig::new()
        .trust_anchors(roots.roots)
        .timeout(HANDSHAKE_TIMEOUT);
    match (&tls.cert_file, &tls.key_file) {
        (Some(cert_file), Some(key_file)) => {
            let cert = pem::certificates(cert_file)?;
            let key = pem::private_key(key_file)?;
            config = config.identity(Identity::from_pem(cert.bytes, key.bytes));
        }
        (None, None) => {}
        _ => {
            return Err(TlsError::Config(
                "a client certificate needs both its certificate and its key file".into(),
            ));
        }
    }
    endpoint
        .tls_config(config)
        .map_err(|e| TlsError::Config(format!("TLS for {url}: {e}")))
}

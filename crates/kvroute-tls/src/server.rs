//! Server-side TLS: the router's two listeners, and a simulated engine's HTTP.
//!
//! One certificate serves both router listeners. Only gRPC ingest can ask for
//! client certificates: workers are a known fleet that can be given
//! certificates, the HTTP API's clients are applications that cannot.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};

use crate::{TlsError, pem};

/// A client that has not finished its handshake by then is dropped, so that
/// idle connections cannot pile up before any request.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The router's TLS, read from `[tls]`: one config per listener, both served
/// by a [`TlsListener`](crate::TlsListener), which counts and logs failed handshakes.
pub struct ServerTls {
    pub http: Arc<ServerConfig>,
    pub grpc: Arc<ServerConfig>,
}

impl ServerTls {
    /// Reads the certificate chain and key, and for mTLS the CA that signs
    /// workers' client certificates: a worker without one is refused.
    pub fn load(
        cert_file: &Path,
        key_file: &Path,
        client_ca_file: Option<&Path>,
    ) -> Result<Self, TlsError> {
        let certs = pem::certificates(cert_file)?.parsed;
        let key = pem::private_key(key_file)?.parsed;
        let builder = ServerConfig::builder_with_provider(crate::provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Config(e.to_string()))?;
        let builder = match client_ca_file {
            Some(ca_file) => {
                let mut roots = RootCertStore::empty();
                pem::add_ca_certificates(&mut roots, ca_file)?;
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), crate::provider())
                        .build()
                        .map_err(|e| TlsError::File {
                            path: ca_file.display().to_string(),
                            message: format!("cannot verify client certificates with it: {e}"),
                        })?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut grpc = builder
            .with_single_cert(certs.clone(), key.clone_key())
            .map_err(|e| unusable(cert_file, e))?;
        grpc.alpn_protocols = vec![b"h2".to_vec()];
        // The router's HTTP API serves HTTP/2 as well.
        let http = https_config(certs, key, cert_file, &[b"h2", b"http/1.1"])?;
        Ok(ServerTls {
            http,
            grpc: Arc::new(grpc),
        })
    }
}

/// The config of an HTTPS (HTTP/1.1) listener with this certificate and key.
pub fn https_server_config(
    cert_file: &Path,
    key_file: &Path,
) -> Result<Arc<ServerConfig>, TlsError> {
    let certs = pem::certificates(cert_file)?;
    let key = pem::private_key(key_file)?;
    https_config(certs.parsed, key.parsed, cert_file, &[b"http/1.1"])
}

fn unusable(cert_file: &Path, e: rustls::Error) -> TlsError {
    TlsError::File {
        path: cert_file.display().to_string(),
        message: format!("unusable with its key: {e}"),
    }
}

fn https_config(
    certs: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    cert_file: &Path,
    alpn: &[&[u8]],
) -> Result<Arc<ServerConfig>, TlsError> {
    let mut config = ServerConfig::builder_with_provider(crate::provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| unusable(cert_file, e))?;
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn bad_files_are_refused_naming_the_file() {
        let dir = std::env::temp_dir().join(format!("kvroute-tls-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let one = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let other = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let cert = write(&dir, "cert.pem", &one.cert.pem());
        let key = write(&dir, "key.pem", &one.signing_key.serialize_pem());
        let other_key = write(&dir, "other.key", &other.signing_key.serialize_pem());
        let not_pem = write(&dir, "notes.txt", "hello");

        assert!(ServerTls::load(&cert, &key, Some(&cert)).is_ok());
        let error = |result: Result<ServerTls, TlsError>| result.err().unwrap().to_string();
        let message = error(ServerTls::load(&not_pem, &key, None));
        assert!(message.contains("notes.txt") && message.contains("no PEM certificate"));
        let message = error(ServerTls::load(&cert, &not_pem, None));
        assert!(message.contains("notes.txt") && message.contains("private key"));
        let message = error(ServerTls::load(&cert, &other_key, None));
        assert!(
            message.contains("cert.pem") && message.contains("key"),
            "{message}"
        );
        let message = error(ServerTls::load(&cert, &key, Some(&dir.join("absent.pem"))));
        assert!(message.contains("absent.pem") && message.contains("cannot read"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}

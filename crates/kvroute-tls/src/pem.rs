//! Reading PEM files, each read once and checked here, so that a wrong path or a
//! file of the wrong kind stops the process at start with the file's name,
//! instead of failing every handshake later.

use std::path::Path;

use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::TlsError;

/// A PEM file's bytes with what was parsed from them (tonic takes the bytes).
pub struct Pem<T> {
    pub bytes: Vec<u8>,
    pub parsed: T,
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|e| file_error(path, format!("cannot read: {e}")))
}

fn file_error(path: &Path, message: String) -> TlsError {
    TlsError::File {
        path: path.display().to_string(),
        message,
    }
}

/// Every certificate in `path` (a chain, or a bundle of CA certificates); at least one.
pub fn certificates(path: &Path) -> Result<Pem<Vec<CertificateDer<'static>>>, TlsError> {
    let bytes = read(path)?;
    let parsed = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_error(path, format!("not a PEM certificate file: {e}")))?;
    if parsed.is_empty() {
        return Err(file_error(path, "holds no PEM certificate".into()));
    }
    Ok(Pem { bytes, parsed })
}

/// Adds every certificate in `path` to `roots`, as trusted CAs.
pub fn add_ca_certificates(roots: &mut RootCertStore, path: &Path) -> Result<(), TlsError> {
    for cert in certificates(path)?.parsed {
        roots
            .add(cert)
            .map_err(|e| file_error(path, format!("not a usable CA certificate: {e}")))?;
    }
    Ok(())
}

/// The private key in `path` (PKCS#8, PKCS#1 or SEC1).
pub fn private_key(path: &Path) -> Result<Pem<PrivateKeyDer<'static>>, TlsError> {
    let bytes = read(path)?;
    let parsed = PrivateKeyDer::from_pem_slice(&bytes)
        .map_err(|e| file_error(path, format!("holds no PEM private key: {e}")))?;
    Ok(Pem { bytes, parsed })
}

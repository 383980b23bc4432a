//! kvroute-tls: TLS and credentials for kvroute's processes, shared by the router, the simulated
//! engines and the bridge, so that certificates are read and checked one way.
//!
//! Everything is rustls with the ring crypto provider (aws-lc-rs would need cmake
//! and nasm to build). [`pem`] reads certificate and key files with errors that
//! name the file; [`server`] turns them into the configs of an HTTPS listener and
//! of tonic's gRPC server (optionally asking clients for certificates: mTLS);
//! [`client`] builds the trust roots for calls to `https://` workers and the
//! gRPC channel of a worker to the router; [`listener`] serves axum and tonic
//! over TLS, counting and logging the handshakes that fail.
//! [`secret`] holds the bearer tokens all of them send or check, redacted in
//! every printed form.
//!
//! Nothing here runs unless TLS is configured: plain listeners and clients are
//! the ones kvroute always had.

pub mod client;
pub mod listener;
pub mod pem;
pub mod secret;
pub mod server;

pub use client::{GrpcClientTls, grpc_endpoint, https_client_config};
pub use listener::{Peek, Serves, TlsListener};
pub use rustls::ServerConfig;
pub use secret::Secret;
pub use server::{ServerTls, https_server_config};

/// Everything that can go wrong setting TLS up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: {message}")]
    File { path: String, message: String },
    #[error("{0}")]
    Config(String),
}

/// ring: the crypto provider of every TLS config kvroute builds.
fn provider() -> std::sync::Arc<rustls::crypto::CryptoProvider> {
    std::sync::Arc::new(rustls::crypto::ring::default_provider())
}

//! The one error type of the crate: what stops a replica from joining.

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("cannot connect to NATS at {url}: {message}")]
    Connect { url: String, message: String },
    #[error("NATS JetStream: {0}")]
    JetStream(String),
    #[error(transparent)]
    Router(#[from] kvroute_router::RouterError),
}

impl ClusterError {
    pub(crate) fn jetstream(e: impl std::fmt::Display) -> Self {
        ClusterError::JetStream(e.to_string())
    }
}

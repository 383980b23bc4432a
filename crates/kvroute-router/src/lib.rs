//! kvroute-router: the router service behind `kvroute serve`.
//!
//! Workers stream KV-cache events to it over gRPC ([`grpc`], whose streams
//! [`ingest`] serves); it keeps them in
//! the global index (`kvroute-index`) and tracks who can take requests and how
//! loaded each worker is ([`fleet`]: the registry, with its bookings, breakers,
//! groups and shared load). For every OpenAI-style request the HTTP API
//! ([`http`]) tokenizes the prompt ([`tokenize`], on [`low_priority`] threads),
//! hashes it into blocks, asks the scheduler ([`schedule`]) for the worker whose
//! cached prefix and load make it cheapest, and the proxy books the load and
//! forwards the request. [`state`] ties these together; [`ingest`] also decides
//! which worker stream may write the index and checks the index against the
//! digests workers send (`faults`, behind the `test-hooks` feature, corrupts it
//! on purpose for tests), and
//! [`cached_tokens`] with [`fleet::claims`] stops crediting a worker whose
//! responses keep contradicting its events; [`server`] starts the listeners,
//! background tasks and the graceful shutdown ([`connections`] caps both
//! listeners'). With `[cluster]`, [`replica`] is the seam through which
//! replicas share their workers' events (the NATS side lives in
//! `kvroute-cluster`); [`schedule::sessions`] keeps agent sessions on the
//! rank that served their last request. With `[epp]`, [`epp`] answers a
//! gateway's ext_proc stream with the same routing instead of proxying.
//! [`http::responses`] keeps an OpenAI Responses conversation on the worker
//! that stores it. [`config`], [`error`],
//! [`metrics`] (with [`series`]), [`limits`] and [`auth`] are shared.
//!
//! No module imports one that imports it back (`tests/layout.rs` checks): a
//! module may use its own submodules and they it, nothing else goes in a
//! circle.

pub mod auth;
pub mod cached_tokens;
pub mod config;
pub mod connections;
pub mod epp;
pub mod error;
#[cfg(feature = "test-hooks")]
pub mod faults;
pub mod fleet;
pub mod grpc;
pub mod http;
pub mod ingest;
pub mod limits;
pub mod low_priority;
pub mod metrics;
pub mod replica;
pub mod schedule;
pub mod series;
pub mod server;
pub mod state;
pub mod tokenize;

pub use config::Config;
pub use error::RouterError;

//! kvroute-router: the router service behind `kvroute serve`.
//!
//! Workers stream KV-cache events to it over gRPC ([`ingest`]); it keeps them in
//! the global index (`kvroute-index`) and tracks who can take requests and how
//! loaded each worker is ([`registry`], with its [`booking`]s and [`breaker`]s).
//! For every OpenAI-style request the HTTP API ([`api`]) tokenizes the prompt
//! ([`tokenize`], on [`low_priority`] threads), hashes it into blocks, asks the [`scheduler`] for the worker
//! whose cached prefix and load make it cheapest, and the [`proxy`] books the load and forwards the request
//! ([`upstream`]). [`state`] ties these together, [`writers`] decides which
//! worker stream may write the index, and [`verify`] checks the index against
//! the digests workers send ([`faults`] corrupts it on purpose, for tests), and
//! [`claims`] stops crediting a worker whose responses keep contradicting its
//! events; [`server`] starts the listeners,
//! background tasks and the graceful shutdown ([`http_serve`] serves the HTTP API's connections, [`connections`] caps both listeners'). With `[cluster]`, [`replica`] is
//! the seam through which replicas share their workers' events, and
//! [`shared_load`] the one through which they share bookings and predictions
//! (the NATS side lives in `kvroute-cluster`). With `[epp]`, [`epp`] answers
//! a gateway's ext_proc stream with the same routing instead of proxying. [`config`], [`error`],
//! [`metrics`] (with [`series`]), [`auth`] and [`worker_url`] are shared.

pub mod api;
pub mod auth;
pub mod booking;
pub mod breaker;
mod bucketed;
pub mod cached_tokens;
pub mod claims;
pub mod config;
pub mod connections;
pub mod epp;
pub mod error;
pub mod faults;
pub mod groups;
pub mod http_serve;
pub mod ingest;
mod kept;
pub mod limits;
pub mod low_priority;
pub mod metrics;
pub mod pd;
pub mod proxy;
pub mod queue;
pub mod registry;
pub mod replica;
pub mod scheduler;
pub mod series;
pub mod server;
pub mod shared_load;
pub mod state;
pub mod tokenize;
pub mod upstream;
pub mod verify;
pub mod worker_url;
pub mod writers;

pub use config::Config;
pub use error::RouterError;

//! kvroute-sim: simulated inference engines that behave like vLLM where it
//! matters to a KV-aware router, so routing can be tried and compared without
//! a GPU fleet.
//!
//! - [`pool`]: the paged KV block pool with prefix caching on kvroute's block
//!   hashes, active (reference-counted) and inactive (cached) blocks, evicted
//!   as vLLM does (a `kvroute-cache` policy, blocks given back tail first) or
//!   as SGLang does (a radix tree, least recently used unlocked leaf first);
//! - [`pool::host`]: the optional host tier (`--offload-blocks`): blocks the pool
//!   evicted, kept in CPU memory and loaded back instead of prefilled;
//! - [`engine`]: continuous batching over the pool (max-num-seqs,
//!   max-num-batched-tokens, chunked prefill, preemption), one iteration per
//!   [`Engine::step`], timed by the [`cost`] model and never by a clock;
//! - [`eviction`]: per-policy eviction figures and the eviction log;
//! - [`events`]: the numbered event log a worker publishes, with a ring of
//!   recent events to answer resync requests;
//! - [`worker`]: one engine made live: its iteration loop on tokio, the gRPC
//!   stream to the router ([`worker::publisher`], with the digests of [`view`]), the
//!   OpenAI-compatible HTTP server ([`worker::http`]), with the Responses API,
//!   the Anthropic Messages API and vLLM's endpoints without KV cache, and the
//!   faults tests inject;
//! - [`worker::pd`]: prefill/decode disaggregation: roles, vLLM's and SGLang's
//!   handoff conventions, prefill leases and the side channel decode engines
//!   take KV from;
//! - [`worker::persona`]: whose HTTP surface an engine shows, vLLM's or SGLang's;
//! - [`trace`]: Mooncake trace requests turned into token ids;
//! - [`cli`]: the engines' options as command-line flags.

pub mod cli;
pub mod cost;
pub mod engine;
pub mod events;
pub mod eviction;
pub mod pool;
pub mod trace;
pub mod view;
pub mod worker;

pub use cost::CostModel;
pub use engine::{Engine, EngineConfig, Handoff};
pub use pool::EngineKind;
pub use worker::pd::{PdConfig, PdConvention, PdStats, Role};
pub use worker::persona::Persona;
pub use worker::{Fault, Worker, WorkerConfig, start_fleet};

/// Everything that can go wrong in the simulator.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("{0}")]
    BadRequest(String),
    #[error(transparent)]
    Cache(#[from] kvroute_cache::CacheError),
    #[error(transparent)]
    Tokenize(#[from] kvroute_tokenize::TokenizeError),
    #[error("{context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },
    #[error("the engine is not running")]
    Stopped,
}

//! kvroute-index: the router's knowledge of which worker holds which KV-cache block.
//!
//! A pure library (no async runtime, no I/O) that the router service, the
//! simulator and the engine bridges all stand on:
//! - [`hash`] turns tokens into block hashes exactly as NVIDIA Dynamo does, so
//!   events from Dynamo-instrumented engines and ours agree;
//! - [`event`] defines the events workers report (stored chains, removals,
//!   clears) and what applying one did;
//! - [`digest`] sums up a set of engine block hashes, for workers and the
//!   router to check that they agree on what a rank holds;
//! - [`index`] applies events per worker, in id order, and answers "how long a
//!   prefix of this request does each worker hold?";
//! - [`timeline`] derives benchmark workloads (lookups and events) from a trace;
//! - [`tiers`] pairs a device-tier index with an offload-tier one (blocks a
//!   worker keeps in host memory or on disk) over one event sequence per rank;
//! - [`predicted`] remembers the router's own decisions for a while, for workers
//!   that publish no events and for requests that race the engine's first event;
//! - [`huge`] allocates tables of megabytes read at random in 2 MiB pages (the
//!   predicted layer's, and the tokenizer's).

mod background;
mod cells;
pub mod digest;
pub mod event;
mod flat;
pub mod hash;
pub mod huge;
pub mod index;
mod lru;
pub mod predicted;
mod slots;
mod table;
pub mod tiers;
pub mod timeline;

pub use digest::{BlockSetDigest, IndexedDigest};
pub use event::{ApplyOutcome, EventKind, EventStatus, EventType, KvEvent, StoredBlock, WorkerKey};
pub use hash::{
    BlockHasher, ExtraKeys, MultimodalItem, multimodal_identifier_hash, salt_key, sequence_hash,
    sequence_hashes,
};
pub use index::{
    IndexConfig, IndexMatch, IndexStats, KvIndex, Matches, OwnedPinnedPath, PinnedPath, WorkerDump,
    WorkerEvents, WorkerMatch,
};
pub use predicted::{PredictedConfig, PredictedIndex};
pub use tiers::{Tier, TieredDump, TieredIndex};

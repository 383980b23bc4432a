//! A worker stream's queued work, between its reader and its applier (or the
//! cluster's log, which takes it on the applier's behalf).

use kvroute_proto::{Digest, Dump, EventBatch};
use tokio::sync::OwnedSemaphorePermit;

/// Queued work, holding its decoded bytes of the stream's queue until applied.
pub(crate) enum Work {
    Events(EventBatch, OwnedSemaphorePermit),
    Dump(Dump, OwnedSemaphorePermit),
    /// Queued behind the events it covers: see [`crate::ingest::verify`].
    Digest(Digest, OwnedSemaphorePermit),
}

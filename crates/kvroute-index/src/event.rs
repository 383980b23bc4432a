//! KV-cache events as workers report them, and what applying one did.
//!
//! The index only reports outcomes; the router service decides what to do with
//! them (ask for a resync after a gap, export counters, and so on).

/// One data-parallel rank of one worker: the unit that holds a KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerKey {
    pub worker_id: u64,
    pub dp_rank: u32,
}

impl WorkerKey {
    pub fn new(worker_id: u64, dp_rank: u32) -> Self {
        Self { worker_id, dp_rank }
    }
}

/// One block of a stored chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StoredBlock {
    /// The engine's own hash of the block: an opaque id, used to name the block in
    /// later `Removed` events and as a later chain's parent.
    pub block_hash: u64,
    /// kvroute's local hash of the block's tokens (see [`crate::hash`]).
    pub tokens_hash: u64,
}

/// What happened in a worker's cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// A chain of consecutive blocks whose first block follows `parent_hash`
    /// (none: the chain starts at the root).
    Stored {
        parent_hash: Option<u64>,
        blocks: Vec<StoredBlock>,
    },
    /// Blocks evicted, named by their engine hashes.
    Removed { block_hashes: Vec<u64> },
    /// The worker dropped its whole cache.
    Cleared,
}

impl EventKind {
    pub fn type_name(&self) -> EventType {
        match self {
            EventKind::Stored { .. } => EventType::Stored,
            EventKind::Removed { .. } => EventType::Removed,
            EventKind::Cleared => EventType::Cleared,
        }
    }
}

/// An event with its per-worker id; ids of one worker are consecutive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEvent {
    pub event_id: u64,
    pub kind: EventKind,
}

/// The result of offering one event to the index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApplyOutcome {
    /// The event was the next in the worker's sequence and was applied.
    Applied {
        /// Blocks of a `Stored` whose parent the worker does not hold (all of them).
        rejected_blocks: u64,
        /// Hashes of a `Removed` that the worker did not hold.
        unknown_removals: u64,
    },
    /// The id was at or below the last applied one: a duplicate, ignored.
    Stale { last_applied: u64 },
    /// Events are missing; nothing was applied. The caller should resync the worker.
    Gap { expected: u64, got: u64 },
}

/// Event types, for counting outcomes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventType {
    Stored,
    Removed,
    Cleared,
}

impl EventType {
    pub const ALL: [EventType; 3] = [EventType::Stored, EventType::Removed, EventType::Cleared];

    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Stored => "stored",
            EventType::Removed => "removed",
            EventType::Cleared => "cleared",
        }
    }
}

/// Statuses, for counting outcomes. `Rejected` is an applied `Stored` whose parent
/// was unknown; `Partial` an applied `Removed` with some unknown hashes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventStatus {
    Applied,
    Rejected,
    Partial,
    Stale,
    Gap,
}

impl EventStatus {
    pub const ALL: [EventStatus; 5] = [
        EventStatus::Applied,
        EventStatus::Rejected,
        EventStatus::Partial,
        EventStatus::Stale,
        EventStatus::Gap,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            EventStatus::Applied => "applied",
            EventStatus::Rejected => "rejected",
            EventStatus::Partial => "partial",
            EventStatus::Stale => "stale",
            EventStatus::Gap => "gap",
        }
    }
}

impl ApplyOutcome {
    pub fn status(&self) -> EventStatus {
        match *self {
            ApplyOutcome::Applied {
                rejected_blocks, ..
            } if rejected_blocks > 0 => EventStatus::Rejected,
            ApplyOutcome::Applied {
                unknown_removals, ..
            } if unknown_removals > 0 => EventStatus::Partial,
            ApplyOutcome::Applied { .. } => EventStatus::Applied,
            ApplyOutcome::Stale { .. } => EventStatus::Stale,
            ApplyOutcome::Gap { .. } => EventStatus::Gap,
        }
    }
}

//! Index self-verification: a worker's digest of a rank's cache against the
//! index's own view of that rank.
//!
//! Workers send a [`Digest`] every so many events and every few seconds. It
//! travels through the stream's apply queue like an event batch, so it is
//! judged after every event before it and none after: the index's view and the
//! worker's are compared at the same event id, and only then. A digest for
//! another id (events were dropped on a full queue, or a gap awaits its resend)
//! or arriving while a resync is under way proves nothing and is skipped.
//!
//! What the index legitimately holds differently from the worker:
//! - blocks it evicted itself under `index.max_blocks`: a rank the cap trimmed
//!   since it was last cleared or dumped is not compared (the index marks it);
//! - predicted entries live in their own index and pinned paths only delay
//!   eviction, so neither enters the digest.
//!
//! A difference is counted, logged once, and answered by the caller with a
//! resync request from event 0, which workers can only answer with a full dump:
//! the dump replaces the rank and heals it. With `[cluster]` the digest is a
//! record of the shared log, checked by every replica at the same point
//! (`crate::replica`).

use kvroute_index::{BlockSetDigest, WorkerKey};
use kvroute_proto::Digest;

use crate::fleet::worker_label;
use crate::metrics;
use crate::state::AppState;

/// How a worker's digest compared with the index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Matched,
    /// The index holds something else than the worker: it needs a dump.
    Diverged,
    /// Not comparable: the index is not at the digest's event id, or a resync is under way.
    NotCurrent,
    /// Not comparable: the memory cap evicted some of the rank's blocks.
    Trimmed,
}

impl Verdict {
    fn as_str(self) -> &'static str {
        match self {
            Verdict::Matched => "matched",
            Verdict::Diverged => "diverged",
            Verdict::NotCurrent => "not_current",
            Verdict::Trimmed => "trimmed",
        }
    }
}

/// Compares `digest` with the index's view of `key` (whose stream has applied
/// everything queued before it), counts the outcome and logs a divergence.
pub fn check(state: &AppState, key: WorkerKey, digest: &Digest, resyncing: bool) -> Verdict {
    let worker = BlockSetDigest {
        block_count: digest.block_count,
        block_set_hash: digest.block_set_hash,
    };
    let indexed = state.tiers.digest(key);
    let verdict = match indexed {
        _ if resyncing => Verdict::NotCurrent,
        None => Verdict::NotCurrent,
        Some(i) if i.last_event_id != Some(digest.last_event_id) => Verdict::NotCurrent,
        Some(i) if i.trimmed => Verdict::Trimmed,
        Some(i) if i.digest == worker => Verdict::Matched,
        Some(_) => Verdict::Diverged,
    };
    let label = worker_label(key);
    ::metrics::counter!(metrics::INDEX_DIGESTS, "worker" => label.clone(), "outcome" => verdict.as_str())
        .increment(1);
    if verdict == Verdict::Diverged {
        ::metrics::counter!(metrics::INDEX_DIVERGENCE, "worker" => label.clone()).increment(1);
        tracing::warn!(
            worker = %label,
            event_id = digest.last_event_id,
            worker_blocks = digest.block_count,
            indexed_blocks = indexed.map_or(0, |i| i.digest.block_count),
            "the index differs from the worker's digest: asking for a full dump"
        );
    }
    verdict
}

#[cfg(test)]
mod tests {
    use kvroute_index::{EventKind, KvEvent, StoredBlock};

    use super::*;
    use crate::config::Config;

    fn store(event_id: u64, hashes: std::ops::Range<u64>) -> KvEvent {
        KvEvent {
            event_id,
            kind: EventKind::Stored {
                parent_hash: None,
                blocks: hashes
                    .map(|h| StoredBlock {
                        block_hash: h,
                        tokens_hash: h,
                    })
                    .collect(),
            },
        }
    }

    fn digest(last_event_id: u64, hashes: std::ops::Range<u64>) -> Digest {
        let d = BlockSetDigest::of(hashes);
        Digest {
            dp_rank: 0,
            last_event_id,
            block_count: d.block_count,
            block_set_hash: d.block_set_hash,
        }
    }

    #[test]
    fn digests_are_compared_only_at_the_same_event_id_on_an_untrimmed_rank() {
        let mut config = Config::default();
        config.index.max_blocks = 6;
        let state = AppState::new(config, None).unwrap();
        let key = WorkerKey::new(1, 0);
        assert_eq!(
            check(&state, key, &digest(1, 0..4), false),
            Verdict::NotCurrent
        );
        state.index.apply(key, &store(1, 0..4));
        assert_eq!(
            check(&state, key, &digest(1, 0..4), false),
            Verdict::Matched
        );
        assert_eq!(
            check(&state, key, &digest(1, 0..3), false),
            Verdict::Diverged
        );
        assert_eq!(
            check(&state, key, &digest(1, 1..5), false),
            Verdict::Diverged
        );
        assert_eq!(
            check(&state, key, &digest(2, 0..3), false),
            Verdict::NotCurrent
        );
        assert_eq!(
            check(&state, key, &digest(1, 0..3), true),
            Verdict::NotCurrent
        );
        // Over the cap: the index evicts some of the rank's blocks itself.
        state.index.apply(key, &store(2, 10..14));
        assert_eq!(
            check(&state, key, &digest(2, 0..3), false),
            Verdict::Trimmed
        );
    }
}

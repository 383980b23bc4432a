//! A digest of a set of engine block hashes: how workers and the router check,
//! cheaply and often, that they agree on what a rank holds.
//!
//! The digest is the set's size plus an order-independent hash, kept
//! incrementally: adding or removing one hash is O(1), so a worker can send it
//! every few events and the router can keep one per rank without ever scanning.
//! Both sides use this one definition (the simulator, the bridge and the index).
//!
//! The hash is the wrapping sum of a strong 64-bit mix (xxh3) of each member.
//! Not a plain xor of the members or of their mixes: xor is linear over GF(2),
//! so a member counted twice vanishes, and any 65 distinct hashes contain a
//! subset that xors to zero — errors that cancel out are easy to hit. A sum
//! modulo 2^64 of well-mixed values has no such structure: two different sets
//! collide with probability about 2^-64, and the count catches most of those.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Seed of the member mix, fixed by the protocol (ASCII "kvdigest").
const MIX_SEED: u64 = 0x6b76_6469_6765_7374;

/// Count and order-independent hash of a set of engine block hashes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct BlockSetDigest {
    pub block_count: u64,
    pub block_set_hash: u64,
}

impl BlockSetDigest {
    /// The digest of `hashes`, which must be distinct (a set).
    pub fn of(hashes: impl IntoIterator<Item = u64>) -> Self {
        let mut digest = Self::default();
        for hash in hashes {
            digest.insert(hash);
        }
        digest
    }

    /// Adds a member not in the set yet.
    pub fn insert(&mut self, block_hash: u64) {
        self.block_count = self.block_count.wrapping_add(1);
        self.block_set_hash = self.block_set_hash.wrapping_add(mix(block_hash));
    }

    /// Takes away a member of the set.
    #[inline]
    pub fn remove(&mut self, block_hash: u64) {
        self.block_count = self.block_count.wrapping_sub(1);
        self.block_set_hash = self.block_set_hash.wrapping_sub(mix(block_hash));
    }

    /// The digest of both sets together, a hash in both counted twice: how a
    /// rank's two tiers (see [`crate::tiers`]) make its one digest.
    pub fn plus(self, other: Self) -> Self {
        Self {
            block_count: self.block_count.wrapping_add(other.block_count),
            block_set_hash: self.block_set_hash.wrapping_add(other.block_set_hash),
        }
    }
}

/// What the index holds of one rank, to compare with the worker's digest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexedDigest {
    /// The last event applied; the digest is current to it.
    pub last_event_id: Option<u64>,
    /// The digest of the engine block hashes the rank holds.
    pub digest: BlockSetDigest,
    /// The index evicted some of the rank's blocks under its memory cap since
    /// the rank was last cleared: it holds less than the worker on purpose,
    /// and the digest says nothing.
    pub trimmed: bool,
}

fn mix(block_hash: u64) -> u64 {
    xxh3_64_with_seed(&block_hash.to_le_bytes(), MIX_SEED)
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeSet, HashSet};

    use proptest::prelude::*;

    use super::*;
    use crate::{EventKind, IndexConfig, KvEvent, KvIndex, StoredBlock, WorkerKey};

    /// The specification, from scratch: the sorted set's size, and the sum of
    /// its members' xxh3 mixes modulo 2^64.
    fn reference(set: &BTreeSet<u64>) -> BlockSetDigest {
        let mut sum = 0u64;
        for &h in set {
            sum = sum.wrapping_add(xxh3_64_with_seed(&h.to_le_bytes(), MIX_SEED));
        }
        BlockSetDigest {
            block_count: set.len() as u64,
            block_set_hash: sum,
        }
    }

    proptest! {
        /// Any sequence of set insertions and removals, applied incrementally,
        /// gives the digest of the resulting set computed from scratch.
        #[test]
        fn incremental_digest_equals_the_digest_of_the_set(
            ops in prop::collection::vec((any::<bool>(), 0u64..64), 0..300),
        ) {
            let mut set = BTreeSet::new();
            let mut digest = BlockSetDigest::default();
            for (add, h) in ops {
                if add && set.insert(h) {
                    digest.insert(h);
                } else if !add && set.remove(&h) {
                    digest.remove(h);
                }
                prop_assert_eq!(digest, reference(&set));
            }
            prop_assert_eq!(BlockSetDigest::of(set.iter().rev().copied()), reference(&set));
        }

        /// Different sets of the same size get different digests.
        #[test]
        fn different_sets_differ(
            a in prop::collection::hash_set(any::<u64>(), 1..50),
            swap in any::<u64>(),
        ) {
            let mut b: HashSet<u64> = a.clone();
            let out = *a.iter().next().unwrap();
            prop_assume!(!a.contains(&swap));
            b.remove(&out);
            b.insert(swap);
            prop_assert_ne!(BlockSetDigest::of(a), BlockSetDigest::of(b));
        }
    }

    /// An event a worker might send: stores under a parent among a few hashes
    /// (so some parents are unknown and refused), removals, clears.
    fn event() -> impl Strategy<Value = EventKind> {
        prop_oneof![
            6 => (prop::option::of(0u64..24), prop::collection::vec(0u64..24, 1..4)).prop_map(
                |(parent_hash, hashes)| EventKind::Stored {
                    parent_hash,
                    blocks: hashes
                        .into_iter()
                        .map(|h| StoredBlock { block_hash: h, tokens_hash: h % 5 })
                        .collect(),
                }
            ),
            3 => prop::collection::vec(0u64..24, 1..4)
                .prop_map(|block_hashes| EventKind::Removed { block_hashes }),
            1 => Just(EventKind::Cleared),
        ]
    }

    /// The engine hashes a router holds for a worker, from the protocol: a
    /// chain whose parent is not held is refused whole; removals and clears
    /// take hashes away.
    fn held_after(held: &mut BTreeSet<u64>, kind: &EventKind) {
        match kind {
            EventKind::Stored {
                parent_hash,
                blocks,
            } => {
                if parent_hash.is_none_or(|p| held.contains(&p)) {
                    held.extend(blocks.iter().map(|b| b.block_hash));
                }
            }
            EventKind::Removed { block_hashes } => {
                for h in block_hashes {
                    held.remove(h);
                }
            }
            EventKind::Cleared => held.clear(),
        }
    }

    proptest! {
        /// The index's per-worker digest, kept as events apply, is the digest
        /// of the engine hashes the worker holds by the protocol, after every
        /// event and after a dump replaces the worker's state.
        #[test]
        fn the_index_keeps_each_workers_digest_as_events_apply(
            events in prop::collection::vec((0u32..2, event()), 0..120),
            dump in prop::collection::vec(event(), 0..20),
        ) {
            let index = KvIndex::default();
            let mut held = [BTreeSet::new(), BTreeSet::new()];
            let mut ids = [0u64; 2];
            for (rank, kind) in &events {
                let (key, r) = (WorkerKey::new(1, *rank), *rank as usize);
                ids[r] += 1;
                index.apply(key, &KvEvent { event_id: ids[r], kind: kind.clone() });
                held_after(&mut held[r], kind);
                let indexed = index.digest(key).unwrap();
                prop_assert_eq!(indexed.digest, reference(&held[r]));
                prop_assert_eq!(indexed.last_event_id, Some(ids[r]));
                prop_assert!(!indexed.trimmed);
            }
            let stores: Vec<EventKind> = dump
                .into_iter()
                .filter(|k| matches!(k, EventKind::Stored { .. }))
                .collect();
            let key = WorkerKey::new(1, 0);
            index.replace_worker(key, 500, &stores);
            let mut replaced = BTreeSet::new();
            for kind in &stores {
                held_after(&mut replaced, kind);
            }
            let indexed = index.digest(key).unwrap();
            prop_assert_eq!(indexed.digest, reference(&replaced));
            prop_assert_eq!(indexed.last_event_id, Some(500));
        }
    }

    #[test]
    fn a_worker_the_memory_cap_evicted_from_is_trimmed_until_cleared() {
        let index = KvIndex::new(IndexConfig {
            max_blocks: Some(4),
        });
        let key = WorkerKey::new(1, 0);
        let store = |id: u64, hashes: std::ops::Range<u64>| KvEvent {
            event_id: id,
            kind: EventKind::Stored {
                parent_hash: None,
                blocks: hashes
                    .map(|h| StoredBlock {
                        block_hash: h,
                        tokens_hash: h,
                    })
                    .collect(),
            },
        };
        index.apply(key, &store(1, 0..4));
        assert!(!index.digest(key).unwrap().trimmed);
        index.apply(key, &store(2, 10..12));
        assert!(index.digest(key).unwrap().trimmed);
        index.apply(
            key,
            &KvEvent {
                event_id: 3,
                kind: EventKind::Cleared,
            },
        );
        let indexed = index.digest(key).unwrap();
        assert!(!indexed.trimmed);
        assert_eq!(indexed.digest, BlockSetDigest::default());
    }
}

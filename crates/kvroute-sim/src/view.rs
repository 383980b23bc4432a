//! What the router should hold of this worker, for the digests the publisher
//! sends (see kvroute-index's `digest` module).
//!
//! Not the pool itself: a dump leaves out blocks whose parent was evicted (they
//! can never be part of a prefix hit), while the events the router applies keep
//! such blocks until their own removal. So the view follows the connection: the
//! set of engine block hashes a dump sent, then every event after it applied by
//! the protocol's rules (a chain whose parent is not held is refused whole).
//! Events the `DropEvents` fault swallows are applied too: the router gets them
//! back through its resync before its view is at their ids.
//!
//! Two sets, one per tier (a chain's parent is looked up in its own tier); the
//! digest is their sum, as the router's (kvroute-index's `tiers`).

use std::collections::HashSet;

use kvroute_index::BlockSetDigest;
use kvroute_proto::{Digest, Dump, KvEvent, Stored, Tier, kv_event};

#[derive(Default)]
pub(crate) struct RouterView {
    /// Engine block hashes held, by tier: device, offload.
    held: [HashSet<u64>; 2],
    /// Of both tiers.
    digest: BlockSetDigest,
    last_event_id: u64,
    /// Events applied since the last digest was taken.
    since_digest: u64,
}

impl RouterView {
    /// The router's state after `dump`: exactly its blocks.
    pub fn reset(&mut self, dump: &Dump) {
        self.held = Default::default();
        self.digest = BlockSetDigest::default();
        for chain in &dump.chains {
            self.store(0, chain);
        }
        for chain in &dump.offload_chains {
            self.store(1, chain);
        }
        self.last_event_id = dump.last_event_id;
    }

    /// Applies the events not applied yet (ids past the last one), in order.
    pub fn apply(&mut self, events: &[KvEvent]) {
        for event in events {
            if event.event_id <= self.last_event_id {
                continue;
            }
            self.last_event_id = event.event_id;
            self.since_digest += 1;
            let tier = match event.tier() {
                Tier::Device => 0,
                Tier::Offload => 1,
            };
            match &event.kind {
                Some(kv_event::Kind::Stored(stored)) => self.store(tier, stored),
                Some(kv_event::Kind::Removed(removed)) => {
                    for hash in &removed.block_hashes {
                        if self.held[tier].remove(hash) {
                            self.digest.remove(*hash);
                        }
                    }
                }
                Some(kv_event::Kind::Cleared(_)) => {
                    self.held = Default::default();
                    self.digest = BlockSetDigest::default();
                }
                None => {}
            }
        }
    }

    /// Events applied since the last [`Self::take_digest`].
    pub fn since_digest(&self) -> u64 {
        self.since_digest
    }

    /// The digest of rank 0 as of the last event applied.
    pub fn take_digest(&mut self) -> Digest {
        self.since_digest = 0;
        Digest {
            dp_rank: 0,
            last_event_id: self.last_event_id,
            block_count: self.digest.block_count,
            block_set_hash: self.digest.block_set_hash,
        }
    }

    fn store(&mut self, tier: usize, stored: &Stored) {
        let held = &mut self.held[tier];
        if stored.parent_hash.is_some_and(|p| !held.contains(&p)) {
            return;
        }
        for block in &stored.blocks {
            if held.insert(block.block_hash) {
                self.digest.insert(block.block_hash);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use kvroute_proto::{Cleared, Removed};

    use super::*;
    use crate::events::stored;

    fn event(event_id: u64, kind: kv_event::Kind) -> KvEvent {
        KvEvent {
            event_id,
            kind: Some(kind),
            tier: Tier::Device.into(),
        }
    }

    #[test]
    fn each_tier_is_its_own_set_and_the_digest_sums_both() {
        let mut view = RouterView::default();
        let offload = |e: KvEvent| KvEvent {
            tier: Tier::Offload.into(),
            ..e
        };
        view.reset(&Dump {
            dp_rank: 0,
            last_event_id: 2,
            chains: vec![stored(None, 1, 10)],
            more: false,
            offload_chains: vec![stored(None, 1, 10), stored(Some(1), 2, 20)],
        });
        view.apply(&[
            // Its parent (3) is held on no tier: refused.
            offload(event(3, kv_event::Kind::Stored(stored(Some(3), 4, 40)))),
            offload(event(
                4,
                kv_event::Kind::Removed(Removed {
                    block_hashes: vec![2],
                }),
            )),
            event(5, kv_event::Kind::Stored(stored(Some(1), 2, 20))),
        ]);
        let digest = view.take_digest();
        let expected = BlockSetDigest::of([1, 2]).plus(BlockSetDigest::of([1]));
        assert_eq!(
            (digest.block_count, digest.block_set_hash),
            (expected.block_count, expected.block_set_hash)
        );
        view.apply(&[offload(event(6, kv_event::Kind::Cleared(Cleared {})))]);
        assert_eq!(view.take_digest().block_count, 0);
    }

    #[test]
    fn the_view_follows_the_dump_then_the_events_by_the_protocols_rules() {
        let mut view = RouterView::default();
        view.reset(&Dump {
            dp_rank: 0,
            last_event_id: 4,
            chains: vec![stored(None, 1, 10), stored(Some(1), 2, 20)],
            more: false,
            offload_chains: Vec::new(),
        });
        view.apply(&[
            // Already covered by the dump: skipped.
            event(4, kv_event::Kind::Stored(stored(None, 99, 990))),
            event(5, kv_event::Kind::Stored(stored(Some(2), 3, 30))),
            // Its parent is not held: refused, as the router refuses it.
            event(6, kv_event::Kind::Stored(stored(Some(7), 8, 80))),
            event(
                7,
                kv_event::Kind::Removed(Removed {
                    block_hashes: vec![1, 5],
                }),
            ),
        ]);
        let digest = view.take_digest();
        let expected = BlockSetDigest::of([2, 3]);
        assert_eq!(digest.last_event_id, 7);
        assert_eq!(
            (digest.block_count, digest.block_set_hash),
            (expected.block_count, expected.block_set_hash)
        );
        assert_eq!(view.since_digest(), 0);
        view.apply(&[event(8, kv_event::Kind::Cleared(Cleared {}))]);
        assert_eq!(view.since_digest(), 1);
        assert_eq!(view.take_digest().block_count, 0);
    }
}

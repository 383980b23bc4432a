//! The seam through which router replicas share their load (`[cluster]` with
//! `share_load`): each replica's bookings per rank, and its route-time
//! predictions.
//!
//! A booking is the load a replica's own requests put on a rank
//! ([`crate::fleet::booking`]). With several replicas, each one books only what it
//! routed, so each alone would see a rank as idle while its siblings fill it.
//! Every replica therefore scores a rank on the sum of all replicas' bookings
//! ([`RankLoad`] in [`crate::fleet::Rank::remote`], set by the cluster's
//! transport) blended with what the rank reports, as with one router.
//!
//! Predictions are shared for the same reason: a request's siblings (the next
//! turns of a conversation, requests sharing a system prompt) arriving at
//! another replica land where the first one went, before its events arrive.
//!
//! This module knows nothing of NATS: it tracks what changed and takes in what
//! the other replicas said; `kvroute-cluster` carries it.

use std::sync::Arc;

use kvroute_index::WorkerKey;
use serde::{Deserialize, Serialize};

use crate::fleet::{Fleet, Registry};

/// One replica's bookings on one rank, or the sum of several replicas'.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankLoad {
    pub requests: u64,
    pub prefill_tokens: u64,
    pub blocks: u64,
}

impl RankLoad {
    pub fn is_zero(&self) -> bool {
        *self == RankLoad::default()
    }

    pub fn add(&mut self, other: &RankLoad) {
        self.requests += other.requests;
        self.prefill_tokens += other.prefill_tokens;
        self.blocks += other.blocks;
    }
}

/// A prediction this replica recorded, for the others to record too.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedPrediction {
    pub worker_id: u64,
    pub dp_rank: u32,
    /// How long it holds, in milliseconds, as this replica recorded it.
    pub ttl_ms: u64,
    pub local_hashes: Vec<u64>,
}

impl Registry {
    /// From now on, remembers which ranks' bookings change and signals
    /// [`Registry::bookings_changed`].
    pub fn share_bookings(&self) {
        self.lock()
            .changed_bookings
            .get_or_insert_with(Default::default);
    }

    /// Under the fleet lock, after a booking of `key` changed.
    pub(crate) fn note_booking(&self, fleet: &mut Fleet, key: WorkerKey) {
        if let Some(changed) = fleet.changed_bookings.as_mut() {
            changed.insert(key);
            self.bookings_changed.notify_one();
        }
    }

    /// This replica's bookings of the ranks changed since the last call (zero
    /// for a rank gone or released).
    pub fn take_changed_bookings(&self) -> Vec<(WorkerKey, RankLoad)> {
        let mut fleet = self.lock();
        let Some(changed) = fleet.changed_bookings.as_mut() else {
            return Vec::new();
        };
        let keys = std::mem::take(changed);
        keys.into_iter()
            .map(|key| (key, own(&fleet, key)))
            .collect()
    }

    /// This replica's bookings of every rank that has any.
    pub fn own_bookings(&self) -> Vec<(WorkerKey, RankLoad)> {
        let fleet = self.lock();
        fleet
            .ranks
            .keys()
            .map(|&key| (key, own(&fleet, key)))
            .filter(|(_, load)| !load.is_zero())
            .collect()
    }

    /// Sets the other replicas' bookings of `key`, summed; nothing if the rank
    /// is not registered here (yet: their next full state tells it again).
    pub fn set_remote_bookings(self: &Arc<Self>, key: WorkerKey, load: RankLoad) {
        let mut fleet = self.lock();
        let Some(rank) = fleet.ranks.get_mut(&key) else {
            return;
        };
        if rank.remote == load {
            return;
        }
        let released = load.requests < rank.remote.requests || load.blocks < rank.remote.blocks;
        fleet.update_rank(key, &self.limits, |rank| rank.remote = load);
        drop(fleet);
        if released {
            self.released.notify_waiters();
        }
    }
}

fn own(fleet: &Fleet, key: WorkerKey) -> RankLoad {
    fleet
        .ranks
        .get(&key)
        .map_or_else(RankLoad::default, |rank| RankLoad {
            requests: rank.booked_requests as u64,
            prefill_tokens: rank.booked_prefill_tokens,
            blocks: rank.booked_blocks,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::Source;
    use crate::fleet::tests::{limits, reg};

    #[test]
    fn changes_are_tracked_only_when_shared_and_remote_load_counts_in_scoring() {
        let registry = Arc::new(Registry::new(limits()));
        for id in 1..=2 {
            registry.register(reg(id, &["m"]), Source::Stream).unwrap();
        }
        let one = WorkerKey::new(1, 0);
        let two = WorkerKey::new(2, 0);
        drop(registry.book(one, 64, 4));
        assert!(registry.take_changed_bookings().is_empty());

        registry.share_bookings();
        let booking = registry.book(one, 64, 4);
        let own = RankLoad {
            requests: 1,
            prefill_tokens: 64,
            blocks: 4,
        };
        assert_eq!(registry.take_changed_bookings(), vec![(one, own)]);
        assert_eq!(registry.own_bookings(), vec![(one, own)]);
        drop(booking);
        assert_eq!(
            registry.take_changed_bookings(),
            vec![(one, RankLoad::default())]
        );
        assert!(registry.own_bookings().is_empty());

        // Another replica's bookings make rank 2 the busier one here.
        let remote = RankLoad {
            requests: 3,
            prefill_tokens: 0,
            blocks: 40,
        };
        registry.set_remote_bookings(two, remote);
        let _booking = registry.book(one, 0, 1);
        let fleet = registry.lock();
        assert_eq!(fleet.ranks[&two].inflight(), 3);
        assert_eq!(fleet.ranks[&two].active_blocks(), 40);
        let cheapest = fleet
            .groups
            .get(crate::config::Role::Aggregated, "m")
            .unwrap()
            .by_load
            .iter()
            .next()
            .unwrap()
            .1;
        assert_eq!(cheapest, one);
        // Remote load is not this replica's own: it is never sent back.
        drop(fleet);
        assert_eq!(registry.own_bookings().len(), 1);
    }
}

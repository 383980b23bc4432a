//! The numbered event log a worker publishes to the router.
//!
//! Pool events get consecutive ids starting at 1 (the first is always
//! `Cleared`); a restart starts them over, which is how the router recognises
//! one. The most recent events stay in a bounded ring so a resync request
//! (`from_event_id`) can be answered with the events themselves; when they have
//! already left the ring the worker sends a full dump instead.

use std::collections::VecDeque;

use kvroute_proto::{Cleared, KvEvent, Removed, Stored, StoredBlock, Tier, kv_event};

use crate::pool::PoolEvent;

/// Events kept for resyncs by default.
pub const DEFAULT_RING_EVENTS: usize = 65_536;

pub struct EventLog {
    ring: VecDeque<KvEvent>,
    capacity: usize,
    next_id: u64,
}

impl EventLog {
    pub fn new(capacity: usize) -> Self {
        EventLog {
            ring: VecDeque::new(),
            capacity: capacity.max(1),
            next_id: 1,
        }
    }

    /// Ids start over at 1 (an engine restart).
    pub fn restart(&mut self) {
        self.ring.clear();
        self.next_id = 1;
    }

    /// The id of the last event appended; 0 before any.
    pub fn last_id(&self) -> u64 {
        self.next_id - 1
    }

    /// Appends a pool event; the host tier's go on the offload tier, in the
    /// same id sequence.
    pub fn append(&mut self, event: PoolEvent) {
        let removed = |hash| {
            kv_event::Kind::Removed(Removed {
                block_hashes: vec![hash],
            })
        };
        let (tier, kind) = match event {
            PoolEvent::Stored {
                parent,
                hash,
                local,
            } => (
                Tier::Device,
                kv_event::Kind::Stored(stored(parent, hash, local)),
            ),
            PoolEvent::Removed { hash } => (Tier::Device, removed(hash)),
            PoolEvent::Cleared => (Tier::Device, kv_event::Kind::Cleared(Cleared {})),
            PoolEvent::HostStored {
                parent,
                hash,
                local,
            } => (
                Tier::Offload,
                kv_event::Kind::Stored(stored(parent, hash, local)),
            ),
            PoolEvent::HostRemoved { hash } => (Tier::Offload, removed(hash)),
        };
        self.ring.push_back(KvEvent {
            event_id: self.next_id,
            kind: Some(kind),
            tier: tier.into(),
        });
        self.next_id += 1;
        if self.ring.len() > self.capacity {
            self.ring.pop_front();
        }
    }

    /// Events from id `from` on; `None` when some of them have left the ring.
    pub fn since(&self, from: u64) -> Option<Vec<KvEvent>> {
        let first = self.ring.front().map_or(self.next_id, |e| e.event_id);
        if from < first {
            return None;
        }
        let skip = (from - first) as usize;
        Some(self.ring.iter().skip(skip).cloned().collect())
    }
}

/// A `Stored` message of one block.
pub fn stored(parent: Option<u64>, hash: u64, local: u64) -> Stored {
    Stored {
        parent_hash: parent,
        blocks: vec![StoredBlock {
            block_hash: hash,
            tokens_hash: local,
        }],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_consecutive_the_ring_is_bounded_and_restart_starts_over() {
        let mut log = EventLog::new(3);
        assert_eq!(log.last_id(), 0);
        log.append(PoolEvent::Cleared);
        for hash in 0..4 {
            log.append(PoolEvent::Removed { hash });
        }
        assert_eq!(log.last_id(), 5);
        let ids = |events: Vec<KvEvent>| events.iter().map(|e| e.event_id).collect::<Vec<_>>();
        assert_eq!(ids(log.since(3).unwrap()), [3, 4, 5]);
        assert_eq!(ids(log.since(5).unwrap()), [5]);
        assert_eq!(ids(log.since(6).unwrap()), Vec::<u64>::new());
        assert!(log.since(2).is_none(), "event 2 has left the ring");
        log.restart();
        log.append(PoolEvent::Cleared);
        assert_eq!(ids(log.since(1).unwrap()), [1]);
    }
}

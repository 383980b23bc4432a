//! LFU: evict the least frequently used block, ties to the oldest insertion.
//!
//! Frequency buckets with per-bucket queues (the classic O(1) LFU) would order
//! ties by when a block reached its count, but the rule here orders them by
//! insertion, which hits do not refresh. So resident blocks are kept in an
//! ordered set keyed by `(count, insertion number)`: O(log n) per access, and
//! the first key is always the victim.

use std::collections::BTreeSet;

use rustc_hash::FxHashMap;

use crate::{Access, BlockCache, BlockId, CacheError, check_capacity};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Rank {
    count: u64,
    inserted: u64,
}

/// Least frequently used: a hit adds 1 to the block's count; a miss evicts
/// first if full (lowest count, ties to the oldest insertion), then inserts the
/// block with count 1. A count is forgotten on eviction.
#[derive(Debug)]
pub struct Lfu {
    capacity: usize,
    insertions: u64,
    ranks: FxHashMap<BlockId, Rank>,
    order: BTreeSet<(Rank, BlockId)>,
}

impl Lfu {
    pub fn new(capacity: usize) -> Result<Self, CacheError> {
        check_capacity(capacity)?;
        Ok(Lfu {
            capacity,
            insertions: 0,
            ranks: FxHashMap::default(),
            order: BTreeSet::new(),
        })
    }
}

impl BlockCache for Lfu {
    fn access(&mut self, block: BlockId, evicted: &mut Vec<BlockId>) -> Access {
        if let Some(rank) = self.ranks.get_mut(&block) {
            self.order.remove(&(*rank, block));
            rank.count += 1;
            self.order.insert((*rank, block));
            return Access::Hit;
        }
        if self.ranks.len() >= self.capacity
            && let Some(victim) = self.evict_one()
        {
            evicted.push(victim);
        }
        let rank = Rank {
            count: 1,
            inserted: self.insertions,
        };
        self.insertions += 1;
        self.ranks.insert(block, rank);
        self.order.insert((rank, block));
        Access::Miss
    }

    fn contains(&self, block: BlockId) -> bool {
        self.ranks.contains_key(&block)
    }

    fn remove(&mut self, block: BlockId) -> bool {
        match self.ranks.remove(&block) {
            Some(rank) => self.order.remove(&(rank, block)),
            None => false,
        }
    }

    fn evict_one(&mut self) -> Option<BlockId> {
        let (_, victim) = self.order.pop_first()?;
        self.ranks.remove(&victim);
        Some(victim)
    }

    fn len(&self) -> usize {
        self.ranks.len()
    }

    fn capacity(&self) -> Option<usize> {
        Some(self.capacity)
    }
}

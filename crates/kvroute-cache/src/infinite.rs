//! The infinite-capacity bound: every block, once seen, stays resident.

use rustc_hash::FxHashSet;

use crate::{Access, BlockCache, BlockId};

/// Never evicts, so its hits are the most any policy can get on a trace. A
/// bound, not a policy: its capacity is unlimited.
#[derive(Debug, Default)]
pub struct Infinite {
    resident: FxHashSet<BlockId>,
}

impl BlockCache for Infinite {
    fn access(&mut self, block: BlockId, _evicted: &mut Vec<BlockId>) -> Access {
        if self.resident.insert(block) {
            Access::Miss
        } else {
            Access::Hit
        }
    }

    fn contains(&self, block: BlockId) -> bool {
        self.resident.contains(&block)
    }

    fn remove(&mut self, block: BlockId) -> bool {
        self.resident.remove(&block)
    }

    /// Nothing is ever pushed out: an unlimited pool never needs room.
    fn evict_one(&mut self) -> Option<BlockId> {
        None
    }

    fn len(&self) -> usize {
        self.resident.len()
    }

    fn capacity(&self) -> Option<usize> {
        None
    }
}

//! A radix-tree prefix cache evicted like SGLang's: least recently used leaf
//! first, never a node a running request holds.
//!
//! Blocks form a tree (each names its parent, the block before it in its
//! prompt). SGLang's rules, at block granularity:
//! - only a *leaf* (no resident child) is ever evicted, so a chain loses its
//!   tail before its root and a stored prefix never has holes;
//! - a *locked* block (lock references from the running requests that hold it)
//!   is never evicted;
//! - touching a block touches its whole path, the root last, so the root of a
//!   chain is its most recent block.
//!
//! One recency list holds every resident block, locked or not, oldest first.
//! The list keeps one invariant: **a block is older than its parent**. Touches
//! walk from the block to the root, and a new block is placed just below its
//! parent (it takes the parent's recency), so the invariant always holds. It
//! is what makes eviction one forward scan: the children of a block are met
//! before it, so by the time the scan reaches a block, whether it has children
//! is settled for the rest of the scan; a block skipped as a non-leaf can never
//! become a leaf behind the scan. [`RadixLru::evict`] therefore evicts M blocks
//! past K skipped ones (locked, or parents of locked ones) in one pass that
//! resumes after each victim: M + K visits, where restarting from the oldest
//! block after each victim would cost up to M × K.

use rustc_hash::FxHashMap;

use crate::BlockId;

const NIL: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
struct Node {
    block: BlockId,
    /// Slot of the resident parent, or `NIL` for a root.
    parent: u32,
    /// Toward the newest end and toward the oldest end.
    newer: u32,
    older: u32,
    /// Resident children.
    children: u32,
    locks: u32,
}

/// The SGLang-like cache structure: blocks in a tree with lock references, in
/// one recency list. Capacity is the caller's: it decides when to [`evict`].
///
/// [`evict`]: RadixLru::evict
#[derive(Debug)]
pub struct RadixLru {
    nodes: Vec<Node>,
    free: Vec<u32>,
    map: FxHashMap<BlockId, u32>,
    oldest: u32,
    newest: u32,
    visited: u64,
}

impl Default for RadixLru {
    fn default() -> Self {
        RadixLru {
            nodes: Vec::new(),
            free: Vec::new(),
            map: FxHashMap::default(),
            oldest: NIL,
            newest: NIL,
            visited: 0,
        }
    }
}

impl RadixLru {
    pub fn new() -> Self {
        Self::default()
    }

    /// Resident blocks, locked or not.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn contains(&self, block: BlockId) -> bool {
        self.map.contains_key(&block)
    }

    /// Lock references on `block`; `None` when it is not resident.
    pub fn locks(&self, block: BlockId) -> Option<u32> {
        self.map
            .get(&block)
            .map(|&slot| self.nodes[slot as usize].locks)
    }

    /// Blocks the eviction scans have visited in total (victims and skipped
    /// ones), for tests of the scan's cost.
    pub fn visited(&self) -> u64 {
        self.visited
    }

    /// Stores `block`, unlocked, under `parent` (a root when `parent` is `None`
    /// or not resident), just below its parent in recency. False, and nothing
    /// changes, when it is already resident.
    pub fn insert(&mut self, block: BlockId, parent: Option<BlockId>) -> bool {
        if self.map.contains_key(&block) {
            return false;
        }
        let parent = parent
            .and_then(|p| self.map.get(&p).copied())
            .unwrap_or(NIL);
        let node = Node {
            block,
            parent,
            newer: NIL,
            older: NIL,
            children: 0,
            locks: 0,
        };
        let slot = match self.free.pop() {
            Some(slot) => {
                self.nodes[slot as usize] = node;
                slot
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() as u32 - 1
            }
        };
        self.map.insert(block, slot);
        if parent == NIL {
            self.link_newest(slot);
        } else {
            self.nodes[parent as usize].children += 1;
            self.link_below(slot, parent);
        }
        true
    }

    /// Adds a lock reference (a running request holds the block). False when
    /// the block is not resident.
    pub fn lock(&mut self, block: BlockId) -> bool {
        match self.map.get(&block) {
            Some(&slot) => {
                self.nodes[slot as usize].locks += 1;
                true
            }
            None => false,
        }
    }

    /// Drops a lock reference. False when the block is not resident or not locked.
    pub fn unlock(&mut self, block: BlockId) -> bool {
        match self.map.get(&block) {
            Some(&slot) if self.nodes[slot as usize].locks > 0 => {
                self.nodes[slot as usize].locks -= 1;
                true
            }
            _ => false,
        }
    }

    /// Makes `block` and every ancestor the most recent blocks, the root most
    /// recent of all. No-op when `block` is not resident.
    pub fn touch(&mut self, block: BlockId) {
        let mut at = self.map.get(&block).copied().unwrap_or(NIL);
        while at != NIL {
            self.unlink(at);
            self.link_newest(at);
            at = self.nodes[at as usize].parent;
        }
    }

    /// Takes a leaf out without counting an eviction (a block whose compute
    /// never finished). False when it is not resident or has children.
    pub fn remove(&mut self, block: BlockId) -> bool {
        match self.map.get(&block) {
            Some(&slot) if self.nodes[slot as usize].children == 0 => {
                self.forget(slot);
                true
            }
            _ => false,
        }
    }

    /// Evicts up to `count` blocks, each the least recent unlocked leaf at the
    /// time, in one scan from the oldest block; appends them to `evicted` in
    /// eviction order and returns how many were evicted (fewer when every
    /// remaining block is locked or holds a locked one).
    pub fn evict(&mut self, count: usize, evicted: &mut Vec<BlockId>) -> usize {
        let mut done = 0;
        let mut at = self.oldest;
        while done < count && at != NIL {
            self.visited += 1;
            let node = self.nodes[at as usize];
            if node.locks == 0 && node.children == 0 {
                // The parent, now perhaps a leaf, is newer: the scan meets it.
                evicted.push(node.block);
                self.forget(at);
                done += 1;
            }
            at = node.newer;
        }
        done
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        let visited = self.visited;
        *self = RadixLru {
            visited,
            ..Self::default()
        };
    }

    fn forget(&mut self, slot: u32) {
        let node = self.nodes[slot as usize];
        self.unlink(slot);
        if node.parent != NIL {
            self.nodes[node.parent as usize].children -= 1;
        }
        self.map.remove(&node.block);
        self.free.push(slot);
    }

    fn unlink(&mut self, slot: u32) {
        let Node { newer, older, .. } = self.nodes[slot as usize];
        match newer {
            NIL => self.newest = older,
            n => self.nodes[n as usize].older = older,
        }
        match older {
            NIL => self.oldest = newer,
            o => self.nodes[o as usize].newer = newer,
        }
    }

    fn link_newest(&mut self, slot: u32) {
        let old_newest = self.newest;
        let node = &mut self.nodes[slot as usize];
        node.newer = NIL;
        node.older = old_newest;
        match old_newest {
            NIL => self.oldest = slot,
            n => self.nodes[n as usize].newer = slot,
        }
        self.newest = slot;
    }

    /// Links `slot` just older than `above`.
    fn link_below(&mut self, slot: u32, above: u32) {
        let below = self.nodes[above as usize].older;
        let node = &mut self.nodes[slot as usize];
        node.newer = above;
        node.older = below;
        self.nodes[above as usize].older = slot;
        match below {
            NIL => self.oldest = slot,
            b => self.nodes[b as usize].newer = slot,
        }
    }

    /// Resident blocks, oldest first (tests).
    #[cfg(test)]
    fn order(&self) -> Vec<BlockId> {
        let mut out = Vec::new();
        let mut at = self.oldest;
        while at != NIL {
            out.push(self.nodes[at as usize].block);
            at = self.nodes[at as usize].newer;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(lru: &mut RadixLru, blocks: &[BlockId]) {
        let mut parent = None;
        for &block in blocks {
            lru.insert(block, parent);
            parent = Some(block);
        }
    }

    fn evict(lru: &mut RadixLru, count: usize) -> Vec<BlockId> {
        let mut out = Vec::new();
        lru.evict(count, &mut out);
        out
    }

    #[test]
    fn a_chain_is_evicted_tail_first_and_a_touch_makes_the_root_newest() {
        let mut lru = RadixLru::new();
        chain(&mut lru, &[1, 2, 3]);
        lru.insert(9, None);
        // A new block sits just below its parent: 3 < 2 < 1, then 9.
        assert_eq!(lru.order(), [3, 2, 1, 9]);
        lru.touch(2);
        assert_eq!(lru.order(), [3, 9, 2, 1]);
        assert_eq!(evict(&mut lru, 2), [3, 9]);
        assert_eq!(evict(&mut lru, 5), [2, 1]);
        assert!(lru.is_empty());
    }

    #[test]
    fn locked_blocks_and_their_ancestors_stay() {
        let mut lru = RadixLru::new();
        chain(&mut lru, &[1, 2, 3]);
        chain(&mut lru, &[7, 8]);
        lru.lock(3);
        // 3 is locked, so 2 and 1 are not leaves; 8 then 7 go.
        assert_eq!(evict(&mut lru, 10), [8, 7]);
        assert!(!lru.remove(2), "a block with children is not removed");
        lru.unlock(3);
        assert!(!lru.unlock(3), "not locked any more");
        assert_eq!(evict(&mut lru, 10), [3, 2, 1]);
    }

    #[test]
    fn remove_takes_out_a_leaf_and_its_parent_becomes_one() {
        let mut lru = RadixLru::new();
        chain(&mut lru, &[1, 2]);
        assert!(lru.remove(2));
        assert!(!lru.contains(2));
        assert_eq!(evict(&mut lru, 1), [1]);
    }
}

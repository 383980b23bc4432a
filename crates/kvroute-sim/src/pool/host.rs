//! The host tier: blocks an engine keeps in CPU memory after its GPU pool
//! evicted them, and loads back instead of recomputing (vLLM's CPU offloading).
//!
//! A block the GPU pool evicts is copied here, with those of its ancestors not
//! here yet (they are still on the GPU, or here already: a block is evicted
//! from the GPU only while its chain is reachable, else it is not worth a
//! copy). So the tier is *prefix-closed*: every block's parent is here too, and
//! the router's offload-tier index, which refuses a chain whose parent it does
//! not hold, sees every block the tier announces.
//!
//! Eviction is LRU over leaves: a use touches a block and all its ancestors,
//! the ancestors last, so a parent is always more recent than its children and
//! the least recently used block is a leaf. Evicting it keeps the tier
//! prefix-closed. Announced as `Stored` / `Removed` on the offload tier.

use std::collections::{BTreeMap, HashMap};

use crate::pool::{BlockKey, PoolEvent};

struct HostBlock {
    parent: Option<u64>,
    local: u64,
    depth: u32,
    children: u32,
    /// Its key in `order`.
    stamp: u64,
}

pub struct HostTier {
    capacity: usize,
    blocks: HashMap<u64, HostBlock>,
    /// Blocks by last use, oldest first.
    order: BTreeMap<u64, u64>,
    clock: u64,
}

/// One block of a chain to copy in, root first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Copied {
    pub parent: Option<u64>,
    pub hash: u64,
    pub local: u64,
    pub depth: u32,
}

impl HostTier {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            blocks: HashMap::new(),
            order: BTreeMap::new(),
            clock: 0,
        }
    }

    /// Whether the engine has a host tier at all.
    pub fn enabled(&self) -> bool {
        self.capacity > 0
    }

    pub fn contains(&self, hash: u64) -> bool {
        self.blocks.contains_key(&hash)
    }

    /// How many of `blocks` from `from` on are here, contiguously.
    pub fn continues(&self, blocks: &[BlockKey], from: usize) -> usize {
        blocks[from.min(blocks.len())..]
            .iter()
            .take_while(|b| self.contains(b.hash))
            .count()
    }

    /// Copies in `chain` (root first: each block's parent is the block before
    /// it, the first one's is here or none), touches it, and evicts leaves over
    /// the capacity; pushes the offload tier's events.
    pub fn copy_in(&mut self, chain: &[Copied], events: &mut Vec<PoolEvent>) {
        if !self.enabled() || chain.is_empty() {
            return;
        }
        for block in chain {
            if self.blocks.contains_key(&block.hash) {
                continue;
            }
            if let Some(parent) = block.parent.and_then(|p| self.blocks.get_mut(&p)) {
                parent.children += 1;
            }
            self.blocks.insert(
                block.hash,
                HostBlock {
                    parent: block.parent,
                    local: block.local,
                    depth: block.depth,
                    children: 0,
                    stamp: 0,
                },
            );
            events.push(PoolEvent::HostStored {
                parent: block.parent,
                hash: block.hash,
                local: block.local,
            });
        }
        let last = chain.last().expect("not empty").hash;
        self.touch(last);
        while self.blocks.len() > self.capacity {
            let (_, victim) = self.order.pop_first().expect("over capacity: not empty");
            let gone = self
                .blocks
                .remove(&victim)
                .expect("ordered blocks are held");
            debug_assert_eq!(gone.children, 0, "the oldest block is a leaf");
            if let Some(parent) = gone.parent.and_then(|p| self.blocks.get_mut(&p)) {
                parent.children -= 1;
            }
            events.push(PoolEvent::HostRemoved { hash: victim });
        }
    }

    /// Uses `hash` and its ancestors, the ancestors last (more recent).
    pub fn touch(&mut self, hash: u64) {
        let mut at = Some(hash);
        while let Some(hash) = at {
            let Some(block) = self.blocks.get_mut(&hash) else {
                return;
            };
            self.order.remove(&block.stamp);
            self.clock += 1;
            block.stamp = self.clock;
            self.order.insert(self.clock, hash);
            at = block.parent;
        }
    }

    /// Forgets everything (an engine restart; `Cleared` covers both tiers).
    pub fn clear(&mut self) {
        self.blocks.clear();
        self.order.clear();
    }

    /// Every block, parents first, as the offload tier's `Stored` events.
    pub fn dump(&self) -> Vec<PoolEvent> {
        let mut blocks: Vec<(&u64, &HostBlock)> = self.blocks.iter().collect();
        blocks.sort_by_key(|(hash, b)| (b.depth, **hash));
        blocks
            .into_iter()
            .map(|(&hash, b)| PoolEvent::HostStored {
                parent: b.parent,
                hash,
                local: b.local,
            })
            .collect()
    }

    /// Asserts the tier's invariants (tests only).
    #[cfg(test)]
    pub fn check(&self) {
        assert!(self.blocks.len() <= self.capacity);
        assert_eq!(self.order.len(), self.blocks.len());
        for (hash, block) in &self.blocks {
            assert_eq!(self.order.get(&block.stamp), Some(hash));
            let children = self
                .blocks
                .values()
                .filter(|b| b.parent == Some(*hash))
                .count();
            assert_eq!(block.children as usize, children);
            if let Some(parent) = block.parent {
                let parent = self.blocks.get(&parent).expect("prefix-closed");
                assert!(
                    parent.stamp > block.stamp,
                    "a parent is used after its children"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    /// The specification, from scratch: a set of blocks with a last-use time
    /// each; using a block uses its whole path at once; over the capacity the
    /// least recently used block with no child in the set goes.
    #[derive(Default)]
    struct Reference {
        used: HashMap<u64, (Option<u64>, u64)>,
        time: u64,
    }

    impl Reference {
        fn copy_in(&mut self, chain: &[Copied], capacity: usize) -> Vec<u64> {
            if capacity == 0 || chain.is_empty() {
                return Vec::new();
            }
            self.time += 1;
            let t = self.time;
            for b in chain {
                self.used.entry(b.hash).or_insert((b.parent, 0));
            }
            let mut at = Some(chain.last().unwrap().hash);
            while let Some(h) = at {
                let entry = self.used.get_mut(&h).unwrap();
                entry.1 = t;
                at = entry.0;
            }
            let mut evicted = Vec::new();
            while self.used.len() > capacity {
                let leaves = self
                    .used
                    .iter()
                    .filter(|(h, _)| !self.used.values().any(|(p, _)| *p == Some(**h)));
                let (&victim, _) = leaves.min_by_key(|(_, (_, t))| *t).unwrap();
                self.used.remove(&victim);
                evicted.push(victim);
            }
            evicted
        }
    }

    /// A random tree of blocks: block `i`'s parent is some block below `i`, or none.
    fn chain_to(parents: &[Option<usize>], leaf: usize) -> Vec<Copied> {
        let mut path = vec![leaf];
        while let Some(p) = parents[*path.last().unwrap()] {
            path.push(p);
        }
        path.reverse();
        path.iter()
            .enumerate()
            .map(|(depth, &i)| Copied {
                parent: parents[i].map(|p| p as u64),
                hash: i as u64,
                local: 100 + i as u64,
                depth: depth as u32,
            })
            .collect()
    }

    proptest! {
        #[test]
        fn evicts_the_least_recently_used_leaf_as_the_reference_does(
            capacity in 0usize..8,
            links in prop::collection::vec(any::<prop::sample::Index>(), 1..24),
            leaves in prop::collection::vec(any::<prop::sample::Index>(), 1..60),
        ) {
            // Block i's parent: one of the blocks before it, or none for every third.
            let parents: Vec<Option<usize>> = links
                .iter()
                .enumerate()
                .map(|(i, l)| (i > 0 && i % 3 != 0).then(|| l.index(i)))
                .collect();
            let mut tier = HostTier::new(capacity);
            let mut reference = Reference::default();
            for leaf in leaves {
                let mut chain = chain_to(&parents, leaf.index(parents.len()));
                // What is here already is not copied again; the rest continues it.
                let here = chain.iter().take_while(|b| tier.contains(b.hash)).count();
                chain.drain(..here.saturating_sub(1));
                let mut events = Vec::new();
                tier.copy_in(&chain, &mut events);
                let evicted = reference.copy_in(&chain, capacity);
                let removed: Vec<u64> = events
                    .iter()
                    .filter_map(|e| match e {
                        PoolEvent::HostRemoved { hash } => Some(*hash),
                        _ => None,
                    })
                    .collect();
                prop_assert_eq!(removed, evicted);
                tier.check();
                let held: BTreeSet<u64> = tier.blocks.keys().copied().collect();
                let expected: BTreeSet<u64> = reference.used.keys().copied().collect();
                prop_assert_eq!(held, expected);
            }
        }
    }
}

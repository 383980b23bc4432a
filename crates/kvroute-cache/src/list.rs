//! Intrusive doubly linked lists over one slab, addressed by `u32` slot index.
//!
//! LRU, FIFO, S3FIFO and ARC are all "a few queues plus a map from block id to
//! where the block sits". Keeping every node of every queue in one `Vec` (the
//! slab) and linking them by index gives O(1) append, unlink and pop-front with
//! no allocation per access and good locality, and a block moves between queues
//! (S to M, T1 to B1, ...) by relinking its slot instead of copying it.
//!
//! Invariants the owner must keep (the methods rely on them, and do not check):
//! - a slot is in at most one [`List`] at a time, and only linked slots are
//!   unlinked or popped through the list that holds them;
//! - a released slot is in no list and is not used again until `insert` hands
//!   it out anew (freed slots are chained through `next`).

use rustc_hash::FxHashMap;

/// Block id → slot index. Block ids are already hashes or dense ids, so the
/// multiply-rotate Fx hash is enough to spread them and costs almost nothing.
pub(crate) type SlotMap = FxHashMap<u64, u32>;

const NIL: u32 = u32::MAX;

/// One block's slot: its id, its links and two bytes of policy state.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Node {
    pub block: u64,
    prev: u32,
    next: u32,
    /// Which of the owner's queues holds the slot (owner-defined).
    pub queue: u8,
    /// Owner-defined counter (S3FIFO's access count).
    pub count: u8,
}

/// The ends and length of one queue; its nodes live in a [`Slab`].
#[derive(Debug)]
pub(crate) struct List {
    head: u32,
    tail: u32,
    len: usize,
}

impl Default for List {
    fn default() -> Self {
        List {
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }
}

impl List {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The oldest slot (the front), if any.
    pub fn head(&self) -> Option<u32> {
        (self.head != NIL).then_some(self.head)
    }
}

/// Storage for the nodes of any number of lists.
#[derive(Debug, Default)]
pub(crate) struct Slab {
    nodes: Vec<Node>,
    free: Vec<u32>,
}

impl Slab {
    pub fn with_capacity(capacity: usize) -> Self {
        Slab {
            nodes: Vec::with_capacity(capacity),
            free: Vec::new(),
        }
    }

    /// A new unlinked slot holding `block`.
    pub fn insert(&mut self, block: u64, queue: u8, count: u8) -> u32 {
        let node = Node {
            block,
            prev: NIL,
            next: NIL,
            queue,
            count,
        };
        match self.free.pop() {
            Some(slot) => {
                self.nodes[slot as usize] = node;
                slot
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        }
    }

    /// Gives an unlinked slot back for reuse.
    pub fn release(&mut self, slot: u32) {
        self.free.push(slot);
    }

    pub fn get(&self, slot: u32) -> &Node {
        &self.nodes[slot as usize]
    }

    pub fn get_mut(&mut self, slot: u32) -> &mut Node {
        &mut self.nodes[slot as usize]
    }

    /// Links an unlinked slot at the back (newest end) of `list`.
    pub fn push_back(&mut self, list: &mut List, slot: u32) {
        let tail = list.tail;
        {
            let node = &mut self.nodes[slot as usize];
            node.prev = tail;
            node.next = NIL;
        }
        if tail == NIL {
            list.head = slot;
        } else {
            self.nodes[tail as usize].next = slot;
        }
        list.tail = slot;
        list.len += 1;
    }

    /// Takes a slot out of `list`, which must hold it.
    pub fn unlink(&mut self, list: &mut List, slot: u32) {
        let Node { prev, next, .. } = self.nodes[slot as usize];
        if prev == NIL {
            list.head = next;
        } else {
            self.nodes[prev as usize].next = next;
        }
        if next == NIL {
            list.tail = prev;
        } else {
            self.nodes[next as usize].prev = prev;
        }
        list.len -= 1;
    }

    /// Unlinks and returns the front (oldest) slot of `list`.
    pub fn pop_front(&mut self, list: &mut List) -> Option<u32> {
        let head = list.head()?;
        self.unlink(list, head);
        Some(head)
    }

    /// Moves a slot of `list` to its back.
    pub fn move_to_back(&mut self, list: &mut List, slot: u32) {
        if list.tail != slot {
            self.unlink(list, slot);
            self.push_back(list, slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks(slab: &Slab, list: &List) -> Vec<u64> {
        let mut out = Vec::new();
        let mut at = list.head;
        while at != NIL {
            out.push(slab.get(at).block);
            at = slab.get(at).next;
        }
        out
    }

    #[test]
    fn push_unlink_pop_and_reuse_slots() {
        let mut slab = Slab::default();
        let (mut a, mut b) = (List::default(), List::default());
        let s: Vec<u32> = (0..4).map(|i| slab.insert(i, 0, 0)).collect();
        for &slot in &s {
            slab.push_back(&mut a, slot);
        }
        slab.unlink(&mut a, s[1]);
        slab.push_back(&mut b, s[1]);
        slab.move_to_back(&mut a, s[0]);
        assert_eq!(blocks(&slab, &a), [2, 3, 0]);
        assert_eq!(blocks(&slab, &b), [1]);
        assert_eq!(slab.pop_front(&mut a), Some(s[2]));
        slab.release(s[2]);
        assert_eq!(slab.insert(9, 0, 0), s[2], "a released slot is reused");
        assert_eq!(slab.pop_front(&mut b), Some(s[1]));
        assert!(b.is_empty() && b.head().is_none());
        assert_eq!(a.len(), 2);
    }
}

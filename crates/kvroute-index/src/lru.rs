//! Recency order of distinct blocks, for the optional `max_blocks` limit.
//!
//! An intrusive doubly linked list over a slab, newest at the head. Each node
//! counts its children present in the list, stored below it while it was there
//! (so only leaves are evicted, never an ancestor before its descendants), and
//! whether it is pinned (on a path of a request being routed right now, never
//! evicted; the counts of pins are beside the nodes, in a map of the few
//! pinned ones). A child keeps its parent's node, not its key: a removal
//! releases the parent without a probe, and a block removed while it still
//! counts children keeps its node, out of the list, until the last of them
//! goes.
//!
//! The order has no index of its own: a block's node id lives in the block's
//! table entry (see [`crate::table::Entry::lru_node`]), where the index finds
//! the block anyway, so the callers name nodes, not keys. A node id read
//! without this order's lock (a lookup's walk) travels with the block's key,
//! a [`Touch`], and is checked against the node's key when used: the block may
//! have gone and its node been reused meanwhile. The separate key → node map
//! this replaced was a third of the order's bytes, and a probe (at fleet
//! scale a cache miss) per store, removal and touch.
//!
//! Touching a path moves it to the head leaf first and root last, so that within
//! the chain the root-side ancestor is newest and the leaf oldest: a tail-to-head
//! scan meets a chain's leaf before its ancestors. The eviction scan resumes from a
//! cursor after each victim instead of restarting at the tail, so evicting M blocks
//! past K skipped ones (pinned or not leaves) visits M + K nodes. The index's
//! scan moves each skipped block to the head instead (a second chance, see
//! [`Lru::next_victim_where`]), so that the next scans do not meet it again.
//!
//! A lookup's touch is only written down (by the index, outside this order's
//! lock, then handed over with [`Lru::defer`]) and done before the order is
//! next read or changed (the next store, removal or eviction scan): moving a
//! routed prompt's few hundred blocks is a few cache misses each, which the
//! routing decision need not wait for. Done in arrival order before anything
//! else, the deferred touches leave the same order as touching at once. A
//! touch whose block went between the lookup's walk and its hand-over moves
//! nothing (unless the block was stored again into the same node: then it
//! moves, as a touch by key did). The index's recency thread applies them in
//! short slices ([`Lru::apply_some`]) when nothing else does, so a lookup
//! rarely finds too many waiting and has to apply them all itself (64 Ki
//! moves, 3–12 ms).
//!
//! Stores and removals are written down too ([`Change`], by the index's runs
//! of events, which change the block table without this order's lock) and
//! applied in the order they were handed over ([`Lru::apply_changes`]); new
//! blocks' nodes are given out beforehand ([`Lru::give_ids`]). Runs of two
//! threads may hand over in the other order than they changed the table: a
//! block's removal may come before its insertion (the node is marked and
//! freed when the insertion comes), and the eviction scan may take a block
//! whose removal is still to come ([`Lru::await_removal`]).

use std::collections::VecDeque;

use crate::flat::FlatMap;

const NIL: u32 = u32::MAX;

/// Marks (in `older`) the node of a block removed while children it counted
/// remain: out of the list, freed when its last child goes.
const RETIRED: u32 = u32::MAX - 1;

/// Marks (in `older`) a node not in the order: free, or given out to a
/// writer for a block whose insertion ([`Change::Insert`]) is not applied yet.
const FREE: u32 = u32::MAX - 2;

/// Marks (in `older`) a node whose block's removal was applied before its
/// insertion (two writers handed their changes over in the other order):
/// the insertion, when it comes, frees it.
const DOOMED: u32 = u32::MAX - 3;

/// Marks (in `older`) a node the eviction scan took out of the order while
/// its block's removal was not applied yet: that removal frees it.
const EVICTED: u32 = u32::MAX - 4;

/// In [`Node::children`]: the block is pinned (its count is in [`Lru::pins`]).
const PINNED: u32 = 1 << 31;

/// Nodes per chunk of the slab (28 KiB), a power of two.
const CHUNK_BITS: u32 = 10;
const CHUNK: usize = 1 << CHUNK_BITS;

/// Deferred touches kept at most (1 MiB); past it a lookup applies them
/// itself.
pub(crate) const MAX_PENDING: usize = 1 << 16;

/// Deferred touches past which a lookup wakes the recency thread.
pub(crate) const DRAIN_AT: usize = 1 << 13;

/// A block's key and the node the index found it under, to be checked
/// against the node when used.
pub(crate) type Touch = (u64, u32);

/// A change to the order a writer made to the block table without this
/// order's lock, written down in its run and handed over at the run's end
/// ([`Lru::apply_changes`]).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Change {
    /// A stored chain starts under its parent (key and node), if present.
    Start(Option<Touch>),
    /// The chain's next block, new, at a node given out by [`Lru::give_ids`].
    Insert { seq: u64, id: u32, tokens_low: u32 },
    /// The chain's next block, present already.
    Place(Touch),
    /// The chain ended.
    End,
    /// The block at this node went (nobody holds it any more).
    Remove(u32),
    /// Lookups' touches written down before this point: the first this
    /// many of the list handed over with the changes.
    Touches(u32),
}

/// 28 bytes: 4-byte aligned, the key in halves.
#[derive(Clone, Copy)]
struct Node {
    seq: [u32; 2],
    /// The parent's node when this block was inserted, counting it among its
    /// children; `NIL` if it had none in the order. Kept by id, not by block:
    /// a removal releases its parent without probing the index, and a parent
    /// dropped and stored again meanwhile (a new node) is not charged with a
    /// child it never counted.
    parent: u32,
    /// Toward the head (newer) and toward the tail (older); `older` is
    /// [`RETIRED`] once the block is gone but its node still counts children,
    /// [`FREE`] once the node is free.
    newer: u32,
    older: u32,
    /// Children counted, and [`PINNED`]: zero exactly for an evictable block.
    children: u32,
    /// The low half of the block's local hash, whose place in the table entry
    /// holds this node's id.
    tokens_low: u32,
}

impl Node {
    fn seq(&self) -> u64 {
        u64::from(self.seq[0]) | u64::from(self.seq[1]) << 32
    }
}

/// Whether a node's `older` says it is in the list.
#[inline]
fn in_order(older: u32) -> bool {
    !matches!(older, RETIRED | FREE | DOOMED | EVICTED)
}

fn halves(seq: u64) -> [u32; 2] {
    [seq as u32, (seq >> 32) as u32]
}

/// The nodes, by id, in chunks of [`CHUNK`]: it grows a chunk at a time and
/// never moves a node. One vector grown by a quarter copied the whole slab at
/// each step (at 1,024 workers about 12 % of a replay thread's time was that
/// copy and its page faults), and kept an eighth of it empty on average.
/// Chunks of fixed length, so that a node's place in its chunk (a masked id)
/// needs no bounds check.
#[derive(Default)]
struct Slab {
    chunks: Vec<Box<[Node; CHUNK]>>,
    len: u32,
}

impl Slab {
    #[inline]
    fn get(&self, id: u32) -> Option<&Node> {
        (id < self.len).then(|| &self[id])
    }

    /// Adds `n` free nodes (see [`FREE`]); returns their ids. In bulk: one
    /// node at a time, each call reserved and probed the 28 KiB stack frame
    /// a chunk was built in (then copied).
    fn add_free(&mut self, n: usize) -> std::ops::Range<u32> {
        let start = self.len;
        let end = start + u32::try_from(n).expect("fewer than 2^32 nodes");
        while self.chunks.len() * CHUNK < end as usize {
            self.chunks.push(free_chunk());
        }
        self.len = end;
        start..end
    }

    fn heap_bytes(&self) -> usize {
        self.chunks.capacity() * size_of::<usize>() + self.chunks.len() * size_of::<[Node; CHUNK]>()
    }
}

/// A node not in the order (see [`FREE`]).
const FREE_NODE: Node = Node {
    seq: [0, 0],
    parent: NIL,
    newer: NIL,
    older: FREE,
    children: 0,
    tokens_low: 0,
};

/// A chunk of free nodes, built where it stays (not on the stack and
/// copied).
#[cold]
fn free_chunk() -> Box<[Node; CHUNK]> {
    vec![FREE_NODE; CHUNK]
        .into_boxed_slice()
        .try_into()
        .unwrap_or_else(|_| unreachable!("a chunk is CHUNK nodes"))
}

impl std::ops::Index<u32> for Slab {
    type Output = Node;

    /// Checked against `len` (one test that also covers the chunk), not
    /// against the chunks' vector's length as indexing it would. A plain
    /// assert: a message's formatting would be inlined at every index.
    #[inline]
    fn index(&self, id: u32) -> &Node {
        assert!(id < self.len);
        // SAFETY: the chunks hold `len` nodes at least (`add_free` adds the
        // chunks before it raises `len`, and neither ever shrinks).
        let chunk = unsafe { self.chunks.get_unchecked((id >> CHUNK_BITS) as usize) };
        &chunk[id as usize & (CHUNK - 1)]
    }
}

impl std::ops::IndexMut<u32> for Slab {
    #[inline]
    fn index_mut(&mut self, id: u32) -> &mut Node {
        assert!(id < self.len);
        // SAFETY: as in `index`.
        let chunk = unsafe { self.chunks.get_unchecked_mut((id >> CHUNK_BITS) as usize) };
        &mut chunk[id as usize & (CHUNK - 1)]
    }
}

#[derive(Default)]
pub(crate) struct Lru {
    nodes: Slab,
    free: Vec<u32>,
    /// Blocks in the order.
    len: usize,
    /// Pins of each pinned node (by id): few at a time, and the eviction scan
    /// reads only the node's [`PINNED`] bit.
    pins: FlatMap<u64>,
    head: Option<u32>,
    tail: Option<u32>,
    /// Blocks to move to the head, in order: the deferred touches' paths, each
    /// leaf first.
    pending: VecDeque<Touch>,
    /// Nodes given out ([`Self::give_ids`]) whose insertion is still to be
    /// applied and that carry a mark for it: doomed (their block's removal came
    /// first) or pinned. While there are none, a run of inserts need not read
    /// its nodes before writing them (docs/measurements/index-vs-dynamo.md, "Layout choices").
    marked_pending: u32,
    /// Nodes the eviction scan has visited, for the cost-bound test.
    pub visited: u64,
}

/// Where a stored chain's next block goes: right behind the block before it
/// (the first behind the chain's parent, moved to the head), so that the chain
/// ends in the order one touch of its whole path leaves (parent newest, then
/// each block), each block placed once, not inserted at the head and then
/// moved again by the touch.
#[derive(Default)]
pub(crate) struct ChainPlace {
    /// The block placed last; none: the next goes to the head.
    behind: Option<Touch>,
    /// The block placed last went before the next was placed (its engine hash
    /// named another block later in the event): the caller touches the whole
    /// chain, which leaves the order it would have left.
    pub lost: bool,
}

/// Blocks marked gone and still to be unlinked (see [`Lru::forget`]): one,
/// or a piece of neighbours in the order taken out together, each the
/// parent of the one below it.
#[derive(Clone, Copy)]
struct Gone {
    /// The newest's newer neighbour.
    newer: u32,
    /// The oldest's older neighbour.
    older: u32,
    /// The newest's parent.
    parent: u32,
}

/// Blocks an eviction scan met without taking them (skipped or given a
/// second chance, see [`Lru::next_victim_where`]), against a limit, and the
/// first block it moved to the head, where its pass ends.
#[derive(Debug)]
pub(crate) struct Spared {
    met: usize,
    limit: usize,
    fence: Option<Touch>,
    second_chance: bool,
}

impl Spared {
    /// At most `limit` blocks met without taking them, each moved to the
    /// head.
    pub fn second_chance(limit: usize) -> Self {
        Self {
            met: 0,
            limit,
            fence: None,
            second_chance: true,
        }
    }

    /// Blocks met without taking them are skipped in place, with no limit.
    #[cfg(test)]
    pub fn unlimited() -> Self {
        Self {
            met: 0,
            limit: usize::MAX,
            fence: None,
            second_chance: false,
        }
    }

    /// The scan met its limit of blocks it did not take.
    pub fn exhausted(&self) -> bool {
        self.met >= self.limit
    }

    /// A new pass (from the tail): blocks moved before are met again.
    pub fn new_pass(&mut self) {
        self.fence = None;
    }
}

/// Where an eviction scan resumes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Cursor {
    #[default]
    Tail,
    /// At node `id`, which held block `seq` when the cursor was set: a scan
    /// resumed after the lock was let go (a dump's eviction in batches) starts
    /// at the tail again if that node went meanwhile.
    At { id: u32, seq: u64 },
    /// The scan reached the head.
    Done,
}

impl Lru {
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn heap_bytes(&self) -> u64 {
        (self.nodes.heap_bytes()
            + self.free.capacity() * 4
            + self.pending.capacity() * size_of::<Touch>()) as u64
            + self.pins.heap_bytes()
    }

    /// Whether node `id` is in the order holding block `seq`.
    #[inline]
    fn holds(&self, (seq, id): Touch) -> bool {
        self.nodes
            .get(id)
            .is_some_and(|n| in_order(n.older) && n.seq == halves(seq))
    }

    /// Gives out `n` nodes for writers to put new blocks in without this
    /// order's lock: their [`Change::Insert`] links them when applied.
    pub fn give_ids(&mut self, n: usize, out: &mut Vec<u32>) {
        let reused = n.min(self.free.len());
        out.extend(self.free.drain(self.free.len() - reused..).rev());
        out.extend(self.nodes.add_free(n - reused));
    }

    /// Applies changes writers made without this order's lock, in the order
    /// they were handed over, and lookups' touches, each where
    /// [`Change::Touches`] says it was written down among them, leaving both
    /// lists empty.
    pub fn apply_changes(&mut self, changes: &mut Vec<Change>, touches: &mut Vec<Touch>) {
        let mut touched = 0;
        let mut place = ChainPlace::default();
        let mut parent = None;
        // The node of the chain's block the change just before linked: the
        // next block's parent and place, in the order with nothing moved
        // since (see `Self::insert_run_below`).
        let mut linked = None;
        // Where the chain under way starts in `changes`, for its touch when
        // its place was lost.
        let mut chain_start = 0;
        let mut at = 0;
        while let Some(&change) = changes.get(at) {
            match change {
                Change::Start(p) => {
                    chain_start = at;
                    parent = p;
                    place = self.start_chain(p);
                    linked = place.behind.map(|(_, id)| id);
                }
                Change::Insert {
                    seq,
                    id,
                    tokens_low,
                } => {
                    let run = linked.and_then(|prev| self.insert_run_below(prev, &changes[at..]));
                    if let Some((inserted, last)) = run {
                        at += inserted - 1;
                        place.behind = Some(last);
                        linked = Some(last.1);
                        parent = Some(last);
                    } else {
                        let linked_now = self.insert_at(id, seq, tokens_low, parent, &mut place);
                        linked = linked_now.then_some(id);
                        parent = Some((seq, id));
                    }
                }
                Change::Place(touch) => {
                    linked = self.place(&mut place, touch).then_some(touch.1);
                    parent = Some(touch);
                }
                Change::End => {
                    if place.lost {
                        self.touch(changes[chain_start..at].iter().filter_map(|c| match *c {
                            Change::Start(p) => p,
                            Change::Insert { seq, id, .. } => Some((seq, id)),
                            Change::Place(touch) => Some(touch),
                            _ => None,
                        }));
                    }
                    linked = None;
                }
                Change::Remove(_) => {
                    self.apply_pending();
                    at += self.remove_run(&changes[at..]) - 1;
                    linked = None;
                }
                Change::Touches(upto) => {
                    // Done here, not deferred: the next change would do
                    // them first anyway, after a move through the deferred
                    // list.
                    let upto = (upto as usize).max(touched);
                    self.apply_pending();
                    self.touch_in_order(&touches[touched..upto]);
                    touched = upto;
                    linked = None;
                }
            }
            at += 1;
        }
        changes.clear();
        self.defer_from(&touches[touched..]);
        touches.clear();
    }

    /// Starts placing a stored chain whose parent is `parent` (its key and
    /// node), moved to the head if still in the order. Out of line, as the
    /// compiler left it before it called [`Self::move_to_head`]: inlined, it
    /// changed the code of [`crate::index::KvIndex::apply_kind`] around it (a
    /// dump's store calls it there), which both indexes run (docs/measurements/index-vs-dynamo.md, "Layout choices").
    #[inline(never)]
    pub fn start_chain(&mut self, parent: Option<Touch>) -> ChainPlace {
        self.apply_pending();
        let behind = parent.filter(|&p| self.move_to_head(p));
        ChainPlace {
            behind,
            lost: false,
        }
    }

    /// The node a chain's next block goes behind (none: the head).
    #[inline]
    fn chain_anchor(&self, place: &mut ChainPlace) -> Option<u32> {
        let behind = place.behind?;
        if self.holds(behind) {
            Some(behind.1)
        } else {
            place.lost = true;
            None
        }
    }

    /// Adds a new block, a chain's next at `place` (a fresh place: the newest),
    /// under `parent` (its key and node) if that is still in the order; returns
    /// its node, for the block's entry. Out of line: only a caller holding the
    /// order's lock (a dump's build) inserts at once, and inlined it would
    /// weigh on the event path's code, which the unbounded index runs too
    /// (docs/measurements/index-vs-dynamo.md, "Layout choices").
    #[inline(never)]
    pub fn insert(
        &mut self,
        seq: u64,
        tokens_low: u32,
        parent: Option<Touch>,
        place: &mut ChainPlace,
    ) -> u32 {
        let id = match self.free.pop() {
            Some(id) => id,
            None => self.nodes.add_free(1).start,
        };
        self.insert_at(id, seq, tokens_low, parent, place);
        id
    }

    /// [`Self::insert`] at node `id`, given out by [`Self::give_ids`]; a node
    /// whose block's removal came first is freed instead.
    /// Returns whether it linked the node (it did not if freed).
    #[inline(always)]
    fn insert_at(
        &mut self,
        id: u32,
        seq: u64,
        tokens_low: u32,
        parent: Option<Touch>,
        place: &mut ChainPlace,
    ) -> bool {
        self.apply_pending();
        let node = self.nodes[id];
        let pinned = node.children & PINNED;
        if node.older == DOOMED || pinned != 0 {
            self.marked_pending -= 1;
        }
        if node.older == DOOMED {
            self.free_node(id);
            // The chain's next block then finds its place lost.
            place.behind = Some((seq, id));
            return false;
        }
        let parent = parent.filter(|&p| self.holds(p)).map_or(NIL, |(_, id)| id);
        self.nodes[id] = Node {
            seq: halves(seq),
            parent,
            newer: NIL,
            older: NIL,
            // Pinned before it was handed over.
            children: pinned,
            tokens_low,
        };
        let anchor = self.chain_anchor(place);
        self.link_behind(id, anchor);
        place.behind = Some((seq, id));
        if parent != NIL {
            self.nodes[parent].children += 1;
        }
        self.len += 1;
        true
    }

    /// [`Self::insert_at`] of the new blocks `changes` starts with (its leading
    /// [`Change::Insert`]s, up to a doomed node): a chain's next blocks, below
    /// node `prev`, the chain's block before them, just linked (so it is in the
    /// order, and the first one's parent and place). Returns how many, and the
    /// last one's key and node; none if the first node is doomed. Each node is
    /// read once and written once, whole (its neighbours are the blocks before
    /// and after it in the run), and `prev`'s older neighbour is given the last
    /// as its newer once: one block at a time read and wrote the block before
    /// and that neighbour for each (docs/measurements/index-vs-dynamo.md, "Layout choices").
    #[inline(always)]
    fn insert_run_below(&mut self, prev: u32, changes: &[Change]) -> Option<(usize, Touch)> {
        debug_assert!(self.pending.is_empty());
        // The block linked last and its node, not written yet: its older
        // neighbour is the next block of the run, if any.
        let mut above: Option<(Touch, Node)> = None;
        let mut older = NIL;
        let mut inserted = 0;
        // No node given out is doomed or pinned: none need be read.
        let unmarked = self.marked_pending == 0;
        for change in changes {
            let Change::Insert {
                seq,
                id,
                tokens_low,
            } = *change
            else {
                break;
            };
            debug_assert!(
                !unmarked || (self.nodes[id].older != DOOMED && self.nodes[id].children == 0),
                "an unmarked node given out"
            );
            let pinned = if unmarked {
                0
            } else {
                let node = self.nodes[id];
                if node.older == DOOMED {
                    break;
                }
                if node.children & PINNED != 0 {
                    self.marked_pending -= 1;
                }
                node.children & PINNED
            };
            let parent = match above {
                None => {
                    let anchor = &mut self.nodes[prev];
                    older = anchor.older;
                    anchor.older = id;
                    anchor.children += 1;
                    prev
                }
                Some(((_, at), mut linked)) => {
                    linked.older = id;
                    linked.children += 1;
                    self.nodes[at] = linked;
                    at
                }
            };
            above = Some((
                (seq, id),
                Node {
                    seq: halves(seq),
                    parent,
                    newer: parent,
                    older,
                    // Pinned before it was handed over.
                    children: pinned,
                    tokens_low,
                },
            ));
            inserted += 1;
        }
        let (last, node) = above?;
        self.nodes[last.1] = node;
        match older {
            NIL => self.tail = Some(last.1),
            o => self.nodes[o].newer = last.1,
        }
        self.len += inserted;
        Some((inserted, last))
    }

    /// Moves a block already in the order to a chain's next place; returns
    /// whether it was in the order.
    pub fn place(&mut self, place: &mut ChainPlace, touch: Touch) -> bool {
        if !self.holds(touch) {
            return false;
        }
        let anchor = self.chain_anchor(place);
        if anchor != Some(touch.1) {
            self.unlink(touch.1);
            self.link_behind(touch.1, anchor);
        }
        place.behind = Some(touch);
        true
    }

    /// The low half of the local hash of the block at its node; none while
    /// its insertion is still to be handed over.
    pub fn tokens_low(&self, touch: Touch) -> Option<u32> {
        self.holds(touch).then(|| self.nodes[touch.1].tokens_low)
    }

    /// Forgets the block at node `id` (nobody holds it any more).
    #[inline(always)]
    pub fn remove(&mut self, id: u32) {
        self.apply_pending();
        if let Some(gone) = self.forget(id, false) {
            self.take_out(gone);
        }
    }

    /// [`Self::remove`] of the blocks `changes` starts with (its leading
    /// [`Change::Remove`]s, at least one); returns how many. A block that is
    /// the parent of the one removed before it and right newer than it in the
    /// order (a chain's blocks going leaf first, as an engine evicts them) is
    /// taken out with it as one piece: the child's release is counted as its
    /// node is read, and the piece's neighbours are joined once, which leaves
    /// what removing each in turn leaves (docs/measurements/index-vs-dynamo.md, "Layout choices").
    #[inline(never)]
    fn remove_run(&mut self, changes: &[Change]) -> usize {
        debug_assert!(self.pending.is_empty());
        let mut piece: Option<Gone> = None;
        let mut removed = 0;
        for change in changes {
            let Change::Remove(id) = *change else {
                break;
            };
            removed += 1;
            let extends = piece.is_some_and(|p| p.parent == id && p.newer == id);
            let below = match piece.take() {
                Some(p) if extends => Some(p.older),
                Some(p) => {
                    self.take_out(p);
                    None
                }
                None => None,
            };
            piece = self.forget(id, extends).map(|gone| Gone {
                older: below.unwrap_or(gone.older),
                ..gone
            });
        }
        if let Some(p) = piece {
            self.take_out(p);
        }
        removed
    }

    /// Marks the block at node `id` gone, its node freed or retired while it
    /// counts children, reading and writing the node once; returns its
    /// neighbours and parent for the caller to unlink and release. With
    /// `child_released`, the block is in the order and its child just went:
    /// that child's release is counted here. Else, a block whose insertion is
    /// still to be applied (handed over later), or which the eviction scan
    /// took out already, is handled as such, and none returned.
    #[inline(always)]
    fn forget(&mut self, id: u32, child_released: bool) -> Option<Gone> {
        let n = &mut self.nodes[id];
        let node = *n;
        match node.older {
            _ if child_released => {}
            FREE => {
                n.older = DOOMED;
                // Marked now if it was not pinned (then it was already).
                if node.children & PINNED == 0 {
                    self.marked_pending += 1;
                }
                self.unpin_all(id);
                return None;
            }
            EVICTED => {
                self.free_node(id);
                return None;
            }
            _ => {}
        }
        debug_assert!(in_order(node.older));
        let mut children = node.children;
        // As `Self::release_child`.
        debug_assert!(!child_released || children & !PINNED > 0);
        if child_released && children & !PINNED > 0 {
            children -= 1;
        }
        let kept = children & !PINNED;
        n.children = kept;
        n.older = if kept == 0 { FREE } else { RETIRED };
        self.len -= 1;
        if children & PINNED != 0 {
            self.pins.remove(u64::from(id));
        }
        if kept == 0 {
            self.free.push(id);
        }
        Some(Gone {
            newer: node.newer,
            older: node.older,
            parent: node.parent,
        })
    }

    /// Joins the neighbours of blocks [`Self::forget`] marked gone and
    /// releases their parent.
    #[inline(always)]
    fn take_out(&mut self, gone: Gone) {
        self.unlink_between(gone.newer, gone.older);
        if gone.parent != NIL {
            self.release_child(gone.parent);
        }
    }

    /// Drops the pins of a block that went, as they did with a node found by
    /// key.
    #[inline]
    fn unpin_all(&mut self, id: u32) {
        let node = &mut self.nodes[id];
        if node.children & PINNED != 0 {
            node.children &= !PINNED;
            self.pins.remove(u64::from(id));
        }
    }

    fn free_node(&mut self, id: u32) {
        self.nodes[id].older = FREE;
        self.free.push(id);
    }

    /// One child of node `id` went; frees it if it was retired and that was
    /// its last.
    fn release_child(&mut self, id: u32) {
        let node = &mut self.nodes[id];
        debug_assert!(node.children & !PINNED > 0, "a node counts each child once");
        if node.children & !PINNED > 0 {
            node.children -= 1;
        }
        if node.children == 0 && node.older == RETIRED {
            self.free_node(id);
        }
    }

    /// Marks a path (from the root) as just used: root newest.
    pub fn touch(&mut self, path: impl DoubleEndedIterator<Item = Touch>) {
        self.apply_pending();
        for touch in path.rev() {
            self.move_to_head(touch);
        }
    }

    /// Takes over touches written down elsewhere, in order (each path leaf
    /// first), leaving `touches` empty.
    #[cfg(test)]
    pub fn defer(&mut self, touches: &mut Vec<Touch>) {
        self.defer_from(touches);
        touches.clear();
    }

    fn defer_from(&mut self, touches: &[Touch]) {
        if touches.is_empty() {
            return;
        }
        if self.pending.len() + touches.len() > MAX_PENDING {
            self.apply_pending();
        }
        if self.pending.capacity() == 0 && !touches.is_empty() {
            // At its full size at once: grown by doubling, the lookup that
            // crossed 32 Ki blocks copied 256 KiB into fresh pages (≈ 190 µs,
            // a routing decision's p99 at 8k tokens).
            self.pending.reserve_exact(MAX_PENDING);
        }
        self.pending.extend(touches);
    }

    #[inline]
    fn apply_pending(&mut self) {
        if !self.pending.is_empty() {
            self.apply_some(usize::MAX);
        }
    }

    /// Deferred touches waiting.
    #[cfg(test)]
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Applies the `n` oldest deferred touches; true when none are left.
    pub fn apply_some(&mut self, n: usize) -> bool {
        for _ in 0..n.min(self.pending.len()) {
            let Some(touch) = self.pending.pop_front() else {
                break;
            };
            self.move_to_head(touch);
        }
        self.pending.is_empty()
    }

    /// Moves lookups' touches (each path leaf first) to the head, as
    /// [`Self::move_to_head`] of each in turn would, and a run of them whose
    /// blocks lie in the order already as that leaves them (each right newer
    /// than the one before: a path touched or stored before) as one piece,
    /// reading each of its nodes once (docs/measurements/index-vs-dynamo.md, "Layout choices").
    fn touch_in_order(&mut self, touches: &[Touch]) {
        let mut at = 0;
        while let Some(&oldest) = touches.get(at) {
            at += 1;
            if !self.holds(oldest) {
                continue;
            }
            let mut newest = oldest.1;
            while let Some(&(seq, id)) = touches.get(at) {
                // Right newer than a block in the order: in it too.
                match self.nodes.get(id) {
                    Some(node) if node.older == newest && node.seq == halves(seq) => {}
                    _ => break,
                }
                newest = id;
                at += 1;
            }
            self.move_run_to_head(oldest.1, newest);
        }
    }

    /// Moves the blocks from node `oldest` up to node `newest`, neighbours
    /// in the order, to the head, keeping their order.
    #[inline]
    fn move_run_to_head(&mut self, oldest: u32, newest: u32) {
        let above = self.nodes[newest].newer;
        if above == NIL {
            return;
        }
        let below = self.nodes[oldest].older;
        self.nodes[above].older = below;
        match below {
            NIL => self.tail = Some(above),
            b => self.nodes[b].newer = above,
        }
        // Not in the run (which is below it): the run's newest is not the head.
        let old_head = self.head.unwrap_or(NIL);
        self.nodes[old_head].newer = oldest;
        self.nodes[oldest].older = old_head;
        self.nodes[newest].newer = NIL;
        self.head = Some(newest);
    }

    /// Moves a block still in the order to the head, reading its node once
    /// (nothing to do at the head already); returns whether it was in the
    /// order.
    #[inline]
    fn move_to_head(&mut self, (seq, id): Touch) -> bool {
        let Some(&node) = self.nodes.get(id) else {
            return false;
        };
        if !in_order(node.older) || node.seq != halves(seq) {
            return false;
        }
        if node.newer != NIL {
            self.unlink_between(node.newer, node.older);
            self.push_head(id);
        }
        true
    }

    /// Protects (or, with `delta` -1, releases) the blocks of a path from eviction.
    ///
    /// A block whose insertion is still to be handed over is pinned too: its
    /// node (named by the block's table entry, read under this order's lock)
    /// is the block's until that insertion or its removal is applied, and
    /// keeps the pin through the insertion.
    pub fn pin(&mut self, path: impl Iterator<Item = Touch>, delta: i32) {
        for touch in path {
            let (seq, id) = touch;
            let pending = self.nodes.get(id).is_some_and(|n| n.older == FREE);
            if !pending && !self.holds(touch) {
                continue;
            }
            let node = &mut self.nodes[id];
            if pending {
                if delta > 0 {
                    node.seq = halves(seq);
                } else if node.seq != halves(seq) {
                    continue;
                }
            }
            if delta < 0 && node.children & PINNED == 0 {
                continue;
            }
            let was_pinned = node.children & PINNED != 0;
            let (pins, _) = self.pins.get_or_insert(u64::from(id), || 0);
            *pins = pins.saturating_add_signed(i64::from(delta));
            if *pins == 0 {
                node.children &= !PINNED;
                self.pins.remove(u64::from(id));
            } else {
                node.children |= PINNED;
            }
            if pending && was_pinned != (node.children & PINNED != 0) {
                match was_pinned {
                    false => self.marked_pending += 1,
                    true => self.marked_pending -= 1,
                }
            }
        }
    }

    /// [`Self::next_victim_where`] with every unpinned leaf evictable.
    #[cfg(test)]
    pub fn next_victim(&mut self, cursor: &mut Cursor) -> Option<Touch> {
        self.next_victim_where(cursor, &mut Spared::unlimited(), |_| true)
    }

    /// The next evictable block (an unpinned leaf that `evictable` accepts)
    /// from `cursor` toward the head, removed from the order; none when the
    /// scan reached the head, or the blocks met since then `spared` was
    /// made number its limit ([`Spared::exhausted`]).
    ///
    /// `evictable` is asked only about unpinned leaves (the index's fair
    /// share, see DESIGN.md, "Eviction"). With [`Spared::second_chance`],
    /// every block met and not taken (refused, pinned, or not a leaf) is
    /// moved to the head with the ancestors right newer than it (a chain as
    /// a touch leaves it, whole), so that no later scan from the tail walks
    /// it again before every block that was newer is gone or moved too: a
    /// block no scan may take costs one visit a cycle of the order, not one
    /// a scan, and every block a scan meets is taken or moved out of the
    /// next scan's way. The pass then ends at the first block it moved
    /// (what lies above it this pass met already). Without it, such blocks
    /// are skipped in place and the order stays exact LRU.
    pub fn next_victim_where(
        &mut self,
        cursor: &mut Cursor,
        spared: &mut Spared,
        mut evictable: impl FnMut(Touch) -> bool,
    ) -> Option<Touch> {
        self.apply_pending();
        let mut at = match *cursor {
            Cursor::Tail => self.tail,
            Cursor::At { id, seq } if self.holds((seq, id)) => Some(id),
            Cursor::At { .. } => self.tail,
            Cursor::Done => None,
        };
        while let Some(id) = at {
            if spared.exhausted() {
                *cursor = Cursor::At {
                    id,
                    seq: self.nodes[id].seq(),
                };
                return None;
            }
            let seq = self.nodes[id].seq();
            if spared.fence == Some((seq, id)) {
                break;
            }
            self.visited += 1;
            let node = &self.nodes[id];
            let next = (node.newer != NIL).then_some(node.newer);
            if node.children == 0 && evictable((seq, id)) {
                self.remove(id);
                *cursor = next.map_or(Cursor::Done, |id| Cursor::At {
                    id,
                    seq: self.nodes[id].seq(),
                });
                return Some((seq, id));
            }
            at = match spared.second_chance {
                true => self.spare(id, spared),
                false => {
                    spared.met += 1;
                    next
                }
            };
        }
        *cursor = Cursor::Done;
        None
    }

    /// Moves block `leaf`, met and not taken, to the head with the ancestors right
    /// newer than it, each the parent of the one below (as many as `spared`
    /// allows); returns the node the scan goes on at (the piece's newer
    /// neighbour before the move).
    fn spare(&mut self, leaf: u32, spared: &mut Spared) -> Option<u32> {
        let mut newest = leaf;
        spared.met += 1;
        loop {
            let node = &self.nodes[newest];
            if node.newer == NIL || node.newer != node.parent || spared.exhausted() {
                break;
            }
            newest = node.newer;
            self.visited += 1;
            spared.met += 1;
        }
        let next = self.nodes[newest].newer;
        if next == NIL {
            return None;
        }
        self.move_run_to_head(leaf, newest);
        spared.fence.get_or_insert((self.nodes[leaf].seq(), leaf));
        Some(next)
    }

    /// The eviction scan's last victim, node `id`, whose block's removal is
    /// still to be applied (its block already went from the table): kept out
    /// of the order until that removal frees it.
    pub fn await_removal(&mut self, id: u32) {
        // Freed last, or just before the parent its removal freed.
        if let Some(at) = self.free.iter().rposition(|&free| free == id) {
            self.free.swap_remove(at);
            self.nodes[id].older = EVICTED;
        }
    }

    #[inline]
    fn unlink(&mut self, id: u32) {
        let (newer, older) = {
            let n = &self.nodes[id];
            (n.newer, n.older)
        };
        self.unlink_between(newer, older);
    }

    /// Joins the neighbours of a node leaving the order.
    #[inline]
    fn unlink_between(&mut self, newer: u32, older: u32) {
        match newer {
            NIL => self.head = (older != NIL).then_some(older),
            n => self.nodes[n].older = older,
        }
        match older {
            NIL => self.tail = (newer != NIL).then_some(newer),
            o => self.nodes[o].newer = newer,
        }
    }

    /// Links node `id` (not in the list) right behind (older than) node
    /// `anchor`, or at the head.
    #[inline]
    fn link_behind(&mut self, id: u32, anchor: Option<u32>) {
        let Some(anchor) = anchor else {
            self.push_head(id);
            return;
        };
        let older = self.nodes[anchor].older;
        {
            let n = &mut self.nodes[id];
            n.newer = anchor;
            n.older = older;
        }
        self.nodes[anchor].older = id;
        match older {
            NIL => self.tail = Some(id),
            o => self.nodes[o].newer = id,
        }
    }

    #[inline]
    fn push_head(&mut self, id: u32) {
        let old_head = self.head.unwrap_or(NIL);
        {
            let n = &mut self.nodes[id];
            n.newer = NIL;
            n.older = old_head;
        }
        match self.head {
            Some(h) => self.nodes[h].newer = id,
            None => self.tail = Some(id),
        }
        self.head = Some(id);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::table::NO_PARENT;

    /// The order with the key → node map the block table keeps for it, so
    /// that tests name blocks by key as the index does; with `deferred`,
    /// stores and removals write their changes down as a bounded index's
    /// runs do, applied before the order is next read.
    #[derive(Default)]
    struct Keyed {
        lru: Lru,
        table: HashMap<u64, u32>,
        deferred: Option<Vec<Change>>,
    }

    impl Keyed {
        fn deferred() -> Self {
            Self {
                deferred: Some(Vec::new()),
                ..Self::default()
            }
        }

        fn found(&self, seq: u64) -> Option<Touch> {
            self.table.get(&seq).map(|&id| (seq, id))
        }

        /// Applies the changes written down (a hand-over and the lock's next
        /// holder applying it).
        fn flush(&mut self) {
            if let Some(changes) = &mut self.deferred {
                self.lru.apply_changes(changes, &mut Vec::new());
            }
        }

        /// Adds a block as the newest; no-op if present.
        fn insert(&mut self, seq: u64, parent: u64) {
            self.flush();
            if self.table.contains_key(&seq) {
                return;
            }
            let parent = if parent == NO_PARENT {
                None
            } else {
                self.found(parent)
            };
            let id = self
                .lru
                .insert(seq, seq as u32, parent, &mut ChainPlace::default());
            self.table.insert(seq, id);
        }

        /// A stored chain as the index applies one: `blocks` placed one by
        /// one behind `parent`, inserting those not present; `remove` (a
        /// block's key and the index in `blocks` before which it goes)
        /// dropped on the way, as an engine hash named again drops the block
        /// it named.
        fn store(&mut self, parent: Option<u64>, blocks: &[u64], remove: Option<(u64, usize)>) {
            if self.deferred.is_some() {
                return self.store_deferred(parent, blocks, remove);
            }
            let mut parent = parent.and_then(|p| self.found(p));
            let mut chain: Vec<Touch> = parent.into_iter().collect();
            let mut place = self.lru.start_chain(parent);
            for (i, &seq) in blocks.iter().enumerate() {
                if let Some((gone, _)) = remove.filter(|&(_, at)| at == i) {
                    self.remove(gone);
                }
                let node = match self.found(seq) {
                    Some(touch) => {
                        self.lru.place(&mut place, touch);
                        touch.1
                    }
                    None => {
                        let id = self.lru.insert(seq, seq as u32, parent, &mut place);
                        self.table.insert(seq, id);
                        id
                    }
                };
                parent = Some((seq, node));
                chain.push((seq, node));
            }
            if place.lost {
                self.lru.touch(chain.into_iter());
            }
        }

        /// [`Self::store`] as a run without the order's lock writes it down.
        fn store_deferred(
            &mut self,
            parent: Option<u64>,
            blocks: &[u64],
            remove: Option<(u64, usize)>,
        ) {
            let parent = parent.and_then(|p| self.found(p));
            self.write(Change::Start(parent));
            for (i, &seq) in blocks.iter().enumerate() {
                if let Some((gone, _)) = remove.filter(|&(_, at)| at == i) {
                    self.remove(gone);
                }
                let change = match self.found(seq) {
                    Some(touch) => Change::Place(touch),
                    None => {
                        let mut id = Vec::new();
                        self.lru.give_ids(1, &mut id);
                        self.table.insert(seq, id[0]);
                        Change::Insert {
                            seq,
                            id: id[0],
                            tokens_low: seq as u32,
                        }
                    }
                };
                self.write(change);
            }
            self.write(Change::End);
        }

        fn write(&mut self, change: Change) {
            self.deferred.as_mut().unwrap().push(change);
        }

        fn remove(&mut self, seq: u64) {
            if let Some(id) = self.table.remove(&seq) {
                match self.deferred.is_some() {
                    true => self.write(Change::Remove(id)),
                    false => self.lru.remove(id),
                }
            }
        }

        fn touch(&mut self, path: impl DoubleEndedIterator<Item = u64>) {
            self.flush();
            let path: Vec<Touch> = path.filter_map(|s| self.found(s)).collect();
            self.lru.touch(path.into_iter());
        }

        /// Writes down a touch as a lookup does, nodes found now.
        fn defer(&mut self, touches: &mut Vec<u64>) {
            self.flush();
            let mut found: Vec<Touch> = touches.drain(..).filter_map(|s| self.found(s)).collect();
            self.lru.defer(&mut found);
        }

        fn apply_some(&mut self, n: usize) -> bool {
            self.lru.apply_some(n)
        }

        /// Hands lookups' touches over as a run's hand-over marks them,
        /// nodes found now, and applies them.
        fn hand_over_touches(&mut self, touches: &[u64]) {
            self.flush();
            let mut found: Vec<Touch> = touches.iter().filter_map(|&s| self.found(s)).collect();
            let mut marked = vec![Change::Touches(found.len() as u32)];
            self.lru.apply_changes(&mut marked, &mut found);
        }

        fn pin(&mut self, path: &[u64], delta: i32) {
            self.flush();
            let path: Vec<Touch> = path.iter().filter_map(|&s| self.found(s)).collect();
            self.lru.pin(path.into_iter(), delta);
        }

        fn next_victim(&mut self, cursor: &mut Cursor) -> Option<u64> {
            self.flush();
            let (victim, _) = self.lru.next_victim(cursor)?;
            self.table.remove(&victim);
            Some(victim)
        }

        fn len(&mut self) -> usize {
            self.flush();
            assert_eq!(self.lru.len(), self.table.len());
            self.lru.len()
        }
    }

    /// Evicts until `n` victims or the head, in one cursor-resumed scan.
    fn evict(lru: &mut Keyed, n: usize) -> Vec<u64> {
        let mut cursor = Cursor::default();
        std::iter::from_fn(|| lru.next_victim(&mut cursor))
            .take(n)
            .collect()
    }

    /// A path whose blocks lie in the order as a touch leaves them, below
    /// other blocks, moves to the head whole when touched again.
    #[test]
    fn a_path_touched_again_moves_whole() {
        let mut lru = Keyed::default();
        for seq in [1, 2, 3] {
            lru.insert(seq, NO_PARENT);
        }
        // Leaf first: 1 newest, then 2.
        lru.hand_over_touches(&[2, 1]);
        lru.insert(4, NO_PARENT);
        lru.hand_over_touches(&[2, 1]);
        assert_eq!(evict(&mut lru, 10), vec![3, 4, 2, 1]);
    }

    #[test]
    fn interleaved_skips_cost_one_visit_each() {
        // Tail to head: pinned, leaf, pinned, leaf, ... A scan restarting at the
        // tail after each eviction would visit about M * K / 2 nodes.
        const M: u64 = 2000;
        let mut lru = Keyed::default();
        for i in 1..=M {
            lru.insert(2 * i, NO_PARENT);
            lru.pin(&[2 * i], 1);
            lru.insert(2 * i + 1, NO_PARENT);
        }
        let victims = evict(&mut lru, M as usize);
        assert_eq!(victims, (1..=M).map(|i| 2 * i + 1).collect::<Vec<_>>());
        assert!(
            lru.lru.visited <= 2 * M,
            "visited {} nodes for {M} evictions",
            lru.lru.visited
        );
    }

    /// Blocks a scan may not take (chains of two touched leaf first, below
    /// blocks it may take) move to the head whole, so that the next scans
    /// from the tail meet only the blocks that were newer; a pass ends at
    /// the first block it moved; a scan stops at its limit with its cursor
    /// in place.
    #[test]
    fn refused_blocks_get_a_second_chance_at_the_head() {
        const M: u64 = 500;
        let mut lru = Keyed::default();
        for i in 0..M {
            let (root, leaf) = (1000 + 2 * i, 1001 + 2 * i);
            lru.insert(root, NO_PARENT);
            lru.insert(leaf, root);
            lru.touch([root, leaf].into_iter());
        }
        for seq in 5000..5000 + M {
            lru.insert(seq, NO_PARENT);
        }
        let take = |lru: &mut Keyed| {
            lru.lru
                .next_victim_where(
                    &mut Cursor::default(),
                    &mut Spared::second_chance(usize::MAX),
                    |(seq, _)| seq >= 5000,
                )
                .map(|(seq, _)| seq)
        };
        assert_eq!(take(&mut lru), Some(5000));
        assert_eq!(lru.lru.visited, 2 * M + 1, "each chain met once");
        for seq in 5001..5000 + M {
            let visited = lru.lru.visited;
            assert_eq!(take(&mut lru), Some(seq));
            assert_eq!(lru.lru.visited - visited, 1, "{seq}");
        }
        // Only the refused chains are left: the pass ends at the first it
        // moves, and they lie leaf first, as a touch leaves them.
        assert_eq!(take(&mut lru), None);
        let mut cursor = Cursor::default();
        let mut spared = Spared::second_chance(3);
        assert_eq!(
            lru.lru
                .next_victim_where(&mut cursor, &mut spared, |_| false),
            None
        );
        assert!(spared.exhausted());
        // The third block met (the second chain's leaf) moved alone.
        let (seq, id) = lru.found(1002).unwrap();
        assert_eq!(cursor, Cursor::At { id, seq });
    }

    #[test]
    fn a_touched_chain_is_evicted_leaf_first_in_one_pass() {
        let mut lru = Keyed::default();
        let chain = [10, 11, 12, 13];
        let mut parent = NO_PARENT;
        for seq in chain {
            lru.insert(seq, parent);
            parent = seq;
        }
        lru.insert(99, NO_PARENT);
        // Stored root first, the chain's leaf is newest; touching reorders it.
        lru.touch(chain.into_iter());
        assert_eq!(evict(&mut lru, 5), vec![99, 13, 12, 11, 10]);
        assert_eq!(lru.lru.visited, 5);
    }

    #[test]
    fn ancestors_and_pinned_blocks_are_never_victims() {
        let mut lru = Keyed::default();
        lru.insert(1, NO_PARENT);
        lru.insert(2, 1);
        lru.insert(3, 2);
        lru.insert(7, NO_PARENT);
        lru.pin(&[7], 1);
        // 1 and 2 are older than 3 but have children: skipped this pass.
        assert_eq!(evict(&mut lru, 10), vec![3]);
        assert_eq!(evict(&mut lru, 10), vec![2]);
        lru.pin(&[7], -1);
        assert_eq!(evict(&mut lru, 10), vec![1, 7]);
        assert_eq!(lru.len(), 0);
    }

    #[derive(Clone, Debug)]
    enum Op {
        Insert(u64),
        Remove(u64),
        TouchLater(Vec<u64>),
        /// A path touched this many times, handed over with a run's changes.
        TouchHandedOver(Vec<u64>, usize),
        /// The recency thread's slice: changes nothing the order shows.
        ApplySome(usize),
        Evict,
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            (0..12u64).prop_map(Op::Insert),
            (0..12u64).prop_map(Op::Remove),
            proptest::collection::vec(0..12u64, 0..5).prop_map(Op::TouchLater),
            (proptest::collection::vec(0..12u64, 0..5), 1..3usize)
                .prop_map(|(path, times)| Op::TouchHandedOver(path, times)),
            (0..6usize).prop_map(Op::ApplySome),
            Just(Op::Evict),
        ]
    }

    proptest::proptest! {
        /// Deferred touches, and touches handed over with a run's changes,
        /// against a model that moves each touched block to the front of a
        /// list at once (root blocks only: the order alone).
        #[test]
        fn deferred_touches_evict_as_touches_done_at_once(
            ops in proptest::collection::vec(op(), 1..80)
        ) {
            let mut lru = Keyed::default();
            // Newest first.
            let mut model: Vec<u64> = Vec::new();
            for op in ops {
                match op {
                    Op::Insert(seq) => {
                        lru.insert(seq, NO_PARENT);
                        if !model.contains(&seq) {
                            model.insert(0, seq);
                        }
                    }
                    Op::Remove(seq) => {
                        lru.remove(seq);
                        model.retain(|&s| s != seq);
                    }
                    Op::TouchLater(path) => {
                        lru.defer(&mut path.iter().rev().copied().collect());
                        for seq in path.iter().rev() {
                            if let Some(at) = model.iter().position(|s| s == seq) {
                                model.remove(at);
                                model.insert(0, *seq);
                            }
                        }
                    }
                    Op::TouchHandedOver(path, times) => {
                        let leaf_first: Vec<u64> = path.iter().rev().copied().collect();
                        lru.hand_over_touches(&leaf_first.repeat(times));
                        for seq in leaf_first.repeat(times) {
                            if let Some(at) = model.iter().position(|&s| s == seq) {
                                model.remove(at);
                                model.insert(0, seq);
                            }
                        }
                    }
                    Op::ApplySome(n) => {
                        lru.apply_some(n);
                    }
                    Op::Evict => {
                        let victim = lru.next_victim(&mut Cursor::default());
                        proptest::prop_assert_eq!(victim, model.pop());
                    }
                }
            }
            proptest::prop_assert_eq!(evict(&mut lru, 100), model.into_iter().rev().collect::<Vec<_>>());
        }
    }

    /// An operation on a tree of blocks 1..16, block `k`'s parent `k / 2`.
    #[derive(Clone, Debug)]
    enum TreeOp {
        /// A stored chain: the path from the root to `k` but its first `cut`
        /// blocks (the last of those its parent, present or not) inserted,
        /// root first, then touched with its parent; `drop` (a block, and the
        /// chain's index before which it goes) removed on the way.
        Store {
            k: u64,
            cut: usize,
            drop: Option<(u64, usize)>,
        },
        /// `k` alone inserted (if its parent is present), not touched.
        Insert(u64),
        /// `k` removed, leaf or not (a child left behind is an orphan).
        Remove(u64),
        Touch(u64),
        Pin(u64, i32),
        Evict,
    }

    fn tree_op() -> impl proptest::strategy::Strategy<Value = TreeOp> {
        use proptest::prelude::*;
        prop_oneof![
            (
                1..16u64,
                0..4usize,
                proptest::option::of((1..16u64, 0..4usize))
            )
                .prop_map(|(k, cut, drop)| TreeOp::Store { k, cut, drop }),
            (1..16u64).prop_map(TreeOp::Insert),
            (1..16u64).prop_map(TreeOp::Remove),
            (1..16u64).prop_map(TreeOp::Touch),
            (1..16u64, prop_oneof![Just(1), Just(-1)]).prop_map(|(k, d)| TreeOp::Pin(k, d)),
            Just(TreeOp::Evict),
        ]
    }

    /// Root first.
    fn tree_path(k: u64) -> Vec<u64> {
        let mut path: Vec<u64> = std::iter::successors(Some(k), |&k| Some(k / 2))
            .take_while(|&k| k > 0)
            .collect();
        path.reverse();
        path
    }

    fn tree_parent(k: u64) -> u64 {
        if k == 1 { NO_PARENT } else { k / 2 }
    }

    proptest::proptest! {
        /// Stored chains, removals (orphans included), touches and pins
        /// against a model: the victim is the least recently used block with
        /// no pin and no block stored below it while it was present.
        #[test]
        fn chains_evict_the_oldest_unpinned_leaf(
            ops in proptest::collection::vec(tree_op(), 1..120),
            deferred: bool,
        ) {
            /// A present block: its key, pins, and the parent it was stored
            /// under (key and that parent's incarnation), if present then.
            #[derive(Clone, Copy)]
            struct Block {
                seq: u64,
                pins: u32,
                under: Option<(u64, u32)>,
            }
            let mut lru = if deferred { Keyed::deferred() } else { Keyed::default() };
            // Newest first; how many times each key was stored.
            let mut model: Vec<Block> = Vec::new();
            let mut incarnation = [0u32; 16];
            fn move_front(model: &mut Vec<Block>, seq: u64) {
                if let Some(at) = model.iter().position(|b| b.seq == seq) {
                    let block = model.remove(at);
                    model.insert(0, block);
                }
            }
            fn victim(model: &[Block], incarnation: &[u32; 16]) -> Option<u64> {
                let leaf = |s: u64| {
                    !model.iter().any(|c| c.under == Some((s, incarnation[s as usize])))
                };
                model.iter().rev().find(|b| b.pins == 0 && leaf(b.seq)).map(|b| b.seq)
            }
            fn model_insert(model: &mut Vec<Block>, incarnation: &mut [u32; 16], k: u64) {
                if !model.iter().any(|b| b.seq == k) {
                    let p = tree_parent(k);
                    let under = model
                        .iter()
                        .any(|b| b.seq == p)
                        .then(|| (p, incarnation[p as usize]));
                    incarnation[k as usize] += 1;
                    model.insert(0, Block { seq: k, pins: 0, under });
                }
            }
            let insert = |model: &mut Vec<Block>, incarnation: &mut [u32; 16], lru: &mut Keyed, k: u64| {
                lru.insert(k, tree_parent(k));
                model_insert(model, incarnation, k);
            };
            for op in ops {
                match op {
                    TreeOp::Store { k, cut, drop } => {
                        let path = tree_path(k);
                        let cut = cut.min(path.len() - 1);
                        let parent = cut.checked_sub(1).map(|p| path[p]);
                        let blocks = &path[cut..];
                        lru.store(parent, blocks, drop);
                        for (i, &seq) in blocks.iter().enumerate() {
                            if let Some((gone, _)) = drop.filter(|&(_, at)| at == i) {
                                model.retain(|b| b.seq != gone);
                            }
                            model_insert(&mut model, &mut incarnation, seq);
                        }
                        for &seq in blocks.iter().rev().chain(parent.iter()) {
                            move_front(&mut model, seq);
                        }
                    }
                    TreeOp::Insert(k) => {
                        if k == 1 || model.iter().any(|b| b.seq == k / 2) {
                            insert(&mut model, &mut incarnation, &mut lru, k);
                        }
                    }
                    TreeOp::Remove(k) => {
                        lru.remove(k);
                        model.retain(|b| b.seq != k);
                    }
                    TreeOp::Touch(k) => {
                        let path = tree_path(k);
                        lru.touch(path.iter().copied());
                        for &seq in path.iter().rev() {
                            move_front(&mut model, seq);
                        }
                    }
                    TreeOp::Pin(k, delta) => {
                        let path = tree_path(k);
                        lru.pin(&path, delta);
                        for b in &mut model {
                            if path.contains(&b.seq) {
                                b.pins = b.pins.saturating_add_signed(delta);
                            }
                        }
                    }
                    TreeOp::Evict => {
                        let expected = victim(&model, &incarnation);
                        proptest::prop_assert_eq!(lru.next_victim(&mut Cursor::default()), expected);
                        model.retain(|b| Some(b.seq) != expected);
                    }
                }
            }
            while let Some(expected) = victim(&model, &incarnation) {
                proptest::prop_assert_eq!(lru.next_victim(&mut Cursor::default()), Some(expected));
                model.retain(|b| b.seq != expected);
            }
            proptest::prop_assert_eq!(lru.len(), model.len());
        }
    }

    /// A lookup's touch names the node it found its block under; if the
    /// block goes and another takes its node before the touch is handed
    /// over, the touch moves nothing.
    #[test]
    fn a_stale_deferred_touch_moves_no_other_block() {
        let mut lru = Keyed::default();
        lru.insert(1, NO_PARENT);
        lru.insert(2, NO_PARENT);
        // Found by a walk, written down after the block went.
        let walked = lru.found(1).unwrap();
        lru.remove(1);
        lru.insert(3, NO_PARENT);
        assert_eq!(lru.found(3).unwrap().1, walked.1, "3 took 1's node");
        lru.lru.defer(&mut vec![walked]);
        // Moved, 3 would be the newest and 2 the oldest.
        assert_eq!(evict(&mut lru, 2), vec![2, 3]);
    }

    #[test]
    fn a_parent_stored_again_is_not_charged_with_an_orphan() {
        let mut lru = Keyed::default();
        lru.insert(1, NO_PARENT);
        lru.insert(2, 1);
        // 1 goes while 2 stays (an orphan), then 1 is stored again, with a
        // new child 3.
        lru.remove(1);
        lru.insert(1, NO_PARENT);
        lru.insert(3, 1);
        // The orphan leaving must not make 1 a leaf while 3 is below it: 1
        // is the oldest, but 3 goes first.
        lru.remove(2);
        assert_eq!(evict(&mut lru, 1), vec![3]);
        assert_eq!(evict(&mut lru, 1), vec![1]);
    }

    /// Two runs handed over in the other order than they changed the table:
    /// a block's removal comes before its insertion. The block never enters
    /// the order, its node is freed, and the chain's block stored under it
    /// is placed as a touch of the chain would place it (no parent counted:
    /// its parent is gone, as after a removal applied in order).
    #[test]
    fn a_removal_handed_over_before_its_insertion_frees_the_node() {
        let mut lru = Lru::default();
        let mut ids = Vec::new();
        lru.give_ids(3, &mut ids);
        let [a, b, c] = ids[..] else { unreachable!() };
        let insert = |seq, id| Change::Insert {
            seq,
            id,
            tokens_low: 0,
        };
        let mut earlier = vec![Change::Start(None), insert(1, a), insert(2, b), Change::End];
        let mut later = vec![Change::Remove(a)];
        lru.apply_changes(&mut later, &mut Vec::new());
        lru.apply_changes(&mut earlier, &mut Vec::new());
        assert_eq!(lru.len(), 1);
        let mut others = vec![Change::Start(None), insert(3, c), Change::End];
        lru.apply_changes(&mut others, &mut Vec::new());
        // 2 is a leaf older than 3; node a is free again.
        assert_eq!(lru.next_victim(&mut Cursor::default()), Some((2, b)));
        let mut again = Vec::new();
        lru.give_ids(2, &mut again);
        assert!(again.contains(&a), "{again:?}");
    }

    /// Three nodes given out and the changes of a stored chain of new
    /// blocks 1, 2 and 3 at them, in that order.
    fn new_chain(lru: &mut Lru) -> ([u32; 3], Vec<Change>) {
        let mut ids = Vec::new();
        lru.give_ids(3, &mut ids);
        let ids: [u32; 3] = ids[..].try_into().expect("three ids");
        let mut changes = vec![Change::Start(None)];
        changes.extend((1..).zip(ids).map(|(seq, id)| Change::Insert {
            seq,
            id,
            tokens_low: 0,
        }));
        changes.push(Change::End);
        (ids, changes)
    }

    /// As above for a block in the middle of a chain of new blocks, which
    /// the apply links as a run below the block before: the run stops at
    /// the doomed node, which is freed, and the block after it, its place
    /// lost, goes to the head, then the chain's touch moves the first there.
    #[test]
    fn a_removal_handed_over_before_its_insertion_mid_chain_frees_the_node() {
        let mut lru = Lru::default();
        let ([a, b, c], mut earlier) = new_chain(&mut lru);
        let mut later = vec![Change::Remove(b)];
        lru.apply_changes(&mut later, &mut Vec::new());
        lru.apply_changes(&mut earlier, &mut Vec::new());
        assert_eq!(lru.len(), 2);
        // Neither counts a child: 3's parent, 2, was not in the order.
        let mut cursor = Cursor::default();
        assert_eq!(lru.next_victim(&mut cursor), Some((3, c)));
        assert_eq!(lru.next_victim(&mut cursor), Some((1, a)));
        assert_eq!(lru.next_victim(&mut cursor), None);
        let mut again = Vec::new();
        lru.give_ids(3, &mut again);
        assert!(again.contains(&b), "{again:?}");
    }

    /// A chain's blocks removed leaf first in one hand-over, as an engine
    /// evicts them, go as one piece while each is the parent of the one
    /// before and right newer than it; a parent moved away since (4,
    /// touched alone) goes alone. Each node is freed, and the blocks left
    /// keep their order.
    #[test]
    fn a_chain_removed_leaf_first_in_one_hand_over_goes_as_one_piece() {
        let mut lru = Keyed::deferred();
        lru.store(None, &[1, 2, 3], None);
        lru.store(None, &[4, 5], None);
        lru.store(None, &[6], None);
        lru.touch([4].into_iter());
        // Newest first: 4, 6, 5, 1, 2, 3.
        let mut nodes: Vec<u32> = [2, 3, 4, 5].map(|seq| lru.found(seq).unwrap().1).to_vec();
        for seq in [3, 2, 5, 4] {
            lru.remove(seq);
        }
        assert_eq!(
            lru.deferred.as_ref().map(Vec::len),
            Some(4),
            "one hand-over"
        );
        assert_eq!(lru.len(), 2);
        let mut freed = Vec::new();
        lru.lru.give_ids(4, &mut freed);
        freed.sort_unstable();
        nodes.sort_unstable();
        assert_eq!(freed, nodes);
        assert_eq!(evict(&mut lru, 3), vec![1, 6]);
    }

    /// Nodes given out that carry a mark for their insertion (pinned,
    /// doomed) are counted, each once, until the insertion links or frees
    /// them: while none are, a run's inserts do not read their nodes.
    #[test]
    fn marks_on_nodes_given_out_are_counted_until_inserted() {
        let mut lru = Lru::default();
        let ([a, b, c], mut stored) = new_chain(&mut lru);
        lru.pin([(1, a)].into_iter(), 1);
        lru.pin([(2, b)].into_iter(), 1);
        lru.pin([(2, b)].into_iter(), 1);
        // Pinned, then doomed: one mark.
        lru.apply_changes(&mut vec![Change::Remove(b)], &mut Vec::new());
        lru.pin([(3, c)].into_iter(), 1);
        lru.pin([(3, c)].into_iter(), -1);
        assert_eq!(lru.marked_pending, 2);
        lru.apply_changes(&mut stored, &mut Vec::new());
        assert_eq!(lru.marked_pending, 0);
        assert_eq!(lru.len(), 2);
        // 3 is not pinned; 1 still is.
        let mut cursor = Cursor::default();
        assert_eq!(lru.next_victim(&mut cursor), Some((3, c)));
        assert_eq!(lru.next_victim(&mut cursor), None);
    }

    /// A victim whose block left the table by a removal not yet applied is
    /// kept out of the order, and that removal, when applied, frees it once;
    /// also when taking the victim freed its retired parent after it.
    #[test]
    fn a_victim_awaiting_its_removal_is_freed_by_it() {
        let mut lru = Lru::default();
        let mut ids = Vec::new();
        lru.give_ids(2, &mut ids);
        let [parent, child] = ids[..] else {
            unreachable!()
        };
        let insert = |seq, id| Change::Insert {
            seq,
            id,
            tokens_low: 0,
        };
        let mut stored = vec![
            Change::Start(None),
            insert(1, parent),
            insert(2, child),
            Change::End,
        ];
        // The parent goes first: retired, counting its child.
        stored.push(Change::Remove(parent));
        lru.apply_changes(&mut stored, &mut Vec::new());
        assert_eq!(lru.next_victim(&mut Cursor::default()), Some((2, child)));
        lru.await_removal(child);
        let mut given = Vec::new();
        lru.give_ids(2, &mut given);
        assert!(
            !given.contains(&child),
            "free before its removal: {given:?}"
        );
        assert!(given.contains(&parent));
        lru.apply_changes(&mut vec![Change::Remove(child)], &mut Vec::new());
        lru.give_ids(2, &mut given);
        assert_eq!(given.iter().filter(|&&id| id == child).count(), 1);
        assert_eq!(lru.len(), 0);
    }

    /// A pin taken while a block's insertion is still to be handed over
    /// holds the block once inserted, and its release lets it go.
    #[test]
    fn a_pin_on_a_block_not_yet_handed_over_holds_it() {
        let mut lru = Lru::default();
        let mut ids = Vec::new();
        lru.give_ids(2, &mut ids);
        let [a, b] = ids[..] else { unreachable!() };
        assert_eq!(lru.tokens_low((1, a)), None, "not inserted yet");
        lru.pin([(1, a)].into_iter(), 1);
        let insert = |seq, id| Change::Insert {
            seq,
            id,
            tokens_low: 7,
        };
        let mut stored = vec![Change::Start(None), insert(1, a), Change::End];
        stored.extend([Change::Start(None), insert(2, b), Change::End]);
        lru.apply_changes(&mut stored, &mut Vec::new());
        assert_eq!(lru.tokens_low((1, a)), Some(7));
        // 1 is older, but pinned.
        assert_eq!(lru.next_victim(&mut Cursor::default()), Some((2, b)));
        lru.pin([(1, a)].into_iter(), -1);
        assert_eq!(lru.next_victim(&mut Cursor::default()), Some((1, a)));
    }

    /// As above for a block in the middle of a chain of new blocks, which
    /// the apply links as a run below the block before.
    #[test]
    fn a_pin_mid_chain_on_a_block_not_yet_handed_over_holds_it() {
        let mut lru = Lru::default();
        let ([a, b, c], mut stored) = new_chain(&mut lru);
        lru.pin([(2, b)].into_iter(), 1);
        lru.apply_changes(&mut stored, &mut Vec::new());
        let mut cursor = Cursor::default();
        assert_eq!(lru.next_victim(&mut cursor), Some((3, c)));
        // 2 is a leaf now, but pinned, and 1 counts it.
        assert_eq!(lru.next_victim(&mut cursor), None);
        lru.pin([(2, b)].into_iter(), -1);
        let mut cursor = Cursor::default();
        assert_eq!(lru.next_victim(&mut cursor), Some((2, b)));
        assert_eq!(lru.next_victim(&mut cursor), Some((1, a)));
    }
}

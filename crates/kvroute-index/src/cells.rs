//! What a lookup reads of each interned worker index, without a lock.
//!
//! Blocks name their holders by small interned indices (see [`crate::table`]); a
//! lookup's caller turns the indices it ranks into worker keys and sizes
//! ([`crate::index::KvIndex::resolve`]), every one of thousands for the
//! scheduler at fleet scale. These cells used to sit in growable arrays
//! behind a lock that lookups held for reading over their whole walk, so every
//! new worker waited for the lookups in flight, and every later lookup waited
//! for it. Here they live in buckets that never move (bucket `b` holds 64·2^b
//! cells, allocated once, when the first index in it is given out), read with
//! plain atomic loads: adding a worker never waits for a lookup.
//!
//! What a lookup must still not see is an index changing hands, or a dump's swap
//! half done (DESIGN.md, "Dumps"). Both are rare, so they bump an epoch around
//! the change, seqlock style, and a lookup that saw the epoch move walks again.
//! Giving out an index does not bump it: a new index holds no block until its
//! worker's first event, which reaches lookups through the table's shard locks.
//!
//! A lookup answers with bare (index, depth) pairs and reads a cell only for the
//! indices its caller resolves (see [`crate::index::Matches`]). So that it need
//! not read every matched index's cell to leave out hidden ones (a dump being
//! built, a state being released), the cells count the hidden indices: while
//! there are none, which is nearly always, every index a walk meets is live.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering, fence};
use std::sync::{Arc, OnceLock};

use crate::event::WorkerKey;

/// One interned index: whose it is and how many blocks that worker holds.
pub(crate) struct Cell {
    worker_id: AtomicU64,
    dp_rank: AtomicU32,
    /// Lookups report the index (see `WorkerSlot::live` in [`crate::index`]).
    live: AtomicBool,
    /// The memberships the worker's own writers gave and took (its events,
    /// the dump building the slot, the release of a replaced state), one at
    /// a time: a plain load and store (see [`Cell::blocks`]).
    pub held: AtomicU64,
    /// The memberships the evictor took, under the eviction mutex: a count
    /// of its own, so that `held` needs no locked add on the event path.
    pub evicted: AtomicU64,
}

impl Cell {
    fn new() -> Self {
        Cell {
            worker_id: AtomicU64::new(0),
            dp_rank: AtomicU32::new(0),
            live: AtomicBool::new(false),
            held: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
        }
    }

    /// The blocks the worker holds: `held` less `evicted` (DESIGN.md,
    /// invariant 3). `evicted` is read first (acquire, so that `held` is
    /// read after it), so a pair read across an eviction counts the block as
    /// still held rather than falling short; saturating, since within an
    /// event in flight the evictor may take a block the event has not
    /// counted yet.
    #[inline]
    pub fn blocks(&self) -> u64 {
        let evicted = self.evicted.load(Ordering::Acquire);
        self.held.load(Ordering::Relaxed).saturating_sub(evicted)
    }

    /// The worker, if lookups report this index. Read inside an epoch (see
    /// [`Cells::epoch`]); the key's loads pair with [`Cells::assign`]'s stores.
    #[inline]
    pub fn live_worker(&self) -> Option<WorkerKey> {
        self.live.load(Ordering::Relaxed).then(|| {
            WorkerKey::new(
                self.worker_id.load(Ordering::Relaxed),
                self.dp_rank.load(Ordering::Relaxed),
            )
        })
    }
}

/// Buckets: enough for every `u32` index.
const BUCKETS: usize = 27;

/// The bucket and position of index `idx`: bucket `b` starts at index 64·(2^b − 1).
#[inline]
fn locate(idx: u32) -> (usize, usize) {
    let i = u64::from(idx) + 64;
    let b = 57 - i.leading_zeros() as usize;
    (b, (i - (64 << b)) as usize)
}

/// The cells of every interned index, and the epoch of the changes lookups
/// must not straddle.
pub(crate) struct Cells {
    buckets: [OnceLock<Arc<[Cell]>>; BUCKETS],
    /// Odd while a change is under way; see [`Cells::change`].
    epoch: AtomicU64,
    /// Indices given out and not live. Raised when a hidden index is given out
    /// (before its first block is stored, which reaches lookups through the
    /// table's locks) or hidden by a change; lowered only by changes.
    hidden: AtomicU64,
}

impl Default for Cells {
    fn default() -> Self {
        Cells {
            buckets: std::array::from_fn(|_| OnceLock::new()),
            epoch: AtomicU64::new(0),
            hidden: AtomicU64::new(0),
        }
    }
}

impl Cells {
    /// The cell of `idx`, if its bucket exists.
    #[inline]
    pub fn get(&self, idx: u32) -> Option<&Cell> {
        let (b, at) = locate(idx);
        self.buckets[b].get().map(|cells| &cells[at])
    }

    /// Gives index `idx` to `worker`: returns its bucket and position (for the
    /// worker's slot to keep) with its counts at 0. The caller serialises
    /// assignments with the evictor (both hold the indices' mutex) and only
    /// assigns a free index, which holds no block.
    pub fn assign(&self, idx: u32, worker: WorkerKey, live: bool) -> (Arc<[Cell]>, usize) {
        let (b, at) = locate(idx);
        let bucket =
            self.buckets[b].get_or_init(|| (0..64usize << b).map(|_| Cell::new()).collect());
        let cell = &bucket[at];
        cell.held.store(0, Ordering::Relaxed);
        cell.evicted.store(0, Ordering::Relaxed);
        // Release: a lookup that reads the new key (after a removal bumped the
        // epoch, then freed the index) also sees that bump.
        cell.worker_id.store(worker.worker_id, Ordering::Release);
        cell.dp_rank.store(worker.dp_rank, Ordering::Release);
        cell.live.store(live, Ordering::Release);
        if !live {
            self.hidden.fetch_add(1, Ordering::Release);
        }
        (Arc::clone(bucket), at)
    }

    /// The epoch a lookup starts in, or `None` while a change is under way.
    #[inline]
    pub fn epoch(&self) -> Option<u64> {
        let epoch = self.epoch.load(Ordering::Acquire);
        (epoch & 1 == 0).then_some(epoch)
    }

    /// Whether nothing changed since `epoch`: what the lookup read is one state.
    #[inline]
    pub fn unchanged(&self, epoch: u64) -> bool {
        fence(Ordering::Acquire);
        self.epoch.load(Ordering::Relaxed) == epoch
    }

    /// Makes one change lookups must see whole or not at all: setting which
    /// indices are live ([`Cells::set_live`]) before an index changes hands or
    /// when a dump is swapped in. Callers serialise changes (under the index's
    /// interned-index lock).
    pub fn change(&self, f: impl FnOnce(&Self)) {
        let epoch = self.epoch.load(Ordering::Relaxed);
        self.epoch.store(epoch + 1, Ordering::Relaxed);
        fence(Ordering::Release);
        f(self);
        self.epoch.store(epoch + 2, Ordering::Release);
    }

    /// Shows or hides a given-out index; inside [`Cells::change`].
    pub fn set_live(&self, idx: u32, live: bool) {
        if let Some(cell) = self.get(idx)
            && cell.live.swap(live, Ordering::Relaxed) != live
        {
            if live {
                self.hidden.fetch_sub(1, Ordering::Relaxed);
            } else {
                self.hidden.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Takes index `idx` back from its worker, live or hidden; inside
    /// [`Cells::change`].
    pub fn free(&self, idx: u32) {
        if let Some(cell) = self.get(idx)
            && !cell.live.swap(false, Ordering::Relaxed)
        {
            self.hidden.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Whether some given-out index is hidden. A walk asks after reading the
    /// table: a hidden index whose bits it met was counted before them.
    #[inline]
    pub fn any_hidden(&self) -> bool {
        self.hidden.load(Ordering::Acquire) != 0
    }

    /// Whether lookups report index `idx`.
    #[inline]
    pub fn is_live(&self, idx: u32) -> bool {
        self.get(idx)
            .is_some_and(|c| c.live.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_tile_the_indices() {
        let mut expected = (0, 0);
        for idx in 0..100_000u32 {
            assert_eq!(locate(idx), expected, "index {idx}");
            expected.1 += 1;
            if expected.1 == 64 << expected.0 {
                expected = (expected.0 + 1, 0);
            }
        }
        assert_eq!(locate(u32::MAX).0, BUCKETS - 1);
    }
}

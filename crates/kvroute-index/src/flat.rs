//! A flat map from `u64` keys to small `Copy` values, of our own: the block
//! table's shards (chain key → entry) and every worker's engine map (engine
//! block hash → block) are these.
//!
//! Open addressing with linear probing and backward-shift deletion (no
//! tombstones), one slot per entry (key and value, no control bytes), at most
//! 7/8 full, grown by a quarter (doubled only under 64 slots; a short table
//! with a floor skips lengths of that chain) and shrunk under
//! a quarter of what it may hold (a sixth with a floor); a table churning at its size is laid out
//! again sparser (see [`CHURN_MAX_SIXTEENTHS`]). A table of any length: the home slot is the key's hash
//! scaled to the length (`hash × len >> 64`), not masked to a power of two, so
//! growing by a quarter keeps the tables 70–87 % full (doubling left them
//! 44–87 %, 63 % on average: a third of every table's memory was empty).
//!
//! It replaced `HashMap` for two reasons. A walk can prefetch the slots of the blocks ahead of the one it
//! probes: a path's chain keys are computed without the table, and a routing decision over 256 matched
//! blocks of a million otherwise waited for one cache miss after another
//! (docs/measurements/index-vs-dynamo.md, "Layout choices": "The walk's cache misses"). And without
//! hashbrown's control byte a 16-byte engine-map slot costs 16 bytes, not 17, per membership (and a
//! block-table slot 20).

/// Marks an empty slot; the entry of key 0 is kept beside the slots.
const EMPTY: u64 = 0;
/// A key's hash, which picks its home slot, is the key times this (odd).
const HASH_MUL: u64 = 0x9E37_79B9_7F4A_7C15;
/// Slots of the smallest table.
const MIN_SLOTS: usize = 4;
/// Slots a table grows by at least.
const MIN_GROWTH: usize = 8;
/// Tables shorter than this double: a growing index resizes each worker's
/// small engine map fewer times. The bound is low because doubling longer
/// tables costs bytes per membership, which the memory goal counts
/// (docs/measurements/index-vs-dynamo.md, "Layout choices").
const DOUBLED_BELOW: usize = 64;
/// A table with a floor (a block-table shard) shorter than this many floors
/// grows at least twofold, to a length of the same chain of quarter growths (see
/// [`next_length`]), so that the lengths it ends at past them are the ones it
/// would have reached a quarter at a time: end-state memory is the same, and the
/// entries are moved far fewer times on the way (at 1,024 workers a shard grows
/// from empty to 3,615 slots in 9 resizes, not 21, moving each entry 2.1 times,
/// not 4.4; docs/measurements/index-vs-dynamo.md, "Layout choices": "Ingest
/// under churn"). The price is density while a shard is short (up to 2.5× its
/// need below ~2,000 entries, a few MB over all 64 shards).
const JUMPED_BELOW_FLOORS: usize = 4;
/// Most slots in use, in eighths of the table.
const MAX_EIGHTHS: usize = 7;
/// A table that lost as many entries as it has slots since it was laid out,
/// without growing or shrinking, is churning (a worker's pool at its size,
/// evicting a block for each it stores). If it is more than this many
/// sixteenths full it is laid out again [`CHURN_SIXTEENTHS`] full, so that its
/// probes stay short: an insert probes to the end of a cluster, and a removal
/// shifts back the rest of one, about 17 slots at 7/8 full, 6 at 5/8 and 3 at
/// 1/2. Tables that only grow (a fleet filling up) stay dense: their cost is
/// growth, not probing, and their bytes are what the memory goals count.
/// Indexed by whether the table has a floor: a block-table shard 3/4 → 5/8, a
/// worker's engine map 1/2 → 7/16 (a full pool's engine map sits near 0.71
/// full, so a 3/4 trigger would never lay it out again). Each trades some heap
/// per membership in the churned state for shorter shifts and probes
/// (docs/measurements/index-vs-dynamo.md, "Layout choices"). Sparser still is not faster: a table laid out 3/8 or 5/16 full is near the
/// shrink bound (a quarter of what it may hold), and a pool dipping below it
/// shrank and regrew.
const CHURN_MAX_SIXTEENTHS: [usize; 2] = [8, 12];
/// How full a churning table is laid out, in sixteenths, indexed like
/// [`CHURN_MAX_SIXTEENTHS`].
const CHURN_SIXTEENTHS: [usize; 2] = [7, 10];
/// A table with a floor (a block-table shard) shrinks once under this fraction of
/// what it may hold, a table without one under a quarter. At 16 workers a shard's
/// share of the blocks swings between ~70 and ~300 entries as conversations come
/// and go, and under a quarter the shards went round 256 → 782 → 389 → 256 slots a
/// few times a round. A sixth trades a little heap in the churned state for
/// fewer resizes; an eighth cost twice the heap for little more
/// (docs/measurements/index-vs-dynamo.md, "Layout choices").
const FLOORED_SHRINK_UNDER: usize = 6;
/// Old slots a resize gathers the entries of before placing them.
const RESIZE_CHUNK: usize = 32;
/// Slots an insert's probe tests at once (see [`FlatMap::key_or_empty`]).
const PROBE_GROUP: usize = 4;
/// Cache lines an insert's prefetch brings in from the key's home slot.
const INSERT_LINES: usize = 4;

/// The length after `len` in the chain every table grows along: doubled
/// under [`DOUBLED_BELOW`] slots, else grown by a quarter.
fn next_length(len: usize) -> usize {
    if len < DOUBLED_BELOW {
        len + len.max(MIN_GROWTH)
    } else {
        len + len.div_ceil(4)
    }
}

/// A value whose all-zero bytes are a valid value: a new table is asked of
/// the allocator zeroed (all slots empty) instead of written slot by slot.
/// Zeroing was a sixth of a growing index's ingest (the 1,024-worker replay);
/// zeroed memory from the allocator is often fresh pages that need no writes.
///
/// # Safety
///
/// All-zero bytes must be a valid `Self`.
pub(crate) unsafe trait Zeroable: Copy {}

// SAFETY: every bit pattern is a valid `u64`.
unsafe impl Zeroable for u64 {}

/// A key and its value. The key is kept as two halves so that a value of
/// 4-byte alignment packs beside it: a block-table slot is 20 bytes, not 24.
#[derive(Clone, Copy)]
#[repr(C)]
struct Slot<V> {
    key: [u32; 2],
    value: V,
}

impl<V> Slot<V> {
    #[inline]
    fn key(&self) -> u64 {
        u64::from(self.key[0]) | u64::from(self.key[1]) << 32
    }

    #[inline]
    fn set_key(&mut self, key: u64) {
        self.key = halves(key);
    }
}

/// The home slot of `key` in a table of `len` slots.
#[inline]
fn home_in(key: u64, len: usize) -> usize {
    // The product's top bits mix all of the key's (engine hashes may be
    // small integers, and a chain key's low bits are its shard's, the same
    // for every block of a shard); scaled to the length, not masked.
    let hash = key.wrapping_mul(HASH_MUL);
    ((u128::from(hash) * len as u128) >> 64) as usize
}

/// The slot after `at` in a table of `len` slots, cyclically.
#[inline]
fn next_in(at: usize, len: usize) -> usize {
    if at + 1 == len { 0 } else { at + 1 }
}

/// Copies the entries of `slots` (at most [`RESIZE_CHUNK`]) to the front of
/// `into`, in order, without a branch; returns how many.
#[inline(always)]
fn gather<V: Copy>(slots: &[Slot<V>], into: &mut [Slot<V>; RESIZE_CHUNK]) -> usize {
    let mut taken = 0;
    for slot in slots {
        // `taken` is below the slots read so far, so below `RESIZE_CHUNK`:
        // the modulo only spares a bounds check.
        into[taken % RESIZE_CHUNK] = *slot;
        taken += usize::from(slot.key() != EMPTY);
    }
    taken
}

/// [`FlatMap::remove_at`]'s backward shift from slot `next` on, the hole
/// at `hole`: moves back the slots that probed past the hole, up to the end
/// of the cluster or of the table, whichever comes first; returns whether it
/// met the cluster's end.
///
/// An entry may fill the hole iff its home is not cyclically in (hole, next]
/// (moving it would put it before its home): one unsigned range test modulo
/// 2^64, `home − (hole + 1) ≥ next − hole`, which is the cyclic one because
/// homes are below the length (the part of the interval through 2^64 holds no
/// home), whether or not the shift has wrapped. Chosen and copied without a
/// branch (a slot moved onto itself when it may not): whether a slot of a
/// churned table may move is a coin the branch predictor loses often, and
/// removals from churned tables are the 16-worker replay's main cost
/// (docs/measurements/index-vs-dynamo.md, "Layout choices").
#[inline(always)]
fn shift_back<V: Copy>(slots: &mut [Slot<V>], hole: &mut usize, mut next: usize) -> bool {
    let len = slots.len();
    while next < len {
        let key = slots[next].key();
        if key == EMPTY {
            return true;
        }
        let movable = home_in(key, len).wrapping_sub(*hole + 1) >= next.wrapping_sub(*hole);
        let from = std::hint::select_unpredictable(movable, next, *hole);
        // Indexed unchecked: this loop is the removal's hot path
        // (docs/measurements/index-vs-dynamo.md, "Layout choices").
        // SAFETY: `hole` is a slot of the table (the caller's, or an earlier
        // `next`), and `from` is `next` or `hole`.
        unsafe { *slots.get_unchecked_mut(*hole) = *slots.get_unchecked(from) };
        *hole = from;
        next += 1;
    }
    false
}

/// The halves of a key.
#[inline]
fn halves(key: u64) -> [u32; 2] {
    [key as u32, (key >> 32) as u32]
}

///
/// A table that grew past `FLOOR` slots never shrinks below it: a
/// block-table shard whose share of a small fleet's blocks comes and goes
/// (conversations end, others start) was otherwise shrunk and regrown over
/// and over, most of the resizes of a churning 16-worker index.
pub(crate) struct FlatMap<V, const FLOOR: usize = 0> {
    /// Empty, or at least `MIN_SLOTS` long.
    slots: Vec<Slot<V>>,
    /// Entries in `slots` (32 bits, so that `removals_left` fits beside it).
    in_slots: u32,
    /// Removals until the table has lost as many entries as it has slots since
    /// it was last laid out, or since it was last found not dense enough to be
    /// laid out again (see [`CHURN_MAX_SIXTEENTHS`]): its length less those
    /// removals. Counted down, so that a removal decrements and tests it in
    /// place instead of comparing a count with the length.
    removals_left: u32,
    /// The table shrinks once it holds fewer entries than this (see
    /// [`Self::shrink_below`]).
    shrink_below: u32,
    /// The most entries the table holds before it grows ([`MAX_EIGHTHS`] of its
    /// slots), kept from its last layout, so that an insert only compares. It
    /// must be set again wherever the slots are laid out.
    most: u32,
    zero: Option<V>,
}

impl<V, const FLOOR: usize> Default for FlatMap<V, FLOOR> {
    fn default() -> Self {
        Self {
            slots: Vec::new(),
            in_slots: 0,
            removals_left: 0,
            shrink_below: 0,
            most: 0,
            zero: None,
        }
    }
}

impl<V: Zeroable, const FLOOR: usize> FlatMap<V, FLOOR> {
    pub fn len(&self) -> usize {
        self.in_slots as usize + usize::from(self.zero.is_some())
    }

    /// Heap bytes of the slots.
    pub fn heap_bytes(&self) -> u64 {
        (self.slots.capacity() * size_of::<Slot<V>>()) as u64
    }

    #[inline]
    fn home(&self, key: u64) -> usize {
        home_in(key, self.slots.len())
    }

    /// The slot after `at`, cyclically.
    #[inline]
    fn next(&self, at: usize) -> usize {
        next_in(at, self.slots.len())
    }

    /// The slot of `key` (not 0), if present.
    #[inline]
    fn find(&self, key: u64) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let mut at = self.home(key);
        loop {
            match self.slots[at].key() {
                k if k == key => return Some(at),
                EMPTY => return None,
                _ => at = self.next(at),
            }
        }
    }

    #[inline]
    pub fn get(&self, key: u64) -> Option<&V> {
        if key == EMPTY {
            return self.zero.as_ref();
        }
        self.find(key).map(|at| &self.slots[at].value)
    }

    /// Starts bringing `key`'s first slot and the cache line after it into
    /// the cache: a lookup that finds its key probes about 2.8 slots on
    /// average at 78 % full (linear probing: (1 + 1/(1 − load)) / 2), 56
    /// bytes of 20-byte slots, so it often reads past its home slot's line. For
    /// the walk, where every block it reaches is probed; a stored chain's
    /// inserts use [`Self::prefetch_insert`].
    #[inline]
    pub fn prefetch_probe(&self, key: u64) {
        self.prefetch_lines(key, 2);
    }

    /// Starts bringing [`INSERT_LINES`] cache lines from `key`'s home slot into
    /// the cache, for an insert of a key that is likely new: it probes to the
    /// end of its home's cluster, about 11 slots at 78 % full (linear probing:
    /// (1 + 1/(1 − load)²) / 2), three to four lines of 16- or 20-byte slots,
    /// where the home slot's line alone left the rest to miss one after another
    /// (docs/measurements/index-vs-dynamo.md, "Layout choices": "Ingest at
    /// 1,024 workers").
    #[inline]
    pub fn prefetch_insert(&self, key: u64) {
        self.prefetch_lines(key, INSERT_LINES);
    }

    /// Starts bringing `lines` cache lines from `key`'s home slot on into the
    /// cache.
    #[inline]
    fn prefetch_lines(&self, key: u64, lines: usize) {
        if self.slots.is_empty() {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
            // The home slot's address, not a slice of the table from it: no
            // bounds check (a home is below the length).
            let slot: *const i8 = self.slots.as_ptr().wrapping_add(self.home(key)).cast();
            // SAFETY: SSE is part of x86_64's baseline; a prefetch is a hint
            // that reads nothing architecturally and cannot fault. The later
            // addresses may lie past the table, where it does nothing (they
            // are never read).
            unsafe {
                for line in 0..lines {
                    _mm_prefetch::<_MM_HINT_T0>(slot.wrapping_add(64 * line));
                }
            }
        }
    }

    /// Room for `additional` more entries without growing, grown by a
    /// quarter at least (so that reserving before each insert of a few does
    /// not resize every time).
    pub fn reserve(&mut self, additional: usize) {
        let needed = self.in_slots as usize + additional;
        if needed * 8 > self.slots.len() * MAX_EIGHTHS {
            self.resize(Self::slots_for(needed).max(self.grown()));
        }
    }

    /// The length a full table grows to: the next length of the growth chain
    /// ([`next_length`]), or, for a table with a floor while it is shorter
    /// than [`JUMPED_BELOW_FLOORS`] floors, the first length of the chain at
    /// least twice its own.
    fn grown(&self) -> usize {
        let len = self.slots.len();
        let mut next = next_length(len);
        while len < FLOOR * JUMPED_BELOW_FLOORS && next < 2 * len {
            next = next_length(next);
        }
        next
    }

    /// The value of `key`, made by `make` if absent; and whether it was made.
    /// Always inlined, as the other map operations the event path calls
    /// (`insert`, `remove`, `change_or_remove`, `remove_at`, the shard's
    /// `insert` and `remove`): a stored chain inserts each block into both
    /// tables, and that path is compiled once for each kind of index
    /// (`index::Limit`), where LLVM would otherwise leave them out of line
    /// (docs/measurements/index-vs-dynamo.md, "Layout choices").
    #[inline(always)]
    pub fn get_or_insert(&mut self, key: u64, make: impl FnOnce() -> V) -> (&mut V, bool) {
        if key == EMPTY {
            let made = self.zero.is_none();
            return (self.zero.get_or_insert_with(make), made);
        }
        if self.in_slots >= self.most {
            self.resize(self.grown());
        }
        let at = self.key_or_empty(key);
        // SAFETY: `key_or_empty` returns a slot of the table (indexed
        // unchecked: the insert is on the event path's hot loop).
        let slot = unsafe { self.slots.get_unchecked_mut(at) };
        if slot.key() == key {
            return (&mut slot.value, false);
        }
        *slot = Slot {
            key: halves(key),
            value: make(),
        };
        self.in_slots += 1;
        (&mut slot.value, true)
    }

    /// The first slot from `key`'s home on, cyclically, that holds `key` or
    /// is empty (the table is never full, so there is one): where `key` is,
    /// or where it goes. Tested [`PROBE_GROUP`] slots at a time, each group
    /// without a branch: a probe's length is a coin the branch predictor
    /// loses, once a probe slot by slot (1.2 mispredictions an insert at 16
    /// workers), once a group mostly.
    #[inline]
    fn key_or_empty(&self, key: u64) -> usize {
        let len = self.slots.len();
        let mut at = self.home(key);
        loop {
            if let Some(group) = self.slots.get(at..at + PROBE_GROUP) {
                let mut hits = 0u32;
                for (j, slot) in group.iter().enumerate() {
                    let k = slot.key();
                    hits |= u32::from((k == key) | (k == EMPTY)) << j;
                }
                if hits != 0 {
                    return at + hits.trailing_zeros() as usize;
                }
                at += PROBE_GROUP;
                if at == len {
                    at = 0;
                }
            } else {
                // The table's last slots, one at a time, up to the wrap.
                let k = self.slots[at].key();
                if k == key || k == EMPTY {
                    return at;
                }
                at = self.next(at);
            }
        }
    }

    /// Sets `key` to `value`; returns the value it replaced.
    #[inline]
    pub fn insert(&mut self, key: u64, value: V) -> Option<V> {
        let (slot, made) = self.get_or_insert(key, || value);
        (!made).then(|| std::mem::replace(slot, value))
    }

    /// Always inlined: a worker's removal event calls it for its engine map
    /// (see [`Self::get_or_insert`]).
    #[inline(always)]
    pub fn remove(&mut self, key: u64) -> Option<V> {
        if key == EMPTY {
            return self.zero.take();
        }
        let at = self.find(key)?;
        Some(self.remove_at(at))
    }

    /// Lets `change` update the value of `key`, then drops the entry if
    /// `change` returned true; false if `key` is absent. One probe, where
    /// `get_mut` then `remove` took two (a block's last holder leaving).
    /// Always inlined: see [`Self::get_or_insert`].
    #[inline(always)]
    pub fn change_or_remove(&mut self, key: u64, change: impl FnOnce(&mut V) -> bool) -> bool {
        if key == EMPTY {
            let Some(value) = self.zero.as_mut() else {
                return false;
            };
            if change(value) {
                self.zero = None;
            }
            return true;
        }
        let Some(at) = self.find(key) else {
            return false;
        };
        if change(&mut self.slots[at].value) {
            self.remove_at(at);
        }
        true
    }

    /// Removes the entry in slot `at`; returns its value. Always inlined: a
    /// block-table shard's removal calls it (see [`Self::get_or_insert`]).
    #[inline(always)]
    fn remove_at(&mut self, at: usize) -> V {
        let removed = self.slots[at].value;
        // Moves back the slots after the hole that probed past it, to the end
        // of the cluster: up to the table's end, then from its start if the
        // cluster goes on. Two loops, where one wrapped `next` at each slot:
        // the loop's bound is the wrap's test.
        let mut hole = at;
        if !shift_back(self.slots.as_mut_slice(), &mut hole, at + 1) {
            shift_back(self.slots.as_mut_slice(), &mut hole, 0);
        }
        self.slots[hole].set_key(EMPTY);
        self.in_slots -= 1;
        self.removals_left -= 1;
        // Two compares a removal; what they call for is worked out only then:
        // removals from full tables are the 16-worker replay's main cost
        // (docs/measurements/index-vs-dynamo.md, "Layout choices").
        if self.in_slots < self.shrink_below || self.removals_left == 0 {
            self.relayout_after_removals();
        }
        removed
    }

    /// Gives memory back once under [`Self::shrink_below`] entries; else,
    /// once the table lost as many entries as it has slots, lays it out
    /// again sparser if it is churning dense (see [`CHURN_MAX_SIXTEENTHS`]),
    /// or counts its removals afresh.
    #[cold]
    fn relayout_after_removals(&mut self) {
        let (len, entries) = (self.slots.len(), self.in_slots as usize);
        if self.in_slots < self.shrink_below {
            self.resize(Self::slots_for(entries * 2).max(FLOOR));
        } else if entries * 16 > len * CHURN_MAX_SIXTEENTHS[usize::from(FLOOR > 0)] {
            self.resize((entries * 16).div_ceil(CHURN_SIXTEENTHS[usize::from(FLOOR > 0)]));
        } else {
            self.removals_left = Self::removals_for(len);
        }
    }

    /// Entries under which a table of `len` slots shrinks: a quarter of what
    /// it may hold (a sixth with a floor, and never to below the floor), so
    /// that under churn a shard whose share of the blocks moves around, or a
    /// worker's emptied engine map, gives memory back; none for a short
    /// table.
    fn shrink_below(len: usize) -> u32 {
        let usable = len * MAX_EIGHTHS / 8;
        let shrink_under = if FLOOR > 0 { FLOORED_SHRINK_UNDER } else { 4 };
        if usable > 64 && len > FLOOR {
            // `entries * shrink_under < usable`, as a bound on entries.
            u32::try_from(usable.div_ceil(shrink_under)).unwrap_or(u32::MAX)
        } else {
            0
        }
    }

    /// Every entry, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, V)> + '_ {
        let zero = self.zero.map(|v| (EMPTY, v));
        let slotted = self.slots.iter().filter(|s| s.key() != EMPTY);
        zero.into_iter().chain(slotted.map(|s| (s.key(), s.value)))
    }

    /// Keeps the entries `keep` accepts, in a table sized for them.
    pub fn retain(&mut self, mut keep: impl FnMut(u64, &V) -> bool) {
        let kept: Vec<(u64, V)> = self.iter().filter(|(k, v)| keep(*k, v)).collect();
        *self = Self::default();
        self.reserve(kept.len());
        for (key, value) in kept {
            self.insert(key, value);
        }
    }

    /// [`Self::removals_left`] of a table of `len` slots just laid out.
    fn removals_for(len: usize) -> u32 {
        u32::try_from(len).unwrap_or(u32::MAX)
    }

    /// Slots of a table that takes `entries` before it grows.
    fn slots_for(entries: usize) -> usize {
        (entries * 8).div_ceil(MAX_EIGHTHS).max(MIN_SLOTS)
    }

    /// Moves the entries into a table of `slots` slots. Homes grow with the
    /// key's hash (scaled, not masked), so the old table read from an empty
    /// slot on, cyclically, yields the entries nearly in the new table's
    /// order of homes: the writes go through the new table in order, not
    /// scattered (a table grown by a quarter is rehashed more often than a
    /// doubled one).
    fn resize(&mut self, slots: usize) {
        self.removals_left = Self::removals_for(slots);
        self.shrink_below = Self::shrink_below(slots);
        self.most = u32::try_from(slots * MAX_EIGHTHS / 8).unwrap_or(u32::MAX);
        let old = std::mem::replace(&mut self.slots, Self::empty_slots(slots));
        let Some(&first) = old.first() else {
            return;
        };
        let start = old.iter().position(|s| s.key() == EMPTY).unwrap_or(0);
        // The old slots are read a chunk at a time, their entries first
        // gathered without a branch (whether a slot of a table 70-87 % full is
        // taken is a coin the predictor loses a fifth of the time), then
        // placed. The run of slots being filled: all of `run_start..run_end`
        // is taken and nothing at or past `run_end` is, so an entry whose home
        // is in the run or past it goes to the later of its home and the
        // run's end without a probe (whose loop mispredicted as often); one
        // whose home is before the run (an entry the old table held out of
        // order, or one whose probe wraps) is probed for. Resizing was nearly
        // half of the 1,024-worker replay's mispredicted branches.
        // Whole chunks are gathered by a loop of a known length, which the
        // compiler unrolls.
        let mut gathered = [first; RESIZE_CHUNK];
        let mut run = 0..0;
        for half in [&old[start..], &old[..start]] {
            let (chunks, rest) = half.as_chunks::<RESIZE_CHUNK>();
            for chunk in chunks {
                let taken = gather(chunk, &mut gathered);
                self.place_gathered(&gathered[..taken], &mut run);
            }
            let taken = gather(rest, &mut gathered);
            self.place_gathered(&gathered[..taken], &mut run);
        }
    }

    /// Places a resize's gathered entries, in the old table's order, `run`
    /// being the run of slots being filled (see [`Self::resize`]).
    #[inline(always)]
    fn place_gathered(&mut self, gathered: &[Slot<V>], run: &mut std::ops::Range<usize>) {
        let slots = self.slots.len();
        for slot in gathered {
            let home = self.home(slot.key());
            let at = home.max(run.end);
            if home >= run.start && at < slots {
                run.start = if home > run.end { home } else { run.start };
                run.end = at + 1;
                self.slots[at] = *slot;
            } else if self.place(*slot) == run.end {
                run.end += 1;
            }
        }
    }

    /// `len` empty slots, zeroed by the allocator.
    fn empty_slots(len: usize) -> Vec<Slot<V>> {
        let layout = std::alloc::Layout::array::<Slot<V>>(len).expect("a table fits in memory");
        if layout.size() == 0 {
            return Vec::new();
        }
        // SAFETY: the layout is not empty; a null pointer is handled. Zeroed
        // bytes are a valid slot (an empty key, a valid `V`: `Zeroable`), so
        // all `len` are initialised, and the pointer comes from the global
        // allocator with the layout `Vec` uses for a capacity of `len`.
        unsafe {
            let ptr = std::alloc::alloc_zeroed(layout);
            if ptr.is_null() {
                std::alloc::handle_alloc_error(layout);
            }
            Vec::from_raw_parts(ptr.cast(), len, len)
        }
    }

    /// Puts a slot at the first free one from its home (resizing only: the key
    /// is not in the table); returns where.
    #[inline]
    fn place(&mut self, slot: Slot<V>) -> usize {
        let mut at = self.home(slot.key());
        while self.slots[at].key() != EMPTY {
            at = self.next(at);
        }
        self.slots[at] = slot;
        at
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Against a `HashMap`, through growth, removals (plain, and after a
        /// change) that shift clusters back, shrinking, retain and key 0. Keys
        /// from a small range collide often.
        #[test]
        fn behaves_as_a_map(ops in prop::collection::vec((0..4u8, 0..400u64), 1..3_000)) {
            against_a_map::<0>(&ops)?;
            // A table kept from shrinking below 64 slots.
            against_a_map::<64>(&ops)?;
        }
    }

    proptest! {
        /// A resize to any length that holds the entries keeps every one
        /// findable, whatever order the old table held them in and wherever
        /// its clusters wrap: keys crowded into a few homes (long clusters,
        /// entries out of order) or spread, including the table's last homes.
        #[test]
        fn a_resize_keeps_every_entry(
            hashes in prop::collection::btree_set(any::<u64>(), 1..300),
            crowd in 0..3u32,
            lengths in prop::collection::vec(0..2_000usize, 1..6),
        ) {
            let keys = crowded_keys(hashes, crowd);
            let mut map = FlatMap::<u64>::default();
            for &key in &keys {
                map.insert(key, !key);
            }
            for extra in lengths {
                let len = FlatMap::<u64>::slots_for(keys.len()) + extra;
                map.resize(len);
                prop_assert_eq!(map.slots.len(), len);
                for &key in &keys {
                    prop_assert_eq!(map.get(key), Some(&!key));
                }
                prop_assert_eq!(map.iter().count(), keys.len());
            }
        }
    }

    proptest! {
        /// The grouped probe stops where a probe slot by slot from the
        /// key's home stops (the key's slot, else the first empty one), for
        /// keys present and absent, crowded (clusters that wrap past the
        /// table's end) or spread, in tables of any length and load.
        #[test]
        fn the_grouped_probe_stops_where_a_slot_by_slot_probe_does(
            hashes in prop::collection::btree_set(any::<u64>(), 0..200),
            probes in prop::collection::btree_set(any::<u64>(), 1..50),
            crowd in 0..3u32,
            extra in 0..40usize,
        ) {
            let keys = crowded_keys(hashes, crowd);
            let mut map = FlatMap::<u64>::default();
            for &key in &keys {
                map.insert(key, !key);
            }
            map.resize(FlatMap::<u64>::slots_for(keys.len()) + extra);
            let absent = crowded_keys(probes, crowd);
            for &key in absent.iter().chain(keys.iter().take(20)) {
                let mut at = map.home(key);
                while map.slots[at].key() != key && map.slots[at].key() != EMPTY {
                    at = map.next(at);
                }
                prop_assert_eq!(map.key_or_empty(key), at);
            }
        }
    }

    proptest! {
        /// Removals in any order from clusters crowded into a few homes (long
        /// clusters, some wrapping past the table's end) or spread leave
        /// exactly the other keys findable, each with its value: the backward
        /// shift moves back every entry that may move, and none before its
        /// home.
        #[test]
        fn removals_keep_every_other_entry(
            hashes in prop::collection::btree_set(any::<u64>(), 1..300),
            crowd in 0..3u32,
            order in any::<u64>(),
        ) {
            let keys = crowded_keys(hashes, crowd);
            let mut map = FlatMap::<u64>::default();
            for &key in &keys {
                map.insert(key, !key);
            }
            let mut left: Vec<u64> = keys.into_iter().collect();
            // A removal order of the keys, picked by `order`.
            left.sort_by_key(|&k| (k ^ order).wrapping_mul(0x2545_F491_4F6C_DD1D));
            while let Some(key) = left.pop() {
                prop_assert_eq!(map.remove(key), Some(!key));
                prop_assert_eq!(map.get(key), None);
                for &other in &left {
                    prop_assert_eq!(map.get(other), Some(&!other));
                }
                prop_assert_eq!(map.len(), left.len());
            }
        }
    }

    /// Keys whose hashes (what picks their homes) are `hashes`, crowded near a
    /// few: the first homes, the middle, and the last ones, whose clusters
    /// wrap (`crowd` 1 or 2, closer with 2); or spread (`crowd` 0).
    fn crowded_keys(
        hashes: std::collections::BTreeSet<u64>,
        crowd: u32,
    ) -> std::collections::BTreeSet<u64> {
        // The key whose hash is `hash`.
        let inverse = (0..5).fold(HASH_MUL, |inv: u64, _| {
            inv.wrapping_mul(2u64.wrapping_sub(HASH_MUL.wrapping_mul(inv)))
        });
        hashes
            .into_iter()
            .map(|h| match crowd {
                0 => h,
                _ => [0, u64::MAX / 2, u64::MAX - (1 << 20)][(h % 3) as usize]
                    .wrapping_add(h >> (40 + 8 * crowd)),
            })
            .map(|h| h.wrapping_mul(inverse))
            .filter(|&k| k != EMPTY)
            .collect()
    }

    fn against_a_map<const FLOOR: usize>(ops: &[(u8, u64)]) -> Result<(), TestCaseError> {
        let mut map = FlatMap::<u64, FLOOR>::default();
        let mut model = HashMap::new();
        for (i, &(op, k)) in ops.iter().enumerate() {
            // Spread some keys so that homes differ, keep others close.
            let key = if k % 2 == 0 {
                k
            } else {
                k.wrapping_mul(0x2545_F491_4F6C_DD1D)
            };
            let i = i as u64;
            match op {
                0 => {
                    let (v, made) = map.get_or_insert(key, || i);
                    let was = model.get(&key).copied();
                    prop_assert_eq!(made, was.is_none());
                    prop_assert_eq!(*v, was.unwrap_or(i));
                    model.entry(key).or_insert(i);
                }
                1 => prop_assert_eq!(map.insert(key, i), model.insert(key, i)),
                2 => prop_assert_eq!(map.remove(key), model.remove(&key)),
                _ => {
                    // Changed, and dropped when the old value is odd.
                    let present = map.change_or_remove(key, |v| {
                        let odd = *v % 2 == 1;
                        *v = i;
                        odd
                    });
                    prop_assert_eq!(present, model.contains_key(&key));
                    match model.get(&key).copied() {
                        Some(old) if old % 2 == 1 => drop(model.remove(&key)),
                        Some(_) => drop(model.insert(key, i)),
                        None => {}
                    }
                }
            }
            prop_assert_eq!(map.len(), model.len());
        }
        for k in 0..400u64 {
            for key in [k, k.wrapping_mul(0x2545_F491_4F6C_DD1D)] {
                prop_assert_eq!(map.get(key), model.get(&key));
            }
        }
        let mut all: Vec<(u64, u64)> = map.iter().collect();
        all.sort_unstable();
        let mut expected: Vec<(u64, u64)> = model.iter().map(|(&k, &v)| (k, v)).collect();
        expected.sort_unstable();
        prop_assert_eq!(all, expected);
        map.retain(|k, _| k % 3 != 0);
        model.retain(|k, _| k % 3 != 0);
        prop_assert_eq!(map.len(), model.len());
        // Drained, through the shrinking.
        let keys: Vec<u64> = model.keys().copied().collect();
        for (n, key) in keys.iter().enumerate() {
            prop_assert_eq!(map.remove(*key), model.remove(key));
            if n % 16 == 0 {
                for other in &keys[n + 1..] {
                    prop_assert!(map.get(*other).is_some());
                }
            }
        }
        prop_assert_eq!(map.len(), 0);
        Ok(())
    }

    /// A table with a floor grows from empty in fewer, larger steps while it
    /// is short, along the chain of quarter growths, so that past the jumps it
    /// is as long as a table without a floor holding the same entries (the
    /// same end-state memory), and holds the same keys.
    #[test]
    fn a_table_with_a_floor_ends_as_long_as_one_grown_a_quarter_at_a_time() {
        let mut floored = FlatMap::<u64, 256>::default();
        let mut plain = FlatMap::<u64>::default();
        let mut lengths = std::collections::BTreeSet::new();
        for i in 1..=20_000u64 {
            let key = i.wrapping_mul(0x2545_F491_4F6C_DD1D);
            floored.insert(key, i);
            plain.insert(key, i);
            lengths.insert(floored.slots.len());
            // The last jump lands under 2.5 times where the jumps end.
            assert!(plain.slots.len() <= floored.slots.len());
            if plain.slots.len() >= 256 * JUMPED_BELOW_FLOORS * 5 / 2 {
                assert_eq!(floored.slots.len(), plain.slots.len(), "at {i} entries");
            }
        }
        let below = lengths.range(..256 * JUMPED_BELOW_FLOORS).count();
        let plain_steps = {
            let (mut len, mut steps) = (0, 0);
            while len < 256 * JUMPED_BELOW_FLOORS {
                len = next_length(len);
                steps += 1;
            }
            steps
        };
        assert!(
            below * 2 <= plain_steps,
            "{below} lengths below the jumps' end, against {plain_steps}"
        );
        for i in 1..=20_000u64 {
            assert_eq!(floored.get(i.wrapping_mul(0x2545_F491_4F6C_DD1D)), Some(&i));
        }
    }

    /// A table with a floor keeps its length while its entries stay above a
    /// sixth of what it may hold, and shrinks below that; one without a floor
    /// shrinks under a quarter.
    #[test]
    fn a_table_with_a_floor_shrinks_only_far_below_its_length() {
        let key = |i: u64| i.wrapping_mul(0x2545_F491_4F6C_DD1D);
        let mut floored = FlatMap::<u64, 64>::default();
        let mut plain = FlatMap::<u64>::default();
        for i in 1..=1_000 {
            floored.insert(key(i), i);
            plain.insert(key(i), i);
        }
        let (len, plain_len) = (floored.slots.len(), plain.slots.len());
        let usable = len * MAX_EIGHTHS / 8;
        let mut i = 1;
        while (floored.len() - 1) * FLOORED_SHRINK_UNDER >= usable {
            floored.remove(key(i));
            plain.remove(key(i));
            i += 1;
            assert_eq!(floored.slots.len(), len, "at {} entries", floored.len());
        }
        assert!(plain.slots.len() < plain_len, "the plain table shrank");
        floored.remove(key(i));
        assert!(floored.slots.len() < len, "shrank below a sixth");
    }

    /// A sliding window of keys: each insert past `window` removes the
    /// oldest. Returns the map and the keys it holds.
    fn churned(window: usize, inserts: u64) -> (FlatMap<u64>, std::collections::VecDeque<u64>) {
        let mut map = FlatMap::<u64>::default();
        let mut held = std::collections::VecDeque::new();
        for i in 1..=inserts {
            let key = i.wrapping_mul(0x2545_F491_4F6C_DD1D);
            assert_eq!(map.insert(key, i), None);
            held.push_back(key);
            if held.len() > window {
                let old = held.pop_front().unwrap();
                assert!(map.remove(old).is_some());
            }
        }
        (map, held)
    }

    /// A table without a floor (an engine map) at its size under churn is
    /// laid out at most half full, and keeps exactly its keys; one that only
    /// grew stays over 5/8 full.
    #[test]
    fn a_churning_table_is_laid_out_sparser() {
        // 450 keys grow the table to 605 slots, 0.74 full.
        let (map, held) = churned(450, 20_000);
        let load = map.len() as f64 / map.slots.len() as f64;
        assert!(load <= 0.5, "churning at load {load:.2}");
        assert_eq!(map.len(), held.len());
        for key in &held {
            assert!(map.get(*key).is_some());
        }
        for i in 1..=20_000 - 450u64 {
            assert!(map.get(i.wrapping_mul(0x2545_F491_4F6C_DD1D)).is_none());
        }
        let (grown, _) = churned(usize::MAX, 5_000);
        let load = grown.len() as f64 / grown.slots.len() as f64;
        assert!(load > 0.625, "grown to load {load:.2}");
    }
}

//! A bounded per-thread cache of the token ids of pre-tokenizer pieces.
//!
//! tiktoken splits text into pieces (mostly a word with its leading space) and
//! runs BPE on each piece alone, so a piece's ids never depend on its
//! neighbours: `" caching"` is the same ids wherever it occurs. Most pieces
//! are one token and found in the vocabulary (`vocab` module); this cache
//! holds the others, words BPE splits, so that a frequent one is not merged
//! again each time. Hugging Face's BPE models keep the same kind of word
//! cache; this one is also used for Hugging Face tokenizers that split as
//! cl100k_base does (see [`crate::hf`]), in front of their model.
//!
//! Each thread has its own cache (no lock on a path taken once per piece).
//! It is a table of [`PIECE_CACHE_ENTRIES`] entries of two cache lines each,
//! holding the piece's bytes (at most [`MAX_CACHED_PIECE_BYTES`]) and ids (at
//! most [`MAX_CACHED_IDS`]) inline: 4 MiB, no allocation, one hash of four
//! words and the key's line of each way per lookup. (The `quick_cache` map it replaces kept
//! keys and ids on the heap: two allocations per insert, and a `memcmp`
//! through a pointer per lookup.) Entries are in sets of [`WAYS`]; each set
//! evicts as a clock does, passing over once the entries hit since the hand
//! last passed them, so the frequent pieces stay while a stream of rare ones
//! passes through.

use crate::vocab::words_at;
use kvroute_index::huge::HugeSlice;

/// Pieces one thread remembers at most.
pub(crate) const PIECE_CACHE_ENTRIES: usize = 1 << 15;

/// Longer pieces (long runs of spaces or symbols, long words) are encoded
/// every time: they are rare, and not keeping them keeps entries small.
pub(crate) const MAX_CACHED_PIECE_BYTES: usize = 32;

/// Pieces of more tokens are encoded every time (rare: pieces of odd
/// bytes). Rare words BPE splits into many tokens are the costliest to merge
/// again (merging is quadratic in a piece's length), so the bound is high
/// enough to keep them (docs/measurements/tokenize.md, "Where a request's CPU
/// goes").
pub(crate) const MAX_CACHED_IDS: usize = 14;

/// Entries per set.
const WAYS: usize = 4;

pub(crate) struct PieceCache {
    /// Sets of [`WAYS`] entries, a power of two of them.
    entries: HugeSlice<Entry>,
    /// Each set's clock hand: where it looks for the next entry to replace.
    hands: Box<[u8]>,
}

/// `C` layout: what a lookup compares (the key and its length) in the first
/// line, the ids from there into the second.
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
struct Entry {
    /// The piece's bytes, zero after its end.
    key: [u64; MAX_CACHED_PIECE_BYTES / 8],
    /// The piece's length; 0: an empty entry.
    len: u8,
    /// How many of `ids` are the piece's.
    count: u8,
    /// Hit since its set last evicted.
    hit: bool,
    ids: [u32; MAX_CACHED_IDS],
}

impl Default for PieceCache {
    fn default() -> Self {
        Self::with_capacity(PIECE_CACHE_ENTRIES)
    }
}

impl PieceCache {
    /// A cache of `capacity` entries, rounded up to a power of two sets.
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        let sets = capacity.div_ceil(WAYS).next_power_of_two();
        PieceCache {
            entries: HugeSlice::filled(Entry::default(), sets * WAYS),
            hands: vec![0; sets].into_boxed_slice(),
        }
    }

    /// Appends the ids of the piece `text[start..end]` to `out`: remembered
    /// ones, or those `encode` appends.
    pub(crate) fn encode_into<E>(
        &mut self,
        text: &[u8],
        start: usize,
        end: usize,
        out: &mut Vec<u32>,
        encode: impl FnOnce(&[u8], &mut Vec<u32>) -> Result<(), E>,
    ) -> Result<(), E> {
        let piece = &text[start..end];
        if piece.is_empty() || piece.len() > MAX_CACHED_PIECE_BYTES {
            return encode(piece, out);
        }
        let key = words_at(text, start, end);
        let set = self.set(&key, piece.len());
        let ways = &mut self.entries[set * WAYS..][..WAYS];
        for entry in ways.iter_mut() {
            if entry.key == key && usize::from(entry.len) == piece.len() {
                entry.hit = true;
                out.extend_from_slice(&entry.ids[..usize::from(entry.count)]);
                return Ok(());
            }
        }
        let start = out.len();
        encode(piece, out)?;
        let ids = &out[start..];
        if ids.len() <= MAX_CACHED_IDS {
            let mut entry = Entry {
                key,
                len: piece.len() as u8,
                count: ids.len() as u8,
                ..Entry::default()
            };
            entry.ids[..ids.len()].copy_from_slice(ids);
            *victim(ways, &mut self.hands[set]) = entry;
        }
        Ok(())
    }

    /// Asks for the entries [`Self::encode_into`] will compare with the piece
    /// `text[start..end]` ahead of its use.
    #[inline]
    pub(crate) fn prefetch(&self, text: &[u8], start: usize, end: usize) {
        let len = end - start;
        if len == 0 || len > MAX_CACHED_PIECE_BYTES {
            return;
        }
        let set = self.set(&words_at(text, start, end), len);
        #[cfg(target_arch = "x86_64")]
        for entry in &self.entries[set * WAYS..][..WAYS] {
            use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
            let first = std::ptr::from_ref(entry).cast::<i8>();
            // SAFETY: SSE is part of x86_64's baseline; a prefetch reads
            // nothing architecturally and cannot fault. Both lines: the
            // key's, and the rest of the ids.
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(first);
                _mm_prefetch::<_MM_HINT_T0>(first.wrapping_add(64));
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = set;
    }

    /// The set `key` belongs to.
    fn set(&self, key: &[u64; MAX_CACHED_PIECE_BYTES / 8], len: usize) -> usize {
        let fold = |a: u64, b: u64| {
            let product = u128::from(a) * u128::from(b);
            (product as u64) ^ ((product >> 64) as u64)
        };
        let hash = fold(
            key[0] ^ 0x243f_6a88_85a3_08d3,
            key[1] ^ 0x1319_8a2e_0370_7344,
        ) ^ fold(
            key[2] ^ 0xa409_3822_299f_31d0,
            key[3] ^ 0x082e_fa98_ec4e_6c89 ^ ((len as u64) << 56),
        );
        hash as usize & (self.entries.len() / WAYS - 1)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.iter().filter(|entry| entry.len > 0).count()
    }
}

/// The entry of `ways` to replace, from `hand` on, which moves past it: the
/// first that is empty or not hit since the hand last passed it, clearing
/// the marks of those passed over (a clock; at most one turn and a step).
fn victim<'a>(ways: &'a mut [Entry], hand: &mut u8) -> &'a mut Entry {
    loop {
        let at = usize::from(*hand);
        *hand = ((at + 1) % WAYS) as u8;
        let entry = &mut ways[at];
        if entry.len == 0 || !entry.hit {
            return &mut ways[at];
        }
        entry.hit = false;
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn bpe(piece: &[u8], out: &mut Vec<u32>) -> Result<(), ()> {
        out.extend(bpe_openai::cl100k_base().bpe.encode_via_backtracking(piece));
        Ok(())
    }

    #[test]
    fn hits_give_the_bpe_ids_and_the_cache_stays_within_its_capacity() {
        let mut cache = PieceCache::with_capacity(4);
        let long = " a".repeat(MAX_CACHED_PIECE_BYTES);
        let pieces = [
            " the", " cache", " router", " the", " worker", " prefix", " cache", "!!", &long,
            " router",
        ];
        for round in 0..3 {
            for piece in pieces {
                let mut ids = vec![7];
                cache
                    .encode_into(piece.as_bytes(), 0, piece.len(), &mut ids, bpe)
                    .unwrap();
                let mut expected = vec![7];
                bpe(piece.as_bytes(), &mut expected).unwrap();
                assert_eq!(ids, expected, "{piece:?} in round {round}");
                assert!(cache.len() <= 4);
            }
        }
        let mut calls = 0;
        let mut ids = Vec::new();
        cache
            .encode_into(long.as_bytes(), 0, long.len(), &mut ids, |piece, out| {
                calls += 1;
                bpe(piece, out)
            })
            .unwrap();
        assert_eq!(calls, 1, "a long piece is never kept");
    }

    #[test]
    fn frequent_pieces_stay_while_rare_ones_pass_through() {
        // One set: the frequent pieces are hit between the rare ones.
        let mut cache = PieceCache::with_capacity(WAYS);
        let frequent = [" the", " of", " and"];
        let mut misses = Vec::new();
        for i in 0..100 {
            for piece in frequent
                .iter()
                .map(|p| p.to_string())
                .chain([format!(" rare{i}")])
            {
                let mut ids = Vec::new();
                cache
                    .encode_into(piece.as_bytes(), 0, piece.len(), &mut ids, |piece, out| {
                        misses.push(String::from_utf8_lossy(piece).into_owned());
                        bpe(piece, out)
                    })
                    .unwrap();
            }
        }
        let frequent_misses = misses
            .iter()
            .filter(|m| frequent.contains(&m.as_str()))
            .count();
        assert_eq!(frequent_misses, 3, "only the first time: {misses:?}");
    }

    proptest! {
        /// Whatever the order of pieces and the cache's size, the ids are
        /// those of encoding each piece.
        #[test]
        fn the_cache_never_changes_the_ids(
            capacity in 1usize..64,
            pieces in prop::collection::vec(prop_oneof![
                "[ a-z]{1,12}",
                "[ -~éß中]{0,40}",
            ], 1..200),
        ) {
            let mut cache = PieceCache::with_capacity(capacity);
            // Ids made up from the bytes, as many as a piece has bytes, so
            // that some pieces have more than fit in an entry.
            let ids = |piece: &[u8], out: &mut Vec<u32>| -> Result<(), ()> {
                out.extend(piece.iter().enumerate().map(|(i, &b)| u32::from(b) * 64 + i as u32));
                Ok(())
            };
            // The pieces within one text, as the encoders pass them.
            let text = pieces.concat();
            let mut start = 0;
            for piece in &pieces {
                let mut got = vec![1];
                let end = start + piece.len();
                cache.encode_into(text.as_bytes(), start, end, &mut got, ids).unwrap();
                start = end;
                let mut expected = vec![1];
                ids(piece.as_bytes(), &mut expected).unwrap();
                prop_assert_eq!(got, expected);
            }
        }
    }
}

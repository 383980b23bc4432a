//! The table of which pieces are one token: a token's bytes to its id.
//!
//! Most pieces of text are one token, so this lookup runs for nearly every
//! piece. A general hash map keeps each key on the heap, and on this path
//! comparing the piece with that key (a second random memory access and a
//! `memcmp` call) cost more than everything else per piece (`perf` on the
//! router bench). Here keys of up to [`INLINE_KEY_BYTES`] bytes, nearly every
//! token, are held in the slot itself as two words, so a lookup is one hash
//! of two words, usually one cache line, and two compares. The table never
//! changes after it is built, so probe lengths are fixed by the vocabulary,
//! not by the text. Longer tokens are in an ordinary map beside it.

use rustc_hash::FxHashMap;

use kvroute_index::huge::HugeSlice;

/// Keys up to this long live in the slots.
const INLINE_KEY_BYTES: usize = 16;

pub(crate) struct TokenIds {
    /// Open addressing with linear probing; a power of two long, at most half
    /// full.
    slots: HugeSlice<Slot>,
    /// The tokens longer than [`INLINE_KEY_BYTES`].
    long: FxHashMap<Box<[u8]>, u32>,
}

/// A piece's key and the slot its search starts at ([`TokenIds::probe`]).
#[derive(Clone, Copy, Default)]
pub(crate) struct Probe {
    key: [u64; 2],
    home: usize,
}

#[derive(Clone, Copy, Default)]
struct Slot {
    /// The key's bytes, little-endian, zero after its end.
    key: [u64; 2],
    /// The key's length; 0: an empty slot (no token is empty).
    len: u32,
    id: u32,
}

impl TokenIds {
    /// The table of `tokens`, each bytes and id; empty keys are skipped, and
    /// of equal keys the last is kept.
    pub(crate) fn new<'a>(tokens: impl ExactSizeIterator<Item = (&'a [u8], u32)>) -> Self {
        let slots = (tokens.len() * 2).next_power_of_two().max(16);
        let mut table = TokenIds {
            slots: HugeSlice::filled(Slot::default(), slots),
            long: FxHashMap::default(),
        };
        for (bytes, id) in tokens {
            if bytes.is_empty() {
                continue;
            }
            if bytes.len() > INLINE_KEY_BYTES {
                table.long.insert(bytes.into(), id);
                continue;
            }
            let key = words(bytes);
            let mut at = table.home(key, bytes.len());
            loop {
                let slot = &mut table.slots[at];
                if slot.len == 0 || (slot.key == key && slot.len as usize == bytes.len()) {
                    *slot = Slot {
                        key,
                        len: bytes.len() as u32,
                        id,
                    };
                    break;
                }
                at = (at + 1) & (table.slots.len() - 1);
            }
        }
        table
    }

    /// The id of the token whose bytes are `piece`, if there is one.
    #[cfg(test)]
    pub(crate) fn get(&self, piece: &[u8]) -> Option<u32> {
        self.find(&self.probe(piece, 0, piece.len()), piece, 0, piece.len())
    }

    /// Where [`Self::find`] will look for `text[start..end]`, that place
    /// prefetched. (The text around the piece lets its key be read with
    /// whole loads.)
    #[inline]
    pub(crate) fn probe(&self, text: &[u8], start: usize, end: usize) -> Probe {
        let len = end - start;
        if len > INLINE_KEY_BYTES {
            return Probe::default();
        }
        let key = words_at(text, start, end);
        let home = self.home(key, len);
        prefetch(&self.slots[home]);
        Probe { key, home }
    }

    /// The id of the token whose bytes are `text[start..end]`, if there is
    /// one; `probe` is [`Self::probe`]'s for the same piece.
    #[inline]
    pub(crate) fn find(&self, probe: &Probe, text: &[u8], start: usize, end: usize) -> Option<u32> {
        let len = end - start;
        if len > INLINE_KEY_BYTES {
            return self.long.get(&text[start..end]).copied();
        }
        let mut at = probe.home;
        loop {
            let slot = &self.slots[at];
            if slot.len == 0 {
                return None;
            }
            if slot.key == probe.key && slot.len as usize == len {
                return Some(slot.id);
            }
            at = (at + 1) & (self.slots.len() - 1);
        }
    }

    /// The first slot to probe for `key`.
    #[inline]
    fn home(&self, key: [u64; 2], len: usize) -> usize {
        // A folded 128-bit multiply mixes every key bit into the low bits.
        let product = u128::from(key[0] ^ 0x243f_6a88_85a3_08d3)
            * u128::from(key[1] ^ 0x1319_8a2e_0370_7344 ^ ((len as u64) << 56));
        let hash = (product as u64) ^ ((product >> 64) as u64);
        hash as usize & (self.slots.len() - 1)
    }
}

/// Asks for the cache lines of `slot` ahead of its use (a hint: nothing is
/// read, nothing can fault).
#[inline]
fn prefetch(slot: &Slot) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let first = std::ptr::from_ref(slot).cast::<i8>();
        // SAFETY: SSE is part of x86_64's baseline; a prefetch reads nothing
        // architecturally and cannot fault. A slot may straddle two lines:
        // its last byte's line too.
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(first);
            _mm_prefetch::<_MM_HINT_T0>(first.wrapping_add(size_of::<Slot>() - 1));
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = slot;
}

/// The bytes of `text[start..end]` (at most `8 * N`) as `N` little-endian
/// words, zero after its end: [`words`], but by `N` whole loads, masked,
/// where `text` has `8 * N` bytes from `start` (nearly every piece but the
/// last few of a text).
#[inline]
pub(crate) fn words_at<const N: usize>(text: &[u8], start: usize, end: usize) -> [u64; N] {
    let len = end - start;
    let Some(window) = text.get(start..start + 8 * N) else {
        return words(&text[start..end]);
    };
    let mut words = [0; N];
    for (i, word) in words.iter_mut().enumerate() {
        // The low `kept` bytes, 0 to 8 of them.
        let kept = len.saturating_sub(8 * i).min(8);
        let mask = ((1u128 << (8 * kept)) - 1) as u64;
        *word = self::word(&window[8 * i..]) & mask;
    }
    words
}

/// The bytes of `piece` (at most `8 * N`) as `N` little-endian words, zero
/// after its end, read with a few possibly overlapping loads.
#[inline]
pub(crate) fn words<const N: usize>(piece: &[u8]) -> [u64; N] {
    let mut words = [0; N];
    for (word, chunk) in words.iter_mut().zip(piece.chunks(8)) {
        *word = partial_word(chunk);
    }
    words
}

/// `bytes` (at most 8) as a little-endian word, zero after its end.
#[inline]
fn partial_word(bytes: &[u8]) -> u64 {
    let len = bytes.len();
    if len == 8 {
        word(bytes)
    } else if len >= 4 {
        // Two 4-byte loads that overlap where len < 8: the bytes in both are
        // the same, so or-ing them is exact.
        let low = u64::from(u32::from_le_bytes(
            bytes[..4].try_into().unwrap_or_default(),
        ));
        let high = u64::from(u32::from_le_bytes(
            bytes[len - 4..].try_into().unwrap_or_default(),
        ));
        low | (high << ((len - 4) * 8))
    } else if len > 0 {
        // The first, middle and last byte: 1 to 3 bytes, maybe the same ones.
        u64::from(bytes[0])
            | (u64::from(bytes[len / 2]) << (len / 2 * 8))
            | (u64::from(bytes[len - 1]) << ((len - 1) * 8))
    } else {
        0
    }
}

#[inline]
fn word(bytes: &[u8]) -> u64 {
    u64::from_le_bytes(bytes[..8].try_into().unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Against a hash map of the same tokens: every token is found, and
        /// other byte strings (prefixes, extensions, zero bytes) are not.
        #[test]
        fn finds_exactly_the_tokens(
            tokens in prop::collection::hash_set(prop::collection::vec(any::<u8>(), 0..24), 0..300),
            others in prop::collection::vec(prop::collection::vec(prop_oneof![Just(0u8), any::<u8>()], 0..24), 0..100),
        ) {
            let tokens: Vec<Vec<u8>> = tokens.into_iter().collect();
            let table = TokenIds::new(tokens.iter().enumerate().map(|(id, t)| (t.as_slice(), id as u32)));
            let reference: FxHashMap<&[u8], u32> = tokens
                .iter()
                .enumerate()
                .filter(|(_, t)| !t.is_empty())
                .map(|(id, t)| (t.as_slice(), id as u32))
                .collect();
            let probes = tokens.iter().chain(&others).flat_map(|t| {
                [t.clone(), t[..t.len().saturating_sub(1)].to_vec(), [t.as_slice(), &[0]].concat()]
            });
            for probe in probes {
                let expected = reference.get(probe.as_slice()).copied();
                prop_assert_eq!(table.get(&probe), expected, "{:?}", probe);
                // Within a text, with bytes on both sides that are not the piece's.
                let text = [&[0xFF; 3][..], &probe, &[0xFF; 20]].concat();
                let (start, end) = (3, 3 + probe.len());
                let found = table.find(&table.probe(&text, start, end), &text, start, end);
                prop_assert_eq!(found, expected, "{:?} in a text", probe);
            }
        }
    }

    #[test]
    fn keys_are_their_bytes_zero_padded() {
        for len in 0..=INLINE_KEY_BYTES {
            let bytes: Vec<u8> = (1..=len as u8).collect();
            let mut padded = [0u8; 16];
            padded[..len].copy_from_slice(&bytes);
            let expected = [
                u64::from_le_bytes(padded[..8].try_into().unwrap()),
                u64::from_le_bytes(padded[8..].try_into().unwrap()),
            ];
            assert_eq!(words::<2>(&bytes), expected, "{len} bytes");
            // Read from within a longer text, as the encoders do.
            let text: Vec<u8> = [&[0xAA; 3][..], &bytes, &[0x55; 20]].concat();
            assert_eq!(words_at::<2>(&text, 3, 3 + len), expected, "{len} bytes");
            assert_eq!(
                words_at::<4>(&text, 3, 3 + len)[..2],
                expected,
                "{len} bytes"
            );
        }
    }
}

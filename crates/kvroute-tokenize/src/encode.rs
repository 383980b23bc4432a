//! Encoding a text piece by piece, for tiktoken and for Hugging Face
//! tokenizers that split as cl100k_base does: split, then each piece one
//! token if it is one (`vocab` module), else from the thread's piece cache
//! (`pieces` module), else merged.
//!
//! Nearly every piece is looked up in the table of tokens, at a random place
//! in megabytes of it, so most of a lookup's time was the wait for its slot
//! to come from memory (`perf`: 73 % of the loop's samples on the load of the
//! slot). Pieces are therefore split [`LOOKAHEAD`] at a time first, each
//! one's slot prefetched as soon as its bytes are known, and only then looked
//! up, in order: the waits overlap instead of following one another. The
//! pieces that are not one token (about one in ten) then wait for their
//! piece cache entries, so those are prefetched too, once the lookups of the
//! batch have found which pieces they are, before any piece's ids are
//! appended.

use crate::merges::MergeTable;
use crate::pieces::PieceCache;
use crate::split::piece_end;
use crate::vocab::Probe;

/// Pieces split and prefetched before the first of them is looked up: enough
/// for a slot to arrive from memory while the others are split and looked up.
const LOOKAHEAD: usize = 32;

/// Appends the ids of `text` to `ids`: split as `split`'s pattern does (by
/// hand where that is exact and `by_hand`, see [`piece_end`]), each piece
/// one token of `tokens` if it is one, else from `cache`, else
/// `encode_piece`d.
pub(crate) fn encode_pieces<E>(
    split: &bpe_openai::Tokenizer,
    by_hand: bool,
    tokens: Option<&MergeTable>,
    cache: &mut PieceCache,
    text: &str,
    ids: &mut Vec<u32>,
    mut encode_piece: impl FnMut(&[u8], &mut Vec<u32>) -> Result<(), E>,
) -> Result<(), E> {
    let bytes = text.as_bytes();
    let mut ends = [0; LOOKAHEAD];
    let mut probes = [Probe::default(); LOOKAHEAD];
    let mut found = [None; LOOKAHEAD];
    let mut start = 0;
    while start < text.len() {
        let mut split_to = start;
        let mut count = 0;
        while count < LOOKAHEAD && split_to < text.len() {
            let end = piece_end(split, by_hand, text, split_to);
            if let Some(tokens) = tokens {
                probes[count] = tokens.probe(bytes, split_to, end);
            }
            ends[count] = end;
            split_to = end;
            count += 1;
        }
        // The tokens first, prefetching the cache entries of the pieces
        // that are none; then the ids in order.
        let mut at = start;
        for ((&end, probe), token) in ends[..count].iter().zip(&probes).zip(&mut found) {
            *token = tokens.and_then(|tokens| tokens.find(probe, bytes, at, end));
            if token.is_none() {
                cache.prefetch(bytes, at, end);
            }
            at = end;
        }
        for (&end, &token) in ends[..count].iter().zip(&found) {
            match token {
                Some(token) => ids.push(token),
                None => cache.encode_into(bytes, start, end, ids, &mut encode_piece)?,
            }
            start = end;
        }
    }
    Ok(())
}

//! Tokenizing only what is new: text cut at safe boundaries, each chunk's ids
//! cached on their own.
//!
//! Multi-turn conversations resend their whole history every turn, and agents
//! resend a growing context, so most of a prompt's text was tokenized moments
//! ago. Caching whole prompts misses as soon as one character is appended, and a
//! prompt's ids cannot simply be spliced at any byte: BPE, and the split before
//! it, can join the characters on both sides of a cut into one token (`"hel"` +
//! `"lo"` is not `"hello"`).
//!
//! Some cuts are safe, though: a position `c` of a text `t` where
//! `ids(t) == ids(t[..c]) ++ ids(t[c..])` whatever the text is before and after.
//! A text is cut at the first safe position at least [`MIN_CHUNK_BYTES`] past
//! the previous cut, scanning from the start, so two texts that share a prefix
//! are cut alike up to where they differ. Each chunk's ids are then looked up in
//! the tokenizer's cache by the chunk's text (a chunk's ids do not depend on its
//! neighbours, so its text is the whole key), and only the chunks not found are
//! tokenized: for a follow-up turn, the last chunk of the history and the new
//! text. The result is exactly the whole text's tokenization, which the property
//! tests check against tokenizing it whole.
//!
//! Which cuts are safe depends on the tokenizer ([`Cuts`]):
//! - line starts (tiktoken's cl100k_base and o200k_base, and Hugging Face
//!   tokenizers that split as cl100k_base does, see [`crate::hf`]): just after
//!   a line feed that is followed by an ASCII letter or digit. Both split
//!   patterns put a piece boundary there and nowhere inside a piece can a line
//!   feed be followed by a letter or a digit (pieces holding a line feed are
//!   whitespace runs, which stop at the letter, or symbol runs ending in line
//!   feeds, which o200k_base lets continue only with `/`); the pieces before
//!   it end the same way whatever letter or digit follows, and no alternative
//!   looks behind. BPE runs within pieces.
//! - added tokens (Hugging Face): just after an added token such as
//!   `<|eot_id|>`, which the `tokenizers` crate splits out before anything
//!   else and encodes each part between such tokens on its own (see
//!   [`crate::hf`] for when that holds).
//!
//! A tokenizer may allow both; the text is then cut at whichever comes first.

use aho_corasick::AhoCorasick;

use crate::TokenizeError;
use crate::cache::{Kind, TokenCache};

/// The shortest chunk worth a cache entry of its own: about 250 tokens of
/// English, so that a 32k-token conversation is a few hundred lookups.
pub(crate) const MIN_CHUNK_BYTES: usize = 1024;

/// Where a tokenizer's text may be cut safely.
pub(crate) struct Cuts {
    /// After `\n` followed by an ASCII letter or digit.
    line_starts: bool,
    /// After an added token.
    added_tokens: Option<AddedTokenCuts>,
}

/// After a match of `matcher` (leftmost-longest, as `tokenizers` finds added
/// tokens) whose pattern index `safe_after` marks.
pub(crate) struct AddedTokenCuts {
    pub(crate) matcher: AhoCorasick,
    pub(crate) safe_after: Vec<bool>,
}

impl Cuts {
    /// Cuts at line starts only (tiktoken).
    pub(crate) const LINE_STARTS: Cuts = Cuts {
        line_starts: true,
        added_tokens: None,
    };

    pub(crate) fn new(line_starts: bool, added_tokens: Option<AddedTokenCuts>) -> Option<Self> {
        (line_starts || added_tokens.is_some()).then_some(Cuts {
            line_starts,
            added_tokens,
        })
    }

    /// The first safe cut at or after `from`, or `None` if there is none before
    /// the end of `text`.
    #[cfg(test)]
    pub(crate) fn next(&self, text: &str, from: usize) -> Option<usize> {
        let line = self
            .line_starts
            .then(|| next_line_start(text, from))
            .flatten();
        let added = self
            .added_tokens
            .as_ref()
            .and_then(|added| added.safe_ends(text).find(|&end| end >= from));
        earliest(line, added)
    }

    /// The ids of `text`: chunk by chunk, each from `cache` or `encode`d and
    /// remembered there under `kind`.
    pub(crate) fn encode(
        &self,
        cache: &TokenCache,
        kind: Kind,
        text: &str,
        encode: impl Fn(&str) -> Result<Vec<u32>, TokenizeError>,
    ) -> Result<Vec<u32>, TokenizeError> {
        // About 4 bytes of English per token.
        let mut ids = Vec::with_capacity(text.len() / 4 + 16);
        self.encode_into(cache, kind, text, encode, &mut ids)?;
        Ok(ids)
    }

    /// [`Self::encode`], appending to `ids`.
    pub(crate) fn encode_into(
        &self,
        cache: &TokenCache,
        kind: Kind,
        text: &str,
        encode: impl Fn(&str) -> Result<Vec<u32>, TokenizeError>,
        ids: &mut Vec<u32>,
    ) -> Result<(), TokenizeError> {
        let mut start = 0;
        // Added-token matches are found once, then consumed in order. Fused:
        // once there are no more, asking again must not search the rest of
        // the text again for every chunk (quadratic in a long prompt).
        let mut added_ends = self.added_tokens.as_ref().map(|a| a.safe_ends(text).fuse());
        let mut next_added = None;
        while start < text.len() {
            let from = start + MIN_CHUNK_BYTES;
            let line = self
                .line_starts
                .then(|| next_line_start(text, from))
                .flatten();
            if let Some(ends) = &mut added_ends
                && next_added.is_none_or(|end| end < from)
            {
                next_added = ends.find(|&end| end >= from);
            }
            let end = earliest(line, next_added).unwrap_or(text.len());
            let chunk = cache.get_or_tokenize(kind, &text[start..end], &encode)?;
            ids.extend_from_slice(&chunk);
            start = end;
        }
        Ok(())
    }
}

impl AddedTokenCuts {
    /// The ends of the safe added tokens in `text`, in order, except at its
    /// end. Matches must be found from the start, as `tokenizers` finds them:
    /// one that starts before a position may end after it.
    fn safe_ends<'a>(&'a self, text: &'a str) -> impl Iterator<Item = usize> + 'a {
        self.matcher
            .find_iter(text.as_bytes())
            .filter(|m| self.safe_after[m.pattern().as_usize()])
            .map(|m| m.end())
            .filter(move |&end| end < text.len())
    }
}

/// The first position at or after `from` just after a `\n` that is followed
/// by an ASCII letter or digit.
fn next_line_start(text: &str, from: usize) -> Option<usize> {
    let bytes = text.as_bytes();
    let mut at = from.checked_sub(1)?;
    while at + 1 < bytes.len() {
        let newline = at + memchr::memchr(b'\n', &bytes[at..bytes.len() - 1])?;
        if bytes[newline + 1].is_ascii_alphanumeric() {
            return Some(newline + 1);
        }
        at = newline + 1;
    }
    None
}

fn earliest(a: Option<usize>, b: Option<usize>) -> Option<usize> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use proptest::prelude::*;

    use super::*;

    /// Lines whose ends and starts are what the split patterns treat apart:
    /// letters, digits, spaces, symbols (`/` continues an o200k_base symbol run
    /// across a line feed), non-ASCII letters; line feeds after spaces, symbols
    /// and other line feeds.
    fn lines() -> impl Strategy<Value = String> {
        let line = (
            prop_oneof!["[a-zA-Z0-9]", "[ \t!/'.]", "[éß中🙂]", Just(String::new())],
            "[ -~éß中🙂\t]{0,40}",
            prop_oneof![
                Just("\n"),
                Just("\r\n"),
                Just(" \n"),
                Just("!!\n"),
                Just("\n\n"),
                Just("  \n \n"),
                Just("/\n"),
                Just(""),
            ],
        )
            .prop_map(|(start, middle, end)| format!("{start}{middle}{end}"));
        prop::collection::vec(line, 1..16).prop_map(|lines| lines.concat())
    }

    /// tiktoken-rs's ids, or `None` where its backtracking regex gives up.
    fn reference(bpe: &tiktoken_rs::CoreBPE, text: &str) -> Option<Vec<u32>> {
        bpe.encode(text, &HashSet::new()).ok().map(|(ids, _)| ids)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        /// The claim the tiktoken cuts rest on, checked against tiktoken-rs
        /// (OpenAI's encoder ported) for every cut of the text.
        #[test]
        fn every_line_start_cut_is_exact_in_both_encodings(text in lines()) {
            for bpe in [tiktoken_rs::cl100k_base_singleton(), tiktoken_rs::o200k_base_singleton()] {
                let Some(whole) = reference(bpe, &text) else { continue };
                let mut at = 1;
                while let Some(cut) = Cuts::LINE_STARTS.next(&text, at) {
                    let (Some(mut joined), Some(rest)) =
                        (reference(bpe, &text[..cut]), reference(bpe, &text[cut..]))
                    else {
                        break;
                    };
                    joined.extend(rest);
                    prop_assert_eq!(&joined, &whole, "cut at {}", cut);
                    at = cut + 1;
                }
            }
        }
    }

    fn cuts(text: &str, from: usize) -> Vec<usize> {
        let mut found = Vec::new();
        let mut at = from;
        while let Some(cut) = Cuts::LINE_STARTS.next(text, at) {
            found.push(cut);
            at = cut + 1;
        }
        found
    }

    #[test]
    fn line_starts_cut_before_a_letter_or_digit_after_a_line_feed() {
        let text = "ab\ncd\n\nef\n gh\n!i\n2j\n";
        assert_eq!(cuts(text, 1), [3, 7, 17]);
        assert_eq!(cuts(text, 4), [7, 17]);
        assert_eq!(cuts(text, 0), Vec::<usize>::new(), "0 is never a cut");
        assert_eq!(Cuts::LINE_STARTS.next("ab\n", 1), None, "not at the end");
    }

    #[test]
    fn added_tokens_cut_after_safe_tokens_only_and_never_at_the_end() {
        let added = AhoCorasick::builder()
            .match_kind(aho_corasick::MatchKind::LeftmostLongest)
            .build(["<a>", "<b>", "<a>x"])
            .unwrap();
        let cuts = Cuts::new(
            false,
            Some(AddedTokenCuts {
                matcher: added,
                safe_after: vec![true, false, true],
            }),
        )
        .unwrap();
        let text = "0<a>12<b>3<a>x4<a>";
        assert_eq!(cuts.next(text, 0), Some(4));
        assert_eq!(
            cuts.next(text, 5),
            Some(14),
            "<b> is not safe; <a>x is longest"
        );
        assert_eq!(cuts.next(text, 15), None);
    }

    #[test]
    fn with_both_kinds_the_earliest_cut_wins() {
        let added = AhoCorasick::builder()
            .match_kind(aho_corasick::MatchKind::LeftmostLongest)
            .build(["<a>"])
            .unwrap();
        let cuts = Cuts::new(
            true,
            Some(AddedTokenCuts {
                matcher: added,
                safe_after: vec![true],
            }),
        )
        .unwrap();
        let text = "x\ny<a>z\nw<a>";
        assert_eq!(cuts.next(text, 1), Some(2));
        assert_eq!(cuts.next(text, 3), Some(6));
        assert_eq!(cuts.next(text, 7), Some(8));
        assert_eq!(cuts.next(text, 9), None, "not at the end");
        assert!(Cuts::new(false, None).is_none());
    }

    #[test]
    fn chunks_are_cached_and_joined_in_order() {
        let cache = TokenCache::new(1 << 20);
        let line = "x".repeat(MIN_CHUNK_BYTES);
        let text = format!("{line}\na{line}\nb{line}");
        let bytes = |text: &str| -> Result<Vec<u32>, TokenizeError> {
            Ok(text.bytes().map(u32::from).collect())
        };
        let ids = Cuts::LINE_STARTS
            .encode(&cache, Kind::Prompt, &text, bytes)
            .unwrap();
        assert_eq!(ids, bytes(&text).unwrap());
        let longer = format!("{text}\nc");
        let calls = std::cell::Cell::new(0);
        let ids = Cuts::LINE_STARTS
            .encode(&cache, Kind::Prompt, &longer, |chunk| {
                calls.set(calls.get() + 1);
                bytes(chunk)
            })
            .unwrap();
        assert_eq!(ids, bytes(&longer).unwrap());
        // The history's last chunk now ends in "\n", and "c" is new.
        assert_eq!(calls.get(), 2);
    }
}

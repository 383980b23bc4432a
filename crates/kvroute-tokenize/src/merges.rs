//! Byte-pair encoding of one piece from a table of merges, for the pieces no
//! cache holds.
//!
//! tiktoken and the `tokenizers` BPE model define the same procedure: start
//! from one token per byte, then merge the adjacent pair of tokens with the
//! lowest priority (the leftmost of equals) until no adjacent pair merges.
//! - tiktoken: a pair merges when the two tokens' bytes together are a token,
//!   whose rank is the priority; a piece that is a token is that token,
//!   without merging.
//! - `tokenizers`: a pair merges when it is in `merges`, whose index there is
//!   the priority (its `Word::merge_all` pops a min-heap of (index, position));
//!   with `ignore_merges`, a piece in the vocabulary is that token.
//!
//! Their own encoders allocate for every piece (tiktoken-rs and `bpe_openai`
//! byte vectors and their state, `tokenizers` its word, heap and token
//! strings). Here a piece of at most [`MAX_MERGED_BYTES`] bytes is merged in
//! arrays on the stack, looking pairs up in one table of
//! `(left, right) → (priority, merged)` ([`PairTable`]: open addressing with
//! a multiplicative hash, the pair and its merge in one 16-byte slot, so a
//! lookup is a multiply and usually one cache line), and the tokens kept in
//! place and linked, so that a merge moves nothing; a piece that is a token is
//! found in a table of the tokens' bytes first. Longer
//! pieces (rare: long runs of spaces or symbols) are left to the caller's
//! encoder. The unit tests compare with tiktoken-rs and with the `tokenizers`
//! model, on real vocabularies and on random little ones whose merge order is
//! not the order of the merged tokens.

use rustc_hash::FxHashMap;
use serde_json::Value;

use crate::vocab::{Probe, TokenIds};
use kvroute_index::huge::HugeSlice;

/// The longest piece [`MergeTable::merge_into`] encodes.
pub(crate) const MAX_MERGED_BYTES: usize = 64;

/// What a BPE vocabulary needs for [`MergeTable::merge_into`].
pub(crate) struct MergeTable {
    /// The token of each byte.
    byte_tokens: [u32; 256],
    /// The pieces that are one token, by their bytes.
    tokens: TokenIds,
    /// How each pair of adjacent tokens merges.
    pairs: PairTable,
}

#[derive(Clone, Copy)]
struct Merge {
    /// Lower merges first.
    priority: u32,
    /// The token the pair becomes.
    token: u32,
}

/// A pair that does not merge.
const NO_MERGE: Merge = Merge {
    priority: u32::MAX,
    token: 0,
};

fn pair_key(left: u32, right: u32) -> u64 {
    (u64::from(left) << 32) | u64::from(right)
}

impl MergeTable {
    /// tiktoken's table: token `i` is `tokens[i]`, of rank `i`. `None` if
    /// some byte is not a token or two tokens have the same bytes (then the
    /// caller's encoder is used).
    pub(crate) fn from_ranks(tokens: &[&[u8]]) -> Option<Self> {
        let ids: FxHashMap<Box<[u8]>, u32> = tokens
            .iter()
            .enumerate()
            .map(|(id, &token)| (Box::from(token), id as u32))
            .collect();
        if ids.len() != tokens.len() {
            return None;
        }
        let mut pairs = FxHashMap::default();
        for (id, token) in tokens.iter().enumerate() {
            for split in 1..token.len() {
                if let (Some(&left), Some(&right)) =
                    (ids.get(&token[..split]), ids.get(&token[split..]))
                {
                    let id = id as u32;
                    let merge = Merge {
                        priority: id,
                        token: id,
                    };
                    pairs.insert(pair_key(left, right), merge);
                }
            }
        }
        Some(MergeTable {
            byte_tokens: byte_tokens(|byte| ids.get(&[byte][..]).copied())?,
            tokens: TokenIds::new(
                tokens
                    .iter()
                    .enumerate()
                    .map(|(id, &token)| (token, id as u32)),
            ),
            pairs: PairTable::new(&pairs),
        })
    }

    /// The table of a `tokenizers` BPE model (`model`, serialized as in
    /// `tokenizer.json`) whose vocabulary is written in `byte_chars` (byte-level
    /// BPE). `None` for any other model, or one with dropout, word prefixes or
    /// suffixes, or a byte missing from its vocabulary.
    pub(crate) fn from_hugging_face(model: &Value, byte_chars: &[char; 256]) -> Option<Self> {
        let plain = |key: &str| model.get(key).is_none_or(Value::is_null);
        let no_dropout = plain("dropout") || model["dropout"].as_f64() == Some(0.0);
        if model.get("type")? != "BPE"
            || !no_dropout
            || !plain("continuing_subword_prefix")
            || !plain("end_of_word_suffix")
        {
            return None;
        }
        let ignore_merges = model.get("ignore_merges")?.as_bool()?;
        let vocab: FxHashMap<&str, u32> = model
            .get("vocab")?
            .as_object()?
            .iter()
            .map(|(token, id)| Some((token.as_str(), u32::try_from(id.as_u64()?).ok()?)))
            .collect::<Option<_>>()?;
        let mut pairs = FxHashMap::default();
        let mut joined = String::new();
        for (priority, merge) in model.get("merges")?.as_array()?.iter().enumerate() {
            let [left, right] = merge.as_array()?.as_slice() else {
                return None;
            };
            let (left, right) = (left.as_str()?, right.as_str()?);
            joined.clear();
            joined.push_str(left);
            joined.push_str(right);
            let merged = *vocab.get(joined.as_str())?;
            let merge = Merge {
                priority: u32::try_from(priority).ok()?,
                token: merged,
            };
            pairs.insert(pair_key(*vocab.get(left)?, *vocab.get(right)?), merge);
        }
        let mut table = MergeTable {
            byte_tokens: byte_tokens(|byte| {
                vocab
                    .get(byte_chars[byte as usize].encode_utf8(&mut [0; 4]) as &str)
                    .copied()
            })?,
            tokens: TokenIds::new(std::iter::empty()),
            pairs: PairTable::new(&pairs),
        };
        let byte_of: FxHashMap<char, u8> = (0..=255u8)
            .map(|byte| (byte_chars[byte as usize], byte))
            .collect();
        let mut merged = Vec::new();
        let mut whole = Vec::new();
        for (token, &id) in &vocab {
            let Some(bytes) = token
                .chars()
                .map(|c| byte_of.get(&c).copied())
                .collect::<Option<Box<[u8]>>>()
            else {
                continue;
            };
            // Without `ignore_merges` a token's bytes are that token only if
            // merging them gives it.
            merged.clear();
            if ignore_merges || (table.merge_into(&bytes, &mut merged) && merged == [id]) {
                whole.push((bytes, id));
            }
        }
        table.tokens = TokenIds::new(whole.iter().map(|(bytes, id)| (&**bytes, *id)));
        Some(table)
    }

    /// The token `piece` is as a whole, if it is one (before any merging).
    #[cfg(test)]
    pub(crate) fn token(&self, piece: &[u8]) -> Option<u32> {
        self.tokens.get(piece)
    }

    /// Where [`Self::find`] will look for `text[start..end]`, prefetched.
    #[inline]
    pub(crate) fn probe(&self, text: &[u8], start: usize, end: usize) -> Probe {
        self.tokens.probe(text, start, end)
    }

    /// [`Self::token`] of `text[start..end]`, found where `probe` says.
    #[inline]
    pub(crate) fn find(&self, probe: &Probe, text: &[u8], start: usize, end: usize) -> Option<u32> {
        self.tokens.find(probe, text, start, end)
    }

    /// Appends the tokens of `piece` to `out`, merging pairs from single
    /// bytes; `false` (and nothing appended) if `piece` is longer than
    /// [`MAX_MERGED_BYTES`]. The caller first asks [`Self::token`].
    pub(crate) fn merge_into(&self, piece: &[u8], out: &mut Vec<u32>) -> bool {
        let len = piece.len();
        if len > MAX_MERGED_BYTES {
            return false;
        }
        if len == 0 {
            return true;
        }
        // The tokens stay where their first byte was; next[i] is where the
        // token after the one at i is (`len`: none), so a merge only relinks.
        let mut tokens = [0u32; MAX_MERGED_BYTES];
        // merges[i]: how the token at i merges with the next one.
        let mut merges = [NO_MERGE; MAX_MERGED_BYTES];
        let mut next = [0u8; MAX_MERGED_BYTES];
        for (i, &byte) in piece.iter().enumerate() {
            tokens[i] = self.byte_tokens[byte as usize];
            next[i] = (i + 1) as u8;
        }
        for i in 0..len - 1 {
            merges[i] = self.pairs.get(tokens[i], tokens[i + 1]);
        }
        loop {
            // The lowest priority, the leftmost of equals, and the token before it.
            let (mut best, mut before_best) = (0, None);
            let (mut at, mut before) = (0, None);
            while at < len {
                if merges[at].priority < merges[best].priority {
                    (best, before_best) = (at, before);
                }
                before = Some(at);
                at = usize::from(next[at]);
            }
            let merge = merges[best];
            if merge.priority == u32::MAX {
                break;
            }
            tokens[best] = merge.token;
            next[best] = next[usize::from(next[best])];
            let after = usize::from(next[best]);
            merges[best] = if after < len {
                self.pairs.get(tokens[best], tokens[after])
            } else {
                NO_MERGE
            };
            if let Some(before) = before_best {
                merges[before] = self.pairs.get(tokens[before], tokens[best]);
            }
        }
        let mut at = 0;
        while at < len {
            out.push(tokens[at]);
            at = usize::from(next[at]);
        }
        true
    }
}

/// How pairs of adjacent tokens merge: open addressing with linear probing,
/// at most three quarters full, a power of two long; an empty slot holds
/// [`NO_MERGE`] (no pair merges with that priority).
struct PairTable {
    slots: HugeSlice<PairSlot>,
    /// Right shift that leaves a hash's top bits, as many as index a slot.
    shift: u32,
}

#[derive(Clone, Copy)]
struct PairSlot {
    left: u32,
    right: u32,
    merge: Merge,
}

impl PairTable {
    fn new(pairs: &FxHashMap<u64, Merge>) -> Self {
        let slots = (pairs.len() * 4 / 3 + 1).next_power_of_two().max(2);
        let mut table = PairTable {
            slots: HugeSlice::filled(
                PairSlot {
                    left: 0,
                    right: 0,
                    merge: NO_MERGE,
                },
                slots,
            ),
            shift: 64 - slots.trailing_zeros(),
        };
        // A pair of the highest priority would never merge (see the merge loop).
        for (&key, &merge) in pairs.iter().filter(|(_, m)| m.priority != u32::MAX) {
            let (left, right) = ((key >> 32) as u32, key as u32);
            let mut at = table.home(left, right);
            while table.slots[at].merge.priority != u32::MAX {
                at = (at + 1) & (table.slots.len() - 1);
            }
            table.slots[at] = PairSlot { left, right, merge };
        }
        table
    }

    /// How `left` and `right` merge, or [`NO_MERGE`].
    #[inline]
    fn get(&self, left: u32, right: u32) -> Merge {
        let mut at = self.home(left, right);
        loop {
            let slot = &self.slots[at];
            if slot.merge.priority == u32::MAX || (slot.left == left && slot.right == right) {
                return slot.merge;
            }
            at = (at + 1) & (self.slots.len() - 1);
        }
    }

    /// The first slot to probe: the top bits of a Fibonacci hash of the pair.
    #[inline]
    fn home(&self, left: u32, right: u32) -> usize {
        (pair_key(left, right).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> self.shift) as usize
    }
}

fn byte_tokens(token: impl Fn(u8) -> Option<u32>) -> Option<[u32; 256]> {
    let mut tokens = [0; 256];
    for byte in 0..=255u8 {
        tokens[byte as usize] = token(byte)?;
    }
    Some(tokens)
}

#[cfg(test)]
mod tests {
    use std::sync::LazyLock;

    use proptest::prelude::*;
    use tokenizers::Model;

    use super::*;
    use crate::byte_chars;

    fn encode(table: &MergeTable, piece: &[u8]) -> Vec<u32> {
        if let Some(token) = table.token(piece) {
            return vec![token];
        }
        let mut out = Vec::new();
        assert!(table.merge_into(piece, &mut out), "{} bytes", piece.len());
        out
    }

    fn ranks(bpe: &bpe_openai::Tokenizer) -> MergeTable {
        let tokens: Vec<&[u8]> = (0..bpe.bpe.num_tokens() as u32)
            .map(|id| bpe.bpe.token_bytes(id))
            .collect();
        MergeTable::from_ranks(&tokens).expect("a complete vocabulary")
    }

    static CL100K: LazyLock<MergeTable> = LazyLock::new(|| ranks(bpe_openai::cl100k_base()));
    static O200K: LazyLock<MergeTable> = LazyLock::new(|| ranks(bpe_openai::o200k_base()));

    /// tiktoken's rank map of the same vocabulary.
    fn rank_map(bpe: &bpe_openai::Tokenizer) -> FxHashMap<Vec<u8>, u32> {
        (0..bpe.bpe.num_tokens() as u32)
            .map(|id| (bpe.bpe.token_bytes(id).to_vec(), id))
            .collect()
    }

    static CL100K_RANKS: LazyLock<FxHashMap<Vec<u8>, u32>> =
        LazyLock::new(|| rank_map(bpe_openai::cl100k_base()));
    static O200K_RANKS: LazyLock<FxHashMap<Vec<u8>, u32>> =
        LazyLock::new(|| rank_map(bpe_openai::o200k_base()));

    fn spell(bytes: &[u8]) -> String {
        let chars = byte_chars();
        bytes.iter().map(|&b| chars[b as usize]).collect()
    }

    /// A byte-level `tokenizers` BPE model: the 256 bytes, then each merge's
    /// result, merged in the order given.
    fn hugging_face_model(merges: &[(Vec<u8>, Vec<u8>)], ignore_merges: bool) -> Value {
        let mut vocab = serde_json::Map::new();
        for byte in 0..=255u8 {
            vocab.insert(spell(&[byte]), vocab.len().into());
        }
        let mut merged: Vec<String> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for (left, right) in merges {
            let token = spell(&[left.as_slice(), right].concat());
            if !vocab.contains_key(&token) && seen.insert(token.clone()) {
                merged.push(token);
            }
        }
        // Ids in the reverse order of the merges, so that neither order
        // stands for the other.
        for (token, id) in merged.into_iter().rev().zip(256..) {
            vocab.insert(token, id.into());
        }
        let merges: Vec<Value> = merges
            .iter()
            .map(|(left, right)| serde_json::json!([spell(left), spell(right)]))
            .collect();
        serde_json::json!({"type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": ignore_merges,
            "vocab": vocab, "merges": merges})
    }

    /// The ids `tokenizers` gives `piece` with the model `json`.
    fn tokenizers_ids(model: &tokenizers::models::bpe::BPE, piece: &[u8]) -> Vec<u32> {
        let tokens = model.tokenize(&spell(piece)).unwrap();
        tokens.into_iter().map(|token| token.id).collect()
    }

    /// Random merges over the bytes `a`, `b`, `c`: each joins two tokens
    /// made so far, in an order unrelated to their length, so that equal
    /// merged tokens, overlapping pairs and a vocabulary token that merging
    /// does not reach all occur.
    fn random_merges() -> impl Strategy<Value = Vec<(Vec<u8>, Vec<u8>)>> {
        prop::collection::vec(
            (any::<prop::sample::Index>(), any::<prop::sample::Index>()),
            1..40,
        )
        .prop_map(|picks| {
            let mut tokens: Vec<Vec<u8>> = vec![b"a".to_vec(), b"b".to_vec(), b"c".to_vec()];
            let mut merges = Vec::new();
            for (left, right) in picks {
                let left = left.get(&tokens).clone();
                let right = right.get(&tokens).clone();
                if left.len() + right.len() > 12 || merges.contains(&(left.clone(), right.clone()))
                {
                    continue;
                }
                tokens.push([left.as_slice(), &right].concat());
                merges.push((left, right));
            }
            merges
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// tiktoken's own merge (tiktoken-rs's copy of OpenAI's code) on
        /// the same ranks, for pieces of any bytes and word-like ones, after
        /// its check for a piece that is a token.
        #[test]
        fn pieces_get_the_ids_of_tiktoken(
            piece in prop_oneof![
                prop::collection::vec(any::<u8>(), 1..=MAX_MERGED_BYTES),
                "[ 'A-Za-z]{1,24}".prop_map(String::into_bytes),
                " ?[a-zéßñü中文日本한국어]{1,12}".prop_map(String::into_bytes),
                "[ !-/:-@\\[-`{-~🙂]{1,16}".prop_map(String::into_bytes),
                "[0-9]{1,3}".prop_map(String::into_bytes),
            ]
        ) {
            for (table, ranks) in [(&*CL100K, &*CL100K_RANKS), (&*O200K, &*O200K_RANKS)] {
                let expected = match ranks.get(&piece) {
                    Some(&rank) => vec![rank],
                    None => tiktoken_rs::byte_pair_split(&piece, ranks)
                        .into_iter()
                        .map(|part| ranks[part])
                        .collect(),
                };
                prop_assert_eq!(encode(table, &piece), expected);
            }
        }

        /// Random vocabularies whose merge order is not the merged tokens'
        /// order, with and without `ignore_merges`, on random words.
        #[test]
        fn pieces_get_the_ids_of_the_tokenizers_model(
            merges in random_merges(),
            ignore_merges in any::<bool>(),
            words in prop::collection::vec("[abc]{1,16}", 1..8),
        ) {
            let json = hugging_face_model(&merges, ignore_merges);
            let table = MergeTable::from_hugging_face(&json, &byte_chars()).unwrap();
            let model: tokenizers::models::bpe::BPE = serde_json::from_str(&json.to_string()).unwrap();
            for word in words {
                prop_assert_eq!(
                    encode(&table, word.as_bytes()),
                    tokenizers_ids(&model, word.as_bytes()),
                    "{:?} with {:?}", word, merges
                );
            }
        }
    }

    #[test]
    fn cl100k_as_a_hugging_face_model_gives_the_ids_of_tokenizers() {
        // cl100k_base's merges as Hugging Face's tiktoken converter writes them:
        // every split of a token into two, by the merged token's rank.
        let bpe = &bpe_openai::cl100k_base().bpe;
        let tokens: Vec<&[u8]> = (0..bpe.num_tokens() as u32)
            .map(|id| bpe.token_bytes(id))
            .collect();
        let rank: FxHashMap<&[u8], usize> =
            tokens.iter().enumerate().map(|(i, &t)| (t, i)).collect();
        let mut merges = Vec::new();
        for token in &tokens {
            let mut splits: Vec<(usize, usize)> = (1..token.len())
                .filter_map(|i| Some((*rank.get(&token[..i])?, *rank.get(&token[i..])?)))
                .collect();
            splits.sort_unstable();
            merges.extend(
                splits
                    .into_iter()
                    .map(|(l, r)| (tokens[l].to_vec(), tokens[r].to_vec())),
            );
        }
        let words = [
            "hello",
            " world",
            " tokenization",
            " kvroute",
            "    ",
            "!!!!!!",
            " Übermaß",
            "中文字",
            "🙂🚀",
            " antidisestablishmentarianism",
        ];
        for ignore_merges in [true, false] {
            let mut json = hugging_face_model(&merges, ignore_merges);
            // The vocabulary in rank order, as the converter writes it.
            json["vocab"] = tokens
                .iter()
                .enumerate()
                .map(|(id, t)| (spell(t), Value::from(id)))
                .collect::<serde_json::Map<_, _>>()
                .into();
            let table = MergeTable::from_hugging_face(&json, &byte_chars()).unwrap();
            let model: tokenizers::models::bpe::BPE =
                serde_json::from_str(&json.to_string()).unwrap();
            for word in words {
                assert_eq!(
                    encode(&table, word.as_bytes()),
                    tokenizers_ids(&model, word.as_bytes()),
                    "{word:?}"
                );
                assert_eq!(
                    encode(&table, word.as_bytes()),
                    encode(&CL100K, word.as_bytes()),
                    "{word:?}"
                );
            }
        }
    }

    #[test]
    fn other_models_and_long_pieces_are_left_to_the_caller() {
        let mut json = hugging_face_model(&[], true);
        json["continuing_subword_prefix"] = "##".into();
        assert!(MergeTable::from_hugging_face(&json, &byte_chars()).is_none());
        let mut json = hugging_face_model(&[], true);
        json["type"] = "WordPiece".into();
        assert!(MergeTable::from_hugging_face(&json, &byte_chars()).is_none());
        let mut out = vec![7];
        assert!(!CL100K.merge_into(&[b'x'; MAX_MERGED_BYTES + 1], &mut out));
        assert_eq!(out, [7]);
    }
}

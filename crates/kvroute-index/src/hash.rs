//! Block hashing, byte-compatible with NVIDIA Dynamo's KV router.
//!
//! Engines and routers only agree on which prefix a worker holds if they hash the
//! same tokens to the same numbers, so every rule here mirrors Dynamo exactly:
//! xxh3-64 with seed 1337 over little-endian token bytes, one *local* hash per full
//! block, chained into *sequence* hashes that identify a block together with its
//! whole prefix. A LoRA adapter shifts the local seed so that adapter and base-model
//! blocks never collide; chaining always uses the base seed.
//!
//! Like vLLM, a block's hash also covers its *extra keys* ([`ExtraKeys`]): the
//! hashes of the multimodal objects (images) whose placeholder tokens it holds,
//! and on the first block only, the request's `cache_salt`. Chaining carries a
//! first block's difference to every later block, so a salted chain never
//! matches an unsalted request or another salt. Blocks without extra keys hash
//! exactly as before, so plain text stays byte-compatible with Dynamo.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// The seed Dynamo uses for every block hash.
pub const SEED: u64 = 1337;

/// Tokens per block of vLLM's and Dynamo's default, hashed by a path of its own.
const USUAL_BLOCK_SIZE: usize = 16;

/// Keeps salt keys apart from object hashes of the same bytes.
const SALT_SEED: u64 = SEED ^ 0x5341_4c54; // "SALT"

/// What identifies a request's blocks besides their tokens (vLLM's extra keys).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExtraKeys {
    /// vLLM's `cache_salt`: mixed into the first block only; the empty string is no salt.
    pub cache_salt: Option<String>,
    /// Multimodal objects and the tokens standing for them.
    pub multimodal: Vec<MultimodalItem>,
}

/// A multimodal object (an image) occupying `length` placeholder tokens from
/// token `offset`; every block that holds one of them is keyed by `hash`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MultimodalItem {
    pub offset: usize,
    pub length: usize,
    pub hash: u64,
}

impl ExtraKeys {
    pub fn is_empty(&self) -> bool {
        self.salt().is_none() && self.multimodal.is_empty()
    }

    fn salt(&self) -> Option<&str> {
        self.cache_salt.as_deref().filter(|s| !s.is_empty())
    }
}

/// The 64-bit key of a multimodal identifier as engines report it: a hex digest
/// (vLLM's content hashes) by its last 16 digits, Dynamo's way; any other
/// string (a client's `uuid`) by its xxh3 hash.
pub fn multimodal_identifier_hash(identifier: &str) -> u64 {
    let hex = identifier.len() >= 16 && identifier.bytes().all(|b| b.is_ascii_hexdigit());
    if hex && let Ok(value) = u64::from_str_radix(&identifier[identifier.len() - 16..], 16) {
        return value;
    }
    xxh3_64_with_seed(identifier.as_bytes(), SEED)
}

/// The key a `cache_salt` adds to a first block.
pub fn salt_key(salt: &str) -> u64 {
    xxh3_64_with_seed(salt.as_bytes(), SALT_SEED)
}

/// How local block hashes are computed: the block size and the seed for an adapter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockHasher {
    block_size: usize,
    seed: u64,
}

impl BlockHasher {
    /// A hasher for the base model. `block_size` must be at least 1.
    pub fn new(block_size: usize) -> Self {
        assert!(block_size > 0, "block size must be at least 1");
        Self {
            block_size,
            seed: SEED,
        }
    }

    /// A hasher for a LoRA adapter; the empty name is the base model.
    pub fn with_lora(block_size: usize, lora_name: &str) -> Self {
        let mut hasher = Self::new(block_size);
        hasher.seed = lora_seed(lora_name);
        hasher
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Local hashes of every full block of `tokens`; a trailing partial block is not hashed.
    pub fn local_hashes(&self, tokens: &[u32]) -> Vec<u64> {
        let mut hashes = Vec::new();
        self.local_hashes_into(tokens, &mut hashes);
        hashes
    }

    /// [`Self::local_hashes`] appended to `out`: a caller that keeps its
    /// buffer allocates nothing per prompt.
    pub fn local_hashes_into(&self, tokens: &[u32], out: &mut Vec<u64>) {
        if self.block_size == USUAL_BLOCK_SIZE {
            return self.usual_local_hashes(tokens, out);
        }
        // Tokens are written four bytes at a time into a fixed buffer: a
        // byte-wise `extend` cost more than the hash itself (half of a
        // routing decision was hashing).
        let mut bytes = vec![0u8; self.block_size * 4];
        out.extend(tokens.chunks_exact(self.block_size).map(|block| {
            for (to, t) in bytes.chunks_exact_mut(4).zip(block) {
                to.copy_from_slice(&t.to_le_bytes());
            }
            xxh3_64_with_seed(&bytes, self.seed)
        }));
    }

    /// [`Self::local_hashes`] of 16-token blocks. With the length known when
    /// compiled, the copy to bytes is a few vector moves and xxh3's dispatch
    /// on the length folds away: a 128k-token prompt is 8,192 blocks, and
    /// hashing was two thirds of its routing decision.
    fn usual_local_hashes(&self, tokens: &[u32], out: &mut Vec<u64>) {
        let (blocks, _partial) = tokens.as_chunks::<USUAL_BLOCK_SIZE>();
        out.extend(blocks.iter().map(|block| {
            let mut bytes = [0u8; USUAL_BLOCK_SIZE * 4];
            for (to, t) in bytes.as_chunks_mut::<4>().0.iter_mut().zip(block) {
                *to = t.to_le_bytes();
            }
            xxh3_64_with_seed(&bytes, self.seed)
        }));
    }

    /// Local hash of one full block whose multimodal objects hash to `mm_hashes`:
    /// the token bytes followed by the sorted object hashes, little-endian.
    pub fn local_hash_multimodal(&self, block: &[u32], mm_hashes: &[u64]) -> u64 {
        self.local_hash_with_keys(block, mm_hashes, None)
    }

    /// Local hash of one full block with its extra keys: the token bytes, the
    /// sorted object hashes, then (first blocks of salted requests) the
    /// [`salt_key`], all little-endian.
    pub fn local_hash_with_keys(&self, block: &[u32], mm_hashes: &[u64], salt: Option<u64>) -> u64 {
        let mut sorted = mm_hashes.to_vec();
        sorted.sort_unstable();
        let mut bytes = Vec::with_capacity(block.len() * 4 + (sorted.len() + 1) * 8);
        bytes.extend(block.iter().flat_map(|t| t.to_le_bytes()));
        bytes.extend(sorted.iter().flat_map(|h| h.to_le_bytes()));
        bytes.extend(salt.iter().flat_map(|h| h.to_le_bytes()));
        xxh3_64_with_seed(&bytes, self.seed)
    }

    /// Local hashes of every full block of `tokens` with the request's extra
    /// keys; without any, exactly [`Self::local_hashes`].
    pub fn local_hashes_with(&self, tokens: &[u32], extra: &ExtraKeys) -> Vec<u64> {
        let mut hashes = Vec::new();
        self.local_hashes_with_into(tokens, extra, &mut hashes);
        hashes
    }

    /// [`Self::local_hashes_with`] appended to `out` (see [`Self::local_hashes_into`]).
    pub fn local_hashes_with_into(&self, tokens: &[u32], extra: &ExtraKeys, out: &mut Vec<u64>) {
        if extra.is_empty() {
            return self.local_hashes_into(tokens, out);
        }
        let salt = extra.salt().map(salt_key);
        out.extend(
            tokens
                .chunks_exact(self.block_size)
                .enumerate()
                .map(|(i, block)| {
                    let (start, end) = (i * self.block_size, (i + 1) * self.block_size);
                    let mm: Vec<u64> = extra
                        .multimodal
                        .iter()
                        .filter(|m| m.offset < end && m.offset + m.length > start)
                        .map(|m| m.hash)
                        .collect();
                    self.local_hash_with_keys(block, &mm, if i == 0 { salt } else { None })
                }),
        );
    }
}

/// The local-hash seed for a LoRA adapter: `1337 + xxh3_64(name)`, wrapping; the
/// empty name is the base model.
pub fn lora_seed(lora_name: &str) -> u64 {
    if lora_name.is_empty() {
        SEED
    } else {
        SEED.wrapping_add(xxh3_64(lora_name.as_bytes()))
    }
}

/// The sequence hash of a block whose local hash is `local`, following the block
/// whose sequence hash is `parent` (none for the first block).
pub fn sequence_hash(parent: Option<u64>, local: u64) -> u64 {
    match parent {
        None => local,
        Some(parent) => {
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&parent.to_le_bytes());
            bytes[8..].copy_from_slice(&local.to_le_bytes());
            xxh3_64_with_seed(&bytes, SEED)
        }
    }
}

/// Sequence hashes of a chain of local hashes starting at the root.
pub fn sequence_hashes(local_hashes: &[u64]) -> Vec<u64> {
    let mut parent = None;
    local_hashes
        .iter()
        .map(|&local| {
            let seq = sequence_hash(parent, local);
            parent = Some(seq);
            seq
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKENS: [u32; 16] = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15];

    #[test]
    fn xxh3_with_dynamo_seed_matches_reference_vector() {
        assert_eq!(xxh3_64_with_seed(b"test data", SEED), 13226331709069118873);
    }

    #[test]
    fn local_and_sequence_hashes_match_dynamo_vectors() {
        let local = BlockHasher::new(4).local_hashes(&TOKENS);
        assert_eq!(
            local,
            [
                9143094415614847814,
                12124091508212882195,
                1088361764653601668,
                16024980976528976948
            ]
        );
        assert_eq!(
            sequence_hashes(&local),
            [
                9143094415614847814,
                9510318385840434533,
                16998148715716822651,
                16790386768269814709
            ]
        );
    }

    #[test]
    fn lora_adapter_shifts_local_hashes_to_dynamo_vectors() {
        let local = BlockHasher::with_lora(4, "my-adapter").local_hashes(&TOKENS);
        assert_eq!(
            local,
            [
                13692202469334984872,
                14659540909498545450,
                8053486760833573929,
                17568930666626936681
            ]
        );
        assert_eq!(BlockHasher::with_lora(4, ""), BlockHasher::new(4));
    }

    /// Dynamo's rule spelled out (xxh3 of each full block's little-endian
    /// token bytes) against the 16-token path, base model and adapter.
    #[test]
    fn sixteen_token_blocks_hash_as_the_rule_says() {
        let tokens: Vec<u32> = (0..16 * 9 + 5)
            .map(|i: u32| i.wrapping_mul(2_654_435_761) >> 7)
            .collect();
        for hasher in [
            BlockHasher::new(16),
            BlockHasher::with_lora(16, "my-adapter"),
        ] {
            let expected: Vec<u64> = tokens
                .chunks(16)
                .filter(|block| block.len() == 16)
                .map(|block| {
                    let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
                    xxh3_64_with_seed(&bytes, hasher.seed)
                })
                .collect();
            assert_eq!(hasher.local_hashes(&tokens), expected);
        }
    }

    #[test]
    fn trailing_partial_block_is_not_hashed() {
        let hasher = BlockHasher::new(4);
        assert_eq!(hasher.local_hashes(&TOKENS[..15]).len(), 3);
        assert!(hasher.local_hashes(&TOKENS[..3]).is_empty());
    }

    #[test]
    fn multimodal_hashes_are_order_independent_and_change_the_block() {
        let hasher = BlockHasher::new(4);
        let plain = hasher.local_hashes(&TOKENS[..4])[0];
        let a = hasher.local_hash_multimodal(&TOKENS[..4], &[7, 3]);
        let b = hasher.local_hash_multimodal(&TOKENS[..4], &[3, 7]);
        assert_eq!(a, b);
        assert_ne!(a, plain);
        assert_eq!(hasher.local_hash_multimodal(&TOKENS[..4], &[]), plain);
    }

    /// Whether two requests' chains share their first block, from sequence hashes.
    fn first_blocks_match(a: &ExtraKeys, b: &ExtraKeys) -> (bool, bool) {
        let hasher = BlockHasher::new(4);
        let a = sequence_hashes(&hasher.local_hashes_with(&TOKENS, a));
        let b = sequence_hashes(&hasher.local_hashes_with(&TOKENS, b));
        (a[0] == b[0], a[3] == b[3])
    }

    fn salted(salt: &str) -> ExtraKeys {
        ExtraKeys {
            cache_salt: Some(salt.into()),
            ..ExtraKeys::default()
        }
    }

    #[test]
    fn a_salt_keys_the_first_block_and_so_the_whole_chain() {
        let plain = ExtraKeys::default();
        assert_eq!(
            BlockHasher::new(4).local_hashes_with(&TOKENS, &plain),
            BlockHasher::new(4).local_hashes(&TOKENS),
            "no extra keys: Dynamo's hashes"
        );
        assert_eq!(first_blocks_match(&salted("a"), &salted("a")), (true, true));
        assert_eq!(
            first_blocks_match(&salted("a"), &salted("b")),
            (false, false)
        );
        assert_eq!(first_blocks_match(&salted("a"), &plain), (false, false));
        // The empty salt is no salt, as in vLLM.
        assert_eq!(first_blocks_match(&salted(""), &plain), (true, true));
        // Only the first block's own hash changes; the rest differ through the chain.
        let hasher = BlockHasher::new(4);
        let (s, p) = (
            hasher.local_hashes_with(&TOKENS, &salted("a")),
            hasher.local_hashes(&TOKENS),
        );
        assert_ne!(s[0], p[0]);
        assert_eq!(s[1..], p[1..]);
    }

    #[test]
    fn an_image_keys_the_blocks_holding_its_placeholders() {
        let image = |hash| ExtraKeys {
            multimodal: vec![MultimodalItem {
                offset: 6,
                length: 4,
                hash,
            }],
            ..ExtraKeys::default()
        };
        let hasher = BlockHasher::new(4);
        let with = hasher.local_hashes_with(&TOKENS, &image(42));
        let plain = hasher.local_hashes(&TOKENS);
        // Tokens 6..10 lie in blocks 1 and 2.
        assert_eq!(with[0], plain[0]);
        assert_eq!(with[1], hasher.local_hash_multimodal(&TOKENS[4..8], &[42]));
        assert_eq!(with[2], hasher.local_hash_multimodal(&TOKENS[8..12], &[42]));
        assert_eq!(with[3], plain[3]);
        assert_ne!(with[1], hasher.local_hashes_with(&TOKENS, &image(43))[1]);
    }

    #[test]
    fn multimodal_identifiers_hash_hex_digests_by_their_tail() {
        assert_eq!(
            multimodal_identifier_hash(
                "00000000000000000000000000000000000000000000000000000000000000ff"
            ),
            255
        );
        assert_ne!(
            multimodal_identifier_hash("img-1"),
            multimodal_identifier_hash("img-2")
        );
        assert_ne!(salt_key("x"), multimodal_identifier_hash("x"));
    }
}

//! Block hashing, byte-compatible with NVIDIA Dynamo's KV router.
//!
//! Engines and routers only agree on which prefix a worker holds if they hash the
//! same tokens to the same numbers, so every rule here mirrors Dynamo exactly:
//! xxh3-64 with seed 1337 over little-endian token bytes, one *local* hash per full
//! block, chained into *sequence* hashes that identify a block together with its
//! whole prefix. A LoRA adapter shifts the local seed so that adapter and base-model
//! blocks never collide; chaining always uses the base seed.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// The seed Dynamo uses for every block hash.
pub const SEED: u64 = 1337;

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
        let mut bytes = Vec::with_capacity(self.block_size * 4);
        tokens
            .chunks_exact(self.block_size)
            .map(|block| {
                bytes.clear();
                bytes.extend(block.iter().flat_map(|t| t.to_le_bytes()));
                xxh3_64_with_seed(&bytes, self.seed)
            })
            .collect()
    }

    /// Local hash of one full block whose multimodal objects hash to `mm_hashes`:
    /// the token bytes followed by the sorted object hashes, little-endian.
    pub fn local_hash_multimodal(&self, block: &[u32], mm_hashes: &[u64]) -> u64 {
        let mut sorted = mm_hashes.to_vec();
        sorted.sort_unstable();
        let mut bytes = Vec::with_capacity(block.len() * 4 + sorted.len() * 8);
        bytes.extend(block.iter().flat_map(|t| t.to_le_bytes()));
        bytes.extend(sorted.iter().flat_map(|h| h.to_le_bytes()));
        xxh3_64_with_seed(&bytes, self.seed)
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
}

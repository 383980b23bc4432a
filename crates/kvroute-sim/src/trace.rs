//! Mooncake trace requests as token ids.
//!
//! A trace gives each request's blocks as `hash_ids` of 512 tokens each (the
//! last one partial), where equal ids mean equal prefixes. Giving every id its
//! own deterministic 512 tokens turns a request into a real prompt whose block
//! hashes are shared exactly where the trace says the KV is.

/// Tokens per trace block.
pub const TRACE_BLOCK_TOKENS: usize = 512;

/// The prompt of a trace request: `input_length` tokens of its ids' blocks.
pub fn trace_tokens(hash_ids: &[u64], input_length: usize) -> Vec<u32> {
    let mut tokens = Vec::with_capacity(hash_ids.len() * TRACE_BLOCK_TOKENS);
    for &id in hash_ids {
        tokens.extend((0..TRACE_BLOCK_TOKENS as u64).map(|i| block_token(id, i)));
    }
    tokens.truncate(input_length);
    tokens
}

/// Token `i` of block `id`: splitmix64 of both, within a 32k vocabulary.
fn block_token(id: u64, i: u64) -> u32 {
    let mut z = id
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(i.wrapping_mul(0xBF58_476D_1CE4_E5B9))
        .wrapping_add(0x94D0_49BB_1331_11EB);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z % 32_000) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_ids_give_equal_blocks_and_lengths_are_exact() {
        let a = trace_tokens(&[0, 1, 2], 1200);
        let b = trace_tokens(&[0, 1, 3], 1500);
        assert_eq!(a.len(), 1200);
        assert_eq!(b.len(), 1500);
        assert_eq!(a[..1024], b[..1024]);
        assert_ne!(a[1024..1200], b[1024..1200]);
        assert_ne!(a[..512], a[512..1024]);
    }
}

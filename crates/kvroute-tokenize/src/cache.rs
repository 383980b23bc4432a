//! A bounded cache of recent tokenizations.
//!
//! Tokenizing dominates the router's CPU time on long prompts, and prompts
//! repeat: agents resend the same context, multi-turn chats resend their history
//! (with tiktoken every message is cached on its own, so the history hits even
//! when a new turn is appended). The cache maps a 128-bit xxh3 hash of the text
//! to its token ids; at 128 bits a collision between distinct prompts is not a
//! practical concern, and keying by hash keeps the texts themselves out of memory.
//!
//! It is a `quick_cache` sharded cache (concurrent, S3-FIFO eviction, so one
//! scan of unique prompts does not flush the hot ones) whose capacity is counted
//! in tokens: at 4 bytes a token, [`DEFAULT_CACHE_TOKENS`] bounds it near 64 MiB.

use std::sync::Arc;

use quick_cache::Weighter;
use xxhash_rust::xxh3::xxh3_128_with_seed;

use crate::TokenizeError;

/// Default capacity of a tokenizer's cache, in cached tokens (2,048 prompts of
/// 8k tokens).
pub const DEFAULT_CACHE_TOKENS: u64 = 16 << 20;

/// Token ids shared between the cache and its readers.
type Ids = Arc<[u32]>;

/// What was done to the text, so that the same text tokenized two ways gets two
/// entries.
#[derive(Clone, Copy)]
pub(crate) enum Kind {
    /// A completions prompt, with the special tokens the engine adds by default.
    Prompt,
    /// A rendered chat template, without added special tokens.
    Chat,
    /// One message's text inside a tiktoken chat.
    Segment,
}

#[derive(Clone)]
struct TokenCount;

impl Weighter<u128, Ids> for TokenCount {
    fn weight(&self, _key: &u128, ids: &Ids) -> u64 {
        // Empty results still take a slot; weight 0 would exempt them from eviction.
        ids.len().max(1) as u64
    }
}

pub(crate) struct TokenCache {
    /// `None` when the capacity is 0: every call tokenizes.
    entries: Option<quick_cache::sync::Cache<u128, Ids, TokenCount>>,
}

impl TokenCache {
    pub(crate) fn new(capacity_tokens: u64) -> Self {
        let entries = (capacity_tokens > 0).then(|| {
            // Sized for prompts of ~1k tokens on average; the cache grows its
            // tables if they are shorter.
            let estimated_items = (capacity_tokens / 1024).max(16) as usize;
            quick_cache::sync::Cache::with_weighter(estimated_items, capacity_tokens, TokenCount)
        });
        TokenCache { entries }
    }

    /// The cached ids of `text`, or `tokenize(text)`, remembered on success.
    pub(crate) fn get_or_tokenize(
        &self,
        kind: Kind,
        text: &str,
        tokenize: impl FnOnce(&str) -> Result<Vec<u32>, TokenizeError>,
    ) -> Result<Ids, TokenizeError> {
        let Some(entries) = &self.entries else {
            return tokenize(text).map(Ids::from);
        };
        let key = xxh3_128_with_seed(text.as_bytes(), kind as u64);
        if let Some(ids) = entries.get(&key) {
            return Ok(ids);
        }
        let ids = Ids::from(tokenize(text)?);
        entries.insert(key, ids.clone());
        Ok(ids)
    }
}

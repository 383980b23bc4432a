//! A bounded cache of recent tokenizations.
//!
//! Tokenizing dominates the router's CPU time on long prompts, and prompts
//! repeat: agents resend the same context, multi-turn chats resend their history.
//! Text is cached in chunks (`chunks` module), so a history hits even when a new
//! turn is appended. The cache maps a 128-bit xxh3 hash of the text
//! to its token ids; at 128 bits a collision between distinct prompts is not a
//! practical concern, and keying by hash keeps the texts themselves out of memory.
//!
//! It is a `quick_cache` sharded cache (concurrent, S3-FIFO eviction, so one
//! scan of unique prompts does not flush the hot ones) whose capacity is counted
//! in tokens: at 4 bytes a token, [`DEFAULT_CACHE_TOKENS`] bounds it near 64 MiB.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

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
    /// A whole completions prompt, with the special tokens the engine adds
    /// by default (Hugging Face, when its prompts cannot be cut).
    Prompt,
    /// A chunk of text encoded without added special tokens: tiktoken's
    /// prompts and messages, a Hugging Face tokenizer's rendered chats and
    /// (before its BOS, say, is added) prompts.
    Text,
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
    capacity_tokens: u64,
    hit_tokens: AtomicU64,
    tokenized_tokens: AtomicU64,
}

/// What a tokenizer's cache holds and has saved, for the router's metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Tokens held now.
    pub cached_tokens: u64,
    /// The most it holds.
    pub capacity_tokens: u64,
    /// Tokens served from the cache so far.
    pub hit_tokens: u64,
    /// Tokens tokenized so far (cache misses).
    pub tokenized_tokens: u64,
}

impl TokenCache {
    pub(crate) fn new(capacity_tokens: u64) -> Self {
        let entries = (capacity_tokens > 0).then(|| {
            // Sized for prompts of ~1k tokens on average; the cache grows its
            // tables if they are shorter.
            let estimated_items = (capacity_tokens / 1024).max(16) as usize;
            quick_cache::sync::Cache::with_weighter(estimated_items, capacity_tokens, TokenCount)
        });
        TokenCache {
            entries,
            capacity_tokens,
            hit_tokens: AtomicU64::new(0),
            tokenized_tokens: AtomicU64::new(0),
        }
    }

    pub(crate) fn stats(&self) -> CacheStats {
        CacheStats {
            cached_tokens: self.entries.as_ref().map_or(0, |e| e.weight()),
            capacity_tokens: self.capacity_tokens,
            hit_tokens: self.hit_tokens.load(Ordering::Relaxed),
            tokenized_tokens: self.tokenized_tokens.load(Ordering::Relaxed),
        }
    }

    fn tokenize(
        &self,
        text: &str,
        tokenize: impl FnOnce(&str) -> Result<Vec<u32>, TokenizeError>,
    ) -> Result<Ids, TokenizeError> {
        let ids = tokenize(text)?;
        self.tokenized_tokens
            .fetch_add(ids.len() as u64, Ordering::Relaxed);
        Ok(Ids::from(ids))
    }

    /// The cached ids of `text`, or `tokenize(text)`, remembered on success.
    pub(crate) fn get_or_tokenize(
        &self,
        kind: Kind,
        text: &str,
        tokenize: impl FnOnce(&str) -> Result<Vec<u32>, TokenizeError>,
    ) -> Result<Ids, TokenizeError> {
        let Some(entries) = &self.entries else {
            return self.tokenize(text, tokenize);
        };
        let key = xxh3_128_with_seed(text.as_bytes(), kind as u64);
        if let Some(ids) = entries.get(&key) {
            self.hit_tokens
                .fetch_add(ids.len() as u64, Ordering::Relaxed);
            return Ok(ids);
        }
        let ids = self.tokenize(text, tokenize)?;
        entries.insert(key, ids.clone());
        Ok(ids)
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    fn ids(text: &str) -> Result<Vec<u32>, TokenizeError> {
        Ok(text.bytes().map(u32::from).collect())
    }

    #[test]
    fn a_hit_skips_tokenizing_and_kinds_are_separate_entries() {
        let cache = TokenCache::new(1 << 10);
        let calls = Cell::new(0);
        let counted = |text: &str| {
            calls.set(calls.get() + 1);
            ids(text)
        };
        let first = cache.get_or_tokenize(Kind::Prompt, "abc", counted).unwrap();
        let again = cache.get_or_tokenize(Kind::Prompt, "abc", counted).unwrap();
        assert_eq!(first, again);
        assert_eq!(calls.get(), 1);
        cache.get_or_tokenize(Kind::Text, "abc", counted).unwrap();
        assert_eq!(calls.get(), 2);
        let stats = cache.stats();
        assert_eq!((stats.hit_tokens, stats.tokenized_tokens), (3, 6));
        assert_eq!(stats.cached_tokens, 6);
    }

    #[test]
    fn errors_are_not_cached() {
        let cache = TokenCache::new(1 << 10);
        let failing = |_: &str| -> Result<Vec<u32>, TokenizeError> {
            Err(TokenizeError::Encode {
                message: "no".to_string(),
            })
        };
        assert!(cache.get_or_tokenize(Kind::Prompt, "x", failing).is_err());
        assert_eq!(
            *cache.get_or_tokenize(Kind::Prompt, "x", ids).unwrap(),
            [120]
        );
    }

    #[test]
    fn the_cache_holds_at_most_its_capacity_in_tokens() {
        let capacity = 1_000;
        let cache = TokenCache::new(capacity);
        for i in 0..2_000 {
            let text = format!("prompt number {i:05}");
            cache.get_or_tokenize(Kind::Prompt, &text, ids).unwrap();
        }
        let entries = cache.entries.as_ref().unwrap();
        assert!(entries.weight() <= capacity, "{}", entries.weight());
        assert!(!entries.is_empty());
    }

    #[test]
    fn capacity_zero_tokenizes_every_time() {
        let cache = TokenCache::new(0);
        let calls = Cell::new(0);
        for _ in 0..3 {
            cache
                .get_or_tokenize(Kind::Prompt, "abc", |text| {
                    calls.set(calls.get() + 1);
                    ids(text)
                })
                .unwrap();
        }
        assert_eq!(calls.get(), 3);
    }
}

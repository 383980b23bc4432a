//! kvroute-tokenize: turns OpenAI-style prompts into token ids exactly as the
//! inference workers do.
//!
//! The router hashes a prompt's token ids block by block and looks the hashes up
//! in the index of what each worker has cached. Workers hash the tokens *they*
//! produced, so if the router tokenizes a prompt differently by even one token
//! (another BOS rule, another chat template, another whitespace split) every
//! block hash after it differs and no cached prefix is ever found. This crate is
//! therefore the single place where kvroute tokenizes: the router uses it, and
//! the simulated workers use it so they tokenize exactly as the router does.
//!
//! - [`TokenizerSpec`] names a tokenizer in the configuration: a Hugging Face
//!   `tokenizer.json` with its chat template ([`hf`](crate::hf) module), or an
//!   OpenAI tiktoken encoding ([`tiktoken`](crate::tiktoken) module).
//! - [`Tokenizer`] encodes completions prompts ([`Tokenizer::encode`]) and chat
//!   messages ([`Tokenizer::encode_chat`]), remembering recent results in a
//!   bounded cache (`cache` module) because prompts repeat, chunk by chunk
//!   (`chunks` module) because conversations grow.
//! - [`parse_completion_prompt`] and [`ChatMessage`] read the prompt shapes
//!   OpenAI clients send.
//! - [`Tokenizer::fingerprint`] names what decides the ids (vocabulary, rules,
//!   chat template), so that a router and its workers can check that they
//!   tokenize alike before any prompt is routed.
//! - [`TokenizeError`] is the one error type; no input makes this crate panic.

mod cache;
mod chat_template;
mod chunks;
mod encode;
mod error;
mod hf;
mod merges;
mod pieces;
mod prompt;
mod spec;
mod split;
mod tiktoken;
mod vocab;

pub use cache::{CacheStats, DEFAULT_CACHE_TOKENS};
pub use error::TokenizeError;
pub use hf::byte_chars;
pub use prompt::{ChatMessage, IMAGE_PLACEHOLDER, Prompt, parse_completion_prompt};
pub use spec::TokenizerSpec;

use std::fmt;

use cache::TokenCache;
use hf::HfTokenizer;
use kvroute_index::{MultimodalItem, multimodal_identifier_hash};
use tiktoken::TiktokenTokenizer;

/// A loaded tokenizer with its chat template and cache. `Send + Sync`: load it
/// once and share it through an `Arc`.
pub struct Tokenizer {
    spec: TokenizerSpec,
    fingerprint: String,
    backend: Backend,
    cache: TokenCache,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("spec", &self.spec.to_string())
            .finish_non_exhaustive()
    }
}

enum Backend {
    Tiktoken(Box<TiktokenTokenizer>),
    HuggingFace(Box<HfTokenizer>),
}

impl Tokenizer {
    /// Loads the tokenizer `spec` names, with a cache of
    /// [`DEFAULT_CACHE_TOKENS`] tokens.
    pub fn load(spec: &TokenizerSpec) -> Result<Self, TokenizeError> {
        Self::load_with_cache(spec, DEFAULT_CACHE_TOKENS)
    }

    /// Loads the tokenizer `spec` names, caching up to `cache_tokens` tokens of
    /// recent results (0: no cache).
    pub fn load_with_cache(spec: &TokenizerSpec, cache_tokens: u64) -> Result<Self, TokenizeError> {
        let (backend, fingerprint) = match spec {
            TokenizerSpec::Tiktoken { encoding } => {
                let tiktoken = TiktokenTokenizer::load(encoding)?;
                // The vocabularies are compiled in, so the encoding's name
                // identifies one; the chat format is this crate's ChatML.
                let identity = format!("tiktoken:{encoding}\nchat:chatml");
                (Backend::Tiktoken(Box::new(tiktoken)), identity.into_bytes())
            }
            TokenizerSpec::HuggingFace { dir_or_file } => {
                let (hf, identity) = HfTokenizer::load(dir_or_file)?;
                (Backend::HuggingFace(Box::new(hf)), identity)
            }
            TokenizerSpec::None => return Err(TokenizeError::NoTokenizer),
        };
        Ok(Tokenizer {
            spec: spec.clone(),
            fingerprint: format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&fingerprint)),
            backend,
            cache: TokenCache::new(cache_tokens),
        })
    }

    /// The spec this tokenizer was loaded from, for logs and `/v1/route`.
    pub fn spec(&self) -> &TokenizerSpec {
        &self.spec
    }

    /// A digest of everything that decides the ids: for a Hugging Face
    /// tokenizer the bytes of `tokenizer.json` (vocabulary, merges, normalizer,
    /// BOS rule), of the chat template and of `tokenizer_config.json`; for
    /// tiktoken the encoding's name (its vocabulary is compiled in) and the chat
    /// format. Two tokenizers with one fingerprint give the same ids; copies of
    /// the same files at different paths have the same fingerprint.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// Token ids of a completions prompt, with the special tokens the engine
    /// adds by default (a Hugging Face tokenizer's BOS, if it has one; none for
    /// tiktoken).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        match &self.backend {
            Backend::Tiktoken(tiktoken) => tiktoken.encode_cached(text, &self.cache),
            Backend::HuggingFace(hf) => hf.encode_prompt(text, &self.cache),
        }
    }

    /// What the cache of recent tokenizations holds and has saved.
    pub fn cache_stats(&self) -> CacheStats {
        self.cache.stats()
    }

    /// Token ids of a chat: the chat template applied to `messages`, then
    /// encoded without added special tokens (the template writes them).
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        match &self.backend {
            Backend::Tiktoken(tiktoken) => {
                tiktoken.encode_chat(messages, add_generation_prompt, &self.cache)
            }
            Backend::HuggingFace(hf) => {
                let text = hf
                    .chat_template()?
                    .render(messages, add_generation_prompt)?;
                hf.encode_chat_text(&text, &self.cache)
            }
        }
    }

    /// Token ids of a chat's `messages` (as the request's JSON array), and its
    /// images as the extra keys of the blocks holding them: each keyed by the
    /// [`multimodal_identifier_hash`] of the part's `uuid`, else of its URL.
    /// Each image's span starts where the prompt's tokens
    /// first differ from those of the same chat without that image and the
    /// ones after it; the router and the simulated engine both place images
    /// this way, so the blocks before an image are shared by every request
    /// with that prefix, and the blocks from it on only by requests with the
    /// same image.
    pub fn encode_chat_with_images(
        &self,
        messages: &[serde_json::Value],
        add_generation_prompt: bool,
    ) -> Result<(Vec<u32>, Vec<MultimodalItem>), TokenizeError> {
        let invalid = |message: String| TokenizeError::InvalidPrompt {
            message: format!("invalid `messages`: {message}"),
        };
        let full: Vec<ChatMessage> =
            serde_json::from_value(serde_json::Value::Array(messages.to_vec()))
                .map_err(|e| invalid(e.to_string()))?;
        let tokens = self.encode_chat(&full, add_generation_prompt)?;
        let mut spans = Vec::new();
        for (kept, identifier) in prompt::image_identifiers(messages).into_iter().enumerate() {
            let mut budget = kept;
            let mut without = full.clone();
            for (message, raw) in without.iter_mut().zip(messages) {
                let content = raw.get("content").unwrap_or(&serde_json::Value::Null);
                message.content =
                    prompt::content_from_value(content, &mut budget).map_err(invalid)?;
            }
            let other = self.encode_chat(&without, add_generation_prompt)?;
            let offset = tokens
                .iter()
                .zip(&other)
                .take_while(|(a, b)| a == b)
                .count();
            spans.push(MultimodalItem {
                offset,
                length: 1,
                hash: multimodal_identifier_hash(&identifier),
            });
        }
        Ok((tokens, spans))
    }

    /// The prompt text the model's chat template makes of `messages`;
    /// `add_generation_prompt` appends the header of the assistant's reply.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizeError> {
        match &self.backend {
            Backend::Tiktoken(tiktoken) => {
                Ok(tiktoken.apply_chat_template(messages, add_generation_prompt))
            }
            Backend::HuggingFace(hf) => hf.chat_template()?.render(messages, add_generation_prompt),
        }
    }
}

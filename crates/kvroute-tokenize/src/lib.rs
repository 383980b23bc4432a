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
//!   OpenAI clients send; [`responses_messages`] and [`anthropic_messages`]
//!   turn Responses and Messages prompts into chat messages (`apis` module).
//! - [`Tokenizer::fingerprint`] names what decides the ids (vocabulary, rules,
//!   chat template), so that a router and its workers can check that they
//!   tokenize alike before any prompt is routed.
//! - [`TokenizeError`] is the one error type; no input makes this crate panic.

mod apis;
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

pub use apis::{anthropic_messages, responses_input, responses_messages};
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

    /// The text of token ids (`/detokenize`); an id outside the vocabulary,
    /// or ids that end inside a character, are refused.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizeError> {
        match &self.backend {
            Backend::Tiktoken(tiktoken) => tiktoken.decode(ids),
            Backend::HuggingFace(hf) => hf.decode(ids),
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
        self.encode_chat_marked(messages, add_generation_prompt, None)
    }

    /// [`Self::encode_chat`]; with `images`, see [`encode_marked`].
    fn encode_chat_marked(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        images: Option<&mut Vec<usize>>,
    ) -> Result<Vec<u32>, TokenizeError> {
        match &self.backend {
            Backend::Tiktoken(tiktoken) => {
                tiktoken.encode_chat(messages, add_generation_prompt, &self.cache, images)
            }
            Backend::HuggingFace(hf) => {
                let text = hf
                    .chat_template()?
                    .render(messages, add_generation_prompt)?;
                let encode = |text: &str| hf.encode_chat_text(text, &self.cache);
                match images {
                    None => encode(&text),
                    Some(offsets) => {
                        let mut ids = Vec::with_capacity(text.len() / 4 + 16);
                        encode_marked(&text, encode, &mut ids, offsets)?;
                        Ok(ids)
                    }
                }
            }
        }
    }

    /// Token ids of a chat's `messages` (as the request's JSON array), and its
    /// images as the extra keys of the blocks holding them: each keyed by the
    /// [`multimodal_identifier_hash`] of the part's `uuid`, else of its URL.
    ///
    /// An image part is the text [`IMAGE_PLACEHOLDER`], and the text is cut at
    /// each placeholder, each part and each placeholder tokenized on its own,
    /// as an engine's image placeholder tokens (special tokens) cut it; an
    /// image's span starts at its placeholder's first token. So the blocks
    /// before an image are shared by every request with that prefix, and the
    /// blocks from it on only by requests with the same image. The router and
    /// the simulated engine both place images this way. Tokenizing is one pass
    /// over the rendered chat, however many images it holds: each image's
    /// place is found by rendering it as a mark ([`prompt::IMAGE_MARK`]). If a
    /// message already holds that mark, or the template does not write each
    /// image's mark once, the chat is tokenized whole and every image keys
    /// all of its blocks (no prefix is shared, none is matched wrongly).
    pub fn encode_chat_with_images(
        &self,
        messages: &[serde_json::Value],
        add_generation_prompt: bool,
    ) -> Result<(Vec<u32>, Vec<MultimodalItem>), TokenizeError> {
        let invalid = |message: String| TokenizeError::InvalidPrompt {
            message: format!("invalid `messages`: {message}"),
        };
        let chat: Vec<ChatMessage> =
            serde_json::from_value(serde_json::Value::Array(messages.to_vec()))
                .map_err(|e| invalid(e.to_string()))?;
        let identifiers = prompt::image_identifiers(messages);
        if identifiers.is_empty() {
            return Ok((self.encode_chat(&chat, add_generation_prompt)?, Vec::new()));
        }
        let item = |identifier: &String, offset| MultimodalItem {
            offset,
            length: 1,
            hash: multimodal_identifier_hash(identifier),
        };
        let markable = !chat
            .iter()
            .any(|m| m.role.contains(prompt::IMAGE_MARK) || m.content.contains(prompt::IMAGE_MARK));
        if markable {
            let mut marked = chat.clone();
            let mark = prompt::IMAGE_MARK.to_string();
            for (message, raw) in marked.iter_mut().zip(messages) {
                if let Some(content) = raw.get("content").filter(|c| c.is_array()) {
                    message.content =
                        prompt::content_from_value(content, &mark).map_err(invalid)?;
                }
            }
            let mut offsets = Vec::with_capacity(identifiers.len());
            let tokens =
                self.encode_chat_marked(&marked, add_generation_prompt, Some(&mut offsets))?;
            if offsets.len() == identifiers.len() {
                let spans = identifiers.iter().zip(offsets).map(|(i, o)| item(i, o));
                return Ok((tokens, spans.collect()));
            }
        }
        let tokens = self.encode_chat(&chat, add_generation_prompt)?;
        Ok((tokens, identifiers.iter().map(|i| item(i, 0)).collect()))
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

/// Appends the ids of `text`, in which each image is written as
/// [`prompt::IMAGE_MARK`]: the text between marks `encode`d part by part, each
/// mark as an [`IMAGE_PLACEHOLDER`] of its own, whose first id's position is
/// pushed to `offsets`. One pass over `text`.
fn encode_marked(
    text: &str,
    encode: impl Fn(&str) -> Result<Vec<u32>, TokenizeError>,
    ids: &mut Vec<u32>,
    offsets: &mut Vec<usize>,
) -> Result<(), TokenizeError> {
    let mut placeholder = None;
    for (index, part) in text.split(prompt::IMAGE_MARK).enumerate() {
        if index > 0 {
            offsets.push(ids.len());
            if placeholder.is_none() {
                placeholder = Some(encode(IMAGE_PLACEHOLDER)?);
            }
            ids.extend_from_slice(placeholder.as_deref().unwrap_or_default());
        }
        if !part.is_empty() {
            ids.extend(encode(part)?);
        }
    }
    Ok(())
}

//! Turning a request's prompt into token ids, through `kvroute-tokenize`.
//!
//! Token-id prompts are used as they are. Text prompts and chat messages need
//! the configured tokenizer, which must be the workers' own: a different
//! tokenizer gives different tokens, so no block hash would ever match.

use kvroute_tokenize::{ChatMessage, TokenizerSpec};
use serde_json::Value;

pub use kvroute_tokenize::Prompt;

use crate::config::{TokenizerConfig, TokenizerKind};
use crate::error::RouterError;

/// The configured tokenizer.
pub struct Tokenizer {
    inner: kvroute_tokenize::Tokenizer,
}

impl Tokenizer {
    /// `None` for `kind = "none"`: text is then routed on load alone.
    pub fn load(config: &TokenizerConfig) -> Result<Option<Self>, RouterError> {
        let spec = match config.kind {
            TokenizerKind::None => return Ok(None),
            TokenizerKind::Huggingface => TokenizerSpec::HuggingFace {
                dir_or_file: config.path.clone().into(),
            },
            TokenizerKind::Tiktoken => TokenizerSpec::Tiktoken {
                encoding: config.encoding.clone(),
            },
        };
        let inner = kvroute_tokenize::Tokenizer::load(&spec)
            .map_err(|e| RouterError::Config(format!("tokenizer: {e}")))?;
        Ok(Some(Self { inner }))
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>, RouterError> {
        self.inner
            .encode(text)
            .map_err(|e| RouterError::Tokenize(e.to_string()))
    }

    /// Tokens of a chat request's `messages` through the model's chat template.
    pub fn encode_chat(
        &self,
        messages: &Value,
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, RouterError> {
        let messages: Vec<ChatMessage> = serde_json::from_value(messages.clone())
            .map_err(|e| RouterError::BadRequest(format!("invalid `messages`: {e}")))?;
        self.inner
            .encode_chat(&messages, add_generation_prompt)
            .map_err(|e| RouterError::Tokenize(e.to_string()))
    }
}

/// The `prompt` of a completion request: a string or token ids.
pub fn completion_prompt(prompt: &Value) -> Result<Prompt, RouterError> {
    kvroute_tokenize::parse_completion_prompt(prompt)
        .map_err(|e| RouterError::BadRequest(e.to_string()))
}

//! Turning a request's prompt into token ids.
//!
//! Token-id prompts are used as they are. Text prompts and chat messages need
//! the configured tokenizer, which must be the workers' own: a different
//! tokenizer gives different tokens, so no block hash would ever match.

use serde_json::Value;

use crate::config::{TokenizerConfig, TokenizerKind};
use crate::error::RouterError;

/// A completion prompt as the request gave it.
#[derive(Debug, PartialEq, Eq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// The configured tokenizer.
pub struct Tokenizer {
    _private: (),
}

impl Tokenizer {
    /// `None` for `kind = "none"`: text is then routed on load alone.
    pub fn load(config: &TokenizerConfig) -> Result<Option<Self>, RouterError> {
        match config.kind {
            TokenizerKind::None => Ok(None),
            kind => Err(RouterError::Config(format!(
                "tokenizer kind {kind:?} is not available in this build"
            ))),
        }
    }

    pub fn encode(&self, _text: &str) -> Result<Vec<u32>, RouterError> {
        Err(RouterError::Tokenize("no tokenizer".into()))
    }

    pub fn encode_chat(&self, _messages: &Value) -> Result<Vec<u32>, RouterError> {
        Err(RouterError::Tokenize("no tokenizer".into()))
    }
}

/// The `prompt` of a completion request: a string, token ids, or a batch of one
/// of those (a batch is routed by its first prompt: one worker serves it all).
pub fn completion_prompt(prompt: &Value) -> Result<Prompt, RouterError> {
    let bad = || {
        RouterError::BadRequest(
            "`prompt` must be a string, an array of token ids, or an array of those".into(),
        )
    };
    match prompt {
        Value::String(s) => Ok(Prompt::Text(s.clone())),
        Value::Array(items) if items.is_empty() => Err(bad()),
        Value::Array(items) if items[0].is_number() => items
            .iter()
            .map(|v| {
                v.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or_else(bad)
            })
            .collect::<Result<Vec<u32>, _>>()
            .map(Prompt::Tokens),
        Value::Array(items) if items[0].is_string() || items[0].is_array() => {
            completion_prompt(&items[0])
        }
        _ => Err(bad()),
    }
}

//! The crate's one error type.
//!
//! Messages are written for whoever has to act on them: a client whose prompt
//! has the wrong shape (the router answers 400 with the message), or an operator
//! whose tokenizer files are missing or broken (the router refuses to start).

use std::path::PathBuf;

/// Why a tokenizer could not be loaded or a prompt could not be tokenized.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// A tokenizer spec string that is neither `tiktoken:NAME` nor `hf:PATH`.
    #[error(
        "invalid tokenizer spec '{spec}': {reason} (expected 'tiktoken:cl100k_base', 'tiktoken:o200k_base', 'hf:/path/to/tokenizer' or 'none')"
    )]
    InvalidSpec { spec: String, reason: String },
    /// The spec is `none`: there is no tokenizer to load.
    #[error(
        "no tokenizer is configured (tokenizer spec 'none'): only token-id prompts can be used"
    )]
    NoTokenizer,
    /// A tiktoken encoding this crate does not ship.
    #[error("unknown tiktoken encoding '{name}': expected cl100k_base or o200k_base")]
    UnknownEncoding { name: String },
    /// A tokenizer file that cannot be read.
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A tokenizer file that was read but is not valid.
    #[error("invalid {path}: {message}")]
    InvalidFile { path: PathBuf, message: String },
    /// Chat requests need a chat template and the tokenizer has none.
    #[error("the tokenizer has no chat template: {detail}")]
    NoChatTemplate { detail: String },
    /// The chat template refused the messages (`raise_exception`) or failed
    /// while rendering them.
    #[error("chat template error: {message}")]
    ChatTemplate { message: String },
    /// The prompt or messages of a request have the wrong shape.
    #[error("{message}")]
    InvalidPrompt { message: String },
    /// The tokenizer itself failed on the text.
    #[error("tokenization failed: {message}")]
    Encode { message: String },
}

impl TokenizeError {
    /// Whether the request was at fault (answer 4xx) rather than the
    /// tokenizer's configuration or files (answer 5xx, or refuse to start).
    pub fn is_client_error(&self) -> bool {
        match self {
            TokenizeError::ChatTemplate { .. }
            | TokenizeError::InvalidPrompt { .. }
            | TokenizeError::Encode { .. }
            | TokenizeError::NoTokenizer => true,
            TokenizeError::InvalidSpec { .. }
            | TokenizeError::UnknownEncoding { .. }
            | TokenizeError::Io { .. }
            | TokenizeError::InvalidFile { .. }
            | TokenizeError::NoChatTemplate { .. } => false,
        }
    }
}

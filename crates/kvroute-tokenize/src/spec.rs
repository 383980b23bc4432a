//! Which tokenizer to load, as written in the router's configuration.
//!
//! The text form is `tiktoken:ENCODING`, `hf:PATH` or `none`; it is also the
//! serde form, so a TOML config can say `tokenizer = "hf:/models/llama-3/"`. The
//! router, the simulator and the bridge all take this one syntax, and workers
//! declare theirs to the router in it.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use crate::TokenizeError;

/// Where a tokenizer comes from.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum TokenizerSpec {
    /// A Hugging Face tokenizer: a model directory holding `tokenizer.json`
    /// (and usually `tokenizer_config.json` with the chat template), or the
    /// path of a `tokenizer.json` file whose directory holds the rest.
    HuggingFace { dir_or_file: PathBuf },
    /// An OpenAI tiktoken encoding embedded in the binary: `cl100k_base` or
    /// `o200k_base`.
    Tiktoken { encoding: String },
    /// No tokenizer: only token-id prompts can be hashed.
    None,
}

impl FromStr for TokenizerSpec {
    type Err = TokenizeError;

    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        let invalid = |reason: &str| TokenizeError::InvalidSpec {
            spec: spec.to_string(),
            reason: reason.to_string(),
        };
        if spec == "none" {
            return Ok(TokenizerSpec::None);
        }
        let (kind, rest) = spec
            .split_once(':')
            .ok_or_else(|| invalid("missing 'tiktoken:' or 'hf:' prefix, and not 'none'"))?;
        if rest.is_empty() {
            return Err(invalid("nothing after the prefix"));
        }
        match kind {
            "tiktoken" => {
                crate::tiktoken::Encoding::from_name(rest)?;
                Ok(TokenizerSpec::Tiktoken {
                    encoding: rest.to_string(),
                })
            }
            "hf" => Ok(TokenizerSpec::HuggingFace {
                dir_or_file: PathBuf::from(rest),
            }),
            _ => Err(invalid(&format!("unknown kind '{kind}'"))),
        }
    }
}

impl fmt::Display for TokenizerSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenizerSpec::HuggingFace { dir_or_file } => write!(f, "hf:{}", dir_or_file.display()),
            TokenizerSpec::Tiktoken { encoding } => write!(f, "tiktoken:{encoding}"),
            TokenizerSpec::None => f.write_str("none"),
        }
    }
}

impl TryFrom<String> for TokenizerSpec {
    type Error = TokenizeError;

    fn try_from(spec: String) -> Result<Self, Self::Error> {
        spec.parse()
    }
}

impl From<TokenizerSpec> for String {
    fn from(spec: TokenizerSpec) -> String {
        spec.to_string()
    }
}

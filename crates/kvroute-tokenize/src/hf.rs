//! Hugging Face tokenizers: `tokenizer.json` through the `tokenizers` crate (the
//! same Rust code the Python `tokenizers` wheels run), and the chat template of
//! `chat_template.jinja` or `tokenizer_config.json` beside it.
//!
//! Special tokens follow vLLM's and SGLang's defaults: a completions prompt is
//! encoded with the tokenizer's added special tokens (a Llama BOS, say), a
//! rendered chat template without them, because the template writes its own.
//!
//! A rendered chat is cached in chunks cut just after added tokens (the
//! `chunks` module), which `tokenizers` splits out first, encoding the text
//! between them part by part. That makes the cut exact unless the tokenizer
//! relates parts to each other, which [`chat_cuts`] checks: an added token that
//! swallows the spaces after it (`rstrip`) is no cut; a `single_word` added
//! token (matched by what is around it), a Metaspace pre-tokenizer prepending
//! `▁` to the first part only (`prepend_scheme: first`), and truncation or
//! padding turn chunking off (the whole text is cached as one entry).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use aho_corasick::{AhoCorasick, MatchKind};
use serde_json::Value;

use crate::TokenizeError;
use crate::cache::{Kind, TokenCache};
use crate::chat_template::ChatTemplate;
use crate::chunks::Cuts;

/// The special tokens transformers hands to chat templates by name.
const SPECIAL_TOKEN_NAMES: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
];

pub(crate) struct HfTokenizer {
    tokenizer: tokenizers::Tokenizer,
    /// The chat template, or why there is none.
    chat: Result<ChatTemplate, String>,
    /// Where a rendered chat may be cut; `None`: nowhere.
    cuts: Option<Cuts>,
}

impl HfTokenizer {
    /// The tokenizer, and the bytes that define it (for its fingerprint): its
    /// `tokenizer.json`, then the chat template and config files that exist.
    pub(crate) fn load(dir_or_file: &Path) -> Result<(Self, Vec<u8>), TokenizeError> {
        let (dir, tokenizer_path) = if dir_or_file.is_dir() {
            (
                dir_or_file.to_path_buf(),
                dir_or_file.join("tokenizer.json"),
            )
        } else {
            let dir = dir_or_file.parent().unwrap_or(Path::new("")).to_path_buf();
            (dir, dir_or_file.to_path_buf())
        };
        let bytes = read(&tokenizer_path)?;
        let tokenizer = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|error| {
            TokenizeError::InvalidFile {
                path: tokenizer_path.clone(),
                message: error.to_string(),
            }
        })?;
        let chat = load_chat_template(&dir)?;
        let mut identity = bytes;
        for name in ["chat_template.jinja", "tokenizer_config.json"] {
            let path = dir.join(name);
            if path.is_file() {
                // A separator, so that moving bytes between files changes the digest.
                identity.extend_from_slice(format!("\0{name}\0").as_bytes());
                identity.extend_from_slice(&read(&path)?);
            }
        }
        let cuts = chat_cuts(&tokenizer);
        Ok((
            HfTokenizer {
                tokenizer,
                chat,
                cuts,
            },
            identity,
        ))
    }

    /// Encodes `text`, adding special tokens when `add_special_tokens`.
    pub(crate) fn encode(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        self.tokenizer
            .encode_fast(text, add_special_tokens)
            .map(|encoding| encoding.get_ids().to_vec())
            .map_err(|error| TokenizeError::Encode {
                message: error.to_string(),
            })
    }

    /// The ids of a rendered chat, without added special tokens, through
    /// `cache`: chunk by chunk where it can be cut, else whole.
    pub(crate) fn encode_chat_text(
        &self,
        text: &str,
        cache: &TokenCache,
    ) -> Result<Vec<u32>, TokenizeError> {
        let encode = |text: &str| self.encode(text, false);
        match &self.cuts {
            Some(cuts) => cuts.encode(cache, Kind::Chat, text, encode),
            None => Ok(cache.get_or_tokenize(Kind::Chat, text, encode)?.to_vec()),
        }
    }

    pub(crate) fn chat_template(&self) -> Result<&ChatTemplate, TokenizeError> {
        self.chat
            .as_ref()
            .map_err(|detail| TokenizeError::NoChatTemplate {
                detail: detail.clone(),
            })
    }
}

/// Where a rendered chat can be cut exactly: after an added token that
/// `tokenizers` splits out of the raw text (not `normalized`) and that keeps
/// the spaces after it (not `rstrip`). The matcher holds every non-normalized
/// added token, as `tokenizers`' own does, so that it finds the same matches.
fn chat_cuts(tokenizer: &tokenizers::Tokenizer) -> Option<Cuts> {
    if tokenizer.get_truncation().is_some() || tokenizer.get_padding().is_some() {
        return None;
    }
    let prepends_first_only = tokenizer
        .get_pre_tokenizer()
        .and_then(|pre| serde_json::to_value(pre).ok())
        .is_some_and(|pre| mentions(&pre, "prepend_scheme", "first"));
    if prepends_first_only {
        return None;
    }
    let mut added: Vec<_> = tokenizer
        .get_added_tokens_decoder()
        .into_values()
        .filter(|token| !token.normalized)
        .collect();
    if added.is_empty() || added.iter().any(|token| token.single_word) {
        return None;
    }
    added.sort_by(|a, b| a.content.cmp(&b.content));
    let matcher = AhoCorasick::builder()
        .match_kind(MatchKind::LeftmostLongest)
        .build(added.iter().map(|token| &token.content))
        .ok()?;
    Some(Cuts::AddedTokens {
        added: matcher,
        safe_after: added.iter().map(|token| !token.rstrip).collect(),
    })
}

/// Whether `key` is `value` anywhere in a serialized pre-tokenizer.
fn mentions(json: &Value, key: &str, value: &str) -> bool {
    match json {
        Value::Object(map) => map
            .iter()
            .any(|(k, v)| (k == key && v == value) || mentions(v, key, value)),
        Value::Array(items) => items.iter().any(|item| mentions(item, key, value)),
        _ => false,
    }
}

/// The chat template of the model in `dir`: `chat_template.jinja` when present
/// (newer transformers save it there, and it wins over the config), else the
/// `chat_template` of `tokenizer_config.json`. A missing template is only an
/// error for chat requests; a broken file is an error now.
fn load_chat_template(dir: &Path) -> Result<Result<ChatTemplate, String>, TokenizeError> {
    let config_path = dir.join("tokenizer_config.json");
    let config = if config_path.is_file() {
        let bytes = read(&config_path)?;
        let config: Value =
            serde_json::from_slice(&bytes).map_err(|error| TokenizeError::InvalidFile {
                path: config_path.clone(),
                message: error.to_string(),
            })?;
        Some(config)
    } else {
        None
    };
    let special_tokens = config
        .as_ref()
        .map(|config| special_tokens(config, &config_path))
        .transpose()?
        .unwrap_or_default();

    let jinja_path = dir.join("chat_template.jinja");
    let (source, source_path) = if jinja_path.is_file() {
        let bytes = read(&jinja_path)?;
        let source = String::from_utf8(bytes).map_err(|_| TokenizeError::InvalidFile {
            path: jinja_path.clone(),
            message: "not UTF-8".to_string(),
        })?;
        (source, jinja_path)
    } else {
        let Some(config) = &config else {
            return Ok(Err(format!(
                "neither {} nor {} exists",
                jinja_path.display(),
                config_path.display()
            )));
        };
        match config_template(config, &config_path)? {
            Some(source) => (source, config_path),
            None => {
                return Ok(Err(format!(
                    "{} has no chat_template and {} does not exist",
                    config_path.display(),
                    jinja_path.display()
                )));
            }
        }
    };
    ChatTemplate::new(source, special_tokens, &source_path).map(Ok)
}

/// The `chat_template` field: a template string, or a list of named templates
/// of which `default` is the one for plain chat.
fn config_template(config: &Value, path: &Path) -> Result<Option<String>, TokenizeError> {
    let invalid = |message: String| TokenizeError::InvalidFile {
        path: path.to_path_buf(),
        message,
    };
    match config.get("chat_template") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(source)) => Ok(Some(source.clone())),
        Some(Value::Array(named)) => {
            let default = named
                .iter()
                .find(|entry| entry.get("name").and_then(Value::as_str) == Some("default"));
            match default.map(|entry| entry.get("template").and_then(Value::as_str)) {
                Some(Some(source)) => Ok(Some(source.to_string())),
                Some(None) => Err(invalid(
                    "chat_template entry 'default' has no string 'template'".to_string(),
                )),
                None => Err(invalid(
                    "chat_template is a list without an entry named 'default'".to_string(),
                )),
            }
        }
        Some(_) => Err(invalid(
            "chat_template must be a string or a list of {name, template}".to_string(),
        )),
    }
}

/// `bos_token` and friends: a string, or an added-token object whose `content`
/// is the string.
fn special_tokens(config: &Value, path: &Path) -> Result<BTreeMap<String, String>, TokenizeError> {
    let mut tokens = BTreeMap::new();
    for name in SPECIAL_TOKEN_NAMES {
        let token = match config.get(name) {
            None | Some(Value::Null) => continue,
            Some(Value::String(token)) => token,
            Some(Value::Object(added)) => match added.get("content") {
                Some(Value::String(token)) => token,
                _ => {
                    return Err(TokenizeError::InvalidFile {
                        path: path.to_path_buf(),
                        message: format!("{name} is an object without a string 'content'"),
                    });
                }
            },
            Some(_) => {
                return Err(TokenizeError::InvalidFile {
                    path: path.to_path_buf(),
                    message: format!("{name} must be a string or an object with 'content'"),
                });
            }
        };
        tokens.insert(name.to_string(), token.clone());
    }
    Ok(tokens)
}

fn read(path: &PathBuf) -> Result<Vec<u8>, TokenizeError> {
    std::fs::read(path).map_err(|source| TokenizeError::Io {
        path: path.clone(),
        source,
    })
}

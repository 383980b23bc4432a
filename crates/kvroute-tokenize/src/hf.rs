//! Hugging Face tokenizers: `tokenizer.json` through the `tokenizers` crate (the
//! same Rust code the Python `tokenizers` wheels run), and the chat template of
//! `chat_template.jinja` or `tokenizer_config.json` beside it.
//!
//! Special tokens follow vLLM's and SGLang's defaults: a completions prompt is
//! encoded with the tokenizer's added special tokens (a Llama BOS, say), a
//! rendered chat template without them, because the template writes its own.
//!
//! Rendered chats and completions prompts are cached in chunks (the `chunks`
//! module), cut where [`cuts`] finds that `tokenizers` cannot join what is on
//! either side:
//! - just after an added token, which `tokenizers` splits out first, encoding
//!   the text between them part by part. That makes the cut exact unless the
//!   tokenizer relates parts to each other: an added token that swallows the
//!   spaces after it (`rstrip`) is no cut; a `single_word` added token
//!   (matched by what is around it), a Metaspace pre-tokenizer prepending `▁`
//!   to the first part only (`prepend_scheme: first`), and truncation or
//!   padding turn chunking off (the whole text is cached as one entry).
//! - at line starts (see `chunks`), when the tokenizer splits as cl100k_base
//!   does: no normalizer, and a pre-tokenizer that is cl100k_base's split
//!   pattern (Llama 3's too) then a byte-level mapping without a prefix space
//!   ([`splits_as_cl100k`]). The model then sees the same pieces either way,
//!   and encodes each on its own. No added token may hold a line feed (it
//!   could span the cut) or strip the spaces before it (it could swallow the
//!   line feed).
//!
//! Such a tokenizer is also run faster: the pieces are found by this crate's
//! cl100k_base splitter (`split` module; the property tests check it against
//! `tokenizers`' own split), and each thread remembers recent pieces' ids
//! (`pieces` module), so the model runs only on pieces not seen lately and
//! none of `tokenizers`' per-piece bookkeeping (normalized strings, offsets,
//! the encoding's other vectors) is done. Text holding an added token goes
//! through `tokenizers` as it is.
//!
//! A completions prompt is cut like a chat and encoded without special
//! tokens; the post-processor's BOS (or other fixed tokens around the
//! sequence, [`special_affixes`]) is then put around the ids. A post-processor
//! that does anything else keeps prompts whole.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use aho_corasick::{AhoCorasick, MatchKind};
use serde_json::Value;
use thread_local::ThreadLocal;
use tokenizers::Model;

use crate::TokenizeError;
use crate::cache::{Kind, TokenCache};
use crate::chat_template::ChatTemplate;
use crate::chunks::{AddedTokenCuts, Cuts};
use crate::encode::encode_pieces;
use crate::merges::MergeTable;
use crate::pieces::PieceCache;

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
    /// Where a rendered chat or a prompt may be cut; `None`: nowhere.
    cuts: Option<Cuts>,
    /// The ids the post-processor puts before and after a prompt's, when it
    /// does nothing else; `None`: prompts are encoded whole.
    affixes: Option<(Vec<u32>, Vec<u32>)>,
    /// The fast path, for a tokenizer that [`splits_as_cl100k`].
    pieces: Option<Pieces>,
}

/// What encoding by pieces needs (see the module's doc).
struct Pieces {
    /// Every added token: text holding one goes through `tokenizers`.
    added: Option<AhoCorasick>,
    /// The byte-level alphabet the model's vocabulary is written in.
    byte_chars: [char; 256],
    /// The model as a [`MergeTable`], if it is a byte-level BPE model that
    /// one can run; else the model itself runs.
    merges: Option<MergeTable>,
    /// Each thread's cache of recent pieces' ids.
    cache: ThreadLocal<RefCell<PieceCache>>,
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
        let cuts = cuts(&tokenizer);
        let affixes = special_affixes(&tokenizer);
        let pieces = splits_as_cl100k(&tokenizer).then(|| Pieces::new(&tokenizer));
        Ok((
            HfTokenizer {
                tokenizer,
                chat,
                cuts,
                affixes,
                pieces,
            },
            identity,
        ))
    }

    /// The text of `ids`, special tokens written out.
    pub(crate) fn decode(&self, ids: &[u32]) -> Result<String, TokenizeError> {
        let size = self.tokenizer.get_vocab_size(true);
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= size) {
            return Err(TokenizeError::InvalidPrompt {
                message: format!("token id {bad} is not in the vocabulary ({size} tokens)"),
            });
        }
        self.tokenizer
            .decode(ids, false)
            .map_err(|error| TokenizeError::Encode {
                message: error.to_string(),
            })
    }

    /// Encodes `text`, adding special tokens when `add_special_tokens`.
    pub(crate) fn encode(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        if let Some(pieces) = &self.pieces
            && !add_special_tokens
            && !pieces
                .added
                .as_ref()
                .is_some_and(|added| added.is_match(text))
        {
            return pieces.encode(self.tokenizer.get_model(), text);
        }
        self.tokenizer
            .encode_fast(text, add_special_tokens)
            .map(|encoding| encoding.get_ids().to_vec())
            .map_err(|error| TokenizeError::Encode {
                message: error.to_string(),
            })
    }

    /// The ids of a completions prompt, with the special tokens the engine
    /// adds by default, through `cache`: chunk by chunk where it can be cut
    /// and the special tokens are fixed affixes, else whole.
    pub(crate) fn encode_prompt(
        &self,
        text: &str,
        cache: &TokenCache,
    ) -> Result<Vec<u32>, TokenizeError> {
        let (Some(cuts), Some((prefix, suffix))) = (&self.cuts, &self.affixes) else {
            let ids = cache.get_or_tokenize(Kind::Prompt, text, |text| self.encode(text, true))?;
            return Ok(ids.to_vec());
        };
        let mut ids = Vec::with_capacity(text.len() / 4 + 16);
        ids.extend_from_slice(prefix);
        cuts.encode_into(
            cache,
            Kind::Text,
            text,
            |text| self.encode(text, false),
            &mut ids,
        )?;
        ids.extend_from_slice(suffix);
        Ok(ids)
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
            Some(cuts) => cuts.encode(cache, Kind::Text, text, encode),
            None => Ok(cache.get_or_tokenize(Kind::Text, text, encode)?.to_vec()),
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

impl Pieces {
    fn new(tokenizer: &tokenizers::Tokenizer) -> Self {
        let added: Vec<String> = tokenizer
            .get_added_tokens_decoder()
            .into_values()
            .map(|token| token.content)
            .collect();
        let byte_chars = byte_chars();
        let merges = serde_json::to_value(tokenizer.get_model())
            .ok()
            .and_then(|model| MergeTable::from_hugging_face(&model, &byte_chars));
        Pieces {
            added: (!added.is_empty())
                .then(|| AhoCorasick::new(&added).ok())
                .flatten(),
            byte_chars,
            merges,
            cache: ThreadLocal::new(),
        }
    }

    /// The ids of `text`, which holds no added token, without special tokens:
    /// cl100k_base's pieces, each one token if it is one, else from this
    /// thread's cache, else merged by the [`MergeTable`] or by `model`.
    fn encode(
        &self,
        model: &tokenizers::ModelWrapper,
        text: &str,
    ) -> Result<Vec<u32>, TokenizeError> {
        let mut cache = self.cache.get_or_default().borrow_mut();
        let mut ids = Vec::with_capacity(text.len() / 4 + 1);
        encode_pieces(
            bpe_openai::cl100k_base(),
            true,
            self.merges.as_ref(),
            &mut cache,
            text,
            &mut ids,
            |piece, ids| self.encode_piece(model, piece, ids),
        )?;
        Ok(ids)
    }

    /// Appends the tokens of `piece` by BPE: merged by the [`MergeTable`]
    /// when it can, else by `model`.
    fn encode_piece(
        &self,
        model: &tokenizers::ModelWrapper,
        piece: &[u8],
        ids: &mut Vec<u32>,
    ) -> Result<(), TokenizeError> {
        if let Some(merges) = &self.merges
            && merges.merge_into(piece, ids)
        {
            return Ok(());
        }
        let spelled: String = piece
            .iter()
            .map(|&byte| self.byte_chars[byte as usize])
            .collect();
        let tokens = model
            .tokenize(&spelled)
            .map_err(|error| TokenizeError::Encode {
                message: error.to_string(),
            })?;
        ids.extend(tokens.into_iter().map(|token| token.id));
        Ok(())
    }
}

/// GPT-2's byte-to-character map, which byte-level BPE vocabularies are
/// written in: printable bytes stand for themselves, the others for 256 + n.
/// Public for the bench, which writes such a vocabulary.
pub fn byte_chars() -> [char; 256] {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut chars = ['\0'; 256];
    let mut next = 256;
    for byte in 0..=255u8 {
        chars[byte as usize] = if printable(byte) {
            char::from(byte)
        } else {
            next += 1;
            char::from_u32(next - 1).unwrap_or('\0')
        };
    }
    chars
}

/// Where a rendered chat or a prompt can be cut exactly (see the module's
/// doc): after an added token that `tokenizers` splits out of the raw text (not
/// `normalized`) and that keeps the spaces after it (not `rstrip`), and at line
/// starts when the tokenizer [`splits_as_cl100k`]. The added-token matcher
/// holds every non-normalized added token, as `tokenizers`' own does, so that
/// it finds the same matches.
fn cuts(tokenizer: &tokenizers::Tokenizer) -> Option<Cuts> {
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
    let mut added: Vec<_> = tokenizer.get_added_tokens_decoder().into_values().collect();
    if added.iter().any(|token| token.single_word) {
        return None;
    }
    let line_starts = splits_as_cl100k(tokenizer)
        && added
            .iter()
            .all(|token| !token.lstrip && !token.content.contains('\n'));
    added.retain(|token| !token.normalized);
    added.sort_by(|a, b| a.content.cmp(&b.content));
    let added_tokens = if added.is_empty() {
        None
    } else {
        let matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(added.iter().map(|token| &token.content))
            .ok()?;
        Some(AddedTokenCuts {
            matcher,
            safe_after: added.iter().map(|token| !token.rstrip).collect(),
        })
    };
    Cuts::new(line_starts, added_tokens)
}

/// cl100k_base's split pattern, as tiktoken and Llama 3's `tokenizer.json`
/// write it.
pub(crate) const CL100K_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Whether `tokenizer` cuts text into the pieces cl100k_base's pattern does,
/// and only then maps them to byte-level characters: no normalizer, and the
/// pre-tokenizer is a `Split` by [`CL100K_PATTERN`] (isolating each match)
/// followed by a `ByteLevel` that neither splits again nor adds a space.
fn splits_as_cl100k(tokenizer: &tokenizers::Tokenizer) -> bool {
    if tokenizer.get_normalizer().is_some() {
        return false;
    }
    let Some(pre) = tokenizer
        .get_pre_tokenizer()
        .and_then(|pre| serde_json::to_value(pre).ok())
    else {
        return false;
    };
    let field = |value: &Value, key: &str| value.get(key).cloned().unwrap_or(Value::Null);
    let [split, byte_level] = match pre.get("pretokenizers").and_then(Value::as_array) {
        Some(steps) if field(&pre, "type") == "Sequence" && steps.len() == 2 => {
            [&steps[0], &steps[1]]
        }
        _ => return false,
    };
    field(split, "type") == "Split"
        && field(&field(split, "pattern"), "Regex") == CL100K_PATTERN
        && field(split, "behavior") == "Isolated"
        && field(split, "invert") == false
        && field(byte_level, "type") == "ByteLevel"
        && field(byte_level, "add_prefix_space") == false
        && field(byte_level, "use_regex") == false
}

/// The ids `tokenizer`'s post-processor puts before and after a sequence's
/// (a BOS, say), if that is all it does: found by post-processing sequences
/// of one and of two made-up ids, and checked on a real encoding.
fn special_affixes(tokenizer: &tokenizers::Tokenizer) -> Option<(Vec<u32>, Vec<u32>)> {
    let post_process = |ids: &[u32]| {
        let n = ids.len();
        let encoding = tokenizers::Encoding::new(
            ids.to_vec(),
            vec![0; n],
            vec![String::new(); n],
            vec![None; n],
            vec![(0, 0); n],
            vec![0; n],
            vec![1; n],
            Vec::new(),
            Default::default(),
        );
        tokenizer
            .post_process(encoding, None, true)
            .ok()
            .map(|encoding| encoding.get_ids().to_vec())
    };
    let around = |prefix: &[u32], ids: &[u32], suffix: &[u32]| [prefix, ids, suffix].concat();
    let probe = [u32::MAX, u32::MAX - 1];
    let one = post_process(&probe[..1])?;
    let at = one.iter().position(|&id| id == probe[0])?;
    let (prefix, suffix) = (&one[..at], &one[at + 1..]);
    let fixed = post_process(&probe)? == around(prefix, &probe, suffix);
    let encode = |add_special_tokens| {
        tokenizer
            .encode_fast("a", add_special_tokens)
            .ok()
            .map(|encoding| encoding.get_ids().to_vec())
    };
    let plain = encode(false)?;
    let real = encode(true)? == around(prefix, &plain, suffix);
    (fixed && real).then(|| (prefix.to_vec(), suffix.to_vec()))
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

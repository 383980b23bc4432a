//! OpenAI tiktoken encodings (`cl100k_base`, `o200k_base`), embedded in the
//! binary so nothing is downloaded.
//!
//! The vocabularies and split patterns are GitHub's `bpe-openai`: it splits
//! as tiktoken does (a property test checks the ids against tiktoken-rs, the
//! port of OpenAI's own code) on a linear-time regex engine instead of
//! tiktoken's backtracking one, so no input can make it backtrack for long.
//! On top of it, for the router's per-core budget: cl100k_base's split is
//! done by hand where the text is ASCII (`split` module); a piece that is
//! one token is found in a table of the tokens (`vocab` module), as tiktoken
//! itself does first; each thread remembers the ids of recent pieces of
//! several tokens (`pieces` module); and only the rest is merged, by this
//! crate's BPE (`merges` module; `bpe-openai`'s for pieces longer than it
//! takes), where the merges of pieces the cache missed are a third of a
//! request's CPU (docs/measurements/tokenize.md, "Where a request's CPU
//! goes"). The tables are megabytes, and most of the time went
//! to waiting for them, so pieces are split a batch ahead of their lookups,
//! which prefetch (`encode` module).
//!
//! Prompt text is encoded as ordinary text: a literal `<|endoftext|>` in a
//! prompt is plain characters, never a special token, so no client can inject
//! control tokens, and tiktoken has no BOS to add.
//!
//! Chat uses ChatML, the format OpenAI's chat models were trained on, with the
//! `<|im_start|>`/`<|im_end|>` ids those models use (100264/100265 next to
//! `cl100k_base`, 200264/200265 next to `o200k_base`):
//!
//! ```text
//! <|im_start|>{role}\n{content}<|im_end|>\n      (each message)
//! <|im_start|>assistant\n                          (add_generation_prompt)
//! ```
//!
//! The ids are those of tiktoken encoding that text with the two markers
//! allowed as special tokens, except that markers inside a message's content
//! stay plain text. Because special tokens split the text, each message's
//! `{role}\n{content}` is encoded on its own. Prompts and messages are cached
//! in chunks cut at line starts (`chunks` module), so a conversation's history
//! and a growing prompt's head are not tokenized again.

use std::cell::RefCell;
use std::convert::Infallible;
use std::sync::OnceLock;

use thread_local::ThreadLocal;

use crate::cache::{Kind, TokenCache};
use crate::chunks::Cuts;
use crate::encode::encode_pieces;
use crate::merges::MergeTable;
use crate::pieces::PieceCache;
use crate::{ChatMessage, TokenizeError};

const IM_START: &str = "<|im_start|>";
const IM_END: &str = "<|im_end|>";

/// An encoding this crate ships.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Encoding {
    Cl100kBase,
    O200kBase,
}

impl Encoding {
    pub(crate) fn from_name(name: &str) -> Result<Self, TokenizeError> {
        match name {
            "cl100k_base" => Ok(Encoding::Cl100kBase),
            "o200k_base" => Ok(Encoding::O200kBase),
            _ => Err(TokenizeError::UnknownEncoding {
                name: name.to_string(),
            }),
        }
    }
}

pub(crate) struct TiktokenTokenizer {
    /// Loaded once per process and shared by every tokenizer of that encoding.
    bpe: &'static bpe_openai::Tokenizer,
    /// The same vocabulary for [`MergeTable`], also loaded once per process.
    merges: Option<&'static MergeTable>,
    im_start: u32,
    im_end: u32,
    /// The ids of the `\n` after each `<|im_end|>`.
    newline: Vec<u32>,
    /// The ids of `assistant\n` after the generation prompt's `<|im_start|>`.
    assistant_header: Vec<u32>,
    /// Each thread's cache of recent pieces' ids.
    pieces: ThreadLocal<RefCell<PieceCache>>,
    /// Whether ASCII text is split by hand (`split` module; cl100k_base only).
    ascii_split: bool,
}

impl TiktokenTokenizer {
    pub(crate) fn load(encoding: &str) -> Result<Self, TokenizeError> {
        let encoding = Encoding::from_name(encoding)?;
        let (bpe, im_start, im_end) = match encoding {
            Encoding::Cl100kBase => (bpe_openai::cl100k_base(), 100264, 100265),
            Encoding::O200kBase => (bpe_openai::o200k_base(), 200264, 200265),
        };
        Ok(TiktokenTokenizer {
            bpe,
            merges: merge_table(encoding),
            im_start,
            im_end,
            newline: bpe.encode("\n"),
            assistant_header: bpe.encode("assistant\n"),
            pieces: ThreadLocal::new(),
            ascii_split: encoding == Encoding::Cl100kBase,
        })
    }

    /// Encodes `text` as ordinary text: split as `bpe_openai` splits it (by
    /// hand where that is exact and faster), then each piece: one token if it
    /// is one, else from this thread's cache of recent pieces, else merged.
    /// (`bpe_openai` would also NFC-normalize first, but only for encodings
    /// that ask for it, and neither of ours does.)
    pub(crate) fn encode(&self, text: &str) -> Vec<u32> {
        let mut pieces = self.pieces.get_or_default().borrow_mut();
        // About 4 bytes of English per token.
        let mut ids = Vec::with_capacity(text.len() / 4 + 1);
        let Ok(()) = encode_pieces::<Infallible>(
            self.bpe,
            self.ascii_split,
            self.merges,
            &mut pieces,
            text,
            &mut ids,
            |piece, ids| {
                self.encode_piece(piece, ids);
                Ok(())
            },
        );
        ids
    }

    /// Appends the tokens of `piece` by BPE: merged here when it is short
    /// enough, else by `bpe_openai`.
    fn encode_piece(&self, piece: &[u8], ids: &mut Vec<u32>) {
        match self.merges {
            Some(merges) if merges.merge_into(piece, ids) => {}
            _ => ids.extend(self.bpe.bpe.encode_via_backtracking(piece)),
        }
    }

    /// The text of `ids`; `<|im_start|>` and `<|im_end|>` written out.
    pub(crate) fn decode(&self, ids: &[u32]) -> Result<String, TokenizeError> {
        let size = self.bpe.bpe.num_tokens();
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            match id {
                id if id == self.im_start => bytes.extend_from_slice(b"<|im_start|>"),
                id if id == self.im_end => bytes.extend_from_slice(b"<|im_end|>"),
                id if (id as usize) < size => bytes.extend_from_slice(self.bpe.bpe.token_bytes(id)),
                id => {
                    return Err(TokenizeError::InvalidPrompt {
                        message: format!("token id {id} is not in the vocabulary ({size} tokens)"),
                    });
                }
            }
        }
        String::from_utf8(bytes).map_err(|_| TokenizeError::InvalidPrompt {
            message: "the token ids end inside a character (not valid UTF-8)".into(),
        })
    }

    /// [`Self::encode`], chunk by chunk through `cache`.
    pub(crate) fn encode_cached(
        &self,
        text: &str,
        cache: &TokenCache,
    ) -> Result<Vec<u32>, TokenizeError> {
        Cuts::LINE_STARTS.encode(cache, Kind::Text, text, |chunk| Ok(self.encode(chunk)))
    }

    pub(crate) fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> String {
        let mut text = String::new();
        for message in messages {
            text.push_str(IM_START);
            text.push_str(&message_segment(message));
            text.push_str(IM_END);
            text.push('\n');
        }
        if add_generation_prompt {
            text.push_str(IM_START);
            text.push_str("assistant\n");
        }
        text
    }

    /// The ids of `messages` in ChatML. With `images`, the messages' image
    /// parts are written as [`IMAGE_MARK`](crate::prompt::IMAGE_MARK), and
    /// where each one's placeholder lands is pushed there
    /// ([`crate::encode_marked`]).
    pub(crate) fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        cache: &TokenCache,
        mut images: Option<&mut Vec<usize>>,
    ) -> Result<Vec<u32>, TokenizeError> {
        let mut ids = Vec::new();
        for message in messages {
            ids.push(self.im_start);
            let segment = message_segment(message);
            match images.as_deref_mut() {
                None => ids.extend(self.encode_cached(&segment, cache)?),
                Some(offsets) => crate::encode_marked(
                    &segment,
                    |text| self.encode_cached(text, cache),
                    &mut ids,
                    offsets,
                )?,
            }
            ids.push(self.im_end);
            ids.extend_from_slice(&self.newline);
        }
        if add_generation_prompt {
            ids.push(self.im_start);
            ids.extend_from_slice(&self.assistant_header);
        }
        Ok(ids)
    }
}

/// `encoding`'s [`MergeTable`], built on first use.
fn merge_table(encoding: Encoding) -> Option<&'static MergeTable> {
    static CL100K: OnceLock<Option<MergeTable>> = OnceLock::new();
    static O200K: OnceLock<Option<MergeTable>> = OnceLock::new();
    let (table, bpe) = match encoding {
        Encoding::Cl100kBase => (&CL100K, bpe_openai::cl100k_base()),
        Encoding::O200kBase => (&O200K, bpe_openai::o200k_base()),
    };
    table
        .get_or_init(|| {
            let tokens: Vec<&[u8]> = (0..bpe.bpe.num_tokens() as u32)
                .map(|id| bpe.bpe.token_bytes(id))
                .collect();
            MergeTable::from_ranks(&tokens)
        })
        .as_ref()
}

/// The text between a message's `<|im_start|>` and `<|im_end|>`.
fn message_segment(message: &ChatMessage) -> String {
    format!("{}\n{}", message.role, message.content)
}

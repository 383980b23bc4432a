//! OpenAI tiktoken encodings (`cl100k_base`, `o200k_base`), embedded by the
//! tiktoken-rs crate so nothing is downloaded.
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
//! `{role}\n{content}` is encoded on its own, which lets the cache keep every
//! message of a conversation separately.

use std::collections::HashSet;

use tiktoken_rs::CoreBPE;

use crate::cache::{Kind, TokenCache};
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
    bpe: &'static CoreBPE,
    im_start: u32,
    im_end: u32,
    /// The ids of the `\n` after each `<|im_end|>`.
    newline: Vec<u32>,
    /// The ids of `assistant\n` after the generation prompt's `<|im_start|>`.
    assistant_header: Vec<u32>,
}

impl TiktokenTokenizer {
    pub(crate) fn load(encoding: &str) -> Result<Self, TokenizeError> {
        let (bpe, im_start, im_end) = match Encoding::from_name(encoding)? {
            Encoding::Cl100kBase => (tiktoken_rs::cl100k_base_singleton(), 100264, 100265),
            Encoding::O200kBase => (tiktoken_rs::o200k_base_singleton(), 200264, 200265),
        };
        let mut tokenizer = TiktokenTokenizer {
            bpe,
            im_start,
            im_end,
            newline: Vec::new(),
            assistant_header: Vec::new(),
        };
        tokenizer.newline = tokenizer.encode("\n")?;
        tokenizer.assistant_header = tokenizer.encode("assistant\n")?;
        Ok(tokenizer)
    }

    /// Encodes `text` as ordinary text.
    pub(crate) fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        // `encode` with no allowed special tokens is `encode_ordinary`, but it
        // reports a regex failure (backtrack limit) as an error instead of
        // panicking.
        self.bpe
            .encode(text, &HashSet::new())
            .map(|(ids, _)| ids)
            .map_err(|error| TokenizeError::Encode {
                message: error.message,
            })
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

    pub(crate) fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        cache: &TokenCache,
    ) -> Result<Vec<u32>, TokenizeError> {
        let mut ids = Vec::new();
        for message in messages {
            ids.push(self.im_start);
            let segment =
                cache.get_or_tokenize(Kind::Segment, &message_segment(message), |text| {
                    self.encode(text)
                })?;
            ids.extend_from_slice(&segment);
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

/// The text between a message's `<|im_start|>` and `<|im_end|>`.
fn message_segment(message: &ChatMessage) -> String {
    format!("{}\n{}", message.role, message.content)
}

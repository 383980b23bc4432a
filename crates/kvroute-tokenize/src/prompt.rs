//! The prompt parts of OpenAI-style requests: the completions `prompt` field and
//! chat `messages`.
//!
//! Both accept the shapes OpenAI clients send and reject anything else with a
//! message the router can return as a 400 body unchanged.

use std::fmt;

use serde::de::{self, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

use crate::TokenizeError;

/// One chat message, as the chat template sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    /// The message text. OpenAI clients send a string, an array of content
    /// parts, or `null` (an assistant turn that only calls tools); text parts
    /// are joined with `"\n"` as vLLM does for string-content templates, an
    /// image part is [`IMAGE_PLACEHOLDER`], other parts (audio) are skipped,
    /// and `null` is the empty string.
    #[serde(default, deserialize_with = "content_text")]
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// What an image part of a message's content becomes in its text. The tokens
/// it gives mark where the image is in the prompt: the blocks from there on are
/// keyed by the image (see [`crate::Tokenizer::encode_chat_with_images`]).
pub const IMAGE_PLACEHOLDER: &str = "<image>";

fn content_text<'de, D: Deserializer<'de>>(deserializer: D) -> Result<String, D::Error> {
    let value = Value::deserialize(deserializer)?;
    content_from_value(&value, IMAGE_PLACEHOLDER).map_err(serde::de::Error::custom)
}

/// What an image part is written as while a chat with images is rendered:
/// a Unicode noncharacter, which no template writes, so that each image's
/// place can be found in the rendered text (see
/// [`crate::Tokenizer::encode_chat_with_images`]).
pub(crate) const IMAGE_MARK: char = '\u{FDD0}';

/// The text of a message's content, each image part written as `image`.
pub(crate) fn content_from_value(value: &Value, image: &str) -> Result<String, String> {
    match value {
        Value::Null => Ok(String::new()),
        Value::String(text) => Ok(text.clone()),
        Value::Array(parts) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (index, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str).ok_or_else(|| {
                    format!("content part {index} is not an object with a string \"type\"")
                })?;
                if kind == "image_url" {
                    texts.push(image);
                    continue;
                }
                if kind != "text" {
                    continue;
                }
                let text = part.get("text").and_then(Value::as_str).ok_or_else(|| {
                    format!("content part {index} has type \"text\" but no string \"text\"")
                })?;
                texts.push(text);
            }
            Ok(texts.join("\n"))
        }
        other => Err(format!(
            "message content must be a string or an array of content parts, not {}",
            json_kind(other)
        )),
    }
}

/// The identifiers of a chat's images, in order: an image part's `uuid` (vLLM's
/// name for a client-given identifier, which is also what vLLM keys the image
/// by), else its URL (data URLs included), else the empty string.
pub(crate) fn image_identifiers(messages: &[Value]) -> Vec<String> {
    messages
        .iter()
        .filter_map(|m| m.get("content").and_then(Value::as_array))
        .flatten()
        .filter(|part| part.get("type").and_then(Value::as_str) == Some("image_url"))
        .map(|part| {
            let url = part.get("image_url");
            part.get("uuid")
                .and_then(Value::as_str)
                .or_else(|| url.and_then(|u| u.get("url")).and_then(Value::as_str))
                .or_else(|| url.and_then(Value::as_str))
                .unwrap_or_default()
                .to_string()
        })
        .collect()
}

/// The prompt of a completions request.
///
/// Deserialized straight from the request's JSON (no `serde_json::Value` in
/// between, so a token-id prompt costs 4 bytes a token, not a `Value` each):
/// a string, an array of token ids, or a one-element array holding either.
/// Batches of several prompts are refused: one request is routed to one worker
/// by one prompt's prefix. Every other shape is refused with a message for the
/// client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prompt {
    /// Text to tokenize with the configured tokenizer.
    Text(String),
    /// Token ids the client tokenized itself; used as they are.
    Tokens(Vec<u32>),
}

/// Reads the completions `prompt` field of an already parsed body; see [`Prompt`].
pub fn parse_completion_prompt(value: &Value) -> Result<Prompt, TokenizeError> {
    Prompt::deserialize(value).map_err(|e| TokenizeError::InvalidPrompt {
        message: e.to_string(),
    })
}

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(PromptVisitor)
    }
}

struct PromptVisitor;

impl PromptVisitor {
    fn refuse<E: de::Error>(kind: &str) -> E {
        E::custom(format_args!(
            "prompt must be a string or an array of token ids, not {kind}"
        ))
    }
}

impl<'de> Visitor<'de> for PromptVisitor {
    type Value = Prompt;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string or an array of token ids")
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<Prompt, E> {
        Ok(Prompt::Text(text.to_owned()))
    }

    fn visit_string<E: de::Error>(self, text: String) -> Result<Prompt, E> {
        Ok(Prompt::Text(text))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Prompt, A::Error> {
        let Some(first) = seq.next_element::<Element>()? else {
            return Err(de::Error::custom("prompt must not be an empty array"));
        };
        let nested = match first {
            Element::Id(id) => {
                let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0) + 1);
                ids.push(id);
                return token_ids(&mut seq, ids)?
                    .map(Prompt::Tokens)
                    .map_err(de::Error::custom);
            }
            Element::Other(kind) => {
                return Err(de::Error::custom(format_args!(
                    "prompt array elements must be strings, token ids or token id arrays, not {kind}"
                )));
            }
            Element::BadNumber(number) => {
                return Err(de::Error::custom(BadId {
                    index: 0,
                    is: &number,
                }));
            }
            Element::Text(text) => Ok(Prompt::Text(text)),
            Element::Ids(ids) => ids.map(Prompt::Tokens),
        };
        let mut count = 1;
        while seq.next_element::<IgnoredAny>()?.is_some() {
            count += 1;
        }
        if count > 1 {
            return Err(de::Error::custom(format_args!(
                "prompt holds a batch of {count} prompts; send one prompt per request"
            )));
        }
        nested.map_err(de::Error::custom)
    }

    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<Prompt, A::Error> {
        Err(Self::refuse("an object"))
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Prompt, E> {
        Err(Self::refuse("a boolean"))
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Prompt, E> {
        Err(Self::refuse("a number"))
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Prompt, E> {
        Err(Self::refuse("a number"))
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Prompt, E> {
        Err(Self::refuse("a number"))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Prompt, E> {
        Err(Self::refuse("null"))
    }

    fn visit_none<E: de::Error>(self) -> Result<Prompt, E> {
        Err(Self::refuse("null"))
    }
}

/// The rest of an array of token ids after `ids`; `Ok(Err(message))` when an
/// element is not a token id (the array is still read to its end).
fn token_ids<'de, A: SeqAccess<'de>>(
    seq: &mut A,
    mut ids: Vec<u32>,
) -> Result<Result<Vec<u32>, String>, A::Error> {
    let mut bad = None;
    while let Some(id) = seq.next_element::<TokenId>()? {
        match (id, &bad) {
            (TokenId::Valid(id), None) => ids.push(id),
            (TokenId::Invalid(is), None) => bad = Some((ids.len(), is)),
            (_, Some(_)) => {}
        }
    }
    Ok(match bad {
        None if ids.is_empty() => Err("prompt must not be an empty array of token ids".into()),
        None => Ok(ids),
        Some((index, is)) => Err(BadId { index, is: &is }.to_string()),
    })
}

/// The message for a prompt element that is not a token id.
struct BadId<'a> {
    index: usize,
    /// The number, or what kind of value it is.
    is: &'a str,
}

impl fmt::Display for BadId<'_> {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "prompt token ids must be integers from 0 to {}; element {} is {}",
            u32::MAX,
            self.index,
            self.is
        )
    }
}

/// The first element of a `prompt` array, which says what the array is.
enum Element {
    Id(u32),
    /// A number that is no token id, as the client wrote it.
    BadNumber(String),
    Text(String),
    /// A nested array of token ids, or why it is not one.
    Ids(Result<Vec<u32>, String>),
    /// Anything else, by kind.
    Other(&'static str),
}

impl<'de> Deserialize<'de> for Element {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ElementVisitor;
        impl<'de> Visitor<'de> for ElementVisitor {
            type Value = Element;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string, a token id or an array of token ids")
            }

            fn visit_u64<E: de::Error>(self, n: u64) -> Result<Element, E> {
                Ok(match u32::try_from(n) {
                    Ok(id) => Element::Id(id),
                    Err(_) => Element::BadNumber(n.to_string()),
                })
            }

            fn visit_i64<E: de::Error>(self, n: i64) -> Result<Element, E> {
                Ok(match u32::try_from(n) {
                    Ok(id) => Element::Id(id),
                    Err(_) => Element::BadNumber(n.to_string()),
                })
            }

            fn visit_f64<E: de::Error>(self, n: f64) -> Result<Element, E> {
                Ok(Element::BadNumber(float_text(n)))
            }

            fn visit_str<E: de::Error>(self, text: &str) -> Result<Element, E> {
                Ok(Element::Text(text.to_owned()))
            }

            fn visit_string<E: de::Error>(self, text: String) -> Result<Element, E> {
                Ok(Element::Text(text))
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Element, A::Error> {
                let capacity = seq.size_hint().unwrap_or(0);
                token_ids(&mut seq, Vec::with_capacity(capacity)).map(Element::Ids)
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Element, A::Error> {
                IgnoredAny.visit_map(map)?;
                Ok(Element::Other("an object"))
            }

            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Element, E> {
                Ok(Element::Other("a boolean"))
            }

            fn visit_unit<E: de::Error>(self) -> Result<Element, E> {
                Ok(Element::Other("null"))
            }

            fn visit_none<E: de::Error>(self) -> Result<Element, E> {
                Ok(Element::Other("null"))
            }
        }
        deserializer.deserialize_any(ElementVisitor)
    }
}

/// An element of an array of token ids after the first.
enum TokenId {
    Valid(u32),
    /// Not a token id: the number as written, or the kind of value.
    Invalid(String),
}

impl<'de> Deserialize<'de> for TokenId {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct TokenIdVisitor;
        impl<'de> Visitor<'de> for TokenIdVisitor {
            type Value = TokenId;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a token id")
            }

            fn visit_u64<E: de::Error>(self, n: u64) -> Result<TokenId, E> {
                Ok(u32::try_from(n)
                    .map_or_else(|_| TokenId::Invalid(n.to_string()), TokenId::Valid))
            }

            fn visit_i64<E: de::Error>(self, n: i64) -> Result<TokenId, E> {
                Ok(u32::try_from(n)
                    .map_or_else(|_| TokenId::Invalid(n.to_string()), TokenId::Valid))
            }

            fn visit_f64<E: de::Error>(self, n: f64) -> Result<TokenId, E> {
                Ok(TokenId::Invalid(float_text(n)))
            }

            fn visit_str<E: de::Error>(self, _: &str) -> Result<TokenId, E> {
                Ok(TokenId::Invalid("a string".into()))
            }

            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<TokenId, A::Error> {
                IgnoredAny.visit_seq(seq)?;
                Ok(TokenId::Invalid("an array".into()))
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<TokenId, A::Error> {
                IgnoredAny.visit_map(map)?;
                Ok(TokenId::Invalid("an object".into()))
            }

            fn visit_bool<E: de::Error>(self, _: bool) -> Result<TokenId, E> {
                Ok(TokenId::Invalid("a boolean".into()))
            }

            fn visit_unit<E: de::Error>(self) -> Result<TokenId, E> {
                Ok(TokenId::Invalid("null".into()))
            }

            fn visit_none<E: de::Error>(self) -> Result<TokenId, E> {
                Ok(TokenId::Invalid("null".into()))
            }
        }
        deserializer.deserialize_any(TokenIdVisitor)
    }
}

/// A float as JSON writes it (`2.5`, `1000.0`).
fn float_text(n: f64) -> String {
    serde_json::Number::from_f64(n).map_or_else(|| n.to_string(), |n| n.to_string())
}

fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

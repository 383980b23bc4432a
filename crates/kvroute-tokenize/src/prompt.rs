//! The prompt parts of OpenAI-style requests: the completions `prompt` field and
//! chat `messages`.
//!
//! Both accept the shapes OpenAI clients send and reject anything else with a
//! message the router can return as a 400 body unchanged.

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
    let mut every_image = usize::MAX;
    content_from_value(&value, &mut every_image).map_err(serde::de::Error::custom)
}

/// The text of a message's content, keeping the first `images` image parts
/// (and counting them off); later image parts are left out.
pub(crate) fn content_from_value(value: &Value, images: &mut usize) -> Result<String, String> {
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
                    if *images > 0 {
                        *images -= 1;
                        texts.push(IMAGE_PLACEHOLDER);
                    }
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
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prompt {
    /// Text to tokenize with the configured tokenizer.
    Text(String),
    /// Token ids the client tokenized itself; used as they are.
    Tokens(Vec<u32>),
}

/// Reads the completions `prompt` field: a string, an array of token ids, or a
/// one-element array holding either. Batches of several prompts are refused:
/// one request is routed to one worker by one prompt's prefix.
pub fn parse_completion_prompt(value: &Value) -> Result<Prompt, TokenizeError> {
    match value {
        Value::String(text) => Ok(Prompt::Text(text.clone())),
        Value::Array(items) => match items.as_slice() {
            [] => Err(invalid("prompt must not be an empty array")),
            [Value::String(text)] => Ok(Prompt::Text(text.clone())),
            [Value::Array(ids)] => token_ids(ids).map(Prompt::Tokens),
            [Value::Number(_), ..] => token_ids(items).map(Prompt::Tokens),
            [Value::String(_) | Value::Array(_), ..] => Err(invalid(&format!(
                "prompt holds a batch of {} prompts; send one prompt per request",
                items.len()
            ))),
            [other, ..] => Err(invalid(&format!(
                "prompt array elements must be strings, token ids or token id arrays, not {}",
                json_kind(other)
            ))),
        },
        other => Err(invalid(&format!(
            "prompt must be a string or an array of token ids, not {}",
            json_kind(other)
        ))),
    }
}

fn token_ids(items: &[Value]) -> Result<Vec<u32>, TokenizeError> {
    if items.is_empty() {
        return Err(invalid("prompt must not be an empty array of token ids"));
    }
    items
        .iter()
        .enumerate()
        .map(|(index, item)| {
            item.as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| {
                    invalid(&format!(
                        "prompt token ids must be integers from 0 to {}; element {index} is {}",
                        u32::MAX,
                        match item {
                            Value::Number(number) => number.to_string(),
                            other => json_kind(other).to_string(),
                        }
                    ))
                })
        })
        .collect()
}

fn invalid(message: &str) -> TokenizeError {
    TokenizeError::InvalidPrompt {
        message: message.to_string(),
    }
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

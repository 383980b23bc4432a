//! The prompts of the OpenAI Responses API and the Anthropic Messages API as
//! chat messages (the JSON of a chat completions `messages` array), so that
//! both are tokenized through the chat template exactly as chat is
//! ([`crate::Tokenizer::encode_chat_with_images`]). The router and the
//! simulated engines both render them here, so that a request's blocks hash
//! alike on both sides and a follow-up turn finds the turn before in the cache.
//!
//! What a request becomes, in order:
//! - a system message: Responses' `instructions` or Messages' `system`, then,
//!   if the request has `tools`, `# Tools` and each tool definition as one line
//!   of JSON (keys sorted, so the client's key order does not matter);
//! - (Responses, engine side) the stored turns of `previous_response_id`;
//! - the conversation: Responses' `input` (a string is one user message; items
//!   of type `message`, `function_call`, `function_call_output`) or Messages'
//!   `messages` (content blocks `text`, `image`, `tool_use`, `tool_result`).
//!
//! Text parts become text parts, images become `image_url` parts (so they key
//! the blocks holding them, as in chat), a tool call is an assistant text
//! `<tool_call>` holding `{"arguments": ..., "name": ...}`, and a tool's result
//! is a `tool` message. Reasoning and thinking items, files and documents are
//! not part of the prompt.

use serde_json::{Map, Value, json};

use crate::TokenizeError;

fn invalid(message: impl Into<String>) -> TokenizeError {
    TokenizeError::InvalidPrompt {
        message: message.into(),
    }
}

/// The chat messages of a Responses request: its instructions and tools,
/// then `history` (the stored turns of its `previous_response_id`, from
/// [`responses_input`] and the replies), then its `input`.
pub fn responses_messages(body: &Value, history: &[Value]) -> Result<Vec<Value>, TokenizeError> {
    let instructions = match body.get("instructions") {
        None | Some(Value::Null) => None,
        Some(Value::String(text)) => Some(text.as_str()),
        Some(_) => return Err(invalid("`instructions` must be a string")),
    };
    let mut messages: Vec<Value> = system_message(instructions, body.get("tools"))?
        .into_iter()
        .collect();
    messages.extend_from_slice(history);
    let input = body
        .get("input")
        .ok_or_else(|| invalid("missing field `input` (a string or an array of items)"))?;
    messages.extend(responses_input(input)?);
    Ok(messages)
}

/// The chat messages of a Responses request's `input`: a string is one user
/// message; an array holds items.
pub fn responses_input(input: &Value) -> Result<Vec<Value>, TokenizeError> {
    let items = match input {
        Value::String(text) => return Ok(vec![json!({"role": "user", "content": text})]),
        Value::Array(items) => items,
        _ => return Err(invalid("`input` must be a string or an array of items")),
    };
    let mut messages = Vec::with_capacity(items.len());
    for (index, item) in items.iter().enumerate() {
        let at = |what: &str| invalid(format!("input item {index}: {what}"));
        let field = |name: &str| {
            item.get(name)
                .and_then(Value::as_str)
                .ok_or_else(|| at(&format!("missing string field `{name}`")))
        };
        // An item without a type is a message (the easy input message).
        match item
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("message")
        {
            "message" => {
                let role = match field("role")? {
                    // Chat templates know `system`, not `developer`.
                    "developer" => "system",
                    role @ ("user" | "assistant" | "system") => role,
                    other => return Err(at(&format!("unknown role `{other}`"))),
                };
                let content = match item.get("content") {
                    Some(Value::String(text)) => Value::String(text.clone()),
                    Some(Value::Array(parts)) => Value::Array(responses_parts(parts, index)?),
                    _ => return Err(at("`content` must be a string or an array of parts")),
                };
                messages.push(json!({"role": role, "content": content}));
            }
            "function_call" => {
                let arguments = Value::String(field("arguments")?.to_string());
                messages.push(json!({
                    "role": "assistant",
                    "content": tool_call(field("name")?, &arguments),
                }));
            }
            "function_call_output" => {
                let output = match item.get("output") {
                    Some(Value::String(text)) => text.clone(),
                    Some(Value::Array(parts)) => text_of(&responses_parts(parts, index)?),
                    _ => return Err(at("`output` must be a string or an array of parts")),
                };
                messages.push(json!({"role": "tool", "content": output}));
            }
            "reasoning" => {}
            other => return Err(at(&format!("unsupported item type `{other}`"))),
        }
    }
    Ok(messages)
}

/// A Responses message's content parts as chat content parts.
fn responses_parts(parts: &[Value], item: usize) -> Result<Vec<Value>, TokenizeError> {
    let mut chat = Vec::with_capacity(parts.len());
    for (index, part) in parts.iter().enumerate() {
        let at = |what: &str| invalid(format!("input item {item}, content part {index}: {what}"));
        let string = |name: &str| {
            part.get(name)
                .and_then(Value::as_str)
                .ok_or_else(|| at(&format!("missing string field `{name}`")))
        };
        match part.get("type").and_then(Value::as_str) {
            Some("input_text" | "output_text") => {
                chat.push(json!({"type": "text", "text": string("text")?}));
            }
            Some("refusal") => chat.push(json!({"type": "text", "text": string("refusal")?})),
            Some("input_image") => {
                let url = string("image_url").or_else(|_| string("file_id"))?;
                chat.push(json!({"type": "image_url", "image_url": {"url": url}}));
            }
            Some("input_file" | "input_audio") => {}
            Some(other) => return Err(at(&format!("unsupported part type `{other}`"))),
            None => return Err(at("not an object with a string `type`")),
        }
    }
    Ok(chat)
}

/// The chat messages of an Anthropic Messages request: `system` and `tools`,
/// then `messages`.
pub fn anthropic_messages(body: &Value) -> Result<Vec<Value>, TokenizeError> {
    let system = match body.get("system") {
        None | Some(Value::Null) => None,
        Some(Value::String(text)) => Some(text.clone()),
        Some(Value::Array(blocks)) => {
            let blocks = anthropic_blocks(blocks, "system")?;
            Some(text_of(&blocks.parts))
        }
        Some(_) => {
            return Err(invalid(
                "`system` must be a string or an array of text blocks",
            ));
        }
    };
    let mut messages: Vec<Value> = system_message(system.as_deref(), body.get("tools"))?
        .into_iter()
        .collect();
    let turns = body
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| invalid("missing field `messages` (an array)"))?;
    for (index, turn) in turns.iter().enumerate() {
        let role = match turn.get("role").and_then(Value::as_str) {
            Some(role @ ("user" | "assistant")) => role,
            _ => {
                return Err(invalid(format!(
                    "messages.{index}.role must be \"user\" or \"assistant\""
                )));
            }
        };
        match turn.get("content") {
            Some(Value::String(text)) => messages.push(json!({"role": role, "content": text})),
            Some(Value::Array(blocks)) => {
                let blocks = anthropic_blocks(blocks, &format!("messages.{index}"))?;
                // Tool results answer the assistant's calls, before the user's text.
                for result in blocks.tool_results {
                    messages.push(json!({"role": "tool", "content": result}));
                }
                if !blocks.parts.is_empty() {
                    messages.push(json!({"role": role, "content": blocks.parts}));
                }
            }
            _ => {
                return Err(invalid(format!(
                    "messages.{index}.content must be a string or an array of content blocks"
                )));
            }
        }
    }
    Ok(messages)
}

/// A Messages content array: its chat content parts, and the text of its
/// tool results, each its own `tool` message.
struct Blocks {
    parts: Vec<Value>,
    tool_results: Vec<String>,
}

fn anthropic_blocks(blocks: &[Value], path: &str) -> Result<Blocks, TokenizeError> {
    let mut parts = Vec::with_capacity(blocks.len());
    let mut tool_results = Vec::new();
    for (index, block) in blocks.iter().enumerate() {
        let at = |what: &str| invalid(format!("{path}.content.{index}: {what}"));
        let string = |value: &Value, name: &str| {
            value
                .get(name)
                .and_then(Value::as_str)
                .map(str::to_string)
                .ok_or_else(|| at(&format!("missing string field `{name}`")))
        };
        match block.get("type").and_then(Value::as_str) {
            Some("text") => parts.push(json!({"type": "text", "text": string(block, "text")?})),
            Some("image") => {
                let source = block
                    .get("source")
                    .ok_or_else(|| at("missing field `source`"))?;
                let url = match source.get("type").and_then(Value::as_str) {
                    Some("base64") => format!(
                        "data:{};base64,{}",
                        string(source, "media_type")?,
                        string(source, "data")?
                    ),
                    Some("url") => string(source, "url")?,
                    _ => return Err(at("image `source.type` must be \"base64\" or \"url\"")),
                };
                parts.push(json!({"type": "image_url", "image_url": {"url": url}}));
            }
            Some("tool_use") => {
                let input = block
                    .get("input")
                    .ok_or_else(|| at("missing field `input`"))?;
                let call = tool_call(&string(block, "name")?, input);
                parts.push(json!({"type": "text", "text": call}));
            }
            Some("tool_result") => {
                let text = match block.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(Value::String(text)) => text.clone(),
                    Some(Value::Array(inner)) => {
                        text_of(&anthropic_blocks(inner, &format!("{path}.content.{index}"))?.parts)
                    }
                    Some(_) => return Err(at("tool_result `content` must be a string or blocks")),
                };
                tool_results.push(text);
            }
            Some("thinking" | "redacted_thinking" | "document") => {}
            Some(other) => return Err(at(&format!("unsupported content block type `{other}`"))),
            None => return Err(at("not an object with a string `type`")),
        }
    }
    Ok(Blocks {
        parts,
        tool_results,
    })
}

/// The system message of `system` text and `tools` definitions; `None` when
/// the request has neither.
fn system_message(
    system: Option<&str>,
    tools: Option<&Value>,
) -> Result<Option<Value>, TokenizeError> {
    let tools = match tools {
        None | Some(Value::Null) => &[][..],
        Some(Value::Array(tools)) => tools.as_slice(),
        Some(_) => return Err(invalid("`tools` must be an array of tool definitions")),
    };
    let mut text = system.unwrap_or_default().to_string();
    if !tools.is_empty() {
        if !text.is_empty() {
            text.push_str("\n\n");
        }
        text.push_str("# Tools\n");
        for tool in tools {
            text.push('\n');
            // serde_json's maps are sorted by key: one rendering per definition.
            text.push_str(&tool.to_string());
        }
    }
    Ok((system.is_some() || !tools.is_empty()).then(|| json!({"role": "system", "content": text})))
}

/// A tool call as the assistant's text.
fn tool_call(name: &str, arguments: &Value) -> String {
    let mut call = Map::new();
    call.insert("name".into(), Value::String(name.to_string()));
    call.insert("arguments".into(), arguments.clone());
    format!("<tool_call>\n{}\n</tool_call>", Value::Object(call))
}

/// The text of chat content parts, joined as a message's parts are.
fn text_of(parts: &[Value]) -> String {
    let texts: Vec<&str> = parts
        .iter()
        .filter_map(|part| part.get("text").and_then(Value::as_str))
        .collect();
    texts.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_render_instructions_tools_history_and_items() {
        let body = json!({
            "instructions": "Be brief.",
            "tools": [{"type": "function", "name": "f", "parameters": {}}],
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "hi"},
                    {"type": "input_image", "image_url": "https://x/i.png"}]},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "42"},
                {"type": "reasoning", "summary": []},
            ],
        });
        let history = [json!({"role": "user", "content": "before"})];
        let messages = responses_messages(&body, &history).unwrap();
        assert_eq!(
            messages,
            vec![
                json!({"role": "system", "content":
                    "Be brief.\n\n# Tools\n\n{\"name\":\"f\",\"parameters\":{},\"type\":\"function\"}"}),
                json!({"role": "user", "content": "before"}),
                json!({"role": "user", "content": [{"type": "text", "text": "hi"},
                    {"type": "image_url", "image_url": {"url": "https://x/i.png"}}]}),
                json!({"role": "assistant", "content":
                    "<tool_call>\n{\"arguments\":\"{}\",\"name\":\"f\"}\n</tool_call>"}),
                json!({"role": "tool", "content": "42"}),
            ]
        );
        assert_eq!(
            responses_messages(&json!({"input": "hello"}), &[]).unwrap(),
            vec![json!({"role": "user", "content": "hello"})]
        );
    }

    #[test]
    fn anthropic_renders_system_blocks_tools_and_results() {
        let body = json!({
            "system": [{"type": "text", "text": "S"}],
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": [{"type": "text", "text": "t"},
                    {"type": "tool_use", "id": "u", "name": "f", "input": {"a": 1}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "u", "content": "r"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}]},
            ],
        });
        assert_eq!(
            anthropic_messages(&body).unwrap(),
            vec![
                json!({"role": "system", "content": "S"}),
                json!({"role": "user", "content": "q"}),
                json!({"role": "assistant", "content": [{"type": "text", "text": "t"},
                    {"type": "text", "text":
                        "<tool_call>\n{\"arguments\":{\"a\":1},\"name\":\"f\"}\n</tool_call>"}]}),
                json!({"role": "tool", "content": "r"}),
                json!({"role": "user", "content": [{"type": "image_url",
                    "image_url": {"url": "data:image/png;base64,AA"}}]}),
            ]
        );
    }

    #[test]
    fn bad_shapes_are_refused_with_where() {
        let cases = [
            (json!({}), "missing field `input`"),
            (json!({"input": 3}), "`input` must be"),
            (
                json!({"input": [{"role": "bot", "content": "x"}]}),
                "unknown role `bot`",
            ),
            (
                json!({"input": [{"type": "web_search_call"}]}),
                "unsupported item type",
            ),
            (
                json!({"input": "x", "tools": {}}),
                "`tools` must be an array",
            ),
        ];
        for (body, expected) in cases {
            let error = responses_messages(&body, &[]).unwrap_err().to_string();
            assert!(error.contains(expected), "{body}: {error}");
        }
        let error = anthropic_messages(&json!({"messages": [{"role": "system", "content": "x"}]}))
            .unwrap_err()
            .to_string();
        assert!(error.contains("messages.0.role"), "{error}");
    }
}

//! vLLM's endpoints that use no KV cache, which a router passes through by
//! load: `POST /v1/embeddings`, `/v1/rerank`, `/v1/score`, `/tokenize` and
//! `/detokenize`, in vLLM's request and response shapes.
//!
//! Tokens are the sim's tokenizer's (`/tokenize` gives what chat and
//! completions prompts become). Embeddings are fake but deterministic: the
//! normalized sum of one pseudo-random unit vector per token, so texts that
//! share tokens are alike, and scores (`/v1/score`, `/v1/rerank`) are the
//! cosine similarity of two texts' embeddings, mapped to 0..1.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use base64::Engine as _;
use kvroute_tokenize::{Prompt, parse_completion_prompt};
use serde_json::{Value, json};

use crate::worker::Shared;
use crate::worker::http::responses::{new_id, tokenize_error, unix_now};
use crate::worker::http::{ApiError, json_body, served_model};

/// Dimensions of an embedding unless the request asks for `dimensions`.
const DIMENSIONS: usize = 64;
/// The most dimensions a request may ask for.
const MAX_DIMENSIONS: usize = 4096;
/// The most inputs (texts, documents) in one request, as OpenAI caps embeddings.
const MAX_INPUTS: usize = 2048;

type Answer = Result<Json<Value>, ApiError>;

/// The token ids of one text, or ids given as they are.
fn tokens(shared: &Shared, prompt: Prompt) -> Result<Vec<u32>, ApiError> {
    match prompt {
        Prompt::Tokens(tokens) => Ok(tokens),
        Prompt::Text(text) => shared
            .tokenizer
            .get()?
            .encode(&text)
            .map_err(tokenize_error),
    }
}

fn text_tokens(shared: &Shared, text: &str) -> Result<Vec<u32>, ApiError> {
    tokens(shared, Prompt::Text(text.to_string()))
}

/// splitmix64: a well-mixed 64-bit value of `x`.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The fake embedding of `tokens`: unit length, `dimensions` long.
fn embed(tokens: &[u32], dimensions: usize) -> Vec<f32> {
    let mut vector = vec![0f64; dimensions];
    for &token in tokens {
        let seed = mix(u64::from(token));
        for (j, value) in vector.iter_mut().enumerate() {
            // Uniform in [-1, 1).
            *value += (mix(seed ^ j as u64) >> 11) as f64 / (1u64 << 52) as f64 - 1.0;
        }
    }
    let norm = vector.iter().map(|v| v * v).sum::<f64>().sqrt();
    vector
        .iter()
        .map(|v| if norm > 0.0 { (v / norm) as f32 } else { 0.0 })
        .collect()
}

/// How alike two texts are, in 0..1.
fn similarity(a: &[u32], b: &[u32]) -> f64 {
    let (a, b) = (embed(a, DIMENSIONS), embed(b, DIMENSIONS));
    let cosine: f64 = a.iter().zip(&b).map(|(x, y)| f64::from(x * y)).sum();
    (cosine.clamp(-1.0, 1.0) + 1.0) / 2.0
}

fn usage(prompt_tokens: usize) -> Value {
    json!({"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
           "completion_tokens": 0, "prompt_tokens_details": null})
}

/// A list of at most [`MAX_INPUTS`] items.
fn capped<T>(items: Vec<T>, what: &str) -> Result<Vec<T>, ApiError> {
    if items.is_empty() {
        return Err(ApiError::bad(format!("`{what}` must not be empty")));
    }
    if items.len() > MAX_INPUTS {
        return Err(ApiError::bad(format!(
            "`{what}` holds {} items; at most {MAX_INPUTS} are allowed",
            items.len()
        )));
    }
    Ok(items)
}

/// `field` as one string or an array of strings.
fn texts(json: &Value, field: &str) -> Result<Vec<String>, ApiError> {
    let refuse = || ApiError::bad(format!("`{field}` must be a string or an array of strings"));
    match json.get(field) {
        None => Err(ApiError::bad(format!("missing field `{field}`"))),
        Some(Value::String(text)) => Ok(vec![text.clone()]),
        Some(Value::Array(items)) => capped(
            items
                .iter()
                .map(|item| item.as_str().map(str::to_string).ok_or_else(refuse))
                .collect::<Result<_, _>>()?,
            field,
        ),
        Some(_) => Err(refuse()),
    }
}

/// `POST /v1/embeddings`: `input` a string, token ids, or an array of either;
/// `encoding_format` `float` (default) or `base64`; `dimensions`.
pub(crate) async fn embeddings(
    State(shared): State<Arc<Shared>>,
    body: axum::body::Bytes,
) -> Answer {
    let json = json_body(&body)?;
    let model = served_model(&shared, &json)?;
    let input = json
        .get("input")
        .ok_or_else(|| ApiError::bad("missing field `input`"))?;
    // An array of strings or of token-id arrays is a batch; anything else is one input.
    let batch = match input {
        Value::Array(items) if items.first().is_some_and(|i| i.is_string() || i.is_array()) => {
            capped(items.clone(), "input")?
        }
        one => vec![one.clone()],
    };
    let dimensions = match json.get("dimensions") {
        None | Some(Value::Null) => DIMENSIONS,
        Some(v) => v
            .as_u64()
            .map(|n| n as usize)
            .filter(|n| (1..=MAX_DIMENSIONS).contains(n))
            .ok_or_else(|| {
                ApiError::bad(format!(
                    "`dimensions` must be an integer from 1 to {MAX_DIMENSIONS}"
                ))
            })?,
    };
    let base64 = match json.get("encoding_format").and_then(Value::as_str) {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::bad(format!(
                "`encoding_format` must be \"float\" or \"base64\", not \"{other}\""
            )));
        }
    };
    let mut data = Vec::with_capacity(batch.len());
    let mut prompt_tokens = 0;
    for (index, item) in batch.iter().enumerate() {
        let prompt = parse_completion_prompt(item)
            .map_err(|e| ApiError::bad(format!("input {index}: {e}")))?;
        let ids = tokens(&shared, prompt)?;
        prompt_tokens += ids.len();
        let vector = embed(&ids, dimensions);
        let embedding = if base64 {
            let bytes: Vec<u8> = vector.iter().flat_map(|v| v.to_le_bytes()).collect();
            json!(base64::engine::general_purpose::STANDARD.encode(bytes))
        } else {
            json!(vector)
        };
        data.push(json!({"index": index, "object": "embedding", "embedding": embedding}));
    }
    Ok(Json(json!({
        "id": new_id("embd"), "object": "list", "created": unix_now(), "model": model,
        "data": data, "usage": usage(prompt_tokens),
    })))
}

/// `POST /v1/score`: `text_1` against each of `text_2` (one to many), or
/// pairwise when both are arrays of the same length.
pub(crate) async fn score(State(shared): State<Arc<Shared>>, body: axum::body::Bytes) -> Answer {
    let json = json_body(&body)?;
    let model = served_model(&shared, &json)?;
    let (first, second) = (texts(&json, "text_1")?, texts(&json, "text_2")?);
    let pairs: Vec<(&String, &String)> = match (first.len(), second.len()) {
        (1, _) => second.iter().map(|b| (&first[0], b)).collect(),
        (n, m) if n == m => first.iter().zip(&second).collect(),
        (n, m) => {
            return Err(ApiError::bad(format!(
                "`text_1` has {n} texts and `text_2` {m}: give one `text_1`, or as many as `text_2`"
            )));
        }
    };
    let mut data = Vec::with_capacity(pairs.len());
    let mut prompt_tokens = 0;
    for (index, (a, b)) in pairs.into_iter().enumerate() {
        let (a, b) = (text_tokens(&shared, a)?, text_tokens(&shared, b)?);
        prompt_tokens += a.len() + b.len();
        data.push(json!({"index": index, "object": "score", "score": similarity(&a, &b)}));
    }
    Ok(Json(json!({
        "id": new_id("score"), "object": "list", "created": unix_now(), "model": model,
        "data": data, "usage": usage(prompt_tokens),
    })))
}

/// `POST /v1/rerank`: `documents` by relevance to `query`, best first, the
/// first `top_n` (default, or 0: all).
pub(crate) async fn rerank(State(shared): State<Arc<Shared>>, body: axum::body::Bytes) -> Answer {
    let json = json_body(&body)?;
    let model = served_model(&shared, &json)?;
    let query = json
        .get("query")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::bad("missing field `query` (a string)"))?;
    let documents = match json.get("documents") {
        Some(Value::Array(_)) => texts(&json, "documents")?,
        _ => {
            return Err(ApiError::bad(
                "missing field `documents` (an array of strings)",
            ));
        }
    };
    let top_n = match json.get("top_n") {
        None | Some(Value::Null) => documents.len(),
        Some(v) => match v.as_u64() {
            Some(0) => documents.len(),
            Some(n) => (n as usize).min(documents.len()),
            None => return Err(ApiError::bad("`top_n` must be a non-negative integer")),
        },
    };
    let query = text_tokens(&shared, query)?;
    let mut total_tokens = 0;
    let mut results = Vec::with_capacity(documents.len());
    for (index, document) in documents.iter().enumerate() {
        let ids = text_tokens(&shared, document)?;
        total_tokens += query.len() + ids.len();
        results.push((index, similarity(&query, &ids)));
    }
    results.sort_by(|a, b| b.1.total_cmp(&a.1));
    let results: Vec<Value> = results
        .into_iter()
        .take(top_n)
        .map(|(index, score)| {
            json!({"index": index, "document": {"text": documents[index]},
                   "relevance_score": score})
        })
        .collect();
    Ok(Json(json!({
        "id": new_id("rerank"), "model": model,
        "usage": {"total_tokens": total_tokens}, "results": results,
    })))
}

/// The request's `model`, if it names one: optional on these endpoints.
fn optional_model(shared: &Shared, json: &Value) -> Result<(), ApiError> {
    match json.get("model") {
        None | Some(Value::Null) => Ok(()),
        Some(_) => served_model(shared, json).map(|_| ()),
    }
}

/// `POST /tokenize`: a completions `prompt` (with the tokenizer's added
/// special tokens) or chat `messages` (through the chat template, with the
/// generation prompt unless `add_generation_prompt` is false).
pub(crate) async fn tokenize(State(shared): State<Arc<Shared>>, body: axum::body::Bytes) -> Answer {
    let json = json_body(&body)?;
    optional_model(&shared, &json)?;
    let ids = match (json.get("prompt"), json.get("messages")) {
        (Some(prompt), None) => tokens(
            &shared,
            parse_completion_prompt(prompt).map_err(tokenize_error)?,
        )?,
        (None, Some(Value::Array(messages))) => {
            let generation = match json.get("add_generation_prompt") {
                None | Some(Value::Null) => true,
                Some(v) => v
                    .as_bool()
                    .ok_or_else(|| ApiError::bad("`add_generation_prompt` must be a boolean"))?,
            };
            shared
                .tokenizer
                .get()?
                .encode_chat_with_images(messages, generation)
                .map_err(tokenize_error)?
                .0
        }
        (None, Some(_)) => return Err(ApiError::bad("`messages` must be an array")),
        _ => {
            return Err(ApiError::bad(
                "give either `prompt` (a completions prompt) or `messages` (a chat)",
            ));
        }
    };
    let config = &shared.config.engine;
    Ok(Json(json!({
        "count": ids.len(),
        "max_model_len": config.kv_blocks * config.block_size,
        "tokens": ids,
        "token_strs": null,
    })))
}

/// `POST /detokenize`: `{"tokens": [ids]}` to `{"prompt": text}`.
pub(crate) async fn detokenize(
    State(shared): State<Arc<Shared>>,
    body: axum::body::Bytes,
) -> Answer {
    let json = json_body(&body)?;
    optional_model(&shared, &json)?;
    let ids = json
        .get("tokens")
        .and_then(Value::as_array)
        .ok_or_else(|| ApiError::bad("missing field `tokens` (an array of token ids)"))?
        .iter()
        .map(|id| id.as_u64().and_then(|id| u32::try_from(id).ok()))
        .collect::<Option<Vec<u32>>>()
        .ok_or_else(|| ApiError::bad("`tokens` must hold token ids (integers from 0)"))?;
    let text = shared
        .tokenizer
        .get()?
        .decode(&ids)
        .map_err(tokenize_error)?;
    Ok(Json(json!({"prompt": text})))
}

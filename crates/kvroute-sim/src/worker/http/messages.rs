//! The Anthropic Messages API, as vLLM serves it: `POST /v1/messages`
//! (streamed as Messages events, or the message) and
//! `POST /v1/messages/count_tokens`.
//!
//! The prompt is `system`, `tools` and `messages` as chat messages
//! ([`kvroute_tokenize::anthropic_messages`]) through the chat template, so
//! its tokens, and its cache hits, are chat's. `max_tokens` is required, as
//! Anthropic requires it; the reply is filler that ends there, reported as
//! `end_turn`. Usage is Anthropic's: `input_tokens` are the prompt tokens not
//! read from the cache, `cache_read_input_tokens` those that were. Errors are
//! Anthropic's `{"type": "error", "error": {"type", "message"}}`.

use std::convert::Infallible;
use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::engine::Emitted;
use crate::worker::Shared;
use crate::worker::http::responses::{
    encode_chat, new_id, submit_chat, token_budget, tokenize_error,
};
use crate::worker::http::{
    AbortGuard, ApiError, ended_early, filler, json_body, reply, served_model,
};

/// An error in Anthropic's shape, its type named by its status as Anthropic names it.
pub(crate) fn anthropic_error(error: ApiError) -> Response {
    let (status, body) = anthropic_error_body(error);
    (status, Json(body)).into_response()
}

fn anthropic_error_body(error: ApiError) -> (StatusCode, Value) {
    let kind = match error.status.as_u16() {
        400 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    };
    let body = json!({"type": "error", "error": {"type": kind, "message": error.message}});
    (error.status, body)
}

/// `POST /v1/messages`.
pub(crate) async fn create(State(shared): State<Arc<Shared>>, body: axum::body::Bytes) -> Response {
    start(shared, &body).await.unwrap_or_else(anthropic_error)
}

/// `POST /v1/messages/count_tokens`: `{"input_tokens": N}`, the tokens of the
/// prompt `POST /v1/messages` would run.
pub(crate) async fn count_tokens(
    State(shared): State<Arc<Shared>>,
    body: axum::body::Bytes,
) -> Response {
    let count = || -> Result<usize, ApiError> {
        let json = json_body(&body)?;
        served_model(&shared, &json)?;
        let messages = kvroute_tokenize::anthropic_messages(&json).map_err(tokenize_error)?;
        Ok(encode_chat(&shared, &messages)?.0.len())
    };
    match count() {
        Ok(tokens) => Json(json!({"input_tokens": tokens})).into_response(),
        Err(error) => anthropic_error(error),
    }
}

struct Head {
    id: String,
    model: String,
}

impl Head {
    fn message(&self, text: Option<&str>, stop: Option<&str>, usage: Value) -> Value {
        let content = match text {
            Some(text) => json!([{"type": "text", "text": text}]),
            None => json!([]),
        };
        json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop,
            "stop_sequence": null,
            "usage": usage,
        })
    }
}

/// Anthropic's usage: input tokens apart from those read from the cache.
fn usage(emitted: &Emitted, output_tokens: u32) -> Value {
    json!({
        "input_tokens": emitted.prompt_tokens - emitted.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": emitted.cached_tokens,
        "output_tokens": output_tokens,
    })
}

async fn start(shared: Arc<Shared>, body: &[u8]) -> Result<Response, ApiError> {
    let json = json_body(body)?;
    let model = served_model(&shared, &json)?.to_string();
    let max_tokens = token_budget(&json, "max_tokens", None)?;
    let messages = kvroute_tokenize::anthropic_messages(&json).map_err(tokenize_error)?;
    let (rx, guard) = submit_chat(&shared, &json, &messages, max_tokens)?;
    let head = Head {
        id: new_id("msg"),
        model,
    };
    if json.get("stream").and_then(Value::as_bool).unwrap_or(false) {
        Ok(stream(head, rx, guard))
    } else {
        whole(head, rx, guard).await
    }
}

async fn whole(
    head: Head,
    rx: mpsc::UnboundedReceiver<Emitted>,
    guard: AbortGuard,
) -> Result<Response, ApiError> {
    let (text, last) = reply(rx, guard).await.ok_or_else(ended_early)?;
    let usage = usage(&last, last.generated);
    Ok(Json(head.message(Some(&text), Some("end_turn"), usage)).into_response())
}

fn event(data: Value) -> Event {
    let kind = data["type"].as_str().unwrap_or_default().to_string();
    Event::default().event(kind).data(data.to_string())
}

/// The message as Messages events: on the first token `message_start`,
/// `content_block_start` and `ping`; one `content_block_delta` per token;
/// then `content_block_stop`, `message_delta` (stop reason, usage) and
/// `message_stop`. If the engine drops the request, an `error` event ends it.
fn stream(head: Head, rx: mpsc::UnboundedReceiver<Emitted>, guard: AbortGuard) -> Response {
    let state = (rx, guard, head, false, false);
    let events = futures_util::stream::unfold(
        state,
        |(mut rx, mut guard, head, started, ended)| async move {
            if ended {
                return None;
            }
            let Some(emitted) = rx.recv().await else {
                let (_, body) = anthropic_error_body(ended_early());
                return Some((vec![event(body)], (rx, guard, head, started, true)));
            };
            let mut out = Vec::with_capacity(4);
            if !started {
                let message = head.message(None, None, usage(&emitted, 0));
                out.extend([
                    event(json!({"type": "message_start", "message": message})),
                    event(json!({"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}})),
                    event(json!({"type": "ping"})),
                ]);
            }
            out.push(event(json!({"type": "content_block_delta", "index": 0,
                "delta": {"type": "text_delta", "text": filler(emitted.generated - 1)}})));
            if emitted.finished {
                guard.done = true;
                out.extend([
                    event(json!({"type": "content_block_stop", "index": 0})),
                    event(json!({"type": "message_delta",
                        "delta": {"stop_reason": "end_turn", "stop_sequence": null},
                        "usage": usage(&emitted, emitted.generated)})),
                    event(json!({"type": "message_stop"})),
                ]);
            }
            let finished = emitted.finished;
            Some((out, (rx, guard, head, true, finished)))
        },
    );
    let events = events
        .map(futures_util::stream::iter)
        .flatten()
        .map(Ok::<_, Infallible>);
    Sse::new(events).into_response()
}

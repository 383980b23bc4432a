//! The OpenAI Responses API, as vLLM serves it: `POST /v1/responses`
//! (streamed as Responses events, or the response object), and
//! `GET`/`DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`.
//!
//! The prompt is `instructions`, `tools` and `input` as chat messages
//! ([`kvroute_tokenize::responses_messages`]) through the chat template, so
//! its tokens, and its cache hits, are chat's. A response is stored (unless
//! `store: false`) with its conversation (input and reply, without the
//! instructions, which a follow-up does not inherit), for `--responses-ttl-s`;
//! a request with `previous_response_id` is that conversation plus its own
//! input, so it finds the turn before in this engine's cache. An unknown id is
//! a 404, as vLLM answers. The reply is filler that ends at
//! `max_output_tokens` (default 16), reported `completed`.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use kvroute_index::{ExtraKeys, MultimodalItem};
use kvroute_tokenize::TokenizeError;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::engine::{Emitted, Handoff, SeqId};
use crate::worker::Shared;
use crate::worker::http::{
    AbortGuard, ApiError, cache_salt, ended_early, filler, json_body, priority, reply, served_model,
};

/// Stored responses, each kept for the store's TTL from its creation.
pub(crate) struct ResponseStore {
    ttl: Duration,
    inner: Mutex<Stored>,
}

#[derive(Default)]
struct Stored {
    responses: HashMap<String, StoredResponse>,
    /// Ids by creation time: the TTL is one for all, so the oldest expire first.
    created: VecDeque<(Instant, String)>,
}

struct StoredResponse {
    /// The response object, as `GET /v1/responses/{id}` returns it.
    object: Value,
    /// The input and reply as chat messages, once completed.
    conversation: Option<Vec<Value>>,
    /// The engine's request while the response is in progress.
    running: Option<SeqId>,
}

impl ResponseStore {
    pub fn new(ttl: Duration) -> Self {
        ResponseStore {
            ttl,
            inner: Mutex::new(Stored::default()),
        }
    }

    /// The live responses, the expired ones dropped.
    fn lock(&self) -> MutexGuard<'_, Stored> {
        let mut stored = self
            .inner
            .lock()
            .expect("no code panics while holding the store");
        let now = Instant::now();
        while let Some((created, _)) = stored.created.front() {
            if now.duration_since(*created) < self.ttl {
                break;
            }
            if let Some((_, id)) = stored.created.pop_front() {
                stored.responses.remove(&id);
            }
        }
        stored
    }

    fn insert(&self, id: &str, response: StoredResponse) {
        let mut stored = self.lock();
        stored.created.push_back((Instant::now(), id.to_string()));
        stored.responses.insert(id.to_string(), response);
    }

    /// Records the end of a response; false if it was cancelled (or expired) meanwhile.
    fn finish(&self, id: &str, object: &Value, conversation: Vec<Value>) -> bool {
        let mut stored = self.lock();
        match stored.responses.get_mut(id) {
            Some(response) if response.running.is_some() => {
                response.object = object.clone();
                response.conversation = Some(conversation);
                response.running = None;
                true
            }
            _ => false,
        }
    }

    /// Forgets every response, as a restarted engine does.
    pub fn clear(&self) {
        *self.lock() = Stored::default();
    }
}

fn not_found(id: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("Response with id '{id}' not found."),
    )
}

/// The ids of responses and their message items, as vLLM draws them.
pub(crate) fn new_id(prefix: &str) -> String {
    format!("{prefix}_{:032x}", rand::random::<u128>())
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Token ids of chat `messages` through the chat template, with their images.
pub(crate) fn encode_chat(
    shared: &Shared,
    messages: &[Value],
) -> Result<(Vec<u32>, Vec<MultimodalItem>), ApiError> {
    shared
        .tokenizer
        .get()?
        .encode_chat_with_images(messages, true)
        .map_err(tokenize_error)
}

pub(crate) fn tokenize_error(e: TokenizeError) -> ApiError {
    if e.is_client_error() {
        ApiError::bad(e.to_string())
    } else {
        ApiError::server(e.to_string())
    }
}

/// Queues the prompt of chat `messages`, keyed by the body's `cache_salt`, at
/// its `priority_class`; the request is aborted when the guard drops unfinished.
pub(crate) fn submit_chat(
    shared: &Arc<Shared>,
    json: &Value,
    messages: &[Value],
    max_tokens: u32,
) -> Result<(mpsc::UnboundedReceiver<Emitted>, AbortGuard), ApiError> {
    let (tokens, multimodal) = encode_chat(shared, messages)?;
    let extra = ExtraKeys {
        cache_salt: cache_salt(json)?,
        multimodal,
    };
    let (id, rx) = shared.submit(
        &tokens,
        max_tokens,
        &extra,
        priority(json)?,
        Handoff::default(),
        None,
    )?;
    let guard = AbortGuard {
        shared: Arc::clone(shared),
        id,
        done: false,
    };
    Ok((rx, guard))
}

/// A positive token budget from `field`, or `default` when absent.
pub(crate) fn token_budget(
    json: &Value,
    field: &str,
    default: Option<u32>,
) -> Result<u32, ApiError> {
    match (json.get(field), default) {
        (None | Some(Value::Null), Some(default)) => Ok(default),
        (None | Some(Value::Null), None) => Err(ApiError::bad(format!(
            "missing field `{field}` (a positive integer)"
        ))),
        (Some(v), _) => v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .filter(|&n| n > 0)
            .ok_or_else(|| ApiError::bad(format!("`{field}` must be a positive integer"))),
    }
}

/// What a response is, besides its output and usage.
struct Head {
    id: String,
    message_id: String,
    created_at: u64,
    /// The request's fields a response object echoes.
    echo: Value,
    store: bool,
    shared: Arc<Shared>,
    /// The conversation so far (previous turns and this input), to store.
    conversation: Vec<Value>,
}

impl Head {
    /// The response object; `text` and `usage` once there is output.
    fn object(&self, status: &str, text: Option<&str>, usage: Option<&Emitted>) -> Value {
        let output = match text {
            Some(text) => vec![self.message(text, "completed")],
            None => Vec::new(),
        };
        let usage = usage.map(|last| {
            json!({
                "input_tokens": last.prompt_tokens,
                "input_tokens_details": {"cached_tokens": last.cached_tokens},
                "output_tokens": last.generated,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": last.prompt_tokens + last.generated,
            })
        });
        let mut object = json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": null,
            "incomplete_details": null,
            "output": output,
            "parallel_tool_calls": true,
            "store": self.store,
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto",
            "truncation": "disabled",
            "usage": usage,
        });
        if let (Value::Object(object), Value::Object(echo)) = (&mut object, &self.echo) {
            object.extend(echo.clone());
        }
        object
    }

    fn message(&self, text: &str, status: &str) -> Value {
        json!({
            "id": self.message_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": [output_text(text)],
        })
    }

    /// Stores the completed response and its conversation; false if it was
    /// cancelled meanwhile.
    fn complete(&self, object: &Value, text: &str) -> bool {
        if !self.store {
            return true;
        }
        let mut conversation = self.conversation.clone();
        conversation.push(json!({"role": "assistant", "content": text}));
        self.shared.responses.finish(&self.id, object, conversation)
    }

    /// The stored object of a response that ended early: cancelled, or gone.
    fn cancelled(&self) -> Option<Value> {
        let stored = self.shared.responses.lock();
        stored.responses.get(&self.id).map(|r| r.object.clone())
    }
}

fn output_text(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": []})
}

/// `POST /v1/responses`.
pub(crate) async fn create(State(shared): State<Arc<Shared>>, body: axum::body::Bytes) -> Response {
    start(shared, &body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn start(shared: Arc<Shared>, body: &[u8]) -> Result<Response, ApiError> {
    let json = json_body(body)?;
    let model = served_model(&shared, &json)?.to_string();
    let store = match json.get("store") {
        None | Some(Value::Null) => true,
        Some(v) => v
            .as_bool()
            .ok_or_else(|| ApiError::bad("`store` must be a boolean"))?,
    };
    let previous = match json.get("previous_response_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(id)) => Some(id.as_str()),
        Some(_) => return Err(ApiError::bad("`previous_response_id` must be a string")),
    };
    let history = match previous {
        None => Vec::new(),
        Some(id) => {
            let stored = shared.responses.lock();
            let response = stored.responses.get(id).ok_or_else(|| not_found(id))?;
            response.conversation.clone().ok_or_else(|| {
                ApiError::bad(format!(
                    "response '{id}' is {}; only a completed response can be continued",
                    response.object["status"].as_str().unwrap_or("unfinished")
                ))
            })?
        }
    };
    let messages = kvroute_tokenize::responses_messages(&json, &history).map_err(tokenize_error)?;
    let max_tokens = token_budget(&json, "max_output_tokens", Some(16))?;
    let (rx, guard) = submit_chat(&shared, &json, &messages, max_tokens)?;
    let mut conversation = history;
    let input = json.get("input").unwrap_or(&Value::Null);
    conversation.extend(kvroute_tokenize::responses_input(input).map_err(tokenize_error)?);
    let echoed = [
        "instructions",
        "max_output_tokens",
        "metadata",
        "previous_response_id",
        "temperature",
        "tools",
        "top_p",
        "user",
    ];
    let mut echo = serde_json::Map::new();
    echo.insert("model".into(), Value::String(model));
    for field in echoed {
        echo.insert(
            field.into(),
            json.get(field).cloned().unwrap_or(match field {
                "tools" => json!([]),
                "metadata" => json!({}),
                _ => Value::Null,
            }),
        );
    }
    let head = Head {
        id: new_id("resp"),
        message_id: new_id("msg"),
        created_at: unix_now(),
        echo: Value::Object(echo),
        store,
        shared: Arc::clone(&shared),
        conversation,
    };
    if store {
        shared.responses.insert(
            &head.id,
            StoredResponse {
                object: head.object("in_progress", None, None),
                conversation: None,
                running: Some(guard.id),
            },
        );
    }
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
    if let Some((text, last)) = reply(rx, guard).await {
        let object = head.object("completed", Some(&text), Some(&last));
        if head.complete(&object, &text) {
            return Ok(Json(object).into_response());
        }
    }
    // Cancelled (or dropped by the engine) before it completed.
    head.cancelled()
        .map(|object| Json(object).into_response())
        .ok_or_else(ended_early)
}

/// The SSE events of a response, each with its `type` and `sequence_number`.
struct Events {
    next: u64,
}

impl Events {
    fn event(&mut self, kind: &str, mut data: Value) -> Event {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.next);
        self.next += 1;
        Event::default().event(kind).data(data.to_string())
    }
}

/// The response as Responses events: `response.created`,
/// `response.in_progress`, `response.output_item.added`,
/// `response.content_part.added`, one `response.output_text.delta` per token,
/// `response.output_text.done`, `response.content_part.done`,
/// `response.output_item.done`, `response.completed`. If the request is
/// cancelled or the engine drops it, the stream ends there.
fn stream(head: Head, rx: mpsc::UnboundedReceiver<Emitted>, guard: AbortGuard) -> Response {
    let mut events = Events { next: 0 };
    let in_progress = head.object("in_progress", None, None);
    let item = json!({"output_index": 0, "item": {
        "id": head.message_id, "type": "message", "status": "in_progress",
        "role": "assistant", "content": [],
    }});
    let part = json!({"item_id": head.message_id, "output_index": 0, "content_index": 0,
                      "part": output_text("")});
    let prelude = vec![
        events.event("response.created", json!({"response": in_progress})),
        events.event("response.in_progress", json!({"response": in_progress})),
        events.event("response.output_item.added", item),
        events.event("response.content_part.added", part),
    ];
    let state = (rx, guard, head, events, String::new(), false);
    let rest = futures_util::stream::unfold(
        state,
        |(mut rx, mut guard, head, mut events, mut text, ended)| async move {
            if ended {
                return None;
            }
            let emitted = rx.recv().await?;
            let delta = filler(emitted.generated - 1);
            text.push_str(delta);
            let at = json!({"item_id": head.message_id, "output_index": 0, "content_index": 0});
            let with = |mut at: Value, key: &str, value: Value| {
                at[key] = value;
                at
            };
            let mut out = vec![events.event(
                "response.output_text.delta",
                with(
                    with(at.clone(), "delta", json!(delta)),
                    "logprobs",
                    json!([]),
                ),
            )];
            if emitted.finished {
                guard.done = true;
                let object = head.object("completed", Some(&text), Some(&emitted));
                if !head.complete(&object, &text) {
                    return None;
                }
                out.extend([
                    events.event(
                        "response.output_text.done",
                        with(with(at.clone(), "text", json!(text)), "logprobs", json!([])),
                    ),
                    events.event(
                        "response.content_part.done",
                        with(at, "part", output_text(&text)),
                    ),
                    events.event(
                        "response.output_item.done",
                        json!({"output_index": 0, "item": head.message(&text, "completed")}),
                    ),
                    events.event("response.completed", json!({"response": object})),
                ]);
            }
            let finished = emitted.finished;
            Some((out, (rx, guard, head, events, text, finished)))
        },
    );
    let all = futures_util::stream::iter(prelude)
        .chain(rest.map(futures_util::stream::iter).flatten())
        .map(Ok::<_, Infallible>);
    Sse::new(all).into_response()
}

/// `GET /v1/responses/{id}`.
pub(crate) async fn retrieve(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let stored = shared.responses.lock();
    let response = stored.responses.get(&id).ok_or_else(|| not_found(&id))?;
    Ok(Json(response.object.clone()))
}

/// `DELETE /v1/responses/{id}`: forgets the response (cancelling it if it runs).
pub(crate) async fn delete(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let removed = shared
        .responses
        .lock()
        .responses
        .remove(&id)
        .ok_or_else(|| not_found(&id))?;
    if let Some(seq) = removed.running {
        shared.abort(seq);
    }
    Ok(Json(
        json!({"id": id, "object": "response.deleted", "deleted": true}),
    ))
}

/// `POST /v1/responses/{id}/cancel`: stops a response in progress; a
/// finished one cannot be cancelled (400).
pub(crate) async fn cancel(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let (object, seq) = {
        let mut stored = shared.responses.lock();
        let response = stored
            .responses
            .get_mut(&id)
            .ok_or_else(|| not_found(&id))?;
        let Some(seq) = response.running.take() else {
            return Err(ApiError::bad(format!(
                "response '{id}' is {}; only a response in progress can be cancelled",
                response.object["status"].as_str().unwrap_or("finished")
            )));
        };
        response.object["status"] = json!("cancelled");
        (response.object.clone(), seq)
    };
    shared.abort(seq);
    Ok(Json(object))
}

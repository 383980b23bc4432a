//! The APIs a simulated engine serves besides completions and chat, over real
//! HTTP against one engine: OpenAI Responses, Anthropic Messages and vLLM's
//! pass-through endpoints, each streamed where the API streams, with cached
//! tokens in each API's usage fields and bad bodies answered in each API's
//! own error shape.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kvroute_sim::{CostModel, EngineConfig, Worker, WorkerConfig};
use serde_json::{Value, json};

/// One engine whose steps take a hundredth of their simulated time.
async fn engine() -> Worker {
    let engine = EngineConfig {
        cost: CostModel {
            speedup: 100.0,
            ..CostModel::default()
        },
        ..EngineConfig::default()
    };
    Worker::start(WorkerConfig::new(0, engine)).await.unwrap()
}

struct Http(Client<HttpConnector, Full<Bytes>>);

impl Http {
    fn new() -> Self {
        Http(Client::builder(TokioExecutor::new()).build(HttpConnector::new()))
    }

    async fn send(&self, method: &str, url: &str, body: &str) -> hyper::Response<Incoming> {
        let request = hyper::Request::builder()
            .method(method)
            .uri(url)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap();
        self.0.request(request).await.unwrap()
    }

    /// Status and body text.
    async fn text(&self, method: &str, url: &str, body: &str) -> (u16, String) {
        let response = self.send(method, url, body).await;
        let status = response.status().as_u16();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8(bytes.to_vec()).unwrap())
    }

    /// Status and JSON body.
    async fn json(&self, method: &str, url: &str, body: &Value) -> (u16, Value) {
        let (status, text) = self.text(method, url, &body.to_string()).await;
        let json = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        (status, json)
    }

    /// The SSE events of a streamed response: each event's name (if any) and data.
    async fn events(&self, url: &str, body: &Value) -> Vec<(Option<String>, String)> {
        let (status, text) = self.text("POST", url, &body.to_string()).await;
        assert_eq!(status, 200, "{text}");
        sse(&text)
    }
}

fn sse(text: &str) -> Vec<(Option<String>, String)> {
    text.split("\n\n")
        .filter(|block| !block.trim().is_empty())
        .map(|block| {
            let mut name = None;
            let mut data = String::new();
            for line in block.lines() {
                if let Some(value) = line.strip_prefix("event: ") {
                    name = Some(value.to_string());
                } else if let Some(value) = line.strip_prefix("data: ") {
                    data.push_str(value);
                }
            }
            (name, data)
        })
        .collect()
}

fn data(events: &[(Option<String>, String)]) -> Vec<Value> {
    events
        .iter()
        .map(|(_, data)| serde_json::from_str(data).unwrap())
        .collect()
}

/// A system prompt of many blocks, so that a follow-up's hit is plain.
fn instructions() -> String {
    "You answer questions about the quick brown fox, carefully and briefly. ".repeat(8)
}

#[tokio::test]
async fn responses_answer_with_the_response_object() {
    let worker = engine().await;
    let url = format!("{}/v1/responses", worker.base_url());
    let http = Http::new();
    let (status, body) = http
        .json(
            "POST",
            &url,
            &json!({"model": "sim-model", "input": "Hello there", "max_output_tokens": 5,
                    "metadata": {"k": "v"}}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "response");
    assert_eq!(body["status"], "completed");
    assert!(body["id"].as_str().unwrap().starts_with("resp_"), "{body}");
    assert_eq!(body["model"], "sim-model");
    assert_eq!(body["metadata"], json!({"k": "v"}));
    assert_eq!(body["output"][0]["type"], "message");
    assert_eq!(body["output"][0]["role"], "assistant");
    assert_eq!(body["output"][0]["content"][0]["type"], "output_text");
    let text = body["output"][0]["content"][0]["text"].as_str().unwrap();
    assert_eq!(text.split_whitespace().count(), 5, "{text}");
    assert_eq!(body["usage"]["output_tokens"], 5);
    assert_eq!(body["usage"]["input_tokens_details"]["cached_tokens"], 0);

    // Stored: GET returns it; DELETE forgets it.
    let one = format!("{url}/{}", body["id"].as_str().unwrap());
    let (status, got) = http.json("GET", &one, &Value::Null).await;
    assert_eq!((status, &got), (200, &body));
    let (status, deleted) = http.json("DELETE", &one, &Value::Null).await;
    assert_eq!(status, 200, "{deleted}");
    assert_eq!(deleted["deleted"], true);
    let (status, gone) = http.json("GET", &one, &Value::Null).await;
    assert_eq!(status, 404, "{gone}");
    assert_eq!(gone["error"]["type"], "NotFoundError");
    assert!(
        gone["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not found")
    );
    worker.shutdown().await;
}

#[tokio::test]
async fn responses_stream_the_responses_events() {
    let worker = engine().await;
    let url = format!("{}/v1/responses", worker.base_url());
    let events = Http::new()
        .events(
            &url,
            &json!({"model": "sim-model", "input": "Hi", "stream": true, "max_output_tokens": 3}),
        )
        .await;
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_deref().unwrap()).collect();
    assert_eq!(
        names,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    let data = data(&events);
    for (index, (event, name)) in data.iter().zip(&names).enumerate() {
        assert_eq!(event["type"], *name);
        assert_eq!(event["sequence_number"], index);
    }
    assert_eq!(data[0]["response"]["status"], "in_progress");
    let deltas: String = data[4..7]
        .iter()
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(data[7]["text"], deltas.as_str());
    let completed = &data[10]["response"];
    assert_eq!(completed["status"], "completed");
    assert_eq!(completed["id"], data[0]["response"]["id"]);
    assert_eq!(
        completed["output"][0]["content"][0]["text"],
        deltas.as_str()
    );
    assert_eq!(completed["usage"]["output_tokens"], 3);
    worker.shutdown().await;
}

#[tokio::test]
async fn a_follow_up_turn_continues_the_stored_conversation_from_cache() {
    let worker = engine().await;
    let url = format!("{}/v1/responses", worker.base_url());
    let http = Http::new();
    let tools = json!([{"type": "function", "name": "lookup", "description": "Look it up",
                        "parameters": {"type": "object", "properties": {}}}]);
    let (status, first) = http
        .json(
            "POST",
            &url,
            &json!({"model": "sim-model", "instructions": instructions(), "tools": tools,
                    "input": [{"role": "user", "content": [{"type": "input_text",
                                "text": "What does the fox jump over?"}]}]}),
        )
        .await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["usage"]["input_tokens_details"]["cached_tokens"], 0);
    let first_prompt = first["usage"]["input_tokens"].as_u64().unwrap();

    let (status, second) = http
        .json(
            "POST",
            &url,
            &json!({"model": "sim-model", "instructions": instructions(), "tools": tools,
                    "previous_response_id": first["id"], "input": "And then?"}),
        )
        .await;
    assert_eq!(status, 200, "{second}");
    assert_eq!(second["previous_response_id"], first["id"]);
    let second_prompt = second["usage"]["input_tokens"].as_u64().unwrap();
    let cached = second["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    // The whole first prompt's blocks, but for the block it ended in.
    assert!(second_prompt > first_prompt + 5, "{first} {second}");
    assert!(cached >= first_prompt / 16 * 16 - 16, "{first} {second}");

    // The same conversation sent whole as chat is the same prompt, from cache.
    let chat = json!({"model": "sim-model", "max_tokens": 1, "messages": [
        {"role": "system", "content": format!("{}\n\n# Tools\n\n{}", instructions(),
            tools[0])},
        {"role": "user", "content": "What does the fox jump over?"},
        {"role": "assistant", "content": first["output"][0]["content"][0]["text"]},
        {"role": "user", "content": "And then?"},
    ]});
    let (status, chat) = http
        .json(
            "POST",
            &format!("{}/v1/chat/completions", worker.base_url()),
            &chat,
        )
        .await;
    assert_eq!(status, 200, "{chat}");
    assert_eq!(chat["usage"]["prompt_tokens"], second_prompt);
    assert_eq!(
        chat["usage"]["prompt_tokens_details"]["cached_tokens"],
        second_prompt / 16 * 16
    );

    // store: false keeps nothing to continue from.
    let (_, unstored) = http
        .json(
            "POST",
            &url,
            &json!({"model": "sim-model", "input": "x", "store": false}),
        )
        .await;
    let (status, error) = http
        .json(
            "POST",
            &url,
            &json!({"model": "sim-model", "input": "y", "previous_response_id": unstored["id"]}),
        )
        .await;
    assert_eq!(status, 404, "{error}");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not found")
    );
    worker.shutdown().await;
}

#[tokio::test]
async fn a_response_in_progress_can_be_cancelled_once() {
    let engine = EngineConfig::default();
    let worker = Worker::start(WorkerConfig::new(0, engine)).await.unwrap();
    let url = format!("{}/v1/responses", worker.base_url());
    let http = Http::new();
    // At least 4 ms a step: 2000 tokens take 8 s unless cancelled.
    let body = json!({"model": "sim-model", "input": "Go on", "stream": true,
                      "max_output_tokens": 2000});
    let response = http.send("POST", &url, &body.to_string()).await;
    let mut body = response.into_body();
    let mut text = String::new();
    while !text.contains("\n\n") {
        let frame = body.frame().await.unwrap().unwrap();
        text.push_str(std::str::from_utf8(frame.data_ref().unwrap()).unwrap());
    }
    let created: Value = serde_json::from_str(&sse(&text)[0].1).unwrap();
    let id = created["response"]["id"].as_str().unwrap();
    let (status, cancelled) = http
        .json("POST", &format!("{url}/{id}/cancel"), &Value::Null)
        .await;
    assert_eq!(status, 200, "{cancelled}");
    assert_eq!(cancelled["status"], "cancelled");
    // The stream ends without completing.
    let rest = body.collect().await.unwrap().to_bytes();
    let rest = String::from_utf8(rest.to_vec()).unwrap();
    assert!(!rest.contains("response.completed"), "{rest}");
    let (_, got) = http.json("GET", &format!("{url}/{id}"), &Value::Null).await;
    assert_eq!(got["status"], "cancelled");
    let (status, again) = http
        .json("POST", &format!("{url}/{id}/cancel"), &Value::Null)
        .await;
    assert_eq!(status, 400, "{again}");
    assert!(
        again["error"]["message"]
            .as_str()
            .unwrap()
            .contains("cancelled")
    );
    worker.shutdown().await;
}

#[tokio::test]
async fn bad_responses_requests_get_openai_errors() {
    let worker = engine().await;
    let url = format!("{}/v1/responses", worker.base_url());
    let http = Http::new();
    let cases = [
        (json!({"input": "x"}), 400, "missing field `model`"),
        (json!({"model": "other", "input": "x"}), 404, "not served"),
        (json!({"model": "sim-model"}), 400, "missing field `input`"),
        (
            json!({"model": "sim-model", "input": 7}),
            400,
            "`input` must be",
        ),
        (
            json!({"model": "sim-model", "input": [{"type": "message", "role": "user", "content": 1}]}),
            400,
            "input item 0",
        ),
        (
            json!({"model": "sim-model", "input": "x", "max_output_tokens": 0}),
            400,
            "max_output_tokens",
        ),
        (
            json!({"model": "sim-model", "input": "x", "previous_response_id": "resp_nope"}),
            404,
            "resp_nope",
        ),
    ];
    for (body, status, message) in cases {
        let (got, error) = http.json("POST", &url, &body).await;
        assert_eq!(got, status, "{body}: {error}");
        assert_eq!(error["error"]["code"], status, "{error}");
        let text = error["error"]["message"].as_str().unwrap();
        assert!(text.contains(message), "{body}: {text}");
    }
    let (status, error) = http.text("POST", &url, "{not json").await;
    assert_eq!(status, 400, "{error}");
    assert!(error.contains("not valid JSON"), "{error}");
    for (method, path) in [("GET", ""), ("DELETE", ""), ("POST", "/cancel")] {
        let (status, error) = http
            .json(method, &format!("{url}/resp_nope{path}"), &Value::Null)
            .await;
        assert_eq!(status, 404, "{method} {path}: {error}");
    }
    worker.shutdown().await;
}

fn conversation() -> Value {
    json!([
        {"role": "user", "content": "What does the fox jump over?"},
    ])
}

#[tokio::test]
async fn messages_answer_with_the_message_and_report_cache_reads() {
    let worker = engine().await;
    let url = format!("{}/v1/messages", worker.base_url());
    let http = Http::new();
    let tools = json!([{"name": "lookup", "description": "Look it up",
                        "input_schema": {"type": "object"}}]);
    let first = json!({"model": "sim-model", "max_tokens": 4, "system": instructions(),
                       "tools": tools, "messages": conversation()});
    let (status, reply) = http.json("POST", &url, &first).await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["type"], "message");
    assert_eq!(reply["role"], "assistant");
    assert!(reply["id"].as_str().unwrap().starts_with("msg_"), "{reply}");
    assert_eq!(reply["stop_reason"], "end_turn");
    assert_eq!(reply["content"][0]["type"], "text");
    let text = reply["content"][0]["text"].as_str().unwrap();
    assert_eq!(text.split_whitespace().count(), 4, "{text}");
    assert_eq!(reply["usage"]["output_tokens"], 4);
    assert_eq!(reply["usage"]["cache_read_input_tokens"], 0);
    let first_prompt = reply["usage"]["input_tokens"].as_u64().unwrap();

    // count_tokens counts the prompt the request runs.
    let (status, count) = http
        .json("POST", &format!("{url}/count_tokens"), &first)
        .await;
    assert_eq!(status, 200, "{count}");
    assert_eq!(count, json!({"input_tokens": first_prompt}));

    // The follow-up turn, with the assistant's reply as content blocks and a
    // tool call and its result, reads the first turn from the cache.
    let mut turns = conversation().as_array().unwrap().clone();
    turns.push(
        json!({"role": "assistant", "content": [{"type": "text", "text": text},
        {"type": "tool_use", "id": "t1", "name": "lookup", "input": {"q": "fox"}}]}),
    );
    turns.push(json!({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": "a lazy dog"},
        {"type": "text", "text": "So?"}]}));
    let second = json!({"model": "sim-model", "max_tokens": 4, "system": instructions(),
                        "tools": tools, "messages": turns});
    let (status, reply) = http.json("POST", &url, &second).await;
    assert_eq!(status, 200, "{reply}");
    let cached = reply["usage"]["cache_read_input_tokens"].as_u64().unwrap();
    let uncached = reply["usage"]["input_tokens"].as_u64().unwrap();
    assert!(cached >= first_prompt / 16 * 16 - 16, "{reply}");
    let (_, count) = http
        .json("POST", &format!("{url}/count_tokens"), &second)
        .await;
    assert_eq!(count["input_tokens"], cached + uncached);
    worker.shutdown().await;
}

#[tokio::test]
async fn messages_stream_the_messages_events() {
    let worker = engine().await;
    let url = format!("{}/v1/messages", worker.base_url());
    let body = json!({"model": "sim-model", "max_tokens": 3, "stream": true,
                      "messages": conversation()});
    let events = Http::new().events(&url, &body).await;
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_deref().unwrap()).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "ping",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
    );
    let data = data(&events);
    for (event, name) in data.iter().zip(&names) {
        assert_eq!(event["type"], *name);
    }
    assert_eq!(data[0]["message"]["content"], json!([]));
    assert_eq!(data[0]["message"]["usage"]["output_tokens"], 0);
    assert!(
        data[0]["message"]["usage"]["input_tokens"]
            .as_u64()
            .unwrap()
            > 5
    );
    assert_eq!(data[3]["delta"]["type"], "text_delta");
    assert_eq!(data[7]["delta"]["stop_reason"], "end_turn");
    assert_eq!(data[7]["usage"]["output_tokens"], 3);
    worker.shutdown().await;
}

#[tokio::test]
async fn bad_messages_requests_get_anthropic_errors() {
    let worker = engine().await;
    let url = format!("{}/v1/messages", worker.base_url());
    let http = Http::new();
    let cases = [
        (
            json!({"max_tokens": 1, "messages": []}),
            400,
            "invalid_request_error",
            "`model`",
        ),
        (
            json!({"model": "other", "max_tokens": 1, "messages": []}),
            404,
            "not_found_error",
            "not served",
        ),
        (
            json!({"model": "sim-model", "messages": conversation()}),
            400,
            "invalid_request_error",
            "missing field `max_tokens`",
        ),
        (
            json!({"model": "sim-model", "max_tokens": 1}),
            400,
            "invalid_request_error",
            "`messages`",
        ),
        (
            json!({"model": "sim-model", "max_tokens": 1,
                   "messages": [{"role": "user", "content": [{"type": "video"}]}]}),
            400,
            "invalid_request_error",
            "messages.0.content.0",
        ),
    ];
    for (body, status, kind, message) in cases {
        for path in ["", "/count_tokens"] {
            if path == "/count_tokens" && message.contains("max_tokens") {
                continue;
            }
            let (got, error) = http.json("POST", &format!("{url}{path}"), &body).await;
            assert_eq!(got, status, "{path} {body}: {error}");
            assert_eq!(error["type"], "error", "{error}");
            assert_eq!(error["error"]["type"], kind, "{error}");
            let text = error["error"]["message"].as_str().unwrap();
            assert!(text.contains(message), "{path} {body}: {text}");
        }
    }
    let (status, error) = http.text("POST", &url, "[").await;
    assert_eq!(status, 400, "{error}");
    assert!(error.contains("\"invalid_request_error\""), "{error}");
    worker.shutdown().await;
}

#[tokio::test]
async fn embeddings_score_and_rerank_have_vllms_shapes() {
    let worker = engine().await;
    let base = worker.base_url().to_string();
    let http = Http::new();
    let (status, body) = http
        .json(
            "POST",
            &format!("{base}/v1/embeddings"),
            &json!({"model": "sim-model", "input": ["the quick fox", [1, 2, 3]], "dimensions": 8}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "list");
    assert_eq!(body["data"].as_array().unwrap().len(), 2);
    assert_eq!(body["data"][1]["index"], 1);
    assert_eq!(body["data"][0]["object"], "embedding");
    let vector: Vec<f32> = serde_json::from_value(body["data"][0]["embedding"].clone()).unwrap();
    assert_eq!(vector.len(), 8);
    let norm: f32 = vector.iter().map(|v| v * v).sum();
    assert!((norm - 1.0).abs() < 1e-4, "{vector:?}");
    // 3 tokens of text, 3 ids.
    assert_eq!(body["usage"]["prompt_tokens"], 6);
    // Deterministic, and base64 is the same floats.
    let (_, again) = http
        .json(
            "POST",
            &format!("{base}/v1/embeddings"),
            &json!({"model": "sim-model", "input": "the quick fox", "dimensions": 8,
                    "encoding_format": "base64"}),
        )
        .await;
    let encoded = again["data"][0]["embedding"].as_str().unwrap();
    use base64::Engine as _;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .unwrap();
    let decoded: Vec<f32> = bytes
        .chunks(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(decoded, vector);

    let (status, body) = http
        .json(
            "POST",
            &format!("{base}/v1/score"),
            &json!({"model": "sim-model", "text_1": "the quick brown fox",
                    "text_2": ["the quick brown fox", "an unrelated sentence entirely"]}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["data"][0]["object"], "score");
    let (same, other) = (
        body["data"][0]["score"].as_f64().unwrap(),
        body["data"][1]["score"].as_f64().unwrap(),
    );
    assert!((same - 1.0).abs() < 1e-6 && other < same, "{body}");

    let (status, body) = http
        .json(
            "POST",
            &format!("{base}/v1/rerank"),
            &json!({"model": "sim-model", "query": "brown fox", "top_n": 2,
                    "documents": ["a red car", "the brown fox", "blue sky", "fox"]}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let results = body["results"].as_array().unwrap();
    assert_eq!(results.len(), 2);
    assert_eq!(results[0]["index"], 1, "{body}");
    assert_eq!(results[0]["document"]["text"], "the brown fox");
    assert!(results[0]["relevance_score"].as_f64() >= results[1]["relevance_score"].as_f64());
    assert!(body["usage"]["total_tokens"].as_u64().unwrap() > 0);
    worker.shutdown().await;
}

#[tokio::test]
async fn tokenize_gives_the_prompts_tokens_and_detokenize_the_text() {
    let worker = engine().await;
    let base = worker.base_url().to_string();
    let http = Http::new();
    let (status, body) = http
        .json(
            "POST",
            &format!("{base}/tokenize"),
            &json!({"model": "sim-model", "prompt": "Hello world"}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["count"], 2);
    assert!(body["max_model_len"].as_u64().unwrap() > 0);
    let (status, text) = http
        .json(
            "POST",
            &format!("{base}/detokenize"),
            &json!({"tokens": body["tokens"]}),
        )
        .await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(text, json!({"prompt": "Hello world"}));

    // A chat's tokens are what the chat request is charged.
    let messages = json!([{"role": "user", "content": "Hello world"}]);
    let (_, chat_tokens) = http
        .json(
            "POST",
            &format!("{base}/tokenize"),
            &json!({"messages": messages}),
        )
        .await;
    let (_, chat) = http
        .json(
            "POST",
            &format!("{base}/v1/chat/completions"),
            &json!({"model": "sim-model", "messages": messages, "max_tokens": 1}),
        )
        .await;
    assert_eq!(chat_tokens["count"], chat["usage"]["prompt_tokens"]);
    let (_, rendered) = http
        .json(
            "POST",
            &format!("{base}/detokenize"),
            &json!({"tokens": chat_tokens["tokens"]}),
        )
        .await;
    assert_eq!(
        rendered["prompt"],
        "<|im_start|>user\nHello world<|im_end|>\n<|im_start|>assistant\n"
    );
    worker.shutdown().await;
}

#[tokio::test]
async fn bad_pass_through_requests_get_openai_errors() {
    let worker = engine().await;
    let base = worker.base_url().to_string();
    let http = Http::new();
    let many: Vec<String> = (0..2049).map(|i| i.to_string()).collect();
    let cases = [
        (
            "/v1/embeddings",
            json!({"model": "sim-model"}),
            400,
            "missing field `input`",
        ),
        (
            "/v1/embeddings",
            json!({"model": "sim-model", "input": "x", "dimensions": 0}),
            400,
            "`dimensions`",
        ),
        (
            "/v1/embeddings",
            json!({"model": "sim-model", "input": many}),
            400,
            "at most 2048",
        ),
        (
            "/v1/embeddings",
            json!({"model": "other", "input": "x"}),
            404,
            "not served",
        ),
        (
            "/v1/score",
            json!({"model": "sim-model", "text_1": ["a", "b"], "text_2": ["c", "d", "e"]}),
            400,
            "`text_1` has 2 texts",
        ),
        (
            "/v1/score",
            json!({"model": "sim-model", "text_1": "a"}),
            400,
            "`text_2`",
        ),
        (
            "/v1/rerank",
            json!({"model": "sim-model", "query": "q", "documents": "d"}),
            400,
            "`documents`",
        ),
        (
            "/tokenize",
            json!({"model": "sim-model"}),
            400,
            "either `prompt`",
        ),
        ("/tokenize", json!({"prompt": {}}), 400, "prompt must be"),
        ("/detokenize", json!({"tokens": [-1]}), 400, "token ids"),
        (
            "/detokenize",
            json!({"tokens": [4000000]}),
            400,
            "not in the vocabulary",
        ),
    ];
    for (path, body, status, message) in cases {
        let (got, error) = http.json("POST", &format!("{base}{path}"), &body).await;
        assert_eq!(got, status, "{path} {body}: {error}");
        let text = error["error"]["message"].as_str().unwrap();
        assert!(text.contains(message), "{path} {body}: {text}");
    }
    worker.shutdown().await;
}

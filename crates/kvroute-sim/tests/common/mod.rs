//! HTTP helpers of the simulator's tests.

#![allow(dead_code)] // each test file uses its share

use std::time::Duration;

use axum::body::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::StatusCode;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

async fn request(request: hyper::Request<Full<Bytes>>) -> (StatusCode, Bytes) {
    let client = Client::builder(TokioExecutor::new()).build_http();
    let response = client.request(request).await.unwrap();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, body)
}

/// POSTs `body` as JSON; the status and the JSON answer (null if not JSON).
pub async fn post(url: &str, body: &Value) -> (StatusCode, Value) {
    let (status, bytes) = request(
        hyper::Request::post(url)
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap(),
    )
    .await;
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

/// GETs `url`: the status and the body as text.
pub async fn get(url: &str) -> (StatusCode, String) {
    let (status, bytes) = request(hyper::Request::get(url).body(Full::default()).unwrap()).await;
    (status, String::from_utf8(bytes.to_vec()).unwrap())
}

/// Waits until `condition` holds, for at most 5 seconds.
pub async fn eventually(mut condition: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !condition() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the condition never held"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

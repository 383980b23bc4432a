//! The crate's one error type, and how each error looks to an HTTP client.
//!
//! HTTP errors follow OpenAI's shape, `{"error": {"message", "type", "code"}}`,
//! so clients written against OpenAI's API report them sensibly; on Anthropic's
//! Messages endpoints they follow Anthropic's (see [`RouterError::into_anthropic`]).

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    BadRequest(String),
    #[error("request body is larger than the limit of {0} bytes")]
    PayloadTooLarge(usize),
    #[error("{0}")]
    RequestTimeout(String),
    #[error("missing or wrong bearer token")]
    Unauthorized,
    #[error("{0}")]
    Forbidden(String),
    #[error("the model `{0}` does not exist")]
    UnknownModel(String),
    #[error("no worker with id {0}")]
    UnknownWorker(String),
    #[error("{message}")]
    Unavailable { message: String, retry_after_s: u64 },
    /// The wait queue would refuse the request: a 503 through the proxy, a
    /// 429 (shed) through the endpoint picker, as gateways expect.
    #[error("every worker is busy and the queue is full")]
    QueueFull,
    #[error("the router has {0} requests in flight already (limits.max_inflight_requests)")]
    Overloaded(usize),
    #[error("{0}")]
    Upstream(String),
    #[error("{0}")]
    UpstreamTimeout(String),
    #[error("{0}")]
    Tokenize(String),
}

impl RouterError {
    pub fn status(&self) -> StatusCode {
        match self {
            RouterError::Config(_) | RouterError::Io(_) => StatusCode::INTERNAL_SERVER_ERROR,
            RouterError::BadRequest(_) | RouterError::Tokenize(_) => StatusCode::BAD_REQUEST,
            RouterError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            RouterError::RequestTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            RouterError::Unauthorized => StatusCode::UNAUTHORIZED,
            RouterError::Forbidden(_) => StatusCode::FORBIDDEN,
            RouterError::UnknownModel(_) | RouterError::UnknownWorker(_) => StatusCode::NOT_FOUND,
            RouterError::Unavailable { .. }
            | RouterError::QueueFull
            | RouterError::Overloaded(_) => StatusCode::SERVICE_UNAVAILABLE,
            RouterError::Upstream(_) => StatusCode::BAD_GATEWAY,
            RouterError::UpstreamTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
        }
    }

    /// OpenAI's `type` and `code` for this error.
    fn kind(&self) -> (&'static str, &'static str) {
        match self {
            RouterError::Config(_) | RouterError::Io(_) => ("server_error", "internal_error"),
            RouterError::BadRequest(_) => ("invalid_request_error", "invalid_request"),
            RouterError::Tokenize(_) => ("invalid_request_error", "tokenization_failed"),
            RouterError::PayloadTooLarge(_) => ("invalid_request_error", "request_too_large"),
            RouterError::RequestTimeout(_) => ("invalid_request_error", "request_timeout"),
            RouterError::Unauthorized => ("authentication_error", "invalid_api_key"),
            RouterError::Forbidden(_) => ("permission_error", "forbidden"),
            RouterError::UnknownModel(_) => ("invalid_request_error", "model_not_found"),
            RouterError::UnknownWorker(_) => ("invalid_request_error", "worker_not_found"),
            RouterError::Unavailable { .. } | RouterError::QueueFull => {
                ("server_error", "no_worker_available")
            }
            RouterError::Overloaded(_) => ("server_error", "overloaded"),
            RouterError::Upstream(_) => ("server_error", "upstream_error"),
            RouterError::UpstreamTimeout(_) => ("server_error", "upstream_timeout"),
        }
    }

    /// The OpenAI-style body: `{"error": {"message", "type", "code"}}`.
    pub fn body(&self) -> serde_json::Value {
        let (kind, code) = self.kind();
        serde_json::json!({
            "error": { "message": self.to_string(), "type": kind, "code": code }
        })
    }
}

impl RouterError {
    /// Anthropic's status and `error.type` for this error: Anthropic's API
    /// answers 400, 401, 403, 404, 413, 429, 500 and 529 (overloaded), and
    /// its clients retry on 408, 429 and 5xx.
    fn anthropic_kind(&self) -> (StatusCode, &'static str) {
        let overloaded = StatusCode::from_u16(529).expect("529 is a status code");
        match self {
            RouterError::BadRequest(_)
            | RouterError::Tokenize(_)
            | RouterError::RequestTimeout(_) => (self.status(), "invalid_request_error"),
            RouterError::PayloadTooLarge(_) => (self.status(), "request_too_large"),
            RouterError::Unauthorized => (self.status(), "authentication_error"),
            RouterError::Forbidden(_) => (self.status(), "permission_error"),
            RouterError::UnknownModel(_) | RouterError::UnknownWorker(_) => {
                (self.status(), "not_found_error")
            }
            RouterError::Unavailable { .. }
            | RouterError::QueueFull
            | RouterError::Overloaded(_) => (overloaded, "overloaded_error"),
            RouterError::Config(_)
            | RouterError::Io(_)
            | RouterError::Upstream(_)
            | RouterError::UpstreamTimeout(_) => (StatusCode::INTERNAL_SERVER_ERROR, "api_error"),
        }
    }

    /// The error as Anthropic's API answers one:
    /// `{"type": "error", "error": {"type", "message"}}` with Anthropic's
    /// status, and the same headers as [`IntoResponse`] gives.
    pub fn into_anthropic(self) -> Response {
        let (status, kind) = self.anthropic_kind();
        let body = serde_json::json!({
            "type": "error",
            "error": { "type": kind, "message": self.to_string() }
        });
        let mut response = self.into_response();
        *response.status_mut() = status;
        *response.body_mut() = axum::body::Body::from(body.to_string());
        response.headers_mut().remove(header::CONTENT_LENGTH);
        response
    }
}

impl IntoResponse for RouterError {
    fn into_response(self) -> Response {
        let mut response = (self.status(), axum::Json(self.body())).into_response();
        match self {
            RouterError::Unavailable { retry_after_s, .. } => {
                response
                    .headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from(retry_after_s));
            }
            // Its body is left unread: the connection cannot carry another request.
            RouterError::RequestTimeout(_) => {
                response
                    .headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            RouterError::Overloaded(_) | RouterError::QueueFull => {
                response
                    .headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from(1));
            }
            // RFC 6750: every 401 says which scheme would do.
            RouterError::Unauthorized => {
                response.headers_mut().insert(
                    header::WWW_AUTHENTICATE,
                    HeaderValue::from_static("Bearer realm=\"kvroute\""),
                );
            }
            _ => {}
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;

    async fn anthropic(error: RouterError) -> (u16, serde_json::Value, Response) {
        let response = error.into_anthropic();
        let status = response.status().as_u16();
        let (parts, body) = response.into_parts();
        let body = body.collect().await.unwrap().to_bytes();
        let json = serde_json::from_slice(&body).unwrap();
        (
            status,
            json,
            Response::from_parts(parts, axum::body::Body::empty()),
        )
    }

    #[tokio::test]
    async fn anthropic_errors_have_anthropics_shape_and_status() {
        let (status, body, _) = anthropic(RouterError::BadRequest("no".into())).await;
        assert_eq!(status, 400);
        assert_eq!(
            body,
            serde_json::json!({"type": "error", "error": {"type": "invalid_request_error", "message": "no"}})
        );
        let (status, body, response) = anthropic(RouterError::QueueFull).await;
        assert_eq!(
            (status, &body["error"]["type"]),
            (529, &serde_json::json!("overloaded_error"))
        );
        assert!(response.headers().contains_key(header::RETRY_AFTER));
        let (status, body, response) = anthropic(RouterError::Unauthorized).await;
        assert_eq!(body["error"]["type"], "authentication_error");
        assert_eq!(status, 401);
        assert!(response.headers().contains_key(header::WWW_AUTHENTICATE));
        let (status, body, _) = anthropic(RouterError::Upstream("x".into())).await;
        assert_eq!(
            (status, body["error"]["type"].as_str()),
            (500, Some("api_error"))
        );
        let (status, body, _) = anthropic(RouterError::PayloadTooLarge(8)).await;
        assert_eq!(
            (status, body["error"]["type"].as_str()),
            (413, Some("request_too_large"))
        );
    }
}

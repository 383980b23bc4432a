//! The optional bearer token on gRPC ingest and the admin endpoints, so that
//! nobody else can poison the index or drain workers.

use http::HeaderValue;

/// Whether `header` carries `Bearer <token>`; always true when no token is configured.
pub fn bearer_ok(token: &str, header: Option<&HeaderValue>) -> bool {
    if token.is_empty() {
        return true;
    }
    let Some(given) = header
        .and_then(|h| h.to_str().ok())
        .and_then(|h| h.strip_prefix("Bearer "))
    else {
        return false;
    };
    constant_time_eq(given.as_bytes(), token.as_bytes())
}

/// Compares without an early exit, so response timing does not leak the token.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A tonic interceptor enforcing the token on every gRPC call.
pub fn grpc_interceptor(
    token: String,
) -> impl Fn(tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> + Clone {
    move |request: tonic::Request<()>| {
        let header = request
            .metadata()
            .get("authorization")
            .and_then(|v| HeaderValue::from_bytes(v.as_bytes()).ok());
        if bearer_ok(&token, header.as_ref()) {
            Ok(request)
        } else {
            Err(tonic::Status::unauthenticated(
                "missing or wrong bearer token",
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_must_match_exactly() {
        let ok = HeaderValue::from_static("Bearer s3cret");
        assert!(bearer_ok("s3cret", Some(&ok)));
        assert!(bearer_ok("", None));
        assert!(!bearer_ok("s3cret", None));
        assert!(!bearer_ok(
            "s3cret",
            Some(&HeaderValue::from_static("Bearer s3cre"))
        ));
        assert!(!bearer_ok(
            "s3cret",
            Some(&HeaderValue::from_static("s3cret"))
        ));
    }
}

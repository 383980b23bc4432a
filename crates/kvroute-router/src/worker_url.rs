//! Workers' base URLs, checked once where they enter: the config file's static
//! workers and gRPC registrations. A module of its own so that the config and the
//! registry both use it without one importing the other.

/// Checks that a base URL is an absolute http or https URL; returns it without a trailing slash.
pub fn parse_base_url(url: &str) -> Result<String, String> {
    let uri: http::Uri = url
        .parse()
        .map_err(|e| format!("base_url {url:?} is not a URL: {e}"))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.authority().is_none() {
        return Err(format!(
            "base_url {url:?} must be an absolute http:// or https:// URL"
        ));
    }
    Ok(url.trim_end_matches('/').to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls_are_absolute_http_or_https_without_a_trailing_slash() {
        assert_eq!(
            parse_base_url("http://10.0.0.5:8000/").unwrap(),
            "http://10.0.0.5:8000"
        );
        assert_eq!(
            parse_base_url("http://w:8000/v1").unwrap(),
            "http://w:8000/v1"
        );
        assert_eq!(parse_base_url("https://w:8443/").unwrap(), "https://w:8443");
        for bad in ["10.0.0.5:8000", "/v1", "ftp://w:21", "http//w", ""] {
            let err = parse_base_url(bad).unwrap_err();
            assert!(err.contains("base_url"), "{bad:?}: {err}");
        }
    }
}

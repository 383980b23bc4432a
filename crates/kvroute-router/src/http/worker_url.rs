//! Workers' base URLs, checked once where they enter: the config file's static
//! workers and gRPC registrations. A module of its own so that the config and the
//! registry both use it without one importing the other.
//!
//! The router sends clients' prompts and its health checks to a base URL, so a
//! worker token must not be able to point it at the host's own metadata service
//! (cloud credentials), at link-local or unspecified addresses, or smuggle a
//! user:password, query or fragment into it. Addresses the rules refuse are
//! accepted only when `limits.allowed_base_url_addresses` names them. Errors
//! name the rule and never echo the URL, which may hold a secret.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Cloud metadata services: AWS, GCP and Azure (169.254.169.254, link-local
/// anyway), AWS over IPv6, Alibaba Cloud.
const METADATA: [IpAddr; 3] = [
    IpAddr::V4(Ipv4Addr::new(169, 254, 169, 254)),
    IpAddr::V6(Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254)),
    IpAddr::V4(Ipv4Addr::new(100, 100, 100, 200)),
];

/// Checks that a base URL is an absolute http or https URL without userinfo,
/// query or fragment, whose host is not an address the rules refuse (unless in
/// `allowed`); returns it without a trailing slash.
pub fn parse_base_url(url: &str, allowed: &[IpAddr]) -> Result<String, String> {
    // http::Uri would take these as part of the path or authority.
    if url.contains('#') {
        return Err("base_url must not have a #fragment".into());
    }
    let uri: http::Uri = url
        .parse()
        .map_err(|e| format!("base_url is not a URL: {e}"))?;
    let authority = match (uri.scheme_str(), uri.authority()) {
        (Some("http" | "https"), Some(authority)) => authority,
        _ => return Err("base_url must be an absolute http:// or https:// URL".into()),
    };
    if authority.as_str().contains('@') {
        return Err("base_url must not hold a user or password (user:password@)".into());
    }
    if uri.query().is_some() {
        return Err("base_url must not have a ?query".into());
    }
    let host = authority.host();
    let ip = match host.trim_start_matches('[').trim_end_matches(']').parse() {
        Ok(ip) => ip,
        // A host whose last label is a number is an address in another
        // notation (`0`, `2852039166`, `0xa9fea9fe`), which the resolver takes
        // and these rules could not check.
        Err(_) if host.rsplit('.').next().is_some_and(is_numeric_label) => {
            return Err(format!(
                "base_url host {host:?} is a number but not a dotted IPv4 address"
            ));
        }
        Err(_) => return Ok(url.trim_end_matches('/').to_string()),
    };
    if let Some(rule) = refused_address(ip)
        && !allowed.contains(&ip)
    {
        return Err(format!(
            "base_url host {ip} is {rule}; list it in limits.allowed_base_url_addresses to allow it"
        ));
    }
    Ok(url.trim_end_matches('/').to_string())
}

fn is_numeric_label(label: &str) -> bool {
    let label = label.to_ascii_lowercase();
    let hex = label.strip_prefix("0x");
    match hex {
        Some(digits) => digits.chars().all(|c| c.is_ascii_hexdigit()),
        None => !label.is_empty() && label.chars().all(|c| c.is_ascii_digit()),
    }
}

/// Why `ip` may not be a worker's address, if it may not.
fn refused_address(ip: IpAddr) -> Option<&'static str> {
    let ip = ip.to_canonical();
    if METADATA.contains(&ip) {
        return Some("a cloud metadata address");
    }
    let (unspecified, link_local) = match ip {
        IpAddr::V4(v4) => (v4.is_unspecified(), v4.is_link_local()),
        IpAddr::V6(v6) => (
            v6.is_unspecified(),
            v6.segments()[0] & 0xffc0 == 0xfe80, // fe80::/10
        ),
    };
    if unspecified {
        Some("the unspecified address")
    } else if link_local {
        Some("a link-local address")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls_are_absolute_http_or_https_without_a_trailing_slash() {
        assert_eq!(
            parse_base_url("http://10.0.0.5:8000/", &[]).unwrap(),
            "http://10.0.0.5:8000"
        );
        assert_eq!(
            parse_base_url("http://w:8000/v1", &[]).unwrap(),
            "http://w:8000/v1"
        );
        assert_eq!(
            parse_base_url("https://w:8443/", &[]).unwrap(),
            "https://w:8443"
        );
        for bad in ["10.0.0.5:8000", "/v1", "ftp://w:21", "http//w", ""] {
            let err = parse_base_url(bad, &[]).unwrap_err();
            assert!(err.contains("base_url"), "{bad:?}: {err}");
        }
    }

    #[test]
    fn userinfo_queries_fragments_and_special_addresses_are_refused_naming_the_rule() {
        for (bad, rule) in [
            ("http://user:s3cret@10.0.0.5:8000", "user or password"),
            ("http://10.0.0.5:8000/v1?key=s3cret", "?query"),
            ("http://10.0.0.5:8000/#s3cret", "#fragment"),
            ("http://169.254.169.254/latest", "metadata"),
            ("http://[fd00:ec2::254]", "metadata"),
            ("http://100.100.100.200", "metadata"),
            ("http://169.254.10.1:8000", "link-local"),
            ("http://[fe80::1]:8000", "link-local"),
            ("http://[::ffff:169.254.169.254]", "metadata"),
            ("http://0.0.0.0:8000", "unspecified"),
            ("http://[::]:8000", "unspecified"),
            ("http://0:8000", "a number"),
            ("http://2852039166", "a number"),
            ("http://0xa9fea9fe", "a number"),
        ] {
            let err = parse_base_url(bad, &[]).unwrap_err();
            assert!(err.contains(rule), "{bad}: {err}");
            assert!(!err.contains("s3cret"), "{bad}: {err}");
        }
        let allowed = ["169.254.10.1".parse().unwrap()];
        assert!(parse_base_url("http://169.254.10.1:8000", &allowed).is_ok());
        assert!(parse_base_url("http://169.254.10.2:8000", &allowed).is_err());
        assert!(parse_base_url("http://[::1]:8000", &[]).is_ok());
        assert!(parse_base_url("http://worker-0.svc:8000", &[]).is_ok());
    }
}

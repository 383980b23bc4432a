//! Who may do what. Workers stream KV events (the gRPC `Stream`) with a worker
//! token, optionally bound to the worker ids it may register; operators use the
//! admin endpoints (`/workers...`), the `Route` RPC (it writes predictions) and
//! the routing details (pinning with `x-kvroute-worker`, worker URLs and prefix
//! overlaps in `/v1/route`) with the admin token. Separate credentials, so that a leaked
//! worker token cannot drain the fleet, and a gateway cannot pose as a worker.
//!
//! A role without a configured token is open. That is only allowed on loopback,
//! or when the operator says `insecure` ([`check_exposure`]): on any other
//! address an open ingest lets anyone register a worker at their own URL,
//! claim every prefix, and receive the clients' prompts.

use http::HeaderMap;
use subtle::ConstantTimeEq;
use tonic::Status;
use tonic::metadata::MetadataMap;

use crate::config::{Config, Secret};
use crate::error::RouterError;

/// The tokens of a running router, resolved from the config once.
pub struct Credentials {
    /// Tokens accepted on the `Stream` RPC, each with the ids it may register
    /// (None: any id).
    workers: Vec<(Secret, Option<Vec<u64>>)>,
    admin: Secret,
    clients_may_pin: bool,
    clients_see_overlaps: bool,
}

/// What a worker token allows a stream to register.
#[derive(Debug)]
pub struct WorkerGrant {
    /// Which of the configured worker tokens it is (0 without tokens), for the
    /// per-token limits.
    pub token: usize,
    /// The ids it may register; `None`: any.
    ids: Option<Vec<u64>>,
}

impl WorkerGrant {
    /// PERMISSION_DENIED for an id this token may not register.
    pub fn permits(&self, worker_id: u64) -> Result<(), Status> {
        match &self.ids {
            Some(ids) if !ids.contains(&worker_id) => Err(Status::permission_denied(format!(
                "this worker token may register worker ids {ids:?}, not {worker_id}"
            ))),
            _ => Ok(()),
        }
    }
}

impl Credentials {
    pub fn new(config: &Config) -> Self {
        let mut workers = Vec::new();
        if !config.worker_token().is_empty() {
            workers.push((config.worker_token().clone(), None));
        }
        for bound in &config.auth.bound_worker_tokens {
            workers.push((bound.token.clone(), Some(bound.worker_ids.clone())));
        }
        Self {
            workers,
            admin: config.admin_token().clone(),
            clients_may_pin: config.auth.clients_may_pin,
            clients_see_overlaps: config.auth.clients_see_overlaps,
        }
    }

    /// How many worker tokens the per-token limits tell apart (1 without tokens).
    pub fn worker_tokens(&self) -> usize {
        self.workers.len().max(1)
    }

    /// What the bearer token in `metadata` lets a `Stream` register.
    pub fn worker(&self, metadata: &MetadataMap) -> Result<WorkerGrant, Status> {
        if self.workers.is_empty() {
            return Ok(WorkerGrant {
                token: 0,
                ids: None,
            });
        }
        let given = bearer(metadata.get("authorization").map(|v| v.as_bytes()));
        // Every token is compared, so timing tells nothing about which matched.
        let mut grant = None;
        for (token, (secret, ids)) in self.workers.iter().enumerate() {
            if given.is_some_and(|g| token_eq(secret, g)) {
                grant = Some(WorkerGrant {
                    token,
                    ids: ids.clone(),
                });
            }
        }
        grant.ok_or_else(|| Status::unauthenticated("missing or wrong worker token"))
    }

    /// Whether the bearer token in `metadata` is the admin token (for `Route`).
    pub fn admin_grpc(&self, metadata: &MetadataMap) -> Result<(), Status> {
        if self.is_admin(metadata.get("authorization").map(|v| v.as_bytes())) {
            Ok(())
        } else {
            Err(Status::unauthenticated("missing or wrong admin token"))
        }
    }

    /// Whether an HTTP request carries the admin token (or none is configured).
    pub fn admin_http(&self, headers: &HeaderMap) -> bool {
        self.is_admin(
            headers
                .get(http::header::AUTHORIZATION)
                .map(|v| v.as_bytes()),
        )
    }

    /// Whether an HTTP request may pin a worker and see worker URLs.
    pub fn may_see_workers(&self, headers: &HeaderMap) -> bool {
        self.clients_may_pin || self.admin_http(headers)
    }

    /// Whether an HTTP request may see prefix overlaps in `/v1/route`: they
    /// tell block by block what the caches hold, other tenants' prompts included.
    pub fn may_see_overlaps(&self, headers: &HeaderMap) -> bool {
        self.clients_see_overlaps || self.admin_http(headers)
    }

    fn is_admin(&self, header: Option<&[u8]>) -> bool {
        self.admin.is_empty() || bearer(header).is_some_and(|given| token_eq(&self.admin, given))
    }
}

/// The token of an `Authorization: Bearer <token>` value; the scheme is
/// case-insensitive (RFC 7235).
fn bearer(header: Option<&[u8]>) -> Option<&[u8]> {
    let header = header?;
    let space = header.iter().position(|&b| b == b' ')?;
    let (scheme, rest) = header.split_at(space);
    if !scheme.eq_ignore_ascii_case(b"bearer") {
        return None;
    }
    let token = rest.trim_ascii();
    (!token.is_empty()).then_some(token)
}

/// Constant-time in the token's content, so response timing does not leak it.
fn token_eq(token: &Secret, given: &[u8]) -> bool {
    token.expose().as_bytes().ct_eq(given).into()
}

/// Refuses a listener on a non-loopback address whose role has no token, unless
/// `auth.insecure`; insecure mode is logged at every start.
pub fn check_exposure(config: &Config) -> Result<(), RouterError> {
    if config.auth.insecure {
        tracing::warn!(
            "insecure mode: tokens are not required on non-loopback addresses; \
             anyone who reaches the gRPC port can register workers"
        );
        return Ok(());
    }
    let no_worker_token =
        config.worker_token().is_empty() && config.auth.bound_worker_tokens.is_empty();
    let no_admin_token = config.admin_token().is_empty();
    let mut missing = Vec::new();
    if !config.grpc_addr.ip().is_loopback() {
        if no_worker_token {
            missing.push(format!(
                "auth.worker_token (gRPC ingest on {})",
                config.grpc_addr
            ));
        }
        if no_admin_token {
            missing.push(format!(
                "auth.admin_token (the Route RPC on {})",
                config.grpc_addr
            ));
        }
    }
    if !config.http_addr.ip().is_loopback() && no_admin_token {
        missing.push(format!(
            "auth.admin_token (admin endpoints on {})",
            config.http_addr
        ));
    }
    if missing.is_empty() {
        return Ok(());
    }
    Err(RouterError::Config(format!(
        "refusing to serve without a token on a non-loopback address: set {}, \
         or bind to loopback, or pass --insecure (auth.insecure = true) to allow it",
        missing.join(" and ")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::BoundWorkerToken;

    fn credentials(auth: impl FnOnce(&mut Config)) -> Credentials {
        let mut config = Config::default();
        auth(&mut config);
        Credentials::new(&config)
    }

    fn metadata(authorization: Option<&str>) -> MetadataMap {
        let mut map = MetadataMap::new();
        if let Some(value) = authorization {
            map.insert("authorization", value.parse().unwrap());
        }
        map
    }

    fn headers(authorization: &str) -> HeaderMap {
        let mut map = HeaderMap::new();
        map.insert(http::header::AUTHORIZATION, authorization.parse().unwrap());
        map
    }

    #[test]
    fn the_bearer_scheme_is_case_insensitive_and_the_token_exact() {
        let c = credentials(|c| c.auth.admin_token = Secret::new("s3cret"));
        for ok in ["Bearer s3cret", "bearer s3cret", "BEARER  s3cret"] {
            assert!(c.admin_http(&headers(ok)), "{ok}");
        }
        for wrong in [
            "Bearer s3cre",
            "Bearer s3cret2",
            "s3cret",
            "Basic s3cret",
            "Bearer",
        ] {
            assert!(!c.admin_http(&headers(wrong)), "{wrong}");
        }
        assert!(!c.admin_http(&HeaderMap::new()));
        assert!(credentials(|_| {}).admin_http(&HeaderMap::new()));
    }

    #[test]
    fn worker_and_admin_tokens_are_separate_credentials() {
        let c = credentials(|c| {
            c.auth.worker_token = Secret::new("w");
            c.auth.admin_token = Secret::new("a");
        });
        let grant = c.worker(&metadata(Some("Bearer w"))).unwrap();
        assert!(grant.ids.is_none());
        for wrong in [None, Some("Bearer a")] {
            let status = c.worker(&metadata(wrong)).unwrap_err();
            assert_eq!(status.code(), tonic::Code::Unauthenticated);
        }
        assert!(c.admin_grpc(&metadata(Some("bearer a"))).is_ok());
        let status = c.admin_grpc(&metadata(Some("Bearer w"))).unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unauthenticated);
        assert!(!c.admin_http(&headers("Bearer w")));
    }

    #[test]
    fn the_deprecated_auth_token_sets_both() {
        let c = credentials(|c| c.auth_token = Secret::new("old"));
        assert!(c.worker(&metadata(Some("Bearer old"))).is_ok());
        assert!(c.admin_http(&headers("Bearer old")));
        assert!(!c.admin_http(&HeaderMap::new()));
    }

    #[test]
    fn a_bound_token_registers_only_its_ids() {
        let c = credentials(|c| {
            c.auth.worker_token = Secret::new("fleet");
            c.auth.bound_worker_tokens = vec![BoundWorkerToken {
                token: Secret::new("w7"),
                worker_ids: vec![7, 8],
            }];
        });
        let grant = c.worker(&metadata(Some("Bearer w7"))).unwrap();
        assert!(grant.permits(7).is_ok() && grant.permits(8).is_ok());
        let status = grant.permits(9).unwrap_err();
        assert_eq!(status.code(), tonic::Code::PermissionDenied);
        assert!(status.message().contains("not 9"), "{}", status.message());
        let fleet = c.worker(&metadata(Some("Bearer fleet"))).unwrap();
        assert!(fleet.permits(9).is_ok());
        assert_ne!(
            fleet.token, grant.token,
            "told apart by the per-token limits"
        );
    }

    #[test]
    fn no_token_on_a_public_address_is_refused_unless_insecure() {
        let mut config = Config::default();
        let err = check_exposure(&config).unwrap_err().to_string();
        assert!(err.contains("auth.worker_token"), "{err}");
        assert!(err.contains("auth.admin_token"), "{err}");
        assert!(err.contains("--insecure"), "{err}");
        config.http_addr = ([127, 0, 0, 1], 0).into();
        config.grpc_addr = ([127, 0, 0, 1], 0).into();
        assert!(check_exposure(&config).is_ok(), "loopback needs no token");
        config.grpc_addr = ([0, 0, 0, 0], 0).into();
        config.auth.worker_token = Secret::new("w");
        let err = check_exposure(&config).unwrap_err().to_string();
        assert!(err.contains("Route RPC"), "{err}");
        config.auth.admin_token = Secret::new("a");
        assert!(check_exposure(&config).is_ok());
        let mut open = Config::default();
        open.auth.insecure = true;
        assert!(check_exposure(&open).is_ok());
    }
}

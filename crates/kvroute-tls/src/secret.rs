//! Credentials from configuration and command lines: bearer tokens. Their
//! `Debug` and `Serialize` forms are redacted, so printing or logging a config
//! that holds one never shows it. Here, beside TLS, because the router, the
//! simulated engines and the bridge all hold one.

use serde::{Deserialize, Serialize};

/// A credential. Read it with [`Secret::expose`], only to compare or send it.
#[derive(Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The value itself, for comparing or sending; never for printing.
    pub fn expose(&self) -> &str {
        &self.0
    }

    fn redacted(&self) -> &'static str {
        if self.0.is_empty() { "" } else { "<redacted>" }
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.redacted())
    }
}

impl Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.redacted())
    }
}

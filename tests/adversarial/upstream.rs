//! Attacks through upstream: see tests/adversarial.rs.

#[allow(unused_imports)]
use crate::common::*;

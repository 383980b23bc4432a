//! Attacks through trust: see tests/adversarial.rs.

#[allow(unused_imports)]
use crate::common::*;

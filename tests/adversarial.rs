//! The adversarial suite: each attack a hostile client or worker could make on
//! the router, reproduced against real `kvroute serve` (and `kvroute sim`)
//! processes over loopback, with a real gRPC client where the attack comes
//! over the wire. Each test names the attack it reproduces and asserts the
//! router's defence; docs/operator/security.md holds the threat model.
//! One module per front the attacker comes through.

mod common;

#[path = "adversarial/fairness.rs"]
mod fairness;
#[path = "adversarial/ingest.rs"]
mod ingest;
#[path = "adversarial/peers.rs"]
mod peers;
#[path = "adversarial/tokenizer.rs"]
mod tokenizer;
#[path = "adversarial/trust.rs"]
mod trust;
#[path = "adversarial/upstream.rs"]
mod upstream;

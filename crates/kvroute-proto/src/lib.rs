//! kvroute-proto: the gRPC protocol between workers and the router.
//!
//! Generated from `proto/kvroute.proto` at build time; see that file for what
//! each message means. Workers (the simulator, the engine bridges) use the
//! client, the router service the server.

#![allow(clippy::all)]

tonic::include_proto!("kvroute.v1");

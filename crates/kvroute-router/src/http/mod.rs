//! The HTTP side: the OpenAI-compatible API and its admin endpoints ([`api`]),
//! serving its connections ([`serve`]), the proxy policy for one request
//! ([`proxy`]) and talking to workers' HTTP servers ([`upstream`]) at the base
//! URLs [`worker_url`] checks; [`responses`] keeps an OpenAI Responses
//! conversation on the worker that stores it.

pub mod api;
pub mod proxy;
pub mod responses;
pub mod serve;
pub mod upstream;
pub mod worker_url;

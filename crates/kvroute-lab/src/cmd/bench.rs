//! `kvroute-lab bench ...`: workloads that measure kvroute's parts, each printing its
//! results as JSON. Speed and memory goals live here, not in timed tests.

mod cpu_time;
mod e2e;
mod epp;
mod fixture;
mod index;
mod proxy;
mod router;
mod saturation;
mod service;
mod soak;
mod tokenize;

use clap::{Args, Subcommand};

#[derive(Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    target: BenchTarget,
}

// Parsed once per run: the size of its largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum BenchTarget {
    /// Replay a trace-derived timeline of KV events and lookups against the index.
    Index(index::IndexBenchArgs),
    /// Routing decision latency, routing throughput with tokenization, proxy overhead.
    Router(router::BenchRouterArgs),
    /// The proxy hop beside nginx's: throughput lost and proxy CPU per request and per streamed chunk.
    Proxy(proxy::BenchProxyArgs),
    /// Replay a trace through the router and a simulated fleet under several policies.
    E2e(e2e::E2eArgs),
    /// kvroute as a real Envoy's endpoint picker, beside Envoy's round robin
    /// and kvroute's own proxy: decisions per CPU-second, TTFT, hit rate.
    Epp(epp::EppArgs),
    /// The router process and a simulated fleet under a steady replay with churn
    /// (restarts, leaves, joins): the router's memory, descriptors and tasks at
    /// start and end, and failed requests.
    Soak(soak::SoakArgs),
    /// One router process at fleet scale: thousands of streamed workers, about
    /// a million indexed blocks, requests routed at a fixed rate; its memory,
    /// CPU per request and event-apply lag.
    Service(service::ServiceArgs),
    /// The router process of `bench router`'s separated proxy measurement.
    #[command(hide = true)]
    RouterProxy(router::RouterProxyArgs),
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    match args.target {
        BenchTarget::Index(args) => index::run(args),
        BenchTarget::Router(args) => router::run(args),
        BenchTarget::Proxy(args) => proxy::run(args),
        BenchTarget::E2e(args) => e2e::run(args),
        BenchTarget::Epp(args) => epp::run(args),
        BenchTarget::Soak(args) => soak::run(args),
        BenchTarget::Service(args) => service::run(args),
        BenchTarget::RouterProxy(args) => router::router_proxy(args),
    }
}

//! The engines' options as command-line flags, for the binaries that start
//! simulated engines: `kvroute sim` and `kvroute-lab bench e2e`.

use std::time::Duration;

use clap::Args;
use kvroute_cache::PolicyKind;

use crate::{CostModel, EngineConfig, EngineKind, PdConfig, PdConvention, Persona, Role, SimError};

/// Engine options shared by `kvroute sim` and `kvroute-lab bench e2e`.
#[derive(Args, Clone, Debug)]
pub struct EngineArgs {
    /// KV blocks per engine.
    #[arg(long, default_value_t = 8192)]
    pub kv_blocks: usize,
    /// Tokens per KV block; must match the router's.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Most requests in one engine's running batch.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Most tokens (prefill chunks plus decodes) in one iteration.
    #[arg(long, default_value_t = 8192)]
    pub max_num_batched_tokens: usize,
    /// Eviction policy of the cached blocks: lru, lfu, fifo, s3fifo, arc,
    /// predictive or qos. `bench e2e` takes several, comma-separated, and runs each.
    #[arg(long, value_delimiter = ',', default_value = "lru")]
    pub eviction: Vec<PolicyKind>,
    /// Whose prefix cache the engines imitate: vllm (finished requests give
    /// their blocks back tail first, --eviction picks victims) or sglang (a
    /// radix tree: the least recently used unlocked leaf goes first; lru only).
    #[arg(long = "engine", default_value = "vllm")]
    pub engine_kind: EngineKind,
    /// Divides every simulated time (1: real time).
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// Blocks of a per-engine host (CPU) tier, LRU: blocks the GPU pool evicts
    /// are copied there and loaded back instead of prefilled, announced to the
    /// router as the offload tier. 0: no host tier.
    #[arg(long, default_value_t = 0)]
    pub offload_blocks: usize,
}

impl EngineArgs {
    pub fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            kv_blocks: self.kv_blocks,
            block_size: self.block_size,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            eviction: self.eviction.first().copied().unwrap_or(PolicyKind::Lru),
            kind: self.engine_kind,
            cost: CostModel {
                speedup: self.speedup,
                ..CostModel::default()
            },
            offload_blocks: self.offload_blocks,
        }
    }
}

/// Persona and prefill/decode options shared by `kvroute sim` and `kvroute-lab bench e2e`.
#[derive(Args, Clone, Debug)]
pub struct PdArgs {
    /// Whose HTTP surface the engines show: vllm (/version, vllm:* metrics) or
    /// sglang (/server_info, /get_load, sglang:* metrics).
    #[arg(long, default_value = "vllm")]
    pub persona: Persona,
    /// The engines' part in prefill/decode disaggregation: aggregated, prefill or decode.
    #[arg(long, default_value = "aggregated")]
    pub role: Role,
    /// How prefill hands KV to decode: sglang (bootstrap room) or vllm
    /// (kv_transfer_params). Default: the persona's.
    #[arg(long)]
    pub pd_convention: Option<PdConvention>,
    /// Port of the side channel prefill engines serve for decode engines to
    /// take KV from (SGLang's bootstrap server, vLLM's remote_port); engine i
    /// uses P+i. 0: any free ports.
    #[arg(long, default_value_t = 0)]
    pub bootstrap_port: u16,
    /// Bandwidth of the KV transfer between prefill and decode engines, in
    /// gigabits per second.
    #[arg(long, default_value_t = 100.0)]
    pub kv_transfer_gbps: f64,
    /// Seconds a finished prefill keeps its blocks for a decode that has not
    /// taken them, before freeing them (counted as lease-expired blocks).
    #[arg(long, default_value_t = 480.0)]
    pub kv_lease_timeout_secs: f64,
    /// Seconds an SGLang-convention decode waits for its prefill before failing.
    #[arg(long, default_value_t = 300.0)]
    pub bootstrap_timeout_secs: f64,
}

impl PdArgs {
    /// The P/D configuration of an engine of `role`.
    pub fn pd_config(&self, role: Role) -> Result<PdConfig, SimError> {
        if !(self.kv_transfer_gbps > 0.0 && self.kv_transfer_gbps.is_finite()) {
            return Err(SimError::Config(format!(
                "--kv-transfer-gbps must be a positive number, got {}",
                self.kv_transfer_gbps
            )));
        }
        let seconds = |flag: &str, value: f64| {
            Duration::try_from_secs_f64(value)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or_else(|| {
                    SimError::Config(format!("--{flag} must be a positive number, got {value}"))
                })
        };
        Ok(PdConfig {
            role,
            convention: self.pd_convention.unwrap_or(match self.persona {
                Persona::Vllm => PdConvention::Vllm,
                Persona::Sglang => PdConvention::Sglang,
            }),
            bootstrap_port: self.bootstrap_port,
            kv_transfer_gbps: self.kv_transfer_gbps,
            lease_timeout: seconds("kv-lease-timeout-secs", self.kv_lease_timeout_secs)?,
            bootstrap_timeout: seconds("bootstrap-timeout-secs", self.bootstrap_timeout_secs)?,
        })
    }
}

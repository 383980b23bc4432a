//! The cost model: how long one engine iteration takes.
//!
//! An iteration runs one forward pass over a batch that mixes prefill chunks and
//! decode steps (continuous batching with chunked prefill, as vLLM v1 does). Its
//! time, before `--speedup` divides it, is
//!
//! ```text
//! step = step_overhead
//!      + prefill_per_token × prefill tokens actually computed
//!      + decode_per_seq    × decoding sequences
//!      + attention_per_kv_token × KV tokens the decoding sequences attend to
//!      + offload_load_per_token × tokens loaded from the host tier
//! ```
//!
//! - Cached prefix tokens are never computed, so they cost nothing: this is what
//!   makes routing to the worker that holds a prefix pay off.
//! - Decode time grows with the batch (per-sequence work) and with KV usage
//!   (attention reads every cached token of every decoding sequence).
//! - Prefill attention's quadratic term is left out: it is small next to the
//!   linear matmul cost at the prompt lengths of the bundled traces.
//!
//! - A block loaded from the host tier (`--offload-blocks`) is copied over PCIe
//!   instead of computed. Its default cost is a tenth of prefill's: an 8B
//!   model's KV is ~128 KiB per token (32 layers × K and V × 8 heads × 128 ×
//!   2 bytes), which PCIe 4.0 x16 (~25 GB/s in practice) moves in ~5 µs,
//!   against ~50 µs of prefill compute; PCIe 5.0 halves that. Cheap next to a
//!   prefill, but not free.
//!
//! - A disaggregated decode receives a prefill engine's blocks over the
//!   network instead of computing them: `blocks × block bytes ÷ bandwidth`
//!   (`--kv-transfer-gbps`), block bytes being the block size times the same
//!   128 KiB per token. Paid by the decode request before it is queued, not
//!   by the batch: the engines move KV beside the forward pass.
//!
//! The defaults approximate an 8B-parameter model on one H100-class GPU:
//! about 20,000 prefill tokens/s, a 25-sequence decode batch at 8k context in
//! roughly 15 ms per token.

use std::time::Duration;

/// KV cache bytes per token of the modelled 8B model (see the module docs).
pub const KV_BYTES_PER_TOKEN: f64 = 131_072.0;

/// Per-iteration costs, in seconds, before the speedup.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostModel {
    /// Fixed cost of any iteration (kernel launches, sampling, scheduling).
    pub step_overhead_s: f64,
    /// Per prompt token computed (cached prefix tokens are free).
    pub prefill_per_token_s: f64,
    /// Per sequence in the decode part of the batch.
    pub decode_per_seq_s: f64,
    /// Per KV token read by the decoding sequences' attention.
    pub attention_per_kv_token_s: f64,
    /// Per prompt token loaded from the host tier instead of computed.
    pub offload_load_per_token_s: f64,
    /// Divides every time above; 1 is real time.
    pub speedup: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            step_overhead_s: 0.004,
            prefill_per_token_s: 0.000_05,
            decode_per_seq_s: 0.000_15,
            attention_per_kv_token_s: 0.000_000_02,
            // A tenth of prefill_per_token_s: see the module docs.
            offload_load_per_token_s: 0.000_005,
            speedup: 1.0,
        }
    }
}

/// What one iteration did, as the cost model needs it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchShape {
    pub prefill_tokens: u64,
    pub decode_seqs: u64,
    pub decode_kv_tokens: u64,
    /// Prompt tokens loaded from the host tier.
    pub loaded_tokens: u64,
}

impl CostModel {
    /// Wall time of one iteration of `batch`, speedup applied.
    pub fn step_time(&self, batch: BatchShape) -> Duration {
        let seconds = self.step_overhead_s
            + self.prefill_per_token_s * batch.prefill_tokens as f64
            + self.decode_per_seq_s * batch.decode_seqs as f64
            + self.attention_per_kv_token_s * batch.decode_kv_tokens as f64
            + self.offload_load_per_token_s * batch.loaded_tokens as f64;
        Duration::from_secs_f64(seconds / self.speedup)
    }

    /// Time to move `blocks` KV blocks of `block_size` tokens between engines
    /// at `gbps` gigabits per second, speedup applied.
    pub fn transfer_time(&self, blocks: usize, block_size: usize, gbps: f64) -> Duration {
        let bits = blocks as f64 * block_size as f64 * KV_BYTES_PER_TOKEN * 8.0;
        Duration::from_secs_f64(bits / (gbps * 1e9) / self.speedup)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_tokens_are_free_and_decode_grows_with_batch_and_kv() {
        let model = CostModel::default();
        let cold = model.step_time(BatchShape {
            prefill_tokens: 8192,
            ..Default::default()
        });
        let warm = model.step_time(BatchShape {
            prefill_tokens: 512,
            ..Default::default()
        });
        assert!(cold > warm * 10, "{cold:?} vs {warm:?}");
        let small = model.step_time(BatchShape {
            decode_seqs: 1,
            decode_kv_tokens: 1000,
            ..Default::default()
        });
        let big = model.step_time(BatchShape {
            decode_seqs: 32,
            decode_kv_tokens: 32 * 8000,
            ..Default::default()
        });
        assert!(big > small * 2);
        let fast = CostModel {
            speedup: 10.0,
            ..model
        };
        let ratio = big.as_secs_f64()
            / fast
                .step_time(BatchShape {
                    decode_seqs: 32,
                    decode_kv_tokens: 32 * 8000,
                    ..Default::default()
                })
                .as_secs_f64();
        assert!((ratio - 10.0).abs() < 1e-6, "{ratio}");
    }
}

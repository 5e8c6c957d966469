//! The matrix arithmetic a step asks of a device, from the model's shapes: the FLOPs of its GEMMs
//! (two per multiply-add). `bench sweep` divides a sweep's total by its wall time to give the
//! share of a GPU's FP32 peak the sweep reaches. Attention scores, norms, the router's softmax and
//! the quantizers are left out, so that share is a lower bound.

use super::model::ModelConfig;

/// GEMM FLOPs of one token's forward: every matmul site once, the routed experts `top_k` times
/// (a token runs only the experts it chose), the embedding lookups none.
pub fn forward_flops_per_token(cfg: &ModelConfig) -> f64 {
    let (d, e, k) = (cfg.d_model as f64, cfg.n_experts as f64, cfg.top_k as f64);
    let (f, fs, v) = (cfg.d_ff as f64, cfg.d_ff_shared as f64, cfg.vocab as f64);
    let attention = 3.0 * d * d + d * d; // qkv, then the output projection
    let router = e * d;
    let shared = 2.0 * fs * d + d * fs; // gate | up, then down
    let routed = k * (2.0 * f * d + d * f);
    2.0 * (cfg.n_layers as f64 * (attention + router + shared + routed) + v * d)
}

/// GEMM FLOPs of `forward` token rows through the model plus `backward` rows through its
/// backward (which multiplies twice per forward product: once for the input's gradient, once
/// for the weight's).
pub fn gemm_flops(cfg: &ModelConfig, forward: usize, backward: usize) -> f64 {
    forward_flops_per_token(cfg) * (forward as f64 + 2.0 * backward as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same count taken from the parameter list instead of the architecture: every weight
    /// matrix `[out, in]` is one multiply-add per element per token, a routed expert's only for
    /// the `top_k` of `n_experts` that a token runs, the embedding tables none.
    fn from_named_shapes(cfg: &ModelConfig) -> f64 {
        let mut macs = 0.0;
        for (name, shape) in cfg.named_shapes() {
            let elements: usize = shape.iter().product();
            macs += match shape.len() {
                2 if name.starts_with("embedding.") => 0.0,
                2 => elements as f64,
                3 => elements as f64 * cfg.top_k as f64 / cfg.n_experts as f64,
                _ => 0.0, // norm gains
            };
        }
        2.0 * macs
    }

    #[test]
    fn the_count_covers_every_weight_matrix_once() {
        for cfg in [ModelConfig::tiny(), ModelConfig::small()] {
            assert_eq!(forward_flops_per_token(&cfg), from_named_shapes(&cfg));
        }
        let mut wide = ModelConfig::small();
        (wide.top_k, wide.d_ff_shared, wide.vocab) = (3, 96, 50);
        assert_eq!(forward_flops_per_token(&wide), from_named_shapes(&wide));
    }

    #[test]
    fn a_backward_row_costs_two_forward_rows() {
        let cfg = ModelConfig::small();
        assert_eq!(gemm_flops(&cfg, 0, 5), gemm_flops(&cfg, 10, 0));
        assert_eq!(gemm_flops(&cfg, 1, 0), forward_flops_per_token(&cfg));
    }
}

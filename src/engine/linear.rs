//! The precision-aware linear layer: `y = x · Wᵀ` with operands quantized per the site's
//! [`SitePlan`], and its backward in the plan's [`BackwardMode`]. Every matmul site of the model goes
//! through here, and every quantization goes through `crate::formats` (the one quantizer).
//!
//! Shapes: `x` is `[n, k]` (n tokens), `W` is `[m, k]` (out x in, as torch/Megatron store it),
//! `y` is `[n, m]`.

use super::backend::{Backend, MatRef};
use crate::recipe::SitePlan;

/// A weight prepared once per optimizer step: the operands the forward and the dgrad GEMM use.
/// `w_fwd` is what the rollout receives through weight export, byte for byte.
#[derive(Debug, Clone)]
pub struct PreparedWeight {
    pub out_dim: usize,
    pub in_dim: usize,
    /// Forward operand (quantized then dequantized to FP32).
    pub w_fwd: Vec<f32>,
    /// Operand of the dgrad GEMM (`dx = dy · W`), chosen by the backward mode.
    pub w_bwd: Vec<f32>,
}

/// What the forward keeps for the backward.
#[derive(Debug, Clone)]
pub struct LinearCache {
    /// Operand of the wgrad GEMM (`dW = dyᵀ · x`), chosen by the backward mode.
    pub x_bwd: Vec<f32>,
    pub n: usize,
}

/// Quantize a weight `[out_dim, in_dim]` for this step.
pub fn prepare_weight(plan: &SitePlan, w: &[f32], out_dim: usize, in_dim: usize) -> PreparedWeight {
    assert_eq!(w.len(), out_dim * in_dim);
    let _ = plan; // TODO(formats): quantize per plan; FP32 for now.
    PreparedWeight {
        out_dim,
        in_dim,
        w_fwd: w.to_vec(),
        w_bwd: w.to_vec(),
    }
}

/// `y[n, m] = x[n, k] · Wᵀ`; returns the cache the backward needs.
pub fn forward(
    be: &dyn Backend,
    plan: &SitePlan,
    x: &[f32],
    n: usize,
    w: &PreparedWeight,
    y: &mut [f32],
) -> LinearCache {
    let k = w.in_dim;
    assert_eq!(x.len(), n * k);
    let _ = plan; // TODO(formats): quantize activations per plan.
    be.gemm(
        MatRef::new(x, n, k),
        MatRef::new(&w.w_fwd, w.out_dim, k).t(),
        y,
        false,
    );
    LinearCache {
        x_bwd: x.to_vec(),
        n,
    }
}

/// Backward: `dx = dy · W` (written to `dx` when given) and `dW += dyᵀ · x` (accumulated).
pub fn backward(
    be: &dyn Backend,
    plan: &SitePlan,
    cache: &LinearCache,
    w: &PreparedWeight,
    dy: &[f32],
    dx: Option<&mut [f32]>,
    dw: &mut [f32],
) {
    let (n, k, m) = (cache.n, w.in_dim, w.out_dim);
    assert_eq!(dy.len(), n * m);
    let _ = plan; // TODO(formats): quantize dy in `Quantized` mode.
    if let Some(dx) = dx {
        be.gemm(
            MatRef::new(dy, n, m),
            MatRef::new(&w.w_bwd, m, k),
            dx,
            false,
        );
    }
    be.gemm(
        MatRef::new(dy, n, m).t(),
        MatRef::new(&cache.x_bwd, n, k),
        dw,
        true,
    );
}

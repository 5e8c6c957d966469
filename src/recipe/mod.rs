//! Precision policy: which format each matmul site uses and how its backward treats operands.
//! Rules (glob over Megatron site names, first match wins, layer ranges) resolve to a [`ModelPlan`]:
//! one [`SitePlan`] per site and layer. No tensor math and no I/O here.

use serde::{Deserialize, Serialize};

/// Format of a matmul site's operands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Precision {
    /// Plain FP32 operands (used by gradient checks and as "no quantization").
    Fp32,
    /// Operands rounded to BF16, FP32 accumulation.
    Bf16,
    /// MXFP8: E4M3 elements, 32-element blocks, E8M0 scale (TE rounding).
    Mxfp8,
    /// NVFP4: E2M1 elements, 16-element blocks, E4M3 scale, FP32 second-level scale.
    Nvfp4,
    /// DeepSeek-V3 style FP8 block scaling (1x128 activations, 128x128 weights).
    Fp8Block,
}

/// What the two backward GEMMs (dgrad, wgrad) use as operands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BackwardMode {
    /// Both backward GEMMs in the format: column-wise copies quantized from the originals, and the
    /// incoming gradient quantized too.
    Quantized,
    /// The original BF16 operands.
    HighPrecision,
    /// BF16 rebuilt from the exact low-precision values the forward used.
    Dequantized,
}

/// Second-level (FP32) scale of NVFP4 activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SecondScale {
    PerTensor,
    PerToken,
}

/// The resolved precision of one matmul site in one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SitePlan {
    pub precision: Precision,
    pub backward: BackwardMode,
    /// NVFP4 activation second-level scale (weights always use one scale per tensor).
    pub act_scale: SecondScale,
    /// NVFP4 per-token scale computed over K split into this many equal shards (expert TP size).
    pub shards: usize,
}

impl SitePlan {
    pub const FP32: SitePlan = SitePlan {
        precision: Precision::Fp32,
        backward: BackwardMode::HighPrecision,
        act_scale: SecondScale::PerToken,
        shards: 1,
    };
    pub const BF16: SitePlan = SitePlan {
        precision: Precision::Bf16,
        ..SitePlan::FP32
    };
}

/// Plans of the matmul sites of one transformer block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerPlan {
    pub linear_qkv: SitePlan,
    pub linear_proj: SitePlan,
    pub router: SitePlan,
    pub experts_fc1: SitePlan,
    pub experts_fc2: SitePlan,
    pub shared_fc1: SitePlan,
    pub shared_fc2: SitePlan,
}

impl LayerPlan {
    pub fn uniform(p: SitePlan) -> Self {
        LayerPlan {
            linear_qkv: p,
            linear_proj: p,
            router: p,
            experts_fc1: p,
            experts_fc2: p,
            shared_fc1: p,
            shared_fc2: p,
        }
    }
}

/// Plans for every site of a model: one [`LayerPlan`] per layer plus the output layer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelPlan {
    pub layers: Vec<LayerPlan>,
    pub output_layer: SitePlan,
}

impl ModelPlan {
    /// Every site of an `n_layers` model on the same plan.
    pub fn uniform(n_layers: usize, p: SitePlan) -> Self {
        ModelPlan {
            layers: vec![LayerPlan::uniform(p); n_layers],
            output_layer: p,
        }
    }
}

//! The built-in policy: a small pre-norm MoE transformer (learned positions, causal multi-head
//! attention, a Qwen3-style softmax/top-k router over SwiGLU experts plus one always-on shared expert),
//! with its FP32 master weights ([`Params`]), the per-step quantized view every forward runs on
//! ([`PreparedModel`]), the full forward and backward used by training, and the KV-cache decoder the
//! rollout samples with ([`decode_step`]).
//!
//! The contract that makes the low-precision comparison meaningful: rollout and trainer both run on the
//! same [`PreparedModel`], so they see the same quantized weights byte for byte; every matmul site goes
//! through `engine::linear` with its [`SitePlan`]; the trainer can replay the experts the rollout chose
//! ([`Routing`], "rollout routing replay"). Gradients are with respect to the FP32 master weights
//! (straight-through: `linear::backward` already returns dW for the master weight).
//!
//! Layout follows llm.c's `train_gpt2.c`: each block is a forward/backward pair that names its buffers,
//! and [`backward`] walks the layers in reverse. Dimension letters as in `engine::ops`: N = B·T tokens,
//! D model width, H heads, E experts, K experts per token, F / Fs routed / shared expert hidden width,
//! V vocabulary, S = `max_seq`. Weights are stored `[out, in]` as Megatron stores them.
//!
//! Left out on purpose: dropout, biases, rotary embeddings, load-balancing losses, MLA.

pub mod pass;

use super::device::cpu::CpuOps;
use super::layout::Layout;
use super::linear::{self, PreparedWeight};
use super::ops;
use crate::formats::QuantStats;
use crate::formats::bf16::round_bf16;
use crate::recipe::{ModelPlan, SitePlan};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// MXFP8 scales blocks of 32 elements along the reduction dimension; every matmul input width must
/// be a multiple of it.
const BLOCK: usize = 32;

// ===================================================================================================
// Configuration

/// Shape of the policy. `d_ff` is the hidden width of each routed expert, `d_ff_shared` of the shared
/// expert; `max_seq` is the number of learned positions (prompt plus response).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub vocab: usize,
    pub d_model: usize,
    pub n_heads: usize,
    pub n_layers: usize,
    pub n_experts: usize,
    pub top_k: usize,
    pub d_ff: usize,
    pub d_ff_shared: usize,
    pub max_seq: usize,
}

/// Everything that can be wrong with a config, a plan, weights or the inputs of a forward.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    #[error("model config: `{field}` is 0; every dimension must be at least 1")]
    Zero { field: &'static str },
    #[error(
        "model config: `d_model` = {d_model} is not divisible by `n_heads` = {n_heads}; \
         choose n_heads among the divisors of d_model"
    )]
    Heads { d_model: usize, n_heads: usize },
    #[error(
        "model config: `{field}` = {value} is not a multiple of 32, so 32-element MXFP8 blocks do not \
         tile the {dim}; use {suggest}"
    )]
    Block {
        field: &'static str,
        value: usize,
        dim: &'static str,
        suggest: usize,
    },
    #[error("model config: `top_k` = {top_k} must be between 1 and `n_experts` = {n_experts}")]
    TopK { top_k: usize, n_experts: usize },
    #[error(
        "precision plan has {got} layer plans but the model has {want} layers; resolve the recipe for {want} layers"
    )]
    PlanLayers { got: usize, want: usize },
    #[error("parameter `{name}` has {got} values, expected {want} for this config")]
    Shape {
        name: String,
        got: usize,
        want: usize,
    },
    #[error("forward input: {got} tokens, expected {expected} for B = {b} sequences of T = {t}")]
    Tokens {
        got: usize,
        expected: usize,
        b: usize,
        t: usize,
    },
    #[error(
        "forward input: sequence length {t} exceeds `max_seq` = {max_seq}; raise max_seq or shorten prompt + response"
    )]
    SeqTooLong { t: usize, max_seq: usize },
    #[error(
        "forward input: token id {token} at index {index} is outside the vocabulary of {vocab}"
    )]
    TokenId {
        token: u32,
        index: usize,
        vocab: usize,
    },
    #[error("replay routing: {0}")]
    Replay(String),
    #[error("KV cache: {0}")]
    Cache(String),
}

impl ModelConfig {
    /// Seconds-fast config for tests and smoke runs.
    pub fn tiny() -> Self {
        ModelConfig {
            vocab: 32,
            d_model: 32,
            n_heads: 2,
            n_layers: 2,
            n_experts: 4,
            top_k: 2,
            d_ff: 32,
            d_ff_shared: 32,
            max_seq: 32,
        }
    }

    /// The benchmark config: big enough for routing and quantization effects to matter.
    pub fn small() -> Self {
        ModelConfig {
            vocab: 32,
            d_model: 128,
            n_heads: 4,
            n_layers: 6,
            n_experts: 8,
            top_k: 2,
            d_ff: 256,
            d_ff_shared: 256,
            max_seq: 32,
        }
    }

    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_heads
    }

    /// Checks the config, naming the offending field. Widths that feed a matmul (`d_model`, `d_ff`,
    /// `d_ff_shared`) must be multiples of 32 because MXFP8 quantizes 32-element blocks along them.
    pub fn validate(&self) -> Result<(), ModelError> {
        let fields = [
            ("vocab", self.vocab),
            ("d_model", self.d_model),
            ("n_heads", self.n_heads),
            ("n_layers", self.n_layers),
            ("n_experts", self.n_experts),
            ("top_k", self.top_k),
            ("d_ff", self.d_ff),
            ("d_ff_shared", self.d_ff_shared),
            ("max_seq", self.max_seq),
        ];
        if let Some(&(field, _)) = fields.iter().find(|(_, v)| *v == 0) {
            return Err(ModelError::Zero { field });
        }
        let widths = [
            (
                "d_model",
                self.d_model,
                "model width (input of linear_qkv, linear_proj, router, fc1)",
            ),
            (
                "d_ff",
                self.d_ff,
                "routed expert hidden width (input of experts linear_fc2)",
            ),
            (
                "d_ff_shared",
                self.d_ff_shared,
                "shared expert hidden width (input of shared_experts linear_fc2)",
            ),
        ];
        for (field, value, dim) in widths {
            if !value.is_multiple_of(BLOCK) {
                let suggest = value.div_ceil(BLOCK) * BLOCK;
                return Err(ModelError::Block {
                    field,
                    value,
                    dim,
                    suggest,
                });
            }
        }
        if !self.d_model.is_multiple_of(self.n_heads) {
            return Err(ModelError::Heads {
                d_model: self.d_model,
                n_heads: self.n_heads,
            });
        }
        if self.top_k > self.n_experts {
            return Err(ModelError::TopK {
                top_k: self.top_k,
                n_experts: self.n_experts,
            });
        }
        Ok(())
    }

    /// Every tensor's Megatron name and shape, in the order of [`Params::named_tensors`].
    pub fn named_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (v, d, e) = (self.vocab, self.d_model, self.n_experts);
        let (f, fs) = (self.d_ff, self.d_ff_shared);
        let layer = [
            vec![d],
            vec![3 * d, d],
            vec![d, d],
            vec![d],
            vec![e, d],
            vec![e, 2 * f, d],
            vec![e, d, f],
            vec![2 * fs, d],
            vec![d, fs],
        ];
        let mut out = vec![
            (WTE.to_string(), vec![v, d]),
            (WPE.to_string(), vec![self.max_seq, d]),
        ];
        for i in 0..self.n_layers {
            for (suffix, shape) in LAYER_TENSORS.iter().zip(&layer) {
                out.push((layer_name(i, suffix), shape.clone()));
            }
        }
        out.push((FINAL_NORM.to_string(), vec![d]));
        out.push((OUTPUT.to_string(), vec![v, d]));
        out
    }

    /// Every tensor's number of values, in the order of [`ModelConfig::named_shapes`].
    pub fn tensor_lens(&self) -> Vec<usize> {
        self.named_shapes()
            .iter()
            .map(|(_, dims)| dims.iter().product())
            .collect()
    }
}

// ===================================================================================================
// Parameters (FP32 master weights; gradients use the same struct)

const WTE: &str = "embedding.word_embeddings.weight";
const WPE: &str = "embedding.position_embeddings.weight";
const FINAL_NORM: &str = "decoder.final_layernorm.weight";
const OUTPUT: &str = "output_layer.weight";
/// Per-layer tensor names after `decoder.layers.{i}.`, in [`LayerParams`] field order.
const LAYER_TENSORS: [&str; 9] = [
    "input_layernorm",
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "pre_mlp_layernorm",
    "mlp.router",
    "mlp.experts.linear_fc1",
    "mlp.experts.linear_fc2",
    "mlp.shared_experts.linear_fc1",
    "mlp.shared_experts.linear_fc2",
];

fn layer_name(i: usize, suffix: &str) -> String {
    format!("decoder.layers.{i}.{suffix}.weight")
}

/// One transformer block's weights; shapes in brackets, `[out, in]` for matmuls.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerParams {
    /// [D] gain of the pre-attention RMSNorm.
    pub attn_norm: Vec<f32>,
    /// [3D, D]: Q rows 0..D, K rows D..2D, V rows 2D..3D.
    pub linear_qkv: Vec<f32>,
    /// [D, D]
    pub linear_proj: Vec<f32>,
    /// [D] gain of the pre-MoE RMSNorm.
    pub mlp_norm: Vec<f32>,
    /// [E, D]
    pub router: Vec<f32>,
    /// [E, 2F, D]: per expert, gate rows 0..F and up rows F..2F, fused so they share one quantization.
    pub experts_fc1: Vec<f32>,
    /// [E, D, F]
    pub experts_fc2: Vec<f32>,
    /// [2Fs, D]: gate rows then up rows.
    pub shared_fc1: Vec<f32>,
    /// [D, Fs]
    pub shared_fc2: Vec<f32>,
}

impl LayerParams {
    fn tensors(&self) -> [&Vec<f32>; 9] {
        [
            &self.attn_norm,
            &self.linear_qkv,
            &self.linear_proj,
            &self.mlp_norm,
            &self.router,
            &self.experts_fc1,
            &self.experts_fc2,
            &self.shared_fc1,
            &self.shared_fc2,
        ]
    }

    fn tensors_mut(&mut self) -> [&mut Vec<f32>; 9] {
        [
            &mut self.attn_norm,
            &mut self.linear_qkv,
            &mut self.linear_proj,
            &mut self.mlp_norm,
            &mut self.router,
            &mut self.experts_fc1,
            &mut self.experts_fc2,
            &mut self.shared_fc1,
            &mut self.shared_fc2,
        ]
    }
}

/// The FP32 master weights (and, from [`backward`], their gradients).
#[derive(Debug, Clone, PartialEq)]
pub struct Params {
    pub config: ModelConfig,
    /// [V, D]
    pub wte: Vec<f32>,
    /// [S, D]
    pub wpe: Vec<f32>,
    pub layers: Vec<LayerParams>,
    /// [D]
    pub final_norm: Vec<f32>,
    /// [V, D]
    pub output_layer: Vec<f32>,
}

/// `n` samples of N(0, std²) by Box–Muller (rand_distr is not a dependency).
fn normal(rng: &mut ChaCha8Rng, n: usize, std: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let u1 = 1.0 - rng.random::<f64>(); // (0, 1]: ln is finite
            let u2 = rng.random::<f64>();
            ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32 * std
        })
        .collect()
}

impl Params {
    /// Deterministic init from `seed`: gains 1; matmul weights N(0, 1/fan_in), the three residual-branch
    /// outputs (linear_proj, experts and shared fc2) further scaled by 1/√(2L) (GPT-2) so the residual
    /// stream does not grow with depth; output layer at half scale so the initial policy is close to
    /// uniform (RL needs exploration); token embeddings N(0, 1), positions N(0, 0.25).
    pub fn init(cfg: &ModelConfig, seed: u64) -> Result<Params, ModelError> {
        cfg.validate()?;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let (v, d, e, f, fs) = (
            cfg.vocab,
            cfg.d_model,
            cfg.n_experts,
            cfg.d_ff,
            cfg.d_ff_shared,
        );
        let fan = |n: usize| 1.0 / (n as f32).sqrt();
        let resid = fan(2 * cfg.n_layers);
        let wte = normal(&mut rng, v * d, 1.0);
        let wpe = normal(&mut rng, cfg.max_seq * d, 0.5);
        let layers = (0..cfg.n_layers)
            .map(|_| LayerParams {
                attn_norm: vec![1.0; d],
                linear_qkv: normal(&mut rng, 3 * d * d, fan(d)),
                linear_proj: normal(&mut rng, d * d, fan(d) * resid),
                mlp_norm: vec![1.0; d],
                router: normal(&mut rng, e * d, fan(d)),
                experts_fc1: normal(&mut rng, e * 2 * f * d, fan(d)),
                experts_fc2: normal(&mut rng, e * d * f, fan(f) * resid),
                shared_fc1: normal(&mut rng, 2 * fs * d, fan(d)),
                shared_fc2: normal(&mut rng, d * fs, fan(fs) * resid),
            })
            .collect();
        let output_layer = normal(&mut rng, v * d, 0.5 * fan(d));
        Ok(Params {
            config: cfg.clone(),
            wte,
            wpe,
            layers,
            final_norm: vec![1.0; d],
            output_layer,
        })
    }

    /// All-zero tensors of this config's shapes (the gradient accumulator).
    pub fn zeros(cfg: &ModelConfig) -> Params {
        let (v, d, e, f, fs) = (
            cfg.vocab,
            cfg.d_model,
            cfg.n_experts,
            cfg.d_ff,
            cfg.d_ff_shared,
        );
        let layer = LayerParams {
            attn_norm: vec![0.0; d],
            linear_qkv: vec![0.0; 3 * d * d],
            linear_proj: vec![0.0; d * d],
            mlp_norm: vec![0.0; d],
            router: vec![0.0; e * d],
            experts_fc1: vec![0.0; e * 2 * f * d],
            experts_fc2: vec![0.0; e * d * f],
            shared_fc1: vec![0.0; 2 * fs * d],
            shared_fc2: vec![0.0; d * fs],
        };
        Params {
            config: cfg.clone(),
            wte: vec![0.0; v * d],
            wpe: vec![0.0; cfg.max_seq * d],
            layers: vec![layer; cfg.n_layers],
            final_norm: vec![0.0; d],
            output_layer: vec![0.0; v * d],
        }
    }

    /// Params from its tensors in [`Self::named_tensors`] order (a device's gradients copied
    /// back), checked against `cfg`'s shapes.
    pub fn from_tensors(cfg: &ModelConfig, tensors: Vec<Vec<f32>>) -> Result<Params, ModelError> {
        let count = 4 + 9 * cfg.n_layers;
        if tensors.len() != count {
            return Err(ModelError::Shape {
                name: "(all tensors)".into(),
                got: tensors.len(),
                want: count,
            });
        }
        let mut it = tensors.into_iter();
        let mut next = || it.next().unwrap_or_default();
        let (wte, wpe) = (next(), next());
        let layers = (0..cfg.n_layers)
            .map(|_| LayerParams {
                attn_norm: next(),
                linear_qkv: next(),
                linear_proj: next(),
                mlp_norm: next(),
                router: next(),
                experts_fc1: next(),
                experts_fc2: next(),
                shared_fc1: next(),
                shared_fc2: next(),
            })
            .collect();
        let p = Params {
            config: cfg.clone(),
            wte,
            wpe,
            layers,
            final_norm: next(),
            output_layer: next(),
        };
        p.check_shapes()?;
        Ok(p)
    }

    pub fn zeros_like(&self) -> Params {
        Params::zeros(&self.config)
    }

    /// Every tensor with its Megatron name (`decoder.layers.{i}.mlp.experts.linear_fc1.weight` holds all
    /// experts, [E, 2F, D]). Same order as [`ModelConfig::named_shapes`] and [`Self::named_tensors_mut`].
    pub fn named_tensors(&self) -> Vec<(String, &[f32])> {
        let mut out: Vec<(String, &[f32])> = vec![(WTE.into(), &self.wte), (WPE.into(), &self.wpe)];
        for (i, l) in self.layers.iter().enumerate() {
            for (suffix, t) in LAYER_TENSORS.iter().zip(l.tensors()) {
                out.push((layer_name(i, suffix), t));
            }
        }
        out.push((FINAL_NORM.into(), &self.final_norm));
        out.push((OUTPUT.into(), &self.output_layer));
        out
    }

    /// Mutable twin of [`Self::named_tensors`] (optimizers, checkpoint loading).
    pub fn named_tensors_mut(&mut self) -> Vec<(String, &mut [f32])> {
        let mut out: Vec<(String, &mut [f32])> =
            vec![(WTE.into(), &mut self.wte), (WPE.into(), &mut self.wpe)];
        for (i, l) in self.layers.iter_mut().enumerate() {
            for (suffix, t) in LAYER_TENSORS.iter().zip(l.tensors_mut()) {
                out.push((layer_name(i, suffix), t));
            }
        }
        out.push((FINAL_NORM.into(), &mut self.final_norm));
        out.push((OUTPUT.into(), &mut self.output_layer));
        out
    }

    /// Checks that every tensor has its config's size (weights loaded from elsewhere).
    pub fn check_shapes(&self) -> Result<(), ModelError> {
        self.config.validate()?;
        let shapes = self.config.named_shapes();
        if self.layers.len() != self.config.n_layers {
            return Err(ModelError::Shape {
                name: "decoder.layers".into(),
                got: self.layers.len(),
                want: self.config.n_layers,
            });
        }
        for ((name, t), (_, shape)) in self.named_tensors().into_iter().zip(shapes) {
            let want: usize = shape.iter().product();
            if t.len() != want {
                return Err(ModelError::Shape {
                    name,
                    got: t.len(),
                    want,
                });
            }
        }
        Ok(())
    }
}

// ===================================================================================================
// Prepared (quantized) model: what the rollout holds and the trainer's forward runs on

/// One block's prepared weights: a [`PreparedWeight`] per matmul site (one per expert), gains copied.
#[derive(Debug, Clone)]
pub struct PreparedLayer {
    pub attn_norm: Vec<f32>,
    pub linear_qkv: PreparedWeight,
    pub linear_proj: PreparedWeight,
    pub mlp_norm: Vec<f32>,
    pub router: PreparedWeight,
    /// E weights of [2F, D]; gate and up quantized together.
    pub experts_fc1: Vec<PreparedWeight>,
    /// E weights of [D, F].
    pub experts_fc2: Vec<PreparedWeight>,
    pub shared_fc1: PreparedWeight,
    pub shared_fc2: PreparedWeight,
}

/// The per-step view of the policy: weights quantized once per optimizer step per the plan (which it
/// keeps, so every forward applies the same plan), non-matmul tensors copied in FP32.
#[derive(Debug, Clone)]
pub struct PreparedModel {
    pub config: ModelConfig,
    pub plan: ModelPlan,
    pub wte: Vec<f32>,
    pub wpe: Vec<f32>,
    pub layers: Vec<PreparedLayer>,
    pub final_norm: Vec<f32>,
    pub output_layer: PreparedWeight,
}

/// Prepares E stacked expert weights [E, out, in] one expert at a time (in parallel; order kept).
fn prepare_experts(
    plan: &SitePlan,
    w: &[f32],
    e: usize,
    out: usize,
    inp: usize,
) -> Vec<PreparedWeight> {
    (0..e)
        .into_par_iter()
        .map(|i| linear::prepare_weight(plan, &w[i * out * inp..][..out * inp], out, inp))
        .collect()
}

impl PreparedModel {
    /// Names this prepared model's contents (immutable once prepared): clones share it, every
    /// new preparation gets a new one. A device backend keys its uploaded copy by it.
    pub fn key(&self) -> u64 {
        self.output_layer.key()
    }

    /// Quantizes every matmul site of `params` per `plan` (experts one at a time, each with its own
    /// scales, as grouped-GEMM experts are).
    pub fn new(params: &Params, plan: &ModelPlan) -> Result<PreparedModel, ModelError> {
        params.check_shapes()?;
        let cfg = &params.config;
        if plan.layers.len() != cfg.n_layers {
            return Err(ModelError::PlanLayers {
                got: plan.layers.len(),
                want: cfg.n_layers,
            });
        }
        let (d, e, f, fs) = (cfg.d_model, cfg.n_experts, cfg.d_ff, cfg.d_ff_shared);
        // Layers are independent: prepared in parallel (collect keeps their order).
        let layers = params
            .layers
            .par_iter()
            .zip(&plan.layers)
            .map(|(l, p)| PreparedLayer {
                attn_norm: l.attn_norm.clone(),
                linear_qkv: linear::prepare_weight(&p.linear_qkv, &l.linear_qkv, 3 * d, d),
                linear_proj: linear::prepare_weight(&p.linear_proj, &l.linear_proj, d, d),
                mlp_norm: l.mlp_norm.clone(),
                router: linear::prepare_weight(&p.router, &l.router, e, d),
                experts_fc1: prepare_experts(&p.experts_fc1, &l.experts_fc1, e, 2 * f, d),
                experts_fc2: prepare_experts(&p.experts_fc2, &l.experts_fc2, e, d, f),
                shared_fc1: linear::prepare_weight(&p.shared_fc1, &l.shared_fc1, 2 * fs, d),
                shared_fc2: linear::prepare_weight(&p.shared_fc2, &l.shared_fc2, d, fs),
            })
            .collect();
        Ok(PreparedModel {
            config: cfg.clone(),
            plan: plan.clone(),
            wte: params.wte.clone(),
            wpe: params.wpe.clone(),
            layers,
            final_norm: params.final_norm.clone(),
            output_layer: linear::prepare_weight(
                &plan.output_layer,
                &params.output_layer,
                cfg.vocab,
                d,
            ),
        })
    }

    /// Everything the rollout receives, by name, for hashing the exported bytes: each matmul site's
    /// `w_fwd` (experts one by one, TE grouped-GEMM style: `...mlp.experts.linear_fc1.weight{e}`) and the
    /// FP32 copies of embeddings and norm gains under their master names.
    pub fn exported(&self) -> Vec<(String, &[f32])> {
        let mut out: Vec<(String, &[f32])> = vec![(WTE.into(), &self.wte), (WPE.into(), &self.wpe)];
        for (i, l) in self.layers.iter().enumerate() {
            let name = |s: &str| layer_name(i, s);
            out.push((name(LAYER_TENSORS[0]), &l.attn_norm));
            out.push((name(LAYER_TENSORS[1]), l.linear_qkv.w_fwd()));
            out.push((name(LAYER_TENSORS[2]), l.linear_proj.w_fwd()));
            out.push((name(LAYER_TENSORS[3]), &l.mlp_norm));
            out.push((name(LAYER_TENSORS[4]), l.router.w_fwd()));
            for (e, w) in l.experts_fc1.iter().enumerate() {
                out.push((format!("{}{e}", name(LAYER_TENSORS[5])), w.w_fwd()));
            }
            for (e, w) in l.experts_fc2.iter().enumerate() {
                out.push((format!("{}{e}", name(LAYER_TENSORS[6])), w.w_fwd()));
            }
            out.push((name(LAYER_TENSORS[7]), l.shared_fc1.w_fwd()));
            out.push((name(LAYER_TENSORS[8]), l.shared_fc2.w_fwd()));
        }
        out.push((FINAL_NORM.into(), &self.final_norm));
        out.push((OUTPUT.into(), self.output_layer.w_fwd()));
        out
    }
}

// ===================================================================================================
// Routing record (rollout routing replay)

/// The experts chosen for every token in every layer: `layers[l][n·K + j]` is token n's j-th expert
/// (most probable first). Tokens are in forward order (sequence-major, n = b·T + t). Passing it back as
/// `replay` forces the same selection; the gate weights are still recomputed from the router logits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Routing {
    pub top_k: usize,
    pub n_tokens: usize,
    pub layers: Vec<Vec<u32>>,
}

impl Routing {
    /// Each token's record repeated `times` times in a row (the routing of copied sequences).
    pub fn repeat_each(&self, times: usize) -> Routing {
        let k = self.top_k.max(1);
        Routing {
            top_k: self.top_k,
            n_tokens: self.n_tokens * times,
            layers: self
                .layers
                .iter()
                .map(|ids| {
                    ids.chunks(k)
                        .flat_map(|tok| std::iter::repeat_n(tok, times).flatten().copied())
                        .collect()
                })
                .collect(),
        }
    }

    /// Assembles the per-position records of [`decode_step`] (each over the same B sequences) into one
    /// record in the full forward's sequence-major order, ready for replay in the trainer.
    pub fn from_steps(steps: &[Routing]) -> Result<Routing, ModelError> {
        let first = steps
            .first()
            .ok_or_else(|| ModelError::Replay("no decode steps to assemble".into()))?;
        let (k, b, n_layers) = (first.top_k, first.n_tokens, first.layers.len());
        if let Some(i) = steps
            .iter()
            .position(|s| (s.top_k, s.n_tokens, s.layers.len()) != (k, b, n_layers))
        {
            return Err(ModelError::Replay(format!(
                "decode step {i} has a different batch, top-k or depth than step 0"
            )));
        }
        let t = steps.len();
        let layers = (0..n_layers)
            .map(|l| {
                let mut ids = vec![0u32; b * t * k];
                for (ti, s) in steps.iter().enumerate() {
                    for bi in 0..b {
                        ids[(bi * t + ti) * k..][..k].copy_from_slice(&s.layers[l][bi * k..][..k]);
                    }
                }
                ids
            })
            .collect();
        Ok(Routing {
            top_k: k,
            n_tokens: b * t,
            layers,
        })
    }

    /// Checks that this record fits a forward over `n` tokens of `cfg`: depth, top-k, length, ids in
    /// range and distinct per token.
    pub fn check(&self, cfg: &ModelConfig, n: usize) -> Result<(), ModelError> {
        if (self.top_k, self.n_tokens, self.layers.len()) != (cfg.top_k, n, cfg.n_layers) {
            return Err(ModelError::Replay(format!(
                "record has top_k {}, {} tokens, {} layers; the forward needs top_k {}, {n} tokens, {} layers",
                self.top_k,
                self.n_tokens,
                self.layers.len(),
                cfg.top_k,
                cfg.n_layers
            )));
        }
        for (l, ids) in self.layers.iter().enumerate() {
            if ids.len() != n * cfg.top_k {
                return Err(ModelError::Replay(format!(
                    "layer {l} holds {} ids, expected {}",
                    ids.len(),
                    n * cfg.top_k
                )));
            }
            for (tok, row) in ids.chunks(cfg.top_k).enumerate() {
                let bad = row
                    .iter()
                    .enumerate()
                    .any(|(j, &x)| x as usize >= cfg.n_experts || row[..j].contains(&x));
                if bad {
                    return Err(ModelError::Replay(format!(
                        "layer {l} token {tok}: experts {row:?} are not {} distinct ids below {}",
                        cfg.top_k, cfg.n_experts
                    )));
                }
            }
        }
        Ok(())
    }
}

/// Validates the inputs of [`forward_rows`] (and so of [`forward`], a plain layout) without
/// running it (the forward panics on the same conditions).
pub fn check_layout_inputs(
    cfg: &ModelConfig,
    tokens: &[u32],
    layout: &Layout,
    replay: Option<&Routing>,
) -> Result<(), ModelError> {
    if tokens.len() != layout.rows() {
        return Err(ModelError::Tokens {
            got: tokens.len(),
            expected: layout.rows(),
            b: layout.sequences(),
            t: layout.seq_len(),
        });
    }
    let t = layout.seq_len();
    if t > cfg.max_seq {
        return Err(ModelError::SeqTooLong {
            t,
            max_seq: cfg.max_seq,
        });
    }
    check_tokens(cfg, tokens)?;
    replay.map_or(Ok(()), |r| r.check(cfg, layout.rows()))
}

/// Every token id below the vocabulary size, or the first one that is not.
pub fn check_tokens(cfg: &ModelConfig, tokens: &[u32]) -> Result<(), ModelError> {
    match tokens.iter().position(|&x| x as usize >= cfg.vocab) {
        Some(index) => Err(ModelError::TokenId {
            token: tokens[index],
            index,
            vocab: cfg.vocab,
        }),
        None => Ok(()),
    }
}
// ===================================================================================================
// Activation counts, and the trainer's pass wherever it runs

/// The matmul sites a forward's activation counts are reported for, in the order of
/// [`ForwardCache::quant_stats`]: per layer qkv, proj, router, routed experts' fc1 and fc2, shared
/// expert's fc1 and fc2; then the output layer.
pub fn quant_sites(n_layers: usize) -> Vec<String> {
    let mut out = Vec::with_capacity(7 * n_layers + 1);
    for i in 0..n_layers {
        for t in [1, 2, 4, 5, 6, 7, 8] {
            out.push(format!("decoder.layers.{i}.{}", LAYER_TENSORS[t]));
        }
    }
    out.push("output_layer".to_string());
    out
}

/// The trainer's policy forward, wherever it ran: its logits, its activation counts, and the
/// backward that goes with it ([`crate::engine::backend::Backend::train_forward`]). [`HostPass`]
/// is the host's: `forward_rows` + `backward`.
pub trait TrainPass: Send {
    /// Logits `[rows, V]` in the layout's row order.
    fn logits(&self) -> &[f32];
    /// As [`ForwardCache::quant_stats`].
    fn quant_stats(&self) -> Vec<(String, QuantStats)>;
    /// Gradients w.r.t. the master weights from dL/dlogits `[rows, V]` (as [`backward`]).
    fn backward(&self, dlogits: &[f32]) -> Params;
}

/// [`TrainPass`] on the host: [`forward_rows`] kept, [`backward`] on demand.
pub struct HostPass<'a> {
    prep: &'a PreparedModel,
    logits: Vec<f32>,
    cache: ForwardCache<'a>,
}

impl<'a> HostPass<'a> {
    /// [`forward_rows`] (no routing record: the trainer does not read it).
    pub fn forward(
        prep: &'a PreparedModel,
        tokens: &[u32],
        layout: &Layout,
        replay: Option<&Routing>,
    ) -> Self {
        let (logits, cache, _) = forward_rows(prep, tokens, layout, replay);
        HostPass {
            prep,
            logits,
            cache,
        }
    }
}

impl TrainPass for HostPass<'_> {
    fn logits(&self) -> &[f32] {
        &self.logits
    }
    fn quant_stats(&self) -> Vec<(String, QuantStats)> {
        self.cache.quant_stats()
    }
    fn backward(&self, dlogits: &[f32]) -> Params {
        backward(self.prep, &self.cache, dlogits)
    }
}

// ===================================================================================================
// The passes on the host (`pass` over `CpuOps`)

/// A forward's cache on the host (see [`pass::Cache`]), for [`backward`].
pub type ForwardCache<'a> = pass::Cache<CpuOps<'a>>;

impl ForwardCache<'_> {
    /// Activation-quantization counts of this forward, one entry per matmul site and layer, named as
    /// the recipe names sites (`decoder.layers.{i}.mlp.experts.linear_fc1`, ..., `output_layer`); the
    /// routed experts of a layer are merged into their site.
    pub fn quant_stats(&self) -> Vec<(String, QuantStats)> {
        let stats = pass::quant_stats(&CpuOps::new(), self).expect("host counts");
        quant_sites(self.n_layers())
            .into_iter()
            .zip(stats)
            .collect()
    }
}

impl PreparedModel {
    /// This prepared model as the host passes read it (borrowed, nothing copied).
    pub fn host_weights(&self) -> pass::Weights<CpuOps<'_>> {
        let layers = self
            .layers
            .iter()
            .map(|l| pass::LayerWeights {
                attn_norm: &l.attn_norm[..],
                linear_qkv: &l.linear_qkv,
                linear_proj: &l.linear_proj,
                mlp_norm: &l.mlp_norm[..],
                router: &l.router,
                experts_fc1: &l.experts_fc1[..],
                experts_fc2: &l.experts_fc2[..],
                shared_fc1: &l.shared_fc1,
                shared_fc2: &l.shared_fc2,
            })
            .collect();
        pass::Weights {
            config: self.config.clone(),
            plans: pass::RunPlans::one(self.plan.clone()),
            wte: &self.wte,
            wpe: &self.wpe,
            layers,
            final_norm: &self.final_norm,
            output_layer: &self.output_layer,
        }
    }
}

/// Causal forward over B sequences of T tokens (`tokens` sequence-major, [B·T]): returns logits
/// [B·T, V], the cache for [`backward`], and the experts chosen in every layer. With `replay`, the
/// selection is forced to the record (rollout routing replay); gate weights still come from this
/// forward's router.
///
/// # Panics
/// On inputs [`check_layout_inputs`] rejects (wrong token count, id outside the vocabulary, T > max_seq, a
/// replay record that does not fit). Call it first where the inputs come from outside.
pub fn forward<'a>(
    prep: &'a PreparedModel,
    tokens: &[u32],
    b: usize,
    t: usize,
    replay: Option<&Routing>,
) -> (Vec<f32>, ForwardCache<'a>, Routing) {
    forward_rows(prep, tokens, &Layout::plain(b, t), replay)
}

/// [`forward`] over the rows of `layout` (`tokens`, logits, routing and replay all in layout row
/// order): sequences that share a prompt compute it once.
///
/// # Panics
/// As [`forward`], on inputs [`check_layout_inputs`] rejects.
pub fn forward_rows<'a>(
    prep: &'a PreparedModel,
    tokens: &[u32],
    layout: &Layout,
    replay: Option<&Routing>,
) -> (Vec<f32>, ForwardCache<'a>, Routing) {
    pass::forward(&CpuOps::new(), &prep.host_weights(), tokens, layout, replay)
        .unwrap_or_else(|err| panic!("model::forward: {err}"))
}

/// Gradients of the loss w.r.t. the FP32 master weights, given dL/dlogits [N, V] (in the row order
/// of the forward that produced `cache`, on the same `prep`).
pub fn backward<'a>(prep: &'a PreparedModel, cache: &ForwardCache<'a>, dlogits: &[f32]) -> Params {
    pass::backward(&CpuOps::new(), &prep.host_weights(), cache, dlogits)
        .unwrap_or_else(|err| panic!("model::backward: {err}"))
}

// ===================================================================================================
// Incremental decoder (rollout)

/// Keys and values of every layer for B sequences, [B, H, S, Dh] per layer, filled one position per
/// [`decode_step`]. K and V are stored rounded to BF16 (the recipe's BF16 KV cache) unless
/// `round_bf16` is turned off, which makes decoding match [`forward`] to FP32 rounding.
#[derive(Debug, Clone)]
pub struct KvCache {
    b: usize,
    capacity: usize,
    head_dim: usize,
    len: usize,
    pub round_bf16: bool,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl KvCache {
    /// An empty cache for `b` sequences of up to `positions` (at most `max_seq`) positions, BF16
    /// rounding on: a rollout sizes it to its prompt plus response, since every copy and
    /// allocation of the cache scales with it.
    pub fn with_capacity(cfg: &ModelConfig, b: usize, positions: usize) -> KvCache {
        KvCache::for_shape(cfg.n_layers, b, positions, cfg.d_model, cfg.n_heads)
    }

    /// An empty cache of this shape (BF16 rounding on).
    pub fn for_shape(layers: usize, b: usize, positions: usize, d: usize, h: usize) -> KvCache {
        let per_layer = b * positions * d;
        let zeros = |_| vec![0.0; per_layer]; // one allocation each, zeroed lazily by the OS
        KvCache {
            b,
            capacity: positions,
            head_dim: d / h.max(1),
            len: 0,
            round_bf16: true,
            k: (0..layers).map(zeros).collect(),
            v: (0..layers).map(zeros).collect(),
        }
    }

    /// Values per sequence in one layer's K (or V): H·S·Dh.
    fn per_seq(&self) -> usize {
        self.k.first().map_or(0, |k| k.len() / self.b.max(1))
    }

    /// Positions filled so far (the position the next step writes).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of sequences.
    pub fn batch(&self) -> usize {
        self.b
    }

    /// Positions left before the cache (and the position embedding) is full.
    pub fn remaining(&self) -> usize {
        self.capacity - self.len
    }

    /// The cache with every sequence repeated `times` times in a row (sequence `i` becomes
    /// `i·times .. (i+1)·times`): after decoding each distinct prompt once, its samples continue
    /// from copies of its cache. Every position's K/V is per sequence, so the copies hold exactly
    /// what decoding each sample's prompt separately would have written.
    pub fn repeat_each(&self, times: usize) -> KvCache {
        // [B, H, S, Dh] per layer: copy each (sequence, head)'s filled positions only.
        let (per_seq, per_head) = (self.per_seq(), self.capacity * self.head_dim);
        let filled = self.len * self.head_dim;
        let rep = |layer: &Vec<f32>| -> Vec<f32> {
            let mut out = vec![0.0f32; layer.len() * times];
            for (seq, dst) in out.chunks_mut(per_seq.max(1)).enumerate() {
                let src = &layer[(seq / times) * per_seq..][..per_seq];
                for (d, s) in dst.chunks_mut(per_head).zip(src.chunks(per_head)) {
                    d[..filled].copy_from_slice(&s[..filled]);
                }
            }
            out
        };
        KvCache {
            b: self.b * times,
            capacity: self.capacity,
            head_dim: self.head_dim,
            len: self.len,
            round_bf16: self.round_bf16,
            k: self.k.iter().map(rep).collect(),
            v: self.v.iter().map(rep).collect(),
        }
    }

    /// Writes this step's K and V ([B, 3D] qkv rows) of layer `l` at position `len`.
    fn store(&mut self, l: usize, qkv: &[f32], h: usize, d: usize) {
        let (dh, s, pos, round) = (d / h, self.capacity, self.len, self.round_bf16);
        for bi in 0..self.b {
            for hi in 0..h {
                let src = bi * 3 * d + hi * dh;
                let dst = ((bi * h + hi) * s + pos) * dh;
                for (cache, off) in [(&mut self.k[l], d), (&mut self.v[l], 2 * d)] {
                    for (o, &x) in cache[dst..dst + dh]
                        .iter_mut()
                        .zip(&qkv[src + off..src + off + dh])
                    {
                        *o = if round { round_bf16(x) } else { x };
                    }
                }
            }
        }
    }

    /// Stores this step's keys and values (`qkv` [B, 3D]) in layer `l` and attends over the
    /// cache up to them: [B, D].
    pub(crate) fn attend(&mut self, l: usize, qkv: &[f32], h: usize, d: usize) -> Vec<f32> {
        self.store(l, qkv, h, d);
        let mut att = vec![0.0f32; self.b * d];
        ops::attention_step(
            &mut att,
            qkv,
            &self.k[l],
            &self.v[l],
            self.b,
            h,
            d,
            self.capacity,
            self.len + 1,
        );
        att
    }

    /// Marks the step's position filled.
    pub(crate) fn advance(&mut self) {
        self.len += 1;
    }
}

pub fn check_step(
    cfg: &ModelConfig,
    cache: &KvCache,
    tokens: &[u32],
    replay: Option<&Routing>,
) -> Result<(), ModelError> {
    if tokens.len() != cache.b {
        return Err(ModelError::Cache(format!(
            "{} tokens for a cache of {} sequences",
            tokens.len(),
            cache.b
        )));
    }
    if cache.remaining() == 0 {
        return Err(ModelError::Cache(format!(
            "all {} positions are filled; raise max_seq",
            cache.capacity
        )));
    }
    if cache.k.len() != cfg.n_layers
        || cache.capacity > cfg.max_seq
        || cache.head_dim != cfg.head_dim()
        || cache.per_seq() != cache.capacity * cfg.d_model
    {
        return Err(ModelError::Cache(
            "cache was made for a different model config".into(),
        ));
    }
    check_tokens(cfg, tokens)?;
    replay.map_or(Ok(()), |r| r.check(cfg, cache.b))
}

/// Runs one new position for each of the cache's B sequences (`tokens` [B], one each) attending over
/// the cached positions; returns logits [B, V] and this position's routing (B tokens). Same blocks and
/// prepared weights as [`forward`]; only attention reads K/V from the cache.
///
/// # Panics
/// On inputs [`check_step`] rejects (wrong batch, full cache, bad ids, unfit replay record).
pub fn decode_step(
    prep: &PreparedModel,
    cache: &mut KvCache,
    tokens: &[u32],
    replay: Option<&Routing>,
) -> (Vec<f32>, Routing) {
    if let Err(err) = check_step(&prep.config, cache, tokens, replay) {
        panic!("model::decode_step: {err}");
    }
    pass::decode(
        &CpuOps::new(),
        &prep.host_weights(),
        cache,
        tokens,
        1,
        replay,
    )
    .unwrap_or_else(|err| panic!("model::decode_step: {err}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small_test_config() -> ModelConfig {
        ModelConfig {
            vocab: 11,
            d_model: 32,
            n_heads: 2,
            n_layers: 2,
            n_experts: 4,
            top_k: 2,
            d_ff: 32,
            d_ff_shared: 32,
            max_seq: 8,
        }
    }

    fn random_tokens(rng: &mut ChaCha8Rng, n: usize, vocab: usize) -> Vec<u32> {
        (0..n).map(|_| rng.random_range(0..vocab as u32)).collect()
    }

    fn fp32_plan(cfg: &ModelConfig) -> ModelPlan {
        ModelPlan::uniform(cfg.n_layers, SitePlan::FP32)
    }

    #[test]
    fn validate_names_the_offending_field() {
        assert_eq!(ModelConfig::tiny().validate(), Ok(()));
        assert_eq!(ModelConfig::small().validate(), Ok(()));
        let bad = |f: fn(&mut ModelConfig)| {
            let mut c = ModelConfig::tiny();
            f(&mut c);
            c.validate().unwrap_err()
        };
        assert_eq!(
            bad(|c| c.n_heads = 3),
            ModelError::Heads {
                d_model: 32,
                n_heads: 3
            }
        );
        let e = bad(|c| c.d_model = 48);
        assert!(
            matches!(
                e,
                ModelError::Block {
                    field: "d_model",
                    value: 48,
                    suggest: 64,
                    ..
                }
            ),
            "{e}"
        );
        assert!(matches!(
            bad(|c| c.d_ff = 40),
            ModelError::Block { field: "d_ff", .. }
        ));
        let e = bad(|c| c.d_ff_shared = 16);
        assert!(
            e.to_string().contains("d_ff_shared") && e.to_string().contains("shared expert"),
            "{e}"
        );
        assert_eq!(bad(|c| c.vocab = 0), ModelError::Zero { field: "vocab" });
        assert_eq!(
            bad(|c| c.top_k = 5),
            ModelError::TopK {
                top_k: 5,
                n_experts: 4
            }
        );
        let json = serde_json::to_string(&ModelConfig::small()).unwrap();
        assert_eq!(
            serde_json::from_str::<ModelConfig>(&json).unwrap(),
            ModelConfig::small()
        );
    }

    #[test]
    fn named_tensors_cover_every_tensor_with_megatron_names() {
        let cfg = ModelConfig::tiny();
        let mut p = Params::init(&cfg, 3).unwrap();
        let named = p.named_tensors();
        assert_eq!(named.len(), 4 + 9 * cfg.n_layers);
        let total: usize = named.iter().map(|(_, t)| t.len()).sum();
        for ((name, t), (sname, shape)) in named.iter().zip(cfg.named_shapes()) {
            assert_eq!(name, &sname);
            assert_eq!(t.len(), shape.iter().product::<usize>(), "{name}");
        }
        let names: Vec<String> = named.iter().map(|(n, _)| n.clone()).collect();
        assert!(names.contains(&"decoder.layers.1.mlp.experts.linear_fc1.weight".to_string()));
        assert!(names.contains(&"decoder.layers.0.self_attention.linear_qkv.weight".to_string()));
        assert_eq!(
            names
                .iter()
                .collect::<std::collections::BTreeSet<_>>()
                .len(),
            names.len()
        );
        let mut_names: Vec<String> = p.named_tensors_mut().into_iter().map(|(n, _)| n).collect();
        assert_eq!(mut_names, names);
        // Every value is reachable through the list: zeroing through it zeroes the whole model.
        for (_, t) in p.named_tensors_mut() {
            t.fill(0.0);
        }
        assert_eq!(p, p.zeros_like());
        assert!(total > 0);
        assert_eq!(p.check_shapes(), Ok(()));
    }

    #[test]
    fn init_is_deterministic_per_seed() {
        let cfg = ModelConfig::tiny();
        assert_eq!(
            Params::init(&cfg, 5).unwrap(),
            Params::init(&cfg, 5).unwrap()
        );
        assert_ne!(
            Params::init(&cfg, 5).unwrap(),
            Params::init(&cfg, 6).unwrap()
        );
        let mut bad = cfg.clone();
        bad.n_heads = 5;
        assert!(Params::init(&bad, 1).is_err());
    }

    #[test]
    fn prepared_model_exports_every_site_and_checks_the_plan() {
        let cfg = ModelConfig::tiny();
        let p = Params::init(&cfg, 1).unwrap();
        assert_eq!(
            PreparedModel::new(&p, &ModelPlan::uniform(1, SitePlan::FP32)).unwrap_err(),
            ModelError::PlanLayers { got: 1, want: 2 }
        );
        let prep = PreparedModel::new(&p, &fp32_plan(&cfg)).unwrap();
        let ex = prep.exported();
        assert_eq!(ex.len(), 4 + cfg.n_layers * (7 + 2 * cfg.n_experts));
        let fc1_3 = ex
            .iter()
            .find(|(n, _)| n == "decoder.layers.1.mlp.experts.linear_fc1.weight3")
            .unwrap();
        let per = 2 * cfg.d_ff * cfg.d_model;
        assert_eq!(fc1_3.1, &p.layers[1].experts_fc1[3 * per..4 * per]); // FP32 plan: bytes unchanged
        let mut broken = p.clone();
        broken.layers[0].router.pop();
        assert!(matches!(
            PreparedModel::new(&broken, &fp32_plan(&cfg)),
            Err(ModelError::Shape { .. })
        ));
    }

    #[test]
    fn forward_rejects_bad_inputs_by_name() {
        let cfg = small_test_config();
        assert!(matches!(
            check_layout_inputs(&cfg, &[0; 6], &Layout::plain(2, 4), None),
            Err(ModelError::Tokens { got: 6, .. })
        ));
        assert!(matches!(
            check_layout_inputs(&cfg, &[0; 18], &Layout::plain(2, 9), None),
            Err(ModelError::SeqTooLong { .. })
        ));
        assert!(matches!(
            check_layout_inputs(&cfg, &[0, 11], &Layout::plain(1, 2), None),
            Err(ModelError::TokenId { index: 1, .. })
        ));
        let r = Routing {
            top_k: 2,
            n_tokens: 1,
            layers: vec![vec![1, 1], vec![0, 1]],
        };
        assert!(matches!(
            check_layout_inputs(&cfg, &[0], &Layout::plain(1, 1), Some(&r)),
            Err(ModelError::Replay(_))
        ));
    }

    /// Loss used by the gradient checks: Σ logits · r, accumulated in f64.
    fn weighted_logits(
        prep: &PreparedModel,
        tokens: &[u32],
        layout: &Layout,
        r: &[f32],
    ) -> (f64, Routing) {
        let (logits, _, routing) = forward_rows(prep, tokens, layout, None);
        (
            logits
                .iter()
                .zip(r)
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum(),
            routing,
        )
    }

    /// Whole-model central finite differences on a sample of coordinates of every named tensor (half
    /// where the backward says the gradient is nonzero, half uniform). A coordinate whose ±ε evaluation
    /// changes any routing decision is skipped (top-k is not differentiable); the test fails if more
    /// than 10 % are skipped. Per-coordinate tolerance 2 % + 1e-3, per-tensor relative error 1 %: a
    /// missing factor 2, a transposed or misplaced gradient fails both. Run on a plain batch and on
    /// a shared-prefix layout whose continuations end at different positions.
    #[test]
    fn backward_matches_finite_differences_for_every_tensor() {
        check_model_gradients(&Layout::plain(2, 5));
        // Two groups of a 3-token prompt; continuations of 2, 0, 1 and 2, 2, 1 rows.
        let toks: Vec<u32> = (0..6).flat_map(|s| [1, 2, 3 + s / 3, s, s]).collect();
        check_model_gradients(&Layout::shared_prefix(
            &toks,
            6,
            5,
            3,
            3,
            Some(&[5, 3, 4, 5, 5, 4]),
        ));
    }

    fn check_model_gradients(layout: &Layout) {
        let cfg = small_test_config();
        let n = layout.rows();
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let mut params = Params::init(&cfg, 7).unwrap();
        for (name, w) in params.named_tensors_mut() {
            if name.contains("layernorm") {
                w.iter_mut()
                    .for_each(|g| *g = 1.0 + (rng.random::<f32>() - 0.5) * 0.6);
            }
        }
        let tokens = random_tokens(&mut rng, n, cfg.vocab);
        let r: Vec<f32> = (0..n * cfg.vocab)
            .map(|_| rng.random::<f32>() * 2.0 - 1.0)
            .collect();
        let plan = fp32_plan(&cfg);
        let prep = PreparedModel::new(&params, &plan).unwrap();
        let (_, cache, base_routing) = forward_rows(&prep, &tokens, layout, None);
        let grads = backward(&prep, &cache, &r);
        let grads = grads.named_tensors();
        let eps = 5e-3f32;
        let (mut checked, mut skipped) = (0usize, 0usize);
        let mut report = Vec::new();
        for (ti, (name, an)) in grads.iter().enumerate() {
            let nonzero: Vec<usize> = (0..an.len()).filter(|&i| an[i] != 0.0).collect();
            assert!(
                !nonzero.is_empty(),
                "{name}: backward gives an all-zero gradient"
            );
            let mut coords: Vec<usize> = (0..4)
                .map(|_| nonzero[rng.random_range(0..nonzero.len())])
                .collect();
            coords.extend((0..4).map(|_| rng.random_range(0..an.len())));
            let (mut err2, mut norm2) = (0.0f64, 0.0f64);
            for &i in &coords {
                let eval = |delta: f32| {
                    let mut p = params.clone();
                    p.named_tensors_mut()[ti].1[i] += delta;
                    let moved = p.named_tensors()[ti].1[i] as f64;
                    let (l, routing) = weighted_logits(
                        &PreparedModel::new(&p, &plan).unwrap(),
                        &tokens,
                        layout,
                        &r,
                    );
                    (l, routing, moved)
                };
                let ((lp, rp, hi), (lm, rm, lo)) = (eval(eps), eval(-eps));
                checked += 1;
                if rp != base_routing || rm != base_routing {
                    skipped += 1;
                    continue;
                }
                let fd = (lp - lm) / (hi - lo);
                let a = an[i] as f64;
                assert!(
                    (fd - a).abs() <= 2e-2 * fd.abs().max(a.abs()) + 1e-3,
                    "{name}[{i}]: finite difference {fd}, backward {a}"
                );
                err2 += (fd - a).powi(2);
                norm2 += fd * fd;
            }
            let rel = (err2 / norm2.max(1e-30)).sqrt();
            report.push(format!("{name}: rel {rel:.2e} |g| {:.2e}", norm2.sqrt()));
            assert!(
                norm2 > 1e-8,
                "{name}: sampled gradient is all zero, the check proves nothing"
            );
            assert!(rel <= 1e-2, "{name}: relative error {rel}");
        }
        assert!(
            skipped * 10 <= checked,
            "{skipped} of {checked} coordinates flipped the routing; lower eps"
        );
        eprintln!(
            "{layout:?}: checked {checked}, skipped {skipped}\n{}",
            report.join("\n")
        );
    }

    /// The trainer's shared-prefix forward gives every sequence position the bits of the plain
    /// batch's forward, under a quantized recipe with per-token NVFP4 scales too; its gradients equal
    /// the plain batch's up to the order of the sums over rows.
    #[test]
    fn shared_prefix_rows_match_the_plain_batch() {
        let cfg = ModelConfig::tiny();
        let (groups, n, prompt, t) = (3, 4, 4, 7);
        let mut rng = ChaCha8Rng::seed_from_u64(31);
        let mut tokens = Vec::new();
        for _ in 0..groups {
            let head = random_tokens(&mut rng, prompt, cfg.vocab);
            for _ in 0..n {
                tokens.extend(&head);
                tokens.extend(random_tokens(&mut rng, t - prompt, cfg.vocab));
            }
        }
        let b = groups * n;
        // Sequences end at different positions (a finished response keeps no rows past its end).
        let used: Vec<usize> = (0..b).map(|s| t - s % 3).collect();
        let layout = Layout::shared_prefix(&tokens, b, t, n, prompt, Some(&used));
        let kept: usize = used.iter().map(|u| u - prompt).sum();
        assert_eq!(layout.rows(), groups * prompt + kept);
        let params = Params::init(&cfg, 3).unwrap();
        let preset = |name| {
            crate::recipe::presets::preset(name)
                .unwrap()
                .resolve(cfg.n_layers)
                .unwrap()
        };
        // FP32 operands: only the association of the sums over rows differs. Recipes that round the
        // output gradient to BF16 round a shared row's summed gradient once instead of each
        // sequence's share: differences of the order of BF16's precision.
        let cases = [
            ("fp32", fp32_plan(&cfg), 1e-5),
            ("bf16", preset("bf16"), 1e-2),
            ("nvfp4-dq", preset("nvfp4-dq"), 1e-2),
        ];
        for (recipe, plan, tol) in cases {
            let prep = PreparedModel::new(&params, &plan).unwrap();
            let (full, full_cache, _) = forward(&prep, &tokens, b, t, None);
            let (rows, row_cache, _) = forward_rows(&prep, &layout.pack(&tokens, 1), &layout, None);
            let v = cfg.vocab;
            for (s, p) in (0..b).flat_map(|s| (0..used[s]).map(move |p| (s, p))) {
                let r = layout.row(s, p).expect("kept position");
                let (x, y) = (&rows[r * v..][..v], &full[(s * t + p) * v..][..v]);
                assert!(
                    x.iter().zip(y).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{recipe}: sequence {s} position {p} differs from the plain batch"
                );
            }
            // The loss reads only kept positions.
            let r: Vec<f32> = (0..b * t * v)
                .map(|i| {
                    let (s, p) = (i / v / t, i / v % t);
                    if p < used[s] {
                        rng.random::<f32>() - 0.5
                    } else {
                        0.0
                    }
                })
                .collect();
            let g_full = backward(&prep, &full_cache, &r);
            let g_rows = backward(&prep, &row_cache, &layout.fold(&r, cfg.vocab));
            for ((name, a), (_, b)) in g_full.named_tensors().iter().zip(g_rows.named_tensors()) {
                let (mut err, mut norm) = (0.0f64, 0.0f64);
                for (&x, &y) in a.iter().zip(b) {
                    err += ((x - y) as f64).powi(2);
                    norm += (x as f64).powi(2);
                }
                let rel = (err / norm.max(1e-30)).sqrt();
                assert!(
                    norm > 0.0 && rel < tol,
                    "{recipe} {name}: relative difference {rel}"
                );
            }
        }
    }

    #[test]
    fn decoding_token_by_token_matches_the_full_forward() {
        let cfg = ModelConfig::tiny();
        let (b, t) = (3, 10);
        let mut rng = ChaCha8Rng::seed_from_u64(21);
        let params = Params::init(&cfg, 4).unwrap();
        let prep = PreparedModel::new(&params, &fp32_plan(&cfg)).unwrap();
        let tokens = random_tokens(&mut rng, b * t, cfg.vocab);
        let (full, _, full_routing) = forward(&prep, &tokens, b, t, None);
        let decode = |round: bool| {
            let mut cache = KvCache::with_capacity(&cfg, b, cfg.max_seq);
            cache.round_bf16 = round;
            let (mut logits, mut steps) = (vec![0.0f32; b * t * cfg.vocab], Vec::new());
            for ti in 0..t {
                let step_tokens: Vec<u32> = (0..b).map(|bi| tokens[bi * t + ti]).collect();
                let (l, r) = decode_step(&prep, &mut cache, &step_tokens, None);
                for bi in 0..b {
                    logits[(bi * t + ti) * cfg.vocab..][..cfg.vocab]
                        .copy_from_slice(&l[bi * cfg.vocab..][..cfg.vocab]);
                }
                steps.push(r);
            }
            assert_eq!(cache.len(), t);
            (logits, Routing::from_steps(&steps).unwrap())
        };
        // Without BF16 rounding of K/V the decoder differs from the forward only by FP32 summation order.
        let (exact, routing) = decode(false);
        let max_diff = exact
            .iter()
            .zip(&full)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(
            max_diff < 1e-4,
            "decode vs forward: max |Δlogit| {max_diff}"
        );
        assert_eq!(routing, full_routing);
        // With the BF16 KV cache the logits move, but only by BF16 rounding noise.
        let (rounded, _) = decode(true);
        let max_diff = rounded
            .iter()
            .zip(&full)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(
            max_diff > 0.0 && max_diff < 5e-2,
            "bf16 KV cache: max |Δlogit| {max_diff}"
        );
    }

    /// Quantized plans run end to end, and the decoder (same prepared weights, activations quantized per
    /// token row) agrees with the full forward: MXFP8 blocks run along each token's own row, so the
    /// batch size of a call does not change a token's quantization.
    #[test]
    fn quantized_plans_train_and_decode_like_the_forward() {
        use crate::recipe::Precision;
        let cfg = ModelConfig::tiny();
        let (b, t) = (2, 6);
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let params = Params::init(&cfg, 4).unwrap();
        let tokens = random_tokens(&mut rng, b * t, cfg.vocab);
        for precision in [Precision::Bf16, Precision::Mxfp8] {
            let site = SitePlan {
                precision,
                ..SitePlan::FP32
            };
            let prep =
                PreparedModel::new(&params, &ModelPlan::uniform(cfg.n_layers, site)).unwrap();
            let (logits, cache, routing) = forward(&prep, &tokens, b, t, None);
            let g = backward(&prep, &cache, &vec![0.01; logits.len()]);
            assert!(
                g.named_tensors()
                    .iter()
                    .all(|(_, t)| t.iter().all(|x| x.is_finite()))
            );
            let mut kv = KvCache::with_capacity(&cfg, b, cfg.max_seq);
            kv.round_bf16 = false;
            let (mut max_diff, mut steps) = (0.0f32, Vec::new());
            for ti in 0..t {
                let step: Vec<u32> = (0..b).map(|bi| tokens[bi * t + ti]).collect();
                let (l, r) = decode_step(&prep, &mut kv, &step, None);
                for bi in 0..b {
                    let full = &logits[(bi * t + ti) * cfg.vocab..][..cfg.vocab];
                    let got = &l[bi * cfg.vocab..][..cfg.vocab];
                    max_diff = full
                        .iter()
                        .zip(got)
                        .map(|(x, y)| (x - y).abs())
                        .fold(max_diff, f32::max);
                }
                steps.push(r);
            }
            eprintln!("{precision:?}: decode vs forward max |dlogit| {max_diff}");
            assert!(
                max_diff < 1e-4,
                "{precision:?}: decode vs forward max |dlogit| {max_diff}"
            );
            assert_eq!(Routing::from_steps(&steps).unwrap(), routing);
        }
    }

    #[test]
    fn replay_forces_the_recorded_experts() {
        let cfg = ModelConfig::tiny();
        let (b, t) = (2, 6);
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let prep = PreparedModel::new(&Params::init(&cfg, 9).unwrap(), &fp32_plan(&cfg)).unwrap();
        let tokens = random_tokens(&mut rng, b * t, cfg.vocab);
        let (logits, _, routing) = forward(&prep, &tokens, b, t, None);
        // Replaying the forward's own choice reproduces it bit for bit.
        let (again, _, r2) = forward(&prep, &tokens, b, t, Some(&routing));
        assert_eq!((again, r2), (logits.clone(), routing.clone()));
        // A different record is obeyed and changes the output.
        let forced = Routing {
            top_k: 2,
            n_tokens: b * t,
            layers: vec![[3u32, 1].repeat(b * t); cfg.n_layers],
        };
        let (other, _, r3) = forward(&prep, &tokens, b, t, Some(&forced));
        assert_eq!(r3, forced);
        assert_ne!(other, logits);
        // Decoding with replay obeys too.
        let mut cache = KvCache::with_capacity(&cfg, b, cfg.max_seq);
        let step = Routing {
            top_k: 2,
            n_tokens: b,
            layers: vec![vec![2, 0, 1, 3]; cfg.n_layers],
        };
        let (_, r4) = decode_step(&prep, &mut cache, &[1, 2], Some(&step));
        assert_eq!(r4, step);
    }

    #[test]
    fn quant_stats_name_every_site_once() {
        let cfg = ModelConfig::tiny();
        let prep = PreparedModel::new(&Params::init(&cfg, 1).unwrap(), &fp32_plan(&cfg)).unwrap();
        let (_, cache, _) = forward(&prep, &[1, 2, 3, 4], 2, 2, None);
        let stats = cache.quant_stats();
        assert_eq!(stats.len(), 7 * cfg.n_layers + 1);
        assert_eq!(stats[3].0, "decoder.layers.0.mlp.experts.linear_fc1");
        assert_eq!(stats.last().map(|s| s.0.as_str()), Some("output_layer"));
        // FP32 sites never clip.
        assert!(stats.iter().all(|(_, s)| s.saturated == 0));
    }

    fn step_bits(threads: usize) -> (Vec<u32>, Vec<u32>) {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let cfg = ModelConfig::tiny();
            let (b, t) = (8, 12);
            let mut rng = ChaCha8Rng::seed_from_u64(8);
            let prep =
                PreparedModel::new(&Params::init(&cfg, 2).unwrap(), &fp32_plan(&cfg)).unwrap();
            let tokens = random_tokens(&mut rng, b * t, cfg.vocab);
            let (logits, cache, _) = forward(&prep, &tokens, b, t, None);
            let dl: Vec<f32> = (0..logits.len())
                .map(|_| rng.random::<f32>() - 0.5)
                .collect();
            let g = backward(&prep, &cache, &dl);
            let grads = g
                .named_tensors()
                .iter()
                .flat_map(|(_, t)| t.iter().map(|x| x.to_bits()))
                .collect();
            (logits.iter().map(|x| x.to_bits()).collect(), grads)
        })
    }

    #[test]
    fn forward_and_backward_are_bit_identical_across_thread_counts() {
        let (l1, g1) = step_bits(1);
        let (l3, g3) = step_bits(3);
        assert!(l1 == l3, "logits differ between 1 and 3 threads");
        assert!(g1 == g3, "gradients differ between 1 and 3 threads");
        assert!(g1.iter().any(|&x| x != 0));
    }

    /// Prints the time of prepare + decode of every position + forward + backward at `b` × `t`.
    fn time_step(cfg: &ModelConfig, b: usize, t: usize) {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let params = Params::init(cfg, 1).unwrap();
        let tokens = random_tokens(&mut rng, b * t, cfg.vocab);
        let dl: Vec<f32> = (0..b * t * cfg.vocab)
            .map(|_| rng.random::<f32>() - 0.5)
            .collect();
        for _ in 0..3 {
            let t0 = std::time::Instant::now();
            let prep = PreparedModel::new(&params, &fp32_plan(cfg)).unwrap();
            let t1 = std::time::Instant::now();
            let mut kv = KvCache::with_capacity(cfg, b, cfg.max_seq);
            for ti in 0..t {
                let step: Vec<u32> = (0..b).map(|bi| tokens[bi * t + ti]).collect();
                decode_step(&prep, &mut kv, &step, None);
            }
            let t2 = std::time::Instant::now();
            let (logits, cache, _) = forward(&prep, &tokens, b, t, None);
            let t3 = std::time::Instant::now();
            let g = backward(&prep, &cache, &dl);
            let t4 = std::time::Instant::now();
            assert!(logits.iter().chain(&g.output_layer).all(|x| x.is_finite()));
            eprintln!(
                "{b}x{t}: prepare {:?} decode {:?} forward {:?} backward {:?}; train step {:?}",
                t1 - t0,
                t2 - t1,
                t3 - t2,
                t4 - t3,
                (t1 - t0) + (t4 - t2)
            );
        }
    }

    /// Benchmark shapes (small: 256 × 16; tiny: a GRPO step of 64 × 16). Ignored by default; run with
    /// `cargo test --lib bench_ -- --ignored --nocapture --test-threads 1`.
    #[test]
    #[ignore]
    fn bench_small_step() {
        time_step(&ModelConfig::small(), 256, 16);
    }

    #[test]
    #[ignore]
    fn bench_tiny_step() {
        time_step(&ModelConfig::tiny(), 64, 16);
    }
}

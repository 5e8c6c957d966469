//! The resident trainer's forward and backward: `model::forward_rows` keeping its cache on the
//! device, and `model::backward` over it, so the trainer's policy pass never leaves the GPU but for
//! the logits (`[rows, V]`, small: the loss is computed on the host), dL/dlogits and the
//! gradients. It is `CudaBackend`'s `Backend::train_forward` ([`ResidentPass`]).
//!
//! Op for op the CPU's (`model.rs`), block by block, forward and backward side by side:
//! - every linear site is [`CudaLinear`] (`engine::linear` on the device: the same activation
//!   quantization, the same wgrad operand per backward mode, its activation counts);
//! - the routed experts run as one capacity-padded batch ([`ExpertBatch`]): expert e owns rows
//!   `[e·cap, (e+1)·cap)`, its tokens in token order then zero rows, with `cap` the row count
//!   rounded up to 128 so that no column-quantization block straddles two experts. Zero rows change
//!   no amax (no code), add nothing to a GEMM and are not counted as saturated or underflowed;
//! - the gate-weight gradient and the experts' dx scatter (`train.cu`), RMSNorm, attention, the
//!   router and the embedding backward (`cuda::backward`) sum in the CPU's order.
//!
//! What is identical to the CPU pass and what is not: every quantization and every op summed in
//! a fixed order gives the CPU's bits for the same inputs; cuBLAS sums GEMMs in another order than
//! `matrixmultiply` and CUDA's `expf` may differ by an ulp, so logits and gradients agree to a
//! tolerance (`tests/cuda_train.rs` measures it). The activation counts' `elements` include the
//! padding rows; saturated and underflowed counts do not.

use super::backward::{CudaBackwardOps, DeviceGroups};
use super::linear::{CudaLinear, DeviceLinearCache, DeviceWeight};
use super::moe::ExpertBatch;
use super::ops::{CudaOps, DeviceLayout, cfg_warps, dim};
use super::{CudaBackend, CudaDevice, CudaError};
use crate::engine::layout::Layout;
use crate::engine::model::{
    LayerParams, ModelConfig, Params, PreparedModel, Routing, TrainPass, quant_sites,
};
use crate::formats::QuantStats;
use crate::recipe::{LayerPlan, ModelPlan, SitePlan};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, PushKernelArg};
use std::sync::Arc;

const SRC: &str = include_str!("train.cu");

/// Expert batch rows are a multiple of this: the largest block a column quantization uses
/// (FP8 block's 128), so that blocks never straddle two experts.
const CAP_MULTIPLE: usize = 128;

/// One block's device weights, both operands of every site (see `model::PreparedLayer`).
pub struct TrainLayer {
    attn_norm: CudaSlice<f32>,
    linear_qkv: DeviceWeight,
    linear_proj: DeviceWeight,
    mlp_norm: CudaSlice<f32>,
    router: DeviceWeight,
    /// The E experts stacked: `[E, 2F, D]` and `[E, D, F]`.
    experts_fc1: DeviceWeight,
    experts_fc2: DeviceWeight,
    shared_fc1: DeviceWeight,
    shared_fc2: DeviceWeight,
}

/// A step's prepared model on the device, with its plan.
pub struct TrainModel {
    config: ModelConfig,
    plan: ModelPlan,
    wte: CudaSlice<f32>,
    wpe: CudaSlice<f32>,
    layers: Vec<TrainLayer>,
    final_norm: CudaSlice<f32>,
    output_layer: DeviceWeight,
}

/// fc1 → SwiGLU → fc2 over a block of rows (the shared expert, or every routed expert at once).
struct FfnCache {
    fc1: DeviceLinearCache,
    /// `[rows, 2F]` pre-activation (gate | up).
    fc1_out: CudaSlice<f32>,
    fc2: DeviceLinearCache,
}

struct AttnCache {
    /// `[N, D]` block input, for the RMSNorm backward.
    x: CudaSlice<f32>,
    rstd: CudaSlice<f32>,
    qkv_lin: DeviceLinearCache,
    qkv: CudaSlice<f32>,
    /// `[N, H, S]` softmax weights.
    probs: CudaSlice<f32>,
    proj_lin: DeviceLinearCache,
}

struct MoeCache {
    x: CudaSlice<f32>,
    rstd: CudaSlice<f32>,
    router_lin: DeviceLinearCache,
    /// `[N, K]` chosen experts and their renormalized gate weights.
    ids: CudaSlice<u32>,
    weights: CudaSlice<f32>,
    /// Batch row of each slot (`moe.cu`), and rows per expert.
    slot_row: CudaSlice<u32>,
    cap: usize,
    shared: FfnCache,
    experts: FfnCache,
    /// `[E·cap, D]` expert outputs before the gate weight.
    y_all: CudaSlice<f32>,
}

struct LayerCache {
    attn: AttnCache,
    moe: MoeCache,
}

/// Everything the backward needs from one forward, on the device.
pub struct TrainCache {
    layout: DeviceLayout,
    groups: DeviceGroups,
    tokens: CudaSlice<u32>,
    layers: Vec<LayerCache>,
    /// `[N, D]` input of the final RMSNorm.
    h_final: CudaSlice<f32>,
    final_rstd: CudaSlice<f32>,
    out_lin: DeviceLinearCache,
    /// Activation counts per site (3 each, `model::quant_sites` order).
    counts: Vec<CudaSlice<u64>>,
}

/// A forward's logits (`[rows, V]`, layout row order) and its cache.
pub struct TrainForward {
    pub logits: Vec<f32>,
    pub cache: TrainCache,
}

/// The gradients of one layer on the device (`LayerParams`' fields).
struct LayerGrads {
    attn_norm: CudaSlice<f32>,
    linear_qkv: CudaSlice<f32>,
    linear_proj: CudaSlice<f32>,
    mlp_norm: CudaSlice<f32>,
    router: CudaSlice<f32>,
    experts_fc1: CudaSlice<f32>,
    experts_fc2: CudaSlice<f32>,
    shared_fc1: CudaSlice<f32>,
    shared_fc2: CudaSlice<f32>,
}

/// The trainer's kernels, linear layer, cuBLAS handle and stream on one GPU; all work is queued
/// on the linear layer's stream, in program order.
pub struct ResidentTrainer {
    stream: Arc<CudaStream>,
    lin: CudaLinear,
    ops: CudaOps,
    bwd: CudaBackwardOps,
    batch: ExpertBatch,
    expert_dy: CudaFunction,
    expert_dx_scatter: CudaFunction,
}

impl ResidentTrainer {
    pub fn new(dev: &Arc<CudaDevice>) -> Result<Self, CudaError> {
        let lin = CudaLinear::new(dev)?;
        let m = dev.compile_with_prelude("train", SRC)?;
        Ok(ResidentTrainer {
            stream: lin.stream().clone(),
            lin,
            ops: CudaOps::new(dev)?,
            bwd: CudaBackwardOps::new(dev)?,
            batch: ExpertBatch::new(dev)?,
            expert_dy: m.load_function("expert_dy")?,
            expert_dx_scatter: m.load_function("expert_dx_scatter")?,
        })
    }

    fn zeros(&self, n: usize) -> Result<CudaSlice<f32>, CudaError> {
        Ok(self.stream.alloc_zeros(n.max(1))?)
    }

    /// A buffer of `n` floats for the op it is passed to to write in full
    /// ([`super::output_buffer`]).
    fn output(&self, n: usize) -> Result<CudaSlice<f32>, CudaError> {
        super::output_buffer(&self.stream, n)
    }

    /// Copy a step's prepared weights (forward and dgrad operands) to the device, in one staged
    /// copy: the tensors are listed in one fixed order and taken back in the same order.
    pub fn upload(&self, prep: &PreparedModel) -> Result<TrainModel, CudaError> {
        let one = |x| vec![x];
        let mut groups = vec![one(&prep.wte[..]), one(&prep.wpe), one(&prep.final_norm)];
        groups.extend(DeviceWeight::parts(std::slice::from_ref(
            &prep.output_layer,
        ))?);
        for l in &prep.layers {
            groups.extend([one(&l.attn_norm[..]), one(&l.mlp_norm)]);
            for ws in [
                std::slice::from_ref(&l.linear_qkv),
                std::slice::from_ref(&l.linear_proj),
                std::slice::from_ref(&l.router),
                &l.experts_fc1,
                &l.experts_fc2,
                std::slice::from_ref(&l.shared_fc1),
                std::slice::from_ref(&l.shared_fc2),
            ] {
                groups.extend(DeviceWeight::parts(ws)?);
            }
        }
        let mut bufs = self.lin.staging().upload(&groups)?.into_iter();
        let next = |b: &mut std::vec::IntoIter<_>| b.next().expect("one buffer per group");
        let weight = |b: &mut std::vec::IntoIter<_>, ws: &[_]| {
            let (w_fwd, w_bwd) = (next(b), next(b));
            DeviceWeight::from_parts(ws, w_fwd, w_bwd)
        };
        let b = &mut bufs;
        let (wte, wpe, final_norm) = (next(b), next(b), next(b));
        let output_layer = weight(b, std::slice::from_ref(&prep.output_layer));
        let layers = prep
            .layers
            .iter()
            .map(|l| TrainLayer {
                attn_norm: next(b),
                mlp_norm: next(b),
                linear_qkv: weight(b, std::slice::from_ref(&l.linear_qkv)),
                linear_proj: weight(b, std::slice::from_ref(&l.linear_proj)),
                router: weight(b, std::slice::from_ref(&l.router)),
                experts_fc1: weight(b, &l.experts_fc1),
                experts_fc2: weight(b, &l.experts_fc2),
                shared_fc1: weight(b, std::slice::from_ref(&l.shared_fc1)),
                shared_fc2: weight(b, std::slice::from_ref(&l.shared_fc2)),
            })
            .collect();
        Ok(TrainModel {
            config: prep.config.clone(),
            plan: prep.plan.clone(),
            wte,
            wpe,
            layers,
            final_norm,
            output_layer,
        })
    }

    // ---------------------------------------------------------------------------------------
    // Forward (model.rs's blocks, keeping their caches)

    /// `[n, d]` RMSNorm of x: (output, rstd).
    fn rmsnorm(
        &self,
        x: &CudaSlice<f32>,
        g: &CudaSlice<f32>,
        n: usize,
        d: usize,
    ) -> Result<(CudaSlice<f32>, CudaSlice<f32>), CudaError> {
        let (mut out, mut rstd) = (self.output(n * d)?, self.output(n)?);
        self.ops
            .rmsnorm_forward(&self.stream, &mut out, &mut rstd, x, g, n, d)?;
        Ok((out, rstd))
    }

    /// `model::ffn_forward` over `n` rows per weight of the batch.
    #[allow(clippy::too_many_arguments)]
    fn ffn_forward(
        &self,
        (fc1, p1): (&DeviceWeight, &SitePlan),
        (fc2, p2): (&DeviceWeight, &SitePlan),
        x: &CudaSlice<f32>,
        n: usize,
        (c1, c2): (&mut CudaSlice<u64>, &mut CudaSlice<u64>),
    ) -> Result<(CudaSlice<f32>, FfnCache), CudaError> {
        let (rows, f) = (fc1.batch() * n, fc2.in_dim());
        let (fc1_out, fc1_c) = self.lin.forward_counted(p1, x, n, fc1, Some(c1))?;
        let mut act = self.output(rows * f)?;
        self.ops
            .swiglu_forward(&self.stream, &mut act, &fc1_out, rows, f)?;
        let (y, fc2_c) = self.lin.forward_counted(p2, &act, n, fc2, Some(c2))?;
        Ok((
            y,
            FfnCache {
                fc1: fc1_c,
                fc1_out,
                fc2: fc2_c,
            },
        ))
    }

    /// `model::attn_forward`: x (kept) → x + proj(attention(qkv(rmsnorm(x)))). `counts`: qkv,
    /// proj.
    fn attn_forward(
        &self,
        w: &TrainLayer,
        p: &LayerPlan,
        cfg: &ModelConfig,
        x: CudaSlice<f32>,
        dl: &DeviceLayout,
        counts: &mut [CudaSlice<u64>],
    ) -> Result<(CudaSlice<f32>, AttnCache), CudaError> {
        let (n, d, h) = (dl.rows, cfg.d_model, cfg.n_heads);
        let [c_qkv, c_proj] = counts else {
            return Err(CudaError::Shape(
                "attention forward: two count buffers".into(),
            ));
        };
        let (xn, rstd) = self.rmsnorm(&x, &w.attn_norm, n, d)?;
        let (qkv, qkv_lin) =
            self.lin
                .forward_counted(&p.linear_qkv, &xn, n, &w.linear_qkv, Some(c_qkv))?;
        let (mut att, mut probs) = (self.output(n * d)?, self.output(n * h * dl.max_context)?);
        self.ops
            .attention_forward(&self.stream, &mut att, &mut probs, &qkv, dl, h, d)?;
        let (mut out, proj_lin) =
            self.lin
                .forward_counted(&p.linear_proj, &att, n, &w.linear_proj, Some(c_proj))?;
        self.ops.add_into(&self.stream, &mut out, &x, n * d)?;
        Ok((
            out,
            AttnCache {
                x,
                rstd,
                qkv_lin,
                qkv,
                probs,
                proj_lin,
            },
        ))
    }

    /// `model::moe_forward`: x (kept) → x + shared(xn) + Σ gate · expert(xn). `counts`: router,
    /// experts fc1, fc2, shared fc1, fc2.
    #[allow(clippy::too_many_arguments)]
    fn moe_forward(
        &self,
        w: &TrainLayer,
        p: &LayerPlan,
        cfg: &ModelConfig,
        x: CudaSlice<f32>,
        n: usize,
        replay: Option<&[u32]>,
        counts: &mut [CudaSlice<u64>],
    ) -> Result<(CudaSlice<f32>, MoeCache), CudaError> {
        let (d, e, k) = (cfg.d_model, cfg.n_experts, cfg.top_k);
        let s = &self.stream;
        let [c_router, c_e1, c_e2, c_sh1, c_sh2] = counts else {
            return Err(CudaError::Shape("moe forward: five count buffers".into()));
        };
        let (xn, rstd) = self.rmsnorm(&x, &w.mlp_norm, n, d)?;
        let (logits, router_lin) =
            self.lin
                .forward_counted(&p.router, &xn, n, &w.router, Some(c_router))?;
        let (ids, weights) = self.ops.route(s, &logits, n, e, k, replay)?;
        let cap = n.div_ceil(CAP_MULTIPLE) * CAP_MULTIPLE;
        let slots = self.batch.route(s, &ids, (n, k, e), cap)?;
        let mut xe = self.output(e * cap * d)?;
        self.batch
            .gather(s, &mut xe, &xn, &slots.src_row, e * cap, d, n)?;
        let (shared_y, shared) = self.ffn_forward(
            (&w.shared_fc1, &p.shared_fc1),
            (&w.shared_fc2, &p.shared_fc2),
            &xn,
            n,
            (c_sh1, c_sh2),
        )?;
        let (y_all, experts) = self.ffn_forward(
            (&w.experts_fc1, &p.experts_fc1),
            (&w.experts_fc2, &p.experts_fc2),
            &xe,
            cap,
            (c_e1, c_e2),
        )?;
        let mut out = self.output(n * d)?;
        self.ops.moe_combine(
            s,
            &mut out,
            &shared_y,
            &y_all,
            &slots.slot_row,
            &ids,
            &weights,
            &x,
            n,
            k,
            d,
        )?;
        Ok((
            out,
            MoeCache {
                x,
                rstd,
                router_lin,
                ids,
                weights,
                slot_row: slots.slot_row,
                cap,
                shared,
                experts,
                y_all,
            },
        ))
    }

    /// `model::forward_rows` on the device, keeping the cache for [`Self::backward`]: logits
    /// `[rows, V]` in layout row order. `replay` forces the experts (rollout routing replay).
    pub fn forward(
        &self,
        m: &TrainModel,
        tokens: &[u32],
        layout: &Layout,
        replay: Option<&Routing>,
    ) -> Result<TrainForward, CudaError> {
        let cfg = &m.config;
        crate::engine::model::check_layout_inputs(cfg, tokens, layout, replay)
            .map_err(|e| CudaError::Shape(e.to_string()))?;
        let s = &self.stream;
        let dl = DeviceLayout::upload(s, layout)?;
        let groups = DeviceGroups::upload(s, layout)?;
        let (n, d, v) = (dl.rows, cfg.d_model, cfg.vocab);
        let toks = if tokens.is_empty() {
            s.alloc_zeros::<u32>(1)?
        } else {
            s.clone_htod(tokens)?
        };
        let mut counts = (0..7 * cfg.n_layers + 1)
            .map(|_| s.alloc_zeros::<u64>(3))
            .collect::<Result<Vec<_>, _>>()?;
        let mut h = self.output(n * d)?;
        self.ops
            .embedding_forward(s, &mut h, &toks, &dl.positions, &m.wte, &m.wpe, n, d)?;
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for (l, (w, p)) in m.layers.iter().zip(&m.plan.layers).enumerate() {
            let c = &mut counts[7 * l..7 * l + 7];
            let (mid, attn) = self.attn_forward(w, p, cfg, h, &dl, &mut c[..2])?;
            let r = replay.map(|r| r.layers[l].as_slice());
            let (out, moe) = self.moe_forward(w, p, cfg, mid, n, r, &mut c[2..])?;
            layers.push(LayerCache { attn, moe });
            h = out;
        }
        let (hn, final_rstd) = self.rmsnorm(&h, &m.final_norm, n, d)?;
        let c_out = counts.last_mut().expect("one per site");
        let (logits, out_lin) =
            self.lin
                .forward_counted(&m.plan.output_layer, &hn, n, &m.output_layer, Some(c_out))?;
        let logits = s.clone_dtoh(&logits.slice(..n * v))?;
        Ok(TrainForward {
            logits,
            cache: TrainCache {
                layout: dl,
                groups,
                tokens: toks,
                layers,
                h_final: h,
                final_rstd,
                out_lin,
                counts,
            },
        })
    }

    /// The forward's activation counts, as `ForwardCache::quant_stats` reports them.
    pub fn quant_stats(
        &self,
        m: &TrainModel,
        cache: &TrainCache,
    ) -> Result<Vec<(String, QuantStats)>, CudaError> {
        let sites = quant_sites(m.config.n_layers);
        let s = &self.stream;
        // The sites' [elements, saturated, underflowed] gathered on the device: one copy back.
        let mut all = s.alloc_zeros::<u64>((3 * cache.counts.len()).max(1))?;
        for (i, c) in cache.counts.iter().enumerate() {
            s.memcpy_dtod(&c.slice(..3), &mut all.slice_mut(3 * i..3 * i + 3))?;
        }
        let all = s.clone_dtoh(&all)?;
        Ok(sites
            .into_iter()
            .zip(all.chunks_exact(3))
            .map(|(name, v)| {
                (
                    name,
                    QuantStats {
                        elements: v[0],
                        saturated: v[1],
                        underflowed: v[2],
                    },
                )
            })
            .collect())
    }

    // ---------------------------------------------------------------------------------------
    // Backward (model.rs's blocks in reverse)

    /// `model::ffn_backward`: dy → dx (written); dW1, dW2 accumulated.
    #[allow(clippy::too_many_arguments)]
    fn ffn_backward(
        &self,
        (fc1, p1): (&DeviceWeight, &SitePlan),
        (fc2, p2): (&DeviceWeight, &SitePlan),
        c: &FfnCache,
        dy: &CudaSlice<f32>,
        dx: &mut CudaSlice<f32>,
        dw1: &mut CudaSlice<f32>,
        dw2: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let (rows, f) = (fc1.batch() * c.fc1.n, fc2.in_dim());
        let mut dact = self.zeros(rows * f)?;
        self.lin
            .backward(p2, &c.fc2, fc2, dy, Some(&mut dact), dw2)?;
        let mut dfc1 = self.zeros(rows * 2 * f)?;
        self.bwd
            .swiglu_backward(&self.stream, &mut dfc1, &dact, &c.fc1_out, rows, f)?;
        self.lin.backward(p1, &c.fc1, fc1, &dfc1, Some(dx), dw1)
    }

    /// `model::attn_backward`: dh in, w.r.t. the block output; out, w.r.t. its input.
    #[allow(clippy::too_many_arguments)]
    fn attn_backward(
        &self,
        w: &TrainLayer,
        p: &LayerPlan,
        cfg: &ModelConfig,
        c: &AttnCache,
        dh: &mut CudaSlice<f32>,
        g: &mut LayerGrads,
        cache: &TrainCache,
    ) -> Result<(), CudaError> {
        let (n, d, h) = (cache.layout.rows, cfg.d_model, cfg.n_heads);
        let s = &self.stream;
        let mut datt = self.zeros(n * d)?;
        self.lin.backward(
            &p.linear_proj,
            &c.proj_lin,
            &w.linear_proj,
            dh,
            Some(&mut datt),
            &mut g.linear_proj,
        )?;
        let mut dqkv = self.zeros(n * 3 * d)?;
        self.bwd.attention_backward(
            s,
            &mut dqkv,
            &datt,
            &c.qkv,
            &c.probs,
            &cache.layout,
            &cache.groups,
            h,
            d,
        )?;
        let mut dxn = self.zeros(n * d)?;
        self.lin.backward(
            &p.linear_qkv,
            &c.qkv_lin,
            &w.linear_qkv,
            &dqkv,
            Some(&mut dxn),
            &mut g.linear_qkv,
        )?;
        self.bwd.rmsnorm_backward(
            s,
            dh,
            &mut g.attn_norm,
            &dxn,
            &c.x,
            &w.attn_norm,
            &c.rstd,
            n,
            d,
        )
    }

    /// `model::moe_backward`: dh in, w.r.t. the MoE block output; out, w.r.t. its input.
    #[allow(clippy::too_many_arguments)]
    fn moe_backward(
        &self,
        w: &TrainLayer,
        p: &LayerPlan,
        cfg: &ModelConfig,
        c: &MoeCache,
        dh: &mut CudaSlice<f32>,
        g: &mut LayerGrads,
        n: usize,
    ) -> Result<(), CudaError> {
        let (d, e, k) = (cfg.d_model, cfg.n_experts, cfg.top_k);
        let s = &self.stream;
        let rows = e * c.cap;
        let mut dxn = self.zeros(n * d)?;
        self.ffn_backward(
            (&w.shared_fc1, &p.shared_fc1),
            (&w.shared_fc2, &p.shared_fc2),
            &c.shared,
            dh,
            &mut dxn,
            &mut g.shared_fc1,
            &mut g.shared_fc2,
        )?;
        // Each slot's share of dh, scaled by its gate weight, on its batch row; and the gate
        // weights' gradient.
        let (mut dy_all, mut dgate) = (self.zeros(rows * d)?, self.zeros(n * k)?);
        let op = "moe backward";
        let (nk32, k32, d32, rows32) = (
            dim(op, "slots", n * k)?,
            dim(op, "k", k)?,
            dim(op, "d", d)?,
            dim(op, "rows", rows)?,
        );
        let n32 = dim(op, "n", n)?;
        if n * k > 0 {
            let mut b = s.launch_builder(&self.expert_dy);
            b.arg(&mut dy_all).arg(&mut dgate).arg(&*dh).arg(&c.y_all);
            b.arg(&c.slot_row).arg(&c.weights);
            b.arg(&nk32).arg(&k32).arg(&d32).arg(&rows32);
            // SAFETY: a warp per slot s < n·k (slot_row, weights, dgate hold n·k); dh read at
            // row s/k < n (n·d); y_all and dy_all at batch rows < rows only (rows·d each).
            unsafe { b.launch(cfg_warps(n * k)) }?;
        }
        let mut dxe_all = self.zeros(rows * d)?;
        self.ffn_backward(
            (&w.experts_fc1, &p.experts_fc1),
            (&w.experts_fc2, &p.experts_fc2),
            &c.experts,
            &dy_all,
            &mut dxe_all,
            &mut g.experts_fc1,
            &mut g.experts_fc2,
        )?;
        if n * d > 0 {
            let mut b = s.launch_builder(&self.expert_dx_scatter);
            b.arg(&mut dxn).arg(&dxe_all).arg(&c.slot_row).arg(&c.ids);
            b.arg(&n32).arg(&k32).arg(&d32).arg(&rows32);
            // SAFETY: a thread per (t < n, c < d): dxn at t·d + c (n·d); ids and slot_row at
            // t·k + j (n·k); dxe_all at batch rows < rows only (rows·d).
            unsafe { b.launch(super::ops::cfg(n * d)) }?;
        }
        let mut dlogits = self.zeros(n * e)?;
        self.bwd
            .router_backward(s, &mut dlogits, &dgate, &c.ids, &c.weights, n, e, k)?;
        let mut dxr = self.zeros(n * d)?;
        self.lin.backward(
            &p.router,
            &c.router_lin,
            &w.router,
            &dlogits,
            Some(&mut dxr),
            &mut g.router,
        )?;
        self.ops.add_into(s, &mut dxn, &dxr, n * d)?;
        self.bwd.rmsnorm_backward(
            s,
            dh,
            &mut g.mlp_norm,
            &dxn,
            &c.x,
            &w.mlp_norm,
            &c.rstd,
            n,
            d,
        )
    }

    fn layer_grads(&self, cfg: &ModelConfig) -> Result<LayerGrads, CudaError> {
        let (d, e, f, fs) = (cfg.d_model, cfg.n_experts, cfg.d_ff, cfg.d_ff_shared);
        Ok(LayerGrads {
            attn_norm: self.zeros(d)?,
            linear_qkv: self.zeros(3 * d * d)?,
            linear_proj: self.zeros(d * d)?,
            mlp_norm: self.zeros(d)?,
            router: self.zeros(e * d)?,
            experts_fc1: self.zeros(e * 2 * f * d)?,
            experts_fc2: self.zeros(e * d * f)?,
            shared_fc1: self.zeros(2 * fs * d)?,
            shared_fc2: self.zeros(d * fs)?,
        })
    }

    /// `model::backward` on the device: gradients w.r.t. the master weights from dL/dlogits
    /// `[rows, V]` (layout row order, the forward's rows), copied back as [`Params`].
    pub fn backward(
        &self,
        m: &TrainModel,
        cache: &TrainCache,
        dlogits: &[f32],
    ) -> Result<Params, CudaError> {
        let cfg = &m.config;
        let s = &self.stream;
        let (n, d) = (cache.layout.rows, cfg.d_model);
        if dlogits.len() != n * cfg.vocab {
            return Err(CudaError::Shape(format!(
                "backward: dlogits holds {} values, needs [{n}, {}]",
                dlogits.len(),
                cfg.vocab
            )));
        }
        let dlog = if dlogits.is_empty() {
            self.zeros(1)?
        } else {
            s.clone_htod(dlogits)?
        };
        let mut grads = (0..cfg.n_layers)
            .map(|_| self.layer_grads(cfg))
            .collect::<Result<Vec<_>, _>>()?;
        let (mut dwte, mut dwpe) = (self.zeros(cfg.vocab * d)?, self.zeros(cfg.max_seq * d)?);
        let (mut dfinal, mut dout) = (self.zeros(d)?, self.zeros(cfg.vocab * d)?);
        let mut dhn = self.zeros(n * d)?;
        self.lin.backward(
            &m.plan.output_layer,
            &cache.out_lin,
            &m.output_layer,
            &dlog,
            Some(&mut dhn),
            &mut dout,
        )?;
        let mut dh = self.zeros(n * d)?;
        self.bwd.rmsnorm_backward(
            s,
            &mut dh,
            &mut dfinal,
            &dhn,
            &cache.h_final,
            &m.final_norm,
            &cache.final_rstd,
            n,
            d,
        )?;
        for l in (0..cfg.n_layers).rev() {
            let (w, p, c, g) = (
                &m.layers[l],
                &m.plan.layers[l],
                &cache.layers[l],
                &mut grads[l],
            );
            self.moe_backward(w, p, cfg, &c.moe, &mut dh, g, n)?;
            self.attn_backward(w, p, cfg, &c.attn, &mut dh, g, cache)?;
        }
        self.bwd.embedding_backward(
            s,
            &mut dwte,
            &mut dwpe,
            &dh,
            &cache.tokens,
            &cache.layout.positions,
            n,
            d,
        )?;
        self.download(cfg, &grads, (&dwte, &dwpe, &dfinal, &dout))
    }

    /// The gradients as host [`Params`] (one staged copy back).
    fn download(
        &self,
        cfg: &ModelConfig,
        grads: &[LayerGrads],
        (wte, wpe, final_norm, output): (
            &CudaSlice<f32>,
            &CudaSlice<f32>,
            &CudaSlice<f32>,
            &CudaSlice<f32>,
        ),
    ) -> Result<Params, CudaError> {
        let mut p = Params::zeros(cfg);
        let mut parts: Vec<(&CudaSlice<f32>, &mut [f32])> = vec![
            (wte, &mut p.wte),
            (wpe, &mut p.wpe),
            (final_norm, &mut p.final_norm),
            (output, &mut p.output_layer),
        ];
        for (dst, g) in p.layers.iter_mut().zip(grads) {
            let LayerParams {
                attn_norm,
                linear_qkv,
                linear_proj,
                mlp_norm,
                router,
                experts_fc1,
                experts_fc2,
                shared_fc1,
                shared_fc2,
            } = dst;
            parts.extend([
                (&g.attn_norm, &mut attn_norm[..]),
                (&g.linear_qkv, &mut linear_qkv[..]),
                (&g.linear_proj, &mut linear_proj[..]),
                (&g.mlp_norm, &mut mlp_norm[..]),
                (&g.router, &mut router[..]),
                (&g.experts_fc1, &mut experts_fc1[..]),
                (&g.experts_fc2, &mut experts_fc2[..]),
                (&g.shared_fc1, &mut shared_fc1[..]),
                (&g.shared_fc2, &mut shared_fc2[..]),
            ]);
        }
        self.lin.staging().download(&mut parts)?;
        Ok(p)
    }
}

/// `CudaBackend`'s [`TrainPass`]: one of its resident trainers (back to the pool on drop), the
/// uploaded model and the forward's cache.
pub struct ResidentPass<'a> {
    backend: &'a CudaBackend,
    trainer: Option<ResidentTrainer>,
    model: TrainModel,
    forward: TrainForward,
}

impl<'a> ResidentPass<'a> {
    /// Upload `prep` and run the forward over `layout`'s rows.
    pub fn new(
        backend: &'a CudaBackend,
        prep: &PreparedModel,
        tokens: &[u32],
        layout: &Layout,
        replay: Option<&Routing>,
    ) -> Result<Self, CudaError> {
        let trainer = backend.take_trainer()?;
        let run = || -> Result<_, CudaError> {
            let t0 = std::time::Instant::now();
            // Queued, not waited for: the forward's kernels follow the copy on the stream.
            let model = trainer.upload(prep)?;
            backend.note_model_upload(t0);
            let t1 = std::time::Instant::now();
            let forward = trainer.forward(&model, tokens, layout, replay)?;
            backend.note_train_forward(t1);
            Ok((model, forward))
        };
        match run() {
            Ok((model, forward)) => Ok(ResidentPass {
                backend,
                trainer: Some(trainer),
                model,
                forward,
            }),
            Err(e) => {
                backend.give_trainer(trainer);
                Err(e)
            }
        }
    }

    fn trainer(&self) -> &ResidentTrainer {
        self.trainer.as_ref().expect("held until drop")
    }

    /// GPU failures cannot be returned through the trait: they panic with the device, which
    /// `suite::builtin::run_one` turns into a `failed` run with that message (as `gemm` does).
    fn fail(&self, what: &str, e: CudaError) -> ! {
        panic!(
            "cuda:{}: resident trainer {what} failed: {e}",
            self.backend.device().ordinal()
        )
    }
}

impl TrainPass for ResidentPass<'_> {
    fn logits(&self) -> &[f32] {
        &self.forward.logits
    }

    fn quant_stats(&self) -> Vec<(String, QuantStats)> {
        self.trainer()
            .quant_stats(&self.model, &self.forward.cache)
            .unwrap_or_else(|e| self.fail("quantization counts", e))
    }

    fn backward(&self, dlogits: &[f32]) -> Params {
        self.trainer()
            .backward(&self.model, &self.forward.cache, dlogits)
            .unwrap_or_else(|e| self.fail("backward", e))
    }
}

impl Drop for ResidentPass<'_> {
    fn drop(&mut self) {
        if let Some(t) = self.trainer.take() {
            self.backend.give_trainer(t);
        }
    }
}

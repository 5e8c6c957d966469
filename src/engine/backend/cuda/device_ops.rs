//! [`GpuOps`]: the model's op set ([`Ops`]) on one GPU — device buffers, the kernels of
//! `ops.cu`, `backward.cu`, `moe.cu`, `train.cu` and `kv.cu`, the linear layer of
//! [`CudaLinear`] (the one quantizer's device side, cuBLAS GEMMs), all queued on one stream in
//! program order. No model logic lives here: the passes are `model::pass`.
//!
//! Layout choices that differ from the CPU's, and why they give the same numbers:
//! - the routed experts run as one capacity-padded batch ([`ExpertBatch`]): expert e owns rows
//!   `[e·cap, (e+1)·cap)`, its tokens in token order then zero rows, with `cap` the row count
//!   rounded up to 128 so that no column-quantization block straddles two experts. Zero rows
//!   change no amax (no code), add nothing to a GEMM and are not counted as saturated or
//!   underflowed (the `elements` count includes them);
//! - every quantization and every op summed in a fixed order gives the CPU's bits for the same
//!   inputs; cuBLAS sums GEMMs in another order than `matrixmultiply`, CUDA's `expf` may differ
//!   by an ulp, and the experts' dx is summed per token over its choices, so logits and
//!   gradients agree with the CPU's to a tolerance (`tests/cuda_train.rs` measures it), and run
//!   to run bit for bit.

use super::backward::{CudaBackwardOps, DeviceGroups};
use super::linear::{CudaLinear, DeviceLinearCache, DeviceWeight};
use super::moe::ExpertBatch;
use super::ops::{CudaOps, DeviceLayout, cfg, cfg_warps, dim};
use super::{CudaDevice, CudaError};
use crate::engine::device::{OpError, OpResult, Ops, SiteCounts};
use crate::engine::layout::Layout;
use crate::engine::linear::PreparedWeight;
use crate::engine::model::PreparedModel;
use crate::engine::model::pass::{LayerWeights, Weights};
use crate::formats::QuantStats;
use crate::recipe::SitePlan;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use std::sync::Arc;

const TRAIN_SRC: &str = include_str!("train.cu");
const KV_SRC: &str = include_str!("kv.cu");

/// Expert batch rows are a multiple of this: the largest block a column quantization uses
/// (FP8 block's 128), so that blocks never straddle two experts.
const CAP_MULTIPLE: usize = 128;

impl From<CudaError> for OpError {
    fn from(e: CudaError) -> Self {
        match e {
            CudaError::Shape(s) => OpError::Shape(s),
            e => OpError::Device(e.to_string()),
        }
    }
}

/// A linear forward's cache on the device, with its activation counts
/// (`[elements, saturated, underflowed]`).
pub struct GpuLin {
    cache: DeviceLinearCache,
    counts: CudaSlice<u64>,
}

/// The routed slots' rows in the capacity-padded expert batch (`moe.cu`).
pub struct GpuDispatch {
    /// Batch row of each slot `n·k + j`.
    slot_row: CudaSlice<u32>,
    /// Token row each batch row is gathered from.
    src_row: CudaSlice<u32>,
    cap: usize,
    e: usize,
    n: usize,
}

/// A decoder's keys and values on the device (`kv.cu`): per layer `[seqs · capacity, 3d]`,
/// sequence i's position p at row `i · capacity + p`, K and V columns rounded to BF16.
pub struct DeviceKvCache {
    layers: Vec<CudaSlice<f32>>,
    seqs: usize,
    capacity: usize,
    len: usize,
    width: usize,
}

/// A row layout on the device; `groups` for the attention backward.
pub struct GpuRows {
    layout: DeviceLayout,
    groups: Option<DeviceGroups>,
}

/// The op set on one GPU; see the module doc.
pub struct GpuOps {
    stream: Arc<CudaStream>,
    lin: CudaLinear,
    k: CudaOps,
    bwd: CudaBackwardOps,
    batch: ExpertBatch,
    expert_dy: CudaFunction,
    expert_dx_scatter: CudaFunction,
    kv_store: CudaFunction,
}

impl GpuOps {
    /// Compile the kernels and open a cuBLAS handle on `dev`, with a stream of their own.
    pub fn new(dev: &Arc<CudaDevice>) -> Result<Self, CudaError> {
        let lin = CudaLinear::new(dev)?;
        let train = dev.compile_with_prelude("train", TRAIN_SRC)?;
        let kv = dev.compile("kv", KV_SRC)?;
        Ok(GpuOps {
            stream: lin.stream().clone(),
            lin,
            k: CudaOps::new(dev)?,
            bwd: CudaBackwardOps::new(dev)?,
            batch: ExpertBatch::new(dev)?,
            expert_dy: train.load_function("expert_dy")?,
            expert_dx_scatter: train.load_function("expert_dx_scatter")?,
            kv_store: kv.load_function("kv_store")?,
        })
    }

    /// The stream every op is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn output(&self, n: usize) -> Result<CudaSlice<f32>, CudaError> {
        super::output_buffer(&self.stream, n)
    }

    fn zeros_f(&self, n: usize) -> Result<CudaSlice<f32>, CudaError> {
        Ok(self.stream.alloc_zeros(n.max(1))?)
    }

    /// Copy a step's prepared weights (forward and dgrad operands) to the device in one staged
    /// copy: the tensors are listed in one fixed order and taken back in the same order.
    pub fn upload_model(&self, prep: &PreparedModel) -> Result<Weights<GpuOps>, CudaError> {
        self.upload_model_with(prep, true)
    }

    /// [`GpuOps::upload_model`] without the dgrad operands, for passes that never run a
    /// backward (the rollout's decode, the reference forward): where a recipe's backward reads
    /// other operands than its forward (`-hp`, `-dq`), half the bytes and copies.
    pub fn upload_model_for_inference(
        &self,
        prep: &PreparedModel,
    ) -> Result<Weights<GpuOps>, CudaError> {
        self.upload_model_with(prep, false)
    }

    fn upload_model_with(
        &self,
        prep: &PreparedModel,
        dgrad: bool,
    ) -> Result<Weights<GpuOps>, CudaError> {
        let one = |x| vec![x];
        fn parts(ws: &[PreparedWeight], dgrad: bool) -> Result<Vec<Vec<&[f32]>>, CudaError> {
            let [fwd, bwd] = DeviceWeight::parts(ws)?;
            Ok(if dgrad { vec![fwd, bwd] } else { vec![fwd] })
        }
        let mut groups = vec![one(&prep.wte[..]), one(&prep.wpe), one(&prep.final_norm)];
        groups.extend(parts(std::slice::from_ref(&prep.output_layer), dgrad)?);
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
                groups.extend(parts(ws, dgrad)?);
            }
        }
        let mut bufs = self.lin.staging().upload(&groups)?.into_iter();
        let next = |b: &mut std::vec::IntoIter<_>| b.next().expect("one buffer per group");
        let weight = |b: &mut std::vec::IntoIter<_>, ws: &[_]| {
            let w_fwd = next(b);
            if dgrad {
                DeviceWeight::from_parts(ws, w_fwd, next(b))
            } else {
                DeviceWeight::forward_only(ws, w_fwd)
            }
        };
        let b = &mut bufs;
        let (wte, wpe, final_norm) = (next(b), next(b), next(b));
        let output_layer = weight(b, std::slice::from_ref(&prep.output_layer));
        let layers = prep
            .layers
            .iter()
            .map(|l| LayerWeights {
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
        Ok(Weights {
            config: prep.config.clone(),
            plan: prep.plan.clone(),
            wte,
            wpe,
            layers,
            final_norm,
            output_layer,
        })
    }

    /// [`CudaLinear::forward_counted`] into a fresh count buffer.
    fn linear_counted(
        &self,
        plan: &SitePlan,
        x: &CudaSlice<f32>,
        n: usize,
        w: &DeviceWeight,
    ) -> OpResult<(CudaSlice<f32>, GpuLin)> {
        let mut counts = self.stream.alloc_zeros::<u64>(3).map_err(CudaError::from)?;
        let (y, cache) = self.lin.forward_counted(plan, x, n, w, Some(&mut counts))?;
        Ok((y, GpuLin { cache, counts }))
    }
}

impl Ops for GpuOps {
    type T = CudaSlice<f32>;
    type Ids = CudaSlice<u32>;
    type Param = CudaSlice<f32>;
    type Weight = DeviceWeight;
    type Experts = DeviceWeight;
    type Lin = GpuLin;
    type ExpertLin = GpuLin;
    type Dispatch = GpuDispatch;
    type Rows = GpuRows;
    type Kv = DeviceKvCache;

    fn zeros(&self, n: usize) -> OpResult<CudaSlice<f32>> {
        Ok(self.zeros_f(n)?)
    }

    fn upload(&self, x: &[f32]) -> OpResult<CudaSlice<f32>> {
        if x.is_empty() {
            return self.zeros(1);
        }
        Ok(self.stream.clone_htod(x).map_err(CudaError::from)?)
    }

    fn to_host(&self, t: &CudaSlice<f32>, n: usize) -> OpResult<Vec<f32>> {
        if n == 0 {
            return Ok(Vec::new());
        }
        Ok(self
            .stream
            .clone_dtoh(&t.slice(..n))
            .map_err(CudaError::from)?)
    }

    fn all_to_host(&self, ts: Vec<(CudaSlice<f32>, usize)>) -> OpResult<Vec<Vec<f32>>> {
        let mut host: Vec<Vec<f32>> = ts.iter().map(|(_, n)| vec![0.0; *n]).collect();
        let mut parts: Vec<(&CudaSlice<f32>, &mut [f32])> = ts
            .iter()
            .zip(host.iter_mut())
            .map(|((t, _), h)| (t, &mut h[..]))
            .collect();
        self.lin.staging().download(&mut parts)?;
        Ok(host)
    }

    fn ids(&self, v: &[u32]) -> OpResult<CudaSlice<u32>> {
        let s = &self.stream;
        Ok(if v.is_empty() {
            s.alloc_zeros::<u32>(1)
        } else {
            s.clone_htod(v)
        }
        .map_err(CudaError::from)?)
    }

    fn ids_to_host(&self, ids: &[&CudaSlice<u32>], nk: usize) -> OpResult<Vec<Vec<u32>>> {
        let s = &self.stream;
        // Every layer's ids gathered on the device: one copy back, not one per layer.
        let mut all = s
            .alloc_zeros::<u32>((ids.len() * nk).max(1))
            .map_err(CudaError::from)?;
        if nk > 0 {
            for (l, layer) in ids.iter().enumerate() {
                s.memcpy_dtod(&layer.slice(..nk), &mut all.slice_mut(l * nk..(l + 1) * nk))
                    .map_err(CudaError::from)?;
            }
        }
        let all = s.clone_dtoh(&all).map_err(CudaError::from)?;
        Ok((0..ids.len())
            .map(|l| all[l * nk..(l + 1) * nk].to_vec())
            .collect())
    }

    fn rows(&self, layout: &Layout) -> OpResult<GpuRows> {
        Ok(GpuRows {
            layout: DeviceLayout::upload(&self.stream, layout)?,
            groups: Some(DeviceGroups::upload(&self.stream, layout)?),
        })
    }

    /// One stream: `a` then `b`, queued in that order.
    fn join<A: Send, B: Send>(
        &self,
        a: impl FnOnce() -> A + Send,
        b: impl FnOnce() -> B + Send,
    ) -> (A, B) {
        let ra = a();
        (ra, b())
    }

    fn embedding(
        &self,
        tokens: &CudaSlice<u32>,
        rows: &GpuRows,
        wte: &CudaSlice<f32>,
        wpe: &CudaSlice<f32>,
        n: usize,
        d: usize,
    ) -> OpResult<CudaSlice<f32>> {
        let mut h = self.output(n * d)?;
        self.k.embedding_forward(
            &self.stream,
            &mut h,
            tokens,
            &rows.layout.positions,
            wte,
            wpe,
            n,
            d,
        )?;
        Ok(h)
    }

    fn embedding_backward(
        &self,
        dwte: &mut CudaSlice<f32>,
        dwpe: &mut CudaSlice<f32>,
        dh: &CudaSlice<f32>,
        tokens: &CudaSlice<u32>,
        rows: &GpuRows,
        n: usize,
        d: usize,
    ) -> OpResult<()> {
        let pos = &rows.layout.positions;
        Ok(self
            .bwd
            .embedding_backward(&self.stream, dwte, dwpe, dh, tokens, pos, n, d)?)
    }

    fn rmsnorm(
        &self,
        x: &CudaSlice<f32>,
        g: &CudaSlice<f32>,
        n: usize,
        d: usize,
    ) -> OpResult<(CudaSlice<f32>, CudaSlice<f32>)> {
        let (mut out, mut rstd) = (self.output(n * d)?, self.output(n)?);
        self.k
            .rmsnorm_forward(&self.stream, &mut out, &mut rstd, x, g, n, d)?;
        Ok((out, rstd))
    }

    fn rmsnorm_backward(
        &self,
        dx: &mut CudaSlice<f32>,
        dg: &mut CudaSlice<f32>,
        dy: &CudaSlice<f32>,
        x: &CudaSlice<f32>,
        g: &CudaSlice<f32>,
        rstd: &CudaSlice<f32>,
        n: usize,
        d: usize,
    ) -> OpResult<()> {
        Ok(self
            .bwd
            .rmsnorm_backward(&self.stream, dx, dg, dy, x, g, rstd, n, d)?)
    }

    fn add_into(&self, dst: &mut CudaSlice<f32>, src: &CudaSlice<f32>, n: usize) -> OpResult<()> {
        Ok(self.k.add_into(&self.stream, dst, src, n)?)
    }

    fn swiglu(&self, x: &CudaSlice<f32>, n: usize, f: usize) -> OpResult<CudaSlice<f32>> {
        let mut act = self.output(n * f)?;
        self.k.swiglu_forward(&self.stream, &mut act, x, n, f)?;
        Ok(act)
    }

    fn swiglu_backward(
        &self,
        dy: &CudaSlice<f32>,
        x: &CudaSlice<f32>,
        n: usize,
        f: usize,
    ) -> OpResult<CudaSlice<f32>> {
        let mut dx = self.zeros_f(n * 2 * f)?;
        self.bwd
            .swiglu_backward(&self.stream, &mut dx, dy, x, n, f)?;
        Ok(dx)
    }

    fn attention(
        &self,
        qkv: &CudaSlice<f32>,
        rows: &GpuRows,
        h: usize,
        d: usize,
    ) -> OpResult<(CudaSlice<f32>, CudaSlice<f32>)> {
        let dl = &rows.layout;
        let (mut att, mut probs) = (
            self.output(dl.rows * d)?,
            self.output(dl.rows * h * dl.max_context)?,
        );
        self.k
            .attention_forward(&self.stream, &mut att, &mut probs, qkv, dl, h, d)?;
        Ok((att, probs))
    }

    fn attention_backward(
        &self,
        dy: &CudaSlice<f32>,
        qkv: &CudaSlice<f32>,
        probs: &CudaSlice<f32>,
        rows: &GpuRows,
        h: usize,
        d: usize,
    ) -> OpResult<CudaSlice<f32>> {
        let groups = rows
            .groups
            .as_ref()
            .ok_or_else(|| OpError::Shape("attention backward over decode rows".into()))?;
        let mut dqkv = self.zeros_f(rows.layout.rows * 3 * d)?;
        self.bwd.attention_backward(
            &self.stream,
            &mut dqkv,
            dy,
            qkv,
            probs,
            &rows.layout,
            groups,
            h,
            d,
        )?;
        Ok(dqkv)
    }

    fn linear(
        &self,
        plan: &SitePlan,
        x: &CudaSlice<f32>,
        n: usize,
        w: &DeviceWeight,
    ) -> OpResult<(CudaSlice<f32>, GpuLin)> {
        self.linear_counted(plan, x, n, w)
    }

    fn linear_backward(
        &self,
        plan: &SitePlan,
        c: &GpuLin,
        w: &DeviceWeight,
        dy: &CudaSlice<f32>,
        dx: Option<&mut CudaSlice<f32>>,
        dw: &mut CudaSlice<f32>,
    ) -> OpResult<()> {
        Ok(self.lin.backward(plan, &c.cache, w, dy, dx, dw)?)
    }

    fn experts_linear(
        &self,
        plan: &SitePlan,
        x: &CudaSlice<f32>,
        disp: &GpuDispatch,
        w: &DeviceWeight,
    ) -> OpResult<(CudaSlice<f32>, GpuLin)> {
        self.linear_counted(plan, x, disp.cap, w)
    }

    fn experts_linear_backward(
        &self,
        plan: &SitePlan,
        c: &GpuLin,
        w: &DeviceWeight,
        dy: &CudaSlice<f32>,
        dx: &mut CudaSlice<f32>,
        dw: &mut CudaSlice<f32>,
    ) -> OpResult<()> {
        Ok(self.lin.backward(plan, &c.cache, w, dy, Some(dx), dw)?)
    }

    fn apply(
        &self,
        plan: &SitePlan,
        x: &CudaSlice<f32>,
        n: usize,
        w: &DeviceWeight,
    ) -> OpResult<CudaSlice<f32>> {
        Ok(self.lin.apply(plan, x, n, w)?)
    }

    fn apply_experts(
        &self,
        plan: &SitePlan,
        x: &CudaSlice<f32>,
        disp: &GpuDispatch,
        w: &DeviceWeight,
    ) -> OpResult<CudaSlice<f32>> {
        Ok(self.lin.apply(plan, x, disp.cap, w)?)
    }

    fn counts(&self, sites: &[SiteCounts<'_, Self>]) -> OpResult<Vec<QuantStats>> {
        let s = &self.stream;
        // Every site's counts gathered on the device: one copy back.
        let mut all = s
            .alloc_zeros::<u64>((3 * sites.len()).max(1))
            .map_err(CudaError::from)?;
        for (i, site) in sites.iter().enumerate() {
            let c = match site {
                SiteCounts::One(c) | SiteCounts::Experts(c) => &c.counts,
            };
            s.memcpy_dtod(&c.slice(..3), &mut all.slice_mut(3 * i..3 * i + 3))
                .map_err(CudaError::from)?;
        }
        let all = s.clone_dtoh(&all).map_err(CudaError::from)?;
        Ok(all
            .chunks_exact(3)
            .take(sites.len())
            .map(|v| QuantStats {
                elements: v[0],
                saturated: v[1],
                underflowed: v[2],
            })
            .collect())
    }

    fn route(
        &self,
        logits: &CudaSlice<f32>,
        n: usize,
        e: usize,
        k: usize,
        replay: Option<&[u32]>,
    ) -> OpResult<(CudaSlice<u32>, CudaSlice<f32>)> {
        Ok(self.k.route(&self.stream, logits, n, e, k, replay)?)
    }

    fn route_backward(
        &self,
        dweights: &CudaSlice<f32>,
        ids: &CudaSlice<u32>,
        weights: &CudaSlice<f32>,
        n: usize,
        e: usize,
        k: usize,
    ) -> OpResult<CudaSlice<f32>> {
        let mut dlogits = self.zeros_f(n * e)?;
        self.bwd
            .router_backward(&self.stream, &mut dlogits, dweights, ids, weights, n, e, k)?;
        Ok(dlogits)
    }

    fn dispatch(
        &self,
        ids: &CudaSlice<u32>,
        n: usize,
        k: usize,
        e: usize,
    ) -> OpResult<GpuDispatch> {
        let cap = n.div_ceil(CAP_MULTIPLE) * CAP_MULTIPLE;
        let slots = self.batch.route(&self.stream, ids, (n, k, e), cap)?;
        Ok(GpuDispatch {
            slot_row: slots.slot_row,
            src_row: slots.src_row,
            cap,
            e,
            n,
        })
    }

    fn dispatch_rows(&self, d: &GpuDispatch) -> usize {
        d.e * d.cap
    }

    fn gather(&self, x: &CudaSlice<f32>, disp: &GpuDispatch, d: usize) -> OpResult<CudaSlice<f32>> {
        let rows = disp.e * disp.cap;
        let mut xe = self.output(rows * d)?;
        self.batch
            .gather(&self.stream, &mut xe, x, &disp.src_row, rows, d, disp.n)?;
        Ok(xe)
    }

    fn combine(
        &self,
        x: &CudaSlice<f32>,
        shared: &CudaSlice<f32>,
        experts: &CudaSlice<f32>,
        ids: &CudaSlice<u32>,
        disp: &GpuDispatch,
        weights: &CudaSlice<f32>,
        (n, k, d): (usize, usize, usize),
    ) -> OpResult<CudaSlice<f32>> {
        let mut out = self.output(n * d)?;
        self.k.moe_combine(
            &self.stream,
            &mut out,
            shared,
            experts,
            &disp.slot_row,
            ids,
            weights,
            x,
            n,
            k,
            d,
        )?;
        Ok(out)
    }

    fn combine_backward(
        &self,
        dh: &CudaSlice<f32>,
        experts: &CudaSlice<f32>,
        disp: &GpuDispatch,
        weights: &CudaSlice<f32>,
        (n, k, d): (usize, usize, usize),
    ) -> OpResult<(CudaSlice<f32>, CudaSlice<f32>)> {
        let rows = disp.e * disp.cap;
        let (mut dy, mut dgate) = (self.zeros_f(rows * d)?, self.zeros_f(n * k)?);
        if n * k > 0 {
            let op = "moe backward";
            let (nk32, k32, d32, rows32) = (
                dim(op, "slots", n * k)?,
                dim(op, "k", k)?,
                dim(op, "d", d)?,
                dim(op, "rows", rows)?,
            );
            let mut b = self.stream.launch_builder(&self.expert_dy);
            b.arg(&mut dy).arg(&mut dgate).arg(dh).arg(experts);
            b.arg(&disp.slot_row).arg(weights);
            b.arg(&nk32).arg(&k32).arg(&d32).arg(&rows32);
            // SAFETY: a warp per slot s < n·k (slot_row, weights, dgate hold n·k); dh read at
            // row s/k < n (n·d); experts and dy at batch rows < rows only (rows·d each).
            unsafe { b.launch(cfg_warps(n * k)) }.map_err(CudaError::from)?;
        }
        Ok((dy, dgate))
    }

    fn scatter_add(
        &self,
        dx: &mut CudaSlice<f32>,
        dexperts: &CudaSlice<f32>,
        ids: &CudaSlice<u32>,
        disp: &GpuDispatch,
        (n, k, d): (usize, usize, usize),
    ) -> OpResult<()> {
        if n * d == 0 {
            return Ok(());
        }
        let op = "moe backward";
        let rows = disp.e * disp.cap;
        let (n32, k32, d32, rows32) = (
            dim(op, "n", n)?,
            dim(op, "k", k)?,
            dim(op, "d", d)?,
            dim(op, "rows", rows)?,
        );
        let mut b = self.stream.launch_builder(&self.expert_dx_scatter);
        b.arg(dx).arg(dexperts).arg(&disp.slot_row).arg(ids);
        b.arg(&n32).arg(&k32).arg(&d32).arg(&rows32);
        // SAFETY: a thread per (t < n, c < d): dx at t·d + c (n·d); ids and slot_row at
        // t·k + j (n·k); dexperts at batch rows < rows only (rows·d).
        unsafe { b.launch(cfg(n * d)) }.map_err(CudaError::from)?;
        Ok(())
    }

    fn kv_cache(
        &self,
        layers: usize,
        seqs: usize,
        positions: usize,
        d: usize,
        _h: usize,
    ) -> OpResult<DeviceKvCache> {
        let width = 3 * d;
        let layers = (0..layers)
            .map(|_| self.zeros_f(seqs * positions * width))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(DeviceKvCache {
            layers,
            seqs,
            capacity: positions,
            len: 0,
            width,
        })
    }

    fn kv_len(&self, kv: &DeviceKvCache) -> usize {
        kv.len
    }

    fn kv_seqs(&self, kv: &DeviceKvCache) -> usize {
        kv.seqs
    }

    fn decode_rows(&self, kv: &DeviceKvCache, count: usize) -> OpResult<GpuRows> {
        if kv.len + count > kv.capacity {
            return Err(OpError::Shape(format!(
                "decode: {count} positions past the {} filled of {}",
                kv.len, kv.capacity
            )));
        }
        let layout = DeviceLayout::decode_rows(&self.stream, kv.seqs, kv.capacity, kv.len, count)?;
        Ok(GpuRows {
            layout,
            groups: None,
        })
    }

    /// Keys and values are stored BF16-rounded (as `model::KvCache` does); the queries stay
    /// unrounded.
    fn kv_attend(
        &self,
        kv: &mut DeviceKvCache,
        l: usize,
        qkv: &CudaSlice<f32>,
        rows: &GpuRows,
        h: usize,
        d: usize,
        count: usize,
    ) -> OpResult<CudaSlice<f32>> {
        let (seqs, cap, pos) = (kv.seqs, kv.capacity, kv.len);
        let n = seqs * count;
        let mut rounded = self.output(n * 3 * d)?;
        self.lin
            .fake_quantizer()
            .round_bf16(qkv, &mut rounded, n * 3 * d)?;
        self.store_kv(&rounded, &mut kv.layers[l], (seqs, count), cap, pos, 3 * d)?;
        let dl = &rows.layout;
        let (mut att, mut probs) = (self.output(n * d)?, self.output(n * h * dl.max_context)?);
        self.k.attention_over(
            &self.stream,
            &mut att,
            &mut probs,
            qkv,
            (&kv.layers[l], seqs * cap),
            dl,
            h,
            d,
        )?;
        Ok(att)
    }

    fn kv_advance(&self, kv: &mut DeviceKvCache, count: usize) {
        kv.len += count;
    }

    fn kv_repeat_each(&self, kv: &mut DeviceKvCache, samples: usize) -> OpResult<()> {
        let (seqs, cap, w) = (kv.seqs * samples, kv.capacity, kv.width);
        let src_row: Vec<u32> = (0..seqs * cap)
            .map(|r| ((r / cap) / samples * cap + r % cap) as u32)
            .collect();
        let src_row = self.stream.clone_htod(&src_row).map_err(CudaError::from)?;
        for layer in &mut kv.layers {
            let mut out = self.zeros_f(seqs * cap * w)?;
            self.batch.gather(
                &self.stream,
                &mut out,
                &*layer,
                &src_row,
                seqs * cap,
                w,
                kv.seqs * cap,
            )?;
            *layer = out;
        }
        kv.seqs = seqs;
        Ok(())
    }
}

impl GpuOps {
    /// Cache row `i · capacity + pos + j` = x row `i · per_seq + j`, for each of `seqs`
    /// sequences and `j < per_seq` (rows of `width` floats; x sequence-major).
    fn store_kv(
        &self,
        x: &CudaSlice<f32>,
        cache: &mut CudaSlice<f32>,
        (seqs, per_seq): (usize, usize),
        capacity: usize,
        pos: usize,
        width: usize,
    ) -> Result<(), CudaError> {
        let n = seqs * per_seq;
        if pos + per_seq > capacity || cache.len() < seqs * capacity * width || x.len() < n * width
        {
            return Err(CudaError::Shape(format!(
                "kv_store: positions {pos}..{} of {capacity}, {seqs} sequences of {width}: cache \
                 holds {}, rows {}",
                pos + per_seq,
                cache.len(),
                x.len()
            )));
        }
        if n * width == 0 {
            return Ok(());
        }
        let op = "kv_store";
        let (n32, cap32, pos32, w32, per32) = (
            dim(op, "rows", n)?,
            dim(op, "capacity", capacity)?,
            dim(op, "position", pos)?,
            dim(op, "width", width)?,
            dim(op, "positions per sequence", per_seq)?,
        );
        let mut b = self.stream.launch_builder(&self.kv_store);
        b.arg(cache)
            .arg(x)
            .arg(&n32)
            .arg(&cap32)
            .arg(&pos32)
            .arg(&w32)
            .arg(&per32);
        // SAFETY: element idx < n·width reads x[idx] (x holds n·width) and writes cache at
        // (i·capacity + pos + j)·width + c < seqs·capacity·width (pos + per_seq ≤ capacity,
        // checked above).
        unsafe { b.launch(LaunchConfig::for_num_elems((n * width).min(1 << 20) as u32)) }?;
        Ok(())
    }
}

//! The device-resident forward: the policy's forward pass (`model::forward_rows`) with weights,
//! activations and routing kept on the GPU. Only the tokens and the layout go in; the logits and
//! the routed expert ids come back at the end, with no host round trip in between (routing sorts
//! the slots on the device into a capacity-padded expert batch: `moe.cu`).
//!
//! The same layers also decode (`ResidentForward::decode_step`, `model::decode_step` on the device):
//! one new position per sequence, keys and values kept in a device KV cache (`DeviceKvCache`,
//! BF16-rounded as `model::KvCache` stores them). That is the rollout's and the evaluation's
//! decoder on a GPU (`CudaBackend`'s `Backend::decoder`).
//!
//! These are the first pieces of the resident engine that the step targets need (docs/cuda.md):
//! op for op the CPU's, so the same plan quantizes the same activations the same way
//! (`CudaFakeQuantizer`, byte-equal to `formats::fake_quantize`). The trainer's own pass, which
//! keeps what its backward needs, is `cuda::train`; the optimizer runs on the host.
//!
//! What is identical to the CPU forward and what is not: every quantizer and every non-GEMM op
//! that the CPU computes in a fixed order (norms, embeddings, expert gather and combine) give the
//! CPU's bits for the same inputs; cuBLAS sums in another order than `matrixmultiply`, and the
//! GPU's `expf` may differ by an ulp, so logits agree to a tolerance, and a router near a tie can
//! pick another expert (tests measure both).

use super::fake_quant::CudaFakeQuantizer;
use super::moe::ExpertBatch;
use super::ops::{CudaOps, DeviceLayout, dim};
use super::staging::Staging;
use super::{CudaDevice, CudaError, CudaQuantizer};
use crate::engine::layout::Layout;
use crate::engine::linear::PreparedWeight;
use crate::engine::model::{ModelConfig, PreparedModel, Routing};
use crate::formats::QuantFormat;
use crate::formats::SecondScale;
use crate::recipe::SitePlan;
use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, StridedBatchedConfig};
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use std::sync::Arc;

const KV_SRC: &str = include_str!("kv.cu");

/// A matmul site on the device: its forward operand (already quantized and dequantized by
/// `linear::prepare_weight`) and the format its input activations are quantized to.
pub struct DeviceLinear {
    w: CudaSlice<f32>,
    out_dim: usize,
    in_dim: usize,
    act: Option<QuantFormat>,
}

/// One matmul site of every routed expert: the E forward operands stacked `[E, out, in]` (one
/// strided batched GEMM runs them all) and the format of the experts' input activations.
pub struct DeviceExperts {
    w: CudaSlice<f32>,
    out_dim: usize,
    in_dim: usize,
    act: Option<QuantFormat>,
}

/// One transformer block's device weights (see `model::PreparedLayer`).
pub struct DeviceLayer {
    attn_norm: CudaSlice<f32>,
    linear_qkv: DeviceLinear,
    linear_proj: DeviceLinear,
    mlp_norm: CudaSlice<f32>,
    router: DeviceLinear,
    experts_fc1: DeviceExperts,
    experts_fc2: DeviceExperts,
    shared_fc1: DeviceLinear,
    shared_fc2: DeviceLinear,
}

/// A prepared model uploaded once per optimizer step (`ResidentForward::upload`).
pub struct DeviceModel {
    config: ModelConfig,
    wte: CudaSlice<f32>,
    wpe: CudaSlice<f32>,
    layers: Vec<DeviceLayer>,
    final_norm: CudaSlice<f32>,
    output_layer: DeviceLinear,
}

/// What a resident forward returns: logits `[rows, V]` in layout row order and the experts chosen
/// in every layer (the same record `model::forward_rows` returns).
pub struct ForwardOutput {
    pub logits: Vec<f32>,
    pub routing: Routing,
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

impl DeviceKvCache {
    /// Positions filled so far (the position the next step writes).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Sequences decoded side by side.
    pub fn seqs(&self) -> usize {
        self.seqs
    }
}

/// Where one layer's decode step writes its keys and values: `per_seq` consecutive positions of
/// each of `seqs` sequences, from `pos`.
struct KvSlot<'a> {
    cache: &'a mut CudaSlice<f32>,
    seqs: usize,
    per_seq: usize,
    capacity: usize,
    pos: usize,
}

/// The kernels, cuBLAS handle and stream of resident forwards on one GPU. All work is queued on
/// one stream, so its order is the program order.
pub struct ResidentForward {
    stream: Arc<CudaStream>,
    fq: CudaFakeQuantizer,
    ops: CudaOps,
    blas: CudaBlas,
    /// `moe.cu`: routing to the capacity-padded expert batch, and its row gather.
    experts: ExpertBatch,
    /// `kv.cu`.
    kv_store: CudaFunction,
    /// Model uploads (one page-locked buffer).
    staging: Staging,
}

impl ResidentForward {
    /// Compile the kernels and open a cuBLAS handle (FP32, no TF32: `CUBLAS_PEDANTIC_MATH`) on
    /// `dev`.
    pub fn new(dev: &Arc<CudaDevice>) -> Result<Self, CudaError> {
        let q = Arc::new(CudaQuantizer::new(dev)?);
        let stream = q.stream().clone();
        let blas = super::gemm::pedantic_blas(&stream)?;
        let kv = dev.compile("kv", KV_SRC)?;
        let staging = Staging::new(&stream);
        Ok(ResidentForward {
            fq: CudaFakeQuantizer::new(q)?,
            ops: CudaOps::new(dev)?,
            stream,
            blas,
            experts: ExpertBatch::new(dev)?,
            kv_store: kv.load_function("kv_store")?,
            staging,
        })
    }

    /// The stream all of this forward's work is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Copy a step's prepared weights to the device (forward operands only), in one staged
    /// copy: the tensors are listed in one fixed order and taken back in the same order.
    pub fn upload(&self, prep: &PreparedModel) -> Result<DeviceModel, CudaError> {
        fn one(x: &[f32]) -> Vec<&[f32]> {
            vec![x]
        }
        fn fwd(ws: &[PreparedWeight]) -> Vec<&[f32]> {
            ws.iter().map(PreparedWeight::w_fwd).collect()
        }
        let mut groups = vec![
            one(&prep.wte),
            one(&prep.wpe),
            one(&prep.final_norm),
            one(prep.output_layer.w_fwd()),
        ];
        for l in &prep.layers {
            groups.extend([
                one(&l.attn_norm),
                one(l.linear_qkv.w_fwd()),
                one(l.linear_proj.w_fwd()),
                one(&l.mlp_norm),
                one(l.router.w_fwd()),
                fwd(&l.experts_fc1),
                fwd(&l.experts_fc2),
                one(l.shared_fc1.w_fwd()),
                one(l.shared_fc2.w_fwd()),
            ]);
        }
        let mut bufs = self.staging.upload(&groups)?.into_iter();
        let mut next = || bufs.next().expect("one buffer per group");
        let linear = |w: CudaSlice<f32>, pw: &PreparedWeight, plan: &SitePlan| DeviceLinear {
            w,
            out_dim: pw.out_dim,
            in_dim: pw.in_dim,
            act: plan.activation_format(),
        };
        let experts = |w: CudaSlice<f32>, ws: &[PreparedWeight], plan: &SitePlan| {
            let (out_dim, in_dim) = ws.first().map_or((0, 0), |w| (w.out_dim, w.in_dim));
            DeviceExperts {
                w,
                out_dim,
                in_dim,
                act: plan.activation_format(),
            }
        };
        let (wte, wpe, final_norm) = (next(), next(), next());
        let output_layer = linear(next(), &prep.output_layer, &prep.plan.output_layer);
        let layers = prep
            .layers
            .iter()
            .zip(&prep.plan.layers)
            .map(|(l, p)| DeviceLayer {
                attn_norm: next(),
                linear_qkv: linear(next(), &l.linear_qkv, &p.linear_qkv),
                linear_proj: linear(next(), &l.linear_proj, &p.linear_proj),
                mlp_norm: next(),
                router: linear(next(), &l.router, &p.router),
                experts_fc1: experts(next(), &l.experts_fc1, &p.experts_fc1),
                experts_fc2: experts(next(), &l.experts_fc2, &p.experts_fc2),
                shared_fc1: linear(next(), &l.shared_fc1, &p.shared_fc1),
                shared_fc2: linear(next(), &l.shared_fc2, &p.shared_fc2),
            })
            .collect();
        Ok(DeviceModel {
            config: prep.config.clone(),
            wte,
            wpe,
            layers,
            final_norm,
            output_layer,
        })
    }

    /// A zeroed device buffer of `n` floats (at least one: cudarc does not allocate zero bytes).
    fn zeros(&self, n: usize) -> Result<CudaSlice<f32>, CudaError> {
        Ok(self.stream.alloc_zeros(n.max(1))?)
    }

    /// A buffer of `n` floats for the op it is passed to to write in full ([`super::output_buffer`]).
    fn output(&self, n: usize) -> Result<CudaSlice<f32>, CudaError> {
        super::output_buffer(&self.stream, n)
    }

    /// `y[n, m] = x[n, k] · Wᵀ` with FP32 accumulation, for `batch` independent (x, W, y) triples
    /// stored back to back (the experts). Row-major buffers read column-major are their
    /// transposes: `yᵀ = W · xᵀ` is cuBLAS's `op(A) = T` on W's buffer (k x m column-major) times
    /// `op(B) = N` on x's.
    fn gemm_xwt<X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(
        &self,
        x: &X,
        w: &CudaSlice<f32>,
        y: &mut Y,
        (n, k, m): (usize, usize, usize),
        batch: usize,
    ) -> Result<(), CudaError> {
        if n == 0 || batch == 0 {
            return Ok(());
        }
        let dim = |v: usize| {
            i32::try_from(v).map_err(|_| {
                CudaError::Shape(format!("gemm dimension {v} exceeds cuBLAS's 32-bit limit"))
            })
        };
        let gemm = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_T,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: dim(m)?,
            n: dim(n)?,
            k: dim(k)?,
            alpha: 1.0f32,
            lda: dim(k)?,
            ldb: dim(k)?,
            beta: 0.0f32,
            ldc: dim(m)?,
        };
        if w.len() < batch * m * k || x.len() < batch * n * k || y.len() < batch * n * m {
            return Err(CudaError::Shape(format!(
                "resident gemm: buffers of {}, {}, {} floats for {batch} x (x [{n}, {k}], W [{m}, {k}], y [{n}, {m}])",
                x.len(),
                w.len(),
                y.len()
            )));
        }
        if batch == 1 {
            // SAFETY: checked just above: W holds m·k, x n·k and y n·m floats, and the leading
            // dimensions are the row lengths of the row-major buffers, so cuBLAS stays inside them.
            unsafe { self.blas.gemm(gemm, w, x, y) }?;
        } else {
            let cfg = StridedBatchedConfig {
                gemm,
                batch_size: dim(batch)?,
                stride_a: (m * k) as i64,
                stride_b: (n * k) as i64,
                stride_c: (n * m) as i64,
            };
            // SAFETY: as above for each of the `batch` triples, which lie back to back at the
            // strides given (checked: the buffers hold batch times each operand).
            unsafe { self.blas.gemm_strided_batched(cfg, w, x, y) }?;
        }
        Ok(())
    }

    /// `linear::forward`'s values: the input quantized per the site's activation format (BF16
    /// sites round to BF16; other formats quantize the BF16-rounded input), then the GEMM.
    fn linear_forward(
        &self,
        lin: &DeviceLinear,
        x: &CudaSlice<f32>,
        n: usize,
    ) -> Result<CudaSlice<f32>, CudaError> {
        let (k, m) = (lin.in_dim, lin.out_dim);
        let mut y = self.output(n * m)?;
        if n == 0 {
            return Ok(y);
        }
        match lin.act {
            None => self.gemm_xwt(x, &lin.w, &mut y, (n, k, m), 1)?,
            Some(fmt) => {
                let mut xq = self.output(n * k)?;
                if matches!(fmt, QuantFormat::Bf16) {
                    self.fq.fake_quantize_rows(x, n, k, &fmt, &mut xq)?;
                } else {
                    let mut hp = self.output(n * k)?;
                    self.fq.round_bf16(x, &mut hp, n * k)?;
                    self.fq.fake_quantize_rows(&hp, n, k, &fmt, &mut xq)?;
                }
                self.gemm_xwt(&xq, &lin.w, &mut y, (n, k, m), 1)?;
            }
        }
        Ok(y)
    }

    /// The input of one expert site quantized like `linear::forward` quantizes each expert's own
    /// rows: `x` is E blocks of `cap` rows. Row-local formats (every format but NVFP4 with a
    /// per-tensor activation scale) quantize all blocks in one call; a per-tensor scale is taken
    /// per expert, as on the CPU (zero padding rows change no amax).
    fn quantize_experts(
        &self,
        ex: &DeviceExperts,
        x: &CudaSlice<f32>,
        e: usize,
        cap: usize,
    ) -> Result<Option<CudaSlice<f32>>, CudaError> {
        let Some(fmt) = ex.act else {
            return Ok(None);
        };
        let (k, rows) = (ex.in_dim, e * cap);
        let mut xq = self.output(rows * k)?;
        let src = if matches!(fmt, QuantFormat::Bf16) {
            None
        } else {
            let mut hp = self.output(rows * k)?;
            self.fq.round_bf16(x, &mut hp, rows * k)?;
            Some(hp)
        };
        let src = src.as_ref().unwrap_or(x);
        let per_tensor = matches!(
            fmt,
            QuantFormat::Nvfp4 {
                second: SecondScale::PerTensor,
                ..
            }
        );
        if !per_tensor {
            self.fq.fake_quantize_rows(src, rows, k, &fmt, &mut xq)?;
            return Ok(Some(xq));
        }
        self.fq.per_block(src, &mut xq, (e, cap * k), |blk, q| {
            self.fq.fake_quantize_rows(blk, cap, k, &fmt, q)
        })?;
        Ok(Some(xq))
    }

    /// Every expert's linear site over its `cap` rows: `[E·cap, in]` → `[E·cap, out]`, one
    /// strided batched GEMM.
    fn experts_forward(
        &self,
        ex: &DeviceExperts,
        x: &CudaSlice<f32>,
        e: usize,
        cap: usize,
    ) -> Result<CudaSlice<f32>, CudaError> {
        let (k, m) = (ex.in_dim, ex.out_dim);
        let mut y = self.output(e * cap * m)?;
        match self.quantize_experts(ex, x, e, cap)? {
            Some(xq) => self.gemm_xwt(&xq, &ex.w, &mut y, (cap, k, m), e)?,
            None => self.gemm_xwt(x, &ex.w, &mut y, (cap, k, m), e)?,
        }
        Ok(y)
    }

    /// fc1 → SwiGLU → fc2 over `n` rows of `x`.
    fn ffn(
        &self,
        fc1: &DeviceLinear,
        fc2: &DeviceLinear,
        x: &CudaSlice<f32>,
        n: usize,
    ) -> Result<CudaSlice<f32>, CudaError> {
        let f = fc2.in_dim;
        let h = self.linear_forward(fc1, x, n)?;
        let mut act = self.output(n * f)?;
        if n > 0 {
            self.ops.swiglu_forward(&self.stream, &mut act, &h, n, f)?;
        }
        self.linear_forward(fc2, &act, n)
    }

    /// x [n, D] → x + proj(attention(qkv(rmsnorm(x)))). Keys and values are the rows' own, or in
    /// a decode step (`kv`) the cache's, after this step's rows are stored there (BF16-rounded,
    /// as `model::KvCache::store` does; the queries stay unrounded, as in `model::attn_step`).
    fn attention_block(
        &self,
        w: &DeviceLayer,
        cfg: &ModelConfig,
        x: &CudaSlice<f32>,
        layout: &DeviceLayout,
        kv: Option<KvSlot<'_>>,
    ) -> Result<CudaSlice<f32>, CudaError> {
        let (n, d, h) = (layout.rows, cfg.d_model, cfg.n_heads);
        let s = &self.stream;
        let (mut xn, mut rstd) = (self.output(n * d)?, self.output(n)?);
        self.ops
            .rmsnorm_forward(s, &mut xn, &mut rstd, x, &w.attn_norm, n, d)?;
        let qkv = self.linear_forward(&w.linear_qkv, &xn, n)?;
        let mut att = self.output(n * d)?;
        let mut probs = self.output(n * h * layout.max_context)?;
        match kv {
            None => self
                .ops
                .attention_forward(s, &mut att, &mut probs, &qkv, layout, h, d)?,
            Some(slot) => {
                let mut rounded = self.output(n * 3 * d)?;
                self.fq.round_bf16(&qkv, &mut rounded, n * 3 * d)?;
                self.store_kv(
                    &rounded,
                    &mut *slot.cache,
                    (slot.seqs, slot.per_seq),
                    slot.capacity,
                    slot.pos,
                    3 * d,
                )?;
                let rows = slot.seqs * slot.capacity;
                self.ops.attention_over(
                    s,
                    &mut att,
                    &mut probs,
                    &qkv,
                    (&*slot.cache, rows),
                    layout,
                    h,
                    d,
                )?;
            }
        }
        let mut out = self.linear_forward(&w.linear_proj, &att, n)?;
        self.ops.add_into(s, &mut out, x, n * d)?;
        Ok(out)
    }

    /// cache row `i · capacity + pos + j` = x row `i · per_seq + j`, for each of `seqs`
    /// sequences and `j < per_seq` (rows of `width` floats; x sequence-major).
    #[allow(clippy::too_many_arguments)]
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

    /// x [n, D] → x + shared(xn) + Σ gate · expert(xn), in `model::moe_forward`'s order, with no
    /// host round trip: the routed slots go to a capacity-padded batch of E blocks of n rows (a
    /// token picks an expert at most once; `moe.cu`), every expert runs in one batched GEMM per
    /// site, and the combine reads each slot's row. Returns the output and the chosen experts
    /// (`[n, K]`, on the device).
    fn moe_block(
        &self,
        w: &DeviceLayer,
        cfg: &ModelConfig,
        x: &CudaSlice<f32>,
        n: usize,
        replay: Option<&[u32]>,
    ) -> Result<(CudaSlice<f32>, CudaSlice<u32>), CudaError> {
        let (d, e, k) = (cfg.d_model, cfg.n_experts, cfg.top_k);
        let s = &self.stream;
        let (mut xn, mut rstd) = (self.output(n * d)?, self.output(n)?);
        self.ops
            .rmsnorm_forward(s, &mut xn, &mut rstd, x, &w.mlp_norm, n, d)?;
        let logits = self.linear_forward(&w.router, &xn, n)?;
        let (ids, weights) = self.ops.route(s, &logits, n, e, k, replay)?;
        let cap = n;
        let slots = self.experts.route(s, &ids, (n, k, e), cap)?;
        let mut xe = self.output(e * cap * d)?;
        self.experts
            .gather(s, &mut xe, &xn, &slots.src_row, e * cap, d, n)?;
        let shared = self.ffn(&w.shared_fc1, &w.shared_fc2, &xn, n)?;
        let f = w.experts_fc2.in_dim;
        let h = self.experts_forward(&w.experts_fc1, &xe, e, cap)?;
        let mut act = self.output(e * cap * f)?;
        self.ops
            .swiglu_forward(&self.stream, &mut act, &h, e * cap, f)?;
        let y_all = self.experts_forward(&w.experts_fc2, &act, e, cap)?;
        let mut out = self.output(n * d)?;
        self.ops.moe_combine(
            s,
            &mut out,
            &shared,
            &y_all,
            &slots.slot_row,
            &ids,
            &weights,
            x,
            n,
            k,
            d,
        )?;
        Ok((out, ids))
    }

    /// `model::forward_rows` on the device: logits `[rows, V]` and the routing record, both in
    /// layout row order. `replay` forces the experts (rollout routing replay).
    pub fn forward(
        &self,
        m: &DeviceModel,
        tokens: &[u32],
        layout: &Layout,
        replay: Option<&Routing>,
    ) -> Result<ForwardOutput, CudaError> {
        crate::engine::model::check_layout_inputs(&m.config, tokens, layout, replay)
            .map_err(|e| CudaError::Shape(e.to_string()))?;
        let dl = DeviceLayout::upload(&self.stream, layout)?;
        self.layers_forward(m, tokens, &dl, replay, None)
    }

    /// An empty KV cache for `seqs` sequences of up to `positions` (at most `max_seq`) positions.
    pub fn kv_cache(
        &self,
        m: &DeviceModel,
        seqs: usize,
        positions: usize,
    ) -> Result<DeviceKvCache, CudaError> {
        let cfg = &m.config;
        if positions > cfg.max_seq {
            return Err(CudaError::Shape(format!(
                "kv cache: {positions} positions exceed max_seq {}",
                cfg.max_seq
            )));
        }
        let width = 3 * cfg.d_model;
        let layers = (0..cfg.n_layers)
            .map(|_| self.zeros(seqs * positions * width))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(DeviceKvCache {
            layers,
            seqs,
            capacity: positions,
            len: 0,
            width,
        })
    }

    /// Each sequence's cache copied to `samples` consecutive sequences (`KvCache::repeat_each`:
    /// a prompt decoded once, then shared by its samples).
    pub fn repeat_each(&self, cache: &mut DeviceKvCache, samples: usize) -> Result<(), CudaError> {
        let (seqs, cap, w) = (cache.seqs * samples, cache.capacity, cache.width);
        let src_row: Vec<u32> = (0..seqs * cap)
            .map(|r| ((r / cap) / samples * cap + r % cap) as u32)
            .collect();
        let src_row = self.stream.clone_htod(&src_row)?;
        for layer in &mut cache.layers {
            let mut out = self.zeros(seqs * cap * w)?;
            self.experts.gather(
                &self.stream,
                &mut out,
                &*layer,
                &src_row,
                seqs * cap,
                w,
                cache.seqs * cap,
            )?;
            *layer = out;
        }
        cache.seqs = seqs;
        Ok(())
    }

    /// `model::decode_step` on the device: one new position for each of the cache's sequences
    /// (`tokens`, one each) attending over the cached positions; logits `[seqs, V]` and this
    /// position's routing.
    pub fn decode_step(
        &self,
        m: &DeviceModel,
        cache: &mut DeviceKvCache,
        tokens: &[u32],
        replay: Option<&Routing>,
    ) -> Result<ForwardOutput, CudaError> {
        self.decode_positions(m, cache, tokens, 1, replay)
    }

    /// `count` new positions of each of the cache's sequences at once (a prompt's: `tokens`
    /// sequence-major, `count` per sequence), each attending over its sequence's cached
    /// positions and the new ones up to itself: the rows of `count` decode steps in one pass.
    /// Logits `[seqs · count, V]` and routing in the same (sequence-major) row order.
    pub fn decode_positions(
        &self,
        m: &DeviceModel,
        cache: &mut DeviceKvCache,
        tokens: &[u32],
        count: usize,
        replay: Option<&Routing>,
    ) -> Result<ForwardOutput, CudaError> {
        let cfg = &m.config;
        let bad = |msg: String| CudaError::Shape(format!("decode step: {msg}"));
        if count == 0 || tokens.len() != cache.seqs * count {
            return Err(bad(format!(
                "{} tokens for {count} positions of a cache of {} sequences",
                tokens.len(),
                cache.seqs
            )));
        }
        if cache.len + count > cache.capacity {
            return Err(bad(format!(
                "{count} positions past the {} filled of {}",
                cache.len, cache.capacity
            )));
        }
        if cache.layers.len() != cfg.n_layers || cache.width != 3 * cfg.d_model {
            return Err(bad("cache was made for a different model config".into()));
        }
        crate::engine::model::check_tokens(cfg, tokens)
            .and_then(|()| replay.map_or(Ok(()), |r| r.check(cfg, tokens.len())))
            .map_err(|e| bad(e.to_string()))?;
        let dl =
            DeviceLayout::decode_rows(&self.stream, cache.seqs, cache.capacity, cache.len, count)?;
        let out = self.layers_forward(m, tokens, &dl, replay, Some(&mut *cache))?;
        cache.len += count;
        Ok(out)
    }

    /// Embedding, the blocks and the head over `dl`'s rows; keys and values from the rows
    /// themselves or, decoding, from `cache` (this step's written first).
    fn layers_forward(
        &self,
        m: &DeviceModel,
        tokens: &[u32],
        dl: &DeviceLayout,
        replay: Option<&Routing>,
        mut cache: Option<&mut DeviceKvCache>,
    ) -> Result<ForwardOutput, CudaError> {
        let cfg = &m.config;
        let (n, d, v) = (dl.rows, cfg.d_model, cfg.vocab);
        let s = &self.stream;
        let toks = s.clone_htod(tokens)?;
        let mut h = self.output(n * d)?;
        self.ops
            .embedding_forward(s, &mut h, &toks, &dl.positions, &m.wte, &m.wpe, n, d)?;
        let mut routing = Routing {
            top_k: cfg.top_k,
            n_tokens: n,
            layers: Vec::with_capacity(cfg.n_layers),
        };
        let mut ids = Vec::with_capacity(cfg.n_layers);
        for (l, w) in m.layers.iter().enumerate() {
            let slot = cache.as_deref_mut().map(|c| KvSlot {
                seqs: c.seqs,
                per_seq: dl.rows / c.seqs.max(1),
                capacity: c.capacity,
                pos: c.len,
                cache: &mut c.layers[l],
            });
            let mid = self.attention_block(w, cfg, &h, dl, slot)?;
            let r = replay.map(|r| r.layers[l].as_slice());
            let (out, layer_ids) = self.moe_block(w, cfg, &mid, n, r)?;
            ids.push(layer_ids);
            h = out;
        }
        let (mut hn, mut rstd) = (self.output(n * d)?, self.output(n)?);
        self.ops
            .rmsnorm_forward(s, &mut hn, &mut rstd, &h, &m.final_norm, n, d)?;
        let logits = self.linear_forward(&m.output_layer, &hn, n)?;
        // Every layer's ids gathered on the device: two copies back in all, not one per layer.
        let nk = n * cfg.top_k;
        // SAFETY: device memory, fully written by the gathering copies below before the read.
        let mut all_ids = unsafe { s.alloc::<u32>((ids.len() * nk).max(1))? };
        if nk > 0 {
            for (l, layer_ids) in ids.iter().enumerate() {
                s.memcpy_dtod(
                    &layer_ids.slice(..nk),
                    &mut all_ids.slice_mut(l * nk..(l + 1) * nk),
                )?;
            }
        }
        let logits = s.clone_dtoh(&logits.slice(..n * v))?;
        let all_ids = s.clone_dtoh(&all_ids)?;
        routing.layers = (0..ids.len())
            .map(|l| all_ids[l * nk..(l + 1) * nk].to_vec())
            .collect();
        Ok(ForwardOutput { logits, routing })
    }
}

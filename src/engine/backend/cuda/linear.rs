//! The precision-aware linear layer on the device: `engine::linear::forward` (keeping the
//! backward's operand, [`DeviceLinearCache`]) and `engine::linear::backward` over device tensors,
//! for a resident trainer. Every quantization is the CPU's, bit for bit
//! ([`CudaFakeQuantizer`]: rows, columns, and both with the block dimension zero-padded), so the
//! kept operand `x_bwd` equals the CPU's exactly. The GEMMs sum in FP32, so outputs and
//! gradients agree to summation order: cuBLAS FP32 (`CUBLAS_PEDANTIC_MATH`, no TF32), or, where
//! both operands hold only BF16 values (`linear::Operands::Bf16`: BF16 and MXFP8 operands), BF16
//! tensor cores accumulating in FP32, whose products are exact ([`GEMM_VAR`] turns them off).
//!
//! A site can also hold a batch of weights of one shape (the routed experts, stacked
//! `[E, out, in]`): each expert's rows are one block of the input, every GEMM is one strided
//! batched GEMM, and each quantization is per block where the CPU's is per expert (a per-tensor
//! NVFP4 scale, a column block that would straddle two experts). Blocks are zero-padded token
//! rows (see `train.rs`), which change no amax and so no code.
//!
//! Tested against the CPU layer in `tests/cuda_linear.rs` (passing on the H200, 2026-12-03; see
//! docs/cuda.md).

use super::fake_quant::CudaFakeQuantizer;
use super::staging::Staging;
use super::{CudaDevice, CudaError, CudaQuantizer};
use crate::engine::linear::{
    self, Blocks, CountSlots, DgradOperand, Operands, PreparedWeight, Reads, RunCounts,
    SiteKernels, SiteQuant, SiteWeight,
};
use crate::formats::mxfp8::MX_BLOCK;
use crate::formats::nvfp4::NV_BLOCK;
use crate::formats::{QuantFormat, SecondScale};
use crate::recipe::SitePlan;
use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t,
};
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, StridedBatchedConfig};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use std::sync::{Arc, Mutex, OnceLock};

/// A prepared weight on the device: the forward operand and the dgrad operand
/// ([`PreparedWeight::w_fwd`], [`PreparedWeight::w_bwd`]), `[out_dim, in_dim]` each, or `batch`
/// of them back to back ([`CudaLinear::upload_stacked`]).
pub struct DeviceWeight {
    w_fwd: CudaSlice<f32>,
    /// `None` where every stacked weight's dgrad operand is its forward operand
    /// ([`PreparedWeight::bwd_is_fwd`]): one copy serves both GEMMs.
    w_bwd: Option<CudaSlice<f32>>,
    /// False for a weight uploaded for forward passes only ([`DeviceWeight::forward_only`]):
    /// its dgrad operand stayed on the host, so a backward through it is an error.
    has_dgrad: bool,
    out_dim: usize,
    in_dim: usize,
    batch: usize,
    /// The BF16 bits of `w_fwd` and `w_bwd`, made by the first tensor-core GEMM that reads
    /// them (`Operands::Bf16`), so each is packed once in the weight's life, not per GEMM.
    bf16: [OnceLock<CudaSlice<u16>>; 2],
}

impl DeviceWeight {
    /// What to upload for `ws` (weights of one shape, stacked in order): the forward operands,
    /// then the dgrad operands (an empty group where they are the forward ones), as two
    /// [`Staging::upload`] groups.
    pub fn parts<'w>(ws: &[&'w PreparedWeight]) -> Result<[Vec<&'w [f32]>; 2], CudaError> {
        let first = ws
            .first()
            .ok_or_else(|| CudaError::Shape("device weight: no weights".into()))?;
        if ws
            .iter()
            .any(|w| (w.out_dim, w.in_dim) != (first.out_dim, first.in_dim))
        {
            return Err(CudaError::Shape(
                "device weight: stacked weights of different shapes".into(),
            ));
        }
        let bwd = if ws.iter().all(|w| w.bwd_is_fwd()) {
            Vec::new()
        } else {
            ws.iter().map(|w| w.w_bwd()).collect()
        };
        Ok([ws.iter().map(|w| w.w_fwd()).collect(), bwd])
    }

    /// `ws` on the device, from the two buffers its [`DeviceWeight::parts`] were uploaded into.
    pub fn from_parts(
        ws: &[&PreparedWeight],
        w_fwd: CudaSlice<f32>,
        w_bwd: CudaSlice<f32>,
    ) -> Self {
        let (out_dim, in_dim) = ws.first().map_or((0, 0), |w| (w.out_dim, w.in_dim));
        DeviceWeight {
            w_fwd,
            w_bwd: (!ws.iter().all(|w| w.bwd_is_fwd())).then_some(w_bwd),
            has_dgrad: true,
            out_dim,
            in_dim,
            batch: ws.len(),
            bf16: Default::default(),
        }
    }

    /// `ws` for forward passes only (decode, the reference forward), from the buffer its
    /// forward operands (`parts(ws)[0]`) were uploaded into.
    pub fn forward_only(ws: &[&PreparedWeight], w_fwd: CudaSlice<f32>) -> Self {
        let (out_dim, in_dim) = ws.first().map_or((0, 0), |w| (w.out_dim, w.in_dim));
        DeviceWeight {
            w_fwd,
            w_bwd: None,
            has_dgrad: false,
            out_dim,
            in_dim,
            batch: ws.len(),
            bf16: Default::default(),
        }
    }

    /// `batch` weights `[out_dim, in_dim]` prepared on the device ([`CudaLinear::prepare_stacked`]),
    /// for training passes.
    pub fn from_prepared(p: DevicePrepared, batch: usize, out_dim: usize, in_dim: usize) -> Self {
        DeviceWeight {
            w_fwd: p.w_fwd,
            w_bwd: p.w_bwd,
            has_dgrad: true,
            out_dim,
            in_dim,
            batch,
            bf16: Default::default(),
        }
    }

    /// Runs `keep` of this stack of `runs` runs' weights (each run `batch / runs` of them), in
    /// that order: a stack of their own, copied on `s`.
    pub fn gather(
        &self,
        s: &Arc<CudaStream>,
        runs: usize,
        keep: &[usize],
    ) -> Result<Self, CudaError> {
        let per_run = self.batch / runs;
        let size = per_run * self.out_dim * self.in_dim;
        let take = |b: &CudaSlice<f32>| gather_chunks(s, b, size, keep);
        Ok(DeviceWeight {
            w_fwd: take(&self.w_fwd)?,
            w_bwd: self.w_bwd.as_ref().map(take).transpose()?,
            has_dgrad: self.has_dgrad,
            out_dim: self.out_dim,
            in_dim: self.in_dim,
            batch: per_run * keep.len(),
            bf16: Default::default(),
        })
    }

    pub fn out_dim(&self) -> usize {
        self.out_dim
    }
    pub fn in_dim(&self) -> usize {
        self.in_dim
    }
    /// Weights stacked (1 but for the routed experts).
    pub fn batch(&self) -> usize {
        self.batch
    }
}

/// Chunks `keep` of `b` (chunk k: values `k·size..(k+1)·size`), back to back in a new buffer
/// copied on `s`.
pub fn gather_chunks(
    s: &Arc<CudaStream>,
    b: &CudaSlice<f32>,
    size: usize,
    keep: &[usize],
) -> Result<CudaSlice<f32>, CudaError> {
    let mut out = super::output_buffer(s, size * keep.len())?;
    if size > 0 {
        for (j, &k) in keep.iter().enumerate() {
            s.memcpy_dtod(
                &b.slice(k * size..(k + 1) * size),
                &mut out.slice_mut(j * size..(j + 1) * size),
            )?;
        }
    }
    Ok(out)
}

/// A weight's operands prepared on the device ([`CudaLinear::prepare`]).
pub struct DevicePrepared {
    pub w_fwd: CudaSlice<f32>,
    /// `None` where the dgrad operand is `w_fwd`.
    pub w_bwd: Option<CudaSlice<f32>>,
}

/// Site plans for `w`: one, or one per run of a stack that holds each run's weights in turn.
fn check_plans(plans: &[SitePlan], w: &DeviceWeight) -> Result<(), CudaError> {
    if plans.is_empty() || !w.batch.is_multiple_of(plans.len()) {
        return Err(CudaError::Shape(format!(
            "linear: {} site plans for a stack of {} weights",
            plans.len(),
            w.batch
        )));
    }
    Ok(())
}

/// A stack of `batch` weights of `len` values each under a one-shard per-tensor NVFP4 plan,
/// viewed as one row of `batch` shards: a shard's amax is then its weight's amax, the tensor
/// scale of that weight alone, and no 16-value block straddles two rows (the row length is a
/// block multiple), so every code and scale is the weight-by-weight one. `None`
/// where the view does not hold (other formats, sharded scales) or the `Quantized` backward
/// needs each weight's columns.
fn nvfp4_stack_view(
    plan: &SitePlan,
    batch: usize,
    (out_dim, in_dim): (usize, usize),
) -> Option<(QuantFormat, usize, usize)> {
    match plan.weight_format()? {
        QuantFormat::Nvfp4 {
            second: SecondScale::PerTensor,
            shards: 1,
        } if linear::dgrad_operand(plan) != DgradOperand::ColumnQuantized
            && in_dim.is_multiple_of(NV_BLOCK) =>
        {
            let view = QuantFormat::Nvfp4 {
                second: SecondScale::PerTensor,
                shards: batch,
            };
            Some((view, 1, batch * out_dim * in_dim))
        }
        _ => None,
    }
}

/// What the forward keeps for the backward (`linear::LinearCache` on the device).
pub struct DeviceLinearCache {
    /// Operand of the wgrad GEMM, `[batch · n, in_dim]`, chosen by the backward mode.
    pub x_bwd: CudaSlice<f32>,
    /// Rows per weight of the batch.
    pub n: usize,
}

/// The linear layer's kernels (the fake quantizer), cuBLAS handles and stream on one GPU.
pub struct CudaLinear {
    stream: Arc<CudaStream>,
    fq: CudaFakeQuantizer,
    blas: CudaBlas,
    /// GEMMs of BF16 operands on tensor cores; `None` where [`GEMM_VAR`] asks for FP32 only.
    tensor: Option<CudaBlas>,
    staging: Staging,
    /// The BF16 operands the tensor-core GEMMs pack (all but a weight's kept copy), reused.
    packs: Mutex<PackBuffers>,
}

/// Buffers for the BF16 operands of tensor-core GEMMs, reused from GEMM to GEMM rather than
/// allocated and freed per GEMM (allocations were a third of the driver's host time). One
/// stream runs every pack and GEMM, so a GEMM has read its operands before the next pack
/// overwrites them; the lock is held from a pack until its GEMM is queued.
#[derive(Default)]
struct PackBuffers {
    /// One buffer per operand of a GEMM.
    slots: [Option<CudaSlice<u16>>; 2],
    /// Buffers outgrown, kept: a captured CUDA graph may still name them.
    outgrown: Vec<CudaSlice<u16>>,
}

impl PackBuffers {
    /// Whether both slots already hold their counts of values.
    fn fit(&self, lens: [usize; 2]) -> bool {
        self.slots
            .iter()
            .zip(lens)
            .all(|(slot, n)| slot.as_ref().is_some_and(|b| b.len() >= n))
    }

    /// Both slots, each holding at least its count of values (grown to a power of two).
    fn take(
        &mut self,
        stream: &Arc<CudaStream>,
        lens: [usize; 2],
    ) -> Result<[&mut CudaSlice<u16>; 2], CudaError> {
        for (slot, n) in self.slots.iter_mut().zip(lens) {
            if slot.as_ref().is_none_or(|b| b.len() < n) {
                // SAFETY: device memory that each pack writes before its GEMM reads it.
                let grown = unsafe { stream.alloc::<u16>(n.max(1).next_power_of_two())? };
                self.outgrown.extend(slot.replace(grown));
            }
        }
        let [a, b] = &mut self.slots;
        Ok([
            a.as_mut().expect("just filled"),
            b.as_mut().expect("just filled"),
        ])
    }
}

/// Whether `stream` is capturing a CUDA graph.
fn capturing(stream: &CudaStream) -> Result<bool, CudaError> {
    let status = stream.capture_status()?;
    Ok(status != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// `LOCKSTEP_GEMM=fp32` multiplies every GEMM in FP32, BF16 operands too (to compare against the
/// default, `bf16`: tensor cores where both operands hold only BF16 values).
pub const GEMM_VAR: &str = "LOCKSTEP_GEMM";

/// Whether [`GEMM_VAR`] lets BF16 operands go to tensor cores.
fn tensor_cores_allowed() -> Result<bool, CudaError> {
    match std::env::var(GEMM_VAR).as_deref() {
        Err(_) | Ok("bf16") => Ok(true),
        Ok("fp32") => Ok(false),
        Ok(v) => Err(CudaError::Setting(format!(
            "{GEMM_VAR}=`{v}`: use bf16 (tensor cores where both operands hold BF16 values, the \
             default) or fp32 (every GEMM in FP32)"
        ))),
    }
}

impl CudaLinear {
    pub fn new(dev: &Arc<CudaDevice>) -> Result<Self, CudaError> {
        let q = Arc::new(CudaQuantizer::new(dev)?);
        let stream = q.stream().clone();
        let blas = super::backend::pedantic_blas(&stream)?;
        let tensor = if tensor_cores_allowed()? {
            Some(super::backend::tensor_core_blas(&stream)?)
        } else {
            None
        };
        Ok(CudaLinear {
            fq: CudaFakeQuantizer::new(q)?,
            staging: Staging::new(&stream),
            stream,
            blas,
            tensor,
            packs: Mutex::new(PackBuffers::default()),
        })
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The fake quantizer on this layer's stream.
    pub fn fake_quantizer(&self) -> &CudaFakeQuantizer {
        &self.fq
    }

    /// Copy a prepared weight's two operands to the device.
    pub fn upload(&self, w: &PreparedWeight) -> Result<DeviceWeight, CudaError> {
        self.upload_stacked(std::slice::from_ref(w))
    }

    /// The page-locked staging of this layer's stream (the resident trainer's model uploads).
    pub fn staging(&self) -> &Staging {
        &self.staging
    }

    /// Copy weights of one shape (a site's routed experts) to the device, stacked in order.
    pub fn upload_stacked(&self, ws: &[PreparedWeight]) -> Result<DeviceWeight, CudaError> {
        let ws: Vec<&PreparedWeight> = ws.iter().collect();
        let mut bufs = self.staging.upload(&DeviceWeight::parts(&ws)?)?.into_iter();
        let mut next = || bufs.next().expect("two groups");
        let (w_fwd, w_bwd) = (next(), next());
        Ok(DeviceWeight::from_parts(&ws, w_fwd, w_bwd))
    }

    /// `engine::linear::prepare_weight`'s operands made on the device from the FP32 master weight
    /// `w` (`[out_dim, in_dim]`, row-major), bit for bit: the forward operand (the BF16-rounded
    /// weight quantized along rows and dequantized) and the dgrad operand the backward mode asks
    /// for, `None` where it is the forward operand by construction (FP32 and BF16 sites; the host
    /// also drops dgrad operands that turn out equal, so `Some` here may hold the same values).
    /// For training state kept on the GPU: the weights never cross the bus. Queued on this
    /// layer's stream.
    pub fn prepare(
        &self,
        plan: &SitePlan,
        w: &CudaSlice<f32>,
        out_dim: usize,
        in_dim: usize,
    ) -> Result<DevicePrepared, CudaError> {
        self.prepare_as(plan, None, w, 1, out_dim, in_dim)
    }

    /// [`Self::prepare`] of `batch` weights `[out_dim, in_dim]` back to back, their row
    /// quantization (the forward operand) made in one call with `rows_as`, a format that
    /// quantizes the stack as the plan's format quantizes each weight alone (`None`: the plan's,
    /// over the stack as one `[batch · out_dim, in_dim]` weight). Column quantization (the
    /// `Quantized` dgrad operand) needs `batch` = 1.
    fn prepare_as(
        &self,
        plan: &SitePlan,
        rows_as: Option<(QuantFormat, usize, usize)>,
        w: &CudaSlice<f32>,
        batch: usize,
        out_dim: usize,
        in_dim: usize,
    ) -> Result<DevicePrepared, CudaError> {
        let n = out_dim
            .checked_mul(in_dim)
            .and_then(|n| n.checked_mul(batch))
            .ok_or_else(|| {
                CudaError::Shape(format!("{batch} x {out_dim} x {in_dim} elements overflow"))
            })?;
        if w.len() < n {
            return Err(CudaError::Shape(format!(
                "prepare: the weights hold {} values, {batch} of [{out_dim}, {in_dim}] need {n}",
                w.len()
            )));
        }
        let s = &self.stream;
        let Some(fmt) = plan.weight_format() else {
            let mut w_fwd = super::output_buffer(s, n)?;
            if n > 0 {
                s.memcpy_dtod(&w.slice(..n), &mut w_fwd.slice_mut(..n))?;
            }
            return Ok(DevicePrepared { w_fwd, w_bwd: None });
        };
        let fq = &self.fq;
        let mut w_fwd = super::output_buffer(s, n)?;
        if fmt == QuantFormat::Bf16 {
            // A BF16 site's operand is its BF16-rounded weight, for the dgrad too.
            fq.round_bf16(w, &mut w_fwd, n)?;
            return Ok(DevicePrepared { w_fwd, w_bwd: None });
        }
        let dgrad = linear::dgrad_operand(plan);
        // The rounded weight where the dgrad operand is made from it; otherwise the quantizer
        // reads the rounding as it loads.
        let w_hp = match dgrad {
            DgradOperand::DequantizedBf16 => None,
            DgradOperand::HighPrecision | DgradOperand::ColumnQuantized => {
                let mut w_hp = super::output_buffer(s, n)?;
                fq.round_bf16(w, &mut w_hp, n)?;
                Some(w_hp)
            }
        };
        let (row_fmt, rows, cols) = rows_as.unwrap_or((fmt, batch * out_dim, in_dim));
        match &w_hp {
            Some(w_hp) => fq.fake_quantize_rows(w_hp, rows, cols, &row_fmt, &mut w_fwd)?,
            None => {
                fq.fake_quantize_rows_of_rounding(w, (rows, cols), &row_fmt, &mut w_fwd, None)?
            }
        }
        let w_bwd = match dgrad {
            DgradOperand::HighPrecision => w_hp,
            DgradOperand::DequantizedBf16 => {
                let mut b = super::output_buffer(s, n)?;
                fq.round_bf16(&w_fwd, &mut b, n)?;
                Some(b)
            }
            DgradOperand::ColumnQuantized if batch == 1 => {
                let w_hp = w_hp.expect("rounded above");
                let mut b = super::output_buffer(s, n)?;
                fq.fake_quantize_cols_padded(&w_hp, out_dim, in_dim, &fmt, &mut b)?;
                Some(b)
            }
            DgradOperand::ColumnQuantized => {
                return Err(CudaError::Shape(
                    "prepare: column quantization of a stack of weights".into(),
                ));
            }
        };
        Ok(DevicePrepared { w_fwd, w_bwd })
    }

    /// [`Self::prepare`] of each of `batch` weights `[out_dim, in_dim]` stored back to back in
    /// `w` (a site's copy of every run, or every run's routed experts), into stacked operands.
    /// Where the format's scales never reach across a weight's rows or its column blocks (BF16;
    /// MXFP8 when `out_dim` is a multiple of its block, so column blocks do not straddle two
    /// weights) the stack is one weight of `batch · out_dim` rows, one launch per kernel; NVFP4
    /// with one tensor scale a weight is quantized as one row with a shard per weight
    /// ([`nvfp4_stack_view`]), also one launch per kernel; otherwise (sharded NVFP4 scales,
    /// NVFP4's `Quantized` backward, FP8 block tiles) each weight is prepared alone.
    pub fn prepare_stacked(
        &self,
        plan: &SitePlan,
        w: &CudaSlice<f32>,
        batch: usize,
        out_dim: usize,
        in_dim: usize,
    ) -> Result<DevicePrepared, CudaError> {
        let stacks = match plan.weight_format() {
            None | Some(QuantFormat::Bf16) => true,
            Some(QuantFormat::Mxfp8 { .. }) => out_dim.is_multiple_of(MX_BLOCK),
            Some(QuantFormat::Nvfp4 { .. } | QuantFormat::Fp8Block { .. }) => false,
        };
        if stacks || batch == 1 {
            return self.prepare(plan, w, batch * out_dim, in_dim);
        }
        if let Some(view) = nvfp4_stack_view(plan, batch, (out_dim, in_dim)) {
            return self.prepare_as(plan, Some(view), w, batch, out_dim, in_dim);
        }
        let n = out_dim * in_dim;
        let total = n
            .checked_mul(batch)
            .ok_or_else(|| CudaError::Shape(format!("{batch} x {n} elements overflow")))?;
        if w.len() < total {
            return Err(CudaError::Shape(format!(
                "prepare: the weights hold {} values, {batch} of [{out_dim}, {in_dim}] need {total}",
                w.len()
            )));
        }
        let s = &self.stream;
        let mut w_fwd = super::output_buffer(s, total)?;
        let mut w_bwd: Option<CudaSlice<f32>> = None;
        let mut one = super::output_buffer(s, n)?;
        for b in 0..batch {
            let range = b * n..(b + 1) * n;
            s.memcpy_dtod(&w.slice(range.clone()), &mut one.slice_mut(..n))?;
            let p = self.prepare(plan, &one, out_dim, in_dim)?;
            s.memcpy_dtod(&p.w_fwd.slice(..n), &mut w_fwd.slice_mut(range.clone()))?;
            if let Some(pb) = p.w_bwd {
                let dst = match &mut w_bwd {
                    Some(d) => d,
                    None => w_bwd.insert(super::output_buffer(s, total)?),
                };
                s.memcpy_dtod(&pb.slice(..n), &mut dst.slice_mut(range))?;
            }
        }
        Ok(DevicePrepared { w_fwd, w_bwd })
    }

    /// [`Self::prepare_stacked`] of `runs` runs' weights (`stack` each, back to back in `w`),
    /// run r on `plans[r]` (or every run on `plans[0]`): each group of consecutive runs of one
    /// plan prepared as its own stack, the groups' operands then laid back to back (the dgrad
    /// operand of a group without one is its forward operand).
    pub fn prepare_runs(
        &self,
        plans: &[SitePlan],
        w: &CudaSlice<f32>,
        (runs, stack): (usize, usize),
        out_dim: usize,
        in_dim: usize,
    ) -> Result<DevicePrepared, CudaError> {
        if plans.is_empty() || (plans.len() != 1 && plans.len() != runs) {
            return Err(CudaError::Shape(format!(
                "prepare: {} site plans for {runs} runs",
                plans.len()
            )));
        }
        let groups = linear::plan_groups(plans, runs);
        if let [g] = &groups[..] {
            return self.prepare_stacked(g.plan, w, runs * stack, out_dim, in_dim);
        }
        let per = stack * out_dim * in_dim;
        let total = per * runs;
        if w.len() < total {
            return Err(CudaError::Shape(format!(
                "prepare: the weights hold {} values, {runs} runs of {stack} x [{out_dim}, {in_dim}] need {total}",
                w.len()
            )));
        }
        let s = &self.stream;
        let parts = groups
            .iter()
            .map(|g| {
                let (at, len) = (g.blocks.start * per, g.blocks.len() * per);
                let mine = self.copy_range(w, at, len)?;
                let p =
                    self.prepare_stacked(g.plan, &mine, g.blocks.len() * stack, out_dim, in_dim)?;
                Ok((at, len, p))
            })
            .collect::<Result<Vec<_>, CudaError>>()?;
        let mut w_fwd = self.output(total)?;
        let mut w_bwd = match parts.iter().any(|(_, _, p)| p.w_bwd.is_some()) {
            true => Some(self.output(total)?),
            false => None,
        };
        for (at, len, p) in &parts {
            let range = *at..at + len;
            s.memcpy_dtod(&p.w_fwd.slice(..*len), &mut w_fwd.slice_mut(range.clone()))?;
            if let Some(b) = w_bwd.as_mut() {
                let src = p.w_bwd.as_ref().unwrap_or(&p.w_fwd);
                s.memcpy_dtod(&src.slice(..*len), &mut b.slice_mut(range))?;
            }
        }
        Ok(DevicePrepared { w_fwd, w_bwd })
    }

    /// The weight's operands as the policy of `engine::linear` reads them.
    /// The kernels for a pass through `w` (which keep its BF16 copies).
    fn on<'w>(&'w self, w: &'w DeviceWeight) -> OnWeight<'w> {
        OnWeight { lin: self, w }
    }

    fn site<'a>(&self, w: &'a DeviceWeight) -> SiteWeight<'a, CudaSlice<f32>> {
        SiteWeight {
            fwd: &w.w_fwd,
            bwd: w.w_bwd.as_ref().unwrap_or(&w.w_fwd),
            out_dim: w.out_dim,
            in_dim: w.in_dim,
            batch: w.batch,
        }
    }

    /// `linear::forward` on the device: `y[n, m] = x[n, k] · Wᵀ` with the input quantized per
    /// the site's activation format, and the wgrad operand the backward mode asks for. With a
    /// stacked weight, `x` is `batch` blocks of `n` rows and `y` likewise.
    ///
    /// `plans` holds the site's plan in each run whose weights `w` stacks (each run's blocks
    /// consecutive), or one plan for all: each run's rows are quantized per its own plan and
    /// every run shares the GEMM.
    pub fn forward(
        &self,
        plans: &[SitePlan],
        x: &CudaSlice<f32>,
        n: usize,
        w: &DeviceWeight,
    ) -> Result<(CudaSlice<f32>, DeviceLinearCache), CudaError> {
        check_plans(plans, w)?;
        let mut y = self.output(w.batch * n * w.out_dim)?;
        let x_bwd = linear::forward_on(&self.on(w), plans, x, n, &self.site(w), &mut y, None)?;
        Ok((y, DeviceLinearCache { x_bwd, n }))
    }

    /// [`Self::forward`] that adds each run's activation counts to its slot of `acc` (3 values
    /// a run, `LinearCache::stats`; `runs` runs, each owning `w.batch / runs` blocks), counted
    /// by the forward's own quantization under each run's plan.
    pub fn forward_counted(
        &self,
        plans: &[SitePlan],
        x: &CudaSlice<f32>,
        n: usize,
        w: &DeviceWeight,
        (acc, runs): (&mut CudaSlice<u64>, usize),
    ) -> Result<(CudaSlice<f32>, DeviceLinearCache), CudaError> {
        check_plans(plans, w)?;
        if runs == 0 || !w.batch.is_multiple_of(runs) || acc.len() < 3 * runs {
            return Err(CudaError::Shape(format!(
                "linear forward: {runs} runs' counts ({} values) over {} weight blocks",
                acc.len(),
                w.batch
            )));
        }
        let mut y = self.output(w.batch * n * w.out_dim)?;
        let counts = RunCounts { counts: acc, runs };
        let x_bwd = linear::forward_on(
            &self.on(w),
            plans,
            x,
            n,
            &self.site(w),
            &mut y,
            Some(counts),
        )?;
        Ok((y, DeviceLinearCache { x_bwd, n }))
    }

    /// [`Self::forward`] without what a backward needs (an inference pass: decode, the
    /// reference forward): the same quantization and GEMM, the output only.
    pub fn apply(
        &self,
        plans: &[SitePlan],
        x: &CudaSlice<f32>,
        n: usize,
        w: &DeviceWeight,
    ) -> Result<CudaSlice<f32>, CudaError> {
        check_plans(plans, w)?;
        let mut y = self.output(w.batch * n * w.out_dim)?;
        linear::apply_on(&self.on(w), plans, x, n, &self.site(w), &mut y)?;
        Ok(y)
    }

    /// `linear::backward` on the device: `dx = dy · W` (when `dx` is given, written) and
    /// `dW += dyᵀ · x` (accumulated), dy quantized as the plan's backward mode says; per block
    /// of a stacked weight.
    pub fn backward(
        &self,
        plans: &[SitePlan],
        cache: &DeviceLinearCache,
        w: &DeviceWeight,
        dy: &CudaSlice<f32>,
        dx: Option<&mut CudaSlice<f32>>,
        dw: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        if !w.has_dgrad {
            return Err(CudaError::Shape(
                "linear backward through a weight uploaded for forward passes only".into(),
            ));
        }
        let (n, m) = (cache.n, w.out_dim);
        if dy.len() < w.batch * n * m {
            return Err(CudaError::Shape(format!(
                "linear backward: dy holds {} floats, needs {} x {m}",
                dy.len(),
                w.batch * n
            )));
        }
        check_plans(plans, w)?;
        linear::backward_on(
            &self.on(w),
            plans,
            &cache.x_bwd,
            n,
            &self.site(w),
            dy,
            dx,
            dw,
        )
    }

    /// Values `from..from + len` of `x`, as a buffer of their own.
    fn copy_range(
        &self,
        x: &CudaSlice<f32>,
        from: usize,
        len: usize,
    ) -> Result<CudaSlice<f32>, CudaError> {
        let mut out = self.output(len)?;
        if len > 0 {
            self.stream
                .memcpy_dtod(&x.slice(from..from + len), &mut out.slice_mut(..len))?;
        }
        Ok(out)
    }

    /// A buffer of `n` floats for the op it is passed to to write in full
    /// ([`super::output_buffer`]).
    fn output(&self, n: usize) -> Result<CudaSlice<f32>, CudaError> {
        super::output_buffer(&self.stream, n)
    }

    /// One quantization of a single block, or of several stacked blocks where that is the
    /// same thing, of what `reads` says (the BF16 rounding only for `Rows`).
    #[allow(clippy::too_many_arguments)]
    fn quantize_one(
        &self,
        kind: SiteQuant,
        x: &CudaSlice<f32>,
        reads: Reads,
        (rows, cols): (usize, usize),
        fmt: &QuantFormat,
        out: &mut CudaSlice<f32>,
        acc: Option<CountSlots<'_, CudaSlice<u64>>>,
    ) -> Result<(), CudaError> {
        if rows == 0 {
            return Ok(());
        }
        match (kind, reads) {
            (SiteQuant::Rows, Reads::Input) => self
                .fq
                .fake_quantize_rows_counted(x, rows, cols, fmt, out, acc),
            (SiteQuant::Rows, Reads::Bf16Rounding) => {
                self.fq
                    .fake_quantize_rows_of_rounding(x, (rows, cols), fmt, out, acc)
            }
            (SiteQuant::RowsPadded, Reads::Input) => {
                self.fq.fake_quantize_rows_padded(x, rows, cols, fmt, out)
            }
            (SiteQuant::ColsPadded, Reads::Input) => {
                self.fq.fake_quantize_cols_padded(x, rows, cols, fmt, out)
            }
            (kind, reads) => Err(CudaError::Shape(format!(
                "{kind:?} quantization of {reads:?}: only rows read a rounding as they load"
            ))),
        }
    }
}

/// The device's kernels under the linear layer's precision policy (`engine::linear`): the
/// fake quantizer and cuBLAS on this layer's stream.
impl CudaLinear {
    /// `SiteKernels::gemm`, where `b` may come with the place its BF16 copy is kept (a weight:
    /// see [`DeviceWeight`]). cuBLAS is column-major, where a row-major buffer reads as its
    /// transpose: `cᵀ = bᵀ · aᵀ`.
    fn gemm_keeping(
        &self,
        (a_buf, a_t): (&CudaSlice<f32>, bool),
        (b_buf, b_t, kept): (&CudaSlice<f32>, bool, Option<&OnceLock<CudaSlice<u16>>>),
        c: &mut CudaSlice<f32>,
        (r, inner, cc): (usize, usize, usize),
        (batch, accumulate, operands): (usize, bool, Operands),
    ) -> Result<(), CudaError> {
        if r == 0 || cc == 0 || batch == 0 {
            return Ok(());
        }
        let dim = |v: usize| {
            i32::try_from(v).map_err(|_| {
                CudaError::Shape(format!("gemm dimension {v} exceeds cuBLAS's 32-bit limit"))
            })
        };
        let (a_len, b_len, c_len) = (r * inner, inner * cc, r * cc);
        if a_buf.len() < batch * a_len || b_buf.len() < batch * b_len || c.len() < batch * c_len {
            return Err(CudaError::Shape(format!(
                "linear gemm: buffers of {}, {}, {} floats for {batch} x [{r}, {inner}] x [{inner}, {cc}]",
                a_buf.len(),
                b_buf.len(),
                c.len()
            )));
        }
        let op = |t: bool| {
            if t {
                cublasOperation_t::CUBLAS_OP_T
            } else {
                cublasOperation_t::CUBLAS_OP_N
            }
        };
        let gemm = GemmConfig {
            // First cuBLAS operand: b's buffer, (cc x inner) column-major when stored as b.
            transa: op(b_t),
            transb: op(a_t),
            m: dim(cc)?,
            n: dim(r)?,
            k: dim(inner)?,
            alpha: 1.0f32,
            lda: dim(if b_t { inner } else { cc })?,
            ldb: dim(if a_t { r } else { inner })?,
            beta: if accumulate { 1.0f32 } else { 0.0 },
            ldc: dim(cc)?,
        };
        if inner == 0 {
            if !accumulate {
                self.stream.memset_zeros(c)?;
            }
            return Ok(());
        }
        let cfg = StridedBatchedConfig {
            gemm,
            batch_size: dim(batch)?,
            stride_a: b_len as i64,
            stride_b: a_len as i64,
            stride_c: c_len as i64,
        };
        if let (Operands::Bf16, Some(tensor)) = (operands, &self.tensor) {
            let (a, b) = ((b_buf, batch * b_len, kept), (a_buf, batch * a_len));
            return self.gemm_bf16(tensor, cfg, a, b, c);
        }
        if batch == 1 {
            // SAFETY: checked above: a holds r·inner, b inner·cc and c r·cc floats, and each
            // leading dimension is the row length of that row-major buffer as stored, so cuBLAS
            // stays inside.
            unsafe { self.blas.gemm(gemm, b_buf, a_buf, c) }?;
        } else {
            // SAFETY: as above for each of the `batch` triples, which lie back to back at the
            // strides given (checked: each buffer holds batch times its operand).
            unsafe { self.blas.gemm_strided_batched(cfg, b_buf, a_buf, c) }?;
        }
        Ok(())
    }

    /// `cfg`'s GEMM (cuBLAS's column-major operands `a` then `b`, each with the values it covers
    /// in all) on tensor cores: both operands as BF16 (exactly their values: the caller's
    /// `Operands::Bf16`), products exact, sums and `c` in FP32.
    fn gemm_bf16(
        &self,
        tensor: &CudaBlas,
        cfg: StridedBatchedConfig<f32>,
        (a, na, kept): (&CudaSlice<f32>, usize, Option<&OnceLock<CudaSlice<u16>>>),
        (b, nb): (&CudaSlice<f32>, usize),
        c: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let mut packs = self.packs.lock().unwrap_or_else(|e| e.into_inner());
        let kept_a = kept.and_then(OnceLock::get).filter(|pa| pa.len() >= na);
        // A weight's first packing is kept with it (a weight is not changed in place).
        let keep_a = kept.filter(|_| kept_a.is_none());
        let lens = [nb, if kept.is_some() { 0 } else { na }];
        // A capture allocates in the graph's memory: there the buffers are the GEMM's own, as
        // the graph frees and makes them again each launch.
        let mut own: [Option<CudaSlice<u16>>; 2] = [None, None];
        let [pb, scratch_a] = if packs.fit(lens) || !capturing(&self.stream)? {
            packs.take(&self.stream, lens)?
        } else {
            for (o, n) in own.iter_mut().zip(lens) {
                // SAFETY: as the pack buffers: written by `bf16_pack2` before the GEMM reads.
                *o = Some(unsafe { self.stream.alloc::<u16>(n.max(1))? });
            }
            let [x, y] = &mut own;
            [x.as_mut().expect("made"), y.as_mut().expect("made")]
        };
        let mut fresh = None;
        let pa: &CudaSlice<u16> = match (kept_a, keep_a) {
            (Some(pa), _) => {
                self.fq.bf16_pack2((b, nb, pb), None)?;
                pa
            }
            (None, Some(cell)) => {
                // SAFETY: as the pack buffers: written in full by `bf16_pack2` first.
                let mut pa = unsafe { self.stream.alloc::<u16>(na)? };
                self.fq.bf16_pack2((a, na, &mut pa), Some((b, nb, pb)))?;
                match cell.set(pa) {
                    Ok(()) => cell.get().expect("just set"),
                    Err(pa) => fresh.insert(pa),
                }
            }
            (None, None) => {
                self.fq.bf16_pack2((a, na, scratch_a), Some((b, nb, pb)))?;
                scratch_a
            }
        };
        let pb: &CudaSlice<u16> = pb;
        let g = cfg.gemm;
        let (alpha, beta) = (g.alpha, g.beta);
        let (pa_ptr, _ra) = pa.device_ptr(&self.stream);
        let (pb_ptr, _rb) = pb.device_ptr(&self.stream);
        let (c_ptr, _rc) = c.device_ptr_mut(&self.stream);
        let bf16 = cudaDataType_t::CUDA_R_16BF;
        // SAFETY: `gemm`'s checks hold for these operands: each of the `batch_size` triples
        // lies inside pa, pb (na, nb values: what the FP32 operands cover) and c at the
        // strides given, with the FP32 GEMM's leading dimensions; alpha and beta are host
        // floats living across the call, as CUBLAS_COMPUTE_32F reads them.
        unsafe {
            cudarc::cublas::result::gemm_strided_batched_ex(
                *tensor.handle(),
                g.transa,
                g.transb,
                g.m,
                g.n,
                g.k,
                (&alpha) as *const f32 as *const _,
                pa_ptr as *const _,
                bf16,
                g.lda,
                cfg.stride_a,
                pb_ptr as *const _,
                bf16,
                g.ldb,
                cfg.stride_b,
                (&beta) as *const f32 as *const _,
                c_ptr as *mut _,
                cudaDataType_t::CUDA_R_32F,
                g.ldc,
                cfg.stride_c,
                cfg.batch_size,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }?;
        Ok(())
    }
}

/// The linear layer's kernels (`SiteKernels`) for a pass through one site's weights: its
/// GEMMs read each weight's BF16 copy kept with the weight ([`DeviceWeight`]'s `bf16`, packed by
/// the first tensor-core GEMM that reads it) rather than packing it again.
struct OnWeight<'w> {
    lin: &'w CudaLinear,
    w: &'w DeviceWeight,
}

/// Values `from..from + len` of a tensor of `total` values exist.
fn check_range(from: usize, len: usize, total: usize) -> Result<(), CudaError> {
    if from.checked_add(len).is_none_or(|end| end > total) {
        return Err(CudaError::Shape(format!(
            "range {from}..+{len} of a tensor of {total}"
        )));
    }
    Ok(())
}

impl OnWeight<'_> {
    /// Whether a range of `len` values can be a view ([`Self::view_at`]): where cudarc tracks no
    /// events (the engine's default; a view would leak its events), and not for no values.
    fn views(&self, len: usize) -> bool {
        len > 0 && !self.lin.stream.context().is_event_tracking()
    }

    /// A slice over floats `from..from + len` of the allocation at device address `base`, never
    /// freed (and, without event tracking, holding nothing else); its work is queued on this
    /// layer's stream.
    ///
    /// # Safety
    /// The range lies inside that allocation, which outlives the view, and the view is used only
    /// as the borrow the caller holds on it allows (read, or written where borrowed mutably).
    unsafe fn view_at(
        &self,
        base: u64,
        from: usize,
        len: usize,
    ) -> std::mem::ManuallyDrop<CudaSlice<f32>> {
        let at = base + (from * std::mem::size_of::<f32>()) as u64;
        // SAFETY: as the caller promises.
        std::mem::ManuallyDrop::new(unsafe { self.lin.stream.upgrade_device_ptr(at, len) })
    }

    /// Where `buf`'s BF16 copy is kept, if it is one of the site's weights.
    fn kept(&self, buf: &CudaSlice<f32>) -> Option<&OnceLock<CudaSlice<u16>>> {
        if std::ptr::eq(buf, &self.w.w_fwd) {
            Some(&self.w.bf16[0])
        } else if self.w.w_bwd.as_ref().is_some_and(|b| std::ptr::eq(buf, b)) {
            Some(&self.w.bf16[1])
        } else {
            None
        }
    }
}

impl OnWeight<'_> {
    /// [`SiteKernels::quantize`] into `out` (at least `shape`'s values). Blocks are quantized
    /// together where that is the same thing (row-local formats; columns when `rows` divides
    /// into blocks), one by one otherwise (a per-tensor NVFP4 scale, a column block that would
    /// straddle two experts).
    #[allow(clippy::too_many_arguments)]
    fn quantize_blocks(
        &self,
        kind: SiteQuant,
        x: &CudaSlice<f32>,
        reads: Reads,
        Blocks { rows, cols, batch }: Blocks,
        fmt: &QuantFormat,
        mut acc: Option<CountSlots<'_, CudaSlice<u64>>>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let per_tensor = matches!(
            fmt,
            QuantFormat::Nvfp4 {
                second: SecondScale::PerTensor,
                ..
            }
        );
        let aligned = kind != SiteQuant::ColsPadded || rows.is_multiple_of(fmt.required_multiple());
        if batch == 1 || (!per_tensor && aligned) {
            self.lin
                .quantize_one(kind, x, reads, (rows * batch, cols), fmt, out, acc)
        } else {
            let mut b = 0;
            self.lin
                .fq
                .per_block(x, out, (batch, rows * cols), |blk, q| {
                    let slot = acc.as_mut().map(|a| a.part(b, batch));
                    b += 1;
                    self.lin
                        .quantize_one(kind, blk, reads, (rows, cols), fmt, q, slot)
                })
        }
    }
}

impl SiteKernels for OnWeight<'_> {
    type Buf = CudaSlice<f32>;
    type Owned = CudaSlice<f32>;
    type Counts = CudaSlice<u64>;
    type Error = CudaError;

    fn copy(&self, x: &CudaSlice<f32>, len: usize) -> Result<CudaSlice<f32>, CudaError> {
        self.lin.copy_range(x, 0, len)
    }

    fn round_bf16(&self, x: &CudaSlice<f32>, len: usize) -> Result<CudaSlice<f32>, CudaError> {
        let mut out = self.lin.output(len)?;
        self.lin.fq.round_bf16(x, &mut out, len)?;
        Ok(out)
    }

    fn quantize(
        &self,
        kind: SiteQuant,
        x: &CudaSlice<f32>,
        shape: Blocks,
        fmt: &QuantFormat,
        acc: Option<CountSlots<'_, CudaSlice<u64>>>,
    ) -> Result<CudaSlice<f32>, CudaError> {
        let len = shape.batch * shape.rows * shape.cols;
        // The padded row path writes through a transpose; zeroed, as it always was.
        let mut out = match kind {
            SiteQuant::RowsPadded => self.lin.stream.alloc_zeros(len.max(1))?,
            _ => self.lin.output(len)?,
        };
        self.quantize_blocks(kind, x, Reads::Input, shape, fmt, acc, &mut out)?;
        Ok(out)
    }

    /// The quantizer rounds as it loads where it can (MXFP8, per-token NVFP4).
    fn quantize_rounding(
        &self,
        x: &CudaSlice<f32>,
        shape: Blocks,
        fmt: &QuantFormat,
        acc: Option<CountSlots<'_, CudaSlice<u64>>>,
    ) -> Result<CudaSlice<f32>, CudaError> {
        let mut out = self.lin.output(shape.batch * shape.rows * shape.cols)?;
        let (kind, reads) = (SiteQuant::Rows, Reads::Bf16Rounding);
        self.quantize_blocks(kind, x, reads, shape, fmt, acc, &mut out)?;
        Ok(out)
    }

    /// Into a view of `dst`'s range where cudarc tracks no events (as [`Self::with_range`]).
    fn quantize_rows_to(
        &self,
        x: &CudaSlice<f32>,
        reads: Reads,
        shape: Blocks,
        fmt: &QuantFormat,
        acc: Option<CountSlots<'_, CudaSlice<u64>>>,
        dst: &mut CudaSlice<f32>,
        at: usize,
    ) -> Result<(), CudaError> {
        let len = shape.batch * shape.rows * shape.cols;
        check_range(at, len, dst.len())?;
        if !self.views(len) {
            let mut q = self.lin.output(len)?;
            self.quantize_blocks(SiteQuant::Rows, x, reads, shape, fmt, acc, &mut q)?;
            return self.place(dst, at, (&q, 0), len);
        }
        let (base, _in_use) = dst.device_ptr_mut(&self.lin.stream);
        // SAFETY: the range lies inside dst's allocation (checked above), which outlives this
        // call, and dst is borrowed mutably for it, so nothing else reads or writes it meanwhile.
        let mut view = unsafe { self.view_at(base, at, len) };
        self.quantize_blocks(SiteQuant::Rows, x, reads, shape, fmt, acc, &mut view)
    }

    fn gemm(
        &self,
        a: (&CudaSlice<f32>, bool),
        (b, b_t): (&CudaSlice<f32>, bool),
        c: &mut CudaSlice<f32>,
        dims: (usize, usize, usize),
        batch: usize,
        accumulate: bool,
        operands: Operands,
    ) -> Result<(), CudaError> {
        let kernels = (batch, accumulate, operands);
        self.lin
            .gemm_keeping(a, (b, b_t, self.kept(b)), c, dims, kernels)
    }

    fn fill_zero(&self, c: &mut CudaSlice<f32>) -> Result<(), CudaError> {
        Ok(self.lin.stream.memset_zeros(c)?)
    }

    fn alloc(&self, len: usize) -> Result<CudaSlice<f32>, CudaError> {
        self.lin.output(len)
    }

    /// A view where cudarc tracks no events (the engine's default): a slice over the range of
    /// `x`'s memory that is never freed; a copy otherwise (a view would leak its events).
    fn with_range<R>(
        &self,
        x: &CudaSlice<f32>,
        from: usize,
        len: usize,
        f: impl FnOnce(&CudaSlice<f32>) -> Result<R, CudaError>,
    ) -> Result<R, CudaError> {
        check_range(from, len, x.len())?;
        if !self.views(len) {
            return f(&self.lin.copy_range(x, from, len)?);
        }
        let (base, _in_use) = x.device_ptr(&self.lin.stream);
        // SAFETY: the range lies inside x's allocation (checked above), which outlives `f` (x is
        // borrowed for this call).
        let view = unsafe { self.view_at(base, from, len) };
        f(&view)
    }

    fn place(
        &self,
        dst: &mut CudaSlice<f32>,
        at: usize,
        (src, from): (&CudaSlice<f32>, usize),
        len: usize,
    ) -> Result<(), CudaError> {
        if len > 0 {
            self.lin.stream.memcpy_dtod(
                &src.slice(from..from + len),
                &mut dst.slice_mut(at..at + len),
            )?;
        }
        Ok(())
    }

    /// A tensor-core GEMM packs both operands to BF16 (`bf16_pack2`, round to nearest even).
    fn gemm_rounds_to_bf16(&self) -> bool {
        self.lin.tensor.is_some()
    }
}

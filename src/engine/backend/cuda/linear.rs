//! The precision-aware linear layer on the device: `engine::linear::forward` (keeping the
//! backward's operand, [`DeviceLinearCache`]) and `engine::linear::backward` over device tensors,
//! for a resident trainer. Every quantization is the CPU's, bit for bit
//! ([`CudaFakeQuantizer`]: rows, columns, and both with the block dimension zero-padded), so the
//! kept operand `x_bwd` equals the CPU's exactly; the GEMMs are cuBLAS FP32
//! (`CUBLAS_PEDANTIC_MATH`, no TF32), so outputs and gradients agree to summation order.
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
use crate::engine::linear::PreparedWeight;
use crate::formats::{QuantFormat, SecondScale};
use crate::recipe::{BackwardMode, Precision, SitePlan};
use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, StridedBatchedConfig};
use cudarc::driver::{CudaSlice, CudaStream};
use std::sync::Arc;

/// A prepared weight on the device: the forward operand and the dgrad operand
/// ([`PreparedWeight::w_fwd`], [`PreparedWeight::w_bwd`]), `[out_dim, in_dim]` each, or `batch`
/// of them back to back ([`CudaLinear::upload_stacked`]).
pub struct DeviceWeight {
    w_fwd: CudaSlice<f32>,
    /// `None` where every stacked weight's dgrad operand is its forward operand
    /// ([`PreparedWeight::bwd_is_fwd`]): one copy serves both GEMMs.
    w_bwd: Option<CudaSlice<f32>>,
    out_dim: usize,
    in_dim: usize,
    batch: usize,
}

impl DeviceWeight {
    /// What to upload for `ws` (weights of one shape, stacked in order): the forward operands,
    /// then the dgrad operands (an empty group where they are the forward ones), as two
    /// [`Staging::upload`] groups.
    pub fn parts(ws: &[PreparedWeight]) -> Result<[Vec<&[f32]>; 2], CudaError> {
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
        let bwd = if ws.iter().all(PreparedWeight::bwd_is_fwd) {
            Vec::new()
        } else {
            ws.iter().map(PreparedWeight::w_bwd).collect()
        };
        Ok([ws.iter().map(PreparedWeight::w_fwd).collect(), bwd])
    }

    /// `ws` on the device, from the two buffers its [`DeviceWeight::parts`] were uploaded into.
    pub fn from_parts(ws: &[PreparedWeight], w_fwd: CudaSlice<f32>, w_bwd: CudaSlice<f32>) -> Self {
        let (out_dim, in_dim) = ws.first().map_or((0, 0), |w| (w.out_dim, w.in_dim));
        DeviceWeight {
            w_fwd,
            w_bwd: (!ws.iter().all(PreparedWeight::bwd_is_fwd)).then_some(w_bwd),
            out_dim,
            in_dim,
            batch: ws.len(),
        }
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

/// What the forward keeps for the backward (`linear::LinearCache` on the device).
pub struct DeviceLinearCache {
    /// Operand of the wgrad GEMM, `[batch · n, in_dim]`, chosen by the backward mode.
    pub x_bwd: CudaSlice<f32>,
    /// Rows per weight of the batch.
    pub n: usize,
}

/// A stored matrix operand of [`CudaLinear::gemm`]: the buffer and whether it holds the
/// transpose of the operand (row-major).
type Operand<'a> = (&'a CudaSlice<f32>, bool);

/// Which of the CPU's quantizations of `engine::linear` to apply.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Quant {
    /// Blocks along rows (the forward's activations).
    Rows,
    /// Blocks along rows, the columns zero-padded to the block multiple (dgrad's dy).
    RowsPadded,
    /// Blocks along columns, the rows (tokens) zero-padded (the `Quantized` wgrad operands).
    ColsPadded,
}

/// The linear layer's kernels (the fake quantizer), cuBLAS handle and stream on one GPU.
pub struct CudaLinear {
    stream: Arc<CudaStream>,
    fq: CudaFakeQuantizer,
    blas: CudaBlas,
    staging: Staging,
}

impl CudaLinear {
    pub fn new(dev: &Arc<CudaDevice>) -> Result<Self, CudaError> {
        let q = Arc::new(CudaQuantizer::new(dev)?);
        let stream = q.stream().clone();
        let blas = super::backend::pedantic_blas(&stream)?;
        Ok(CudaLinear {
            fq: CudaFakeQuantizer::new(q)?,
            staging: Staging::new(&stream),
            stream,
            blas,
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
        let mut bufs = self.staging.upload(&DeviceWeight::parts(ws)?)?.into_iter();
        let mut next = || bufs.next().expect("two groups");
        let (w_fwd, w_bwd) = (next(), next());
        Ok(DeviceWeight::from_parts(ws, w_fwd, w_bwd))
    }

    fn zeros(&self, n: usize) -> Result<CudaSlice<f32>, CudaError> {
        Ok(self.stream.alloc_zeros(n.max(1))?)
    }

    /// A buffer of `n` floats for the op it is passed to to write in full
    /// ([`super::output_buffer`]).
    fn output(&self, n: usize) -> Result<CudaSlice<f32>, CudaError> {
        super::output_buffer(&self.stream, n)
    }

    /// Row-major `c[r, cc] = a[r, inner] · b[inner, cc]` (`+= ` when `accumulate`), FP32, for
    /// `batch` (a, b, c) triples stored back to back. Each operand is stored as itself or, when
    /// its flag says so, as its transpose. cuBLAS is column-major, where a row-major buffer reads
    /// as its transpose: `cᵀ = bᵀ · aᵀ`.
    fn gemm(
        &self,
        a: Operand<'_>,
        b: Operand<'_>,
        c: &mut CudaSlice<f32>,
        (r, inner, cc): (usize, usize, usize),
        batch: usize,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        if r == 0 || cc == 0 || batch == 0 {
            return Ok(());
        }
        let dim = |v: usize| {
            i32::try_from(v).map_err(|_| {
                CudaError::Shape(format!("gemm dimension {v} exceeds cuBLAS's 32-bit limit"))
            })
        };
        let ((a_buf, a_t), (b_buf, b_t)) = (a, b);
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
        if batch == 1 {
            // SAFETY: checked above: a holds r·inner, b inner·cc and c r·cc floats, and each
            // leading dimension is the row length of that row-major buffer as stored, so cuBLAS
            // stays inside.
            unsafe { self.blas.gemm(gemm, b_buf, a_buf, c) }?;
        } else {
            let cfg = StridedBatchedConfig {
                gemm,
                batch_size: dim(batch)?,
                stride_a: b_len as i64,
                stride_b: a_len as i64,
                stride_c: c_len as i64,
            };
            // SAFETY: as above for each of the `batch` triples, which lie back to back at the
            // strides given (checked: each buffer holds batch times its operand).
            unsafe { self.blas.gemm_strided_batched(cfg, b_buf, a_buf, c) }?;
        }
        Ok(())
    }

    /// One of `engine::linear`'s quantizations of `batch` blocks of `[rows, cols]` stored back
    /// to back, each block as the CPU quantizes one expert's tensor. Blocks are quantized
    /// together where that is the same thing (row-local formats; columns when `rows` divides into
    /// blocks), one by one otherwise (a per-tensor NVFP4 scale, a column block that would
    /// straddle two experts). `acc` (only with `Quant::Rows`) collects the counts.
    #[allow(clippy::too_many_arguments)]
    fn quantize(
        &self,
        kind: Quant,
        x: &CudaSlice<f32>,
        (rows, cols, batch): (usize, usize, usize),
        fmt: &QuantFormat,
        out: &mut CudaSlice<f32>,
        mut acc: Option<&mut CudaSlice<u64>>,
    ) -> Result<(), CudaError> {
        let per_tensor = matches!(
            fmt,
            QuantFormat::Nvfp4 {
                second: SecondScale::PerTensor,
                ..
            }
        );
        let aligned = kind != Quant::ColsPadded || rows.is_multiple_of(fmt.required_multiple());
        if batch == 1 || (!per_tensor && aligned) {
            return self.quantize_one(kind, x, rows * batch, cols, fmt, out, acc);
        }
        self.fq.per_block(x, out, (batch, rows * cols), |blk, q| {
            self.quantize_one(kind, blk, rows, cols, fmt, q, acc.as_deref_mut())
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn quantize_one(
        &self,
        kind: Quant,
        x: &CudaSlice<f32>,
        rows: usize,
        cols: usize,
        fmt: &QuantFormat,
        out: &mut CudaSlice<f32>,
        acc: Option<&mut CudaSlice<u64>>,
    ) -> Result<(), CudaError> {
        if rows == 0 {
            return Ok(());
        }
        match kind {
            Quant::Rows => self
                .fq
                .fake_quantize_rows_counted(x, rows, cols, fmt, out, acc),
            Quant::RowsPadded => self.fq.fake_quantize_rows_padded(x, rows, cols, fmt, out),
            Quant::ColsPadded => self.fq.fake_quantize_cols_padded(x, rows, cols, fmt, out),
        }
    }

    /// `linear::forward`: `y[n, m] = x[n, k] · Wᵀ` with the input quantized per the site's
    /// activation format, and the wgrad operand the backward mode asks for. With a stacked
    /// weight, `x` is `batch` blocks of `n` rows and `y` likewise.
    pub fn forward(
        &self,
        plan: &SitePlan,
        x: &CudaSlice<f32>,
        n: usize,
        w: &DeviceWeight,
    ) -> Result<(CudaSlice<f32>, DeviceLinearCache), CudaError> {
        self.forward_counted(plan, x, n, w, None)
    }

    /// [`Self::forward`] that adds the activation quantization's counts to `acc` (3 values:
    /// `LinearCache::stats`).
    pub fn forward_counted(
        &self,
        plan: &SitePlan,
        x: &CudaSlice<f32>,
        n: usize,
        w: &DeviceWeight,
        acc: Option<&mut CudaSlice<u64>>,
    ) -> Result<(CudaSlice<f32>, DeviceLinearCache), CudaError> {
        let (k, m, batch) = (w.in_dim, w.out_dim, w.batch);
        let rows = batch * n;
        let mut y = self.output(rows * m)?;
        let Some(fmt) = plan.activation_format() else {
            self.gemm(
                (x, false),
                (&w.w_fwd, true),
                &mut y,
                (n, k, m),
                batch,
                false,
            )?;
            let mut x_bwd = self.output(rows * k)?;
            if rows > 0 {
                self.stream
                    .memcpy_dtod(&x.slice(..rows * k), &mut x_bwd.slice_mut(..rows * k))?;
            }
            return Ok((y, DeviceLinearCache { x_bwd, n }));
        };
        // As on the CPU: a BF16 site's operand is its BF16 rounding, counted against the FP32
        // input; other formats quantize the BF16 values.
        let bf16_site = matches!(fmt, QuantFormat::Bf16);
        let x_hp = if bf16_site {
            None
        } else {
            let mut r = self.output(rows * k)?;
            self.fq.round_bf16(x, &mut r, rows * k)?;
            Some(r)
        };
        let mut x_q = self.output(rows * k)?;
        let src = x_hp.as_ref().unwrap_or(x);
        self.quantize(Quant::Rows, src, (n, k, batch), &fmt, &mut x_q, acc)?;
        self.gemm(
            (&x_q, false),
            (&w.w_fwd, true),
            &mut y,
            (n, k, m),
            batch,
            false,
        )?;
        let Some(x_hp) = x_hp else {
            // Already the BF16 operand, whatever the backward mode.
            return Ok((y, DeviceLinearCache { x_bwd: x_q, n }));
        };
        let x_bwd = match plan.backward {
            BackwardMode::HighPrecision => x_hp,
            BackwardMode::Dequantized => {
                let mut r = self.output(rows * k)?;
                self.fq.round_bf16(&x_q, &mut r, rows * k)?;
                r
            }
            BackwardMode::Quantized if n == 0 => x_hp,
            BackwardMode::Quantized => {
                let mut q = self.output(rows * k)?;
                self.quantize(Quant::ColsPadded, &x_hp, (n, k, batch), &fmt, &mut q, None)?;
                q
            }
        };
        Ok((y, DeviceLinearCache { x_bwd, n }))
    }

    /// [`Self::forward`] without what a backward needs (an inference pass: decode, the
    /// reference forward): the same quantization and GEMM, the output only.
    pub fn apply(
        &self,
        plan: &SitePlan,
        x: &CudaSlice<f32>,
        n: usize,
        w: &DeviceWeight,
    ) -> Result<CudaSlice<f32>, CudaError> {
        let (k, m, batch) = (w.in_dim, w.out_dim, w.batch);
        let rows = batch * n;
        let mut y = self.output(rows * m)?;
        let x_q = match plan.activation_format() {
            None => None,
            Some(fmt) => {
                let x_hp = if matches!(fmt, QuantFormat::Bf16) {
                    None
                } else {
                    let mut r = self.output(rows * k)?;
                    self.fq.round_bf16(x, &mut r, rows * k)?;
                    Some(r)
                };
                let mut q = self.output(rows * k)?;
                let src = x_hp.as_ref().unwrap_or(x);
                self.quantize(Quant::Rows, src, (n, k, batch), &fmt, &mut q, None)?;
                Some(q)
            }
        };
        let xin = x_q.as_ref().unwrap_or(x);
        self.gemm(
            (xin, false),
            (&w.w_fwd, true),
            &mut y,
            (n, k, m),
            batch,
            false,
        )?;
        Ok(y)
    }

    /// `linear::backward`: `dx = dy · W` (when `dx` is given, written) and `dW += dyᵀ · x`
    /// (accumulated), dy quantized as the plan's backward mode says; per block of a stacked
    /// weight.
    pub fn backward(
        &self,
        plan: &SitePlan,
        cache: &DeviceLinearCache,
        w: &DeviceWeight,
        dy: &CudaSlice<f32>,
        dx: Option<&mut CudaSlice<f32>>,
        dw: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let (n, k, m, batch) = (cache.n, w.in_dim, w.out_dim, w.batch);
        let rows = batch * n;
        if dy.len() < rows * m {
            return Err(CudaError::Shape(format!(
                "linear backward: dy holds {} floats, needs {rows} x {m}",
                dy.len()
            )));
        }
        if n == 0 {
            if let Some(dx) = dx {
                self.stream.memset_zeros(dx)?;
            }
            return Ok(());
        }
        // The dgrad and wgrad operands when they are not dy itself (the wgrad one only when it
        // differs from the dgrad one).
        let (own_d, own_w): (Option<CudaSlice<f32>>, Option<CudaSlice<f32>>) = match plan
            .activation_format()
        {
            None => (None, None),
            Some(fmt) => {
                let mut dy_hp = self.zeros(rows * m)?;
                self.fq.round_bf16(dy, &mut dy_hp, rows * m)?;
                if plan.precision != Precision::Bf16 && plan.backward == BackwardMode::Quantized {
                    // dgrad contracts over m (row blocks of dy, m padded where it does not
                    // divide into blocks); wgrad over n (column blocks of dy, n padded).
                    let (mut d, mut wq) = (self.zeros(rows * m)?, self.zeros(rows * m)?);
                    let shape = (n, m, batch);
                    self.quantize(Quant::RowsPadded, &dy_hp, shape, &fmt, &mut d, None)?;
                    self.quantize(Quant::ColsPadded, &dy_hp, shape, &fmt, &mut wq, None)?;
                    (Some(d), Some(wq))
                } else {
                    (Some(dy_hp), None)
                }
            }
        };
        let dy_d = own_d.as_ref().unwrap_or(dy);
        let dy_w = own_w.as_ref().unwrap_or(dy_d);
        if let Some(dx) = dx {
            self.gemm(
                (dy_d, false),
                (w.w_bwd.as_ref().unwrap_or(&w.w_fwd), false),
                dx,
                (n, m, k),
                batch,
                false,
            )?;
        }
        self.gemm(
            (dy_w, true),
            (&cache.x_bwd, false),
            dw,
            (m, n, k),
            batch,
            true,
        )
    }
}

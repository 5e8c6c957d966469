//! The precision-aware linear layer on the device: `engine::linear::forward` (keeping the
//! backward's operand, [`DeviceLinearCache`]) and `engine::linear::backward` over device tensors,
//! for a resident trainer. Every quantization is the CPU's, bit for bit
//! ([`CudaFakeQuantizer`]: rows, columns, and both with the block dimension zero-padded), so the
//! kept operand `x_bwd` equals the CPU's exactly; the GEMMs are cuBLAS FP32
//! (`CUBLAS_PEDANTIC_MATH`, no TF32), so outputs and gradients agree to summation order.
//!
//! Tested against the CPU layer in `tests/cuda_linear.rs` (passing on the H200, 2026-12-03; see
//! docs/cuda.md).

use super::fake_quant::CudaFakeQuantizer;
use super::{CudaDevice, CudaError, CudaQuantizer};
use crate::engine::linear::PreparedWeight;
use crate::formats::QuantFormat;
use crate::recipe::{BackwardMode, Precision, SitePlan};
use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{CudaSlice, CudaStream};
use std::sync::Arc;

/// A prepared weight on the device: the forward operand and the dgrad operand
/// ([`PreparedWeight::w_fwd`], [`PreparedWeight::w_bwd`]), `[out_dim, in_dim]` each.
pub struct DeviceWeight {
    w_fwd: CudaSlice<f32>,
    w_bwd: CudaSlice<f32>,
    out_dim: usize,
    in_dim: usize,
}

/// What the forward keeps for the backward (`linear::LinearCache` on the device).
pub struct DeviceLinearCache {
    /// Operand of the wgrad GEMM, `[n, in_dim]`, chosen by the backward mode.
    pub x_bwd: CudaSlice<f32>,
    pub n: usize,
}

/// A stored matrix operand of [`CudaLinear::gemm`]: the buffer and whether it holds the
/// transpose of the operand (row-major).
type Operand<'a> = (&'a CudaSlice<f32>, bool);

/// The linear layer's kernels (the fake quantizer), cuBLAS handle and stream on one GPU.
pub struct CudaLinear {
    stream: Arc<CudaStream>,
    fq: CudaFakeQuantizer,
    blas: CudaBlas,
}

impl CudaLinear {
    pub fn new(dev: &Arc<CudaDevice>) -> Result<Self, CudaError> {
        let q = Arc::new(CudaQuantizer::new(dev)?);
        let stream = q.stream().clone();
        let blas = super::gemm::pedantic_blas(&stream)?;
        Ok(CudaLinear {
            fq: CudaFakeQuantizer::new(q)?,
            stream,
            blas,
        })
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Copy a prepared weight's two operands to the device.
    pub fn upload(&self, w: &PreparedWeight) -> Result<DeviceWeight, CudaError> {
        Ok(DeviceWeight {
            w_fwd: self.stream.clone_htod(w.w_fwd())?,
            w_bwd: self.stream.clone_htod(w.w_bwd())?,
            out_dim: w.out_dim,
            in_dim: w.in_dim,
        })
    }

    fn zeros(&self, n: usize) -> Result<CudaSlice<f32>, CudaError> {
        Ok(self.stream.alloc_zeros(n.max(1))?)
    }

    /// Row-major `c[r, cc] = a[r, inner] · b[inner, cc]` (`+= ` when `accumulate`), FP32. Each
    /// operand is stored as itself or, when its flag says so, as its transpose. cuBLAS is
    /// column-major, where a row-major buffer reads as its transpose: `cᵀ = bᵀ · aᵀ`.
    fn gemm(
        &self,
        a: Operand<'_>,
        b: Operand<'_>,
        c: &mut CudaSlice<f32>,
        (r, inner, cc): (usize, usize, usize),
        accumulate: bool,
    ) -> Result<(), CudaError> {
        if r == 0 || cc == 0 {
            return Ok(());
        }
        let dim = |v: usize| {
            i32::try_from(v).map_err(|_| {
                CudaError::Shape(format!("gemm dimension {v} exceeds cuBLAS's 32-bit limit"))
            })
        };
        let ((a_buf, a_t), (b_buf, b_t)) = (a, b);
        if a_buf.len() < r * inner || b_buf.len() < inner * cc || c.len() < r * cc {
            return Err(CudaError::Shape(format!(
                "linear gemm: buffers of {}, {}, {} floats for [{r}, {inner}] x [{inner}, {cc}]",
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
        let cfg = GemmConfig {
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
        // SAFETY: checked above: a holds r·inner, b inner·cc and c r·cc floats, and each leading
        // dimension is the row length of that row-major buffer as stored, so cuBLAS stays inside.
        unsafe { self.blas.gemm(cfg, b_buf, a_buf, c) }?;
        Ok(())
    }

    /// `linear::forward`: `y[n, m] = x[n, k] · Wᵀ` with the input quantized per the site's
    /// activation format, and the wgrad operand the backward mode asks for.
    pub fn forward(
        &self,
        plan: &SitePlan,
        x: &CudaSlice<f32>,
        n: usize,
        w: &DeviceWeight,
    ) -> Result<(CudaSlice<f32>, DeviceLinearCache), CudaError> {
        let (k, m) = (w.in_dim, w.out_dim);
        let mut y = self.zeros(n * m)?;
        let Some(fmt) = plan.activation_format() else {
            self.gemm((x, false), (&w.w_fwd, true), &mut y, (n, k, m), false)?;
            let mut x_bwd = self.zeros(n * k)?;
            if n > 0 {
                self.stream
                    .memcpy_dtod(&x.slice(..n * k), &mut x_bwd.slice_mut(..n * k))?;
            }
            return Ok((y, DeviceLinearCache { x_bwd, n }));
        };
        // As on the CPU: a BF16 site's operand is its BF16 rounding; other formats quantize the
        // BF16 values.
        let bf16_site = matches!(fmt, QuantFormat::Bf16);
        let x_hp = if bf16_site {
            None
        } else {
            let mut r = self.zeros(n * k)?;
            self.fq.round_bf16(x, &mut r, n * k)?;
            Some(r)
        };
        let mut x_q = self.zeros(n * k)?;
        if n > 0 {
            self.fq
                .fake_quantize_rows(x_hp.as_ref().unwrap_or(x), n, k, &fmt, &mut x_q)?;
        }
        self.gemm((&x_q, false), (&w.w_fwd, true), &mut y, (n, k, m), false)?;
        let Some(x_hp) = x_hp else {
            // Already the BF16 operand, whatever the backward mode.
            return Ok((y, DeviceLinearCache { x_bwd: x_q, n }));
        };
        let x_bwd = match plan.backward {
            BackwardMode::HighPrecision => x_hp,
            BackwardMode::Dequantized => {
                let mut r = self.zeros(n * k)?;
                self.fq.round_bf16(&x_q, &mut r, n * k)?;
                r
            }
            BackwardMode::Quantized if n == 0 => x_hp,
            BackwardMode::Quantized => {
                let mut q = self.zeros(n * k)?;
                self.fq
                    .fake_quantize_cols_padded(&x_hp, n, k, &fmt, &mut q)?;
                q
            }
        };
        Ok((y, DeviceLinearCache { x_bwd, n }))
    }

    /// `linear::backward`: `dx = dy · W` (when `dx` is given, written) and `dW += dyᵀ · x`
    /// (accumulated), dy quantized as the plan's backward mode says.
    pub fn backward(
        &self,
        plan: &SitePlan,
        cache: &DeviceLinearCache,
        w: &DeviceWeight,
        dy: &CudaSlice<f32>,
        dx: Option<&mut CudaSlice<f32>>,
        dw: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let (n, k, m) = (cache.n, w.in_dim, w.out_dim);
        if dy.len() < n * m {
            return Err(CudaError::Shape(format!(
                "linear backward: dy holds {} floats, needs {n} x {m}",
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
                let mut dy_hp = self.zeros(n * m)?;
                self.fq.round_bf16(dy, &mut dy_hp, n * m)?;
                if plan.precision != Precision::Bf16 && plan.backward == BackwardMode::Quantized {
                    // dgrad contracts over m (row blocks of dy, m padded where it does not
                    // divide into blocks); wgrad over n (column blocks of dy, n padded).
                    let (mut d, mut wq) = (self.zeros(n * m)?, self.zeros(n * m)?);
                    self.fq
                        .fake_quantize_rows_padded(&dy_hp, n, m, &fmt, &mut d)?;
                    self.fq
                        .fake_quantize_cols_padded(&dy_hp, n, m, &fmt, &mut wq)?;
                    (Some(d), Some(wq))
                } else {
                    (Some(dy_hp), None)
                }
            }
        };
        let dy_d = own_d.as_ref().unwrap_or(dy);
        let dy_w = own_w.as_ref().unwrap_or(dy_d);
        if let Some(dx) = dx {
            self.gemm((dy_d, false), (&w.w_bwd, false), dx, (n, m, k), false)?;
        }
        self.gemm((dy_w, true), (&cache.x_bwd, false), dw, (m, n, k), true)
    }
}

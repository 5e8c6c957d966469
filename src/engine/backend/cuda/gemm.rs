//! [`CudaBackend`]: the engine's [`Backend`] on one GPU, GEMMs through cuBLAS SGEMM.
//!
//! Operands arrive quantize-dequantized (and BF16-exact where the recipe says so) from
//! `engine::linear`, so the GEMM keeps them in FP32 and accumulates in FP32: cuBLAS runs in
//! `CUBLAS_PEDANTIC_MATH`, which rules out TF32 and any reduced-precision tensor-core path, whatever
//! `NVIDIA_TF32_OVERRIDE` says.
//!
//! Each call copies its operands to the device, multiplies, and copies the result back: the model
//! and its element-wise ops still run on the CPU (see `docs/cuda.md` for what that costs).
//! Concurrent callers (the suite runner's workers) each take a *lane* — a stream, a cuBLAS handle
//! and grow-only device buffers — from a pool, so they never share a handle or a stream. cuBLAS is
//! deterministic for a given shape, handle configuration and GPU, so the same seed gives the same
//! metrics run to run.

use super::{CudaDevice, CudaError};
use crate::engine::backend::{Backend, MatRef};
use cudarc::cublas::sys::{cublasMath_t, cublasOperation_t};
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{CudaSlice, CudaStream};
use std::sync::{Arc, Mutex};

/// A stream, its cuBLAS handle and operand buffers, used by one GEMM at a time.
struct Lane {
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    a: CudaSlice<f32>,
    b: CudaSlice<f32>,
    c: CudaSlice<f32>,
}

impl Lane {
    fn new(dev: &CudaDevice) -> Result<Self, CudaError> {
        let stream = dev.context().new_stream()?;
        let blas = CudaBlas::new(stream.clone())?;
        // SAFETY: the handle is valid (just created) and owned by this lane; setting its math mode
        // is a plain configuration call with no memory access.
        let st = unsafe {
            cudarc::cublas::sys::cublasSetMathMode(
                *blas.handle(),
                cublasMath_t::CUBLAS_PEDANTIC_MATH,
            )
        };
        st.result()?;
        Ok(Lane {
            a: stream.alloc_zeros(1)?,
            b: stream.alloc_zeros(1)?,
            c: stream.alloc_zeros(1)?,
            stream,
            blas,
        })
    }
}

/// Make `buf` hold at least `n` values (contents are not kept).
fn ensure(stream: &Arc<CudaStream>, buf: &mut CudaSlice<f32>, n: usize) -> Result<(), CudaError> {
    if buf.len() < n {
        *buf = stream.alloc_zeros(n.next_power_of_two())?;
    }
    Ok(())
}

/// The engine on one GPU.
pub struct CudaBackend {
    dev: Arc<CudaDevice>,
    lanes: Mutex<Vec<Lane>>,
}

impl CudaBackend {
    /// Open `cuda:ordinal` and check that cuBLAS starts there.
    pub fn new(ordinal: usize) -> Result<Self, CudaError> {
        let dev = CudaDevice::open(ordinal)?;
        let first = Lane::new(&dev)?;
        Ok(CudaBackend {
            dev,
            lanes: Mutex::new(vec![first]),
        })
    }

    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.dev
    }

    fn take_lane(&self) -> Result<Lane, CudaError> {
        let popped = self.lanes.lock().ok().and_then(|mut l| l.pop());
        match popped {
            Some(l) => Ok(l),
            None => Lane::new(&self.dev),
        }
    }

    fn give_lane(&self, lane: Lane) {
        if let Ok(mut l) = self.lanes.lock() {
            l.push(lane);
        }
    }

    /// `c = a · b` (or `c += a · b`) on the GPU, FP32 operands and accumulation.
    pub fn try_gemm(
        &self,
        a: MatRef<'_>,
        b: MatRef<'_>,
        c: &mut [f32],
        accumulate: bool,
    ) -> Result<(), CudaError> {
        let (m, k, n) = crate::engine::backend::gemm_dims(a, b, c.len());
        if m == 0 || n == 0 {
            return Ok(());
        }
        if k == 0 {
            if !accumulate {
                c.fill(0.0);
            }
            return Ok(());
        }
        let mut lane = self.take_lane()?;
        let r = gemm_on(&mut lane, a, b, c, accumulate, (m, k, n));
        if r.is_ok() {
            self.give_lane(lane); // a lane whose call failed is dropped, not reused
        }
        r
    }
}

/// Row-major `C[m,n] = A[m,k] · B[k,n]` is column-major `Cᵀ = Bᵀ · Aᵀ`: a row-major buffer read
/// column-major is its transpose, so cuBLAS gets B first, A second, and no copy is transposed.
fn gemm_on(
    lane: &mut Lane,
    a: MatRef<'_>,
    b: MatRef<'_>,
    c: &mut [f32],
    accumulate: bool,
    (m, k, n): (usize, usize, usize),
) -> Result<(), CudaError> {
    let Lane {
        stream,
        blas,
        a: da,
        b: db,
        c: dc,
    } = lane;
    ensure(stream, da, a.data.len())?;
    ensure(stream, db, b.data.len())?;
    ensure(stream, dc, m * n)?;
    stream.memcpy_htod(a.data, &mut da.slice_mut(..a.data.len()))?;
    stream.memcpy_htod(b.data, &mut db.slice_mut(..b.data.len()))?;
    if accumulate {
        stream.memcpy_htod(&*c, &mut dc.slice_mut(..m * n))?;
    }
    let op = |t: bool| {
        if t {
            cublasOperation_t::CUBLAS_OP_T
        } else {
            cublasOperation_t::CUBLAS_OP_N
        }
    };
    let dim = |v: usize| -> Result<i32, CudaError> {
        i32::try_from(v).map_err(|_| {
            CudaError::Shape(format!("gemm dimension {v} exceeds cuBLAS's 32-bit limit"))
        })
    };
    let cfg = GemmConfig {
        transa: op(b.trans),
        transb: op(a.trans),
        m: dim(n)?,
        n: dim(m)?,
        k: dim(k)?,
        alpha: 1.0f32,
        lda: dim(b.cols)?,
        ldb: dim(a.cols)?,
        beta: if accumulate { 1.0 } else { 0.0 },
        ldc: dim(n)?,
    };
    // SAFETY: the buffers hold at least b.rows*b.cols, a.rows*a.cols and m*n floats (ensured
    // above), and the leading dimensions are the stored row lengths, so cuBLAS reads and writes
    // inside them.
    unsafe { blas.gemm(cfg, &*db, &*da, &mut *dc) }?;
    stream.memcpy_dtoh(&dc.slice(..m * n), c)?;
    stream.synchronize()?;
    Ok(())
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        format!("cuda:{}", self.dev.ordinal())
    }

    /// GPU failures cannot be returned through the trait: they panic with the device and shape,
    /// which `engine::run::run_one` turns into a `failed` run with that message.
    fn gemm(&self, a: MatRef<'_>, b: MatRef<'_>, c: &mut [f32], accumulate: bool) {
        if let Err(e) = self.try_gemm(a, b, c, accumulate) {
            let (m, k) = a.shape();
            let n = b.shape().1;
            panic!("{}: gemm {m}x{k}x{n} failed: {e}", self.name());
        }
    }
}

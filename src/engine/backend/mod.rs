//! The small backend interface the model runs on. The CPU backend is the reference; a CUDA backend
//! implements the same trait, so model and trainer code never name a device.
//!
//! Only dense GEMM lives here for now: it is where all the FLOPs are. Element-wise ops are plain
//! functions in `engine::ops`, written once for the CPU reference.

pub mod cpu;

pub use cpu::CpuBackend;

/// Row-major matrix operand: `data` holds `rows x cols` values; `trans` says to use its transpose.
#[derive(Clone, Copy)]
pub struct MatRef<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    pub trans: bool,
}

impl<'a> MatRef<'a> {
    pub fn new(data: &'a [f32], rows: usize, cols: usize) -> Self {
        debug_assert_eq!(data.len(), rows * cols);
        MatRef {
            data,
            rows,
            cols,
            trans: false,
        }
    }
    /// The same storage read as its transpose.
    pub fn t(self) -> Self {
        MatRef {
            trans: !self.trans,
            ..self
        }
    }
    /// Logical (rows, cols) after the optional transpose.
    pub fn shape(&self) -> (usize, usize) {
        if self.trans {
            (self.cols, self.rows)
        } else {
            (self.rows, self.cols)
        }
    }
}

/// Compute devices. Every method takes explicit shapes and FP32 buffers; operands have already been
/// quantized-dequantized by `engine::linear`, so a backend only ever does FP32-accumulated math.
pub trait Backend: Send + Sync {
    /// Human-readable device name for manifests and progress lines (e.g. `cpu`, `cuda:0`).
    fn name(&self) -> String;
    /// `c = a · b` (or `c += a · b` when `accumulate`), FP32 accumulation. The result must not depend on
    /// the number of threads (split only over rows/columns of `c`, never over the inner dimension).
    fn gemm(&self, a: MatRef<'_>, b: MatRef<'_>, c: &mut [f32], accumulate: bool);
}

//! The CPU backend: the host passes ([`HostDecoder`], [`HostPass`], [`model::forward_rows`]),
//! and the GEMM every host matmul runs through.
//!
//! The GEMM is `matrixmultiply`'s SGEMM (packing + SIMD micro-kernels, well kept, no BLAS system
//! dependency). Large products are split over row blocks of the output and run on rayon's pool
//! (which the model's other parallel loops share, so nothing is oversubscribed); an output
//! element's sum does not depend on which rows it is computed with, so results are identical
//! whatever the thread count — lockstep's determinism rule (tested).

use super::Backend;
use crate::engine::device::OpError;
use crate::engine::layout::Layout;
use crate::engine::model::{self, HostPass, PreparedModel, Routing, TrainPass};
use crate::engine::rollout::{Decoder, HostDecoder};
use rayon::prelude::*;
use std::sync::atomic::{AtomicU64, Ordering};

/// The engine on this host's CPU.
#[derive(Debug, Default, Clone, Copy)]
pub struct CpuBackend;

impl Backend for CpuBackend {
    fn name(&self) -> String {
        "cpu".to_string()
    }

    fn decoder<'a>(
        &'a self,
        prep: &'a PreparedModel,
        seqs: usize,
        positions: usize,
    ) -> Result<Box<dyn Decoder + 'a>, OpError> {
        Ok(Box::new(HostDecoder::new(prep, seqs, positions)))
    }

    fn forward_logits(
        &self,
        prep: &PreparedModel,
        tokens: &[u32],
        layout: &Layout,
        replay: Option<&Routing>,
    ) -> Result<Vec<f32>, OpError> {
        Ok(model::forward_rows(prep, tokens, layout, replay).0)
    }

    fn train_forward<'a>(
        &'a self,
        prep: &'a PreparedModel,
        tokens: &[u32],
        layout: &Layout,
        replay: Option<&Routing>,
    ) -> Result<Box<dyn TrainPass + 'a>, OpError> {
        Ok(Box::new(HostPass::forward(prep, tokens, layout, replay)))
    }
}

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

/// FLOPs (2·m·k·n per product) [`gemm`] has run in this process, for `lockstep bench engine`.
static FLOPS: AtomicU64 = AtomicU64::new(0);

/// The FLOPs [`gemm`] has run in this process so far.
pub fn gemm_flops() -> u64 {
    FLOPS.load(Ordering::Relaxed)
}

/// `c = a · b` (or `c += a · b` when `accumulate`), FP32 accumulation, split only over rows of
/// `c` (never over the inner dimension), so the result does not depend on the thread count.
///
/// # Panics
/// When the operands' shapes do not fit each other or `c`.
pub fn gemm(a: MatRef<'_>, b: MatRef<'_>, c: &mut [f32], accumulate: bool) {
    let (m, k) = a.shape();
    let (kb, n) = b.shape();
    assert_eq!(
        k, kb,
        "gemm inner dimensions differ: a is {m}x{k}, b is {kb}x{n}"
    );
    assert_eq!(
        c.len(),
        m * n,
        "gemm output has {} values, expected {m}x{n}",
        c.len()
    );
    FLOPS.fetch_add(2 * (m * k * n) as u64, Ordering::Relaxed);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            c.fill(0.0);
        }
        return;
    }
    // Strides of the logical (transposed or not) row-major operands.
    let (rsa, csa) = if a.trans {
        (1, a.cols as isize)
    } else {
        (a.cols as isize, 1)
    };
    let (rsb, csb) = if b.trans {
        (1, b.cols as isize)
    } else {
        (b.cols as isize, 1)
    };
    let beta = if accumulate { 1.0 } else { 0.0 };
    let rows = rows_per_task(m, k, n, rayon::current_num_threads());
    let a_ptr = SendPtr(a.data.as_ptr());
    let run = |(i, c_rows): (usize, &mut [f32])| {
        let r0 = i * rows;
        let mr = c_rows.len() / n;
        // SAFETY: matrixmultiply's sgemm is an unsafe fn over raw pointers. The shape asserts
        // above guarantee every index of the full product is inside the three slices; this task
        // computes rows r0..r0+mr of it (A's rows start at r0·rsa, inside A since r0+mr <= m)
        // into its own disjoint chunk of C.
        unsafe {
            matrixmultiply::sgemm(
                mr,
                k,
                n,
                1.0,
                a_ptr.get().offset(r0 as isize * rsa),
                rsa,
                csa,
                b.data.as_ptr(),
                rsb,
                csb,
                beta,
                c_rows.as_mut_ptr(),
                n as isize,
                1,
            );
        }
    };
    if rows >= m {
        run((0, c));
    } else {
        c.par_chunks_mut(rows * n).enumerate().for_each(run);
    }
}

/// A's base pointer, shared read-only by the row-block tasks.
#[derive(Clone, Copy)]
struct SendPtr(*const f32);
// SAFETY: the pointee (A's data) is only read, and outlives the tasks (they end inside `gemm`).
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// Through a method, so closures capture the wrapper (Send) rather than the raw field.
    fn get(self) -> *const f32 {
        self.0
    }
}

/// Output rows per task: the whole product when it is small (a split would cost more than it
/// saves), else blocks of at least 64 rows, about two per thread so a busy thread can be helped.
fn rows_per_task(m: usize, k: usize, n: usize, threads: usize) -> usize {
    const MIN_FLOPS: usize = 1 << 22;
    if threads <= 1 || 2 * m * k * n < MIN_FLOPS || m < 128 {
        return m.max(1);
    }
    m.div_ceil(2 * threads).max(64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: MatRef, b: MatRef) -> Vec<f32> {
        let (m, k) = a.shape();
        let (_, n) = b.shape();
        let at = |i: usize, j: usize| {
            if a.trans {
                a.data[j * a.cols + i]
            } else {
                a.data[i * a.cols + j]
            }
        };
        let bt = |i: usize, j: usize| {
            if b.trans {
                b.data[j * b.cols + i]
            } else {
                b.data[i * b.cols + j]
            }
        };
        let mut c = vec![0.0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0f64;
                for p in 0..k {
                    s += at(i, p) as f64 * bt(p, j) as f64;
                }
                c[i * n + j] = s as f32;
            }
        }
        c
    }

    /// `a` as an `m x k` operand and `b` as `k x n`, each stored as is or transposed.
    fn operands<'a>(
        a: &'a [f32],
        b: &'a [f32],
        (m, k, n): (usize, usize, usize),
        ta: bool,
        tb: bool,
    ) -> (MatRef<'a>, MatRef<'a>) {
        let ar = if ta {
            MatRef::new(a, k, m).t()
        } else {
            MatRef::new(a, m, k)
        };
        let br = if tb {
            MatRef::new(b, n, k).t()
        } else {
            MatRef::new(b, k, n)
        };
        (ar, br)
    }

    #[test]
    fn row_blocks_on_any_thread_count_give_the_same_bits() {
        let (m, k, n) = (1000, 96, 130);
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.11).cos()).collect();
        assert!(rows_per_task(m, k, n, 2) < m, "this product must be split");
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            let (ar, br) = operands(&a, &b, (m, k, n), ta, tb);
            let on = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let mut c = vec![0.5f32; m * n];
                pool.install(|| gemm(ar, br, &mut c, true));
                c.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            };
            let one = on(1);
            assert_eq!(one, on(2), "{ta} {tb}");
            assert_eq!(one, on(5), "{ta} {tb}");
        }
    }

    #[test]
    fn gemm_matches_naive_for_every_transpose() {
        let (m, k, n) = (7, 5, 3);
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.11).cos()).collect();
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            let (ar, br) = operands(&a, &b, (m, k, n), ta, tb);
            let mut c = vec![1.0f32; m * n];
            gemm(ar, br, &mut c, false);
            let want = naive(ar, br);
            for (x, y) in c.iter().zip(&want) {
                assert!((x - y).abs() < 1e-5, "{ta} {tb}: {x} vs {y}");
            }
            let mut acc = vec![1.0f32; m * n];
            gemm(ar, br, &mut acc, true);
            for (x, y) in acc.iter().zip(&want) {
                assert!((x - (y + 1.0)).abs() < 1e-5);
            }
        }
    }
}

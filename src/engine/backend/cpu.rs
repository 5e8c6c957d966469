//! CPU reference backend: `matrixmultiply`'s SGEMM (packing + SIMD micro-kernels, well kept, no
//! BLAS system dependency). Its threading splits over output blocks only, so results are identical
//! whatever the thread count — lockstep's determinism rule.

use super::{Backend, MatRef};

#[derive(Debug, Default, Clone, Copy)]
pub struct CpuBackend;

impl Backend for CpuBackend {
    fn name(&self) -> String {
        "cpu".to_string()
    }

    fn gemm(&self, a: MatRef<'_>, b: MatRef<'_>, c: &mut [f32], accumulate: bool) {
        let (m, k, n) = super::gemm_dims(a, b, c.len());
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
        // SAFETY-free: matrixmultiply's sgemm is an unsafe fn over raw pointers; the shape asserts above
        // guarantee every index it touches is inside the three slices.
        unsafe {
            matrixmultiply::sgemm(
                m,
                k,
                n,
                1.0,
                a.data.as_ptr(),
                rsa,
                csa,
                b.data.as_ptr(),
                rsb,
                csb,
                beta,
                c.as_mut_ptr(),
                n as isize,
                1,
            );
        }
    }
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

    #[test]
    fn gemm_matches_naive_for_every_transpose() {
        let (m, k, n) = (7, 5, 3);
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.11).cos()).collect();
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            let ar = if ta {
                MatRef::new(&a, k, m).t()
            } else {
                MatRef::new(&a, m, k)
            };
            let br = if tb {
                MatRef::new(&b, n, k).t()
            } else {
                MatRef::new(&b, k, n)
            };
            let mut c = vec![1.0f32; m * n];
            CpuBackend.gemm(ar, br, &mut c, false);
            let want = naive(ar, br);
            for (x, y) in c.iter().zip(&want) {
                assert!((x - y).abs() < 1e-5, "{ta} {tb}: {x} vs {y}");
            }
            let mut acc = vec![1.0f32; m * n];
            CpuBackend.gemm(ar, br, &mut acc, true);
            for (x, y) in acc.iter().zip(&want) {
                assert!((x - (y + 1.0)).abs() < 1e-5);
            }
        }
    }
}

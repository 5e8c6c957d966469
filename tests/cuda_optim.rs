//! The optimizer on the device (`cuda::optim`) against `engine::optim` on the CPU, bit for bit:
//! AdamW's update of parameters and moments and its chunk sums over three steps, and the
//! gradients' squared norms, for three runs stacked in one tensor with different constants
//! (learning rate, clipping scale, decay, step count), tensors of less than one chunk and of
//! several (a partial last one), zeros, subnormals, large and tiny values; an empty block sums to
//! -0.0 as Rust's `Sum` does, and NaN stays NaN.
//!
//! Without a GPU each test prints why it skips and passes; in CI they run on the CUDA emulator
//! (`scripts/cuda-emu`). `cargo test --release --test cuda_optim` on a GPU machine.

mod common;

use cudarc::driver::CudaStream;
use lockstep::engine::backend::cuda::CudaDevice;
use lockstep::engine::backend::cuda::optim::GpuOptim;
use lockstep::engine::optim::{AdamStep, CHUNK, sum_squares, update_tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::{Arc, OnceLock};

fn gpu(test: &str) -> Option<&'static (GpuOptim, Arc<CudaStream>)> {
    static G: OnceLock<Result<(GpuOptim, Arc<CudaStream>), String>> = OnceLock::new();
    common::gpu_fixture(&G, test, || {
        let dev = CudaDevice::open(0)?;
        let stream = dev.context().new_stream()?;
        Ok((GpuOptim::new(&dev)?, stream))
    })
}

/// Values of every kind a gradient or weight holds: mostly moderate, some zeros, subnormals,
/// large and tiny magnitudes, both signs.
fn values(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|i| match i % 13 {
            0 => 0.0,
            1 => f32::from_bits(rng.random_range(1..0x007F_FFFF)), // subnormal
            2 => rng.random_range(-1e4f32..1e4),
            3 => rng.random_range(-1e-20f32..1e-20),
            _ => rng.random_range(-1.0f32..1.0) * scale,
        })
        .collect()
}

fn bits32(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn adamw_on_the_device_is_the_cpu_update_bit_for_bit() {
    let Some((opt, s)) = gpu("adamw_on_the_device_is_the_cpu_update_bit_for_bit") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for len in [7, CHUNK, 2 * CHUNK + 123] {
        let runs = 3;
        let mut p = values(&mut rng, len * runs, 0.1);
        let (mut m, mut v) = (vec![0.0f32; len * runs], vec![0.0f32; len * runs]);
        let (mut dp, mut dm, mut dv) = (
            s.clone_htod(&p).unwrap(),
            s.clone_htod(&m).unwrap(),
            s.clone_htod(&v).unwrap(),
        );
        for t in 1..=3i32 {
            let g = values(&mut rng, len * runs, 1e-2);
            let dg = s.clone_htod(&g).unwrap();
            // Each run its own constants, as runs of different configurations would have.
            // Run 1 sits out step 2 (a run whose gradients were not finite): left as it is.
            let steps: Vec<Option<AdamStep>> = (0..runs)
                .map(|r| {
                    if (t, r) == (2, 1) {
                        return None;
                    }
                    let (beta1, beta2) = (0.9f32, [0.999f32, 0.95, 0.98][r]);
                    let t = t + r as i32;
                    Some(AdamStep {
                        lr: [1e-3, 3e-4, 1e-4][r],
                        beta1,
                        beta2,
                        eps: 1e-8,
                        bc1: 1.0 - beta1.powi(t),
                        bc2: 1.0 - beta2.powi(t),
                        scale: [1.0, 0.37, 0.5][r],
                        decay: [0.0, 0.1, 0.01][r],
                    })
                })
                .collect();
            let want: Vec<Vec<(f64, f64)>> = (0..runs)
                .map(|r| {
                    let b = r * len..(r + 1) * len;
                    let Some(k) = &steps[r] else {
                        return Vec::new();
                    };
                    update_tensor(
                        &mut p[b.clone()],
                        &mut m[b.clone()],
                        &mut v[b.clone()],
                        &g[b],
                        k,
                    )
                })
                .collect();
            let got = opt
                .update(s, &mut dp, &mut dm, &mut dv, &dg, len, &steps)
                .unwrap();
            let sums = |x: &Vec<Vec<(f64, f64)>>| -> Vec<(u64, u64)> {
                x.iter()
                    .flatten()
                    .map(|(a, b)| (a.to_bits(), b.to_bits()))
                    .collect()
            };
            // The run left as it is: no update to sum.
            let mut got = got;
            if t == 2 {
                assert!(
                    got[1].iter().all(|c| c.0 == 0.0),
                    "len {len}: skipped run's updates"
                );
                got[1].clear();
            }
            assert_eq!(sums(&got), sums(&want), "len {len} step {t}: chunk sums");
            assert_eq!(got[0].len(), len.div_ceil(CHUNK), "len {len}: chunks a run");
            for (name, host, dev) in [("p", &p, &dp), ("m", &m, &dm), ("v", &v, &dv)] {
                let back = s.clone_dtoh(dev).unwrap();
                assert!(
                    bits32(&back) == bits32(host),
                    "len {len} step {t}: {name} differs from the CPU's"
                );
            }
        }
    }
    // A buffer shorter than the runs it is asked to hold is an error, not an access past it.
    let mut short = s.clone_htod(&[0.0f32; 5]).unwrap();
    let (mut m, mut v) = (
        s.clone_htod(&[0.0f32; 8]).unwrap(),
        s.clone_htod(&[0.0f32; 8]).unwrap(),
    );
    let g = s.clone_htod(&[0.0f32; 8]).unwrap();
    let k = AdamStep {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        bc1: 0.1,
        bc2: 0.001,
        scale: 1.0,
        decay: 0.0,
    };
    assert!(
        opt.update(s, &mut short, &mut m, &mut v, &g, 4, &[Some(k), Some(k)])
            .is_err()
    );
}

#[test]
fn gradient_norms_on_the_device_are_the_cpu_sums_bit_for_bit() {
    let Some((opt, s)) = gpu("gradient_norms_on_the_device_are_the_cpu_sums_bit_for_bit") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    for (len, runs) in [(1, 1), (1000, 4), (2 * CHUNK + 5, 3), (0, 2)] {
        let x = values(&mut rng, len * runs, 3.0);
        let dx = s
            .clone_htod(&x[..])
            .unwrap_or_else(|_| s.clone_htod(&[0.0f32]).unwrap());
        let got = opt.sum_squares(s, &dx, len, runs).unwrap();
        let want: Vec<u64> = (0..runs)
            .map(|r| sum_squares(&x[r * len..(r + 1) * len]).to_bits())
            .collect();
        let got: Vec<u64> = got.iter().map(|v| v.to_bits()).collect();
        assert_eq!(got, want, "{runs} runs of {len}");
    }
    assert_eq!(sum_squares(&[]).to_bits(), (-0.0f64).to_bits());
    // Several tensors in one launch: each (tensor, run) its CPU sum, bit for bit.
    let runs = 3;
    let lens = [5usize, 2 * CHUNK + 3, 1, 700];
    let xs: Vec<Vec<f32>> = lens
        .iter()
        .map(|&l| values(&mut rng, l * runs, 2.0))
        .collect();
    let dxs: Vec<_> = xs.iter().map(|x| s.clone_htod(x).unwrap()).collect();
    let refs: Vec<_> = dxs.iter().collect();
    let got = opt.sum_squares_many(s, &refs, &lens, runs).unwrap();
    for (t, (x, &len)) in xs.iter().zip(&lens).enumerate() {
        for r in 0..runs {
            assert_eq!(
                got[t][r].to_bits(),
                sum_squares(&x[r * len..(r + 1) * len]).to_bits(),
                "tensor {t} run {r}"
            );
        }
    }
    assert!(
        opt.sum_squares_many(s, &refs, &[5, 2 * CHUNK + 4, 1, 700], runs)
            .is_err()
    );
    assert!(opt.sum_squares_many(s, &refs[..2], &lens, runs).is_err());
    // A NaN gradient gives a NaN norm (the trainer's non-finite event).
    let mut x = values(&mut rng, 64, 1.0);
    x[40] = f32::NAN;
    let got = opt
        .sum_squares(s, &s.clone_htod(&x).unwrap(), 32, 2)
        .unwrap();
    assert!(got[0].is_finite() && got[1].is_nan(), "{got:?}");
    assert!(
        opt.sum_squares(s, &s.clone_htod(&x).unwrap(), 33, 2)
            .is_err()
    );
}

//! The precision-aware linear layer on the device (`cuda::linear::CudaLinear`) against the CPU's
//! (`engine::linear`): every precision x backward mode, on a 64-wide site with an odd token count
//! (the `Quantized` mode pads the token dimension) and on an 8-wide router-like site (its dgrad
//! pads dy's columns).
//!
//! The operand the forward keeps for the wgrad (`x_bwd`) is the CPU's bit for bit (it is a pure
//! quantization); the output, dx and dW (accumulated onto a non-zero dW) agree to summation order.
//! Weight preparation on the device (`CudaLinear::prepare`) gives the CPU's operands bit for bit.
//!
//! Each test prints why and returns when no GPU is usable. On a GPU machine:
//! `cargo test --release --test cuda_linear -- --nocapture`.

mod common;

use common::{max_abs, max_rel, same_bits, uniform};
use lockstep::engine::backend::cuda::CudaDevice;
use lockstep::engine::backend::cuda::linear::CudaLinear;
use lockstep::engine::linear;
use lockstep::recipe::{BackwardMode, Precision, SecondScale, SitePlan};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::sync::OnceLock;

fn gpu(test: &str) -> Option<&'static CudaLinear> {
    static G: OnceLock<Result<CudaLinear, String>> = OnceLock::new();
    common::gpu_fixture(&G, test, || CudaLinear::new(&CudaDevice::open(0)?))
}

fn plans() -> Vec<SitePlan> {
    let mut v = vec![SitePlan::FP32];
    for precision in [
        Precision::Bf16,
        Precision::Mxfp8,
        Precision::Nvfp4,
        Precision::Fp8Block,
    ] {
        for backward in [
            BackwardMode::HighPrecision,
            BackwardMode::Dequantized,
            BackwardMode::Quantized,
        ] {
            v.push(SitePlan {
                precision,
                backward,
                ..SitePlan::FP32
            });
        }
    }
    // NVFP4 with per-tensor activation scales and two shards.
    v.push(SitePlan {
        precision: Precision::Nvfp4,
        backward: BackwardMode::Quantized,
        act_scale: SecondScale::PerTensor,
        shards: 2,
        ..SitePlan::FP32
    });
    v
}

#[test]
fn device_linear_forward_and_backward_match_the_cpu_layer() {
    let Some(lin) = gpu("device_linear_forward_and_backward_match_the_cpu_layer") else {
        return;
    };
    let s = lin.stream();
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut failures = Vec::new();
    // (tokens, in, out): an expert-like site with an odd token count, and the router's shape.
    for (n, k, m) in [(37, 128, 64), (300, 128, 8)] {
        for plan in plans() {
            let what = format!("{:?}/{:?} n {n} k {k} m {m}", plan.precision, plan.backward);
            let w = uniform(&mut rng, m * k, 0.2);
            let x = uniform(&mut rng, n * k, 2.0);
            let dy = uniform(&mut rng, n * m, 1.0);
            let dw0 = uniform(&mut rng, m * k, 0.1);
            let pw = linear::prepare_weight(&plan, &w, m, k);
            let mut y = vec![0.0f32; n * m];
            let cache = linear::forward(&plan, &x, n, &pw, &mut y);
            let (mut dx, mut dw) = (vec![0.0f32; n * k], dw0.clone());
            linear::backward(&plan, &cache, &pw, &dy, Some(&mut dx), &mut dw);

            let dev_w = lin.upload(&pw).unwrap();
            let (gy, gcache) = lin
                .forward(
                    std::slice::from_ref(&plan),
                    &s.clone_htod(&x).unwrap(),
                    n,
                    &dev_w,
                )
                .unwrap();
            let (mut gdx, mut gdw) = (
                s.alloc_zeros::<f32>(n * k).unwrap(),
                s.clone_htod(&dw0).unwrap(),
            );
            lin.backward(
                std::slice::from_ref(&plan),
                &gcache,
                &dev_w,
                &s.clone_htod(&dy).unwrap(),
                Some(&mut gdx),
                &mut gdw,
            )
            .unwrap();
            let down = |b: &cudarc::driver::CudaSlice<f32>, len: usize| {
                let v = s.clone_dtoh(&b.slice(..len)).unwrap();
                s.synchronize().unwrap();
                v
            };
            if let Err(e) = same_bits(&what, &down(&gcache.x_bwd, n * k), &cache.x_bwd) {
                failures.push(format!("x_bwd: {e}"));
            }
            // Summation order only: FP32 sums of up to 300 products, relative to the largest value.
            let checks = [
                ("y", down(&gy, n * m), y),
                ("dx", down(&gdx, n * k), dx),
                ("dw", down(&gdw, m * k), dw),
            ];
            for (name, got, want) in checks {
                let (r, i) = max_rel(&got, &want, max_abs(&want));
                if r.is_nan() || r >= 1e-5 {
                    failures.push(format!(
                        "{what}: {name} off by {r:e} of its largest value at {i} (gpu {:e}, cpu {:e})",
                        got[i], want[i]
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Weight preparation on the device (`CudaLinear::prepare`, for master weights kept on the GPU)
/// gives `linear::prepare_weight`'s operands bit for bit, for every precision x backward mode, on
/// a 64-wide site, an 8-wide router-like site (its `Quantized` dgrad operand pads the rows) and a
/// 128x128 one (whole FP8 tiles), with outliers and exact zeros among the weights; a weight
/// shorter than its shape is an error.
#[test]
fn device_weight_preparation_is_the_cpus() {
    let Some(lin) = gpu("device_weight_preparation_is_the_cpus") else {
        return;
    };
    let s = lin.stream();
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    for (out_dim, in_dim) in [(64, 64), (8, 64), (128, 128)] {
        let mut w = uniform(&mut rng, out_dim * in_dim, 0.2);
        w[3] = 40.0;
        w[7] = 0.0;
        w[in_dim + 1] = -1e-9;
        let dw = s.clone_htod(&w).unwrap();
        for plan in plans() {
            let cpu = linear::prepare_weight(&plan, &w, out_dim, in_dim);
            let dev = lin.prepare(&plan, &dw, out_dim, in_dim).unwrap();
            let fwd = s.clone_dtoh(&dev.w_fwd).unwrap();
            let what = format!("{plan:?} [{out_dim}, {in_dim}]");
            same_bits(
                &format!("{what}: forward operand"),
                &fwd[..w.len()],
                cpu.w_fwd(),
            )
            .unwrap_or_else(|e| panic!("{e}"));
            let bwd = match &dev.w_bwd {
                Some(b) => s.clone_dtoh(b).unwrap(),
                None => {
                    assert!(cpu.bwd_is_fwd(), "{what}: the device says dgrad is forward");
                    fwd.clone()
                }
            };
            same_bits(
                &format!("{what}: dgrad operand"),
                &bwd[..w.len()],
                cpu.w_bwd(),
            )
            .unwrap_or_else(|e| panic!("{e}"));
        }
    }
    let short = s.clone_htod(&[0.0f32; 10]).unwrap();
    assert!(lin.prepare(&plans()[1], &short, 4, 4).is_err());
}

/// A stack of weights prepared in one call (`CudaLinear::prepare_stacked`: a site's copy of
/// every run, or every run's routed experts) gives each weight's own operands bit for bit, for
/// every precision x backward mode: each weight's tensor scale is its own (the weights span
/// eight binades, so one scale for the stack would change codes), and a block never straddles
/// two weights. The router-like 8-row shape takes the weight-by-weight path for formats whose
/// column blocks would straddle weights.
#[test]
fn stacked_weight_preparation_is_each_weights_own() {
    let Some(lin) = gpu("stacked_weight_preparation_is_each_weights_own") else {
        return;
    };
    let s = lin.stream();
    let mut rng = ChaCha8Rng::seed_from_u64(47);
    let batch = 5;
    for (out_dim, in_dim) in [(64, 64), (8, 64)] {
        let len = out_dim * in_dim;
        let weights: Vec<Vec<f32>> = (0..batch)
            .map(|b| {
                let mut w = uniform(&mut rng, len, 0.2 * 4f32.powi(b as i32 - 2));
                w[b * 3] = if b == 1 { 0.0 } else { w[b * 3] * 9.0 };
                w
            })
            .collect();
        let stack: Vec<f32> = weights.concat();
        let dw = s.clone_htod(&stack).unwrap();
        for plan in plans() {
            let dev = lin
                .prepare_stacked(&plan, &dw, batch, out_dim, in_dim)
                .unwrap();
            let fwd = s.clone_dtoh(&dev.w_fwd).unwrap();
            let bwd = dev.w_bwd.as_ref().map(|b| s.clone_dtoh(b).unwrap());
            for (b, w) in weights.iter().enumerate() {
                let cpu = linear::prepare_weight(&plan, w, out_dim, in_dim);
                let what = format!("{plan:?} [{out_dim}, {in_dim}] weight {b} of {batch}");
                let range = b * len..(b + 1) * len;
                same_bits(
                    &format!("{what}: forward operand"),
                    &fwd[range.clone()],
                    cpu.w_fwd(),
                )
                .unwrap_or_else(|e| panic!("{e}"));
                let got = bwd.as_ref().map_or(&fwd[range.clone()], |v| &v[range]);
                same_bits(&format!("{what}: dgrad operand"), got, cpu.w_bwd())
                    .unwrap_or_else(|e| panic!("{e}"));
            }
        }
    }
}

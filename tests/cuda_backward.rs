//! The backward kernels (`engine::backend::cuda::backward`) against the CPU's backward ops
//! (`engine::ops`) at the engine's shapes (D 128, F 256, 2272 rows, 8 experts, top-2), each
//! accumulating into a gradient that already holds values, as the trainer's do.
//!
//! Bit-identical to the CPU: RMSNorm (dx and dg), the router, the embedding and attention (their
//! sums run in one thread in the CPU's order; attention reads the forward's softmax weights, so no
//! `expf`), and AdamW's parameters. Within a tolerance: SwiGLU (the GPU's `expf`) and
//! AdamW's FP64 sums of squares (a fixed tree order instead of the CPU's sequential one).
//!
//! Each test prints why and returns when no GPU is usable. On a GPU machine:
//! `cargo test --release --test cuda_backward -- --nocapture`.

mod common;

use common::{StreamIo, assert_rel, max_abs, ragged, same_bits, uniform};
use cudarc::driver::CudaStream;
use lockstep::engine::backend::cuda::backward::{AdamStep, CudaBackwardOps, DeviceGroups};
use lockstep::engine::backend::cuda::ops::DeviceLayout;
use lockstep::engine::backend::cuda::{CudaDevice, CudaError};
use lockstep::engine::layout::Layout;
use lockstep::engine::model::{ModelConfig, Params};
use lockstep::engine::ops;
use lockstep::engine::optim::AdamW;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::{Arc, OnceLock};

const D: usize = 128;
const F: usize = 256;
const H: usize = 4;
const E: usize = 8;
const K: usize = 2;
/// The benchmark batch's trainer rows.
const N: usize = 2272;

struct Gpu {
    ops: CudaBackwardOps,
    stream: Arc<CudaStream>,
}

fn gpu(test: &str) -> Option<&'static Gpu> {
    static G: OnceLock<Result<Gpu, String>> = OnceLock::new();
    common::gpu_fixture(&G, test, || {
        let d = CudaDevice::open(0)?;
        Ok(Gpu {
            ops: CudaBackwardOps::new(&d)?,
            stream: d.context().new_stream()?,
        })
    })
}

impl StreamIo for Gpu {
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

#[test]
fn rmsnorm_backward_matches_cpu_bit_for_bit() {
    let Some(g) = gpu("rmsnorm_backward_matches_cpu_bit_for_bit") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    for n in [1, 37, N] {
        let x = uniform(&mut rng, n * D, 3.0);
        let gain = uniform(&mut rng, D, 1.5);
        let dout = uniform(&mut rng, n * D, 1.0);
        let (mut out, mut rstd) = (vec![0.0; n * D], vec![0.0; n]);
        ops::rmsnorm_forward(&mut out, &mut rstd, &x, &gain, n, D);
        // Gradients that already hold values: the kernels must add, not overwrite.
        let (mut dx, mut dg) = (uniform(&mut rng, n * D, 0.5), uniform(&mut rng, D, 0.5));
        let (mut gdx, mut gdg) = (g.up(&dx), g.up(&dg));
        ops::rmsnorm_backward(&mut dx, &mut dg, &dout, &x, &gain, &rstd, n, D);
        g.ops
            .rmsnorm_backward(
                &g.stream,
                &mut gdx,
                &mut gdg,
                &g.up(&dout),
                &g.up(&x),
                &g.up(&gain),
                &g.up(&rstd),
                n,
                D,
            )
            .unwrap();
        same_bits(&format!("n {n}: dx"), &g.down(&gdx), &dx).unwrap();
        same_bits(&format!("n {n}: dg"), &g.down(&gdg), &dg).unwrap();
    }
}

#[test]
fn swiglu_backward_within_1e_5_of_cpu() {
    let Some(g) = gpu("swiglu_backward_within_1e_5_of_cpu") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let n = N;
    let inp = uniform(&mut rng, n * 2 * F, 6.0);
    let dout = uniform(&mut rng, n * F, 1.0);
    let mut dinp = uniform(&mut rng, n * 2 * F, 0.5);
    let mut gd = g.up(&dinp);
    ops::swiglu_backward(&mut dinp, &dout, &inp, n, F);
    g.ops
        .swiglu_backward(&g.stream, &mut gd, &g.up(&dout), &g.up(&inp), n, F)
        .unwrap();
    // Relative to the largest value: an `expf` ulp moves a term by an ulp of the term, and the
    // value it lands in can be much smaller than the term (cancellation).
    assert_rel("swiglu dinp", &g.down(&gd), &dinp, max_abs(&dinp), 1e-5);
}

#[test]
fn router_backward_matches_cpu_bit_for_bit() {
    let Some(g) = gpu("router_backward_matches_cpu_bit_for_bit") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let n = N;
    let logits = uniform(&mut rng, n * E, 4.0);
    let (mut probs, mut ids, mut w) = (vec![0.0; n * E], vec![0u32; n * K], vec![0.0; n * K]);
    ops::router_forward(&mut probs, &mut ids, &mut w, &logits, n, E, K, None);
    let dw = uniform(&mut rng, n * K, 1.0);
    let mut dl = uniform(&mut rng, n * E, 0.5);
    let mut gdl = g.up(&dl);
    ops::router_backward(&mut dl, &dw, &ids, &w, n, E, K);
    g.ops
        .router_backward(
            &g.stream,
            &mut gdl,
            &g.up(&dw),
            &g.up(&ids),
            &g.up(&w),
            n,
            E,
            K,
        )
        .unwrap();
    same_bits("router dlogits", &g.down(&gdl), &dl).unwrap();
    // An expert id out of range poisons its row instead of writing outside it.
    let mut bad = ids.clone();
    bad[5 * K] = E as u32;
    let mut gbad = g.zeros::<f32>(n * E);
    g.ops
        .router_backward(
            &g.stream,
            &mut gbad,
            &g.up(&dw),
            &g.up(&bad),
            &g.up(&w),
            n,
            E,
            K,
        )
        .unwrap();
    let v = g.down(&gbad);
    assert!(v[5 * E..6 * E].iter().all(|x| x.is_nan()), "row 5 not NaN");
    assert!(v[..5 * E].iter().all(|x| !x.is_nan()), "rows 0-4 touched");
}

#[test]
fn embedding_backward_matches_cpu_bit_for_bit() {
    let Some(g) = gpu("embedding_backward_matches_cpu_bit_for_bit") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let (n, vocab, npos) = (N, 16, 16);
    // Few distinct tokens and positions, so each table row sums many rows: the order matters.
    let tokens: Vec<u32> = (0..n).map(|_| rng.random_range(0..vocab as u32)).collect();
    let positions: Vec<u32> = (0..n).map(|i| (i % 15) as u32).collect();
    let dout = uniform(&mut rng, n * D, 1.0);
    let mut dwte = uniform(&mut rng, vocab * D, 0.5);
    let mut dwpe = uniform(&mut rng, npos * D, 0.5);
    let (mut gte, mut gpe) = (g.up(&dwte), g.up(&dwpe));
    ops::embedding_backward(
        &mut dwte,
        &mut dwpe,
        &dout,
        &tokens,
        |i| positions[i] as usize,
        D,
    );
    g.ops
        .embedding_backward(
            &g.stream,
            &mut gte,
            &mut gpe,
            &g.up(&dout),
            &g.up(&tokens),
            &g.up(&positions),
            n,
            D,
        )
        .unwrap();
    same_bits("dwte", &g.down(&gte), &dwte).unwrap();
    same_bits("dwpe", &g.down(&gpe), &dwpe).unwrap();
}

#[test]
fn backward_shape_errors_name_the_buffer() {
    let Some(g) = gpu("backward_shape_errors_name_the_buffer") else {
        return;
    };
    let shape = |r: Result<(), CudaError>, what: &str| match r {
        Err(CudaError::Shape(m)) => assert!(m.contains(what), "{m:?} should name {what}"),
        other => panic!("expected a Shape error naming {what}, got {other:?}"),
    };
    let (n, s) = (4, &g.stream);
    let (x, gain, rstd) = (g.zeros::<f32>(n * D), g.zeros::<f32>(D), g.zeros::<f32>(n));
    let (mut dx, mut short) = (g.zeros::<f32>(n * D), g.zeros::<f32>(D - 1));
    shape(
        g.ops
            .rmsnorm_backward(s, &mut dx, &mut short, &x, &x, &gain, &rstd, n, D),
        "dg",
    );
    let mut dinp = g.zeros::<f32>(n * 2 * F - 1);
    shape(
        g.ops
            .swiglu_backward(s, &mut dinp, &g.zeros(n * F), &g.zeros(n * 2 * F), n, F),
        "dinp",
    );
    let mut dl = g.zeros::<f32>(n * E);
    shape(
        g.ops.router_backward(
            s,
            &mut dl,
            &g.zeros(n * K),
            &g.zeros(n * K - 1),
            &g.zeros(n * K),
            n,
            E,
            K,
        ),
        "ids",
    );
    shape(
        g.ops.router_backward(
            s,
            &mut dl,
            &g.zeros(n * K),
            &g.zeros(n * K),
            &g.zeros(n * K),
            n,
            E,
            E + 1,
        ),
        "top-k",
    );
}

/// Attention's backward on a plain and two ragged shared-prefix layouts (a key row of a shared
/// prompt gathers gradients from every sample of its group), the forward's softmax weights from
/// the CPU.
#[test]
fn attention_backward_matches_cpu_bit_for_bit() {
    let Some(g) = gpu("attention_backward_matches_cpu_bit_for_bit") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let layouts = [
        ("plain", Layout::plain(16, 15)),
        ("ragged 256x16", ragged(&mut rng, 256, 16, 8, 8)),
        ("ragged 64x32", ragged(&mut rng, 64, 32, 8, 12)),
    ];
    for (what, layout) in layouts {
        let (n, s) = (layout.rows(), layout.max_context());
        let qkv = uniform(&mut rng, n * 3 * D, 1.0);
        let (mut out, mut probs) = (vec![0.0; n * D], vec![0.0; n * H * s]);
        ops::attention_forward(&mut out, &mut probs, &qkv, &layout, H, D);
        let dout = uniform(&mut rng, n * D, 1.0);
        let mut dqkv = uniform(&mut rng, n * 3 * D, 0.5);
        let mut gd = g.up(&dqkv);
        ops::attention_backward(&mut dqkv, &dout, &qkv, &probs, &layout, H, D);
        let dl = DeviceLayout::upload(&g.stream, &layout).unwrap();
        let groups = DeviceGroups::upload(&g.stream, &layout).unwrap();
        g.ops
            .attention_backward(
                &g.stream,
                &mut gd,
                &g.up(&dout),
                &g.up(&qkv),
                &g.up(&probs),
                &dl,
                &groups,
                H,
                D,
            )
            .unwrap();
        same_bits(&format!("{what}: dqkv"), &g.down(&gd), &dqkv).unwrap();
    }
}

/// Three AdamW steps over every tensor of the tiny model, with a gradient scale and per-tensor
/// weight decay: the parameters bit for bit after the third (which needs the moments' bits at
/// every step), the update and weight sums of squares to FP64 rounding.
#[test]
fn adamw_matches_cpu_bit_for_bit() {
    let Some(g) = gpu("adamw_matches_cpu_bit_for_bit") else {
        return;
    };
    let cfg = ModelConfig::tiny();
    let mut params = Params::init(&cfg, 1).unwrap();
    let grads = Params::init(&cfg, 2).unwrap();
    let (lr, beta1, beta2, eps, scale) = (1e-3f32, 0.9f32, 0.95f32, 1e-8f32, 0.7f32);
    let decay = |name: &str| if name.contains("norm") { 0.0 } else { 0.1 };
    let mut opt = AdamW::new(&params, lr, beta1, beta2, eps);
    let tensors: Vec<(String, Vec<f32>)> = params
        .named_tensors()
        .into_iter()
        .map(|(n, t)| (n, t.to_vec()))
        .collect();
    let mut dev: Vec<_> = tensors
        .iter()
        .map(|(name, t)| {
            (
                name.clone(),
                g.up(t),
                g.zeros::<f32>(t.len()),
                g.zeros::<f32>(t.len()),
            )
        })
        .collect();
    let dev_grads: Vec<_> = grads.named_tensors().iter().map(|(_, t)| g.up(t)).collect();
    for t in 1..=3 {
        let (upd, wsq) = opt.update(&mut params, &grads, scale, decay);
        let mut sums = g.zeros::<f64>(2);
        for ((name, p, m, v), gr) in dev.iter_mut().zip(&dev_grads) {
            let h = AdamStep {
                t,
                lr,
                beta1,
                beta2,
                eps,
                scale,
                weight_decay: decay(name),
            };
            let n = gr.len();
            g.ops
                .adamw_step(&g.stream, p, m, v, gr, n, &h, &mut sums)
                .unwrap();
        }
        let s = g.down(&sums);
        assert!(
            (s[0] - upd).abs() <= 1e-9 * upd.abs() && (s[1] - wsq).abs() <= 1e-9 * wsq.abs(),
            "step {t}: sums {s:?} vs cpu ({upd}, {wsq})"
        );
    }
    for ((name, p, _, _), (_, want)) in dev.iter().zip(params.named_tensors()) {
        same_bits(name, &g.down(p), want).unwrap();
    }
}

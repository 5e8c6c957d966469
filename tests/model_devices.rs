//! The model's properties, one test body per device: each body is generic over the op set
//! (`engine::device::Ops`) and runs on the CPU (`CpuOps`, always: CI) and on a GPU (`GpuOps`,
//! where one is present; otherwise it prints why it skips).
//!
//! - the backward is the forward's gradient: central finite differences of a weighted sum of
//!   the logits, coordinate by coordinate, for every parameter tensor (FP32 plan);
//! - the inference forward gives the training forward's logits and routing bit for bit (the
//!   same quantizations and GEMMs, nothing kept);
//! - decoding position by position matches the full forward to the BF16 KV cache's rounding;
//! - a forward and backward repeat bit for bit.

mod common;

use common::{bits, plan};
use lockstep::engine::device::Ops;
use lockstep::engine::device::cpu::CpuOps;
use lockstep::engine::layout::Layout;
use lockstep::engine::model::pass::{self, Weights};
use lockstep::engine::model::{ModelConfig, Params, PreparedModel};
use lockstep::tools::bench::trainer_batch;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The tiny model with non-trivial norm gains (so their gradients are not all alike).
fn params(seed: u64) -> Params {
    let cfg = ModelConfig::tiny();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut p = Params::init(&cfg, seed).unwrap();
    for (name, w) in p.named_tensors_mut() {
        if name.contains("layernorm") {
            w.iter_mut()
                .for_each(|g| *g = 1.0 + (rng.random::<f32>() - 0.5) * 0.6);
        }
    }
    p
}

fn tokens(rng: &mut ChaCha8Rng, n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|_| rng.random_range(0..vocab as u32)).collect()
}

/// Σ logits · r in f64.
fn weighted(logits: &[f32], r: &[f32]) -> f64 {
    logits
        .iter()
        .zip(r)
        .map(|(&a, &b)| a as f64 * b as f64)
        .sum()
}

/// Central differences of `Σ logits · r` against the backward's gradient, 4 coordinates of every
/// tensor. `load` puts a prepared model on the device; `preps[0]` is the base model and
/// `preps[1 + 2j]`, `preps[2 + 2j]` move coordinate j by ±eps (`moves[j]`).
fn check_gradients<'a, O: Ops>(
    ops: &O,
    load: impl Fn(&'a PreparedModel) -> Weights<O>,
    preps: &'a [PreparedModel],
    moves: &[(usize, usize, f64)],
    toks: &[u32],
    layout: &Layout,
    r: &[f32],
) -> Result<(), String> {
    let base = load(&preps[0]);
    let (_, cache, routing) = pass::forward(ops, &base, toks, layout, None).unwrap();
    let grads = pass::backward(ops, &base, &cache, r).unwrap();
    let grads = grads.named_tensors();
    let (mut skipped, mut failures) = (0, Vec::new());
    for (j, &(t, i, step)) in moves.iter().enumerate() {
        let eval = |p: &'a PreparedModel| {
            let w = load(p);
            let (logits, _, rt) = pass::forward(ops, &w, toks, layout, None).unwrap();
            (weighted(&logits, r), rt)
        };
        let ((lp, rp), (lm, rm)) = (eval(&preps[1 + 2 * j]), eval(&preps[2 + 2 * j]));
        if rp != routing || rm != routing {
            skipped += 1;
            continue;
        }
        let fd = (lp - lm) / step;
        let a = grads[t].1[i] as f64;
        if (fd - a).abs() > 3e-2 * fd.abs().max(a.abs()) + 2e-3 {
            failures.push(format!(
                "{}[{i}]: finite difference {fd:.6e}, backward {a:.6e}",
                grads[t].0
            ));
        }
    }
    if skipped * 5 > moves.len() {
        failures.push(format!(
            "{skipped} of {} moves flipped the routing",
            moves.len()
        ));
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures.join("\n"))
    }
}

/// The perturbed models of [`check_gradients`]: 4 coordinates per tensor (2 where the gradient
/// is non-zero, 2 anywhere), each moved by ±eps.
fn perturbed(
    p: &Params,
    plan: &lockstep::recipe::ModelPlan,
) -> (Vec<PreparedModel>, Vec<(usize, usize, f64)>) {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let eps = 5e-3f32;
    let mut preps = vec![PreparedModel::new(p, plan).unwrap()];
    let mut moves = Vec::new();
    let n_tensors = p.named_tensors().len();
    for t in 0..n_tensors {
        let len = p.named_tensors()[t].1.len();
        for _ in 0..4 {
            let i = rng.random_range(0..len);
            let mut up = p.clone();
            up.named_tensors_mut()[t].1[i] += eps;
            let mut down = p.clone();
            down.named_tensors_mut()[t].1[i] -= eps;
            let step = up.named_tensors()[t].1[i] as f64 - down.named_tensors()[t].1[i] as f64;
            preps.push(PreparedModel::new(&up, plan).unwrap());
            preps.push(PreparedModel::new(&down, plan).unwrap());
            moves.push((t, i, step));
        }
    }
    (preps, moves)
}

fn gradient_case() -> (Params, Vec<u32>, Layout, Vec<f32>) {
    let p = params(7);
    let cfg = &p.config;
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let layout = Layout::plain(2, 6);
    let toks = tokens(&mut rng, layout.rows(), cfg.vocab);
    let r = (0..layout.rows() * cfg.vocab)
        .map(|_| rng.random::<f32>() * 2.0 - 1.0)
        .collect();
    (p, toks, layout, r)
}

#[test]
fn the_backward_is_the_forwards_gradient_on_every_device() {
    let (p, toks, layout, r) = gradient_case();
    let plan = plan("fp32", p.config.n_layers);
    let (preps, moves) = perturbed(&p, &plan);
    let cpu = CpuOps::new();
    check_gradients(
        &cpu,
        |pm| pm.host_weights(),
        &preps,
        &moves,
        &toks,
        &layout,
        &r,
    )
    .unwrap_or_else(|e| panic!("cpu:\n{e}"));
    if let Some(g) = common::gpu_ops("the_backward_is_the_forwards_gradient_on_every_device") {
        check_gradients(
            g,
            |pm| g.upload_model(pm).unwrap(),
            &preps,
            &moves,
            &toks,
            &layout,
            &r,
        )
        .unwrap_or_else(|e| panic!("cuda:\n{e}"));
    }
}

/// Inference forward = training forward (bits), and forward + backward repeat (bits).
fn check_bit_identities<O: Ops>(ops: &O, w: &Weights<O>, toks: &[u32], layout: &Layout) {
    let (logits, cache, routing) = pass::forward(ops, w, toks, layout, None).unwrap();
    let (inf_logits, inf_routing) = pass::infer(ops, w, toks, layout, None).unwrap();
    assert_eq!(bits(&logits), bits(&inf_logits), "infer's logits differ");
    assert_eq!(routing, inf_routing, "infer's routing differs");
    let dl: Vec<f32> = logits.iter().map(|x| x * 1e-2).collect();
    let g1 = pass::backward(ops, w, &cache, &dl).unwrap();
    let (logits2, cache2, _) = pass::forward(ops, w, toks, layout, None).unwrap();
    let g2 = pass::backward(ops, w, &cache2, &dl).unwrap();
    assert_eq!(bits(&logits), bits(&logits2), "two forwards differ");
    for ((name, a), (_, b)) in g1.named_tensors().iter().zip(g2.named_tensors()) {
        assert_eq!(bits(a), bits(b), "{name}: two backwards differ");
    }
}

#[test]
fn inference_and_training_forwards_agree_and_repeat_bit_for_bit_on_every_device() {
    let p = params(3);
    // Groups of samples sharing a prompt, ragged responses: the trainer's row layout.
    let (toks, layout) = trainer_batch(p.config.vocab, (3, 4, 3, 7), 1, true);
    for name in ["fp32", "nvfp4-dq", "mxfp8"] {
        let prep = PreparedModel::new(&p, &plan(name, p.config.n_layers)).unwrap();
        check_bit_identities(&CpuOps::new(), &prep.host_weights(), &toks, &layout);
        if let Some(g) =
            common::gpu_ops("inference_and_training_forwards_agree_and_repeat_bit_for_bit")
        {
            check_bit_identities(g, &g.upload_model(&prep).unwrap(), &toks, &layout);
        }
    }
}

/// Decoding B sequences position by position gives the full forward's logits, up to the BF16
/// rounding of the cached keys and values; returns the largest difference over the largest
/// logit.
fn decode_vs_forward<O: Ops>(ops: &O, w: &Weights<O>, toks: &[u32], b: usize, t: usize) -> f32 {
    let cfg = &w.config;
    let (full, _) = pass::infer(ops, w, toks, &Layout::plain(b, t), None).unwrap();
    let mut kv = ops
        .kv_cache(cfg.n_layers, b, t, cfg.d_model, cfg.n_heads)
        .unwrap();
    let (v, mut worst) = (cfg.vocab, 0.0f32);
    let scale = full.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    for pos in 0..t {
        let step: Vec<u32> = (0..b).map(|s| toks[s * t + pos]).collect();
        let (logits, _) = pass::decode(ops, w, &mut kv, &step, 1, None).unwrap();
        for s in 0..b {
            let want = &full[(s * t + pos) * v..][..v];
            let got = &logits[s * v..][..v];
            for (a, c) in got.iter().zip(want) {
                worst = worst.max((a - c).abs());
            }
        }
    }
    worst / scale
}

#[test]
fn decoding_matches_the_full_forward_on_every_device() {
    let p = params(9);
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let (b, t) = (3, 7);
    let toks = tokens(&mut rng, b * t, p.config.vocab);
    let prep = PreparedModel::new(&p, &plan("bf16", p.config.n_layers)).unwrap();
    let cpu = decode_vs_forward(&CpuOps::new(), &prep.host_weights(), &toks, b, t);
    eprintln!("cpu: decode vs forward {cpu:.3e}");
    assert!(
        cpu < 2e-2,
        "cpu: decode differs from the forward by {cpu:.3e}"
    );
    if let Some(g) = common::gpu_ops("decoding_matches_the_full_forward_on_every_device") {
        let gd = decode_vs_forward(g, &g.upload_model(&prep).unwrap(), &toks, b, t);
        eprintln!("cuda: decode vs forward {gd:.3e}");
        assert!(
            gd < 2e-2,
            "cuda: decode differs from the forward by {gd:.3e}"
        );
    }
}

//! The model's passes on a GPU (`model::pass` over `cuda::device_ops::GpuOps`) against the CPU's,
//! and the trainer on a GPU end to end.
//!
//! Without a GPU each test prints why it skips and passes. On a GPU: the same prepared weights,
//! tokens (groups sharing a prompt, ragged responses) and dL/dlogits through both, with the CPU's
//! routing replayed so both run the same experts; logits and every gradient tensor agree to the
//! tolerance GEMM summation order allows, activation counts agree, and the pass repeats bit for
//! bit. `cargo test --release --test cuda_train -- --nocapture` prints the measured differences.

mod common;

use common::{bits, plan, rel};
use lockstep::engine::backend::cpu::CpuBackend;
use lockstep::engine::backend::cuda::CudaBackend;
use lockstep::engine::model::{
    ModelConfig, Params, PreparedModel, backward, forward_rows, pass, quant_sites,
};
use lockstep::engine::task::Task;
use lockstep::engine::trainer::{ContractBreak, GrpoConfig, Trainer};
use lockstep::recipe::presets::preset;
use lockstep::tools::bench::trainer_batch;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

fn norm(v: &[f32]) -> f64 {
    v.iter()
        .map(|x| (*x as f64) * (*x as f64))
        .sum::<f64>()
        .sqrt()
}

#[test]
fn resident_pass_matches_the_cpu_forward_and_backward() {
    let Some(tr) = common::gpu_ops("resident_pass_matches_the_cpu_forward_and_backward") else {
        return;
    };
    // (model, plan, tolerance on logits, on each gradient tensor, on the global gradient norm),
    // relative to the CPU's largest value (the norm: relative to the CPU's norm). About 3x what
    // the H200 measured on 2026-12-03 (docs/cuda-logs/train-2026-12-03): fp32 logits 2.5e-7 /
    // 4.8e-7, gradients 7.7e-7 / 1.1e-6, norms 6e-9 / 1.3e-8; bf16 1.6e-3, 3.4e-3, 8.3e-7; mxfp8
    // 3.5e-3, 5.2e-2, 6.7e-5; nvfp4-dq 1.2e-2, 5.0e-2, 1.9e-5; per-tensor 1.1e-2, 6.9e-2,
    // 2.8e-5; fp8-block 4.3e-3, 4.7e-2, 5.7e-6. A quantized site's worst tensor is a small one
    // (a norm gain, an expert's fc1) where a code moved across a rounding boundary. fp8-block's
    // norm bound is 3x the 6.3e-5 of the CUDA emulator (scripts/cuda-emu), whose GEMMs sum
    // exactly: another summation order moves it that far. With BF16 tensor cores (the default
    // since 2026-12-06, `linear::Operands`) an H100 measured bf16 2.2e-3, 5.1e-3, 1.4e-6; mxfp8
    // 7.7e-3, 5.6e-2, 4.0e-5; nvfp4-dq 1.8e-2, 5.8e-2, 2.8e-5; per-tensor 2.2e-2, 0.16, 2.0e-4:
    // one tensor's amax moved by the other accumulation rescales that whole tensor's codes, so
    // per-tensor NVFP4's norm bound is 2x that.
    let cases = [
        (ModelConfig::tiny(), "fp32", 2e-6f32, 5e-6f32, 1e-7f64),
        (ModelConfig::small(), "fp32", 2e-6, 5e-6, 1e-7),
        (ModelConfig::small(), "bf16", 5e-3, 1e-2, 1e-5),
        (ModelConfig::small(), "mxfp8", 1e-2, 0.15, 3e-4),
        (ModelConfig::small(), "nvfp4-dq", 4e-2, 0.15, 1e-4),
        (ModelConfig::small(), "nvfp4-dq-per-tensor", 4e-2, 0.2, 4e-4),
        (ModelConfig::small(), "fp8-block", 2e-2, 0.15, 2e-4),
    ];
    let mut failures = Vec::new();
    for (cfg, name, tol_logits, tol_grad, tol_norm) in cases {
        let params = Params::init(&cfg, 11).unwrap();
        let prep = PreparedModel::new(&params, &plan(name, cfg.n_layers)).unwrap();
        let (tokens, layout) = trainer_batch(cfg.vocab, (8, 8, 7, 15), 5, true);
        let (cpu_logits, cpu_cache, cpu_routing) = forward_rows(&prep, &tokens, &layout, None);
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let dlogits = common::uniform(&mut rng, cpu_logits.len(), 1e-2);
        let cpu_grads = backward(&prep, &cpu_cache, &dlogits);

        let m = tr.upload_model(&prep).unwrap();
        let (logits, cache, _) =
            pass::forward(tr, &m, &tokens, &layout, Some(&cpu_routing)).unwrap();
        let grads = pass::backward(tr, &m, &cache, &dlogits).unwrap();
        let again = pass::backward(tr, &m, &cache, &dlogits).unwrap();
        let logit_diff = rel(&logits, &cpu_logits);
        let (mut worst, mut worst_name) = (0.0f32, String::new());
        let (mut sq_gpu, mut sq_cpu) = (0.0f64, 0.0f64);
        for ((gname, g), (_, c)) in grads
            .named_tensors()
            .into_iter()
            .zip(cpu_grads.named_tensors())
        {
            let r = rel(g, c);
            if r.is_nan() || r > worst {
                worst = r;
                worst_name = gname.clone();
            }
            sq_gpu += norm(g).powi(2);
            sq_cpu += norm(c).powi(2);
        }
        let norm_diff = (sq_gpu.sqrt() - sq_cpu.sqrt()).abs() / sq_cpu.sqrt().max(1e-30);
        eprintln!(
            "{name} (d_model {}): logits {logit_diff:.3e}, worst gradient {worst:.3e} ({worst_name}), grad norm {:.6e} vs cpu {:.6e} (rel {norm_diff:.2e})",
            cfg.d_model,
            sq_gpu.sqrt(),
            sq_cpu.sqrt()
        );
        if logit_diff.is_nan() || logit_diff > tol_logits {
            failures.push(format!("{name}: logits differ by {logit_diff:.3e}"));
        }
        if worst.is_nan() || worst > tol_grad {
            failures.push(format!(
                "{name}: gradient {worst_name} differs by {worst:.3e}"
            ));
        }
        if norm_diff.is_nan() || norm_diff > tol_norm {
            failures.push(format!("{name}: gradient norm differs by {norm_diff:.2e}"));
        }
        let same = grads
            .named_tensors()
            .iter()
            .zip(again.named_tensors())
            .all(|((_, a), (_, b))| bits(a) == bits(b));
        if !same {
            failures.push(format!("{name}: two backward passes differ"));
        }
        // Activation counts: within GEMM order of the CPU's (common::counts_disagree).
        let gpu_stats: Vec<_> = quant_sites(cfg.n_layers)
            .into_iter()
            .zip(pass::quant_stats(tr, &cache).unwrap())
            .collect();
        if let Some(why) = common::counts_disagree(&gpu_stats, &cpu_cache.quant_stats()) {
            failures.push(format!("{name}: {why} (gpu vs cpu)"));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The GRPO trainer on `CudaBackend` (rollout, reference forward, policy forward and backward all
/// on the GPU): same seed, same metrics and per-layer records, run to run, every step finite; the
/// first step's gradient norm (same master weights, same rollout up to GEMM order) within 5 % of
/// the CPU run's. Later steps drift apart as GEMM order moves the weights (printed, not held).
#[test]
fn trainer_on_the_gpu_repeats_and_tracks_the_cpu() {
    if common::gpu_ops("trainer_on_the_gpu_repeats_and_tracks_the_cpu").is_none() {
        return;
    }
    let be = CudaBackend::new(0).unwrap();
    let cfg = ModelConfig::tiny();
    let grpo = GrpoConfig {
        prompts_per_step: 8,
        samples_per_prompt: 8,
        max_response_tokens: Task::Add(2).answer_len() + 1,
        eval_every: 0,
        kl_coef: 0.1,
        ..Default::default()
    };
    let trainer = || {
        Trainer::new(
            Params::init(&cfg, 3).unwrap(),
            Task::Add(2),
            preset("nvfp4-dq").unwrap(),
            grpo.clone(),
            5,
            ContractBreak::None,
        )
        .unwrap()
    };
    let (mut a, mut b, mut c) = (trainer(), trainer(), trainer());
    for step in 0..4 {
        let ra = a.step(&be);
        let rb = b.step(&be);
        let rc = c.step(&CpuBackend);
        assert_eq!(
            ra.deterministic_scalars(),
            rb.deterministic_scalars(),
            "step {step}: two GPU runs differ"
        );
        assert_eq!(ra.layers, rb.layers, "step {step}");
        let get = |r: &lockstep::engine::metrics::StepRecord, k: &str| {
            r.scalars.get(k).copied().unwrap_or(f64::NAN)
        };
        for k in ["train/grad_norm", "train/kl_loss", "train/train_rollout_kl"] {
            let (g, cpu) = (get(&ra, k), get(&rc, k));
            eprintln!("step {step} {k}: gpu {g:.6e} cpu {cpu:.6e}");
            assert!(g.is_finite(), "step {step}: {k} is {g}");
        }
        let (g, cpu) = (get(&ra, "train/grad_norm"), get(&rc, "train/grad_norm"));
        if step == 0 {
            // Same master weights, same rollout but for GEMM order: the first gradient agrees.
            assert!(
                (g - cpu).abs() <= 0.05 * cpu.abs(),
                "step 0 grad norm: gpu {g} cpu {cpu}"
            );
        }
    }
}

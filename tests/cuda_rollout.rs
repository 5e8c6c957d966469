//! The rollout decoded on the GPU (`CudaBackend`'s device decoder: `cuda::decoder` over
//! `ResidentForward::decode_step`) against the host decoder (`model::decode_step`).
//!
//! Without a GPU each test prints why it skips and passes. On a GPU, at the engine's benchmark
//! shape (32 prompts x 8 samples, 7 prompt tokens, up to 8 response tokens, `small` model):
//! - the GPU rollout's logprobs equal, to GEMM-order tolerance, what the host decoder gives for
//!   the same tokens (teacher-forced through a host KV cache, which rounds keys and values to BF16
//!   as the device cache does), and its routing agrees;
//! - the same seed gives the same tokens, logprobs and routing, bit for bit;
//! - with an FP32 plan, sampling from the GPU's and the host's logits picks the same tokens in
//!   nearly every sequence (the same RNG draws; only a draw within a rounding error of a CDF
//!   boundary can flip).

mod common;

use common::{agreement, bits, plan};
use lockstep::engine::backend::Backend;
use lockstep::engine::backend::cpu::CpuBackend;
use lockstep::engine::backend::cuda::CudaBackend;
use lockstep::engine::layout::Layout;
use lockstep::engine::model::{self, KvCache, ModelConfig, Params, PreparedModel, Routing};
use lockstep::engine::rollout::{Rollout, generate};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::OnceLock;

fn gpu(test: &str) -> Option<&'static CudaBackend> {
    static B: OnceLock<Result<CudaBackend, String>> = OnceLock::new();
    common::gpu_fixture(&B, test, || CudaBackend::new(0))
}

/// 32 prompts of 7 tokens (ids below the task's special tokens).
fn prompts(seed: u64) -> Vec<Vec<u32>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..32)
        .map(|_| (0..7).map(|_| rng.random_range(0..12u32)).collect())
        .collect()
}

/// The host decoder's logprob of every token given its prefix (positions 1..T), decoding the
/// rollout's own tokens (teacher forcing), and its routing of every input position.
fn host_logprobs(prep: &PreparedModel, ro: &Rollout) -> (Vec<f32>, Routing) {
    let v = prep.config.vocab;
    let mut cache = KvCache::with_capacity(&prep.config, ro.b, ro.t - 1);
    let mut lp = vec![0.0f32; ro.b * ro.t];
    let mut steps = Vec::new();
    for pos in 0..ro.t - 1 {
        let input: Vec<u32> = (0..ro.b).map(|s| ro.tokens[s * ro.t + pos]).collect();
        let (logits, routing) = model::decode_step(prep, &mut cache, &input, None);
        steps.push(routing);
        for s in 0..ro.b {
            let row = &logits[s * v..(s + 1) * v];
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            let lse = max + row.iter().map(|&x| (x - max).exp()).sum::<f32>().ln();
            let tok = ro.tokens[s * ro.t + pos + 1] as usize;
            lp[s * ro.t + pos + 1] = row[tok] - lse;
        }
    }
    (lp, Routing::from_steps(&steps).unwrap())
}

#[test]
fn gpu_rollout_matches_the_host_decoder_and_repeats_bit_for_bit() {
    let Some(be) = gpu("gpu_rollout_matches_the_host_decoder_and_repeats_bit_for_bit") else {
        return;
    };
    let cfg = ModelConfig::small();
    let params = Params::init(&cfg, 21).unwrap();
    let prompts = prompts(4);
    // (plan, tolerance on |logprob difference| for the rollout's own tokens), about 3x what the
    // H200 measured on 2026-12-03 (fp32 2.0e-4, bf16 4.4e-2, mxfp8 6.8e-3, nvfp4-dq 5.8e-2,
    // fp8-block 5.5e-2). GEMM summation order and `expf` move values by an ulp or so, and both
    // caches round keys and values to BF16, so an ulp can become a BF16 step (even under FP32);
    // quantized sites also move the odd activation across a rounding boundary of their format.
    let cases = [
        ("fp32", 6e-4f32),
        ("bf16", 0.15),
        ("mxfp8", 0.1),
        ("nvfp4-dq", 0.2),
        ("fp8-block", 0.2),
    ];
    let mut failures = Vec::new();
    for (name, tol) in cases {
        let prep = PreparedModel::new(&params, &plan(name, cfg.n_layers)).unwrap();
        let ro = generate(be, &prep, &prompts, 8, 8, 1.0, 17);
        let again = generate(be, &prep, &prompts, 8, 8, 1.0, 17);
        let (host_lp, host_routing) = host_logprobs(&prep, &ro);
        let (mut worst, mut n) = (0.0f32, 0usize);
        for s in 0..ro.b {
            for pos in 1..ro.t {
                if ro.is_response(s, pos) {
                    let d = (ro.logprobs[s * ro.t + pos] - host_lp[s * ro.t + pos]).abs();
                    worst = if d.is_nan() { f32::NAN } else { worst.max(d) };
                    n += 1;
                }
            }
        }
        let agree = agreement(&ro.routing, &host_routing);
        eprintln!(
            "{name}: {n} response tokens, max |logprob - host decoder's| {worst:.3e}, routing agreement {agree:.5}"
        );
        if n == 0 {
            failures.push(format!("{name}: the rollout sampled no response token"));
        }
        if worst.is_nan() || worst > tol {
            failures.push(format!(
                "{name}: logprobs differ by {worst:.3e} > {tol:.0e}"
            ));
        }
        if agree < 0.97 {
            failures.push(format!("{name}: only {agree:.4} of expert choices agree"));
        }
        if ro.tokens != again.tokens
            || bits(&ro.logprobs) != bits(&again.logprobs)
            || ro.routing != again.routing
        {
            failures.push(format!("{name}: two GPU rollouts with one seed differ"));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn gpu_and_host_rollouts_sample_the_same_tokens_under_fp32() {
    let Some(be) = gpu("gpu_and_host_rollouts_sample_the_same_tokens_under_fp32") else {
        return;
    };
    let cfg = ModelConfig::small();
    let prep = PreparedModel::new(
        &Params::init(&cfg, 22).unwrap(),
        &plan("fp32", cfg.n_layers),
    )
    .unwrap();
    let prompts = prompts(5);
    for temperature in [1.0f32, 0.0] {
        let gpu_ro = generate(be, &prep, &prompts, 8, 8, temperature, 3);
        let cpu_ro = generate(&CpuBackend, &prep, &prompts, 8, 8, temperature, 3);
        let same = (0..gpu_ro.b)
            .filter(|&s| gpu_ro.response(s) == cpu_ro.response(s))
            .count();
        eprintln!(
            "temperature {temperature}: {same} of {} sequences sample the same response on {} and the host",
            gpu_ro.b,
            be.name()
        );
        assert!(
            same * 100 >= gpu_ro.b * 95,
            "temperature {temperature}: only {same} of {} responses agree",
            gpu_ro.b
        );
    }
}

/// The GPU backend's decoder and reference forward against the CPU backend's on the same prepared
/// model: a few decode steps and a forward over two sequences give the same logits to BF16
/// tolerance.
#[test]
fn gpu_decoder_and_forward_match_the_cpu_backends() {
    let Some(be) = gpu("gpu_decoder_and_forward_match_the_cpu_backends") else {
        return;
    };
    let cfg = ModelConfig::tiny();
    let prep =
        PreparedModel::new(&Params::init(&cfg, 1).unwrap(), &plan("bf16", cfg.n_layers)).unwrap();
    let close = |what: &str, gpu: &[f32], cpu: &[f32]| {
        assert_eq!(gpu.len(), cpu.len(), "{what}");
        let scale = cpu.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let worst = gpu
            .iter()
            .zip(cpu)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            worst <= 5e-3 * scale,
            "{what}: {worst} vs max logit {scale}"
        );
    };
    let (mut on_gpu, mut on_cpu) = (
        be.decoder(&prep, 2, 4).unwrap(),
        CpuBackend.decoder(&prep, 2, 4).unwrap(),
    );
    for (pos, step) in [[1u32, 5], [2, 6], [3, 7], [4, 8]].iter().enumerate() {
        let (g, c) = (on_gpu.step(step), on_cpu.step(step));
        close(&format!("decode position {pos}"), &g.0, &c.0);
    }
    let layout = Layout::plain(2, 4);
    let tokens = vec![1u32, 2, 3, 4, 5, 6, 7, 8];
    let gpu_logits = be.forward_logits(&prep, &tokens, &layout, None).unwrap();
    let cpu_logits = CpuBackend
        .forward_logits(&prep, &tokens, &layout, None)
        .unwrap();
    close("forward", &gpu_logits, &cpu_logits);
}

/// A decode position of a batch of runs of two recipes captured as a CUDA graph and replayed
/// gives the position queued op by op, bit for bit (`bench decode`'s check, as a test): the
/// decode's device work queues nothing a graph cannot hold. Skips where the driver does not
/// support stream capture. The CUDA emulator records and replays captures, so CI runs it.
#[test]
fn a_decode_position_replayed_from_a_cuda_graph_gives_its_queued_outputs() {
    let Some(gpu) = gpu("a_decode_position_replayed_from_a_cuda_graph_gives_its_queued_outputs")
    else {
        return;
    };
    let cfg = ModelConfig::tiny();
    for recipe in ["bf16", "nvfp4-dq"] {
        let p = plan(recipe, cfg.n_layers);
        let preps: Vec<PreparedModel> = (0..3)
            .map(|s| PreparedModel::new(&Params::init(&cfg, s).unwrap(), &p).unwrap())
            .collect();
        let refs: Vec<&PreparedModel> = preps.iter().collect();
        let t = lockstep::engine::backend::cuda::decode_graph::decode_times(
            gpu,
            &refs,
            16,
            &[1, 2, 3, 4, 5, 6, 7],
            &mut |f| f().map(|()| 0.0),
        )
        .unwrap();
        if let Some(e) = &t.capture_error {
            assert!(
                e.contains("NOT_SUPPORTED"),
                "{recipe}: the capture failed on a driver that supports graphs: {e}"
            );
            eprintln!("skipping: this driver refuses stream capture ({e})");
            return;
        }
        assert!(
            t.same,
            "{recipe}: the replay's outputs differ from the queued position's"
        );
        assert!(t.nodes > 0, "{recipe}: an empty graph");
    }
}

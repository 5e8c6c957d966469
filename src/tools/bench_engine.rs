//! `lockstep bench engine`: the built-in engine's RL step at the benchmark shape, for every recipe,
//! next to the GEMM library's own rate on a large square matmul measured in the same run.
//!
//! Shape (issue 3): the `small` model (6 layers, d_model 128, 4 heads, 8 experts top-2, FFN 256,
//! vocab 32), 32 prompts x 8 samples, at most 8 response tokens, 3-digit addition, from a seeded
//! random initialisation: a warm start would cost a minute and end responses earlier, and the
//! trainer skips the rows past a response's end, so random initialisation (almost every response
//! runs to the 8-token limit) is the slower case. FLOPs are the GEMM FLOPs the CPU actually ran
//! (2·m·n·k per call, counted by `backend::cpu::gemm`); attention score/value products and element-wise ops are not counted, so the GFLOP/s
//! figures are a lower bound.

use crate::engine::backend::CpuBackend;
use crate::engine::backend::cpu::{MatRef, gemm, gemm_flops};
use crate::engine::model::{ModelConfig, Params, PreparedModel};
use crate::engine::rollout;
use crate::engine::task::{Split, Task};
use crate::engine::trainer::{ContractBreak, GrpoConfig, Trainer};
use crate::recipe::{ModelPlan, presets};
use std::time::Duration;

/// What one recipe's steps measured (medians over the timed steps).
#[derive(Debug, Clone)]
pub struct EngineRow {
    pub recipe: String,
    pub step_s: f64,
    pub export_s: f64,
    pub rollout_s: f64,
    pub train_s: f64,
    pub rollout_tokens_per_s: f64,
    pub train_tokens_per_s: f64,
    /// GEMM GFLOP/s of the train phase (step FLOPs minus the rollout's, over the train time).
    pub train_gflops: f64,
}

/// The whole benchmark's answer.
#[derive(Debug, Clone)]
pub struct EngineBench {
    pub threads: usize,
    /// The GEMM library's rate on an `n x n x n` matmul, all threads.
    pub gemm_n: usize,
    pub gemm_gflops: f64,
    pub rows: Vec<EngineRow>,
}

/// The benchmark's GRPO settings.
pub fn bench_grpo() -> GrpoConfig {
    GrpoConfig {
        prompts_per_step: 32,
        samples_per_prompt: 8,
        max_response_tokens: 8,
        eval_every: 0,
        ..Default::default()
    }
}

/// Rate of the CPU GEMM on an `n`-cube, in GFLOP/s (median of repetitions).
pub fn gemm_rate(n: usize, min_time: Duration) -> f64 {
    let a: Vec<f32> = (0..n * n).map(|i| ((i % 17) as f32) * 0.1 - 0.8).collect();
    let b: Vec<f32> = (0..n * n).map(|i| ((i % 13) as f32) * 0.1 - 0.6).collect();
    let mut c = vec![0.0f32; n * n];
    let s = super::bench::time_median(3, min_time, || {
        gemm(MatRef::new(&a, n, n), MatRef::new(&b, n, n), &mut c, false)
    });
    2.0 * (n * n * n) as f64 / s / 1e9
}

/// Run `steps` timed steps (after one warm-up) of every recipe in `recipes`.
pub fn engine_bench(
    recipes: &[&str],
    steps: usize,
    gemm_n: usize,
    min_time: Duration,
) -> anyhow::Result<EngineBench> {
    let cfg = ModelConfig::small();
    let task = Task::Add(3);
    let grpo = bench_grpo();
    let params = Params::init(&cfg, 7)?;
    let rollout_flops = rollout_gemm_flops(&params, task, &grpo)?;
    let mut rows = Vec::new();
    for name in recipes {
        let recipe = presets::preset(name)?;
        let mut trainer = Trainer::new(
            params.clone(),
            task,
            recipe,
            grpo.clone(),
            0,
            ContractBreak::None,
        )?;
        trainer.step(&CpuBackend);
        let mut recs = Vec::new();
        for _ in 0..steps.max(1) {
            let before = gemm_flops();
            let r = trainer.step(&CpuBackend);
            recs.push((r, gemm_flops() - before));
        }
        let med = |key: &str| median(recs.iter().map(|(r, _)| r.get(key).unwrap_or(f64::NAN)));
        let train_flops = median(
            recs.iter()
                .map(|(_, f)| f.saturating_sub(rollout_flops) as f64),
        );
        rows.push(EngineRow {
            recipe: name.to_string(),
            step_s: med("perf/step_time"),
            export_s: med("perf/export_time"),
            rollout_s: med("perf/rollout_time"),
            train_s: med("perf/train_time"),
            rollout_tokens_per_s: med("perf/rollout_tokens_per_s"),
            train_tokens_per_s: med("perf/train_tokens_per_s"),
            train_gflops: train_flops / med("perf/train_time") / 1e9,
        });
    }
    Ok(EngineBench {
        threads: rayon::current_num_threads(),
        gemm_n,
        gemm_gflops: gemm_rate(gemm_n, min_time),
        rows,
    })
}

/// GEMM FLOPs of one rollout at the benchmark shape (BF16 plan; formats do not change GEMM shapes),
/// measured on a separate rollout from the same weights. Responses stop at `<eos>`, so when the
/// step's rollout stops at a different length this is approximate (untrained weights rarely emit it).
fn rollout_gemm_flops(params: &Params, task: Task, grpo: &GrpoConfig) -> anyhow::Result<u64> {
    let plan = ModelPlan::uniform(params.config.n_layers, crate::recipe::SitePlan::BF16);
    let prep = PreparedModel::new(params, &plan)?;
    let prompts: Vec<Vec<u32>> = task
        .sample(Split::Train, grpo.prompts_per_step, 1)
        .into_iter()
        .map(|p| p.prompt)
        .collect();
    let before = gemm_flops();
    rollout::generate(
        &CpuBackend,
        &prep,
        &prompts,
        grpo.samples_per_prompt,
        grpo.max_response_tokens,
        grpo.temperature,
        1,
    );
    Ok(gemm_flops() - before)
}

fn median(it: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = it.collect();
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

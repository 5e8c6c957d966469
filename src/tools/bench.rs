//! Benchmarks that print ratios measured side by side in one run (timings never live in tests).
//!
//! `quantize`: throughput (GB/s of FP32 input) of MXFP8 and NVFP4 per-token quantization next to a
//! plain copy of the same tensor, on one core and on all cores. The copy is the memory-bandwidth
//! yardstick, so "0.25 of copy" reads the same on any machine.

use crate::formats::{Axis, QuantFormat, SecondScale, quantize};
use rayon::prelude::*;
use std::time::{Duration, Instant};

/// One measured line.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchRow {
    pub what: String,
    pub threads: usize,
    pub median_s: f64,
    pub gb_per_s: f64,
    /// Throughput relative to the copy with the same thread count.
    pub vs_copy: f64,
}

/// Median wall time of `f` over at least `min_reps` runs and `min_time` (after one warm-up).
pub fn time_median(min_reps: usize, min_time: Duration, mut f: impl FnMut()) -> f64 {
    f();
    let start = Instant::now();
    let mut times = Vec::new();
    while times.len() < min_reps || start.elapsed() < min_time {
        let t = Instant::now();
        f();
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(|a, b| a.total_cmp(b));
    times[times.len() / 2]
}

/// Quantizer throughput vs copy on an `n x n` tensor, on 1 thread and on `all` threads.
pub fn quantize_throughput(n: usize, all: usize, min_time: Duration) -> Vec<BenchRow> {
    let x: Vec<f32> = (0..n * n)
        .map(|i| ((i as f32) * 0.618).sin() * if i % 97 == 0 { 40.0 } else { 1.0 })
        .collect();
    let bytes = (n * n * 4) as f64;
    let formats = [
        ("mxfp8", QuantFormat::MXFP8),
        (
            "nvfp4 per-token",
            QuantFormat::Nvfp4 {
                second: SecondScale::PerToken,
                shards: 1,
            },
        ),
    ];
    let mut rows = Vec::new();
    for threads in [1, all.max(1)] {
        let pool = match rayon::ThreadPoolBuilder::new().num_threads(threads).build() {
            Ok(p) => p,
            Err(_) => continue,
        };
        let mut dst = vec![0.0f32; n * n];
        let copy_s = pool.install(|| {
            time_median(3, min_time, || {
                dst.par_chunks_mut(64 * 1024)
                    .zip(x.par_chunks(64 * 1024))
                    .for_each(|(d, s)| d.copy_from_slice(s));
                std::hint::black_box(&dst);
            })
        });
        rows.push(BenchRow {
            what: "copy".into(),
            threads,
            median_s: copy_s,
            gb_per_s: bytes / copy_s / 1e9,
            vs_copy: 1.0,
        });
        for (name, fmt) in formats {
            let s = pool.install(|| {
                time_median(3, min_time, || {
                    std::hint::black_box(
                        quantize(&x, n, n, &fmt, Axis::Row)
                            .map(|q| q.codes.len())
                            .ok(),
                    );
                })
            });
            rows.push(BenchRow {
                what: name.into(),
                threads,
                median_s: s,
                gb_per_s: bytes / s / 1e9,
                vs_copy: copy_s / s,
            });
        }
    }
    rows
}

/// Median seconds of each `perf/*` phase over `steps` GRPO steps (after one warm-up step) of
/// `model` under `recipe` on `be`, at the engine's benchmark batch (issue 3: 32 prompts x 8
/// samples, at most 8 response tokens, `add:3`, seeded random initialisation; see
/// [`super::bench_engine`]): the engine's step cost on a device, whatever the reward does.
/// `between_steps` runs after every step (a GPU backend's counters are read there).
pub fn engine_step_times(
    be: &dyn crate::engine::backend::Backend,
    model: &crate::engine::model::ModelConfig,
    recipe: crate::recipe::Recipe,
    steps: usize,
    mut between_steps: impl FnMut(),
) -> Result<Vec<(String, f64)>, crate::engine::trainer::TrainerError> {
    use crate::engine::task::Task;
    use crate::engine::trainer::{ContractBreak, Trainer};
    let init = crate::engine::model::Params::init(model, 7)?;
    let grpo = super::bench_engine::bench_grpo();
    let mut t = Trainer::new(init, Task::Add(3), recipe, grpo, 0, ContractBreak::None)?;
    t.step(be);
    between_steps();
    let recs: Vec<_> = (0..steps.max(1))
        .map(|_| {
            let r = t.step(be);
            between_steps();
            r
        })
        .collect();
    let keys = [
        "perf/step_time",
        "perf/export_time",
        "perf/rollout_time",
        "perf/train_time",
        "perf/train_forward_time",
        "perf/train_backward_time",
        "perf/optimizer_time",
    ];
    Ok(keys
        .iter()
        .map(|k| {
            let mut v: Vec<f64> = recs.iter().filter_map(|r| r.get(k)).collect();
            v.sort_by(|a, b| a.total_cmp(b));
            (
                k.to_string(),
                v.get(v.len() / 2).copied().unwrap_or(f64::NAN),
            )
        })
        .collect())
}

/// A trainer-shaped batch of random tokens: `groups` prompts of `prompt` tokens, `n` samples of
/// each, sequences of `t` tokens, laid out as the trainer lays them out (a group's prompt rows
/// once, then each sample's own rows). With `ragged`, sample s ends `s mod 4` tokens early (no
/// rows past a response's end). Returns the tokens in layout row order and the layout.
pub fn trainer_batch(
    vocab: usize,
    (groups, n, prompt, t): (usize, usize, usize, usize),
    seed: u64,
    ragged: bool,
) -> (Vec<u32>, crate::engine::layout::Layout) {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut tokens = Vec::with_capacity(groups * n * t);
    for _ in 0..groups {
        let head: Vec<u32> = (0..prompt)
            .map(|_| rng.random_range(0..vocab as u32))
            .collect();
        for _ in 0..n {
            tokens.extend(&head);
            tokens.extend((prompt..t).map(|_| rng.random_range(0..vocab as u32)));
        }
    }
    let b = groups * n;
    let used: Vec<usize> = (0..b).map(|s| t - s % 4).collect();
    let layout = crate::engine::layout::Layout::shared_prefix(
        &tokens,
        b,
        t,
        n,
        prompt,
        ragged.then_some(used.as_slice()),
    );
    (layout.pack(&tokens, 1), layout)
}

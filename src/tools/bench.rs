//! Benchmarks that print ratios measured side by side in one run (timings never live in tests).
//!
//! `quantize`: throughput of the quantizer (MXFP8, NVFP4 per token and per tensor, rows and
//! columns) on one core and on all cores, next to the *bytes-moved floor*: the time a copy would
//! take to read the FP32 input and write the codes and scales, at the copy bandwidth measured in
//! the same run. The copy reference is one `copy_from_slice` per thread into a preallocated,
//! pre-faulted buffer (large enough that the C library streams it like a plain `memcpy`), so the
//! fraction of the floor reads the same on any machine and is not flattered by a slow reference.

use crate::formats::{Axis, QuantFormat, SecondScale, quantize};
use rayon::prelude::*;
use std::time::{Duration, Instant};

/// One measured line.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchRow {
    pub what: String,
    pub threads: usize,
    pub median_s: f64,
    /// FP32 input consumed per second (GB/s).
    pub gb_per_s: f64,
    /// Bytes read and written per call: the FP32 input plus the codes and scales (for the copy:
    /// the input read and its copy written).
    pub moved_bytes: f64,
    /// Time the copy would take to move `moved_bytes`, at this thread count's copy bandwidth.
    pub floor_s: f64,
    /// `floor_s / median_s`: 1.0 is copy speed, 0.5 takes twice the floor.
    pub of_floor: f64,
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

/// The formats `bench quantize` times, with their display names.
pub fn bench_formats() -> Vec<(&'static str, QuantFormat, Axis)> {
    let token = QuantFormat::Nvfp4 {
        second: SecondScale::PerToken,
        shards: 1,
    };
    let tensor = QuantFormat::Nvfp4 {
        second: SecondScale::PerTensor,
        shards: 1,
    };
    vec![
        ("mxfp8 row", QuantFormat::MXFP8, Axis::Row),
        ("mxfp8 col", QuantFormat::MXFP8, Axis::Col),
        ("nvfp4 token row", token, Axis::Row),
        ("nvfp4 token col", token, Axis::Col),
        ("nvfp4 tensor row", tensor, Axis::Row),
        ("nvfp4 tensor col", tensor, Axis::Col),
    ]
}

/// Bytes a quantization of `elems` FP32 values moves at least: the input read once, the codes
/// and the block scales written (second-level scales are a float per row at most, left out).
pub fn moved_bytes(fmt: &QuantFormat, elems: usize) -> f64 {
    let e = elems as f64;
    match fmt {
        QuantFormat::Mxfp8 { .. } => 4.0 * e + e + e / 32.0,
        QuantFormat::Nvfp4 { .. } => 4.0 * e + e / 2.0 + e / 16.0,
        QuantFormat::Bf16 => 4.0 * e + 2.0 * e,
        QuantFormat::Fp8Block { .. } => 4.0 * e + e + e / 32.0,
    }
}

/// Median seconds of copying `x` into the pre-faulted `dst` on the current rayon pool: one
/// contiguous `copy_from_slice` per thread (no small chunks, which defeat the streaming stores a
/// large `memcpy` uses and read each destination line before writing it).
fn time_copy(x: &[f32], dst: &mut [f32], min_time: Duration) -> f64 {
    let per = x.len().div_ceil(rayon::current_num_threads());
    time_median(3, min_time, || {
        dst.par_chunks_mut(per)
            .zip(x.par_chunks(per))
            .for_each(|(d, s)| d.copy_from_slice(s));
        std::hint::black_box(&dst);
    })
}

/// Quantizer throughput vs the bytes-moved floor on an `n x n` tensor, on 1 thread and on `all`;
/// `only` keeps the formats whose name contains it (the copy always runs: it sets the floor).
pub fn quantize_throughput(
    n: usize,
    all: usize,
    min_time: Duration,
    only: Option<&str>,
) -> Vec<BenchRow> {
    let x: Vec<f32> = (0..n * n)
        .map(|i| ((i as f32) * 0.618).sin() * if i % 97 == 0 { 40.0 } else { 1.0 })
        .collect();
    let in_bytes = (n * n * 4) as f64;
    // Written once here, so every page is faulted in before the copy is timed.
    let mut dst = vec![1.0f32; n * n];
    let mut rows = Vec::new();
    let mut thread_counts = vec![1];
    if all > 1 {
        thread_counts.push(all);
    }
    for threads in thread_counts {
        let pool = match rayon::ThreadPoolBuilder::new().num_threads(threads).build() {
            Ok(p) => p,
            Err(_) => continue,
        };
        let copy_s = pool.install(|| time_copy(&x, &mut dst, min_time));
        let copy_moved = 2.0 * in_bytes;
        let bandwidth = copy_moved / copy_s;
        rows.push(BenchRow {
            what: "copy".into(),
            threads,
            median_s: copy_s,
            gb_per_s: in_bytes / copy_s / 1e9,
            moved_bytes: copy_moved,
            floor_s: copy_s,
            of_floor: 1.0,
        });
        let chosen = bench_formats()
            .into_iter()
            .filter(|(name, ..)| only.is_none_or(|o| name.contains(o)));
        for (name, fmt, axis) in chosen {
            let s = pool.install(|| {
                time_median(3, min_time, || {
                    std::hint::black_box(
                        quantize(&x, n, n, &fmt, axis).map(|q| q.codes.len()).ok(),
                    );
                })
            });
            let moved = moved_bytes(&fmt, n * n);
            let floor_s = moved / bandwidth;
            rows.push(BenchRow {
                what: name.into(),
                threads,
                median_s: s,
                gb_per_s: in_bytes / s / 1e9,
                moved_bytes: moved,
                floor_s,
                of_floor: floor_s / s,
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
    between_steps: impl FnMut(),
) -> Result<Vec<(String, f64)>, crate::engine::trainer::TrainerError> {
    engine_batch_step_times(be, model, recipe, steps, 1, between_steps)
}

/// As [`engine_step_times`] for `runs` runs (sampling seeds 0, 1, ...) stepped together
/// ([`crate::engine::trainer::Trainer::step_batch`]: one batched device call per pass): the
/// phases of one step of all of them.
pub fn engine_batch_step_times(
    be: &dyn crate::engine::backend::Backend,
    model: &crate::engine::model::ModelConfig,
    recipe: crate::recipe::Recipe,
    steps: usize,
    runs: usize,
    mut between_steps: impl FnMut(),
) -> Result<Vec<(String, f64)>, crate::engine::trainer::TrainerError> {
    use crate::engine::task::Task;
    use crate::engine::trainer::{ContractBreak, Trainer};
    let init = crate::engine::model::Params::init(model, 7)?;
    let grpo = super::bench_engine::bench_grpo();
    let mut ts = (0..runs.max(1) as u64)
        .map(|seed| {
            Trainer::new(
                init.clone(),
                Task::Add(3),
                recipe.clone(),
                grpo.clone(),
                seed,
                ContractBreak::None,
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    // `Trainer::step` is `step_batch` of one, so one path serves every count.
    let mut step = || {
        let mut members: Vec<&mut Trainer> = ts.iter_mut().collect();
        let rec = Trainer::step_batch(&mut members, be).swap_remove(0);
        between_steps();
        rec
    };
    step();
    let recs: Vec<_> = (0..steps.max(1)).map(|_| step()).collect();
    for t in &ts {
        be.release_held(t.run_key());
    }
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

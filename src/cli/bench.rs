//! `lockstep bench quantize --device cuda` and `lockstep bench step`: device timings printed as
//! tables (the numbers behind `docs/cuda.md`).

use anyhow::{Context, Result};
use clap::Args;
use lockstep::engine::backend::{Device, cuda, open};

/// Quantizer kernels vs a device-to-device copy on the GPU.
pub fn quantize_gpu(device: &str, size: Option<usize>, reps: usize) -> Result<bool> {
    let d: Device = device.parse()?;
    let Device::Cuda(ordinal) = d else {
        unreachable!("the CPU bench is dispatched before this")
    };
    let n = size.unwrap_or(16384);
    let b = cuda::bench::quantize_bandwidth(ordinal, n, n, reps)
        .map_err(|err| lockstep::engine::backend::DeviceError::Cuda { device: d, err })?;
    println!(
        "quantize {n}x{n} fp32 ({:.0} MiB) on {} (sm_{}{}), median of {} event-timed runs",
        (n * n * 4) as f64 / (1 << 20) as f64,
        b.device,
        b.compute_capability.0,
        b.compute_capability.1,
        b.reps
    );
    println!(
        "{:<28} {:>10} {:>12} {:>12} {:>9}",
        "what", "median_ms", "input GB/s", "moved GB/s", "vs copy"
    );
    for r in &b.lines {
        println!(
            "{:<28} {:>10.3} {:>12.1} {:>12.1} {:>9.3}",
            r.what, r.median_ms, r.input_gb_s, r.moved_gb_s, r.vs_copy
        );
    }
    Ok(true)
}

#[derive(Debug, Args)]
pub struct StepArgs {
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Model preset (tiny or small: the benchmark shape).
    #[arg(long, default_value = "small")]
    pub model: String,
    /// Recipe preset or file.
    #[arg(long, default_value = "bf16")]
    pub recipe: String,
    /// Timed steps (after one warm-up step).
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
}

/// Median GRPO step time and its phases on one device.
pub fn step(args: &StepArgs) -> Result<bool> {
    let device: Device = args.device.parse()?;
    let be = open(device)?;
    let model = super::engine::model_preset(&args.model)?;
    let recipe = lockstep::recipe::file::load(&args.recipe)?;
    let times = lockstep::tools::bench::engine_step_times(be.as_ref(), &model, recipe, args.steps)
        .context("engine step")?;
    println!(
        "engine step, model {} recipe {} on {} (threads {}), median of {} steps:",
        args.model,
        args.recipe,
        be.name(),
        rayon::current_num_threads(),
        args.steps
    );
    for (k, v) in times {
        println!("  {k:<20} {:>9.1} ms", v * 1e3);
    }
    Ok(true)
}

//! `lockstep bench quantize` (CPU, and `--device cuda`) and `lockstep bench step`: timings
//! printed as tables (the GPU numbers are behind `docs/cuda.md`).

use anyhow::{Context, Result};
use clap::Args;
use lockstep::engine::backend::{Backend, CpuBackend, Device, cuda, open};

/// Quantizer kernels vs a device-to-device copy on the GPU.
pub fn quantize_gpu(device: &str, size: Option<usize>, reps: usize) -> Result<bool> {
    let d: Device = device.parse()?;
    let Device::Cuda(ordinal) = d else {
        unreachable!("the CPU bench is dispatched before this")
    };
    let n = size.unwrap_or(16384);
    let b = lockstep::tools::bench_gpu::quantize_bandwidth(ordinal, n, n, reps)
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
    /// Then the same step for N runs stepped together (one batched device call per pass), for
    /// each N of this list, e.g. `1,8,32`: per-run-step time and the ratio to one run alone.
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u16).range(1..))]
    pub batch_runs: Vec<u16>,
}

/// The CPU quantizer next to the bytes-moved floor (see `tools::bench`), on 1 core and all cores.
pub fn quantize_cpu(size: usize, min_time: f64, only: Option<&str>) -> Result<bool> {
    let all = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let rows = lockstep::tools::bench::quantize_throughput(
        size,
        all,
        std::time::Duration::from_secs_f64(min_time),
        only,
    );
    println!(
        "quantize {size}x{size} fp32 ({:.0} MiB), median of repetitions; floor = input read + codes \
         and scales written, at the copy's bandwidth with the same thread count",
        (size * size * 4) as f64 / (1 << 20) as f64
    );
    println!(
        "{:<18} {:>7} {:>10} {:>10} {:>9} {:>10} {:>9}",
        "what", "threads", "median_ms", "input GB/s", "moved MB", "floor_ms", "of floor"
    );
    for r in &rows {
        println!(
            "{:<18} {:>7} {:>10.2} {:>10.2} {:>9.1} {:>10.2} {:>9.3}",
            r.what,
            r.threads,
            r.median_s * 1e3,
            r.gb_per_s,
            r.moved_bytes / 1e6,
            r.floor_s * 1e3,
            r.of_floor
        );
    }
    for r in rows.iter().filter(|r| r.threads == 1 && r.what != "copy") {
        if let Some(b) = rows
            .iter()
            .find(|b| b.what == r.what && b.threads == all && all > 1)
        {
            println!(
                "{}: scaling 1 -> {all} threads: {:.2}x",
                r.what,
                r.median_s / b.median_s
            );
        }
    }
    Ok(true)
}

/// `bench step --batch-runs`: for each N, N runs stepped together on `be`, the step's phases, its
/// time per run-step and the ratio to the first N's (a GPU's model uploads per step with it).
fn batched_steps(
    be: &dyn lockstep::engine::backend::Backend,
    model: &lockstep::engine::model::ModelConfig,
    recipe: &lockstep::recipe::Recipe,
    args: &StepArgs,
    gpu: Option<&cuda::CudaBackend>,
) -> Result<()> {
    // On a GPU each N runs twice: training state held on the GPU (the default), then on the
    // host (prepared models uploaded, gradients downloaded, AdamW on the host).
    let modes: &[(bool, &str)] = if gpu.is_some() {
        &[(true, ", state on the GPU"), (false, ", state on the host")]
    } else {
        &[(false, "")]
    };
    let mut first: Option<(usize, f64)> = None;
    for (n, &(held, mode)) in args
        .batch_runs
        .iter()
        .flat_map(|&n| modes.iter().map(move |m| (usize::from(n), m)))
    {
        if let Some(g) = gpu {
            g.set_holds_training(held);
        }
        let mut uploads = Vec::new();
        let times = lockstep::tools::bench::engine_batch_step_times(
            be,
            model,
            recipe.clone(),
            args.steps,
            n,
            || uploads.extend(gpu.map(|g| g.take_counters())),
        )
        .with_context(|| format!("engine step of {n} runs together"))?;
        let step = times
            .iter()
            .find(|(k, _)| k == "perf/step_time")
            .map_or(f64::NAN, |(_, v)| *v);
        let per_run = step / n as f64;
        let (n0, per0) = *first.get_or_insert((n, per_run));
        println!(
            "  {:<42} step {:>7.1} ms for {n}: {:.2} ms a run-step, {:.1} run-steps/s, \
             {:.2}x the run-step rate of {n0}",
            if n == 1 {
                format!("{} 1 run alone{mode}", be.name())
            } else {
                format!("{} {n} runs together{mode}", be.name())
            },
            step * 1e3,
            per_run * 1e3,
            1.0 / per_run,
            per0 / per_run
        );
        let phase = |k: &str| {
            times
                .iter()
                .find(|(n, _)| n == k)
                .map_or(f64::NAN, |(_, v)| v * 1e3)
        };
        println!(
            "  {:<42} export {:.1}  rollout {:.1}  train {:.1} (forward {:.1}, backward {:.1}, \
             optimizer {:.1} a member)",
            "",
            phase("perf/export_time"),
            phase("perf/rollout_time"),
            phase("perf/train_time"),
            phase("perf/train_forward_time"),
            phase("perf/train_backward_time"),
            phase("perf/optimizer_time"),
        );
        if let Some(last) = uploads.last() {
            println!(
                "  {:<42} {} models uploaded in {:.1} ms (last step)",
                "",
                last.model_uploads,
                last.model_upload_ns as f64 / 1e6
            );
        }
        if let Some(g) = gpu
            && !held
        {
            train_pass_line(g, model, recipe, n, args.steps)?;
        }
    }
    if let Some(g) = gpu {
        g.set_holds_training(false);
    }
    Ok(())
}

/// On a GPU, `n` runs' batched training pass (forward, logits back, backward; `bench forward`'s
/// rows) as the trainer runs it, every run's model uploaded and gradients downloaded, against
/// the same pass with both left on the GPU: what keeping them there could save.
fn train_pass_line(
    gpu: &cuda::CudaBackend,
    model: &lockstep::engine::model::ModelConfig,
    recipe: &lockstep::recipe::Recipe,
    n: usize,
    reps: usize,
) -> Result<()> {
    use lockstep::engine::backend::ForwardItem;
    use lockstep::engine::model::{Params, PreparedModel};
    let plan = recipe.resolve(model.n_layers)?;
    // One model stacked n times: the pass's work does not depend on the weights' values.
    let prep = PreparedModel::new(&Params::init(model, 7)?, &plan)?;
    let (rows, layout) =
        lockstep::tools::bench::trainer_batch(model.vocab, (32, 8, 7, 15), 7, false);
    let items: Vec<ForwardItem> = (0..n)
        .map(|_| ForwardItem {
            prep: &prep,
            tokens: &rows,
            layout: &layout,
            replay: None,
        })
        .collect();
    let dl: Vec<f32> = (0..cuda::CudaBackend::train_pass_rows(&items) * model.vocab)
        .map(|i| ((i % 97) as f32 - 48.0) * 1e-5)
        .collect();
    let t = gpu
        .train_pass_times(&items, &dl, reps)
        .with_context(|| format!("training pass of {n} runs"))?;
    println!(
        "  {:<42} training pass: {:.2} ms a run with its model uploaded and gradients \
         downloaded, {:.2} ms with both left on the GPU ({:.2}x), {:.2} ms with the model \
         prepared on the GPU from master weights kept there ({:.2}x)",
        "",
        t.with_transfers * 1e3 / n as f64,
        t.on_device * 1e3 / n as f64,
        t.with_transfers / t.on_device,
        t.prepared_on_device * 1e3 / n as f64,
        t.with_transfers / t.prepared_on_device
    );
    Ok(())
}

/// Median GRPO step time and its phases on one device. On a GPU, the CUDA backend is timed with
/// cudarc's cross-stream event tracking off (its default here) and on, with its model-upload and
/// training-forward counters per step; then this host's CPU at the same shape and the CPU/GPU
/// step-time ratios, all in one run.
pub fn step(args: &StepArgs) -> Result<bool> {
    let device: Device = args.device.parse()?;
    let model = super::engine::model_preset(&args.model)?;
    let recipe = lockstep::recipe::file::load(&args.recipe)?;
    // On a GPU, the backends are all opened first, so a missing GPU is the one-line error alone.
    let cuda_err = |err| lockstep::engine::backend::DeviceError::Cuda { device, err };
    let gpu = match device {
        Device::Cuda(ordinal) => [
            ("cudarc event tracking off", false),
            ("cudarc event tracking on", true),
        ]
        .into_iter()
        .map(|(label, tracking)| {
            cuda::CudaBackend::with_event_tracking(ordinal, tracking).map(|be| (label, be))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(cuda_err)?,
        Device::Cpu => Vec::new(),
    };
    println!(
        "engine step, model {} recipe {} (32 prompts x 8 samples, <= 8 response tokens, add:3), \
         host threads {}, median of {} steps after one warm-up:",
        args.model,
        args.recipe,
        rayon::current_num_threads(),
        args.steps
    );
    // A phase's median in ms (NaN if the step did not record it).
    let ms = |times: &[(String, f64)], k: &str| {
        times
            .iter()
            .find(|(n, _)| n == k)
            .map_or(f64::NAN, |(_, v)| v * 1e3)
    };
    let print = |label: &str, times: &[(String, f64)]| {
        let cell = |k: &str| ms(times, k);
        println!(
            "  {label:<42} step {:>7.1} ms  export {:>6.1}  rollout {:>6.1}  train {:>6.1} \
             (forward {:.1}, backward {:.1}, optimizer {:.1})",
            cell("perf/step_time"),
            cell("perf/export_time"),
            cell("perf/rollout_time"),
            cell("perf/train_time"),
            cell("perf/train_forward_time"),
            cell("perf/train_backward_time"),
            cell("perf/optimizer_time")
        );
    };
    if gpu.is_empty() {
        let be = open(device)?;
        let times = lockstep::tools::bench::engine_step_times(
            be.as_ref(),
            &model,
            recipe.clone(),
            args.steps,
            || {},
        )
        .context("engine step")?;
        print(&be.name(), &times);
        batched_steps(be.as_ref(), &model, &recipe, args, None)?;
        return Ok(true);
    }
    let mut gpu_steps = Vec::new();
    for (label, be) in &gpu {
        let mut per_step = Vec::new();
        let times = lockstep::tools::bench::engine_step_times(
            be,
            &model,
            recipe.clone(),
            args.steps,
            || per_step.push(be.take_counters()),
        )
        .context("engine step")?;
        print(&format!("{} {label}", be.name()), &times);
        gpu_steps.push((label, ms(&times, "perf/step_time")));
        let last = per_step.last().copied().unwrap_or_default();
        println!(
            "  {:<42} {} models uploaded in {:.1} ms; trainer forward {:.1} ms (last step)",
            "",
            last.model_uploads,
            last.model_upload_ns as f64 / 1e6,
            last.train_forward_ns as f64 / 1e6
        );
    }
    if let Some((_, be)) = gpu.first() {
        batched_steps(be, &model, &recipe, args, Some(be))?;
    }
    // The same shape on this host's CPU, in the same run, so the ratios compare like with like.
    let cpu = CpuBackend;
    let times = lockstep::tools::bench::engine_step_times(&cpu, &model, recipe, args.steps, || {})
        .context("engine step on the CPU")?;
    print("cpu (this host, same run)", &times);
    let cpu_ms = ms(&times, "perf/step_time");
    for (label, ms) in gpu_steps {
        println!("  cpu/gpu step time, {label}: {:.2}x", cpu_ms / ms);
    }
    Ok(true)
}

#[derive(Debug, Args)]
pub struct ForwardArgs {
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Model preset (tiny or small: the benchmark shape).
    #[arg(long, default_value = "small")]
    pub model: String,
    /// Recipe presets or files (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "bf16,nvfp4-dq")]
    pub recipes: Vec<String>,
    /// Timed forwards per device (after one warm-up); the median is printed.
    #[arg(long, default_value_t = 10)]
    pub reps: usize,
}

/// Median wall time of `f` over `reps` calls after one warm-up.
fn median_secs<E>(reps: usize, mut f: impl FnMut() -> Result<(), E>) -> Result<f64, E> {
    f()?;
    let mut t = Vec::with_capacity(reps.max(1));
    for _ in 0..reps.max(1) {
        let start = std::time::Instant::now();
        f()?;
        t.push(start.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// The policy forward (logits and routing of the trainer's rows) at the benchmark shape: 32
/// prompts of 7 tokens x 8 samples of 8 response tokens, laid out as the trainer lays them out.
/// On a GPU the device-resident forward is timed next to this host's CPU forward, logits copied
/// back included (weights uploaded once, outside the timing).
pub fn forward(args: &ForwardArgs) -> Result<bool> {
    use lockstep::engine::model::{Params, PreparedModel, forward_rows};
    let device: Device = args.device.parse()?;
    let cfg = super::engine::model_preset(&args.model)?;
    let resident = match device {
        Device::Cuda(ordinal) => Some(
            cuda::CudaDevice::open(ordinal)
                .and_then(|d| cuda::device_ops::GpuOps::new(&d))
                .map_err(|err| lockstep::engine::backend::DeviceError::Cuda { device, err })?,
        ),
        Device::Cpu => None,
    };
    let (groups, n, prompt, t) = (32, 8, 7, 15);
    let (rows, layout) =
        lockstep::tools::bench::trainer_batch(cfg.vocab, (groups, n, prompt, t), 7, false);
    let params = Params::init(&cfg, 7)?;
    println!(
        "policy forward, model {} ({} rows: {groups} prompts x {n} samples, {prompt} prompt + {} \
         response tokens), host threads {}, median of {} after one warm-up:",
        args.model,
        layout.rows(),
        t - prompt,
        rayon::current_num_threads(),
        args.reps
    );
    for name in &args.recipes {
        let plan = lockstep::recipe::file::load(name)?.resolve(cfg.n_layers)?;
        let prep = PreparedModel::new(&params, &plan)?;
        let cpu = median_secs::<anyhow::Error>(args.reps, || {
            forward_rows(&prep, &rows, &layout, None);
            Ok(())
        })?;
        let Some(rf) = &resident else {
            println!("  {name:<12} cpu {:>8.2} ms", cpu * 1e3);
            continue;
        };
        let dm = rf.upload_model(&prep).context("upload")?;
        let gpu = median_secs(args.reps, || {
            lockstep::engine::model::pass::infer(rf, &dm, &rows, &layout, None).map(|_| ())
        })
        .context("resident forward")?;
        println!(
            "  {name:<12} cpu {:>8.2} ms   resident {} {:>8.2} ms   cpu/gpu {:>5.2}x",
            cpu * 1e3,
            args.device,
            gpu * 1e3,
            cpu / gpu
        );
    }
    Ok(true)
}

#[derive(Debug, Args)]
pub struct DecodeArgs {
    /// cuda or cuda:N.
    #[arg(long, default_value = "cuda")]
    pub device: String,
    /// Model preset (tiny or small: the nightly's shape).
    #[arg(long, default_value = "small")]
    pub model: String,
    /// Recipe presets or files (comma-separated); each is timed with every batch size.
    #[arg(long, value_delimiter = ',', default_value = "bf16,nvfp4-dq")]
    pub recipes: Vec<String>,
    /// Runs decoded together (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    pub batch_runs: Vec<usize>,
    /// Sequences a run decodes (the nightly's rollout: 16 prompts x 8 samples).
    #[arg(long, default_value_t = 128)]
    pub seqs: usize,
    /// Timed positions per mode (after one warm-up); the median is printed.
    #[arg(long, default_value_t = 20)]
    pub reps: usize,
}

/// `lockstep bench decode`: a decode position queued op by op against its CUDA graph replayed.
pub fn decode(args: &DecodeArgs) -> Result<bool> {
    use lockstep::engine::device::OpError;
    use lockstep::engine::model::{Params, PreparedModel};
    let device: Device = args.device.parse()?;
    let Device::Cuda(ordinal) = device else {
        anyhow::bail!("bench decode times CUDA graphs: use --device cuda");
    };
    let backend = cuda::CudaBackend::new(ordinal)
        .map_err(|err| lockstep::engine::backend::DeviceError::Cuda { device, err })?;
    let cfg = super::engine::model_preset(&args.model)?;
    // A 3-digit addition prompt's length.
    let prompt: Vec<u32> = (1..=7).map(|t| t % cfg.vocab as u32).collect();
    println!(
        "decode position, model {} ({} sequences a run after a {}-token prompt), {} {}, median \
         of {} after one warm-up, logits and routing read back in both:",
        args.model,
        args.seqs,
        prompt.len(),
        args.device,
        backend.device().name(),
        args.reps
    );
    for name in &args.recipes {
        let plan = lockstep::recipe::file::load(name)?.resolve(cfg.n_layers)?;
        for &runs in &args.batch_runs {
            let preps = (0..runs)
                .map(|r| PreparedModel::new(&Params::init(&cfg, r as u64)?, &plan))
                .collect::<Result<Vec<_>, _>>()?;
            let refs: Vec<&PreparedModel> = preps.iter().collect();
            let mut median_ms = |f: &mut dyn FnMut() -> Result<(), OpError>| {
                median_secs(args.reps, f).map(|s| s * 1e3)
            };
            let t = cuda::decode_graph::decode_times(
                &backend,
                &refs,
                args.seqs,
                &prompt,
                &mut median_ms,
            )
            .with_context(|| format!("{name}, {runs} runs"))?;
            match (t.replay_ms, &t.capture_error) {
                (Some(replay), _) => println!(
                    "  {name:<10} {runs:>3} runs  queued {:>7.3} ms  graph {:>7.3} ms ({} nodes)  \
                     {:>5.2}x  outputs {}",
                    t.queued_ms,
                    replay,
                    t.nodes,
                    t.queued_ms / replay,
                    if t.same { "identical" } else { "DIFFER" }
                ),
                (None, e) => println!(
                    "  {name:<10} {runs:>3} runs  queued {:>7.3} ms  graph: not captured ({})",
                    t.queued_ms,
                    e.as_deref().unwrap_or("no reason given")
                ),
            }
        }
    }
    Ok(true)
}

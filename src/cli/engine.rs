//! `lockstep run-one` and `lockstep recipe show`: flags → a validated run configuration.

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use lockstep::engine::model::ModelConfig;
use lockstep::engine::task::Task;
use lockstep::engine::trainer::{ContractBreak, GrpoConfig};
use lockstep::engine::warmstart::WarmStartConfig;
use lockstep::recipe::{Precision, Site, file::load};
use lockstep::store::RunStatus;
use lockstep::suite::builtin::{
    RunConfig, default_cache, run_one, site_weights, step_line, stored_bytes,
};
use std::path::PathBuf;

/// A model preset name.
pub fn model_preset(name: &str) -> Result<ModelConfig> {
    lockstep::suite::plan::model_preset(name)
        .with_context(|| format!("unknown model `{name}`; presets: tiny, small"))
}

#[derive(Debug, Args)]
pub struct RunOneArgs {
    /// Model preset: tiny (CI-sized) or small (nightly: 6 layers, 8 experts top-2).
    #[arg(long, default_value = "tiny")]
    pub model: String,
    /// Task: add:N (N-digit addition) or sort:N (sort N digits).
    #[arg(long, default_value = "add:2")]
    pub task: String,
    /// Recipe preset (bf16, mxfp8, mxfp8-hp, mxfp8-dq, nvfp4-hp, nvfp4-dq, fp8-block) or a .toml/.yaml file.
    #[arg(long, default_value = "bf16")]
    pub recipe: String,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long, default_value_t = 30)]
    pub steps: usize,
    /// Run folder to write (manifest.json, scalars.parquet, layers.parquet, events.jsonl, log.txt).
    #[arg(long, required_unless_present = "suite", conflicts_with = "suite")]
    pub out: Option<PathBuf>,
    /// Run one planned run of this suite file into the store instead (what a Slurm array task
    /// runs; the suite decides model, task, recipe, seed and steps; needs --run-id).
    #[arg(long, requires = "run_id")]
    pub suite: Option<PathBuf>,
    /// The run id within --suite (`lockstep suite show FILE` lists them).
    #[arg(long, requires = "suite")]
    pub run_id: Option<String>,
    /// Run store root for --suite.
    #[arg(long, default_value = "runs")]
    pub store: PathBuf,
    /// With --suite: redo the run even if it is finished.
    #[arg(long)]
    pub force: bool,
    /// Prompts per step.
    #[arg(long)]
    pub prompts: Option<usize>,
    /// Samples per prompt (GRPO group size).
    #[arg(long)]
    pub samples: Option<usize>,
    /// Maximum response tokens.
    #[arg(long)]
    pub max_response: Option<usize>,
    /// Break the trainer/rollout quantization contract on purpose: per-tensor-nvfp4, shards:N, mxfp8-floor-scale.
    #[arg(long, default_value = "none")]
    pub contract_break: String,
    /// Warm-start cache folder (default: $LOCKSTEP_CACHE or runs/cache).
    #[arg(long)]
    pub cache: Option<PathBuf>,
    /// Where the engine runs: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: String,
}

pub fn parse_break(s: &str) -> Result<ContractBreak> {
    lockstep::suite::plan::parse_break(s)
        .with_context(|| format!("unknown contract break `{s}`; use none, per-tensor-nvfp4, shards:N or mxfp8-floor-scale"))
}

impl RunOneArgs {
    pub fn config(&self) -> Result<RunConfig> {
        let model = model_preset(&self.model)?;
        model.validate()?;
        let task: Task = self.task.parse()?;
        let recipe = load(&self.recipe)?;
        let mut grpo = GrpoConfig::default();
        if let Some(p) = self.prompts {
            grpo.prompts_per_step = p;
        }
        if let Some(s) = self.samples {
            grpo.samples_per_prompt = s;
        }
        grpo.max_response_tokens = self.max_response.unwrap_or(task.answer_len() + 2);
        Ok(RunConfig {
            model,
            task,
            recipe,
            grpo,
            warm_start: WarmStartConfig::default(),
            contract_break: parse_break(&self.contract_break)?,
            seed: self.seed,
            steps: self.steps,
        })
    }
}

pub fn run_one_cmd(args: &RunOneArgs) -> Result<bool> {
    if let (Some(suite), Some(run_id)) = (&args.suite, &args.run_id) {
        let be = lockstep::engine::backend::open(args.device.parse()?)?;
        return super::slurm::run_task(
            be.as_ref(),
            suite,
            run_id,
            &args.store,
            args.cache.clone(),
            args.force,
        );
    }
    let Some(out) = &args.out else {
        anyhow::bail!("give --out DIR (or --suite FILE --run-id ID)");
    };
    let cfg = args.config()?;
    let device: lockstep::engine::backend::Device = args.device.parse()?;
    let be = lockstep::engine::backend::open(device)?;
    if matches!(device, lockstep::engine::backend::Device::Cuda(_)) {
        eprintln!("{}", lockstep::engine::backend::cuda::GPU_NOTE);
    }
    let cache = args.cache.clone().unwrap_or_else(default_cache);
    let id = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "run".into());
    let m = run_one(be.as_ref(), &cfg, &id, out, Some(&cache), |r| {
        println!("{}", step_line(r))
    })
    .with_context(|| format!("run {}", out.display()))?;
    println!(
        "status {:?}, {} steps, wrote {}",
        m.status,
        m.steps_done,
        out.display()
    );
    if let Some(e) = &m.error {
        eprintln!("error: {e}");
    }
    Ok(m.status == RunStatus::Ok)
}

#[derive(Debug, Subcommand)]
pub enum RecipeCommand {
    /// Print the resolved table (site x layer -> format, backward mode) and weight bytes per format.
    Show {
        /// Preset name or recipe file.
        name: String,
        #[arg(long, default_value = "small")]
        model: String,
    },
}

pub fn recipe_cmd(cmd: &RecipeCommand) -> Result<bool> {
    let RecipeCommand::Show { name, model } = cmd;
    let cfg = model_preset(model)?;
    let recipe = load(name)?;
    let plan = recipe
        .resolve(cfg.n_layers)
        .map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
    println!(
        "recipe {} on model {model} ({} layers)",
        recipe.name, cfg.n_layers
    );
    print!("{:<32}", "site \\ layer");
    for i in 0..cfg.n_layers {
        print!(" {:>16}", i);
    }
    println!();
    let d = cfg.d_model;
    let mut bytes: std::collections::BTreeMap<&str, (usize, f64)> = Default::default();
    for s in Site::ALL {
        print!("{:<32}", s.suffix());
        for l in &plan.layers {
            let p = l.get(s);
            let cell = if p.precision == Precision::Bf16 || p.precision == Precision::Fp32 {
                p.precision.label().to_string()
            } else {
                format!("{}/{}", p.precision.label(), short(p.backward.label()))
            };
            print!(" {:>16}", cell);
            let (n, tensors) = site_weights(&cfg, s);
            let entry = bytes.entry(p.precision.label()).or_default();
            entry.0 += n;
            entry.1 += stored_bytes(p.precision, n, tensors);
        }
        println!();
    }
    let out = plan.output_layer;
    println!("{:<32} {:>16}", "output_layer", out.precision.label());
    let entry = bytes.entry(out.precision.label()).or_default();
    entry.0 += cfg.vocab * d;
    entry.1 += stored_bytes(out.precision, cfg.vocab * d, 1);
    println!(
        "\nbackward: hp = high-precision, dq = dequantized, q = quantized. NVFP4 activations: {:?}, shards {}",
        recipe.nvfp4_activation_scale, recipe.nvfp4_shards
    );
    println!("\nmatmul weight bytes per format (codes + scales + second-level scales):");
    let total: f64 = bytes.values().map(|v| v.1).sum();
    for (fmt, (n, b)) in &bytes {
        println!(
            "  {fmt:<10} {n:>10} weights  {b:>12.0} bytes  ({:.1} %)",
            100.0 * b / total.max(1.0)
        );
    }
    println!(
        "  total      {:>10} weights  {total:>12.0} bytes  (BF16 would be {} bytes)",
        bytes.values().map(|v| v.0).sum::<usize>(),
        2 * bytes.values().map(|v| v.0).sum::<usize>()
    );
    Ok(true)
}

fn short(b: &str) -> &str {
    match b {
        "high-precision" => "hp",
        "dequantized" => "dq",
        _ => "q",
    }
}

/// `lockstep bench engine`: print the step table and how it stands against the targets.
pub fn bench_engine_cmd(
    steps: usize,
    recipes: &[String],
    gemm_size: usize,
    peer: Option<(&std::path::Path, &std::path::Path)>,
) -> Result<bool> {
    use lockstep::tools::bench_engine::engine_bench;
    let names: Vec<&str> = recipes.iter().map(String::as_str).collect();
    let b = engine_bench(&names, steps, gemm_size, std::time::Duration::from_secs(1))?;
    println!(
        "engine step at the benchmark shape (small model, 32 prompts x 8 samples, <= 8 response tokens, add:3), \
         CPU, {} threads, median of {steps} steps; formats are emulated",
        b.threads
    );
    println!(
        "{:<10} {:>7} {:>8} {:>8} {:>8} {:>10} {:>10} {:>9} {:>7} {:>8}",
        "recipe",
        "step_s",
        "export_s",
        "rollout",
        "train_s",
        "roll_tok/s",
        "train_tok/s",
        "train_GF/s",
        "vs_gemm",
        "vs_bf16"
    );
    let bf16 = b.rows.iter().find(|r| r.recipe == "bf16").map(|r| r.step_s);
    for r in &b.rows {
        println!(
            "{:<10} {:>7.3} {:>8.3} {:>8.3} {:>8.3} {:>10.0} {:>10.0} {:>9.1} {:>7.2} {:>8}",
            r.recipe,
            r.step_s,
            r.export_s,
            r.rollout_s,
            r.train_s,
            r.rollout_tokens_per_s,
            r.train_tokens_per_s,
            r.train_gflops,
            r.train_gflops / b.gemm_gflops,
            bf16.map(|s| format!("{:.2}x", r.step_s / s))
                .unwrap_or_else(|| "-".into()),
        );
    }
    println!(
        "GEMM library (matrixmultiply) on {n}x{n}x{n}: {:.1} GFLOP/s",
        b.gemm_gflops,
        n = b.gemm_n
    );
    println!(
        "targets (issue 3): bf16 step <= 0.55 s, nvfp4-dq <= 0.90 s, every recipe <= 1.6x bf16, train >= 0.40 of the GEMM rate"
    );
    if let Some((python, script)) = peer {
        print_peer(python, script, &names, steps, &b)?;
    }
    Ok(true)
}

/// Times the PyTorch-eager peer on the same recipes and steps (after lockstep's, so the two
/// never share the cores) and prints it next to lockstep's step.
fn print_peer(
    python: &std::path::Path,
    script: &std::path::Path,
    names: &[&str],
    steps: usize,
    b: &lockstep::tools::bench_engine::EngineBench,
) -> Result<()> {
    use lockstep::tools::pytorch_peer::{Peer, run_peer};
    let rows = match run_peer(python, script, names, steps, b.threads)? {
        Peer::Ran(rows) => rows,
        Peer::Unavailable(why) => {
            println!("PyTorch-eager peer: not run ({why})");
            return Ok(());
        }
    };
    let torch = rows.first().map_or("?", |r| r.torch.as_str());
    println!(
        "PyTorch-eager peer ({}, torch {torch}, {} threads), median of {steps} steps, run after lockstep's:",
        script.display(),
        rows.first().map_or(0, |r| r.threads)
    );
    println!(
        "{:<10} {:>7} {:>8} {:>8} {:>8} {:>15}",
        "recipe", "step_s", "export_s", "rollout", "train_s", "lockstep_faster"
    );
    for (p, r) in rows.iter().zip(&b.rows) {
        println!(
            "{:<10} {:>7.3} {:>8.3} {:>8.3} {:>8.3} {:>14.2}x",
            p.recipe,
            p.step,
            p.export,
            p.rollout,
            p.train,
            p.step / r.step_s
        );
    }
    println!("target (issue 23): lockstep at least 2x the peer on every recipe, 2 threads");
    Ok(())
}

//! Command-line definitions (clap derive: each doc comment is the flag's help) and the mapping of raw
//! flags to validated library calls. Exit codes are defined once, in `main.rs`.

pub mod bench;
pub mod bench_sweep;
pub mod compare;
pub mod engine;
pub mod progress;
pub mod quantize;
pub mod report;
pub mod slurm;
pub mod suite;
pub mod workers;

use clap::{Parser, Subcommand};

/// lockstep: does a low-precision RL recipe still train like BF16?
#[derive(Debug, Parser)]
#[command(name = "lockstep", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Quantize a 2-D float32 .npy with one format, or check golden vectors (--check DIR).
    Quantize(quantize::QuantizeArgs),
    /// Run one configuration and seed of the built-in engine into a run folder.
    RunOne(engine::RunOneArgs),
    /// Suite files: show the expanded run list or validate.
    #[command(subcommand)]
    Suite(suite::SuiteCommand),
    /// Run every unfinished run of a suite into the run store (resumable).
    Run(suite::RunArgs),
    /// One worker process of `lockstep run --processes N`: its share of the runs comes on stdin.
    #[command(hide = true)]
    SweepWorker,
    /// Import runs made elsewhere (a tree of metrics files) into the run store.
    Ingest(suite::IngestArgs),
    /// Inspect the run store.
    #[command(subcommand)]
    Runs(suite::RunsCommand),
    /// Precision recipes.
    #[command(subcommand)]
    Recipe(engine::RecipeCommand),
    /// Write the suite's HTML report with a PNG of every figure (reports/<suite>/<timestamp>/).
    Report(report::ReportArgs),
    /// Compare every configuration of a suite against BF16 across seeds; writes compare.json.
    Compare(compare::CompareArgs),
    /// Golden values: save a suite's runs under baselines/<suite>/, or diff against them.
    #[command(subcommand)]
    Baseline(compare::BaselineCommand),
    /// Run + compare + report + verdict. Exit 0 pass, 1 regression, 2 error.
    Nightly(compare::NightlyArgs),
    /// Benchmarks: ratios measured side by side in one run.
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// MXFP8 and NVFP4 (per token and per tensor, rows and columns) quantizer throughput next to
    /// the bytes-moved floor (input read + codes and scales written, at the bandwidth of a copy
    /// into a pre-faulted buffer timed in the same run), on 1 core and all cores
    /// (`--device cuda`: every quantizer kernel next to a device-to-device copy).
    Quantize {
        /// Side of the square FP32 tensor (default 4096 on the CPU, 16384 on a GPU).
        #[arg(long)]
        size: Option<usize>,
        /// Minimum seconds spent per measurement (median of the repetitions is reported; CPU only).
        #[arg(long, default_value_t = 1.0)]
        min_time: f64,
        /// cpu, cuda or cuda:N.
        #[arg(long, default_value = "cpu")]
        device: String,
        /// Timed repetitions per kernel (GPU only; the median is reported).
        #[arg(long, default_value_t = 20)]
        reps: usize,
        /// Time only the formats whose name contains this (e.g. `nvfp4 token row`; CPU only).
        #[arg(long)]
        only: Option<String>,
    },
    /// The built-in engine's RL step at the benchmark shape for every recipe, with rollout and train
    /// tokens/s and the train phase's GFLOP/s next to the GEMM library's rate on a large matmul.
    Engine {
        /// Timed steps per recipe (after one warm-up step); medians are printed.
        #[arg(long, default_value_t = 3)]
        steps: usize,
        /// Recipes to time (comma-separated presets).
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "bf16,mxfp8,mxfp8-hp,mxfp8-dq,nvfp4-hp,nvfp4-dq,fp8-block"
        )]
        recipes: Vec<String>,
        /// Side of the square matmul that measures the GEMM library's own rate.
        #[arg(long, default_value_t = 1024)]
        gemm_size: usize,
        /// Also time the PyTorch-eager peer (`bench/pytorch_step.py`, same recipes and steps,
        /// after lockstep's) and print how many times faster lockstep is; says so when Python or
        /// torch is missing.
        #[arg(long)]
        pytorch: bool,
        /// Python interpreter for `--pytorch`.
        #[arg(long, default_value = "python3")]
        python: std::path::PathBuf,
        /// The peer script for `--pytorch`.
        #[arg(long, default_value = "bench/pytorch_step.py")]
        pytorch_script: std::path::PathBuf,
    },
    /// Time building a report for a synthetic nightly-sized suite (target: under 10 s).
    Report(report::BenchReportArgs),
    /// Engine GRPO step time (median of --steps after one warm-up) on a device; with --device
    /// cuda, the CUDA backend with cudarc's event tracking off and on, then this host's CPU at the
    /// same shape and the CPU/GPU step-time ratios.
    Step(bench::StepArgs),
    /// The policy forward at the benchmark shape on this host's CPU and, with --device cuda, the
    /// device-resident forward next to it.
    Forward(bench::ForwardArgs),
    /// One decode position of a batch of runs (the work a rollout queues per generated token)
    /// queued op by op against the same position captured as a CUDA graph and replayed: what
    /// graphs would save the rollout. GPU only.
    Decode(bench::DecodeArgs),
    /// Sweep throughput: a suite's runs (default the nightly suite) through worker layouts
    /// (processes x workers) in one call, warm start cached first: wall time, run-steps per second,
    /// the ratio to the first layout and whether every layout gives its metrics bit for bit.
    Sweep(bench_sweep::SweepArgs),
    /// Compare synthetic runs (default 1,000 runs x 1,000 steps, read back from run folders) and print
    /// the load, statistics and compare.json times against the 5 s target.
    Compare {
        #[arg(long, default_value_t = 1000)]
        runs: usize,
        #[arg(long, default_value_t = 1000)]
        steps: usize,
        /// Configurations the runs are split over (the first is the bf16 baseline).
        #[arg(long, default_value_t = 10)]
        configs: usize,
        /// Per-site grad-norm series per run (spike detection).
        #[arg(long, default_value_t = 8)]
        sites: usize,
        /// Skip writing the runs as run folders and timing reading them back (loading is timed by
        /// default: the 5 s target includes it).
        #[arg(long)]
        no_io: bool,
        /// Kept for old scripts: loading is timed by default now.
        #[arg(long, hide = true)]
        io: bool,
    },
}

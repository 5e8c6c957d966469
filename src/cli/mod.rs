//! Command-line definitions (clap derive: each doc comment is the flag's help) and the mapping of raw
//! flags to validated library calls. Exit codes are defined once, in `main.rs`.

pub mod engine;
pub mod quantize;
pub mod slurm;
pub mod suite;

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
    /// Import runs made elsewhere (a tree of metrics files) into the run store.
    Ingest(suite::IngestArgs),
    /// Inspect the run store.
    #[command(subcommand)]
    Runs(suite::RunsCommand),
    /// Precision recipes.
    #[command(subcommand)]
    Recipe(engine::RecipeCommand),
    /// Benchmarks: ratios measured side by side in one run.
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// MXFP8 and NVFP4 per-token quantizer throughput next to a plain copy, on 1 core and all cores.
    Quantize {
        /// Side of the square FP32 tensor.
        #[arg(long, default_value_t = 4096)]
        size: usize,
        /// Minimum seconds spent per measurement (median of the repetitions is reported).
        #[arg(long, default_value_t = 1.0)]
        min_time: f64,
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
    },
}

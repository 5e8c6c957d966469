//! Suites: a TOML file naming an engine, a workload, seeds, configurations, optional sweep axes and
//! checks, expanded into the list of runs to execute ([`plan`]), run by a resumable parallel runner
//! ([`runner`]) or handed to Slurm as one job array ([`slurm`]). No statistics here.

pub mod builtin;
pub mod command;
pub mod frameworks;
pub mod identity;
pub mod ingest;
pub mod interrupt;
pub mod metrics;
pub mod plan;
pub mod runner;
pub mod slurm;
pub mod spec;
pub mod tensorboard;
pub mod wandb;

pub use plan::{RunSpec, expand};
pub use spec::{SuiteError, SuiteSpec, load, parse};

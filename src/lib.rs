//! lockstep: runs precision configurations of an RL recipe (BF16, MXFP8, NVFP4, ...) through short GRPO
//! loops and tells whether the low-precision ones still train like BF16.
//!
//! Module map: [`formats`] holds the one quantizer every path calls; [`recipe`] maps site names to
//! formats; [`engine`] is the built-in MoE policy, its rollout and its GRPO trainer; [`io`] reads
//! and writes files atomically; [`tools`] backs the standalone commands (quantize, benchmarks);
//! [`report`] draws a suite's comparison into one self-contained HTML page with PNG figures.
//! [`compare`] judges configurations against BF16 across seeds (verdicts, checks, golden values,
//! the nightly verdict).

pub mod compare;
pub mod engine;
pub mod formats;
pub mod io;
pub mod recipe;
pub mod report;
pub mod store;
pub mod suite;
pub mod tools;

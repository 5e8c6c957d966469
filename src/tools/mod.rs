//! The library side of the standalone commands: `lockstep quantize` and the benchmarks. The binary
//! only parses flags and prints what these return.

pub mod bench;
pub mod bench_engine;
pub mod bench_gpu;
pub mod pytorch_peer;
pub mod quantize;

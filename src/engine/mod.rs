//! The built-in engine: a small MoE transformer policy, its rollout (incremental decoder) and a GRPO
//! trainer, with every matmul site quantized per the precision recipe through `crate::formats`.

pub mod backend;
pub mod linear;

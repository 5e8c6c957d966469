//! The built-in engine: a small MoE transformer policy, its rollout (incremental decoder) and a GRPO
//! trainer, with every matmul site quantized per the precision recipe through `crate::formats`.

pub mod backend;
pub mod checkpoint;
pub mod contract;
pub mod cost;
pub mod device;
pub mod layout;
pub mod linear;
pub mod metrics;
pub mod model;
pub mod ops;
pub mod optim;
pub mod rollout;
pub mod task;
pub mod trainer;
pub mod warmstart;

//! Comparing a suite's configurations against BF16 across seeds (issue: compare). The result types
//! live in [`result`]; the statistics that fill them come next.

pub mod result;

pub use result::*;

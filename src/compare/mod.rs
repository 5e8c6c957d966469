//! Comparing a suite's configurations against BF16 across seeds (issue 5). [`result`] holds the
//! plain result types, [`stats`] the statistics over per-seed values, [`expr`] the check language,
//! [`settings`] the suite's `[checks]` table, [`claims`] the published findings it decides, [`data`] the runs read into memory, [`spikes`] the
//! gradient-spike rules, [`sequential`] the group-sequential seed procedure, [`analyze`] the procedure that fills a [`SuiteComparison`], [`golden`]
//! the golden-value diff, [`nightly`] the nightly verdict, Markdown and JUnit, and [`bench`] the
//! timing of a large comparison.

pub mod analyze;
pub mod bench;
pub mod claims;
pub mod data;
pub mod expr;
pub mod golden;
pub mod health;
pub mod nightly;
pub mod result;
pub mod sequential;
pub mod settings;
pub mod spikes;
pub mod stats;

pub use analyze::{
    CompareError, CompareOptions, apply_sequential, compare_data, compare_planned, compare_runs,
    compare_suite, load_planned, sequential_looks,
};
pub use result::*;
pub use settings::CompareSettings;

//! Reports (issue 6): one self-contained HTML page per suite comparison, with every figure inline as a
//! base64 PNG and the same PNGs beside it, under `reports/<suite>/<timestamp>/`.
//!
//! The report draws what [`crate::compare`] computed ([`SuiteComparison`]: bands over seeds, verdicts,
//! spikes, checks, contract totals, method) and reads from the run store only what the comparison does
//! not carry: per-layer gradient norms (heatmaps), `perf/*` timings and manifests (metadata). It
//! computes no statistics of its own; the few display summaries (mean seconds per step in the timing
//! bars, max over seeds in a heatmap cell) are said in each caption.
//!
//! Safety: every string that comes from a suite, a configuration or a run goes through
//! [`html::Html::text`]; the page carries a Content-Security-Policy that allows no script and no
//! network (`img-src data:`), so a hostile run name can neither run code nor phone home.
//! Text in figures uses the shipped DejaVu Sans ([`font`]), never system font libraries.

pub mod figures;
pub mod fixture;
pub mod font;
pub mod html;
pub mod palette;
pub mod runs;
pub mod summary;

use crate::compare::SuiteComparison;
use crate::io::{IoError, atomic};
use crate::suite::spec::SuiteSpec;
use std::path::{Path, PathBuf};

pub use runs::{RunData, load_current_runs, load_runs};

/// Everything a report is built from.
pub struct ReportInput<'a> {
    pub spec: &'a SuiteSpec,
    /// The suite's folder in the run store (`<store>/<suite>/`), shown in the metadata.
    pub suite_dir: &'a Path,
    pub comparison: &'a SuiteComparison,
    /// The suite's runs as read by [`load_runs`] (layers, timings, manifests).
    pub runs: &'a [RunData],
}

/// A report that could not be written, with the file and the fix.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error(transparent)]
    Io(#[from] IoError),
    #[error("figure {file}: {msg}")]
    Figure { file: String, msg: String },
    #[error("{path}: {msg}")]
    Invalid { path: String, msg: String },
}

/// Where a report lands: `<out_root>/<suite>/<UTC timestamp>/`; a second report in the same second
/// gets a `-2`, `-3`, ... suffix instead of replacing the first.
pub fn report_dir(out_root: &Path, suite: &str, stamp: &str) -> Result<PathBuf, ReportError> {
    crate::suite::runner::safe_component(suite).map_err(|why| ReportError::Invalid {
        path: out_root.display().to_string(),
        msg: format!("suite name `{suite}`: {why}"),
    })?;
    let base = out_root.join(suite);
    let mut dir = base.join(stamp);
    let mut n = 2;
    while dir.exists() {
        dir = base.join(format!("{stamp}-{n}"));
        n += 1;
    }
    Ok(dir)
}

/// The current UTC time as a folder name (`2026-12-02T14-30-05Z`: no `:` so it works everywhere).
pub fn stamp_now() -> String {
    crate::store::run::now_utc().replace(':', "-")
}

/// Write the report folder atomically (filled under a temp name, then renamed) and return the path
/// of its `index.html`. Figures are drawn in parallel.
pub fn write_report(input: &ReportInput<'_>, out_root: &Path) -> Result<PathBuf, ReportError> {
    let dir = report_dir(out_root, &input.comparison.suite, &stamp_now())?;
    atomic::write_dir(&dir, |tmp| -> Result<(), ReportError> {
        let figs = figures::draw_all(input, tmp)?;
        let page = html::page(input, &figs, tmp)?;
        atomic::write_file(&tmp.join("index.html"), page.as_bytes())?;
        Ok(())
    })?;
    Ok(dir.join("index.html"))
}

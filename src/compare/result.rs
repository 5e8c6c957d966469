//! What a comparison of a suite's configurations against its BF16 configuration produces. Plain,
//! serialisable data: `compare` computes it, `report` draws it, `nightly` turns it into a verdict,
//! Markdown and JUnit. Statistics are always computed on raw per-seed values, never on smoothed ones.

use serde::{Deserialize, Serialize};

/// The whole answer for one suite.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SuiteComparison {
    pub suite: String,
    /// The configuration everything is compared against (normally `bf16`).
    pub baseline_config: String,
    pub method: Method,
    pub configs: Vec<ConfigComparison>,
    /// Gradient-spike events found in the per-layer gradient norms (all configs, all seeds).
    pub spikes: Vec<Spike>,
    /// Checks declared in the suite, evaluated.
    pub checks: Vec<CheckResult>,
    /// Contract-check totals per configuration.
    pub contract: Vec<ContractRow>,
    pub overall: OverallVerdict,
    /// Runs left out (failed, not run yet, unreadable, stale) and similar, one line each.
    #[serde(default)]
    pub warnings: Vec<String>,
}

/// How the numbers were computed, so a reader of the report can judge them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Method {
    pub bootstrap_reps: usize,
    pub bootstrap_seed: u64,
    /// Two one-sided tests at this level (e.g. 0.05 → 90 % confidence interval against the margin).
    pub alpha: f64,
    /// Steps at the end of a run averaged for the final-window statistics.
    pub final_window: usize,
    pub spike_window: usize,
    pub spike_z: f64,
    pub spike_ratio: f64,
    /// Bootstrap resamples of the per-step bands.
    #[serde(default)]
    pub band_reps: usize,
    /// Power at which `seeds_needed` is computed.
    #[serde(default)]
    pub power: f64,
    /// Fewer seeds per arm than this: inconclusive.
    #[serde(default)]
    pub min_seeds: usize,
    /// One line per test used, in plain words.
    pub description: Vec<String>,
}

/// One configuration against the baseline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConfigComparison {
    pub config: String,
    pub seeds: Vec<u64>,
    pub metrics: Vec<MetricComparison>,
    /// The baseline group it was compared with (same sweep values when the baseline has them).
    #[serde(default)]
    pub baseline: String,
    /// Runs that diverged (their curves are included up to the divergence).
    #[serde(default)]
    pub diverged: usize,
    /// Runs that failed or did not finish (left out).
    #[serde(default)]
    pub failed: usize,
}

/// A curve with its band across seeds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Band {
    pub steps: Vec<usize>,
    pub mean: Vec<f64>,
    /// Bootstrap confidence band over seeds (lower, upper), same length as `steps`.
    pub lo: Vec<f64>,
    pub hi: Vec<f64>,
    /// The raw per-seed curves `(seed, values)`, so plots never hide the data.
    pub per_seed: Vec<(u64, Vec<f64>)>,
}

/// A difference with its confidence interval.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Interval {
    pub estimate: f64,
    pub lo: f64,
    pub hi: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Equivalent,
    Regressed,
    Improved,
    Inconclusive,
}

/// One metric of one configuration against the baseline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MetricComparison {
    /// Metric key, e.g. `rollout/raw_reward`.
    pub metric: String,
    /// Whether larger is better (reward) or smaller (KL, mismatch).
    pub higher_is_better: bool,
    pub curve: Band,
    pub baseline: Band,
    /// Final-window mean (config − baseline), Welch interval at 1 − 2·alpha (what the verdict uses).
    pub final_diff: Interval,
    /// The same difference with a stratified percentile bootstrap interval over seeds.
    #[serde(default)]
    pub final_diff_bootstrap: Interval,
    /// Area under the curve (config − baseline), per step.
    pub auc_diff: Interval,
    /// Interquartile mean of the config's final-window values.
    pub iqm: f64,
    /// Interquartile mean of the baseline's final-window values.
    #[serde(default)]
    pub baseline_iqm: f64,
    /// P(config run beats a baseline run), Mann-Whitney form.
    pub prob_improvement: f64,
    /// Equivalence margin used (absolute, in the metric's units); None: no margin set, no verdict.
    pub margin: Option<f64>,
    pub verdict: Verdict,
    /// Why, in words (e.g. "3 seeds cannot resolve a 0.05 margin: CI half-width 0.08").
    pub reason: String,
    /// Seeds per arm the margin needs at the stated power (None without a margin).
    #[serde(default)]
    pub seeds_needed: Option<usize>,
    /// For KL-type metrics: level, step-0 offset and drift.
    pub kl: Option<KlSummary>,
}

/// A KL-type metric split into a constant format offset and growth over the run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct KlSummary {
    pub level: f64,
    pub step0_offset: f64,
    /// Slope per step (least squares over steps), with its CI.
    pub drift: Interval,
    /// The configuration's own first value (step0_offset is relative to the baseline's).
    #[serde(default)]
    pub step0: f64,
    /// level − step0: growth over the run, separated from the constant offset.
    #[serde(default)]
    pub growth: f64,
    #[serde(default)]
    pub baseline_level: f64,
    #[serde(default)]
    pub baseline_drift: Interval,
}

/// A gradient spike found by the robust z-score or the ratio-to-rolling-max rule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Spike {
    pub config: String,
    pub seed: u64,
    pub step: usize,
    pub site: String,
    pub layer: i64,
    pub value: f64,
    /// value / rolling max of the preceding window.
    pub ratio: f64,
    /// Robust z-score of log grad norm against the rolling median/MAD.
    pub z: f64,
}

/// One declared check, evaluated.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckResult {
    /// The expression as written in the suite.
    pub expr: String,
    /// The configuration it was evaluated on.
    pub config: String,
    pub passed: bool,
    /// Left-hand side value, and the right-hand side it was held against.
    pub value: f64,
    pub threshold: f64,
    pub message: String,
    /// The check's name (its expression unless the suite named it).
    #[serde(default)]
    pub name: String,
}

/// Contract-check totals for one configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContractRow {
    pub config: String,
    pub runs: usize,
    pub steps_checked: usize,
    pub violations: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OverallVerdict {
    Pass,
    Regression,
    Inconclusive,
}

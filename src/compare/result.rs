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
    /// Spike rates of each configuration against its baseline, per site and layer.
    #[serde(default)]
    pub spike_rates: Vec<SpikeRate>,
    /// Checks declared in the suite, evaluated.
    pub checks: Vec<CheckResult>,
    /// The suite's published findings (`[[claims]]`), decided.
    #[serde(default)]
    pub claims: Vec<ClaimResult>,
    /// Contract-check totals per configuration.
    pub contract: Vec<ContractRow>,
    pub overall: OverallVerdict,
    /// The night's state in `nightly`'s words (`pass`, `pending`, `regression`, `inconclusive`,
    /// `error`) when it is known: `nightly` knows it, `compare` works it out from the suite's
    /// nights so far without recording tonight. Reports print this instead of `overall`, so a
    /// regression that has not yet repeated on enough nights reads PENDING everywhere.
    #[serde(default)]
    pub night_state: Option<String>,
    /// Runs left out (failed, not run yet, unreadable, stale) and similar, one line each.
    #[serde(default)]
    pub warnings: Vec<String>,
    /// What keeps the comparison from covering the whole suite (a planned run missing or failed,
    /// a configuration without usable steps, a needed metric never logged): the night is an
    /// error, not a verdict, while any is here.
    #[serde(default)]
    pub problems: Vec<Problem>,
}

/// A planned run or a configuration the comparison could not use, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Problem {
    pub config: String,
    /// The seed, for a run's problem (`None`: the whole configuration).
    pub seed: Option<u64>,
    /// The run id, for a run's problem (empty otherwise).
    pub run_id: String,
    pub what: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.seed {
            Some(s) => write!(
                f,
                "{} seed {} ({}): {}",
                self.config, s, self.run_id, self.what
            ),
            None => write!(f, "{}: {}", self.config, self.what),
        }
    }
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
    /// Consecutive failing nights before `nightly` alerts (1: the first).
    #[serde(default)]
    pub nights: usize,
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
///
/// In memory every step is kept. Written to `compare.json` (a band is only drawn from there, every
/// statistic and verdict is computed at full resolution before), a band is thinned and rounded:
/// longer than [`BAND_JSON_POINTS`] steps, it keeps that many evenly spaced steps (the first and
/// the last included), and its values keep [`BAND_JSON_DIGITS`] significant digits. At 1,000 runs
/// x 1,000 steps (`lockstep bench compare`) this took compare.json from 200 MB to 51 MB.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Band {
    /// Steps of the curve (in compare.json: at most [`BAND_JSON_POINTS`] of them, evenly spaced).
    pub steps: Vec<usize>,
    /// Mean over seeds at each step (in compare.json: [`BAND_JSON_DIGITS`] significant digits).
    pub mean: Vec<f64>,
    /// Bootstrap confidence band over seeds (lower, upper), same length as `steps` (in
    /// compare.json: thinned and rounded like `mean`).
    pub lo: Vec<f64>,
    pub hi: Vec<f64>,
    /// The raw per-seed curves `(seed, values)`, so plots never hide the data (in compare.json:
    /// the seed's raw values at the kept steps, rounded like `mean`).
    pub per_seed: Vec<(u64, Vec<f64>)>,
}

/// Most steps a band keeps in compare.json (a figure is at most about 1,000 pixels wide).
pub const BAND_JSON_POINTS: usize = 500;

/// Significant digits of band values in compare.json (relative error at most 5e-6).
pub const BAND_JSON_DIGITS: i32 = 6;

/// `n` indices thinned to at most `max` evenly spaced ones, the first and the last included.
pub fn thin_indices(n: usize, max: usize) -> Vec<usize> {
    if n <= max || max < 2 {
        return (0..n).collect();
    }
    (0..max).map(|i| i * (n - 1) / (max - 1)).collect()
}

/// `x` rounded to `digits` significant digits (exactly representable powers of ten only, so the
/// result is the double nearest the rounded decimal and prints as it); others are left as they are.
pub fn round_sig(x: f64, digits: i32) -> f64 {
    if !x.is_finite() || x == 0.0 {
        return x;
    }
    let k = digits - 1 - x.abs().log10().floor() as i32;
    let r = if (0..=22).contains(&k) {
        let p = 10f64.powi(k);
        (x * p).round() / p
    } else if (-22..0).contains(&k) {
        let p = 10f64.powi(-k);
        (x / p).round() * p
    } else {
        x
    };
    if r.is_finite() { r } else { x }
}

impl Serialize for Band {
    fn serialize<S: serde::Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Thinned {
            steps: Vec<usize>,
            mean: Vec<f64>,
            lo: Vec<f64>,
            hi: Vec<f64>,
            per_seed: Vec<(u64, Vec<f64>)>,
        }
        let idx = thin_indices(self.steps.len(), BAND_JSON_POINTS);
        let thin = |v: &[f64]| -> Vec<f64> {
            if v.len() == self.steps.len() {
                idx.iter()
                    .map(|&i| round_sig(v[i], BAND_JSON_DIGITS))
                    .collect()
            } else {
                // Not aligned with the steps (never written so): rounded, not thinned.
                v.iter().map(|&x| round_sig(x, BAND_JSON_DIGITS)).collect()
            }
        };
        Thinned {
            steps: idx.iter().map(|&i| self.steps[i]).collect(),
            mean: thin(&self.mean),
            lo: thin(&self.lo),
            hi: thin(&self.hi),
            per_seed: self.per_seed.iter().map(|(s, v)| (*s, thin(v))).collect(),
        }
        .serialize(ser)
    }
}

/// A difference with its confidence interval. A bound that does not exist (too few seeds, or a
/// rate ratio without baseline events) is NaN or infinite in memory and `null` in compare.json,
/// which reads back as NaN.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Interval {
    #[serde(deserialize_with = "null_as_nan")]
    pub estimate: f64,
    #[serde(deserialize_with = "null_as_nan")]
    pub lo: f64,
    #[serde(deserialize_with = "null_as_nan")]
    pub hi: f64,
}

/// serde_json writes a non-finite number as `null`; read it back as NaN instead of failing.
pub fn null_as_nan<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// A metric's verdict. With a margin: `equivalent`, `regressed`, `improved` or `inconclusive`.
/// Without one the metric is described, never left `inconclusive`: `higher`, `lower` (the whole
/// interval on one side of 0; for KL-type metrics the fold change's interval on one side of 1) or
/// `no_difference` (the interval holds 0: no difference detected, which is not a proof of none).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Equivalent,
    Regressed,
    Improved,
    Inconclusive,
    Higher,
    Lower,
    NoDifference,
}

impl Verdict {
    /// The verdict in words, as reports print it.
    pub fn words(self) -> &'static str {
        match self {
            Verdict::Equivalent => "equivalent",
            Verdict::Regressed => "regressed",
            Verdict::Improved => "improved",
            Verdict::Inconclusive => "inconclusive",
            Verdict::Higher => "higher",
            Verdict::Lower => "lower",
            Verdict::NoDifference => "no difference detected",
        }
    }
}

/// How the per-seed values of the two arms were compared.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Pairing {
    /// Seeds compared pairwise (both arms ran them).
    pub seeds: usize,
    /// Correlation of the two arms' per-seed values over those seeds (NaN for a constant arm).
    #[serde(deserialize_with = "null_as_nan")]
    pub correlation: f64,
    /// Welch's standard error over the paired one: how much the pairing narrows the interval.
    #[serde(deserialize_with = "null_as_nan")]
    pub se_ratio: f64,
    /// Seeds per arm two independent arms would need for the paired interval's width
    /// (`seeds · se_ratio²`); the pairing saved `effective_seeds - seeds` of them.
    #[serde(deserialize_with = "null_as_nan")]
    pub effective_seeds: f64,
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
    /// Present when the arms were compared seed by seed (same seeds, coupled by the engine);
    /// absent: Welch's two-sample comparison.
    #[serde(default)]
    pub pairing: Option<Pairing>,
    /// For KL-type and mismatch metrics without a margin: configuration / baseline as a fold
    /// change of the per-seed final-window values (geometric means), with its interval.
    #[serde(default)]
    pub fold: Option<Interval>,
    /// How the margin was set, in words, e.g. "10 % of bf16's gain over the run (0.23)".
    #[serde(default)]
    pub margin_rule: Option<String>,
}

/// Gradient spikes of one configuration against its baseline at one site and layer (or every
/// site, `site = "all"`, `layer = -1`), counted by compare's offline rule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SpikeRate {
    pub config: String,
    pub baseline: String,
    pub site: String,
    pub layer: i64,
    pub spikes: u64,
    /// Steps judged (those with enough history), summed over seeds.
    pub steps: u64,
    pub baseline_spikes: u64,
    pub baseline_steps: u64,
    /// Spikes per 1,000 judged steps above the baseline's.
    #[serde(deserialize_with = "null_as_nan")]
    pub excess_per_1k: f64,
    /// Rate ratio configuration / baseline with its exact (conditional binomial) interval.
    pub rate_ratio: Interval,
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

/// How a claim came out: `reproduced` (the predicate holds at the stated error rate),
/// `contradicted` (its opposite does) or `inconclusive` (neither, with the reason).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClaimVerdict {
    Reproduced,
    Contradicted,
    Inconclusive,
}

impl ClaimVerdict {
    pub fn words(self) -> &'static str {
        match self {
            ClaimVerdict::Reproduced => "reproduced",
            ClaimVerdict::Contradicted => "contradicted",
            ClaimVerdict::Inconclusive => "inconclusive",
        }
    }
}

/// A published finding held against the runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClaimResult {
    pub name: String,
    /// The published words.
    pub statement: String,
    /// Where it was published.
    pub source: String,
    /// The predicate's name as written (`equivalent`, `higher`, `fold_within`, ...).
    pub expect: String,
    /// The metric it is about (empty for spike-rate claims, which count gradient spikes).
    pub metric: String,
    /// The predicate in words, e.g. "train/train_rollout_kl higher than bf16".
    pub predicate: String,
    pub verdict: ClaimVerdict,
    /// The evidence in numbers, one line.
    pub evidence: String,
    /// A contradicted claim fails the night only when the suite says so (`gate = true`).
    pub gate: bool,
    /// One row per configuration (or one for a trend over a sweep).
    pub rows: Vec<ClaimEvidence>,
}

/// One configuration's part of a claim.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClaimEvidence {
    /// The configuration (for a trend: the sweep's configurations in order, joined by ` < `).
    pub config: String,
    /// What it is held against (empty for a trend).
    pub vs: String,
    /// Seeds of the configuration, and of `vs`, that the test used.
    pub seeds: Vec<u64>,
    pub vs_seeds: Vec<u64>,
    /// The test, named, e.g. "paired t, log scale".
    pub test: String,
    /// What `interval` measures: `difference`, `fold`, `rate ratio`, `fold per step`,
    /// `slope per step`.
    pub scale: String,
    /// Estimate and two-sided `1 - 2·alpha` interval on that scale.
    pub interval: Interval,
    pub verdict: ClaimVerdict,
    /// Holm-adjusted p-value of the test against the claim over the claim's rows (NaN: no test).
    #[serde(deserialize_with = "null_as_nan")]
    pub p_against: f64,
    pub reason: String,
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

impl SuiteComparison {
    /// The headline state in one vocabulary with `nightly` (`pass`, `pending`, `regression`,
    /// `inconclusive`, `error`): the night's state when known; otherwise the comparison's own
    /// verdict, except that a regression under a rule of several nights is `failing` (tonight
    /// fails; whether it alerts depends on the nights before, which only `nightly` records).
    pub fn headline_state(&self) -> String {
        if !self.problems.is_empty() {
            return "error".into();
        }
        if let Some(s) = &self.night_state {
            return s.clone();
        }
        match self.overall {
            OverallVerdict::Pass => "pass".into(),
            OverallVerdict::Inconclusive => "inconclusive".into(),
            OverallVerdict::Regression if self.method.nights > 1 => "failing".into(),
            OverallVerdict::Regression => "regression".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_bounds_survive_compare_json() {
        let i = Interval {
            estimate: f64::NAN,
            lo: 0.0,
            hi: f64::INFINITY,
        };
        let text = serde_json::to_string(&i).unwrap();
        assert_eq!(text, r#"{"estimate":null,"lo":0.0,"hi":null}"#);
        let back: Interval = serde_json::from_str(&text).unwrap();
        assert!(back.estimate.is_nan() && back.hi.is_nan() && back.lo == 0.0);
    }

    #[test]
    fn rounding_keeps_six_significant_digits() {
        assert_eq!(round_sig(0.123_456_789, 6), 0.123457);
        assert_eq!(round_sig(-1_234.567_89, 6), -1234.57);
        assert_eq!(round_sig(1.234_567_89e-3, 6), 0.00123457);
        assert_eq!(round_sig(123_456_789.0, 6), 123_457_000.0);
        assert_eq!(round_sig(0.5, 6), 0.5);
        assert!(round_sig(f64::NAN, 6).is_nan());
        assert_eq!(round_sig(f64::INFINITY, 6), f64::INFINITY);
        assert_eq!(round_sig(0.0, 6), 0.0);
        assert_eq!(
            serde_json::to_string(&round_sig(0.8123456789, 6)).unwrap(),
            "0.812346"
        );
    }

    #[test]
    fn long_bands_are_thinned_in_json_and_short_ones_are_not() {
        let band = |n: usize| Band {
            steps: (0..n).collect(),
            mean: (0..n).map(|i| i as f64 / 3.0).collect(),
            lo: vec![0.0; n],
            hi: vec![1.0; n],
            per_seed: vec![(7, (0..n).map(|i| i as f64).collect())],
        };
        let short = band(12);
        let back: Band = serde_json::from_str(&serde_json::to_string(&short).unwrap()).unwrap();
        assert_eq!(back.steps, short.steps);
        assert_eq!(back.mean[1], round_sig(1.0 / 3.0, BAND_JSON_DIGITS));
        let long = band(1000);
        let back: Band = serde_json::from_str(&serde_json::to_string(&long).unwrap()).unwrap();
        assert_eq!(back.steps.len(), BAND_JSON_POINTS);
        assert_eq!((back.steps[0], back.steps[BAND_JSON_POINTS - 1]), (0, 999));
        assert!(back.steps.windows(2).all(|w| w[0] < w[1]));
        for v in [&back.mean, &back.lo, &back.hi, &back.per_seed[0].1] {
            assert_eq!(v.len(), BAND_JSON_POINTS);
        }
        assert_eq!(
            back.per_seed[0].1[17], back.steps[17] as f64,
            "raw values at kept steps"
        );
    }
}

//! The suite's `[checks]` table: what is compared, against which margins, with which error rates,
//! and the declared checks. Every key has a default, so `[checks]` with only `margin = 0.05` works.
//!
//! ```toml
//! [checks]
//! baseline = "bf16"                  # configuration everything is compared against
//! margin = 0.05                      # equivalence margin of `primary`, in its units (absolute)
//! primary = "rollout/raw_reward"
//! metrics = ["rollout/raw_reward", "train/train_rollout_kl"]   # tracked (default: the usual six)
//! alpha = 0.05                       # error rate of each one-sided test (90 % intervals)
//! power = 0.8                        # chance to catch a regression of the margin's size
//! min_seeds = 3                      # fewer seeds per arm: inconclusive
//! final_window = 10                  # last steps averaged per seed
//! bootstrap_reps = 10000             # scalar intervals
//! band_reps = 1000                   # per-step band
//! bootstrap_seed = 0
//! spike_window = 20                  # gradient spikes: rolling window (steps)
//! spike_z = 6.0                      # robust z of log grad norm vs rolling median/MAD
//! spike_ratio = 10.0                 # value / rolling max
//! nights = 2                         # consecutive nightly regressions before alerting
//! inconclusive = "pass"              # or "fail": what nightly does with an inconclusive verdict
//! expr = ["max(train/train_rollout_kl) < 3e-3", "contract_violations == 0"]
//! [checks.margins]                   # per-metric margins (override `margin` for `primary`)
//! "eval/accuracy" = 0.1              # absolute, in the metric's units
//! "rollout/raw_reward" = { of_gain = 0.1 }   # keeps at least 90 % of BF16's gain over the run
//! "train/grad_norm" = { of_level = 0.2 }     # within 20 % of BF16's final-window level
//! [[checks.rule]]                    # a check limited to some configurations (globs)
//! expr = "spikes(site=\"*experts*\") <= 2"
//! configs = ["nvfp4*"]
//! [checks.golden]                    # baseline save/diff (golden values)
//! metrics = ["rollout/raw_reward", "train/grad_norm"]
//! tolerance = 0.0                    # absolute, all metrics (0: exact match)
//! rel_tolerance = 0.0                # relative to |baseline value|
//! allowed_outside = 0.0              # share of steps allowed outside before it fails
//! band_factor = 1.5                  # tolerance from repeated runs: factor x largest deviation seen
//! [checks.golden.tolerances]
//! "perf/step_time" = 0.5
//! ```

use super::expr::{self, Check, Names};
use crate::suite::spec::SuiteSpec;
use serde::Deserialize;
use std::collections::BTreeMap;

/// The tracked metrics when a suite names none (those present in the runs are compared).
pub const DEFAULT_METRICS: [&str; 6] = [
    "rollout/raw_reward",
    "eval/accuracy",
    "train/train_rollout_kl",
    "train/train_rollout_logprob_abs_diff",
    "train/kl_loss",
    "train/grad_norm",
];

/// The golden-value metrics when a suite names none: deterministic ones only (`perf/*` differs
/// between two runs of one seed).
pub const DEFAULT_GOLDEN_METRICS: [&str; 5] = [
    "rollout/raw_reward",
    "train/train_rollout_kl",
    "train/loss",
    "train/grad_norm",
    "eval/accuracy",
];

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ChecksToml {
    baseline: Option<String>,
    margin: Option<MarginToml>,
    primary: Option<String>,
    metrics: Option<Vec<String>>,
    higher_is_better: Option<Vec<String>>,
    alpha: Option<f64>,
    power: Option<f64>,
    min_seeds: Option<usize>,
    final_window: Option<usize>,
    bootstrap_reps: Option<usize>,
    band_reps: Option<usize>,
    bootstrap_seed: Option<u64>,
    spike_window: Option<usize>,
    spike_z: Option<f64>,
    spike_ratio: Option<f64>,
    spike_min_history: Option<usize>,
    spike_mad_floor: Option<f64>,
    nights: Option<usize>,
    inconclusive: Option<String>,
    #[serde(default)]
    expr: Vec<String>,
    #[serde(default)]
    margins: BTreeMap<String, MarginToml>,
    #[serde(default)]
    rule: Vec<RuleToml>,
    #[serde(default)]
    golden: Option<GoldenToml>,
    sequential: Option<SequentialToml>,
}

/// `[checks.sequential]`: `lockstep nightly` runs seeds in batches by default.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct SequentialToml {
    min_seeds: Option<usize>,
    max_seeds: Option<usize>,
    batch: Option<usize>,
}

/// A margin as written: a number (absolute) or a table with exactly one of `absolute`,
/// `of_level`, `of_gain`.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub(super) enum MarginToml {
    Absolute(f64),
    Rule(MarginRuleToml),
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct MarginRuleToml {
    absolute: Option<f64>,
    of_level: Option<f64>,
    of_gain: Option<f64>,
}

/// How a metric's equivalence margin is set. The relative kinds are turned into metric units from
/// the baseline's own runs in the same comparison (a plug-in: the margin is then treated as fixed,
/// which the report states).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MarginRule {
    /// In the metric's units (`margin = 0.05`).
    Absolute(f64),
    /// A fraction of the baseline's final-window level (`{ of_level = 0.05 }`: within 5 % of
    /// BF16's reward).
    OfLevel(f64),
    /// A fraction of the baseline's gain over the run, final window minus first window, oriented
    /// so that improving is a gain (`{ of_gain = 0.1 }`: keeps at least 90 % of BF16's gain).
    OfGain(f64),
}

impl MarginRule {
    fn value(self) -> f64 {
        match self {
            MarginRule::Absolute(v) | MarginRule::OfLevel(v) | MarginRule::OfGain(v) => v,
        }
    }

    /// A margin as written, checked: exactly one kind, a positive finite value. `Err` is the fix.
    pub(super) fn from_toml(m: MarginToml, metric: &str) -> Result<MarginRule, String> {
        let rule = match m {
            MarginToml::Absolute(v) => MarginRule::Absolute(v),
            MarginToml::Rule(r) => match (r.absolute, r.of_level, r.of_gain) {
                (Some(v), None, None) => MarginRule::Absolute(v),
                (None, Some(v), None) => MarginRule::OfLevel(v),
                (None, None, Some(v)) => MarginRule::OfGain(v),
                _ => {
                    return Err(format!(
                        "margin of `{metric}`: give exactly one of `absolute`, `of_level`, `of_gain`, e.g. {{ of_gain = 0.1 }}"
                    ));
                }
            },
        };
        let v = rule.value();
        if !(v.is_finite() && v > 0.0) {
            return Err(format!(
                "margin of `{metric}` is {v}: use a positive number (absolute: in the metric's units; of_level/of_gain: a fraction such as 0.1)"
            ));
        }
        Ok(rule)
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleToml {
    expr: String,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    configs: Vec<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct GoldenToml {
    metrics: Option<Vec<String>>,
    tolerance: Option<f64>,
    rel_tolerance: Option<f64>,
    allowed_outside: Option<f64>,
    band_factor: Option<f64>,
    #[serde(default)]
    tolerances: BTreeMap<String, f64>,
}

const KEYS: [&str; 25] = [
    "baseline",
    "margin",
    "primary",
    "metrics",
    "higher_is_better",
    "alpha",
    "power",
    "min_seeds",
    "final_window",
    "bootstrap_reps",
    "band_reps",
    "bootstrap_seed",
    "spike_window",
    "spike_z",
    "spike_ratio",
    "spike_min_history",
    "spike_mad_floor",
    "nights",
    "inconclusive",
    "expr",
    "margins",
    "rule",
    "golden",
    "tolerances",
    "sequential",
];

/// Gradient-spike rules.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpikeRule {
    /// Preceding steps the rolling median/MAD/max look at.
    pub window: usize,
    /// Robust z-score threshold (log grad norm).
    pub z: f64,
    /// Ratio-to-rolling-max threshold.
    pub ratio: f64,
    /// Steps of history needed before a step can be judged.
    pub min_history: usize,
    /// Smallest MAD (in log units) used, so a nearly constant series does not turn a 1 % wiggle
    /// into a huge z-score.
    pub mad_floor: f64,
}

impl Default for SpikeRule {
    fn default() -> Self {
        SpikeRule {
            window: 20,
            z: 6.0,
            ratio: 10.0,
            min_history: 10,
            mad_floor: 0.1,
        }
    }
}

/// One declared check.
#[derive(Debug, Clone)]
pub struct CheckSpec {
    pub name: String,
    pub check: Check,
    /// Configuration globs it applies to; empty: every configuration except the baseline.
    pub configs: Vec<String>,
}

/// Golden-value settings (`[checks.golden]`).
#[derive(Debug, Clone, PartialEq)]
pub struct GoldenSettings {
    pub metrics: Vec<String>,
    pub tolerance: f64,
    pub rel_tolerance: f64,
    pub allowed_outside: f64,
    pub band_factor: f64,
    pub tolerances: BTreeMap<String, f64>,
}

/// Sequential seeds (`nightly --seeds auto`, or `[checks.sequential]` in the suite): every
/// configuration starts with `min_seeds`; undecided ones get `batch` more per look, up to
/// `max_seeds`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SequentialPlan {
    pub min_seeds: usize,
    pub max_seeds: usize,
    pub batch: usize,
}

impl Default for SequentialPlan {
    fn default() -> Self {
        SequentialPlan {
            min_seeds: 3,
            max_seeds: 15,
            batch: 3,
        }
    }
}

impl SequentialPlan {
    /// The most seeds a plan may ask for: far past where any verdict needs more.
    pub const MOST_SEEDS: usize = 1000;

    /// Why the plan cannot run, if it cannot.
    pub fn check(&self) -> Result<(), String> {
        if !(1..=self.max_seeds).contains(&self.min_seeds)
            || self.batch == 0
            || self.max_seeds > Self::MOST_SEEDS
        {
            return Err(format!(
                "sequential seeds need 1 <= min_seeds ({}) <= max_seeds ({}) <= {} and batch ({}) >= 1",
                self.min_seeds,
                self.max_seeds,
                Self::MOST_SEEDS,
                self.batch
            ));
        }
        Ok(())
    }
}

/// Everything `compare` and `nightly` need from the suite.
#[derive(Debug, Clone)]
pub struct CompareSettings {
    pub baseline: String,
    pub primary: String,
    /// Tracked metrics; `None`: the defaults that are present in the runs.
    pub metrics: Option<Vec<String>>,
    /// Absolute margins, in each metric's units.
    pub margins: BTreeMap<String, f64>,
    /// Margins relative to the baseline (`of_level`, `of_gain`); a metric is in one map or the
    /// other.
    pub margin_rules: BTreeMap<String, MarginRule>,
    pub higher_is_better: Vec<String>,
    pub alpha: f64,
    pub power: f64,
    pub min_seeds: usize,
    pub final_window: usize,
    pub bootstrap_reps: usize,
    pub band_reps: usize,
    pub bootstrap_seed: u64,
    pub spikes: SpikeRule,
    pub nights: usize,
    pub inconclusive_fails: bool,
    pub checks: Vec<CheckSpec>,
    pub golden: GoldenSettings,
    /// `[checks.sequential]`: the suite's nights run seeds sequentially unless told otherwise.
    pub sequential: Option<SequentialPlan>,
    /// The suite's `[[claims]]`: published findings the comparison decides.
    pub claims: Vec<super::claims::ClaimSpec>,
}

impl Default for CompareSettings {
    fn default() -> Self {
        CompareSettings {
            baseline: "bf16".into(),
            primary: "rollout/raw_reward".into(),
            metrics: None,
            margins: BTreeMap::new(),
            margin_rules: BTreeMap::new(),
            higher_is_better: Vec::new(),
            alpha: 0.05,
            power: 0.8,
            min_seeds: 3,
            final_window: 10,
            bootstrap_reps: 10_000,
            band_reps: 1_000,
            bootstrap_seed: 0,
            spikes: SpikeRule::default(),
            nights: 1,
            inconclusive_fails: false,
            checks: Vec::new(),
            golden: GoldenSettings {
                metrics: DEFAULT_GOLDEN_METRICS
                    .iter()
                    .map(|s| s.to_string())
                    .collect(),
                tolerance: 0.0,
                rel_tolerance: 0.0,
                allowed_outside: 0.0,
                band_factor: 1.5,
                tolerances: BTreeMap::new(),
            },
            sequential: None,
            claims: Vec::new(),
        }
    }
}

impl CompareSettings {
    /// The absolute margin of a metric, if one is set.
    pub fn margin(&self, metric: &str) -> Option<f64> {
        self.margins.get(metric).copied()
    }

    /// How a metric's margin is set (absolute or relative to the baseline), if it has one.
    pub fn margin_rule(&self, metric: &str) -> Option<MarginRule> {
        self.margins
            .get(metric)
            .map(|m| MarginRule::Absolute(*m))
            .or_else(|| self.margin_rules.get(metric).copied())
    }

    /// Metrics with a margin of any kind.
    pub fn gated_metrics(&self) -> impl Iterator<Item = &String> {
        self.margins.keys().chain(self.margin_rules.keys())
    }

    /// Whether larger values are better: rewards, accuracies and throughputs, or anything listed in
    /// `higher_is_better`; KL, mismatch, loss and grad norms are better small.
    pub fn higher_is_better(&self, metric: &str) -> bool {
        self.higher_is_better.iter().any(|m| m == metric)
            || metric.ends_with("reward")
            || metric.ends_with("rewards")
            || metric.ends_with("accuracy")
            || metric.ends_with("tokens_per_s")
    }

    /// Constants an expression may name.
    pub fn constants(&self) -> Vec<(String, f64)> {
        let mut c = vec![
            ("alpha".to_string(), self.alpha),
            ("final_window".to_string(), self.final_window as f64),
        ];
        if let Some(m) = self.margin(&self.primary) {
            c.push(("margin".to_string(), m));
        }
        c
    }
}

/// A `[checks]` table or a `[[claims]]` entry that cannot be used: where (suite file, line when
/// found) and why.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{path}{line}: {table} {msg}")]
pub struct SettingsError {
    pub path: String,
    /// `:LINE:COL` when the offending text was found in the file, else empty.
    pub line: String,
    /// `[checks]` or `[[claims]]`.
    pub table: &'static str,
    pub msg: String,
}

/// Read the suite's `[checks]` table and its `[[claims]]` (this is part of `lockstep suite
/// check`).
pub fn from_spec(spec: &SuiteSpec) -> Result<CompareSettings, SettingsError> {
    let text = std::fs::read_to_string(&spec.path).unwrap_or_default();
    let configs: Vec<String> = spec.configs.iter().map(|c| c.name.clone()).collect();
    let path = spec.path.display().to_string();
    let mut s = from_table(&spec.checks, &configs, &path, &text)?;
    s.claims = super::claims::from_spec(spec, &configs, &s, &path, &text)?;
    Ok(s)
}

/// Read a `[checks]` table; `file_text` (the suite file, may be empty) locates errors by line.
pub fn from_table(
    table: &toml::Table,
    configs: &[String],
    path: &str,
    file_text: &str,
) -> Result<CompareSettings, SettingsError> {
    let err = |needle: Option<&str>, col_offset: usize, msg: String| SettingsError {
        path: path.to_string(),
        table: "[checks]",
        line: needle
            .and_then(|n| locate(file_text, n))
            .map(|(l, c)| format!(":{l}:{}", c + col_offset))
            .unwrap_or_default(),
        msg,
    };
    let t: ChecksToml =
        toml::Value::Table(table.clone())
            .try_into()
            .map_err(|e: toml::de::Error| {
                let msg = e.message().to_string();
                let field = msg
                    .split("unknown field `")
                    .nth(1)
                    .and_then(|r| r.split('`').next())
                    .map(str::to_string);
                let hint = field
                    .as_deref()
                    .and_then(|f| crate::recipe::presets::suggest(f, &KEYS))
                    .map(|s| format!(" (did you mean `{s}`?)"))
                    .unwrap_or_default();
                err(field.as_deref(), 0, format!("{msg}{hint}"))
            })?;
    let mut s = CompareSettings::default();
    let d = CompareSettings::default();
    s.baseline = t.baseline.unwrap_or(d.baseline);
    if !configs.is_empty() && !configs.contains(&s.baseline) {
        return Err(err(
            Some("baseline"),
            0,
            format!(
                "baseline = \"{}\" is not a configuration of this suite (have: {}); add a [[configs]] named `{}` or set checks.baseline",
                s.baseline,
                configs.join(", "),
                s.baseline
            ),
        ));
    }
    s.primary = t.primary.unwrap_or(d.primary);
    s.metrics = t.metrics;
    let mut margins = t.margins;
    if let Some(m) = t.margin {
        margins.entry(s.primary.clone()).or_insert(m);
    }
    for (k, m) in margins {
        let rule = MarginRule::from_toml(m, &k).map_err(|e| err(Some(&k), 0, e))?;
        match rule {
            MarginRule::Absolute(v) => {
                s.margins.insert(k, v);
            }
            r => {
                s.margin_rules.insert(k, r);
            }
        }
    }
    s.higher_is_better = t.higher_is_better.unwrap_or_default();
    s.alpha = t.alpha.unwrap_or(d.alpha);
    if !(s.alpha > 0.0 && s.alpha < 0.5) {
        return Err(err(
            Some("alpha"),
            0,
            format!("alpha = {}: use a level in (0, 0.5), e.g. 0.05", s.alpha),
        ));
    }
    s.power = t.power.unwrap_or(d.power);
    if !(s.power > 0.5 && s.power < 1.0) {
        return Err(err(
            Some("power"),
            0,
            format!("power = {}: use a value in (0.5, 1), e.g. 0.8", s.power),
        ));
    }
    s.min_seeds = t.min_seeds.unwrap_or(d.min_seeds).max(2);
    s.final_window = t.final_window.unwrap_or(d.final_window).max(1);
    s.bootstrap_reps = t.bootstrap_reps.unwrap_or(d.bootstrap_reps);
    s.band_reps = t.band_reps.unwrap_or(d.band_reps);
    s.bootstrap_seed = t.bootstrap_seed.unwrap_or(d.bootstrap_seed);
    s.spikes = SpikeRule {
        window: t.spike_window.unwrap_or(d.spikes.window).max(2),
        z: t.spike_z.unwrap_or(d.spikes.z),
        ratio: t.spike_ratio.unwrap_or(d.spikes.ratio),
        min_history: t.spike_min_history.unwrap_or(d.spikes.min_history).max(2),
        mad_floor: t.spike_mad_floor.unwrap_or(d.spikes.mad_floor),
    };
    s.nights = t.nights.unwrap_or(d.nights).max(1);
    s.inconclusive_fails = match t.inconclusive.as_deref() {
        None | Some("pass") => false,
        Some("fail") => true,
        Some(o) => {
            return Err(err(
                Some("inconclusive"),
                0,
                format!("inconclusive = \"{o}\": use \"pass\" or \"fail\""),
            ));
        }
    };
    if let Some(q) = t.sequential {
        let d = SequentialPlan::default();
        let plan = SequentialPlan {
            min_seeds: q.min_seeds.unwrap_or(d.min_seeds),
            max_seeds: q.max_seeds.unwrap_or(d.max_seeds),
            batch: q.batch.unwrap_or(d.batch),
        };
        plan.check().map_err(|e| err(Some("sequential"), 0, e))?;
        s.sequential = Some(plan);
    }
    if let Some(g) = t.golden {
        s.golden = GoldenSettings {
            metrics: g.metrics.unwrap_or(d.golden.metrics),
            tolerance: g.tolerance.unwrap_or(0.0),
            rel_tolerance: g.rel_tolerance.unwrap_or(0.0),
            allowed_outside: g.allowed_outside.unwrap_or(0.0),
            band_factor: g.band_factor.unwrap_or(1.5),
            tolerances: g.tolerances,
        };
    }
    let names = Names {
        configs: configs.to_vec(),
        baseline: s.baseline.clone(),
        constants: s.constants(),
    };
    let parse_one = |text: &str, name: Option<String>, globs: Vec<String>| {
        for g in &globs {
            crate::recipe::glob_matcher(g).map_err(|e| {
                err(
                    Some(g),
                    0,
                    format!("configs pattern `{}`: {e}", crate::recipe::shorten(g)),
                )
            })?;
        }
        let check = expr::parse(text, &names).map_err(|e| {
            err(
                Some(text),
                e.pos,
                format!("check `{}`: {e}", crate::recipe::shorten(text)),
            )
        })?;
        Ok::<CheckSpec, SettingsError>(CheckSpec {
            name: name.unwrap_or_else(|| text.to_string()),
            check,
            configs: globs,
        })
    };
    for e in &t.expr {
        s.checks.push(parse_one(e, None, Vec::new())?);
    }
    for r in t.rule {
        s.checks.push(parse_one(&r.expr, r.name, r.configs)?);
    }
    Ok(s)
}

/// 1-based line and column of the first occurrence of `needle` in `text`.
fn locate(text: &str, needle: &str) -> Option<(usize, usize)> {
    let at = text.find(needle)?;
    let line = text[..at].matches('\n').count() + 1;
    let col = at - text[..at].rfind('\n').map_or(0, |i| i + 1) + 1;
    Some((line, col))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(s: &str) -> toml::Table {
        toml::from_str(s).unwrap()
    }

    fn cfgs() -> Vec<String> {
        vec!["bf16".into(), "nvfp4-dq".into()]
    }

    #[test]
    fn defaults_and_margin_go_to_the_primary_metric() {
        let s = from_table(&table("margin = 0.05"), &cfgs(), "s.toml", "").unwrap();
        assert_eq!(s.margin("rollout/raw_reward"), Some(0.05));
        assert_eq!(s.margin("train/train_rollout_kl"), None);
        assert_eq!(
            (s.bootstrap_reps, s.alpha, s.baseline.as_str()),
            (10_000, 0.05, "bf16")
        );
        assert!(s.higher_is_better("eval/accuracy") && !s.higher_is_better("train/grad_norm"));
    }

    #[test]
    fn margins_may_be_relative_to_the_baseline() {
        let s = from_table(
            &table("margin = { of_gain = 0.1 }\n[margins]\n\"train/grad_norm\" = { of_level = 0.2 }\n\"eval/accuracy\" = { absolute = 0.03 }"),
            &cfgs(),
            "s.toml",
            "",
        )
        .unwrap();
        assert_eq!(
            s.margin_rule("rollout/raw_reward"),
            Some(MarginRule::OfGain(0.1))
        );
        assert_eq!(s.margin("rollout/raw_reward"), None, "not absolute");
        assert_eq!(
            s.margin_rule("train/grad_norm"),
            Some(MarginRule::OfLevel(0.2))
        );
        assert_eq!(s.margin("eval/accuracy"), Some(0.03));
        assert_eq!(s.gated_metrics().count(), 3);
        let e = from_table(
            &table("margin = { of_gain = 0.1, of_level = 0.1 }"),
            &cfgs(),
            "s.toml",
            "",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("exactly one of"), "{e}");
    }

    #[test]
    fn a_bad_expression_is_located_in_the_file() {
        let file = "name = \"x\"\n[checks]\nmargin = 0.05\nexpr = [\"max(train/kl) <\"]\n";
        let t: toml::Table = toml::from_str(file).unwrap();
        let checks = t["checks"].as_table().unwrap();
        let e = from_table(checks, &cfgs(), "s.toml", file)
            .unwrap_err()
            .to_string();
        // The expression starts at line 4, col 10 (after the quote); the error is at its byte 15.
        assert!(
            e.starts_with("s.toml:4:25: [checks] check `max(train/kl) <`"),
            "{e}"
        );
        assert!(e.contains("expression ends too early"), "{e}");
    }

    #[test]
    fn unknown_keys_and_bad_values_say_how_to_fix_them() {
        let e = from_table(&table("margn = 0.05"), &cfgs(), "s.toml", "")
            .unwrap_err()
            .to_string();
        assert!(e.contains("did you mean `margin`"), "{e}");
        let e = from_table(&table("baseline = \"fp32\""), &cfgs(), "s.toml", "")
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a configuration"), "{e}");
        let e = from_table(&table("alpha = 0.7"), &cfgs(), "s.toml", "")
            .unwrap_err()
            .to_string();
        assert!(e.contains("alpha"), "{e}");
        let s = from_table(
            &table("[[rule]]\nexpr = \"spikes(site=\\\"*experts*\\\") <= 2\"\nconfigs = [\"nvfp4*\"]\n"),
            &cfgs(),
            "s.toml",
            "",
        )
        .unwrap();
        assert_eq!(s.checks.len(), 1);
        assert_eq!(s.checks[0].configs, vec!["nvfp4*".to_string()]);
    }
}

//! The comparison procedure: group runs by configuration, compare every configuration with the
//! baseline configuration metric by metric (seed by seed when the built-in engine ran both on the
//! same seeds, else Welch; metrics without a margin described rather than judged), count gradient
//! spikes against the baseline, total the contract checks, evaluate the declared checks, and reach
//! one overall verdict. Pure over [`RunData`] except the two entry points that read a suite folder
//! or explicit run folders; [`sequential_looks`] is the per-look entry point for sequential seeds.

use super::claims::{self, ClaimArm, SeedValue, SiteSpikes};
use super::data::{self, RunData};
use super::expr::{self, Source};
use super::result::*;
use super::sequential::{SequentialDecision, SequentialPlan, SequentialVerdict};
use super::settings::{self, CompareSettings, DEFAULT_METRICS, MarginRule, SettingsError};
use super::spikes;
use super::stats::{self, Resampler};
use crate::io::IoError;
use crate::store::RunStatus;
use crate::suite::spec::{SuiteError, SuiteSpec};
use rayon::prelude::*;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Overrides for one comparison (the suite's `[checks]` gives the rest).
#[derive(Debug, Clone, Default)]
pub struct CompareOptions {
    /// Bootstrap resamples for the scalar intervals (default: the suite's, else 10,000).
    pub bootstrap_reps: Option<usize>,
    /// Bootstrap resamples for the per-step band (default: the suite's, else 1,000).
    pub band_reps: Option<usize>,
    /// Seed of the bootstrap (default: the suite's, else 0).
    pub seed: Option<u64>,
    /// Compare against this configuration instead of the suite's baseline.
    pub baseline: Option<String>,
}

/// Why a comparison could not be made.
#[derive(Debug, thiserror::Error)]
pub enum CompareError {
    #[error(transparent)]
    Io(#[from] IoError),
    #[error(transparent)]
    Settings(#[from] SettingsError),
    #[error(transparent)]
    Suite(#[from] SuiteError),
    #[error(
        "{dir}: no finished runs of suite `{suite}` here; run it first (`lockstep run SUITE.toml --store STORE`)"
    )]
    NoRuns { dir: String, suite: String },
    #[error(
        "no finished runs of the baseline configuration `{baseline}` (configurations with runs: {have}); run it, or pick another with [checks] baseline / --baseline"
    )]
    NoBaseline { baseline: String, have: String },
    #[error(transparent)]
    Plan(#[from] super::sequential::PlanError),
    #[error(
        "sequential seeds decide on `{metric}`, which has no margin; set [checks] margin (or [checks.margins] \"{metric}\")"
    )]
    NoMargin { metric: String },
}

/// Compare the runs of `spec` found in `suite_dir` (normally `<store>/<suite>`). Only runs of the
/// suite as it is now count: a folder left from an edited suite is ignored with a warning.
pub fn compare_suite(
    spec: &SuiteSpec,
    suite_dir: &Path,
    opts: &CompareOptions,
) -> Result<SuiteComparison, CompareError> {
    let planned = crate::suite::expand(spec)?;
    compare_planned(spec, &planned, suite_dir, opts)
}

/// [`compare_suite`] over an explicit run list: the runs a sequential night planned (each
/// configuration at its own seed count) instead of the suite's fixed seeds.
pub fn compare_planned(
    spec: &SuiteSpec,
    planned: &[crate::suite::RunSpec],
    suite_dir: &Path,
    opts: &CompareOptions,
) -> Result<SuiteComparison, CompareError> {
    let settings = settings::from_spec(spec)?;
    let mut warnings = Vec::new();
    let mut dirs = Vec::new();
    for r in planned {
        let d = suite_dir.join(&r.run_id);
        if d.join("manifest.json").is_file() {
            dirs.push(d);
        } else {
            warnings.push(format!(
                "{} seed {}: not run yet ({})",
                r.config, r.seed, r.run_id
            ));
        }
    }
    if let Ok(all) = data::run_dirs(suite_dir) {
        let stale: Vec<&std::path::PathBuf> = all.iter().filter(|d| !dirs.contains(d)).collect();
        if let Some(first) = stale.first() {
            warnings.push(format!(
                "skipped {} stale run folder(s) in {} (e.g. {}): not runs of the suite as it is now (an edited suite, or run ids of an older lockstep)",
                stale.len(),
                suite_dir.display(),
                first.file_name().map(|n| n.to_string_lossy()).unwrap_or_default()
            ));
        }
    }
    let wanted = wanted_metrics(&settings);
    let (mut runs, skipped) = data::load_runs(&dirs, wanted.as_ref());
    let unreadable: Vec<(String, String)> = planned
        .iter()
        .filter(|p| {
            let d = suite_dir.join(&p.run_id);
            dirs.contains(&d) && !runs.iter().any(|r| r.path == d)
        })
        .map(|p| {
            let why = skipped
                .iter()
                .find(|w| w.contains(&p.run_id))
                .cloned()
                .unwrap_or_else(|| "its files could not be read".into());
            (p.run_id.clone(), why)
        })
        .collect();
    warnings.extend(skipped);
    relabel(&mut runs, planned);
    if runs.is_empty() {
        return Err(CompareError::NoRuns {
            dir: suite_dir.display().to_string(),
            suite: spec.name.clone(),
        });
    }
    let problems = super::health::problems(planned, &runs, &unreadable, &settings);
    let mut out = compare_data(&spec.name, &runs, &settings, opts)?;
    warnings.append(&mut out.warnings);
    out.warnings = warnings;
    out.problems = problems;
    Ok(out)
}

/// Name each run after the planned run it is (configuration with sweep values, base, axes).
fn relabel(runs: &mut [RunData], planned: &[crate::suite::RunSpec]) {
    for run in runs {
        if let Some(p) = planned.iter().find(|p| p.run_id == run.run_id) {
            run.config = p.config.clone();
            run.base = p.base.clone();
            run.axes = p.axes.clone();
        }
    }
}

/// The planned runs found in `suite_dir` (finished or not), named after their plan, with the
/// metrics `settings` needs: what a sequential look reads between batches.
pub fn load_planned(
    planned: &[crate::suite::RunSpec],
    suite_dir: &Path,
    settings: &CompareSettings,
) -> Vec<RunData> {
    let dirs: Vec<std::path::PathBuf> = planned
        .iter()
        .map(|r| suite_dir.join(&r.run_id))
        .filter(|d| d.join("manifest.json").is_file())
        .collect();
    let (mut runs, _) = data::load_runs(&dirs, wanted_metrics(settings).as_ref());
    relabel(&mut runs, planned);
    runs
}

/// Compare explicit run folders (any store, any suite); configurations come from their manifests.
pub fn compare_runs(
    name: &str,
    dirs: &[PathBuf],
    settings: &CompareSettings,
    opts: &CompareOptions,
) -> Result<SuiteComparison, CompareError> {
    let wanted = wanted_metrics(settings);
    let (runs, skipped) = data::load_runs(dirs, wanted.as_ref());
    if runs.is_empty() {
        return Err(CompareError::NoRuns {
            dir: skipped.join("; "),
            suite: name.to_string(),
        });
    }
    let mut out = compare_data(name, &runs, settings, opts)?;
    out.warnings.splice(0..0, skipped);
    Ok(out)
}

/// The metric columns worth loading: tracked ones and those the checks read.
fn wanted_metrics(s: &CompareSettings) -> Option<BTreeSet<String>> {
    let mut w: BTreeSet<String> = match &s.metrics {
        Some(m) => m.iter().cloned().collect(),
        None => DEFAULT_METRICS.iter().map(|m| m.to_string()).collect(),
    };
    w.extend(s.gated_metrics().cloned());
    for c in &s.checks {
        w.extend(c.check.metrics());
    }
    w.extend(
        s.claims
            .iter()
            .filter(|c| !c.metric.is_empty())
            .map(|c| c.metric.clone()),
    );
    Some(w)
}

/// Runs of one configuration (one sweep point).
struct Group<'a> {
    config: String,
    base: String,
    axes: BTreeMap<String, String>,
    /// Usable runs, by seed.
    runs: Vec<&'a RunData>,
    diverged: usize,
    failed: usize,
}

fn group<'a>(runs: &'a [RunData]) -> Vec<Group<'a>> {
    let mut out: Vec<Group<'a>> = Vec::new();
    for r in runs {
        let i = match out.iter().position(|g| g.config == r.config) {
            Some(i) => i,
            None => {
                out.push(Group {
                    config: r.config.clone(),
                    base: r.base.clone(),
                    axes: r.axes.clone(),
                    runs: Vec::new(),
                    diverged: 0,
                    failed: 0,
                });
                out.len() - 1
            }
        };
        let g = &mut out[i];
        if r.usable() {
            g.runs.push(r);
        } else {
            g.failed += 1;
        }
        if r.status == RunStatus::Diverged {
            g.diverged += 1;
        }
    }
    for g in &mut out {
        g.runs.sort_by_key(|r| r.seed);
    }
    out
}

/// The error for a comparison whose baseline configuration has no usable run.
fn no_baseline(groups: &[Group<'_>], baseline: &str) -> CompareError {
    CompareError::NoBaseline {
        baseline: baseline.to_string(),
        have: groups
            .iter()
            .map(|g| g.config.as_str())
            .collect::<Vec<_>>()
            .join(", "),
    }
}

/// The settings with the options applied.
fn effective(settings: &CompareSettings, opts: &CompareOptions) -> CompareSettings {
    let mut s = settings.clone();
    if let Some(r) = opts.bootstrap_reps {
        s.bootstrap_reps = r;
    }
    if let Some(r) = opts.band_reps {
        s.band_reps = r;
    }
    if let Some(r) = opts.seed {
        s.bootstrap_seed = r;
    }
    if let Some(b) = &opts.baseline {
        s.baseline = b.clone();
    }
    s
}

/// Compare runs already in memory. Deterministic: the same runs, settings and seed give the same
/// result whatever the thread count (each bootstrap draws from its own stream keyed by
/// configuration and metric).
pub fn compare_data(
    suite: &str,
    runs: &[RunData],
    settings: &CompareSettings,
    opts: &CompareOptions,
) -> Result<SuiteComparison, CompareError> {
    let s = effective(settings, opts);
    let groups = group(runs);
    let mut warnings = Vec::new();
    for g in &groups {
        if g.failed > 0 {
            warnings.push(format!(
                "{}: {} run(s) failed or unfinished, left out",
                g.config, g.failed
            ));
        }
    }
    let baselines: Vec<usize> = (0..groups.len())
        .filter(|&i| groups[i].base == s.baseline && !groups[i].runs.is_empty())
        .collect();
    if baselines.is_empty() {
        return Err(no_baseline(&groups, &s.baseline));
    }
    let metrics = tracked_metrics(&s, runs);
    // Bands for every (group, metric), computed once (a baseline's band is reused by every config).
    let keys: Vec<(usize, &String)> = (0..groups.len())
        .flat_map(|g| metrics.iter().map(move |m| (g, m)))
        .collect();
    let bands: BTreeMap<(usize, String), Arm> = keys
        .par_iter()
        .map(|&(g, m)| ((g, m.clone()), Arm::build(&groups[g], m, &s)))
        .collect();
    let others: Vec<usize> = (0..groups.len())
        .filter(|i| groups[*i].base != s.baseline)
        .collect();
    let configs: Vec<ConfigComparison> = others
        .par_iter()
        .map(|&gi| {
            let g = &groups[gi];
            let bi = baselines
                .iter()
                .copied()
                .find(|&b| groups[b].axes == g.axes)
                .or_else(|| {
                    baselines
                        .iter()
                        .copied()
                        .find(|&b| groups[b].axes.is_empty())
                })
                .unwrap_or(baselines[0]);
            let coupled = g
                .runs
                .iter()
                .chain(&groups[bi].runs)
                .all(|r| r.engine == COUPLING_ENGINE);
            let seeds_of = |g: &Group<'_>| g.runs.iter().map(|r| r.seed).collect::<Vec<_>>();
            let (own, base) = (seeds_of(g), seeds_of(&groups[bi]));
            let differ = coupled && own != base;
            let common = common_seeds(&own, &base).len();
            let metrics = metrics
                .iter()
                .filter_map(|m| {
                    let (x, y) = (&bands[&(gi, m.clone())], &bands[&(bi, m.clone())]);
                    (!x.seeds.is_empty() && !y.seeds.is_empty())
                        .then(|| compare_metric(m, x, y, &s, &g.config, coupled))
                })
                .collect();
            let note = (differ && common < min_common_seeds(&s)).then(|| {
                format!(
                    "{}: seeds {own:?} share {common} with {}'s {base:?} (fewer than {}), so it is compared by Welch's test instead of seed by seed; run the same seeds to pair them",
                    g.config,
                    groups[bi].config,
                    min_common_seeds(&s),
                )
            });
            let cc = ConfigComparison {
                config: g.config.clone(),
                seeds: g.runs.iter().map(|r| r.seed).collect(),
                metrics,
                baseline: groups[bi].config.clone(),
                diverged: g.diverged,
                failed: g.failed,
            };
            (cc, note)
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|(cc, note)| {
            warnings.extend(note);
            cc
        })
        .collect();
    let spikes = find_spikes(&groups, &s);
    let spike_rates = spike_rates(&groups, &configs, &spikes, &s);
    let contract = groups
        .iter()
        .map(|g| ContractRow {
            config: g.config.clone(),
            runs: g.runs.len(),
            steps_checked: g.runs.iter().map(|r| r.contract_steps).sum(),
            violations: g.runs.iter().map(|r| r.contract_violations).sum(),
        })
        .collect();
    let checks = run_checks(&groups, &spikes, &s);
    let claims = if s.claims.is_empty() {
        Vec::new()
    } else {
        claims::evaluate(&s.claims, &claim_arms(&groups, &spikes, &s), &s)
    };
    let overall = overall(&configs, &checks, &claims, &s);
    Ok(SuiteComparison {
        suite: suite.to_string(),
        baseline_config: s.baseline.clone(),
        method: method(&s),
        configs,
        spikes,
        spike_rates,
        checks,
        claims,
        contract,
        overall,
        night_state: None,
        warnings,
        problems: Vec::new(),
    })
}

/// Make each configuration's primary-metric verdict the sequential procedure's decision (the
/// fixed-sample test on the seeds a sequential night happened to reach would not hold its error
/// rates): equivalent or regressed as decided, inconclusive when undecided at the last look, with
/// the look's interval and reason.
pub fn apply_sequential(cmp: &mut SuiteComparison, looks: &[SequentialLook], s: &CompareSettings) {
    let primary = s.primary.as_str();
    for c in &mut cmp.configs {
        let Some(look) = looks.iter().find(|l| l.config == c.config) else {
            continue;
        };
        let Some(m) = c.metrics.iter_mut().find(|m| m.metric == primary) else {
            continue;
        };
        let d = &look.decision;
        m.verdict = match d.verdict {
            SequentialVerdict::Equivalent => Verdict::Equivalent,
            SequentialVerdict::Regressed => Verdict::Regressed,
            SequentialVerdict::Continue | SequentialVerdict::Inconclusive => Verdict::Inconclusive,
        };
        m.final_diff = d.interval;
        m.seeds_needed = d.seeds_needed;
        m.reason = format!(
            "sequential seeds: {} at {} seeds per arm ({}, error spent {:.3} of {:.3}): {}",
            m.verdict.words(),
            d.seeds,
            if look.paired { "paired" } else { "Welch" },
            d.spent_alpha,
            cmp.method.alpha,
            d.reason
        );
    }
    cmp.overall = overall(&cmp.configs, &cmp.checks, &cmp.claims, s);
}

/// One configuration's sequential look on the primary metric.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SequentialLook {
    pub config: String,
    pub baseline: String,
    /// Compared seed by seed (same seeds on the built-in engine), else Welch.
    pub paired: bool,
    pub decision: SequentialDecision,
}

/// The entry point for sequential seeds (`--seeds auto`): given every usable run of the suite so
/// far, decide each configuration on the primary metric with the group-sequential procedure of
/// [`super::sequential`] (looks at `min_seeds`, then every `batch`, up to `max_seeds` seeds per
/// arm). A runner runs seeds `0..min_seeds` of every configuration, calls this, and runs the next
/// batch only for the configurations whose decision is `continue` (and their baseline), up to
/// `next_seeds`; the error rates hold when it looks only at the planned counts. The baseline runs
/// every seed any configuration still needs. A relative margin is resolved from the baseline's
/// runs at each look.
pub fn sequential_looks(
    runs: &[RunData],
    settings: &CompareSettings,
    min_seeds: usize,
    max_seeds: usize,
    batch: usize,
) -> Result<Vec<SequentialLook>, CompareError> {
    let s = settings;
    let metric = s.primary.clone();
    let Some(rule) = s.margin_rule(&metric) else {
        return Err(CompareError::NoMargin { metric });
    };
    let groups = group(runs);
    let Some(bi) = groups
        .iter()
        .position(|g| g.base == s.baseline && !g.runs.is_empty())
    else {
        return Err(no_baseline(&groups, &s.baseline));
    };
    let hib = s.higher_is_better(&metric);
    let mut out = Vec::new();
    for (gi, g) in groups.iter().enumerate() {
        if g.base == s.baseline {
            continue;
        }
        let b = groups
            .iter()
            .position(|b| b.base == s.baseline && b.axes == g.axes)
            .unwrap_or(bi);
        // Only the seeds both arms ran are looked at, so the arms stay at the same planned
        // count and pair up seed by seed.
        let mut x = Arm::build(&groups[gi], &metric, s);
        let mut y = Arm::build(&groups[b], &metric, s);
        let common = common_seeds(&x.seeds, &y.seeds);
        x.keep_seeds(&common);
        y.keep_seeds(&common);
        let margin = match resolve_margin(rule, &y.finals, &y.initials, hib, &s.baseline) {
            Ok((m, _)) => m,
            Err(_) => f64::NAN,
        };
        let coupled = g
            .runs
            .iter()
            .chain(&groups[b].runs)
            .all(|r| r.engine == COUPLING_ENGINE);
        let paired = coupled && x.seeds == y.seeds;
        let decision = if margin.is_finite() {
            let plan =
                SequentialPlan::new(s.alpha, s.power, margin, hib, min_seeds, max_seeds, batch)?;
            plan.decide(&x.finals, &y.finals, paired)
        } else {
            SequentialDecision {
                verdict: SequentialVerdict::Inconclusive,
                seeds: x.finals.len().min(y.finals.len()),
                next_seeds: None,
                interval: difference(&x.finals, &y.finals, paired, s.alpha),
                nominal_alpha: 0.0,
                spent_alpha: 0.0,
                seeds_needed: None,
                reason: resolve_margin(rule, &y.finals, &y.initials, hib, &s.baseline)
                    .err()
                    .unwrap_or_default(),
            }
        };
        out.push(SequentialLook {
            config: g.config.clone(),
            baseline: groups[b].config.clone(),
            paired,
            decision,
        });
    }
    Ok(out)
}

/// Tracked metrics present in at least one run.
fn tracked_metrics(s: &CompareSettings, runs: &[RunData]) -> Vec<String> {
    let mut want: Vec<String> = match &s.metrics {
        Some(m) => m.clone(),
        None => DEFAULT_METRICS.iter().map(|m| m.to_string()).collect(),
    };
    for m in s.gated_metrics() {
        if !want.contains(m) {
            want.push(m.clone());
        }
    }
    want.into_iter()
        .filter(|m| {
            runs.iter()
                .any(|r| r.metrics.get(m).is_some_and(|v| !v.is_empty()))
        })
        .collect()
}

/// One configuration's runs reduced for one metric.
struct Arm {
    seeds: Vec<u64>,
    /// Per seed, finite `(step, value)` points.
    points: Vec<Vec<(usize, f64)>>,
    /// Per seed, the mean over the final window.
    finals: Vec<f64>,
    /// Per seed, the mean over the first window (as many steps as the final one).
    initials: Vec<f64>,
    band: Band,
}

impl Arm {
    fn build(g: &Group<'_>, metric: &str, s: &CompareSettings) -> Arm {
        let mut seeds = Vec::new();
        let mut points = Vec::new();
        for r in &g.runs {
            let p: Vec<(usize, f64)> = r
                .metrics
                .get(metric)
                .map(|v| v.iter().copied().filter(|(_, x)| x.is_finite()).collect())
                .unwrap_or_default();
            if !p.is_empty() {
                seeds.push(r.seed);
                points.push(p);
            }
        }
        let finals = points
            .iter()
            .map(|p| final_mean(p, s.final_window))
            .collect();
        let initials = points
            .iter()
            .map(|p| first_mean(p, s.final_window))
            .collect();
        // The band is over the steps every seed has (sorted, distinct).
        let mut common: Option<Vec<usize>> = None;
        for p in &points {
            let st = sorted_steps(p);
            common = Some(match common {
                None => st,
                Some(c) => intersect_sorted(&c, &st),
            });
        }
        let steps: Vec<usize> = common.unwrap_or_default();
        let per_seed: Vec<(u64, Vec<f64>)> = seeds
            .iter()
            .zip(&points)
            .map(|(sd, p)| (*sd, values_at(p, &steps)))
            .collect();
        let flat: Vec<f64> = per_seed
            .iter()
            .flat_map(|(_, v)| v.iter().copied())
            .collect();
        let mut rs = Resampler::new(stream_seed(s.bootstrap_seed, &g.config, metric, 1));
        let (mean, lo, hi) = rs.band(&flat, per_seed.len(), steps.len(), s.band_reps, s.alpha);
        Arm {
            seeds,
            points,
            finals,
            initials,
            band: Band {
                steps,
                mean,
                lo,
                hi,
                per_seed,
            },
        }
    }
}

impl Arm {
    /// Keep the per-seed values of these seeds only (the curves and band stay as built).
    fn keep_seeds(&mut self, seeds: &[u64]) {
        let keep: Vec<usize> = (0..self.seeds.len())
            .filter(|&i| seeds.contains(&self.seeds[i]))
            .collect();
        self.finals = keep.iter().map(|&i| self.finals[i]).collect();
        self.initials = keep.iter().map(|&i| self.initials[i]).collect();
        self.seeds = keep.iter().map(|&i| self.seeds[i]).collect();
    }
}

/// The distinct steps of a series in ascending order (already so for a step-ordered series, which
/// then costs one pass).
fn sorted_steps(p: &[(usize, f64)]) -> Vec<usize> {
    let mut st: Vec<usize> = p.iter().map(|x| x.0).collect();
    if !st.windows(2).all(|w| w[0] < w[1]) {
        st.sort_unstable();
        st.dedup();
    }
    st
}

/// Intersection of two ascending, distinct step lists.
fn intersect_sorted(a: &[usize], b: &[usize]) -> Vec<usize> {
    if a == b {
        return a.to_vec();
    }
    let mut out = Vec::with_capacity(a.len().min(b.len()));
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                out.push(a[i]);
                i += 1;
                j += 1;
            }
        }
    }
    out
}

/// Values of a step-ordered series at the given (sorted) steps, which it is known to contain.
fn values_at(p: &[(usize, f64)], steps: &[usize]) -> Vec<f64> {
    if p.len() == steps.len() {
        return p.iter().map(|x| x.1).collect();
    }
    let mut out = Vec::with_capacity(steps.len());
    let mut i = 0;
    for &st in steps {
        while i < p.len() && p[i].0 < st {
            i += 1;
        }
        out.push(p.get(i).map_or(f64::NAN, |x| x.1));
    }
    out
}

/// Mean of the points within the last `window` steps of the series.
pub fn final_mean(p: &[(usize, f64)], window: usize) -> f64 {
    let Some(last) = p.last().map(|x| x.0) else {
        return f64::NAN;
    };
    let from = (last + 1).saturating_sub(window);
    let v: Vec<f64> = p.iter().filter(|x| x.0 >= from).map(|x| x.1).collect();
    stats::mean(&v)
}

/// Mean of the points within the first `window` steps of the series.
pub fn first_mean(p: &[(usize, f64)], window: usize) -> f64 {
    let Some(first) = p.first().map(|x| x.0) else {
        return f64::NAN;
    };
    let v: Vec<f64> = p
        .iter()
        .filter(|x| x.0 < first + window)
        .map(|x| x.1)
        .collect();
    stats::mean(&v)
}

/// A bootstrap stream per (configuration, metric, purpose), independent of evaluation order.
fn stream_seed(seed: u64, config: &str, metric: &str, purpose: u64) -> u64 {
    use sha2::{Digest, Sha256};
    let h: [u8; 32] =
        Sha256::digest(format!("{seed}\u{0}{config}\u{0}{metric}\u{0}{purpose}").as_bytes()).into();
    u64::from_le_bytes([h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]])
}

/// KL-type and mismatch metrics: positive, spread multiplicatively, compared as fold changes.
pub(crate) fn is_kl_type(metric: &str) -> bool {
    let m = metric.to_ascii_lowercase();
    m.contains("kl")
        || m.contains("logprob_abs_diff")
        || m.contains("prob_error")
        || m.contains("probs_diff")
}

/// The engine whose configurations of one seed are coupled (see [`crate::engine::trainer`]: the
/// warm start, each step's prompts and the sampler's random stream depend on the seed only), so
/// its arms are compared seed by seed.
pub const COUPLING_ENGINE: &str = "builtin";

/// The paired values of two arms: per seed both ran, `(x, y)` in `x`'s seed order. `None` when
/// they share fewer than two seeds, or, where their seed sets differ, fewer than
/// [`min_common_seeds`].
fn pair_up(
    x: &Arm,
    y: &Arm,
    s: &CompareSettings,
    values: fn(&Arm) -> &Vec<f64>,
) -> Option<(Vec<f64>, Vec<f64>)> {
    if x.seeds == y.seeds {
        return (x.seeds.len() >= 2).then(|| (values(x).clone(), values(y).clone()));
    }
    let common = common_seeds(&x.seeds, &y.seeds);
    if common.len() < min_common_seeds(s) {
        return None;
    }
    let at = |a: &Arm| -> Vec<f64> {
        let v = values(a);
        common
            .iter()
            .filter_map(|sd| a.seeds.iter().position(|t| t == sd).map(|i| v[i]))
            .collect()
    };
    Some((at(x), at(y)))
}

/// Seeds two arms must share to be paired over them when their seed sets differ (sequential seeds
/// leave the baseline with more): below this, Welch over each arm's own seeds. The claims use
/// the same rule (`compare::claims`).
fn min_common_seeds(s: &CompareSettings) -> usize {
    s.min_seeds.max(2)
}

/// The seeds of `x` that `y` also ran, in `x`'s order.
fn common_seeds(x: &[u64], y: &[u64]) -> Vec<u64> {
    x.iter().copied().filter(|sd| y.contains(sd)).collect()
}

/// A margin rule turned into metric units from the baseline's per-seed final-window and
/// first-window values, with its description; `Err`
/// says why it cannot be (the baseline did not gain, or has no level).
pub(crate) fn resolve_margin(
    rule: MarginRule,
    finals: &[f64],
    initials: &[f64],
    higher_is_better: bool,
    baseline: &str,
) -> Result<(f64, String), String> {
    let f = expr::fmt_num;
    match rule {
        MarginRule::Absolute(m) => Ok((m, format!("absolute {}", f(m)))),
        MarginRule::OfLevel(r) => {
            let level = stats::mean(finals).abs();
            if level.is_finite() && level > 0.0 {
                Ok((
                    r * level,
                    format!(
                        "{} % of {baseline}'s final-window level {} = {}",
                        f(100.0 * r),
                        f(level),
                        f(r * level)
                    ),
                ))
            } else {
                Err(format!(
                    "{baseline}'s final-window level is {}: a margin relative to it is undefined; set an absolute margin",
                    f(level)
                ))
            }
        }
        MarginRule::OfGain(r) => {
            let sign = if higher_is_better { 1.0 } else { -1.0 };
            let gain = sign * (stats::mean(finals) - stats::mean(initials));
            if gain.is_finite() && gain > 0.0 {
                Ok((
                    r * gain,
                    format!(
                        "{} % of {baseline}'s gain over the run {} = {} (keeps at least {} % of it)",
                        f(100.0 * r),
                        f(gain),
                        f(r * gain),
                        f(100.0 * (1.0 - r))
                    ),
                ))
            } else {
                Err(format!(
                    "{baseline} did not gain over the run (final minus first window {}): a margin relative to its gain is undefined; run longer or set an absolute margin",
                    f(gain)
                ))
            }
        }
    }
}

fn compare_metric(
    metric: &str,
    x: &Arm,
    y: &Arm,
    s: &CompareSettings,
    config: &str,
    coupled: bool,
) -> MetricComparison {
    let hib = s.higher_is_better(metric);
    let rule = s.margin_rule(metric);
    let resolved = rule.map(|r| resolve_margin(r, &y.finals, &y.initials, hib, &s.baseline));
    let margin = resolved.as_ref().and_then(|r| r.as_ref().ok()).map(|r| r.0);
    let margin_rule = resolved.as_ref().map(|r| match r {
        Ok((_, t)) => t.clone(),
        Err(e) => e.clone(),
    });
    let paired = if coupled {
        pair_up(x, y, s, |a| &a.finals)
    } else {
        None
    };
    let (xs, ys) = paired
        .clone()
        .unwrap_or_else(|| (x.finals.clone(), y.finals.clone()));
    let pairing = paired.as_ref().map(|(a, b)| pairing_of(a, b));
    let mut fold = None;
    let d = match (&resolved, rule) {
        (Some(Err(e)), _) => Decision {
            verdict: Verdict::Inconclusive,
            reason: e.clone(),
            interval: difference(&xs, &ys, paired.is_some(), s.alpha),
            seeds_needed: None,
        },
        (_, Some(_)) => decide(&xs, &ys, margin, hib, paired.is_some(), s),
        (_, None) => {
            let positive = xs.iter().chain(&ys).all(|v| *v > 0.0);
            if is_kl_type(metric) && positive && xs.len().min(ys.len()) >= 2 {
                let (lx, ly): (Vec<f64>, Vec<f64>) = (
                    xs.iter().map(|v| v.ln()).collect(),
                    ys.iter().map(|v| v.ln()).collect(),
                );
                let log = difference(&lx, &ly, paired.is_some(), s.alpha);
                fold = Some(stats::exp_interval(log));
                describe_fold(
                    metric,
                    &s.baseline,
                    log,
                    difference(&xs, &ys, paired.is_some(), s.alpha),
                    s,
                )
            } else {
                describe(&xs, &ys, paired.is_some(), s)
            }
        }
    };
    let mut rs = Resampler::new(stream_seed(s.bootstrap_seed, config, metric, 2));
    let final_boot = if paired.is_some() {
        rs.paired_interval(&xs, &ys, s.bootstrap_reps, s.alpha, stats::mean)
    } else {
        rs.diff_interval(&x.finals, &y.finals, s.bootstrap_reps, s.alpha, stats::mean)
    };
    // Area under the curve per step over the steps both arms share.
    let common: BTreeSet<usize> = x
        .band
        .steps
        .iter()
        .copied()
        .collect::<BTreeSet<_>>()
        .intersection(&y.band.steps.iter().copied().collect())
        .copied()
        .collect();
    let same_steps = x.band.steps == y.band.steps;
    let auc = |a: &Arm| -> Vec<f64> {
        if same_steps && a.points.iter().all(|p| p.len() == a.band.steps.len()) {
            return a
                .points
                .iter()
                .map(|p| stats::mean(&p.iter().map(|q| q.1).collect::<Vec<_>>()))
                .collect();
        }
        a.points
            .iter()
            .map(|p| {
                stats::mean(
                    &p.iter()
                        .filter(|q| common.contains(&q.0))
                        .map(|q| q.1)
                        .collect::<Vec<_>>(),
                )
            })
            .collect()
    };
    let auc_diff = rs.diff_interval(&auc(x), &auc(y), s.bootstrap_reps, s.alpha, stats::mean);
    let kl = is_kl_type(metric).then(|| kl_summary(x, y, s));
    MetricComparison {
        metric: metric.to_string(),
        higher_is_better: hib,
        curve: x.band.clone(),
        baseline: y.band.clone(),
        final_diff: d.interval,
        final_diff_bootstrap: final_boot,
        auc_diff,
        iqm: stats::iqm(&x.finals),
        baseline_iqm: stats::iqm(&y.finals),
        prob_improvement: stats::prob_improvement(&x.finals, &y.finals, hib),
        margin,
        verdict: d.verdict,
        reason: d.reason,
        seeds_needed: d.seeds_needed,
        kl,
        pairing,
        fold,
        margin_rule,
    }
}

/// The difference `mean(x) - mean(y)` with its interval at `1 - 2·alpha`: paired t over the
/// seeds' differences, or Welch.
fn difference(x: &[f64], y: &[f64], paired: bool, alpha: f64) -> Interval {
    if paired {
        stats::paired_interval(x, y, alpha)
    } else {
        stats::welch_interval(x, y, alpha)
    }
}

/// What pairing gave: the arms' correlation, and Welch's standard error over the paired one.
fn pairing_of(x: &[f64], y: &[f64]) -> Pairing {
    let (_, se_p, _) = stats::paired(x, y);
    let (_, se_w, _) = stats::welch(x, y);
    let ratio = se_w / se_p;
    Pairing {
        seeds: x.len(),
        correlation: stats::correlation(x, y),
        se_ratio: ratio,
        effective_seeds: x.len() as f64 * ratio * ratio,
    }
}

/// A metric without a margin, described: `higher` or `lower` when the interval excludes 0,
/// otherwise `no difference detected`.
pub fn describe(x: &[f64], y: &[f64], paired: bool, s: &CompareSettings) -> Decision {
    let i = difference(x, y, paired, s.alpha);
    let f = expr::fmt_num;
    let ci = format!("{} [{}, {}]", f(i.estimate), f(i.lo), f(i.hi));
    let level = 100.0 * (1.0 - 2.0 * s.alpha);
    let (verdict, reason) = if !(i.lo.is_finite() && i.hi.is_finite()) {
        (
            Verdict::NoDifference,
            format!(
                "no difference detected: difference {ci}, too few seeds for an interval (no margin set: descriptive)"
            ),
        )
    } else if i.lo > 0.0 {
        (
            Verdict::Higher,
            format!(
                "higher by {} [{}, {}] ({level:.0} % interval; no margin set: descriptive)",
                f(i.estimate),
                f(i.lo),
                f(i.hi)
            ),
        )
    } else if i.hi < 0.0 {
        (
            Verdict::Lower,
            format!(
                "lower by {} [{}, {}] ({level:.0} % interval; no margin set: descriptive)",
                f(-i.estimate),
                f(-i.hi),
                f(-i.lo)
            ),
        )
    } else {
        (
            Verdict::NoDifference,
            format!(
                "no difference detected: difference {ci} ({level:.0} % interval holds 0; no margin set: descriptive)"
            ),
        )
    };
    Decision {
        verdict,
        reason,
        interval: i,
        seeds_needed: None,
    }
}

/// A KL-type metric without a margin, described as a fold change over the baseline: the per-seed
/// final-window values are compared on the log scale (their spread is multiplicative, and a
/// 38-fold difference is the finding), and the interval of the mean log ratio is exponentiated.
fn describe_fold(
    metric: &str,
    baseline: &str,
    log: Interval,
    linear: Interval,
    s: &CompareSettings,
) -> Decision {
    let ratio = stats::exp_interval(log);
    let fx = |v: f64| {
        if v >= 10.0 {
            format!("{v:.0}x")
        } else {
            format!("{v:.2}x")
        }
    };
    let text = format!(
        "{metric} {} {baseline} [{}, {}]",
        fx(ratio.estimate),
        fx(ratio.lo),
        fx(ratio.hi)
    );
    let level = 100.0 * (1.0 - 2.0 * s.alpha);
    let verdict = if log.lo > 0.0 {
        Verdict::Higher
    } else if log.hi < 0.0 {
        Verdict::Lower
    } else {
        Verdict::NoDifference
    };
    let word = match verdict {
        Verdict::Higher => "higher",
        Verdict::Lower => "lower",
        _ => "no difference detected",
    };
    Decision {
        verdict,
        reason: format!(
            "{word}: {text} (geometric means, {level:.0} % interval on the log scale; no margin set: descriptive)"
        ),
        interval: linear,
        seeds_needed: None,
    }
}

/// The verdict of one metric, with its reason and the interval it rests on.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub verdict: Verdict,
    pub reason: String,
    /// Welch interval of `mean(x) - mean(y)` at `1 - 2·alpha`.
    pub interval: Interval,
    /// Seeds per arm the margin needs at the stated power (from an upper bound on the noise).
    pub seeds_needed: Option<usize>,
}

/// The noise used to count the seeds a margin needs is the upper bound of the pooled standard
/// deviation at this level (99 %): a small sample that happens to look quiet claims "enough
/// seeds" with probability at most 1 %, and must then also pass TOST.
pub const SD_BOUND_LEVEL: f64 = 0.01;

/// Decide from per-seed final-window values `x` (configuration) and `y` (baseline); with
/// `paired`, `x[i]` and `y[i]` come from the same seed and the interval is the paired t interval
/// of the differences, else Welch's. Without a margin the metric is described ([`describe`]).
///
/// With the difference oriented so that positive is better and `[lo, hi]` its interval at
/// `1 - 2·alpha`:
/// 1. fewer than `min_seeds` seeds in an arm: inconclusive;
/// 2. `-margin < lo` and `hi < margin` (TOST) and the seeds reach the margin's required count:
///    equivalent (and when the interval also excludes 0, the reason says by how much it is lower
///    or higher: a real difference inside the margin);
/// 3. `hi < 0`: regressed (worse, at one-sided level alpha; this is what bounds false alarms);
/// 4. `lo > 0`: improved;
/// 5. otherwise inconclusive, saying how many seeds the margin needs.
///
/// The required count uses the 99 % upper confidence bound of the standard deviation (pooled,
/// or of the paired differences; [`SD_BOUND_LEVEL`]), so a small sample that happens to look
/// quiet cannot claim equivalence.
pub fn decide(
    x: &[f64],
    y: &[f64],
    margin: Option<f64>,
    higher_is_better: bool,
    paired: bool,
    s: &CompareSettings,
) -> Decision {
    let Some(m) = margin else {
        return describe(x, y, paired, s);
    };
    let raw = difference(x, y, paired, s.alpha);
    let sign = if higher_is_better { 1.0 } else { -1.0 };
    let (lo, hi) = if higher_is_better {
        (raw.lo, raw.hi)
    } else {
        (-raw.hi, -raw.lo)
    };
    let est = sign * raw.estimate;
    let n = x.len().min(y.len());
    let needed = if paired {
        let d: Vec<f64> = x.iter().zip(y).map(|(a, b)| a - b).collect();
        let up = stats::sd_upper(stats::variance(&d), n as f64 - 1.0, SD_BOUND_LEVEL);
        stats::seeds_needed_diff(up, m, s.alpha, s.power)
    } else {
        let (var, df) = stats::pooled_variance(x, y);
        let sd_up = stats::sd_upper(var, df, SD_BOUND_LEVEL);
        stats::seeds_needed(sd_up, m, s.alpha, s.power)
    };
    let worse = if higher_is_better { "lower" } else { "higher" };
    let f = expr::fmt_num;
    let ci = format!("{} [{}, {}]", f(raw.estimate), f(raw.lo), f(raw.hi));
    let verdict_of = |v: Verdict, reason: String| Decision {
        verdict: v,
        reason,
        interval: raw,
        seeds_needed: needed,
    };
    if n < s.min_seeds {
        return verdict_of(
            Verdict::Inconclusive,
            format!(
                "{n} seed(s) per arm; at least {} are needed for any verdict{}",
                s.min_seeds,
                needed
                    .map(|k| format!(" (about {k} for a {} margin)", f(m)))
                    .unwrap_or_default()
            ),
        );
    }
    if !(lo.is_finite() && hi.is_finite()) {
        return verdict_of(
            Verdict::Inconclusive,
            format!("no interval could be computed: difference {ci}"),
        );
    }
    let within = lo > -m && hi < m;
    let enough = needed.is_some_and(|k| n >= k);
    let needed_txt = needed.map_or("more".to_string(), |k| k.to_string());
    if within && enough {
        let how = if paired { "paired TOST" } else { "TOST" };
        let reason = if hi < 0.0 || lo > 0.0 {
            // Significant, yet inside the margin: say both.
            let (word, a, b) = if raw.hi < 0.0 {
                ("lower", -raw.hi, -raw.lo)
            } else {
                ("higher", raw.lo, raw.hi)
            };
            format!(
                "equivalent; {word} by {} [{}, {}], a real difference inside ±{} ({how} at alpha {})",
                f(raw.estimate.abs()),
                f(a),
                f(b),
                f(m),
                s.alpha
            )
        } else {
            format!(
                "difference {ci} lies inside ±{} ({how} at alpha {})",
                f(m),
                s.alpha
            )
        };
        return verdict_of(Verdict::Equivalent, reason);
    }
    if hi < 0.0 {
        let past = if within {
            format!(
                "it lies inside the margin ±{}, but {n} seeds per arm are fewer than the {needed_txt} the margin needs to call that equivalent",
                f(m)
            )
        } else {
            format!("it reaches past the margin {}", f(m))
        };
        return verdict_of(
            Verdict::Regressed,
            format!(
                "{worse} by {} ({ci}): the whole {:.0} % interval is on the worse side of 0 and {past}",
                f(est.abs()),
                100.0 * (1.0 - 2.0 * s.alpha),
            ),
        );
    }
    if lo > 0.0 && !within {
        return verdict_of(
            Verdict::Improved,
            format!("better by {} ({ci})", f(est.abs())),
        );
    }
    if within {
        return verdict_of(
            Verdict::Inconclusive,
            format!(
                "difference {ci} lies inside ±{} but {n} seeds per arm cannot establish it at power {}: about {needed_txt} needed",
                f(m),
                s.power
            ),
        );
    }
    verdict_of(
        Verdict::Inconclusive,
        format!(
            "difference {ci} spans both 0 and the margin ±{}: {n} seeds per arm cannot resolve it; about {needed_txt} needed",
            f(m)
        ),
    )
}

fn kl_summary(x: &Arm, y: &Arm, s: &CompareSettings) -> KlSummary {
    let first = |a: &Arm| stats::mean(&a.points.iter().map(|p| p[0].1).collect::<Vec<_>>());
    let slopes = |a: &Arm| -> Vec<f64> {
        a.points
            .iter()
            .map(|p| {
                let (st, v): (Vec<f64>, Vec<f64>) = p.iter().map(|q| (q.0 as f64, q.1)).unzip();
                stats::ols_slope(&st, &v)
            })
            .filter(|v| v.is_finite())
            .collect()
    };
    let level = stats::mean(&x.finals);
    let step0 = first(x);
    KlSummary {
        level,
        step0_offset: step0 - first(y),
        drift: stats::mean_interval(&slopes(x), s.alpha),
        step0,
        growth: level - step0,
        baseline_level: stats::mean(&y.finals),
        baseline_drift: stats::mean_interval(&slopes(y), s.alpha),
    }
}

/// Spikes in every run's per-site grad norms.
fn find_spikes(groups: &[Group<'_>], s: &CompareSettings) -> Vec<Spike> {
    let runs: Vec<&RunData> = groups.iter().flat_map(|g| g.runs.iter().copied()).collect();
    runs.par_iter()
        .flat_map_iter(|r| {
            r.layers.iter().flat_map(move |l| {
                spikes::find(&l.grad_norm, &s.spikes)
                    .into_iter()
                    .map(move |f| Spike {
                        config: r.config.clone(),
                        seed: r.seed,
                        step: l.steps[f.index],
                        site: l.site.clone(),
                        layer: l.layer,
                        value: l.grad_norm[f.index],
                        ratio: f.ratio,
                        z: f.z,
                    })
            })
        })
        .collect()
}

/// Site and layer of a spike count.
type SiteKey = (String, i64);

/// A configuration's spikes and judged steps per site and layer, summed over its seeds. A run's
/// exposure at a site is the steps the rule could judge (those after `min_history` steps).
fn spike_tally(
    g: &Group<'_>,
    spikes: &[Spike],
    s: &CompareSettings,
) -> BTreeMap<SiteKey, (u64, u64)> {
    let mut t: BTreeMap<SiteKey, (u64, u64)> = BTreeMap::new();
    for r in &g.runs {
        for l in &r.layers {
            let judged = l.grad_norm.len().saturating_sub(s.spikes.min_history) as u64;
            t.entry((l.site.clone(), l.layer)).or_default().1 += judged;
        }
    }
    for sp in spikes.iter().filter(|sp| sp.config == g.config) {
        t.entry((sp.site.clone(), sp.layer)).or_default().0 += 1;
    }
    t
}

/// Spike rates of every configuration against its baseline group: per site and layer where either
/// arm has a spike, and over all sites. A run's exposure at a site is the steps the rule could
/// judge (those after `min_history` steps of history).
fn spike_rates(
    groups: &[Group<'_>],
    configs: &[ConfigComparison],
    spikes: &[Spike],
    s: &CompareSettings,
) -> Vec<SpikeRate> {
    let tally = |g: &Group<'_>| spike_tally(g, spikes, s);
    let by_name = |name: &str| groups.iter().find(|g| g.config == name);
    let mut out = Vec::new();
    for c in configs {
        let (Some(g), Some(b)) = (by_name(&c.config), by_name(&c.baseline)) else {
            continue;
        };
        let (tx, ty) = (tally(g), tally(b));
        let row = |site: &str, layer: i64, (a, ea): (u64, u64), (bb, eb): (u64, u64)| SpikeRate {
            config: c.config.clone(),
            baseline: c.baseline.clone(),
            site: site.to_string(),
            layer,
            spikes: a,
            steps: ea,
            baseline_spikes: bb,
            baseline_steps: eb,
            excess_per_1k: 1000.0 * (a as f64 / ea as f64 - bb as f64 / eb as f64),
            rate_ratio: stats::rate_ratio_interval(a, ea as f64, bb, eb as f64, s.alpha),
        };
        let sum = |t: &BTreeMap<SiteKey, (u64, u64)>| {
            t.values().fold((0, 0), |acc, v| (acc.0 + v.0, acc.1 + v.1))
        };
        let (ax, ay) = (sum(&tx), sum(&ty));
        if ax.1 == 0 || ay.1 == 0 {
            continue; // no per-layer grad norms: nothing to count
        }
        out.push(row("all", -1, ax, ay));
        let keys: BTreeSet<&SiteKey> = tx.keys().chain(ty.keys()).collect();
        for k in keys {
            let (x, y) = (
                tx.get(k).copied().unwrap_or_default(),
                ty.get(k).copied().unwrap_or_default(),
            );
            if x.0 + y.0 > 0 && x.1 > 0 && y.1 > 0 {
                out.push(row(&k.0, k.1, x, y));
            }
        }
    }
    out
}

/// What checks read: groups by configuration name, and the spikes found.
struct Data<'a, 'b> {
    groups: &'a [Group<'b>],
    spikes: &'a [Spike],
    /// Sweep values of the configuration under check: `bf16` in a check on
    /// `nvfp4 [backward=dq]` means the bf16 group with the same sweep values, when there is one.
    axes: &'a BTreeMap<String, String>,
}

impl Data<'_, '_> {
    /// A configuration by its full name, or by base name (same sweep values as the configuration
    /// under check, else its only sweep point).
    fn group(&self, config: &str) -> Option<&Group<'_>> {
        self.groups
            .iter()
            .find(|g| g.config == config)
            .or_else(|| {
                self.groups
                    .iter()
                    .find(|g| g.base == config && &g.axes == self.axes)
            })
            .or_else(|| {
                let mut it = self.groups.iter().filter(|g| g.base == config);
                match (it.next(), it.next()) {
                    (Some(g), None) => Some(g),
                    _ => None,
                }
            })
    }
}

/// Whether a site (or its full name, `decoder.layers.N.SITE`) matches a glob; no glob: every site.
pub(crate) fn site_matches(glob: Option<&str>, site: &str, layer: i64) -> bool {
    let Some(g) = glob else { return true };
    let Ok(m) = crate::recipe::glob_matcher(g) else {
        return false;
    };
    m.is_match(site) || m.is_match(format!("decoder.layers.{layer}.{site}"))
}

impl Source for Data<'_, '_> {
    fn series(&self, config: &str, metric: &str) -> Vec<Vec<(usize, f64)>> {
        self.group(config)
            .map(|g| {
                g.runs
                    .iter()
                    .map(|r| r.metrics.get(metric).cloned().unwrap_or_default())
                    .collect()
            })
            .unwrap_or_default()
    }
    fn spikes(&self, config: &str, site: Option<&str>, layer: Option<i64>) -> Vec<f64> {
        let Some(g) = self.group(config) else {
            return vec![];
        };
        g.runs
            .iter()
            .map(|r| {
                self.spikes
                    .iter()
                    .filter(|sp| {
                        sp.config == g.config
                            && sp.seed == r.seed
                            && layer.is_none_or(|l| l == sp.layer)
                            && site_matches(site, &sp.site, sp.layer)
                    })
                    .count() as f64
            })
            .collect()
    }
    fn events(&self, config: &str, kind: Option<&str>, site: Option<&str>) -> Vec<f64> {
        let Some(g) = self.group(config) else {
            return vec![];
        };
        g.runs
            .iter()
            .map(|r| {
                r.events
                    .iter()
                    .filter(|e| {
                        kind.is_none_or(|k| e.kind == k) && site_matches(site, &e.site, e.layer)
                    })
                    .count() as f64
            })
            .collect()
    }
    fn contract_violations(&self, config: &str) -> Vec<f64> {
        let Some(g) = self.group(config) else {
            return vec![];
        };
        g.runs
            .iter()
            .map(|r| r.contract_violations as f64)
            .collect()
    }
}

/// Every configuration as claims read it: per-seed final- and first-window values of the claims'
/// metrics, and spike tallies.
fn claim_arms(groups: &[Group<'_>], spikes: &[Spike], s: &CompareSettings) -> Vec<ClaimArm> {
    let metrics: BTreeSet<&String> = s
        .claims
        .iter()
        .filter(|c| !c.metric.is_empty())
        .map(|c| &c.metric)
        .collect();
    groups
        .iter()
        .filter(|g| !g.runs.is_empty())
        .map(|g| ClaimArm {
            config: g.config.clone(),
            base: g.base.clone(),
            axes: g.axes.clone(),
            seeds: g.runs.iter().map(|r| r.seed).collect(),
            coupled: g.runs.iter().all(|r| r.engine == COUPLING_ENGINE),
            weight_bytes: g.runs.iter().find_map(|r| r.weight_bytes),
            values: metrics
                .iter()
                .map(|m| {
                    let v = g
                        .runs
                        .iter()
                        .filter_map(|r| {
                            let p: Vec<(usize, f64)> = r
                                .metrics
                                .get(*m)?
                                .iter()
                                .copied()
                                .filter(|(_, x)| x.is_finite())
                                .collect();
                            let (last, first) = (
                                final_mean(&p, s.final_window),
                                first_mean(&p, s.final_window),
                            );
                            last.is_finite().then_some(SeedValue {
                                seed: r.seed,
                                last,
                                first,
                            })
                        })
                        .collect();
                    ((*m).clone(), v)
                })
                .collect(),
            spikes: spike_tally(g, spikes, s)
                .into_iter()
                .map(|((site, layer), (spikes, steps))| SiteSpikes {
                    site,
                    layer,
                    spikes,
                    steps,
                })
                .collect(),
        })
        .collect()
}

fn run_checks(groups: &[Group<'_>], spikes: &[Spike], s: &CompareSettings) -> Vec<CheckResult> {
    let constants = s.constants();
    let mut out = Vec::new();
    for c in &s.checks {
        let matchers: Vec<globset::GlobMatcher> = c
            .configs
            .iter()
            .filter_map(|g| crate::recipe::glob_matcher(g).ok())
            .collect();
        for g in groups {
            let applies = if matchers.is_empty() {
                g.base != s.baseline
            } else {
                matchers
                    .iter()
                    .any(|m| m.is_match(&g.config) || m.is_match(&g.base))
            };
            if !applies {
                continue;
            }
            let data = Data {
                groups,
                spikes,
                axes: &g.axes,
            };
            let o = c.check.eval(&g.config, &data, &constants);
            out.push(CheckResult {
                expr: c.check.text.clone(),
                config: g.config.clone(),
                passed: o.passed,
                value: o.lhs,
                threshold: o.rhs,
                message: o.message,
                name: c.name.clone(),
            });
        }
    }
    out
}

fn overall(
    configs: &[ConfigComparison],
    checks: &[CheckResult],
    claims: &[ClaimResult],
    s: &CompareSettings,
) -> OverallVerdict {
    let gated: Vec<&MetricComparison> = configs
        .iter()
        .flat_map(|c| &c.metrics)
        .filter(|m| m.margin.is_some() || m.margin_rule.is_some())
        .collect();
    let claim_failed = claims
        .iter()
        .any(|c| c.gate && c.verdict == ClaimVerdict::Contradicted);
    if gated.iter().any(|m| m.verdict == Verdict::Regressed)
        || checks.iter().any(|c| !c.passed)
        || claim_failed
    {
        return OverallVerdict::Regression;
    }
    let resolved = gated
        .iter()
        .all(|m| matches!(m.verdict, Verdict::Equivalent | Verdict::Improved));
    if resolved && (!gated.is_empty() || !s.checks.is_empty()) {
        OverallVerdict::Pass
    } else {
        OverallVerdict::Inconclusive
    }
}

fn method(s: &CompareSettings) -> Method {
    let level = 100.0 * (1.0 - 2.0 * s.alpha);
    let mut m = method_base(s, level);
    if !s.claims.is_empty() {
        m.description.extend(claims::method(s));
    }
    m
}

fn method_base(s: &CompareSettings, level: f64) -> Method {
    Method {
        bootstrap_reps: s.bootstrap_reps,
        bootstrap_seed: s.bootstrap_seed,
        alpha: s.alpha,
        final_window: s.final_window,
        spike_window: s.spikes.window,
        spike_z: s.spikes.z,
        spike_ratio: s.spikes.ratio,
        band_reps: s.band_reps,
        power: s.power,
        min_seeds: s.min_seeds,
        nights: s.nights,
        description: vec![
            format!(
                "Each run (seed) is one observation: a metric is reduced per seed to the mean of its last {} steps, and seeds, not steps, are resampled, because steps within a run are correlated.",
                s.final_window
            ),
            format!(
                "Intervals are two-sided {level:.0} % intervals, so an interval inside ±margin is exactly the two one-sided tests (TOST) at level {}.",
                s.alpha
            ),
            "Paired or not: when both arms ran the same seeds on the built-in engine, whose configurations of one seed share the warm start, each step's prompts and the sampler's random stream (common random numbers; each configuration's own arithmetic is untouched), the verdict uses the paired t interval over the per-seed differences (and a paired bootstrap, resampling seeds with their pair), and reports the arms' correlation, how much narrower the interval is than Welch's, and the independent seeds per arm it is worth. Otherwise (other engines, or different seed sets) it uses Welch's t interval (unequal variances). With 3-10 seeds a percentile bootstrap covers less than it claims, so the bootstrap interval is shown alongside but does not decide.".to_string(),
            format!(
                "Verdicts (difference oriented so positive is better): equivalent when the interval lies inside ±margin and the seeds reach the count the margin needs; regressed when the whole interval is on the worse side of 0 (a false alarm rate of at most {} when nothing changed); improved when it is wholly on the better side; inconclusive otherwise, or with fewer than {} seeds per arm.",
                s.alpha, s.min_seeds
            ),
            format!(
                "Seeds needed: the smallest n per arm with margin / (sd·sqrt(2/n)) >= t(1-alpha) + t(power) (t with n-1 degrees of freedom) at power {}, where sd is the {:.0} % upper confidence bound of the pooled per-seed standard deviation, so a quiet-looking small sample cannot claim equivalence.",
                s.power,
                100.0 * (1.0 - SD_BOUND_LEVEL)
            ),
            format!(
                "Bands: percentile bootstrap of the mean curve over seeds ({} resamples, the same resample at every step); final-window and area-under-curve intervals: stratified percentile bootstrap over seeds, each arm resampled on its own ({} resamples, seed {}), as in rliable.",
                s.band_reps, s.bootstrap_reps, s.bootstrap_seed
            ),
            "Interquartile mean (IQM): mean of the middle half of the per-seed values; probability of improvement: P(a run of the configuration beats a run of the baseline), the Mann-Whitney U over n·m, ties counted half.".to_string(),
            "KL-type metrics: level = final-window mean; step-0 offset = the configuration's first value minus the baseline's (the format's constant offset); drift = least-squares slope per seed, averaged over seeds with a t interval.".to_string(),
            format!(
                "Gradient spikes, per site and layer: a step is flagged when its log grad norm is at least {} robust z-scores (1.4826·MAD, floor {}) above the median of the previous {} steps and a new high of that window, or when it is at least {}x the largest of them; a step needs {} earlier values to be judged.",
                s.spikes.z, s.spikes.mad_floor, s.spikes.window, s.spikes.ratio, s.spikes.min_history
            ),
            "Margins: absolute (metric units), `of_level` (a fraction of the baseline's final-window level) or `of_gain` (a fraction of the baseline's gain over the run, final window minus the first window of as many steps, so `of_gain = 0.1` means keeping at least 90 % of BF16's gain). Relative margins are computed from the baseline runs of the same comparison and then treated as fixed. A difference that is significant but inside the margin is reported as both: `equivalent; lower by d [lo, hi]`.".to_string(),
            "Metrics without a margin are described, never left inconclusive: `higher` or `lower` when the interval excludes 0, else `no difference detected` (which is not evidence of no difference). KL-type and mismatch metrics, whose per-seed values are positive and spread multiplicatively, are described as a fold change: the interval of the mean log ratio (paired or Welch, as above), exponentiated, i.e. a ratio of geometric means. These descriptive intervals are per metric, without a correction for the number of metrics.".to_string(),
            format!(
                "Spike rates against the baseline, per site and layer and over all sites: spikes (the offline rule above) per judged step (steps after {} of history, summed over seeds), the excess per 1,000 steps over the baseline's, and the rate ratio with an exact conditional-binomial (Clopper-Pearson) {level:.0} % interval that treats spikes as Poisson events; spikes that cluster within a seed make it too narrow. The engine's own `grad_spike` events are a second, online rule (a grad norm above 10x the median of that site's previous 10 steps, as the run goes) and are counted separately, as events.",
                s.spikes.min_history
            ),
            "Overall: regression if any metric with a margin regressed or any declared check failed; pass if every metric with a margin is equivalent or improved; inconclusive otherwise. Metrics without a margin are descriptive.".to_string(),
        ],
    }
}

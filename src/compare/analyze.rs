//! The comparison procedure: group runs by configuration, compare every configuration with the
//! baseline configuration metric by metric, find gradient spikes, total the contract checks,
//! evaluate the declared checks, and reach one overall verdict. Pure over [`RunData`] except the
//! two entry points that read a suite folder or explicit run folders.

use super::data::{self, RunData};
use super::expr::{self, Source};
use super::result::*;
use super::settings::{self, CompareSettings, DEFAULT_METRICS, SettingsError};
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
}

/// Compare the runs of `spec` found in `suite_dir` (normally `<store>/<suite>`). Only runs of the
/// suite as it is now count: a folder left from an edited suite is ignored with a warning.
pub fn compare_suite(
    spec: &SuiteSpec,
    suite_dir: &Path,
    opts: &CompareOptions,
) -> Result<SuiteComparison, CompareError> {
    let settings = settings::from_spec(spec)?;
    let planned = crate::suite::expand(spec)?;
    let mut warnings = Vec::new();
    let mut dirs = Vec::new();
    for r in &planned {
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
        let stale = all.iter().filter(|d| !dirs.contains(d)).count();
        if stale > 0 {
            warnings.push(format!(
                "{stale} run folder(s) in {} are not part of the suite as it is now and were ignored",
                suite_dir.display()
            ));
        }
    }
    let wanted = wanted_metrics(&settings);
    let (mut runs, skipped) = data::load_runs(&dirs, wanted.as_ref());
    warnings.extend(skipped);
    for run in &mut runs {
        if let Some(p) = planned.iter().find(|p| p.run_id == run.run_id) {
            run.config = p.config.clone();
            run.base = p.base.clone();
            run.axes = p.axes.clone();
        }
    }
    if runs.is_empty() {
        return Err(CompareError::NoRuns {
            dir: suite_dir.display().to_string(),
            suite: spec.name.clone(),
        });
    }
    let mut out = compare_data(&spec.name, &runs, &settings, opts)?;
    warnings.append(&mut out.warnings);
    out.warnings = warnings;
    Ok(out)
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
    w.extend(s.margins.keys().cloned());
    for c in &s.checks {
        w.extend(c.check.metrics());
    }
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
        return Err(CompareError::NoBaseline {
            baseline: s.baseline.clone(),
            have: groups
                .iter()
                .map(|g| g.config.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        });
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
            let metrics = metrics
                .iter()
                .filter_map(|m| {
                    let (x, y) = (&bands[&(gi, m.clone())], &bands[&(bi, m.clone())]);
                    (!x.seeds.is_empty() && !y.seeds.is_empty())
                        .then(|| compare_metric(m, x, y, &s, &g.config))
                })
                .collect();
            ConfigComparison {
                config: g.config.clone(),
                seeds: g.runs.iter().map(|r| r.seed).collect(),
                metrics,
                baseline: groups[bi].config.clone(),
                diverged: g.diverged,
                failed: g.failed,
            }
        })
        .collect();
    let spikes = find_spikes(&groups, &s);
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
    let overall = overall(&configs, &checks, &s);
    Ok(SuiteComparison {
        suite: suite.to_string(),
        baseline_config: s.baseline.clone(),
        method: method(&s),
        configs,
        spikes,
        checks,
        contract,
        overall,
        warnings,
    })
}

/// Tracked metrics present in at least one run.
fn tracked_metrics(s: &CompareSettings, runs: &[RunData]) -> Vec<String> {
    let mut want: Vec<String> = match &s.metrics {
        Some(m) => m.clone(),
        None => DEFAULT_METRICS.iter().map(|m| m.to_string()).collect(),
    };
    for m in s.margins.keys() {
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

/// A bootstrap stream per (configuration, metric, purpose), independent of evaluation order.
fn stream_seed(seed: u64, config: &str, metric: &str, purpose: u64) -> u64 {
    use sha2::{Digest, Sha256};
    let h: [u8; 32] =
        Sha256::digest(format!("{seed}\u{0}{config}\u{0}{metric}\u{0}{purpose}").as_bytes()).into();
    u64::from_le_bytes([h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]])
}

fn is_kl_type(metric: &str) -> bool {
    let m = metric.to_ascii_lowercase();
    m.contains("kl")
        || m.contains("logprob_abs_diff")
        || m.contains("prob_error")
        || m.contains("probs_diff")
}

fn compare_metric(
    metric: &str,
    x: &Arm,
    y: &Arm,
    s: &CompareSettings,
    config: &str,
) -> MetricComparison {
    let hib = s.higher_is_better(metric);
    let margin = s.margin(metric);
    let d = decide(&x.finals, &y.finals, margin, hib, s);
    let mut rs = Resampler::new(stream_seed(s.bootstrap_seed, config, metric, 2));
    let final_boot = rs.diff_interval(&x.finals, &y.finals, s.bootstrap_reps, s.alpha, stats::mean);
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

/// Decide from per-seed final-window values `x` (configuration) and `y` (baseline).
///
/// With `g` the difference oriented so that positive is better and `[lo, hi]` its Welch interval
/// at `1 - 2·alpha`:
/// 1. fewer than `min_seeds` seeds in an arm: inconclusive;
/// 2. `-margin < lo` and `hi < margin` (TOST) and the seeds reach the margin's required count:
///    equivalent;
/// 3. `hi < 0`: regressed (worse, at one-sided level alpha; this is what bounds false alarms);
/// 4. `lo > 0`: improved;
/// 5. otherwise inconclusive, saying how many seeds the margin needs.
///
/// The required count uses the 99 % upper confidence bound of the pooled standard deviation
/// ([`SD_BOUND_LEVEL`]), so a small sample that happens to look quiet cannot claim equivalence.
pub fn decide(
    x: &[f64],
    y: &[f64],
    margin: Option<f64>,
    higher_is_better: bool,
    s: &CompareSettings,
) -> Decision {
    let raw = stats::welch_interval(x, y, s.alpha);
    let sign = if higher_is_better { 1.0 } else { -1.0 };
    let (lo, hi) = if higher_is_better {
        (raw.lo, raw.hi)
    } else {
        (-raw.hi, -raw.lo)
    };
    let est = sign * raw.estimate;
    let n = x.len().min(y.len());
    let (var, df) = stats::pooled_variance(x, y);
    let sd_up = stats::sd_upper(var, df, SD_BOUND_LEVEL);
    let needed = margin.and_then(|m| stats::seeds_needed(sd_up, m, s.alpha, s.power));
    let worse = if higher_is_better { "lower" } else { "higher" };
    let f = expr::fmt_num;
    let ci = format!("{} [{}, {}]", f(raw.estimate), f(raw.lo), f(raw.hi));
    let verdict_of = |v: Verdict, reason: String| Decision {
        verdict: v,
        reason,
        interval: raw,
        seeds_needed: needed,
    };
    let Some(m) = margin else {
        return verdict_of(
            Verdict::Inconclusive,
            format!("no margin set for this metric (descriptive only): difference {ci}"),
        );
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
        return verdict_of(
            Verdict::Equivalent,
            format!(
                "difference {ci} lies inside ±{} (TOST at alpha {})",
                f(m),
                s.alpha
            ),
        );
    }
    if hi < 0.0 {
        return verdict_of(
            Verdict::Regressed,
            format!(
                "{worse} by {} ({ci}): the whole {:.0} % interval is on the worse side of 0 and it reaches past the margin {}",
                f(est.abs()),
                100.0 * (1.0 - 2.0 * s.alpha),
                f(m)
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

fn site_matches(glob: Option<&str>, site: &str, layer: i64) -> bool {
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
    s: &CompareSettings,
) -> OverallVerdict {
    let gated: Vec<&MetricComparison> = configs
        .iter()
        .flat_map(|c| &c.metrics)
        .filter(|m| m.margin.is_some())
        .collect();
    if gated.iter().any(|m| m.verdict == Verdict::Regressed) || checks.iter().any(|c| !c.passed) {
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
        description: vec![
            format!(
                "Each run (seed) is one observation: a metric is reduced per seed to the mean of its last {} steps, and seeds, not steps, are resampled, because steps within a run are correlated.",
                s.final_window
            ),
            format!(
                "Intervals are two-sided {level:.0} % intervals, so an interval inside ±margin is exactly the two one-sided tests (TOST) at level {}.",
                s.alpha
            ),
            "The verdict uses Welch's t interval for the difference of per-seed final-window means (unequal variances); with 3-10 seeds a percentile bootstrap covers less than it claims, so the bootstrap interval is shown alongside but does not decide.".to_string(),
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
            "Overall: regression if any metric with a margin regressed or any declared check failed; pass if every metric with a margin is equivalent or improved; inconclusive otherwise. Metrics without a margin are descriptive.".to_string(),
        ],
    }
}

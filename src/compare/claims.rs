//! Published findings as claims the comparison decides (`[[claims]]` in a suite). A claim names
//! the published words, where they were published, and one predicate over configurations, built
//! from the statistics the comparison already computes; each is decided `reproduced`,
//! `contradicted` or `inconclusive`, with its interval, the seeds and the test.
//!
//! ```toml
//! [[claims]]
//! name = "mismatch-up"                      # unique
//! statement = "Train-rollout mismatch is higher than BF16's."   # the published words
//! source = "Miles low-precision RL ablation, July 2026"         # where
//! expect = "higher"          # equivalent | higher | lower | fold_within | spike_rate_higher
//!                            # | decreasing | increasing
//! metric = "train/train_rollout_kl"        # every predicate but spike_rate_higher
//! configs = ["mxfp8*", "nvfp4*"]           # names or globs (default: all but `vs`)
//! vs = "bf16"                # what they are held against (default: the suite's baseline)
//! gate = false               # true: a contradicted claim fails the night
//! # margin = 0.05 | { of_level = 0.1 } | { of_gain = 0.2 }   equivalent (default: [checks]')
//! # fold = [0.67, 1.5]                                        fold_within
//! # site = "*experts*"                                        spike_rate_higher (default: all)
//! # by = "bf16_last"         decreasing/increasing: order the configs by this sweep axis
//! ```
//!
//! Every test is one-sided at the suite's alpha, so its interval is the comparison's two-sided
//! `1 - 2·alpha` interval; see [`method`] for the tests and how several configurations of one
//! claim are combined.

use super::analyze;
use super::result::{ClaimEvidence, ClaimResult, ClaimVerdict, Interval};
use super::settings::{CompareSettings, MarginRule, MarginToml, SettingsError};
use super::stats;
use crate::suite::spec::SuiteSpec;
use serde::Deserialize;
use std::collections::BTreeMap;
use toml::Spanned;

/// What a claim asserts about its configurations.
#[derive(Debug, Clone, PartialEq)]
pub enum Predicate {
    /// The metric of each configuration is within ±margin of `vs` (TOST).
    Equivalent(MarginRule),
    /// The metric of each configuration is higher (`true`) or lower than `vs`'s.
    Higher(bool),
    /// The fold change (ratio of geometric means) of each configuration over `vs` is in `[lo, hi]`.
    FoldWithin(f64, f64),
    /// Each configuration has more gradient spikes per judged step than `vs` (at sites matching
    /// the glob, all when `None`).
    SpikeRateHigher(Option<String>),
    /// The metric falls (`true`) or rises along the configurations in order, ordered by the
    /// sweep axis when one is named.
    Trend {
        decreasing: bool,
        by: Option<String>,
    },
}

/// One `[[claims]]` entry, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimSpec {
    pub name: String,
    pub statement: String,
    pub source: String,
    /// The predicate's name as written.
    pub expect: String,
    /// Empty for spike-rate claims.
    pub metric: String,
    /// Names or globs; empty: every configuration but `vs`.
    pub configs: Vec<String>,
    /// `None`: the suite's baseline.
    pub vs: Option<String>,
    pub predicate: Predicate,
    pub gate: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClaimToml {
    name: Spanned<String>,
    statement: Spanned<String>,
    source: Spanned<String>,
    expect: Spanned<String>,
    metric: Option<Spanned<String>>,
    configs: Option<Spanned<Vec<String>>>,
    vs: Option<Spanned<String>>,
    margin: Option<Spanned<MarginToml>>,
    fold: Option<Spanned<Vec<f64>>>,
    site: Option<Spanned<String>>,
    by: Option<Spanned<String>>,
    gate: Option<bool>,
}

/// The suite file as claims read it: everything else is left to the suite parser.
#[derive(Debug, Deserialize)]
struct ClaimsFile {
    #[serde(default)]
    claims: Vec<Spanned<ClaimToml>>,
}

const KEYS: [&str; 12] = [
    "name",
    "statement",
    "source",
    "expect",
    "metric",
    "configs",
    "vs",
    "margin",
    "fold",
    "site",
    "by",
    "gate",
];

const PREDICATES: [&str; 7] = [
    "equivalent",
    "higher",
    "lower",
    "fold_within",
    "spike_rate_higher",
    "decreasing",
    "increasing",
];

/// Sweep axes a trend may be ordered by.
const AXES: [&str; 4] = ["bf16_last", "bf16_first", "shared_experts_bf16", "backward"];

/// Read and check the suite's `[[claims]]`. `file_text` is the suite file (positions in errors
/// come from it); without it the claims are read from `spec` and errors carry no position.
pub fn from_spec(
    spec: &SuiteSpec,
    configs: &[String],
    settings: &CompareSettings,
    path: &str,
    file_text: &str,
) -> Result<Vec<ClaimSpec>, SettingsError> {
    if spec.claims.is_empty() {
        return Ok(Vec::new());
    }
    let (text, located) = if file_text.is_empty() {
        let mut t = toml::Table::new();
        t.insert(
            "claims".into(),
            toml::Value::Array(
                spec.claims
                    .iter()
                    .cloned()
                    .map(toml::Value::Table)
                    .collect(),
            ),
        );
        (toml::to_string(&t).unwrap_or_default(), false)
    } else {
        (file_text.to_string(), true)
    };
    let axes = sweep_axes(spec);
    parse(&text, located, path, configs, &axes, settings)
}

/// The sweep axes the suite runs.
fn sweep_axes(spec: &SuiteSpec) -> Vec<&'static str> {
    let w = &spec.sweep;
    let used = [
        !w.bf16_last.is_empty(),
        !w.bf16_first.is_empty(),
        !w.shared_experts_bf16.is_empty(),
        !w.backward.is_empty(),
    ];
    AXES.iter()
        .zip(used)
        .filter(|(_, u)| *u)
        .map(|(a, _)| *a)
        .collect()
}

/// Parse the claims of a suite file's text.
pub fn parse(
    text: &str,
    located: bool,
    path: &str,
    configs: &[String],
    axes: &[&str],
    settings: &CompareSettings,
) -> Result<Vec<ClaimSpec>, SettingsError> {
    let at = |pos: Option<usize>| match pos {
        Some(p) if located => {
            let (l, c) = crate::io::line_col(text, p);
            format!(":{l}:{c}")
        }
        _ => String::new(),
    };
    let err = |pos: Option<usize>, msg: String| SettingsError {
        path: path.to_string(),
        line: at(pos),
        table: "[[claims]]",
        msg,
    };
    let file: ClaimsFile = toml::from_str(text).map_err(|e| {
        let msg = crate::io::one_line(e.message());
        let hint = msg
            .split("unknown field `")
            .nth(1)
            .and_then(|r| r.split('`').next())
            .and_then(|f| crate::recipe::presets::suggest(f, &KEYS))
            .map(|s| format!(" (did you mean `{s}`?)"))
            .unwrap_or_default();
        err(e.span().map(|s| s.start), format!("{msg}{hint}"))
    })?;
    let mut out: Vec<ClaimSpec> = Vec::new();
    for c in file.claims {
        let c = c.into_inner();
        let name = c.name.get_ref().trim().to_string();
        let here = c.name.span().start;
        let bad = |pos: usize, msg: String| {
            err(
                Some(pos),
                format!("claim `{}`: {msg}", crate::recipe::shorten(&name)),
            )
        };
        if name.is_empty() {
            return Err(err(
                Some(here),
                "a claim needs a name, e.g. name = \"mismatch-up\"".into(),
            ));
        }
        if out.iter().any(|o| o.name == name) {
            return Err(bad(
                here,
                "two claims have this name; names must be unique".into(),
            ));
        }
        for (field, v) in [("statement", &c.statement), ("source", &c.source)] {
            if v.get_ref().trim().is_empty() {
                return Err(bad(
                    v.span().start,
                    format!(
                        "`{field}` is empty: give the published words and where they were published"
                    ),
                ));
            }
        }
        let claim =
            check_one(&c, name.clone(), configs, axes, settings).map_err(|(p, m)| bad(p, m))?;
        out.push(claim);
    }
    Ok(out)
}

/// The checks serde cannot make, for one claim: `Err((byte offset, message with the fix))`.
fn check_one(
    c: &ClaimToml,
    name: String,
    configs: &[String],
    axes: &[&str],
    settings: &CompareSettings,
) -> Result<ClaimSpec, (usize, String)> {
    let expect = c.expect.get_ref().as_str();
    let expect_at = c.expect.span().start;
    if !PREDICATES.contains(&expect) {
        let hint = crate::recipe::presets::suggest(expect, &PREDICATES)
            .map(|s| format!(" (did you mean `{s}`?)"))
            .unwrap_or_default();
        return Err((
            expect_at,
            format!(
                "expect = \"{}\"{hint}: use one of {}",
                crate::recipe::shorten(expect),
                PREDICATES.join(", ")
            ),
        ));
    }
    // Keys that belong to one predicate only.
    let only = |key: &str, pos: Option<usize>, allowed: &[&str]| match pos {
        Some(p) if !allowed.contains(&expect) => Err((
            p,
            format!(
                "`{key}` is only read with expect = {}; remove it",
                allowed
                    .iter()
                    .map(|a| format!("\"{a}\""))
                    .collect::<Vec<_>>()
                    .join(" or ")
            ),
        )),
        _ => Ok(()),
    };
    only(
        "margin",
        c.margin.as_ref().map(|m| m.span().start),
        &["equivalent"],
    )?;
    only(
        "fold",
        c.fold.as_ref().map(|m| m.span().start),
        &["fold_within"],
    )?;
    only(
        "site",
        c.site.as_ref().map(|m| m.span().start),
        &["spike_rate_higher"],
    )?;
    only(
        "by",
        c.by.as_ref().map(|m| m.span().start),
        &["decreasing", "increasing"],
    )?;
    let trend = matches!(expect, "decreasing" | "increasing");
    if let (true, Some(v)) = (trend, &c.vs) {
        return Err((
            v.span().start,
            "`vs` is not read by a trend (it compares the listed configurations with each other); remove it".into(),
        ));
    }
    let metric = match (&c.metric, expect) {
        (Some(m), "spike_rate_higher") => {
            return Err((
                m.span().start,
                "spike_rate_higher counts gradient spikes and reads no metric; remove `metric` (narrow the sites with site = \"*experts*\")".into(),
            ));
        }
        (None, "spike_rate_higher") => String::new(),
        (Some(m), _) if !m.get_ref().trim().is_empty() => m.get_ref().trim().to_string(),
        (m, _) => {
            return Err((
                m.as_ref().map_or(expect_at, |m| m.span().start),
                format!(
                    "expect = \"{expect}\" needs the metric it is about, e.g. metric = \"train/train_rollout_kl\""
                ),
            ));
        }
    };
    let cfg_at = c.configs.as_ref().map_or(expect_at, |v| v.span().start);
    let globs: Vec<String> = c
        .configs
        .as_ref()
        .map(|v| v.get_ref().clone())
        .unwrap_or_default();
    for g in &globs {
        check_config(g, configs).map_err(|m| (cfg_at, m))?;
    }
    if let Some(v) = &c.vs {
        let vs = v.get_ref();
        if is_glob(vs) {
            return Err((
                v.span().start,
                format!(
                    "vs = \"{}\" is a pattern: name one configuration",
                    crate::recipe::shorten(vs)
                ),
            ));
        }
        check_config(vs, configs).map_err(|m| (v.span().start, m))?;
    }
    let predicate = match expect {
        "equivalent" => Predicate::Equivalent(match &c.margin {
            Some(m) => MarginRule::from_toml(m.get_ref().clone(), &metric)
                .map_err(|e| (m.span().start, e))?,
            None => settings.margin_rule(&metric).ok_or_else(|| {
                (
                    expect_at,
                    format!("expect = \"equivalent\" needs a margin: add margin = 0.05 (absolute), {{ of_level = 0.1 }} or {{ of_gain = 0.2 }}, or set one for `{metric}` in [checks.margins]"),
                )
            })?,
        }),
        "higher" | "lower" => Predicate::Higher(expect == "higher"),
        "fold_within" => {
            let Some(f) = &c.fold else {
                return Err((
                    expect_at,
                    "expect = \"fold_within\" needs fold = [LO, HI], e.g. fold = [0.67, 1.5]".into(),
                ));
            };
            match f.get_ref().as_slice() {
                [lo, hi] if lo.is_finite() && hi.is_finite() && *lo > 0.0 && lo < hi => {
                    Predicate::FoldWithin(*lo, *hi)
                }
                v => {
                    return Err((
                        f.span().start,
                        format!("fold = {v:?}: give two ratios 0 < LO < HI, e.g. fold = [0.67, 1.5]"),
                    ));
                }
            }
        }
        "spike_rate_higher" => {
            let site = c.site.as_ref().map(|s| s.get_ref().clone());
            if let (Some(s), Some(sp)) = (&site, &c.site) {
                crate::recipe::glob_matcher(s).map_err(|e| {
                    (sp.span().start, format!("site pattern `{}`: {e}", crate::recipe::shorten(s)))
                })?;
            }
            Predicate::SpikeRateHigher(site)
        }
        _ => {
            let by = c.by.as_ref().map(|b| b.get_ref().clone());
            match (&by, &c.by) {
                (Some(b), Some(sp)) if !axes.contains(&b.as_str()) => {
                    return Err((
                        sp.span().start,
                        format!(
                            "by = \"{}\": this suite sweeps {}; name one of its [sweep] axes, or drop `by` and list the configurations in order",
                            crate::recipe::shorten(b),
                            if axes.is_empty() { "nothing".to_string() } else { axes.join(", ") }
                        ),
                    ));
                }
                _ => {}
            }
            if by.is_none() {
                if globs.len() < 2 {
                    return Err((
                        cfg_at,
                        format!("expect = \"{expect}\" needs configs = [...] with at least two configurations in order, or by = AXIS to order them by a sweep axis"),
                    ));
                }
                if let Some(g) = globs.iter().find(|g| is_glob(g)) {
                    return Err((
                        cfg_at,
                        format!("`{}` is a pattern, and without `by` the order is the list's: name the configurations one by one, or add by = AXIS", crate::recipe::shorten(g)),
                    ));
                }
            } else if globs.is_empty() {
                return Err((
                    cfg_at,
                    format!("expect = \"{expect}\" needs configs = [...]: the configurations of the sweep"),
                ));
            }
            Predicate::Trend {
                decreasing: expect == "decreasing",
                by,
            }
        }
    };
    Ok(ClaimSpec {
        name,
        statement: c.statement.get_ref().trim().to_string(),
        source: c.source.get_ref().trim().to_string(),
        expect: expect.to_string(),
        metric,
        configs: globs,
        vs: c.vs.as_ref().map(|v| v.get_ref().clone()),
        predicate,
        gate: c.gate.unwrap_or(false),
    })
}

fn is_glob(s: &str) -> bool {
    s.contains(['*', '?', '[', '{']) && !s.contains(" [") // a sweep point's name, `nvfp4 [bf16_last=2]`
}

/// A configuration name or glob must name something the suite runs.
fn check_config(g: &str, configs: &[String]) -> Result<(), String> {
    if configs.is_empty() {
        return Ok(());
    }
    let base = g.split(" [").next().unwrap_or(g);
    if !is_glob(g) {
        return if configs.iter().any(|c| c == base) {
            Ok(())
        } else {
            let hint = crate::recipe::presets::suggest(
                base,
                &configs.iter().map(String::as_str).collect::<Vec<_>>(),
            )
            .map(|s| format!(" (did you mean `{s}`?)"))
            .unwrap_or_default();
            Err(format!(
                "`{}` is not a configuration of this suite{hint}; have: {}",
                crate::recipe::shorten(g),
                configs.join(", ")
            ))
        };
    }
    let m = crate::recipe::glob_matcher(g)
        .map_err(|e| format!("configs pattern `{}`: {e}", crate::recipe::shorten(g)))?;
    if configs.iter().any(|c| m.is_match(c)) {
        Ok(())
    } else {
        Err(format!(
            "configs pattern `{}` matches no configuration (have: {})",
            crate::recipe::shorten(g),
            configs.join(", ")
        ))
    }
}

/// One seed's reduction of a metric: the final-window mean and the first-window mean.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SeedValue {
    pub seed: u64,
    pub last: f64,
    pub first: f64,
}

/// Spikes counted at one site and layer over a configuration's seeds, and the steps judged.
#[derive(Debug, Clone, PartialEq)]
pub struct SiteSpikes {
    pub site: String,
    pub layer: i64,
    pub spikes: u64,
    pub steps: u64,
}

/// A configuration as claims see it: per-seed values and spike tallies, built by the comparison
/// from the runs (or by a test from known effects).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ClaimArm {
    pub config: String,
    pub base: String,
    pub axes: BTreeMap<String, String>,
    /// Usable runs' seeds, ascending.
    pub seeds: Vec<u64>,
    /// Every run came from the built-in engine, which couples the configurations of one seed.
    pub coupled: bool,
    /// Metric → per-seed values (finite, seed order).
    pub values: BTreeMap<String, Vec<SeedValue>>,
    pub spikes: Vec<SiteSpikes>,
}

impl ClaimArm {
    fn metric(&self, m: &str) -> &[SeedValue] {
        self.values.get(m).map_or(&[], |v| v.as_slice())
    }
}

/// A configuration by full name, else by base name with the given sweep values, else the base's
/// only sweep point (as checks resolve names).
fn resolve<'a>(
    arms: &'a [ClaimArm],
    name: &str,
    axes: &BTreeMap<String, String>,
) -> Option<&'a ClaimArm> {
    arms.iter()
        .find(|a| a.config == name)
        .or_else(|| arms.iter().find(|a| a.base == name && &a.axes == axes))
        .or_else(|| {
            let mut it = arms.iter().filter(|a| a.base == name);
            match (it.next(), it.next()) {
                (Some(a), None) => Some(a),
                _ => None,
            }
        })
}

/// Decide every claim. Pure: the same arms and settings give the same results.
pub fn evaluate(claims: &[ClaimSpec], arms: &[ClaimArm], s: &CompareSettings) -> Vec<ClaimResult> {
    claims.iter().map(|c| evaluate_one(c, arms, s)).collect()
}

/// A row before the multiplicity adjustment: its evidence and the raw p-value against the claim.
struct Row {
    ev: ClaimEvidence,
    reproduced: bool,
    p_against: f64,
}

fn evaluate_one(c: &ClaimSpec, arms: &[ClaimArm], s: &CompareSettings) -> ClaimResult {
    let vs_name = c.vs.clone().unwrap_or_else(|| s.baseline.clone());
    let (rows, predicate) = match &c.predicate {
        Predicate::Trend { decreasing, by } => {
            let (row, words) = trend_row(c, arms, *decreasing, by.as_deref(), s);
            (row.into_iter().collect::<Vec<_>>(), words)
        }
        _ => {
            let pairs = pairs(c, arms, &vs_name, s);
            let rows: Vec<Row> = pairs.iter().map(|(a, b)| pair_row(c, a, b, s)).collect();
            (rows, predicate_words(c, &vs_name))
        }
    };
    decide_claim(c, rows, predicate, s)
}

/// The claim's predicate in words.
fn predicate_words(c: &ClaimSpec, vs: &str) -> String {
    let f = super::expr::fmt_num;
    match &c.predicate {
        Predicate::Equivalent(m) => {
            let margin = match m {
                MarginRule::Absolute(v) => format!("±{}", f(*v)),
                MarginRule::OfLevel(v) => format!("±{} % of {vs}'s level", f(100.0 * v)),
                MarginRule::OfGain(v) => format!("±{} % of {vs}'s gain", f(100.0 * v)),
            };
            format!("{} equivalent to {vs} within {margin}", c.metric)
        }
        Predicate::Higher(true) => format!("{} higher than {vs}", c.metric),
        Predicate::Higher(false) => format!("{} lower than {vs}", c.metric),
        Predicate::FoldWithin(lo, hi) => {
            format!(
                "{} fold change over {vs} within [{}, {}]",
                c.metric,
                f(*lo),
                f(*hi)
            )
        }
        Predicate::SpikeRateHigher(site) => format!(
            "gradient spike rate{} higher than {vs}",
            site.as_ref()
                .map(|s| format!(" at {s}"))
                .unwrap_or_default()
        ),
        Predicate::Trend { .. } => String::new(),
    }
}

/// The (configuration, what it is held against) pairs of a two-arm claim.
fn pairs<'a>(
    c: &ClaimSpec,
    arms: &'a [ClaimArm],
    vs: &str,
    s: &CompareSettings,
) -> Vec<(&'a ClaimArm, &'a ClaimArm)> {
    let matchers: Vec<globset::GlobMatcher> = c
        .configs
        .iter()
        .filter_map(|g| crate::recipe::glob_matcher(g).ok())
        .collect();
    arms.iter()
        .filter(|a| {
            if matchers.is_empty() {
                a.base != s.baseline && a.base != vs && a.config != vs
            } else {
                c.configs.iter().any(|g| g == &a.config)
                    || matchers
                        .iter()
                        .any(|m| m.is_match(&a.config) || m.is_match(&a.base))
            }
        })
        .filter_map(|a| {
            let b = resolve(arms, vs, &a.axes)?;
            (b.config != a.config).then_some((a, b))
        })
        .collect()
}

/// The seed-level values of two arms on a metric: paired (same seeds, both coupled) or not.
struct Sample {
    x: Vec<f64>,
    y: Vec<f64>,
    xs: Vec<u64>,
    ys: Vec<u64>,
    paired: bool,
}

fn sample(a: &ClaimArm, b: &ClaimArm, metric: &str) -> Sample {
    let (va, vb) = (a.metric(metric), b.metric(metric));
    let xs: Vec<u64> = va.iter().map(|v| v.seed).collect();
    let ys: Vec<u64> = vb.iter().map(|v| v.seed).collect();
    Sample {
        x: va.iter().map(|v| v.last).collect(),
        y: vb.iter().map(|v| v.last).collect(),
        paired: a.coupled && b.coupled && xs == ys && xs.len() >= 2,
        xs,
        ys,
    }
}

/// `(d, se, df)` of `mean(x) - mean(y)`: the paired t over seeds or Welch, as the comparison.
fn diff_stats(x: &[f64], y: &[f64], paired: bool) -> (f64, f64, f64) {
    if paired {
        stats::paired(x, y)
    } else {
        stats::welch(x, y)
    }
}

fn test_name(paired: bool, log: bool) -> String {
    format!(
        "{}{}",
        if paired {
            "paired t over seeds"
        } else {
            "Welch t"
        },
        if log { ", log scale" } else { "" }
    )
}

fn inconclusive_row(config: &str, vs: &str, test: &str, scale: &str, reason: String) -> Row {
    Row {
        ev: ClaimEvidence {
            config: config.to_string(),
            vs: vs.to_string(),
            seeds: vec![],
            vs_seeds: vec![],
            test: test.to_string(),
            scale: scale.to_string(),
            interval: Interval {
                estimate: f64::NAN,
                lo: f64::NAN,
                hi: f64::NAN,
            },
            verdict: ClaimVerdict::Inconclusive,
            p_against: f64::NAN,
            reason,
        },
        reproduced: false,
        p_against: f64::NAN,
    }
}

/// One configuration against `vs`.
fn pair_row(c: &ClaimSpec, a: &ClaimArm, b: &ClaimArm, s: &CompareSettings) -> Row {
    if let Predicate::SpikeRateHigher(site) = &c.predicate {
        return spike_row(a, b, site.as_deref(), s);
    }
    let smp = sample(a, b, &c.metric);
    let n = smp.x.len().min(smp.y.len());
    if n < s.min_seeds {
        return inconclusive_row(
            &a.config,
            &b.config,
            &test_name(smp.paired, false),
            "difference",
            format!(
                "{} seed(s) of `{}` ({} has {}, {} has {}); at least {} per arm are needed",
                n,
                c.metric,
                a.config,
                smp.x.len(),
                b.config,
                smp.y.len(),
                s.min_seeds
            ),
        );
    }
    let positive = smp.x.iter().chain(&smp.y).all(|v| *v > 0.0);
    let log_scale = match c.predicate {
        Predicate::FoldWithin(..) => true,
        Predicate::Higher(_) => positive && analyze::is_kl_type(&c.metric),
        _ => false,
    };
    if log_scale && !positive {
        return inconclusive_row(
            &a.config,
            &b.config,
            &test_name(smp.paired, true),
            "fold",
            format!(
                "`{}` has values <= 0, so no fold change exists; use expect = \"higher\" or \"lower\"",
                c.metric
            ),
        );
    }
    let (x, y) = if log_scale {
        (
            smp.x.iter().map(|v| v.ln()).collect::<Vec<_>>(),
            smp.y.iter().map(|v| v.ln()).collect::<Vec<_>>(),
        )
    } else {
        (smp.x.clone(), smp.y.clone())
    };
    let (d, se, df) = diff_stats(&x, &y, smp.paired);
    let raw = if smp.paired {
        stats::paired_interval(&x, &y, s.alpha)
    } else {
        stats::welch_interval(&x, &y, s.alpha)
    };
    let interval = if log_scale {
        stats::exp_interval(raw)
    } else {
        raw
    };
    let f = super::expr::fmt_num;
    let shown = show(&interval, log_scale);
    let (reproduced, p_against, reason) = match &c.predicate {
        Predicate::Equivalent(rule) => {
            let hib = s.higher_is_better(&c.metric);
            let initials: Vec<f64> = b.metric(&c.metric).iter().map(|v| v.first).collect();
            match analyze::resolve_margin(*rule, &smp.y, &initials, hib, &b.config) {
                Err(e) => (false, f64::NAN, e),
                Ok((m, _)) => {
                    let dec = analyze::decide(&x, &y, Some(m), hib, smp.paired, s);
                    let p = above_p(d, se, df, m).min(above_p(-d, se, df, m));
                    (
                        dec.verdict == super::Verdict::Equivalent,
                        p,
                        format!("difference {shown} against ±{}: {}", f(m), dec.reason),
                    )
                }
            }
        }
        Predicate::Higher(up) => {
            let (lo, hi) = if log_scale {
                (raw.lo, raw.hi)
            } else {
                (interval.lo, interval.hi)
            };
            let ok = if *up { lo > 0.0 } else { hi < 0.0 };
            let p = if *up {
                above_p(-d, se, df, 0.0)
            } else {
                above_p(d, se, df, 0.0)
            };
            let what = if log_scale { "fold" } else { "difference" };
            (ok, p, format!("{what} {shown}"))
        }
        Predicate::FoldWithin(lo, hi) => {
            let (llo, lhi) = (lo.ln(), hi.ln());
            let ok = raw.lo > llo && raw.hi < lhi;
            let p = above_p(d, se, df, lhi).min(above_p(-d, se, df, -llo));
            (
                ok,
                p,
                format!("fold {shown} against [{}, {}]", f(*lo), f(*hi)),
            )
        }
        _ => (false, f64::NAN, String::new()),
    };
    Row {
        ev: ClaimEvidence {
            config: a.config.clone(),
            vs: b.config.clone(),
            seeds: smp.xs,
            vs_seeds: smp.ys,
            test: test_name(smp.paired, log_scale),
            scale: if log_scale { "fold" } else { "difference" }.into(),
            interval,
            verdict: ClaimVerdict::Inconclusive,
            p_against,
            reason,
        },
        reproduced,
        p_against,
    }
}

fn above_p(d: f64, se: f64, df: f64, bound: f64) -> f64 {
    stats::above_p(d, se, df, bound)
}

/// An estimate with its interval, as a fold (`2.1x [1.5x, 3.0x]`) or a difference.
fn show(i: &Interval, fold: bool) -> String {
    let f = super::expr::fmt_num;
    if fold {
        let fx = |v: f64| {
            if v >= 10.0 {
                format!("{v:.0}x")
            } else {
                format!("{v:.2}x")
            }
        };
        format!("{} [{}, {}]", fx(i.estimate), fx(i.lo), fx(i.hi))
    } else {
        format!("{} [{}, {}]", f(i.estimate), f(i.lo), f(i.hi))
    }
}

fn site_matches(glob: Option<&str>, site: &str, layer: i64) -> bool {
    let Some(g) = glob else { return true };
    let Ok(m) = crate::recipe::glob_matcher(g) else {
        return false;
    };
    m.is_match(site) || m.is_match(format!("decoder.layers.{layer}.{site}"))
}

/// Spikes per judged step of `a` over `b`: the exact conditional-binomial rate ratio.
fn spike_row(a: &ClaimArm, b: &ClaimArm, site: Option<&str>, s: &CompareSettings) -> Row {
    let total = |arm: &ClaimArm| {
        arm.spikes
            .iter()
            .filter(|t| site_matches(site, &t.site, t.layer))
            .fold((0u64, 0u64), |acc, t| (acc.0 + t.spikes, acc.1 + t.steps))
    };
    let test = "exact conditional binomial (Clopper-Pearson)";
    let n = a.seeds.len().min(b.seeds.len());
    let ((ka, ea), (kb, eb)) = (total(a), total(b));
    if n < s.min_seeds || ea == 0 || eb == 0 {
        let why = if n < s.min_seeds {
            format!("{n} seed(s) per arm; at least {} are needed", s.min_seeds)
        } else {
            "no per-layer gradient norms to count spikes in".to_string()
        };
        return inconclusive_row(&a.config, &b.config, test, "rate ratio", why);
    }
    let interval = stats::rate_ratio_interval(ka, ea as f64, kb, eb as f64, s.alpha);
    let (_, p_lower) = stats::rate_ratio_p(ka, ea as f64, kb, eb as f64);
    let f = super::expr::fmt_num;
    Row {
        ev: ClaimEvidence {
            config: a.config.clone(),
            vs: b.config.clone(),
            seeds: a.seeds.clone(),
            vs_seeds: b.seeds.clone(),
            test: test.into(),
            scale: "rate ratio".into(),
            interval,
            verdict: ClaimVerdict::Inconclusive,
            p_against: p_lower,
            reason: format!(
                "{ka} spikes in {ea} judged steps against {kb} in {eb}: rate ratio {} [{}, {}]",
                f(interval.estimate),
                f(interval.lo),
                f(interval.hi)
            ),
        },
        reproduced: interval.lo > 1.0,
        p_against: p_lower,
    }
}

/// The configurations of a trend in order: as listed, or matched and ordered by a sweep axis.
fn trend_arms<'a>(
    c: &ClaimSpec,
    arms: &'a [ClaimArm],
    by: Option<&str>,
) -> Result<Vec<&'a ClaimArm>, String> {
    let Some(axis) = by else {
        return c
            .configs
            .iter()
            .map(|n| {
                resolve(arms, n, &BTreeMap::new())
                    .ok_or_else(|| format!("no runs of `{n}` (or it names several sweep points)"))
            })
            .collect();
    };
    let matchers: Vec<globset::GlobMatcher> = c
        .configs
        .iter()
        .filter_map(|g| crate::recipe::glob_matcher(g).ok())
        .collect();
    let mut picked: Vec<(&ClaimArm, &String)> = arms
        .iter()
        .filter(|a| {
            c.configs.iter().any(|g| g == &a.config)
                || matchers
                    .iter()
                    .any(|m| m.is_match(&a.config) || m.is_match(&a.base))
        })
        .filter_map(|a| a.axes.get(axis).map(|v| (a, v)))
        .collect();
    let key = |v: &String| v.parse::<f64>().unwrap_or(f64::NAN);
    if picked.iter().any(|(_, v)| key(v).is_nan()) {
        picked.sort_by(|p, q| p.1.cmp(q.1));
    } else {
        picked.sort_by(|p, q| key(p.1).total_cmp(&key(q.1)));
    }
    if picked.windows(2).any(|w| w[0].1 == w[1].1) {
        return Err(format!(
            "several matched configurations share a value of `{axis}`; narrow configs to one per value"
        ));
    }
    Ok(picked.into_iter().map(|(a, _)| a).collect())
}

/// A trend over ordered configurations: the linear contrast on ranks.
fn trend_row(
    c: &ClaimSpec,
    arms: &[ClaimArm],
    decreasing: bool,
    by: Option<&str>,
    s: &CompareSettings,
) -> (Option<Row>, String) {
    let dir = if decreasing { "decreases" } else { "increases" };
    let along = by.map(|b| format!(" as `{b}` grows")).unwrap_or_default();
    let mut words = format!("{} {dir}{along} along {}", c.metric, c.configs.join(", "));
    let test = "linear trend contrast on ranks";
    let picked = match trend_arms(c, arms, by) {
        Ok(p) => p,
        Err(e) => {
            return (
                Some(inconclusive_row(
                    &c.configs.join(" < "),
                    "",
                    test,
                    "per step",
                    e,
                )),
                words,
            );
        }
    };
    let order = picked
        .iter()
        .map(|a| a.config.as_str())
        .collect::<Vec<_>>()
        .join(" → ");
    words = format!("{} {dir} along {order}", c.metric);
    let label = picked
        .iter()
        .map(|a| a.config.as_str())
        .collect::<Vec<_>>()
        .join(" < ");
    let vals: Vec<&[SeedValue]> = picked.iter().map(|a| a.metric(&c.metric)).collect();
    let n = vals.iter().map(|v| v.len()).min().unwrap_or(0);
    if picked.len() < 2 || n < s.min_seeds {
        let why = if picked.len() < 2 {
            format!(
                "{} configuration(s) found; a trend needs two or more",
                picked.len()
            )
        } else {
            format!(
                "{n} seed(s) of `{}` in the sparsest configuration; at least {} are needed",
                c.metric, s.min_seeds
            )
        };
        return (
            Some(inconclusive_row(&label, "", test, "per step", why)),
            words,
        );
    }
    let seeds0: Vec<u64> = vals[0].iter().map(|v| v.seed).collect();
    let paired = picked.iter().all(|a| a.coupled)
        && vals
            .iter()
            .all(|v| v.iter().map(|x| x.seed).eq(seeds0.iter().copied()));
    let positive = vals.iter().all(|v| v.iter().all(|x| x.last > 0.0));
    let log_scale = positive && analyze::is_kl_type(&c.metric);
    let groups: Vec<Vec<f64>> = vals
        .iter()
        .map(|v| {
            v.iter()
                .map(|x| if log_scale { x.last.ln() } else { x.last })
                .collect()
        })
        .collect();
    let k = groups.len();
    let w: Vec<f64> = (0..k).map(|i| i as f64 - (k - 1) as f64 / 2.0).collect();
    let ss: f64 = w.iter().map(|c| c * c).sum();
    let (l, se, df) = stats::contrast(&groups, &w, paired);
    let (slope, se) = (l / ss, se / ss);
    let raw = stats::t_interval(slope, se, df, s.alpha);
    let interval = if log_scale {
        stats::exp_interval(raw)
    } else {
        raw
    };
    let reproduced = if decreasing {
        raw.hi < 0.0
    } else {
        raw.lo > 0.0
    };
    let p_against = if decreasing {
        above_p(slope, se, df, 0.0)
    } else {
        above_p(-slope, se, df, 0.0)
    };
    let seeds = if paired {
        seeds0
    } else {
        picked
            .iter()
            .flat_map(|a| a.seeds.clone())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect()
    };
    let scale = if log_scale {
        "fold per step"
    } else {
        "slope per step"
    };
    let row = Row {
        ev: ClaimEvidence {
            config: label,
            vs: String::new(),
            seeds,
            vs_seeds: vec![],
            test: format!(
                "{test}, {}{}",
                if paired {
                    "paired t over seeds"
                } else {
                    "Welch-Satterthwaite t"
                },
                if log_scale { ", log scale" } else { "" }
            ),
            scale: scale.into(),
            interval,
            verdict: ClaimVerdict::Inconclusive,
            p_against,
            reason: format!("{scale} {}", show(&interval, log_scale)),
        },
        reproduced,
        p_against,
    };
    (Some(row), words)
}

/// Combine a claim's rows: reproduced when every row is (an intersection-union test, each at
/// alpha); contradicted when Holm's adjustment over the rows' p-values against the claim rejects
/// at least one; inconclusive otherwise.
fn decide_claim(
    c: &ClaimSpec,
    mut rows: Vec<Row>,
    predicate: String,
    s: &CompareSettings,
) -> ClaimResult {
    let raw: Vec<f64> = rows.iter().map(|r| r.p_against).collect();
    let adj = stats::holm(&raw);
    for (r, p) in rows.iter_mut().zip(adj) {
        r.ev.p_against = if r.p_against.is_nan() { f64::NAN } else { p };
        r.ev.verdict = if r.p_against.is_finite() && p < s.alpha {
            ClaimVerdict::Contradicted
        } else if r.reproduced {
            ClaimVerdict::Reproduced
        } else {
            ClaimVerdict::Inconclusive
        };
    }
    let verdict = if rows.is_empty() {
        ClaimVerdict::Inconclusive
    } else if rows
        .iter()
        .any(|r| r.ev.verdict == ClaimVerdict::Contradicted)
    {
        ClaimVerdict::Contradicted
    } else if rows
        .iter()
        .all(|r| r.ev.verdict == ClaimVerdict::Reproduced)
    {
        ClaimVerdict::Reproduced
    } else {
        ClaimVerdict::Inconclusive
    };
    let evidence = if rows.is_empty() {
        format!(
            "no configuration matched {} in these runs",
            if c.configs.is_empty() {
                "(all but the baseline)".to_string()
            } else {
                c.configs.join(", ")
            }
        )
    } else {
        rows.iter()
            .map(|r| {
                let who = if r.ev.vs.is_empty() {
                    r.ev.config.clone()
                } else {
                    format!("{} vs {}", r.ev.config, r.ev.vs)
                };
                format!(
                    "{who}: {} ({}, {} seeds{})",
                    r.ev.reason,
                    r.ev.test,
                    r.ev.seeds.len(),
                    if r.ev.verdict == ClaimVerdict::Contradicted {
                        format!(
                            ", against the claim at Holm-adjusted p = {:.3}",
                            r.ev.p_against
                        )
                    } else {
                        String::new()
                    }
                )
            })
            .collect::<Vec<_>>()
            .join("; ")
    };
    ClaimResult {
        name: c.name.clone(),
        statement: c.statement.clone(),
        source: c.source.clone(),
        expect: c.expect.clone(),
        metric: c.metric.clone(),
        predicate,
        verdict,
        evidence,
        gate: c.gate,
        rows: rows.into_iter().map(|r| r.ev).collect(),
    }
}

/// How claims are decided, for the comparison's method text.
pub fn method(s: &CompareSettings) -> Vec<String> {
    let level = 100.0 * (1.0 - 2.0 * s.alpha);
    vec![
        format!(
            "Claims (published findings): each is decided `reproduced`, `contradicted` or `inconclusive` from the same per-seed final-window values, with one-sided tests at alpha {} read off {level:.0} % intervals, and fewer than {} seeds per arm is inconclusive. `equivalent`: the comparison's TOST (paired or Welch) against the claim's margin, with the seeds the margin needs; contradicted when the interval lies wholly outside ±margin. `higher`/`lower`: the difference's interval (for KL-type metrics the log ratio's, i.e. a fold change of geometric means) wholly above or below 0; contradicted when it is wholly on the other side. `fold_within = [lo, hi]`: TOST on the log scale, the fold change's interval inside [lo, hi]; contradicted when wholly outside. `spike_rate_higher`: the exact conditional-binomial (Clopper-Pearson) interval of the spike rate ratio above 1; contradicted when the exact test says lower.",
            s.alpha, s.min_seeds
        ),
        "Trends (`decreasing`/`increasing`): a linear contrast over the configurations' ranks in sweep order (scores centred on the middle rank), i.e. the least-squares slope of the per-configuration means per sweep step, on the log scale for KL-type metrics; paired t over seeds when every configuration ran the same seeds on the built-in engine (the contrast is taken seed by seed), else Welch-Satterthwaite. It tests a trend, not that every step goes down.".to_string(),
        format!(
            "Several configurations in one claim: the claim is reproduced only when every configuration is (an intersection-union test: each at alpha, so the claim's false-reproduction rate stays at most {}); it is contradicted when Holm's step-down adjustment over its configurations' p-values against it still leaves one below alpha (family-wise error at most {}). Claims are not adjusted against each other: each claim holds its own error rate. On a night with sequential seeds the claims' tests are fixed-sample tests on the seeds the night reached. A claim changes the night's verdict only with `gate = true` (a contradicted gated claim is a regression).",
            s.alpha, s.alpha
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    const SUITE: &str = "name = \"t\"\nseeds = [0]\n[workload]\nsteps = 3\n[[configs]]\nname = \"bf16\"\nrecipe = \"bf16\"\n[[configs]]\nname = \"nvfp4-dq\"\nrecipe = \"nvfp4-dq\"\n[[configs]]\nname = \"nvfp4-hp\"\nrecipe = \"nvfp4-hp\"\n[sweep]\nbf16_last = [1, 2]\n";

    fn cfgs() -> Vec<String> {
        vec!["bf16".into(), "nvfp4-dq".into(), "nvfp4-hp".into()]
    }

    fn parse_claims(claims: &str) -> Result<Vec<ClaimSpec>, String> {
        let text = format!("{SUITE}{claims}");
        parse(
            &text,
            true,
            "s.toml",
            &cfgs(),
            &["bf16_last"],
            &CompareSettings::default(),
        )
        .map_err(|e| e.to_string())
    }

    const HEAD: &str = "[[claims]]\nname = \"c\"\nstatement = \"s\"\nsource = \"src\"\n";

    #[test]
    fn every_predicate_parses() {
        let text = [
            "expect = \"equivalent\"\nmetric = \"rollout/raw_reward\"\nmargin = { of_gain = 0.2 }\nconfigs = [\"nvfp4*\"]\n",
            "expect = \"higher\"\nmetric = \"train/train_rollout_kl\"\n",
            "expect = \"lower\"\nmetric = \"train/train_rollout_kl\"\nconfigs = [\"nvfp4-dq\"]\nvs = \"nvfp4-hp\"\n",
            "expect = \"fold_within\"\nmetric = \"train/train_rollout_kl\"\nfold = [0.67, 1.5]\nconfigs = [\"nvfp4-dq\"]\nvs = \"nvfp4-hp\"\n",
            "expect = \"spike_rate_higher\"\nconfigs = [\"nvfp4-hp\"]\nvs = \"nvfp4-dq\"\nsite = \"*experts*\"\ngate = true\n",
            "expect = \"decreasing\"\nmetric = \"train/train_rollout_kl\"\nconfigs = [\"nvfp4-dq\"]\nby = \"bf16_last\"\n",
            "expect = \"increasing\"\nmetric = \"rollout/raw_reward\"\nconfigs = [\"nvfp4-hp\", \"nvfp4-dq\"]\n",
        ];
        let all: String = text
            .iter()
            .enumerate()
            .map(|(i, t)| HEAD.replace("\"c\"", &format!("\"c{i}\"")) + t)
            .collect();
        let c = parse_claims(&all).unwrap();
        assert_eq!(c.len(), 7);
        assert_eq!(
            c[0].predicate,
            Predicate::Equivalent(MarginRule::OfGain(0.2))
        );
        assert_eq!(c[3].predicate, Predicate::FoldWithin(0.67, 1.5));
        assert_eq!(c[3].vs.as_deref(), Some("nvfp4-hp"));
        assert!(c[4].gate && !c[0].gate);
        assert_eq!(
            c[5].predicate,
            Predicate::Trend {
                decreasing: true,
                by: Some("bf16_last".into())
            }
        );
    }

    #[test]
    fn bad_claims_are_located_and_say_the_fix() {
        // Line 19 is `expect = ...` (the suite is 15 lines, the claim's head 4).
        let cases = [
            (
                "expect = \"hgher\"\nmetric = \"m\"\n",
                ":20:10:",
                "did you mean `higher`",
            ),
            (
                "expect = \"higher\"\nmetrc = \"m\"\n",
                ":21:1:",
                "did you mean `metric`",
            ),
            ("expect = \"higher\"\n", ":20:10:", "needs the metric"),
            (
                "expect = \"higher\"\nmetric = \"m\"\nconfigs = [\"fp32\"]\n",
                ":22:11:",
                "not a configuration",
            ),
            (
                "expect = \"higher\"\nmetric = \"m\"\nfold = [1, 2]\n",
                ":22:8:",
                "only read with",
            ),
            (
                "expect = \"fold_within\"\nmetric = \"m\"\nfold = [2, 1]\n",
                ":22:8:",
                "0 < LO < HI",
            ),
            (
                "expect = \"equivalent\"\nmetric = \"m\"\n",
                ":20:10:",
                "needs a margin",
            ),
            (
                "expect = \"equivalent\"\nmetric = \"m\"\nmargin = -1\n",
                ":22:10:",
                "positive",
            ),
            (
                "expect = \"decreasing\"\nmetric = \"m\"\nconfigs = [\"bf16\", \"nvfp4*\"]\n",
                ":22:11:",
                "is a pattern",
            ),
            (
                "expect = \"decreasing\"\nmetric = \"m\"\nconfigs = [\"nvfp4-dq\"]\nby = \"layers\"\n",
                ":23:6:",
                "this suite sweeps bf16_last",
            ),
            (
                "expect = \"spike_rate_higher\"\nmetric = \"m\"\n",
                ":21:10:",
                "reads no metric",
            ),
            (
                "expect = \"higher\"\nmetric = \"m\"\nvs = \"nvfp4*\"\n",
                ":22:6:",
                "is a pattern",
            ),
        ];
        for (body, at, says) in cases {
            let e = parse_claims(&format!("{HEAD}{body}")).unwrap_err();
            assert!(e.starts_with(&format!("s.toml{at} [[claims]]")), "{e}");
            assert!(e.contains(says), "{e}");
            assert_eq!(e.lines().count(), 1, "{e}");
        }
        let e = parse_claims(&format!(
            "{HEAD}expect = \"higher\"\nmetric = \"m\"\n{HEAD}expect = \"lower\"\nmetric = \"m\"\n"
        ))
        .unwrap_err();
        assert!(
            e.contains("names must be unique") && e.contains(":23:8:"),
            "{e}"
        );
        let e = parse_claims(&format!(
            "{}expect = \"higher\"\nmetric = \"m\"\n",
            HEAD.replace("\"s\"", "\"\"")
        ))
        .unwrap_err();
        assert!(e.contains("`statement` is empty"), "{e}");
    }

    fn arm(config: &str, vals: &[f64], coupled: bool) -> ClaimArm {
        ClaimArm {
            config: config.into(),
            base: config.into(),
            seeds: (0..vals.len() as u64).collect(),
            coupled,
            values: [(
                "train/train_rollout_kl".to_string(),
                vals.iter()
                    .enumerate()
                    .map(|(i, v)| SeedValue {
                        seed: i as u64,
                        last: *v,
                        first: *v,
                    })
                    .collect(),
            )]
            .into(),
            ..Default::default()
        }
    }

    fn claim(predicate: Predicate, configs: &[&str], vs: Option<&str>) -> ClaimSpec {
        ClaimSpec {
            name: "c".into(),
            statement: "s".into(),
            source: "src".into(),
            expect: "x".into(),
            metric: "train/train_rollout_kl".into(),
            configs: configs.iter().map(|c| c.to_string()).collect(),
            vs: vs.map(str::to_string),
            predicate,
            gate: false,
        }
    }

    #[test]
    fn a_fold_change_is_read_on_the_log_scale() {
        let s = CompareSettings::default();
        let b = arm("bf16", &[1e-4, 1.2e-4, 0.9e-4, 1.1e-4], true);
        let x = arm("nvfp4-dq", &[4e-3, 4.4e-3, 3.7e-3, 4.3e-3], true);
        let arms = vec![b, x];
        let higher = evaluate(&[claim(Predicate::Higher(true), &[], None)], &arms, &s);
        assert_eq!(
            higher[0].verdict,
            ClaimVerdict::Reproduced,
            "{:?}",
            higher[0]
        );
        let r = &higher[0].rows[0];
        assert_eq!(
            (r.scale.as_str(), r.test.as_str()),
            ("fold", "paired t over seeds, log scale")
        );
        assert!((30.0..50.0).contains(&r.interval.estimate), "{r:?}");
        let lower = evaluate(&[claim(Predicate::Higher(false), &[], None)], &arms, &s);
        assert_eq!(lower[0].verdict, ClaimVerdict::Contradicted);
        let within = evaluate(
            &[claim(Predicate::FoldWithin(20.0, 80.0), &[], None)],
            &arms,
            &s,
        );
        assert_eq!(
            within[0].verdict,
            ClaimVerdict::Reproduced,
            "{:?}",
            within[0]
        );
        let outside = evaluate(
            &[claim(Predicate::FoldWithin(0.67, 1.5), &[], None)],
            &arms,
            &s,
        );
        assert_eq!(outside[0].verdict, ClaimVerdict::Contradicted);
        // Fewer seeds than `min_seeds`: inconclusive, whatever the numbers.
        let two = vec![
            arm("bf16", &[1e-4, 1.1e-4], true),
            arm("nvfp4-dq", &[4e-3, 4.1e-3], true),
        ];
        let r = evaluate(&[claim(Predicate::Higher(true), &[], None)], &two, &s);
        assert_eq!(r[0].verdict, ClaimVerdict::Inconclusive);
        assert!(r[0].evidence.contains("at least 3"), "{}", r[0].evidence);
    }

    #[test]
    fn a_trend_follows_the_listed_order() {
        let s = CompareSettings::default();
        let arms = vec![
            arm("a", &[4.0, 4.2, 3.9, 4.1], true),
            arm("b", &[2.0, 2.2, 1.9, 2.1], true),
            arm("c", &[1.0, 1.1, 0.9, 1.0], true),
        ];
        let dec = |d: bool, order: &[&str]| {
            evaluate(
                &[claim(
                    Predicate::Trend {
                        decreasing: d,
                        by: None,
                    },
                    order,
                    None,
                )],
                &arms,
                &s,
            )
            .remove(0)
        };
        let r = dec(true, &["a", "b", "c"]);
        assert_eq!(r.verdict, ClaimVerdict::Reproduced, "{r:?}");
        assert_eq!(r.rows[0].config, "a < b < c");
        // Halving per step: the fold per step is about 0.5.
        assert!(
            (r.rows[0].interval.estimate - 0.5).abs() < 0.05,
            "{:?}",
            r.rows[0]
        );
        assert_eq!(
            dec(true, &["c", "b", "a"]).verdict,
            ClaimVerdict::Contradicted
        );
        assert_eq!(
            dec(false, &["c", "b", "a"]).verdict,
            ClaimVerdict::Reproduced
        );
        let missing = dec(true, &["a", "zz"]);
        assert_eq!(missing.verdict, ClaimVerdict::Inconclusive);
        assert!(
            missing.evidence.contains("no runs of `zz`"),
            "{}",
            missing.evidence
        );
    }

    #[test]
    fn equivalence_uses_the_comparisons_tost() {
        let s = CompareSettings::default();
        let mut b = arm("bf16", &[0.50, 0.52, 0.49, 0.51, 0.50, 0.48], true);
        let mut x = arm("mxfp8", &[0.505, 0.515, 0.495, 0.51, 0.505, 0.485], true);
        for a in [&mut b, &mut x] {
            let v = a.values.remove("train/train_rollout_kl").unwrap();
            a.values.insert("rollout/raw_reward".into(), v);
        }
        let mut c = claim(Predicate::Equivalent(MarginRule::Absolute(0.05)), &[], None);
        c.metric = "rollout/raw_reward".into();
        let arms = vec![b, x];
        let r = evaluate(std::slice::from_ref(&c), &arms, &s).remove(0);
        assert_eq!(r.verdict, ClaimVerdict::Reproduced, "{r:?}");
        c.predicate = Predicate::Equivalent(MarginRule::Absolute(0.001));
        let r = evaluate(&[c], &arms, &s).remove(0);
        assert_ne!(r.verdict, ClaimVerdict::Reproduced, "{r:?}");
    }
}

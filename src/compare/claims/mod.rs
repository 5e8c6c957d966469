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
//!                            # | decreasing | increasing | batch_invariant
//! metric = "train/train_rollout_kl"        # every predicate but spike_rate_higher
//! configs = ["mxfp8*", "nvfp4*"]           # names or globs (default: all but `vs`)
//! vs = "bf16"                # what they are held against (default: the suite's baseline)
//! gate = false               # true: a contradicted claim fails the night
//! # margin = 0.05 | { of_level = 0.1 } | { of_gain = 0.2 }   equivalent (default: [checks]')
//! # fold = [0.67, 1.5]                                        fold_within
//! # site = "*experts*"                                        spike_rate_higher (default: all)
//! # by = "bf16_last"         decreasing/increasing: order the configs by this sweep axis
//! # format = "nvfp4-per-token"                                batch_invariant
//! ```
//!
//! `expect = "batch_invariant"` with `format = "nvfp4-per-token"` (no metric, configs or vs) is
//! decided on the quantizer alone, without runs: see [`quantizer`].
//!
//! [`parse`] reads and checks the table; this module decides. Every test is one-sided at the
//! suite's alpha, so its interval is the comparison's two-sided `1 - 2·alpha` interval; see
//! [`method`] for the tests and how several configurations of one claim are combined.

pub mod parse;
pub mod quantizer;

pub use parse::{from_spec, parse};

use super::analyze;
use super::result::{ClaimEvidence, ClaimResult, ClaimVerdict, Interval};
use super::settings::{CompareSettings, MarginRule};
use super::stats;
use std::collections::BTreeMap;

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
    /// A token quantized in this activation format (a name in [`quantizer::FORMATS`]) comes out
    /// the same alone and inside any batch.
    BatchInvariant(String),
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
    /// Stored bytes of the model's matmul weights under the configuration's recipe, when known.
    pub weight_bytes: Option<f64>,
    pub spikes: Vec<SiteSpikes>,
}

impl ClaimArm {
    fn metric(&self, m: &str) -> &[SeedValue] {
        self.values.get(m).map_or(&[], |v| v.as_slice())
    }
}

/// A configuration by base name with the given sweep and variant values (so a variant is held
/// against the same variant of `vs`), else by full name, else the base's only sweep point.
fn resolve<'a>(
    arms: &'a [ClaimArm],
    name: &str,
    axes: &BTreeMap<String, String>,
) -> Option<&'a ClaimArm> {
    arms.iter()
        .find(|a| a.base == name && &a.axes == axes)
        .or_else(|| arms.iter().find(|a| a.config == name))
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
        Predicate::BatchInvariant(format) => (
            vec![batch_invariant_row(format)],
            format!("a token's {format} codes are the same alone and inside any batch"),
        ),
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
        Predicate::Trend { .. } | Predicate::BatchInvariant(_) => String::new(),
    }
}

/// Whether a claim's `configs` (names and globs) pick `arm`: by its full name, or by a pattern
/// over its name or base (every sweep point of a base). A configuration's variants (other
/// workload conditions: policy lag, task) are picked only by their full name, so a claim about
/// `nvfp4-dq` stays a claim about its plain runs.
fn picked(arm: &ClaimArm, names: &[String], matchers: &[globset::GlobMatcher]) -> bool {
    if names.iter().any(|g| g == &arm.config) {
        return true;
    }
    let variant = crate::suite::spec::VARIANT_AXES
        .iter()
        .any(|k| arm.axes.contains_key(*k));
    !variant
        && matchers
            .iter()
            .any(|m| m.is_match(&arm.config) || m.is_match(&arm.base))
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
                picked(a, &c.configs, &matchers)
            }
        })
        .filter_map(|a| {
            let b = resolve(arms, vs, &a.axes)?;
            (b.config != a.config).then_some((a, b))
        })
        .collect()
}

/// The seed-level values of two arms on a metric, paired or not.
struct Sample {
    x: Vec<f64>,
    y: Vec<f64>,
    /// The seeds behind `x` and `y` (the common seeds when paired).
    xs: Vec<u64>,
    ys: Vec<u64>,
    /// How the test pairs the arms (and so what it is called).
    pairing: Pairing,
}

/// Whether arms are paired seed by seed, and over which seeds.
#[derive(Debug, Clone, PartialEq)]
enum Pairing {
    /// Welch: the arms are not coupled, or share too few seeds.
    None,
    /// Every arm ran the same seeds.
    AllSeeds,
    /// Over the seeds every arm ran: their count, and each arm's own count.
    Common(usize, Vec<usize>),
}

impl Pairing {
    fn paired(&self) -> bool {
        *self != Pairing::None
    }

    /// The t test's name, e.g. "paired t over the 9 common seeds (of 12 and 9)".
    fn test(&self, welch: &str) -> String {
        match self {
            Pairing::None => welch.to_string(),
            Pairing::AllSeeds => "paired t over seeds".to_string(),
            Pairing::Common(n, each) => {
                let each: Vec<String> = each.iter().map(usize::to_string).collect();
                format!(
                    "paired t over the {n} common seeds (of {})",
                    join_words(&each)
                )
            }
        }
    }
}

/// `a`, `a and b`, `a, b and c`.
fn join_words(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [head @ .., last] => format!("{} and {last}", head.join(", ")),
    }
}

/// The seeds every one of `arms` has a value for, ascending.
fn common_seeds(arms: &[&[SeedValue]]) -> Vec<u64> {
    let Some((first, rest)) = arms.split_first() else {
        return Vec::new();
    };
    let mut seeds: Vec<u64> = first
        .iter()
        .map(|v| v.seed)
        .filter(|s| rest.iter().all(|r| r.iter().any(|v| v.seed == *s)))
        .collect();
    seeds.sort_unstable();
    seeds.dedup();
    seeds
}

/// How arms on the built-in engine (coupled: one seed gives every configuration the same prompts
/// and sampling stream) are paired: over the seeds they all ran, when those are enough for a
/// verdict (sequential seeds often leave the baseline with more seeds than the others); else not.
fn pairing_of(vals: &[&[SeedValue]], coupled: bool, min_seeds: usize) -> (Pairing, Vec<u64>) {
    let common = common_seeds(vals);
    if !coupled || common.len() < min_seeds.max(2) {
        return (Pairing::None, common);
    }
    if vals.iter().all(|v| v.len() == common.len()) {
        return (Pairing::AllSeeds, common);
    }
    let each = vals.iter().map(|v| v.len()).collect();
    (Pairing::Common(common.len(), each), common)
}

/// The values of `vals` at `seeds`, in seed order.
fn at_seeds(vals: &[SeedValue], seeds: &[u64]) -> Vec<f64> {
    seeds
        .iter()
        .filter_map(|s| vals.iter().find(|v| v.seed == *s).map(|v| v.last))
        .collect()
}

fn sample(a: &ClaimArm, b: &ClaimArm, metric: &str, min_seeds: usize) -> Sample {
    let (va, vb) = (a.metric(metric), b.metric(metric));
    let (pairing, common) = pairing_of(&[va, vb], a.coupled && b.coupled, min_seeds);
    if pairing.paired() {
        return Sample {
            x: at_seeds(va, &common),
            y: at_seeds(vb, &common),
            xs: common.clone(),
            ys: common,
            pairing,
        };
    }
    Sample {
        x: va.iter().map(|v| v.last).collect(),
        y: vb.iter().map(|v| v.last).collect(),
        xs: va.iter().map(|v| v.seed).collect(),
        ys: vb.iter().map(|v| v.seed).collect(),
        pairing,
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

fn test_name(pairing: &Pairing, log: bool) -> String {
    let log = if log { ", log scale" } else { "" };
    format!("{}{log}", pairing.test("Welch t"))
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
    let smp = sample(a, b, &c.metric, s.min_seeds);
    let n = smp.x.len().min(smp.y.len());
    if n < s.min_seeds {
        return inconclusive_row(
            &a.config,
            &b.config,
            &test_name(&smp.pairing, false),
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
            &test_name(&smp.pairing, true),
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
    let paired = smp.pairing.paired();
    let (d, se, df) = diff_stats(&x, &y, paired);
    let raw = if paired {
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
            // A relative margin comes from every seed `vs` ran, paired or not.
            let vb = b.metric(&c.metric);
            let finals: Vec<f64> = vb.iter().map(|v| v.last).collect();
            let initials: Vec<f64> = vb.iter().map(|v| v.first).collect();
            match analyze::resolve_margin(*rule, &finals, &initials, hib, &b.config) {
                Err(e) => (false, f64::NAN, e),
                Ok((m, how)) => {
                    let dec = analyze::decide(&x, &y, Some(m), hib, paired, s);
                    let p = stats::above_p(d, se, df, m).min(stats::above_p(-d, se, df, m));
                    let reason = match rule {
                        MarginRule::Absolute(_) => dec.reason,
                        _ => format!("margin {how}; {}", dec.reason),
                    };
                    (dec.verdict == super::Verdict::Equivalent, p, reason)
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
                stats::above_p(-d, se, df, 0.0)
            } else {
                stats::above_p(d, se, df, 0.0)
            };
            let what = if log_scale { "fold" } else { "difference" };
            (ok, p, format!("{what} {shown}{}", weight_cost(a, b)))
        }
        Predicate::FoldWithin(lo, hi) => {
            let (llo, lhi) = (lo.ln(), hi.ln());
            let ok = raw.lo > llo && raw.hi < lhi;
            let p = stats::above_p(d, se, df, lhi).min(stats::above_p(-d, se, df, -llo));
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
            test: test_name(&smp.pairing, log_scale),
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

/// What `a`'s precision choices cost in weight memory over `b`'s (nothing when equal or unknown),
/// e.g. a BF16 shared expert against an NVFP4 one.
fn weight_cost(a: &ClaimArm, b: &ClaimArm) -> String {
    let (Some(wa), Some(wb)) = (a.weight_bytes, b.weight_bytes) else {
        return String::new();
    };
    if wa == wb || wb <= 0.0 {
        return String::new();
    }
    let kib = |v: f64| format!("{:.0} KiB", v / 1024.0);
    format!(
        "; matmul weights {} against {}: {}{}, {:+.1} % of the model's",
        kib(wa),
        kib(wb),
        if wa > wb { "+" } else { "-" },
        kib((wa - wb).abs()),
        100.0 * (wa - wb) / wb
    )
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

/// Spikes per judged step of `a` over `b`: the exact conditional-binomial rate ratio.
fn spike_row(a: &ClaimArm, b: &ClaimArm, site: Option<&str>, s: &CompareSettings) -> Row {
    let total = |arm: &ClaimArm| {
        arm.spikes
            .iter()
            .filter(|t| analyze::site_matches(site, &t.site, t.layer))
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

/// A batch-invariance claim, decided by quantizing seeded random tokens alone and in batches: a
/// single changed token contradicts it (p = 0: a counterexample, not a sample).
fn batch_invariant_row(format: &str) -> Row {
    let test = format!(
        "{} random tokens of 256 quantized alone and in random batches of 2-16 (seeded)",
        quantizer::TOKENS
    );
    let Some(fmt) = quantizer::format(format) else {
        let why = format!("unknown format `{format}`");
        return inconclusive_row(format, "", &test, "tokens changed", why);
    };
    let r = quantizer::batch_invariance(&fmt, quantizer::TOKENS, 0);
    let share = r.changed as f64 / r.tokens as f64;
    let reason = match r.first {
        None => format!("all {} tokens identical alone and in a batch", r.tokens),
        Some((b, at, differ)) => format!(
            "{} of {} tokens changed with their batch (first: position {at} of {b}, {differ} of 256 values differ)",
            r.changed, r.tokens
        ),
    };
    let p_against = if r.changed > 0 { 0.0 } else { f64::NAN };
    Row {
        ev: ClaimEvidence {
            config: format.to_string(),
            vs: String::new(),
            seeds: vec![],
            vs_seeds: vec![],
            test,
            scale: "tokens changed".into(),
            interval: Interval {
                estimate: share,
                lo: share,
                hi: share,
            },
            verdict: ClaimVerdict::Inconclusive,
            p_against,
            reason,
        },
        reproduced: r.changed == 0,
        p_against,
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
        .filter(|a| picked(a, &c.configs, &matchers))
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
    let coupled = picked.iter().all(|a| a.coupled);
    let (pairing, common) = pairing_of(&vals, coupled, s.min_seeds);
    let paired = pairing.paired();
    let raw_groups: Vec<Vec<f64>> = vals
        .iter()
        .map(|v| {
            if paired {
                at_seeds(v, &common)
            } else {
                v.iter().map(|x| x.last).collect()
            }
        })
        .collect();
    let positive = raw_groups.iter().flatten().all(|x| *x > 0.0);
    let log_scale = positive && analyze::is_kl_type(&c.metric);
    let groups: Vec<Vec<f64>> = raw_groups
        .into_iter()
        .map(|g| {
            g.into_iter()
                .map(|x| if log_scale { x.ln() } else { x })
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
        stats::above_p(slope, se, df, 0.0)
    } else {
        stats::above_p(-slope, se, df, 0.0)
    };
    let seeds = if paired {
        common
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
                pairing.test("Welch-Satterthwaite t"),
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
                // A quantizer claim runs no seeds; a counterexample needs no p-value.
                let seeds = if r.ev.scale == "tokens changed" {
                    String::new()
                } else {
                    format!(", {} seeds", r.ev.seeds.len())
                };
                let counted = r.ev.p_against > 0.0;
                format!(
                    "{who}: {} ({}{seeds}{})",
                    r.ev.reason,
                    r.ev.test,
                    if r.ev.verdict == ClaimVerdict::Contradicted && counted {
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
        format!(
            "Pairing: arms run on the built-in engine share each seed's prompts and sampling stream, so they are compared seed by seed (paired t) over the seeds all of them ran, when at least {} are common (with sequential seeds the baseline often ran more); the test's name gives how many seeds were paired and of how many. Otherwise, and for other engines, Welch's t over every seed of each arm.",
            s.min_seeds.max(2)
        ),
        "Quantizer claims (`batch_invariant`): decided on the quantizer alone, without runs: seeded random tokens (256 elements, magnitudes over six decades) are quantized alone and at a random position of random batches of 2 to 16 with the one quantizer (`formats::quantize`, row blocks along K); reproduced when every token's element codes, block scales and dequantized values are identical both ways, contradicted by the first token that differs.".to_string(),
        "Trends (`decreasing`/`increasing`): a linear contrast over the configurations' ranks in sweep order (scores centred on the middle rank), i.e. the least-squares slope of the per-configuration means per sweep step, on the log scale for KL-type metrics; paired as above (the contrast is taken seed by seed over the seeds every configuration ran), else Welch-Satterthwaite. It tests a trend, not that every step goes down.".to_string(),
        format!(
            "Several configurations in one claim: the claim is reproduced only when every configuration is (an intersection-union test: each at alpha, so the claim's false-reproduction rate stays at most {}); it is contradicted when Holm's step-down adjustment over its configurations' p-values against it still leaves one below alpha (family-wise error at most {}). Claims are not adjusted against each other: each claim holds its own error rate. On a night with sequential seeds the claims' tests are fixed-sample tests on the seeds the night reached. A claim changes the night's verdict only with `gate = true` (a contradicted gated claim is a regression).",
            s.alpha, s.alpha
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// An arm with a value at each of `seeds`, from `value(seed)`.
    fn arm_at(config: &str, seeds: &[u64], value: impl Fn(u64) -> f64, coupled: bool) -> ClaimArm {
        let mut a = arm(config, &[], coupled);
        a.seeds = seeds.to_vec();
        let vals = seeds
            .iter()
            .map(|&seed| SeedValue {
                seed,
                last: value(seed),
                first: value(seed),
            })
            .collect();
        a.values.insert("train/train_rollout_kl".into(), vals);
        a
    }

    /// A KL level per seed: a large shared nuisance (what one seed's prompts and sampling do to
    /// every configuration) times a small configuration-specific noise, times `fold`.
    fn coupled_kl(seed: u64, fold: f64, salt: u64) -> f64 {
        let u = |k: u64| {
            let h =
                (seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ k).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            (h >> 11) as f64 / (1u64 << 53) as f64 - 0.5
        };
        1e-3 * fold * (2.0 * u(0)).exp() * (0.02 * u(salt + 1)).exp()
    }

    #[test]
    fn coupled_arms_pair_on_the_seeds_they_share() {
        let s = CompareSettings::default();
        let base: Vec<u64> = (0..12).collect();
        let fewer: Vec<u64> = (0..9).collect();
        let make = |coupled: bool| {
            vec![
                arm_at("bf16", &base, |k| coupled_kl(k, 1.0, 1), coupled),
                arm_at("nvfp4-dq", &fewer, |k| coupled_kl(k, 1.1, 2), coupled),
            ]
        };
        let higher = claim(Predicate::Higher(true), &[], None);
        let r = evaluate(std::slice::from_ref(&higher), &make(true), &s).remove(0);
        assert_eq!(r.verdict, ClaimVerdict::Reproduced, "{r:?}");
        let row = &r.rows[0];
        assert_eq!(
            row.test,
            "paired t over the 9 common seeds (of 9 and 12), log scale"
        );
        assert_eq!((row.seeds.len(), row.vs_seeds.len()), (9, 9));
        assert!((1.05..1.15).contains(&row.interval.estimate), "{row:?}");
        assert!(r.evidence.contains("9 common seeds"), "{}", r.evidence);
        // The same values from an engine that does not couple seeds: Welch over all 12 and 9,
        // which the shared nuisance drowns.
        let r = evaluate(std::slice::from_ref(&higher), &make(false), &s).remove(0);
        assert_eq!(r.verdict, ClaimVerdict::Inconclusive, "{r:?}");
        assert_eq!(r.rows[0].test, "Welch t, log scale");
        assert_eq!((r.rows[0].seeds.len(), r.rows[0].vs_seeds.len()), (9, 12));
        // Fewer common seeds than a verdict needs: Welch over each arm's own seeds.
        let apart = vec![
            arm_at("bf16", &base, |k| coupled_kl(k, 1.0, 1), true),
            arm_at(
                "nvfp4-dq",
                &[10, 11, 12, 13],
                |k| coupled_kl(k, 1.1, 2),
                true,
            ),
        ];
        let r = evaluate(&[higher], &apart, &s).remove(0);
        assert_eq!(r.rows[0].test, "Welch t, log scale");
    }

    #[test]
    fn a_coupled_trend_pairs_on_the_seeds_every_configuration_ran() {
        let s = CompareSettings::default();
        let seeds = |n: u64| (0..n).collect::<Vec<u64>>();
        let make = |coupled: bool| {
            vec![
                arm_at("a", &seeds(12), |k| coupled_kl(k, 1.0, 1), coupled),
                arm_at("b", &seeds(9), |k| coupled_kl(k, 0.9, 2), coupled),
                arm_at("c", &seeds(10), |k| coupled_kl(k, 0.8, 3), coupled),
            ]
        };
        let trend = claim(
            Predicate::Trend {
                decreasing: true,
                by: None,
            },
            &["a", "b", "c"],
            None,
        );
        let r = evaluate(std::slice::from_ref(&trend), &make(true), &s).remove(0);
        assert_eq!(r.verdict, ClaimVerdict::Reproduced, "{r:?}");
        assert_eq!(
            r.rows[0].test,
            "linear trend contrast on ranks, paired t over the 9 common seeds (of 12, 9 and 10), log scale"
        );
        assert_eq!(r.rows[0].seeds, seeds(9));
        let r = evaluate(&[trend], &make(false), &s).remove(0);
        assert_eq!(r.verdict, ClaimVerdict::Inconclusive, "{r:?}");
        assert!(r.rows[0].test.contains("Welch-Satterthwaite"), "{r:?}");
    }

    #[test]
    fn batch_invariance_is_decided_on_the_quantizer_without_runs() {
        let s = CompareSettings::default();
        let decide = |format: &str| {
            let mut c = claim(Predicate::BatchInvariant(format.into()), &[], None);
            c.metric = String::new();
            evaluate(&[c], &[], &s).remove(0)
        };
        let token = decide("nvfp4-per-token");
        assert_eq!(token.verdict, ClaimVerdict::Reproduced, "{token:?}");
        assert!(
            token.evidence.contains("all 500 tokens identical")
                && !token.evidence.contains("seeds,"),
            "{}",
            token.evidence
        );
        let tensor = decide("nvfp4-per-tensor");
        assert_eq!(tensor.verdict, ClaimVerdict::Contradicted, "{tensor:?}");
        assert!(
            tensor.rows[0].interval.estimate > 0.5,
            "{:?}",
            tensor.rows[0]
        );
        assert!(
            tensor.evidence.contains("tokens changed with their batch"),
            "{}",
            tensor.evidence
        );
    }

    #[test]
    fn a_variant_is_held_against_the_baselines_variant_and_named_in_full() {
        let s = CompareSettings::default();
        let lagged = |a: &mut ClaimArm| {
            a.config = format!("{} [policy_lag=1]", a.base);
            a.axes = [("policy_lag".to_string(), "1".to_string())].into();
        };
        let mut bf16_lag = arm("bf16", &[1e-3, 1.2e-3, 0.9e-3, 1.1e-3], true);
        let mut nv_lag = arm("nvfp4-dq", &[4e-3, 4.4e-3, 3.7e-3, 4.3e-3], true);
        lagged(&mut bf16_lag);
        lagged(&mut nv_lag);
        let arms = vec![
            arm("bf16", &[1e-4, 1.2e-4, 0.9e-4, 1.1e-4], true),
            arm("nvfp4-dq", &[4e-3, 4.4e-3, 3.7e-3, 4.3e-3], true),
            bf16_lag,
            nv_lag,
        ];
        let higher = |configs: &[&str]| {
            evaluate(&[claim(Predicate::Higher(true), configs, None)], &arms, &s).remove(0)
        };
        // The plain name picks the plain runs only.
        let plain = higher(&["nvfp4-dq"]);
        assert_eq!(plain.rows.len(), 1, "{plain:?}");
        assert_eq!(plain.rows[0].vs, "bf16");
        // The variant, named in full, is held against BF16's variant (about 4x, not 40x).
        let lag = higher(&["nvfp4-dq [policy_lag=1]"]);
        assert_eq!(lag.rows.len(), 1, "{lag:?}");
        assert_eq!(lag.rows[0].vs, "bf16 [policy_lag=1]");
        assert!(
            (3.0..5.0).contains(&lag.rows[0].interval.estimate),
            "{lag:?}"
        );
        // A pattern does not reach variants either.
        assert_eq!(higher(&["nvfp4*"]).rows.len(), 1);
    }

    #[test]
    fn a_higher_or_lower_claim_says_what_its_precision_costs_in_weight_memory() {
        let s = CompareSettings::default();
        let mut shared_bf16 = arm("nvfp4-dq", &[1e-3, 1.2e-3, 0.9e-3, 1.1e-3], true);
        let mut shared_fp4 = arm("shared-fp4", &[4e-3, 4.4e-3, 3.7e-3, 4.3e-3], true);
        shared_bf16.weight_bytes = Some(1.1 * 1024.0 * 1024.0);
        shared_fp4.weight_bytes = Some(1024.0 * 1024.0);
        let r = evaluate(
            &[claim(
                Predicate::Higher(false),
                &["nvfp4-dq"],
                Some("shared-fp4"),
            )],
            &[shared_bf16, shared_fp4],
            &s,
        )
        .remove(0);
        assert_eq!(r.verdict, ClaimVerdict::Reproduced, "{r:?}");
        assert!(
            r.evidence.contains(
                "matmul weights 1126 KiB against 1024 KiB: +102 KiB, +10.0 % of the model's"
            ),
            "{}",
            r.evidence
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

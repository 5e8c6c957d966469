//! The summary at the top of the report: the comparison's verdicts in plain sentences a newcomer
//! reads in ten seconds ("5/5 low-precision configs equivalent to bf16 reward within 0.05;
//! nvfp4-hp: 3 gradient spikes, all in layer 5 mlp.experts.linear_fc2"). Plain text: the page
//! escapes it.

use crate::compare::{OverallVerdict, SuiteComparison, Verdict};
use std::collections::BTreeMap;

/// The headline metric: reward when compared, else the first metric that has a margin.
fn headline(cmp: &SuiteComparison) -> Option<String> {
    let all = || cmp.configs.iter().flat_map(|c| &c.metrics);
    all()
        .find(|m| m.metric == "rollout/raw_reward")
        .or_else(|| all().find(|m| m.margin.is_some()))
        .map(|m| m.metric.clone())
}

fn metric_words(metric: &str) -> String {
    match metric {
        "rollout/raw_reward" => "reward".into(),
        "eval/accuracy" => "held-out accuracy".into(),
        other => other.to_string(),
    }
}

/// A signed difference with its interval, compact.
fn diff(iv: &crate::compare::Interval) -> String {
    format!("Δ {:+.3} [{:+.3}, {:+.3}]", iv.estimate, iv.lo, iv.hi)
}

/// The summary sentences, most important first.
pub fn sentences(cmp: &SuiteComparison, emulated: bool) -> Vec<String> {
    let base = &cmp.baseline_config;
    let nights = cmp.method.nights;
    let mut out = vec![match (cmp.headline_state().as_str(), cmp.overall) {
        ("pending", _) => format!(
            "Overall: PENDING. A regression against {base} tonight, not yet on {nights} consecutive nights."
        ),
        ("failing", _) => format!(
            "Overall: FAILING against {base} tonight; it alerts as a regression after {nights} consecutive failing nights (`lockstep nightly` keeps the count)."
        ),
        ("error", _) => "Overall: ERROR. Some runs failed; see the warnings.".to_string(),
        (_, OverallVerdict::Pass) => format!("Overall: PASS. No regression against {base}."),
        (_, OverallVerdict::Regression) => format!("Overall: REGRESSION against {base}."),
        (_, OverallVerdict::Inconclusive) => {
            format!("Overall: INCONCLUSIVE. The runs cannot decide equivalence to {base} yet.")
        }
    }];
    if !cmp.problems.is_empty() {
        out[0] = format!(
            "Overall: ERROR. {} problem(s) keep the comparison from covering the suite: {}.",
            cmp.problems.len(),
            cmp.problems
                .iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
                .join("; ")
        );
    }
    if let Some(h) = headline(cmp) {
        out.push(headline_sentence(cmp, &h));
    }
    for c in cmp.configs.iter().filter(|c| &c.config != base) {
        let bad: Vec<String> = c
            .metrics
            .iter()
            .filter(|m| {
                m.verdict == Verdict::Regressed && Some(&m.metric) != headline(cmp).as_ref()
            })
            .map(|m| {
                format!(
                    "{} regressed ({})",
                    metric_words(&m.metric),
                    diff(&m.final_diff)
                )
            })
            .collect();
        if !bad.is_empty() {
            out.push(format!("{}: {}.", c.config, bad.join("; ")));
        }
    }
    out.extend(spike_sentences(cmp));
    if !cmp.checks.is_empty() {
        let passed = cmp.checks.iter().filter(|c| c.passed).count();
        let mut s = format!("Checks: {passed}/{} passed.", cmp.checks.len());
        let failed: Vec<String> = cmp
            .checks
            .iter()
            .filter(|c| !c.passed)
            .map(|c| format!("`{}` on {}: {}", c.expr, c.config, c.message))
            .collect();
        if !failed.is_empty() {
            s.push_str(&format!(" Failed: {}.", failed.join("; ")));
        }
        out.push(s);
    }
    if !cmp.contract.is_empty() {
        let bad: Vec<String> = cmp
            .contract
            .iter()
            .filter(|r| r.violations > 0)
            .map(|r| format!("{} {} of {} steps", r.config, r.violations, r.steps_checked))
            .collect();
        let steps: usize = cmp.contract.iter().map(|r| r.steps_checked).sum();
        out.push(if steps == 0 {
            "Rollout/trainer quantization contract: not checked (these runs record no contract \
             check; the built-in engine checks it every step, an external framework does not)."
                .to_string()
        } else if bad.is_empty() {
            format!(
                "Rollout/trainer quantization contract: no violations in {steps} checked steps."
            )
        } else {
            format!("Contract violations: {}.", bad.join(", "))
        });
    }
    if emulated {
        out.push(
            "Timings are emulated: the built-in engine emulates the formats on the CPU, so times \
             are not hardware times."
                .into(),
        );
    }
    out
}

/// "k/n low-precision configs equivalent to BF16 reward within m", then the exceptions.
fn headline_sentence(cmp: &SuiteComparison, metric: &str) -> String {
    let base = &cmp.baseline_config;
    let ms: Vec<(&str, &crate::compare::MetricComparison)> = cmp
        .configs
        .iter()
        .filter(|c| &c.config != base)
        .filter_map(|c| {
            c.metrics
                .iter()
                .find(|m| m.metric == metric)
                .map(|m| (c.config.as_str(), m))
        })
        .collect();
    let n = ms.len();
    let eq = ms
        .iter()
        .filter(|(_, m)| m.verdict == Verdict::Equivalent)
        .count();
    let margins: Vec<f64> = ms.iter().filter_map(|(_, m)| m.margin).collect();
    let within = match margins.first() {
        Some(m) if margins.iter().all(|x| x == m) && margins.len() == n => format!(" within {m}"),
        _ => String::new(),
    };
    let what = metric_words(metric);
    let mut s = format!("{eq}/{n} low-precision configs equivalent to {base} {what}{within}.");
    let group = |v: Verdict, word: &str, why: bool| -> Option<String> {
        let xs: Vec<String> = ms
            .iter()
            .filter(|(_, m)| m.verdict == v)
            .map(|(c, m)| {
                if why && !m.reason.is_empty() {
                    format!("{c} ({})", m.reason)
                } else {
                    format!("{c} ({})", diff(&m.final_diff))
                }
            })
            .collect();
        (!xs.is_empty()).then(|| format!(" {word}: {}.", xs.join("; ")))
    };
    for (v, w, why) in [
        (Verdict::Regressed, "Regressed", false),
        (Verdict::Improved, "Improved", false),
        (Verdict::Inconclusive, "Inconclusive", true),
    ] {
        if let Some(g) = group(v, w, why) {
            s.push_str(&g);
        }
    }
    s
}

/// Per configuration with spikes: how many and where.
fn spike_sentences(cmp: &SuiteComparison) -> Vec<String> {
    let mut by: BTreeMap<&str, BTreeMap<(i64, &str), usize>> = BTreeMap::new();
    for s in &cmp.spikes {
        *by.entry(&s.config)
            .or_default()
            .entry((s.layer, &s.site))
            .or_default() += 1;
    }
    if by.is_empty() {
        return vec!["No gradient spikes in any configuration.".into()];
    }
    let place = |(l, s): (i64, &str)| {
        if l < 0 {
            s.to_string()
        } else {
            format!("layer {l} {s}")
        }
    };
    // Configurations in the comparison's order.
    let order: Vec<&str> = cmp
        .configs
        .iter()
        .map(|c| c.config.as_str())
        .chain(std::iter::once(cmp.baseline_config.as_str()))
        .chain(by.keys().copied())
        .collect();
    let mut seen = std::collections::BTreeSet::new();
    let mut out = Vec::new();
    for c in order {
        let Some(places) = by.get(c) else { continue };
        if !seen.insert(c) {
            continue;
        }
        let total: usize = places.values().sum();
        let noun = if total == 1 { "spike" } else { "spikes" };
        let s = if places.len() == 1 {
            let (k, _) = places
                .iter()
                .next()
                .map(|(k, v)| (*k, *v))
                .unwrap_or(((0, ""), 0));
            if total == 1 {
                format!("{c}: 1 gradient spike, in {}.", place(k))
            } else {
                format!("{c}: {total} gradient {noun}, all in {}.", place(k))
            }
        } else {
            let (k, v) = places
                .iter()
                .max_by_key(|(_, v)| **v)
                .map(|(k, v)| (*k, *v))
                .unwrap_or(((0, ""), 0));
            format!(
                "{c}: {total} gradient {noun} in {} places, most in {} ({v}).",
                places.len(),
                place(k)
            )
        };
        out.push(s);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::fixture;

    #[test]
    fn says_how_many_configs_are_equivalent_and_where_spikes_are() {
        let f = fixture::synthetic(&fixture::Shape::small());
        let s = sentences(&f.comparison, true).join("\n");
        assert!(s.contains("Overall: PASS"), "{s}");
        assert!(
            s.contains("3/3 low-precision configs equivalent to bf16 reward within 0.05."),
            "{s}"
        );
        assert!(
            s.contains("nvfp4-hp: 3 gradient spikes, all in layer 1 mlp.experts.linear_fc2."),
            "{s}"
        );
        assert!(s.contains("Timings are emulated"), "{s}");
    }

    #[test]
    fn names_regressions_and_inconclusive_configs_with_their_numbers() {
        let mut f = fixture::synthetic(&fixture::Shape::small());
        let c = &mut f.comparison;
        c.overall = OverallVerdict::Regression;
        c.configs[1].metrics[0].verdict = Verdict::Regressed;
        c.configs[1].metrics[0].final_diff = crate::compare::Interval {
            estimate: -0.08,
            lo: -0.12,
            hi: -0.04,
        };
        c.configs[2].metrics[0].verdict = Verdict::Inconclusive;
        c.configs[2].metrics[0].reason = "2 seeds cannot resolve a 0.05 margin".into();
        c.spikes.clear();
        let s = sentences(c, false).join("\n");
        assert!(s.contains("Overall: REGRESSION"), "{s}");
        assert!(s.contains("1/3 low-precision configs equivalent"), "{s}");
        let cfg1 = &c.configs[1].config;
        assert!(
            s.contains(&format!("Regressed: {cfg1} (Δ -0.080 [-0.120, -0.040])")),
            "{s}"
        );
        assert!(s.contains("2 seeds cannot resolve"), "{s}");
        assert!(s.contains("No gradient spikes"), "{s}");
        assert!(!s.contains("emulated"), "{s}");
    }
}

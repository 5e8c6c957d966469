//! Reading `[[claims]]` from a suite file: strict keys, each error with the suite file's line and
//! column (from the TOML spans) and the fix. The checks here are the ones the runs are not
//! needed for; naming a metric the runs never logged is found when the claim is decided.

use super::{ClaimSpec, Predicate};
use crate::compare::settings::{CompareSettings, MarginRule, MarginToml, SettingsError};
use crate::suite::spec::SuiteSpec;
use serde::Deserialize;
use toml::Spanned;

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
    format: Option<Spanned<String>>,
    gate: Option<bool>,
}

/// The suite file as claims read it: everything else is left to the suite parser.
#[derive(Debug, Deserialize)]
struct ClaimsFile {
    #[serde(default)]
    claims: Vec<Spanned<ClaimToml>>,
}

const KEYS: [&str; 13] = [
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
    "format",
    "gate",
];

const PREDICATES: [&str; 8] = [
    "equivalent",
    "higher",
    "lower",
    "fold_within",
    "spike_rate_higher",
    "decreasing",
    "increasing",
    "batch_invariant",
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
    only(
        "format",
        c.format.as_ref().map(|m| m.span().start),
        &["batch_invariant"],
    )?;
    if expect == "batch_invariant" {
        return batch_invariant(c, name, expect_at);
    }
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

/// A quantizer claim: a known `format`, and none of the keys that name runs.
fn batch_invariant(
    c: &ClaimToml,
    name: String,
    expect_at: usize,
) -> Result<ClaimSpec, (usize, String)> {
    let run_keys = [
        ("metric", c.metric.as_ref().map(|v| v.span().start)),
        ("configs", c.configs.as_ref().map(|v| v.span().start)),
        ("vs", c.vs.as_ref().map(|v| v.span().start)),
    ];
    if let Some((key, Some(at))) = run_keys.iter().find(|(_, at)| at.is_some()) {
        return Err((
            *at,
            format!(
                "expect = \"batch_invariant\" is decided on the quantizer alone, without runs; remove `{key}`"
            ),
        ));
    }
    let formats = super::quantizer::FORMATS;
    let Some(f) = &c.format else {
        return Err((
            expect_at,
            format!(
                "expect = \"batch_invariant\" needs the activation format, e.g. format = \"nvfp4-per-token\" (one of {})",
                formats.join(", ")
            ),
        ));
    };
    let format = f.get_ref().trim();
    if super::quantizer::format(format).is_none() {
        let hint = crate::recipe::presets::suggest(format, &formats)
            .map(|s| format!(" (did you mean `{s}`?)"))
            .unwrap_or_default();
        return Err((
            f.span().start,
            format!(
                "format = \"{}\"{hint}: use one of {}",
                crate::recipe::shorten(format),
                formats.join(", ")
            ),
        ));
    }
    Ok(ClaimSpec {
        name,
        statement: c.statement.get_ref().trim().to_string(),
        source: c.source.get_ref().trim().to_string(),
        expect: "batch_invariant".into(),
        metric: String::new(),
        configs: Vec::new(),
        vs: None,
        predicate: Predicate::BatchInvariant(format.to_string()),
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
            "expect = \"batch_invariant\"\nformat = \"nvfp4-per-token\"\n",
        ];
        let all: String = text
            .iter()
            .enumerate()
            .map(|(i, t)| HEAD.replace("\"c\"", &format!("\"c{i}\"")) + t)
            .collect();
        let c = parse_claims(&all).unwrap();
        assert_eq!(c.len(), 8);
        assert_eq!(
            c[7].predicate,
            Predicate::BatchInvariant("nvfp4-per-token".into())
        );
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
            (
                "expect = \"batch_invariant\"\nformat = \"nvfp4-per-tokn\"\n",
                ":21:10:",
                "did you mean `nvfp4-per-token`",
            ),
            (
                "expect = \"batch_invariant\"\n",
                ":20:10:",
                "needs the activation format",
            ),
            (
                "expect = \"batch_invariant\"\nformat = \"mxfp8\"\nmetric = \"m\"\n",
                ":22:10:",
                "without runs; remove `metric`",
            ),
            (
                "expect = \"higher\"\nmetric = \"m\"\nformat = \"mxfp8\"\n",
                ":22:10:",
                "only read with expect = \"batch_invariant\"",
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
}

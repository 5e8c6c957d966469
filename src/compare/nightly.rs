//! The nightly verdict: a comparison (and an optional golden-value diff) turned into an exit code,
//! `verdict.json`, a Markdown summary short enough for a chat message, and JUnit XML with one test
//! case per check. A regression can be required to repeat on consecutive nights before it alerts
//! (PyTorch's benchmark alerting rule); the history lives in the store (`nightly-state.json`).
//!
//! A night whose comparison has problems (a planned run missing, failed, timed out or interrupted,
//! a configuration without usable steps, a needed metric never logged) is an `error` with exit 2:
//! the problems come first in the summary and are JUnit `<error>` cases, and they win over any
//! verdict, so a crashed configuration can never let the night pass.

use super::expr::fmt_num;
use super::golden::GoldenDiff;
use super::result::*;
use serde::{Deserialize, Serialize};

/// Exit codes of `lockstep nightly` (the same as `main.rs`).
pub const EXIT_PASS: u8 = 0;
pub const EXIT_REGRESSION: u8 = 1;
pub const EXIT_ERROR: u8 = 2;

/// One thing that failed tonight: a metric verdict, a check, or a golden-value row.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Finding {
    /// Stable key across nights, e.g. `nvfp4-hp :: rollout/raw_reward`.
    pub key: String,
    pub config: String,
    pub what: String,
    pub detail: String,
    /// Date of the first night of the current unbroken run of failures, and its length.
    pub since: String,
    pub nights: usize,
}

/// `verdict.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NightlyVerdict {
    pub suite: String,
    pub date: String,
    /// `error` (problems below), `regression`, `pending` (failing, but not yet on enough
    /// consecutive nights), `inconclusive` or `pass`.
    pub verdict: String,
    pub exit_code: u8,
    pub overall: OverallVerdict,
    pub nights_required: usize,
    /// Failures that alert tonight.
    pub regressions: Vec<Finding>,
    /// Failures seen tonight that have not repeated on enough nights yet.
    pub pending: Vec<Finding>,
    pub inconclusive: Vec<String>,
    pub checks_passed: usize,
    pub checks_total: usize,
    pub warnings: Vec<String>,
    /// What made the night an error (from the comparison), one line each.
    #[serde(default)]
    pub problems: Vec<String>,
}

/// One night in the history.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Night {
    pub date: String,
    pub failing: Vec<String>,
}

/// `nightly-state.json`: the nights so far, oldest first (the last 60 are kept).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NightState {
    pub nights: Vec<Night>,
}

/// Everything that failed tonight, before the consecutive-nights rule.
pub fn findings(cmp: &SuiteComparison, golden: Option<&GoldenDiff>) -> Vec<Finding> {
    let mut out = Vec::new();
    for c in &cmp.configs {
        for m in c
            .metrics
            .iter()
            .filter(|m| m.margin.is_some() && m.verdict == Verdict::Regressed)
        {
            out.push(Finding {
                key: format!("{} :: {}", c.config, m.metric),
                config: c.config.clone(),
                what: m.metric.clone(),
                detail: format!(
                    "{} vs {} {} [{}, {}] (margin {})",
                    m.metric,
                    c.baseline,
                    signed(m.final_diff.estimate),
                    fmt_num(m.final_diff.lo),
                    fmt_num(m.final_diff.hi),
                    m.margin.map(fmt_num).unwrap_or_default()
                ),
                since: String::new(),
                nights: 0,
            });
        }
    }
    for k in cmp.checks.iter().filter(|k| !k.passed) {
        out.push(Finding {
            key: format!("{} :: {}", k.config, k.name),
            config: k.config.clone(),
            what: format!("check `{}`", k.name),
            detail: k.message.clone(),
            since: String::new(),
            nights: 0,
        });
    }
    for c in cmp
        .claims
        .iter()
        .filter(|c| c.gate && c.verdict == ClaimVerdict::Contradicted)
    {
        out.push(Finding {
            key: format!("claim :: {}", c.name),
            config: c
                .rows
                .iter()
                .filter(|r| r.verdict == ClaimVerdict::Contradicted)
                .map(|r| r.config.as_str())
                .collect::<Vec<_>>()
                .join(", "),
            what: format!("claim `{}` contradicted", c.name),
            detail: c.evidence.clone(),
            since: String::new(),
            nights: 0,
        });
    }
    if let Some(g) = golden {
        for r in g.rows.iter().filter(|r| !r.passed) {
            out.push(Finding {
                key: format!("{} :: golden {}", r.config, r.metric),
                config: r.config.clone(),
                what: format!("golden {}", r.metric),
                detail: format!(
                    "{} of {} points outside tolerance {} (max |diff| {}){}",
                    r.outside,
                    r.compared,
                    fmt_num(r.tolerance),
                    fmt_num(r.max_abs_diff),
                    r.first_outside
                        .map(|(s, t)| format!(", first at seed {s} step {t}"))
                        .unwrap_or_default()
                ),
                since: String::new(),
                nights: 0,
            });
        }
    }
    out
}

fn signed(v: f64) -> String {
    if v >= 0.0 {
        format!("+{}", fmt_num(v))
    } else {
        fmt_num(v)
    }
}

/// Tonight's verdict; appends tonight to `state` (a rerun on the same date replaces that night).
pub fn verdict(
    cmp: &SuiteComparison,
    golden: Option<&GoldenDiff>,
    state: &mut NightState,
    date: &str,
    nights_required: usize,
    inconclusive_fails: bool,
) -> NightlyVerdict {
    let mut found = findings(cmp, golden);
    state.nights.retain(|n| n.date != date);
    state.nights.push(Night {
        date: date.to_string(),
        failing: found.iter().map(|f| f.key.clone()).collect(),
    });
    let keep = state.nights.len().saturating_sub(60);
    state.nights.drain(..keep);
    for f in &mut found {
        let streak: Vec<&Night> = state
            .nights
            .iter()
            .rev()
            .take_while(|n| n.failing.contains(&f.key))
            .collect();
        f.nights = streak.len();
        f.since = streak.last().map(|n| n.date.clone()).unwrap_or_default();
    }
    let need = nights_required.max(1);
    let (regressions, pending): (Vec<Finding>, Vec<Finding>) =
        found.into_iter().partition(|f| f.nights >= need);
    let inconclusive: Vec<String> = cmp
        .configs
        .iter()
        .flat_map(|c| {
            c.metrics
                .iter()
                .filter(|m| m.margin.is_some() && m.verdict == Verdict::Inconclusive)
                .map(move |m| format!("{} {}: {}", c.config, m.metric, m.reason))
        })
        .collect();
    let problems: Vec<String> = cmp.problems.iter().map(|p| p.to_string()).collect();
    let (verdict, exit_code) = if !problems.is_empty() {
        ("error", EXIT_ERROR)
    } else if !regressions.is_empty() {
        ("regression", EXIT_REGRESSION)
    } else if !pending.is_empty() {
        ("pending", EXIT_PASS)
    } else if cmp.overall == OverallVerdict::Inconclusive || !inconclusive.is_empty() {
        (
            "inconclusive",
            if inconclusive_fails {
                EXIT_REGRESSION
            } else {
                EXIT_PASS
            },
        )
    } else {
        ("pass", EXIT_PASS)
    };
    let golden_total = golden.map_or(0, |g| g.rows.len());
    let golden_passed = golden.map_or(0, |g| g.rows.iter().filter(|r| r.passed).count());
    NightlyVerdict {
        suite: cmp.suite.clone(),
        date: date.to_string(),
        verdict: verdict.to_string(),
        exit_code,
        overall: cmp.overall,
        nights_required: need,
        regressions,
        pending,
        inconclusive,
        checks_passed: cmp.checks.iter().filter(|c| c.passed).count() + golden_passed,
        checks_total: cmp.checks.len() + golden_total,
        warnings: cmp.warnings.clone(),
        problems,
    }
}

/// A Markdown summary for a chat message or PR comment: the verdict first, then what regressed,
/// by how much and since when; a line per configuration; details stay in compare.json.
pub fn markdown(v: &NightlyVerdict, cmp: &SuiteComparison) -> String {
    let icon = match v.verdict.as_str() {
        "pass" => "✅",
        "regression" | "error" => "❌",
        "pending" => "⚠️",
        _ => "❔",
    };
    let mut s = format!(
        "### {icon} lockstep nightly {} {}: **{}**\n\n",
        md_code(&v.suite),
        v.date,
        v.verdict.to_uppercase()
    );
    if !v.problems.is_empty() {
        s.push_str(&format!(
            "**{} problem(s): the night has no verdict until they are fixed**\n",
            v.problems.len()
        ));
        for p in &v.problems {
            s.push_str(&format!("- {p}\n"));
        }
        s.push('\n');
    }
    s.push_str(&format!(
        "Checks passed: {}/{}.",
        v.checks_passed, v.checks_total
    ));
    if v.nights_required > 1 {
        s.push_str(&format!(
            " A regression alerts after {} consecutive nights.",
            v.nights_required
        ));
    }
    s.push_str("\n\n");
    let list = |s: &mut String, title: &str, fs: &[Finding]| {
        if fs.is_empty() {
            return;
        }
        s.push_str(&format!("**{title}**\n"));
        for f in fs {
            s.push_str(&format!(
                "- {} {}: {} (since {}, {} night{})\n",
                md_code(&f.config),
                md_spans(&f.what),
                md_spans(&f.detail),
                md_text(&f.since),
                f.nights,
                if f.nights == 1 { "" } else { "s" }
            ));
        }
        s.push('\n');
    };
    list(&mut s, "Regressed", &v.regressions);
    list(&mut s, "Failing, not yet alerting", &v.pending);
    if !cmp.claims.is_empty() {
        s.push_str("**Findings**\n");
        for c in &cmp.claims {
            s.push_str(&format!(
                "- {} {}: {}. {}\n",
                c.verdict.words(),
                md_code(&c.name),
                md_text(&c.predicate),
                md_text(&c.evidence)
            ));
        }
        s.push('\n');
    }
    let primary: Vec<String> = cmp
        .configs
        .iter()
        .filter_map(|c| {
            let m = c.metrics.iter().find(|m| m.margin.is_some())?;
            Some(format!(
                "| {} | {} | {} | {} [{}, {}] | {} |",
                md_text(&c.config),
                md_text(&m.metric),
                format!("{:?}", m.verdict).to_lowercase(),
                signed(m.final_diff.estimate),
                fmt_num(m.final_diff.lo),
                fmt_num(m.final_diff.hi),
                c.seeds.len()
            ))
        })
        .collect();
    if !primary.is_empty() {
        s.push_str(&format!(
            "| config | metric | verdict | vs {} | seeds |\n|---|---|---|---|---|\n",
            md_text(&cmp.baseline_config)
        ));
        for l in primary {
            s.push_str(&l);
            s.push('\n');
        }
        s.push('\n');
    }
    if !v.inconclusive.is_empty() {
        s.push_str(&format!(
            "{} metric verdict(s) inconclusive (see compare.json).\n",
            v.inconclusive.len()
        ));
    }
    if !v.warnings.is_empty() {
        s.push_str(&format!(
            "{} warning(s): {}\n",
            v.warnings.len(),
            md_spans(&v.warnings[0])
        ));
    }
    s
}

/// Text from the input (configuration names, metrics, details) as inert Markdown: on one line,
/// with every character that could start emphasis, a link, an image, HTML, a heading or a table
/// cell backslash-escaped, so a hostile name renders as itself in CI systems and chat tools.
pub fn md_text(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\n' | '\r' => o.push(' '),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '&' => o.push_str("&amp;"),
            '\\' | '`' | '*' | '_' | '[' | ']' | '(' | ')' | '#' | '!' | '|' | '~' | '{' | '}' => {
                o.push('\\');
                o.push(c);
            }
            c => o.push(c),
        }
    }
    o
}

/// Text of lockstep's own that quotes input in code spans (check `...`): the spans stay code
/// spans (through [`md_code`]) and the rest is [`md_text`]. With an odd number of backticks the
/// spans are not lockstep's, and the whole is plain text.
pub fn md_spans(s: &str) -> String {
    let parts: Vec<&str> = s.split('`').collect();
    if parts.len().is_multiple_of(2) {
        return md_text(s);
    }
    parts
        .iter()
        .enumerate()
        .map(|(i, p)| if i % 2 == 1 { md_code(p) } else { md_text(p) })
        .collect()
}

/// Text from the input as a Markdown code span: fenced with more backticks than it contains and
/// on one line, so nothing in it is interpreted (`|` is still escaped: GitHub tables split on it
/// even inside code).
pub fn md_code(s: &str) -> String {
    let flat: String = s
        .chars()
        .map(|c| if c == '\n' || c == '\r' { ' ' } else { c })
        .collect();
    let longest = flat.split(|c| c != '`').map(str::len).max().unwrap_or(0);
    let fence = "`".repeat(longest + 1);
    let pad = if flat.starts_with('`') || flat.ends_with('`') {
        " "
    } else {
        ""
    };
    format!("{fence}{pad}{}{pad}{fence}", flat.replace('|', "\\|"))
}

fn xml(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&apos;"),
            c if (c as u32) < 0x20 && !matches!(c, '\n' | '\t' | '\r') => {}
            c => o.push(c),
        }
    }
    o
}

/// JUnit XML: one `<error>` case per problem (a run that failed, timed out, was interrupted or
/// is missing; a configuration without usable steps or without a needed metric), one test case
/// per declared check and configuration, one per metric with a margin (the equivalence test;
/// inconclusive is reported as skipped), and one per golden-value row.
pub fn junit(cmp: &SuiteComparison, golden: Option<&GoldenDiff>) -> String {
    let mut cases = Vec::new();
    for p in &cmp.problems {
        let name = match p.seed {
            Some(seed) => format!("run seed {seed}"),
            None => "configuration".to_string(),
        };
        cases.push((
            format!("{}.{}", cmp.suite, p.config),
            name,
            Some(format!("<error message=\"{}\"/>", xml(&p.to_string()))),
        ));
    }
    for k in &cmp.checks {
        let body = (!k.passed).then(|| format!("<failure message=\"{}\"/>", xml(&k.message)));
        cases.push((format!("{}.{}", cmp.suite, k.config), k.name.clone(), body));
    }
    for c in &cmp.configs {
        for m in c.metrics.iter().filter(|m| m.margin.is_some()) {
            let body = match m.verdict {
                Verdict::Regressed => Some(format!("<failure message=\"{}\"/>", xml(&m.reason))),
                Verdict::Inconclusive => Some(format!("<skipped message=\"{}\"/>", xml(&m.reason))),
                _ => None,
            };
            cases.push((
                format!("{}.{}", cmp.suite, c.config),
                format!("equivalent to {}: {}", c.baseline, m.metric),
                body,
            ));
        }
    }
    if let Some(g) = golden {
        for r in &g.rows {
            let body = (!r.passed).then(|| {
                format!(
                    "<failure message=\"{}\"/>",
                    xml(&format!(
                        "{} of {} points outside tolerance {}",
                        r.outside, r.compared, r.tolerance
                    ))
                )
            });
            cases.push((
                format!("{}.{}", cmp.suite, r.config),
                format!("golden: {}", r.metric),
                body,
            ));
        }
    }
    let failures = cases
        .iter()
        .filter(|c| c.2.as_deref().is_some_and(|b| b.starts_with("<failure")))
        .count();
    let skipped = cases
        .iter()
        .filter(|c| c.2.as_deref().is_some_and(|b| b.starts_with("<skipped")))
        .count();
    let errors = cases
        .iter()
        .filter(|c| c.2.as_deref().is_some_and(|b| b.starts_with("<error")))
        .count();
    let mut s = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    s.push_str(&format!(
        "<testsuites name=\"lockstep\" tests=\"{}\" failures=\"{failures}\" errors=\"{errors}\" skipped=\"{skipped}\">\n  <testsuite name=\"{}\" tests=\"{}\" failures=\"{failures}\" errors=\"{errors}\" skipped=\"{skipped}\">\n",
        cases.len(),
        xml(&cmp.suite),
        cases.len()
    ));
    for (class, name, body) in cases {
        match body {
            None => s.push_str(&format!(
                "    <testcase classname=\"{}\" name=\"{}\"/>\n",
                xml(&class),
                xml(&name)
            )),
            Some(b) => s.push_str(&format!(
                "    <testcase classname=\"{}\" name=\"{}\">{b}</testcase>\n",
                xml(&class),
                xml(&name)
            )),
        }
    }
    s.push_str("  </testsuite>\n</testsuites>\n");
    s
}

/// JUnit XML for a night with no comparison: one `<error>` case saying why.
pub fn junit_error(suite: &str, why: &str) -> String {
    format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<testsuites name=\"lockstep\" tests=\"1\" failures=\"0\" errors=\"1\" skipped=\"0\">\n  <testsuite name=\"{s}\" tests=\"1\" failures=\"0\" errors=\"1\" skipped=\"0\">\n    <testcase classname=\"{s}\" name=\"comparison\"><error message=\"{w}\"/></testcase>\n  </testsuite>\n</testsuites>\n",
        s = xml(suite),
        w = xml(why)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cmp(regressed: bool) -> SuiteComparison {
        SuiteComparison {
            suite: "nightly".into(),
            baseline_config: "bf16".into(),
            method: Method {
                bootstrap_reps: 0,
                bootstrap_seed: 0,
                alpha: 0.05,
                final_window: 10,
                spike_window: 20,
                spike_z: 6.0,
                spike_ratio: 10.0,
                band_reps: 0,
                power: 0.8,
                min_seeds: 3,
                nights: 1,
                description: vec![],
            },
            configs: vec![],
            spikes: vec![],
            spike_rates: vec![],
            checks: vec![CheckResult {
                expr: "contract_violations == 0".into(),
                config: "nvfp4<hp>".into(),
                passed: !regressed,
                value: 3.0,
                threshold: 0.0,
                message: "3 \"violations\" & more".into(),
                name: "contract_violations == 0".into(),
            }],
            claims: vec![],
            contract: vec![],
            overall: if regressed {
                OverallVerdict::Regression
            } else {
                OverallVerdict::Pass
            },
            night_state: None,
            warnings: vec![],
            problems: vec![],
        }
    }

    #[test]
    fn two_nights_rule_and_since() {
        let mut st = NightState::default();
        let v = verdict(&cmp(true), None, &mut st, "2026-12-01", 2, false);
        assert_eq!((v.verdict.as_str(), v.exit_code), ("pending", 0));
        let v = verdict(&cmp(true), None, &mut st, "2026-12-02", 2, false);
        assert_eq!((v.verdict.as_str(), v.exit_code), ("regression", 1));
        assert_eq!(
            (v.regressions[0].since.as_str(), v.regressions[0].nights),
            ("2026-12-01", 2)
        );
        let v = verdict(&cmp(false), None, &mut st, "2026-12-03", 2, false);
        assert_eq!((v.verdict.as_str(), v.exit_code), ("pass", 0));
        let v = verdict(&cmp(true), None, &mut st, "2026-12-04", 2, false);
        assert_eq!(v.verdict, "pending", "a broken streak starts over");
        let v = verdict(&cmp(true), None, &mut st, "2026-12-04", 1, false);
        assert_eq!(
            v.verdict, "regression",
            "one night is enough when nights = 1"
        );
        assert_eq!(
            st.nights.len(),
            4,
            "a rerun on the same date replaces that night"
        );
        assert!(markdown(&v, &cmp(true)).contains("since 2026-12-04"));
    }

    #[test]
    fn junit_escapes_and_counts_failures() {
        let x = junit(&cmp(true), None);
        assert!(x.contains("tests=\"1\" failures=\"1\""), "{x}");
        assert!(x.contains("classname=\"nightly.nvfp4&lt;hp&gt;\""), "{x}");
        assert!(x.contains("3 &quot;violations&quot; &amp; more"), "{x}");
        assert!(!x.contains("\"violations\""));
        assert!(junit(&cmp(false), None).contains("failures=\"0\""));
    }

    #[test]
    fn markdown_helpers_make_hostile_names_inert() {
        let evil = "x` [click](http://e.vil) <img src=x> | *b* _i_\n# h";
        let t = md_text(evil);
        assert!(
            !t.contains('\n') && !t.contains("<img") && !t.contains("]("),
            "{t}"
        );
        assert!(
            t.contains("\\|") && t.contains("\\*b\\*") && t.contains("\\["),
            "{t}"
        );
        let c = md_code(evil);
        assert!(
            c.starts_with("``") && c.ends_with("``") && !c.contains('\n'),
            "{c}"
        );
        assert_eq!(md_code("bf16"), "`bf16`");
        assert_eq!(md_code("a``b"), "```a``b```");
        assert_eq!(md_code("`x"), "`` `x ``");
        assert_eq!(md_text("nvfp4-dq"), "nvfp4-dq");
        assert_eq!(
            md_spans("check `max(train/kl_x) < 1` failed: 2 > 1"),
            "check `max(train/kl_x) < 1` failed: 2 &gt; 1",
        );
        let hostile = md_spans("check `a` on x` [l](http://e.vil)");
        assert!(
            hostile.contains("\\`") && hostile.contains("\\["),
            "{hostile}"
        );
        let inner = md_spans("check `a | b` <b>");
        assert_eq!(inner, "check `a \\| b` &lt;b&gt;");
    }
}

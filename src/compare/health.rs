//! What keeps a suite's comparison from being a verdict: planned runs that are missing, failed,
//! timed out, were interrupted or are still running; configurations with no usable run or no
//! logged step; and metrics the margins or checks need that a configuration never logged. A
//! nightly job with any of these is an error (exit 2), never a pass: the verdict would describe
//! less than the suite asked for.

use super::data::RunData;
use super::result::Problem;
use super::settings::CompareSettings;
use crate::store::{RunDir, RunStatus};
use crate::suite::RunSpec;
use std::collections::BTreeSet;

/// Every problem of a suite's runs, planned runs first (in plan order), then configurations.
/// `unreadable` holds `(run id, why)` for run folders whose files could not be read.
pub fn problems(
    planned: &[RunSpec],
    runs: &[RunData],
    unreadable: &[(String, String)],
    settings: &CompareSettings,
) -> Vec<Problem> {
    let mut out = Vec::new();
    for p in planned {
        let problem = |what: String| Problem {
            config: p.config.clone(),
            seed: Some(p.seed),
            run_id: p.run_id.clone(),
            what,
        };
        if let Some((_, why)) = unreadable.iter().find(|(id, _)| *id == p.run_id) {
            out.push(problem(format!("unreadable: {why}")));
            continue;
        }
        match runs.iter().find(|r| r.run_id == p.run_id) {
            None => out.push(problem(
                "missing: the run has not been run (no run folder); run the suite first".into(),
            )),
            Some(r) if !r.usable() => out.push(problem(status_text(r))),
            Some(_) => {}
        }
    }
    let configs: Vec<(&str, &str)> = {
        let mut seen = BTreeSet::new();
        planned
            .iter()
            .filter(|p| seen.insert(p.config.as_str()))
            .map(|p| (p.config.as_str(), p.base.as_str()))
            .collect()
    };
    for (config, base) in configs {
        out.extend(config_problems(config, base, runs, settings));
    }
    out
}

/// A run's status and why, from its manifest.
fn status_text(r: &RunData) -> String {
    let why = RunDir::open(&r.path)
        .read_manifest()
        .ok()
        .and_then(|m| m.error)
        .unwrap_or_default();
    let status = match r.status {
        RunStatus::Running => "not finished (running, or its process was killed)",
        RunStatus::Failed => "failed",
        RunStatus::Timeout => "timed out",
        RunStatus::Interrupted => "interrupted",
        RunStatus::Ok | RunStatus::Diverged => "usable",
    };
    if why.is_empty() {
        status.to_string()
    } else {
        format!("{status}: {why}")
    }
}

/// A configuration with nothing to compare, or without a metric its margin or checks need.
fn config_problems(
    config: &str,
    base: &str,
    runs: &[RunData],
    s: &CompareSettings,
) -> Vec<Problem> {
    let usable: Vec<&RunData> = runs
        .iter()
        .filter(|r| r.config == config && r.usable())
        .collect();
    let problem = |what: String| Problem {
        config: config.to_string(),
        seed: None,
        run_id: String::new(),
        what,
    };
    if usable.is_empty() {
        return vec![problem(
            "no usable run: every planned run is missing or failed".into(),
        )];
    }
    if usable
        .iter()
        .all(|r| r.metrics.values().all(|v| v.is_empty()))
    {
        return vec![problem(
            "no usable step: its runs logged no metric (check the metrics mapping)".into(),
        )];
    }
    let logged = |m: &str| {
        usable
            .iter()
            .any(|r| r.metrics.get(m).is_some_and(|v| !v.is_empty()))
    };
    let mut out = Vec::new();
    for m in s.margins.keys().filter(|m| !logged(m)) {
        out.push(problem(format!(
            "metric `{m}` (it has a margin) was never logged; map the framework's name to it in the metrics map"
        )));
    }
    for c in &s.checks {
        if !check_applies(c, config, base, &s.baseline) {
            continue;
        }
        for m in c.check.metrics().iter().filter(|m| !logged(m)) {
            out.push(problem(format!(
                "metric `{m}` (check `{}`) was never logged; map the framework's name to it in the metrics map",
                c.name
            )));
        }
    }
    out
}

/// Whether a declared check is evaluated on `config` (its `configs` globs; none: every
/// configuration but the baseline).
fn check_applies(c: &super::settings::CheckSpec, config: &str, base: &str, baseline: &str) -> bool {
    if c.configs.is_empty() {
        return base != baseline;
    }
    c.configs.iter().any(|g| {
        globset::Glob::new(g)
            .map(|g| g.compile_matcher())
            .is_ok_and(|m| m.is_match(config) || m.is_match(base))
    })
}

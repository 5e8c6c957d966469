//! Golden values (Megatron-LM's practice): runs against a checked-in baseline, step by step. The
//! built-in engine is deterministic, so on the same platform a run must match exactly unless the
//! suite states a tolerance per metric; a tolerance can also be derived from repeated runs (band
//! factor x the largest deviation seen), and a share of steps may fall outside before it counts.

use super::data::RunData;
use super::settings::GoldenSettings;
use crate::store::baseline::{BaselineMeta, GoldenTable, Platform};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One configuration and metric against the baseline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GoldenRow {
    pub config: String,
    pub metric: String,
    /// Points compared (seed x step present in the baseline).
    pub compared: usize,
    /// Points outside the tolerance (a missing point counts as outside).
    pub outside: usize,
    pub missing: usize,
    pub max_abs_diff: f64,
    /// First `(seed, step)` outside.
    pub first_outside: Option<(u64, usize)>,
    /// Absolute and relative tolerance used.
    pub tolerance: f64,
    pub rel_tolerance: f64,
    pub passed: bool,
}

/// The whole diff.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GoldenDiff {
    pub rows: Vec<GoldenRow>,
    /// Differences in what was recorded: configurations, seeds, version, platform.
    pub notes: Vec<String>,
    pub passed: bool,
}

/// This machine's platform, as a baseline records it.
pub fn platform(device: &str, emulated: bool) -> Platform {
    Platform {
        os: std::env::consts::OS.into(),
        arch: std::env::consts::ARCH.into(),
        device: device.into(),
        host: crate::store::run::hostname(),
        emulated,
    }
}

/// Golden tables from runs (usable runs only), one per configuration.
pub fn tables(runs: &[RunData], metrics: &[String]) -> BTreeMap<String, GoldenTable> {
    let mut out: BTreeMap<String, GoldenTable> = BTreeMap::new();
    for r in runs.iter().filter(|r| r.usable()) {
        let t = out.entry(r.config.clone()).or_insert_with(|| GoldenTable {
            metrics: metrics.to_vec(),
            rows: BTreeMap::new(),
        });
        for (j, m) in metrics.iter().enumerate() {
            for &(step, v) in r.metrics.get(m).map(Vec::as_slice).unwrap_or(&[]) {
                let row = t
                    .rows
                    .entry((r.seed, step))
                    .or_insert_with(|| vec![f64::NAN; metrics.len()]);
                row[j] = v;
            }
        }
    }
    out
}

/// Per metric, `factor` x the largest deviation of any repeat from the first set of tables.
pub fn derive_tolerances(
    sets: &[BTreeMap<String, GoldenTable>],
    factor: f64,
) -> BTreeMap<String, f64> {
    let mut out: BTreeMap<String, f64> = BTreeMap::new();
    let Some(first) = sets.first() else {
        return out;
    };
    for other in &sets[1..] {
        for (config, t) in first {
            let Some(o) = other.get(config) else { continue };
            for (j, m) in t.metrics.iter().enumerate() {
                let Some(k) = o.metrics.iter().position(|x| x == m) else {
                    continue;
                };
                for (key, vals) in &t.rows {
                    if let Some(ov) = o.rows.get(key) {
                        let d = (vals[j] - ov[k]).abs();
                        if d.is_finite() {
                            let e = out.entry(m.clone()).or_insert(0.0);
                            *e = e.max(factor * d);
                        }
                    }
                }
            }
        }
    }
    out
}

/// Compare current tables with the baseline's.
pub fn diff(
    meta: &BaselineMeta,
    base: &BTreeMap<String, GoldenTable>,
    current: &BTreeMap<String, GoldenTable>,
    here: &Platform,
    g: &GoldenSettings,
) -> GoldenDiff {
    let mut notes = Vec::new();
    if meta.lockstep_version != env!("CARGO_PKG_VERSION") {
        notes.push(format!(
            "baseline recorded with lockstep {}, this is {}",
            meta.lockstep_version,
            env!("CARGO_PKG_VERSION")
        ));
    }
    if !meta.platform.same_numerics(here) {
        notes.push(format!(
            "baseline platform {}/{}/{} differs from this one ({}/{}/{}): exact agreement is not expected; state tolerances in [checks.golden]",
            meta.platform.os, meta.platform.arch, meta.platform.device, here.os, here.arch, here.device
        ));
    }
    for c in current.keys().filter(|c| !base.contains_key(*c)) {
        notes.push(format!("configuration `{c}` is new (not in the baseline)"));
    }
    let mut rows = Vec::new();
    for (config, bt) in base {
        let Some(ct) = current.get(config) else {
            notes.push(format!(
                "configuration `{config}` is in the baseline but has no runs now"
            ));
            rows.extend(bt.metrics.iter().map(|m| GoldenRow {
                config: config.clone(),
                metric: m.clone(),
                compared: bt.rows.len(),
                outside: bt.rows.len(),
                missing: bt.rows.len(),
                max_abs_diff: f64::NAN,
                first_outside: bt.rows.keys().next().copied(),
                tolerance: 0.0,
                rel_tolerance: 0.0,
                passed: false,
            }));
            continue;
        };
        for (j, m) in bt.metrics.iter().enumerate() {
            let k = ct.metrics.iter().position(|x| x == m);
            let tol = g
                .tolerances
                .get(m)
                .copied()
                .unwrap_or(g.tolerance)
                .max(meta.derived_tolerances.get(m).copied().unwrap_or(0.0));
            let mut row = GoldenRow {
                config: config.clone(),
                metric: m.clone(),
                compared: 0,
                outside: 0,
                missing: 0,
                max_abs_diff: 0.0,
                first_outside: None,
                tolerance: tol,
                rel_tolerance: g.rel_tolerance,
                passed: true,
            };
            for (key, vals) in &bt.rows {
                let b = vals[j];
                if b.is_nan() {
                    continue; // absent in the baseline: nothing to hold the run to
                }
                row.compared += 1;
                let c = k.and_then(|k| ct.rows.get(key).map(|v| v[k]));
                let out = match c {
                    None => {
                        row.missing += 1;
                        true
                    }
                    Some(c) if c.to_bits() == b.to_bits() => false,
                    Some(c) => {
                        let d = (c - b).abs();
                        if d.is_finite() {
                            row.max_abs_diff = row.max_abs_diff.max(d);
                        } else {
                            row.max_abs_diff = f64::INFINITY;
                        }
                        d.is_nan() || d > tol.max(g.rel_tolerance * b.abs())
                    }
                };
                if out {
                    row.outside += 1;
                    row.first_outside.get_or_insert(*key);
                }
            }
            row.passed = row.compared == 0
                || (row.outside as f64) <= g.allowed_outside * row.compared as f64;
            rows.push(row);
        }
    }
    let passed = rows.iter().all(|r| r.passed);
    GoldenDiff {
        rows,
        notes,
        passed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(vals: &[(u64, usize, f64)]) -> GoldenTable {
        GoldenTable {
            metrics: vec!["m".into()],
            rows: vals.iter().map(|&(s, t, v)| ((s, t), vec![v])).collect(),
        }
    }

    fn meta() -> BaselineMeta {
        BaselineMeta {
            suite: "s".into(),
            lockstep_version: env!("CARGO_PKG_VERSION").into(),
            git_revision: String::new(),
            created: String::new(),
            platform: platform("cpu", true),
            metrics: vec!["m".into()],
            configs: [("bf16".to_string(), "bf16.csv".to_string())].into(),
            derived_tolerances: BTreeMap::new(),
            repeats: 1,
        }
    }

    fn settings(tol: f64, allowed: f64) -> GoldenSettings {
        GoldenSettings {
            metrics: vec!["m".into()],
            tolerance: tol,
            rel_tolerance: 0.0,
            allowed_outside: allowed,
            band_factor: 1.5,
            tolerances: BTreeMap::new(),
        }
    }

    #[test]
    fn exact_by_default_then_tolerance_then_allowed_share() {
        let base: BTreeMap<_, _> = [(
            "bf16".to_string(),
            table(&[(0, 0, 1.0), (0, 1, 2.0), (0, 2, 3.0), (0, 3, 4.0)]),
        )]
        .into();
        let cur: BTreeMap<_, _> = [(
            "bf16".to_string(),
            table(&[(0, 0, 1.0), (0, 1, 2.0), (0, 2, 3.0 + 1e-12), (0, 3, 4.0)]),
        )]
        .into();
        let here = platform("cpu", true);
        let d = diff(&meta(), &base, &base, &here, &settings(0.0, 0.0));
        assert!(d.passed && d.notes.is_empty(), "{d:?}");
        let d = diff(&meta(), &base, &cur, &here, &settings(0.0, 0.0));
        assert!(!d.passed);
        assert_eq!(
            (d.rows[0].outside, d.rows[0].first_outside),
            (1, Some((0, 2)))
        );
        assert!(
            diff(&meta(), &base, &cur, &here, &settings(1e-9, 0.0)).passed,
            "within tolerance"
        );
        assert!(
            diff(&meta(), &base, &cur, &here, &settings(0.0, 0.25)).passed,
            "1 of 4 steps allowed"
        );
        let mut m = meta();
        m.derived_tolerances.insert("m".into(), 1e-9);
        assert!(
            diff(&m, &base, &cur, &here, &settings(0.0, 0.0)).passed,
            "derived band"
        );
        let short: BTreeMap<_, _> = [("bf16".to_string(), table(&[(0, 0, 1.0)]))].into();
        let d = diff(&meta(), &base, &short, &here, &settings(1.0, 0.0));
        assert_eq!(d.rows[0].missing, 3, "missing steps count as outside");
        assert!(!d.passed);
    }

    #[test]
    fn tolerances_from_repeats_are_the_factor_times_the_largest_deviation() {
        let a: BTreeMap<_, _> = [("bf16".to_string(), table(&[(0, 0, 1.0), (0, 1, 2.0)]))].into();
        let b: BTreeMap<_, _> = [("bf16".to_string(), table(&[(0, 0, 1.1), (0, 1, 1.8)]))].into();
        let t = derive_tolerances(&[a, b], 1.5);
        assert!((t["m"] - 0.3).abs() < 1e-9, "{t:?}");
    }
}

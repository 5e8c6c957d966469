//! `lockstep bench compare`: synthetic runs (reward curves, KL, grad norms per site with a few
//! spikes) compared end to end, timed. With `io`, the runs are first written as run folders and
//! read back, so loading is timed too.

use super::analyze::{CompareOptions, compare_data};
use super::data::{self, LayerSeries, RunData};
use super::settings::{self, DEFAULT_METRICS};
use crate::engine::metrics::{LayerRecord, StepRecord};
use crate::io::IoError;
use crate::store::{Manifest, RunDir, RunStatus};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeMap;
use std::time::Instant;

/// Timings of one benchmark.
#[derive(Debug, Clone)]
pub struct BenchResult {
    pub metrics: usize,
    pub load_s: Option<f64>,
    pub compare_s: f64,
    pub json_s: f64,
    pub json_bytes: usize,
}

/// Synthetic runs: `configs` configurations (the first is `bf16`), `runs / configs` seeds each.
pub fn synthetic(runs: usize, steps: usize, configs: usize, sites: usize) -> Vec<RunData> {
    let per = (runs / configs.max(1)).max(1);
    let mut out = Vec::with_capacity(runs);
    for c in 0..configs.max(1) {
        let config = if c == 0 {
            "bf16".to_string()
        } else {
            format!("cfg{c}")
        };
        for seed in 0..per as u64 {
            let mut rng = ChaCha8Rng::seed_from_u64(seed * 1000 + c as u64);
            let mut metrics: BTreeMap<String, Vec<(usize, f64)>> = BTreeMap::new();
            let offset: f64 = rng.random_range(-0.02..0.02);
            for (k, m) in DEFAULT_METRICS.iter().enumerate() {
                let every = if *m == "eval/accuracy" { 10 } else { 1 };
                let v = (0..steps)
                    .step_by(every)
                    .map(|t| {
                        let x = t as f64 / steps as f64;
                        let noise: f64 = rng.random_range(-0.05..0.05);
                        let base = match k {
                            0 | 1 => 0.3 + 0.5 * (1.0 - (-4.0 * x).exp()) + offset,
                            _ => 1e-3 * (1.0 + c as f64 * 0.1) * (1.0 + x),
                        };
                        (t, base * (1.0 + noise))
                    })
                    .collect();
                metrics.insert(m.to_string(), v);
            }
            let layers = (0..sites)
                .map(|s| {
                    let g: Vec<f64> = (0..steps)
                        .map(|t| {
                            let spike = rng.random_range(0..2000) == 0 && t > 10;
                            let v = rng.random_range(0.8..1.25);
                            if spike { v * 30.0 } else { v }
                        })
                        .collect();
                    LayerSeries {
                        site: format!("mlp.experts.linear_fc{}", s % 2 + 1),
                        layer: (s / 2) as i64,
                        steps: (0..steps).collect(),
                        grad_norm: g,
                    }
                })
                .collect();
            out.push(RunData {
                run_id: format!("{config}-s{seed}-bench"),
                config: config.clone(),
                base: config.clone(),
                axes: BTreeMap::new(),
                seed,
                engine: "builtin".into(),
                status: RunStatus::Ok,
                metrics,
                layers,
                events: Vec::new(),
                contract_steps: steps,
                contract_violations: 0,
                weight_bytes: None,
                path: Default::default(),
            });
        }
    }
    out
}

/// Write a run as a run folder (what the engine would have written).
fn write_run(root: &std::path::Path, r: &RunData) -> Result<std::path::PathBuf, IoError> {
    let dir = root.join(&r.run_id);
    let rd = RunDir::create(&dir)?;
    let steps: usize = r.metrics.values().map(|v| v.len()).max().unwrap_or(0);
    let mut recs: Vec<StepRecord> = (0..steps)
        .map(|t| StepRecord {
            step: t,
            ..Default::default()
        })
        .collect();
    for (m, v) in &r.metrics {
        for &(t, x) in v {
            if let Some(rec) = recs.get_mut(t) {
                rec.set(m, x);
            }
        }
    }
    for l in &r.layers {
        for (i, &t) in l.steps.iter().enumerate() {
            if let Some(rec) = recs.get_mut(t) {
                rec.layers.push(LayerRecord {
                    step: t,
                    site: l.site.clone(),
                    layer: l.layer,
                    precision: "bf16".into(),
                    grad_norm: l.grad_norm[i],
                    saturated: 0,
                    underflowed: 0,
                });
            }
        }
    }
    rd.write_metrics(&recs)?;
    let mut m = Manifest::start(
        &r.run_id,
        "builtin",
        serde_json::json!({}),
        r.seed,
        steps,
        "cpu",
    );
    m.status = RunStatus::Ok;
    m.steps_done = steps;
    m.extra
        .insert("config_name".into(), r.config.clone().into());
    rd.write_manifest(&m)?;
    Ok(dir)
}

/// Generate, optionally write and read back, compare and serialise; return the timings.
pub fn run(
    runs: usize,
    steps: usize,
    configs: usize,
    sites: usize,
    io: bool,
) -> Result<BenchResult, IoError> {
    let mut data = synthetic(runs, steps, configs, sites);
    let mut s = settings::CompareSettings::default();
    s.margins.insert("rollout/raw_reward".into(), 0.05);
    let names = crate::compare::expr::Names {
        configs: data.iter().map(|r| r.config.clone()).collect(),
        baseline: "bf16".into(),
        constants: s.constants(),
    };
    for e in [
        "max(train/train_rollout_kl) < 3e-3",
        "spikes(site=\"*experts*\") <= 2",
    ] {
        let check = crate::compare::expr::parse(e, &names)
            .map_err(|err| IoError::invalid(std::path::Path::new(e), err.to_string()))?;
        s.checks.push(settings::CheckSpec {
            name: e.into(),
            check,
            configs: vec![],
        });
    }
    let mut load_s = None;
    if io {
        let root =
            std::env::temp_dir().join(format!("lockstep-bench-compare-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).map_err(|e| IoError::io(&root, e))?;
        let dirs = data
            .iter()
            .map(|r| write_run(&root, r))
            .collect::<Result<Vec<_>, _>>()?;
        let t = Instant::now();
        let (back, skipped) = data::load_runs(&dirs, None);
        load_s = Some(t.elapsed().as_secs_f64());
        let _ = std::fs::remove_dir_all(&root);
        if let Some(e) = skipped.first() {
            return Err(IoError::invalid(&root, e.clone()));
        }
        data = back;
    }
    let t = Instant::now();
    let cmp = compare_data("bench", &data, &s, &CompareOptions::default())
        .map_err(|e| IoError::invalid(std::path::Path::new("bench"), e.to_string()))?;
    let compare_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let json = serde_json::to_vec(&cmp)
        .map_err(|e| IoError::invalid(std::path::Path::new("bench"), e.to_string()))?;
    Ok(BenchResult {
        metrics: DEFAULT_METRICS.len(),
        load_s,
        compare_s,
        json_s: t.elapsed().as_secs_f64(),
        json_bytes: json.len(),
    })
}

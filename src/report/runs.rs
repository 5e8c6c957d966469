//! What the report reads from the run store that the comparison does not carry: manifests
//! (metadata, config names, sweep axes, whether timings are emulated), per-layer gradient norms
//! (heatmaps) and `perf/*` timings. Reading goes through [`crate::store::RunDir`] only.

use crate::engine::metrics::LayerRecord;
use crate::io::IoError;
use crate::store::{Manifest, RunDir, RunStatus, run_dirs};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// One run as the report needs it.
#[derive(Debug, Clone)]
pub struct RunData {
    pub dir: PathBuf,
    pub manifest: Manifest,
    /// Configuration label with sweep values, e.g. `nvfp4-dq [bf16_last=4]` (what comparisons name).
    pub config: String,
    /// Base configuration name without sweep values (the colour family).
    pub base: String,
    pub axes: BTreeMap<String, String>,
    pub layers: Vec<LayerRecord>,
    /// `perf/*` series: key → (step, seconds or rate).
    pub perf: BTreeMap<String, Vec<(usize, f64)>>,
}

impl RunData {
    /// Config label, base and axes from a manifest: the runner's `extra.config_name`,
    /// `extra.base_config` and `extra.axes`, else the command engine's `config.config`, else the
    /// recipe name.
    pub fn names(m: &Manifest) -> (String, String, BTreeMap<String, String>) {
        let s = |v: Option<&serde_json::Value>| v.and_then(|v| v.as_str()).map(String::from);
        let config = s(m.extra.get("config_name"))
            .or_else(|| s(m.config.get("config")))
            .or_else(|| s(m.config.get("recipe").and_then(|r| r.get("name"))))
            .or_else(|| s(m.config.get("recipe")))
            .unwrap_or_else(|| m.run_id.clone());
        let axes: BTreeMap<String, String> = m
            .extra
            .get("axes")
            .and_then(|a| a.as_object())
            .map(|o| {
                o.iter()
                    .map(|(k, v)| {
                        let v = v
                            .as_str()
                            .map(String::from)
                            .unwrap_or_else(|| v.to_string());
                        (k.clone(), v)
                    })
                    .collect()
            })
            .unwrap_or_default();
        let base = s(m.extra.get("base_config")).unwrap_or_else(|| config.clone());
        (config, base, axes)
    }

    /// Whether the run finished with data worth drawing.
    pub fn finished(&self) -> bool {
        matches!(self.manifest.status, RunStatus::Ok | RunStatus::Diverged)
    }
}

/// Read every run folder under `suite_dir` (folders without a manifest, e.g. half-written ones, and
/// lock files are skipped). A run without `layers.parquet` or `scalars.parquet` yet (still running, failed
/// early) is kept with empty series, so the metadata still lists it.
pub fn load_runs(suite_dir: &Path) -> Result<Vec<RunData>, IoError> {
    run_dirs(suite_dir)?.iter().map(|d| load_run(d)).collect()
}

/// The suite's runs as it is now, read from `suite_dir`, and the folders passed over as stale
/// (sorted names): a folder counts when its run id is one the suite's plan gives, over the suite's
/// seeds and any further seed a folder records (a `--seeds auto` night runs more), so an old run id
/// (made before an upgrade changed ids, or by an edited suite) is never drawn or counted beside the
/// run that replaced it. The same rule `compare --suite` and `nightly` apply.
pub fn load_current_runs(
    spec: &crate::suite::SuiteSpec,
    suite_dir: &Path,
) -> Result<(Vec<RunData>, Vec<String>), crate::report::ReportError> {
    let dirs = run_dirs(suite_dir)?;
    let mut wide = spec.clone();
    for d in &dirs {
        if let Ok(m) = RunDir::open(d).read_manifest()
            && !wide.seeds.contains(&m.seed)
        {
            wide.seeds.push(m.seed);
        }
    }
    let planned: std::collections::BTreeSet<String> = crate::suite::expand(&wide)
        .map_err(|e| crate::report::ReportError::Invalid {
            path: spec.path.display().to_string(),
            msg: e.to_string(),
        })?
        .into_iter()
        .map(|r| r.run_id)
        .collect();
    let name = |d: &PathBuf| {
        d.file_name()
            .and_then(|n| n.to_str())
            .map(String::from)
            .unwrap_or_default()
    };
    let (current, stale): (Vec<PathBuf>, Vec<PathBuf>) =
        dirs.into_iter().partition(|d| planned.contains(&name(d)));
    let runs = current
        .iter()
        .map(|d| load_run(d))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((runs, stale.iter().map(name).collect()))
}

/// Read one run folder.
pub fn load_run(dir: &Path) -> Result<RunData, IoError> {
    let run = RunDir::open(dir);
    let manifest = run.read_manifest()?;
    let (config, base, axes) = RunData::names(&manifest);
    let layers = if dir.join("layers.parquet").is_file() {
        run.read_layers()?
    } else {
        Vec::new()
    };
    let mut perf: BTreeMap<String, Vec<(usize, f64)>> = BTreeMap::new();
    if dir.join("scalars.parquet").is_file() {
        for rec in run.read_scalars()? {
            for (k, v) in rec.scalars.range("perf/".to_string()..) {
                if !k.starts_with("perf/") {
                    break;
                }
                perf.entry(k.clone()).or_default().push((rec.step, *v));
            }
        }
    }
    Ok(RunData {
        dir: dir.to_path_buf(),
        manifest,
        config,
        base,
        axes,
        layers,
        perf,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::metrics::StepRecord;

    #[test]
    fn reads_names_axes_layers_and_timings_and_skips_half_written_folders() {
        let root = tempfile::tempdir().unwrap();
        let d = root.path().join("nvfp4-dq-s0-abc");
        let run = RunDir::create(&d).unwrap();
        let mut r = StepRecord {
            step: 0,
            ..Default::default()
        };
        r.set("perf/train_time", 0.5);
        r.set("rollout/raw_reward", 0.1);
        r.layers.push(LayerRecord {
            step: 0,
            site: "mlp.experts.linear_fc2".into(),
            layer: 5,
            precision: "nvfp4".into(),
            grad_norm: 2.0,
            saturated: 0,
            underflowed: 0,
        });
        run.write_metrics(&[r]).unwrap();
        let mut m = Manifest::start(
            "nvfp4-dq-s0-abc",
            "builtin",
            serde_json::json!({}),
            0,
            1,
            "cpu",
        );
        m.extra
            .insert("config_name".into(), "nvfp4-dq [bf16_last=4]".into());
        m.extra.insert("base_config".into(), "nvfp4-dq".into());
        m.extra
            .insert("axes".into(), serde_json::json!({"bf16_last": "4"}));
        run.write_manifest(&m).unwrap();
        std::fs::create_dir(root.path().join("half-written")).unwrap();
        std::fs::write(root.path().join("x.lock"), "1").unwrap();
        let runs = load_runs(root.path()).unwrap();
        assert_eq!(runs.len(), 1);
        let r = &runs[0];
        assert_eq!(r.config, "nvfp4-dq [bf16_last=4]");
        assert_eq!(r.base, "nvfp4-dq");
        assert_eq!(r.axes.get("bf16_last").map(String::as_str), Some("4"));
        assert_eq!(r.layers.len(), 1);
        assert_eq!(r.perf.len(), 1, "only perf/* keys are kept");
        assert_eq!(r.perf["perf/train_time"], vec![(0, 0.5)]);
    }
}

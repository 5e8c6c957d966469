//! Runs read into memory for comparing: per run its configuration, seed, status, the tracked metric
//! series, per-site-and-layer gradient norms and events. Reading goes through [`crate::store`]; this
//! module only reshapes what the store returns.

use crate::engine::metrics::Event;
use crate::io::IoError;
use crate::store::{RunDir, RunStatus, columns};
use rayon::prelude::*;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// One site's gradient norm over steps.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerSeries {
    pub site: String,
    pub layer: i64,
    pub steps: Vec<usize>,
    pub grad_norm: Vec<f64>,
}

/// One run in memory.
#[derive(Debug, Clone, PartialEq)]
pub struct RunData {
    pub run_id: String,
    /// Configuration name with sweep values, e.g. `nvfp4-dq [bf16_last=4]`.
    pub config: String,
    /// Base configuration name (the suite's `[[configs]] name`).
    pub base: String,
    /// Sweep values.
    pub axes: BTreeMap<String, String>,
    pub seed: u64,
    /// The engine that ran it (`builtin`, `command`, ...): the built-in engine couples the
    /// configurations of one seed, so only its runs are compared seed by seed.
    pub engine: String,
    pub status: RunStatus,
    /// Metric key → `(step, value)` points in step order (absent steps are absent, never 0).
    pub metrics: BTreeMap<String, Vec<(usize, f64)>>,
    pub layers: Vec<LayerSeries>,
    pub events: Vec<Event>,
    /// Steps on which the contract was checked, and violations found.
    pub contract_steps: usize,
    pub contract_violations: usize,
    /// Stored bytes of the model's matmul weights under the run's recipe (built-in runs only).
    pub weight_bytes: Option<f64>,
    pub path: PathBuf,
}

impl RunData {
    /// Whether the run may be compared: it finished (`ok`) or diverged (its curve counts).
    pub fn usable(&self) -> bool {
        matches!(self.status, RunStatus::Ok | RunStatus::Diverged)
    }
}

/// Which metric columns to keep (`None`: all).
pub type Wanted<'a> = Option<&'a BTreeSet<String>>;

/// Read one run folder. `config`/`base`/`axes` come from the manifest (`extra.config_name`,
/// `extra.base_config`, `extra.axes`, else the resolved config's `config` or the run id's prefix).
pub fn load_run(dir: &Path, wanted: Wanted<'_>) -> Result<RunData, IoError> {
    let rd = RunDir::open(dir);
    let m = rd.read_manifest()?;
    const CONTRACT: &str = "contract/violations";
    let with_contract: Option<BTreeSet<String>> = wanted.map(|w| {
        let mut w = w.clone();
        w.insert(CONTRACT.into());
        w
    });
    let mut metrics = match columns::read_scalar_columns(dir, with_contract.as_ref()) {
        Ok(c) => c,
        Err(e) if matches!(m.status, RunStatus::Ok | RunStatus::Diverged) => return Err(e),
        Err(_) => Default::default(), // a failed run may have no metrics at all
    };
    let contract = if wanted.is_some_and(|w| !w.contains(CONTRACT)) {
        metrics.remove(CONTRACT).unwrap_or_default()
    } else {
        metrics.get(CONTRACT).cloned().unwrap_or_default()
    };
    let contract_steps = contract.len();
    let contract_violations = contract.iter().map(|p| p.1.max(0.0) as usize).sum();
    let layers = columns::read_grad_norms(dir)?
        .into_iter()
        .map(|(site, layer, steps, grad_norm)| LayerSeries {
            site,
            layer,
            steps,
            grad_norm,
        })
        .collect();
    let events = rd.read_events()?;
    let extra = |k: &str| m.extra.get(k).and_then(|v| v.as_str()).map(str::to_string);
    let config = extra("config_name")
        .or_else(|| {
            m.config
                .get("config")
                .and_then(|v| v.as_str())
                .map(str::to_string)
        })
        .unwrap_or_else(|| config_from_run_id(&m.run_id, m.seed));
    let base = extra("base_config")
        .unwrap_or_else(|| config.split(" [").next().unwrap_or_default().to_string());
    let axes = m
        .extra
        .get("axes")
        .and_then(|v| serde_json::from_value(v.clone()).ok())
        .unwrap_or_default();
    Ok(RunData {
        run_id: m.run_id.clone(),
        config,
        base,
        axes,
        seed: m.seed,
        engine: m.engine.clone(),
        status: m.status,
        metrics,
        layers,
        events,
        contract_steps,
        contract_violations,
        weight_bytes: serde_json::from_value::<crate::suite::builtin::RunConfig>(m.config.clone())
            .ok()
            .and_then(|c| c.weight_bytes()),
        path: dir.to_path_buf(),
    })
}

/// `nvfp4-dq-s3-0a1b2c3d4e5f` → `nvfp4-dq`.
fn config_from_run_id(id: &str, seed: u64) -> String {
    let tag = format!("-s{seed}-");
    id.rfind(&tag)
        .map_or_else(|| id.to_string(), |i| id[..i].to_string())
}

/// Read many run folders in parallel (order preserved). Unreadable folders come back as errors
/// in `skipped`, each naming its path, so one broken run never hides the rest.
pub fn load_runs(dirs: &[PathBuf], wanted: Wanted<'_>) -> (Vec<RunData>, Vec<String>) {
    // Parquet decoding (polars, built unoptimised in dev) needs deep stacks: rayon's default
    // 2 MiB worker stacks overflowed on 1,000 runs, so the readers get their own pool.
    let read = || -> Vec<Result<RunData, IoError>> {
        dirs.par_iter().map(|d| load_run(d, wanted)).collect()
    };
    let res = match rayon::ThreadPoolBuilder::new().stack_size(64 << 20).build() {
        Ok(pool) => pool.install(read),
        Err(_) => dirs.iter().map(|d| load_run(d, wanted)).collect(),
    };
    let mut runs = Vec::new();
    let mut skipped = Vec::new();
    for r in res {
        match r {
            Ok(x) => runs.push(x),
            Err(e) => skipped.push(e.to_string()),
        }
    }
    (runs, skipped)
}

pub use crate::store::run_dirs;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_names_fall_back_to_the_run_id() {
        assert_eq!(config_from_run_id("nvfp4-dq-s3-0a1b2c", 3), "nvfp4-dq");
        assert_eq!(config_from_run_id("weird", 3), "weird");
    }
}

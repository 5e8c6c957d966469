//! One run folder: writing it as a run goes, reading it back.

use super::table;
use crate::engine::metrics::{Event, LayerRecord, StepRecord};
use crate::io::{IoError, atomic};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};

/// How a run ended (or that it has not).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RunStatus {
    Running,
    Ok,
    Failed,
    Diverged,
    Timeout,
    /// lockstep was stopped (SIGINT/SIGTERM) while the run was in flight; rerunning redoes it.
    Interrupted,
}

/// `manifest.json`: everything needed to know what a run was and how it ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub run_id: String,
    #[serde(default)]
    pub suite: Option<String>,
    /// `builtin` or `command`.
    pub engine: String,
    pub status: RunStatus,
    /// The resolved configuration (recipe, model, task, GRPO settings, ...).
    pub config: serde_json::Value,
    pub seed: u64,
    pub steps_planned: usize,
    pub steps_done: usize,
    pub lockstep_version: String,
    pub git_revision: String,
    pub host: String,
    pub device: String,
    /// True when low-precision formats are emulated (built-in engine): timings are not hardware's.
    pub emulated: bool,
    pub started: String,
    #[serde(default)]
    pub finished: Option<String>,
    #[serde(default)]
    pub error: Option<String>,
    /// Free-form extras (warm start, command exit code, Slurm job id, skipped metric lines...).
    #[serde(default)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl Manifest {
    /// A manifest for a run starting now.
    pub fn start(
        run_id: &str,
        engine: &str,
        config: serde_json::Value,
        seed: u64,
        steps: usize,
        device: &str,
    ) -> Manifest {
        Manifest {
            run_id: run_id.to_string(),
            suite: None,
            engine: engine.to_string(),
            status: RunStatus::Running,
            config,
            seed,
            steps_planned: steps,
            steps_done: 0,
            lockstep_version: env!("CARGO_PKG_VERSION").to_string(),
            git_revision: env!("LOCKSTEP_GIT_REV").to_string(),
            host: hostname(),
            device: device.to_string(),
            emulated: engine == "builtin",
            started: now_utc(),
            finished: None,
            error: None,
            extra: Default::default(),
        }
    }
}

/// This machine's host name (best effort).
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .map(|s| s.trim().to_string())
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown".into())
}

/// Current UTC time as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn now_utc() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// A run folder being written or read.
#[derive(Debug, Clone)]
pub struct RunDir {
    pub path: PathBuf,
}

impl RunDir {
    /// Create (or reopen) the folder.
    pub fn create(path: &Path) -> Result<RunDir, IoError> {
        std::fs::create_dir_all(path).map_err(|e| IoError::io(path, e))?;
        Ok(RunDir {
            path: path.to_path_buf(),
        })
    }

    pub fn open(path: &Path) -> RunDir {
        RunDir {
            path: path.to_path_buf(),
        }
    }

    pub fn write_manifest(&self, m: &Manifest) -> Result<(), IoError> {
        let p = self.path.join("manifest.json");
        let text =
            serde_json::to_string_pretty(m).map_err(|e| IoError::invalid(&p, e.to_string()))?;
        atomic::write_file(&p, text.as_bytes())
    }

    pub fn read_manifest(&self) -> Result<Manifest, IoError> {
        let p = self.path.join("manifest.json");
        let text = std::fs::read_to_string(&p).map_err(|e| IoError::io(&p, e))?;
        serde_json::from_str(&text)
            .map_err(|e| IoError::invalid(&p, format!("not a lockstep manifest: {e}")))
    }

    /// Append one line to `log.txt` (the log is a convenience, not read back as data).
    pub fn log(&self, line: &str) {
        let p = self.path.join("log.txt");
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
        {
            let _ = writeln!(f, "{line}");
        }
    }

    /// Write `scalars.parquet`, `layers.parquet` and `events.jsonl` for all steps so far.
    pub fn write_metrics(&self, records: &[StepRecord]) -> Result<(), IoError> {
        let p = self.path.join("scalars.parquet");
        let bytes =
            table::scalars_parquet(records).map_err(|e| IoError::invalid(&p, e.to_string()))?;
        atomic::write_file(&p, &bytes)?;
        let p = self.path.join("layers.parquet");
        let bytes =
            table::layers_parquet(records).map_err(|e| IoError::invalid(&p, e.to_string()))?;
        atomic::write_file(&p, &bytes)?;
        let events: Vec<&Event> = records.iter().flat_map(|r| &r.events).collect();
        self.write_events(&events)
    }

    pub fn write_events(&self, events: &[&Event]) -> Result<(), IoError> {
        let p = self.path.join("events.jsonl");
        let mut text = String::new();
        for e in events {
            text.push_str(
                &serde_json::to_string(e).map_err(|err| IoError::invalid(&p, err.to_string()))?,
            );
            text.push('\n');
        }
        atomic::write_file(&p, text.as_bytes())
    }

    /// Read `scalars.parquet` back into step records (scalars only; null cells are absent keys).
    pub fn read_scalars(&self) -> Result<Vec<StepRecord>, IoError> {
        let p = self.path.join("scalars.parquet");
        let df = self.read_table(&p)?;
        table::scalars_from_frame(&df)
            .map_err(|e| IoError::invalid(&p, format!("not a lockstep scalars table: {e}")))
    }

    /// Read the per-site-and-layer rows back (one per step, site and layer).
    pub fn read_layers(&self) -> Result<Vec<LayerRecord>, IoError> {
        let p = self.path.join("layers.parquet");
        let df = self.read_table(&p)?;
        table::layers_from_frame(&df)
            .map_err(|e| IoError::invalid(&p, format!("not a lockstep layers table: {e}")))
    }

    fn read_table(&self, p: &Path) -> Result<polars::prelude::DataFrame, IoError> {
        let bytes = std::fs::read(p).map_err(|e| IoError::io(p, e))?;
        table::read_frame(&bytes)
            .map_err(|e| IoError::invalid(p, format!("not a Parquet file: {e}")))
    }

    pub fn read_events(&self) -> Result<Vec<Event>, IoError> {
        let p = self.path.join("events.jsonl");
        let text = match std::fs::read_to_string(&p) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(IoError::io(&p, e)),
        };
        text.lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(i, l)| {
                serde_json::from_str(l)
                    .map_err(|e| IoError::invalid(&p, format!("line {}: {e}", i + 1)))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_round_trip_exactly_through_parquet() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::create(&dir.path().join("r")).unwrap();
        let mut a = StepRecord {
            step: 0,
            ..Default::default()
        };
        a.set("rollout/raw_reward", 0.25);
        a.set("train/grad_norm", 0.1 + 0.2); // not a short decimal: must come back bit for bit
        a.layers.push(LayerRecord {
            step: 0,
            site: "mlp.router".into(),
            layer: 1,
            precision: "bf16".into(),
            grad_norm: 0.5,
            saturated: 0,
            underflowed: 2,
        });
        let mut b = StepRecord {
            step: 1,
            ..Default::default()
        };
        b.set("rollout/raw_reward", 0.5);
        b.set("eval/accuracy", 0.4);
        b.events.push(Event {
            step: 1,
            kind: "grad_spike".into(),
            site: "mlp.router".into(),
            layer: 1,
            value: 9.0,
            detail: String::new(),
        });
        run.write_metrics(&[a, b]).unwrap();
        let back = run.read_scalars().unwrap();
        assert_eq!(back.len(), 2);
        assert_eq!(
            back[0].get("eval/accuracy"),
            None,
            "a step without the metric stays absent, not 0"
        );
        assert_eq!(back[1].get("eval/accuracy"), Some(0.4));
        assert_eq!(back[1].get("rollout/raw_reward"), Some(0.5));
        assert_eq!(back[0].get("train/grad_norm"), Some(0.1 + 0.2));
        assert_eq!(back[1].step, 1);
        let layers = run.read_layers().unwrap();
        assert_eq!(layers.len(), 1);
        assert_eq!(layers[0].underflowed, 2);
        assert_eq!(run.read_events().unwrap().len(), 1);
        let m = Manifest::start("abc", "builtin", serde_json::json!({"x": 1}), 3, 10, "cpu");
        run.write_manifest(&m).unwrap();
        assert_eq!(run.read_manifest().unwrap(), m);
        assert!(m.emulated);
    }
}

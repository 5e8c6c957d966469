//! The submission record: `<store>/<suite>/.slurm/<id>/` holds one job array's `job.sbatch`, its
//! `runs.txt` (line N+1 = array task N), the tasks' Slurm logs (`logs/`) and `submission.json`.
//!
//! The record is written *before* `sbatch` runs, under the job name it submits, so a lockstep that
//! dies between `sbatch` and saving the job id still finds its array afterwards (by name, in
//! `squeue`) and never submits those runs a second time. A record is closed once none of its
//! tasks is queued or running any more; closed records are history and are not queried again.

use crate::io::{IoError, atomic};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// One submitted (or being submitted) job array.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Submission {
    /// The Slurm job name, unique per submission: `lockstep-<suite>-<id>`.
    pub name: String,
    /// The array's job id, once `sbatch` answered.
    #[serde(default)]
    pub job_id: Option<String>,
    /// Run ids by array index.
    pub runs: Vec<String>,
    pub submitted: String,
    /// No task of it is queued or running any more.
    #[serde(default)]
    pub closed: bool,
    /// The folder the record lives in.
    #[serde(skip)]
    pub dir: PathBuf,
}

/// Where a suite's submission records live.
pub fn slurm_dir(suite_root: &Path) -> PathBuf {
    suite_root.join(".slurm")
}

impl Submission {
    /// A fresh submission folder (with `logs/`) for these runs; nothing is written into it yet.
    pub fn create(suite_root: &Path, suite: &str, runs: Vec<String>) -> Result<Self, IoError> {
        let base = slurm_dir(suite_root);
        std::fs::create_dir_all(&base).map_err(|e| IoError::io(&base, e))?;
        let stamp: String = crate::store::run::now_utc()
            .chars()
            .filter(|c| c.is_ascii_digit())
            .collect();
        for n in 0..1000u32 {
            let id = format!("{stamp}-{}-{n}", std::process::id());
            let dir = base.join(&id);
            match std::fs::create_dir(&dir) {
                Ok(()) => {
                    let logs = dir.join("logs");
                    std::fs::create_dir(&logs).map_err(|e| IoError::io(&logs, e))?;
                    return Ok(Submission {
                        name: format!("lockstep-{suite}-{id}"),
                        job_id: None,
                        runs,
                        submitted: crate::store::run::now_utc(),
                        closed: false,
                        dir,
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(IoError::io(&dir, e)),
            }
        }
        Err(IoError::invalid(
            &base,
            "could not make a new submission folder",
        ))
    }

    /// The submission `create` would make now, without touching the disk (for `--dry-run`).
    pub fn preview(suite_root: &Path, suite: &str, runs: Vec<String>) -> Self {
        let stamp: String = crate::store::run::now_utc()
            .chars()
            .filter(|c| c.is_ascii_digit())
            .collect();
        let id = format!("{stamp}-{}-0", std::process::id());
        Submission {
            name: format!("lockstep-{suite}-{id}"),
            job_id: None,
            runs,
            submitted: crate::store::run::now_utc(),
            closed: false,
            dir: slurm_dir(suite_root).join(id),
        }
    }

    pub fn script_path(&self) -> PathBuf {
        self.dir.join("job.sbatch")
    }
    pub fn runs_path(&self) -> PathBuf {
        self.dir.join("runs.txt")
    }
    pub fn logs_dir(&self) -> PathBuf {
        self.dir.join("logs")
    }

    /// Write `submission.json` atomically.
    pub fn save(&self) -> Result<(), IoError> {
        let p = self.dir.join("submission.json");
        let text =
            serde_json::to_string_pretty(self).map_err(|e| IoError::invalid(&p, e.to_string()))?;
        atomic::write_file(&p, text.as_bytes())
    }

    /// Write `runs.txt` (one run id per line, array task N on line N+1) atomically.
    pub fn save_runs(&self) -> Result<(), IoError> {
        let mut text = self.runs.join("\n");
        text.push('\n');
        atomic::write_file(&self.runs_path(), text.as_bytes())
    }
}

/// Every submission record of a suite, oldest first. A folder without `submission.json` (a
/// submission that died before its record was saved, so before `sbatch`) is ignored.
pub fn read_all(suite_root: &Path) -> Result<Vec<Submission>, IoError> {
    let base = slurm_dir(suite_root);
    let entries = match std::fs::read_dir(&base) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(IoError::io(&base, e)),
    };
    let mut out = Vec::new();
    for entry in entries.filter_map(Result::ok) {
        let p = entry.path().join("submission.json");
        let text = match std::fs::read_to_string(&p) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(IoError::io(&p, e)),
        };
        let mut s: Submission = serde_json::from_str(&text).map_err(|e| {
            IoError::invalid(
                &p,
                format!(
                    "not a lockstep submission record ({e}); if no job of it is queued (squeue), delete its folder"
                ),
            )
        })?;
        s.dir = entry.path();
        out.push(s);
    }
    out.sort_by(|a, b| a.dir.cmp(&b.dir));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_unsaved_folders_are_ignored() {
        let d = tempfile::tempdir().unwrap();
        let mut a = Submission::create(d.path(), "t", vec!["r1".into(), "r2".into()]).unwrap();
        let b = Submission::create(d.path(), "t", vec!["r3".into()]).unwrap();
        assert_ne!(a.name, b.name, "job names must never repeat");
        assert!(a.name.starts_with("lockstep-t-"));
        assert!(a.logs_dir().is_dir());
        a.save().unwrap();
        a.save_runs().unwrap();
        assert_eq!(std::fs::read_to_string(a.runs_path()).unwrap(), "r1\nr2\n");
        a.job_id = Some("12".into());
        a.save().unwrap();
        let all = read_all(d.path()).unwrap(); // b was never saved
        assert_eq!(all, vec![a.clone()]);
        std::fs::write(b.dir.join("submission.json"), "{").unwrap();
        let e = read_all(d.path()).unwrap_err().to_string();
        assert!(e.contains("submission.json") && e.contains("delete"), "{e}");
    }
}

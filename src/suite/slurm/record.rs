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

/// Serialises plan-and-submit per suite, so two lockstep processes started at once cannot both
/// submit the same unfinished runs. `.slurm/submit.lock` holds `host pid unix-seconds`; a lock
/// whose process is gone (same host) or that is older than [`STALE_LOCK_S`] (another host, where
/// the process cannot be checked) is taken over. Released on drop.
#[derive(Debug)]
pub struct SubmitLock(PathBuf);

/// Seconds after which another host's submit lock counts as abandoned (submitting takes seconds).
pub const STALE_LOCK_S: u64 = 600;

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Whether a submit lock with content `text` may be taken over by `host` at `now`.
pub fn lock_is_stale(text: &str, host: &str, now: u64) -> bool {
    let w: Vec<&str> = text.split_whitespace().collect();
    let [h, pid, t] = w[..] else {
        return false; // being written right now
    };
    let t: u64 = t.parse().unwrap_or(0);
    if h == host {
        !Path::new(&format!("/proc/{pid}")).exists()
    } else {
        now.saturating_sub(t) > STALE_LOCK_S
    }
}

impl SubmitLock {
    /// Take the suite's submit lock, waiting up to `wait` for another lockstep to finish.
    pub fn acquire(suite_root: &Path, wait: std::time::Duration) -> Result<SubmitLock, IoError> {
        use std::io::Write;
        let dir = slurm_dir(suite_root);
        std::fs::create_dir_all(&dir).map_err(|e| IoError::io(&dir, e))?;
        let p = dir.join("submit.lock");
        let host = crate::store::run::hostname();
        let deadline = std::time::Instant::now() + wait;
        loop {
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&p)
            {
                Ok(mut f) => {
                    write!(f, "{host} {} {}", std::process::id(), unix_now())
                        .map_err(|e| IoError::io(&p, e))?;
                    return Ok(SubmitLock(p));
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let text = std::fs::read_to_string(&p).unwrap_or_default();
                    if lock_is_stale(&text, &host, unix_now()) {
                        let _ = std::fs::remove_file(&p);
                        continue;
                    }
                    if std::time::Instant::now() >= deadline {
                        return Err(IoError::invalid(
                            &p,
                            format!(
                                "another lockstep (host pid time: {}) is submitting this suite; wait for it, or delete this file if that process is gone",
                                text.trim()
                            ),
                        ));
                    }
                    std::thread::sleep(std::time::Duration::from_millis(200));
                }
                Err(e) => return Err(IoError::io(&p, e)),
            }
        }
    }
}

impl Drop for SubmitLock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
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
        if !entry.path().is_dir() {
            continue; // submit.lock
        }
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
    fn submit_lock_excludes_a_second_taker_and_stale_locks_are_taken_over() {
        let d = tempfile::tempdir().unwrap();
        let short = std::time::Duration::from_millis(300);
        let l = SubmitLock::acquire(d.path(), short).unwrap();
        let e = SubmitLock::acquire(d.path(), short)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("submit.lock") && e.contains("another lockstep"),
            "{e}"
        );
        drop(l);
        let again = SubmitLock::acquire(d.path(), short).unwrap();
        drop(again);
        // Gone process on this host, abandoned lock elsewhere, fresh lock elsewhere, half-written.
        let host = crate::store::run::hostname();
        assert!(lock_is_stale(&format!("{host} 999999999 5"), &host, 10));
        assert!(!lock_is_stale(
            &format!("{host} {} 5", std::process::id()),
            &host,
            10
        ));
        assert!(lock_is_stale(
            "other-host 1 100",
            &host,
            100 + STALE_LOCK_S + 1
        ));
        assert!(!lock_is_stale(
            "other-host 1 100",
            &host,
            100 + STALE_LOCK_S
        ));
        assert!(!lock_is_stale("", &host, 1 << 40));
        std::fs::write(
            slurm_dir(d.path()).join("submit.lock"),
            format!("{host} 999999999 5"),
        )
        .unwrap();
        SubmitLock::acquire(d.path(), short).expect("a dead owner's lock is taken over");
    }

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

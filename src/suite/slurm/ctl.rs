//! Talking to Slurm: `sbatch`, `squeue`, `scontrol`, `sacct` and `scancel`, always through argv (never a
//! shell string), with their text output parsed by pure functions that the tests pin.
//!
//! `squeue` sees only queued and running tasks; a task that has left it has ended, and its end
//! state comes from `scontrol show job` (kept by the controller for `MinJobAge`, 300 s by default)
//! or, on clusters with accounting, `sacct`. Jobs are looked up by their unique job *name*, never
//! by id alone: ids restart when a controller's state is wiped, names from lockstep do not repeat.

use std::collections::BTreeMap;
use std::process::Command;

/// Slurm could not be asked, or said no.
#[derive(Debug, thiserror::Error)]
pub enum SlurmError {
    #[error(
        "`{tool}` not found on PATH: --executor slurm needs Slurm's client commands (sbatch, squeue, scontrol); install them (Debian: apt-get install slurm-client) or run lockstep on a login node"
    )]
    Missing { tool: String },
    #[error("{what}: {tool} said: {said}")]
    Said {
        tool: String,
        what: String,
        said: String,
    },
    #[error("{0}")]
    Io(#[from] crate::io::IoError),
    #[error("{0}")]
    Invalid(String),
}

/// Run one Slurm command and return its stdout; a non-zero exit becomes [`SlurmError::Said`]
/// carrying Slurm's own message on one line.
pub fn tool(name: &str, args: &[String], what: &str) -> Result<String, SlurmError> {
    let out = Command::new(name).args(args).output().map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            SlurmError::Missing { tool: name.into() }
        } else {
            SlurmError::Said {
                tool: name.into(),
                what: what.into(),
                said: e.to_string(),
            }
        }
    })?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let said = one_line(if stderr.trim().is_empty() {
            &stdout
        } else {
            &stderr
        });
        return Err(SlurmError::Said {
            tool: name.into(),
            what: what.into(),
            said: if said.is_empty() {
                format!("exit status {}", out.status)
            } else {
                said
            },
        });
    }
    Ok(stdout)
}

/// Slurm's multi-line complaints joined into one line.
pub fn one_line(text: &str) -> String {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" | ")
}

/// One line of `squeue`: a queued or running array task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueRow {
    pub array_job_id: String,
    /// The array index (`None` for a job that is not an array task).
    pub task: Option<usize>,
    /// The task's own job id.
    pub job_id: String,
    pub name: String,
    /// PENDING, RUNNING, COMPLETING, ...
    pub state: String,
    pub node: String,
    pub reason: String,
}

/// The `squeue` output format [`parse_squeue`] reads (`|`-separated; the reason goes last
/// because it is free text).
pub const SQUEUE_FORMAT: &str = "%F|%K|%A|%j|%T|%N|%r";

/// Parse `squeue -h -r -o SQUEUE_FORMAT` output (one line per task; `-r` expands pending ranges).
pub fn parse_squeue(text: &str) -> Vec<QueueRow> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.trim().splitn(7, '|').collect();
            if f.len() < 7 || f[0].is_empty() {
                return None;
            }
            Some(QueueRow {
                array_job_id: f[0].to_string(),
                task: f[1].parse().ok(),
                job_id: f[2].to_string(),
                name: f[3].to_string(),
                state: f[4].to_string(),
                node: f[5].to_string(),
                reason: f[6].to_string(),
            })
        })
        .collect()
}

/// The queued and running tasks of the jobs named `names` (one `squeue` call; unknown names
/// simply have no rows).
pub fn squeue_by_names(names: &[String]) -> Result<Vec<QueueRow>, SlurmError> {
    if names.is_empty() {
        return Ok(Vec::new());
    }
    let args = vec![
        "-h".to_string(),
        "-r".into(),
        "-n".into(),
        names.join(","),
        "-o".into(),
        SQUEUE_FORMAT.into(),
    ];
    let out = tool(
        "squeue",
        &args,
        "asking Slurm which lockstep tasks are queued",
    )?;
    let wanted: std::collections::BTreeSet<&str> = names.iter().map(String::as_str).collect();
    Ok(parse_squeue(&out)
        .into_iter()
        .filter(|r| wanted.contains(r.name.as_str()))
        .collect())
}

/// Submit a batch script; returns the job id (`sbatch --parsable` prints `ID` or `ID;cluster`).
pub fn sbatch(script: &std::path::Path, what: &str) -> Result<String, SlurmError> {
    let out = tool(
        "sbatch",
        &["--parsable".to_string(), script.display().to_string()],
        what,
    )?;
    parse_sbatch(&out).ok_or_else(|| SlurmError::Said {
        tool: "sbatch".into(),
        what: what.into(),
        said: format!("no job id in its answer `{}`", one_line(&out)),
    })
}

/// Cancel every task of the job (array) `job_id`: `scancel JOB_ID`, as argv.
pub fn scancel(job_id: &str) -> Result<(), SlurmError> {
    tool(
        "scancel",
        &[job_id.to_string()],
        &format!("cancelling job array {job_id}"),
    )
    .map(|_| ())
}

/// The job id in `sbatch --parsable` output.
pub fn parse_sbatch(out: &str) -> Option<String> {
    let id = out.lines().rev().find(|l| !l.trim().is_empty())?.trim();
    let id = id.split(';').next()?.trim();
    (!id.is_empty() && id.chars().all(|c| c.is_ascii_digit())).then(|| id.to_string())
}

/// How an array task ended, as Slurm reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskEnd {
    /// COMPLETED, FAILED, CANCELLED, NODE_FAIL, TIMEOUT, OUT_OF_MEMORY, ... or UNKNOWN.
    pub state: String,
    /// `exit:signal`, e.g. `0:0`, `1:0`, `0:15`.
    pub exit_code: String,
    pub node: String,
    pub job_id: String,
}

impl TaskEnd {
    /// What lockstep records when Slurm no longer knows the task.
    pub fn unknown() -> TaskEnd {
        TaskEnd {
            state: "UNKNOWN".into(),
            exit_code: String::new(),
            node: String::new(),
            job_id: String::new(),
        }
    }
}

/// Parse `scontrol show job -o` output: one `Key=Value` record per line. Values with spaces
/// (commands, paths) lose their tail, which none of the keys read here have.
pub fn parse_scontrol(text: &str) -> Vec<BTreeMap<String, String>> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            l.split_whitespace()
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        })
        .collect()
}

/// End states by array index from `scontrol show job -o` records of one array job; pending
/// ranges (`ArrayTaskId=4-7`) and records of other jobs are ignored.
pub fn ends_from_scontrol(
    records: &[BTreeMap<String, String>],
    array_job_id: &str,
) -> BTreeMap<usize, TaskEnd> {
    records
        .iter()
        .filter(|r| r.get("ArrayJobId").map(String::as_str) == Some(array_job_id))
        .filter_map(|r| {
            let idx = r.get("ArrayTaskId")?.parse().ok()?;
            let g = |k: &str| r.get(k).cloned().unwrap_or_default();
            let node = g("NodeList");
            Some((
                idx,
                TaskEnd {
                    state: g("JobState"),
                    exit_code: g("ExitCode"),
                    node: if node == "(null)" {
                        String::new()
                    } else {
                        node
                    },
                    job_id: g("JobId"),
                },
            ))
        })
        .collect()
}

/// The `sacct` fields [`ends_from_sacct`] reads.
pub const SACCT_FORMAT: &str = "JobID,State,ExitCode,NodeList,JobIDRaw";

/// End states by array index from `sacct -n -P -X -j ID --format SACCT_FORMAT` output. States
/// like `CANCELLED by 0` keep their first word; condensed pending ranges are ignored.
pub fn ends_from_sacct(text: &str, array_job_id: &str) -> BTreeMap<usize, TaskEnd> {
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.trim().split('|').collect();
            if f.len() < 5 {
                return None;
            }
            let (job, idx) = f[0].split_once('_')?;
            if job != array_job_id {
                return None;
            }
            let node = f[3].to_string();
            Some((
                idx.parse().ok()?,
                TaskEnd {
                    state: f[1].split_whitespace().next().unwrap_or("").to_string(),
                    exit_code: f[2].to_string(),
                    node: if node == "None assigned" {
                        String::new()
                    } else {
                        node
                    },
                    job_id: f[4].to_string(),
                },
            ))
        })
        .collect()
}

/// How the ended tasks of one array job ended: `scontrol` first (no database needed), then
/// `sacct` for what the controller has already forgotten. Tasks neither knows are absent.
pub fn task_ends(array_job_id: &str) -> BTreeMap<usize, TaskEnd> {
    let args = vec![
        "show".to_string(),
        "job".into(),
        "-o".into(),
        array_job_id.to_string(),
    ];
    let mut ends = tool("scontrol", &args, "reading job states")
        .map(|t| ends_from_scontrol(&parse_scontrol(&t), array_job_id))
        .unwrap_or_default();
    let sacct = [
        "-n",
        "-P",
        "-X",
        "-j",
        array_job_id,
        "--format",
        SACCT_FORMAT,
    ]
    .map(String::from);
    if let Ok(t) = tool("sacct", &sacct, "reading job accounting") {
        for (i, e) in ends_from_sacct(&t, array_job_id) {
            ends.entry(i).or_insert(e);
        }
    }
    ends
}

/// States after which a task no longer runs (Slurm's base job states).
pub fn is_terminal(state: &str) -> bool {
    matches!(
        state,
        "COMPLETED"
            | "FAILED"
            | "CANCELLED"
            | "TIMEOUT"
            | "NODE_FAIL"
            | "OUT_OF_MEMORY"
            | "PREEMPTED"
            | "BOOT_FAIL"
            | "DEADLINE"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn squeue_rows_are_parsed_with_free_text_reasons() {
        // Real output of `squeue -h -r -o '%F|%K|%A|%j|%T|%N|%r'` on Slurm 22.05.
        let text = "1|2|1|lockstep-t-a|PENDING||Resources\n1|0|2|lockstep-t-a|RUNNING|vm|None\n7|N/A|7|other|RUNNING|n1|a|b\n\n";
        let rows = parse_squeue(text);
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[0].task, Some(2));
        assert_eq!(rows[0].job_id, "1");
        assert_eq!(rows[0].state, "PENDING");
        assert_eq!(rows[0].node, "");
        assert_eq!(rows[1].node, "vm");
        assert_eq!(rows[2].task, None);
        assert_eq!(rows[2].reason, "a|b");
    }

    #[test]
    fn sbatch_job_ids_with_and_without_cluster() {
        assert_eq!(parse_sbatch("12\n").as_deref(), Some("12"));
        assert_eq!(parse_sbatch("345;cluster\n").as_deref(), Some("345"));
        assert_eq!(parse_sbatch("Submitted batch job 12\n"), None);
        assert_eq!(parse_sbatch(""), None);
    }

    #[test]
    fn scontrol_records_give_per_task_ends_and_skip_pending_ranges() {
        let text = "JobId=9 ArrayJobId=8 ArrayTaskId=1 JobName=x JobState=CANCELLED Reason=None ExitCode=0:15 NodeList=vm Command=/a b\n\
                    JobId=8 ArrayJobId=8 ArrayTaskId=2-3 JobState=PENDING ExitCode=0:0 NodeList=(null)\n\
                    JobId=10 ArrayJobId=8 ArrayTaskId=0 JobState=COMPLETED ExitCode=0:0 NodeList=vm\n\
                    JobId=3 ArrayJobId=2 ArrayTaskId=0 JobState=FAILED ExitCode=1:0 NodeList=vm\n";
        let ends = ends_from_scontrol(&parse_scontrol(text), "8");
        assert_eq!(ends.len(), 2);
        assert_eq!(ends[&1].state, "CANCELLED");
        assert_eq!(ends[&1].exit_code, "0:15");
        assert_eq!(ends[&1].job_id, "9");
        assert_eq!(ends[&0].state, "COMPLETED");
        assert_eq!(ends[&0].node, "vm");
    }

    #[test]
    fn sacct_lines_keep_the_state_word_and_skip_other_jobs() {
        let text = "8_0|COMPLETED|0:0|vm|10\n8_1|CANCELLED by 0|0:15|vm|9\n8_[2-3]|CANCELLED by 0|0:0|None assigned|8\n80_1|FAILED|1:0|vm|81\n";
        let ends = ends_from_sacct(text, "8");
        assert_eq!(ends.len(), 2);
        assert_eq!(ends[&1].state, "CANCELLED");
        assert_eq!(ends[&0].job_id, "10");
    }

    #[test]
    fn missing_tools_and_refusals_are_reported_with_what_was_said() {
        let e = tool("lockstep-no-such-tool", &[], "x").unwrap_err();
        assert!(matches!(e, SlurmError::Missing { .. }), "{e}");
        assert!(e.to_string().contains("lockstep-no-such-tool"), "{e}");
        let e = tool(
            "sh",
            &[
                "-c".into(),
                "echo 'sbatch: error: no\nsecond' >&2; exit 1".into(),
            ],
            "submitting",
        )
        .unwrap_err()
        .to_string();
        assert_eq!(e, "submitting: sh said: sbatch: error: no | second");
        assert!(is_terminal("NODE_FAIL") && !is_terminal("COMPLETING"));
    }
}

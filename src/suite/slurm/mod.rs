//! Sweeps on a Slurm cluster: the unfinished runs of a suite go out as ONE job array (one task
//! per run), each task running this lockstep binary's `run-one --suite FILE --run-id ID --store
//! DIR` against the shared store, so a run made in Slurm is the same folder a local run makes.
//! lockstep then follows the array through `squeue` (and `scontrol`/`sacct` for how tasks
//! ended) and records each task's job id, array index, node, state and exit code in the run's
//! manifest (`extra.slurm`).
//!
//! Nothing runs twice: a run is submitted only if it is not finished and no task of an earlier,
//! still-open submission of the suite has it queued or running (checked in `squeue` by the
//! submission's unique job name; see [`record`]). So rerunning the same command after lockstep
//! crashed, a task was cancelled or a node failed resubmits exactly the runs that did not finish
//! and follows the ones still in Slurm. A task that finds its run already finished exits at once.
//!
//! Ownership of a run folder: a task writes `.slurm/tasks/<run-id>.json` (its identity) before it
//! starts the run; only the task named there may have its end recorded into the run's manifest,
//! so an older task's cancellation can never overwrite a newer attempt.

pub mod ctl;
pub mod record;
pub mod script;

pub use ctl::{SlurmError, TaskEnd};
pub use record::Submission;

use super::plan::RunSpec;
use super::runner::{is_finished, suite_dir};
use super::spec::SuiteSpec;
use crate::io::{IoError, atomic};
use crate::store::{RunDir, RunStatus};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// sbatch options: the suite's `[slurm]` table, each overridable on the command line.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SlurmSpec {
    pub partition: Option<String>,
    /// GPUs per run (`--gres=gpu:N`); leave unset for CPU runs.
    pub gpus_per_run: Option<u32>,
    /// CPUs per run (`--cpus-per-task`); the engine uses that many threads.
    pub cpus_per_run: Option<u32>,
    /// Time limit per run, in Slurm's syntax (`30`, `02:00:00`, `1-00:00:00`).
    pub time: Option<String>,
    pub account: Option<String>,
    /// Memory per run (`--mem`), e.g. `16G`.
    pub mem: Option<String>,
    /// Further sbatch options, each one `--name=value` or `--flag`.
    pub sbatch_args: Vec<String>,
}

impl SlurmSpec {
    /// These defaults with every option `over` sets taking their place; sbatch arguments add up
    /// (the suite's first, so a later duplicate from the command line wins in sbatch).
    pub fn overridden_by(&self, over: &SlurmSpec) -> SlurmSpec {
        SlurmSpec {
            partition: over.partition.clone().or_else(|| self.partition.clone()),
            gpus_per_run: over.gpus_per_run.or(self.gpus_per_run),
            cpus_per_run: over.cpus_per_run.or(self.cpus_per_run),
            time: over.time.clone().or_else(|| self.time.clone()),
            account: over.account.clone().or_else(|| self.account.clone()),
            mem: over.mem.clone().or_else(|| self.mem.clone()),
            sbatch_args: self
                .sbatch_args
                .iter()
                .chain(&over.sbatch_args)
                .cloned()
                .collect(),
        }
    }
}

/// How to submit and follow.
#[derive(Debug, Clone)]
pub struct SlurmOptions {
    pub sbatch: SlurmSpec,
    /// Run store root (absolute: tasks run elsewhere).
    pub store: PathBuf,
    /// Warm-start cache (absolute).
    pub cache: PathBuf,
    /// Redo finished runs too.
    pub force: bool,
    /// At most this many tasks at once.
    pub max_parallel: Option<usize>,
    /// Seconds between `squeue` polls.
    pub poll: Duration,
    /// The lockstep binary the tasks run.
    pub exe: PathBuf,
    /// The suite file (absolute).
    pub suite_file: PathBuf,
    /// The tasks' working directory.
    pub workdir: PathBuf,
    /// `--device` passed to every task's `run-one` (built-in engine on a GPU node); the device is
    /// opened in the task, never on the submitting machine.
    pub device: Option<String>,
}

/// One array task.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskRef {
    pub array_job_id: String,
    pub index: usize,
}

impl std::fmt::Display for TaskRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}_{}", self.array_job_id, self.index)
    }
}

/// What the follower tells its progress display.
#[derive(Debug, Clone)]
pub enum SlurmEvent<'a> {
    /// Finished before: not submitted.
    Skipped { run: &'a RunSpec },
    /// Queued or running from an earlier submission: followed, not resubmitted.
    InFlight {
        run: &'a RunSpec,
        task: &'a TaskRef,
        state: &'a str,
    },
    /// A job array went to Slurm.
    Submitted {
        job_id: &'a str,
        runs: usize,
        script: &'a Path,
    },
    Started {
        run: &'a RunSpec,
        task: &'a TaskRef,
        node: &'a str,
    },
    /// The task's run reached a step (0-based), read from its `log.txt`.
    Step {
        run: &'a RunSpec,
        task: &'a TaskRef,
        step: usize,
        reward: Option<f64>,
    },
    /// The task left the queue. `status` is the run's manifest status after recording the end
    /// (`None`: the task never started its run, e.g. cancelled while pending).
    Ended {
        run: &'a RunSpec,
        task: &'a TaskRef,
        end: &'a TaskEnd,
        status: Option<RunStatus>,
        error: Option<String>,
    },
    /// `squeue` failed; retrying.
    QueueError { error: String },
}

/// Counts at the end of a Slurm sweep.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlurmSummary {
    pub ok: usize,
    pub skipped: usize,
    pub failed: usize,
    pub diverged: usize,
    /// Runs sent to Slurm by this invocation.
    pub submitted: usize,
    /// Runs already in Slurm from an earlier invocation, followed instead of resubmitted.
    pub followed: usize,
    /// Runs whose task lockstep cancelled when it was stopped, marked `interrupted`.
    pub interrupted: usize,
    /// The signal (SIGINT, SIGTERM) that stopped lockstep while it followed the sweep: the job
    /// array this invocation submitted was cancelled (`scancel ID`).
    pub signal: Option<i32>,
    /// The job array this invocation submitted, if any (what `scancel` was given on a stop).
    pub job_id: Option<String>,
    /// Why cancelling failed, if it did (the tasks may still be in Slurm).
    pub cancel_error: Option<String>,
    /// Tasks of earlier submissions still queued or running when lockstep was stopped: another
    /// lockstep submitted them (and may be following them), so they were left alone.
    pub left_running: usize,
}

/// A task lockstep follows until it leaves the queue.
#[derive(Debug, Clone)]
pub struct Tracked<'r> {
    pub run: &'r RunSpec,
    pub task: TaskRef,
    /// The submission's job name.
    pub name: String,
    /// The Slurm state last seen (PENDING, RUNNING, ...).
    pub state: String,
    started: bool,
    last_step: Option<usize>,
    ended: bool,
}

impl<'r> Tracked<'r> {
    fn new(run: &'r RunSpec, task: TaskRef, name: String) -> Self {
        Tracked {
            run,
            task,
            name,
            state: "PENDING".into(),
            started: false,
            last_step: None,
            ended: false,
        }
    }
}

/// What a sweep amounts to before anything is submitted.
#[derive(Debug)]
pub struct Plan<'r> {
    /// `<store>/<suite>`.
    pub root: PathBuf,
    pub skipped: Vec<&'r RunSpec>,
    pub in_flight: Vec<Tracked<'r>>,
    pub submit: Vec<&'r RunSpec>,
    /// Submissions with tasks still queued or running.
    pub open: Vec<Submission>,
    /// Held from planning until the array is submitted (`None` for a dry run).
    lock: Option<record::SubmitLock>,
}

/// Sort `runs` into finished, already in Slurm, and to submit. Earlier submissions are looked
/// up in `squeue`; their ended tasks get their end recorded, and submissions with nothing left
/// in the queue are closed (unless `dry_run`, which writes nothing).
pub fn plan<'r>(
    suite: &SuiteSpec,
    runs: &'r [RunSpec],
    opts: &SlurmOptions,
    dry_run: bool,
) -> Result<Plan<'r>, SlurmError> {
    let root = suite_dir(&opts.store, &suite.name)?;
    let lock = if dry_run {
        None
    } else {
        Some(record::SubmitLock::acquire(&root, Duration::from_secs(30))?)
    };
    let mut open: Vec<Submission> = record::read_all(&root)?
        .into_iter()
        .filter(|s| !s.closed)
        .collect();
    let names: Vec<String> = open.iter().map(|s| s.name.clone()).collect();
    let rows = ctl::squeue_by_names(&names)?;
    let by_id: BTreeMap<&str, &RunSpec> = runs.iter().map(|r| (r.run_id.as_str(), r)).collect();
    let mut in_flight: Vec<Tracked<'r>> = Vec::new();
    let mut busy: BTreeSet<String> = BTreeSet::new();
    for sub in &mut open {
        let mine: Vec<&ctl::QueueRow> = rows.iter().filter(|r| r.name == sub.name).collect();
        if sub.job_id.is_none()
            && let Some(r) = mine.first()
        {
            sub.job_id = Some(r.array_job_id.clone()); // sbatch answered, lockstep died before saving
            if !dry_run {
                sub.save()?;
            }
        }
        let Some(job) = sub.job_id.clone() else {
            continue;
        };
        for r in &mine {
            let Some(run_id) = r.task.and_then(|i| sub.runs.get(i)) else {
                continue;
            };
            busy.insert(run_id.clone());
            let task = TaskRef {
                array_job_id: job.clone(),
                index: r.task.unwrap_or_default(),
            };
            // A run no longer in the suite still blocks resubmission but is not followed.
            if let Some(run) = by_id.get(run_id.as_str()) {
                let mut t = Tracked::new(run, task, sub.name.clone());
                t.state = r.state.clone();
                in_flight.push(t);
            }
        }
    }
    if !dry_run {
        for sub in &mut open {
            record_missed_ends(&root, sub, &busy)?;
        }
    }
    let mut skipped = Vec::new();
    let mut submit = Vec::new();
    for run in runs {
        if busy.contains(&run.run_id) {
            continue;
        }
        if !opts.force && is_finished(&root.join(&run.run_id)) {
            skipped.push(run);
        } else {
            submit.push(run);
        }
    }
    open.retain(|s| !s.closed);
    Ok(Plan {
        root,
        skipped,
        in_flight,
        submit,
        open,
        lock,
    })
}

/// Record the ends of tasks of `sub` that left the queue while no lockstep was watching, and
/// close `sub` when none of its tasks is queued any more.
fn record_missed_ends(
    root: &Path,
    sub: &mut Submission,
    busy: &BTreeSet<String>,
) -> Result<(), SlurmError> {
    let live = sub.runs.iter().any(|r| busy.contains(r));
    if let Some(job) = sub.job_id.clone() {
        let ended: Vec<(usize, String)> = sub
            .runs
            .iter()
            .enumerate()
            .filter(|(_, r)| !busy.contains(*r))
            .map(|(i, r)| (i, r.clone()))
            .collect();
        let unrecorded: Vec<&(usize, String)> = ended
            .iter()
            .filter(|(i, r)| {
                let t = TaskRef {
                    array_job_id: job.clone(),
                    index: *i,
                };
                owns(root, r, &t) && !end_recorded(root, r)
            })
            .collect();
        if !unrecorded.is_empty() {
            let ends = ctl::task_ends(&job);
            for (i, run_id) in unrecorded {
                let t = TaskRef {
                    array_job_id: job.clone(),
                    index: *i,
                };
                let end = ends.get(i).cloned().unwrap_or_else(TaskEnd::unknown);
                record_end(root, run_id, &t, &end)?;
            }
        }
    }
    if !live {
        sub.closed = true;
        sub.save()?;
    }
    Ok(())
}

/// The identity a Slurm task writes before it starts its run (from Slurm's environment).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskIdentity {
    pub array_job_id: String,
    pub array_task_id: usize,
    /// The task's own job id.
    pub job_id: String,
    pub node: String,
    pub started: String,
}

impl TaskIdentity {
    /// From `SLURM_ARRAY_JOB_ID`, `SLURM_ARRAY_TASK_ID`, `SLURM_JOB_ID`, `SLURMD_NODENAME`;
    /// `None` outside a Slurm array task.
    pub fn from_env() -> Option<TaskIdentity> {
        let v = |k: &str| std::env::var(k).ok().filter(|s| !s.is_empty());
        Some(TaskIdentity {
            array_job_id: v("SLURM_ARRAY_JOB_ID")?,
            array_task_id: v("SLURM_ARRAY_TASK_ID")?.parse().ok()?,
            job_id: v("SLURM_JOB_ID").unwrap_or_default(),
            node: v("SLURMD_NODENAME").unwrap_or_else(crate::store::run::hostname),
            started: crate::store::run::now_utc(),
        })
    }

    fn is(&self, t: &TaskRef) -> bool {
        self.array_job_id == t.array_job_id && self.array_task_id == t.index
    }
}

fn marker_path(root: &Path, run_id: &str) -> PathBuf {
    record::slurm_dir(root)
        .join("tasks")
        .join(format!("{run_id}.json"))
}

/// Claim `run_id` for the task `who` (called by the task before it starts the run).
pub fn write_task_marker(root: &Path, run_id: &str, who: &TaskIdentity) -> Result<(), IoError> {
    let p = marker_path(root, run_id);
    if let Some(d) = p.parent() {
        std::fs::create_dir_all(d).map_err(|e| IoError::io(d, e))?;
    }
    let text =
        serde_json::to_string_pretty(who).map_err(|e| IoError::invalid(&p, e.to_string()))?;
    atomic::write_file(&p, text.as_bytes())
}

/// The task that last claimed `run_id`.
pub fn read_task_marker(root: &Path, run_id: &str) -> Option<TaskIdentity> {
    let text = std::fs::read_to_string(marker_path(root, run_id)).ok()?;
    serde_json::from_str(&text).ok()
}

/// Put the task's identity into its run's manifest (`extra.slurm`), keeping an end already
/// recorded there.
pub fn stamp_manifest(root: &Path, run_id: &str, who: &TaskIdentity) -> Result<(), IoError> {
    let rd = RunDir::open(&root.join(run_id));
    let Ok(mut m) = rd.read_manifest() else {
        return Ok(());
    };
    let mut slurm = serde_json::to_value(who)
        .ok()
        .and_then(|v| v.as_object().cloned())
        .unwrap_or_default();
    if let Some(old) = m.extra.get("slurm").and_then(|v| v.as_object()) {
        for k in ["state", "exit_code"] {
            if let Some(v) = old.get(k) {
                slurm.insert(k.into(), v.clone());
            }
        }
    }
    m.extra.insert("slurm".into(), slurm.into());
    rd.write_manifest(&m)
}

fn owns(root: &Path, run_id: &str, t: &TaskRef) -> bool {
    read_task_marker(root, run_id).is_some_and(|w| w.is(t))
}

fn end_recorded(root: &Path, run_id: &str) -> bool {
    RunDir::open(&root.join(run_id))
        .read_manifest()
        .ok()
        .and_then(|m| m.extra.get("slurm")?.get("state").cloned())
        .is_some()
}

/// Record how task `t` ended into its run's manifest, if `t` is the task that ran it: the
/// identity, state and exit code under `extra.slurm`; a run still `running` becomes `failed`
/// (it can never finish now) with Slurm's state as the error. Returns the manifest's status and
/// error afterwards, or `None` when `t` never started the run (nothing is written then).
pub fn record_end(
    root: &Path,
    run_id: &str,
    t: &TaskRef,
    end: &TaskEnd,
) -> Result<Option<(RunStatus, Option<String>)>, IoError> {
    record(root, run_id, t, end, None)
}

/// Record that lockstep, stopped by `signal`, cancelled task `t`: as [`record_end`], but a run
/// still `running` becomes `interrupted` (not `failed`). A finished run keeps its status.
pub fn record_interrupted(
    root: &Path,
    run_id: &str,
    t: &TaskRef,
    end: &TaskEnd,
    signal: i32,
) -> Result<Option<(RunStatus, Option<String>)>, IoError> {
    record(root, run_id, t, end, Some(signal))
}

fn record(
    root: &Path,
    run_id: &str,
    t: &TaskRef,
    end: &TaskEnd,
    interrupted: Option<i32>,
) -> Result<Option<(RunStatus, Option<String>)>, IoError> {
    let Some(who) = read_task_marker(root, run_id).filter(|w| w.is(t)) else {
        return Ok(None);
    };
    let rd = RunDir::open(&root.join(run_id));
    let Ok(mut m) = rd.read_manifest() else {
        let status = match interrupted {
            Some(_) => RunStatus::Interrupted,
            None => RunStatus::Failed,
        };
        return Ok(Some((
            status,
            Some(format!(
                "Slurm task {t} ended {} (exit {}) before the run wrote its manifest; see its log under {}",
                end.state,
                end.exit_code,
                record::slurm_dir(root).display()
            )),
        )));
    };
    let mut slurm = serde_json::to_value(&who)
        .ok()
        .and_then(|v| v.as_object().cloned())
        .unwrap_or_default();
    if !end.node.is_empty() {
        slurm.insert("node".into(), end.node.clone().into());
    }
    slurm.insert("state".into(), end.state.clone().into());
    slurm.insert("exit_code".into(), end.exit_code.clone().into());
    m.extra.insert("slurm".into(), slurm.into());
    if let (RunStatus::Running, Some(sig)) = (m.status, interrupted) {
        m.status = RunStatus::Interrupted;
        m.error = Some(format!(
            "interrupted: lockstep got {} and cancelled Slurm task {t} ({}); rerun the same command to resubmit it",
            super::command::signal_name(sig),
            end.state
        ));
        m.finished = Some(crate::store::run::now_utc());
    } else if m.status == RunStatus::Running {
        m.status = RunStatus::Failed;
        m.error = Some(format!(
            "Slurm task {t} ended {} (exit {}) on {} before the run finished; rerun the same command to resubmit it",
            end.state,
            end.exit_code,
            if end.node.is_empty() {
                &who.node
            } else {
                &end.node
            }
        ));
        m.finished = Some(crate::store::run::now_utc());
    }
    rd.write_manifest(&m)?;
    Ok(Some((m.status, m.error)))
}

/// Write the submission folder and script and hand the array to `sbatch`. The record is saved
/// before `sbatch` runs (see [`record`]).
pub fn submit(
    suite: &SuiteSpec,
    root: &Path,
    runs: &[&RunSpec],
    opts: &SlurmOptions,
) -> Result<Submission, SlurmError> {
    let ids: Vec<String> = runs.iter().map(|r| r.run_id.clone()).collect();
    let mut sub = Submission::create(root, &suite.name, ids)?;
    let text = match script::render(&script_input(&sub, opts)) {
        Ok(t) => t,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&sub.dir);
            return Err(e);
        }
    };
    sub.save_runs()?;
    atomic::write_file(&sub.script_path(), text.as_bytes())?;
    sub.save()?;
    let what = format!(
        "submitting {} run(s) of suite {} as one job array",
        runs.len(),
        suite.name
    );
    let id = match ctl::sbatch(&sub.script_path(), &what) {
        Ok(id) => id,
        Err(e @ SlurmError::Missing { .. }) => {
            let _ = std::fs::remove_dir_all(&sub.dir); // sbatch never ran: nothing can be queued
            return Err(e);
        }
        // Kept open: if sbatch did queue it despite the error, the next run finds it by name.
        Err(e) => return Err(e),
    };
    sub.job_id = Some(id);
    sub.save()?;
    Ok(sub)
}

/// The script `submit` would write now, for `--dry-run`.
pub fn dry_run_script(
    suite: &SuiteSpec,
    root: &Path,
    runs: &[&RunSpec],
    opts: &SlurmOptions,
) -> Result<String, SlurmError> {
    let ids: Vec<String> = runs.iter().map(|r| r.run_id.clone()).collect();
    let sub = Submission::preview(root, &suite.name, ids);
    script::render(&script_input(&sub, opts))
}

fn script_input(sub: &Submission, opts: &SlurmOptions) -> script::ScriptInput {
    script::ScriptInput {
        job_name: sub.name.clone(),
        tasks: sub.runs.len(),
        max_parallel: opts.max_parallel,
        sbatch: opts.sbatch.clone(),
        logs: sub.logs_dir(),
        runs_file: sub.runs_path(),
        workdir: opts.workdir.clone(),
        exe: opts.exe.clone(),
        suite_file: opts.suite_file.clone(),
        store: opts.store.clone(),
        cache: opts.cache.clone(),
        force: opts.force,
        device: opts.device.clone(),
    }
}

/// The last step a run has reached (0-based) and its reward: the built-in engine's `log.txt`,
/// or the command engine's metrics files under `out/` (read through the suite's mapping).
fn progress_of(suite: &SuiteSpec, run_dir: &Path) -> Option<(usize, Option<f64>)> {
    if suite.engine != "command" {
        return last_step(run_dir);
    }
    let mapping = &suite.command.as_ref()?.metrics;
    let read = super::metrics::read_metrics(&run_dir.join("out"), mapping).ok()?;
    let last = read.records.last()?;
    Some((last.step, last.get("rollout/raw_reward")))
}

/// The last step a run's `log.txt` reports (0-based) and its reward.
pub fn last_step(run_dir: &Path) -> Option<(usize, Option<f64>)> {
    let text = std::fs::read_to_string(run_dir.join("log.txt")).ok()?;
    text.lines().rev().find_map(|l| {
        let mut w = l.split_whitespace();
        if w.next()? != "step" {
            return None;
        }
        let step = w.next()?.parse().ok()?;
        let reward = (w.next() == Some("reward"))
            .then(|| w.next().and_then(|v| v.parse().ok()))
            .flatten();
        Some((step, reward))
    })
}

/// Submit what `plan` says and follow every task (new and in flight) until all have left the
/// queue, reporting through `on`. Gives up with an error after `squeue` failed 5 polls in a row
/// (the tasks keep running; rerunning the command follows them again).
///
/// `stop` is polled while following: when it returns a signal (lockstep got SIGINT or SIGTERM),
/// the job array this invocation submitted is cancelled with `scancel ID` (argv, never a shell),
/// lockstep waits up to [`CANCEL_WAIT`] for its tasks to leave the queue, the runs they had
/// started are marked `interrupted`, and the summary carries the signal. Tasks submitted by an
/// earlier invocation are left to it (counted in `left_running`).
pub fn run_sweep(
    suite: &SuiteSpec,
    plan: Plan<'_>,
    opts: &SlurmOptions,
    on: &dyn Fn(SlurmEvent<'_>),
    stop: &dyn Fn() -> Option<i32>,
) -> Result<SlurmSummary, SlurmError> {
    let Plan {
        root,
        skipped,
        mut in_flight,
        submit: to_submit,
        mut open,
        lock,
    } = plan;
    let mut sum = SlurmSummary {
        skipped: skipped.len(),
        followed: in_flight.len(),
        ..Default::default()
    };
    for run in &skipped {
        on(SlurmEvent::Skipped { run });
    }
    for t in &in_flight {
        on(SlurmEvent::InFlight {
            run: t.run,
            task: &t.task,
            state: &t.state,
        });
    }
    if let Some(sig) = stop() {
        sum.signal = Some(sig); // stopped before anything was submitted
        sum.left_running = in_flight.len();
        return Ok(sum);
    }
    let mut ours: Option<usize> = None;
    if !to_submit.is_empty() {
        let sub = submit(suite, &root, &to_submit, opts)?;
        sum.job_id = sub.job_id.clone();
        let job = sub.job_id.clone().unwrap_or_default();
        on(SlurmEvent::Submitted {
            job_id: &job,
            runs: to_submit.len(),
            script: &sub.script_path(),
        });
        sum.submitted = to_submit.len();
        for (i, run) in to_submit.iter().enumerate() {
            let task = TaskRef {
                array_job_id: job.clone(),
                index: i,
            };
            in_flight.push(Tracked::new(run, task, sub.name.clone()));
        }
        ours = Some(open.len());
        open.push(sub);
    }
    drop(lock); // submitted: another lockstep may plan now and will see this array in squeue
    if let Some(sig) = follow(
        suite,
        &root,
        &mut in_flight,
        &mut open,
        opts,
        on,
        &mut sum,
        stop,
    )? {
        sum.signal = Some(sig);
        if let Some(i) = ours {
            cancel(&root, &mut open[i], &mut in_flight, sig, on, &mut sum)?;
        }
        sum.left_running = in_flight.iter().filter(|t| !t.ended).count();
    }
    Ok(sum)
}

/// How long a stopped lockstep waits for its cancelled tasks to leave the queue before it marks
/// their runs (Slurm's default `KillWait` is 30 s).
pub const CANCEL_WAIT: Duration = Duration::from_secs(45);

/// Cancel the job array `sub` (`scancel ID`), wait for its tasks to leave the queue, and record
/// each tracked task of it as interrupted.
fn cancel(
    root: &Path,
    sub: &mut Submission,
    tracked: &mut [Tracked<'_>],
    sig: i32,
    on: &dyn Fn(SlurmEvent<'_>),
    sum: &mut SlurmSummary,
) -> Result<(), SlurmError> {
    let Some(job) = sub.job_id.clone() else {
        return Ok(());
    };
    if let Err(e) = ctl::scancel(&job) {
        sum.cancel_error = Some(e.to_string());
        return Ok(());
    }
    let deadline = std::time::Instant::now() + CANCEL_WAIT;
    let mut gone = false;
    while std::time::Instant::now() < deadline {
        match ctl::squeue_by_names(std::slice::from_ref(&sub.name)) {
            Ok(rows) if rows.is_empty() => {
                gone = true;
                break;
            }
            _ => std::thread::sleep(Duration::from_millis(250)),
        }
    }
    let ends = ctl::task_ends(&job);
    for t in tracked
        .iter_mut()
        .filter(|t| !t.ended && t.name == sub.name)
    {
        let end = ends.get(&t.task.index).cloned().unwrap_or_else(|| TaskEnd {
            state: "CANCELLED".into(),
            ..TaskEnd::unknown()
        });
        let recorded = record_interrupted(root, &t.run.run_id, &t.task, &end, sig)?;
        t.ended = true;
        let (status, error) = match recorded {
            Some((s, e)) => (Some(s), e),
            None => (None, None),
        };
        match status {
            Some(RunStatus::Ok) => sum.ok += 1,
            Some(RunStatus::Diverged) => sum.diverged += 1,
            Some(RunStatus::Interrupted) => sum.interrupted += 1,
            Some(_) => sum.failed += 1,
            None => {} // never started: nothing ran, nothing to mark
        }
        on(SlurmEvent::Ended {
            run: t.run,
            task: &t.task,
            end: &end,
            status,
            error,
        });
    }
    if gone {
        sub.closed = true;
        sub.save()?;
    }
    Ok(())
}

/// Sleep `d`, waking early when `stop` reports a signal.
fn nap(d: Duration, stop: &dyn Fn() -> Option<i32>) {
    let until = std::time::Instant::now() + d;
    while stop().is_none() {
        let now = std::time::Instant::now();
        if now >= until {
            return;
        }
        std::thread::sleep((until - now).min(Duration::from_millis(50)));
    }
}

/// Follow `tracked` until every task has left the queue (`Ok(None)`) or `stop` reports a signal
/// (`Ok(Some(signal))`, tasks still in Slurm left as they are).
#[allow(clippy::too_many_arguments)]
fn follow(
    suite: &SuiteSpec,
    root: &Path,
    tracked: &mut [Tracked<'_>],
    open: &mut [Submission],
    opts: &SlurmOptions,
    on: &dyn Fn(SlurmEvent<'_>),
    sum: &mut SlurmSummary,
    stop: &dyn Fn() -> Option<i32>,
) -> Result<Option<i32>, SlurmError> {
    let mut failures = 0;
    while tracked.iter().any(|t| !t.ended) {
        if let Some(sig) = stop() {
            return Ok(Some(sig));
        }
        let names: Vec<String> = open
            .iter()
            .filter(|s| !s.closed)
            .map(|s| s.name.clone())
            .collect();
        let rows = match ctl::squeue_by_names(&names) {
            Ok(r) => {
                failures = 0;
                r
            }
            Err(e) => {
                failures += 1;
                if failures >= 5 {
                    return Err(SlurmError::Invalid(format!(
                        "lost contact with Slurm while following suite tasks ({e}); the tasks keep running in Slurm: rerun the same command to follow them again"
                    )));
                }
                on(SlurmEvent::QueueError {
                    error: e.to_string(),
                });
                nap(opts.poll, stop);
                continue;
            }
        };
        let live: BTreeMap<(&str, usize), &ctl::QueueRow> = rows
            .iter()
            .filter_map(|r| Some(((r.name.as_str(), r.task?), r)))
            .collect();
        let mut ended: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        for (i, t) in tracked.iter_mut().enumerate().filter(|(_, t)| !t.ended) {
            match live.get(&(t.name.as_str(), t.task.index)) {
                Some(row) => {
                    if row.state == "RUNNING" && !t.started {
                        t.started = true;
                        on(SlurmEvent::Started {
                            run: t.run,
                            task: &t.task,
                            node: &row.node,
                        });
                    }
                    if t.started
                        && let Some((step, reward)) = progress_of(suite, &root.join(&t.run.run_id))
                        && t.last_step.is_none_or(|s| step > s)
                    {
                        t.last_step = Some(step);
                        on(SlurmEvent::Step {
                            run: t.run,
                            task: &t.task,
                            step,
                            reward,
                        });
                    }
                }
                None => ended
                    .entry(t.task.array_job_id.clone())
                    .or_default()
                    .push(i),
            }
        }
        for (job, idxs) in ended {
            let ends = ctl::task_ends(&job);
            for i in idxs {
                let t = &mut tracked[i];
                let end = ends
                    .get(&t.task.index)
                    .cloned()
                    .unwrap_or_else(TaskEnd::unknown);
                let recorded = record_end(root, &t.run.run_id, &t.task, &end)?;
                t.ended = true;
                let (status, error) = match recorded {
                    Some((s, e)) => (Some(s), e),
                    None => (None, None),
                };
                match status {
                    Some(RunStatus::Ok) => sum.ok += 1,
                    Some(RunStatus::Diverged) => sum.diverged += 1,
                    _ => sum.failed += 1,
                }
                on(SlurmEvent::Ended {
                    run: t.run,
                    task: &t.task,
                    end: &end,
                    status,
                    error,
                });
            }
        }
        for sub in open.iter_mut().filter(|s| !s.closed) {
            if !rows.iter().any(|r| r.name == sub.name) {
                sub.closed = true;
                sub.save()?;
            }
        }
        if tracked.iter().any(|t| !t.ended) {
            nap(opts.poll, stop);
        }
    }
    Ok(stop())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_line_options_override_the_suite_and_extra_args_add_up() {
        let suite = SlurmSpec {
            partition: Some("gpu".into()),
            time: Some("1:00:00".into()),
            sbatch_args: vec!["--qos=low".into()],
            ..Default::default()
        };
        let cli = SlurmSpec {
            partition: Some("debug".into()),
            gpus_per_run: Some(2),
            sbatch_args: vec!["--qos=high".into()],
            ..Default::default()
        };
        let m = suite.overridden_by(&cli);
        assert_eq!(m.partition.as_deref(), Some("debug"));
        assert_eq!(m.time.as_deref(), Some("1:00:00"));
        assert_eq!(m.gpus_per_run, Some(2));
        assert_eq!(m.sbatch_args, ["--qos=low", "--qos=high"]);
    }

    #[test]
    fn last_step_reads_the_run_log() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(last_step(d.path()), None);
        std::fs::write(
            d.path().join("log.txt"),
            "warm start: cached x\nstep    0  reward 0.250  mismatch 1e-3\nstep    1  reward 0.500  mismatch 1e-3\n",
        )
        .unwrap();
        assert_eq!(last_step(d.path()), Some((1, Some(0.5))));
    }

    fn manifest(dir: &Path, status: RunStatus) {
        let mut m =
            crate::store::Manifest::start("r", "builtin", serde_json::json!({}), 0, 5, "cpu");
        m.status = status;
        RunDir::create(dir).unwrap().write_manifest(&m).unwrap();
    }

    #[test]
    fn only_the_task_that_ran_a_run_records_its_end() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path();
        manifest(&root.join("r"), RunStatus::Running);
        let old = TaskRef {
            array_job_id: "5".into(),
            index: 1,
        };
        let new = TaskRef {
            array_job_id: "9".into(),
            index: 0,
        };
        let who = TaskIdentity {
            array_job_id: "9".into(),
            array_task_id: 0,
            job_id: "10".into(),
            node: "n1".into(),
            started: "t".into(),
        };
        write_task_marker(root, "r", &who).unwrap();
        let cancelled = TaskEnd {
            state: "CANCELLED".into(),
            exit_code: "0:15".into(),
            node: "n1".into(),
            job_id: "6".into(),
        };
        // An older task (cancelled while pending) must not touch the newer attempt.
        assert_eq!(record_end(root, "r", &old, &cancelled).unwrap(), None);
        let m = RunDir::open(&root.join("r")).read_manifest().unwrap();
        assert_eq!(m.status, RunStatus::Running);
        assert!(!m.extra.contains_key("slurm"));
        // The owner's cancellation fails the run and records Slurm's view.
        let (status, err) = record_end(root, "r", &new, &cancelled).unwrap().unwrap();
        assert_eq!(status, RunStatus::Failed);
        assert!(err.unwrap().contains("CANCELLED"));
        let m = RunDir::open(&root.join("r")).read_manifest().unwrap();
        let s = &m.extra["slurm"];
        assert_eq!(s["array_job_id"], "9");
        assert_eq!(s["array_task_id"], 0);
        assert_eq!(s["state"], "CANCELLED");
        assert_eq!(s["exit_code"], "0:15");
        assert_eq!(s["node"], "n1");
        assert!(end_recorded(root, "r"));
        // A finished run keeps its status; only the Slurm fields are added.
        manifest(&root.join("r"), RunStatus::Ok);
        stamp_manifest(root, "r", &who).unwrap();
        let done = TaskEnd {
            state: "COMPLETED".into(),
            exit_code: "0:0".into(),
            ..cancelled
        };
        let (status, err) = record_end(root, "r", &new, &done).unwrap().unwrap();
        assert_eq!((status, err), (RunStatus::Ok, None));
        let m = RunDir::open(&root.join("r")).read_manifest().unwrap();
        assert_eq!(m.extra["slurm"]["state"], "COMPLETED");
        assert_eq!(m.extra["slurm"]["job_id"], "10");
    }
}

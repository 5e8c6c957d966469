//! `lockstep run SUITE --executor slurm [...]` (submit the unfinished runs as one job array and
//! follow it) and `lockstep run-one --suite FILE --run-id ID --store DIR` (what each array task
//! runs: one planned run of a suite, through the local runner's per-run code).

use super::suite::RunArgs;
use anyhow::{Context, Result, bail};
use clap::Args;
use lockstep::store::RunStatus;
use lockstep::suite::builtin::default_cache;
use lockstep::suite::runner::{Outcome, Progress, RunnerOptions, run_planned, suite_dir};
use lockstep::suite::slurm::{
    self, SlurmEvent, SlurmOptions, SlurmSpec, TaskIdentity, stamp_manifest, write_task_marker,
};
use lockstep::suite::{RunSpec, SuiteSpec, expand, load};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Slurm options of `lockstep run` (with `--executor slurm`); each overrides the suite's
/// `[slurm]` table.
#[derive(Debug, Args, Default)]
pub struct SlurmArgs {
    /// Slurm partition (sbatch --partition).
    #[arg(long)]
    pub partition: Option<String>,
    /// GPUs per run (sbatch --gres=gpu:N).
    #[arg(long)]
    pub gpus_per_run: Option<u32>,
    /// CPUs per run (sbatch --cpus-per-task); the built-in engine uses that many threads.
    #[arg(long)]
    pub cpus_per_run: Option<u32>,
    /// Time limit per run, Slurm syntax (e.g. 30, 02:00:00).
    #[arg(long)]
    pub time: Option<String>,
    /// Account to charge (sbatch --account).
    #[arg(long)]
    pub account: Option<String>,
    /// Memory per run (sbatch --mem, e.g. 16G).
    #[arg(long)]
    pub mem: Option<String>,
    /// Further sbatch option for every task, e.g. --sbatch-arg=--qos=high (repeatable; added
    /// after the suite's `sbatch_args`).
    #[arg(long = "sbatch-arg", allow_hyphen_values = true)]
    pub sbatch_args: Vec<String>,
    /// Print the sbatch script that would be submitted, and submit nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Seconds between squeue polls while following the array.
    #[arg(long, default_value_t = 5.0)]
    pub poll: f64,
}

impl SlurmArgs {
    fn spec(&self) -> SlurmSpec {
        SlurmSpec {
            partition: self.partition.clone(),
            gpus_per_run: self.gpus_per_run,
            cpus_per_run: self.cpus_per_run,
            time: self.time.clone(),
            account: self.account.clone(),
            mem: self.mem.clone(),
            sbatch_args: self.sbatch_args.clone(),
        }
    }

    /// The first Slurm-only flag given, to refuse it without `--executor slurm`.
    pub fn first_set(&self) -> Option<&'static str> {
        let s = self.spec();
        [
            (s.partition.is_some(), "--partition"),
            (s.gpus_per_run.is_some(), "--gpus-per-run"),
            (s.cpus_per_run.is_some(), "--cpus-per-run"),
            (s.time.is_some(), "--time"),
            (s.account.is_some(), "--account"),
            (s.mem.is_some(), "--mem"),
            (!s.sbatch_args.is_empty(), "--sbatch-arg"),
            (self.dry_run, "--dry-run"),
        ]
        .into_iter()
        .find(|(set, _)| *set)
        .map(|(_, name)| name)
    }
}

fn absolute(p: &Path) -> Result<PathBuf> {
    std::path::absolute(p)
        .with_context(|| format!("{}: cannot make the path absolute", p.display()))
}

/// Submit the suite's unfinished runs as one job array and follow it to the end.
pub fn run(args: &RunArgs, s: &SuiteSpec, runs: &[RunSpec]) -> Result<bool> {
    if !args.slurm.poll.is_finite() || args.slurm.poll <= 0.0 {
        bail!(
            "--poll {}: give a positive number of seconds",
            args.slurm.poll
        );
    }
    let opts = SlurmOptions {
        sbatch: s.slurm.overridden_by(&args.slurm.spec()),
        store: absolute(&args.store)?,
        cache: absolute(&default_cache())?,
        force: args.force,
        max_parallel: args.jobs,
        poll: Duration::from_secs_f64(args.slurm.poll),
        exe: std::env::current_exe().context("cannot find the lockstep binary to run in tasks")?,
        suite_file: absolute(&args.suite)?,
        workdir: std::env::current_dir().context("cannot read the current directory")?,
        // Opened in the tasks only, so a login node without a GPU can submit.
        device: (args.device != "cpu").then(|| args.device.clone()),
    };
    let plan = slurm::plan(s, runs, &opts, args.slurm.dry_run)?;
    if args.slurm.dry_run {
        eprintln!(
            "suite {}: {} runs: {} finished, {} queued or running in Slurm, {} to submit",
            s.name,
            runs.len(),
            plan.skipped.len(),
            plan.in_flight.len(),
            plan.submit.len()
        );
        if plan.submit.is_empty() {
            eprintln!("nothing to submit");
        } else {
            print!(
                "{}",
                slurm::dry_run_script(s, &plan.root, &plan.submit, &opts)?
            );
        }
        return Ok(true);
    }
    let total = runs.len();
    let start = Instant::now();
    let tty = std::io::stdout().is_terminal();
    println!(
        "suite {}: {total} runs, executor slurm, store {}",
        s.name,
        args.store.display()
    );
    let state = Mutex::new((0usize, 0usize)); // (done, failed)
    let on = |e: SlurmEvent<'_>| {
        let Ok(mut st) = state.lock() else { return };
        let eta = |done: usize| {
            if done == 0 {
                "?".to_string()
            } else {
                format!(
                    "{:.0}s",
                    start.elapsed().as_secs_f64() / done as f64 * (total - done) as f64
                )
            }
        };
        match e {
            SlurmEvent::Skipped { run } => {
                st.0 += 1;
                println!(
                    "[{}/{total}] skip {} seed {} (finished)",
                    st.0, run.config, run.seed
                );
            }
            SlurmEvent::InFlight { run, task, state } => println!(
                "[{}/{total}] follow {} seed {} (slurm {task} {state}, submitted earlier; not resubmitted)",
                st.0, run.config, run.seed
            ),
            SlurmEvent::Submitted {
                job_id,
                runs,
                script,
            } => println!(
                "submitted job array {job_id}: {runs} runs ({})",
                script.display()
            ),
            SlurmEvent::Started { run, task, node } => println!(
                "[{}/{total}] start {} seed {} on {node} (slurm {task})",
                st.0, run.config, run.seed
            ),
            SlurmEvent::Step {
                run,
                task,
                step,
                reward,
            } => {
                if tty || (step + 1) % 10 == 0 {
                    println!(
                        "  {} s{} step {}/{} reward {:.3} (slurm {task}; done {}/{total}, failed {}, ETA {})",
                        run.config,
                        run.seed,
                        step + 1,
                        run.run.steps,
                        reward.unwrap_or(f64::NAN),
                        st.0,
                        st.1,
                        eta(st.0)
                    );
                }
            }
            SlurmEvent::Ended {
                run,
                task,
                end,
                status,
                error,
            } => {
                st.0 += 1;
                if !matches!(status, Some(RunStatus::Ok)) {
                    st.1 += 1;
                }
                let what = match status {
                    Some(s) => format!("{s:?}"),
                    None => "NotRun".into(),
                };
                let node = if end.node.is_empty() {
                    String::new()
                } else {
                    format!(" on {}", end.node)
                };
                println!(
                    "[{}/{total}] {what} {} seed {} (slurm {task} {} exit {}{node}){} (ETA {})",
                    st.0,
                    run.config,
                    run.seed,
                    end.state,
                    if end.exit_code.is_empty() {
                        "?"
                    } else {
                        &end.exit_code
                    },
                    error.map(|e| format!(": {e}")).unwrap_or_default(),
                    eta(st.0)
                );
            }
            SlurmEvent::QueueError { error } => eprintln!("warning: {error}; retrying"),
        }
    };
    // Installed before anything is submitted: SIGINT/SIGTERM then cancel what this invocation
    // submitted instead of leaving it running in Slurm.
    lockstep::suite::interrupt::install();
    let sum = slurm::run_sweep(s, plan, &opts, &on, &lockstep::suite::interrupt::requested)?;
    println!(
        "done in {:.1}s: {} ok, {} skipped, {} failed, {} diverged, {} interrupted; {} submitted, {} followed from earlier submissions",
        start.elapsed().as_secs_f64(),
        sum.ok,
        sum.skipped,
        sum.failed,
        sum.diverged,
        sum.interrupted,
        sum.submitted,
        sum.followed
    );
    if let Some(sig) = sum.signal {
        return Err(super::suite::Interrupted(sig, Some(stopped_text(&sum))).into());
    }
    Ok(sum.failed == 0)
}

/// What a stopped Slurm sweep did, for the one line lockstep ends with.
fn stopped_text(sum: &slurm::SlurmSummary) -> String {
    let mut what = match (&sum.job_id, &sum.cancel_error) {
        (None, _) => "nothing was submitted".to_string(),
        (Some(job), None) => format!(
            "job array {job} was cancelled (scancel {job}) and the runs its tasks had started are marked interrupted"
        ),
        (Some(job), Some(e)) => format!(
            "cancelling job array {job} FAILED ({e}); its tasks may still be in Slurm: cancel them with `scancel {job}`"
        ),
    };
    if sum.left_running > 0 {
        what.push_str(&format!(
            "; {} task(s) submitted by an earlier lockstep keep running in Slurm (rerun the same command to follow them)",
            sum.left_running
        ));
    }
    what + "; rerun the same command to resume"
}

/// One planned run of a suite into the store (`run-one --suite`), as a local `lockstep run`
/// would make it; inside a Slurm array task it also claims the run and stamps the manifest with
/// the task's identity. Exit: ok when the run ended ok or was already finished.
pub fn run_task(
    be: &dyn lockstep::engine::backend::Backend,
    suite_file: &Path,
    run_id: &str,
    store: &Path,
    cache: Option<PathBuf>,
    force: bool,
) -> Result<bool> {
    let s = load(suite_file)?;
    let runs = expand(&s)?;
    let Some(run) = runs.iter().find(|r| r.run_id == run_id) else {
        bail!(
            "run id `{run_id}` is not in suite {} (was the suite file edited after submission? `lockstep suite show {}` lists its runs)",
            suite_file.display(),
            suite_file.display()
        );
    };
    let root = suite_dir(store, &s.name)?;
    std::fs::create_dir_all(&root).with_context(|| format!("{}", root.display()))?;
    let opts = RunnerOptions {
        store: store.to_path_buf(),
        jobs: 1,
        force,
        cache: cache.unwrap_or_else(default_cache),
        threads_per_worker: None,
        batch_runs: None,
    };
    let who = TaskIdentity::from_env();
    if let Some(w) = &who
        && (force || !lockstep::suite::runner::is_finished(&root.join(run_id)))
    {
        write_task_marker(&root, run_id, w)?;
    }
    let progress = |p: Progress<'_>| match p {
        Progress::Skipped { run } => println!("skip {} seed {} (finished)", run.config, run.seed),
        Progress::Busy { run } => println!(
            "busy {} seed {} (another process holds its lock)",
            run.config, run.seed
        ),
        Progress::Started { run, device } => println!(
            "start {} seed {} ({}) on {} {device}",
            run.config,
            run.seed,
            run.run_id,
            lockstep::store::run::hostname()
        ),
        Progress::Step { record, .. } => {
            println!("{}", lockstep::suite::builtin::step_line(record))
        }
        Progress::Finished { status, error, .. } => println!(
            "{status:?}{}",
            error.map(|e| format!(": {e}")).unwrap_or_default()
        ),
        Progress::DeviceLost { device, error } => {
            eprintln!("{device} stopped computing: {error}")
        }
    };
    let outcome = run_planned(be, &s, run, &root, &opts, &progress);
    if let (Some(w), Outcome::Finished(_) | Outcome::DeviceLost(_)) = (&who, &outcome) {
        stamp_manifest(&root, run_id, w)?;
    }
    Ok(matches!(
        outcome,
        Outcome::Skipped | Outcome::Finished(RunStatus::Ok)
    ))
}

//! The resumable parallel runner. Runs land in `<store>/<suite>/<run-id>/`; a run whose manifest
//! says `ok` or `diverged` is finished and skipped on a rerun (`force` redoes it). A run folder is
//! only ever trusted through its manifest status, which is written last and atomically, so a
//! killed process leaves a `running` folder that the next invocation redoes from scratch.
//! Two processes on one store coordinate through per-run lock files (`<run-id>.lock`, a
//! [`PidLock`]: a lock whose process is gone is taken over).

use super::builtin::{BatchRun, run_batch_until};
use super::plan::RunSpec;
use super::spec::SuiteSpec;
use crate::engine::backend::Backend;
use crate::engine::metrics::StepRecord;
use crate::engine::trainer::BatchShape;
use crate::io::IoError;
use crate::io::lock::PidLock;
use crate::store::{Manifest, RunDir, RunStatus};
use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// How to run a suite.
#[derive(Debug, Clone)]
pub struct RunnerOptions {
    pub store: PathBuf,
    pub jobs: usize,
    pub force: bool,
    /// Warm-start cache.
    pub cache: PathBuf,
    /// Host threads of each worker's own thread pool; `None`, every worker shares the process's
    /// pool. A GPU worker's host work blocks pool threads while it waits for its device (the
    /// rollout and the trainer's preparation run side by side on the pool), so workers sharing
    /// one pool stall each other's host phases: on an H200 with 8 workers, every phase of a step
    /// took 5x its one-worker time.
    pub threads_per_worker: Option<usize>,
    /// Runs a worker steps together, one batched device call per pass for all of them
    /// ([`crate::engine::trainer::Trainer::step_batch`]; built-in engine only); `None`, what the
    /// device says suits it ([`Backend::batch_runs`]: 1 on the CPU). 1 runs each run alone.
    pub batch_runs: Option<usize>,
}

/// What the runner tells its progress display.
#[derive(Debug, Clone)]
pub enum Progress<'a> {
    Skipped {
        run: &'a RunSpec,
    },
    Busy {
        run: &'a RunSpec,
    },
    Started {
        run: &'a RunSpec,
        /// The device the run's worker computes on (`cpu`, `cuda:1`).
        device: &'a str,
    },
    Step {
        run: &'a RunSpec,
        record: &'a StepRecord,
    },
    Finished {
        run: &'a RunSpec,
        status: RunStatus,
        error: Option<String>,
    },
    /// A device stopped computing (its run failed and its health check fails): its workers
    /// take no more runs, the other devices take the rest.
    DeviceLost {
        device: &'a str,
        error: &'a str,
    },
}

/// Counts at the end.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Summary {
    pub ok: usize,
    pub skipped: usize,
    pub failed: usize,
    pub diverged: usize,
    /// Held by another process.
    pub busy: usize,
    /// Stopped by SIGINT/SIGTERM while in flight (runs not yet started are not counted).
    pub interrupted: usize,
    /// Timed out (command engine).
    pub timeout: usize,
    /// Runs left unstarted because every device was lost (they count as failures).
    pub not_run: usize,
    /// Devices that stopped computing during the sweep, with why.
    pub lost_devices: Vec<(String, String)>,
    /// Runs that ran (not skipped) on each device, by [`Backend::name`].
    pub per_device: std::collections::BTreeMap<String, usize>,
}

impl Summary {
    /// Count a run that ran on `device` and ended with `status`.
    fn ran(&mut self, device: &str, status: RunStatus) {
        self.count(status);
        *self.per_device.entry(device.to_string()).or_default() += 1;
    }

    /// Whether `device` was reported lost.
    fn is_lost(&self, device: &str) -> bool {
        self.lost_devices.iter().any(|(d, _)| d == device)
    }

    /// Add `other`'s counts to these (the summaries of one sweep's worker processes); a device
    /// both report lost is named once.
    pub fn absorb(&mut self, other: Summary) {
        let Summary {
            ok,
            skipped,
            failed,
            diverged,
            busy,
            interrupted,
            timeout,
            not_run,
            lost_devices,
            per_device,
        } = other;
        self.ok += ok;
        self.skipped += skipped;
        self.failed += failed;
        self.diverged += diverged;
        self.busy += busy;
        self.interrupted += interrupted;
        self.timeout += timeout;
        self.not_run += not_run;
        for (device, why) in lost_devices {
            if !self.is_lost(&device) {
                self.lost_devices.push((device, why));
            }
        }
        for (d, n) in per_device {
            *self.per_device.entry(d).or_default() += n;
        }
    }

    /// Count a run that ended with `status`.
    fn count(&mut self, status: RunStatus) {
        match status {
            RunStatus::Ok => self.ok += 1,
            RunStatus::Diverged => self.diverged += 1,
            RunStatus::Interrupted => self.interrupted += 1,
            RunStatus::Timeout => self.timeout += 1,
            RunStatus::Failed | RunStatus::Running => self.failed += 1,
        }
    }
}

/// The suite's folder in the store. The suite name must be a plain name (letters, digits, `-`,
/// `_`, `.` not leading), so it can never point outside the store.
pub fn suite_dir(store: &Path, suite: &str) -> Result<PathBuf, IoError> {
    safe_component(suite)
        .map_err(|why| IoError::invalid(store, format!("suite name `{suite}`: {why}")))?;
    Ok(store.join(suite))
}

pub use crate::store::safe_component;

/// A relative path that stays inside its root (no `..`, not absolute).
pub fn safe_relative(p: &str) -> Result<(), String> {
    let path = Path::new(p);
    if path.is_absolute()
        || path
            .components()
            .any(|c| !matches!(c, std::path::Component::Normal(_)))
    {
        return Err("must be a relative path inside the run folder (no `..`, not absolute)".into());
    }
    Ok(())
}

/// Finished runs are those whose manifest records an end.
pub fn is_finished(dir: &Path) -> bool {
    RunDir::open(dir)
        .read_manifest()
        .map(|m| matches!(m.status, RunStatus::Ok | RunStatus::Diverged))
        .unwrap_or(false)
}

/// The run folders in a suite's folder `root` that none of `runs` names, sorted: runs of an edited
/// suite, or runs made before an upgrade that changed run ids. A rerun does not take them for
/// finished runs of the suite, and `compare` ignores them, so a store holding them is reported.
pub fn unplanned_runs(root: &Path, runs: &[RunSpec]) -> Vec<String> {
    let planned: std::collections::BTreeSet<&str> =
        runs.iter().map(|r| r.run_id.as_str()).collect();
    crate::store::run_dirs(root)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|d| d.file_name()?.to_str().map(String::from))
        .filter(|name| !planned.contains(name.as_str()))
        .collect()
}

/// Run every unfinished run of `runs` with `opts.jobs` workers. Worker `w` computes on
/// `backends[w % backends.len()]`, so a sweep spreads over every device it is given (one backend
/// per GPU; with more workers than GPUs, several workers share a GPU). A device that stops
/// computing fails the run it had (the error names it) and takes no more: the others finish the
/// sweep; runs that no device is left to take count as `not_run`. With batches of more than one
/// run ([`RunnerOptions::batch_runs`]), a worker takes up to that many runs of one shape at a
/// time, the seeds of one configuration first, then whole configurations that fit
/// ([`take_batch`]), and steps them together.
pub fn run_suite(
    backends: &[&dyn Backend],
    suite: &SuiteSpec,
    runs: &[RunSpec],
    opts: &RunnerOptions,
    progress: &(dyn Fn(Progress<'_>) + Sync),
) -> Result<Summary, IoError> {
    let root = suite_dir(&opts.store, &suite.name)?;
    std::fs::create_dir_all(&root).map_err(|e| IoError::io(&root, e))?;
    let queue: Mutex<VecDeque<&RunSpec>> = Mutex::new(runs.iter().collect());
    let summary = Mutex::new(Summary::default());
    assert!(!backends.is_empty(), "run_suite needs at least one backend");
    let lost = |name: &str| summary.lock().is_ok_and(|s| s.is_lost(name));
    std::thread::scope(|scope| {
        for w in 0..opts.jobs.max(1) {
            let be = backends[w % backends.len()];
            let (queue, root, lost, summary) = (&queue, &root, &lost, &summary);
            let pool = opts.threads_per_worker.and_then(|t| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(t.max(1))
                    .thread_name(move |i| format!("worker-{w}-{i}"))
                    .build()
                    .ok()
            });
            scope.spawn(move || {
                let device = be.name();
                // Counts a run's outcome; true when its device was lost.
                let record = |outcome: Outcome| -> bool {
                    let bump = |f: &dyn Fn(&mut Summary)| {
                        if let Ok(mut s) = summary.lock() {
                            f(&mut s);
                        }
                    };
                    match outcome {
                        Outcome::Skipped => bump(&|s| s.skipped += 1),
                        Outcome::Busy => bump(&|s| s.busy += 1),
                        Outcome::Finished(status) => bump(&|s| s.ran(&device, status)),
                        Outcome::DeviceLost(why) => {
                            // Checked and recorded under one lock: the device's other workers
                            // (and the other runs of this batch) may lose it at the same time,
                            // and it is reported once.
                            let first = summary.lock().is_ok_and(|mut s| {
                                s.ran(&device, RunStatus::Failed);
                                let first = !s.is_lost(&device);
                                if first {
                                    s.lost_devices.push((device.clone(), why.clone()));
                                }
                                first
                            });
                            if first {
                                progress(Progress::DeviceLost {
                                    device: &device,
                                    error: &why,
                                });
                            }
                            return true;
                        }
                    }
                    false
                };
                let size = batch_size(be, suite, opts);
                let work = || loop {
                    if super::interrupt::requested().is_some() || lost(&device) {
                        break; // stopping, or this device is gone: start nothing new
                    }
                    let batch = take_batch(queue, size, root, opts, progress, &record);
                    if batch.is_empty() {
                        break;
                    }
                    let outcomes = run_admitted(be, suite, batch, opts, progress);
                    // Every outcome is counted before the worker stops.
                    let gone = outcomes.into_iter().fold(false, |gone, o| record(o) | gone);
                    if gone {
                        break;
                    }
                };
                match &pool {
                    Some(p) => p.install(work),
                    None => work(),
                }
            });
        }
    });
    let mut sum = summary.into_inner().unwrap_or_default();
    if super::interrupt::requested().is_none() {
        sum.not_run = queue.into_inner().map(|q| q.len()).unwrap_or_default();
    }
    Ok(sum)
}

/// How many runs a worker on `be` steps together: `opts.batch_runs`, else what the device says
/// suits it ([`Backend::batch_runs`]); always 1 for engines other than the built-in one.
fn batch_size(be: &dyn Backend, suite: &SuiteSpec, opts: &RunnerOptions) -> usize {
    match suite.engine.as_str() {
        "builtin" => opts.batch_runs.unwrap_or_else(|| be.batch_runs()).max(1),
        _ => 1,
    }
}

/// The shape a run's trainer steps in: runs of one shape can be stepped together.
fn shape_of(run: &RunSpec) -> BatchShape {
    BatchShape::new(&run.run.model, run.run.task, &run.run.grpo)
}

/// Up to `size` runs off `queue` for one batch, each admitted ([`admit`]): the front run, then
/// the other seeds of its configuration, then, of its shape, whole configurations that still fit
/// (each in queue order). A configuration is split only when no batch holds it whole: a device
/// quantizes each site once per group of neighbouring runs of one plan, so a split one costs a
/// group in two batches. The queue stays locked until the batch is made, so workers taking
/// batches at once never interleave: a batch's runs, and so on a GPU their numbers, are the same
/// whatever the timing. Runs found finished or locked on the way are passed to `record`. Empty
/// when the queue is, or a stop was asked for before any run was admitted.
fn take_batch<'r>(
    queue: &Mutex<VecDeque<&'r RunSpec>>,
    size: usize,
    root: &Path,
    opts: &RunnerOptions,
    progress: &(dyn Fn(Progress<'_>) + Sync),
    record: &dyn Fn(Outcome) -> bool,
) -> Vec<Admitted<'r>> {
    let mut batch: Vec<Admitted> = Vec::new();
    let mut last: Option<&RunSpec> = None;
    let Ok(mut queue) = queue.lock() else {
        return batch;
    };
    while batch.len() < size.max(1) && super::interrupt::requested().is_none() {
        let room = size.max(1) - batch.len();
        let Some(run) = pop_fitting(&mut queue, last, (room, size.max(1))) else {
            break;
        };
        last = Some(run);
        match admit(run, root, opts, progress) {
            Ok(a) => batch.push(a),
            Err(passed) => {
                record(passed);
            }
        }
    }
    batch
}

/// Device memory one run is taken to hold while it steps in a batch: its step's activations
/// ([`super::plan::step_memory_bytes`]) plus [`RUN_STATE_COPIES`] FP32 copies of its parameters
/// (master weights, two AdamW moments, gradients, the prepared forward and backward operands and
/// their BF16 twins, the export).
pub fn run_memory_bytes(run: &RunSpec) -> u64 {
    let r = &run.run;
    let seqs = r.grpo.prompts_per_step * r.grpo.samples_per_prompt;
    let seq = r.task.prompt_len() + r.grpo.max_response_tokens;
    let params: u64 = r.model.tensor_lens().iter().map(|&l| l as u64).sum();
    super::plan::step_memory_bytes(&r.model, seqs, seq)
        .saturating_add(params.saturating_mul(4 * RUN_STATE_COPIES))
}

/// FP32 copies of a run's parameters [`run_memory_bytes`] counts.
pub const RUN_STATE_COPIES: u64 = 8;

/// How many runs a worker steps together when the sweep does not say: the device's sweet spot
/// `base`, raised up to twice it where `runs` give each of `workers` a batch that large (a batch
/// of 32 ran the 6 x 32-seed, 100-step sweep in 55.8 s against 59.0 s at 16 on an H100; the
/// 30-run nightly is as fast at 16 with two workers as at 32 with one), and lowered so that the
/// batches of the workers sharing a device fill at most half of `free` device memory, at
/// `per_run` bytes a run (at least one run).
pub fn default_batch_runs(
    base: usize,
    runs: usize,
    workers: usize,
    memory: Option<(u64, u64)>,
) -> usize {
    let base = base.max(1);
    let even = runs.div_ceil(workers.max(1)).clamp(base, 2 * base);
    match memory {
        Some((free, per_run)) => {
            let fits = free / 2 / workers.max(1) as u64 / per_run.max(1);
            even.min(usize::try_from(fits).unwrap_or(usize::MAX)).max(1)
        }
        None => even,
    }
}

/// `runs` cut into the batches of up to `size` that workers take off a queue of them
/// ([`take_batch`], every run unfinished).
pub fn batches_of(runs: &[RunSpec], size: usize) -> Vec<Vec<&RunSpec>> {
    let size = size.max(1);
    let mut queue: VecDeque<&RunSpec> = runs.iter().collect();
    let mut out = Vec::new();
    while !queue.is_empty() {
        let mut batch: Vec<&RunSpec> = Vec::new();
        while let Some(r) = pop_fitting(
            &mut queue,
            batch.last().copied(),
            (size - batch.len(), size),
        ) {
            batch.push(r);
            if batch.len() == size {
                break;
            }
        }
        out.push(batch);
    }
    out
}

/// The next run of a batch of `size` whose latest run is `last`, with `room` places left: the
/// front of the queue for a new batch; otherwise the next seed of `last`'s configuration, else
/// the first run of the first configuration of its shape whose queued runs all fit in `room`, or
/// that no batch could hold whole.
fn pop_fitting<'r>(
    queue: &mut VecDeque<&'r RunSpec>,
    last: Option<&RunSpec>,
    (room, size): (usize, usize),
) -> Option<&'r RunSpec> {
    let Some(last) = last else {
        return queue.pop_front();
    };
    let shape = shape_of(last);
    let fits = |r: &RunSpec| shape_of(r) == shape;
    let whole = |config: &str| {
        let queued = queue.iter().filter(|r| r.config == config).count();
        queued <= room || queued > size
    };
    let at = queue
        .iter()
        .position(|r| r.config == last.config && fits(r))
        .or_else(|| queue.iter().position(|r| fits(r) && whole(&r.config)))?;
    queue.remove(at)
}

/// What became of one planned run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Already finished (by an earlier invocation or another process).
    Skipped,
    /// Another live process holds its lock.
    Busy,
    /// Ran now and ended with this status.
    Finished(RunStatus),
    /// Failed because its device stopped computing (why, as the device's health check says);
    /// the manifest's error names the device.
    DeviceLost(String),
}

/// A run this process is to compute now: not finished, its lock held until it ends, its folder
/// cleared.
struct Admitted<'r> {
    run: &'r RunSpec,
    dir: PathBuf,
    lock: PidLock,
}

/// Admit `run` into `root/<run-id>` unless it is finished ([`Outcome::Skipped`]) or another
/// live process holds its lock ([`Outcome::Busy`]); reports either.
fn admit<'r>(
    run: &'r RunSpec,
    root: &Path,
    opts: &RunnerOptions,
    progress: &(dyn Fn(Progress<'_>) + Sync),
) -> Result<Admitted<'r>, Outcome> {
    let dir = root.join(&run.run_id);
    if !opts.force && is_finished(&dir) {
        progress(Progress::Skipped { run });
        return Err(Outcome::Skipped);
    }
    let Some(lock) = PidLock::acquire(&root.join(format!("{}.lock", run.run_id))) else {
        progress(Progress::Busy { run });
        return Err(Outcome::Busy);
    };
    if !opts.force && is_finished(&dir) {
        progress(Progress::Skipped { run }); // finished by another process meanwhile
        return Err(Outcome::Skipped);
    }
    let _ = std::fs::remove_dir_all(&dir); // a half-written run is redone from scratch
    Ok(Admitted { run, dir, lock })
}

/// Run one planned run into `root/<run-id>` unless it is finished or locked: the per-run step of
/// [`run_suite`], shared with `lockstep run-one --suite` (a Slurm array task), so a run made by
/// either lands in the store identically. Reports every [`Progress`] event for the run.
pub fn run_planned(
    be: &dyn Backend,
    suite: &SuiteSpec,
    run: &RunSpec,
    root: &Path,
    opts: &RunnerOptions,
    progress: &(dyn Fn(Progress<'_>) + Sync),
) -> Outcome {
    match admit(run, root, opts, progress) {
        Ok(admitted) => run_admitted(be, suite, vec![admitted], opts, progress).remove(0),
        Err(passed) => passed,
    }
}

/// Run admitted runs as one batch: the built-in engine's stepped together
/// ([`crate::suite::builtin::run_batch_until`]), a command engine's one after the other. Each
/// run is reported, recorded and released as it ends, as [`run_planned`] does for one; returns
/// the outcome of each, in order.
fn run_admitted(
    be: &dyn Backend,
    suite: &SuiteSpec,
    batch: Vec<Admitted<'_>>,
    opts: &RunnerOptions,
    progress: &(dyn Fn(Progress<'_>) + Sync),
) -> Vec<Outcome> {
    let device = be.name();
    for a in &batch {
        progress(Progress::Started {
            run: a.run,
            device: &device,
        });
    }
    let (members, mut locks): (Vec<(&RunSpec, PathBuf)>, Vec<Option<PidLock>>) = batch
        .into_iter()
        .map(|a| ((a.run, a.dir), Some(a.lock)))
        .unzip();
    let mut outcomes: Vec<Option<Outcome>> = vec![None; members.len()];
    let mut ended = |i: usize, result: Result<Manifest, IoError>| {
        let (run, dir) = &members[i];
        outcomes[i] = Some(conclude(be, suite, run, dir, result, progress));
        locks[i] = None; // recorded: another process may take it now
    };
    let stop = super::interrupt::requested;
    match suite.engine.as_str() {
        "builtin" => {
            let mut on_steps: Vec<_> = members
                .iter()
                .map(|(run, _)| move |r: &StepRecord| progress(Progress::Step { run, record: r }))
                .collect();
            let runs = members
                .iter()
                .zip(&mut on_steps)
                .map(|((run, dir), on_step)| BatchRun {
                    cfg: &run.run,
                    run_id: &run.run_id,
                    out: dir,
                    on_step,
                })
                .collect();
            run_batch_until(be, runs, Some(&opts.cache), &stop, &mut ended);
        }
        "command" => {
            for (i, (run, dir)) in members.iter().enumerate() {
                let on_step = |r: &StepRecord| progress(Progress::Step { run, record: r });
                ended(
                    i,
                    super::command::run_command(suite, run, dir, &on_step, &stop),
                );
            }
        }
        other => {
            for i in 0..members.len() {
                let why =
                    format!("engine `{other}` runs are not launched; `lockstep run` imports them");
                ended(i, Err(IoError::invalid(&suite.path, why)));
            }
        }
    }
    outcomes
        .into_iter()
        .map(|o| o.expect("every run of a batch ends"))
        .collect()
}

/// A run that ended: the suite's names for it added to its manifest, its device's health
/// checked when it failed (a device that stopped computing is named in the run's error), and
/// its end reported.
fn conclude(
    be: &dyn Backend,
    suite: &SuiteSpec,
    run: &RunSpec,
    dir: &Path,
    result: Result<Manifest, IoError>,
    progress: &(dyn Fn(Progress<'_>) + Sync),
) -> Outcome {
    let (status, mut error) = match result.and_then(|m| label(suite, run, dir, m)) {
        Ok(m) => (m.status, m.error),
        Err(e) => (RunStatus::Failed, Some(e.to_string())),
    };
    let lost = match status {
        RunStatus::Failed => be.health().err(),
        _ => None,
    };
    if let Some(why) = &lost {
        let device = be.name();
        let hw = be.hardware().map(|h| format!(" ({h})")).unwrap_or_default();
        let note = format!("{device}{hw} stopped computing: {why}; it takes no more runs");
        error = Some(match error {
            Some(e) => format!("{e}; {note}"),
            None => note,
        });
        let rd = RunDir::open(dir);
        if let Ok(mut m) = rd.read_manifest() {
            m.error = error.clone();
            let _ = rd.write_manifest(&m);
        }
    }
    progress(Progress::Finished { run, status, error });
    match lost {
        Some(why) => Outcome::DeviceLost(why),
        None => Outcome::Finished(status),
    }
}

/// The suite's names for `run` (suite, configuration, base configuration, axes), written into
/// its manifest.
fn label(
    suite: &SuiteSpec,
    run: &RunSpec,
    dir: &Path,
    mut m: Manifest,
) -> Result<Manifest, IoError> {
    m.suite = Some(suite.name.clone());
    m.extra
        .insert("config_name".into(), run.config.clone().into());
    m.extra
        .insert("base_config".into(), run.base.clone().into());
    m.extra.insert(
        "axes".into(),
        serde_json::to_value(&run.axes).unwrap_or_default(),
    );
    RunDir::open(dir).write_manifest(&m)?;
    Ok(m)
}

/// Re-read every finished command run of `runs` with the suite's current metrics mapping,
/// without relaunching anything; reports each run as `Finished` with its new status.
pub fn reingest_suite(
    suite: &SuiteSpec,
    runs: &[RunSpec],
    store: &Path,
    progress: &(dyn Fn(Progress<'_>) + Sync),
) -> Result<Summary, IoError> {
    let root = suite_dir(store, &suite.name)?;
    let mut sum = Summary::default();
    for run in runs {
        let dir = root.join(&run.run_id);
        let Some(_lock) = PidLock::acquire(&root.join(format!("{}.lock", run.run_id))) else {
            progress(Progress::Busy { run });
            sum.busy += 1;
            continue;
        };
        match super::command::reingest(suite, run, &dir)? {
            None => {
                progress(Progress::Skipped { run });
                sum.skipped += 1;
            }
            Some(m) => {
                sum.count(m.status);
                progress(Progress::Finished {
                    run,
                    status: m.status,
                    error: m.error,
                });
            }
        }
    }
    Ok(sum)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_could_escape_the_store_are_rejected() {
        for bad in ["..", "../x", "a/b", ".hidden", "", "a\\b", "x y"] {
            assert!(safe_component(bad).is_err(), "{bad:?}");
        }
        assert!(safe_component("smoke-2.v1_x").is_ok());
        assert!(suite_dir(Path::new("runs"), "../etc").is_err());
    }

    use crate::engine::backend::CpuBackend;
    use crate::engine::device::OpError;
    use crate::engine::layout::Layout;
    use crate::engine::model::{PreparedModel, Routing, TrainPass};
    use crate::engine::rollout::Decoder;

    /// The CPU backend under another name, standing in for one GPU of several.
    struct Named(&'static str);

    impl Backend for Named {
        fn name(&self) -> String {
            self.0.to_string()
        }
        fn decoder<'a>(
            &'a self,
            prep: &'a PreparedModel,
            seqs: usize,
            positions: usize,
        ) -> Result<Box<dyn Decoder + 'a>, OpError> {
            CpuBackend.decoder(prep, seqs, positions)
        }
        fn forward_logits(
            &self,
            prep: &PreparedModel,
            tokens: &[u32],
            layout: &Layout,
            replay: Option<&Routing>,
        ) -> Result<Vec<f32>, OpError> {
            CpuBackend.forward_logits(prep, tokens, layout, replay)
        }
        fn train_forward<'a>(
            &'a self,
            prep: &'a PreparedModel,
            tokens: &[u32],
            layout: &Layout,
            replay: Option<&Routing>,
        ) -> Result<Box<dyn TrainPass + 'a>, OpError> {
            CpuBackend.train_forward(prep, tokens, layout, replay)
        }
    }

    #[test]
    fn workers_spread_runs_over_every_device() {
        let d = tempfile::tempdir().unwrap();
        let text = "name = \"spread\"\nseeds = [0, 1]\n[workload]\nsteps = 1\nprompts_per_step = 2\n\
                    [workload.warm_start]\nmax_steps = 2\neval_prompts = 8\n\
                    [[configs]]\nname = \"bf16\"\nrecipe = \"bf16\"\n";
        let suite = crate::suite::spec::parse(text, Path::new("spread.toml")).unwrap();
        let runs = crate::suite::plan::expand(&suite).unwrap();
        let opts = RunnerOptions {
            store: d.path().join("runs"),
            jobs: 2,
            force: false,
            cache: d.path().join("cache"),
            threads_per_worker: None,
            batch_runs: None,
        };
        let started = Mutex::new(Vec::new());
        let progress = |p: Progress<'_>| {
            if let Progress::Started { device, .. } = p {
                started.lock().unwrap().push(device.to_string());
            }
        };
        let (a, b) = (Named("gpu-a"), Named("gpu-b"));
        let sum = run_suite(&[&a, &b], &suite, &runs, &opts, &progress).unwrap();
        assert_eq!(sum.ok, 2, "{sum:?}");
        // Each worker takes its first run before any work starts, so the two runs land on the two devices.
        let mut seen = started.into_inner().unwrap();
        seen.sort();
        assert_eq!(seen, ["gpu-a", "gpu-b"]);
        let mut recorded: Vec<String> = runs
            .iter()
            .map(|r| {
                RunDir::open(&opts.store.join("spread").join(&r.run_id))
                    .read_manifest()
                    .unwrap()
                    .device
            })
            .collect();
        recorded.sort();
        assert_eq!(recorded, ["gpu-a", "gpu-b"], "manifests record the device");
    }

    /// A device whose every pass fails and whose health check says it is gone: a GPU that
    /// faulted.
    struct Lost;

    impl Backend for Lost {
        fn name(&self) -> String {
            "gpu-lost".into()
        }
        fn health(&self) -> Result<(), String> {
            Err("planted fault".into())
        }
        fn decoder<'a>(
            &'a self,
            _: &'a PreparedModel,
            _: usize,
            _: usize,
        ) -> Result<Box<dyn Decoder + 'a>, OpError> {
            Err(OpError::Device("planted fault".into()))
        }
        fn forward_logits(
            &self,
            _: &PreparedModel,
            _: &[u32],
            _: &Layout,
            _: Option<&Routing>,
        ) -> Result<Vec<f32>, OpError> {
            Err(OpError::Device("planted fault".into()))
        }
        fn train_forward<'a>(
            &'a self,
            _: &'a PreparedModel,
            _: &[u32],
            _: &Layout,
            _: Option<&Routing>,
        ) -> Result<Box<dyn TrainPass + 'a>, OpError> {
            Err(OpError::Device("planted fault".into()))
        }
    }

    /// Four runs of one step, their store and warm-start cache under `dir`, two workers.
    fn four_runs(dir: &Path) -> (SuiteSpec, Vec<RunSpec>, RunnerOptions) {
        let text = "name = \"lose\"\nseeds = [0, 1, 2, 3]\n[workload]\nsteps = 1\nprompts_per_step = 2\n\
                    [workload.warm_start]\nmax_steps = 2\neval_prompts = 8\n\
                    [[configs]]\nname = \"bf16\"\nrecipe = \"bf16\"\n";
        let suite = crate::suite::spec::parse(text, Path::new("lose.toml")).unwrap();
        let runs = crate::suite::plan::expand(&suite).unwrap();
        let opts = RunnerOptions {
            store: dir.join("runs"),
            jobs: 2,
            force: false,
            cache: dir.join("cache"),
            threads_per_worker: Some(1),
            batch_runs: None,
        };
        (suite, runs, opts)
    }

    #[test]
    fn a_lost_device_fails_its_run_and_the_others_finish_the_sweep() {
        let d = tempfile::tempdir().unwrap();
        let (suite, runs, opts) = four_runs(d.path());
        let lines = Mutex::new(Vec::new());
        let progress = |p: Progress<'_>| {
            if let Progress::DeviceLost { device, error } = p {
                lines.lock().unwrap().push(format!("{device}: {error}"));
            }
        };
        let good = Named("gpu-good");
        let sum = run_suite(&[&good, &Lost], &suite, &runs, &opts, &progress).unwrap();
        assert_eq!((sum.ok, sum.failed, sum.not_run), (3, 1, 0), "{sum:?}");
        assert_eq!(sum.per_device.get("gpu-good"), Some(&3));
        assert_eq!(sum.per_device.get("gpu-lost"), Some(&1));
        assert_eq!(
            sum.lost_devices,
            [("gpu-lost".to_string(), "planted fault".to_string())]
        );
        assert_eq!(lines.into_inner().unwrap(), ["gpu-lost: planted fault"]);
        for r in &runs {
            let m = RunDir::open(&opts.store.join("lose").join(&r.run_id))
                .read_manifest()
                .unwrap();
            match m.device.as_str() {
                "gpu-lost" => {
                    assert_eq!(m.status, RunStatus::Failed);
                    let e = m.error.unwrap_or_default();
                    assert!(e.contains("gpu-lost stopped computing"), "{e}");
                }
                _ => assert_eq!(m.status, RunStatus::Ok, "{:?}", m.error),
            }
        }

        // With every device lost, the runs nobody could take are counted, never dropped.
        let d = tempfile::tempdir().unwrap();
        let (suite, runs, mut opts) = four_runs(d.path());
        opts.jobs = 1;
        let sum = run_suite(&[&Lost], &suite, &runs, &opts, &|_| {}).unwrap();
        assert_eq!((sum.ok, sum.failed, sum.not_run), (0, 1, 3), "{sum:?}");
    }

    #[test]
    fn summaries_add_up_and_a_lost_device_is_named_once() {
        let mut a = Summary {
            ok: 2,
            lost_devices: vec![("cuda:0".into(), "gone".into())],
            per_device: std::collections::BTreeMap::from([("cuda:0".to_string(), 2)]),
            ..Default::default()
        };
        let b = Summary {
            ok: 1,
            failed: 1,
            lost_devices: vec![("cuda:0".into(), "gone".into())],
            per_device: std::collections::BTreeMap::from([("cuda:0".to_string(), 2)]),
            ..Default::default()
        };
        a.absorb(b);
        assert_eq!((a.ok, a.failed, a.lost_devices.len()), (3, 1, 1));
        assert_eq!(a.per_device["cuda:0"], 4);
    }

    /// What a run's folder holds but wall-clock times: its manifest's status, steps and error,
    /// its scalars, layer rows and events (values as bits or text, so a NaN equals itself).
    fn run_content(dir: &Path) -> (String, Vec<String>, String) {
        let rd = RunDir::open(dir);
        let m = rd.read_manifest().unwrap();
        let head = format!("{:?} {} {:?}", m.status, m.steps_done, m.error);
        let mut rows: Vec<String> = rd
            .read_scalars()
            .unwrap()
            .iter()
            .map(|r| format!("{} {:?}", r.step, r.deterministic_scalars()))
            .collect();
        rows.extend(rd.read_layers().unwrap().iter().map(|l| {
            let bits = l.grad_norm.to_bits();
            format!(
                "{} {} {} {bits} {} {}",
                l.step, l.site, l.layer, l.saturated, l.underflowed
            )
        }));
        (
            head,
            rows,
            std::fs::read_to_string(dir.join("events.jsonl")).unwrap(),
        )
    }

    #[test]
    fn runs_stepped_together_land_as_they_do_alone_and_a_diverging_one_stops_alone() {
        let d = tempfile::tempdir().unwrap();
        let text = "name = \"batch\"\nseeds = [0, 1]\n[workload]\nsteps = 3\nprompts_per_step = 2\neval_every = 2\n\
                    [workload.warm_start]\nmax_steps = 20\neval_prompts = 8\n\
                    [[configs]]\nname = \"bf16\"\nrecipe = \"bf16\"\n\
                    [[configs]]\nname = \"boom\"\nrecipe = \"mxfp8\"\n";
        let suite = crate::suite::spec::parse(text, Path::new("batch.toml")).unwrap();
        let mut runs = crate::suite::plan::expand(&suite).unwrap();
        // A learning rate that makes every weight NaN in the first update: `boom` diverges at
        // step 1.
        for r in runs.iter_mut().filter(|r| r.config == "boom") {
            r.run.grpo.lr = f32::NAN;
        }
        let opts = |store: &str, batch: usize| RunnerOptions {
            store: d.path().join(store),
            jobs: 1,
            force: false,
            cache: d.path().join("cache"),
            threads_per_worker: None,
            batch_runs: Some(batch),
        };
        let be = CpuBackend;
        let alone = run_suite(&[&be], &suite, &runs, &opts("alone", 1), &|_| {}).unwrap();
        let seen = Mutex::new(Vec::new());
        let progress = |p: Progress<'_>| {
            let line = match p {
                Progress::Started { run, .. } => format!("start {} {}", run.config, run.seed),
                Progress::Step { run, record } => {
                    format!("step {} {} {}", run.config, run.seed, record.step)
                }
                Progress::Finished { run, status, .. } => {
                    format!("end {} {} {status:?}", run.config, run.seed)
                }
                _ => return,
            };
            seen.lock().unwrap().push(line);
        };
        let together = run_suite(&[&be], &suite, &runs, &opts("together", 4), &progress).unwrap();
        assert_eq!((together.ok, together.diverged), (2, 2), "{together:?}");
        assert_eq!(together, alone);
        for r in &runs {
            let (a, b) = (
                opts("alone", 1).store.join("batch").join(&r.run_id),
                opts("together", 4).store.join("batch").join(&r.run_id),
            );
            assert_eq!(
                run_content(&b),
                run_content(&a),
                "{} seed {}",
                r.config,
                r.seed
            );
        }
        // All four were stepped together; boom's seeds diverged at step 1 and the bf16 seeds
        // went on to their last step.
        let seen = seen.into_inner().unwrap();
        let at = |line: &str| {
            seen.iter()
                .position(|l| l == line)
                .unwrap_or_else(|| panic!("{line}: {seen:?}"))
        };
        assert!(at("start boom 0") < at("step bf16 0 0"), "{seen:?}");
        assert!(at("start boom 1") < at("step bf16 0 0"), "{seen:?}");
        assert!(at("end boom 0 Diverged") < at("step bf16 1 2"), "{seen:?}");
        assert!(at("end boom 1 Diverged") < at("step bf16 1 2"), "{seen:?}");

        // A rerun skips what is done; a run whose folder went is redone, alone in its batch.
        let redo = runs
            .iter()
            .find(|r| r.config == "bf16" && r.seed == 1)
            .unwrap();
        let dir = opts("together", 4).store.join("batch").join(&redo.run_id);
        let before = run_content(&dir);
        std::fs::remove_dir_all(&dir).unwrap();
        let again = run_suite(&[&be], &suite, &runs, &opts("together", 4), &|_| {}).unwrap();
        assert_eq!((again.ok, again.skipped), (1, 3), "{again:?}");
        assert_eq!(run_content(&dir), before);
    }

    #[test]
    fn batches_grow_with_the_sweep_and_shrink_to_the_memory() {
        // The nightly's 30 runs over two workers: the device's 16.
        assert_eq!(default_batch_runs(16, 30, 2, None), 16);
        // A few runs still take the sweet spot (a batch is only as big as its runs).
        assert_eq!(default_batch_runs(16, 3, 2, None), 16);
        // 40 runs: one batch of 20 a worker; 192: batches of 32, twice the base at most.
        assert_eq!(default_batch_runs(16, 40, 2, None), 20);
        assert_eq!(default_batch_runs(16, 192, 2, None), 32);
        // Half of 64 GiB free over two workers at 1 GiB a run: 16 runs a batch.
        let gib = 1u64 << 30;
        assert_eq!(default_batch_runs(16, 192, 2, Some((64 * gib, gib))), 16);
        assert_eq!(default_batch_runs(16, 192, 2, Some((64 * gib, 3 * gib))), 5);
        // A run larger than the card still gets a batch of one (its own error is the device's).
        assert_eq!(default_batch_runs(16, 192, 2, Some((gib, 8 * gib))), 1);
        // The small model's nightly run: well under a GiB, so 80 GiB cards take the full 32.
        let text = "name = \"m\"\nseeds = [0]\n[workload]\nmodel = \"small\"\ntask = \"add:3\"\n\
                    prompts_per_step = 16\nsamples_per_prompt = 8\nmax_response_tokens = 6\nsteps = 1\n\
                    [[configs]]\nname = \"a\"\nrecipe = \"bf16\"\n";
        let suite = crate::suite::spec::parse(text, Path::new("m.toml")).unwrap();
        let run = &crate::suite::plan::expand(&suite).unwrap()[0];
        let per_run = run_memory_bytes(run);
        assert!(per_run > 1 << 20 && per_run < gib, "{per_run}");
        assert_eq!(
            default_batch_runs(16, 192, 2, Some((80 * gib, per_run))),
            32
        );
    }

    #[test]
    fn workers_taking_batches_at_once_each_take_whole_configurations() {
        let d = tempfile::tempdir().unwrap();
        let text = "name = \"w\"\nseeds = [0, 1, 2]\n[workload]\nsteps = 1\nprompts_per_step = 2\n\
                    eval_every = 0\n[workload.warm_start]\nmax_steps = 20\neval_prompts = 8\n\
                    [[configs]]\nname = \"a\"\nrecipe = \"bf16\"\n\
                    [[configs]]\nname = \"b\"\nrecipe = \"mxfp8\"\n\
                    [[configs]]\nname = \"c\"\nrecipe = \"nvfp4-dq\"\n";
        let suite = crate::suite::spec::parse(text, Path::new("w.toml")).unwrap();
        let runs = crate::suite::plan::expand(&suite).unwrap();
        let opts = |jobs: usize| RunnerOptions {
            store: d.path().join("store"),
            jobs,
            force: false,
            cache: d.path().join("cache"),
            threads_per_worker: None,
            batch_runs: Some(3),
        };
        // Seed 1 of every configuration finished first: a worker taking a batch meets it, and
        // while it reports the skip (slowly here) the other worker reaches for the queue.
        let middle: Vec<RunSpec> = runs.iter().filter(|r| r.seed == 1).cloned().collect();
        run_suite(&[&CpuBackend], &suite, &middle, &opts(1), &|_| {}).unwrap();
        let slow_skip = |p: Progress<'_>| {
            if matches!(p, Progress::Skipped { .. }) {
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        };
        let sum = run_suite(&[&CpuBackend], &suite, &runs, &opts(2), &slow_skip).unwrap();
        assert_eq!((sum.ok, sum.skipped), (6, 3), "{sum:?}");
        for r in runs.iter().filter(|r| r.seed != 1) {
            let m = RunDir::open(&opts(2).store.join("w").join(&r.run_id))
                .read_manifest()
                .unwrap();
            let mates: Vec<&str> = runs
                .iter()
                .filter(|o| o.config == r.config && o.seed != 1)
                .map(|o| o.run_id.as_str())
                .collect();
            assert_eq!(
                m.extra[crate::suite::builtin::BATCH_KEY],
                serde_json::json!(mates),
                "{} seed {}",
                r.config,
                r.seed
            );
        }
    }

    /// The configurations of each batch `pop_fitting` makes of `suite`'s runs, batches of `size`.
    /// Only the runs `keep` keeps are queued.
    fn batches(text: &str, size: usize, keep: impl Fn(&RunSpec) -> bool) -> Vec<Vec<String>> {
        let suite = crate::suite::spec::parse(text, Path::new("b.toml")).unwrap();
        let runs: Vec<RunSpec> = crate::suite::plan::expand(&suite)
            .unwrap()
            .into_iter()
            .filter(|r| keep(r))
            .collect();
        batches_of(&runs, size)
            .iter()
            .map(|b| {
                b.iter()
                    .map(|r| format!("{}{}", r.config, r.seed))
                    .collect()
            })
            .collect()
    }

    #[test]
    fn batches_split_a_configuration_only_when_no_batch_holds_it() {
        let configs = |names: &[&str]| -> String {
            names
                .iter()
                .map(|n| format!("[[configs]]\nname = \"{n}\"\nrecipe = \"bf16\"\n"))
                .collect()
        };
        let suite = |seeds: usize, names: &[&str]| {
            let seeds: Vec<String> = (0..seeds).map(|s| s.to_string()).collect();
            format!(
                "name = \"b\"\nseeds = [{}]\n[workload]\nsteps = 3\n{}",
                seeds.join(", "),
                configs(names)
            )
        };
        // Five seeds of six configurations, 16 a batch: three whole configurations each.
        let six = batches(&suite(5, &["a", "b", "c", "d", "e", "f"]), 16, |_| true);
        let sizes: Vec<usize> = six.iter().map(Vec::len).collect();
        assert_eq!(sizes, [15, 15], "{six:?}");
        assert!(
            six[0].iter().all(|r| r.starts_with(['a', 'b', 'c'])),
            "{six:?}"
        );
        // A configuration larger than a batch fills it; its rest starts the next, where the next
        // configuration, split whatever happens, fills the room.
        let big = batches(&suite(20, &["a", "b"]), 16, |_| true);
        let sizes: Vec<usize> = big.iter().map(Vec::len).collect();
        assert_eq!(sizes, [16, 16, 8], "{big:?}");
        // A later configuration that fits fills the room one that does not leaves.
        let mixed = batches(&suite(3, &["a", "b", "z"]), 5, |r| {
            r.config != "z" || r.seed == 0
        });
        assert_eq!(mixed[0], ["a0", "a1", "a2", "z0"], "{mixed:?}");
    }
}

//! A sweep run by several lockstep processes (`lockstep run --processes N`): on a GPU the
//! workers of one process queue on the CUDA driver's lock, one call at a time, while processes
//! each have their own. On an H200 the nightly suite took 29.6-33.3 s in one process of 4
//! workers and 21.1 s in 2 processes of 4 (docs/cuda.md, "Driver calls per step, and worker
//! processes").
//!
//! The parent splits the planned runs over the processes (round robin, devices taken in turn),
//! hands each its share on stdin (`lockstep sweep-worker`, hidden) and reads back JSON events,
//! which drive the one progress board and summary a single-process sweep prints. A worker that
//! dies without its summary is reported at once: its started runs count as failed, the others as
//! not run. SIGINT/SIGTERM reach every worker, and a worker whose parent dies stops itself.

use anyhow::{Context, Result, bail};
use lockstep::engine::metrics::StepRecord;
use lockstep::store::RunStatus;
use lockstep::suite::runner::{
    Progress, RunnerOptions, Summary, batches_of, is_finished, run_suite, suite_dir,
};
use lockstep::suite::{RunSpec, SuiteSpec};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// One worker process's share of a sweep, sent on its stdin.
#[derive(Debug, Serialize, Deserialize)]
pub struct Job {
    pub suite: SuiteSpec,
    /// The suite file (not serialized with the spec; errors and relative paths name it).
    pub suite_path: PathBuf,
    pub runs: Vec<RunSpec>,
    pub store: PathBuf,
    pub cache: PathBuf,
    pub force: bool,
    /// `cpu`, `cuda:N`.
    pub device: String,
    pub jobs: usize,
    pub threads_per_worker: Option<usize>,
    /// Runs each worker steps together (`None`: what the device suits).
    pub batch_runs: Option<usize>,
    /// The parent's pid: a worker that finds another parent was orphaned before it started.
    pub parent: u32,
}

/// What a worker reports on stdout, one JSON object a line.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Event {
    Skipped {
        run_id: String,
    },
    Busy {
        run_id: String,
    },
    Started {
        run_id: String,
        device: String,
    },
    Step {
        run_id: String,
        record: Box<StepRecord>,
    },
    Finished {
        run_id: String,
        status: RunStatus,
        error: Option<String>,
    },
    DeviceLost {
        device: String,
        error: String,
    },
    Summary(Summary),
}

impl Event {
    fn of(p: Progress<'_>) -> Event {
        let id = |r: &RunSpec| r.run_id.clone();
        match p {
            Progress::Skipped { run } => Event::Skipped { run_id: id(run) },
            Progress::Busy { run } => Event::Busy { run_id: id(run) },
            Progress::Started { run, device } => Event::Started {
                run_id: id(run),
                device: device.to_string(),
            },
            Progress::Step { run, record } => Event::Step {
                run_id: id(run),
                record: Box::new(record.clone()),
            },
            Progress::Finished { run, status, error } => Event::Finished {
                run_id: id(run),
                status,
                error,
            },
            Progress::DeviceLost { device, error } => Event::DeviceLost {
                device: device.to_string(),
                error: error.to_string(),
            },
        }
    }
}

/// The fault test hook of the GPU test bundle: with `LOCKSTEP_PLANT_FAULT=cuda:N`, the workers on
/// that card fault it `LOCKSTEP_PLANT_FAULT_AFTER` seconds (default 3) after they start.
#[cfg(feature = "fault-injection")]
fn plant_fault(device: &str) {
    if std::env::var("LOCKSTEP_PLANT_FAULT").ok().as_deref() != Some(device) {
        return;
    }
    let after = std::env::var("LOCKSTEP_PLANT_FAULT_AFTER")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3.0);
    let Ok(lockstep::engine::backend::Device::Cuda(ordinal)) = device.parse() else {
        return;
    };
    std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_secs_f64(after));
        eprintln!("fault-injection: faulting cuda:{ordinal}");
        let _ = lockstep::engine::backend::cuda::plant_fault(ordinal);
    });
}

/// `lockstep sweep-worker`: run the [`Job`] on stdin, reporting [`Event`]s on stdout.
pub fn worker_cmd() -> Result<bool> {
    stop_with_parent();
    let mut job: Job = serde_json::from_reader(std::io::stdin().lock())
        .context("sweep-worker reads its job from lockstep run on stdin; it is not run by hand")?;
    job.suite.path = job.suite_path.clone();
    if std::os::unix::process::parent_id() != job.parent {
        bail!("the lockstep run that started this worker is gone");
    }
    lockstep::suite::interrupt::install();
    let be = lockstep::engine::backend::open(job.device.parse()?)?;
    #[cfg(feature = "fault-injection")]
    plant_fault(&job.device);
    let opts = RunnerOptions {
        store: job.store.clone(),
        jobs: job.jobs,
        force: job.force,
        cache: job.cache.clone(),
        threads_per_worker: job.threads_per_worker,
        batch_runs: job.batch_runs,
    };
    let emit = |e: &Event| {
        if let Ok(line) = serde_json::to_string(e) {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{line}");
            let _ = out.flush();
        }
    };
    let sum = run_suite(&[be.as_ref()], &job.suite, &job.runs, &opts, &|p| {
        emit(&Event::of(p))
    })?;
    let ok = sum.failed + sum.timeout + sum.not_run == 0;
    emit(&Event::Summary(sum));
    Ok(ok)
}

/// Ask the kernel to send this process SIGTERM when its parent dies (Linux), so a `lockstep run`
/// killed outright does not leave workers computing: SIGTERM stops them between steps, their
/// runs marked interrupted.
fn stop_with_parent() {
    #[cfg(target_os = "linux")]
    // SAFETY: prctl with PR_SET_PDEATHSIG only sets this process's parent-death signal.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
    }
}

/// A started worker: its process, device and share of the runs.
struct Worker {
    child: Child,
    device: String,
    runs: Vec<RunSpec>,
    summary: Option<Summary>,
    /// Set once reaped.
    status: Option<std::process::ExitStatus>,
}

impl Drop for Worker {
    /// A worker not yet reaped when the sweep ends early (an error in this process) is stopped
    /// and waited for: nothing lockstep started outlives it.
    fn drop(&mut self) {
        if self.status.is_none() {
            // SAFETY: kill only sends a signal to our own child, not yet reaped.
            unsafe {
                libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
            }
            let _ = self.child.wait();
        }
    }
}

/// How to split a sweep over processes.
pub struct Split {
    /// The devices, by name (`cuda:0`, `cpu`).
    pub devices: Vec<String>,
    /// Processes per device.
    pub per_device: usize,
    /// Workers over all processes.
    pub jobs: usize,
}

/// The runs each process gets: `runs` dealt round robin over `processes` shares, a batch of up
/// to `together` runs at a time (a device's processes are spread over the list, so consecutive
/// deals go to different devices). Shares that get no run are dropped.
fn deal(runs: &[RunSpec], processes: usize, together: usize) -> Vec<Vec<RunSpec>> {
    let n = processes.max(1);
    let mut shares = vec![Vec::new(); n];
    // The batches one process of several workers would take: each run's neighbours (on a GPU,
    // its numbers) do not depend on the layout.
    for (i, batch) in batches_of(runs, together).into_iter().enumerate() {
        shares[i % n].extend(batch.into_iter().cloned());
    }
    shares.retain(|s| !s.is_empty());
    shares
}

/// Run `runs` of suite `s` in worker processes; prints progress through `on_event` and returns
/// the summed summary (a worker that died without one has its runs read from the store).
pub fn run(
    s: &SuiteSpec,
    runs: &[RunSpec],
    opts: &RunnerOptions,
    split: &Split,
    on_event: &dyn Fn(Progress<'_>),
) -> Result<Summary> {
    // Finished runs are skipped here: a worker is started (and a device opened) only for work.
    let root = suite_dir(&opts.store, &s.name)?;
    let mut total = Summary::default();
    let mut todo = Vec::new();
    for r in runs {
        if !opts.force && is_finished(&root.join(&r.run_id)) {
            on_event(Progress::Skipped { run: r });
            total.skipped += 1;
        } else {
            todo.push(r.clone());
        }
    }
    let slots: Vec<&String> = (0..split.per_device)
        .flat_map(|_| split.devices.iter())
        .collect();
    // The batch size the parent chose for every worker (`cli::suite`), so shares are whole batches.
    let shares = deal(&todo, slots.len(), opts.batch_runs.unwrap_or(1));
    let jobs_each = (split.jobs / shares.len().max(1)).max(1);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let processes = shares.len().max(1);
    let exe = std::env::current_exe().context("cannot find the lockstep binary for workers")?;
    let mut workers = Vec::new();
    for (share, device) in shares.into_iter().zip(slots) {
        // A GPU worker process sizes its host pools as a `lockstep run` of its own would (the
        // layout measured: its host threads mostly wait on the driver); CPU worker processes,
        // which compute on the cores, share them out.
        let on_gpu = device.as_str() != "cpu";
        let pool = if on_gpu {
            cores
        } else {
            (cores / processes).max(1)
        };
        let threads_per_worker = super::suite::worker_threads(on_gpu, jobs_each);
        let job = Job {
            suite: s.clone(),
            suite_path: s.path.clone(),
            runs: share,
            store: opts.store.clone(),
            cache: opts.cache.clone(),
            force: opts.force,
            device: device.clone(),
            jobs: jobs_each,
            threads_per_worker,
            batch_runs: opts.batch_runs,
            parent: std::process::id(),
        };
        workers.push(start(&exe, job, pool)?);
    }
    for w in &workers {
        println!(
            "worker process {} on {}: {} runs",
            w.child.id(),
            w.device,
            w.runs.len()
        );
    }
    follow(&mut workers, runs, on_event)?;
    for w in &mut workers {
        let sum = match w.summary.take() {
            Some(sum) => sum,
            None => from_store(&root, &w.runs),
        };
        total.absorb(sum);
    }
    Ok(total)
}

/// Start `lockstep sweep-worker` with `job` on its stdin and a global host pool of `cores` threads.
fn start(exe: &std::path::Path, job: Job, cores: usize) -> Result<Worker> {
    let mut child = Command::new(exe)
        .arg("sweep-worker")
        .env("RAYON_NUM_THREADS", cores.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("cannot start a worker process ({})", exe.display()))?;
    let mut stdin = child.stdin.take().context("worker stdin")?;
    serde_json::to_writer(&mut stdin, &job)?;
    drop(stdin); // end of the job
    Ok(Worker {
        child,
        device: job.device,
        runs: job.runs,
        summary: None,
        status: None,
    })
}

/// Relay every worker's events until all of them have ended; a worker that ends without its
/// summary is reported at once. SIGINT/SIGTERM received here is passed on to every worker once.
fn follow(workers: &mut [Worker], runs: &[RunSpec], on_event: &dyn Fn(Progress<'_>)) -> Result<()> {
    let by_id: BTreeMap<&str, &RunSpec> = runs.iter().map(|r| (r.run_id.as_str(), r)).collect();
    // (worker, a line of its output; None once the output closed).
    let (tx, rx) = mpsc::channel::<(usize, Option<String>)>();
    for (i, w) in workers.iter_mut().enumerate() {
        let out = w.child.stdout.take().context("worker stdout")?;
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send((i, Some(line))).is_err() {
                    return;
                }
            }
            let _ = tx.send((i, None));
        });
    }
    drop(tx);
    let mut forwarded = false;
    loop {
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok((i, Some(line))) => match serde_json::from_str::<Event>(&line) {
                Ok(Event::Summary(sum)) => workers[i].summary = Some(sum),
                Ok(e) => relay(e, &by_id, on_event),
                Err(_) => println!("{line}"),
            },
            Ok((i, None)) => ended(&mut workers[i])?,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => return Ok(()),
        }
        if !forwarded && let Some(sig) = lockstep::suite::interrupt::requested() {
            forwarded = true;
            for w in workers.iter().filter(|w| w.status.is_none()) {
                // SAFETY: kill only sends a signal to our own child, not yet reaped.
                unsafe {
                    libc::kill(w.child.id() as libc::pid_t, sig);
                }
            }
        }
    }
}

/// A worker whose output closed: reap it, and say so at once if it ended without its summary.
fn ended(w: &mut Worker) -> Result<()> {
    let status = w.child.wait()?;
    w.status = Some(status);
    if w.summary.is_none() {
        eprintln!(
            "error: worker process {} on {} ended ({status}) before reporting its runs; its unfinished runs count as failed or not run, and the next `lockstep run` redoes them",
            w.child.id(),
            w.device
        );
    }
    Ok(())
}

/// One worker event as the progress board's event (an unknown run id, which no worker of this
/// sweep sends, is dropped).
fn relay(e: Event, by_id: &BTreeMap<&str, &RunSpec>, on_event: &dyn Fn(Progress<'_>)) {
    let run = |id: &str| by_id.get(id).copied();
    match e {
        Event::Skipped { run_id } => {
            if let Some(run) = run(&run_id) {
                on_event(Progress::Skipped { run })
            }
        }
        Event::Busy { run_id } => {
            if let Some(run) = run(&run_id) {
                on_event(Progress::Busy { run })
            }
        }
        Event::Started { run_id, device } => {
            if let Some(run) = run(&run_id) {
                on_event(Progress::Started {
                    run,
                    device: &device,
                })
            }
        }
        Event::Step { run_id, record } => {
            if let Some(run) = run(&run_id) {
                on_event(Progress::Step {
                    run,
                    record: &record,
                })
            }
        }
        Event::Finished {
            run_id,
            status,
            error,
        } => {
            if let Some(run) = run(&run_id) {
                on_event(Progress::Finished { run, status, error })
            }
        }
        Event::DeviceLost { device, error } => on_event(Progress::DeviceLost {
            device: &device,
            error: &error,
        }),
        Event::Summary(_) => {}
    }
}

/// The counts of a dead worker's `runs` as the store has them: finished ones by their status,
/// started ones failed, the others not run.
fn from_store(root: &std::path::Path, runs: &[RunSpec]) -> Summary {
    let mut sum = Summary::default();
    for r in runs {
        match lockstep::store::RunDir::open(&root.join(&r.run_id)).read_manifest() {
            Ok(m) if m.status == RunStatus::Ok => sum.ok += 1,
            Ok(m) if m.status == RunStatus::Diverged => sum.diverged += 1,
            Ok(_) => sum.failed += 1,
            Err(_) => sum.not_run += 1,
        }
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockstep::suite::{expand, spec::parse};
    use std::path::Path;

    fn runs(n: usize) -> Vec<RunSpec> {
        let seeds: Vec<String> = (0..n).map(|s| s.to_string()).collect();
        let text = format!(
            "name = \"p\"\nseeds = [{}]\n[workload]\nsteps = 2\n[[configs]]\nname = \"bf16\"\nrecipe = \"bf16\"\n",
            seeds.join(", ")
        );
        expand(&parse(&text, Path::new("p.toml")).unwrap()).unwrap()
    }

    #[test]
    fn runs_are_dealt_round_robin_and_empty_shares_dropped() {
        let r = runs(5);
        let shares = deal(&r, 2, 1);
        let seeds = |s: &[RunSpec]| s.iter().map(|r| r.seed).collect::<Vec<_>>();
        assert_eq!(seeds(&shares[0]), [0, 2, 4]);
        assert_eq!(seeds(&shares[1]), [1, 3]);
        assert_eq!(
            deal(&r[..1], 4, 1).len(),
            1,
            "three processes would get nothing"
        );
        // Runs stepped together in batches of 2 are dealt 2 at a time.
        let shares = deal(&r, 2, 2);
        assert_eq!(seeds(&shares[0]), [0, 1, 4]);
        assert_eq!(seeds(&shares[1]), [2, 3]);
    }

    #[test]
    fn processes_are_dealt_the_batches_a_worker_would_take() {
        let text = "name = \"p\"\nseeds = [0, 1, 2]\n[workload]\nsteps = 2\n\
                    [[configs]]\nname = \"a\"\nrecipe = \"bf16\"\n\
                    [[configs]]\nname = \"b\"\nrecipe = \"mxfp8\"\n\
                    [[configs]]\nname = \"c\"\nrecipe = \"nvfp4-dq\"\n";
        let r = expand(&parse(text, Path::new("p.toml")).unwrap()).unwrap();
        let configs = |s: &[RunSpec]| s.iter().map(|r| r.config.clone()).collect::<Vec<_>>();
        // Batches of 6 take two whole configurations, then the third: one each.
        let shares = deal(&r, 2, 6);
        assert_eq!(configs(&shares[0]), ["a", "a", "a", "b", "b", "b"]);
        assert_eq!(configs(&shares[1]), ["c", "c", "c"]);
        // Batches of 4 hold one configuration each (4 consecutive runs at a time would cut them).
        let shares = deal(&r, 2, 4);
        assert_eq!(configs(&shares[0]), ["a", "a", "a", "c", "c", "c"]);
        assert_eq!(configs(&shares[1]), ["b", "b", "b"]);
    }

    #[test]
    fn every_progress_event_survives_the_trip_through_a_line() {
        let r = runs(1);
        let record = StepRecord {
            step: 3,
            ..Default::default()
        };
        let events = [
            Event::of(Progress::Started {
                run: &r[0],
                device: "cuda:1",
            }),
            Event::of(Progress::Step {
                run: &r[0],
                record: &record,
            }),
            Event::of(Progress::Finished {
                run: &r[0],
                status: RunStatus::Diverged,
                error: Some("nan".into()),
            }),
        ];
        let by_id = BTreeMap::from([(r[0].run_id.as_str(), &r[0])]);
        let seen = std::sync::Mutex::new(Vec::new());
        for e in &events {
            let line = serde_json::to_string(e).unwrap();
            assert!(!line.contains('\n'));
            relay(serde_json::from_str(&line).unwrap(), &by_id, &|p| {
                seen.lock().unwrap().push(match p {
                    Progress::Started { device, .. } => format!("started {device}"),
                    Progress::Step { record, .. } => format!("step {}", record.step),
                    Progress::Finished { status, error, .. } => format!("{status:?} {error:?}"),
                    _ => "other".into(),
                })
            });
        }
        assert_eq!(
            seen.into_inner().unwrap(),
            ["started cuda:1", "step 3", "Diverged Some(\"nan\")"]
        );
    }
}

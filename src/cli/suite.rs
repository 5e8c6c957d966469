//! `lockstep suite show|check`, `lockstep run SUITE` and `lockstep runs list|show|rm`.

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use lockstep::engine::backend::DeviceError;
use lockstep::store::RunDir;
use lockstep::suite::builtin::default_cache;
use lockstep::suite::runner::{
    Progress, RunnerOptions, default_batch_runs, run_memory_bytes, run_suite, safe_component,
    suite_dir,
};
use lockstep::suite::{expand, load};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Instant;

#[derive(Debug, Subcommand)]
pub enum SuiteCommand {
    /// Print the expanded run list.
    Show {
        file: PathBuf,
        /// Command engine: also print each run's expanded argv and environment, as they would be
        /// launched (with `{out_dir}` under --store).
        #[arg(long)]
        argv: bool,
        /// Run store root (for `{out_dir}` with --argv).
        #[arg(long, default_value = "runs")]
        store: PathBuf,
    },
    /// Validate a suite without running it.
    Check { file: PathBuf },
}

pub fn suite_cmd(cmd: &SuiteCommand) -> Result<bool> {
    match cmd {
        SuiteCommand::Show { file, argv, store } => {
            let s = load(file)?;
            let runs = expand(&s)?;
            println!(
                "suite {} ({} engine): {} runs",
                s.name,
                s.engine,
                runs.len()
            );
            for r in &runs {
                println!("  {:<40} seed {:<4} {}", r.config, r.seed, r.run_id);
                if let (true, Some(cmd)) = (*argv, &s.command) {
                    let out = std::path::absolute(
                        suite_dir(store, &s.name)?.join(&r.run_id).join("out"),
                    )?;
                    let a = lockstep::suite::command::argv(&s, cmd, r, &out)
                        .map_err(|e| anyhow::anyhow!("config `{}`: {e}", r.config))?;
                    println!(
                        "      argv: {}",
                        a.iter().map(|x| quote(x)).collect::<Vec<_>>().join(" ")
                    );
                    let env = lockstep::suite::command::env(&s, r, &out)
                        .map_err(|e| anyhow::anyhow!("config `{}`: {e}", r.config))?;
                    for (k, v) in &env {
                        println!("      env:  {k}={}", quote(v));
                    }
                }
            }
            if *argv && s.command.is_none() {
                println!("(--argv: only command-engine suites launch a program)");
            }
            Ok(true)
        }
        SuiteCommand::Check { file } => {
            let s = load(file)?;
            let runs = expand(&s)?;
            let checks = lockstep::compare::settings::from_spec(&s)?;
            println!(
                "{}: ok ({} runs, {} checks, {} claims)",
                file.display(),
                runs.len(),
                checks.checks.len(),
                checks.claims.len()
            );
            Ok(true)
        }
    }
}

/// An argument as a POSIX shell would need it quoted, for display only (lockstep never runs a
/// shell): plain words as they are, anything else in single quotes.
fn quote(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// `lockstep run` or `nightly` was stopped by a signal; main exits with 128 + the signal. The text,
/// when given, says what was stopped (the Slurm executor's cancellation); otherwise the local
/// runner's words.
#[derive(Debug)]
pub struct Interrupted(pub i32, pub Option<String>);

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "stopped by {}: {}",
            lockstep::suite::command::signal_name(self.0),
            self.1.as_deref().unwrap_or(
                "every launcher was stopped and the runs in flight are marked interrupted; rerun the same command to resume"
            )
        )
    }
}

impl std::error::Error for Interrupted {}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Suite file (TOML).
    pub suite: PathBuf,
    /// Run store root.
    #[arg(long, default_value = "runs")]
    pub store: PathBuf,
    /// Parallel workers, over all processes (default: one per core; on GPUs two per GPU when
    /// runs are batched, else four per process).
    #[arg(long)]
    pub jobs: Option<usize>,
    /// Worker processes per device (default: 1; 2 per GPU whose workers step one run each). A
    /// GPU's workers in one process queue on the CUDA driver's lock; each process has its own.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    pub processes: Option<u16>,
    /// Runs a worker steps together, one batched device call per pass for all of them: runs of
    /// one model, task and workload shape, the seeds of one configuration first, then whole
    /// configurations that fit (built-in engine). Default: what the device suits (16 on a GPU; 1
    /// on the CPU, whose passes already use every core); 1 runs each run by itself. On the CPU
    /// every run's metrics are the same either way; on a GPU a batched run's differ from its
    /// metrics alone by the GEMMs' summation order, and repeat bit for bit for the same batches.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    pub batch_runs: Option<u16>,
    /// Redo finished runs too.
    #[arg(long)]
    pub force: bool,
    /// Command engine: re-read every finished run's output folder with the suite's current
    /// metrics mapping and judge it again, launching nothing.
    #[arg(long, conflicts_with = "force")]
    pub reingest: bool,
    /// Where the engine runs: cpu; cuda (spread over every visible GPU, workers take them in
    /// turn); cuda:N; or a list, cuda:0,cuda:2.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Where runs execute: `local` (this machine, --jobs workers) or `slurm` (one job array,
    /// one task per unfinished run; --jobs then caps how many tasks run at once).
    #[arg(long, value_enum, default_value_t = Executor::Local)]
    pub executor: Executor,
    #[command(flatten)]
    pub slurm: super::slurm::SlurmArgs,
}

/// Where `lockstep run` executes runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Executor {
    Local,
    Slurm,
}

pub fn run_cmd(args: &RunArgs) -> Result<bool> {
    let s = load(&args.suite)?;
    let runs = expand(&s)?;
    if s.engine == "ingest" {
        return ingest_suite_cmd(&s, &runs, &args.store);
    }
    if args.reingest {
        return reingest_cmd(&s, &runs, args);
    }
    note_unplanned_runs(&s, &runs, &args.store);
    if args.processes.is_some() && args.executor != Executor::Local {
        bail!("--processes only applies with --executor local (Slurm runs each run as a task)");
    }
    if args.batch_runs.is_some() && args.executor != Executor::Local {
        bail!("--batch-runs only applies with --executor local (Slurm runs each run as a task)");
    }
    if args.executor == Executor::Slurm {
        return super::slurm::run(args, &s, &runs);
    }
    if let Some(flag) = args.slurm.first_set() {
        bail!("{flag} only applies with --executor slurm");
    }
    run_local(&s, &runs, args)
}

/// Say so when the suite's folder holds runs that are not runs of the suite as it is now (an
/// edited suite, or an older lockstep's run ids), so a rerun of all of it is not a surprise.
fn note_unplanned_runs(
    s: &lockstep::suite::SuiteSpec,
    runs: &[lockstep::suite::RunSpec],
    store: &std::path::Path,
) {
    let Ok(root) = suite_dir(store, &s.name) else {
        return;
    };
    let other = lockstep::suite::runner::unplanned_runs(&root, runs);
    if let Some(first) = other.first() {
        eprintln!(
            "note: {} run folder(s) in {} are not runs of this suite as it is now (e.g. {first}): an edited suite, or run ids of an older lockstep (README, \"Upgrading\"); they do not count as done; `compare`, `report` and `nightly` skip them",
            other.len(),
            root.display()
        );
    }
}

/// Run `runs` (planned runs of suite `s`) on this machine with `args`' workers and devices;
/// Ok(false) when a run failed or timed out, an [`Interrupted`] error on SIGINT/SIGTERM.
pub fn run_local(
    s: &lockstep::suite::SuiteSpec,
    runs: &[lockstep::suite::RunSpec],
    args: &RunArgs,
) -> Result<bool> {
    use lockstep::engine::backend::{Device, describe, open};
    // The devices are described first, without compiling kernels: in worker processes only the
    // workers need them.
    let devices = lockstep::engine::backend::sweep_devices(&args.device)?;
    let described = devices
        .iter()
        .map(|d| describe(*d).map(|i| (*d, i)))
        .collect();
    let (usable, unavailable) = usable_devices(described)?;
    for e in &unavailable {
        eprintln!("warning: {e}; the sweep runs on the other devices");
    }
    let (devices, infos): (Vec<Device>, Vec<_>) = usable.into_iter().unzip();
    let on_gpu = devices.iter().any(|d| *d != Device::Cpu);
    let exclusive: Vec<String> = infos
        .iter()
        .filter(|i| i.one_process_only)
        .map(|i| i.name.clone())
        .collect();
    // Without --batch-runs, what the devices suit: known here without opening them, so the
    // parent deals worker processes whole batches.
    let asked = args.batch_runs.map(usize::from);
    let device_batch = infos.iter().map(|i| i.batch_runs).min();
    let batched = asked.or(device_batch).is_some_and(|n| n > 1) && s.engine == "builtin";
    let processes = worker_processes(args.processes, on_gpu && !batched, &exclusive)?;
    let jobs = args.jobs.unwrap_or_else(|| {
        if on_gpu && batched {
            BATCHED_WORKERS * devices.len()
        } else {
            default_jobs(on_gpu, devices.len() * processes)
        }
    });
    // No more processes than workers: `--jobs 1` runs in this process.
    let processes = processes.min(jobs / devices.len().max(1)).max(1);
    let batch_runs = asked.or_else(|| {
        let base = device_batch?;
        if !batched {
            return Some(base);
        }
        // Sized by the suite and by the device with the least memory free.
        let free = infos.iter().filter_map(|i| i.free_memory).min();
        let per_run = runs.iter().map(run_memory_bytes).max().unwrap_or(0);
        let workers = jobs.div_ceil(devices.len().max(1));
        let runs_each = runs.len().div_ceil(devices.len().max(1));
        Some(default_batch_runs(
            base,
            runs_each,
            workers,
            free.map(|f| (f, per_run)),
        ))
    });
    let opts = RunnerOptions {
        store: args.store.clone(),
        jobs,
        force: args.force,
        cache: default_cache(),
        threads_per_worker: worker_threads(on_gpu, jobs),
        batch_runs,
    };
    let total = runs.len();
    let start = Instant::now();
    let tty = std::io::stdout().is_terminal();
    let in_processes = match processes {
        1 => String::new(),
        p => format!(" in {} processes", p * infos.len()),
    };
    let batches = match opts.batch_runs {
        Some(n) if n > 1 && s.engine == "builtin" => format!(" stepping up to {n} runs together"),
        _ => String::new(),
    };
    println!(
        "suite {}: {total} runs, {jobs} workers{in_processes}{batches} on {}, store {}",
        s.name,
        infos
            .iter()
            .map(|i| i.name.as_str())
            .collect::<Vec<_>>()
            .join(", "),
        args.store.display()
    );
    for i in &infos {
        if let Some(hw) = &i.hardware {
            println!("  {} = {hw}", i.name);
        }
    }
    static GPU_NOTE_SHOWN: std::sync::Once = std::sync::Once::new();
    if on_gpu {
        // Once per command: `nightly --seeds auto` runs several rounds.
        GPU_NOTE_SHOWN.call_once(|| eprintln!("{}", lockstep::engine::backend::cuda::GPU_NOTE));
    }
    let board = Mutex::new(super::progress::Board::new(total, tty));
    let progress = |p: Progress<'_>| {
        if let Ok(mut b) = board.lock() {
            super::progress::print(&b.event(p), tty);
        }
    };
    lockstep::suite::interrupt::install();
    let names: Vec<String> = infos.iter().map(|i| i.name.clone()).collect();
    let sum = if processes > 1 {
        let split = super::workers::Split {
            devices: names.clone(),
            per_device: processes,
            jobs,
        };
        super::workers::run(s, runs, &opts, &split, &progress)?
    } else {
        // A card can still fail here (its cuBLAS handle, a kernel module): the others go on.
        let (backends, unavailable) = usable_devices(devices.into_iter().map(open).collect())?;
        for e in &unavailable {
            eprintln!("warning: {e}; the sweep runs on the other devices");
        }
        let refs: Vec<&dyn lockstep::engine::backend::Backend> =
            backends.iter().map(|b| b.as_ref()).collect();
        run_suite(&refs, s, runs, &opts, &progress)?
    };
    if tty {
        print!("\r\x1b[2K"); // the status line
    }
    print_summary(&sum, start.elapsed().as_secs_f64());
    if names.len() > 1 {
        let spread: Vec<String> = names
            .iter()
            .map(|name| {
                let n = sum.per_device.get(name).copied().unwrap_or(0);
                format!("{name} {n}")
            })
            .collect();
        println!("runs per device: {}", spread.join(", "));
    }
    for (device, why) in &sum.lost_devices {
        eprintln!(
            "error: {device} stopped computing during the sweep ({why}); its failed run is redone by the next `lockstep run` (on the other devices: --device cuda:N,...)"
        );
    }
    if let Some(sig) = lockstep::suite::interrupt::requested() {
        return Err(Interrupted(sig, None).into());
    }
    Ok(sum.failed + sum.timeout + sum.not_run == 0)
}

fn print_summary(sum: &lockstep::suite::runner::Summary, secs: f64) {
    let not_run = match sum.not_run {
        0 => String::new(),
        n => format!(", {n} not run (no device or worker process left)"),
    };
    println!(
        "done in {secs:.1}s: {} ok, {} skipped, {} failed, {} timed out, {} diverged, {} interrupted, {} busy{not_run}",
        sum.ok, sum.skipped, sum.failed, sum.timeout, sum.diverged, sum.interrupted, sum.busy
    );
}

/// `lockstep run --reingest`: judge finished command runs again with the current mapping.
fn reingest_cmd(
    s: &lockstep::suite::SuiteSpec,
    runs: &[lockstep::suite::RunSpec],
    args: &RunArgs,
) -> Result<bool> {
    if s.engine != "command" {
        bail!(
            "--reingest re-reads command-engine output folders; suite `{}` uses the {} engine",
            s.name,
            s.engine
        );
    }
    let start = Instant::now();
    let board = Mutex::new(super::progress::Board::new(runs.len(), false));
    let progress = |p: Progress<'_>| {
        if let Ok(mut b) = board.lock() {
            super::progress::print(&b.event(p), false);
        }
    };
    let sum = lockstep::suite::runner::reingest_suite(s, runs, &args.store, &progress)?;
    print_summary(&sum, start.elapsed().as_secs_f64());
    Ok(sum.failed + sum.timeout == 0)
}

/// `lockstep run` of an `engine = "ingest"` suite: read its tree into the store.
fn ingest_suite_cmd(
    s: &lockstep::suite::SuiteSpec,
    runs: &[lockstep::suite::RunSpec],
    store: &std::path::Path,
) -> Result<bool> {
    let sum = lockstep::suite::ingest::ingest_suite(s, runs, store, |run, status, error| {
        println!(
            "{:<12} {} seed {}{}",
            format!("{status:?}").to_lowercase(),
            run.config,
            run.seed,
            error.map(|e| format!(": {e}")).unwrap_or_default()
        );
    })?;
    for i in &sum.ignored {
        eprintln!(
            "warning: {i} is in the tree but not in suite `{}`; ignored",
            s.name
        );
    }
    println!(
        "{} imported ({} not finished), {} planned run(s) missing from the tree, {} unreadable metric lines or values skipped; store: {}",
        sum.imported,
        sum.unfinished,
        sum.missing,
        sum.skipped_lines,
        store.join(&s.name).display()
    );
    Ok(sum.missing + sum.unfinished == 0)
}

/// The devices a sweep can use, and the cards it leaves out because they cannot be used now
/// ([`DeviceError::card_unavailable`]), as long as one is left; any other error stops it.
fn usable_devices<B>(
    opened: Vec<Result<B, DeviceError>>,
) -> Result<(Vec<B>, Vec<DeviceError>), DeviceError> {
    let (mut usable, mut left_out) = (Vec::new(), Vec::new());
    for o in opened {
        match o {
            Ok(b) => usable.push(b),
            Err(e) if e.card_unavailable() => left_out.push(e),
            Err(e) => return Err(e),
        }
    }
    match (usable.is_empty(), left_out.is_empty()) {
        (true, false) => Err(left_out.swap_remove(0)),
        _ => Ok((usable, left_out)),
    }
}

/// Worker processes per device: `--processes`, else 2 on a GPU whose workers step one run each
/// (`pooled`: their driver calls then queue on two locks, not one) and 1 otherwise; 1 where a
/// GPU takes one process at a time (exclusive-process mode: the devices named in `exclusive`),
/// and an error if more were asked there.
fn worker_processes(asked: Option<u16>, pooled: bool, exclusive: &[String]) -> Result<usize> {
    match asked.map(usize::from) {
        Some(n) if n > 1 && !exclusive.is_empty() => bail!(
            "--processes {n}: {} takes one process at a time (exclusive-process compute mode); use --processes 1",
            exclusive.join(", ")
        ),
        Some(n) => Ok(n),
        None if pooled && exclusive.is_empty() => Ok(2),
        None => Ok(1),
    }
}

/// Each worker's own host thread pool on GPUs, the cores shared out, where that leaves each at
/// least 2 (a step runs its rollout and the trainer's preparation side by side); otherwise the
/// workers share one pool. On an H200 (16 cores) the nightly suite took 35.0 s against 36.9 s
/// with a shared pool at 4 workers, 37.1 against 40.6 s at 8; at 16 workers the shared pool was
/// faster (44.5 against 52.3 s). On the CPU the workers compute on the shared pool.
pub(super) fn worker_threads(on_gpu: bool, jobs: usize) -> Option<usize> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (on_gpu && jobs > 1 && cores / jobs >= 2).then_some(cores / jobs)
}

/// Workers per GPU when `--jobs` is not given and runs are stepped in batches: one process of two
/// workers, each stepping a batch while the other does its host work. On an H200 the nightly
/// suite in batches of up to 16 took 14.3-15.1 s in 1 process of 2 workers, 15.6 s in 2 of 2
/// (batches of 8), 15.8 s in 1 of 4 (of 8), 16.2 s in 2 of 1 (of 16), against 21.1-21.5 s for
/// the pool of 2 processes of 4 workers stepping one run each (docs/cuda.md).
const BATCHED_WORKERS: usize = 2;

/// Workers when `--jobs` is not given, runs stepped one at a time: one per core on the CPU; on
/// GPUs four per process, the measured sweet spot on an H200 (the nightly suite in one process:
/// 55 s with one worker, 35 s with 4, 37 s with 8, 52 s with 16; in 2 processes of 4, 21 s
/// against 30-33 s for 1 of 4).
fn default_jobs(on_gpu: bool, processes: usize) -> usize {
    if on_gpu {
        processes * 4
    } else {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    }
}

#[derive(Debug, Subcommand)]
pub enum RunsCommand {
    /// List the runs of a suite (or every suite) with their status.
    List {
        suite: Option<String>,
        #[arg(long, default_value = "runs")]
        store: PathBuf,
    },
    /// Print one run's manifest.
    Show {
        suite: String,
        run_id: String,
        #[arg(long, default_value = "runs")]
        store: PathBuf,
    },
    /// Delete one run.
    Rm {
        suite: String,
        run_id: String,
        #[arg(long, default_value = "runs")]
        store: PathBuf,
    },
}

pub fn runs_cmd(cmd: &RunsCommand) -> Result<bool> {
    match cmd {
        RunsCommand::List { suite, store } => {
            let suites: Vec<String> = match suite {
                Some(s) => vec![s.clone()],
                None => std::fs::read_dir(store)
                    .with_context(|| {
                        format!("{}: no run store here (run a suite first)", store.display())
                    })?
                    .filter_map(|e| e.ok())
                    .filter(|e| e.path().is_dir())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| safe_component(n).is_ok() && n != "cache")
                    .collect(),
            };
            for s in suites {
                let dir = suite_dir(store, &s)?;
                let mut entries: Vec<_> = std::fs::read_dir(&dir)
                    .with_context(|| format!("{}", dir.display()))?
                    .filter_map(|e| e.ok())
                    .filter(|e| e.path().is_dir())
                    .filter(|e| !e.file_name().to_string_lossy().starts_with('.')) // .slurm records
                    .collect();
                entries.sort_by_key(|e| e.file_name());
                for e in entries {
                    match RunDir::open(&e.path()).read_manifest() {
                        Ok(m) => println!(
                            "{s}/{:<48} {:<9} {}/{} steps",
                            m.run_id,
                            format!("{:?}", m.status).to_lowercase(),
                            m.steps_done,
                            m.steps_planned
                        ),
                        Err(_) => {
                            println!("{s}/{:<48} (no manifest)", e.file_name().to_string_lossy())
                        }
                    }
                }
            }
            Ok(true)
        }
        RunsCommand::Show {
            suite,
            run_id,
            store,
        } => {
            let dir = run_path(store, suite, run_id)?;
            let m = RunDir::open(&dir).read_manifest()?;
            println!("{}", serde_json::to_string_pretty(&m)?);
            Ok(true)
        }
        RunsCommand::Rm {
            suite,
            run_id,
            store,
        } => {
            let dir = run_path(store, suite, run_id)?;
            std::fs::remove_dir_all(&dir).with_context(|| format!("{}", dir.display()))?;
            println!("removed {}", dir.display());
            Ok(true)
        }
    }
}

/// A run folder from user-given names, refusing anything that could leave the store.
fn run_path(store: &std::path::Path, suite: &str, run_id: &str) -> Result<PathBuf> {
    if let Err(why) = safe_component(run_id) {
        bail!("run id `{run_id}`: {why}");
    }
    Ok(suite_dir(store, suite)?.join(run_id))
}

/// `lockstep ingest --detect DIR`: which preset fits the keys logged under DIR.
fn detect_cmd(dir: &std::path::Path) -> Result<bool> {
    use lockstep::suite::frameworks::detect;
    let keys = lockstep::suite::metrics::keys_under(dir).map_err(anyhow::Error::msg)?;
    if keys.is_empty() {
        bail!(
            "{}: no metric keys found in .jsonl, .csv, TensorBoard or W&B files (with a step key or column)",
            dir.display()
        );
    }
    let d = detect(&keys);
    let Some((best, n)) = d.ranked.first() else {
        println!(
            "no preset places any of the {} keys found; map them yourself in [metrics.map]",
            keys.len()
        );
        return Ok(false);
    };
    println!("preset `{best}` places {n} of {} keys found", keys.len());
    for (other, m) in d.ranked.iter().skip(1) {
        println!("  (`{other}` places {m})");
    }
    for k in &d.unplaced {
        println!("  not placed by `{best}`: {k} (kept under its own name unless you map it)");
    }
    println!(
        "add to the suite's [command.metrics] (or the mapping's [metrics]): preset = \"{best}\""
    );
    Ok(true)
}

#[derive(Debug, Args)]
pub struct IngestArgs {
    /// Folder tree holding runs made elsewhere (e.g. a cluster's output); default: the mapping's
    /// `tree`.
    pub dir: Option<PathBuf>,
    /// Mapping file (TOML): tree, meta_file, path_pattern, [metrics] preset/files/step/map/layers.
    /// See docs/command-engine.md.
    #[arg(long, required_unless_present = "detect")]
    pub mapping: Option<PathBuf>,
    /// Import nothing: read every metrics file (.jsonl, .csv) under DIR and say which framework
    /// preset fits its keys and which keys that preset cannot place.
    #[arg(long)]
    pub detect: bool,
    /// Suite name to file the runs under (default: the folder's name).
    #[arg(long)]
    pub suite: Option<String>,
    /// Run store root.
    #[arg(long, default_value = "runs")]
    pub store: PathBuf,
    /// Re-import runs already in the store.
    #[arg(long)]
    pub force: bool,
}

pub fn ingest_cmd(args: &IngestArgs) -> Result<bool> {
    use lockstep::suite::ingest::{ingest_tree, load_mapping};
    let Some(mapping_file) = &args.mapping else {
        let Some(dir) = &args.dir else {
            bail!("name the folder to look at: lockstep ingest --detect DIR");
        };
        return detect_cmd(dir);
    };
    let mapping = load_mapping(mapping_file)?;
    let Some(dir) = args.dir.clone().or_else(|| mapping.tree.clone()) else {
        bail!(
            "name the folder to import (lockstep ingest DIR --mapping {}) or set tree = \"DIR\" in the mapping",
            mapping_file.display()
        );
    };
    let suite = match &args.suite {
        Some(s) => s.clone(),
        None => dir
            .canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .context("cannot name the suite after the folder; pass --suite NAME")?,
    };
    let s = ingest_tree(
        &dir,
        &mapping,
        &args.store,
        &suite,
        args.force,
        |run, id, new| {
            println!(
                "{} {} seed {} ({}) -> {id}",
                if new { "import" } else { "skip  " },
                run.config,
                run.seed,
                run.rel
            );
        },
    )?;
    println!(
        "{} imported, {} already in the store, {} unreadable metric lines or values skipped (counted per run in manifest extra.skipped_lines); store: {}",
        s.imported,
        s.skipped,
        s.skipped_lines,
        args.store.join(&suite).display()
    );
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockstep::engine::backend::Device;
    use lockstep::engine::backend::cuda::CudaError;

    fn busy(i: usize) -> DeviceError {
        // What a card held in exclusive mode by another process answers.
        let err = cudarc::driver::DriverError(
            cudarc::driver::sys::cudaError_enum::CUDA_ERROR_DEVICE_UNAVAILABLE,
        );
        DeviceError::Cuda {
            device: Device::Cuda(i),
            err: CudaError::Driver(err),
        }
    }

    fn missing(i: usize) -> DeviceError {
        DeviceError::Cuda {
            device: Device::Cuda(i),
            err: CudaError::NoDevice {
                ordinal: i,
                count: 2,
                hint: String::new(),
            },
        }
    }

    #[test]
    fn two_worker_processes_per_gpu_unless_a_card_takes_one_process() {
        let none: Vec<String> = Vec::new();
        let excl = vec!["cuda:1".to_string()];
        assert_eq!(worker_processes(None, true, &none).unwrap(), 2);
        assert_eq!(worker_processes(None, false, &none).unwrap(), 1);
        assert_eq!(worker_processes(None, true, &excl).unwrap(), 1);
        assert_eq!(worker_processes(Some(3), false, &none).unwrap(), 3);
        assert_eq!(worker_processes(Some(1), true, &excl).unwrap(), 1);
        let e = worker_processes(Some(2), true, &excl)
            .unwrap_err()
            .to_string();
        assert!(e.contains("cuda:1") && e.contains("--processes 1"), "{e}");
    }

    #[test]
    fn a_sweep_leaves_out_busy_cards_but_stops_on_a_wrong_name() {
        let (ok, out) = usable_devices(vec![Ok(0), Err(busy(1)), Ok(2)]).unwrap();
        assert_eq!(ok, [0, 2]);
        // (A driver error's text comes from the driver library, absent here: match, not print.)
        assert!(matches!(
            out[..],
            [DeviceError::Cuda {
                device: Device::Cuda(1),
                ..
            }]
        ));
        let e = usable_devices(vec![Ok(0), Err(missing(5))]).unwrap_err();
        assert!(e.to_string().contains("cuda:5 does not exist"), "{e}");
        let e = usable_devices::<u8>(vec![Err(busy(0)), Err(busy(1))]).unwrap_err();
        assert!(matches!(
            e,
            DeviceError::Cuda {
                device: Device::Cuda(0),
                ..
            }
        ));
    }
}

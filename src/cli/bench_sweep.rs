//! `lockstep bench sweep`: a suite's runs through several worker layouts (processes x workers,
//! and runs stepped together per worker) in one call, so the ratios compare like with like on
//! one machine. The warm start is trained
//! (and cached) before the first layout; each layout is a `lockstep run` of its own into a fresh
//! store, timed from start to exit. Prints wall time, run-steps per second, the ratio to the first
//! layout, the GEMM arithmetic per second (`perf/gemm_flops` over the wall time) with the share of
//! the device's FP32 peak it is, and whether every layout's runs hold the first one's metrics bit
//! for bit. On a GPU only runs stepped with the same neighbours in both layouts are compared (the
//! `batch` their manifests list): GEMMs over other batch compositions sum in another order.

use anyhow::{Context, Result, bail};
use clap::Args;
use lockstep::engine::metrics::StepRecord;
use lockstep::suite::{RunSpec, expand, load};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

#[derive(Debug, Args)]
pub struct SweepArgs {
    /// Suite file (TOML) whose runs are swept.
    #[arg(default_value = "suites/nightly.toml")]
    pub suite: PathBuf,
    /// cpu, cuda (every visible GPU) or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Layouts to time, `PxJ` = P worker processes per device with J workers each, `PxJbN` with
    /// each worker stepping up to N runs together (`--batch-runs N`); on a GPU a layout may end
    /// in `:held` or `:host` to keep the runs' training state there whatever the batch
    /// (LOCKSTEP_HELD_STATE). Default: on the CPU 1xN, N = cores; on GPUs the worker pool of one
    /// run a worker with host state (2x4:host, the default before runs were batched), `lockstep
    /// run`'s default (1x2b16), then 1x1 with 1, 8, 32 and 128 runs batched.
    #[arg(long, value_delimiter = ',')]
    pub layouts: Vec<String>,
}

/// `P` processes per device, `J` workers each, each worker stepping up to `batch` runs together;
/// `held`: the runs' training state kept on the GPU (`Some(true)`) or the host, where the
/// layout says (else the device's default for the batch).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Layout {
    processes: usize,
    workers: usize,
    batch: usize,
    held: Option<bool>,
}

impl Layout {
    const fn new(processes: usize, workers: usize, batch: usize) -> Layout {
        Layout {
            processes,
            workers,
            batch,
            held: None,
        }
    }
}

impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}x{}", self.processes, self.workers)?;
        if self.batch > 1 {
            write!(f, "b{}", self.batch)?;
        }
        match self.held {
            Some(true) => write!(f, ":held"),
            Some(false) => write!(f, ":host"),
            None => Ok(()),
        }
    }
}

fn parse_layout(s: &str) -> Result<Layout> {
    let (t, held) = match s.trim().split_once(':') {
        Some((t, "held")) => (t, Some(Some(true))),
        Some((t, "host")) => (t, Some(Some(false))),
        Some((t, _)) => (t, None),
        None => (s.trim(), Some(None)),
    };
    let (pool, batch) = match t.split_once('b') {
        Some((pool, n)) => (pool, n.parse().ok()),
        None => (t, Some(1)),
    };
    let parsed = pool
        .split_once('x')
        .and_then(|(p, j)| Some((p.parse().ok()?, j.parse().ok()?, batch?, held?)));
    match parsed {
        Some((p, j, n, held)) if p > 0 && j > 0 && n > 0 => Ok(Layout {
            held,
            ..Layout::new(p, j, n)
        }),
        _ => bail!(
            "layout `{s}`: use PxJ (P processes per device of J workers each, e.g. 2x4) or PxJbN \
             (each worker stepping N runs together, e.g. 1x1b32), optionally ending in :held or \
             :host (the runs' training state kept on the GPU or the host, e.g. 1x1b32:held)"
        ),
    }
}

pub fn sweep(args: &SweepArgs) -> Result<bool> {
    let s = load(&args.suite)?;
    if s.engine != "builtin" {
        bail!(
            "bench sweep times the built-in engine; suite `{}` uses the {} engine",
            s.name,
            s.engine
        );
    }
    let runs = expand(&s)?;
    let devices = lockstep::engine::backend::sweep_devices(&args.device)?;
    let on_gpu = devices
        .iter()
        .any(|d| *d != lockstep::engine::backend::Device::Cpu);
    let layouts: Vec<Layout> = if args.layouts.is_empty() {
        if on_gpu {
            vec![
                Layout {
                    held: Some(false),
                    ..Layout::new(2, 4, 1)
                },
                Layout::new(1, 2, 16),
                Layout::new(1, 1, 1),
                Layout::new(1, 1, 8),
                Layout::new(1, 1, 32),
                Layout::new(1, 1, 128),
            ]
        } else {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            vec![Layout::new(1, cores, 1)]
        }
    } else {
        args.layouts
            .iter()
            .map(|l| parse_layout(l))
            .collect::<Result<_>>()?
    };
    if let Some(l) = layouts.iter().find(|l| l.held.is_some() && !on_gpu) {
        bail!(
            "layout `{l}`: only a GPU holds training state; drop the `:held`/`:host` ending \
             or sweep with --device cuda"
        );
    }
    let tmp = Scratch::new()?;
    let cache = tmp.path().join("cache");
    let t0 = Instant::now();
    let first_device = *devices
        .first()
        .context("no device to train the warm start on")?;
    let be = lockstep::engine::backend::open(first_device)?;
    prime_warm_starts(&runs, be.as_ref(), &cache)?;
    // Every device of a sweep is taken to be the first one's kind.
    let peak = be.fp32_peak_flops().map(|p| p * devices.len() as f64);
    drop(be);
    let run_steps: usize = runs.iter().map(|r| r.run.steps).sum();
    println!(
        "suite {}: {} runs, {run_steps} run-steps on {}; warm start trained and cached in {:.1} s",
        s.name,
        runs.len(),
        args.device,
        t0.elapsed().as_secs_f64()
    );
    println!(
        "{:<12} {:>9} {:>14} {:>9} {:>13}  metrics",
        "layout", "wall", "run-steps/s", "vs first", "GEMM GFLOP/s"
    );
    let mut first: Option<(f64, PathBuf)> = None;
    let mut all_ok = true;
    let mut best_gflops: f64 = 0.0;
    for (i, l) in layouts.iter().enumerate() {
        // A store per entry: a layout listed twice is timed twice, not skipped as finished.
        let store = tmp.path().join(format!("{i}-{l}"));
        let secs = time_run(&args.suite, &store, &args.device, *l, devices.len(), &cache)?;
        let same = match &first {
            None => "reference".to_string(),
            Some((_, reference)) => match same_metrics(&runs, &s.name, reference, &store, on_gpu) {
                Ok(c) => c.to_string(),
                Err(why) => {
                    all_ok = false;
                    format!("DIFFER: {why}")
                }
            },
        };
        let ratio = first.as_ref().map_or(1.0, |(f, _)| f / secs);
        let gflops = gemm_flops(&runs, &s.name, &store)? / secs / 1e9;
        println!(
            "{:<12} {:>8.1}s {:>14.1} {:>8.2}x {:>13.1}  {same}",
            l.to_string(),
            secs,
            run_steps as f64 / secs,
            ratio,
            gflops
        );
        best_gflops = best_gflops.max(gflops);
        first.get_or_insert((secs, store));
    }
    match peak {
        Some(p) => println!(
            "GEMM FLOPs from the model's shapes and the rows each step ran (attention, norms and quantizers left out): the best layout reaches {:.2} % of the FP32 peak ({:.1} TFLOP/s)",
            100.0 * best_gflops * 1e9 / p,
            p / 1e12
        ),
        None => println!(
            "GEMM FLOPs from the model's shapes and the rows each step ran (attention, norms and quantizers left out); no FP32 peak is known for {}",
            args.device
        ),
    }
    Ok(all_ok)
}

/// The GEMM FLOPs every run's steps in `store` recorded (`perf/gemm_flops`).
fn gemm_flops(runs: &[RunSpec], suite: &str, store: &Path) -> Result<f64> {
    let mut total = 0.0;
    for r in runs {
        let dir = store.join(suite).join(&r.run_id);
        let steps = lockstep::store::RunDir::open(&dir).read_scalars()?;
        total += steps
            .iter()
            .filter_map(|rec| rec.get("perf/gemm_flops"))
            .sum::<f64>();
    }
    Ok(total)
}

/// A scratch folder for the sweeps' stores and cache, removed when the benchmark ends.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Result<Scratch> {
        let p = std::env::temp_dir().join(format!("lockstep-bench-sweep-{}", std::process::id()));
        std::fs::create_dir_all(&p).with_context(|| format!("{}", p.display()))?;
        Ok(Scratch(p))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Train every warm start the runs need into `cache`, so no layout's time includes one.
fn prime_warm_starts(
    runs: &[RunSpec],
    be: &dyn lockstep::engine::backend::Backend,
    cache: &Path,
) -> Result<()> {
    let mut done = std::collections::BTreeSet::new();
    for r in runs {
        let key = lockstep::engine::warmstart::key(&r.run.model, r.run.task, &r.run.warm_start);
        if done.insert(key) {
            lockstep::engine::warmstart::warm_start(
                be,
                &r.run.model,
                r.run.task,
                &r.run.warm_start,
                Some(cache),
                |_| {},
            )?;
        }
    }
    Ok(())
}

/// Seconds a `lockstep run` of `suite` into `store` takes with layout `l`, all of its runs ok.
fn time_run(
    suite: &Path,
    store: &Path,
    device: &str,
    l: Layout,
    devices: usize,
    cache: &Path,
) -> Result<f64> {
    let exe = std::env::current_exe().context("cannot find the lockstep binary")?;
    let jobs = l.processes * l.workers * devices;
    let t0 = Instant::now();
    let mut cmd = Command::new(exe);
    if let Some(held) = l.held {
        cmd.env(
            lockstep::engine::backend::cuda::backend::HELD_STATE_VAR,
            if held { "on" } else { "off" },
        );
    }
    let out = cmd
        .arg("run")
        .arg(suite)
        .arg("--store")
        .arg(store)
        .args(["--device", device])
        .args(["--jobs", &jobs.to_string()])
        .args(["--processes", &l.processes.to_string()])
        .args(["--batch-runs", &l.batch.to_string()])
        .env("LOCKSTEP_CACHE", cache)
        .output()
        .context("cannot start lockstep run")?;
    let secs = t0.elapsed().as_secs_f64();
    if !out.status.success() {
        let text = String::from_utf8_lossy(&out.stdout);
        let err = String::from_utf8_lossy(&out.stderr);
        let last = text
            .lines()
            .chain(err.lines())
            .rfind(|l| !l.trim().is_empty());
        bail!(
            "layout {l}: lockstep run failed ({}): {}",
            out.status,
            last.unwrap_or("no output")
        );
    }
    // A timing over runs found finished would be meaningless: every run must have run.
    let text = String::from_utf8_lossy(&out.stdout);
    let skipped = text
        .lines()
        .filter(|l| l.starts_with("done in"))
        .flat_map(|l| l.split(", "))
        .find_map(|part| part.strip_suffix(" skipped")?.parse::<usize>().ok());
    if skipped != Some(0) {
        bail!("layout {l}: the sweep did not run every run (skipped: {skipped:?})");
    }
    Ok(secs)
}

/// Every run's step records in `b` hold `a`'s values bit for bit (wall-clock `perf/` aside).
/// How many runs of a layout were compared with the first layout's, and how many were not
/// (stepped with other neighbours on a GPU).
#[derive(Debug, PartialEq)]
struct Compared {
    same: usize,
    other_neighbours: usize,
}

impl std::fmt::Display for Compared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.same, self.other_neighbours) {
            (_, 0) => write!(f, "identical"),
            (0, _) => write!(
                f,
                "not compared (batched on a GPU with other neighbours: another GEMM order)"
            ),
            (s, o) => write!(
                f,
                "identical ({s} runs; {o} batched with other neighbours not compared)"
            ),
        }
    }
}

/// Whether every run of `runs` holds the same deterministic metrics in stores `a` and `b`; on a
/// GPU (`by_neighbours`) only runs stepped with the same neighbours in both are compared. The
/// error names the first run that differs, and where.
fn same_metrics(
    runs: &[RunSpec],
    suite: &str,
    a: &Path,
    b: &Path,
    by_neighbours: bool,
) -> Result<Compared, String> {
    let dir = |store: &Path, id: &str| lockstep::store::RunDir::open(&store.join(suite).join(id));
    let read = |store: &Path, id: &str| dir(store, id).read_scalars().map_err(|e| e.to_string());
    let neighbours = |store: &Path, id: &str| -> Result<Vec<String>, String> {
        let m = dir(store, id).read_manifest().map_err(|e| e.to_string())?;
        Ok(batch_of(&m))
    };
    let mut c = Compared {
        same: 0,
        other_neighbours: 0,
    };
    for r in runs {
        if by_neighbours && neighbours(a, &r.run_id)? != neighbours(b, &r.run_id)? {
            c.other_neighbours += 1;
            continue;
        }
        let (x, y) = (read(a, &r.run_id)?, read(b, &r.run_id)?);
        if let Some(at) = first_difference(&x, &y) {
            return Err(format!("{} seed {}: {at}", r.config, r.seed));
        }
        c.same += 1;
    }
    Ok(c)
}

/// The runs a run was stepped with (itself included), as its manifest lists them; a run stepped
/// alone lists none.
fn batch_of(m: &lockstep::store::Manifest) -> Vec<String> {
    match m.extra.get(lockstep::suite::builtin::BATCH_KEY) {
        Some(serde_json::Value::Array(ids)) => ids
            .iter()
            .map(|v| v.as_str().unwrap_or_default().to_string())
            .collect(),
        _ => vec![m.run_id.clone()],
    }
}

/// Where two runs' deterministic metrics first part: the step and the metric, or the step count.
fn first_difference(x: &[StepRecord], y: &[StepRecord]) -> Option<String> {
    if x.len() != y.len() {
        return Some(format!("{} steps against {}", y.len(), x.len()));
    }
    x.iter().zip(y).enumerate().find_map(|(step, (p, q))| {
        let (p, q) = (p.deterministic_scalars(), q.deterministic_scalars());
        if p == q {
            return None;
        }
        let names: std::collections::BTreeSet<&String> = p.keys().chain(q.keys()).collect();
        let name = names.into_iter().find(|k| p.get(*k) != q.get(*k))?;
        let value =
            |m: &std::collections::BTreeMap<String, u64>| m.get(name).map(|b| f64::from_bits(*b));
        Some(format!(
            "step {step}, {name} {:?} against {:?}",
            value(&q),
            value(&p)
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_difference_is_named_by_step_and_metric_and_runs_of_other_neighbours_are_counted() {
        let rec = |step: usize, reward: f64, time: f64| {
            let mut r = StepRecord {
                step,
                ..Default::default()
            };
            r.set("rollout/raw_reward", reward);
            r.set("perf/step_time", time);
            r
        };
        let a = [rec(0, 0.5, 1.0), rec(1, 0.25, 1.0)];
        // Times differ run to run and are not compared.
        assert_eq!(
            first_difference(&a, &[rec(0, 0.5, 2.0), rec(1, 0.25, 3.0)]),
            None
        );
        assert_eq!(
            first_difference(&a, &[rec(0, 0.5, 1.0), rec(1, 0.375, 1.0)]).unwrap(),
            "step 1, rollout/raw_reward Some(0.375) against Some(0.25)"
        );
        assert_eq!(first_difference(&a, &a[..1]).unwrap(), "1 steps against 2");
        let c = |same, other_neighbours| {
            Compared {
                same,
                other_neighbours,
            }
            .to_string()
        };
        assert_eq!(c(30, 0), "identical");
        assert!(c(0, 30).starts_with("not compared"), "{}", c(0, 30));
        assert!(
            c(24, 6).starts_with("identical (24 runs; 6 "),
            "{}",
            c(24, 6)
        );

        let mut m =
            lockstep::store::Manifest::start("r1", "builtin", serde_json::json!({}), 0, 1, "cpu");
        assert_eq!(batch_of(&m), ["r1"], "a run alone is its own batch");
        m.extra
            .insert("batch".into(), serde_json::json!(["r0", "r1"]));
        assert_eq!(batch_of(&m), ["r0", "r1"]);
    }

    #[test]
    fn layouts_parse_and_bad_ones_say_the_form() {
        assert_eq!(parse_layout("2x4").unwrap(), Layout::new(2, 4, 1));
        assert_eq!(parse_layout("1x1b32").unwrap(), Layout::new(1, 1, 32));
        assert_eq!(Layout::new(1, 1, 32).to_string(), "1x1b32");
        assert_eq!(Layout::new(2, 4, 1).to_string(), "2x4");
        for (text, held) in [("1x1b32:held", true), ("2x4:host", false)] {
            let l = parse_layout(text).unwrap();
            assert_eq!(l.held, Some(held));
            assert_eq!(l.to_string(), text);
        }
        for bad in [
            "2",
            "0x4",
            "2x0",
            "ax4",
            "2x4x1",
            "1x1b0",
            "1x1b",
            "b8",
            "1x1b8:gpu",
            "1x1:",
        ] {
            let e = parse_layout(bad).unwrap_err().to_string();
            assert!(e.contains("use PxJ"), "{bad}: {e}");
        }
    }
}

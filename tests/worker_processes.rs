//! `lockstep run --processes N`: a sweep split over worker processes gives the runs one process
//! gives, a worker that dies fails its runs and the sweep, and every worker stops when the sweep
//! is stopped or its parent is killed. On the CPU engine (the split is the same on GPUs, where it
//! is the default).

mod common;
use common::gone_within;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const EXE: &str = env!("CARGO_BIN_EXE_lockstep");

/// Two configurations x two seeds of the tiny model, `steps` steps each.
fn suite(dir: &Path, steps: usize) -> std::path::PathBuf {
    let text = format!(
        "name = \"wp\"\nseeds = [0, 1]\n[workload]\nmodel = \"tiny\"\nsteps = {steps}\n\
         prompts_per_step = 4\nsamples_per_prompt = 2\n[workload.warm_start]\nmax_steps = 60\n\
         eval_prompts = 8\n[[configs]]\nname = \"bf16\"\nrecipe = \"bf16\"\n[[configs]]\n\
         name = \"mxfp8\"\nrecipe = \"mxfp8\"\n"
    );
    let p = dir.join("wp.toml");
    std::fs::write(&p, text).unwrap();
    p
}

fn lockstep(dir: &Path) -> Command {
    let mut c = Command::new(EXE);
    c.current_dir(dir).env("LOCKSTEP_CACHE", dir.join("cache"));
    c
}

/// Run `c`, assert it exited 0 (showing both streams if not), and return its standard output.
fn succeeds(c: &mut Command) -> String {
    let out = c.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// Every run's step records without the wall-clock `perf/` values, as bits, by run folder.
fn metrics(store: &Path) -> Vec<(String, Vec<BTreeMap<String, u64>>)> {
    lockstep::store::run_dirs(&store.join("wp"))
        .unwrap()
        .into_iter()
        .map(|d| {
            let steps = lockstep::store::RunDir::open(&d)
                .read_scalars()
                .unwrap()
                .iter()
                .map(|r| r.deterministic_scalars())
                .collect();
            (d.file_name().unwrap().to_string_lossy().into_owned(), steps)
        })
        .collect()
}

#[test]
fn worker_processes_make_the_runs_one_process_makes() {
    let tmp = tempfile::tempdir().unwrap();
    let s = suite(tmp.path(), 3);
    let run = |store: &str, processes: &str| {
        succeeds(
            lockstep(tmp.path())
                .args(["run", s.to_str().unwrap(), "--store", store, "--jobs", "2"])
                .args(["--processes", processes]),
        )
    };
    let split = run("split", "2");
    assert!(split.contains("2 workers in 2 processes on cpu"), "{split}");
    assert_eq!(split.matches("worker process ").count(), 2, "{split}");
    assert!(
        split.contains("[4/4]"),
        "one board counts every process's runs: {split}"
    );
    assert!(
        split.contains("done in") && split.contains(": 4 ok, 0 skipped, 0 failed"),
        "{split}"
    );
    run("one", "1");
    let again = run("split", "2");
    assert!(
        again.contains(": 0 ok, 4 skipped") && !again.contains("worker process"),
        "a rerun skips finished runs without starting workers: {again}"
    );
    let (a, b) = (
        metrics(&tmp.path().join("split")),
        metrics(&tmp.path().join("one")),
    );
    assert_eq!(a.len(), 4);
    assert_eq!(a, b, "the same bits in worker processes and in one process");
    let warm: Vec<_> = std::fs::read_dir(tmp.path().join("cache"))
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
        .collect();
    assert_eq!(warm.len(), 1, "one warm start, shared");
    // Trained by one process; the other waited for it and loaded it.
    let trained = std::fs::read_dir(tmp.path().join("split").join("wp"))
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_dir())
        .filter(|e| {
            let m = lockstep::store::RunDir::open(&e.path())
                .read_manifest()
                .unwrap();
            m.extra["warm_start"]["cached"] == serde_json::Value::Bool(false)
        })
        .count();
    assert_eq!(trained, 1, "the warm start was trained {trained} times");
}

/// Start a sweep in 2 worker processes; returns it and the workers' pids once both are computing.
fn start_split_sweep(dir: &Path) -> (Child, Vec<String>, std::sync::mpsc::Receiver<String>) {
    let s = suite(dir, 100_000);
    let mut child = lockstep(dir)
        .args(["run", s.to_str().unwrap(), "--store", "runs", "--jobs", "2"])
        .args(["--processes", "2"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    for pipe in [
        Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
        Box::new(child.stderr.take().unwrap()),
    ] {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
    }
    // Both workers computing: step lines of two runs (each worker's first run).
    let (mut pids, mut stepping) = (Vec::new(), std::collections::BTreeSet::new());
    let t0 = Instant::now();
    while stepping.len() < 2 {
        let line = rx
            .recv_timeout(Duration::from_secs(120).saturating_sub(t0.elapsed()))
            .expect("the sweep starts computing");
        if let Some(rest) = line.strip_prefix("worker process ") {
            pids.push(rest.split_whitespace().next().unwrap().to_string());
        }
        if let Some((run, _)) = line.split_once(" step ") {
            stepping.insert(run.trim().to_string());
        }
    }
    assert_eq!(pids.len(), 2);
    (child, pids, rx)
}

/// The lines still to come from the sweep's output: read until both pipes close (the readers
/// stop at end of file once the sweep and its workers are gone) or `limit` passes. A sweep that
/// has exited may not have had its last lines read yet.
fn rest_of(rx: &std::sync::mpsc::Receiver<String>, limit: Duration) -> Vec<String> {
    let t0 = Instant::now();
    let mut lines = Vec::new();
    while let Ok(line) = rx.recv_timeout(limit.saturating_sub(t0.elapsed())) {
        lines.push(line);
    }
    lines
}

fn wait(child: &mut Child, limit: Duration) -> std::process::ExitStatus {
    let t0 = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        assert!(
            t0.elapsed() < limit,
            "the sweep did not end within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn signal(pid: &str, sig: libc::c_int) {
    // SAFETY: kill only sends a signal, to a process this test started (or its child).
    unsafe {
        libc::kill(pid.parse().unwrap(), sig);
    }
}

#[test]
fn a_worker_that_dies_fails_its_runs_and_the_sweep() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut sweep, pids, rx) = start_split_sweep(tmp.path());
    signal(&pids[0], libc::SIGKILL);
    // Reported as soon as it is gone; the other worker's runs (100,000 steps) are then stopped.
    let reported = format!("worker process {} on cpu ended", pids[0]);
    let mut seen = Vec::new();
    while !seen.iter().any(|l: &String| l.contains(&reported)) {
        seen.push(
            rx.recv_timeout(Duration::from_secs(60))
                .unwrap_or_else(|_| panic!("no report of the dead worker: {}", seen.join("\n"))),
        );
    }
    signal(&sweep.id().to_string(), libc::SIGTERM);
    let status = wait(&mut sweep, Duration::from_secs(120));
    seen.extend(rest_of(&rx, Duration::from_secs(30)));
    let all = seen.join("\n");
    assert!(!status.success(), "{all}");
    assert!(all.contains(&reported), "{all}");
    // The dead worker's run in flight failed and its next one never ran; the other worker's
    // run in flight was interrupted (its next one, never started, is not counted).
    assert!(
        all.contains("1 failed") && all.contains("1 interrupted") && all.contains("1 not run"),
        "{all}"
    );
}

#[test]
fn stopping_the_sweep_stops_every_worker() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut sweep, pids, rx) = start_split_sweep(tmp.path());
    signal(&sweep.id().to_string(), libc::SIGTERM);
    let status = wait(&mut sweep, Duration::from_secs(120));
    let all = rest_of(&rx, Duration::from_secs(30));
    assert_eq!(status.code(), Some(143), "{}", all.join("\n"));
    for pid in &pids {
        assert!(
            gone_within(pid, Duration::from_secs(5)),
            "worker {pid} left running"
        );
    }
    assert!(
        all.iter().any(|l| l.contains("2 interrupted")),
        "{}",
        all.join("\n")
    );
}

#[test]
fn workers_stop_when_their_parent_is_killed() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut sweep, pids, _rx) = start_split_sweep(tmp.path());
    sweep.kill().unwrap(); // SIGKILL: no chance to pass anything on
    sweep.wait().unwrap();
    for pid in &pids {
        assert!(
            gone_within(pid, Duration::from_secs(60)),
            "worker {pid} outlived its parent"
        );
    }
}

#[test]
fn bench_sweep_times_each_layout_and_checks_their_metrics() {
    let tmp = tempfile::tempdir().unwrap();
    let s = suite(tmp.path(), 2);
    let text = succeeds(lockstep(tmp.path()).args([
        "bench",
        "sweep",
        s.to_str().unwrap(),
        "--layouts",
        "1x1,2x1,1x1",
    ]));
    assert!(text.contains("4 runs, 8 run-steps on cpu"), "{text}");
    let rows: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("1x1 ") || l.starts_with("2x1 "))
        .collect();
    // A layout listed twice runs twice (each layout must run every run, or the bench fails).
    assert_eq!(rows.len(), 3, "{text}");
    assert!(rows[0].ends_with("reference"), "{text}");
    assert!(rows[1..].iter().all(|r| r.ends_with("identical")), "{text}");
    // The GEMM rate column: the runs recorded their arithmetic, so it is positive.
    let gflops: Vec<f64> = rows
        .iter()
        .map(|r| r.split_whitespace().nth(4).unwrap().parse().unwrap())
        .collect();
    assert!(gflops.iter().all(|t| *t > 0.0), "{text}");
    let bad = lockstep(tmp.path())
        .args(["bench", "sweep", s.to_str().unwrap(), "--layouts", "2"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("use PxJ"));
}

#[test]
fn no_more_processes_than_workers() {
    let tmp = tempfile::tempdir().unwrap();
    let s = suite(tmp.path(), 1);
    let out = lockstep(tmp.path())
        .args([
            "run",
            s.to_str().unwrap(),
            "--jobs",
            "1",
            "--processes",
            "2",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("1 workers on cpu") && !text.contains("worker process"),
        "one worker runs in this process: {text}"
    );
}

#[test]
fn command_engine_suites_run_in_worker_processes_too() {
    let tmp = tempfile::tempdir().unwrap();
    let script = tmp.path().join("launch.sh");
    std::fs::write(
        &script,
        "#!/usr/bin/env bash\nfor i in 0 1 2; do echo \"{\\\"step\\\": $i, \\\"rollout/raw_reward\\\": 0.5}\" >> \"$2/metrics.jsonl\"; done\n[ \"$1\" = ok ] || { echo boom >&2; exit 3; }\n",
    )
    .unwrap();
    let text = format!(
        "name = \"cmd\"\nengine = \"command\"\nseeds = [0, 1]\n[workload]\nmodel = \"tiny\"\nsteps = 3\n\
         [command]\nargv = [\"bash\", \"{}\", \"{{mode}}\", \"{{out_dir}}\"]\n\
         [command.metrics]\nfiles = [\"metrics.jsonl\"]\nstep = \"step\"\n\
         [[configs]]\nname = \"ok\"\nrecipe = \"bf16\"\n[configs.vars]\nmode = \"ok\"\n\
         [[configs]]\nname = \"bad\"\nrecipe = \"mxfp8\"\n[configs.vars]\nmode = \"bad\"\n",
        script.display()
    );
    let s = tmp.path().join("cmd.toml");
    std::fs::write(&s, text).unwrap();
    let out = lockstep(tmp.path())
        .args([
            "run",
            s.to_str().unwrap(),
            "--jobs",
            "2",
            "--processes",
            "2",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("in 2 processes"), "{stdout}");
    assert!(stdout.contains(": 2 ok, 0 skipped, 2 failed"), "{stdout}");
    assert!(
        stdout.contains("Failed bad seed 0: exit code 3"),
        "the failure says why: {stdout}"
    );
}

#[test]
fn bench_step_times_runs_stepped_together() {
    let tmp = tempfile::tempdir().unwrap();
    let text = succeeds(lockstep(tmp.path()).args([
        "bench",
        "step",
        "--model",
        "tiny",
        "--steps",
        "1",
        "--batch-runs",
        "1,3",
    ]));
    // One line per N: the step of all N runs, and per run-step that time over N.
    for (n, label) in [(1.0, "cpu 1 run alone"), (3.0, "cpu 3 runs together")] {
        let line = text
            .lines()
            .find(|l| l.trim_start().starts_with(label))
            .unwrap_or_else(|| panic!("no line for {label}: {text}"));
        let before = |marker: &str| -> f64 {
            let head = line.split(marker).next().unwrap();
            head.split_whitespace().last().unwrap().parse().unwrap()
        };
        let (step, per_run) = (before(" ms for "), before(" ms a run-step"));
        assert!(step > 0.0, "{line}");
        assert!((per_run - step / n).abs() <= 0.01 + 1e-3 * step, "{line}");
    }
    let bad = lockstep(tmp.path())
        .args(["bench", "step", "--batch-runs", "0"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
}

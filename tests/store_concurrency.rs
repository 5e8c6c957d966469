//! Issue 4 acceptance for the run store: two `lockstep run` processes on one store never run a
//! run twice or corrupt it, and a process killed mid-sweep loses nothing finished: the rerun skips
//! what finished and redoes only what was cut short.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const SUITE: &str = r#"name = "pair"
engine = "builtin"
seeds = [0, 1]

[workload]
model = "tiny"
task = "add:2"
prompts_per_step = 4
samples_per_prompt = 4
max_response_tokens = 4
steps = 6

[[configs]]
name = "bf16"
recipe = "bf16"

[[configs]]
name = "mxfp8"
recipe = "mxfp8"
"#;

fn lockstep(dir: &Path, store: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_lockstep"));
    c.args(["run", "pair.toml", "--jobs", "1", "--store"])
        .arg(store)
        .current_dir(dir)
        .env("LOCKSTEP_CACHE", dir.join("cache"));
    c
}

fn run_dirs(store: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(store.join("pair"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    v.sort();
    v
}

fn status(run: &Path) -> Option<String> {
    let m = std::fs::read_to_string(run.join("manifest.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&m).ok()?;
    v["status"].as_str().map(String::from)
}

fn setup() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("pair.toml"), SUITE).unwrap();
    // Warm start once, so both processes below start from the cached checkpoint.
    let out = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args([
            "run-one", "--model", "tiny", "--task", "add:2", "--steps", "1", "--out",
        ])
        .arg(tmp.path().join("warm"))
        .env("LOCKSTEP_CACHE", tmp.path().join("cache"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let store = tmp.path().join("runs");
    (tmp, store)
}

fn wait(c: Child) -> String {
    let out = c.wait_with_output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn two_processes_on_one_store_run_each_run_exactly_once() {
    let (tmp, store) = setup();
    let spawn = || {
        lockstep(tmp.path(), &store)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (spawn(), spawn());
    let (out_a, out_b) = (wait(a), wait(b));
    let dirs = run_dirs(&store);
    assert_eq!(dirs.len(), 4, "{dirs:?}");
    for d in &dirs {
        assert_eq!(status(d).as_deref(), Some("ok"), "{}", d.display());
    }
    let starts = |o: &str| o.lines().filter(|l| l.contains("] start ")).count();
    assert_eq!(
        starts(&out_a) + starts(&out_b),
        4,
        "every run started exactly once over both processes\nA:\n{out_a}\nB:\n{out_b}"
    );
    let leftovers: Vec<_> = std::fs::read_dir(store.join("pair"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".lock") || n.contains("tmp"))
        .collect();
    assert!(leftovers.is_empty(), "left behind: {leftovers:?}");
}

#[test]
fn a_killed_sweep_resumes_without_losing_or_redoing_finished_runs() {
    let (tmp, store) = setup();
    let mut a = lockstep(tmp.path(), &store)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    // Kill it as soon as one run has finished and another has started.
    let t0 = Instant::now();
    let finished = loop {
        assert!(t0.elapsed() < Duration::from_secs(120), "no run finished");
        if store.join("pair").is_dir() {
            let dirs = run_dirs(&store);
            let done: Vec<_> = dirs
                .iter()
                .filter(|d| status(d).as_deref() == Some("ok"))
                .cloned()
                .collect();
            if !done.is_empty() && dirs.len() > done.len() {
                break done;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    a.kill().unwrap();
    a.wait().unwrap();
    let before: Vec<(PathBuf, Vec<u8>)> = finished
        .iter()
        .map(|d| (d.clone(), std::fs::read(d.join("scalars.parquet")).unwrap()))
        .collect();
    let out = wait(
        lockstep(tmp.path(), &store)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let dirs = run_dirs(&store);
    assert_eq!(dirs.len(), 4);
    assert!(dirs.iter().all(|d| status(d).as_deref() == Some("ok")));
    let skips = out.lines().filter(|l| l.contains("] skip ")).count();
    assert_eq!(skips, finished.len(), "finished runs are skipped:\n{out}");
    for (d, bytes) in before {
        assert_eq!(
            std::fs::read(d.join("scalars.parquet")).unwrap(),
            bytes,
            "a finished run was rewritten: {}",
            d.display()
        );
    }
}

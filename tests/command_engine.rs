//! Issue 4 acceptance for the command engine: a small script that behaves like an RL framework's
//! launcher (writes metrics over time, can fail, can hang) is run through `lockstep run`, and the
//! store must say what happened: metrics ingested with junk lines counted, exit code and stderr tail
//! for a failure, `timeout` (and the whole process group killed) for a hang, and values that look
//! like shell code passed as plain argv.

mod common;
use common::gone_within;
use std::path::Path;
use std::process::Command;

const LAUNCHER: &str = r#"#!/usr/bin/env bash
# Fake launcher: MODE STEPS OUT_DIR MARKER
mode="$1"; steps="$2"; out="$3"; marker="$4"
echo "argv4=$marker" > "$out/argv.txt"
for ((i = 0; i < steps; i++)); do
  echo "{\"step\": $i, \"rollout/raw_reward\": 0.$i, \"grad/global_norm\": 1.5, \"note\": \"x\"}" >> "$out/metrics.jsonl"
  sleep 0.05
done
echo "this is not json" >> "$out/metrics.jsonl"
echo '{"step": 99, "rollout/raw_reward": "NaN-ish"}' >> "$out/metrics.jsonl"
case "$mode" in
  fail) echo "RuntimeError: CUDA out of memory" >&2; exit 3 ;;
  hang) sleep 300 & echo $! > "$out/child.pid"; wait ;;
esac
"#;

fn suite(dir: &Path) -> std::path::PathBuf {
    let script = dir.join("launch.sh");
    std::fs::write(&script, LAUNCHER).unwrap();
    let text = format!(
        r#"name = "fake-cluster"
engine = "command"
seeds = [0]

[workload]
model = "tiny"
task = "add:2"
steps = 4

[command]
argv = ["bash", "{script}", "{{mode}}", "{{steps}}", "{{out_dir}}", "{{marker}}"]
timeout_s = 3

[command.metrics]
files = ["metrics.jsonl"]
step = "step"
[command.metrics.map]
"grad/global_norm" = "train/grad_norm"

[[configs]]
name = "ok"
recipe = "bf16"
[configs.vars]
mode = "ok"
marker = "$(touch PWNED); rm -rf x"

[[configs]]
name = "fail"
recipe = "nvfp4-dq"
[configs.vars]
mode = "fail"
marker = "m"

[[configs]]
name = "hang"
recipe = "mxfp8"
[configs.vars]
mode = "hang"
marker = "m"
"#,
        script = script.display()
    );
    let p = dir.join("fake.toml");
    std::fs::write(&p, text).unwrap();
    p
}

fn manifest(store: &Path, config: &str) -> (serde_json::Value, std::path::PathBuf) {
    let suite = store.join("fake-cluster");
    for e in std::fs::read_dir(&suite).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir()
            && p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with(&format!("{config}-s0-"))
        {
            let m = std::fs::read_to_string(p.join("manifest.json")).unwrap();
            return (serde_json::from_str(&m).unwrap(), p);
        }
    }
    panic!("no run folder for {config}");
}

#[test]
fn a_launcher_that_succeeds_fails_or_hangs_is_recorded_as_such() {
    let tmp = tempfile::tempdir().unwrap();
    let suite = suite(tmp.path());
    let store = tmp.path().join("runs");
    let out = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(["run", suite.to_str().unwrap(), "--store"])
        .arg(&store)
        .args(["--jobs", "3"])
        .current_dir(tmp.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(1),
        "failed runs make `run` exit 1\n{stdout}"
    );

    // Success: every step ingested, names mapped, junk counted, never turned into zeros.
    let (m, dir) = manifest(&store, "ok");
    assert_eq!(m["status"], "ok", "{m}");
    assert_eq!(m["steps_done"], 4);
    assert_eq!(m["extra"]["exit_code"], 0);
    assert_eq!(
        m["extra"]["skipped_lines"], 6,
        "four string `note` values, a non-JSON line and a non-numeric reward: {m}"
    );
    let recs = lockstep::store::RunDir::open(&dir).read_scalars().unwrap();
    assert_eq!(recs.len(), 4, "step 99 had no numeric value, so no row");
    assert_eq!(recs[3].get("rollout/raw_reward"), Some(0.3));
    assert_eq!(recs[3].get("train/grad_norm"), Some(1.5));
    assert_eq!(recs[3].get("note"), None);
    // The shell-looking value arrived as one plain argument and ran nothing.
    let argv = std::fs::read_to_string(dir.join("out/argv.txt")).unwrap();
    assert_eq!(argv.trim(), "argv4=$(touch PWNED); rm -rf x");
    assert!(!tmp.path().join("PWNED").exists());
    assert!(!dir.join("out/PWNED").exists());

    // Failure: exit code and the tail of stderr in the manifest, metrics so far kept.
    let (m, _) = manifest(&store, "fail");
    assert_eq!(m["status"], "failed");
    assert_eq!(m["extra"]["exit_code"], 3);
    assert!(
        m["extra"]["stderr_tail"]
            .as_str()
            .unwrap()
            .contains("CUDA out of memory")
    );
    assert_eq!(m["steps_done"], 4);

    // Hang: timeout, and the launcher's own child was killed with it.
    let (m, dir) = manifest(&store, "hang");
    assert_eq!(m["status"], "timeout", "{m}");
    assert!(m["error"].as_str().unwrap().contains("timed out"));
    let pid = std::fs::read_to_string(dir.join("out/child.pid")).unwrap();
    assert!(
        gone_within(pid.trim(), std::time::Duration::from_secs(5)),
        "the hung launcher's child process survived the timeout"
    );

    // Live progress: steps were reported while the launcher was still writing.
    assert!(
        stdout.contains("hang s0 step"),
        "no per-step progress line in:\n{stdout}"
    );

    // Rerun: the finished run is skipped, the failed ones are tried again.
    let out = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(["run", suite.to_str().unwrap(), "--store"])
        .arg(&store)
        .args(["--jobs", "3"])
        .current_dir(tmp.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("skip ok seed 0"), "{stdout}");
}

/// Writes the steps it is asked for, and its environment variables `LS_*` into `out/env.txt`.
const ENV_LAUNCHER: &str = r#"#!/usr/bin/env bash
out="$1"
for ((i = 0; i < 2; i++)); do
  echo "{\"step\": $i, \"rollout/raw_reward\": 0.5}" >> "$out/metrics.jsonl"
done
printf 'seed=%s\nout=%s\ntag=%s\n' "$LS_SEED" "$LS_OUT" "$LS_TAG" > "$out/env.txt"
"#;

fn env_suite(dir: &Path, extra_env: &str) -> std::path::PathBuf {
    let script = dir.join("env.sh");
    std::fs::write(&script, ENV_LAUNCHER).unwrap();
    let text = format!(
        r#"name = "env-cluster"
engine = "command"
seeds = [7]

[workload]
steps = 2

[command]
argv = ["bash", "{script}", "{{out_dir}}"]
env = {{ LS_SEED = "{{seed}}", LS_OUT = "{{out_dir}}/wandb"{extra_env} }}

[command.metrics]
files = ["metrics.jsonl"]
step = "step"

[[configs]]
name = "bf16"
recipe = "bf16"
[configs.env]
LS_TAG = "{{config}}-{{tag}}"
[configs.vars]
tag = "t1"
"#,
        script = script.display()
    );
    let p = dir.join("env.toml");
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn env_values_are_placeholder_expanded_checked_shown_and_recorded() {
    let tmp = tempfile::tempdir().unwrap();
    let suite = env_suite(tmp.path(), "");
    let store = tmp.path().join("runs");
    let bin = env!("CARGO_BIN_EXE_lockstep");
    let out = Command::new(bin)
        .args(["run", suite.to_str().unwrap(), "--store"])
        .arg(&store)
        .current_dir(tmp.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let run = std::fs::read_dir(store.join("env-cluster"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.join("manifest.json").is_file())
        .unwrap();
    let out_dir = std::path::absolute(run.join("out")).unwrap();
    // The launcher saw the values, not the templates.
    let seen = std::fs::read_to_string(run.join("out/env.txt")).unwrap();
    assert_eq!(
        seen,
        format!("seed=7\nout={}/wandb\ntag=bf16-t1\n", out_dir.display())
    );
    // The manifest records the environment as launched.
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(m["status"], "ok", "{m}");
    assert_eq!(m["config"]["env"]["LS_SEED"], "7");
    assert_eq!(m["config"]["env"]["LS_TAG"], "bf16-t1");
    // `suite show --argv` prints them filled in too.
    let show = Command::new(bin)
        .args([
            "suite",
            "show",
            suite.to_str().unwrap(),
            "--argv",
            "--store",
        ])
        .arg(&store)
        .current_dir(tmp.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&show.stdout);
    assert!(text.contains("env:  LS_SEED=7\n"), "{text}");
    assert!(text.contains("env:  LS_TAG=bf16-t1\n"), "{text}");

    // An unknown placeholder in an env value fails `suite check`: exit 2, one line with the
    // file, the line and the fix.
    let bad = tempfile::tempdir().unwrap();
    let suite = env_suite(bad.path(), r#", LS_BAD = "{nope}""#);
    let out = Command::new(bin)
        .args(["suite", "check", suite.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains(&format!("{}:10:", suite.display())),
        "file and line of the env table: {err}"
    );
    assert!(err.contains("env `LS_BAD`"), "{err}");
    assert!(err.contains("unknown placeholder `{nope}`"), "{err}");
    assert!(err.contains("add it to [command.vars]"), "{err}");
}

//! Issue 18: a nightly job on the command engine (and on ingested runs) cannot pass by accident.
//! A stand-in launcher (bash) crashes, hangs, ignores SIGTERM, logs Python's `NaN`, logs 1-based
//! float steps, or never logs the margin metric; `lockstep nightly` must exit 2 with JUnit
//! `<error>` cases and the problems first in summary.md, a NaN must make the run `diverged` with
//! a `non_finite` event, a typo in the metrics files must fail the run, and a signal must leave no
//! process of the launcher's group alive (checked in the process table).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const LAUNCHER: &str = r#"#!/usr/bin/env bash
# Stand-in for an RL framework's launcher: MODE SEED STEPS OUT_DIR. Steps are logged 1-based as
# floats ("step": 1.0), as TRL-style frameworks do.
mode="$1"; seed="$2"; steps="$3"; out="$4"
echo $$ > "$out/launcher.pid"
echo launched >> "$out/../launches.txt"
step() {
  printf '{"step": %d.0, "rollout/raw_reward": %s, "grad/global_norm": 1.5, "train/train_rollout_kl": 0.001}\n' "$(( $1 + 1 ))" "$2" >> "$out/metrics.jsonl"
}
case "$mode" in
  ok) for ((i = 0; i < steps; i++)); do step $i "0.$((50 + seed + i))"; done ;;
  crash) step 0 0.5; step 1 0.5; echo "RuntimeError: CUDA error: an illegal memory access" >&2; exit 3 ;;
  hang) step 0 0.5; sleep 300 ;;
  nan) for ((i = 0; i < steps; i++)); do if [ $i = 2 ]; then step $i NaN; else step $i 0.5; fi; done ;;
  silent) for ((i = 0; i < steps; i++)); do printf '{"step": %d, "train/train_rollout_kl": 0.001}\n' $((i + 1)) >> "$out/metrics.jsonl"; done ;;
  stubborn)
    trap '' TERM
    sleep 300 &
    echo $! > "$out/child.pid"
    step 0 0.5
    while true; do sleep 0.1; done ;;
esac
"#;

fn write_suite(dir: &Path, name: &str, configs: &[(&str, &str, &str)], extra: &str) -> PathBuf {
    let script = dir.join("launch.sh");
    std::fs::write(&script, LAUNCHER).unwrap();
    let mut text = format!(
        r#"name = "{name}"
engine = "command"
seeds = [0, 1, 2]

[workload]
steps = 6

[command]
argv = ["bash", "{script}", "{{mode}}", "{{seed}}", "{{steps}}", "{{out_dir}}"]
timeout_s = 2
kill_grace_s = 1

[command.metrics]
first_step = 1
[command.metrics.map]
"grad/global_norm" = "train/grad_norm"

[checks]
margin = 0.5
bootstrap_reps = 200
band_reps = 50
final_window = 3
{extra}
"#,
        script = script.display()
    );
    for (cfg, recipe, mode) in configs {
        text.push_str(&format!(
            "\n[[configs]]\nname = \"{cfg}\"\nrecipe = \"{recipe}\"\n[configs.vars]\nmode = \"{mode}\"\n"
        ));
    }
    let p = dir.join(format!("{name}.toml"));
    std::fs::write(&p, text).unwrap();
    p
}

fn lockstep(dir: &Path, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(args)
        .current_dir(dir)
        .env("LOCKSTEP_CACHE", dir.join("cache"))
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The manifests of a suite's runs whose config is `config`, by seed.
fn manifests(store: &Path, suite: &str, config: &str) -> Vec<(serde_json::Value, PathBuf)> {
    let mut out: Vec<(serde_json::Value, PathBuf)> = std::fs::read_dir(store.join(suite))
        .unwrap()
        .filter_map(|e| {
            let p = e.unwrap().path();
            let m = std::fs::read_to_string(p.join("manifest.json")).ok()?;
            let m: serde_json::Value = serde_json::from_str(&m).ok()?;
            (m["extra"]["config_name"] == config).then_some((m, p))
        })
        .collect();
    out.sort_by_key(|(m, _)| m["seed"].as_u64());
    out
}

#[test]
fn crashed_hung_and_silent_configurations_make_the_nightly_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    let suite = write_suite(
        tmp.path(),
        "trust",
        &[
            ("bf16", "bf16", "ok"),
            ("mxfp8", "mxfp8", "ok"),
            ("crash", "nvfp4-dq", "crash"),
            ("hang", "nvfp4-hp", "hang"),
            ("silent", "mxfp8", "silent"),
            ("nan", "nvfp4-dq", "nan"),
        ],
        "",
    );
    let s = suite.to_str().unwrap();
    let (code, stdout, stderr) = lockstep(
        tmp.path(),
        &["nightly", s, "--jobs", "8", "--store", "runs"],
    );
    assert_eq!(
        code, 2,
        "a night with crashed runs is an error\n{stdout}\n{stderr}"
    );
    assert!(stderr.contains("problem(s)"), "{stderr}");
    let dir = tmp.path().join("runs/trust");
    let verdict: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("verdict.json")).unwrap()).unwrap();
    assert_eq!(verdict["verdict"], "error");
    assert_eq!(verdict["exit_code"], 2);
    // JUnit: an <error> case for each crashed and hung seed and for the configuration that never
    // logged the margin metric.
    let junit = std::fs::read_to_string(dir.join("junit.xml")).unwrap();
    let errors = junit.matches("<error message=").count();
    assert!(errors >= 7, "{junit}");
    for needle in [
        "trust.crash",
        "trust.hang",
        "trust.silent",
        "exit code 3",
        "timed out",
        "rollout/raw_reward",
    ] {
        assert!(junit.contains(needle), "{needle} missing from\n{junit}");
    }
    assert!(
        !junit.contains("trust.bf16\" name=\"run"),
        "bf16 ran fine:\n{junit}"
    );
    // summary.md: the problems come first, before any table.
    let md = std::fs::read_to_string(dir.join("summary.md")).unwrap();
    let lines: Vec<&str> = md.lines().collect();
    assert!(lines[0].contains("ERROR"), "{md}");
    assert!(lines[2].contains("problem(s)"), "{md}");
    assert!(lines[3].starts_with("- crash seed 0"), "{md}");

    // The crash: failed, with the exit code and stderr kept.
    let crash = manifests(&tmp.path().join("runs"), "trust", "crash");
    assert_eq!(crash.len(), 3);
    assert_eq!(crash[0].0["status"], "failed");
    assert!(
        crash[0].0["extra"]["stderr_tail"]
            .as_str()
            .unwrap()
            .contains("illegal memory access")
    );
    // The expanded argv is in the manifest, with an absolute out_dir.
    let argv = crash[0].0["config"]["argv"].as_array().unwrap();
    assert_eq!(argv[2], "crash");
    assert!(
        Path::new(argv[5].as_str().unwrap()).is_absolute(),
        "{argv:?}"
    );

    // NaN: stored as NaN (not dropped), a non_finite event with step and key, status diverged.
    let nan = manifests(&tmp.path().join("runs"), "trust", "nan");
    let (m, run_dir) = &nan[0];
    assert_eq!(m["status"], "diverged", "{m}");
    assert_eq!(
        m["steps_done"], 6,
        "1-based float steps 1.0..6.0 are steps 0..5"
    );
    let recs = lockstep::store::RunDir::open(run_dir)
        .read_scalars()
        .unwrap();
    assert_eq!(recs.len(), 6);
    assert!(recs[2].get("rollout/raw_reward").unwrap().is_nan());
    assert_eq!(recs[0].get("train/grad_norm"), Some(1.5), "mapped");
    let events = lockstep::store::RunDir::open(run_dir)
        .read_events()
        .unwrap();
    assert!(
        events
            .iter()
            .any(|e| e.kind == "non_finite" && e.step == 2 && e.site == "rollout/raw_reward"),
        "{events:?}"
    );

    // The same night with only healthy configurations is not an error.
    let healthy = write_suite(
        tmp.path(),
        "healthy",
        &[("bf16", "bf16", "ok"), ("mxfp8", "mxfp8", "ok")],
        "",
    );
    let (code, stdout, stderr) = lockstep(
        tmp.path(),
        &["nightly", healthy.to_str().unwrap(), "--store", "runs"],
    );
    assert!(code == 0 || code == 1, "{code}\n{stdout}\n{stderr}");
    let v = std::fs::read_to_string(tmp.path().join("runs/healthy/verdict.json")).unwrap();
    assert!(!v.contains("\"error\""), "{v}");
}

#[test]
fn a_typo_in_metrics_files_fails_the_run_and_reingest_fixes_it_without_relaunching() {
    let tmp = tempfile::tempdir().unwrap();
    let suite = write_suite(tmp.path(), "typo", &[("bf16", "bf16", "ok")], "");
    let text = std::fs::read_to_string(&suite).unwrap();
    std::fs::write(
        &suite,
        text.replace(
            "first_step = 1",
            "first_step = 1\nfiles = [\"metrix.jsonl\"]",
        ),
    )
    .unwrap();
    let s = suite.to_str().unwrap();
    let (code, stdout, _) = lockstep(tmp.path(), &["run", s, "--store", "runs"]);
    assert_eq!(code, 1, "{stdout}");
    let runs = manifests(&tmp.path().join("runs"), "typo", "bf16");
    assert_eq!(runs[0].0["status"], "failed");
    assert!(
        runs[0].0["error"]
            .as_str()
            .unwrap()
            .contains("`metrix.jsonl` were not written")
    );
    let launches = |p: &Path| {
        std::fs::read_to_string(p.join("launches.txt"))
            .unwrap()
            .lines()
            .count()
    };
    assert_eq!(launches(&runs[0].1), 1);

    // Fix the mapping: the run id does not change (the mapping is not part of it), and
    // --reingest re-reads the output folders, launching nothing.
    std::fs::write(&suite, text.replace("timeout_s = 2", "timeout_s = 30")).unwrap();
    let (code, stdout, stderr) = lockstep(tmp.path(), &["run", s, "--store", "runs", "--reingest"]);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    let again = manifests(&tmp.path().join("runs"), "typo", "bf16");
    assert_eq!(
        again[0].1, runs[0].1,
        "same run id after changing timeout_s and files"
    );
    assert_eq!(again[0].0["status"], "ok", "{}", again[0].0);
    assert_eq!(launches(&again[0].1), 1, "nothing was relaunched");
    let (code, stdout, _) = lockstep(tmp.path(), &["run", s, "--store", "runs"]);
    assert_eq!(code, 0);
    assert!(
        stdout.contains("skip bf16 seed 0"),
        "finished runs are not relaunched:\n{stdout}"
    );
}

#[test]
fn the_command_table_is_strict_and_checked_for_every_configuration() {
    let tmp = tempfile::tempdir().unwrap();
    let suite = write_suite(tmp.path(), "strict", &[("bf16", "bf16", "ok")], "");
    let text = std::fs::read_to_string(&suite).unwrap();
    let check = |t: String| {
        let p = tmp.path().join("variant.toml");
        std::fs::write(&p, t).unwrap();
        lockstep(tmp.path(), &["suite", "check", p.to_str().unwrap()])
    };
    let (code, out, _) = check(text.clone());
    assert_eq!(code, 0, "{out}");
    for (variant, needles) in [
        (
            text.replace("timeout_s = 2", "timeout = 60"),
            vec![
                "unknown field `timeout`",
                "did you mean `timeout_s`",
                "variant.toml:10:",
            ],
        ),
        (
            text.replace("\"{mode}\", ", "3, "),
            vec!["variant.toml:9:", "string"],
        ),
        (
            text.replace("timeout_s = 2", "timeout_s = -1"),
            vec!["timeout_s = -1", "positive"],
        ),
        (
            text.replace("timeout_s = 2", "timeout_s = nan"),
            vec!["timeout_s = NaN"],
        ),
        (
            text.replace("seeds = [0, 1, 2]", "seeds = [0, 1, 2]\nseed = 3"),
            vec!["did you mean `seeds`"],
        ),
        (
            format!("{text}\n[[configs]]\nname = \"novars\"\nrecipe = \"bf16\"\n"),
            vec!["config `novars`", "unknown placeholder `{mode}`"],
        ),
        (
            text.replace(
                "first_step = 1",
                "first_step = 1\n[command.metrics.layers]\n\"g/{site}\" = \"grad_norm\"",
            ),
            vec!["{layer}"],
        ),
    ] {
        let (code, _, err) = check(variant);
        assert_eq!(code, 2, "{err}");
        assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
        for n in needles {
            assert!(err.contains(n), "`{n}` not in: {err}");
        }
    }
    // Suite-level [command.vars] defaults serve every configuration that lacks the value.
    let with_default = format!(
        "{}\n[[configs]]\nname = \"novars\"\nrecipe = \"bf16\"\n",
        text.replace(
            "kill_grace_s = 1",
            "kill_grace_s = 1\nvars = { mode = \"ok\" }"
        )
    );
    let (code, out, err) = check(with_default.clone());
    assert_eq!(code, 0, "{out}{err}");
    // `suite show --argv` prints each run's launch line as it would run.
    let p = tmp.path().join("variant.toml");
    std::fs::write(&p, with_default).unwrap();
    let (code, out, _) = lockstep(
        tmp.path(),
        &["suite", "show", p.to_str().unwrap(), "--argv"],
    );
    assert_eq!(code, 0);
    assert!(out.contains("argv: bash "), "{out}");
    assert!(
        out.contains(" ok 2 6 /"),
        "mode, seed, steps, absolute out_dir:\n{out}"
    );
}

/// Processes of a group that are alive (zombies, dead but not yet reaped, do not count).
fn live_members(pgid: u32) -> Vec<u32> {
    lockstep::suite::command::process_group::members(pgid)
        .into_iter()
        .filter(|(_, state)| *state != 'Z' && *state != 'X')
        .map(|(pid, _)| pid)
        .collect()
}

fn wait_for_file(p: &Path, limit: Duration) -> String {
    let t0 = Instant::now();
    loop {
        if let Ok(s) = std::fs::read_to_string(p)
            && !s.trim().is_empty()
        {
            return s.trim().to_string();
        }
        assert!(t0.elapsed() < limit, "{} never appeared", p.display());
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn wait_exit(child: &mut std::process::Child, limit: Duration) -> i32 {
    let t0 = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s.code().unwrap_or(-1);
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            panic!("lockstep did not exit within {limit:?} of the signal");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn sigterm_stops_a_launcher_that_ignores_it_and_marks_the_run_interrupted() {
    let tmp = tempfile::tempdir().unwrap();
    let suite = write_suite(tmp.path(), "sig", &[("stubborn", "bf16", "stubborn")], "");
    let text = std::fs::read_to_string(&suite).unwrap();
    std::fs::write(
        &suite,
        text.replace("seeds = [0, 1, 2]", "seeds = [0]")
            .replace("timeout_s = 2", "timeout_s = 600"),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(["run", suite.to_str().unwrap(), "--store", "runs"])
        .current_dir(tmp.path())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let store = tmp.path().join("runs/sig");
    let run_dir = loop {
        let found = std::fs::read_dir(&store).ok().and_then(|mut d| {
            d.find_map(|e| {
                let p = e.ok()?.path();
                p.join("out").is_dir().then_some(p)
            })
        });
        if let Some(p) = found {
            break p;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let pgid: u32 = wait_for_file(&run_dir.join("out/launcher.pid"), Duration::from_secs(20))
        .parse()
        .unwrap();
    wait_for_file(&run_dir.join("out/child.pid"), Duration::from_secs(20));
    assert!(
        live_members(pgid).len() >= 2,
        "launcher and its child are running"
    );
    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let code = wait_exit(&mut child, Duration::from_secs(30));
    let mut err = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert_eq!(code, 143, "128 + SIGTERM\n{err}");
    assert!(err.contains("SIGTERM"), "{err}");
    assert_eq!(
        live_members(pgid),
        Vec::<u32>::new(),
        "a process of the launcher's group survived"
    );
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("manifest.json")).unwrap())
            .unwrap();
    assert_eq!(m["status"], "interrupted", "{m}");
    assert!(m["finished"].is_string());
    // An interrupted run is not finished: the next run redoes it (here, stopped again at once).
    assert!(!lockstep::suite::runner::is_finished(&run_dir));
}

#[test]
fn ctrl_c_stops_the_built_in_engine_between_steps() {
    let tmp = tempfile::tempdir().unwrap();
    let suite = tmp.path().join("b.toml");
    std::fs::write(
        &suite,
        "name = \"ctrlc\"\nseeds = [0]\n[workload]\nsteps = 100000\nprompts_per_step = 2\n\
         [workload.warm_start]\nmax_steps = 2\neval_prompts = 8\n\
         [[configs]]\nname = \"bf16\"\nrecipe = \"bf16\"\n",
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args([
            "run",
            suite.to_str().unwrap(),
            "--store",
            "runs",
            "--jobs",
            "1",
        ])
        .current_dir(tmp.path())
        .env("LOCKSTEP_CACHE", tmp.path().join("cache"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let store = tmp.path().join("runs/ctrlc");
    // Wait until the engine has logged a step.
    let t0 = Instant::now();
    let run_dir = loop {
        let found = std::fs::read_dir(&store).ok().and_then(|mut d| {
            d.find_map(|e| {
                let p = e.ok()?.path();
                let log = std::fs::read_to_string(p.join("log.txt")).ok()?;
                log.lines().any(|l| l.starts_with("step ")).then_some(p)
            })
        });
        if let Some(p) = found {
            break p;
        }
        assert!(t0.elapsed() < Duration::from_secs(120), "no step logged");
        std::thread::sleep(Duration::from_millis(50));
    };
    Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert_eq!(
        wait_exit(&mut child, Duration::from_secs(60)),
        130,
        "128 + SIGINT"
    );
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("manifest.json")).unwrap())
            .unwrap();
    assert_eq!(m["status"], "interrupted", "{m}");
    assert!(
        m["steps_done"].as_u64().unwrap() >= 1,
        "the steps so far are kept: {m}"
    );
}

#[test]
fn an_ingest_suite_is_compared_like_any_other_and_per_layer_norms_give_spikes() {
    let tmp = tempfile::tempdir().unwrap();
    let tree = tmp.path().join("cluster");
    // bf16 seeds 0-2 and nvfp4 seeds 0-1; nvfp4 seed 0 has a gradient spike in layer 1 at step 20.
    let write_run = |config: &str, seed: u64| {
        let d = tree.join(format!("{config}/seed{seed}"));
        std::fs::create_dir_all(&d).unwrap();
        let mut text = String::new();
        for step in 1..=30u64 {
            let wiggle = ((step * 7 + seed * 13) % 5) as f64 * 0.01;
            let spike = if config == "nvfp4" && seed == 0 && step == 21 {
                100.0
            } else {
                1.0
            };
            text.push_str(&format!(
                "{{\"step\": {step}, \"critic/score/mean\": {}, \"actor/grad_norm\": 1.0, \"grad_norm/layer_1/mlp.experts.linear_fc1\": {}, \"grad_norm/layer_0/mlp.experts.linear_fc1\": {}}}\n",
                0.5 + wiggle,
                spike * (1.0 + wiggle),
                1.0 + wiggle
            ));
        }
        std::fs::write(d.join("metrics.jsonl"), text).unwrap();
    };
    for seed in 0..3 {
        write_run("bf16", seed);
    }
    for seed in 0..2 {
        write_run("nvfp4", seed);
    }
    let suite = tmp.path().join("ingested.toml");
    std::fs::write(
        &suite,
        r#"name = "ingested"
engine = "ingest"
seeds = [0, 1, 2]
[workload]
steps = 30
[ingest]
tree = "cluster"
path_pattern = "{config}/seed{seed}"
[ingest.metrics]
first_step = 1
[ingest.metrics.map]
"critic/score/mean" = "rollout/raw_reward"
"actor/grad_norm" = "train/grad_norm"
[ingest.metrics.layers]
"grad_norm/layer_{layer}/{site}" = "grad_norm"
[[configs]]
name = "bf16"
recipe = "bf16"
[[configs]]
name = "nvfp4"
recipe = "nvfp4-dq"
[checks]
margin = 0.5
bootstrap_reps = 200
band_reps = 50
"#,
    )
    .unwrap();
    let s = suite.to_str().unwrap();
    let (code, out, err) = lockstep(tmp.path(), &["suite", "check", s]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, err) = lockstep(tmp.path(), &["ingest", "--detect", "cluster"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("preset `verl` places 2 of 4 keys"), "{out}");
    assert!(
        out.contains("not placed by `verl`: grad_norm/layer_0/mlp.experts.linear_fc1"),
        "{out}"
    );
    // nvfp4 seed 2 is not in the tree: `run` (the import) says so, and the night is an error.
    let (code, out, err) = lockstep(tmp.path(), &["run", s, "--store", "runs"]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("1 planned run(s) missing"), "{out}");
    let (code, out, err) = lockstep(tmp.path(), &["nightly", s, "--store", "runs", "--no-run"]);
    assert_eq!(code, 2, "{out}{err}");
    let junit = std::fs::read_to_string(tmp.path().join("runs/ingested/junit.xml")).unwrap();
    assert!(
        junit.contains("ingested.nvfp4\" name=\"run seed 2\"><error"),
        "{junit}"
    );
    // Once the run is there, the same suite gives a verdict; the spike is found per layer.
    write_run("nvfp4", 2);
    let (code, out, err) = lockstep(tmp.path(), &["run", s, "--store", "runs"]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, err) = lockstep(tmp.path(), &["nightly", s, "--store", "runs", "--no-run"]);
    assert!(code == 0 || code == 1, "{out}{err}");
    let cmp: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(tmp.path().join("runs/ingested/compare.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        cmp["problems"].as_array().map(Vec::len),
        Some(0),
        "{}",
        cmp["problems"]
    );
    let spikes = cmp["spikes"].as_array().unwrap();
    assert!(
        spikes.iter().any(|x| x["config"] == "nvfp4"
            && x["layer"] == 1
            && x["step"] == 20
            && x["seed"] == 0),
        "{spikes:?}"
    );
    assert!(
        spikes
            .iter()
            .all(|x| x["config"] == "nvfp4" && x["layer"] == 1),
        "{spikes:?}"
    );
    let (code, out, _) = lockstep(tmp.path(), &["compare", "--suite", s, "--store", "runs"]);
    assert!(code == 0 || code == 1, "{out}");
}

//! Issue 8 (Slurm sweeps) against a real Slurm: `.ci/start-slurm.sh` starts a one-node cluster
//! on localhost. Tests that need the cluster print why and return when `sinfo` is missing or no
//! node is usable. The refusal tests that need no cluster always run, and so does the signal test,
//! which puts stand-in `sbatch`/`squeue`/`scancel`/`scontrol`/`sacct` scripts on PATH.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_lockstep");
const STEPS: usize = 40;

/// 2 configs x 2 seeds, tiny model, runs of a few seconds each on one core.
fn suite(dir: &Path, slurm: &str) -> PathBuf {
    let p = dir.join("it.toml");
    let text = format!(
        "name = \"slurm-it\"\nseeds = [0, 1]\n[workload]\nmodel = \"tiny\"\ntask = \"add:2\"\n\
         prompts_per_step = 8\nsamples_per_prompt = 8\nmax_response_tokens = 4\nsteps = {STEPS}\n\
         [[configs]]\nname = \"bf16\"\nrecipe = \"bf16\"\n[[configs]]\nname = \"nvfp4-dq\"\nrecipe = \"nvfp4-dq\"\n{slurm}"
    );
    std::fs::write(&p, text).unwrap();
    p
}

/// Why the cluster cannot be used, if it cannot.
fn cluster_down() -> Option<String> {
    let out = match Command::new("sinfo").args(["-h", "-o", "%t"]).output() {
        Ok(o) => o,
        Err(e) => return Some(format!("sinfo cannot run ({e}): Slurm is not installed")),
    };
    if !out.status.success() {
        return Some(format!(
            "sinfo failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let states = String::from_utf8_lossy(&out.stdout).to_string();
    if !states
        .lines()
        .any(|s| matches!(s.trim(), "idle" | "mix" | "alloc"))
    {
        return Some(format!(
            "no usable node (sinfo states: {:?})",
            states.trim()
        ));
    }
    None
}

macro_rules! need_cluster {
    () => {
        if let Some(why) = cluster_down() {
            eprintln!(
                "SKIP (no Slurm cluster): {why}; start one with `bash .ci/start-slurm.sh` as root"
            );
            return;
        }
    };
}

/// The submission records (`submission.json`) of the suite, oldest first.
fn submissions(store: &Path) -> Vec<serde_json::Value> {
    let base = store.join("slurm-it/.slurm");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&base)
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).collect())
        .unwrap_or_default();
    dirs.sort();
    dirs.iter()
        .filter_map(|d| std::fs::read_to_string(d.join("submission.json")).ok())
        .map(|t| serde_json::from_str(&t).unwrap())
        .collect()
}

/// Cancels every job this test submitted, whatever happens to the test.
struct CancelOnDrop(PathBuf);
impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        for s in submissions(&self.0) {
            if let Some(name) = s["name"].as_str() {
                let _ = Command::new("scancel").args(["-n", name]).output();
            }
        }
    }
}

fn lockstep(dir: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.current_dir(dir)
        .env("LOCKSTEP_CACHE", dir.join("cache"))
        .args(args);
    c
}

/// Lines of a child's stdout, as they come.
fn lines_of(child: &mut Child) -> Receiver<String> {
    let (tx, rx) = channel();
    let out = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    rx
}

fn wait_line(rx: &Receiver<String>, seen: &mut Vec<String>, what: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(180);
    while Instant::now() < deadline {
        if let Ok(l) = rx.recv_timeout(Duration::from_millis(200)) {
            seen.push(l.clone());
            if what(&l) {
                return l;
            }
        }
    }
    panic!("timed out waiting; output so far:\n{}", seen.join("\n"));
}

fn finish(mut c: Command) -> Output {
    let mut child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(240);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("lockstep did not finish in time");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    child.wait_with_output().unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Run ids of the suite, from `lockstep suite show`.
fn planned_ids(dir: &Path, suite: &Path) -> Vec<String> {
    let o = lockstep(dir, &["suite", "show", suite.to_str().unwrap()])
        .output()
        .unwrap();
    let mut ids: Vec<String> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().last().map(String::from))
        .collect();
    ids.sort();
    ids
}

#[test]
fn r8_cancelled_task_and_crashed_lockstep_rerun_gives_every_run_exactly_once() {
    need_cluster!();
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let store = dir.join("runs");
    let _guard = CancelOnDrop(store.clone());
    let suite = suite(dir, "");
    let s = suite.to_str().unwrap();
    // One task at a time (--jobs 1 throttles the array), so cancelling task 0 mid-run leaves
    // the others queued in Slurm when lockstep is killed.
    let args = [
        "run",
        s,
        "--executor",
        "slurm",
        "--jobs",
        "1",
        "--poll",
        "0.5",
    ];
    let mut first = lockstep(dir, &args).stdout(Stdio::piped()).spawn().unwrap();
    let rx = lines_of(&mut first);
    let mut seen = Vec::new();
    let start = wait_line(&rx, &mut seen, |l| {
        l.contains(" start ") && l.contains("(slurm ")
    });
    let task = start
        .rsplit("(slurm ")
        .next()
        .unwrap()
        .trim_end_matches(')')
        .to_string();
    let (job, index) = task.split_once('_').unwrap();
    let subs = submissions(&store);
    assert_eq!(subs.len(), 1);
    assert_eq!(subs[0]["job_id"], job);
    let victim = subs[0]["runs"][index.parse::<usize>().unwrap()]
        .as_str()
        .unwrap()
        .to_string();
    // Mid-run: the run has written at least one step.
    let log = store.join("slurm-it").join(&victim).join("log.txt");
    let deadline = Instant::now() + Duration::from_secs(120);
    while !std::fs::read_to_string(&log).is_ok_and(|t| t.contains("step    0")) {
        assert!(
            Instant::now() < deadline,
            "run {victim} never reached step 0"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let o = Command::new("scancel").arg(&task).output().unwrap();
    assert!(o.status.success(), "scancel: {}", text(&o));
    let ended = wait_line(&rx, &mut seen, |l| l.contains(&format!("(slurm {task} ")));
    assert!(
        ended.contains("Failed") && ended.contains("CANCELLED"),
        "{ended}"
    );
    let m: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(store.join("slurm-it").join(&victim).join("manifest.json"))
            .unwrap(),
    )
    .unwrap();
    assert_eq!(m["status"], "failed");
    assert_eq!(m["extra"]["slurm"]["state"], "CANCELLED");
    // lockstep crashes while the rest of the array is still queued or running.
    first.kill().unwrap();
    first.wait().unwrap();
    // Harder still: as if it had died between sbatch answering and the job id being saved. The
    // rerun must find the array by its job name and still not resubmit its queued runs.
    let rec = store
        .join("slurm-it/.slurm")
        .join(
            std::fs::read_dir(store.join("slurm-it/.slurm"))
                .unwrap()
                .filter_map(|e| e.ok())
                .find(|e| e.path().join("submission.json").exists())
                .unwrap()
                .file_name(),
        )
        .join("submission.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&rec).unwrap()).unwrap();
    v["job_id"] = serde_json::Value::Null;
    std::fs::write(&rec, v.to_string()).unwrap();

    eprintln!("first lockstep, killed:\n{}", seen.join("\n"));
    let second = finish(lockstep(dir, &args));
    let out = text(&second);
    eprintln!("second lockstep:\n{out}");
    assert!(second.status.success(), "{out}");
    assert!(
        out.contains("; 1 submitted,"),
        "only the cancelled run is resubmitted:\n{out}"
    );
    let subs = submissions(&store);
    assert_eq!(subs.len(), 2, "{subs:?}");
    assert_eq!(subs[1]["runs"], serde_json::json!([victim]));
    assert!(subs.iter().all(|s| s["closed"] == true), "{subs:?}");
    let followed: usize = out
        .lines()
        .filter(|l| l.contains("submitted earlier; not resubmitted"))
        .count();
    let skipped = out.lines().filter(|l| l.contains(" skip ")).count();
    assert_eq!(followed + skipped, 3, "{out}");

    // The store: every planned run exactly once, complete, with Slurm's view recorded.
    let planned = planned_ids(dir, &suite);
    assert_eq!(planned.len(), 4);
    let mut stored: Vec<String> = std::fs::read_dir(store.join("slurm-it"))
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.'))
        .collect();
    stored.sort();
    assert_eq!(stored, planned);
    for id in &planned {
        let rd = store.join("slurm-it").join(id);
        let m: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(rd.join("manifest.json")).unwrap())
                .unwrap();
        assert_eq!(m["status"], "ok", "{id}: {m}");
        assert_eq!(m["steps_done"], STEPS);
        let sl = &m["extra"]["slurm"];
        assert_eq!(sl["state"], "COMPLETED", "{id}: {sl}");
        assert_eq!(sl["exit_code"], "0:0");
        assert!(!sl["node"].as_str().unwrap_or("").is_empty());
        let want_job = if *id == victim {
            &subs[1]["job_id"]
        } else {
            &subs[0]["job_id"]
        };
        assert_eq!(&sl["array_job_id"], want_job, "{id}");
        let steps: Vec<usize> = lockstep::store::RunDir::open(&rd)
            .read_scalars()
            .unwrap()
            .iter()
            .map(|r| r.step)
            .collect();
        assert_eq!(
            steps,
            (0..STEPS).collect::<Vec<_>>(),
            "{id}: one row per step, once"
        );
    }
    // A third invocation has nothing left to do.
    let third = finish(lockstep(dir, &args));
    let out = text(&third);
    assert!(
        third.status.success() && out.contains("4 skipped") && out.contains("0 submitted"),
        "{out}"
    );
    assert_eq!(submissions(&store).len(), 2);
}

#[test]
fn r8_unknown_partition_is_refused_with_slurms_words_and_nothing_queued() {
    need_cluster!();
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let store = dir.join("runs");
    let _guard = CancelOnDrop(store.clone());
    let suite = suite(dir, "[slurm]\npartition = \"no-such-partition\"\n");
    let o = lockstep(
        dir,
        &["run", suite.to_str().unwrap(), "--executor", "slurm"],
    )
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("sbatch said") && err.contains("invalid partition"),
        "{err}"
    );
    let subs = submissions(&store);
    assert_eq!(subs.len(), 1);
    assert!(subs[0]["job_id"].is_null(), "{subs:?}");
    // The command line overrides the suite's partition; the refused record is closed, not followed.
    let o = lockstep(
        dir,
        &[
            "run",
            suite.to_str().unwrap(),
            "--executor",
            "slurm",
            "--partition",
            "debug",
            "--dry-run",
        ],
    )
    .output()
    .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        out.contains("#SBATCH --partition=debug\n") && out.contains("#SBATCH --array=0-3\n"),
        "{out}"
    );
}

#[test]
fn r8_dry_run_prints_the_script_and_writes_nothing() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let suite = suite(
        dir,
        "[slurm]\npartition = \"gpu\"\ntime = \"00:30:00\"\nsbatch_args = [\"--qos=high\"]\n",
    );
    let o = lockstep(
        dir,
        &[
            "run",
            suite.to_str().unwrap(),
            "--executor",
            "slurm",
            "--dry-run",
            "--time",
            "01:00:00",
            "--gpus-per-run",
            "1",
            "--sbatch-arg=--exclusive",
        ],
    )
    .output()
    .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", text(&o));
    for line in [
        "#SBATCH --partition=gpu\n",
        "#SBATCH --time=01:00:00\n",
        "#SBATCH --gres=gpu:1\n",
        "#SBATCH --qos=high\n",
        "#SBATCH --exclusive\n",
        "#SBATCH --array=0-3\n",
        " run-one --suite ",
    ] {
        assert!(out.contains(line), "missing {line:?} in\n{out}");
    }
    assert!(out.contains(BIN), "tasks run this very binary:\n{out}");
    assert!(!dir.join("runs").exists(), "a dry run writes nothing");
}

#[test]
fn r8_missing_sbatch_is_one_clear_line_and_leaves_no_record() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let empty = dir.join("empty-path");
    std::fs::create_dir(&empty).unwrap();
    let suite = suite(dir, "");
    let o = lockstep(
        dir,
        &["run", suite.to_str().unwrap(), "--executor", "slurm"],
    )
    .env("PATH", &empty)
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("`sbatch` not found") && err.contains("slurm-client"),
        "{err}"
    );
    assert!(submissions(&dir.join("runs")).is_empty());
}

#[test]
fn r8_unreachable_controller_is_one_clear_line() {
    if Command::new("sbatch").arg("--version").output().is_err() {
        eprintln!("SKIP: sbatch is not installed");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    // A configuration naming a controller port nothing listens on.
    let conf = dir.join("slurm.conf");
    std::fs::write(
        &conf,
        "ClusterName=nowhere\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort=1\nAuthType=auth/munge\n\
         NodeName=localhost CPUs=1 State=UNKNOWN\nPartitionName=p Nodes=ALL Default=YES\n",
    )
    .unwrap();
    let suite = suite(dir, "");
    let o = lockstep(
        dir,
        &["run", suite.to_str().unwrap(), "--executor", "slurm"],
    )
    .env("SLURM_CONF", &conf)
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("sbatch said") && err.contains("Unable to contact slurm controller"),
        "{err}"
    );
}

#[test]
fn r8_command_engine_launch_script_runs_inside_the_task() {
    need_cluster!();
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let store = dir.join("runs");
    let _guard = CancelOnDrop(store.clone());
    // A stand-in launcher: writes metrics over time, its environment and the Slurm job it ran in.
    let launcher = dir.join("launch.sh");
    std::fs::write(
        &launcher,
        "out=\"$1\"\nfor i in 0 1 2 3 4 5 6 7 8 9; do echo \"{\\\"step\\\": $i, \\\"rollout/raw_reward\\\": 0.5}\" >> \"$out/metrics.jsonl\"; sleep 0.1; done\nsleep 1.5\n\
         echo \"$SLURM_ARRAY_JOB_ID $SLURM_ARRAY_TASK_ID $RECIPE_KNOB\" > \"$out/where.txt\"\n",
    )
    .unwrap();
    let suite = dir.join("cmd.toml");
    std::fs::write(
        &suite,
        format!(
            "name = \"slurm-it\"\nengine = \"command\"\nseeds = [0]\n[workload]\nsteps = 10\n\
             [command]\nargv = [\"sh\", \"{}\", \"{{out_dir}}\"]\ntimeout_s = 60\n\
             [command.metrics]\nfiles = [\"metrics.jsonl\"]\n\
             [[configs]]\nname = \"bf16\"\nrecipe = \"bf16\"\n[configs.env]\nRECIPE_KNOB = \"plain\"\n\
             [[configs]]\nname = \"nvfp4-dq\"\nrecipe = \"nvfp4-dq\"\n[configs.env]\nRECIPE_KNOB = \"dequantized\"\n",
            launcher.display()
        ),
    )
    .unwrap();
    let o = finish(lockstep(
        dir,
        &[
            "run",
            suite.to_str().unwrap(),
            "--executor",
            "slurm",
            "--poll",
            "0.5",
        ],
    ));
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains(" step 10/10 reward 0.500 "),
        "progress read from the launcher's metrics:\n{}",
        text(&o)
    );
    let subs = submissions(&store);
    assert_eq!(subs.len(), 1);
    for (i, id) in subs[0]["runs"].as_array().unwrap().iter().enumerate() {
        let rd = store.join("slurm-it").join(id.as_str().unwrap());
        let m: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(rd.join("manifest.json")).unwrap())
                .unwrap();
        assert_eq!(m["engine"], "command");
        assert_eq!(m["status"], "ok", "{m}");
        assert_eq!(m["steps_done"], 10);
        assert_eq!(m["extra"]["slurm"]["state"], "COMPLETED");
        let knob = if m["config"]["config"] == "bf16" {
            "plain"
        } else {
            "dequantized"
        };
        assert_eq!(
            std::fs::read_to_string(rd.join("out/where.txt"))
                .unwrap()
                .trim(),
            format!("{} {i} {knob}", subs[0]["job_id"].as_str().unwrap()),
            "the launch script ran inside array task {i} with its config's environment"
        );
    }
}

/// Takes the (only) node down under running tasks, so it disturbs every other Slurm test: run
/// it alone with `cargo test --test slurm -- --ignored`. The default tests cover the same
/// resubmission rule through a cancelled task.
#[test]
#[ignore = "marks the cluster's node DOWN; run alone: cargo test --test slurm -- --ignored"]
fn r8_node_failure_fails_the_runs_on_it_and_a_rerun_resubmits_only_those() {
    need_cluster!();
    let node = String::from_utf8_lossy(
        &Command::new("sinfo")
            .args(["-h", "-o", "%n"])
            .output()
            .unwrap()
            .stdout,
    )
    .lines()
    .next()
    .unwrap()
    .trim()
    .to_string();
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let store = dir.join("runs");
    let _guard = CancelOnDrop(store.clone());
    let suite = suite(dir, "");
    let s = suite.to_str().unwrap();
    // Without requeueing, a task on a failed node ends NODE_FAIL instead of waiting to rerun.
    let args = [
        "run",
        s,
        "--executor",
        "slurm",
        "--poll",
        "0.5",
        "--sbatch-arg=--no-requeue",
    ];
    let mut first = lockstep(dir, &args).stdout(Stdio::piped()).spawn().unwrap();
    let rx = lines_of(&mut first);
    let mut seen = Vec::new();
    wait_line(&rx, &mut seen, |l| {
        l.contains(" step ") && l.contains("(slurm ")
    });
    let down = |state: &str| {
        Command::new("scontrol")
            .args([
                "update",
                &format!("nodename={node}"),
                &format!("state={state}"),
            ])
            .args(if state == "down" {
                vec!["reason=lockstep-test"]
            } else {
                vec![]
            })
            .output()
            .unwrap()
    };
    assert!(down("down").status.success());
    wait_line(&rx, &mut seen, |l| l.contains("NODE_FAIL"));
    let _ = down("resume"); // fails harmlessly when the node already returned to service
    let status = first.wait().unwrap();
    seen.extend(rx.iter());
    assert!(
        !status.success(),
        "runs failed, so the sweep fails:\n{}",
        seen.join("\n")
    );
    let lost = seen
        .iter()
        .filter(|l| l.contains("Failed") && l.contains("NODE_FAIL"))
        .count();
    assert!(lost >= 1, "{}", seen.join("\n"));
    let second = finish(lockstep(dir, &args));
    let out = text(&second);
    assert!(second.status.success(), "{out}");
    assert!(
        out.contains(&format!("; {lost} submitted,")),
        "only the lost runs go again:\n{out}"
    );
    for id in planned_ids(dir, &suite) {
        let m: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(store.join("slurm-it").join(&id).join("manifest.json"))
                .unwrap(),
        )
        .unwrap();
        assert_eq!(m["status"], "ok", "{id}");
        assert_eq!(m["extra"]["slurm"]["state"], "COMPLETED", "{id}");
    }
}

#[test]
fn r8_a_run_made_in_slurm_equals_the_same_run_made_locally() {
    need_cluster!();
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let _guard = CancelOnDrop(dir.join("slurm-store"));
    let suite = dir.join("same.toml");
    std::fs::write(
        &suite,
        "name = \"slurm-it\"\nseeds = [3]\n[workload]\nmodel = \"tiny\"\ntask = \"add:2\"\n\
         prompts_per_step = 8\nsamples_per_prompt = 8\nmax_response_tokens = 4\nsteps = 8\n\
         [[configs]]\nname = \"mxfp8\"\nrecipe = \"mxfp8\"\n[[configs]]\nname = \"nvfp4-hp\"\nrecipe = \"nvfp4-hp\"\n",
    )
    .unwrap();
    let s = suite.to_str().unwrap();
    let local = finish(lockstep(
        dir,
        &["run", s, "--store", "local-store", "--jobs", "1"],
    ));
    assert!(local.status.success(), "{}", text(&local));
    let slurm = finish(lockstep(
        dir,
        &[
            "run",
            s,
            "--store",
            "slurm-store",
            "--executor",
            "slurm",
            "--poll",
            "0.5",
        ],
    ));
    assert!(slurm.status.success(), "{}", text(&slurm));
    let ids = planned_ids(dir, &suite);
    assert_eq!(ids.len(), 2);
    for id in ids {
        let read = |store: &str| {
            let rd = lockstep::store::RunDir::open(&dir.join(store).join("slurm-it").join(&id));
            (rd.read_manifest().unwrap(), rd.read_scalars().unwrap())
        };
        let (ml, sl) = read("local-store");
        let (ms, ss) = read("slurm-store");
        assert_eq!(ml.config, ms.config, "{id}");
        assert!(ms.extra.contains_key("slurm") && !ml.extra.contains_key("slurm"));
        assert_eq!(sl.len(), ss.len());
        for (a, b) in sl.iter().zip(&ss) {
            // Wall-clock `perf/` times differ; everything else must repeat.
            assert_eq!(
                a.deterministic_scalars(),
                b.deterministic_scalars(),
                "{id} step {}: same bits locally and in Slurm",
                a.step
            );
        }
    }
}

/// Stand-ins for Slurm's client commands, written into `bin/` as shell scripts: every call is
/// appended to `calls.log`; `sbatch` answers job id 4242; `squeue` lists task 0 of the array as
/// RUNNING and task 1 as PENDING until `scancel` was called, then nothing; `scontrol` then
/// reports both tasks CANCELLED.
fn fake_slurm(dir: &Path) -> PathBuf {
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let log = dir.join("calls.log");
    let gone = dir.join("cancelled");
    let scripts = [
        ("sbatch", "echo 4242\n".to_string()),
        (
            "squeue",
            format!(
                "[ -e '{g}' ] && exit 0\nname=\nwhile [ $# -gt 0 ]; do [ \"$1\" = -n ] && name=\"$2\"; shift; done\n\
                 [ -z \"$name\" ] && exit 0\necho \"4242|0|4243|$name|RUNNING|node1|None\"\n\
                 echo \"4242|1|4244|$name|PENDING||Resources\"\n",
                g = gone.display()
            ),
        ),
        ("scancel", format!("touch '{}'\n", gone.display())),
        (
            "scontrol",
            format!(
                "[ -e '{g}' ] || exit 0\n\
                 echo 'JobId=4243 ArrayJobId=4242 ArrayTaskId=0 JobState=CANCELLED ExitCode=0:15 NodeList=node1'\n\
                 echo 'JobId=4244 ArrayJobId=4242 ArrayTaskId=1 JobState=CANCELLED ExitCode=0:0 NodeList=(null)'\n",
                g = gone.display()
            ),
        ),
        ("sacct", String::new()),
    ];
    for (name, body) in scripts {
        let p = bin.join(name);
        std::fs::write(
            &p,
            format!(
                "#!/bin/sh\necho \"{name} $*\" >> '{}'\n{body}",
                log.display()
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    bin
}

#[test]
fn r8_sigint_and_sigterm_cancel_the_submitted_array_and_mark_started_runs_interrupted() {
    for (sig, code) in [(libc::SIGINT, 130), (libc::SIGTERM, 143)] {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path();
        let bin = fake_slurm(dir);
        let store = dir.join("runs");
        let suite = suite(dir, "");
        let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
        let mut child = lockstep(
            dir,
            &[
                "run",
                suite.to_str().unwrap(),
                "--executor",
                "slurm",
                "--poll",
                "0.2",
            ],
        )
        .env("PATH", &path)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
        let rx = lines_of(&mut child);
        let mut seen = Vec::new();
        wait_line(&rx, &mut seen, |l| l.contains("submitted job array 4242"));
        // Task 0 starts its run, as `run-one --suite` inside the task would: it claims the run
        // and writes a `running` manifest.
        let subs = submissions(&store);
        assert_eq!(subs.len(), 1);
        let started = subs[0]["runs"][0].as_str().unwrap().to_string();
        let pending = subs[0]["runs"][1].as_str().unwrap().to_string();
        let root = store.join("slurm-it");
        lockstep::suite::slurm::write_task_marker(
            &root,
            &started,
            &lockstep::suite::slurm::TaskIdentity {
                array_job_id: "4242".into(),
                array_task_id: 0,
                job_id: "4243".into(),
                node: "node1".into(),
                started: "t".into(),
            },
        )
        .unwrap();
        let m = lockstep::store::Manifest::start(
            &started,
            "builtin",
            serde_json::json!({}),
            0,
            STEPS,
            "cpu",
        );
        lockstep::store::RunDir::create(&root.join(&started))
            .unwrap()
            .write_manifest(&m)
            .unwrap();
        wait_line(&rx, &mut seen, |l| {
            l.contains(" start ") && l.contains("4242_0")
        });
        // SAFETY: sending a signal to the child this test started.
        assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0);
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("lockstep did not stop after the signal");
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let mut err = String::new();
        std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
        assert_eq!(status.code(), Some(code), "signal {sig}; stderr: {err}");
        // scancel got the job id, as one argument (no shell, no name pattern).
        let calls = std::fs::read_to_string(dir.join("calls.log")).unwrap();
        assert!(
            calls.lines().any(|l| l == "scancel 4242"),
            "scancel was not called with the job id:\n{calls}"
        );
        // The started run is interrupted, with Slurm's view recorded; the pending one never ran.
        let m = lockstep::store::RunDir::open(&root.join(&started))
            .read_manifest()
            .unwrap();
        assert_eq!(m.status, lockstep::store::RunStatus::Interrupted, "{m:?}");
        assert!(
            m.error
                .as_deref()
                .unwrap()
                .contains("cancelled Slurm task 4242_0")
        );
        assert_eq!(m.extra["slurm"]["state"], "CANCELLED");
        assert!(!root.join(&pending).join("manifest.json").exists());
        assert!(
            err.contains("scancel 4242") && err.contains("interrupted"),
            "{err}"
        );
        // The submission is closed: a rerun resubmits both runs instead of following them.
        assert_eq!(submissions(&store)[0]["closed"], true);
    }
}

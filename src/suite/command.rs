//! The command engine: launches a real RL framework's job (argv from a template, never a shell),
//! with per-config environment variables and a timeout, then reads the metrics files it wrote
//! ([`super::metrics`]) and decides how the run ended.
//!
//! Placeholders in argv elements: `{config}`, `{precision}` (the recipe name), `{backward}`,
//! `{seed}`, `{steps}`, `{out_dir}` (absolute), `{suite}`, `{task}`, `{model}`, and every key of
//! `[command.vars]` and the configuration's `vars`. Substitution happens inside single argv
//! elements, so a value can never become a second argument or a shell command. The values of
//! `env` (the suite's and the configuration's) are filled the same way. `suite check` expands
//! every run's argv and environment, so a placeholder one configuration lacks fails there.
//!
//! A run folder holds `manifest.json` (status, the expanded argv and environment, exit code or
//! signal, stderr tail), `stdout.log` and `stderr.log` (the launcher's output), `out/` (the
//! launcher's `{out_dir}`), and the metrics read from it: `scalars.parquet`, `layers.parquet`,
//! `events.jsonl`.
//!
//! How a run ends ([`judge`]): a non-finite reward, loss or gradient norm makes it `diverged`; a
//! non-zero exit or a death by signal `failed`; exit 0 is `ok` only when every metrics file exists
//! and the logged steps reach the planned count; `timeout` and `interrupted` when lockstep stopped
//! it. Stopping sends SIGTERM to the launcher's whole process group, then SIGKILL after
//! `kill_grace_s`, and waits until no process of the group is left.

use super::metrics::{MetricsMapping, MetricsRead, read_metrics};
use super::plan::RunSpec;
use super::spec::{CommandSpec, SuiteSpec};
use crate::engine::metrics::StepRecord;
use crate::io::IoError;
use crate::store::{Manifest, RunDir, RunStatus};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

/// Fill `{name}` placeholders from `vals`; an unknown placeholder is an error naming it.
pub fn fill(template: &str, vals: &BTreeMap<String, String>) -> Result<String, String> {
    let mut out = String::new();
    let mut rest = template;
    while let Some(i) = rest.find('{') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        let j = after
            .find('}')
            .ok_or_else(|| format!("unclosed `{{` in `{template}`"))?;
        let key = &after[..j];
        let v = vals.get(key).ok_or_else(|| {
            format!(
                "unknown placeholder `{{{key}}}` in `{template}`; known: {} (add it to [command.vars] or the configuration's vars)",
                vals.keys().cloned().collect::<Vec<_>>().join(", ")
            )
        })?;
        out.push_str(v);
        rest = &after[j + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

fn placeholders(suite: &SuiteSpec, run: &RunSpec, out_dir: &Path) -> BTreeMap<String, String> {
    let mut v = BTreeMap::new();
    v.insert("config".into(), run.config.clone());
    v.insert("precision".into(), run.run.recipe.name.clone());
    v.insert(
        "backward".into(),
        run.run.recipe.backward.label().to_string(),
    );
    v.insert("seed".into(), run.seed.to_string());
    v.insert("steps".into(), run.run.steps.to_string());
    v.insert("out_dir".into(), out_dir.display().to_string());
    v.insert("suite".into(), suite.name.clone());
    v.insert("task".into(), suite.workload.task.clone());
    v.insert("model".into(), suite.workload.model.clone());
    for (k, x) in &run.vars {
        v.insert(k.clone(), x.clone());
    }
    v
}

/// The run's argv with every placeholder filled (`out_dir` as given).
pub fn argv(
    suite: &SuiteSpec,
    cmd: &CommandSpec,
    run: &RunSpec,
    out_dir: &Path,
) -> Result<Vec<String>, String> {
    let vals = placeholders(suite, run, out_dir);
    cmd.argv.iter().map(|a| fill(a, &vals)).collect()
}

/// Why `template` (an argv element or an `env` value) cannot be filled for `run`, if it cannot.
pub fn template_error(
    suite: &SuiteSpec,
    run: &RunSpec,
    template: &str,
    out_dir: &Path,
) -> Option<String> {
    fill(template, &placeholders(suite, run, out_dir)).err()
}

/// The run's environment (`[command] env` and the configuration's `env`) with every placeholder
/// in the values filled exactly as in [`argv`] (`out_dir` as given): `WANDB_DIR = "{out_dir}/wandb"`
/// or `SEED = "{seed}"`. Names are taken as written. An error names the variable.
pub fn env(
    suite: &SuiteSpec,
    run: &RunSpec,
    out_dir: &Path,
) -> Result<BTreeMap<String, String>, String> {
    let vals = placeholders(suite, run, out_dir);
    run.env
        .iter()
        .map(|(k, v)| {
            fill(v, &vals)
                .map(|x| (k.clone(), x))
                .map_err(|e| format!("env `{k}`: {e}"))
        })
        .collect()
}

/// How the launcher ended, as recorded in the manifest (`extra.launcher_end`) so that a re-read
/// with a corrected mapping can judge the run again without relaunching it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "how", rename_all = "snake_case")]
pub enum LauncherEnd {
    /// It exited with this code.
    Exited { code: i32 },
    /// A signal lockstep did not send killed it.
    Signalled { signal: i32 },
    /// It ran past `timeout_s` and lockstep stopped it.
    TimedOut { after_s: f64 },
    /// lockstep was stopped by this signal and stopped it.
    Interrupted { signal: i32 },
    /// It could not be started.
    NotStarted { why: String },
}

/// A signal's conventional name.
pub fn signal_name(sig: i32) -> String {
    match sig {
        1 => "SIGHUP".into(),
        2 => "SIGINT".into(),
        6 => "SIGABRT".into(),
        9 => "SIGKILL".into(),
        11 => "SIGSEGV".into(),
        15 => "SIGTERM".into(),
        n => format!("signal {n}"),
    }
}

/// The run's status and, unless it is `ok`, why: the one place that decides what a launcher's end
/// and its metrics mean.
pub fn judge(
    end: &LauncherEnd,
    read: &MetricsRead,
    steps_planned: usize,
) -> (RunStatus, Option<String>) {
    let reached = read.steps_reached();
    let progress = format!("{reached} of {steps_planned} planned steps logged");
    match end {
        LauncherEnd::Interrupted { signal } => {
            return (
                RunStatus::Interrupted,
                Some(format!(
                    "interrupted: lockstep got {} and stopped the launcher ({progress}); rerun to redo it",
                    signal_name(*signal)
                )),
            );
        }
        LauncherEnd::NotStarted { why } => return (RunStatus::Failed, Some(why.clone())),
        _ => {}
    }
    if let Some((step, key)) = read.divergence() {
        return (
            RunStatus::Diverged,
            Some(format!(
                "{key} is not finite at step {step} ({})",
                end_text(end)
            )),
        );
    }
    let problem = match end {
        LauncherEnd::TimedOut { after_s } => {
            return (
                RunStatus::Timeout,
                Some(format!(
                    "timed out after {after_s} s (timeout_s); {progress}"
                )),
            );
        }
        LauncherEnd::Exited { code: 0 } => None,
        other => Some(end_text(other)),
    };
    if let Some(p) = problem {
        return (RunStatus::Failed, Some(format!("{p}; {progress}")));
    }
    if let Some(short) = read.shortfall(Some(steps_planned)) {
        return (
            RunStatus::Failed,
            Some(format!(
                "exit code 0, but {short}; a run that stops early must exit non-zero"
            )),
        );
    }
    (RunStatus::Ok, None)
}

fn end_text(end: &LauncherEnd) -> String {
    match end {
        LauncherEnd::Exited { code } => format!("exit code {code}"),
        LauncherEnd::Signalled { signal } => format!("killed by {}", signal_name(*signal)),
        LauncherEnd::TimedOut { after_s } => format!("timed out after {after_s} s"),
        LauncherEnd::Interrupted { signal } => format!("interrupted by {}", signal_name(*signal)),
        LauncherEnd::NotStarted { why } => why.clone(),
    }
}

/// Launch the run's command and read its metrics into `dir`. While it runs, the metrics files
/// are re-read about once a second and each new step is passed to `on_step` (live progress).
/// `stop` is polled too: when it returns a signal number, the launcher's process group is stopped
/// and the run is `interrupted`.
pub fn run_command(
    suite: &SuiteSpec,
    run: &RunSpec,
    dir: &Path,
    on_step: &dyn Fn(&StepRecord),
    stop: &dyn Fn() -> Option<i32>,
) -> Result<Manifest, IoError> {
    let cmd = suite.command.as_ref().ok_or_else(|| {
        IoError::invalid(&suite.path, "engine = \"command\" needs a [command] table")
    })?;
    let rd = RunDir::create(dir)?;
    let out_dir = std::path::absolute(dir.join("out")).map_err(|e| IoError::io(dir, e))?;
    std::fs::create_dir_all(&out_dir).map_err(|e| IoError::io(&out_dir, e))?;
    let argv = argv(suite, cmd, run, &out_dir);
    let env = env(suite, run, &out_dir);
    let config = serde_json::json!({
        "config": run.config,
        "recipe": run.run.recipe.name,
        "argv": argv.as_ref().ok(),
        // As launched (placeholders filled); the templates are in the suite file.
        "env": env.as_ref().unwrap_or(&run.env),
        "vars": run.vars,
    });
    let mut m = Manifest::start(
        &run.run_id,
        "command",
        config,
        run.seed,
        run.run.steps,
        "external",
    );
    m.suite = Some(suite.name.clone());
    rd.write_manifest(&m)?;
    let end = match (argv, env) {
        (Ok(argv), Ok(env)) => launch(cmd, &argv, &env, dir, &out_dir, on_step, stop)?,
        (Err(e), _) => LauncherEnd::NotStarted {
            why: format!("[command] argv: {e}"),
        },
        (_, Err(e)) => LauncherEnd::NotStarted {
            why: format!("[command] {e}"),
        },
    };
    m.extra
        .insert("stderr_tail".into(), stderr_tail(dir).into());
    finish(rd, m, &end, &cmd.metrics, &out_dir)
}

/// Read `out_dir` with `mapping`, judge the run, write metrics and manifest.
fn finish(
    rd: RunDir,
    mut m: Manifest,
    end: &LauncherEnd,
    mapping: &MetricsMapping,
    out_dir: &Path,
) -> Result<Manifest, IoError> {
    let (status, error, read) = match read_metrics(out_dir, mapping) {
        Ok(read) => {
            let (status, error) = judge(end, &read, m.steps_planned);
            (status, error, read)
        }
        Err(e) => (
            RunStatus::Failed,
            Some(format!("metrics: {e}")),
            MetricsRead::default(),
        ),
    };
    rd.write_metrics(&read.records)?;
    m.status = status;
    m.error = error;
    m.steps_done = read.steps_reached();
    m.extra.insert(
        "launcher_end".into(),
        serde_json::to_value(end).unwrap_or_default(),
    );
    if let LauncherEnd::Exited { code } = end {
        m.extra.insert("exit_code".into(), (*code).into());
    }
    m.extra.insert("skipped_lines".into(), read.skipped.into());
    m.extra
        .insert("duplicate_values".into(), read.duplicates.into());
    m.extra
        .insert("rows_before_first_step".into(), read.before_first.into());
    m.finished = Some(crate::store::run::now_utc());
    rd.write_manifest(&m)?;
    Ok(m)
}

/// Re-read a finished command run's `out/` with the suite's current mapping and judge it again,
/// without relaunching anything (`lockstep run --reingest`). The launcher's end comes from the
/// manifest; a run that never recorded one (it was killed with lockstep) is left as it is.
pub fn reingest(suite: &SuiteSpec, run: &RunSpec, dir: &Path) -> Result<Option<Manifest>, IoError> {
    let Some(cmd) = &suite.command else {
        return Ok(None);
    };
    let rd = RunDir::open(dir);
    let Ok(mut m) = rd.read_manifest() else {
        return Ok(None);
    };
    let Some(end) = m
        .extra
        .get("launcher_end")
        .and_then(|v| serde_json::from_value::<LauncherEnd>(v.clone()).ok())
    else {
        return Ok(None);
    };
    m.steps_planned = run.run.steps;
    let out_dir = std::path::absolute(dir.join("out")).map_err(|e| IoError::io(dir, e))?;
    finish(rd, m, &end, &cmd.metrics, &out_dir).map(Some)
}

fn stderr_tail(dir: &Path) -> String {
    let text = std::fs::read(dir.join("stderr.log")).unwrap_or_default();
    let text = String::from_utf8_lossy(&text[text.len().saturating_sub(64 << 10)..]);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// Start the launcher in its own process group and wait for it, a timeout or `stop`.
fn launch(
    cmd: &CommandSpec,
    argv: &[String],
    env: &BTreeMap<String, String>,
    dir: &Path,
    out_dir: &Path,
    on_step: &dyn Fn(&StepRecord),
    stop: &dyn Fn() -> Option<i32>,
) -> Result<LauncherEnd, IoError> {
    let log = |name: &str| {
        let p = dir.join(name);
        std::fs::File::create(&p).map_err(|e| IoError::io(&p, e))
    };
    let mut command = std::process::Command::new(&argv[0]);
    command
        .args(&argv[1..])
        .envs(env)
        .stdin(std::process::Stdio::null())
        .stdout(log("stdout.log")?)
        .stderr(log("stderr.log")?);
    // Own process group, so stopping it reaches the launcher and everything it started.
    #[cfg(unix)]
    std::os::unix::process::CommandExt::process_group(&mut command, 0);
    if let Some(sig) = stop() {
        return Ok(LauncherEnd::Interrupted { signal: sig });
    }
    let mut child = match command.spawn() {
        Ok(c) => c,
        Err(e) => {
            return Ok(LauncherEnd::NotStarted {
                why: format!("could not start `{}`: {e}", argv[0]),
            });
        }
    };
    let grace = Duration::from_secs_f64(cmd.kill_grace_s);
    let start = Instant::now();
    let mut seen_steps = 0usize;
    let mut last_poll = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(s)) => {
                // The launcher is gone; anything it left in its group goes too.
                process_group::stop(child.id(), &mut child, Duration::ZERO);
                return Ok(exit_of(s));
            }
            Ok(None) => {}
            Err(e) => {
                process_group::stop(child.id(), &mut child, grace);
                return Ok(LauncherEnd::NotStarted {
                    why: format!("lost track of the launcher: {e}"),
                });
            }
        }
        if let Some(signal) = stop() {
            process_group::stop(child.id(), &mut child, grace);
            return Ok(LauncherEnd::Interrupted { signal });
        }
        if start.elapsed().as_secs_f64() > cmd.timeout_s {
            process_group::stop(child.id(), &mut child, grace);
            return Ok(LauncherEnd::TimedOut {
                after_s: cmd.timeout_s,
            });
        }
        if last_poll.elapsed() >= Duration::from_secs(1) {
            last_poll = Instant::now();
            if let Ok(read) = read_metrics(out_dir, &cmd.metrics) {
                for r in read.records.iter().skip(seen_steps) {
                    on_step(r);
                }
                seen_steps = seen_steps.max(read.records.len());
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn exit_of(s: std::process::ExitStatus) -> LauncherEnd {
    if let Some(code) = s.code() {
        return LauncherEnd::Exited { code };
    }
    #[cfg(unix)]
    if let Some(signal) = std::os::unix::process::ExitStatusExt::signal(&s) {
        return LauncherEnd::Signalled { signal };
    }
    LauncherEnd::Exited { code: -1 }
}

/// Stopping a launcher's process group and making sure nothing of it is left.
pub mod process_group {
    use std::time::{Duration, Instant};

    /// SIGTERM to the group, SIGKILL after `grace`, then wait until no process of the group is
    /// left (the launcher is reaped here; orphans are reaped by init once killed). Returns whether
    /// the group is gone.
    pub fn stop(pgid: u32, child: &mut std::process::Child, grace: Duration) -> bool {
        signal_group(pgid, libc::SIGTERM);
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            let _ = child.try_wait();
            if !alive(pgid) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        signal_group(pgid, libc::SIGKILL);
        let _ = child.wait();
        let deadline = Instant::now() + Duration::from_secs(10);
        while alive(pgid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        !alive(pgid)
    }

    fn signal_group(pgid: u32, sig: i32) {
        // SAFETY: killpg only sends a signal; the group is the one the launcher was started as.
        unsafe {
            libc::killpg(pgid as libc::pid_t, sig);
        }
    }

    /// Whether any process of the group is still alive: signal 0 checks without sending, and a
    /// zombie (dead, not yet reaped) is not counted as alive.
    pub fn alive(pgid: u32) -> bool {
        // SAFETY: signal 0 sends nothing.
        let exists = unsafe { libc::killpg(pgid as libc::pid_t, 0) } == 0;
        exists && members(pgid).iter().any(|(_, state)| *state != 'Z')
    }

    /// The processes of a group as (pid, state) from `/proc`.
    pub fn members(pgid: u32) -> Vec<(u32, char)> {
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        dir.filter_map(|e| e.ok())
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter_map(|pid| {
                let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
                // `pid (comm) state ppid pgrp ...`: comm may hold spaces and parentheses.
                let rest = &stat[stat.rfind(')')? + 2..];
                let mut f = rest.split_whitespace();
                let state = f.next()?.chars().next()?;
                let pgrp: u32 = f.nth(1)?.parse().ok()?;
                (pgrp == pgid).then_some((pid, state))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_fill_single_arguments_only() {
        let vals = BTreeMap::from([("seed".to_string(), "3; rm -rf /".to_string())]);
        assert_eq!(fill("--seed={seed}", &vals).unwrap(), "--seed=3; rm -rf /");
        assert!(
            fill("{nope}", &vals)
                .unwrap_err()
                .contains("unknown placeholder `{nope}`")
        );
    }

    fn read_with(steps: usize, nan_at: Option<usize>) -> MetricsRead {
        let mut text = String::new();
        for s in 0..steps {
            let r = if Some(s) == nan_at {
                "NaN".to_string()
            } else {
                "0.5".to_string()
            };
            text.push_str(&format!("{{\"step\": {s}, \"rollout/raw_reward\": {r}}}\n"));
        }
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("metrics.jsonl"), text).unwrap();
        read_metrics(d.path(), &MetricsMapping::default()).unwrap()
    }

    #[test]
    fn judge_never_calls_a_broken_run_ok() {
        let ok = LauncherEnd::Exited { code: 0 };
        assert_eq!(judge(&ok, &read_with(4, None), 4).0, RunStatus::Ok);
        let (s, why) = judge(&ok, &read_with(2, None), 4);
        assert_eq!(s, RunStatus::Failed);
        assert!(why.unwrap().contains("2 of 4"));
        let (s, why) = judge(&ok, &read_with(0, None), 4);
        assert_eq!(s, RunStatus::Failed);
        assert!(why.unwrap().contains("no metric rows"), "an empty file");
        let mut missing = read_with(4, None);
        missing.missing = vec!["typo.jsonl".into()];
        let (s, why) = judge(&ok, &missing, 4);
        assert_eq!(s, RunStatus::Failed);
        assert!(why.unwrap().contains("`typo.jsonl` were not written"));
        let (s, why) = judge(&ok, &read_with(4, Some(2)), 4);
        assert_eq!(s, RunStatus::Diverged);
        assert!(why.unwrap().contains("step 2"));
        let crash = LauncherEnd::Exited { code: 3 };
        assert_eq!(judge(&crash, &read_with(4, None), 4).0, RunStatus::Failed);
        let killed = LauncherEnd::Signalled { signal: 9 };
        let (s, why) = judge(&killed, &read_with(4, None), 4);
        assert_eq!(s, RunStatus::Failed);
        assert!(why.unwrap().contains("SIGKILL"));
        let t = LauncherEnd::TimedOut { after_s: 3.0 };
        assert_eq!(judge(&t, &read_with(1, None), 4).0, RunStatus::Timeout);
        let i = LauncherEnd::Interrupted { signal: 15 };
        let (s, why) = judge(&i, &read_with(4, Some(1)), 4);
        assert_eq!(
            s,
            RunStatus::Interrupted,
            "an interrupt is never a finished run"
        );
        assert!(why.unwrap().contains("SIGTERM"));
    }

    #[test]
    fn launcher_ends_round_trip_through_the_manifest() {
        for e in [
            LauncherEnd::Exited { code: 0 },
            LauncherEnd::Signalled { signal: 9 },
            LauncherEnd::TimedOut { after_s: 1.5 },
            LauncherEnd::Interrupted { signal: 2 },
            LauncherEnd::NotStarted { why: "x".into() },
        ] {
            let v = serde_json::to_value(&e).unwrap();
            assert_eq!(serde_json::from_value::<LauncherEnd>(v).unwrap(), e);
        }
    }
}

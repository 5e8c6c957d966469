//! The command engine: launches a real RL framework's job (argv from a template, never a shell),
//! with per-config environment variables and a timeout, then ingests the metrics files it wrote.
//!
//! Placeholders in argv elements: `{config}`, `{precision}` (the recipe name), `{backward}`,
//! `{seed}`, `{steps}`, `{out_dir}`, `{suite}`, any `vars` key of the configuration and any
//! workload key. Substitution happens inside single argv elements, so a value can never become a
//! second argument or a shell command.
//!
//! Metrics files (`[command.metrics] files = [...]`, relative to the run's `out/` folder):
//! JSON lines with a step key and numeric fields, CSV with a header, or the Miles CI form
//! `{"metric": NAME, "series": [[step, value], ...]}`. Names are mapped through
//! [`MILES_MAPPING`] and the suite's `[command.metrics.map]`; unmapped numeric keys are kept under
//! their own name. Junk lines and non-numeric values are skipped and counted in the manifest
//! (`extra.skipped_lines`), never turned into zeros.

use super::plan::RunSpec;
use super::spec::SuiteSpec;
use crate::engine::metrics::StepRecord;
use crate::io::IoError;
use crate::store::{Manifest, RunDir, RunStatus};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

/// Miles metric names and the lockstep keys they map to (identity where lockstep uses the same
/// name, which is the point: curves from a cluster and from the built-in engine line up).
pub const MILES_MAPPING: [(&str, &str); 16] = [
    ("rollout/raw_reward", "rollout/raw_reward"),
    ("rollout/rewards", "rollout/rewards"),
    ("rollout/response_len/mean", "rollout/response_len/mean"),
    ("rollout/truncated_ratio", "rollout/truncated_ratio"),
    (
        "train/train_rollout_logprob_abs_diff",
        "train/train_rollout_logprob_abs_diff",
    ),
    ("train/train_rollout_kl", "train/train_rollout_kl"),
    ("train/ppo_kl", "train/ppo_kl"),
    ("train/pg_clipfrac", "train/pg_clipfrac"),
    ("train/tis", "train/tis"),
    ("train/tis_clipfrac", "train/tis_clipfrac"),
    ("train/kl_loss", "train/kl_loss"),
    ("train/grad_norm", "train/grad_norm"),
    ("perf/rollout_time", "perf/rollout_time"),
    ("perf/train_time", "perf/train_time"),
    ("perf/step_time", "perf/step_time"),
    ("perf/log_probs_time", "perf/log_probs_time"),
];

fn tbl_str<'a>(t: &'a toml::Table, k: &str) -> Option<&'a str> {
    t.get(k).and_then(|v| v.as_str())
}

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
                "unknown placeholder `{{{key}}}` in `{template}`; known: {}",
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

/// Launch the run's command and ingest its metrics into `dir`. While it runs, the metrics files
/// are re-read about once a second and each new step is passed to `on_step` (live progress).
pub fn run_command(
    suite: &SuiteSpec,
    run: &RunSpec,
    dir: &Path,
    on_step: &dyn Fn(&StepRecord),
) -> Result<Manifest, IoError> {
    let cmd = suite.command.clone().unwrap_or_default();
    let rd = RunDir::create(dir)?;
    let out_dir = dir.join("out");
    std::fs::create_dir_all(&out_dir).map_err(|e| IoError::io(&out_dir, e))?;
    let vals = placeholders(suite, run, &out_dir);
    let config = serde_json::json!({"config": run.config, "argv": cmd.get("argv").map(|a| a.to_string()), "env": run.env, "vars": run.vars, "recipe": run.run.recipe.name});
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
    let argv: Vec<String> = cmd
        .get("argv")
        .and_then(|a| a.as_array())
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default();
    let argv: Result<Vec<String>, String> = argv.iter().map(|a| fill(a, &vals)).collect();
    let argv = match argv {
        Ok(a) if !a.is_empty() => a,
        Ok(_) => {
            return finish(
                rd,
                m,
                RunStatus::Failed,
                Some("[command] argv is empty".into()),
                vec![],
                0,
            );
        }
        Err(e) => return finish(rd, m, RunStatus::Failed, Some(e), vec![], 0),
    };
    let timeout = cmd
        .get("timeout_s")
        .and_then(|v| v.as_integer().map(|i| i as f64).or(v.as_float()))
        .unwrap_or(86_400.0);
    let mut env: BTreeMap<String, String> = cmd
        .get("env")
        .and_then(|e| e.as_table())
        .map(|t| {
            t.iter()
                .filter_map(|(k, v)| v.as_str().map(|s| (k.clone(), s.to_string())))
                .collect()
        })
        .unwrap_or_default();
    env.extend(run.env.clone());
    let stdout = std::fs::File::create(dir.join("stdout.log")).map_err(|e| IoError::io(dir, e))?;
    let stderr = std::fs::File::create(dir.join("stderr.log")).map_err(|e| IoError::io(dir, e))?;
    let mut command = std::process::Command::new(&argv[0]);
    command
        .args(&argv[1..])
        .envs(&env)
        .stdin(std::process::Stdio::null())
        .stdout(stdout)
        .stderr(stderr);
    // Own process group, so a timeout kills the launcher and everything it started.
    #[cfg(unix)]
    std::os::unix::process::CommandExt::process_group(&mut command, 0);
    let child = command.spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            return finish(
                rd,
                m,
                RunStatus::Failed,
                Some(format!("could not start `{}`: {e}", argv[0])),
                vec![],
                0,
            );
        }
    };
    let metrics = cmd
        .get("metrics")
        .and_then(|x| x.as_table())
        .cloned()
        .unwrap_or_default();
    let start = Instant::now();
    let mut seen_steps = 0usize;
    let mut last_poll = Instant::now();
    let (status, exit) = loop {
        match child.try_wait() {
            Ok(Some(s)) => {
                break (
                    if s.success() {
                        RunStatus::Ok
                    } else {
                        RunStatus::Failed
                    },
                    s.code(),
                );
            }
            Ok(None) if start.elapsed().as_secs_f64() > timeout => {
                kill_group(&mut child);
                break (RunStatus::Timeout, None);
            }
            Ok(None) => {
                if last_poll.elapsed() >= Duration::from_secs(1) {
                    last_poll = Instant::now();
                    if let Ok((records, _)) = ingest_dir(&out_dir, &metrics) {
                        for r in records.iter().skip(seen_steps) {
                            on_step(r);
                        }
                        seen_steps = seen_steps.max(records.len());
                    }
                }
                std::thread::sleep(Duration::from_millis(50))
            }
            Err(e) => return finish(rd, m, RunStatus::Failed, Some(e.to_string()), vec![], 0),
        }
    };
    m.extra.insert(
        "exit_code".into(),
        exit.map_or(serde_json::Value::Null, |c| c.into()),
    );
    m.extra.insert("timeout_s".into(), timeout.into());
    let tail = std::fs::read_to_string(dir.join("stderr.log")).unwrap_or_default();
    let tail: String = tail
        .lines()
        .rev()
        .take(20)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect::<Vec<_>>()
        .join("\n");
    m.extra.insert("stderr_tail".into(), tail.into());
    let (records, skipped) = match ingest_dir(&out_dir, &metrics) {
        Ok(x) => x,
        Err(e) => return finish(rd, m, RunStatus::Failed, Some(e), vec![], 0),
    };
    let error = match status {
        RunStatus::Timeout => Some(format!("timed out after {timeout} s")),
        RunStatus::Failed => Some(format!(
            "exit code {}",
            exit.map_or("none".into(), |c| c.to_string())
        )),
        _ => None,
    };
    finish(rd, m, status, error, records, skipped)
}

/// Kill the child's whole process group (it was started as its own group leader), then reap it.
fn kill_group(child: &mut std::process::Child) {
    #[cfg(unix)]
    {
        // argv, not a shell: `kill -KILL -- -PGID`.
        let _ = std::process::Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", child.id())])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
    }
    let _ = child.kill();
    let _ = child.wait();
}

fn finish(
    rd: RunDir,
    mut m: Manifest,
    status: RunStatus,
    error: Option<String>,
    records: Vec<StepRecord>,
    skipped: usize,
) -> Result<Manifest, IoError> {
    rd.write_metrics(&records)?;
    m.status = status;
    m.error = error;
    m.steps_done = records.len();
    m.extra.insert("skipped_lines".into(), skipped.into());
    m.finished = Some(crate::store::run::now_utc());
    rd.write_manifest(&m)?;
    Ok(m)
}

/// Read every metrics file named by the mapping under `root`; returns step records and the count
/// of skipped lines/values.
pub fn ingest_dir(root: &Path, mapping: &toml::Table) -> Result<(Vec<StepRecord>, usize), String> {
    let files: Vec<String> = mapping
        .get("files")
        .and_then(|f| f.as_array())
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_else(|| vec!["metrics.jsonl".to_string()]);
    let step_key = tbl_str(mapping, "step").unwrap_or("step").to_string();
    let mut map: BTreeMap<String, String> = MILES_MAPPING
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    if let Some(t) = mapping.get("map").and_then(|m| m.as_table()) {
        for (k, v) in t {
            if let Some(v) = v.as_str() {
                map.insert(k.clone(), v.to_string());
            }
        }
    }
    let mut steps: BTreeMap<u64, BTreeMap<String, f64>> = BTreeMap::new();
    let mut skipped = 0;
    for f in files {
        crate::suite::runner::safe_relative(&f)
            .map_err(|why| format!("metrics file `{f}`: {why}"))?;
        let path = root.join(&f);
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        if f.ends_with(".csv") {
            skipped += ingest_csv(&text, &step_key, &map, &mut steps)
                .map_err(|e| format!("{}: {e}", path.display()))?;
        } else {
            skipped += ingest_jsonl(&text, &step_key, &map, &mut steps);
        }
    }
    let records = steps
        .into_iter()
        .map(|(s, scalars)| StepRecord {
            step: s as usize,
            scalars,
            ..Default::default()
        })
        .collect();
    Ok((records, skipped))
}

fn put(
    steps: &mut BTreeMap<u64, BTreeMap<String, f64>>,
    map: &BTreeMap<String, String>,
    step: u64,
    name: &str,
    v: f64,
) {
    let key = map.get(name).cloned().unwrap_or_else(|| name.to_string());
    steps.entry(step).or_default().insert(key, v);
}

fn ingest_jsonl(
    text: &str,
    step_key: &str,
    map: &BTreeMap<String, String>,
    steps: &mut BTreeMap<u64, BTreeMap<String, f64>>,
) -> usize {
    let mut skipped = 0;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let Ok(serde_json::Value::Object(o)) = serde_json::from_str::<serde_json::Value>(line)
        else {
            skipped += 1;
            continue;
        };
        if let (Some(name), Some(series)) = (
            o.get("metric").and_then(|m| m.as_str()),
            o.get("series").and_then(|s| s.as_array()),
        ) {
            for pt in series {
                match pt.as_array().map(|p| {
                    (
                        p.first().and_then(|s| s.as_u64()),
                        p.get(1).and_then(|v| v.as_f64()),
                    )
                }) {
                    Some((Some(s), Some(v))) => put(steps, map, s, name, v),
                    _ => skipped += 1,
                }
            }
            continue;
        }
        let Some(step) = o.get(step_key).and_then(|s| s.as_u64()) else {
            skipped += 1;
            continue;
        };
        for (k, v) in &o {
            if k == step_key {
                continue;
            }
            match v.as_f64() {
                Some(x) => put(steps, map, step, k, x),
                None => skipped += 1,
            }
        }
    }
    skipped
}

fn ingest_csv(
    text: &str,
    step_key: &str,
    map: &BTreeMap<String, String>,
    steps: &mut BTreeMap<u64, BTreeMap<String, f64>>,
) -> Result<usize, String> {
    let mut r = csv::ReaderBuilder::new()
        .flexible(true)
        .from_reader(text.as_bytes());
    let headers = r.headers().map_err(|e| e.to_string())?.clone();
    let si = headers.iter().position(|h| h == step_key).ok_or_else(|| {
        format!(
            "no `{step_key}` column (columns: {})",
            headers.iter().collect::<Vec<_>>().join(", ")
        )
    })?;
    let mut skipped = 0;
    for rec in r.records() {
        let Ok(rec) = rec else {
            skipped += 1;
            continue;
        };
        let Some(step) = rec.get(si).and_then(|s| s.trim().parse::<u64>().ok()) else {
            skipped += 1;
            continue;
        };
        for (i, h) in headers.iter().enumerate() {
            if i == si {
                continue;
            }
            match rec.get(i).map(|s| s.trim().parse::<f64>()) {
                Some(Ok(v)) => put(steps, map, step, h, v),
                Some(Err(_)) | None => skipped += 1,
            }
        }
    }
    Ok(skipped)
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

    #[test]
    fn ingests_jsonl_csv_and_miles_series_counting_junk() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("m.jsonl"), "{\"step\": 0, \"rollout/raw_reward\": 0.5, \"note\": \"x\"}\nnot json\n{\"step\": 1, \"rollout/raw_reward\": 0.6}\n{\"metric\": \"train/grad_norm\", \"series\": [[0, 1.5], [1, \"bad\"]]}\n").unwrap();
        std::fs::write(
            d.path().join("m.csv"),
            "step,train/train_rollout_kl\n0,0.001\n1,abc\n",
        )
        .unwrap();
        let mapping: toml::Table = toml::from_str("files = [\"m.jsonl\", \"m.csv\"]\n[map]\n\"rollout/raw_reward\" = \"rollout/raw_reward\"\n").unwrap();
        let (recs, skipped) = ingest_dir(d.path(), &mapping).unwrap();
        assert_eq!(recs.len(), 2);
        assert_eq!(recs[0].get("rollout/raw_reward"), Some(0.5));
        assert_eq!(recs[0].get("train/grad_norm"), Some(1.5));
        assert_eq!(recs[0].get("train/train_rollout_kl"), Some(0.001));
        assert_eq!(
            recs[1].get("train/train_rollout_kl"),
            None,
            "a non-numeric value is skipped, not 0"
        );
        assert_eq!(skipped, 4); // "note", "not json", the "bad" point, "abc"
        let bad: toml::Table = toml::from_str("files = [\"../../etc/passwd\"]").unwrap();
        assert!(ingest_dir(d.path(), &bad).is_err());
    }
}

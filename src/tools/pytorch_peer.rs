//! The PyTorch-eager peer of `lockstep bench engine`: `bench/pytorch_step.py`, the same GRPO step
//! written in plain PyTorch, run in the same call so the ratio is measured side by side.
//!
//! The script prints one JSON object per recipe with `--json`. A machine without Python or
//! torch gets a line saying so and how to install them, never a silent skip; a peer that ran
//! and failed is an error.

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use std::path::Path;
use std::process::Command;

/// One recipe's median seconds per step in the peer, by phase.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct PeerRow {
    pub recipe: String,
    pub torch: String,
    pub threads: usize,
    pub step: f64,
    pub export: f64,
    pub rollout: f64,
    pub train: f64,
}

/// What running the peer gave.
#[derive(Debug, Clone, PartialEq)]
pub enum Peer {
    Ran(Vec<PeerRow>),
    /// Python or torch is not installed: why, and the fix.
    Unavailable(String),
}

/// Runs `python script --json --recipe R1,R2 --steps N --threads T` (an argument list, no shell)
/// and reads its rows. Python missing or torch not importable gives [`Peer::Unavailable`]; any
/// other failure, or output that is not one row per recipe, is an error.
pub fn run_peer(
    python: &Path,
    script: &Path,
    recipes: &[&str],
    steps: usize,
    threads: usize,
) -> Result<Peer> {
    if !script.is_file() {
        bail!(
            "{} not found: run from the repository root or pass --pytorch-script",
            script.display()
        );
    }
    let out = match Command::new(python)
        .arg(script)
        .arg("--json")
        .args(["--recipe", &recipes.join(",")])
        .args(["--steps", &steps.to_string()])
        .args(["--threads", &threads.to_string()])
        .output()
    {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(Peer::Unavailable(format!(
                "{} not found: install Python 3 with `pip install torch numpy`, or pass --python",
                python.display()
            )));
        }
        Err(e) => return Err(e).with_context(|| format!("starting {}", python.display())),
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        if stderr.contains("No module named 'torch'") {
            return Ok(Peer::Unavailable(format!(
                "torch is not installed for {}: `pip install torch numpy`",
                python.display()
            )));
        }
        let tail: Vec<&str> = stderr.lines().rev().take(5).collect();
        bail!(
            "the PyTorch peer failed ({}): {}",
            out.status,
            tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let rows = parse_rows(&stdout)?;
    let got: Vec<&str> = rows.iter().map(|r| r.recipe.as_str()).collect();
    if got != recipes {
        bail!("the PyTorch peer timed {got:?}, not the recipes asked for ({recipes:?})");
    }
    Ok(Peer::Ran(rows))
}

/// The peer's JSON lines (other lines are ignored), each checked to hold finite, positive times.
fn parse_rows(stdout: &str) -> Result<Vec<PeerRow>> {
    let mut rows = Vec::new();
    for (i, line) in stdout.lines().enumerate() {
        if !line.trim_start().starts_with('{') {
            continue;
        }
        let row: PeerRow = serde_json::from_str(line)
            .with_context(|| format!("the PyTorch peer's line {}: {line}", i + 1))?;
        let times = [row.step, row.export, row.rollout, row.train];
        if times.iter().any(|t| !t.is_finite() || *t < 0.0) || row.step <= 0.0 {
            bail!(
                "the PyTorch peer's line {} has a time that is not a positive number: {line}",
                i + 1
            );
        }
        rows.push(row);
    }
    Ok(rows)
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// An executable standing in for Python: a shell script with `body`.
    fn fake_python(dir: &Path, body: &str) -> std::path::PathBuf {
        let p = dir.join("python");
        std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }

    fn script(dir: &Path) -> std::path::PathBuf {
        let s = dir.join("pytorch_step.py");
        std::fs::write(&s, "# stand-in").unwrap();
        s
    }

    #[test]
    fn rows_are_read_one_per_recipe_and_arguments_passed_as_a_list() {
        let d = tempfile::tempdir().unwrap();
        // Echoes its arguments on a line of its own, then one row per recipe.
        let py = fake_python(
            d.path(),
            r#"echo "args: $*"
echo '{"recipe": "bf16", "torch": "2.9", "threads": 2, "step": 1.5, "export": 0.03, "rollout": 0.5, "train": 0.9}'
echo '{"recipe": "nvfp4-dq", "torch": "2.9", "threads": 2, "step": 2.5, "export": 0.2, "rollout": 1.0, "train": 1.2}'"#,
        );
        let peer = run_peer(&py, &script(d.path()), &["bf16", "nvfp4-dq"], 3, 2).unwrap();
        let Peer::Ran(rows) = peer else {
            panic!("{peer:?}")
        };
        assert_eq!(rows.len(), 2);
        assert_eq!((rows[1].recipe.as_str(), rows[1].step), ("nvfp4-dq", 2.5));
    }

    #[test]
    fn a_missing_interpreter_or_torch_says_how_to_install_them() {
        let d = tempfile::tempdir().unwrap();
        let s = script(d.path());
        let none = run_peer(&d.path().join("no-python"), &s, &["bf16"], 1, 2).unwrap();
        assert!(matches!(&none, Peer::Unavailable(m) if m.contains("pip install torch")));
        let py = fake_python(
            d.path(),
            "echo \"ModuleNotFoundError: No module named 'torch'\" >&2; exit 1",
        );
        let no_torch = run_peer(&py, &s, &["bf16"], 1, 2).unwrap();
        assert!(matches!(&no_torch, Peer::Unavailable(m) if m.contains("torch is not installed")));
    }

    #[test]
    fn a_failed_or_short_or_nonsense_peer_is_an_error_not_a_skip() {
        let d = tempfile::tempdir().unwrap();
        let s = script(d.path());
        let crash = fake_python(d.path(), "echo 'AssertionError: boom' >&2; exit 1");
        let e = run_peer(&crash, &s, &["bf16"], 1, 2).unwrap_err();
        assert!(e.to_string().contains("boom"), "{e}");
        let short = fake_python(
            d.path(),
            r#"echo '{"recipe": "bf16", "torch": "2.9", "threads": 2, "step": 1.5, "export": 0.03, "rollout": 0.5, "train": 0.9}'"#,
        );
        let e = run_peer(&short, &s, &["bf16", "mxfp8"], 1, 2).unwrap_err();
        assert!(e.to_string().contains("not the recipes asked for"), "{e}");
        let nan = fake_python(
            d.path(),
            r#"echo '{"recipe": "bf16", "torch": "2.9", "threads": 2, "step": -1, "export": 0.03, "rollout": 0.5, "train": 0.9}'"#,
        );
        assert!(run_peer(&nan, &s, &["bf16"], 1, 2).is_err());
        let e = run_peer(&crash, &d.path().join("missing.py"), &["bf16"], 1, 2).unwrap_err();
        assert!(e.to_string().contains("repository root"), "{e}");
    }
}

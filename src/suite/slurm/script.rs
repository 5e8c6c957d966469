//! The sbatch script of one job array: `#SBATCH` options from the suite's `[slurm]` table and
//! the command line, then a body that maps `SLURM_ARRAY_TASK_ID` to a run id through `runs.txt`
//! and `exec`s the lockstep binary's `run-one --suite FILE --run-id ID --store DIR`, so each task
//! runs exactly the per-run code of a local `lockstep run`.

use super::SlurmSpec;
use super::ctl::SlurmError;
use std::fmt::Write;
use std::path::PathBuf;

/// Everything the script names (absolute paths: tasks start in another process, maybe on
/// another node that sees the same shared file system).
#[derive(Debug, Clone)]
pub struct ScriptInput {
    pub job_name: String,
    pub tasks: usize,
    /// At most this many tasks at once (`--array=0-N%M`).
    pub max_parallel: Option<usize>,
    pub sbatch: SlurmSpec,
    pub logs: PathBuf,
    pub runs_file: PathBuf,
    pub workdir: PathBuf,
    pub exe: PathBuf,
    pub suite_file: PathBuf,
    pub store: PathBuf,
    pub cache: PathBuf,
    pub force: bool,
    /// `--device` for the tasks' built-in engine (`cuda`, `cuda:N`); `None` keeps run-one's default.
    pub device: Option<String>,
}

/// `s` as one bash word.
pub fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// An `#SBATCH` value: double-quoted when it has spaces (sbatch honours the quotes); quotes and
/// newlines cannot be written there at all.
fn sbatch_value(what: &str, v: &str) -> Result<String, SlurmError> {
    if v.contains(['"', '\n', '\r']) {
        return Err(SlurmError::Invalid(format!(
            "{what} `{v}` contains a quote or newline, which an #SBATCH line cannot hold"
        )));
    }
    Ok(if v.contains(char::is_whitespace) {
        format!("\"{v}\"")
    } else {
        v.to_string()
    })
}

/// The script text.
pub fn render(i: &ScriptInput) -> Result<String, SlurmError> {
    if i.tasks == 0 {
        return Err(SlurmError::Invalid("no runs to submit".into()));
    }
    let mut opts: Vec<(String, String)> = vec![
        ("--job-name".into(), i.job_name.clone()),
        (
            "--array".into(),
            match i.max_parallel {
                Some(m) => format!("0-{}%{}", i.tasks - 1, m.max(1)),
                None => format!("0-{}", i.tasks - 1),
            },
        ),
        (
            "--output".into(),
            i.logs.join("%A_%a.out").display().to_string(),
        ),
        ("--chdir".into(), i.workdir.display().to_string()),
        ("--ntasks".into(), "1".into()),
    ];
    let s = &i.sbatch;
    if let Some(p) = &s.partition {
        opts.push(("--partition".into(), p.clone()));
    }
    if let Some(a) = &s.account {
        opts.push(("--account".into(), a.clone()));
    }
    if let Some(t) = &s.time {
        opts.push(("--time".into(), t.clone()));
    }
    if let Some(g) = s.gpus_per_run.filter(|g| *g > 0) {
        opts.push(("--gres".into(), format!("gpu:{g}")));
    }
    if let Some(c) = s.cpus_per_run {
        opts.push(("--cpus-per-task".into(), c.to_string()));
    }
    if let Some(m) = &s.mem {
        opts.push(("--mem".into(), m.clone()));
    }
    let mut out = String::new();
    let _ = writeln!(out, "#!/bin/bash");
    let _ = writeln!(
        out,
        "# lockstep {}: one array task per run; task N runs the run id on line N+1 of runs.txt.",
        env!("CARGO_PKG_VERSION")
    );
    let _ = writeln!(
        out,
        "# Resubmit with `lockstep run SUITE --executor slurm` (it skips finished and queued runs), not by hand."
    );
    for (k, v) in &opts {
        let _ = writeln!(out, "#SBATCH {k}={}", sbatch_value(k, v)?);
    }
    for a in &s.sbatch_args {
        if !a.starts_with('-') {
            return Err(SlurmError::Invalid(format!(
                "sbatch argument `{a}` must be an option starting with `-`, e.g. --qos=high"
            )));
        }
        let line = match a.split_once('=') {
            Some((k, v)) => format!("{k}={}", sbatch_value("sbatch argument", v)?),
            None => sbatch_value("sbatch argument", a)?,
        };
        let _ = writeln!(out, "#SBATCH {line}");
    }
    let _ = writeln!(out, "set -euo pipefail");
    let _ = writeln!(
        out,
        "# Engines use the CPUs Slurm granted (all of the node's when --cpus-per-task is unset)."
    );
    let _ = writeln!(
        out,
        "export RAYON_NUM_THREADS=\"${{SLURM_CPUS_PER_TASK:-$(nproc)}}\""
    );
    let _ = writeln!(out, "mapfile -t RUNS < {}", sh_quote(&path(&i.runs_file)));
    let _ = writeln!(out, "RUN_ID=\"${{RUNS[$SLURM_ARRAY_TASK_ID]:-}}\"");
    let _ = writeln!(
        out,
        "if [ -z \"$RUN_ID\" ]; then echo \"lockstep: array task $SLURM_ARRAY_TASK_ID has no line in runs.txt\" >&2; exit 2; fi"
    );
    let mut cmd = vec![
        sh_quote(&path(&i.exe)),
        "run-one".into(),
        "--suite".into(),
        sh_quote(&path(&i.suite_file)),
        "--run-id".into(),
        "\"$RUN_ID\"".into(),
        "--store".into(),
        sh_quote(&path(&i.store)),
        "--cache".into(),
        sh_quote(&path(&i.cache)),
    ];
    if i.force {
        cmd.push("--force".into());
    }
    if let Some(d) = &i.device {
        cmd.push("--device".into());
        cmd.push(sh_quote(d));
    }
    let _ = writeln!(out, "exec {}", cmd.join(" "));
    Ok(out)
}

fn path(p: &std::path::Path) -> String {
    p.display().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input() -> ScriptInput {
        ScriptInput {
            job_name: "lockstep-smoke-1".into(),
            tasks: 4,
            max_parallel: None,
            sbatch: SlurmSpec {
                partition: Some("gpu".into()),
                gpus_per_run: Some(1),
                time: Some("01:00:00".into()),
                account: Some("ml".into()),
                sbatch_args: vec!["--qos=high".into(), "--exclusive".into()],
                ..Default::default()
            },
            logs: "/s/runs/smoke/.slurm/x/logs".into(),
            runs_file: "/s/runs/smoke/.slurm/x/runs.txt".into(),
            workdir: "/s".into(),
            exe: "/opt/it's/lockstep".into(),
            suite_file: "/s/suites/smoke.toml".into(),
            store: "/s/runs".into(),
            cache: "/s/runs/cache".into(),
            force: false,
            device: None,
        }
    }

    #[test]
    fn script_has_the_options_and_maps_the_task_to_its_run() {
        let s = render(&input()).unwrap();
        for line in [
            "#SBATCH --job-name=lockstep-smoke-1\n",
            "#SBATCH --array=0-3\n",
            "#SBATCH --output=/s/runs/smoke/.slurm/x/logs/%A_%a.out\n",
            "#SBATCH --partition=gpu\n",
            "#SBATCH --account=ml\n",
            "#SBATCH --time=01:00:00\n",
            "#SBATCH --gres=gpu:1\n",
            "#SBATCH --qos=high\n",
            "#SBATCH --exclusive\n",
            "mapfile -t RUNS < '/s/runs/smoke/.slurm/x/runs.txt'\n",
            "exec '/opt/it'\\''s/lockstep' run-one --suite '/s/suites/smoke.toml' --run-id \"$RUN_ID\" --store '/s/runs' --cache '/s/runs/cache'\n",
        ] {
            assert!(s.contains(line), "missing {line:?} in\n{s}");
        }
        assert!(s.starts_with("#!/bin/bash\n"));
        assert!(!s.contains("--force") && !s.contains("#SBATCH --cpus-per-task"));
    }

    #[test]
    fn throttle_force_and_spaces() {
        let mut i = input();
        i.max_parallel = Some(2);
        i.force = true;
        i.device = Some("cuda:1".into());
        i.logs = "/a b/logs".into();
        let s = render(&i).unwrap();
        assert!(s.contains("#SBATCH --array=0-3%2\n"), "{s}");
        assert!(s.contains(" --force --device 'cuda:1'\n"), "{s}");
        assert!(
            s.contains("#SBATCH --output=\"/a b/logs/%A_%a.out\"\n"),
            "{s}"
        );
    }

    #[test]
    fn unwritable_options_are_refused() {
        let mut i = input();
        i.sbatch.sbatch_args = vec!["qos=high".into()];
        assert!(
            render(&i)
                .unwrap_err()
                .to_string()
                .contains("starting with `-`")
        );
        let mut i = input();
        i.sbatch.partition = Some("gpu\n#SBATCH --x".into());
        assert!(render(&i).unwrap_err().to_string().contains("newline"));
        let mut i = input();
        i.tasks = 0;
        assert!(render(&i).is_err());
    }
}

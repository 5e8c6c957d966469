//! The suite file format. Unknown keys are errors with file, line and column (and the nearest
//! known key); values are checked when the suite is expanded (`suite check`).
//!
//! ```toml
//! name = "smoke"
//! engine = "builtin"              # or "command"
//! seeds = [0, 1]
//! [workload]
//! model = "tiny"                  # tiny | small
//! task = "add:2"
//! prompts_per_step = 8
//! samples_per_prompt = 8
//! max_response_tokens = 5
//! steps = 30
//! policy_lag = 0                  # rollouts sample from the policy this many steps old
//! [workload.warm_start]           # optional: the supervised warm start's settings
//! lr = 1e-3
//! [[configs]]
//! name = "nvfp4-dq"
//! recipe = "nvfp4-dq"             # preset or recipe file (relative to the suite file)
//! bf16_last = 2                   # optional overrides (also policy_lag)
//! variants = [{ policy_lag = 1 }, { task = "sort:4" }]   # also run as `nvfp4-dq [policy_lag=1]`...
//! [sweep]                         # optional axes: every combination is run
//! bf16_last = [2, 4, 8]
//! [checks]                        # used by `lockstep compare`
//! margin = 0.05
//! [[claims]]                      # optional: published findings `compare` decides
//! name = "mismatch-up"             # (see `compare::claims` for every key)
//! statement = "Low-precision training raises train-rollout mismatch over BF16."
//! source = "Miles low-precision RL ablation, July 2026"
//! expect = "higher"
//! metric = "train/train_rollout_kl"
//! configs = ["nvfp4*"]
//! [slurm]                         # optional defaults for `--executor slurm`
//! partition = "gpu"
//! gpus_per_run = 1
//! time = "02:00:00"
//! ```

use crate::recipe::presets::suggest;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A whole suite file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SuiteSpec {
    pub name: String,
    #[serde(default)]
    pub description: String,
    #[serde(default = "default_engine")]
    pub engine: String,
    pub seeds: Vec<u64>,
    pub workload: Workload,
    pub configs: Vec<ConfigSpec>,
    #[serde(default)]
    pub sweep: Sweep,
    /// Checks and thresholds for `compare`/`nightly`, kept as TOML for the comparison module.
    #[serde(default)]
    pub checks: toml::Table,
    /// `[[claims]]`: published findings the comparison decides, kept as TOML for the comparison
    /// module (which reads them with their positions in the file).
    #[serde(default)]
    pub claims: Vec<toml::Table>,
    /// Command engine settings (engine = "command").
    #[serde(default)]
    pub command: Option<CommandSpec>,
    /// Where an `engine = "ingest"` suite finds its runs, and how to read them.
    #[serde(default)]
    pub ingest: Option<super::ingest::IngestMapping>,
    /// Defaults for `lockstep run --executor slurm` (command-line flags override them).
    #[serde(default)]
    pub slurm: super::slurm::SlurmSpec,
    /// Where the file was read from (recipe files resolve relative to it).
    #[serde(skip)]
    pub path: PathBuf,
}

fn default_engine() -> String {
    "builtin".into()
}

/// `[command]`: how the command engine launches a framework's job. Every key is typed and
/// unknown keys are errors, so `timeout = 60` (meant `timeout_s`) cannot silently mean 24 h.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommandSpec {
    /// The launcher and its arguments, each a string with `{placeholders}` (never a shell line).
    pub argv: Vec<String>,
    /// Environment for every run (a configuration's `env` adds to and overrides it).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Placeholder defaults for every run (a configuration's `vars` override them).
    #[serde(default)]
    pub vars: BTreeMap<String, String>,
    /// Wall-clock limit per run; the launcher's process group is then stopped.
    #[serde(default = "default_timeout_s")]
    pub timeout_s: f64,
    /// Seconds between SIGTERM and SIGKILL when a run is stopped (timeout or interrupt).
    #[serde(default = "default_kill_grace_s")]
    pub kill_grace_s: f64,
    /// How to read what the launcher writes into `{out_dir}`.
    #[serde(default)]
    pub metrics: super::metrics::MetricsMapping,
}

fn default_timeout_s() -> f64 {
    86_400.0
}

fn default_kill_grace_s() -> f64 {
    10.0
}

impl CommandSpec {
    /// The checks `serde` cannot make.
    fn validate(&self) -> Result<(), String> {
        if self.argv.first().is_none_or(|a| a.trim().is_empty()) {
            return Err("[command] argv is empty: name the launcher first, e.g. argv = [\"python\", \"train.py\", \"--seed={seed}\"]".into());
        }
        if !(self.timeout_s.is_finite() && self.timeout_s > 0.0) {
            return Err(format!(
                "[command] timeout_s = {}: use a positive number of seconds",
                self.timeout_s
            ));
        }
        if !(self.kill_grace_s.is_finite() && (0.0..=3600.0).contains(&self.kill_grace_s)) {
            return Err(format!(
                "[command] kill_grace_s = {}: use 0 to 3600 seconds",
                self.kill_grace_s
            ));
        }
        self.metrics
            .validate()
            .map_err(|e| format!("[command.metrics] {e}"))
    }
}
/// What every run of the suite does.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    #[serde(default = "default_model")]
    pub model: String,
    #[serde(default = "default_task")]
    pub task: String,
    #[serde(default)]
    pub prompts_per_step: Option<usize>,
    #[serde(default)]
    pub samples_per_prompt: Option<usize>,
    #[serde(default)]
    pub max_response_tokens: Option<usize>,
    pub steps: usize,
    /// Learning rate override.
    #[serde(default)]
    pub lr: Option<f32>,
    #[serde(default)]
    pub routing_replay: Option<bool>,
    #[serde(default)]
    pub eval_every: Option<usize>,
    /// Asynchronous RL: each rollout samples from the policy this many steps old (default 0).
    #[serde(default)]
    pub policy_lag: Option<usize>,
    /// The supervised warm start (`[workload.warm_start]`); every key optional. The defaults suit
    /// `tiny`; `small` needs `lr = 1e-3` (at 3e-3 it stays near 0 % on add:3).
    #[serde(default)]
    pub warm_start: Option<crate::engine::warmstart::WarmStartConfig>,
}

fn default_model() -> String {
    "tiny".into()
}
fn default_task() -> String {
    "add:2".into()
}

/// One configuration: a recipe plus overrides.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigSpec {
    pub name: String,
    pub recipe: String,
    #[serde(default)]
    pub bf16_last: Option<usize>,
    #[serde(default)]
    pub bf16_first: Option<usize>,
    #[serde(default)]
    pub backward: Option<String>,
    #[serde(default)]
    pub shared_experts_bf16: Option<bool>,
    /// none | per-tensor-nvfp4 | shards:N | mxfp8-floor-scale
    #[serde(default)]
    pub contract_break: Option<String>,
    /// Overrides the workload's `policy_lag` for this configuration.
    #[serde(default)]
    pub policy_lag: Option<usize>,
    /// The configuration again under other workload conditions, each run as `NAME [key=value]`
    /// and compared with the baseline's variant under the same conditions.
    #[serde(default)]
    pub variants: Vec<Variant>,
    /// Environment variables for the command engine (the NVFP4 recipe is driven by them).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Extra placeholders for the command engine's argv template.
    #[serde(default)]
    pub vars: BTreeMap<String, String>,
}

/// One variant of a configuration (`variants = [{ policy_lag = 1 }, { task = "sort:4" }]`): the
/// workload keys it changes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Variant {
    #[serde(default)]
    pub policy_lag: Option<usize>,
    #[serde(default)]
    pub task: Option<String>,
}

impl Variant {
    /// The variant as axes of its runs (`policy_lag`, `task`).
    pub fn axes(&self) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        if let Some(lag) = self.policy_lag {
            out.insert("policy_lag".to_string(), lag.to_string());
        }
        if let Some(task) = &self.task {
            out.insert("task".to_string(), task.clone());
        }
        out
    }
}

/// Axes only variants set: a configuration named without them means its plain runs.
pub const VARIANT_AXES: [&str; 2] = ["policy_lag", "task"];

/// Sweep axes: each present axis multiplies the run list.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sweep {
    #[serde(default)]
    pub bf16_last: Vec<usize>,
    #[serde(default)]
    pub bf16_first: Vec<usize>,
    #[serde(default)]
    pub shared_experts_bf16: Vec<bool>,
    #[serde(default)]
    pub backward: Vec<String>,
}

/// A suite that cannot be used, with where and how to fix it.
#[derive(Debug, thiserror::Error)]
pub enum SuiteError {
    #[error("{path}: {err}")]
    Io { path: String, err: std::io::Error },
    #[error("{path}: {msg}")]
    Parse { path: String, msg: String },
    #[error("{path}: {msg}")]
    Invalid { path: String, msg: String },
}

const TOP_KEYS: [&str; 12] = [
    "name",
    "description",
    "engine",
    "seeds",
    "workload",
    "configs",
    "sweep",
    "checks",
    "claims",
    "command",
    "ingest",
    "slurm",
];
const OTHER_KEYS: [&str; 36] = [
    "model",
    "task",
    "prompts_per_step",
    "samples_per_prompt",
    "max_response_tokens",
    "steps",
    "lr",
    "routing_replay",
    "eval_every",
    "policy_lag",
    "warm_start",
    "max_steps",
    "batch",
    "target_accuracy",
    "eval_prompts",
    "seed",
    "recipe",
    "bf16_last",
    "bf16_first",
    "backward",
    "shared_experts_bf16",
    "contract_break",
    "variants",
    "env",
    "vars",
    "margin",
    "tail",
    "argv",
    "timeout_s",
    "partition",
    "gpus_per_run",
    "cpus_per_run",
    "time",
    "account",
    "mem",
    "sbatch_args",
];

/// Read a suite file.
pub fn load(path: &Path) -> Result<SuiteSpec, SuiteError> {
    let text = std::fs::read_to_string(path).map_err(|err| SuiteError::Io {
        path: path.display().to_string(),
        err,
    })?;
    parse(&text, path)
}

/// Parse suite text (`path` names errors and anchors relative recipe files).
pub fn parse(text: &str, path: &Path) -> Result<SuiteSpec, SuiteError> {
    let mut s: SuiteSpec = toml::from_str(text).map_err(|e| {
        let (at, what) = crate::io::toml_error(path, text, &e);
        SuiteError::Parse {
            path: at,
            msg: hint(what),
        }
    })?;
    s.path = path.to_path_buf();
    let bad = |msg: String| SuiteError::Invalid {
        path: path.display().to_string(),
        msg,
    };
    if s.seeds.is_empty() {
        return Err(bad(
            "`seeds` is empty: list at least one seed, e.g. seeds = [0, 1]".into(),
        ));
    }
    if s.configs.is_empty() {
        return Err(bad(
            "no [[configs]]: add at least one, e.g. [[configs]] name = \"bf16\" recipe = \"bf16\""
                .into(),
        ));
    }
    let mut names = std::collections::BTreeSet::new();
    for c in &s.configs {
        if !names.insert(c.name.as_str()) {
            return Err(bad(format!(
                "two [[configs]] are named `{}`; names must be unique",
                c.name
            )));
        }
    }
    match s.engine.as_str() {
        "builtin" | "command" | "ingest" => {}
        other => {
            return Err(bad(format!(
                "engine = \"{other}\": use \"builtin\", \"command\" or \"ingest\""
            )));
        }
    }
    match (&s.command, s.engine.as_str()) {
        (None, "command") => {
            return Err(bad(
                "engine = \"command\" needs a [command] table with argv".into(),
            ));
        }
        (Some(c), "command") => c.validate().map_err(bad)?,
        (Some(_), e) => {
            return Err(bad(format!(
                "[command] is only read with engine = \"command\" (this suite's engine is \"{e}\"); remove it or set the engine"
            )));
        }
        (None, _) => {}
    }
    match (&s.ingest, s.engine.as_str()) {
        (None, "ingest") => {
            return Err(bad(
                "engine = \"ingest\" needs an [ingest] table with tree (the folder holding the runs) and path_pattern or meta_file".into(),
            ));
        }
        (Some(i), "ingest") => {
            if i.tree.is_none() {
                return Err(bad(
                    "[ingest] needs tree = \"DIR\": the folder holding the runs (relative to the suite file)".into(),
                ));
            }
            i.metrics
                .validate()
                .map_err(|e| bad(format!("[ingest.metrics] {e}")))?;
        }
        (Some(_), e) => {
            return Err(bad(format!(
                "[ingest] is only read with engine = \"ingest\" (this suite's engine is \"{e}\"); remove it or set the engine"
            )));
        }
        (None, _) => {}
    }
    Ok(s)
}

/// Add "did you mean" to an unknown-key error, choosing among the keys of the table the key was
/// found in (serde lists them as "expected one of ..."), so a top-level `seed` is not told to
/// become `seed`.
fn hint(msg: String) -> String {
    let Some(start) = msg.find("unknown field `") else {
        return msg.trim_end().to_string();
    };
    let field = msg[start + 15..].split('`').next().unwrap_or("");
    let expected: Vec<&str> = msg
        .split_once("expected one of ")
        .or_else(|| msg.split_once("expected "))
        .map(|(_, list)| {
            list.lines()
                .next()
                .unwrap_or("")
                .split('`')
                .skip(1)
                .step_by(2)
                .collect()
        })
        .unwrap_or_default();
    let all: Vec<&str> = if expected.is_empty() {
        TOP_KEYS.iter().chain(OTHER_KEYS.iter()).copied().collect()
    } else {
        expected
    };
    match suggest(field, &all).filter(|s| *s != field) {
        Some(s) => format!("{} (did you mean `{s}`?)", msg.trim_end()),
        None => msg.trim_end().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OK: &str = "name = \"t\"\nseeds = [0, 1]\n[workload]\nsteps = 3\n[[configs]]\nname = \"bf16\"\nrecipe = \"bf16\"\n";

    #[test]
    fn parses_and_reports_position_of_bad_keys() {
        let s = parse(OK, Path::new("s.toml")).unwrap();
        assert_eq!(s.engine, "builtin");
        assert_eq!(s.workload.model, "tiny");
        let e = parse(&OK.replace("steps = 3", "stepz = 3"), Path::new("s.toml"))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("s.toml:4:1: ") && e.contains("did you mean `steps`"),
            "{e}"
        );
        let e = parse(
            &OK.replace("steps = 3", "steps = \"three\""),
            Path::new("s.toml"),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("s.toml:4:") && e.contains("expected usize") && e.lines().count() == 1,
            "{e}"
        );
        let e = parse(&OK.replace("seeds = [0, 1]\n", ""), Path::new("s.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("seeds"), "{e}");
        let e = parse(
            &format!("{OK}[[configs]]\nname = \"bf16\"\nrecipe = \"mxfp8\"\n"),
            Path::new("s.toml"),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("unique"), "{e}");
    }
}

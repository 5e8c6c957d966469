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
//! [workload.warm_start]           # optional: the supervised warm start's settings
//! lr = 1e-3
//! [[configs]]
//! name = "nvfp4-dq"
//! recipe = "nvfp4-dq"             # preset or recipe file (relative to the suite file)
//! bf16_last = 2                   # optional overrides
//! [sweep]                         # optional axes: every combination is run
//! bf16_last = [2, 4, 8]
//! [checks]                        # used by `lockstep compare`
//! margin = 0.05
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
    /// Command engine settings (engine = "command").
    #[serde(default)]
    pub command: Option<toml::Table>,
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
    /// Environment variables for the command engine (the NVFP4 recipe is driven by them).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Extra placeholders for the command engine's argv template.
    #[serde(default)]
    pub vars: BTreeMap<String, String>,
}

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

const TOP_KEYS: [&str; 10] = [
    "name",
    "description",
    "engine",
    "seeds",
    "workload",
    "configs",
    "sweep",
    "checks",
    "command",
    "slurm",
];
const OTHER_KEYS: [&str; 34] = [
    "model",
    "task",
    "prompts_per_step",
    "samples_per_prompt",
    "max_response_tokens",
    "steps",
    "lr",
    "routing_replay",
    "eval_every",
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
    if !matches!(s.engine.as_str(), "builtin" | "command") {
        return Err(bad(format!(
            "engine = \"{}\": use \"builtin\" or \"command\"",
            s.engine
        )));
    }
    if s.engine == "command" && s.command.is_none() {
        return Err(bad(
            "engine = \"command\" needs a [command] table with argv".into(),
        ));
    }
    Ok(s)
}

/// Add "did you mean" to an unknown-key error.
fn hint(msg: String) -> String {
    let Some(start) = msg.find("unknown field `") else {
        return msg.trim_end().to_string();
    };
    let field = msg[start + 15..].split('`').next().unwrap_or("");
    let all: Vec<&str> = TOP_KEYS.iter().chain(OTHER_KEYS.iter()).copied().collect();
    match suggest(field, &all) {
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

//! Suite → run list: configurations x sweep combinations x seeds, each resolved to a complete
//! [`RunConfig`] whose hash is the run id (so a rerun finds finished runs by id).

use super::spec::{ConfigSpec, SuiteError, SuiteSpec};
use crate::engine::model::ModelConfig;
use crate::engine::run::RunConfig;
use crate::engine::task::Task;
use crate::engine::trainer::{ContractBreak, GrpoConfig};
use crate::recipe::{BackwardMode, LayerCount, Precision, Recipe, Rule};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;

/// One run of a suite.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunSpec {
    /// Configuration name plus sweep values, e.g. `nvfp4-dq` or `nvfp4-dq [bf16_last=4]`.
    pub config: String,
    /// The base configuration name (what comparisons group by, with the axes).
    pub base: String,
    pub axes: BTreeMap<String, String>,
    pub seed: u64,
    pub run_id: String,
    pub run: RunConfig,
    pub env: BTreeMap<String, String>,
    pub vars: BTreeMap<String, String>,
}

fn invalid(s: &SuiteSpec, msg: String) -> SuiteError {
    SuiteError::Invalid {
        path: s.path.display().to_string(),
        msg,
    }
}

/// Parse a model preset name.
pub fn model_preset(name: &str) -> Option<ModelConfig> {
    match name {
        "tiny" => Some(ModelConfig::tiny()),
        "small" => Some(ModelConfig::small()),
        _ => None,
    }
}

fn parse_backward(s: &str) -> Option<BackwardMode> {
    match s {
        "quantized" => Some(BackwardMode::Quantized),
        "high-precision" | "hp" => Some(BackwardMode::HighPrecision),
        "dequantized" | "dq" => Some(BackwardMode::Dequantized),
        _ => None,
    }
}

/// Parse a contract-break name.
pub fn parse_break(s: &str) -> Option<ContractBreak> {
    match s {
        "none" => Some(ContractBreak::None),
        "per-tensor-nvfp4" => Some(ContractBreak::PerTensorNvfp4),
        "mxfp8-floor-scale" => Some(ContractBreak::Mxfp8FloorScale),
        _ => s
            .strip_prefix("shards:")
            .and_then(|n| n.parse().ok())
            .filter(|n| *n >= 1)
            .map(ContractBreak::Shards),
    }
}

/// The recipe of a configuration with one sweep combination applied.
fn build_recipe(
    s: &SuiteSpec,
    c: &ConfigSpec,
    axes: &BTreeMap<String, String>,
) -> Result<Recipe, SuiteError> {
    let spec =
        if c.recipe.ends_with(".toml") || c.recipe.ends_with(".yaml") || c.recipe.ends_with(".yml")
        {
            s.path
                .parent()
                .unwrap_or(std::path::Path::new("."))
                .join(&c.recipe)
                .display()
                .to_string()
        } else {
            c.recipe.clone()
        };
    let mut r = crate::recipe::file::load(&spec)
        .map_err(|e| invalid(s, format!("config `{}`: {e}", c.name)))?;
    let get = |k: &str| axes.get(k).cloned();
    if let Some(n) = get("bf16_last")
        .and_then(|v| v.parse().ok())
        .or(c.bf16_last)
    {
        r.bf16_last = Some(LayerCount::Layers(n));
    }
    if let Some(n) = get("bf16_first")
        .and_then(|v| v.parse().ok())
        .or(c.bf16_first)
    {
        r.bf16_first = Some(LayerCount::Layers(n));
    }
    if let Some(b) = get("backward").or(c.backward.clone()) {
        r.backward = parse_backward(&b).ok_or_else(|| {
            invalid(
                s,
                format!(
                    "config `{}`: backward `{b}`: use quantized, high-precision or dequantized",
                    c.name
                ),
            )
        })?;
        for rule in &mut r.rules {
            rule.backward = None;
        }
    }
    if let Some(keep) = get("shared_experts_bf16")
        .and_then(|v| v.parse().ok())
        .or(c.shared_experts_bf16)
    {
        let pat = "*.mlp.shared_experts.*";
        r.rules.retain(|x| x.pattern != pat);
        let main = r
            .rules
            .iter()
            .map(|x| x.format)
            .find(|f| f.is_low_precision())
            .unwrap_or(Precision::Bf16);
        r.rules.insert(
            0,
            Rule {
                pattern: pat.into(),
                format: if keep { Precision::Bf16 } else { main },
                backward: None,
            },
        );
    }
    if !axes.is_empty() {
        r.name = format!("{} {}", r.name, label(axes));
    }
    Ok(r)
}

fn label(axes: &BTreeMap<String, String>) -> String {
    format!(
        "[{}]",
        axes.iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// Every combination of the sweep axes (one empty combination when there are none).
fn combinations(s: &SuiteSpec) -> Vec<BTreeMap<String, String>> {
    let axes: Vec<(&str, Vec<String>)> = [
        (
            "bf16_last",
            s.sweep
                .bf16_last
                .iter()
                .map(|v| v.to_string())
                .collect::<Vec<_>>(),
        ),
        (
            "bf16_first",
            s.sweep.bf16_first.iter().map(|v| v.to_string()).collect(),
        ),
        (
            "shared_experts_bf16",
            s.sweep
                .shared_experts_bf16
                .iter()
                .map(|v| v.to_string())
                .collect(),
        ),
        ("backward", s.sweep.backward.clone()),
    ]
    .into_iter()
    .filter(|(_, v)| !v.is_empty())
    .collect();
    let mut out = vec![BTreeMap::new()];
    for (k, vals) in axes {
        out = out
            .into_iter()
            .flat_map(|m| {
                vals.iter().map(move |v| {
                    let mut m2 = m.clone();
                    m2.insert(k.to_string(), v.clone());
                    m2
                })
            })
            .collect();
    }
    out
}

/// Expand and validate a suite (this is `lockstep suite check`).
pub fn expand(s: &SuiteSpec) -> Result<Vec<RunSpec>, SuiteError> {
    let model = model_preset(&s.workload.model).ok_or_else(|| {
        invalid(
            s,
            format!("workload.model `{}`: use tiny or small", s.workload.model),
        )
    })?;
    let task: Task = s
        .workload
        .task
        .parse()
        .map_err(|e| invalid(s, format!("workload.task: {e}")))?;
    let mut grpo = GrpoConfig::default();
    let w = &s.workload;
    grpo.prompts_per_step = w.prompts_per_step.unwrap_or(grpo.prompts_per_step);
    grpo.samples_per_prompt = w.samples_per_prompt.unwrap_or(grpo.samples_per_prompt);
    grpo.max_response_tokens = w.max_response_tokens.unwrap_or(task.answer_len() + 2);
    grpo.lr = w.lr.unwrap_or(grpo.lr);
    grpo.routing_replay = w.routing_replay.unwrap_or(grpo.routing_replay);
    grpo.eval_every = w.eval_every.unwrap_or(grpo.eval_every);
    if let Some(ws) = &w.warm_start {
        ws.validate()
            .map_err(|e| invalid(s, format!("workload.warm_start: {e}")))?;
    }
    let mut out = Vec::new();
    for c in &s.configs {
        for axes in combinations(s) {
            let recipe = build_recipe(s, c, &axes)?;
            let brk = match &c.contract_break {
                None => ContractBreak::None,
                Some(b) => parse_break(b).ok_or_else(|| invalid(s, format!("config `{}`: contract_break `{b}`: use none, per-tensor-nvfp4, shards:N or mxfp8-floor-scale", c.name)))?,
            };
            for &seed in &s.seeds {
                let run = RunConfig {
                    model: model.clone(),
                    task,
                    recipe: recipe.clone(),
                    grpo: grpo.clone(),
                    warm_start: w.warm_start.clone().unwrap_or_default(),
                    contract_break: brk,
                    seed,
                    steps: w.steps,
                };
                if s.engine == "builtin" {
                    crate::engine::trainer::check_run(&run)
                        .map_err(|e| invalid(s, format!("config `{}`: {e}", c.name)))?;
                }
                let config = if axes.is_empty() {
                    c.name.clone()
                } else {
                    format!("{} {}", c.name, label(&axes))
                };
                let (env, vars) = merged_env_vars(s, c);
                let run_id = run_id(s, &config, &run, &env, &vars);
                let spec = RunSpec {
                    config,
                    base: c.name.clone(),
                    axes: axes.clone(),
                    seed,
                    run_id,
                    run,
                    env,
                    vars,
                };
                if let Some(cmd) = &s.command {
                    // Every placeholder must resolve for every run, now rather than at 3 a.m.
                    super::command::argv(s, cmd, &spec, std::path::Path::new("OUT_DIR")).map_err(
                        |e| invalid(s, format!("config `{}`: [command] argv: {e}", c.name)),
                    )?;
                }
                out.push(spec);
            }
        }
    }
    Ok(out)
}

/// A configuration's environment and placeholder values over the suite's `[command]` defaults.
fn merged_env_vars(
    s: &SuiteSpec,
    c: &ConfigSpec,
) -> (BTreeMap<String, String>, BTreeMap<String, String>) {
    let mut env = s
        .command
        .as_ref()
        .map(|c| c.env.clone())
        .unwrap_or_default();
    env.extend(c.env.clone());
    let mut vars = s
        .command
        .as_ref()
        .map(|c| c.vars.clone())
        .unwrap_or_default();
    vars.extend(c.vars.clone());
    (env, vars)
}

/// Hash of everything that determines what a run does: engine, configuration and its name, the
/// resolved workload and recipe, seed, environment and placeholder values, and for the command
/// engine the launcher's argv template. Not the timeout, the kill grace or the metrics mapping:
/// changing how long to wait or how to read the output does not make finished runs stale (re-read
/// them with `lockstep run --reingest`).
fn run_id(
    s: &SuiteSpec,
    config: &str,
    run: &RunConfig,
    env: &BTreeMap<String, String>,
    vars: &BTreeMap<String, String>,
) -> String {
    let launcher = s
        .command
        .as_ref()
        .map(|c| serde_json::to_string(&serde_json::json!({ "argv": c.argv })).unwrap_or_default());
    let text =
        serde_json::to_string(&(&s.engine, config, run, env, vars, &launcher)).unwrap_or_default();
    format_run_id(config, run.seed, &text)
}

/// Longest configuration slug kept in a run id, so the id (slug, seed, hash) stays a valid file
/// name however long the configuration's name is; the hash keeps truncated ids distinct.
const MAX_SLUG: usize = 96;

/// `<config slug>-s<seed>-<12 hex of sha256(identity)>`: readable, and safe as a path component
/// whatever the configuration is called (anything but ASCII letters, digits and `-` becomes `_`).
pub fn format_run_id(config: &str, seed: u64, identity: &str) -> String {
    let h: [u8; 32] = Sha256::digest(identity.as_bytes()).into();
    let hex: String = h[..6].iter().map(|b| format!("{b:02x}")).collect();
    let slug: String = config
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let slug = slug.trim_matches('_');
    let slug = &slug[..slug.len().min(MAX_SLUG)];
    format!("{slug}-s{seed}-{hex}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::warmstart::WarmStartConfig;
    use crate::suite::spec::parse;
    use std::path::Path;

    #[test]
    fn expansion_multiplies_configs_sweeps_and_seeds_with_stable_ids() {
        let text = "name = \"t\"\nseeds = [0, 1]\n[workload]\nsteps = 3\n[[configs]]\nname = \"bf16\"\nrecipe = \"bf16\"\n[[configs]]\nname = \"nv\"\nrecipe = \"nvfp4-dq\"\n[sweep]\nbf16_last = [0, 1]\nshared_experts_bf16 = [true, false]\n";
        let s = parse(text, Path::new("t.toml")).unwrap();
        let runs = expand(&s).unwrap();
        assert_eq!(runs.len(), 2 * 4 * 2);
        let ids: std::collections::BTreeSet<_> = runs.iter().map(|r| r.run_id.clone()).collect();
        assert_eq!(ids.len(), runs.len(), "run ids must be unique");
        assert_eq!(
            expand(&s).unwrap()[5].run_id,
            runs[5].run_id,
            "ids are stable"
        );
        let nv = runs
            .iter()
            .find(|r| r.base == "nv" && r.axes["shared_experts_bf16"] == "false")
            .unwrap();
        let plan = nv.run.recipe.resolve(2).unwrap();
        assert_eq!(plan.layers[0].shared_fc1.precision, Precision::Nvfp4);
        assert!(
            runs.iter()
                .all(|r| crate::suite::runner::safe_component(&r.run_id).is_ok())
        );
    }

    #[test]
    fn the_warm_start_table_reaches_every_run_and_is_checked() {
        let base = "name = \"t\"\nseeds = [0, 1]\n[workload]\nsteps = 3\n[workload.warm_start]\n";
        let tail = "\n[[configs]]\nname = \"bf16\"\nrecipe = \"bf16\"\n";
        let s = parse(
            &format!("{base}lr = 1e-3\nmax_steps = 50{tail}"),
            Path::new("t.toml"),
        )
        .unwrap();
        let runs = expand(&s).unwrap();
        assert!(
            runs.iter()
                .all(|r| r.run.warm_start.lr == 1e-3 && r.run.warm_start.max_steps == 50)
        );
        assert_eq!(
            runs[0].run.warm_start.batch,
            WarmStartConfig::default().batch
        );
        // Without the table, the defaults; with another lr, another run id (the warm start differs).
        let plain = parse("name = \"t\"\nseeds = [0, 1]\n[workload]\nsteps = 3\n[[configs]]\nname = \"bf16\"\nrecipe = \"bf16\"\n", Path::new("t.toml")).unwrap();
        let d = expand(&plain).unwrap();
        assert_eq!(d[0].run.warm_start, WarmStartConfig::default());
        assert_ne!(d[0].run_id, runs[0].run_id);
        let e = parse(&format!("{base}lrr = 1e-3{tail}"), Path::new("t.toml"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("line 6") && e.contains("did you mean `lr`"),
            "{e}"
        );
        let e = expand(
            &parse(
                &format!("{base}target_accuracy = 30{tail}"),
                Path::new("t.toml"),
            )
            .unwrap(),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("warm_start") && e.contains("target_accuracy"),
            "{e}"
        );
    }

    #[test]
    fn bad_values_are_reported_with_the_config() {
        let text = "name = \"t\"\nseeds = [0]\n[workload]\nsteps = 3\n[[configs]]\nname = \"x\"\nrecipe = \"nvfp4dq\"\n";
        let e = expand(&parse(text, Path::new("t.toml")).unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("config `x`") && e.contains("did you mean `nvfp4-dq`"),
            "{e}"
        );
        let text = "name = \"t\"\nseeds = [0]\n[workload]\nsteps = 3\nmodel = \"huge\"\n[[configs]]\nname = \"x\"\nrecipe = \"bf16\"\n";
        assert!(
            expand(&parse(text, Path::new("t.toml")).unwrap())
                .unwrap_err()
                .to_string()
                .contains("tiny or small")
        );
    }
}

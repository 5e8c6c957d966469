//! Suite → run list: configurations x sweep combinations x seeds, each resolved to a complete
//! [`RunConfig`] whose hash is the run id (so a rerun finds finished runs by id; see
//! [`super::identity`]).

use super::spec::{ConfigSpec, SuiteError, SuiteSpec};
use crate::engine::model::ModelConfig;
use crate::engine::task::Task;
use crate::engine::trainer::{ContractBreak, GrpoConfig, MAX_POLICY_LAG};
use crate::recipe::{BackwardMode, LayerCount, Precision, Recipe, Rule};
use crate::suite::builtin::RunConfig;
use serde::{Deserialize, Serialize};
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

/// [`invalid`], with the line of the suite file that holds the string `value` (as a TOML string)
/// when it can be found, so the message points at what to fix.
fn invalid_at(s: &SuiteSpec, value: Option<&str>, msg: String) -> SuiteError {
    let line = value.and_then(|v| {
        let text = std::fs::read_to_string(&s.path).ok()?;
        let quoted = [
            format!("\"{v}\""),
            format!("'{v}'"),
            serde_json::to_string(v).ok()?,
        ];
        text.lines()
            .position(|l| quoted.iter().any(|q| l.contains(q.as_str())))
            .map(|i| i + 1)
    });
    match line {
        Some(n) => SuiteError::Invalid {
            path: format!("{}:{n}", s.path.display()),
            msg,
        },
        None => invalid(s, msg),
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

/// Whether a configuration's `recipe` names a file (else a preset).
fn recipe_is_file(recipe: &str) -> bool {
    recipe.ends_with(".toml") || recipe.ends_with(".yaml") || recipe.ends_with(".yml")
}

/// The recipe of a configuration with one sweep combination applied.
fn build_recipe(
    s: &SuiteSpec,
    c: &ConfigSpec,
    axes: &BTreeMap<String, String>,
) -> Result<Recipe, SuiteError> {
    let spec = if recipe_is_file(&c.recipe) {
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

/// Most steps a run may have.
pub const MAX_STEPS: usize = 10_000_000;
/// Most prompts per step and samples per prompt.
pub const MAX_PROMPTS: usize = 4096;
pub const MAX_SAMPLES: usize = 1024;
/// Most memory the activations of one step may need (estimated by [`step_memory_bytes`]).
pub const MAX_STEP_MEMORY: u64 = 64 << 30;

/// A rough lower bound on what one training step of `batch` sequences of `seq` tokens keeps in
/// memory: the forward's activations (residual stream, attention, the routed experts' and the
/// shared expert's hidden layers, logits) in FP32, which the backward needs back.
pub fn step_memory_bytes(m: &ModelConfig, batch: usize, seq: usize) -> u64 {
    let per_token = m.vocab as u64
        + m.n_layers as u64
            * (16 * m.d_model as u64 + 3 * (m.top_k * m.d_ff) as u64 + 3 * m.d_ff_shared as u64);
    (batch as u64)
        .saturating_mul(seq as u64)
        .saturating_mul(per_token)
        .saturating_mul(4)
}

/// Every value of the suite that `run` would reject or mishandle, checked once, with the range
/// the value must be in: steps, learning rate, batch sizes (and the memory they need), duplicate
/// seeds and a suite name that must be a path component of the run store.
fn check_workload(
    s: &SuiteSpec,
    model: &ModelConfig,
    grpo: &GrpoConfig,
    seq: usize,
) -> Result<(), SuiteError> {
    let bad = |msg: String| Err(invalid(s, msg));
    if let Err(why) = super::runner::safe_component(&s.name) {
        return bad(format!(
            "name = \"{}\": {why}; it names the run store folder",
            crate::recipe::shorten(&s.name)
        ));
    }
    let w = &s.workload;
    if !(1..=MAX_STEPS).contains(&w.steps) {
        return bad(format!(
            "workload.steps = {}: must be in 1..={MAX_STEPS}",
            w.steps
        ));
    }
    if !(grpo.lr.is_finite() && grpo.lr > 0.0 && grpo.lr <= 1.0) {
        return bad(format!(
            "workload.lr = {}: must be a number in (0, 1], e.g. 1e-3",
            grpo.lr
        ));
    }
    if !(1..=MAX_PROMPTS).contains(&grpo.prompts_per_step) {
        return bad(format!(
            "workload.prompts_per_step = {}: must be in 1..={MAX_PROMPTS}",
            grpo.prompts_per_step
        ));
    }
    if !(1..=MAX_SAMPLES).contains(&grpo.samples_per_prompt) {
        return bad(format!(
            "workload.samples_per_prompt = {}: must be in 1..={MAX_SAMPLES}",
            grpo.samples_per_prompt
        ));
    }
    check_policy_lag(s, "workload.policy_lag", grpo.policy_lag)?;
    if grpo.max_response_tokens == 0 {
        return bad("workload.max_response_tokens = 0: must be at least 1".into());
    }
    let batch = grpo.prompts_per_step * grpo.samples_per_prompt;
    let need = step_memory_bytes(model, batch, seq);
    if need > MAX_STEP_MEMORY {
        return bad(format!(
            "workload.prompts_per_step x samples_per_prompt = {batch} sequences of {seq} tokens need about {:.0} GiB per step (at most {} GiB); lower them",
            need as f64 / (1u64 << 30) as f64,
            MAX_STEP_MEMORY >> 30
        ));
    }
    for c in &s.configs {
        for (what, v) in [("name", &c.name), ("recipe", &c.recipe)] {
            if v.chars().any(char::is_control) {
                return bad(format!(
                    "[[configs]] {what} = \"{}\" holds a control character (newline, tab...); remove it",
                    crate::recipe::shorten(v)
                ));
            }
        }
    }
    let mut seen = std::collections::BTreeSet::new();
    for &seed in &s.seeds {
        if !seen.insert(seed) {
            return bad(format!(
                "seeds lists {seed} twice: each seed must appear once"
            ));
        }
    }
    Ok(())
}

/// A rollout may lag the trainer by 0 (synchronous) to [`MAX_POLICY_LAG`] steps.
fn check_policy_lag(s: &SuiteSpec, what: &str, lag: usize) -> Result<(), SuiteError> {
    if lag > MAX_POLICY_LAG {
        return Err(invalid(
            s,
            format!("{what} = {lag}: must be in 0..={MAX_POLICY_LAG} (0 is synchronous)"),
        ));
    }
    Ok(())
}

/// A configuration's points: every sweep combination, then each again with each of its
/// variants' axes added.
fn points(s: &SuiteSpec, c: &ConfigSpec) -> Result<Vec<BTreeMap<String, String>>, SuiteError> {
    let sweep = combinations(s);
    let mut out = sweep.clone();
    for (i, v) in c.variants.iter().enumerate() {
        let extra = v.axes();
        if extra.is_empty() {
            return Err(invalid(
                s,
                format!(
                    "config `{}`: variants[{i}] changes nothing: give policy_lag or task, e.g. {{ policy_lag = 1 }}",
                    c.name
                ),
            ));
        }
        out.extend(sweep.iter().map(|axes| {
            let mut a = axes.clone();
            a.extend(extra.clone());
            a
        }));
    }
    Ok(out)
}

/// The task of one point: its variant's, else the workload's.
fn point_task(
    s: &SuiteSpec,
    c: &ConfigSpec,
    axes: &BTreeMap<String, String>,
    task: Task,
) -> Result<Task, SuiteError> {
    match axes.get("task") {
        None => Ok(task),
        Some(t) => t.parse().map_err(|e: crate::engine::task::TaskError| {
            invalid(
                s,
                format!(
                    "config `{}`: variants task: {}",
                    c.name,
                    crate::recipe::escape_controls(&e.to_string())
                ),
            )
        }),
    }
}

/// The task and GRPO settings of one point of a configuration: the workload's, with the
/// configuration's `policy_lag` and its variant's task and lag applied, checked.
fn point_workload(
    s: &SuiteSpec,
    c: &ConfigSpec,
    axes: &BTreeMap<String, String>,
    model: &ModelConfig,
    task: Task,
    grpo: &GrpoConfig,
) -> Result<(Task, GrpoConfig), SuiteError> {
    let point = point_task(s, c, axes, task)?;
    let mut grpo = grpo.clone();
    // Another task keeps the workload's room beyond the answer, not its length.
    let room = grpo.max_response_tokens.saturating_sub(task.answer_len());
    grpo.max_response_tokens = point.answer_len() + room;
    if point != task {
        let seq = point.prompt_len().saturating_add(grpo.max_response_tokens);
        check_workload(s, model, &grpo, seq)?;
    }
    grpo.policy_lag = match axes.get("policy_lag") {
        Some(v) => v.parse().unwrap_or(usize::MAX),
        None => c.policy_lag.unwrap_or(grpo.policy_lag),
    };
    check_policy_lag(
        s,
        &format!("config `{}`: policy_lag", c.name),
        grpo.policy_lag,
    )?;
    Ok((point, grpo))
}

/// Expand and validate a suite (this is `lockstep suite check`).
pub fn expand(s: &SuiteSpec) -> Result<Vec<RunSpec>, SuiteError> {
    let model = model_preset(&s.workload.model).ok_or_else(|| {
        invalid(
            s,
            format!(
                "workload.model `{}`: use tiny or small",
                crate::recipe::shorten(&s.workload.model)
            ),
        )
    })?;
    let task: Task = s
        .workload
        .task
        .parse()
        .map_err(|e: crate::engine::task::TaskError| {
            invalid(
                s,
                format!(
                    "workload.task: {}",
                    crate::recipe::escape_controls(&e.to_string())
                ),
            )
        })?;
    let mut grpo = GrpoConfig::default();
    let w = &s.workload;
    grpo.prompts_per_step = w.prompts_per_step.unwrap_or(grpo.prompts_per_step);
    grpo.samples_per_prompt = w.samples_per_prompt.unwrap_or(grpo.samples_per_prompt);
    grpo.max_response_tokens = w.max_response_tokens.unwrap_or(task.answer_len() + 2);
    grpo.lr = w.lr.unwrap_or(grpo.lr);
    grpo.routing_replay = w.routing_replay.unwrap_or(grpo.routing_replay);
    grpo.eval_every = w.eval_every.unwrap_or(grpo.eval_every);
    grpo.policy_lag = w.policy_lag.unwrap_or(0);
    check_workload(
        s,
        &model,
        &grpo,
        task.prompt_len().saturating_add(grpo.max_response_tokens),
    )?;
    if let Some(ws) = &w.warm_start {
        ws.validate()
            .map_err(|e| invalid(s, format!("workload.warm_start: {e}")))?;
    }
    let mut out = Vec::new();
    for c in &s.configs {
        for axes in points(s, c)? {
            let recipe = build_recipe(s, c, &axes)?;
            let (task, grpo) = point_workload(s, c, &axes, &model, task, &grpo)?;
            let brk = match &c.contract_break {
                None => ContractBreak::None,
                Some(b) => parse_break(b).ok_or_else(|| invalid(s, format!("config `{}`: contract_break `{b}`: use none, per-tensor-nvfp4, shards:N or mxfp8-floor-scale", c.name)))?,
            };
            let template = RunConfig {
                model: model.clone(),
                task,
                recipe,
                grpo,
                warm_start: w.warm_start.clone().unwrap_or_default(),
                contract_break: brk,
                seed: 0,
                steps: w.steps,
            };
            // Checked once per configuration: the seed changes nothing `RunConfig::check` looks at.
            if s.engine == "builtin" {
                template.check().map_err(|e| {
                    // A recipe file's own errors name the file, not only the recipe.
                    let file = if recipe_is_file(&c.recipe) {
                        format!(" (recipe file {})", c.recipe)
                    } else {
                        String::new()
                    };
                    invalid(s, format!("config `{}`{file}: {e}", c.name))
                })?;
            }
            for &seed in &s.seeds {
                let run = RunConfig {
                    seed,
                    ..template.clone()
                };
                let config = if axes.is_empty() {
                    c.name.clone()
                } else {
                    format!("{} {}", c.name, label(&axes))
                };
                let (env, vars) = merged_env_vars(s, c);
                let run_id = super::identity::run_id(s, &config, &run, &env, &vars);
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
                    let out_dir = std::path::Path::new("OUT_DIR");
                    // The error at the line of the first template that does not fill.
                    let at_template = |templates: Vec<&String>, e: String| {
                        let bad = templates.into_iter().find(|t| {
                            super::command::template_error(s, &spec, t, out_dir).is_some()
                        });
                        invalid_at(
                            s,
                            bad.map(String::as_str),
                            format!("config `{}`: [command] {e}", c.name),
                        )
                    };
                    if let Err(e) = super::command::argv(s, cmd, &spec, out_dir) {
                        return Err(at_template(cmd.argv.iter().collect(), format!("argv: {e}")));
                    }
                    if let Err(e) = super::command::env(s, &spec, out_dir) {
                        return Err(at_template(spec.env.values().collect(), e));
                    }
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
            e.starts_with("t.toml:6:") && e.contains("did you mean `lr`"),
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

    fn check_err(workload: &str, top: &str) -> String {
        let text = format!(
            "name = \"t\"\nseeds = [0, 1]\n{top}\n[workload]\n{workload}\n[[configs]]\nname = \"x\"\nrecipe = \"bf16\"\n"
        );
        match expand(&parse(&text, Path::new("t.toml")).unwrap()) {
            Ok(_) => String::new(),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn values_run_would_mishandle_are_rejected_with_their_range() {
        for (w, want) in [
            ("steps = 0", "steps = 0: must be in 1..="),
            (
                "steps = 3\nlr = nan",
                "lr = NaN: must be a number in (0, 1]",
            ),
            ("steps = 3\nlr = -1e-3", "must be a number in (0, 1]"),
            ("steps = 3\nlr = 0.0", "must be a number in (0, 1]"),
            (
                "steps = 3\nprompts_per_step = 0",
                "prompts_per_step = 0: must be in 1..=4096",
            ),
            (
                "steps = 3\nsamples_per_prompt = 0",
                "samples_per_prompt = 0: must be in 1..=1024",
            ),
            (
                "steps = 3\nsamples_per_prompt = 100000000000",
                "must be in 1..=1024",
            ),
            (
                "steps = 3\nprompts_per_step = 4096\nsamples_per_prompt = 1024",
                "GiB per step",
            ),
            (
                "steps = 3\nmax_response_tokens = 0",
                "max_response_tokens = 0",
            ),
        ] {
            let e = check_err(w, "");
            assert!(e.starts_with("t.toml: ") && e.contains(want), "{w}: {e}");
        }
        assert!(check_err("steps = 3", "").is_empty());
        let e = check_err("steps = 3", "").to_string();
        assert!(e.is_empty(), "{e}");
        let text = "name = \"t\"\nseeds = [3, 1, 3]\n[workload]\nsteps = 3\n[[configs]]\nname = \"x\"\nrecipe = \"bf16\"\n";
        let e = expand(&parse(text, Path::new("t.toml")).unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("seeds lists 3 twice"), "{e}");
        for name in ["../../etc", "a/b", ".hidden", ""] {
            let text = format!(
                "name = \"{name}\"\nseeds = [0]\n[workload]\nsteps = 3\n[[configs]]\nname = \"x\"\nrecipe = \"bf16\"\n"
            );
            let e = expand(&parse(&text, Path::new("t.toml")).unwrap())
                .unwrap_err()
                .to_string();
            assert!(e.contains("names the run store folder"), "{name}: {e}");
        }
    }

    #[test]
    fn policy_lag_reaches_the_run_config_and_is_range_checked() {
        let suite = |workload: &str, config: &str| {
            format!(
                "name = \"t\"\nseeds = [0]\n[workload]\nsteps = 3\n{workload}\n[[configs]]\nname = \"x\"\nrecipe = \"bf16\"\n{config}\n"
            )
        };
        let runs = |text: String| expand(&parse(&text, Path::new("t.toml")).unwrap());
        let sync = runs(suite("", "")).unwrap().remove(0);
        let zero = runs(suite("policy_lag = 0", "")).unwrap().remove(0);
        let lag1 = runs(suite("policy_lag = 1", "")).unwrap().remove(0);
        let over = runs(suite("policy_lag = 2", "policy_lag = 1"))
            .unwrap()
            .remove(0);
        assert_eq!(sync.run.grpo.policy_lag, 0);
        assert_eq!((lag1.run.grpo.policy_lag, over.run.grpo.policy_lag), (1, 1));
        // Lag 0 is the synchronous run of before: same config, same id; a lag is another run.
        assert_eq!(zero.run_id, sync.run_id);
        assert_ne!(lag1.run_id, sync.run_id);
        // The manifest holds the resolved config as this JSON: a lag is written, lag 0 left out.
        let json = |r: &RunSpec| serde_json::to_value(&r.run).unwrap()["grpo"].clone();
        assert_eq!(json(&lag1)["policy_lag"], 1);
        assert!(json(&sync).get("policy_lag").is_none());
        let e = runs(suite("policy_lag = 9", "")).unwrap_err().to_string();
        assert!(
            e.contains("workload.policy_lag = 9: must be in 0..=8"),
            "{e}"
        );
        let e = runs(suite("", "policy_lag = 100")).unwrap_err().to_string();
        assert!(
            e.contains("config `x`: policy_lag = 100: must be in 0..=8"),
            "{e}"
        );
    }

    #[test]
    fn variants_run_a_configuration_again_under_other_workload_conditions() {
        let text = "name = \"t\"\nseeds = [0]\n[workload]\nsteps = 3\ntask = \"add:2\"\n[[configs]]\nname = \"bf16\"\nrecipe = \"bf16\"\nvariants = [{ policy_lag = 2 }, { task = \"sort:4\" }]\n";
        let runs = expand(&parse(text, Path::new("t.toml")).unwrap()).unwrap();
        let names: Vec<&str> = runs.iter().map(|r| r.config.as_str()).collect();
        assert_eq!(names, ["bf16", "bf16 [policy_lag=2]", "bf16 [task=sort:4]"]);
        assert!(runs.iter().all(|r| r.base == "bf16"));
        let (plain, lag, sort) = (&runs[0].run, &runs[1].run, &runs[2].run);
        assert_eq!((plain.grpo.policy_lag, plain.task), (0, Task::Add(2)));
        assert_eq!((lag.grpo.policy_lag, lag.task), (2, Task::Add(2)));
        assert_eq!((sort.grpo.policy_lag, sort.task), (0, Task::Sort(4)));
        // Another task keeps the workload's room beyond the answer (two tokens by default; here
        // add:2's answer is 4 tokens, so 5 leaves one).
        assert_eq!(
            sort.grpo.max_response_tokens,
            Task::Sort(4).answer_len() + 2
        );
        let one = text.replace("steps = 3", "steps = 3\nmax_response_tokens = 5");
        let runs = expand(&parse(&one, Path::new("t.toml")).unwrap()).unwrap();
        assert_eq!(runs[0].run.grpo.max_response_tokens, 5);
        assert_eq!(
            runs[2].run.grpo.max_response_tokens,
            Task::Sort(4).answer_len() + 1
        );
        assert_eq!(runs[2].axes["task"], "sort:4");
        for (variant, says) in [
            (
                "{ task = \"sort:1\" }",
                "config `bf16`: variants task: unknown task `sort:1`",
            ),
            (
                "{ policy_lag = 9 }",
                "config `bf16`: policy_lag = 9: must be in 0..=8",
            ),
            ("{}", "variants[0] changes nothing"),
        ] {
            let bad = text.replace(
                "[{ policy_lag = 2 }, { task = \"sort:4\" }]",
                &format!("[{variant}]"),
            );
            let e = expand(&parse(&bad, Path::new("t.toml")).unwrap())
                .unwrap_err()
                .to_string();
            assert!(e.starts_with("t.toml: ") && e.contains(says), "{e}");
        }
        let e = parse(
            &text.replace("{ policy_lag = 2 }", "{ policy_lg = 2 }"),
            Path::new("t.toml"),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("did you mean `policy_lag`"), "{e}");
    }

    #[test]
    fn the_memory_estimate_grows_with_the_batch() {
        let m = ModelConfig::tiny();
        let one = step_memory_bytes(&m, 1, 16);
        assert!(one > 0);
        assert_eq!(step_memory_bytes(&m, 64, 16), 64 * one);
        assert_eq!(step_memory_bytes(&m, usize::MAX, usize::MAX), u64::MAX);
    }

    #[test]
    fn many_seeds_share_one_check_and_keep_their_ids() {
        let seeds: Vec<String> = (0..500).map(|i| i.to_string()).collect();
        let text = format!(
            "name = \"t\"\nseeds = [{}]\n[workload]\nsteps = 3\n[[configs]]\nname = \"bf16\"\nrecipe = \"bf16\"\n[[configs]]\nname = \"nv\"\nrecipe = \"nvfp4-dq\"\n",
            seeds.join(", ")
        );
        let runs = expand(&parse(&text, Path::new("t.toml")).unwrap()).unwrap();
        assert_eq!(runs.len(), 1000);
        let ids: std::collections::BTreeSet<_> = runs.iter().map(|r| &r.run_id).collect();
        assert_eq!(ids.len(), 1000);
        assert!(
            runs.iter()
                .zip(&runs[1..])
                .all(|(a, b)| a.base != b.base || a.seed + 1 == b.seed)
        );
    }

    #[test]
    fn a_recipe_file_error_names_the_recipe_file() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(
            d.path().join("r.toml"),
            "weight_decay = -0.5\n[[rules]]\npattern = \"*\"\nformat = \"bf16\"\n",
        )
        .unwrap();
        let p = d.path().join("s.toml");
        let text = "name = \"t\"\nseeds = [0]\n[workload]\nsteps = 3\n[[configs]]\nname = \"x\"\nrecipe = \"r.toml\"\n";
        let e = expand(&parse(text, &p).unwrap()).unwrap_err().to_string();
        assert!(
            e.contains("recipe file r.toml")
                && e.contains("weight_decay = -0.5 must be a number in [0, 1]"),
            "{e}"
        );
    }
}

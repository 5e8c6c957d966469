//! One configuration and seed, end to end: warm start (cached), precision conversion, GRPO steps,
//! and the run folder the run store holds. A non-finite loss stops the run with status `diverged`
//! and its events recorded; a panic inside the engine becomes status `failed` — neither takes the
//! process (or a sweep) down.

use crate::engine::backend::Backend;
use crate::engine::metrics::StepRecord;
use crate::engine::model::ModelConfig;
use crate::engine::task::Task;
use crate::engine::trainer::{ContractBreak, GrpoConfig, Trainer};
use crate::engine::warmstart::{WarmStartConfig, warm_start};
use crate::io::IoError;
use crate::recipe::{Precision, Recipe, Site};
use crate::store::{Manifest, RunDir, RunStatus};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Everything that determines a built-in engine run (hashing it gives the run id).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunConfig {
    pub model: ModelConfig,
    pub task: Task,
    pub recipe: Recipe,
    pub grpo: GrpoConfig,
    pub warm_start: WarmStartConfig,
    pub contract_break: ContractBreak,
    pub seed: u64,
    pub steps: usize,
}

impl RunConfig {
    /// Whether the run can start (model, lengths, recipe, every site's blocks), without running it.
    pub fn check(&self) -> Result<(), crate::engine::trainer::TrainerError> {
        crate::engine::trainer::check_setup(
            &self.model,
            &self.task,
            &self.grpo,
            &self.recipe,
            self.contract_break,
        )
    }
}

impl RunConfig {
    /// Stored bytes of the model's matmul weights under this run's trainer plan (codes, block
    /// scales and second-level scales); `None` when the recipe does not resolve.
    pub fn weight_bytes(&self) -> Option<f64> {
        let plan = self.recipe.resolve(self.model.n_layers).ok()?;
        let mut total = 0.0;
        for l in &plan.layers {
            for site in Site::ALL {
                let (n, tensors) = site_weights(&self.model, site);
                total += stored_bytes(l.get(site).precision, n, tensors);
            }
        }
        let (v, d) = (self.model.vocab, self.model.d_model);
        Some(total + stored_bytes(plan.output_layer.precision, v * d, 1))
    }
}

/// Weights of one matmul site of one layer, and the tensors they are stored in (one per expert).
pub fn site_weights(m: &ModelConfig, site: Site) -> (usize, usize) {
    let (d, e, f, fs) = (m.d_model, m.n_experts, m.d_ff, m.d_ff_shared);
    match site {
        Site::LinearQkv => (3 * d * d, 1),
        Site::LinearProj => (d * d, 1),
        Site::Router => (e * d, 1),
        Site::ExpertsFc1 => (e * 2 * f * d, e),
        Site::ExpertsFc2 => (e * d * f, e),
        Site::SharedFc1 => (2 * fs * d, 1),
        Site::SharedFc2 => (d * fs, 1),
    }
}

/// Stored bytes of `n` weights in `tensors` tensors at a precision.
pub fn stored_bytes(p: Precision, n: usize, tensors: usize) -> f64 {
    let n = n as f64;
    match p {
        Precision::Fp32 => 4.0 * n,
        Precision::Bf16 => 2.0 * n,
        Precision::Mxfp8 => n + n / 32.0,
        Precision::Nvfp4 => n / 2.0 + n / 16.0 + 4.0 * tensors as f64,
        Precision::Fp8Block => n + 4.0 * (n / (128.0 * 128.0)).ceil().max(tensors as f64),
    }
}

/// Run `cfg` into `out`, calling `on_step` after each step. `cache` holds warm starts.
pub fn run_one(
    be: &dyn Backend,
    cfg: &RunConfig,
    run_id: &str,
    out: &Path,
    cache: Option<&Path>,
    on_step: impl FnMut(&StepRecord),
) -> Result<Manifest, IoError> {
    run_one_until(be, cfg, run_id, out, cache, on_step, &|| None)
}

/// [`run_one`], checking `stop` before every step: when it names a signal, the run ends there with
/// status `interrupted` and the steps so far written.
pub fn run_one_until(
    be: &dyn Backend,
    cfg: &RunConfig,
    run_id: &str,
    out: &Path,
    cache: Option<&Path>,
    mut on_step: impl FnMut(&StepRecord),
    stop: &dyn Fn() -> Option<i32>,
) -> Result<Manifest, IoError> {
    let dir = RunDir::create(out)?;
    let config_json =
        serde_json::to_value(cfg).map_err(|e| IoError::invalid(out, e.to_string()))?;
    let mut manifest = Manifest::start(
        run_id,
        "builtin",
        config_json,
        cfg.seed,
        cfg.steps,
        &be.name(),
    );
    if let Some(hw) = be.hardware() {
        manifest.extra.insert("gpu".into(), hw.into());
    }
    dir.write_manifest(&manifest)?;
    let log_dir = dir.clone();
    // The warm start runs on the device too: a device fault there fails this run, not the sweep.
    let warm = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        warm_start(be, &cfg.model, cfg.task, &cfg.warm_start, cache, |l| {
            log_dir.log(l)
        })
    }));
    let (init, ws) = match warm {
        Ok(w) => w?,
        Err(p) => {
            manifest.status = RunStatus::Failed;
            manifest.error = Some(format!("warm start: {}", panic_message(p.as_ref())));
            manifest.finished = Some(crate::store::run::now_utc());
            dir.write_manifest(&manifest)?;
            return Ok(manifest);
        }
    };
    manifest.extra.insert(
        "warm_start".into(),
        serde_json::to_value(&ws).unwrap_or_default(),
    );
    let mut records: Vec<StepRecord> = Vec::new();
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(
        || -> Result<RunStatus, (RunStatus, String)> {
            let mut trainer = Trainer::new(
                init,
                cfg.task,
                cfg.recipe.clone(),
                cfg.grpo.clone(),
                cfg.seed,
                cfg.contract_break,
            )
            .map_err(|e| (RunStatus::Failed, e.to_string()))?;
            for step in 0..cfg.steps {
                if let Some(sig) = stop() {
                    return Err((
                        RunStatus::Interrupted,
                        format!("interrupted by signal {sig} before step {step}; rerun to redo it"),
                    ));
                }
                let rec = trainer.step(be);
                let diverged = rec
                    .events
                    .iter()
                    .any(|e| e.kind == "non_finite" && e.site == "train/loss");
                dir.log(&step_line(&rec));
                on_step(&rec);
                records.push(rec);
                if diverged {
                    return Ok(RunStatus::Diverged);
                }
            }
            Ok(RunStatus::Ok)
        },
    ));
    let (status, error) = match outcome {
        Ok(Ok(s)) => (s, None),
        Ok(Err((status, why))) => (status, Some(why)),
        Err(p) => (RunStatus::Failed, Some(panic_message(p.as_ref()))),
    };
    dir.write_metrics(&records)?;
    manifest.status = status;
    manifest.error = error;
    manifest.steps_done = records.len();
    manifest.finished = Some(crate::store::run::now_utc());
    dir.write_manifest(&manifest)?;
    Ok(manifest)
}

/// `engine panicked: <message>` for a caught panic's payload.
fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    let msg = p
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
    format!("engine panicked: {}", msg.unwrap_or_default())
}

/// The one-line progress summary of a step.
pub fn step_line(r: &StepRecord) -> String {
    let g = |k: &str| r.get(k).unwrap_or(f64::NAN);
    let mut s = format!(
        "step {:>4}  reward {:.3}  mismatch {:.2e}  kl {:.2e}  grad {:.3}  {:.2}s",
        r.step,
        g("rollout/raw_reward"),
        g("train/train_rollout_logprob_abs_diff"),
        g("train/train_rollout_kl"),
        g("train/grad_norm"),
        g("perf/step_time")
    );
    if let Some(a) = r.get("eval/accuracy") {
        s.push_str(&format!("  eval {a:.3}"));
    }
    let v = r.get("contract/violations").unwrap_or(0.0);
    if v > 0.0 {
        s.push_str(&format!("  CONTRACT VIOLATIONS {v}"));
    }
    if !r.events.is_empty() {
        s.push_str(&format!("  events {}", r.events.len()));
    }
    s
}

/// The default warm-start cache: `$LOCKSTEP_CACHE`, else `runs/cache`.
pub fn default_cache() -> PathBuf {
    std::env::var_os("LOCKSTEP_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("runs/cache"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(recipe: Recipe) -> RunConfig {
        RunConfig {
            model: ModelConfig::small(),
            task: Task::Add(3),
            recipe,
            grpo: GrpoConfig::default(),
            warm_start: WarmStartConfig::default(),
            contract_break: ContractBreak::None,
            seed: 0,
            steps: 1,
        }
    }

    #[test]
    fn a_lagged_run_says_so_in_its_manifest_and_differs_from_step_1() {
        let tmp = tempfile::tempdir().unwrap();
        let run = |lag: usize| {
            let mut cfg = config(crate::recipe::presets::preset("nvfp4-dq").unwrap());
            cfg.model = ModelConfig::tiny();
            cfg.task = Task::Add(2);
            cfg.steps = 3;
            cfg.warm_start.max_steps = 30;
            cfg.grpo = GrpoConfig {
                max_response_tokens: 5,
                eval_every: 0,
                lr: 1e-2,
                policy_lag: lag,
                ..GrpoConfig::default()
            };
            let out = tmp.path().join(format!("lag{lag}"));
            let cache = tmp.path().join("cache");
            let be = crate::engine::backend::CpuBackend;
            run_one(&be, &cfg, "r", &out, Some(&cache), |_| {}).unwrap();
            let dir = RunDir::open(&out);
            (dir.read_manifest().unwrap(), dir.read_scalars().unwrap())
        };
        let ((sync_m, sync), (lag_m, lag)) = (run(0), run(1));
        assert_eq!(lag_m.config["grpo"]["policy_lag"], 1);
        assert!(sync_m.config["grpo"].get("policy_lag").is_none());
        let kl = |r: &[StepRecord], step: usize| r[step].get("train/train_rollout_kl").unwrap();
        // Step 0 samples the same weights either way; step 1 of the lagged run samples step 0's.
        assert_eq!(kl(&sync, 0).to_bits(), kl(&lag, 0).to_bits());
        assert_ne!(kl(&sync, 1).to_bits(), kl(&lag, 1).to_bits());
    }

    #[test]
    fn weight_bytes_count_each_sites_format() {
        let preset = |n: &str| crate::recipe::presets::preset(n).unwrap();
        let m = ModelConfig::small();
        let all: usize = Site::ALL
            .iter()
            .map(|s| site_weights(&m, *s).0)
            .sum::<usize>()
            * m.n_layers
            + m.vocab * m.d_model;
        assert_eq!(
            config(preset("bf16")).weight_bytes(),
            Some(2.0 * all as f64)
        );
        // A BF16 shared expert costs its weights at 2 bytes instead of NVFP4's 9/16 byte (codes
        // and E4M3 block scales) plus a 4-byte global scale per tensor, in every NVFP4 layer.
        let bf16_shared = config(preset("nvfp4-dq"));
        let mut fp4 = preset("nvfp4-dq");
        fp4.rules.insert(
            0,
            crate::recipe::Rule {
                pattern: "*.mlp.shared_experts.*".into(),
                format: Precision::Nvfp4,
                backward: None,
            },
        );
        let fp4_shared = config(fp4);
        let plan = fp4_shared.recipe.resolve(m.n_layers).unwrap();
        let layers = plan
            .layers
            .iter()
            .filter(|l| l.get(Site::SharedFc1).precision == Precision::Nvfp4)
            .count();
        assert!(layers >= 1, "{plan:?}");
        let n = (site_weights(&m, Site::SharedFc1).0 + site_weights(&m, Site::SharedFc2).0) as f64;
        let per_layer = 2.0 * n - (n * 9.0 / 16.0 + 8.0);
        let diff = bf16_shared.weight_bytes().unwrap() - fp4_shared.weight_bytes().unwrap();
        assert!((diff - layers as f64 * per_layer).abs() < 1e-6, "{diff}");
    }
}

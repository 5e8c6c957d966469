//! The warm start: a short supervised phase in BF16 that brings a freshly initialised policy to
//! partial accuracy (it stops at the first evaluation at or above `target_accuracy`, 0.3 by
//! default, inside the 20–60 % band where GRPO has signal: groups with both right and wrong
//! answers). It is cached as safetensors under the hash of everything that determines it, so
//! every configuration and seed of a suite starts from the same checkpoint; each recipe then
//! converts it to its own formats.

use super::backend::{Backend, Counts, HeldItem, HeldRun};
use super::checkpoint;
use super::layout::Layout;
use super::model::{self, ModelConfig, Params, PreparedModel};
use super::optim::AdamW;
use super::rollout::Policy;
use super::task::{Split, Task};
use crate::io::IoError;
use crate::io::lock::PidLock;
use crate::recipe::{ModelPlan, SitePlan};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Supervised warm-start settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WarmStartConfig {
    pub max_steps: usize,
    pub batch: usize,
    pub lr: f32,
    pub target_accuracy: f64,
    pub eval_every: usize,
    pub eval_prompts: usize,
    /// Initialisation and data seed (shared by every run of a suite, unlike the run seed).
    pub seed: u64,
}

impl Default for WarmStartConfig {
    fn default() -> Self {
        WarmStartConfig {
            max_steps: 4000,
            batch: 64,
            lr: 3e-3,
            target_accuracy: 0.3,
            eval_every: 25,
            eval_prompts: 128,
            seed: 0,
        }
    }
}

impl WarmStartConfig {
    /// Reject settings that cannot train, naming the field.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(format!(
                "lr = {}: use a positive learning rate, e.g. 1e-3",
                self.lr
            ));
        }
        if self.batch == 0 || self.eval_prompts == 0 {
            return Err("batch and eval_prompts must be at least 1".into());
        }
        if !(0.0..=1.0).contains(&self.target_accuracy) {
            return Err(format!(
                "target_accuracy = {}: use a fraction in [0, 1], e.g. 0.3",
                self.target_accuracy
            ));
        }
        Ok(())
    }
}

/// How the warm start was obtained.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WarmStartInfo {
    /// Hash of model config, task, settings and the lockstep version (the cache key).
    pub key: String,
    pub steps: usize,
    /// Held-out greedy accuracy in BF16 when it stopped.
    pub accuracy: f64,
    pub cached: bool,
    pub path: Option<PathBuf>,
}

/// The cache key of a warm start.
pub fn key(cfg: &ModelConfig, task: Task, ws: &WarmStartConfig) -> String {
    let text =
        serde_json::to_string(&(cfg, task, ws, env!("CARGO_PKG_VERSION"))).unwrap_or_default();
    let h: [u8; 32] = Sha256::digest(text.as_bytes()).into();
    h[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// The lock that lets one process at a time train the warm start cached at `path`.
fn cache_lock(path: &Path) -> Result<PidLock, IoError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| IoError::io(dir, e))?;
    let lock = path.with_extension("lock");
    PidLock::wait(&lock, std::time::Duration::from_millis(200)).map_err(|e| IoError::io(&lock, e))
}

/// Load the cached warm start or train it (and cache it when `cache_dir` is given).
pub fn warm_start(
    be: &dyn Backend,
    cfg: &ModelConfig,
    task: Task,
    ws: &WarmStartConfig,
    cache_dir: Option<&Path>,
    mut log: impl FnMut(&str),
) -> Result<(Params, WarmStartInfo), IoError> {
    // One warm start at a time in this process: a sweep's workers all start by asking for the same
    // checkpoint, and without this each would train it (N times the work); the later ones now wait
    // and load the cached file.
    static TRAINING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = TRAINING.lock().unwrap_or_else(|p| p.into_inner());
    let key = key(cfg, task, ws);
    let path =
        cache_dir.map(|d| d.join(format!("warmstart-{task}-{key}.safetensors").replace(':', "")));
    // And one at a time across processes sharing the cache (a sweep's worker processes, two
    // sweeps at once): the others wait for the file instead of training it again. A cached file
    // is read without the lock, so a read-only cache still serves.
    let _one_process = match &path {
        Some(p) if !p.exists() => Some(cache_lock(p)?),
        _ => None,
    };
    if let Some(p) = path.as_ref().filter(|p| p.exists()) {
        let (params, meta) = checkpoint::load(p, cfg)?;
        let num = |k: &str| {
            meta.get(k)
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(f64::NAN)
        };
        log(&format!("warm start: cached {}", p.display()));
        return Ok((
            params,
            WarmStartInfo {
                key,
                steps: num("steps") as usize,
                accuracy: num("accuracy"),
                cached: true,
                path: path.clone(),
            },
        ));
    }
    let (params, steps, accuracy) = train(be, cfg, task, ws, &mut log)
        .map_err(|e| IoError::invalid(Path::new("warm start"), e.to_string()))?;
    if let Some(p) = &path {
        if let Some(dir) = p.parent() {
            std::fs::create_dir_all(dir).map_err(|e| IoError::io(dir, e))?;
        }
        let meta = BTreeMap::from([
            ("steps".to_string(), steps.to_string()),
            ("accuracy".to_string(), accuracy.to_string()),
            ("task".to_string(), task.to_string()),
        ]);
        checkpoint::save(p, &params, meta)?;
    }
    Ok((
        params,
        WarmStartInfo {
            key,
            steps,
            accuracy,
            cached: false,
            path,
        },
    ))
}

/// Supervised cross-entropy on the answer tokens, in BF16, until the target accuracy; each step
/// is the backend's training forward and its backward. On a device that holds training state
/// the weights, their BF16 preparation, the gradients and AdamW stay there (as a GRPO run's do);
/// elsewhere the host prepares and updates them.
fn train(
    be: &dyn Backend,
    cfg: &ModelConfig,
    task: Task,
    ws: &WarmStartConfig,
    log: &mut impl FnMut(&str),
) -> Result<(Params, usize, f64), model::ModelError> {
    let plan = ModelPlan::uniform(cfg.n_layers, SitePlan::BF16);
    let mut learner = Learner::new(be, Params::init(cfg, ws.seed)?, ws.lr);
    let (pl, al) = (task.prompt_len(), task.answer_len());
    let t = pl + al;
    let mut accuracy = 0.0;
    for step in 0..=ws.max_steps {
        if step % ws.eval_every.max(1) == 0 {
            accuracy = learner.evaluate(&plan, task, ws)?;
            log(&format!(
                "warm start: step {step} held-out accuracy {accuracy:.3}"
            ));
            if accuracy >= ws.target_accuracy || step == ws.max_steps {
                return Ok((learner.finish()?, step, accuracy));
            }
        }
        let problems = task.sample(
            Split::Train,
            ws.batch,
            ws.seed.wrapping_mul(1_000_003).wrapping_add(step as u64),
        );
        let b = problems.len();
        let seqs: Vec<u32> = problems
            .iter()
            .flat_map(|p| p.prompt.iter().chain(&p.answer).copied())
            .collect();
        let inputs: Vec<u32> = (0..b)
            .flat_map(|s| seqs[s * t..(s + 1) * t - 1].to_vec())
            .collect();
        let layout = Layout::plain(b, t - 1);
        learner.step(&plan, &inputs, &layout, |logits| {
            answer_dlogits(logits, &seqs, b, (pl, al), cfg.vocab)
        })?;
    }
    Ok((learner.finish()?, ws.max_steps, accuracy))
}

/// dL/dlogits of the mean cross-entropy of the answer tokens (`seqs`: `b` sequences of prompt
/// then answer, `pl` and `al` tokens; `logits` over every position but the last).
fn answer_dlogits(
    logits: &[f32],
    seqs: &[u32],
    b: usize,
    (pl, al): (usize, usize),
    v: usize,
) -> Vec<f32> {
    let t = pl + al;
    let n = b * (t - 1);
    let mut logp = vec![0.0f32; n * v];
    super::ops::log_softmax_forward(&mut logp, logits, n, v);
    let count = (b * al) as f32;
    let mut dlogp = vec![0.0f32; n * v];
    for s in 0..b {
        for p in (pl - 1)..(t - 1) {
            let target = seqs[s * t + p + 1] as usize;
            dlogp[(s * (t - 1) + p) * v + target] = -1.0 / count;
        }
    }
    let mut dlogits = vec![0.0f32; n * v];
    super::ops::log_softmax_backward(&mut dlogits, &dlogp, &logp, n, v);
    dlogits
}

/// Gradients with a norm above 1 are scaled to norm 1.
fn clip_scale(norm: f64) -> f32 {
    if norm > 1.0 {
        (1.0 / (norm + 1e-6)) as f32
    } else {
        1.0
    }
}

/// The warm start's weights and optimizer: on the host, or held by the device as one run
/// (`init` is read when the device first sees it; `opt` then only counts steps).
enum Learner<'a> {
    Host {
        be: &'a dyn Backend,
        params: Params,
        opt: AdamW,
    },
    Held {
        run: HeldKey<'a>,
        init: Params,
        opt: AdamW,
    },
}

impl<'a> Learner<'a> {
    fn new(be: &'a dyn Backend, params: Params, lr: f32) -> Self {
        let opt = AdamW::new(&params, lr, 0.9, 0.98, 1e-8);
        if be.holds_training(1) {
            Learner::Held {
                run: HeldKey {
                    be,
                    key: super::trainer::new_run_key(),
                },
                init: params,
                opt,
            }
        } else {
            Learner::Host { be, params, opt }
        }
    }

    fn be(&self) -> &'a dyn Backend {
        match self {
            Learner::Host { be, .. } => *be,
            Learner::Held { run, .. } => run.be,
        }
    }

    fn failed(&self, what: &str, e: impl std::fmt::Display) -> ! {
        failed(self.be(), what, e)
    }

    /// Greedy held-out accuracy of the weights as they stand, prepared under `plan`.
    fn evaluate(
        &self,
        plan: &ModelPlan,
        task: Task,
        ws: &WarmStartConfig,
    ) -> Result<f64, model::ModelError> {
        let (be, al) = (self.be(), task.answer_len());
        let (prompts, seed) = (ws.eval_prompts, ws.seed);
        let on_host = |params: &Params| {
            let prep = PreparedModel::new(params, plan)?;
            Ok(super::trainer::evaluate(be, &prep, task, prompts, al, seed))
        };
        match self {
            Learner::Host { params, .. } => on_host(params),
            Learner::Held { run, init, .. } => {
                let me = HeldRun {
                    run: run.key,
                    params: init,
                    plan,
                };
                match be
                    .held_export(&[me])
                    .unwrap_or_else(|e| self.failed("export", e))
                {
                    Some(ex) => {
                        let policy = Policy::Held(&ex[0]);
                        Ok(
                            super::trainer::evaluate_batch(
                                be,
                                task,
                                prompts,
                                al,
                                &[(policy, seed)],
                            )[0],
                        )
                    }
                    None => on_host(&self.params()?),
                }
            }
        }
    }

    /// One supervised step over `inputs` in `layout`'s rows; `loss` maps the logits to
    /// dL/dlogits. Gradients are clipped to norm 1, then AdamW (no weight decay).
    fn step(
        &mut self,
        plan: &ModelPlan,
        inputs: &[u32],
        layout: &Layout,
        loss: impl Fn(&[f32]) -> Vec<f32>,
    ) -> Result<(), model::ModelError> {
        let be = self.be();
        match self {
            Learner::Host { params, opt, .. } => {
                let prep = PreparedModel::new(params, plan)?;
                let pass = be
                    .train_forward(&prep, inputs, layout, None)
                    .unwrap_or_else(|e| failed(be, "forward", e));
                let grads = pass.backward(&loss(pass.logits()));
                // Σ g² over every element in order (the norm this path has always used).
                let norm = grads
                    .named_tensors()
                    .iter()
                    .flat_map(|(_, g)| g.iter())
                    .map(|x| (*x as f64) * (*x as f64))
                    .sum::<f64>()
                    .sqrt();
                opt.update(params, &grads, clip_scale(norm), |_| 0.0);
            }
            Learner::Held { run, init, opt, .. } => {
                let item = HeldItem {
                    run: run.key,
                    params: init,
                    plan,
                    tokens: inputs,
                    layout,
                    replay: None,
                    export: None,
                };
                let mut pass = be
                    .held_forward_batch(&[item], Counts::Skip)
                    .unwrap_or_else(|e| failed(be, "forward", e));
                let dlogits = loss(pass.logits(0));
                // The device's per-tensor sums of squares, added in tensor order.
                let squares = pass
                    .backward(&[Some(&dlogits)])
                    .remove(0)
                    .unwrap_or_default();
                let norm = squares.iter().sum::<f64>().sqrt();
                let step = opt.next_step(clip_scale(norm));
                pass.update(&[Some(vec![step; squares.len()])]);
            }
        }
        Ok(())
    }

    /// The weights as they stand (read back from the device that holds them).
    fn params(&self) -> Result<Params, model::ModelError> {
        match self {
            Learner::Host { params, .. } => Ok(params.clone()),
            Learner::Held { run, .. } => Ok(run
                .be
                .held_params(&[run.key])
                .unwrap_or_else(|e| self.failed("read-back", e))
                .remove(0)),
        }
    }

    /// The trained weights; a device lets go of them.
    fn finish(self) -> Result<Params, model::ModelError> {
        match self {
            Learner::Host { params, .. } => Ok(params),
            Learner::Held { .. } => self.params(),
        }
    }
}

/// A warm start that cannot go on: the device's failure, as the suite runner reports it.
fn failed(be: &dyn Backend, what: &str, e: impl std::fmt::Display) -> ! {
    panic!("{}: warm start {what} failed: {e}", be.name())
}

/// A run whose state a device holds, let go of when dropped (also when the warm start fails).
struct HeldKey<'a> {
    be: &'a dyn Backend,
    key: u64,
}

impl Drop for HeldKey<'_> {
    fn drop(&mut self) {
        self.be.release_held(self.key);
    }
}

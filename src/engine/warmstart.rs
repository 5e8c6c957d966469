//! The warm start: a short supervised phase in BF16 that brings a freshly initialised policy to
//! partial accuracy (it stops at the first evaluation at or above `target_accuracy`, 0.3 by
//! default, inside the 20–60 % band where GRPO has signal: groups with both right and wrong
//! answers). It is cached as safetensors under the hash of everything that determines it, so
//! every configuration and seed of a suite starts from the same checkpoint; each recipe then
//! converts it to its own formats.

use super::backend::Backend;
use super::checkpoint;
use super::layout::Layout;
use super::model::{self, ModelConfig, Params, PreparedModel};
use super::optim::AdamW;
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
/// is the backend's training forward and its backward (on a GPU, on the device).
fn train(
    be: &dyn Backend,
    cfg: &ModelConfig,
    task: Task,
    ws: &WarmStartConfig,
    log: &mut impl FnMut(&str),
) -> Result<(Params, usize, f64), model::ModelError> {
    let mut params = Params::init(cfg, ws.seed)?;
    let plan = ModelPlan::uniform(cfg.n_layers, SitePlan::BF16);
    let mut opt = AdamW::new(&params, ws.lr, 0.9, 0.98, 1e-8);
    let (pl, al, v) = (task.prompt_len(), task.answer_len(), cfg.vocab);
    let t = pl + al;
    let mut accuracy = 0.0;
    for step in 0..=ws.max_steps {
        if step % ws.eval_every.max(1) == 0 {
            let prep = PreparedModel::new(&params, &plan)?;
            accuracy = super::trainer::evaluate(be, &prep, task, ws.eval_prompts, al, ws.seed);
            log(&format!(
                "warm start: step {step} held-out accuracy {accuracy:.3}"
            ));
            if accuracy >= ws.target_accuracy || step == ws.max_steps {
                return Ok((params, step, accuracy));
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
        let prep = PreparedModel::new(&params, &plan)?;
        let layout = Layout::plain(b, t - 1);
        let pass = be
            .train_forward(&prep, &inputs, &layout, None)
            .unwrap_or_else(|e| panic!("{}: warm start forward failed: {e}", be.name()));
        let n = b * (t - 1);
        let mut logp = vec![0.0f32; n * v];
        super::ops::log_softmax_forward(&mut logp, pass.logits(), n, v);
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
        let grads = pass.backward(&dlogits);
        let norm = grads
            .named_tensors()
            .iter()
            .flat_map(|(_, g)| g.iter())
            .map(|x| (*x as f64) * (*x as f64))
            .sum::<f64>()
            .sqrt();
        let scale = if norm > 1.0 {
            (1.0 / (norm + 1e-6)) as f32
        } else {
            1.0
        };
        opt.update(&mut params, &grads, scale, |_| 0.0);
    }
    Ok((params, ws.max_steps, accuracy))
}

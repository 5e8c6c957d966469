//! One configuration and seed, end to end: warm start (cached), precision conversion, GRPO steps,
//! and the run folder the run store holds. A non-finite loss stops the run with status `diverged`
//! and its events recorded; a panic inside the engine becomes status `failed` — neither takes the
//! process (or a sweep) down. Several runs of one shape can run as one batch
//! ([`run_batch_until`]), stepped together through the device's batched passes; each run's folder
//! is what it would be alone.

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
/// status `interrupted` and the steps so far written. A batch of one ([`run_batch_until`]).
pub fn run_one_until(
    be: &dyn Backend,
    cfg: &RunConfig,
    run_id: &str,
    out: &Path,
    cache: Option<&Path>,
    mut on_step: impl FnMut(&StepRecord),
    stop: &dyn Fn() -> Option<i32>,
) -> Result<Manifest, IoError> {
    let run = BatchRun {
        cfg,
        run_id,
        out,
        on_step: &mut on_step,
    };
    let mut ended = None;
    run_batch_until(be, vec![run], cache, stop, &mut |_, result| {
        ended = Some(result)
    });
    ended.expect("every run of a batch ends")
}

/// One run of [`run_batch_until`]: what [`run_one_until`] takes for it.
pub struct BatchRun<'a> {
    pub cfg: &'a RunConfig,
    pub run_id: &'a str,
    pub out: &'a Path,
    pub on_step: &'a mut dyn FnMut(&StepRecord),
}

/// Several runs stepped together ([`Trainer::step_batch`]: one batched device call per pass),
/// each into its own folder exactly as [`run_one_until`] would write it alone: its own warm
/// start (through the shared `cache`), manifest, log, metrics and status. A run that diverges,
/// finishes its steps or cannot start leaves the batch and the others go on; `stop` naming a
/// signal ends every run still stepping as `interrupted`; a panic in a batched step (a device
/// failure) fails every run still stepping, with its message. `on_end(i, result)` is called as
/// run `i` ends, with what [`run_one_until`] would have returned for it. The runs must share a
/// [`BatchShape`](crate::engine::trainer::BatchShape) (runs that do not fail at their first step).
pub fn run_batch_until(
    be: &dyn Backend,
    runs: Vec<BatchRun<'_>>,
    cache: Option<&Path>,
    stop: &dyn Fn() -> Option<i32>,
    on_end: &mut dyn FnMut(usize, Result<Manifest, IoError>),
) {
    let mut live = Vec::new();
    for (index, run) in runs.into_iter().enumerate() {
        match start(be, index, run, cache) {
            Ok(Start::Ready(l)) => live.push(*l),
            Ok(Start::Failed(m)) => on_end(index, Ok(*m)),
            Err(e) => on_end(index, Err(e)),
        }
    }
    note_batch(&mut live);
    loop {
        let (done, stepping): (Vec<Live>, Vec<Live>) = live
            .into_iter()
            .partition(|l| l.records.len() >= l.run.cfg.steps);
        for l in done {
            l.end(be, RunStatus::Ok, None, on_end);
        }
        live = stepping;
        if live.is_empty() {
            return;
        }
        if let Some(sig) = stop() {
            for l in live {
                let step = l.records.len();
                let why =
                    format!("interrupted by signal {sig} before step {step}; rerun to redo it");
                l.end(be, RunStatus::Interrupted, Some(why), on_end);
            }
            return;
        }
        let stepped =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| step(be, &mut live)));
        match stepped {
            Ok(diverged) => {
                let mut next = Vec::new();
                for (l, diverged) in live.into_iter().zip(diverged) {
                    if diverged {
                        l.end(be, RunStatus::Diverged, None, on_end);
                    } else {
                        next.push(l);
                    }
                }
                live = next;
            }
            Err(p) => {
                let why = panic_message(p.as_ref());
                for l in live {
                    l.end(be, RunStatus::Failed, Some(why.clone()), on_end);
                }
                return;
            }
        }
    }
}

/// The key under which a run's manifest lists the runs it started stepping with (itself
/// included), when there were others: on a GPU a run's numbers are bit for bit the same only
/// for the same neighbours, so whoever compares two runs needs them.
pub const BATCH_KEY: &str = "batch";

/// Record in each manifest of a batch of several runs the runs it started with.
fn note_batch(live: &mut [Live<'_>]) {
    if live.len() < 2 {
        return;
    }
    let ids: Vec<serde_json::Value> = live
        .iter()
        .map(|l| serde_json::Value::from(l.manifest.run_id.as_str()))
        .collect();
    for l in live.iter_mut() {
        l.manifest
            .extra
            .insert(BATCH_KEY.into(), serde_json::Value::Array(ids.clone()));
    }
}

/// A run of a batch that is stepping.
struct Live<'a> {
    index: usize,
    run: BatchRun<'a>,
    dir: RunDir,
    manifest: Manifest,
    trainer: Trainer,
    records: Vec<StepRecord>,
}

impl Live<'_> {
    /// Write the run's metrics and final manifest, and report it ended; the device forgets the
    /// training state it held for it.
    fn end(
        mut self,
        be: &dyn Backend,
        status: RunStatus,
        error: Option<String>,
        on_end: &mut dyn FnMut(usize, Result<Manifest, IoError>),
    ) {
        be.release_held(self.trainer.run_key());
        let written = finish(&self.dir, &mut self.manifest, &self.records, status, error);
        on_end(self.index, written.map(|()| self.manifest));
    }
}

/// Record a run's end: its metrics, then its manifest (written last: it is what says the run is
/// finished).
fn finish(
    dir: &RunDir,
    manifest: &mut Manifest,
    records: &[StepRecord],
    status: RunStatus,
    error: Option<String>,
) -> Result<(), IoError> {
    dir.write_metrics(records)?;
    manifest.status = status;
    manifest.error = error;
    manifest.steps_done = records.len();
    manifest.finished = Some(crate::store::run::now_utc());
    dir.write_manifest(manifest)
}

/// How starting a run went.
enum Start<'a> {
    /// Ready to step.
    Ready(Box<Live<'a>>),
    /// Failed before its first step (in its warm start, or making its trainer): its final
    /// manifest, written.
    Failed(Box<Manifest>),
}

/// Start a run: its folder and first manifest, its warm start, its trainer.
fn start<'a>(
    be: &dyn Backend,
    index: usize,
    run: BatchRun<'a>,
    cache: Option<&Path>,
) -> Result<Start<'a>, IoError> {
    let (cfg, out) = (run.cfg, run.out);
    let dir = RunDir::create(out)?;
    let config_json =
        serde_json::to_value(cfg).map_err(|e| IoError::invalid(out, e.to_string()))?;
    let mut manifest = Manifest::start(
        run.run_id,
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
            return Ok(Start::Failed(Box::new(manifest)));
        }
    };
    manifest.extra.insert(
        "warm_start".into(),
        serde_json::to_value(&ws).unwrap_or_default(),
    );
    let trainer = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        Trainer::new(
            init,
            cfg.task,
            cfg.recipe.clone(),
            cfg.grpo.clone(),
            cfg.seed,
            cfg.contract_break,
        )
        .map_err(|e| e.to_string())
    }))
    .unwrap_or_else(|p| Err(panic_message(p.as_ref())));
    match trainer {
        Ok(trainer) => Ok(Start::Ready(Box::new(Live {
            index,
            run,
            dir,
            manifest,
            trainer,
            records: Vec::new(),
        }))),
        Err(why) => {
            finish(&dir, &mut manifest, &[], RunStatus::Failed, Some(why))?;
            Ok(Start::Failed(Box::new(manifest)))
        }
    }
}

/// One step of every run in `live`, together; each run's step logged, reported and kept.
/// Returns which runs diverged (their loss went non-finite).
fn step(be: &dyn Backend, live: &mut [Live<'_>]) -> Vec<bool> {
    let mut trainers: Vec<&mut Trainer> = live.iter_mut().map(|l| &mut l.trainer).collect();
    let recs = Trainer::step_batch(&mut trainers, be);
    live.iter_mut()
        .zip(recs)
        .map(|(l, rec)| {
            let diverged = rec
                .events
                .iter()
                .any(|e| e.kind == "non_finite" && e.site == "train/loss");
            l.dir.log(&step_line(&rec));
            (l.run.on_step)(&rec);
            l.records.push(rec);
            diverged
        })
        .collect()
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
    use crate::engine::device::OpError;

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

    /// A tiny run of `steps` steps of `recipe` under `seed`.
    fn tiny(recipe: &str, seed: u64, steps: usize) -> RunConfig {
        let mut cfg = config(crate::recipe::presets::preset(recipe).unwrap());
        cfg.model = ModelConfig::tiny();
        cfg.task = Task::Add(2);
        cfg.seed = seed;
        cfg.steps = steps;
        cfg.warm_start.max_steps = 10;
        cfg.warm_start.eval_prompts = 8;
        cfg.grpo = GrpoConfig {
            prompts_per_step: 2,
            max_response_tokens: 5,
            eval_every: 0,
            ..GrpoConfig::default()
        };
        cfg
    }

    /// Run `cfgs` as one batch into `root/<i>`; each run's manifest.
    fn batch(
        be: &dyn Backend,
        cfgs: &[RunConfig],
        root: &Path,
        stop: &dyn Fn() -> Option<i32>,
    ) -> Vec<Manifest> {
        let outs: Vec<PathBuf> = (0..cfgs.len()).map(|i| root.join(i.to_string())).collect();
        let mut on_steps: Vec<_> = cfgs.iter().map(|_| |_: &StepRecord| {}).collect();
        let runs = cfgs
            .iter()
            .zip(&outs)
            .zip(&mut on_steps)
            .map(|((cfg, out), on_step)| BatchRun {
                cfg,
                run_id: "r",
                out,
                on_step,
            })
            .collect();
        let mut ended: Vec<Option<Manifest>> = vec![None; cfgs.len()];
        let cache = root.join("cache");
        run_batch_until(be, runs, Some(&cache), stop, &mut |i, m| {
            ended[i] = Some(m.unwrap())
        });
        ended.into_iter().map(|m| m.expect("ended")).collect()
    }

    #[test]
    fn a_signal_stops_every_run_of_a_batch_at_its_own_step() {
        let tmp = tempfile::tempdir().unwrap();
        let cfgs = [tiny("bf16", 1, 1), tiny("bf16", 2, 4), tiny("mxfp8", 3, 4)];
        let asked = std::cell::Cell::new(0);
        // The signal comes after the batch's second step.
        let stop = || {
            asked.set(asked.get() + 1);
            (asked.get() > 2).then_some(15)
        };
        let be = crate::engine::backend::CpuBackend;
        let ms = batch(&be, &cfgs, tmp.path(), &stop);
        assert_eq!((ms[0].status, ms[0].steps_done), (RunStatus::Ok, 1));
        for m in &ms[1..] {
            assert_eq!((m.status, m.steps_done), (RunStatus::Interrupted, 2));
            assert_eq!(
                m.error.as_deref(),
                Some("interrupted by signal 15 before step 2; rerun to redo it")
            );
        }
        let steps = RunDir::open(&tmp.path().join("2")).read_scalars().unwrap();
        assert_eq!(steps.len(), 2, "the steps so far are written");
    }

    /// The CPU backend, but a batched training forward of more than one run fails, as a
    /// device fault in a batched pass would.
    struct FailsBatches;

    impl Backend for FailsBatches {
        fn name(&self) -> String {
            "cpu-failing-batches".into()
        }
        fn decoder<'a>(
            &'a self,
            prep: &'a crate::engine::model::PreparedModel,
            seqs: usize,
            positions: usize,
        ) -> Result<Box<dyn crate::engine::rollout::Decoder + 'a>, OpError> {
            crate::engine::backend::CpuBackend.decoder(prep, seqs, positions)
        }
        fn forward_logits(
            &self,
            prep: &crate::engine::model::PreparedModel,
            tokens: &[u32],
            layout: &crate::engine::layout::Layout,
            replay: Option<&crate::engine::model::Routing>,
        ) -> Result<Vec<f32>, OpError> {
            crate::engine::backend::CpuBackend.forward_logits(prep, tokens, layout, replay)
        }
        fn train_forward<'a>(
            &'a self,
            prep: &'a crate::engine::model::PreparedModel,
            tokens: &[u32],
            layout: &crate::engine::layout::Layout,
            replay: Option<&crate::engine::model::Routing>,
        ) -> Result<Box<dyn crate::engine::model::TrainPass + 'a>, OpError> {
            crate::engine::backend::CpuBackend.train_forward(prep, tokens, layout, replay)
        }
        fn train_forward_batch<'a>(
            &'a self,
            items: &[crate::engine::backend::ForwardItem<'a>],
            _counts: crate::engine::backend::Counts,
        ) -> Result<Box<dyn crate::engine::backend::TrainBatch + 'a>, OpError> {
            if items.len() > 1 {
                return Err(OpError::Device("planted fault".into()));
            }
            let passes = items
                .iter()
                .map(|i| self.train_forward(i.prep, i.tokens, i.layout, i.replay))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(Box::new(crate::engine::backend::LoopBatch(passes)))
        }
    }

    #[test]
    fn a_failed_batched_pass_fails_every_run_of_the_batch_with_its_message() {
        let tmp = tempfile::tempdir().unwrap();
        let cfgs = [tiny("bf16", 1, 2), tiny("nvfp4-dq", 2, 2)];
        let ms = batch(&FailsBatches, &cfgs, tmp.path(), &|| None);
        for m in &ms {
            assert_eq!((m.status, m.steps_done), (RunStatus::Failed, 0));
            let e = m.error.as_deref().unwrap_or_default();
            assert!(
                e.contains("cpu-failing-batches: training forward failed")
                    && e.contains("planted fault"),
                "{e}"
            );
        }
        // Alone, the same run computes.
        let alone = batch(
            &FailsBatches,
            &cfgs[..1],
            &tmp.path().join("alone"),
            &|| None,
        );
        assert_eq!((alone[0].status, alone[0].steps_done), (RunStatus::Ok, 2));
    }
}

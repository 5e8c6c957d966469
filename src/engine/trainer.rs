//! GRPO: every step exports the policy to the rollout engine, samples `P x n` responses (from
//! that export, or with `policy_lag = k` from the one k steps older, as asynchronous RL systems
//! do), scores them with the task's exact-match reward, normalises advantages within each
//! prompt's group, and takes PPO-clipped policy-gradient updates on the trainer's own quantized
//! forward. It emits a [`StepRecord`] per step and writes no files.
//!
//! Losses are token means over response tokens (DAPO style). Truncated importance sampling, when
//! on, reweights each token by `min(exp(logp_old - logp_rollout), cap)`: the correction for the
//! train/rollout mismatch low-precision rollouts introduce. The optional KL-to-reference term uses
//! the k3 estimator against the BF16 warm start (coefficient 0 by default, as in the published runs:
//! it is still measured, as `train/kl_loss`).
//!
//! Runs of one shape can step together ([`Trainer::step_batch`]): each device pass of the step is
//! then one batched backend call over all of them, which is what keeps a GPU busy with runs this
//! small; a single run's step is a batch of one.

use super::backend::{
    Backend, Counts, ForwardItem, HeldBatch, HeldExport, HeldItem, HeldRun, TrainBatch,
};
use super::contract;
use super::cost;
use super::layout::Layout;
use super::metrics::{Event, LayerRecord, StepRecord, site_of};
use super::model::{self, ModelConfig, Params, PreparedModel, Routing};
use super::optim::{AdamStep, AdamW};
use super::rollout::{self, Policy, Rollout, RolloutItem};
use super::task::{Problem, Split, Task};
use crate::formats::{MxScaleRule, QuantStats, SecondScale};
use crate::recipe::{ModelPlan, Precision, Recipe, RecipeError, SitePlan};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};
use std::time::Instant;

/// GRPO and optimizer settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GrpoConfig {
    pub prompts_per_step: usize,
    pub samples_per_prompt: usize,
    pub max_response_tokens: usize,
    pub temperature: f32,
    /// Optimizer steps per rollout (the batch is split into this many minibatches of whole groups).
    pub minibatches: usize,
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub adam_eps: f32,
    pub grad_clip: f32,
    pub clip_low: f32,
    pub clip_high: f32,
    /// Truncated importance sampling cap on exp(logp_train - logp_rollout); `None` is off.
    pub tis_cap: Option<f32>,
    pub kl_coef: f32,
    /// The trainer reuses the experts the rollout chose for each token.
    pub routing_replay: bool,
    /// Asynchronous RL: the rollout of step t samples from the weights exported at step t - k
    /// (in the first k steps, the oldest export kept). 0 is synchronous. Left out of the
    /// serialized config at 0, so synchronous runs keep their run ids.
    #[serde(skip_serializing_if = "is_zero")]
    pub policy_lag: usize,
    /// Evaluate held-out greedy accuracy every this many steps (and at the first and last step).
    pub eval_every: usize,
    pub eval_prompts: usize,
    /// A site's grad norm above this multiple of its rolling median is a `grad_spike` event.
    pub spike_ratio: f64,
    pub spike_window: usize,
}

impl Default for GrpoConfig {
    fn default() -> Self {
        GrpoConfig {
            prompts_per_step: 8,
            samples_per_prompt: 8,
            max_response_tokens: 8,
            temperature: 1.0,
            minibatches: 1,
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            adam_eps: 1e-8,
            grad_clip: 1.0,
            clip_low: 0.2,
            clip_high: 0.28,
            tis_cap: Some(2.0),
            kl_coef: 0.0,
            routing_replay: true,
            policy_lag: 0,
            eval_every: 10,
            eval_prompts: 64,
            spike_ratio: 10.0,
            spike_window: 10,
        }
    }
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// Most steps a rollout may lag the trainer by (each kept export holds a quantized copy of the
/// model).
pub const MAX_POLICY_LAG: usize = 8;

/// Deliberate breaks of the trainer/rollout quantization contract (to see what they do to KL and
/// reward). Each changes the rollout's plan only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ContractBreak {
    #[default]
    None,
    /// The rollout uses per-tensor NVFP4 activation scales instead of per-token.
    PerTensorNvfp4,
    /// The rollout computes NVFP4 per-token scales over this many shards of K.
    Shards(usize),
    /// The rollout uses the OCP floor rule for MXFP8 scales.
    Mxfp8FloorScale,
}

/// The rollout's plan: the trainer's, with the contract break applied to quantized sites.
pub fn rollout_plan(plan: &ModelPlan, brk: ContractBreak) -> ModelPlan {
    let apply = |p: &SitePlan| -> SitePlan {
        match (brk, p.precision) {
            (ContractBreak::PerTensorNvfp4, Precision::Nvfp4) => SitePlan {
                act_scale: SecondScale::PerTensor,
                ..*p
            },
            (ContractBreak::Shards(s), Precision::Nvfp4) => SitePlan { shards: s, ..*p },
            (ContractBreak::Mxfp8FloorScale, Precision::Mxfp8) => SitePlan {
                mx_rule: MxScaleRule::OcpFloor,
                ..*p
            },
            _ => *p,
        }
    };
    let mut out = plan.clone();
    for l in &mut out.layers {
        for p in [
            &mut l.linear_qkv,
            &mut l.linear_proj,
            &mut l.router,
            &mut l.experts_fc1,
            &mut l.experts_fc2,
            &mut l.shared_fc1,
            &mut l.shared_fc2,
        ] {
            *p = apply(p);
        }
    }
    out.output_layer = apply(&out.output_layer);
    out
}

/// Why a trainer could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TrainerError {
    #[error(transparent)]
    Recipe(#[from] RecipeError),
    #[error(transparent)]
    Model(#[from] model::ModelError),
    #[error(
        "site {site}: {err}; choose model dimensions the format's blocks divide (or another recipe)"
    )]
    Site {
        site: String,
        err: crate::formats::FormatError,
    },
    #[error(
        "task {task}: prompt ({prompt}) + response ({resp}) tokens exceed the model's max_seq {max_seq}"
    )]
    TooLong {
        task: String,
        prompt: usize,
        resp: usize,
        max_seq: usize,
    },
}

/// The GRPO trainer: master weights, optimizer state, the precision plans of both sides.
///
/// What configurations run under one seed share (common random numbers, which is what lets
/// `compare` pair them seed by seed): the warm start (seeded by the suite's warm-start seed, not
/// the run seed, so every run of a suite starts from the same weights); each step's training
/// prompts, in order ([`Trainer::train_problems`], a function of the run seed and the step only);
/// the seed of each step's sampling stream ([`Trainer::sampling_seed`]); and the held-out
/// evaluation problems. The sampler draws one uniform per live sequence and position in a fixed
/// order, so the draws stay aligned across configurations until a sequence ends in one
/// configuration and not in the other (an ended sequence draws nothing), after which that step's
/// later draws shift. Not shared, by design: everything the precision changes, i.e. the quantized
/// weights and activations, hence the logits, the sampled tokens, the rewards and the updates.
pub struct Trainer {
    pub config: GrpoConfig,
    pub task: Task,
    pub recipe: Recipe,
    pub plan: ModelPlan,
    pub rollout_plan: ModelPlan,
    pub params: Params,
    seed: u64,
    adam: AdamW,
    reference: PreparedModel,
    kl_ref_step0: Option<f64>,
    /// Weight decay per named tensor.
    decay: BTreeMap<String, f32>,
    /// Rolling grad norms per (site, layer) for spike detection.
    history: BTreeMap<(String, i64), Vec<f64>>,
    /// The rollout's exported policies, oldest first: the last `policy_lag + 1`.
    exported: VecDeque<Exported>,
    /// The last step's rollout, as sampled.
    last_rollout: Option<Rollout>,
    pub step: usize,
    /// This trainer's key among the runs a device holds the training state of
    /// ([`Backend::holds_training`]).
    run_key: u64,
    /// Whether the device holds this run's state ([`Backend::holds_training`], asked at the
    /// run's first step and kept: the state lives in one place for the whole run).
    held: Option<bool>,
    /// The device holds this run's state and updated it since `params` was read back: `params`
    /// (and the host `adam`'s moments, which the device then keeps) are stale until
    /// [`Trainer::sync_params`].
    params_on_device: bool,
}

/// Keys of trainers, unique in the process.
static RUN_KEYS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A key no other run of this process has, for state a device holds ([`HeldItem::run`]).
pub fn new_run_key() -> u64 {
    RUN_KEYS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Deterministic per-step seeds derived from the run seed.
fn mix(seed: u64, step: usize, stream: u64) -> u64 {
    let mut z = seed
        ^ (step as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Trainer {
    /// Start from `init` (the warm start) under `recipe`.
    pub fn new(
        init: Params,
        task: Task,
        recipe: Recipe,
        config: GrpoConfig,
        seed: u64,
        brk: ContractBreak,
    ) -> Result<Trainer, TrainerError> {
        let cfg = init.config.clone();
        check_setup(&cfg, &task, &config, &recipe, brk)?;
        let plan = recipe.resolve(cfg.n_layers)?;
        let rollout_plan = rollout_plan(&plan, brk);
        let reference =
            PreparedModel::new(&init, &ModelPlan::uniform(cfg.n_layers, SitePlan::BF16))?;
        let decay = weight_decay_table(&init, &plan, &recipe);
        let adam = AdamW::new(
            &init,
            config.lr,
            config.beta1,
            config.beta2,
            config.adam_eps,
        );
        Ok(Trainer {
            config,
            task,
            recipe,
            plan,
            rollout_plan,
            params: init,
            seed,
            adam,
            reference,
            kl_ref_step0: None,
            decay,
            history: BTreeMap::new(),
            exported: VecDeque::new(),
            last_rollout: None,
            step: 0,
            run_key: new_run_key(),
            held: None,
            params_on_device: false,
        })
    }

    /// This trainer's key among the runs whose state a device holds ([`Backend::release_held`]
    /// takes it when the run ends).
    pub fn run_key(&self) -> u64 {
        self.run_key
    }

    /// Read the master weights back from `be` where the device holds this run's state and
    /// updated them: `params` is then current.
    ///
    /// # Panics
    /// When the device cannot give them back (the message names the device).
    pub fn sync_params(&mut self, be: &dyn Backend) {
        Trainer::sync_params_batch(&mut [self], be);
    }

    /// [`Trainer::sync_params`] of several runs, their weights read back together (one copy).
    pub fn sync_params_batch(trainers: &mut [&mut Trainer], be: &dyn Backend) {
        let stale: Vec<usize> = (0..trainers.len())
            .filter(|&i| trainers[i].params_on_device)
            .collect();
        if stale.is_empty() {
            return;
        }
        let keys: Vec<u64> = stale.iter().map(|&i| trainers[i].run_key).collect();
        let params = be
            .held_params(&keys)
            .unwrap_or_else(|e| panic!("{}: reading run weights back failed: {e}", be.name()));
        for (i, p) in stale.into_iter().zip(params) {
            trainers[i].params = p;
            trainers[i].params_on_device = false;
        }
    }

    /// One GRPO step: export, rollout, score, update. Returns everything it measured.
    pub fn step(&mut self, be: &dyn Backend) -> StepRecord {
        Trainer::step_batch(&mut [self], be).remove(0)
    }

    /// One GRPO step of several runs at once ("members", of one [`BatchShape`]; seeds, recipes
    /// and optimizer settings may differ): every device pass of all of them is one batched call
    /// ([`Backend::decoder_batch`], [`Backend::train_forward_batch`],
    /// [`Backend::forward_logits_batch`]), and the host work of each member stays its own, the
    /// members' side by side. Each member's record is what its step alone would give on a device
    /// whose batched passes equal its single ones (the CPU: bit for bit), except for the `perf/*`
    /// times of the phases the members go through together (export, rollout, train and its first
    /// forward and backwards, the whole step): those are the batch phase's wall time, recorded
    /// for every member.
    ///
    /// # Panics
    /// When the members' shapes differ, or a device pass fails (the message names the device).
    pub fn step_batch(trainers: &mut [&mut Trainer], be: &dyn Backend) -> Vec<StepRecord> {
        let Some(first) = trainers.first() else {
            return Vec::new();
        };
        let shape = first.batch_shape();
        assert!(
            trainers.iter().all(|t| t.batch_shape() == shape),
            "Trainer::step_batch: members must share the model, the task and the rollout's sizes"
        );
        // Where a run's training state lives is settled at its first step.
        let held = be.holds_training(trainers.len());
        for t in trainers.iter_mut() {
            t.held.get_or_insert(held);
        }
        assert!(
            trainers.iter().all(|t| t.held == trainers[0].held),
            "Trainer::step_batch: members whose state the device holds step apart from others"
        );
        let t_step = Instant::now();
        let mut recs: Vec<StepRecord> = trainers
            .iter()
            .map(|t| StepRecord {
                step: t.step,
                ..Default::default()
            })
            .collect();

        // 1. Live weight export: the rollout builds its own quantized view of the shipped weights
        // (the master weights as they stand, read-only: no copy is needed to ship them). Where
        // the device holds them, it prepares the export itself; else they are read back first.
        let t0 = Instant::now();
        if !Trainer::export_held(trainers, be) {
            Trainer::sync_params_batch(trainers, be);
            trainers.par_iter_mut().for_each(|t| t.export());
        }
        set_each(&mut recs, "perf/export_time", t0.elapsed().as_secs_f64());

        // 2. Rollout, the trainers' own weights, rewards and advantages.
        let scored = Trainer::rollout_batch(trainers, be, &mut recs);

        // 3. Train: old logprobs, mismatch metrics, minibatch updates.
        let t0 = Instant::now();
        let diverged = Trainer::train_batch(trainers, be, &scored, &mut recs);
        let train_time = t0.elapsed().as_secs_f64();
        for (rec, sc) in recs.iter_mut().zip(&scored) {
            rec.set("perf/train_time", train_time);
            rec.set(
                "perf/train_tokens_per_s",
                (sc.ro.b * (sc.ro.t - 1)) as f64 / train_time.max(1e-9),
            );
        }

        // 4. Held-out accuracy.
        Trainer::evaluate_due(trainers, be, &diverged, &mut recs);

        set_each(&mut recs, "perf/step_time", t_step.elapsed().as_secs_f64());
        for (t, sc) in trainers.iter_mut().zip(scored) {
            t.last_rollout = Some(sc.ro);
            t.step += 1;
        }
        recs
    }

    /// The shape of this trainer's device passes: what the members of one batch share.
    pub fn batch_shape(&self) -> BatchShape {
        BatchShape::new(&self.params.config, self.task, &self.config)
    }

    /// Every member's rollout (one batched decode) and, side by side, each trainer's own
    /// preparation of its weights (it quantizes independently of the export: the contract check
    /// compares the two); then each member's contract check, rewards and advantages.
    fn rollout_batch(
        trainers: &[&mut Trainer],
        be: &dyn Backend,
        recs: &mut [StepRecord],
    ) -> Vec<Scored> {
        let c = &trainers[0].config; // the sizes all members share
        let problems: Vec<Vec<Problem>> = trainers.iter().map(|t| t.train_problems()).collect();
        let prompts = prompts_of(&problems);
        let items: Vec<RolloutItem> = trainers
            .iter()
            .zip(&prompts)
            .map(|(t, prompts)| RolloutItem {
                policy: t.newest_and_sampled().1.policy(),
                prompts,
                seed: t.sampling_seed(),
            })
            .collect();
        let ((rollouts, rollout_time), preps) = rayon::join(
            || {
                let t0 = Instant::now();
                let ros = rollout::generate_batch(
                    be,
                    &items,
                    c.samples_per_prompt,
                    c.max_response_tokens,
                    c.temperature,
                );
                (ros, t0.elapsed().as_secs_f64())
            },
            || {
                trainers
                    .par_iter()
                    .map(|t| match t.newest_and_sampled().0 {
                        Exported::Host(_) => Some(
                            PreparedModel::new(&t.params, &t.plan)
                                .expect("plan checked at construction"),
                        ),
                        Exported::Held(_) => None,
                    })
                    .collect::<Vec<_>>()
            },
        );
        (trainers, rollouts, preps, problems, recs)
            .into_par_iter()
            .map(|(t, ro, prep, problems, rec)| t.score(ro, prep, &problems, rollout_time, rec))
            .collect()
    }

    /// This member's rollout checked against its trainer's weights `prep` (the contract) and
    /// scored: rewards, group-normalised advantages, and the rows its training reads.
    ///
    /// An export the device made ([`Backend::held_export`]) is checked by construction: the
    /// device prepares it from the held masters under the trainer's own plan, as it prepares the
    /// trainer's forwards, and never under another (a rollout plan of its own exports through
    /// the host, whose bytes are compared here).
    fn score(
        &self,
        ro: Rollout,
        prep: Option<PreparedModel>,
        problems: &[Problem],
        rollout_time: f64,
        rec: &mut StepRecord,
    ) -> Scored {
        let bad = match (&prep, self.newest_and_sampled().0) {
            (Some(prep), Exported::Host(newest)) => contract::mismatches(
                &contract::fingerprints(prep),
                &contract::fingerprints(newest),
            ),
            _ => Vec::new(),
        };
        rec.set("contract/violations", bad.len() as f64);
        for site in &bad {
            rec.events.push(Event {
                step: self.step,
                kind: "contract_violation".into(),
                site: site.clone(),
                layer: site_of(
                    site.split(".weight")
                        .next()
                        .unwrap_or(site)
                        .trim_end_matches(".activation"),
                )
                .1,
                value: 1.0,
                detail: "trainer and rollout quantized this site to different bytes".into(),
            });
        }
        let gen_tokens: usize = ro.response_len.iter().sum();
        rec.set("perf/rollout_time", rollout_time);
        rec.set(
            "perf/rollout_tokens_per_s",
            gen_tokens as f64 / rollout_time.max(1e-9),
        );

        let n = self.config.samples_per_prompt;
        let rewards: Vec<f32> = (0..ro.b)
            .map(|s| self.task.reward(&problems[s / n], ro.response(s)))
            .collect();
        let adv = group_advantages(&rewards, n);
        rec.set(
            "rollout/raw_reward",
            mean(rewards.iter().map(|r| *r as f64)),
        );
        rec.set("rollout/rewards", mean(adv.iter().map(|a| *a as f64)));
        rec.set(
            "rollout/response_len/mean",
            mean(ro.response_len.iter().map(|l| *l as f64)),
        );
        rec.set(
            "rollout/truncated_ratio",
            mean(ro.truncated.iter().map(|t| f64::from(u8::from(*t)))),
        );
        let rows = TrainRows::new(&ro, &self.config);
        Scored {
            ro,
            prep,
            adv,
            rows,
        }
    }

    /// Export the current weights to the rollout, prepared on the host.
    fn export(&mut self) {
        let prep = PreparedModel::new(&self.params, &self.rollout_plan)
            .expect("plan checked at construction");
        self.keep_export(Exported::Host(Box::new(prep)));
    }

    /// Keep `e` as the newest export, and the last `policy_lag + 1` exports.
    fn keep_export(&mut self, e: Exported) {
        self.exported.push_back(e);
        while self.exported.len() > self.config.policy_lag + 1 {
            self.exported.pop_front();
        }
    }

    /// Export every member's current weights on the device that holds them, where it can: each
    /// member's state is held and its rollout reads its own plan. Returns whether it did (else
    /// the host exports them all).
    fn export_held(trainers: &mut [&mut Trainer], be: &dyn Backend) -> bool {
        if trainers
            .iter()
            .any(|t| t.held != Some(true) || t.rollout_plan != t.plan)
        {
            return false;
        }
        let runs: Vec<HeldRun> = trainers
            .iter()
            .map(|t| HeldRun {
                run: t.run_key,
                params: &t.params,
                plan: &t.rollout_plan,
            })
            .collect();
        let exports = be
            .held_export(&runs)
            .unwrap_or_else(|e| panic!("{}: weight export failed: {e}", be.name()));
        let Some(exports) = exports else {
            return false;
        };
        for (t, e) in trainers.iter_mut().zip(exports) {
            t.keep_export(Exported::Held(e));
        }
        true
    }

    /// The newest export (the current weights: what the contract check and evaluation see) and
    /// the one this step's rollout samples from (`policy_lag` steps older, or the oldest kept).
    fn newest_and_sampled(&self) -> (&Exported, &Exported) {
        let newest = self.exported.back().expect("exported before use");
        let oldest = self.exported.front().expect("exported before use");
        (newest, oldest)
    }

    /// The last step's rollout: its tokens and the sampling policy's logprobs.
    pub fn last_rollout(&self) -> Option<&Rollout> {
        self.last_rollout.as_ref()
    }

    /// This step's training problems, in order: a function of the run seed and the step only, so
    /// every configuration run under one seed trains on the same prompts.
    pub fn train_problems(&self) -> Vec<super::task::Problem> {
        self.task.sample(
            Split::Train,
            self.config.prompts_per_step,
            mix(self.seed, self.step, 1),
        )
    }

    /// Seed of this step's sampling stream: the same for every configuration of one seed.
    pub fn sampling_seed(&self) -> u64 {
        mix(self.seed, self.step, 2)
    }

    /// Greedy exact-match accuracy on the held-out split, through the given (rollout) model.
    pub fn evaluate(&self, be: &dyn Backend, prep: &PreparedModel) -> f64 {
        evaluate(
            be,
            prep,
            self.task,
            self.config.eval_prompts,
            self.config.max_response_tokens,
            self.seed,
        )
    }

    /// Train every member on its rollout. The first forward (policy and BF16 reference, side by
    /// side), each later minibatch's fresh forward and each minibatch's backward are one batched
    /// call over the members still in their minibatch loop; losses, norms and updates are each
    /// member's own. Returns whether each member's loss went non-finite.
    fn train_batch(
        trainers: &mut [&mut Trainer],
        be: &dyn Backend,
        scored: &[Scored],
        recs: &mut [StepRecord],
    ) -> Vec<bool> {
        let v = trainers[0].params.config.vocab;
        let everyone: Vec<usize> = (0..scored.len()).collect();
        // Old policy logprobs (and the first minibatch's forward, reused below), and the BF16
        // reference's logits for the KL metric: two independent forwards, run side by side so
        // each fills the other's serial stretches (same bits as one after the other). The
        // reference needs no cache, so it is the backend's cheaper `forward_logits`.
        // Held state is prepared on the device; otherwise each member's own preparation.
        let items: Vec<ForwardItem> = if trainers[0].held == Some(true) {
            Vec::new()
        } else {
            scored
                .iter()
                .map(|sc| {
                    let prep = sc.prep.as_ref().expect("host state: prepared on the host");
                    sc.rows.item(prep)
                })
                .collect()
        };
        let t_fwd = Instant::now();
        let (first, ref_logits) = {
            let refs: Vec<ForwardItem> = trainers
                .iter()
                .zip(scored)
                .map(|(t, sc)| sc.rows.item(&t.reference))
                .collect();
            rayon::join(
                || policy_pass(be, trainers, scored, &everyone, &items, Counts::Keep, true),
                || {
                    be.forward_logits_batch(&refs)
                        .unwrap_or_else(|e| panic!("{}: reference forward failed: {e}", be.name()))
                },
            )
        };
        set_each(
            recs,
            "perf/train_forward_time",
            t_fwd.elapsed().as_secs_f64(),
        );
        let mut first = first;
        let logits0 = unpack_logits(&first, &everyone, scored, v);
        let quant0: Vec<Vec<(String, QuantStats)>> =
            (0..scored.len()).map(|m| first.quant_stats(m)).collect();
        let mut tallies: Vec<Tally> = (
            trainers.par_iter_mut(),
            scored,
            &logits0,
            ref_logits,
            quant0,
            recs.par_iter_mut(),
        )
            .into_par_iter()
            .map(|(t, sc, l0, r, q, rec)| t.first_forward(sc, l0, &r, q, rec))
            .collect();

        // Minibatches of whole groups; the first reuses the forward above.
        let round = Round {
            k: 0,
            batch: &mut first,
            members: &everyone,
            logits: logits0,
        };
        Trainer::minibatch(trainers, round, scored, &mut tallies, recs);
        drop(first);
        for k in 1.. {
            let members: Vec<usize> = everyone
                .iter()
                .copied()
                .filter(|&m| tallies[m].in_round(k))
                .collect();
            if members.is_empty() {
                break;
            }
            // Held state is prepared on the device; otherwise each member's weights here.
            let fresh: Vec<PreparedModel> = if trainers[0].held == Some(true) {
                Vec::new()
            } else {
                members
                    .par_iter()
                    .map(|&m| {
                        PreparedModel::new(&trainers[m].params, &trainers[m].plan)
                            .expect("plan checked at construction")
                    })
                    .collect()
            };
            let items: Vec<ForwardItem> = members
                .iter()
                .zip(&fresh)
                .map(|(&m, prep)| scored[m].rows.item(prep))
                .collect();
            // Only the first forward's activation counts are recorded.
            let mut batch =
                policy_pass(be, trainers, scored, &members, &items, Counts::Skip, false);
            for &m in &members {
                tallies[m].forwards += 1;
            }
            let logits = unpack_logits(&batch, &members, scored, v);
            let round = Round {
                k,
                batch: &mut batch,
                logits,
                members: &members,
            };
            Trainer::minibatch(trainers, round, scored, &mut tallies, recs);
        }
        (
            trainers.par_iter_mut(),
            scored,
            tallies,
            recs.par_iter_mut(),
        )
            .into_par_iter()
            .map(|(t, sc, y, rec)| t.finish_train(sc, y, rec))
            .collect()
    }

    /// What this member's first forward measures (train/rollout mismatch, entropy, KL to the
    /// BF16 reference, activation quantization counts), and its tally for the minibatches.
    fn first_forward(
        &mut self,
        sc: &Scored,
        logits0: &[f32],
        ref_logits: &[f32],
        quant0: Vec<(String, QuantStats)>,
        rec: &mut StepRecord,
    ) -> Tally {
        let (ro, mask, n_tok) = (&sc.ro, &sc.rows.mask, sc.rows.n_tok);
        let (b, t_in, v) = (ro.b, ro.t - 1, self.params.config.vocab);
        let lp0 = token_logprobs(logits0, ro, v);

        // Train/rollout mismatch on the rollout's own samples: r = logp_train - logp_rollout (the
        // sampling policy's logprobs: under `policy_lag`, those of the older export).
        let (mut abs_diff, mut k1, mut k2, mut k3) = (0.0, 0.0, 0.0, 0.0);
        for r in (0..b * t_in).filter(|r| mask[*r]) {
            let d = (lp0[r] - ro.logprobs[(r / t_in) * ro.t + r % t_in + 1]) as f64;
            abs_diff += d.abs();
            k1 += -d;
            k2 += d * d / 2.0;
            k3 += d.exp() - 1.0 - d;
        }
        rec.set("train/train_rollout_logprob_abs_diff", abs_diff / n_tok);
        rec.set("train/train_rollout_kl_k1", k1 / n_tok);
        rec.set("train/train_rollout_kl_k2", k2 / n_tok);
        rec.set("train/train_rollout_kl", k3 / n_tok);
        rec.set("train/entropy", entropy(logits0, mask, v) / n_tok);

        // KL to the BF16 reference (k3 with r = logp_ref - logp_train, samples ~ policy).
        let lp_ref = token_logprobs(&sc.rows.layout.unpack(ref_logits, v), ro, v);
        let kl_ref = (0..b * t_in)
            .filter(|r| mask[*r])
            .map(|r| {
                let d = (lp_ref[r] - lp0[r]) as f64;
                d.exp() - 1.0 - d
            })
            .sum::<f64>()
            / n_tok;
        rec.set("train/kl_loss", kl_ref);
        let base = *self.kl_ref_step0.get_or_insert(kl_ref);
        rec.set("train/kl_loss_minus_step0", kl_ref - base);

        // Quantization counts of this forward, per site and layer.
        let mut quant: BTreeMap<(String, i64), QuantStats> = BTreeMap::new();
        for (name, st) in quant0 {
            let (site, layer) = site_of(&name);
            let e = quant.entry((site, layer)).or_default();
            *e = e.merge(st);
        }
        let groups = b / self.config.samples_per_prompt;
        Tally {
            lp0,
            lp_ref,
            quant,
            minibatches: self.config.minibatches.clamp(1, groups.max(1)),
            // The reference and the first policy forward.
            forwards: 2,
            ..Default::default()
        }
    }

    /// One minibatch of every member in `round`: each member's loss from its logits, one
    /// backward of all of them (a member whose loss went non-finite is skipped), then each
    /// member's gradient norms and update.
    fn minibatch(
        trainers: &mut [&mut Trainer],
        round: Round<'_, '_>,
        scored: &[Scored],
        tallies: &mut [Tally],
        recs: &mut [StepRecord],
    ) {
        let k = round.k;
        let mut logits: Vec<Option<Vec<f32>>> = vec![None; scored.len()];
        for (&m, l) in round.members.iter().zip(round.logits) {
            logits[m] = Some(l);
        }
        let dlogits: Vec<Option<Vec<f32>>> = (
            trainers.par_iter(),
            scored,
            logits,
            tallies.par_iter_mut(),
            recs.par_iter_mut(),
        )
            .into_par_iter()
            .map(|(t, sc, l, y, rec)| l.and_then(|l| t.minibatch_loss(k, sc, &l, y, rec)))
            .collect();
        let inputs: Vec<Option<&[f32]>> = round
            .members
            .iter()
            .map(|&m| dlogits[m].as_deref())
            .collect();
        let t_bwd = Instant::now();
        let grads: Vec<Option<Grads>> = match &mut *round.batch {
            Pass::Host(b) => b
                .backward(&inputs)
                .into_iter()
                .map(|g| g.map(Grads::Host))
                .collect(),
            Pass::Held(b) => b
                .backward(&inputs)
                .into_iter()
                .map(|g| g.map(Grads::Held))
                .collect(),
        };
        let backward_time = t_bwd.elapsed().as_secs_f64();
        let mut by_member: Vec<Option<Grads>> = (0..scored.len()).map(|_| None).collect();
        for (&m, g) in round.members.iter().zip(grads) {
            by_member[m] = g;
        }
        // Each member's norms and clipping; the host's update, or the device's steps.
        let steps: Vec<Option<Vec<AdamStep>>> = (
            trainers.par_iter_mut(),
            by_member,
            tallies.par_iter_mut(),
            recs.par_iter_mut(),
        )
            .into_par_iter()
            .map(|(t, g, y, rec)| {
                let g = g?;
                y.backward_time += backward_time;
                y.backwards += 1;
                t.apply_gradients(&g, y, rec)
            })
            .collect();
        let Pass::Held(b) = &mut *round.batch else {
            return;
        };
        let t_opt = Instant::now();
        let in_batch: Vec<Option<Vec<AdamStep>>> =
            round.members.iter().map(|&m| steps[m].clone()).collect();
        let sums = b.update(&in_batch);
        let optimizer_time = t_opt.elapsed().as_secs_f64();
        for (&m, sum) in round.members.iter().zip(sums) {
            if let Some((u, w)) = sum {
                let y = &mut tallies[m];
                y.upd_sq += u;
                y.w_sq = w;
                y.optimizer_time += optimizer_time;
                trainers[m].params_on_device = true;
            }
        }
    }

    /// Minibatch `k`'s PPO-clipped loss of this member from its forward's `logits`; the dL/dlogits
    /// its backward takes (in its layout's rows), or `None` when the loss is not finite: the
    /// member then takes no more minibatches this step, and its run stops.
    fn minibatch_loss(
        &self,
        k: usize,
        sc: &Scored,
        logits: &[f32],
        y: &mut Tally,
        rec: &mut StepRecord,
    ) -> Option<Vec<f32>> {
        let c = &self.config;
        let (ro, mask, n_tok) = (&sc.ro, &sc.rows.mask, sc.rows.n_tok);
        let (b, t_in, v) = (ro.b, ro.t - 1, self.params.config.vocab);
        let groups = b / c.samples_per_prompt;
        let seqs: Vec<usize> = (0..b)
            .filter(|s| (s / c.samples_per_prompt) * y.minibatches / groups.max(1) == k)
            .collect();
        let (lp0, lp_ref) = (&y.lp0, &y.lp_ref);
        let lp = token_logprobs(logits, ro, v);
        // dL/dlogp per token, then through log-softmax.
        let mut dlogp = vec![0.0f32; b * t_in * v];
        let mut loss = 0.0f64;
        for &s in &seqs {
            for p in 0..t_in {
                let r = s * t_in + p;
                if !mask[r] {
                    continue;
                }
                let a = sc.adv[s] as f64;
                let ratio = ((lp[r] - lp0[r]) as f64).exp();
                let w = match c.tis_cap {
                    Some(cap) => {
                        let iw = ((lp0[r] - ro.logprobs[s * ro.t + p + 1]) as f64).exp();
                        y.tis_sum += iw.min(cap as f64);
                        y.tis_clip += f64::from(u8::from(iw > cap as f64));
                        iw.min(cap as f64)
                    }
                    None => 1.0,
                };
                let clipped = ratio.clamp(1.0 - c.clip_low as f64, 1.0 + c.clip_high as f64);
                let unclipped_active = ratio * a <= clipped * a;
                y.clip_n += f64::from(u8::from(!unclipped_active));
                y.ppo_kl += ((lp0[r] - lp[r]) as f64).max(f64::MIN);
                loss += -w * (ratio * a).min(clipped * a);
                let mut g = if unclipped_active {
                    -w * a * ratio
                } else {
                    0.0
                };
                if c.kl_coef > 0.0 {
                    let d = (lp_ref[r] - lp[r]) as f64;
                    loss += c.kl_coef as f64 * (d.exp() - 1.0 - d);
                    g += c.kl_coef as f64 * (1.0 - d.exp());
                }
                let target = ro.tokens[s * ro.t + p + 1] as usize;
                dlogp[r * v + target] = (g / n_tok) as f32;
            }
        }
        y.loss_sum += loss / n_tok;
        if !loss.is_finite() {
            rec.events.push(Event {
                step: self.step,
                kind: "non_finite".into(),
                site: "train/loss".into(),
                layer: -1,
                value: loss,
                detail: "policy loss is not finite; update skipped and run stopped".into(),
            });
            y.diverged = true;
            return None;
        }
        let logp_full = log_softmax(logits, b * t_in, v);
        let mut dlogits = vec![0.0f32; b * t_in * v];
        super::ops::log_softmax_backward(&mut dlogits, &dlogp, &logp_full, b * t_in, v);
        Some(sc.rows.layout.fold(&dlogits, v))
    }

    /// This member's gradient norms per site and layer and overall (before clipping) and, when
    /// they are finite, its clipped AdamW update: done here for host gradients, returned as
    /// each tensor's step for gradients the device holds (`None`: no update).
    fn apply_gradients(
        &mut self,
        grads: &Grads,
        y: &mut Tally,
        rec: &mut StepRecord,
    ) -> Option<Vec<AdamStep>> {
        let t_opt = Instant::now();
        let mut sq_total = 0.0f64;
        let mut finite = true;
        // Each tensor's sum in element order (one task per tensor), combined in tensor order:
        // the same bits whatever the thread count (and on a device: `optim::sum_squares`').
        let names: Vec<String> = self
            .params
            .config
            .named_shapes()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        let sums: Vec<f64> = match grads {
            Grads::Host(g) => g
                .named_tensors()
                .par_iter()
                .map(|(_, g)| super::optim::sum_squares(g))
                .collect(),
            Grads::Held(sums) => sums.clone(),
        };
        for (name, sq) in names.iter().zip(sums) {
            finite &= sq.is_finite();
            sq_total += sq;
            *y.grad_norms.entry(site_of(name)).or_default() += sq;
        }
        let norm = sq_total.sqrt();
        y.global_norm += norm / y.minibatches as f64;
        if !finite {
            rec.events.push(Event {
                step: self.step,
                kind: "non_finite".into(),
                site: "train/grad_norm".into(),
                layer: -1,
                value: norm,
                detail: "gradient has non-finite values; update skipped".into(),
            });
            return None;
        }
        let clip = self.config.grad_clip as f64;
        let scale = if norm > clip {
            clip / (norm + 1e-6)
        } else {
            1.0
        };
        match grads {
            Grads::Host(g) => {
                let (u, w) = self.adam_update(g, scale as f32);
                y.upd_sq += u;
                y.w_sq = w;
                y.optimizer_time += t_opt.elapsed().as_secs_f64();
                None
            }
            Grads::Held(_) => {
                // `AdamW::update`'s constants, tensor by tensor: the device applies them.
                let step = self.adam.next_step(scale as f32);
                let decay = &self.decay;
                Some(
                    names
                        .iter()
                        .map(|n| AdamStep {
                            decay: decay.get(n).copied().unwrap_or(0.0),
                            ..step
                        })
                        .collect(),
                )
            }
        }
    }

    /// This member's train metrics from its tally, and its per-site rows and spike events;
    /// returns whether its loss went non-finite.
    fn finish_train(&mut self, sc: &Scored, y: Tally, rec: &mut StepRecord) -> bool {
        // Where the train phase goes: forward (policy and reference side by side), backward,
        // gradient norms with the optimizer.
        rec.set("perf/train_backward_time", y.backward_time);
        rec.set("perf/optimizer_time", y.optimizer_time);
        // The step's matrix arithmetic: the rollout's decoded rows and these passes (the held-out
        // evaluation's decode is left out).
        let rows = sc.rows.layout.rows();
        let (fwd_rows, bwd_rows) = (rows * y.forwards, rows * y.backwards);
        rec.set(
            "perf/gemm_flops",
            cost::gemm_flops(&self.params.config, sc.ro.decoded_rows + fwd_rows, bwd_rows),
        );
        let n_tok = sc.rows.n_tok;
        rec.set("train/loss", y.loss_sum);
        rec.set("train/pg_clipfrac", y.clip_n / n_tok);
        rec.set("train/ppo_kl", y.ppo_kl / n_tok);
        if self.config.tis_cap.is_some() {
            rec.set("train/tis", y.tis_sum / n_tok);
            rec.set("train/tis_clipfrac", y.tis_clip / n_tok);
        }
        rec.set("train/grad_norm", y.global_norm);
        rec.set(
            "train/update_weight_ratio",
            (y.upd_sq / y.w_sq.max(1e-30)).sqrt(),
        );
        let (sat, under) = y.quant.values().fold((0u64, 0u64), |(a, b), s| {
            (a + s.saturated, b + s.underflowed)
        });
        rec.set("quant/saturated", sat as f64);
        rec.set("quant/underflowed", under as f64);
        self.record_layers(rec, &y.grad_norms, &y.quant);
        y.diverged
    }

    /// Held-out accuracy of the members due for it (not diverged, on an evaluation step), one
    /// batched greedy decode of their newest exports.
    fn evaluate_due(
        trainers: &[&mut Trainer],
        be: &dyn Backend,
        diverged: &[bool],
        recs: &mut [StepRecord],
    ) {
        let due: Vec<usize> = (0..trainers.len())
            .filter(|&m| {
                let (t, every) = (&trainers[m], trainers[m].config.eval_every);
                !diverged[m] && every > 0 && t.step.is_multiple_of(every)
            })
            .collect();
        let Some(&first) = due.first() else {
            return;
        };
        let members: Vec<(Policy, u64)> = due
            .iter()
            .map(|&m| {
                (
                    trainers[m].newest_and_sampled().0.policy(),
                    trainers[m].seed,
                )
            })
            .collect();
        let (task, c) = (trainers[first].task, &trainers[first].config);
        let accuracy = evaluate_batch(be, task, c.eval_prompts, c.max_response_tokens, &members);
        for (&m, a) in due.iter().zip(accuracy) {
            recs[m].set("eval/accuracy", a);
        }
    }

    /// Per-site rows and spike events.
    fn record_layers(
        &mut self,
        rec: &mut StepRecord,
        sq: &BTreeMap<(String, i64), f64>,
        quant: &BTreeMap<(String, i64), QuantStats>,
    ) {
        for ((site, layer), s) in sq {
            let norm = s.sqrt();
            let precision = self.site_precision(site, *layer);
            let q = quant
                .get(&(site.clone(), *layer))
                .copied()
                .unwrap_or_default();
            rec.layers.push(LayerRecord {
                step: self.step,
                site: site.clone(),
                layer: *layer,
                precision,
                grad_norm: norm,
                saturated: q.saturated,
                underflowed: q.underflowed,
            });
            let h = self.history.entry((site.clone(), *layer)).or_default();
            if h.len() >= 3 {
                let mut sorted = h.clone();
                sorted.sort_by(|a, b| a.total_cmp(b));
                let median = sorted[sorted.len() / 2];
                if median > 0.0 && norm > self.config.spike_ratio * median {
                    rec.events.push(Event {
                        step: self.step,
                        kind: "grad_spike".into(),
                        site: site.clone(),
                        layer: *layer,
                        value: norm,
                        detail: format!("{:.1}x the rolling median {median:.3e}", norm / median),
                    });
                }
            }
            h.push(norm);
            if h.len() > self.config.spike_window.max(1) {
                h.remove(0);
            }
        }
    }

    fn site_precision(&self, site: &str, layer: i64) -> String {
        self.plan
            .site_plan(site, layer)
            .map_or("fp32", |p| p.precision.label())
            .to_string()
    }

    /// AdamW on every tensor; returns (Σ update², Σ weight²).
    fn adam_update(&mut self, grads: &Params, scale: f32) -> (f64, f64) {
        let decay = &self.decay;
        self.adam.update(&mut self.params, grads, scale, |name| {
            decay.get(name).copied().unwrap_or(0.0)
        })
    }
}

/// What the members of one [`Trainer::step_batch`] share, so that each of their device passes
/// has one shape: the model, the task, and the rollout's and the evaluation's sizes. Recipes,
/// seeds, contract breaks and the optimizer's and the loop's settings (learning rate,
/// minibatches, policy lag, when to evaluate) may differ from member to member.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchShape {
    pub model: ModelConfig,
    pub task: Task,
    pub prompts_per_step: usize,
    pub samples_per_prompt: usize,
    pub max_response_tokens: usize,
    pub temperature: f32,
    pub eval_prompts: usize,
}

impl BatchShape {
    pub fn new(model: &ModelConfig, task: Task, grpo: &GrpoConfig) -> BatchShape {
        BatchShape {
            model: model.clone(),
            task,
            prompts_per_step: grpo.prompts_per_step,
            samples_per_prompt: grpo.samples_per_prompt,
            max_response_tokens: grpo.max_response_tokens,
            temperature: grpo.temperature,
            eval_prompts: grpo.eval_prompts,
        }
    }
}

/// A run's exported policy, kept for the steps that sample it: prepared on the host, or on the
/// device that holds the run's state.
enum Exported {
    Host(Box<PreparedModel>),
    Held(HeldExport),
}

impl Exported {
    fn policy(&self) -> Policy<'_> {
        match self {
            Exported::Host(p) => Policy::Host(p),
            Exported::Held(e) => Policy::Held(e),
        }
    }
}

/// One member's rollout, scored, with the rows its training reads: fixed for the rest of its step.
struct Scored {
    ro: Rollout,
    /// The trainer's own quantized weights, where the host exported (its first forward runs on
    /// them unless the device holds its state).
    prep: Option<PreparedModel>,
    adv: Vec<f32>,
    rows: TrainRows,
}

/// The rows a member's forwards run over this step, the same for all its minibatches.
struct TrainRows {
    layout: Layout,
    /// The rollout's input tokens in `layout`'s rows.
    rows: Vec<u32>,
    /// The rollout's routing in `layout`'s rows, under routing replay.
    replay: Option<Routing>,
    /// Response positions of the `[B, T-1]` inputs: the tokens the loss and metrics count.
    mask: Vec<bool>,
    /// How many there are (at least 1).
    n_tok: f64,
}

impl TrainRows {
    fn new(ro: &Rollout, c: &GrpoConfig) -> TrainRows {
        let (b, t_in) = (ro.b, ro.t - 1);
        let inputs = ro.tokens_inputs();
        // The samples of a group share their prompt: its rows are computed once; a sample keeps no
        // row past the one that predicts its last token (see `layout`).
        let used: Vec<usize> = (0..b)
            .map(|s| {
                (ro.prompt_len + ro.response_len[s])
                    .saturating_sub(1)
                    .min(t_in)
            })
            .collect();
        let layout = Layout::shared_prefix(
            &inputs,
            b,
            t_in,
            c.samples_per_prompt,
            ro.prompt_len,
            Some(&used),
        );
        let rows = layout.pack(&inputs, 1);
        let replay = (c.routing_replay && ro.routing.n_tokens == b * t_in)
            .then(|| pack_routing(&layout, &ro.routing));
        let mask: Vec<bool> = (0..b * t_in)
            .map(|r| ro.is_response(r / t_in, r % t_in + 1))
            .collect();
        let n_tok = mask.iter().filter(|m| **m).count().max(1) as f64;
        TrainRows {
            layout,
            rows,
            replay,
            mask,
            n_tok,
        }
    }

    /// A forward of `prep` over these rows.
    fn item<'a>(&'a self, prep: &'a PreparedModel) -> ForwardItem<'a> {
        ForwardItem {
            prep,
            tokens: &self.rows,
            layout: &self.layout,
            replay: self.replay.as_ref(),
        }
    }
}

/// A member's sums over its minibatches, and what its first forward measured.
#[derive(Default)]
struct Tally {
    /// Old policy logprobs (the first forward's) and the BF16 reference's, `[B·(T-1)]`.
    lp0: Vec<f32>,
    lp_ref: Vec<f32>,
    quant: BTreeMap<(String, i64), QuantStats>,
    /// Minibatches this step (whole groups each).
    minibatches: usize,
    /// The loss went non-finite: no more minibatches this step.
    diverged: bool,
    clip_n: f64,
    ppo_kl: f64,
    tis_sum: f64,
    tis_clip: f64,
    loss_sum: f64,
    grad_norms: BTreeMap<(String, i64), f64>,
    global_norm: f64,
    upd_sq: f64,
    w_sq: f64,
    backward_time: f64,
    optimizer_time: f64,
    /// Forwards over the member's rows (the reference's included) and backwards, for the step's
    /// GEMM work.
    forwards: usize,
    backwards: usize,
}

impl Tally {
    /// Whether the member takes minibatch `k`.
    fn in_round(&self, k: usize) -> bool {
        !self.diverged && k < self.minibatches
    }
}

/// One minibatch's batched forward: member `members[j]` is the batch's member `j`, its logits
/// unpacked to sequence-major `[B·(T-1), V]` in `logits[j]`.
struct Round<'b, 'a> {
    k: usize,
    batch: &'b mut Pass<'a>,
    members: &'b [usize],
    logits: Vec<Vec<f32>>,
}

/// The policy forward of several members, kept for their backward: over prepared models the
/// host made (their gradients come back), or over the state the device holds for them (their
/// gradients stay there, with the update).
enum Pass<'a> {
    Host(Box<dyn TrainBatch + 'a>),
    Held(Box<dyn HeldBatch + 'a>),
}

impl Pass<'_> {
    fn logits(&self, j: usize) -> &[f32] {
        match self {
            Pass::Host(b) => b.logits(j),
            Pass::Held(b) => b.logits(j),
        }
    }

    fn quant_stats(&self, j: usize) -> Vec<(String, QuantStats)> {
        match self {
            Pass::Host(b) => b.quant_stats(j),
            Pass::Held(b) => b.quant_stats(j),
        }
    }
}

/// A member's gradients from a backward: on the host, or their squared norms per tensor (in
/// `Params::named_tensors` order) with the gradients left on the device.
enum Grads {
    Host(Params),
    Held(Vec<f64>),
}

/// The trainer's policy forward of members `members` (`items`: their forwards over the host's
/// prepared models, unread where the device holds their state). `as_exported`: no update since
/// this step's export, so a device may read the export instead of preparing the weights again.
fn policy_pass<'a>(
    be: &'a dyn Backend,
    trainers: &[&mut Trainer],
    scored: &[Scored],
    members: &[usize],
    items: &[ForwardItem<'a>],
    counts: Counts,
    as_exported: bool,
) -> Pass<'a> {
    let failed = |e| -> ! { panic!("{}: training forward failed: {e}", be.name()) };
    if trainers[members[0]].held != Some(true) {
        return Pass::Host(
            be.train_forward_batch(items, counts)
                .unwrap_or_else(|e| failed(e)),
        );
    }
    let held: Vec<HeldItem> = members
        .iter()
        .map(|&m| {
            let (t, rows) = (&trainers[m], &scored[m].rows);
            HeldItem {
                run: t.run_key,
                params: &t.params,
                plan: &t.plan,
                tokens: &rows.rows,
                layout: &rows.layout,
                replay: rows.replay.as_ref(),
                export: match t.newest_and_sampled().0 {
                    Exported::Held(e) if as_exported => Some(e),
                    _ => None,
                },
            }
        })
        .collect();
    Pass::Held(
        be.held_forward_batch(&held, counts)
            .unwrap_or_else(|e| failed(e)),
    )
}

/// The logits of `batch`'s members (member `members[j]` at index `j`), sequence-major.
fn unpack_logits(
    batch: &Pass<'_>,
    members: &[usize],
    scored: &[Scored],
    v: usize,
) -> Vec<Vec<f32>> {
    members
        .iter()
        .enumerate()
        .map(|(j, &m)| scored[m].rows.layout.unpack(batch.logits(j), v))
        .collect()
}

fn set_each(recs: &mut [StepRecord], key: &str, v: f64) {
    for r in recs {
        r.set(key, v);
    }
}

/// The rollout's routing record (sequence-major) in the rows of `layout`.
fn pack_routing(layout: &Layout, routing: &Routing) -> Routing {
    Routing {
        top_k: routing.top_k,
        n_tokens: layout.rows(),
        layers: routing
            .layers
            .iter()
            .map(|ids| layout.pack(ids, routing.top_k))
            .collect(),
    }
}

/// Each member's prompts, from its problems.
fn prompts_of(problems: &[Vec<Problem>]) -> Vec<Vec<Vec<u32>>> {
    problems
        .iter()
        .map(|ps| ps.iter().map(|p| p.prompt.clone()).collect())
        .collect()
}

/// Held-out greedy accuracy of `prep` on `count` evaluation prompts.
pub fn evaluate(
    be: &dyn Backend,
    prep: &PreparedModel,
    task: Task,
    count: usize,
    max_new: usize,
    seed: u64,
) -> f64 {
    evaluate_batch(be, task, count, max_new, &[(prep.into(), seed)])[0]
}

/// [`evaluate`] of several models, each on the evaluation prompts of its own seed, decoded
/// together (one batched greedy decode).
pub fn evaluate_batch(
    be: &dyn Backend,
    task: Task,
    count: usize,
    max_new: usize,
    members: &[(Policy<'_>, u64)],
) -> Vec<f64> {
    let problems: Vec<Vec<Problem>> = members
        .iter()
        .map(|(_, seed)| task.sample(Split::Eval, count, *seed))
        .collect();
    let prompts = prompts_of(&problems);
    let items: Vec<RolloutItem> = members
        .iter()
        .zip(&prompts)
        .map(|((policy, _), prompts)| RolloutItem {
            policy: *policy,
            prompts,
            seed: 0,
        })
        .collect();
    rollout::generate_batch(be, &items, 1, max_new, 0.0)
        .iter()
        .zip(&problems)
        .map(|(ro, problems)| {
            mean((0..ro.b).map(|s| task.reward(&problems[s], ro.response(s)) as f64))
        })
        .collect()
}

/// Validate a training setup without running it (model, lengths, recipe, every site's blocks).
pub fn check_setup(
    model: &ModelConfig,
    task: &Task,
    grpo: &GrpoConfig,
    recipe: &Recipe,
    contract_break: ContractBreak,
) -> Result<(), TrainerError> {
    model.validate()?;
    if task.prompt_len() + grpo.max_response_tokens > model.max_seq {
        return Err(TrainerError::TooLong {
            task: task.to_string(),
            prompt: task.prompt_len(),
            resp: grpo.max_response_tokens,
            max_seq: model.max_seq,
        });
    }
    let plan = recipe.resolve(model.n_layers)?;
    check_sites(model, &plan)?;
    check_sites(model, &rollout_plan(&plan, contract_break))
}

/// Every site's weights must block under the plan.
fn check_sites(cfg: &ModelConfig, plan: &ModelPlan) -> Result<(), TrainerError> {
    let (d, e, f, fs, v) = (
        cfg.d_model,
        cfg.n_experts,
        cfg.d_ff,
        cfg.d_ff_shared,
        cfg.vocab,
    );
    let mut checks: Vec<(String, SitePlan, usize, usize)> = Vec::new();
    for (i, l) in plan.layers.iter().enumerate() {
        use crate::recipe::Site::*;
        for (s, out, inp) in [
            (LinearQkv, 3 * d, d),
            (LinearProj, d, d),
            (Router, e, d),
            (ExpertsFc1, 2 * f, d),
            (ExpertsFc2, d, f),
            (SharedFc1, 2 * fs, d),
            (SharedFc2, d, fs),
        ] {
            checks.push((s.name(i), *l.get(s), out, inp));
        }
    }
    checks.push((crate::recipe::OUTPUT_LAYER.into(), plan.output_layer, v, d));
    for (site, p, out, inp) in checks {
        super::linear::check_site(&p, out, inp).map_err(|err| TrainerError::Site { site, err })?;
    }
    Ok(())
}

fn weight_decay_table(params: &Params, plan: &ModelPlan, recipe: &Recipe) -> BTreeMap<String, f32> {
    let mut out = BTreeMap::new();
    for (name, _) in params.named_tensors() {
        let (site, layer) = site_of(&name);
        // Embeddings and norm gains are not sites: no decay.
        let p = plan.site_plan(&site, layer);
        out.insert(name, p.map_or(0.0, |p| recipe.weight_decay_for(&p)));
    }
    out
}

/// `(r - mean) / (std + 1e-6)` within each group of `n` (all-equal groups get 0).
pub fn group_advantages(rewards: &[f32], n: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; rewards.len()];
    for (g, chunk) in rewards.chunks(n).enumerate() {
        let m = chunk.iter().sum::<f32>() / chunk.len() as f32;
        let var = chunk.iter().map(|r| (r - m) * (r - m)).sum::<f32>() / chunk.len() as f32;
        let sd = var.sqrt();
        for (i, r) in chunk.iter().enumerate() {
            out[g * n + i] = if sd > 0.0 { (r - m) / (sd + 1e-6) } else { 0.0 };
        }
    }
    out
}

fn mean(it: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = it.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 { 0.0 } else { s / n as f64 }
}

fn log_softmax(logits: &[f32], n: usize, v: usize) -> Vec<f32> {
    let mut lp = vec![0.0f32; n * v];
    super::ops::log_softmax_forward(&mut lp, logits, n, v);
    lp
}

/// logp of each next token, `[B·(T-1)]` (row r predicts token r%(T-1)+1 of sequence r/(T-1)).
fn token_logprobs(logits: &[f32], ro: &Rollout, v: usize) -> Vec<f32> {
    let t_in = ro.t - 1;
    let lp = log_softmax(logits, ro.b * t_in, v);
    (0..ro.b * t_in)
        .map(|r| lp[r * v + ro.tokens[(r / t_in) * ro.t + r % t_in + 1] as usize])
        .collect()
}

/// Σ over masked rows of the softmax entropy.
fn entropy(logits: &[f32], mask: &[bool], v: usize) -> f64 {
    let n = mask.len();
    let lp = log_softmax(logits, n, v);
    (0..n)
        .filter(|r| mask[*r])
        .map(|r| {
            -lp[r * v..(r + 1) * v]
                .iter()
                .map(|l| (l.exp() * l) as f64)
                .sum::<f64>()
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advantages_are_normalised_per_group() {
        let a = group_advantages(&[1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0], 4);
        assert!((a[0] - 3f32.sqrt()).abs() < 1e-4, "{a:?}");
        assert!((a[1] + 1.0 / 3f32.sqrt()).abs() < 1e-4);
        assert_eq!(&a[4..], &[0.0; 4]); // a group where everyone is right carries no signal
    }

    #[test]
    fn configurations_of_one_seed_share_prompts_and_sampling_stream() {
        let cfg = ModelConfig::tiny();
        let init = Params::init(&cfg, 0).unwrap();
        let task = Task::Add(2);
        let grpo = GrpoConfig {
            max_response_tokens: task.answer_len() + 1,
            ..Default::default()
        };
        let make = |recipe: &str, seed: u64| {
            let r = crate::recipe::presets::preset(recipe).unwrap();
            Trainer::new(
                init.clone(),
                task,
                r,
                grpo.clone(),
                seed,
                ContractBreak::None,
            )
            .unwrap()
        };
        let (mut bf16, mut nvfp4) = (make("bf16", 7), make("nvfp4-dq", 7));
        assert_ne!(bf16.plan, nvfp4.plan, "two different precisions");
        for step in 0..3 {
            bf16.step = step;
            nvfp4.step = step;
            assert_eq!(bf16.train_problems(), nvfp4.train_problems(), "step {step}");
            assert_eq!(bf16.sampling_seed(), nvfp4.sampling_seed());
        }
        // The seed is what they share: another seed gives other prompts and another stream.
        let other = make("bf16", 8);
        let first = make("bf16", 7);
        assert_ne!(first.train_problems(), other.train_problems());
        assert_ne!(first.sampling_seed(), other.sampling_seed());
    }

    /// The rollout's tokens and the bits of its logprobs.
    fn sampled(t: &Trainer) -> (Vec<u32>, Vec<u32>) {
        let ro = t.last_rollout().expect("a step ran");
        let bits = ro.logprobs.iter().map(|x| x.to_bits()).collect();
        (ro.tokens.clone(), bits)
    }

    #[test]
    fn a_lagged_rollout_samples_from_the_export_k_steps_old() {
        let be = crate::engine::backend::CpuBackend;
        let cfg = ModelConfig::tiny();
        let init = Params::init(&cfg, 0).unwrap();
        let task = Task::Add(2);
        let make = |lag: usize| {
            let grpo = GrpoConfig {
                max_response_tokens: task.answer_len() + 1,
                eval_every: 0,
                policy_lag: lag,
                ..Default::default()
            };
            let r = crate::recipe::presets::preset("nvfp4-dq").unwrap();
            Trainer::new(init.clone(), task, r, grpo, 7, ContractBreak::None).unwrap()
        };
        let (mut sync, mut lagged) = (make(0), make(1));
        // Step 0: no older export exists, so both sample from the initial weights.
        sync.step(&be);
        lagged.step(&be);
        assert_eq!(sampled(&sync), sampled(&lagged));
        // Move both policies the same way (whatever step 0's update did), so the weights exported
        // at step 1 surely differ from the initial ones.
        for t in [&mut sync, &mut lagged] {
            for (_, w) in t.params.named_tensors_mut() {
                w.iter_mut().for_each(|x| *x *= 1.5);
            }
        }
        sync.step(&be);
        lagged.step(&be);
        // The lagged step 1 is the initial weights on step 1's prompts and sampling stream.
        let mut stale = make(0);
        stale.step = 1;
        stale.step(&be);
        assert_eq!(sampled(&lagged), sampled(&stale));
        assert_ne!(
            sampled(&lagged).1,
            sampled(&sync).1,
            "lag 0 samples the new weights"
        );
        // The contract check still compares the newest export with the trainer's weights.
        assert_eq!(lagged.exported.len(), 2);
    }

    #[test]
    fn contract_breaks_change_only_the_rollout_plan_of_quantized_sites() {
        let r = crate::recipe::presets::preset("nvfp4-dq").unwrap();
        let plan = r.resolve(6).unwrap();
        let rp = rollout_plan(&plan, ContractBreak::PerTensorNvfp4);
        assert_eq!(rp.layers[0].experts_fc1.act_scale, SecondScale::PerTensor);
        assert_eq!(rp.layers[0].linear_qkv, plan.layers[0].linear_qkv);
        assert_eq!(rollout_plan(&plan, ContractBreak::None), plan);
    }

    /// A tiny model trained a little on the task, so rewards (and advantages) are not all zero.
    fn warm() -> &'static Params {
        static INIT: std::sync::OnceLock<Params> = std::sync::OnceLock::new();
        INIT.get_or_init(|| {
            let ws = crate::engine::warmstart::WarmStartConfig {
                max_steps: 4000,
                target_accuracy: 0.15,
                eval_prompts: 16,
                ..Default::default()
            };
            let be = crate::engine::backend::CpuBackend;
            crate::engine::warmstart::warm_start(
                &be,
                &ModelConfig::tiny(),
                Task::Add(2),
                &ws,
                None,
                |_| {},
            )
            .unwrap()
            .0
        })
    }

    /// Three trainers of one batch shape whose recipes, seeds and loop settings differ: more
    /// minibatches, a KL term and a lagged rollout, evaluation on other steps.
    fn three() -> Vec<Trainer> {
        let task = Task::Add(2);
        let base = GrpoConfig {
            prompts_per_step: 4,
            samples_per_prompt: 4,
            max_response_tokens: task.answer_len() + 2,
            eval_every: 2,
            eval_prompts: 8,
            ..Default::default()
        };
        let members = [
            (
                "bf16",
                11,
                GrpoConfig {
                    minibatches: 2,
                    ..base.clone()
                },
            ),
            (
                "mxfp8",
                12,
                GrpoConfig {
                    kl_coef: 0.1,
                    policy_lag: 1,
                    ..base.clone()
                },
            ),
            (
                "nvfp4-dq",
                13,
                GrpoConfig {
                    minibatches: 4,
                    tis_cap: None,
                    eval_every: 3,
                    ..base
                },
            ),
        ];
        members
            .into_iter()
            .map(|(recipe, seed, grpo)| {
                let r = crate::recipe::presets::preset(recipe).unwrap();
                Trainer::new(warm().clone(), task, r, grpo, seed, ContractBreak::None).unwrap()
            })
            .collect()
    }

    /// All a record holds but its wall-clock times, values as bits (a NaN equals itself).
    type Content = (usize, BTreeMap<String, u64>, Vec<String>, Vec<String>);

    fn content(r: &StepRecord) -> Content {
        let layers = r.layers.iter().map(|l| {
            let bits = l.grad_norm.to_bits();
            format!(
                "{} {} {} {bits} {} {}",
                l.site, l.layer, l.precision, l.saturated, l.underflowed
            )
        });
        let events = r.events.iter().map(|e| {
            let bits = e.value.to_bits();
            format!(
                "{} {} {} {} {bits} {}",
                e.step, e.kind, e.site, e.layer, e.detail
            )
        });
        (
            r.step,
            r.deterministic_scalars(),
            layers.collect(),
            events.collect(),
        )
    }

    /// Every weight's bits.
    fn weights(t: &Trainer) -> Vec<u32> {
        t.params
            .named_tensors()
            .iter()
            .flat_map(|(_, w)| w.iter().map(|x| x.to_bits()))
            .collect()
    }

    /// Step each of `trainers` alone `steps` times.
    fn alone(trainers: &mut [Trainer], steps: usize) -> Vec<Vec<Content>> {
        let be = crate::engine::backend::CpuBackend;
        trainers
            .iter_mut()
            .map(|t| (0..steps).map(|_| content(&t.step(&be))).collect())
            .collect()
    }

    /// Step the `members` of `trainers` together once; their records by member.
    fn together(trainers: &mut [Trainer], members: &[usize]) -> Vec<Content> {
        let mut batch: Vec<&mut Trainer> = trainers
            .iter_mut()
            .enumerate()
            .filter(|(m, _)| members.contains(m))
            .map(|(_, t)| t)
            .collect();
        let be = crate::engine::backend::CpuBackend;
        Trainer::step_batch(&mut batch, &be)
            .iter()
            .map(content)
            .collect()
    }

    #[test]
    fn runs_stepped_together_record_what_each_records_alone() {
        let steps = 4;
        let mut solo = three();
        let want = alone(&mut solo, steps);
        let mut batch = three();
        let mut got = vec![Vec::new(); 3];
        for _ in 0..steps {
            for (m, rec) in together(&mut batch, &[0, 1, 2]).into_iter().enumerate() {
                got[m].push(rec);
            }
        }
        for m in 0..3 {
            assert_eq!(got[m], want[m], "member {m}");
            assert_eq!(
                weights(&batch[m]),
                weights(&solo[m]),
                "member {m}'s weights"
            );
        }
        // The members' records differ, so a member given another's work would show; and the
        // steps measured what they are about (rewards, updates, evaluations on their own steps).
        let scalar = |m: usize, step: usize, key: &str| want[m][step].1.get(key).copied();
        assert_ne!(want[0], want[1]);
        assert_ne!(want[1], want[2]);
        // (Without a KL term, a gradient comes from non-zero advantages only.)
        let learned = |m: usize| (0..steps).any(|s| scalar(m, s, "train/grad_norm") != Some(0));
        assert!(learned(0) && learned(2), "advantages were all zero");
        assert!(scalar(0, 2, "eval/accuracy").is_some() && scalar(0, 3, "eval/accuracy").is_none());
        assert!(scalar(2, 3, "eval/accuracy").is_some() && scalar(2, 2, "eval/accuracy").is_none());
        assert!((0..3).all(|m| scalar(m, 1, "train/update_weight_ratio") != Some(0)));
    }

    #[test]
    fn a_diverging_run_leaves_the_others_it_is_stepped_with_as_they_are_alone() {
        // A NaN in one member's output layer: its first loss is not finite.
        let poisoned = || {
            let mut t = three();
            for (name, w) in t[1].params.named_tensors_mut() {
                if name == "output_layer.weight" {
                    w[5] = f32::NAN;
                }
            }
            t
        };
        let steps = 3;
        let mut solo = poisoned();
        let want = alone(&mut solo[..1], steps)
            .into_iter()
            .chain(alone(&mut solo[1..2], 1))
            .chain(alone(&mut solo[2..], steps))
            .collect::<Vec<_>>();
        let diverged = |c: &Content| c.3.iter().any(|e| e.contains("non_finite train/loss"));
        assert!(diverged(&want[1][0]));
        assert!(!want[0].iter().chain(&want[2]).any(diverged));
        // Step 0 together; then the diverged run drops out (as a sweep drops it) and the
        // others go on together.
        let mut batch = poisoned();
        let first = together(&mut batch, &[0, 1, 2]);
        assert_eq!(first[1], want[1][0], "the diverged run's record");
        let mut got = [vec![first[0].clone()], vec![first[2].clone()]];
        for _ in 1..steps {
            for (i, rec) in together(&mut batch, &[0, 2]).into_iter().enumerate() {
                got[i].push(rec);
            }
        }
        assert_eq!(got[0], want[0]);
        assert_eq!(got[1], want[2]);
        assert_eq!(weights(&batch[0]), weights(&solo[0]));
        assert_eq!(weights(&batch[2]), weights(&solo[2]));
    }
}

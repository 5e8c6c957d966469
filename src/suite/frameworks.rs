//! What each RL framework logs, as mapping presets (`[command.metrics] preset = "verl"`): the
//! framework's key → lockstep's key, and the step it logs first. A suite's own `map` entries
//! extend and override a preset key by key.
//!
//! The train-vs-rollout mismatch is a different quantity in each framework. A key is mapped to
//! `train/train_rollout_logprob_abs_diff` only when it is the mean |Δ log p|, and to
//! `train/train_rollout_kl` only when it is a k3 estimate of KL(rollout ‖ train); probability-space
//! differences (verl's `training/rollout_probs_diff_*`, NeMo-RL's `token_mult_prob_error`) and
//! signed means (OpenRLHF's `vllm_kl`) keep their own names, where checks can still name them.
//!
//! Sources (each framework's repository, 2026 snapshots): Miles/slime
//! `slime/backends/megatron_utils/loss.py`, `miles/backends/training_utils/loss_hub/losses.py`;
//! verl `verl/trainer/ppo/metric_utils.py`, `verl/trainer/ppo/rollout_corr_helper.py`;
//! NeMo-RL `nemo_rl/algorithms/grpo.py`, `nemo_rl/algorithms/loss/loss_functions.py`;
//! TRL `trl/trainer/grpo_trainer.py` (and transformers' `rewrite_logs`, which prefixes `train/`
//! under TensorBoard); OpenRLHF `openrlhf/trainer/ppo_trainer.py`, `openrlhf/utils/logging_utils.py`.

use std::collections::BTreeSet;

/// One framework's preset.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Preset {
    pub name: &'static str,
    /// The step the framework logs first (stored as step 0).
    pub first_step: u64,
    /// The key the framework charts its W&B history against (`define_metric(..., step_metric=)`)
    /// when it is not W&B's own `_step`; W&B history is read by it unless `step` is set.
    pub wandb_step: Option<&'static str>,
    /// Framework key → lockstep key.
    pub map: &'static [(&'static str, &'static str)],
    /// Keys it logs that keep their own name on purpose (a different quantity than any lockstep
    /// key); `--detect` counts them as placed.
    pub own: &'static [&'static str],
}

/// Miles and slime log lockstep's own names (lockstep took them from Miles), 0-based steps: the
/// default mapping itself. `train/entropy_loss` (the entropy term of the loss) keeps its name.
const MILES: Preset = Preset {
    name: "miles",
    first_step: 0,
    wandb_step: None,
    map: &super::metrics::MILES_MAPPING,
    own: &[
        "train/entropy_loss",
        "train/ess_ratio",
        "train/tis_abs",
        "train/ois",
        "rollout/response_len/median",
        "rollout/response_len/max",
        "rollout/response_len/min",
    ],
};

/// verl: `critic/score/mean` is the raw score; steps start at 1 (validation at 0).
const VERL: Preset = Preset {
    name: "verl",
    first_step: 1,
    wandb_step: None,
    map: &[
        ("critic/score/mean", "rollout/raw_reward"),
        ("critic/rewards/mean", "rollout/rewards"),
        ("actor/grad_norm", "train/grad_norm"),
        ("actor/kl_loss", "train/kl_loss"),
        ("actor/ppo_kl", "train/ppo_kl"),
        ("actor/pg_clipfrac", "train/pg_clipfrac"),
        ("actor/entropy", "train/entropy"),
        ("response_length/mean", "rollout/response_len/mean"),
        ("rollout_corr/k3_kl", "train/train_rollout_kl"),
        ("timing_s/gen", "perf/rollout_time"),
        ("timing_s/update_actor", "perf/train_time"),
        ("timing_s/step", "perf/step_time"),
    ],
    own: &[
        "training/rollout_probs_diff_mean",
        "training/rollout_probs_diff_max",
        "training/rollout_probs_diff_std",
        "rollout_corr/kl",
        "rollout_corr/log_ppl_abs_diff",
        "rollout_corr/ppl_ratio",
        "rollout_corr/chi2_token",
    ],
};

/// NeMo-RL: everything under `train/`, 1-based steps.
const NEMO_RL: Preset = Preset {
    name: "nemo-rl",
    first_step: 1,
    wandb_step: None,
    map: &[
        ("train/reward", "rollout/raw_reward"),
        ("train/kl_penalty", "train/kl_loss"),
        ("train/grad_norm", "train/grad_norm"),
        (
            "train/mean_gen_tokens_per_sample",
            "rollout/response_len/mean",
        ),
        ("train/approx_entropy", "train/entropy"),
    ],
    own: &[
        "train/token_mult_prob_error",
        "train/gen_kl_error",
        "train/policy_kl_error",
        "train/js_divergence_error",
        "train/sampling_importance_ratio",
    ],
};

/// TRL's GRPOTrainer: 1-based steps; keys bare in its own logs, `train/`-prefixed under
/// TensorBoard and W&B (both are mapped). Under W&B, transformers' `WandbCallback`
/// (`integrations/integration_utils.py`) logs `train/global_step` with every row and charts every
/// key against it (`define_metric("*", step_metric="train/global_step")`).
const TRL: Preset = Preset {
    name: "trl",
    first_step: 1,
    wandb_step: Some("train/global_step"),
    map: &[
        ("reward", "rollout/raw_reward"),
        (
            "sampling/sampling_logp_difference/mean",
            "train/train_rollout_logprob_abs_diff",
        ),
        ("kl", "train/kl_loss"),
        ("grad_norm", "train/grad_norm"),
        ("completions/mean_length", "rollout/response_len/mean"),
        ("entropy", "train/entropy"),
        ("clip_ratio/region_mean", "train/pg_clipfrac"),
        ("step_time", "perf/step_time"),
        ("train/reward", "rollout/raw_reward"),
        (
            "train/sampling/sampling_logp_difference/mean",
            "train/train_rollout_logprob_abs_diff",
        ),
        ("train/kl", "train/kl_loss"),
        ("train/grad_norm", "train/grad_norm"),
        ("train/completions/mean_length", "rollout/response_len/mean"),
        ("train/entropy", "train/entropy"),
        ("train/clip_ratio/region_mean", "train/pg_clipfrac"),
        ("train/step_time", "perf/step_time"),
    ],
    own: &[
        "reward_std",
        "sampling/sampling_logp_difference/max",
        "sampling/importance_sampling_ratio/min",
        "sampling/importance_sampling_ratio/mean",
        "sampling/importance_sampling_ratio/max",
        "train/reward_std",
        "train/sampling/sampling_logp_difference/max",
        "train/sampling/importance_sampling_ratio/min",
        "train/sampling/importance_sampling_ratio/mean",
        "train/sampling/importance_sampling_ratio/max",
        "train/global_step", // W&B's x-axis, logged with every row
    ],
};

/// OpenRLHF: `train/`-prefixed under TensorBoard and W&B, 1-based steps; its W&B rows chart
/// against `train/global_step` (`define_metric("train/*", step_metric="train/global_step")`).
const OPENRLHF: Preset = Preset {
    name: "openrlhf",
    first_step: 1,
    wandb_step: Some("train/global_step"),
    map: &[
        ("train/rollout/reward_mean", "rollout/raw_reward"),
        ("train/kl", "train/kl_loss"),
        ("train/actor_grad_norm", "train/grad_norm"),
        (
            "train/rollout/response_length_mean",
            "rollout/response_len/mean",
        ),
        ("rollout/reward_mean", "rollout/raw_reward"),
        ("kl", "train/kl_loss"),
        ("actor_grad_norm", "train/grad_norm"),
        ("rollout/response_length_mean", "rollout/response_len/mean"),
    ],
    own: &["train/vllm_kl", "vllm_kl", "train/global_step"],
};

/// Every preset, by name.
pub const PRESETS: [Preset; 5] = [MILES, VERL, NEMO_RL, TRL, OPENRLHF];

/// The preset called `name`; an unknown name is an error listing the known ones.
pub fn preset(name: &str) -> Result<&'static Preset, String> {
    PRESETS.iter().find(|p| p.name == name).ok_or_else(|| {
        let names: Vec<&str> = PRESETS.iter().map(|p| p.name).collect();
        let hint = crate::recipe::presets::suggest(name, &names)
            .map(|s| format!(" (did you mean `{s}`?)"))
            .unwrap_or_default();
        format!(
            "metrics preset `{name}`{hint}: use one of {}",
            names.join(", ")
        )
    })
}

impl Preset {
    /// Whether the preset knows `key` (maps it, or keeps it under its own name on purpose).
    pub fn places(&self, key: &str) -> bool {
        self.map.iter().any(|(k, _)| *k == key) || self.own.contains(&key)
    }
}

/// Which preset fits a set of logged keys best, with the keys it could not place. Keys that
/// are no framework's metric (a step counter, wall-clock stamps) should be left out by the caller.
#[derive(Debug, Clone, PartialEq)]
pub struct Detection {
    /// Presets that place at least one key, best first, with how many they place.
    pub ranked: Vec<(&'static str, usize)>,
    /// Keys the best preset cannot place (empty when nothing fits).
    pub unplaced: Vec<String>,
}

/// Rank the presets by how many of `keys` each places.
pub fn detect(keys: &BTreeSet<String>) -> Detection {
    let mut ranked: Vec<(&'static str, usize)> = PRESETS
        .iter()
        .map(|p| (p.name, keys.iter().filter(|k| p.places(k)).count()))
        .filter(|(_, n)| *n > 0)
        .collect();
    ranked.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
    let unplaced = ranked
        .first()
        .and_then(|(name, _)| PRESETS.iter().find(|p| p.name == *name))
        .map(|p| keys.iter().filter(|k| !p.places(k)).cloned().collect())
        .unwrap_or_default();
    Detection { ranked, unplaced }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(k: &[&str]) -> BTreeSet<String> {
        k.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn each_framework_is_detected_from_its_own_keys() {
        let cases = [
            (
                "verl",
                keys(&[
                    "critic/score/mean",
                    "actor/grad_norm",
                    "actor/kl_loss",
                    "training/rollout_probs_diff_mean",
                    "response_length/mean",
                    "timing_s/step",
                ]),
            ),
            (
                "nemo-rl",
                keys(&[
                    "train/reward",
                    "train/token_mult_prob_error",
                    "train/grad_norm",
                    "train/kl_penalty",
                ]),
            ),
            (
                "trl",
                keys(&[
                    "reward",
                    "reward_std",
                    "kl",
                    "grad_norm",
                    "sampling/sampling_logp_difference/mean",
                    "completions/mean_length",
                ]),
            ),
            (
                "openrlhf",
                keys(&[
                    "train/rollout/reward_mean",
                    "train/actor_grad_norm",
                    "train/vllm_kl",
                    "train/kl",
                ]),
            ),
            (
                "miles",
                keys(&[
                    "rollout/raw_reward",
                    "train/train_rollout_logprob_abs_diff",
                    "train/grad_norm",
                    "perf/step_time",
                ]),
            ),
        ];
        for (want, k) in cases {
            let d = detect(&k);
            assert_eq!(d.ranked[0].0, want, "{k:?} -> {d:?}");
            assert!(d.unplaced.is_empty(), "{want}: {:?}", d.unplaced);
        }
        // A TRL run read from W&B (by `_step`): its x-axis key is placed, not reported.
        let d = detect(&keys(&["train/reward", "train/kl", "train/global_step"]));
        assert_eq!((d.ranked[0].0, d.unplaced.len()), ("trl", 0), "{d:?}");
        let d = detect(&keys(&["reward", "my/custom_metric"]));
        assert_eq!(d.ranked[0].0, "trl");
        assert_eq!(d.unplaced, ["my/custom_metric"]);
        assert!(detect(&keys(&["nothing/known"])).ranked.is_empty());
    }

    #[test]
    fn presets_map_mismatch_only_to_the_same_quantity() {
        for p in PRESETS {
            for (from, to) in p.map {
                if *to == "train/train_rollout_logprob_abs_diff" {
                    assert!(
                        from.contains("logprob_abs_diff") || from.contains("logp_difference/mean"),
                        "{}: {from} is not a mean |Δ log p|",
                        p.name
                    );
                }
                assert!(
                    !p.own.contains(from),
                    "{}: {from} both mapped and kept",
                    p.name
                );
            }
        }
        assert!(preset("verl").is_ok());
        let e = preset("verI").unwrap_err();
        assert!(e.contains("did you mean `verl`"), "{e}");
    }
}

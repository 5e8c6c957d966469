//! What a training step reports: scalars under the metric keys users know (Miles' names where one
//! exists), per-site-and-layer rows, and events. Plain data: the trainer fills it, the run store
//! writes it, analysis reads it.
//!
//! Keys: `rollout/raw_reward`, `rollout/response_len/mean`, `rollout/truncated_ratio`,
//! `train/train_rollout_logprob_abs_diff`, `train/train_rollout_kl` (k3), `train/train_rollout_kl_k1`,
//! `train/train_rollout_kl_k2`, `train/kl_loss` (k3 KL to the BF16 reference = the warm start),
//! `train/kl_loss_minus_step0`, `train/entropy`, `train/pg_clipfrac`, `train/ppo_kl`, `train/tis`,
//! `train/tis_clipfrac`, `train/loss`, `train/grad_norm` (global, before clipping),
//! `train/update_weight_ratio`, `quant/saturated`, `quant/underflowed`, `contract/violations`,
//! `eval/accuracy` (held-out, greedy; on evaluation steps only), and wall-clock `perf/*` keys
//! (`perf/rollout_time`, `perf/train_time`, `perf/export_time`, `perf/step_time`,
//! `perf/rollout_tokens_per_s`, `perf/train_tokens_per_s`, and the train phase's parts
//! `perf/train_forward_time`, `perf/train_backward_time`, `perf/optimizer_time`). `perf/*` are the only keys that differ
//! between two runs of the same seed.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Per site and layer, per step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerRecord {
    pub step: usize,
    /// Site name relative to its layer, e.g. `mlp.experts.linear_fc1` (`output_layer`, `embedding`
    /// and norms use their own names, layer -1 outside the decoder stack).
    pub site: String,
    pub layer: i64,
    pub precision: String,
    pub grad_norm: f64,
    /// Elements clipped to the format's max in this step's quantizations of this site.
    pub saturated: u64,
    /// Non-zero elements that quantized to zero.
    pub underflowed: u64,
}

/// Something worth a line in `events.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub step: usize,
    /// `grad_spike`, `non_finite` or `contract_violation`.
    pub kind: String,
    pub site: String,
    pub layer: i64,
    /// The value that raised the event; `NaN`, `inf` and `-inf` are written as those strings
    /// (JSON has no such numbers, and a `non_finite` event is exactly about them).
    #[serde(with = "nonfinite_as_text")]
    pub value: f64,
    pub detail: String,
}

/// Serde for an f64 that may be non-finite: finite values as JSON numbers, others as `"NaN"`,
/// `"inf"` or `"-inf"` (Rust's own spellings, which `str::parse::<f64>` reads back).
mod nonfinite_as_text {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        if v.is_finite() {
            s.serialize_f64(*v)
        } else {
            s.serialize_str(&v.to_string())
        }
    }

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum NumberOrText {
        Number(f64),
        Text(String),
        Null(()),
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        match NumberOrText::deserialize(d)? {
            NumberOrText::Number(x) => Ok(x),
            NumberOrText::Text(t) => t
                .parse()
                .map_err(|_| serde::de::Error::custom(format!("`{t}` is not a number"))),
            // Files written before values were spelled out held `null` for a non-finite value.
            NumberOrText::Null(()) => Ok(f64::NAN),
        }
    }
}

/// Everything one step produced.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    pub step: usize,
    pub scalars: BTreeMap<String, f64>,
    pub layers: Vec<LayerRecord>,
    pub events: Vec<Event>,
}

impl StepRecord {
    pub fn set(&mut self, key: &str, v: f64) {
        self.scalars.insert(key.to_string(), v);
    }
    pub fn get(&self, key: &str) -> Option<f64> {
        self.scalars.get(key).copied()
    }
    /// Scalars without the wall-clock `perf/*` keys (what determinism compares).
    pub fn deterministic_scalars(&self) -> BTreeMap<String, u64> {
        self.scalars
            .iter()
            .filter(|(k, _)| !k.starts_with("perf/"))
            .map(|(k, v)| (k.clone(), v.to_bits()))
            .collect()
    }
}

/// Split a parameter name into (site, layer): `decoder.layers.3.mlp.router.weight` →
/// (`mlp.router`, 3); `output_layer.weight` → (`output_layer`, -1).
pub fn site_of(name: &str) -> (String, i64) {
    let base = name.strip_suffix(".weight").unwrap_or(name);
    if let Some(rest) = base.strip_prefix("decoder.layers.")
        && let Some((i, site)) = rest.split_once('.')
        && let Ok(i) = i.parse::<i64>()
    {
        return (site.to_string(), i);
    }
    (base.to_string(), -1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_finite_event_values_round_trip_through_json() {
        for v in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 1.5, -0.0] {
            let e = Event {
                step: 3,
                kind: "non_finite".into(),
                site: "train/loss".into(),
                layer: -1,
                value: v,
                detail: String::new(),
            };
            let text = serde_json::to_string(&e).unwrap();
            let back: Event = serde_json::from_str(&text).unwrap();
            assert_eq!(back.value.to_bits(), v.to_bits(), "{text}");
        }
        let old: Event = serde_json::from_str(
            r#"{"step":1,"kind":"non_finite","site":"x","layer":-1,"value":null,"detail":""}"#,
        )
        .unwrap();
        assert!(old.value.is_nan());
    }

    #[test]
    fn site_names_split_into_site_and_layer() {
        assert_eq!(
            site_of("decoder.layers.3.mlp.router.weight"),
            ("mlp.router".into(), 3)
        );
        assert_eq!(
            site_of("decoder.layers.12.mlp.experts.linear_fc1.weight"),
            ("mlp.experts.linear_fc1".into(), 12)
        );
        assert_eq!(site_of("output_layer.weight"), ("output_layer".into(), -1));
        assert_eq!(
            site_of("decoder.final_layernorm.weight"),
            ("decoder.final_layernorm".into(), -1)
        );
    }
}

//! The published configurations as presets (field notes: the Miles Qwen3-30B-A3B ablation) plus the
//! Hopper FP8 block recipe. Every low-precision preset keeps the last 15 % of layers, the router,
//! the shared expert and the output layer in BF16, and uses weight decay 0 on low-precision weights.

use super::{BackwardMode, LayerCount, Precision, Recipe, RecipeError, Rule, SecondScale};

/// Preset names, in the order reports list them (BF16 first: everything is compared against it).
pub const PRESETS: [&str; 7] = [
    "bf16",
    "mxfp8",
    "mxfp8-hp",
    "mxfp8-dq",
    "nvfp4-hp",
    "nvfp4-dq",
    "fp8-block",
];

fn rule(p: &str, f: Precision) -> Rule {
    Rule {
        pattern: p.into(),
        format: f,
        backward: None,
    }
}

fn base(name: &str, rules: Vec<Rule>, backward: BackwardMode) -> Recipe {
    Recipe {
        name: name.into(),
        rules,
        backward,
        bf16_first: None,
        bf16_last: Some(LayerCount::Fraction(0.15)),
        nvfp4_activation_scale: SecondScale::PerToken,
        nvfp4_shards: 1,
        weight_decay: 0.01,
        weight_decay_low_precision: 0.0,
    }
}

/// Every site but the BF16 exceptions in `f`.
fn everywhere(name: &str, f: Precision, backward: BackwardMode) -> Recipe {
    base(
        name,
        vec![
            rule("*.mlp.router", Precision::Bf16),
            rule("*.mlp.shared_experts.*", Precision::Bf16),
            rule("output_layer", Precision::Bf16),
            rule("*", f),
        ],
        backward,
    )
}

/// Routed experts only (gate/up fused in `linear_fc1`, so they share one second-level scale).
fn experts_only(name: &str, f: Precision, backward: BackwardMode) -> Recipe {
    base(
        name,
        vec![
            rule("*.mlp.experts.linear_fc1", f),
            rule("*.mlp.experts.linear_fc2", f),
            rule("*", Precision::Bf16),
        ],
        backward,
    )
}

/// A preset by name, or an error listing the presets and the nearest name.
pub fn preset(name: &str) -> Result<Recipe, RecipeError> {
    use BackwardMode::*;
    Ok(match name {
        "bf16" => {
            let mut r = base("bf16", vec![rule("*", Precision::Bf16)], HighPrecision);
            r.bf16_last = None;
            r
        }
        "mxfp8" => everywhere("mxfp8", Precision::Mxfp8, Quantized),
        "mxfp8-hp" => everywhere("mxfp8-hp", Precision::Mxfp8, HighPrecision),
        "mxfp8-dq" => everywhere("mxfp8-dq", Precision::Mxfp8, Dequantized),
        "nvfp4-hp" => experts_only("nvfp4-hp", Precision::Nvfp4, HighPrecision),
        "nvfp4-dq" => experts_only("nvfp4-dq", Precision::Nvfp4, Dequantized),
        "fp8-block" => everywhere("fp8-block", Precision::Fp8Block, Quantized),
        _ => {
            return Err(RecipeError::UnknownPreset {
                name: name.into(),
                hint: suggest(name, &PRESETS)
                    .map(|s| format!(" (did you mean `{s}`?)"))
                    .unwrap_or_default(),
                presets: PRESETS.join(", "),
            });
        }
    })
}

/// The closest candidate by edit distance, if it is close enough to be a typo.
pub fn suggest<'a>(name: &str, candidates: &[&'a str]) -> Option<&'a str> {
    candidates
        .iter()
        .map(|c| (strsim::damerau_levenshtein(name, c), *c))
        .filter(|(d, c)| *d <= 2.max(c.len() / 3))
        .min()
        .map(|(_, c)| c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recipe::Site;

    #[test]
    fn published_presets_resolve_with_their_exceptions() {
        for name in PRESETS {
            let p = preset(name).unwrap().resolve(6).unwrap();
            let last = &p.layers[5];
            // Tail layer (ceil(0.15 * 6) = 1), router, shared expert and output layer stay BF16.
            for s in Site::ALL {
                assert_eq!(
                    last.get(s).precision,
                    Precision::Bf16,
                    "{name}: layer 5 {s:?}"
                );
            }
            for l in &p.layers {
                assert_eq!(l.router.precision, Precision::Bf16, "{name}");
                assert_eq!(l.shared_fc1.precision, Precision::Bf16, "{name}");
                assert_eq!(l.shared_fc2.precision, Precision::Bf16, "{name}");
            }
            assert_eq!(p.output_layer.precision, Precision::Bf16, "{name}");
        }
        let nv = preset("nvfp4-dq").unwrap().resolve(6).unwrap();
        assert_eq!(nv.layers[0].experts_fc1.precision, Precision::Nvfp4);
        assert_eq!(nv.layers[0].experts_fc1.act_scale, SecondScale::PerToken);
        assert_eq!(nv.layers[0].experts_fc2.backward, BackwardMode::Dequantized);
        assert_eq!(nv.layers[0].linear_qkv.precision, Precision::Bf16);
        let mx = preset("mxfp8").unwrap().resolve(6).unwrap();
        assert_eq!(mx.layers[4].linear_qkv.precision, Precision::Mxfp8);
        assert_eq!(mx.layers[4].experts_fc1.backward, BackwardMode::Quantized);
        assert_eq!(
            preset("mxfp8-hp").unwrap().resolve(6).unwrap().layers[0]
                .linear_proj
                .backward,
            BackwardMode::HighPrecision
        );
    }

    #[test]
    fn unknown_preset_suggests_the_nearest() {
        let e = preset("nvfp4dq").unwrap_err().to_string();
        assert!(e.contains("did you mean `nvfp4-dq`"), "{e}");
        assert!(e.contains("bf16, mxfp8"), "{e}");
        assert!(
            !preset("zzzzzzzzzz")
                .unwrap_err()
                .to_string()
                .contains("did you mean")
        );
    }
}

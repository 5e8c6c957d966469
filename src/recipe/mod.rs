//! Precision policy: which format each matmul site uses and how its backward treats operands.
//!
//! A [`Recipe`] is an ordered list of glob rules over Megatron site names (first match wins, like
//! Miles' TransformerEngine precision config) plus layer-range rules ("first N / last N layers in
//! BF16", or a fraction). [`Recipe::resolve`] turns it into a [`ModelPlan`]: one [`SitePlan`] per
//! site and layer, which is all the engine reads. No tensor math and no I/O here (files are parsed
//! from strings by [`file`]).
//!
//! Fraction rounding: "last 15 % of layers" keeps `ceil(f · L)` layers in BF16 (so any non-zero
//! fraction keeps at least one layer): 48 layers → 8, 6 layers → 1, 2 layers → 1.

pub mod file;
pub mod presets;

pub use crate::formats::SecondScale;
use crate::formats::{Fp8BlockVariant, Fp8Elem, Fp8Tile, MxScaleRule, QuantFormat};
use globset::{Glob, GlobMatcher};
use serde::{Deserialize, Serialize};

/// Format of a matmul site's operands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Precision {
    /// Plain FP32 operands (gradient checks; "no quantization at all").
    Fp32,
    /// Operands rounded to BF16, FP32 accumulation.
    Bf16,
    /// MXFP8: E4M3 elements, 32-element blocks, E8M0 scale (TE rounding).
    Mxfp8,
    /// NVFP4: E2M1 elements, 16-element blocks, E4M3 scale, FP32 second-level scale.
    Nvfp4,
    /// DeepSeek-V3 style FP8 block scaling (1x128 activations, 128x128 weights).
    Fp8Block,
}

impl Precision {
    /// Quantized below BF16 (the weights the published recipe gives weight decay 0).
    pub fn is_low_precision(self) -> bool {
        matches!(
            self,
            Precision::Mxfp8 | Precision::Nvfp4 | Precision::Fp8Block
        )
    }
    pub fn label(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Mxfp8 => "mxfp8",
            Precision::Nvfp4 => "nvfp4",
            Precision::Fp8Block => "fp8-block",
        }
    }
}

/// What the two backward GEMMs (dgrad, wgrad) use as operands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BackwardMode {
    /// Both backward GEMMs in the format: column-wise copies quantized from the high-precision
    /// originals, and the incoming gradient quantized too.
    Quantized,
    /// The original operands rounded to BF16.
    HighPrecision,
    /// BF16 rebuilt from the exact low-precision values the forward used.
    Dequantized,
}

impl BackwardMode {
    pub fn label(self) -> &'static str {
        match self {
            BackwardMode::Quantized => "quantized",
            BackwardMode::HighPrecision => "high-precision",
            BackwardMode::Dequantized => "dequantized",
        }
    }
}

/// The resolved precision of one matmul site in one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SitePlan {
    pub precision: Precision,
    pub backward: BackwardMode,
    /// NVFP4 activation second-level scale (weights always use one scale per tensor).
    pub act_scale: SecondScale,
    /// NVFP4 per-token scale computed over K split into this many equal shards (expert TP size).
    pub shards: usize,
    /// MXFP8 E8M0 scale rule (TE's rounded-up scale everywhere, unless a contract break asks).
    pub mx_rule: MxScaleRule,
}

impl SitePlan {
    pub const FP32: SitePlan = SitePlan {
        precision: Precision::Fp32,
        backward: BackwardMode::HighPrecision,
        act_scale: SecondScale::PerToken,
        shards: 1,
        mx_rule: MxScaleRule::TeCeil,
    };
    pub const BF16: SitePlan = SitePlan {
        precision: Precision::Bf16,
        ..SitePlan::FP32
    };

    /// Format of the weight operand (blocks along K); `None` for FP32.
    pub fn weight_format(&self) -> Option<QuantFormat> {
        match self.precision {
            Precision::Fp32 => None,
            Precision::Bf16 => Some(QuantFormat::Bf16),
            Precision::Mxfp8 => Some(QuantFormat::Mxfp8 {
                elem: Fp8Elem::E4M3,
                rule: self.mx_rule,
            }),
            Precision::Nvfp4 => Some(QuantFormat::Nvfp4 {
                second: SecondScale::PerTensor,
                shards: 1,
            }),
            Precision::Fp8Block => Some(QuantFormat::Fp8Block {
                tile: Fp8Tile::Weight128x128,
                variant: Fp8BlockVariant::Te,
            }),
        }
    }

    /// Format of activations and incoming gradients (blocks along K, per token where it applies).
    pub fn activation_format(&self) -> Option<QuantFormat> {
        match self.precision {
            Precision::Nvfp4 => Some(QuantFormat::Nvfp4 {
                second: self.act_scale,
                shards: self.shards,
            }),
            Precision::Fp8Block => Some(QuantFormat::Fp8Block {
                tile: Fp8Tile::Act1x128,
                variant: Fp8BlockVariant::Te,
            }),
            _ => self.weight_format(),
        }
    }
}

/// The matmul sites of one transformer block, with their Megatron names (after `decoder.layers.{i}.`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Site {
    LinearQkv,
    LinearProj,
    Router,
    ExpertsFc1,
    ExpertsFc2,
    SharedFc1,
    SharedFc2,
}

impl Site {
    pub const ALL: [Site; 7] = [
        Site::LinearQkv,
        Site::LinearProj,
        Site::Router,
        Site::ExpertsFc1,
        Site::ExpertsFc2,
        Site::SharedFc1,
        Site::SharedFc2,
    ];

    /// Name relative to the layer, e.g. `mlp.experts.linear_fc1`.
    pub fn suffix(self) -> &'static str {
        match self {
            Site::LinearQkv => "self_attention.linear_qkv",
            Site::LinearProj => "self_attention.linear_proj",
            Site::Router => "mlp.router",
            Site::ExpertsFc1 => "mlp.experts.linear_fc1",
            Site::ExpertsFc2 => "mlp.experts.linear_fc2",
            Site::SharedFc1 => "mlp.shared_experts.linear_fc1",
            Site::SharedFc2 => "mlp.shared_experts.linear_fc2",
        }
    }

    /// Full Megatron name in layer `i`.
    pub fn name(self, layer: usize) -> String {
        format!("decoder.layers.{layer}.{}", self.suffix())
    }
}

/// Name of the output projection site.
pub const OUTPUT_LAYER: &str = "output_layer";

/// Plans of the matmul sites of one transformer block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerPlan {
    pub linear_qkv: SitePlan,
    pub linear_proj: SitePlan,
    pub router: SitePlan,
    pub experts_fc1: SitePlan,
    pub experts_fc2: SitePlan,
    pub shared_fc1: SitePlan,
    pub shared_fc2: SitePlan,
}

impl LayerPlan {
    pub fn uniform(p: SitePlan) -> Self {
        LayerPlan {
            linear_qkv: p,
            linear_proj: p,
            router: p,
            experts_fc1: p,
            experts_fc2: p,
            shared_fc1: p,
            shared_fc2: p,
        }
    }
    pub fn get(&self, s: Site) -> &SitePlan {
        match s {
            Site::LinearQkv => &self.linear_qkv,
            Site::LinearProj => &self.linear_proj,
            Site::Router => &self.router,
            Site::ExpertsFc1 => &self.experts_fc1,
            Site::ExpertsFc2 => &self.experts_fc2,
            Site::SharedFc1 => &self.shared_fc1,
            Site::SharedFc2 => &self.shared_fc2,
        }
    }
    fn get_mut(&mut self, s: Site) -> &mut SitePlan {
        match s {
            Site::LinearQkv => &mut self.linear_qkv,
            Site::LinearProj => &mut self.linear_proj,
            Site::Router => &mut self.router,
            Site::ExpertsFc1 => &mut self.experts_fc1,
            Site::ExpertsFc2 => &mut self.experts_fc2,
            Site::SharedFc1 => &mut self.shared_fc1,
            Site::SharedFc2 => &mut self.shared_fc2,
        }
    }
}

/// Plans for every site of a model: one [`LayerPlan`] per layer plus the output layer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelPlan {
    pub layers: Vec<LayerPlan>,
    pub output_layer: SitePlan,
}

impl ModelPlan {
    /// Every site of an `n_layers` model on the same plan.
    pub fn uniform(n_layers: usize, p: SitePlan) -> Self {
        ModelPlan {
            layers: vec![LayerPlan::uniform(p); n_layers],
            output_layer: p,
        }
    }

    /// The plan of a site given by its layer-relative name (`mlp.router`) and layer, or
    /// `output_layer` with layer -1; `None` for anything that is not a matmul site.
    pub fn site_plan(&self, site: &str, layer: i64) -> Option<SitePlan> {
        if layer >= 0 {
            let l = self.layers.get(layer as usize)?;
            Site::ALL
                .iter()
                .find(|s| s.suffix() == site)
                .map(|s| *l.get(*s))
        } else if site == OUTPUT_LAYER {
            Some(self.output_layer)
        } else {
            None
        }
    }

    /// Every (name, plan) pair, layers in order then the output layer.
    pub fn sites(&self) -> Vec<(String, SitePlan)> {
        let mut v: Vec<(String, SitePlan)> = Vec::new();
        for (i, l) in self.layers.iter().enumerate() {
            for s in Site::ALL {
                v.push((s.name(i), *l.get(s)));
            }
        }
        v.push((OUTPUT_LAYER.to_string(), self.output_layer));
        v
    }
}

/// One glob rule: sites whose name matches `pattern` take this format and backward mode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    /// Glob over full site names, e.g. `*.mlp.experts.linear_fc1` or `decoder.layers.0.*`.
    pub pattern: String,
    pub format: Precision,
    /// Defaults to the recipe's `backward`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backward: Option<BackwardMode>,
}

/// How many layers at one end of the stack stay BF16.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum LayerCount {
    Layers(usize),
    Fraction(f64),
}

impl LayerCount {
    /// Number of layers out of `n` (fractions round up: see the module doc).
    pub fn of(self, n: usize) -> usize {
        match self {
            LayerCount::Layers(k) => k.min(n),
            LayerCount::Fraction(f) => ((f * n as f64) - 1e-9).ceil().max(0.0) as usize,
        }
    }
}

/// Longest site or configuration glob accepted (site names are well under 100 characters).
pub const MAX_GLOB_LEN: usize = 256;

/// Compile a glob over site or configuration names. Longer than [`MAX_GLOB_LEN`] is an error, and
/// so is a glob whose regex is too big: `GlobSet::build` reports that as an error where
/// `Glob::compile_matcher` would panic ("regex compilation shouldn't fail").
pub fn glob_matcher(pattern: &str) -> Result<GlobMatcher, String> {
    if pattern.len() > MAX_GLOB_LEN {
        return Err(format!(
            "{} characters long, at most {MAX_GLOB_LEN} are allowed; shorten it",
            pattern.len()
        ));
    }
    let g = Glob::new(pattern).map_err(|e| e.to_string())?;
    globset::GlobSetBuilder::new()
        .add(g.clone())
        .build()
        .map_err(|e| e.to_string())?;
    Ok(g.compile_matcher())
}

/// `s` for a one-line message: cut to 40 characters (a hostile pattern can be megabytes) and with
/// control characters escaped ([`escape_controls`]).
pub fn shorten(s: &str) -> String {
    match s.char_indices().nth(40) {
        Some((i, _)) => format!("{}...", escape_controls(&s[..i])),
        None => escape_controls(s),
    }
}

/// `s` with control characters such as a newline escaped (`\n`), so a name from the input cannot
/// split a one-line message.
pub fn escape_controls(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        if c.is_control() {
            o.extend(c.escape_default());
        } else {
            o.push(c);
        }
    }
    o
}

/// A precision recipe: ordered glob rules, layer ranges, NVFP4 options and weight decay.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    /// Defaults to the file name when read from a file.
    #[serde(default)]
    pub name: String,
    /// Ordered rules; the first match wins. A site no rule matches is an error at resolve time.
    pub rules: Vec<Rule>,
    /// Backward mode of rules that do not name one.
    #[serde(default = "default_backward")]
    pub backward: BackwardMode,
    /// First N layers (or a fraction) forced to BF16.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bf16_first: Option<LayerCount>,
    /// Last N layers (or a fraction: the published recipe keeps 0.15) forced to BF16.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bf16_last: Option<LayerCount>,
    /// NVFP4 activation second-level scale.
    #[serde(default = "default_act_scale")]
    pub nvfp4_activation_scale: SecondScale,
    /// NVFP4 per-token scale shards (expert tensor-parallel size).
    #[serde(default = "default_shards")]
    pub nvfp4_shards: usize,
    /// AdamW weight decay of weights at BF16/FP32 sites and of non-matmul parameters.
    #[serde(default = "default_wd")]
    pub weight_decay: f32,
    /// AdamW weight decay of weights at low-precision sites (the published recipe uses 0).
    #[serde(default)]
    pub weight_decay_low_precision: f32,
}

fn default_backward() -> BackwardMode {
    BackwardMode::HighPrecision
}
fn default_act_scale() -> SecondScale {
    SecondScale::PerToken
}
fn default_shards() -> usize {
    1
}
fn default_wd() -> f32 {
    0.01
}

/// A recipe that cannot be resolved, naming the rule or field and the fix.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum RecipeError {
    #[error("recipe `{recipe}`, rule {index} (`{pattern}`): invalid glob: {why}")]
    BadGlob {
        recipe: String,
        index: usize,
        pattern: String,
        why: String,
    },
    #[error(
        "recipe `{recipe}`, rule {index} (`{pattern}`) matches no site of this model; site names look like `decoder.layers.0.mlp.experts.linear_fc1` or `output_layer`"
    )]
    MatchesNothing {
        recipe: String,
        index: usize,
        pattern: String,
    },
    #[error(
        "recipe `{recipe}`: rules {first} and {second} both use pattern `{pattern}` with different formats; remove one"
    )]
    Contradictory {
        recipe: String,
        first: usize,
        second: usize,
        pattern: String,
    },
    #[error(
        "recipe `{recipe}`, rule {index} (`{pattern}`) is never used: every site it matches is taken by an earlier rule (rule {shadowed_by}); move it up or remove it"
    )]
    Unreachable {
        recipe: String,
        index: usize,
        pattern: String,
        shadowed_by: usize,
    },
    #[error(
        "recipe `{recipe}`: site `{site}` matches no rule; add a catch-all rule `pattern = \"*\"` at the end"
    )]
    Unmatched { recipe: String, site: String },
    #[error("recipe `{recipe}`: {field} = {value} is outside [0, 1]")]
    BadFraction {
        recipe: String,
        field: &'static str,
        value: f64,
    },
    #[error("recipe `{recipe}`: {field} = {value} must be a number in [0, 1]")]
    BadWeightDecay {
        recipe: String,
        field: &'static str,
        value: f32,
    },
    #[error("recipe `{recipe}`: {what} holds a control character (newline, tab...); remove it")]
    ControlChar { recipe: String, what: String },
    #[error("recipe `{recipe}`: nvfp4_shards must be at least 1")]
    BadShards { recipe: String },
    #[error("unknown recipe `{name}`{hint}; presets: {presets}")]
    UnknownPreset {
        name: String,
        hint: String,
        presets: String,
    },
}

impl Recipe {
    /// Resolve to a per-site, per-layer plan for a model of `n_layers` layers.
    pub fn resolve(&self, n_layers: usize) -> Result<ModelPlan, RecipeError> {
        self.validate()?;
        let matchers = self.matchers()?;
        let first = self.bf16_first.map_or(0, |c| c.of(n_layers));
        let last = self.bf16_last.map_or(0, |c| c.of(n_layers));
        let mut used = vec![false; self.rules.len()];
        let mut matched_any = vec![false; self.rules.len()];
        let mut plan = ModelPlan::uniform(n_layers, SitePlan::BF16);
        let mut resolve_one = |name: &str| -> Result<SitePlan, RecipeError> {
            let mut hit = None;
            for (i, m) in matchers.iter().enumerate() {
                if m.is_match(name) {
                    matched_any[i] = true;
                    if hit.is_none() {
                        hit = Some(i);
                        used[i] = true;
                    }
                }
            }
            let i = hit.ok_or_else(|| RecipeError::Unmatched {
                recipe: self.name.clone(),
                site: name.to_string(),
            })?;
            Ok(self.plan_for(&self.rules[i]))
        };
        for layer in 0..n_layers {
            let forced_bf16 = layer < first || layer >= n_layers.saturating_sub(last);
            for s in Site::ALL {
                let p = resolve_one(&s.name(layer))?;
                *plan.layers[layer].get_mut(s) = if forced_bf16 && p.precision != Precision::Fp32 {
                    SitePlan {
                        precision: Precision::Bf16,
                        ..p
                    }
                } else {
                    p
                };
            }
        }
        plan.output_layer = resolve_one(OUTPUT_LAYER)?;
        for (i, r) in self.rules.iter().enumerate() {
            if !matched_any[i] {
                return Err(RecipeError::MatchesNothing {
                    recipe: self.name.clone(),
                    index: i + 1,
                    pattern: r.pattern.clone(),
                });
            }
            if !used[i] {
                let shadowed_by = (0..i)
                    .find(|&j| {
                        used[j]
                            && matchers[j].is_match(OUTPUT_LAYER)
                                == matchers[i].is_match(OUTPUT_LAYER)
                    })
                    .unwrap_or(0)
                    + 1;
                return Err(RecipeError::Unreachable {
                    recipe: self.name.clone(),
                    index: i + 1,
                    pattern: r.pattern.clone(),
                    shadowed_by,
                });
            }
        }
        Ok(plan)
    }

    fn plan_for(&self, r: &Rule) -> SitePlan {
        SitePlan {
            precision: r.format,
            backward: r.backward.unwrap_or(self.backward),
            act_scale: self.nvfp4_activation_scale,
            shards: self.nvfp4_shards,
            mx_rule: MxScaleRule::TeCeil,
        }
    }

    fn matchers(&self) -> Result<Vec<GlobMatcher>, RecipeError> {
        self.rules
            .iter()
            .enumerate()
            .map(|(i, r)| {
                glob_matcher(&r.pattern).map_err(|why| RecipeError::BadGlob {
                    recipe: self.name.clone(),
                    index: i + 1,
                    pattern: shorten(&r.pattern),
                    why,
                })
            })
            .collect()
    }

    fn validate(&self) -> Result<(), RecipeError> {
        let name_bad = self.name.chars().any(char::is_control);
        if let Some(what) = name_bad.then(|| "its name".to_string()).or_else(|| {
            self.rules
                .iter()
                .position(|r| r.pattern.chars().any(char::is_control))
                .map(|i| {
                    format!(
                        "rule {} pattern `{}`",
                        i + 1,
                        shorten(&self.rules[i].pattern)
                    )
                })
        }) {
            return Err(RecipeError::ControlChar {
                recipe: shorten(&self.name),
                what,
            });
        }
        for (field, c) in [
            ("bf16_first", self.bf16_first),
            ("bf16_last", self.bf16_last),
        ] {
            if let Some(LayerCount::Fraction(f)) = c
                && !(0.0..=1.0).contains(&f)
            {
                return Err(RecipeError::BadFraction {
                    recipe: self.name.clone(),
                    field,
                    value: f,
                });
            }
        }
        for (field, value) in [
            ("weight_decay", self.weight_decay),
            (
                "weight_decay_low_precision",
                self.weight_decay_low_precision,
            ),
        ] {
            if !(0.0..=1.0).contains(&value) {
                return Err(RecipeError::BadWeightDecay {
                    recipe: self.name.clone(),
                    field,
                    value,
                });
            }
        }
        if self.nvfp4_shards == 0 {
            return Err(RecipeError::BadShards {
                recipe: self.name.clone(),
            });
        }
        for (i, a) in self.rules.iter().enumerate() {
            for (j, b) in self.rules.iter().enumerate().skip(i + 1) {
                if a.pattern == b.pattern && (a.format != b.format || a.backward != b.backward) {
                    return Err(RecipeError::Contradictory {
                        recipe: self.name.clone(),
                        first: i + 1,
                        second: j + 1,
                        pattern: a.pattern.clone(),
                    });
                }
            }
        }
        Ok(())
    }

    /// Weight decay for the weight of a site resolved to `p`.
    pub fn weight_decay_for(&self, p: &SitePlan) -> f32 {
        if p.precision.is_low_precision() {
            self.weight_decay_low_precision
        } else {
            self.weight_decay
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(p: &str, f: Precision) -> Rule {
        Rule {
            pattern: p.into(),
            format: f,
            backward: None,
        }
    }

    fn recipe(rules: Vec<Rule>) -> Recipe {
        Recipe {
            name: "t".into(),
            rules,
            backward: BackwardMode::Dequantized,
            bf16_first: None,
            bf16_last: None,
            nvfp4_activation_scale: SecondScale::PerToken,
            nvfp4_shards: 1,
            weight_decay: 0.01,
            weight_decay_low_precision: 0.0,
        }
    }

    #[test]
    fn first_match_wins_and_layer_ranges_force_bf16() {
        let mut r = recipe(vec![
            rule("*.mlp.router", Precision::Bf16),
            rule("*.mlp.experts.*", Precision::Nvfp4),
            rule("*", Precision::Mxfp8),
        ]);
        r.bf16_last = Some(LayerCount::Fraction(0.15));
        r.bf16_first = Some(LayerCount::Layers(1));
        let p = r.resolve(8).unwrap();
        // ceil(0.15 * 8) = 2 tail layers, plus the first layer.
        for (i, l) in p.layers.iter().enumerate() {
            let low = (1..6).contains(&i);
            assert_eq!(
                l.experts_fc1.precision,
                if low {
                    Precision::Nvfp4
                } else {
                    Precision::Bf16
                },
                "layer {i}"
            );
            assert_eq!(
                l.linear_qkv.precision,
                if low {
                    Precision::Mxfp8
                } else {
                    Precision::Bf16
                },
                "layer {i}"
            );
            assert_eq!(l.router.precision, Precision::Bf16);
            assert_eq!(l.experts_fc1.backward, BackwardMode::Dequantized);
        }
        assert_eq!(p.output_layer.precision, Precision::Mxfp8);
    }

    #[test]
    fn fraction_rounding_is_documented_ceil() {
        assert_eq!(LayerCount::Fraction(0.15).of(48), 8);
        assert_eq!(LayerCount::Fraction(0.15).of(6), 1);
        assert_eq!(LayerCount::Fraction(0.15).of(2), 1);
        assert_eq!(LayerCount::Fraction(0.0).of(6), 0);
        assert_eq!(LayerCount::Fraction(0.5).of(6), 3);
        assert_eq!(LayerCount::Layers(9).of(6), 6);
    }

    #[test]
    fn bad_rules_are_errors_naming_the_rule() {
        let e = recipe(vec![
            rule("*.mlp.expert.linear_fc1", Precision::Nvfp4),
            rule("*", Precision::Bf16),
        ])
        .resolve(2)
        .unwrap_err();
        assert!(
            matches!(e, RecipeError::MatchesNothing { index: 1, .. }),
            "{e}"
        );
        let e = recipe(vec![
            rule("*", Precision::Bf16),
            rule("*.mlp.router", Precision::Mxfp8),
        ])
        .resolve(2)
        .unwrap_err();
        assert!(
            matches!(e, RecipeError::Unreachable { index: 2, .. }),
            "{e}"
        );
        let e = recipe(vec![
            rule("*.mlp.router", Precision::Bf16),
            rule("*.mlp.router", Precision::Mxfp8),
            rule("*", Precision::Bf16),
        ])
        .resolve(2)
        .unwrap_err();
        assert!(
            matches!(
                e,
                RecipeError::Contradictory {
                    first: 1,
                    second: 2,
                    ..
                }
            ),
            "{e}"
        );
        let e = recipe(vec![rule("*.mlp.*", Precision::Bf16)])
            .resolve(2)
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("decoder.layers.0.self_attention.linear_qkv"),
            "{e}"
        );
        let mut r = recipe(vec![rule("*", Precision::Bf16)]);
        r.bf16_last = Some(LayerCount::Fraction(1.5));
        assert!(matches!(
            r.resolve(2),
            Err(RecipeError::BadFraction {
                field: "bf16_last",
                ..
            })
        ));
        let e = recipe(vec![rule("[", Precision::Bf16)])
            .resolve(2)
            .unwrap_err();
        assert!(matches!(e, RecipeError::BadGlob { .. }), "{e}");
    }

    #[test]
    fn weight_decay_follows_precision() {
        let r = recipe(vec![rule("*", Precision::Bf16)]);
        assert_eq!(
            r.weight_decay_for(&SitePlan {
                precision: Precision::Nvfp4,
                ..SitePlan::BF16
            }),
            0.0
        );
        assert_eq!(r.weight_decay_for(&SitePlan::BF16), 0.01);
    }

    #[test]
    fn weight_decay_must_be_a_number_in_0_1() {
        let mut r = recipe(vec![rule("*", Precision::Bf16)]);
        for bad in [f32::NAN, -0.1, 2.0, f32::INFINITY] {
            r.weight_decay = bad;
            let e = r.resolve(2).unwrap_err().to_string();
            assert!(e.contains("weight_decay") && e.contains("[0, 1]"), "{e}");
        }
        r.weight_decay = 0.0;
        r.weight_decay_low_precision = f32::NAN;
        assert!(r.resolve(2).is_err());
    }

    #[test]
    fn huge_globs_are_errors_not_panics() {
        let mut r = recipe(vec![rule("*", Precision::Bf16)]);
        r.rules[0].pattern = "*".repeat(100_000);
        let e = r.resolve(2).unwrap_err().to_string();
        assert!(e.contains("at most 256") && e.len() < 300, "{e}");
        assert!(glob_matcher(&"*".repeat(100_000)).is_err());
        assert!(glob_matcher(&"a*".repeat(128)).is_ok());
    }
}

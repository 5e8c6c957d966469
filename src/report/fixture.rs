//! Synthetic, deterministic report input: a suite, its runs (per-layer gradient norms with injected
//! spikes, `perf/*` timings) and a hand-built [`SuiteComparison`] over them. Used by the report's
//! tests, the browser test and `lockstep bench report`, so the report can be built and timed
//! without running the engine or the comparison. The bands here are min/max over the synthetic
//! seeds: fixture data, not the comparison's statistics.

use super::runs::RunData;
use crate::compare::*;
use crate::engine::metrics::{LayerRecord, StepRecord};
use crate::store::{Manifest, RunDir, RunStatus};
use crate::suite::spec::{ConfigSpec, SuiteSpec, Sweep, Workload};
use std::collections::BTreeMap;
use std::path::Path;

/// Sites per decoder layer, with Megatron names relative to the layer (as the built-in engine
/// logs them).
pub const SITES: [&str; 9] = [
    "input_layernorm",
    "pre_mlp_layernorm",
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "mlp.router",
    "mlp.experts.linear_fc1",
    "mlp.experts.linear_fc2",
    "mlp.shared_experts.linear_fc1",
    "mlp.shared_experts.linear_fc2",
];

/// How big a synthetic suite is.
#[derive(Debug, Clone)]
pub struct Shape {
    pub suite: String,
    /// Config names; the first is the baseline.
    pub configs: Vec<String>,
    pub seeds: usize,
    pub steps: usize,
    pub layers: i64,
    /// An optional sweep axis applied to every non-baseline config.
    pub sweep: Option<(String, Vec<String>)>,
}

impl Shape {
    /// Four configs x 3 seeds x 30 steps, 2 layers: fast enough for unit tests.
    pub fn small() -> Shape {
        Shape {
            suite: "synthetic".into(),
            configs: ["bf16", "mxfp8", "nvfp4-hp", "nvfp4-dq"]
                .map(String::from)
                .to_vec(),
            seeds: 3,
            steps: 30,
            layers: 2,
            sweep: None,
        }
    }

    /// The nightly suite's size: six configs x 5 seeds x 40 steps, 6 layers.
    pub fn nightly() -> Shape {
        Shape {
            suite: "nightly".into(),
            configs: [
                "bf16", "mxfp8", "mxfp8-hp", "mxfp8-dq", "nvfp4-hp", "nvfp4-dq",
            ]
            .map(String::from)
            .to_vec(),
            seeds: 5,
            steps: 40,
            layers: 6,
            sweep: None,
        }
    }

    /// A tail-layer ablation: bf16 plus two families swept over `bf16_last`.
    pub fn ablation() -> Shape {
        Shape {
            suite: "ablation-tail".into(),
            configs: ["bf16", "nvfp4-dq-tail", "nvfp4-dq-first1"]
                .map(String::from)
                .to_vec(),
            seeds: 3,
            steps: 30,
            layers: 6,
            sweep: Some(("bf16_last".into(), vec!["2".into(), "4".into(), "8".into()])),
        }
    }
}

/// A synthetic suite with everything a report needs.
pub struct Fixture {
    pub spec: SuiteSpec,
    pub comparison: SuiteComparison,
    pub runs: Vec<RunData>,
    /// What each run wrote, for [`Fixture::write_store`].
    pub records: Vec<(Manifest, Vec<StepRecord>)>,
}

/// splitmix64: deterministic noise without an RNG dependency.
fn noise(mut x: u64) -> f64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
}

fn key(parts: &[u64]) -> u64 {
    parts.iter().fold(1469598103934665603u64, |h, p| {
        (h ^ p).wrapping_mul(1099511628211)
    })
}

/// How far from BF16 a config's formats are (drives mismatch, KL and timings).
fn severity(name: &str) -> f64 {
    if name.contains("nvfp4") {
        1.0
    } else if name.contains("mxfp8") || name.contains("fp8") {
        0.3
    } else if name.contains("bf16") {
        0.02
    } else {
        0.6
    }
}

/// Whether the config gets gradient spikes (the published finding: NVFP4 with high-precision
/// backward).
fn spiky(name: &str) -> bool {
    name.contains("nvfp4-hp")
}

/// Build the synthetic suite.
pub fn synthetic(shape: &Shape) -> Fixture {
    let baseline = shape.configs[0].clone();
    // (label, base, axes)
    let mut labels: Vec<(String, String, BTreeMap<String, String>)> =
        vec![(baseline.clone(), baseline.clone(), BTreeMap::new())];
    for c in &shape.configs[1..] {
        match &shape.sweep {
            None => labels.push((c.clone(), c.clone(), BTreeMap::new())),
            Some((axis, vals)) => {
                for v in vals {
                    let axes = BTreeMap::from([(axis.clone(), v.clone())]);
                    labels.push((format!("{c} [{axis}={v}]"), c.clone(), axes));
                }
            }
        }
    }
    let seeds: Vec<u64> = (0..shape.seeds as u64).collect();
    let mut runs = Vec::new();
    let mut records = Vec::new();
    let mut spikes = Vec::new();
    for (ci, (label, base, axes)) in labels.iter().enumerate() {
        // A swept axis value (e.g. more BF16 tail layers) lowers the severity.
        let relief = axes
            .values()
            .filter_map(|v| v.parse::<f64>().ok())
            .map(|v| 1.0 / (1.0 + v / 4.0))
            .next()
            .unwrap_or(1.0);
        let sev = severity(base) * relief;
        for &seed in &seeds {
            let (recs, mut sp) = run_records(shape, ci as u64, seed, base, sev);
            for s in &mut sp {
                s.config = label.clone();
            }
            spikes.extend(sp);
            let run_id = format!(
                "{}-s{seed}-{:08x}",
                super::figures::slug(ci, label),
                key(&[ci as u64, seed]) as u32
            );
            let mut m = Manifest::start(
                &run_id,
                "builtin",
                serde_json::json!({"recipe": {"name": base}}),
                seed,
                shape.steps,
                "cpu",
            );
            m.suite = Some(shape.suite.clone());
            m.status = RunStatus::Ok;
            m.steps_done = shape.steps;
            m.finished = Some(m.started.clone());
            m.extra.insert("config_name".into(), label.clone().into());
            m.extra.insert("base_config".into(), base.clone().into());
            m.extra.insert(
                "axes".into(),
                serde_json::to_value(axes).unwrap_or_default(),
            );
            runs.push(run_data(&m, &recs));
            records.push((m, recs));
        }
    }
    let comparison = compare(shape, &labels, &records, spikes);
    Fixture {
        spec: spec(shape, &labels),
        comparison,
        runs,
        records,
    }
}

fn run_data(m: &Manifest, recs: &[StepRecord]) -> RunData {
    let (config, base, axes) = RunData::names(m);
    let mut perf: BTreeMap<String, Vec<(usize, f64)>> = BTreeMap::new();
    for r in recs {
        for (k, v) in r.scalars.iter().filter(|(k, _)| k.starts_with("perf/")) {
            perf.entry(k.clone()).or_default().push((r.step, *v));
        }
    }
    RunData {
        dir: Path::new(&m.run_id).to_path_buf(),
        manifest: m.clone(),
        config,
        base,
        axes,
        layers: recs.iter().flat_map(|r| r.layers.clone()).collect(),
        perf,
    }
}

/// One run's step records and the spikes injected into it.
fn run_records(
    shape: &Shape,
    ci: u64,
    seed: u64,
    base: &str,
    sev: f64,
) -> (Vec<StepRecord>, Vec<Spike>) {
    let spike_steps: Vec<usize> = if spiky(base) {
        vec![
            shape.steps / 4 + seed as usize,
            shape.steps / 2 + 2 * seed as usize,
        ]
        .into_iter()
        .filter(|s| *s < shape.steps)
        .take(match seed {
            0 => 1,
            1 => 2,
            _ => 0,
        })
        .collect()
    } else {
        vec![]
    };
    let mut spikes = Vec::new();
    let mut recs = Vec::new();
    for step in 0..shape.steps {
        let t = step as f64;
        let n = |salt: u64| noise(key(&[ci, seed, step as u64, salt]));
        let mut r = StepRecord {
            step,
            ..Default::default()
        };
        r.set(
            "rollout/raw_reward",
            0.15 + 0.6 * (1.0 - (-t / 12.0).exp()) + 0.04 * n(1) - 0.01 * sev,
        );
        let diff = (1e-4 + 6e-3 * sev) * (1.0 + 0.01 * t) * (1.0 + 0.2 * n(2));
        r.set("train/train_rollout_logprob_abs_diff", diff);
        r.set(
            "train/train_rollout_kl",
            diff * diff * 0.5 * (1.0 + 0.1 * n(3)),
        );
        let kl0 = 2e-3 * sev;
        r.set("train/kl_loss", kl0 + 1e-4 * t * (1.0 + 0.3 * n(4)).abs());
        if step % 10 == 0 {
            r.set(
                "eval/accuracy",
                0.1 + 0.5 * (1.0 - (-t / 15.0).exp()) + 0.05 * n(5),
            );
        }
        r.set("perf/rollout_time", 0.05 * (1.0 + sev) * (1.0 + 0.1 * n(6)));
        r.set(
            "perf/train_time",
            0.12 * (1.0 + 2.0 * sev) * (1.0 + 0.1 * n(7)),
        );
        r.set(
            "perf/export_time",
            0.01 * (1.0 + 3.0 * sev) * (1.0 + 0.1 * n(8)),
        );
        for layer in -1..shape.layers {
            let sites: &[&str] = if layer < 0 {
                &[
                    "embedding.word_embeddings",
                    "embedding.position_embeddings",
                    "decoder.final_layernorm",
                    "output_layer",
                ]
            } else {
                &SITES
            };
            for (si, site) in sites.iter().enumerate() {
                let mut g = 0.05
                    * (1.0 + si as f64 * 0.4)
                    * (1.0 + 0.3 * n(100 + si as u64 + 10 * (layer + 1) as u64)).abs()
                    * (1.0 + 0.2 * layer.max(0) as f64);
                if layer == shape.layers - 1
                    && *site == "mlp.experts.linear_fc2"
                    && spike_steps.contains(&step)
                {
                    let prev = g;
                    g *= 25.0;
                    spikes.push(Spike {
                        config: String::new(),
                        seed,
                        step,
                        site: site.to_string(),
                        layer,
                        value: g,
                        ratio: g / (prev * 1.3),
                        z: 9.5,
                    });
                }
                r.layers.push(LayerRecord {
                    step,
                    site: site.to_string(),
                    layer,
                    precision: if sev > 0.1 {
                        "nvfp4".into()
                    } else {
                        "bf16".into()
                    },
                    grad_norm: g,
                    saturated: 0,
                    underflowed: 0,
                });
            }
        }
        recs.push(r);
    }
    (recs, spikes)
}

/// The suite spec the fixture pretends to be.
fn spec(shape: &Shape, labels: &[(String, String, BTreeMap<String, String>)]) -> SuiteSpec {
    let mut bases: Vec<&String> = Vec::new();
    for (_, b, _) in labels {
        if !bases.contains(&b) {
            bases.push(b);
        }
    }
    let mut checks = toml::Table::new();
    checks.insert("margin".into(), toml::Value::Float(0.05));
    SuiteSpec {
        name: shape.suite.clone(),
        description: format!("Synthetic {} suite (report fixture)", shape.suite),
        engine: "builtin".into(),
        seeds: (0..shape.seeds as u64).collect(),
        workload: Workload {
            model: "small".into(),
            task: "add:3".into(),
            prompts_per_step: Some(16),
            samples_per_prompt: Some(8),
            max_response_tokens: Some(6),
            steps: shape.steps,
            lr: None,
            routing_replay: None,
            eval_every: Some(10),
            policy_lag: None,
            warm_start: None,
        },
        configs: bases
            .iter()
            .map(|b| ConfigSpec {
                name: b.to_string(),
                recipe: b.to_string(),
                bf16_last: None,
                bf16_first: None,
                backward: None,
                shared_experts_bf16: None,
                contract_break: None,
                policy_lag: None,
                variants: Vec::new(),
                env: BTreeMap::new(),
                vars: BTreeMap::new(),
            })
            .collect(),
        sweep: Sweep {
            bf16_last: shape
                .sweep
                .iter()
                .filter(|(a, _)| a == "bf16_last")
                .flat_map(|(_, v)| v.iter().filter_map(|x| x.parse().ok()))
                .collect(),
            ..Default::default()
        },
        slurm: Default::default(),
        checks,
        claims: Vec::new(),
        command: None,
        ingest: None,
        path: format!("suites/{}.toml", shape.suite).into(),
    }
}

/// A band over seeds: mean, min/max as the band, every seed's curve.
fn band(recs: &[&(Manifest, Vec<StepRecord>)], metric: &str) -> Band {
    let mut steps: Vec<usize> = recs
        .first()
        .map(|(_, r)| {
            r.iter()
                .filter(|s| s.get(metric).is_some())
                .map(|s| s.step)
                .collect()
        })
        .unwrap_or_default();
    steps.sort_unstable();
    let per_seed: Vec<(u64, Vec<f64>)> = recs
        .iter()
        .map(|(m, r)| {
            (
                m.seed,
                r.iter().filter_map(|s| s.get(metric)).collect::<Vec<f64>>(),
            )
        })
        .collect();
    let at = |i: usize| per_seed.iter().filter_map(move |(_, v)| v.get(i).copied());
    let mean = (0..steps.len())
        .map(|i| at(i).sum::<f64>() / per_seed.len().max(1) as f64)
        .collect();
    let lo = (0..steps.len())
        .map(|i| at(i).fold(f64::INFINITY, f64::min))
        .collect();
    let hi = (0..steps.len())
        .map(|i| at(i).fold(f64::NEG_INFINITY, f64::max))
        .collect();
    Band {
        steps,
        mean,
        lo,
        hi,
        per_seed,
    }
}

fn tail_mean(b: &Band, w: usize) -> f64 {
    let n = b.mean.len();
    let s = &b.mean[n.saturating_sub(w)..];
    s.iter().sum::<f64>() / s.len().max(1) as f64
}

/// The hand-built comparison of every config against the baseline.
fn compare(
    shape: &Shape,
    labels: &[(String, String, BTreeMap<String, String>)],
    records: &[(Manifest, Vec<StepRecord>)],
    spikes: Vec<Spike>,
) -> SuiteComparison {
    let of = |label: &str| -> Vec<&(Manifest, Vec<StepRecord>)> {
        records
            .iter()
            .filter(|(m, _)| m.extra.get("config_name").and_then(|v| v.as_str()) == Some(label))
            .collect()
    };
    let baseline = labels[0].0.clone();
    let base_recs = of(&baseline);
    let metrics: [(&str, bool, Option<f64>); 5] = [
        ("rollout/raw_reward", true, Some(0.05)),
        ("train/train_rollout_logprob_abs_diff", false, None),
        ("train/train_rollout_kl", false, None),
        ("train/kl_loss", false, None),
        ("eval/accuracy", true, None),
    ];
    let mut configs = Vec::new();
    let mut checks = Vec::new();
    let mut contract = Vec::new();
    for (label, _, _) in labels {
        let recs = of(label);
        contract.push(ContractRow {
            config: label.clone(),
            runs: recs.len(),
            steps_checked: recs.len() * shape.steps,
            violations: 0,
        });
        if *label == baseline {
            continue;
        }
        let mut ms = Vec::new();
        for (metric, hib, margin) in metrics {
            let curve = band(&recs, metric);
            let base = band(&base_recs, metric);
            let d = tail_mean(&curve, 10) - tail_mean(&base, 10);
            // Interval half-width: 0.02 for reward-like metrics, 30 % of the level otherwise.
            let hw = if hib {
                0.02
            } else {
                0.3 * tail_mean(&base, 10).abs().max(d.abs())
            };
            let kl = metric.contains("kl").then(|| KlSummary {
                level: tail_mean(&curve, 10),
                step0_offset: curve.mean.first().copied().unwrap_or(0.0),
                drift: Interval {
                    estimate: 1e-4,
                    lo: 5e-5,
                    hi: 1.5e-4,
                },
                step0: curve.mean.first().copied().unwrap_or(0.0),
                growth: 0.0,
                baseline_level: tail_mean(&base, 10),
                baseline_drift: Interval::default(),
            });
            let (verdict, reason) = match margin {
                Some(m) if d.abs() + 0.02 < m => (
                    Verdict::Equivalent,
                    format!("90 % CI of the difference inside ±{m}"),
                ),
                Some(_) => (Verdict::Inconclusive, "CI crosses the margin".to_string()),
                None => (
                    Verdict::NoDifference,
                    "no difference detected (no margin set: descriptive)".to_string(),
                ),
            };
            ms.push(MetricComparison {
                metric: metric.to_string(),
                higher_is_better: hib,
                curve,
                baseline: base,
                final_diff: Interval {
                    estimate: d,
                    lo: d - hw,
                    hi: d + hw,
                },
                auc_diff: Interval {
                    estimate: d * 0.8,
                    lo: d * 0.8 - hw,
                    hi: d * 0.8 + hw,
                },
                iqm: 0.5,
                prob_improvement: 0.5,
                margin,
                verdict,
                reason,
                kl,
                final_diff_bootstrap: Interval::default(),
                baseline_iqm: 0.5,
                seeds_needed: None,
                pairing: None,
                fold: None,
                margin_rule: None,
            });
        }
        configs.push(ConfigComparison {
            config: label.clone(),
            seeds: (0..shape.seeds as u64).collect(),
            metrics: ms,
            baseline: baseline.clone(),
            diverged: 0,
            failed: 0,
        });
        checks.push(CheckResult {
            expr: format!("mean(rollout/raw_reward, last=10) >= {baseline} - 0.05"),
            config: label.clone(),
            passed: true,
            value: 0.7,
            threshold: 0.66,
            message: "ok".into(),
            name: String::new(),
        });
    }
    SuiteComparison {
        spike_rates: vec![],
        suite: shape.suite.clone(),
        baseline_config: baseline,
        method: Method {
            bootstrap_reps: 10_000,
            bootstrap_seed: 0,
            alpha: 0.05,
            final_window: 10,
            spike_window: 20,
            spike_z: 6.0,
            spike_ratio: 10.0,
            description: vec![
                "Bands: percentile bootstrap over seeds (10,000 resamples, seed 0).".into(),
                "Equivalence: two one-sided tests at alpha 0.05 against the suite margin.".into(),
            ],
            band_reps: 1000,
            power: 0.8,
            min_seeds: 3,
            nights: 1,
        },
        configs,
        spikes,
        checks,
        claims: vec![],
        warnings: Vec::new(),
        problems: Vec::new(),
        contract,
        overall: OverallVerdict::Pass,
        night_state: None,
    }
}

impl Fixture {
    /// Write the runs into `suite_dir` as the run store would (`manifest.json`, `scalars.parquet`,
    /// `layers.parquet`, `events.jsonl`).
    pub fn write_store(&self, suite_dir: &Path) -> Result<(), crate::io::IoError> {
        for (m, recs) in &self.records {
            let d = RunDir::create(&suite_dir.join(&m.run_id))?;
            d.write_metrics(recs)?;
            d.write_manifest(m)?;
        }
        Ok(())
    }
}

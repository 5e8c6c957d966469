//! Issue 20, decisive verdicts: the sequential seed procedure (`compare::sequential`) simulated on
//! per-seed values, 2,000 simulated nights per setting (20,000 for the false-regression rate):
//! - identical arms are called `regressed` at most at the stated alpha over the whole procedure
//!   (every look counted), for independent arms (Welch) and for arms coupled by the seed (paired,
//!   correlation 0.6);
//! - a regression of the margin's size is caught at the stated power when the plan says its last
//!   look resolves the noise, and is called `equivalent` at most at alpha;
//! - `equivalent` is never declared with fewer seeds than the margin needs.
//!
//! Binomial slack: an observed rate may exceed the stated one by 2.33 standard errors (one-sided
//! 99 %); the simulation seeds are fixed, so the outcome is reproducible.

use lockstep::compare::sequential::{SequentialPlan, SequentialVerdict};
use lockstep::compare::stats::seeds_needed_diff;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const SIMS: usize = 2000;
/// The false-regression rate is checked on more nights: its binomial slack is then small enough
/// to see an excess of a few tenths of a percent.
const SIMS_NULL: usize = 20_000;
const MARGIN: f64 = 0.05;

fn normal(rng: &mut ChaCha8Rng) -> f64 {
    let u1: f64 = rng.random_range(f64::EPSILON..1.0);
    let u2: f64 = rng.random_range(0.0..1.0);
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

fn plan() -> SequentialPlan {
    // The shape `lockstep nightly --seeds auto` would use: 3 seeds, then batches of 3, up to 15.
    SequentialPlan::new(0.05, 0.8, MARGIN, true, 3, 15, 3).unwrap()
}

/// One simulated night: per-seed rewards of both arms (level 0.5, spread `sd`, correlation `rho`
/// through a shared seed effect, configuration shifted by `shift`), looked at as planned.
/// Returns the verdict, the seeds used, and the seeds the procedure said the margin needs.
fn night(
    p: &SequentialPlan,
    shift: f64,
    sd: f64,
    rho: f64,
    paired: bool,
    rng: &mut ChaCha8Rng,
) -> (SequentialVerdict, usize, Option<usize>) {
    let max = *p.looks.last().unwrap();
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for _ in 0..max {
        let common = normal(rng);
        let own = normal(rng);
        y.push(0.5 + sd * common);
        x.push(0.5 + shift + sd * (rho * common + (1.0 - rho * rho).sqrt() * own));
    }
    for &n in &p.looks {
        let d = p.decide(&x[..n], &y[..n], paired);
        if d.verdict != SequentialVerdict::Continue {
            return (d.verdict, n, d.seeds_needed);
        }
    }
    unreachable!("the last look always decides")
}

fn simulate(
    shift: f64,
    sd: f64,
    rho: f64,
    paired: bool,
    seed: u64,
) -> Vec<(SequentialVerdict, usize, Option<usize>)> {
    simulate_n(SIMS, shift, sd, rho, paired, seed)
}

fn simulate_n(
    sims: usize,
    shift: f64,
    sd: f64,
    rho: f64,
    paired: bool,
    seed: u64,
) -> Vec<(SequentialVerdict, usize, Option<usize>)> {
    let p = plan();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..sims)
        .map(|_| night(&p, shift, sd, rho, paired, &mut rng))
        .collect()
}

fn rate(v: &[(SequentialVerdict, usize, Option<usize>)], w: SequentialVerdict) -> f64 {
    v.iter().filter(|x| x.0 == w).count() as f64 / v.len() as f64
}

fn slack(p: f64) -> f64 {
    slack_n(p, SIMS)
}

fn slack_n(p: f64, sims: usize) -> f64 {
    2.33 * (p * (1.0 - p) / sims as f64).sqrt()
}

/// The largest per-seed spread whose difference (`sd·sqrt(2(1 - rho))`) the plan resolves.
fn resolvable_sd(rho: f64) -> f64 {
    let p = plan();
    let mut sd = 0.001;
    while p.resolves((sd + 0.0005) * (2.0 * (1.0 - rho)).sqrt()) {
        sd += 0.0005;
    }
    sd
}

/// (rho, paired): independent arms compared by Welch; coupled arms compared per seed.
const SETTINGS: [(f64, bool); 2] = [(0.0, false), (0.6, true)];

#[test]
fn identical_arms_regress_at_most_at_alpha_over_all_looks() {
    let alpha = plan().alpha;
    for (i, (rho, paired)) in SETTINGS.into_iter().enumerate() {
        // At the noisiest level the plan resolves, and at half of it.
        for (j, scale) in [1.0, 0.5].into_iter().enumerate() {
            let sd = scale * resolvable_sd(rho);
            let v = simulate_n(
                SIMS_NULL,
                0.0,
                sd,
                rho,
                paired,
                10 + 2 * i as u64 + j as u64,
            );
            let r = rate(&v, SequentialVerdict::Regressed);
            let eq = rate(&v, SequentialVerdict::Equivalent);
            let mean_seeds = v.iter().map(|x| x.1 as f64).sum::<f64>() / v.len() as f64;
            println!(
                "rho {rho} paired {paired} sd {sd:.4}: regressed {r}, equivalent {eq}, mean seeds per arm {mean_seeds:.1}"
            );
            assert!(
                r <= alpha + slack_n(alpha, SIMS_NULL),
                "false regression rate {r}"
            );
            if scale < 1.0 {
                // The procedure does decide: with half the noise, identical arms are mostly
                // found equivalent, and before the last look on average.
                assert!(eq >= 0.8, "equivalent in only {eq} of identical-arm nights");
                assert!(mean_seeds < 15.0, "{mean_seeds}");
            }
        }
    }
}

#[test]
fn a_regression_of_the_margin_is_caught_at_the_stated_power() {
    let p = plan();
    for (i, (rho, paired)) in SETTINGS.into_iter().enumerate() {
        let sd = resolvable_sd(rho);
        assert!(sd > 0.005, "a usable noise level ({sd})");
        let v = simulate(-MARGIN, sd, rho, paired, 20 + i as u64);
        let caught = rate(&v, SequentialVerdict::Regressed);
        let eq = rate(&v, SequentialVerdict::Equivalent);
        println!("rho {rho} paired {paired} sd {sd:.4}: caught {caught}, equivalent {eq}");
        assert!(
            caught >= p.power - slack(p.power),
            "caught {caught}, stated power {}",
            p.power
        );
        assert!(
            eq <= p.alpha + slack(p.alpha),
            "equivalent {eq} at the margin"
        );
    }
}

#[test]
fn equivalent_is_never_declared_with_fewer_seeds_than_the_margin_needs() {
    let p = plan();
    for (i, (rho, paired)) in SETTINGS.into_iter().enumerate() {
        // Half the noise the plan resolves: equivalence is common, and could come too early.
        let sd = 0.5 * resolvable_sd(rho);
        let sd_diff = sd * (2.0 * (1.0 - rho)).sqrt();
        let truth = seeds_needed_diff(sd_diff, MARGIN, p.alpha, p.power).unwrap();
        let v = simulate(0.0, sd, rho, paired, 30 + i as u64);
        let eq: Vec<_> = v
            .iter()
            .filter(|x| x.0 == SequentialVerdict::Equivalent)
            .collect();
        assert!(!eq.is_empty());
        for (_, n, needed) in &eq {
            assert!(*n >= p.looks[0]);
            assert!(
                needed.is_some_and(|k| *n >= k),
                "equivalent at {n} seeds, below the {needed:?} it said the margin needs"
            );
        }
        // Against the true noise: the 99 % bound keeps early claims rare.
        let early = eq.iter().filter(|x| x.1 < truth).count() as f64 / SIMS as f64;
        println!("rho {rho}: true need {truth}, equivalent below it in {early}");
        assert!(early <= 0.01 + slack(0.01), "{early}");
    }
}

// ---- The comparison itself, on simulated runs -----------------------------------------------

use lockstep::compare::analyze::{CompareOptions, compare_data};
use lockstep::compare::data::{LayerSeries, RunData};
use lockstep::compare::settings::{CompareSettings, MarginRule};
use lockstep::compare::{SuiteComparison, Verdict};
use lockstep::store::RunStatus;
use std::collections::BTreeMap;

const REWARD: &str = "rollout/raw_reward";
const KL: &str = "train/train_rollout_kl";
const STEPS: usize = 40;

/// What sets one simulated run apart: a reward shift, the seed's own offset (shared by the
/// configurations of one seed), the KL level, and the steps where its grad norm spikes.
struct Shape<'a> {
    shift: f64,
    offset: f64,
    kl: f64,
    spikes_at: &'a [usize],
}

/// A run whose reward rises from 0.3 to 0.54 (plus the shape's shift and offset), whose KL sits at
/// the shape's level times a per-seed factor, and with one grad-norm series.
fn sim_run(config: &str, engine: &str, seed: u64, sh: &Shape, rng: &mut ChaCha8Rng) -> RunData {
    let Shape {
        shift,
        offset,
        kl,
        spikes_at,
    } = *sh;
    let reward = (0..STEPS)
        .map(|t| {
            let base = 0.3 + 0.24 * (1.0 - (-(t as f64) / 8.0).exp());
            (t, base + shift + offset + 0.005 * normal(rng))
        })
        .collect();
    let factor = (0.1 * normal(rng)).exp();
    let kls = (0..STEPS)
        .map(|t| (t, kl * factor * (1.0 + 0.02 * normal(rng))))
        .collect();
    let grad: Vec<f64> = (0..STEPS)
        .map(|t| {
            if spikes_at.contains(&t) {
                50.0
            } else {
                1.0 + 0.05 * normal(rng)
            }
        })
        .collect();
    RunData {
        run_id: format!("{config}-s{seed}-sim"),
        config: config.into(),
        base: config.into(),
        axes: BTreeMap::new(),
        seed,
        engine: engine.into(),
        status: RunStatus::Ok,
        metrics: [(REWARD.to_string(), reward), (KL.to_string(), kls)].into(),
        layers: vec![LayerSeries {
            site: "mlp.experts.linear_fc1".into(),
            layer: 3,
            steps: (0..STEPS).collect(),
            grad_norm: grad,
        }],
        events: vec![],
        contract_steps: 0,
        contract_violations: 0,
        weight_bytes: None,
        path: Default::default(),
    }
}

struct Night {
    seeds: u64,
    shift: f64,
    seed_sd: f64,
    kl_ratio: f64,
    engine: &'static str,
    spikes: bool,
}

fn compare_night(n: &Night, s: &CompareSettings, sim: u64) -> SuiteComparison {
    compare_runs(&night_runs(n, sim), s)
}

fn compare_runs(runs: &[RunData], s: &CompareSettings) -> SuiteComparison {
    let opts = CompareOptions {
        bootstrap_reps: Some(500),
        band_reps: Some(20),
        ..Default::default()
    };
    compare_data("sim", runs, s, &opts).unwrap()
}

fn night_runs(n: &Night, sim: u64) -> Vec<RunData> {
    let mut rng = ChaCha8Rng::seed_from_u64(sim);
    let mut runs = Vec::new();
    for seed in 0..n.seeds {
        // The seed's own effect, shared by both configurations (common random numbers).
        let offset = n.seed_sd * normal(&mut rng);
        let sp: &[usize] = if n.spikes { &[15, 38] } else { &[] };
        let base = Shape {
            shift: 0.0,
            offset,
            kl: 1e-4,
            spikes_at: &[],
        };
        runs.push(sim_run("bf16", n.engine, seed, &base, &mut rng));
        let config = Shape {
            shift: n.shift,
            offset,
            kl: 1e-4 * n.kl_ratio,
            spikes_at: sp,
        };
        runs.push(sim_run("nvfp4", n.engine, seed, &config, &mut rng));
    }
    runs
}

fn settings(margin: MarginRule) -> CompareSettings {
    let mut s = CompareSettings::default();
    match margin {
        MarginRule::Absolute(m) => {
            s.margins.insert(REWARD.into(), m);
        }
        r => {
            s.margin_rules.insert(REWARD.into(), r);
        }
    }
    s.metrics = Some(vec![REWARD.into(), KL.into()]);
    s
}

fn metric<'a>(c: &'a SuiteComparison, m: &str) -> &'a lockstep::compare::MetricComparison {
    c.configs[0].metrics.iter().find(|x| x.metric == m).unwrap()
}

#[test]
fn coupled_seeds_are_compared_pairwise_and_say_what_it_saved() {
    let night = Night {
        seeds: 6,
        shift: 0.0,
        seed_sd: 0.03,
        kl_ratio: 1.0,
        engine: "builtin",
        spikes: false,
    };
    let c = compare_night(&night, &settings(MarginRule::Absolute(0.05)), 1);
    let m = metric(&c, REWARD);
    let p = m
        .pairing
        .expect("same seeds on the built-in engine are paired");
    assert_eq!(p.seeds, 6);
    assert!(p.correlation > 0.8, "{p:?}");
    assert!(p.se_ratio > 2.0 && p.effective_seeds > 24.0, "{p:?}");
    assert!(
        c.method
            .description
            .iter()
            .any(|l| l.contains("paired t interval"))
    );
    assert_eq!(m.verdict, Verdict::Equivalent, "{}", m.reason);
    // Another engine: no coupling is known, so Welch, and the same data cannot decide.
    let other = compare_night(
        &Night {
            engine: "command",
            ..night
        },
        &settings(MarginRule::Absolute(0.05)),
        1,
    );
    let w = metric(&other, REWARD);
    assert!(w.pairing.is_none());
    // The built-in engine, one seed of the configuration missing (sequential seeds stop a
    // configuration before the baseline): paired over the 5 seeds both ran, no warning, and the
    // same interval as a night that ran only those 5 seeds.
    let mut runs = night_runs(&night, 1);
    runs.retain(|r| !(r.config == "nvfp4" && r.seed == 2));
    let c = compare_runs(&runs, &settings(MarginRule::Absolute(0.05)));
    let common = metric(&c, REWARD);
    assert_eq!(
        common.pairing.map(|p| p.seeds),
        Some(5),
        "{}",
        common.reason
    );
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    let mut five = night_runs(&night, 1);
    five.retain(|r| r.seed != 2);
    let only = compare_runs(&five, &settings(MarginRule::Absolute(0.05)));
    assert_eq!(
        (common.final_diff.lo, common.final_diff.hi),
        (
            metric(&only, REWARD).final_diff.lo,
            metric(&only, REWARD).final_diff.hi
        )
    );
    // Fewer than 3 seeds in common: Welch over each arm's own seeds, and a warning.
    let mut runs = night_runs(&night, 1);
    runs.retain(|r| !(r.config == "nvfp4" && r.seed >= 2));
    let c = compare_runs(&runs, &settings(MarginRule::Absolute(0.05)));
    assert!(metric(&c, REWARD).pairing.is_none());
    assert!(
        c.warnings
            .iter()
            .any(|w| w.contains("instead of seed by seed")),
        "{:?}",
        c.warnings
    );
    assert!(
        w.final_diff.hi - w.final_diff.lo > 2.0 * (m.final_diff.hi - m.final_diff.lo),
        "Welch {:?} vs paired {:?}",
        w.final_diff,
        m.final_diff
    );
}

#[test]
fn metrics_without_a_margin_are_findings_with_a_fold_change() {
    let night = Night {
        seeds: 5,
        shift: 0.0,
        seed_sd: 0.02,
        kl_ratio: 38.0,
        engine: "builtin",
        spikes: false,
    };
    let c = compare_night(&night, &settings(MarginRule::Absolute(0.05)), 2);
    let kl = metric(&c, KL);
    assert_eq!(kl.verdict, Verdict::Higher, "{}", kl.reason);
    let f = kl.fold.expect("a fold change for a KL metric");
    assert!(
        f.lo > 25.0 && f.hi < 55.0 && f.lo < 38.0 && 38.0 < f.hi,
        "{f:?}"
    );
    assert!(kl.reason.contains("x bf16 ["), "{}", kl.reason);
    // The same metric at the baseline's level: no difference detected, never inconclusive.
    let same = compare_night(
        &Night {
            kl_ratio: 1.0,
            ..night
        },
        &settings(MarginRule::Absolute(0.05)),
        3,
    );
    let kl = metric(&same, KL);
    assert_eq!(kl.verdict, Verdict::NoDifference, "{}", kl.reason);
    assert!(kl.reason.starts_with("no difference detected"));
}

#[test]
fn a_real_difference_inside_the_margin_is_reported_as_both() {
    let night = Night {
        seeds: 8,
        shift: -0.023,
        seed_sd: 0.03,
        kl_ratio: 1.0,
        engine: "builtin",
        spikes: false,
    };
    let c = compare_night(&night, &settings(MarginRule::Absolute(0.05)), 4);
    let m = metric(&c, REWARD);
    assert_eq!(m.verdict, Verdict::Equivalent, "{}", m.reason);
    assert!(
        m.reason.starts_with("equivalent; lower by 0.02"),
        "{}",
        m.reason
    );
    // Against 10 % of BF16's gain it is not equivalent. The gain is the final window (steps
    // 30-39, about 0.536) minus the first (steps 0-9, about 0.394): a margin near 0.014.
    let c = compare_night(&night, &settings(MarginRule::OfGain(0.1)), 4);
    let m = metric(&c, REWARD);
    let margin = m.margin.expect("resolved from the baseline's gain");
    assert!((0.012..0.016).contains(&margin), "{margin}");
    assert!(m.margin_rule.as_deref().unwrap().contains("gain"));
    assert_ne!(m.verdict, Verdict::Equivalent, "{}", m.reason);
    assert_eq!(m.verdict, Verdict::Regressed, "{}", m.reason);
}

#[test]
fn spikes_are_counted_against_the_baseline_per_site() {
    let night = Night {
        seeds: 4,
        shift: 0.0,
        seed_sd: 0.02,
        kl_ratio: 1.0,
        engine: "builtin",
        spikes: true,
    };
    let c = compare_night(&night, &settings(MarginRule::Absolute(0.05)), 5);
    let all = c
        .spike_rates
        .iter()
        .find(|r| r.site == "all")
        .expect("an all-sites row");
    assert_eq!((all.spikes, all.baseline_spikes), (8, 0), "{all:?}");
    let site = c
        .spike_rates
        .iter()
        .find(|r| r.site == "mlp.experts.linear_fc1" && r.layer == 3)
        .unwrap();
    assert_eq!(site.steps, 4 * (STEPS as u64 - 10));
    assert!(site.rate_ratio.lo > 1.0 && site.rate_ratio.hi.is_infinite());
    assert!((site.excess_per_1k - 1000.0 * 8.0 / 120.0).abs() < 1e-9);
}

// ---- Real engine runs: an A/A test and a recipe broken on purpose ------------------------------

use lockstep::compare::analyze::sequential_looks;
use lockstep::compare::data;
use std::path::Path;
use std::process::Command;

/// Tiny MoE, 2-digit addition, 8 seeds x 30 steps: BF16, BF16 under another name (A/A), and
/// NVFP4 whose rollout quantizes activations per tensor while training uses per-token scales (the
/// contract broken on purpose, which lowers the reward).
const AA_SUITE: &str = r#"
name = "aa-broken"
engine = "builtin"
seeds = [0, 1, 2, 3, 4, 5, 6, 7]

[workload]
model = "tiny"
task = "add:2"
prompts_per_step = 8
samples_per_prompt = 8
max_response_tokens = 5
steps = 30
eval_every = 0

[[configs]]
name = "bf16"
recipe = "bf16"

[[configs]]
name = "bf16-again"
recipe = "bf16"

[[configs]]
name = "broken"
recipe = "nvfp4-dq"
contract_break = "per-tensor-nvfp4"

[checks]
MARGIN_LINE
final_window = 10
bootstrap_reps = 1000
"#;

fn lockstep_cli(dir: &Path, args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(args)
        .current_dir(dir)
        .env("LOCKSTEP_CACHE", dir.join("cache"))
        .output()
        .expect("the lockstep binary runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

fn compare_with(dir: &Path, margin_line: &str) -> SuiteComparison {
    let file = format!("aa-{}.toml", margin_line.len());
    std::fs::write(
        dir.join(&file),
        AA_SUITE.replace("MARGIN_LINE", margin_line),
    )
    .unwrap();
    let json = dir.join(format!("{file}.json"));
    let (_, out) = lockstep_cli(
        dir,
        &[
            "compare",
            "--suite",
            &file,
            "--json",
            json.to_str().unwrap(),
        ],
    );
    serde_json::from_str(&std::fs::read_to_string(&json).unwrap_or_else(|_| panic!("{out}")))
        .unwrap()
}

fn reward_of<'a>(c: &'a SuiteComparison, config: &str) -> &'a lockstep::compare::MetricComparison {
    c.configs
        .iter()
        .find(|x| x.config == config)
        .and_then(|x| x.metrics.iter().find(|m| m.metric == REWARD))
        .unwrap()
}

#[test]
fn engine_runs_a_a_is_never_regressed_and_a_broken_recipe_is() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    std::fs::write(
        dir.join("aa.toml"),
        AA_SUITE.replace("MARGIN_LINE", "margin = 0.05"),
    )
    .unwrap();
    let (code, out) = lockstep_cli(dir, &["run", "aa.toml", "--store", "runs", "--jobs", "2"]);
    assert_eq!(code, 0, "{out}");

    // Absolute margin 0.05: the A/A arm is the same bytes seed by seed; the broken recipe is
    // measurably lower, but by less than 0.05, and the verdict says both.
    let c = compare_with(dir, "margin = 0.05");
    let aa = reward_of(&c, "bf16-again");
    assert_eq!(aa.verdict, Verdict::Equivalent, "{}", aa.reason);
    assert_eq!(aa.final_diff.estimate, 0.0);
    let broken = reward_of(&c, "broken");
    assert!(
        broken.pairing.is_some_and(|p| p.correlation > 0.5),
        "{broken:?}"
    );
    assert!(broken.final_diff.hi < 0.0, "lower: {:?}", broken.final_diff);
    assert_eq!(broken.verdict, Verdict::Equivalent, "{}", broken.reason);
    assert!(
        broken.reason.starts_with("equivalent; lower by"),
        "{}",
        broken.reason
    );
    let kl = c
        .configs
        .iter()
        .find(|x| x.config == "broken")
        .and_then(|x| x.metrics.iter().find(|m| m.metric == KL))
        .unwrap();
    assert_eq!(kl.verdict, Verdict::Higher, "{}", kl.reason);
    assert!(kl.fold.is_some_and(|f| f.lo > 10.0), "{:?}", kl.fold);

    // A margin of 5 % of BF16's reward level: the broken recipe is regressed, A/A still is not.
    let c = compare_with(dir, "margin = { of_level = 0.05 }");
    let broken = reward_of(&c, "broken");
    assert_eq!(broken.verdict, Verdict::Regressed, "{}", broken.reason);
    assert!(broken.margin_rule.as_deref().unwrap().contains("level"));
    assert_ne!(reward_of(&c, "bf16-again").verdict, Verdict::Regressed);

    // Sequential looks at 4, 6 and 8 seeds on the same runs: the A/A arm stops equivalent at
    // the first look, the broken recipe regressed by the last.
    let spec_dirs = data::run_dirs(&dir.join("runs/aa-broken")).unwrap();
    let (runs, skipped) = data::load_runs(&spec_dirs, None);
    assert!(skipped.is_empty(), "{skipped:?}");
    let mut s = CompareSettings::default();
    s.margin_rules
        .insert(REWARD.into(), MarginRule::OfLevel(0.05));
    for n in [4u64, 6, 8] {
        let upto: Vec<RunData> = runs.iter().filter(|r| r.seed < n).cloned().collect();
        let looks = sequential_looks(&upto, &s, 4, 8, 2).unwrap();
        let get = |c: &str| looks.iter().find(|l| l.config == c).unwrap();
        println!(
            "{n} seeds: bf16-again {:?}, broken {:?} ({})",
            get("bf16-again").decision.verdict,
            get("broken").decision.verdict,
            get("broken").decision.reason
        );
        assert!(get("broken").paired);
        assert_ne!(
            get("bf16-again").decision.verdict,
            SequentialVerdict::Regressed
        );
        if n == 4 {
            assert_eq!(
                get("bf16-again").decision.verdict,
                SequentialVerdict::Equivalent
            );
        }
        if n == 8 {
            assert_eq!(get("broken").decision.verdict, SequentialVerdict::Regressed);
        }
    }
}

// ---- The report draws what the comparison found -----------------------------------------------

#[test]
fn the_report_shows_pairing_spike_rates_and_the_nights_state() {
    use lockstep::compare::{Pairing, SpikeRate};
    use lockstep::report::fixture::{self, Shape};
    use lockstep::report::{ReportInput, write_report};
    let mut f = fixture::synthetic(&Shape::small());
    let c = &mut f.comparison;
    c.night_state = Some("pending".into());
    c.overall = lockstep::compare::OverallVerdict::Regression;
    let config = c.configs[0].config.clone();
    c.configs[0].metrics[0].pairing = Some(Pairing {
        seeds: 5,
        correlation: 0.62,
        se_ratio: 1.5,
        effective_seeds: 11.25,
    });
    c.spike_rates.push(SpikeRate {
        config: config.clone(),
        baseline: c.baseline_config.clone(),
        site: "mlp.experts.linear_fc1".into(),
        layer: 3,
        spikes: 9,
        steps: 400,
        baseline_spikes: 1,
        baseline_steps: 400,
        excess_per_1k: 20.0,
        rate_ratio: lockstep::compare::stats::rate_ratio_interval(9, 400.0, 1, 400.0, 0.05),
    });
    let tmp = tempfile::tempdir().unwrap();
    let input = ReportInput {
        spec: &f.spec,
        suite_dir: Path::new("runs/synthetic"),
        comparison: &f.comparison,
        runs: &f.runs,
    };
    let html = std::fs::read_to_string(write_report(&input, tmp.path()).unwrap()).unwrap();
    assert!(
        html.contains(">PENDING</span></h1>"),
        "the banner uses nightly's word"
    );
    assert!(!html.contains(">REGRESSION</span></h1>"));
    assert!(html.contains("Overall: PENDING"));
    assert!(html.contains("paired over 5 seeds: correlation 0.62"));
    assert!(html.contains("excess per 1,000 steps") && html.contains("9 / 400"));
}

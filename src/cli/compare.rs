//! `lockstep compare`, `lockstep baseline save|diff`, `lockstep nightly` and `lockstep bench compare`.

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use lockstep::compare::expr::fmt_num;
use lockstep::compare::golden::{self, GoldenDiff};
use lockstep::compare::nightly::{self, NightState};
use lockstep::compare::settings::SequentialPlan;
use lockstep::compare::{
    ClaimVerdict, CompareOptions, CompareSettings, SuiteComparison, Verdict, data, settings,
};
use lockstep::io::atomic;
use lockstep::store::RunDir;
use lockstep::store::baseline::{self as bstore, BaselineMeta};
use lockstep::suite::runner::suite_dir;
use lockstep::suite::{SuiteSpec, expand, load};
use std::path::{Path, PathBuf};

/// Flags shared by everything that compares.
#[derive(Debug, Args, Clone)]
pub struct CompareFlags {
    /// Bootstrap resamples for the intervals (default: the suite's `bootstrap_reps`, else 10,000).
    #[arg(long)]
    pub reps: Option<usize>,
    /// Bootstrap resamples for the per-step bands (default: the suite's `band_reps`, else 1,000).
    #[arg(long)]
    pub band_reps: Option<usize>,
    /// Bootstrap seed (default: the suite's `bootstrap_seed`, else 0).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Compare against this configuration instead of the suite's `baseline` (default bf16).
    #[arg(long)]
    pub baseline: Option<String>,
}

impl CompareFlags {
    fn options(&self) -> CompareOptions {
        CompareOptions {
            bootstrap_reps: self.reps,
            band_reps: self.band_reps,
            seed: self.seed,
            baseline: self.baseline.clone(),
        }
    }
}

#[derive(Debug, Args)]
pub struct CompareArgs {
    /// Suite file (TOML); its runs are read from `<store>/<suite name>/`.
    #[arg(long)]
    pub suite: Option<PathBuf>,
    /// Run store root.
    #[arg(long, default_value = "runs")]
    pub store: PathBuf,
    /// Compare these run folders instead of a suite's (configurations from their manifests;
    /// `--suite` still supplies the [checks] settings when given).
    #[arg(long, num_args = 1..)]
    pub runs: Vec<PathBuf>,
    /// Where to write compare.json (default: the suite folder; with --runs: not written unless set).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// The night this comparison stands for (YYYY-MM-DD, default today), as `nightly --date`:
    /// under a rule of several nights, `compare` says what `nightly` would say on that date.
    #[arg(long)]
    pub date: Option<String>,
    #[command(flatten)]
    pub flags: CompareFlags,
}

/// `lockstep compare`: exit 0 unless something regressed (1).
pub fn compare_cmd(a: &CompareArgs) -> Result<bool> {
    let (cmp, default_json) = if !a.runs.is_empty() {
        let (name, s) = match &a.suite {
            Some(f) => {
                let spec = load(f)?;
                (spec.name.clone(), settings::from_spec(&spec)?)
            }
            None => ("runs".to_string(), CompareSettings::default()),
        };
        (
            lockstep::compare::compare_runs(&name, &a.runs, &s, &a.flags.options())?,
            None,
        )
    } else {
        let Some(f) = &a.suite else {
            bail!("name a suite (--suite SUITE.toml) or run folders (--runs DIR...)");
        };
        let spec = load(f)?;
        let s = settings::from_spec(&spec)?;
        let dir = suite_dir(&a.store, &spec.name)?;
        let mut cmp = lockstep::compare::compare_suite(&spec, &dir, &a.flags.options())?;
        cmp.night_state = night_state(&cmp, &s, &dir, a.date.as_deref())?;
        (cmp, Some(dir.join("compare.json")))
    };
    print_comparison(&cmp);
    if let Some(p) = a.json.clone().or(default_json) {
        write_json(&p, &cmp)?;
        println!("wrote {}", p.display());
    }
    problems_error(&cmp)?;
    Ok(cmp.headline_state() != "regression")
}

/// The state `lockstep nightly` would give tonight (`pass`, `pending`, `regression`,
/// `inconclusive`), from the suite's nights so far in `nightly-state.json`, without recording
/// tonight; `None` under a one-night rule, where the comparison's own verdict is the same word.
/// Golden values are not diffed here, so a night failing only on them reads `pass` here.
fn night_state(
    cmp: &SuiteComparison,
    s: &CompareSettings,
    dir: &Path,
    date: Option<&str>,
) -> Result<Option<String>> {
    if s.nights <= 1 {
        return Ok(None);
    }
    let path = dir.join("nightly-state.json");
    let mut state: NightState = match std::fs::read_to_string(&path) {
        Ok(t) => serde_json::from_str(&t).with_context(|| {
            format!(
                "{}: not a nightly state file; delete it to start over",
                path.display()
            )
        })?,
        Err(_) => NightState::default(),
    };
    let date = date.map_or_else(
        || lockstep::store::run::now_utc()[..10].to_string(),
        str::to_string,
    );
    let v = nightly::verdict(cmp, None, &mut state, &date, s.nights, s.inconclusive_fails);
    Ok(Some(v.verdict))
}

/// An error (exit 2) naming the first problem when the comparison does not cover the suite.
fn problems_error(cmp: &SuiteComparison) -> Result<()> {
    match cmp.problems.first() {
        None => Ok(()),
        Some(first) => bail!(
            "suite `{}`: {} problem(s) keep this from being a verdict (listed above); first: {first}",
            cmp.suite,
            cmp.problems.len()
        ),
    }
}

fn write_json<T: serde::Serialize>(p: &Path, v: &T) -> Result<()> {
    if let Some(parent) = p.parent().filter(|x| !x.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).with_context(|| parent.display().to_string())?;
    }
    let text = serde_json::to_string_pretty(v)?;
    atomic::write_file(p, format!("{text}\n").as_bytes())?;
    Ok(())
}

/// The readable table, problems first.
pub fn print_comparison(c: &SuiteComparison) {
    for p in &c.problems {
        println!("PROBLEM {p}");
    }
    let m = &c.method;
    println!(
        "suite {}: {} configuration(s) vs {}; {:.0} % intervals, equivalence by two one-sided tests at alpha {}, final window {} steps",
        c.suite,
        c.configs.len(),
        c.baseline_config,
        100.0 * (1.0 - 2.0 * m.alpha),
        m.alpha,
        m.final_window
    );
    println!(
        "{:<28} {:<38} {:<12} {:>30} {:>7} {:>6} {:>9} {:>5}",
        "config", "metric", "verdict", "diff [interval]", "margin", "P(imp)", "IQM", "seeds"
    );
    for cc in &c.configs {
        for mm in &cc.metrics {
            let verdict = match mm.verdict {
                Verdict::NoDifference => "no diff.".to_string(),
                v => v.words().to_string(),
            };
            println!(
                "{:<28} {:<38} {:<12} {:>30} {:>7} {:>6.2} {:>9} {:>5}",
                cc.config,
                mm.metric,
                verdict,
                format!(
                    "{} [{}, {}]",
                    fmt_num(mm.final_diff.estimate),
                    fmt_num(mm.final_diff.lo),
                    fmt_num(mm.final_diff.hi)
                ),
                mm.margin.map(fmt_num).unwrap_or_else(|| "-".into()),
                mm.prob_improvement,
                fmt_num(mm.iqm),
                cc.seeds.len()
            );
            if mm.verdict != Verdict::Equivalent || mm.reason.starts_with("equivalent;") {
                println!("{:<28}   why: {}", "", mm.reason);
            }
            if let Some(p) = &mm.pairing {
                if p.se_ratio.is_finite() {
                    println!(
                        "{:<28}   paired over {} seeds: correlation {:.2}, interval {:.2}x narrower than Welch's (worth {:.1} independent seeds per arm)",
                        "", p.seeds, p.correlation, p.se_ratio, p.effective_seeds
                    );
                } else {
                    println!(
                        "{:<28}   paired over {} seeds: the two arms are identical seed by seed",
                        "", p.seeds
                    );
                }
            }
            if let Some(k) = &mm.kl {
                println!(
                    "{:<28}   KL: level {} (baseline {}), step-0 offset {}, drift {}/step [{}, {}]",
                    "",
                    fmt_num(k.level),
                    fmt_num(k.baseline_level),
                    fmt_num(k.step0_offset),
                    fmt_num(k.drift.estimate),
                    fmt_num(k.drift.lo),
                    fmt_num(k.drift.hi)
                );
            }
        }
    }
    if !c.checks.is_empty() {
        let passed = c.checks.iter().filter(|k| k.passed).count();
        println!("checks: {passed}/{} passed", c.checks.len());
        for k in c.checks.iter().filter(|k| !k.passed) {
            println!("  FAIL {}", k.message);
        }
    }
    print_claims(c);
    let mut by: std::collections::BTreeMap<(&str, &str, i64), usize> = Default::default();
    for s in &c.spikes {
        *by.entry((s.config.as_str(), s.site.as_str(), s.layer))
            .or_default() += 1;
    }
    println!("gradient spikes: {}", c.spikes.len());
    for ((cfg, site, layer), n) in by.iter().take(12) {
        println!("  {cfg:<28} layer {layer:>2} {site:<32} {n}");
    }
    for r in c.contract.iter().filter(|r| r.violations > 0) {
        println!(
            "contract: {} has {} violation(s) over {} checked steps",
            r.config, r.violations, r.steps_checked
        );
    }
    for w in &c.warnings {
        println!("warning: {w}");
    }
    let state = c.headline_state();
    match state.as_str() {
        "pending" => println!(
            "overall: PENDING (a regression tonight, not yet on {} consecutive nights)",
            c.method.nights
        ),
        "failing" => println!(
            "overall: FAILING tonight (a regression alerts after {} consecutive nights; `lockstep nightly` keeps the count)",
            c.method.nights
        ),
        "error" => println!(
            "overall: ERROR ({} problem(s) listed first; the comparison of what did run says {})",
            c.problems.len(),
            format!("{:?}", c.overall).to_uppercase()
        ),
        s => println!("overall: {}", s.to_uppercase()),
    }
}

/// The suite's published findings, one line each: verdict, the predicate, the evidence.
fn print_claims(c: &SuiteComparison) {
    if c.claims.is_empty() {
        return;
    }
    let count = |v: ClaimVerdict| c.claims.iter().filter(|k| k.verdict == v).count();
    println!(
        "claims: {} reproduced, {} contradicted, {} inconclusive",
        count(ClaimVerdict::Reproduced),
        count(ClaimVerdict::Contradicted),
        count(ClaimVerdict::Inconclusive)
    );
    for k in &c.claims {
        println!(
            "  {:<13} {}{}: {}",
            k.verdict.words().to_uppercase(),
            k.name,
            if k.gate { " (gate)" } else { "" },
            k.predicate
        );
        println!("  {:<13} {}", "", k.evidence);
    }
}

#[derive(Debug, Subcommand)]
pub enum BaselineCommand {
    /// Record the suite's finished runs as golden values under `baselines/<suite>/`.
    Save(BaselineArgs),
    /// Show what changed between the suite's runs and its saved baseline (exit 1 when outside
    /// the tolerances).
    Diff(BaselineArgs),
}

#[derive(Debug, Args)]
pub struct BaselineArgs {
    /// Suite file (TOML).
    #[arg(long)]
    pub suite: PathBuf,
    /// Run store root.
    #[arg(long, default_value = "runs")]
    pub store: PathBuf,
    /// Baselines root (the suite's baseline is `<dir>/<suite name>/`).
    #[arg(long, default_value = "baselines")]
    pub baselines: PathBuf,
    /// save: other stores holding repeated runs of the same suite; per metric the tolerance
    /// becomes band_factor (default 1.5) x the largest deviation seen between them.
    #[arg(long)]
    pub repeat: Vec<PathBuf>,
}

/// Golden tables of a suite's runs in one store.
fn suite_tables(
    spec: &SuiteSpec,
    store: &Path,
    metrics: &[String],
) -> Result<(
    std::collections::BTreeMap<String, bstore::GoldenTable>,
    String,
    bool,
)> {
    let dir = suite_dir(store, &spec.name)?;
    let planned = expand(spec)?;
    let dirs: Vec<PathBuf> = planned
        .iter()
        .map(|p| dir.join(&p.run_id))
        .filter(|d| d.join("manifest.json").is_file())
        .collect();
    if dirs.is_empty() {
        bail!(
            "{}: no runs of suite `{}`; run it first (lockstep run {} --store {})",
            dir.display(),
            spec.name,
            spec.path.display(),
            store.display()
        );
    }
    let wanted: std::collections::BTreeSet<String> = metrics.iter().cloned().collect();
    let (mut runs, skipped) = data::load_runs(&dirs, Some(&wanted));
    for s in skipped {
        eprintln!("warning: {s}");
    }
    for r in &mut runs {
        if let Some(p) = planned.iter().find(|p| p.run_id == r.run_id) {
            r.config = p.config.clone();
        }
    }
    let m = RunDir::open(&dirs[0]).read_manifest()?;
    Ok((golden::tables(&runs, metrics), m.device, m.emulated))
}

pub fn baseline_cmd(cmd: &BaselineCommand) -> Result<bool> {
    match cmd {
        BaselineCommand::Save(a) => {
            let spec = load(&a.suite)?;
            let s = settings::from_spec(&spec)?;
            let (tables, device, emulated) = suite_tables(&spec, &a.store, &s.golden.metrics)?;
            let mut sets = vec![tables.clone()];
            for r in &a.repeat {
                sets.push(suite_tables(&spec, r, &s.golden.metrics)?.0);
            }
            let derived = golden::derive_tolerances(&sets, s.golden.band_factor);
            let meta = BaselineMeta {
                suite: spec.name.clone(),
                lockstep_version: env!("CARGO_PKG_VERSION").into(),
                git_revision: option_env!("LOCKSTEP_GIT_REV").unwrap_or("unknown").into(),
                created: lockstep::store::run::now_utc(),
                platform: golden::platform(&device, emulated),
                metrics: s.golden.metrics.clone(),
                configs: tables
                    .keys()
                    .map(|c| (c.clone(), format!("{}.csv", bstore::slug(c))))
                    .collect(),
                derived_tolerances: derived.clone(),
                repeats: sets.len(),
            };
            let dir = a.baselines.join(&spec.name);
            bstore::save(&dir, &meta, &tables)?;
            let points: usize = tables.values().map(|t| t.rows.len()).sum();
            println!(
                "saved {} configuration(s), {points} (seed, step) rows x {} metrics to {}",
                tables.len(),
                meta.metrics.len(),
                dir.display()
            );
            for (m, t) in &derived {
                println!("  derived tolerance {m}: {}", fmt_num(*t));
            }
            Ok(true)
        }
        BaselineCommand::Diff(a) => {
            let spec = load(&a.suite)?;
            let s = settings::from_spec(&spec)?;
            let d = golden_diff(&spec, &s, &a.store, &a.baselines)?;
            print_golden(&d);
            Ok(d.passed)
        }
    }
}

fn golden_diff(
    spec: &SuiteSpec,
    s: &CompareSettings,
    store: &Path,
    baselines: &Path,
) -> Result<GoldenDiff> {
    let dir = baselines.join(&spec.name);
    let (meta, base) = bstore::load(&dir)?;
    let (current, device, emulated) = suite_tables(spec, store, &meta.metrics)?;
    Ok(golden::diff(
        &meta,
        &base,
        &current,
        &golden::platform(&device, emulated),
        &s.golden,
    ))
}

fn print_golden(d: &GoldenDiff) {
    for n in &d.notes {
        println!("note: {n}");
    }
    println!(
        "{:<28} {:<38} {:>8} {:>8} {:>12} {:>10}  result",
        "config", "metric", "points", "outside", "max |diff|", "tolerance"
    );
    for r in &d.rows {
        let state = if r.passed && r.outside == 0 && r.max_abs_diff == 0.0 {
            "exact".to_string()
        } else if r.passed {
            "within tolerance".to_string()
        } else {
            format!(
                "CHANGED{}",
                r.first_outside
                    .map(|(s, t)| format!(" (first: seed {s} step {t})"))
                    .unwrap_or_default()
            )
        };
        println!(
            "{:<28} {:<38} {:>8} {:>8} {:>12} {:>10}  {state}",
            r.config,
            r.metric,
            r.compared,
            r.outside,
            fmt_num(r.max_abs_diff),
            fmt_num(r.tolerance)
        );
    }
    println!(
        "golden values: {}",
        if d.passed { "PASS" } else { "CHANGED" }
    );
}

#[derive(Debug, Args)]
pub struct NightlyArgs {
    /// Suite file (TOML).
    pub suite: PathBuf,
    /// Run store root (runs, compare.json, verdict and the nights' history go under `<store>/<suite>/`).
    #[arg(long, default_value = "runs")]
    pub store: PathBuf,
    /// Parallel workers, over all processes (default: one per core; on GPUs two per GPU when
    /// runs are batched, else four per process).
    #[arg(long)]
    pub jobs: Option<usize>,
    /// Worker processes per device (default: 1; 2 per GPU whose workers step one run each); see
    /// `lockstep run`.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    pub processes: Option<u16>,
    /// Runs a worker steps together (default: what the device suits, 16 on a GPU, 1 on the
    /// CPU); see `lockstep run`.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    pub batch_runs: Option<u16>,
    /// Compare what is in the store without running anything.
    #[arg(long)]
    pub no_run: bool,
    /// Baselines root; golden values are checked when `<dir>/<suite>/baseline.json` exists.
    #[arg(long, default_value = "baselines")]
    pub baselines: PathBuf,
    /// Where verdict.json, summary.md and junit.xml go (default: the suite's store folder).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Where the built-in engine's GEMMs run: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Reports root: the HTML report goes to `<reports>/<suite>/<timestamp>/index.html`.
    #[arg(long, default_value = "reports")]
    pub reports: PathBuf,
    /// The night's date (default: today, UTC); the consecutive-nights rule counts dates.
    #[arg(long)]
    pub date: Option<String>,
    /// `auto`: run seeds in batches and stop each configuration as soon as the group-sequential
    /// procedure decides it on the primary metric (equivalent or regressed; error spending
    /// keeps the false-alarm rate and power over all looks). `fixed`: the suite's seeds. Default:
    /// `auto` when the suite has `[checks.sequential]`, else `fixed`.
    #[arg(long, value_parser = ["auto", "fixed"])]
    pub seeds: Option<String>,
    /// Sequential seeds: seeds per configuration at the first look (default 3, or the suite's
    /// `[checks.sequential] min_seeds`).
    #[arg(long)]
    pub min_seeds: Option<usize>,
    /// Sequential seeds: the most seeds per configuration, the last look (default 15).
    #[arg(long)]
    pub max_seeds: Option<usize>,
    /// Sequential seeds: seeds added between looks (default 3).
    #[arg(long)]
    pub batch: Option<usize>,
    #[command(flatten)]
    pub flags: CompareFlags,
}

/// `lockstep nightly`: run, compare, report, verdict. Ok(true) pass, Ok(false) regression.
pub fn nightly_cmd(a: &NightlyArgs) -> Result<bool> {
    let spec = load(&a.suite)?;
    let s = settings::from_spec(&spec)?;
    let dir = suite_dir(&a.store, &spec.name)?;
    let run_args = crate::cli::suite::RunArgs {
        suite: a.suite.clone(),
        store: a.store.clone(),
        jobs: a.jobs,
        processes: a.processes,
        batch_runs: a.batch_runs,
        force: false,
        reingest: false,
        device: a.device.clone(),
        executor: crate::cli::suite::Executor::Local,
        slurm: Default::default(),
    };
    let sequential = match sequential_plan(a, &s)? {
        Some(plan) => Some(sequential_night(
            &spec, &s, &plan, a.no_run, &run_args, &dir,
        )?),
        None => {
            if !a.no_run && !crate::cli::suite::run_cmd(&run_args)? {
                eprintln!("some runs did not finish; they are listed as problems below");
            }
            None
        }
    };
    let out = a.out.clone().unwrap_or_else(|| dir.clone());
    let date = a
        .date
        .clone()
        .unwrap_or_else(|| lockstep::store::run::now_utc()[..10].to_string());
    let compared = match &sequential {
        Some((planned, looks)) => {
            lockstep::compare::compare_planned(&spec, planned, &dir, &a.flags.options()).map(
                |mut c| {
                    lockstep::compare::apply_sequential(&mut c, looks, &s);
                    c
                },
            )
        }
        None => lockstep::compare::compare_suite(&spec, &dir, &a.flags.options()),
    };
    let mut cmp = match compared {
        Ok(c) => c,
        Err(e) => {
            write_error_night(&out, &spec.name, &date, &e.to_string())?;
            return Err(anyhow::Error::from(e).context(format!(
                "nightly `{}`: no comparison (wrote the error to {}/{{verdict.json,summary.md,junit.xml}})",
                spec.name,
                out.display()
            )));
        }
    };
    let golden = if a.baselines.join(&spec.name).join("baseline.json").is_file() {
        Some(golden_diff(&spec, &s, &a.store, &a.baselines)?)
    } else {
        None
    };
    let state_path = dir.join("nightly-state.json");
    let mut state: NightState = match std::fs::read_to_string(&state_path) {
        Ok(t) => serde_json::from_str(&t).with_context(|| {
            format!(
                "{}: not a nightly state file; delete it to start over",
                state_path.display()
            )
        })?,
        Err(_) => NightState::default(),
    };
    let v = nightly::verdict(
        &cmp,
        golden.as_ref(),
        &mut state,
        &date,
        s.nights,
        s.inconclusive_fails,
    );
    // The report, compare.json and summary.md all state the night's state, so it is settled first.
    cmp.night_state = Some(v.verdict.clone());
    write_json(&dir.join("compare.json"), &cmp)?;
    let runs = crate::cli::report::current_runs(&spec, &dir)?;
    let report = lockstep::report::write_report(
        &lockstep::report::ReportInput {
            spec: &spec,
            suite_dir: &dir,
            comparison: &cmp,
            runs: &runs,
        },
        &a.reports,
    )?;
    println!("report: {}", report.display());
    std::fs::create_dir_all(&out).with_context(|| out.display().to_string())?;
    write_json(&state_path, &state)?;
    write_json(&out.join("verdict.json"), &v)?;
    let md = nightly::markdown(&v, &cmp);
    atomic::write_file(&out.join("summary.md"), md.as_bytes())?;
    atomic::write_file(
        &out.join("junit.xml"),
        nightly::junit(&cmp, golden.as_ref()).as_bytes(),
    )?;
    print_comparison(&cmp);
    if let Some(g) = &golden {
        print_golden(g);
    }
    println!("\n{md}");
    println!(
        "wrote {}/{{verdict.json,summary.md,junit.xml}} and {}",
        out.display(),
        dir.join("compare.json").display()
    );
    if v.exit_code == nightly::EXIT_ERROR {
        problems_error(&cmp)?;
    }
    Ok(v.exit_code == nightly::EXIT_PASS)
}

/// The sequential plan tonight, if seeds run sequentially: the suite's `[checks.sequential]`
/// unless `--seeds fixed`, with the command line's numbers over the suite's.
fn sequential_plan(a: &NightlyArgs, s: &CompareSettings) -> Result<Option<SequentialPlan>> {
    let base = match (a.seeds.as_deref(), s.sequential) {
        (Some("fixed"), _) | (None, None) => {
            if a.min_seeds.is_some() || a.max_seeds.is_some() || a.batch.is_some() {
                bail!(
                    "--min-seeds, --max-seeds and --batch apply to sequential seeds: add --seeds auto (or [checks.sequential] to the suite)"
                );
            }
            return Ok(None);
        }
        (_, Some(plan)) => plan,
        (_, None) => SequentialPlan::default(),
    };
    let plan = SequentialPlan {
        min_seeds: a.min_seeds.unwrap_or(base.min_seeds),
        max_seeds: a.max_seeds.unwrap_or(base.max_seeds),
        batch: a.batch.unwrap_or(base.batch),
    };
    plan.check()
        .map_err(|e| anyhow::anyhow!("--seeds auto: {e}"))?;
    Ok(Some(plan))
}

/// `nightly --seeds auto`: seeds `min_seeds` of every configuration, then batches of `batch` more
/// for the configurations the group-sequential procedure has not decided, up to `max_seeds` (the
/// baseline runs as many as the most any configuration needs). Seeds are the suite's, in order,
/// then the next unused integers. Returns the runs planned and the last look of each
/// configuration.
fn sequential_night(
    spec: &SuiteSpec,
    s: &CompareSettings,
    a: &SequentialPlan,
    no_run: bool,
    run_args: &crate::cli::suite::RunArgs,
    dir: &Path,
) -> Result<(
    Vec<lockstep::suite::RunSpec>,
    Vec<lockstep::compare::analyze::SequentialLook>,
)> {
    if spec.engine == "ingest" {
        bail!(
            "--seeds auto runs more seeds as needed; an ingest suite's runs are made elsewhere (use its fixed seeds)"
        );
    }
    let mut pool: Vec<u64> = spec.seeds.clone();
    let mut next = 0u64;
    while pool.len() < a.max_seeds {
        if !pool.contains(&next) {
            pool.push(next);
        }
        next += 1;
    }
    pool.truncate(a.max_seeds);
    let mut wide = spec.clone();
    wide.seeds = pool.clone();
    let all = expand(&wide)?;
    let rank = |seed: u64| pool.iter().position(|p| *p == seed).unwrap_or(usize::MAX);
    let mut need: std::collections::BTreeMap<String, usize> = all
        .iter()
        .filter(|r| r.base != s.baseline)
        .map(|r| (r.config.clone(), a.min_seeds))
        .collect();
    loop {
        let most = need.values().copied().max().unwrap_or(a.min_seeds);
        let planned: Vec<lockstep::suite::RunSpec> = all
            .iter()
            .filter(|r| rank(r.seed) < *need.get(&r.config).unwrap_or(&most))
            .cloned()
            .collect();
        if !no_run && !crate::cli::suite::run_local(spec, &planned, run_args)? {
            eprintln!("some runs did not finish; they are listed as problems below");
        }
        let runs = lockstep::compare::load_planned(&planned, dir, s);
        let looks =
            lockstep::compare::sequential_looks(&runs, s, a.min_seeds, a.max_seeds, a.batch)?;
        let mut more = false;
        for l in &looks {
            let d = &l.decision;
            println!(
                "sequential: {} at {} seeds: {:?}{}",
                l.config,
                d.seeds,
                d.verdict,
                d.next_seeds
                    .map(|n| format!(" (next look at {n})"))
                    .unwrap_or_default()
            );
            if let (Some(n), Some(have)) = (d.next_seeds, need.get_mut(&l.config))
                && n > *have
            {
                *have = n.min(a.max_seeds);
                more = true;
            }
        }
        if !more {
            return Ok((planned, looks));
        }
    }
}

/// A night with no comparison at all (no runs, no baseline, a broken suite folder): verdict.json,
/// summary.md and junit.xml still say so, as an error, for the CI system that reads them.
fn write_error_night(out: &Path, suite: &str, date: &str, why: &str) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| out.display().to_string())?;
    let v = serde_json::json!({
        "suite": suite,
        "date": date,
        "verdict": "error",
        "exit_code": nightly::EXIT_ERROR,
        "problems": [why],
    });
    write_json(&out.join("verdict.json"), &v)?;
    let md = format!(
        "### ❌ lockstep nightly `{suite}` {date}: **ERROR**\n\nNo comparison was possible: {why}\n"
    );
    atomic::write_file(&out.join("summary.md"), md.as_bytes())?;
    atomic::write_file(
        &out.join("junit.xml"),
        nightly::junit_error(suite, why).as_bytes(),
    )?;
    Ok(())
}

/// Issue 5's target for comparing 1,000 runs x 1,000 steps, loading included.
const BENCH_COMPARE_TARGET_S: f64 = 5.0;

/// `lockstep bench compare`.
pub fn bench_compare(
    runs: usize,
    steps: usize,
    configs: usize,
    sites: usize,
    io: bool,
) -> Result<bool> {
    let r = lockstep::compare::bench::run(runs, steps, configs, sites, io)?;
    println!(
        "compare {runs} runs x {steps} steps ({configs} configurations, {} metrics, {sites} grad-norm series per run)",
        r.metrics
    );
    if let Some(t) = r.load_s {
        println!(
            "  load from the store (Parquet, {} threads): {t:.2} s",
            rayon::current_num_threads()
        );
    }
    println!(
        "  statistics (bands, intervals, verdicts, spikes, checks): {:.2} s",
        r.compare_s
    );
    println!(
        "  compare.json serialisation: {:.2} s ({:.1} MB)",
        r.json_s,
        r.json_bytes as f64 / 1e6
    );
    let total = r.load_s.unwrap_or(0.0) + r.compare_s;
    let verdict = |t: f64| {
        if t < BENCH_COMPARE_TARGET_S {
            "under"
        } else {
            "OVER"
        }
    };
    println!(
        "  total{}: {total:.2} s ({} the {BENCH_COMPARE_TARGET_S:.0} s target)",
        if r.load_s.is_some() {
            " (load + statistics)"
        } else {
            " (statistics only: --no-io)"
        },
        verdict(total)
    );
    println!(
        "  total with compare.json: {:.2} s ({} the {BENCH_COMPARE_TARGET_S:.0} s target)",
        total + r.json_s,
        verdict(total + r.json_s)
    );
    Ok(true)
}

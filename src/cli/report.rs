//! `lockstep report --suite S [--store DIR] [--out DIR]` and `lockstep bench report`.

use anyhow::{Context, Result, bail};
use clap::Args;
use lockstep::report::{ReportInput, fixture, load_current_runs, load_runs, write_report};
use lockstep::suite::runner::suite_dir;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Debug, Args)]
pub struct ReportArgs {
    /// Suite file, or the name of one under `suites/` (e.g. `nightly` for `suites/nightly.toml`).
    #[arg(long)]
    pub suite: String,
    /// Run store root (the suite's runs are in `<store>/<suite>/`).
    #[arg(long, default_value = "runs")]
    pub store: PathBuf,
    /// Reports root: the report is written to `<out>/<suite>/<UTC timestamp>/index.html`.
    #[arg(long, default_value = "reports")]
    pub out: PathBuf,
    /// Draw a comparison saved by `lockstep compare` (its compare.json) instead of computing one.
    #[arg(long)]
    pub comparison: Option<PathBuf>,
}

/// Find the suite file: the path as given, else `suites/<name>.toml`.
pub fn suite_file(s: &str) -> Result<PathBuf> {
    let p = PathBuf::from(s);
    if p.is_file() {
        return Ok(p);
    }
    let named = Path::new("suites").join(format!("{s}.toml"));
    if named.is_file() {
        return Ok(named);
    }
    bail!(
        "suite `{s}`: no such file, and no `{}` either; pass a suite file path",
        named.display()
    )
}

/// Read a `compare.json` written by `lockstep compare`.
fn read_comparison(p: &Path) -> Result<lockstep::compare::SuiteComparison> {
    let text = std::fs::read_to_string(p)
        .with_context(|| format!("{}: cannot read the comparison", p.display()))?;
    serde_json::from_str(&text).with_context(|| {
        format!(
            "{}: not a lockstep comparison (write one with `lockstep compare`)",
            p.display()
        )
    })
}

pub fn run(args: &ReportArgs) -> Result<bool> {
    let file = suite_file(&args.suite)?;
    let spec = lockstep::suite::load(&file)?;
    let dir = suite_dir(&args.store, &spec.name)?;
    if !dir.is_dir() {
        bail!(
            "{}: no runs for suite `{}`; run `lockstep run {}` first",
            dir.display(),
            spec.name,
            file.display()
        );
    }
    let t0 = Instant::now();
    let comparison = match &args.comparison {
        Some(p) => read_comparison(p)?,
        None => lockstep::compare::compare_suite(&spec, &dir, &Default::default())?,
    };
    let runs = match &args.comparison {
        // A saved comparison may come from `compare --runs` over folders no plan names: when the
        // store holds none of the suite's current runs, it is drawn with every folder there.
        Some(p) if load_current_runs(&spec, &dir)?.0.is_empty() => {
            let all = load_runs(&dir)?;
            if !all.is_empty() {
                eprintln!(
                    "note: none of the {} run folder(s) in {} is a run of suite `{}` as it is now; drawing all of them beside the saved comparison {}",
                    all.len(),
                    dir.display(),
                    spec.name,
                    p.display()
                );
            }
            all
        }
        _ => current_runs(&spec, &dir)?,
    };
    let input = ReportInput {
        spec: &spec,
        suite_dir: &dir,
        comparison: &comparison,
        runs: &runs,
    };
    let index = write_report(&input, &args.out)?;
    println!(
        "report: {} ({} runs, {:.1}s)",
        index.display(),
        runs.len(),
        t0.elapsed().as_secs_f64()
    );
    Ok(true)
}

/// The suite's current runs in `dir` for a report; stale folders (old run ids, an edited suite)
/// are passed over and said so in one line.
pub fn current_runs(
    spec: &lockstep::suite::SuiteSpec,
    dir: &Path,
) -> Result<Vec<lockstep::report::RunData>> {
    let (runs, stale) = load_current_runs(spec, dir)?;
    if let Some(first) = stale.first() {
        eprintln!(
            "note: skipped {} stale run folder(s) in {} (e.g. {first}): not runs of suite `{}` as it is now (an edited suite, or run ids of an older lockstep; README, \"Upgrading\"); the report draws and counts only the suite's current runs",
            stale.len(),
            dir.display(),
            spec.name
        );
    }
    Ok(runs)
}

#[derive(Debug, Args)]
pub struct BenchReportArgs {
    /// Suite shape: `nightly` (6 configs x 5 seeds x 40 steps, 6 layers), `ablation` or `small`.
    #[arg(long, default_value = "nightly")]
    pub shape: String,
    /// Steps per run (overrides the shape's).
    #[arg(long)]
    pub steps: Option<usize>,
    /// Keep the report in this folder instead of a temporary one.
    #[arg(long)]
    pub keep: Option<PathBuf>,
}

/// Time a report of a synthetic suite: reading its runs from a store and writing the report.
pub fn bench(args: &BenchReportArgs) -> Result<bool> {
    let mut shape = match args.shape.as_str() {
        "nightly" => fixture::Shape::nightly(),
        "ablation" => fixture::Shape::ablation(),
        "small" => fixture::Shape::small(),
        other => bail!("--shape {other}: use nightly, ablation or small"),
    };
    if let Some(s) = args.steps {
        shape.steps = s.max(2);
    }
    let f = fixture::synthetic(&shape);
    let tmp = std::env::temp_dir().join(format!("lockstep-bench-report-{}", std::process::id()));
    let store = tmp.join("store").join(&shape.suite);
    f.write_store(&store)?;
    let out = args.keep.clone().unwrap_or_else(|| tmp.join("reports"));
    let t0 = Instant::now();
    let runs = load_runs(&store)?;
    let t_load = t0.elapsed().as_secs_f64();
    let input = ReportInput {
        spec: &f.spec,
        suite_dir: &store,
        comparison: &f.comparison,
        runs: &runs,
    };
    let t1 = Instant::now();
    let index = write_report(&input, &out)?;
    let t_write = t1.elapsed().as_secs_f64();
    let n_png = std::fs::read_dir(index.parent().unwrap_or(Path::new(".")))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| e.path().extension().is_some_and(|x| x == "png"))
                .count()
        })
        .unwrap_or(0);
    let html_kb = std::fs::metadata(&index)
        .map(|m| m.len() / 1024)
        .unwrap_or(0);
    println!(
        "report bench, shape {} ({} configs incl. sweeps, {} runs x {} steps, {} layer rows per step)",
        args.shape,
        f.comparison.configs.len() + 1,
        runs.len(),
        shape.steps,
        runs.first()
            .map_or(0, |r| r.layers.len() / shape.steps.max(1))
    );
    println!("  read runs from store : {t_load:.2} s");
    println!("  figures + page       : {t_write:.2} s ({n_png} PNGs, index.html {html_kb} KiB)");
    println!(
        "  total                : {:.2} s (target < 10 s for the nightly suite)",
        t_load + t_write
    );
    if args.keep.is_some() {
        println!("  kept: {}", index.display());
    }
    let _ = std::fs::remove_dir_all(&tmp);
    Ok(true)
}

//! Importing runs made elsewhere (a cluster's output tree) into the run store, the same way the
//! command engine stores a run it launched. Two ways in:
//!
//! - `lockstep ingest DIR --mapping FILE`: every run folder found under DIR, filed under run ids
//!   made from its configuration, seed and relative path;
//! - a suite with `engine = "ingest"` and an `[ingest]` table (the mapping plus `tree`): its
//!   configurations and seeds say which runs to expect, run ids are the suite's own, so
//!   `compare --suite`, `report` and `nightly` treat them like any other suite's runs. Every
//!   `lockstep run` of it re-reads the tree; a planned run not found there is recorded `failed`.
//!
//! A mapping (TOML) says how to recognise a run folder and how to read it:
//!
//! ```toml
//! tree = "/shared/rl-runs"               # suites, or a default DIR for `lockstep ingest`
//! meta_file = "lockstep-run.json"        # per-run metadata: {"config": "nvfp4-dq", "seed": 1, ...}
//! path_pattern = "{config}/seed{seed}"   # used for folders without a metadata file
//! [metrics]                              # exactly as [command.metrics] in a suite
//! files = ["metrics.jsonl"]
//! step = "step"
//! [metrics.map]                          # the framework's name = lockstep's name
//! "actor/grad_norm" = "train/grad_norm"
//! ```
//!
//! Pattern segments are literal, `*` (any one folder), or text with one `{config}` or `{seed}`
//! placeholder. Every run found is read and checked before anything is written, and all runs land
//! together or not at all ([`crate::io::atomic::write_dirs`]). A metadata `status` of `failed`,
//! `timeout`, `diverged` or `running` is kept (a `running` run is not finished, so never `ok`).

use super::identity::format_run_id;
use super::metrics::{MetricsMapping, MetricsRead, read_metrics};
use super::plan::RunSpec;
use super::runner::suite_dir;
use super::spec::SuiteSpec;
use crate::io::{IoError, atomic};
use crate::store::{Manifest, RunDir, RunStatus};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The mapping file, or a suite's `[ingest]` table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IngestMapping {
    /// The folder holding the runs (relative to the file it is written in).
    #[serde(default)]
    pub tree: Option<PathBuf>,
    #[serde(default = "default_meta_file")]
    pub meta_file: String,
    #[serde(default)]
    pub path_pattern: Option<String>,
    #[serde(default)]
    pub metrics: MetricsMapping,
}

fn default_meta_file() -> String {
    "lockstep-run.json".to_string()
}

/// Read a mapping file; errors carry the file, line and column. `tree` is made relative to it.
pub fn load_mapping(path: &Path) -> Result<IngestMapping, IoError> {
    let text = std::fs::read_to_string(path).map_err(|e| IoError::io(path, e))?;
    let mut m: IngestMapping = toml::from_str(&text).map_err(|e| {
        IoError::invalid(
            path,
            format!(
                "{} (known keys: tree, meta_file, path_pattern, [metrics] preset, files, source, step, first_step, keep_partial_events, map, layers)",
                e.to_string().trim_end()
            ),
        )
    })?;
    m.metrics
        .validate()
        .map_err(|e| IoError::invalid(path, format!("[metrics] {e}")))?;
    m.tree = m.tree.map(|t| relative_to(path, &t));
    Ok(m)
}

/// `p` as written in `file`: absolute stays, relative is taken from the file's folder.
pub fn relative_to(file: &Path, p: &Path) -> PathBuf {
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        file.parent().unwrap_or(Path::new(".")).join(p)
    }
}

/// A run folder found in the tree.
#[derive(Debug, Clone, PartialEq)]
pub struct FoundRun {
    pub path: PathBuf,
    /// Path relative to the tree's root (part of the run's identity).
    pub rel: String,
    pub config: String,
    pub seed: u64,
    /// The metadata file's content, when there was one.
    pub meta: Option<serde_json::Value>,
}

/// Walk `root` and return every run folder, sorted by relative path.
pub fn find_runs(root: &Path, mapping: &IngestMapping) -> Result<Vec<FoundRun>, IoError> {
    if !root.is_dir() {
        return Err(IoError::invalid(root, "not a folder to ingest runs from"));
    }
    let mut out = Vec::new();
    for entry in walkdir::WalkDir::new(root).sort_by_file_name() {
        let entry = entry.map_err(|e| IoError::invalid(root, e.to_string()))?;
        if !entry.file_type().is_dir() {
            continue;
        }
        let dir = entry.path();
        let rel = dir
            .strip_prefix(root)
            .unwrap_or(dir)
            .to_string_lossy()
            .replace('\\', "/");
        let meta_path = dir.join(&mapping.meta_file);
        if meta_path.is_file() {
            out.push(from_meta(dir, &rel, &meta_path)?);
        } else if let Some(pat) = &mapping.path_pattern
            && let Some((config, seed)) = match_pattern(pat, &rel)
        {
            let seed = seed.parse().map_err(|_| {
                IoError::invalid(
                    dir,
                    format!("seed `{seed}` from path_pattern `{pat}` is not an integer"),
                )
            })?;
            out.push(FoundRun {
                path: dir.to_path_buf(),
                rel,
                config,
                seed,
                meta: None,
            });
        }
    }
    Ok(out)
}

fn from_meta(dir: &Path, rel: &str, meta_path: &Path) -> Result<FoundRun, IoError> {
    let text = std::fs::read_to_string(meta_path).map_err(|e| IoError::io(meta_path, e))?;
    let meta: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| IoError::invalid(meta_path, format!("not JSON: {e}")))?;
    let config = meta.get("config").and_then(|c| c.as_str()).ok_or_else(|| {
        IoError::invalid(meta_path, "needs a string `config` (and an integer `seed`)")
    })?;
    let seed = meta.get("seed").and_then(|s| s.as_u64()).ok_or_else(|| {
        IoError::invalid(meta_path, "needs an integer `seed` (and a string `config`)")
    })?;
    Ok(FoundRun {
        path: dir.to_path_buf(),
        rel: rel.to_string(),
        config: config.to_string(),
        seed,
        meta: Some(meta),
    })
}

/// Match a relative path against a pattern; returns (config, seed text) when it matches and
/// names both.
pub fn match_pattern(pattern: &str, rel: &str) -> Option<(String, String)> {
    let pats: Vec<&str> = pattern.split('/').filter(|s| !s.is_empty()).collect();
    let segs: Vec<&str> = rel.split('/').filter(|s| !s.is_empty()).collect();
    if pats.len() != segs.len() {
        return None;
    }
    let mut vals = Vec::new();
    for (p, s) in pats.iter().zip(&segs) {
        if *p != "*" && !match_segment(p, s, &mut vals) {
            return None;
        }
    }
    let get = |name: &str| vals.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
    Some((get("config")?, get("seed")?))
}

/// Match one folder name against `lit{name}lit{name}...`, backtracking over where each value
/// ends (values are non-empty; a `{seed}` value is digits only, which settles `{config}-s{seed}`).
fn match_segment(pat: &str, seg: &str, vals: &mut Vec<(String, String)>) -> bool {
    let Some(i) = pat.find('{') else {
        return pat == seg;
    };
    let Some(rest) = seg.strip_prefix(&pat[..i]) else {
        return false;
    };
    let Some(j) = pat[i..].find('}').map(|j| j + i) else {
        return false;
    };
    let (name, tail) = (&pat[i + 1..j], &pat[j + 1..]);
    for end in (1..=rest.len()).rev().filter(|e| rest.is_char_boundary(*e)) {
        let v = &rest[..end];
        if name == "seed" && !v.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let n = vals.len();
        vals.push((name.to_string(), v.to_string()));
        if match_segment(tail, &rest[end..], vals) {
            return true;
        }
        vals.truncate(n);
    }
    false
}

/// What an ingest did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IngestSummary {
    pub imported: usize,
    pub skipped: usize,
    /// Metric lines or values that could not be read, over all runs.
    pub skipped_lines: usize,
    /// Planned runs (suite ingest) not found in the tree, recorded as failed.
    pub missing: usize,
    /// Imported runs whose status is not `ok` or `diverged`.
    pub unfinished: usize,
    /// Run folders found in the tree that the suite does not plan (suite ingest), as
    /// `config seed N (path)`.
    pub ignored: Vec<String>,
}

/// A run folder whose manifest is complete (whatever status the run ended with).
fn already_imported(dest: &Path) -> bool {
    RunDir::open(dest)
        .read_manifest()
        .is_ok_and(|m| m.status != RunStatus::Running)
}

/// The status of an imported run: what its metadata says it was, what its metrics show, and
/// whether it reached the planned steps (when a suite plans them).
pub fn imported_status(
    meta: Option<&serde_json::Value>,
    read: &MetricsRead,
    steps_planned: Option<usize>,
) -> (RunStatus, Option<String>) {
    let said = meta.and_then(|m| m.get("status")).and_then(|s| s.as_str());
    match said {
        Some("running") => {
            return (
                RunStatus::Running,
                Some("still running when imported (metadata status `running`); import it again when it ends".into()),
            );
        }
        Some("failed") => {
            return (
                RunStatus::Failed,
                Some("the run's metadata says `failed`".into()),
            );
        }
        Some("timeout") => {
            return (
                RunStatus::Timeout,
                Some("the run's metadata says `timeout`".into()),
            );
        }
        _ => {}
    }
    if let Some((step, key)) = read.divergence() {
        return (
            RunStatus::Diverged,
            Some(format!("{key} is not finite at step {step}")),
        );
    }
    if said == Some("diverged") {
        return (
            RunStatus::Diverged,
            Some("the run's metadata says `diverged`".into()),
        );
    }
    if let Some(short) = read.shortfall(steps_planned) {
        return (RunStatus::Failed, Some(short));
    }
    (RunStatus::Ok, None)
}

/// One run ready to be written: its manifest and metrics.
struct Staged {
    run_id: String,
    manifest: Manifest,
    read: MetricsRead,
}

fn manifest_for(
    run_id: &str,
    suite: &str,
    found: &FoundRun,
    read: &MetricsRead,
    steps_planned: Option<usize>,
) -> Manifest {
    let config = serde_json::json!({
        "config": found.config,
        "source": found.path.display().to_string(),
        "meta": found.meta,
    });
    let steps = read.steps_reached();
    let mut m = Manifest::start(
        run_id,
        "ingest",
        config,
        found.seed,
        steps_planned.unwrap_or(steps),
        "external",
    );
    let (status, error) = imported_status(found.meta.as_ref(), read, steps_planned);
    m.suite = Some(suite.to_string());
    m.status = status;
    m.error = error;
    m.steps_done = steps;
    m.finished = Some(crate::store::run::now_utc());
    m.extra
        .insert("config_name".into(), found.config.clone().into());
    m.extra
        .insert("base_config".into(), found.config.clone().into());
    m.extra.insert(
        "ingested_from".into(),
        found.path.display().to_string().into(),
    );
    m.extra.insert("skipped_lines".into(), read.skipped.into());
    m.extra
        .insert("duplicate_values".into(), read.duplicates.into());
    m.extra
        .insert("rows_before_first_step".into(), read.before_first.into());
    m
}

/// Write every staged run into `suite_root`, all or nothing.
fn publish(suite_root: &Path, staged: &[Staged]) -> Result<(), IoError> {
    let names: Vec<String> = staged.iter().map(|s| s.run_id.clone()).collect();
    atomic::write_dirs(suite_root, &names, |i, dir| {
        let rd = RunDir::open(dir);
        rd.write_metrics(&staged[i].read.records)?;
        rd.write_manifest(&staged[i].manifest)
    })
}

/// Import every run under `root` into `<store>/<suite>/` (`lockstep ingest`).
pub fn ingest_tree(
    root: &Path,
    mapping: &IngestMapping,
    store: &Path,
    suite: &str,
    force: bool,
    mut on_run: impl FnMut(&FoundRun, &str, bool),
) -> Result<IngestSummary, IoError> {
    let suite_root = suite_dir(store, suite)?;
    let runs = find_runs(root, mapping)?;
    if runs.is_empty() {
        return Err(IoError::invalid(
            root,
            format!(
                "no run folders found: none holds `{}`{}",
                mapping.meta_file,
                mapping
                    .path_pattern
                    .as_ref()
                    .map(|p| format!(" or matches path_pattern `{p}`"))
                    .unwrap_or_else(|| {
                        "; set path_pattern (e.g. \"{config}/seed{seed}\") in the mapping".into()
                    })
            ),
        ));
    }
    // Read and check every run first: a tree with an unreadable run imports nothing.
    let mut summary = IngestSummary::default();
    let mut staged = Vec::new();
    let mut announced = Vec::new();
    for run in &runs {
        let read = read_metrics(&run.path, &mapping.metrics)
            .map_err(|e| IoError::invalid(&run.path, e))?;
        if read.records.is_empty() {
            return Err(IoError::invalid(
                &run.path,
                "no metric rows found; check [metrics] files and step in the mapping",
            ));
        }
        // Plain values only, which no upgrade adds fields to, so imported runs keep their ids.
        let identity =
            serde_json::to_string(&("ingest", &run.config, run.seed, &run.rel)).unwrap_or_default();
        let run_id = format_run_id(&run.config, run.seed, &identity);
        if !force && already_imported(&suite_root.join(&run_id)) {
            summary.skipped += 1;
            announced.push((run, run_id, false));
            continue;
        }
        let manifest = manifest_for(&run_id, suite, run, &read, None);
        summary.unfinished += usize::from(!matches!(
            manifest.status,
            RunStatus::Ok | RunStatus::Diverged
        ));
        summary.imported += 1;
        summary.skipped_lines += read.skipped;
        announced.push((run, run_id.clone(), true));
        staged.push(Staged {
            run_id,
            manifest,
            read,
        });
    }
    publish(&suite_root, &staged)?;
    for (run, id, new) in announced {
        on_run(run, &id, new);
    }
    Ok(summary)
}

/// Import an `engine = "ingest"` suite's planned runs from its tree (`lockstep run` of it): every
/// planned (configuration, seed) found is read and filed under the suite's run id; one not found
/// is recorded `failed`, so the comparison and the nightly say so. Re-reads every time.
pub fn ingest_suite(
    suite: &SuiteSpec,
    planned: &[RunSpec],
    store: &Path,
    mut on_run: impl FnMut(&RunSpec, &RunStatus, Option<&str>),
) -> Result<IngestSummary, IoError> {
    let mapping = suite.ingest.as_ref().ok_or_else(|| {
        IoError::invalid(&suite.path, "engine = \"ingest\" needs an [ingest] table")
    })?;
    let tree = relative_to(
        &suite.path,
        mapping.tree.as_deref().unwrap_or(Path::new(".")),
    );
    let suite_root = suite_dir(store, &suite.name)?;
    let found = find_runs(&tree, mapping)?;
    let mut summary = IngestSummary::default();
    for f in &found {
        if !planned
            .iter()
            .any(|p| p.config == f.config && p.seed == f.seed)
        {
            summary
                .ignored
                .push(format!("{} seed {} ({})", f.config, f.seed, f.rel));
        }
    }
    let mut staged = Vec::new();
    for p in planned {
        let mut matches = found
            .iter()
            .filter(|f| f.config == p.config && f.seed == p.seed);
        let (Some(f), second) = (matches.next(), matches.next()) else {
            let none = FoundRun {
                path: tree.clone(),
                rel: String::new(),
                config: p.config.clone(),
                seed: p.seed,
                meta: None,
            };
            let mut m = manifest_for(
                &p.run_id,
                &suite.name,
                &none,
                &MetricsRead::default(),
                Some(p.run.steps),
            );
            m.status = RunStatus::Failed;
            m.error = Some(format!(
                "not found in {}: no folder for config `{}` seed {} (check path_pattern or the meta file)",
                tree.display(),
                p.config,
                p.seed
            ));
            summary.missing += 1;
            staged.push(Staged {
                run_id: p.run_id.clone(),
                manifest: m,
                read: MetricsRead::default(),
            });
            continue;
        };
        if let Some(g) = second {
            return Err(IoError::invalid(
                &tree,
                format!(
                    "two run folders for config `{}` seed {}: `{}` and `{}`; keep one, or tell them apart in the metadata",
                    p.config, p.seed, f.rel, g.rel
                ),
            ));
        }
        let read =
            read_metrics(&f.path, &mapping.metrics).map_err(|e| IoError::invalid(&f.path, e))?;
        let mut m = manifest_for(&p.run_id, &suite.name, f, &read, Some(p.run.steps));
        m.extra.insert("base_config".into(), p.base.clone().into());
        m.extra.insert(
            "axes".into(),
            serde_json::to_value(&p.axes).unwrap_or_default(),
        );
        summary.unfinished += usize::from(!matches!(m.status, RunStatus::Ok | RunStatus::Diverged));
        summary.imported += 1;
        summary.skipped_lines += read.skipped;
        staged.push(Staged {
            run_id: p.run_id.clone(),
            manifest: m,
            read,
        });
    }
    publish(&suite_root, &staged)?;
    for (p, s) in planned.iter().zip(&staged) {
        on_run(p, &s.manifest.status, s.manifest.error.as_deref());
    }
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(p: &Path, text: &str) {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    fn mapping() -> IngestMapping {
        toml::from_str(
            r#"
path_pattern = "{config}/seed{seed}"
[metrics]
files = ["metrics.jsonl"]
[metrics.map]
"grad/global_norm" = "train/grad_norm"
"#,
        )
        .unwrap()
    }

    #[test]
    fn patterns_name_config_and_seed() {
        assert_eq!(
            match_pattern("{config}/seed{seed}", "nvfp4-dq/seed3"),
            Some(("nvfp4-dq".into(), "3".into()))
        );
        assert_eq!(
            match_pattern("*/{config}-s{seed}", "night1/bf16-s0"),
            Some(("bf16".into(), "0".into()))
        );
        assert_eq!(match_pattern("{config}/seed{seed}", "bf16"), None);
        assert_eq!(match_pattern("{config}/seed{seed}", "bf16/run0"), None);
        assert_eq!(match_pattern("{config}", "bf16"), None, "no seed");
        assert_eq!(
            match_pattern("{config}-s{seed}", "mxfp8-sweep-s12"),
            Some(("mxfp8-sweep".into(), "12".into()))
        );
        assert_eq!(match_pattern("{config}-s{seed}", "bf16-sx"), None);
    }

    #[test]
    fn a_tree_is_imported_once_with_names_mapped_and_junk_counted() {
        let tmp = tempfile::tempdir().unwrap();
        let tree = tmp.path().join("cluster");
        for (cfg, seed) in [("bf16", 0), ("bf16", 1), ("nvfp4-dq", 0)] {
            write(
                &tree.join(format!("{cfg}/seed{seed}/metrics.jsonl")),
                "{\"step\": 0, \"rollout/raw_reward\": 0.5, \"grad/global_norm\": 2}\n\
                 junk\n\
                 {\"step\": 1, \"rollout/raw_reward\": 0.625}\n",
            );
        }
        // A folder with a metadata file instead of a matching path.
        write(
            &tree.join("odd/place/lockstep-run.json"),
            r#"{"config": "mxfp8", "seed": 7, "status": "failed"}"#,
        );
        write(
            &tree.join("odd/place/metrics.jsonl"),
            "{\"step\": 0, \"rollout/raw_reward\": 0.25}\n",
        );
        let store = tmp.path().join("runs");
        let s = ingest_tree(&tree, &mapping(), &store, "imported", false, |_, _, _| {}).unwrap();
        assert_eq!(
            s,
            IngestSummary {
                imported: 4,
                skipped: 0,
                skipped_lines: 3,
                unfinished: 1,
                ..Default::default()
            }
        );
        let mut dirs: Vec<PathBuf> = std::fs::read_dir(store.join("imported"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        dirs.sort();
        assert_eq!(dirs.len(), 4);
        let rd = RunDir::open(&dirs[0]);
        let m = rd.read_manifest().unwrap();
        assert_eq!(m.extra["config_name"], "bf16");
        let recs = rd.read_scalars().unwrap();
        assert_eq!(recs[0].get("train/grad_norm"), Some(2.0));
        assert_eq!(recs[1].get("rollout/raw_reward"), Some(0.625));
        let failed = dirs
            .iter()
            .map(|d| RunDir::open(d).read_manifest().unwrap())
            .find(|m| m.seed == 7)
            .unwrap();
        assert_eq!(failed.status, RunStatus::Failed);
        // Again: nothing re-imported.
        let s = ingest_tree(&tree, &mapping(), &store, "imported", false, |_, _, _| {}).unwrap();
        assert_eq!((s.imported, s.skipped), (0, 4));
    }

    #[test]
    fn a_hostile_config_name_stays_inside_the_store() {
        let tmp = tempfile::tempdir().unwrap();
        let tree = tmp.path().join("t");
        write(
            &tree.join("r/lockstep-run.json"),
            r#"{"config": "../../etc/x", "seed": 0}"#,
        );
        write(&tree.join("r/metrics.jsonl"), "{\"step\": 0, \"a\": 1}\n");
        let store = tmp.path().join("runs");
        ingest_tree(&tree, &mapping(), &store, "s", false, |_, _, _| {}).unwrap();
        let entries: Vec<String> = std::fs::read_dir(store.join("s"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(entries.len(), 1);
        assert!(entries[0].starts_with("etc_x-s0-"), "{entries:?}");
        assert!(!tmp.path().join("etc").exists());
    }

    #[test]
    fn a_tree_imports_all_or_nothing_even_with_a_300_character_config_name() {
        let tmp = tempfile::tempdir().unwrap();
        let tree = tmp.path().join("t");
        for (i, name) in ["a", "b", &"x".repeat(300)].iter().enumerate() {
            write(
                &tree.join(format!("r{i}/lockstep-run.json")),
                &format!(r#"{{"config": "{name}", "seed": 0}}"#),
            );
            write(
                &tree.join(format!("r{i}/metrics.jsonl")),
                "{\"step\": 0, \"a\": 1}\n",
            );
        }
        // A fourth run that cannot be read: nothing of the tree is imported.
        write(
            &tree.join("r3/lockstep-run.json"),
            r#"{"config": "d", "seed": 0}"#,
        );
        write(&tree.join("r3/metrics.jsonl"), "junk only\n");
        let store = tmp.path().join("runs");
        assert!(ingest_tree(&tree, &mapping(), &store, "s", false, |_, _, _| {}).is_err());
        assert!(
            !store.join("s").exists() || std::fs::read_dir(store.join("s")).unwrap().count() == 0,
            "a bad tree imports nothing"
        );
        std::fs::remove_dir_all(tree.join("r3")).unwrap();
        let s = ingest_tree(&tree, &mapping(), &store, "s", false, |_, _, _| {}).unwrap();
        assert_eq!(s.imported, 3, "the long name gets a bounded run id");
        let longest = std::fs::read_dir(store.join("s"))
            .unwrap()
            .map(|e| e.unwrap().file_name().len())
            .max()
            .unwrap();
        assert!(longest < 128, "{longest}");
    }

    #[test]
    fn a_run_still_running_is_imported_unfinished() {
        let tmp = tempfile::tempdir().unwrap();
        let tree = tmp.path().join("t");
        write(
            &tree.join("r/lockstep-run.json"),
            r#"{"config": "a", "seed": 0, "status": "running"}"#,
        );
        write(&tree.join("r/metrics.jsonl"), "{\"step\": 0, \"a\": 1}\n");
        let store = tmp.path().join("runs");
        let s = ingest_tree(&tree, &mapping(), &store, "s", false, |_, _, _| {}).unwrap();
        assert_eq!((s.imported, s.unfinished), (1, 1));
        let d = std::fs::read_dir(store.join("s"))
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .path();
        assert_eq!(
            RunDir::open(&d).read_manifest().unwrap().status,
            RunStatus::Running
        );
    }

    #[test]
    fn bad_input_is_refused_with_the_file_named() {
        let tmp = tempfile::tempdir().unwrap();
        let tree = tmp.path().join("t");
        write(&tree.join("r/lockstep-run.json"), r#"{"seed": 0}"#);
        let err = ingest_tree(&tree, &mapping(), tmp.path(), "s", false, |_, _, _| {})
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("lockstep-run.json") && err.contains("config"),
            "{err}"
        );
        let p = tmp.path().join("m.toml");
        std::fs::write(&p, "path_patern = \"x\"\n").unwrap();
        let err = load_mapping(&p).unwrap_err().to_string();
        assert!(
            err.contains("m.toml") && err.contains("path_patern"),
            "{err}"
        );
        // Nothing matched at all.
        let empty = tmp.path().join("empty");
        std::fs::create_dir_all(&empty).unwrap();
        let err = ingest_tree(&empty, &mapping(), tmp.path(), "s", false, |_, _, _| {})
            .unwrap_err()
            .to_string();
        assert!(err.contains("no run folders"), "{err}");
    }
}

//! Reading the metrics files an external RL framework wrote (the command engine's `out/` folder, or
//! a run folder found by `ingest`), through a [`MetricsMapping`].
//!
//! The map goes **from the framework's name to lockstep's**: `"actor/grad_norm" = "train/grad_norm"`
//! files verl's global gradient norm where lockstep (and Miles, whose names it shares) keeps it.
//! Keys the map does not name are kept under their own name. `[layers]` patterns such as
//! `"grad_norm/layer_{layer}/{site}" = "grad_norm"` file per-layer values into `layers.parquet`,
//! where spikes are found exactly as for the built-in engine.
//!
//! Formats: JSON lines with a step key and numeric fields, the Miles CI form
//! `{"metric": NAME, "series": [[step, value], ...]}`, CSV with a header, TensorBoard event
//! files ([`super::tensorboard`], by the `.tfevents.` in their name) and W&B history (below).
//! Python's `json.dumps`
//! spellings `NaN`, `Infinity` and `-Infinity` (and CSV's `nan`, `inf`) are values, stored as
//! non-finite and raised as `non_finite` events, never dropped. A step may be written as `3` or
//! `3.0`. Junk lines, non-numeric values and lines past the limits below are skipped and counted,
//! never turned into zeros; a value given twice for one step keeps the last and is counted.
//!
//! **W&B history** is read with W&B's own rules: the step is W&B's `_step` unless `step` names
//! another key (a preset may: TRL and OpenRLHF chart against `train/global_step`); keys starting
//! with `_` (`_runtime`, `_timestamp`, `_wandb.runtime`) are W&B's bookkeeping, neither metrics nor
//! junk, unless `map` names one; nested values flatten with `.` (`perf.step_time`), as W&B's app
//! and API show them; media and histograms (objects with a `_type`) are passed over; `null` (what
//! pandas writes for a step where a key was not logged) is no value. Sources, by file: a run's
//! transaction log `run-<id>.wandb` ([`super::wandb`]), the `wandb-history.jsonl` of older
//! clients, JSON lines of `api.run(...).scan_history()` rows (`source = "wandb"`), and the CSV the
//! app exports from a panel (`Step`, `<run> - <key>`, `<run> - <key>__MIN`/`__MAX`: the run prefix
//! is stripped, the min/max band columns are not metrics, and an export holding several runs is
//! refused). `wandb-summary.json` (the last value of each key) is refused: it is no history.
//!
//! Only regular files are read (a FIFO or a device named `metrics.jsonl` is refused, not waited
//! on), at most [`MAX_FILE_BYTES`] each.

use crate::engine::metrics::{Event, LayerRecord, StepRecord};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

/// Largest metrics file read (a long run logging per-layer norms stays far below it).
pub const MAX_FILE_BYTES: u64 = 1 << 30;
/// Longest JSON line parsed; longer lines are skipped and counted.
pub const MAX_LINE_BYTES: usize = 4 << 20;
/// Most keys (or series points) read from one line or CSV row; a longer one is skipped and counted.
pub const MAX_KEYS_PER_LINE: usize = 100_000;

/// `[command.metrics]` in a suite, `[metrics]` in an ingest mapping.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsMapping {
    /// Files to read, relative to the run's output folder; `*` and `?` match within a name
    /// (`tb/events.out.tfevents.*`), `**` across folders.
    #[serde(default = "default_files")]
    pub files: Vec<String>,
    /// TensorBoard event files and W&B transaction logs: keep the records before a truncated or
    /// corrupt one (a job killed mid-write, or still writing) instead of failing the read; the cut
    /// is counted as one skipped line.
    #[serde(default)]
    pub keep_partial_events: bool,
    /// How to read files whose name does not say: `auto` (the default: by name and content) or
    /// `wandb` (W&B history rows, e.g. `scan_history()` dumped as JSON lines, or an app export).
    #[serde(default)]
    pub source: Source,
    /// The key (JSON) or column (CSV) holding the step. Default `step`; for W&B history `_step`
    /// (`Step` in the app's CSV export), or the preset's W&B step key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<String>,
    /// The framework's names ([`super::frameworks`]): `miles`, `verl`, `nemo-rl`, `trl` or
    /// `openrlhf`. `map` entries extend and override it key by key, `first_step` overrides its
    /// first step.
    #[serde(default)]
    pub preset: Option<String>,
    /// The first step the framework logs: 1 for TRL, verl, NeMo-RL and OpenRLHF, whose steps are
    /// 1-based (their presets say so). It is stored as step 0; rows logged before it (verl's
    /// validation at 0) are skipped and counted.
    #[serde(default)]
    pub first_step: Option<u64>,
    /// Framework key → lockstep key.
    #[serde(default)]
    pub map: BTreeMap<String, String>,
    /// Framework key pattern (with `{layer}` and optionally `{site}`) → per-layer field
    /// (`grad_norm`, `saturated` or `underflowed`).
    #[serde(default)]
    pub layers: BTreeMap<String, String>,
}

fn default_files() -> Vec<String> {
    vec!["metrics.jsonl".to_string()]
}

/// Where metrics come from when a file's name does not say (`[metrics] source`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    /// By the file: `.csv` (a W&B panel export by its `<run> - <key>` columns), `.tfevents.`,
    /// `run-*.wandb` and `wandb-history.jsonl` (W&B); anything else is JSON lines.
    #[default]
    Auto,
    /// W&B history whatever the name: JSON lines of history rows or a CSV export.
    Wandb,
}

impl Default for MetricsMapping {
    fn default() -> Self {
        MetricsMapping {
            files: default_files(),
            keep_partial_events: false,
            source: Source::Auto,
            step: None,
            preset: None,
            first_step: None,
            map: BTreeMap::new(),
            layers: BTreeMap::new(),
        }
    }
}

/// Per-layer fields a `[layers]` pattern can fill.
pub const LAYER_FIELDS: [&str; 3] = ["grad_norm", "saturated", "underflowed"];

/// Miles metric names and the lockstep keys they map to (identity where lockstep uses the same
/// name, which is the point: curves from a cluster and from the built-in engine line up).
pub const MILES_MAPPING: [(&str, &str); 16] = [
    ("rollout/raw_reward", "rollout/raw_reward"),
    ("rollout/rewards", "rollout/rewards"),
    ("rollout/response_len/mean", "rollout/response_len/mean"),
    ("rollout/truncated_ratio", "rollout/truncated_ratio"),
    (
        "train/train_rollout_logprob_abs_diff",
        "train/train_rollout_logprob_abs_diff",
    ),
    ("train/train_rollout_kl", "train/train_rollout_kl"),
    ("train/ppo_kl", "train/ppo_kl"),
    ("train/pg_clipfrac", "train/pg_clipfrac"),
    ("train/tis", "train/tis"),
    ("train/tis_clipfrac", "train/tis_clipfrac"),
    ("train/kl_loss", "train/kl_loss"),
    ("train/grad_norm", "train/grad_norm"),
    ("perf/rollout_time", "perf/rollout_time"),
    ("perf/train_time", "perf/train_time"),
    ("perf/step_time", "perf/step_time"),
    ("perf/log_probs_time", "perf/log_probs_time"),
];

impl MetricsMapping {
    /// Everything `suite check` can know about the mapping without reading a file; the message
    /// is one line even when a name in the mapping holds a newline.
    pub fn validate(&self) -> Result<(), String> {
        self.check_names()
            .map_err(|e| crate::recipe::escape_controls(&e))
    }

    fn check_names(&self) -> Result<(), String> {
        if let Some(p) = &self.preset {
            super::frameworks::preset(p)?;
        }
        if self.files.is_empty() {
            return Err(
                "metrics `files` is empty: name at least one, e.g. files = [\"metrics.jsonl\"]"
                    .into(),
            );
        }
        for f in &self.files {
            crate::suite::runner::safe_relative(f)
                .map_err(|why| format!("metrics file `{f}`: {why}"))?;
            if f.contains(['*', '?']) {
                globset::Glob::new(f).map_err(|e| format!("metrics file pattern `{f}`: {e}"))?;
            }
        }
        if self.step.as_ref().is_some_and(String::is_empty) {
            return Err("metrics `step` is empty: name the step key, e.g. step = \"step\"".into());
        }
        for (from, to) in &self.map {
            if to.is_empty() || from.is_empty() {
                return Err(format!(
                    "metrics map `{from}` = `{to}`: both names must be non-empty (framework key = lockstep key)"
                ));
            }
        }
        for (pat, field) in &self.layers {
            LayerPattern::parse(pat)?;
            if !LAYER_FIELDS.contains(&field.as_str()) {
                return Err(format!(
                    "metrics layers `{pat}` = `{field}`: the value names a per-layer field, one of {}",
                    LAYER_FIELDS.join(", ")
                ));
            }
        }
        Ok(())
    }

    fn preset(&self) -> Option<&'static super::frameworks::Preset> {
        self.preset
            .as_deref()
            .and_then(|p| super::frameworks::preset(p).ok())
    }

    /// The step stored as 0: `first_step`, else the preset's, else 0.
    pub fn first_step(&self) -> u64 {
        self.first_step
            .or(self.preset().map(|p| p.first_step))
            .unwrap_or(0)
    }

    /// The step keys to look for, first found wins: the mapping's `step`, else for W&B history
    /// the preset's W&B step key, then `_step` (and the app export's `Step`), else `step`.
    fn step_keys(&self, wandb: bool) -> Vec<&str> {
        match (&self.step, wandb) {
            (Some(s), _) => vec![s.as_str()],
            (None, true) => self
                .preset()
                .and_then(|p| p.wandb_step)
                .into_iter()
                .chain(["_step", "Step"])
                .collect(),
            (None, false) => vec!["step"],
        }
    }

    /// The lockstep key a framework key is stored under: the suite's map, then the preset, then
    /// Miles' names (lockstep's own), else the key itself.
    fn target<'a>(&'a self, key: &'a str) -> &'a str {
        if let Some(t) = self.map.get(key) {
            return t;
        }
        let preset = self.preset().map_or(&[][..], |p| p.map);
        preset
            .iter()
            .chain(MILES_MAPPING.iter())
            .find(|(a, _)| *a == key)
            .map_or(key, |(_, b)| b)
    }
}

/// A `[layers]` pattern: literal text with one `{layer}` (an integer) and at most one `{site}`.
#[derive(Debug, Clone, PartialEq)]
struct LayerPattern {
    parts: Vec<Part>,
}

#[derive(Debug, Clone, PartialEq)]
enum Part {
    Lit(String),
    Layer,
    Site,
}

impl LayerPattern {
    fn parse(pat: &str) -> Result<LayerPattern, String> {
        let bad = |why: &str| format!("metrics layers pattern `{pat}`: {why}");
        let mut parts = Vec::new();
        let mut rest = pat;
        while let Some(i) = rest.find('{') {
            if i > 0 {
                parts.push(Part::Lit(rest[..i].to_string()));
            }
            let j = rest[i..].find('}').ok_or_else(|| bad("unclosed `{`"))? + i;
            parts.push(match &rest[i + 1..j] {
                "layer" => Part::Layer,
                "site" => Part::Site,
                other => {
                    return Err(bad(&format!(
                        "unknown placeholder `{{{other}}}`; use {{layer}} and {{site}}"
                    )));
                }
            });
            rest = &rest[j + 1..];
        }
        if !rest.is_empty() {
            parts.push(Part::Lit(rest.to_string()));
        }
        let count = |p: &Part| parts.iter().filter(|x| *x == p).count();
        if count(&Part::Layer) != 1 || count(&Part::Site) > 1 {
            return Err(bad("needs exactly one {layer} and at most one {site}"));
        }
        if parts
            .windows(2)
            .any(|w| !matches!(w[0], Part::Lit(_)) && !matches!(w[1], Part::Lit(_)))
        {
            return Err(bad("put literal text between {layer} and {site}"));
        }
        Ok(LayerPattern { parts })
    }

    /// (site, layer) when `key` matches. The site is `all` when the pattern has no `{site}`.
    fn matches(&self, key: &str) -> Option<(String, i64)> {
        let mut site = None;
        let mut layer = None;
        self.match_from(0, key, &mut site, &mut layer).then(|| {
            (
                site.unwrap_or_else(|| "all".to_string()),
                layer.unwrap_or(0),
            )
        })
    }

    fn match_from(
        &self,
        i: usize,
        s: &str,
        site: &mut Option<String>,
        layer: &mut Option<i64>,
    ) -> bool {
        let Some(part) = self.parts.get(i) else {
            return s.is_empty();
        };
        match part {
            Part::Lit(l) => s
                .strip_prefix(l.as_str())
                .is_some_and(|r| self.match_from(i + 1, r, site, layer)),
            Part::Layer => {
                let digits = s
                    .char_indices()
                    .take_while(|(k, c)| c.is_ascii_digit() || (*k == 0 && *c == '-'))
                    .count();
                match s[..digits].parse::<i64>() {
                    Ok(v) => {
                        *layer = Some(v);
                        self.match_from(i + 1, &s[digits..], site, layer)
                    }
                    Err(_) => false,
                }
            }
            Part::Site => {
                // Non-empty; the literal that follows decides where it ends (longest first).
                for end in (1..=s.len()).rev().filter(|e| s.is_char_boundary(*e)) {
                    if self.match_from(i + 1, &s[end..], site, layer) {
                        *site = Some(s[..end].to_string());
                        return true;
                    }
                }
                false
            }
        }
    }
}

/// What reading a run's metrics found.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MetricsRead {
    /// One record per logged step, in step order, with per-layer rows and `non_finite` events.
    pub records: Vec<StepRecord>,
    /// Lines or values that could not be read.
    pub skipped: usize,
    /// Values given twice for one step and key (the last is kept).
    pub duplicates: usize,
    /// Rows logged before `first_step` (skipped).
    pub before_first: usize,
    /// Files the mapping names that do not exist.
    pub missing: Vec<String>,
}

impl MetricsRead {
    /// Steps reached: the last logged step + 1 (0 when nothing was logged).
    pub fn steps_reached(&self) -> usize {
        self.records.last().map_or(0, |r| r.step + 1)
    }

    /// Why the metrics do not cover a finished run, if they do not: a mapped file was not written,
    /// no row was read, or the steps stop short of `steps_planned`.
    pub fn shortfall(&self, steps_planned: Option<usize>) -> Option<String> {
        if !self.missing.is_empty() {
            let files: Vec<String> = self.missing.iter().map(|f| format!("`{f}`")).collect();
            return Some(format!(
                "the metrics file(s) {} were not written; check [metrics] files against what the run writes",
                files.join(", ")
            ));
        }
        if self.records.is_empty() {
            return Some(format!(
                "no metric rows were read ({} lines skipped); check the metrics `step` key and the file format",
                self.skipped
            ));
        }
        let reached = self.steps_reached();
        steps_planned
            .filter(|n| reached < *n)
            .map(|n| format!("{reached} of {n} planned steps logged"))
    }

    /// The first non-finite value of a metric that ends a run (reward, loss, gradient norm), as
    /// (step, key).
    pub fn divergence(&self) -> Option<(usize, String)> {
        self.records.iter().find_map(|r| {
            r.events
                .iter()
                .find(|e| e.kind == "non_finite" && e.layer < 0 && ends_a_run(&e.site))
                .map(|e| (r.step, e.site.clone()))
        })
    }
}

/// Metrics whose non-finite value means the run diverged (the built-in engine stops on them).
pub fn ends_a_run(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    k.contains("reward") || k.ends_with("loss") || k.ends_with("grad_norm")
}

/// Accumulates values by step before they become records.
#[derive(Default)]
struct Steps {
    by_step: BTreeMap<u64, StepValues>,
    skipped: usize,
    duplicates: usize,
    before_first: usize,
}

#[derive(Default)]
struct StepValues {
    scalars: BTreeMap<String, f64>,
    layers: BTreeMap<(String, i64), [Option<f64>; 3]>,
}

struct Reader<'a> {
    mapping: &'a MetricsMapping,
    first_step: u64,
    patterns: Vec<(LayerPattern, usize)>,
}

impl Reader<'_> {
    fn put(&self, acc: &mut Steps, step: u64, key: &str, v: f64) {
        let Some(step) = step.checked_sub(self.first_step) else {
            acc.before_first += 1;
            return;
        };
        let at = acc.by_step.entry(step).or_default();
        for (pat, field) in &self.patterns {
            if let Some((site, layer)) = pat.matches(key) {
                let slot = &mut at.layers.entry((site, layer)).or_default()[*field];
                acc.duplicates += usize::from(slot.is_some());
                *slot = Some(v);
                return;
            }
        }
        let target = self.mapping.target(key).to_string();
        if at.scalars.insert(target, v).is_some() {
            acc.duplicates += 1;
        }
    }
}

/// Read every metrics file the mapping names under `root`. Missing files are listed (the caller
/// decides whether that fails the run); a file that cannot be read safely is an error naming it.
pub fn read_metrics(root: &Path, mapping: &MetricsMapping) -> Result<MetricsRead, String> {
    mapping.validate()?;
    let reader = Reader {
        mapping,
        first_step: mapping.first_step(),
        patterns: mapping
            .layers
            .iter()
            .filter_map(|(p, f)| {
                let field = LAYER_FIELDS.iter().position(|x| x == f)?;
                Some((LayerPattern::parse(p).ok()?, field))
            })
            .collect(),
    };
    let mut acc = Steps::default();
    let mut missing = Vec::new();
    for pattern in &mapping.files {
        let names = expand_files(root, pattern);
        if names.is_empty() {
            missing.push(pattern.clone());
        }
        for f in names {
            let path = root.join(&f);
            let Some(bytes) = read_capped(&path)? else {
                missing.push(f.clone());
                continue;
            };
            let at = |e: String| format!("{}: {e}", path.display());
            let name = f.rsplit('/').next().unwrap_or(&f);
            let wandb = mapping.source == Source::Wandb;
            if name == "wandb-summary.json" {
                return Err(at(
                    "a W&B summary holds only each key's last value, not its history; read the run's transaction log (files = [\"wandb/*/run-*.wandb\"]) or a history export".into(),
                ));
            } else if f.ends_with(".csv") {
                read_csv(&bytes, &reader, &mut acc, wandb).map_err(at)?;
            } else if f.contains(".tfevents.") {
                read_tfevents(&bytes, &reader, &mut acc, mapping.keep_partial_events)
                    .map_err(at)?;
            } else if f.ends_with(".wandb") {
                read_wandb_log(&bytes, &reader, &mut acc, mapping.keep_partial_events)
                    .map_err(at)?;
            } else {
                let lines: Vec<_> = json_lines(&bytes).collect();
                if wandb || name == "wandb-history.jsonl" || looks_like_wandb(mapping, &lines) {
                    read_wandb_jsonl(lines, &reader, &mut acc);
                } else {
                    read_jsonl(lines, &reader, &mut acc);
                }
            }
        }
    }
    Ok(MetricsRead {
        records: into_records(acc.by_step),
        skipped: acc.skipped,
        duplicates: acc.duplicates,
        before_first: acc.before_first,
        missing,
    })
}

/// Most files a glob in `files` is matched against (a run's output folder, not a file system).
const MAX_GLOB_WALK: usize = 10_000;

/// The files under `root` a `files` entry names: itself when it has no `*` or `?`, else every
/// regular file whose path relative to `root` matches, sorted.
fn expand_files(root: &Path, pattern: &str) -> Vec<String> {
    if !pattern.contains(['*', '?']) {
        return vec![pattern.to_string()];
    }
    let Ok(glob) = globset::GlobBuilder::new(pattern)
        .literal_separator(true)
        .build()
    else {
        return Vec::new();
    };
    let m = glob.compile_matcher();
    let mut out: Vec<String> = walkdir::WalkDir::new(root)
        .into_iter()
        .take(MAX_GLOB_WALK)
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().is_file())
        .filter_map(|e| {
            let rel = e
                .path()
                .strip_prefix(root)
                .ok()?
                .to_string_lossy()
                .replace('\\', "/");
            m.is_match(&rel).then_some(rel)
        })
        .collect();
    out.sort();
    out
}

fn read_tfevents(
    bytes: &[u8],
    r: &Reader<'_>,
    acc: &mut Steps,
    keep_partial: bool,
) -> Result<(), String> {
    let f = super::tensorboard::read(bytes, keep_partial)?;
    for s in f.scalars {
        r.put(acc, s.step, &s.tag, s.value);
    }
    acc.skipped += f.skipped + usize::from(f.stopped.is_some());
    Ok(())
}

/// Every metric key logged in the `.jsonl`, `.csv`, TensorBoard and W&B files under `dir` (at
/// most 1,000 files, read with the default step key and no map), for `lockstep ingest --detect`.
pub fn keys_under(dir: &Path) -> Result<std::collections::BTreeSet<String>, String> {
    let mut keys = std::collections::BTreeSet::new();
    let files = walkdir::WalkDir::new(dir)
        .sort_by_file_name()
        .into_iter()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().is_file())
        .filter(|e| {
            let n = e.file_name().to_string_lossy();
            n.ends_with(".jsonl")
                || n.ends_with(".csv")
                || n.contains(".tfevents.")
                || n.ends_with(".wandb")
        })
        .take(1000);
    for f in files {
        let (Some(parent), Some(name)) = (f.path().parent(), f.path().file_name()) else {
            continue;
        };
        let m = MetricsMapping {
            files: vec![name.to_string_lossy().into_owned()],
            ..MetricsMapping::default()
        };
        for r in read_metrics(parent, &m)?.records {
            keys.extend(r.scalars.into_keys());
        }
    }
    Ok(keys)
}

/// A regular file's bytes (`None` when it does not exist). FIFOs, devices and sockets are refused
/// before they are opened, and the file is opened non-blocking, so neither a FIFO swapped in
/// meanwhile nor `/dev/zero` can hang or exhaust the reader.
fn read_capped(path: &Path) -> Result<Option<Vec<u8>>, String> {
    let show = || path.display().to_string();
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("{}: {e}", show())),
    };
    let not_regular = || {
        format!(
            "{}: not a regular file (a FIFO, device or folder); metrics files must be plain files",
            show()
        )
    };
    if !meta.is_file() {
        return Err(not_regular());
    }
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::custom_flags(&mut opts, libc_nonblock());
    let file = opts.open(path).map_err(|e| format!("{}: {e}", show()))?;
    if !file
        .metadata()
        .map_err(|e| format!("{}: {e}", show()))?
        .is_file()
    {
        return Err(not_regular());
    }
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("{}: {e}", show()))?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(format!(
            "{}: larger than {} GiB; point `files` at the metrics, not at a checkpoint or log dump",
            show(),
            MAX_FILE_BYTES >> 30
        ));
    }
    Ok(Some(bytes))
}

#[cfg(unix)]
fn libc_nonblock() -> i32 {
    // O_NONBLOCK: the same value on Linux for every architecture lockstep builds for.
    0o4000
}

fn into_records(by_step: BTreeMap<u64, StepValues>) -> Vec<StepRecord> {
    by_step
        .into_iter()
        .map(|(step, v)| {
            let step = step as usize;
            let mut events = Vec::new();
            for (k, x) in v.scalars.iter().filter(|(_, x)| !x.is_finite()) {
                events.push(non_finite(step, k, -1, *x));
            }
            let layers: Vec<LayerRecord> = v
                .layers
                .into_iter()
                .map(|((site, layer), [g, sat, under])| {
                    let grad_norm = g.unwrap_or(f64::NAN);
                    if g.is_some_and(|g| !g.is_finite()) {
                        events.push(non_finite(step, &site, layer, grad_norm));
                    }
                    let count = |x: Option<f64>| {
                        x.filter(|x| x.is_finite() && *x >= 0.0)
                            .map_or(0, |x| x as u64)
                    };
                    LayerRecord {
                        step,
                        site,
                        layer,
                        precision: "external".into(),
                        grad_norm,
                        saturated: count(sat),
                        underflowed: count(under),
                    }
                })
                .collect();
            StepRecord {
                step,
                scalars: v.scalars,
                layers,
                events,
            }
        })
        .collect()
}

fn non_finite(step: usize, key: &str, layer: i64, value: f64) -> Event {
    Event {
        step,
        kind: "non_finite".into(),
        site: key.to_string(),
        layer,
        value,
        detail: format!("{key} logged as {value}"),
    }
}

/// Python's non-standard JSON tokens, swapped for strings starting with the control character
/// U+0001 (written as the escape `\u0001`; no metrics logger writes such a string), then read
/// back as numbers: (token, JSON text put in its place, the string it parses to, the value).
const NONFINITE_TOKENS: [(&str, &str, &str, f64); 3] = [
    (
        "-Infinity",
        "\"\\u0001-inf\"",
        "\u{1}-inf",
        f64::NEG_INFINITY,
    ),
    ("Infinity", "\"\\u0001inf\"", "\u{1}inf", f64::INFINITY),
    ("NaN", "\"\\u0001nan\"", "\u{1}nan", f64::NAN),
];

/// The line with `NaN`, `Infinity` and `-Infinity` outside strings made parseable.
fn with_nonfinite_tokens(line: &str) -> std::borrow::Cow<'_, str> {
    if !(line.contains("NaN") || line.contains("Infinity")) {
        return std::borrow::Cow::Borrowed(line);
    }
    let mut out = String::with_capacity(line.len() + 16);
    let (mut in_string, mut escaped) = (false, false);
    let mut rest = line;
    while let Some(c) = rest.chars().next() {
        if in_string {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
        } else if c == '"' {
            in_string = true;
        } else if let Some((tok, rep, _, _)) = NONFINITE_TOKENS
            .iter()
            .find(|(t, _, _, _)| rest.starts_with(t))
        {
            out.push_str(rep);
            rest = &rest[tok.len()..];
            continue;
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    std::borrow::Cow::Owned(out)
}

/// A JSON value as a metric value: numbers and the non-finite stand-ins.
fn number(v: &serde_json::Value) -> Option<f64> {
    match v {
        serde_json::Value::Number(n) => n.as_f64(),
        serde_json::Value::String(s) => NONFINITE_TOKENS
            .iter()
            .find(|(_, _, parsed, _)| parsed == s)
            .map(|(_, _, _, x)| *x),
        _ => None,
    }
}

/// A step: a non-negative integer, written as `3` or `3.0`.
fn step_number(v: &serde_json::Value) -> Option<u64> {
    v.as_u64().or_else(|| {
        v.as_f64()
            .filter(|x| x.is_finite() && *x >= 0.0 && x.fract() == 0.0 && *x < 2f64.powi(53))
            .map(|x| x as u64)
    })
}

/// The JSON objects of a JSON-lines file, one per non-blank line; `None` for a line that is not
/// one (not UTF-8, not JSON, not an object, longer than [`MAX_LINE_BYTES`] or with more than
/// [`MAX_KEYS_PER_LINE`] keys).
fn json_lines(bytes: &[u8]) -> impl Iterator<Item = Option<JsonObject>> + '_ {
    bytes
        .split(|b| *b == b'\n')
        .filter(|line| !line.iter().all(u8::is_ascii_whitespace))
        .map(|line| {
            let parsed = (line.len() <= MAX_LINE_BYTES)
                .then(|| std::str::from_utf8(line).ok())
                .flatten()
                .and_then(|l| {
                    serde_json::from_str::<serde_json::Value>(&with_nonfinite_tokens(l)).ok()
                });
            match parsed {
                Some(serde_json::Value::Object(o)) if o.len() <= MAX_KEYS_PER_LINE => Some(o),
                _ => None,
            }
        })
}

/// JSON lines that are W&B history rows: with no `step` set, rows with W&B's `_step` and none
/// with `step`.
fn looks_like_wandb(mapping: &MetricsMapping, lines: &[Option<JsonObject>]) -> bool {
    let any = |k: &str| lines.iter().flatten().any(|o| o.contains_key(k));
    mapping.step.is_none() && any("_step") && !any("step")
}

type JsonObject = serde_json::Map<String, serde_json::Value>;

fn read_jsonl(lines: Vec<Option<JsonObject>>, r: &Reader<'_>, acc: &mut Steps) {
    let step_key = r.mapping.step_keys(false)[0];
    for o in lines {
        let Some(o) = o else {
            acc.skipped += 1;
            continue;
        };
        if let (Some(name), Some(series)) = (
            o.get("metric").and_then(|m| m.as_str()),
            o.get("series").and_then(|s| s.as_array()),
        ) {
            for pt in series.iter().take(MAX_KEYS_PER_LINE) {
                let p = pt.as_array();
                let step = p.and_then(|p| p.first()).and_then(step_number);
                let v = p.and_then(|p| p.get(1)).and_then(number);
                match (step, v) {
                    (Some(s), Some(v)) => r.put(acc, s, name, v),
                    _ => acc.skipped += 1,
                }
            }
            acc.skipped += series.len().saturating_sub(MAX_KEYS_PER_LINE);
            continue;
        }
        let Some(step) = o.get(step_key).and_then(step_number) else {
            acc.skipped += 1;
            continue;
        };
        for (k, v) in o.iter().filter(|(k, _)| *k != step_key) {
            match number(v) {
                Some(x) => r.put(acc, step, k, x),
                None => acc.skipped += 1,
            }
        }
    }
}

/// A W&B history row flattened as W&B shows it: nested objects joined with `.`, media and
/// histograms (objects with a `_type`) left out.
type WandbRow = Vec<(String, serde_json::Value)>;

/// Leave out of a flattened row the media and histograms that arrived as separate items (the
/// transaction log stores `weights` as `weights._type`, `weights.values`, `weights.bins`).
fn drop_wandb_media(row: &mut WandbRow) {
    let media: Vec<String> = row
        .iter()
        .filter_map(|(k, _)| k.strip_suffix("._type").map(|p| format!("{p}.")))
        .collect();
    if !media.is_empty() {
        row.retain(|(k, _)| !media.iter().any(|m| k.starts_with(m.as_str())));
    }
}

/// W&B's bookkeeping: a key with a part starting with `_` (`_runtime`, `_wandb.runtime`).
fn wandb_bookkeeping(key: &str) -> bool {
    key.split('.').any(|part| part.starts_with('_'))
}

fn flatten_wandb(key: String, v: serde_json::Value, out: &mut WandbRow) {
    match v {
        serde_json::Value::Object(o) if o.contains_key("_type") => {} // an image, histogram, table
        serde_json::Value::Object(o) => {
            for (k, x) in o {
                flatten_wandb(format!("{key}.{k}"), x, out);
            }
        }
        v => out.push((key, v)),
    }
}

impl Reader<'_> {
    /// The step key of a W&B file: the first of [`MetricsMapping::step_keys`] that any row has.
    fn wandb_step_key(&self, has: impl Fn(&str) -> bool) -> &str {
        let keys = self.mapping.step_keys(true);
        keys.iter().copied().find(|k| has(k)).unwrap_or(keys[0])
    }

    /// One W&B history row: W&B's bookkeeping keys (`_runtime`, `_timestamp`, `_wandb.*`) pass
    /// over unless the map names them, `null` is no value, other non-numbers are counted.
    fn put_wandb_row(&self, acc: &mut Steps, step_key: &str, row: &WandbRow) {
        if row.len() > MAX_KEYS_PER_LINE {
            acc.skipped += 1;
            return;
        }
        let Some(step) = row
            .iter()
            .find(|(k, _)| k == step_key)
            .and_then(|(_, v)| step_number(v))
        else {
            acc.skipped += 1;
            return;
        };
        for (k, v) in row {
            if k == step_key
                || v.is_null()
                || (wandb_bookkeeping(k) && !self.mapping.map.contains_key(k))
            {
                continue;
            }
            match number(v) {
                Some(x) => self.put(acc, step, k, x),
                None => acc.skipped += 1,
            }
        }
    }

    fn put_wandb_rows(&self, acc: &mut Steps, rows: &[WandbRow]) {
        let step_key = self.wandb_step_key(|k| rows.iter().any(|r| r.iter().any(|(x, _)| x == k)));
        for row in rows {
            self.put_wandb_row(acc, step_key, row);
        }
    }
}

/// W&B history as JSON lines: `wandb-history.jsonl`, or `scan_history()` rows written with
/// `json.dumps` (which keeps NaN; pandas' `to_json` writes it as `null`, the same as "not logged").
fn read_wandb_jsonl(lines: Vec<Option<JsonObject>>, r: &Reader<'_>, acc: &mut Steps) {
    let mut rows = Vec::new();
    for o in lines {
        let Some(o) = o else {
            acc.skipped += 1;
            continue;
        };
        let mut row = WandbRow::new();
        for (k, v) in o {
            flatten_wandb(k, v, &mut row);
        }
        drop_wandb_media(&mut row);
        rows.push(row);
    }
    r.put_wandb_rows(acc, &rows);
}

/// A W&B run's transaction log (`run-<id>.wandb`).
fn read_wandb_log(
    bytes: &[u8],
    r: &Reader<'_>,
    acc: &mut Steps,
    keep_partial: bool,
) -> Result<(), String> {
    let log = super::wandb::read(bytes, keep_partial)?;
    let mut rows = Vec::with_capacity(log.rows.len());
    for h in log.rows {
        let mut row = WandbRow::new();
        for (k, json) in h.items {
            match serde_json::from_str(&with_nonfinite_tokens(&json)) {
                Ok(v) => flatten_wandb(k, v, &mut row),
                Err(_) => acc.skipped += 1,
            }
        }
        drop_wandb_media(&mut row);
        if !row.iter().any(|(k, _)| k == "_step") {
            row.push(("_step".into(), serde_json::json!(h.step)));
        }
        rows.push(row);
    }
    r.put_wandb_rows(acc, &rows);
    acc.skipped += usize::from(log.stopped.is_some());
    Ok(())
}

/// The app's band columns beside each metric of a panel export.
const WANDB_BANDS: [&str; 2] = ["__MIN", "__MAX"];

/// Whether a CSV header is W&B's: a panel export (the x-axis column, `Step` or the panel's own
/// x-axis key, then only `<run> - <key>` columns), or a history table with W&B's `_step` and no
/// `step` (`run.history().to_csv()`, whose first, unnamed column is pandas' index).
fn is_wandb_export(headers: &csv::StringRecord) -> bool {
    let panel = headers.len() > 1 && headers.iter().skip(1).all(|h| h.contains(" - "));
    let history = headers.iter().any(|h| h == "_step") && !headers.iter().any(|h| h == "step");
    panel || history
}

/// The metric key of each column of a W&B CSV (`None`: a min/max band, not a metric), with the
/// run prefix stripped: the longest `<run> - ` that every `... - ...` column starts with. Columns
/// of several runs are refused (lockstep reads one run per file).
fn wandb_columns(headers: &csv::StringRecord) -> Result<Vec<Option<String>>, String> {
    let values: Vec<&str> = headers
        .iter()
        .filter(|h| !WANDB_BANDS.iter().any(|b| h.ends_with(b)) && h.contains(" - "))
        .collect();
    let prefix = values.first().and_then(|first| {
        first
            .match_indices(" - ")
            .map(|(i, _)| &first[..i + 3])
            .filter(|p| values.iter().all(|h| h.starts_with(p) && h.len() > p.len()))
            .last()
    });
    if prefix.is_none() && !values.is_empty() {
        let mut runs: Vec<String> = values
            .iter()
            .filter_map(|h| {
                h.split_once(" - ")
                    .map(|(run, _)| run.escape_debug().to_string())
            })
            .collect();
        runs.sort_unstable();
        runs.dedup();
        let n = runs.len();
        runs.truncate(3);
        return Err(format!(
            "this W&B export holds {n} runs ({}); export each run on its own (hide the others in the panel), one file per run",
            runs.join(", ")
        ));
    }
    Ok(headers
        .iter()
        .map(|h| {
            let band = WANDB_BANDS.iter().any(|b| h.ends_with(b));
            let key = prefix.and_then(|p| h.strip_prefix(p)).unwrap_or(h);
            (!band).then(|| key.to_string())
        })
        .collect())
}

fn read_csv(bytes: &[u8], r: &Reader<'_>, acc: &mut Steps, wandb: bool) -> Result<(), String> {
    let mut rd = csv::ReaderBuilder::new().flexible(true).from_reader(bytes);
    let headers = rd.headers().map_err(|e| e.to_string())?.clone();
    if headers.len() > MAX_KEYS_PER_LINE {
        return Err(format!(
            "{} columns, more than {MAX_KEYS_PER_LINE}",
            headers.len()
        ));
    }
    let wandb = wandb || is_wandb_export(&headers);
    let names: Vec<Option<String>> = if wandb {
        wandb_columns(&headers)?
    } else {
        headers.iter().map(|h| Some(h.to_string())).collect()
    };
    let has = |k: &str| names.iter().any(|n| n.as_deref() == Some(k));
    let step_key = if wandb {
        r.wandb_step_key(has)
    } else {
        r.mapping.step_keys(false)[0]
    };
    let si = names
        .iter()
        .position(|n| n.as_deref() == Some(step_key))
        .ok_or_else(|| {
            let cols = column_list(&headers);
            if wandb && headers.iter().any(|h| h == "Name") && headers.iter().any(|h| h == "State")
            {
                format!(
                    "this is W&B's runs table (one row per run, final values only; {cols}); export a panel's CSV or the run's history instead"
                )
            } else {
                format!("no `{step_key}` column ({cols}); set `step` in the mapping")
            }
        })?;
    for rec in rd.records() {
        let Ok(rec) = rec else {
            acc.skipped += 1;
            continue;
        };
        let step = rec
            .get(si)
            .and_then(|s| s.trim().parse::<f64>().ok())
            .and_then(|x| step_number(&serde_json::json!(x)));
        let Some(step) = step else {
            acc.skipped += 1;
            continue;
        };
        for (i, h) in names.iter().enumerate().filter(|(i, _)| *i != si) {
            let Some(h) = h else {
                continue; // a W&B min/max band column
            };
            if wandb && (h.is_empty() || wandb_bookkeeping(h)) && !r.mapping.map.contains_key(h) {
                continue; // W&B's bookkeeping
            }
            match rec.get(i).map(str::trim) {
                None | Some("") => {} // no value at this step (sparse logging), not junk
                Some(s) => match s.parse::<f64>() {
                    Ok(v) => r.put(acc, step, h, v),
                    Err(_) => acc.skipped += 1,
                },
            }
        }
    }
    Ok(())
}

/// The first columns of a CSV header for an error message: quoted, so a name holding a newline or
/// a comma stays on the error's one line, and capped, so a 100,000-column header stays short.
fn column_list(headers: &csv::StringRecord) -> String {
    const SHOWN: usize = 8;
    let names: Vec<String> = headers
        .iter()
        .take(SHOWN)
        .map(|h| format!("{h:?}"))
        .collect();
    let more = headers.len().saturating_sub(SHOWN);
    match (names.is_empty(), more) {
        (true, _) => "the header is empty".to_string(),
        (false, 0) => format!("columns: {}", names.join(", ")),
        (false, n) => format!("columns: {} and {n} more", names.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mapping(text: &str) -> MetricsMapping {
        toml::from_str(text).unwrap()
    }

    fn read(files: &[(&str, &[u8])], m: &MetricsMapping) -> MetricsRead {
        let d = tempfile::tempdir().unwrap();
        for (name, bytes) in files {
            std::fs::write(d.path().join(name), bytes).unwrap();
        }
        read_metrics(d.path(), m).unwrap()
    }

    #[test]
    fn jsonl_csv_and_miles_series_are_read_and_junk_counted() {
        let m = mapping(
            "files = [\"m.jsonl\", \"m.csv\"]\n[map]\n\"grad/global_norm\" = \"train/grad_norm\"\n",
        );
        let r = read(
            &[
                ("m.jsonl", b"{\"step\": 0, \"rollout/raw_reward\": 0.5, \"grad/global_norm\": 2, \"note\": \"x\"}\nnot json\n{\"step\": 1, \"rollout/raw_reward\": 0.6}\n{\"metric\": \"train/ppo_kl\", \"series\": [[0, 1.5], [1, \"bad\"]]}\n"),
                ("m.csv", b"step,train/train_rollout_kl\n0,0.001\n1,abc\n"),
            ],
            &m,
        );
        assert_eq!(r.records.len(), 2);
        assert_eq!(r.records[0].get("rollout/raw_reward"), Some(0.5));
        assert_eq!(r.records[0].get("train/grad_norm"), Some(2.0), "mapped");
        assert_eq!(r.records[0].get("train/ppo_kl"), Some(1.5));
        assert_eq!(r.records[0].get("train/train_rollout_kl"), Some(0.001));
        assert_eq!(r.records[1].get("train/train_rollout_kl"), None, "not 0");
        assert_eq!(r.skipped, 4, "note, not json, the bad point, abc");
        assert!(r.missing.is_empty());
    }

    #[test]
    fn python_nan_and_infinity_are_values_with_events_and_divergence() {
        // What json.dumps writes for float('nan') and float('inf').
        let r = read(
            &[(
                "metrics.jsonl",
                b"{\"step\": 0, \"rollout/raw_reward\": 0.5, \"train/grad_norm\": 1.0, \"note\": \"NaN here is text\"}\n{\"step\": 1, \"rollout/raw_reward\": 0.5, \"train/grad_norm\": Infinity, \"train/ppo_kl\": -Infinity}\n{\"step\": 2, \"rollout/raw_reward\": NaN}\n",
            )],
            &MetricsMapping::default(),
        );
        assert_eq!(r.records.len(), 3, "no line dropped");
        assert_eq!(r.skipped, 1, "only the text field");
        assert_eq!(r.records[1].get("train/grad_norm"), Some(f64::INFINITY));
        assert_eq!(r.records[1].get("train/ppo_kl"), Some(f64::NEG_INFINITY));
        assert!(r.records[2].get("rollout/raw_reward").unwrap().is_nan());
        let ev: Vec<(usize, &str)> = r
            .records
            .iter()
            .flat_map(|x| x.events.iter().map(|e| (e.step, e.site.as_str())))
            .collect();
        assert_eq!(
            ev,
            [
                (1, "train/grad_norm"),
                (1, "train/ppo_kl"),
                (2, "rollout/raw_reward")
            ]
        );
        assert_eq!(r.divergence(), Some((1, "train/grad_norm".to_string())));
        // A KL going to infinity is recorded but does not by itself end a run.
        let r = read(
            &[(
                "metrics.jsonl",
                b"{\"step\": 0, \"train/ppo_kl\": Infinity}\n",
            )],
            &MetricsMapping::default(),
        );
        assert_eq!(r.records[0].events.len(), 1);
        assert_eq!(r.divergence(), None);
    }

    #[test]
    fn csv_nan_spellings_raise_events() {
        let m = mapping("files = [\"m.csv\"]\n");
        let r = read(
            &[("m.csv", b"step,train/loss,x\n0,1.0,\n1,nan,2\n2,-inf,3\n")],
            &m,
        );
        assert_eq!(r.records.len(), 3);
        assert_eq!(r.skipped, 0, "an empty cell is no value, not junk");
        assert_eq!(r.divergence(), Some((1, "train/loss".to_string())));
        assert_eq!(r.records[2].get("train/loss"), Some(f64::NEG_INFINITY));
    }

    #[test]
    fn mapping_errors_stay_on_one_line_when_names_hold_newlines() {
        for text in [
            "[layers]\n\"grad_norm/layer_{lay\\ner}/{site}\" = \"grad_norm\"\n",
            "[map]\n\"a\\nb\" = \"\"\n",
            "files = [\"../x\\n\"]\n",
        ] {
            let e = mapping(text).validate().unwrap_err();
            assert_eq!(e.lines().count(), 1, "{e:?}");
            assert!(e.contains("\\n"), "the newline is shown escaped: {e}");
        }
    }

    #[test]
    fn a_header_without_the_step_column_is_one_line_naming_a_few_columns() {
        let d = tempfile::tempdir().unwrap();
        let wide: Vec<String> = (0..20).map(|i| format!("c{i}")).collect();
        for (name, bytes) in [
            ("a.csv", b"\"\n1,,inf\n".to_vec()),
            ("b.csv", format!("{}\n1\n", wide.join(",")).into_bytes()),
        ] {
            std::fs::write(d.path().join(name), bytes).unwrap();
            let m = mapping(&format!("files = [\"{name}\"]\n"));
            let e = read_metrics(d.path(), &m).unwrap_err();
            assert_eq!(e.lines().count(), 1, "{e:?}");
            assert!(e.contains("no `step` column"), "{e}");
        }
        let m = mapping("files = [\"b.csv\"]\n");
        let e = read_metrics(d.path(), &m).unwrap_err();
        assert!(e.contains("\"c7\" and 12 more"), "{e}");
    }

    #[test]
    fn one_based_and_float_steps() {
        let m = mapping("first_step = 1\n");
        let r = read(
            &[(
                "metrics.jsonl",
                b"{\"step\": 0, \"val/score\": 0.1}\n{\"step\": 1.0, \"reward\": 0.2}\n{\"step\": 2, \"reward\": 0.3}\n{\"step\": 2.5, \"reward\": 0.3}\n",
            )],
            &m,
        );
        let steps: Vec<usize> = r.records.iter().map(|x| x.step).collect();
        assert_eq!(steps, [0, 1], "1-based steps stored from 0");
        assert_eq!(r.records[0].get("reward"), Some(0.2));
        assert_eq!(r.before_first, 1, "the validation row at step 0");
        assert_eq!(r.skipped, 1, "step 2.5 is not a step");
        assert_eq!(r.steps_reached(), 2);
    }

    #[test]
    fn a_preset_maps_a_framework_and_the_suite_overrides_it_key_by_key() {
        let m = mapping("preset = \"verl\"\n[map]\n\"actor/entropy\" = \"my/entropy\"\n");
        let r = read(
            &[(
                "metrics.jsonl",
                b"{\"step\": 0, \"val/score\": 0.1}\n{\"step\": 1, \"critic/score/mean\": 0.4, \"actor/entropy\": 2.0, \"training/rollout_probs_diff_mean\": 0.01}\n",
            )],
            &m,
        );
        assert_eq!(r.before_first, 1, "verl's validation row at step 0");
        assert_eq!(r.records[0].step, 0);
        assert_eq!(r.records[0].get("rollout/raw_reward"), Some(0.4));
        assert_eq!(
            r.records[0].get("my/entropy"),
            Some(2.0),
            "the suite's map wins"
        );
        assert_eq!(
            r.records[0].get("training/rollout_probs_diff_mean"),
            Some(0.01),
            "a probability-space difference keeps its name"
        );
        let m = mapping("preset = \"verl\"\nfirst_step = 0\n");
        assert_eq!(m.first_step(), 0, "first_step overrides the preset's");
        let e = mapping("preset = \"trll\"\n").validate().unwrap_err();
        assert!(e.contains("did you mean `trl`"), "{e}");
    }

    #[test]
    fn per_layer_patterns_fill_layer_rows() {
        let m = mapping(
            "[layers]\n\"grad_norm/layer_{layer}/{site}\" = \"grad_norm\"\n\"sat/layer_{layer}/{site}\" = \"saturated\"\n\"norm_l{layer}\" = \"grad_norm\"\n",
        );
        let r = read(
            &[(
                "metrics.jsonl",
                b"{\"step\": 0, \"grad_norm/layer_3/mlp.experts.linear_fc1\": 0.5, \"sat/layer_3/mlp.experts.linear_fc1\": 7, \"norm_l12\": 1.25, \"grad_norm/layer_x/a\": 1, \"train/grad_norm\": 2}\n{\"step\": 1, \"grad_norm/layer_3/mlp.experts.linear_fc1\": NaN}\n",
            )],
            &m,
        );
        let l = &r.records[0].layers;
        assert_eq!(l.len(), 2, "{l:?}");
        assert_eq!((l[0].site.as_str(), l[0].layer), ("all", 12));
        assert_eq!(l[0].grad_norm, 1.25);
        assert_eq!(
            (l[1].site.as_str(), l[1].layer),
            ("mlp.experts.linear_fc1", 3)
        );
        assert_eq!((l[1].grad_norm, l[1].saturated), (0.5, 7));
        assert_eq!(
            r.records[0].get("grad_norm/layer_x/a"),
            Some(1.0),
            "no layer number: a scalar"
        );
        assert_eq!(r.records[0].get("train/grad_norm"), Some(2.0));
        assert!(
            !r.records[0].scalars.contains_key("norm_l12"),
            "layer keys are not scalars"
        );
        let e = &r.records[1].events[0];
        assert_eq!((e.kind.as_str(), e.layer), ("non_finite", 3));
        assert_eq!(
            r.divergence(),
            None,
            "a per-layer NaN alone is an event, not a divergence"
        );
    }

    #[test]
    fn bad_mappings_are_refused_at_check_time() {
        for (text, needle) in [
            ("files = []\n", "empty"),
            ("files = [\"../x\"]\n", "relative"),
            ("[layers]\n\"g/{site}\" = \"grad_norm\"\n", "{layer}"),
            ("[layers]\n\"g/{layer}{site}\" = \"grad_norm\"\n", "literal"),
            (
                "[layers]\n\"g/{layer}\" = \"norm\"\n",
                "grad_norm, saturated",
            ),
            (
                "[layers]\n\"g/{lyr}\" = \"grad_norm\"\n",
                "unknown placeholder",
            ),
        ] {
            let e = mapping(text).validate().unwrap_err();
            assert!(e.contains(needle), "{text}: {e}");
        }
        let e = toml::from_str::<MetricsMapping>("file = [\"m\"]\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field `file`"), "{e}");
    }

    #[test]
    fn duplicates_keep_the_last_and_are_counted_and_missing_files_listed() {
        let m = mapping("files = [\"metrics.jsonl\", \"typo.jsonl\"]\n");
        let r = read(
            &[(
                "metrics.jsonl",
                b"{\"step\": 0, \"a\": 1}\n{\"step\": 0, \"a\": 2}\n",
            )],
            &m,
        );
        assert_eq!(r.records[0].get("a"), Some(2.0));
        assert_eq!(r.duplicates, 1);
        assert_eq!(r.missing, ["typo.jsonl"]);
    }

    #[test]
    fn non_utf8_lines_long_lines_and_key_floods_are_skipped_alone() {
        let mut bytes = b"{\"step\": 0, \"a\": 1}\n{\"step\": 1, \"a\": \"\xff\"}\n".to_vec();
        bytes.extend_from_slice(
            format!(
                "{{\"step\": 2, \"a\": \"{}\"}}\n",
                "x".repeat(MAX_LINE_BYTES)
            )
            .as_bytes(),
        );
        let flood: Vec<String> = (0..=MAX_KEYS_PER_LINE)
            .map(|i| format!("\"k{i}\": 1"))
            .collect();
        bytes.extend_from_slice(format!("{{\"step\": 3, {}}}\n", flood.join(", ")).as_bytes());
        bytes.extend_from_slice(b"{\"step\": 4, \"a\": 5}\n");
        let r = read(&[("metrics.jsonl", &bytes)], &MetricsMapping::default());
        let steps: Vec<usize> = r.records.iter().map(|x| x.step).collect();
        assert_eq!(steps, [0, 4], "the good lines around the bad ones are kept");
        assert_eq!(r.skipped, 3);
    }

    #[test]
    fn wandb_rows_skip_bookkeeping_media_and_nulls_and_count_only_junk() {
        let m = mapping(
            "files = [\"h.jsonl\"]\nsource = \"wandb\"\n[map]\n\"_runtime\" = \"perf/wall\"\n",
        );
        let r = read(
            &[(
                "h.jsonl",
                b"{\"_step\": 0, \"_runtime\": 1.5, \"_timestamp\": 1e9, \"_wandb\": {\"runtime\": 1}, \"a\": {\"b\": 2, \"c\": {\"d\": 3}}, \"img\": {\"_type\": \"image-file\", \"path\": \"x.png\"}, \"h._type\": \"histogram\", \"h.values\": [1], \"gone\": null, \"note\": \"text\"}\n{\"_step\": 1.0, \"a\": {\"b\": Infinity}}\n{\"train/loss\": 1}\n",
            )],
            &m,
        );
        assert_eq!(r.records.len(), 2);
        let keys: Vec<&str> = r.records[0].scalars.keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            ["a.b", "a.c.d", "perf/wall"],
            "`.`-joined; a mapped `_` key kept"
        );
        assert_eq!(r.records[0].get("a.c.d"), Some(3.0));
        assert_eq!(r.records[1].get("a.b"), Some(f64::INFINITY));
        assert_eq!(r.records[1].events.len(), 1);
        assert_eq!(r.skipped, 2, "the text value and the row without `_step`");
        // `step` names the user's own step key instead of `_step`.
        let m =
            mapping("files = [\"h.jsonl\"]\nsource = \"wandb\"\nstep = \"train/global_step\"\n");
        let r = read(
            &[(
                "h.jsonl",
                b"{\"_step\": 0, \"train/global_step\": 5, \"x\": 1}\n",
            )],
            &m,
        );
        assert_eq!((r.records[0].step, r.records[0].get("x")), (5, Some(1.0)));
        assert!(!r.records[0].scalars.contains_key("train/global_step"));
    }

    #[test]
    fn wandb_csv_exports_are_read_and_several_runs_or_the_runs_table_refused() {
        let m = mapping("files = [\"e.csv\"]\n");
        // A panel plotted against the user's own step, a run name holding " - ".
        let r = read(
            &[(
                "e.csv",
                b"train/global_step,a - b - loss,a - b - loss__MIN,a - b - loss__MAX,a - b - kl\n1,0.5,0.4,0.6,\n2,nan,nan,nan,0.1\n",
            )],
            &mapping("files = [\"e.csv\"]\nstep = \"train/global_step\"\n"),
        );
        let keys: Vec<&str> = r.records[1].scalars.keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            ["kl", "loss"],
            "run prefix `a - b - ` stripped, bands left out"
        );
        assert_eq!(r.records[0].get("loss"), Some(0.5));
        assert_eq!(r.divergence(), Some((2, "loss".to_string())));
        // pandas' run.history().to_csv(): an unnamed index column and W&B's `_` columns.
        let r = read(
            &[(
                "e.csv",
                b",_step,_runtime,train/loss\n0,0,0.1,1.0\n1,1,0.2,2.0\n",
            )],
            &m,
        );
        assert_eq!(r.records.len(), 2);
        assert_eq!(r.records[0].scalars.len(), 1, "{:?}", r.records[0].scalars);
        assert_eq!(r.skipped, 0);
        let d = tempfile::tempdir().unwrap();
        for (bytes, needle) in [
            (
                &b"Step,bf16 - loss,bf16 - loss__MIN,fp8 - loss\n0,1,1,2\n"[..],
                "holds 2 runs (bf16, fp8)",
            ),
            (
                &b"Name,State,Runtime,train/loss\nbf16,finished,10,0.5\n"[..],
                "W&B's runs table",
            ),
        ] {
            std::fs::write(d.path().join("e.csv"), bytes).unwrap();
            let e = read_metrics(
                d.path(),
                &mapping("files = [\"e.csv\"]\nsource = \"wandb\"\n"),
            )
            .unwrap_err();
            assert!(e.contains(needle), "{e}");
            assert!(!e.contains('\n'), "{e}");
        }
    }

    #[cfg(unix)]
    #[test]
    fn fifos_and_devices_are_refused_not_waited_on() {
        let d = tempfile::tempdir().unwrap();
        let fifo = d.path().join("metrics.jsonl");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if made.is_ok_and(|s| s.success()) {
            let e = read_metrics(d.path(), &MetricsMapping::default()).unwrap_err();
            assert!(e.contains("not a regular file"), "{e}");
            std::fs::remove_file(&fifo).unwrap();
        }
        std::os::unix::fs::symlink("/dev/zero", &fifo).unwrap();
        let e = read_metrics(d.path(), &MetricsMapping::default()).unwrap_err();
        assert!(e.contains("not a regular file"), "{e}");
    }
}

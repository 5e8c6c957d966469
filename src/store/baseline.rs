//! Checked-in golden values: `baselines/<suite>/baseline.json` (lockstep version, platform, which
//! runs, tolerances derived from repeated runs) and one `<config>.csv` per configuration with
//! `seed, step` and the tracked metrics. Plain text with shortest round-trip floats, so a reviewer
//! can read a diff and reading it back is exact.

use crate::io::{IoError, atomic};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

/// Where and with what a baseline was recorded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Platform {
    pub os: String,
    pub arch: String,
    /// `cpu` for the built-in engine, the run's device otherwise.
    pub device: String,
    pub host: String,
    pub emulated: bool,
}

impl Platform {
    /// Two platforms on which the deterministic engine must agree bit for bit.
    pub fn same_numerics(&self, other: &Platform) -> bool {
        self.os == other.os && self.arch == other.arch && self.device == other.device
    }
}

/// `baseline.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BaselineMeta {
    pub suite: String,
    pub lockstep_version: String,
    pub git_revision: String,
    pub created: String,
    pub platform: Platform,
    pub metrics: Vec<String>,
    /// Configuration name → CSV file name in the folder.
    pub configs: BTreeMap<String, String>,
    /// Tolerances derived from repeated runs (band factor x largest deviation seen), per metric.
    #[serde(default)]
    pub derived_tolerances: BTreeMap<String, f64>,
    /// How many repeated stores the tolerances came from (1: none derived).
    #[serde(default)]
    pub repeats: usize,
}

/// One configuration's golden values: per seed, per step, the metrics (NaN: absent).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GoldenTable {
    pub metrics: Vec<String>,
    /// `(seed, step)` → values in `metrics` order.
    pub rows: BTreeMap<(u64, usize), Vec<f64>>,
}

/// A file-name-safe form of a configuration name (`nvfp4-dq [bf16_last=4]` → `nvfp4-dq_bf16_last-4`).
pub fn slug(config: &str) -> String {
    let s: String = config
        .chars()
        .map(|c| match c {
            'a'..='z' | 'A'..='Z' | '0'..='9' | '-' | '_' | '.' => c,
            '=' => '-',
            _ => '_',
        })
        .collect();
    let mut out = String::new();
    for c in s.trim_matches('_').chars() {
        if !(c == '_' && out.ends_with('_')) {
            out.push(c);
        }
    }
    out
}

fn table_csv(t: &GoldenTable) -> Result<String, csv::Error> {
    let mut w = csv::Writer::from_writer(Vec::new());
    let mut head = vec!["seed".to_string(), "step".to_string()];
    head.extend(t.metrics.iter().cloned());
    w.write_record(&head)?;
    for ((seed, step), vals) in &t.rows {
        let mut row = vec![seed.to_string(), step.to_string()];
        row.extend(vals.iter().map(|v| {
            if v.is_nan() {
                String::new()
            } else {
                format!("{v:?}")
            }
        }));
        w.write_record(&row)?;
    }
    Ok(String::from_utf8_lossy(&w.into_inner().map_err(|e| e.into_error())?).into_owned())
}

/// Write a whole baseline folder atomically (a failure leaves the previous one in place).
pub fn save(
    dir: &Path,
    meta: &BaselineMeta,
    tables: &BTreeMap<String, GoldenTable>,
) -> Result<(), IoError> {
    atomic::write_dir(dir, |tmp| {
        for (config, t) in tables {
            let file = meta
                .configs
                .get(config)
                .cloned()
                .unwrap_or_else(|| format!("{}.csv", slug(config)));
            let p = tmp.join(&file);
            let text = table_csv(t).map_err(|e| IoError::invalid(&p, e.to_string()))?;
            atomic::write_file(&p, text.as_bytes())?;
        }
        let p = tmp.join("baseline.json");
        let text =
            serde_json::to_string_pretty(meta).map_err(|e| IoError::invalid(&p, e.to_string()))?;
        atomic::write_file(&p, format!("{text}\n").as_bytes())
    })
}

/// Read a baseline folder back.
pub fn load(dir: &Path) -> Result<(BaselineMeta, BTreeMap<String, GoldenTable>), IoError> {
    let p = dir.join("baseline.json");
    let text = std::fs::read_to_string(&p).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            IoError::invalid(
                &p,
                "no baseline here; record one with `lockstep baseline save --suite SUITE.toml`",
            )
        } else {
            IoError::io(&p, e)
        }
    })?;
    let meta: BaselineMeta = serde_json::from_str(&text)
        .map_err(|e| IoError::invalid(&p, format!("not a lockstep baseline: {e}")))?;
    let mut tables = BTreeMap::new();
    for (config, file) in &meta.configs {
        super::safe_component(file)
            .map_err(|why| IoError::invalid(&p, format!("file `{file}`: {why}")))?;
        let p = dir.join(file);
        tables.insert(config.clone(), read_table(&p)?);
    }
    Ok((meta, tables))
}

fn read_table(p: &Path) -> Result<GoldenTable, IoError> {
    let text = std::fs::read_to_string(p).map_err(|e| IoError::io(p, e))?;
    let mut r = csv::Reader::from_reader(text.as_bytes());
    let head = r
        .headers()
        .map_err(|e| IoError::invalid(p, e.to_string()))?
        .clone();
    if head.get(0) != Some("seed") || head.get(1) != Some("step") {
        return Err(IoError::invalid(
            p,
            "the first two columns must be `seed,step`",
        ));
    }
    let mut t = GoldenTable {
        metrics: head.iter().skip(2).map(str::to_string).collect(),
        rows: BTreeMap::new(),
    };
    for (i, rec) in r.records().enumerate() {
        let rec = rec.map_err(|e| IoError::invalid(p, format!("row {}: {e}", i + 2)))?;
        let num = |j: usize| -> Result<f64, IoError> {
            let v = rec.get(j).unwrap_or("");
            if v.is_empty() {
                return Ok(f64::NAN);
            }
            v.parse().map_err(|_| {
                IoError::invalid(
                    p,
                    format!("row {}: `{}` = `{v}` is not a number", i + 2, &head[j]),
                )
            })
        };
        let seed = num(0)? as u64;
        let step = num(1)? as usize;
        let vals = (2..head.len()).map(num).collect::<Result<Vec<_>, _>>()?;
        t.rows.insert((seed, step), vals);
    }
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_baseline_round_trips_exactly() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("smoke");
        let mut t = GoldenTable {
            metrics: vec!["rollout/raw_reward".into(), "eval/accuracy".into()],
            ..Default::default()
        };
        t.rows.insert((0, 0), vec![0.1 + 0.2, f64::NAN]);
        t.rows.insert((1, 3), vec![1e-300, 0.25]);
        let name = "nvfp4-dq [bf16_last=4]";
        let meta = BaselineMeta {
            suite: "smoke".into(),
            lockstep_version: "0.1.0".into(),
            git_revision: "x".into(),
            created: "now".into(),
            platform: Platform {
                os: "linux".into(),
                arch: "x86_64".into(),
                device: "cpu".into(),
                host: "h".into(),
                emulated: true,
            },
            metrics: t.metrics.clone(),
            configs: [(name.to_string(), format!("{}.csv", slug(name)))].into(),
            derived_tolerances: BTreeMap::new(),
            repeats: 1,
        };
        assert_eq!(meta.configs[name], "nvfp4-dq_bf16_last-4.csv");
        save(&dir, &meta, &[(name.to_string(), t.clone())].into()).unwrap();
        let (m2, tables) = load(&dir).unwrap();
        assert_eq!(m2, meta);
        let back = &tables[name];
        assert_eq!(back.rows[&(0, 0)][0].to_bits(), (0.1f64 + 0.2).to_bits());
        assert!(back.rows[&(0, 0)][1].is_nan(), "absent stays absent");
        assert_eq!(back.rows[&(1, 3)], vec![1e-300, 0.25]);
    }
}

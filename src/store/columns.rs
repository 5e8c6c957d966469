//! Column-wise readers of a run's `scalars.parquet` and `layers.parquet` for analysis: only the
//! wanted metric columns, no per-row maps. Parquet is columnar, so reading the columns a
//! comparison needs is reading just those (polars), which keeps comparing 1,000 runs fast.

use crate::io::IoError;
use polars::prelude::*;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

/// Metric key → `(step, value)` points in file order; absent cells are absent.
pub type Columns = BTreeMap<String, Vec<(usize, f64)>>;

/// One site's gradient norms: `(site, layer, steps, grad_norms)`.
pub type GradSeries = (String, i64, Vec<usize>, Vec<f64>);

/// Read only `columns` of a Parquet file (projection pushdown: the other column chunks are never
/// decoded). `pick` chooses from the file's column names; `None` when the file does not exist.
fn frame(p: &Path, pick: impl Fn(&str) -> bool) -> Result<Option<DataFrame>, IoError> {
    let bytes = match std::fs::read(p) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(IoError::io(p, e)),
    };
    let not_parquet = |e: PolarsError| IoError::invalid(p, format!("not a Parquet file: {e}"));
    let mut reader = ParquetReader::new(std::io::Cursor::new(&bytes[..]));
    let schema = reader.schema().map_err(not_parquet)?;
    let columns: Vec<String> = schema
        .iter_names()
        .map(|n| n.as_str())
        .filter(|n| pick(n))
        .map(str::to_string)
        .collect();
    reader
        .with_columns(Some(columns))
        // Runs are already read in parallel, one per thread.
        .read_parallel(ParallelStrategy::None)
        .finish()
        .map(Some)
        .map_err(not_parquet)
}

fn bad(p: &Path, e: PolarsError) -> IoError {
    IoError::invalid(p, format!("not a lockstep metrics table: {e}"))
}

/// The wanted columns of `scalars.parquet` (`None`: all).
pub fn read_scalar_columns(
    dir: &Path,
    wanted: Option<&BTreeSet<String>>,
) -> Result<Columns, IoError> {
    let p = dir.join("scalars.parquet");
    let Some(df) = frame(&p, |n| n == "step" || wanted.is_none_or(|w| w.contains(n)))? else {
        return Err(IoError::io(
            &p,
            std::io::Error::from(std::io::ErrorKind::NotFound),
        ));
    };
    let steps: Vec<usize> = df
        .column("step")
        .and_then(|c| c.cast(&DataType::UInt64))
        .map_err(|e| bad(&p, e))?
        .u64()
        .map_err(|e| bad(&p, e))?
        .iter()
        .map(|s| s.unwrap_or(0) as usize)
        .collect();
    let mut out = Columns::new();
    for col in df.columns() {
        let name = col.name().as_str();
        if name == "step" || wanted.is_some_and(|w| !w.contains(name)) {
            continue;
        }
        let vals = col.cast(&DataType::Float64).map_err(|e| bad(&p, e))?;
        let pts: Vec<(usize, f64)> = steps
            .iter()
            .zip(vals.f64().map_err(|e| bad(&p, e))?.iter())
            .filter_map(|(s, v)| v.map(|v| (*s, v)))
            .collect();
        out.insert(name.to_string(), pts);
    }
    Ok(out)
}

#[cfg(test)]
fn general_scalars(dir: &Path, wanted: Option<&BTreeSet<String>>) -> Result<Columns, IoError> {
    let mut out = Columns::new();
    for r in super::run::RunDir::open(dir).read_scalars()? {
        for (k, v) in r.scalars {
            if wanted.is_none_or(|w| w.contains(&k)) {
                out.entry(k).or_default().push((r.step, v));
            }
        }
    }
    Ok(out)
}

/// Gradient norms per site and layer from `layers.parquet`, sorted by (site, layer); a missing
/// file is an empty list (command-engine runs have none).
pub fn read_grad_norms(dir: &Path) -> Result<Vec<GradSeries>, IoError> {
    let p = dir.join("layers.parquet");
    let Some(df) = frame(&p, |n| matches!(n, "step" | "site" | "layer" | "grad_norm"))? else {
        return Ok(Vec::new());
    };
    let get = |name: &str, dt: DataType| {
        df.column(name)
            .and_then(|c| c.cast(&dt))
            .map_err(|e| bad(&p, e))
    };
    let (step, layer, grad) = (
        get("step", DataType::UInt64)?,
        get("layer", DataType::Int64)?,
        get("grad_norm", DataType::Float64)?,
    );
    let site = df.column("site").map_err(|e| bad(&p, e))?;
    let site = site.str().map_err(|e| bad(&p, e))?;
    let (step, layer, grad) = (
        step.u64().map_err(|e| bad(&p, e))?,
        layer.i64().map_err(|e| bad(&p, e))?,
        grad.f64().map_err(|e| bad(&p, e))?,
    );
    // Rows come step by step, a site after the other: remember the last row's series so most rows
    // skip the lookup, and look up by the borrowed name (one String per series, not per row).
    let mut index: HashMap<(&str, i64), usize> = HashMap::new();
    let mut out: Vec<GradSeries> = Vec::new();
    let mut last: Option<(&str, i64, usize)> = None;
    for ((s, l), (st, g)) in site
        .iter()
        .zip(layer.iter())
        .zip(step.iter().zip(grad.iter()))
    {
        let (s, l) = (s.unwrap_or_default(), l.unwrap_or(-1));
        let k = match last {
            Some((ls, ll, k)) if ll == l && ls == s => k,
            _ => *index.entry((s, l)).or_insert_with(|| {
                out.push((s.to_string(), l, Vec::new(), Vec::new()));
                out.len() - 1
            }),
        };
        last = Some((s, l, k));
        out[k].2.push(st.unwrap_or(0) as usize);
        out[k].3.push(g.unwrap_or(f64::NAN));
    }
    out.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
    Ok(out)
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::metrics::{LayerRecord, StepRecord};
    use crate::store::RunDir;

    #[test]
    fn column_readers_agree_with_the_general_readers() {
        let d = tempfile::tempdir().unwrap();
        let run = RunDir::create(d.path()).unwrap();
        let recs: Vec<StepRecord> = (0..5)
            .map(|t| {
                let mut r = StepRecord {
                    step: t,
                    ..Default::default()
                };
                r.set("rollout/raw_reward", 0.1 * t as f64 + 1e-17);
                if t % 2 == 0 {
                    r.set("eval/accuracy", t as f64 / 7.0);
                }
                for (site, layer) in [("mlp.router", 1), ("output_layer", -1)] {
                    r.layers.push(LayerRecord {
                        step: t,
                        site: site.into(),
                        layer,
                        precision: "bf16".into(),
                        grad_norm: 1.0 / (t as f64 + 3.0),
                        saturated: 0,
                        underflowed: 0,
                    });
                }
                r
            })
            .collect();
        run.write_metrics(&recs).unwrap();
        let cols = read_scalar_columns(d.path(), None).unwrap();
        assert_eq!(cols, general_scalars(d.path(), None).unwrap());
        assert_eq!(cols["eval/accuracy"].len(), 3, "absent cells stay absent");
        let only: BTreeSet<String> = ["eval/accuracy".to_string()].into();
        assert_eq!(read_scalar_columns(d.path(), Some(&only)).unwrap().len(), 1);
        let g = read_grad_norms(d.path()).unwrap();
        assert_eq!(g.len(), 2);
        assert_eq!((g[0].0.as_str(), g[0].1), ("mlp.router", 1));
        assert_eq!(g[0].3[4].to_bits(), (1.0f64 / 7.0).to_bits());
        assert_eq!(g[1].2, vec![0, 1, 2, 3, 4]);
    }
}

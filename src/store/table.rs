//! Per-step metric tables as Parquet (through polars): `scalars.parquet` has a `step` column and one
//! nullable Float64 column per metric key (null where a step has no value, e.g. `eval/accuracy`
//! between evaluations); `layers.parquet` has one row per (step, site, layer). Parquet keeps every
//! f64 bit, so reading back is exact. Files are uncompressed: they are small, and it keeps the
//! codec features of polars out of the build.

use crate::engine::metrics::{LayerRecord, StepRecord};
use polars::prelude::*;
use std::collections::{BTreeMap, BTreeSet};
use std::io::Cursor;

/// Parquet bytes of the scalars table.
pub fn scalars_parquet(records: &[StepRecord]) -> PolarsResult<Vec<u8>> {
    let keys: BTreeSet<&String> = records.iter().flat_map(|r| r.scalars.keys()).collect();
    let mut cols = vec![Column::new(
        "step".into(),
        records.iter().map(|r| r.step as u64).collect::<Vec<_>>(),
    )];
    for k in keys {
        let vals: Vec<Option<f64>> = records.iter().map(|r| r.get(k)).collect();
        cols.push(Column::new(k.as_str().into(), vals));
    }
    to_parquet(DataFrame::new(records.len(), cols)?)
}

/// Parquet bytes of the per-site-and-layer table.
pub fn layers_parquet(records: &[StepRecord]) -> PolarsResult<Vec<u8>> {
    let rows: Vec<&LayerRecord> = records.iter().flat_map(|r| &r.layers).collect();
    let cols = vec![
        Column::new(
            "step".into(),
            rows.iter().map(|l| l.step as u64).collect::<Vec<_>>(),
        ),
        Column::new(
            "site".into(),
            rows.iter().map(|l| l.site.as_str()).collect::<Vec<_>>(),
        ),
        Column::new(
            "layer".into(),
            rows.iter().map(|l| l.layer).collect::<Vec<_>>(),
        ),
        Column::new(
            "precision".into(),
            rows.iter()
                .map(|l| l.precision.as_str())
                .collect::<Vec<_>>(),
        ),
        Column::new(
            "grad_norm".into(),
            rows.iter().map(|l| l.grad_norm).collect::<Vec<_>>(),
        ),
        Column::new(
            "saturated".into(),
            rows.iter().map(|l| l.saturated).collect::<Vec<_>>(),
        ),
        Column::new(
            "underflowed".into(),
            rows.iter().map(|l| l.underflowed).collect::<Vec<_>>(),
        ),
    ];
    to_parquet(DataFrame::new(rows.len(), cols)?)
}

fn to_parquet(mut df: DataFrame) -> PolarsResult<Vec<u8>> {
    let mut buf = Vec::new();
    ParquetWriter::new(&mut buf)
        .with_compression(ParquetCompression::Uncompressed)
        .finish(&mut df)?;
    Ok(buf)
}

/// Read Parquet bytes into a frame.
pub fn read_frame(bytes: &[u8]) -> PolarsResult<DataFrame> {
    ParquetReader::new(Cursor::new(bytes)).finish()
}

/// Scalars table back into step records (null cells are absent keys).
pub fn scalars_from_frame(df: &DataFrame) -> PolarsResult<Vec<StepRecord>> {
    let steps = u64_column(df, "step")?;
    let mut out: Vec<StepRecord> = steps
        .iter()
        .map(|s| StepRecord {
            step: *s as usize,
            scalars: BTreeMap::new(),
            ..Default::default()
        })
        .collect();
    for col in df.columns() {
        if col.name().as_str() == "step" {
            continue;
        }
        let vals = col.cast(&DataType::Float64)?;
        let vals = vals.f64()?;
        for (rec, v) in out.iter_mut().zip(vals.iter()) {
            if let Some(v) = v {
                rec.scalars.insert(col.name().to_string(), v);
            }
        }
    }
    Ok(out)
}

/// Per-site-and-layer table back into rows.
pub fn layers_from_frame(df: &DataFrame) -> PolarsResult<Vec<LayerRecord>> {
    let step = u64_column(df, "step")?;
    let layer = df.column("layer")?.cast(&DataType::Int64)?;
    let grad = df.column("grad_norm")?.cast(&DataType::Float64)?;
    let sat = u64_column(df, "saturated")?;
    let under = u64_column(df, "underflowed")?;
    let site = df.column("site")?.str()?.clone();
    let prec = df.column("precision")?.str()?.clone();
    let (layer, grad) = (layer.i64()?, grad.f64()?);
    Ok((0..df.height())
        .map(|i| LayerRecord {
            step: step[i] as usize,
            site: site.get(i).unwrap_or_default().to_string(),
            layer: layer.get(i).unwrap_or(-1),
            precision: prec.get(i).unwrap_or_default().to_string(),
            grad_norm: grad.get(i).unwrap_or(f64::NAN),
            saturated: sat[i],
            underflowed: under[i],
        })
        .collect())
}

fn u64_column(df: &DataFrame, name: &str) -> PolarsResult<Vec<u64>> {
    let c = df.column(name)?.cast(&DataType::UInt64)?;
    Ok(c.u64()?.iter().map(|v| v.unwrap_or(0)).collect())
}

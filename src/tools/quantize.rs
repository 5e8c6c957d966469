//! `lockstep quantize`: quantize a 2-D float32 `.npy` with any format and write what the quantizer
//! produced (codes, scales, second-level scales, dequantized values) as `.npy` files a numpy user
//! can inspect, plus the error it introduced.

use crate::formats::{Axis, FormatError, QuantFormat, QuantizedTensor, Scales, quantize};
use crate::io::{IoError, atomic, npy};
use std::path::Path;

/// Quantization error of `x'` against `x`. The error statistics cover only the elements where both
/// `x` and `x'` are finite, so one NaN or overflow cannot hide (NaN) or swamp (inf) the error of
/// the rest; those elements are counted instead, so a `max abs error` of 0 over an input full of
/// NaN reads as what it is.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct ErrorMetrics {
    pub max_abs_error: f64,
    /// sqrt(Σ(x - x')² / Σx²).
    pub relative_rmse: f64,
    /// Signal-to-quantization-noise ratio, 10·log10(Σx² / Σ(x - x')²) (∞ when exact).
    pub sqnr_db: f64,
    /// Elements the statistics above cover (finite in and out).
    pub finite: u64,
    /// NaN inputs (kept NaN by every format).
    pub nan: u64,
    /// ±inf inputs.
    pub inf: u64,
    /// Finite inputs that dequantize to ±inf or NaN: the spec's dequantization formulas run in
    /// f32 and overflow near FLT_MAX (MXFP8 TE: FLT_MAX rounds to 256·2^120 = 2^128; NVFP4:
    /// `e4m3(scale)·global_amax` overflows once the amax passes FLT_MAX/448, and a zero code in
    /// that block is then 0·inf = NaN, as TE's kernel gives it; UE8M0 FP8-block variants like
    /// MXFP8). The codes and scales are the spec's; only the decoded value leaves f32's range.
    pub overflow: u64,
}

pub fn error_metrics(x: &[f32], xq: &[f32]) -> ErrorMetrics {
    let (mut max_abs, mut sig, mut noise) = (0.0f64, 0.0f64, 0.0f64);
    let (mut finite, mut nan, mut inf, mut overflow) = (0u64, 0u64, 0u64, 0u64);
    for (a, b) in x.iter().zip(xq) {
        if a.is_nan() {
            nan += 1;
            continue;
        }
        if a.is_infinite() {
            inf += 1;
            continue;
        }
        if !b.is_finite() {
            overflow += 1;
            continue;
        }
        finite += 1;
        let (a, b) = (*a as f64, *b as f64);
        let d = (a - b).abs();
        max_abs = max_abs.max(d);
        sig += a * a;
        noise += d * d;
    }
    let relative_rmse = if sig > 0.0 { (noise / sig).sqrt() } else { 0.0 };
    let sqnr_db = if noise > 0.0 {
        10.0 * (sig / noise).log10()
    } else {
        f64::INFINITY
    };
    ErrorMetrics {
        max_abs_error: max_abs,
        relative_rmse,
        sqnr_db,
        finite,
        nan,
        inf,
        overflow,
    }
}

/// The files a `quantize` output folder may hold: an existing `--out` holding anything else (or
/// lacking `quantized.json`) is not replaced.
pub const OUTPUT_FILES: [&str; 5] = [
    "codes.npy",
    "scales.npy",
    "global_scale.npy",
    "dequant.npy",
    "quantized.json",
];

/// Whether `dir` holds exactly a previous `quantize` output: only [`OUTPUT_FILES`], with a
/// `quantized.json` this command wrote (a JSON object with its `format` and `layout` keys).
pub fn is_previous_output(dir: &Path) -> Result<(), String> {
    atomic::only_files(dir, &OUTPUT_FILES, "quantized.json")?;
    let text = std::fs::read_to_string(dir.join("quantized.json")).map_err(|e| e.to_string())?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|_| "quantized.json is not JSON".to_string())?;
    if v.get("format").is_some() && v.get("layout").is_some() {
        Ok(())
    } else {
        Err("quantized.json was not written by lockstep quantize".into())
    }
}

/// Why `lockstep quantize` failed (all are the user's to fix).
#[derive(Debug, thiserror::Error)]
pub enum QuantizeError {
    #[error(transparent)]
    Io(#[from] IoError),
    #[error("{path}: {err}")]
    Format { path: String, err: FormatError },
}

/// Quantize `input` and write `codes.npy`, `scales.npy`, `global_scale.npy` (NVFP4),
/// `dequant.npy` and `quantized.json` into `out` (nothing is left on failure). `out` must be new,
/// empty or a previous output ([`is_previous_output`]) and must not hold `input`; otherwise
/// nothing is read or written.
pub fn quantize_file(
    input: &Path,
    out: &Path,
    fmt: &QuantFormat,
    axis: Axis,
) -> Result<ErrorMetrics, QuantizeError> {
    let rule = atomic::Replace {
        protect: &[input],
        previous_output: &is_previous_output,
    };
    atomic::check_replaceable(out, &rule)?;
    let m = npy::read_matrix_f32(input)?;
    let q = quantize(&m.data, m.rows, m.cols, fmt, axis).map_err(|err| QuantizeError::Format {
        path: input.display().to_string(),
        err,
    })?;
    let deq = q.dequantize();
    let metrics = error_metrics(&m.data, &deq);
    atomic::write_dir_checked::<QuantizeError>(out, &rule, |dir| {
        write_outputs(dir, &q, &deq)?;
        let meta = serde_json::json!({
            "input": input.display().to_string(),
            "shape": [q.rows, q.cols],
            "format": q.format,
            "axis": q.axis,
            "blocked_shape": q.blocked_shape(),
            "layout": "codes/scales are row-major over the blocked view: [rows, cols] for axis=row, [cols, rows] (transposed) for axis=col; FP4 codes packed two a byte, element 2i in the low nibble; dequant.npy has the input's shape",
            "stats": {
                "elements": q.stats.elements,
                "saturated": q.stats.saturated,
                "underflowed": q.stats.underflowed,
                "overflow": metrics.overflow,
                "nan": metrics.nan,
                "inf": metrics.inf,
            },
            "error": metrics,
        });
        let text = serde_json::to_string_pretty(&meta).unwrap_or_default();
        atomic::write_file(&dir.join("quantized.json"), text.as_bytes())?;
        Ok(())
    })?;
    Ok(metrics)
}

fn write_outputs(dir: &Path, q: &QuantizedTensor, deq: &[f32]) -> Result<(), IoError> {
    let (br, bc) = q.blocked_shape();
    let (br, bc) = (br as u64, bc as u64);
    match q.format {
        QuantFormat::Bf16 => {
            let bits: Vec<u16> = q
                .codes
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect();
            npy::write(&dir.join("codes.npy"), &bits, &[br, bc])?;
        }
        QuantFormat::Nvfp4 { .. } => npy::write(&dir.join("codes.npy"), &q.codes, &[br, bc / 2])?,
        _ => npy::write(&dir.join("codes.npy"), &q.codes, &[br, bc])?,
    }
    match (&q.scales, q.format) {
        (Scales::E8m0(s), _) => npy::write(&dir.join("scales.npy"), s, &[br, bc / 32])?,
        (Scales::E4m3(s), _) => npy::write(&dir.join("scales.npy"), s, &[br, bc / 16])?,
        (Scales::F32(s), QuantFormat::Fp8Block { tile, .. }) => {
            let tr = match tile {
                crate::formats::Fp8Tile::Act1x128 => br,
                crate::formats::Fp8Tile::Weight128x128 => br.div_ceil(128),
            };
            npy::write(&dir.join("scales.npy"), s, &[tr, bc.div_ceil(128)])?
        }
        _ => {}
    }
    if let QuantFormat::Nvfp4 { second, shards } = q.format {
        let shape: Vec<u64> = match (second, shards) {
            (crate::formats::SecondScale::PerTensor, 1) => vec![1],
            (crate::formats::SecondScale::PerTensor, s) => vec![s as u64],
            (crate::formats::SecondScale::PerToken, 1) => vec![br],
            (crate::formats::SecondScale::PerToken, s) => vec![br, s as u64],
        };
        npy::write(&dir.join("global_scale.npy"), &q.global_amax, &shape)?;
    }
    npy::write(
        &dir.join("dequant.npy"),
        deq,
        &[q.rows as u64, q.cols as u64],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_are_zero_error_for_exact_copies_and_finite_otherwise() {
        let x = [1.0f32, -2.0, 3.0];
        let m = error_metrics(&x, &x);
        assert_eq!(m.max_abs_error, 0.0);
        assert!(m.sqnr_db.is_infinite());
        let m = error_metrics(&x, &[1.0, -2.0, 2.0]);
        assert_eq!(m.max_abs_error, 1.0);
        assert!((m.relative_rmse - (1.0f64 / 14.0).sqrt()).abs() < 1e-12);
        assert!((m.sqnr_db - 10.0 * 14f64.log10()).abs() < 1e-9);
    }

    #[test]
    fn non_finite_inputs_and_overflow_are_counted_not_hidden() {
        let x = [1.0f32, f32::NAN, f32::INFINITY, f32::MAX, 2.0];
        let xq = [1.5f32, f32::NAN, f32::INFINITY, f32::INFINITY, 2.0];
        let m = error_metrics(&x, &xq);
        assert_eq!((m.finite, m.nan, m.inf, m.overflow), (2, 1, 1, 1));
        assert_eq!(m.max_abs_error, 0.5);
        assert!(m.sqnr_db.is_finite());
    }

    #[test]
    fn only_a_previous_output_counts_as_one() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("dequant.npy"), b"x").unwrap();
        assert!(
            is_previous_output(d.path())
                .unwrap_err()
                .contains("quantized.json")
        );
        std::fs::write(d.path().join("quantized.json"), b"{\"a\": 1}").unwrap();
        assert!(is_previous_output(d.path()).is_err());
        std::fs::write(
            d.path().join("quantized.json"),
            b"{\"format\": \"bf16\", \"layout\": \"\"}",
        )
        .unwrap();
        assert!(is_previous_output(d.path()).is_ok());
        std::fs::write(d.path().join("x.npy"), b"input").unwrap();
        assert!(is_previous_output(d.path()).unwrap_err().contains("x.npy"));
    }
}

//! Conformance runner for golden vector files laid out like `tests/golden/` (copied from the
//! project's `shared/golden/`, written by the numpy reference `gen_golden.py` and checked against
//! TransformerEngine's references). Used by `lockstep quantize --check DIR` and by the tests.
//!
//! Every comparison is exact: codes, scale bytes, FP32 bit patterns of global amax / S_enc / S_dec /
//! scale_inv and of the dequantized values where the file gives them.

use super::bf16::bf16_from_f32;
use super::e2m1::{E2m1Convention, e2m1_from_f32};
use super::fp8::{e4m3_from_f32_plain, e4m3_from_f32_sat};
use super::fp8_block::Fp8BlockVariant;
use super::mxfp8::{Fp8Elem, MxScaleRule};
use super::nvfp4::GlobalScale;
use super::tensor::{Axis, Fp8Tile, QuantFormat, Scales, SecondScale, quantize};
use serde_json::Value;
use std::path::Path;

/// Outcome of one golden case.
#[derive(Debug, Clone)]
pub struct CaseResult {
    pub file: String,
    pub case: String,
    pub passed: bool,
    /// Values compared, or the first mismatches on failure.
    pub detail: String,
}

/// Errors reading a golden folder (not mismatches: those are failed [`CaseResult`]s).
#[derive(Debug, thiserror::Error)]
pub enum GoldenError {
    #[error("{path}: {err}")]
    Io { path: String, err: std::io::Error },
    #[error("{path}: not valid JSON: {err}")]
    Json {
        path: String,
        err: serde_json::Error,
    },
    #[error("{path}: {what} (is this a golden file written by gen_golden.py?)")]
    Layout { path: String, what: String },
    #[error(
        "{dir}: no golden files found (expected bf16.json, e4m3.json, e2m1.json, mxfp8.json, nvfp4.json, fp8_block.json)"
    )]
    Empty { dir: String },
}

type Res<T> = Result<T, String>;
/// Checks of one golden file: (case name, outcome) pairs, or a layout error.
type FileChecks = Res<Vec<(String, Res<String>)>>;
type Checker = fn(&Value) -> FileChecks;

/// Run every known golden file present in `dir`.
pub fn check_dir(dir: &Path) -> Result<Vec<CaseResult>, GoldenError> {
    let mut out = Vec::new();
    let runners: [(&str, Checker); 6] = [
        ("bf16.json", check_bf16),
        ("e4m3.json", check_e4m3),
        ("e2m1.json", check_e2m1),
        ("mxfp8.json", check_mxfp8),
        ("nvfp4.json", check_nvfp4),
        ("fp8_block.json", check_fp8_block),
    ];
    for (name, run) in runners {
        let path = dir.join(name);
        if !path.exists() {
            continue;
        }
        let p = path.display().to_string();
        let text = std::fs::read_to_string(&path).map_err(|err| GoldenError::Io {
            path: p.clone(),
            err,
        })?;
        let v: Value = serde_json::from_str(&text).map_err(|err| GoldenError::Json {
            path: p.clone(),
            err,
        })?;
        let cases = run(&v).map_err(|what| GoldenError::Layout {
            path: p.clone(),
            what,
        })?;
        for (case, r) in cases {
            let (passed, detail) = match r {
                Ok(d) => (true, d),
                Err(d) => (false, d),
            };
            out.push(CaseResult {
                file: name.to_string(),
                case,
                passed,
                detail,
            });
        }
    }
    if out.is_empty() {
        return Err(GoldenError::Empty {
            dir: dir.display().to_string(),
        });
    }
    Ok(out)
}

fn field<'a>(v: &'a Value, k: &str) -> Res<&'a Value> {
    v.get(k).ok_or_else(|| format!("missing field `{k}`"))
}

fn arr<'a>(v: &'a Value, k: &str) -> Res<&'a Vec<Value>> {
    field(v, k)?
        .as_array()
        .ok_or_else(|| format!("field `{k}` is not an array"))
}

fn hex(v: &Value) -> Res<u32> {
    let s = v.as_str().ok_or("expected a hex string")?;
    u32::from_str_radix(s.trim_start_matches("0x"), 16).map_err(|e| format!("bad hex `{s}`: {e}"))
}

fn hexes(v: &Value, k: &str) -> Res<Vec<u32>> {
    arr(v, k)?.iter().map(hex).collect()
}

fn ints(v: &Value) -> Res<Vec<u32>> {
    v.as_array()
        .ok_or("expected an array of integers")?
        .iter()
        .map(|x| {
            x.as_u64()
                .map(|u| u as u32)
                .ok_or_else(|| "expected an integer".to_string())
        })
        .collect()
}

/// Integers of a flat or nested (2-D) array, flattened.
fn ints_flat(v: &Value) -> Res<Vec<u32>> {
    let a = v.as_array().ok_or("expected an array")?;
    if a.first().is_some_and(|x| x.is_array()) {
        Ok(a.iter().map(ints).collect::<Res<Vec<_>>>()?.concat())
    } else {
        ints(v)
    }
}

fn floats(bits: &[u32]) -> Vec<f32> {
    bits.iter().map(|b| f32::from_bits(*b)).collect()
}

/// Compare two sequences; report the first few mismatches with their inputs.
fn compare(what: &str, got: &[u32], want: &[u32], inputs: &[u32]) -> Res<String> {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: {} values, golden has {}",
            got.len(),
            want.len()
        ));
    }
    let bad: Vec<String> = (0..got.len())
        .filter(|&i| got[i] != want[i])
        .take(3)
        .map(|i| {
            let x = inputs
                .get(i)
                .map(|b| format!(" (x = {:#010x})", b))
                .unwrap_or_default();
            format!("#{i}: got {:#x}, want {:#x}{x}", got[i], want[i])
        })
        .collect();
    let n_bad = (0..got.len()).filter(|&i| got[i] != want[i]).count();
    if n_bad == 0 {
        Ok(format!("{} {what}", got.len()))
    } else {
        Err(format!(
            "{what}: {n_bad}/{} differ: {}",
            got.len(),
            bad.join("; ")
        ))
    }
}

fn all(parts: Vec<Res<String>>) -> Res<String> {
    let errs: Vec<String> = parts
        .iter()
        .filter_map(|p| p.as_ref().err().cloned())
        .collect();
    if errs.is_empty() {
        Ok(parts
            .into_iter()
            .map(|p| p.unwrap_or_default())
            .collect::<Vec<_>>()
            .join(", "))
    } else {
        Err(errs.join(" | "))
    }
}

fn elementwise(
    v: &Value,
    out_key: &str,
    enc: impl Fn(f32) -> u32,
    out_is_hex: bool,
) -> Res<Res<String>> {
    let xb = hexes(v, "x_bits")?;
    let want = if out_is_hex {
        hexes(v, out_key)?
    } else {
        ints(field(v, out_key)?)?
    };
    let got: Vec<u32> = xb.iter().map(|b| enc(f32::from_bits(*b))).collect();
    Ok(compare(out_key, &got, &want, &xb))
}

fn check_bf16(v: &Value) -> FileChecks {
    Ok(vec![(
        "bf16_bits".into(),
        elementwise(v, "bf16_bits", |x| bf16_from_f32(x) as u32, true)?,
    )])
}

fn check_e4m3(v: &Value) -> FileChecks {
    Ok(vec![
        (
            "e4m3_sat".into(),
            elementwise(v, "e4m3_sat", |x| e4m3_from_f32_sat(x) as u32, false)?,
        ),
        (
            "e4m3_plain_cast".into(),
            elementwise(
                v,
                "e4m3_plain_cast_non_saturating",
                |x| e4m3_from_f32_plain(x) as u32,
                false,
            )?,
        ),
    ])
}

fn check_e2m1(v: &Value) -> FileChecks {
    let mut out = Vec::new();
    for (key, conv) in [
        ("code_te", E2m1Convention::TeRef),
        ("code_ml_dtypes", E2m1Convention::MlDtypes),
        ("code_ptx_satfinite", E2m1Convention::PtxSatfinite),
    ] {
        out.push((
            key.to_string(),
            elementwise(v, key, |x| e2m1_from_f32(x, conv) as u32, false)?,
        ));
    }
    Ok(out)
}

fn check_mxfp8(v: &Value) -> FileChecks {
    let mut out = Vec::new();
    for case in arr(v, "cases")? {
        let name = field(case, "name")?.as_str().unwrap_or("?").to_string();
        for (key, rule) in [
            ("te", MxScaleRule::TeCeil),
            ("ocp_floor_rne", MxScaleRule::OcpFloor),
        ] {
            let mut parts = Vec::new();
            for (bi, block) in arr(case, "blocks")?.iter().enumerate() {
                let xb = hexes(block, "x_bits")?;
                let want = field(block, key)?;
                let fmt = QuantFormat::Mxfp8 {
                    elem: Fp8Elem::E4M3,
                    rule,
                };
                let q = quantize(&floats(&xb), 1, xb.len(), &fmt, Axis::Row)
                    .map_err(|e| e.to_string())?;
                let Scales::E8m0(s) = &q.scales else {
                    return Err("mxfp8 without E8M0 scales".into());
                };
                let want_scale = field(want, "scale_e8m0")?
                    .as_u64()
                    .ok_or("scale_e8m0 not an integer")? as u32;
                parts.push(compare(
                    &format!("block {bi} scale"),
                    &[s[0] as u32],
                    &[want_scale],
                    &[],
                ));
                let got: Vec<u32> = q.codes.iter().map(|c| *c as u32).collect();
                parts.push(compare(
                    &format!("block {bi} codes"),
                    &got,
                    &ints(field(want, "codes")?)?,
                    &xb,
                ));
            }
            out.push((format!("{name} [{key}]"), all(parts)));
        }
    }
    Ok(out)
}

fn check_nvfp4(v: &Value) -> FileChecks {
    let mut out = Vec::new();
    for case in arr(v, "cases")? {
        let name = field(case, "name")?.as_str().unwrap_or("?").to_string();
        let shape = ints(field(case, "shape")?)?;
        let (rows, cols) = (shape[0] as usize, shape[1] as usize);
        let per_token = field(case, "per_token")?
            .as_bool()
            .ok_or("per_token not a bool")?;
        let second = if per_token {
            SecondScale::PerToken
        } else {
            SecondScale::PerTensor
        };
        let xb = hexes(case, "x_bits")?;
        let fmt = QuantFormat::Nvfp4 { second, shards: 1 };
        let q = quantize(&floats(&xb), rows, cols, &fmt, Axis::Row).map_err(|e| e.to_string())?;
        let Scales::E4m3(scales) = &q.scales else {
            return Err("nvfp4 without E4M3 scales".into());
        };
        let globals: Vec<GlobalScale> = q
            .global_amax
            .iter()
            .map(|a| GlobalScale::from_amax(*a))
            .collect();
        let bits = |f: &dyn Fn(&GlobalScale) -> f32| {
            globals.iter().map(|g| f(g).to_bits()).collect::<Vec<_>>()
        };
        let deq: Vec<u32> = q.dequantize().iter().map(|x| x.to_bits()).collect();
        let parts = vec![
            compare(
                "global_amax",
                &bits(&|g| g.amax),
                &hexes(case, "global_amax_bits")?,
                &[],
            ),
            compare(
                "s_enc",
                &bits(&|g| g.s_enc),
                &hexes(case, "s_enc_bits")?,
                &[],
            ),
            compare(
                "s_dec",
                &bits(&|g| g.s_dec),
                &hexes(case, "s_dec_bits")?,
                &[],
            ),
            compare(
                "scales",
                &scales.iter().map(|s| *s as u32).collect::<Vec<_>>(),
                &ints_flat(field(case, "scales_e4m3")?)?,
                &[],
            ),
            compare(
                "codes",
                &q.unpacked_codes()
                    .iter()
                    .map(|c| *c as u32)
                    .collect::<Vec<_>>(),
                &ints_flat(field(case, "codes")?)?,
                &xb,
            ),
            compare(
                "packed",
                &q.codes.iter().map(|c| *c as u32).collect::<Vec<_>>(),
                &hexes(case, "packed")?,
                &[],
            ),
            compare(
                "dequant bits",
                &deq,
                &hexes(case, "dequant_te_kernel_f32_bits")?,
                &xb,
            ),
        ];
        out.push((name, all(parts)));
    }
    Ok(out)
}

fn check_fp8_block(v: &Value) -> FileChecks {
    let variants = [
        ("deepseek_v3_act_quant", Fp8BlockVariant::DeepseekV3),
        ("deepseek_v3_ue8m0", Fp8BlockVariant::DeepseekV3Ue8m0),
        ("deepgemm", Fp8BlockVariant::Deepgemm),
        ("deepgemm_ue8m0", Fp8BlockVariant::DeepgemmUe8m0),
        ("te_blockwise", Fp8BlockVariant::Te),
    ];
    let mut out = Vec::new();
    for case in arr(v, "cases")? {
        let name = field(case, "name")?.as_str().unwrap_or("?").to_string();
        let xb = hexes(case, "x_bits")?;
        for (key, variant) in variants {
            let want = field(case, key)?;
            let fmt = QuantFormat::Fp8Block {
                tile: Fp8Tile::Act1x128,
                variant,
            };
            let q =
                quantize(&floats(&xb), 1, xb.len(), &fmt, Axis::Row).map_err(|e| e.to_string())?;
            let Scales::F32(s) = &q.scales else {
                return Err("fp8 block without FP32 scales".into());
            };
            let got: Vec<u32> = q.codes.iter().map(|c| *c as u32).collect();
            let parts = vec![
                compare(
                    "scale_inv",
                    &[s[0].to_bits()],
                    &hexes(want, "scale_inv_f32_bits")?,
                    &[],
                ),
                compare("codes", &got, &ints(field(want, "codes")?)?, &xb),
            ];
            out.push((format!("{name} [{key}]"), all(parts)));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every golden case passes byte for byte.
    #[test]
    fn all_golden_vectors_pass() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
        let results = check_dir(&dir).expect("golden folder readable");
        let failed: Vec<_> = results.iter().filter(|r| !r.passed).collect();
        for f in &failed {
            eprintln!("FAIL {} / {}: {}", f.file, f.case, f.detail);
        }
        assert!(
            failed.is_empty(),
            "{} of {} golden cases failed",
            failed.len(),
            results.len()
        );
        // Guard against a silently shrinking suite: 6 element cases + 32 MXFP8 + 20 NVFP4 + 25 FP8 block.
        assert_eq!(results.len(), 6 + 32 + 20 + 25);
    }

    #[test]
    fn a_corrupted_golden_value_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/e2m1.json");
        let text = std::fs::read_to_string(src).unwrap();
        let mut v: Value = serde_json::from_str(&text).unwrap();
        v["code_te"][10] = Value::from(v["code_te"][10].as_u64().unwrap() ^ 1);
        std::fs::write(dir.path().join("e2m1.json"), v.to_string()).unwrap();
        let r = check_dir(dir.path()).unwrap();
        let te = r.iter().find(|c| c.case == "code_te").unwrap();
        assert!(!te.passed);
        assert!(te.detail.contains("#10"), "{}", te.detail);
    }
}

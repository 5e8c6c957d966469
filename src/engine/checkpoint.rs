//! Checkpoints as safetensors: FP32 master weights under their Megatron names, and checkpoint
//! conversion — every matmul weight quantized through `crate::formats` per a precision plan and
//! stored as the codes, scales and second-level scales a low-precision inference engine loads.

use super::model::{ModelConfig, Params};
use crate::formats::{Axis, QuantFormat, Scales, quantize};
use crate::io::{IoError, atomic};
use crate::recipe::ModelPlan;
use safetensors::tensor::{Dtype, TensorView};
use std::collections::BTreeMap;
use std::path::Path;

fn f32_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Serialize master weights (plus string metadata) to safetensors bytes.
pub fn to_bytes(
    params: &Params,
    metadata: BTreeMap<String, String>,
) -> Result<Vec<u8>, safetensors::SafeTensorError> {
    let data: Vec<(String, Vec<u8>, usize)> = params
        .named_tensors()
        .into_iter()
        .map(|(n, t)| (n, f32_bytes(t), t.len()))
        .collect();
    let views: Vec<(String, TensorView<'_>)> = data
        .iter()
        .map(|(n, b, len)| Ok((n.clone(), TensorView::new(Dtype::F32, vec![*len], b)?)))
        .collect::<Result<_, safetensors::SafeTensorError>>()?;
    safetensors::serialize(views, Some(metadata.into_iter().collect()))
}

/// Save master weights atomically.
pub fn save(
    path: &Path,
    params: &Params,
    metadata: BTreeMap<String, String>,
) -> Result<(), IoError> {
    let bytes = to_bytes(params, metadata).map_err(|e| IoError::invalid(path, e.to_string()))?;
    atomic::write_file(path, &bytes)
}

/// Load master weights for `cfg`; every tensor must be present with the right size.
pub fn load(path: &Path, cfg: &ModelConfig) -> Result<(Params, BTreeMap<String, String>), IoError> {
    let bytes = std::fs::read(path).map_err(|e| IoError::io(path, e))?;
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes)
        .map_err(|e| IoError::invalid(path, format!("not a safetensors file: {e}")))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| IoError::invalid(path, format!("not a safetensors file: {e}")))?;
    let mut params = Params::zeros(cfg);
    for (name, dst) in params.named_tensors_mut() {
        let t = st.tensor(&name).map_err(|_| {
            IoError::invalid(
                path,
                format!("missing tensor `{name}`; was it saved for another model config?"),
            )
        })?;
        if t.dtype() != Dtype::F32 || t.data().len() != dst.len() * 4 {
            return Err(IoError::invalid(
                path,
                format!(
                    "tensor `{name}` has {} bytes of {:?}, expected {} f32",
                    t.data().len(),
                    t.dtype(),
                    dst.len()
                ),
            ));
        }
        for (d, c) in dst.iter_mut().zip(t.data().chunks_exact(4)) {
            *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
    }
    let meta = meta
        .metadata()
        .clone()
        .map(|m| m.into_iter().collect())
        .unwrap_or_default();
    Ok((params, meta))
}

/// Checkpoint conversion: each matmul weight quantized per `plan` (row-wise, blocks along K; routed
/// experts one by one) into `<name>.codes` (U8), `<name>.scales` (U8, or F32 for FP8 block) and
/// `<name>.global_amax` (F32, NVFP4); BF16 sites store `<name>` as BF16; FP32 and non-matmul
/// tensors stay F32. Metadata records each site's format. Same bytes the trainer's forward uses.
pub fn convert(params: &Params, plan: &ModelPlan) -> Result<Vec<u8>, safetensors::SafeTensorError> {
    let cfg = &params.config;
    let mut out: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut meta: BTreeMap<String, String> = BTreeMap::new();
    for (name, t) in params.named_tensors() {
        let (site, layer) = super::metrics::site_of(&name);
        let plan_of = plan.site_plan(&site, layer);
        let fmt = plan_of.and_then(|p| p.weight_format());
        let (Some(fmt), Some(p)) = (fmt, plan_of) else {
            out.push((name, Dtype::F32, vec![t.len()], f32_bytes(t)));
            continue;
        };
        meta.insert(name.clone(), p.precision.label().to_string());
        let k = if site == "mlp.experts.linear_fc2" || site == "mlp.shared_experts.linear_fc2" {
            if site.contains("shared") {
                cfg.d_ff_shared
            } else {
                cfg.d_ff
            }
        } else {
            cfg.d_model
        };
        let experts = if site.starts_with("mlp.experts.") {
            cfg.n_experts
        } else {
            1
        };
        let per = t.len() / experts;
        for e in 0..experts {
            let w: Vec<f32> = t[e * per..(e + 1) * per]
                .iter()
                .map(|v| crate::formats::bf16::round_bf16(*v))
                .collect();
            let tag = if experts > 1 {
                format!("{name}.{e}")
            } else {
                name.clone()
            };
            let q = quantize(&w, per / k, k, &fmt, Axis::Row).map_err(|e| {
                safetensors::SafeTensorError::InvalidTensorView(
                    Dtype::F32,
                    vec![per],
                    e.to_string().len(),
                )
            })?;
            if matches!(fmt, QuantFormat::Bf16) {
                out.push((tag, Dtype::BF16, vec![per / k, k], q.codes.clone()));
                continue;
            }
            out.push((
                format!("{tag}.codes"),
                Dtype::U8,
                vec![q.codes.len()],
                q.codes.clone(),
            ));
            match &q.scales {
                Scales::E8m0(s) | Scales::E4m3(s) => {
                    out.push((format!("{tag}.scales"), Dtype::U8, vec![s.len()], s.clone()))
                }
                Scales::F32(s) => out.push((
                    format!("{tag}.scales"),
                    Dtype::F32,
                    vec![s.len()],
                    f32_bytes(s),
                )),
                Scales::None => {}
            }
            if !q.global_amax.is_empty() {
                out.push((
                    format!("{tag}.global_amax"),
                    Dtype::F32,
                    vec![q.global_amax.len()],
                    f32_bytes(&q.global_amax),
                ));
            }
        }
    }
    let views: Vec<(String, TensorView<'_>)> = out
        .iter()
        .map(|(n, d, s, b)| Ok((n.clone(), TensorView::new(*d, s.clone(), b)?)))
        .collect::<Result<_, safetensors::SafeTensorError>>()?;
    safetensors::serialize(views, Some(meta.into_iter().collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn save_load_round_trips_and_rejects_other_configs() {
        let cfg = ModelConfig::tiny();
        let p = Params::init(&cfg, 7).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        save(
            &path,
            &p,
            BTreeMap::from([("accuracy".to_string(), "0.3".to_string())]),
        )
        .unwrap();
        let (q, meta) = load(&path, &cfg).unwrap();
        assert!(
            p.named_tensors()
                .iter()
                .zip(q.named_tensors())
                .all(|(a, b)| a.0 == b.0 && a.1 == b.1)
        );
        assert_eq!(meta.get("accuracy").map(String::as_str), Some("0.3"));
        let mut other = cfg.clone();
        other.d_model = 64;
        assert!(load(&path, &other).is_err());
    }

    #[test]
    fn conversion_holds_the_trainers_bytes() {
        let cfg = ModelConfig::tiny();
        let p = Params::init(&cfg, 7).unwrap();
        let plan = crate::recipe::presets::preset("nvfp4-dq")
            .unwrap()
            .resolve(cfg.n_layers)
            .unwrap();
        let bytes = convert(&p, &plan).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        // Layer 0 expert 1's fc1 codes equal the trainer's quantization of the same weight.
        let name = "decoder.layers.0.mlp.experts.linear_fc1.weight";
        let w = p
            .named_tensors()
            .into_iter()
            .find(|(n, _)| n == name)
            .unwrap()
            .1
            .to_vec();
        let per = w.len() / cfg.n_experts;
        let prep = super::super::linear::prepare_weight(
            &plan.layers[0].experts_fc1,
            &w[per..2 * per],
            2 * cfg.d_ff,
            cfg.d_model,
        );
        let codes = st.tensor(&format!("{name}.1.codes")).unwrap();
        let q = quantize(
            &w[per..2 * per]
                .iter()
                .map(|v| crate::formats::bf16::round_bf16(*v))
                .collect::<Vec<_>>(),
            2 * cfg.d_ff,
            cfg.d_model,
            &plan.layers[0].experts_fc1.weight_format().unwrap(),
            Axis::Row,
        )
        .unwrap();
        assert_eq!(codes.data(), &q.codes[..]);
        assert_eq!(super::super::linear::digest_of(&q), prep.digest);
    }
}

//! Helpers shared by the GPU test files (each test crate that says `mod common;` compiles its own
//! copy, and uses a subset of it).
#![allow(dead_code)]

use lockstep::engine::backend::cuda::{self, CudaError};
use lockstep::engine::model::Routing;
use lockstep::formats::{Fp8BlockVariant, Fp8Elem, Fp8Tile, MxScaleRule, QuantFormat, SecondScale};
use lockstep::recipe::{ModelPlan, SitePlan};
use std::sync::OnceLock;

/// A test file's GPU fixture, built once on first use: `None` where there is no GPU (the test
/// prints `skipping <test>: <why>` and passes); a GPU that is present but fails to set up fails
/// the test instead of skipping it.
pub fn gpu_fixture<T>(
    cell: &'static OnceLock<Result<T, String>>,
    test: &str,
    build: impl FnOnce() -> Result<T, CudaError>,
) -> Option<&'static T> {
    let r = cell.get_or_init(|| match cuda::skip_reason() {
        Some(why) => Err(why),
        None => build().map_err(|e| format!("GPU present but unusable: {e}")),
    });
    match r {
        Ok(v) => Some(v),
        Err(why) if why.starts_with("GPU present") => panic!("{test}: {why}"),
        Err(why) => {
            eprintln!("skipping {test}: {why}");
            None
        }
    }
}

/// Every format variant the quantizers implement.
pub fn all_formats() -> Vec<QuantFormat> {
    let mut v = vec![QuantFormat::Bf16];
    for elem in [Fp8Elem::E4M3, Fp8Elem::E5M2] {
        for rule in [MxScaleRule::TeCeil, MxScaleRule::OcpFloor] {
            v.push(QuantFormat::Mxfp8 { elem, rule });
        }
    }
    for second in [SecondScale::PerTensor, SecondScale::PerToken] {
        for shards in [1, 2, 4] {
            v.push(QuantFormat::Nvfp4 { second, shards });
        }
    }
    for tile in [Fp8Tile::Act1x128, Fp8Tile::Weight128x128] {
        for variant in [
            Fp8BlockVariant::Te,
            Fp8BlockVariant::DeepseekV3,
            Fp8BlockVariant::DeepseekV3Ue8m0,
            Fp8BlockVariant::Deepgemm,
            Fp8BlockVariant::DeepgemmUe8m0,
        ] {
            v.push(QuantFormat::Fp8Block { tile, variant });
        }
    }
    v
}

/// A uniform FP32 plan, a shipped preset, or "nvfp4-dq-per-tensor": nvfp4-dq with per-tensor
/// second-level activation scales on the experts (the one activation format that is not
/// row-local, so each expert's rows are quantized apart, as on the CPU).
pub fn plan(name: &str, layers: usize) -> ModelPlan {
    match name {
        "fp32" => ModelPlan::uniform(layers, SitePlan::FP32),
        "nvfp4-dq-per-tensor" => {
            let mut p = plan("nvfp4-dq", layers);
            for l in &mut p.layers {
                l.experts_fc1.act_scale = SecondScale::PerTensor;
                l.experts_fc2.act_scale = SecondScale::PerTensor;
            }
            p
        }
        _ => lockstep::recipe::presets::preset(name)
            .unwrap()
            .resolve(layers)
            .unwrap(),
    }
}

/// The fraction of expert choices two routing records share, position by position.
pub fn agreement(a: &Routing, b: &Routing) -> f64 {
    let (mut same, mut all) = (0usize, 0usize);
    for (la, lb) in a.layers.iter().zip(&b.layers) {
        same += la.iter().zip(lb).filter(|(x, y)| x == y).count();
        all += la.len();
    }
    same as f64 / all.max(1) as f64
}

/// Bit patterns, to compare floats exactly (NaN included).
pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

//! The quantization contract between trainer and rollout: for every matmul site, both sides must
//! quantize the same weight to the same bytes and apply the same activation quantizer. Each side
//! fingerprints what it holds — a SHA-256 of every weight's codes and scales, and of a fixed probe
//! activation pushed through the site's activation quantizer — and any difference is a
//! `contract_violation` event naming the site.
//!
//! The probe is built to expose each way the contract is known to break: rows of different
//! magnitudes (per-tensor vs per-token second-level scales), halves of K with different ranges
//! (a different shard count), and a block maximum of 1.9·2^k (TE's rounded-up MXFP8 scale vs the
//! OCP floor rule, which clips it).

use super::linear::{PreparedWeight, digest_of};
use super::model::PreparedModel;
use crate::formats::{Axis, quantize};
use crate::recipe::{OUTPUT_LAYER, Site, SitePlan};
use sha2::{Digest, Sha256};

/// `(site name, digest)` for every weight and activation quantizer of a prepared model.
pub fn fingerprints(prep: &PreparedModel) -> Vec<(String, [u8; 32])> {
    let mut out = Vec::new();
    let d = prep.config.d_model;
    for (i, (l, p)) in prep.layers.iter().zip(&prep.plan.layers).enumerate() {
        let sites: [(Site, Vec<&PreparedWeight>); 7] = [
            (Site::LinearQkv, vec![&l.linear_qkv]),
            (Site::LinearProj, vec![&l.linear_proj]),
            (Site::Router, vec![&l.router]),
            (Site::ExpertsFc1, l.experts_fc1.iter().collect()),
            (Site::ExpertsFc2, l.experts_fc2.iter().collect()),
            (Site::SharedFc1, vec![&l.shared_fc1]),
            (Site::SharedFc2, vec![&l.shared_fc2]),
        ];
        for (s, ws) in sites {
            let name = s.name(i);
            for (e, w) in ws.iter().enumerate() {
                let tag = if ws.len() > 1 {
                    format!("{name}.weight[{e}]")
                } else {
                    format!("{name}.weight")
                };
                out.push((tag, w.digest));
            }
            out.push((
                format!("{name}.activation"),
                activation_digest(p.get(s), ws[0].in_dim),
            ));
        }
    }
    out.push((format!("{OUTPUT_LAYER}.weight"), prep.output_layer.digest));
    out.push((
        format!("{OUTPUT_LAYER}.activation"),
        activation_digest(&prep.plan.output_layer, d),
    ));
    out
}

/// Digest of the probe activation `[8, k]` through the site's activation quantizer.
pub fn activation_digest(plan: &SitePlan, k: usize) -> [u8; 32] {
    let rows = 8;
    let mut probe = vec![0.0f32; rows * k];
    for r in 0..rows {
        for j in 0..k {
            let half = if j >= k / 2 { 4.0 } else { 1.0 };
            probe[r * k + j] =
                ((j as f32) * 0.37 + r as f32).sin() * (2f32).powi(r as i32 - 3) * half;
        }
        probe[r * k] = 1.9 * (2f32).powi(r as i32 - 3);
    }
    match plan.activation_format() {
        None => {
            let mut h = Sha256::new();
            h.update(b"fp32");
            h.finalize().into()
        }
        Some(fmt) => match quantize(&probe, rows, k, &fmt, Axis::Row) {
            Ok(q) => digest_of(&q),
            Err(e) => {
                let mut h = Sha256::new();
                h.update(e.to_string().as_bytes());
                h.finalize().into()
            }
        },
    }
}

/// Sites whose fingerprints differ between the two sides (names from `a`).
pub fn mismatches(a: &[(String, [u8; 32])], b: &[(String, [u8; 32])]) -> Vec<String> {
    let mut bad: Vec<String> = a
        .iter()
        .zip(b)
        .filter(|(x, y)| x.0 != y.0 || x.1 != y.1)
        .map(|(x, _)| x.0.clone())
        .collect();
    if a.len() != b.len() {
        bad.push(format!("site count {} vs {}", a.len(), b.len()));
    }
    bad
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::{MxScaleRule, SecondScale};
    use crate::recipe::{BackwardMode, Precision};

    fn site(p: Precision) -> SitePlan {
        SitePlan {
            precision: p,
            backward: BackwardMode::Dequantized,
            ..SitePlan::FP32
        }
    }

    #[test]
    fn the_probe_separates_each_known_contract_break() {
        let nv = site(Precision::Nvfp4);
        let mx = site(Precision::Mxfp8);
        let k = 64;
        let base_nv = activation_digest(&nv, k);
        assert_ne!(
            base_nv,
            activation_digest(
                &SitePlan {
                    act_scale: SecondScale::PerTensor,
                    ..nv
                },
                k
            )
        );
        assert_ne!(base_nv, activation_digest(&SitePlan { shards: 2, ..nv }, k));
        assert_ne!(
            activation_digest(&mx, k),
            activation_digest(
                &SitePlan {
                    mx_rule: MxScaleRule::OcpFloor,
                    ..mx
                },
                k
            )
        );
        // Backward mode does not change what the forward quantizes.
        assert_eq!(
            base_nv,
            activation_digest(
                &SitePlan {
                    backward: BackwardMode::HighPrecision,
                    ..nv
                },
                k
            )
        );
    }
}

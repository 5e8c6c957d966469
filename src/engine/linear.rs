//! The precision-aware linear layer: `y = x · Wᵀ` with operands quantized per the site's
//! [`SitePlan`], and its backward in the plan's [`BackwardMode`]. Every matmul site of the model goes
//! through here, and every quantization goes through `crate::formats` (the one quantizer).
//!
//! Shapes: `x` is `[n, k]` (n tokens), `W` is `[m, k]` (out x in, as torch/Megatron store it),
//! `y` is `[n, m]`. Forward operands are quantized along K (rows of both). The backward GEMMs
//! contract over other dimensions: dgrad `dx = dy · W` over m, wgrad `dW = dyᵀ · x` over n, so in
//! `Quantized` mode their operands are fresh column-wise quantizations of the high-precision
//! originals (never re-quantized from the row-wise copy), blocks along the contraction dimension.
//! When that dimension is not a multiple of the block (tokens routed to one expert, 8 router
//! rows) it is padded with zeros, which changes no amax and so no code (what TE's padded grouped
//! GEMMs do).
//!
//! "High precision" means BF16: low-precision sites read their operands as the BF16 values a
//! BF16 model holds (weights are `bf16(master)`), so the rollout, which receives BF16 weights,
//! quantizes the same tensor to the same bytes. FP32 sites (gradient checks) never round.

use super::backend::cpu::{MatRef, gemm};
use crate::formats::bf16::round_bf16;
use crate::formats::{
    Axis, QuantFormat, QuantStats, QuantizedTensor, Scales, fake_quantize, quantize,
};
use crate::recipe::{BackwardMode, Precision, SitePlan};
use sha2::{Digest, Sha256};

/// A weight prepared once per optimizer step: the operands the forward and the dgrad GEMM use.
/// `w_fwd` is what the rollout computes with; `digest` hashes the quantized bytes behind it.
#[derive(Debug, Clone)]
pub struct PreparedWeight {
    pub out_dim: usize,
    pub in_dim: usize,
    /// Forward operand (quantized then dequantized to FP32). Private, like `w_bwd`: both are
    /// immutable once prepared, which is what `key` relies on.
    w_fwd: Vec<f32>,
    /// Operand of the dgrad GEMM (`dx = dy · W`), chosen by the backward mode; `None` where it
    /// equals `w_fwd` bit for bit (FP32 and BF16 sites, and most dequantized ones), so it is
    /// neither stored nor copied to a device twice.
    w_bwd: Option<Vec<f32>>,
    /// Unique per preparation (see [`PreparedWeight::key`]).
    key: u64,
    /// SHA-256 over the weight's codes, scales and second-level scales (FP32 values for FP32 sites).
    pub digest: [u8; 32],
    /// Saturation/underflow of the weight quantization.
    pub stats: QuantStats,
}

impl PreparedWeight {
    /// Forward operand (quantized then dequantized to FP32).
    pub fn w_fwd(&self) -> &[f32] {
        &self.w_fwd
    }
    /// Operand of the dgrad GEMM, chosen by the backward mode.
    pub fn w_bwd(&self) -> &[f32] {
        self.w_bwd.as_deref().unwrap_or(&self.w_fwd)
    }
    /// True when the dgrad operand is the forward operand (bit for bit).
    pub fn bwd_is_fwd(&self) -> bool {
        self.w_bwd.is_none()
    }
    /// Names this preparation's contents: clones share it, every new preparation gets a new one.
    pub fn key(&self) -> u64 {
        self.key
    }
    fn fwd_operand(&self) -> MatRef<'_> {
        MatRef::new(&self.w_fwd, self.out_dim, self.in_dim)
    }
    fn bwd_operand(&self) -> MatRef<'_> {
        MatRef::new(self.w_bwd(), self.out_dim, self.in_dim)
    }
}

/// A fresh content key for a prepared weight (process-wide, never reused).
fn next_weight_key() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// What the forward keeps for the backward.
#[derive(Debug, Clone)]
pub struct LinearCache {
    /// Operand of the wgrad GEMM (`dW = dyᵀ · x`), chosen by the backward mode.
    pub x_bwd: Vec<f32>,
    pub n: usize,
    /// Saturation/underflow of the activation quantization.
    pub stats: QuantStats,
}

fn bf16_vec(x: &[f32]) -> Vec<f32> {
    x.iter().map(|v| round_bf16(*v)).collect()
}

/// Hash of a quantized tensor's bytes (codes, scales, second-level scales).
pub fn digest_of(q: &QuantizedTensor) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(&q.codes);
    match &q.scales {
        Scales::None => {}
        Scales::E8m0(s) | Scales::E4m3(s) => h.update(s),
        Scales::F32(s) => s.iter().for_each(|v| h.update(v.to_le_bytes())),
    }
    q.global_amax.iter().for_each(|v| h.update(v.to_le_bytes()));
    h.finalize().into()
}

fn digest_f32(x: &[f32]) -> [u8; 32] {
    let mut h = Sha256::new();
    x.iter().for_each(|v| h.update(v.to_le_bytes()));
    h.finalize().into()
}

/// Column-wise (blocks along the row dimension) fake quantization of `[r, c]`, padding `r` with
/// zero rows up to the block multiple.
fn fake_quantize_col_padded(x: &[f32], r: usize, c: usize, fmt: &QuantFormat) -> Vec<f32> {
    let m = fmt.required_multiple();
    let rp = r.div_ceil(m) * m;
    let mut out = vec![0.0f32; rp * c];
    if rp == r {
        fake_quantize(x, r, c, fmt, Axis::Col, &mut out)
            .expect("blocked dimension is a multiple of the block");
        return out;
    }
    let mut padded = vec![0.0f32; rp * c];
    padded[..r * c].copy_from_slice(x);
    fake_quantize(&padded, rp, c, fmt, Axis::Col, &mut out)
        .expect("padded to a multiple of the block");
    out.truncate(r * c);
    out
}

/// Check that a site of this shape can be quantized under `plan` (K must divide into blocks).
pub fn check_site(
    plan: &SitePlan,
    out_dim: usize,
    in_dim: usize,
) -> Result<(), crate::formats::FormatError> {
    for fmt in [plan.weight_format(), plan.activation_format()]
        .into_iter()
        .flatten()
    {
        let probe = vec![0.0f32; out_dim.max(1) * in_dim];
        quantize(&probe, out_dim.max(1), in_dim, &fmt, Axis::Row)?;
    }
    Ok(())
}

/// Quantize a weight `[out_dim, in_dim]` for this step. Panics only if the shape was not checked
/// with [`check_site`] (the engine checks every site before training).
pub fn prepare_weight(plan: &SitePlan, w: &[f32], out_dim: usize, in_dim: usize) -> PreparedWeight {
    assert_eq!(w.len(), out_dim * in_dim);
    let Some(fmt) = plan.weight_format() else {
        return PreparedWeight {
            out_dim,
            in_dim,
            w_fwd: w.to_vec(),
            w_bwd: None,
            key: next_weight_key(),
            digest: digest_f32(w),
            stats: QuantStats::default(),
        };
    };
    let w_hp = bf16_vec(w);
    let q = quantize(&w_hp, out_dim, in_dim, &fmt, Axis::Row)
        .expect("site shape checked by check_site");
    let w_fwd = q.dequantize();
    let w_bwd = match (plan.precision, plan.backward) {
        (Precision::Bf16, _) | (_, BackwardMode::HighPrecision) => w_hp,
        (_, BackwardMode::Dequantized) => bf16_vec(&w_fwd),
        (_, BackwardMode::Quantized) => fake_quantize_col_padded(&w_hp, out_dim, in_dim, &fmt),
    };
    let same = w_bwd.len() == w_fwd.len()
        && w_bwd
            .iter()
            .zip(&w_fwd)
            .all(|(a, b)| a.to_bits() == b.to_bits());
    let w_bwd = (!same).then_some(w_bwd);
    PreparedWeight {
        out_dim,
        in_dim,
        w_fwd,
        w_bwd,
        key: next_weight_key(),
        digest: digest_of(&q),
        stats: q.stats,
    }
}

/// `y[n, m] = x[n, k] · Wᵀ`; returns the cache the backward needs.
pub fn forward(
    plan: &SitePlan,
    x: &[f32],
    n: usize,
    w: &PreparedWeight,
    y: &mut [f32],
) -> LinearCache {
    let k = w.in_dim;
    assert_eq!(x.len(), n * k);
    let Some(fmt) = plan.activation_format() else {
        gemm(MatRef::new(x, n, k), w.fwd_operand().t(), y, false);
        return LinearCache {
            x_bwd: x.to_vec(),
            n,
            stats: QuantStats::default(),
        };
    };
    // A BF16 site's operand is its BF16 rounding, so it is rounded once (and its saturation is
    // counted against the FP32 input); other formats quantize the BF16 values.
    let bf16_site = matches!(fmt, QuantFormat::Bf16);
    let x_hp = if bf16_site { Vec::new() } else { bf16_vec(x) };
    let src = if bf16_site { x } else { &x_hp };
    let mut x_q = vec![0.0f32; n * k];
    let stats = if n == 0 {
        QuantStats::default()
    } else {
        fake_quantize(src, n, k, &fmt, Axis::Row, &mut x_q)
            .expect("site shape checked by check_site")
    };
    gemm(MatRef::new(&x_q, n, k), w.fwd_operand().t(), y, false);
    let x_bwd = match plan.backward {
        _ if bf16_site => x_q, // already the BF16 operand, whatever the backward mode
        BackwardMode::HighPrecision => x_hp,
        BackwardMode::Dequantized => bf16_vec(&x_q),
        BackwardMode::Quantized if n == 0 => x_hp,
        BackwardMode::Quantized => fake_quantize_col_padded(&x_hp, n, k, &fmt),
    };
    LinearCache { x_bwd, n, stats }
}

/// Backward: `dx = dy · W` (written to `dx` when given) and `dW += dyᵀ · x` (accumulated).
pub fn backward(
    plan: &SitePlan,
    cache: &LinearCache,
    w: &PreparedWeight,
    dy: &[f32],
    dx: Option<&mut [f32]>,
    dw: &mut [f32],
) {
    let (n, k, m) = (cache.n, w.in_dim, w.out_dim);
    assert_eq!(dy.len(), n * m);
    if n == 0 {
        if let Some(dx) = dx {
            dx.fill(0.0);
        }
        return;
    }
    let (dy_d, dy_w): (std::borrow::Cow<[f32]>, std::borrow::Cow<[f32]>) =
        match plan.activation_format() {
            None => (dy.into(), dy.into()),
            Some(fmt) => {
                let dy_hp = bf16_vec(dy);
                if plan.precision != Precision::Bf16 && plan.backward == BackwardMode::Quantized {
                    // dgrad contracts over m (row blocks of dy); wgrad over n (column blocks of dy).
                    let mut d = vec![0.0f32; n * m];
                    let d_ok = fake_quantize(&dy_hp, n, m, &fmt, Axis::Row, &mut d).is_ok();
                    let d = if d_ok {
                        d
                    } else {
                        fake_quantize_col_padded_t(&dy_hp, n, m, &fmt)
                    };
                    (
                        d.into(),
                        fake_quantize_col_padded(&dy_hp, n, m, &fmt).into(),
                    )
                } else {
                    let c: std::borrow::Cow<[f32]> = dy_hp.into();
                    (c.clone(), c)
                }
            }
        };
    if let Some(dx) = dx {
        gemm(MatRef::new(&dy_d, n, m), w.bwd_operand(), dx, false);
    }
    gemm(
        MatRef::new(&dy_w, n, m).t(),
        MatRef::new(&cache.x_bwd, n, k),
        dw,
        true,
    );
}

/// Row-wise fake quantization of `[r, c]` with `c` padded to the block multiple (dy of a site whose
/// output width does not divide into blocks, e.g. the 8-wide router).
fn fake_quantize_col_padded_t(x: &[f32], r: usize, c: usize, fmt: &QuantFormat) -> Vec<f32> {
    let m = fmt.required_multiple();
    let cp = c.div_ceil(m) * m;
    let mut padded = vec![0.0f32; r * cp];
    for i in 0..r {
        padded[i * cp..i * cp + c].copy_from_slice(&x[i * c..(i + 1) * c]);
    }
    let mut out = vec![0.0f32; r * cp];
    fake_quantize(&padded, r, cp, fmt, Axis::Row, &mut out)
        .expect("padded to a multiple of the block");
    (0..r)
        .flat_map(|i| out[i * cp..i * cp + c].to_vec())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: f32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32 + seed) * 0.731).sin() * if i % 29 == 0 { 8.0 } else { 1.0 })
            .collect()
    }

    fn plan(p: Precision, b: BackwardMode) -> SitePlan {
        SitePlan {
            precision: p,
            backward: b,
            ..SitePlan::FP32
        }
    }

    #[test]
    fn fp32_site_is_an_exact_matmul_and_its_gradients_are_exact() {
        let (n, k, m) = (5, 32, 3);
        let (x, w) = (data(n * k, 0.0), data(m * k, 1.0));
        let p = prepare_weight(&SitePlan::FP32, &w, m, k);
        let mut y = vec![0.0; n * m];
        let c = forward(&SitePlan::FP32, &x, n, &p, &mut y);
        for i in 0..n {
            for j in 0..m {
                let want: f32 = (0..k).map(|t| x[i * k + t] * w[j * k + t]).sum();
                assert!((y[i * m + j] - want).abs() < 1e-4);
            }
        }
        let dy = data(n * m, 2.0);
        let (mut dx, mut dw) = (vec![0.0; n * k], vec![0.0; m * k]);
        backward(&SitePlan::FP32, &c, &p, &dy, Some(&mut dx), &mut dw);
        let want_dx: f32 = (0..m).map(|j| dy[j] * w[j * k]).sum();
        let want_dw: f32 = (0..n).map(|i| dy[i * m] * x[i * k]).sum();
        assert!((dx[0] - want_dx).abs() < 1e-4 && (dw[0] - want_dw).abs() < 1e-4);
    }

    #[test]
    fn backward_modes_use_the_operands_they_promise() {
        let (n, k, m) = (40, 64, 32); // 40 tokens: not a multiple of 32, so the column copies pad
        let (x, w) = (data(n * k, 0.0), data(m * k, 1.0));
        let fwd_q = |p: &SitePlan| {
            let pw = prepare_weight(p, &w, m, k);
            let mut y = vec![0.0; n * m];
            let c = forward(p, &x, n, &pw, &mut y);
            (pw, c)
        };
        for prec in [Precision::Mxfp8, Precision::Nvfp4] {
            let hp = plan(prec, BackwardMode::HighPrecision);
            let dq = plan(prec, BackwardMode::Dequantized);
            let qz = plan(prec, BackwardMode::Quantized);
            let (pw_hp, c_hp) = fwd_q(&hp);
            let (pw_dq, c_dq) = fwd_q(&dq);
            let (pw_qz, c_qz) = fwd_q(&qz);
            // Forward operands are identical whatever the backward mode.
            assert_eq!(pw_hp.w_fwd, pw_dq.w_fwd);
            assert_eq!(pw_hp.digest, pw_qz.digest);
            // High precision: BF16 originals.
            assert_eq!(pw_hp.w_bwd(), bf16_vec(&w));
            assert_eq!(c_hp.x_bwd, bf16_vec(&x));
            // Dequantized: BF16 of exactly what the forward used.
            assert_eq!(pw_dq.w_bwd(), bf16_vec(&pw_dq.w_fwd));
            let mut xq = vec![0.0; n * k];
            fake_quantize(
                &bf16_vec(&x),
                n,
                k,
                &hp.activation_format().unwrap(),
                Axis::Row,
                &mut xq,
            )
            .unwrap();
            assert_eq!(c_dq.x_bwd, bf16_vec(&xq));
            // Quantized: fresh column-wise copies of the BF16 originals (blocks along the contraction).
            let mut col = vec![0.0; m * k];
            fake_quantize(
                &bf16_vec(&w),
                m,
                k,
                &qz.weight_format().unwrap(),
                Axis::Col,
                &mut col,
            )
            .unwrap();
            assert!(
                pw_qz.w_bwd() == col,
                "{prec:?}: dgrad weight is not the column-wise quantization"
            );
            let mut xpad = bf16_vec(&x);
            xpad.resize(64 * k, 0.0); // 40 tokens padded to 64 (a multiple of 16 and 32)
            let mut xcol = vec![0.0; 64 * k];
            fake_quantize(
                &xpad,
                64,
                k,
                &qz.activation_format().unwrap(),
                Axis::Col,
                &mut xcol,
            )
            .unwrap();
            assert!(
                c_qz.x_bwd[..] == xcol[..n * k],
                "{prec:?}: wgrad activation is not the padded column-wise quantization"
            );
            // All three give a gradient close to the FP32 one.
            let dy = data(n * m, 3.0);
            let pf = prepare_weight(&SitePlan::FP32, &w, m, k);
            let mut y = vec![0.0; n * m];
            let cf = forward(&SitePlan::FP32, &x, n, &pf, &mut y);
            let (mut dx_f, mut dw_f) = (vec![0.0; n * k], vec![0.0; m * k]);
            backward(&SitePlan::FP32, &cf, &pf, &dy, Some(&mut dx_f), &mut dw_f);
            for (p, pw, c) in [
                (hp, &pw_hp, &c_hp),
                (dq, &pw_dq, &c_dq),
                (qz, &pw_qz, &c_qz),
            ] {
                let (mut dx, mut dw) = (vec![0.0; n * k], vec![0.0; m * k]);
                backward(&p, c, pw, &dy, Some(&mut dx), &mut dw);
                let rel = |a: &[f32], b: &[f32]| {
                    let num: f32 = a.iter().zip(b).map(|(u, v)| (u - v) * (u - v)).sum();
                    (num / b.iter().map(|v| v * v).sum::<f32>()).sqrt()
                };
                let tol = if prec == Precision::Nvfp4 { 0.25 } else { 0.08 };
                assert!(
                    rel(&dx, &dx_f) < tol,
                    "{prec:?} {:?} dx rel err {}",
                    p.backward,
                    rel(&dx, &dx_f)
                );
                assert!(
                    rel(&dw, &dw_f) < tol,
                    "{prec:?} {:?} dw rel err {}",
                    p.backward,
                    rel(&dw, &dw_f)
                );
            }
        }
    }

    #[test]
    fn bf16_site_rounds_operands() {
        let (n, k, m) = (2, 32, 2);
        let (x, w) = (data(n * k, 0.5), data(m * k, 1.5));
        let pw = prepare_weight(&SitePlan::BF16, &w, m, k);
        assert_eq!(pw.w_fwd, bf16_vec(&w));
        let mut y = vec![0.0; n * m];
        let c = forward(&SitePlan::BF16, &x, n, &pw, &mut y);
        assert_eq!(c.x_bwd, bf16_vec(&x));
    }

    #[test]
    fn digests_change_with_the_quantizer() {
        let (m, k) = (4, 64);
        let w = data(m * k, 0.0);
        let a = prepare_weight(&plan(Precision::Mxfp8, BackwardMode::Quantized), &w, m, k);
        let b = prepare_weight(&plan(Precision::Nvfp4, BackwardMode::Quantized), &w, m, k);
        let a2 = prepare_weight(&plan(Precision::Mxfp8, BackwardMode::Dequantized), &w, m, k);
        assert_ne!(a.digest, b.digest);
        assert_eq!(a.digest, a2.digest);
        assert!(check_site(&plan(Precision::Mxfp8, BackwardMode::Quantized), 8, 48).is_err());
    }

    /// One stored (and uploaded) operand where the dgrad operand is the forward one: a BF16 site
    /// (BF16 values quantize to themselves) and an MXFP8 site with the dequantized backward (E4M3
    /// values times a power of two are BF16-exact); two where they differ (the high-precision
    /// backward keeps the BF16 originals).
    #[test]
    fn the_dgrad_operand_is_shared_exactly_when_it_equals_the_forward_one() {
        let (m, k) = (4, 64);
        let w = data(m * k, 0.0);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (p, b, shared) in [
            (Precision::Bf16, BackwardMode::HighPrecision, true),
            (Precision::Mxfp8, BackwardMode::Dequantized, true),
            (Precision::Mxfp8, BackwardMode::HighPrecision, false),
        ] {
            let pw = prepare_weight(&plan(p, b), &w, m, k);
            assert_eq!(pw.bwd_is_fwd(), shared, "{p:?} {b:?}");
            assert_eq!(bits(pw.w_bwd()) == bits(pw.w_fwd()), shared, "{p:?} {b:?}");
        }
    }
}

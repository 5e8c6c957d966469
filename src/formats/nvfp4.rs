//! NVFP4 block quantization: 16 E2M1 elements share one E4M3 scale, under an FP32 second-level scale
//! per tensor or per row (= per token). Spec §4 (TE reference semantics, which the golden follows).
//!
//! The second-level scale is stored as the FP32 *global amax* (what TE stores), from which
//! `S_enc = 2688 / amax` (2688 = 448·6) is derived. Per-token scales make a row's codes a function
//! of that row alone, so a token quantizes the same whatever batch it is in; per-tensor scales do
//! not. With `shards > 1` the row's amax is taken over each of K/S equal slices separately
//! (mirrors an expert tensor-parallel partition, where each rank sees only its slice).
//!
//! Arithmetic is FP32 with the TE association order: block scale `vec_max · (S_enc · fp32(1/6))`,
//! element multiplier `1 / (e4m3(scale) · S_dec)`. Changing either order changes codes.

use super::QuantStats;
use super::e2m1::{E2M1_VALUES, E2m1Convention, e2m1_from_f32};
use super::fp8::{E4M3_TABLE, e4m3_from_f32_sat};

/// Elements per NVFP4 block.
pub const NV_BLOCK: usize = 16;
/// fp32(1/6), TE's `fp4_max_inv`.
const RCP_6: f32 = 1.0 / 6.0;
/// fp32(1/2688), used by TE's dequantize kernel.
const RCP_2688: f32 = 1.0 / 2688.0;

/// The FP32 second-level scale derived from a global amax.
#[derive(Debug, Clone, Copy)]
pub struct GlobalScale {
    pub amax: f32,
    /// Encode scale `min(2688 / amax, FLT_MAX)`, 1 when amax is Inf.
    pub s_enc: f32,
    /// Decode scale `1 / s_enc`.
    pub s_dec: f32,
}

impl GlobalScale {
    pub fn from_amax(amax: f32) -> Self {
        let mut s_enc = 2688.0f32 / amax;
        if !s_enc.is_nan() {
            s_enc = s_enc.min(f32::MAX);
        }
        if s_enc == 0.0 {
            s_enc = 1.0;
        }
        GlobalScale {
            amax,
            s_enc,
            s_dec: 1.0 / s_enc,
        }
    }
}

/// max |x| with NaN propagating (torch.amax semantics, which the TE reference uses).
#[inline]
pub fn amax_nan_propagating(x: &[f32]) -> f32 {
    let mut m = 0.0f32;
    let mut nan = false;
    for v in x {
        nan |= v.is_nan();
        m = m.max(v.abs());
    }
    if nan { f32::NAN } else { m }
}

/// Quantize one 16-element block under `g`; writes unpacked 4-bit codes, returns the E4M3 scale byte.
#[inline]
pub fn quantize_block(x: &[f32], g: &GlobalScale, codes: &mut [u8], stats: &mut QuantStats) -> u8 {
    let vec_max = amax_nan_propagating(x);
    let mult = g.s_enc * RCP_6;
    let mut ds = vec_max * mult;
    if !ds.is_nan() {
        ds = ds.min(f32::MAX).clamp(-448.0, 448.0);
    }
    let scale = e4m3_from_f32_sat(ds);
    let mut enc = 1.0f32 / (E4M3_TABLE[scale as usize] * g.s_dec);
    if !enc.is_nan() {
        enc = enc.min(f32::MAX);
    }
    for (c, &v) in codes.iter_mut().zip(x) {
        let s = v * enc;
        stats.note(v, s.abs() > 6.0);
        *c = e2m1_from_f32(s.clamp(-6.0, 6.0), E2m1Convention::TeRef);
        stats.note_underflow(v, *c & 7 == 0);
    }
    scale
}

/// Dequantize one block the way TE's kernel does:
/// `final = fp32(fp32(e4m3(scale) · amax) · fp32(1/2688))`, `x' = e2m1(code) · final`.
#[inline]
pub fn dequantize_block(codes: &[u8], scale: u8, amax: f32, out: &mut [f32]) {
    let fin = (E4M3_TABLE[scale as usize] * amax) * RCP_2688;
    for (o, &c) in out.iter_mut().zip(codes) {
        *o = E2M1_VALUES[(c & 0xF) as usize] * fin;
    }
}

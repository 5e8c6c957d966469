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
        let a = v.abs();
        nan |= v.is_nan();
        m = if a > m { a } else { m };
    }
    if nan { f32::NAN } else { m }
}

/// Quantize one 16-element block under `g`; writes the codes packed two a byte (element 2i in the
/// low nibble) into `packed` (8 bytes) and returns the E4M3 scale byte.
#[inline]
pub fn quantize_block(x: &[f32], g: &GlobalScale, packed: &mut [u8], stats: &mut QuantStats) -> u8 {
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
    // Fixed-length loops over the 16 elements so the compiler can vectorise them.
    let x: &[f32; NV_BLOCK] = x
        .try_into()
        .expect("NVFP4 blocks are 16 elements (checked by the caller)");
    let (mut sat, mut under) = (0u32, 0u32);
    let mut c = [0u8; NV_BLOCK];
    for i in 0..NV_BLOCK {
        let v = x[i];
        let s = v * enc;
        // e2m1 saturates itself, so this equals TE's clamp to [-6, 6] followed by the table.
        c[i] = e2m1_from_f32(s, E2m1Convention::TeRef);
        sat += u32::from((s.abs() > 6.0) & (v.abs() < f32::INFINITY));
        under += u32::from((c[i] & 7 == 0) & (v != 0.0) & (v.abs() < f32::INFINITY));
    }
    for (j, p) in packed.iter_mut().enumerate() {
        *p = c[2 * j] | c[2 * j + 1] << 4;
    }
    stats.elements += x.len() as u64;
    stats.saturated += u64::from(sat);
    stats.underflowed += u64::from(under);
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

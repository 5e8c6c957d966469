//! MXFP8 block quantization: 32 FP8 elements share one E8M0 power-of-two scale. Spec §2 and §3.
//!
//! Two scale rules, both golden-checked:
//! - [`MxScaleRule::TeCeil`] (default, what TransformerEngine and the Blackwell recipes run):
//!   `b = ceil_e8m0(fp32(amax · fp32(1/max_elem)))`, elements `sat(x · 2^(127-b))`. NaN elements
//!   are ignored by the amax (fmaxf) and encode as NaN; nothing ever clips.
//! - [`MxScaleRule::OcpFloor`] (OCP MX v1.0 / microxcaling, RNE): `shared = floor(log2 amax) - emax`;
//!   a block max with mantissa above 1.75 clips to the element max; NaN/Inf anywhere makes the whole
//!   block NaN (scale 0xFF).

use super::QuantStats;
use super::e8m0::{e8m0_ceil_from_f32, e8m0_from_exponent, e8m0_reciprocal, e8m0_to_f32};
use super::fp8::{E4M3_TABLE, E5M2_TABLE, e4m3_code_u32_sat, e4m3_from_f32_sat, e5m2_from_f32_sat};
use super::isa::prefetch;
use super::output::zeroed;
use serde::{Deserialize, Serialize};
use std::mem::MaybeUninit;

/// Elements per MXFP8 block.
pub const MX_BLOCK: usize = 32;

/// Element format of an MX block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Fp8Elem {
    E4M3,
    E5M2,
}

impl Fp8Elem {
    fn max(self) -> f32 {
        match self {
            Fp8Elem::E4M3 => super::fp8::E4M3_MAX,
            Fp8Elem::E5M2 => super::fp8::E5M2_MAX,
        }
    }
    /// fp32(1/max) — TE multiplies by this reciprocal, it does not divide.
    fn rcp_max(self) -> f32 {
        1.0 / self.max()
    }
    /// Exponent of the element format's largest binade (E4M3: 8, E5M2: 15).
    fn emax(self) -> i32 {
        match self {
            Fp8Elem::E4M3 => 8,
            Fp8Elem::E5M2 => 15,
        }
    }
    #[inline]
    pub fn encode_sat(self, x: f32) -> u8 {
        match self {
            Fp8Elem::E4M3 => e4m3_from_f32_sat(x),
            Fp8Elem::E5M2 => e5m2_from_f32_sat(x),
        }
    }
    #[inline]
    pub fn decode(self, c: u8) -> f32 {
        match self {
            Fp8Elem::E4M3 => E4M3_TABLE[c as usize],
            Fp8Elem::E5M2 => E5M2_TABLE[c as usize],
        }
    }
}

/// How the E8M0 scale of a block is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MxScaleRule {
    TeCeil,
    OcpFloor,
}

/// floor(log2(a)) for a finite positive FP32, exact (subnormals included).
fn floor_log2(a: f32) -> i32 {
    let u = a.to_bits();
    let e = ((u >> 23) & 0xFF) as i32;
    if e != 0 {
        e - 127
    } else {
        (31 - (u & 0x7F_FFFF).leading_zeros() as i32) - 149
    }
}

/// Quantize one block (up to 32 values); writes the codes and returns the E8M0 scale byte.
#[inline]
pub fn quantize_block(
    x: &[f32],
    elem: Fp8Elem,
    rule: MxScaleRule,
    codes: &mut [u8],
    stats: &mut QuantStats,
) -> u8 {
    match rule {
        MxScaleRule::TeCeil => {
            let amax = amax_ignoring_nan(x);
            let b = e8m0_ceil_from_f32(amax * elem.rcp_max());
            let inv = e8m0_reciprocal(b);
            encode(x, inv, elem, codes, stats);
            b
        }
        MxScaleRule::OcpFloor => {
            let mut amax = 0.0f32;
            let mut nan = false;
            for v in x {
                nan |= v.is_nan();
                amax = amax.max(v.abs());
            }
            if nan || amax.is_infinite() {
                codes.fill(0x7F);
                return 0xFF;
            }
            let e = if amax == 0.0 { -126 } else { floor_log2(amax) };
            let shared = e - elem.emax();
            let b = e8m0_from_exponent(shared);
            if b == 0xFF {
                codes.fill(0x7F);
                return 0xFF;
            }
            let shared = shared.max(-127);
            let mul = 2f64.powi(-shared); // exact power of two; scaling in f64 is exact
            for (c, &v) in codes.iter_mut().zip(x) {
                let s = (v as f64 * mul) as f32;
                stats.note(v, s.abs() > elem.max());
                *c = elem.encode_sat(s);
                stats.note_underflow(v, *c & 0x7F == 0);
            }
            b
        }
    }
}

/// max |x| skipping NaN (CUDA `fmaxf` semantics, which TE's MXFP8 amax uses).
#[inline]
fn amax_ignoring_nan(x: &[f32]) -> f32 {
    let mut m = 0.0f32;
    for v in x {
        let a = v.abs();
        m = if a > m { a } else { m }; // a NaN compares false and is skipped
    }
    m
}

#[inline]
fn encode(x: &[f32], inv: f32, elem: Fp8Elem, codes: &mut [u8], stats: &mut QuantStats) {
    match elem {
        Fp8Elem::E4M3 => encode_with(
            x,
            inv,
            super::fp8::E4M3_MAX,
            e4m3_from_f32_sat,
            codes,
            stats,
        ),
        Fp8Elem::E5M2 => encode_with(
            x,
            inv,
            super::fp8::E5M2_MAX,
            e5m2_from_f32_sat,
            codes,
            stats,
        ),
    }
}

/// The per-element loop, monomorphised per element codec so it stays branch-free.
#[inline(always)]
fn encode_with(
    x: &[f32],
    inv: f32,
    max: f32,
    enc: impl Fn(f32) -> u8,
    codes: &mut [u8],
    stats: &mut QuantStats,
) {
    let (mut sat, mut under) = (0u32, 0u32);
    for (c, &v) in codes.iter_mut().zip(x) {
        let s = v * inv;
        let code = enc(s);
        sat += u32::from(s.abs() > max && v.is_finite());
        under += u32::from(code & 0x7F == 0 && v != 0.0);
        *c = code;
    }
    stats.add_block(x.len(), sat, under);
}

/// Per-thread buffers reused across rows by [`quantize_row`].
#[derive(Debug, Default)]
pub struct RowScratch {
    mult: Vec<f32>,
    block_mult: Vec<f32>,
    block_amax: Vec<f32>,
}

/// max of the sign-cleared bit patterns: |x|'s bits when no element is NaN, above 0x7F800000
/// when one is.
#[inline(always)]
fn amax_nan_propagating_bits(x: &[f32; MX_BLOCK]) -> u32 {
    x.iter().fold(0u32, |m, v| m.max(v.to_bits() & 0x7FFF_FFFF))
}

/// Every 32-element block's [`amax_ignoring_nan`] into `out`.
///
/// The NaN-propagating integer max vectorises within a block; a block holding a NaN (its max
/// bits above +Inf's) takes the NaN-skipping loop instead, which is rare and gives the same
/// amax. (The branch also keeps AVX-512 compiles from vectorising across blocks with gathers.)
#[inline(always)]
pub fn block_amaxes(x: &[f32], out: &mut [f32]) {
    for (m, x32) in out.iter_mut().zip(x.as_chunks::<MX_BLOCK>().0) {
        let a = amax_nan_propagating_bits(x32);
        *m = if a > 0x7F80_0000 {
            amax_ignoring_nan(x32)
        } else {
            f32::from_bits(a)
        };
    }
}

/// [`e8m0_ceil_from_f32`] for a non-negative, non-NaN `t`, branch-free (as u32, at most 0xFE):
/// the exponent field, plus one when the mantissa is non-zero unless `t <= 2^-127`; +Inf and
/// the bump past 0xFE saturate to 0xFE.
#[inline(always)]
fn e8m0_ceil_finite(t: f32) -> u32 {
    let u = t.to_bits();
    let (e, m) = (u >> 23, u & 0x7F_FFFF);
    let bump = (m != 0) & !((e == 0) & (m <= 0x40_0000));
    (e + u32::from(bump)).min(0xFE)
}

/// [`e8m0_reciprocal`] of a byte below 0xFF, branch-free: 2^(127-b), the subnormal 2^-127 at
/// b = 254.
#[inline(always)]
fn e8m0_reciprocal_below_ff(b: u32) -> f32 {
    f32::from_bits(if b == 254 {
        0x0040_0000
    } else {
        (254 - b) << 23
    })
}

/// Quantize one row of MXFP8 blocks (`x.len()` a multiple of 32): one E8M0 byte per block into
/// `scales`, one code per element into `codes`. Byte for byte [`quantize_block`] on each block
/// (tested over every FP32 exponent and sign, with NaN, Inf, subnormals and ties).
///
/// For the TE rule the row is done in passes, as NVFP4's row: every block's amax; the scales and
/// multipliers in one branch-free loop across blocks; then the encode (E4M3: a block at a time
/// under its multiplier; E5M2: one loop over the row with a multiplier per element). The OCP
/// rule, whose NaN/Inf blocks short-circuit, stays block by block.
#[inline(always)]
pub fn quantize_row(
    x: &[f32],
    elem: Fp8Elem,
    rule: MxScaleRule,
    scales: &mut [MaybeUninit<u8>],
    codes: &mut [MaybeUninit<u8>],
    scratch: &mut RowScratch,
) -> QuantStats {
    quantize_row_with(x, elem, rule, scales, codes, scratch, block_amaxes)
}

/// [`quantize_row`] with the TE rule's block amaxes taken by `amaxes` (`(row, out)`, as
/// [`block_amaxes`]), so a caller can run that loop from another kernel.
#[inline(always)]
pub fn quantize_row_with(
    x: &[f32],
    elem: Fp8Elem,
    rule: MxScaleRule,
    scales: &mut [MaybeUninit<u8>],
    codes: &mut [MaybeUninit<u8>],
    scratch: &mut RowScratch,
    amaxes: impl FnOnce(&[f32], &mut [f32]),
) -> QuantStats {
    let mut st = QuantStats::default();
    if rule == MxScaleRule::OcpFloor {
        // Every byte is written below; the block rule reads and fills plain bytes.
        let (scales, codes) = (zeroed(scales), zeroed(codes));
        for ((s, x32), c32) in scales
            .iter_mut()
            .zip(x.chunks_exact(MX_BLOCK))
            .zip(codes.chunks_exact_mut(MX_BLOCK))
        {
            *s = quantize_block(x32, elem, rule, c32, &mut st);
        }
        return st;
    }
    // Every element of the buffers is written below before it is read: no clearing needed.
    let nb = scales.len();
    scratch.block_mult.resize(nb, 0.0);
    scratch.block_amax.resize(nb, 0.0);
    let bm = &mut scratch.block_mult[..nb];
    let ba = &mut scratch.block_amax[..nb];
    let rcp = elem.rcp_max();
    let (x32s, _) = x.as_chunks::<MX_BLOCK>();
    // Every block's amax, then the scales in one branch-free loop across blocks.
    amaxes(&x[..x32s.len() * MX_BLOCK], ba);
    for ((s, m), &a) in scales.iter_mut().zip(bm.iter_mut()).zip(ba.iter()) {
        let b = e8m0_ceil_finite(a * rcp);
        s.write(b as u8);
        *m = e8m0_reciprocal_below_ff(b);
    }
    match elem {
        // A block at a time under its multiplier, in 32-bit lanes to the code byte (the loop
        // LLVM's SLP pass vectorises; no per-element multiplier array to write and read back).
        // The underflow count is kept per lane across the row (a sum per block is a horizontal
        // reduction per block, which dominated the loop). No element of a block can saturate
        // unless its amax does (a product with the same multiplier is monotonic in |x|), so
        // only those rare blocks are counted for saturation.
        Fp8Elem::E4M3 => {
            let max = super::fp8::E4M3_MAX;
            let mut under = [0u32; MX_BLOCK];
            let mut sat = 0u32;
            let (c32s, _) = codes.as_chunks_mut::<MX_BLOCK>();
            for (((c32, x32), &m), &a) in c32s.iter_mut().zip(x32s).zip(bm.iter()).zip(ba.iter()) {
                // The next row, as in NVFP4's row (a block is two cache lines).
                prefetch(x32.as_ptr().wrapping_add(x.len()));
                prefetch(x32.as_ptr().wrapping_add(x.len() + 16));
                for ((c, &v), u) in c32.iter_mut().zip(x32).zip(under.iter_mut()) {
                    let code = e4m3_code_u32_sat(v * m);
                    // wrapping: see `encode_row`.
                    *u = u.wrapping_add(u32::from((code & 0x7F == 0) & (v != 0.0)));
                    c.write(code as u8);
                }
                if a * m > max {
                    sat += x32
                        .iter()
                        .map(|&v| u32::from(((v * m).abs() > max) & v.is_finite()))
                        .sum::<u32>();
                }
            }
            let under = under.iter().fold(0u32, |t, &u| t.wrapping_add(u));
            st.add_block(x32s.len() * MX_BLOCK, sat, under);
        }
        Fp8Elem::E5M2 => {
            scratch.mult.resize(x.len(), 0.0);
            let mult = &mut scratch.mult[..x.len()];
            for (m32, &m) in mult.as_chunks_mut::<MX_BLOCK>().0.iter_mut().zip(bm.iter()) {
                *m32 = [m; MX_BLOCK];
            }
            let n = x32s.len() * MX_BLOCK;
            encode_row(
                &x[..n],
                mult,
                super::fp8::E5M2_MAX,
                e5m2_from_f32_sat,
                zeroed(codes),
                &mut st,
            );
        }
    }
    st
}

/// [`encode_with`] with a multiplier per element: the same element rule and counts.
#[inline(always)]
fn encode_row(
    x: &[f32],
    mult: &[f32],
    max: f32,
    enc: impl Fn(f32) -> u8,
    codes: &mut [u8],
    stats: &mut QuantStats,
) {
    let (mut sat, mut under) = (0u32, 0u32);
    for ((c, &v), &m) in codes.iter_mut().zip(x).zip(mult) {
        let s = v * m;
        let code = enc(s);
        // wrapping: a row has far fewer than 2^32 elements, and an overflow-checked add is a
        // branch that keeps the loop scalar in builds with overflow checks (the dev profile).
        sat = sat.wrapping_add(u32::from((s.abs() > max) & v.is_finite()));
        under = under.wrapping_add(u32::from((code & 0x7F == 0) & (v != 0.0)));
        *c = code;
    }
    stats.add_block(x.len(), sat, under);
}

/// Dequantize one block: `decode(code) · 2^(b-127)`; scale 0xFF gives NaN.
#[inline]
pub fn dequantize_block(codes: &[u8], scale: u8, elem: Fp8Elem, out: &mut [f32]) {
    let s = e8m0_to_f32(scale);
    for (o, &c) in out.iter_mut().zip(codes) {
        *o = elem.decode(c) * s;
    }
}

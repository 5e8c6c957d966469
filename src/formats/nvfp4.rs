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
use super::e2m1::{E2M1_VALUES, E2m1Convention, e2m1_code_u32};
use super::fp8::{E4M3_TABLE, e4m3_from_f32_sat};
use super::isa::prefetch;
use std::mem::MaybeUninit;

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
///
/// Computed on the bit patterns: for non-NaN values |x| orders like its bits with the sign
/// cleared (as u32), and every NaN's cleared bits are above +Inf's 0x7F800000. So one integer max
/// gives the answer exactly, and an integer max reduction vectorises where a float one does not.
#[inline(always)]
pub fn amax_nan_propagating(x: &[f32]) -> f32 {
    amax_from_bits(x.iter().fold(0u32, |m, v| m.max(v.to_bits() & 0x7FFF_FFFF)))
}

/// The amax whose sign-cleared bits are `m` (a maximum over bit patterns, see
/// [`amax_nan_propagating`]): NaN when any pattern was a NaN's.
#[inline(always)]
pub fn amax_from_bits(m: u32) -> f32 {
    if m > 0x7F80_0000 {
        f32::NAN
    } else {
        f32::from_bits(m)
    }
}

/// The E4M3 scale byte of one 16-element block under `g`, and the FP32 multiplier its elements
/// are encoded with (`1 / (e4m3(scale) · S_dec)`, TE's association order).
#[inline(always)]
pub fn block_scale(x: &[f32], g: &GlobalScale) -> (u8, f32) {
    scale_from_amax(amax_nan_propagating(x), g)
}

/// [`block_scale`] from the block's amax (NaN-propagating). Branch-free, and the E4M3 scale is
/// decoded arithmetically rather than from the table, so a loop over blocks vectorises.
#[inline(always)]
pub fn scale_from_amax(vec_max: f32, g: &GlobalScale) -> (u8, f32) {
    let mult = g.s_enc * RCP_6;
    let mut ds = vec_max * mult;
    if !ds.is_nan() {
        ds = ds.min(f32::MAX).clamp(-448.0, 448.0);
    }
    let scale = e4m3_from_f32_sat(ds);
    let mut enc = 1.0f32 / (e4m3_decode(scale) * g.s_dec);
    if !enc.is_nan() {
        enc = enc.min(f32::MAX);
    }
    (scale, enc)
}

/// E4M3 code → FP32 without a table lookup (equal to [`E4M3_TABLE`] for all 256 codes, tested):
/// normal codes rebias the exponent (7 → 127), subnormals are `m · 2^-9`, S.1111.111 is NaN.
#[inline(always)]
pub fn e4m3_decode(c: u8) -> f32 {
    let c = u32::from(c);
    let (e, m) = ((c >> 3) & 0xF, c & 7);
    let normal = f32::from_bits(((e + 120) << 23) | (m << 20));
    let sub = m as f32 * (1.0 / 512.0);
    let mag = if e == 0 { sub } else { normal };
    let v = f32::from_bits(mag.to_bits() | ((c & 0x80) << 24));
    if c & 0x7F == 0x7F { f32::NAN } else { v }
}

/// Encode one element `v` with its block's multiplier: (code, saturated, underflowed).
/// Saturated: `|v·enc| > 6` for finite `v`; underflowed: a finite non-zero `v` whose code is ±0.
#[inline(always)]
pub fn encode(v: f32, enc: f32) -> (u8, bool, bool) {
    let (c, sat, under) = encode_u32(v, enc);
    (c as u8, sat, under)
}

/// [`encode`] with the code in a 32-bit lane (see [`e2m1_code_u32`]).
#[inline(always)]
fn encode_u32(v: f32, enc: f32) -> (u32, bool, bool) {
    let s = v * enc;
    // e2m1 saturates itself, so this equals TE's clamp to [-6, 6] followed by the table.
    let c = e2m1_code_u32(s, E2m1Convention::TeRef);
    let b = v.to_bits() & 0x7FFF_FFFF;
    // Finite, and finite non-zero (one unsigned compare: 0 < |v| < Inf).
    let (finite, nonzero_finite) = (b < 0x7F80_0000, b.wrapping_sub(1) < 0x7F7F_FFFF);
    (c, (s.abs() > 6.0) & finite, (c & 7 == 0) & nonzero_finite)
}

/// Encode of one element of a block on the fast path ([`fast_block`]): every element finite,
/// the multiplier a (positive, finite) number. Equal there to [`encode_u32`] with its counts,
/// in fewer operations, which is what the row's time is made of:
/// - `+ 0.0` turns a −0 product into +0, so TE's table (−0 → code 0) needs no test;
/// - |s|, clamped to 6 as a bit pattern (an overflowed product is Inf, which clamps too), is
///   rounded to E2M1 by one FP32 addition: for |s| in [2^k, 2^(k+1)) with k ≥ 0, adding
///   `c = 2^(k+22)` rounds to nearest even at E2M1's step there, 2^(k-1); below 1, `c = 2^22`
///   rounds at the subnormal step 0.5 (the same `c` as k = 0, whose step is also 0.5). The sum's
///   bits minus `c`'s count the steps, and the code is that count plus 2k;
/// - saturated is |s| > 6 (a finite element, so an Inf product counts), underflowed a
///   non-zero element whose |s| rounds to 0, i.e. |s| ≤ 0.25 (the tie goes to 0).
#[inline(always)]
fn encode_fast(v: f32, enc: f32) -> (u32, bool, bool) {
    let s = v * enc + 0.0;
    let u = s.to_bits();
    let ab = u & 0x7FFF_FFFF;
    let am = ab.min(0x40C0_0000);
    let binade = (am & 0x7F80_0000).max(0x3F80_0000);
    let c = binade + (22 << 23);
    let steps = (f32::from_bits(am) + f32::from_bits(c))
        .to_bits()
        .wrapping_sub(c);
    // `binade >> 22` is twice its biased exponent, 2(k + 127).
    let mag = steps.wrapping_add(binade >> 22).wrapping_sub(254);
    let nonzero = v.to_bits() & 0x7FFF_FFFF != 0;
    (
        mag | ((u >> 28) & 8),
        ab > 0x40C0_0000,
        (ab <= 0x3E80_0000) & nonzero,
    )
}

/// Whether a block takes [`encode_fast`]: its amax (NaN-propagating) is finite, so every
/// element is, and its multiplier is a number (not NaN, which a NaN second-level scale gives).
/// Other blocks, which hold an Inf or a NaN, take the general [`encode_u32`].
#[inline(always)]
fn fast_block(amax: f32, enc: f32) -> bool {
    (amax.to_bits() < 0x7F80_0000) & !enc.is_nan()
}

/// Where a row's second-level scales come from.
pub enum RowGlobals<'a> {
    /// Known before the row (per tensor, or per token from a pass of their own): one a shard.
    Given(&'a [GlobalScale]),
    /// Per token from the row's own block amaxes, so the row is read once for both: each
    /// shard's amax (the maximum of its blocks') is written here.
    FromBlocks(&'a mut [f32]),
}

/// Per-thread buffers reused across rows by [`quantize_row`].
#[derive(Debug, Default)]
pub struct RowScratch {
    block_amax: Vec<f32>,
    block_enc: Vec<f32>,
    globals: Vec<GlobalScale>,
}

/// Quantize one row of blocks in shards of `per_shard` blocks, each with the second-level scale
/// `globals` gives it. Writes one scale byte per block into `scales` and the codes, packed two
/// a byte (element 2i in the low nibble), into `packed`: every byte of both (they may come
/// uninitialised, see `formats::output`).
///
/// Three passes over the row, each shaped so LLVM vectorises it (checked with `perf annotate`):
/// every block's amax; the block scales in one loop per shard (uniform second-level scale); the
/// encode, a block at a time, its codes then packed in pairs. The encode vectorises only with
/// every lane 32-bit to the end: a byte per code in between stayed scalar (~60 instructions an
/// element, measured with callgrind).
#[inline(always)]
pub fn quantize_row(
    x: &[f32],
    globals: RowGlobals<'_>,
    per_shard: usize,
    scales: &mut [MaybeUninit<u8>],
    packed: &mut [MaybeUninit<u8>],
    scratch: &mut RowScratch,
) -> QuantStats {
    quantize_row_with(x, globals, per_shard, scales, packed, scratch, block_amaxes)
}

/// Every 16-element block's amax ([`amax_nan_propagating`]) into `out`.
#[inline(always)]
pub fn block_amaxes(x: &[f32], out: &mut [f32]) {
    for (m, x16) in out.iter_mut().zip(x.chunks_exact(NV_BLOCK)) {
        *m = amax_nan_propagating(x16);
    }
}

/// [`quantize_row`] with the block amaxes taken by `amaxes` (`(row, out)`, as
/// [`block_amaxes`]), so a caller can run that loop from another compile than the rest.
#[inline(always)]
pub fn quantize_row_with(
    x: &[f32],
    globals: RowGlobals<'_>,
    per_shard: usize,
    scales: &mut [MaybeUninit<u8>],
    packed: &mut [MaybeUninit<u8>],
    scratch: &mut RowScratch,
    amaxes: impl FnOnce(&[f32], &mut [f32]),
) -> QuantStats {
    // Every element of these buffers is written below before it is read, so a reused buffer
    // needs no clearing (zeroing two fresh buffers per row showed up as memset in profiles).
    let nb = scales.len();
    scratch.block_amax.resize(nb, 0.0);
    scratch.block_enc.resize(nb, 0.0);
    let (bmax, benc) = (&mut scratch.block_amax[..nb], &mut scratch.block_enc[..nb]);
    amaxes(x, bmax);
    let globals = match globals {
        RowGlobals::Given(g) => g,
        RowGlobals::FromBlocks(out) => {
            // A shard's amax is the maximum of its blocks' (a NaN block amax propagating).
            scratch.globals.clear();
            for (a, m) in out.iter_mut().zip(bmax.chunks(per_shard)) {
                *a = amax_nan_propagating(m);
                scratch.globals.push(GlobalScale::from_amax(*a));
            }
            &scratch.globals[..]
        }
    };
    // The block scales as one loop per shard over its blocks (the shard's scale is uniform, so
    // the loop vectorises; a scalar chain per block was a third of the row's time).
    for (((s, e), m), g) in scales
        .chunks_mut(per_shard)
        .zip(benc.chunks_mut(per_shard))
        .zip(bmax.chunks(per_shard))
        .zip(globals)
    {
        for ((s, e), &m) in s.iter_mut().zip(e.iter_mut()).zip(m) {
            let (b, enc) = scale_from_amax(m, g);
            s.write(b);
            *e = enc;
        }
    }
    // Encoded a block at a time under its multiplier, in 32-bit lanes end to end (a byte per
    // code in between made LLVM build the bytes with inserts and extracts), and no per-element
    // multiplier array to fill. A pair of codes is packed as one 64-bit lane (`c0 | c1 << 32`,
    // then `w | w >> 28`, which ignores bits above a code's four), which keeps the block one
    // 16-lane vector. The counts are kept per element position across the row (a sum per block
    // is a horizontal reduction per block, which cost more than the encode), both in one lane:
    // saturated in bits 1-15 (counted in twos), underflowed in bits 16-31, neither able to
    // overflow into the other because the lanes are emptied every `FLUSH` blocks.
    const FLUSH: usize = 1 << 14;
    let mut stats = QuantStats::default();
    let (x16s, _) = x.as_chunks::<NV_BLOCK>();
    let (p8s, _) = packed.as_chunks_mut::<{ NV_BLOCK / 2 }>();
    let blocks = p8s.iter_mut().zip(x16s).zip(benc.iter().zip(bmax.iter()));
    let mut counts = [0u32; NV_BLOCK];
    for (i, ((p8, x16), (&e, &m))) in blocks.enumerate() {
        // The next row (a row's length ahead) is asked for while this one encodes, so the next
        // call's amax pass reads from cache instead of waiting on memory between passes.
        prefetch(x16.as_ptr().wrapping_add(x.len()));
        let mut c = [0u32; NV_BLOCK];
        if fast_block(m, e) {
            for ((c, &v), n) in c.iter_mut().zip(x16).zip(&mut counts) {
                let (code, sat, under) = encode_fast(v, e);
                *c = code;
                // Selects of constants other than 1, which LLVM turns into one masked add
                // each (a 1 became a mask-to-vector move and a subtraction).
                *n = n.wrapping_add(if sat { SAT } else { 0 });
                *n = n.wrapping_add(if under { UNDER } else { 0 });
            }
        } else {
            for ((c, &v), n) in c.iter_mut().zip(x16).zip(&mut counts) {
                let (code, sat, under) = encode_u32(v, e);
                *c = code;
                *n = n.wrapping_add(u32::from(sat) * SAT + u32::from(under) * UNDER);
            }
        }
        for (p, c2) in p8.iter_mut().zip(c.as_chunks::<2>().0) {
            let w = u64::from(c2[0]) | u64::from(c2[1]) << 32;
            p.write((w | w >> 28) as u8);
        }
        if i % FLUSH == FLUSH - 1 {
            add_counts(&mut stats, &mut counts);
        }
    }
    add_counts(&mut stats, &mut counts);
    stats.elements = x.len() as u64;
    stats
}

/// What a saturated and an underflowed element add to their lane's count in
/// [`quantize_row_with`].
const SAT: u32 = 2;
const UNDER: u32 = 1 << 16;

/// Adds the per-lane counts of [`quantize_row_with`] to `stats`, and empties the lanes.
#[inline(always)]
fn add_counts(stats: &mut QuantStats, counts: &mut [u32; NV_BLOCK]) {
    for n in counts.iter_mut() {
        stats.saturated += u64::from((*n & 0xFFFF) / SAT);
        stats.underflowed += u64::from(*n / UNDER);
        *n = 0;
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The obvious float loop the bit-pattern amax must equal.
    fn amax_reference(x: &[f32]) -> f32 {
        let mut m = 0.0f32;
        for v in x {
            if v.is_nan() {
                return f32::NAN;
            }
            m = m.max(v.abs());
        }
        m
    }

    #[test]
    fn arithmetic_e4m3_decode_equals_the_table_for_every_code() {
        for c in 0..=255u8 {
            let (a, b) = (e4m3_decode(c), E4M3_TABLE[c as usize]);
            assert!(
                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                "code {c:#04x}: {a} vs {b}"
            );
        }
    }

    #[test]
    fn bit_pattern_amax_equals_the_float_definition() {
        let specials = [
            0.0,
            -0.0,
            1e-45,
            -1e-45,
            1.17e-38,
            -3.5,
            448.0,
            f32::MAX,
            -f32::MAX,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
        ];
        let mut state = 0x1234_5678u32;
        for _ in 0..2000 {
            let block: Vec<f32> = (0..16)
                .map(|_| {
                    state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    if state.is_multiple_of(5) {
                        specials[(state >> 8) as usize % specials.len()]
                    } else {
                        f32::from_bits(state)
                    }
                })
                .collect();
            let (a, b) = (amax_nan_propagating(&block), amax_reference(&block));
            assert!(
                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                "{block:?}: {a} vs {b}"
            );
        }
        assert_eq!(amax_nan_propagating(&[-0.0, -0.0]).to_bits(), 0);
        assert_eq!(amax_nan_propagating(&[]), 0.0);
    }
}

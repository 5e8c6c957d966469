//! NVFP4 column quantization done down the input's rows ("vertically"), without an FP32
//! transpose.
//!
//! A column block is 16 consecutive input rows of one column. For a strip of adjacent columns,
//! the block's rows are contiguous vectors of the input, so every step of the block rule runs
//! element-wise across the strip: the block amax is a max over the block's rows (no horizontal
//! reduction), the scales are computed for all the strip's columns in one loop, and each row's
//! values are encoded with their column's multiplier. Only the packed codes are then transposed
//! into the blocked (column-major) layout: half a byte per value, an eighth of the bytes an FP32
//! transpose moves.
//!
//! The arithmetic is the row kernel's ([`nvfp4::quantize_row`]) term for term, so the bytes
//! equal row quantization of the transpose (tested on every bit class, for every compile).
//! MXFP8 columns keep the FP32 tile transpose (`tensor`): the same vertical scheme measured
//! slower there (`docs/benchmarks.md`).

use super::QuantStats;
use super::isa::{per_isa, prefetch_write};
use super::nvfp4::{self, NV_BLOCK};

/// Input columns one kernel call quantizes side by side: a block of them (16 rows x 128 FP32 =
/// 8 KiB) stays in L1 between its amax and its encode.
pub const STRIP: usize = 128;

/// A part of the input one kernel call quantizes: `x` starts at its first element and has row
/// stride `stride`; the part is `rows` input rows (whole blocks) by `width` columns (at most
/// [`STRIP`]).
#[derive(Clone, Copy)]
pub struct Strip<'a> {
    pub x: &'a [f32],
    pub stride: usize,
    pub rows: usize,
    pub width: usize,
}

impl Strip<'_> {
    /// Row `i` of the strip.
    #[inline(always)]
    fn row(&self, i: usize) -> &[f32] {
        &self.x[i * self.stride..][..self.width]
    }
}

/// Where a kernel call writes: column `j`'s codes at `codes[j * code_stride..]` (the call's
/// rows, in the blocked layout: a column's codes contiguous) and its block scales at
/// `scales[j * scale_stride..]`.
pub struct Dest<'a> {
    pub codes: &'a mut [u8],
    pub code_stride: usize,
    pub scales: &'a mut [u8],
    pub scale_stride: usize,
}

impl Dest<'_> {
    /// Stores block `rb`'s scale of every column (`scales[j]`, below 256), one byte a column
    /// stride apart: kept out of the scale loop, whose scattered byte stores would keep it
    /// from vectorising.
    #[inline(always)]
    fn put_scales(&mut self, rb: usize, scales: &[u32]) {
        for (j, &s) in scales.iter().enumerate() {
            self.scales[j * self.scale_stride + rb] = s as u8;
        }
    }

    /// Asks for the code lines the next call down these columns writes (`ahead` bytes past
    /// this call's first, in every column) to be brought in for writing. A column's codes are
    /// a few bytes per call, a column stride apart, a pattern the hardware prefetcher does not
    /// follow; without this every store of the transpose waited for its line to be read.
    #[inline(always)]
    fn prefetch_next(&self, width: usize, ahead: usize) {
        let p = self.codes.as_ptr().wrapping_add(ahead);
        for j in 0..width {
            prefetch_write(p.wrapping_add(j * self.code_stride));
        }
    }
}

/// `out[j]` = the max of the sign-cleared bit patterns over the strip's rows `r0..r0 + n` in
/// column `j` (see [`nvfp4::amax_nan_propagating`]). Thirty-two columns at a time down the
/// rows, so their maxima stay in registers (a row at a time kept them in memory).
#[inline(always)]
fn column_max(strip: &Strip, r0: usize, n: usize, out: &mut [u32; STRIP]) {
    const C: usize = 32;
    let full = strip.width / C * C;
    for (c, o) in out[..full].as_chunks_mut::<C>().0.iter_mut().enumerate() {
        let mut acc = [0u32; C];
        for i in r0..r0 + n {
            let row: &[f32; C] = strip.row(i)[c * C..][..C].try_into().unwrap();
            for (a, v) in acc.iter_mut().zip(row) {
                *a = (*a).max(v.to_bits() & 0x7FFF_FFFF);
            }
        }
        *o = acc;
    }
    let rest = &mut out[full..strip.width];
    rest.fill(0);
    for i in r0..r0 + n {
        for (a, v) in rest.iter_mut().zip(&strip.row(i)[full..]) {
            *a = (*a).max(v.to_bits() & 0x7FFF_FFFF);
        }
    }
}

/// The sum of per-lane counts (each far below 2^32).
fn lane_total(c: &[u32]) -> u64 {
    c.iter().map(|&v| u64::from(v)).sum()
}

/// The second-level scales of a strip's columns: shard `s` (input rows `s * shard_rows..`) of
/// column `j` has `s_enc[s * stride + j]` and `s_dec[s * stride + j]`; the strip's row 0 is
/// input row `row0`.
#[derive(Clone, Copy)]
pub struct ColumnScales<'a> {
    pub s_enc: &'a [f32],
    pub s_dec: &'a [f32],
    pub stride: usize,
    pub shard_rows: usize,
    pub row0: usize,
}

per_isa! {
    /// NVFP4 of one strip's columns: two codes a byte (the upper row's in the high nibble)
    /// and one E4M3 byte per block into `dest`, under the second-level scales `g`.
    pub fn nvfp4_strip(strip: Strip, g: ColumnScales, dest: Dest) -> QuantStats = nvfp4_strip_kernel;
}

/// Per block of 16 rows: the column amaxes (NaN propagating, as [`nvfp4::block_amaxes`]), each
/// column's scale and multiplier under its shard's second-level scale, then the rows encoded a
/// pair at a time into packed bytes (`[8, width]`, row 2k in the low nibble) that are transposed
/// into the columns' packed codes.
#[inline(always)]
fn nvfp4_strip_kernel(strip: Strip, g: ColumnScales, mut dest: Dest) -> QuantStats {
    let (w, rows) = (strip.width, strip.rows);
    dest.prefetch_next(w, rows / 2);
    let (mut amax, mut scale) = ([0u32; STRIP], [0u32; STRIP]);
    let mut mult = [0f32; STRIP];
    let mut tile = [0u8; NV_BLOCK / 2 * STRIP];
    let (mut sat, mut under) = ([0u32; STRIP], [0u32; STRIP]);
    for rb in 0..rows / NV_BLOCK {
        let r0 = rb * NV_BLOCK;
        let shard = (g.row0 + r0) / g.shard_rows;
        let s_enc = &g.s_enc[shard * g.stride..][..w];
        let s_dec = &g.s_dec[shard * g.stride..][..w];
        column_max(&strip, r0, NV_BLOCK, &mut amax);
        let lanes = mult[..w].iter_mut().zip(&mut scale[..w]).zip(&amax[..w]);
        for (((m, sc), &a), (&e, &d)) in lanes.zip(s_enc.iter().zip(s_dec)) {
            let (s, enc) = nvfp4::scale_from_parts(nvfp4::amax_from_bits(a), e, d);
            *sc = u32::from(s);
            *m = enc;
        }
        dest.put_scales(rb, &scale[..w]);
        for k in 0..NV_BLOCK / 2 {
            let (lo, hi) = (strip.row(r0 + 2 * k), strip.row(r0 + 2 * k + 1));
            let trow = &mut tile[k * w..][..w];
            let lanes = trow.iter_mut().zip(lo.iter().zip(hi)).zip(&mult[..w]);
            for (((p, (&v0, &v1)), &m), (s, u)) in lanes.zip(sat.iter_mut().zip(under.iter_mut())) {
                let (c0, s0, u0) = nvfp4::encode_u32(v0, m);
                let (c1, s1, u1) = nvfp4::encode_u32(v1, m);
                // wrapping: see `nvfp4::quantize_row`'s counts.
                *s = s.wrapping_add(u32::from(s0) + u32::from(s1));
                *u = u.wrapping_add(u32::from(u0) + u32::from(u1));
                *p = (c0 | c1 << 4) as u8;
            }
        }
        let codes = &mut dest.codes[r0 / 2..];
        transpose_bytes(&tile, w, NV_BLOCK / 2, w, codes, dest.code_stride);
    }
    QuantStats {
        elements: (w * rows) as u64,
        saturated: lane_total(&sat),
        underflowed: lane_total(&under),
    }
}

/// `dst[j * ds + i] = src[i * ss + j]` for `i < h`, `j < w`: the `h x w` byte matrix at the
/// start of `src` (row stride `ss`) transposed into `dst` (row stride `ds`).
///
/// Where `h` is 8 or 16 (or a multiple of 16), sixteen columns at a time go through SSE2
/// register transposes ([`transpose16x16_sse2`], [`transpose8x16_sse2`]); the remaining columns,
/// other heights and other targets go byte by byte ([`transpose_bytes_scalar`]), the definition
/// they are tested against.
#[inline(always)]
pub fn transpose_bytes(src: &[u8], ss: usize, h: usize, w: usize, dst: &mut [u8], ds: usize) {
    if h == 0 || w == 0 {
        return;
    }
    assert!(src.len() >= (h - 1) * ss + w && dst.len() >= (w - 1) * ds + h);
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if h == 8 || h.is_multiple_of(16) {
        done = w / 16 * 16;
        for j in (0..done).step_by(16) {
            for i in (0..h).step_by(16) {
                // SAFETY: rows i..i + min(16, h) and columns j..j + 16 of `src` lie inside the
                // bounds asserted above, and so do their transposes in `dst`; SSE2 is part of
                // every x86-64 target.
                unsafe {
                    let (s, d) = (
                        src.as_ptr().add(i * ss + j),
                        dst.as_mut_ptr().add(j * ds + i),
                    );
                    if h == 8 {
                        transpose8x16_sse2(s, ss, d, ds);
                    } else {
                        transpose16x16_sse2(s, ss, d, ds);
                    }
                }
            }
        }
    }
    if done < w {
        transpose_bytes_scalar(&src[done..], ss, h, w - done, &mut dst[done * ds..], ds);
    }
}

/// [`transpose_bytes`] byte by byte.
#[inline(always)]
pub fn transpose_bytes_scalar(
    src: &[u8],
    ss: usize,
    h: usize,
    w: usize,
    dst: &mut [u8],
    ds: usize,
) {
    for j in 0..w {
        for i in 0..h {
            dst[j * ds + i] = src[i * ss + j];
        }
    }
}

/// One round of the byte-interleave transpose: register `2i` and `2i + 1` take the low and high
/// interleave of registers `i` and `i + n/2`. Seen on the bits of (register, byte position),
/// each round rotates them left by one, so `log2` of the element count of rounds transposes.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn interleave_round<const N: usize>(
    r: [std::arch::x86_64::__m128i; N],
) -> [std::arch::x86_64::__m128i; N] {
    use std::arch::x86_64::*;
    // SAFETY: SSE2 is part of every x86-64 target.
    std::array::from_fn(|k| unsafe {
        let (a, b) = (r[k / 2], r[k / 2 + N / 2]);
        if k % 2 == 0 {
            _mm_unpacklo_epi8(a, b)
        } else {
            _mm_unpackhi_epi8(a, b)
        }
    })
}

/// A 16x16 byte transpose in SSE2 registers: four interleave rounds rotate the 8 bits of
/// (row, column) by four.
///
/// # Safety
/// `src` must be readable for 16 rows of 16 bytes at stride `ss`, `dst` writable for 16 rows of
/// 16 bytes at stride `ds`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn transpose16x16_sse2(src: *const u8, ss: usize, dst: *mut u8, ds: usize) {
    use std::arch::x86_64::*;
    // SAFETY: the caller guarantees both sides are in bounds.
    unsafe {
        let r: [__m128i; 16] = std::array::from_fn(|i| _mm_loadu_si128(src.add(i * ss).cast()));
        let r = interleave_round(interleave_round(interleave_round(interleave_round(r))));
        for (j, v) in r.iter().enumerate() {
            _mm_storeu_si128(dst.add(j * ds).cast(), *v);
        }
    }
}

/// An 8x16 byte matrix transposed to 16 rows of 8: three interleave rounds rotate the 7 bits of
/// (row, column) by three, leaving columns 2k and 2k + 1 in the low and high half of register k.
///
/// # Safety
/// `src` must be readable for 8 rows of 16 bytes at stride `ss`, `dst` writable for 16 rows of
/// 8 bytes at stride `ds`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn transpose8x16_sse2(src: *const u8, ss: usize, dst: *mut u8, ds: usize) {
    use std::arch::x86_64::*;
    // SAFETY: the caller guarantees both sides are in bounds.
    unsafe {
        let r: [__m128i; 8] = std::array::from_fn(|i| _mm_loadu_si128(src.add(i * ss).cast()));
        let r = interleave_round(interleave_round(interleave_round(r)));
        for (k, v) in r.iter().enumerate() {
            _mm_storel_epi64(dst.add(2 * k * ds).cast(), *v);
            _mm_storel_epi64(dst.add((2 * k + 1) * ds).cast(), _mm_unpackhi_epi64(*v, *v));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(n: usize, seed: u32) -> Vec<u8> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (s >> 24) as u8
            })
            .collect()
    }

    #[test]
    fn byte_transpose_equals_the_element_definition() {
        for h in [1, 3, 8, 16, 32, 48] {
            for w in [1, 5, 16, 17, 40, 128] {
                let (ss, ds) = (w + 3, h + 5);
                let src = bytes(h * ss, (h * 1000 + w) as u32);
                let mut fast = vec![0u8; w * ds];
                let mut slow = vec![0u8; w * ds];
                transpose_bytes(&src, ss, h, w, &mut fast, ds);
                transpose_bytes_scalar(&src, ss, h, w, &mut slow, ds);
                assert_eq!(fast, slow, "{h}x{w}");
            }
        }
    }
}

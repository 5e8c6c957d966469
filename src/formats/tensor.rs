//! 2-D tensors through the block quantizers.
//!
//! A tensor `x` of shape `[rows, cols]` (row-major FP32) is quantized along an [`Axis`]:
//! - `Row`: blocks run along each row (the K dimension of the forward GEMM's `x · Wᵀ`);
//! - `Col`: blocks run down each column (the backward's transposed use). The two copies are
//!   quantized independently from the original, never one from the other (spec §3.2).
//!
//! Layout: every quantized tensor stores its *blocked view* row-major, blocks contiguous. For `Row`
//! that is `x` itself; for `Col` it is `xᵀ` (`[cols, rows]`) — the K-major layout a backward GEMM
//! reads, and the layout TE uses for NVFP4's column-wise copy. (TE keeps MXFP8 column-wise data
//! untransposed; lockstep transposes both so that column quantization of X is, byte for byte, row
//! quantization of Xᵀ — one rule instead of two.) [`QuantizedTensor::dequantize`] returns the
//! original `[rows, cols]` orientation.
//!
//! Rows are processed in parallel; each row's codes depend only on that row (and on precomputed
//! tensor-level scales), so results are identical whatever the thread count.

use super::bf16::{bf16_from_f32, bf16_to_f32};
use super::e2m1::unpack_fp4;
use super::fp8_block::{self, Fp8BlockVariant, TILE};
use super::isa::{Isa, per_isa};
use super::mxfp8::{self, Fp8Elem, MX_BLOCK, MxScaleRule};
use super::nvfp4::{self, GlobalScale, NV_BLOCK, amax_nan_propagating};
use super::output::written_by;
use super::{FormatError, QuantStats};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::mem::MaybeUninit;
use std::ops::Range;

/// Which dimension the blocks run along.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Axis {
    Row,
    Col,
}

/// NVFP4 second-level (FP32) scale granularity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SecondScale {
    /// One amax for the whole tensor (per shard): a token's codes depend on its batch neighbours.
    PerTensor,
    /// One amax per row (= per token): a token's codes depend on that token alone.
    PerToken,
}

/// FP8 block-scaling tile shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fp8Tile {
    /// 1x128 along K (activations, per token).
    Act1x128,
    /// 128x128 (weights).
    Weight128x128,
}

/// A complete quantization recipe for one tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "format", rename_all = "kebab-case")]
pub enum QuantFormat {
    /// Round to BF16 (no scales).
    Bf16,
    Mxfp8 {
        elem: Fp8Elem,
        rule: MxScaleRule,
    },
    Nvfp4 {
        second: SecondScale,
        shards: usize,
    },
    Fp8Block {
        tile: Fp8Tile,
        variant: Fp8BlockVariant,
    },
}

impl QuantFormat {
    /// MXFP8 as the Blackwell recipes run it (E4M3, TE ceil scale).
    pub const MXFP8: QuantFormat = QuantFormat::Mxfp8 {
        elem: Fp8Elem::E4M3,
        rule: MxScaleRule::TeCeil,
    };

    /// A short display name, e.g. `mxfp8`, `nvfp4(per-token, 2 shards)`.
    pub fn name(&self) -> String {
        match self {
            QuantFormat::Bf16 => "bf16".into(),
            QuantFormat::Mxfp8 { elem, rule } => format!("mxfp8({elem:?}, {rule:?})"),
            QuantFormat::Nvfp4 { second, shards } => format!("nvfp4({second:?}, {shards} shards)"),
            QuantFormat::Fp8Block { tile, variant } => format!("fp8-block({tile:?}, {variant:?})"),
        }
    }

    /// Whether every dequantized value is a BF16 value: BF16 rounding, and MXFP8, whose FP8
    /// element (at most 4 significant bits) times a power-of-two E8M0 scale needs no more than
    /// BF16's 8, in the same exponent range (but below 2^-126, where BF16 keeps fewer subnormal
    /// bits than FP32: there a value differs from its BF16 by less than 2^-133). NVFP4's FP32
    /// second-level scale and FP8 block's FP32 scales leave up to 24 significant bits.
    pub fn decodes_to_bf16(&self) -> bool {
        matches!(self, QuantFormat::Bf16 | QuantFormat::Mxfp8 { .. })
    }

    /// Elements per block along the blocked dimension that the shape must divide (1 when any
    /// length works: BF16, and FP8 block tiles, whose last tile may be partial as in DeepSeek-V3).
    pub fn required_multiple(&self) -> usize {
        match self {
            QuantFormat::Bf16 | QuantFormat::Fp8Block { .. } => 1,
            QuantFormat::Mxfp8 { .. } => MX_BLOCK,
            QuantFormat::Nvfp4 { shards, .. } => NV_BLOCK * shards,
        }
    }
}

/// Block scales of a quantized tensor, row-major over the blocked view.
#[derive(Debug, Clone, PartialEq)]
pub enum Scales {
    None,
    /// MXFP8: `[rows, cols/32]` E8M0 bytes.
    E8m0(Vec<u8>),
    /// NVFP4: `[rows, cols/16]` E4M3 bytes.
    E4m3(Vec<u8>),
    /// FP8 block: decode multipliers, `[rows, ceil(cols/128)]` (1x128) or
    /// `[ceil(rows/128), ceil(cols/128)]` (128x128).
    F32(Vec<f32>),
}

/// A quantized 2-D tensor: codes, scales, second-level scales and the layout needed to read them.
#[derive(Debug, Clone)]
pub struct QuantizedTensor {
    pub format: QuantFormat,
    pub axis: Axis,
    /// Shape of the original tensor.
    pub rows: usize,
    pub cols: usize,
    /// Codes of the blocked view (see module doc): one byte per element; FP4 two per byte (element
    /// 2i in the low nibble); BF16 two bytes per element, little-endian.
    pub codes: Vec<u8>,
    pub scales: Scales,
    /// NVFP4 only: FP32 global amax, `[shards]` per tensor or `[blocked rows, shards]` per token.
    pub global_amax: Vec<f32>,
    /// Saturation and underflow counts of this quantization.
    pub stats: QuantStats,
}

impl QuantizedTensor {
    /// Shape of the blocked view (`[rows, cols]` for `Row`, `[cols, rows]` for `Col`).
    pub fn blocked_shape(&self) -> (usize, usize) {
        blocked_shape(self.rows, self.cols, self.axis)
    }

    /// Unpacked 4-bit codes of an NVFP4 tensor (or the raw codes of other formats).
    pub fn unpacked_codes(&self) -> Vec<u8> {
        match self.format {
            QuantFormat::Nvfp4 { .. } => unpack_fp4(&self.codes, self.rows * self.cols),
            _ => self.codes.clone(),
        }
    }

    /// Back to FP32 in the original `[rows, cols]` orientation.
    pub fn dequantize(&self) -> Vec<f32> {
        let (br, bc) = self.blocked_shape();
        let mut out = vec![0.0f32; br * bc];
        self.dequantize_blocked(&mut out);
        match self.axis {
            Axis::Row => out,
            Axis::Col => transpose(&out, br, bc),
        }
    }

    fn dequantize_blocked(&self, out: &mut [f32]) {
        let (br, bc) = self.blocked_shape();
        if br == 0 || bc == 0 {
            return;
        }
        let min_rows = (16 * 1024 / bc).max(1);
        match (&self.format, &self.scales) {
            (QuantFormat::Bf16, _) => {
                for (o, b) in out.iter_mut().zip(self.codes.chunks_exact(2)) {
                    *o = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
                }
            }
            (QuantFormat::Mxfp8 { elem, .. }, Scales::E8m0(s)) => {
                let nb = bc / MX_BLOCK;
                out.par_chunks_mut(bc)
                    .with_min_len(min_rows)
                    .enumerate()
                    .for_each(|(r, orow)| {
                        let crow = &self.codes[r * bc..(r + 1) * bc];
                        for b in 0..nb {
                            let span = b * MX_BLOCK..(b + 1) * MX_BLOCK;
                            mxfp8::dequantize_block(
                                &crow[span.clone()],
                                s[r * nb + b],
                                *elem,
                                &mut orow[span],
                            );
                        }
                    });
            }
            (QuantFormat::Nvfp4 { second, shards }, Scales::E4m3(s)) => {
                let nb = bc / NV_BLOCK;
                let per_shard = nb / shards;
                let half = bc / 2;
                out.par_chunks_mut(bc)
                    .with_min_len(min_rows)
                    .enumerate()
                    .for_each(|(r, orow)| {
                        let crow = unpack_fp4(&self.codes[r * half..(r + 1) * half], bc);
                        for b in 0..nb {
                            let g = global_index(*second, *shards, r, b / per_shard);
                            let span = b * NV_BLOCK..(b + 1) * NV_BLOCK;
                            nvfp4::dequantize_block(
                                &crow[span.clone()],
                                s[r * nb + b],
                                self.global_amax[g],
                                &mut orow[span],
                            );
                        }
                    });
            }
            (QuantFormat::Fp8Block { tile, .. }, Scales::F32(s)) => {
                let tc = bc.div_ceil(TILE);
                out.par_chunks_mut(bc)
                    .with_min_len(min_rows)
                    .enumerate()
                    .for_each(|(r, orow)| {
                        let tr = match tile {
                            Fp8Tile::Act1x128 => r,
                            Fp8Tile::Weight128x128 => r / TILE,
                        };
                        let crow = &self.codes[r * bc..(r + 1) * bc];
                        let srow = &s[tr * tc..(tr + 1) * tc];
                        for ((o, c), &sc) in orow.chunks_mut(TILE).zip(crow.chunks(TILE)).zip(srow)
                        {
                            for (o, &c) in o.iter_mut().zip(c) {
                                *o = fp8_block::decode(c, sc);
                            }
                        }
                    });
            }
            _ => unreachable!("scales variant always matches the format (built by `quantize`)"),
        }
    }
}

fn blocked_shape(rows: usize, cols: usize, axis: Axis) -> (usize, usize) {
    match axis {
        Axis::Row => (rows, cols),
        Axis::Col => (cols, rows),
    }
}

/// Index into `global_amax` of blocked row `r`, shard `s`.
fn global_index(second: SecondScale, shards: usize, r: usize, s: usize) -> usize {
    match second {
        SecondScale::PerTensor => s,
        SecondScale::PerToken => r * shards + s,
    }
}

/// Row-major transpose of a `[r, c]` matrix, in parallel over bands of 32 output rows. Each band
/// reads a `[r, 32]` strip of `x` (32 floats = two cache lines of every row) and writes its
/// output rows contiguously, in tiles of 32 so both sides stay in L1.
pub fn transpose(x: &[f32], r: usize, c: usize) -> Vec<f32> {
    const B: usize = 32;
    let mut t = vec![0.0f32; r * c];
    if r == 0 || c == 0 {
        return t;
    }
    t.par_chunks_mut(B * r).enumerate().for_each(|(jb, band)| {
        let j0 = jb * B;
        let bw = band.len() / r;
        for i0 in (0..r).step_by(B) {
            let bh = B.min(r - i0);
            let mut tile = [[0.0f32; B]; B];
            for (ii, trow) in tile.iter_mut().enumerate().take(bh) {
                let src = &x[(i0 + ii) * c + j0..][..bw];
                trow[..bw].copy_from_slice(src);
            }
            for (jj, out) in band.chunks_exact_mut(r).enumerate() {
                for (ii, o) in out[i0..i0 + bh].iter_mut().enumerate() {
                    *o = tile[ii][jj];
                }
            }
        }
    });
    t
}

/// The input seen as its blocked view (see the module doc) without materialising the transpose:
/// [`Blocked::rows_into`] hands out a band of blocked rows as one contiguous slice.
#[derive(Clone, Copy)]
struct Blocked<'a> {
    x: &'a [f32],
    rows: usize,
    cols: usize,
    axis: Axis,
}

/// Column quantization works on tiles of the input: a task takes a strip of `COL_STRIP` input
/// columns (its blocked rows) and walks down it `COL_TILE` input rows at a time, transposing
/// each tile into a buffer that stays in L2 and quantizing the tile's pieces of blocked rows.
/// Each input row gives the strip 256 contiguous bytes: four cache lines for every page the
/// walk down the strip visits. (A 128-column strip with 256-row tiles measured no faster.)
const COL_STRIP: usize = 64;
/// Input rows per column tile (a multiple of both block sizes): long enough that a row kernel
/// call covers 16 MXFP8 or 32 NVFP4 blocks.
const COL_TILE: usize = 512;

impl<'a> Blocked<'a> {
    fn shape(&self) -> (usize, usize) {
        blocked_shape(self.rows, self.cols, self.axis)
    }

    /// Blocked rows per parallel task: about 16 K elements of rows, or a strip of columns.
    fn band(&self) -> usize {
        match self.axis {
            Axis::Row => (16 * 1024 / self.cols).max(1),
            Axis::Col => COL_STRIP,
        }
    }

    /// The element ranges of a blocked row that one row kernel call takes: the whole row for
    /// row blocks; for column blocks, runs of at most `COL_TILE` that stay inside one of
    /// `shards` equal parts of the row, so every run has a single second-level scale.
    fn segments(&self, shards: usize) -> Vec<Range<usize>> {
        let (_, bc) = self.shape();
        match self.axis {
            Axis::Row => std::iter::once(0..bc).collect(),
            Axis::Col => {
                let w = bc / shards;
                (0..shards)
                    .flat_map(|s| {
                        let end = (s + 1) * w;
                        (s * w..end)
                            .step_by(COL_TILE)
                            .map(move |a| a..(a + COL_TILE).min(end))
                    })
                    .collect()
            }
        }
    }

    /// Elements `seg` of blocked rows `r0..r0 + n`, as one slice and its row stride: borrowed
    /// for row blocks (where `seg` is the whole row); for column blocks, the input's tile
    /// (rows `seg`, columns `r0..r0 + n`) transposed into `buf`.
    fn tile_into<'b>(
        &self,
        r0: usize,
        n: usize,
        seg: Range<usize>,
        buf: &'b mut Vec<f32>,
    ) -> (&'b [f32], usize)
    where
        'a: 'b,
    {
        match self.axis {
            Axis::Row => (&self.x[r0 * self.cols..(r0 + n) * self.cols], self.cols),
            Axis::Col => {
                // A cache line of padding per row: rows a power of two apart share L1 sets.
                let stride = seg.len() + 16;
                // Every element read later is written by the transpose: no clearing needed.
                buf.resize(n * stride, 0.0);
                let x = &self.x[seg.start * self.cols + r0..];
                transpose_tile(x, self.cols, seg.len(), n, buf, stride);
                (buf, stride)
            }
        }
    }

    /// Per-token NVFP4 amax of the column blocks' blocked rows `r0..r0 + n` (input columns),
    /// one per shard, into `out` (`[n, shards]`): maxima taken down the input's rows, the
    /// strip's columns side by side (a max is exact in any order, so no transpose is needed).
    /// Row blocks take theirs from their block amaxes in the row's own pass instead
    /// ([`nvfp4::RowGlobals::FromBlocks`]).
    fn column_token_amax_into(
        &self,
        isa: Isa,
        r0: usize,
        n: usize,
        shards: usize,
        out: &mut [f32],
    ) {
        debug_assert_eq!(self.axis, Axis::Col);
        let h = self.rows / shards;
        let mut bits = vec![0u32; n];
        for s in 0..shards {
            let x = &self.x[s * h * self.cols + r0..];
            column_amax_bits(isa, x, self.cols, h, &mut bits);
            for (t, &b) in bits.iter().enumerate() {
                out[t * shards + s] = nvfp4::amax_from_bits(b);
            }
        }
    }
}

per_isa! {
    /// max |x| with NaN propagating ([`nvfp4::amax_nan_propagating`]) compiled for `isa`.
    fn amax_of(x: &[f32]) -> f32 = nvfp4::amax_nan_propagating;
}

per_isa! {
    /// The sign-cleared bit maxima of the first `out.len()` columns over `h` rows of `x` (row
    /// stride `xs`), see [`nvfp4::amax_nan_propagating`]; vectorised across the columns.
    fn column_amax_bits(x: &[f32], xs: usize, h: usize, out: &mut [u32]) -> () = column_amax_bits_kernel;
}

#[inline(always)]
fn column_amax_bits_kernel(x: &[f32], xs: usize, h: usize, out: &mut [u32]) {
    out.fill(0);
    let n = out.len();
    for i in 0..h {
        for (m, v) in out.iter_mut().zip(&x[i * xs..i * xs + n]) {
            *m = (*m).max(v.to_bits() & 0x7FFF_FFFF);
        }
    }
}

/// Copies the `h x w` block at the start of `x` (row stride `xs`) transposed into `out` (row
/// stride `os`): `out[j * os + i] = x[i * xs + j]`. 8x8 register transposes where the CPU has
/// AVX2 (a strided element-by-element copy was the column quantizers' largest cost), element
/// by element otherwise.
fn transpose_tile(x: &[f32], xs: usize, h: usize, w: usize, out: &mut [f32], os: usize) {
    if h == 0 || w == 0 {
        return;
    }
    assert!(x.len() >= (h - 1) * xs + w && out.len() >= (w - 1) * os + h);
    #[cfg(target_arch = "x86_64")]
    if Isa::Avx2.available() {
        // SAFETY: AVX2 is available (checked just above); the bounds are asserted above.
        return unsafe { transpose_tile_avx2(x, xs, h, w, out, os) };
    }
    transpose_edges(x, xs, (h, w), (0, 0), out, os);
}

/// The elements of the `h x w` transpose outside the leading `h8 x w8` part.
#[inline(always)]
fn transpose_edges(
    x: &[f32],
    xs: usize,
    (h, w): (usize, usize),
    (h8, w8): (usize, usize),
    out: &mut [f32],
    os: usize,
) {
    for i in 0..h {
        let j0 = if i < h8 { w8 } else { 0 };
        for j in j0..w {
            out[j * os + i] = x[i * xs + j];
        }
    }
}

/// [`transpose_tile`] in 8x8 blocks of AVX2 registers, the edges element by element.
///
/// # Safety
/// The CPU must support AVX2; `x` must hold `(h - 1) * xs + w` elements and `out`
/// `(w - 1) * os + h`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn transpose_tile_avx2(
    x: &[f32],
    xs: usize,
    h: usize,
    w: usize,
    out: &mut [f32],
    os: usize,
) {
    let (h8, w8) = (h / 8 * 8, w / 8 * 8);
    for i in (0..h8).step_by(8) {
        for j in (0..w8).step_by(8) {
            // SAFETY: rows i..i + 8 and columns j..j + 8 lie inside the bounds the caller
            // guarantees, and so do their transposes.
            unsafe {
                transpose8x8_avx2(
                    x.as_ptr().add(i * xs + j),
                    xs,
                    out.as_mut_ptr().add(j * os + i),
                    os,
                )
            };
        }
    }
    transpose_edges(x, xs, (h, w), (h8, w8), out, os);
}

/// One 8x8 FP32 transpose in AVX2 registers (unpack, shuffle, then swap 128-bit halves).
///
/// # Safety
/// The CPU must support AVX2; `x` must be readable for 8 rows of 8 floats at stride `xs`, and
/// `out` writable for 8 rows of 8 floats at stride `os`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn transpose8x8_avx2(x: *const f32, xs: usize, out: *mut f32, os: usize) {
    use std::arch::x86_64::*;
    // SAFETY: the caller guarantees the 8 rows of both sides are in bounds.
    unsafe {
        let r: [__m256; 8] = std::array::from_fn(|k| _mm256_loadu_ps(x.add(k * xs)));
        let t = [
            _mm256_unpacklo_ps(r[0], r[1]),
            _mm256_unpackhi_ps(r[0], r[1]),
            _mm256_unpacklo_ps(r[2], r[3]),
            _mm256_unpackhi_ps(r[2], r[3]),
            _mm256_unpacklo_ps(r[4], r[5]),
            _mm256_unpackhi_ps(r[4], r[5]),
            _mm256_unpacklo_ps(r[6], r[7]),
            _mm256_unpackhi_ps(r[6], r[7]),
        ];
        // u[k] (k < 4): rows 0-3 of column k in its low half, of column k + 4 in its high half;
        // u[k + 4]: the same for rows 4-7.
        let u = [
            _mm256_shuffle_ps::<0x44>(t[0], t[2]),
            _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
            _mm256_shuffle_ps::<0x44>(t[1], t[3]),
            _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
            _mm256_shuffle_ps::<0x44>(t[4], t[6]),
            _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
            _mm256_shuffle_ps::<0x44>(t[5], t[7]),
            _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
        ];
        for k in 0..4 {
            _mm256_storeu_ps(
                out.add(k * os),
                _mm256_permute2f128_ps::<0x20>(u[k], u[k + 4]),
            );
            _mm256_storeu_ps(
                out.add((k + 4) * os),
                _mm256_permute2f128_ps::<0x31>(u[k], u[k + 4]),
            );
        }
    }
}

fn validate(
    x: &[f32],
    rows: usize,
    cols: usize,
    fmt: &QuantFormat,
    axis: Axis,
) -> Result<(), FormatError> {
    validate_len(x.len(), rows, cols, fmt, axis)
}

/// Shape and option checks of a tensor of `len` values, shared by this quantizer and the CUDA
/// kernels (`engine::backend::cuda`), so both refuse the same inputs with the same message.
pub(crate) fn validate_len(
    len: usize,
    rows: usize,
    cols: usize,
    fmt: &QuantFormat,
    axis: Axis,
) -> Result<(), FormatError> {
    if len != rows * cols {
        return Err(FormatError::ShapeMismatch {
            rows,
            cols,
            got: len,
            want: rows * cols,
        });
    }
    if rows == 0 || cols == 0 {
        return Err(FormatError::Empty { rows, cols });
    }
    if let QuantFormat::Nvfp4 { shards, .. } = fmt
        && *shards == 0
    {
        return Err(FormatError::Option("NVFP4 needs at least 1 shard".into()));
    }
    let m = fmt.required_multiple();
    let (dim, name, size) = match axis {
        Axis::Row => (1, "cols", cols),
        Axis::Col => (0, "rows", rows),
    };
    if size % m != 0 {
        let format = match fmt {
            QuantFormat::Nvfp4 { shards, .. } if *shards > 1 => {
                format!("NVFP4 ({shards} shards x 16)")
            }
            QuantFormat::Nvfp4 { .. } => "NVFP4".to_string(),
            _ => "MXFP8".to_string(),
        };
        return Err(FormatError::NotDivisible {
            dim,
            name,
            size,
            format,
            block: m,
        });
    }
    Ok(())
}

/// Quantize `x` (`[rows, cols]`, row-major) along `axis`.
pub fn quantize(
    x: &[f32],
    rows: usize,
    cols: usize,
    fmt: &QuantFormat,
    axis: Axis,
) -> Result<QuantizedTensor, FormatError> {
    validate(x, rows, cols, fmt, axis)?;
    let src = Blocked {
        x,
        rows,
        cols,
        axis,
    };
    let mut q = match *fmt {
        // MXFP8 and NVFP4 columns are transposed a band of columns at a time into a per-thread
        // buffer that stays in cache, never as a whole second copy of the tensor.
        QuantFormat::Mxfp8 { elem, rule } => quantize_mxfp8(src, elem, rule),
        // Per token, each row's amax is taken in its row's pass (the row is then in cache for
        // the encode); per tensor, the whole tensor's amax must be known first.
        QuantFormat::Nvfp4 {
            second: SecondScale::PerToken,
            shards,
        } => quantize_nvfp4_with(src, SecondScale::PerToken, shards, None),
        QuantFormat::Nvfp4 { second, shards } => {
            let amax = nvfp4_tensor_amax(src, shards);
            quantize_nvfp4_with(src, second, shards, Some(amax))
        }
        QuantFormat::Bf16 | QuantFormat::Fp8Block { .. } => {
            let owned;
            let xb: &[f32] = match axis {
                Axis::Row => x,
                Axis::Col => {
                    owned = transpose(x, rows, cols);
                    &owned
                }
            };
            let (br, bc) = blocked_shape(rows, cols, axis);
            match *fmt {
                QuantFormat::Fp8Block { tile, variant } => {
                    quantize_fp8_block(xb, br, bc, tile, variant)
                }
                _ => quantize_bf16(xb),
            }
        }
    };
    q.format = *fmt;
    q.axis = axis;
    q.rows = rows;
    q.cols = cols;
    Ok(q)
}

/// Quantize then dequantize into `out` (`[rows, cols]`): the FP32 values a GEMM on the quantized
/// operand sees. Goes through [`quantize`], so it is the same bytes the weight export ships.
pub fn fake_quantize(
    x: &[f32],
    rows: usize,
    cols: usize,
    fmt: &QuantFormat,
    axis: Axis,
    out: &mut [f32],
) -> Result<QuantStats, FormatError> {
    if let (QuantFormat::Bf16, Axis::Row) = (fmt, axis) {
        validate(x, rows, cols, fmt, axis)?;
        return Ok(fake_quantize_bf16(x, out));
    }
    let q = quantize(x, rows, cols, fmt, axis)?;
    match axis {
        Axis::Row => q.dequantize_blocked(out),
        Axis::Col => out.copy_from_slice(&q.dequantize()),
    }
    Ok(q.stats)
}

/// Quantize several NVFP4 tensors (e.g. a gate and an up projection) under one shared second-level
/// scale: the global amax is the maximum over all parts (per shard, and per row for per-token
/// scales, which then needs equal row counts). Each part is `(data, rows)`; all share `cols`.
pub fn quantize_nvfp4_joint(
    parts: &[(&[f32], usize)],
    cols: usize,
    second: SecondScale,
    shards: usize,
) -> Result<Vec<QuantizedTensor>, FormatError> {
    let fmt = QuantFormat::Nvfp4 { second, shards };
    for &(x, rows) in parts {
        validate(x, rows, cols, &fmt, Axis::Row)?;
    }
    if second == SecondScale::PerToken && parts.windows(2).any(|w| w[0].1 != w[1].1) {
        return Err(FormatError::Option(
            "a joint per-token NVFP4 quantization needs equal row counts".into(),
        ));
    }
    let mut joint: Option<Vec<f32>> = None;
    for &(x, rows) in parts {
        let a = nvfp4_global_amax(x, rows, cols, second, shards);
        joint = Some(match joint {
            None => a,
            Some(j) => j.iter().zip(&a).map(|(p, q)| nan_max(*p, *q)).collect(),
        });
    }
    let joint = joint.unwrap_or_default();
    Ok(parts
        .iter()
        .map(|&(x, rows)| {
            let src = Blocked {
                x,
                rows,
                cols,
                axis: Axis::Row,
            };
            let mut q = quantize_nvfp4_with(src, second, shards, Some(joint.clone()));
            q.format = fmt;
            q.rows = rows;
            q.cols = cols;
            q
        })
        .collect())
}

fn nan_max(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.max(b)
    }
}

fn empty(fmt: QuantFormat) -> QuantizedTensor {
    QuantizedTensor {
        format: fmt,
        axis: Axis::Row,
        rows: 0,
        cols: 0,
        codes: Vec::new(),
        scales: Scales::None,
        global_amax: Vec::new(),
        stats: QuantStats::default(),
    }
}

fn quantize_bf16(x: &[f32]) -> QuantizedTensor {
    let mut q = empty(QuantFormat::Bf16);
    q.codes = vec![0u8; 2 * x.len()];
    let mut counts = Bf16Counts::default();
    for (c, &v) in q.codes.chunks_exact_mut(2).zip(x) {
        let b = bf16_from_f32(v);
        c.copy_from_slice(&b.to_le_bytes());
        counts.add(v, bf16_to_f32(b));
    }
    q.stats = counts.stats(x.len());
    q
}

/// Saturation and underflow of BF16 rounding, counted without branches so the loops vectorise.
#[derive(Default)]
struct Bf16Counts {
    saturated: u64,
    underflowed: u64,
}

impl Bf16Counts {
    #[inline]
    fn add(&mut self, x: f32, rounded: f32) {
        let sat = x.is_finite() & rounded.is_infinite();
        let under = (x != 0.0) & (rounded == 0.0);
        self.saturated = self.saturated.wrapping_add(u64::from(sat));
        self.underflowed = self.underflowed.wrapping_add(u64::from(under));
    }

    fn stats(&self, elements: usize) -> QuantStats {
        QuantStats {
            elements: elements as u64,
            saturated: self.saturated,
            underflowed: self.underflowed,
        }
    }
}

/// BF16 fake quantization in one pass: the same rounding as [`quantize_bf16`] then dequantize
/// (a BF16 value is exact in FP32), without the intermediate code bytes. BF16 operands are the
/// most frequent quantization in the engine (every GEMM of a BF16 site rounds both operands).
fn fake_quantize_bf16(x: &[f32], out: &mut [f32]) -> QuantStats {
    let mut counts = Bf16Counts::default();
    for (o, &v) in out.iter_mut().zip(x) {
        *o = bf16_to_f32(bf16_from_f32(v));
        counts.add(v, *o);
    }
    counts.stats(x.len())
}

fn quantize_mxfp8(src: Blocked, elem: Fp8Elem, rule: MxScaleRule) -> QuantizedTensor {
    let (br, bc) = src.shape();
    let nb = bc / MX_BLOCK;
    let band = src.band();
    let segs = src.segments(1);
    // SAFETY (both buffers): every band's rows are whole blocked rows, and the segments cover
    // each row, so the row kernels write every code and scale byte.
    let (codes, (scales, stats)) = unsafe {
        written_by(br * bc, |codes| {
            written_by(br * nb, |scales| {
                mxfp8_bands(src, elem, rule, &segs, band, codes, scales)
            })
        })
    };
    let mut q = empty(QuantFormat::Mxfp8 { elem, rule });
    q.codes = codes;
    q.scales = Scales::E8m0(scales);
    q.stats = stats;
    q
}

/// [`quantize_mxfp8`]'s parallel loop: `band` blocked rows a task, each row's `segs` through
/// the row kernel.
fn mxfp8_bands(
    src: Blocked,
    elem: Fp8Elem,
    rule: MxScaleRule,
    segs: &[Range<usize>],
    band: usize,
    codes: &mut [MaybeUninit<u8>],
    scales: &mut [MaybeUninit<u8>],
) -> QuantStats {
    let (_, bc) = src.shape();
    let nb = bc / MX_BLOCK;
    let isa = Isa::best();
    codes
        .par_chunks_mut(band * bc)
        .zip(scales.par_chunks_mut(band * nb))
        .enumerate()
        .map_init(
            || (mxfp8::RowScratch::default(), Vec::new()),
            |(scratch, buf), (k, (cband, sband))| {
                let n = sband.len() / nb;
                let mut st = QuantStats::default();
                for seg in segs {
                    let (xt, stride) = src.tile_into(k * band, n, seg.clone(), buf);
                    let blocks = seg.start / MX_BLOCK..seg.end / MX_BLOCK;
                    for t in 0..n {
                        let xrow = &xt[t * stride..][..seg.len()];
                        let crow = &mut cband[t * bc..][seg.clone()];
                        let srow = &mut sband[t * nb..][blocks.clone()];
                        st = st.merge(mxfp8_row(isa, xrow, elem, rule, srow, crow, scratch));
                    }
                }
                st
            },
        )
        .reduce(QuantStats::default, QuantStats::merge)
}

/// Quantize one row of MXFP8 blocks ([`mxfp8::quantize_row`]) compiled for `isa`.
fn mxfp8_row(
    isa: Isa,
    xrow: &[f32],
    elem: Fp8Elem,
    rule: MxScaleRule,
    srow: &mut [MaybeUninit<u8>],
    crow: &mut [MaybeUninit<u8>],
    scratch: &mut mxfp8::RowScratch,
) -> QuantStats {
    mxfp8_row_compiled(isa, xrow, elem, rule, srow, crow, scratch, isa)
}

per_isa! {
    /// [`mxfp8_row`]'s kernel; `amax_isa` picks the block amax loop ([`block_amaxes`]).
    fn mxfp8_row_compiled(
        xrow: &[f32],
        elem: Fp8Elem,
        rule: MxScaleRule,
        srow: &mut [MaybeUninit<u8>],
        crow: &mut [MaybeUninit<u8>],
        scratch: &mut mxfp8::RowScratch,
        amax_isa: Isa,
    ) -> QuantStats = mxfp8_row_kernel;
}

#[inline(always)]
fn mxfp8_row_kernel(
    xrow: &[f32],
    elem: Fp8Elem,
    rule: MxScaleRule,
    srow: &mut [MaybeUninit<u8>],
    crow: &mut [MaybeUninit<u8>],
    scratch: &mut mxfp8::RowScratch,
    amax_isa: Isa,
) -> QuantStats {
    let amaxes = |x: &[f32], out: &mut [f32]| block_amaxes(amax_isa, x, MX_BLOCK, out);
    mxfp8::quantize_row_with(xrow, elem, rule, srow, crow, scratch, amaxes)
}

per_isa! {
    /// Every MXFP8 block's amax ([`mxfp8::block_amaxes`]) compiled for `isa`.
    fn mxfp8_block_amaxes(x: &[f32], out: &mut [f32]) -> () = mxfp8::block_amaxes;
}

/// Every `block`-element block's amax of `x` into `out`: NaN-skipping for MXFP8 blocks (32,
/// [`mxfp8::block_amaxes`]), NaN-propagating for NVFP4 blocks (16, [`nvfp4::block_amaxes`]).
///
/// Under AVX-512, sixteen blocks at a time reduce to one vector of their maxima by a tree of
/// lane shuffles ([`block_amaxes_avx512`]): a horizontal reduction per block costs about three
/// times as much, and compilers vectorise the plain loop across blocks with gathers, slower
/// still. Elsewhere (and for the last blocks) the plain loops, the NVFP4 one from the AVX2
/// compile at most for the gathers' sake.
fn block_amaxes(isa: Isa, x: &[f32], block: usize, out: &mut [f32]) {
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && Isa::Avx512.available() {
        done = out.len() / 16 * 16;
        assert!(x.len() >= done * block);
        // SAFETY: the CPU supports AVX-512 (checked just above); `x` holds `done` blocks.
        unsafe { block_amaxes_avx512(x, block, &mut out[..done]) };
    }
    let (x, out) = (&x[done * block..], &mut out[done..]);
    match block {
        MX_BLOCK => mxfp8_block_amaxes(isa, x, out),
        _ => nvfp4_block_amaxes(isa.min(Isa::Avx2), x, out),
    }
}

/// [`block_amaxes`] for a multiple of 16 blocks of 16 or 32, sixteen at a time: each block's
/// sign-cleared bit patterns (NaN patterns zeroed for 32-element blocks) folded to one vector,
/// then the sixteen vectors reduced to one in four levels of shuffles and integer maxima, each
/// level halving the lanes per block.
///
/// # Safety
/// The CPU must support AVX-512 F; `x` must hold `out.len() * block` elements, `out.len()` a
/// multiple of 16, `block` 16 or 32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512dq,avx512vl")]
unsafe fn block_amaxes_avx512(x: &[f32], block: usize, out: &mut [f32]) {
    use std::arch::x86_64::*;
    debug_assert!(x.len() >= out.len() * block && out.len().is_multiple_of(16));
    let abs = _mm512_set1_epi32(0x7FFF_FFFF);
    let inf = _mm512_set1_epi32(0x7F80_0000);
    let nan = _mm512_set1_epi32(f32::NAN.to_bits() as i32);
    // Lane 4L + p of the reduced vector holds block 4p + L.
    let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    let skip_nan = block == MX_BLOCK;
    macro_rules! fold {
        ($a:expr, $b:expr, $shuffle:ident, $lo:literal, $hi:literal) => {
            _mm512_max_epu32($shuffle::<$lo>($a, $b), $shuffle::<$hi>($a, $b))
        };
    }
    fn shuffle_ps<const I: i32>(a: __m512i, b: __m512i) -> __m512i {
        // SAFETY: only reached from the AVX-512 function below (callers check the CPU).
        unsafe {
            _mm512_castps_si512(_mm512_shuffle_ps::<I>(
                _mm512_castsi512_ps(a),
                _mm512_castsi512_ps(b),
            ))
        }
    }
    for (k, o16) in out.chunks_exact_mut(16).enumerate() {
        let base = x[k * 16 * block..][..16 * block].as_ptr();
        // SAFETY: the 16 blocks at `base` are in bounds (the slice above); AVX-512 F is
        // available (the caller's contract).
        unsafe {
            let v: [__m512i; 16] = std::array::from_fn(|b| {
                let p = base.add(b * block);
                let lo = _mm512_and_si512(_mm512_loadu_si512(p.cast()), abs);
                if skip_nan {
                    let hi = _mm512_and_si512(_mm512_loadu_si512(p.add(16).cast()), abs);
                    let lo = _mm512_maskz_mov_epi32(_mm512_cmple_epu32_mask(lo, inf), lo);
                    let hi = _mm512_maskz_mov_epi32(_mm512_cmple_epu32_mask(hi, inf), hi);
                    _mm512_max_epu32(lo, hi)
                } else {
                    lo
                }
            });
            // 128-bit lanes [a, a, b, b] per pair of blocks, then [a, b, c, d] per four.
            let m: [__m512i; 8] = std::array::from_fn(|i| {
                fold!(v[2 * i], v[2 * i + 1], _mm512_shuffle_i32x4, 0x44, 0xEE)
            });
            let n: [__m512i; 4] = std::array::from_fn(|i| {
                fold!(m[2 * i], m[2 * i + 1], _mm512_shuffle_i32x4, 0x88, 0xDD)
            });
            // Within each 128-bit lane: two values per block, then one.
            let r: [__m512i; 2] =
                std::array::from_fn(|i| fold!(n[2 * i], n[2 * i + 1], shuffle_ps, 0x44, 0xEE));
            let t = fold!(r[0], r[1], shuffle_ps, 0x88, 0xDD);
            let mut t = _mm512_permutexvar_epi32(order, t);
            if !skip_nan {
                // A NaN's pattern reads back as NaN; the canonical one, as [`amax_from_bits`].
                t = _mm512_mask_mov_epi32(t, _mm512_cmpgt_epu32_mask(t, inf), nan);
            }
            _mm512_storeu_ps(o16.as_mut_ptr(), _mm512_castsi512_ps(t));
        }
    }
}

/// Global amax of an NVFP4 tensor: `[shards]` (per tensor) or `[br, shards]` (per token).
fn nvfp4_global_amax(
    x: &[f32],
    br: usize,
    bc: usize,
    second: SecondScale,
    shards: usize,
) -> Vec<f32> {
    let w = bc / shards;
    let isa = Isa::best();
    let per_row: Vec<f32> = x
        .par_chunks(bc)
        .with_min_len((16 * 1024 / bc).max(1))
        .flat_map_iter(|row| row.chunks(w).map(|c| amax_of(isa, c)).collect::<Vec<_>>())
        .collect();
    match second {
        SecondScale::PerToken => per_row,
        SecondScale::PerTensor => (0..shards)
            .map(|s| (0..br).map(|r| per_row[r * shards + s]).fold(0.0, nan_max))
            .collect(),
    }
}

/// Per-tensor NVFP4 global amax (`[shards]`) of the blocked view. For column blocks, shard `s`
/// of a blocked row is a band of the input's rows, so its amax is taken over those input rows
/// directly (a max is exact in any order; no transpose needed).
fn nvfp4_tensor_amax(src: Blocked, shards: usize) -> Vec<f32> {
    let (br, bc) = src.shape();
    match src.axis {
        Axis::Row => nvfp4_global_amax(src.x, br, bc, SecondScale::PerTensor, shards),
        Axis::Col => src
            .x
            .chunks(src.rows / shards * src.cols)
            .map(|band| {
                band.par_chunks(64 * 1024)
                    .map(|c| amax_of(Isa::best(), c))
                    .reduce(|| 0.0, nan_max)
            })
            .collect(),
    }
}

/// NVFP4 quantization of the blocked view under the global amax `amax` (`[shards]` per tensor or
/// `[br, shards]` per token); `None` (per token only) takes each row's amax in that row's task.
fn quantize_nvfp4_with(
    src: Blocked,
    second: SecondScale,
    shards: usize,
    amax: Option<Vec<f32>>,
) -> QuantizedTensor {
    let (br, bc) = src.shape();
    let nb = bc / NV_BLOCK;
    let given = amax.is_some();
    let mut amax = amax.unwrap_or_else(|| vec![0.0f32; br * shards]);
    let tensor_globals: Vec<GlobalScale> = match second {
        SecondScale::PerTensor => amax.iter().map(|a| GlobalScale::from_amax(*a)).collect(),
        SecondScale::PerToken => Vec::new(),
    };
    // Per tensor, every row reads the same `shards` amaxes; give each row a dummy slot to zip.
    let mut unused = Vec::new();
    let row_amax: &mut [f32] = match second {
        SecondScale::PerToken => &mut amax,
        SecondScale::PerTensor => {
            unused.resize(br * shards, 0.0f32);
            &mut unused
        }
    };
    // SAFETY (both buffers): every band's rows are whole blocked rows, and the segments cover
    // each row, so the row kernels write every code and scale byte.
    let (packed, (scales, stats)) = unsafe {
        written_by(br * bc / 2, |packed| {
            written_by(br * nb, |scales| {
                let out = (packed, scales, row_amax);
                nvfp4_bands(src, second, shards, given, &tensor_globals, out)
            })
        })
    };
    let mut q = empty(QuantFormat::Nvfp4 { second, shards });
    q.codes = packed;
    q.scales = Scales::E4m3(scales);
    q.global_amax = amax;
    q.stats = stats;
    q
}

/// [`quantize_nvfp4_with`]'s parallel loop into `out` (codes, scales, per-token amaxes).
fn nvfp4_bands(
    src: Blocked,
    second: SecondScale,
    shards: usize,
    given: bool,
    tensor_globals: &[GlobalScale],
    out: (&mut [MaybeUninit<u8>], &mut [MaybeUninit<u8>], &mut [f32]),
) -> QuantStats {
    let (packed, scales, row_amax) = out;
    let (_, bc) = src.shape();
    let nb = bc / NV_BLOCK;
    let w = bc / shards;
    let band = src.band();
    let isa = Isa::best();
    let segs = src.segments(shards);
    let whole_rows = src.axis == Axis::Row;
    packed
        .par_chunks_mut(band * bc / 2)
        .zip(scales.par_chunks_mut(band * nb))
        .zip(row_amax.par_chunks_mut(band * shards))
        .enumerate()
        .map_init(
            || {
                let g: Vec<GlobalScale> = Vec::with_capacity(shards);
                (nvfp4::RowScratch::default(), g, Vec::new())
            },
            |(scratch, g, buf), (k, ((pband, sband), aband))| {
                let n = sband.len() / nb;
                // Per token along rows, each row's amax comes from its block amaxes in the
                // row's own pass (the row is read once); columns need a pass down the strip.
                let from_blocks = second == SecondScale::PerToken && !given && whole_rows;
                if second == SecondScale::PerToken && !given && !whole_rows {
                    src.column_token_amax_into(isa, k * band, n, shards, aband);
                }
                let mut st = QuantStats::default();
                for seg in &segs {
                    let (xt, stride) = src.tile_into(k * band, n, seg.clone(), buf);
                    // The shards this run covers: all of them for a whole row, else its one.
                    let sh = if seg.len() == bc {
                        0..shards
                    } else {
                        seg.start / w..seg.start / w + 1
                    };
                    let blocks = seg.start / NV_BLOCK..seg.end / NV_BLOCK;
                    let per_shard = blocks.len() / sh.len();
                    for t in 0..n {
                        let xrow = &xt[t * stride..][..seg.len()];
                        let prow = &mut pband[t * bc / 2..][seg.start / 2..seg.end / 2];
                        let srow = &mut sband[t * nb..][blocks.clone()];
                        let globals = if from_blocks {
                            nvfp4::RowGlobals::FromBlocks(&mut aband[t * shards..][..shards])
                        } else {
                            g.clear();
                            match second {
                                SecondScale::PerTensor => g.extend(&tensor_globals[sh.clone()]),
                                SecondScale::PerToken => g.extend(
                                    aband[t * shards..][sh.clone()]
                                        .iter()
                                        .map(|a| GlobalScale::from_amax(*a)),
                                ),
                            }
                            nvfp4::RowGlobals::Given(g)
                        };
                        let q = nvfp4_row(isa, xrow, globals, per_shard, srow, prow, scratch);
                        st = st.merge(q);
                    }
                }
                st
            },
        )
        .reduce(QuantStats::default, QuantStats::merge)
}

/// Quantize one row of NVFP4 blocks ([`nvfp4::quantize_row`]) compiled for `isa`;
/// `globals[s]` is the second-level scale of shard `s` (a shard is `per_shard` blocks).
fn nvfp4_row(
    isa: Isa,
    xrow: &[f32],
    globals: nvfp4::RowGlobals<'_>,
    per_shard: usize,
    srow: &mut [MaybeUninit<u8>],
    prow: &mut [MaybeUninit<u8>],
    scratch: &mut nvfp4::RowScratch,
) -> QuantStats {
    nvfp4_row_compiled(isa, xrow, globals, per_shard, srow, prow, scratch, isa)
}

per_isa! {
    /// [`nvfp4_row`]'s kernel; `amax_isa` picks the block amax loop ([`block_amaxes`]).
    fn nvfp4_row_compiled(
        xrow: &[f32],
        globals: nvfp4::RowGlobals<'_>,
        per_shard: usize,
        srow: &mut [MaybeUninit<u8>],
        prow: &mut [MaybeUninit<u8>],
        scratch: &mut nvfp4::RowScratch,
        amax_isa: Isa,
    ) -> QuantStats = nvfp4_row_kernel;
}

/// [`nvfp4::quantize_row`] with the block amaxes of [`block_amaxes`].
#[inline(always)]
fn nvfp4_row_kernel(
    xrow: &[f32],
    globals: nvfp4::RowGlobals<'_>,
    per_shard: usize,
    srow: &mut [MaybeUninit<u8>],
    prow: &mut [MaybeUninit<u8>],
    scratch: &mut nvfp4::RowScratch,
    amax_isa: Isa,
) -> QuantStats {
    let amaxes = |x: &[f32], out: &mut [f32]| block_amaxes(amax_isa, x, NV_BLOCK, out);
    nvfp4::quantize_row_with(xrow, globals, per_shard, srow, prow, scratch, amaxes)
}

per_isa! {
    /// Every NVFP4 block's amax ([`nvfp4::block_amaxes`]) compiled for `isa`.
    fn nvfp4_block_amaxes(x: &[f32], out: &mut [f32]) -> () = nvfp4::block_amaxes;
}

fn quantize_fp8_block(
    x: &[f32],
    br: usize,
    bc: usize,
    tile: Fp8Tile,
    variant: Fp8BlockVariant,
) -> QuantizedTensor {
    let tc = bc.div_ceil(TILE);
    // Tile amax grid first (a 128x128 tile spans rows), then every row encodes independently.
    let amax: Vec<f32> = match tile {
        Fp8Tile::Act1x128 => x
            .par_chunks(bc)
            .flat_map_iter(|row| {
                row.chunks(TILE)
                    .map(amax_nan_propagating)
                    .collect::<Vec<_>>()
            })
            .collect(),
        Fp8Tile::Weight128x128 => x
            .par_chunks(bc * TILE)
            .flat_map_iter(|band| {
                let mut a = vec![0.0f32; tc];
                for row in band.chunks(bc) {
                    for (t, chunk) in row.chunks(TILE).enumerate() {
                        a[t] = nan_max(a[t], amax_nan_propagating(chunk));
                    }
                }
                a
            })
            .collect(),
    };
    let tiles: Vec<_> = amax
        .iter()
        .map(|a| fp8_block::tile_scale(*a, variant))
        .collect();
    let mut codes = vec![0u8; br * bc];
    let stats = codes
        .par_chunks_mut(bc)
        .zip(x.par_chunks(bc))
        .enumerate()
        .with_min_len((16 * 1024 / bc).max(1))
        .map(|(r, (crow, xrow))| {
            let tr = match tile {
                Fp8Tile::Act1x128 => r,
                Fp8Tile::Weight128x128 => r / TILE,
            };
            let mut st = QuantStats::default();
            for (t, (c, v)) in crow.chunks_mut(TILE).zip(xrow.chunks(TILE)).enumerate() {
                fp8_block::encode_tile(v, &tiles[tr * tc + t], c, &mut st);
            }
            st
        })
        .reduce(QuantStats::default, QuantStats::merge);
    let mut q = empty(QuantFormat::Fp8Block { tile, variant });
    q.codes = codes;
    q.scales = Scales::F32(tiles.iter().map(|t| t.scale_inv).collect());
    q.stats = stats;
    q
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// Every FP32 upper half (sign, exponent, top 7 mantissa bits: 2^16 patterns) with low
    /// halves 0x0000 (exact E4M3/E2M1 ties sit here), 0x0001, 0x7FFF, 0x8000 and 0xFFFF (one ulp
    /// either side of a tie, above and below the middle): NaNs, ±Inf, ±0, FP32 subnormals.
    /// Arranged three ways: in order (blocks of neighbouring magnitudes), permuted (blocks mixing
    /// every magnitude), and with every block's first element set to a fixed amax, so each
    /// pattern is encoded relative to a moderate scale, deep into the subnormal codes.
    fn every_bit_class() -> Vec<Vec<f32>> {
        let mut v = Vec::new();
        for hi in 0..=0xFFFFu32 {
            for lo in [0x0000u32, 0x0001, 0x7FFF, 0x8000, 0xFFFF] {
                v.push(f32::from_bits(hi << 16 | lo));
            }
        }
        let n = v.len();
        let permuted: Vec<f32> = (0..n).map(|i| v[(i * 7919) % n]).collect();
        let mut anchored = v.clone();
        for (k, b) in anchored.chunks_mut(16).enumerate() {
            b[0] = [1.0, 448.0, 6.0, 3.0e-3, 7.0e4][k % 5];
        }
        vec![v, permuted, anchored]
    }

    fn same_f32(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    /// MXFP8 block rule written from the spec (§2, §3) with the generic element rounding.
    fn mxfp8_block_reference(x: &[f32], elem: Fp8Elem, codes: &mut [u8]) -> (u8, u32, u32) {
        use crate::formats::e8m0::{e8m0_ceil_from_f32, e8m0_reciprocal};
        use crate::formats::fp8::{E4M3_MAX, E5M2_MAX, e4m3_from_f32_sat_reference};
        let mut amax = 0.0f32;
        for v in x {
            if !v.is_nan() && v.abs() > amax {
                amax = v.abs();
            }
        }
        let max = match elem {
            Fp8Elem::E4M3 => E4M3_MAX,
            Fp8Elem::E5M2 => E5M2_MAX,
        };
        let b = e8m0_ceil_from_f32(amax * (1.0 / max));
        let inv = e8m0_reciprocal(b);
        let (mut sat, mut under) = (0, 0);
        for (c, &v) in codes.iter_mut().zip(x) {
            let s = v * inv;
            *c = match elem {
                Fp8Elem::E4M3 => e4m3_from_f32_sat_reference(s),
                Fp8Elem::E5M2 => crate::formats::fp8::e5m2_from_f32_sat(s),
            };
            sat += u32::from(s.abs() > max && v.is_finite());
            under += u32::from(*c & 0x7F == 0 && v != 0.0);
        }
        (b, sat, under)
    }

    /// NVFP4 block rule written from the spec (§4): TE's association order, the E4M3 table and
    /// the generic E2M1 rounding.
    fn nvfp4_block_reference(x: &[f32], g: &GlobalScale, codes: &mut [u8]) -> (u8, u32, u32) {
        use crate::formats::e2m1::{E2m1Convention, e2m1_from_f32_reference};
        use crate::formats::fp8::{E4M3_TABLE, e4m3_from_f32_sat_reference};
        let mut vmax = 0.0f32;
        for v in x {
            vmax = if v.is_nan() || vmax.is_nan() {
                f32::NAN
            } else {
                vmax.max(v.abs())
            };
        }
        let mut ds = vmax * (g.s_enc * (1.0 / 6.0));
        if !ds.is_nan() {
            ds = ds.min(f32::MAX).clamp(-448.0, 448.0);
        }
        let scale = e4m3_from_f32_sat_reference(ds);
        let mut enc = 1.0f32 / (E4M3_TABLE[scale as usize] * g.s_dec);
        if !enc.is_nan() {
            enc = enc.min(f32::MAX);
        }
        let (mut sat, mut under) = (0, 0);
        for (c, &v) in codes.iter_mut().zip(x) {
            let s = v * enc;
            *c = e2m1_from_f32_reference(s, E2m1Convention::TeRef);
            sat += u32::from(s.abs() > 6.0 && v.is_finite());
            under += u32::from(*c & 7 == 0 && v != 0.0 && v.is_finite());
        }
        (scale, sat, under)
    }

    #[test]
    fn mxfp8_row_loops_equal_the_block_reference_on_every_bit_class() {
        // 19 MXFP8 or 38 NVFP4 blocks: whole groups of sixteen and a remainder.
        let w = 608;
        for data in every_bit_class() {
            for elem in [Fp8Elem::E4M3, Fp8Elem::E5M2] {
                let mut scratch = mxfp8::RowScratch::default();
                for row in data.chunks_exact(w) {
                    let (mut c_ref, mut s_ref) = (vec![0u8; w], vec![0u8; w / 32]);
                    let (mut sat, mut under) = (0u64, 0u64);
                    for ((x, c), s) in row.chunks(32).zip(c_ref.chunks_mut(32)).zip(&mut s_ref) {
                        let (b, sa, un) = mxfp8_block_reference(x, elem, c);
                        *s = b;
                        sat += u64::from(sa);
                        under += u64::from(un);
                    }
                    // Every compile this CPU runs (the others are skipped).
                    for isa in Isa::ALL.into_iter().filter(|i| i.available()) {
                        let rule = MxScaleRule::TeCeil;
                        // SAFETY: the row kernel writes every code and scale of its row.
                        let (c, (s, st)) = unsafe {
                            written_by(w, |c| {
                                written_by(w / 32, |s| {
                                    mxfp8_row(isa, row, elem, rule, s, c, &mut scratch)
                                })
                            })
                        };
                        assert_eq!(s, s_ref, "{isa:?} {elem:?} scales of {row:?}");
                        for (i, (a, b)) in c.iter().zip(&c_ref).enumerate() {
                            assert_eq!(a, b, "{isa:?} {elem:?} code of {:#010x}", row[i].to_bits());
                        }
                        assert_eq!(
                            (st.elements, st.saturated, st.underflowed),
                            (w as u64, sat, under)
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn nvfp4_row_loops_equal_the_block_reference_on_every_bit_class() {
        use crate::formats::e2m1::pack_fp4;
        // 19 MXFP8 or 38 NVFP4 blocks: whole groups of sixteen and a remainder.
        let w = 608;
        for data in every_bit_class() {
            for (shards, amax_of) in [
                (1, None),
                (2, None),
                (1, Some(1.0f32)),
                (1, Some(f32::INFINITY)),
            ] {
                let mut scratch = nvfp4::RowScratch::default();
                for row in data.chunks_exact(w) {
                    // Per token (the row's own amax per shard) or a fixed per-tensor amax.
                    let globals: Vec<GlobalScale> = row
                        .chunks(w / shards)
                        .map(|xs| {
                            GlobalScale::from_amax(amax_of.unwrap_or_else(|| {
                                xs.iter().fold(0.0f32, |m, v| nan_max(m, v.abs()))
                            }))
                        })
                        .collect();
                    let per_shard = w / 16 / shards;
                    let (mut c_ref, mut s_ref) = (vec![0u8; w], vec![0u8; w / 16]);
                    let (mut sat, mut under) = (0u64, 0u64);
                    for (b, ((x, c), s)) in row
                        .chunks(16)
                        .zip(c_ref.chunks_mut(16))
                        .zip(&mut s_ref)
                        .enumerate()
                    {
                        let (sc, sa, un) = nvfp4_block_reference(x, &globals[b / per_shard], c);
                        *s = sc;
                        sat += u64::from(sa);
                        under += u64::from(un);
                    }
                    let p_ref = pack_fp4(&c_ref);
                    // Every compile this CPU runs, with the scales given and, per token,
                    // also taken from the row's own block amaxes.
                    let modes: &[bool] = if amax_of.is_none() {
                        &[false, true]
                    } else {
                        &[false]
                    };
                    for isa in Isa::ALL.into_iter().filter(|i| i.available()) {
                        for &fused in modes {
                            let mut amax = vec![-1.0f32; shards];
                            let g = if fused {
                                nvfp4::RowGlobals::FromBlocks(&mut amax)
                            } else {
                                nvfp4::RowGlobals::Given(&globals)
                            };
                            // SAFETY: the row kernel writes every code and scale of its row.
                            let (p, (s, st)) = unsafe {
                                written_by(w / 2, |p| {
                                    written_by(w / 16, |s| {
                                        nvfp4_row(isa, row, g, per_shard, s, p, &mut scratch)
                                    })
                                })
                            };
                            assert_eq!(s, s_ref, "{isa:?} fused {fused}: scales of {row:?}");
                            for (i, (a, b)) in p.iter().zip(&p_ref).enumerate() {
                                assert_eq!(
                                    a,
                                    b,
                                    "{isa:?} fused {fused}: codes of {:#010x} {:#010x}",
                                    row[2 * i].to_bits(),
                                    row[2 * i + 1].to_bits()
                                );
                            }
                            assert_eq!(
                                (st.elements, st.saturated, st.underflowed),
                                (w as u64, sat, under)
                            );
                            if fused {
                                for (a, g) in amax.iter().zip(&globals) {
                                    assert!(
                                        same_f32(*a, g.amax),
                                        "{isa:?}: amax {a} vs {}",
                                        g.amax
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// The fused per-token path (row amax taken in the row's pass) equals the two-pass one.
    #[test]
    fn per_token_amax_in_the_row_pass_equals_the_separate_pass() {
        for data in every_bit_class() {
            let x = &data[..64 * 1024];
            for shards in [1, 2] {
                let src = Blocked {
                    x,
                    rows: 64,
                    cols: 1024,
                    axis: Axis::Row,
                };
                let fused = quantize_nvfp4_with(src, SecondScale::PerToken, shards, None);
                let amax = nvfp4_global_amax(x, 64, 1024, SecondScale::PerToken, shards);
                let two = quantize_nvfp4_with(src, SecondScale::PerToken, shards, Some(amax));
                assert!(same(&fused, &two));
                assert!(
                    fused
                        .global_amax
                        .iter()
                        .zip(&two.global_amax)
                        .all(|(a, b)| same_f32(*a, *b))
                );
            }
        }
    }

    const MX: QuantFormat = QuantFormat::MXFP8;
    const NV_TOKEN: QuantFormat = QuantFormat::Nvfp4 {
        second: SecondScale::PerToken,
        shards: 1,
    };
    const NV_TENSOR: QuantFormat = QuantFormat::Nvfp4 {
        second: SecondScale::PerTensor,
        shards: 1,
    };

    /// Normal values with a few large outliers, like real activations.
    fn sample(seed: u64, n: usize) -> Vec<f32> {
        let mut r = ChaCha8Rng::seed_from_u64(seed);
        (0..n)
            .map(|_| {
                let u: f32 = r.random::<f32>() * 2.0 - 1.0;
                let big = if r.random::<f32>() < 0.02 { 50.0 } else { 1.0 };
                u * big * (0.1 + r.random::<f32>())
            })
            .collect()
    }

    fn all_formats() -> Vec<QuantFormat> {
        vec![
            QuantFormat::Bf16,
            MX,
            QuantFormat::Mxfp8 {
                elem: Fp8Elem::E5M2,
                rule: MxScaleRule::OcpFloor,
            },
            NV_TOKEN,
            NV_TENSOR,
            QuantFormat::Nvfp4 {
                second: SecondScale::PerToken,
                shards: 2,
            },
            QuantFormat::Fp8Block {
                tile: Fp8Tile::Act1x128,
                variant: Fp8BlockVariant::Te,
            },
            QuantFormat::Fp8Block {
                tile: Fp8Tile::Weight128x128,
                variant: Fp8BlockVariant::Deepgemm,
            },
        ]
    }

    fn scales_bytes(q: &QuantizedTensor) -> Vec<u8> {
        match &q.scales {
            Scales::None => vec![],
            Scales::E8m0(s) | Scales::E4m3(s) => s.clone(),
            Scales::F32(s) => s.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }

    fn same(a: &QuantizedTensor, b: &QuantizedTensor) -> bool {
        a.codes == b.codes
            && scales_bytes(a) == scales_bytes(b)
            && a.global_amax
                .iter()
                .map(|v| v.to_bits())
                .eq(b.global_amax.iter().map(|v| v.to_bits()))
    }

    #[test]
    fn column_quantization_is_row_quantization_of_the_transpose() {
        let (r, c) = (256, 160);
        let x = sample(1, r * c);
        let xt = transpose(&x, r, c);
        for f in all_formats() {
            if f.required_multiple() > 0 && (r % f.required_multiple() != 0) {
                continue;
            }
            let col = quantize(&x, r, c, &f, Axis::Col).unwrap();
            let row_t = quantize(&xt, c, r, &f, Axis::Row).unwrap();
            assert!(same(&col, &row_t), "{}", f.name());
            // And dequantize gives back the original orientation.
            assert_eq!(
                col.dequantize(),
                transpose(&row_t.dequantize(), c, r),
                "{}",
                f.name()
            );
        }
    }

    /// Column tiles: blocked rows longer than a tile, strips with a partial remainder and odd
    /// widths (the transpose's scalar edges), and shards whose boundaries split the tiles.
    #[test]
    fn column_tiles_equal_row_quantization_of_the_transpose() {
        for (r, c) in [(1056, 72), (1040, 13), (48, 200)] {
            let x = sample(8, r * c);
            let xt = transpose(&x, r, c);
            let mut formats = all_formats();
            formats.push(QuantFormat::Nvfp4 {
                second: SecondScale::PerTensor,
                shards: 3,
            });
            formats.push(QuantFormat::Nvfp4 {
                second: SecondScale::PerToken,
                shards: 3,
            });
            for f in formats {
                if r % f.required_multiple() != 0 {
                    continue;
                }
                let col = quantize(&x, r, c, &f, Axis::Col).unwrap();
                let row_t = quantize(&xt, c, r, &f, Axis::Row).unwrap();
                assert!(same(&col, &row_t), "{} at {r}x{c}", f.name());
                assert_eq!(col.stats, row_t.stats, "{} at {r}x{c}", f.name());
            }
        }
    }

    #[test]
    fn tile_transpose_equals_the_element_definition() {
        let (h, w, xs, os) = (21, 19, 23, 29);
        let x: Vec<f32> = (0..h * xs).map(|i| i as f32).collect();
        let mut out = vec![-1.0f32; w * os];
        transpose_tile(&x, xs, h, w, &mut out, os);
        for i in 0..h {
            for j in 0..w {
                assert_eq!(out[j * os + i], x[i * xs + j], "({i}, {j})");
            }
        }
    }

    #[test]
    fn per_token_rows_ignore_their_neighbours_but_per_tensor_rows_do_not() {
        let (r, c) = (8, 64);
        let x = sample(2, r * c);
        let mut y = x.clone();
        // Row 5 gets a 100x outlier; row 2 is untouched.
        y[5 * c + 3] = 400.0;
        let row2 = |q: &QuantizedTensor| {
            (
                q.codes[2 * c / 2..3 * c / 2].to_vec(),
                match &q.scales {
                    Scales::E4m3(s) => s[2 * c / 16..3 * c / 16].to_vec(),
                    _ => unreachable!(),
                },
            )
        };
        let a = quantize(&x, r, c, &NV_TOKEN, Axis::Row).unwrap();
        let b = quantize(&y, r, c, &NV_TOKEN, Axis::Row).unwrap();
        assert_eq!(
            row2(&a),
            row2(&b),
            "per-token codes of row 2 changed with row 5"
        );
        let a = quantize(&x, r, c, &NV_TENSOR, Axis::Row).unwrap();
        let b = quantize(&y, r, c, &NV_TENSOR, Axis::Row).unwrap();
        assert_ne!(
            row2(&a),
            row2(&b),
            "per-tensor codes of row 2 should depend on row 5"
        );
        // The same token in a batch of one quantizes identically under per-token scales.
        let alone = quantize(&x[2 * c..3 * c], 1, c, &NV_TOKEN, Axis::Row).unwrap();
        let batched = quantize(&x, r, c, &NV_TOKEN, Axis::Row).unwrap();
        assert_eq!(alone.codes, batched.codes[c..3 * c / 2]);
    }

    #[test]
    fn sharded_scales_equal_each_shard_quantized_alone() {
        let (r, c, s) = (6, 128, 4);
        let x = sample(3, r * c);
        for second in [SecondScale::PerToken, SecondScale::PerTensor] {
            let whole = quantize(
                &x,
                r,
                c,
                &QuantFormat::Nvfp4 { second, shards: s },
                Axis::Row,
            )
            .unwrap();
            let w = c / s;
            let deq = whole.dequantize();
            for k in 0..s {
                let part: Vec<f32> = (0..r)
                    .flat_map(|i| x[i * c + k * w..i * c + (k + 1) * w].to_vec())
                    .collect();
                let alone = quantize(
                    &part,
                    r,
                    w,
                    &QuantFormat::Nvfp4 { second, shards: 1 },
                    Axis::Row,
                )
                .unwrap();
                let whole_codes = whole.unpacked_codes();
                let got: Vec<u8> = (0..r)
                    .flat_map(|i| whole_codes[i * c + k * w..i * c + (k + 1) * w].to_vec())
                    .collect();
                assert_eq!(got, alone.unpacked_codes(), "{second:?} shard {k} codes");
                let got_deq: Vec<u32> = (0..r)
                    .flat_map(|i| {
                        deq[i * c + k * w..i * c + (k + 1) * w]
                            .iter()
                            .map(|v| v.to_bits())
                            .collect::<Vec<_>>()
                    })
                    .collect();
                let alone_deq: Vec<u32> = alone.dequantize().iter().map(|v| v.to_bits()).collect();
                assert_eq!(got_deq, alone_deq, "{second:?} shard {k} dequant");
            }
        }
        // Sharding changes the codes when shards have different ranges (so the option is not a no-op).
        let mut y = x.clone();
        y[7] = 300.0;
        let one = quantize(&y, r, c, &NV_TOKEN, Axis::Row).unwrap();
        let four = quantize(
            &y,
            r,
            c,
            &QuantFormat::Nvfp4 {
                second: SecondScale::PerToken,
                shards: 4,
            },
            Axis::Row,
        )
        .unwrap();
        assert_ne!(one.codes, four.codes);
    }

    #[test]
    fn gate_and_up_share_one_second_level_scale() {
        let (r, c) = (4, 64);
        let gate = sample(4, r * c);
        let mut up = sample(5, r * c);
        up[9] = 80.0; // the up half holds the tensor's amax
        let qs =
            quantize_nvfp4_joint(&[(&gate, r), (&up, r)], c, SecondScale::PerTensor, 1).unwrap();
        assert_eq!(qs[0].global_amax, vec![80.0]);
        assert_eq!(qs[1].global_amax, vec![80.0]);
        // Joint quantization equals quantizing the fused [gate; up] matrix as one tensor.
        let fused: Vec<f32> = gate.iter().chain(&up).copied().collect();
        let f = quantize(&fused, 2 * r, c, &NV_TENSOR, Axis::Row).unwrap();
        assert_eq!([qs[0].codes.clone(), qs[1].codes.clone()].concat(), f.codes);
        // Quantized alone, the gate would get its own (smaller) scale and different codes.
        let alone = quantize(&gate, r, c, &NV_TENSOR, Axis::Row).unwrap();
        assert_ne!(alone.codes, qs[0].codes);
    }

    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        let (r, c) = (512, 256);
        let x = sample(6, r * c);
        for f in all_formats() {
            let one = rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .build()
                .unwrap();
            let many = rayon::ThreadPoolBuilder::new()
                .num_threads(5)
                .build()
                .unwrap();
            let a = one.install(|| quantize(&x, r, c, &f, Axis::Row).unwrap());
            let b = many.install(|| quantize(&x, r, c, &f, Axis::Row).unwrap());
            assert!(same(&a, &b), "{}", f.name());
            assert_eq!(a.stats, b.stats);
        }
    }

    #[test]
    fn bf16_fake_quantization_equals_quantize_then_dequantize() {
        // The one-pass BF16 path must give the bytes and counts of the general path, specials included.
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut x: Vec<f32> = (0..4096)
            .map(|_| f32::from_bits(rng.random::<u32>()))
            .collect();
        x[..8].copy_from_slice(&[
            0.0,
            -0.0,
            f32::MAX,
            -f32::MAX,
            f32::INFINITY,
            f32::NAN,
            1e-45,
            3.4e38,
        ]);
        let q = quantize(&x, 64, 64, &QuantFormat::Bf16, Axis::Row).unwrap();
        let mut fast = vec![0.0f32; x.len()];
        let st = fake_quantize(&x, 64, 64, &QuantFormat::Bf16, Axis::Row, &mut fast).unwrap();
        let slow = q.dequantize();
        assert!(
            fast.iter()
                .zip(&slow)
                .all(|(a, b)| a.to_bits() == b.to_bits())
        );
        assert_eq!(st, q.stats);
        assert!(st.saturated > 0 && st.underflowed > 0, "{st:?}");
    }

    #[test]
    fn representable_tensors_round_trip_exactly() {
        // Blocks whose amax is exactly 448 get scale 2^0 under TE MXFP8: every E4M3 value survives.
        let vals: Vec<f32> = (0..=0x7Eu8).map(crate::formats::fp8::e4m3_to_f32).collect();
        let mut x: Vec<f32> = Vec::new();
        for b in 0..8 {
            let mut block: Vec<f32> = (0..32)
                .map(|i| vals[(b * 31 + i * 7) % vals.len()] * if i % 3 == 0 { -1.0 } else { 1.0 })
                .collect();
            block[b] = 448.0;
            x.extend(block);
        }
        let q = quantize(&x, 8, 32, &MX, Axis::Row).unwrap();
        assert_eq!(q.dequantize(), x);
        // NVFP4: a tensor with amax 2688 has S_enc = 1; blocks with max 6·s for E4M3 s reproduce E2M1 grid values.
        let mut y: Vec<f32> = (0..64)
            .map(|i| crate::formats::e2m1::E2M1_VALUES[i % 16] * 448.0)
            .collect();
        y[0] = 2688.0;
        let q = quantize(&y, 1, 64, &NV_TENSOR, Axis::Row).unwrap();
        let d = q.dequantize();
        for (a, b) in d.iter().zip(&y) {
            assert_eq!(a.abs(), b.abs(), "{a} vs {b}");
        }
    }

    #[test]
    fn bad_shapes_name_the_dimension_and_block() {
        let x = vec![0.5f32; 3 * 40];
        let e = quantize(&x, 3, 40, &MX, Axis::Row).unwrap_err();
        assert_eq!(
            e,
            FormatError::NotDivisible {
                dim: 1,
                name: "cols",
                size: 40,
                format: "MXFP8".into(),
                block: 32
            }
        );
        let e = quantize(&x, 3, 40, &NV_TOKEN, Axis::Col).unwrap_err();
        assert!(e.to_string().contains("rows = 3"), "{e}");
        let e = quantize(
            &x,
            3,
            40,
            &QuantFormat::Nvfp4 {
                second: SecondScale::PerToken,
                shards: 2,
            },
            Axis::Row,
        )
        .unwrap_err();
        assert!(e.to_string().contains("block size 32"), "{e}");
        assert!(matches!(
            quantize(&[], 0, 32, &MX, Axis::Row),
            Err(FormatError::Empty { .. })
        ));
        assert!(matches!(
            quantize(&x, 4, 40, &MX, Axis::Row),
            Err(FormatError::ShapeMismatch { .. })
        ));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Within a block, quantization preserves order: x_i <= x_j implies x'_i <= x'_j.
        #[test]
        fn block_quantization_is_monotonic(xs in prop::collection::vec(-1000.0f32..1000.0, 32), fi in 0usize..8) {
            let f = all_formats()[fi];
            let d = quantize(&xs, 1, 32, &f, Axis::Row).unwrap().dequantize();
            for i in 0..32 {
                // Only within one block: neighbouring blocks have their own scales (16 = the smallest block).
                for j in (i / 16 * 16)..(i / 16 * 16 + 16) {
                    if xs[i] <= xs[j] {
                        prop_assert!(d[i] <= d[j], "{}: x[{i}]={} <= x[{j}]={} but {} > {}", f.name(), xs[i], xs[j], d[i], d[j]);
                    }
                }
            }
        }

        /// Error bound: MXFP8 (TE) never clips, so every element is within half an E4M3 step.
        #[test]
        fn mxfp8_error_is_within_half_a_step(xs in prop::collection::vec(-1e4f32..1e4, 32)) {
            let q = quantize(&xs, 1, 32, &MX, Axis::Row).unwrap();
            let Scales::E8m0(s) = &q.scales else { unreachable!() };
            let scale = crate::formats::e8m0::e8m0_to_f32(s[0]) as f64;
            let d = q.dequantize();
            for (x, y) in xs.iter().zip(&d) {
                let v = (*x as f64 / scale).abs();
                let step = if v < 2f64.powi(-6) { 2f64.powi(-9) } else { 2f64.powi(v.log2().floor() as i32 - 3) };
                prop_assert!(((*x as f64) - (*y as f64)).abs() <= 0.5 * step * scale * (1.0 + 1e-9), "{x} -> {y}");
            }
            prop_assert_eq!(q.stats.saturated, 0);
        }
    }

    /// `decodes_to_bf16` is what a device relies on to multiply on BF16 tensor cores: every
    /// dequantized value of a format that claims it is a BF16 value (but below 2^-126, within
    /// 2^-133 of one), over every bit class in three arrangements and a random tensor, row- and
    /// column-wise; the
    /// formats that do not claim it do produce values outside BF16 (so the claim is not
    /// withheld from a format by mistake unnoticed).
    #[test]
    fn formats_that_decode_to_bf16_values_do_and_the_others_need_fp32() {
        use crate::formats::bf16::round_bf16;
        let formats = [
            QuantFormat::Bf16,
            QuantFormat::MXFP8,
            QuantFormat::Mxfp8 {
                elem: Fp8Elem::E5M2,
                rule: MxScaleRule::OcpFloor,
            },
            QuantFormat::Nvfp4 {
                second: SecondScale::PerToken,
                shards: 1,
            },
            QuantFormat::Nvfp4 {
                second: SecondScale::PerTensor,
                shards: 1,
            },
            QuantFormat::Fp8Block {
                tile: Fp8Tile::Act1x128,
                variant: Fp8BlockVariant::Te,
            },
        ];
        let cols = 128;
        // Beside the bit classes (whose Inf and NaN make a per-tensor scale degenerate), values
        // of a trained model's range.
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut data = every_bit_class();
        data.push(
            (0..64 * cols)
                .map(|_| rng.random_range(-3.0f32..3.0))
                .collect(),
        );
        for fmt in formats {
            let mut outside = 0usize;
            for x in &data {
                let rows = x.len() / cols;
                for axis in [Axis::Row, Axis::Col] {
                    let mut out = vec![0.0f32; x.len()];
                    fake_quantize(x, rows, cols, &fmt, axis, &mut out).unwrap();
                    for &v in out.iter().filter(|v| v.is_finite()) {
                        let b = round_bf16(v);
                        if b.to_bits() == v.to_bits() {
                            continue;
                        }
                        outside += 1;
                        if fmt.decodes_to_bf16() {
                            assert!(
                                v.abs() < f32::MIN_POSITIVE && (v - b).abs() < 2f32.powi(-133),
                                "{}: {v:e} ({:#010x}) is not a BF16 value",
                                fmt.name(),
                                v.to_bits()
                            );
                        }
                    }
                }
            }
            if !fmt.decodes_to_bf16() {
                assert!(outside > 0, "{}: every value fits BF16", fmt.name());
            }
        }
    }
}

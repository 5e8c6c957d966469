//! Row-wise fake quantization on the device: a device FP32 tensor in, the FP32 values a GEMM on its
//! quantized form sees out, both staying on the GPU (activation quantization of a device-resident
//! forward).
//!
//! The contract is bit equality with `crate::formats::fake_quantize(.., Axis::Row, ..)` for every
//! format (tested in `tests/cuda_fake_quant.rs`). It is built from the one quantizer: the codes,
//! scales and second-level amax come from [`CudaQuantizer::quantize_into`] (`quant.cu`, tested
//! byte for byte against the CPU in `tests/cuda_quantizer.rs`), and a kernel of `dequant.cu` only
//! decodes those buffers with the CPU's dequantize arithmetic, as `fake_quantize` does on the host
//! (`quantize`, then `QuantizedTensor::dequantize_blocked`). BF16 is the one-pass rounding of the
//! CPU's own special case (`fake_quantize_bf16`). NaN results carry the host's NaN bits (see
//! `dequant.cu`). All work is queued on the quantizer's stream.

use super::quant::{CountInto, counts_in_slots, rounds_as_it_loads};
use super::{CudaError, CudaQuantizer, DeviceQuantized};
use crate::engine::linear::CountSlots;
use crate::formats::fp8_block::TILE;
use crate::formats::mxfp8::{Fp8Elem, MX_BLOCK};
use crate::formats::nvfp4::NV_BLOCK;
use crate::formats::tensor::validate_len;
use crate::formats::{Axis, Fp8Tile, QuantFormat, SecondScale};
use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};
use std::sync::{Arc, Mutex};

const SRC: &str = include_str!("dequant.cu");
const THREADS: u32 = 256;
/// Quantizer outputs kept for reuse, one per (rows, cols, format), least recently used evicted.
const SCRATCH_SLOTS: usize = 16;

/// The loaded kernels of `dequant.cu`.
struct Kernels {
    bf16: CudaFunction,
    /// `bf16_round` counting saturation and underflow.
    bf16_count: CudaFunction,
    /// Two FP32 tensors' BF16 bits (a tensor-core GEMM's operands).
    bf16_pack2: CudaFunction,
    /// Indexed by element: E4M3, E5M2.
    mxfp8: [CudaFunction; 2],
    nvfp4: CudaFunction,
    fp8_block: CudaFunction,
}

/// The device buffers of one shape and format: the quantizer's outputs, and an exact-length copy
/// of the input for callers whose input buffer is longer than `rows * cols` (`quantize_into`
/// takes exactly `rows * cols` values).
struct Scratch {
    q: DeviceQuantized,
    input: Option<CudaSlice<f32>>,
}

/// Row-wise fake quantization and BF16 rounding of device tensors, on a [`CudaQuantizer`]'s device
/// and stream.
pub struct CudaFakeQuantizer {
    q: Arc<CudaQuantizer>,
    k: Kernels,
    /// Grid cap of the grid-stride kernels: 16 thread blocks per multiprocessor.
    grid: u32,
    /// Bits of the NaN this host's FP32 arithmetic makes from an invalid operation (x86:
    /// 0xFFC00000); the CPU dequantization produces it for 0 x Inf, so the kernels do too.
    default_nan: u32,
    /// Quantizer outputs by shape, most recently used last. Held locked for a whole call: its
    /// quantize and decode launches share the buffers in stream order.
    scratch: Mutex<Vec<Scratch>>,
}

fn cfg(grid: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `grid` blocks for each of `slots` count slots (the grid's y axis).
fn cfg_slots(grid: u32, slots: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid, slots as u32, 1),
        ..cfg(1)
    }
}

/// Thread blocks for `threads` threads, at least 1, at most `cap` (the kernels loop).
fn blocks(threads: usize, cap: u32) -> u32 {
    threads.div_ceil(THREADS as usize).clamp(1, cap as usize) as u32
}

impl CudaFakeQuantizer {
    /// Compile `dequant.cu` on `q`'s device (once; NVRTC takes a fraction of a second).
    pub fn new(q: Arc<CudaQuantizer>) -> Result<Self, CudaError> {
        let dev = q.device().clone();
        let m = dev.compile("dequant", SRC)?;
        let f = |name: &str| m.load_function(name);
        let k = Kernels {
            bf16: f("bf16_round")?,
            bf16_count: f("bf16_round_count")?,
            bf16_pack2: f("bf16_pack2")?,
            mxfp8: [f("mxfp8_dq_e4m3")?, f("mxfp8_dq_e5m2")?],
            nvfp4: f("nvfp4_dq")?,
            fp8_block: f("fp8_block_dq")?,
        };
        let sms = dev.context().attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )?;
        // black_box: measured at run time, not folded by the compiler (which may pick other bits).
        let invalid = std::hint::black_box(0.0f32) * std::hint::black_box(f32::INFINITY);
        Ok(CudaFakeQuantizer {
            q,
            k,
            grid: sms.max(1) as u32 * 16,
            default_nan: invalid.to_bits(),
            scratch: Mutex::new(Vec::new()),
        })
    }

    pub fn quantizer(&self) -> &Arc<CudaQuantizer> {
        &self.q
    }

    /// `out[..n] = round_bf16(x[..n])` bit for bit (NaN keeps sign and payload top bits, quiet
    /// bit set, as `crate::formats::bf16::round_bf16`). Queued on the quantizer's stream.
    pub fn round_bf16(
        &self,
        x: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        n: usize,
    ) -> Result<(), CudaError> {
        check_len("x", x.len(), n)?;
        check_len("out", out.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        let mut b = self.q.stream().launch_builder(&self.k.bf16);
        b.arg(x).arg(out).arg(&n64);
        // SAFETY: grid-stride loop over i < n; `x` and `out` hold at least n floats (checked).
        unsafe { b.launch(cfg(blocks(n, self.grid))) }?;
        Ok(())
    }

    /// The BF16 bits of `a[..na]` and, when given, `b[..nb]` (RNE, as
    /// [`CudaFakeQuantizer::round_bf16`]) into `pa` and `pb`, in one launch: exactly their bits
    /// where they hold BF16 values.
    pub fn bf16_pack2(
        &self,
        (a, na, pa): (&CudaSlice<f32>, usize, &mut CudaSlice<u16>),
        b: Option<(&CudaSlice<f32>, usize, &mut CudaSlice<u16>)>,
    ) -> Result<(), CudaError> {
        let nb = b.as_ref().map_or(0, |b| b.1);
        let lens = [
            ("a", a.len(), na),
            ("BF16 a", pa.len(), na),
            ("b", b.as_ref().map_or(0, |b| b.0.len()), nb),
            ("BF16 b", b.as_ref().map_or(0, |b| b.2.len()), nb),
        ];
        for (what, len, n) in lens {
            if len < n {
                return Err(CudaError::Shape(format!(
                    "{what} holds {len} values, BF16 packing needs {n}"
                )));
            }
        }
        if na + nb == 0 {
            return Ok(());
        }
        let (na64, nb64) = (na as u64, nb as u64);
        let mut l = self.q.stream().launch_builder(&self.k.bf16_pack2);
        match b {
            Some((b, _, pb)) => l.arg(a).arg(pa).arg(&na64).arg(b).arg(pb).arg(&nb64),
            // No second tensor: the first's buffers stand in, never touched (nb = 0).
            None => l.arg(a).arg(&*pa).arg(&na64).arg(a).arg(&*pa).arg(&nb64),
        };
        // SAFETY: grid-stride loop over i < na + nb: a and pa are touched below na, b and pb
        // below nb (each holds at least that many, checked).
        unsafe { l.launch(cfg(blocks(na + nb, self.grid))) }?;
        Ok(())
    }

    /// `out[..rows*cols]` = quantize-then-dequantize of `x[..rows*cols]` (`[rows, cols]`,
    /// row-major) with blocks along rows: the values of `fake_quantize(x, rows, cols, fmt,
    /// Axis::Row, out)`, bit for bit. Asynchronous, on the quantizer's stream; no host copy.
    ///
    /// `cols` must satisfy the format (the CPU's own check: MXFP8 a multiple of 32, NVFP4 of
    /// 16 x shards, `CudaError::Format` otherwise); `rows == 0` is a no-op. The buffers may be
    /// longer than `rows*cols` (`CudaError::Shape` if shorter); the rest is not touched (a longer
    /// `x` costs a device copy of its first `rows*cols` values).
    pub fn fake_quantize_rows(
        &self,
        x: &CudaSlice<f32>,
        rows: usize,
        cols: usize,
        fmt: &QuantFormat,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        self.fake_quantize_rows_counted(x, rows, cols, fmt, out, None)
    }

    /// [`Self::fake_quantize_rows`] that also adds the quantization's counts (elements,
    /// saturated, underflowed: the `QuantStats` the CPU's `fake_quantize` returns) to `acc`
    /// when given (on the device; the trainer's per-site quantization metrics). The rows split
    /// into `acc.slots` equal parts (the runs of a batch), each counted into its own slot, in
    /// the same launches as one slot where the format allows ([`counts_in_slots`]).
    pub fn fake_quantize_rows_counted(
        &self,
        x: &CudaSlice<f32>,
        rows: usize,
        cols: usize,
        fmt: &QuantFormat,
        out: &mut CudaSlice<f32>,
        acc: Option<CountSlots<'_, CudaSlice<u64>>>,
    ) -> Result<(), CudaError> {
        self.fake_quantize_rows_reading(x, (rows, cols), fmt, out, acc, false)
    }

    /// [`Self::fake_quantize_rows_counted`] of `x`'s BF16 rounding (`round_bf16(x)`, what a
    /// site quantizes) without a rounded copy where the quantizer rounds as it loads
    /// ([`rounds_as_it_loads`]: MXFP8, per-token NVFP4); through a rounded copy otherwise.
    pub fn fake_quantize_rows_of_rounding(
        &self,
        x: &CudaSlice<f32>,
        (rows, cols): (usize, usize),
        fmt: &QuantFormat,
        out: &mut CudaSlice<f32>,
        acc: Option<CountSlots<'_, CudaSlice<u64>>>,
    ) -> Result<(), CudaError> {
        if rounds_as_it_loads(fmt, Axis::Row) {
            return self.fake_quantize_rows_reading(x, (rows, cols), fmt, out, acc, true);
        }
        let n = rows * cols;
        check_len("x", x.len(), n)?;
        let mut rounded = super::output_buffer(self.q.stream(), n.max(1))?;
        self.round_bf16(x, &mut rounded, n)?;
        self.fake_quantize_rows_counted(&rounded, rows, cols, fmt, out, acc)
    }

    /// [`Self::fake_quantize_rows_counted`], of `x`'s BF16 rounding formed as the quantizer
    /// loads when `round_in` (only where [`rounds_as_it_loads`]).
    fn fake_quantize_rows_reading(
        &self,
        x: &CudaSlice<f32>,
        (rows, cols): (usize, usize),
        fmt: &QuantFormat,
        out: &mut CudaSlice<f32>,
        acc: Option<CountSlots<'_, CudaSlice<u64>>>,
        round_in: bool,
    ) -> Result<(), CudaError> {
        let slots = acc.as_ref().map_or(1, |a| a.slots);
        if let Some(a) = &acc {
            check_counts(a.counts.len(), 3 * (a.first + a.slots))?;
            if slots == 0 || !rows.is_multiple_of(slots) {
                return Err(CudaError::Shape(format!(
                    "{rows} rows in {slots} count slots"
                )));
            }
        }
        // The column conditions of the CPU (cols > 0, block multiple, shards > 0), whatever rows.
        validate_len(cols, 1, cols, fmt, Axis::Row)?;
        let n = rows
            .checked_mul(cols)
            .ok_or_else(|| CudaError::Shape(format!("{rows} x {cols} elements overflow")))?;
        check_len("x", x.len(), n)?;
        check_len("out", out.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        if let QuantFormat::Bf16 = fmt {
            let Some(acc) = acc else {
                return self.round_bf16(x, out, n);
            };
            let per = (n / slots) as u64;
            let mut counts = acc.counts.slice_mut(3 * acc.first..3 * (acc.first + slots));
            let mut b = self.q.stream().launch_builder(&self.k.bf16_count);
            b.arg(x).arg(out).arg(&per).arg(&mut counts);
            // SAFETY: slot y's grid-stride loop covers values y·per + i, i < per, so below n;
            // `x` and `out` hold at least n floats, `counts` 3 per slot (checked).
            unsafe { b.launch(cfg_slots(blocks(n / slots, self.grid), slots)) }?;
            return Ok(());
        }
        if slots > 1 && !counts_in_slots(fmt, Axis::Row) {
            return self.count_slot_by_slot(x, (rows, cols), fmt, out, acc.expect("slots > 1"));
        }
        let s = self.q.stream();
        let mut cache = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let Scratch { q, input } = self.scratch_for(&mut cache, (rows, cols), fmt, slots)?;
        let src = if x.len() == n {
            x
        } else {
            let buf = match input {
                Some(b) => b,
                None => input.insert(s.alloc_zeros::<f32>(n)?),
            };
            s.memcpy_dtod(&x.slice(..n), buf)?;
            &*buf
        };
        // The quantizer adds its counts straight into the caller's slots (3 per slot, checked).
        let into = match acc {
            Some(acc) => {
                CountInto::Add(acc.counts.slice_mut(3 * acc.first..3 * (acc.first + slots)))
            }
            None => CountInto::Unread,
        };
        self.q.quantize_rounding(src, q, into, round_in)?;
        let dnan = self.default_nan;
        let (n64, rows64, cols64) = (n as u64, rows as u64, cols as u64);
        match *fmt {
            QuantFormat::Bf16 => unreachable!("BF16 returned above"),
            QuantFormat::Mxfp8 { elem, .. } => {
                let e = match elem {
                    Fp8Elem::E4M3 => 0,
                    Fp8Elem::E5M2 => 1,
                };
                let n4 = n64 / 4;
                let mut b = s.launch_builder(&self.k.mxfp8[e]);
                b.arg(&q.codes)
                    .arg(q.scale_bytes())
                    .arg(out)
                    .arg(&n4)
                    .arg(&dnan);
                debug_assert_eq!(n % MX_BLOCK, 0);
                // SAFETY: cols is a multiple of 32 (validated), so n is: thread i < n/4 reads code
                // word i (the n code bytes `alloc` made, 256-byte aligned) and scale byte i/8 <
                // n/32, and writes float4 i of `out` (at least n floats, an allocation's start).
                unsafe { b.launch(cfg(blocks(n / 4, self.grid))) }?;
            }
            QuantFormat::Nvfp4 { second, shards } => {
                // 16-element blocks per (row, shard) segment.
                let seg_blocks = (cols / shards / NV_BLOCK) as u64;
                let nblocks = n64 / NV_BLOCK as u64;
                let shards64 = shards as u64;
                let per_token = i32::from(second == SecondScale::PerToken);
                let rcp2688: f32 = 1.0 / 2688.0;
                let mut b = s.launch_builder(&self.k.nvfp4);
                b.arg(&q.codes)
                    .arg(q.scale_bytes())
                    .arg(q.global_amax_keys());
                b.arg(out).arg(&nblocks).arg(&seg_blocks).arg(&shards64);
                b.arg(&per_token).arg(&rcp2688).arg(&dnan);
                // SAFETY: cols is a multiple of 16·shards (validated): block b < n/16 reads code
                // bytes 8b..8b+8 (n/2 in all) and scale byte b (n/16), and writes floats
                // 16b..16b+16 of `out`; its segment b / L is below rows·shards (per token, the
                // key count) and (b / L) % shards below shards (per tensor).
                unsafe { b.launch(cfg(blocks(n / NV_BLOCK, self.grid))) }?;
            }
            QuantFormat::Fp8Block { tile, .. } => {
                let tc = cols.div_ceil(TILE);
                let tile_rows: u64 = match tile {
                    Fp8Tile::Act1x128 => 1,
                    Fp8Tile::Weight128x128 => TILE as u64,
                };
                let mut b = s.launch_builder(&self.k.fp8_block);
                b.arg(&q.codes).arg(q.tile_scales()).arg(out);
                b.arg(&rows64).arg(&cols64).arg(&tile_rows).arg(&dnan);
                // SAFETY: a warp per (row < rows, tile t < tc): element indices r·cols + c with
                // c < cols stay below n (`codes` n bytes, `out` at least n floats); the tile index
                // (r / tile_rows)·tc + t is below the tile count the quantizer sized.
                unsafe { b.launch(cfg(blocks((rows * tc).saturating_mul(32), self.grid))) }?;
            }
        }
        Ok(())
    }

    /// `f` over each of `blocks` blocks of `len` values stored back to back in `x`, into the
    /// same block of `out`: each block is copied into a buffer of its own first, so `f` sees one
    /// whole tensor (what a per-tensor scale needs: the CPU quantizes each expert's tensor alone).
    pub fn per_block(
        &self,
        x: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        (blocks, len): (usize, usize),
        mut f: impl FnMut(&CudaSlice<f32>, &mut CudaSlice<f32>) -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        let s = self.q.stream();
        let (mut blk_in, mut blk_out) =
            (super::output_buffer(s, len)?, super::output_buffer(s, len)?);
        for b in 0..blocks {
            let range = b * len..(b + 1) * len;
            s.memcpy_dtod(&x.slice(range.clone()), &mut blk_in.slice_mut(..len))?;
            f(&blk_in, &mut blk_out)?;
            s.memcpy_dtod(&blk_out.slice(..len), &mut out.slice_mut(range))?;
        }
        Ok(())
    }

    /// [`Self::fake_quantize_rows_counted`] for a format whose quantizer counts one slot a
    /// launch (FP8 blocks, per-tensor NVFP4): the values in one call, then each slot's rows
    /// counted as a tensor of their own ([`Self::per_block`]; their values are dropped, `out`
    /// holds the whole tensor's).
    fn count_slot_by_slot(
        &self,
        x: &CudaSlice<f32>,
        (rows, cols): (usize, usize),
        fmt: &QuantFormat,
        out: &mut CudaSlice<f32>,
        mut acc: CountSlots<'_, CudaSlice<u64>>,
    ) -> Result<(), CudaError> {
        self.fake_quantize_rows_counted(x, rows, cols, fmt, out, None)?;
        let (slots, r) = (acc.slots, rows / acc.slots);
        let mut dropped = super::output_buffer(self.q.stream(), rows * cols)?;
        let mut i = 0;
        self.per_block(x, &mut dropped, (slots, r * cols), |part, o| {
            let slot = acc.part(i, slots);
            i += 1;
            self.fake_quantize_rows_counted(part, r, cols, fmt, o, Some(slot))
        })
    }

    /// The scratch of (rows, cols, fmt, count slots), made most recently used; allocated on a
    /// miss, evicting the least recently used beyond `SCRATCH_SLOTS` (its buffers are freed in
    /// stream order).
    /// `out[..rows*cols]` = `fake_quantize(x, rows, cols, fmt, Axis::Col, out)` bit for bit:
    /// blocks along columns, computed as the CPU computes them (row quantization of the
    /// transpose, dequantized, transposed back). `rows` must satisfy the format's block multiple
    /// (`CudaError::Format` otherwise, the CPU's message). Asynchronous, on the quantizer's stream.
    pub fn fake_quantize_cols(
        &self,
        x: &CudaSlice<f32>,
        rows: usize,
        cols: usize,
        fmt: &QuantFormat,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        validate_len(rows, rows, 1, fmt, Axis::Col)?;
        let n = rows
            .checked_mul(cols)
            .ok_or_else(|| CudaError::Shape(format!("{rows} x {cols} elements overflow")))?;
        check_len("x", x.len(), n)?;
        check_len("out", out.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        let s = self.q.stream();
        let (mut t, mut tq) = (s.alloc_zeros::<f32>(n)?, s.alloc_zeros::<f32>(n)?);
        self.q.transpose_into(x, rows, cols, &mut t)?;
        self.fake_quantize_rows(&t, cols, rows, fmt, &mut tq)?;
        self.q.transpose_into(&tq, cols, rows, out)
    }

    /// `linear.rs`'s `fake_quantize_col_padded` on the device: column fake quantization of
    /// `[rows, cols]` with `rows` padded by zero rows up to the format's block multiple (zero rows
    /// change no amax, so no code), the padding dropped again. What the `Quantized` backward mode
    /// uses for operands whose contraction dimension is a token count.
    pub fn fake_quantize_cols_padded(
        &self,
        x: &CudaSlice<f32>,
        rows: usize,
        cols: usize,
        fmt: &QuantFormat,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let m = fmt.required_multiple();
        let padded = rows.div_ceil(m) * m;
        if padded == rows {
            return self.fake_quantize_cols(x, rows, cols, fmt, out);
        }
        let n = rows * cols;
        check_len("x", x.len(), n)?;
        check_len("out", out.len(), n)?;
        let s = self.q.stream();
        let (mut xp, mut op) = (
            s.alloc_zeros::<f32>(padded * cols)?,
            s.alloc_zeros::<f32>(padded * cols)?,
        );
        if n > 0 {
            s.memcpy_dtod(&x.slice(..n), &mut xp.slice_mut(..n))?;
        }
        self.fake_quantize_cols(&xp, padded, cols, fmt, &mut op)?;
        if n > 0 {
            s.memcpy_dtod(&op.slice(..n), &mut out.slice_mut(..n))?;
        }
        Ok(())
    }

    /// `linear.rs`'s `fake_quantize_col_padded_t` on the device: row fake quantization of
    /// `[rows, cols]` with `cols` zero-padded to the format's block multiple, the padding dropped
    /// again (dy of a site whose output width does not divide into blocks: the 8-wide router).
    /// Blocks along a row of `x` are blocks along a column of its transpose, so this is
    /// [`Self::fake_quantize_cols_padded`] of the transpose, transposed back.
    pub fn fake_quantize_rows_padded(
        &self,
        x: &CudaSlice<f32>,
        rows: usize,
        cols: usize,
        fmt: &QuantFormat,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let m = fmt.required_multiple();
        if cols.is_multiple_of(m) {
            return self.fake_quantize_rows(x, rows, cols, fmt, out);
        }
        let n = rows * cols;
        check_len("x", x.len(), n)?;
        check_len("out", out.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        let s = self.q.stream();
        let (mut t, mut tq) = (s.alloc_zeros::<f32>(n)?, s.alloc_zeros::<f32>(n)?);
        self.q.transpose_into(x, rows, cols, &mut t)?; // [cols, rows]
        self.fake_quantize_cols_padded(&t, cols, rows, fmt, &mut tq)?;
        self.q.transpose_into(&tq, cols, rows, out)
    }

    fn scratch_for<'a>(
        &self,
        cache: &'a mut Vec<Scratch>,
        (rows, cols): (usize, usize),
        fmt: &QuantFormat,
        slots: usize,
    ) -> Result<&'a mut Scratch, CudaError> {
        let hit = cache.iter().position(|s| {
            s.q.rows == rows && s.q.cols == cols && s.q.format == *fmt && s.q.slots() == slots
        });
        let entry = match hit {
            Some(i) => cache.remove(i),
            None => Scratch {
                q: self.q.alloc_slots(rows, cols, fmt, Axis::Row, slots)?,
                input: None,
            },
        };
        if cache.len() >= SCRATCH_SLOTS {
            cache.remove(0);
        }
        cache.push(entry);
        Ok(cache.last_mut().expect("pushed above"))
    }
}

fn check_counts(len: usize, n: usize) -> Result<(), CudaError> {
    if len < n {
        return Err(CudaError::Shape(format!(
            "counts hold {len} values, the count slots need {n}"
        )));
    }
    Ok(())
}

fn check_len(what: &str, len: usize, n: usize) -> Result<(), CudaError> {
    if len < n {
        return Err(CudaError::Shape(format!(
            "{what} holds {len} floats, fake quantization needs {n}"
        )));
    }
    Ok(())
}

//! The quantizers on the GPU: `quant.cu` compiled once per device by NVRTC, launched on device
//! buffers, read back into the same [`QuantizedTensor`] the CPU quantizer builds.
//!
//! The contract is byte equality with `crate::formats::quantize` (codes, scale bytes, global amax
//! bits and the saturation/underflow counts), for every format, axis and shard count: the kernels
//! port the CPU code line by line, and `tests/cuda_quantizer.rs` checks it on every golden vector
//! and on large random tensors with outliers, subnormals, zeros, Inf and NaN. Shapes are checked by
//! the CPU's own [`validate_len`], so both refuse the same inputs.
//!
//! Column quantization transposes first (a shared-memory transpose kernel), exactly like the CPU,
//! so a column copy is, byte for byte, row quantization of the transpose.

use super::{CudaDevice, CudaError};
use crate::formats::fp8_block::{Fp8BlockVariant, TILE};
use crate::formats::mxfp8::{Fp8Elem, MX_BLOCK, MxScaleRule};
use crate::formats::nvfp4::NV_BLOCK;
use crate::formats::tensor::validate_len;
use crate::formats::{
    Axis, Fp8Tile, QuantFormat, QuantStats, QuantizedTensor, Scales, SecondScale,
};
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, CudaViewMut, LaunchConfig, PushKernelArg,
};
use std::sync::Arc;

const SRC: &str = include_str!("quant.cu");
const THREADS: u32 = 256;

/// The loaded kernels of `quant.cu`.
struct Kernels {
    bf16: CudaFunction,
    /// `[element][rule]`: E4M3/E5M2 x TE ceil/OCP floor.
    mxfp8_row: [[CudaFunction; 2]; 2],
    mxfp8_col: [[CudaFunction; 2]; 2],
    nvfp4_amax: CudaFunction,
    nvfp4_amax16: CudaFunction,
    nvfp4_tensor: CudaFunction,
    nvfp4_token: CudaFunction,
    /// `nvfp4_token_staged`, where the device has TMA and the shared memory it needs.
    nvfp4_token_staged: Option<CudaFunction>,
    fp8_1x128: CudaFunction,
    fp8_128: CudaFunction,
    fp8_amax: CudaFunction,
    fp8_scales: CudaFunction,
    fp8_encode: CudaFunction,
    transpose: CudaFunction,
    elements: CudaFunction,
}

/// The GPU quantizer of one device, with its own stream.
pub struct CudaQuantizer {
    dev: Arc<CudaDevice>,
    stream: Arc<CudaStream>,
    k: Kernels,
    /// Grid of the grid-stride kernels: enough 256-thread blocks to fill every multiprocessor.
    grid: u32,
    /// Grid of the NVFP4 kernels (a thread per 16-element block): as many thread blocks as fit
    /// on the device at once, each looping over chunks (measured faster than a block per chunk:
    /// 0.434 against 0.437-0.451 ms per-token on the H200).
    nv_grid: u32,
    /// Grid of `nvfp4_token_staged`: one thread block per multiprocessor.
    staged_grid: u32,
    /// Use the staged per-token kernel where it applies (default); off, the register kernel
    /// `nvfp4_token16` takes every shape (the tests and the bench run both).
    staged: bool,
}

/// Threads, blocks per chunk and dynamic shared memory of `nvfp4_token_staged` (`SG_T`,
/// `SG_CHUNK`, `SG_STAGES` chunks of 64 bytes a block in `quant.cu`).
const STAGED_THREADS: u32 = 1024;
const STAGED_CHUNK: u32 = 1024;
const STAGED_SMEM: u32 = 3 * STAGED_CHUNK * 64;
/// Its static shared memory (three key buffers of `SG_CHUNK` u32, three mbarriers).
const STAGED_STATIC_SMEM: u32 = 3 * STAGED_CHUNK * 4 + 3 * 8;

/// A quantized tensor still on the device (outputs plus the scratch its kernels need), reusable
/// across calls with the same format and shape.
pub struct DeviceQuantized {
    pub format: QuantFormat,
    pub axis: Axis,
    pub rows: usize,
    pub cols: usize,
    /// Codes of the blocked view, laid out as `QuantizedTensor::codes`.
    pub codes: CudaSlice<u8>,
    /// E8M0 / E4M3 scale bytes (MXFP8, NVFP4).
    scales_u8: CudaSlice<u8>,
    /// FP8 block: stored decode multipliers, and the encode operand per tile.
    scales_f32: CudaSlice<f32>,
    apply: CudaSlice<f32>,
    /// NVFP4: per-shard tensor amax keys; FP8 block: tile amax keys.
    keys: CudaSlice<u32>,
    /// NVFP4: per (row, shard) amax keys.
    row_keys: CudaSlice<u32>,
    /// elements, saturated, underflowed; three per count slot (the rows in that many equal
    /// parts, each counted on its own: [`CudaQuantizer::alloc_slots`]).
    stats: CudaSlice<u64>,
    /// Column axis: the transposed input.
    transposed: Option<CudaSlice<f32>>,
    /// FP8 block: number of scale tiles (0 for other formats).
    tiles: usize,
}

/// Where a quantization adds its counts (elements, saturated, underflowed; three per count slot):
/// the kernels only add to them, so a caller's own counts can take them directly.
pub enum CountInto<'a> {
    /// The quantizer's own, zeroed first: what [`CudaQuantizer::to_host`] reads back.
    Own,
    /// Added to these, three per count slot of the quantizer's buffers.
    Add(CudaViewMut<'a, u64>),
    /// Nobody reads them: added to the quantizer's own, which are not zeroed first.
    Unread,
}

impl DeviceQuantized {
    /// Bytes the quantizer must at least move: the input read once, every output written once.
    pub fn min_bytes(&self) -> usize {
        let n = self.rows * self.cols;
        let scales = match self.format {
            QuantFormat::Mxfp8 { .. } => n / MX_BLOCK,
            QuantFormat::Nvfp4 { .. } => n / NV_BLOCK,
            QuantFormat::Fp8Block { .. } => self.tiles * 4,
            QuantFormat::Bf16 => 0,
        };
        4 * n + self.codes.len() + scales
    }

    /// The scale bytes of the blocked view, one per block, row-major: E8M0 (MXFP8, `[rows,
    /// cols/32]`) or E4M3 (NVFP4, `[rows, cols/16]`); as `to_host` reads them.
    pub(crate) fn scale_bytes(&self) -> &CudaSlice<u8> {
        &self.scales_u8
    }

    /// The count slots its rows are counted in.
    pub(crate) fn slots(&self) -> usize {
        self.stats.len() / 3
    }

    /// FP8 block scaling: the stored decode multipliers (`scale_inv`), one per tile, row-major
    /// over the tile grid (`[rows, ceil(cols/128)]` or `[ceil(rows/128), ceil(cols/128)]`).
    pub(crate) fn tile_scales(&self) -> &CudaSlice<f32> {
        &self.scales_f32
    }

    /// NVFP4: the second-level (global) amax as keys, `[rows, shards]` per token, `[shards]` per
    /// tensor; a key is the amax's FP32 bits, and any key above 0x7F800000 stands for the CPU's
    /// NaN (`to_host` turns it into `f32::NAN`).
    pub(crate) fn global_amax_keys(&self) -> &CudaSlice<u32> {
        match self.format {
            QuantFormat::Nvfp4 {
                second: SecondScale::PerToken,
                ..
            } => &self.row_keys,
            _ => &self.keys,
        }
    }
}

fn blocks(n: usize, per: u32) -> u32 {
    n.div_ceil(per as usize).max(1) as u32
}

fn cfg(grid: u32, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `grid` thread blocks shared out over `slots` count slots (the grid's y axis; quant.cu's
/// row kernels take the y-th slot's rows).
fn cfg_slots(grid: u32, block: u32, slots: usize) -> LaunchConfig {
    let slots = slots as u32;
    LaunchConfig {
        grid_dim: (grid.div_ceil(slots).max(1), slots, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Whether the quantizer counts `fmt` along `axis` in several slots in one launch (row kernels
/// of MXFP8 and per-token NVFP4: the formats whose blocks and scales never cross a row).
pub fn counts_in_slots(fmt: &QuantFormat, axis: Axis) -> bool {
    axis == Axis::Row
        && matches!(
            fmt,
            QuantFormat::Mxfp8 { .. }
                | QuantFormat::Nvfp4 {
                    second: SecondScale::PerToken,
                    ..
                }
        )
}

/// Whether the quantizer can read `fmt` along `axis` from its input's BF16 rounding, rounding
/// each value as it loads ([`CudaQuantizer::quantize_rounding`]): the same row kernels.
pub fn rounds_as_it_loads(fmt: &QuantFormat, axis: Axis) -> bool {
    counts_in_slots(fmt, axis)
}

/// Amax keys (|x| bits, maxed as integers so NaN wins) as FP32 amax values, NaN as the CPU's
/// `f32::NAN`.
/// `nvfp4_token_staged` if this device can run it: TMA bulk copies (compute capability 9.0+) and
/// room for its shared memory (opted in here); `None` sends per-token NVFP4 to the register
/// kernel.
fn staged_kernel(dev: &CudaDevice, f: CudaFunction) -> Result<Option<CudaFunction>, CudaError> {
    use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
    let optin = dev
        .context()
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
    if dev.compute_capability().0 < 9 || (optin as u32) < STAGED_SMEM + STAGED_STATIC_SMEM {
        return Ok(None);
    }
    f.set_attribute(
        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        STAGED_SMEM as i32,
    )?;
    Ok(Some(f))
}

fn keys_to_f32(k: &[u32]) -> Vec<f32> {
    k.iter()
        .map(|b| {
            if *b > 0x7F80_0000 {
                f32::NAN
            } else {
                f32::from_bits(*b)
            }
        })
        .collect()
}

impl CudaQuantizer {
    /// Compile and load the kernels on `dev` (NVRTC takes a fraction of a second, once).
    pub fn new(dev: &Arc<CudaDevice>) -> Result<Self, CudaError> {
        let m = dev.compile("quant", SRC)?;
        let f = |name: &str| m.load_function(name);
        let k = Kernels {
            bf16: f("bf16_quantize")?,
            mxfp8_row: [
                [f("mxfp8_row_e4m3_te")?, f("mxfp8_row_e4m3_ocp")?],
                [f("mxfp8_row_e5m2_te")?, f("mxfp8_row_e5m2_ocp")?],
            ],
            mxfp8_col: [
                [f("mxfp8_col_e4m3_te")?, f("mxfp8_col_e4m3_ocp")?],
                [f("mxfp8_col_e5m2_te")?, f("mxfp8_col_e5m2_ocp")?],
            ],
            nvfp4_amax: f("nvfp4_amax")?,
            nvfp4_amax16: f("nvfp4_amax16")?,
            nvfp4_tensor: f("nvfp4_tensor16")?,
            nvfp4_token: f("nvfp4_token16")?,
            nvfp4_token_staged: None,
            fp8_1x128: f("fp8_block_1x128")?,
            fp8_128: f("fp8_block_128x128")?,
            fp8_amax: f("fp8_block_amax")?,
            fp8_scales: f("fp8_block_scales")?,
            fp8_encode: f("fp8_block_encode")?,
            transpose: f("transpose_f32")?,
            elements: f("encode_elements")?,
        };
        let stream = dev.context().new_stream()?;
        let sms = dev.context().attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )?;
        let sms = sms.max(1) as u32;
        let per_sm = k
            .nvfp4_token
            .occupancy_max_active_blocks_per_multiprocessor(THREADS, 0, None)?
            .min(
                k.nvfp4_tensor
                    .occupancy_max_active_blocks_per_multiprocessor(THREADS, 0, None)?,
            )
            .max(1);
        let mut k = k;
        k.nvfp4_token_staged = staged_kernel(dev, f("nvfp4_token_staged")?)?;
        Ok(CudaQuantizer {
            dev: dev.clone(),
            stream,
            k,
            grid: sms * 8,
            nv_grid: sms * per_sm,
            staged_grid: sms,
            staged: true,
        })
    }

    /// Choose the NVFP4 per-token kernel: `true` (the default) the shared-memory staged kernel
    /// where the device and the segment length allow it, `false` always the register kernel.
    /// Both give the same bytes (tested); the bench times both.
    pub fn with_staged_nvfp4(mut self, staged: bool) -> Self {
        self.staged = staged;
        self
    }

    /// Whether per-token NVFP4 with `seg_blocks` 16-element blocks per (row, shard) segment runs
    /// the staged kernel.
    pub fn uses_staged_nvfp4(&self, seg_blocks: usize) -> bool {
        self.staged && self.k.nvfp4_token_staged.is_some() && seg_blocks <= STAGED_CHUNK as usize
    }

    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.dev
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Quantize a host tensor on the GPU and read the result back: same contract as
    /// [`crate::formats::quantize`].
    pub fn quantize(
        &self,
        x: &[f32],
        rows: usize,
        cols: usize,
        fmt: &QuantFormat,
        axis: Axis,
    ) -> Result<QuantizedTensor, CudaError> {
        validate_len(x.len(), rows, cols, fmt, axis)?;
        let dx = self.stream.clone_htod(x)?;
        let mut q = self.alloc(rows, cols, fmt, axis)?;
        self.quantize_into(&dx, &mut q)?;
        self.to_host(&q)
    }

    /// Device buffers for quantizing a `rows x cols` tensor with `fmt` along `axis`.
    pub fn alloc(
        &self,
        rows: usize,
        cols: usize,
        fmt: &QuantFormat,
        axis: Axis,
    ) -> Result<DeviceQuantized, CudaError> {
        self.alloc_slots(rows, cols, fmt, axis, 1)
    }

    /// [`Self::alloc`] whose quantization counts its rows in `slots` equal parts (one per run
    /// of a batch), each into its own three counts; more than one slot needs
    /// [`counts_in_slots`].
    pub fn alloc_slots(
        &self,
        rows: usize,
        cols: usize,
        fmt: &QuantFormat,
        axis: Axis,
        slots: usize,
    ) -> Result<DeviceQuantized, CudaError> {
        validate_len(rows * cols, rows, cols, fmt, axis)?;
        if slots == 0 || !rows.is_multiple_of(slots) || (slots > 1 && !counts_in_slots(fmt, axis)) {
            return Err(CudaError::Shape(format!(
                "{rows} rows of {fmt:?} along {axis:?} in {slots} count slots"
            )));
        }
        let (br, bc) = match axis {
            Axis::Row => (rows, cols),
            Axis::Col => (cols, rows),
        };
        let n = br * bc;
        let tc = bc.div_ceil(TILE);
        let (code_bytes, scale_bytes, tiles, keys, row_keys) = match *fmt {
            QuantFormat::Bf16 => (2 * n, 0, 0, 0, 0),
            QuantFormat::Mxfp8 { .. } => (n, n / MX_BLOCK, 0, 0, 0),
            QuantFormat::Nvfp4 { shards, .. } => (n / 2, n / NV_BLOCK, 0, shards, br * shards),
            QuantFormat::Fp8Block { tile, .. } => {
                let tr = match tile {
                    Fp8Tile::Act1x128 => br,
                    Fp8Tile::Weight128x128 => br.div_ceil(TILE),
                };
                (n, 0, tr * tc, tr * tc, 0)
            }
        };
        let s = &self.stream;
        Ok(DeviceQuantized {
            format: *fmt,
            axis,
            rows,
            cols,
            codes: s.alloc_zeros::<u8>(code_bytes.max(1))?,
            scales_u8: s.alloc_zeros::<u8>(scale_bytes.max(1))?,
            scales_f32: s.alloc_zeros::<f32>(tiles.max(1))?,
            apply: s.alloc_zeros::<f32>(tiles.max(1))?,
            keys: s.alloc_zeros::<u32>(keys.max(1))?,
            row_keys: s.alloc_zeros::<u32>(row_keys.max(1))?,
            stats: s.alloc_zeros::<u64>(3 * slots)?,
            transposed: match (axis, fmt) {
                (Axis::Row, _) | (Axis::Col, QuantFormat::Mxfp8 { .. }) => None,
                (Axis::Col, _) => Some(s.alloc_zeros::<f32>(n)?),
            },
            tiles,
        })
    }

    /// Quantize the device tensor `x` (`q.rows x q.cols`, row-major) into `q`, counting into
    /// `q`'s own counts. Asynchronous: the work is queued on this quantizer's stream.
    pub fn quantize_into(
        &self,
        x: &CudaSlice<f32>,
        q: &mut DeviceQuantized,
    ) -> Result<(), CudaError> {
        self.quantize_counting(x, q, CountInto::Own)
    }

    /// [`Self::quantize_into`] with its counts added where `into` says.
    pub fn quantize_counting(
        &self,
        x: &CudaSlice<f32>,
        q: &mut DeviceQuantized,
        into: CountInto<'_>,
    ) -> Result<(), CudaError> {
        self.quantize_rounding(x, q, into, false)
    }

    /// [`Self::quantize_counting`] of `x`'s BF16 rounding when `round_in`: the bytes of
    /// quantizing `round_bf16(x)`, each value rounded as the kernel loads it, so no rounded copy
    /// is made. Only where [`rounds_as_it_loads`] (`CudaError::Shape` otherwise).
    pub fn quantize_rounding(
        &self,
        x: &CudaSlice<f32>,
        q: &mut DeviceQuantized,
        into: CountInto<'_>,
        round_in: bool,
    ) -> Result<(), CudaError> {
        let (rows, cols, axis) = (q.rows, q.cols, q.axis);
        validate_len(x.len(), rows, cols, &q.format, axis)?;
        if round_in && !rounds_as_it_loads(&q.format, axis) {
            return Err(CudaError::Shape(format!(
                "{:?} along {axis:?} cannot round its input as it loads; round it first",
                q.format
            )));
        }
        let round_i = i32::from(round_in);
        let s = &self.stream;
        let grid = self.grid;
        let DeviceQuantized {
            format,
            codes,
            scales_u8,
            scales_f32,
            apply,
            keys,
            row_keys,
            stats: own,
            transposed,
            ..
        } = q;
        let slots = own.len() / 3;
        let mut counts = match into {
            CountInto::Own => {
                s.memset_zeros(own)?;
                own.slice_mut(..)
            }
            CountInto::Add(c) if c.len() == own.len() => c,
            CountInto::Add(c) => {
                return Err(CudaError::Shape(format!(
                    "{} counts for {slots} count slots",
                    c.len()
                )));
            }
            CountInto::Unread => own.slice_mut(..),
        };
        let stats = &mut counts;
        // Column quantization: MXFP8 reads columns directly; the others transpose first.
        let (src, br, bc) = match transposed {
            None => (x, rows, cols),
            Some(t) => {
                self.transpose(x, rows, cols, t)?;
                (&*t, cols, rows)
            }
        };
        let n = br * bc;
        let (n64, br64, bc64) = (n as u64, br as u64, bc as u64);
        match *format {
            QuantFormat::Bf16 => {
                let mut b = s.launch_builder(&self.k.bf16);
                b.arg(src).arg(codes).arg(&n64).arg(stats);
                // SAFETY: `codes` holds 2n bytes (n u16), `src` n floats, `stats` 3 u64: the sizes
                // `alloc` made for this shape; the grid-stride loops stay below n.
                unsafe { b.launch(cfg(grid, THREADS)) }?;
            }
            QuantFormat::Mxfp8 { elem, rule } => {
                let (e, max, emax) = match elem {
                    Fp8Elem::E4M3 => (0, crate::formats::fp8::E4M3_MAX, 8i32),
                    Fp8Elem::E5M2 => (1, crate::formats::fp8::E5M2_MAX, 15i32),
                };
                let rcp_max: f32 = 1.0 / max;
                let r = match rule {
                    MxScaleRule::TeCeil => 0,
                    MxScaleRule::OcpFloor => 1,
                };
                if axis == Axis::Col {
                    let (r64, c64) = (rows as u64, cols as u64);
                    let mut b = s.launch_builder(&self.k.mxfp8_col[e][r]);
                    b.arg(x).arg(codes).arg(scales_u8).arg(&r64).arg(&c64);
                    b.arg(&max).arg(&rcp_max).arg(&emax).arg(stats);
                    // A thread block per 128x64 tile (MX_TR x MX_TC in quant.cu), so the
                    // scheduler balances the tiles (the kernel also loops if the grid is short).
                    let tiles = (rows.div_ceil(128) * cols.div_ceil(64)).clamp(1, 1 << 30) as u32;
                    // SAFETY: rows is a multiple of 32 (validated); every load is guarded by
                    // r < rows && c < cols inside x (rows*cols floats, float4 loads only when
                    // cols is a multiple of 4); codes are written at c*rows + r (< rows*cols) for
                    // in-range (r, c), scales at c*rows/32 + r/32 (< rows*cols/32).
                    unsafe { b.launch(cfg(tiles, THREADS)) }?;
                } else {
                    // Per count slot (rows divide into slots, `alloc_slots`).
                    let n4 = n64 / 4 / slots as u64;
                    let mut b = s.launch_builder(&self.k.mxfp8_row[e][r]);
                    b.arg(src).arg(codes).arg(scales_u8).arg(&n4);
                    b.arg(&max)
                        .arg(&rcp_max)
                        .arg(&emax)
                        .arg(stats)
                        .arg(&round_i);
                    // SAFETY: n is a multiple of 32 (validated) and each slot's rows a whole
                    // number of rows: slot y's n4 float4 loads, u32 code stores and n4/8 scale
                    // stores start at y·n4 and stay inside `src`, `codes` and `scales_u8`; its
                    // counts are stats[3y..3y+3] (3·slots, `alloc_slots`).
                    unsafe { b.launch(cfg_slots(grid, THREADS, slots)) }?;
                }
            }
            QuantFormat::Nvfp4 { second, shards } => {
                let shards32 = shards as u32;
                let rcp6: f32 = 1.0 / 6.0;
                let segs = (br * shards).min(u32::MAX as usize) as u32;
                // 16-element blocks per (row, shard) segment; segment s is blocks [s·L, (s+1)·L).
                let seg_blocks = (bc / shards / NV_BLOCK) as u32;
                // Per-token kernels take the segments of one count slot at a time.
                let slot_segs = (br * shards / slots) as u64;
                let nblocks = (n / NV_BLOCK) as u64;
                if second == SecondScale::PerToken
                    && let Some(f) = self
                        .k
                        .nvfp4_token_staged
                        .as_ref()
                        .filter(|_| self.uses_staged_nvfp4(seg_blocks as usize))
                {
                    let mut b = s.launch_builder(f);
                    b.arg(src).arg(codes).arg(scales_u8).arg(&mut *row_keys);
                    b.arg(&slot_segs).arg(&seg_blocks).arg(&rcp6).arg(stats);
                    b.arg(&round_i);
                    let cfg = LaunchConfig {
                        shared_mem_bytes: STAGED_SMEM,
                        ..cfg_slots(self.staged_grid, STAGED_THREADS, slots)
                    };
                    // SAFETY: as for `nvfp4_token16` below (same arguments, same index ranges);
                    // segments hold at most SG_CHUNK blocks (checked above), so a chunk fits in
                    // its STAGED_SMEM / 3 stage; the function was allowed STAGED_SMEM bytes.
                    unsafe { b.launch(cfg) }?;
                } else if second == SecondScale::PerToken {
                    let mut b = s.launch_builder(&self.k.nvfp4_token);
                    b.arg(src).arg(codes).arg(scales_u8).arg(&mut *row_keys);
                    b.arg(&slot_segs).arg(&seg_blocks).arg(&rcp6).arg(stats);
                    b.arg(&round_i);
                    // SAFETY: cols is a multiple of 16·shards, so the n/16 blocks are exactly the
                    // br·shards segments of seg_blocks blocks, slot y's the y-th slot_segs of
                    // them; each block index b < n/16 reads floats 16b..16b+16 of `src` and
                    // writes code bytes 8b..8b+8 (n/2 in all) and scale byte b (n/16); row_keys
                    // has br·shards entries; slot y counts into stats[3y..3y+3].
                    unsafe { b.launch(cfg_slots(self.nv_grid, THREADS, slots)) }?;
                } else {
                    s.memset_zeros(keys)?;
                    if shards == 1 {
                        let n4 = n64 / 4;
                        let mut b = s.launch_builder(&self.k.nvfp4_amax16);
                        b.arg(src).arg(&mut *keys).arg(&n4);
                        // SAFETY: float4 index j < n/4 stays inside `src`; one key.
                        unsafe { b.launch(cfg(self.nv_grid, THREADS)) }?;
                    } else {
                        let mut b = s.launch_builder(&self.k.nvfp4_amax);
                        b.arg(src).arg(&mut *row_keys).arg(&mut *keys);
                        b.arg(&br64).arg(&bc64).arg(&shards32);
                        // SAFETY: a block per (row, shard) segment of cols/shards floats inside
                        // its row; row_keys has br*shards entries, keys `shards`.
                        unsafe { b.launch(cfg(segs.min(grid), THREADS)) }?;
                    }
                    let mut b = s.launch_builder(&self.k.nvfp4_tensor);
                    b.arg(src).arg(codes).arg(scales_u8).arg(&*keys);
                    b.arg(&nblocks).arg(&seg_blocks).arg(&shards32).arg(&rcp6);
                    b.arg(stats);
                    // SAFETY: block index b < n/16 reads floats 16b..16b+16 and writes code
                    // bytes 8b..8b+8 and scale byte b; key indices (b / L) % shards are below
                    // `shards`.
                    unsafe { b.launch(cfg(self.nv_grid, THREADS)) }?;
                }
            }
            QuantFormat::Fp8Block { tile, variant } => {
                let variant_i: i32 = match variant {
                    Fp8BlockVariant::Te => 0,
                    Fp8BlockVariant::DeepseekV3 => 1,
                    Fp8BlockVariant::DeepseekV3Ue8m0 => 2,
                    Fp8BlockVariant::Deepgemm => 3,
                    Fp8BlockVariant::DeepgemmUe8m0 => 4,
                };
                if bc % 4 == 0 {
                    let f = match tile {
                        Fp8Tile::Act1x128 => &self.k.fp8_1x128,
                        Fp8Tile::Weight128x128 => &self.k.fp8_128,
                    };
                    let mut b = s.launch_builder(f);
                    b.arg(src).arg(codes).arg(&mut *scales_f32);
                    b.arg(&br64).arg(&bc64).arg(&variant_i).arg(stats);
                    // SAFETY: cols is a multiple of 4, so every float4 load and u32 code store of
                    // an in-range (row, column) is inside the n-element buffers; scale indices
                    // are tile indices below the tile count `alloc` sized.
                    unsafe { b.launch(cfg(grid, THREADS)) }?;
                    return Ok(());
                }
                let tile_rows: u32 = match tile {
                    Fp8Tile::Act1x128 => 1,
                    Fp8Tile::Weight128x128 => TILE as u32,
                };
                let tiles = keys.len();
                s.memset_zeros(keys)?;
                {
                    let warps = br * bc.div_ceil(TILE);
                    let mut b = s.launch_builder(&self.k.fp8_amax);
                    b.arg(src)
                        .arg(&mut *keys)
                        .arg(&br64)
                        .arg(&bc64)
                        .arg(&tile_rows);
                    // SAFETY: one warp per (row, tile); reads stay inside the row, atomics index
                    // the tile grid of `tiles` keys.
                    unsafe { b.launch(cfg(blocks(warps * 32, THREADS), THREADS)) }?;
                }
                let tiles64 = tiles as u64;
                {
                    let mut b = s.launch_builder(&self.k.fp8_scales);
                    b.arg(&*keys).arg(&mut *scales_f32).arg(&mut *apply);
                    b.arg(&tiles64).arg(&variant_i);
                    // SAFETY: one thread per tile, bounded by `tiles`, the length of all three.
                    unsafe { b.launch(cfg(blocks(tiles, THREADS), THREADS)) }?;
                }
                let divide = i32::from(matches!(
                    variant,
                    Fp8BlockVariant::DeepseekV3 | Fp8BlockVariant::DeepseekV3Ue8m0
                ));
                let mut b = s.launch_builder(&self.k.fp8_encode);
                b.arg(src).arg(codes).arg(&*apply).arg(&br64).arg(&bc64);
                b.arg(&tile_rows).arg(&divide).arg(stats);
                // SAFETY: grid-stride loop below n over `src` and `codes` (n each); tile indices
                // are below `tiles`.
                unsafe { b.launch(cfg(grid, THREADS)) }?;
            }
        }
        Ok(())
    }

    /// `out[c, r] = x[r, c]` on the device.
    fn transpose(
        &self,
        x: &CudaSlice<f32>,
        rows: usize,
        cols: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let (r64, c64) = (rows as u64, cols as u64);
        let mut b = self.stream.launch_builder(&self.k.transpose);
        b.arg(x).arg(out).arg(&r64).arg(&c64);
        let grid = (cols.div_ceil(32) as u32, rows.div_ceil(32) as u32, 1);
        // SAFETY: every load and store is guarded by `r < rows && c < cols` in the kernel; both
        // buffers hold rows*cols floats.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: grid,
                block_dim: (32, 8, 1),
                shared_mem_bytes: 0,
            })
        }?;
        Ok(())
    }

    /// `out[..rows*cols]` = the transpose of `x`'s `[rows, cols]` (row-major), on this
    /// quantizer's stream: the transpose its column quantizations use.
    pub(crate) fn transpose_into(
        &self,
        x: &CudaSlice<f32>,
        rows: usize,
        cols: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let n = rows
            .checked_mul(cols)
            .ok_or_else(|| CudaError::Shape(format!("transpose: {rows} x {cols} overflows")))?;
        if x.len() < n || out.len() < n {
            return Err(CudaError::Shape(format!(
                "transpose of {rows} x {cols}: input holds {}, output {}",
                x.len(),
                out.len()
            )));
        }
        if n == 0 {
            return Ok(());
        }
        self.transpose(x, rows, cols, out)
    }

    /// Read a device result back into the CPU's [`QuantizedTensor`] (waits for the stream).
    pub fn to_host(&self, q: &DeviceQuantized) -> Result<QuantizedTensor, CudaError> {
        let s = &self.stream;
        let (br, _) = match q.axis {
            Axis::Row => (q.rows, q.cols),
            Axis::Col => (q.cols, q.rows),
        };
        let stats = s.clone_dtoh(&q.stats)?;
        let codes = s.clone_dtoh(&q.codes)?;
        let (scales, global_amax) = match q.format {
            QuantFormat::Bf16 => (Scales::None, vec![]),
            QuantFormat::Mxfp8 { .. } => (Scales::E8m0(s.clone_dtoh(&q.scales_u8)?), vec![]),
            QuantFormat::Nvfp4 { second, shards } => {
                let keys = match second {
                    SecondScale::PerToken => s.clone_dtoh(&q.row_keys)?,
                    SecondScale::PerTensor => s.clone_dtoh(&q.keys)?,
                };
                debug_assert_eq!(
                    keys.len(),
                    match second {
                        SecondScale::PerToken => br * shards,
                        SecondScale::PerTensor => shards,
                    }
                );
                (
                    Scales::E4m3(s.clone_dtoh(&q.scales_u8)?),
                    keys_to_f32(&keys),
                )
            }
            QuantFormat::Fp8Block { .. } => (Scales::F32(s.clone_dtoh(&q.scales_f32)?), vec![]),
        };
        s.synchronize()?;
        Ok(QuantizedTensor {
            format: q.format,
            axis: q.axis,
            rows: q.rows,
            cols: q.cols,
            codes,
            scales,
            global_amax,
            // The whole tensor's counts: every slot's summed.
            stats: stats
                .chunks_exact(3)
                .map(|c| QuantStats {
                    elements: c[0],
                    saturated: c[1],
                    underflowed: c[2],
                })
                .fold(QuantStats::default(), QuantStats::merge),
        })
    }

    /// Every element codec on every input (test support): per input, the E4M3 and E5M2 saturating
    /// codes, the E2M1 TE code, the BF16 bits, and the E8M0 ceil byte.
    pub fn encode_elements(&self, bits: &[u32]) -> Result<Vec<ElementCodes>, CudaError> {
        let n = bits.len();
        if n == 0 {
            return Ok(vec![]);
        }
        let s = &self.stream;
        let d = s.clone_htod(bits)?;
        let mut out = s.alloc_zeros::<u8>(5 * n)?;
        let mut e8 = s.alloc_zeros::<u8>(n)?;
        let n64 = n as u64;
        let mut b = s.launch_builder(&self.k.elements);
        b.arg(&d).arg(&mut out).arg(&mut e8).arg(&n64);
        // SAFETY: one thread per input, bounded by n; `out` holds 5n bytes and `e8` n.
        unsafe { b.launch(cfg(blocks(n, THREADS), THREADS)) }?;
        let out = s.clone_dtoh(&out)?;
        let e8 = s.clone_dtoh(&e8)?;
        s.synchronize()?;
        Ok(out
            .chunks_exact(5)
            .zip(e8)
            .map(|(o, e)| ElementCodes {
                e4m3_sat: o[0],
                e5m2_sat: o[1],
                e2m1_te: o[2],
                bf16: u16::from_le_bytes([o[3], o[4]]),
                e8m0_ceil: e,
            })
            .collect())
    }
}

/// One input's codes from every element codec (see [`CudaQuantizer::encode_elements`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ElementCodes {
    pub e4m3_sat: u8,
    pub e5m2_sat: u8,
    pub e2m1_te: u8,
    pub bf16: u16,
    pub e8m0_ceil: u8,
}

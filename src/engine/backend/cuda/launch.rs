//! What the op set's kernel launches share: launch configurations, the shape checks that keep
//! every kernel inside its buffers, and the row layouts attention and the embedding read.
//!
//! Buffers may be longer than an op needs (the op reads and writes the leading elements), so
//! buffers sized for the largest layout serve every step; shorter ones are a
//! [`CudaError::Shape`]. Indices held on the device (tokens, positions, replayed expert ids) are
//! checked in the kernels: an out-of-range one makes its outputs NaN where the CPU would panic,
//! and nothing is read outside a buffer.

use super::CudaError;
use crate::engine::layout::Layout;
use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig};
use std::sync::Arc;

/// Threads per block for every kernel (8 warps).
const THREADS: u32 = 256;
/// Grid cap: kernels loop (grid-stride) past it, so no shape overflows the grid.
const MAX_GRID: usize = 1 << 16;

/// A [`Layout`] on the device: what attention and the position embedding read per row.
pub struct DeviceLayout {
    pub rows: usize,
    pub max_context: usize,
    /// `[rows]`: position of each row ([`Layout::positions`]).
    pub positions: CudaSlice<u32>,
    /// `[rows]`: keys each row attends to ([`Layout::context`]'s length).
    pub ctx_len: CudaSlice<u32>,
    /// `[rows * max_context]`: row index of key j of row i (0 past the row's context).
    pub ctx_keys: CudaSlice<u32>,
}

impl DeviceLayout {
    /// Copy `layout`'s positions and attention contexts to the device (queued on `stream`; the
    /// host vectors are staged by the copy, so nothing here must outlive the call).
    pub fn upload(stream: &Arc<CudaStream>, layout: &Layout) -> Result<Self, CudaError> {
        let (rows, s) = (layout.rows(), layout.max_context());
        dim("layout", "rows", rows)?;
        let cells = checked(rows, s, "layout", "rows x max_context")?;
        let mut ctx_len = Vec::with_capacity(rows);
        let mut ctx_keys = vec![0u32; cells];
        for i in 0..rows {
            let (len, key) = layout.context(i);
            ctx_len.push(len as u32);
            for (j, k) in ctx_keys[i * s..][..len].iter_mut().enumerate() {
                *k = key(j) as u32;
            }
        }
        let positions: Vec<u32> = layout.positions().iter().map(|&p| p as u32).collect();
        Self::from_host(stream, s, &positions, &ctx_len, &ctx_keys)
    }

    /// One decode step: position `pos` of each of `seqs` sequences whose keys and values sit in a
    /// cache of `capacity` rows per sequence (sequence `i`'s position `p` at row
    /// `i * capacity + p`); every query attends to its own sequence's positions `0..=pos`.
    pub fn decode_step(
        stream: &Arc<CudaStream>,
        seqs: usize,
        capacity: usize,
        pos: usize,
    ) -> Result<Self, CudaError> {
        Self::decode_rows(stream, seqs, capacity, pos, 1)
    }

    /// `count` decode steps' rows at once: positions `pos..pos + count` of each sequence,
    /// sequence-major (row `i * count + j` is sequence `i`'s position `pos + j`, attending to its
    /// positions `0..=pos + j`).
    pub fn decode_rows(
        stream: &Arc<CudaStream>,
        seqs: usize,
        capacity: usize,
        pos: usize,
        count: usize,
    ) -> Result<Self, CudaError> {
        if pos + count > capacity {
            return Err(shape(format!(
                "decode step: positions {pos}..{} past a cache of {capacity} positions",
                pos + count
            )));
        }
        let s = pos + count;
        let rows = checked(seqs, count, "decode step", "sequences x positions")?;
        let cells = checked(rows, s, "decode step", "rows x positions")?;
        checked(seqs, capacity, "decode step", "sequences x capacity")
            .and_then(|rows| dim("decode step", "cache rows", rows))?;
        let (mut positions, mut ctx_len) = (Vec::with_capacity(rows), Vec::with_capacity(rows));
        let mut ctx_keys = vec![0u32; cells];
        for i in 0..seqs {
            for j in 0..count {
                let (r, len) = (i * count + j, pos + j + 1);
                positions.push((pos + j) as u32);
                ctx_len.push(len as u32);
                for (p, k) in ctx_keys[r * s..][..len].iter_mut().enumerate() {
                    *k = (i * capacity + p) as u32;
                }
            }
        }
        Self::from_host(stream, s, &positions, &ctx_len, &ctx_keys)
    }

    /// `(rows, max_context)`, after checking that the context arrays have that shape.
    pub(super) fn check(&self, op: &str) -> Result<(usize, usize), CudaError> {
        let (n, s) = (self.rows, self.max_context);
        if self.ctx_len.len() != n || self.ctx_keys.len() != checked(n, s, op, "rows x S")? {
            return Err(shape(format!(
                "{op}: DeviceLayout of {n} rows x {s} keys has ctx_len {} and ctx_keys {}",
                self.ctx_len.len(),
                self.ctx_keys.len()
            )));
        }
        Ok((n, s))
    }

    /// From host arrays: each row's position, context length and context keys (`max_context`
    /// per row). Every key must be a row of the layout (the attention kernels rely on it).
    pub fn from_host(
        stream: &Arc<CudaStream>,
        max_context: usize,
        positions: &[u32],
        ctx_len: &[u32],
        ctx_keys: &[u32],
    ) -> Result<Self, CudaError> {
        Ok(DeviceLayout {
            rows: positions.len(),
            max_context,
            positions: upload(stream, positions)?,
            ctx_len: upload(stream, ctx_len)?,
            ctx_keys: upload(stream, ctx_keys)?,
        })
    }
}

/// `v` on the device; an empty slice becomes cudarc's null slice (a zero-byte allocation is an
/// error on some drivers).
fn upload(stream: &Arc<CudaStream>, v: &[u32]) -> Result<CudaSlice<u32>, CudaError> {
    Ok(if v.is_empty() {
        stream.null()?
    } else {
        stream.clone_htod(v)?
    })
}

pub(super) fn shape(msg: String) -> CudaError {
    CudaError::Shape(msg)
}

/// `have >= want`, or a Shape error naming the op and the buffer.
pub(super) fn need(op: &str, name: &str, have: usize, want: usize) -> Result<(), CudaError> {
    if have < want {
        return Err(shape(format!(
            "{op}: {name} holds {have} elements, needs at least {want}"
        )));
    }
    Ok(())
}

/// A dimension as the kernels' u32.
pub(super) fn dim(op: &str, name: &str, v: usize) -> Result<u32, CudaError> {
    u32::try_from(v).map_err(|_| shape(format!("{op}: {name} = {v} exceeds u32")))
}

pub(super) fn checked(a: usize, b: usize, op: &str, what: &str) -> Result<usize, CudaError> {
    a.checked_mul(b)
        .ok_or_else(|| shape(format!("{op}: {what} = {a} x {b} overflows")))
}

/// A block of `THREADS` threads per item (grid-stride past `MAX_GRID` blocks).
pub(super) fn cfg_blocks(items: usize) -> LaunchConfig {
    cfg(items.saturating_mul(THREADS as usize))
}

/// A thread per item (grid-stride past `MAX_GRID` blocks).
pub(super) fn cfg(items: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            items.div_ceil(THREADS as usize).clamp(1, MAX_GRID) as u32,
            1,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A warp per item.
pub(super) fn cfg_warps(items: usize) -> LaunchConfig {
    cfg(items.saturating_mul(32))
}

/// Each row's layout group on the device (`[first, end)` row ranges): attention's key and value
/// gradients gather over the query rows of the key's group.
pub struct DeviceGroups {
    pub(super) first: CudaSlice<u32>,
    pub(super) end: CudaSlice<u32>,
}

impl DeviceGroups {
    pub fn upload(stream: &Arc<CudaStream>, layout: &Layout) -> Result<Self, CudaError> {
        let n = layout.rows();
        let (mut first, mut end) = (vec![0u32; n], vec![0u32; n]);
        for g in 0..layout.groups() {
            let rows = layout.group_rows(g);
            for r in rows.clone() {
                first[r] = rows.start as u32;
                end[r] = rows.end as u32;
            }
        }
        Self::from_host(stream, &first, &end)
    }

    /// From each row's first and past-the-end group row.
    pub fn from_host(
        stream: &Arc<CudaStream>,
        first: &[u32],
        end: &[u32],
    ) -> Result<Self, CudaError> {
        dim("layout", "rows", first.len())?;
        Ok(DeviceGroups {
            first: upload(stream, first)?,
            end: upload(stream, end)?,
        })
    }
}

//! The capacity-padded expert batch (`moe.cu`), shared by the resident forward, decoder and
//! trainer: the routed slots of a layer go to rows of a batch where expert e owns rows
//! `[e·cap, (e+1)·cap)` (its tokens in token order, then zero rows), so every expert site runs as
//! one strided batched GEMM. The capacity is every row a run has, with no host round trip, or,
//! in a batch's training passes, the busiest expert's count ([`ExpertBatch::largest_count`], one
//! small copy back per layer): at top-2 of 8 experts every row makes three of every four expert
//! rows padding.

use super::launch::dim;
use super::{CudaDevice, CudaError};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use std::sync::Arc;

const SRC: &str = include_str!("moe.cu");

/// `moe.cu`'s ROUTE_THREADS: a block of `route_slots` (one per run) ranks this many slots at once.
const ROUTE_THREADS: u32 = 1024;

/// `moe.cu`'s ROUTE_MAX_EXPERTS: the most experts a run may have for `route_slots`, whose
/// shared counters have room for that many.
const ROUTE_MAX_EXPERTS: usize = 256;

/// A slot's or a batch row's entry when it has none (`moe.cu`'s 0xFFFFFFFF).
pub const NO_ROW: u32 = u32::MAX;

/// `moe.cu`'s kernels.
pub struct ExpertBatch {
    route_slots: CudaFunction,
    gather_padded: CudaFunction,
    expert_counts: CudaFunction,
}

/// Where each slot went: `slot_row[n·k]` (batch row of slot t·k + j) and `src_row[e·cap]` (token
/// of each batch row, [`NO_ROW`] for padding).
pub struct Slots {
    pub slot_row: CudaSlice<u32>,
    pub src_row: CudaSlice<u32>,
    pub cap: usize,
}

impl ExpertBatch {
    pub fn new(dev: &Arc<CudaDevice>) -> Result<Self, CudaError> {
        let m = dev.compile("moe", SRC)?;
        Ok(ExpertBatch {
            route_slots: m.load_function("route_slots")?,
            gather_padded: m.load_function("gather_padded")?,
            expert_counts: m.load_function("expert_counts")?,
        })
    }

    /// The most slots any one expert of any run got from `ids` (`[n, k]` expert ids, `runs` runs'
    /// rows in turn; ids >= e are not counted). Waits for the stream: the host sizes the batch.
    pub fn largest_count(
        &self,
        stream: &Arc<CudaStream>,
        ids: &CudaSlice<u32>,
        (n, k, e): (usize, usize, usize),
        runs: usize,
    ) -> Result<usize, CudaError> {
        let op = "expert_counts";
        if runs == 0 || !n.is_multiple_of(runs) || ids.len() < n * k {
            return Err(CudaError::Shape(format!(
                "{op}: {n} tokens of {runs} runs, {} ids for {n} x {k}",
                ids.len()
            )));
        }
        if n * k == 0 {
            return Ok(0);
        }
        let mut counts = stream.alloc_zeros::<u32>(e * runs)?;
        let (nk32, e32, runs32) = (
            dim(op, "slots", n * k)?,
            dim(op, "e", e)?,
            dim(op, "runs", runs)?,
        );
        dim(op, "counts", e * runs)?;
        let mut b = stream.launch_builder(&self.expert_counts);
        b.arg(ids)
            .arg(&mut counts)
            .arg(&nk32)
            .arg(&e32)
            .arg(&runs32);
        // SAFETY: grid-stride over slots s < n·k (ids holds that many, checked); a slot of run
        // s / (n·k / runs) < runs with id < e adds to counts[run·e + id] < e·runs (its length).
        unsafe { b.launch(LaunchConfig::for_num_elems(nk32.min(1 << 16))) }?;
        let counts = stream.clone_dtoh(&counts)?;
        Ok(counts.into_iter().max().unwrap_or(0) as usize)
    }

    /// Route the `n·k` slots of `ids` (`[n, k]` expert ids) to a batch of `e` experts with `cap`
    /// rows each. With `runs` > 1 the tokens are that many runs' rows in turn (`n / runs` each)
    /// and the batch holds each run's `e` experts in turn. `cap` must be at least
    /// [`ExpertBatch::largest_count`] (a run's rows bound it where each token names distinct
    /// experts); a slot past it would be dropped.
    pub fn route(
        &self,
        stream: &Arc<CudaStream>,
        ids: &CudaSlice<u32>,
        (n, k, e): (usize, usize, usize),
        cap: usize,
        runs: usize,
    ) -> Result<Slots, CudaError> {
        let op = "moe";
        if runs == 0 || !n.is_multiple_of(runs) || ids.len() < n * k {
            return Err(CudaError::Shape(format!(
                "{op}: capacity {cap} for {n} tokens of {runs} runs, {} ids for {n} x {k}",
                ids.len()
            )));
        }
        let experts = e * runs;
        // Not zeroed: `route_slots` writes every slot's row and every batch row's source.
        // SAFETY: device memory, fully written by the launch below before any read.
        let mut slot_row = unsafe { stream.alloc::<u32>((n * k).max(1))? };
        let mut src_row = unsafe { stream.alloc::<u32>((experts * cap).max(1))? };
        let (nk32, k32, e32) = (dim(op, "slots", n * k)?, dim(op, "k", k)?, dim(op, "e", e)?);
        let (cap32, runs32) = (dim(op, "cap", cap)?, dim(op, "runs", runs)?);
        dim(op, "experts", experts)?;
        dim(op, "expert rows", experts * cap)?;
        if e > ROUTE_MAX_EXPERTS {
            return Err(CudaError::Shape(format!(
                "{op}: {e} experts a run; the device routes at most {ROUTE_MAX_EXPERTS}"
            )));
        }
        let mut b = stream.launch_builder(&self.route_slots);
        b.arg(ids).arg(&mut slot_row).arg(&mut src_row);
        b.arg(&nk32).arg(&k32).arg(&e32).arg(&cap32).arg(&runs32);
        let cfg = LaunchConfig {
            grid_dim: (runs32, 1, 1),
            block_dim: (ROUTE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: block q < runs reads ids in run q's slot range (within n·k) and writes
        // slot_row[s] there and src_row[(q·e + ex)·cap + r] for ex < e, r < cap; both buffers
        // hold those many entries. Its shared counters hold ROUTE_MAX_EXPERTS experts (checked).
        unsafe { b.launch(cfg) }?;
        Ok(Slots {
            slot_row,
            src_row,
            cap,
        })
    }

    /// `dst[row] = x[src_row[row]]` for `rows` rows of `d` floats, a zero row where `src_row` is
    /// [`NO_ROW`] or not below `n` (x's rows).
    #[allow(clippy::too_many_arguments)]
    pub fn gather(
        &self,
        stream: &Arc<CudaStream>,
        dst: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        src_row: &CudaSlice<u32>,
        rows: usize,
        d: usize,
        n: usize,
    ) -> Result<(), CudaError> {
        let op = "gather_padded";
        if dst.len() < rows * d || src_row.len() < rows || x.len() < n * d {
            return Err(CudaError::Shape(format!(
                "{op}: {rows} rows of {d} from {n}: dst holds {}, src_row {}, x {}",
                dst.len(),
                src_row.len(),
                x.len()
            )));
        }
        if rows * d == 0 {
            return Ok(());
        }
        let (rows32, d32, n32) = (dim(op, "rows", rows)?, dim(op, "d", d)?, dim(op, "n", n)?);
        let mut b = stream.launch_builder(&self.gather_padded);
        b.arg(dst).arg(x).arg(src_row);
        b.arg(&rows32).arg(&d32).arg(&n32);
        // SAFETY: grid-stride over i < rows·d (dst's length, checked); x is read at src·d + c only
        // for src < n (x holds n·d, checked); src_row holds rows entries (checked).
        unsafe { b.launch(LaunchConfig::for_num_elems((rows * d).min(1 << 20) as u32)) }?;
        Ok(())
    }
}

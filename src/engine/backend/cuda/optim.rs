//! The optimizer on the device (`optim.cu`): [`crate::engine::optim`]'s AdamW update and the
//! trainer's gradient norms, bit for bit, for training state kept on the GPU (every run's master
//! weights, moments and gradients stacked as the batched passes stack models: a tensor holds each
//! run's copy back to back). Each op queues its kernels on the caller's stream and brings back
//! only its sums (a few numbers a run).

use super::launch::{cfg, shape};
use super::{CudaDevice, CudaError};
use crate::engine::optim::{AdamStep, CHUNK};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, PushKernelArg};
use std::sync::Arc;

/// The compiled kernels of `optim.cu`.
pub struct GpuOptim {
    update: CudaFunction,
    chunk_sums: CudaFunction,
    sum_squares: CudaFunction,
}

impl GpuOptim {
    pub fn new(dev: &Arc<CudaDevice>) -> Result<Self, CudaError> {
        let m = dev.compile_with_prelude("optim", include_str!("optim.cu"))?;
        Ok(GpuOptim {
            update: m.load_function("adamw_update")?,
            chunk_sums: m.load_function("adamw_chunk_sums")?,
            sum_squares: m.load_function("sum_squares")?,
        })
    }

    /// [`crate::engine::optim::update_tensor`] on each run's block of one tensor (`len` values a
    /// run; run r with `steps[r]`): `p`, `m`, `v` updated in place from `g`. Returns each run's
    /// chunk sums in chunk order (waits for them).
    #[allow(clippy::too_many_arguments)]
    pub fn update(
        &self,
        s: &Arc<CudaStream>,
        p: &mut CudaSlice<f32>,
        m: &mut CudaSlice<f32>,
        v: &mut CudaSlice<f32>,
        g: &CudaSlice<f32>,
        len: usize,
        steps: &[AdamStep],
    ) -> Result<Vec<Vec<(f64, f64)>>, CudaError> {
        let runs = steps.len();
        let total = len
            .checked_mul(runs)
            .ok_or_else(|| shape(format!("adamw: {len} x {runs} values overflow")))?;
        for (name, have) in [
            ("p", p.len()),
            ("m", m.len()),
            ("v", v.len()),
            ("g", g.len()),
        ] {
            if have < total {
                return Err(shape(format!(
                    "adamw: {name} holds {have} values, {runs} runs of {len} need {total}"
                )));
            }
        }
        if total == 0 {
            return Ok(vec![Vec::new(); runs]);
        }
        let ks: Vec<f32> = steps
            .iter()
            .flat_map(|k| {
                [
                    k.lr, k.beta1, k.beta2, k.eps, k.bc1, k.bc2, k.scale, k.decay,
                ]
            })
            .collect();
        let ks = s.clone_htod(&ks)?;
        // SAFETY: written in full by `adamw_update` (every index below total) before any read.
        let mut step = unsafe { s.alloc::<f32>(total)? };
        let (len64, runs32) = (
            len as u64,
            u32::try_from(runs).map_err(|_| shape("adamw: runs".into()))?,
        );
        let mut b = s.launch_builder(&self.update);
        b.arg(&mut *p)
            .arg(&mut *m)
            .arg(&mut *v)
            .arg(&mut step)
            .arg(g)
            .arg(&ks)
            .arg(&len64)
            .arg(&runs32);
        // SAFETY: indices below len * runs <= every buffer's length (checked above); ks holds 8
        // values a run.
        unsafe { b.launch(cfg(total)) }?;
        let chunks = len.div_ceil(CHUNK);
        // SAFETY: written in full by `adamw_chunk_sums` (2 values per (run, chunk)).
        let mut sums = unsafe { s.alloc::<f64>(2 * chunks * runs)? };
        let chunk32 = CHUNK as u32;
        let mut b = s.launch_builder(&self.chunk_sums);
        b.arg(&mut sums)
            .arg(&step)
            .arg(&*p)
            .arg(&len64)
            .arg(&runs32)
            .arg(&chunk32);
        // SAFETY: reads below len * runs of step and p; writes 2 * chunks * runs values.
        unsafe { b.launch(cfg(chunks * runs)) }?;
        let host = s.clone_dtoh(&sums)?;
        Ok(host
            .chunks(2 * chunks)
            .map(|run| run.chunks(2).map(|c| (c[0], c[1])).collect())
            .collect())
    }

    /// [`crate::engine::optim::sum_squares`] of each run's block of `x` (`len` values a run, `runs`
    /// runs), in run order (waits for them).
    pub fn sum_squares(
        &self,
        s: &Arc<CudaStream>,
        x: &CudaSlice<f32>,
        len: usize,
        runs: usize,
    ) -> Result<Vec<f64>, CudaError> {
        let total = len
            .checked_mul(runs)
            .ok_or_else(|| shape(format!("sum_squares: {len} x {runs} values overflow")))?;
        if x.len() < total {
            return Err(shape(format!(
                "sum_squares: x holds {} values, {runs} runs of {len} need {total}",
                x.len()
            )));
        }
        if runs == 0 {
            return Ok(Vec::new());
        }
        // SAFETY: written in full by `sum_squares` (one value a run).
        let mut out = unsafe { s.alloc::<f64>(runs)? };
        let (len64, runs32) = (
            len as u64,
            u32::try_from(runs).map_err(|_| shape("sum_squares: runs".into()))?,
        );
        let mut b = s.launch_builder(&self.sum_squares);
        b.arg(&mut out).arg(x).arg(&len64).arg(&runs32);
        // SAFETY: reads below len * runs <= x.len(); writes `runs` values.
        unsafe { b.launch(cfg(runs)) }?;
        Ok(s.clone_dtoh(&out)?)
    }
}

//! The optimizer on the device (`optim.cu`): [`crate::engine::optim`]'s AdamW update and the
//! trainer's gradient norms, bit for bit, for training state kept on the GPU (every run's master
//! weights, moments and gradients stacked as the batched passes stack models: a tensor holds each
//! run's copy back to back). Each op is one launch over every tensor of a model and brings back
//! only its sums (a few numbers a run).

use super::launch::shape;
use super::{CudaDevice, CudaError};
use crate::engine::optim::{AdamStep, CHUNK};
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use std::sync::Arc;

/// Threads of a block of `optim.cu`'s sums (its `SUM_THREADS`).
const SUM_THREADS: u32 = 256;
/// Grid cap: the kernels loop over their blocks' segments past it.
const MAX_BLOCKS: u64 = 1 << 16;

/// A block per segment (up to the cap), `SUM_THREADS` threads each.
fn segments_cfg(segments: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (segments.clamp(1, MAX_BLOCKS) as u32, 1, 1),
        block_dim: (SUM_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The compiled kernels of `optim.cu`.
pub struct GpuOptim {
    update: CudaFunction,
    sum_squares_many: CudaFunction,
}

/// One tensor of every run's training state, stacked (each run's `len` values in turn): the
/// master weights `p`, the moments `m` and `v`, and the gradients `g`.
pub struct StateTensor<'a> {
    pub p: &'a mut CudaSlice<f32>,
    pub m: &'a mut CudaSlice<f32>,
    pub v: &'a mut CudaSlice<f32>,
    pub g: &'a CudaSlice<f32>,
    pub len: usize,
}

impl GpuOptim {
    pub fn new(dev: &Arc<CudaDevice>) -> Result<Self, CudaError> {
        let m = dev.compile_with_prelude("optim", include_str!("optim.cu"))?;
        Ok(GpuOptim {
            update: m.load_function("adamw_model")?,
            sum_squares_many: m.load_function("sum_squares_many")?,
        })
    }

    /// [`crate::engine::optim::update_tensor`] on each run's block of one tensor (`len` values a
    /// run; run r with `steps[r]`, or left as it is where that is `None`): `p`, `m`, `v` updated
    /// in place from `g`. Returns each run's chunk sums in chunk order (a run left as it is sums
    /// zero updates and its unchanged weights); waits for them.
    #[allow(clippy::too_many_arguments)]
    pub fn update(
        &self,
        s: &Arc<CudaStream>,
        p: &mut CudaSlice<f32>,
        m: &mut CudaSlice<f32>,
        v: &mut CudaSlice<f32>,
        g: &CudaSlice<f32>,
        len: usize,
        steps: &[Option<AdamStep>],
    ) -> Result<Vec<Vec<(f64, f64)>>, CudaError> {
        let steps: Vec<Option<Vec<AdamStep>>> = steps.iter().map(|k| k.map(|k| vec![k])).collect();
        self.update_model(s, vec![StateTensor { p, m, v, g, len }], &steps)
    }

    /// [`crate::engine::optim::AdamW::update`]'s arithmetic on every tensor of a model for every
    /// run, in one launch: run r takes `steps[r]` (one [`AdamStep`] per tensor) or, where that is
    /// `None`, keeps its state. Returns each run's chunk sums, tensors in turn and each one's
    /// chunks in order (the order `AdamW::update` adds them up in; a run left as it is sums zero
    /// updates and its unchanged weights). Waits for them.
    pub fn update_model(
        &self,
        s: &Arc<CudaStream>,
        tensors: Vec<StateTensor<'_>>,
        steps: &[Option<Vec<AdamStep>>],
    ) -> Result<Vec<Vec<(f64, f64)>>, CudaError> {
        let runs = steps.len();
        for (t, x) in tensors.iter().enumerate() {
            let total = x
                .len
                .checked_mul(runs)
                .ok_or_else(|| shape(format!("adamw: {} x {runs} values overflow", x.len)))?;
            for (name, have) in [
                ("p", x.p.len()),
                ("m", x.m.len()),
                ("v", x.v.len()),
                ("g", x.g.len()),
            ] {
                if have < total {
                    return Err(shape(format!(
                        "adamw: tensor {t}'s {name} holds {have} values, {runs} runs of {} need \
                         {total}",
                        x.len
                    )));
                }
            }
        }
        if let Some(k) = steps.iter().flatten().find(|k| k.len() != tensors.len()) {
            return Err(shape(format!(
                "adamw: {} steps for a model of {} tensors",
                k.len(),
                tensors.len()
            )));
        }
        let chunks: Vec<usize> = tensors.iter().map(|x| x.len.div_ceil(CHUNK)).collect();
        let segments = chunks.iter().sum::<usize>() * runs;
        if segments == 0 {
            return Ok(vec![Vec::new(); runs]);
        }
        // Tensor t's constants for run r at (t * runs + r) * 9.
        let mut ks = Vec::with_capacity(tensors.len() * runs * 9);
        for t in 0..tensors.len() {
            for k in steps {
                ks.extend(match k {
                    Some(k) => {
                        let k = k[t];
                        [
                            k.lr, k.beta1, k.beta2, k.eps, k.bc1, k.bc2, k.scale, k.decay, 1.0,
                        ]
                    }
                    None => [0.0; 9],
                });
            }
        }
        let ks = s.clone_htod(&ks)?;
        let lens: Vec<u64> = tensors.iter().map(|x| x.len as u64).collect();
        let n = tensors.len();
        let mut ptrs = vec![0u64; 4 * n];
        // The guards (events, where tracked) live until the launch is queued.
        let mut guards = Vec::with_capacity(4 * n);
        for (t, x) in tensors.into_iter().enumerate() {
            let (pp, gp) = x.p.device_ptr_mut(s);
            let (mp, gm) = x.m.device_ptr_mut(s);
            let (vp, gv) = x.v.device_ptr_mut(s);
            let (gg, gg_guard) = x.g.device_ptr(s);
            (ptrs[t], ptrs[n + t], ptrs[2 * n + t], ptrs[3 * n + t]) = (pp, mp, vp, gg);
            guards.push((gp, gm, gv, gg_guard));
        }
        let (dptrs, dlens) = (s.clone_htod(&ptrs)?, s.clone_htod(&lens)?);
        // SAFETY: written in full by `adamw_model` (2 values a segment).
        let mut out = unsafe { s.alloc::<f64>(2 * segments)? };
        let (n32, runs32, chunk32, seg64) = (
            u32::try_from(n).map_err(|_| shape("adamw: tensors".into()))?,
            u32::try_from(runs).map_err(|_| shape("adamw: runs".into()))?,
            CHUNK as u32,
            segments as u64,
        );
        let mut b = s.launch_builder(&self.update);
        b.arg(&mut out)
            .arg(&dptrs)
            .arg(&dlens)
            .arg(&ks)
            .arg(&n32)
            .arg(&runs32)
            .arg(&chunk32)
            .arg(&seg64);
        // SAFETY: block (t, r, c) touches run r's chunk c of tensor t, inside each of its four
        // allocations (at least runs * lens[t] values, checked); ks holds 9 values per (tensor,
        // run); writes 2 * segments values.
        unsafe { b.launch(segments_cfg(seg64)) }?;
        drop(guards);
        let host = s.clone_dtoh(&out)?;
        let mut per_run = vec![Vec::new(); runs];
        let mut at = 0;
        for &c in &chunks {
            for run in per_run.iter_mut() {
                run.extend(host[at..at + 2 * c].chunks(2).map(|x| (x[0], x[1])));
                at += 2 * c;
            }
        }
        Ok(per_run)
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
        Ok(self.sum_squares_many(s, &[x], &[len], runs)?.remove(0))
    }

    /// [`Self::sum_squares`] of every tensor of `xs` at once (tensor t holding `runs` blocks of
    /// `lens[t]` values): `out[t][r]`, run r's sum of tensor t, in one launch (a block per
    /// tensor and run: a model's gradient norms cost its largest tensor's sum, not all of
    /// them in turn). Waits for them.
    pub fn sum_squares_many(
        &self,
        s: &Arc<CudaStream>,
        xs: &[&CudaSlice<f32>],
        lens: &[usize],
        runs: usize,
    ) -> Result<Vec<Vec<f64>>, CudaError> {
        if xs.len() != lens.len() {
            return Err(shape(format!(
                "sum_squares: {} tensors and {} lengths",
                xs.len(),
                lens.len()
            )));
        }
        for (t, (x, &len)) in xs.iter().zip(lens).enumerate() {
            let need = len
                .checked_mul(runs)
                .ok_or_else(|| shape(format!("sum_squares: {len} x {runs} values overflow")))?;
            if x.len() < need {
                return Err(shape(format!(
                    "sum_squares: tensor {t} holds {} values, {runs} runs of {len} need {need}",
                    x.len()
                )));
            }
        }
        let n = xs.len() * runs;
        if n == 0 {
            return Ok(vec![vec![0.0; runs]; xs.len()]);
        }
        // The tensors' device addresses; the guards (read events, where tracked) live until
        // the launch is queued.
        let (ptrs, guards): (Vec<u64>, Vec<_>) = xs.iter().map(|x| x.device_ptr(s)).unzip();
        let (dptrs, dlens) = (
            s.clone_htod(&ptrs)?,
            s.clone_htod(&lens.iter().map(|&l| l as u64).collect::<Vec<u64>>())?,
        );
        // SAFETY: written in full by `sum_squares_many` (one value per (tensor, run)).
        let mut out = unsafe { s.alloc::<f64>(n)? };
        let (t32, runs32) = (
            u32::try_from(xs.len()).map_err(|_| shape("sum_squares: tensors".into()))?,
            u32::try_from(runs).map_err(|_| shape("sum_squares: runs".into()))?,
        );
        let mut b = s.launch_builder(&self.sum_squares_many);
        b.arg(&mut out)
            .arg(&dptrs)
            .arg(&dlens)
            .arg(&t32)
            .arg(&runs32);
        // SAFETY: block (t, r) reads lens[t] values from ptrs[t] + r * lens[t], inside tensor t's
        // allocation (at least runs * lens[t] values, checked); writes n values.
        unsafe { b.launch(segments_cfg(n as u64)) }?;
        drop(guards);
        let host = s.clone_dtoh(&out)?;
        Ok(host.chunks(runs).map(|c| c.to_vec()).collect())
    }
}

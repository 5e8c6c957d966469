//! The optimizer on the device (`optim.cu`): [`crate::engine::optim`]'s AdamW update and the
//! trainer's gradient norms, bit for bit, for training state kept on the GPU (every run's master
//! weights, moments and gradients stacked as the batched passes stack models: a tensor holds each
//! run's copy back to back). Each op queues its kernels on the caller's stream and brings back
//! only its sums (a few numbers a run).

use super::launch::{cfg, shape};
use super::{CudaDevice, CudaError};
use crate::engine::optim::{AdamStep, CHUNK};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, PushKernelArg};
use std::sync::Arc;

/// The compiled kernels of `optim.cu`.
pub struct GpuOptim {
    update: CudaFunction,
    chunk_sums: CudaFunction,
    sum_squares: CudaFunction,
    sum_squares_many: CudaFunction,
}

impl GpuOptim {
    pub fn new(dev: &Arc<CudaDevice>) -> Result<Self, CudaError> {
        let m = dev.compile_with_prelude("optim", include_str!("optim.cu"))?;
        Ok(GpuOptim {
            update: m.load_function("adamw_update")?,
            chunk_sums: m.load_function("adamw_chunk_sums")?,
            sum_squares: m.load_function("sum_squares")?,
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
        self.update_queued(s, p, m, v, g, len, steps)?.read(s)
    }

    /// [`Self::update`] queued on `s` without waiting: its sums come with [`QueuedSums::read`]
    /// (a model's tensors are all queued first, then read).
    #[allow(clippy::too_many_arguments)]
    pub fn update_queued(
        &self,
        s: &Arc<CudaStream>,
        p: &mut CudaSlice<f32>,
        m: &mut CudaSlice<f32>,
        v: &mut CudaSlice<f32>,
        g: &CudaSlice<f32>,
        len: usize,
        steps: &[Option<AdamStep>],
    ) -> Result<QueuedSums, CudaError> {
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
        let chunks = len.div_ceil(CHUNK);
        if total == 0 {
            return Ok(QueuedSums {
                sums: None,
                runs,
                chunks,
            });
        }
        let ks: Vec<f32> = steps
            .iter()
            .flat_map(|k| match k {
                Some(k) => [
                    k.lr, k.beta1, k.beta2, k.eps, k.bc1, k.bc2, k.scale, k.decay, 1.0,
                ],
                None => [0.0; 9],
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
        // SAFETY: indices below len * runs <= every buffer's length (checked above); ks holds 9
        // values a run.
        unsafe { b.launch(cfg(total)) }?;
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
        Ok(QueuedSums {
            sums: Some(sums),
            runs,
            chunks,
        })
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

    /// [`Self::sum_squares`] of every tensor of `xs` at once (tensor t holding `runs` blocks of
    /// `lens[t]` values): `out[t][r]`, run r's sum of tensor t, in one launch (a thread per
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
        let (ptrs, _guards): (Vec<u64>, Vec<_>) = xs.iter().map(|x| x.device_ptr(s)).unzip();
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
        // SAFETY: thread (t, r) reads lens[t] values from ptrs[t] + r * lens[t], inside tensor t's
        // allocation (at least runs * lens[t] values, checked); writes n values.
        unsafe { b.launch(cfg(n)) }?;
        let host = s.clone_dtoh(&out)?;
        Ok(host.chunks(runs).map(|c| c.to_vec()).collect())
    }
}

/// The chunk sums of a queued [`GpuOptim::update_queued`].
pub struct QueuedSums {
    sums: Option<CudaSlice<f64>>,
    runs: usize,
    chunks: usize,
}

impl QueuedSums {
    /// Each run's (Σ update², Σ weight²) per chunk, in chunk order (waits for them).
    pub fn read(self, s: &Arc<CudaStream>) -> Result<Vec<Vec<(f64, f64)>>, CudaError> {
        let Some(sums) = self.sums else {
            return Ok(vec![Vec::new(); self.runs]);
        };
        let host = s.clone_dtoh(&sums)?;
        Ok(host
            .chunks(2 * self.chunks)
            .map(|run| run.chunks(2).map(|c| (c[0], c[1])).collect())
            .collect())
    }
}

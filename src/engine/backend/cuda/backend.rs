//! [`CudaBackend`]: the engine's [`Backend`] on one GPU: the model's passes (`model::pass`)
//! over [`GpuOps`]. The rollout and the evaluation decode there ([`ResidentDecoder`]), the
//! trainer's policy forward and backward and the warm start's steps run there
//! ([`ResidentPass`]), and so does the trainer's BF16 reference forward (`forward_logits`).
//! A trainer's state (master weights, AdamW moments, gradients) is held on the device
//! (`held`, [`HELD_FROM_RUNS`]): its weights are prepared, exported and updated there, and the
//! loss and the metrics stay on the host. The warm start's supervised steps hold their one run
//! there too (`warmstart`).
//!
//! Concurrent callers (the suite runner's workers) each take an op set — a stream, its cuBLAS
//! handle and compiled kernels — from a pool, so they never share a handle or a stream. cuBLAS is
//! deterministic for a given shape, handle configuration and GPU, so the same seed gives the same
//! metrics run to run.

use super::decoder::ResidentDecoder;
use super::device_ops::GpuOps;
use super::train::ResidentPass;
use super::{CudaDevice, CudaError};
use crate::engine::backend::Backend;
use crate::engine::device::OpError;
use crate::engine::layout::Layout;
use crate::engine::model::pass::{self, Weights};
use crate::engine::model::{PreparedModel, Routing, TrainPass};
use crate::engine::rollout::Decoder;
use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys::cublasMath_t;
use cudarc::driver::CudaStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// What the device passes have done since the backend opened (or since
/// [`CudaBackend::take_counters`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PassCounters {
    /// Whole prepared models copied to the device (decoder, trainer, reference forward) and the
    /// host's wall time for them, ns: packing and queuing the staged copy (the decoder's and
    /// trainer's do not wait for the copy itself; the reference's does).
    pub model_uploads: u64,
    pub model_upload_ns: u64,
    /// Wall time of the training forwards, ns (from the queued upload on, so waiting for its
    /// copy is included).
    pub train_forward_ns: u64,
    /// Runs' weights exported on the device from the masters it holds (never uploaded).
    pub held_exports: u64,
}

#[derive(Default)]
struct AtomicCounters {
    model_uploads: AtomicU64,
    model_upload_ns: AtomicU64,
    train_forward_ns: AtomicU64,
    held_exports: AtomicU64,
}

impl AtomicCounters {
    fn take(&self) -> PassCounters {
        let t = |f: &AtomicU64| f.swap(0, Ordering::Relaxed);
        PassCounters {
            model_uploads: t(&self.model_uploads),
            model_upload_ns: t(&self.model_upload_ns),
            train_forward_ns: t(&self.train_forward_ns),
            held_exports: t(&self.held_exports),
        }
    }
}

fn bump(field: &AtomicU64, v: u64) {
    field.fetch_add(v, Ordering::Relaxed);
}

/// [`Backend::batch_runs`] on a GPU: runs stepped as one pass when `--batch-runs` is not given.
/// On an H200 the nightly suite (30 runs x 40 steps) ran at 79.6-84.0 run-steps/s in batches of
/// up to 16 (two workers), against 55.9-56.8 for the worker pool stepping one run each; batches
/// of 8 gave 75.8-77.0, of 32 66.5-69.0 (`lockstep bench sweep --device cuda`, docs/cuda.md).
pub const BATCH_RUNS: usize = 16;

/// [`Backend::holds_training`] on a GPU: runs stepped this many or more together keep their
/// training state on the device. Every run: on an H200 a run alone steps in 44.7 ms held against
/// 53.7 on the host (bf16; nvfp4-dq 53.4 against 56.3), 8 together 12.9 against 26.3 ms a
/// run-step, and the worker pool's runs hold the same metrics bit for bit either way.
pub const HELD_FROM_RUNS: usize = 1;

/// The environment variable that overrides [`HELD_FROM_RUNS`]: `on`, `off`, or N.
pub const HELD_STATE_VAR: &str = "LOCKSTEP_HELD_STATE";

/// [`HELD_FROM_RUNS`], or what [`HELD_STATE_VAR`] says.
fn held_from_runs() -> Result<usize, CudaError> {
    match std::env::var(HELD_STATE_VAR) {
        Ok(v) => parse_held_state(&v),
        Err(_) => Ok(HELD_FROM_RUNS),
    }
}

/// A value of [`HELD_STATE_VAR`]: the fewest runs stepped together that keep their state on the
/// GPU.
fn parse_held_state(v: &str) -> Result<usize, CudaError> {
    match v.trim() {
        "on" => Ok(1),
        "off" => Ok(usize::MAX),
        n => n.parse().ok().filter(|&n| n >= 1).ok_or_else(|| {
            CudaError::Setting(format!(
                "{HELD_STATE_VAR}=`{v}`: use on, off, or N (runs stepped N or more together keep \
                 their training state on the GPU)"
            ))
        }),
    }
}

/// A cuBLAS handle on `stream` in `CUBLAS_PEDANTIC_MATH`: FP32 operands and accumulation, no
/// TF32 or other reduced-precision path, whatever `NVIDIA_TF32_OVERRIDE` says. Every FP32 cuBLAS
/// handle of the engine is made here.
pub(crate) fn pedantic_blas(stream: &Arc<CudaStream>) -> Result<CudaBlas, CudaError> {
    blas_in(stream, cublasMath_t::CUBLAS_PEDANTIC_MATH)
}

/// A cuBLAS handle on `stream` for GEMMs of BF16 operands (`linear::Operands::Bf16`): tensor
/// cores with FP32 accumulation (`CUBLAS_COMPUTE_32F`, asked for call by call) and, where cuBLAS
/// splits a sum, FP32 partial sums (`CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION`).
pub(crate) fn tensor_core_blas(stream: &Arc<CudaStream>) -> Result<CudaBlas, CudaError> {
    blas_in(
        stream,
        cublasMath_t::CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION,
    )
}

/// A cuBLAS handle on `stream` in math mode `mode`.
fn blas_in(stream: &Arc<CudaStream>, mode: cublasMath_t) -> Result<CudaBlas, CudaError> {
    let blas = CudaBlas::new(stream.clone())?;
    // SAFETY: the handle is valid (just created) and owned by the caller from here on; setting
    // its math mode is a plain configuration call with no memory access.
    let st = unsafe { cudarc::cublas::sys::cublasSetMathMode(*blas.handle(), mode) };
    st.result()?;
    Ok(blas)
}

/// Costly device objects (an op set with its compiled kernels), each used by one caller at a
/// time and handed back for the next: as many get built as callers ever overlap.
struct Pool<T>(Mutex<Vec<T>>);

impl<T> Pool<T> {
    /// One from the pool, or a new one from `make`.
    fn take(&self, make: impl FnOnce() -> Result<T, CudaError>) -> Result<T, CudaError> {
        let popped = self.0.lock().ok().and_then(|mut v| v.pop());
        match popped {
            Some(t) => Ok(t),
            None => make(),
        }
    }

    fn give(&self, t: T) {
        if let Ok(mut v) = self.0.lock() {
            v.push(t);
        }
    }
}

/// The engine on one GPU.
pub struct CudaBackend {
    dev: Arc<CudaDevice>,
    counters: AtomicCounters,
    /// Op sets (kernels, stream, cuBLAS handle) of finished passes, one per concurrent caller
    /// at most, so compiling them is paid once per worker.
    ops: Pool<GpuOps>,
    /// The inference copies `forward_logits` and `forward_logits_batch` uploaded, by
    /// [`PreparedModel::key`] (of a stack, its members' keys in order), newest last: the
    /// trainer's BF16 reference does not change during a run, so it is uploaded once per run or
    /// batch instead of once per step (up to [`UPLOADED_MODELS`]).
    uploaded: Mutex<Vec<(u64, Arc<Weights<GpuOps>>)>>,
    /// Runs' training state kept on the GPU across steps ([`Backend::holds_training`]).
    pub(super) held: super::held::HeldPool,
    /// [`Backend::holds_training`] says yes from this many runs stepped together
    /// ([`CudaBackend::set_holds_training`]).
    held_from: std::sync::atomic::AtomicUsize,
}

/// The key of a model, or of several stacked in this order, among the held inference copies.
fn models_key(preps: &[&PreparedModel]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    preps.len().hash(&mut h);
    for p in preps {
        p.key().hash(&mut h);
    }
    h.finish()
}

/// Inference copies kept (a model is a few tens of MB at the shipped sizes; a batch's stack that
/// times its runs).
const UPLOADED_MODELS: usize = 8;

impl CudaBackend {
    /// Open `cuda:ordinal` and build a first op set there (so a GPU whose cuBLAS or NVRTC does
    /// not start is an error here, not in the first pass).
    pub fn new(ordinal: usize) -> Result<Self, CudaError> {
        Self::with_event_tracking(ordinal, false)
    }

    /// As [`CudaBackend::new`], choosing whether cudarc tracks every buffer's uses across
    /// streams with events (its default; `false` here: `lockstep bench step` times both).
    ///
    /// Tracking costs two events per allocation and an event record or wait per buffer argument
    /// of every launch and copy, which a decode step's few hundred small launches feel. It is
    /// not needed here: every buffer of this backend is made and used on one op set's stream,
    /// except `forward_logits`' uploaded models, which are shared only after a host wait on the
    /// uploading stream, are read-only after that, and are freed only when their last user
    /// (which ends its call with a synchronizing copy back) drops them.
    pub fn with_event_tracking(ordinal: usize, tracking: bool) -> Result<Self, CudaError> {
        let dev = CudaDevice::open(ordinal)?;
        if !tracking {
            // SAFETY: set before this context makes any buffer; the cross-stream uses above
            // are synchronized by host waits.
            unsafe { dev.context().disable_event_tracking() };
        }
        let first = GpuOps::new(&dev)?;
        Ok(CudaBackend {
            dev,
            counters: AtomicCounters::default(),
            ops: Pool(Mutex::new(vec![first])),
            uploaded: Mutex::new(Vec::new()),
            held: Default::default(),
            held_from: std::sync::atomic::AtomicUsize::new(held_from_runs()?),
        })
    }

    /// An op set from the pool, or a new one.
    pub(super) fn take_ops(&self) -> Result<GpuOps, CudaError> {
        self.ops.take(|| GpuOps::new(&self.dev))
    }

    pub(super) fn give_ops(&self, mut o: GpuOps) {
        o.set_runs(1);
        o.set_run_counts(true);
        self.ops.give(o);
    }

    /// Count `runs` runs' weights exported on the device.
    pub(super) fn note_held_exports(&self, runs: usize) {
        bump(&self.counters.held_exports, runs as u64);
    }

    /// Count a whole-model upload that started at `since` and is queued (the host's part: packing
    /// the page-locked buffer and queuing the copies; `forward_logits` also waits for the copy).
    pub(super) fn note_model_upload(&self, since: std::time::Instant) {
        self.note_model_uploads(since, 1);
    }

    /// Count `models` whole models uploaded as one stack that started at `since`.
    pub(super) fn note_model_uploads(&self, since: std::time::Instant, models: usize) {
        bump(&self.counters.model_uploads, models as u64);
        bump(
            &self.counters.model_upload_ns,
            since.elapsed().as_nanos() as u64,
        );
    }

    /// Count a training forward that started at `since` and has finished.
    pub(super) fn note_train_forward(&self, since: std::time::Instant) {
        bump(
            &self.counters.train_forward_ns,
            since.elapsed().as_nanos() as u64,
        );
    }

    /// The inference copy of `preps` (one model, or several stacked as
    /// [`GpuOps::upload_models`] stacks them) for a pass on `f`: the copy an earlier pass left
    /// held ([`CudaBackend::hold_model`]), else a fresh upload, counted, that `f`'s stream has
    /// finished. With its key for `hold_model`.
    pub(super) fn inference_model(
        &self,
        f: &GpuOps,
        preps: &[&PreparedModel],
    ) -> Result<(u64, Arc<Weights<GpuOps>>), OpError> {
        let key = models_key(preps);
        let held = self.uploaded.lock().ok().and_then(|v| {
            v.iter()
                .find(|(k, _)| *k == key)
                .map(|(_, m)| Arc::clone(m))
        });
        if let Some(m) = held {
            return Ok((key, m));
        }
        let t0 = std::time::Instant::now();
        let m = f.upload_models(preps, false)?;
        f.stream().synchronize().map_err(CudaError::from)?;
        self.note_model_uploads(t0, preps.len());
        Ok((key, Arc::new(m)))
    }

    /// Keep an inference copy for later passes of the same models (the trainer's BF16
    /// reference does not change during a run). Call it only after a pass on the uploading
    /// stream has brought its results back (a synchronizing copy), so any other stream reads the
    /// copy complete.
    pub(super) fn hold_model(&self, key: u64, m: Arc<Weights<GpuOps>>) {
        if let Ok(mut v) = self.uploaded.lock()
            && !v.iter().any(|(k, _)| *k == key)
        {
            if v.len() >= UPLOADED_MODELS {
                v.remove(0);
            }
            v.push((key, m));
        }
    }

    /// The counters since the last call, reset to zero.
    pub fn take_counters(&self) -> PassCounters {
        self.counters.take()
    }

    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.dev
    }

    /// Whether trainers keep their state on this GPU or on the host, with prepared models
    /// uploaded and gradients downloaded each minibatch (`lockstep bench step` times both; tests
    /// compare them), whatever the number of runs stepped together. A run keeps the choice made
    /// at its first step.
    pub fn set_holds_training(&self, on: bool) {
        self.set_held_from(if on { 1 } else { usize::MAX });
    }

    /// Runs stepped `runs` or more together keep their state on this GPU, fewer on the host
    /// ([`HELD_FROM_RUNS`]).
    pub fn set_held_from(&self, runs: usize) {
        self.held_from
            .store(runs.max(1), std::sync::atomic::Ordering::Relaxed);
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // A card that stopped computing cannot release its op sets: destroying a cuBLAS handle
        // on a lost context fails, and cudarc panics on that in drop. The process's exit frees
        // them instead.
        if self.dev.health().is_err()
            && let Ok(mut ops) = self.ops.0.lock()
        {
            ops.drain(..).for_each(std::mem::forget);
        }
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        format!("cuda:{}", self.dev.ordinal())
    }

    fn hardware(&self) -> Option<String> {
        Some(self.dev.hardware())
    }

    fn fp32_peak_flops(&self) -> Option<f64> {
        self.dev.fp32_peak_flops()
    }

    fn health(&self) -> Result<(), String> {
        self.dev.health().map_err(|e| e.to_string())
    }

    fn one_process_only(&self) -> bool {
        self.dev.exclusive_process()
    }

    /// Runs one batched call carries when the caller does not say ([`BATCH_RUNS`]).
    fn batch_runs(&self) -> usize {
        BATCH_RUNS
    }

    fn forward_logits_batch(
        &self,
        items: &[crate::engine::backend::ForwardItem<'_>],
    ) -> Result<Vec<Vec<f32>>, OpError> {
        self.forward_logits_runs(items)
    }

    fn train_forward_batch<'a>(
        &'a self,
        items: &[crate::engine::backend::ForwardItem<'a>],
        counts: crate::engine::backend::Counts,
    ) -> Result<Box<dyn crate::engine::backend::TrainBatch + 'a>, OpError> {
        self.train_forward_runs(items, counts)
    }

    fn holds_training(&self, runs: usize) -> bool {
        runs >= self.held_from.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn held_forward_batch<'a>(
        &'a self,
        items: &[crate::engine::backend::HeldItem<'_>],
        counts: crate::engine::backend::Counts,
    ) -> Result<Box<dyn crate::engine::backend::HeldBatch + 'a>, OpError> {
        self.held_forward_runs(items, counts)
    }

    fn held_params(&self, runs: &[u64]) -> Result<Vec<crate::engine::model::Params>, OpError> {
        self.held_params_of(runs)
    }

    fn release_held(&self, run: u64) {
        self.release_held_run(run)
    }

    fn held_export(
        &self,
        runs: &[crate::engine::backend::HeldRun<'_>],
    ) -> Result<Option<Vec<crate::engine::backend::HeldExport>>, OpError> {
        self.held_export_runs(runs).map(Some)
    }

    fn held_decoder_batch<'a>(
        &'a self,
        exports: &[&'a crate::engine::backend::HeldExport],
        seqs: usize,
        positions: usize,
    ) -> Result<Box<dyn crate::engine::backend::BatchDecoder + 'a>, OpError> {
        self.held_decoder_runs(exports, seqs, positions)
    }

    fn decoder_batch<'a>(
        &'a self,
        preps: &[&'a PreparedModel],
        seqs: usize,
        positions: usize,
    ) -> Result<Box<dyn crate::engine::backend::BatchDecoder + 'a>, OpError> {
        self.decoder_runs(preps, seqs, positions)
    }

    fn decoder<'a>(
        &'a self,
        prep: &'a PreparedModel,
        seqs: usize,
        positions: usize,
    ) -> Result<Box<dyn Decoder + 'a>, OpError> {
        Ok(Box::new(ResidentDecoder::new(self, prep, seqs, positions)?))
    }

    /// `prep` uploaded (or found uploaded), the rows run, the logits back.
    fn forward_logits(
        &self,
        prep: &PreparedModel,
        tokens: &[u32],
        layout: &Layout,
        replay: Option<&Routing>,
    ) -> Result<Vec<f32>, OpError> {
        let run = |f: &GpuOps| -> Result<_, OpError> {
            let (key, m) = self.inference_model(f, &[prep])?;
            let out = pass::infer(f, &m, tokens, layout, replay)?;
            self.hold_model(key, m);
            Ok(out)
        };
        let f = self.take_ops()?;
        let out = run(&f);
        self.give_ops(f);
        Ok(out?.0)
    }

    fn train_forward<'a>(
        &'a self,
        prep: &'a PreparedModel,
        tokens: &[u32],
        layout: &Layout,
        replay: Option<&Routing>,
    ) -> Result<Box<dyn TrainPass + 'a>, OpError> {
        Ok(Box::new(ResidentPass::new(
            self, prep, tokens, layout, replay,
        )?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_state_setting_reads_on_off_and_a_run_count() {
        assert_eq!(parse_held_state("on").unwrap(), 1);
        assert_eq!(parse_held_state(" off ").unwrap(), usize::MAX);
        assert_eq!(parse_held_state("8").unwrap(), 8);
        for bad in ["0", "-1", "yes", ""] {
            let e = parse_held_state(bad).unwrap_err().to_string();
            assert!(
                e.contains(HELD_STATE_VAR) && e.contains("use on, off, or N"),
                "{e}"
            );
        }
    }
}

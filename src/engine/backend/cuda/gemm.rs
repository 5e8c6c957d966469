//! [`CudaBackend`]: the engine's [`Backend`] on one GPU, GEMMs through cuBLAS SGEMM.
//!
//! Operands arrive quantize-dequantized (and BF16-exact where the recipe says so) from
//! `engine::linear`, so the GEMM keeps them in FP32 and accumulates in FP32: cuBLAS runs in
//! `CUBLAS_PEDANTIC_MATH`, which rules out TF32 and any reduced-precision tensor-core path, whatever
//! `NVIDIA_TF32_OVERRIDE` says.
//!
//! Each call copies its activation operand to the device, multiplies, and copies the result back:
//! the trainer's model and its element-wise ops still run on the CPU (see `docs/cuda.md` for what
//! that costs). The model's forward-only work runs on the device instead: rollouts and evaluations
//! decode there ([`Backend::decoder`]: `cuda::decoder`) and the trainer's BF16 reference forward
//! runs there ([`Backend::forward_logits`]: `cuda::resident`), unless
//! [`CudaBackend::with_device_model`] turns that off.
//! Keyed operands (prepared weights, see [`MatRef::key`]) are copied once and kept resident in a
//! FIFO cache with a byte budget, since a step multiplies by the same weights hundreds of times
//! (every rollout decode step, the policy and reference forwards, the backward).
//! Concurrent callers (the suite runner's workers) each take a *lane* — a stream, a cuBLAS handle
//! and grow-only device buffers — from a pool, so they never share a handle or a stream. cuBLAS is
//! deterministic for a given shape, handle configuration and GPU, so the same seed gives the same
//! metrics run to run.

use super::decoder::ResidentDecoder;
use super::device_ops::GpuOps;
use super::train::ResidentPass;
use super::{CudaDevice, CudaError};
use crate::engine::backend::{Backend, MatRef};
use crate::engine::device::OpError;
use crate::engine::layout::Layout;
use crate::engine::model::pass::{self, Weights};
use crate::engine::model::{PreparedModel, Routing, TrainPass};
use crate::engine::rollout::Decoder;
use cudarc::cublas::sys::{cublasMath_t, cublasOperation_t};
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{CudaSlice, CudaStream};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Default byte budget of the resident-weight cache: a step of the `small` model prepares three
/// weight sets (rollout export, policy, BF16 reference) of about 2 x 23 MB each, and a sweep's
/// workers share one backend per GPU, so 2 GiB holds several steps of eight workers.
pub const RESIDENT_BUDGET: usize = 2 << 30;

/// Device copies of keyed operands, shared by every lane, oldest dropped first. Generic over the
/// buffer so its bookkeeping is tested without a GPU.
struct Resident<B> {
    map: HashMap<u64, Arc<B>>,
    /// Keys in insertion order, with their sizes in bytes.
    order: VecDeque<(u64, usize)>,
    bytes: usize,
    budget: usize,
}

impl<B> Resident<B> {
    fn new(budget: usize) -> Self {
        Resident {
            map: HashMap::new(),
            order: VecDeque::new(),
            bytes: 0,
            budget,
        }
    }

    /// Whether a buffer of `bytes` can be kept at all.
    fn fits(&self, bytes: usize) -> bool {
        bytes <= self.budget
    }

    fn get(&self, key: u64) -> Option<Arc<B>> {
        self.map.get(&key).cloned()
    }

    /// Keep `buf` (of `bytes`) under `key`, dropping the oldest entries until it fits. A buffer a
    /// lane is still reading survives its eviction through the lane's `Arc`.
    fn insert(&mut self, key: u64, buf: Arc<B>, bytes: usize) {
        if self.map.contains_key(&key) || !self.fits(bytes) {
            return;
        }
        while self.bytes + bytes > self.budget {
            let Some((old, b)) = self.order.pop_front() else {
                break;
            };
            self.map.remove(&old);
            self.bytes -= b;
        }
        self.map.insert(key, buf);
        self.order.push_back((key, bytes));
        self.bytes += bytes;
    }
}

/// What the GEMM path has done since the backend opened (or since [`CudaBackend::take_counters`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct GemmCounters {
    pub calls: u64,
    /// Keyed operands found resident, and those copied in (then kept).
    pub resident_hits: u64,
    pub resident_uploads: u64,
    pub bytes_to_device: u64,
    pub bytes_to_host: u64,
    /// Whole prepared models copied to the device (decoder, trainer, reference forward) and the
    /// host's wall time for them, ns: packing and queuing the staged copy (the decoder's and
    /// trainer's do not wait for the copy itself; the reference's does).
    pub model_uploads: u64,
    pub model_upload_ns: u64,
    /// Wall time of the resident trainer's forwards, ns (from the queued upload on, so waiting
    /// for its copy is included).
    pub train_forward_ns: u64,
}

fn bump(field: &AtomicU64, v: u64) {
    field.fetch_add(v, Ordering::Relaxed);
}

#[derive(Default)]
struct AtomicCounters {
    calls: AtomicU64,
    resident_hits: AtomicU64,
    resident_uploads: AtomicU64,
    bytes_to_device: AtomicU64,
    bytes_to_host: AtomicU64,
    model_uploads: AtomicU64,
    model_upload_ns: AtomicU64,
    train_forward_ns: AtomicU64,
}

impl AtomicCounters {
    fn take(&self) -> GemmCounters {
        let t = |f: &AtomicU64| f.swap(0, Ordering::Relaxed);
        GemmCounters {
            calls: t(&self.calls),
            resident_hits: t(&self.resident_hits),
            resident_uploads: t(&self.resident_uploads),
            bytes_to_device: t(&self.bytes_to_device),
            bytes_to_host: t(&self.bytes_to_host),
            model_uploads: t(&self.model_uploads),
            model_upload_ns: t(&self.model_upload_ns),
            train_forward_ns: t(&self.train_forward_ns),
        }
    }
}

/// A stream, its cuBLAS handle and operand buffers, used by one GEMM at a time.
struct Lane {
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    a: CudaSlice<f32>,
    b: CudaSlice<f32>,
    c: CudaSlice<f32>,
}

/// A cuBLAS handle on `stream` in `CUBLAS_PEDANTIC_MATH`: FP32 operands and accumulation, no
/// TF32 or other reduced-precision path, whatever `NVIDIA_TF32_OVERRIDE` says. Every cuBLAS
/// handle of the engine is made here.
pub(crate) fn pedantic_blas(stream: &Arc<CudaStream>) -> Result<CudaBlas, CudaError> {
    let blas = CudaBlas::new(stream.clone())?;
    // SAFETY: the handle is valid (just created) and owned by the caller from here on; setting
    // its math mode is a plain configuration call with no memory access.
    let st = unsafe {
        cudarc::cublas::sys::cublasSetMathMode(*blas.handle(), cublasMath_t::CUBLAS_PEDANTIC_MATH)
    };
    st.result()?;
    Ok(blas)
}

impl Lane {
    fn new(dev: &CudaDevice) -> Result<Self, CudaError> {
        let stream = dev.context().new_stream()?;
        let blas = pedantic_blas(&stream)?;
        Ok(Lane {
            a: stream.alloc_zeros(1)?,
            b: stream.alloc_zeros(1)?,
            c: stream.alloc_zeros(1)?,
            stream,
            blas,
        })
    }
}

/// Make `buf` hold at least `n` values (contents are not kept).
fn ensure(stream: &Arc<CudaStream>, buf: &mut CudaSlice<f32>, n: usize) -> Result<(), CudaError> {
    if buf.len() < n {
        *buf = stream.alloc_zeros(n.next_power_of_two())?;
    }
    Ok(())
}

/// Costly device objects (a lane, a resident forward with its compiled kernels), each used by one
/// caller at a time and handed back for the next: as many get built as callers ever overlap.
struct Pool<T>(Mutex<Vec<T>>);

impl<T> Pool<T> {
    fn new(items: Vec<T>) -> Self {
        Pool(Mutex::new(items))
    }

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
    lanes: Pool<Lane>,
    resident: Mutex<Resident<CudaSlice<f32>>>,
    counters: AtomicCounters,
    /// Run the forward-only passes on the device ([`ResidentDecoder`], `forward_logits`)
    /// rather than on the host.
    device_model: bool,
    /// Run the trainer's policy forward and backward on the device ([`ResidentPass`]).
    device_train: bool,
    /// Op sets (kernels, stream, cuBLAS handle) of finished passes, one per concurrent caller
    /// at most, so compiling them is paid once per worker.
    ops: Pool<GpuOps>,
    /// The models `forward_logits` uploaded, by [`PreparedModel::key`], newest last: the
    /// trainer's BF16 reference does not change during a run, so it is uploaded once per run
    /// instead of once per step (one per concurrent run, up to [`UPLOADED_MODELS`]).
    uploaded: Mutex<Vec<(u64, Arc<Weights<GpuOps>>)>>,
}

/// Models kept by `forward_logits` (each a few tens of MB at the shipped sizes).
const UPLOADED_MODELS: usize = 8;

impl CudaBackend {
    /// Open `cuda:ordinal` and check that cuBLAS starts there; weights stay resident within
    /// [`RESIDENT_BUDGET`].
    pub fn new(ordinal: usize) -> Result<Self, CudaError> {
        Self::with_resident_budget(ordinal, RESIDENT_BUDGET)
    }

    /// As [`CudaBackend::new`] with another byte budget for resident weights (0: copy every
    /// operand on every call, the A/B baseline of `lockstep bench step`).
    pub fn with_resident_budget(ordinal: usize, budget: usize) -> Result<Self, CudaError> {
        Self::with_event_tracking(ordinal, budget, false)
    }

    /// As [`CudaBackend::with_resident_budget`], choosing whether cudarc tracks every buffer's
    /// uses across streams with events (its default; `false` here: `lockstep bench step` times
    /// both).
    ///
    /// Tracking costs two events per allocation and an event record or wait per buffer argument
    /// of every launch and copy, which a decode step's few hundred small launches feel. It is
    /// not needed here: every buffer of this backend is made and used on one stream (a resident
    /// forward's, trainer's or lane's), except the resident GEMM operands and `forward_logits`'
    /// uploaded models, which are shared only after a host wait on the uploading stream, are
    /// read-only after that, and are freed only when their last user (which ends its call with
    /// a synchronizing copy back) drops them.
    pub fn with_event_tracking(
        ordinal: usize,
        budget: usize,
        tracking: bool,
    ) -> Result<Self, CudaError> {
        let dev = CudaDevice::open(ordinal)?;
        if !tracking {
            // SAFETY: set before this context makes any buffer; the cross-stream uses above
            // are synchronized by host waits.
            unsafe { dev.context().disable_event_tracking() };
        }
        let first = Lane::new(&dev)?;
        Ok(CudaBackend {
            dev,
            lanes: Pool::new(vec![first]),
            resident: Mutex::new(Resident::new(budget)),
            counters: AtomicCounters::default(),
            device_model: true,
            device_train: true,
            ops: Pool::new(Vec::new()),
            uploaded: Mutex::new(Vec::new()),
        })
    }

    /// Run the model's forward-only passes (rollout and evaluation decoding, the trainer's BF16
    /// reference forward) on the device (`true`, the default), or on the host with GEMMs here
    /// (the A/B baseline of `lockstep bench step`).
    pub fn with_device_model(mut self, on: bool) -> Self {
        self.device_model = on;
        self
    }

    /// Run the trainer's policy forward and backward on the device (`true`, the default, when
    /// the device model is on too), or on the host with GEMMs here (an A/B baseline of
    /// `lockstep bench step`).
    pub fn with_device_trainer(mut self, on: bool) -> Self {
        self.device_train = on;
        self
    }

    /// An op set from the pool, or a new one.
    pub(super) fn take_ops(&self) -> Result<GpuOps, CudaError> {
        self.ops.take(|| GpuOps::new(&self.dev))
    }

    pub(super) fn give_ops(&self, o: GpuOps) {
        self.ops.give(o);
    }

    /// Count a whole-model upload that started at `since` and is queued (the host's part: packing
    /// the page-locked buffer and queuing the copies; `forward_logits` also waits for the copy).
    pub(super) fn note_model_upload(&self, since: std::time::Instant) {
        bump(&self.counters.model_uploads, 1);
        bump(
            &self.counters.model_upload_ns,
            since.elapsed().as_nanos() as u64,
        );
    }

    /// Count a resident trainer forward that started at `since` and has finished.
    pub(super) fn note_train_forward(&self, since: std::time::Instant) {
        bump(
            &self.counters.train_forward_ns,
            since.elapsed().as_nanos() as u64,
        );
    }

    /// The counters since the last call, reset to zero.
    pub fn take_counters(&self) -> GemmCounters {
        self.counters.take()
    }

    /// A keyed operand's resident device copy, copied in through `lane` on first use. `None` when
    /// the operand has no key or is larger than the cache's budget.
    fn resident_operand(
        &self,
        lane: &Lane,
        m: MatRef<'_>,
    ) -> Result<Option<Arc<CudaSlice<f32>>>, CudaError> {
        let Some(key) = m.key else {
            return Ok(None);
        };
        let Ok(mut cache) = self.resident.lock() else {
            return Ok(None);
        };
        if !cache.fits(m.data.len() * 4) {
            return Ok(None);
        }
        if let Some(buf) = cache.get(key) {
            bump(&self.counters.resident_hits, 1);
            return Ok(Some(buf));
        }
        let buf = Arc::new(lane.stream.clone_htod(m.data)?);
        // Complete before another lane's stream can read it.
        lane.stream.synchronize()?;
        bump(&self.counters.resident_uploads, 1);
        bump(&self.counters.bytes_to_device, (m.data.len() * 4) as u64);
        cache.insert(key, buf.clone(), m.data.len() * 4);
        Ok(Some(buf))
    }

    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.dev
    }

    /// `c = a · b` (or `c += a · b`) on the GPU, FP32 operands and accumulation.
    pub fn try_gemm(
        &self,
        a: MatRef<'_>,
        b: MatRef<'_>,
        c: &mut [f32],
        accumulate: bool,
    ) -> Result<(), CudaError> {
        let (m, k, n) = crate::engine::backend::gemm_dims(a, b, c.len());
        if m == 0 || n == 0 {
            return Ok(());
        }
        if k == 0 {
            if !accumulate {
                c.fill(0.0);
            }
            return Ok(());
        }
        let mut lane = self.lanes.take(|| Lane::new(&self.dev))?;
        let r = self.gemm_in_lane(&mut lane, a, b, c, accumulate, (m, k, n));
        if r.is_ok() {
            self.lanes.give(lane); // a lane whose call failed is dropped, not reused
        }
        r
    }

    /// One GEMM in `lane`: keyed operands from their resident copies, the rest staged, counted.
    fn gemm_in_lane(
        &self,
        lane: &mut Lane,
        a: MatRef<'_>,
        b: MatRef<'_>,
        c: &mut [f32],
        accumulate: bool,
        (m, k, n): (usize, usize, usize),
    ) -> Result<(), CudaError> {
        let ra = self.resident_operand(lane, a)?;
        let rb = self.resident_operand(lane, b)?;
        let staged = |r: &Option<_>, x: MatRef<'_>| if r.is_some() { 0 } else { x.data.len() };
        let c_in = if accumulate { m * n } else { 0 };
        let to_device = staged(&ra, a) + staged(&rb, b) + c_in;
        gemm_on(lane, (a, ra), (b, rb), c, accumulate, (m, k, n))?;
        bump(&self.counters.calls, 1);
        bump(&self.counters.bytes_to_device, (to_device * 4) as u64);
        bump(&self.counters.bytes_to_host, (m * n * 4) as u64);
        Ok(())
    }
}

/// An operand given with its resident device copy, if it has one (otherwise it is copied into the
/// lane's buffer).
type Operand<'a> = (MatRef<'a>, Option<Arc<CudaSlice<f32>>>);

/// Row-major `C[m,n] = A[m,k] · B[k,n]` is column-major `Cᵀ = Bᵀ · Aᵀ`: a row-major buffer read
/// column-major is its transpose, so cuBLAS gets B first, A second, and no copy is transposed.
fn gemm_on(
    lane: &mut Lane,
    (a, ra): Operand<'_>,
    (b, rb): Operand<'_>,
    c: &mut [f32],
    accumulate: bool,
    (m, k, n): (usize, usize, usize),
) -> Result<(), CudaError> {
    let Lane {
        stream,
        blas,
        a: da,
        b: db,
        c: dc,
    } = lane;
    ensure(stream, dc, m * n)?;
    let stage = |x: MatRef<'_>, buf: &mut CudaSlice<f32>| -> Result<(), CudaError> {
        ensure(stream, buf, x.data.len())?;
        stream.memcpy_htod(x.data, &mut buf.slice_mut(..x.data.len()))?;
        Ok(())
    };
    if ra.is_none() {
        stage(a, da)?;
    }
    if rb.is_none() {
        stage(b, db)?;
    }
    let da: &CudaSlice<f32> = ra.as_deref().unwrap_or(da);
    let db: &CudaSlice<f32> = rb.as_deref().unwrap_or(db);
    if accumulate {
        stream.memcpy_htod(&*c, &mut dc.slice_mut(..m * n))?;
    }
    let op = |t: bool| {
        if t {
            cublasOperation_t::CUBLAS_OP_T
        } else {
            cublasOperation_t::CUBLAS_OP_N
        }
    };
    let dim = |v: usize| -> Result<i32, CudaError> {
        i32::try_from(v).map_err(|_| {
            CudaError::Shape(format!("gemm dimension {v} exceeds cuBLAS's 32-bit limit"))
        })
    };
    let cfg = GemmConfig {
        transa: op(b.trans),
        transb: op(a.trans),
        m: dim(n)?,
        n: dim(m)?,
        k: dim(k)?,
        alpha: 1.0f32,
        lda: dim(b.cols)?,
        ldb: dim(a.cols)?,
        beta: if accumulate { 1.0 } else { 0.0 },
        ldc: dim(n)?,
    };
    // SAFETY: the buffers hold at least b.rows*b.cols, a.rows*a.cols and m*n floats (ensured
    // above), and the leading dimensions are the stored row lengths, so cuBLAS reads and writes
    // inside them.
    unsafe { blas.gemm(cfg, db, da, &mut *dc) }?;
    stream.memcpy_dtoh(&dc.slice(..m * n), c)?;
    stream.synchronize()?;
    Ok(())
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        format!("cuda:{}", self.dev.ordinal())
    }

    /// GPU failures cannot be returned through the trait: they panic with the device and shape,
    /// which `suite::builtin::run_one` turns into a `failed` run with that message.
    fn gemm(&self, a: MatRef<'_>, b: MatRef<'_>, c: &mut [f32], accumulate: bool) {
        if let Err(e) = self.try_gemm(a, b, c, accumulate) {
            let (m, k) = a.shape();
            let n = b.shape().1;
            panic!("{}: gemm {m}x{k}x{n} failed: {e}", self.name());
        }
    }

    /// The device-resident decoder (unless turned off); a GPU failure setting it up panics as
    /// `gemm` does.
    fn decoder<'a>(
        &'a self,
        prep: &'a PreparedModel,
        seqs: usize,
        positions: usize,
    ) -> Option<Box<dyn Decoder + 'a>> {
        if !self.device_model {
            return None;
        }
        match ResidentDecoder::new(self, prep, seqs, positions) {
            Ok(d) => Some(Box::new(d)),
            Err(e) => panic!("{}: resident decoder failed: {e}", self.name()),
        }
    }

    /// The resident forward (unless turned off): `prep` uploaded, the rows run, the logits back.
    fn forward_logits(
        &self,
        prep: &PreparedModel,
        tokens: &[u32],
        layout: &Layout,
        replay: Option<&Routing>,
    ) -> Option<Vec<f32>> {
        if !self.device_model {
            return None;
        }
        // An uploaded copy is only published after a forward on the uploading stream has
        // returned its logits (a synchronizing copy), so any other stream reads it complete.
        let run = |f: &GpuOps| -> Result<_, OpError> {
            let key = prep.key();
            let held = self.uploaded.lock().ok().and_then(|v| {
                v.iter()
                    .find(|(k, _)| *k == key)
                    .map(|(_, m)| Arc::clone(m))
            });
            let m = match held {
                Some(m) => m,
                None => {
                    let t0 = std::time::Instant::now();
                    let m = f.upload_model(prep)?;
                    f.stream().synchronize().map_err(CudaError::from)?;
                    self.note_model_upload(t0);
                    Arc::new(m)
                }
            };
            let out = pass::infer(f, &m, tokens, layout, replay)?;
            if let Ok(mut v) = self.uploaded.lock()
                && !v.iter().any(|(k, _)| *k == key)
            {
                if v.len() >= UPLOADED_MODELS {
                    v.remove(0);
                }
                v.push((key, m));
            }
            Ok(out)
        };
        let out = self.take_ops().map_err(OpError::from).and_then(|f| {
            let out = run(&f);
            self.give_ops(f);
            out
        });
        match out {
            Ok((logits, _)) => Some(logits),
            Err(e) => panic!("{}: resident forward failed: {e}", self.name()),
        }
    }

    /// The resident trainer's forward (unless the device model or trainer is turned off); its
    /// backward runs on the device too.
    fn train_forward<'a>(
        &'a self,
        prep: &'a PreparedModel,
        tokens: &[u32],
        layout: &Layout,
        replay: Option<&Routing>,
    ) -> Option<Box<dyn TrainPass + 'a>> {
        if !(self.device_model && self.device_train) {
            return None;
        }
        match ResidentPass::new(self, prep, tokens, layout, replay) {
            Ok(p) => Some(Box::new(p)),
            Err(e) => panic!("{}: resident trainer failed: {e}", self.name()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// FIFO within the byte budget: the oldest keys go first, bytes are accounted exactly, a key
    /// already held is not stored twice, and a buffer larger than the budget is never kept.
    #[test]
    fn resident_cache_drops_the_oldest_within_its_budget() {
        let mut r: Resident<Vec<f32>> = Resident::new(100);
        let buf = |n: usize| Arc::new(vec![0.0f32; n]);
        r.insert(1, buf(10), 40);
        r.insert(2, buf(10), 40);
        r.insert(1, buf(10), 40); // already held
        assert_eq!((r.bytes, r.map.len()), (80, 2));
        r.insert(3, buf(10), 40); // evicts 1
        assert!(r.get(1).is_none() && r.get(2).is_some() && r.get(3).is_some());
        assert_eq!(r.bytes, 80);
        let held = r.get(2).unwrap();
        r.insert(4, buf(25), 100); // evicts 2 and 3
        assert_eq!((r.bytes, r.map.len()), (100, 1));
        assert_eq!(held.len(), 10, "a reader keeps an evicted buffer alive");
        assert!(!r.fits(101));
        r.insert(5, buf(26), 104);
        assert!(
            r.get(5).is_none() && r.get(4).is_some(),
            "too big: not kept, nothing evicted"
        );
    }
}

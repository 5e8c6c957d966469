//! The CUDA backend, through cudarc with `dynamic-loading`: libcuda, libnvrtc and libcublas are
//! opened at first use, so the crate builds and runs on machines without CUDA, and `--device cuda`
//! there is a one-line error ([`CudaError::Missing`]), never a panic (cudarc's `CudaContext::new`
//! panics when libcuda is absent, so [`probe`] checks the libraries first).
//!
//! - [`quant`]: the quantizers as NVRTC kernels (`quant.cu`), compiled with the spec's exact FP32
//!   arithmetic and tested byte for byte against `crate::formats` (the one quantizer);
//! - [`backend`]: [`CudaBackend`], the engine's [`Backend`](super::Backend) on a GPU: the model's
//!   passes over [`device_ops::GpuOps`] (kernels of `ops.cu`, `backward.cu`, [`moe`], the linear
//!   layer of [`linear`]); [`decoder`]: the rollout's decoder, [`train`]: the training pass;
//! - device timings (quantizer bandwidth vs a device-to-device copy) are `lockstep bench quantize
//!   --device cuda`'s, outside the engine;
//! - [`optim`]: AdamW and the gradient norms on the device, bit for bit the CPU's, for training
//!   state kept on the GPU.
//!
//! Every `unsafe` block of the crate that touches the GPU lives under this folder.

pub mod backend;
pub mod batch;
pub mod decode_graph;
pub mod decoder;
pub mod device_ops;
pub mod fake_quant;
mod held;
pub mod launch;
pub mod linear;
pub mod moe;
pub mod optim;
pub mod quant;
pub mod staging;
pub mod train;

pub use backend::CudaBackend;
pub use quant::{CudaQuantizer, DeviceQuantized};

use cudarc::driver::{CudaContext, CudaModule, DriverError};
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};

/// What `lockstep run` and `run-one` print (to stderr) when they compute on a GPU, so nobody takes
/// `--device cuda` for more of a speed-up than it is (measured in docs/cuda.md).
pub const GPU_NOTE: &str = "note: on a GPU each run's training state (master weights, AdamW \
    moments, gradients) stays on the device, where its weights are prepared, exported, decoded, \
    trained and updated; the loss and the metrics stay on this host's CPU. By default two \
    workers a GPU step batches of 16 to 32 runs each (by the suite's size and the free memory), \
    of any precision plans (one launch per op for a batch): on H100s the nightly suite's 30 runs \
    ran at 150-206 run-steps/s (the host sets the pace), 2.8-3.1x the former pool of one-run \
    workers, and 6 configurations x 32 seeds x 100 steps in 49-57 s (--batch-runs, --jobs, \
    --processes to change; docs/cuda.md)";

/// Why the GPU could not be used. Messages are one line and name the fix.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error(
        "no CUDA {lib} library could be loaded ({file}); run on a machine with an NVIDIA GPU, \
         driver and CUDA 13 libraries, or use --device cpu"
    )]
    Missing {
        lib: &'static str,
        file: &'static str,
    },
    #[error("cuda:{ordinal} does not exist ({count} CUDA device(s) visible); {hint}")]
    NoDevice {
        ordinal: usize,
        count: usize,
        hint: String,
    },
    #[error("the CUDA driver did not start ({0}); check the NVIDIA driver or use --device cpu")]
    Init(DriverError),
    #[error("CUDA driver: {0}")]
    Driver(#[from] DriverError),
    #[error("NVRTC could not compile the {module} kernels: {detail}")]
    Compile {
        module: &'static str,
        detail: String,
    },
    #[error("cuBLAS: {0}")]
    Blas(#[from] cudarc::cublas::result::CublasError),
    #[error(transparent)]
    Format(#[from] crate::formats::FormatError),
    #[error("{0}")]
    Shape(String),
    /// A setting (an environment variable) that cannot be read; the message says the fix.
    #[error("{0}")]
    Setting(String),
}

/// Check, without panicking, that the driver, NVRTC and cuBLAS libraries can be loaded.
pub fn probe() -> Result<(), CudaError> {
    // SAFETY: each `is_culib_present` only tries to dlopen the library by name and closes it; no
    // CUDA function is called.
    let present = unsafe {
        [
            (
                "driver",
                "libcuda.so",
                cudarc::driver::sys::is_culib_present(),
            ),
            (
                "NVRTC",
                "libnvrtc.so",
                cudarc::nvrtc::sys::is_culib_present(),
            ),
            (
                "cuBLAS",
                "libcublas.so",
                cudarc::cublas::sys::is_culib_present(),
            ),
        ]
    };
    match present.iter().find(|(_, _, ok)| !ok) {
        Some((lib, file, _)) => Err(CudaError::Missing { lib, file }),
        None => Ok(()),
    }
}

/// Number of visible CUDA devices (0 when the driver loads but sees none).
pub fn device_count() -> Result<usize, CudaError> {
    probe()?;
    match CudaContext::device_count() {
        Ok(n) => Ok(n.max(0) as usize),
        // cuInit fails with CUDA_ERROR_NO_DEVICE on a machine with a driver but no GPU.
        Err(e) if format!("{e:?}").contains("NO_DEVICE") => Ok(0),
        Err(e) => Err(CudaError::Init(e)),
    }
}

/// An out-of-bounds store on `ordinal`'s primary context, which every backend on that card
/// shares: from then on each call on that context fails, as after a hardware fault. For fault
/// tests of the sweep (`--features fault-injection`).
#[cfg(feature = "fault-injection")]
pub fn plant_fault(ordinal: usize) -> Result<(), CudaError> {
    use cudarc::driver::{LaunchConfig, PushKernelArg};
    let ctx = CudaContext::new(ordinal)?;
    let src =
        r#"extern "C" __global__ void oob(float* p) { p[(1ull << 40) + threadIdx.x] = 1.0f; }"#;
    let ptx = cudarc::nvrtc::compile_ptx(src).map_err(|e| CudaError::Compile {
        module: "oob",
        detail: format!("{e:?}"),
    })?;
    let f = ctx.load_module(ptx)?.load_function("oob")?;
    let stream = ctx.new_stream()?;
    let buf = stream.alloc_zeros::<f32>(32)?;
    let mut launch = stream.launch_builder(&f);
    launch.arg(&buf);
    // SAFETY: deliberately unsafe: the kernel writes far outside `buf` to fault the context.
    let _ = unsafe { launch.launch(LaunchConfig::for_num_elems(32)) };
    let _ = stream.synchronize();
    Ok(())
}

/// One opened GPU: its context, name and compute capability, and the kernel modules compiled
/// for it so far.
#[derive(Debug)]
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    ordinal: usize,
    name: String,
    cc: (i32, i32),
    /// Each module compiled once per device, by name and a hash of its source: every op set (one
    /// per concurrent worker) loads its functions from the same module instead of running NVRTC
    /// again. A module's functions may be launched on several streams at once.
    modules: Mutex<HashMap<&'static str, (u64, Arc<CudaModule>)>>,
}

impl CudaDevice {
    /// Open `cuda:ordinal`, checking libraries and the device count first.
    pub fn open(ordinal: usize) -> Result<Arc<Self>, CudaError> {
        let count = device_count()?;
        if ordinal >= count {
            let hint = if count == 0 {
                "run on a machine with an NVIDIA GPU or use --device cpu".to_string()
            } else {
                format!("use --device cuda:0 .. cuda:{}", count - 1)
            };
            return Err(CudaError::NoDevice {
                ordinal,
                count,
                hint,
            });
        }
        let ctx = CudaContext::new(ordinal)?;
        keep_freed_memory(&ctx)?;
        let name = ctx.name()?;
        let cc = ctx.compute_capability()?;
        Ok(Arc::new(CudaDevice {
            ctx,
            ordinal,
            name,
            cc,
            modules: Mutex::new(HashMap::new()),
        }))
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The card's name as the driver reports it (what `nvidia-smi` prints).
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn compute_capability(&self) -> (i32, i32) {
        self.cc
    }

    /// The card's UUID as `nvidia-smi -L` prints it (`GPU-xxxxxxxx-…`): the one name of a GPU
    /// that does not change with `CUDA_VISIBLE_DEVICES`.
    pub fn uuid(&self) -> Result<String, CudaError> {
        let raw = self.ctx.uuid()?;
        let b: Vec<u8> = raw.bytes.iter().map(|&c| c as u8).collect();
        let hex =
            |r: std::ops::Range<usize>| b[r].iter().map(|x| format!("{x:02x}")).collect::<String>();
        Ok(format!(
            "GPU-{}-{}-{}-{}-{}",
            hex(0..4),
            hex(4..6),
            hex(6..8),
            hex(8..10),
            hex(10..16)
        ))
    }

    /// The card's PCI address (`0000:18:00.0`), as `nvidia-smi` and the kernel log name it.
    pub fn pci_bus_id(&self) -> Result<String, CudaError> {
        use cudarc::driver::sys::CUdevice_attribute as A;
        let at = |a| self.ctx.attribute(a);
        Ok(format!(
            "{:04x}:{:02x}:{:02x}.0",
            at(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
            at(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
            at(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?
        ))
    }

    /// Whether the card is in exclusive-process compute mode (`nvidia-smi -c EXCLUSIVE_PROCESS`):
    /// a second process cannot open it while this one holds it. Unknown counts as no.
    pub fn exclusive_process(&self) -> bool {
        use cudarc::driver::sys::{CUcomputemode, CUdevice_attribute as A};
        self.ctx
            .attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_MODE)
            .is_ok_and(|m| m == CUcomputemode::CU_COMPUTEMODE_EXCLUSIVE_PROCESS as i32)
    }

    /// The card's FP32 peak in FLOP/s: SMs x boost clock x FP32 lanes per SM x 2 (a fused
    /// multiply-add). `None` for an architecture whose lane count is not listed here.
    pub fn fp32_peak_flops(&self) -> Option<f64> {
        use cudarc::driver::sys::CUdevice_attribute as A;
        // FP32 lanes per SM: Volta, Turing and the A100 have 64; consumer Ampere, Ada, Hopper
        // and Blackwell 128.
        let lanes = match self.cc {
            (7, _) | (8, 0) => 64.0,
            (8, _) | (9, _) | (10, _) | (12, _) => 128.0,
            _ => return None,
        };
        let sms = self
            .ctx
            .attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .ok()?;
        let khz = self.ctx.attribute(A::CU_DEVICE_ATTRIBUTE_CLOCK_RATE).ok()?;
        Some(f64::from(sms) * f64::from(khz) * 1e3 * lanes * 2.0)
    }

    /// Bytes of device memory free now (other processes' use taken out); `None` if the driver
    /// does not say.
    pub fn free_memory(&self) -> Option<u64> {
        self.ctx.mem_get_info().ok().map(|(free, _)| free as u64)
    }

    /// `NVIDIA H200, GPU-…, PCI 0000:18:00.0`: what a manifest records to name the card.
    pub fn hardware(&self) -> String {
        let or_unknown = |r: Result<String, CudaError>| r.unwrap_or_else(|_| "unknown".into());
        format!(
            "{}, {}, PCI {}",
            self.name,
            or_unknown(self.uuid()),
            or_unknown(self.pci_bus_id())
        )
    }

    /// Whether the card still computes: waits for all its work and reads one byte back. A fault
    /// that leaves the context unusable (an illegal address, a lost card) is sticky: every later
    /// call fails the same way, so this answers it.
    pub fn health(&self) -> Result<(), CudaError> {
        self.ctx.bind_to_thread()?;
        self.ctx.synchronize()?;
        let stream = self.ctx.default_stream();
        let probe = stream.alloc_zeros::<u8>(1)?;
        stream.clone_dtoh(&probe)?;
        Ok(())
    }

    /// NVRTC virtual architecture for this device (`compute_90` on an H100/H200): PTX the driver
    /// finishes for the exact chip at load time.
    fn nvrtc_arch(&self) -> &'static str {
        let arch = format!("compute_{}{}", self.cc.0, self.cc.1);
        // cudarc wants a 'static str; one small leak per opened device and module.
        Box::leak(arch.into_boxed_str())
    }

    /// Compile `src` with the exact-arithmetic options: no FMA contraction, no flush to zero, IEEE
    /// division and square root (the spec's FP32 arithmetic; fast-math would change codes). A
    /// module already compiled on this device from the same source is returned as it is.
    pub(crate) fn compile(
        &self,
        module: &'static str,
        src: &str,
    ) -> Result<Arc<CudaModule>, CudaError> {
        let hash = {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            src.hash(&mut h);
            h.finish()
        };
        // Held while compiling: op sets made at once wait for the first compile, not repeat it.
        let mut modules = self.modules.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((h, m)) = modules.get(module)
            && *h == hash
        {
            return Ok(m.clone());
        }
        let m = self.compile_uncached(module, src)?;
        modules.insert(module, (hash, m.clone()));
        Ok(m)
    }

    fn compile_uncached(
        &self,
        module: &'static str,
        src: &str,
    ) -> Result<Arc<CudaModule>, CudaError> {
        let opts = cudarc::nvrtc::CompileOptions {
            ftz: Some(false),
            prec_sqrt: Some(true),
            prec_div: Some(true),
            fmad: Some(false),
            use_fast_math: Some(false),
            arch: Some(self.nvrtc_arch()),
            name: Some(format!("{module}.cu")),
            ..Default::default()
        };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(src, opts).map_err(|e| {
            let detail = match &e {
                cudarc::nvrtc::CompileError::CompileError { log, .. } => log
                    .to_string_lossy()
                    .lines()
                    .take(6)
                    .collect::<Vec<_>>()
                    .join(" / "),
                other => format!("{other:?}"),
            };
            CudaError::Compile { module, detail }
        })?;
        Ok(self.ctx.load_module(ptx)?)
    }

    /// [`CudaDevice::compile`] with `prelude.cuh` (the engine-op kernels' shared typedefs,
    /// index helpers and `dot8`) put in front of `src`.
    pub(crate) fn compile_with_prelude(
        &self,
        module: &'static str,
        src: &str,
    ) -> Result<Arc<CudaModule>, CudaError> {
        self.compile(module, &format!("{}\n{src}", include_str!("prelude.cuh")))
    }
}

/// Let the device's memory pool keep what stream-ordered frees return instead of handing it back
/// to the driver at every synchronization (the pool's default release threshold is 0). Every
/// pass allocates and frees its buffers, so with the default each step unmapped and remapped
/// them, work the driver does under a lock that the workers sharing the GPU then wait on.
fn keep_freed_memory(ctx: &CudaContext) -> Result<(), CudaError> {
    if !ctx.has_async_alloc() {
        return Ok(());
    }
    use cudarc::driver::{result, sys};
    let mut keep_all = u64::MAX;
    // SAFETY: `cu_device` is the device of a live context; the release threshold attribute is a
    // u64, and `keep_all` is one, alive for the call.
    unsafe {
        let pool = result::device::get_mem_pool(ctx.cu_device())?;
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&raw mut keep_all).cast(),
        )?;
    }
    Ok(())
}

/// Parse `cuda` or `cuda:N` (the part after `--device`); `None` for anything else.
pub fn parse_ordinal(s: &str) -> Option<usize> {
    match s {
        "cuda" => Some(0),
        _ => s.strip_prefix("cuda:").and_then(|n| n.parse().ok()),
    }
}

/// A message for tests that need a GPU and skip without one; `None` when a GPU is usable.
pub fn skip_reason() -> Option<String> {
    match device_count() {
        Ok(0) => Some("no CUDA device visible".into()),
        Ok(_) => None,
        Err(e) => Some(e.to_string()),
    }
}

/// A device buffer of `n` floats (at least one: cudarc does not allocate zero bytes) for an op to
/// write in full. Not zeroed, which saves a memset launch per buffer (a decode step makes a few
/// hundred): callers pass it to a kernel, copy or beta-0 GEMM that writes every element before
/// anything reads it.
pub(crate) fn output_buffer(
    stream: &Arc<cudarc::driver::CudaStream>,
    n: usize,
) -> Result<cudarc::driver::CudaSlice<f32>, CudaError> {
    // SAFETY: device memory, written in full by the caller's op before any read (see above).
    Ok(unsafe { stream.alloc(n.max(1))? })
}

//! The small backend interface the model runs on. The CPU backend is the reference; a CUDA backend
//! implements the same trait, so model and trainer code never name a device.
//!
//! Only dense GEMM lives here for now: it is where all the FLOPs are. Element-wise ops are plain
//! functions in `engine::ops`, written once for the CPU reference.
//!
//! [`Device`] is what `--device` parses to (`cpu`, `cuda`, `cuda:N`) and [`open`] turns it into a
//! backend; without a usable GPU, `cuda` is a one-line error, never a panic.

pub mod cpu;
pub mod cuda;

pub use cpu::CpuBackend;

/// Where the engine's GEMMs run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    #[default]
    Cpu,
    /// A CUDA device by ordinal (`cuda` is `cuda:0`).
    Cuda(usize),
}

/// A `--device` value that does not parse, or a device that cannot be opened.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("unknown device `{0}`; use cpu, cuda or cuda:N")]
    Unknown(String),
    #[error("--device {device}: {err}")]
    Cuda {
        device: Device,
        err: cuda::CudaError,
    },
}

impl std::str::FromStr for Device {
    type Err = DeviceError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cpu" => Ok(Device::Cpu),
            _ => cuda::parse_ordinal(s)
                .map(Device::Cuda)
                .ok_or_else(|| DeviceError::Unknown(s.to_string())),
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// The devices a sweep's workers compute on, from `lockstep run --device`: `cpu`; `cuda`, every
/// visible GPU (`CUDA_VISIBLE_DEVICES` narrows it); or one or more ordinals, `cuda:1` or
/// `cuda:0,cuda:2`. Without a usable GPU, `cuda` is the same one-line error as [`open`]'s.
pub fn sweep_devices(spec: &str) -> Result<Vec<Device>, DeviceError> {
    if spec.trim() == "cuda" {
        let err = |err| DeviceError::Cuda {
            device: Device::Cuda(0),
            err,
        };
        // With none visible, `cuda:0` is returned so that opening it gives the usual error.
        let n = cuda::device_count().map_err(err)?;
        return Ok((0..n.max(1)).map(Device::Cuda).collect());
    }
    let mut out: Vec<Device> = Vec::new();
    for part in spec.split(',') {
        let d: Device = part.trim().parse()?;
        if !out.contains(&d) {
            out.push(d);
        }
    }
    Ok(out)
}

/// The backend for `device` (the CUDA one checks libraries and device count first).
pub fn open(device: Device) -> Result<Box<dyn Backend>, DeviceError> {
    match device {
        Device::Cpu => Ok(Box::new(CpuBackend)),
        Device::Cuda(i) => cuda::CudaBackend::new(i)
            .map(|b| Box::new(b) as Box<dyn Backend>)
            .map_err(|err| DeviceError::Cuda { device, err }),
    }
}

/// Row-major matrix operand: `data` holds `rows x cols` values; `trans` says to use its transpose.
#[derive(Clone, Copy)]
pub struct MatRef<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    pub trans: bool,
    /// A content key: every operand passed with the same key holds the same values (a prepared
    /// weight, immutable for its lifetime), so a backend may keep a device copy under it instead of
    /// copying the operand on every call. `None` for activations.
    pub key: Option<u64>,
}

impl<'a> MatRef<'a> {
    pub fn new(data: &'a [f32], rows: usize, cols: usize) -> Self {
        debug_assert_eq!(data.len(), rows * cols);
        MatRef {
            data,
            rows,
            cols,
            trans: false,
            key: None,
        }
    }
    /// The same operand, tagged with a content key (see [`MatRef::key`]).
    pub fn keyed(self, key: u64) -> Self {
        MatRef {
            key: Some(key),
            ..self
        }
    }
    /// The same storage read as its transpose.
    pub fn t(self) -> Self {
        MatRef {
            trans: !self.trans,
            ..self
        }
    }
    /// Logical (rows, cols) after the optional transpose.
    pub fn shape(&self) -> (usize, usize) {
        if self.trans {
            (self.cols, self.rows)
        } else {
            (self.rows, self.cols)
        }
    }
}

/// `(m, k, n)` of `c[m×n] = a[m×k] · b[k×n]`, checking that the operands fit; every backend's
/// `gemm` starts here so they refuse the same mismatches with the same message.
pub fn gemm_dims(a: MatRef<'_>, b: MatRef<'_>, c_len: usize) -> (usize, usize, usize) {
    let (m, k) = a.shape();
    let (kb, n) = b.shape();
    assert_eq!(
        k, kb,
        "gemm inner dimensions differ: a is {m}x{k}, b is {kb}x{n}"
    );
    assert_eq!(
        c_len,
        m * n,
        "gemm output has {c_len} values, expected {m}x{n}"
    );
    (m, k, n)
}

/// Compute devices. Every method takes explicit shapes and FP32 buffers; operands have already been
/// quantized-dequantized by `engine::linear`, so a backend only ever does FP32-accumulated math.
pub trait Backend: Send + Sync {
    /// Human-readable device name for manifests and progress lines (e.g. `cpu`, `cuda:0`).
    fn name(&self) -> String;
    /// `c = a · b` (or `c += a · b` when `accumulate`), FP32 accumulation. The result must not depend on
    /// the number of threads (split only over rows/columns of `c`, never over the inner dimension).
    fn gemm(&self, a: MatRef<'_>, b: MatRef<'_>, c: &mut [f32], accumulate: bool);

    /// A decoder that runs `prep` on this backend's device, for `seqs` sequences of up to
    /// `positions` positions (the rollout and the evaluation). `None`, the default: they decode
    /// on the host ([`crate::engine::model::decode_step`]) with this backend's `gemm`.
    fn decoder<'a>(
        &'a self,
        _prep: &'a crate::engine::model::PreparedModel,
        _seqs: usize,
        _positions: usize,
    ) -> Option<Box<dyn crate::engine::rollout::Decoder + 'a>> {
        None
    }

    /// The logits `[rows, V]` of [`crate::engine::model::forward_rows`] computed on this
    /// backend's device, for a forward whose cache nobody needs (the trainer's BF16 reference).
    /// `None`, the default: the host computes it with this backend's `gemm`.
    fn forward_logits(
        &self,
        _prep: &crate::engine::model::PreparedModel,
        _tokens: &[u32],
        _layout: &crate::engine::layout::Layout,
        _replay: Option<&crate::engine::model::Routing>,
    ) -> Option<Vec<f32>> {
        None
    }

    /// The trainer's policy forward, keeping what its backward needs, run by the backend (a
    /// device-resident forward and backward); `None`, the default, runs `model::HostPass` (the
    /// host model with this backend's GEMMs). Same rows, logits and gradients as the host pass up
    /// to the backend's GEMM summation order.
    fn train_forward<'a>(
        &'a self,
        _prep: &'a crate::engine::model::PreparedModel,
        _tokens: &[u32],
        _layout: &crate::engine::layout::Layout,
        _replay: Option<&crate::engine::model::Routing>,
    ) -> Option<Box<dyn crate::engine::model::TrainPass + 'a>> {
        None
    }
}

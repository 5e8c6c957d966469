//! The engine on a device: the passes the rollout and the trainer run ([`Backend`]). The CPU
//! backend runs the host passes; the CUDA backend runs the same model (`model::pass`) over its
//! device op set. Trainer and rollout code never name a device.
//!
//! [`Device`] is what `--device` parses to (`cpu`, `cuda`, `cuda:N`) and [`open`] turns it into a
//! backend; without a usable GPU, `cuda` is a one-line error, never a panic.

pub mod cpu;
pub mod cuda;

pub use cpu::CpuBackend;

use crate::engine::device::OpError;
use crate::engine::layout::Layout;
use crate::engine::model::{ModelConfig, Params, PreparedModel, Routing, TrainPass};
use crate::engine::optim::AdamStep;
use crate::engine::rollout::Decoder;
use crate::formats::QuantStats;
use crate::recipe::ModelPlan;

/// Where the engine runs.
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

impl DeviceError {
    /// A card that exists but cannot be used now: its context or cuBLAS handle failed to start
    /// (a colleague's process holds it in exclusive mode, its memory is full, it faulted). A
    /// sweep over several cards runs on the others; a wrong name or missing libraries are the
    /// user's to fix, and stop it.
    pub fn card_unavailable(&self) -> bool {
        matches!(
            self,
            DeviceError::Cuda {
                err: cuda::CudaError::Driver(_) | cuda::CudaError::Blas(_),
                ..
            }
        )
    }
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

/// What a sweep needs to know of a device before it decides how to split the work: what
/// [`Backend::name`], [`Backend::hardware`], [`Backend::one_process_only`] and
/// [`Backend::batch_runs`] would say, read
/// without compiling kernels (a sweep in worker processes leaves that to the workers).
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceInfo {
    pub name: String,
    pub hardware: Option<String>,
    pub one_process_only: bool,
    /// [`Backend::batch_runs`].
    pub batch_runs: usize,
    /// Device memory free when it was described, in bytes (`None` on the CPU).
    pub free_memory: Option<u64>,
}

/// [`DeviceInfo`] of `device`; the same errors as [`open`] for a device that cannot be opened.
pub fn describe(device: Device) -> Result<DeviceInfo, DeviceError> {
    match device {
        Device::Cpu => Ok(DeviceInfo {
            name: device.to_string(),
            hardware: None,
            one_process_only: false,
            batch_runs: 1,
            free_memory: None,
        }),
        Device::Cuda(i) => cuda::CudaDevice::open(i)
            .map(|d| DeviceInfo {
                name: device.to_string(),
                hardware: Some(d.hardware()),
                one_process_only: d.exclusive_process(),
                batch_runs: cuda::backend::BATCH_RUNS,
                free_memory: d.free_memory(),
            })
            .map_err(|err| DeviceError::Cuda { device, err }),
    }
}

/// The passes of the engine on one device. Each is the same model (`model::pass`) on that
/// device's op set, so devices agree to their GEMM summation order; a device failure is an
/// [`OpError`], which callers that cannot return it turn into a panic naming the device
/// (`suite::builtin::run_one` records it as a failed run).
pub trait Backend: Send + Sync {
    /// Human-readable device name for manifests and progress lines (e.g. `cpu`, `cuda:0`).
    fn name(&self) -> String;

    /// The hardware behind [`Backend::name`] for a run's manifest: a GPU's model, UUID and PCI
    /// address, which stay true whatever `CUDA_VISIBLE_DEVICES` renumbered (`None` on the CPU).
    fn hardware(&self) -> Option<String> {
        None
    }

    /// The device's FP32 peak in FLOP/s, where it is known (a GPU's, from its SMs and clock).
    fn fp32_peak_flops(&self) -> Option<f64> {
        None
    }

    /// Whether the device takes one process at a time (a GPU in exclusive-process compute mode,
    /// as shared clusters set them): a sweep then keeps all its workers in one process.
    fn one_process_only(&self) -> bool {
        false
    }

    /// `Err(why)` when the device no longer computes (a sticky fault, a lost card): the sweep
    /// runner asks after a failed run and stops giving that device runs.
    fn health(&self) -> Result<(), String> {
        Ok(())
    }

    /// A decoder of `prep` on this device, for `seqs` sequences of up to `positions` positions
    /// (the rollout and the evaluation).
    fn decoder<'a>(
        &'a self,
        prep: &'a PreparedModel,
        seqs: usize,
        positions: usize,
    ) -> Result<Box<dyn Decoder + 'a>, OpError>;

    /// The logits `[rows, V]` of [`crate::engine::model::forward_rows`], for a forward whose
    /// cache nobody needs (the trainer's BF16 reference).
    fn forward_logits(
        &self,
        prep: &PreparedModel,
        tokens: &[u32],
        layout: &Layout,
        replay: Option<&Routing>,
    ) -> Result<Vec<f32>, OpError>;

    /// A training forward over `layout`'s rows that keeps what its backward needs (the
    /// trainer's policy pass and the warm start's supervised steps).
    fn train_forward<'a>(
        &'a self,
        prep: &'a PreparedModel,
        tokens: &[u32],
        layout: &Layout,
        replay: Option<&Routing>,
    ) -> Result<Box<dyn TrainPass + 'a>, OpError>;

    /// How many runs one batched call should carry on this device: 1 where batching gains
    /// nothing (the CPU, whose passes already use every core), more on a GPU.
    fn batch_runs(&self) -> usize {
        1
    }

    /// [`Backend::forward_logits`] of several runs; the logits of each, in order. A device
    /// that batches runs them as one pass.
    fn forward_logits_batch(&self, items: &[ForwardItem<'_>]) -> Result<Vec<Vec<f32>>, OpError> {
        items
            .iter()
            .map(|i| self.forward_logits(i.prep, i.tokens, i.layout, i.replay))
            .collect()
    }

    /// [`Backend::train_forward`] of several runs, kept for one backward of all of them. With
    /// [`Counts::Skip`] a device may leave out the activation counts.
    fn train_forward_batch<'a>(
        &'a self,
        items: &[ForwardItem<'a>],
        _counts: Counts,
    ) -> Result<Box<dyn TrainBatch + 'a>, OpError> {
        let passes = items
            .iter()
            .map(|i| self.train_forward(i.prep, i.tokens, i.layout, i.replay))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Box::new(LoopBatch(passes)))
    }

    /// Whether this device keeps the training state of runs stepped `runs` together across
    /// steps (their master weights, AdamW moments and gradients:
    /// [`Backend::held_forward_batch`]). The trainer then neither uploads prepared models nor
    /// runs AdamW on the host each minibatch; it reads the runs' weights back once a step
    /// ([`Backend::held_params`], every run at once) for their export. A run keeps the answer
    /// given at its first step.
    fn holds_training(&self, _runs: usize) -> bool {
        false
    }
    /// The training forward of several runs over the state this device holds for them, each
    /// run's weights prepared on the device per its plan (a run seen for the first time starts
    /// from `params` with zero moments), kept for one backward and update of all of them.
    fn held_forward_batch<'a>(
        &'a self,
        _items: &[HeldItem<'_>],
        _counts: Counts,
    ) -> Result<Box<dyn HeldBatch + 'a>, OpError> {
        Err(OpError::Shape(format!(
            "{}: this device does not hold training state",
            self.name()
        )))
    }
    /// Each of `runs`' master weights as this device holds them (read back together: one copy
    /// for all of them).
    fn held_params(&self, runs: &[u64]) -> Result<Vec<Params>, OpError> {
        Err(OpError::Shape(format!(
            "{}: holds no training state for runs {runs:?}",
            self.name()
        )))
    }
    /// Forget run `run`'s state (the run ended); nothing where none is held.
    fn release_held(&self, _run: u64) {}
    /// Each of `runs`' weights exported where the device holds them: prepared there per the
    /// run's plan from the master weights as they stand (a run not held yet is taken on from
    /// `params` first), for [`Backend::held_decoder_batch`]. The weights never cross the bus;
    /// the bytes are those of `PreparedModel::new(params, plan)`. `None` where this device
    /// exports nothing (the host prepares the export).
    fn held_export(&self, _runs: &[HeldRun<'_>]) -> Result<Option<Vec<HeldExport>>, OpError> {
        Ok(None)
    }
    /// [`Backend::decoder_batch`] of exports made by [`Backend::held_export`] (of any steps).
    fn held_decoder_batch<'a>(
        &'a self,
        _exports: &[&'a HeldExport],
        _seqs: usize,
        _positions: usize,
    ) -> Result<Box<dyn BatchDecoder + 'a>, OpError> {
        Err(OpError::Shape(format!(
            "{}: this device exports no held weights",
            self.name()
        )))
    }
    /// [`Backend::decoder`] of several runs, stepped together.
    fn decoder_batch<'a>(
        &'a self,
        preps: &[&'a PreparedModel],
        seqs: usize,
        positions: usize,
    ) -> Result<Box<dyn BatchDecoder + 'a>, OpError> {
        let decs = preps
            .iter()
            .map(|p| self.decoder(p, seqs, positions))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Box::new(LoopDecoder(decs)))
    }
}

// ===================================================================================================
// Several runs at once

/// Whether a batched training forward keeps each run's activation counts
/// ([`TrainBatch::quant_stats`]). A device stepping several runs as one pass counts each run's
/// rows in passes of their own, which a forward whose counts nobody reads can skip; its
/// `quant_stats` then panics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counts {
    Keep,
    Skip,
}

/// One run's input to a batched forward ([`Backend::forward_logits_batch`],
/// [`Backend::train_forward_batch`]).
#[derive(Clone, Copy)]
pub struct ForwardItem<'a> {
    pub prep: &'a PreparedModel,
    pub tokens: &'a [u32],
    pub layout: &'a Layout,
    pub replay: Option<&'a Routing>,
}

/// One run's input to [`Backend::held_forward_batch`]: which run, its weights as the host has
/// them (read only when the device first sees the run), its plan and its rows.
#[derive(Clone, Copy)]
pub struct HeldItem<'a> {
    /// The run's key ([`crate::engine::trainer::Trainer::run_key`]), unique in the process.
    pub run: u64,
    pub params: &'a Params,
    pub plan: &'a ModelPlan,
    pub tokens: &'a [u32],
    pub layout: &'a Layout,
    pub replay: Option<&'a Routing>,
    /// The run's export made from its masters as they stand, under its plan, where there is
    /// one (the first forward of a step): a device may read it instead of preparing again.
    pub export: Option<&'a HeldExport>,
}

/// One run's input to [`Backend::held_export`].
#[derive(Clone, Copy)]
pub struct HeldRun<'a> {
    /// [`HeldItem::run`].
    pub run: u64,
    /// The run's weights as the host has them (read only when the device first sees the run).
    pub params: &'a Params,
    /// The plan the export is prepared under (the rollout's).
    pub plan: &'a ModelPlan,
}

/// A run's weights exported on the device that holds its state ([`Backend::held_export`]): one
/// member of a stack of runs prepared together, kept alive on the device as long as any of
/// them is. Opaque to the host; only the device that made it reads it.
#[derive(Clone)]
pub struct HeldExport {
    stack: std::sync::Arc<dyn std::any::Any + Send + Sync>,
    member: usize,
    config: ModelConfig,
}

impl HeldExport {
    /// Member `member` of `stack` (what the device made), a model of shape `config`.
    pub fn new(
        stack: std::sync::Arc<dyn std::any::Any + Send + Sync>,
        member: usize,
        config: ModelConfig,
    ) -> Self {
        HeldExport {
            stack,
            member,
            config,
        }
    }
    /// The device's stack this run is a member of.
    pub fn stack(&self) -> &std::sync::Arc<dyn std::any::Any + Send + Sync> {
        &self.stack
    }
    /// This run's place in [`HeldExport::stack`].
    pub fn member(&self) -> usize {
        self.member
    }
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }
}

/// The training forward of runs whose state the device holds, their backward and their AdamW
/// update: [`TrainBatch`] with the gradients kept on the device.
pub trait HeldBatch: Send {
    fn members(&self) -> usize;
    /// Member `m`'s logits `[rows, V]` in its layout's row order.
    fn logits(&self, m: usize) -> &[f32];
    /// Member `m`'s activation counts; made with [`Counts::Keep`].
    fn quant_stats(&self, m: usize) -> Vec<(String, QuantStats)>;
    /// The backward of every member with `Some` dL/dlogits; each one's gradients stay on the
    /// device for [`HeldBatch::update`], and what comes back is their squared norms, one per
    /// tensor of `Params::named_tensors` (`optim::sum_squares`' bits).
    fn backward(&mut self, dlogits: &[Option<&[f32]>]) -> Vec<Option<Vec<f64>>>;
    /// AdamW from the last backward's gradients for each member with `Some` steps (one per
    /// tensor, in `Params::named_tensors` order); the others are left as they are. Returns each
    /// updated member's (Σ update², Σ weight² after the update), summed as `AdamW::update`
    /// sums them.
    fn update(&mut self, steps: &[Option<Vec<AdamStep>>]) -> Vec<Option<(f64, f64)>>;
}

/// The training forward of several runs ("members") at once, and their backward. A device that
/// batches computes every member in one pass; what a member gets never depends on the others.
pub trait TrainBatch: Send {
    /// Members, in the order of the items that made it.
    fn members(&self) -> usize;
    /// Member `m`'s logits `[rows, V]` in its layout's row order ([`TrainPass::logits`]).
    fn logits(&self, m: usize) -> &[f32];
    /// Member `m`'s activation counts ([`TrainPass::quant_stats`]); made with [`Counts::Keep`].
    fn quant_stats(&self, m: usize) -> Vec<(String, QuantStats)>;
    /// The gradients of every member given its dL/dlogits ([`TrainPass::backward`]); a member
    /// given `None` is skipped and gets `None`.
    fn backward(&self, dlogits: &[Option<&[f32]>]) -> Vec<Option<Params>>;
}

/// The decoders of several runs stepped together: every member has the same number of
/// sequences and positions; member `m`'s tokens and results are at index `m`.
pub trait BatchDecoder {
    fn members(&self) -> usize;
    /// [`Decoder::step`] of every member.
    fn step(&mut self, tokens: &[Vec<u32>]) -> Vec<(Vec<f32>, Routing)>;
    /// [`Decoder::feed`] of every member, `count` positions each.
    fn feed(&mut self, tokens: &[Vec<u32>], count: usize) -> Vec<Vec<Routing>>;
    /// [`Decoder::repeat_each`] of every member.
    fn repeat_each(&mut self, samples: usize);
}

/// [`TrainBatch`] of a device that does not batch: one [`TrainPass`] per member.
pub struct LoopBatch<'a>(pub Vec<Box<dyn TrainPass + 'a>>);

impl TrainBatch for LoopBatch<'_> {
    fn members(&self) -> usize {
        self.0.len()
    }
    fn logits(&self, m: usize) -> &[f32] {
        self.0[m].logits()
    }
    fn quant_stats(&self, m: usize) -> Vec<(String, QuantStats)> {
        self.0[m].quant_stats()
    }
    fn backward(&self, dlogits: &[Option<&[f32]>]) -> Vec<Option<Params>> {
        self.0
            .iter()
            .zip(dlogits)
            .map(|(p, d)| d.map(|d| p.backward(d)))
            .collect()
    }
}

/// [`BatchDecoder`] of a device that does not batch: one [`Decoder`] per member.
pub struct LoopDecoder<'a>(pub Vec<Box<dyn Decoder + 'a>>);

impl BatchDecoder for LoopDecoder<'_> {
    fn members(&self) -> usize {
        self.0.len()
    }
    fn step(&mut self, tokens: &[Vec<u32>]) -> Vec<(Vec<f32>, Routing)> {
        self.0
            .iter_mut()
            .zip(tokens)
            .map(|(d, t)| d.step(t))
            .collect()
    }
    fn feed(&mut self, tokens: &[Vec<u32>], count: usize) -> Vec<Vec<Routing>> {
        self.0
            .iter_mut()
            .zip(tokens)
            .map(|(d, t)| d.feed(t, count))
            .collect()
    }
    fn repeat_each(&mut self, samples: usize) {
        for d in &mut self.0 {
            d.repeat_each(samples);
        }
    }
}

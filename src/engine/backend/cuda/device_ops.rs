//! [`GpuOps`]: the model's op set ([`Ops`]) on one GPU — device buffers, the kernels of
//! `ops.cu`, `backward.cu`, `moe.cu`, `train.cu` and `kv.cu`, the linear layer of
//! [`CudaLinear`] (the one quantizer's device side, cuBLAS GEMMs), all queued on one stream in
//! program order. No model logic lives here: the passes are `model::pass`.
//!
//! Each element-wise or row op's kernel computes what its CPU op (`engine::ops`) computes, in the
//! CPU's order wherever the CPU sums within a row or column (one thread does that sum), so the
//! embedding, RMSNorm, `add_into`, the MoE combine and their backwards, the router's backward and
//! attention's backward give the CPU's bits (attention's backward reads the forward's softmax
//! weights, so no `expf`, and gathers its key and value gradients over each layout group's query
//! rows in the CPU's order, [`DeviceGroups`]). Ops that call `expf` (attention, SwiGLU and its
//! backward, the router) differ from glibc by an ulp or so per `exp` and agree to a tolerance
//! (`tests/cuda_ops.rs`, `tests/cuda_backward.rs`). Backward ops accumulate into their gradient
//! buffers as the CPU's do. Shape checks and device-side index checks: [`super::launch`].
//!
//! Layout choices that differ from the CPU's, and why they give the same numbers:
//! - the routed experts run as one capacity-padded batch ([`ExpertBatch`]): expert e owns rows
//!   `[e·cap, (e+1)·cap)`, its tokens in token order then zero rows, with `cap` the row count
//!   rounded up to 128 so that no column-quantization block straddles two experts. Zero rows
//!   change no amax (no code), add nothing to a GEMM and are not counted as saturated or
//!   underflowed (the `elements` count includes them);
//! - every quantization and every op summed in a fixed order gives the CPU's bits for the same
//!   inputs; cuBLAS sums GEMMs in another order than `matrixmultiply`, CUDA's `expf` may differ
//!   by an ulp, and the experts' dx is summed per token over its choices, so logits and
//!   gradients agree with the CPU's to a tolerance (`tests/cuda_train.rs` measures it), and run
//!   to run bit for bit.

use super::launch::{
    DeviceGroups, DeviceLayout, cfg, cfg_blocks, cfg_warps, checked, dim, need, shape,
};
use super::linear::{CudaLinear, DeviceLinearCache, DeviceWeight};
use super::moe::ExpertBatch;
use super::{CudaDevice, CudaError};
use crate::engine::device::{OpError, OpResult, Ops, SiteCounts};
use crate::engine::layout::Layout;
use crate::engine::linear::PreparedWeight;
use crate::engine::model::pass::{LayerWeights, RunPlans, Weights};
use crate::engine::model::{ModelConfig, Params, PreparedModel};
use crate::engine::ops::RMSNORM_EPS;
use crate::formats::QuantStats;
use crate::recipe::{Site, SitePlan};
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, CudaView, DriverError, LaunchConfig, PushKernelArg,
};
use std::sync::Arc;

/// Expert batch rows are a multiple of this: the largest block a column quantization uses
/// (FP8 block's 128), so that blocks never straddle two experts.
const CAP_MULTIPLE: usize = 128;

/// Runs stepped together with at least this many rows each (training passes; a decode step has
/// a row per sequence) size the expert batch by the busiest expert's count
/// ([`super::moe::ExpertBatch::largest_count`]) rather than by every row of a run. Waiting for
/// the count stops the host queueing ahead of the GPU: for a run alone (the worker pool, the warm
/// start) and for decode steps that cost more than the padding saved (H200 and H100,
/// `docs/cuda.md`).
const COUNT_FROM_RUN_ROWS: usize = 512;

impl From<CudaError> for OpError {
    fn from(e: CudaError) -> Self {
        match e {
            CudaError::Shape(s) => OpError::Shape(s),
            e => OpError::Device(e.to_string()),
        }
    }
}

impl From<DriverError> for OpError {
    fn from(e: DriverError) -> Self {
        CudaError::from(e).into()
    }
}

/// A linear forward's cache on the device, with its activation counts
/// (`[elements, saturated, underflowed]`).
pub struct GpuLin {
    cache: DeviceLinearCache,
    counts: CudaSlice<u64>,
}

/// The routed slots' rows in the capacity-padded expert batch (`moe.cu`).
pub struct GpuDispatch {
    /// Batch row of each slot `n·k + j`.
    slot_row: CudaSlice<u32>,
    /// Token row each batch row is gathered from.
    src_row: CudaSlice<u32>,
    cap: usize,
    e: usize,
    n: usize,
}

/// A decoder's keys and values on the device (`kv.cu`): per layer `[seqs · capacity, 3d]`,
/// sequence i's position p at row `i · capacity + p`, K and V columns rounded to BF16.
pub struct DeviceKvCache {
    layers: Vec<CudaSlice<f32>>,
    seqs: usize,
    capacity: usize,
    len: usize,
    width: usize,
}

/// A row layout on the device; `groups` for the attention backward.
pub struct GpuRows {
    layout: DeviceLayout,
    groups: Option<DeviceGroups>,
}

impl GpuRows {
    pub fn new(layout: DeviceLayout, groups: Option<DeviceGroups>) -> Self {
        GpuRows { layout, groups }
    }
}

/// The kernels of `ops.cu`, `backward.cu`, `train.cu` and `kv.cu`.
struct Kernels {
    embedding: CudaFunction,
    embedding_backward: CudaFunction,
    rmsnorm: CudaFunction,
    rmsnorm_dx: CudaFunction,
    rmsnorm_dg: CudaFunction,
    add_into: CudaFunction,
    swiglu: CudaFunction,
    swiglu_backward: CudaFunction,
    attention: CudaFunction,
    attention_dq: CudaFunction,
    attention_dkv: CudaFunction,
    router_topk: CudaFunction,
    router_replay: CudaFunction,
    router_backward: CudaFunction,
    moe_combine: CudaFunction,
    expert_dy: CudaFunction,
    expert_dx_scatter: CudaFunction,
    kv_store: CudaFunction,
}

/// The op set on one GPU; see the module doc.
pub struct GpuOps {
    stream: Arc<CudaStream>,
    lin: CudaLinear,
    k: Kernels,
    batch: ExpertBatch,
    /// Runs stepped at once ([`Ops::runs`]): each tensor holds `runs` equal blocks of rows, each
    /// parameter `runs` copies, each weight `runs` stacked copies (experts: `runs · E`).
    runs: usize,
    /// Stepping several runs, whether a training forward counts each run's activations (passes
    /// of their own; [`crate::engine::backend::Counts`]). One run's counts come with its forward.
    run_counts: bool,
}

impl GpuOps {
    /// Compile the kernels and open a cuBLAS handle on `dev`, with a stream of their own.
    pub fn new(dev: &Arc<CudaDevice>) -> Result<Self, CudaError> {
        let lin = CudaLinear::new(dev)?;
        let ops = dev.compile_with_prelude("ops", include_str!("ops.cu"))?;
        let bwd = dev.compile_with_prelude("backward", include_str!("backward.cu"))?;
        let train = dev.compile_with_prelude("train", include_str!("train.cu"))?;
        let kv = dev.compile("kv", include_str!("kv.cu"))?;
        let k = Kernels {
            embedding: ops.load_function("embedding_forward")?,
            embedding_backward: bwd.load_function("embedding_backward")?,
            rmsnorm: ops.load_function("rmsnorm_forward")?,
            rmsnorm_dx: bwd.load_function("rmsnorm_backward_dx")?,
            rmsnorm_dg: bwd.load_function("rmsnorm_backward_dg")?,
            add_into: ops.load_function("add_into")?,
            swiglu: ops.load_function("swiglu_forward")?,
            swiglu_backward: bwd.load_function("swiglu_backward")?,
            attention: ops.load_function("attention_forward")?,
            attention_dq: bwd.load_function("attention_backward_dq")?,
            attention_dkv: bwd.load_function("attention_backward_dkv")?,
            router_topk: ops.load_function("router_topk")?,
            router_replay: ops.load_function("router_replay")?,
            router_backward: bwd.load_function("router_backward")?,
            moe_combine: ops.load_function("moe_combine")?,
            expert_dy: train.load_function("expert_dy")?,
            expert_dx_scatter: train.load_function("expert_dx_scatter")?,
            kv_store: kv.load_function("kv_store")?,
        };
        Ok(GpuOps {
            stream: lin.stream().clone(),
            lin,
            k,
            batch: ExpertBatch::new(dev)?,
            runs: 1,
            run_counts: true,
        })
    }

    /// Step `runs` runs at once from now on (1: one run, as made).
    pub fn set_runs(&mut self, runs: usize) {
        self.runs = runs.max(1);
    }

    /// Whether training forwards of several runs count each run's activations (on when made);
    /// off, their counts stay zero.
    pub fn set_run_counts(&mut self, on: bool) {
        self.run_counts = on;
    }

    /// Rows of one run among `n`: the runs' blocks are equal.
    fn run_rows(&self, op: &str, n: usize) -> Result<usize, CudaError> {
        if !n.is_multiple_of(self.runs) {
            return Err(shape(format!(
                "{op}: {n} rows do not split into {} equal runs",
                self.runs
            )));
        }
        Ok((n / self.runs).max(1))
    }

    /// The stream every op is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn output(&self, n: usize) -> Result<CudaSlice<f32>, CudaError> {
        super::output_buffer(&self.stream, n)
    }

    fn zeros_f(&self, n: usize) -> Result<CudaSlice<f32>, CudaError> {
        Ok(self.stream.alloc_zeros(n.max(1))?)
    }

    /// Copy a step's prepared weights (forward and dgrad operands) to the device in one staged
    /// copy: the tensors are listed in one fixed order and taken back in the same order.
    pub fn upload_model(&self, prep: &PreparedModel) -> Result<Weights<GpuOps>, CudaError> {
        self.upload_models(&[prep], true)
    }

    /// [`GpuOps::upload_model`] without the dgrad operands, for passes that never run a
    /// backward (the rollout's decode, the reference forward): where a recipe's backward reads
    /// other operands than its forward (`-hp`, `-dq`), half the bytes and copies.
    pub fn upload_model_for_inference(
        &self,
        prep: &PreparedModel,
    ) -> Result<Weights<GpuOps>, CudaError> {
        self.upload_models(&[prep], false)
    }

    /// The models of runs stepped together (one shape and plan), stacked: each tensor holds
    /// every run's copy in turn, each site every run's weights (`[runs · E, out, in]` for the
    /// routed experts). One staged copy, as for one model; `dgrad` as [`GpuOps::upload_model`].
    pub fn upload_models(
        &self,
        preps: &[&PreparedModel],
        dgrad: bool,
    ) -> Result<Weights<GpuOps>, CudaError> {
        let first = *preps
            .first()
            .ok_or_else(|| shape("upload: no models".into()))?;
        if preps.iter().any(|p| p.config != first.config) {
            return Err(shape(
                "upload: models stepped together need one shape".into(),
            ));
        }
        // Every run's tensor `f(prep)` as one group, and every run's weights of a site.
        let stack = |f: &dyn Fn(&PreparedModel) -> &[f32]| -> Vec<&[f32]> {
            preps.iter().map(|p| f(p)).collect()
        };
        let sites = |f: &dyn Fn(&PreparedModel) -> Vec<&PreparedWeight>| -> Vec<&PreparedWeight> {
            preps.iter().flat_map(|p| f(p)).collect()
        };
        let site_list = |l: usize| -> Vec<Vec<&PreparedWeight>> {
            let at = |f: fn(&crate::engine::model::PreparedLayer) -> Vec<&PreparedWeight>| {
                sites(&|p: &PreparedModel| f(&p.layers[l]))
            };
            vec![
                at(|l| vec![&l.linear_qkv]),
                at(|l| vec![&l.linear_proj]),
                at(|l| vec![&l.router]),
                at(|l| l.experts_fc1.iter().collect()),
                at(|l| l.experts_fc2.iter().collect()),
                at(|l| vec![&l.shared_fc1]),
                at(|l| vec![&l.shared_fc2]),
            ]
        };
        let output = sites(&|p: &PreparedModel| vec![&p.output_layer]);
        let layer_sites: Vec<Vec<Vec<&PreparedWeight>>> =
            (0..first.layers.len()).map(site_list).collect();
        fn parts<'w>(
            ws: &[&'w PreparedWeight],
            dgrad: bool,
        ) -> Result<Vec<Vec<&'w [f32]>>, CudaError> {
            let [fwd, bwd] = DeviceWeight::parts(ws)?;
            Ok(if dgrad { vec![fwd, bwd] } else { vec![fwd] })
        }
        let mut groups = vec![
            stack(&|p| &p.wte[..]),
            stack(&|p| &p.wpe[..]),
            stack(&|p| &p.final_norm[..]),
        ];
        groups.extend(parts(&output, dgrad)?);
        for (l, ls) in layer_sites.iter().enumerate() {
            groups.extend([
                stack(&|p| &p.layers[l].attn_norm[..]),
                stack(&|p| &p.layers[l].mlp_norm[..]),
            ]);
            for ws in ls {
                groups.extend(parts(ws, dgrad)?);
            }
        }
        let mut bufs = self.lin.staging().upload(&groups)?.into_iter();
        let next = |b: &mut std::vec::IntoIter<_>| b.next().expect("one buffer per group");
        let weight = |b: &mut std::vec::IntoIter<_>, ws: &[&PreparedWeight]| {
            let w_fwd = next(b);
            if dgrad {
                DeviceWeight::from_parts(ws, w_fwd, next(b))
            } else {
                DeviceWeight::forward_only(ws, w_fwd)
            }
        };
        let b = &mut bufs;
        let (wte, wpe, final_norm) = (next(b), next(b), next(b));
        let output_layer = weight(b, &output);
        let layers = layer_sites
            .iter()
            .map(|ls| {
                let (attn_norm, mlp_norm) = (next(b), next(b));
                LayerWeights {
                    attn_norm,
                    mlp_norm,
                    linear_qkv: weight(b, &ls[0]),
                    linear_proj: weight(b, &ls[1]),
                    router: weight(b, &ls[2]),
                    experts_fc1: weight(b, &ls[3]),
                    experts_fc2: weight(b, &ls[4]),
                    shared_fc1: weight(b, &ls[5]),
                    shared_fc2: weight(b, &ls[6]),
                }
            })
            .collect();
        Ok(Weights {
            config: first.config.clone(),
            plans: RunPlans::of(preps.iter().map(|p| p.plan.clone()).collect()),
            wte,
            wpe,
            layers,
            final_norm,
            output_layer,
        })
    }

    /// Each `(src, dst)` copied back in one staged copy ([`super::staging::Staging::download`]).
    pub fn download(&self, parts: &mut [(CudaView<'_, f32>, &mut [f32])]) -> Result<(), CudaError> {
        self.lin.staging().download(parts)
    }

    /// The master weights of runs stepped together, stacked as [`GpuOps::prepare_models`] reads
    /// them (each of `Params::named_tensors` holding every run's copy in turn), in one staged
    /// copy.
    pub fn upload_params(&self, params: &[&Params]) -> Result<Vec<CudaSlice<f32>>, CudaError> {
        let first = params
            .first()
            .ok_or_else(|| shape("upload: no parameters".into()))?;
        if params.iter().any(|p| p.config != first.config) {
            return Err(shape(
                "upload: runs stepped together need one model shape".into(),
            ));
        }
        let named: Vec<Vec<(String, &[f32])>> = params.iter().map(|p| p.named_tensors()).collect();
        let groups: Vec<Vec<&[f32]>> = (0..named[0].len())
            .map(|i| named.iter().map(|n| n[i].1).collect())
            .collect();
        self.lin.staging().upload(&groups)
    }

    /// The training copy [`GpuOps::upload_models`] would make of `PreparedModel::new(params, plan)`
    /// for each of `runs` runs (run r on its plan in `plans`), made on the device from their
    /// master weights `master`: the tensors of `Params::named_tensors`, in that order, each
    /// holding every run's copy back to back (the stacking of `upload_models`, so the passes read
    /// it the same way). The weights never cross the bus; the operands are `upload_models'` bit
    /// for bit (`tests/cuda_batch.rs`).
    pub fn prepare_models(
        &self,
        cfg: &ModelConfig,
        plans: &RunPlans,
        master: &[CudaSlice<f32>],
        runs: usize,
    ) -> Result<Weights<GpuOps>, CudaError> {
        let shapes = cfg.named_shapes();
        let models = plans.models();
        if master.len() != shapes.len()
            || models.iter().any(|m| m.layers.len() != cfg.n_layers)
            || (models.len() != 1 && models.len() != runs)
        {
            return Err(shape(format!(
                "prepare: {} master tensors and {} plans of {} layers for {runs} runs of a model \
                 of {} tensors, {} layers",
                master.len(),
                models.len(),
                models[0].layers.len(),
                shapes.len(),
                cfg.n_layers
            )));
        }
        for ((name, dims), t) in shapes.iter().zip(master) {
            let want = dims.iter().product::<usize>() * runs;
            if t.len() < want {
                return Err(shape(format!(
                    "prepare: master `{name}` holds {} values, {runs} runs need {want}",
                    t.len()
                )));
            }
        }
        let s = &self.stream;
        let copy = |t: &CudaSlice<f32>, len: usize| -> Result<CudaSlice<f32>, CudaError> {
            let mut out = super::output_buffer(s, len * runs)?;
            if len * runs > 0 {
                s.memcpy_dtod(&t.slice(..len * runs), &mut out.slice_mut(..len * runs))?;
            }
            Ok(out)
        };
        let weight = |p: &[SitePlan], t: &CudaSlice<f32>, stack: usize, out: usize, inp: usize| {
            let prepared = self.lin.prepare_runs(p, t, (runs, stack), out, inp)?;
            Ok::<_, CudaError>(DeviceWeight::from_prepared(
                prepared,
                runs * stack,
                out,
                inp,
            ))
        };
        let (v, d, e) = (cfg.vocab, cfg.d_model, cfg.n_experts);
        let (f, fs) = (cfg.d_ff, cfg.d_ff_shared);
        let layers = (0..cfg.n_layers)
            .map(|l| {
                // Per layer, in `named_shapes` order: attn norm, qkv, proj, mlp norm, router,
                // experts fc1, experts fc2, shared fc1, shared fc2.
                let t = &master[2 + 9 * l..2 + 9 * (l + 1)];
                let p = |site: Site| plans.site(l, site);
                Ok(LayerWeights {
                    attn_norm: copy(&t[0], d)?,
                    linear_qkv: weight(p(Site::LinearQkv), &t[1], 1, 3 * d, d)?,
                    linear_proj: weight(p(Site::LinearProj), &t[2], 1, d, d)?,
                    mlp_norm: copy(&t[3], d)?,
                    router: weight(p(Site::Router), &t[4], 1, e, d)?,
                    experts_fc1: weight(p(Site::ExpertsFc1), &t[5], e, 2 * f, d)?,
                    experts_fc2: weight(p(Site::ExpertsFc2), &t[6], e, d, f)?,
                    shared_fc1: weight(p(Site::SharedFc1), &t[7], 1, 2 * fs, d)?,
                    shared_fc2: weight(p(Site::SharedFc2), &t[8], 1, d, fs)?,
                })
            })
            .collect::<Result<Vec<_>, CudaError>>()?;
        let tail = 2 + 9 * cfg.n_layers;
        Ok(Weights {
            config: cfg.clone(),
            plans: plans.clone(),
            wte: copy(&master[0], v * d)?,
            wpe: copy(&master[1], cfg.max_seq * d)?,
            layers,
            final_norm: copy(&master[tail], d)?,
            output_layer: weight(plans.output(), &master[tail + 1], 1, v, d)?,
        })
    }

    /// Runs `keep` of `w`, a stack of `runs` runs' models, as a stack of their own in that order
    /// (device-to-device copies): what [`GpuOps::upload_models`] or [`GpuOps::prepare_models`]
    /// would have made of those runs alone, bit for bit.
    pub fn gather_models(
        &self,
        w: &Weights<GpuOps>,
        runs: usize,
        keep: &[usize],
    ) -> Result<Weights<GpuOps>, CudaError> {
        if keep.iter().any(|&k| k >= runs) {
            return Err(shape(format!("gather: runs {keep:?} of a stack of {runs}")));
        }
        let s = &self.stream;
        let cfg = &w.config;
        let d = cfg.d_model;
        let param = |p: &CudaSlice<f32>, len: usize| super::linear::gather_chunks(s, p, len, keep);
        let weight = |x: &DeviceWeight| x.gather(s, runs, keep);
        let layers = w
            .layers
            .iter()
            .map(|l| {
                Ok(LayerWeights {
                    attn_norm: param(&l.attn_norm, d)?,
                    linear_qkv: weight(&l.linear_qkv)?,
                    linear_proj: weight(&l.linear_proj)?,
                    mlp_norm: param(&l.mlp_norm, d)?,
                    router: weight(&l.router)?,
                    experts_fc1: weight(&l.experts_fc1)?,
                    experts_fc2: weight(&l.experts_fc2)?,
                    shared_fc1: weight(&l.shared_fc1)?,
                    shared_fc2: weight(&l.shared_fc2)?,
                })
            })
            .collect::<Result<Vec<_>, CudaError>>()?;
        Ok(Weights {
            config: cfg.clone(),
            plans: w.plans.gather(keep),
            wte: param(&w.wte, cfg.vocab * d)?,
            wpe: param(&w.wpe, cfg.max_seq * d)?,
            layers,
            final_norm: param(&w.final_norm, d)?,
            output_layer: weight(&w.output_layer)?,
        })
    }

    /// `plans` as this op set's sites take them: one per run, or one for all.
    fn site_plans<'p>(&self, plans: &'p [SitePlan]) -> OpResult<&'p [SitePlan]> {
        if plans.len() == 1 || plans.len() == self.runs {
            Ok(plans)
        } else {
            Err(shape(format!(
                "linear: {} site plans for {} runs",
                plans.len(),
                self.runs
            ))
            .into())
        }
    }

    /// [`CudaLinear::forward`] into a fresh count buffer (`n` rows per weight block), three
    /// counts per run. Stepping several runs, the forward runs once for all of them and its own
    /// quantization counts each run's rows into the run's slot, under the run's plan (a count
    /// is a sum over a run's blocks).
    fn linear_counted(
        &self,
        plans: &[SitePlan],
        x: &CudaSlice<f32>,
        n: usize,
        w: &DeviceWeight,
    ) -> OpResult<(CudaSlice<f32>, GpuLin)> {
        let s = &self.stream;
        let plans = self.site_plans(plans)?;
        let mut counts = s
            .alloc_zeros::<u64>(3 * self.runs)
            .map_err(CudaError::from)?;
        if self.runs > 1 && !self.run_counts {
            let (y, cache) = self.lin.forward(plans, x, n, w)?;
            return Ok((y, GpuLin { cache, counts }));
        }
        let (y, cache) = self
            .lin
            .forward_counted(plans, x, n, w, (&mut counts, self.runs))?;
        Ok((y, GpuLin { cache, counts }))
    }
}

impl Ops for GpuOps {
    type T = CudaSlice<f32>;
    type Ids = CudaSlice<u32>;
    type Param = CudaSlice<f32>;
    type Weight = DeviceWeight;
    type Experts = DeviceWeight;
    type Lin = GpuLin;
    type ExpertLin = GpuLin;
    type Dispatch = GpuDispatch;
    type Rows = GpuRows;
    type Kv = DeviceKvCache;

    fn runs(&self) -> usize {
        self.runs
    }

    fn zeros(&self, n: usize) -> OpResult<CudaSlice<f32>> {
        Ok(self.zeros_f(n)?)
    }

    fn upload(&self, x: &[f32]) -> OpResult<CudaSlice<f32>> {
        if x.is_empty() {
            return self.zeros(1);
        }
        Ok(self.stream.clone_htod(x).map_err(CudaError::from)?)
    }

    fn to_host(&self, t: &CudaSlice<f32>, n: usize) -> OpResult<Vec<f32>> {
        if n == 0 {
            return Ok(Vec::new());
        }
        Ok(self
            .stream
            .clone_dtoh(&t.slice(..n))
            .map_err(CudaError::from)?)
    }

    fn all_to_host(&self, ts: Vec<(CudaSlice<f32>, usize)>) -> OpResult<Vec<Vec<f32>>> {
        let mut host: Vec<Vec<f32>> = ts.iter().map(|(_, n)| vec![0.0; *n]).collect();
        let mut parts: Vec<(CudaView<'_, f32>, &mut [f32])> = ts
            .iter()
            .zip(host.iter_mut())
            .map(|((t, _), h)| (t.as_view(), &mut h[..]))
            .collect();
        self.lin.staging().download(&mut parts)?;
        Ok(host)
    }

    fn ids(&self, v: &[u32]) -> OpResult<CudaSlice<u32>> {
        let s = &self.stream;
        Ok(if v.is_empty() {
            s.alloc_zeros::<u32>(1)
        } else {
            s.clone_htod(v)
        }
        .map_err(CudaError::from)?)
    }

    fn ids_to_host(&self, ids: &[&CudaSlice<u32>], nk: usize) -> OpResult<Vec<Vec<u32>>> {
        let s = &self.stream;
        // Every layer's ids gathered on the device: one copy back, not one per layer.
        let mut all = s
            .alloc_zeros::<u32>((ids.len() * nk).max(1))
            .map_err(CudaError::from)?;
        if nk > 0 {
            for (l, layer) in ids.iter().enumerate() {
                s.memcpy_dtod(&layer.slice(..nk), &mut all.slice_mut(l * nk..(l + 1) * nk))
                    .map_err(CudaError::from)?;
            }
        }
        let all = s.clone_dtoh(&all).map_err(CudaError::from)?;
        Ok((0..ids.len())
            .map(|l| all[l * nk..(l + 1) * nk].to_vec())
            .collect())
    }

    fn rows(&self, layout: &Layout) -> OpResult<GpuRows> {
        Ok(GpuRows {
            layout: DeviceLayout::upload(&self.stream, layout)?,
            groups: Some(DeviceGroups::upload(&self.stream, layout)?),
        })
    }

    /// One stream: `a` then `b`, queued in that order.
    fn join<A: Send, B: Send>(
        &self,
        a: impl FnOnce() -> A + Send,
        b: impl FnOnce() -> B + Send,
    ) -> (A, B) {
        let ra = a();
        (ra, b())
    }

    /// A token or position past its table gives a NaN row, not a read outside the table.
    fn embedding(
        &self,
        tokens: &CudaSlice<u32>,
        rows: &GpuRows,
        wte: &CudaSlice<f32>,
        wpe: &CudaSlice<f32>,
        n: usize,
        d: usize,
    ) -> OpResult<CudaSlice<f32>> {
        let (op, positions) = ("embedding_forward", &rows.layout.positions);
        if d == 0 {
            return Err(shape(format!("{op}: d = 0")).into());
        }
        let nd = checked(n, d, op, "n x d")?;
        let mut out = self.output(nd)?;
        need(op, "tokens", tokens.len(), n)?;
        need(op, "positions", positions.len(), n)?;
        let (n32, d32) = (dim(op, "n", n)?, dim(op, "d", d)?);
        let vocab = dim(op, "wte rows", wte.len() / d / self.runs)?;
        let npos = dim(op, "wpe rows", wpe.len() / d / self.runs)?;
        let run_rows = dim(op, "run rows", self.run_rows(op, n)?)?;
        if nd > 0 {
            let mut b = self.stream.launch_builder(&self.k.embedding);
            b.arg(&mut out).arg(tokens).arg(positions).arg(wte).arg(wpe);
            b.arg(&n32).arg(&d32).arg(&vocab).arg(&npos).arg(&run_rows);
            // SAFETY: element idx < n*d, the length `out` was allocated with; row i < n indexes
            // tokens and positions (>= n each); run r = i / run_rows < runs reads wte/wpe at
            // (r*vocab + t)*d + c, (r*npos + p)*d + c only for t < vocab = wte.len()/d/runs,
            // p < npos = wpe.len()/d/runs, c < d.
            unsafe { b.launch(cfg(nd)) }?;
        }
        Ok(out)
    }

    /// A thread per column adds the rows in order. A token or position out of range turns column
    /// c of row 0 of both tables into NaN rather than writing outside them.
    fn embedding_backward(
        &self,
        dwte: &mut CudaSlice<f32>,
        dwpe: &mut CudaSlice<f32>,
        dh: &CudaSlice<f32>,
        tokens: &CudaSlice<u32>,
        rows: &GpuRows,
        n: usize,
        d: usize,
    ) -> OpResult<()> {
        let (op, positions) = ("embedding_backward", &rows.layout.positions);
        if d == 0 {
            return Err(shape(format!("{op}: d = 0")).into());
        }
        need(op, "dout", dh.len(), checked(n, d, op, "n x d")?)?;
        need(op, "tokens", tokens.len(), n)?;
        need(op, "positions", positions.len(), n)?;
        let (n32, d32) = (dim(op, "n", n)?, dim(op, "d", d)?);
        let vocab = dim(op, "dwte rows", dwte.len() / d / self.runs)?;
        let npos = dim(op, "dwpe rows", dwpe.len() / d / self.runs)?;
        let run_rows = dim(op, "run rows", self.run_rows(op, n)?)?;
        if n == 0 {
            return Ok(());
        }
        let mut b = self.stream.launch_builder(&self.k.embedding_backward);
        b.arg(dwte).arg(dwpe).arg(dh).arg(tokens).arg(positions);
        b.arg(&n32).arg(&d32).arg(&vocab).arg(&npos).arg(&run_rows);
        // SAFETY: a thread per (run q < runs, column c < d); dout read at i*d + c, i < n; run
        // q's dwte/dwpe (vocab·d and npos·d floats from q·vocab·d, q·npos·d: runs copies each)
        // touched at t*d + c, p*d + c only for t < vocab, p < npos, or at c when that table has
        // a row.
        unsafe { b.launch(cfg(self.runs * d)) }?;
        Ok(())
    }

    /// The sum of squares runs in one thread in column order.
    fn rmsnorm(
        &self,
        x: &CudaSlice<f32>,
        g: &CudaSlice<f32>,
        n: usize,
        d: usize,
    ) -> OpResult<(CudaSlice<f32>, CudaSlice<f32>)> {
        let op = "rmsnorm_forward";
        let nd = checked(n, d, op, "n x d")?;
        // Allocated here at n x d and n: only the inputs' lengths need checking.
        let (mut out, mut rstd) = (self.output(nd)?, self.output(n)?);
        need(op, "x", x.len(), nd)?;
        need(op, "g", g.len(), self.runs * d)?;
        let (n32, d32) = (dim(op, "n", n)?, dim(op, "d", d)?);
        let run_rows = dim(op, "run rows", self.run_rows(op, n)?)?;
        if n > 0 {
            // The CPU divides by `d as f32` and adds the crate's epsilon: the same FP32 values.
            let (d_f, eps) = (d as f32, RMSNORM_EPS);
            let mut b = self.stream.launch_builder(&self.k.rmsnorm);
            b.arg(&mut out).arg(&mut rstd).arg(x).arg(g);
            b.arg(&n32).arg(&d32).arg(&d_f).arg(&eps).arg(&run_rows);
            // SAFETY: a warp per row r < n: x and out are touched at r*d + c, c < d (n*d
            // elements each: x checked, out allocated so), rstd at r < n (allocated so), g at
            // (r / run_rows)*d + c < runs*d (checked).
            unsafe { b.launch(cfg_warps(n)) }?;
        }
        Ok((out, rstd))
    }

    /// A warp per row with the row's sum in one lane, then a block per (run, 32 columns) whose
    /// first warp sums each column over rows in order, a lane per column.
    fn rmsnorm_backward(
        &self,
        dx: &mut CudaSlice<f32>,
        dg: &mut CudaSlice<f32>,
        dy: &CudaSlice<f32>,
        x: &CudaSlice<f32>,
        g: &CudaSlice<f32>,
        rstd: &CudaSlice<f32>,
        n: usize,
        d: usize,
    ) -> OpResult<()> {
        let op = "rmsnorm_backward";
        let nd = checked(n, d, op, "n x d")?;
        need(op, "dx", dx.len(), nd)?;
        need(op, "dout", dy.len(), nd)?;
        need(op, "x", x.len(), nd)?;
        need(op, "dg", dg.len(), self.runs * d)?;
        need(op, "g", g.len(), self.runs * d)?;
        need(op, "rstd", rstd.len(), n)?;
        let (n32, d32) = (dim(op, "n", n)?, dim(op, "d", d)?);
        let run_rows = dim(op, "run rows", self.run_rows(op, n)?)?;
        if nd == 0 {
            return Ok(());
        }
        let d_f = d as f32;
        let mut b = self.stream.launch_builder(&self.k.rmsnorm_dx);
        b.arg(&mut *dx).arg(dy).arg(x).arg(g).arg(rstd);
        b.arg(&n32).arg(&d32).arg(&d_f).arg(&run_rows);
        // SAFETY: a warp per row r < n: dx, dout, x at r*d + c, c < d (n*d each, checked), g at
        // (r / run_rows)*d + c < runs*d, rstd at r < n.
        unsafe { b.launch(cfg_warps(n)) }?;
        let mut b = self.stream.launch_builder(&self.k.rmsnorm_dg);
        b.arg(dg)
            .arg(dy)
            .arg(x)
            .arg(rstd)
            .arg(&n32)
            .arg(&d32)
            .arg(&run_rows);
        // SAFETY: a block of 256 threads per (run q, 32 columns), q < n / run_rows = runs (dg
        // holds runs*d); columns c < d only: dout and x read at r*d + c, rstd at r, for run q's
        // rows r < n.
        unsafe { b.launch(cfg_blocks(self.runs * d.div_ceil(32))) }?;
        Ok(())
    }

    fn add_into(&self, dst: &mut CudaSlice<f32>, src: &CudaSlice<f32>, n: usize) -> OpResult<()> {
        let op = "add_into";
        need(op, "dst", dst.len(), n)?;
        need(op, "src", src.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        let len64 = n as u64;
        let mut b = self.stream.launch_builder(&self.k.add_into);
        b.arg(dst).arg(src).arg(&len64);
        // SAFETY: indices below n <= dst.len(), src.len().
        unsafe { b.launch(cfg(n)) }?;
        Ok(())
    }

    /// Within an ulp or two of the CPU (the GPU's `expf`).
    fn swiglu(&self, x: &CudaSlice<f32>, n: usize, f: usize) -> OpResult<CudaSlice<f32>> {
        let op = "swiglu_forward";
        let nf = checked(n, f, op, "n x f")?;
        let mut out = self.output(nf)?;
        need(op, "inp", x.len(), checked(nf, 2, op, "n x 2f")?)?;
        let (n32, f32_) = (dim(op, "n", n)?, dim(op, "f", f)?);
        if nf > 0 {
            let mut b = self.stream.launch_builder(&self.k.swiglu);
            b.arg(&mut out).arg(x).arg(&n32).arg(&f32_);
            // SAFETY: element idx < n*f, the length `out` was allocated with; reads at i*2f + c and i*2f + f + c with
            // i < n, c < f stay below n*2f <= x.len().
            unsafe { b.launch(cfg(nf)) }?;
        }
        Ok(out)
    }

    /// Within an ulp or two of the CPU (`expf`).
    fn swiglu_backward(
        &self,
        dy: &CudaSlice<f32>,
        x: &CudaSlice<f32>,
        n: usize,
        f: usize,
    ) -> OpResult<CudaSlice<f32>> {
        let op = "swiglu_backward";
        let mut dx = self.zeros_f(n * 2 * f)?;
        let nf = checked(n, f, op, "n x f")?;
        let n2f = checked(nf, 2, op, "n x 2f")?;
        need(op, "dinp", dx.len(), n2f)?;
        need(op, "inp", x.len(), n2f)?;
        need(op, "dout", dy.len(), nf)?;
        let (n32, f32_) = (dim(op, "n", n)?, dim(op, "f", f)?);
        if nf > 0 {
            let mut b = self.stream.launch_builder(&self.k.swiglu_backward);
            b.arg(&mut dx).arg(dy).arg(x).arg(&n32).arg(&f32_);
            // SAFETY: element idx < n*f reads dy[idx] (n*f) and touches dx/x at i*2f + c and
            // i*2f + f + c, i < n, c < f: below n*2f (checked).
            unsafe { b.launch(cfg(nf)) }?;
        }
        Ok(dx)
    }

    fn attention(
        &self,
        qkv: &CudaSlice<f32>,
        rows: &GpuRows,
        h: usize,
        d: usize,
    ) -> OpResult<(CudaSlice<f32>, CudaSlice<f32>)> {
        let dl = &rows.layout;
        let outs = (
            self.output(dl.rows * d)?,
            self.output(dl.rows * h * dl.max_context)?,
        );
        self.attend(outs, qkv, (qkv, dl.rows), dl, h, d)
    }

    /// dP = dO·Vᵀ, dS = P∘(dP − rowsum(P∘dP))/√Dh, dQ = dS·K, dK = dSᵀ·Q, dV = Pᵀ·dO, with the
    /// CPU's `dot` and its sums in its order.
    fn attention_backward(
        &self,
        dy: &CudaSlice<f32>,
        qkv: &CudaSlice<f32>,
        probs: &CudaSlice<f32>,
        rows: &GpuRows,
        h: usize,
        d: usize,
    ) -> OpResult<CudaSlice<f32>> {
        let groups = rows
            .groups
            .as_ref()
            .ok_or_else(|| OpError::Shape("attention backward over decode rows".into()))?;
        let (op, layout) = ("attention_backward", &rows.layout);
        let mut dqkv = self.zeros_f(layout.rows * 3 * d)?;
        if h == 0 || !d.is_multiple_of(h) {
            return Err(shape(format!("{op}: d = {d} is not a multiple of h = {h}")).into());
        }
        let (n, s) = layout.check(op)?;
        let group_rows = groups.first.len().min(groups.end.len());
        need(op, "group rows", group_rows, n)?;
        let nd = checked(n, d, op, "n x d")?;
        let n3d = checked(nd, 3, op, "n x 3d")?;
        need(op, "dqkv", dqkv.len(), n3d)?;
        need(op, "qkv", qkv.len(), n3d)?;
        need(op, "dout", dy.len(), nd)?;
        let nh = checked(n, h, op, "n x h")?;
        let nhs = checked(nh, s, op, "n x h x S")?;
        need(op, "probs", probs.len(), nhs)?;
        let (n32, h32, d32, s32) = (
            dim(op, "rows", n)?,
            dim(op, "h", h)?,
            dim(op, "d", d)?,
            dim(op, "S", s)?,
        );
        if nh == 0 || d == 0 || s == 0 {
            return Ok(dqkv);
        }
        let scale: f32 = 1.0 / ((d / h) as f32).sqrt();
        let mut ds = self.stream.alloc_zeros::<f32>(nhs)?;
        let mut b = self.stream.launch_builder(&self.k.attention_dq);
        b.arg(&mut dqkv).arg(&mut ds).arg(dy).arg(qkv).arg(probs);
        b.arg(&layout.ctx_len).arg(&layout.ctx_keys);
        b.arg(&n32).arg(&h32).arg(&d32).arg(&s32).arg(&scale);
        // SAFETY: a warp per (row i < n, head): ds and probs at (i*h + head)*S + j, j < S
        // (n*h*S each); ctx_keys at i*S + j; qkv read at key rows < n only; dout at i*d + ..
        // and dqkv at i*3d + .. within n*d and n*3d (checked).
        unsafe { b.launch(cfg_warps(nh)) }?;
        let mut b = self.stream.launch_builder(&self.k.attention_dkv);
        b.arg(&mut dqkv).arg(&ds).arg(dy).arg(qkv).arg(probs);
        b.arg(&layout.ctx_len).arg(&layout.ctx_keys);
        b.arg(&groups.first).arg(&groups.end);
        b.arg(&n32).arg(&h32).arg(&d32).arg(&s32);
        // SAFETY: a warp per (key row k < n, head): group rows i < min(end, n); ctx_keys at
        // i*S + j, j < S; ds/probs at (i*h + head)*S + j; qkv, dout, dqkv at rows i, k < n
        // within n*3d, n*d (checked); group_first/end hold n entries (checked).
        unsafe { b.launch(cfg_warps(nh)) }?;
        Ok(dqkv)
    }

    fn linear(
        &self,
        plan: &[SitePlan],
        x: &CudaSlice<f32>,
        n: usize,
        w: &DeviceWeight,
    ) -> OpResult<(CudaSlice<f32>, GpuLin)> {
        self.linear_counted(plan, x, self.run_rows("linear", n)?, w)
    }

    fn linear_backward(
        &self,
        plan: &[SitePlan],
        c: &GpuLin,
        w: &DeviceWeight,
        dy: &CudaSlice<f32>,
        dx: Option<&mut CudaSlice<f32>>,
        dw: &mut CudaSlice<f32>,
    ) -> OpResult<()> {
        Ok(self
            .lin
            .backward(self.site_plans(plan)?, &c.cache, w, dy, dx, dw)?)
    }

    fn experts_linear(
        &self,
        plan: &[SitePlan],
        x: &CudaSlice<f32>,
        disp: &GpuDispatch,
        w: &DeviceWeight,
    ) -> OpResult<(CudaSlice<f32>, GpuLin)> {
        self.linear_counted(plan, x, disp.cap, w)
    }

    fn experts_linear_backward(
        &self,
        plan: &[SitePlan],
        c: &GpuLin,
        w: &DeviceWeight,
        dy: &CudaSlice<f32>,
        dx: &mut CudaSlice<f32>,
        dw: &mut CudaSlice<f32>,
    ) -> OpResult<()> {
        Ok(self
            .lin
            .backward(self.site_plans(plan)?, &c.cache, w, dy, Some(dx), dw)?)
    }

    fn apply(
        &self,
        plan: &[SitePlan],
        x: &CudaSlice<f32>,
        n: usize,
        w: &DeviceWeight,
    ) -> OpResult<CudaSlice<f32>> {
        let rows = self.run_rows("linear", n)?;
        Ok(self.lin.apply(self.site_plans(plan)?, x, rows, w)?)
    }

    fn apply_experts(
        &self,
        plan: &[SitePlan],
        x: &CudaSlice<f32>,
        disp: &GpuDispatch,
        w: &DeviceWeight,
    ) -> OpResult<CudaSlice<f32>> {
        Ok(self.lin.apply(self.site_plans(plan)?, x, disp.cap, w)?)
    }

    /// Site-major, each site's runs in order (`model::pass::quant_stats`).
    fn counts(&self, sites: &[SiteCounts<'_, Self>]) -> OpResult<Vec<QuantStats>> {
        let (s, per) = (&self.stream, 3 * self.runs);
        // Every site's counts gathered on the device: one copy back.
        let mut all = s
            .alloc_zeros::<u64>((per * sites.len()).max(1))
            .map_err(CudaError::from)?;
        for (i, site) in sites.iter().enumerate() {
            let c = match site {
                SiteCounts::One(c) | SiteCounts::Experts(c) => &c.counts,
            };
            need("counts", "site counts", c.len(), per)?;
            s.memcpy_dtod(&c.slice(..per), &mut all.slice_mut(per * i..per * (i + 1)))
                .map_err(CudaError::from)?;
        }
        let all = s.clone_dtoh(&all).map_err(CudaError::from)?;
        Ok(all
            .chunks_exact(3)
            .take(sites.len() * self.runs)
            .map(|v| QuantStats {
                elements: v[0],
                saturated: v[1],
                underflowed: v[2],
            })
            .collect())
    }

    /// Ties go to the lower expert, as `select_top_k`; the weights are p[id] / Σ p[ids] in the
    /// CPU's order. A replayed id >= e gives NaN weights. The softmax probabilities are not kept
    /// (no backward reads them).
    fn route(
        &self,
        logits: &CudaSlice<f32>,
        n: usize,
        e: usize,
        k: usize,
        replay: Option<&[u32]>,
    ) -> OpResult<(CudaSlice<u32>, CudaSlice<f32>)> {
        let (op, s) = ("router_forward", &self.stream);
        if k == 0 || k > e {
            return Err(shape(format!("{op}: top-k {k} of {e} experts")).into());
        }
        let (ne, nk) = (checked(n, e, op, "n x e")?, checked(n, k, op, "n x k")?);
        need(op, "logits", logits.len(), ne)?;
        // Not zeroed: the router writes every row's probabilities, ids and weights.
        // SAFETY: device memory, fully written by the launch below before any read.
        let mut probs = unsafe { s.alloc::<f32>(ne.max(1))? };
        let mut ids = unsafe { s.alloc::<u32>(nk.max(1))? };
        let mut weights = unsafe { s.alloc::<f32>(nk.max(1))? };
        let replay = replay.map(|r| s.clone_htod(r)).transpose()?;
        if let Some(r) = &replay {
            need(op, "replay", r.len(), nk)?;
        }
        let (n32, e32, k32) = (dim(op, "n", n)?, dim(op, "e", e)?, dim(op, "k", k)?);
        if n > 0 {
            let f = match &replay {
                Some(_) => &self.k.router_replay,
                None => &self.k.router_topk,
            };
            let mut b = s.launch_builder(f);
            b.arg(&mut probs)
                .arg(&mut ids)
                .arg(&mut weights)
                .arg(logits);
            if let Some(r) = &replay {
                b.arg(r);
            }
            b.arg(&n32).arg(&e32).arg(&k32);
            // SAFETY: a thread per row r < n: probs and logits at r*e + i, i < e (n*e each: probs
            // allocated so, logits checked); ids, weights and replay at r*k + j, j < k (n*k each,
            // likewise); p is indexed by an id only if < e.
            unsafe { b.launch(cfg(n)) }?;
        }
        Ok((ids, weights))
    }

    /// A row with an id >= e is NaN rather than a write outside it.
    fn route_backward(
        &self,
        dweights: &CudaSlice<f32>,
        ids: &CudaSlice<u32>,
        weights: &CudaSlice<f32>,
        n: usize,
        e: usize,
        k: usize,
    ) -> OpResult<CudaSlice<f32>> {
        let op = "router_backward";
        if k == 0 || k > e {
            return Err(shape(format!("{op}: top-k {k} of {e} experts")).into());
        }
        let nk = checked(n, k, op, "n x k")?;
        let mut dlogits = self.zeros_f(checked(n, e, op, "n x e")?)?;
        need(op, "dweights", dweights.len(), nk)?;
        need(op, "ids", ids.len(), nk)?;
        need(op, "weights", weights.len(), nk)?;
        let (n32, e32, k32) = (dim(op, "n", n)?, dim(op, "e", e)?, dim(op, "k", k)?);
        if n > 0 {
            let mut b = self.stream.launch_builder(&self.k.router_backward);
            b.arg(&mut dlogits).arg(dweights).arg(ids).arg(weights);
            b.arg(&n32).arg(&e32).arg(&k32);
            // SAFETY: a thread per row r < n reads dweights/ids/weights at r*k + j, j < k (n*k
            // each) and writes dlogits at r*e + id only for id < e (else r*e + c, c < e): below
            // n*e.
            unsafe { b.launch(cfg(n)) }?;
        }
        Ok(dlogits)
    }

    fn dispatch(
        &self,
        ids: &CudaSlice<u32>,
        n: usize,
        k: usize,
        e: usize,
    ) -> OpResult<GpuDispatch> {
        // A token names distinct experts (`Routing::check`), so no expert gets more than a run's
        // rows.
        let run_rows = self.run_rows("dispatch", n)?;
        let cap = if self.runs < 2 || run_rows < COUNT_FROM_RUN_ROWS {
            run_rows.next_multiple_of(CAP_MULTIPLE)
        } else {
            let busiest = self
                .batch
                .largest_count(&self.stream, ids, (n, k, e), self.runs)?;
            busiest.next_multiple_of(CAP_MULTIPLE).max(CAP_MULTIPLE)
        };
        let slots = self
            .batch
            .route(&self.stream, ids, (n, k, e), cap, self.runs)?;
        Ok(GpuDispatch {
            slot_row: slots.slot_row,
            src_row: slots.src_row,
            cap,
            e: e * self.runs,
            n,
        })
    }

    fn dispatch_rows(&self, d: &GpuDispatch) -> usize {
        d.e * d.cap
    }

    fn gather(&self, x: &CudaSlice<f32>, disp: &GpuDispatch, d: usize) -> OpResult<CudaSlice<f32>> {
        let rows = disp.e * disp.cap;
        let mut xe = self.output(rows * d)?;
        self.batch
            .gather(&self.stream, &mut xe, x, &disp.src_row, rows, d, disp.n)?;
        Ok(xe)
    }

    /// out[t] = shared[t], then for t's k slots s = t*k + j in ascending (expert id, j) order
    /// (the CPU's loop over experts and their slot lists) out[t] += weights[s] ·
    /// experts[slot_row[s]], then out[t] += x[t]. A slot row past the batch gives NaN.
    fn combine(
        &self,
        x: &CudaSlice<f32>,
        shared: &CudaSlice<f32>,
        experts: &CudaSlice<f32>,
        ids: &CudaSlice<u32>,
        disp: &GpuDispatch,
        weights: &CudaSlice<f32>,
        (n, k, d): (usize, usize, usize),
    ) -> OpResult<CudaSlice<f32>> {
        let (op, slot_row) = ("moe_combine", &disp.slot_row);
        if d == 0 {
            return Err(shape(format!("{op}: d = 0")).into());
        }
        let (nd, nk) = (checked(n, d, op, "n x d")?, checked(n, k, op, "n x k")?);
        let mut out = self.output(nd)?;
        need(op, "shared_y", shared.len(), nd)?;
        need(op, "x", x.len(), nd)?;
        need(op, "slot_row", slot_row.len(), nk)?;
        need(op, "ids", ids.len(), nk)?;
        need(op, "weights", weights.len(), nk)?;
        let (n32, k32, d32) = (dim(op, "n", n)?, dim(op, "k", k)?, dim(op, "d", d)?);
        let y_rows = dim(op, "y_all rows", experts.len() / d)?;
        if nd > 0 {
            let mut b = self.stream.launch_builder(&self.k.moe_combine);
            b.arg(&mut out).arg(shared).arg(experts).arg(slot_row);
            b.arg(ids).arg(weights).arg(x);
            b.arg(&n32).arg(&k32).arg(&d32).arg(&y_rows);
            // SAFETY: element idx = t*d + c < n*d (`out`'s allocated length; shared, x); slots t*k + j < n*k (ids,
            // weights, slot_row); experts read at row*d + c only for row < experts.len()/d.
            unsafe { b.launch(cfg(nd)) }?;
        }
        Ok(out)
    }

    fn combine_backward(
        &self,
        dh: &CudaSlice<f32>,
        experts: &CudaSlice<f32>,
        disp: &GpuDispatch,
        weights: &CudaSlice<f32>,
        (n, k, d): (usize, usize, usize),
    ) -> OpResult<(CudaSlice<f32>, CudaSlice<f32>)> {
        let rows = disp.e * disp.cap;
        let (mut dy, mut dgate) = (self.zeros_f(rows * d)?, self.zeros_f(n * k)?);
        if n * k > 0 {
            let op = "moe backward";
            let (nk32, k32, d32, rows32) = (
                dim(op, "slots", n * k)?,
                dim(op, "k", k)?,
                dim(op, "d", d)?,
                dim(op, "rows", rows)?,
            );
            let mut b = self.stream.launch_builder(&self.k.expert_dy);
            b.arg(&mut dy).arg(&mut dgate).arg(dh).arg(experts);
            b.arg(&disp.slot_row).arg(weights);
            b.arg(&nk32).arg(&k32).arg(&d32).arg(&rows32);
            // SAFETY: a warp per slot s < n·k (slot_row, weights, dgate hold n·k); dh read at
            // row s/k < n (n·d); experts and dy at batch rows < rows only (rows·d each).
            unsafe { b.launch(cfg_warps(n * k)) }.map_err(CudaError::from)?;
        }
        Ok((dy, dgate))
    }

    fn scatter_add(
        &self,
        dx: &mut CudaSlice<f32>,
        dexperts: &CudaSlice<f32>,
        ids: &CudaSlice<u32>,
        disp: &GpuDispatch,
        (n, k, d): (usize, usize, usize),
    ) -> OpResult<()> {
        if n * d == 0 {
            return Ok(());
        }
        let op = "moe backward";
        let rows = disp.e * disp.cap;
        let (n32, k32, d32, rows32) = (
            dim(op, "n", n)?,
            dim(op, "k", k)?,
            dim(op, "d", d)?,
            dim(op, "rows", rows)?,
        );
        let mut b = self.stream.launch_builder(&self.k.expert_dx_scatter);
        b.arg(dx).arg(dexperts).arg(&disp.slot_row).arg(ids);
        b.arg(&n32).arg(&k32).arg(&d32).arg(&rows32);
        // SAFETY: a thread per (t < n, c < d): dx at t·d + c (n·d); ids and slot_row at
        // t·k + j (n·k); dexperts at batch rows < rows only (rows·d).
        unsafe { b.launch(cfg(n * d)) }.map_err(CudaError::from)?;
        Ok(())
    }

    fn kv_cache(
        &self,
        layers: usize,
        seqs: usize,
        positions: usize,
        d: usize,
        _h: usize,
    ) -> OpResult<DeviceKvCache> {
        let width = 3 * d;
        let layers = (0..layers)
            .map(|_| self.zeros_f(seqs * positions * width))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(DeviceKvCache {
            layers,
            seqs,
            capacity: positions,
            len: 0,
            width,
        })
    }

    fn kv_len(&self, kv: &DeviceKvCache) -> usize {
        kv.len
    }

    fn kv_seqs(&self, kv: &DeviceKvCache) -> usize {
        kv.seqs
    }

    fn decode_rows(&self, kv: &DeviceKvCache, count: usize) -> OpResult<GpuRows> {
        if kv.len + count > kv.capacity {
            return Err(OpError::Shape(format!(
                "decode: {count} positions past the {} filled of {}",
                kv.len, kv.capacity
            )));
        }
        let layout = DeviceLayout::decode_rows(&self.stream, kv.seqs, kv.capacity, kv.len, count)?;
        Ok(GpuRows {
            layout,
            groups: None,
        })
    }

    /// Keys and values are stored BF16-rounded (as `model::KvCache` does); the queries stay
    /// unrounded.
    fn kv_attend(
        &self,
        kv: &mut DeviceKvCache,
        l: usize,
        qkv: &CudaSlice<f32>,
        rows: &GpuRows,
        h: usize,
        d: usize,
        count: usize,
    ) -> OpResult<CudaSlice<f32>> {
        let (seqs, cap, pos) = (kv.seqs, kv.capacity, kv.len);
        let n = seqs * count;
        let mut rounded = self.output(n * 3 * d)?;
        self.lin
            .fake_quantizer()
            .round_bf16(qkv, &mut rounded, n * 3 * d)?;
        self.store_kv(&rounded, &mut kv.layers[l], (seqs, count), cap, pos, 3 * d)?;
        let dl = &rows.layout;
        let outs = (self.output(n * d)?, self.output(n * h * dl.max_context)?);
        let (att, _) = self.attend(outs, qkv, (&kv.layers[l], seqs * cap), dl, h, d)?;
        Ok(att)
    }

    fn kv_advance(&self, kv: &mut DeviceKvCache, count: usize) {
        kv.len += count;
    }

    fn kv_repeat_each(&self, kv: &mut DeviceKvCache, samples: usize) -> OpResult<()> {
        let (seqs, cap, w) = (kv.seqs * samples, kv.capacity, kv.width);
        let src_row: Vec<u32> = (0..seqs * cap)
            .map(|r| ((r / cap) / samples * cap + r % cap) as u32)
            .collect();
        let src_row = self.stream.clone_htod(&src_row).map_err(CudaError::from)?;
        for layer in &mut kv.layers {
            let mut out = self.zeros_f(seqs * cap * w)?;
            self.batch.gather(
                &self.stream,
                &mut out,
                &*layer,
                &src_row,
                seqs * cap,
                w,
                kv.seqs * cap,
            )?;
            *layer = out;
        }
        kv.seqs = seqs;
        Ok(())
    }
}

impl GpuOps {
    /// Causal attention of the queries in `q`'s Q columns over keys and values in the K and V
    /// columns of `kv` (`[kv_rows, 3d]`: the rows' own qkv, or a decoder's cache), which
    /// `layout`'s key indices address; writes `outs` (`[rows, d]`, probs `[rows, h, S]`, zero past
    /// each row's context). Scores use the CPU's `dot` order and the softmax its sums
    /// (`ops::attention_forward`, `ops::attention_step`), so only `expf` separates it from the
    /// CPU (tolerance).
    fn attend(
        &self,
        (mut out, mut probs): (CudaSlice<f32>, CudaSlice<f32>),
        q: &CudaSlice<f32>,
        (kv, kv_rows): (&CudaSlice<f32>, usize),
        layout: &DeviceLayout,
        h: usize,
        d: usize,
    ) -> OpResult<(CudaSlice<f32>, CudaSlice<f32>)> {
        let op = "attention_forward";
        if h == 0 || !d.is_multiple_of(h) {
            return Err(shape(format!("{op}: d = {d} is not a multiple of h = {h}")).into());
        }
        let (n, s) = layout.check(op)?;
        let nd = checked(n, d, op, "n x d")?;
        need(op, "out", out.len(), nd)?;
        // Named as the callers know them: the rows' qkv, and a decoder's cache.
        need(op, "qkv", q.len(), checked(nd, 3, op, "n x 3d")?)?;
        let kd = checked(kv_rows, d, op, "kv rows x d")?;
        need(
            op,
            "kv cache",
            kv.len(),
            checked(kd, 3, op, "kv rows x 3d")?,
        )?;
        let nh = checked(n, h, op, "n x h")?;
        need(op, "probs", probs.len(), checked(nh, s, op, "n x h x S")?)?;
        let (n32, nk32, h32, d32, s32) = (
            dim(op, "rows", n)?,
            dim(op, "kv rows", kv_rows)?,
            dim(op, "h", h)?,
            dim(op, "d", d)?,
            dim(op, "S", s)?,
        );
        if nh == 0 || d == 0 {
            return Ok((out, probs));
        }
        // As the CPU computes it: 1 / sqrt(Dh) in FP32.
        let scale: f32 = 1.0 / ((d / h) as f32).sqrt();
        let mut b = self.stream.launch_builder(&self.k.attention);
        b.arg(&mut out).arg(&mut probs).arg(q).arg(kv);
        b.arg(&layout.ctx_len).arg(&layout.ctx_keys);
        b.arg(&n32).arg(&nk32).arg(&h32).arg(&d32).arg(&s32);
        b.arg(&scale);
        // SAFETY: a warp per (row i < n, head < h): probs row (i*h + head)*S .. +S is inside
        // n*h*S; keys j < min(ctx_len[i], S) are read at i*S + j < n*S = ctx_keys.len(); q is
        // read at row i < n (q holds n*3d); a key row is used only if < kv_rows, so kv reads stay
        // below kv_rows*3d (checked); out at i*d + head*dh + c, c < dh.
        unsafe { b.launch(cfg_warps(nh)) }?;
        Ok((out, probs))
    }

    /// Cache row `i · capacity + pos + j` = x row `i · per_seq + j`, for each of `seqs`
    /// sequences and `j < per_seq` (rows of `width` floats; x sequence-major).
    fn store_kv(
        &self,
        x: &CudaSlice<f32>,
        cache: &mut CudaSlice<f32>,
        (seqs, per_seq): (usize, usize),
        capacity: usize,
        pos: usize,
        width: usize,
    ) -> Result<(), CudaError> {
        let n = seqs * per_seq;
        if pos + per_seq > capacity || cache.len() < seqs * capacity * width || x.len() < n * width
        {
            return Err(CudaError::Shape(format!(
                "kv_store: positions {pos}..{} of {capacity}, {seqs} sequences of {width}: cache \
                 holds {}, rows {}",
                pos + per_seq,
                cache.len(),
                x.len()
            )));
        }
        if n * width == 0 {
            return Ok(());
        }
        let op = "kv_store";
        let (n32, cap32, pos32, w32, per32) = (
            dim(op, "rows", n)?,
            dim(op, "capacity", capacity)?,
            dim(op, "position", pos)?,
            dim(op, "width", width)?,
            dim(op, "positions per sequence", per_seq)?,
        );
        let mut b = self.stream.launch_builder(&self.k.kv_store);
        b.arg(cache)
            .arg(x)
            .arg(&n32)
            .arg(&cap32)
            .arg(&pos32)
            .arg(&w32)
            .arg(&per32);
        // SAFETY: element idx < n·width reads x[idx] (x holds n·width) and writes cache at
        // (i·capacity + pos + j)·width + c < seqs·capacity·width (pos + per_seq ≤ capacity,
        // checked above).
        unsafe { b.launch(LaunchConfig::for_num_elems((n * width).min(1 << 20) as u32)) }?;
        Ok(())
    }
}

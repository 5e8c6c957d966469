//! Several runs stepped at once on one GPU: [`CudaBackend`]'s `*_batch` calls. The runs of a
//! batch share the model's shape and run as ONE pass of `model::pass` over an op set stepping
//! them together ([`GpuOps::set_runs`]): their models stacked on the device
//! ([`GpuOps::upload_models`]), each run's rows a block of every tensor, one launch per op for
//! all of them, every GEMM one strided batched GEMM (the routed experts: runs · E blocks). Runs
//! of different precision plans share that pass: only a site's quantizers depend on the plan,
//! and they run once per group of consecutive runs of one plan (`engine::linear::forward_on`);
//! a batch of one run is the single-run pass (`ResidentPass`, `ResidentDecoder`, the cached
//! reference upload).
//!
//! What a run computes does not depend on its neighbours: every op is per row or per run
//! (norm gains, embedding tables and weights are the run's own; the expert batch, each
//! quantization with a per-tensor scale and each count are per run). A training forward pads
//! each run's rows up to the longest run's with rows that embed to zeros and attend only to
//! themselves: a zero row changes no amax and so no code (the argument that already lets the
//! expert batch pad to its capacity), and gets zero gradient. The GEMMs see other shapes than a
//! run alone, so a run's numbers equal its numbers alone to cuBLAS's summation order (the
//! tolerance `tests/cuda_train.rs` states), and repeat bit for bit for one batch composition.

use super::CudaBackend;
use super::CudaError;
use super::decoder::per_position;
use super::device_ops::{DeviceKvCache, GpuOps, GpuRows};
use super::held::ExportStack;
use super::launch::{DeviceGroups, DeviceLayout};
use crate::engine::backend::{
    Backend, BatchDecoder, Counts, ForwardItem, HeldExport, HeldItem, LoopBatch, LoopDecoder,
    TrainBatch,
};
use crate::engine::device::{OpError, Ops};
use crate::engine::layout::Layout;
use crate::engine::model::pass::{self, Cache, RunPlans, Weights};
use crate::engine::model::{Params, PreparedModel, Routing, check_layout_inputs, quant_sites};
use crate::formats::QuantStats;
use std::sync::{Arc, OnceLock};

/// A token id the embedding turns into a zero row (`PAD_ROW` in the kernels' prelude).
const PAD_ROW: u32 = u32::MAX;

/// Indices of `items` grouped by `same` (an equivalence), groups in order of first appearance
/// and each in item order.
pub(super) fn groups_of<T>(items: &[T], same: impl Fn(&T, &T) -> bool) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for (i, it) in items.iter().enumerate() {
        match groups.iter_mut().find(|g| same(&items[g[0]], it)) {
            Some(g) => g.push(i),
            None => groups.push(vec![i]),
        }
    }
    groups
}

/// What a joint pass reads of one run's input: its rows and the routing it replays.
pub(super) trait RowSource {
    fn tokens(&self) -> &[u32];
    fn layout(&self) -> &Layout;
    fn replay(&self) -> Option<&Routing>;
}

impl RowSource for ForwardItem<'_> {
    fn tokens(&self) -> &[u32] {
        self.tokens
    }
    fn layout(&self) -> &Layout {
        self.layout
    }
    fn replay(&self) -> Option<&Routing> {
        self.replay
    }
}

impl RowSource for HeldItem<'_> {
    fn tokens(&self) -> &[u32] {
        self.tokens
    }
    fn layout(&self) -> &Layout {
        self.layout
    }
    fn replay(&self) -> Option<&Routing> {
        self.replay
    }
}

/// The rows of several runs' forwards as one: run m's layout rows at `m · cap ..`, then
/// padding rows (position 0, attending to themselves alone) up to `cap`, the longest run's rows.
pub(super) struct JointRows {
    pub(super) cap: usize,
    /// Each run's own rows.
    pub(super) rows: Vec<usize>,
    tokens: Vec<u32>,
    positions: Vec<u32>,
    ctx_len: Vec<u32>,
    ctx_keys: Vec<u32>,
    max_context: usize,
    group_first: Vec<u32>,
    group_end: Vec<u32>,
}

impl JointRows {
    pub(super) fn new<I: RowSource>(items: &[&I]) -> JointRows {
        let cap = items
            .iter()
            .map(|i| i.layout().rows())
            .max()
            .unwrap_or(0)
            .max(1);
        let s = items
            .iter()
            .map(|i| i.layout().max_context())
            .max()
            .unwrap_or(1)
            .max(1);
        let n = cap * items.len();
        let mut j = JointRows {
            cap,
            rows: items.iter().map(|i| i.layout().rows()).collect(),
            tokens: vec![PAD_ROW; n],
            positions: vec![0; n],
            ctx_len: vec![1; n],
            ctx_keys: vec![0; n * s],
            max_context: s,
            group_first: (0..n as u32).collect(),
            group_end: (1..=n as u32).collect(),
        };
        for (m, it) in items.iter().enumerate() {
            let (base, l) = (m * cap, it.layout());
            j.tokens[base..base + l.rows()].copy_from_slice(it.tokens());
            for (r, p) in l.positions().into_iter().enumerate() {
                j.positions[base + r] = p as u32;
            }
            for r in 0..l.rows() {
                let (len, key) = l.context(r);
                j.ctx_len[base + r] = len as u32;
                for (q, k) in j.ctx_keys[(base + r) * s..][..len].iter_mut().enumerate() {
                    *k = (base + key(q)) as u32;
                }
            }
            for g in 0..l.groups() {
                let gr = l.group_rows(g);
                for r in gr.clone() {
                    j.group_first[base + r] = (base + gr.start) as u32;
                    j.group_end[base + r] = (base + gr.end) as u32;
                }
            }
            // Padding rows attend to themselves.
            for r in l.rows()..cap {
                j.ctx_keys[(base + r) * s] = (base + r) as u32;
            }
        }
        j
    }

    pub(super) fn n(&self) -> usize {
        self.cap * self.rows.len()
    }

    pub(super) fn upload(&self, ops: &GpuOps) -> Result<GpuRows, CudaError> {
        let s = ops.stream();
        let layout = DeviceLayout::from_host(
            s,
            self.max_context,
            &self.positions,
            &self.ctx_len,
            &self.ctx_keys,
        )?;
        let groups = DeviceGroups::from_host(s, &self.group_first, &self.group_end)?;
        Ok(GpuRows::new(layout, Some(groups)))
    }

    /// Every run's replay record in the joint rows (padding rows take experts 0..k), or `None`
    /// when no run replays.
    pub(super) fn replay<I: RowSource>(
        &self,
        items: &[&I],
        k: usize,
        layers: usize,
    ) -> Option<Routing> {
        items.iter().find(|i| i.replay().is_some())?;
        let n = self.n();
        let pad: Vec<u32> = (0..k as u32).collect();
        let layers = (0..layers)
            .map(|l| {
                let mut ids = Vec::with_capacity(n * k);
                for (m, it) in items.iter().enumerate() {
                    let rows = self.rows[m];
                    match it.replay() {
                        Some(r) => ids.extend_from_slice(&r.layers[l][..rows * k]),
                        None => (0..rows).for_each(|_| ids.extend_from_slice(&pad)),
                    }
                    (rows..self.cap).for_each(|_| ids.extend_from_slice(&pad));
                }
                ids
            })
            .collect();
        Some(Routing {
            top_k: k,
            n_tokens: n,
            layers,
        })
    }

    /// Every run's dL/dlogits (`None`: zeros) in the joint rows, `[n, vocab]`; a run's must
    /// cover its own rows.
    pub(super) fn dlogits(
        &self,
        dlogits: &[Option<&[f32]>],
        v: usize,
    ) -> Result<Vec<f32>, OpError> {
        let mut all = vec![0.0f32; self.n() * v];
        for (m, d) in dlogits.iter().enumerate() {
            if let Some(d) = d {
                if d.len() != self.rows[m] * v {
                    return Err(OpError::Shape(format!(
                        "run {m}: dlogits hold {} values for {} rows of {v}",
                        d.len(),
                        self.rows[m]
                    )));
                }
                all[m * self.cap * v..][..d.len()].copy_from_slice(d);
            }
        }
        Ok(all)
    }

    /// Run m's rows of a joint `[n, width]` host tensor.
    pub(super) fn take(&self, all: &[f32], m: usize, width: usize) -> Vec<f32> {
        all[m * self.cap * width..][..self.rows[m] * width].to_vec()
    }
}

fn check_items(items: &[&ForwardItem<'_>]) -> Result<(), OpError> {
    for it in items {
        check_layout_inputs(&it.prep.config, it.tokens, it.layout, it.replay)
            .map_err(|e| OpError::Shape(e.to_string()))?;
    }
    Ok(())
}

impl CudaBackend {
    /// An op set stepping `runs` runs, and `f` run on it; the op set goes back to the pool.
    fn with_runs<T>(
        &self,
        runs: usize,
        f: impl FnOnce(&GpuOps) -> Result<T, OpError>,
    ) -> Result<T, OpError> {
        let mut ops = self.take_ops()?;
        ops.set_runs(runs);
        let out = f(&ops);
        self.give_ops(ops);
        out
    }

    /// [`crate::engine::backend::Backend::forward_logits_batch`]: one pass for every run.
    pub(super) fn forward_logits_runs(
        &self,
        items: &[ForwardItem<'_>],
    ) -> Result<Vec<Vec<f32>>, OpError> {
        // One run: the single pass, whose uploads are cached across steps.
        match items {
            [] => return Ok(Vec::new()),
            [i] => {
                return Ok(vec![
                    self.forward_logits(i.prep, i.tokens, i.layout, i.replay)?,
                ]);
            }
            _ => {}
        }
        let its: Vec<&ForwardItem<'_>> = items.iter().collect();
        check_items(&its)?;
        let cfg = &its[0].prep.config;
        let joint = JointRows::new(&its);
        let logits = self.with_runs(its.len(), |ops| {
            let members: Vec<&PreparedModel> = its.iter().map(|i| i.prep).collect();
            let (key, model) = self.inference_model(ops, &members)?;
            let rows = joint.upload(ops)?;
            let toks = ops.ids(&joint.tokens)?;
            let replay = joint.replay(&its, cfg.top_k, cfg.n_layers);
            let (logits, _) =
                pass::infer_on(ops, &model, &toks, &rows, joint.n(), replay.as_ref())?;
            self.hold_model(key, model);
            Ok(logits)
        })?;
        Ok((0..its.len())
            .map(|m| joint.take(&logits, m, cfg.vocab))
            .collect())
    }

    /// [`crate::engine::backend::Backend::train_forward_batch`]: one pass for every run.
    pub(super) fn train_forward_runs<'a>(
        &'a self,
        items: &[ForwardItem<'a>],
        counts: Counts,
    ) -> Result<Box<dyn TrainBatch + 'a>, OpError> {
        match items {
            [] => return Ok(Box::new(LoopBatch(Vec::new()))),
            [i] => {
                let pass = self.train_forward(i.prep, i.tokens, i.layout, i.replay)?;
                return Ok(Box::new(LoopBatch(vec![pass])));
            }
            _ => {}
        }
        let its: Vec<&ForwardItem<'_>> = items.iter().collect();
        Ok(Box::new(GpuTrainBatch::new(self, &its, counts)?))
    }

    /// [`crate::engine::backend::Backend::decoder_batch`]: one decoder for every run.
    pub(super) fn decoder_runs<'a>(
        &'a self,
        preps: &[&'a PreparedModel],
        seqs: usize,
        positions: usize,
    ) -> Result<Box<dyn BatchDecoder + 'a>, OpError> {
        match preps {
            [] => return Ok(Box::new(LoopDecoder(Vec::new()))),
            [p] => {
                return Ok(Box::new(LoopDecoder(vec![
                    self.decoder(p, seqs, positions)?,
                ])));
            }
            _ => {}
        }
        Ok(Box::new(GroupedDecoder {
            parts: vec![GpuBatchDecoder::new(self, preps, seqs, positions)?],
            groups: vec![(0..preps.len()).collect()],
            members: preps.len(),
        }))
    }
}

impl CudaBackend {
    /// [`crate::engine::backend::Backend::held_decoder_batch`]: one decoder per stack the
    /// exports are members of, reading the stack where it lies when they are all of it in its
    /// order, else a stack of just them gathered on the device (the stack the host would have
    /// uploaded for them: a run decodes as with its state on the host, bit for bit).
    pub(super) fn held_decoder_runs<'a>(
        &'a self,
        exports: &[&'a HeldExport],
        seqs: usize,
        positions: usize,
    ) -> Result<Box<dyn BatchDecoder + 'a>, OpError> {
        let groups = groups_of(exports, |a, b| Arc::ptr_eq(a.stack(), b.stack()));
        let parts = groups
            .iter()
            .map(|g| {
                let stack = exports[g[0]]
                    .stack()
                    .downcast_ref::<ExportStack>()
                    .ok_or_else(|| {
                        OpError::Shape(format!("{}: an export of another device", self.name()))
                    })?;
                let keep: Vec<usize> = g.iter().map(|&i| exports[i].member()).collect();
                let whole = keep.iter().copied().eq(0..stack.runs);
                let model = |ops: &GpuOps| {
                    if whole {
                        Ok(Arc::clone(&stack.model))
                    } else {
                        ops.gather_models(&stack.model, stack.runs, &keep)
                            .map(Arc::new)
                    }
                };
                GpuBatchDecoder::over(self, model, keep.len(), seqs, positions)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Box::new(GroupedDecoder {
            parts,
            groups,
            members: exports.len(),
        }))
    }
}

/// The training forward of `its` over their stacked `model` on `ops` (set to their number of
/// runs): every run's logits in `joint`'s rows, and the cache for the backward.
pub(super) fn forward_members<I: RowSource>(
    ops: &GpuOps,
    model: &Weights<GpuOps>,
    its: &[&I],
    joint: &JointRows,
) -> Result<(Vec<f32>, Cache<GpuOps>), OpError> {
    let cfg = &model.config;
    let rows = joint.upload(ops)?;
    let toks = ops.ids(&joint.tokens)?;
    let replay = joint.replay(its, cfg.top_k, cfg.n_layers);
    let (logits, cache, _) = pass::forward_on(ops, model, toks, rows, joint.n(), replay.as_ref())?;
    Ok((logits, cache))
}

/// Each of `runs` runs' activation counts per quantization site of a batched forward's `cache`
/// (the device counts them site by site, every run's in turn).
pub(super) fn counts_per_run(
    ops: &GpuOps,
    cache: &Cache<GpuOps>,
    runs: usize,
) -> Result<Vec<Vec<(String, QuantStats)>>, OpError> {
    let flat = pass::quant_stats(ops, cache)?;
    let names = quant_sites(cache.n_layers());
    Ok((0..runs)
        .map(|r| {
            names
                .iter()
                .enumerate()
                .map(|(i, n)| (n.clone(), flat[i * runs + r]))
                .collect()
        })
        .collect())
}

/// Median seconds of one batched training pass (forward, logits back, backward) of a batch's
/// runs, two ways: [`TrainPassTimes::with_transfers`] as the trainer runs it (every run's
/// prepared model uploaded first, its gradients downloaded after), and
/// [`TrainPassTimes::on_device`] with both left on the GPU: the floor that keeping the master
/// weights, gradients and optimizer on the device could reach for this pass; and
/// [`TrainPassTimes::prepared_on_device`], that floor plus preparing every run's weights on the
/// GPU from master weights kept there (`GpuOps::prepare_models`): what a minibatch of training
/// state kept on the device costs before its optimizer step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrainPassTimes {
    pub with_transfers: f64,
    pub on_device: f64,
    pub prepared_on_device: f64,
}

impl CudaBackend {
    /// [`TrainPassTimes`] of `items` over `reps` passes each way, with
    /// dL/dlogits `dlogits` (every run's rows, padded as the batch lays them out: see
    /// [`CudaBackend::train_pass_rows`]).
    pub fn train_pass_times(
        &self,
        items: &[ForwardItem<'_>],
        dlogits: &[f32],
        reps: usize,
    ) -> Result<TrainPassTimes, OpError> {
        let its: Vec<&ForwardItem> = items.iter().collect();
        check_items(&its)?;
        let members: Vec<&PreparedModel> = its.iter().map(|i| i.prep).collect();
        let joint = JointRows::new(&its);
        // Counting each run's activations, as the trainer's first forward of a step does.
        self.with_runs(its.len(), |ops| {
            let median = |mut v: Vec<f64>| {
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            };
            let mut with_transfers = Vec::new();
            for _ in 0..reps.max(1) {
                let t0 = std::time::Instant::now();
                let model = ops.upload_models(&members, true)?;
                let (_, cache) = forward_members(ops, &model, &its, &joint)?;
                pass::backward_runs(ops, &model, &cache, dlogits)?;
                with_transfers.push(t0.elapsed().as_secs_f64());
            }
            let model = ops.upload_models(&members, true)?;
            let mut on_device = Vec::new();
            for _ in 0..reps.max(1) {
                let t0 = std::time::Instant::now();
                let (_, cache) = forward_members(ops, &model, &its, &joint)?;
                let grads = pass::backward_on_device(ops, &model, &cache, dlogits)?;
                ops.stream().synchronize().map_err(CudaError::from)?;
                drop(grads);
                on_device.push(t0.elapsed().as_secs_f64());
            }
            // Any weights of the model's shape time the same: fresh ones, a seed a run.
            let params = (0..members.len() as u64)
                .map(|seed| Params::init(&members[0].config, seed))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| OpError::Shape(e.to_string()))?;
            let refs: Vec<&Params> = params.iter().collect();
            let master = ops.upload_params(&refs)?;
            let cfg = &members[0].config;
            let plans = RunPlans::of(members.iter().map(|m| m.plan.clone()).collect());
            let mut prepared = Vec::new();
            for _ in 0..reps.max(1) {
                let t0 = std::time::Instant::now();
                let model = ops.prepare_models(cfg, &plans, &master, members.len())?;
                let (_, cache) = forward_members(ops, &model, &its, &joint)?;
                let grads = pass::backward_on_device(ops, &model, &cache, dlogits)?;
                ops.stream().synchronize().map_err(CudaError::from)?;
                drop(grads);
                prepared.push(t0.elapsed().as_secs_f64());
            }
            Ok(TrainPassTimes {
                with_transfers: median(with_transfers),
                on_device: median(on_device),
                prepared_on_device: median(prepared),
            })
        })
    }

    /// The training pass of `items` (their prepared models give only the plans) with every run's weights prepared on the GPU from `masters` (uploaded stacked, then
    /// `GpuOps::prepare_models`) instead of uploaded from the host: each run's logits and its
    /// gradients for `dlogits` (laid out as [`CudaBackend::train_pass_rows`] says). With
    /// `masters[i]` the parameters `items[i].prep` was prepared from, these are the batched
    /// pass's numbers bit for bit (`tests/cuda_batch.rs`).
    pub fn train_pass_from_masters(
        &self,
        items: &[ForwardItem<'_>],
        masters: &[&Params],
        dlogits: &[f32],
    ) -> Result<(Vec<Vec<f32>>, Vec<Params>), OpError> {
        let its: Vec<&ForwardItem> = items.iter().collect();
        check_items(&its)?;
        if masters.len() != its.len() {
            return Err(OpError::Shape(format!(
                "{} runs and {} master weights",
                its.len(),
                masters.len()
            )));
        }
        let joint = JointRows::new(&its);
        let cfg = &its[0].prep.config;
        let plans = RunPlans::of(its.iter().map(|i| i.prep.plan.clone()).collect());
        self.with_runs(its.len(), |ops| {
            let master = ops.upload_params(masters)?;
            let model = ops.prepare_models(cfg, &plans, &master, its.len())?;
            let (all, cache) = forward_members(ops, &model, &its, &joint)?;
            let grads = pass::backward_runs(ops, &model, &cache, dlogits)?;
            let logits = (0..its.len())
                .map(|m| joint.take(&all, m, cfg.vocab))
                .collect();
            Ok((logits, grads))
        })
    }

    /// Rows of the joint pass of `items` (each run padded to the longest): the length of its
    /// dL/dlogits is this times the vocabulary.
    pub fn train_pass_rows(items: &[ForwardItem<'_>]) -> usize {
        let its: Vec<&ForwardItem> = items.iter().collect();
        JointRows::new(&its).n()
    }
}

/// The training forward of a batch's runs, kept for their backward.
struct GpuTrainBatch<'a> {
    backend: &'a CudaBackend,
    ops: Option<GpuOps>,
    model: Weights<GpuOps>,
    cache: Cache<GpuOps>,
    joint: JointRows,
    vocab: usize,
    logits: Vec<Vec<f32>>,
    counts: Counts,
    stats: OnceLock<Vec<Vec<(String, QuantStats)>>>,
}

impl<'a> GpuTrainBatch<'a> {
    fn new(
        backend: &'a CudaBackend,
        its: &[&ForwardItem<'_>],
        counts: Counts,
    ) -> Result<Self, OpError> {
        check_items(its)?;
        let cfg = its[0].prep.config.clone();
        let joint = JointRows::new(its);
        let mut ops = backend.take_ops()?;
        ops.set_runs(its.len());
        ops.set_run_counts(counts == Counts::Keep);
        let run = |ops: &GpuOps| -> Result<_, OpError> {
            let members: Vec<&PreparedModel> = its.iter().map(|i| i.prep).collect();
            let t0 = std::time::Instant::now();
            let model = ops.upload_models(&members, true)?;
            backend.note_model_uploads(t0, members.len());
            let (logits, cache) = forward_members(ops, &model, its, &joint)?;
            Ok((model, logits, cache))
        };
        match run(&ops) {
            Ok((model, all, cache)) => {
                let logits = (0..its.len())
                    .map(|m| joint.take(&all, m, cfg.vocab))
                    .collect();
                Ok(GpuTrainBatch {
                    backend,
                    ops: Some(ops),
                    model,
                    cache,
                    joint,
                    vocab: cfg.vocab,
                    logits,
                    counts,
                    stats: OnceLock::new(),
                })
            }
            Err(e) => {
                backend.give_ops(ops);
                Err(e)
            }
        }
    }

    fn ops(&self) -> &GpuOps {
        self.ops.as_ref().expect("held until drop")
    }

    /// GPU failures cannot be returned through the trait: they panic with the device, which
    /// the suite runner turns into failed runs with that message.
    fn fail(&self, what: &str, e: OpError) -> ! {
        panic!(
            "cuda:{}: batched trainer {what} failed: {e}",
            self.backend.device().ordinal()
        )
    }
}

impl TrainBatch for GpuTrainBatch<'_> {
    fn members(&self) -> usize {
        self.logits.len()
    }

    fn logits(&self, m: usize) -> &[f32] {
        &self.logits[m]
    }

    fn quant_stats(&self, m: usize) -> Vec<(String, QuantStats)> {
        assert_eq!(
            self.counts,
            Counts::Keep,
            "activation counts of a batched training forward made with Counts::Skip"
        );
        self.stats.get_or_init(|| {
            counts_per_run(self.ops(), &self.cache, self.members())
                .unwrap_or_else(|e| self.fail("quantization counts", e))
        })[m]
            .clone()
    }

    fn backward(&self, dlogits: &[Option<&[f32]>]) -> Vec<Option<Params>> {
        let all = self
            .joint
            .dlogits(dlogits, self.vocab)
            .unwrap_or_else(|e| self.fail("backward", e));
        let grads = pass::backward_runs(self.ops(), &self.model, &self.cache, &all)
            .unwrap_or_else(|e| self.fail("backward", e));
        grads
            .into_iter()
            .zip(dlogits)
            .map(|(g, d)| d.map(|_| g))
            .collect()
    }
}

impl Drop for GpuTrainBatch<'_> {
    fn drop(&mut self) {
        if let Some(o) = self.ops.take() {
            self.backend.give_ops(o);
        }
    }
}

/// The decoders of a batch's runs: one KV cache holding every run's sequences in turn.
struct GpuBatchDecoder<'a> {
    backend: &'a CudaBackend,
    ops: Option<GpuOps>,
    model: Arc<Weights<GpuOps>>,
    cache: DeviceKvCache,
    runs: usize,
}

impl<'a> GpuBatchDecoder<'a> {
    /// A decoder of `preps` uploaded as one stack.
    fn new(
        backend: &'a CudaBackend,
        preps: &[&PreparedModel],
        seqs: usize,
        positions: usize,
    ) -> Result<Self, OpError> {
        let t0 = std::time::Instant::now();
        let upload = |ops: &GpuOps| {
            let model = ops.upload_models(preps, false)?;
            backend.note_model_uploads(t0, preps.len());
            Ok(Arc::new(model))
        };
        Self::over(backend, upload, preps.len(), seqs, positions)
    }

    /// A decoder of the stack of `runs` runs' models that `model` gives on the decoder's op set.
    fn over(
        backend: &'a CudaBackend,
        model: impl FnOnce(&GpuOps) -> Result<Arc<Weights<GpuOps>>, CudaError>,
        runs: usize,
        seqs: usize,
        positions: usize,
    ) -> Result<Self, OpError> {
        let mut ops = backend.take_ops()?;
        ops.set_runs(runs);
        let made = model(&ops).map_err(OpError::from).and_then(|model| {
            let cfg = &model.config;
            if positions > cfg.max_seq {
                return Err(OpError::Shape(format!(
                    "kv cache: {positions} positions exceed max_seq {}",
                    cfg.max_seq
                )));
            }
            let cache = ops.kv_cache(
                cfg.n_layers,
                seqs * runs,
                positions,
                cfg.d_model,
                cfg.n_heads,
            )?;
            Ok((model, cache))
        });
        match made {
            Ok((model, cache)) => Ok(GpuBatchDecoder {
                backend,
                ops: Some(ops),
                model,
                cache,
                runs,
            }),
            Err(e) => {
                backend.give_ops(ops);
                Err(e)
            }
        }
    }

    fn fail(&self, what: &str, e: OpError) -> ! {
        panic!(
            "cuda:{}: batched {what} failed: {e}",
            self.backend.device().ordinal()
        )
    }

    /// `count` positions of every run's sequences (`tokens[m]` sequence-major): each run's
    /// logits and its sequence-major routing.
    fn decode(&mut self, tokens: &[Vec<u32>], count: usize) -> Vec<(Vec<f32>, Routing)> {
        let joint: Vec<u32> = tokens.iter().flatten().copied().collect();
        let ops = self.ops.as_ref().expect("held until drop");
        let (logits, routing) =
            match pass::decode(ops, &*self.model, &mut self.cache, &joint, count, None) {
                Ok(out) => out,
                Err(e) => self.fail("decode", e),
            };
        let (v, k, runs) = (self.model.config.vocab, routing.top_k, self.runs);
        let rows = routing.n_tokens / runs;
        (0..runs)
            .map(|m| {
                let l = logits[m * rows * v..][..rows * v].to_vec();
                let r = Routing {
                    top_k: k,
                    n_tokens: rows,
                    layers: routing
                        .layers
                        .iter()
                        .map(|ids| ids[m * rows * k..][..rows * k].to_vec())
                        .collect(),
                };
                (l, r)
            })
            .collect()
    }
}

impl Drop for GpuBatchDecoder<'_> {
    fn drop(&mut self) {
        if let Some(o) = self.ops.take() {
            self.backend.give_ops(o);
        }
    }
}

/// Decoders of groups of a batch's runs (the export stacks they read) behind one
/// [`BatchDecoder`].
struct GroupedDecoder<'a> {
    parts: Vec<GpuBatchDecoder<'a>>,
    groups: Vec<Vec<usize>>,
    members: usize,
}

impl GroupedDecoder<'_> {
    fn each<T>(
        &mut self,
        tokens: &[Vec<u32>],
        mut f: impl FnMut(&mut GpuBatchDecoder<'_>, &[Vec<u32>]) -> Vec<T>,
    ) -> Vec<T> {
        let mut out: Vec<Option<T>> = (0..self.members).map(|_| None).collect();
        for (part, group) in self.parts.iter_mut().zip(&self.groups) {
            let mine: Vec<Vec<u32>> = group.iter().map(|&m| tokens[m].clone()).collect();
            for (&m, r) in group.iter().zip(f(part, &mine)) {
                out[m] = Some(r);
            }
        }
        out.into_iter()
            .map(|r| r.expect("every member is in one group"))
            .collect()
    }
}

impl BatchDecoder for GroupedDecoder<'_> {
    fn members(&self) -> usize {
        self.members
    }

    fn step(&mut self, tokens: &[Vec<u32>]) -> Vec<(Vec<f32>, Routing)> {
        self.each(tokens, |d, t| d.decode(t, 1))
    }

    fn feed(&mut self, tokens: &[Vec<u32>], count: usize) -> Vec<Vec<Routing>> {
        self.each(tokens, |d, t| {
            d.decode(t, count)
                .into_iter()
                .map(|(_, r)| per_position(&r, count))
                .collect()
        })
    }

    fn repeat_each(&mut self, samples: usize) {
        for part in &mut self.parts {
            let ops = part.ops.as_ref().expect("held until drop");
            if let Err(e) = ops.kv_repeat_each(&mut part.cache, samples) {
                part.fail("kv cache copy", e);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::layout::Layout;
    use crate::engine::model::{ModelConfig, Params};
    use crate::recipe::{ModelPlan, SitePlan};

    /// Two runs of different row counts: each run's rows sit at `m · cap` with their own
    /// positions, contexts (keys offset into the run's block) and groups; padding rows follow,
    /// at position 0 and attending to themselves only; replay records are padded with experts
    /// 0..k.
    #[test]
    fn joint_rows_keep_each_runs_layout_in_its_block_and_pad_the_rest() {
        let cfg = ModelConfig::tiny();
        let prep = PreparedModel::new(
            &Params::init(&cfg, 1).unwrap(),
            &ModelPlan::uniform(cfg.n_layers, SitePlan::BF16),
        )
        .unwrap();
        let (b, t) = (4, 6);
        let toks_a: Vec<u32> = (0..b * t).map(|i| (i % 7) as u32).collect();
        let la = Layout::shared_prefix(&toks_a, b, t, 2, 3, Some(&[6, 5, 4, 6]));
        let lb = Layout::plain(2, 5);
        let (ra, rb) = (la.pack(&toks_a, 1), vec![3u32; 10]);
        let routing = |n: usize, v: u32| Routing {
            top_k: cfg.top_k,
            n_tokens: n,
            layers: vec![vec![v; n * cfg.top_k]; cfg.n_layers],
        };
        let rep_a = routing(la.rows(), 1);
        let items = [
            ForwardItem {
                prep: &prep,
                tokens: &ra,
                layout: &la,
                replay: Some(&rep_a),
            },
            ForwardItem {
                prep: &prep,
                tokens: &rb,
                layout: &lb,
                replay: None,
            },
        ];
        let refs: Vec<&ForwardItem<'_>> = items.iter().collect();
        let j = JointRows::new(&refs);
        assert_eq!(j.cap, la.rows().max(lb.rows()));
        assert_eq!(j.n(), 2 * j.cap);
        let s = j.max_context;
        for (m, l) in [&la, &lb].into_iter().enumerate() {
            let base = m * j.cap;
            for r in 0..l.rows() {
                let (len, key) = l.context(r);
                assert_eq!(j.positions[base + r] as usize, l.position(r));
                assert_eq!(j.ctx_len[base + r] as usize, len);
                for q in 0..len {
                    assert_eq!(j.ctx_keys[(base + r) * s + q] as usize, base + key(q));
                }
            }
            for r in l.rows()..j.cap {
                assert_eq!(j.tokens[base + r], PAD_ROW);
                assert_eq!((j.positions[base + r], j.ctx_len[base + r]), (0, 1));
                assert_eq!(j.ctx_keys[(base + r) * s] as usize, base + r);
                assert_eq!(
                    (
                        j.group_first[base + r] as usize,
                        j.group_end[base + r] as usize
                    ),
                    (base + r, base + r + 1)
                );
            }
        }
        assert_eq!(&j.tokens[..la.rows()], &ra[..]);
        assert_eq!(&j.tokens[j.cap..j.cap + lb.rows()], &rb[..]);
        let logits: Vec<f32> = (0..j.n() * 3).map(|i| i as f32).collect();
        assert_eq!(j.take(&logits, 1, 3), logits[j.cap * 3..][..lb.rows() * 3]);
        let replay = j.replay(&refs, cfg.top_k, cfg.n_layers).unwrap();
        let k = cfg.top_k;
        let pad: Vec<u32> = (0..k as u32).collect();
        for ids in &replay.layers {
            assert_eq!(ids.len(), j.n() * k);
            assert!(ids[..la.rows() * k].iter().all(|&x| x == 1));
            for r in la.rows()..2 * j.cap {
                assert_eq!(&ids[r * k..(r + 1) * k], &pad[..], "row {r}");
            }
        }
    }
}

//! Training state the GPU keeps across steps ([`Backend::holds_training`]): each run's master
//! weights and AdamW moments stay on the device, stacked per batch as the batched passes stack
//! models (a tensor holds every run's copy in turn). A minibatch then prepares the weights there
//! (`GpuOps::prepare_models`), keeps the gradients there, brings back only their squared norms,
//! and updates with `GpuOptim`: the host sends rows and dL/dlogits and reads back logits. Every
//! piece is the host path's arithmetic bit for bit (the preparation, the norms and AdamW), so a
//! run trains as it does with its state on the host (`tests/cuda_batch.rs`).
//!
//! [`Backend::holds_training`]: crate::engine::backend::Backend::holds_training

use super::CudaBackend;
use super::batch::{JointRows, counts_per_run, forward_members};
use super::device_ops::GpuOps;
use super::optim::{GpuOptim, StateTensor};
use super::{CudaDevice, CudaError};
use crate::engine::backend::{Backend, Counts, HeldBatch, HeldExport, HeldItem, HeldRun};
use crate::engine::device::OpError;
use crate::engine::model::pass::{self, Cache, RunPlans, Weights};
use crate::engine::model::{ModelConfig, Params, check_layout_inputs};
use crate::engine::optim::AdamStep;
use crate::formats::QuantStats;
use crate::recipe::ModelPlan;
use cudarc::driver::CudaSlice;
use std::any::Any;
use std::sync::{Arc, Mutex, OnceLock};

/// The runs' state the device holds, in groups of the runs last stepped together.
#[derive(Default)]
pub(super) struct HeldPool {
    /// Groups not in use by a pass (a pass takes its group out and gives it back synchronized).
    groups: Mutex<Vec<HeldGroup>>,
    optim: OnceLock<GpuOptim>,
}

/// Runs' master weights and moments, stacked: tensor t of `Params::named_tensors` holds each
/// slot's `lens[t]` values in turn. A slot whose run moved to another group or ended is `None`.
struct HeldGroup {
    slots: Vec<Option<u64>>,
    cfg: ModelConfig,
    lens: Vec<usize>,
    master: Vec<CudaSlice<f32>>,
    m: Vec<CudaSlice<f32>>,
    v: Vec<CudaSlice<f32>>,
}

impl HeldGroup {
    fn holds_exactly(&self, runs: &[u64]) -> bool {
        self.slots.len() == runs.len() && self.slots.iter().zip(runs).all(|(s, r)| *s == Some(*r))
    }

    fn slot_of(&self, run: u64) -> Option<usize> {
        self.slots.iter().position(|s| *s == Some(run))
    }
}

impl HeldPool {
    fn optim(&self, dev: &Arc<CudaDevice>) -> Result<&GpuOptim, CudaError> {
        if let Some(o) = self.optim.get() {
            return Ok(o);
        }
        let o = GpuOptim::new(dev)?;
        Ok(self.optim.get_or_init(|| o))
    }

    /// The group of exactly `items`' runs (`(run, params)`), in their order, taken out of the
    /// pool: the group they were last stepped in where it is that, else one gathered on `ops`'
    /// stream from the groups that hold them (their slots there emptied) and, for a run not
    /// held yet, its `params` uploaded with zero moments.
    fn take(&self, ops: &GpuOps, items: &[(u64, &Params)]) -> Result<HeldGroup, CudaError> {
        let runs: Vec<u64> = items.iter().map(|i| i.0).collect();
        let mut groups = self.groups.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(k) = groups.iter().position(|g| g.holds_exactly(&runs)) {
            return Ok(groups.remove(k));
        }
        let cfg = &items[0].1.config;
        let lens = cfg.tensor_lens();
        let r = runs.len();
        let s = ops.stream();
        let mut master = Vec::with_capacity(lens.len());
        let (mut m, mut v) = (
            Vec::with_capacity(lens.len()),
            Vec::with_capacity(lens.len()),
        );
        for &len in &lens {
            master.push(super::output_buffer(s, len * r)?);
            m.push(s.alloc_zeros::<f32>((len * r).max(1))?);
            v.push(s.alloc_zeros::<f32>((len * r).max(1))?);
        }
        // Runs not held anywhere: their weights in one staged upload.
        let fresh: Vec<usize> = (0..r)
            .filter(|&i| groups.iter().all(|g| g.slot_of(runs[i]).is_none()))
            .collect();
        if !fresh.is_empty() {
            let params: Vec<&Params> = fresh.iter().map(|&i| items[i].1).collect();
            let up = ops.upload_params(&params)?;
            for (k, &i) in fresh.iter().enumerate() {
                for (t, &len) in lens.iter().enumerate() {
                    s.memcpy_dtod(
                        &up[t].slice(k * len..(k + 1) * len),
                        &mut master[t].slice_mut(i * len..(i + 1) * len),
                    )?;
                }
            }
            s.synchronize()?;
        }
        for (i, &run) in runs.iter().enumerate() {
            let Some((g, slot)) = groups
                .iter()
                .enumerate()
                .find_map(|(g, grp)| grp.slot_of(run).map(|slot| (g, slot)))
            else {
                continue;
            };
            let src = &mut groups[g];
            for (t, &len) in lens.iter().enumerate() {
                let (from, to) = (slot * len..(slot + 1) * len, i * len..(i + 1) * len);
                s.memcpy_dtod(
                    &src.master[t].slice(from.clone()),
                    &mut master[t].slice_mut(to.clone()),
                )?;
                s.memcpy_dtod(
                    &src.m[t].slice(from.clone()),
                    &mut m[t].slice_mut(to.clone()),
                )?;
                s.memcpy_dtod(&src.v[t].slice(from), &mut v[t].slice_mut(to))?;
            }
            src.slots[slot] = None;
        }
        // The copies read the old groups: done before any of them is freed.
        s.synchronize()?;
        groups.retain(|g| g.slots.iter().any(Option::is_some));
        Ok(HeldGroup {
            slots: runs.into_iter().map(Some).collect(),
            cfg: cfg.clone(),
            lens,
            master,
            m,
            v,
        })
    }

    /// A group back into the pool, its pass's work finished.
    fn give(&self, g: HeldGroup) {
        self.groups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(g);
    }

    /// Each of `runs`' master weights, copied back on `ops`' stream straight from the stacked
    /// masters; `None` for a run none are held of.
    fn params(&self, ops: &GpuOps, runs: &[u64]) -> Result<Vec<Option<Params>>, OpError> {
        let groups = self.groups.lock().unwrap_or_else(|e| e.into_inner());
        // A staged copy per run, so one model-sized page-locked buffer serves every run: one
        // copy of all runs (hundreds of MB staged at once) measured slower on an H100 than the
        // runs read one by one (docs/cuda.md).
        runs.iter()
            .map(|&run| {
                let Some((g, slot)) = groups
                    .iter()
                    .find_map(|g| g.slot_of(run).map(|slot| (g, slot)))
                else {
                    return Ok(None);
                };
                let mut tensors: Vec<Vec<f32>> = g.lens.iter().map(|&len| vec![0.0; len]).collect();
                let mut parts: Vec<_> = g
                    .master
                    .iter()
                    .zip(&g.lens)
                    .zip(tensors.iter_mut())
                    .map(|((t, &len), dst)| (t.slice(slot * len..(slot + 1) * len), &mut dst[..]))
                    .collect();
                ops.download(&mut parts)?;
                Params::from_tensors(&g.cfg, tensors)
                    .map(Some)
                    .map_err(|e| OpError::Shape(e.to_string()))
            })
            .collect()
    }

    /// Forget `run`: its slot emptied, a group with no runs left freed.
    fn release(&self, run: u64) {
        let mut groups = self.groups.lock().unwrap_or_else(|e| e.into_inner());
        for g in groups.iter_mut() {
            if let Some(slot) = g.slot_of(run) {
                g.slots[slot] = None;
            }
        }
        groups.retain(|g| g.slots.iter().any(Option::is_some));
    }
}

impl CudaBackend {
    /// [`crate::engine::backend::Backend::held_forward_batch`]: one pass for every run.
    pub(super) fn held_forward_runs<'a>(
        &'a self,
        items: &[HeldItem<'_>],
        counts: Counts,
    ) -> Result<Box<dyn HeldBatch + 'a>, OpError> {
        if items.is_empty() {
            return Err(OpError::Shape("a held-state pass of no runs".into()));
        }
        let its: Vec<&HeldItem<'_>> = items.iter().collect();
        Ok(Box::new(HeldPart::new(self, &its, counts)?))
    }

    /// [`crate::engine::backend::Backend::held_export`]: one stack of every run, prepared from
    /// the held masters (runs not held yet taken on first) and complete when this returns.
    pub(super) fn held_export_runs(
        &self,
        runs: &[HeldRun<'_>],
    ) -> Result<Vec<HeldExport>, OpError> {
        let Some(first) = runs.first() else {
            return Ok(Vec::new());
        };
        let cfg = first.params.config.clone();
        if runs.iter().any(|r| r.params.config != cfg) {
            return Err(OpError::Shape(
                "held runs exported together need one model shape".into(),
            ));
        }
        let its: Vec<(u64, &Params)> = runs.iter().map(|r| (r.run, r.params)).collect();
        let plans = RunPlans::of(runs.iter().map(|r| r.plan.clone()).collect());
        let mut ops = self.take_ops()?;
        ops.set_runs(its.len());
        let made = self.held.take(&ops, &its).and_then(|g| {
            let model = ops
                .prepare_models(&cfg, &plans, &g.master, its.len())
                .and_then(|m| {
                    // Complete before any other stream reads it, or an update rewrites the
                    // masters it is made from.
                    ops.stream().synchronize()?;
                    Ok(m)
                });
            self.held.give(g);
            model
        });
        self.give_ops(ops);
        let model = Arc::new(made?);
        self.note_held_exports(its.len());
        let stack: Arc<dyn Any + Send + Sync> = Arc::new(ExportStack {
            model,
            runs: its.len(),
        });
        Ok((0..runs.len())
            .map(|m| HeldExport::new(Arc::clone(&stack), m, cfg.clone()))
            .collect())
    }

    /// [`crate::engine::backend::Backend::held_params`].
    pub(super) fn held_params_of(&self, runs: &[u64]) -> Result<Vec<Params>, OpError> {
        let ops = self.take_ops()?;
        let out = self.held.params(&ops, runs);
        self.give_ops(ops);
        out?.into_iter()
            .zip(runs)
            .map(|(p, run)| {
                p.ok_or_else(|| {
                    OpError::Shape(format!("{}: holds no state for run {run}", self.name()))
                })
            })
            .collect()
    }

    /// [`crate::engine::backend::Backend::release_held`].
    pub(super) fn release_held_run(&self, run: u64) {
        self.held.release(run);
    }
}

/// The stack `its` were exported in this step, where it is exactly theirs, in their order, under
/// their plan: the weights this pass would prepare from the same masters, bit for bit.
fn exported_stack(its: &[&HeldItem<'_>]) -> Option<Arc<Weights<GpuOps>>> {
    let first = its[0].export?;
    let stack = first.stack().downcast_ref::<ExportStack>()?;
    let whole = stack.runs == its.len()
        && its.iter().enumerate().all(|(m, it)| {
            it.export
                .is_some_and(|e| Arc::ptr_eq(e.stack(), first.stack()) && e.member() == m)
        });
    let plans: Vec<&ModelPlan> = its.iter().map(|i| i.plan).collect();
    (whole && stack.model.plans.is(&plans)).then(|| Arc::clone(&stack.model))
}

/// Runs' exported weights prepared together ([`HeldExport`]'s stack on a GPU): read by
/// decoders on any stream (the stream that made it was synchronized).
pub(super) struct ExportStack {
    pub(super) model: Arc<Weights<GpuOps>>,
    pub(super) runs: usize,
}

/// The held runs of a batch in one pass.
struct HeldPart<'a> {
    backend: &'a CudaBackend,
    ops: Option<GpuOps>,
    group: Option<HeldGroup>,
    model: Arc<Weights<GpuOps>>,
    cache: Cache<GpuOps>,
    joint: JointRows,
    vocab: usize,
    logits: Vec<Vec<f32>>,
    counts: Counts,
    stats: OnceLock<Vec<Vec<(String, QuantStats)>>>,
    /// The last backward's gradients, stacked as the masters are.
    grads: Option<Vec<CudaSlice<f32>>>,
}

impl<'a> HeldPart<'a> {
    fn new(
        backend: &'a CudaBackend,
        its: &[&HeldItem<'_>],
        counts: Counts,
    ) -> Result<Self, OpError> {
        let cfg = its[0].params.config.clone();
        for it in its {
            if it.params.config != cfg {
                return Err(OpError::Shape(
                    "held runs stepped together need one model shape".into(),
                ));
            }
            check_layout_inputs(&cfg, it.tokens, it.layout, it.replay)
                .map_err(|e| OpError::Shape(e.to_string()))?;
        }
        let joint = JointRows::new(its);
        let mut ops = backend.take_ops()?;
        ops.set_runs(its.len());
        ops.set_run_counts(counts == Counts::Keep);
        let runs: Vec<(u64, &Params)> = its.iter().map(|i| (i.run, i.params)).collect();
        let group = match backend.held.take(&ops, &runs) {
            Ok(g) => g,
            Err(e) => {
                backend.give_ops(ops);
                return Err(e.into());
            }
        };
        let run = |ops: &GpuOps, group: &HeldGroup| -> Result<_, OpError> {
            let model = match exported_stack(its) {
                Some(m) => m,
                None => {
                    let plans = RunPlans::of(its.iter().map(|i| i.plan.clone()).collect());
                    Arc::new(ops.prepare_models(&cfg, &plans, &group.master, its.len())?)
                }
            };
            let (logits, cache) = forward_members(ops, &model, its, &joint)?;
            Ok((model, logits, cache))
        };
        match run(&ops, &group) {
            Ok((model, all, cache)) => {
                let logits = (0..its.len())
                    .map(|m| joint.take(&all, m, cfg.vocab))
                    .collect();
                Ok(HeldPart {
                    backend,
                    ops: Some(ops),
                    group: Some(group),
                    model,
                    cache,
                    joint,
                    vocab: cfg.vocab,
                    logits,
                    counts,
                    stats: OnceLock::new(),
                    grads: None,
                })
            }
            Err(e) => {
                let _ = ops.stream().synchronize();
                backend.held.give(group);
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
    fn fail(&self, what: &str, e: impl Into<OpError>) -> ! {
        panic!(
            "cuda:{}: held-state trainer {what} failed: {}",
            self.backend.device().ordinal(),
            e.into()
        )
    }
}

impl HeldBatch for HeldPart<'_> {
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
            "activation counts of a held-state training forward made with Counts::Skip"
        );
        self.stats.get_or_init(|| {
            counts_per_run(self.ops(), &self.cache, self.logits.len())
                .unwrap_or_else(|e| self.fail("quantization counts", e))
        })[m]
            .clone()
    }

    fn backward(&mut self, dlogits: &[Option<&[f32]>]) -> Vec<Option<Vec<f64>>> {
        let all = self
            .joint
            .dlogits(dlogits, self.vocab)
            .unwrap_or_else(|e| self.fail("backward", e));
        let grads = pass::backward_on_device(self.ops(), &self.model, &self.cache, &all)
            .unwrap_or_else(|e| self.fail("backward", e));
        let runs = dlogits.len();
        let optim = self
            .backend
            .held
            .optim(self.backend.device())
            .unwrap_or_else(|e| self.fail("optimizer kernels", e));
        let refs: Vec<&CudaSlice<f32>> = grads.tensors.iter().collect();
        // `DeviceGrads::lens` are every run's values together; a run's are the group's.
        let lens = &self.group.as_ref().expect("held until drop").lens;
        let norms = optim
            .sum_squares_many(self.ops().stream(), &refs, lens, runs)
            .unwrap_or_else(|e| self.fail("gradient norms", e));
        self.grads = Some(grads.tensors);
        (0..runs)
            .map(|m| dlogits[m].map(|_| norms.iter().map(|t| t[m]).collect()))
            .collect()
    }

    fn update(&mut self, steps: &[Option<Vec<AdamStep>>]) -> Vec<Option<(f64, f64)>> {
        let Some(grads) = self.grads.take() else {
            self.fail(
                "update",
                OpError::Shape("an update before any backward".into()),
            );
        };
        let ops = self.ops.take().expect("held until drop");
        let mut group = self.group.take().expect("held until drop");
        let sums = (|| -> Result<Vec<Vec<(f64, f64)>>, CudaError> {
            let optim = self.backend.held.optim(self.backend.device())?;
            let HeldGroup {
                master, m, v, lens, ..
            } = &mut group;
            let tensors = master
                .iter_mut()
                .zip(m.iter_mut())
                .zip(v.iter_mut())
                .zip(&grads)
                .zip(lens.iter())
                .map(|((((p, m), v), g), &len)| StateTensor { p, m, v, g, len })
                .collect();
            optim.update_model(ops.stream(), tensors, steps)
        })();
        self.ops = Some(ops);
        self.group = Some(group);
        let sums = sums.unwrap_or_else(|e| self.fail("update", e));
        (0..steps.len())
            .map(|r| {
                steps[r].as_ref().map(|_| {
                    // `AdamW::update`'s order: tensors in turn, each one's chunks in order.
                    let (mut upd, mut wsq) = (0.0f64, 0.0f64);
                    for &(u, w) in &sums[r] {
                        upd += u;
                        wsq += w;
                    }
                    (upd, wsq)
                })
            })
            .collect()
    }
}

impl Drop for HeldPart<'_> {
    fn drop(&mut self) {
        if let Some(o) = self.ops.take() {
            // The group's buffers go back to a pool other streams take from.
            let _ = o.stream().synchronize();
            if let Some(g) = self.group.take() {
                self.backend.held.give(g);
            }
            self.backend.give_ops(o);
        }
    }
}

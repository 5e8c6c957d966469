//! The model's passes, written once over a device's op set ([`Ops`]): the training forward
//! (keeping what the backward needs), the backward, and the incremental decode step. Each block
//! is a forward/backward pair side by side, as in llm.c's `train_gpt2.c`; [`backward`] walks
//! the layers in reverse.
//!
//! Blocks (dimension letters as in `engine::ops`):
//! - attention: `h = x + proj(attention(qkv(rmsnorm(x))))`;
//! - MoE: `h = x + shared(xn) + Σ_j gate_j · expert_{i_j}(xn)`, `xn = rmsnorm(x)`, with the
//!   routed experts run as one dispatched batch (the device decides its layout) and the shared
//!   expert beside them;
//! - head: `logits = output_layer(rmsnorm(h))`; the loss is computed by the caller.

use super::{ModelConfig, ModelError, Params, Routing, check_layout_inputs, check_tokens};
use crate::engine::device::{OpError, OpResult, Ops, SiteCounts};
use crate::engine::layout::Layout;
use crate::formats::QuantStats;
use crate::recipe::{ModelPlan, Site, SitePlan};

/// One block's weights on a device (see `model::PreparedLayer`).
pub struct LayerWeights<O: Ops> {
    pub attn_norm: O::Param,
    pub linear_qkv: O::Weight,
    pub linear_proj: O::Weight,
    pub mlp_norm: O::Param,
    pub router: O::Weight,
    pub experts_fc1: O::Experts,
    pub experts_fc2: O::Experts,
    pub shared_fc1: O::Weight,
    pub shared_fc2: O::Weight,
}

/// The precision plans of the runs a pass steps, site by site: each site's plan in every run,
/// in run order, or one plan for all (a single run, or runs that share their plan). Runs of
/// different plans share one pass: every op but the quantizers is plan-blind.
#[derive(Clone, Debug, PartialEq)]
pub struct RunPlans {
    models: Vec<ModelPlan>,
    /// `layers[l][s]`: site `Site::ALL[s]` of layer l in each run.
    layers: Vec<Vec<Vec<SitePlan>>>,
    output: Vec<SitePlan>,
}

impl RunPlans {
    /// One plan for every run.
    pub fn one(plan: ModelPlan) -> RunPlans {
        RunPlans::of(vec![plan])
    }

    /// Run r on `models[r]`; runs that all share a plan keep one copy.
    pub fn of(mut models: Vec<ModelPlan>) -> RunPlans {
        assert!(!models.is_empty(), "plans of no runs");
        assert!(
            models
                .iter()
                .all(|m| m.layers.len() == models[0].layers.len()),
            "plans of runs of different depths"
        );
        if models.iter().all(|m| *m == models[0]) {
            models.truncate(1);
        }
        let layers = (0..models[0].layers.len())
            .map(|l| {
                Site::ALL
                    .iter()
                    .map(|&s| models.iter().map(|m| *m.layers[l].get(s)).collect())
                    .collect()
            })
            .collect();
        let output = models.iter().map(|m| m.output_layer).collect();
        RunPlans {
            models,
            layers,
            output,
        }
    }

    /// Each run's plan, or one for every run.
    pub fn models(&self) -> &[ModelPlan] {
        &self.models
    }

    /// Site `s` of layer `l` in each run (or one plan for all).
    pub fn site(&self, l: usize, s: Site) -> &[SitePlan] {
        let i = Site::ALL.iter().position(|&x| x == s).expect("a site");
        &self.layers[l][i]
    }

    /// Layer `l`'s sites.
    fn layer(&self, l: usize) -> LayerSites<'_> {
        LayerSites {
            plans: self,
            layer: l,
        }
    }

    /// The output layer's plan in each run (or one for all).
    pub fn output(&self) -> &[SitePlan] {
        &self.output
    }

    /// Whether run r's plan is `plans[r]` for every run.
    pub fn is(&self, plans: &[&ModelPlan]) -> bool {
        match &self.models[..] {
            [one] => plans.iter().all(|p| *p == one),
            all => all.len() == plans.len() && all.iter().zip(plans).all(|(a, b)| a == *b),
        }
    }

    /// Runs `keep` of these plans, in that order.
    pub fn gather(&self, keep: &[usize]) -> RunPlans {
        match &self.models[..] {
            [one] => RunPlans::one(one.clone()),
            all => RunPlans::of(keep.iter().map(|&k| all[k].clone()).collect()),
        }
    }
}

/// One layer's sites in the plans of a pass.
#[derive(Clone, Copy)]
struct LayerSites<'a> {
    plans: &'a RunPlans,
    layer: usize,
}

impl<'a> LayerSites<'a> {
    fn get(&self, s: Site) -> &'a [SitePlan] {
        self.plans.site(self.layer, s)
    }
}

/// A prepared model on a device (each run's copy, on a device stepping several), with the
/// plans its sites were prepared for.
pub struct Weights<O: Ops> {
    pub config: ModelConfig,
    pub plans: RunPlans,
    pub wte: O::Param,
    pub wpe: O::Param,
    pub layers: Vec<LayerWeights<O>>,
    pub final_norm: O::Param,
    pub output_layer: O::Weight,
}

/// fc1 → SwiGLU → fc2 over a block of rows; `L` is a linear cache (one weight, or the experts).
struct FfnCache<L, T> {
    fc1: L,
    /// `[rows, 2F]` pre-activation (gate | up).
    fc1_out: T,
    fc2: L,
}

type SharedCache<O> = FfnCache<<O as Ops>::Lin, <O as Ops>::T>;
type ExpertsCache<O> = FfnCache<<O as Ops>::ExpertLin, <O as Ops>::T>;

struct AttnCache<O: Ops> {
    /// `[N, D]` block input, for the RMSNorm backward.
    x: O::T,
    rstd: O::T,
    qkv_lin: O::Lin,
    /// `[N, 3D]`
    qkv: O::T,
    /// `[N, H, S]` softmax weights.
    probs: O::T,
    proj_lin: O::Lin,
}

struct MoeCache<O: Ops> {
    x: O::T,
    rstd: O::T,
    router_lin: O::Lin,
    /// `[N, K]` chosen experts and their renormalized gate weights.
    ids: O::Ids,
    weights: O::T,
    disp: O::Dispatch,
    shared: SharedCache<O>,
    experts: ExpertsCache<O>,
    /// The experts' outputs before the gate weight, one row per dispatched slot.
    y_experts: O::T,
}

struct LayerCache<O: Ops> {
    attn: AttnCache<O>,
    moe: MoeCache<O>,
}

/// Everything [`backward`] needs from one [`forward`].
pub struct Cache<O: Ops> {
    /// Rows of the forward (every run's, on a device stepping several).
    n: usize,
    rows: O::Rows,
    tokens: O::Ids,
    layers: Vec<LayerCache<O>>,
    /// `[N, D]` input of the final RMSNorm.
    h_final: O::T,
    final_rstd: O::T,
    out_lin: O::Lin,
}

impl<O: Ops> Cache<O> {
    /// Layers of the model that made it.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }
}

fn shape_err(e: ModelError) -> OpError {
    OpError::Shape(e.to_string())
}

// ===================================================================================================
// Blocks: forward and backward side by side

/// `x` (kept) → `x + proj(attention(qkv(rmsnorm(x))))`.
fn attn_forward<O: Ops>(
    ops: &O,
    w: &LayerWeights<O>,
    p: LayerSites<'_>,
    cfg: &ModelConfig,
    x: O::T,
    rows: &O::Rows,
    n: usize,
) -> OpResult<(O::T, AttnCache<O>)> {
    let (d, h) = (cfg.d_model, cfg.n_heads);
    let (xn, rstd) = ops.rmsnorm(&x, &w.attn_norm, n, d)?;
    let (qkv, qkv_lin) = ops.linear(p.get(Site::LinearQkv), &xn, n, &w.linear_qkv)?;
    let (att, probs) = ops.attention(&qkv, rows, h, d)?;
    let (mut out, proj_lin) = ops.linear(p.get(Site::LinearProj), &att, n, &w.linear_proj)?;
    ops.add_into(&mut out, &x, n * d)?;
    let cache = AttnCache {
        x,
        rstd,
        qkv_lin,
        qkv,
        probs,
        proj_lin,
    };
    Ok((out, cache))
}

/// `dh`: in, the gradient w.r.t. the block output; out, w.r.t. its input.
#[allow(clippy::too_many_arguments)]
fn attn_backward<O: Ops>(
    ops: &O,
    w: &LayerWeights<O>,
    p: LayerSites<'_>,
    cfg: &ModelConfig,
    c: &AttnCache<O>,
    dh: &mut O::T,
    g: &mut LayerGrads<O>,
    rows: &O::Rows,
    n: usize,
) -> OpResult<()> {
    let (d, h) = (cfg.d_model, cfg.n_heads);
    let mut datt = ops.zeros(n * d)?;
    ops.linear_backward(
        p.get(Site::LinearProj),
        &c.proj_lin,
        &w.linear_proj,
        dh,
        Some(&mut datt),
        &mut g.linear_proj,
    )?;
    let dqkv = ops.attention_backward(&datt, &c.qkv, &c.probs, rows, h, d)?;
    let mut dxn = ops.zeros(n * d)?;
    ops.linear_backward(
        p.get(Site::LinearQkv),
        &c.qkv_lin,
        &w.linear_qkv,
        &dqkv,
        Some(&mut dxn),
        &mut g.linear_qkv,
    )?;
    // The residual: the block input's gradient is dh itself plus the norm's (accumulated).
    ops.rmsnorm_backward(
        dh,
        &mut g.attn_norm,
        &dxn,
        &c.x,
        &w.attn_norm,
        &c.rstd,
        n,
        d,
    )
}

/// The shared expert: fc1 → SwiGLU → fc2 over `x` `[n, D]`.
fn shared_forward<O: Ops>(
    ops: &O,
    (w1, p1): (&O::Weight, &[SitePlan]),
    (w2, p2): (&O::Weight, &[SitePlan]),
    x: &O::T,
    n: usize,
    f: usize,
) -> OpResult<(O::T, SharedCache<O>)> {
    let (fc1_out, fc1) = ops.linear(p1, x, n, w1)?;
    let act = ops.swiglu(&fc1_out, n, f)?;
    let (y, fc2) = ops.linear(p2, &act, n, w2)?;
    Ok((y, FfnCache { fc1, fc1_out, fc2 }))
}

/// The shared expert's backward: `dx` written; dW1, dW2 accumulated.
#[allow(clippy::too_many_arguments)]
fn shared_backward<O: Ops>(
    ops: &O,
    (w1, p1): (&O::Weight, &[SitePlan]),
    (w2, p2): (&O::Weight, &[SitePlan]),
    c: &SharedCache<O>,
    dy: &O::T,
    (n, f): (usize, usize),
    dx: &mut O::T,
    (dw1, dw2): (&mut O::T, &mut O::T),
) -> OpResult<()> {
    let mut dact = ops.zeros(n * f)?;
    ops.linear_backward(p2, &c.fc2, w2, dy, Some(&mut dact), dw2)?;
    let dfc1 = ops.swiglu_backward(&dact, &c.fc1_out, n, f)?;
    ops.linear_backward(p1, &c.fc1, w1, &dfc1, Some(dx), dw1)
}

/// The routed experts over their dispatched batch `xe`.
fn experts_forward<O: Ops>(
    ops: &O,
    w: &LayerWeights<O>,
    p: LayerSites<'_>,
    xe: &O::T,
    disp: &O::Dispatch,
    f: usize,
) -> OpResult<(O::T, ExpertsCache<O>)> {
    let rows = ops.dispatch_rows(disp);
    let (fc1_out, fc1) = ops.experts_linear(p.get(Site::ExpertsFc1), xe, disp, &w.experts_fc1)?;
    let act = ops.swiglu(&fc1_out, rows, f)?;
    let (y, fc2) = ops.experts_linear(p.get(Site::ExpertsFc2), &act, disp, &w.experts_fc2)?;
    Ok((y, FfnCache { fc1, fc1_out, fc2 }))
}

/// The routed experts' backward: their batch's `dx`; dW1, dW2 accumulated.
#[allow(clippy::too_many_arguments)]
fn experts_backward<O: Ops>(
    ops: &O,
    w: &LayerWeights<O>,
    p: LayerSites<'_>,
    c: &MoeCache<O>,
    dy: &O::T,
    (d, f): (usize, usize),
    (dw1, dw2): (&mut O::T, &mut O::T),
) -> OpResult<O::T> {
    let rows = ops.dispatch_rows(&c.disp);
    let e = &c.experts;
    let mut dact = ops.zeros(rows * f)?;
    ops.experts_linear_backward(
        p.get(Site::ExpertsFc2),
        &e.fc2,
        &w.experts_fc2,
        dy,
        &mut dact,
        dw2,
    )?;
    let dfc1 = ops.swiglu_backward(&dact, &e.fc1_out, rows, f)?;
    let mut dx = ops.zeros(rows * d)?;
    ops.experts_linear_backward(
        p.get(Site::ExpertsFc1),
        &e.fc1,
        &w.experts_fc1,
        &dfc1,
        &mut dx,
        dw1,
    )?;
    Ok(dx)
}

/// `x` (kept) → `x + shared(xn) + Σ gate · expert(xn)`; the shared expert runs beside the routed
/// ones.
#[allow(clippy::too_many_arguments)]
fn moe_forward<O: Ops>(
    ops: &O,
    w: &LayerWeights<O>,
    p: LayerSites<'_>,
    cfg: &ModelConfig,
    x: O::T,
    n: usize,
    replay: Option<&[u32]>,
) -> OpResult<(O::T, MoeCache<O>)> {
    let (d, e, k) = (cfg.d_model, cfg.n_experts, cfg.top_k);
    let (xn, rstd) = ops.rmsnorm(&x, &w.mlp_norm, n, d)?;
    let (logits, router_lin) = ops.linear(p.get(Site::Router), &xn, n, &w.router)?;
    let (ids, weights) = ops.route(&logits, n, e, k, replay)?;
    let disp = ops.dispatch(&ids, n, k, e)?;
    let xe = ops.gather(&xn, &disp, d)?;
    let (shared, experts) = ops.join(
        || {
            shared_forward(
                ops,
                (&w.shared_fc1, p.get(Site::SharedFc1)),
                (&w.shared_fc2, p.get(Site::SharedFc2)),
                &xn,
                n,
                cfg.d_ff_shared,
            )
        },
        || experts_forward(ops, w, p, &xe, &disp, cfg.d_ff),
    );
    let ((shared_y, shared), (y_experts, experts)) = (shared?, experts?);
    let out = ops.combine(&x, &shared_y, &y_experts, &ids, &disp, &weights, (n, k, d))?;
    let cache = MoeCache {
        x,
        rstd,
        router_lin,
        ids,
        weights,
        disp,
        shared,
        experts,
        y_experts,
    };
    Ok((out, cache))
}

/// `dh`: in, the gradient w.r.t. the MoE block output; out, w.r.t. its input.
#[allow(clippy::too_many_arguments)]
fn moe_backward<O: Ops>(
    ops: &O,
    w: &LayerWeights<O>,
    p: LayerSites<'_>,
    cfg: &ModelConfig,
    c: &MoeCache<O>,
    dh: &mut O::T,
    g: &mut LayerGrads<O>,
    n: usize,
) -> OpResult<()> {
    let (d, e, k) = (cfg.d_model, cfg.n_experts, cfg.top_k);
    let (dy_experts, dweights) =
        ops.combine_backward(dh, &c.y_experts, &c.disp, &c.weights, (n, k, d))?;
    let mut dxn = ops.zeros(n * d)?;
    let LayerGrads {
        experts_fc1,
        experts_fc2,
        shared_fc1,
        shared_fc2,
        ..
    } = g;
    let dh_in: &O::T = dh;
    let (shared, dx_experts) = ops.join(
        || {
            shared_backward(
                ops,
                (&w.shared_fc1, p.get(Site::SharedFc1)),
                (&w.shared_fc2, p.get(Site::SharedFc2)),
                &c.shared,
                dh_in,
                (n, cfg.d_ff_shared),
                &mut dxn,
                (shared_fc1, shared_fc2),
            )
        },
        || {
            experts_backward(
                ops,
                w,
                p,
                c,
                &dy_experts,
                (d, cfg.d_ff),
                (experts_fc1, experts_fc2),
            )
        },
    );
    shared?;
    // The experts' dx added back in expert order (fixed, so the thread count cannot change it).
    ops.scatter_add(&mut dxn, &dx_experts?, &c.ids, &c.disp, (n, k, d))?;
    let dlogits = ops.route_backward(&dweights, &c.ids, &c.weights, n, e, k)?;
    let mut dxr = ops.zeros(n * d)?;
    ops.linear_backward(
        p.get(Site::Router),
        &c.router_lin,
        &w.router,
        &dlogits,
        Some(&mut dxr),
        &mut g.router,
    )?;
    ops.add_into(&mut dxn, &dxr, n * d)?;
    ops.rmsnorm_backward(dh, &mut g.mlp_norm, &dxn, &c.x, &w.mlp_norm, &c.rstd, n, d)
}

// ===================================================================================================
// The training forward and backward

/// Causal forward over the rows of `layout` (`tokens`, logits, routing and replay all in layout
/// row order): logits `[rows, V]` on the host, the cache for [`backward`], and the experts chosen
/// in every layer. With `replay`, the selection is forced to the record (rollout routing replay);
/// gate weights still come from this forward's router.
pub fn forward<O: Ops>(
    ops: &O,
    w: &Weights<O>,
    tokens: &[u32],
    layout: &Layout,
    replay: Option<&Routing>,
) -> OpResult<(Vec<f32>, Cache<O>, Routing)> {
    check_layout_inputs(&w.config, tokens, layout, replay).map_err(shape_err)?;
    let rows = ops.rows(layout)?;
    let toks = ops.ids(tokens)?;
    forward_on(ops, w, toks, rows, layout.rows(), replay)
}

/// [`forward`] over rows and tokens already on the device (`n` rows; a device stepping several
/// runs lays their rows out itself). The inputs are the caller's to check.
pub fn forward_on<O: Ops>(
    ops: &O,
    w: &Weights<O>,
    toks: O::Ids,
    rows: O::Rows,
    n: usize,
    replay: Option<&Routing>,
) -> OpResult<(Vec<f32>, Cache<O>, Routing)> {
    let cfg = &w.config;
    let d = cfg.d_model;
    let mut h = ops.embedding(&toks, &rows, &w.wte, &w.wpe, n, d)?;
    let mut layers = Vec::with_capacity(cfg.n_layers);
    for (l, lw) in w.layers.iter().enumerate() {
        let p = w.plans.layer(l);
        let (mid, attn) = attn_forward(ops, lw, p, cfg, h, &rows, n)?;
        let r = replay.map(|r| r.layers[l].as_slice());
        let (out, moe) = moe_forward(ops, lw, p, cfg, mid, n, r)?;
        layers.push(LayerCache { attn, moe });
        h = out;
    }
    let (hn, final_rstd) = ops.rmsnorm(&h, &w.final_norm, n, d)?;
    let (logits, out_lin) = ops.linear(w.plans.output(), &hn, n, &w.output_layer)?;
    let logits = ops.to_host(&logits, n * cfg.vocab)?;
    let ids: Vec<&O::Ids> = layers.iter().map(|l| &l.moe.ids).collect();
    let routing = routing_to_host(ops, cfg, &ids, n)?;
    let cache = Cache {
        n,
        rows,
        tokens: toks,
        layers,
        h_final: h,
        final_rstd,
        out_lin,
    };
    Ok((logits, cache, routing))
}

/// A forward's activation counts, one per matmul site and layer in `model::quant_sites` order
/// (the routed experts of a layer merged into their site); on a device stepping several runs,
/// each site's counts run by run (`sites x runs`, site-major).
pub fn quant_stats<O: Ops>(ops: &O, c: &Cache<O>) -> OpResult<Vec<QuantStats>> {
    let mut sites = Vec::with_capacity(7 * c.layers.len() + 1);
    for l in &c.layers {
        sites.extend([
            SiteCounts::One(&l.attn.qkv_lin),
            SiteCounts::One(&l.attn.proj_lin),
            SiteCounts::One(&l.moe.router_lin),
            SiteCounts::Experts(&l.moe.experts.fc1),
            SiteCounts::Experts(&l.moe.experts.fc2),
            SiteCounts::One(&l.moe.shared.fc1),
            SiteCounts::One(&l.moe.shared.fc2),
        ]);
    }
    sites.push(SiteCounts::One(&c.out_lin));
    ops.counts(&sites)
}

/// One layer's gradients on the device (`LayerParams`' fields).
struct LayerGrads<O: Ops> {
    attn_norm: O::T,
    linear_qkv: O::T,
    linear_proj: O::T,
    mlp_norm: O::T,
    router: O::T,
    experts_fc1: O::T,
    experts_fc2: O::T,
    shared_fc1: O::T,
    shared_fc2: O::T,
}

impl<O: Ops> LayerGrads<O> {
    /// Zeros of the 9 lengths `lens` (`LayerParams` order).
    fn zeros(ops: &O, lens: &[usize]) -> OpResult<Self> {
        let z = |i: usize| ops.zeros(lens[i]);
        Ok(LayerGrads {
            attn_norm: z(0)?,
            linear_qkv: z(1)?,
            linear_proj: z(2)?,
            mlp_norm: z(3)?,
            router: z(4)?,
            experts_fc1: z(5)?,
            experts_fc2: z(6)?,
            shared_fc1: z(7)?,
            shared_fc2: z(8)?,
        })
    }

    fn into_list(self) -> [O::T; 9] {
        [
            self.attn_norm,
            self.linear_qkv,
            self.linear_proj,
            self.mlp_norm,
            self.router,
            self.experts_fc1,
            self.experts_fc2,
            self.shared_fc1,
            self.shared_fc2,
        ]
    }
}

/// Gradients of the loss w.r.t. the FP32 master weights, given dL/dlogits `[rows, V]` in the
/// row order of the forward that produced `c` (on the same weights).
pub fn backward<O: Ops>(
    ops: &O,
    w: &Weights<O>,
    c: &Cache<O>,
    dlogits: &[f32],
) -> OpResult<Params> {
    let mut all = backward_runs(ops, w, c, dlogits)?;
    match (all.pop(), all.is_empty()) {
        (Some(p), true) => Ok(p),
        _ => Err(OpError::Shape(
            "backward: an op set stepping several runs gives one gradient per run (backward_runs)"
                .into(),
        )),
    }
}

/// [`backward`] on an op set stepping `ops.runs()` runs at once: each run's gradients, in run
/// order (`dlogits` holds every run's rows, as the forward laid them out).
pub fn backward_runs<O: Ops>(
    ops: &O,
    w: &Weights<O>,
    c: &Cache<O>,
    dlogits: &[f32],
) -> OpResult<Vec<Params>> {
    let cfg = &w.config;
    let DeviceGrads { tensors, lens } = backward_on_device(ops, w, c, dlogits)?;
    // Every gradient copied back (one batched copy where the device has one).
    let host = ops.all_to_host(tensors.into_iter().zip(lens).collect())?;
    let runs = ops.runs();
    if runs == 1 {
        // One run: its tensors as they came back, not copied again (a model's worth a step).
        return Ok(vec![Params::from_tensors(cfg, host).map_err(shape_err)?]);
    }
    (0..runs)
        .map(|r| {
            let tensors = host
                .iter()
                .map(|t| {
                    let len = t.len() / runs;
                    t[r * len..(r + 1) * len].to_vec()
                })
                .collect();
            Params::from_tensors(cfg, tensors).map_err(shape_err)
        })
        .collect()
}

/// Gradients left on the device: one tensor per entry of `Params::named_tensors`, in that order,
/// each holding every run's copy back to back (`lens`: the values of each).
pub struct DeviceGrads<O: Ops> {
    pub tensors: Vec<O::T>,
    pub lens: Vec<usize>,
}

/// [`backward_runs`] without the copy back: the gradients as the device holds them (what an
/// optimizer on the device would read).
pub fn backward_on_device<O: Ops>(
    ops: &O,
    w: &Weights<O>,
    c: &Cache<O>,
    dlogits: &[f32],
) -> OpResult<DeviceGrads<O>> {
    let cfg = &w.config;
    let (n, d, v, runs) = (c.n, cfg.d_model, cfg.vocab, ops.runs());
    if dlogits.len() != n * v {
        return Err(OpError::Shape(format!(
            "backward: dlogits must be [N, V] = [{n}, {v}], got {} values",
            dlogits.len()
        )));
    }
    // Tensor lengths in `Params::named_tensors` order: wte, wpe, 9 per layer, final norm, output;
    // every run's copy of a tensor back to back.
    let lens: Vec<usize> = cfg.tensor_lens().iter().map(|l| runs * l).collect();
    let last = lens.len() - 2;
    let (mut dwte, mut dwpe) = (ops.zeros(lens[0])?, ops.zeros(lens[1])?);
    let (mut dfinal, mut dout) = (ops.zeros(lens[last])?, ops.zeros(lens[last + 1])?);
    let mut grads = lens[2..last]
        .chunks(9)
        .map(|l| LayerGrads::zeros(ops, l))
        .collect::<OpResult<Vec<_>>>()?;
    // Output layer and final norm.
    let dl = ops.upload(dlogits)?;
    let mut dhn = ops.zeros(n * d)?;
    ops.linear_backward(
        w.plans.output(),
        &c.out_lin,
        &w.output_layer,
        &dl,
        Some(&mut dhn),
        &mut dout,
    )?;
    // The gradient w.r.t. the residual stream, walked down the layers.
    let mut dh = ops.zeros(n * d)?;
    ops.rmsnorm_backward(
        &mut dh,
        &mut dfinal,
        &dhn,
        &c.h_final,
        &w.final_norm,
        &c.final_rstd,
        n,
        d,
    )?;
    for l in (0..cfg.n_layers).rev() {
        let (lw, p, lc, g) = (&w.layers[l], w.plans.layer(l), &c.layers[l], &mut grads[l]);
        moe_backward(ops, lw, p, cfg, &lc.moe, &mut dh, g, n)?;
        attn_backward(ops, lw, p, cfg, &lc.attn, &mut dh, g, &c.rows, n)?;
    }
    ops.embedding_backward(&mut dwte, &mut dwpe, &dh, &c.tokens, &c.rows, n, d)?;
    let mut tensors = vec![dwte, dwpe];
    tensors.extend(grads.into_iter().flat_map(LayerGrads::into_list));
    tensors.extend([dfinal, dout]);
    Ok(DeviceGrads { tensors, lens })
}

// ===================================================================================================
// Inference: the reference forward and the incremental decode (rollout)

/// The shared expert or every routed expert, forward only.
fn ffn_infer<O: Ops>(
    ops: &O,
    rows: usize,
    f: usize,
    fc1: impl FnOnce(&O::T) -> OpResult<O::T>,
    fc2: impl FnOnce(&O::T) -> OpResult<O::T>,
    x: &O::T,
) -> OpResult<O::T> {
    let h = fc1(x)?;
    let act = ops.swiglu(&h, rows, f)?;
    fc2(&act)
}

/// [`moe_forward`] keeping nothing: the output and the chosen experts.
#[allow(clippy::too_many_arguments)]
fn moe_infer<O: Ops>(
    ops: &O,
    w: &LayerWeights<O>,
    p: LayerSites<'_>,
    cfg: &ModelConfig,
    x: &O::T,
    n: usize,
    replay: Option<&[u32]>,
) -> OpResult<(O::T, O::Ids)> {
    let (d, e, k) = (cfg.d_model, cfg.n_experts, cfg.top_k);
    let (xn, _) = ops.rmsnorm(x, &w.mlp_norm, n, d)?;
    let logits = ops.apply(p.get(Site::Router), &xn, n, &w.router)?;
    let (ids, weights) = ops.route(&logits, n, e, k, replay)?;
    let disp = ops.dispatch(&ids, n, k, e)?;
    let xe = ops.gather(&xn, &disp, d)?;
    let rows = ops.dispatch_rows(&disp);
    let (shared, experts) = ops.join(
        || {
            ffn_infer(
                ops,
                n,
                cfg.d_ff_shared,
                |x| ops.apply(p.get(Site::SharedFc1), x, n, &w.shared_fc1),
                |x| ops.apply(p.get(Site::SharedFc2), x, n, &w.shared_fc2),
                &xn,
            )
        },
        || {
            ffn_infer(
                ops,
                rows,
                cfg.d_ff,
                |x| ops.apply_experts(p.get(Site::ExpertsFc1), x, &disp, &w.experts_fc1),
                |x| ops.apply_experts(p.get(Site::ExpertsFc2), x, &disp, &w.experts_fc2),
                &xe,
            )
        },
    );
    let out = ops.combine(x, &shared?, &experts?, &ids, &disp, &weights, (n, k, d))?;
    Ok((out, ids))
}

/// [`attn_forward`] keeping nothing; `attend` maps qkv to the attention output (over the rows
/// themselves, or over a decoder's cache).
fn attn_infer<O: Ops>(
    ops: &O,
    w: &LayerWeights<O>,
    p: LayerSites<'_>,
    cfg: &ModelConfig,
    x: &O::T,
    n: usize,
    attend: impl FnOnce(&O::T) -> OpResult<O::T>,
) -> OpResult<O::T> {
    let d = cfg.d_model;
    let (xn, _) = ops.rmsnorm(x, &w.attn_norm, n, d)?;
    let qkv = ops.apply(p.get(Site::LinearQkv), &xn, n, &w.linear_qkv)?;
    let att = attend(&qkv)?;
    let mut out = ops.apply(p.get(Site::LinearProj), &att, n, &w.linear_proj)?;
    ops.add_into(&mut out, x, n * d)?;
    Ok(out)
}

/// Embedding, the blocks and the head over `n` rows, keeping nothing: the logits `[n, V]` and
/// each layer's chosen experts `[n, K]`, left on the device ([`outputs_to_host`] reads them).
/// `attend(l, qkv)` is layer `l`'s attention. Queues device work only (no copy to or from the
/// host), so a stream can capture it as a graph.
fn infer_rows<O: Ops>(
    ops: &O,
    w: &Weights<O>,
    toks: &O::Ids,
    rows: &O::Rows,
    n: usize,
    replay: Option<&Routing>,
    mut attend: impl FnMut(usize, &O::T) -> OpResult<O::T>,
) -> OpResult<(O::T, Vec<O::Ids>)> {
    let cfg = &w.config;
    let d = cfg.d_model;
    let mut x = ops.embedding(toks, rows, &w.wte, &w.wpe, n, d)?;
    let mut ids = Vec::with_capacity(cfg.n_layers);
    for (l, lw) in w.layers.iter().enumerate() {
        let p = w.plans.layer(l);
        let mid = attn_infer(ops, lw, p, cfg, &x, n, |qkv| attend(l, qkv))?;
        let r = replay.map(|r| r.layers[l].as_slice());
        let (out, layer_ids) = moe_infer(ops, lw, p, cfg, &mid, n, r)?;
        ids.push(layer_ids);
        x = out;
    }
    let (hn, _) = ops.rmsnorm(&x, &w.final_norm, n, d)?;
    let logits = ops.apply(w.plans.output(), &hn, n, &w.output_layer)?;
    Ok((logits, ids))
}

/// The outputs [`infer_rows`] left on the device, for `n` rows: logits and routing.
pub fn outputs_to_host<O: Ops>(
    ops: &O,
    cfg: &ModelConfig,
    logits: &O::T,
    ids: &[O::Ids],
    n: usize,
) -> OpResult<(Vec<f32>, Routing)> {
    let logits = ops.to_host(logits, n * cfg.vocab)?;
    let ids: Vec<&O::Ids> = ids.iter().collect();
    Ok((logits, routing_to_host(ops, cfg, &ids, n)?))
}

/// The experts every layer chose for `n` rows (`ids`, one `[n, K]` tensor per layer), on the
/// host in one go.
fn routing_to_host<O: Ops>(
    ops: &O,
    cfg: &ModelConfig,
    ids: &[&O::Ids],
    n: usize,
) -> OpResult<Routing> {
    Ok(Routing {
        top_k: cfg.top_k,
        n_tokens: n,
        layers: ops.ids_to_host(ids, n * cfg.top_k)?,
    })
}

/// [`forward`] keeping nothing for a backward (the trainer's reference forward): the same
/// logits and routing.
pub fn infer<O: Ops>(
    ops: &O,
    w: &Weights<O>,
    tokens: &[u32],
    layout: &Layout,
    replay: Option<&Routing>,
) -> OpResult<(Vec<f32>, Routing)> {
    check_layout_inputs(&w.config, tokens, layout, replay).map_err(shape_err)?;
    let rows = ops.rows(layout)?;
    let toks = ops.ids(tokens)?;
    infer_on(ops, w, &toks, &rows, layout.rows(), replay)
}

/// [`infer`] over rows and tokens already on the device (see [`forward_on`]).
pub fn infer_on<O: Ops>(
    ops: &O,
    w: &Weights<O>,
    toks: &O::Ids,
    rows: &O::Rows,
    n: usize,
    replay: Option<&Routing>,
) -> OpResult<(Vec<f32>, Routing)> {
    let (h, d) = (w.config.n_heads, w.config.d_model);
    let (logits, ids) = infer_rows(ops, w, toks, rows, n, replay, |_, qkv| {
        ops.attention(qkv, rows, h, d).map(|(att, _)| att)
    })?;
    outputs_to_host(ops, &w.config, &logits, &ids, n)
}

/// `count` new positions of each of the cache's sequences (`tokens` sequence-major, `count` per
/// sequence), each attending over its sequence's cached positions and the new ones up to
/// itself: logits `[seqs · count, V]` on the host and the routing, in the same row order. Same
/// blocks and weights as [`forward`]; only attention reads keys and values from the cache.
pub fn decode<O: Ops>(
    ops: &O,
    w: &Weights<O>,
    kv: &mut O::Kv,
    tokens: &[u32],
    count: usize,
    replay: Option<&Routing>,
) -> OpResult<(Vec<f32>, Routing)> {
    let cfg = &w.config;
    let n = ops.kv_seqs(kv) * count;
    if count == 0 || tokens.len() != n {
        return Err(OpError::Shape(format!(
            "decode: {} tokens for {count} positions of {} sequences",
            tokens.len(),
            ops.kv_seqs(kv)
        )));
    }
    check_tokens(cfg, tokens)
        .and_then(|()| replay.map_or(Ok(()), |r| r.check(cfg, n)))
        .map_err(shape_err)?;
    let rows = ops.decode_rows(kv, count)?;
    let toks = ops.ids(tokens)?;
    let (logits, ids) = decode_on_device(ops, w, kv, &toks, &rows, count, replay)?;
    let out = outputs_to_host(ops, cfg, &logits, &ids, n)?;
    ops.kv_advance(kv, count);
    Ok(out)
}

/// [`decode`]'s device work for tokens and rows already there (`rows` from
/// [`Ops::decode_rows`] at the cache's current length), leaving the cache's length as it is and
/// the outputs on the device ([`outputs_to_host`] reads them). It queues no copy to or from the
/// host, so a stream can capture it as a graph and replay it at that position.
pub fn decode_on_device<O: Ops>(
    ops: &O,
    w: &Weights<O>,
    kv: &mut O::Kv,
    toks: &O::Ids,
    rows: &O::Rows,
    count: usize,
    replay: Option<&Routing>,
) -> OpResult<(O::T, Vec<O::Ids>)> {
    let (h, d) = (w.config.n_heads, w.config.d_model);
    let n = ops.kv_seqs(kv) * count;
    infer_rows(ops, w, toks, rows, n, replay, |l, qkv| {
        ops.kv_attend(kv, l, qkv, rows, h, d, count)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs that share a plan keep one; otherwise each run's site plan is its own, in run order,
    /// and a gathered subset keeps its runs' plans (collapsing again when they agree).
    #[test]
    fn run_plans_give_each_run_its_site_plan() {
        let (a, b) = (
            ModelPlan::uniform(2, SitePlan::BF16),
            ModelPlan::uniform(2, SitePlan::FP32),
        );
        let same = RunPlans::of(vec![a.clone(), a.clone(), a.clone()]);
        assert_eq!(same.models().len(), 1);
        assert_eq!(same.site(1, Site::ExpertsFc1), &[SitePlan::BF16]);
        assert!(same.is(&[&a, &a]) && !same.is(&[&a, &b]));
        let mut c = a.clone();
        c.layers[1].router = SitePlan::FP32;
        let mixed = RunPlans::of(vec![a.clone(), b.clone(), c.clone()]);
        assert_eq!(mixed.models().len(), 3);
        assert_eq!(
            mixed.site(1, Site::Router),
            &[SitePlan::BF16, SitePlan::FP32, SitePlan::FP32]
        );
        assert_eq!(
            mixed.site(0, Site::Router),
            &[SitePlan::BF16, SitePlan::FP32, SitePlan::BF16]
        );
        assert_eq!(
            mixed.output(),
            &[SitePlan::BF16, SitePlan::FP32, SitePlan::BF16]
        );
        assert!(mixed.is(&[&a, &b, &c]) && !mixed.is(&[&a, &b]) && !mixed.is(&[&a, &a, &c]));
        assert_eq!(
            mixed.gather(&[2, 1]),
            RunPlans::of(vec![c.clone(), b.clone()])
        );
        assert_eq!(mixed.gather(&[0]).models(), std::slice::from_ref(&a));
        assert_eq!(mixed.gather(&[0, 2]).models().len(), 2);
    }
}

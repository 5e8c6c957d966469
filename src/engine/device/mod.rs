//! The op set the model is written over (`engine::model`): tensors that live on a device and
//! the ops a transformer step needs, each returning `Result`. The model's forward, backward and
//! incremental decode are written once against [`Ops`]; a device brings storage and kernels.
//!
//! [`cpu::CpuOps`] is the reference: host vectors, element-wise ops from `engine::ops`, every
//! GEMM by `backend::cpu::gemm` and every quantization through `engine::linear` (the one
//! quantizer), in the fixed orders that make the CPU engine
//! deterministic at any thread count.
//!
//! Tensors come in kinds, each an associated type, because devices store them differently:
//! activations ([`Ops::T`]), token and expert ids ([`Ops::Ids`]), read-only parameters
//! ([`Ops::Param`]: norm gains and embeddings, borrowed on the host), prepared matmul sites
//! ([`Ops::Weight`], and [`Ops::Experts`] for a site of every routed expert), what a linear
//! layer keeps for its backward, how tokens are dispatched to experts ([`Ops::Dispatch`]: the
//! CPU packs each expert's tokens tightly, a GPU pads each expert to a fixed capacity), a row
//! layout ([`Ops::Rows`]) and a decoder's key/value cache ([`Ops::Kv`]).

pub mod cpu;

use crate::engine::layout::Layout;
use crate::formats::QuantStats;
use crate::recipe::SitePlan;

/// An op that could not run: a shape that does not fit, or a device failure.
#[derive(Debug, thiserror::Error)]
pub enum OpError {
    #[error("{0}")]
    Shape(String),
    #[error("{0}")]
    Device(String),
}

pub type OpResult<T> = Result<T, OpError>;

/// The activation counts of one matmul site's forward: a single weight or the routed experts.
pub enum SiteCounts<'a, O: Ops + ?Sized> {
    One(&'a O::Lin),
    Experts(&'a O::ExpertLin),
}

/// A device's tensors and ops. Shapes are explicit (`n` rows of width `d`, row-major); every op
/// writes a fresh output or accumulates where it says so.
pub trait Ops: Sync {
    /// An FP32 activation or gradient tensor.
    type T: Send + Sync;
    /// A u32 tensor: token ids, chosen experts.
    type Ids: Send + Sync;
    /// A read-only FP32 parameter: a norm gain, an embedding table.
    type Param: Send + Sync;
    /// A prepared matmul site: its forward and dgrad operands.
    type Weight: Send + Sync;
    /// One matmul site of every routed expert.
    type Experts: Send + Sync;
    /// What a linear forward keeps for its backward (wgrad operand, activation counts).
    type Lin: Send + Sync;
    /// The same for the routed experts' site.
    type ExpertLin: Send + Sync;
    /// Which rows each expert computes, in which order.
    type Dispatch: Send + Sync;
    /// A row layout: each row's position and the keys it attends to.
    type Rows: Sync;
    /// A decoder's keys and values, every layer.
    type Kv: Send;

    /// Runs this op set steps at once (1 but on a device that batches runs): every tensor holds
    /// each run's rows in turn, every weight each run's copy, and ops never mix runs.
    fn runs(&self) -> usize {
        1
    }

    // -- storage --------------------------------------------------------------------------
    /// A zero tensor of `n` values.
    fn zeros(&self, n: usize) -> OpResult<Self::T>;
    /// A tensor holding these host values.
    fn upload(&self, x: &[f32]) -> OpResult<Self::T>;
    /// Host values of a tensor (its first `n`).
    fn to_host(&self, t: &Self::T, n: usize) -> OpResult<Vec<f32>>;
    /// Host values of many tensors at once (a device may batch the copies).
    fn all_to_host(&self, ts: Vec<(Self::T, usize)>) -> OpResult<Vec<Vec<f32>>>;
    /// Token ids on the device.
    fn ids(&self, v: &[u32]) -> OpResult<Self::Ids>;
    /// Host values of every layer's chosen experts (`n·k` each), in one go.
    fn ids_to_host(&self, ids: &[&Self::Ids], nk: usize) -> OpResult<Vec<Vec<u32>>>;
    /// A row layout on the device.
    fn rows(&self, layout: &Layout) -> OpResult<Self::Rows>;
    /// Runs `a` and `b`, concurrently where the device gains from it (the CPU's thread pool).
    fn join<A: Send, B: Send>(
        &self,
        a: impl FnOnce() -> A + Send,
        b: impl FnOnce() -> B + Send,
    ) -> (A, B);

    // -- element-wise and row ops -----------------------------------------------------------
    /// Token plus position embedding of every row: `[n, d]`.
    fn embedding(
        &self,
        tokens: &Self::Ids,
        rows: &Self::Rows,
        wte: &Self::Param,
        wpe: &Self::Param,
        n: usize,
        d: usize,
    ) -> OpResult<Self::T>;
    /// Accumulates the embedding gradients from `dh` `[n, d]`.
    #[allow(clippy::too_many_arguments)]
    fn embedding_backward(
        &self,
        dwte: &mut Self::T,
        dwpe: &mut Self::T,
        dh: &Self::T,
        tokens: &Self::Ids,
        rows: &Self::Rows,
        n: usize,
        d: usize,
    ) -> OpResult<()>;
    /// RMSNorm of `[n, d]`: (output, per-row reciprocal RMS).
    fn rmsnorm(
        &self,
        x: &Self::T,
        g: &Self::Param,
        n: usize,
        d: usize,
    ) -> OpResult<(Self::T, Self::T)>;
    /// RMSNorm backward: `dx` and `dg` accumulated (a residual stream's gradient sums in place).
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_backward(
        &self,
        dx: &mut Self::T,
        dg: &mut Self::T,
        dy: &Self::T,
        x: &Self::T,
        g: &Self::Param,
        rstd: &Self::T,
        n: usize,
        d: usize,
    ) -> OpResult<()>;
    /// `dst += src` over `n` values.
    fn add_into(&self, dst: &mut Self::T, src: &Self::T, n: usize) -> OpResult<()>;
    /// SwiGLU of `[n, 2f]` (gate | up) → `[n, f]`.
    fn swiglu(&self, x: &Self::T, n: usize, f: usize) -> OpResult<Self::T>;
    /// SwiGLU backward: `[n, 2f]` from `dy` `[n, f]`.
    fn swiglu_backward(&self, dy: &Self::T, x: &Self::T, n: usize, f: usize) -> OpResult<Self::T>;
    /// Causal attention of `qkv` `[n, 3d]` over `rows`: (output `[n, d]`, softmax weights).
    fn attention(
        &self,
        qkv: &Self::T,
        rows: &Self::Rows,
        h: usize,
        d: usize,
    ) -> OpResult<(Self::T, Self::T)>;
    /// Attention backward: dqkv `[n, 3d]`.
    fn attention_backward(
        &self,
        dy: &Self::T,
        qkv: &Self::T,
        probs: &Self::T,
        rows: &Self::Rows,
        h: usize,
        d: usize,
    ) -> OpResult<Self::T>;

    // -- linear layers (quantized per the site's plan) ------------------------------------------
    // `plan` is the site's plan in each run the op set steps, in run order, or one plan for all
    // of them ([`crate::engine::model::pass::RunPlans::site`]): runs of different plans share
    // every op, each run's rows quantized per its own plan.

    /// `y[n, m] = x[n, k] · Wᵀ`, with the activations quantized per `plan`.
    fn linear(
        &self,
        plan: &[SitePlan],
        x: &Self::T,
        n: usize,
        w: &Self::Weight,
    ) -> OpResult<(Self::T, Self::Lin)>;
    /// `dx = dy · W` (written when given) and `dW += dyᵀ · x`, per the plan's backward mode.
    fn linear_backward(
        &self,
        plan: &[SitePlan],
        c: &Self::Lin,
        w: &Self::Weight,
        dy: &Self::T,
        dx: Option<&mut Self::T>,
        dw: &mut Self::T,
    ) -> OpResult<()>;
    /// [`Ops::linear`] of every routed expert over its dispatched rows.
    fn experts_linear(
        &self,
        plan: &[SitePlan],
        x: &Self::T,
        d: &Self::Dispatch,
        w: &Self::Experts,
    ) -> OpResult<(Self::T, Self::ExpertLin)>;
    /// [`Ops::linear_backward`] of every routed expert (`dw` stacked `[E, out, in]`).
    fn experts_linear_backward(
        &self,
        plan: &[SitePlan],
        c: &Self::ExpertLin,
        w: &Self::Experts,
        dy: &Self::T,
        dx: &mut Self::T,
        dw: &mut Self::T,
    ) -> OpResult<()>;
    /// [`Ops::linear`] without what a backward needs (an inference pass).
    fn apply(
        &self,
        plan: &[SitePlan],
        x: &Self::T,
        n: usize,
        w: &Self::Weight,
    ) -> OpResult<Self::T> {
        self.linear(plan, x, n, w).map(|(y, _)| y)
    }
    /// [`Ops::experts_linear`] without what a backward needs.
    fn apply_experts(
        &self,
        plan: &[SitePlan],
        x: &Self::T,
        d: &Self::Dispatch,
        w: &Self::Experts,
    ) -> OpResult<Self::T> {
        self.experts_linear(plan, x, d, w).map(|(y, _)| y)
    }
    /// The activation counts of these forwards, in order.
    fn counts(&self, sites: &[SiteCounts<'_, Self>]) -> OpResult<Vec<QuantStats>>;

    // -- mixture of experts ---------------------------------------------------------------
    /// Router softmax and top-k of `logits` `[n, e]` (or the `replay`ed choice): (ids, gate
    /// weights renormalized over the k), each `[n, k]`.
    fn route(
        &self,
        logits: &Self::T,
        n: usize,
        e: usize,
        k: usize,
        replay: Option<&[u32]>,
    ) -> OpResult<(Self::Ids, Self::T)>;
    /// dlogits `[n, e]` of the router from the gate weights' gradient `[n, k]`.
    #[allow(clippy::too_many_arguments)]
    fn route_backward(
        &self,
        dweights: &Self::T,
        ids: &Self::Ids,
        weights: &Self::T,
        n: usize,
        e: usize,
        k: usize,
    ) -> OpResult<Self::T>;
    /// Which rows each expert computes for `ids` `[n, k]`.
    fn dispatch(&self, ids: &Self::Ids, n: usize, k: usize, e: usize) -> OpResult<Self::Dispatch>;
    /// Rows of the experts' batch.
    fn dispatch_rows(&self, d: &Self::Dispatch) -> usize;
    /// The experts' input batch: each dispatched (token, choice)'s row of `x` `[n, d]`.
    fn gather(&self, x: &Self::T, disp: &Self::Dispatch, d: usize) -> OpResult<Self::T>;
    /// `x + shared + Σ_j gate_j · expert_j` over `[n, d]`, `k` choices per token, summed in a
    /// fixed order (shared first).
    #[allow(clippy::too_many_arguments)]
    fn combine(
        &self,
        x: &Self::T,
        shared: &Self::T,
        experts: &Self::T,
        ids: &Self::Ids,
        disp: &Self::Dispatch,
        weights: &Self::T,
        nkd: (usize, usize, usize),
    ) -> OpResult<Self::T>;
    /// The combine's backward for the experts: (dy of the experts' batch, d gate weights `[n, k]`).
    fn combine_backward(
        &self,
        dh: &Self::T,
        experts: &Self::T,
        disp: &Self::Dispatch,
        weights: &Self::T,
        nkd: (usize, usize, usize),
    ) -> OpResult<(Self::T, Self::T)>;
    /// Adds the experts' batch gradient back into its tokens' rows of `dx`, in a fixed order.
    fn scatter_add(
        &self,
        dx: &mut Self::T,
        dexperts: &Self::T,
        ids: &Self::Ids,
        disp: &Self::Dispatch,
        nkd: (usize, usize, usize),
    ) -> OpResult<()>;

    // -- incremental decode ------------------------------------------------------------------
    /// An empty cache for `seqs` sequences of up to `positions` positions.
    fn kv_cache(
        &self,
        layers: usize,
        seqs: usize,
        positions: usize,
        d: usize,
        h: usize,
    ) -> OpResult<Self::Kv>;
    /// Positions filled so far.
    fn kv_len(&self, kv: &Self::Kv) -> usize;
    /// Sequences in the cache.
    fn kv_seqs(&self, kv: &Self::Kv) -> usize;
    /// The rows of `count` decode steps at once: positions `kv_len..kv_len + count` of every
    /// sequence, sequence-major.
    fn decode_rows(&self, kv: &Self::Kv, count: usize) -> OpResult<Self::Rows>;
    /// Stores these rows' keys and values (`qkv` `[seqs · count, 3d]`) in layer `l` and attends
    /// each row over its sequence's cached positions up to itself: `[seqs · count, d]`.
    #[allow(clippy::too_many_arguments)]
    fn kv_attend(
        &self,
        kv: &mut Self::Kv,
        l: usize,
        qkv: &Self::T,
        rows: &Self::Rows,
        h: usize,
        d: usize,
        count: usize,
    ) -> OpResult<Self::T>;
    /// Marks `count` positions filled.
    fn kv_advance(&self, kv: &mut Self::Kv, count: usize);
    /// Each sequence's cache copied to `samples` consecutive sequences (a prompt decoded once,
    /// then shared by its samples).
    fn kv_repeat_each(&self, kv: &mut Self::Kv, samples: usize) -> OpResult<()>;
}

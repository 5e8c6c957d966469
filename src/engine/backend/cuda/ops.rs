//! The engine's forward ops (`crate::engine::ops`) as kernels on device-resident buffers
//! (`ops.cu`, compiled by NVRTC with the exact-arithmetic options), for the resident forward.
//!
//! Each kernel computes what its CPU op computes, in the CPU's order wherever the CPU reduces
//! within a row (one thread does that sum), so RMSNorm, the embedding, row gathers, `add_into`
//! and the MoE combine give the CPU's bits; ops that call `exp` (attention, SwiGLU, the router)
//! differ from glibc by an ulp or so per `exp` and are tested to a tolerance (`tests/cuda_ops.rs`).
//! Every launch is queued on the caller's stream, with no synchronisation and no host copies.
//!
//! Buffers may be longer than an op needs (the op reads and writes the leading elements), so
//! buffers sized for the largest layout serve every step; shorter ones are a
//! [`CudaError::Shape`]. Indices held on the device (tokens, positions, gathered rows, replayed
//! expert ids) are checked in the kernels: an out-of-range one makes its outputs NaN where the CPU
//! would panic, and nothing is read outside a buffer.

use super::{CudaDevice, CudaError};
use crate::engine::layout::Layout;
use crate::engine::ops::RMSNORM_EPS;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use std::sync::Arc;

const SRC: &str = include_str!("ops.cu");
/// Threads per block for every kernel (8 warps).
const THREADS: u32 = 256;
/// Grid cap: kernels loop (grid-stride) past it, so no shape overflows the grid.
const MAX_GRID: usize = 1 << 16;

/// The loaded kernels of `ops.cu` (entry points named as the CPU ops they port).
pub struct CudaOps {
    embedding: CudaFunction,
    rmsnorm: CudaFunction,
    swiglu: CudaFunction,
    attention: CudaFunction,
    router_topk: CudaFunction,
    router_replay: CudaFunction,
    add_into: CudaFunction,
    gather_rows: CudaFunction,
    moe_combine: CudaFunction,
}

/// A [`Layout`] on the device: what attention and the position embedding read per row.
pub struct DeviceLayout {
    pub rows: usize,
    pub max_context: usize,
    /// `[rows]`: position of each row ([`Layout::positions`]).
    pub positions: CudaSlice<u32>,
    /// `[rows]`: keys each row attends to ([`Layout::context`]'s length).
    pub ctx_len: CudaSlice<u32>,
    /// `[rows * max_context]`: row index of key j of row i (0 past the row's context).
    pub ctx_keys: CudaSlice<u32>,
}

impl DeviceLayout {
    /// Copy `layout`'s positions and attention contexts to the device (queued on `stream`; the
    /// host vectors are staged by the copy, so nothing here must outlive the call).
    pub fn upload(stream: &Arc<CudaStream>, layout: &Layout) -> Result<Self, CudaError> {
        let (rows, s) = (layout.rows(), layout.max_context());
        dim("layout", "rows", rows)?;
        let cells = checked(rows, s, "layout", "rows x max_context")?;
        let mut ctx_len = Vec::with_capacity(rows);
        let mut ctx_keys = vec![0u32; cells];
        for i in 0..rows {
            let (len, key) = layout.context(i);
            ctx_len.push(len as u32);
            for (j, k) in ctx_keys[i * s..][..len].iter_mut().enumerate() {
                *k = key(j) as u32;
            }
        }
        let positions: Vec<u32> = layout.positions().iter().map(|&p| p as u32).collect();
        Self::from_host(stream, s, &positions, &ctx_len, &ctx_keys)
    }

    /// One decode step: position `pos` of each of `seqs` sequences whose keys and values sit in a
    /// cache of `capacity` rows per sequence (sequence `i`'s position `p` at row
    /// `i * capacity + p`); every query attends to its own sequence's positions `0..=pos`.
    pub fn decode_step(
        stream: &Arc<CudaStream>,
        seqs: usize,
        capacity: usize,
        pos: usize,
    ) -> Result<Self, CudaError> {
        Self::decode_rows(stream, seqs, capacity, pos, 1)
    }

    /// `count` decode steps' rows at once: positions `pos..pos + count` of each sequence,
    /// sequence-major (row `i * count + j` is sequence `i`'s position `pos + j`, attending to its
    /// positions `0..=pos + j`).
    pub fn decode_rows(
        stream: &Arc<CudaStream>,
        seqs: usize,
        capacity: usize,
        pos: usize,
        count: usize,
    ) -> Result<Self, CudaError> {
        if pos + count > capacity {
            return Err(shape(format!(
                "decode step: positions {pos}..{} past a cache of {capacity} positions",
                pos + count
            )));
        }
        let s = pos + count;
        let rows = checked(seqs, count, "decode step", "sequences x positions")?;
        let cells = checked(rows, s, "decode step", "rows x positions")?;
        checked(seqs, capacity, "decode step", "sequences x capacity")
            .and_then(|rows| dim("decode step", "cache rows", rows))?;
        let (mut positions, mut ctx_len) = (Vec::with_capacity(rows), Vec::with_capacity(rows));
        let mut ctx_keys = vec![0u32; cells];
        for i in 0..seqs {
            for j in 0..count {
                let (r, len) = (i * count + j, pos + j + 1);
                positions.push((pos + j) as u32);
                ctx_len.push(len as u32);
                for (p, k) in ctx_keys[r * s..][..len].iter_mut().enumerate() {
                    *k = (i * capacity + p) as u32;
                }
            }
        }
        Self::from_host(stream, s, &positions, &ctx_len, &ctx_keys)
    }

    /// `(rows, max_context)`, after checking that the context arrays have that shape.
    pub(super) fn check(&self, op: &str) -> Result<(usize, usize), CudaError> {
        let (n, s) = (self.rows, self.max_context);
        if self.ctx_len.len() != n || self.ctx_keys.len() != checked(n, s, op, "rows x S")? {
            return Err(shape(format!(
                "{op}: DeviceLayout of {n} rows x {s} keys has ctx_len {} and ctx_keys {}",
                self.ctx_len.len(),
                self.ctx_keys.len()
            )));
        }
        Ok((n, s))
    }

    fn from_host(
        stream: &Arc<CudaStream>,
        max_context: usize,
        positions: &[u32],
        ctx_len: &[u32],
        ctx_keys: &[u32],
    ) -> Result<Self, CudaError> {
        Ok(DeviceLayout {
            rows: positions.len(),
            max_context,
            positions: upload(stream, positions)?,
            ctx_len: upload(stream, ctx_len)?,
            ctx_keys: upload(stream, ctx_keys)?,
        })
    }
}

/// `v` on the device; an empty slice becomes cudarc's null slice (a zero-byte allocation is an
/// error on some drivers).
fn upload(stream: &Arc<CudaStream>, v: &[u32]) -> Result<CudaSlice<u32>, CudaError> {
    Ok(if v.is_empty() {
        stream.null()?
    } else {
        stream.clone_htod(v)?
    })
}

pub(super) fn shape(msg: String) -> CudaError {
    CudaError::Shape(msg)
}

/// `have >= want`, or a Shape error naming the op and the buffer.
pub(super) fn need(op: &str, name: &str, have: usize, want: usize) -> Result<(), CudaError> {
    if have < want {
        return Err(shape(format!(
            "{op}: {name} holds {have} elements, needs at least {want}"
        )));
    }
    Ok(())
}

/// A dimension as the kernels' u32.
pub(super) fn dim(op: &str, name: &str, v: usize) -> Result<u32, CudaError> {
    u32::try_from(v).map_err(|_| shape(format!("{op}: {name} = {v} exceeds u32")))
}

pub(super) fn checked(a: usize, b: usize, op: &str, what: &str) -> Result<usize, CudaError> {
    a.checked_mul(b)
        .ok_or_else(|| shape(format!("{op}: {what} = {a} x {b} overflows")))
}

/// A thread per item (grid-stride past `MAX_GRID` blocks).
pub(super) fn cfg(items: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            items.div_ceil(THREADS as usize).clamp(1, MAX_GRID) as u32,
            1,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A warp per item.
pub(super) fn cfg_warps(items: usize) -> LaunchConfig {
    cfg(items.saturating_mul(32))
}

impl CudaOps {
    /// Compile and load `ops.cu` on `dev` (once per device).
    pub fn new(dev: &Arc<CudaDevice>) -> Result<Self, CudaError> {
        let m = dev.compile_with_prelude("ops", SRC)?;
        let f = |name: &str| m.load_function(name);
        Ok(CudaOps {
            embedding: f("embedding_forward")?,
            rmsnorm: f("rmsnorm_forward")?,
            swiglu: f("swiglu_forward")?,
            attention: f("attention_forward")?,
            router_topk: f("router_topk")?,
            router_replay: f("router_replay")?,
            add_into: f("add_into")?,
            gather_rows: f("gather_rows")?,
            moe_combine: f("moe_combine")?,
        })
    }

    /// out [n, d] = wte[tokens[i]] + wpe[positions[i]] ([`crate::engine::ops::embedding_forward`]
    /// with `pos(i) = positions[i]`); wte [V, d], wpe [S, d]. Bit-identical.
    #[allow(clippy::too_many_arguments)]
    pub fn embedding_forward(
        &self,
        stream: &Arc<CudaStream>,
        out: &mut CudaSlice<f32>,
        tokens: &CudaSlice<u32>,
        positions: &CudaSlice<u32>,
        wte: &CudaSlice<f32>,
        wpe: &CudaSlice<f32>,
        n: usize,
        d: usize,
    ) -> Result<(), CudaError> {
        let op = "embedding_forward";
        if d == 0 {
            return Err(shape(format!("{op}: d = 0")));
        }
        let nd = checked(n, d, op, "n x d")?;
        need(op, "out", out.len(), nd)?;
        need(op, "tokens", tokens.len(), n)?;
        need(op, "positions", positions.len(), n)?;
        let (n32, d32) = (dim(op, "n", n)?, dim(op, "d", d)?);
        let vocab = dim(op, "wte rows", wte.len() / d)?;
        let npos = dim(op, "wpe rows", wpe.len() / d)?;
        if nd == 0 {
            return Ok(());
        }
        let mut b = stream.launch_builder(&self.embedding);
        b.arg(out).arg(tokens).arg(positions).arg(wte).arg(wpe);
        b.arg(&n32).arg(&d32).arg(&vocab).arg(&npos);
        // SAFETY: element idx < n*d <= out.len(); row i < n indexes tokens and positions (>= n
        // each); wte/wpe are read at t*d + c, p*d + c only for t < vocab = wte.len()/d and
        // p < npos = wpe.len()/d, c < d.
        unsafe { b.launch(cfg(nd)) }?;
        Ok(())
    }

    /// out [n, d] = x · rstd · g, rstd [n] = 1 / sqrt(mean(x²) + ε)
    /// ([`crate::engine::ops::rmsnorm_forward`]); the sum of squares runs in one thread in column
    /// order, so the result is bit-identical.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_forward(
        &self,
        stream: &Arc<CudaStream>,
        out: &mut CudaSlice<f32>,
        rstd: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        g: &CudaSlice<f32>,
        n: usize,
        d: usize,
    ) -> Result<(), CudaError> {
        let op = "rmsnorm_forward";
        let nd = checked(n, d, op, "n x d")?;
        need(op, "x", x.len(), nd)?;
        need(op, "out", out.len(), nd)?;
        need(op, "rstd", rstd.len(), n)?;
        need(op, "g", g.len(), d)?;
        let (n32, d32) = (dim(op, "n", n)?, dim(op, "d", d)?);
        if n == 0 {
            return Ok(());
        }
        // The CPU divides by `d as f32` and adds the crate's epsilon: the same FP32 values.
        let (d_f, eps) = (d as f32, RMSNORM_EPS);
        let mut b = stream.launch_builder(&self.rmsnorm);
        b.arg(out).arg(rstd).arg(x).arg(g);
        b.arg(&n32).arg(&d32).arg(&d_f).arg(&eps);
        // SAFETY: a warp per row r < n: x and out are touched at r*d + c, c < d (n*d elements
        // each, checked), rstd at r < n, g at c < d.
        unsafe { b.launch(cfg_warps(n)) }?;
        Ok(())
    }

    /// out [n, f] = silu(gate) · up on inp [n, 2f] ([`crate::engine::ops::swiglu_forward`]).
    /// Within an ulp or two of the CPU (the GPU's `expf`).
    pub fn swiglu_forward(
        &self,
        stream: &Arc<CudaStream>,
        out: &mut CudaSlice<f32>,
        inp: &CudaSlice<f32>,
        n: usize,
        f: usize,
    ) -> Result<(), CudaError> {
        let op = "swiglu_forward";
        let nf = checked(n, f, op, "n x f")?;
        need(op, "out", out.len(), nf)?;
        need(op, "inp", inp.len(), checked(nf, 2, op, "n x 2f")?)?;
        let (n32, f32_) = (dim(op, "n", n)?, dim(op, "f", f)?);
        if nf == 0 {
            return Ok(());
        }
        let mut b = stream.launch_builder(&self.swiglu);
        b.arg(out).arg(inp).arg(&n32).arg(&f32_);
        // SAFETY: element idx < n*f <= out.len(); reads at i*2f + c and i*2f + f + c with i < n,
        // c < f stay below n*2f <= inp.len().
        unsafe { b.launch(cfg(nf)) }?;
        Ok(())
    }

    /// Causal attention over `layout`'s rows ([`crate::engine::ops::attention_forward`]):
    /// out [n, d] and probs [n, h, S] (S = `layout.max_context`, zero past each row's context)
    /// from qkv [n, 3d], n = `layout.rows`. Scores use the CPU's `dot` order and the softmax its
    /// sums, so only `expf` separates it from the CPU (tolerance).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_forward(
        &self,
        stream: &Arc<CudaStream>,
        out: &mut CudaSlice<f32>,
        probs: &mut CudaSlice<f32>,
        qkv: &CudaSlice<f32>,
        layout: &DeviceLayout,
        h: usize,
        d: usize,
    ) -> Result<(), CudaError> {
        let keys = layout.rows;
        self.attention_over(stream, out, probs, qkv, (qkv, keys), layout, h, d)
    }

    /// As [`CudaOps::attention_forward`], but keys and values come from the K and V columns of
    /// `kv` ([rows, 3d]: a decoder's KV cache), which `layout`'s key indices address; queries are
    /// the Q columns of q [layout.rows, 3d]. The CPU counterpart is `ops::attention_step` (same
    /// sums in the same order).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_over(
        &self,
        stream: &Arc<CudaStream>,
        out: &mut CudaSlice<f32>,
        probs: &mut CudaSlice<f32>,
        q: &CudaSlice<f32>,
        (kv, kv_rows): (&CudaSlice<f32>, usize),
        layout: &DeviceLayout,
        h: usize,
        d: usize,
    ) -> Result<(), CudaError> {
        let op = "attention_forward";
        if h == 0 || !d.is_multiple_of(h) {
            return Err(shape(format!("{op}: d = {d} is not a multiple of h = {h}")));
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
            return Ok(());
        }
        // As the CPU computes it: 1 / sqrt(Dh) in FP32.
        let scale: f32 = 1.0 / ((d / h) as f32).sqrt();
        let mut b = stream.launch_builder(&self.attention);
        b.arg(out)
            .arg(probs)
            .arg(q)
            .arg(kv)
            .arg(&layout.ctx_len)
            .arg(&layout.ctx_keys);
        b.arg(&n32)
            .arg(&nk32)
            .arg(&h32)
            .arg(&d32)
            .arg(&s32)
            .arg(&scale);
        // SAFETY: a warp per (row i < n, head < h): probs row (i*h + head)*S .. +S is inside
        // n*h*S; keys j < min(ctx_len[i], S) are read at i*S + j < n*S = ctx_keys.len(); q is
        // read at row i < n (q holds n*3d); a key row is used only if < kv_rows, so kv reads stay
        // below kv_rows*3d (checked); out at i*d + head*dh + c, c < dh.
        unsafe { b.launch(cfg_warps(nh)) }?;
        Ok(())
    }

    /// Router ([`crate::engine::ops::router_forward`]): probs [n, e] = softmax(logits), ids
    /// [n, k] = the top k (ties to the lower expert, as `select_top_k`) or `replay` [n, k],
    /// weights [n, k] = p[id] / Σ p[ids] in the CPU's order. A replayed id >= e gives NaN weights.
    #[allow(clippy::too_many_arguments)]
    pub fn router_forward(
        &self,
        stream: &Arc<CudaStream>,
        probs: &mut CudaSlice<f32>,
        ids: &mut CudaSlice<u32>,
        weights: &mut CudaSlice<f32>,
        logits: &CudaSlice<f32>,
        n: usize,
        e: usize,
        k: usize,
        replay: Option<&CudaSlice<u32>>,
    ) -> Result<(), CudaError> {
        let op = "router_forward";
        if k == 0 || k > e {
            return Err(shape(format!("{op}: top-k {k} of {e} experts")));
        }
        let (ne, nk) = (checked(n, e, op, "n x e")?, checked(n, k, op, "n x k")?);
        need(op, "probs", probs.len(), ne)?;
        need(op, "logits", logits.len(), ne)?;
        need(op, "ids", ids.len(), nk)?;
        need(op, "weights", weights.len(), nk)?;
        if let Some(r) = replay {
            need(op, "replay", r.len(), nk)?;
        }
        let (n32, e32, k32) = (dim(op, "n", n)?, dim(op, "e", e)?, dim(op, "k", k)?);
        if n == 0 {
            return Ok(());
        }
        let f = match replay {
            Some(_) => &self.router_replay,
            None => &self.router_topk,
        };
        let mut b = stream.launch_builder(f);
        b.arg(probs).arg(ids).arg(weights).arg(logits);
        if let Some(r) = replay {
            b.arg(r);
        }
        b.arg(&n32).arg(&e32).arg(&k32);
        // SAFETY: a thread per row r < n: probs and logits at r*e + i, i < e (n*e each); ids,
        // weights and replay at r*k + j, j < k (n*k each); p is indexed by an id only if < e.
        unsafe { b.launch(cfg(n)) }?;
        Ok(())
    }

    /// [`Self::router_forward`] into fresh buffers: the chosen experts `[n, k]` and their gate
    /// weights, `replay` (host ids, `[n, k]`) copied to the device first. The softmax
    /// probabilities are not kept (no backward reads them).
    #[allow(clippy::too_many_arguments)]
    pub fn route(
        &self,
        stream: &Arc<CudaStream>,
        logits: &CudaSlice<f32>,
        n: usize,
        e: usize,
        k: usize,
        replay: Option<&[u32]>,
    ) -> Result<(CudaSlice<u32>, CudaSlice<f32>), CudaError> {
        // Not zeroed: the router writes every row's probabilities, ids and weights.
        // SAFETY: device memory, fully written by `router_forward` before any read.
        let mut probs = unsafe { stream.alloc::<f32>((n * e).max(1))? };
        let mut ids = unsafe { stream.alloc::<u32>((n * k).max(1))? };
        let mut weights = unsafe { stream.alloc::<f32>((n * k).max(1))? };
        let replay = replay.map(|r| stream.clone_htod(r)).transpose()?;
        self.router_forward(
            stream,
            &mut probs,
            &mut ids,
            &mut weights,
            logits,
            n,
            e,
            k,
            replay.as_ref(),
        )?;
        Ok((ids, weights))
    }

    /// dst[..len] += src[..len] (the model's `add_into`). Bit-identical.
    pub fn add_into(
        &self,
        stream: &Arc<CudaStream>,
        dst: &mut CudaSlice<f32>,
        src: &CudaSlice<f32>,
        len: usize,
    ) -> Result<(), CudaError> {
        let op = "add_into";
        need(op, "dst", dst.len(), len)?;
        need(op, "src", src.len(), len)?;
        if len == 0 {
            return Ok(());
        }
        let len64 = len as u64;
        let mut b = stream.launch_builder(&self.add_into);
        b.arg(dst).arg(src).arg(&len64);
        // SAFETY: indices below len <= dst.len(), src.len().
        unsafe { b.launch(cfg(len)) }?;
        Ok(())
    }

    /// dst[r] = src[rows[r]] for r < m, rows of width d (an expert's tokens, as `expert_forward`
    /// gathers them). A row index past src's rows gives a NaN row. Bit-identical.
    #[allow(clippy::too_many_arguments)]
    pub fn gather_rows(
        &self,
        stream: &Arc<CudaStream>,
        dst: &mut CudaSlice<f32>,
        src: &CudaSlice<f32>,
        rows: &CudaSlice<u32>,
        m: usize,
        d: usize,
    ) -> Result<(), CudaError> {
        let op = "gather_rows";
        if d == 0 {
            return Err(shape(format!("{op}: d = 0")));
        }
        let md = checked(m, d, op, "m x d")?;
        need(op, "dst", dst.len(), md)?;
        need(op, "rows", rows.len(), m)?;
        let (m32, d32) = (dim(op, "m", m)?, dim(op, "d", d)?);
        let src_rows = dim(op, "src rows", src.len() / d)?;
        if md == 0 {
            return Ok(());
        }
        let mut b = stream.launch_builder(&self.gather_rows);
        b.arg(dst)
            .arg(src)
            .arg(rows)
            .arg(&m32)
            .arg(&d32)
            .arg(&src_rows);
        // SAFETY: element idx < m*d <= dst.len(); rows read at r < m; src read at sr*d + c only
        // for sr < src.len()/d, c < d.
        unsafe { b.launch(cfg(md)) }?;
        Ok(())
    }

    /// The end of `model.rs`'s `moe_forward`: out[t] = shared_y[t], then for t's k slots
    /// s = t*k + j in ascending (expert id, j) order (the CPU's loop over experts and their slot
    /// lists) out[t] += weights[s] · y_all[slot_row[s]], then out[t] += x[t]. y_all holds every
    /// expert's output rows [*, d]; a slot row past them gives NaN. Bit-identical.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_combine(
        &self,
        stream: &Arc<CudaStream>,
        out: &mut CudaSlice<f32>,
        shared_y: &CudaSlice<f32>,
        y_all: &CudaSlice<f32>,
        slot_row: &CudaSlice<u32>,
        ids: &CudaSlice<u32>,
        weights: &CudaSlice<f32>,
        x: &CudaSlice<f32>,
        n: usize,
        k: usize,
        d: usize,
    ) -> Result<(), CudaError> {
        let op = "moe_combine";
        if d == 0 {
            return Err(shape(format!("{op}: d = 0")));
        }
        let (nd, nk) = (checked(n, d, op, "n x d")?, checked(n, k, op, "n x k")?);
        need(op, "out", out.len(), nd)?;
        need(op, "shared_y", shared_y.len(), nd)?;
        need(op, "x", x.len(), nd)?;
        need(op, "slot_row", slot_row.len(), nk)?;
        need(op, "ids", ids.len(), nk)?;
        need(op, "weights", weights.len(), nk)?;
        let (n32, k32, d32) = (dim(op, "n", n)?, dim(op, "k", k)?, dim(op, "d", d)?);
        let y_rows = dim(op, "y_all rows", y_all.len() / d)?;
        if nd == 0 {
            return Ok(());
        }
        let mut b = stream.launch_builder(&self.moe_combine);
        b.arg(out)
            .arg(shared_y)
            .arg(y_all)
            .arg(slot_row)
            .arg(ids)
            .arg(weights)
            .arg(x);
        b.arg(&n32).arg(&k32).arg(&d32).arg(&y_rows);
        // SAFETY: element idx = t*d + c < n*d (out, shared_y, x); slots t*k + j < n*k (ids,
        // weights, slot_row); y_all read at row*d + c only for row < y_all.len()/d.
        unsafe { b.launch(cfg(nd)) }?;
        Ok(())
    }
}

//! Backward ops on the device (`backward.cu`), each the counterpart of an `engine::ops` backward
//! function and of a forward in [`super::ops`]: the first pieces of a resident trainer. Like the
//! CPU functions they accumulate into their gradient buffers. RMSNorm, the router and the
//! embedding give the CPU's bits (their sums run in one thread in the CPU's order); SwiGLU calls
//! `expf`, so it agrees to a tolerance. Tested against the CPU in `tests/cuda_backward.rs` (passing
//! on the H200, 2026-12-03; see docs/cuda.md).
//!
//! Attention's backward is bit-identical too: it reads the forward's softmax weights instead of
//! recomputing them, so no `expf` is involved, and its key and value gradients gather over each
//! layout group's query rows in the CPU's order ([`DeviceGroups`]).
//!
//! The linear layers' backward (GEMMs plus the gradient quantization of `engine::linear`) is
//! `cuda::linear`; `cuda::train` puts them all together into `model::backward`.

use super::ops::{DeviceLayout, cfg, cfg_warps, checked, dim, need, shape};
use super::{CudaDevice, CudaError};
use crate::engine::layout::Layout;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, PushKernelArg};
use std::sync::Arc;

const SRC: &str = include_str!("backward.cu");

/// The loaded kernels of `backward.cu`.
pub struct CudaBackwardOps {
    rmsnorm_dx: CudaFunction,
    rmsnorm_dg: CudaFunction,
    swiglu: CudaFunction,
    router: CudaFunction,
    embedding: CudaFunction,
    attention_dq: CudaFunction,
    attention_dkv: CudaFunction,
    adamw_step: CudaFunction,
    adamw_sums: CudaFunction,
}

/// One AdamW update's hyperparameters (`optim::AdamW::update`): step `t` (from 1), the gradient
/// scale (clipping) and the tensor's weight decay.
#[derive(Debug, Clone, Copy)]
pub struct AdamStep {
    pub t: i32,
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub scale: f32,
    pub weight_decay: f32,
}

/// Each row's layout group on the device (`[first, end)` row ranges): attention's key and value
/// gradients gather over the query rows of the key's group.
pub struct DeviceGroups {
    first: CudaSlice<u32>,
    end: CudaSlice<u32>,
}

impl DeviceGroups {
    pub fn upload(stream: &Arc<CudaStream>, layout: &Layout) -> Result<Self, CudaError> {
        let n = layout.rows();
        let (mut first, mut end) = (vec![0u32; n], vec![0u32; n]);
        for g in 0..layout.groups() {
            let rows = layout.group_rows(g);
            for r in rows.clone() {
                first[r] = rows.start as u32;
                end[r] = rows.end as u32;
            }
        }
        dim("layout", "rows", n)?;
        let up = |v: &[u32]| -> Result<CudaSlice<u32>, CudaError> {
            Ok(if v.is_empty() {
                stream.null()?
            } else {
                stream.clone_htod(v)?
            })
        };
        Ok(DeviceGroups {
            first: up(&first)?,
            end: up(&end)?,
        })
    }
}

impl CudaBackwardOps {
    /// Compile and load `backward.cu` on `dev`.
    pub fn new(dev: &Arc<CudaDevice>) -> Result<Self, CudaError> {
        let m = dev.compile_with_prelude("backward", SRC)?;
        let f = |name: &str| m.load_function(name);
        Ok(CudaBackwardOps {
            rmsnorm_dx: f("rmsnorm_backward_dx")?,
            rmsnorm_dg: f("rmsnorm_backward_dg")?,
            swiglu: f("swiglu_backward")?,
            router: f("router_backward")?,
            embedding: f("embedding_backward")?,
            attention_dq: f("attention_backward_dq")?,
            attention_dkv: f("attention_backward_dkv")?,
            adamw_step: f("adamw_step")?,
            adamw_sums: f("adamw_sums")?,
        })
    }

    /// dx [n, d] +=, dg [d] += from dout [n, d]; x, g, rstd as the forward left them
    /// ([`crate::engine::ops::rmsnorm_backward`]). Bit-identical: a warp per row with the row's
    /// sum in one lane, then a thread per column summing over rows in order.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_backward(
        &self,
        stream: &Arc<CudaStream>,
        dx: &mut CudaSlice<f32>,
        dg: &mut CudaSlice<f32>,
        dout: &CudaSlice<f32>,
        x: &CudaSlice<f32>,
        g: &CudaSlice<f32>,
        rstd: &CudaSlice<f32>,
        n: usize,
        d: usize,
    ) -> Result<(), CudaError> {
        let op = "rmsnorm_backward";
        let nd = checked(n, d, op, "n x d")?;
        need(op, "dx", dx.len(), nd)?;
        need(op, "dout", dout.len(), nd)?;
        need(op, "x", x.len(), nd)?;
        need(op, "dg", dg.len(), d)?;
        need(op, "g", g.len(), d)?;
        need(op, "rstd", rstd.len(), n)?;
        let (n32, d32) = (dim(op, "n", n)?, dim(op, "d", d)?);
        if nd == 0 {
            return Ok(());
        }
        let d_f = d as f32;
        let mut b = stream.launch_builder(&self.rmsnorm_dx);
        b.arg(&mut *dx).arg(dout).arg(x).arg(g).arg(rstd);
        b.arg(&n32).arg(&d32).arg(&d_f);
        // SAFETY: a warp per row r < n: dx, dout, x at r*d + c, c < d (n*d each, checked), g at
        // c < d, rstd at r < n.
        unsafe { b.launch(cfg_warps(n)) }?;
        let mut b = stream.launch_builder(&self.rmsnorm_dg);
        b.arg(dg).arg(dout).arg(x).arg(rstd).arg(&n32).arg(&d32);
        // SAFETY: a thread per column c < d (dg holds d); dout and x read at r*d + c, r < n.
        unsafe { b.launch(cfg(d)) }?;
        Ok(())
    }

    /// dinp [n, 2f] += from dout [n, f], inp [n, 2f] the forward's input
    /// ([`crate::engine::ops::swiglu_backward`]). Within an ulp or two of the CPU (`expf`).
    pub fn swiglu_backward(
        &self,
        stream: &Arc<CudaStream>,
        dinp: &mut CudaSlice<f32>,
        dout: &CudaSlice<f32>,
        inp: &CudaSlice<f32>,
        n: usize,
        f: usize,
    ) -> Result<(), CudaError> {
        let op = "swiglu_backward";
        let nf = checked(n, f, op, "n x f")?;
        let n2f = checked(nf, 2, op, "n x 2f")?;
        need(op, "dinp", dinp.len(), n2f)?;
        need(op, "inp", inp.len(), n2f)?;
        need(op, "dout", dout.len(), nf)?;
        let (n32, f32_) = (dim(op, "n", n)?, dim(op, "f", f)?);
        if nf == 0 {
            return Ok(());
        }
        let mut b = stream.launch_builder(&self.swiglu);
        b.arg(dinp).arg(dout).arg(inp).arg(&n32).arg(&f32_);
        // SAFETY: element idx < n*f reads dout[idx] (n*f) and touches dinp/inp at i*2f + c and
        // i*2f + f + c, i < n, c < f: below n*2f (checked).
        unsafe { b.launch(cfg(nf)) }?;
        Ok(())
    }

    /// dlogits [n, e] += from dweights [n, k], with the forward's ids and weights
    /// ([`crate::engine::ops::router_backward`]). Bit-identical; a row with an id >= e is NaN.
    #[allow(clippy::too_many_arguments)]
    pub fn router_backward(
        &self,
        stream: &Arc<CudaStream>,
        dlogits: &mut CudaSlice<f32>,
        dweights: &CudaSlice<f32>,
        ids: &CudaSlice<u32>,
        weights: &CudaSlice<f32>,
        n: usize,
        e: usize,
        k: usize,
    ) -> Result<(), CudaError> {
        let op = "router_backward";
        if k == 0 || k > e {
            return Err(shape(format!("{op}: top-k {k} of {e} experts")));
        }
        let nk = checked(n, k, op, "n x k")?;
        need(op, "dlogits", dlogits.len(), checked(n, e, op, "n x e")?)?;
        need(op, "dweights", dweights.len(), nk)?;
        need(op, "ids", ids.len(), nk)?;
        need(op, "weights", weights.len(), nk)?;
        let (n32, e32, k32) = (dim(op, "n", n)?, dim(op, "e", e)?, dim(op, "k", k)?);
        if n == 0 {
            return Ok(());
        }
        let mut b = stream.launch_builder(&self.router);
        b.arg(dlogits).arg(dweights).arg(ids).arg(weights);
        b.arg(&n32).arg(&e32).arg(&k32);
        // SAFETY: a thread per row r < n reads dweights/ids/weights at r*k + j, j < k (n*k each)
        // and writes dlogits at r*e + id only for id < e (else r*e + c, c < e): below n*e.
        unsafe { b.launch(cfg(n)) }?;
        Ok(())
    }

    /// dwte [V, d] +=, dwpe [S, d] += from dout [n, d] at each row's token and position
    /// ([`crate::engine::ops::embedding_backward`]). Bit-identical: a thread per column adds the
    /// rows in order. A token or position out of range turns column c of row 0 of both tables
    /// into NaN rather than writing outside them.
    #[allow(clippy::too_many_arguments)]
    pub fn embedding_backward(
        &self,
        stream: &Arc<CudaStream>,
        dwte: &mut CudaSlice<f32>,
        dwpe: &mut CudaSlice<f32>,
        dout: &CudaSlice<f32>,
        tokens: &CudaSlice<u32>,
        positions: &CudaSlice<u32>,
        n: usize,
        d: usize,
    ) -> Result<(), CudaError> {
        let op = "embedding_backward";
        if d == 0 {
            return Err(shape(format!("{op}: d = 0")));
        }
        need(op, "dout", dout.len(), checked(n, d, op, "n x d")?)?;
        need(op, "tokens", tokens.len(), n)?;
        need(op, "positions", positions.len(), n)?;
        let (n32, d32) = (dim(op, "n", n)?, dim(op, "d", d)?);
        let vocab = dim(op, "dwte rows", dwte.len() / d)?;
        let npos = dim(op, "dwpe rows", dwpe.len() / d)?;
        if n == 0 {
            return Ok(());
        }
        let mut b = stream.launch_builder(&self.embedding);
        b.arg(dwte).arg(dwpe).arg(dout).arg(tokens).arg(positions);
        b.arg(&n32).arg(&d32).arg(&vocab).arg(&npos);
        // SAFETY: a thread per column c < d; dout read at i*d + c, i < n; dwte/dwpe touched at
        // t*d + c, p*d + c only for t < vocab = dwte.len()/d, p < npos = dwpe.len()/d, or at c
        // (row 0) when that table has a row.
        unsafe { b.launch(cfg(d)) }?;
        Ok(())
    }

    /// dqkv [n, 3d] += from dout [n, d], with the forward's qkv [n, 3d] and softmax weights probs
    /// [n, h, S] over `layout`'s rows ([`crate::engine::ops::attention_backward`]): dP = dO·Vᵀ,
    /// dS = P∘(dP − rowsum(P∘dP))/√Dh, dQ = dS·K, dK = dSᵀ·Q, dV = Pᵀ·dO. Bit-identical: the
    /// CPU's `dot`, its sums in its order, no `expf`.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_backward(
        &self,
        stream: &Arc<CudaStream>,
        dqkv: &mut CudaSlice<f32>,
        dout: &CudaSlice<f32>,
        qkv: &CudaSlice<f32>,
        probs: &CudaSlice<f32>,
        layout: &DeviceLayout,
        groups: &DeviceGroups,
        h: usize,
        d: usize,
    ) -> Result<(), CudaError> {
        let op = "attention_backward";
        if h == 0 || !d.is_multiple_of(h) {
            return Err(shape(format!("{op}: d = {d} is not a multiple of h = {h}")));
        }
        let (n, s) = layout.check(op)?;
        need(
            op,
            "group rows",
            groups.first.len().min(groups.end.len()),
            n,
        )?;
        let nd = checked(n, d, op, "n x d")?;
        let n3d = checked(nd, 3, op, "n x 3d")?;
        need(op, "dqkv", dqkv.len(), n3d)?;
        need(op, "qkv", qkv.len(), n3d)?;
        need(op, "dout", dout.len(), nd)?;
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
            return Ok(());
        }
        let scale: f32 = 1.0 / ((d / h) as f32).sqrt();
        let mut ds = stream.alloc_zeros::<f32>(nhs)?;
        let mut b = stream.launch_builder(&self.attention_dq);
        b.arg(&mut *dqkv).arg(&mut ds).arg(dout).arg(qkv).arg(probs);
        b.arg(&layout.ctx_len).arg(&layout.ctx_keys);
        b.arg(&n32).arg(&h32).arg(&d32).arg(&s32).arg(&scale);
        // SAFETY: a warp per (row i < n, head): ds and probs at (i*h + head)*S + j, j < S
        // (n*h*S each); ctx_keys at i*S + j; qkv read at key rows < n only; dout at i*d + ..
        // and dqkv at i*3d + .. within n*d and n*3d (checked).
        unsafe { b.launch(cfg_warps(nh)) }?;
        let mut b = stream.launch_builder(&self.attention_dkv);
        b.arg(dqkv).arg(&ds).arg(dout).arg(qkv).arg(probs);
        b.arg(&layout.ctx_len).arg(&layout.ctx_keys);
        b.arg(&groups.first).arg(&groups.end);
        b.arg(&n32).arg(&h32).arg(&d32).arg(&s32);
        // SAFETY: a warp per (key row k < n, head): group rows i < min(end, n); ctx_keys at
        // i*S + j, j < S; ds/probs at (i*h + head)*S + j; qkv, dout, dqkv at rows i, k < n
        // within n*3d, n*d (checked); group_first/end hold n entries (checked).
        unsafe { b.launch(cfg_warps(nh)) }?;
        Ok(())
    }

    /// `optim::AdamW::update` for one tensor of `n` values: p, m and v updated in place with the
    /// CPU's arithmetic (bit-identical), and the tensor's Σ step² and Σ p² (after the update)
    /// added to `sums` [2] in FP64, in a fixed order (deterministic; not the CPU's sequential
    /// order, so equal to it to rounding).
    #[allow(clippy::too_many_arguments)]
    pub fn adamw_step(
        &self,
        stream: &Arc<CudaStream>,
        p: &mut CudaSlice<f32>,
        m: &mut CudaSlice<f32>,
        v: &mut CudaSlice<f32>,
        g: &CudaSlice<f32>,
        n: usize,
        h: &AdamStep,
        sums: &mut CudaSlice<f64>,
    ) -> Result<(), CudaError> {
        let op = "adamw_step";
        for (name, len) in [
            ("p", p.len()),
            ("m", m.len()),
            ("v", v.len()),
            ("g", g.len()),
        ] {
            need(op, name, len, n)?;
        }
        need(op, "sums", sums.len(), 2)?;
        if h.t < 1 {
            return Err(shape(format!(
                "{op}: step t = {} (steps count from 1)",
                h.t
            )));
        }
        if n == 0 {
            return Ok(());
        }
        // As the CPU computes them, in FP32.
        let (omb1, omb2) = (1.0 - h.beta1, 1.0 - h.beta2);
        let (bc1, bc2) = (1.0 - h.beta1.powi(h.t), 1.0 - h.beta2.powi(h.t));
        let launch = cfg(n);
        let blocks = launch.grid_dim.0;
        let mut partial = stream.alloc_zeros::<f64>(2 * blocks as usize)?;
        let n64 = n as u64;
        let mut b = stream.launch_builder(&self.adamw_step);
        b.arg(p).arg(m).arg(v).arg(g).arg(&n64);
        b.arg(&h.scale)
            .arg(&h.beta1)
            .arg(&h.beta2)
            .arg(&omb1)
            .arg(&omb2);
        b.arg(&bc1)
            .arg(&bc2)
            .arg(&h.lr)
            .arg(&h.eps)
            .arg(&h.weight_decay);
        b.arg(&mut partial);
        // SAFETY: grid-stride over i < n (p, m, v, g hold n each, checked); 256-thread blocks
        // (`cfg`), the kernel's shared arrays; block b writes partial[2b], partial[2b + 1] with
        // b < blocks, partial's 2·blocks entries.
        unsafe { b.launch(launch) }?;
        let mut b = stream.launch_builder(&self.adamw_sums);
        b.arg(&partial).arg(&blocks).arg(sums);
        // SAFETY: one thread reads partial[0 .. 2·blocks) and writes sums[0..2] (checked).
        unsafe { b.launch(cfg(1)) }?;
        Ok(())
    }
}

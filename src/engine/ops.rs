//! The non-matmul ops of the MoE transformer, each a forward/backward pair written side by side as in
//! llm.c's `train_gpt2.c`: explicit output and input buffers, explicit dims, shapes in comments. The
//! matmul sites are not here: they go through `engine::linear` so the precision recipe applies to them.
//! Attention's score and value products are plain FP32: they are not recipe sites.
//!
//! Dimension letters: N tokens (= B·T), B sequences, T positions per sequence, S cache capacity,
//! D model width, H heads, Dh = D/H head width, E experts, K experts per token, F hidden width, V vocab.
//!
//! Conventions. Forward functions overwrite their outputs. Backward functions *add* into their gradient
//! buffers (`+=`, llm.c style), so a residual stream and a parameter shared by several calls sum without
//! temporaries; zero them before the first call. Determinism: work is split only over output rows (or
//! whole sequences), and every reduction over rows (gain and embedding gradients) runs
//! sequentially in row order, so results are bit-identical whatever rayon's thread count.

use super::layout::Layout;
use rayon::prelude::*;

/// Rows per rayon task for row-wise ops: below this the fork/join costs more than the arithmetic.
const ROWS_PER_TASK: usize = 32;

/// RMSNorm epsilon (Qwen3's value).
pub const RMSNORM_EPS: f32 = 1e-6;

// ---------------------------------------------------------------------------------------------------
// RMSNorm with learned gain: y = x · rstd · g, rstd = 1 / sqrt(mean(x²) + ε).

/// out [N, D], rstd [N] (kept for the backward), x [N, D], g [D].
pub fn rmsnorm_forward(
    out: &mut [f32],
    rstd: &mut [f32],
    x: &[f32],
    g: &[f32],
    n: usize,
    d: usize,
) {
    assert_eq!(x.len(), n * d, "rmsnorm input");
    assert_eq!(out.len(), n * d, "rmsnorm output");
    assert_eq!((rstd.len(), g.len()), (n, d), "rmsnorm rstd/gain");
    out.par_chunks_mut(d)
        .zip(rstd.par_iter_mut())
        .zip(x.par_chunks(d))
        .with_min_len(ROWS_PER_TASK)
        .for_each(|((o, r), xr)| {
            let ms = xr.iter().map(|&v| v * v).sum::<f32>() / d as f32;
            let s = 1.0 / (ms + RMSNORM_EPS).sqrt();
            *r = s;
            for ((o, &xv), &gv) in o.iter_mut().zip(xr).zip(g) {
                *o = xv * s * gv;
            }
        });
}

/// dx [N, D] +=, dg [D] +=, from dout [N, D]; x, g, rstd as in the forward.
///
/// dx_j = rstd·g_j·dout_j − rstd³·x_j·Σ_i(dout_i·g_i·x_i)/D; dg_i = Σ_rows dout_i·x_i·rstd.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward(
    dx: &mut [f32],
    dg: &mut [f32],
    dout: &[f32],
    x: &[f32],
    g: &[f32],
    rstd: &[f32],
    n: usize,
    d: usize,
) {
    assert_eq!(
        (dx.len(), dout.len(), x.len()),
        (n * d, n * d, n * d),
        "rmsnorm backward rows"
    );
    assert_eq!(
        (dg.len(), g.len(), rstd.len()),
        (d, d, n),
        "rmsnorm backward gain/rstd"
    );
    dx.par_chunks_mut(d)
        .zip(dout.par_chunks(d))
        .zip(x.par_chunks(d))
        .zip(rstd.par_iter())
        .with_min_len(ROWS_PER_TASK)
        .for_each(|(((dxr, dor), xr), &s)| {
            let dot: f32 = dor
                .iter()
                .zip(g)
                .zip(xr)
                .map(|((&a, &b), &c)| a * b * c)
                .sum();
            let c = s * s * s * dot / d as f32;
            for i in 0..d {
                dxr[i] += s * dor[i] * g[i] - c * xr[i];
            }
        });
    // A reduction over rows: sequential, so its order never depends on the thread count.
    for ((dor, xr), &s) in dout.chunks(d).zip(x.chunks(d)).zip(rstd) {
        for i in 0..d {
            dg[i] += dor[i] * xr[i] * s;
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Causal multi-head self-attention over B sequences of equal length T.
// qkv [N, 3D]: Q in columns 0..D, K in D..2D, V in 2D..3D; head h uses columns h·Dh..(h+1)·Dh of each.
//
// Why not the CPU GEMM (`backend::cpu::gemm`) here: at the benchmark shape (T = 16, Dh = 32)
// each (sequence, head) product is 16×32×16, and matrixmultiply spent its time packing (13-27 ms
// per layer forward at B = 256 on 2 cores, against 3-4 ms for these loops). The loops below use
// one `dot`/`axpy` pair shared with the decoder's [`attention_step`], so the incremental decoder does the same arithmetic in the same order.

/// Dot product with 8 independent partial sums (so it vectorizes) combined in a fixed order: the same
/// inputs give the same bits everywhere it is used.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let (ca, ra) = a.as_chunks::<8>();
    let (cb, rb) = b.as_chunks::<8>();
    let mut acc = [0.0f32; 8];
    for (x, y) in ca.iter().zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// `y += alpha · x`.
fn axpy(y: &mut [f32], alpha: f32, x: &[f32]) {
    y.iter_mut().zip(x).for_each(|(a, &b)| *a += alpha * b);
}

/// `row = softmax(row · scale)`, max-subtracted.
fn softmax_in_place(row: &mut [f32], scale: f32) {
    let mut max = f32::NEG_INFINITY;
    for v in row.iter_mut() {
        *v *= scale;
        max = max.max(*v);
    }
    let mut sum = 0.0f32;
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    row.iter_mut().for_each(|v| *v *= inv);
}

/// One query row against keys/values `0..len` (rows `kv(j)` give (K_j, V_j)): writes the softmax
/// weights to `p[..len]` and the output to `o` [Dh]. Shared by the full forward and the decoder.
fn attend_row<'a>(
    o: &mut [f32],
    p: &mut [f32],
    q: &[f32],
    len: usize,
    scale: f32,
    kv: impl Fn(usize) -> (&'a [f32], &'a [f32]),
) {
    for (j, pj) in p[..len].iter_mut().enumerate() {
        *pj = dot(q, kv(j).0);
    }
    softmax_in_place(&mut p[..len], scale);
    o.fill(0.0);
    for (j, &pj) in p[..len].iter().enumerate() {
        axpy(o, pj, kv(j).1);
    }
}

/// out [N, D] (written), probs [N, H, S] (written: each row's softmax weights over its context, at
/// most S = `layout.max_context()` positions, kept for the backward, zero past the context), qkv [N, 3D].
/// P = softmax(Q·Kᵀ/√Dh) over each row's context (causal, within its sequence: see
/// [`Layout::context`]), O = P·V. One rayon task per group of the layout (attention never crosses
/// groups, and a group's rows of `out` and `probs` are contiguous, so tasks never share an output).
pub fn attention_forward(
    out: &mut [f32],
    probs: &mut [f32],
    qkv: &[f32],
    layout: &Layout,
    h: usize,
    d: usize,
) {
    let dh = d / h;
    assert_eq!(dh * h, d, "attention: D={d} not divisible by H={h}");
    let (n, s) = (layout.rows(), layout.max_context());
    assert_eq!(
        (qkv.len(), out.len(), probs.len()),
        (n * 3 * d, n * d, n * h * s),
        "attention"
    );
    let scale = 1.0 / (dh as f32).sqrt();
    let row = |i: usize| &qkv[i * 3 * d..][..3 * d];
    layout
        .split_groups(out, d)
        .into_par_iter()
        .zip(layout.split_groups(probs, h * s))
        .enumerate()
        .for_each(|(g, (out_g, probs_g))| {
            let rows = layout.group_rows(g);
            for (li, i) in rows.clone().enumerate() {
                let (len, key) = layout.context(i);
                for hi in 0..h {
                    let kv = |j: usize| {
                        let r = row(key(j));
                        (&r[d + hi * dh..][..dh], &r[2 * d + hi * dh..][..dh])
                    };
                    let p = &mut probs_g[(li * h + hi) * s..][..s];
                    let o = &mut out_g[li * d + hi * dh..][..dh];
                    attend_row(o, p, &row(i)[hi * dh..][..dh], len, scale, kv);
                    p[len..].fill(0.0);
                }
            }
        });
}

/// dqkv [N, 3D] +=, from dout [N, D]; qkv and probs as in the forward.
/// dP = dO·Vᵀ, dS = P∘(dP − rowsum(P∘dP))/√Dh, dQ = dS·K, dK = dSᵀ·Q, dV = Pᵀ·dO. One task per group
/// (a shared prefix row gathers the key/value gradients of every sequence of its group); within it
/// the sums over query rows run in row order.
pub fn attention_backward(
    dqkv: &mut [f32],
    dout: &[f32],
    qkv: &[f32],
    probs: &[f32],
    layout: &Layout,
    h: usize,
    d: usize,
) {
    let dh = d / h;
    let (n, s) = (layout.rows(), layout.max_context());
    assert_eq!(
        (dqkv.len(), dout.len(), probs.len()),
        (n * 3 * d, n * d, n * h * s),
        "attention backward"
    );
    let scale = 1.0 / (dh as f32).sqrt();
    let row = |i: usize| &qkv[i * 3 * d..][..3 * d];
    layout
        .split_groups(dqkv, 3 * d)
        .into_par_iter()
        .enumerate()
        .for_each_init(
            || vec![0.0f32; s],
            |ds, (g, dqkv_g)| {
                let g0 = layout.group_rows(g).start;
                for i in layout.group_rows(g) {
                    let (len, key) = layout.context(i);
                    let li = i - g0;
                    for hi in 0..h {
                        let (qc, kc, vc) = (hi * dh, d + hi * dh, 2 * d + hi * dh);
                        let p = &probs[(i * h + hi) * s..][..len];
                        let d_o = &dout[i * d + hi * dh..][..dh];
                        let ds = &mut ds[..len];
                        for (j, x) in ds.iter_mut().enumerate() {
                            *x = dot(d_o, &row(key(j))[vc..][..dh]); // dP
                        }
                        let sum = dot(p, ds);
                        ds.iter_mut()
                            .zip(p)
                            .for_each(|(x, &pv)| *x = pv * (*x - sum) * scale); // dS
                        for (j, (&dsj, &pj)) in ds.iter().zip(p).enumerate() {
                            let lk = key(j) - g0;
                            axpy(
                                &mut dqkv_g[li * 3 * d + qc..][..dh],
                                dsj,
                                &row(key(j))[kc..][..dh],
                            );
                            axpy(
                                &mut dqkv_g[lk * 3 * d + kc..][..dh],
                                dsj,
                                &row(i)[qc..][..dh],
                            );
                            axpy(&mut dqkv_g[lk * 3 * d + vc..][..dh], pj, d_o);
                        }
                    }
                }
            },
        );
}

/// Incremental attention for the decoder: one new query per sequence against cached keys and values.
/// out [B, D] (written), qkv [B, 3D] (only the Q columns are read), k_cache/v_cache [B, H, S, Dh] with
/// positions 0..len valid (the new position's K/V already written). Same row arithmetic as
/// [`attention_forward`]. No backward: rollout only.
#[allow(clippy::too_many_arguments)]
pub fn attention_step(
    out: &mut [f32],
    qkv: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    b: usize,
    h: usize,
    d: usize,
    s: usize,
    len: usize,
) {
    let dh = d / h;
    assert!(
        len >= 1 && len <= s,
        "attention_step: {len} cached positions, capacity {s}"
    );
    assert_eq!(
        (out.len(), qkv.len(), k_cache.len()),
        (b * d, b * 3 * d, b * h * s * dh),
        "attention_step"
    );
    let scale = 1.0 / (dh as f32).sqrt();
    out.par_chunks_mut(d).enumerate().for_each_init(
        || vec![0.0f32; len],
        |p, (bi, orow)| {
            for hi in 0..h {
                let base = (bi * h + hi) * s * dh;
                let kv = |j: usize| {
                    (
                        &k_cache[base + j * dh..][..dh],
                        &v_cache[base + j * dh..][..dh],
                    )
                };
                attend_row(
                    &mut orow[hi * dh..][..dh],
                    p,
                    &qkv[bi * 3 * d + hi * dh..][..dh],
                    len,
                    scale,
                    kv,
                );
            }
        },
    );
}

// ---------------------------------------------------------------------------------------------------
// SwiGLU on a fused [N, 2F] input: gate = columns 0..F, up = columns F..2F; out = silu(gate) · up.

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// out [N, F] (written), inp [N, 2F].
pub fn swiglu_forward(out: &mut [f32], inp: &[f32], n: usize, f: usize) {
    assert_eq!((out.len(), inp.len()), (n * f, n * 2 * f), "swiglu");
    out.par_chunks_mut(f)
        .zip(inp.par_chunks(2 * f))
        .with_min_len(ROWS_PER_TASK)
        .for_each(|(o, x)| {
            let (gate, up) = x.split_at(f);
            for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
                *o = g * sigmoid(g) * u;
            }
        });
}

/// dinp [N, 2F] +=, from dout [N, F]; silu'(g) = σ(g)·(1 + g·(1 − σ(g))).
pub fn swiglu_backward(dinp: &mut [f32], dout: &[f32], inp: &[f32], n: usize, f: usize) {
    assert_eq!(
        (dinp.len(), dout.len(), inp.len()),
        (n * 2 * f, n * f, n * 2 * f),
        "swiglu backward"
    );
    dinp.par_chunks_mut(2 * f)
        .zip(dout.par_chunks(f))
        .zip(inp.par_chunks(2 * f))
        .with_min_len(ROWS_PER_TASK)
        .for_each(|((dx, dy), x)| {
            let (gate, up) = x.split_at(f);
            let (dgate, dup) = dx.split_at_mut(f);
            for j in 0..f {
                let (g, u) = (gate[j], up[j]);
                let sg = sigmoid(g);
                dgate[j] += dy[j] * u * sg * (1.0 + g * (1.0 - sg));
                dup[j] += dy[j] * g * sg;
            }
        });
}

// ---------------------------------------------------------------------------------------------------
// Router (Qwen3 style): p = softmax(logits) over E experts, select the top K (ties: lower expert index
// wins, so the choice is deterministic), weights = the K selected probabilities renormalized to sum 1.
// The selection is a constant for the backward. Renormalized softmax over a subset equals the softmax of
// the selected logits alone, so the backward only touches the selected logits.

/// probs [N, E], ids [N, K], weights [N, K] (all written) from logits [N, E]. With `replay` ([N, K]
/// expert ids, e.g. the rollout's choice), the selection is forced; probabilities and weights are still
/// computed from these logits.
#[allow(clippy::too_many_arguments)]
pub fn router_forward(
    probs: &mut [f32],
    ids: &mut [u32],
    weights: &mut [f32],
    logits: &[f32],
    n: usize,
    e: usize,
    k: usize,
    replay: Option<&[u32]>,
) {
    assert!(k >= 1 && k <= e, "router: top-k {k} of {e} experts");
    assert_eq!(
        (probs.len(), logits.len()),
        (n * e, n * e),
        "router probs/logits"
    );
    assert_eq!(
        (ids.len(), weights.len()),
        (n * k, n * k),
        "router ids/weights"
    );
    if let Some(r) = replay {
        assert_eq!(r.len(), n * k, "router replay ids");
    }
    probs
        .par_chunks_mut(e)
        .zip(ids.par_chunks_mut(k))
        .zip(weights.par_chunks_mut(k))
        .zip(logits.par_chunks(e))
        .enumerate()
        .with_min_len(ROWS_PER_TASK)
        .for_each(|(row, (((p, id), w), l))| {
            p.copy_from_slice(l);
            softmax_in_place(p, 1.0);
            match replay {
                Some(r) => id.copy_from_slice(&r[row * k..(row + 1) * k]),
                None => select_top_k(p, id),
            }
            let sum: f32 = id.iter().map(|&i| p[i as usize]).sum();
            for (w, &i) in w.iter_mut().zip(id.iter()) {
                *w = p[i as usize] / sum;
            }
        });
}

/// Writes the indices of the `ids.len()` largest values of `p`, largest first; among equal values the
/// lower index comes first (a strict `>` scan keeps the first maximum).
fn select_top_k(p: &[f32], ids: &mut [u32]) {
    for j in 0..ids.len() {
        let mut best: Option<(usize, f32)> = None;
        for (i, &v) in p.iter().enumerate() {
            if ids[..j].contains(&(i as u32)) {
                continue;
            }
            if best.is_none_or(|(_, bv)| v > bv) {
                best = Some((i, v));
            }
        }
        ids[j] = best.map_or(0, |(i, _)| i as u32);
    }
}

/// dlogits [N, E] +=, from dweights [N, K]: for selected i_j, w_j·(dw_j − Σ_k w_k·dw_k); others get 0.
pub fn router_backward(
    dlogits: &mut [f32],
    dweights: &[f32],
    ids: &[u32],
    weights: &[f32],
    n: usize,
    e: usize,
    k: usize,
) {
    assert_eq!(dlogits.len(), n * e, "router backward logits");
    assert_eq!(
        (dweights.len(), ids.len(), weights.len()),
        (n * k, n * k, n * k),
        "router backward"
    );
    dlogits
        .par_chunks_mut(e)
        .zip(dweights.par_chunks(k))
        .zip(ids.par_chunks(k))
        .zip(weights.par_chunks(k))
        .with_min_len(ROWS_PER_TASK)
        .for_each(|(((dl, dw), id), w)| {
            let s: f32 = dw.iter().zip(w).map(|(&a, &b)| a * b).sum();
            for j in 0..k {
                dl[id[j] as usize] += w[j] * (dw[j] - s);
            }
        });
}

// ---------------------------------------------------------------------------------------------------
// Log-softmax and cross-entropy over logits [N, V].

/// logp [N, V] (written) = logits − logsumexp(logits) per row.
pub fn log_softmax_forward(logp: &mut [f32], logits: &[f32], n: usize, v: usize) {
    assert_eq!((logp.len(), logits.len()), (n * v, n * v), "log_softmax");
    logp.par_chunks_mut(v)
        .zip(logits.par_chunks(v))
        .with_min_len(ROWS_PER_TASK)
        .for_each(|(o, l)| {
            let max = l.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            let lse = max + l.iter().map(|&x| (x - max).exp()).sum::<f32>().ln();
            o.iter_mut().zip(l).for_each(|(o, &x)| *o = x - lse);
        });
}

/// dlogits [N, V] +=, from dlogp [N, V]: dl_j = dlogp_j − softmax_j · Σ_i dlogp_i.
pub fn log_softmax_backward(dlogits: &mut [f32], dlogp: &[f32], logp: &[f32], n: usize, v: usize) {
    assert_eq!(
        (dlogits.len(), dlogp.len(), logp.len()),
        (n * v, n * v, n * v),
        "log_softmax backward"
    );
    dlogits
        .par_chunks_mut(v)
        .zip(dlogp.par_chunks(v))
        .zip(logp.par_chunks(v))
        .with_min_len(ROWS_PER_TASK)
        .for_each(|((dl, dp), lp)| {
            let s: f32 = dp.iter().sum();
            for j in 0..v {
                dl[j] += dp[j] - lp[j].exp() * s;
            }
        });
}

// ---------------------------------------------------------------------------------------------------
// Embeddings: token row plus learned position row. Row n sits at position `pos(n)`.

/// out [N, D] (written) = wte[tokens[n]] + wpe[pos(n)]; wte [V, D], wpe [S, D].
pub fn embedding_forward(
    out: &mut [f32],
    tokens: &[u32],
    wte: &[f32],
    wpe: &[f32],
    pos: impl Fn(usize) -> usize + Sync,
    d: usize,
) {
    assert_eq!(out.len(), tokens.len() * d, "embedding output");
    out.par_chunks_mut(d)
        .zip(tokens.par_iter())
        .enumerate()
        .with_min_len(ROWS_PER_TASK)
        .for_each(|(i, (o, &tok))| {
            let te = &wte[tok as usize * d..][..d];
            let pe = &wpe[pos(i) * d..][..d];
            for ((o, &a), &b) in o.iter_mut().zip(te).zip(pe) {
                *o = a + b;
            }
        });
}

/// dwte [V, D] +=, dwpe [S, D] +=, from dout [N, D]: a scatter-add, sequential in row order.
pub fn embedding_backward(
    dwte: &mut [f32],
    dwpe: &mut [f32],
    dout: &[f32],
    tokens: &[u32],
    pos: impl Fn(usize) -> usize,
    d: usize,
) {
    assert_eq!(dout.len(), tokens.len() * d, "embedding backward");
    for (i, (dr, &tok)) in dout.chunks(d).zip(tokens).enumerate() {
        let te = &mut dwte[tok as usize * d..][..d];
        te.iter_mut().zip(dr).for_each(|(a, &b)| *a += b);
        let pe = &mut dwpe[pos(i) * d..][..d];
        pe.iter_mut().zip(dr).for_each(|(a, &b)| *a += b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn randn(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| (rng.random::<f32>() * 2.0 - 1.0) * scale)
            .collect()
    }

    fn dot64(a: &[f32], b: &[f32]) -> f64 {
        a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
    }

    /// Central differences of `loss` at every coordinate of `x`, against `analytic`. Fails on any
    /// coordinate off by more than 1 % + 1e-3 and on a relative error of the whole vector above 1 %
    /// (so a factor-2 or transposed gradient cannot hide behind small coordinates).
    fn check_grad(
        what: &str,
        x: &mut [f32],
        analytic: &[f32],
        eps: f32,
        loss: impl Fn(&[f32]) -> f64,
    ) {
        let (mut err2, mut norm2) = (0.0f64, 0.0f64);
        for i in 0..x.len() {
            let orig = x[i];
            x[i] = orig + eps;
            let (hi, lp) = (x[i] as f64, loss(x));
            x[i] = orig - eps;
            let (lo, lm) = (x[i] as f64, loss(x));
            x[i] = orig;
            let fd = (lp - lm) / (hi - lo);
            let an = analytic[i] as f64;
            assert!(
                (fd - an).abs() <= 1e-2 * fd.abs().max(an.abs()) + 1e-3,
                "{what}[{i}]: finite difference {fd}, backward {an}"
            );
            err2 += (fd - an).powi(2);
            norm2 += fd * fd;
        }
        assert!(
            norm2 > 1e-6,
            "{what}: gradient is all zero, the check proves nothing"
        );
        assert!(
            err2.sqrt() <= 1e-2 * norm2.sqrt(),
            "{what}: relative error {}",
            (err2 / norm2).sqrt()
        );
    }

    #[test]
    fn rmsnorm_gradients_match_finite_differences() {
        let (n, d) = (3, 8);
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let (x, mut g, r) = (
            randn(&mut rng, n * d, 1.0),
            randn(&mut rng, d, 1.0),
            randn(&mut rng, n * d, 1.0),
        );
        let fwd = |x: &[f32], g: &[f32]| {
            let (mut out, mut rstd) = (vec![0.0; n * d], vec![0.0; n]);
            rmsnorm_forward(&mut out, &mut rstd, x, g, n, d);
            (out, rstd)
        };
        let (_, rstd) = fwd(&x, &g);
        let (mut dx, mut dg) = (vec![0.0; n * d], vec![0.0; d]);
        rmsnorm_backward(&mut dx, &mut dg, &r, &x, &g, &rstd, n, d);
        let g0 = g.clone();
        check_grad("rmsnorm dx", &mut x.clone(), &dx, 1e-2, |x| {
            dot64(&fwd(x, &g0).0, &r)
        });
        check_grad("rmsnorm dg", &mut g, &dg, 1e-2, |g| {
            dot64(&fwd(&x, g).0, &r)
        });
        // The backward accumulates: a second call doubles the gradients.
        let dx1 = dx.clone();
        rmsnorm_backward(&mut dx, &mut dg, &r, &x, &g0, &rstd, n, d);
        assert!(dx.iter().zip(&dx1).all(|(a, b)| (a - 2.0 * b).abs() < 1e-6));
    }

    fn attention_probs_len(l: &Layout, h: usize) -> usize {
        l.rows() * h * l.max_context()
    }

    /// Two groups of a 3-token prompt, three continuations each (2, 0, 1 and 2, 2, 1 rows).
    fn ragged_layout() -> Layout {
        let toks: Vec<u32> = (0..6).flat_map(|s| [1, 2, 3 + s / 3, s, s]).collect();
        Layout::shared_prefix(&toks, 6, 5, 3, 3, Some(&[5, 3, 4, 5, 5, 4]))
    }

    #[test]
    fn attention_gradients_match_finite_differences() {
        let (h, d) = (2, 8);
        for layout in [Layout::plain(2, 5), ragged_layout()] {
            let n = layout.rows();
            let mut rng = ChaCha8Rng::seed_from_u64(2);
            let (mut qkv, r) = (randn(&mut rng, n * 3 * d, 1.0), randn(&mut rng, n * d, 1.0));
            let fwd = |qkv: &[f32]| {
                let mut out = vec![0.0; n * d];
                let mut probs = vec![0.0; attention_probs_len(&layout, h)];
                attention_forward(&mut out, &mut probs, qkv, &layout, h, d);
                (out, probs)
            };
            let (_, probs) = fwd(&qkv);
            let mut dqkv = vec![0.0; qkv.len()];
            attention_backward(&mut dqkv, &r, &qkv, &probs, &layout, h, d);
            check_grad(
                &format!("attention dqkv {layout:?}"),
                &mut qkv,
                &dqkv,
                1e-2,
                |q| dot64(&fwd(q).0, &r),
            );
        }
    }

    /// A shared-prefix layout computes, row for row, the bits the plain batch computes for the same
    /// positions of the same sequences.
    #[test]
    fn shared_prefix_attention_matches_the_plain_batch_bit_for_bit() {
        let (h, d) = (2, 8);
        let l = ragged_layout();
        let (b, t) = (l.sequences(), l.seq_len());
        let plain = Layout::plain(b, t);
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let packed_qkv = randn(&mut rng, l.rows() * 3 * d, 1.0);
        let full_qkv = l.unpack(&packed_qkv, 3 * d);
        let run = |lay: &Layout, qkv: &[f32]| {
            let mut out = vec![0.0; lay.rows() * d];
            let mut probs = vec![0.0; attention_probs_len(lay, h)];
            attention_forward(&mut out, &mut probs, qkv, lay, h, d);
            out
        };
        let packed = run(&l, &packed_qkv);
        let full = run(&plain, &full_qkv);
        for s in 0..b {
            for p in 0..t {
                if let Some(r) = l.row(s, p) {
                    let (a, b) = (&packed[r * d..][..d], &full[(s * t + p) * d..][..d]);
                    assert!(
                        a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "sequence {s} position {p}: shared-prefix attention differs"
                    );
                }
            }
        }
    }

    #[test]
    fn attention_is_causal_and_step_matches_full() {
        let (b, t, h, d) = (2, 6, 2, 8);
        let dh = d / h;
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let qkv = randn(&mut rng, b * t * 3 * d, 1.0);
        let (mut out, mut probs) = (vec![0.0; b * t * d], vec![0.0; b * h * t * t]);
        attention_forward(&mut out, &mut probs, &qkv, &Layout::plain(b, t), h, d);
        // Changing the last position's K/V must not change earlier outputs.
        let mut qkv2 = qkv.clone();
        for bi in 0..b {
            qkv2[(bi * t + t - 1) * 3 * d + d..(bi * t + t) * 3 * d]
                .iter_mut()
                .for_each(|x| *x += 1.0);
        }
        let mut out2 = vec![0.0; b * t * d];
        attention_forward(&mut out2, &mut probs, &qkv2, &Layout::plain(b, t), h, d);
        for bi in 0..b {
            let rows = bi * t * d..(bi * t + t - 1) * d;
            assert_eq!(out[rows.clone()], out2[rows]);
        }
        // The incremental step over a [B, H, S, Dh] cache gives the full forward's last row.
        let s = t + 2;
        let (mut kc, mut vc) = (vec![0.0; b * h * s * dh], vec![0.0; b * h * s * dh]);
        for bi in 0..b {
            for hi in 0..h {
                for ti in 0..t {
                    let src = (bi * t + ti) * 3 * d + hi * dh;
                    let dst = ((bi * h + hi) * s + ti) * dh;
                    kc[dst..dst + dh].copy_from_slice(&qkv[src + d..src + d + dh]);
                    vc[dst..dst + dh].copy_from_slice(&qkv[src + 2 * d..src + 2 * d + dh]);
                }
            }
        }
        let last: Vec<f32> = (0..b)
            .flat_map(|bi| qkv[(bi * t + t - 1) * 3 * d..(bi * t + t) * 3 * d].to_vec())
            .collect();
        let mut step = vec![0.0; b * d];
        attention_step(&mut step, &last, &kc, &vc, b, h, d, s, t);
        for bi in 0..b {
            let full = &out[(bi * t + t - 1) * d..(bi * t + t) * d];
            for (x, y) in step[bi * d..(bi + 1) * d].iter().zip(full) {
                assert!((x - y).abs() < 1e-5, "{x} vs {y}");
            }
        }
    }

    #[test]
    fn swiglu_gradients_match_finite_differences() {
        let (n, f) = (3, 5);
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        let (mut inp, r) = (randn(&mut rng, n * 2 * f, 2.0), randn(&mut rng, n * f, 1.0));
        let fwd = |x: &[f32]| {
            let mut out = vec![0.0; n * f];
            swiglu_forward(&mut out, x, n, f);
            out
        };
        // gate = first F columns, up = last F.
        let out = fwd(&inp);
        let (g, u) = (inp[0], inp[f]);
        assert!((out[0] - g / (1.0 + (-g).exp()) * u).abs() < 1e-6);
        let mut dinp = vec![0.0; inp.len()];
        swiglu_backward(&mut dinp, &r, &inp, n, f);
        check_grad("swiglu dinp", &mut inp, &dinp, 1e-2, |x| dot64(&fwd(x), &r));
    }

    #[test]
    fn router_picks_top_k_with_ties_to_lower_index_and_renormalizes() {
        let (e, k) = (5, 2);
        let logits = [
            0.5f32, 2.0, 0.5, 2.0, -1.0, /* row 2 */ 1.0, 1.0, 1.0, 1.0, 1.0,
        ];
        let (mut p, mut ids, mut w) = (vec![0.0; 2 * e], vec![0u32; 2 * k], vec![0.0; 2 * k]);
        router_forward(&mut p, &mut ids, &mut w, &logits, 2, e, k, None);
        assert_eq!(ids, [1, 3, 0, 1]);
        assert!(w.iter().all(|&x| (x - 0.5).abs() < 1e-6), "{w:?}");
        assert!((p[..e].iter().sum::<f32>() - 1.0).abs() < 1e-6);
        // Replay forces the selection; weights still come from these logits.
        router_forward(
            &mut p,
            &mut ids,
            &mut w,
            &logits,
            2,
            e,
            k,
            Some(&[4, 0, 2, 3]),
        );
        assert_eq!(ids, [4, 0, 2, 3]);
        let (p4, p0) = (p[4], p[0]);
        assert!((w[0] - p4 / (p4 + p0)).abs() < 1e-6 && (w[0] + w[1] - 1.0).abs() < 1e-6);
    }

    #[test]
    fn router_gradients_match_finite_differences() {
        let (n, e, k) = (3, 6, 2);
        // Logits spaced ≥ 0.3 apart so an ε = 1e-2 perturbation never changes the selection.
        let mut logits: Vec<f32> = (0..n * e)
            .map(|i| ((i * 7) % (n * e)) as f32 * 0.3 - 2.0)
            .collect();
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let r = randn(&mut rng, n * k, 1.0);
        let fwd = |l: &[f32]| {
            let (mut p, mut ids, mut w) = (vec![0.0; n * e], vec![0u32; n * k], vec![0.0; n * k]);
            router_forward(&mut p, &mut ids, &mut w, l, n, e, k, None);
            (w, ids)
        };
        let (w, ids) = fwd(&logits);
        let mut dl = vec![0.0; n * e];
        router_backward(&mut dl, &r, &ids, &w, n, e, k);
        check_grad("router dlogits", &mut logits, &dl, 1e-2, |l| {
            let (w, id) = fwd(l);
            assert_eq!(id, ids, "perturbation flipped the selection");
            dot64(&w, &r)
        });
    }

    #[test]
    fn log_softmax_gradients_match_finite_differences() {
        let (n, v) = (3, 7);
        let mut rng = ChaCha8Rng::seed_from_u64(6);
        let (logits, r) = (randn(&mut rng, n * v, 3.0), randn(&mut rng, n * v, 1.0));
        let fwd = |l: &[f32]| {
            let mut lp = vec![0.0; n * v];
            log_softmax_forward(&mut lp, l, n, v);
            lp
        };
        let lp = fwd(&logits);
        assert!((lp[..v].iter().map(|x| x.exp()).sum::<f32>() - 1.0).abs() < 1e-5);
        let mut dlogits = vec![0.0; n * v];
        log_softmax_backward(&mut dlogits, &r, &lp, n, v);
        check_grad(
            "log_softmax dlogits",
            &mut logits.clone(),
            &dlogits,
            1e-2,
            |l| dot64(&fwd(l), &r),
        );
    }

    #[test]
    fn embedding_gradients_match_finite_differences() {
        let (v, s, d, t) = (5, 4, 3, 3);
        let tokens = [1u32, 4, 1, 0, 1, 2]; // two sequences of three; token 1 repeats (scatter-add)
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let (mut wte, mut wpe, r) = (
            randn(&mut rng, v * d, 1.0),
            randn(&mut rng, s * d, 1.0),
            randn(&mut rng, 6 * d, 1.0),
        );
        let fwd = |wte: &[f32], wpe: &[f32]| {
            let mut out = vec![0.0; 6 * d];
            embedding_forward(&mut out, &tokens, wte, wpe, |i| 1 + i % t, d);
            out
        };
        let (mut dwte, mut dwpe) = (vec![0.0; v * d], vec![0.0; s * d]);
        embedding_backward(&mut dwte, &mut dwpe, &r, &tokens, |i| 1 + i % t, d);
        let (wte0, wpe0) = (wte.clone(), wpe.clone());
        check_grad("embedding dwte", &mut wte, &dwte, 1e-2, |w| {
            dot64(&fwd(w, &wpe0), &r)
        });
        check_grad("embedding dwpe", &mut wpe, &dwpe, 1e-2, |w| {
            dot64(&fwd(&wte0, w), &r)
        });
        assert!(
            dwpe[..d].iter().all(|&x| x == 0.0),
            "position 0 is unused when positions start at 1"
        );
    }
}

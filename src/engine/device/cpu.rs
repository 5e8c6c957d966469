//! The reference device: host vectors, `engine::ops` for the element-wise ops, `engine::linear`
//! for every matmul site (GEMMs by `backend::cpu::gemm`). Each routed expert's tokens are packed
//! tightly (expert 0's first) and each expert's linear layers run on their own rows, in
//! parallel over experts; sums over experts go in expert order, so results do not depend on
//! the thread count.

use super::{OpError, OpResult, Ops, SiteCounts};
use crate::engine::layout::Layout;
use crate::engine::linear::{self, LinearCache, PreparedWeight};
use crate::engine::model::KvCache;
use crate::engine::ops;
use crate::formats::QuantStats;
use crate::recipe::SitePlan;
use rayon::prelude::*;

/// Host tensors; parameters and prepared weights are borrowed for `'a`.
#[derive(Clone, Copy, Default)]
pub struct CpuOps<'a>(std::marker::PhantomData<&'a ()>);

impl CpuOps<'_> {
    pub fn new() -> Self {
        CpuOps(std::marker::PhantomData)
    }
}

/// The rows of a pass: a layout (training, reference and prompt passes) or one decode step.
pub struct CpuRows {
    layout: Option<Layout>,
    positions: Vec<usize>,
}

/// The (token, choice) slots `n·k + j` routed to each expert, in token order; expert `e`'s rows
/// of the experts' batch start at `offsets[e]`.
pub struct CpuDispatch {
    slots: Vec<Vec<usize>>,
    offsets: Vec<usize>,
    k: usize,
}

impl CpuDispatch {
    /// Expert `e`'s rows of a `[rows, w]` experts' batch.
    fn range(&self, e: usize, w: usize) -> std::ops::Range<usize> {
        self.offsets[e] * w..(self.offsets[e] + self.slots[e].len()) * w
    }

    fn rows(&self) -> usize {
        self.offsets.last().copied().unwrap_or(0) + self.slots.last().map_or(0, Vec::len)
    }
}

/// Splits `buf` into one mutable chunk per expert (`w` values per row), in expert order.
fn expert_chunks_mut<'b>(buf: &'b mut [f32], disp: &CpuDispatch, w: usize) -> Vec<&'b mut [f32]> {
    let mut out = Vec::with_capacity(disp.slots.len());
    let mut rest = buf;
    for s in &disp.slots {
        let (head, tail) = rest.split_at_mut(s.len() * w);
        out.push(head);
        rest = tail;
    }
    out
}

/// The host decodes one position per step (`rollout::Decoder::feed` steps through a prompt).
fn one_position(count: usize) -> OpResult<()> {
    if count == 1 {
        Ok(())
    } else {
        Err(OpError::Shape(format!(
            "the host decoder runs one position per step, not {count}"
        )))
    }
}

fn shape(what: &str, got: usize, want: usize) -> OpResult<()> {
    if got == want {
        Ok(())
    } else {
        Err(OpError::Shape(format!(
            "{what}: {got} values, expected {want}"
        )))
    }
}

/// The host steps one run at a time: a site has one plan.
fn one_plan(plans: &[SitePlan]) -> OpResult<&SitePlan> {
    match plans {
        [p] => Ok(p),
        _ => Err(OpError::Shape(format!(
            "the host steps one run: {} site plans",
            plans.len()
        ))),
    }
}

impl<'a> Ops for CpuOps<'a> {
    type T = Vec<f32>;
    type Ids = Vec<u32>;
    type Param = &'a [f32];
    type Weight = &'a PreparedWeight;
    type Experts = &'a [PreparedWeight];
    type Lin = LinearCache;
    type ExpertLin = Vec<LinearCache>;
    type Dispatch = CpuDispatch;
    type Rows = CpuRows;
    type Kv = KvCache;

    fn zeros(&self, n: usize) -> OpResult<Vec<f32>> {
        Ok(vec![0.0; n])
    }

    fn upload(&self, x: &[f32]) -> OpResult<Vec<f32>> {
        Ok(x.to_vec())
    }

    fn to_host(&self, t: &Vec<f32>, n: usize) -> OpResult<Vec<f32>> {
        Ok(t[..n].to_vec())
    }

    fn all_to_host(&self, ts: Vec<(Vec<f32>, usize)>) -> OpResult<Vec<Vec<f32>>> {
        Ok(ts
            .into_iter()
            .map(|(mut t, n)| {
                t.truncate(n);
                t
            })
            .collect())
    }

    fn ids(&self, v: &[u32]) -> OpResult<Vec<u32>> {
        Ok(v.to_vec())
    }

    fn ids_to_host(&self, ids: &[&Vec<u32>], nk: usize) -> OpResult<Vec<Vec<u32>>> {
        Ok(ids.iter().map(|v| v[..nk].to_vec()).collect())
    }

    fn rows(&self, layout: &Layout) -> OpResult<CpuRows> {
        Ok(CpuRows {
            positions: layout.positions(),
            layout: Some(layout.clone()),
        })
    }

    fn join<A: Send, B: Send>(
        &self,
        a: impl FnOnce() -> A + Send,
        b: impl FnOnce() -> B + Send,
    ) -> (A, B) {
        rayon::join(a, b)
    }

    fn embedding(
        &self,
        tokens: &Vec<u32>,
        rows: &CpuRows,
        wte: &&'a [f32],
        wpe: &&'a [f32],
        n: usize,
        d: usize,
    ) -> OpResult<Vec<f32>> {
        shape("embedding tokens", tokens.len(), n)?;
        let mut h = vec![0.0f32; n * d];
        let pos = &rows.positions;
        ops::embedding_forward(&mut h, tokens, wte, wpe, |r| pos[r], d);
        Ok(h)
    }

    fn embedding_backward(
        &self,
        dwte: &mut Vec<f32>,
        dwpe: &mut Vec<f32>,
        dh: &Vec<f32>,
        tokens: &Vec<u32>,
        rows: &CpuRows,
        n: usize,
        d: usize,
    ) -> OpResult<()> {
        shape("embedding backward", dh.len(), n * d)?;
        let pos = &rows.positions;
        ops::embedding_backward(dwte, dwpe, dh, tokens, |r| pos[r], d);
        Ok(())
    }

    fn rmsnorm(
        &self,
        x: &Vec<f32>,
        g: &&'a [f32],
        n: usize,
        d: usize,
    ) -> OpResult<(Vec<f32>, Vec<f32>)> {
        let (mut out, mut rstd) = (vec![0.0f32; n * d], vec![0.0f32; n]);
        ops::rmsnorm_forward(&mut out, &mut rstd, x, g, n, d);
        Ok((out, rstd))
    }

    fn rmsnorm_backward(
        &self,
        dx: &mut Vec<f32>,
        dg: &mut Vec<f32>,
        dy: &Vec<f32>,
        x: &Vec<f32>,
        g: &&'a [f32],
        rstd: &Vec<f32>,
        n: usize,
        d: usize,
    ) -> OpResult<()> {
        ops::rmsnorm_backward(dx, dg, dy, x, g, rstd, n, d);
        Ok(())
    }

    fn add_into(&self, dst: &mut Vec<f32>, src: &Vec<f32>, n: usize) -> OpResult<()> {
        dst[..n]
            .iter_mut()
            .zip(&src[..n])
            .for_each(|(a, &b)| *a += b);
        Ok(())
    }

    fn swiglu(&self, x: &Vec<f32>, n: usize, f: usize) -> OpResult<Vec<f32>> {
        let mut act = vec![0.0f32; n * f];
        ops::swiglu_forward(&mut act, x, n, f);
        Ok(act)
    }

    fn swiglu_backward(
        &self,
        dy: &Vec<f32>,
        x: &Vec<f32>,
        n: usize,
        f: usize,
    ) -> OpResult<Vec<f32>> {
        let mut dx = vec![0.0f32; n * 2 * f];
        ops::swiglu_backward(&mut dx, dy, x, n, f);
        Ok(dx)
    }

    fn attention(
        &self,
        qkv: &Vec<f32>,
        rows: &CpuRows,
        h: usize,
        d: usize,
    ) -> OpResult<(Vec<f32>, Vec<f32>)> {
        let layout = rows
            .layout
            .as_ref()
            .ok_or_else(|| OpError::Shape("attention over decode rows: use kv_attend".into()))?;
        let n = layout.rows();
        let (mut att, mut probs) = (
            vec![0.0f32; n * d],
            vec![0.0f32; n * h * layout.max_context()],
        );
        ops::attention_forward(&mut att, &mut probs, qkv, layout, h, d);
        Ok((att, probs))
    }

    fn attention_backward(
        &self,
        dy: &Vec<f32>,
        qkv: &Vec<f32>,
        probs: &Vec<f32>,
        rows: &CpuRows,
        h: usize,
        d: usize,
    ) -> OpResult<Vec<f32>> {
        let layout = rows
            .layout
            .as_ref()
            .ok_or_else(|| OpError::Shape("attention backward over decode rows".into()))?;
        let mut dqkv = vec![0.0f32; layout.rows() * 3 * d];
        ops::attention_backward(&mut dqkv, dy, qkv, probs, layout, h, d);
        Ok(dqkv)
    }

    fn linear(
        &self,
        plan: &[SitePlan],
        x: &Vec<f32>,
        n: usize,
        w: &&'a PreparedWeight,
    ) -> OpResult<(Vec<f32>, LinearCache)> {
        let plan = one_plan(plan)?;
        shape("linear input", x.len(), n * w.in_dim)?;
        let mut y = vec![0.0f32; n * w.out_dim];
        let c = linear::forward(plan, x, n, w, &mut y);
        Ok((y, c))
    }

    fn linear_backward(
        &self,
        plan: &[SitePlan],
        c: &LinearCache,
        w: &&'a PreparedWeight,
        dy: &Vec<f32>,
        dx: Option<&mut Vec<f32>>,
        dw: &mut Vec<f32>,
    ) -> OpResult<()> {
        let plan = one_plan(plan)?;
        linear::backward(plan, c, w, dy, dx.map(|v| &mut v[..]), dw);
        Ok(())
    }

    fn experts_linear(
        &self,
        plan: &[SitePlan],
        x: &Vec<f32>,
        disp: &CpuDispatch,
        w: &&'a [PreparedWeight],
    ) -> OpResult<(Vec<f32>, Vec<LinearCache>)> {
        let plan = one_plan(plan)?;
        let (k, m) = (w[0].in_dim, w[0].out_dim);
        shape("experts' input", x.len(), disp.rows() * k)?;
        let mut y = vec![0.0f32; disp.rows() * m];
        let caches = expert_chunks_mut(&mut y, disp, m)
            .into_par_iter()
            .enumerate()
            .map(|(e, ye)| {
                let n = disp.slots[e].len();
                linear::forward(plan, &x[disp.range(e, k)], n, &w[e], ye)
            })
            .collect();
        Ok((y, caches))
    }

    fn experts_linear_backward(
        &self,
        plan: &[SitePlan],
        c: &Vec<LinearCache>,
        w: &&'a [PreparedWeight],
        dy: &Vec<f32>,
        dx: &mut Vec<f32>,
        dw: &mut Vec<f32>,
    ) -> OpResult<()> {
        let plan = one_plan(plan)?;
        let (k, m) = (w[0].in_dim, w[0].out_dim);
        let disp_rows: Vec<usize> = c.iter().map(|c| c.n).collect();
        let mut dy_rest: &[f32] = dy;
        let mut dys = Vec::with_capacity(c.len());
        for &n in &disp_rows {
            let (head, tail) = dy_rest.split_at(n * m);
            dys.push(head);
            dy_rest = tail;
        }
        let mut dx_rest: &mut [f32] = dx;
        let mut dxs = Vec::with_capacity(c.len());
        for &n in &disp_rows {
            let (head, tail) = dx_rest.split_at_mut(n * k);
            dxs.push(head);
            dx_rest = tail;
        }
        dw.par_chunks_mut(m * k)
            .zip(dxs)
            .zip(dys)
            .enumerate()
            .for_each(|(e, ((dwe, dxe), dye))| {
                linear::backward(plan, &c[e], &w[e], dye, Some(dxe), dwe)
            });
        Ok(())
    }

    fn counts(&self, sites: &[SiteCounts<'_, Self>]) -> OpResult<Vec<QuantStats>> {
        Ok(sites
            .iter()
            .map(|s| match s {
                SiteCounts::One(c) => c.stats,
                SiteCounts::Experts(cs) => cs
                    .iter()
                    .fold(QuantStats::default(), |acc, c| acc.merge(c.stats)),
            })
            .collect())
    }

    fn route(
        &self,
        logits: &Vec<f32>,
        n: usize,
        e: usize,
        k: usize,
        replay: Option<&[u32]>,
    ) -> OpResult<(Vec<u32>, Vec<f32>)> {
        let (mut probs, mut ids, mut weights) =
            (vec![0.0f32; n * e], vec![0u32; n * k], vec![0.0f32; n * k]);
        ops::router_forward(&mut probs, &mut ids, &mut weights, logits, n, e, k, replay);
        Ok((ids, weights))
    }

    fn route_backward(
        &self,
        dweights: &Vec<f32>,
        ids: &Vec<u32>,
        weights: &Vec<f32>,
        n: usize,
        e: usize,
        k: usize,
    ) -> OpResult<Vec<f32>> {
        let mut dlogits = vec![0.0f32; n * e];
        ops::router_backward(&mut dlogits, dweights, ids, weights, n, e, k);
        Ok(dlogits)
    }

    fn dispatch(&self, ids: &Vec<u32>, n: usize, k: usize, e: usize) -> OpResult<CpuDispatch> {
        shape("expert ids", ids.len(), n * k)?;
        let mut slots = vec![Vec::new(); e];
        for (s, &id) in ids.iter().enumerate() {
            slots
                .get_mut(id as usize)
                .ok_or_else(|| OpError::Shape(format!("expert id {id} of {e}")))?
                .push(s);
        }
        let offsets = slots
            .iter()
            .scan(0, |acc, s| {
                let o = *acc;
                *acc += s.len();
                Some(o)
            })
            .collect();
        Ok(CpuDispatch { slots, offsets, k })
    }

    fn dispatch_rows(&self, d: &CpuDispatch) -> usize {
        d.rows()
    }

    fn gather(&self, x: &Vec<f32>, disp: &CpuDispatch, d: usize) -> OpResult<Vec<f32>> {
        let mut xe = vec![0.0f32; disp.rows() * d];
        let srcs = disp.slots.iter().flatten();
        for (row, &s) in xe.chunks_mut(d).zip(srcs) {
            row.copy_from_slice(&x[(s / disp.k) * d..][..d]);
        }
        Ok(xe)
    }

    fn combine(
        &self,
        x: &Vec<f32>,
        shared: &Vec<f32>,
        experts: &Vec<f32>,
        _ids: &Vec<u32>,
        disp: &CpuDispatch,
        weights: &Vec<f32>,
        (n, k, d): (usize, usize, usize),
    ) -> OpResult<Vec<f32>> {
        let mut out = shared[..n * d].to_vec();
        for (&s, y) in disp.slots.iter().flatten().zip(experts.chunks(d)) {
            let gate = weights[s];
            out[(s / k) * d..][..d]
                .iter_mut()
                .zip(y)
                .for_each(|(o, &v)| *o += gate * v);
        }
        self.add_into(&mut out, x, n * d)?;
        Ok(out)
    }

    fn combine_backward(
        &self,
        dh: &Vec<f32>,
        experts: &Vec<f32>,
        disp: &CpuDispatch,
        weights: &Vec<f32>,
        (n, k, d): (usize, usize, usize),
    ) -> OpResult<(Vec<f32>, Vec<f32>)> {
        let (mut dy, mut dweights) = (vec![0.0f32; disp.rows() * d], vec![0.0f32; n * k]);
        for ((&s, y), dyr) in disp
            .slots
            .iter()
            .flatten()
            .zip(experts.chunks(d))
            .zip(dy.chunks_mut(d))
        {
            let src = &dh[(s / k) * d..][..d];
            dweights[s] = src.iter().zip(y).map(|(&a, &b)| a * b).sum();
            dyr.iter_mut()
                .zip(src)
                .for_each(|(o, &v)| *o = weights[s] * v);
        }
        Ok((dy, dweights))
    }

    fn scatter_add(
        &self,
        dx: &mut Vec<f32>,
        dexperts: &Vec<f32>,
        _ids: &Vec<u32>,
        disp: &CpuDispatch,
        (_, k, d): (usize, usize, usize),
    ) -> OpResult<()> {
        for (&s, src) in disp.slots.iter().flatten().zip(dexperts.chunks(d)) {
            dx[(s / k) * d..][..d]
                .iter_mut()
                .zip(src)
                .for_each(|(a, &b)| *a += b);
        }
        Ok(())
    }

    fn kv_cache(
        &self,
        layers: usize,
        seqs: usize,
        positions: usize,
        d: usize,
        h: usize,
    ) -> OpResult<KvCache> {
        Ok(KvCache::for_shape(layers, seqs, positions, d, h))
    }

    fn kv_len(&self, kv: &KvCache) -> usize {
        kv.len()
    }

    fn kv_seqs(&self, kv: &KvCache) -> usize {
        kv.batch()
    }

    fn decode_rows(&self, kv: &KvCache, count: usize) -> OpResult<CpuRows> {
        one_position(count)?;
        Ok(CpuRows {
            layout: None,
            positions: vec![kv.len(); kv.batch()],
        })
    }

    fn kv_attend(
        &self,
        kv: &mut KvCache,
        l: usize,
        qkv: &Vec<f32>,
        _rows: &CpuRows,
        h: usize,
        d: usize,
        count: usize,
    ) -> OpResult<Vec<f32>> {
        one_position(count)?;
        Ok(kv.attend(l, qkv, h, d))
    }

    fn kv_advance(&self, kv: &mut KvCache, count: usize) {
        (0..count).for_each(|_| kv.advance());
    }

    fn kv_repeat_each(&self, kv: &mut KvCache, samples: usize) -> OpResult<()> {
        *kv = kv.repeat_each(samples);
        Ok(())
    }
}

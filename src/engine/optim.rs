//! AdamW with bias correction over every named parameter, weight decay chosen per tensor (the
//! published recipe uses 0 on low-precision weights), and a global gradient scale (clipping).

use super::model::Params;
use rayon::prelude::*;

/// Elements per parallel task of the update, and the order of its sums: each chunk's in element
/// order, the chunks in order (so the sums' bits do not depend on the thread count).
pub const CHUNK: usize = 16 * 1024;

/// First and second moments for every parameter.
pub struct AdamW {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    m: Params,
    v: Params,
    t: u32,
}

/// One AdamW step's constants for one tensor ([`update_tensor`]); a device running the update
/// takes the same numbers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamStep {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// Bias corrections `1 - beta1^t`, `1 - beta2^t`.
    pub bc1: f32,
    pub bc2: f32,
    /// The gradients' multiplier (clipping).
    pub scale: f32,
    /// Decoupled weight decay (times lr).
    pub decay: f32,
}

impl AdamW {
    pub fn new(params: &Params, lr: f32, beta1: f32, beta2: f32, eps: f32) -> AdamW {
        AdamW {
            lr,
            beta1,
            beta2,
            eps,
            m: params.zeros_like(),
            v: params.zeros_like(),
            t: 0,
        }
    }

    /// Advance the step count; this step's constants for gradients times `scale` (decay 0: each
    /// tensor sets its own).
    pub fn next_step(&mut self, scale: f32) -> AdamStep {
        self.t += 1;
        let t = self.t as i32;
        let (beta1, beta2) = (self.beta1, self.beta2);
        AdamStep {
            lr: self.lr,
            beta1,
            beta2,
            eps: self.eps,
            bc1: 1.0 - beta1.powi(t),
            bc2: 1.0 - beta2.powi(t),
            scale,
            decay: 0.0,
        }
    }

    /// One update with gradients multiplied by `scale`; `decay(name)` gives each tensor's weight
    /// decay (decoupled, times lr). Returns (Σ update², Σ weight² after the update).
    pub fn update(
        &mut self,
        params: &mut Params,
        grads: &Params,
        scale: f32,
        decay: impl Fn(&str) -> f32,
    ) -> (f64, f64) {
        let step = self.next_step(scale);
        let (mut upd, mut wsq) = (0.0f64, 0.0f64);
        let gs = grads.named_tensors();
        let ms = self.m.named_tensors_mut();
        let vs = self.v.named_tensors_mut();
        let ps = params.named_tensors_mut();
        for ((((name, g), (_, m)), (_, v)), (_, p)) in gs.into_iter().zip(ms).zip(vs).zip(ps) {
            let k = AdamStep {
                decay: decay(&name),
                ..step
            };
            for (u, w) in update_tensor(p, m, v, g, &k) {
                upd += u;
                wsq += w;
            }
        }
        (upd, wsq)
    }
}

/// AdamW on one tensor: `p`, `m`, `v` updated in place from `g`. Returns each [`CHUNK`]'s
/// (Σ update², Σ weight² after the update), in chunk order: [`AdamW::update`] adds them up in
/// that order.
pub fn update_tensor(
    p: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: &[f32],
    k: &AdamStep,
) -> Vec<(f64, f64)> {
    let AdamStep {
        lr,
        beta1: b1,
        beta2: b2,
        eps,
        bc1,
        bc2,
        scale,
        decay: wd,
    } = *k;
    // The element updates are independent: in parallel chunks of fixed size. Each chunk sums its
    // squares in element order.
    p.par_chunks_mut(CHUNK)
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .zip(g.par_chunks(CHUNK))
        .map(|(((p, m), v), g)| {
            // The update loop vectorizes; the ordered sums run after it, on hot data.
            let mut steps = vec![0.0f32; g.len()];
            for i in 0..g.len() {
                let gi = g[i] * scale;
                m[i] = b1 * m[i] + (1.0 - b1) * gi;
                v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
                let step = lr * ((m[i] / bc1) / ((v[i] / bc2).sqrt() + eps) + wd * p[i]);
                p[i] -= step;
                steps[i] = step;
            }
            let (mut upd, mut wsq) = (0.0f64, 0.0f64);
            for (&step, &pi) in steps.iter().zip(p.iter()) {
                upd += (step as f64) * (step as f64);
                wsq += (pi as f64) * (pi as f64);
            }
            (upd, wsq)
        })
        .collect()
}

/// Σ x² in f64, in element order (a gradient tensor's squared norm, as the trainer sums it).
pub fn sum_squares(x: &[f32]) -> f64 {
    x.iter().map(|v| (*v as f64) * (*v as f64)).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::model::ModelConfig;

    /// The definition, one element at a time: what `update` must equal bit for bit.
    fn sequential(
        p: &mut [f32],
        m: &mut [f32],
        v: &mut [f32],
        g: &[f32],
        (scale, wd, t): (f32, f32, i32),
        (upd, wsq): (&mut f64, &mut f64),
    ) {
        let (b1, b2, lr, eps) = (0.9f32, 0.95f32, 1e-3f32, 1e-8f32);
        let (bc1, bc2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
        for i in 0..g.len() {
            let gi = g[i] * scale;
            m[i] = b1 * m[i] + (1.0 - b1) * gi;
            v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
            let step = lr * ((m[i] / bc1) / ((v[i] / bc2).sqrt() + eps) + wd * p[i]);
            p[i] -= step;
            *upd += (step as f64) * (step as f64);
            *wsq += (p[i] as f64) * (p[i] as f64);
        }
    }

    /// Parallel element updates: the same parameters and the same (Σ update², Σ weight²) bits as
    /// the sequential definition (each sum in element order within a chunk, chunks in order),
    /// over tensors larger than a chunk, three steps, with per-tensor weight decay.
    #[test]
    fn update_matches_the_sequential_definition_bit_for_bit() {
        let cfg = ModelConfig::small();
        let mut params = Params::init(&cfg, 4).unwrap();
        let mut grads = params.zeros_like();
        for (k, (_, g)) in grads.named_tensors_mut().into_iter().enumerate() {
            for (i, x) in g.iter_mut().enumerate() {
                *x = ((i as f32 * 0.37 + k as f32).sin()) * 1e-2;
            }
        }
        let decay = |name: &str| if name.contains("experts") { 0.0 } else { 0.1 };
        let mut reference = params.clone();
        let (mut m, mut v) = (params.zeros_like(), params.zeros_like());
        let mut adam = AdamW::new(&params, 1e-3, 0.9, 0.95, 1e-8);
        for t in 1..=3 {
            let got = adam.update(&mut params, &grads, 0.5, decay);
            let (mut upd, mut wsq) = (0.0f64, 0.0f64);
            let named = grads.named_tensors();
            let ps = reference.named_tensors_mut();
            let ms = m.named_tensors_mut();
            let vs = v.named_tensors_mut();
            for ((((name, g), (_, p)), (_, m)), (_, v)) in named.into_iter().zip(ps).zip(ms).zip(vs)
            {
                let wd = decay(&name);
                let chunks = p
                    .chunks_mut(CHUNK)
                    .zip(m.chunks_mut(CHUNK))
                    .zip(v.chunks_mut(CHUNK))
                    .zip(g.chunks(CHUNK));
                for (((p, m), v), g) in chunks {
                    let (mut u, mut w) = (0.0f64, 0.0f64);
                    sequential(p, m, v, g, (0.5, wd, t), (&mut u, &mut w));
                    upd += u;
                    wsq += w;
                }
            }
            assert_eq!(
                (got.0.to_bits(), got.1.to_bits()),
                (upd.to_bits(), wsq.to_bits()),
                "step {t}"
            );
            assert!(params == reference, "step {t}: parameters differ");
        }
    }
}

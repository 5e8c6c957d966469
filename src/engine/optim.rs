//! AdamW with bias correction over every named parameter, weight decay chosen per tensor (the
//! published recipe uses 0 on low-precision weights), and a global gradient scale (clipping).

use super::model::Params;

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

    /// One update with gradients multiplied by `scale`; `decay(name)` gives each tensor's weight
    /// decay (decoupled, times lr). Returns (Σ update², Σ weight² after the update).
    pub fn update(
        &mut self,
        params: &mut Params,
        grads: &Params,
        scale: f32,
        decay: impl Fn(&str) -> f32,
    ) -> (f64, f64) {
        self.t += 1;
        let t = self.t as i32;
        let (b1, b2, lr, eps) = (self.beta1, self.beta2, self.lr, self.eps);
        let (bc1, bc2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
        let (mut upd, mut wsq) = (0.0f64, 0.0f64);
        let gs = grads.named_tensors();
        let ms = self.m.named_tensors_mut();
        let vs = self.v.named_tensors_mut();
        let ps = params.named_tensors_mut();
        for ((((name, g), (_, m)), (_, v)), (_, p)) in gs.into_iter().zip(ms).zip(vs).zip(ps) {
            let wd = decay(&name);
            for i in 0..g.len() {
                let gi = g[i] * scale;
                m[i] = b1 * m[i] + (1.0 - b1) * gi;
                v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
                let step = lr * ((m[i] / bc1) / ((v[i] / bc2).sqrt() + eps) + wd * p[i]);
                p[i] -= step;
                upd += (step as f64) * (step as f64);
                wsq += (p[i] as f64) * (p[i] as f64);
            }
        }
        (upd, wsq)
    }
}

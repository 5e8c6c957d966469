//! The rollout's decoder on a GPU ([`CudaBackend`]'s [`Backend::decoder`]): the exported model
//! uploaded once per rollout, keys and values in a device KV cache, every position one
//! `model::pass::decode` over [`GpuOps`] and a prompt's positions in one pass. Only the tokens go
//! in and the logits and routed ids come back per position; sampling stays on the host
//! (`rollout::generate`, the same code and RNG as on the CPU).
//!
//! [`Backend::decoder`]: crate::engine::backend::Backend::decoder

use super::CudaBackend;
use super::device_ops::{DeviceKvCache, GpuOps};
use crate::engine::device::{OpError, Ops};
use crate::engine::model::pass::{self, Weights};
use crate::engine::model::{PreparedModel, Routing};
use crate::engine::rollout::Decoder;

/// A decode in progress on one GPU. Holds one of the backend's op sets (returned to its pool on
/// drop), the uploaded model and the cache.
pub struct ResidentDecoder<'a> {
    backend: &'a CudaBackend,
    ops: Option<GpuOps>,
    model: Weights<GpuOps>,
    cache: DeviceKvCache,
}

impl<'a> ResidentDecoder<'a> {
    /// Upload `prep` and an empty cache for `seqs` sequences of up to `positions` positions.
    pub fn new(
        backend: &'a CudaBackend,
        prep: &PreparedModel,
        seqs: usize,
        positions: usize,
    ) -> Result<Self, OpError> {
        let ops = backend.take_ops()?;
        let cfg = &prep.config;
        if positions > cfg.max_seq {
            backend.give_ops(ops);
            return Err(OpError::Shape(format!(
                "kv cache: {positions} positions exceed max_seq {}",
                cfg.max_seq
            )));
        }
        let t0 = std::time::Instant::now();
        // Queued, not waited for: the decode's first kernels follow the copy on the stream.
        let made = ops
            .upload_model_for_inference(prep)
            .map_err(OpError::from)
            .and_then(|model| {
                backend.note_model_upload(t0);
                let cache =
                    ops.kv_cache(cfg.n_layers, seqs, positions, cfg.d_model, cfg.n_heads)?;
                Ok((model, cache))
            });
        match made {
            Ok((model, cache)) => Ok(ResidentDecoder {
                backend,
                ops: Some(ops),
                model,
                cache,
            }),
            Err(e) => {
                backend.give_ops(ops);
                Err(e)
            }
        }
    }

    /// GPU failures cannot be returned through the trait: they panic with the device, which
    /// `suite::builtin::run_one` turns into a `failed` run with that message.
    fn fail(&self, what: &str, e: OpError) -> ! {
        panic!(
            "cuda:{}: resident {what} failed: {e}",
            self.backend.device().ordinal()
        )
    }

    fn decode(&mut self, tokens: &[u32], count: usize) -> Result<(Vec<f32>, Routing), OpError> {
        let ops = self.ops.as_ref().expect("held until drop");
        pass::decode(ops, &self.model, &mut self.cache, tokens, count, None)
    }
}

impl Decoder for ResidentDecoder<'_> {
    fn step(&mut self, tokens: &[u32]) -> (Vec<f32>, Routing) {
        self.decode(tokens, 1)
            .unwrap_or_else(|e| self.fail("decode step", e))
    }

    /// The `count` positions in one pass; its routing, sequence-major, split back into one
    /// record per position.
    fn feed(&mut self, tokens: &[u32], count: usize) -> Vec<Routing> {
        match self.decode(tokens, count) {
            Ok((_, routing)) => per_position(&routing, count),
            Err(e) => self.fail("decode of several positions", e),
        }
    }

    fn repeat_each(&mut self, samples: usize) {
        let ops = self.ops.as_ref().expect("held until drop");
        if let Err(e) = ops.kv_repeat_each(&mut self.cache, samples) {
            self.fail("kv cache copy", e);
        }
    }
}

impl Drop for ResidentDecoder<'_> {
    fn drop(&mut self) {
        if let Some(o) = self.ops.take() {
            self.backend.give_ops(o);
        }
    }
}

/// A sequence-major record of `count` positions per sequence (row `i · count + j`) as `count`
/// records of one position each, in position order.
pub(super) fn per_position(r: &Routing, count: usize) -> Vec<Routing> {
    let (k, seqs) = (r.top_k, r.n_tokens / count.max(1));
    (0..count)
        .map(|j| Routing {
            top_k: k,
            n_tokens: seqs,
            layers: r
                .layers
                .iter()
                .map(|ids| {
                    (0..seqs)
                        .flat_map(|i| ids[(i * count + j) * k..][..k].iter().copied())
                        .collect()
                })
                .collect(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_position_takes_each_sequences_row_for_that_position() {
        // 2 sequences x 3 positions, top-1, one layer: id = 10 * sequence + position.
        let r = Routing {
            top_k: 1,
            n_tokens: 6,
            layers: vec![vec![0, 1, 2, 10, 11, 12]],
        };
        let got = per_position(&r, 3);
        let ids: Vec<Vec<u32>> = got.iter().map(|p| p.layers[0].clone()).collect();
        assert_eq!(ids, [vec![0, 10], vec![1, 11], vec![2, 12]]);
        assert!(got.iter().all(|p| p.n_tokens == 2 && p.top_k == 1));
    }
}

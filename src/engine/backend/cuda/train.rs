//! The trainer's pass on a GPU ([`CudaBackend`]'s `Backend::train_forward`): the model's forward
//! and backward (`model::pass`) over [`GpuOps`], so the trainer's policy pass never leaves the
//! GPU but for the logits (`[rows, V]`, small: the loss is computed on the host), dL/dlogits and
//! the gradients.

use super::device_ops::GpuOps;
use super::{CudaBackend, CudaError};
use crate::engine::device::OpError;
use crate::engine::layout::Layout;
use crate::engine::model::pass::{self, Cache, Weights};
use crate::engine::model::{Params, PreparedModel, Routing, TrainPass, quant_sites};
use crate::formats::QuantStats;

/// `CudaBackend`'s [`TrainPass`]: one of its op sets (back to the pool on drop), the uploaded
/// model and the forward's logits and cache.
pub struct ResidentPass<'a> {
    backend: &'a CudaBackend,
    ops: Option<GpuOps>,
    model: Weights<GpuOps>,
    logits: Vec<f32>,
    cache: Cache<GpuOps>,
}

impl<'a> ResidentPass<'a> {
    /// Upload `prep` and run the forward over `layout`'s rows.
    pub fn new(
        backend: &'a CudaBackend,
        prep: &PreparedModel,
        tokens: &[u32],
        layout: &Layout,
        replay: Option<&Routing>,
    ) -> Result<Self, OpError> {
        let ops = backend.take_ops()?;
        let run = || -> Result<_, OpError> {
            let t0 = std::time::Instant::now();
            // Queued, not waited for: the forward's kernels follow the copy on the stream.
            let model = ops.upload_model(prep)?;
            backend.note_model_upload(t0);
            let t1 = std::time::Instant::now();
            let (logits, cache, _) = pass::forward(&ops, &model, tokens, layout, replay)?;
            backend.note_train_forward(t1);
            Ok((model, logits, cache))
        };
        match run() {
            Ok((model, logits, cache)) => Ok(ResidentPass {
                backend,
                ops: Some(ops),
                model,
                logits,
                cache,
            }),
            Err(e) => {
                backend.give_ops(ops);
                Err(e)
            }
        }
    }

    fn ops(&self) -> &GpuOps {
        self.ops.as_ref().expect("held until drop")
    }

    /// GPU failures cannot be returned through the trait: they panic with the device, which
    /// `suite::builtin::run_one` turns into a `failed` run with that message.
    fn fail(&self, what: &str, e: OpError) -> ! {
        panic!(
            "cuda:{}: resident trainer {what} failed: {e}",
            self.backend.device().ordinal()
        )
    }
}

impl TrainPass for ResidentPass<'_> {
    fn logits(&self) -> &[f32] {
        &self.logits
    }

    fn quant_stats(&self) -> Vec<(String, QuantStats)> {
        let stats = pass::quant_stats(self.ops(), &self.cache)
            .unwrap_or_else(|e| self.fail("quantization counts", e));
        quant_sites(self.cache.n_layers())
            .into_iter()
            .zip(stats)
            .collect()
    }

    fn backward(&self, dlogits: &[f32]) -> Params {
        pass::backward(self.ops(), &self.model, &self.cache, dlogits)
            .unwrap_or_else(|e| self.fail("backward", e))
    }
}

impl Drop for ResidentPass<'_> {
    fn drop(&mut self) {
        if let Some(o) = self.ops.take() {
            self.backend.give_ops(o);
        }
    }
}

impl From<OpError> for CudaError {
    fn from(e: OpError) -> Self {
        CudaError::Shape(e.to_string())
    }
}

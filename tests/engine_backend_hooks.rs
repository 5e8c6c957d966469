//! The three places where a backend can run the model on its own device (`Backend::decoder` for
//! the rollout and the evaluation, `Backend::forward_logits` for the trainer's BF16 reference,
//! `Backend::train_forward` for the trainer's policy forward and backward) are really used, and
//! using them changes nothing else: a backend that answers them with the host's own computations
//! gives the plain CPU backend's bits, and counts that it was asked.
//!
//! `CudaBackend` answers them with the GPU (`tests/cuda_rollout.rs` and `tests/cuda_train.rs`
//! check those on a GPU); this file checks the engine's side of the contract everywhere, CI
//! included.

use lockstep::engine::backend::{Backend, CpuBackend, MatRef};
use lockstep::engine::layout::Layout;
use lockstep::engine::model::{
    self, HostPass, KvCache, ModelConfig, Params, PreparedModel, Routing, TrainPass,
};
use lockstep::engine::rollout::{Decoder, generate};
use lockstep::engine::task::Task;
use lockstep::engine::trainer::{ContractBreak, GrpoConfig, Trainer};
use lockstep::recipe::presets::preset;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The CPU backend, with its own decoder and reference forward (the host's, counted).
#[derive(Default)]
struct Hooked {
    decode_steps: AtomicUsize,
    reference_forwards: AtomicUsize,
    train_passes: AtomicUsize,
}

struct CountingDecoder<'a> {
    prep: &'a PreparedModel,
    cache: KvCache,
    steps: &'a AtomicUsize,
}

impl Decoder for CountingDecoder<'_> {
    fn step(&mut self, tokens: &[u32]) -> (Vec<f32>, Routing) {
        self.steps.fetch_add(1, Ordering::Relaxed);
        model::decode_step(&CpuBackend, self.prep, &mut self.cache, tokens, None)
    }

    fn repeat_each(&mut self, samples: usize) {
        self.cache = self.cache.repeat_each(samples);
    }
}

impl Backend for Hooked {
    fn name(&self) -> String {
        "hooked-cpu".into()
    }

    fn gemm(&self, a: MatRef<'_>, b: MatRef<'_>, c: &mut [f32], accumulate: bool) {
        CpuBackend.gemm(a, b, c, accumulate)
    }

    fn decoder<'a>(
        &'a self,
        prep: &'a PreparedModel,
        seqs: usize,
        positions: usize,
    ) -> Option<Box<dyn Decoder + 'a>> {
        Some(Box::new(CountingDecoder {
            prep,
            cache: KvCache::with_capacity(&prep.config, seqs, positions),
            steps: &self.decode_steps,
        }))
    }

    fn forward_logits(
        &self,
        prep: &PreparedModel,
        tokens: &[u32],
        layout: &Layout,
        replay: Option<&Routing>,
    ) -> Option<Vec<f32>> {
        self.reference_forwards.fetch_add(1, Ordering::Relaxed);
        Some(model::forward_rows(&CpuBackend, prep, tokens, layout, replay).0)
    }

    fn train_forward<'a>(
        &'a self,
        prep: &'a PreparedModel,
        tokens: &[u32],
        layout: &Layout,
        replay: Option<&Routing>,
    ) -> Option<Box<dyn TrainPass + 'a>> {
        self.train_passes.fetch_add(1, Ordering::Relaxed);
        Some(Box::new(HostPass::forward(
            &CpuBackend,
            prep,
            tokens,
            layout,
            replay,
        )))
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn the_rollout_decodes_through_the_backends_decoder() {
    let cfg = ModelConfig::tiny();
    let prep = PreparedModel::new(
        &Params::init(&cfg, 2).unwrap(),
        &preset("nvfp4-dq").unwrap().resolve(cfg.n_layers).unwrap(),
    )
    .unwrap();
    let prompts = vec![vec![1, 2, 10, 3, 4, 11], vec![5, 6, 10, 7, 8, 11]];
    let hooked = Hooked::default();
    let a = generate(&hooked, &prep, &prompts, 4, 5, 1.0, 9);
    let b = generate(&CpuBackend, &prep, &prompts, 4, 5, 1.0, 9);
    assert_eq!(a.tokens, b.tokens);
    assert_eq!(bits(&a.logprobs), bits(&b.logprobs));
    assert_eq!(a.routing, b.routing);
    // Every input position but the last is decoded once (5 prompt positions shared, then up to
    // 5 response positions; the loop also decodes the padding after everyone has finished).
    assert_eq!(hooked.decode_steps.load(Ordering::Relaxed), a.t - 1);
}

#[test]
fn the_trainer_takes_its_forwards_from_the_backend() {
    let cfg = ModelConfig::tiny();
    let grpo = GrpoConfig {
        prompts_per_step: 4,
        samples_per_prompt: 4,
        max_response_tokens: Task::Add(2).answer_len() + 1,
        eval_every: 0,
        // From a random init every reward is 0, so every advantage is; the KL term to the BF16
        // reference gives the backward something to carry.
        kl_coef: 0.1,
        ..Default::default()
    };
    let trainer = || {
        Trainer::new(
            Params::init(&cfg, 3).unwrap(),
            Task::Add(2),
            preset("mxfp8").unwrap(),
            grpo.clone(),
            5,
            ContractBreak::None,
        )
        .unwrap()
    };
    let (mut plain, mut with_hooks) = (trainer(), trainer());
    let hooked = Hooked::default();
    for step in 0..2 {
        let a = plain.step(&CpuBackend);
        let b = with_hooks.step(&hooked);
        assert_eq!(
            a.deterministic_scalars(),
            b.deterministic_scalars(),
            "step {step}"
        );
        // Per-layer gradient norms and quantization counts come through the pass too.
        assert_eq!(a.layers, b.layers, "step {step}");
        assert!(a.layers.iter().any(|l| l.grad_norm > 0.0));
    }
    assert_eq!(hooked.reference_forwards.load(Ordering::Relaxed), 2);
    assert_eq!(hooked.train_passes.load(Ordering::Relaxed), 2);
    assert!(hooked.decode_steps.load(Ordering::Relaxed) > 0);
}

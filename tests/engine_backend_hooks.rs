//! The engine takes every pass from its backend: the rollout and the evaluation decode through
//! `Backend::decoder`, the trainer's BF16 reference is `Backend::forward_logits`, and the
//! trainer's policy pass and the warm start's supervised steps are `Backend::train_forward`. A
//! backend that wraps the CPU's passes and counts the calls gives the CPU backend's bits and is
//! asked for each, so a device backend (`CudaBackend`: `tests/cuda_rollout.rs`,
//! `tests/cuda_train.rs` check it on a GPU) really runs all of them.

use lockstep::engine::backend::{Backend, CpuBackend};
use lockstep::engine::device::OpError;
use lockstep::engine::layout::Layout;
use lockstep::engine::model::{ModelConfig, Params, PreparedModel, Routing, TrainPass};
use lockstep::engine::rollout::{Decoder, generate};
use lockstep::engine::task::Task;
use lockstep::engine::trainer::{ContractBreak, GrpoConfig, Trainer};
use lockstep::engine::warmstart::{WarmStartConfig, warm_start};
use lockstep::recipe::presets::preset;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The CPU backend, counting the passes it is asked for.
#[derive(Default)]
struct Counting {
    decode_steps: AtomicUsize,
    reference_forwards: AtomicUsize,
    train_passes: AtomicUsize,
}

/// A decoder that counts its steps.
struct CountingDecoder<'a> {
    inner: Box<dyn Decoder + 'a>,
    steps: &'a AtomicUsize,
}

impl Decoder for CountingDecoder<'_> {
    fn step(&mut self, tokens: &[u32]) -> (Vec<f32>, Routing) {
        self.steps.fetch_add(1, Ordering::Relaxed);
        self.inner.step(tokens)
    }

    fn repeat_each(&mut self, samples: usize) {
        self.inner.repeat_each(samples)
    }
}

impl Backend for Counting {
    fn name(&self) -> String {
        "counting-cpu".into()
    }

    fn decoder<'a>(
        &'a self,
        prep: &'a PreparedModel,
        seqs: usize,
        positions: usize,
    ) -> Result<Box<dyn Decoder + 'a>, OpError> {
        Ok(Box::new(CountingDecoder {
            inner: CpuBackend.decoder(prep, seqs, positions)?,
            steps: &self.decode_steps,
        }))
    }

    fn forward_logits(
        &self,
        prep: &PreparedModel,
        tokens: &[u32],
        layout: &Layout,
        replay: Option<&Routing>,
    ) -> Result<Vec<f32>, OpError> {
        self.reference_forwards.fetch_add(1, Ordering::Relaxed);
        CpuBackend.forward_logits(prep, tokens, layout, replay)
    }

    fn train_forward<'a>(
        &'a self,
        prep: &'a PreparedModel,
        tokens: &[u32],
        layout: &Layout,
        replay: Option<&Routing>,
    ) -> Result<Box<dyn TrainPass + 'a>, OpError> {
        self.train_passes.fetch_add(1, Ordering::Relaxed);
        CpuBackend.train_forward(prep, tokens, layout, replay)
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
    let counting = Counting::default();
    let a = generate(&counting, &prep, &prompts, 4, 5, 1.0, 9);
    let b = generate(&CpuBackend, &prep, &prompts, 4, 5, 1.0, 9);
    assert_eq!(a.tokens, b.tokens);
    assert_eq!(bits(&a.logprobs), bits(&b.logprobs));
    assert_eq!(a.routing, b.routing);
    // Every input position but the last is decoded once (5 prompt positions shared, then up to
    // 5 response positions; the loop also decodes the padding after everyone has finished).
    assert_eq!(counting.decode_steps.load(Ordering::Relaxed), a.t - 1);
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
    let (mut plain, mut counted) = (trainer(), trainer());
    let counting = Counting::default();
    for step in 0..2 {
        let a = plain.step(&CpuBackend);
        let b = counted.step(&counting);
        assert_eq!(
            a.deterministic_scalars(),
            b.deterministic_scalars(),
            "step {step}"
        );
        // Per-layer gradient norms and quantization counts come through the pass too.
        assert_eq!(a.layers, b.layers, "step {step}");
        assert!(a.layers.iter().any(|l| l.grad_norm > 0.0));
    }
    assert_eq!(counting.reference_forwards.load(Ordering::Relaxed), 2);
    assert_eq!(counting.train_passes.load(Ordering::Relaxed), 2);
    assert!(counting.decode_steps.load(Ordering::Relaxed) > 0);
}

/// Each supervised step of the warm start is one training pass of the backend (on a GPU, the
/// device model), with the CPU backend's result.
#[test]
fn the_warm_start_trains_through_the_backends_pass() {
    let cfg = ModelConfig::tiny();
    let ws = WarmStartConfig {
        max_steps: 3,
        batch: 8,
        target_accuracy: 1.0,
        eval_every: 3,
        eval_prompts: 4,
        ..Default::default()
    };
    let counting = Counting::default();
    let (a, info) = warm_start(&counting, &cfg, Task::Add(2), &ws, None, |_| {}).unwrap();
    let (b, _) = warm_start(&CpuBackend, &cfg, Task::Add(2), &ws, None, |_| {}).unwrap();
    assert_eq!(info.steps, 3);
    assert_eq!(counting.train_passes.load(Ordering::Relaxed), 3);
    assert!(
        counting.decode_steps.load(Ordering::Relaxed) > 0,
        "evaluated"
    );
    for ((name, x), (_, y)) in a.named_tensors().iter().zip(b.named_tensors().iter()) {
        assert_eq!(bits(x), bits(y), "{name}");
    }
    let init = Params::init(&cfg, ws.seed).unwrap();
    assert_ne!(
        bits(a.named_tensors()[0].1),
        bits(init.named_tensors()[0].1),
        "the steps changed the weights"
    );
}

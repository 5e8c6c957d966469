//! The rollout engine: an incremental decoder with a BF16 KV cache that samples responses from the
//! *exported* policy — a [`PreparedModel`] built from the weights the trainer shipped, under the
//! rollout's own precision plan. It never reads the trainer's master weights, so a quantization
//! mismatch between the two sides shows up here exactly as it would in a real deployment.
//!
//! Layout: `B = prompts x samples` sequences, each `T = prompt_len + max_new` tokens: the prompt,
//! the sampled response (ending in `<eos>` unless truncated), then `<pad>`. Position `t`'s logprob
//! is the rollout's log-probability of token `t` given tokens `< t` (response positions only).

use super::backend::Backend;
use super::model::{self, KvCache, PreparedModel, Routing};
use super::task::{EOS, PAD};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// What one rollout produced.
#[derive(Debug, Clone)]
pub struct Rollout {
    /// `[B, T]` tokens, sequence-major.
    pub tokens: Vec<u32>,
    pub b: usize,
    pub t: usize,
    pub prompt_len: usize,
    /// Response length per sequence, `<eos>` included (0..=max_new).
    pub response_len: Vec<usize>,
    /// `[B, T]` rollout logprob of each token given its prefix (0 outside responses).
    pub logprobs: Vec<f32>,
    /// Experts chosen for every input position `0..T-1` (for routing replay in the trainer).
    pub routing: Routing,
    /// Sequences that hit `max_new` without `<eos>`.
    pub truncated: Vec<bool>,
    /// Token rows the decoder ran (a shared prompt once, then every sequence each position).
    pub decoded_rows: usize,
}

impl Rollout {
    /// True for response positions (the tokens the policy chose, `<eos>` included).
    pub fn is_response(&self, seq: usize, pos: usize) -> bool {
        pos >= self.prompt_len && pos < self.prompt_len + self.response_len[seq]
    }

    /// The `[B, T-1]` input tokens of the trainer's forward (every position but the last).
    pub fn tokens_inputs(&self) -> Vec<u32> {
        (0..self.b)
            .flat_map(|s| self.tokens[s * self.t..(s + 1) * self.t - 1].to_vec())
            .collect()
    }

    pub fn response(&self, seq: usize) -> &[u32] {
        let s = seq * self.t + self.prompt_len;
        &self.tokens[s..s + self.response_len[seq]]
    }
}

/// What [`generate`] needs from a model: one new position of every sequence at a time, from
/// [`Backend::decoder`] ([`HostDecoder`] on the CPU; on a GPU, cache and model on the device).
pub trait Decoder {
    /// Logits `[B, V]` and the routing of one new position of each of the B sequences.
    fn step(&mut self, tokens: &[u32]) -> (Vec<f32>, Routing);
    /// Each sequence's cache copied to `samples` consecutive sequences (a prompt decoded once).
    fn repeat_each(&mut self, samples: usize);

    /// `count` positions of every sequence whose logits are not needed (a prompt, or padding):
    /// `tokens` sequence-major, `count` per sequence; the routing of each position in turn. The
    /// host decodes them step by step; a device decoder may run them as one pass (each position
    /// still attends only to its own prefix).
    fn feed(&mut self, tokens: &[u32], count: usize) -> Vec<Routing> {
        let seqs = tokens.len() / count.max(1);
        (0..count)
            .map(|j| {
                let input: Vec<u32> = (0..seqs).map(|i| tokens[i * count + j]).collect();
                self.step(&input).1
            })
            .collect()
    }
}

/// The CPU's decoder: [`model::decode_step`] over a host KV cache.
pub struct HostDecoder<'a> {
    prep: &'a PreparedModel,
    cache: KvCache,
}

impl<'a> HostDecoder<'a> {
    /// An empty cache for `seqs` sequences of up to `positions` positions.
    pub fn new(prep: &'a PreparedModel, seqs: usize, positions: usize) -> Self {
        HostDecoder {
            prep,
            cache: KvCache::with_capacity(&prep.config, seqs, positions),
        }
    }
}

impl Decoder for HostDecoder<'_> {
    fn step(&mut self, tokens: &[u32]) -> (Vec<f32>, Routing) {
        model::decode_step(self.prep, &mut self.cache, tokens, None)
    }

    fn repeat_each(&mut self, samples: usize) {
        self.cache = self.cache.repeat_each(samples);
    }
}

/// The backend's decoder for `prep`; a device that fails to make one panics with its name.
fn decoder<'a>(
    be: &'a dyn Backend,
    prep: &'a PreparedModel,
    seqs: usize,
    positions: usize,
) -> Box<dyn Decoder + 'a> {
    be.decoder(prep, seqs, positions)
        .unwrap_or_else(|e| panic!("{}: decoder failed: {e}", be.name()))
}

/// Log-softmax of one row of logits at `temperature` (> 0), in place into `out`.
fn log_softmax_row(logits: &[f32], temperature: f32, out: &mut [f32]) {
    let inv = 1.0 / temperature;
    let max = logits
        .iter()
        .fold(f32::NEG_INFINITY, |m, &x| m.max(x * inv));
    let sum: f32 = logits.iter().map(|&x| (x * inv - max).exp()).sum();
    let lse = max + sum.ln();
    for (o, &x) in out.iter_mut().zip(logits) {
        *o = x * inv - lse;
    }
}

/// Sample an index from log-probabilities with one uniform draw (inverse CDF, fixed order).
fn sample(logp: &[f32], u: f32) -> usize {
    let mut acc = 0.0f32;
    for (i, lp) in logp.iter().enumerate() {
        acc += lp.exp();
        if u < acc {
            return i;
        }
    }
    // Rounding left the total just under 1: take the most likely token.
    logp.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map(|(i, _)| i)
        .unwrap_or(0)
}

/// Generate `samples` responses for each prompt (all prompts the same length). `temperature` 0 is
/// greedy decoding (evaluation); otherwise tokens are drawn from the tempered softmax with an RNG
/// seeded by `seed`. Deterministic: one RNG, sequences drawn in a fixed order.
///
/// The prompt is decoded once per distinct prompt, then its KV cache is copied to its samples:
/// every op is per sequence and per token (per-token scales), so this gives the same bytes as
/// decoding all `prompts x samples` sequences from the start, at 1/`samples` of the prompt cost.
pub fn generate(
    be: &dyn Backend,
    prep: &PreparedModel,
    prompts: &[Vec<u32>],
    samples: usize,
    max_new: usize,
    temperature: f32,
    seed: u64,
) -> Rollout {
    generate_with(be, prep, prompts, samples, max_new, temperature, seed, true)
}

#[allow(clippy::too_many_arguments)]
fn generate_with(
    be: &dyn Backend,
    prep: &PreparedModel,
    prompts: &[Vec<u32>],
    samples: usize,
    max_new: usize,
    temperature: f32,
    seed: u64,
    share_prompts: bool,
) -> Rollout {
    let cfg = &prep.config;
    let prompt_len = prompts.first().map_or(0, |p| p.len());
    assert!(
        prompts.iter().all(|p| p.len() == prompt_len),
        "rollout: prompts must have equal length"
    );
    let (b, t, v) = (prompts.len() * samples, prompt_len + max_new, cfg.vocab);
    let mut tokens = vec![PAD; b * t];
    for (i, p) in prompts.iter().enumerate() {
        for s in 0..samples {
            tokens[(i * samples + s) * t..][..prompt_len].copy_from_slice(p);
        }
    }
    let mut logprobs = vec![0.0f32; b * t];
    let mut response_len = vec![0usize; b];
    let mut done = vec![false; b];
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut steps = Vec::with_capacity(t.saturating_sub(1));
    let mut row = vec![0.0f32; v];
    // Prompt positions but the last, once per distinct prompt (or per sequence without sharing).
    let shared = if share_prompts && samples > 1 && prompt_len > 1 {
        prompt_len - 1
    } else {
        0
    };
    // Positions 0..T-1 are decoded (the last token is sampled, never read back).
    let positions = t.saturating_sub(1).max(1);
    let seqs = if shared > 0 { prompts.len() } else { b };
    let mut dec = decoder(be, prep, seqs, positions);
    let mut decoded_rows = seqs * shared;
    if shared > 0 {
        let input: Vec<u32> = prompts.iter().flat_map(|p| p[..shared].to_vec()).collect();
        for routing in dec.feed(&input, shared) {
            steps.push(routing.repeat_each(samples));
        }
        dec.repeat_each(samples);
    }
    for pos in shared..t.saturating_sub(1) {
        let input: Vec<u32> = (0..b).map(|s| tokens[s * t + pos]).collect();
        let (logits, routing) = dec.step(&input);
        decoded_rows += b;
        steps.push(routing);
        let next = pos + 1;
        if next < prompt_len {
            continue; // still reading the prompt
        }
        for s in 0..b {
            if done[s] {
                continue;
            }
            let l = &logits[s * v..(s + 1) * v];
            log_softmax_row(
                l,
                if temperature > 0.0 { temperature } else { 1.0 },
                &mut row,
            );
            let tok = if temperature > 0.0 {
                sample(&row, rng.random::<f32>())
            } else {
                row.iter()
                    .enumerate()
                    .max_by(|a, b| a.1.total_cmp(b.1).then(b.0.cmp(&a.0)))
                    .map_or(0, |(i, _)| i)
            };
            tokens[s * t + next] = tok as u32;
            logprobs[s * t + next] = row[tok];
            response_len[s] += 1;
            if tok as u32 == EOS {
                done[s] = true;
            }
        }
        if done.iter().all(|d| *d) {
            // Everyone finished: the remaining positions are padding; still record routing for them
            // so replay covers the full [B, T-1] block the trainer reads.
            let rest = (pos + 1)..t.saturating_sub(1);
            if !rest.is_empty() {
                decoded_rows += b * rest.len();
                let input: Vec<u32> = (0..b)
                    .flat_map(|s| tokens[s * t..][rest.clone()].to_vec())
                    .collect();
                steps.extend(dec.feed(&input, rest.len()));
            }
            break;
        }
    }
    let truncated: Vec<bool> = done.iter().map(|d| !d).collect();
    let routing = Routing::from_steps(&steps).unwrap_or(Routing {
        top_k: cfg.top_k,
        n_tokens: 0,
        layers: vec![],
    });
    Rollout {
        tokens,
        b,
        t,
        prompt_len,
        response_len,
        logprobs,
        routing,
        truncated,
        decoded_rows,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::backend::CpuBackend;
    use crate::engine::model::{ModelConfig, Params};
    use crate::recipe::{ModelPlan, SitePlan};

    #[test]
    fn decoding_each_prompt_once_gives_the_same_bytes_as_decoding_every_sample() {
        let cfg = ModelConfig::tiny();
        let params = Params::init(&cfg, 5).unwrap();
        let prompts = vec![
            vec![1, 2, 10, 3, 4, 11],
            vec![5, 6, 10, 7, 8, 11],
            vec![1, 2, 10, 3, 4, 11],
        ];
        let mut plans = vec![
            ModelPlan::uniform(cfg.n_layers, SitePlan::FP32),
            ModelPlan::uniform(cfg.n_layers, SitePlan::BF16),
        ];
        for preset in ["nvfp4-dq", "mxfp8", "fp8-block"] {
            let recipe = crate::recipe::presets::preset(preset).unwrap();
            plans.push(recipe.resolve(cfg.n_layers).unwrap());
        }
        for plan in &plans {
            let prep = PreparedModel::new(&params, plan).unwrap();
            let shared = generate_with(&CpuBackend, &prep, &prompts, 4, 5, 1.0, 9, true);
            let each = generate_with(&CpuBackend, &prep, &prompts, 4, 5, 1.0, 9, false);
            assert_eq!(shared.tokens, each.tokens);
            let bits = |r: &Rollout| r.logprobs.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&shared), bits(&each));
            assert_eq!(shared.routing, each.routing);
            assert_eq!(shared.response_len, each.response_len);
            // 3 prompts' first 5 positions once, then 12 sequences x positions 5..10; without
            // sharing, 12 sequences x positions 0..10, whenever the samples stop.
            assert_eq!(
                (shared.decoded_rows, each.decoded_rows),
                (3 * 5 + 12 * 5, 12 * 10)
            );
        }
    }

    #[test]
    fn sampling_is_seeded_and_logprobs_match_a_full_forward() {
        let cfg = ModelConfig::tiny();
        let params = Params::init(&cfg, 3).unwrap();
        let prep =
            PreparedModel::new(&params, &ModelPlan::uniform(cfg.n_layers, SitePlan::FP32)).unwrap();
        let prompts = vec![vec![1, 2, 10, 3, 4, 11], vec![5, 6, 10, 7, 8, 11]];
        let a = generate(&CpuBackend, &prep, &prompts, 3, 5, 1.0, 42);
        let b = generate(&CpuBackend, &prep, &prompts, 3, 5, 1.0, 42);
        assert_eq!(a.tokens, b.tokens);
        assert_eq!(a.logprobs, b.logprobs);
        let c = generate(&CpuBackend, &prep, &prompts, 3, 5, 1.0, 43);
        assert_ne!(
            a.tokens, c.tokens,
            "a different seed should sample differently"
        );
        // The rollout's logprobs equal the full forward's (up to the BF16 KV cache).
        let (logits, _, routing) = model::forward(&prep, &a.tokens_inputs(), a.b, a.t - 1, None);
        let v = cfg.vocab;
        let mut row = vec![0.0; v];
        for s in 0..a.b {
            for pos in 1..a.t {
                if a.is_response(s, pos) {
                    let r = s * (a.t - 1) + pos - 1;
                    log_softmax_row(&logits[r * v..(r + 1) * v], 1.0, &mut row);
                    let lp = row[a.tokens[s * a.t + pos] as usize];
                    assert!(
                        (lp - a.logprobs[s * a.t + pos]).abs() < 0.05,
                        "seq {s} pos {pos}: {lp} vs {}",
                        a.logprobs[s * a.t + pos]
                    );
                }
            }
        }
        assert_eq!(routing.n_tokens, a.routing.n_tokens);
    }
}

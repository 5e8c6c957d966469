//! The rollout engine: an incremental decoder with a BF16 KV cache that samples responses from the
//! *exported* policy — a [`PreparedModel`] built from the weights the trainer shipped, under the
//! rollout's own precision plan. It never reads the trainer's master weights, so a quantization
//! mismatch between the two sides shows up here exactly as it would in a real deployment.
//!
//! Layout: `B = prompts x samples` sequences, each `T = prompt_len + max_new` tokens: the prompt,
//! the sampled response (ending in `<eos>` unless truncated), then `<pad>`. Position `t`'s logprob
//! is the rollout's log-probability of token `t` given tokens `< t` (response positions only).

use super::backend::{Backend, BatchDecoder, HeldExport};
use super::model::{self, KvCache, ModelConfig, PreparedModel, Routing};
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

/// A run's exported policy as the rollout reads it: prepared on the host, or on the device that
/// holds the run's training state ([`Backend::held_export`]; the same bytes, never copied back).
#[derive(Clone, Copy)]
pub enum Policy<'a> {
    Host(&'a PreparedModel),
    Held(&'a HeldExport),
}

impl<'a> Policy<'a> {
    pub fn config(&self) -> &ModelConfig {
        match self {
            Policy::Host(p) => &p.config,
            Policy::Held(e) => e.config(),
        }
    }

    /// The host's prepared model, where the host exported.
    pub fn host(self) -> Option<&'a PreparedModel> {
        match self {
            Policy::Host(p) => Some(p),
            Policy::Held(_) => None,
        }
    }

    /// The device's export, where the device that holds the run exported.
    pub fn held(self) -> Option<&'a HeldExport> {
        match self {
            Policy::Held(e) => Some(e),
            Policy::Host(_) => None,
        }
    }
}

impl<'a> From<&'a PreparedModel> for Policy<'a> {
    fn from(p: &'a PreparedModel) -> Self {
        Policy::Host(p)
    }
}

/// One run's part of a batched rollout ([`generate_batch`]): its exported policy, its prompts and
/// the seed of its sampling stream.
#[derive(Clone, Copy)]
pub struct RolloutItem<'a> {
    pub policy: Policy<'a>,
    pub prompts: &'a [Vec<u32>],
    pub seed: u64,
}

/// One decoder of every member's policy: all exported on the host, or all on the device.
///
/// # Panics
/// When the device fails, or the members mix the two.
fn decoder_of<'a>(
    be: &'a dyn Backend,
    items: &[RolloutItem<'a>],
    seqs: usize,
    positions: usize,
) -> Box<dyn BatchDecoder + 'a> {
    let host: Option<Vec<&PreparedModel>> = items.iter().map(|i| i.policy.host()).collect();
    let made = match host {
        Some(preps) => be.decoder_batch(&preps, seqs, positions),
        None => {
            let held: Option<Vec<&HeldExport>> = items.iter().map(|i| i.policy.held()).collect();
            let exports = held.unwrap_or_else(|| {
                panic!("rollout: members exported on the host and on the device decode apart")
            });
            be.held_decoder_batch(&exports, seqs, positions)
        }
    };
    made.unwrap_or_else(|e| panic!("{}: decoder failed: {e}", be.name()))
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
    let item = RolloutItem {
        policy: prep.into(),
        prompts,
        seed,
    };
    generate_batch(be, &[item], samples, max_new, temperature).remove(0)
}

/// [`generate`] of several runs at once through one [`BatchDecoder`](super::backend::BatchDecoder): every position of every
/// member is one batched decoder call. Members share the shapes (prompt count and length,
/// `samples`, `max_new`, `temperature`); each has its own model, prompts and sampling stream, and
/// gets exactly the rollout [`generate`] would give it on a device whose batched passes equal its
/// single ones.
pub fn generate_batch(
    be: &dyn Backend,
    items: &[RolloutItem<'_>],
    samples: usize,
    max_new: usize,
    temperature: f32,
) -> Vec<Rollout> {
    generate_with(be, items, samples, max_new, temperature, true)
}

/// One member's rollout while it is being decoded.
struct Sampling {
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    response_len: Vec<usize>,
    done: Vec<bool>,
    rng: ChaCha8Rng,
    /// The routing of each decoded position, in order.
    steps: Vec<Routing>,
    decoded_rows: usize,
}

impl Sampling {
    /// `samples` copies of each prompt, padded to `t` tokens.
    fn new(prompts: &[Vec<u32>], samples: usize, t: usize, seed: u64) -> Sampling {
        let (b, prompt_len) = (
            prompts.len() * samples,
            prompts.first().map_or(0, |p| p.len()),
        );
        let mut tokens = vec![PAD; b * t];
        for (i, p) in prompts.iter().enumerate() {
            for s in 0..samples {
                tokens[(i * samples + s) * t..][..prompt_len].copy_from_slice(p);
            }
        }
        Sampling {
            tokens,
            logprobs: vec![0.0; b * t],
            response_len: vec![0; b],
            done: vec![false; b],
            rng: ChaCha8Rng::seed_from_u64(seed),
            steps: Vec::with_capacity(t.saturating_sub(1)),
            decoded_rows: 0,
        }
    }

    fn all_done(&self) -> bool {
        self.done.iter().all(|d| *d)
    }

    /// Every sequence's token at `pos` (the decoder's input).
    fn column(&self, pos: usize, t: usize) -> Vec<u32> {
        (0..self.done.len())
            .map(|s| self.tokens[s * t + pos])
            .collect()
    }

    /// Every sequence's tokens at `range`, sequence-major (a [`Decoder::feed`] input).
    fn block(&self, range: std::ops::Range<usize>, t: usize) -> Vec<u32> {
        (0..self.done.len())
            .flat_map(|s| self.tokens[s * t..][range.clone()].to_vec())
            .collect()
    }

    /// Choose token `next` of every live sequence from its `[B, V]` logits: drawn at
    /// `temperature`, or the most likely (lowest index on ties) at 0.
    fn choose(&mut self, logits: &[f32], next: usize, t: usize, temperature: f32, row: &mut [f32]) {
        let v = row.len();
        for s in 0..self.done.len() {
            if self.done[s] {
                continue;
            }
            let l = &logits[s * v..(s + 1) * v];
            log_softmax_row(l, if temperature > 0.0 { temperature } else { 1.0 }, row);
            let tok = if temperature > 0.0 {
                sample(row, self.rng.random::<f32>())
            } else {
                row.iter()
                    .enumerate()
                    .max_by(|a, b| a.1.total_cmp(b.1).then(b.0.cmp(&a.0)))
                    .map_or(0, |(i, _)| i)
            };
            self.tokens[s * t + next] = tok as u32;
            self.logprobs[s * t + next] = row[tok];
            self.response_len[s] += 1;
            if tok as u32 == EOS {
                self.done[s] = true;
            }
        }
    }

    fn finish(self, t: usize, prompt_len: usize, top_k: usize) -> Rollout {
        let truncated: Vec<bool> = self.done.iter().map(|d| !d).collect();
        let routing = Routing::from_steps(&self.steps).unwrap_or(Routing {
            top_k,
            n_tokens: 0,
            layers: vec![],
        });
        Rollout {
            b: self.done.len(),
            t,
            prompt_len,
            response_len: self.response_len,
            logprobs: self.logprobs,
            routing,
            truncated,
            decoded_rows: self.decoded_rows,
            tokens: self.tokens,
        }
    }
}

/// [`generate_batch`], with the prompts' shared positions decoded once per distinct prompt
/// (`share_prompts`) or once per sequence.
///
/// A member whose sequences have all ended keeps being stepped on its padding, its routing
/// recorded as for any other position, until every member has ended: then the positions left
/// are fed to all members at once. Alone, a member is fed its padding from the position it
/// ended at, and a host decoder feeds position by position, so the two record the same.
fn generate_with(
    be: &dyn Backend,
    items: &[RolloutItem<'_>],
    samples: usize,
    max_new: usize,
    temperature: f32,
    share_prompts: bool,
) -> Vec<Rollout> {
    let Some(first) = items.first() else {
        return Vec::new();
    };
    let cfg = first.policy.config();
    let n_prompts = first.prompts.len();
    let prompt_len = first.prompts.first().map_or(0, |p| p.len());
    assert!(
        items
            .iter()
            .all(|i| i.prompts.len() == n_prompts && i.policy.config() == cfg),
        "rollout: batched members must share the model shape and prompt count"
    );
    assert!(
        items
            .iter()
            .all(|i| i.prompts.iter().all(|p| p.len() == prompt_len)),
        "rollout: prompts must have equal length"
    );
    let (b, t, v) = (n_prompts * samples, prompt_len + max_new, cfg.vocab);
    let mut runs: Vec<Sampling> = items
        .iter()
        .map(|i| Sampling::new(i.prompts, samples, t, i.seed))
        .collect();
    let mut row = vec![0.0f32; v];
    // Prompt positions but the last, once per distinct prompt (or per sequence without sharing).
    let shared = if share_prompts && samples > 1 && prompt_len > 1 {
        prompt_len - 1
    } else {
        0
    };
    // Positions 0..T-1 are decoded (the last token is sampled, never read back).
    let positions = t.saturating_sub(1).max(1);
    let seqs = if shared > 0 { n_prompts } else { b };
    let mut dec = decoder_of(be, items, seqs, positions);
    if shared > 0 {
        let inputs: Vec<Vec<u32>> = items
            .iter()
            .map(|i| {
                i.prompts
                    .iter()
                    .flat_map(|p| p[..shared].to_vec())
                    .collect()
            })
            .collect();
        for (run, fed) in runs.iter_mut().zip(dec.feed(&inputs, shared)) {
            run.decoded_rows += seqs * shared;
            run.steps
                .extend(fed.iter().map(|routing| routing.repeat_each(samples)));
        }
        dec.repeat_each(samples);
    }
    for pos in shared..t.saturating_sub(1) {
        let inputs: Vec<Vec<u32>> = runs.iter().map(|r| r.column(pos, t)).collect();
        let stepped = dec.step(&inputs);
        let next = pos + 1;
        for (run, (logits, routing)) in runs.iter_mut().zip(stepped) {
            run.decoded_rows += b;
            run.steps.push(routing);
            if next >= prompt_len {
                run.choose(&logits, next, t, temperature, &mut row);
            }
        }
        if runs.iter().all(Sampling::all_done) {
            // Everyone finished: the remaining positions are padding; still record routing for
            // them so replay covers the full [B, T-1] block the trainer reads.
            let rest = (pos + 1)..t.saturating_sub(1);
            if !rest.is_empty() {
                let inputs: Vec<Vec<u32>> = runs.iter().map(|r| r.block(rest.clone(), t)).collect();
                for (run, fed) in runs.iter_mut().zip(dec.feed(&inputs, rest.len())) {
                    run.decoded_rows += b * rest.len();
                    run.steps.extend(fed);
                }
            }
            break;
        }
    }
    runs.into_iter()
        .map(|r| r.finish(t, prompt_len, cfg.top_k))
        .collect()
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
            let item = [RolloutItem {
                policy: (&prep).into(),
                prompts: &prompts,
                seed: 9,
            }];
            let shared = generate_with(&CpuBackend, &item, 4, 5, 1.0, true).remove(0);
            let each = generate_with(&CpuBackend, &item, 4, 5, 1.0, false).remove(0);
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

    /// A model that ends a sample about as often as `eos` says (0: as its initialisation does):
    /// every embedding carries a large first component, which the final norm turns into a
    /// positive one of about sqrt(d_model), and only `<eos>` reads it, with weight `eos`.
    fn ending(seed: u64, eos: f32, preset: &str) -> PreparedModel {
        let cfg = ModelConfig::tiny();
        let d = cfg.d_model;
        let mut params = Params::init(&cfg, seed).unwrap();
        params.wte.chunks_mut(d).for_each(|e| e[0] += 10.0);
        for (v, row) in params.output_layer.chunks_mut(d).enumerate() {
            row[0] = if v == EOS as usize { eos } else { 0.0 };
        }
        let plan = crate::recipe::presets::preset(preset)
            .unwrap()
            .resolve(cfg.n_layers)
            .unwrap();
        PreparedModel::new(&params, &plan).unwrap()
    }

    #[test]
    fn a_batched_rollout_gives_each_member_its_rollout_alone() {
        let models = [
            ending(1, 0.7, "bf16"),
            ending(2, 0.0, "nvfp4-dq"),
            ending(3, 0.45, "mxfp8"),
        ];
        let prompts = [
            vec![vec![1, 2, 10, 3, 4, 11], vec![5, 6, 10, 7, 8, 11]],
            vec![vec![9, 9, 10, 0, 1, 11], vec![2, 2, 10, 2, 2, 11]],
            vec![vec![3, 1, 10, 4, 1, 11], vec![5, 9, 10, 2, 6, 11]],
        ];
        let items: Vec<RolloutItem> = models
            .iter()
            .zip(&prompts)
            .zip([21, 22, 23])
            .map(|((prep, prompts), seed)| RolloutItem {
                policy: prep.into(),
                prompts,
                seed,
            })
            .collect();
        let bits = |r: &Rollout| r.logprobs.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (samples, temperature) in [(3, 1.0), (1, 1.0), (2, 0.0)] {
            let together = generate_batch(&CpuBackend, &items, samples, 12, temperature);
            // The position after which every sequence of a member is padding.
            let mut ends = Vec::new();
            for (m, ((item, prep), got)) in items.iter().zip(&models).zip(&together).enumerate() {
                let alone = generate(
                    &CpuBackend,
                    prep,
                    item.prompts,
                    samples,
                    12,
                    temperature,
                    item.seed,
                );
                let case = format!("member {m}, {samples} samples at {temperature}");
                assert_eq!(got.tokens, alone.tokens, "{case}");
                assert_eq!(bits(got), bits(&alone), "{case}");
                assert_eq!(got.routing, alone.routing, "{case}");
                assert_eq!(got.response_len, alone.response_len, "{case}");
                assert_eq!(got.truncated, alone.truncated, "{case}");
                assert_eq!(got.decoded_rows, alone.decoded_rows, "{case}");
                ends.push(alone.response_len.iter().max().copied());
            }
            // The members end at different positions (one of them before the last), so the
            // batch steps a finished member on its padding while the others still sample.
            ends.sort();
            ends.dedup();
            assert!(
                ends.len() >= 2,
                "{samples} samples at {temperature}: ends {ends:?}"
            );
            assert!(
                ends[0] < Some(12),
                "{samples} samples at {temperature}: ends {ends:?}"
            );
        }
    }
}

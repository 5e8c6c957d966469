//! Claims about the quantizer itself, decided without runs (`expect = "batch_invariant"`): does a
//! token come out of [`crate::formats::quantize`] the same whether it is quantized alone or inside
//! a batch? A rollout batches tokens differently from the trainer, so only a batch-invariant
//! activation format lets both sides see the same bytes.
//!
//! Random tokens (rows of K = 256 with magnitudes spread over six decades, so neighbours differ)
//! are quantized alone and at a random position of random batches of 2 to 16; the token's element
//! codes, block scales and dequantized values must be identical in both. The draws are seeded, so
//! the verdict is the same every time: reproduced when every token matched, contradicted (with the
//! first counterexample) otherwise.

use crate::formats::{Axis, Fp8BlockVariant, Fp8Tile, QuantFormat, QuantizedTensor, Scales};
use crate::formats::{Fp8Elem, MxScaleRule, SecondScale};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The activation formats a batch-invariance claim may name.
pub const FORMATS: [&str; 5] = [
    "nvfp4-per-token",
    "nvfp4-per-tensor",
    "mxfp8",
    "fp8-block",
    "bf16",
];

/// The quantizer setting a format name stands for (the activation side: row blocks along K).
pub fn format(name: &str) -> Option<QuantFormat> {
    let nvfp4 = |second| QuantFormat::Nvfp4 { second, shards: 1 };
    match name {
        "nvfp4-per-token" => Some(nvfp4(SecondScale::PerToken)),
        "nvfp4-per-tensor" => Some(nvfp4(SecondScale::PerTensor)),
        "mxfp8" => Some(QuantFormat::Mxfp8 {
            elem: Fp8Elem::E4M3,
            rule: MxScaleRule::TeCeil,
        }),
        "fp8-block" => Some(QuantFormat::Fp8Block {
            tile: Fp8Tile::Act1x128,
            variant: Fp8BlockVariant::Te,
        }),
        "bf16" => Some(QuantFormat::Bf16),
        _ => None,
    }
}

/// Elements per token.
const K: usize = 256;
/// Tokens tried.
pub const TOKENS: usize = 500;
const MAX_BATCH: usize = 16;

/// What the trials found.
#[derive(Debug, Clone, PartialEq)]
pub struct Invariance {
    pub tokens: usize,
    /// Tokens whose bytes or values changed with the batch.
    pub changed: usize,
    /// The first such token: (batch size, position in the batch, elements that differ).
    pub first: Option<(usize, usize, usize)>,
}

/// One random token: Gaussian elements at a magnitude drawn log-uniformly over 1e-3..1e3.
fn token(rng: &mut ChaCha8Rng) -> Vec<f32> {
    let scale = 10f64.powf(rng.random_range(-3.0..3.0));
    (0..K)
        .map(|_| {
            let u1: f64 = rng.random_range(f64::EPSILON..1.0);
            let u2: f64 = rng.random_range(0.0..1.0);
            let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
            (scale * z) as f32
        })
        .collect()
}

/// Row `i`'s element codes, block scales (as bytes) and dequantized values' bits.
fn row_of(q: &QuantizedTensor, i: usize) -> (Vec<u8>, Vec<u8>, Vec<u32>) {
    let slice = |len: usize| i * len / q.rows..(i + 1) * len / q.rows;
    let codes = q.codes[slice(q.codes.len())].to_vec();
    let scales = match &q.scales {
        Scales::None => Vec::new(),
        Scales::E8m0(s) | Scales::E4m3(s) => s[slice(s.len())].to_vec(),
        Scales::F32(s) => s[slice(s.len())]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
    };
    let values = q.dequantize()[i * K..(i + 1) * K]
        .iter()
        .map(|v| v.to_bits())
        .collect();
    (codes, scales, values)
}

/// Quantize `tokens` random tokens alone and inside random batches (seeded by `seed`).
pub fn batch_invariance(fmt: &QuantFormat, tokens: usize, seed: u64) -> Invariance {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let quantize = |x: &[f32], rows: usize| {
        crate::formats::quantize(x, rows, K, fmt, Axis::Row)
            .expect("K = 256 blocks in every format")
    };
    let mut out = Invariance {
        tokens,
        changed: 0,
        first: None,
    };
    for _ in 0..tokens {
        let b = rng.random_range(2..=MAX_BATCH);
        let at = rng.random_range(0..b);
        let batch: Vec<Vec<f32>> = (0..b).map(|_| token(&mut rng)).collect();
        let alone = row_of(&quantize(&batch[at], 1), 0);
        let inside = row_of(&quantize(&batch.concat(), b), at);
        if alone != inside {
            out.changed += 1;
            let differ = alone
                .2
                .iter()
                .zip(&inside.2)
                .filter(|(a, b)| a != b)
                .count();
            out.first.get_or_insert((b, at, differ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_token_scales_are_batch_invariant_and_per_tensor_scales_are_not() {
        let run = |name: &str| batch_invariance(&format(name).unwrap(), 100, 1);
        for name in ["nvfp4-per-token", "mxfp8", "fp8-block", "bf16"] {
            let r = run(name);
            assert_eq!((r.tokens, r.changed, r.first), (100, 0, None), "{name}");
        }
        let r = run("nvfp4-per-tensor");
        assert!(r.changed > 50, "{r:?}");
        let (b, at, differ) = r.first.unwrap();
        assert!(b >= 2 && at < b && differ > 0, "{r:?}");
        assert!(FORMATS.iter().all(|f| format(f).is_some()));
        assert_eq!(format("nvfp4"), None);
    }
}

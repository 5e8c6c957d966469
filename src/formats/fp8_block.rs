//! DeepSeek-V3-style FP8 block scaling (the Hopper recipe): E4M3 elements, one FP32 scale per
//! 1x128 activation tile or 128x128 weight tile. Spec §5.
//!
//! The variants differ in how the scale is computed and applied, and a scale from one variant used
//! with another's math is not bit-exact (`x/s` vs `x·(1/s)`), so the variant travels with the data.
//! The stored scale is always the *decode* multiplier ("scale_inv"): `x' = e4m3(q) · s`.

use super::QuantStats;
use super::fp8::{E4M3_MAX, E4M3_TABLE, e4m3_from_f32_sat};
use serde::{Deserialize, Serialize};

/// Tile edge: 128 along K for activations; 128x128 for weights.
pub const TILE: usize = 128;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fp8BlockVariant {
    /// TE blockwise reference: `scale = 448/amax` (Inf → FLT_MAX, amax 0 → 1), `q = sat(x·scale)`,
    /// stores `1/scale`. The default: it is what the TE-based Hopper recipe runs.
    Te,
    /// DeepSeek-V3 `act_quant`: `s = max(amax, 1e-4)/448`, `q = e4m3(x / s)`.
    DeepseekV3,
    /// DeepSeek-V3 with a UE8M0 scale: `s = 2^ceil(log2(max(amax,1e-4)/448))`, `q = e4m3(x / s)`.
    DeepseekV3Ue8m0,
    /// DeepGEMM: `s = max(amax, 1e-4)/448`, `q = e4m3(x · fp32(1/s))`.
    Deepgemm,
    /// DeepGEMM with `ceil_to_ue8m0(s)` (biased exponent + (mantissa≠0), clamped to [1, 254]).
    DeepgemmUe8m0,
}

/// How elements are brought into range for one tile.
#[derive(Debug, Clone, Copy)]
pub struct TileScale {
    /// Stored decode multiplier.
    pub scale_inv: f32,
    apply: Apply,
}

#[derive(Debug, Clone, Copy)]
enum Apply {
    Mul(f32),
    Div(f32),
}

/// Scale of a tile from its amax (NaN-propagating).
pub fn tile_scale(amax: f32, v: Fp8BlockVariant) -> TileScale {
    use Fp8BlockVariant::*;
    match v {
        Te => {
            let mut scale = if amax == 0.0 {
                f32::INFINITY
            } else {
                E4M3_MAX / amax
            };
            if scale.is_infinite() {
                scale = f32::MAX;
            }
            if amax == 0.0 {
                scale = 1.0;
            }
            TileScale {
                scale_inv: 1.0 / scale,
                apply: Apply::Mul(scale),
            }
        }
        DeepseekV3 | DeepseekV3Ue8m0 | Deepgemm | DeepgemmUe8m0 => {
            let mut s = amax.max(1e-4) / E4M3_MAX;
            if amax.is_nan() {
                s = f32::NAN;
            }
            s = match v {
                DeepgemmUe8m0 => ceil_ue8m0_deepgemm(s),
                DeepseekV3Ue8m0 => pow2_ceil(s),
                _ => s,
            };
            let apply = if matches!(v, Deepgemm | DeepgemmUe8m0) {
                Apply::Mul(1.0 / s)
            } else {
                Apply::Div(s)
            };
            TileScale {
                scale_inv: s,
                apply,
            }
        }
    }
}

/// DeepGEMM `ceil_to_ue8m0`: biased exponent + (mantissa ≠ 0), clamped to [1, 254].
fn ceil_ue8m0_deepgemm(s: f32) -> f32 {
    if s.is_nan() {
        return s;
    }
    let b = s.abs().to_bits();
    let e = ((b >> 23) & 0xFF) + u32::from(b & 0x7F_FFFF != 0);
    f32::from_bits(e.clamp(1, 254) << 23)
}

/// 2^ceil(log2 s) for a positive normal s (exact).
fn pow2_ceil(s: f32) -> f32 {
    if !s.is_finite() || s <= 0.0 {
        return s;
    }
    let b = s.to_bits();
    let e = ((b >> 23) & 0xFF) + u32::from(b & 0x7F_FFFF != 0);
    f32::from_bits(e.min(254) << 23)
}

/// Encode the values of one tile (or a row's part of it) into `out`: scale each value (the tile's
/// multiply or divide, chosen once per tile so the loop can vectorise), then saturating E4M3.
pub fn encode_tile(xs: &[f32], t: &TileScale, out: &mut [u8], stats: &mut QuantStats) {
    match t.apply {
        Apply::Mul(m) => encode_with(xs, out, stats, |v| v * m),
        Apply::Div(d) => encode_with(xs, out, stats, |v| v / d),
    }
}

#[inline(always)]
fn encode_with(xs: &[f32], out: &mut [u8], stats: &mut QuantStats, scale: impl Fn(f32) -> f32) {
    let (mut saturated, mut underflowed) = (0u32, 0u32);
    for (c, &v) in out.iter_mut().zip(xs) {
        let s = scale(v);
        let finite = v.is_finite();
        saturated += u32::from(s.abs() > E4M3_MAX && finite);
        *c = e4m3_from_f32_sat(s);
        underflowed += u32::from(*c & 0x7F == 0 && v != 0.0 && finite);
    }
    stats.add_block(out.len().min(xs.len()), saturated, underflowed);
}

/// Decode one value.
#[inline]
pub fn decode(c: u8, scale_inv: f32) -> f32 {
    E4M3_TABLE[c as usize] * scale_inv
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The encode loop's 32-bit block counters give the counts the per-element definition gives
    /// (saturated: finite input whose scaled magnitude exceeds 448; underflowed: finite non-zero
    /// input whose code is ±0), for every variant, on inputs with NaN, ±Inf, huge and tiny values.
    #[test]
    fn block_counts_match_the_per_element_definition() {
        use Fp8BlockVariant::*;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        for v in [Te, DeepseekV3, DeepseekV3Ue8m0, Deepgemm, DeepgemmUe8m0] {
            for amax in [1.0f32, 3e-3, 600.0, 1e-6] {
                let mut xs: Vec<f32> = (0..128)
                    .map(|_| rng.random_range(-1.0f32..1.0) * 2f32.powi(rng.random_range(-40..12)))
                    .collect();
                xs[..5].copy_from_slice(&[f32::NAN, f32::INFINITY, -f32::INFINITY, 0.0, -0.0]);
                let t = tile_scale(amax, v);
                let mut codes = vec![0u8; xs.len()];
                let mut got = QuantStats::default();
                encode_tile(&xs, &t, &mut codes, &mut got);
                let mut want = QuantStats::default();
                for (&x, &c) in xs.iter().zip(&codes) {
                    let s = match t.apply {
                        Apply::Mul(m) => x * m,
                        Apply::Div(d) => x / d,
                    };
                    want.note(x, s.abs() > E4M3_MAX);
                    want.note_underflow(x, c & 0x7F == 0);
                }
                assert_eq!(got, want, "{v:?} amax {amax}");
                assert!(
                    got.saturated > 0 || amax >= 1.0,
                    "{v:?} amax {amax}: {got:?}"
                );
            }
        }
    }
}

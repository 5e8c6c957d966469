//! BF16 (1/8/7, bias 127): the upper half of an FP32. Spec §1.1.
//!
//! Encode is round-to-nearest-even on the 16 dropped bits; a value that rounds past the largest
//! finite BF16 becomes ±Inf (the carry runs into the exponent field). NaN keeps its sign and payload
//! top bits and gets the quiet bit 0x0040 set (the golden rule; ml_dtypes and torch agree, other
//! implementations differ only in the payload).

/// FP32 → BF16 bits, round to nearest even.
pub const fn bf16_from_f32(x: f32) -> u16 {
    let u = x.to_bits();
    if (u & 0x7FFF_FFFF) > 0x7F80_0000 {
        return ((u >> 16) as u16) | 0x0040;
    }
    let lsb = (u >> 16) & 1;
    (u.wrapping_add(0x7FFF + lsb) >> 16) as u16
}

/// BF16 bits → FP32 (exact).
pub const fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Round an FP32 value to the nearest BF16 value, kept as FP32 ("operands rounded to BF16").
#[inline]
pub const fn round_bf16(x: f32) -> f32 {
    bf16_to_f32(bf16_from_f32(x))
}

/// Round every value of a slice to BF16 in place.
pub fn round_bf16_slice(xs: &mut [f32]) {
    for x in xs {
        *x = round_bf16(*x);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_bf16_code_round_trips() {
        for b in 0..=u16::MAX {
            let x = bf16_to_f32(b);
            let back = bf16_from_f32(x);
            if x.is_nan() {
                // NaN stays NaN with the same sign and the quiet bit set.
                assert_eq!(back, b | 0x0040, "NaN code {b:#06x}");
            } else {
                assert_eq!(back, b, "code {b:#06x}");
            }
        }
    }

    #[test]
    fn ties_and_overflow() {
        // 1 + 2^-8 = 0x3F80_8000: exactly halfway between 0x3F80 and 0x3F81 -> even 0x3F80.
        assert_eq!(bf16_from_f32(f32::from_bits(0x3F80_8000)), 0x3F80);
        // 1 + 3·2^-8 = 0x3F81_8000: halfway between 0x3F81 and 0x3F82 -> even 0x3F82.
        assert_eq!(bf16_from_f32(f32::from_bits(0x3F81_8000)), 0x3F82);
        // One ulp above a tie rounds up.
        assert_eq!(bf16_from_f32(f32::from_bits(0x3F80_8001)), 0x3F81);
        // 0x7F7F_8000 is the tie between max finite 0x7F7F and 2^128 -> odd max rounds up to +Inf.
        assert_eq!(bf16_from_f32(f32::from_bits(0x7F7F_8000)), 0x7F80);
        assert_eq!(bf16_from_f32(f32::from_bits(0xFF7F_8000)), 0xFF80);
        assert_eq!(bf16_from_f32(-0.0), 0x8000);
        assert_eq!(bf16_from_f32(f32::NAN), 0x7FC0);
        assert_eq!(bf16_from_f32(f32::from_bits(0xFF80_0001)), 0xFFC0);
    }

    #[test]
    fn encode_is_monotonic_on_finite_inputs() {
        let mut prev = f32::NEG_INFINITY;
        let mut u: u32 = 0xFF7F_FFFF; // most negative finite, walking up in value
        let mut xs = Vec::new();
        while u > 0x8000_0000 {
            xs.push(f32::from_bits(u));
            u -= 0x0001_2345;
        }
        let mut v: u32 = 0;
        while v < 0x7F7F_FFFF {
            xs.push(f32::from_bits(v));
            v = v.saturating_add(0x0001_2345);
        }
        for x in xs {
            let r = round_bf16(x);
            assert!(r >= prev, "round_bf16 not monotonic at {x:e}");
            prev = r;
        }
    }
}

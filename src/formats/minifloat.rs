//! Round-to-nearest-even from FP32 to a small binary float (E4M3, E5M2, E2M1), done once on bits.
//!
//! The trick every codec here shares: write the target's magnitude code as one integer
//! `exponent_field << mbits | mantissa`. Codes are then ordered like the values they encode, so
//! rounding is "keep the high bits, add one if the dropped bits are above half, or exactly half and
//! the kept code is odd" — and a carry out of the mantissa lands in the next binade for free
//! (subnormal → min normal, binade → binade, and past the largest finite code → the caller's overflow
//! rule). Callers handle sign, NaN and overflow; this module only rounds finite magnitudes.

/// Layout of a small float: exponent bits, mantissa bits, exponent bias.
#[derive(Debug, Clone, Copy)]
pub struct Minifloat {
    pub mbits: u32,
    pub bias: i32,
}

impl Minifloat {
    /// Round `|x|` (given as the FP32 bits with the sign cleared, finite) to the nearest magnitude code,
    /// ties to even. The result may exceed the largest finite code: the caller saturates or
    /// maps it to Inf/NaN.
    pub const fn round_magnitude(self, abs_bits: u32) -> u32 {
        let exp_field = (abs_bits >> 23) as i32;
        if exp_field == 0 {
            // FP32 zero or subnormal (< 2^-126): below half the smallest subnormal of every target.
            return 0;
        }
        let sig = (1u32 << 23) | (abs_bits & 0x7F_FFFF); // 24-bit significand, value = sig·2^(e-23)
        let e = exp_field - 127;
        let min_normal_exp = 1 - self.bias;
        // Number of low significand bits that do not fit in the target.
        let (base, shift) = if e >= min_normal_exp {
            // Normal in the target: code = (e + bias) << mbits | top mbits of the fraction.
            (((e + self.bias) as u32) << self.mbits, 23 - self.mbits)
        } else {
            // Subnormal in the target: units of 2^(min_normal_exp - mbits).
            let s = 23 - self.mbits as i32 + (min_normal_exp - e);
            if s > 24 {
                return 0; // below half the smallest subnormal
            }
            (0, s as u32)
        };
        let kept = if e >= min_normal_exp {
            (sig & 0x7F_FFFF) >> shift
        } else {
            sig >> shift
        };
        let rem = sig & ((1u32 << shift) - 1);
        let half = 1u32 << (shift - 1);
        let code = base + kept;
        if rem > half || (rem == half && code & 1 == 1) {
            code + 1
        } else {
            code
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const E4M3: Minifloat = Minifloat { mbits: 3, bias: 7 };

    #[test]
    fn ties_go_to_even_codes() {
        // 1.0625 = 1.0001b: halfway between 1.0 (code 0x38) and 1.125 (0x39) -> even 0x38.
        assert_eq!(E4M3.round_magnitude(1.0625f32.to_bits()), 0x38);
        // 1.1875 = 1.0011b: halfway between 0x39 and 0x3A -> even 0x3A.
        assert_eq!(E4M3.round_magnitude(1.1875f32.to_bits()), 0x3A);
        // Subnormal tie: 2^-10 is half of the smallest subnormal 2^-9 -> 0 (even).
        assert_eq!(E4M3.round_magnitude((2f32).powi(-10).to_bits()), 0);
        // 3·2^-10 is halfway between 2^-9 (code 1) and 2·2^-9 (code 2) -> 2.
        assert_eq!(E4M3.round_magnitude((3.0 * (2f32).powi(-10)).to_bits()), 2);
    }

    #[test]
    fn carries_cross_binades() {
        // 1.9999 rounds up out of the [1,2) binade into 2.0 = code 0x40.
        assert_eq!(E4M3.round_magnitude(1.9999f32.to_bits()), 0x40);
        // Just below the min normal 2^-6 rounds to the min normal code 0x08.
        assert_eq!(E4M3.round_magnitude(0.015_6f32.to_bits()), 0x08);
    }
}

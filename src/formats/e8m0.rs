//! E8M0: the unsigned power-of-two scale of MX formats (8 exponent bits, bias 127, no sign, no zero;
//! 0xFF is NaN). Spec §1 and §2.
//!
//! Two ways to pick a scale byte from FP32, named after their sources:
//! - [`e8m0_ceil_from_f32`]: TE's `float_to_e8m0` = PTX `cvt.rp.satfinite.ue8m0x2.f32` (round the
//!   value *up* to a power of two, saturate at 2^127);
//! - [`e8m0_from_exponent`]: the OCP/MSX rule, given the already-floored exponent.
//!
//! Never round scales "to nearest in the linear domain" (ml_dtypes `astype`): see spec §2.

/// TE `float_to_e8m0`: NaN → 0xFF, ±Inf → 0xFE, 0 → 0x00; otherwise the FP32 exponent field,
/// plus one when the mantissa is non-zero — except at 0xFE (saturate) and for FP32 subnormals
/// ≤ 2^-127 (mantissa ≤ 0x400000), which stay 0x00.
pub fn e8m0_ceil_from_f32(v: f32) -> u8 {
    if v.is_nan() {
        return 0xFF;
    }
    if v.is_infinite() {
        return 0xFE;
    }
    if v == 0.0 {
        return 0x00;
    }
    let u = v.to_bits();
    let e = (u >> 23) & 0xFF;
    let m = u & 0x7F_FFFF;
    let bump = m > 0 && e != 0xFE && !(e == 0 && m <= 0x40_0000);
    (e + bump as u32) as u8
}

/// Scale byte for an unbiased exponent (OCP rule): `< -127` clamps to 0x00; `> 127` is NaN (0xFF).
pub fn e8m0_from_exponent(e: i32) -> u8 {
    if e > 127 {
        0xFF
    } else {
        (e.max(-127) + 127) as u8
    }
}

/// E8M0 byte → FP32: 2^(b-127); 0x00 is the FP32 subnormal 2^-127; 0xFF is NaN.
pub fn e8m0_to_f32(b: u8) -> f32 {
    match b {
        0xFF => f32::NAN,
        0 => f32::from_bits(0x0040_0000),
        _ => f32::from_bits((b as u32) << 23),
    }
}

/// TE `exp2f_rcp`: 2^(127-b) as FP32 (the multiplier that brings a block into range);
/// b = 254 gives the subnormal 2^-127, b = 255 gives NaN.
pub fn e8m0_reciprocal(b: u8) -> f32 {
    match b {
        0xFF => f32::NAN,
        254 => f32::from_bits(0x0040_0000),
        _ => f32::from_bits((254 - b as u32) << 23),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_byte_decodes_to_its_power_of_two() {
        for b in 0..=254u8 {
            assert_eq!(e8m0_to_f32(b) as f64, 2f64.powi(b as i32 - 127), "byte {b}");
            assert_eq!(
                e8m0_reciprocal(b) as f64,
                2f64.powi(127 - b as i32),
                "rcp {b}"
            );
            // A power of two encodes to itself under the ceil rule (no mantissa to round up).
            assert_eq!(e8m0_ceil_from_f32(e8m0_to_f32(b)), b, "round trip {b}");
        }
        assert!(e8m0_to_f32(0xFF).is_nan());
        assert!(e8m0_reciprocal(0xFF).is_nan());
    }

    #[test]
    fn ceil_rounds_up_and_saturates() {
        assert_eq!(e8m0_ceil_from_f32(1.0), 127);
        assert_eq!(e8m0_ceil_from_f32(1.000_000_1), 128);
        assert_eq!(e8m0_ceil_from_f32(0.75), 127); // 2^-1 < 0.75 -> 2^0
        assert_eq!(e8m0_ceil_from_f32(f32::MAX), 0xFE); // exponent 254, saturates instead of 255
        assert_eq!(e8m0_ceil_from_f32(f32::INFINITY), 0xFE);
        assert_eq!(e8m0_ceil_from_f32(f32::NAN), 0xFF);
        assert_eq!(e8m0_ceil_from_f32(0.0), 0x00);
        // Subnormal ≤ 2^-127 stays at 0x00; just above it rounds up to 2^-126 (0x01).
        assert_eq!(e8m0_ceil_from_f32(f32::from_bits(0x0040_0000)), 0x00);
        assert_eq!(e8m0_ceil_from_f32(f32::from_bits(0x0040_0001)), 0x01);
        assert_eq!(e8m0_ceil_from_f32(f32::from_bits(1)), 0x00);
    }

    #[test]
    fn exponent_rule_clamps() {
        assert_eq!(e8m0_from_exponent(0), 127);
        assert_eq!(e8m0_from_exponent(-200), 0);
        assert_eq!(e8m0_from_exponent(127), 254);
        assert_eq!(e8m0_from_exponent(128), 0xFF);
    }
}

//! FP8 element codecs: E4M3 ("fn": 1/4/3, bias 7, max 448, no Inf, NaN = S.1111.111) and E5M2
//! (1/5/2, bias 15, max 57344, IEEE-style Inf/NaN). Spec §1 and §1.1.
//!
//! Two casts each, named at every call site because they differ only at overflow and specials:
//! - *saturating* (PTX `cvt.rn.satfinite`, what the TE quantizers use): overflow and ±Inf clamp to
//!   ±max, NaN → 0x7F (E4M3) / 0x7E (E5M2);
//! - *plain* (torch `.to()`, ml_dtypes `astype`): overflow past the rounding boundary → NaN (E4M3) or
//!   ±Inf (E5M2); NaN keeps its sign for E4M3 (ml_dtypes), → 0x7E for E5M2.
//!
//! Both round to nearest even first (see `minifloat`), so "clamp then round" and "round then
//! saturate" give the same code.

use super::minifloat::Minifloat;

const E4M3: Minifloat = Minifloat { mbits: 3, bias: 7 };
const E5M2: Minifloat = Minifloat { mbits: 2, bias: 15 };

/// Largest finite E4M3 magnitude code (448).
pub const E4M3_MAX_CODE: u8 = 0x7E;
/// Largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;
/// Largest finite E5M2 magnitude code (57344).
pub const E5M2_MAX_CODE: u8 = 0x7B;
/// Largest finite E5M2 value.
pub const E5M2_MAX: f32 = 57344.0;

#[inline]
fn sign_bit(x: f32) -> u8 {
    ((x.to_bits() >> 24) & 0x80) as u8
}

/// FP32 → E4M3 code, saturating (TE quantizers, `cvt.rn.satfinite.e4m3x2.f32`).
///
/// Branch-free fast path (this runs once per element in every quantizer): clamp |x| to 448 (exact,
/// so clamp-then-round equals round-then-saturate), then round to nearest even either with the
/// BF16-style bit trick (normal targets: add `half - 1 + lsb` and shift) or, below 2^-6, with the
/// float trick `|x|·2^9 + 2^23` whose FP32 rounding *is* RNE to a multiple of the subnormal step.
/// The generic `minifloat` rounding is the independent reference it is tested against.
#[inline(always)]
pub fn e4m3_from_f32_sat(x: f32) -> u8 {
    e4m3_code_u32_sat(x) as u8
}

/// [`e4m3_from_f32_sat`] in a 32-bit lane (the code is below 256): the same rule, kept 32-bit
/// to the end so a vectorised block loop does not narrow to bytes in the middle.
#[inline(always)]
pub(crate) fn e4m3_code_u32_sat(x: f32) -> u32 {
    let u = x.to_bits();
    let a = f32::from_bits(u & 0x7FFF_FFFF).min(E4M3_MAX); // min() ignores NaN: handled below
    let ab = a.to_bits();
    // Normal E4M3 (|x| >= 2^-6): rebias the exponent (127 -> 7) and round off 20 mantissa bits.
    let normal = ab
        .wrapping_sub(120 << 23)
        .wrapping_add(0x7_FFFF + ((ab >> 20) & 1))
        >> 20;
    // Subnormal E4M3: units of 2^-9, rounded by FP32 addition at magnitude 2^23.
    let sub = (a * 512.0 + 8_388_608.0)
        .to_bits()
        .wrapping_sub(0x4B00_0000);
    let mag = if ab < (121 << 23) { sub } else { normal };
    let code = ((u >> 24) & 0x80) | (mag & 0xFF);
    if x.is_nan() { 0x7F } else { code }
}

/// Reference (slow, generic) saturating E4M3 encode; kept to test the fast path against.
pub fn e4m3_from_f32_sat_reference(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let abs = x.to_bits() & 0x7FFF_FFFF;
    let mag = if abs >= 0x7F80_0000 {
        E4M3_MAX_CODE as u32
    } else {
        E4M3.round_magnitude(abs)
    };
    sign_bit(x) | mag.min(E4M3_MAX_CODE as u32) as u8
}

/// FP32 → E4M3 code, plain non-saturating cast (ml_dtypes / torch): |x| rounding above 448 → NaN.
pub fn e4m3_from_f32_plain(x: f32) -> u8 {
    if x.is_nan() || x.is_infinite() {
        return sign_bit(x) | 0x7F;
    }
    let mag = E4M3.round_magnitude(x.to_bits() & 0x7FFF_FFFF);
    if mag > E4M3_MAX_CODE as u32 {
        sign_bit(x) | 0x7F
    } else {
        sign_bit(x) | mag as u8
    }
}

/// E4M3 code → FP32 (exact). 0x7F / 0xFF are NaN.
pub const fn e4m3_to_f32(c: u8) -> f32 {
    let neg = c & 0x80 != 0;
    let e = ((c >> 3) & 0xF) as i32;
    let m = (c & 7) as f32;
    if e == 15 && (c & 7) == 7 {
        return f32::NAN;
    }
    let mag = if e == 0 {
        m * (1.0 / 512.0)
    } else {
        (1.0 + m / 8.0) * pow2(e - 7)
    };
    if neg { -mag } else { mag }
}

/// FP32 → E5M2 code, saturating: overflow and ±Inf → ±57344, NaN → 0x7E.
pub fn e5m2_from_f32_sat(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7E;
    }
    let abs = x.to_bits() & 0x7FFF_FFFF;
    let mag = if abs >= 0x7F80_0000 {
        E5M2_MAX_CODE as u32
    } else {
        E5M2.round_magnitude(abs)
    };
    sign_bit(x) | mag.min(E5M2_MAX_CODE as u32) as u8
}

/// FP32 → E5M2 code, plain cast: values rounding past 57344 → ±Inf, NaN → 0x7E (ml_dtypes).
pub fn e5m2_from_f32_plain(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7E;
    }
    let abs = x.to_bits() & 0x7FFF_FFFF;
    let mag = if abs >= 0x7F80_0000 {
        0x7C
    } else {
        E5M2.round_magnitude(abs).min(0x7C)
    };
    sign_bit(x) | mag as u8
}

/// E5M2 code → FP32 (exact); exponent field 31 is Inf (mantissa 0) or NaN.
pub const fn e5m2_to_f32(c: u8) -> f32 {
    let neg = c & 0x80 != 0;
    let e = ((c >> 2) & 0x1F) as i32;
    let m = (c & 3) as f32;
    let mag = if e == 31 {
        if c & 3 == 0 { f32::INFINITY } else { f32::NAN }
    } else if e == 0 {
        m * (1.0 / 65536.0)
    } else {
        (1.0 + m / 4.0) * pow2(e - 15)
    };
    if neg { -mag } else { mag }
}

/// 2^e for |e| < 127 as an exact FP32 (const-evaluable).
pub(crate) const fn pow2(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

/// Decode table of all 256 E4M3 codes (hot paths index it instead of decoding).
pub static E4M3_TABLE: [f32; 256] = {
    let mut t = [0.0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = e4m3_to_f32(i as u8);
        i += 1;
    }
    t
};

/// Decode table of all 256 E5M2 codes.
pub static E5M2_TABLE: [f32; 256] = {
    let mut t = [0.0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = e5m2_to_f32(i as u8);
        i += 1;
    }
    t
};

#[cfg(test)]
mod tests {
    use super::*;

    /// Nearest finite code by exhaustive search, ties to the even code (independent of `minifloat`).
    fn brute_nearest(x: f32, table: &[f32; 256], max_code: u8) -> u8 {
        let a = (x.abs() as f64).min(table[max_code as usize] as f64);
        let mut best = 0u8;
        let mut best_d = f64::INFINITY;
        for c in 0..=max_code {
            let d = (table[c as usize] as f64 - a).abs();
            if d < best_d || (d == best_d && c % 2 == 0) {
                best = c;
                best_d = d;
            }
        }
        best | if x.is_sign_negative() { 0x80 } else { 0 }
    }

    #[test]
    fn every_code_round_trips_both_casts() {
        for c in 0..=255u8 {
            let x = e4m3_to_f32(c);
            if x.is_nan() {
                assert_eq!(e4m3_from_f32_sat(x), 0x7F);
                continue;
            }
            assert_eq!(e4m3_from_f32_sat(x), c, "e4m3 sat {c:#04x}");
            assert_eq!(e4m3_from_f32_plain(x), c, "e4m3 plain {c:#04x}");
        }
        for c in 0..=255u8 {
            let x = e5m2_to_f32(c);
            if x.is_nan() {
                continue;
            }
            assert_eq!(e5m2_from_f32_plain(x), c, "e5m2 plain {c:#04x}");
            if x.is_finite() {
                assert_eq!(e5m2_from_f32_sat(x), c, "e5m2 sat {c:#04x}");
            }
        }
    }

    #[test]
    fn midpoints_match_brute_force() {
        // Every midpoint between neighbouring codes, and one ulp either side.
        for (table, max, enc) in [
            (
                &E4M3_TABLE,
                E4M3_MAX_CODE,
                e4m3_from_f32_sat as fn(f32) -> u8,
            ),
            (
                &E5M2_TABLE,
                E5M2_MAX_CODE,
                e5m2_from_f32_sat as fn(f32) -> u8,
            ),
        ] {
            for c in 0..max {
                let mid = ((table[c as usize] as f64 + table[c as usize + 1] as f64) / 2.0) as f32;
                for x in [
                    f32::from_bits(mid.to_bits() - 1),
                    mid,
                    f32::from_bits(mid.to_bits() + 1),
                ] {
                    assert_eq!(enc(x), brute_nearest(x, table, max), "x = {x:e}");
                    assert_eq!(enc(-x), brute_nearest(-x, table, max), "x = {:e}", -x);
                }
            }
        }
    }

    #[test]
    fn fast_e4m3_matches_the_generic_rounding() {
        // Every FP32 whose magnitude lies below 2^10, at a stride that hits every mantissa pattern
        // class, plus all midpoints ±1 ulp (above) and the specials.
        let mut u: u32 = 0;
        while u < 0x4480_0000 {
            for x in [f32::from_bits(u), -f32::from_bits(u)] {
                assert_eq!(
                    e4m3_from_f32_sat(x),
                    e4m3_from_f32_sat_reference(x),
                    "x = {x:e} ({u:#x})"
                );
            }
            u += 0x0000_0FFF;
        }
        for x in [
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::MAX,
            f32::MIN,
            1e30,
            -0.0,
            0.0,
        ] {
            assert_eq!(
                e4m3_from_f32_sat(x),
                e4m3_from_f32_sat_reference(x),
                "x = {x:e}"
            );
        }
    }

    #[test]
    fn overflow_and_specials() {
        // 464 is the exact tie between 448 (0x7E, even) and 480 (not finite): both casts give 448.
        assert_eq!(e4m3_from_f32_sat(464.0), 0x7E);
        assert_eq!(e4m3_from_f32_plain(464.0), 0x7E);
        // Inside (464, 480): plain -> NaN, saturating -> 448.
        assert_eq!(e4m3_from_f32_plain(464.5), 0x7F);
        assert_eq!(e4m3_from_f32_sat(464.5), 0x7E);
        assert_eq!(e4m3_from_f32_plain(-1e6), 0xFF);
        assert_eq!(e4m3_from_f32_sat(-1e6), 0xFE);
        assert_eq!(e4m3_from_f32_sat(f32::INFINITY), 0x7E);
        assert_eq!(e4m3_from_f32_sat(f32::NEG_INFINITY), 0xFE);
        assert_eq!(e4m3_from_f32_plain(f32::INFINITY), 0x7F);
        assert_eq!(e4m3_from_f32_sat(-f32::NAN), 0x7F);
        assert_eq!(e4m3_from_f32_plain(-f32::NAN), 0xFF);
        assert_eq!(e4m3_from_f32_sat(-0.0), 0x80);
        // E5M2: 61440 is the tie between 57344 and 65536 (odd max -> rounds up -> Inf in plain cast).
        assert_eq!(e5m2_from_f32_plain(61440.0), 0x7C);
        assert_eq!(e5m2_from_f32_plain(61439.0), 0x7B);
        assert_eq!(e5m2_from_f32_sat(61440.0), 0x7B);
        assert_eq!(e5m2_from_f32_sat(f32::NEG_INFINITY), 0xFB);
        assert_eq!(e5m2_from_f32_plain(f32::NEG_INFINITY), 0xFC);
        assert_eq!(e5m2_from_f32_plain(f32::NAN), 0x7E);
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0x01), (2f32).powi(-9));
        assert_eq!(e5m2_to_f32(0x7B), 57344.0);
        assert_eq!(e5m2_to_f32(0x01), (2f32).powi(-16));
    }

    #[test]
    fn encode_is_monotonic() {
        let mut prev = -1e9f32;
        let mut x = -600.0f32;
        while x < 600.0 {
            let v = e4m3_to_f32(e4m3_from_f32_sat(x));
            assert!(v >= prev, "e4m3 not monotonic at {x}");
            prev = v;
            x += 0.0137;
        }
    }
}

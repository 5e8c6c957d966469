//! FP4 E2M1 (1/2/1, bias 1, max 6, no Inf/NaN) and its packing. Spec §1, §1.1 and §4.1.
//!
//! All implementations round to nearest even and saturate to ±6; they differ only on −0.0 and NaN,
//! so the convention is an explicit argument:
//! - [`E2m1Convention::TeRef`] (TE's PyTorch reference threshold table, the golden default):
//!   −0.0 → code 0, NaN → code 0;
//! - [`E2m1Convention::MlDtypes`]: −0.0 → 8, NaN → 8;
//! - [`E2m1Convention::PtxSatfinite`] (the hardware cvt): −0.0 → 8, NaN → 7 (+6).
//!
//! Packing: element 2i in the low nibble, element 2i+1 in the high nibble (memory order; the PTX
//! instruction's operand order is the reverse, which only kernels need to know).

use super::minifloat::Minifloat;

const E2M1: Minifloat = Minifloat { mbits: 1, bias: 1 };

/// Values of the 16 E2M1 codes (bit 3 is the sign).
pub const E2M1_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// How −0.0 and NaN encode (the only points where references disagree).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum E2m1Convention {
    TeRef,
    MlDtypes,
    PtxSatfinite,
}

/// FP32 → E2M1 code (4 bits), round to nearest even, saturating to ±6.
///
/// Same branch-free shape as the fast E4M3 encode: clamp |x| to 6, bit-trick RNE for normals
/// (|x| >= 1), FP32-addition RNE in steps of 0.5 below; specials per convention.
#[inline(always)]
pub fn e2m1_from_f32(x: f32, conv: E2m1Convention) -> u8 {
    e2m1_code_u32(x, conv) as u8
}

/// [`e2m1_from_f32`] in a 32-bit lane: the same rule, kept 32-bit to the end so a vectorised
/// loop does not narrow to bytes in the middle (LLVM then builds the bytes one insert at a time).
#[inline(always)]
pub(crate) fn e2m1_code_u32(x: f32, conv: E2m1Convention) -> u32 {
    let u = x.to_bits();
    let a = f32::from_bits(u & 0x7FFF_FFFF).min(6.0);
    let ab = a.to_bits();
    let normal = ab
        .wrapping_sub(126 << 23)
        .wrapping_add(0x1F_FFFF + ((ab >> 22) & 1))
        >> 22;
    let sub = (a * 2.0 + 8_388_608.0).to_bits().wrapping_sub(0x4B00_0000);
    let mag = if ab < (127 << 23) { sub } else { normal };
    let code = ((u >> 28) & 8) | mag;
    let nan_code = match conv {
        // ±0 and NaN both give 0: one unsigned compare keeps exactly the magnitudes in
        // (0, Inf], in place of a test for each (this runs once per NVFP4 element).
        E2m1Convention::TeRef => {
            let keep = (u & 0x7FFF_FFFF).wrapping_sub(1) < 0x7F80_0000;
            return if keep { code } else { 0 };
        }
        E2m1Convention::MlDtypes => 8,
        E2m1Convention::PtxSatfinite => 7,
    };
    if x.is_nan() { nan_code } else { code }
}

/// Reference (slow, generic) E2M1 encode; kept to test the fast path against.
pub fn e2m1_from_f32_reference(x: f32, conv: E2m1Convention) -> u8 {
    let u = x.to_bits();
    let abs = u & 0x7FFF_FFFF;
    if abs > 0x7F80_0000 {
        return match conv {
            E2m1Convention::TeRef => 0,
            E2m1Convention::MlDtypes => 8,
            E2m1Convention::PtxSatfinite => 7,
        };
    }
    if u == 0x8000_0000 && conv == E2m1Convention::TeRef {
        return 0;
    }
    let mag = if abs >= 0x7F80_0000 {
        7
    } else {
        E2M1.round_magnitude(abs).min(7)
    };
    ((u >> 28) & 8) as u8 | mag as u8
}

/// E2M1 code → FP32 (the low 4 bits are used).
#[inline]
pub fn e2m1_to_f32(c: u8) -> f32 {
    E2M1_VALUES[(c & 0xF) as usize]
}

/// Pack 4-bit codes two a byte, element 2i in the low nibble. An odd count pads with code 0.
pub fn pack_fp4(codes: &[u8]) -> Vec<u8> {
    codes
        .chunks(2)
        .map(|p| (p[0] & 0xF) | (p.get(1).copied().unwrap_or(0) & 0xF) << 4)
        .collect()
}

/// Unpack `n` 4-bit codes (inverse of [`pack_fp4`]).
pub fn unpack_fp4(packed: &[u8], n: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(n);
    for &b in packed {
        out.push(b & 0xF);
        out.push(b >> 4);
    }
    out.truncate(n);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use E2m1Convention::*;

    #[test]
    fn every_code_round_trips() {
        for c in 0..16u8 {
            let x = e2m1_to_f32(c);
            assert_eq!(e2m1_from_f32(x, PtxSatfinite), c);
            assert_eq!(e2m1_from_f32(x, MlDtypes), c);
            // TE's table sends −0.0 to +0.
            assert_eq!(e2m1_from_f32(x, TeRef), if c == 8 { 0 } else { c });
        }
    }

    #[test]
    fn ties_go_to_even() {
        // Spec §1.1: 0.25→0, 0.75→1, 1.25→1, 1.75→2, 2.5→2, 3.5→4, 5→4; above 5 → 6.
        let cases = [
            (0.25, 0),
            (0.75, 2),
            (1.25, 2),
            (1.75, 4),
            (2.5, 4),
            (3.5, 6),
            (5.0, 6),
            (5.01, 7),
        ];
        for (x, code) in cases {
            assert_eq!(e2m1_from_f32(x, TeRef), code, "{x}");
            assert_eq!(e2m1_from_f32(-x, PtxSatfinite), code | 8, "-{x}");
        }
        // One ulp above a tie rounds away.
        assert_eq!(
            e2m1_from_f32(f32::from_bits(0.25f32.to_bits() + 1), TeRef),
            1
        );
        assert_eq!(
            e2m1_from_f32(f32::from_bits(2.5f32.to_bits() - 1), TeRef),
            4
        );
    }

    #[test]
    fn fast_encode_matches_the_generic_rounding() {
        let mut u: u32 = 0;
        while u < 0x4200_0000 {
            for x in [f32::from_bits(u), -f32::from_bits(u)] {
                for conv in [TeRef, MlDtypes, PtxSatfinite] {
                    assert_eq!(
                        e2m1_from_f32(x, conv),
                        e2m1_from_f32_reference(x, conv),
                        "x = {x:e}"
                    );
                }
            }
            u += 0x0000_0FFF;
        }
        for x in [
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::MAX,
            -0.0,
            0.0,
        ] {
            for conv in [TeRef, MlDtypes, PtxSatfinite] {
                assert_eq!(
                    e2m1_from_f32(x, conv),
                    e2m1_from_f32_reference(x, conv),
                    "x = {x:e}"
                );
            }
        }
    }

    #[test]
    fn specials_follow_each_convention() {
        assert_eq!(e2m1_from_f32(-0.0, TeRef), 0);
        assert_eq!(e2m1_from_f32(-0.0, MlDtypes), 8);
        assert_eq!(e2m1_from_f32(-1e-30, TeRef), 8);
        assert_eq!(e2m1_from_f32(f32::NAN, TeRef), 0);
        assert_eq!(e2m1_from_f32(f32::NAN, MlDtypes), 8);
        assert_eq!(e2m1_from_f32(f32::NAN, PtxSatfinite), 7);
        assert_eq!(e2m1_from_f32(f32::INFINITY, TeRef), 7);
        assert_eq!(e2m1_from_f32(-1e9, TeRef), 15);
    }

    #[test]
    fn pack_puts_first_element_in_low_nibble() {
        assert_eq!(pack_fp4(&[0x1, 0xF, 0x7]), vec![0xF1, 0x07]);
        let codes: Vec<u8> = (0..37).map(|i| (i * 7 % 16) as u8).collect();
        assert_eq!(unpack_fp4(&pack_fp4(&codes), codes.len()), codes);
    }
}

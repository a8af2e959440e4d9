//! FP8 e4m3 (`float8_e4m3fn`: 4 exponent bits, bias 7, 3 mantissa bits, no infinities, NaN at
//! 0x7f and 0xff, largest finite 448) on the host: the inputs of the FP8 kernels' tests and
//! their exact values for the reference.

/// The value of an e4m3 code.
pub fn e4m3_to_f32(x: u8) -> f32 {
    let sign = if x & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = ((x >> 3) & 0xf, (x & 7) as f32);
    if e == 0xf && x & 7 == 7 {
        return f32::NAN;
    }
    let mag = if e == 0 { m / 8.0 * 2f32.powi(-6) } else { (1.0 + m / 8.0) * 2f32.powi(e as i32 - 7) };
    sign * mag
}

/// The e4m3 code nearest to `x` (saturating at ±448; NaN to 0x7f).
pub fn e4m3_from_f32(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    // Codes 0..=0x7e are the non-negative finite values in increasing order.
    let a = x.abs();
    let (mut lo, mut hi) = (0u8, 0x7eu8);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if e4m3_to_f32(mid) <= a {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    let up = (lo + 1).min(0x7e);
    let code = if (e4m3_to_f32(up) - a).abs() < (a - e4m3_to_f32(lo)).abs() { up } else { lo };
    if x.is_sign_negative() {
        code | 0x80
    } else {
        code
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_codes_and_round_trips() {
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0xc0), -2.0);
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
        for c in (0u8..=0xff).filter(|c| c & 0x7f != 0x7f) {
            assert_eq!(e4m3_from_f32(e4m3_to_f32(c)) & 0x7f, c & 0x7f, "code {c:#x}");
        }
        assert_eq!(e4m3_from_f32(1e6), 0x7e);
        assert_eq!(e4m3_from_f32(-1e6), 0xfe);
        assert_eq!(e4m3_from_f32(1.06), 0x38); // 1.0 and 1.125 are the neighbours
        assert_eq!(e4m3_from_f32(1.1), 0x39);
    }
}

//! Error measures against the f64 reference.

use distattn_core::Element;

/// Floor of the norm in relative errors: an RMS of 0.1.
///
/// Inputs are of unit scale, so O and the gradients have an RMS of order 0.1–1; the floor keeps
/// the measure meaningful where the exact result is nearly zero by cancellation (dQ when every
/// row sees a single key, where dS = P·(dP − D) ≈ 0).
pub const FLOOR: f64 = 1e-1;

/// `‖x − r‖ / max(‖r‖, FLOOR·√n)`; infinite on any NaN in `x`, or where `x` is not finite but
/// `r` is, and where infinities differ.
pub fn rel_err<T: Element>(x: &[T], r: &[f64]) -> f64 {
    assert_eq!(x.len(), r.len(), "compared tensors differ in length");
    let (mut num, mut den) = (0f64, 0f64);
    for (a, &b) in x.iter().zip(r) {
        let a = a.to_f32() as f64;
        if b.is_finite() {
            if !a.is_finite() {
                return f64::INFINITY;
            }
            num += (a - b).powi(2);
            den += b * b;
        } else if a != b {
            return f64::INFINITY;
        }
    }
    (num / den.max(FLOOR * FLOOR * r.len() as f64)).sqrt()
}

/// [`rel_err`] against an f32 result (one distributed run against a single call, say).
pub fn rel_err_f32<T: Element>(x: &[T], r: &[f32]) -> f64 {
    let r: Vec<f64> = r.iter().map(|&v| v as f64).collect();
    rel_err(x, &r)
}

/// LSE comparison: −inf exactly where the reference has −inf, [`rel_err`] over the rest.
pub fn lse_err(x: &[f32], r: &[f64]) -> f64 {
    let mut fin_x = Vec::new();
    let mut fin_r = Vec::new();
    for (&a, &b) in x.iter().zip(r) {
        if b == f64::NEG_INFINITY {
            if a != f32::NEG_INFINITY {
                return f64::INFINITY;
            }
        } else {
            fin_x.push(a);
            fin_r.push(b);
        }
    }
    if fin_r.is_empty() {
        0.0
    } else {
        rel_err(&fin_x, &fin_r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measures_fail_on_nan_and_mismatched_infinities() {
        assert_eq!(rel_err(&[1.0f32, 2.0], &[1.0, 2.0]), 0.0);
        assert!(rel_err(&[f32::NAN, 2.0], &[1.0, 2.0]).is_infinite());
        assert!(rel_err(&[1.0f32, f32::INFINITY], &[1.0, 2.0]).is_infinite());
        assert!(lse_err(&[0.0, 1.0], &[f64::NEG_INFINITY, 1.0]).is_infinite());
        assert_eq!(lse_err(&[f32::NEG_INFINITY, 1.0], &[f64::NEG_INFINITY, 1.0]), 0.0);
        // The floor: a tiny reference does not turn rounding into a large relative error.
        assert!(rel_err(&[1e-7f32], &[0.0]) < 1e-5);
        let e = rel_err_f32(&[1.0f32, 2.0], &[1.0, 2.1]);
        assert!((e - 0.1 / (1.0f64 + 4.41).sqrt()).abs() < 1e-6, "{e}");
    }
}

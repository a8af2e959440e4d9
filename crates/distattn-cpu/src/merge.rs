//! Combining partial attention results over disjoint key sets, and the backward of that.
//!
//! A partial `(O_s, LSE_s)` is the normalised output and natural-log LSE of attention over key
//! set `s`. Over disjoint sets: `LSE = log Σ exp(LSE_s)`, `O = Σ w_s O_s` with
//! `w_s = exp(LSE_s − LSE)`. Everything is f32 and shifted by the larger LSE, so nothing
//! overflows; rows no key reaches stay at `O = 0`, `LSE = −inf`, never NaN.

use distattn_core::{AttnShape, Forward, Result};

fn check(shape: &AttnShape, o: (&str, usize), lse: (&str, usize)) -> Result<()> {
    shape.validate()?;
    shape.check_len(o.0, o.1, shape.q_elems())?;
    shape.check_len(lse.0, lse.1, shape.lse_elems())
}

/// Merges the partial `(part_o, part_lse)` into the running `(acc_o, acc_lse)` in place.
/// Layouts: O `[batch, q_len, heads, head_dim]`, LSE `[batch, heads, q_len]`.
pub fn merge_into(
    acc_o: &mut [f32],
    acc_lse: &mut [f32],
    part_o: &[f32],
    part_lse: &[f32],
    shape: &AttnShape,
) -> Result<()> {
    check(shape, ("acc_o", acc_o.len()), ("acc_lse", acc_lse.len()))?;
    check(shape, ("part_o", part_o.len()), ("part_lse", part_lse.len()))?;
    let d = shape.head_dim;
    for b in 0..shape.batch {
        for i in 0..shape.q_len {
            for h in 0..shape.heads {
                let li = shape.lse_offset(b, h, i);
                let off = shape.q_offset(b, i, h);
                merge_row(&mut acc_o[off..off + d], &mut acc_lse[li], &part_o[off..off + d], part_lse[li]);
            }
        }
    }
    Ok(())
}

/// Merges one partial row (`part_o`, `part_lse`) into an accumulator row in place, shifted by
/// the larger LSE; a partial that reaches no key (LSE −inf) leaves it as is, and an accumulator
/// that has none yet takes the partial. A NaN LSE on either side (a non-finite input) makes the
/// merged row NaN.
pub fn merge_row(acc_o: &mut [f32], acc_lse: &mut f32, part_o: &[f32], part_lse: f32) {
    let (la, lb) = (*acc_lse, part_lse);
    if la.is_nan() || lb.is_nan() {
        acc_o.fill(f32::NAN);
        *acc_lse = f32::NAN;
        return;
    }
    if lb == f32::NEG_INFINITY {
        return;
    }
    if la == f32::NEG_INFINITY {
        acc_o.copy_from_slice(part_o);
        *acc_lse = lb;
        return;
    }
    let m = la.max(lb);
    let (wa, wb) = ((la - m).exp(), (lb - m).exp());
    let sum = wa + wb;
    let (wa, wb) = (wa / sum, wb / sum);
    for (x, &y) in acc_o.iter_mut().zip(part_o) {
        *x = wa * *x + wb * y;
    }
    *acc_lse = m + sum.ln();
}

/// Merges every partial into one result (no partial: O = 0, LSE = −inf everywhere).
pub fn merge(parts: &[(&[f32], &[f32])], shape: &AttnShape) -> Result<Forward> {
    shape.validate()?;
    let mut o = vec![0f32; shape.q_elems()];
    let mut lse = vec![f32::NEG_INFINITY; shape.lse_elems()];
    for (po, pl) in parts {
        merge_into(&mut o, &mut lse, po, pl, shape)?;
    }
    Ok(Forward { o, lse })
}

/// Gradients of a loss with respect to one partial `(O_s, LSE_s)` of a merge.
#[derive(Debug, Clone, PartialEq)]
pub struct PartGrads {
    /// ∂L/∂O_s, O layout: `w_s · dO`.
    pub d_o: Vec<f32>,
    /// ∂L/∂LSE_s, LSE layout: `w_s · (dO · (O_s − O) + dLSE)`.
    pub d_lse: Vec<f32>,
}

/// Backward of [`merge`] for one partial: given the merged `o`, `lse`, the upstream `d_o`
/// (and optionally an upstream gradient `d_lse` on the merged LSE), returns the gradients
/// with respect to the partial `(part_o, part_lse)`, with `w_s = exp(LSE_s − LSE)`.
///
/// (For attention itself there is a shortcut: [`crate::backward`] over the partial's key set
/// with the *merged* LSE and `D = rowsum(dO ∘ O)` gives the exact partial gradients directly.)
pub fn merge_backward(
    o: &[f32],
    lse: &[f32],
    d_o: &[f32],
    d_lse: Option<&[f32]>,
    part_o: &[f32],
    part_lse: &[f32],
    shape: &AttnShape,
) -> Result<PartGrads> {
    check(shape, ("o", o.len()), ("lse", lse.len()))?;
    check(shape, ("part_o", part_o.len()), ("part_lse", part_lse.len()))?;
    shape.check_len("d_o", d_o.len(), shape.q_elems())?;
    if let Some(g) = d_lse {
        shape.check_len("d_lse", g.len(), shape.lse_elems())?;
    }
    let d = shape.head_dim;
    let mut g_o = vec![0f32; shape.q_elems()];
    let mut g_lse = vec![0f32; shape.lse_elems()];
    for b in 0..shape.batch {
        for i in 0..shape.q_len {
            for h in 0..shape.heads {
                let li = shape.lse_offset(b, h, i);
                let (l, ls) = (lse[li], part_lse[li]);
                if l == f32::NEG_INFINITY || ls == f32::NEG_INFINITY || l.is_nan() || ls.is_nan() {
                    continue;
                }
                let w = (ls - l).exp();
                let off = shape.q_offset(b, i, h);
                let mut dot = 0f32;
                for c in 0..d {
                    g_o[off + c] = w * d_o[off + c];
                    dot += d_o[off + c] * (part_o[off + c] - o[off + c]);
                }
                g_lse[li] = w * (dot + d_lse.map_or(0.0, |g| g[li]));
            }
        }
    }
    Ok(PartGrads { d_o: g_o, d_lse: g_lse })
}
